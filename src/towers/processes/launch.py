"""``towers run SCRIPT -n N -- ARGS``: start N copies of a script the way torchrun does."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Collection, Sequence
from typing import Any

from ..comm.net import DEFAULT_ADDR, free_port
from ..core.secret import new_secret
from .env import describe_exit, thread_share, worker_env
from .lifeline import Terminated
from .output import RankOutput
from .zygote import Rank, start_script, zygote_for

__all__ = ["restarting", "run_script"]


def _terminated(signum: int, frame: object) -> None:
    raise Terminated()


def run_script(
    script: str,
    workers: int,
    args: Sequence[str] = (),
    *,
    addr: str = DEFAULT_ADDR,
    port: int | None = None,
    failure_grace: float = 5.0,
    secret: str | None = None,
    show_ranks: Collection[int] | None = None,
    max_restarts: int = 0,
) -> int:
    """Run ``python SCRIPT ARGS`` as ``workers`` ranks; return 0, or the first failure's code.

    The ranks are forked from one interpreter that has imported torch once for them all
    (:mod:`towers.processes.zygote`; ``TOWERS_START_METHOD=spawn`` starts fresh ones instead).

    When one rank fails the others get ``failure_grace`` seconds, then are terminated; with
    ``max_restarts`` the whole job then starts again, up to that many times, as torchrun's
    ``--max-restarts`` does: every rank anew (on a fresh port unless ``port`` is given), with
    ``TORCHELASTIC_RESTART_COUNT`` set to the attempt, so that the script resumes from its own
    checkpoint. Ranks die with ``towers run`` however it dies (``PR_SET_PDEATHSIG``); on Ctrl-C
    or ``SIGTERM`` it stops them and says so in one line, and restarts nothing. The ranks get
    the job's ``secret`` (a fresh one by default) in their environment. The output of the ranks
    in ``show_ranks`` (default: all) is shown, each line prefixed with its rank when more than
    one is shown (:mod:`towers.processes.output`).
    """
    if not os.path.isfile(script):
        raise FileNotFoundError(f"no such script: {script}")
    secret = new_secret() if secret is None else secret
    zygote = zygote_for(workers)
    previous = signal.signal(signal.SIGTERM, _terminated)
    try:
        attempt = 0
        while True:
            where = free_port(addr) if port is None else port
            code = _attempt(
                zygote, script, workers, args, addr, where, failure_grace, secret, show_ranks,
                attempt,
            )  # fmt: skip
            if code == 0 or attempt == max_restarts:
                return code
            attempt += 1
            print(
                f"towers run: restarting all {workers} ranks (restart {attempt} of "
                f"{max_restarts}, TORCHELASTIC_RESTART_COUNT={attempt}); the script "
                "resumes from its own checkpoint",
                file=sys.stderr,
            )
    except KeyboardInterrupt as exc:
        what = "SIGTERM" if isinstance(exc, Terminated) else "Ctrl-C"
        print(f"towers run: stopped by {what}; stopping every rank", file=sys.stderr)
        return 143 if what == "SIGTERM" else 130
    finally:
        if zygote is not None:
            zygote.close()
        signal.signal(signal.SIGTERM, previous)


def restarting(
    script: str,
    workers: int,
    args: Sequence[str],
    max_restarts: int,
    addr: str,
    port: int | None,
    secret: str | None,
) -> int:
    """A script on ``towers.ddp`` under ``towers run --elastic`` (its ranks exited with
    :data:`~towers.core.launch.RESTARTS_INSTEAD`): :func:`run_script` with ``max_restarts``."""
    print(
        f"towers run: {script} runs on towers.ddp, whose steps cannot be redone without a lost "
        f"worker: when a worker fails, every rank starts again (up to {max_restarts} times, "
        "--max-restarts) and the script resumes from its own checkpoint, as under torchrun",
        file=sys.stderr,
    )
    return run_script(
        script, workers, args, addr=addr, port=port, secret=secret, max_restarts=max_restarts
    )


def _attempt(
    zygote: Any,
    script: str,
    workers: int,
    args: Sequence[str],
    addr: str,
    port: int,
    failure_grace: float,
    secret: str,
    show_ranks: Collection[int] | None,
    restart: int,
) -> int:
    """One start of every rank (see :func:`run_script`): 0, or the first failure's code."""
    threads = str(thread_share(workers))
    procs: list[Rank | subprocess.Popen[bytes]] = []
    output = RankOutput(workers, show_ranks)

    def stop() -> None:
        for p in procs:
            if p.poll() is None:
                p.terminate()
        deadline = time.monotonic() + 3
        for p in procs:
            try:
                p.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()

    try:
        for rank in range(workers):
            env = {
                **os.environ,
                **output.env(rank),
                **worker_env(rank, workers, addr, port, secret=secret, restart_count=restart),
            }
            env.setdefault("OMP_NUM_THREADS", threads)
            procs.append(start_script(zygote, [script, *args], env, **output.streams(rank)))
            output.attach(rank, procs[-1])
        failed_at = None
        code = 0
        while True:
            codes = [p.poll() for p in procs]
            for rank, rc in enumerate(codes):
                if rc not in (None, 0) and failed_at is None:
                    print(
                        f"towers run: rank {rank} failed with {describe_exit(rc)}",
                        *(f"[rank{rank}]: {line}" for line in output.tail(rank)),
                        sep="\n",
                        file=sys.stderr,
                    )
                    failed_at, code = time.monotonic(), (rc if rc > 0 else 128 - rc)
            if all(rc is not None for rc in codes):
                return code
            if failed_at is not None and time.monotonic() - failed_at > failure_grace:
                return code
            time.sleep(0.05)
    finally:
        stop()
        output.close()
