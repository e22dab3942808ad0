"""towers bench --quick: a smoke run of the whole suite; structure and sanity, no timings."""

from __future__ import annotations

import json

import pytest

from towers.tools.cli import main


@pytest.mark.timeout(120)
def test_quick_bench_writes_json_table_and_chart(tmp_path, capsys):
    assert main(["bench", "--quick", "--out", str(tmp_path)]) == 0
    results = json.loads((tmp_path / "bench.json").read_text())
    assert (tmp_path / "sweep.png").stat().st_size > 0
    table = (tmp_path / "bench.txt").read_text()
    assert "towers-shm" in table and "ddp" in table and table in capsys.readouterr().out

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
