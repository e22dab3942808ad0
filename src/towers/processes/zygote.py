"""Script ranks forked from one interpreter that has already imported torch.

``towers run`` starts ``python SCRIPT`` once per rank. A fresh interpreter spends about 4.5 s of
CPU before the script's first step: 2.5 s importing torch and 2 s importing ``torch._dynamo``,
which building the first optimizer does. Every rank pays it, side by side, so on a 2-core
machine 4 ranks take two rounds of it; a replacement worker of an elastic job pays it while
the job waits for it. A zygote (the name Android gives its process that forks every app) pays it
once: ``towers run`` starts it first, it imports torch, ``torch._dynamo`` and towers, freezes
what it loaded out of garbage collection, and forks each rank on request. A rank then starts in
a few milliseconds and shares the imported pages with its siblings.

A forked rank is made to look as ``python SCRIPT ARGS`` would: its own environment, working
directory, standard output and error (received as file descriptors), ``sys.argv``,
``sys.path[0]`` (the script's directory), a fresh ``__main__`` module, torch's thread count
from ``OMP_NUM_THREADS`` (read at the zygote's import of torch, so set again), numpy's global
generator reseeded (Python's ``random`` reseeds itself after a fork), the default signal
handlers, and a traceback that starts in the script. It exits as the interpreter would, waiting
for its non-daemon threads and running its ``atexit`` functions.

The zygote dies with its caller (``PR_SET_PDEATHSIG``, and the end of its socket), and each rank
with the zygote, so no rank outlives ``towers run``. The zygote reaps the ranks and reports their
exit codes; it also signals them on request, so a signal never reaches a reused process id.
Requests travel over a socket pair only the caller holds, as JSON (nothing is unpickled).

A caller that has imported torch itself and runs no other thread (the ``towers`` command) forks
the zygote instead of starting it, so that torch is imported once per job, not twice; the
zygote imports only what the caller has not. A rank of a forked zygote never returns into the
caller's code: it ends as the interpreter would, then leaves with ``os._exit``.

``TOWERS_START_METHOD=spawn`` starts every rank as a fresh interpreter instead.
"""

from __future__ import annotations

import contextlib
import gc
import json
import os
import select
import signal
import socket
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Mapping, Sequence
from typing import IO, Any

from .as_script import Job, run_and_end
from .env import describe_exit, thread_share
from .lifeline import die_with_parent
from .start import START_ENV, default_signal_handlers

__all__ = [
    "PRELOAD",
    "ForkedZygote",
    "Rank",
    "Zygote",
    "can_fork",
    "main",
    "start_script",
    "zygote_for",
]

PRELOAD = ("torch", "torch._dynamo", "towers")
_LIMIT = 1 << 20  # bytes of one request (argv and environment)
_KILLED = -signal.SIGKILL


