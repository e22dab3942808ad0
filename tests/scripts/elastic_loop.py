"""An own-loop script for ``towers run --elastic``: the test loses one of its workers midway.

Each worker grows its file in ``--progress`` by a byte per step (so the test can pick a moment
and a victim), and every worker that finishes writes its final parameters and the losses to
``--out``, with the towers of each step and when it completed. The loop only adds
``if r.redo: continue`` to the usual own loop. With ``--hold FILE`` every worker waits after
four steps until FILE exists, so that a test can look at a job that is surely running, and
each worker leaves ``replicating-RANK`` in ``--out`` once ``towers.init`` has returned (a
newcomer is let in from ``ctx.replicate``, at the members' next step).
"""

from __future__ import annotations

import argparse
import os
import time

import torch
from torch import nn

import towers


def batches(steps: int, seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        x = torch.randn(29, 3, generator=g)
        out.append((x, (x[:, :1] * 2 - x[:, 1:2]).sin()))
    return out


def build(batchnorm: bool = False, hidden: int = 8) -> nn.Module:
    torch.manual_seed(0)
    norm = [nn.BatchNorm1d(hidden)] if batchnorm else []
    return nn.Sequential(nn.Linear(3, hidden), *norm, nn.Tanh(), nn.Linear(hidden, 1))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--sleep", type=float, default=0.03, help="seconds per step")
    parser.add_argument("--progress", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--batchnorm", action="store_true", help="with sync_batchnorm=True")
    parser.add_argument("--timeout", type=float, default=None, help="towers.init(timeout=)")
    parser.add_argument("--hold", default=None, help="after 4 steps, wait until this file exists")
    parser.add_argument("--hidden", type=int, default=8, help="another model than the job's")
    parser.add_argument("--compress", default=None, help="ctx.replicate(compress=)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    ctx = towers.init(timeout=args.timeout)
    if args.hold:  # the test may go on once every worker is about to build its model
        open(os.path.join(args.out, f"replicating-{os.environ['RANK']}"), "w").close()
    model = ctx.replicate(
        build(args.batchnorm, args.hidden), sync_batchnorm=args.batchnorm, compress=args.compress
    )
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    losses, world, times = [], [], []
    mine = os.path.join(args.progress, f"{os.environ['RANK']}-{os.getpid()}")
    for x, y in ctx.shards(batches(args.steps)):
        while args.hold and len(losses) == 4 and not os.path.exists(args.hold):
            time.sleep(0.02)  # the test looks at the running job, then lets it go on
        with open(mine, "a") as f:
            f.write(".")
        time.sleep(args.sleep)
        towers_now = ctx.world_size
        r = ctx.step(nn.functional.mse_loss(model(x), y), opt)
        if r.redo:  # a peer was lost: the same global batch comes again, re-split
            continue
        losses.append(r.loss)
        world.append(towers_now)
        times.append(time.time())
    ctx.close()
    torch.save(
        {
            "model": model.state_dict(),
            "losses": losses,
            "steps": ctx.steps,
            "world": world,  # towers per completed step, as this worker saw them
            "times": times,  # when each completed
        },
        os.path.join(args.out, f"final-{os.environ['RANK']}.pt"),
    )


if __name__ == "__main__":
    main()
