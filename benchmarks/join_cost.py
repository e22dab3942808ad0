"""What a join costs a running elastic job: the members' step in which a newcomer is let in,
against their steps after it.

The members keep training while a newcomer starts (the import of torch, building its model);
what the join takes from them is the end of the step after which they regroup with it (a new
process group, and a live peer sends it the state: parameters, optimizer, step counter, split)
and the first step with it (which waits for whatever the newcomer does before it). For each run
the cost is those two steps' time (from the end of the step before them) minus twice the median
of the next 10 steps' (at the new width), in two arms:

- ``local``: ``towers.train(..., workers=2, elastic=True, min_workers=1)``, an MLP of
  ``--width`` hidden units trained with Adam (its state is twice the parameters), a 30 ms
  sleep per shard; worker 1 joins as soon as it is built.
- ``hosts`` (root: network namespaces, tests/netns.py): ``towers run --elastic --nnodes 2:3``
  on two hosts (one worker each) running tests/scripts/elastic_loop.py; a third host's
  ``towers run`` is launched after ``--after`` steps and joins. Also reported: from its launch
  to its worker's first step.

Prints one line per run and the medians, with the load average::

    python benchmarks/join_cost.py --runs 3
    python benchmarks/join_cost.py --arms local --width 2048
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import itertools
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
import towers  # noqa: E402


def _stall(times: list[float], world: list[int], width: int) -> tuple[int, float, float]:
    """The first step at ``width`` towers; the duration of it and the step before it (the
    members regroup at the end of that step, the newcomer's first step follows), and twice the
    median of the next 10 steps'."""
    k = world.index(width)
    steps = [b - a for a, b in itertools.pairwise(times)]  # steps[i - 1]: step i's duration
    after = statistics.median(steps[k : k + 10])
    return k, steps[k - 2] + steps[k - 1], 2 * after


def _loss(model: nn.Module, shard: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    time.sleep(0.03)
    x, y = shard
    return nn.functional.mse_loss(model(x), y)


def local(width: int) -> tuple[float, str]:
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(4096, 64, generator=g), torch.randn(4096, 1, generator=g)
    model = nn.Sequential(
        nn.Linear(64, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU(), nn.Linear(width, 1)
    )
    result = towers.train(
        model,
        _loss,
        (x, y),
        batch_size=64,
        steps=60,
        workers=2,
        elastic=True,
        min_workers=1,
        progress=False,
        optimizer=functools.partial(torch.optim.Adam, lr=1e-3),
    )
    k, step, after = _stall(result.times, result.world, 2)
    params = sum(p.numel() for p in model.parameters())
    return (
        step - after,
        f"{params} parameters, joined at step {k}: {step * 1e3:.0f} ms against "
        f"{after * 1e3:.0f} (two steps)",
    )


def _netns() -> object:
    spec = importlib.util.spec_from_file_location("towers_bench_netns", ROOT / "tests" / "netns.py")
    module = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    sys.modules[spec.name] = module  # type: ignore[union-attr]
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    return module


def hosts(after: int) -> tuple[float, str]:
    netns = _netns()
    script = ROOT / "tests" / "scripts" / "elastic_loop.py"
    steps, port = after + 200, random.randrange(20000, 30000)  # the job outlasts the join
    with tempfile.TemporaryDirectory() as tmp, netns.three_hosts() as (a, b, c):  # type: ignore[attr-defined]
        work = Path(tmp)
        (work / "progress").mkdir()
        (work / "out").mkdir()
        env = {k: v for k, v in os.environ.items() if not k.startswith(("GLOO_", "MASTER_"))}
        env |= {"PYTHONPATH": str(ROOT / "src"), "OMP_NUM_THREADS": "1", "TOWERS_SECRET": "join"}

        def launch(host: object, rank: int) -> subprocess.Popen[str]:
            args = [sys.executable, "-m", "towers", "run", str(script), "-n", "1", "--elastic",
                    "--nnodes", "2:3", "--node-rank", str(rank), "--master-addr", a.addr,
                    "--master-port", str(port), "--", "--progress", str(work / "progress"),
                    "--out", str(work / "out"), "--steps", str(steps),
                    "--sleep", "0.05"]  # fmt: skip
            return host.popen(args, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)  # type: ignore[attr-defined]

        nodes = [launch(a, 0), launch(b, 1)]
        deadline = time.monotonic() + 120
        while sum(f.stat().st_size for f in (work / "progress").iterdir()) < 2 * after:
            if time.monotonic() > deadline or any(n.poll() is not None for n in nodes):
                raise RuntimeError("the job made no progress: " + nodes[0].communicate()[0])
            time.sleep(0.01)
        launched = time.time()
        nodes.append(launch(c, 2))
        logs = [n.communicate(timeout=120)[0] for n in nodes]
        if any(n.returncode for n in nodes):
            raise RuntimeError("\n".join(log[-2000:] for log in logs))
        finals = {int(p.stem.split("-")[1]): torch.load(p) for p in (work / "out").glob("*.pt")}
    first = finals[0]
    k, step, after_join = _stall(first["times"], first["world"], 3)
    start = finals[max(finals)]["times"][0] - launched
    return step - after_join, (
        f"joined at step {k}: {step * 1e3:.0f} ms against {after_join * 1e3:.0f} (two steps); "
        f"launch to first step {start:.2f} s"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arms", default="local,hosts")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--width", type=int, default=1024, help="local: hidden units")
    parser.add_argument("--after", type=int, default=8, help="hosts: steps before the launch")
    args = parser.parse_args()
    for arm in args.arms.split(","):
        costs = []
        for run in range(args.runs):
            load = os.getloadavg()[0]
            cost, said = local(args.width) if arm == "local" else hosts(args.after)
            costs.append(cost)
            print(f"{arm} run {run}: cost {cost:.2f} s ({said}; load {load:.1f})", flush=True)
        print(f"{arm}: median cost {statistics.median(costs):.2f} s over {len(costs)} runs")


if __name__ == "__main__":
    main()
