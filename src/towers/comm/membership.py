"""Who is in an elastic job: generations of members, kept in the job's TCPStore.

The supervisor (the caller of ``towers.train``, or ``towers run --elastic``) hosts the store,
so it outlives any worker. Every worker has a stable id (its first rank; a replacement gets a
new one) and a heartbeat thread that counts up ``hb/<id>`` every :data:`HEARTBEAT` seconds.

Generation ``g`` is a list of member ids (``g<g>/members``, written once by the supervisor); a
member's rank is its index in that list. Its keys:

- ``g<g>/here``: arrivals; the members form a process group (``g<g>/pg``) once all are here.
- ``g<g>/failed``: set by the supervisor when a member died or hung (after it killed it), with
  the dead ids and the time of death. The heartbeat thread watches it and sets the interrupt
  event, which makes a waiting collective raise :class:`~towers.comm.base.PeerFailure`; the
  members then enter ``g + 1``, which the supervisor publishes without the dead.
- ``g<g>/regroup``: a replacement is ready and waits in ``g + 1``; the members agree, in the
  metadata of a step, to move there after that step. A newcomer compares ``terms`` (what every
  member shares) with its own before it asks to be let in, and says how it differs
  (``refused/<id>``) and stops if it does; a dropped worker finds ``lost/<id>``, says so, exits.

Across hosts a network partition answers nothing at all: the heartbeat's calls are timed
(:class:`WatchedStore`), and one unanswered for the timeout ends the worker with a line saying
that it lost contact with the job, and since when.

The keys and records are named in :mod:`towers.comm.protocol`. Every key lives under the job's
prefix, and the records that decide who is a member are signed with the job's secret
(:mod:`towers.comm.store`): a process that reaches the store cannot make itself a member.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

from ..core.secret import JobSecret
from . import protocol
from .base import PeerTimeout
from .store import client_store, get_signed, job_store, put_signed, read_signed

__all__ = [
    "HEARTBEAT",
    "Dropped",
    "JoinRefused",
    "Membership",
    "Pulse",
    "WatchedStore",
    "clock",
    "open_store",
    "own_client",
]

HEARTBEAT = 0.2  # seconds between a worker's heartbeats
_POLL = 0.01  # seconds between checks while members arrive


class Dropped(SystemExit):
    """This worker is no longer a member: the job declared it lost and trains on without it.

    A ``SystemExit`` (exit code 1), so that a training loop's ``except Exception`` does not keep
    a dropped worker training as a ghost, and the script ends with the one line that says why
    instead of a traceback.
    """


class JobLost(SystemExit):
    """The job's store stopped answering (a dead supervisor, a partition), as :class:`Dropped`."""


class JoinRefused(SystemExit):
    """This newcomer differs from the job it was to join (another model, mode or compression):
    it said how in the store (``refused/<id>``), where its supervisor reads it, and stops
    before the members wait for it; the job goes on without it. Exit code 2, no traceback."""

    def __init__(self, why: str):
        super().__init__(2)
        self.why = why


def open_store(addr: str, port: int, timeout: float, secret: JobSecret | None) -> Any:
    """A client of the job's store (the supervisor hosts it), checked to be this job's."""
    return job_store(client_store(addr, port, timeout, secret), secret)


def own_client(
    addr: str, port: int, timeout: float, secret: JobSecret | None
) -> tuple[Any, Callable[[], None]]:
    """A store client for a thread of its own, and ``cut()``, which breaks its connection.

    A call on a connection whose peer stopped answering (a link cut, a stopped host) waits for
    TCP's next resend or for the kernel to give up, whatever the store's timeout. A daemon
    thread that returns from such a call while the interpreter shuts down is ended inside the
    call's C++ frames and the process aborts (``terminate called without an active
    exception``, exit -6); ``cut()`` makes the call fail at once, so its thread can be waited
    for. It shuts down the client's socket (found as the one it opened to ``port``; none on a
    system without ``/proc``), not the other clients'.
    """
    before = set(_sockets().values())
    store = open_store(addr, port, timeout, secret)
    mine = [fd for fd, s in _sockets().items() if s not in before and _peer_port(fd) == port]

    def cut() -> None:
        for fd in mine:  # the client is alive (its owner holds it): the numbers are still its
            if _peer_port(fd) == port:
                with contextlib.suppress(OSError), socket.socket(fileno=os.dup(fd)) as conn:
                    conn.shutdown(socket.SHUT_RDWR)

    return store, cut


