"""The one command that checks towers on a CUDA GPU: the GPU tests, then one GPU's overhead.

It prints the environment, runs ``pytest -m gpu tests/test_gpu.py``, then trains a GPT-style
decoder (29.5 M parameters, bf16 autocast, fused AdamW, 128 sequences of 256 synthetic tokens
a step: on an H100 the GPU bounds that step, with 32 the host's kernel launches do) from the
same weights on the same batches in three arms, alternated in rounds: ``plain``
(a PyTorch loop that reads ``loss.item()`` every step), ``train`` (``towers.train(...,
workers=1, device="cuda")``) and ``loop`` (``towers.init(device="cuda")``, ``ctx.replicate``,
``ctx.shards``, ``ctx.backward``, the loop's own ``opt.step()``). A step ends when its loss is
read (``loss.item()``, ``r.loss``, ``TrainResult.times``), which waits for the GPU; ms/step is
the median time between consecutive steps' ends after a warm-up. The target: at most 3% over
``plain``. An arm that misses it (or ``--profile``) adds torch.profiler tables of 10 of its
steps and of ``plain``'s to the report. After the rounds, one run each of ``train`` with
``compress="int8"`` and with ``mode="diloco:16"`` (their cost against ``plain``; their losses
shown, not checked: both change the arithmetic), of ``train`` with ``shard_optimizer=True``
(the sharded step's path on the device, held to ``plain``'s losses) and of ``diloco:16`` with
its outer state sharded (held to ``diloco:16``'s), and of a float16 ``GradScaler`` loop, plain
and the own loop (``ctx.backward(loss, scaler=...)``), the latter held to the same target and
loss agreement against the former. With two GPUs (on the CPU smoke run, two CPU towers), two
more: ``train`` on two towers with the second device shared with a busy process, the even
split against ``balance=True`` (both held to ``plain``'s losses; their times compared with
each other's); on one GPU the report says they need two (NCCL refuses two ranks on one GPU).

Run it from the repository root (the checkout's ``src`` is used, installed or not)::

    python benchmarks/gpu_check.py                  # about two minutes on one H100
    python benchmarks/gpu_check.py --batch 32       # the launch-bound case
    python benchmarks/gpu_check.py --quick          # one round of few steps
    python benchmarks/gpu_check.py --device cpu --quick --skip-tests   # the CPU smoke run

It writes ``gpu-check/gpu_check.md`` and ``gpu_check.json`` (``--out DIR``), prints the
markdown, and exits 1 if the tests fail, an arm fails or the arms' losses disagree; a missed
speed target is reported, not failed.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import datetime
import functools
import gc
import json
import os
import re
import shlex
import statistics
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))  # this checkout's towers, installed or not
import towers  # noqa: E402

TARGET = 0.03  # the most an arm may add to the plain loop's time per step
TOLERANCE = 2e-2  # relative, first and last losses: bf16 autocast, not bitwise
PROFILE_STEPS = 10


@dataclasses.dataclass(frozen=True)
class Size:
    vocab: int
    block: int
    layers: int
    heads: int
    width: int
    batch: int  # sequences per global batch


GPU_SIZE = Size(vocab=8192, block=256, layers=8, heads=8, width=512, batch=128)
SMOKE_SIZE = Size(vocab=256, block=32, layers=2, heads=4, width=64, batch=8)


@dataclasses.dataclass(frozen=True)
class Plan:
    device: torch.device
    size: Size
    steps: int
    warmup: int
    rounds: int


@dataclasses.dataclass
class Run:
    losses: list[float]
    ends: list[float]  # perf_counter at the start, then at the end of every step
    peak_bytes: int | None = None
    queued_ms: list[float] = dataclasses.field(default_factory=list)  # plain: the CPU side

    def step_ms(self, warmup: int) -> list[float]:
        return [(b - a) * 1e3 for a, b in zip(self.ends, self.ends[1:])][warmup:]


class Block(nn.Module):
    def __init__(self, width: int, heads: int):
        super().__init__()
        self.heads = heads
        self.ln_1, self.ln_2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.qkv = nn.Linear(width, 3 * width, bias=False)
        self.proj = nn.Linear(width, width, bias=False)
        self.mlp = nn.Sequential(
            nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(self.ln_1(x)).split(c, dim=2)
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, c))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """A decoder-only transformer, nanoGPT's shape, with tied input and output embeddings."""

    def __init__(self, s: Size):
        super().__init__()
        self.tok, self.pos = nn.Embedding(s.vocab, s.width), nn.Embedding(s.block, s.width)
        self.blocks = nn.Sequential(*[Block(s.width, s.heads) for _ in range(s.layers)])
        self.ln_f = nn.LayerNorm(s.width)
        self.head = nn.Linear(s.width, s.vocab, bias=False)
        self.head.weight = self.tok.weight
        for m in self.modules():
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, std=0.02)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        return self.head(self.ln_f(self.blocks(x)))


