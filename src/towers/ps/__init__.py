"""The asynchronous engine: a parameter server on ``torch.distributed`` point-to-point messages.

Process layout: rank 0 is the server (it owns the parameters, the optimizer and the learning-rate
schedule, and computes nothing); ranks 1..workers are the computing towers, tower ``rank - 1``.
``workers`` in :func:`towers.train` counts computing towers, so a local run starts
``workers + 1`` processes, and a launched run (``torchrun``) needs ``WORLD_SIZE = workers + 1``.
See docs/async.md for the protocol, each mode's semantics and the measurements behind them.
This package has no public names; :func:`towers.train` is its interface.
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist

from .._comm import DistComm
from .._context import Context
from .._sync import verify_same_model
from ._resume import check_resumable
from ._wire import Layout, ServerLink, WorkerLink
from .server import Server
from .worker import work

__all__ = ["check_resumable", "run"]


def run(ctx: Context, spec: Any) -> dict[str, Any] | None:
    """Run this rank's part; the server returns the result (every rank does if launched)."""
    if ctx.world_size < 2:
        raise ValueError(
            f"mode {spec.mode} needs a server and at least one worker: 2 or more processes, "
            f"got {ctx.world_size}"
        )
    # Messages travel on the CPU over Gloo even when the towers compute on GPUs (NCCL has no
    # way to tell a receiver that its peer died); a Gloo group beside NCCL's serves them.
    group = None if dist.get_backend() == "gloo" else dist.new_group(backend="gloo")
    comm = DistComm(group)
    verify_same_model(spec.model, comm)
    layout = Layout(spec.model)
    towers = ctx.world_size - 1
    comm.barrier()
    if ctx.rank == 0:
        link = ServerLink(comm, layout, towers)
        result = Server(spec, link, layout, towers, ctx.device).run()
        if spec.every_rank:
            for t in sorted(set(range(towers)) - set(result["dead_workers"])):
                comm.send_object(result, t + 1)
        return result
    work(WorkerLink(comm, layout), spec, ctx.rank - 1, towers, ctx.device)
    return comm.recv_object(0) if spec.every_rank else None
