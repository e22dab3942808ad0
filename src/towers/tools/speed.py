"""The demo's speed section: a problem big enough for towers to pay off, measured, not claimed.

The parabola trains in microseconds per step, so its towers spend their time communicating and
are slower than one process. This section trains :func:`~towers.tools.zoo.mlp` (1.86 M
parameters) on a batch of 1024 random samples three ways — one process with one thread, one
process with as many threads as there are cores, and towers with one single-threaded worker per
core (2 to 4) — and prints the median time of a step of each side by side.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass

import torch

from ..api.train import train
from ..processes.env import cpu_count
from .zoo import cross_entropy, mlp

__all__ = ["SpeedRow", "measure_speed", "print_speed"]

BATCH = 1024


@dataclass(frozen=True)
class SpeedRow:
    label: str
    seconds: float  # the median step
    final_loss: float


def _run(
    threads: int, workers: int, steps: int, data: tuple[torch.Tensor, torch.Tensor]
) -> tuple[float, float]:
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        torch.manual_seed(0)
        result = train(
            mlp(), cross_entropy, data, batch_size=BATCH, steps=steps, workers=workers,
            shuffle=False, progress=False,
        )  # fmt: skip
    finally:
        torch.set_num_threads(before)
    # The median step, not the total: a burst of other work on the machine stretches a few
    # steps, not the typical one. The first step (warm-up) is left out.
    steps_s = [b - a for a, b in zip(result.times, result.times[1:])]
    return statistics.median(steps_s or [result.seconds]), result.losses[-1]


def measure_speed(steps: int) -> list[SpeedRow]:
    """Train the MLP for ``steps`` global batches each way; rows in the order printed."""
    g = torch.Generator().manual_seed(0)
    data = (
        torch.randn(2 * BATCH, 784, generator=g),
        torch.randint(0, 10, (2 * BATCH,), generator=g),
    )
    cores = min(4, max(2, cpu_count()))  # a short demo: at most 4 workers
    rows = []
    for label, threads, workers in [
        ("1 process, 1 thread", 1, 1),
        (f"1 process, {cores} threads", cores, 1),
        (f"towers, {cores} workers x 1 thread", 1, cores),
    ]:
        seconds, loss = _run(threads, workers, steps, data)
        rows.append(SpeedRow(label, seconds, loss))
    return rows


def print_speed(rows: list[SpeedRow], steps: int) -> None:
    one, threads, towers = rows
    print(
        f"\nspeed: an MLP 784-1024-1024-10 (1.86 M parameters), global batch {BATCH}, {steps} steps"
    )
    print(f"{'':<34}{'s/step':>9}{'final loss':>12}{'vs 1 thread':>13}")
    for r in rows:
        print(
            f"{r.label:<34}{r.seconds:>9.2f}{r.final_loss:>12.4f}{one.seconds / r.seconds:>12.2f}x"
        )
    ratio = one.seconds / towers.seconds
    if towers.seconds < one.seconds:
        verdict = (
            f"Here towers is {ratio:.2f}x as fast as one process with one thread: each worker "
            "computes its part of every batch on its own core, and averaging 1.86 M gradients "
            "through shared memory takes a few milliseconds against the "
            f"{one.seconds * 1000:.0f} ms one thread computes per step."
        )
    else:
        verdict = (
            f"Here towers was not faster than one process with one thread ({ratio:.2f}x): its "
            "workers need a core each, and other processes on this machine held them (see "
            "`uptime`); on idle cores each worker computes its part of every batch in parallel."
        )
    print(
        f"{verdict} Threads in one process split the work inside each matrix product instead "
        f"({one.seconds / threads.seconds:.2f}x here). Times vary with what else runs."
    )
