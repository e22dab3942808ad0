"""Where a synchronous step's time goes: forward, backward, averaging, optimizer, per rank.

Runs the benchmark models' steps the way ``Context.step`` does, with a clock around each phase,
for several transport settings side by side (interleaved repeats, medians). The averaging
phase is split further into the sums themselves and the time their barriers spent waiting for
the slowest rank. ``none`` is the floor: the same processes without any averaging.

Run it from the repository root::

    python benchmarks/profile_step.py --model mlp -n 2
    python benchmarks/profile_step.py --model cnn -n 4 --repeats 5

Settings are ``none``, ``gloo``, ``shm`` (the defaults), ``shm-thread`` (sums on a helper
thread), ``shm-spin=SECONDS`` (poll that long before blocking), e.g. ``--settings
none,shm,shm-spin=0``.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import torch
import torch.distributed as dist

import towers
from towers.comm import shm as _shm
from towers.comm.base import DistComm
from towers.comm.group import Connection, init_process_group
from towers.core.launch import read_launch
from towers.engines.sync.driver import SyncDriver
from towers.engines.sync.group import PlainGroup
from towers.tools import bench

PHASES = ("forward", "backward", "average", "optimizer", "step", "sums", "barrier waits")


class _Clock:
    """Time spent in ShmComm's sums and barriers, by wrapping them."""

    sums = 0.0
    waits = 0.0

    @classmethod
    def install(cls) -> None:
        barrier, total = _shm.ShmComm._barrier, _shm.ShmComm._sum

        def timed_barrier(self: Any) -> None:
            start = time.perf_counter()
            barrier(self)
            cls.waits += time.perf_counter() - start

        def timed_sum(self: Any, flat: torch.Tensor) -> None:
            start = time.perf_counter()
            total(self, flat)
            cls.sums += time.perf_counter() - start

        _shm.ShmComm._barrier = timed_barrier  # type: ignore[method-assign]
        _shm.ShmComm._sum = timed_sum  # type: ignore[method-assign]


def _comm(setting: str) -> Any:
    base = DistComm()
    if setting in ("none", "gloo"):
        return base
    kwargs: dict[str, Any] = {}
    if setting == "shm-thread":
        kwargs["threaded"] = True
    elif setting.startswith("shm-spin="):
        kwargs["spin"] = float(setting.partition("=")[2])
    return _shm.ShmComm(base, **kwargs)


def _worker(name: str, setting: str, warmup: int, steps: int) -> list[float]:
    _Clock.install()
    init_process_group(read_launch(), "gloo")
    comm = _comm(setting)
    step = SyncDriver(PlainGroup(Connection(comm, torch.device("cpu"))))
    model = step.replicate(bench._build(name))
    world, rank = comm.world_size, comm.rank
    shards = [towers.split(b, world)[rank] for b in bench._batches(name)]
    opt = bench._sgd(model.parameters())
    sync = step.sync
    assert sync is not None
    phases = [0.0] * 4
    for i in range(warmup + steps):
        if i == warmup:
            comm.barrier()
            phases, _Clock.sums, _Clock.waits = [0.0] * 4, 0.0, 0.0
            start = time.perf_counter()
        x, y = shards[i % len(shards)]
        t0 = time.perf_counter()
        loss = bench.ce_loss(model, (x, y))
        t1 = time.perf_counter()
        if setting == "none":
            loss.backward()
        else:
            sync.arm()
            (loss * len(x)).backward()
        t2 = time.perf_counter()
        if setting != "none":
            sync.finish(len(x), float(loss.detach()) * len(x))
        t3 = time.perf_counter()
        opt.step()
        for p in model.parameters():
            p.grad = None
        t4 = time.perf_counter()
        for k, d in enumerate((t1 - t0, t2 - t1, t3 - t2, t4 - t3)):
            phases[k] += d
    comm.barrier()
    total = time.perf_counter() - start
    step.remove()
    comm.close()
    dist.destroy_process_group()
    return [1e3 * v / steps for v in (*phases, total, _Clock.sums, _Clock.waits)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="mlp", choices=sorted(bench.MODELS))
    parser.add_argument("-n", "--workers", type=int, default=2)
    parser.add_argument("--settings", default="none,gloo,shm,shm-thread,shm-spin=0")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    settings = args.settings.split(",")
    runs: dict[str, list[list[list[float]]]] = {s: [] for s in settings}
    for rep in range(args.repeats):
        for s in settings[rep % len(settings) :] + settings[: rep % len(settings)]:
            runs[s].append(
                towers.spawn(_worker, args.workers, args.model, s, args.warmup, args.steps)
            )
    print(
        f"{args.model}, {args.workers} workers: ms per step, median of {args.repeats} "
        "interleaved repeats (rank 0 / slowest rank for the step)"
    )
    print(f"{'setting':<16}" + "".join(f"{p:>15}" for p in PHASES))
    for s in settings:
        med = [statistics.median(run[0][k] for run in runs[s]) for k in range(len(PHASES))]
        slowest = statistics.median(max(r[4] for r in run) for run in runs[s])
        cells = [f"{v:>15.2f}" for v in med]
        cells[4] = f"{med[4]:>8.2f} / {slowest:<4.1f}"
        print(f"{s:<16}" + "".join(cells))


if __name__ == "__main__":
    main()
