"""Processes that die with their caller, and a caller that stops with one line.

A worker must not outlive the process that started it: a caller killed by ``SIGKILL`` (the OOM
killer, a scheduler, ``kill -9``) runs no cleanup, and its workers, re-parented to init, would go
on training and writing checkpoints beside the job that replaces it. ``PR_SET_PDEATHSIG`` is not
enough here: a worker's parent may be multiprocessing's forkserver, which lives on as long as
its children do (they hold its liveness pipe). So every worker watches the pipe its result goes back
through: when the caller dies, the kernel closes the pipe's read end, ``poll`` reports an error
on the write end, and the worker kills itself. ``towers run`` starts scripts with
``PR_SET_PDEATHSIG``, which suffices there (their parent is ``towers run`` itself).

``SIGTERM`` is turned into the same interruption as Ctrl-C; :func:`stopped_line` is the one line
that says what happened and where the last checkpoint is.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import os
import select
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

__all__ = [
    "Terminated",
    "die_with_parent",
    "end_now",
    "sigterm_interrupts",
    "stopped_line",
    "watch_caller",
]

_PR_SET_PDEATHSIG = 1


class Terminated(KeyboardInterrupt):
    """``SIGTERM`` arrived: stop as on Ctrl-C."""


def watch_caller(fd: int) -> None:
    """Kill this process when the read end of the pipe whose write end is ``fd`` closes.

    The read end is held by the caller only, so it closes exactly when the caller exits (or
    after it has read this worker's result and let go). Watches a duplicate of ``fd``, so the
    worker may close its own.
    """
    watched = os.dup(fd)

    def watch() -> None:
        poller = select.poll()
        poller.register(watched, 0)  # POLLERR and POLLHUP are always reported
        while True:
            try:
                events = poller.poll()
            except InterruptedError:
                continue
            if any(mask & (select.POLLERR | select.POLLHUP) for _, mask in events):
                os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=watch, name="towers-lifeline", daemon=True).start()


def end_now(line: str) -> None:
    """End this process now, saying why on standard error, from whichever thread noticed that
    it has lost its job (the job's store stopped answering). No cleanup runs: the main thread
    may be blocked on a call that will never return, and a worker that trained on would be a
    ghost beside the job that dropped it."""
    print(line, file=sys.stderr, flush=True)
    os._exit(1)


def die_with_parent(sig: int = signal.SIGKILL) -> Callable[[], None]:
    """A ``preexec_fn`` for ``subprocess.Popen``: the child gets ``sig`` when its parent dies."""
    parent = os.getpid()

    def arm() -> None:
        name = ctypes.util.find_library("c")
        if name is None:
            return
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL(name, use_errno=True).prctl(_PR_SET_PDEATHSIG, sig, 0, 0, 0)
        if os.getppid() != parent:  # the parent died before the request took effect
            os.kill(os.getpid(), sig)

    return arm


@contextlib.contextmanager
def sigterm_interrupts() -> Iterator[None]:
    """Within the block, ``SIGTERM`` raises :class:`Terminated` (where nobody else handles it)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    if signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
        yield
        return

    def raise_terminated(signum: int, frame: object) -> None:
        raise Terminated()

    signal.signal(signal.SIGTERM, raise_terminated)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)


def stopped_line(exc: KeyboardInterrupt, checkpoint: str | None) -> str:
    """One line: what stopped training, and where its last checkpoint is (or that none is)."""
    what = "SIGTERM" if isinstance(exc, Terminated) else "Ctrl-C (SIGINT)"
    files = sorted(Path(checkpoint).glob("step-*.pt")) if checkpoint else []
    if files:
        where = f"the last checkpoint is {files[-1]}; call train again with checkpoint= to resume"
    elif checkpoint:
        where = f"no checkpoint was written to {checkpoint} yet"
    else:
        where = "no checkpoint was kept (give checkpoint=DIR to resume later)"
    return f"towers: training stopped by {what}; workers stopped; {where}"
