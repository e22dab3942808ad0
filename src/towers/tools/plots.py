"""Loss curves as a PNG for the command line (matplotlib's Agg backend: no display needed)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

__all__ = ["eval_curve", "save_loss_plot"]

Curve = tuple[Sequence[float], Sequence[float], dict[str, Any]]  # x, y, ax.plot keywords


def eval_curve(
    evals: Sequence[tuple[int, dict[str, float]]], metric: str = "loss", **style: Any
) -> Curve:
    """``TrainResult.evals``'s ``metric`` against global batches completed, as one curve
    (drawn with markers: evaluations are few)."""
    xs = [done for done, values in evals if metric in values]
    ys = [values[metric] for _, values in evals if metric in values]
    return xs, ys, {"marker": "o", "label": f"eval {metric}", **style}


def save_loss_plot(
    curves: Sequence[Curve],
    path: Path,
    *,
    title: str,
    xlabel: str,
    ylabel: str,
    size: tuple[float, float] = (7, 4.5),
    fontsize: float | None = None,
) -> Path:
    """Plot each curve on a log-scaled loss axis, write ``path`` and return it, resolved."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=size)
    for xs, ys, style in curves:
        ax.plot(xs, ys, **style)
    ax.set_yscale("log")
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=fontsize)
    ax.legend(fontsize=fontsize and fontsize - 2)
    ax.grid(True, alpha=0.3)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path.resolve()


def save_loss_panels(
    panels: Sequence[tuple[str, Sequence[Curve]]],
    path: Path,
    *,
    title: str,
    ylabel: str,
) -> Path:
    """Side-by-side panels (x label, curves) sharing a log-scaled loss axis; write ``path``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(panels), figsize=(6 * len(panels), 4.5), sharey=True)
    for ax, (xlabel, curves) in zip(list(axes) if len(panels) > 1 else [axes], panels):
        for xs, ys, style in curves:
            ax.plot(xs, ys, **style)
        ax.set_yscale("log")
        ax.set_xlabel(xlabel)
        ax.grid(True, alpha=0.3)
    first = axes[0] if len(panels) > 1 else axes
    first.set_ylabel(ylabel)
    first.legend(fontsize=8)
    fig.suptitle(title)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path.resolve()
