"""towers bench --quick: a smoke run of the whole suite; structure and sanity, no timings."""

from __future__ import annotations

import json
import os
import time

import pytest

from towers.tools.cli import main
from towers.tools.load import busy
from towers.tools.startup import first_jobs, measure, table


@pytest.mark.timeout(120)
@pytest.mark.slow
def test_quick_bench_writes_json_table_and_chart(tmp_path, capsys):
    assert main(["bench", "--quick", "--out", str(tmp_path)]) == 0
    results = json.loads((tmp_path / "bench.json").read_text())
    assert (tmp_path / "sweep.png").stat().st_size > 0
    table = (tmp_path / "bench.txt").read_text()
    assert "towers-shm" in table and "ddp" in table and table in capsys.readouterr().out
    # every column and arm is explained in the table itself
    for term in ("x DDP:", "x 1 proc:", "scaling:", "floor:", "single-Nt:", "lent:"):
        assert term in table, term

    assert results["config"]["workers"] == 2
    assert set(results["models"]) == {"mlp", "cnn"}
    for model in results["models"].values():
        rows = {row["arm"]: row for row in model["arms"]}
        measured = ["single-1t", "single-Nt", "floor", "ddp", "towers-gloo", "towers-shm"]
        assert set(measured) <= set(rows)
        for arm in measured:
            row = rows[arm]
            assert row["ms_per_step"] > 0 and row["samples_per_s"] > 0, row
            assert row["scaling_efficiency"] > 0 and row["vs_ddp"] > 0, row
            assert row["vs_single_nt"] > 0, row
        # measured once this version has the asynchronous engine, reported as skipped before
        assert "ms_per_step" in rows["towers-async"] or "skipped" in rows["towers-async"]
        # the GPU arm runs where there is one GPU per worker, and says why not elsewhere
        assert "ms_per_step" in rows["towers-nccl"] or "CUDA" in rows["towers-nccl"]["skipped"]

    sizes = [row["bytes"] for row in results["sweep"]]
    assert sizes == sorted(sizes) and sizes[0] == 4096
    for row in results["sweep"]:
        for key in ("gloo_us", "shm_us", "shm_lent_us", "memcpy_gbps", "shm_busbw_gbps"):
            assert row[key] > 0, (key, row)


def test_bench_refuses_unknown_arms_and_bad_counts(capsys):
    assert main(["bench", "--arms", "ddp,horovod", "--no-sweep"]) == 2
    assert "horovod" in capsys.readouterr().err
    assert main(["bench", "--repeats", "0"]) == 2
    assert "--repeats must be >= 1" in capsys.readouterr().err
    assert main(["bench", "--load", "-1"]) == 2
    assert "--load must be >= 0" in capsys.readouterr().err


def _cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@pytest.mark.timeout(30)
def test_busy_processes_spin_while_the_block_runs_and_are_gone_after():
    with busy(2) as pids:
        assert len(set(pids)) == 2
        time.sleep(0.5)
        assert all(_cpu_seconds(pid) > 0.05 for pid in pids)
    for pid in pids:
        assert not os.path.exists(f"/proc/{pid}"), f"busy process {pid} outlived the block"
    with pytest.raises(ValueError, match="must be >= 0"), busy(-1):
        pass


@pytest.mark.timeout(120)
def test_startup_times_every_kind_of_start():
    # in this process (towers bench --startup runs it in a fresh interpreter, which costs
    # seconds of imports more here)
    startup = measure(workers=2, calls=1) | {"import_s": 1.0}
    assert set(startup["calls"]) == {"spawn", "train sync", "train async", "towers run"}
    for name, values in startup["calls"].items():
        assert len(values) == 1 and values[0] > 0, name
    text = "\n".join(table(startup))
    assert "call 1" in text and "towers run" in text


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_startup_times_a_first_job_beside_mp_spawn_and_ddp():
    first = first_jobs(workers=1, repeats=1)
    assert set(first["runs"]) == {"towers", "ddp"} and len(first["loads"]) == 1
    for arm, values in first["runs"].items():
        assert len(values) == 1 and values[0] > 0.5, arm  # a fresh interpreter that imports torch
    startup = {"workers": 2, "calls": {"spawn": [0.1]}, "import_s": 1.0, "first_job": first}
    text = "\n".join(table(startup))
    ratio = first["runs"]["towers"][0] / first["runs"]["ddp"][0]
    assert "mp.spawn + DDP" in text and f"towers / DDP: {ratio:.2f}" in text
    assert "load average as each repeat started" in text
