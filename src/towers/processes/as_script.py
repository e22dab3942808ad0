"""A process forked from a zygote becomes ``python SCRIPT ARGS``, and ends as that would.

:func:`run` makes the fork look as a fresh interpreter running the script would (see
:mod:`towers.processes.zygote` for the list) and runs it; :func:`run_and_end` also ends as the
interpreter ends a script, for a fork whose caller's code must never run again (a zygote forked
from ``towers run``): exit status, traceback, non-daemon threads, ``atexit``, flushed output.
"""

from __future__ import annotations

import atexit
import builtins
import contextlib
import functools
import io
import os
import signal
import sys
import threading
import types
from typing import Any

__all__ = ["Job", "run", "run_and_end"]


class Job:
    """A request to become ``python SCRIPT ARGS``: its argv, environment and directory."""

    def __init__(self, request: dict[str, Any]):
        self.argv: list[str] = request["argv"]
        self.env: dict[str, str] = request["env"]
        self.cwd: str = request["cwd"]


def run_and_end(job: Job) -> int:
    """Run ``job`` in a rank of a forked zygote and end as the interpreter ends a script: its
    exit status, the traceback of what it raised, its non-daemon threads awaited, its
    ``atexit`` functions run, its output flushed. Returns the exit status (a ``KeyboardInterrupt``
    ends by ``SIGINT``, as it would)."""
    code, interrupted = 0, False
    try:
        run(job)
    except SystemExit as exc:
        code = _exit_status(exc.code)
    except BaseException as exc:
        sys.excepthook(type(exc), exc, exc.__traceback__)
        code, interrupted = 1, isinstance(exc, KeyboardInterrupt)
    threading._shutdown()  # type: ignore[attr-defined]  # the interpreter's own wait
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    if interrupted:
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
    return code


def _exit_status(code: object) -> int:
    """The status ``sys.exit(code)`` ends an interpreter with."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    print(code, file=sys.stderr)
    return 1


def run(job: Job) -> None:
    """Become ``python SCRIPT ARGS``: its environment, stdio, ``sys`` state and ``__main__``."""
    os.chdir(job.cwd)
    os.environ.clear()
    os.environ.update(job.env)
    _reopen_stdio(unbuffered=bool(job.env.get("PYTHONUNBUFFERED")))
    threads = job.env.get("OMP_NUM_THREADS", "")
    if threads.isdigit() and int(threads) > 0:
        import torch

        torch.set_num_threads(int(threads))
    if "numpy.random" in sys.modules:
        sys.modules["numpy.random"].seed()  # from fresh entropy, as a new interpreter's
    _keep_destroyed_groups()
    script = job.argv[0]
    sys.argv = list(job.argv)
    sys.path[0] = os.path.dirname(os.path.realpath(script))
    module = types.ModuleType("__main__")
    module.__file__ = script
    module.__dict__["__builtins__"] = builtins
    sys.modules["__main__"] = module
    with io.open_code(script) as f:
        code = compile(f.read(), script, "exec", dont_inherit=True)
    sys.excepthook = _from_script(script)
    exec(code, module.__dict__)


def _keep_destroyed_groups() -> None:
    """Keep every process group the script destroys referenced until the rank ends.

    A script that calls ``destroy_process_group()`` while its DDP model still holds the group
    frees the group when the model goes, often on returning from ``main()``. The destructor
    joins Gloo's worker thread while holding the GIL, and that thread may be waiting for the GIL
    to release the last collective's tensor (pytorch#56297): the rank hangs at its very end. In
    forked ranks this hung 2-3 runs in 12 of a plain DDP script; fresh interpreters hit it less
    often. Kept, the group is released when the forked rank leaves with ``os._exit``, without
    its destructor; ``shutdown()`` has run by then. (A script that builds and destroys groups
    many times keeps each one's memory and sockets until it ends.)
    """
    c10d: Any = sys.modules.get("torch.distributed.distributed_c10d")
    if c10d is None:
        return
    destroy = c10d.destroy_process_group
    kept: list[Any] = []

    @functools.wraps(destroy)
    def destroy_process_group(group: Any = None) -> None:
        kept.extend(c10d._world.pg_map if group is None else [group])
        destroy(group)

    c10d.destroy_process_group = destroy_process_group
    dist: Any = sys.modules["torch.distributed"]
    dist.destroy_process_group = destroy_process_group


def _reopen_stdio(unbuffered: bool) -> None:
    """Standard output and error on their new descriptors, buffered as a new interpreter's."""
    for fd, name in ((1, "stdout"), (2, "stderr")):
        old = getattr(sys, name)
        raw = io.FileIO(fd, "wb", closefd=False)
        buffer: Any = raw if unbuffered else io.BufferedWriter(raw)
        stream = io.TextIOWrapper(
            buffer,
            encoding=old.encoding,
            errors=old.errors,
            line_buffering=not unbuffered and (name == "stderr" or os.isatty(fd)),
            write_through=unbuffered,
        )
        setattr(sys, name, stream)
        setattr(sys, f"__{name}__", stream)


def _from_script(script: str) -> Any:
    """An excepthook whose tracebacks start at the script, as ``python SCRIPT``'s do."""

    def hook(kind: type[BaseException], exc: BaseException, tb: types.TracebackType | None) -> None:
        start = tb
        while start is not None and start.tb_frame.f_code.co_filename != script:
            start = start.tb_next
        if start is not None:
            exc.__traceback__ = start  # the default hook prints the exception's own
        sys.__excepthook__(kind, exc, start or tb)

    return hook
