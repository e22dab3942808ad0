"""``towers.spawn``: run a function in local worker processes, with clean failure.

Workers get the torchrun environment (:mod:`towers.processes.env`) with a fresh job secret, and
report their result or their exception through a pipe; a worker that dies is named with its exit
code or signal, and no process is left behind whatever happens. Rendezvous binds 127.0.0.1
unless told otherwise.
"""

from __future__ import annotations

import contextlib
import multiprocessing.connection
import os
import pickle
import signal
import sys
import time
import traceback
from collections.abc import Callable, Collection
from typing import Any

import torch.distributed as dist
import torch.multiprocessing as mp

from ..comm.hang import PeerHang
from ..comm.net import DEFAULT_ADDR, free_port
from ..core.args import check_timeout
from ..core.secret import new_secret
from .env import describe_exit, set_worker_threads, worker_env
from .guard import check_main_guard
from .lifeline import watch_caller
from .oom import OomWatch
from .pack import Packed, pack, unpack

__all__ = ["WorkerError", "spawn"]

_LONGEST_POLL = 86400.0  # seconds


class WorkerError(RuntimeError):
    """A worker process failed: it raised, was killed by a signal, or exited non-zero.

    Attributes:
        rank: the failed worker's rank.
        exitcode: its exit code (negative: killed by that signal), or ``None`` if it raised.
    """

    def __init__(self, message: str, rank: int, exitcode: int | None = None):
        super().__init__(message)
        self.rank = rank
        self.exitcode = exitcode


def _worker_main(
    env: dict[str, str], conn: multiprocessing.connection.Connection, packed: Packed, *extra: Any
) -> None:
    # The forkserver's environment is the caller's as it was when the server started: give the
    # worker the caller's environment as it is now, plus the launcher's variables.
    watch_caller(conn.fileno())  # die with the caller, however it dies
    os.environ.clear()
    os.environ.update(env)
    set_worker_threads(int(env["LOCAL_WORLD_SIZE"]))
    try:
        fn, args = unpack(packed)
        payload: tuple[Any, ...] = ("ok", fn(*args, *extra))
    except BaseException as exc:  # report everything, SystemExit and KeyboardInterrupt too
        payload = ("error", exc, traceback.format_exc())
    finally:
        if dist.is_available() and dist.is_initialized():
            with contextlib.suppress(Exception):
                dist.destroy_process_group()
    try:
        data = pickle.dumps(payload)
    except Exception as exc:  # an unpicklable result or exception
        what = "return value" if payload[0] == "ok" else "exception"
        tb = payload[2] if payload[0] == "error" else ""
        data = pickle.dumps(
            ("error", RuntimeError(f"the worker's {what} cannot be pickled: {exc}"), tb)
        )
    conn.send_bytes(data)
    conn.close()
    if payload[0] == "error":
        sys.exit(1)


def _context() -> Any:
    # forkserver forks workers from a clean server process that has already imported torch, so
    # a worker starts in a fraction of the time a fresh interpreter takes, and without inheriting
    # the caller's threads (forking a process that has run OpenMP regions can deadlock).
    # torch._dynamo is preloaded too: building the first optimizer imports it (about a second).
    method = "forkserver" if "forkserver" in mp.get_all_start_methods() else "spawn"
    ctx = mp.get_context(method)
    if method == "forkserver":
        ctx.set_forkserver_preload(["torch", "torch._dynamo", "towers"])
    return ctx


def _stop(procs: list[Any], grace: float = 3.0) -> None:
    """Terminate, then kill, every process still alive; reap them all."""
    for p in procs:
        if p.is_alive():
            p.terminate()
            with contextlib.suppress(OSError):
                os.kill(p.pid, signal.SIGCONT)  # a stopped process takes SIGTERM only once running
    deadline = time.monotonic() + grace
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join()


