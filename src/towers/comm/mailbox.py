"""Point-to-point messages through shared memory: a parameter server and its workers on one host.

The parameter server moves the whole model twice per update (parameters out, gradient back).
Over Gloo that is loopback TCP, about 1.3 GB/s: 12 ms per update of a 7.5 MB model, as long as
computing the update. :class:`ShmPointToPoint` is a :class:`~towers.comm.base.PointToPoint` for
the star the server uses (rank 0 and each worker, never worker to worker) whose messages are
memory copies: one slot per direction per worker, in one shared segment.

A slot holds one message of a fixed size (the largest the job sends, given up front). The
sender waits until the receiver has taken the previous message out (a "taken" semaphore, one
token per message read), copies the message in, and posts the slot's "full" semaphore; the
receiver waits on it and copies the message out. So ``isend`` is complete when it returns, and
messages between two ranks arrive in order, one at a time, whatever protocol runs on top.

Waits sleep on the semaphore (after a short poll while recent waits were short,
:class:`~towers.comm.wait.Waiter`), check every 0.25 s that the peer is alive, and give up after
``timeout`` seconds, raising as a receive from a dead or silent Gloo peer does. Objects
(``send_object``) go through the process group the transport was built on.
"""

from __future__ import annotations

import os
import time
from typing import Any

import torch

from .base import DistComm
from .segment import ShmUnavailable, alive, host_key, open_shared
from .wait import Waiter

__all__ = ["ShmPointToPoint"]

_ALIGN = 64
_SLICE = 0.25  # seconds between liveness checks of the peer while asleep


class _Done:
    def wait(self) -> bool:
        return True


class _Channel:
    """One direction between rank 0 and one worker: a slot, "full" and "taken" semaphores."""

    def __init__(self, slot: torch.Tensor, full: Any, taken: Any):
        self.slot, self.full, self.taken = slot, full, taken
        self.sent = 0  # messages sent so far (sender's count)
        self.waiter = Waiter(full)


class ShmPointToPoint:
    """Messages of at most ``size`` bytes between rank 0 and every other rank of ``base``.

    Built collectively on every rank. ``base`` (a process group) carries the object messages.

    Raises:
        ShmUnavailable: on every rank alike, if the ranks are not on one host or the segment
            cannot be created (a small /dev/shm): the caller keeps ``base``.
    """

    def __init__(self, base: DistComm, size: int, *, timeout: float = 60.0):
        self.base = base
        self.rank, self.world_size = base.rank, base.world_size
        self.timeout = timeout
        info = base.all_gather_object((host_key(), os.getpid()))
        if any(key != info[0][0] for key, _ in info):
            raise ShmUnavailable("the ranks run on more than one host")
        self._pids = [pid for _, pid in info]
        self.size = size
        stride = -(-max(size, 1) // _ALIGN) * _ALIGN
        workers = self.world_size - 1
        # channel 2w: worker w+1 -> rank 0; channel 2w+1: rank 0 -> worker w+1
        self._bytes, sems = open_shared(base, 2 * workers * stride, 4 * workers)
        self._channels = [
            _Channel(self._bytes[c * stride : c * stride + size], sems[2 * c], sems[2 * c + 1])
            for c in range(2 * workers)
        ]

    def _channel(self, src: int, dst: int) -> _Channel:
        ranks = range(self.world_size)
        if (src == 0) == (dst == 0) or src not in ranks or dst not in ranks:
            raise ValueError(
                f"shared-memory messages go between rank 0 and one other rank; got {src} -> {dst}"
            )
        worker = max(src, dst) - 1
        return self._channels[2 * worker + (src == 0)]

    def isend(self, tensor: torch.Tensor, dst: int) -> _Done:
        """Copy ``tensor`` into ``dst``'s slot (once it took the previous message) and notify it."""
        ch = self._channel(self.rank, dst)
        flat = tensor.reshape(-1).view(torch.uint8)
        if flat.numel() > self.size:
            raise ValueError(
                f"a message of {flat.numel()} bytes does not fit a {self.size}-byte slot"
            )
        if ch.sent:
            self._take(ch.taken, dst, None)
        ch.slot[: flat.numel()].copy_(flat)
        ch.sent += 1
        ch.full.release()
        return _Done()

    def recv(self, tensor: torch.Tensor, src: int) -> None:
        """Wait for ``src``'s next message and copy it into ``tensor``."""
        ch = self._channel(src, self.rank)
        flat = tensor.reshape(-1).view(torch.uint8)
        self._take(ch.full, src, ch.waiter)
        flat.copy_(ch.slot[: flat.numel()])
        ch.taken.release()

    def _take(self, sem: Any, peer: int, waiter: Waiter | None) -> None:
        start = time.perf_counter()
        if waiter is not None and waiter.poll(1) == 0:
            waiter.done(start)
            return
        deadline = time.monotonic() + self.timeout
        while not sem.acquire(True, _SLICE):
            if not alive(self._pids[peer]):
                raise ConnectionError(
                    f"rank {peer} (pid {self._pids[peer]}) exited while rank {self.rank} waited "
                    "for its message"
                )
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"rank {self.rank} waited more than {self.timeout:g} s for a message from "
                    f"rank {peer}"
                )
        if waiter is not None:
            waiter.done(start)

    def send_object(self, obj: Any, dst: int) -> None:
        self.base.send_object(obj, dst)

    def recv_object(self, src: int) -> Any:
        return self.base.recv_object(src)
