"""The outputs of ``towers bench``: JSON, a readable table, and a PNG of the averaging sweep."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

__all__ = ["table", "write"]


def _f(value: Any, fmt: str) -> str:
    return "-" if value is None else format(value, fmt)


def table(results: dict[str, Any]) -> str:
    """The step-time table of every model, then the sweep, as plain text."""
    cfg, machine = results["config"], results["machine"]
    n = cfg["workers"]
    lines = [
        f"towers bench: {n} workers, {cfg['steps']} timed steps after {cfg['warmup']} warm-up, "
        f"median of {cfg['repeats']} interleaved repeats; {machine['cores']} cores, torch "
        f"{machine['torch']}, load average at the end {machine['load_average'][0]:.2f}",
    ]
    if "load_at_repeats" in machine:
        loads = " ".join(f"{v:.2f}" for v in machine["load_at_repeats"])
        lines.append(f"1-minute load average as each repeat started: {loads}")
    lines.append(
        "vs DDP, vs 1p-Nt: ratio of the medians; paired: median of the ratios within each "
        "repeat (steadier under load from other processes); 1p-Nt: one process, N threads"
    )
    for name, model in results["models"].items():
        lines += [
            "",
            f"{name}: global batch {model['global_batch']}, {model['parameters']:,} parameters",
            f"{'arm':<22}{'ms/step':>10}{'samples/s':>12}{'scaling':>9}{'vs DDP':>8}"
            f"{'paired':>8}{'vs 1p-Nt':>10}{'paired':>8}   runs (ms)",
        ]
        for row in model["arms"]:
            if "skipped" in row:
                lines.append(f"{row['arm']:<22}{row['skipped']}")
                continue
            runs = " ".join(_f(r, ".1f") if isinstance(r, float) else "?" for r in row["runs_ms"])
            lines.append(
                f"{row['arm']:<22}{row['ms_per_step']:>10.2f}{row['samples_per_s']:>12.0f}"
                f"{_f(row['scaling_efficiency'], '.0%'):>9}{_f(row['vs_ddp'], '.2f'):>8}"
                f"{_f(row['vs_ddp_paired'], '.2f'):>8}{_f(row['vs_single_nt'], '.2f'):>10}"
                f"{_f(row['vs_single_nt_paired'], '.2f'):>8}   {runs}"
            )
    if results["sweep"]:
        lines += [
            "",
            f"all-reduce of float32 messages over {n} workers (median time per call; "
            "busbw = algbw * 2(n-1)/n)",
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
            "(bandwidths in GB/s; shm: the caller's tensor, copied in and out; lent: a buffer "
            "from ShmComm.buffer, summed in place, as the engine's buckets are; mc: memcpy)"
        )
    return "\n".join(lines)


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
    for key, label, style in (
        ("memcpy_gbps", "memcpy, 1 thread", ":"),
        ("shm_lent_busbw_gbps", "towers shm, lent buffer (busbw)", "-"),
        ("shm_busbw_gbps", "towers shm, own tensor (busbw)", "-."),
        ("gloo_busbw_gbps", "Gloo (busbw)", "--"),
    ):
        if all(key in row for row in sweep):
            bw.plot(sizes, [row[key] for row in sweep], style, marker="o", label=label)
    for key, label, style in (
        ("shm_lent_us", "towers shm, lent buffer", "-"),
        ("shm_us", "towers shm, own tensor", "-."),
        ("gloo_us", "Gloo", "--"),
    ):
        if all(key in row for row in sweep):
            lat.plot(sizes, [row[key] for row in sweep], style, marker="o", label=label)
    n = results["config"]["workers"]
    for ax, ylabel in ((bw, "GB/s"), (lat, "microseconds per all-reduce")):
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
