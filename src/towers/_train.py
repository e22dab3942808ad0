"""``towers.train``: the whole job in one call — validation, processes, modes, results.

Everything that can be checked is checked here, in the caller's process, before any worker
starts: a mistake costs a clear message, not a traceback from a child process.
"""

from __future__ import annotations

import copy
import functools
import importlib
import os
import pickle
import shutil
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch
from torch import nn

from . import _checkpoint
from ._context import TRANSPORTS, Context, check_loss, init
from ._data import BatchOrder, batches_per_epoch, global_batches, num_samples, take
from ._modes import Mode, parse_mode
from ._split import map_batch, split
from ._world import launched_env, spawn

__all__ = ["TrainResult", "train"]


class LossFn(Protocol):
    def __call__(self, model: nn.Module, shard: Any, /) -> torch.Tensor: ...


OptimizerFactory = Callable[[Any], torch.optim.Optimizer]
ScheduleFactory = Callable[[torch.optim.Optimizer], Any]


@dataclass
class TrainResult:
    """What :func:`towers.train` returns.

    Attributes:
        model: the trained model, on the CPU (a copy; the model passed in is not modified).
        losses: per step, the sample-weighted mean loss over all towers, computed with the
            parameters before that step's update.
        tower_losses: per step, each tower's mean loss (``nan`` for a tower with no samples).
        skipped: ``(step, culprit towers)`` for every step skipped because a loss or gradient was
            not finite.
        steps: global batches trained on.
        samples: samples trained on (all towers, all steps).
        seconds: wall time of the training loop, excluding process start-up.
        staleness: asynchronous modes: one entry per applied update; empty in sync mode.
        mode: the mode trained in.
        workers: the number of towers.
        restarts: how many times the workers were relaunched after a failure.
    """

    model: nn.Module
    losses: list[float]
    tower_losses: list[list[float]]
    skipped: list[tuple[int, list[int]]]
    steps: int
    samples: int
    seconds: float
    staleness: list[int] = field(default_factory=list)
    mode: str = "sync"
    workers: int = 1
    restarts: int = 0

    @property
    def samples_per_second(self) -> float:
        return self.samples / self.seconds if self.seconds > 0 else float("nan")


def _default_optimizer(params: Any) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.01)


@dataclass
class _Spec:
    """Everything a worker needs, sent to it by pickle."""

    model: nn.Module
    loss_fn: LossFn
    data: Any
    batch_size: int
    steps: int
    mode: Mode
    optimizer: OptimizerFactory
    lr_schedule: ScheduleFactory | None
    seed: int
    shuffle: bool
    log_dir: str | None
    progress: bool
    accumulate: int
    timeout: float | None
    checkpoint: str | None
    checkpoint_every: int
    every_rank: bool  # every rank returns the result (launched jobs), not only rank 0
    transport: str | None = None
    resume: dict[str, Any] | None = None  # the checkpoint to start from, read by the caller


def _positive_int(name: str, value: Any, *, allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}")
    if value < 1:
        raise ValueError(f"{name} must be >= 1, got {value}")


def _check_picklable(name: str, obj: Any, hint: str) -> None:
    try:
        pickle.dumps(obj)
    except Exception as exc:
        raise ValueError(
            f"{name} cannot be sent to worker processes: {hint} (pickle: {exc})"
        ) from None


def _check_factory(name: str, factory: Any, arg: Any, expected: type, example: str) -> Any:
    if isinstance(factory, expected):
        raise TypeError(
            f"{name} must be a callable that returns a new {expected.__name__} (each worker "
            f"builds its own), not an instance; e.g. {example}"
        )
    if not callable(factory):
        raise TypeError(f"{name} must be callable, e.g. {example}; got {type(factory).__name__}")
    _check_picklable(name, factory, f"use a module-level function or {example}")
    built = factory(arg)
    if not isinstance(built, expected):
        raise TypeError(f"{name} returned a {type(built).__name__}, expected a {expected.__name__}")
    return built


