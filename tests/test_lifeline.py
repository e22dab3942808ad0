"""Nothing towers starts outlives its caller, however the caller dies; a stop is one line."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import descendants

SCRIPT = Path(__file__).parent / "scripts" / "endless.py"
SRC = str(Path(__file__).parents[1] / "src")


def start(args: list[str], ready: Path) -> tuple[subprocess.Popen[str], set[int]]:
    """Start ``args``, wait until ``ready`` exists, return the process and its descendants."""
    env = {**os.environ, "PYTHONPATH": SRC}
    proc = subprocess.Popen(
        args,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    deadline = time.monotonic() + 40
    while not any(ready.parent.glob(ready.name)):
        if proc.poll() is not None or time.monotonic() > deadline:
            for pid in descendants(proc.pid) | {proc.pid}:
                os.kill(pid, signal.SIGKILL)
            raise AssertionError(f"the job never got going: {proc.communicate()}")
        time.sleep(0.1)
    return proc, descendants(proc.pid)


def assert_all_gone(pids: set[int], within: float = 10.0) -> None:
    deadline = time.monotonic() + within
    alive = pids
    while time.monotonic() < deadline:
        alive = {p for p in pids if _alive(p)}
        if not alive:
            return
        time.sleep(0.1)
    for pid in alive:  # do not leave them to the next test
        os.kill(pid, signal.SIGKILL)
    raise AssertionError(f"processes outlived their caller by {within:g} s: {sorted(alive)}")


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.parametrize("method", ["auto", "forkserver"])
def test_workers_server_and_forkserver_die_with_a_killed_caller(tmp_path, monkeypatch, method):
    # auto: workers forked from the caller; forkserver: as where the caller has used CUDA
    monkeypatch.setenv("TOWERS_START_METHOD", method)
    # with a forkserver, the SIGKILL (no chance to clean up) is the case it adds
    jobs = [("sync", signal.SIGKILL), ("async", signal.SIGTERM)]
    jobs = jobs[:1] if method == "forkserver" else jobs
    for mode, sig in jobs:
        directory = tmp_path / f"{mode}-{sig.name}"
        args = [sys.executable, str(SCRIPT), "train", mode, str(directory)]
        proc, children = start(args, directory / "step-*.pt")
        if method == "forkserver":
            assert len(children) >= 3, children  # the workers (and server), forkserver, tracker
        else:
            assert len(children) >= (2 if mode == "sync" else 3), children  # forked workers
        os.kill(proc.pid, sig)
        _, err = proc.communicate(timeout=30)
        assert_all_gone(children)
        if sig == signal.SIGTERM:
            assert proc.returncode == 143, err
            assert "Traceback" not in err, err
            last = err.strip().splitlines()[-1]
            assert last.startswith(
                "towers: training stopped by SIGTERM; workers stopped; the "
                f"last checkpoint is {directory}/step-"
            ), last
            assert len(err.strip().splitlines()) == 1, err


@pytest.mark.timeout(60)
def test_towers_run_ranks_die_with_it(tmp_path):
    args = [
        sys.executable,
        "-m",
        "towers",
        "run",
        str(SCRIPT),
        "-n",
        "2",
        "--",
        "loop",
        str(tmp_path),
    ]
    proc, ranks = start(args, tmp_path / "ready")
    os.kill(proc.pid, signal.SIGKILL)
    proc.communicate(timeout=30)
    assert_all_gone(ranks)
