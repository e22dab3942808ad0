"""What the engines may ask of a transport: the :class:`Comm` and :class:`PointToPoint` protocols.

Engines call a :class:`Comm`; they never call ``torch.distributed`` themselves. This keeps the
averaging logic testable in one process (:class:`LocalComm`) and lets a transport (Gloo, NCCL,
shared memory) be chosen without touching the engines. The protocols name every capability a
caller uses, so an engine never probes a transport with ``getattr`` or ``isinstance``.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Protocol

import torch
import torch.distributed as dist

from ..core.secret import JobSecret
from .hang import absent_ranks, hang_error, publish_pid
from .objects import decode, encode

__all__ = [
    "Comm",
    "DistComm",
    "Levels",
    "LocalComm",
    "PeerFailure",
    "PeerTimeout",
    "PointToPoint",
    "Work",
]

_SLICE = 0.25  # seconds between checks of the interrupt while a collective waits
_SLICE_DELTA = timedelta(seconds=_SLICE)


class PeerFailure(RuntimeError):
    """A peer left the job (died, or was declared lost) while this rank waited for it.

    Raised by a transport's collectives, so that an elastic run can regroup without the
    lost rank; any other run ends with it.
    """


class PeerTimeout(PeerFailure, TimeoutError):
    """A peer did not arrive within the timeout (stuck, or issuing other collectives)."""


class Work(Protocol):
    def wait(self) -> Any: ...


class _Done:
    def wait(self) -> bool:
        return True


@dataclass(frozen=True)
class Levels:
    """A job's ranks seen in two levels: the ranks on this host, and one leader per host.

    Given by a transport that sums across hosts in stages (:mod:`towers.comm.hierarchy`), so
    that the gradient step can run its transform (a compression) among the leaders only.

    Attributes:
        local: this host's ranks (shared memory where it can be had); exact sums.
        leaders: on each host's leader (its lowest rank), one rank per host; ``None`` on the
            other ranks.
        hosts: the number of hosts.
    """

    local: Comm
    leaders: Comm | None
    hosts: int


class Comm(Protocol):
    """Collectives among ``world_size`` ranks; every rank calls them in the same order."""

    rank: int
    world_size: int
    # ``None``, or this transport's two levels across hosts: callers that sum in stages (the
    # gradient step) use them; every other caller sees one flat set of ranks either way.
    levels: Levels | None

    def all_reduce_sum(self, tensor: torch.Tensor) -> Work:
        """Start an in-place sum over ranks; ``wait()`` on the result before reading it."""
        ...

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> None: ...

    def all_to_all(self, output: torch.Tensor, input: torch.Tensor) -> Work:
        """Start sending the r-th of ``world_size`` equal parts of ``input`` to rank r; the
        r-th part of ``output`` receives rank r's part for this rank."""
        ...

    def all_gather(self, output: torch.Tensor, input: torch.Tensor) -> Work:
        """Start gathering every rank's ``input``, in rank order, into ``output``."""
        ...

    def all_gather_object(self, obj: Any) -> list[Any]: ...

    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        """``src``'s ``obj`` (picklable), returned on every rank."""
        ...

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
    levels = None

    def all_reduce_sum(self, tensor: torch.Tensor) -> Work:
        return _Done()

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> None:
        pass

    def all_to_all(self, output: torch.Tensor, input: torch.Tensor) -> Work:
        output.copy_(input)
        return _Done()

    def all_gather(self, output: torch.Tensor, input: torch.Tensor) -> Work:
        output.copy_(input)
        return _Done()

    def all_gather_object(self, obj: Any) -> list[Any]:
        return [obj]

    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        return obj

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


class _Interruptible:
    """A process group's work whose wait gives up when ``interrupt`` is set.

    Gloo reports a peer's death as a read error, but a stuck peer only after the group's
    timeout: the elastic runner's watcher sets ``interrupt`` as soon as a peer is declared
    lost, and the waiting rank raises :class:`PeerFailure` then.
    """

    def __init__(self, work: Any, interrupt: threading.Event, sliced: bool = False):
        self.work = work
        self.interrupt = interrupt
        self.sliced = sliced

    def _wait_sliced(self) -> None:
        # In slices on the work itself, with no Python callback: across hosts, a work left
        # pending in an abandoned group completes (with an error) only when a peer exits,
        # perhaps while this interpreter shuts down, and a Python callback run by Gloo's thread
        # then aborts the process (terminate called after throwing gloo::IoException).
        while not self.work.is_completed():
            try:
                self.work.wait(_SLICE_DELTA)
                return
            except RuntimeError:
                if self.work.is_completed():
                    return
                if self.interrupt.is_set():
                    raise PeerFailure(
                        "a peer was lost while this rank waited in a collective"
                    ) from None

    def wait(self) -> Any:
        if self.sliced:
            self._wait_sliced()
        elif not self.work.is_completed():
            done = threading.Event()
            self.work.get_future().add_done_callback(lambda _f: done.set())
            while not done.wait(_SLICE):
                if self.interrupt.is_set():
                    raise PeerFailure("a peer was lost while this rank waited in a collective")
        try:
            return self.work.wait()
        except RuntimeError as exc:
            raise _peer_failure(exc) from None


def _peer_failure(exc: BaseException) -> PeerFailure:
    text = str(exc).strip().splitlines()
    what = text[0] if text else type(exc).__name__
    if "timeout" in what.lower() or "timed out" in what.lower():
        return PeerTimeout(f"a peer did not arrive in time: {what}")
    return PeerFailure(f"a peer was lost: {what}")