def loss_fn(
    model: nn.Module, shard: tuple[torch.Tensor], dtype: torch.dtype = torch.bfloat16
) -> torch.Tensor:
    """Next-token cross-entropy over a shard of token rows, under ``dtype`` autocast on CUDA."""
    (t,) = shard
    with torch.autocast(t.device.type, dtype=dtype, enabled=t.is_cuda):
        logits = model(t[:, :-1])
        return F.cross_entropy(logits.flatten(0, 1), t[:, 1:].reshape(-1))


def optimizer(device: torch.device) -> Callable[..., torch.optim.Optimizer]:
    return functools.partial(torch.optim.AdamW, lr=3e-4, fused=device.type == "cuda")


def batch(tokens: torch.Tensor, k: int, b: int) -> torch.Tensor:
    return tokens[k * b : (k + 1) * b]


def grad_scaler(device: torch.device, fp16: bool) -> torch.amp.GradScaler | None:
    """float16's scaler (``None`` for bf16), from a scale low enough that neither loop skips its
    first steps for an overflow (towers' scaled gradients are the shard's samples times one
    process's)."""
    return torch.amp.GradScaler(device.type, init_scale=2.0**8) if fp16 else None


def run_plain(plan: Plan, model0: nn.Module, tokens: torch.Tensor, fp16: bool = False) -> Run:
    """The plain loop; ``fp16``: under float16 autocast with a ``GradScaler``."""
    model = copy.deepcopy(model0).to(plan.device)
    opt, scaler = optimizer(plan.device)(model.parameters()), grad_scaler(plan.device, fp16)
    dtype = torch.float16 if fp16 else torch.bfloat16
    run = Run([], [time.perf_counter()])
    for k in range(plan.steps):
        start = time.perf_counter()
        loss = loss_fn(model, (batch(tokens, k, plan.size.batch).to(plan.device),), dtype)
        if scaler is None:
            loss.backward()
            opt.step()
        else:
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
        opt.zero_grad(set_to_none=True)
        run.queued_ms.append((time.perf_counter() - start) * 1e3)  # the step's kernels queued
        run.losses.append(loss.item())
        run.ends.append(time.perf_counter())
    return run


def run_train(
    plan: Plan, model0: nn.Module, tokens: torch.Tensor, workers: int = 1, **options: Any
) -> Run:
    result = towers.train(
        copy.deepcopy(model0),
        loss_fn,
        (tokens,),
        batch_size=plan.size.batch,
        steps=plan.steps,
        workers=workers,
        device=plan.device.type,
        optimizer=optimizer(plan.device),
        shuffle=False,
        progress=False,
        **options,
    )
    return Run(list(result.losses), [0.0, *result.times])  # times: from the loop's start