class Rank:
    """A script forked by a :class:`Zygote`, watched like a ``subprocess.Popen``."""

    def __init__(self, zygote: Zygote, pid: int, streams: dict[str, IO[bytes] | None]):
        self.zygote, self.pid = zygote, pid
        self.stdout, self.stderr = streams["stdout"], streams["stderr"]
        self.returncode: int | None = None

    def poll(self) -> int | None:
        self.returncode = self.zygote._code(self.pid, 0.0)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        code = self.zygote._code(self.pid, timeout)
        if code is None:
            raise subprocess.TimeoutExpired([str(self.pid)], timeout or 0.0)
        self.returncode = code
        return code

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            self.zygote._send({"op": "signal", "pid": self.pid, "sig": int(sig)})

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class Zygote:
    """An interpreter with torch imported that forks ``python SCRIPT ARGS`` ranks on request.

    ``env``: the zygote's own environment (default: this process's); torch reads some of it at
    import. ``fork``: fork this process rather than start a new interpreter (default: where
    this process has imported torch and runs no other thread; see the module doc). Start it
    early: its imports take a few seconds, in which the caller may go on, and :meth:`start`
    waits for them.
    """

    def __init__(self, env: Mapping[str, str] | None = None, *, fork: bool | None = None):
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        if fork is None:
            fork = can_fork()
        with theirs:
            self.proc: ForkedZygote | subprocess.Popen[bytes]
            if fork:
                self.proc = ForkedZygote.fork(theirs, ours, env)
            else:
                code = "from towers.processes.zygote import main; main()"
                self.proc = subprocess.Popen(
                    [sys.executable, "-c", code, str(theirs.fileno())],
                    env=None if env is None else dict(env),
                    pass_fds=[theirs.fileno()],
                    preexec_fn=die_with_parent(),
                )
        self.sock = ours
        self.changed = threading.Condition()
        self.pids: dict[int, int] = {}  # request number -> rank pid
        self.codes: dict[int, int] = {}  # rank pid -> exit code
        self.requests = 0
        self.gone = False  # the zygote has died
        threading.Thread(target=self._listen, name="towers-zygote", daemon=True).start()

    def start(
        self,
        argv: Sequence[str],
        env: Mapping[str, str],
        *,
        stdout: int | None = None,
        stderr: int | None = None,
        timeout: float = 120.0,
    ) -> Rank:
        """Fork ``python *argv`` with ``env``; ``stdout``/``stderr`` as ``subprocess.Popen``
        takes them (``None``: this process's, ``subprocess.PIPE`` or ``subprocess.DEVNULL``)."""
        sent: list[int] = []
        ours: dict[str, IO[bytes] | None] = {"stdout": None, "stderr": None}
        with contextlib.ExitStack() as closing:
            for name, how in (("stdout", stdout), ("stderr", stderr)):
                if how == subprocess.PIPE:
                    read, write = os.pipe()
                    ours[name] = open(read, "rb")  # noqa: SIM115 (the caller reads and closes it)
                    sent.append(write)
                    closing.callback(os.close, write)
                elif how == subprocess.DEVNULL:
                    devnull = os.open(os.devnull, os.O_WRONLY)
                    sent.append(devnull)
                    closing.callback(os.close, devnull)
                else:
                    sent.append(-1)
            with self.changed:
                self.requests += 1
                number = self.requests
            request = {"op": "start", "id": number, "argv": list(argv), "env": dict(env)}
            request["cwd"] = os.getcwd()
            request["fds"] = [fd >= 0 for fd in sent]
            self._send(request, [fd for fd in sent if fd >= 0])
        with self.changed:
            if not self.changed.wait_for(lambda: number in self.pids or self.gone, timeout):
                raise TimeoutError(f"the zygote started no rank in {timeout:g} s")
            if number not in self.pids:
                died = describe_exit(self.proc.wait())
                raise RuntimeError(f"the zygote died ({died}) before it started a rank")
            pid = self.pids.pop(number)
        return Rank(self, pid, ours)

    def close(self) -> None:
        """Stop the zygote; ranks still running are killed with it."""
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)
        try:
            self.proc.wait(5)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.sock.close()

    def _send(self, request: dict[str, Any], fds: Sequence[int] = ()) -> None:
        data = json.dumps(request).encode()
        if len(data) > _LIMIT:
            size = f"{len(data)} bytes; at most {_LIMIT} fit"
            raise ValueError(f"a rank's arguments and environment take {size}")
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):
            socket.send_fds(self.sock, [data], list(fds))

    def _code(self, pid: int, timeout: float | None) -> int | None:
        with self.changed:
            self.changed.wait_for(lambda: pid in self.codes or self.gone, timeout)
            return self.codes.get(pid, _KILLED if self.gone else None)

    def _listen(self) -> None:
        while True:
            try:
                data = self.sock.recv(_LIMIT)
            except OSError:
                data = b""
            with self.changed:
                if not data:
                    self.gone = True  # its ranks died with it
                else:
                    event = json.loads(data)
                    if "exited" in event:
                        self.codes[event["exited"]] = event["code"]
                    else:
                        self.pids[event["started"]] = event["pid"]
                self.changed.notify_all()
            if not data:
                return


def can_fork() -> bool:
    """Whether a zygote forked from this process, now, would gain and be safe: this process has
    imported torch, and runs no other thread (whose locks a fork could inherit held)."""
    return "torch" in sys.modules and threading.active_count() == 1


def zygote_for(local_workers: int) -> Zygote | None:
    """A zygote for ``local_workers`` ranks on this host, or ``None`` where
    ``TOWERS_START_METHOD=spawn`` asks for fresh interpreters. Its environment is this
    process's, with each rank's default share of the cores in ``OMP_NUM_THREADS``
    (:func:`~towers.processes.env.thread_share`), which torch reads at import."""
    if os.environ.get(START_ENV) == "spawn":
        return None
    return Zygote({"OMP_NUM_THREADS": str(thread_share(local_workers)), **os.environ})


def start_script(
    zygote: Zygote | None, argv: Sequence[str], env: Mapping[str, str], **streams: Any
) -> Rank | subprocess.Popen[bytes]:
    """Start ``python *argv``: forked by ``zygote``, or a fresh interpreter if it is ``None``."""
    if zygote is None:
        cmd = [sys.executable, *argv]
        return subprocess.Popen(cmd, env=dict(env), preexec_fn=die_with_parent(), **streams)
    return zygote.start(argv, env, **streams)


