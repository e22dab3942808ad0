"""The examples run as users run them (a fresh interpreter, defaults) and pass their own checks.

Each example exits non-zero when its result is off, so these tests assert the exit code and the
line that reports the result. The package is found through PYTHONPATH, so the tests work in a
clean clone whether or not towers is installed.
"""

from __future__ import annotations

import importlib.util
import os
import signal
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import numpy as np
import pytest
import torch
from helpers import unused_port

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"


def run(args: list[str], cwd: Path, timeout: float) -> subprocess.CompletedProcess[str]:
    """Run ``args`` with this interpreter's torch and the repository's towers; reap everything.

    The example's own worker processes share its session, so a timeout kills them too.
    """
    path = [str(ROOT / "src"), *filter(None, [os.environ.get("PYTHONPATH")])]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(path)}
    proc = subprocess.Popen(
        args,
        cwd=cwd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail(f"{' '.join(args)} ran over {timeout} s; output:\n{out}")
    return subprocess.CompletedProcess(args, proc.returncode, out)


def run_example(name: str, *flags: str, cwd: Path, timeout: float = 90) -> str:
    result = run([sys.executable, str(EXAMPLES / name), *flags], cwd, timeout)
    assert result.returncode == 0, f"{name} exited {result.returncode}:\n{result.stdout}"
    return result.stdout


@pytest.mark.slow
@pytest.mark.timeout(100)
def test_parabola_four_towers_match_one(tmp_path: Path) -> None:
    out = run_example("parabola.py", "--steps", "400", cwd=tmp_path)  # the match, not the fit
    assert "OK: 4 workers match 1 worker" in out


@pytest.mark.slow
@pytest.mark.timeout(100)
def test_quadratic_finds_5x2_plus_3(tmp_path: Path) -> None:
    out = run_example("quadratic.py", cwd=tmp_path)
    assert "make_parallel, 2 towers: w = [5.000, " in out
    assert "towers.train, 2 workers: w = [5.000, " in out
    assert "OK:" in out


@pytest.mark.slow
@pytest.mark.timeout(100)
def test_digits_cnn_reaches_95_percent(tmp_path: Path) -> None:
    out = run_example("digits_cnn.py", "--workers", "2", cwd=tmp_path)  # as many as cores
    assert "OK: test accuracy" in out


@pytest.mark.slow
@pytest.mark.timeout(100)
def test_lightning_digits_balanced_on_two_processes_and_both_end_cleanly(tmp_path: Path) -> None:
    """Lightning starts the second process itself; neither may abort at its exit (it did, in 3
    of 4 runs, before towers let the transport's threads finish with Lightning's last metric
    sums: docs/testing.md)."""
    out = run_example("lightning_digits.py", "--balance", cwd=tmp_path)
    assert "towers on 2 processes: last epoch's training loss" in out
    assert "terminate called" not in out and "Fatal Python error" not in out, out


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_own_loop_under_towers_run(tmp_path: Path) -> None:
    args = ["-m", "towers", "run", str(EXAMPLES / "own_loop.py"), "-n", "2", "--"]
    result = run([sys.executable, *args, "--steps", "100"], tmp_path, timeout=50)
    assert result.returncode == 0, result.stdout
    assert "OK: 2 tower(s) match the plain loop" in result.stdout


# --- the CIFAR-10 binary reader ---------------------------------------------------------------


@pytest.fixture
def digits_cnn(monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    """``examples/digits_cnn.py`` (a script, not part of the package) imported as a module."""
    monkeypatch.syspath_prepend(str(ROOT / "src"))  # its `import towers`, installed or not
    spec = importlib.util.spec_from_file_location("digits_cnn", EXAMPLES / "digits_cnn.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    # Dataclasses look their module up in sys.modules while it executes.
    monkeypatch.setitem(sys.modules, "digits_cnn", module)
    spec.loader.exec_module(module)
    return module


def cifar_records(labels: list[int]) -> np.ndarray:
    """Records in CIFAR-10's layout: record i has red 10i+1, green 10i+2, blue 10i+3 everywhere,
    except red pixel (row 2, column 5) = 200 + i, to pin down the row-major order."""
    records = np.zeros((len(labels), 3073), dtype=np.uint8)
    for i, label in enumerate(labels):
        records[i, 0] = label
        for channel in range(3):
            records[i, 1 + channel * 1024 : 1 + (channel + 1) * 1024] = 10 * i + channel + 1
        records[i, 1 + 2 * 32 + 5] = 200 + i
    return records


def test_load_cifar10_bin_reads_labels_and_channel_major_pixels(
    digits_cnn: ModuleType, tmp_path: Path
) -> None:
    load = digits_cnn.load_cifar10_bin
    first, second = tmp_path / "data_batch_1.bin", tmp_path / "data_batch_2.bin"
    cifar_records([3, 0, 9]).tofile(first)
    cifar_records([7, 1]).tofile(second)

    images, labels = load([first, second])

    assert images.shape == (5, 3, 32, 32) and images.dtype == torch.float32
    assert labels.tolist() == [3, 0, 9, 7, 1] and labels.dtype == torch.int64
    assert images[1, :, 0, 0].tolist() == pytest.approx([11 / 255, 12 / 255, 13 / 255])
    assert images[0, 0, 2, 5].item() == pytest.approx(200 / 255)
    assert images[0, 0, 5, 2].item() == pytest.approx(1 / 255)  # not transposed
    assert images[4, 0, 2, 5].item() == pytest.approx(201 / 255)  # file 2's record 1
    assert images.min().item() >= 0.0 and images.max().item() <= 1.0


def test_load_cifar10_bin_refuses_a_truncated_file(digits_cnn: ModuleType, tmp_path: Path) -> None:
    load = digits_cnn.load_cifar10_bin
    path = tmp_path / "data_batch_1.bin"
    path.write_bytes(cifar_records([1, 2, 3]).tobytes()[:-100])
    with pytest.raises(ValueError, match=r"9119 bytes is not a whole number of CIFAR-10 records"):
        load([path])


@pytest.mark.timeout(60)
def test_digits_cnn_trains_on_cifar_batches(tmp_path: Path) -> None:
    """The --cifar-dir path end to end, on a few random records in the real file layout."""
    rng = np.random.default_rng(0)
    for name, n in [("data_batch_1.bin", 40), ("data_batch_2.bin", 24), ("test_batch.bin", 16)]:
        records = rng.integers(0, 256, size=(n, 3073), dtype=np.uint8)
        records[:, 0] = rng.integers(0, 10, size=n)
        records.tofile(tmp_path / name)
    flags = ["--cifar-dir", str(tmp_path), "--epochs", "1", "--batch-size", "32", "--workers", "2"]
    out = run_example("digits_cnn.py", *flags, "--min-accuracy", "0", cwd=tmp_path)
    assert "CIFAR-10: 64 training and 16 test images" in out
    assert "OK: test accuracy" in out


@pytest.mark.timeout(60)
@pytest.mark.slow
def test_ddp_tutorial_port_under_towers_run_equals_one_process(tmp_path: Path) -> None:
    args = ["-m", "towers", "run", str(EXAMPLES / "ddp_tutorial.py"), "-n", "2", "--"]
    result = run([sys.executable, *args, "--epochs", "2"], tmp_path, timeout=50)
    assert result.returncode == 0, result.stdout
    assert "OK: 2 rank(s) trained exactly as one process (clipped " in result.stdout
    assert "(clipped 0 steps)" not in result.stdout  # the clipping did bite


@pytest.mark.slow
@pytest.mark.timeout(100)
def test_mnist_style_port_and_the_plain_script_test_every_epoch(tmp_path: Path) -> None:
    flags = ("--epochs", "2", "--min-accuracy", "0.7")
    ported = run_example("mnist_style.py", "--workers", "2", *flags, cwd=tmp_path)
    plain = run_example("mnist_style.py", "--plain", *flags, cwd=tmp_path)
    for out in (ported, plain):
        epochs = [line for line in out.splitlines() if line.startswith("epoch ")]
        assert [line.split(":")[0] for line in epochs] == ["epoch 1", "epoch 2"]
        assert "of 360" in epochs[-1] and "ok: test accuracy" in out


@pytest.mark.slow
@pytest.mark.timeout(100)
def test_char_gpt_on_four_ranks_under_towers_run_equals_one_process(tmp_path: Path) -> None:
    args = ["-m", "towers", "run", str(EXAMPLES / "char_gpt.py"), "-n", "4", "--"]
    args += ["--max-iters", "16", "--eval-interval", "8", "--lr-decay-iters", "16"]
    result = run([sys.executable, *args], tmp_path, timeout=90)
    assert result.returncode == 0, result.stdout
    assert "[rank0]: OK: 17 steps on 4 ranks x 2 micro-steps equal one process" in result.stdout
    losses = [float(line.split("val loss ")[1]) for line in result.stdout.splitlines()
              if "step " in line and ": train loss" in line]  # fmt: skip
    assert len(losses) == 6 and losses[2] < losses[0]  # it learns; the check's run repeats them
    assert losses[:3] == losses[3:]


@pytest.mark.slow
@pytest.mark.timeout(100)
def test_char_gpt_under_torchrun_and_its_check_can_fail(tmp_path: Path) -> None:
    launcher = ["-m", "torch.distributed.run", "--nproc-per-node", "2"]
    launcher += ["--master-port", str(unused_port()), str(EXAMPLES / "char_gpt.py")]
    flags = ["--max-iters", "16", "--eval-interval", "8", "--lr-decay-iters", "16"]
    result = run([sys.executable, *launcher, *flags], tmp_path, timeout=90)
    assert result.returncode == 0, result.stdout
    assert "OK: 17 steps on 2 ranks x 2 micro-steps equal one process" in result.stdout
    # parameters agree to float tolerance, not bit for bit: a tolerance of 1e-12 must fail
    strict = ["-m", "towers", "run", str(EXAMPLES / "char_gpt.py"), "-n", "2", "--"]
    strict += ["--max-iters", "6", "--eval-interval", "3", "--rtol", "1e-12"]
    failed = run([sys.executable, *strict], tmp_path, timeout=90)
    assert failed.returncode == 1 and "FAIL: " in failed.stdout, failed.stdout


def char_gpt_with(tmp_path: Path, old: str, new: str) -> Path:
    """examples/char_gpt.py with one line of its port undone, as a DDP habit would leave it."""
    text = (EXAMPLES / "char_gpt.py").read_text()
    assert text.count(old) == 1
    script = tmp_path / "char_gpt_habit.py"
    script.write_text(text.replace(old, new))
    return script


@pytest.mark.timeout(100)
@pytest.mark.parametrize(
    ("old", "new", "cause"),
    [
        ("    @torch.random.fork_rng()", "", "an evaluation on rank 0 that draws from the global"),
        ("seed_offset = 0  #", "seed_offset = ddp_rank  #", "a seed that depends on the rank"),
    ],
    ids=["rank-0-evaluation", "seed-per-rank"],
)
@pytest.mark.slow
def test_char_gpt_with_a_ddp_habit_left_in_stops_naming_it(
    tmp_path: Path, old: str, new: str, cause: str
) -> None:
    script = char_gpt_with(tmp_path, old, new)
    args = [sys.executable, "-m", "towers", "run", str(script), "-n", "2", "--"]
    result = run([*args, "--max-iters", "4", "--eval-interval", "2"], tmp_path, timeout=90)
    assert result.returncode == 1, result.stdout
    assert "the ranks are not on the same global batch" in result.stdout
    assert cause in result.stdout