def run_loop(plan: Plan, model0: nn.Module, tokens: torch.Tensor, fp16: bool = False) -> Run:
    """The own loop; ``fp16``: under float16 autocast, the scaler passed to ``ctx.backward``."""
    ctx = towers.init(device=plan.device.type)
    model = ctx.replicate(copy.deepcopy(model0))
    opt, scaler = optimizer(plan.device)(model.parameters()), grad_scaler(plan.device, fp16)
    dtype = torch.float16 if fp16 else torch.bfloat16
    batches = ((batch(tokens, k, plan.size.batch),) for k in range(plan.steps))
    run = Run([], [time.perf_counter()])
    for shard in ctx.shards(batches):
        r = ctx.backward(loss_fn(model, shard, dtype), scaler=scaler)
        if scaler is None:
            opt.step()
        else:
            scaler.step(opt)
            scaler.update()
        opt.zero_grad(set_to_none=True)
        run.losses.append(r.loss)
        run.ends.append(time.perf_counter())
    ctx.close()
    return run


# A process busy on the second device for as long as a run of two towers lasts: GPU 1, or on a
# CPU (the smoke run) the cores the towers share.
BUSY = {
    "cuda": "import torch\nx = torch.randn(8192, 8192, device='cuda')\n"
    "while True:\n    x = torch.nn.functional.normalize(x @ x)",
    "cpu": "while True:\n    pass",
}


def run_shared(plan: Plan, model0: nn.Module, tokens: torch.Tensor, balance: bool) -> Run:
    """``train`` on two devices, the second shared with a busy process: the even split waits
    for it every step, the balanced one gives it fewer samples."""
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "1"} if plan.device.type == "cuda" else None
    busy = subprocess.Popen([sys.executable, "-c", BUSY[plan.device.type]], env=env)
    try:
        return run_train(plan, model0, tokens, workers=2, balance=balance)
    finally:
        busy.kill()
        busy.wait()


def two_devices(device: torch.device) -> bool:
    """Whether two towers can run: NCCL refuses two ranks on one GPU."""
    return device.type == "cpu" or torch.cuda.device_count() >= 2


ARMS = {"plain": run_plain, "train": run_train, "loop": run_loop}


# Options, one run each after the rounds: (arm, its reference, whether it must agree with it,
# whether its time is held to the target). int8 compression and DiLoCo change the arithmetic,
# so their losses are shown, not checked; two towers (a second GPU busy) are not one GPU's
# cost, so their times are compared with each other's, not held to the target.
OPTIONS: dict[str, tuple[Callable[..., Run], str, bool, bool]] = {
    "train int8": (functools.partial(run_train, compress="int8"), "plain", False, False),
    "train diloco:16": (functools.partial(run_train, mode="diloco:16"), "plain", False, False),
    "plain fp16": (functools.partial(run_plain, fp16=True), "plain", False, False),
    "loop fp16": (functools.partial(run_loop, fp16=True), "plain fp16", True, True),
    "train sharded": (functools.partial(run_train, shard_optimizer=True), "plain", True, False),
    "train diloco:16 sharded": (
        functools.partial(run_train, mode="diloco:16", shard_optimizer=True),
        "train diloco:16",
        True,
        False,
    ),
    "train 2 even": (functools.partial(run_shared, balance=False), "plain", True, False),
    "train 2 balanced": (functools.partial(run_shared, balance=True), "plain", True, False),
}
SHARED = ("train 2 even", "train 2 balanced")
ARMS.update({name: arm for name, (arm, _, _, _) in OPTIONS.items()})


def measured(arm: str, plan: Plan, model0: nn.Module, tokens: torch.Tensor) -> Run:
    """One run of ``arm``, with the peak GPU memory it allocated."""
    cuda = plan.device.type == "cuda"
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        torch.cuda.synchronize()
    run = ARMS[arm](plan, model0, tokens)
    if cuda:
        torch.cuda.synchronize()
        run.peak_bytes = torch.cuda.max_memory_allocated()
    return run


