"""benchmarks/two_hosts.py without hosts: its report's columns, and the GPT problem it trains."""

from __future__ import annotations

import argparse
import importlib.util
import math
import sys
from pathlib import Path
from types import ModuleType

import torch

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def _load(name: str) -> ModuleType:
    """A benchmark module under a name of its own: tests/scripts has a two_hosts.py too."""
    spec = importlib.util.spec_from_file_location(f"bench_{name}", BENCHMARKS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


sys.path.append(str(BENCHMARKS))  # for the benchmarks' own imports (namespaces, gpu_check)


two_hosts = _load("two_hosts")
two_hosts_worker = _load("two_hosts_worker")


def record(ms: float, mb: float, final: float, steps: int = 20) -> dict:
    """A run of ``steps`` global batches of ``ms`` each, ``mb`` over the link each."""
    times = [k * ms / 1e3 for k in range(1, steps + 1)]
    counts = [int(k * mb * 1e6) for k in range(1, steps + 1)]
    evals = [(k, final + (steps - k) / steps) for k in range(5, steps + 1, 5)]
    return {"times": times, "bytes": counts, "evals": evals, "sent": counts[-1]}


def test_the_report_gives_bytes_saved_and_utilisation_paired_per_repeat() -> None:
    args = argparse.Namespace(steps=20, warmup=5)
    raw = {"ddp": [record(400, 6.0, 2.0), record(500, 6.0, 2.0)],
           "towers x": [record(100, 0.01, 2.0), record(100, 0.01, 2.0)]}  # fmt: skip
    fast = {"ddp": [record(100, 6.0, 2.0), record(250, 6.0, 2.0)],
            "towers x": [record(100, 0.01, 2.0), {"error": "RuntimeError: gone"}]}  # fmt: skip
    result = two_hosts.report(raw, args, [1.0], fast)
    ddp, x = result["rows"]["ddp"], result["rows"]["towers x"]
    assert math.isclose(ddp["utilisation"], (0.25 + 0.5) / 2)  # the median of the two repeats
    assert math.isclose(x["utilisation"], 1.0)  # the failed repeat left out
    assert math.isclose(x["fewer_bytes"], 600, rel_tol=1e-3)
    assert math.isclose(x["vs_best_ddp"], 0.25 * 400 / 450)  # DDP's median time to its loss
    text = two_hosts.table(result)
    assert "x fewer" in text and "util" in text and " 38%" in text and "100%" in text
    assert "util" not in two_hosts.table(two_hosts.report(raw, args, [1.0]))


def test_lightning_arms_are_held_to_lightning_s_ddp() -> None:
    """Lightning's arms train on its sampler's order, so they race Lightning's ddp arm: its
    final loss is their target and its time their unit; the others race plain DDP."""
    args = argparse.Namespace(steps=20, warmup=5)
    raw = {"ddp": [record(400, 6.0, 2.0)], "lightning ddp": [record(300, 6.0, 2.5)],
           "lightning towers y": [record(100, 0.1, 2.4)],
           "towers y": [record(100, 0.1, 2.0)]}  # fmt: skip
    result = two_hosts.report(raw, args, [1.0])
    rows = result["rows"]
    assert result["target"] == 2.0 and result["lightning_target"] == 2.5
    assert rows["lightning ddp"]["vs_best_ddp"] == 1.0
    # below 2.5 first at its last evaluation (20 steps of 0.1 s); Lightning's ddp: 20 of 0.3 s
    assert math.isclose(rows["lightning towers y"]["to_target"], 2.0)
    assert math.isclose(rows["lightning towers y"]["vs_best_ddp"], 2.0 / 6.0)
    assert math.isclose(rows["towers y"]["vs_best_ddp"], 0.25)
    assert "lightning ddp's final 2.500" in two_hosts.table(result)


def test_the_gpt_problem_is_the_same_in_every_arm_and_starts_near_chance() -> None:
    p = two_hosts_worker.text()
    (rows,), (held,) = p.data, p.held
    assert rows.shape[1] == held.shape[1] == 65 and len(held) == 64 and p.batch == 32
    assert torch.equal(rows[:-1, -1], rows[1:, 0])  # every character is predicted once
    a, b = p.model(), p.model()
    assert all(torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters(), strict=True))
    vocab = a.tok.weight.shape[0]
    with torch.no_grad():
        assert abs(float(p.loss(a, (held,))) - math.log(vocab)) < 0.1
