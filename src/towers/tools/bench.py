"""``towers bench``: side-by-side step times and an averaging sweep, measured in one run.

Every arm trains the same model on the same global batches (synthetic data, fixed seed) and is
timed after a warm-up; each repeat runs every arm once, in a rotated order, so that load from
other processes hits all arms alike; the report gives medians. ``load`` (``--load K``) runs K
CPU-spinning processes beside the whole run, as on a machine others use. Arms:

- ``single-1t``, ``single-Nt``: one process, the whole global batch, 1 and N threads;
- ``floor``: N processes, each training on its shard alone — no averaging, the bound any
  data-parallel arm could reach;
- ``ddp``: ``torch.nn.parallel.DistributedDataParallel`` over Gloo, same global batch split;
- ``towers-gloo``, ``towers-shm``: towers' synchronous step on each transport (and with other
  bucket sizes if asked);
- ``towers-async``: ``towers.train(mode="async")``: a parameter server and ``workers``
  computing towers, seconds per global batch after the warm-up;
- ``towers-nccl``: towers' synchronous step on NCCL, one GPU per worker (skipped without as many
  CUDA devices as workers);
- ``train-sync``, ``train-elastic``, ``train-even`` (only when named in ``--arms``):
  ``towers.train`` in sync mode without and with ``elastic=True``, and with ``balance=False``
  (the even split), seconds per global batch after the warm-up: what elastic costs when
  nothing fails, and what a balanced split saves beside busy processes.

The sweep times one all-reduce of 4 KB ... 64 MB float32 messages on each transport, next to a
one-thread memcpy of the same size measured in the same run. Reporting lives in
``_bench_report``.
"""

from __future__ import annotations

import functools
import os
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ..api.join import init
from ..api.train import train
from ..comm.group import init_process_group
from ..core.launch import read_launch
from ..core.messages import first_line
from ..core.split import split
from ..processes.env import cpu_count
from ..processes.spawn import spawn
from .load import busy
from .startup import first_jobs, in_fresh_process
from .zoo import CNN, cross_entropy, mlp

__all__ = ["BenchConfig", "run"]

MiB = 1024 * 1024
SWEEP_BYTES = [4 << 10, 16 << 10, 64 << 10, 256 << 10, 1 << 20, 4 << 20, 16 << 20, 64 << 20]
# shm: the caller's own tensor (copied in and out); shm-lent: a buffer from ShmComm.buffer(),
# summed in place (what the engine's buckets use); memcpy: one thread, the same sizes
SWEEP_KINDS = ("gloo", "shm", "shm-lent", "memcpy")
ARMS = [
    "single-1t",
    "single-Nt",
    "floor",
    "ddp",
    "towers-gloo",
    "towers-shm",
    "towers-async",
    "towers-nccl",
    "train-sync",
    "train-elastic",
    "train-even",
]


@dataclass
class BenchConfig:
    """What to measure; the defaults are ``towers bench`` (a few minutes on 2 cores)."""

    models: Sequence[str] = ("mlp", "cnn")
    workers: int = 2
    steps: int = 20
    warmup: int = 5
    repeats: int = 3
    arms: Sequence[str] = tuple(a for a in ARMS if not a.startswith("train-"))
    bucket_mib: Sequence[float] = (1.0, 25.0)  # extra towers-shm arms (the default is 4 MiB)
    sweep_bytes: Sequence[int] = tuple(SWEEP_BYTES)
    sweep_seconds: float = 0.15  # per size and transport, at most (a few calls at least)
    timeout: float = 60.0
    load: int = 0  # CPU-spinning processes running beside every arm (tools/load.py)
    startup: bool = False  # also time start-up: first and later calls (tools/startup.py)
    extra: dict[str, Any] = field(default_factory=dict)


# -- models ---------------------------------------------------------------------------------


MODELS: dict[str, tuple[Callable[[], nn.Module], tuple[int, ...], int]] = {
    # name: (builder, input shape of one sample, global batch)
    "mlp": (mlp, (784,), 512),
    "cnn": (CNN, (1, 8, 8), 256),  # the digits CNN of examples/digits_cnn.py
}
ce_loss = cross_entropy


def _batches(name: str, count: int = 4) -> list[tuple[torch.Tensor, torch.Tensor]]:
    _, shape, batch = MODELS[name]
    g = torch.Generator().manual_seed(0)
    return [
        (torch.randn(batch, *shape, generator=g), torch.randint(0, 10, (batch,), generator=g))
        for _ in range(count)
    ]


