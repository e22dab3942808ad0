"""Supervising an elastic job: host its store, watch its workers, announce losses, replace them.

The supervisor is the process that asked for the job (the caller of ``towers.train``), so the
job's store (:mod:`towers.comm.membership`) lives as long as the job, whichever worker dies. It
watches every worker's process and heartbeat: a worker that exits without a result, or whose
heartbeat stops for :data:`HANG_SECONDS` while its process is stopped (SIGSTOP), or for the
job's timeout in any case (an operation that holds the GIL that long), is lost. The
supervisor kills it first (so that no peer's Gloo thread stays blocked on it), then marks the
generations it belonged to as failed and publishes the next one without it. With
``max_restarts`` it starts a replacement, which is let in (at a step boundary, see
:mod:`towers.engines.sync.elastic`) once it is built.

A worker that raises is not lost but wrong: its exception fails the job, as in
:func:`towers.spawn`. The first worker to return a result ends the job: a worker returns only
after every member has done every step.

One :class:`Supervisor` serves every elastic job. It watches the workers it started (their
processes and heartbeats) and kills the lost ones; what that means for the rest of the job
depends on where the other workers live, which it asks of the :class:`Peers` it is handed:

- :class:`OneHost` (``train(elastic=True)``, ``towers run --elastic``): every worker is this
  supervisor's; it hosts the store and keeps the generations (:class:`Generations`) itself.
- :class:`~towers.processes.elastic_nodes.Nodes` (``towers run --elastic --nnodes M``): one
  supervisor per host over one store; node 0's hosts it and keeps the generations, every
  node posts its losses and its liveness there.

A ``Peers`` has the job's ``store`` (the supervisor reads the heartbeats there) and answers
six calls: ``join`` (the workers to start, and whether they join a running job), ``place``
(a worker's environment), ``lost`` (a worker of this supervisor was lost: announce it, name
its replacement), ``dropped`` (did the job drop this worker), ``tick`` (the job-wide work of
each watch tick, and which workers to stop) and ``busy`` (must the supervisor go on without
workers of its own).
"""

from __future__ import annotations

import multiprocessing.connection
import os
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from ..comm import protocol
from ..comm.net import DEFAULT_ADDR, free_port, is_loopback
from ..comm.rendezvous import choose_interface
from ..comm.store import get_signed, put_signed
from ..core.launch import RESTARTS_INSTEAD
from ..core.secret import JobSecret, new_secret
from .elastic_members import Generations, serve_store
from .elastic_workers import Forked, ScriptStarter, Starter, Worker
from .env import worker_env
from .launch import restarting
from .pack import pack
from .spawn import WorkerError, _context, _worker_main

__all__ = [
    "HANG_SECONDS",
    "ElasticOutcome",
    "OneHost",
    "Peers",
    "Supervisor",
    "run_script_elastic",
    "supervise",
]

# A worker whose heartbeat (every 0.2 s, from a thread) stops this long while its process is
# stopped (SIGSTOP, a debugger) is hung: it is killed and training goes on without it. A running
# process whose heartbeat is silent (one long operation holding the GIL) gets the full timeout.
HANG_SECONDS = 3.0
_TICK = 0.1


class Peers(Protocol):
    """Where the job's other workers live: what a supervisor's events mean for the job."""

    store: Any  # the job's store: the workers' heartbeats, the membership records
    signer: JobSecret | None  # signs the membership records

    def join(self, running: Mapping[int, Worker]) -> tuple[list[int], bool]:
        """The ids of the workers to start, and whether they join a running job (as
        replacements do); ``running``: the supervisor's, as they change."""

    def place(self, wid: int) -> dict[str, str]:
        """Worker ``wid``'s torchrun environment (its rank, the store, the secret)."""

    def lost(self, wid: int, at: float, replace: bool) -> int | None:
        """Announce that worker ``wid`` (killed) was lost at wall time ``at``; returns the id of
        its replacement to start (only if ``replace``, and restarts are left), or ``None``.

        Raises:
            WorkerError: it was the job's last worker.
        """

    def dropped(self, wid: int) -> bool:
        """Whether the job dropped ``wid`` while it ran, so that its error is not its own."""

    def tick(self, finishing: bool) -> tuple[list[int], list[int]]:
        """Once per watch tick (``finishing``: a worker here has finished, the job is ending):
        the job-wide work; returns the workers to stop (replacements that will never join, or
        workers the job dropped) and the newcomers to start (a node that rejoins)."""

    def busy(self) -> bool:
        """Whether the supervisor must go on with none of its own workers left."""


