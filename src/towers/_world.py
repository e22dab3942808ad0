"""Worker processes: the torchrun environment, free ports, and ``spawn`` with clean failure.

Every worker sees what ``torchrun`` would give it (``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``,
``LOCAL_WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``), so code written for ``towers.spawn`` or
``towers run`` runs unchanged under ``torchrun``. Rendezvous binds 127.0.0.1 unless told
otherwise: torch.distributed has no authentication and belongs on trusted networks only.
"""

from __future__ import annotations

import contextlib
import ipaddress
import multiprocessing.connection
import os
import pickle
import signal
import socket
import sys
import time
import traceback
from collections.abc import Callable, Collection, Mapping
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

__all__ = [
    "ENV_KEYS",
    "WorkerError",
    "cpu_count",
    "describe_exit",
    "free_port",
    "launched_env",
    "spawn",
    "worker_env",
]

ENV_KEYS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
DEFAULT_ADDR = "127.0.0.1"
# How long a rank waits for the others (rendezvous, or any collective) before the job fails:
# a dead or stuck worker ends the job within this bound instead of hanging it.
DEFAULT_TIMEOUT = 60.0


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


def cpu_count() -> int:
    """Cores this process may run on (respects CPU affinity and container limits)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not Linux
        return max(1, os.cpu_count() or 1)


def free_port(addr: str = DEFAULT_ADDR) -> int:
    """A TCP port that is free on ``addr`` right now (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((addr, 0))
        return int(s.getsockname()[1])


def worker_env(rank: int, world_size: int, addr: str, port: int) -> dict[str, str]:
    """The variables torchrun sets for one worker of a single-node job.

    On a loopback address Gloo is also told to use the loopback interface, so that no socket of
    a local job listens on the network.
    """
    env = {}
    if _is_loopback(addr) and os.path.exists("/sys/class/net/lo"):
        env["GLOO_SOCKET_IFNAME"] = os.environ.get("GLOO_SOCKET_IFNAME", "lo")
    return env | {
        "RANK": str(rank),
        "LOCAL_RANK": str(rank),
        "WORLD_SIZE": str(world_size),
        "LOCAL_WORLD_SIZE": str(world_size),
        "GROUP_RANK": "0",
        "MASTER_ADDR": addr,
        "MASTER_PORT": str(port),
    }


def launched_env(environ: Mapping[str, str] | None = None) -> bool:
    """Whether this process was started by a launcher (torchrun, ``towers run``, ``spawn``)."""
    env = os.environ if environ is None else environ
    return all(k in env for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"))


def describe_exit(exitcode: int | None) -> str:
    """'exit code 3' or 'signal SIGKILL' for a process's exit status."""
    if exitcode is None:
        return "no exit status"
    if exitcode < 0:
        try:
            return f"signal {signal.Signals(-exitcode).name}"
        except ValueError:
            return f"signal {-exitcode}"
    return f"exit code {exitcode}"


def set_worker_threads(local_world_size: int) -> None:
    """Give each of the local workers an equal share of the cores (at least one thread)."""
    torch.set_num_threads(max(1, cpu_count() // max(1, local_world_size)))


def _worker_main(
    fn: Callable[..., Any],
    env: dict[str, str],
    conn: multiprocessing.connection.Connection,
    args: tuple[Any, ...],
) -> None:
    # The forkserver's environment is the caller's as it was when the server started: give the
    # worker the caller's environment as it is now, plus the launcher's variables.
    os.environ.clear()
    os.environ.update(env)
    set_worker_threads(int(env["LOCAL_WORLD_SIZE"]))
    try:
        payload: tuple[Any, ...] = ("ok", fn(*args))
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
    ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``) and ``cores // workers`` threads, so
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
    port = free_port(addr) if port is None else port
    ctx = _context()
    procs, conns = [], []
    try:
        for rank in range(workers):
            recv, send = ctx.Pipe(duplex=False)
            env = {**os.environ, **worker_env(rank, workers, addr, port)}
            p = ctx.Process(target=_worker_main, args=(fn, env, send, args), daemon=True)
            p.start()
            send.close()
            procs.append(p)
            conns.append(recv)
        return _collect(procs, conns, timeout, failure_grace, frozenset(tolerate))
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
) -> list[Any]:
    results: dict[int, Any] = {}
    failures: list[tuple[str, BaseException]] = []
    deadline = None if timeout is None else time.monotonic() + timeout
    stop_at = None  # set once a worker failed: the others get failure_grace seconds
    pending = dict(enumerate(conns))
    while pending:
        now = time.monotonic()
        limits = [t for t in (deadline, stop_at) if t is not None]
        wait = None if not limits else max(0.0, min(limits) - now)
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
            failures.append((status, _failure(rank, proc, status, rest)))
            if stop_at is None:
                stop_at = time.monotonic() + failure_grace
        now = time.monotonic()
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
    return [results[r] for r in range(len(procs))]


def _failure(rank: int, proc: Any, status: str, rest: list[Any]) -> BaseException:
    if status == "error":
        exc, tb = rest
        if isinstance(exc, (KeyboardInterrupt, SystemExit)) or not isinstance(exc, BaseException):
            exc = WorkerError(f"worker {rank} stopped: {exc!r}", rank)
        with contextlib.suppress(AttributeError):
            exc.add_note(f"raised in towers worker {rank}:\n{tb}")
        return exc
    proc.join(1.0)
    return WorkerError(
        f"worker {rank} (pid {proc.pid}) died with {describe_exit(proc.exitcode)} "
        "before returning a result",
        rank,
        proc.exitcode,
    )


def _is_loopback(addr: str) -> bool:
    try:
        return ipaddress.ip_address(socket.gethostbyname(addr)).is_loopback
    except (OSError, ValueError):
        return False


def _loopback_store(addr: str, port: int, rank: int, world: int, timeout: timedelta) -> Any:
    """A rendezvous store that listens on loopback only.

    torch's TCPStore listens on every interface; handing it a socket bound to ``addr`` keeps a
    single-machine job unreachable from the network.
    """
    if rank == 0:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        try:
            sock.bind((addr, port))
            sock.listen()
        except OSError as exc:
            sock.close()
            raise OSError(
                exc.errno,
                f"cannot listen for the rendezvous on {addr}:{port}: {exc.strerror}; the port is "
                "in use: choose another MASTER_PORT, or leave it unset for a free one",
            ) from None
        return dist.TCPStore(
            addr, port, world, True, timeout, wait_for_workers=False, master_listen_fd=sock.detach()
        )
    try:
        return dist.TCPStore(addr, port, world, False, timeout)
    except dist.DistError as exc:
        raise TimeoutError(
            f"rank {rank} could not reach the rendezvous at {addr}:{port} within "
            f"{timeout.total_seconds():g} s: is rank 0 running, and are MASTER_ADDR and "
            f"MASTER_PORT right? ({str(exc).splitlines()[0]})"
        ) from None


def init_process_group(backend: str | None = None, timeout: float | None = None) -> Any:
    """Initialise the default process group from the launcher's environment.

    Under torchrun the agent's store is used, one key space per restart attempt. A job of our
    own on a loopback ``MASTER_ADDR`` gets a store that listens on loopback only.
    """
    if dist.is_initialized():
        return dist.group.WORLD
    if backend is None:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    wait = timedelta(seconds=DEFAULT_TIMEOUT if timeout is None else timeout)
    kwargs: dict[str, Any] = {"backend": backend, "timeout": wait}
    if backend == "nccl":
        kwargs["device_id"] = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    addr, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        # torchrun's agent hosts the store. After a restart (--max-restarts) the keys of the
        # failed attempt can still be there, and Gloo would dial the dead workers' addresses:
        # keep each attempt's keys apart.
        attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        client = dist.TCPStore(addr, port, world, False, wait)
        store = dist.PrefixStore(f"towers/attempt_{attempt}", client)
        dist.init_process_group(store=store, rank=rank, world_size=world, **kwargs)
    elif _is_loopback(addr):
        store = _loopback_store(addr, port, rank, world, wait)
        dist.init_process_group(store=store, rank=rank, world_size=world, **kwargs)
    else:
        dist.init_process_group(init_method="env://", **kwargs)
    return dist.group.WORLD