def _build(name: str) -> nn.Module:
    torch.manual_seed(0)
    return MODELS[name][0]()


def _sgd(params: Any) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.01)


# -- arms (each runs in fresh processes) ------------------------------------------------------


def _timed(step: Callable[[int], None], warmup: int, steps: int, sync: Callable[[], None]) -> float:
    for i in range(warmup):
        step(i)
    sync()
    start = time.perf_counter()
    for i in range(steps):
        step(warmup + i)
    sync()
    return (time.perf_counter() - start) / steps


def _plain(model: nn.Module, batches: list[Any], warmup: int, steps: int) -> float:
    """Seconds per step of a plain loop (no communication) over ``batches``."""
    opt = _sgd(model.parameters())

    def step(i: int) -> None:
        opt.zero_grad(set_to_none=True)
        ce_loss(model, batches[i % len(batches)]).backward()
        opt.step()

    return _timed(step, warmup, steps, lambda: None)


def _single(name: str, threads: int, warmup: int, steps: int) -> float:
    torch.set_num_threads(threads)
    return _plain(_build(name), _batches(name), warmup, steps)


def _floor(name: str, warmup: int, steps: int) -> float:
    launch = read_launch()
    world, rank = launch.world_size, launch.rank
    return _plain(_build(name), [split(b, world)[rank] for b in _batches(name)], warmup, steps)


def _ddp(name: str, warmup: int, steps: int) -> float:
    init_process_group(read_launch(), "gloo")
    try:
        return _ddp_steps(name, warmup, steps)
    finally:
        # Only now: destroying the group while a DistributedDataParallel still exists hangs
        # its destructor now and then (seen once in about 20 runs).
        dist.destroy_process_group()


def _ddp_steps(name: str, warmup: int, steps: int) -> float:
    from torch.nn.parallel import DistributedDataParallel

    world, rank = dist.get_world_size(), dist.get_rank()
    model = DistributedDataParallel(_build(name))
    shards = [split(b, world)[rank] for b in _batches(name)]
    opt = _sgd(model.parameters())

    def step(i: int) -> None:
        opt.zero_grad(set_to_none=True)
        ce_loss(model, shards[i % len(shards)]).backward()
        opt.step()

    return _timed(step, warmup, steps, dist.barrier)


def _towers(name: str, transport: str, bucket_mib: float, warmup: int, steps: int) -> float:
    ctx = init(transport=transport)
    try:
        model = ctx.replicate(_build(name), bucket_bytes=int(bucket_mib * MiB))
        shards = list(ctx.shards(_batches(name)))
        opt = _sgd(model.parameters())

        def step(i: int) -> None:
            shard = shards[i % len(shards)]
            ctx.step(ce_loss(model, shard), opt, samples=len(shard[0]))

        return _timed(step, warmup, steps, ctx.barrier)
    finally:
        ctx.close()


def _train(name: str, workers: int, warmup: int, steps: int, **options: Any) -> float:
    """Seconds per global batch of ``towers.train`` (async mode, or sync with/without elastic)."""
    x, y = (torch.cat(t) for t in zip(*_batches(name)))
    result = train(
        _build(name),
        ce_loss,
        (x, y),
        batch_size=MODELS[name][2],
        steps=warmup + steps,
        workers=workers,
        optimizer=_sgd,
        progress=False,
        **options,
    )
    # result.times[k]: seconds from the start until global batch k was complete
    done_warming = result.times[warmup - 1] if warmup else 0.0
    return (result.times[-1] - done_warming) / steps


def _arm(name: str, arm: str, cfg: BenchConfig) -> float | str:
    n, w, s = cfg.workers, cfg.warmup, cfg.steps
    if arm == "single-1t":
        return spawn(_single, 1, name, 1, w, s, timeout=cfg.timeout)[0]
    if arm == "single-Nt":
        return spawn(_single, 1, name, min(n, cpu_count()), w, s, timeout=cfg.timeout)[0]
    if arm == "floor":
        return max(spawn(_floor, n, name, w, s, timeout=cfg.timeout))
    if arm == "ddp":
        return spawn(_ddp, n, name, w, s, timeout=cfg.timeout)[0]
    if arm == "towers-async":
        return _train(name, n, w, s, mode="async")
    if arm in ("train-sync", "train-elastic"):  # the steady-state cost of elastic=True
        return _train(name, n, w, s, elastic=arm == "train-elastic")
    if arm == "train-even":  # against train-sync: what the balanced split saves
        return _train(name, n, w, s, balance=False)
    if arm == "towers-nccl" and torch.cuda.device_count() < n:
        return f"skipped: needs {n} CUDA devices, this machine has {torch.cuda.device_count()}"
    if arm.startswith("towers-"):
        transport, _, bucket = arm.removeprefix("towers-").partition("@")
        mib = float(bucket.removesuffix("MiB")) if bucket else 4.0
        return spawn(_towers, n, name, transport, mib, w, s, timeout=cfg.timeout)[0]
    raise ValueError(f"unknown arm {arm!r}; known: {', '.join(ARMS)}")


