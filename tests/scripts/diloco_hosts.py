"""One node of a two-host DiLoCo job: ``towers.train(mode="diloco:3", outer_optimizer=...)``
over Gloo, started by torchrun as a synchronous job is; rank 0 saves the result.

    torchrun --nnodes 2 --node-rank R --nproc-per-node 1 --master-addr A --master-port P \\
        diloco_hosts.py OUT
"""

import functools
import os
import sys

import torch

import towers

OUTER = functools.partial(torch.optim.SGD, lr=0.5, momentum=0.8, nesterov=True)
INNER = functools.partial(torch.optim.Adam, lr=0.03)


def build_model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(3, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))


def mse(model, shard):
    x, y = shard
    return (model(x) - y).square().mean()


def data():
    g = torch.Generator().manual_seed(6)
    return torch.randn(30, 3, generator=g), torch.randn(30, 1, generator=g)


def main():
    torch.set_num_threads(1)
    result = towers.train(
        build_model(), mse, data(), batch_size=7, steps=7, workers=2, seed=4, progress=False,
        timeout=30, transport="gloo", mode="diloco:3", optimizer=INNER, outer_optimizer=OUTER,
    )  # fmt: skip
    if os.environ["RANK"] == "0":
        torch.save({"model": result.model.state_dict(), "losses": result.losses}, sys.argv[1])


if __name__ == "__main__":
    main()
