"""What the engines may ask of a transport: the :class:`Comm` and :class:`PointToPoint` protocols.

Engines call a :class:`Comm`; they never call ``torch.distributed`` themselves. This keeps the
averaging logic testable in one process (:class:`LocalComm`) and lets a transport (Gloo, NCCL,
shared memory) be chosen without touching the engines. The protocols name every capability a
caller uses, so an engine never probes a transport with ``getattr`` or ``isinstance``.
"""

from __future__ import annotations

import atexit
import collections
import contextlib
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.distributed as dist

from ..core.secret import JobSecret
from .failure import Interruptible, PeerFailure, PeerTimeout, peer_failure
from .hang import CallMismatch, absent_ranks, call_mismatch, calling, hang_error, publish_pid
from .objects import decode, encode

__all__ = [
    "DEFAULT_TIMEOUT",
    "Comm",
    "DistComm",
    "Levels",
    "LocalComm",
    "PeerFailure",
    "PeerTimeout",
    "PointToPoint",
    "Work",
]

# How long a rank waits for the others (rendezvous, or any collective) before the job fails:
# a dead or stuck worker ends the job within this bound instead of hanging it.
DEFAULT_TIMEOUT = 60.0

# The newest works of every process group of this process (see _keep).
_KEPT: collections.deque[Any] = collections.deque(maxlen=16)


def _keep(work: Any) -> None:
    """Reference ``work`` from here until 16 newer works replace it, or the interpreter ends.

    A Gloo or NCCL thread lets go of a work a moment after the work completes. If Python has
    dropped one of its tensors by then, that thread holds the tensor's last reference and takes
    the GIL to free it; when that falls in the last milliseconds before the interpreter shuts
    down (a job's final collective, then the script's end), Python ends the thread inside a C++
    destructor and the process aborts with "terminate called without an active exception"
    (pytorch#38228). Kept here, the work is freed by Python instead.
    """
    _KEPT.append(work)


def _settle() -> None:
    """At exit, before the interpreter shuts down: a pause with the GIL released, in which a
    transport thread still letting go of a work another library started (Lightning's metric
    sums, a script's own ``dist.all_reduce``), and so waiting for the GIL, gets it (see
    :func:`_keep`). Registered by the first :class:`DistComm` of the process."""
    time.sleep(SETTLE_SECONDS)


SETTLE_SECONDS = 0.05  # a thread's free of a finished work takes microseconds: a wide margin
_settling = False


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

    @property
    def levels(self) -> Levels | None:
        """``None``, or this transport's two levels across hosts: callers that sum in stages
        (the gradient step) use them; every other caller sees one flat set of ranks either way."""
        ...

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

    def agree_call(self, what: str) -> None:
        """Check that every rank makes the call ``what`` now, before any collective of it."""
        ...

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

    def agree_call(self, what: str) -> None:
        calling(what)

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
        global _settling
        if not _settling:  # at exit, after whatever the script registered later
            atexit.register(_settle)
            _settling = True
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
        self._calls = 0  # agree_call()s so far

    def _work(self, work: Any) -> Work:
        """``work`` whose failure names the stuck ranks, or, elastic, can be interrupted."""
        _keep(work)
        if self.interrupt is None:
            return _NamingWork(work, self)
        return Interruptible(work, self.interrupt, self.sliced)

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
            raise peer_failure(exc) from None

    def name_stuck(self, exc: BaseException) -> BaseException:
        """:class:`PeerHang` naming the ranks that did not arrive, if some did not; else ``exc``.

        Called on every rank whose collective failed; they check in with each other through the
        rendezvous store (for up to a second).
        """
        if self._store is None or self.world_size == 1:
            return exc
        got = absent_ranks(self._store, self.rank, self.world_size)
        # the store, hosted by rank 0's process, does not answer: rank 0 is the stuck one
        absent, calls = got if got is not None else ([(0, None, False)], {})
        mismatch = call_mismatch(self.rank, calls)
        if mismatch is not None:
            return mismatch
        if not absent:
            return exc
        return hang_error(self.rank, absent, self.timeout, "a collective")

    def mismatched_calls(self) -> CallMismatch | None:
        """Check in with the others (a rank gave up waiting): were the ranks in other calls?"""
        if self._store is None or self.world_size == 1:
            return None
        got = absent_ranks(self._store, self.rank, self.world_size)
        return None if got is None else call_mismatch(self.rank, got[1])

    def agree_call(self, what: str) -> None:
        """Check, before its collectives, that every rank is making the call ``what`` now.

        Each rank leaves ``what`` under this call's number in the rendezvous store and waits
        for the others'. Different calls are refused at once (:class:`~towers.comm.hang.
        CallMismatch`, naming each rank's); a rank that never comes (it is in another call, or
        stuck) is named after the timeout. The point is never to issue collectives that do not
        match: Gloo aborts a process whose collective meets one of another size.
        """
        calling(what)
        if self._store is None or self.world_size == 1:
            return
        self._calls += 1
        keys = [f"towers/call/{self._calls}/{r}" for r in range(self.world_size)]
        self._store.set(keys[self.rank], what)
        deadline = time.monotonic() + (DEFAULT_TIMEOUT if self.timeout is None else self.timeout)
        pause = 2e-4  # polled (a timed store wait logs a warning each time it expires)
        while not self._store.check(keys):
            if self.interrupt is not None and self.interrupt.is_set():
                raise PeerFailure("a peer was lost while the ranks agreed on a call")
            if time.monotonic() > deadline:
                raise self.name_stuck(
                    TimeoutError(f"rank {self.rank} waited in vain for the others in {what}")
                )
            time.sleep(pause)
            pause = min(2 * pause, 0.02)
        calls = {r: self._store.get(key).decode() for r, key in enumerate(keys)}
        mismatch = call_mismatch(self.rank, calls)
        if mismatch is not None:
            raise mismatch

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
