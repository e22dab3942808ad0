"""What puts each transport on top of a job's process group: one builder per registered name.

A transport is its declaration (:class:`~towers.core.transport.Transport`: the devices it
moves, whether an elastic job can regroup over it, whether it joins ranks of one host only)
and a builder here, which turns the job's :class:`~towers.comm.base.DistComm` into the
:class:`~towers.comm.base.Comm` the engines sum through. :func:`register` registers both, so a
new transport is one module and one call::

    ORDERED = register(
        Transport("ordered", "sums in rank order", ("cpu",), module=__name__),
        lambda base, timeout, interrupt: OrderedComm(base),
    )

after which ``towers.train(transport="ordered")``, ``towers.init(transport="ordered")`` and
``TOWERS_TRANSPORT=ordered`` use it, and every refusal (an elastic job, a device it does not
move) is written from its declaration (:mod:`towers.core.compat`, :mod:`towers.core.devices`).
``auto`` has no builder of its own: it is shared memory where that applies, else the group
(:func:`build`; across hosts, two levels: :func:`towers.comm.group.choose_transport`).
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import torch.distributed as dist

from ..core.transport import Transport, declare
from .base import Comm, DistComm
from .shm import ShmComm, ShmUnavailable

__all__ = ["BUILDERS", "Builder", "build", "register"]

# (the job's process group, the collectives' timeout, what interrupts a wait in an elastic job)
Builder = Callable[[DistComm, float, "threading.Event | None"], Comm]

BUILDERS: dict[Transport, Builder] = {}


def register(transport: Transport, builder: Builder) -> Transport:
    """Declare ``transport`` (:func:`towers.core.transport.declare`) and build it with
    ``builder``; returns it."""
    declare(transport)
    BUILDERS[transport] = builder
    return transport


def _group(base: DistComm, timeout: float, interrupt: threading.Event | None) -> Comm:
    return base


def _shm(base: DistComm, timeout: float, interrupt: threading.Event | None) -> Comm:
    try:
        return ShmComm(base, timeout=timeout, interrupt=interrupt)
    except ShmUnavailable as exc:
        raise RuntimeError(f"transport='shm' is not available: {exc}") from None


register(Transport.SHM, _shm)
register(Transport.GLOO, _group)
register(Transport.NCCL, _group)


def build(
    base: DistComm,
    transport: Transport,
    timeout: float,
    interrupt: threading.Event | None = None,
) -> Comm:
    """``transport`` over ``base``'s ranks: ``auto`` is shared memory where it applies (CPU
    workers, its segment available), else the process group.

    ``interrupt`` (elastic jobs) lets a waiting collective be interrupted.

    Raises:
        ValueError: the transport does not move the tensors of the group's backend.
        RuntimeError: it cannot serve here (shared memory unavailable).
    """
    if base.world_size == 1:
        return base
    backend = dist.get_backend(base.group)
    moves = "cpu" if backend == "gloo" else "cuda"
    if transport is Transport.AUTO:
        if moves != "cpu":
            return base
        try:
            return ShmComm(base, timeout=timeout, interrupt=interrupt)
        except ShmUnavailable:
            return base
    if moves not in transport.devices:
        uses = " or ".join(repr(t.name) for t in Transport.registered() if moves in t.devices)
        raise ValueError(
            f"transport={transport.name!r} moves {'/'.join(transport.devices).upper()} "
            f"tensors; this job runs on {backend} ({moves.upper()} tensors): use transport="
            f"{uses}"
        )
    return BUILDERS[transport](base, timeout, interrupt)