class ForkedZygote:
    """A zygote forked from the caller, watched like a ``subprocess.Popen``."""

    def __init__(self, pid: int):
        self.pid = pid
        self.returncode: int | None = None

    @classmethod
    def fork(
        cls, theirs: socket.socket, ours: socket.socket, env: Mapping[str, str] | None
    ) -> ForkedZygote:
        """Fork a zygote that serves ``theirs`` (``ours``: the caller's end, closed in it)."""
        arm = die_with_parent()
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid:
            return cls(pid)
        code = 1
        try:
            ours.close()
            arm()
            if env is not None:
                os.environ.clear()
                os.environ.update(env)
            job = _preload_and_serve(theirs, lazy=True)
            code = 0 if job is None else run_and_end(job)
        except BaseException:
            traceback.print_exc()
        finally:
            os._exit(code)  # never back into the caller's code

    def poll(self) -> int | None:
        if self.returncode is None:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired([str(self.pid)], timeout or 0.0)
            time.sleep(0.01)
        assert self.returncode is not None
        return self.returncode

    def kill(self) -> None:
        if self.poll() is None:
            os.kill(self.pid, signal.SIGKILL)


def main() -> None:
    """The zygote: preload, serve requests on the socket named in ``sys.argv[1]``, and in each
    forked child run its script."""
    job = _preload_and_serve(socket.socket(fileno=int(sys.argv[1])))
    if job is not None:
        code = run_and_end(job)
        os._exit(code)  # as a forked zygote's rank: no destructors at interpreter shutdown


def _preload_and_serve(sock: socket.socket, lazy: bool = False) -> Job | None:
    """Import what a rank needs, and serve (see :func:`_serve`). ``lazy``: import it with the
    first request (a forked zygote, which has torch already: an elastic node that the job
    refuses starts no worker, and imports nothing more)."""
    # Python's own handler, or SIG_IGN where the caller started it with SIGINT ignored (a
    # background job of a shell): a fresh interpreter keeps the latter, and so does each rank
    interrupt = signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C is the ranks' to handle
    if not lazy:
        _preload()
    return _serve(sock, interrupt, loaded=not lazy)


def _preload() -> None:
    for name in PRELOAD:
        __import__(name)
    gc.freeze()  # what every rank inherits is never walked by its garbage collector


def _serve(sock: socket.socket, interrupt: Any, loaded: bool) -> Job | None:
    """Fork a child per request (with :data:`PRELOAD` imported, at the first one unless
    ``loaded``); return its job in the child, ``None`` when the caller is gone.
    ``interrupt``: the child's ``SIGINT`` handler."""
    wake_read, wake_write = os.pipe()
    for fd in (wake_read, wake_write):
        os.set_blocking(fd, False)
    signal.set_wakeup_fd(wake_write)
    signal.signal(signal.SIGCHLD, lambda signum, frame: None)
    children: set[int] = set()
    arm = die_with_parent()  # made here: it compares the child's parent with this process
    while True:
        ready: list[Any] = select.select([sock.fileno(), wake_read], [], [])[0]
        with contextlib.suppress(BlockingIOError):
            os.read(wake_read, 4096)
        while children:
            pid, status = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                break
            children.discard(pid)
            _tell(sock, {"exited": pid, "code": os.waitstatus_to_exitcode(status)})
        if sock.fileno() not in ready:
            continue
        data, fds, _, _ = socket.recv_fds(sock, _LIMIT, 2)
        if not data:  # the caller is gone: so are its ranks
            for pid in children:
                os.kill(pid, signal.SIGKILL)
            return None
        request = json.loads(data)
        if request["op"] == "signal":
            if request["pid"] in children:
                os.kill(request["pid"], request["sig"])
            continue
        if not loaded:
            _preload()
            loaded = True
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            default_signal_handlers()  # SIGCHLD's and the wake-up fd are the zygote's
            for fd in (wake_read, wake_write):
                os.close(fd)
            sock.close()
            signal.signal(signal.SIGINT, interrupt)
            arm()
            streams = iter(fds)
            for target, given in zip((1, 2), request["fds"], strict=True):
                if given:
                    fd = next(streams)
                    os.dup2(fd, target)
                    os.close(fd)
            return Job(request)
        children.add(pid)
        for fd in fds:
            os.close(fd)
        _tell(sock, {"started": request["id"], "pid": pid})


def _tell(sock: socket.socket, event: dict[str, int]) -> None:
    with contextlib.suppress(BrokenPipeError, ConnectionResetError):
        sock.send(json.dumps(event).encode())