def run_rounds(
    plan: Plan, model0: nn.Module, tokens: torch.Tensor
) -> tuple[dict[str, list[Run]], dict[str, str]]:
    """Every arm once a round, the order rotated each round; an arm that fails is dropped.
    Then each of :data:`OPTIONS` once (its ratio is to the last round's plain)."""
    names = [a for a in ARMS if a not in OPTIONS]
    options = [a for a in OPTIONS if a not in SHARED or two_devices(plan.device)]
    runs: dict[str, list[Run]] = {a: [] for a in [*names, *options]}
    errors: dict[str, str] = {}
    rounds = [names[r % len(names) :] + names[: r % len(names)] for r in range(plan.rounds)]
    for r, order in enumerate([*rounds, options]):
        for arm in order:
            if arm in errors:
                continue
            try:
                run = measured(arm, plan, model0, tokens)
            except Exception:
                errors[arm] = traceback.format_exc()
                print(f"round {r + 1} {arm}: FAILED\n{errors[arm]}", flush=True)
                continue
            runs[arm].append(run)
            ms = statistics.median(run.step_ms(plan.warmup))
            print(f"round {r + 1} {arm:<15} {ms:9.2f} ms/step", flush=True)
    return runs, errors


def summarise(plan: Plan, runs: dict[str, list[Run]]) -> dict[str, dict[str, Any]]:
    """Per arm: ms/step (each round's median; their median, min, max), ratio to plain, memory."""
    medians = {a: [statistics.median(r.step_ms(plan.warmup)) for r in rs] for a, rs in runs.items()}
    out: dict[str, dict[str, Any]] = {}
    for arm, ms in medians.items():
        if not ms:
            continue
        reference, judged = (
            (OPTIONS[arm][1], OPTIONS[arm][3]) if arm in OPTIONS else ("plain", arm != "plain")
        )
        plain = medians[reference][-1:] if arm in OPTIONS else medians[reference]
        pairs = list(zip(ms, plain))
        ratio = statistics.median(a / b for a, b in pairs) if pairs else None
        peaks = [r.peak_bytes for r in runs[arm] if r.peak_bytes is not None]
        out[arm] = {
            "ms_per_step": statistics.median(ms),
            "ms_min": min(ms),
            "ms_max": max(ms),
            "rounds_ms": ms,
            "ratio_to_plain": ratio,  # the median of the per-round ratios
            "overhead_pct": None if ratio is None else (ratio - 1) * 100,
            "meets_target": None if ratio is None or not judged else ratio <= 1 + TARGET,
            "peak_mib": max(peaks) / 2**20 if peaks else None,
            "losses": runs[arm][0].losses,  # the first round's
            "queued_ms": statistics.median(q) if (q := queued(runs[arm], plan.warmup)) else None,
        }
    return out


def queued(runs: list[Run], warmup: int) -> list[float]:
    return [statistics.median(r.queued_ms[warmup:]) for r in runs if r.queued_ms]


def agreement(runs: dict[str, list[Run]]) -> dict[str, Any]:
    """Whether train's and loop's losses match plain's (first round), and each option's its
    reference's where it must: first, last, and the max. The other options' are shown."""
    out: dict[str, Any] = {"tolerance": TOLERANCE, "max_rel_diff": {}, "ok": True}
    checked = {"train": ("plain", True), "loop": ("plain", True)}
    checked |= {arm: (ref, must) for arm, (_, ref, must, _) in OPTIONS.items()}
    for arm, (reference, must) in checked.items():
        if arm not in runs:  # not run here (two towers on one GPU)
            continue
        ref = runs[reference][0].losses if runs[reference] else []
        losses = runs[arm][0].losses if runs[arm] else []
        if not ref or len(losses) != len(ref):
            out["ok"] &= not must
            out["max_rel_diff"][arm] = None
            continue
        rel = [abs(a - b) / max(abs(b), 1e-12) for a, b in zip(losses, ref)]
        finite = all(x == x and abs(x) != float("inf") for x in rel)
        out["max_rel_diff"][arm] = max(rel) if finite else None
        if must:
            out["ok"] &= finite and rel[0] <= TOLERANCE and rel[-1] <= TOLERANCE
    return out


