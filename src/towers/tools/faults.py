"""``towers demo --faults``: lose a worker midway through an elastic run; nothing changes.

Trains the seed's parabola three times with ``elastic=True``: once undisturbed, once with a
worker killed (SIGKILL) a third of the way in, and once with a worker hung (SIGSTOP) there and a
replacement let in. The faults come from outside, as in life: a thread here watches the
workers' progress (the loss function leaves one small file per worker process) and signals one
of them. Prints what each run saw and the largest relative difference of the final parameters
from the undisturbed run's, and draws the loss curves.
"""

from __future__ import annotations

import argparse
import functools
import os
import signal
import tempfile
import threading
import time
from pathlib import Path

import torch
from torch import nn

from ..api.result import TrainResult
from ..api.train import train
from .plots import save_loss_plot
from .zoo import Parabola, parabola_data, parabola_loss

__all__ = ["faults_demo", "progress_loss"]


def progress_loss(progress: str, model: nn.Module, shard: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """The parabola's loss; also grows this worker's file in ``progress`` by a byte."""
    who = os.environ.get("RANK", "caller")
    with open(os.path.join(progress, f"{who}-{os.getpid()}"), "ab") as f:
        f.write(b".")
    return parabola_loss(model, shard)  # type: ignore[arg-type]


def _strike(progress: Path, calls: int, sig: signal.Signals, done: threading.Event) -> None:
    """Send ``sig`` to worker 1 once the workers have made ``calls`` loss calls in all."""
    while not done.wait(0.005):
        files = [f for f in progress.iterdir() if not f.name.startswith("caller")]
        if sum(f.stat().st_size for f in files) >= calls:
            victims = [f for f in files if f.name.startswith("1-")]
            if victims:
                os.kill(int(victims[0].name.split("-")[1]), sig)
                return


def _run(args: argparse.Namespace, fault: signal.Signals | None, restarts: int) -> TrainResult:
    with tempfile.TemporaryDirectory(prefix="towers-faults-") as progress:
        done = threading.Event()
        if fault is not None:
            calls = args.steps * args.workers // 3
            threading.Thread(
                target=_strike, args=(Path(progress), calls, fault, done), daemon=True
            ).start()
        torch.manual_seed(args.seed)
        try:
            return train(
                Parabola(),
                functools.partial(progress_loss, progress),
                parabola_data(),
                batch_size=50,
                steps=args.steps,
                workers=args.workers,
                shuffle=False,
                seed=args.seed,
                progress=False,
                elastic=True,
                max_restarts=restarts,
            )
        finally:
            done.set()


def _max_relative_difference(a: nn.Module, b: nn.Module) -> float:
    return max(
        float((p - q).detach().abs().max() / q.detach().abs().max().clamp_min(1e-12))
        for p, q in zip(a.parameters(), b.parameters(), strict=True)
    )


def faults_demo(args: argparse.Namespace) -> int:
    """Run ``towers demo --faults``; returns the exit code."""
    if args.workers < 2:
        print("towers demo --faults: needs -n 2 or more workers", flush=True)
        return 2
    print(
        f"towers demo --faults: the parabola, {args.steps} steps, {args.workers} workers, "
        "elastic=True; worker 1 is lost a third of the way in",
        flush=True,
    )
    began = time.perf_counter()
    runs = [
        ("undisturbed", _run(args, None, 0)),
        ("SIGKILL, not replaced", _run(args, signal.SIGKILL, 0)),
        ("SIGSTOP, replaced", _run(args, signal.SIGSTOP, 1)),
    ]
    clean = runs[0][1]
    print(f"\n{'run':<24}{'final loss':>12}{'lost':>6}{'towers per step':>24}{'recovery s':>12}")
    for name, r in runs:
        widths = _widths(r.world)
        recovery = ", ".join(f"{s:.2f}" for _, s in r.recoveries) or "-"
        lost = ",".join(map(str, r.dead_workers)) or "-"
        print(f"{name:<24}{r.losses[-1]:>12.6f}{lost:>6}{widths:>24}{recovery:>12}")
    for name, r in runs[1:]:
        gap = _max_relative_difference(r.model, clean.model)
        print(f"\n{name}: final parameters differ from the undisturbed run's by {gap:.1e} at most")
    print(f"\n({time.perf_counter() - began:.0f} s in all)")
    path = save_loss_plot(
        [
            (range(len(r.losses)), r.losses, {"label": name, "linestyle": style})
            for (name, r), style in zip(runs, ["-", "--", ":"])
        ],
        Path(args.out),
        title="towers demo --faults: a worker lost midway, elastic=True",
        xlabel="step (global batch)",
        ylabel="mean loss over all towers",
    )
    print(f"loss curves: {path}")
    return 0


def _widths(world: list[int]) -> str:
    """``4x200 3x50 4x350``: runs of equal tower counts."""
    out: list[tuple[int, int]] = []
    for w in world:
        if out and out[-1][0] == w:
            out[-1] = (w, out[-1][1] + 1)
        else:
            out.append((w, 1))
    return " ".join(f"{w}x{n}" for w, n in out)
