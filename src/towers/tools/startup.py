"""How long towers takes to start: ``towers bench --startup``.

Measured in a fresh interpreter (``python -m towers.tools.startup``), so that the first call
pays what a user's first call pays: importing torch and towers (and ``torch._dynamo``, which
building the first optimizer imports), forking the workers, the first rendezvous. Then the same
calls again in the same process, which is what a notebook or a sweep of runs pays for each later
one. For each call:

- ``spawn``: :func:`towers.spawn` of a function that returns at once (2 workers);
- ``train sync``, ``train async``: a one-step :func:`towers.train` of the parabola net, minus
  the training loop itself (``TrainResult.seconds``): process start, rendezvous, transport set-up,
  model copy and shut-down;
- ``towers run``: ``towers run`` of a script that joins the job (``towers.init()``), passes a
  barrier and leaves; each call starts fresh interpreters, as torchrun does.

And the whole of a user's first job, side by side with PyTorch's own way (:func:`first_jobs`):
the wall time of ``python script.py`` that trains a 1-5-1 net for 2 steps on 2 workers, once
with ``towers.train`` and once with ``torch.multiprocessing.spawn`` + DDP over Gloo, in
alternating order, repeated.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from ..api.train import train
from ..processes.launch import run_script
from ..processes.spawn import spawn
from .zoo import Parabola, parabola_data, parabola_loss

__all__ = ["first_job_table", "first_jobs", "in_fresh_process", "measure"]

_SCRIPT = """import towers
ctx = towers.init()
ctx.barrier()
ctx.close()
"""

# The same tiny job, as a user would write it with towers and with mp.spawn + DDP.
_TOWERS_JOB = """import sys
import torch
import towers


def loss_fn(model, shard):
    x, y = shard
    return torch.nn.functional.mse_loss(model(x), y)


if __name__ == "__main__":
    workers, steps = int(sys.argv[1]), int(sys.argv[2])
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(1, 5), torch.nn.Tanh(), torch.nn.Linear(5, 1))
    x = torch.linspace(-2, 2, 50).unsqueeze(1)
    towers.train(model, loss_fn, (x, x**2), batch_size=50, steps=steps, workers=workers,
                 progress=False)
"""

_DDP_JOB = """import gc
import os
import socket
import sys
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.nn.parallel import DistributedDataParallel


def work(rank, workers, steps, port):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), GLOO_SOCKET_IFNAME="lo")
    torch.set_num_threads(max(1, len(os.sched_getaffinity(0)) // workers))
    dist.init_process_group("gloo", rank=rank, world_size=workers)
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(1, 5), torch.nn.Tanh(), torch.nn.Linear(5, 1))
    model = DistributedDataParallel(net)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x = torch.linspace(-2, 2, 50).unsqueeze(1).tensor_split(workers)[rank]
    for _ in range(steps):
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), x**2).backward()
        opt.step()
    # Free the model before the group: a DDP model alive at exit keeps Gloo's threads running
    # into interpreter shutdown, where one of them aborts the process now and then.
    del model, opt
    gc.collect()
    dist.destroy_process_group()


