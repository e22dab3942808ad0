"""Checks of ``towers.train``'s arguments, run in the caller before any worker starts.

A mistake costs a clear message naming the argument, what arrived and what to do, not a
traceback from a child process. :func:`preflight` goes further: it builds the optimizer and the
schedule and computes one shard's loss in the caller.
"""

from __future__ import annotations

import copy
import importlib
import os
import warnings
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..core.compat import elastic_refusal
from ..core.data import global_batches, num_samples, take
from ..core.launch import Launch
from ..core.messages import shorten
from ..core.modes import Engine, Mode, parse_mode
from ..core.split import leaves, split
from ..core.transport import Transport
from ..engines.job import Job
from ..engines.replica import check_loss, to_device
from ..engines.shard import refuse_unshardable
from ..engines.sync.mode import SyncMode, plan_for
from ..engines.sync.outer_parts import refuse_low_precision
from ..processes.env import cpu_count
from ..processes.pack import check_picklable as pickles
from .amp import FLOAT16

__all__ = [
    "averages_buffers",
    "check_arguments",
    "check_elastic",
    "check_min_workers",
    "check_mode_options",
    "check_outer_optimizer",
    "check_picklable",
    "check_sharding",
    "check_straggle",
    "check_workers",
    "launched_workers",
    "loop_mode",
    "positive_int",
    "preflight",
    "warn_non_finite",
]


def positive_int(name: str, value: Any, *, allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}")
    if value < 1:
        raise ValueError(f"{name} must be >= 1, got {value}")


def check_picklable(name: str, obj: Any, hint: str) -> None:
    try:
        pickles(obj)  # as spawn sends it: tensors' data not copied, so big data costs nothing
    except Exception as exc:
        raise ValueError(
            f"{name} cannot be sent to worker processes: {hint} (pickle: {shorten(str(exc))})"
        ) from None