def profile(plan: Plan, arm: str, model0: nn.Module, tokens: torch.Tensor) -> dict[str, str]:
    """torch.profiler tables of ``PROFILE_STEPS`` steps of ``arm`` (train: its start-up too)."""
    from torch.profiler import ProfilerActivity

    cuda = plan.device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    short = dataclasses.replace(plan, steps=PROFILE_STEPS)
    with torch.profiler.profile(activities=activities) as prof:
        measured(arm, short, model0, tokens)
    table = functools.partial(prof.key_averages().table, row_limit=25, max_name_column_width=90)
    first = "self_cuda_time_total" if cuda else "self_cpu_time_total"
    return {f"sorted by {k}": table(sort_by=k) for k in (first, "cpu_time_total")}


def quiet(cmd: list[str]) -> str | None:
    """A command's stripped output, or None if it is missing or fails."""
    try:
        out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def environment(device: torch.device) -> dict[str, Any]:
    commit = quiet(["git", "rev-parse", "HEAD"])
    if commit and quiet(["git", "status", "--porcelain", "--untracked-files=no"]):
        commit += " (with uncommitted changes)"
    cuda = torch.cuda.is_available()
    count = torch.cuda.device_count() if cuda else 0
    smi = ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"]
    return {
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version() if cuda else None,
        "gpu_count": count,
        "gpus": [torch.cuda.get_device_name(i) for i in range(count)],
        "driver": quiet(smi) if cuda else None,
        "towers": str(Path(towers.__file__).parent),
        "commit": commit,
        "device": str(device),
        "cpus": os.cpu_count(),
    }


def run_tests(timeout: float = 300) -> dict[str, Any]:
    """``pytest -m gpu tests/test_gpu.py``: counts, and the tail of its output."""
    cmd = [sys.executable, "-m", "pytest", "-m", "gpu", "tests/test_gpu.py", "-v"]
    cmd += ["-p", "no:cacheprovider"]
    paths = [str(ROOT / "src"), *filter(None, [os.environ.get("PYTHONPATH")])]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(paths)}
    print(f"running {shlex.join(cmd[1:])} (timeout {timeout:.0f} s)", flush=True)
    try:
        out = subprocess.run(
            cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout
        )
        code, text = out.returncode, out.stdout + out.stderr
    except subprocess.TimeoutExpired as exc:
        partial = exc.stdout or b""
        text = (partial.decode() if isinstance(partial, bytes) else partial) + "\nTIMED OUT"
        code = None
    lines = text.rstrip().splitlines()
    summary = next((x for x in reversed(lines) if re.search(r" in [\d.]+s", x)), "")
    counts = {k.rstrip("s"): int(n) for n, k in re.findall(r"(\d+) ([a-z]+)", summary)}
    return {
        "command": shlex.join(["python", *cmd[1:]]),
        "returncode": code,
        "counts": counts,
        # All skipped (CUDA not seen) or none collected is not a pass.
        "ok": code == 0 and counts.get("passed", 0) > 0,
        "tail": "\n".join(lines[-60:]),
    }


def _fmt(x: float | None, spec: str) -> str:
    return "n/a" if x is None else format(x, spec)


def arms_table(report: dict[str, Any]) -> list[str]:
    lines = [
        "| arm | ms/step (median) | min | max | x plain | overhead | peak MiB | <= 3% |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | --- |",
    ]
    for arm, s in report["arms"].items():
        verdict = "" if arm == "plain" or s["meets_target"] is None else "PASS"
        verdict = "MISS" if verdict and not s["meets_target"] else verdict
        lines.append(
            f"| {arm} | {s['ms_per_step']:.2f} | {s['ms_min']:.2f} | {s['ms_max']:.2f} "
            f"| {_fmt(s['ratio_to_plain'], '.3f')} | {_fmt(s['overhead_pct'], '+.1f')}% "
            f"| {_fmt(s['peak_mib'], '.0f')} | {verdict} |"
        )
    return lines


