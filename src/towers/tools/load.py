"""Busy processes beside a benchmark: ``towers bench --load K``.

Developer machines and shared servers are rarely idle, and a transport that only wins while it
has the cores to itself wins nowhere. :func:`busy` starts ``K`` processes that spin on the CPU
(a pure Python loop: no memory traffic, no I/O), for as long as the ``with`` block runs, and
ends them when it exits, however it exits. Each one also dies with its parent (Linux
``PR_SET_PDEATHSIG``), so a benchmark killed with ``SIGKILL`` leaves none behind.
"""

from __future__ import annotations

import contextlib
import ctypes
import signal
import subprocess
import sys
from collections.abc import Iterator

__all__ = ["busy"]

_PR_SET_PDEATHSIG = 1
_SPIN = "while True:\n    pass\n"


def _die_with_parent() -> None:
    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)


@contextlib.contextmanager
def busy(count: int) -> Iterator[list[int]]:
    """Run ``count`` CPU-spinning processes for the duration of the block; yield their pids.

    Example:
        >>> with busy(1) as pids:
        ...     len(pids)
        1
    """
    if count < 0:
        raise ValueError(f"the number of busy processes must be >= 0, got {count}")
    procs: list[subprocess.Popen[bytes]] = []
    try:
        for _ in range(count):
            procs.append(
                subprocess.Popen(
                    [sys.executable, "-S", "-c", _SPIN],
                    stdin=subprocess.DEVNULL,
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL,
                    preexec_fn=_die_with_parent,
                )
            )
        yield [p.pid for p in procs]
    finally:
        for p in procs:
            p.kill()
        for p in procs:
            p.wait()