def check_arguments(
    model: Any,
    loss_fn: Any,
    data: Any,
    *,
    ints: dict[str, Any],
    optional_ints: dict[str, Any],
    max_restarts: Any,
    checkpoint: Any,
    seed: Any,
    log_dir: Any,
) -> int:
    """Check what can be checked without building anything; returns the number of samples."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if not any(p.requires_grad for p in model.parameters()):
        raise ValueError("the model has no trainable parameters; there is nothing to train")
    if any(p.dtype == torch.float16 for p in model.parameters() if p.requires_grad):
        raise ValueError(
            FLOAT16.format(
                what="the model's parameters are",
                fix="towers.train takes no GradScaler: keep the parameters float32 and compute "
                "under torch.autocast(dtype=torch.bfloat16) in loss_fn, or use the own loop, "
                "whose ctx.backward(loss, scaler=...) takes one (docs/gpu.md, Mixed precision)",
            )
        )
    if not callable(loss_fn):
        raise TypeError(f"loss_fn must be callable, got {type(loss_fn).__name__}")
    check_picklable(
        "loss_fn",
        loss_fn,
        "define it with `def` at module level, not as a lambda or inner function",
    )
    n = num_samples(data)
    if n == 0:
        raise ValueError("data holds no samples")
    for name, value in ints.items():
        positive_int(name, value)
    for name, value in optional_ints.items():
        positive_int(name, value, allow_none=True)
    if isinstance(max_restarts, bool) or not isinstance(max_restarts, int) or max_restarts < 0:
        raise ValueError(f"max_restarts must be an int >= 0, got {max_restarts!r}")
    if checkpoint is not None and not isinstance(checkpoint, (str, os.PathLike)):
        raise TypeError(f"checkpoint must be a directory path, got {type(checkpoint).__name__}")
    if checkpoint is not None and Path(checkpoint).exists() and not Path(checkpoint).is_dir():
        raise ValueError(f"checkpoint={str(checkpoint)!r} exists and is not a directory")
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise TypeError(f"seed must be an int, got {type(seed).__name__}")
    if log_dir is not None:
        try:
            importlib.import_module("torch.utils.tensorboard")
        except ImportError:
            raise ImportError(
                "log_dir= needs TensorBoard: pip install 'towers-dp[tensorboard]'"
            ) from None
    if not isinstance(data, (torch.Tensor, tuple, list, dict)):
        check_picklable("data", data, "a Dataset must be picklable (no lambdas or open files)")
    else:
        warn_non_finite(data)
    check_picklable("model", model, "the model must be picklable (no lambdas or open files)")
    return n


def check_workers(mode: Mode, workers: int, launched: bool = False) -> None:
    """``ValueError`` if ``mode`` cannot train with ``workers`` computing towers; a warning
    for more workers than cores."""
    mode.check_workers(workers)
    cores = cpu_count()
    if workers > cores and not launched:
        same = "gives the same result" if mode.engine is Engine.SYNC else "trains as well"
        warnings.warn(
            f"workers={workers} on {cores} cores: the towers take turns on the cores and every "
            f"step waits for the slowest, so a step takes about {workers / cores:.3g} times one "
            "tower's compute, plus the switching between processes, and start-up grows with "
            "every process (measured on 2 cores: 8 workers 3-4 times slower per step than 2, "
            f"32 workers 10 times, with 23 s to start). workers={cores} {same}, faster; more "
            "workers than cores only make sense to study many towers (staleness, stragglers)",
            UserWarning,
            stacklevel=4,
        )


def check_mode_options(
    mode: Mode, model: nn.Module, sync_batchnorm: Any, elastic: Any, outer_optimizer: Any
) -> None:
    """``ValueError`` for options ``mode`` cannot serve (``outer_optimizer=`` without outer
    steps, ``sync_batchnorm=True`` or ``elastic=True`` where the mode refuses them)."""
    if outer_optimizer is not None:
        if not (isinstance(mode, SyncMode) and mode.outer_steps):
            raise ValueError(
                f"outer_optimizer= applies to mode='diloco:H' (the optimizer of its outer "
                f"steps); mode {str(mode)!r} has no outer steps: drop outer_optimizer= or "
                "train with mode='diloco:H'"
            )
        check_outer_optimizer(outer_optimizer)
    if isinstance(mode, SyncMode):
        mode.check_options(model, sync_batchnorm=sync_batchnorm is True, elastic=elastic is True)


def check_sharding(
    shard_optimizer: Any, mode: Mode, elastic: bool, transform: Any, checkpoint: Any = None
) -> bool:
    """``shard_optimizer`` checked (``train``'s and ``ctx.replicate``'s): whether to shard;
    the combinations it does not take yet are refused, each with the reason. ``checkpoint``:
    ``train``'s, from which an elastic job rebuilds a lost tower's part of the state."""
    if not isinstance(shard_optimizer, bool):
        raise TypeError(f"shard_optimizer must be True or False, got {shard_optimizer!r}")
    if not shard_optimizer:
        return False
    if not isinstance(mode, SyncMode):
        raise ValueError(
            f"shard_optimizer=True needs mode='sync' or 'diloco:H' (got {str(mode)!r}): in "
            "the parameter-server modes the server's optimizer is already the one copy"
        )
    mode.check_sharding(transform)
    if elastic and mode.outer_steps:
        raise ValueError(
            f"shard_optimizer=True is not available in an elastic job of mode {str(mode)!r} "
            "yet: a lost tower would take its part of the outer state with it. Train it "
            "without elastic=True (checkpoints and max_restarts restart it exactly)"
        )
    if elastic and checkpoint is None:
        raise ValueError(
            "shard_optimizer=True in an elastic job needs its checkpoints: a lost tower takes "
            "its part of the optimizer's state with it, and the others rebuild the whole state "
            "exactly from the newest checkpoint and train again the global batches since. "
            "Pass checkpoint=DIR to towers.train (a directory every host shares). An own loop "
            "cannot train its batches again: save checkpoints (ctx.save_checkpoint) and "
            "restart it instead"
        )
    return True


def loop_mode(mode: Any) -> Mode:
    """The mode an own loop's ``ctx.replicate(model, mode=...)`` names: a synchronous one."""
    parsed = parse_mode(mode)
    if parsed.engine is not Engine.SYNC:
        raise ValueError(
            f"an own loop trains mode='sync' or 'diloco:H', not {mode!r} (the parameter "
            "server's modes run in towers.train)"
        )
    return parsed


def check_outer_optimizer(factory: Any) -> None:
    """``TypeError`` unless ``factory`` builds an optimizer (``params -> Optimizer``)."""
    _check_factory(
        "outer_optimizer",
        factory,
        [torch.nn.Parameter(torch.zeros(1))],
        torch.optim.Optimizer,
        "functools.partial(torch.optim.SGD, lr=0.6, momentum=0.5, nesterov=True)",
    )


def averages_buffers(mode: Mode) -> bool:
    """Whether ``mode`` averages the towers' BatchNorm statistics itself (DiLoCo does)."""
    return isinstance(mode, SyncMode) and mode.averages_buffers


def warn_non_finite(data: Any) -> None:
    """Say up front which samples hold NaN or Inf: the steps that meet them will be skipped."""
    bad = None
    for _, leaf in leaves(data):
        if isinstance(leaf, torch.Tensor) and leaf.is_floating_point():
            rows = ~torch.isfinite(leaf.reshape(len(leaf), -1)).all(dim=1)
            bad = rows if bad is None else bad | rows
    if bad is not None and bool(bad.any()):
        samples = bad.nonzero().flatten().tolist()
        shown = ", ".join(map(str, samples[:5])) + (", ..." if len(samples) > 5 else "")
        warnings.warn(
            f"data holds NaN or Inf in {len(samples)} sample(s) ({shown}); every step whose "
            "global batch holds one is skipped on all towers and listed in TrainResult.skipped "
            "(in mode 'diloco:H', by the tower whose shard holds it)",
            RuntimeWarning,
            stacklevel=5,
        )


