"""Averaging through shared memory, for worker processes on one host and CPU tensors.

Gloo moves a local all-reduce through loopback TCP: about 1.3 GB/s and milliseconds of latency
on small messages, where a one-thread memcpy moves tens of GB/s. :class:`ShmComm` sums through
one shared segment instead, with the same :class:`~towers._comm.Comm` interface, so the engines
do not change. Collectives other than the sum (start-up broadcasts, object gathers, barriers)
go through the process group it was built on.

The segment holds, for each of two alternating generations, one input slot per rank, and one
result area. A message is cut into chunks of at most one slot; each chunk is summed as:

- small chunks: every rank copies its tensor into its slot, a barrier, then every rank adds all
  slots in rank order into its own tensor (one barrier; each rank computes the same bytes with
  the same kernel, so every rank holds identical numbers);
- large chunks: reduce-scatter then all-gather over the ranks, so that all cores work. Rank r
  owns part r of the chunk: it copies the other parts into its slot, and after a barrier adds
  everyone's part r to its own and publishes it in the result area; after a second barrier it
  copies the other ranks' parts from there. Each element is summed once, by its owner, so every
  rank reads the same bytes.

Writing a slot again two chunks later is safe without a third barrier: the chunk in between
passed a barrier that every rank reaches only after it finished reading the older chunk.

Buffers lent by :meth:`ShmComm.buffer` (the engine packs its gradient buckets into them) skip the
copies, which moves about 2.5 times fewer bytes: after a barrier, rank r adds the peers' part r
to its own buffer in place and writes the sum into part r of every peer's buffer; after a
second barrier every buffer holds the whole sum. Between the barriers only rank r touches part
r of any buffer, and after the second no rank reads another's buffer, so each may write its
own again at once (the next gradients). Pushing the sums (instead of each rank pulling the
others' parts after the second barrier) saves the third barrier that pulling needs, and each
barrier is a point where a rank on a busy machine may wait for a peer that is not running.

Sums run when their work is waited on, in launch order, on the calling thread: on CPU the
cores are busy with backward anyway, so a helper thread (``threaded=True``) adds GIL hand-offs
and gains nothing measurable on 2 cores (docs/performance.md).

Synchronisation: one named POSIX semaphore per rank. Arriving at a barrier posts one token to
every other rank and takes ``world_size - 1`` from its own; since no rank passes barrier k
before every rank arrived at it, counting tokens is enough. How a rank waits for its tokens is
:class:`towers.comm.wait.Waiter`'s: it polls (without yielding) only while recent waits were
shorter than ``spin`` (100 us), and otherwise sleeps in ``sem_timedwait`` at once, so that a
waiting rank leaves the core to its peers and to other jobs on a busy machine. An earlier
version yield-polled for 1 ms on every barrier: under one busy process on 2 cores it spent
3 to 6 times as long inside barriers as sleeping does (medians), because a rank that yields
is runnable and so is not woken when its peer arrives (docs/performance.md). Every rank also counts
its arrivals in the segment, so a waiter that gives up names the rank that did not arrive
(:class:`~towers.comm.hang.PeerHang`). A blocked waiter checks that its peers are alive, and
gives up after ``timeout`` seconds.

Nothing outlives the job: rank 0 unlinks the segment file and the semaphores as soon as every
rank has attached, so the memory is freed when the last process exits, even on ``SIGKILL``
(:mod:`towers.comm.segment`).
"""

from __future__ import annotations

import collections
import contextlib
import ctypes
import os
import threading
import time
import weakref
from typing import Any

import torch

from .base import Comm, DistComm, PeerFailure, Work
from .hang import hang_error
from .segment import SHM_DIR, ShmUnavailable, alive, host_key, open_shared
from .wait import DEFAULT_SPIN_SECONDS, Waiter

__all__ = ["SHM_DIR", "ShmComm", "ShmUnavailable"]

DEFAULT_SLOT_BYTES = 4 * 1024 * 1024
# Below this, one barrier and every rank summing everything beats reduce-scatter/all-gather,
# whose second barrier and extra kernel launches cost more than the bandwidth they save.
SMALL_BYTES = 256 * 1024
_ALIGN = 64
_SLICE = 0.25  # seconds between liveness checks of the peers while blocked


