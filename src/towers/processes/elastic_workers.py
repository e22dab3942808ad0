"""The workers an elastic supervisor watches (:mod:`.elastic`): forked, or a script.

``train(elastic=True)`` forks its workers (:class:`Forked`), which send their result or their
exception back through a pipe; ``towers run --elastic`` starts ``python SCRIPT`` (:class:`Script`),
whose exit code is all it says. The supervisor treats both alike through :class:`Worker`.
"""

from __future__ import annotations

import multiprocessing.connection
import pickle
import subprocess
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from ..core.launch import ELASTIC
from .env import describe_exit, thread_share
from .spawn import WorkerError, _failure
from .zygote import Rank, Zygote, can_fork, start_script, zygote_for

__all__ = ["Forked", "Script", "ScriptStarter", "Starter", "Worker"]


class Worker(Protocol):
    """One worker process as the supervisor watches it."""

    pid: int

    def waitables(self) -> list[Any]:
        """What :func:`multiprocessing.connection.wait` can wait on for it (may be none)."""

    def outcome(self, ready: list[Any]) -> tuple[str, list[Any]] | None:
        """``("ok", [result])``, ``("error", [...])``, ``("died", [])``, or ``None`` (running)."""

    def failure(self, wid: int, rest: list[Any]) -> BaseException:
        """The error that fails the job, from an ``"error"`` outcome."""

    def kill(self) -> None:
        """Kill it, and reap it."""


# start(wid, joining, env): worker wid (a replacement if joining) with environment env.
Starter = Callable[[int, bool, dict[str, str]], Worker]


class Forked:
    """A worker forked by :mod:`multiprocessing` that reports its result through a pipe."""

    def __init__(self, proc: Any, conn: multiprocessing.connection.Connection):
        self.proc, self.conn = proc, conn
        self.pid = proc.pid

    def waitables(self) -> list[Any]:
        return [self.conn, self.proc.sentinel]

    def outcome(self, ready: list[Any]) -> tuple[str, list[Any]] | None:
        """``("ok", [result])``, ``("error", [exc, traceback])``, ``("died", [])`` or ``None``."""
        if self.conn in ready or (self.proc.sentinel in ready and self.conn.poll()):
            try:
                status, *rest = pickle.loads(self.conn.recv_bytes())
            except (EOFError, OSError):
                return "died", []
            return status, rest
        if self.proc.sentinel in ready:
            return "died", []
        return None

    def failure(self, wid: int, rest: list[Any]) -> BaseException:
        return _failure(wid, self.proc, "error", rest)

    def kill(self) -> None:
        self.proc.kill()
        self.proc.join()
        self.conn.close()


class Script:
    """A worker that runs a script (``towers run --elastic``): exit 0 is done, a signal lost."""

    def __init__(self, proc: Rank | subprocess.Popen[bytes]):
        self.proc = proc
        self.pid = proc.pid

    def waitables(self) -> list[Any]:
        return []

    def outcome(self, ready: list[Any]) -> tuple[str, list[Any]] | None:
        code = self.proc.poll()
        if code is None:
            return None
        if code == 0:
            return "ok", [None]
        return ("died", []) if code < 0 else ("error", [code])

    def failure(self, wid: int, rest: list[Any]) -> BaseException:
        return WorkerError(f"worker {wid} failed with {describe_exit(rest[0])}", wid, rest[0])

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()


class ScriptStarter:
    """Starts ``python SCRIPT ARGS`` as an elastic worker (a replacement if ``joining``).

    The workers, replacements included, are forked from one interpreter that has imported torch
    (:mod:`.zygote`), so a replacement starts in milliseconds, not seconds. Where this process
    can fork it (the ``towers`` command, before the store's and the heartbeat's threads start),
    the zygote is forked at once and imports the rest with the first worker; otherwise it starts
    with the first worker. Either way a node that the job refuses imports nothing more.
    :meth:`close` stops it.
    """

    def __init__(self, script: str, args: Sequence[str], local_workers: int):
        self.argv = [script, *args]
        self.local_workers = local_workers
        self.threads = str(thread_share(local_workers))
        self.zygote: Zygote | None = None
        self.started = False
        if can_fork():
            self._start_zygote()

    def _start_zygote(self) -> None:
        self.zygote = zygote_for(self.local_workers)  # None: fresh interpreters (spawn)
        self.started = True

    def __call__(self, wid: int, joining: bool, env: dict[str, str]) -> Script:
        if not self.started:
            self._start_zygote()
        env = {**env, ELASTIC: "join" if joining else "1"}  # towers run --elastic
        env.setdefault("OMP_NUM_THREADS", self.threads)
        return Script(start_script(self.zygote, self.argv, env))

    def close(self) -> None:
        if self.zygote is not None:
            self.zygote.close()
