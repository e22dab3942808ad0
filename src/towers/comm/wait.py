"""Waiting for peers on one host: poll briefly while waits are short, otherwise sleep at once.

A rank that waits for its peers can poll (lowest latency when they arrive within microseconds)
or sleep in the kernel until a peer's post wakes it (no CPU used). Polling pays only when the
wait is short: on a machine whose cores are all busy (other jobs, or more workers than cores)
a poller burns the time slice a peer or another job needed, and one that yields between polls
(``sched_yield``) is off the CPU when the peer posts, with no wake-up to bring it back: a
sleeper is woken, and the scheduler favours it, while a yielder waits for its turn. Measured
under one busy process on 2 cores, yield-polling for 1 ms cost more than the sums themselves
(docs/performance.md).

:class:`Waiter` therefore keeps an average of how long its recent waits took (until the last
token arrived, however it arrived) and polls, without yielding, for at most twice that average
and never longer than ``spin``; when the average is longer than ``spin``, it sleeps at once.
Waits that become short again bring polling back, because sleeping waits are measured too.
"""

from __future__ import annotations

import time
from typing import Protocol

__all__ = ["DEFAULT_SPIN_SECONDS", "Semaphore", "Waiter"]

# The longest a waiter polls before it sleeps: about twice the time a sleeping waiter takes to
# be woken on an idle machine (tens of microseconds), so that a poll that fails costs at most
# about what sleeping at once would have.
DEFAULT_SPIN_SECONDS = 100e-6
_WEIGHT = 0.25  # of the newest wait in the running average


class Semaphore(Protocol):
    """A counting semaphore (``multiprocessing``'s ``SemLock`` on a named POSIX semaphore)."""

    def acquire(self, block: bool = True, timeout: float | None = None) -> bool: ...

    def release(self) -> None: ...


class Waiter:
    """Takes tokens from one semaphore: polls while recent waits were short, then sleeps.

    ``poll`` takes what it can within the current polling budget and returns how many tokens
    are still needed; the caller then sleeps on the semaphore (``acquire(True, timeout)``) for
    the rest, checking what it must between slices (peers alive, a deadline), and reports the
    whole wait with ``done`` so the budget follows the waits.

    Example:
        >>> import threading
        >>> sem = threading.Semaphore(0)
        >>> sem.release()
        >>> waiter = Waiter(sem)
        >>> start = waiter.start()
        >>> waiter.poll(1)
        0
        >>> waiter.done(start)
    """

    def __init__(self, sem: Semaphore, spin: float = DEFAULT_SPIN_SECONDS):
        if spin < 0:
            raise ValueError(f"spin must be >= 0 seconds, got {spin}")
        self.sem = sem
        self.spin = spin
        self.average = spin / 2  # seconds, over recent waits

    @property
    def budget(self) -> float:
        """How long the next wait polls before it sleeps (seconds)."""
        if self.average > self.spin:
            return 0.0
        return min(self.spin, 2 * self.average)

    def start(self) -> float:
        """The clock at the start of a wait, for :meth:`done`."""
        return time.perf_counter()

    def poll(self, need: int) -> int:
        """Take up to ``need`` tokens without sleeping, within the budget; return those missing."""
        acquire = self.sem.acquire
        while need and acquire(False):
            need -= 1
        budget = self.budget
        if need and budget > 0:
            stop = time.perf_counter() + budget
            while need:
                if acquire(False):
                    need -= 1
                elif time.perf_counter() > stop:
                    break
        return need

    def done(self, start: float) -> None:
        """Record a whole wait (poll and sleep) that began at ``start``."""
        elapsed = time.perf_counter() - start
        self.average += _WEIGHT * (elapsed - self.average)