def shared_lines(report: dict[str, Any]) -> list[str]:
    """The balanced split against the even one, two towers beside a busy process."""
    arms = report["arms"]
    if not any(a in arms for a in SHARED):
        return [
            "- two towers with the second device busy (balance=True against the even split): "
            "not run, one GPU here (NCCL refuses two ranks on one GPU)"
        ]
    even, balanced = (arms.get(a, {}).get("ms_per_step") for a in SHARED)
    where = "GPU 1" if report["plan"]["device"] == "cuda" else "the cores"
    ratio = f" ({balanced / even:.2f}x)" if even and balanced else ""
    return [
        f"- two towers, {where} shared with a busy process: balanced "
        f"{_fmt(balanced, '.2f')} ms/step against even {_fmt(even, '.2f')}{ratio}; both "
        "held to plain's losses"
    ]


def markdown(report: dict[str, Any]) -> str:
    env, tests = report["environment"], report["tests"]
    lines = ["# towers GPU check", "", f"- date: {report['date']}"]
    lines += [f"- command: `{report['command']}` (in {report['cwd']})"]
    lines += [f"- load average (1, 5, 15 min): {report['loadavg']}", "", "## Environment", ""]
    lines += [f"- {k}: {v}" for k, v in env.items()]
    lines += ["", "## GPU tests", ""]
    if tests is None:
        lines.append("skipped (--skip-tests)")
    else:
        verdict = "ok" if tests["ok"] else "FAILED"
        lines += [f"`{tests['command']}`: {tests['counts']} ({verdict})", "", "```text"]
        lines += [tests["tail"], "```"]
    lines += ["", "## One-GPU overhead", "", report["setup"], ""]
    lines += [*arms_table(report), ""]
    for arm, s in report["arms"].items():
        if arm != "plain" and s["meets_target"] is not None:
            word = "PASS" if s["meets_target"] else "MISS"
            lines.append(f"- {arm}: {word} (target <= 3% overhead): {s['overhead_pct']:+.1f}%")
    lines.append(f"- plain: {_fmt(report['tokens_per_s'], ',.0f')} tokens/s")
    plain = report["arms"].get("plain", {})
    if plain.get("queued_ms") is not None and report["plan"]["device"] == "cuda":
        q, ms = plain["queued_ms"], plain["ms_per_step"]
        bound = "the CPU (launches)" if q >= 0.9 * ms else "the GPU"
        lines.append(
            f"- plain: the CPU queues a step's kernels in {q:.2f} of its {ms:.2f} ms: it is "
            f"bound by {bound}; where the CPU bounds it, every ms towers adds on the CPU counts"
        )
    lines += shared_lines(report)
    a = report["agreement"]
    diffs = ", ".join(f"{k} {_fmt(v, '.2e')}" for k, v in a["max_rel_diff"].items())
    word = "agree" if a["ok"] else "DISAGREE"
    lines.append(
        f"- losses {word} (train's and loop's first and last within relative "
        f"{a['tolerance']:g} of plain's, loop fp16's of plain fp16's; int8 and diloco:16 change "
        "the arithmetic and are shown only;"
    )
    lines.append(f"  max relative difference over all steps: {diffs})")
    for arm, tables in report["profiles"].items():
        for title, text in tables.items():
            lines += ["", f"## Profile: {arm}, {PROFILE_STEPS} steps, {title}", "", "```text"]
            lines += [text, "```"]
    for arm, text in report["errors"].items():
        lines += ["", f"## Error: {arm}", "", "```text", text.rstrip(), "```"]
    lines += ["", f"exit code: {report['exit_code']}", ""]
    return "\n".join(lines)


