"""``towers compare --link 100mbit``: the choice a user faces on a slow link, simulated here.

Trains the 784-1024-1024-10 MLP on the digits upscaled to 28x28 (held-out loss every few
global batches) with local workers, once per arm: exact sums, then each registered compression
(:data:`~towers.engines.transforms.COMPRESSIONS`, at its typical argument). The link
between the workers is **simulated**, not measured: every worker's sums of gradients wait as
long as their bytes would take through a link of its own at the given rate (a ring all-reduce
of n bytes among W workers sends ``2 (W - 1) / W * n`` bytes from each; an all-to-all
``(W - 1) / W * n``; an all-gather ``(W - 1) * n``), one message after the other, while the
computation runs for real and overlaps with the transfers as it would on a real link. What it
leaves out: latency, TCP's ramp-up after idle, start-up broadcasts and evaluations (not
delayed), and any bytes a mode moves outside the gradient transform. ``benchmarks/two_hosts.py``
measures the real thing on two network-namespace hosts (root only; docs/performance.md).

Why simulate: the demo must run for any user, anywhere, without root, namespaces or a second
machine, and give the same kind of answer each time; building namespaces and shaping a
network interface from a demo would change the machine's configuration and need root.

The simulation is a gradient transform around the arm's own (:class:`OverLink`), so it goes
through ``towers.train(transform=...)`` like any user's transform. Arms are dicts of
``towers.train`` keywords in :data:`LINK_ARMS`; ``"longer": F`` trains F times the global
batches (PowerSGD's steps make less progress than exact ones, so it needs more of them to reach
the exact run's loss), its final loss still read at the exact run's last global batch.
"""

from __future__ import annotations

import functools
import re
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ..api.train import train
from ..comm.base import Comm, Work
from ..engines.transforms import (
    COMPRESSIONS,
    Bucket,
    BucketLayout,
    GradientTransform,
    allreduce,
    compression,
)
from .zoo import cross_entropy, digits_flat, mlp

__all__ = ["LINK_ARMS", "OverLink", "SimulatedLink", "compare_link", "parse_rate"]

# PowerSGD's steps make less progress than exact ones: it trains this many times the batches
_LONGER = {"powersgd": 2}
# Each arm: a label and towers.train's keywords (compress= is wrapped in the simulated link):
# exact sums, then every registered compression at its typical argument.
LINK_ARMS: tuple[tuple[str, dict[str, Any]], ...] = (
    ("sync", {}),
    *(
        (c.typical(), {"compress": c.typical(), "longer": _LONGER.get(c.name, 1)})
        for c in COMPRESSIONS.values()
    ),
)

_UNITS = {"": 1, "k": 1e3, "m": 1e6, "g": 1e9}


def parse_rate(text: str) -> float:
    """Bits per second from ``tc``'s notation: ``"100mbit"``, ``"1gbit"``, ``"500kbit"``.

    Raises:
        ValueError: for anything else.
    """
    found = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([kmg]?)bit\s*", text.lower())
    if found is None or float(found.group(1)) <= 0:
        raise ValueError(f"a link rate is written like 100mbit, 1gbit or 500kbit; got {text!r}")
    return float(found.group(1)) * _UNITS[found.group(2)]


class _Delayed:
    """A collective's work that also waits until the simulated link has carried it."""

    def __init__(self, work: Work, until: float):
        self.work, self.until = work, until

    def wait(self) -> Any:
        out = self.work.wait()
        late = self.until - time.perf_counter()
        if late > 0:
            time.sleep(late)
        return out


class SimulatedLink:
    """``comm``'s sums, gathers and all-to-alls, each also taking its bytes' time at ``rate``.

    The link sends one message after another: a message launched while the link is busy starts
    when the one before it ends. Other collectives pass through undelayed.
    """

    def __init__(self, comm: Comm, rate: float, clock: list[float]):
        self.comm, self.rate, self.clock = comm, rate, clock
        self.rank, self.world_size, self.levels = comm.rank, comm.world_size, None

    def _after(self, work: Work, nbytes: float) -> Work:
        start = max(time.perf_counter(), self.clock[0])
        self.clock[0] = start + 8 * nbytes / self.rate
        return _Delayed(work, self.clock[0])

    def all_reduce_sum(self, tensor: torch.Tensor) -> Work:
        w = self.world_size
        nbytes = 2 * (w - 1) / w * tensor.numel() * tensor.element_size()
        return self._after(self.comm.all_reduce_sum(tensor), nbytes)

    def all_to_all(self, output: torch.Tensor, input: torch.Tensor) -> Work:
        w = self.world_size
        nbytes = (w - 1) / w * input.numel() * input.element_size()
        return self._after(self.comm.all_to_all(output, input), nbytes)

    def all_gather(self, output: torch.Tensor, input: torch.Tensor) -> Work:
        nbytes = (self.world_size - 1) * input.numel() * input.element_size()
        return self._after(self.comm.all_gather(output, input), nbytes)

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> None:
        self.comm.broadcast(tensor, src)

    def all_gather_object(self, obj: Any) -> list[Any]:
        return self.comm.all_gather_object(obj)

    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        return self.comm.broadcast_object(obj, src)

    def barrier(self) -> None:
        self.comm.barrier()

    def agree_call(self, what: str) -> None:
        self.comm.agree_call(what)

    def buffer(self, numel: int, dtype: torch.dtype) -> torch.Tensor | None:
        return self.comm.buffer(numel, dtype)

    def close(self) -> None:
        pass


