"""A rank forked by the zygote is the process ``python SCRIPT ARGS`` would be.

Each test runs the same script both ways, a fresh interpreter and a zygote's fork, and compares
what the script sees of itself (argv, path, ``__main__``, environment, threads, signals,
buffering) and how it ends (exit codes, tracebacks, threads and ``atexit`` at exit, signals).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from towers.processes.zygote import Zygote

ROOT = Path(__file__).resolve().parents[1]

PORTRAIT = textwrap.dedent(
    """
    import json, os, signal, sys
    import numpy as np
    import torch

    print(json.dumps({
        "argv": sys.argv,
        "path0": sys.path[0],
        "name": __name__,
        "file": __file__,
        "spec": repr(__spec__),
        "main": sys.modules["__main__"].__dict__ is globals(),
        "cwd": os.getcwd(),
        "mine": os.environ.get("TOWERS_TEST_MINE"),
        "rank": os.environ.get("RANK"),
        "threads": torch.get_num_threads(),
        "sigint": signal.getsignal(signal.SIGINT) is signal.default_int_handler,
        "sigterm": signal.getsignal(signal.SIGTERM) == signal.SIG_DFL,
        "sigchld": signal.getsignal(signal.SIGCHLD) == signal.SIG_DFL,
        "stdout_lines": sys.stdout.line_buffering,
        "stderr_lines": sys.stderr.line_buffering,
        "unbuffered": (sys.stdout.write_through, sys.stderr.write_through),
        "draw": float(np.random.random()),
    }))
    """
)

ENDINGS = textwrap.dedent(
    """
    import atexit, sys, threading, time

    atexit.register(lambda: print("atexit ran", flush=True))
    how = sys.argv[1]
    if how == "thread":  # the interpreter waits for a non-daemon thread
        threading.Thread(target=lambda: (time.sleep(0.3), print("thread done"))).start()
    elif how == "exit":
        sys.exit(3)
    elif how == "raise":
        def inner():
            raise ValueError("what the script raised")
        inner()
    elif how == "sleep":
        print("sleeping", flush=True)
        time.sleep(60)
    """
)


def _env(rank: int, cwd: Path) -> dict[str, str]:
    path = [str(ROOT / "src"), *filter(None, [os.environ.get("PYTHONPATH")])]
    return {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(path),
        "TOWERS_TEST_MINE": f"rank {rank} in {cwd.name}",
        "RANK": str(rank),
        "OMP_NUM_THREADS": "1",
    }


def _zygote(tmp_path: Path, fork: bool = False) -> Zygote:
    env = _env(0, tmp_path)
    env.pop("PYTHONUNBUFFERED", None)  # buffering is each rank's own
    return Zygote(env, fork=fork)


@pytest.fixture(params=[False, True], ids=["started", "forked"])
def zygote(tmp_path, request):
    """A zygote started as a new interpreter, or forked from this process (as ``towers run``
    forks its own), per test: no process outlives its test (conftest checks)."""
    zygote = _zygote(tmp_path, fork=request.param)
    yield zygote
    zygote.close()
    assert zygote.proc.returncode is not None


def _forked(zygote: Zygote, argv: list[str], env: dict[str, str]) -> tuple[int, str, str]:
    rank = zygote.start(argv, env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert rank.stdout is not None and rank.stderr is not None
    out, err = rank.stdout.read().decode(), rank.stderr.read().decode()
    rank.stdout.close()
    rank.stderr.close()
    return rank.wait(30), out, err


def _fresh(argv: list[str], env: dict[str, str]) -> tuple[int, str, str]:
    done = subprocess.run([sys.executable, *argv], env=env, capture_output=True, text=True)
    return done.returncode, done.stdout, done.stderr


@pytest.mark.timeout(120)
def test_a_forked_rank_sees_itself_as_python_script_would(zygote, tmp_path):
    (tmp_path / "sub").mkdir()
    script = tmp_path / "sub" / "portrait.py"
    script.write_text(PORTRAIT)
    argv = [str(script), "--lr", "0.1"]
    unbuffered = {"PYTHONUNBUFFERED": "1"}  # as towers run asks of a rank whose lines it prefixes
    fresh = _fresh(argv, {**_env(1, tmp_path), **unbuffered})
    ranks = [_forked(zygote, argv, {**_env(rank, tmp_path), **unbuffered}) for rank in (1, 2)]
    assert fresh[0] == 0, fresh[2]
    expected = json.loads(fresh[1])
    assert expected["path0"] == str(tmp_path / "sub") and expected["threads"] == 1
    assert expected["unbuffered"] == [True, True]
    seen = []
    for rank, (code, out, err) in zip((1, 2), ranks, strict=True):
        assert code == 0, err
        got = json.loads(out)
        seen.append(got.pop("draw"))
        want = {**expected, "mine": f"rank {rank} in {tmp_path.name}", "rank": str(rank)}
        want.pop("draw")
        assert got == want
    assert seen[0] != seen[1], "two ranks drew the same numbers from numpy's global generator"


ENDS = [  # how, exit code, standard output
    ("thread", 0, "thread done\natexit ran\n"),
    ("exit", 3, "atexit ran\n"),
    ("raise", 1, "atexit ran\n"),
]


@pytest.mark.timeout(120)
def test_a_forked_rank_ends_as_python_script_would(zygote, tmp_path):
    script = tmp_path / "endings.py"
    script.write_text(ENDINGS)
    for how, code, out in ENDS:
        fresh = _fresh([str(script), how], _env(0, tmp_path))
        forked = _forked(zygote, [str(script), how], _env(0, tmp_path))
        assert fresh[:2] == (code, out), fresh
        assert forked == fresh  # the traceback too: it starts in the script, not in the zygote
    assert forked[2].startswith(f'Traceback (most recent call last):\n  File "{script}"')
    assert forked[2].endswith("ValueError: what the script raised\n")


@pytest.mark.timeout(60)
def test_a_signal_reaches_only_a_running_rank_and_the_zygote_takes_its_ranks_along(tmp_path):
    zygote = _zygote(tmp_path)
    script = tmp_path / "endings.py"
    script.write_text(ENDINGS)
    env = _env(0, tmp_path)
    first = zygote.start([str(script), "sleep"], env, stdout=subprocess.PIPE)
    second = zygote.start([str(script), "sleep"], env, stdout=subprocess.PIPE)
    assert first.stdout is not None and second.stdout is not None
    assert first.stdout.readline() == second.stdout.readline() == b"sleeping\n"
    assert first.poll() is None
    with pytest.raises(subprocess.TimeoutExpired):
        first.wait(0.2)
    first.terminate()
    assert first.wait(10) == -signal.SIGTERM
    first.kill()  # a rank already reaped is not signalled again (its pid may be reused)
    zygote.close()  # the caller lets go: the zygote kills what still runs, and exits
    assert second.wait(10) == -signal.SIGKILL
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            os.kill(second.pid, 0)
        except ProcessLookupError:
            break
        time.sleep(0.05)
    else:
        pytest.fail(f"rank {second.pid} outlived its zygote")
    first.stdout.close()
    second.stdout.close()
