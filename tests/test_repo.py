"""The repository keeps its promises: lint- and type-clean, CI runs the README's test command."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_ci_runs_the_readme_test_command():
    """.ci/run runs the README's test command's steps, in order, each on a line of its own
    (so that it can time them)."""
    readme = (ROOT / "README.md").read_text()
    commands = re.findall(r"```bash\n(.+?)\n```", readme)
    assert "towers demo" in commands[0] and "pytest" in commands[1]
    lines = (ROOT / ".ci" / "run").read_text().splitlines()
    steps = commands[1].split(" && ")
    found = [next(i for i, line in enumerate(lines) if step in line) for step in steps]
    assert found == sorted(found), (steps, lines)


@pytest.mark.skipif(
    shutil.which("ruff") is None and not (ROOT / ".venv/bin/ruff").exists(),
    reason="ruff is not installed",
)
def test_ruff_check_and_format():
    ruff = shutil.which("ruff") or str(ROOT / ".venv/bin/ruff")
    for args in (["check", "."], ["format", "--check", "."]):
        out = subprocess.run([ruff, *args], cwd=ROOT, capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stdout + out.stderr


@pytest.mark.timeout(300)
@pytest.mark.skipif(
    shutil.which("mypy") is None and not (ROOT / ".venv/bin/mypy").exists(),
    reason="mypy is not installed",
)
def test_mypy():
    mypy = shutil.which("mypy") or str(ROOT / ".venv/bin/mypy")
    out = subprocess.run(
        [mypy, "src/towers"], cwd=ROOT, capture_output=True, text=True, timeout=280
    )
    assert out.returncode == 0, out.stdout + out.stderr


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_readme_train_example_runs(tmp_path):
    import os
    import sys

    readme = (ROOT / "README.md").read_text()
    example = tmp_path / "example.py"
    code = re.findall(r"```python\n(.*?)```", readme, re.S)[0]
    # as many workers as a 2-core machine has: a synchronous step is exact for any number, so
    # the fit is the same, for half the processes
    assert "workers=4," in code
    example.write_text(code.replace("workers=4,", "workers=2,"))
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    out = subprocess.run(
        [sys.executable, str(example)], cwd=tmp_path, env=env, capture_output=True, text=True,
        timeout=110,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    final_loss, *_ = out.stdout.split()
    assert float(final_loss) < 0.1  # the parabola is fit