def spawn(
    fn: Callable[..., Any],
    workers: int,
    *args: Any,
    addr: str = DEFAULT_ADDR,
    port: int | None = None,
    timeout: float | None = None,
    failure_grace: float = 5.0,
    tolerate: Collection[int] = (),
) -> list[Any]:
    """Run ``fn(*args)`` in ``workers`` local processes and return their results by rank.

    Each worker gets the torchrun environment (``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``,
    ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``), the job's fresh secret
    (``TOWERS_SECRET``, which signs its messages) and ``cores // workers`` threads, so
    ``fn`` can call :func:`towers.init`. ``fn`` and ``args`` are pickled: ``fn`` must be defined
    at module level, and the calling script needs an ``if __name__ == "__main__":`` guard.

    If a worker raises, the same exception is raised here (the worker's traceback attached as a
    note); if one dies (signal or non-zero exit), :class:`WorkerError` names it. Either way the
    other workers get ``failure_grace`` seconds to finish, then are terminated: none is left
    behind. Ranks in ``tolerate`` may die (a signal, or an exit without a result) without failing
    the job: their result is ``None`` (the parameter server uses this to survive lost workers).
    An exception raised in a tolerated rank is still raised here.

    Args:
        fn: a module-level function; its return value must be picklable.
        workers: number of processes, >= 1.
        *args: passed to ``fn`` in every worker.
        addr: rendezvous address (``MASTER_ADDR``); loopback by default.
        port: rendezvous port (``MASTER_PORT``); a free one by default.
        timeout: seconds after which all workers are stopped and ``TimeoutError`` is raised.
        failure_grace: seconds the other workers get after one fails.
        tolerate: ranks allowed to die; their result is ``None``.

    Returns:
        ``[fn's result on rank 0, rank 1, ...]``.

    Example:
        >>> def hello():
        ...     return int(os.environ["RANK"])
        >>> towers.spawn(hello, 2)  # doctest: +SKIP
        [0, 1]
    """
    if isinstance(workers, bool) or not isinstance(workers, int):
        raise TypeError(f"workers must be an int, got {type(workers).__name__}")
    if workers < 1:
        raise ValueError(f"workers must be >= 1, got {workers}")
    timeout = check_timeout(timeout)
    check_main_guard("towers.spawn()")
    port = free_port(addr) if port is None else port
    secret = new_secret()  # the job's, in each worker's environment: signs its messages
    ctx = _context()
    packed = pack((fn, args))  # one shared buffer for every tensor, see processes/pack.py
    oom = OomWatch()
    procs, conns = [], []
    try:
        for rank in range(workers):
            recv, send = ctx.Pipe(duplex=False)
            env = {**os.environ, **worker_env(rank, workers, addr, port, secret=secret)}
            # Not daemonic: a worker may start processes of its own (DataLoader's num_workers),
            # which multiprocessing refuses to a daemon; the finally below stops every worker.
            p = ctx.Process(target=_worker_main, args=(env, send, packed), daemon=False)
            p.start()
            send.close()
            procs.append(p)
            conns.append(recv)
        return _collect(procs, conns, timeout, failure_grace, frozenset(tolerate), oom)
    finally:
        _stop(procs)
        for c in conns:
            c.close()


def _collect(
    procs: list[Any],
    conns: list[multiprocessing.connection.Connection],
    timeout: float | None,
    failure_grace: float,
    tolerate: frozenset[int] = frozenset(),
    oom: OomWatch | None = None,
) -> list[Any]:
    results: dict[int, Any] = {}
    failures: list[tuple[str, BaseException]] = []
    deadline = None if timeout is None else time.monotonic() + timeout
    stop_at = None  # set once a worker failed: the others get failure_grace seconds
    pending = dict(enumerate(conns))
    while pending:
        now = time.monotonic()
        limits = [t for t in (deadline, stop_at) if t is not None]
        # poll(2) takes at most 2**31 ms (24 days): a longer timeout is waited in turns
        wait = None if not limits else min(max(0.0, min(limits) - now), _LONGEST_POLL)
        ready = multiprocessing.connection.wait(
            list(pending.values()) + [procs[r].sentinel for r in pending], timeout=wait
        )
        for rank in list(pending):
            conn, proc = pending[rank], procs[rank]
            if conn in ready or (proc.sentinel in ready and conn.poll()):
                try:
                    status, *rest = pickle.loads(conn.recv_bytes())
                except (EOFError, OSError):
                    status, rest = "died", []
            elif proc.sentinel in ready:
                status, rest = "died", []
            else:
                continue
            del pending[rank]
            if status == "ok":
                results[rank] = rest[0]
                continue
            if status == "died" and rank in tolerate:
                results[rank] = None
                continue
            failures.append((status, _failure(rank, proc, status, rest, oom)))
            if stop_at is None:
                # A rank that names a stuck peer has said all there is to say: the stuck one
                # will not report, and waiting for it would only delay the error.
                hang = isinstance(failures[-1][1], PeerHang)
                stop_at = time.monotonic() + (min(0.1, failure_grace) if hang else failure_grace)
        now = time.monotonic()
        if stop_at is None and pending and set(pending) <= tolerate and len(results) > 0:
            # Every rank that counts has returned; a tolerated one still running (a tower that
            # hung) gets a moment, then is stopped.
            stop_at = now + min(1.0, failure_grace)
        if deadline is not None and now >= deadline and pending:
            raise TimeoutError(
                f"workers {sorted(pending)} did not finish within {timeout} s; all were stopped"
            )
        if stop_at is not None and now >= stop_at:
            break
    if failures:
        # A worker that died takes the others' collectives down with it ("connection reset by
        # peer"), and their errors may arrive first: the death is the cause to report.
        died = [exc for status, exc in failures if status == "died"]
        raise died[0] if died else failures[0][1]
    return [results.get(r) for r in range(len(procs))]


def _failure(
    rank: int, proc: Any, status: str, rest: list[Any], oom: OomWatch | None = None
) -> BaseException:
    if status == "error":
        exc, tb = rest
        if isinstance(exc, (KeyboardInterrupt, SystemExit)) or not isinstance(exc, BaseException):
            exc = WorkerError(f"worker {rank} stopped: {exc!r}", rank)
        with contextlib.suppress(AttributeError):
            exc.add_note(f"raised in towers worker {rank}:\n{tb}")
        return exc
    proc.join(1.0)
    why = oom.explain(proc.exitcode) if oom is not None else ""
    return WorkerError(
        f"worker {rank} (pid {proc.pid}) died with {describe_exit(proc.exitcode)} "
        f"before returning a result{why}",
        rank,
        proc.exitcode,
    )
