"""The outputs of ``towers bench``: JSON, a readable table, and a PNG of the averaging sweep."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from .startup import table as startup_table

__all__ = ["table", "write"]


def _f(value: Any, fmt: str) -> str:
    return "-" if value is None else format(value, fmt)


ARM_LEGEND = {
    "single-1t": "one process, the whole global batch, 1 thread",
    "single-Nt": "one process, the whole global batch, N threads (N = workers, at most the cores)",
    "floor": "N processes, each training on its shard with no averaging at all: the fastest "
    "any data-parallel arm could go",
    "ddp": "PyTorch's DistributedDataParallel over Gloo, the same shards",
    "towers-gloo": "towers' synchronous step, averaging over Gloo (loopback TCP)",
    "towers-shm": "towers' synchronous step, averaging through shared memory (the default on "
    "one host); @1MiB, @25MiB: other gradient bucket sizes (default 4 MiB)",
    "towers-async": "towers.train(mode='async'): a parameter server and N workers; time per "
    "global batch",
    "towers-nccl": "towers' synchronous step on NCCL, one GPU per worker",
    "train-sync": "towers.train in sync mode (the split balanced by default); time per global "
    "batch",
    "train-elastic": "towers.train(elastic=True); time per global batch",
    "train-even": "towers.train(balance=False): the even split; time per global batch",
}


def table(results: dict[str, Any]) -> str:
    """The step-time table of every model with a legend, then the sweep, as plain text."""
    cfg, machine = results["config"], results["machine"]
    n = cfg["workers"]
    load = cfg.get("load", 0)
    beside = f"{load} busy process{'es' if load != 1 else ''} (a CPU spin loop each)"
    lines = [
        f"towers bench: {n} workers, {cfg['steps']} timed steps after {cfg['warmup']} warm-up, "
        f"median of {cfg['repeats']} repeats; {machine['cores']} cores, torch {machine['torch']}",
        f"running beside it: {beside if load else 'nothing started by the benchmark'}; "
        f"load average at the end {machine['load_average'][0]:.2f}",
    ]
    if "load_at_repeats" in machine:
        loads = " ".join(f"{v:.2f}" for v in machine["load_at_repeats"])
        lines.append(f"1-minute load average as each repeat started: {loads}")
    for name, model in results["models"].items():
        lines += [
            "",
            f"{name}: global batch {model['global_batch']}, {model['parameters']:,} parameters",
            f"{'arm':<22}{'ms/step':>10}{'samples/s':>12}{'scaling':>9}{'x DDP':>8}"
            f"{'x 1 proc':>10}   each repeat (ms)",
        ]
        for row in model["arms"]:
            if "skipped" in row:
                lines.append(f"{row['arm']:<22}{row['skipped']}")
                continue
            runs = " ".join(_f(r, ".1f") if isinstance(r, float) else "?" for r in row["runs_ms"])
            lines.append(
                f"{row['arm']:<22}{row['ms_per_step']:>10.2f}{row['samples_per_s']:>12.0f}"
                f"{_f(row['scaling_efficiency'], '.0%'):>9}{_f(row['vs_ddp_paired'], '.2f'):>8}"
                f"{_f(row['vs_single_nt_paired'], '.2f'):>10}   {runs}"
            )
    lines += ["", *legend(results)]
    if results["sweep"]:
        lines += ["", *_sweep_table(results)]
    if "startup" in results:
        lines += ["", *startup_table(results["startup"])]
    return "\n".join(lines)


def legend(results: dict[str, Any]) -> list[str]:
    """What the step table's columns and arms mean, in plain words."""
    arms = {row["arm"].partition("@")[0] for m in results["models"].values() for row in m["arms"]}
    lines = [
        "ms/step: milliseconds per global batch, the median over the repeats",
        "samples/s: global batch / ms/step",
        "scaling: single-1t's time / (processes x this arm's time); 100% = N processes are N "
        "times as fast as one",
        "x DDP: this arm's time divided by DDP's time in the same repeat (so both saw the same "
        "machine load), median over the repeats; below 1 = faster than DDP",
        "x 1 proc: the same, against single-Nt",
        "each repeat: the arm's time in each repeat (arms run in a rotated order per repeat)",
    ]
    lines += [f"{arm}: {text}" for arm, text in ARM_LEGEND.items() if arm in arms]
    return lines