def _preflight(spec: _Spec, workers: int) -> None:
    """Build the optimizer and schedule and compute one shard's loss, in this process."""
    probe = copy.deepcopy(spec.model)
    opt = _check_factory(
        "optimizer",
        spec.optimizer,
        probe.parameters(),
        torch.optim.Optimizer,
        "functools.partial(torch.optim.Adam, lr=1e-3)",
    )
    if spec.lr_schedule is not None:
        _check_factory(
            "lr_schedule",
            spec.lr_schedule,
            opt,
            torch.optim.lr_scheduler.LRScheduler,
            "functools.partial(torch.optim.lr_scheduler.StepLR, step_size=100, gamma=0.5)",
        )
    first = next(global_batches(num_samples(spec.data), spec.batch_size, spec.shuffle, spec.seed))
    shard = take(spec.data, split(first, workers)[0])
    check_loss(spec.loss_fn(probe, shard))


def train(
    model: nn.Module,
    loss_fn: LossFn,
    data: Any,
    *,
    batch_size: int,
    steps: int | None = None,
    epochs: int | None = None,
    workers: int = 2,
    mode: str = "sync",
    optimizer: OptimizerFactory | None = None,
    lr_schedule: ScheduleFactory | None = None,
    seed: int = 0,
    shuffle: bool = True,
    checkpoint: str | None = None,
    log_dir: str | None = None,
    progress: bool = True,
    accumulate: int = 1,
    timeout: float | None = None,
    checkpoint_every: int = 100,
    max_restarts: int = 0,
    transport: str | None = None,
) -> TrainResult:
    """Train ``model`` data-parallel over ``workers`` towers and return the result.

    Each global batch of ``batch_size`` samples is split over the towers with
    :func:`towers.split`; in ``"sync"`` mode every tower computes ``loss_fn(model, shard)`` and
    its gradient with the same parameters, the gradients are averaged weighted by shard sizes,
    and one update is applied: the trained parameters match a single-process loop over the same
    global batches for any ``workers``. The batches depend on ``seed``, ``shuffle`` and
    ``batch_size`` only, exactly as a ``DataLoader(data, batch_size, shuffle=shuffle,
    generator=torch.Generator().manual_seed(seed))`` yields them.

    Workers are local processes (Gloo over 127.0.0.1, a free port); ``workers=1`` trains in this
    process. Called in a process started by ``torchrun`` or ``towers run``, every rank calls
    ``train`` and the launched processes are the workers.

    Args:
        model: the module to train; copied to every worker (it is not modified).
        loss_fn: ``loss_fn(model, shard) -> scalar tensor``, the mean loss over the shard; a
            module-level function, so it can be sent to worker processes.
        data: a tensor, a tuple/dict of tensors (samples along dim 0), or a map-style Dataset.
        batch_size: samples per global batch (all towers together).
        steps: global batches to train on; or give ``epochs``.
        epochs: passes over ``data``; or give ``steps``.
        workers: towers (worker processes).
        mode: ``"sync"``; the asynchronous modes ``"async"``, ``"ssp:S"``, ``"local:K"`` and
            ``"backup:B"`` are refused until they are available.
        optimizer: ``params -> Optimizer``; default SGD with lr 0.01.
        lr_schedule: ``optimizer -> LRScheduler``, stepped once per global batch.
        seed: seeds the batch order (and each worker's RNG as ``seed + rank``).
        shuffle: draw a new permutation of ``data`` every epoch.
        checkpoint: a directory for checkpoints (parameters, optimizer and schedule state, data
            position, RNG states, and the results so far). If it holds a checkpoint, training
            resumes from it and ends exactly where an uninterrupted run ends.
        log_dir: write TensorBoard scalars there (needs the ``tensorboard`` package).
        progress: show a progress bar when stderr is a terminal.
        accumulate: micro-batches per tower shard (gradient accumulation; same result, less
            memory).
        timeout: seconds a worker may wait for the others (rendezvous or a collective) before
            the job fails; default 60. If a worker dies, the others and this call stop at once
            with a :class:`towers.WorkerError` naming it.
        checkpoint_every: steps between checkpoints (one is also written at the end).
        max_restarts: after a failure, relaunch the workers and resume from the last
            checkpoint up to this many times (a temporary directory is used if ``checkpoint``
            is not given).

    Returns:
        A :class:`TrainResult`.

    Example:
        >>> result = towers.train(model, mse, (x, y), batch_size=50, steps=100, workers=4)
        >>> result.losses[-1] < result.losses[0]  # doctest: +SKIP
        True
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if not any(p.requires_grad for p in model.parameters()):
        raise ValueError("the model has no trainable parameters; there is nothing to train")
    if not callable(loss_fn):
        raise TypeError(f"loss_fn must be callable, got {type(loss_fn).__name__}")
    _check_picklable(
        "loss_fn",
        loss_fn,
        "define it with `def` at module level, not as a lambda or inner function",
    )
    n = num_samples(data)
    if n == 0:
        raise ValueError("data holds no samples")
    _positive_int("batch_size", batch_size)
    _positive_int("workers", workers)
    _positive_int("steps", steps, allow_none=True)
    _positive_int("epochs", epochs, allow_none=True)
    _positive_int("accumulate", accumulate)
    _positive_int("checkpoint_every", checkpoint_every)
    if isinstance(max_restarts, bool) or not isinstance(max_restarts, int) or max_restarts < 0:
        raise ValueError(f"max_restarts must be an int >= 0, got {max_restarts!r}")
    if checkpoint is not None and not isinstance(checkpoint, (str, os.PathLike)):
        raise TypeError(f"checkpoint must be a directory path, got {type(checkpoint).__name__}")
    if checkpoint is not None and Path(checkpoint).exists() and not Path(checkpoint).is_dir():
        raise ValueError(f"checkpoint={str(checkpoint)!r} exists and is not a directory")
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise TypeError(f"seed must be an int, got {type(seed).__name__}")
    if (steps is None) == (epochs is None):
        raise ValueError(
            "give either steps= (global batches) or epochs= (passes over the data), not "
            + ("neither" if steps is None else "both")
        )
    total_steps = steps if steps is not None else epochs * batches_per_epoch(n, batch_size)  # type: ignore[operator]
    parsed = parse_mode(mode)
    if transport is not None and transport not in TRANSPORTS:
        raise ValueError(f"transport must be one of {', '.join(TRANSPORTS)}; got {transport!r}")
    if parsed.name != "sync":
        raise NotImplementedError(
            f"mode {mode!r} is not available in this version of towers; use mode='sync'"
        )
    if log_dir is not None:
        try:
            importlib.import_module("torch.utils.tensorboard")
        except ImportError:
            raise ImportError(
                "log_dir= needs TensorBoard: pip install 'towers-dp[tensorboard]'"
            ) from None
    if not isinstance(data, (torch.Tensor, tuple, list, dict)):
        _check_picklable("data", data, "a Dataset must be picklable (no lambdas or open files)")
    _check_picklable("model", model, "the model must be picklable (no lambdas or open files)")

    launched = launched_env()
    if launched:
        world = int(os.environ["WORLD_SIZE"])
        if world != workers:
            warnings.warn(
                f"train() runs in a launched job of {world} processes; training with {world} "
                f"workers, not workers={workers}",
                stacklevel=2,
            )
        workers = world
    spec = _Spec(
        model=model,
        loss_fn=loss_fn,
        data=data,
        batch_size=batch_size,
        steps=total_steps,
        mode=parsed,
        optimizer=optimizer if optimizer is not None else _default_optimizer,
        lr_schedule=lr_schedule,
        seed=seed,
        shuffle=bool(shuffle),
        log_dir=str(log_dir) if log_dir is not None else None,
        progress=bool(progress),
        accumulate=accumulate,
        timeout=timeout,
        checkpoint=None if checkpoint is None else os.fspath(checkpoint),
        checkpoint_every=checkpoint_every,
        every_rank=launched,
        transport=transport,
    )
    with torch.random.fork_rng(devices=[]):
        _preflight(spec, workers)

    scratch = None
    if max_restarts and spec.checkpoint is None:
        scratch = spec.checkpoint = tempfile.mkdtemp(prefix="towers-checkpoints-")
    try:
        restarts = 0
        while True:
            try:
                out = _launch(spec, workers, in_process=launched or (workers == 1 and not scratch))
                break
            except Exception as exc:
                if launched or restarts >= max_restarts:
                    raise
                restarts += 1
                warnings.warn(
                    f"training failed ({type(exc).__name__}: {str(exc).splitlines()[0]}); "
                    f"restart {restarts} of {max_restarts} from the last checkpoint",
                    RuntimeWarning,
                    stacklevel=2,
                )
    finally:
        if scratch is not None:
            shutil.rmtree(scratch, ignore_errors=True)
    trained = copy.deepcopy(model).cpu()
    trained.load_state_dict(out.pop("state_dict"))
    return TrainResult(model=trained, mode=str(parsed), workers=workers, restarts=restarts, **out)


def _launch(spec: _Spec, workers: int, in_process: bool) -> dict[str, Any]:
    # Read in the caller, so that a fallback warning or a mismatch is raised here, and read
    # anew on every attempt, so that a restart continues from the newest checkpoint.
    if spec.checkpoint is not None:
        spec.resume = _checkpoint.load_latest(spec.checkpoint)
        if spec.resume is not None:
            _check_resumable(spec, spec.resume)
    if in_process:
        with torch.random.fork_rng(devices=[]):
            out = _worker(spec)
    else:
        out = spawn(_worker, workers, spec)[0]
    assert out is not None
    return out


def _worker(spec: _Spec) -> dict[str, Any] | None:
    ctx = init(timeout=spec.timeout, transport=spec.transport)
    try:
        return _sync_loop(ctx, spec)
    finally:
        ctx.close()


class _Reporter:
    """Progress bar and TensorBoard scalars, on rank 0 only."""

    def __init__(self, spec: _Spec, ctx: Context):
        self.bar = None
        self.writer = None
        if not ctx.is_main:
            return
        if spec.progress and sys.stderr.isatty():
            from tqdm.auto import tqdm

            self.bar = tqdm(total=spec.steps, desc=f"towers {spec.mode}", unit="step")
        if spec.log_dir is not None:
            from torch.utils.tensorboard import SummaryWriter

            self.writer = SummaryWriter(spec.log_dir)

    def step(self, step: int, loss: float, tower_losses: list[float], rate: float) -> None:
        if self.bar is not None:
            self.bar.set_postfix(loss=f"{loss:.4g}", samples_s=f"{rate:.0f}", refresh=False)
            self.bar.update(1)
        if self.writer is not None:
            self.writer.add_scalar("loss/mean", loss, step)
            for i, value in enumerate(tower_losses):
                self.writer.add_scalar(f"loss/tower_{i}", value, step)
            self.writer.add_scalar("samples_per_second", rate, step)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        if self.writer is not None:
            self.writer.close()


def _check_resumable(spec: _Spec, state: dict[str, Any]) -> None:
    BatchOrder(num_samples(spec.data), spec.batch_size, spec.shuffle, spec.seed).load_state_dict(
        state["data"]
    )
    if state["mode"] != str(spec.mode):
        raise ValueError(
            f"the checkpoint in {spec.checkpoint} is of a {state['mode']!r} run, this run is "
            f"{str(spec.mode)!r}; use another checkpoint directory"
        )
    if state["step"] > spec.steps:
        raise ValueError(
            f"the checkpoint in {spec.checkpoint} is at step {state['step']}, beyond "
            f"steps={spec.steps}; ask for at least {state['step']} steps"
        )


def _restore(
    ctx: Context, spec: _Spec, state: dict[str, Any], parts: dict[str, Any]
) -> dict[str, Any]:
    """Load a checkpoint into the run's parts; return the results recorded so far."""
    parts["model"].load_state_dict(state["model"])
    parts["optimizer"].load_state_dict(state["optimizer"])
    if parts["schedule"] is not None and state["schedule"] is not None:
        parts["schedule"].load_state_dict(state["schedule"])
    parts["order"].load_state_dict(state["data"])
    rng = state["rng"]
    if len(rng) == ctx.world_size:
        torch.set_rng_state(rng[ctx.rank])
    else:  # resumed with another number of workers: fresh, but reproducible, streams
        torch.manual_seed(spec.seed + ctx.rank + 1000 * state["step"])
    return state["history"]


