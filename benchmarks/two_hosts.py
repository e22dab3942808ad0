"""Two hosts joined by a slow link: DDP against towers, side by side, in one run.

    sudo .venv/bin/python benchmarks/two_hosts.py --rate 100mbit --repeats 3 --out two-hosts
    sudo .venv/bin/python benchmarks/two_hosts.py --problem gpt --utilisation --repeats 1

Builds two hosts on this machine (network namespaces with their own host names and /dev/shm,
joined by a veth pair shaped to ``--rate`` by a token bucket: ``benchmarks/namespaces.py``;
they are removed at the end, and also if this process is killed) and trains the same problem in
every arm, each a ``torchrun --nnodes 2`` job (``benchmarks/two_hosts_worker.py``), with
the held-out loss every ``--eval-every`` global batches. ``--problem``: ``mlp`` (the default),
the 784-1024-1024-10 MLP on the digits upscaled to 28x28, global batch 256, SGD; or ``gpt``,
a character-level GPT of 0.81 M parameters on the standard library's source text, global
batches of 32 sequences of 64 characters, AdamW. Each repeat runs every arm once, in a rotated
order; the report gives medians over the repeats and the load average as each repeat started.
``--rate none`` leaves the link unshaped (the veth pair at the kernel's speed).

For each arm:

- ``ms/step``: milliseconds per global batch after the first ``--warmup`` ones;
- ``MB/step``: bytes through the link (both directions) per global batch after the warm-up,
  counted at rank 0's end of the link after every global batch; ``MB/run``: all the bytes of
  the run (start-up, evaluations and the end included) divided by the global batches;
- ``x fewer``: plain DDP's MB/step over the arm's;
- ``final``: the held-out loss after ``--steps`` global batches (at equal samples, or tokens,
  in every arm, also in those that run longer);
- ``to DDP's``: seconds from the start of training until the held-out loss first came within
  0.1% of plain DDP's final held-out loss (the median over the repeats; 0.1% so that a run
  equal to DDP's up to rounding counts), and that time over the best working DDP arm's (arms
  named ``lightning ...`` train on the order of Lightning's sampler: they are held to the
  ``lightning ddp`` arm's final loss and time instead);
- ``util`` (with ``--utilisation``, which runs every arm a second time, right after the first,
  on a second pair of hosts whose link is not shaped): the arm's ms/step unshaped over its
  ms/step on the shaped link, the median of that ratio over the repeats: how much of a step
  on the slow link is the step's own work (100%: the slow link adds no time; a little above
  100% is the noise of a shared machine).

An arm is a dict in :data:`ARMS`: ``name``, ``per_host`` (workers on each host), and either
``train`` (``towers.train``'s keywords over the problem), ``ddp`` or ``lightning`` (see the
worker's doc);
``longer: F`` trains F times ``--steps`` global batches, so that an arm whose steps make less
progress than exact SGD's (low-rank or local steps) shows when it reaches DDP's loss;
``by_default``: the problems that run it unless ``--arms`` names others (``["mlp"]`` when
absent). Add an arm there, or name a subset with ``--arms``. Arms that fail are reported with
their error.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
from contextlib import nullcontext
from pathlib import Path
from typing import Any

from namespaces import Hosts

WORKER = Path(__file__).with_name("two_hosts_worker.py")

BOTH = ["mlp", "gpt"]
ARMS: list[dict[str, Any]] = [
    {"name": "ddp", "per_host": 1, "ddp": "plain", "by_default": BOTH},
    {"name": "ddp powerSGD_hook:4", "per_host": 1, "ddp": "powersgd:4", "longer": 2,
     "by_default": BOTH},
    {"name": "ddp powerSGD_hook:4 1 bucket", "per_host": 1, "ddp": "powersgd-1bucket:4",
     "longer": 2},
    {"name": "ddp post-local SGD:4", "per_host": 1, "ddp": "postlocal:4", "longer": 2},
    {"name": "towers sync", "per_host": 1, "train": {}, "by_default": BOTH},
    {"name": "towers shard_optimizer", "per_host": 1, "train": {"shard_optimizer": True}},
    {"name": "ddp ZeroRedundancyOptimizer", "per_host": 1, "ddp": "zero"},
    {"name": "towers.ddp ZeroRedundancyOptimizer", "per_host": 1, "ddp": "ported-zero"},
    {"name": "towers bf16", "per_host": 1, "train": {"compress": "bf16"}},
    {"name": "towers fp16", "per_host": 1, "train": {"compress": "fp16"}},
    {"name": "towers int8", "per_host": 1, "train": {"compress": "int8"}, "by_default": BOTH},
    {"name": "towers powersgd:4", "per_host": 1, "train": {"compress": "powersgd:4"},
     "longer": 2, "by_default": BOTH},
    {"name": "towers 2/host flat gloo", "per_host": 2, "train": {"transport": "gloo"}},
    {"name": "towers 2/host", "per_host": 2, "train": {}},
    {"name": "towers 2/host int8", "per_host": 2, "train": {"compress": "int8"}},
    {"name": "towers 2/host flat int8", "per_host": 2,
     "train": {"compress": "int8", "transport": "gloo"}},
    {"name": "towers 2/host powersgd:4", "per_host": 2, "train": {"compress": "powersgd:4"},
     "longer": 2},
    {"name": "towers diloco:8", "per_host": 1, "train": {"mode": "diloco:8"}, "longer": 3},
    {"name": "towers diloco:8 int8", "per_host": 1,
     "train": {"mode": "diloco:8", "compress": "int8"}, "longer": 3},
    {"name": "towers diloco:8 shard_optimizer", "per_host": 1,
     "train": {"mode": "diloco:8", "shard_optimizer": True}, "longer": 3},
    {"name": "towers diloco:8:overlap", "per_host": 1, "train": {"mode": "diloco:8:overlap"},
     "longer": 3},
    {"name": "towers diloco:8:overlap int8", "per_host": 1,
     "train": {"mode": "diloco:8:overlap", "compress": "int8"}, "longer": 3},
    {"name": "towers topk:0.1", "per_host": 1, "train": {"compress": "topk:0.1"},
     "by_default": ["gpt"]},
    {"name": "towers diloco:16 int8", "per_host": 1,
     "train": {"mode": "diloco:16", "compress": "int8"}, "longer": 3, "by_default": ["gpt"]},
    {"name": "towers diloco:16:overlap int8", "per_host": 1,
     "train": {"mode": "diloco:16:overlap", "compress": "int8"}, "longer": 3,
     "by_default": ["gpt"]},
    {"name": "towers sparseloco:16", "per_host": 1, "train": {"mode": "sparseloco:16"},
     "longer": 3, "by_default": ["gpt"]},
    {"name": "lightning ddp", "per_host": 1, "lightning": "ddp"},
    {"name": "lightning towers", "per_host": 1, "lightning": {}},
    {"name": "lightning towers diloco:16 int8", "per_host": 1,
     "lightning": {"mode": "diloco:16", "compress": "int8"}, "longer": 3},
]  # fmt: skip
BATCHES = {"mlp": "global batches of 256",
           "gpt": "global batches of 32 sequences of 64 characters"}  # fmt: skip


def _error(log: str) -> str:
    """The line of a failed run's log that says why."""
    for pattern in (r"what\(\):\s*(.*)", r"(\w+Error: .*)", r"(\w+Exception: .*)"):
        found = re.findall(pattern, log)
        if found:
            return found[0].strip()[:400]
    lines = [line for line in log.splitlines() if line.strip()]
    return lines[-1][:400] if lines else "no output"


