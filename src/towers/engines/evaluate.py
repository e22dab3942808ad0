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
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from ..core.balance import shard_of
from ..core.data import num_samples, take
from .fetch import Fetcher, load
from .job import Job
from .replica import to_device

__all__ = [
    "MetricsFn",
    "Partial",
    "combine",
    "due",
    "evaluate",
    "evaluate_loop_data",
    "evaluate_part",
]

Partial = tuple[dict[str, float], int]  # each metric summed over samples, and the samples
MetricsFn = Callable[[nn.Module, Any], Mapping[str, Any]]  # (model, batch) -> {name: mean}


def due(job: Job, done: int) -> bool:
    """Whether to evaluate once ``done`` global batches are complete."""
    if job.eval_data is None:
        return False
    return done == job.steps or (job.eval_every is not None and done % job.eval_every == 0)


def _metrics(fn: MetricsFn, model: nn.Module, batch: Any, what: str) -> Mapping[str, Any]:
    out = fn(model, batch)
    if not isinstance(out, Mapping) or not out:
        raise TypeError(
            f"{what} must return a non-empty dict {{name: mean over the batch}}, e.g. "
            f"{{'loss': ..., 'accuracy': ...}}; got {type(out).__name__}"
        )
    return out


def _value(name: str, value: Any, what: str) -> float:
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise ValueError(
                f"{what}'s {name!r} is a tensor of shape {list(value.shape)}; return its mean "
                "over the batch (a scalar), e.g. with .mean()"
            )
        return float(value.detach())
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    raise TypeError(f"{what}'s {name!r} must be a scalar tensor or a number, got {value!r}")


def evaluate_part(
    model: nn.Module,
    data: Any,
    fn: MetricsFn,
    batch_size: int,
    device: torch.device,
    rank: int,
    world: int,
    batches: Callable[[Any, list[torch.Tensor]], Iterable[Any]],
    what: str = "eval_fn",
    shares: Sequence[float] | None = None,
) -> Partial:
    """This tower's part (``rank`` of ``world``) of evaluating ``fn`` over ``data``.

    ``data`` is cut into chunks of ``batch_size`` samples in order, each split over the towers
    (evenly, or in ``shares``: a balanced split's); ``batches(data, indices)`` fetches this
    tower's parts; ``what`` names ``fn`` in errors. Returns each metric summed over this
    tower's samples, and their number: their combination does not depend on the split.
    """
    n = num_samples(data)
    chunks = [torch.arange(a, min(a + batch_size, n)) for a in range(0, n, batch_size)]
    mine = [part for c in chunks if len(part := shard_of(c, rank, world, shares))]
    sums: dict[str, float] = {}
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            for indices, batch in zip(mine, batches(data, mine), strict=True):
                for name, value in _metrics(fn, model, to_device(batch, device), what).items():
                    add = _value(name, value, what) * len(indices)
                    sums[str(name)] = sums.get(str(name), 0.0) + add
    finally:
        model.train(was_training)
    return sums, sum(len(m) for m in mine)


def evaluate_loop_data(
    model: nn.Module,
    data: Any,
    fn: MetricsFn,
    batch_size: int,
    collate_fn: Callable[[list[Any]], Any] | None,
    device: torch.device,
    rank: int,
    world: int,
    shares: Sequence[float] | None = None,
) -> Partial:
    """This rank's part of the own loop's ``ctx.evaluate``, its arguments checked first."""
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size must be an int >= 1, got {batch_size!r}")
    if not callable(fn):
        raise TypeError(f"fn must be callable (model, batch) -> dict, got {type(fn).__name__}")

    def batches(data: Any, parts: list[torch.Tensor]) -> Iterable[Any]:
        return (take(data, indices, collate_fn) for indices in parts)

    where = device, rank, world
    return evaluate_part(model, data, fn, batch_size, *where, batches, "fn", shares)


def evaluate(
    job: Job,
    model: nn.Module,
    device: torch.device,
    rank: int,
    world: int,
    fetch: Fetcher | None = None,
    shares: Sequence[float] | None = None,
) -> Partial:
    """This tower's part of evaluating ``job.eval_fn`` (default: the loss) over
    ``job.eval_data``; ``fetch``: the tower's :class:`~towers.engines.fetch.Fetcher` (default:
    in this process)."""
    fn: MetricsFn = job.eval_fn or (lambda m, b: {"loss": job.loss_fn(m, b)})
    batches = fetch or (lambda data, mine: load(job, data, mine))
    data, size = job.eval_data, job.batch_size
    return evaluate_part(model, data, fn, size, device, rank, world, batches, shares=shares)


def combine(parts: list[Partial]) -> dict[str, float]:
    """The metrics over all samples, from every tower's :func:`evaluate`."""
    total = sum(count for _, count in parts)
    names = [sorted(sums) for sums, count in parts if count]
    if any(n != names[0] for n in names):
        raise ValueError(f"the evaluation returned different metrics on different towers: {names}")
    return {
        name: math.fsum(sums[name] for sums, count in parts if count) / total for name in names[0]
    }