class DistComm:
    """Collectives of a ``torch.distributed`` process group (Gloo on CPU, NCCL on GPU).

    With ``interrupt`` (elastic runs), a collective's failure raises :class:`PeerFailure`, and
    setting the event makes a waiting collective raise it too; without, a failed collective
    names the ranks that did not arrive. Object messages are signed with ``secret`` and
    checked before they are read (:mod:`towers.comm.objects`); never plain pickles.
    """

    def __init__(
        self,
        group: dist.ProcessGroup | None = None,
        timeout: float | None = None,
        interrupt: threading.Event | None = None,
        sliced: bool = False,
        secret: JobSecret | None = None,
    ):
        self.secret = secret
        self.levels: Levels | None = None
        self.sliced = sliced  # wait without Python callbacks (elastic jobs across hosts)
        self.group = group
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        self.timeout = timeout
        self.interrupt = interrupt
        self._store = _default_store() if group in (None, dist.group.WORLD) else None
        if self._store is not None:
            publish_pid(self._store, self.rank)

    def _work(self, work: Any) -> Work:
        """``work`` whose failure names the stuck ranks, or, elastic, can be interrupted."""
        if self.interrupt is None:
            return _NamingWork(work, self)
        return _Interruptible(work, self.interrupt, self.sliced)

    def _wait(self, work: Any) -> None:
        self._work(work).wait()

    @contextlib.contextmanager
    def _object_errors(self) -> Iterator[None]:
        """An object collective's failure, as :class:`PeerFailure` in elastic jobs."""
        try:
            yield
        except RuntimeError as exc:
            if self.interrupt is None:
                raise
            raise _peer_failure(exc) from None

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
        return self._work(work)

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> None:
        self._wait(dist.broadcast(tensor, src=src, group=self.group, async_op=True))

    def all_to_all(self, output: torch.Tensor, input: torch.Tensor) -> Work:
        work = dist.all_to_all_single(output, input, group=self.group, async_op=True)
        assert work is not None
        return self._work(work)

    def all_gather(self, output: torch.Tensor, input: torch.Tensor) -> Work:
        work = _gather_single(output, input, group=self.group, async_op=True)
        assert work is not None
        return self._work(work)

    def _device(self) -> torch.device:
        if dist.get_backend(self.group) == "nccl":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    def _sender(self, rank: int) -> str:
        """``"rank 2 (pid 4711 on host h)"``, as far as the rank said so in the store."""
        with contextlib.suppress(Exception):
            if self._store is not None and self._store.check([f"towers/pid/{rank}"]):
                pid, host = self._store.get(f"towers/pid/{rank}").decode().split(" ", 1)
                return f"rank {rank} (pid {pid} on host {host}, as it reported)"
        return f"rank {rank}"

    def _decode(self, data: torch.Tensor, rank: int) -> Any:
        return decode(data.cpu().numpy().tobytes(), self.secret, self._sender(rank))

    def all_gather_object(self, obj: Any) -> list[Any]:
        """Every rank's ``obj``; each message checked (:mod:`towers.comm.objects`) before use."""
        blob, device = encode(obj, self.secret), self._device()
        size = torch.tensor([len(blob)], dtype=torch.int64, device=device)
        sizes = [torch.empty_like(size) for _ in range(self.world_size)]
        with self._object_errors():
            self._wait(dist.all_gather(sizes, size, group=self.group, async_op=True))
            counts = [int(n.item()) for n in sizes]
            mine = torch.zeros(max(counts), dtype=torch.uint8, device=device)
            mine[: len(blob)] = torch.frombuffer(bytearray(blob), dtype=torch.uint8)
            out = [torch.empty_like(mine) for _ in range(self.world_size)]
            self._wait(dist.all_gather(out, mine, group=self.group, async_op=True))
        return [self._decode(t[:n], r) for r, (t, n) in enumerate(zip(out, counts))]

    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        device = self._device()
        blob = encode(obj, self.secret) if self.rank == src else b""
        size = torch.tensor([len(blob)], dtype=torch.int64, device=device)
        with self._object_errors():
            self._wait(dist.broadcast(size, src=src, group=self.group, async_op=True))
            data = torch.empty(int(size.item()), dtype=torch.uint8, device=device)
            if self.rank == src:
                data.copy_(torch.frombuffer(bytearray(blob), dtype=torch.uint8))
            self._wait(dist.broadcast(data, src=src, group=self.group, async_op=True))
        return obj if self.rank == src else self._decode(data, src)

    def barrier(self) -> None:
        self._wait(dist.barrier(group=self.group, async_op=True))

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
        blob, device = encode(obj, self.secret), self._device()
        data = torch.frombuffer(bytearray(blob), dtype=torch.uint8).to(device)
        dist.send(torch.tensor([len(blob)], dtype=torch.int64, device=device), dst, self.group)
        dist.send(data, dst, group=self.group)

    def recv_object(self, src: int) -> Any:
        size = torch.empty(1, dtype=torch.int64, device=self._device())
        dist.recv(size, src, group=self.group)
        data = torch.empty(int(size.item()), dtype=torch.uint8, device=size.device)
        dist.recv(data, src, group=self.group)
        return self._decode(data, src)


# torch >= 2.12 names it all_gather_single and deprecates the older name
_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def _default_store() -> Any:
    """The default process group's rendezvous store, or ``None`` where torch hides it."""
    try:
        return dist.distributed_c10d._get_default_store()
    except (AttributeError, RuntimeError, ValueError):
        return None