def run_arm(hosts: list[Any], arm: dict[str, Any], args: argparse.Namespace, port: int) -> dict:
    """Run ``arm`` once on the two hosts; its record, or ``{"error": ...}``."""
    with tempfile.TemporaryDirectory(prefix="two-hosts-") as scratch:
        out = Path(scratch) / "record.json"
        steps = int(args.steps * arm.get("longer", 1))
        spec = json.dumps({**arm, "steps": steps, "eval_every": args.eval_every,
                           "problem": args.problem})  # fmt: skip
        drop = ("GLOO_", "MASTER_", "TOWERS_")
        env = {k: v for k, v in os.environ.items() if not k.startswith(drop)}
        env |= {"OMP_NUM_THREADS": "1"}
        before = [h.link_bytes()[0] for h in hosts]
        nodes = []
        for rank, host in enumerate(hosts):
            cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node-rank",
                   str(rank), "--nproc-per-node", str(arm["per_host"]), "--master-addr",
                   hosts[0].addr, "--master-port", str(port), str(WORKER), spec, str(out),
                   host.link]  # fmt: skip
            nodes.append(host.popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT))
        logs = []
        for node in nodes:
            try:
                logs.append(node.communicate(timeout=args.timeout)[0])
            except subprocess.TimeoutExpired:
                os.killpg(node.pid, 9)
                logs.append(node.communicate()[0] + f"\nTimeoutError: more than {args.timeout} s")
        sent = sum(h.link_bytes()[0] - b for h, b in zip(hosts, before, strict=True))
        record = json.loads(out.read_text()) if out.exists() else {}
        if "error" in record or any(n.returncode for n in nodes) or not record:
            return {"error": record.get("error") or _error("\n".join(logs))}
        return {**record, "sent": sent}


