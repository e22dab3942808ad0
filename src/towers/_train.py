"""``towers.train``: the whole job in one call — validation, processes, modes, results.

Everything that can be checked is checked here, in the caller's process, before any worker
starts: a mistake costs a clear message, not a traceback from a child process.
"""

from __future__ import annotations

import copy
import importlib
import os
import pickle
import shutil
import tempfile
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch
from torch import nn

from . import _checkpoint
from ._context import TRANSPORTS, check_loss, join
from ._data import BatchOrder, batches_per_epoch, global_batches, num_samples, take
from ._modes import Mode, parse_mode
from ._split import _leaves, split
from ._sync_loop import sync_loop
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
        staleness: asynchronous modes: one entry per applied update (updates the server applied
            between a worker's pull and the arrival of its gradient; ``local:K``: the worker's
            steps since the last average); empty in sync mode.
        mode: the mode trained in.
        workers: the number of (computing) towers.
        restarts: how many times the workers were relaunched after a failure.
        times: per step, seconds from the start until its loss was complete (for plots of loss
            against wall time).
        ahead: ``async`` and ``ssp:S``: per pull, how many results the pulling worker had sent
            beyond the slowest live worker (``ssp:S`` keeps it <= S).
        dropped: ``backup:B``: ``(step, tower)`` for each late shard left out of its step.
        dead_workers: towers that died during training (their shards went to the others).
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
    times: list[float] = field(default_factory=list)
    ahead: list[int] = field(default_factory=list)
    dropped: list[tuple[int, int]] = field(default_factory=list)
    dead_workers: list[int] = field(default_factory=list)

    @property
    def updates(self) -> int:
        """Parameter updates applied (sync: steps not skipped)."""
        if self.mode == "sync":
            return self.steps - len(self.skipped)
        return len(self.staleness)

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
    straggle: dict[int, float] = field(default_factory=dict)  # tower -> slowdown factor
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
    straggle: dict[int, float] | None = None,
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

    In the asynchronous modes a parameter server (one more process, rank 0) owns the parameters
    and the optimizer and hands out shards on request; ``workers`` counts the computing towers.
    See docs/async.md.

    Workers are local processes (Gloo over 127.0.0.1, a free port); ``workers=1`` in sync mode
    trains in this process. Called in a process started by ``torchrun`` or ``towers run``, every
    rank calls ``train`` and the launched processes are the workers (plus the server, rank 0, in
    the asynchronous modes).

    Args:
        model: the module to train; copied to every worker (it is not modified).
        loss_fn: ``loss_fn(model, shard) -> scalar tensor``, the mean loss over the shard; a
            module-level function, so it can be sent to worker processes.
        data: a tensor, a tuple/dict of tensors (samples along dim 0), or a map-style Dataset.
        batch_size: samples per global batch (all towers together).
        steps: global batches to train on; or give ``epochs``.
        epochs: passes over ``data``; or give ``steps``.
        workers: towers (worker processes).
        mode: ``"sync"`` (one averaged update per global batch); ``"async"`` (each shard's
            gradient applied on arrival); ``"ssp:S"`` (async, no worker more than S results ahead
            of the slowest live one); ``"local:K"`` (each worker steps its own optimizer;
            parameters averaged, weighted by samples, every K steps and at the end);
            ``"backup:B"`` (synchronous; each step applies the first ``workers - B`` shards to
            arrive and drops the rest). A dead worker does not stop the asynchronous modes.
            In a job started by ``towers run --mode M``, the default ``"sync"`` becomes ``M``.
        optimizer: ``params -> Optimizer``; default SGD with lr 0.01.
        lr_schedule: ``optimizer -> LRScheduler``, stepped once per global batch (in the
            asynchronous modes: before the first update from global batch k, it is stepped up
            to k).
        seed: seeds the batch order (and each worker's RNG as ``seed + rank``).
        shuffle: draw a new permutation of ``data`` every epoch.
        checkpoint: a directory for checkpoints (parameters, optimizer and schedule state, data
            position, RNG states, and the results so far). If it holds a checkpoint, training
            resumes from it and ends exactly where an uninterrupted run ends (asynchronous
            modes: the server's checkpoint; every global batch is trained once and training
            goes on from the saved parameters, see docs/async.md).
        log_dir: write TensorBoard scalars there (needs the ``tensorboard`` package); rank 0
            writes them (the server in the asynchronous modes, which adds ``staleness``).
        progress: show a progress bar when stderr is a terminal (rank 0's, or the server's).
        accumulate: micro-batches per tower shard (gradient accumulation; same result, less
            memory).
        timeout: seconds a worker may wait for the others (rendezvous or a collective) before
            the job fails; default 60. If a worker dies, the others and this call stop at once
            with a :class:`towers.WorkerError` naming it (the asynchronous modes go on without
            it).
        checkpoint_every: global batches completed between checkpoints (one is also written at
            the end; ``local:K``: at the first average after that).
        max_restarts: after a failure (asynchronous modes: of the server, or of the whole
            job), relaunch the workers and resume from the last checkpoint up to this many times
            (a temporary directory is used if ``checkpoint`` is not given).
        straggle: ``{tower: factor}`` makes those towers take ``factor`` times as long per shard
            (they sleep ``factor - 1`` times their compute time), in every mode: a straggler for
            experiments such as ``towers compare``.
        transport: how sync workers average: ``"shm"`` (shared memory, local CPU workers),
            ``"gloo"``, ``"nccl"``, or ``"auto"`` (the default: shared memory when every worker
            is on this host with CPU tensors); also set by ``TOWERS_TRANSPORT``.

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
    launched = launched_env()
    if launched and mode == "sync" and os.environ.get("TOWERS_MODE", "sync") != "sync":
        mode = os.environ["TOWERS_MODE"]  # `towers run --mode M`
    parsed = parse_mode(mode)
    if transport is not None and transport not in TRANSPORTS:
        raise ValueError(f"transport must be one of {', '.join(TRANSPORTS)}; got {transport!r}")
    if log_dir is not None:
        try:
            importlib.import_module("torch.utils.tensorboard")
        except ImportError:
            raise ImportError(
                "log_dir= needs TensorBoard: pip install 'towers-dp[tensorboard]'"
            ) from None
    if not isinstance(data, (torch.Tensor, tuple, list, dict)):
        _check_picklable("data", data, "a Dataset must be picklable (no lambdas or open files)")
    else:
        _warn_non_finite(data)
    _check_picklable("model", model, "the model must be picklable (no lambdas or open files)")

    server = 0 if parsed.name == "sync" else 1  # the parameter server is one more process
    if launched:
        world = int(os.environ["WORLD_SIZE"])
        if world != workers + server:
            warnings.warn(
                f"train() runs in a launched job of {world} processes; training with "
                f"{world - server} workers, not workers={workers}"
                + (f" (mode {parsed}: rank 0 is the parameter server)" if server else ""),
                stacklevel=2,
            )
        workers = world - server
    if parsed.name == "backup" and parsed.arg >= workers:  # type: ignore[operator]
        raise ValueError(
            f"mode {parsed} drops {parsed.arg} shards per step but there are only {workers} "
            f"workers; B must be below workers"
        )
    straggle = _check_straggle(straggle, workers)
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
        straggle=straggle,
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
                out = _launch(spec, workers, launched, isolate=scratch is not None)
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


def _launch(spec: _Spec, workers: int, launched: bool, isolate: bool) -> dict[str, Any]:
    """Run the job once: here (a launched job, or one worker) or in local worker processes."""
    # Read in the caller, so that a fallback warning or a mismatch is raised here, and read
    # anew on every attempt, so that a restart continues from the newest checkpoint.
    if spec.checkpoint is not None:
        spec.resume = _checkpoint.load_latest(spec.checkpoint)
        if spec.resume is not None:
            _check_resumable(spec, spec.resume, workers)
    server = 0 if spec.mode.name == "sync" else 1  # the parameter server is one more process
    if launched or (workers + server == 1 and not isolate):
        with torch.random.fork_rng(devices=[]):
            out = _worker(spec)
    else:
        # Computing towers may die without stopping the server (rank 0), whose result counts.
        tolerate = range(1, workers + 1) if server else ()
        out = spawn(_worker, workers + server, spec, tolerate=tolerate)[0]
    assert out is not None
    return out


def _warn_non_finite(data: Any) -> None:
    """Say up front which samples hold NaN or Inf: the steps that meet them will be skipped."""
    bad = None
    for _, leaf in _leaves(data):
        if isinstance(leaf, torch.Tensor) and leaf.is_floating_point():
            rows = ~torch.isfinite(leaf.reshape(len(leaf), -1)).all(dim=1)
            bad = rows if bad is None else bad | rows
    if bad is not None and bool(bad.any()):
        samples = bad.nonzero().flatten().tolist()
        shown = ", ".join(map(str, samples[:5])) + (", ..." if len(samples) > 5 else "")
        warnings.warn(
            f"data holds NaN or Inf in {len(samples)} sample(s) ({shown}); every step whose "
            "global batch holds one is skipped on all towers and listed in TrainResult.skipped",
            RuntimeWarning,
            stacklevel=3,
        )


def _check_straggle(straggle: Any, workers: int) -> dict[int, float]:
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


def _worker(spec: _Spec) -> dict[str, Any] | None:
    # The parameter server talks over its own point-to-point group: a shared-memory segment
    # for collectives would go unused in the asynchronous modes, so they take the process
    # group's own backend, as "auto" would choose it.
    transport = spec.transport
    if spec.mode.name != "sync":
        transport = "nccl" if torch.cuda.is_available() else "gloo"
    ctx = join(timeout=spec.timeout, transport=transport)
    try:
        if spec.mode.name == "sync":
            return sync_loop(ctx, spec)
        from .ps import run

        return run(ctx, spec)
    finally:
        ctx.close()


def _check_resumable(spec: _Spec, state: dict[str, Any], workers: int) -> None:
    if state["mode"] != str(spec.mode):
        raise ValueError(
            f"the checkpoint in {spec.checkpoint} is of a {state['mode']!r} run, this run is "
            f"{str(spec.mode)!r}; use another checkpoint directory"
        )
    if spec.mode.name == "sync":
        BatchOrder(num_samples(spec.data), spec.batch_size, spec.shuffle, spec.seed).check_config(
            state["data"]
        )
    else:
        from .ps import check_resumable

        check_resumable(spec, state, workers)
    if state["step"] > spec.steps:
        raise ValueError(
            f"the checkpoint in {spec.checkpoint} is at step {state['step']}, beyond "
            f"steps={spec.steps}; ask for at least {state['step']} steps"
        )
