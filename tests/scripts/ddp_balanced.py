"""A DDP script under ``towers.ddp`` whose loader takes towers' balanced batches; rank 1 is
the slower (its forward does more work), so it should be given the smaller share.

    towers run ddp_balanced.py -n 2 -- OUT [ACCUMULATE]

Two epochs of 2903 samples at 48 a rank (global batches of 96, the last one of 23). With
ACCUMULATE, 2807 samples (29 global batches of 96 and one of 23), each step accumulating that
many micro-batches (the first ones under ``no_sync()``, each loss divided by ACCUMULATE, the
epoch's last step holding what is left): the epoch's last step then holds a full micro-batch
and the short one. Each rank saves the dataset indices of each of its batches and the final
parameters to ``OUT/rank-R.pt``.
"""

import contextlib
import os
import sys
from pathlib import Path

import torch
import torch.nn as nn
from torch.utils.data import DataLoader, TensorDataset

import towers.ddp as dist
from towers.ddp import DistributedBatchSampler
from towers.ddp import DistributedDataParallel as DDP

SAMPLES, ACCUMULATED, BATCH, EPOCHS = 2903, 2807, 48, 2


def data(samples: int = SAMPLES) -> TensorDataset:
    g = torch.Generator().manual_seed(5)
    x = torch.randn(samples, 6, generator=g)
    y = x[:, :2] * 0.5 - x[:, 2:4] + 0.1 * torch.randn(samples, 2, generator=g)
    return TensorDataset(x, y, torch.arange(samples))


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 2))


class Slower(nn.Module):
    """The model, with some matrix work on rank 1 first: a slower device's forward."""

    def __init__(self, model: nn.Module, rank: int):
        super().__init__()
        self.model, self.rank = model, rank

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.rank == 1:
            end = torch.randn(192, 192)
            for _ in range(6):
                end = end @ end.tanh()
        return self.model(x)


def main(out: Path, accumulate: int) -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    model = DDP(Slower(make_model(), rank))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    dataset = data(ACCUMULATED if accumulate > 1 else SAMPLES)
    sampler = DistributedBatchSampler(dataset, BATCH, seed=7)
    loader = DataLoader(dataset, batch_sampler=sampler)
    batches = []
    for epoch in range(EPOCHS):
        sampler.set_epoch(epoch)
        for i, (x, y, index) in enumerate(loader):
            last = (i + 1) % accumulate == 0 or i + 1 == len(loader)
            with contextlib.nullcontext() if last else model.no_sync():
                loss = nn.functional.mse_loss(model(x), y) / accumulate
                loss.backward()
            if last:
                optimizer.step()
                optimizer.zero_grad()
            batches.append(index.tolist())
    state = {k: v.clone() for k, v in model.module.model.state_dict().items()}
    torch.save({"batches": batches, "model": state, "len": len(sampler)}, out / f"rank-{rank}.pt")
    dist.destroy_process_group()


if __name__ == "__main__":
    torch.set_num_threads(1)
    assert os.environ.get("WORLD_SIZE") == "2"
    main(Path(sys.argv[1]), int(sys.argv[2]) if len(sys.argv) > 2 else 1)
