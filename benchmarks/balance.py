"""Balanced splits against the even split and async, with a really slow tower, side by side.

Two cases, each run in rotation ``--repeats`` times with the load average printed:

- ``cgroup``: an MLP (256-768-768-10, global batch 512) on two workers, one of them moved into
  a cpu cgroup capped at ``--share`` of a core (root; cgroup v1's cpu controller): sync with
  the even split, sync balanced, async with the same slow tower; beside them one process with
  the whole batch on one full core. Each arm's seconds per global batch, and how far each sync
  run's parameters are from a float64 loop next to a float32 single process's distance.
- ``straggle``: four workers on the machine's cores, one of them ``--factor`` times slower
  (``straggle=``): the balanced step against the ideal ``B / sum(speeds)``, each tower's speed
  measured in the same run (its samples over its compute seconds, last half of the run).

Ends with the split of the balanced cgroup run, step by step, as a small text chart.

Run it from the repository root (as root, for the cgroup)::

    python benchmarks/balance.py --repeats 3
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import itertools
import os
import secrets
import statistics
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

import towers

CPU = Path("/sys/fs/cgroup/cpu")


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(256, 768), nn.ReLU(), nn.Linear(768, 768), nn.ReLU(), nn.Linear(768, 10)
    )


def data(n: int = 512 * 40) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(n, 256, generator=g)
    return x, (x[:, :10] * 3).softmax(1).argmax(1)


def xent(model: nn.Module, shard: Any, cgroup: str | None = None) -> torch.Tensor:
    """Cross entropy; rank ``1`` (tower 0 in async, whose rank 0 is the server: rank 1 is its
    first tower too) moves itself into ``cgroup`` at its first shard."""
    if cgroup and os.environ.get("RANK") == "1" and not getattr(xent, "joined", False):
        Path(cgroup, "cgroup.procs").write_text(str(os.getpid()))
        xent.joined = True  # type: ignore[attr-defined]
    x, y = shard
    return nn.functional.cross_entropy(model(x), y)


@contextlib.contextmanager
def capped(share: float) -> Iterator[str]:
    path = CPU / f"towers-bench-{secrets.token_hex(3)}"
    path.mkdir()
    try:
        (path / "cpu.cfs_period_us").write_text("10000")
        (path / "cpu.cfs_quota_us").write_text(str(round(share * 10000)))
        yield str(path)
    finally:
        for _ in range(100):
            with contextlib.suppress(OSError):
                path.rmdir()
                break
            time.sleep(0.1)


def per_batch(result: Any) -> float:
    """Median seconds between consecutive global batches, the first quarter left out."""
    times = result.times
    gaps = [b - a for a, b in itertools.pairwise(times)][len(times) // 4 :]
    return statistics.median(gaps) if gaps else result.seconds / result.steps


def one_process(steps: int) -> float:
    torch.set_num_threads(1)
    model, (x, y) = mlp(), data()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    gaps = []
    for k in range(steps):
        began = time.perf_counter()
        opt.zero_grad()
        xent(model, (x[k * 512 : (k + 1) * 512], y[k * 512 : (k + 1) * 512])).backward()
        opt.step()
        gaps.append(time.perf_counter() - began)
    return statistics.median(gaps[steps // 4 :])


def distance(model: nn.Module, steps: int) -> tuple[float, float]:
    """``model``'s distance from a float64 loop, and a float32 single process's."""
    runs = {}
    for dtype in (torch.float32, torch.float64):
        m, (x, y) = mlp().to(dtype), data()
        opt = torch.optim.SGD(m.parameters(), lr=0.05)
        for k in range(steps):
            opt.zero_grad()
            xent(m, (x[k * 512 : (k + 1) * 512].to(dtype), y[k * 512 : (k + 1) * 512])).backward()
            opt.step()
        runs[dtype] = torch.cat([p.detach().double().reshape(-1) for p in m.parameters()])
    exact = runs[torch.float64]
    got = torch.cat([p.detach().double().reshape(-1) for p in model.parameters()])
    return float((got - exact).norm() / exact.norm()), float(
        (runs[torch.float32] - exact).norm() / exact.norm()
    )


def cgroup_case(share: float, steps: int) -> dict[str, Any]:
    train = functools.partial(
        towers.train, mlp(), batch_size=512, steps=steps, workers=2, progress=False,
        optimizer=functools.partial(torch.optim.SGD, lr=0.05), shuffle=False, data=data(),
    )  # fmt: skip
    out: dict[str, Any] = {"load": os.getloadavg()[0]}
    with capped(share) as cg:
        loss = functools.partial(xent, cgroup=cg)
        even = train(loss_fn=loss, balance=False)
        balanced = train(loss_fn=loss, balance=True)
        asynchronous = train(loss_fn=loss, mode="async")
    out["one process"] = one_process(steps)
    for name, r in (("even", even), ("balanced", balanced), ("async", asynchronous)):
        out[name] = per_batch(r) if name != "async" else r.seconds / r.steps
    out["distance"] = {
        n: distance(r.model, steps) for n, r in (("even", even), ("balanced", balanced))
    }
    out["split"] = [s[0] for s in balanced.shards]
    return out


def straggle_case(factor: float, steps: int) -> dict[str, Any]:
    train = functools.partial(
        towers.train, mlp(), xent, data(), batch_size=512, steps=steps, workers=4,
        progress=False, optimizer=functools.partial(torch.optim.SGD, lr=0.05), shuffle=False,
        straggle={3: factor},
    )  # fmt: skip
    even = train(balance=False)
    r = train(balance=True)
    half = len(r.shards) // 2
    speeds = [
        sum(s[i] for s in r.shards[half:]) / sum(t[i] for t in r.shard_seconds[half:])
        for i in range(4)
    ]
    ideal = 512 / sum(speeds)
    return {"load": os.getloadavg()[0], "balanced": per_batch(r), "ideal": ideal,
            "even": per_batch(even), "split": r.shards[-1]}  # fmt: skip


def chart(split: list[int], total: int = 512, width: int = 50) -> list[str]:
    """Rank 0's share of each global batch, one row per few steps."""
    every = max(1, len(split) // 20)
    return [
        f"step {k:3d} {split[k]:4d}/{total} " + "#" * round(width * split[k] / total)
        for k in range(0, len(split), every)
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--share", type=float, default=0.33)
    parser.add_argument("--factor", type=float, default=3.0)
    args = parser.parse_args()
    cg, st = [], []
    for rep in range(args.repeats):
        cg.append(cgroup_case(args.share, args.steps))
        st.append(straggle_case(args.factor, args.steps))
        c, s = cg[-1], st[-1]
        print(
            f"repeat {rep + 1}: load {c['load']:.1f}; ms per global batch: one process "
            f"{1e3 * c['one process']:.1f}, even {1e3 * c['even']:.1f}, balanced "
            f"{1e3 * c['balanced']:.1f}, async {1e3 * c['async']:.1f}; balanced/even "
            f"{c['balanced'] / c['even']:.2f}, balanced/async {c['balanced'] / c['async']:.2f}; "
            f"4 workers, one {args.factor:g}x slower: balanced/even "
            f"{s['balanced'] / s['even']:.2f}, balanced/ideal {s['balanced'] / s['ideal']:.2f} "
            f"(split {s['split']}, load {s['load']:.1f})",
            flush=True,
        )
        for name, (d, single) in c["distance"].items():
            print(f"  {name}: distance from float64 {d:.2e}, float32 one process {single:.2e}")
    med = statistics.median
    print(
        f"medians over {args.repeats}: balanced/even "
        f"{med(c['balanced'] / c['even'] for c in cg):.2f}, balanced/async "
        f"{med(c['balanced'] / c['async'] for c in cg):.2f}, straggler balanced/even "
        f"{med(s['balanced'] / s['even'] for s in st):.2f}, balanced/ideal "
        f"{med(s['balanced'] / s['ideal'] for s in st):.2f}"
    )
    print("rank 0's samples of each global batch, the balanced cgroup run of the last repeat:")
    print("\n".join(chart(cg[-1]["split"])))


if __name__ == "__main__":
    main()
