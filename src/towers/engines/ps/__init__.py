"""The asynchronous engine: a parameter server on ``torch.distributed`` point-to-point messages.

Process layout: rank 0 is the server (it owns the parameters, the optimizer and the learning-rate
schedule, and computes nothing); ranks 1..workers are the computing towers, tower ``rank - 1``.
``workers`` in :func:`towers.train` counts computing towers, so a local run starts
``workers + 1`` processes, and a launched run (``torchrun``) needs ``WORLD_SIZE = workers + 1``.
See docs/async.md for the protocol, each mode's semantics and the measurements behind them.

The job's mode (a :class:`~towers.engines.ps.mode.ServerMode`) is asked once, here: for the
server's policy and for each tower's role; the server and the towers never look at it again.

Messages go through shared memory when every rank runs on one host
(:class:`~towers.comm.mailbox.ShmPointToPoint`: memory copies instead of loopback TCP), and over
Gloo point-to-point otherwise, or with ``transport="gloo"``.
"""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

import torch.distributed as dist

from ...comm.base import DistComm, PointToPoint
from ...comm.group import DEFAULT_TIMEOUT, Connection
from ...comm.mailbox import ShmPointToPoint
from ...comm.segment import ShmUnavailable
from ...core.transport import Transport
from ...processes.env import set_process_name
from ..broadcast import verify_same_model
from ..job import EngineResult, Job
from .mode import ServerMode, server_mode
from .resume import check_resumable
from .server import Server
from .wire import Layout, ServerLink, WorkerLink
from .worker import work

__all__ = ["ServerMode", "check_resumable", "run_ps"]


def run_ps(job: Job, conn: Connection, resume: dict[str, Any] | None) -> EngineResult | None:
    """Run this rank's part; the server returns the result (every rank does if launched)."""
    world, rank = conn.comm.world_size, conn.comm.rank
    mode = server_mode(job.mode)
    if world < 2:
        raise ValueError(
            f"mode {job.mode} needs a server and at least one worker: 2 or more processes, "
            f"got {world}"
        )
    # Messages travel on the CPU over Gloo even when the towers compute on GPUs (NCCL has no
    # way to tell a receiver that its peer died); a Gloo group beside NCCL's serves them.
    group = None if dist.get_backend() == "gloo" else dist.new_group(backend="gloo")
    comm = DistComm(group, secret=conn.secret)
    verify_same_model(job.model, comm)
    layout = Layout(job.model)
    towers = world - 1
    messages = _messages(job, comm, layout.size)
    comm.barrier()
    if rank == 0:
        set_process_name("towers-server")
        link = ServerLink(messages, layout, towers)
        server = Server(job, link, layout, towers, conn.device, mode.policy(towers), resume)
        result = server.run()
        if job.every_rank:
            # As plain data: a job without a secret accepts nothing else (comm/objects.py).
            for t in sorted(set(range(towers)) - set(result.dead_workers)):
                comm.send_object(asdict(result), t + 1)
        return result
    set_process_name(f"towers-tower{rank - 1}")
    work(WorkerLink(messages, layout), job, mode.role(), rank - 1, towers, conn.device)
    return EngineResult(**comm.recv_object(0)) if job.every_rank else None


def _messages(job: Job, comm: DistComm, size: int) -> PointToPoint:
    """Shared memory between the server and its workers on one host, else ``comm`` (Gloo)."""
    transport = job.transport
    if transport not in (Transport.AUTO, Transport.SHM):
        return comm
    timeout = DEFAULT_TIMEOUT if job.timeout is None else job.timeout
    try:
        return ShmPointToPoint(comm, size, timeout=timeout)
    except ShmUnavailable as exc:
        if transport is Transport.SHM:
            raise RuntimeError(f"transport='shm' is not available: {exc}") from None
        return comm