if __name__ == "__main__":
    workers, steps = int(sys.argv[1]), int(sys.argv[2])
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(work, args=(workers, steps, port), nprocs=workers)
"""
FIRST_JOB_ARMS = {"towers": "towers.train", "ddp": "mp.spawn + DDP"}


def _nothing() -> None:
    return None


def measure(workers: int = 2, calls: int = 3) -> dict[str, Any]:
    """Seconds of each start-up, for ``calls`` calls in this process (see the module doc)."""
    out: dict[str, Any] = {"workers": workers}
    runs: dict[str, list[float]] = {"spawn": [], "train sync": [], "train async": []}
    runs["towers run"] = []
    with tempfile.TemporaryDirectory() as tmp:
        script = Path(tmp) / "join.py"
        script.write_text(_SCRIPT)
        for _ in range(calls):
            t = time.perf_counter()
            spawn(_nothing, workers, timeout=120)
            runs["spawn"].append(time.perf_counter() - t)
            for mode in ("sync", "async"):
                t = time.perf_counter()
                result = train(
                    Parabola(),
                    parabola_loss,
                    parabola_data(),
                    batch_size=50,
                    steps=1,
                    workers=workers,
                    mode=mode,
                    progress=False,
                )
                runs[f"train {mode}"].append(time.perf_counter() - t - result.seconds)
            t = time.perf_counter()
            code = run_script(str(script), workers)
            if code != 0:
                raise RuntimeError(f"towers run of a script that only joins failed ({code})")
            runs["towers run"].append(time.perf_counter() - t)
    out["calls"] = runs
    return out


def in_fresh_process(workers: int = 2, calls: int = 3, timeout: float = 600) -> dict[str, Any]:
    """:func:`measure` in a new interpreter, so that its first call is a real first call.

    Also times a new interpreter that only imports towers (``import_s``).
    """
    start = time.perf_counter()
    subprocess.run([sys.executable, "-c", "import towers"], check=True, timeout=timeout)
    import_s = time.perf_counter() - start
    proc = subprocess.run(
        [sys.executable, "-m", "towers.tools.startup", str(workers), str(calls)],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    if proc.returncode != 0:
        tail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        raise RuntimeError(f"the start-up measurement failed: {tail}")
    result: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    return result | {"import_s": import_s}


def table(startup: dict[str, Any]) -> list[str]:
    """The start-up measurement as lines of text."""
    calls = startup["calls"]
    count = len(next(iter(calls.values())))
    lines = [
        f"start-up, {startup['workers']} workers, seconds per call in one process (first call "
        f"in a fresh interpreter; a new interpreter that only imports towers: "
        f"{startup['import_s']:.2f} s)",
        f"{'what':<14}" + "".join(f"{f'call {i + 1}':>9}" for i in range(count)),
    ]
    for name, values in calls.items():
        lines.append(f"{name:<14}" + "".join(f"{v:>9.2f}" for v in values))
    lines.append(
        "(train: the call's time minus its training loop; towers run: a script that joins the "
        "job and leaves, fresh interpreters every call)"
    )
    if "first_job" in startup:
        lines += ["", *first_job_table(startup["first_job"])]
    return lines


def first_jobs(
    workers: int = 2, repeats: int = 3, steps: int = 2, timeout: float = 300
) -> dict[str, Any]:
    """Wall seconds of a fresh ``python script.py`` training a tiny net for ``steps`` steps on
    ``workers`` processes, with ``towers.train`` and with ``mp.spawn`` + DDP, ``repeats`` times
    in alternating order; and the 1-minute load average as each repeat starts."""
    runs: dict[str, list[float]] = {arm: [] for arm in FIRST_JOB_ARMS}
    loads = []
    with tempfile.TemporaryDirectory() as tmp:
        scripts = {"towers": Path(tmp) / "with_towers.py", "ddp": Path(tmp) / "with_ddp.py"}
        scripts["towers"].write_text(_TOWERS_JOB)
        scripts["ddp"].write_text(_DDP_JOB)
        for rep in range(repeats):
            loads.append(os.getloadavg()[0])
            for arm in sorted(runs, reverse=rep % 2 == 1):
                start = time.perf_counter()
                proc = subprocess.run(
                    [sys.executable, str(scripts[arm]), str(workers), str(steps)],
                    capture_output=True,
                    text=True,
                    timeout=timeout,
                    check=False,
                )
                runs[arm].append(time.perf_counter() - start)
                if proc.returncode != 0:
                    tail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
                    raise RuntimeError(f"the {FIRST_JOB_ARMS[arm]} first job failed: {tail}")
    return {"workers": workers, "steps": steps, "runs": runs, "loads": loads}


def first_job_table(first: dict[str, Any]) -> list[str]:
    """:func:`first_jobs` as lines of text: medians, each repeat, and the paired ratio."""
    runs = first["runs"]
    ratios = [t / d for t, d in zip(runs["towers"], runs["ddp"])]
    loads = " ".join(f"{v:.2f}" for v in first["loads"])
    lines = [
        f"first job in a fresh interpreter: `python script.py` training a 1-5-1 net for "
        f"{first['steps']} steps on {first['workers']} workers, wall seconds to its exit, "
        f"median of {len(ratios)} (1-minute load average as each repeat started: {loads})",
    ]
    for arm, name in FIRST_JOB_ARMS.items():
        each = " ".join(f"{v:.2f}" for v in runs[arm])
        lines.append(f"{name:<16}{statistics.median(runs[arm]):>7.2f}   each: {each}")
    lines.append(
        f"towers / DDP: {statistics.median(ratios):.2f} (median of the ratios within a repeat)"
    )
    return lines


if __name__ == "__main__":
    print(json.dumps(measure(int(sys.argv[1]), int(sys.argv[2]))))