@dataclass
class ElasticOutcome:
    """What the supervisor saw: the result, the workers lost, the replacements started."""

    result: Any
    dead: list[int] = field(default_factory=list)
    replacements: int = 0
    refused: list[str] = field(default_factory=list)  # why newcomers were not let in


def _stopped(pid: int) -> bool:
    """Whether process ``pid`` is stopped (``T`` in /proc: SIGSTOP, or traced)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("T", "t")
    except OSError:
        return False


class Supervisor:
    """Watches the workers it starts; ``peers`` says what their losses mean for the job.

    Args:
        peers: where the job's workers live (:class:`OneHost`, or one node of several).
        start: ``start(wid, joining, env)`` starts worker ``wid`` (a replacement if
            ``joining``) with environment ``env``.
        hang: seconds of a stopped process's silent heartbeat that make it lost.
        timeout: seconds of silent heartbeat that make any worker lost.
    """

    def __init__(self, peers: Peers, start: Starter, hang: float, timeout: float):
        self.peers, self.start_worker = peers, start
        self.hang, self.timeout = hang, timeout
        self.procs: dict[int, Worker] = {}
        self.finishing = False  # a worker has finished: the job is ending
        self.beats: dict[int, tuple[int, float]] = {}  # id -> (count, when it last changed)
        self.outcome = ElasticOutcome(None)
        self.newcomers: set[int] = set()  # started to join a running job
        first, joining = peers.join(self.procs)
        for wid in first:
            self._start(wid, joining)

    def _start(self, wid: int, joining: bool) -> None:
        if joining:
            self.newcomers.add(wid)
        env = {**os.environ, **self.peers.place(wid)}
        self.procs[wid] = self.start_worker(wid, joining, env)

    def run(self, until_all: bool = False) -> ElasticOutcome:
        """Supervise until a worker returns a result (``until_all``: until every one has)."""
        while self.procs or self.peers.busy():
            waits = [w for handle in self.procs.values() for w in handle.waitables()]
            if waits:
                ready = multiprocessing.connection.wait(waits, timeout=_TICK)
            else:
                time.sleep(_TICK)
                ready = []
            for wid, handle in list(self.procs.items()):
                seen = handle.outcome(ready)
                if seen is None:
                    continue
                status, rest = seen
                if status == "error" and self._refused(wid, handle, rest):
                    continue
                if status == "error" and self.peers.dropped(wid):
                    # The job declared it lost (its node fell silent) and trains on without
                    # it; it said so and stopped: not a bug of its own.
                    self.procs.pop(wid).kill()
                    self.outcome.dead.append(wid)
                    continue
                if status == "error":
                    raise handle.failure(wid, rest)
                if status == "ok" and until_all:
                    del self.procs[wid]
                    self.outcome.result = rest[0]
                    self.finishing = True
                elif status == "ok" and rest[0] is not None:
                    self.outcome.result = rest[0]
                    return self.outcome
                else:
                    self._lost(wid, time.time())
            self._watch_heartbeats()
            stop, start = self.peers.tick(self.finishing)
            for wid in stop:
                if wid in self.procs:  # a dropped worker may have ended on its own
                    self.procs.pop(wid).kill()
            for wid in start:
                self._start(wid, joining=True)
        return self.outcome

    def _refused(self, wid: int, handle: Worker, rest: list[Any]) -> bool:
        """A newcomer that differs from the job stopped before it was let in (or as soon as it
        was), or one that failed before it was let in: the job goes on without it, as without
        a lost worker, and is not failed (it never was a member)."""
        store, signer = self.peers.store, self.peers.signer
        why = get_signed(store, signer, protocol.refused(wid))
        if (
            why is None
            and wid in self.newcomers
            and get_signed(store, signer, protocol.joined(wid)) is None
        ):
            failure = str(handle.failure(wid, rest)).splitlines()
            why = (
                f"worker {wid}, a newcomer, failed before the job let it in "
                f"({failure[0] if failure else 'no message'}); the job goes on without it"
            )
            put_signed(store, signer, protocol.refused(wid), why)  # for the job's last line
        if why is None:
            return False
        self.procs.pop(wid).kill()
        self.beats.pop(wid, None)
        self.outcome.refused.append(why)
        print(f"towers: {why}", file=sys.stderr, flush=True)
        self.peers.lost(wid, time.time(), replace=False)
        return True

    def _watch_heartbeats(self) -> None:
        now = time.monotonic()
        store = self.peers.store
        for wid in list(self.procs):
            count = store.add(protocol.heartbeat(wid), 0)
            if count == 0 or store.check([protocol.left(wid)]):
                continue  # not connected yet, or done: its process is watched
            seen = self.beats.get(wid)
            if seen is None or seen[0] != count:
                self.beats[wid] = (count, now)
            elif now - seen[1] > self.hang and (
                _stopped(self.procs[wid].pid) or now - seen[1] > self.timeout
            ):
                self._lost(wid, time.time() - (now - seen[1]))

    def _lost(self, wid: int, at: float) -> None:
        """Kill ``wid`` (it may be hung), announce the loss, replace it if allowed."""
        self.procs.pop(wid).kill()
        self.beats.pop(wid, None)
        self.outcome.dead.append(wid)
        new = self.peers.lost(wid, at, replace=not self.finishing)
        if new is not None:
            self.outcome.replacements += 1
            self._start(new, joining=True)

    def stop(self) -> None:
        for handle in self.procs.values():
            handle.kill()


class OneHost:
    """Every worker of the job is this supervisor's: it hosts the job's store on ``addr`` (a
    free port unless ``port``), keeps the generations, and starts up to ``max_restarts``
    replacements, with the next free ids. ``secret``: the job's (a fresh one by default).
    ``first``: the workers that start the job (0..first-1; default all); the others are
    started with them as newcomers, each let in at the members' next step once it is built.
    The store is hosted by :meth:`connect`, not by the constructor."""

    store: Any
    generations: Generations
    port: int  # the store's, once connected

    def __init__(
        self,
        workers: int,
        max_restarts: int,
        addr: str,
        timeout: float,
        port: int | None = None,
        secret: str | None = None,
        first: int | None = None,
    ):
        self.workers, self.max_restarts, self.addr = workers, max_restarts, addr
        self.first = workers if first is None else first
        # The workers get the job's secret in their environment; it signs the records here.
        self.secret = new_secret() if secret is None else secret
        self.signer: JobSecret | None = JobSecret(self.secret)
        self.asked_port, self.timeout = port, timeout
        self.later = list(range(self.first, workers))  # started at the first tick, as newcomers
        self.restarts, self.next_id = 0, workers
        self.running: Mapping[int, Worker] = {}

    def connect(self) -> OneHost:
        """Host the job's store (on a free port unless one was given) and publish the first
        generation; returns itself.

        Raises:
            OSError: the port is taken, or the address is not this host's.
        """
        self.port = free_port(self.addr) if self.asked_port is None else self.asked_port
        self.store = serve_store(self.addr, self.port, self.timeout, self.signer)
        self.generations = Generations(self.store, self.signer)
        self.generations.publish(list(range(self.first)))
        self.generations.waiting.update(self.later)
        return self

    def join(self, running: Mapping[int, Worker]) -> tuple[list[int], bool]:
        self.running = running
        return list(range(self.first)), False

    def place(self, wid: int) -> dict[str, str]:
        return worker_env(wid, self.workers, self.addr, self.port, secret=self.secret)

    def lost(self, wid: int, at: float, replace: bool) -> int | None:
        self.generations.drop(wid, at)
        if not replace or self.restarts >= self.max_restarts:
            return None
        self.restarts += 1
        new, self.next_id = self.next_id, self.next_id + 1
        self.generations.waiting.add(new)
        return new

    def dropped(self, wid: int) -> bool:
        return False  # on one host a lost worker is killed before the job goes on

    def tick(self, finishing: bool) -> tuple[list[int], list[int]]:
        later, self.later = self.later, []
        if not finishing:
            self.generations.admit()
            return [], later
        return self._latecomers(), later

    def _latecomers(self) -> list[int]:
        """Replacements that the finished members will never take in."""
        gens, stop = self.generations, []
        for wid in list(gens.waiting) + list(gens.admitted):
            g = gens.admitted.get(wid)
            formed = g is not None and self.store.add(protocol.generation(g, "here"), 0) >= len(
                gens.members[g]
            )
            if wid in self.running and not formed:
                stop.append(wid)
                gens.waiting.discard(wid)
                gens.admitted.pop(wid, None)
        return stop

    def busy(self) -> bool:
        return False


def supervise(
    fn: Callable[..., Any],
    workers: int,
    *args: Any,
    max_restarts: int = 0,
    hang: float = HANG_SECONDS,
    timeout: float = 60.0,
    addr: str = DEFAULT_ADDR,
    first: int | None = None,
) -> ElasticOutcome:
    """Run ``fn(*args, joining)`` as an elastic job of ``workers`` local processes (``first``
    of them start it, the others join it as they are ready; default: all start it).

    Each worker gets the torchrun environment with ``RANK`` = its id and ``MASTER_ADDR`` /
    ``MASTER_PORT`` = the job's store, hosted here, and the job's fresh secret
    (``TOWERS_SECRET``); ``joining`` is true for a replacement.
    Workers are lost, announced and replaced as the module doc says; the first result a
    worker returns ends the job, and every process is stopped before this returns.

    Raises:
        WorkerError: every worker was lost.
        Exception: what a worker raised.
    """
    ctx = _context()
    packed = pack((fn, args))  # one shared buffer for every tensor, for first and replacements

    def start(wid: int, joining: bool, env: dict[str, str]) -> Forked:
        recv, send = ctx.Pipe(duplex=False)
        # Not daemonic, as in spawn: a worker may start DataLoader processes of its own.
        p = ctx.Process(target=_worker_main, args=(env, send, packed, joining), daemon=False)
        p.start()
        send.close()
        return Forked(p, recv)

    peers = OneHost(workers, max_restarts, addr, timeout, first=first).connect()
    sup = Supervisor(peers, start, hang, timeout)
    try:
        return sup.run()
    finally:
        sup.stop()


def run_script_elastic(
    script: str,
    workers: int,
    args: Sequence[str] = (),
    *,
    max_restarts: int = 0,
    timeout: float = 60.0,
    addr: str = DEFAULT_ADDR,
    port: int | None = None,
    secret: str | None = None,
) -> int:
    """``towers run --elastic``: run ``python SCRIPT ARGS`` as an elastic job of ``workers``.

    A worker killed by a signal or hung is lost and the others go on (up to ``max_restarts``
    replacements join); one that exits non-zero fails the job. Returns 0 when every remaining
    worker has exited 0, else the failed worker's exit code. The job's store listens on
    ``addr``:``port`` (a free port by default); its workers get ``secret`` (a fresh one by
    default) in their environment.

    A script on ``towers.ddp`` cannot redo a step without a lost worker: its ranks exit with
    :data:`~towers.core.launch.RESTARTS_INSTEAD` as they join, and the job runs as
    ``towers run --max-restarts`` runs it (:func:`~towers.processes.launch.run_script`): every
    rank starts again when one fails, up to ``max_restarts`` times.
    """
    if not is_loopback(addr):
        choose_interface(addr, "gloo")  # the workers' Gloo listens on addr's interface too
    start = ScriptStarter(script, args, workers)
    hang = min(HANG_SECONDS, timeout)
    try:
        peers = OneHost(workers, max_restarts, addr, timeout, port, secret).connect()
        sup = Supervisor(peers, start, hang, timeout)
    except OSError as exc:  # the port is taken, or addr is not this host's
        start.close()
        print(f"towers run: {exc}", file=sys.stderr)
        return 1
    try:
        outcome = sup.run(until_all=True)
    except WorkerError as exc:
        if exc.exitcode != RESTARTS_INSTEAD:
            print(f"towers run: {exc}", file=sys.stderr)
            code = exc.exitcode or 1
            return code if code > 0 else 128 - code
        outcome = None
    finally:
        sup.stop()
        start.close()
    if outcome is None:  # a script on towers.ddp
        del sup, peers  # the store's port is free again
        return restarting(script, workers, args, max_restarts, addr, port, secret)
    if outcome.dead:
        print(
            f"towers run: workers {outcome.dead} were lost, {outcome.replacements} replaced; "
            "the others trained on",
            file=sys.stderr,
        )
    return 0