def _sockets() -> dict[int, str]:
    """This process's sockets: file descriptor -> ``socket:[INODE]``."""
    found = {}
    with contextlib.suppress(OSError):
        for fd in os.listdir("/proc/self/fd"):
            with contextlib.suppress(OSError):
                link = os.readlink(f"/proc/self/fd/{fd}")
                if link.startswith("socket:"):
                    found[int(fd)] = link
    return found


def _peer_port(fd: int) -> int | None:
    """The remote port of socket ``fd``, or ``None`` if it is no connected socket."""
    try:
        with socket.socket(fileno=os.dup(fd)) as conn:
            return int(conn.getpeername()[1])
    except (OSError, IndexError, TypeError):
        return None


def clock(when: float) -> str:
    """A wall-clock time as people read it in a log: ``14:03:07``."""
    return time.strftime("%H:%M:%S", time.localtime(when))


class WatchedStore:
    """A store client whose calls are timed, for one thread at a time.

    A TCP connection across a network partition neither answers nor fails: a call blocks until
    the kernel gives up, a quarter of an hour later. A thread of this object's own checks the
    call in flight (from :meth:`start`), and calls ``lost(when)`` (``when``: the wall time of the
    last answer) once one has not returned within ``timeout`` seconds; ``lost`` is expected to
    end the process.
    """

    def __init__(self, store: Any, timeout: float, lost: Callable[[float], None]):
        self.store = store
        self.timeout = timeout
        self.answered = time.time()  # wall time of the last answer
        self._asking: float | None = None  # monotonic start of the call in flight
        self._lost = lost
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="towers-contact", daemon=True)

    def start(self) -> WatchedStore:
        """Start watching the calls; returns itself."""
        self._thread.start()
        return self

    def __getattr__(self, name: str) -> Any:
        method = getattr(self.store, name)

        @functools.wraps(method)
        def timed(*args: Any, **kwargs: Any) -> Any:
            self._asking = time.monotonic()
            try:
                answer = method(*args, **kwargs)
            finally:
                self._asking = None
            self.answered = time.time()
            return answer

        return timed

    def _watch(self) -> None:
        every = min(1.0, self.timeout / 10)
        while not self._stop.wait(every):
            began = self._asking
            if began is None or time.monotonic() - began <= self.timeout:
                continue
            # A thread that held the GIL that long kept the answer from being noted: look again
            # once the caller had a moment to run.
            if self._stop.wait(0.2) or self._asking != began:
                continue
            self._lost(self.answered)
            return

    def close(self) -> None:
        self._stop.set()


class Pulse:
    """Counts up ``name`` in the job's ``store`` every ``every`` seconds, from a thread of its own.

    A launcher's liveness must not depend on its main loop being scheduled: on a loaded machine
    a loop that makes a dozen store round trips a tick can fall seconds behind, while a thread
    that wakes only to make one call still runs. ``client`` is this thread's own, from
    :func:`own_client` (a TCPStore client is not shared across threads). A call that fails ends
    the pulse: the launcher's main loop meets the same store and says what happened. Close it
    before the process exits (see :func:`own_client`).
    """

    def __init__(self, client: tuple[Any, Callable[[], None]], name: str, every: float = HEARTBEAT):
        (self.store, self._cut), self.name, self.every = client, name, every
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="towers-pulse", daemon=True)

    def start(self) -> Pulse:
        """The first beat, then one every ``every`` seconds from the thread; returns itself."""
        self.store.add(self.name, 1)
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(self.every):
            try:
                self.store.add(self.name, 1)
            except Exception:
                return

    def close(self, wait: float | None = 2.0) -> None:
        """Stop beating: wait up to ``wait`` seconds for a call in flight (a call to a live
        store takes milliseconds), then break the connection under one still waiting; with
        ``wait=None``, return at once (close it again before exiting)."""
        self._stop.set()
        if wait is not None:
            _end(self._thread, wait, self._cut)


