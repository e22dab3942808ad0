"""ddp_balanced.py's training in a Fabric loop under ``Fabric(strategy="towers", devices=2)``:
the training loader takes towers' ``DistributedBatchSampler`` (set up without Fabric's own
sampler), so rank 1, whose forward does more work, is given the smaller share of each global
batch. Each rank saves the dataset indices of its batches and its final parameters to
``OUT/rank-R.pt``.

    python fabric_balanced.py OUT
"""

import sys
from pathlib import Path

import torch
import torch.nn as nn
from lightning.fabric import Fabric
from torch.utils.data import DataLoader

import towers.lightning  # noqa: F401  (registers "towers")
from towers.ddp import DistributedBatchSampler

sys.path.insert(0, str(Path(__file__).resolve().parent))
from ddp_balanced import BATCH, EPOCHS, Slower, data, make_model

if __name__ == "__main__":
    torch.set_num_threads(1)
    fabric = Fabric(strategy="towers", accelerator="cpu", devices=2)
    fabric.launch()
    net = make_model()
    model, optimizer = fabric.setup(
        Slower(net, fabric.global_rank), torch.optim.SGD(net.parameters(), lr=0.05)
    )
    dataset = data()
    sampler = DistributedBatchSampler(dataset, BATCH, seed=7)  # balance=None: where exact
    loader = fabric.setup_dataloaders(
        DataLoader(dataset, batch_sampler=sampler), use_distributed_sampler=False
    )
    batches = []
    for epoch in range(EPOCHS):
        sampler.set_epoch(epoch)
        for x, y, index in loader:
            fabric.backward(nn.functional.mse_loss(model(x), y))
            optimizer.step()
            optimizer.zero_grad()
            batches.append(index.tolist())
    state = {k: v.clone() for k, v in net.state_dict().items()}
    torch.save(
        {"batches": batches, "model": state}, Path(sys.argv[1], f"rank-{fabric.global_rank}.pt")
    )
