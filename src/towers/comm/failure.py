"""Waiting on a process group's work: peers that fail, and waits that a lost peer interrupts.

:class:`PeerFailure` and :class:`PeerTimeout` are what a transport's collectives raise when a
peer leaves the job; :class:`Interruptible` waits on a Gloo work in a way the elastic runner's
watcher can interrupt (:mod:`towers.comm.base` uses both).
"""

from __future__ import annotations

import threading
from datetime import timedelta
from typing import Any

__all__ = ["Interruptible", "PeerFailure", "PeerTimeout", "peer_failure"]

_SLICE = 0.25  # seconds between checks of the interrupt while a collective waits
_SLICE_DELTA = timedelta(seconds=_SLICE)


class PeerFailure(RuntimeError):
    """A peer left the job (died, or was declared lost) while this rank waited for it.

    Raised by a transport's collectives, so that an elastic run can regroup without the
    lost rank; any other run ends with it.
    """


class PeerTimeout(PeerFailure, TimeoutError):
    """A peer did not arrive within the timeout (stuck, or issuing other collectives)."""


class Interruptible:
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
            raise peer_failure(exc) from None


def peer_failure(exc: BaseException) -> PeerFailure:
    text = str(exc).strip().splitlines()
    what = text[0] if text else type(exc).__name__
    if "timeout" in what.lower() or "timed out" in what.lower():
        return PeerTimeout(f"a peer did not arrive in time: {what}")
    return PeerFailure(f"a peer was lost: {what}")
