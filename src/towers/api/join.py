"""``towers.init()``: join the job this process was launched into, elastic or not.

A job started by ``towers run --elastic`` gets an
:class:`~towers.api.elastic_context.ElasticContext`, any other one a
:class:`~towers.api.context.Context`; the script is the same.
"""

from __future__ import annotations

from ..comm.elastic import ElasticConnection
from ..core.launch import read_launch
from . import context
from .context import Context
from .elastic_context import ElasticContext

__all__ = ["init"]


def init(
    *, backend: str | None = None, timeout: float | None = None, transport: str | None = None
) -> Context:
    """Join the job this process was launched into and return its :class:`Context`.

    Reads the torchrun environment (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``,
    ``MASTER_PORT``), set by ``torchrun``, ``towers run`` and :func:`towers.spawn`, and joins the
    process group over env:// (Gloo on CPU, NCCL when CUDA is available). Without those variables
    the process is a world of one and no process group is created. Under
    ``towers run --elastic`` the job goes on without lost workers (docs/elastic.md).

    Args:
        backend: ``"gloo"`` or ``"nccl"``; chosen from the hardware by default.
        timeout: seconds a rank may wait for the others (rendezvous or a collective) before
            the job fails; default 60. A dead or stuck worker thus ends the job instead of
            hanging it.
        transport: how gradients are averaged: ``"shm"`` (shared memory; every rank on this
            host, CPU tensors), ``"gloo"``/``"nccl"`` (the process group), or ``"auto"``
            (default, or the ``TOWERS_TRANSPORT`` environment variable): shared memory where it
            applies, the process group otherwise. Every rank must ask for the same one.

    Example:
        >>> ctx = towers.init()
        >>> model = ctx.replicate(build_model())  # doctest: +SKIP
    """
    launch = read_launch()
    if not launch.elastic:
        return context.init(backend=backend, timeout=timeout, transport=transport)
    if backend not in (None, "gloo") or transport == "nccl":
        raise ValueError("towers run --elastic runs CPU workers: use backend='gloo'")
    conn = ElasticConnection(launch, transport or "auto", timeout, joining=launch.joining)
    return ElasticContext(conn)