# -- the averaging sweep ----------------------------------------------------------------------


def _iters(nbytes: int, seconds: float, bytes_per_second: float) -> int:
    return max(3, min(200, int(seconds * bytes_per_second / nbytes)))


def _sweep_comm(kind: str, sizes: Sequence[int], seconds: float) -> list[float]:
    ctx = init(transport=kind.removesuffix("-lent"))
    comm = ctx.comm
    try:
        out = []
        for nbytes in sizes:
            if kind.endswith("-lent"):  # a buffer lent by the transport, as bucket buffers are
                lent = comm.buffer(nbytes // 4, torch.float32)
                assert lent is not None, "shared memory lends buffers"
                x = lent.fill_(1.0)
            else:
                x = torch.ones(nbytes // 4)
            iters = _iters(nbytes, seconds, 1e9)  # the same count on every rank
            for _ in range(2):
                comm.all_reduce_sum(x).wait()
            comm.barrier()
            start = time.perf_counter()
            for _ in range(iters):
                comm.all_reduce_sum(x).wait()
            out.append((time.perf_counter() - start) / iters)
        # the slowest rank's time is the collective's time
        return [max(ts) for ts in zip(*comm.all_gather_object(out))]
    finally:
        ctx.close()


def _sweep_memcpy(sizes: Sequence[int], seconds: float) -> list[float]:
    torch.set_num_threads(1)
    out = []
    for nbytes in sizes:
        src, dst = torch.ones(nbytes // 4), torch.empty(nbytes // 4)
        iters = _iters(nbytes, seconds, 10e9)
        for _ in range(2):
            dst.copy_(src)
        start = time.perf_counter()
        for _ in range(iters):
            dst.copy_(src)
        out.append((time.perf_counter() - start) / iters)
    return out


# -- the run ----------------------------------------------------------------------------------


def _median(values: list[Any]) -> float | str:
    numbers = [v for v in values if isinstance(v, float)]
    if numbers:
        return statistics.median(numbers)
    return values[0] if values else "not run"


def run(cfg: BenchConfig, log: Callable[[str], None] = print) -> dict[str, Any]:
    """Measure every arm and the sweep, with ``cfg.load`` busy processes beside them.

    Returns the results as a JSON-ready dict.
    """
    with busy(cfg.load):
        results = _run(cfg, log)
        if cfg.startup:
            log("start-up: timing first and later calls in a fresh interpreter")
            results["startup"] = in_fresh_process(cfg.workers)
            log("start-up: a first job with towers.train and with mp.spawn + DDP")
            results["startup"]["first_job"] = first_jobs(cfg.workers, cfg.repeats)
        return results


def _run(cfg: BenchConfig, log: Callable[[str], None]) -> dict[str, Any]:
    arms = list(cfg.arms)
    if "towers-shm" in arms:
        arms += [f"towers-shm@{m:g}MiB" for m in cfg.bucket_mib]
    raw: dict[str, dict[str, list[Any]]] = {m: {a: [] for a in arms} for m in cfg.models}
    sweep_raw: dict[str, list[list[float]]] = {k: [] for k in SWEEP_KINDS}
    loads = []  # the machine's 1-minute load average as each repeat starts
    for rep in range(cfg.repeats):
        loads.append(os.getloadavg()[0])
        for name in cfg.models:
            order = arms[rep % len(arms) :] + arms[: rep % len(arms)]
            for arm in order:
                try:
                    value = _arm(name, arm, cfg)
                except Exception as exc:  # one failed run (a port taken, a timeout) is a gap
                    value = f"failed: {first_line(exc)}"
                raw[name][arm].append(value)
                shown = f"{value * 1e3:.2f} ms/step" if isinstance(value, float) else value
                log(f"repeat {rep + 1}/{cfg.repeats} {name:<4} {arm:<20} {shown}")
        if cfg.sweep_bytes:
            kinds = list(SWEEP_KINDS)
            for kind in kinds[rep % len(kinds) :] + kinds[: rep % len(kinds)]:
                try:
                    if kind == "memcpy":
                        times = spawn(_sweep_memcpy, 1, cfg.sweep_bytes, cfg.sweep_seconds)[0]
                    else:
                        args = (kind, cfg.sweep_bytes, cfg.sweep_seconds)
                        times = spawn(_sweep_comm, cfg.workers, *args, timeout=cfg.timeout)[0]
                except Exception as exc:
                    log(f"repeat {rep + 1}/{cfg.repeats} sweep {kind} failed: {exc}")
                    continue
                sweep_raw[kind].append(times)
            log(f"repeat {rep + 1}/{cfg.repeats} sweep done")
    results = _summarize(cfg, arms, raw, sweep_raw)
    results["machine"]["load_at_repeats"] = loads
    return results


def _summarize(
    cfg: BenchConfig,
    arms: list[str],
    raw: dict[str, dict[str, list[Any]]],
    sweep_raw: dict[str, list[list[float]]],
) -> dict[str, Any]:
    n = cfg.workers
    models = {}
    for name in cfg.models:
        batch = MODELS[name][2]
        med = {a: _median(raw[name][a]) for a in arms}
        t1, tn, tddp = med.get("single-1t"), med.get("single-Nt"), med.get("ddp")
        rows = []
        for arm in arms:
            t = med[arm]
            row: dict[str, Any] = {"arm": arm, "runs_ms": [_ms(v) for v in raw[name][arm]]}
            if isinstance(t, float):
                procs = 1 if arm.startswith("single") else n
                width = min(n, cpu_count()) if arm == "single-Nt" else procs
                row |= {
                    "ms_per_step": t * 1e3,
                    "samples_per_s": batch / t,
                    "scaling_efficiency": _ratio(t1, width * t) if arm != "single-1t" else 1.0,
                    "vs_ddp": _ratio(t, tddp),
                    "vs_single_nt": _ratio(t, tn),
                    # the same ratios taken within each repeat, then the median: load that
                    # drifts between repeats cancels out
                    "vs_ddp_paired": _paired(raw[name][arm], raw[name].get("ddp")),
                    "vs_single_nt_paired": _paired(raw[name][arm], raw[name].get("single-Nt")),
                }
            else:
                row["skipped"] = t
            rows.append(row)
        models[name] = {
            "global_batch": batch,
            "parameters": sum(p.numel() for p in _build(name).parameters()),
            "arms": rows,
        }
    sweep = []
    for i, nbytes in enumerate(cfg.sweep_bytes):
        row = {"bytes": nbytes}
        for kind, runs in sweep_raw.items():
            if not runs:
                continue
            t = statistics.median(r[i] for r in runs)
            key = kind.replace("-", "_")
            row[f"{key}_us"] = t * 1e6
            if kind == "memcpy":
                row["memcpy_gbps"] = nbytes / t / 1e9
            else:
                row[f"{key}_algbw_gbps"] = nbytes / t / 1e9
                row[f"{key}_busbw_gbps"] = nbytes / t / 1e9 * 2 * (n - 1) / n
        sweep.append(row)
    return {
        "config": {k: (list(v) if isinstance(v, tuple) else v) for k, v in asdict(cfg).items()},
        "machine": {
            "cores": cpu_count(),
            "torch": torch.__version__,
            "load_average": list(os.getloadavg()),
            "cuda": torch.cuda.is_available(),
        },
        "models": models,
        "sweep": sweep,
    }


def _ms(value: Any) -> Any:
    return value * 1e3 if isinstance(value, float) else value


def _paired(runs: list[Any], reference: list[Any] | None) -> float | None:
    ratios = [_ratio(a, b) for a, b in zip(runs, reference or [])]
    numbers = [r for r in ratios if r is not None]
    return statistics.median(numbers) if numbers else None


def _ratio(a: Any, b: Any) -> float | None:
    if isinstance(a, float) and isinstance(b, float) and b > 0:
        return a / b
    return None


quick = functools.partial(
    BenchConfig,
    steps=3,
    warmup=1,
    repeats=1,
    bucket_mib=(),
    sweep_bytes=(4 << 10, 1 << 20),
    sweep_seconds=0.02,
)