def _end(thread: threading.Thread, wait: float, cut: Callable[[], None]) -> None:
    """Wait up to ``wait`` s for ``thread`` to end, then ``cut`` its client and wait again."""
    thread.join(wait)
    if thread.is_alive():
        cut()
        thread.join(2.0)


class Membership:
    """One worker's view of the generations, with its heartbeat thread.

    Args:
        addr, port: the job's store.
        wid: this worker's id.
        timeout: seconds to wait for a generation to be published or its members to arrive.
        secret: the job's secret, which signs the membership records.
        node: this worker's node, in a job across hosts (its lines then say where it runs).

    :meth:`start` connects and starts the heartbeat. If the store stops answering, the heartbeat
    interrupts the wait in progress and the next call here raises :class:`JobLost`.
    """

    def __init__(
        self,
        addr: str,
        port: int,
        wid: int,
        timeout: float,
        secret: JobSecret | None = None,
        node: int | None = None,
    ):
        self.id = wid
        # where this worker runs, in its lines: `` on node 1 (host NAME)`` across hosts
        self.here = "" if node is None else f" on node {node} (host {socket.gethostname()})"
        self.timeout = timeout
        self.secret = secret
        self.lost: str | None = None  # why the job was lost, once it was
        self.addr, self.port = addr, port
        self.where = f"{addr}:{port}"
        self.interrupt = threading.Event()  # a member of the current generation was lost
        self.generation = -1
        self._regroup = False
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._beat, name="towers-heartbeat", daemon=True)

    def start(self) -> Membership:
        """Connect to the job's store and start beating; returns itself."""
        addr, port, timeout, secret = self.addr, self.port, self.timeout, self.secret
        self.store = open_store(addr, port, timeout, secret)
        # The store client is not shared across threads: the heartbeat has its own.
        beat, self._cut = own_client(addr, port, timeout, secret)
        self._beat_store = WatchedStore(beat, timeout, self._cut_off).start()
        self._beat_store.add(protocol.heartbeat(self.id), 1)
        self._thread.start()
        return self

    def _beat(self) -> None:
        store = self._beat_store
        while not self._stop.wait(HEARTBEAT):
            try:
                store.add(protocol.heartbeat(self.id), 1)
                g = self.generation
                if g < 0:
                    continue
                failed = (
                    get_signed(store, self.secret, protocol.generation(g, "failed")) is not None
                )
                regroup = (
                    get_signed(store, self.secret, protocol.generation(g, "regroup")) is not None
                )
            except Exception as exc:
                if self._stop.is_set():
                    return
                # The store lives in the supervisor: without it this worker would train on as
                # a ghost.
                self._lose(
                    f"towers: worker {self.id}{self.here} lost the job's supervisor (the caller of "
                    f"train, or towers run: its store at {self.where} stopped answering at "
                    f"{clock(store.answered)}: {str(exc).splitlines()[0] if str(exc) else exc!r}); "
                    "stopping"
                )
                return
            with self._lock:
                if g == self.generation:
                    if failed:
                        self.interrupt.set()
                    self._regroup = self._regroup or regroup

    def _cut_off(self, since: float) -> None:
        """The heartbeat's call has not returned within the timeout: a partition, or a stop."""
        self._lose(
            f"towers: worker {self.id}{self.here} lost contact with the job at {clock(since)}: the "
            f"job's store at {self.where} has not answered for {self.timeout:g} s (the timeout); "
            "a network partition, or the store's host stopped. This worker stops (the job drops "
            "it and trains on without it)"
        )

    def _lose(self, line: str) -> None:
        """The job is lost (``line`` says how): interrupt the main thread's wait."""
        self.lost = self.lost or line
        self.interrupt.set()

    def check(self) -> None:
        """Raise :class:`JobLost` in the main thread if the heartbeat found the job lost."""
        if self.lost is not None:
            raise JobLost(self.lost)

    @property
    def regroup_wanted(self) -> bool:
        """Whether a replacement waits to join after the current generation."""
        return self._regroup

    def failure(self, generation: int) -> tuple[list[int], float] | None:
        """The ids lost in ``generation`` and when, or ``None`` if it did not fail."""
        self.check()
        text = get_signed(self.store, self.secret, protocol.generation(generation, "failed"))
        if text is None:
            return None
        info = json.loads(text)
        return info["dead"], info["at"]

    def members(self, generation: int) -> list[int]:
        """The members of ``generation``, once the supervisor published it."""
        try:
            text = read_signed(
                self.store, self.secret, protocol.generation(generation, "members"), self.timeout
            )
        except TimeoutError:
            raise PeerTimeout(
                f"worker {self.id}: generation {generation} of the job was not published within "
                f"{self.timeout:g} s; did the supervisor (the caller of train) exit?"
            ) from None
        return list(json.loads(text))

    def _dropped(self) -> str:
        why = ""
        with contextlib.suppress(Exception):
            if self.store.check([protocol.lost(self.id)]):
                lost = protocol.Lost.loads(self.store.get(protocol.lost(self.id)))
                why = f" at {clock(lost.at)} ({lost.why})"
        return (
            f"towers: worker {self.id}{self.here} was dropped from the job{why}; the others train "
            "on without it. This worker stops"
        )

    def job_terms(self) -> str:
        """The terms the job's members published (see the module doc), once they have."""
        try:
            return read_signed(self.store, self.secret, protocol.TERMS, self.timeout)
        except TimeoutError:
            raise PeerTimeout(
                f"worker {self.id}: the job's members did not say what they train within "
                f"{self.timeout:g} s; did the job start?"
            ) from None

    def publish_terms(self, text: str) -> None:
        put_signed(self.store, self.secret, protocol.TERMS, text)

    def refuse(self, why: str) -> JoinRefused:
        """Say in the store why this newcomer does not join; the error that stops it."""
        put_signed(self.store, self.secret, protocol.refused(self.id), why)
        return JoinRefused(why)

    def first_generation(self, joining: bool) -> int:
        """0 for a worker started with the job; a replacement waits to be let in."""
        if not joining:
            return 0
        put_signed(self.store, self.secret, protocol.ready(self.id), "1")
        return int(read_signed(self.store, self.secret, protocol.joined(self.id), self.timeout))

    def enter(self, generation: int) -> tuple[int, list[int]]:
        """Arrive in ``generation`` (or a later one, if it fails) once all its members are here.

        Returns:
            ``(generation, members)`` entered.

        Raises:
            Dropped: if this worker is not a member (it was declared lost).
            PeerTimeout: if the members do not all arrive within the timeout.
            JobLost: if the job's store stopped answering this worker.
        """
        self.check()
        while True:
            members = self.members(generation)
            if self.id not in members:
                raise Dropped(self._dropped())
            with self._lock:
                self.generation = generation
                self.interrupt.clear()
                self._regroup = False
            self.check()  # a job lost while the interrupt was cleared: not missed
            self.store.add(protocol.generation(generation, "here"), 1)
            deadline = time.monotonic() + self.timeout
            while (
                get_signed(self.store, self.secret, protocol.generation(generation, "failed"))
                is None
            ):
                if self.store.add(protocol.generation(generation, "here"), 0) >= len(members):
                    return generation, members
                if time.monotonic() > deadline:
                    raise PeerTimeout(
                        f"worker {self.id}: not every member of generation {generation} "
                        f"({members}) arrived within {self.timeout:g} s"
                    )
                time.sleep(_POLL)
            generation += 1

    def close(self) -> None:
        """Stop the heartbeat, telling the supervisor that this worker left on purpose."""
        self._stop.set()
        _end(self._thread, 1.0, self._cut)
        with contextlib.suppress(Exception):
            self.store.set(protocol.left(self.id), "1")
        self._beat_store.close()  # watched until here: a heartbeat stuck in a partition ends it
