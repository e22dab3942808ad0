"""``towers demo``: the seed's parabola trained with 1 and N local workers, in every mode, then
a problem big enough for towers to be faster than one process (:mod:`towers.tools.speed`)."""

from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from ..api.result import TrainResult
from ..api.train import train
from .plots import Curve, save_loss_panels
from .speed import measure_speed, print_speed
from .zoo import Parabola, parabola_data, parabola_loss

__all__ = ["ASYNC_DEMO_MODES", "DILOCO_DEMO_MODES", "demo"]

ASYNC_DEMO_MODES = ("async", "ssp:2", "local:4", "backup:1")
DILOCO_DEMO_MODES = ("diloco:4",)  # over all-reduce, an outer step every 4 global batches


def demo(args: argparse.Namespace) -> int:
    """Run the demo with the command line's arguments; returns the exit code."""
    data = parabola_data()
    runs: list[tuple[str, int]] = [("sync", 1), ("sync", args.workers)]
    # The asynchronous rows (one more process: the parameter server) train fewer steps to keep
    # the demo under a minute on two cores; their table rows say how many.
    runs += [(m, args.workers) for m in ASYNC_DEMO_MODES if args.workers > 1 or m != "backup:1"]
    runs += [(m, args.workers) for m in DILOCO_DEMO_MODES]
    results: list[TrainResult] = []
    print(
        f"towers demo: the parabola y = x^2 (1-5-1 tanh net, 50 points, SGD lr 0.01), "
        f"{args.steps} steps of the full batch",
        flush=True,
    )
    for mode, workers in runs:
        torch.manual_seed(args.seed)
        result = train(
            Parabola(),
            parabola_loss,
            data,
            batch_size=50,
            steps=args.steps if mode == "sync" else min(args.steps, args.async_steps),
            workers=workers,
            mode=mode,
            shuffle=False,
            seed=args.seed,
            progress=False,
        )
        results.append(result)

    print(
        f"\n{'mode':<10}{'workers':>8}{'final loss':>14}{'steps':>8}{'seconds':>10}"
        f"{'updates':>9}{'staleness':>11}{'max':>5}"
    )
    for r in results:
        stale = sum(r.staleness) / len(r.staleness) if r.staleness else 0.0
        print(
            f"{r.mode:<10}{r.workers:>8}{r.losses[-1]:>14.6f}{r.steps:>8}{r.seconds:>10.2f}"
            f"{r.updates:>9}{stale:>11.2f}{max(r.staleness, default=0):>5}"
        )
    base = results[0].losses
    for r in results[1:]:
        if r.mode != "sync":
            continue
        gap = max(abs(a - b) / max(abs(b), 1e-12) for a, b in zip(r.losses, base))
        print(
            f"\n{r.mode}, {r.workers} workers vs 1 worker: largest relative loss difference "
            f"over all steps {gap:.1e} (the same training, split over towers)"
        )
    print(
        "\nThe parabola is tiny (16 parameters, 50 samples): a step computes in microseconds, "
        "so towers' time goes to communication and hand-offs between processes, and more "
        "workers are slower than one."
    )
    if args.speed_steps > 0:
        print_speed(measure_speed(args.speed_steps), args.speed_steps)
    path = _plot(results, Path(args.out))
    print(f"\nloss curves: {path}")
    return 0


def _plot(results: Sequence[TrainResult], path: Path) -> Path:
    styles = ["-", "--", ":", "-."]

    def curves(x_of: Callable[[TrainResult], Sequence[float]]) -> list[Curve]:
        return [
            (
                x_of(r),
                r.losses,
                {
                    "linestyle": styles[i % len(styles)],
                    "label": f"{r.mode}, {r.workers} worker{'s' if r.workers > 1 else ''}",
                    "zorder": 3 if r.mode == "sync" else 2,  # the reference stays on top
                },
            )
            for i, r in enumerate(results)
        ]

    # Step k of every mode is global batch k (the asynchronous modes apply its shards one by
    # one), so samples seen compare the modes' progress per sample, and wall time their cost.
    return save_loss_panels(
        [
            ("samples seen (all towers)", curves(lambda r: [50 * (k + 1) for k in range(r.steps)])),
            ("wall time (s)", curves(lambda r: r.times)),
        ],
        path,
        title="towers demo: parabola fit",
        ylabel="mean loss over all towers",
    )
