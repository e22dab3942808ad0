"""``towers demo``: the seed's parabola trained with 1 and N local workers, in every mode, then
a problem big enough for towers to be faster than one process (:mod:`towers.tools.speed`)."""

from __future__ import annotations

import argparse
import textwrap
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
    short = min(args.steps, args.async_steps)
    print(
        f"towers demo: the parabola y = x^2 (1-5-1 tanh net, 50 points, SGD lr 0.01); a step is "
        f"one global batch of all 50 points.\nThe sync rows train {args.steps} steps (--steps), "
        f"the others {short} (--async-steps): the asynchronous ones run one more process, "
        "the\nparameter server, which answers the towers' shards one at a time, so their steps "
        f"cost more; {short} steps keep\nthe demo near a minute on two cores (diloco, over "
        "all-reduce, is cut as short to compare with them).",
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

    _table(results)
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


def _table(results: Sequence[TrainResult]) -> None:
    """The results, then what each column and row means, in the table's own words."""
    reference = results[-1 if len(results) == 1 else 1].losses  # sync with the most workers
    print(
        f"\n{'mode':<10}{'workers':>8}{'final loss':>12}{'steps':>7}{'updates':>9}"
        f"{'seconds':>9}{'stale avg':>11}{'stale max':>11}{'sync, same step':>17}"
    )
    for r in results:
        stale = sum(r.staleness) / len(r.staleness) if r.staleness else 0.0
        print(
            f"{r.mode:<10}{r.workers:>8}{r.losses[-1]:>12.6f}{r.steps:>7}{r.updates:>9}"
            f"{r.seconds:>9.2f}{stale:>11.2f}{max(r.staleness, default=0):>11}"
            f"{reference[r.steps - 1]:>17.6f}"
        )
    workers = results[-1].workers
    print(
        "\n  final loss       the mean loss over all towers at the last step, before its update"
        "\n  steps            global batches trained on (all 50 points each)"
        "\n  updates          parameter updates applied: one per step in sync and backup, one "
        f"per shard (up to {workers} a step)\n                   in async and ssp, each "
        "worker's own steps in local"
        "\n  seconds          the training loop's wall time, without starting processes"
        "\n  stale avg, max   updates applied between a tower reading the parameters and its "
        "gradient being\n                   applied: the mean and the largest (0 when "
        "synchronous)"
        f"\n  sync, same step  the loss of sync, {workers} workers, after as many steps: the fair "
        "comparison\n                   for the shorter asynchronous rows"
        "\n\n  sync             one update per step from the gradient averaged over every tower"
        "\n  async            the server applies each tower's gradient as it arrives, however "
        "stale"
        "\n  ssp:2            as async, but no tower runs more than 2 updates ahead of the "
        "slowest"
        "\n  local:4          each tower steps alone on its shard; parameters are averaged "
        "every 4 steps"
        f"\n  backup:1         synchronous, but each step applies the first {workers - 1} of "
        f"{workers} shards to arrive"
        "\n  diloco:4         each tower steps alone; every 4 steps an outer optimizer (Nesterov "
        "SGD)\n                   applies the towers' averaged progress to the shared parameters"
    )
    print("\n" + _why(results, reference))


def _why(results: Sequence[TrainResult], reference: Sequence[float]) -> str:
    """Why the shorter rows end where they do, with their numbers."""
    one_a_step = [r for r in results if r.mode.split(":")[0] in ("local", "backup")]
    per_shard = [r for r in results if r.mode.split(":")[0] in ("async", "ssp")]
    if not one_a_step and not per_shard:
        return ""
    sync_steps, short = results[0].steps, (one_a_step or per_shard)[0].steps
    lines = [
        f"The rows through the parameter server ran {short} steps, sync {sync_steps}; after "
        f"{short} steps sync was at {reference[short - 1]:.4f}."
    ]
    if one_a_step:
        names = " and ".join(f"{r.mode} ({r.losses[-1]:.4f})" for r in one_a_step)
        lines.append(
            f"{names} end higher than sync's last row: like sync, each of their steps moves "
            "about one step's worth (local: the towers' small steps averaged; backup: the "
            "average of the shards that came first)."
        )
    if any(r.mode.startswith("backup") for r in one_a_step):
        lines.append(
            "backup also leaves out each step's late shard: the points are in order, so a "
            "dropped shard is a whole stretch of the curve, and the fit lags there."
        )
    if per_shard:
        names = " and ".join(f"{r.mode} ({r.updates} updates)" for r in per_shard)
        lines.append(
            f"{names} apply every shard's gradient as an update of its own, several a step, "
            "so their shorter runs get further."
        )
    for r in results:
        if r.mode.startswith("diloco") and r.losses[-1] < reference[r.steps - 1]:
            lines.append(
                f"{r.mode} ({r.losses[-1]:.4f}) ends lower than sync after as many steps: its "
                "outer step, with momentum, moves further than one step's worth."
            )
    # indented, as the legend: no line of it may read as a row of the table
    return textwrap.fill(" ".join(lines), width=98, initial_indent="  ", subsequent_indent="  ")


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
