"""An own-loop DiLoCo script for ``towers run --elastic``: worker ``--victim`` is lost midway.

The victim kills itself (SIGKILL) before its ``--die-at``-th step, in the middle of a period;
every worker that finishes writes its parameters and the outer steps' results to ``--out``.
"""

from __future__ import annotations

import argparse
import os
import signal

import torch
from torch import nn

import towers


def batches(steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    out = []
    for _ in range(steps):
        x = torch.randn(21, 3, generator=g)
        out.append((x, (x[:, :1] * 2 - x[:, 1:2]).sin()))
    return out


def build() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 8), nn.Tanh(), nn.Linear(8, 1))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--victim", type=int, default=1)
    parser.add_argument("--die-at", type=int, default=5)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    torch.set_num_threads(1)
    ctx = towers.init()
    model = ctx.replicate(build(), mode="diloco:4")
    opt = torch.optim.Adam(model.parameters(), lr=0.03)
    outer = []
    for x, y in ctx.shards(batches(args.steps)):
        if int(os.environ["RANK"]) == args.victim and ctx.steps == args.die_at:
            os.kill(os.getpid(), signal.SIGKILL)
        r = ctx.step(nn.functional.mse_loss(model(x), y), opt)
        if ctx.steps % 4 == 0:  # the step that ended a period: the outer step's result
            outer.append((ctx.steps, ctx.world_size, r.tower_samples))
    ctx.end_period()
    ctx.close()
    state = {"model": model.state_dict(), "outer": outer}
    torch.save(state, os.path.join(args.out, f"final-{os.environ['RANK']}.pt"))


if __name__ == "__main__":
    main()