class _Op:
    """One all-reduce: the caller's tensor, and what wait() reports."""

    def __init__(self, tensor: torch.Tensor):
        self.tensor = tensor
        self.done = threading.Event()
        self.error: BaseException | None = None


class _Work:
    def __init__(self, comm: ShmComm, op: _Op):
        self._comm = comm
        self._op = op

    def wait(self) -> bool:
        self._comm._complete(self._op)
        if self._op.error is not None:
            raise self._op.error
        return True


class ShmComm:
    """A :class:`~towers._comm.Comm` whose all-reduce runs through shared memory.

    Built collectively on every rank of ``base`` (a process group whose ranks share this host);
    ``base`` carries the other collectives. ``all_reduce_sum`` returns at once; the sum runs
    when the work is waited on (or on a helper thread with ``threaded=True``), in launch order
    either way. A barrier polls for at most ``spin`` seconds, and only while recent waits were
    that short, before it sleeps (:class:`~towers.comm.wait.Waiter`).

    Raises:
        ShmUnavailable: on every rank alike, if the ranks are not on one host or the segment
            cannot be created.
    """

    def __init__(
        self,
        base: Comm,
        *,
        timeout: float = 60.0,
        slot_bytes: int = DEFAULT_SLOT_BYTES,
        spin: float = DEFAULT_SPIN_SECONDS,
        threaded: bool = False,
        interrupt: threading.Event | None = None,
    ):
        self.base = base
        self.levels = None  # one host: no levels
        self.interrupt = interrupt
        self.rank = base.rank
        self.world_size = base.world_size
        self.timeout = timeout
        self.spin = spin
        self.slot_bytes = slot_bytes - slot_bytes % _ALIGN
        if self.slot_bytes <= 0:
            raise ValueError(f"slot_bytes must be at least {_ALIGN}, got {slot_bytes}")
        info = base.all_gather_object((host_key(), os.getpid()))
        if any(key != info[0][0] for key, _ in info):
            raise ShmUnavailable("the ranks run on more than one host")
        self._peers = [(r, pid) for r, (_, pid) in enumerate(info) if r != self.rank]
        size = (2 * self.world_size + 1) * self.slot_bytes
        # After the slots: one arrival counter per rank (a cache line each), so that a waiter
        # that gives up can name the rank that never arrived.
        self._bytes, self._sems = open_shared(
            base, size + self.world_size * _ALIGN, self.world_size
        )
        self._arrivals = [
            ctypes.c_int64.from_address(self._bytes.data_ptr() + size + r * _ALIGN)
            for r in range(self.world_size)
        ]
        self._mine = self._sems[self.rank]
        self._waiter = Waiter(self._mine, spin)
        self._others = [s for r, s in enumerate(self._sems) if r != self.rank]
        # buffers from buffer(): (start address, end address, every rank's bytes)
        self._regions: list[tuple[int, int, list[torch.Tensor]]] = []
        self._chunks = 0  # chunks summed so far: picks the generation of slots to use
        self._queue: collections.deque[_Op] = collections.deque()
        self._lock = threading.Lock()
        self._broken: BaseException | None = None
        self._thread: threading.Thread | None = None
        self._wake = threading.Condition(self._lock)
        self._closing = False
        if threaded:
            self._thread = threading.Thread(target=self._serve, name="towers-shm", daemon=True)
            self._thread.start()

    # -- set-up ---------------------------------------------------------------------------------

    def _slot(self, generation: int, rank: int, dtype: torch.dtype, n: int) -> torch.Tensor:
        start = (generation * self.world_size + rank) * self.slot_bytes
        return self._bytes[start : start + n * dtype.itemsize].view(dtype)

    def _result(self, dtype: torch.dtype, n: int) -> torch.Tensor:
        start = 2 * self.world_size * self.slot_bytes
        return self._bytes[start : start + n * dtype.itemsize].view(dtype)

    def buffer(self, numel: int, dtype: torch.dtype) -> torch.Tensor | None:
        """A zeroed buffer in shared memory whose sums skip the copy into the slots.

        A collective: every rank calls it, in the same order, with the same arguments. Sums of
        views of it at the same offset on every rank read the peers' buffers in place and
        write only this rank's, so they move less than half the bytes of the general path.

        Returns:
            The buffer, or ``None`` on every rank if shared memory is short (a container's
            /dev/shm is often 64 MB): the caller keeps its own tensor, summed by copy.
        """
        nbytes = numel * dtype.itemsize
        stride = -(-max(nbytes, 1) // _ALIGN) * _ALIGN
        try:
            shared, _ = open_shared(self.base, stride * self.world_size, 0)
        except ShmUnavailable:
            return None
        regions = [shared[r * stride : r * stride + nbytes] for r in range(self.world_size)]
        mine = regions[self.rank]
        entry = (mine.data_ptr(), mine.data_ptr() + nbytes, regions)
        self._regions.append(entry)
        lent = mine.view(dtype)
        # Forget the region (and let its memory go) once the caller drops the buffer, e.g.
        # when a model is replicated again: sums can no longer be asked of it.
        weakref.finalize(lent, self._regions.remove, entry)
        return lent

    def _in_place(self, flat: torch.Tensor) -> list[torch.Tensor] | None:
        """Every rank's copy of ``flat`` if it lies in a buffer from :meth:`buffer`."""
        start = flat.data_ptr()
        stop = start + flat.numel() * flat.element_size()
        for lo, hi, regions in self._regions:
            if lo <= start and stop <= hi:
                offset = start - lo
                return [r[offset : offset + stop - start].view(flat.dtype) for r in regions]
        return None

    # -- the Comm interface ---------------------------------------------------------------------

    def all_reduce_sum(self, tensor: torch.Tensor) -> Work:
        if tensor.device.type != "cpu":
            raise ValueError(
                f"shared-memory averaging sums CPU tensors, got one on {tensor.device}; "
                "use transport='gloo' (or NCCL for CUDA tensors)"
            )
        if not tensor.is_contiguous():
            raise ValueError("all_reduce_sum needs a contiguous tensor")
        op = _Op(tensor)
        with self._lock:
            if self._broken is not None:
                raise self._broken
            self._queue.append(op)
            self._wake.notify()
        return _Work(self, op)

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> None:
        self._drain()
        self.base.broadcast(tensor, src)

    def all_to_all(self, output: torch.Tensor, input: torch.Tensor) -> Work:
        # Only compressed sums ask for it, and on one host they save nothing: the process
        # group serves them.
        return self.base.all_to_all(output, input)

    def all_gather(self, output: torch.Tensor, input: torch.Tensor) -> Work:
        return self.base.all_gather(output, input)

    def all_gather_object(self, obj: Any) -> list[Any]:
        self._drain()
        return self.base.all_gather_object(obj)

    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        self._drain()
        return self.base.broadcast_object(obj, src)

    def barrier(self) -> None:
        self._drain()
        self.base.barrier()

    def agree_call(self, what: str) -> None:
        self.base.agree_call(what)

    def close(self) -> None:
        """Finish pending sums and stop the helper thread; errors were raised by ``wait()``."""
        if self._thread is not None:
            with self._lock:
                self._closing = True
                self._wake.notify()
            self._thread.join(self.timeout + 1.0)
            self._thread = None
        else:
            with contextlib.suppress(Exception):
                self._drain()

    # -- progress -------------------------------------------------------------------------------

    def _complete(self, op: _Op) -> None:
        if self._thread is None:
            while not op.done.is_set():
                self._run_next()
        else:
            op.done.wait()

    def _drain(self) -> None:
        """Complete every launched sum: other collectives must not overtake them."""
        with self._lock:
            last = self._queue[-1] if self._queue else None
        if last is not None:
            self._complete(last)
            if last.error is not None:
                raise last.error

    def _serve(self) -> None:
        while True:
            with self._lock:
                while not self._queue and not self._closing:
                    self._wake.wait()
                if not self._queue:
                    return
            self._run_next()

    def _run_next(self) -> None:
        with self._lock:
            op = self._queue[0]
        try:
            if self._broken is not None:
                raise self._broken
            self._sum(op.tensor.view(-1))
        except BaseException as exc:
            self._broken = op.error = exc
        with self._lock:
            self._queue.popleft()
        op.done.set()

    # -- the sum --------------------------------------------------------------------------------

    def _sum(self, flat: torch.Tensor) -> None:
        if flat.numel() * flat.element_size() > SMALL_BYTES and self.world_size > 1:
            copies = self._in_place(flat)
            if copies is not None:
                self._sum_in_place(copies)
                return
        per_chunk = self.slot_bytes // flat.element_size()
        for start in range(0, flat.numel(), per_chunk):
            chunk = flat[start : start + per_chunk]
            generation = self._chunks % 2
            self._chunks += 1
            if chunk.numel() * chunk.element_size() <= SMALL_BYTES or self.world_size == 1:
                self._sum_small(chunk, generation)
            else:
                self._sum_large(chunk, generation)

    def _sum_small(self, x: torch.Tensor, generation: int) -> None:
        n, dtype = x.numel(), x.dtype
        self._slot(generation, self.rank, dtype, n).copy_(x)
        self._barrier()
        slots = [self._slot(generation, r, dtype, n) for r in range(self.world_size)]
        if len(slots) == 1:
            x.copy_(slots[0])
            return
        torch.add(slots[0], slots[1], out=x)
        for s in slots[2:]:
            x.add_(s)

    def _sum_large(self, x: torch.Tensor, generation: int) -> None:
        n, dtype, world = x.numel(), x.dtype, self.world_size
        bounds = self._bounds(x)
        lo, hi = bounds[self.rank], bounds[self.rank + 1]
        mine = self._slot(generation, self.rank, dtype, n)
        mine[:lo].copy_(x[:lo])
        mine[hi:].copy_(x[hi:])
        self._barrier()
        acc = x[lo:hi]
        for r in range(world):
            if r != self.rank:
                acc.add_(self._slot(generation, r, dtype, n)[lo:hi])
        result = self._result(dtype, n)
        result[lo:hi].copy_(acc)
        self._barrier()
        x[:lo].copy_(result[:lo])
        x[hi:].copy_(result[hi:])

    def _sum_in_place(self, copies: list[torch.Tensor]) -> None:
        """Reduce-scatter, then push each summed part into every rank's buffer (module doc)."""
        world, rank = self.world_size, self.rank
        bounds = self._bounds(copies[rank])
        lo, hi = bounds[rank], bounds[rank + 1]
        self._barrier()  # every rank's buffer holds its input
        acc = copies[rank][lo:hi]
        for r in range(world):
            if r != rank:
                acc.add_(copies[r][lo:hi])
        for r in range(world):
            if r != rank:
                copies[r][lo:hi].copy_(acc)
        self._barrier()  # every buffer holds every part's sum

    def _bounds(self, x: torch.Tensor) -> list[int]:
        """Part r of ``x`` is ``[bounds[r], bounds[r + 1])``, cut at cache-line multiples."""
        n, world = x.numel(), self.world_size
        step = max(1, _ALIGN // x.element_size())
        return [min(n, (n * r // world) // step * step) for r in range(world)] + [n]

    def _barrier(self) -> None:
        self._arrivals[self.rank].value += 1
        for sem in self._others:
            sem.release()
        mine, waiter = self._mine, self._waiter
        start = waiter.start()
        need = waiter.poll(self.world_size - 1)
        deadline = time.monotonic() + self.timeout
        while need:
            if mine.acquire(True, _SLICE):
                need -= 1
                continue
            if self.interrupt is not None and self.interrupt.is_set():
                raise PeerFailure(
                    f"rank {self.rank}'s shared-memory all-reduce was interrupted: a peer was lost"
                )
            for rank, pid in self._peers:
                if not alive(pid):
                    raise PeerFailure(
                        f"rank {rank} (pid {pid}) exited while rank {self.rank} waited for it "
                        "in a shared-memory all-reduce"
                    )
            if time.monotonic() > deadline:
                raise self._hang()
        waiter.done(start)

    def _hang(self) -> Exception:
        """The error of a waiter that gave up: the ranks in another call, or those behind it."""
        mismatch = self.base.mismatched_calls() if isinstance(self.base, DistComm) else None
        if mismatch is not None:
            return mismatch
        mine = self._arrivals[self.rank].value
        behind = [(r, pid, True) for r, pid in self._peers if self._arrivals[r].value < mine]
        if behind:
            return hang_error(self.rank, behind, self.timeout, "a shared-memory all-reduce")
        return TimeoutError(
            f"rank {self.rank} waited more than {self.timeout:g} s for the other ranks in "
            "a shared-memory all-reduce; did the ranks issue different collectives?"
        )
