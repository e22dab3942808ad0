"""Ranks with different numbers of steps and micro-batches under ``towers.ddp``: rank 0 takes
three steps, rank 1 two, inside ``model.join()``; each step accumulates two micro-batches, the
first under ``no_sync()``, the loss divided by two as DDP scripts do. Every rank saves its
parameters and optimizer state to ``OUT/rank-R.pt``. With ``zero``, the optimizer is
``ZeroRedundancyOptimizer``'s, which a join cannot serve.

    towers run ddp_join.py -n 2 -- OUT [zero]
"""

import sys

import torch
import torch.nn as nn

import towers.ddp as dist
from towers.ddp import DistributedDataParallel as DDP
from towers.ddp import ZeroRedundancyOptimizer

# rank -> steps -> micro-batch sizes (equal within a step, as loss / 2 assumes)
SIZES = {0: [(3, 3), (3, 3), (2, 2)], 1: [(3, 3), (1, 1)]}


def batches(rank: int) -> list[list[tuple[torch.Tensor, torch.Tensor]]]:
    g = torch.Generator().manual_seed(10 + rank)
    steps = []
    for sizes in SIZES[rank]:
        steps.append(
            [(torch.randn(n, 5, generator=g), torch.randn(n, 2, generator=g)) for n in sizes]
        )
    return steps


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 2))


if __name__ == "__main__":
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    model = DDP(make_model())
    if sys.argv[2:] == ["zero"]:
        optimizer = ZeroRedundancyOptimizer(
            model.parameters(), optimizer_class=torch.optim.SGD, lr=0.1, momentum=0.9
        )
    else:
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    with model.join():
        for micro in batches(rank):
            with model.no_sync():
                x, y = micro[0]
                (nn.functional.mse_loss(model(x), y) / 2).backward()
            x, y = micro[1]
            (nn.functional.mse_loss(model(x), y) / 2).backward()
            optimizer.step()
            optimizer.zero_grad()
    state = {"model": model.module.state_dict(), "optimizer": optimizer.state_dict()}
    torch.save(state, f"{sys.argv[1]}/rank-{rank}.pt")
    dist.destroy_process_group()