def summarize(record: dict, args: argparse.Namespace, target: float | None) -> dict[str, Any]:
    """One run's figures (see the module doc)."""
    if "error" in record:
        return {"error": record["error"]}
    times, counts, w = record["times"], record["bytes"], args.warmup
    s = len(times)
    out = {
        "steps": s,
        "ms_per_step": 1e3 * (times[s - 1] - times[w - 1]) / (s - w),
        "mb_per_step": (counts[s - 1] - counts[w - 1]) / (s - w) / 1e6 if counts else None,
        "mb_per_run_step": record["sent"] / s / 1e6,
        "final": dict(record["evals"])[args.steps],
        "to_target": None,
        "evals": record["evals"],  # (global batches done, held-out loss), the whole curve
    }
    if target is not None:
        reached = [k for k, loss in record["evals"] if loss <= target * 1.001]
        out["to_target"] = times[reached[0] - 1] if reached else None
    return out


def _median(values: list[Any]) -> Any:
    numbers = [v for v in values if isinstance(v, (int, float))]
    return statistics.median(numbers) if numbers else None


def _utilisation(shaped: list[dict], unshaped: list[dict], args: argparse.Namespace) -> Any:
    """The median over the repeats of unshaped ms/step over shaped ms/step, paired per repeat."""
    pairs = [(summarize(a, args, None), summarize(b, args, None))
             for a, b in zip(shaped, unshaped, strict=True)]  # fmt: skip
    return _median([b["ms_per_step"] / a["ms_per_step"] for a, b in pairs
                    if "error" not in a and "error" not in b])  # fmt: skip


def _final(raw: dict[str, list[dict]], name: str, args: argparse.Namespace) -> float | None:
    """The median final held-out loss of arm ``name``'s working runs, if it ran."""
    finals = [dict(r["evals"])[args.steps] for r in raw.get(name, []) if "error" not in r]
    return statistics.median(finals) if finals else None


def report(
    raw: dict[str, list[dict]], args: argparse.Namespace, loads: list[float],
    unshaped: dict[str, list[dict]] | None = None,
) -> dict:  # fmt: skip
    target = _final(raw, "ddp", args)
    # Lightning's arms train on its sampler's order: they are held to Lightning's ddp
    lightning = _final(raw, "lightning ddp", args)
    rows = {}
    for name, records in raw.items():
        goal = lightning if name.startswith("lightning") and lightning is not None else target
        runs = [summarize(r, args, goal) for r in records]
        ok = [r for r in runs if "error" not in r]
        row: dict[str, Any] = {"runs": runs, "failed": len(runs) - len(ok)}
        if not ok:
            row["error"] = runs[0]["error"]
        for key in ("steps", "ms_per_step", "mb_per_step", "mb_per_run_step", "final", "to_target"):
            row[key] = _median([r.get(key) for r in ok])
        if unshaped is not None:
            runs_fast = [summarize(r, args, None) for r in unshaped[name]]
            row["unshaped_runs"] = runs_fast
            row["unshaped_ms_per_step"] = _median([r.get("ms_per_step") for r in runs_fast])
            row["utilisation"] = _utilisation(records, unshaped[name], args)
        rows[name] = row
    working = [r["to_target"] for n, r in rows.items() if n.startswith("ddp") and r["to_target"]]
    best = min(working) if working else None
    own = rows.get("lightning ddp", {}).get("to_target")
    ddp_mb = rows["ddp"]["mb_per_step"] if "ddp" in rows else None
    for name, row in rows.items():
        base = own if name.startswith("lightning") and own else best
        row["vs_best_ddp"] = row["to_target"] / base if base and row["to_target"] else None
        mb = row.get("mb_per_step")
        row["fewer_bytes"] = ddp_mb / mb if ddp_mb and mb else None
    return {"target": target, "lightning_target": lightning, "best_ddp_seconds": best,
            "loads": loads, "rows": rows, "config": vars(args)}  # fmt: skip


