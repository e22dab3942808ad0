"""The small message beside DiLoCo's pseudo-gradients: inner steps' losses, weights, buffers.

Between two exchanges each tower trains alone, so the losses of its inner steps are its own.
Each exchange carries them in one float64 vector whose *sum* over towers (an all-reduce) still
holds every tower's values, as the step's metadata does (:class:`~towers.core.step.StepMeta`):

- for each inner step carried, four blocks of ``world`` slots: loss sums, sample counts,
  non-finite flags, compute seconds (tower r writes slot r);
- ``world`` slots of weights (the samples each tower's pseudo-gradient stands for);
- the tower's floating-point buffers (BatchNorm's running statistics) times its weight, so
  that the sum divided by the total weight is their weighted mean.

Pure functions of tensors and numbers, tested without processes.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ...core.step import StepResult

__all__ = ["Counts", "InnerStep", "pack", "read"]

_BLOCKS = 4  # world-sized blocks per inner step: loss sums, samples, flags, seconds


@dataclass
class InnerStep:
    """One inner step of this tower whose loss has not been exchanged yet."""

    index: int  # the global batch
    loss_sum: float  # nan if not finite; 0 for an empty shard
    samples: int
    bad: bool  # its loss or a gradient was not finite: the tower skipped the step
    at: float  # the run's seconds when the tower finished it
    seconds: float = 0.0  # its compute time (forward and backward), for a balanced split

    @property
    def applied(self) -> int:
        """Samples of this step that the tower's parameters learned from."""
        return 0 if self.bad else self.samples


def pack(
    steps: Sequence[InnerStep],
    rank: int,
    world: int,
    weight: int,
    buffers: Sequence[torch.Tensor],
) -> torch.Tensor:
    """This tower's message (see the module doc), on the CPU."""
    w, n = world, len(steps)
    flat = [b.detach().double().reshape(-1).cpu() for b in buffers]
    values = torch.cat(flat) if flat else torch.zeros(0, dtype=torch.float64)
    message = torch.zeros(_BLOCKS * w * n + w + values.numel(), dtype=torch.float64)
    for e, step in enumerate(steps):
        at = _BLOCKS * w * e + rank
        message[at] = step.loss_sum
        message[at + w] = step.samples
        message[at + 2 * w] = 1.0 if step.bad else 0.0
        message[at + 3 * w] = step.seconds
    message[_BLOCKS * w * n + rank] = weight
    message[_BLOCKS * w * n + w :] = values * weight
    return message


def read(
    summed: torch.Tensor, steps: int, world: int
) -> tuple[list[StepResult], torch.Tensor | None]:
    """From the sum of every tower's message carrying ``steps`` inner steps: each step's result
    over all towers, and the weighted mean of the buffers (``None`` if every weight is 0)."""
    w, b = world, _BLOCKS
    values = summed.double().cpu()
    listed = values[: b * w * steps + w].tolist()
    results = []
    for e in range(steps):
        sums, counts, bads, seconds = (
            listed[b * w * e + k * w : b * w * e + (k + 1) * w] for k in range(b)
        )
        results.append(_result(sums, [round(c) for c in counts], bads, seconds))
    total = sum(listed[b * w * steps :])
    buffers = values[b * w * steps + w :] / total if total > 0 else None
    return results, buffers


def _result(
    sums: list[float], counts: list[int], bads: list[float], seconds: list[float]
) -> StepResult:
    """One global batch's result from every tower's loss sum, samples, non-finite flag and
    compute seconds."""
    total = sum(counts)
    losses = [s / c if c > 0 else math.nan for s, c in zip(sums, counts)]
    culprits = [t for t, b in enumerate(bads) if b > 0]
    loss = math.fsum(sums) / total if total else math.nan
    return StepResult(loss, losses, counts, bool(culprits), culprits, tower_seconds=seconds)


def unflatten(flat: torch.Tensor, tensors: Sequence[torch.Tensor]) -> None:
    """Copy consecutive parts of ``flat`` into ``tensors``."""
    at = 0
    for t in tensors:
        t.copy_(flat[at : at + t.numel()].view_as(t).to(t.device))
        at += t.numel()


@dataclass
class Counts:
    """A fragment's inner progress on this tower since its last exchange."""

    steps: int = 0  # inner steps (the same number on every tower)
    applied: int = 0  # samples of the inner steps applied
    computed: int = 0  # samples computed, applied or skipped
    loss: float = 0.0  # loss summed over the applied steps' samples

    def add(self, e: InnerStep) -> None:
        self.steps += 1
        self.computed += e.samples
        if not e.bad:
            self.applied += e.samples
            self.loss += e.loss_sum
