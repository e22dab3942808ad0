"""``towers.train(elastic=True)`` in a plain process: the job that tests/test_security.py attacks.

    python elastic_train.py OUT STEPS

Trains a small regression with two elastic workers (each shard's loss slowed down a little, so
that the job lasts a few seconds) and saves the trained parameters and the losses to OUT. With
``TRAIN_HOLD=FILE`` in the environment the workers wait until FILE exists before their first
shard, so that a test can act on a job that is surely running.
"""

from __future__ import annotations

import functools
import os
import sys
import time

import torch
from torch import nn

import towers


def data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    x = torch.randn(120, 3, generator=g)
    return x, (x[:, :1] * 2 - x[:, 1:2]).sin()


def build() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 8), nn.Tanh(), nn.Linear(8, 1))


def mse(model: nn.Module, shard) -> torch.Tensor:
    x, y = shard
    return (model(x) - y).square().mean()


def slow_mse(model: nn.Module, shard) -> torch.Tensor:
    hold = os.environ.get("TRAIN_HOLD")
    while hold and "RANK" in os.environ and not os.path.exists(hold):  # workers only
        time.sleep(0.02)
    time.sleep(0.03)
    return mse(model, shard)


OPTIMIZER = functools.partial(torch.optim.SGD, lr=0.05)

if __name__ == "__main__":
    torch.set_num_threads(1)
    out, steps = sys.argv[1], int(sys.argv[2])
    result = towers.train(
        build(),
        slow_mse,
        data(),
        batch_size=12,
        steps=steps,
        workers=2,
        elastic=True,
        shuffle=False,
        optimizer=OPTIMIZER,
        progress=False,
    )
    torch.save({"model": result.model.state_dict(), "losses": result.losses}, out)
