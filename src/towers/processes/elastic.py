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

Across hosts (``towers run --elastic --nnodes M``), :mod:`.elastic_nodes` runs one supervisor
per host over one store, through the hooks ``_tick``, ``_announce``, ``_replace``,
``_admit`` and ``_dropped``.
"""

from __future__ import annotations

import json
import multiprocessing.connection
import os
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..comm.membership import key
from ..comm.net import DEFAULT_ADDR, free_port, is_loopback
from ..comm.rendezvous import choose_interface
from ..comm.store import get_signed, host_store, job_store, put_signed
from ..core.secret import JobSecret, new_secret
from .elastic_workers import Forked, Starter, Worker, script_starter
from .env import worker_env
from .pack import pack
from .spawn import WorkerError, _context, _worker_main

__all__ = ["HANG_SECONDS", "ElasticOutcome", "run_script_elastic", "supervise"]

# A worker whose heartbeat (every 0.2 s, from a thread) stops this long while its process is
# stopped (SIGSTOP, a debugger) is hung: it is killed and training goes on without it. A running
# process whose heartbeat is silent (one long operation holding the GIL) gets the full timeout.
HANG_SECONDS = 3.0
_TICK = 0.1


@dataclass
class ElasticOutcome:
    """What the supervisor saw: the result, the workers lost, the replacements started."""

    result: Any
    dead: list[int] = field(default_factory=list)
    replacements: int = 0


def _host_store(addr: str, port: int, timeout: float, secret: JobSecret | None) -> Any:
    """The job's store, listening on ``addr`` only, with the job's keys under its prefix."""
    return job_store(host_store(addr, port, timeout, secret), secret)


def _stopped(pid: int) -> bool:
    """Whether process ``pid`` is stopped (``T`` in /proc: SIGSTOP, or traced)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("T", "t")
    except OSError:
        return False