def check_straggle(straggle: Any, workers: int) -> dict[int, float]:
    if straggle is None:
        return {}
    if not isinstance(straggle, dict):
        raise TypeError(f"straggle must be a dict {{tower: factor}}, got {type(straggle).__name__}")
    out = {}
    for tower, factor in straggle.items():
        if isinstance(tower, bool) or not isinstance(tower, int) or not 0 <= tower < workers:
            raise ValueError(f"straggle: {tower!r} is not a tower index in 0..{workers - 1}")
        if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not factor >= 1:
            raise ValueError(f"straggle: tower {tower} has factor {factor!r}; give a number >= 1")
        out[tower] = float(factor)
    return out


def _check_factory(name: str, factory: Any, arg: Any, expected: type, example: str) -> Any:
    if isinstance(factory, expected):
        raise TypeError(
            f"{name} must be a callable that returns a new {expected.__name__} (each worker "
            f"builds its own), not an instance; e.g. {example}"
        )
    if not callable(factory):
        raise TypeError(f"{name} must be callable, e.g. {example}; got {type(factory).__name__}")
    check_picklable(name, factory, f"use a module-level function or {example}")
    built = factory(arg)
    if not isinstance(built, expected):
        raise TypeError(f"{name} returned a {type(built).__name__}, expected a {expected.__name__}")
    return built


def preflight(job: Job, workers: int, device: torch.device | None) -> None:
    """Build the optimizer and schedule and compute one shard's loss on ``device``, in this
    process (``None``: no loss, where the workers are processes with GPUs of their own)."""
    with torch.random.fork_rng(devices=[]):
        probe = copy.deepcopy(job.model)
        opt = _check_factory(
            "optimizer",
            job.optimizer,
            probe.parameters(),
            torch.optim.Optimizer,
            "functools.partial(torch.optim.Adam, lr=1e-3)",
        )
        if job.shard_optimizer:  # DiLoCo shards its outer optimizer, sync the user's
            outer = getattr(plan_for(job.mode, job.outer_optimizer), "factory", None)
            refuse_unshardable(outer(probe.parameters()) if outer else opt)
            if outer is not None:
                refuse_low_precision(probe)
        if job.lr_schedule is not None:
            _check_factory(
                "lr_schedule",
                job.lr_schedule,
                opt,
                torch.optim.lr_scheduler.LRScheduler,
                "functools.partial(torch.optim.lr_scheduler.StepLR, step_size=100, gamma=0.5)",
            )
        if device is None:
            return
        first = next(global_batches(num_samples(job.data), job.batch_size, job.shuffle, job.seed))
        shard = take(job.data, split(first, workers)[0], job.collate_fn)
        check_loss(job.loss_fn(probe.to(device), to_device(shard, device)), model=probe)


def check_elastic(elastic: Any, mode: Mode, transport: Transport, launch: Launch) -> None:
    """``elastic=True`` needs sync mode, CPU workers, and local workers started by ``train``."""
    if not isinstance(elastic, bool):
        raise TypeError(f"elastic must be True or False, got {elastic!r}")
    if launch.launched and launch.elastic:
        raise ValueError(
            "towers run --elastic runs own-loop scripts (towers.init); a script that calls "
            "train() runs elastic as a plain python process: train(..., elastic=True) starts "
            "and supervises its workers itself"
        )
    if not elastic:
        return
    if mode.engine is not Engine.SYNC:
        raise ValueError(
            f"elastic=True applies to mode='sync' (a lost worker's share of each global batch "
            f"goes to the others, with exact results); mode {str(mode)!r} already goes on "
            "without a dead worker: drop elastic=True"
        )
    refused = elastic_refusal("elastic=True", transport=transport, instead="drop elastic=True")
    if refused is not None:
        raise ValueError(refused)
    if launch.launched:
        raise ValueError(
            "elastic=True is for workers that train() starts itself, not for a job started by "
            "towers run or torchrun: run the script with plain python (own loops: "
            "towers run --elastic, docs/elastic.md)"
        )


def check_min_workers(min_workers: Any, workers: int, elastic: bool) -> int:
    """``min_workers``: the workers that start an elastic job (default all of them)."""
    if min_workers is None:
        return workers
    if isinstance(min_workers, bool) or not isinstance(min_workers, int):
        raise TypeError(f"min_workers must be an int or None, got {min_workers!r}")
    if not elastic:
        raise ValueError(
            "min_workers applies to elastic=True (the others join the running job as they "
            "are ready): pass elastic=True, or drop min_workers"
        )
    if not 1 <= min_workers <= workers:
        raise ValueError(
            f"min_workers must be in 1..workers ({workers}), got {min_workers}: the job starts "
            f"with min_workers and grows to workers"
        )
    return min_workers


def launched_workers(mode: Mode, workers: int, launch: Launch) -> int:
    """Computing towers: ``workers``, or what a launched job's world size leaves for them."""
    if not launch.launched:
        return workers
    server = mode.servers  # the parameter server is one more process
    world = launch.world_size
    if world != workers + server:
        warnings.warn(
            f"train() runs in a launched job of {world} processes; training with "
            f"{world - server} workers, not workers={workers}"
            + (f" (mode {mode}: rank 0 is the parameter server)" if server else ""),
            stacklevel=4,
        )
    return world - server