def _save(ctx: Context, spec: _Spec, step: int, parts: dict[str, Any], history: dict) -> None:
    rng = ctx.comm.all_gather_object(torch.get_rng_state())
    if not ctx.is_main:
        return
    schedule = parts["schedule"]
    state = {
        "format": 1,
        "step": step,
        "mode": str(spec.mode),
        "model": {k: v.detach().cpu() for k, v in parts["model"].state_dict().items()},
        "optimizer": parts["optimizer"].state_dict(),
        "schedule": schedule.state_dict() if schedule is not None else None,
        "data": parts["order"].state_dict(),
        "rng": rng,
        "history": history,
    }
    _checkpoint.save(spec.checkpoint, step, state)  # type: ignore[arg-type]


def _sync_loop(ctx: Context, spec: _Spec) -> dict[str, Any] | None:
    torch.manual_seed(spec.seed + ctx.rank)
    # Always a private copy: tensors sent to local workers travel through shared memory, so
    # without it every worker would update one and the same parameter storage.
    model = ctx.replicate(copy.deepcopy(spec.model))
    opt = spec.optimizer(model.parameters())
    schedule = spec.lr_schedule(opt) if spec.lr_schedule is not None else None
    to_device = functools.partial(map_batch, lambda t: t.to(ctx.device))
    order = BatchOrder(num_samples(spec.data), spec.batch_size, spec.shuffle, spec.seed)
    parts = {"model": model, "optimizer": opt, "schedule": schedule, "order": order}
    history: dict[str, Any] = {
        "losses": [],
        "tower_losses": [],
        "skipped": [],
        "samples": 0,
        "seconds": 0.0,
    }
    first = 0
    if spec.resume is not None:
        # A private copy, as for the model: optimizer state loaded from shared tensors would
        # be shared, and updated, by every worker.
        history = _restore(ctx, spec, copy.deepcopy(spec.resume), parts)
        first = spec.resume["step"]
    losses, tower_losses, skipped = history["losses"], history["tower_losses"], history["skipped"]
    samples = history["samples"]
    reporter = _Reporter(spec, ctx)
    ctx.barrier()
    start = time.perf_counter()
    try:
        for step in range(first, spec.steps):
            mine = split(next(order), ctx.world_size)[ctx.rank]
            micro = [m for m in split(mine, spec.accumulate) if len(m)]
            for m in micro[:-1]:
                ctx.accumulate(spec.loss_fn(model, to_device(take(spec.data, m))), len(m))
            if micro:
                shard = to_device(take(spec.data, micro[-1]))
                r = ctx.step(spec.loss_fn(model, shard), opt, len(micro[-1]))
            else:
                r = ctx.step(None, opt, 0)
            if schedule is not None:
                schedule.step()
            samples += r.samples
            losses.append(r.loss)
            tower_losses.append(r.tower_losses)
            if r.skipped:
                skipped.append((step, r.culprits))
            elapsed = time.perf_counter() - start
            reporter.step(step, r.loss, r.tower_losses, r.samples * (step + 1 - first) / elapsed)
            done = step + 1
            if spec.checkpoint is not None and (
                done % spec.checkpoint_every == 0 or done == spec.steps
            ):
                history["samples"] = samples
                history["seconds"] += time.perf_counter() - start
                start = time.perf_counter()
                _save(ctx, spec, done, parts, history)
    finally:
        reporter.close()
    history["seconds"] += time.perf_counter() - start
    if not (ctx.is_main or spec.every_rank):
        return None
    return {
        "state_dict": {k: v.detach().cpu().clone() for k, v in model.state_dict().items()},
        "losses": losses,
        "tower_losses": tower_losses,
        "skipped": [tuple(s) for s in skipped],
        "steps": spec.steps,
        "samples": samples,
        "seconds": history["seconds"],
    }
