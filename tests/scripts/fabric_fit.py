"""lightning_fit.py's training in a loop of one's own under ``Fabric(strategy=STRATEGY)``: the
same data, model, clipping and schedule; rank 0 saves the parameters to OUT.

    python fabric_fit.py STRATEGY DEVICES BATCH_PER_RANK OUT
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
    fabric = Fabric(strategy=strategy, accelerator="cpu", devices=devices)
    fabric.launch()
    net = make_net()
    optimizer, schedule = optimizer_and_schedule(net.parameters())
    model, optimizer = fabric.setup(net, optimizer)
    loader = fabric.setup_dataloaders(DataLoader(dataset(), batch_size=batch, shuffle=True))
    for epoch in range(EPOCHS):
        loader.sampler.set_epoch(epoch)
        for x, y in loader:
            fabric.backward(nn.functional.mse_loss(model(x), y))
            fabric.clip_gradients(model, optimizer, max_norm=CLIP)
            optimizer.step()
            optimizer.zero_grad()
        schedule.step()
    if fabric.global_rank == 0:
        torch.save({"model": net.state_dict()}, out)