def table(result: dict) -> str:
    target = result["target"]
    util = any("utilisation" in r for r in result["rows"].values())
    head = (f"{'arm':<30}{'steps':>6}{'ms/step':>9}{'MB/step':>9}{'x fewer':>8}{'MB/run':>8}"
            f"{'final':>8}{'to ' + (f'{target:.3f}' if target else '?'):>10}{'x best DDP':>11}"
            + (f"{'unshaped':>9}{'util':>6}" if util else ""))  # fmt: skip
    lines = [head, "-" * len(head)]

    def num(v: Any, fmt: str) -> str:
        return "-" if v is None else format(v, fmt)

    def percent(v: Any) -> str:
        return "-" if v is None else f"{100 * v:.0f}%"

    for name, r in result["rows"].items():
        if "error" in r:
            lines.append(f"{name:<30}failed: {r['error']}")
            continue
        reach = "never" if r["to_target"] is None else f"{r['to_target']:.1f} s"
        lines.append(
            f"{name:<30}{num(r['steps'], '.0f'):>6}{num(r['ms_per_step'], '.0f'):>9}"
            f"{num(r['mb_per_step'], '.3f'):>9}{num(r['fewer_bytes'], '.0f'):>8}"
            f"{num(r['mb_per_run_step'], '.2f'):>8}{num(r['final'], '.3f'):>8}{reach:>10}"
            f"{num(r['vs_best_ddp'], '.2f'):>11}"
            + (f"{num(r['unshaped_ms_per_step'], '.0f'):>9}{percent(r['utilisation']):>6}"
               if util else "")
            + (f"  ({r['failed']} of the runs failed)" if r["failed"] else "")
        )  # fmt: skip
    if result.get("lightning_target") is not None:
        lines.append(f"\nlightning arms: to lightning ddp's final {result['lightning_target']:.3f}"
                     ", and x lightning ddp's time to it")  # fmt: skip
    loads = ", ".join(f"{x:.1f}" for x in result["loads"])
    lines.append(f"\nload average as each repeat started: {loads}")
    return "\n".join(lines)


def _show(name: str, record: dict, args: argparse.Namespace, link: str = "") -> None:
    shown = summarize(record, args, None)
    if "error" in shown:
        print(f"  {name:<30} {link}failed: {shown['error']}", flush=True)
    else:
        print(f"  {name:<30} {link}{shown['ms_per_step']:.0f} ms/step, "
              f"final {shown['final']:.3f}", flush=True)  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--problem", default="mlp", choices=sorted(BATCHES), help="(mlp)")
    parser.add_argument("--rate", default="100mbit",
                        help="the link's rate, tc units, or none: unshaped (100mbit)")  # fmt: skip
    parser.add_argument("--utilisation", action="store_true",
                        help="run every arm also on an unshaped link: the util column")  # fmt: skip
    parser.add_argument("--steps", type=int, default=100, help="global batches per run (100)")
    parser.add_argument("--warmup", type=int, default=20, help="not in ms/step and MB/step (20)")
    parser.add_argument("--eval-every", type=int, default=5, help="held-out loss every (5)")
    parser.add_argument("--repeats", type=int, default=3, help="interleaved repeats (3)")
    parser.add_argument("--arms", default=None, help="comma-separated arm names (the problem's)")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds per run (900)")
    parser.add_argument("--out", default="two-hosts", help="output directory (two-hosts)")
    args = parser.parse_args(argv)
    arms = [a for a in ARMS if args.problem in a.get("by_default", ["mlp"])]
    if args.arms:
        wanted = [a.strip() for a in args.arms.split(",")]
        unknown = set(wanted) - {a["name"] for a in ARMS}
        if unknown:
            parser.error(f"unknown arms {sorted(unknown)}; known: {[a['name'] for a in ARMS]}")
        arms = [a for a in ARMS if a["name"] in wanted]
    if not 0 < args.warmup < args.steps:
        parser.error("--warmup must be between 0 and --steps")
    if args.steps % args.eval_every:
        parser.error("--steps must be a multiple of --eval-every (the final loss is evaluated)")
    rate = None if args.rate.lower() == "none" else args.rate
    if args.utilisation and rate is None:
        parser.error("--utilisation compares with a shaped link: give --rate, not none")
    raw: dict[str, list[dict]] = {a["name"]: [] for a in arms}
    fast: dict[str, list[dict]] = {a["name"]: [] for a in arms}
    loads, port = [], 29600
    second = Hosts(None) if args.utilisation else nullcontext()
    with Hosts(rate) as hosts, second as unshaped:
        for rep in range(args.repeats):
            loads.append(os.getloadavg()[0])
            print(f"repeat {rep + 1}/{args.repeats}, load average {loads[-1]:.1f}", flush=True)
            for arm in arms[rep % len(arms) :] + arms[: rep % len(arms)]:
                port += 1
                raw[arm["name"]].append(run_arm(hosts, arm, args, port))
                _show(arm["name"], raw[arm["name"]][-1], args)
                if unshaped:
                    port += 1
                    fast[arm["name"]].append(run_arm(unshaped, arm, args, port))
                    _show(arm["name"], fast[arm["name"]][-1], args, "unshaped: ")
    result = report(raw, args, loads, fast if args.utilisation else None)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "two_hosts.json").write_text(json.dumps(result, indent=1))
    text = (f"{args.problem}, rate {args.rate}, {BATCHES[args.problem]}, final held-out loss "
            f"after {args.steps}, medians of {args.repeats} runs\n\n")  # fmt: skip
    text += table(result)
    (out / "two_hosts.txt").write_text(text + "\n")
    print("\n" + text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
