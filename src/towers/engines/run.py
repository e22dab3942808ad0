"""Where a worker enters an engine: join the job, train it synchronously or through the server.

:func:`run_job` is what ``towers.train`` starts in every worker (or calls in its own process);
:func:`load_resume` reads and checks, in the caller, the checkpoint a run continues from.
"""

from __future__ import annotations

from typing import Any

import torch

from ..comm.group import connect
from ..core.data import BatchOrder, num_samples
from ..core.launch import read_launch
from . import checkpoint
from .job import EngineResult, Job
from .ps import check_resumable, run_ps
from .sync.loop import sync_loop

__all__ = ["load_resume", "run_job"]


def run_job(job: Job, resume: dict[str, Any] | None) -> EngineResult | None:
    """Train ``job`` as this rank; the rank that holds the record returns it."""
    transport = job.transport
    if job.asynchronous:
        # The parameter server talks over its own point-to-point group: a shared-memory segment
        # for collectives would go unused, so take the process group's own backend.
        transport = "nccl" if torch.cuda.is_available() else "gloo"
    conn = connect(read_launch(), timeout=job.timeout, transport=transport)
    try:
        if job.asynchronous:
            return run_ps(job, conn, resume)
        return sync_loop(job, conn, resume)
    finally:
        conn.close()


def load_resume(job: Job, workers: int) -> dict[str, Any] | None:
    """The newest checkpoint in ``job.checkpoint``, checked against ``job``; ``None`` if none.

    Read in the caller, so that a fallback warning or a mismatch is raised there, and read anew
    on every attempt, so that a restart continues from the newest checkpoint.
    """
    if job.checkpoint is None:
        return None
    kind = "ps" if job.asynchronous else "sync"
    state = checkpoint.load_latest(job.checkpoint, kind)
    if state is None:
        return None
    if state["mode"] != str(job.mode):
        raise ValueError(
            f"the checkpoint in {job.checkpoint} is of a {state['mode']!r} run, this run is "
            f"{str(job.mode)!r}; use another checkpoint directory"
        )
    if job.asynchronous:
        check_resumable(job, state, workers)
    else:
        order = BatchOrder(num_samples(job.data), job.batch_size, job.shuffle, job.seed)
        order.check_config(state["data"])
    if state["step"] > job.steps:
        raise ValueError(
            f"the checkpoint in {job.checkpoint} is at step {state['step']}, beyond "
            f"steps={job.steps}; ask for at least {state['step']} steps"
        )
    return state