class _Supervisor:
    def __init__(
        self,
        start: Starter,
        workers: int,
        max_restarts: int,
        hang: float,
        addr: str,
        timeout: float,
        port: int | None = None,
        secret: str | None = None,
    ):
        secret = new_secret() if secret is None else secret
        self._setup(start, workers, max_restarts, hang, addr, timeout, secret)
        self.port = free_port(addr) if port is None else port
        self.store = _host_store(addr, self.port, timeout, self.secret)
        self._publish(list(range(workers)))
        for wid in range(workers):
            self._start(wid, joining=False)

    def _setup(
        self,
        start: Starter,
        workers: int,
        max_restarts: int,
        hang: float,
        addr: str,
        timeout: float,
        secret: str | None,
    ) -> None:
        self.start_worker, self.workers = start, workers
        self.max_restarts, self.hang, self.addr = max_restarts, hang, addr
        self.timeout = timeout
        # The workers get the job's secret in their environment; it signs the records here.
        self.secret_text = secret
        self.secret = None if secret is None else JobSecret(secret)
        self.procs: dict[int, Worker] = {}
        self.generations: dict[int, list[int]] = {}
        self.marked: set[int] = set()  # generations announced as failed
        self.waiting: set[int] = set()  # replacements not yet let in
        self.admitted: dict[int, int] = {}  # replacement -> the generation it was let into
        self.finishing = False  # a worker has finished: the job is ending
        self.beats: dict[int, tuple[int, float]] = {}  # id -> (count, when it last changed)
        self.outcome = ElasticOutcome(None)
        self.next_id = workers

    def _publish(self, members: list[int]) -> int:
        g = len(self.generations)
        self.generations[g] = members
        put_signed(self.store, self.secret, key(g, "members"), json.dumps(members))
        return g

    def _start(self, wid: int, joining: bool) -> None:
        place = worker_env(wid, self.workers, self.addr, self.port, secret=self.secret_text)
        env = {**os.environ, **place}
        self.procs[wid] = self.start_worker(wid, joining, env)

    def _active(self) -> bool:
        return bool(self.procs)

    def _tick(self) -> None:
        """Once per watch tick: nothing on one host (see :mod:`.elastic_nodes`)."""

    def _dropped(self, wid: int) -> bool:
        """Whether the job dropped ``wid`` while it ran: never on one host (it is killed first)."""
        return False

    def run(self, until_all: bool = False) -> ElasticOutcome:
        """Supervise until a worker returns a result (``until_all``: until every one has)."""
        while self._active():
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
                if status == "error" and self._dropped(wid):
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
            self._tick()
            if self.finishing:
                self._dismiss_latecomers()
            else:
                self._admit()
        return self.outcome

    def _dismiss_latecomers(self) -> None:
        """Stop replacements that the finished members will never take in."""
        for wid in list(self.waiting) + list(self.admitted):
            g = self.admitted.get(wid)
            formed = g is not None and self.store.add(key(g, "here"), 0) >= len(self.generations[g])
            if wid in self.procs and not formed:
                self.procs.pop(wid).kill()
                self.waiting.discard(wid)
                self.admitted.pop(wid, None)

    def _watch_heartbeats(self) -> None:
        now = time.monotonic()
        for wid in list(self.procs):
            count = self.store.add(f"hb/{wid}", 0)
            if count == 0 or self.store.check([f"left/{wid}"]):
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
        self._announce(wid, at)
        self._replace(wid)

    def _announce(self, wid: int, at: float) -> None:
        """Mark the generations ``wid`` was in as failed and publish the next without it."""
        if wid in self.waiting:
            self.waiting.discard(wid)
        else:
            info = json.dumps({"dead": [wid], "at": at})
            for g, members in self.generations.items():
                if wid in members and g not in self.marked:
                    put_signed(self.store, self.secret, key(g, "failed"), info)
                    self.marked.add(g)
            latest = self.generations[len(self.generations) - 1]
            if wid in latest:
                survivors = [m for m in latest if m != wid]
                if not survivors:
                    raise WorkerError(
                        f"every worker of the elastic job was lost (the last: worker {wid}); "
                        "nothing is left to resume from: use checkpoint= to keep the progress "
                        "on disk",
                        wid,
                    )
                self._publish(survivors)

    def _replace(self, wid: int) -> None:
        if self.outcome.replacements < self.max_restarts and not self.finishing:
            self.outcome.replacements += 1
            self.waiting.add(self.next_id)
            self._start(self.next_id, joining=True)
            self.next_id += 1

    def _admit(self) -> None:
        """Let each built replacement into the next generation, at the members' next step."""
        for wid in sorted(self.waiting):
            if get_signed(self.store, self.secret, f"ready/{wid}") is None:
                continue
            self.waiting.discard(wid)
            current = len(self.generations) - 1
            g = self._publish([*self.generations[current], wid])
            self.admitted[wid] = g
            put_signed(self.store, self.secret, f"join/{wid}", str(g))
            put_signed(self.store, self.secret, key(current, "regroup"), "1")

    def stop(self) -> None:
        for handle in self.procs.values():
            handle.kill()


def supervise(
    fn: Callable[..., Any],
    workers: int,
    *args: Any,
    max_restarts: int = 0,
    hang: float = HANG_SECONDS,
    timeout: float = 60.0,
    addr: str = DEFAULT_ADDR,
) -> ElasticOutcome:
    """Run ``fn(*args, joining)`` as an elastic job of ``workers`` local processes.

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

    sup = _Supervisor(start, workers, max_restarts, hang, addr, timeout)
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
    """
    if not is_loopback(addr):
        choose_interface(addr, "gloo")  # the workers' Gloo listens on addr's interface too
    start = script_starter(script, args, workers)
    hang = min(HANG_SECONDS, timeout)
    try:
        sup = _Supervisor(start, workers, max_restarts, hang, addr, timeout, port, secret)
    except OSError as exc:  # the port is taken, or addr is not this host's
        print(f"towers run: {exc}", file=sys.stderr)
        return 1
    try:
        outcome = sup.run(until_all=True)
    except WorkerError as exc:
        print(f"towers run: {exc}", file=sys.stderr)
        code = exc.exitcode or 1
        return code if code > 0 else 128 - code
    finally:
        sup.stop()
    if outcome.dead:
        print(
            f"towers run: workers {outcome.dead} were lost, {outcome.replacements} replaced; "
            "the others trained on",
            file=sys.stderr,
        )
    return 0
