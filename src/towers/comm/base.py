"""What the engines may ask of a transport: the :class:`Comm` and :class:`PointToPoint` protocols.

Engines call a :class:`Comm`; they never call ``torch.distributed`` themselves. This keeps the
averaging logic testable in one process (:class:`LocalComm`) and lets a transport (Gloo, NCCL,
shared memory) be chosen without touching the engines. The protocols name every capability a
caller uses, so an engine never probes a transport with ``getattr`` or ``isinstance``.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch
import torch.distributed as dist

from .hang import absent_ranks, hang_error, publish_pid

__all__ = ["Comm", "DistComm", "LocalComm", "PointToPoint", "Work"]


class Work(Protocol):
    def wait(self) -> Any: ...


class _Done:
    def wait(self) -> bool:
        return True


class Comm(Protocol):
    """Collectives among ``world_size`` ranks; every rank calls them in the same order."""

    rank: int
    world_size: int

    def all_reduce_sum(self, tensor: torch.Tensor) -> Work:
        """Start an in-place sum over ranks; ``wait()`` on the result before reading it."""
        ...

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> None: ...

    def all_gather_object(self, obj: Any) -> list[Any]: ...

    def barrier(self) -> None: ...

    def buffer(self, numel: int, dtype: torch.dtype) -> torch.Tensor | None:
        """A zeroed tensor whose sums this transport computes in place, or ``None``.

        A collective (every rank calls it in the same order). A transport that can sum in place
        (shared memory) lends buffers so that gradients are packed straight where the peers
        read them; the others return ``None`` and sum the caller's own tensors.
        """
        ...

    def close(self) -> None:
        """Finish pending work and release what the transport holds (not the process group)."""
        ...


class PointToPoint(Protocol):
    """Messages between two ranks (the parameter server's transport); see :class:`DistComm`."""

    rank: int
    world_size: int

    def isend(self, tensor: torch.Tensor, dst: int) -> Work:
        """Start sending ``tensor`` to ``dst``; keep it unchanged until ``wait()`` returns."""
        ...

    def recv(self, tensor: torch.Tensor, src: int) -> None:
        """Receive into ``tensor`` from ``src``; raises if ``src`` died (its connection closed)."""
        ...

    def send_object(self, obj: Any, dst: int) -> None: ...

    def recv_object(self, src: int) -> Any: ...


class LocalComm:
    """A world of one process: every collective is the identity."""

    rank = 0
    world_size = 1

    def all_reduce_sum(self, tensor: torch.Tensor) -> Work:
        return _Done()

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> None:
        pass

    def all_gather_object(self, obj: Any) -> list[Any]:
        return [obj]

    def barrier(self) -> None:
        pass

    def buffer(self, numel: int, dtype: torch.dtype) -> torch.Tensor | None:
        return None

    def close(self) -> None:
        pass


class _NamingWork:
    """A collective's work whose failed wait names the rank that never arrived."""

    def __init__(self, work: Any, comm: DistComm):
        self._work, self._comm = work, comm

    def wait(self) -> Any:
        try:
            return self._work.wait()
        except RuntimeError as exc:
            raise self._comm.name_stuck(exc) from exc


class DistComm:
    """Collectives of a ``torch.distributed`` process group (Gloo on CPU, NCCL on GPU)."""

    def __init__(self, group: dist.ProcessGroup | None = None, timeout: float | None = None):
        self.group = group
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        self.timeout = timeout
        self._store = _default_store() if group in (None, dist.group.WORLD) else None
        if self._store is not None:
            publish_pid(self._store, self.rank)

    def name_stuck(self, exc: BaseException) -> BaseException:
        """:class:`PeerHang` naming the ranks that did not arrive, if some did not; else ``exc``.

        Called on every rank whose collective failed; they check in with each other through the
        rendezvous store (for up to a second).
        """
        if self._store is None or self.world_size == 1:
            return exc
        absent = absent_ranks(self._store, self.rank, self.world_size)
        if absent is None:  # the store, hosted by rank 0's process, does not answer
            absent = [(0, None, False)]
        if not absent:
            return exc
        return hang_error(self.rank, absent, self.timeout, "a collective")

    def all_reduce_sum(self, tensor: torch.Tensor) -> Work:
        work = dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=self.group, async_op=True)
        assert work is not None
        return _NamingWork(work, self)

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> None:
        dist.broadcast(tensor, src=src, group=self.group)

    def all_gather_object(self, obj: Any) -> list[Any]:
        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, obj, group=self.group)
        return out

    def barrier(self) -> None:
        try:
            dist.barrier(group=self.group)
        except RuntimeError as exc:
            raise self.name_stuck(exc) from exc

    def buffer(self, numel: int, dtype: torch.dtype) -> torch.Tensor | None:
        return None

    def close(self) -> None:
        pass

    def isend(self, tensor: torch.Tensor, dst: int) -> Work:
        work = dist.isend(tensor, dst, group=self.group)
        assert work is not None
        return work

    def recv(self, tensor: torch.Tensor, src: int) -> None:
        dist.recv(tensor, src, group=self.group)

    def send_object(self, obj: Any, dst: int) -> None:
        dist.send_object_list([obj], dst, group=self.group)

    def recv_object(self, src: int) -> Any:
        out: list[Any] = [None]
        dist.recv_object_list(out, src, group=self.group)
        return out[0]


def _default_store() -> Any:
    """The default process group's rendezvous store, or ``None`` where torch hides it."""
    try:
        return dist.distributed_c10d._get_default_store()
    except (AttributeError, RuntimeError, ValueError):
        return None
