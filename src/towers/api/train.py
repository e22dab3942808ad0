"""``towers.train``: the whole job in one call: validate, build the job, launch with restarts.

Everything that can be checked is checked in the caller's process, before any worker starts
(:mod:`towers.api.validate`); the job then runs here (one worker, or a launched job whose
processes are the workers) or in local worker processes, relaunched from the last checkpoint up
to ``max_restarts`` times.
"""

from __future__ import annotations

import copy
import dataclasses
import shutil
import sys
import tempfile
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from ..comm.group import DEFAULT_TIMEOUT
from ..core.messages import first_line
from ..engines.job import (
    CollateFn,
    EngineResult,
    EvalFn,
    Job,
    LossFn,
    OptimizerFactory,
    ScheduleFactory,
)
from ..engines.run import load_resume, run_job
from ..engines.sync.loop import elastic_loop
from ..engines.transforms import GradientTransform
from ..processes.elastic import HANG_SECONDS, supervise
from ..processes.lifeline import Terminated, sigterm_interrupts, stopped_line
from ..processes.spawn import spawn
from .make import RunPlan, make_job
from .result import TrainResult, warn_if_untrained

__all__ = ["TrainResult", "train"]


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
    eval_data: Any = None,
    eval_fn: EvalFn | None = None,
    eval_every: int | None = None,
    lr_interval: str = "step",
    collate_fn: CollateFn | None = None,
    num_workers: int = 0,
    sync_batchnorm: bool = False,
    elastic: bool = False,
    min_workers: int | None = None,
    transform: GradientTransform | None = None,
    compress: str | None = None,
    outer_optimizer: OptimizerFactory | None = None,
    device: str = "auto",
    balance: bool | None = None,
    shard_optimizer: bool = False,
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
            ``"diloco:H"`` (DiLoCo: each worker takes H steps alone with ``optimizer``, then
            the workers average their pseudo-gradients, weighted by samples, over all-reduce
            and ``outer_optimizer`` steps the shared parameters; ``"diloco:H:overlap"`` lets
            that exchange travel during the next H steps, ``"diloco:H:overlap:P"`` exchanges
            the model in P fragments; see docs/diloco.md); ``"sparseloco:H"`` (DiLoCo whose
            pseudo-gradients travel as SparseLoCo's: top-k at 2 bits, with error feedback in
            place of the outer momentum, and a plain SGD outer step of lr 1).
            In a job started by ``towers run --mode M``, the default ``"sync"`` becomes ``M``.
        optimizer: ``params -> Optimizer``; default SGD with lr 0.01.
        lr_schedule: ``optimizer -> LRScheduler``, stepped once per global batch, or once per
            epoch with ``lr_interval="epoch"`` (in the asynchronous modes: before the first
            update from global batch k, it is stepped up to k, or to the epochs before k's).
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
        transport: how sync workers average, and how the asynchronous server and its workers
            exchange messages: ``"shm"`` (shared memory, one host), ``"gloo"``, ``"nccl"``, or
            ``"auto"`` (the default: shared memory when every worker is on this host, with CPU
            tensors for sync); also set by ``TOWERS_TRANSPORT``.
        eval_data: samples to evaluate on (tensors or a map-style Dataset), all of them, every
            ``eval_every`` global batches and at the end; split over the towers (the server
            alone in the asynchronous modes), in eval mode under ``no_grad``. The results, in
            ``TrainResult.evals``, equal a single-process evaluation.
        eval_fn: ``eval_fn(model, batch) -> {name: mean over the batch}``; default
            ``{"loss": loss_fn(model, batch)}``. Combined weighted by the samples behind each.
        eval_every: global batches between evaluations; ``None``: at the end only.
        lr_interval: ``"step"`` (``lr_schedule`` steps after every global batch) or
            ``"epoch"`` (after every pass over ``data``, as in a loop calling
            ``scheduler.step()`` once per epoch).
        collate_fn: turns a list of a Dataset's samples into a batch, as DataLoader's (each
            tower collates its own samples: pad to the longest in the tower's shard); default
            DataLoader's ``default_collate``.
        num_workers: data-loading processes per tower (a DataLoader over the tower's samples,
            fetching ahead; see docs/training.md); 0 loads in the tower's process.
        sync_batchnorm: BatchNorm layers normalise over the whole global batch (statistics
            summed over the towers, weighted by samples), so that training and running
            statistics equal one process's (sync mode; every global batch needs at least one
            sample per tower). Without it each tower normalises over its own shard, a warning
            says so, and ``TrainResult.model`` keeps rank 0's running statistics
            (docs/batchnorm.md).
        elastic: sync mode, local CPU workers: a worker that dies or hangs is dropped, the
            survivors redo the interrupted global batch among themselves and training goes on,
            with the same parameters as an uninterrupted run (see docs/elastic.md). With
            ``max_restarts``, that many replacements join at a step boundary and receive the
            state from a live peer. ``TrainResult.dead_workers``, ``world`` and
            ``recoveries`` say what happened.
        min_workers: with ``elastic``: training starts once workers 0..min_workers-1 have
            built their models; the others (up to ``workers``) join the running job as each
            is ready, at a step boundary, with the state of a live peer. Default: every
            worker starts it.
        transform: sync mode: how each bucket of gradients is reduced over the towers, a
            gradient transform (see :mod:`towers.transforms`); default a plain sum. Its state
            is saved in checkpoints and handed to replacements in elastic jobs.
        compress: sync mode: send gradients compressed, for slow links between hosts:
            ``"bf16"`` or ``"fp16"`` (2 bytes a value, summed in float32), ``"int8"`` (1 byte
            a value, with error feedback), ``"powersgd:R"`` (rank-R factors of every weight
            matrix, with error feedback and warm start), ``"topk:F[:BITS]"`` (the largest F
            of each chunk of 4096 values, float32 or BITS = 2, 4, 8 bits each, with error
            feedback; see docs/compression.md). Each gives up
            some exactness for fewer bytes; ``None`` (default) sends every value exactly.
            In mode ``"diloco:H"`` it compresses the pseudo-gradients.
        outer_optimizer: mode ``"diloco:H"``: ``params -> Optimizer`` for the outer steps,
            which take the towers' mean pseudo-gradient as their gradient; default Nesterov
            SGD with lr 0.6 and momentum 0.5 (docs/diloco.md; the paper's is lr 0.7,
            momentum 0.9). ``functools.partial(torch.optim.SGD,
            lr=1.0)`` makes each outer step the plain average of the towers' parameters.
        device: where the workers compute: ``"cuda"`` (every worker on its own GPU,
            ``cuda:LOCAL_RANK``, summing over NCCL; refused before any worker starts if this
            host has fewer GPUs than workers), ``"cpu"`` (Gloo or shared memory), or
            ``"auto"`` (default: ``"cuda"`` when this host has a GPU for every worker, else
            ``"cpu"``; where a GPU is visible, one line on stderr says which). ``elastic=True``
            runs CPU workers; the asynchronous modes' server is one more process, with a GPU of
            its own. Choose the GPUs with ``CUDA_VISIBLE_DEVICES``; ``workers=1`` in sync mode
            trains in this process, on its GPU.
        balance: split each global batch over the towers in proportion to their measured
            speed (sync and DiLoCo modes): a slow tower gets fewer samples, no tower waits for
            another, and the averaged gradient is still the whole batch's, so the parameters
            equal one process's to float tolerance. ``None`` (default): on wherever that holds
            (not with BatchNorm without ``sync_batchnorm``, a ``collate_fn``, or GPU workers:
            one line at the start says why); ``False``: the even split of
            :func:`towers.split`, reproducible bit for bit from run to run.
            ``TrainResult.shards`` holds every step's split (docs/training.md).
        shard_optimizer: each tower keeps the optimizer's state of its part of the
            parameters only (parts balanced by elements, cut inside parameters), steps that
            part and gathers the others' (optimizers that update element by element: SGD,
            Adam, AdamW, ...). The result is the same; the state per tower is about
            ``1/workers`` of it; checkpoints hold every tower's part and resume on any
            number of towers. In ``mode="diloco:H"`` the outer state is sharded: the outer
            parameters and the outer optimizer's. With ``elastic=True`` it needs
            ``checkpoint=``: the members rebuild the state from the newest checkpoint when
            they change (docs/sharding.md).

    Returns:
        A :class:`TrainResult`.

    Raises:
        SystemExit: on Ctrl-C or ``SIGTERM`` (code 130 or 143), after stopping every worker and
            printing one line that says where the last checkpoint is. Workers also die when
            this process is killed outright (``SIGKILL``, the OOM killer).

    Example:
        >>> result = towers.train(model, mse, (x, y), batch_size=50, steps=100, workers=4)
        >>> result.losses[-1] < result.losses[0]  # doctest: +SKIP
        True
    """
    job, plan = make_job(dict(locals()))  # every argument checked here, before any worker
    out, restarts = _run(job, plan)
    return warn_if_untrained(_result(model, job, plan.workers, restarts, out))


def _run(job: Job, plan: RunPlan) -> tuple[EngineResult, int]:
    """Launch with restarts; Ctrl-C or SIGTERM ends in one line that names the last checkpoint."""
    try:
        with sigterm_interrupts():
            return _launch_with_restarts(job, plan)
    except KeyboardInterrupt as exc:
        # The workers are stopped by now; a traceback would bury the one thing to know.
        print(stopped_line(exc, job.checkpoint), file=sys.stderr, flush=True)
        raise SystemExit(143 if isinstance(exc, Terminated) else 130) from None


@contextmanager
def _checkpoint_dir(job: Job, max_restarts: int) -> Iterator[tuple[Job, bool]]:
    """The job with a checkpoint directory to restart from: a temporary one if none was given."""
    if not max_restarts or job.checkpoint is not None:
        yield job, False
        return
    scratch = tempfile.mkdtemp(prefix="towers-checkpoints-")
    try:
        yield dataclasses.replace(job, checkpoint=scratch), True
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def _launch_with_restarts(job: Job, plan: RunPlan) -> tuple[EngineResult, int]:
    workers, launched, max_restarts = plan.workers, plan.launched, plan.max_restarts
    if job.elastic and not launched and workers > 1:
        # Elastic: lost workers are dropped or replaced while the others train on.
        timeout = DEFAULT_TIMEOUT if job.timeout is None else job.timeout
        outcome = supervise(
            elastic_loop,
            workers,
            job,
            load_resume(job, workers),
            max_restarts=max_restarts,
            timeout=timeout,
            hang=min(HANG_SECONDS, timeout),
            first=plan.min_workers,
        )
        out = dataclasses.replace(outcome.result, dead_workers=outcome.dead)
        return out, outcome.replacements
    with _checkpoint_dir(job, max_restarts) as (job, isolate):
        restarts = 0
        while True:
            try:
                return _launch(job, workers, launched, isolate), restarts
            except Exception as exc:
                if launched or restarts >= max_restarts:
                    raise
                restarts += 1
                warnings.warn(
                    f"training failed ({first_line(exc)}); "
                    f"restart {restarts} of {max_restarts} from the last checkpoint",
                    RuntimeWarning,
                    stacklevel=3,
                )


def _launch(job: Job, workers: int, launched: bool, isolate: bool) -> EngineResult:
    """Run the job once: here (a launched job, or one worker) or in local worker processes."""
    resume = load_resume(job, workers)
    server = 1 if job.asynchronous else 0
    if launched or (workers + server == 1 and not isolate):
        with torch.random.fork_rng(devices=[]):
            out = run_job(job, resume)
    else:
        # Computing towers may die without stopping the server (rank 0), whose result counts.
        tolerate = range(1, workers + 1) if server else ()
        out = spawn(run_job, workers + server, job, resume, tolerate=tolerate)[0]
    assert out is not None
    return out


def _result(
    model: nn.Module, job: Job, workers: int, restarts: int, out: EngineResult
) -> TrainResult:
    trained = copy.deepcopy(model).cpu()
    trained.load_state_dict(out.state_dict)
    record = {f.name: getattr(out, f.name) for f in dataclasses.fields(out)}
    del record["state_dict"]
    return TrainResult(
        model=trained, mode=str(job.mode), workers=workers, restarts=restarts, **record
    )
