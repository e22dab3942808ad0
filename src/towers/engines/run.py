"""Where a worker enters an engine: join the job, train it with the engine its mode names.

:func:`run_job` is what ``towers.train`` starts in every worker (or calls in its own process);
:func:`load_resume` reads and checks, in the caller, the checkpoint a run continues from. Which
engine trains a job is its mode's ``engine`` (:mod:`towers.engines.modes`); each engine's entry,
resume check and transport are in ``_ENGINES``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..comm.group import Connection, connect
from ..core.data import BatchOrder, num_samples
from ..core.launch import read_launch
from ..core.modes import Engine
from ..core.transport import Transport
from . import checkpoint
from .job import EngineResult, Job
from .ps import check_resumable, run_ps
from .sync.loop import sync_loop
from .sync.mode import SyncMode

__all__ = ["load_resume", "run_job"]


def _check_sync_resumable(job: Job, state: dict[str, Any], workers: int) -> None:
    BatchOrder(num_samples(job.data), job.batch_size, job.shuffle, job.seed).check_config(
        state["data"]
    )
    if isinstance(job.mode, SyncMode):
        job.mode.check_resumable(state, workers)


@dataclass(frozen=True)
class _Entry:
    train: Callable[[Job, Connection, dict[str, Any] | None], EngineResult | None]
    check_resumable: Callable[[Job, dict[str, Any], int], None]  # ValueError if it cannot go on
    # Talks point to point over the process group's own backend: a shared-memory segment for
    # collectives would go unused.
    point_to_point: bool


_ENGINES = {
    Engine.SYNC: _Entry(sync_loop, _check_sync_resumable, point_to_point=False),
    Engine.SERVER: _Entry(run_ps, check_resumable, point_to_point=True),
}


def run_job(job: Job, resume: dict[str, Any] | None) -> EngineResult | None:
    """Train ``job`` as this rank; the rank that holds the record returns it."""
    engine = _ENGINES[job.mode.engine]
    transport = job.transport
    if engine.point_to_point:
        transport = Transport.NCCL if job.device == "cuda" else Transport.GLOO
    conn = connect(read_launch(), timeout=job.timeout, transport=transport, device=job.device)
    try:
        return engine.train(job, conn, resume)
    finally:
        conn.close()


def load_resume(job: Job, workers: int) -> dict[str, Any] | None:
    """The newest checkpoint in ``job.checkpoint``, checked against ``job``; ``None`` if none.

    Read in the caller, so that a fallback warning or a mismatch is raised there, and read anew
    on every attempt, so that a restart continues from the newest checkpoint.
    """
    if job.checkpoint is None:
        return None
    state = checkpoint.load_latest(job.checkpoint, job.mode.engine.value)
    if state is None:
        return None
    if state["mode"] != str(job.mode):
        raise ValueError(
            f"the checkpoint in {job.checkpoint} is of a {state['mode']!r} run, this run is "
            f"{str(job.mode)!r}; use another checkpoint directory"
        )
    _ENGINES[job.mode.engine].check_resumable(job, state, workers)
    if state["step"] > job.steps:
        raise ValueError(
            f"the checkpoint in {job.checkpoint} is at step {state['step']}, beyond "
            f"steps={job.steps}; ask for at least {state['step']} steps"
        )
    return state
