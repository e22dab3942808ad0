"""What towers shows a person: progress bar, TensorBoard scalars, the demo."""

from __future__ import annotations

import fcntl
import math
import os
import pty
import struct
import subprocess
import sys
import termios
from pathlib import Path

import pytest
from helpers import make_net, mse, regression_data

import towers

SRC = str(Path(__file__).resolve().parents[1] / "src")

PROGRESS = """
import sys
sys.path.insert(0, {tests!r})
import towers
from helpers import make_net, mse, regression_data
if __name__ == "__main__":
    for progress in (True, False):  # the bar, then the same training without it
        print(f"progress={{progress}}:", file=sys.stderr, flush=True)
        towers.train(make_net(), mse, regression_data(20), batch_size=5, steps=6, workers=2,
                     progress=progress, mode={mode!r}, eval_data=regression_data(7), eval_every=3)
"""


def run_on_terminal(code: str, cwd: Path) -> str:
    """Run python code with stderr on a pseudo-terminal; return what it wrote there."""
    leader, follower = pty.openpty()
    # a terminal 120 columns wide (a fresh pty has 0, where progress bars draw nothing)
    fcntl.ioctl(follower, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 120, 0, 0))
    env = {**os.environ, "PYTHONPATH": SRC}
    proc = subprocess.Popen([sys.executable, "-c", code], stderr=follower, cwd=cwd, env=env)
    os.close(follower)
    chunks = []
    while True:
        try:
            chunk = os.read(leader, 4096)
        except OSError:  # the terminal closed: every writer exited
            break
        if not chunk:
            break
        chunks.append(chunk)
    os.close(leader)
    assert proc.wait(timeout=60) == 0
    return b"".join(chunks).decode(errors="replace")


@pytest.mark.slow
@pytest.mark.timeout(90)
@pytest.mark.parametrize("mode", ["sync", "async"])  # async: the server (rank 0) shows it
def test_progress_bar_on_a_terminal_only(tmp_path, mode):
    tests = str(Path(__file__).parent)
    shown, hidden = run_on_terminal(PROGRESS.format(tests=tests, mode=mode), tmp_path).split(
        "progress=False:"
    )
    assert "progress=True:" in shown
    assert f"towers {mode}" in shown and "6/6" in shown
    assert "loss=" in shown and "samples_s=" in shown and "eval_loss=" in shown
    assert "loss=" not in hidden and f"towers {mode}" not in hidden


@pytest.mark.timeout(60)
def test_tensorboard_scalars_match_the_result(tmp_path):
    event_accumulator = pytest.importorskip(
        "tensorboard.backend.event_processing.event_accumulator"
    )
    result = towers.train(
        make_net(),
        mse,
        regression_data(20),
        batch_size=5,
        steps=4,
        workers=2,
        log_dir=tmp_path,
        progress=False,
        eval_data=regression_data(7, seed=3),
        eval_every=2,
    )
    events = event_accumulator.EventAccumulator(str(tmp_path))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    assert {"loss/mean", "loss/tower_0", "loss/tower_1", "samples_per_second"} <= tags
    evaluated = [(e.step, e.value) for e in events.Scalars("eval/loss")]
    assert evaluated == [(d, pytest.approx(m["loss"], rel=1e-6)) for d, m in result.evals]
    assert [d for d, _ in result.evals] == [2, 4]
    logged = [e.value for e in events.Scalars("loss/mean")]
    assert logged == pytest.approx(result.losses, rel=1e-6)
    per_tower = [e.value for e in events.Scalars("loss/tower_1")]
    assert per_tower == pytest.approx([t[1] for t in result.tower_losses], rel=1e-6)
    split = [e.value for e in events.Scalars("shard/tower_0")]
    assert split == [s[0] for s in result.shards] and len(split) == 4


def scalars(events, tag: str) -> list[float]:
    """A tag's values in step order (the server completes global batches out of order)."""
    return [e.value for e in sorted(events.Scalars(tag), key=lambda e: e.step)]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("mode", ["async", "backup:1"])
def test_tensorboard_scalars_of_the_asynchronous_modes(tmp_path, mode):
    event_accumulator = pytest.importorskip(
        "tensorboard.backend.event_processing.event_accumulator"
    )
    result = towers.train(
        make_net(),
        mse,
        regression_data(40),
        batch_size=8,
        steps=12,
        workers=3,
        mode=mode,
        log_dir=tmp_path,
        progress=False,
    )
    events = event_accumulator.EventAccumulator(str(tmp_path))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    assert {"loss/mean", "samples_per_second", "staleness"} <= tags
    assert scalars(events, "loss/mean") == pytest.approx(result.losses, rel=1e-6)
    for t in range(3):  # logged where the tower computed samples of the batch
        tag = f"loss/tower_{t}"
        logged = {e.step: e.value for e in events.Scalars(tag)} if tag in tags else {}
        expected = {k: v[t] for k, v in enumerate(result.tower_losses) if not math.isnan(v[t])}
        assert logged == pytest.approx(expected, rel=1e-6)
    assert scalars(events, "staleness") == result.staleness
    assert len(events.Scalars("samples_per_second")) == 12


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_demo_prints_a_table_explains_it_and_writes_the_plot(tmp_path):
    png = tmp_path / "curves.png"
    cmd = [sys.executable, "-m", "towers", "demo", "--steps", "120", "--async-steps", "40"]
    cmd += ["--speed-steps", "1", "--out", str(png)]
    env = {**os.environ, "PYTHONPATH": SRC}
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=110, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    rows = [line.split() for line in out.stdout.splitlines() if line.startswith("sync ")]
    assert [r[1] for r in rows] == ["1", "4"]
    assert all(r[3] == "120" for r in rows)
    assert abs(float(rows[0][2]) - float(rows[1][2])) <= 1e-5 * float(rows[0][2])
    assert "The parabola is tiny" in out.stdout  # why its towers are slower than one process
    speed = [line for line in out.stdout.splitlines() if line.startswith(("1 process", "towers,"))]
    assert speed[0].startswith("1 process, 1 thread")
    assert len(speed) == 3 and speed[2].split()[2] == "workers"
    assert "Here towers is " in out.stdout or "Here towers was not faster" in out.stdout
    assert f"loss curves: {png}" in out.stdout
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # the columns, the rows and the shorter asynchronous runs are explained
    header = next(line for line in out.stdout.splitlines() if line.startswith("mode"))
    assert header.count("max") == header.count("stale max") == 1  # no bare "max" column
    for column in ("final loss", "steps", "updates", "seconds", "stale avg", "sync, same step"):
        assert column in header and f"\n  {column}" in out.stdout, column
    for row in ("sync", "async", "ssp:2", "local:4", "backup:1", "diloco:4"):
        assert f"\n  {row} " in out.stdout, row  # each row's meaning
    assert "The sync rows train 120 steps (--steps), the others 40 (--async-steps)" in out.stdout
    assert "ran 40 steps, sync 120; after 40 steps sync was at" in " ".join(out.stdout.split())
