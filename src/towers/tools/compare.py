"""``towers compare``: one problem trained in every mode, with and without a straggler.

Seed 003's answer in numbers: synchronous steps wait for the slowest tower, asynchronous updates
never wait but apply stale gradients. Each run reports its updates, the final loss of the trained
model on the whole data set, the wall time until the per-step loss first reached a target,
staleness, and updates per second; a PNG shows loss against wall time.
"""

from __future__ import annotations

import functools
import math
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..api.result import TrainResult
from ..api.train import train
from .plots import save_loss_plot
from .zoo import CNN, Parabola, cross_entropy, digits_data, parabola_data, parabola_loss

__all__ = ["PROBLEMS", "compare"]


@dataclass(frozen=True)
class Problem:
    model: Callable[[], torch.nn.Module]
    data: Callable[[], Any]
    loss: Any
    batch_size: int
    steps: int
    optimizer: Any
    title: str


def _problems() -> dict[str, Problem]:
    return {
        "parabola": Problem(
            Parabola, parabola_data, parabola_loss, 50, 500,
            functools.partial(torch.optim.SGD, lr=0.01),
            "parabola y = x^2 (1-5-1 tanh net, 50 points, full batch, SGD lr 0.01)",
        ),
        "digits": Problem(
            CNN, digits_data, cross_entropy, 64, 300,
            # plain SGD: with momentum 0.9 the asynchronous modes diverged (docs/async.md)
            functools.partial(torch.optim.SGD, lr=0.1),
            "8x8 digits CNN (1797 images, batches of 64, SGD lr 0.1)",
        ),
    }  # fmt: skip


PROBLEMS = ("parabola", "digits")


@dataclass
class Run:
    mode: str
    straggle: dict[int, float]
    result: TrainResult
    final: float  # loss of the trained model on all the data

    @property
    def label(self) -> str:
        if not self.straggle:
            return self.mode
        (t, f), *_ = self.straggle.items()
        return f"{self.mode}, tower {t} {f:g}x slower"

    def time_to(self, target: float) -> float:
        for loss, t in zip(self.result.losses, self.result.times):
            if loss <= target:
                return t
        return math.nan

    @property
    def updates_per_second(self) -> float:
        return self.result.updates / self.result.seconds


BALANCED = "+balance"  # a mode label's suffix: the same mode, with balance=True


def mode_of(label: str) -> tuple[str, bool | None]:
    """The mode and ``balance=`` a row label asks for: ``"sync+balance"`` balances; plain
    ``"sync"`` keeps the even split, so that the straggler's cost shows beside it."""
    if label.endswith(BALANCED):
        return label[: -len(BALANCED)], True
    return label, (False if label == "sync" else None)


def compare(
    problem: str = "parabola",
    *,
    workers: int = 4,
    steps: int | None = None,
    modes: Sequence[str] = ("sync", "async", "ssp:2", "local:4", "backup:1", "diloco:4"),
    straggler: int = 1,
    factor: float = 3.0,
    target: float | None = None,
    seed: int = 0,
    out: str | Path = "towers-compare/loss.png",
    print_fn: Callable[[str], None] = print,
) -> list[Run]:
    """Train ``problem`` in every mode, without and with tower ``straggler`` ``factor`` x slower.

    ``target`` defaults to 1.1 x the last per-step loss of sync without a straggler.
    """
    p = _problems()[problem]
    steps = steps or p.steps
    data = p.data()
    print_fn(f"towers compare: {p.title}; {workers} workers, {steps} global batches per run")
    runs = []
    for mode in modes:
        name, balance = mode_of(mode)
        for straggle in ({}, {straggler: factor}):
            torch.manual_seed(seed)
            r = train(
                p.model(), p.loss, data, batch_size=p.batch_size, steps=steps, workers=workers,
                mode=name, optimizer=p.optimizer, seed=seed, progress=False, straggle=straggle,
                balance=balance,
            )  # fmt: skip
            with torch.no_grad():
                final = float(p.loss(r.model, data))
            runs.append(Run(mode, straggle, r, final))
            print_fn(f"  {runs[-1].label}: {r.seconds:.2f} s")
    if target is None:
        ref = next((r for r in runs if r.mode == "sync" and not r.straggle), runs[0])
        target = 1.1 * ref.result.losses[-1]
    print_fn("")
    for line in table(runs, target):
        print_fn(line)
    print_fn("")
    for line in straggler_summary(runs, straggler, factor):
        print_fn(line)
    path = plot(runs, Path(out), p.title)
    print_fn(f"\nloss against wall time: {path}")
    return runs


def table(runs: Sequence[Run], target: float) -> list[str]:
    w = max([10, *(len(r.mode) + 1 for r in runs)])  # diloco:H:overlap:P is long
    head = (
        f"{'mode':<{w}}{'straggler':>10}{'updates':>9}{'final loss':>12}"
        f"{f'time to {target:.3g}':>16}{'staleness':>11}{'max':>5}{'updates/s':>11}"
        f"{'batches/s':>11}{'dropped':>9}"
    )
    lines = [head, "-" * len(head)]
    for run in runs:
        r = run.result
        reach = run.time_to(target)
        stale = statistics.fmean(r.staleness) if r.staleness else 0.0
        slow = "-" if not run.straggle else f"{max(run.straggle.values()):g}x"
        lines.append(
            f"{run.mode:<{w}}{slow:>10}"
            f"{r.updates:>9}{run.final:>12.4g}"
            f"{(f'{reach:.2f} s' if math.isfinite(reach) else 'not reached'):>16}"
            f"{stale:>11.2f}{max(r.staleness, default=0):>5}{run.updates_per_second:>11.0f}"
            f"{r.steps / r.seconds:>11.0f}{len(r.dropped):>9}"
        )
    return lines


def straggler_summary(runs: Sequence[Run], straggler: int, factor: float) -> list[str]:
    slow = {r.mode: r for r in runs if r.straggle}
    if "sync" not in slow:
        return []
    base = slow["sync"].updates_per_second
    lines = [f"with tower {straggler} {factor:g}x slower, updates/s relative to sync:"]
    w = max([10, *(len(m) + 1 for m in slow)])
    for mode, r in slow.items():
        if mode != "sync":
            lines.append(f"  {mode:<{w}}{r.updates_per_second / base:6.2f}x")
    return lines


def plot(runs: Sequence[Run], path: Path, title: str) -> Path:
    colors: dict[str, str] = {}
    curves = [
        (
            run.result.times,
            run.result.losses,
            {
                "linestyle": "--" if run.straggle else "-",
                "color": colors.setdefault(run.mode, f"C{len(colors)}"),
                "label": run.label,
                "linewidth": 1,
            },
        )
        for run in runs
    ]
    return save_loss_plot(
        curves,
        path,
        title=f"towers compare: {title}",
        xlabel="wall time (s)",
        ylabel="loss per global batch",
        size=(8, 5),
        fontsize=9,
    )
