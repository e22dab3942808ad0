"""An own-loop script that survives ``torchrun --max-restarts``: it resumes from checkpoints.

Rank 1 kills itself once, at step 5 of the first attempt; torchrun restarts every rank, which
resume from the newest checkpoint. Rank 0 saves the final parameters for the test to compare.

    torchrun --nproc-per-node 2 --max-restarts 1 restarting_loop.py DIR
"""

import os
import signal
import sys
from pathlib import Path

import torch

import towers

STEPS = 9


def global_batches():
    g = torch.Generator().manual_seed(3)
    return [(torch.randn(7, 3, generator=g), torch.randn(7, 1, generator=g)) for _ in range(STEPS)]


def build_model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(3, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))


def loss_fn(model, shard):
    x, y = shard
    return (model(x) - y).square().mean()


def main(workdir: Path) -> None:
    ctx = towers.init()
    model = ctx.replicate(build_model())
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    start, _ = ctx.load_checkpoint(workdir / "ckpt", model, opt)
    marker = workdir / "died"
    for step, shard in enumerate(ctx.shards(global_batches()[start:]), start=start):
        if step == 5 and ctx.rank == 1 and not marker.exists():
            marker.write_text(f"rank 1 died at step {step}")
            os.kill(os.getpid(), signal.SIGKILL)
        ctx.step(loss_fn(model, shard), opt)
        if (step + 1) % 2 == 0 or step + 1 == STEPS:
            ctx.save_checkpoint(workdir / "ckpt", step + 1, model, opt)
    if ctx.is_main:
        (workdir / "log").open("a").write(f"started at {start}\n")
        torch.save(model.state_dict(), workdir / "final.pt")
    ctx.close()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