def _sweep_table(results: dict[str, Any]) -> list[str]:
    n = results["config"]["workers"]
    lines = [
        f"all-reduce of float32 messages over {n} workers (median time per call; "
        "bus = bus bandwidth, size / time x 2(n-1)/n, as nccl-tests define it)",
        f"{'size':>9}{'gloo us':>9}{'bus':>7}{'shm us':>9}{'bus':>7}{'lent us':>9}{'bus':>7}"
        f"{'memcpy':>8}{'shm/mc':>8}{'lent/mc':>8}",
    ]
    for row in results["sweep"]:
        mc = row.get("memcpy_gbps")
        cells = [f"{_size(row['bytes']):>9}"]
        for kind in ("gloo", "shm", "shm_lent"):
            cells.append(f"{_f(row.get(f'{kind}_us'), '.1f'):>9}")
            cells.append(f"{_f(row.get(f'{kind}_busbw_gbps'), '.2f'):>7}")
        cells.append(f"{_f(mc, '.2f'):>8}")
        for kind in ("shm", "shm_lent"):
            bus = row.get(f"{kind}_busbw_gbps")
            cells.append(f"{_f(bus / mc if bus and mc else None, '.0%'):>8}")
        lines.append("".join(cells))
    lines.append(
        "(bandwidths in GB/s; shm: the caller's own tensor, copied into shared memory and back; "
        "lent: a tensor that already lives in shared memory (a buffer the transport hands out, "
        "where towers packs its gradient buckets), summed in place; mc: a one-thread memcpy of "
        "the same size)"
    )
    return lines


def _size(nbytes: int) -> str:
    for unit, scale in (("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= scale:
            return f"{nbytes / scale:g} {unit}"
    return f"{nbytes} B"


def plot(results: dict[str, Any], path: Path) -> Path:
    """Bus bandwidth of each transport and memcpy bandwidth against message size."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sweep = results["sweep"]
    sizes = [row["bytes"] for row in sweep]
    fig, (bw, lat) = plt.subplots(1, 2, figsize=(11, 4.2))
    # One colour and line style per series, the same in both panels.
    series = {
        "memcpy": ("memcpy, 1 thread", ":", "tab:gray"),
        "shm_lent": ("towers shm, gradients already in shared memory", "-", "tab:blue"),
        "shm": ("towers shm, caller's tensor copied in and out", "-.", "tab:green"),
        "gloo": ("Gloo (loopback TCP)", "--", "tab:red"),
    }
    for kind, (label, style, colour) in series.items():
        bw_key = "memcpy_gbps" if kind == "memcpy" else f"{kind}_busbw_gbps"
        if all(bw_key in row for row in sweep):
            values = [row[bw_key] for row in sweep]
            bw.plot(sizes, values, style, color=colour, marker="o", label=label)
        if kind != "memcpy" and all(f"{kind}_us" in row for row in sweep):
            values = [row[f"{kind}_us"] for row in sweep]
            lat.plot(sizes, values, style, color=colour, marker="o", label=label)
    n = results["config"]["workers"]
    for ax, ylabel in (
        (bw, "GB/s (memcpy: bytes / time; all-reduce: bus bandwidth)"),
        (lat, "microseconds per all-reduce"),
    ):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("message size (bytes)")
        ax.set_ylabel(ylabel)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
    bw.set_title(f"all-reduce bandwidth, {n} workers")
    lat.set_title(f"all-reduce time, {n} workers")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def write(results: dict[str, Any], out: Path) -> dict[str, Path]:
    """Write bench.json, bench.txt and (with a sweep) sweep.png into ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    paths = {"json": out / "bench.json", "table": out / "bench.txt"}
    paths["json"].write_text(json.dumps(results, indent=2) + "\n")
    paths["table"].write_text(table(results) + "\n")
    if results["sweep"]:
        paths["png"] = plot(results, out / "sweep.png")
    return paths
