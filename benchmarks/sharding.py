"""Sharded optimizer state, side by side in one run: memory and step time per tower.

Three arms train the same MLP (``--width`` wide, three square layers: 50 M parameters at the
default 4096) with AdamW on 2 and 4 local towers, one after the other in the same run:

- ``towers``: ``ctx.replicate(model)``, every tower holds the whole optimizer state;
- ``towers sharded``: ``ctx.replicate(model, shard_optimizer=True)``;
- ``DDP + ZeRO``: torch's ``DistributedDataParallel`` over Gloo with its
  ``ZeroRedundancyOptimizer`` (each rank owns whole parameters);
- ``towers diloco:2`` and ``towers diloco:2 sharded``: DiLoCo with an outer step every 2
  steps, the outer state (the outer parameters and the outer momentum) kept whole on every
  tower, or sharded (``shard_optimizer=True``); the inner AdamW is each tower's own in both.

Each rank reports its peak resident memory (``ru_maxrss``), the bytes of optimizer state it
holds (DiLoCo: of the outer state; its inner AdamW holds what the ``towers`` arm's does), and
the median time of its steps after the first two (DiLoCo: of each pair of steps, one of which
ends in an exchange, per step); the table gives the median over the ranks. Run from the
repository root::

    python benchmarks/sharding.py                # 50 M parameters, 2 and 4 towers
    python benchmarks/sharding.py --width 1024 --steps 4   # a quick look
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import time
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.nn.parallel import DistributedDataParallel

import towers

BATCH = 16  # samples per tower and step
ARMS = ("towers", "towers sharded", "DDP + ZeRO", "towers diloco:2", "towers diloco:2 sharded")


def build(width: int) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(width, width), nn.Tanh(), nn.Linear(width, width), nn.Tanh(),
        nn.Linear(width, width),
    )  # fmt: skip


def _state_bytes(opt: torch.optim.Optimizer) -> int:
    state = opt.optim.state if isinstance(opt, ZeroRedundancyOptimizer) else opt.state
    return sum(
        v.numel() * v.element_size() for s in state.values() for v in s.values() if v.dim() > 0
    )


def _outer_bytes(ctx: Any) -> int:
    """The outer state a DiLoCo tower keeps: the outer parameters and the outer momentum."""
    plan = ctx._state.plan
    if plan.sharded is None:
        params = [p for p in plan.outer.parameters() if p.requires_grad]
        kept = sum(p.numel() * p.element_size() for p in params)
        return kept + _state_bytes(plan.outer_opt)
    kept = sum(t.numel() * t.element_size() for t in plan.sharded.kept.values())
    return kept + _state_bytes(plan.sharded.optimizer)


def arm(name: str, width: int, steps: int) -> dict[str, Any]:
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(1)
    ctx = None
    diloco = name.startswith("towers diloco")
    if name == "DDP + ZeRO":
        dist.init_process_group("gloo")
        rank, world = dist.get_rank(), dist.get_world_size()
        model: nn.Module = DistributedDataParallel(build(width))
        opt: Any = ZeroRedundancyOptimizer(
            model.parameters(), optimizer_class=torch.optim.AdamW, lr=1e-4
        )
    else:
        ctx = towers.init()
        rank, world = ctx.rank, ctx.world_size
        sharded = name.endswith("sharded")
        mode = "diloco:2" if diloco else "sync"
        model = ctx.replicate(build(width), mode=mode, shard_optimizer=sharded)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    times = []
    for _ in range(steps):
        x = torch.randn(BATCH * world, width, generator=g)[rank * BATCH : (rank + 1) * BATCH]
        began = time.perf_counter()
        loss = model(x).square().mean()
        if ctx is None:
            loss.backward()
        elif diloco:
            ctx.step(loss, opt, BATCH)  # every second step ends in an exchange
        else:
            ctx.backward(loss, BATCH)
        if not diloco:
            opt.step()
            opt.zero_grad()
        times.append(time.perf_counter() - began)
    if diloco:  # per step, over pairs of steps: one inner step alone, one with the exchange
        times = [(a + b) / 2 for a, b in zip(times[::2], times[1::2], strict=False)]
    out = {
        "rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "state_mib": (_outer_bytes(ctx) if diloco else _state_bytes(opt)) / 2**20,
        "ms": 1e3 * statistics.median(times[1:] if diloco else times[2:]),
    }
    if ctx is not None:
        ctx.close()
    else:
        dist.destroy_process_group()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--width", type=int, default=4096)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--towers", default="2,4")
    parser.add_argument("--arms", default=",".join(ARMS))
    args = parser.parse_args()
    params = sum(p.numel() for p in build(args.width).parameters())
    print(f"MLP of {params / 1e6:.1f} M parameters, AdamW, {BATCH} samples per tower; "
          f"load before: {os.getloadavg()[0]:.1f}")  # fmt: skip
    print("| towers | arm | peak RSS MiB | optimizer state MiB | ms/step |")
    print("| --- | --- | --- | --- | --- |")
    for n in (int(t) for t in args.towers.split(",")):
        for name in args.arms.split(","):
            ranks = towers.spawn(arm, n, name, args.width, args.steps)
            row = {k: statistics.median(r[k] for r in ranks) for k in ranks[0]}
            print(f"| {n} | {name} | {row['rss_mib']:.0f} | {row['state_mib']:.0f} | "
                  f"{row['ms']:.0f} |", flush=True)  # fmt: skip
    print(f"load after: {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