class OverLink:
    """``inner`` (a gradient transform) with its collectives sent over a simulated link."""

    def __init__(self, inner: GradientTransform, rate: float):
        self.inner, self.rate = inner, rate
        self._clock = [0.0]  # this worker's link is free from then on (perf_counter seconds)

    def __repr__(self) -> str:
        return f"over_link({self.inner!r}, {self.rate:g} bit/s)"

    def init(self, layouts: Sequence[BucketLayout]) -> Any:
        return self.inner.init(layouts)

    def reduce(self, state: Any, bucket: Bucket, comm: Comm) -> tuple[Bucket, Any]:
        return self.inner.reduce(state, bucket, SimulatedLink(comm, self.rate, self._clock))


@dataclass
class LinkRun:
    label: str
    steps: int  # global batches trained
    ms_per_step: float
    final: float  # held-out loss after the exact run's last global batch
    reached: float | None  # seconds until the held-out loss reached the target


SGD = functools.partial(torch.optim.SGD, lr=0.05, momentum=0.9)


def _problem() -> tuple[Any, Any]:
    x, y = digits_flat()
    order = torch.randperm(len(x), generator=torch.Generator().manual_seed(0))
    return (x[order[:-300]], y[order[:-300]]), (x[order[-300:]], y[order[-300:]])


def compare_link(
    rate: str = "100mbit",
    *,
    workers: int = 2,
    steps: int = 100,
    every: int = 5,
    arms: Sequence[tuple[str, dict[str, Any]]] = LINK_ARMS,
    print_fn: Callable[[str], None] = print,
) -> list[LinkRun]:
    """Train every arm over a simulated link of ``rate``; print and return the table."""
    bits = parse_rate(rate)
    every = max(1, min(every, steps))  # a run shorter than ``every`` is evaluated at its end
    data, held = _problem()
    print_fn(
        f"towers compare --link {rate}: the 784-1024-1024-10 MLP on the digits upscaled to "
        f"28x28, {workers} workers, global batches of 256, SGD, {steps} global batches.\n"
        f"SIMULATED link: each worker's gradient sums wait as long as their bytes take at "
        f"{rate} (real computation, no latency modelled); benchmarks/two_hosts.py measures "
        "real hosts."
    )
    results = []
    for label, keywords in arms:
        options = dict(keywords)
        inner = compression(options.pop("compress")) if "compress" in options else allreduce()
        longer = options.pop("longer", 1)
        torch.manual_seed(0)
        r = train(
            mlp(), cross_entropy, data, batch_size=256, steps=int(steps * longer), workers=workers,
            optimizer=SGD, seed=0, progress=False, eval_data=held, eval_every=every,
            transform=OverLink(inner, bits), **options,
        )  # fmt: skip
        results.append((label, r))
        print_fn(f"  {label}: {r.seconds:.1f} s")
    target = results[0][1].evals[-1][1]["loss"]
    runs = [_summary(label, r, target, steps) for label, r in results]
    print_fn("")
    for line in link_table(runs, target, results[0][0]):
        print_fn(line)
    return runs


def _summary(label: str, r: Any, target: float, steps: int) -> LinkRun:
    reached = [k for k, m in r.evals if m["loss"] <= target * 1.001]
    ms = 1e3 * r.seconds / r.steps
    final = [m["loss"] for k, m in r.evals if k <= steps][-1]  # at the exact run's last one
    return LinkRun(label, r.steps, ms, final, r.times[reached[0] - 1] if reached else None)


def link_table(runs: Sequence[LinkRun], target: float, reference: str) -> list[str]:
    """The table: time per step, final held-out loss, time to ``reference``'s final loss."""
    reach_head = f"time to {target:.3f}"
    head = (
        f"{'arm':<14}{'steps':>6}{'ms/step':>9}{'final loss':>12}{reach_head:>16}{'speed-up':>10}"
    )
    lines = [head, "-" * len(head)]
    base = runs[0].reached
    for run in runs:
        reach = "never" if run.reached is None else f"{run.reached:.1f} s"
        speed = f"{base / run.reached:.1f}x" if base and run.reached else "-"
        lines.append(
            f"{run.label:<14}{run.steps:>6}{run.ms_per_step:>9.0f}{run.final:>12.4f}{reach:>16}"
            f"{speed:>10}"
        )
    lines.append(
        f"(time to {reference}'s final held-out loss, within 0.1%, over a simulated link; "
        f"final loss after {runs[0].steps} global batches in every arm)"
    )
    return lines
