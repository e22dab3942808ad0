"""Naming the rank that hangs a collective: the one that did not arrive, not the ones waiting.

A peer that dies closes its connections and is reported at once. A peer that is stuck (stopped
by ``SIGSTOP``, blocked in a system call, looping in the user's code) closes nothing: its peers
wait until the timeout, and then every one of them fails saying that *it* waited. This module
turns such a failure into :class:`PeerHang`, which names the ranks that never arrived:

- over shared memory every rank counts its arrivals in the segment, so a waiter that gives up
  reads who is behind (:class:`~towers.comm.shm.ShmComm`);
- over a process group (Gloo) the ranks whose wait failed check in under one key each in the
  rendezvous store and wait a moment for the others (:func:`absent_ranks`); whoever does not
  check in is stuck (or dead: a death is reported by the launcher first).

A rank that is not stuck but somewhere else is the other common case: a metric computed on
rank 0 alone through ``ctx.mean`` while the others went on to ``ctx.step``. Every rank notes
what it is calling (:func:`calling`, a string set before each call of the own loop, for free)
and checks in with it; when the ranks that checked in were in different calls,
:class:`CallMismatch` names each rank's call instead of a timeout.
"""

from __future__ import annotations

import contextlib
import os
import socket
import threading
import time
from datetime import timedelta
from typing import Any

__all__ = [
    "CHECK_IN_SECONDS",
    "CallMismatch",
    "PeerHang",
    "absent_ranks",
    "call_mismatch",
    "calling",
    "current_call",
    "describe_peer",
    "hang_error",
    "publish_pid",
]

# How long ranks whose collective failed wait for each other to check in.
CHECK_IN_SECONDS = 1.0


class PeerHang(TimeoutError):
    """Ranks did not arrive at a collective within the timeout: they are stuck, not dead.

    Attributes:
        ranks: the ranks that did not arrive.
        pids: their process ids (``None`` where unknown).
    """

    def __init__(self, message: str, ranks: list[int], pids: list[int | None]):
        super().__init__(message)
        self.ranks = ranks
        self.pids = pids

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (str(self), self.ranks, self.pids))


class CallMismatch(RuntimeError):
    """The ranks made different calls (or one rank made a call the others did not)."""


_NOW = ["towers"]  # what this process is calling: see calling()


def calling(what: str) -> None:
    """Note what this process calls now (``"ctx.step (step 3)"``), for :class:`CallMismatch`."""
    _NOW[0] = what


def current_call() -> str:
    return _NOW[0]


def call_mismatch(rank: int, calls: dict[int, str]) -> CallMismatch | None:
    """The error for ranks that were in different calls, or ``None`` if they agree."""
    if len(set(calls.values())) <= 1:
        return None
    where = "; ".join(f"rank {r} in {what}" for r, what in sorted(calls.items()))
    return CallMismatch(
        f"the ranks made different calls ({where}; this is rank {rank}): every rank must make "
        "the same towers calls in the same order. A metric that only rank 0 computes (a "
        "rank-0-only evaluation) must not go through ctx.mean or ctx.evaluate: compute it "
        "without them on that rank, or call them on every rank (docs/porting.md)"
    )


def describe_peer(rank: int, pid: int | None, local: bool) -> str:
    """``"rank 1 (pid 123, stopped by a signal)"``; the state only for a process on this host."""
    if pid is None:
        return f"rank {rank}"
    state = ""
    if local:
        try:
            with open(f"/proc/{pid}/stat") as f:
                code = f.read().rsplit(")", 1)[1].split()[0]
            state = {"T": ", stopped by a signal", "t": ", stopped by a debugger"}.get(code, "")
        except OSError:
            state = ", gone"
    return f"rank {rank} (pid {pid}{state})"


def publish_pid(store: Any, rank: int) -> None:
    """Leave this rank's pid and host in the store, for an error that names it later."""
    with contextlib.suppress(Exception):
        store.set(f"towers/pid/{rank}", f"{os.getpid()} {socket.gethostname()}")


def hang_error(
    rank: int, absent: list[tuple[int, int | None, bool]], timeout: float | None, where: str
) -> PeerHang:
    """The error for ``rank``, which gave up waiting in ``where`` for the ``absent`` ranks.

    ``absent`` holds ``(rank, pid, on this host)``.
    """
    names = ", ".join(describe_peer(r, pid, local) for r, pid, local in absent)
    waited = f"more than {timeout:g} s" if timeout is not None else "until the timeout"
    return PeerHang(
        f"rank {rank} waited {waited} in {where} for {names}, which did not arrive: it is stuck "
        "(stopped, blocked, or in an endless loop) or dead. See where it is (e.g. py-spy dump "
        "--pid PID), or give a larger timeout= if it only needs longer",
        [r for r, _, _ in absent],
        [pid for _, pid, _ in absent],
    )


Absent = list[tuple[int, int | None, bool]]  # (rank, pid, on this host) of ranks not there


def absent_ranks(
    store: Any, rank: int, world: int, wait: float = CHECK_IN_SECONDS
) -> tuple[Absent, dict[int, str]] | None:
    """Check in, wait up to ``wait`` s for the others: who did not, and what the others called.

    Returns ``(absent, calls)``: ``(rank, pid, local)`` of the ranks that did not check in, and
    :func:`current_call` of every rank that did (this one included); ``None`` if the store itself
    does not answer, which means rank 0, whose process hosts it, is the stuck one. The store's
    own timeout does not cover every call when its host is stopped, so the exchange runs on a
    helper thread that is abandoned after ``2 * wait``.
    """
    out: list[tuple[Absent, dict[int, str]] | None] = []
    mine = current_call()
    helper = threading.Thread(
        target=lambda: out.append(_check_in(store, rank, world, wait, mine)), daemon=True
    )
    helper.start()
    helper.join(2 * wait)
    return out[0] if out else None


def _check_in(
    store: Any, rank: int, world: int, wait: float, mine: str
) -> tuple[Absent, dict[int, str]] | None:
    try:
        store.set_timeout(timedelta(seconds=wait))
        store.set(f"towers/arrived/{rank}", mine)
    except Exception:
        return None
    others = [r for r in range(world) if r != rank]
    deadline = time.monotonic() + wait
    missing = others
    with contextlib.suppress(Exception):
        while missing and time.monotonic() < deadline:
            missing = [r for r in missing if not store.check([f"towers/arrived/{r}"])]
            if missing:
                time.sleep(0.02)
    calls = {rank: mine}
    for r in set(others) - set(missing):
        with contextlib.suppress(Exception):
            calls[r] = store.get(f"towers/arrived/{r}").decode()
    found = []
    for r in missing:
        pid, host = None, ""
        with contextlib.suppress(Exception):
            text, host = store.get(f"towers/pid/{r}").decode().split(" ", 1)
            pid = int(text)
        found.append((r, pid, host == socket.gethostname()))
    return found, calls
