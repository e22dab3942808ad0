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


class DistComm:
    """Collectives of a ``torch.distributed`` process group (Gloo on CPU, NCCL on GPU)."""

    def __init__(self, group: dist.ProcessGroup | None = None):
        self.group = group
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)

    def all_reduce_sum(self, tensor: torch.Tensor) -> Work:
        work = dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=self.group, async_op=True)
        assert work is not None
        return work

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> None:
        dist.broadcast(tensor, src=src, group=self.group)

    def all_gather_object(self, obj: Any) -> list[Any]:
        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, obj, group=self.group)
        return out

    def barrier(self) -> None:
        dist.barrier(group=self.group)

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
