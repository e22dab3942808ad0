"""One node of a two-host job whose hosts differ in speed (the test caps one node's share of a
core): ``towers.train`` with a balanced split, started by torchrun. Rank 0 saves the result.

    torchrun --nnodes 2 --node-rank R --nproc-per-node 1 --master-addr A --master-port P \\
        balance_hosts.py OUT
"""

import functools
import os
import sys

import torch

import towers

STEPS, BATCH = 24, 256
LR = 0.05


def build_model():
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(64, 1024), torch.nn.Tanh(), torch.nn.Linear(1024, 1024), torch.nn.Tanh(),
        torch.nn.Linear(1024, 1),
    )  # fmt: skip


def data():
    g = torch.Generator().manual_seed(6)
    x = torch.randn(STEPS * BATCH, 64, generator=g)
    return x, x[:, :1].sin()


def mse(model, shard):
    x, y = shard
    return (model(x) - y).square().mean()


def main():
    torch.set_num_threads(1)
    result = towers.train(
        build_model(), mse, data(), batch_size=BATCH, steps=STEPS, workers=2, seed=4,
        progress=False, timeout=60, transport="gloo", balance=True, shuffle=False,
        optimizer=functools.partial(torch.optim.SGD, lr=LR),
    )  # fmt: skip
    if os.environ["RANK"] == "0":
        saved = {"model": result.model.state_dict(), "shards": result.shards}
        saved["seconds"] = result.shard_seconds  # what the split followed, for a failing test
        torch.save(saved, sys.argv[1])


if __name__ == "__main__":
    main()
