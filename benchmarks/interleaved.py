"""towers' synchronous step against DDP's, alternated block by block inside the same processes.

On a machine that other people use, the load changes from one second to the next, and two arms
timed even a few seconds apart (``towers bench``, one arm after the other) can differ by 2x
for that reason alone. Here every worker holds both a DistributedDataParallel model and a
towers model (``ctx.replicate``) and alternates: a block of DDP steps, a block of towers steps,
again and again; each pair of neighbouring blocks gives one ratio, and the report is their
median. ``--policies`` adds towers arms whose shared-memory barriers wait another way
(``yield-1ms``: poll with ``sched_yield`` for 1 ms before sleeping, the earlier default;
``sleep``: sleep at once), in the same rotation.

Run it from the repository root::

    python benchmarks/interleaved.py --model mlp -n 2 --load 1 --pairs 20
    python benchmarks/interleaved.py --model mlp -n 2 --load 1 --policies adaptive,yield-1ms,sleep
    python benchmarks/interleaved.py --model mlp -n 2 --compress int8   # towers compresses
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from typing import Any

import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

import towers
from towers.comm import wait
from towers.tools import bench
from towers.tools.load import busy


class _YieldPoll(wait.Waiter):
    """The earlier wait: poll with sched_yield for 1 ms, then sleep."""

    def poll(self, need: int) -> int:
        stop = time.perf_counter() + 1e-3
        while need:
            if self.sem.acquire(False):
                need -= 1
            elif time.perf_counter() < stop:
                os.sched_yield()
            else:
                break
        return need


def _worker(
    name: str, policies: list[str], pairs: int, block: int, compress: str | None
) -> dict[str, list[float]]:
    ctx = towers.init(transport="shm")
    world, rank = ctx.world_size, ctx.rank
    shards = [towers.split(b, world)[rank] for b in bench._batches(name)]
    ddp = DistributedDataParallel(bench._build(name))
    ddp_opt = bench._sgd(ddp.parameters())
    ours = ctx.replicate(bench._build(name), compress=compress)
    ours_opt = bench._sgd(ours.parameters())
    comm: Any = ctx.comm
    sem = comm._mine

    def ddp_step(i: int) -> None:
        ddp_opt.zero_grad(set_to_none=True)
        bench.ce_loss(ddp, shards[i % len(shards)]).backward()
        ddp_opt.step()

    def towers_step(i: int) -> None:
        shard = shards[i % len(shards)]
        ctx.step(bench.ce_loss(ours, shard), ours_opt, samples=len(shard[0]))

    waiters = {
        "adaptive": wait.Waiter(sem),
        "yield-1ms": _YieldPoll(sem),
        "sleep": wait.Waiter(sem, spin=0.0),
    }
    arms = ["ddp", *policies]
    times: dict[str, list[float]] = {a: [] for a in arms}
    for p in range(pairs + 1):  # the first round warms up
        for arm in arms[p % len(arms) :] + arms[: p % len(arms)]:
            if arm != "ddp":
                comm._waiter = waiters[arm]
            step = ddp_step if arm == "ddp" else towers_step
            dist.barrier()
            start = time.perf_counter()
            for i in range(block):
                step(i)
            dist.barrier()
            if p:
                times[arm].append((time.perf_counter() - start) / block)
    ctx.close()
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="mlp", choices=sorted(bench.MODELS))
    parser.add_argument("-n", "--workers", type=int, default=2)
    parser.add_argument("--load", type=int, default=0, help="busy processes beside the run")
    parser.add_argument("--pairs", type=int, default=20, help="rounds of blocks")
    parser.add_argument("--block", type=int, default=5, help="steps per block")
    parser.add_argument("--policies", default="adaptive")
    parser.add_argument("--compress", default=None, help="towers' compression, e.g. int8")
    args = parser.parse_args()
    policies = args.policies.split(",")
    before = os.getloadavg()[0]
    with busy(args.load):
        times = towers.spawn(
            _worker,
            args.workers,
            args.model,
            policies,
            args.pairs,
            args.block,
            args.compress,
            timeout=590,
        )[0]
    print(
        f"{args.model}, {args.workers} workers, {args.load} busy processes beside them; "
        f"1-minute load average {before:.2f} before, {os.getloadavg()[0]:.2f} after; "
        f"{args.pairs} rounds of {args.block}-step blocks; towers' compression: {args.compress}"
    )
    print(f"{'arm':<22}{'ms/step':>10}{'x DDP':>8}   (x DDP: median of the per-round ratios)")
    for arm, values in times.items():
        ratio = statistics.median(a / b for a, b in zip(values, times["ddp"]))
        label = "ddp" if arm == "ddp" else f"towers, wait {arm}"
        print(f"{label:<22}{statistics.median(values) * 1e3:>10.2f}{ratio:>8.2f}")


if __name__ == "__main__":
    main()
