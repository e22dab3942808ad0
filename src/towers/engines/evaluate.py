"""Evaluation during training: ``eval_fn`` over all of ``eval_data``, split over the towers.

``eval_data`` is cut into chunks of ``batch_size`` samples, in order; each chunk is split over
the evaluating towers with :func:`towers.split`, as a training batch is. A tower evaluates its
part in eval mode under ``no_grad`` and sums each metric times its sample count; the sums of
all towers, divided by the number of samples, are the metrics over the whole of ``eval_data``:
what one process computes. The synchronous loop evaluates on every tower (the sums travel in one
object gather); in the asynchronous modes the server evaluates its parameters alone.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from ..core.data import num_samples
from ..core.split import split
from .fetch import Fetcher, load
from .job import Job
from .replica import to_device

__all__ = ["Partial", "combine", "due", "evaluate"]

Partial = tuple[dict[str, float], int]  # each metric summed over samples, and the samples


def due(job: Job, done: int) -> bool:
    """Whether to evaluate once ``done`` global batches are complete."""
    if job.eval_data is None:
        return False
    return done == job.steps or (job.eval_every is not None and done % job.eval_every == 0)


def _metrics(job: Job, model: nn.Module, batch: Any) -> Mapping[str, Any]:
    if job.eval_fn is None:
        return {"loss": job.loss_fn(model, batch)}
    out = job.eval_fn(model, batch)
    if not isinstance(out, Mapping) or not out:
        raise TypeError(
            "eval_fn must return a non-empty dict {name: mean over the batch}, e.g. "
            f"{{'loss': ..., 'accuracy': ...}}; got {type(out).__name__}"
        )
    return out


def _value(name: str, value: Any) -> float:
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise ValueError(
                f"eval_fn's {name!r} is a tensor of shape {list(value.shape)}; return its mean "
                "over the batch (a scalar), e.g. with .mean()"
            )
        return float(value.detach())
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    raise TypeError(f"eval_fn's {name!r} must be a scalar tensor or a number, got {value!r}")


def evaluate(
    job: Job,
    model: nn.Module,
    device: torch.device,
    rank: int,
    world: int,
    fetch: Fetcher | None = None,
) -> Partial:
    """This tower's part (``rank`` of ``world``) of an evaluation: metric sums and samples.

    ``fetch``: the tower's :class:`~towers.engines.fetch.Fetcher` (default: in this process).
    """
    n = num_samples(job.eval_data)
    chunks = [torch.arange(a, min(a + job.batch_size, n)) for a in range(0, n, job.batch_size)]
    mine = [part for c in chunks if len(part := split(c, world)[rank])]
    sums: dict[str, float] = {}
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            data = job.eval_data
            batches = load(job, data, mine) if fetch is None else fetch(data, mine)
            for indices, batch in zip(mine, batches, strict=True):
                for name, value in _metrics(job, model, to_device(batch, device)).items():
                    sums[str(name)] = sums.get(str(name), 0.0) + _value(name, value) * len(indices)
    finally:
        model.train(was_training)
    return sums, sum(len(m) for m in mine)


def combine(parts: list[Partial]) -> dict[str, float]:
    """The metrics over all samples, from every tower's :func:`evaluate`."""
    total = sum(count for _, count in parts)
    names = [sorted(sums) for sums, count in parts if count]
    if any(n != names[0] for n in names):
        raise ValueError(f"eval_fn returned different metrics on different towers: {names}")
    return {
        name: math.fsum(sums[name] for sums, count in parts if count) / total for name in names[0]
    }