def parse(argv: list[str] | None) -> tuple[argparse.Namespace, Plan]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default="gpu-check", help="report directory")
    parser.add_argument("--quick", action="store_true", help="one round of few steps")
    parser.add_argument("--device", choices=["cuda", "cpu"], help="default: cuda")
    parser.add_argument("--skip-tests", action="store_true", help="do not run the GPU tests")
    parser.add_argument("--profile", action="store_true", help="profile every arm, even on PASS")
    parser.add_argument("--steps", type=int, help="steps per run (default 50, --quick 8)")
    parser.add_argument("--rounds", type=int, help="rounds of the three arms (default 3)")
    parser.add_argument(
        "--batch",
        type=int,
        help="sequences a step (default 128, where an H100 bounds the step; cpu: 8)",
    )
    args = parser.parse_args(argv)
    if args.device != "cpu" and not torch.cuda.is_available():
        parser.error("no CUDA device; use --device cpu for the smoke run")
    device = torch.device(args.device or "cuda")
    steps = args.steps or (8 if args.quick else 50)
    warmup = 2 if args.quick else 5
    if steps <= warmup + 1:
        parser.error(f"--steps must be more than {warmup + 1} (the warm-up and one more)")
    rounds = args.rounds or (1 if args.quick else 3)
    size = GPU_SIZE if device.type == "cuda" else SMOKE_SIZE
    size = dataclasses.replace(size, batch=args.batch or size.batch)
    return args, Plan(device, size, steps, warmup, rounds)


def measure(plan: Plan, force_profile: bool) -> dict[str, Any]:
    """The three arms: the table's numbers, the agreement, the profiles and the errors."""
    torch.manual_seed(0)
    model0 = GPT(plan.size)
    params = sum(p.numel() for p in model0.parameters())
    s = plan.size
    rows = max(plan.steps, PROFILE_STEPS) * s.batch
    tokens = torch.randint(s.vocab, (rows, s.block + 1), generator=torch.Generator().manual_seed(0))
    setup = (
        f"GPT, {params:,} parameters (vocab {s.vocab}, block {s.block}, {s.layers} layers, "
        f"{s.heads} heads, width {s.width}); {s.batch} sequences a step; AdamW lr 3e-4"
        f"{' fused, bf16 autocast' if plan.device.type == 'cuda' else ', float32'}; "
        f"{plan.steps} steps a run, the first {plan.warmup} not timed; {plan.rounds} round(s), "
        "arms alternated. ms/step: the median over a run's steps of the time between "
        "consecutive losses read; x plain: the median of the per-round ratios."
    )
    print(setup, flush=True)
    runs, errors = run_rounds(plan, model0, tokens)
    arms = summarise(plan, runs)
    # the options are profiled with --profile only
    missed = [a for a, v in arms.items() if v["meets_target"] is False and a not in OPTIONS]
    profiled = list(ARMS) if force_profile else (["plain", *missed] if missed else [])
    plain_ms = arms["plain"]["ms_per_step"] if "plain" in arms else None
    return {
        "model_parameters": params,
        "setup": setup,
        "arms": arms,
        "agreement": agreement(runs),
        "tokens_per_s": plain_ms and s.batch * s.block / (plain_ms / 1e3),
        "profiles": {a: profile(plan, a, model0, tokens) for a in profiled if a not in errors},
        "errors": errors,
    }


def main(argv: list[str] | None = None) -> int:
    args, plan = parse(argv)
    env = environment(plan.device)
    print("\n".join(f"{k}: {v}" for k, v in env.items()), flush=True)
    tests = None if args.skip_tests else run_tests()
    if tests is not None:
        print(tests["tail"], flush=True)
    report: dict[str, Any] = {
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "command": shlex.join([sys.executable, *sys.argv]),
        "cwd": os.getcwd(),
        "environment": env,
        "plan": {**dataclasses.asdict(plan), "device": str(plan.device)},
        "target_overhead": TARGET,
        "tests": tests,
        **measure(plan, args.profile),
        "loadavg": [round(x, 2) for x in os.getloadavg()],
    }
    failed = (tests is not None and not tests["ok"]) or report["errors"]
    report["exit_code"] = 1 if failed or not report["agreement"]["ok"] else 0
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    text = markdown(report)
    (out / "gpu_check.md").write_text(text)
    (out / "gpu_check.json").write_text(json.dumps(report, indent=2) + "\n")
    print(text, flush=True)
    print(f"wrote {out / 'gpu_check.md'} and {out / 'gpu_check.json'}", flush=True)
    return report["exit_code"]


if __name__ == "__main__":
    sys.exit(main())
