"""Checks of ``towers.train``'s data and evaluation keywords, run in the caller.

``eval_data``, ``eval_fn``, ``eval_every``, ``lr_interval``, ``collate_fn`` and ``num_workers``;
a ``torch.utils.data.DataLoader`` given as data is refused with the call to write instead.
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Any

import torch
from torch.utils.data import (
    BatchSampler,
    DataLoader,
    RandomSampler,
    SequentialSampler,
    default_collate,
)

from ..core.data import is_dataset, num_samples, take
from ..core.split import split
from ..engines.evaluate import combine, evaluate
from ..engines.job import Job
from ..processes.pack import check_picklable as pickles

__all__ = ["LR_INTERVALS", "check_options", "preflight_eval", "refuse_loader"]

LR_INTERVALS = ("step", "epoch")


def refuse_loader(name: str, data: Any) -> None:
    """``TypeError`` for a DataLoader given as ``name``, with the exact call to write instead."""
    if not isinstance(data, DataLoader):
        return
    custom = _custom_sampling(data)
    if custom is not None:
        raise TypeError(
            f"{name} is a DataLoader with {custom}; towers draws the global batches itself "
            f"(DataLoader's order, from seed) and cannot honour it: pass {name}=loader.dataset, "
            "or the samples it selects as a torch.utils.data.Subset"
        )
    if name == "data":
        shuffle = isinstance(data.sampler, RandomSampler)
        parts = ["loader.dataset", f"batch_size={data.batch_size}", f"shuffle={shuffle}"]
    else:
        parts = ["data", "eval_data=loader.dataset"]
    if data.collate_fn is not default_collate:
        parts.append(f"collate_fn={getattr(data.collate_fn, '__name__', 'your_collate_fn')}")
    if data.num_workers:
        parts.append(f"num_workers={data.num_workers}")
    dropped = " (towers keeps an epoch's smaller last batch: drop_last is not available)"
    raise TypeError(
        f"{name} is a DataLoader; towers draws the global batches itself (the same ones a "
        "DataLoader yields, from seed) and splits each over the towers: pass the loader's "
        f"dataset and settings instead: towers.train(model, loss_fn, {', '.join(parts)}, ...)"
        + (dropped if data.drop_last else "")
    )


def _custom_sampling(loader: DataLoader[Any]) -> str | None:
    """What in ``loader`` picks samples otherwise than DataLoader's ``shuffle``, if anything."""
    if type(loader.batch_sampler) not in (BatchSampler, type(None)):
        return f"a custom batch_sampler ({type(loader.batch_sampler).__name__})"
    sampler = loader.sampler
    if type(sampler) is RandomSampler:
        if sampler.replacement or sampler._num_samples is not None:
            return "a RandomSampler drawing with replacement or a set number of samples"
        return None
    if type(sampler) is SequentialSampler:
        return None
    return f"a custom sampler ({type(sampler).__name__})"


def check_options(
    data: Any,
    *,
    eval_data: Any,
    eval_fn: Any,
    eval_every: Any,
    lr_interval: Any,
    collate_fn: Any,
    num_workers: Any,
) -> None:
    """Check the keywords of this module's docstring; ``eval_data`` must hold samples."""
    if eval_data is None:
        for key, value in (("eval_fn", eval_fn), ("eval_every", eval_every)):
            if value is not None:
                raise ValueError(f"{key}= needs eval_data= (the samples to evaluate on)")
    else:
        refuse_loader("eval_data", eval_data)
        if num_samples(eval_data) == 0:
            raise ValueError("eval_data holds no samples")
        _check_callable("eval_fn", eval_fn)
        if eval_every is not None and (
            isinstance(eval_every, bool) or not isinstance(eval_every, int) or eval_every < 1
        ):
            raise ValueError(
                f"eval_every must be an int >= 1 (global batches between evaluations) or None "
                f"(evaluate at the end only); got {eval_every!r}"
            )
        if is_dataset(eval_data):
            _pickles("eval_data", eval_data)
    if lr_interval not in LR_INTERVALS:
        raise ValueError(
            f"lr_interval must be 'step' (the schedule steps once per global batch) or 'epoch' "
            f"(once per pass over data); got {lr_interval!r}"
        )
    datasets = is_dataset(data) or (eval_data is not None and is_dataset(eval_data))
    _check_callable("collate_fn", collate_fn)
    if isinstance(num_workers, bool) or not isinstance(num_workers, int) or num_workers < 0:
        raise ValueError(f"num_workers must be an int >= 0, got {num_workers!r}")
    for key, value in (("collate_fn", collate_fn), ("num_workers", num_workers)):
        if value and not datasets:
            raise ValueError(
                f"{key}= applies to a Dataset's samples; data is tensors, which each tower "
                f"indexes directly: leave {key} out, or pass a map-style Dataset"
            )


def _check_callable(name: str, fn: Any) -> None:
    if fn is None:
        return
    if not callable(fn):
        raise TypeError(f"{name} must be callable, got {type(fn).__name__}")
    _pickles(name, fn)


def _pickles(name: str, obj: Any) -> None:
    try:
        pickles(obj)
    except Exception as exc:
        raise ValueError(
            f"{name} cannot be sent to worker processes: define it at module level, not as a "
            f"lambda or inner function, and keep no open files in it (pickle: {exc})"
        ) from None


def preflight_eval(job: Job, workers: int, device: torch.device | None) -> None:
    """Evaluate the first tower's share of the first evaluation batch in the caller, on
    ``device``, to report a bad ``eval_fn`` here rather than from a worker (``None``: not)."""
    if job.eval_data is None or device is None:
        return
    first = split(torch.arange(min(job.batch_size, num_samples(job.eval_data))), workers)[0]
    if is_dataset(job.eval_data):
        probe: Any = torch.utils.data.Subset(job.eval_data, first.tolist())
    else:
        probe = take(job.eval_data, first)
    small = dataclasses.replace(job, eval_data=probe, num_workers=0)
    with torch.random.fork_rng(devices=[]):
        combine([evaluate(small, copy.deepcopy(job.model).to(device), device, 0, 1)])
