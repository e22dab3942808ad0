"""lightning_fit.py's training in a loop of one's own under ``Fabric(strategy=STRATEGY)``: the
same data, model, clipping and schedule; rank 0 saves the parameters to OUT. ``ACCUMULATE``
(default 1): micro-batches a step, all but the last under ``fabric.no_backward_sync``, each
loss divided by their number.

    python fabric_fit.py STRATEGY DEVICES BATCH_PER_RANK OUT [ACCUMULATE]
"""

import sys
from pathlib import Path

import torch
import torch.nn as nn
from lightning.fabric import Fabric
from torch.utils.data import DataLoader

import towers.lightning  # noqa: F401  (registers "towers")

sys.path.insert(0, str(Path(__file__).resolve().parent))
from lightning_fit import CLIP, EPOCHS, dataset, make_net, optimizer_and_schedule

if __name__ == "__main__":
    strategy, devices, batch, out = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    accumulate = int(sys.argv[5]) if len(sys.argv) > 5 else 1
    fabric = Fabric(strategy=strategy, accelerator="cpu", devices=devices)
    fabric.launch()
    net = make_net()
    optimizer, schedule = optimizer_and_schedule(net.parameters())
    model, optimizer = fabric.setup(net, optimizer)
    loader = fabric.setup_dataloaders(DataLoader(dataset(), batch_size=batch, shuffle=True))
    for epoch in range(EPOCHS):
        loader.sampler.set_epoch(epoch)
        for k, (x, y) in enumerate(loader):
            last = (k + 1) % accumulate == 0 or k + 1 == len(loader)
            with fabric.no_backward_sync(model, enabled=not last):
                fabric.backward(nn.functional.mse_loss(model(x), y) / accumulate)
            if not last:
                continue
            fabric.clip_gradients(model, optimizer, max_norm=CLIP)
            optimizer.step()
            optimizer.zero_grad()
        schedule.step()
    if fabric.global_rank == 0:
        torch.save({"model": net.state_dict()}, out)
