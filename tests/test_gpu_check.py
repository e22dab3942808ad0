"""benchmarks/gpu_check.py's CPU smoke run writes its report, with every arm and the verdicts."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_gpu_check_cpu_smoke_run_writes_its_report(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    cmd = [sys.executable, str(ROOT / "benchmarks" / "gpu_check.py"), "--device", "cpu"]
    cmd += ["--quick", "--skip-tests", "--out", str(tmp_path)]
    out = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=110)
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-4000:]
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    assert {"environment", "plan", "arms", "agreement", "tokens_per_s", "loadavg"} <= set(report)
    assert report["tests"] is None and report["errors"] == {} and report["exit_code"] == 0
    options = ["train int8", "train diloco:16", "plain fp16", "loop fp16"]
    options += ["train sharded", "train diloco:16 sharded"]  # one tower: the path, not the cut
    options += ["train 2 even", "train 2 balanced"]  # two CPU towers, the cores shared
    assert list(report["arms"]) == ["plain", "train", "loop", *options]
    for arm in report["arms"].values():
        assert arm["ms_per_step"] > 0 and len(arm["losses"]) == report["plan"]["steps"]
    assert report["agreement"]["ok"]
    assert set(report["agreement"]["max_rel_diff"]) == {"train", "loop", *options}
    # judged: the exact arms only (int8 and DiLoCo change the arithmetic)
    judged = {a for a, v in report["arms"].items() if v["meets_target"] is not None}
    assert judged == {"train", "loop", "loop fp16"}
    text = (tmp_path / "gpu_check.md").read_text()
    rows = ("| plain |", "| train |", "| loop |", "| train int8 |", "| loop fp16 |")
    rows += ("| train 2 balanced |", "the cores shared with a busy process: balanced")
    for row in (*rows, "losses agree", "target <= 3% overhead"):
        assert row in text
    assert text in out.stdout  # the report is printed too
