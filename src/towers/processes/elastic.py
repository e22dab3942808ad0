"""Supervising an elastic job: host its store, watch its workers, announce losses, replace them.

The supervisor is the process that asked for the job (the caller of ``towers.train``), so the
job's store (:mod:`towers.comm.membership`) lives as long as the job, whichever worker dies. It
watches every worker's process and heartbeat: a worker that exits without a result, or whose
heartbeat stops for :data:`HANG_SECONDS` (SIGSTOP, a deadlock holding the GIL), is lost. The
supervisor kills it first (so that no peer's Gloo thread stays blocked on it), then marks the
generations it belonged to as failed and publishes the next one without it. With
``max_restarts`` it starts a replacement, which is let in (at a step boundary, see
:mod:`towers.engines.sync.elastic`) once it is built.

A worker that raises is not lost but wrong: its exception fails the job, as in
:func:`towers.spawn`. The first worker to return a result ends the job: a worker returns only
after every member has done every step.
"""

from __future__ import annotations

import json
import multiprocessing.connection
import os
import pickle
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from ..comm.membership import key
from ..comm.net import DEFAULT_ADDR, free_port
from .env import worker_env
from .spawn import WorkerError, _context, _failure, _stop, _worker_main

__all__ = ["HANG_SECONDS", "ElasticOutcome", "supervise"]

# A worker whose heartbeat (every 0.2 s, from a thread) stops this long is hung: it is killed
# and training goes on without it. Short, because a false alarm costs only a regroup.
HANG_SECONDS = 3.0
_TICK = 0.1


@dataclass
class ElasticOutcome:
    """What the supervisor saw: the result, the workers lost, the replacements started."""

    result: Any
    dead: list[int] = field(default_factory=list)
    replacements: int = 0


def _host_store(addr: str, port: int, timeout: float) -> Any:
    """The job's store, listening on ``addr`` only."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.bind((addr, port))
        sock.listen()
    except OSError:
        sock.close()
        raise
    return dist.TCPStore(
        addr,
        port,
        None,
        True,
        timedelta(seconds=timeout),
        wait_for_workers=False,
        master_listen_fd=sock.detach(),
    )


class _Supervisor:
    def __init__(
        self,
        fn: Callable[..., Any],
        args: tuple[Any, ...],
        workers: int,
        max_restarts: int,
        hang: float,
        addr: str,
        timeout: float,
    ):
        self.fn, self.args, self.workers = fn, args, workers
        self.max_restarts, self.hang, self.addr = max_restarts, hang, addr
        self.port = free_port(addr)
        self.store = _host_store(addr, self.port, timeout)
        self.ctx = _context()
        self.procs: dict[int, tuple[Any, multiprocessing.connection.Connection]] = {}
        self.generations: dict[int, list[int]] = {}
        self.marked: set[int] = set()  # generations announced as failed
        self.waiting: set[int] = set()  # replacements not yet let in
        self.beats: dict[int, tuple[int, float]] = {}  # id -> (count, when it last changed)
        self.outcome = ElasticOutcome(None)
        self.next_id = workers
        self._publish(list(range(workers)))
        for wid in range(workers):
            self._start(wid, joining=False)

    def _publish(self, members: list[int]) -> int:
        g = len(self.generations)
        self.generations[g] = members
        self.store.set(key(g, "members"), json.dumps(members))
        return g

    def _start(self, wid: int, joining: bool) -> None:
        recv, send = self.ctx.Pipe(duplex=False)
        env = {**os.environ, **worker_env(wid, self.workers, self.addr, self.port)}
        args = (*self.args, joining)
        p = self.ctx.Process(target=_worker_main, args=(self.fn, env, send, args), daemon=True)
        p.start()
        send.close()
        self.procs[wid] = (p, recv)

    def run(self) -> ElasticOutcome:
        while True:
            waits = [c for _, c in self.procs.values()] + [
                p.sentinel for p, _ in self.procs.values()
            ]
            ready = multiprocessing.connection.wait(waits, timeout=_TICK)
            for wid, (p, conn) in list(self.procs.items()):
                if conn in ready or (p.sentinel in ready and conn.poll()):
                    try:
                        status, *rest = pickle.loads(conn.recv_bytes())
                    except (EOFError, OSError):
                        status, rest = "died", []
                elif p.sentinel in ready:
                    status, rest = "died", []
                else:
                    continue
                if status == "ok" and rest[0] is not None:
                    self.outcome.result = rest[0]
                    return self.outcome
                if status == "error":
                    raise _failure(wid, p, status, rest)
                self._lost(wid, time.time())
            self._watch_heartbeats()
            self._admit()

    def _watch_heartbeats(self) -> None:
        now = time.monotonic()
        for wid in list(self.procs):
            count = self.store.add(f"hb/{wid}", 0)
            if count == 0:
                continue  # not connected yet: its process is watched
            seen = self.beats.get(wid)
            if seen is None or seen[0] != count:
                self.beats[wid] = (count, now)
            elif now - seen[1] > self.hang:
                self._lost(wid, time.time() - (now - seen[1]))

    def _lost(self, wid: int, at: float) -> None:
        """Kill ``wid`` (it may be hung), announce the loss, replace it if allowed."""
        p, conn = self.procs.pop(wid)
        p.kill()
        p.join()
        conn.close()
        self.beats.pop(wid, None)
        self.outcome.dead.append(wid)
        if wid in self.waiting:
            self.waiting.discard(wid)
        else:
            info = json.dumps({"dead": [wid], "at": at})
            for g, members in self.generations.items():
                if wid in members and g not in self.marked:
                    self.store.set(key(g, "failed"), info)
                    self.marked.add(g)
            latest = self.generations[len(self.generations) - 1]
            if wid in latest:
                survivors = [m for m in latest if m != wid]
                if not survivors:
                    raise WorkerError(
                        f"every worker of the elastic job was lost (the last, worker {wid}, "
                        f"{'hung' if p.exitcode == -9 else 'died'}); nothing is left to resume "
                        "from: use checkpoint= to keep the progress on disk",
                        wid,
                        p.exitcode,
                    )
                self._publish(survivors)
        if self.outcome.replacements < self.max_restarts:
            self.outcome.replacements += 1
            self.waiting.add(self.next_id)
            self._start(self.next_id, joining=True)
            self.next_id += 1

    def _admit(self) -> None:
        """Let each built replacement into the next generation, at the members' next step."""
        for wid in sorted(self.waiting):
            if not self.store.check([f"ready/{wid}"]):
                continue
            self.waiting.discard(wid)
            current = len(self.generations) - 1
            g = self._publish([*self.generations[current], wid])
            self.store.set(f"join/{wid}", str(g))
            self.store.set(key(current, "regroup"), "1")

    def stop(self) -> None:
        procs = [p for p, _ in self.procs.values()]
        _stop(procs)
        for _, conn in self.procs.values():
            conn.close()


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
    ``MASTER_PORT`` = the job's store, hosted here; ``joining`` is true for a replacement.
    Workers are lost, announced and replaced as the module doc says; the first result a
    worker returns ends the job, and every process is stopped before this returns.

    Raises:
        WorkerError: every worker was lost.
        Exception: what a worker raised.
    """
    sup = _Supervisor(fn, args, workers, max_restarts, hang, addr, timeout)
    try:
        return sup.run()
    finally:
        sup.stop()
