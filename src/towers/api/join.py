"""``towers.init()``: join the job this process was launched into, elastic or not.

A job started by ``towers run --elastic`` gets a :class:`~towers.api.context.Context` over an
elastic group (:class:`~towers.engines.sync.group.ElasticGroup`), any other one a context over
its fixed process group; the script is the same.
"""

from __future__ import annotations

import contextlib
import importlib

from ..comm.elastic import ElasticConnection
from ..comm.group import connect
from ..core.args import check_timeout
from ..core.compat import elastic_refusal
from ..core.launch import Launch, read_launch
from ..core.transport import Transport
from ..engines.sync.group import ElasticGroup, PlainGroup
from .context import Context
from .device import loop_placement

__all__ = ["init", "join"]

_NO = "start the job without --elastic"  # how to train on GPUs instead


def init(
    *,
    backend: str | None = None,
    timeout: float | None = None,
    transport: str | None = None,
    device: str = "auto",
) -> Context:
    """Join the job this process was launched into and return its :class:`Context`.

    Reads the torchrun environment (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``,
    ``MASTER_PORT``), set by ``torchrun``, ``towers run`` and :func:`towers.spawn`, and joins the
    process group over env:// (NCCL for GPU workers, Gloo for CPU workers). Without those
    variables the process is a world of one and no process group is created. Under
    ``towers run --elastic`` the job goes on without lost workers (docs/elastic.md).

    Args:
        backend: ``"gloo"`` (CPU workers) or ``"nccl"`` (GPU workers); follows ``device`` by
            default.
        timeout: seconds a rank may wait for the others (rendezvous or a collective) before
            the job fails; default 60. A dead or stuck worker thus ends the job instead of
            hanging it.
        transport: how gradients are averaged: ``"shm"`` (shared memory; every rank on this
            host, CPU tensors), ``"gloo"``/``"nccl"`` (the process group), or ``"auto"``
            (default, or the ``TOWERS_TRANSPORT`` environment variable): shared memory where it
            applies, the process group otherwise. Every rank must ask for the same one.
        device: ``"cuda"`` (this rank computes on ``cuda:LOCAL_RANK``, NCCL; an error if this
            host has fewer GPUs than ranks), ``"cpu"`` (Gloo or shared memory), or ``"auto"``
            (default: ``"cuda"`` when every rank on this host has a GPU of its own, else
            ``"cpu"``). :attr:`Context.device` says which; ranks that chose differently
            are refused at the rendezvous.

    Example:
        >>> ctx = towers.init()
        >>> model = ctx.replicate(build_model())  # doctest: +SKIP
    """
    launch = read_launch()
    if launch.mode != "sync":
        raise ValueError(
            f"this job was started with --mode {launch.mode}, which applies to scripts that call "
            "towers.train (and to towers.ddp); the own-loop API takes its mode in "
            "ctx.replicate(model, mode=...): start the script without --mode"
        )
    return join(launch, backend=backend, timeout=timeout, transport=transport, device=device)


def join(
    launch: Launch,
    *,
    backend: str | None = None,
    timeout: float | None = None,
    transport: str | None = None,
    device: str = "auto",
) -> Context:
    """:func:`init` for the job ``launch`` describes, whatever mode it was started with (the
    caller decides what the mode means: ``towers.ddp`` takes it as its models' mode)."""
    timeout = check_timeout(timeout)
    parsed = Transport.parse(transport, launch.transport)
    if backend not in (None, "gloo", "nccl"):
        raise ValueError(f"backend must be 'gloo' or 'nccl', got {backend!r}")
    if launch.elastic:
        asked = None if backend is None else f"backend={backend!r}"
        over = Transport.parse(backend) if parsed is Transport.AUTO and backend else parsed
        refused = elastic_refusal("towers run --elastic", transport=over, asked=asked, instead=_NO)
        if refused is not None:
            raise ValueError(refused)
    placement = loop_placement(device, launch, backend, parsed)
    if not launch.elastic:
        plain = connect(launch, timeout=timeout, transport=parsed, device=placement.kind)
        return Context(PlainGroup(plain))
    elastic = ElasticConnection(launch, parsed, timeout, joining=launch.joining).start()
    group = ElasticGroup(elastic)
    if not elastic.joining:
        group.join()  # rank and world size are known from here on
    else:
        # A newcomer is let in once ctx.replicate has built its model; what the loop does
        # after that before its first step, the members wait for. Its first optimizer imports
        # torch._dynamo (0.8 s on a small machine): import it now, while the job trains on.
        with contextlib.suppress(ImportError):
            importlib.import_module("torch._dynamo")
    return Context(group)
