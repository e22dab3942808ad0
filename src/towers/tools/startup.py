"""How long towers takes to start: ``towers bench --startup``.

Measured in a fresh interpreter (``python -m towers.tools.startup``), so that the first call
pays what a user's first call pays: importing torch and towers, starting the forkserver that
later workers fork from, the first rendezvous. Then the same calls again in the same process,
which is what a notebook or a sweep of runs pays for each later one. For each call:

- ``spawn``: :func:`towers.spawn` of a function that returns at once (2 workers);
- ``train sync``, ``train async``: a one-step :func:`towers.train` of the parabola net, minus
  the training loop itself (``TrainResult.seconds``): process start, rendezvous, transport set-up,
  model copy and shut-down;
- ``towers run``: ``towers run`` of a script that joins the job (``towers.init()``), passes a
  barrier and leaves; each call starts fresh interpreters, as torchrun does.
"""

from __future__ import annotations

import json
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

__all__ = ["in_fresh_process", "measure"]

_SCRIPT = """import towers
ctx = towers.init()
ctx.barrier()
ctx.close()
"""


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
    return lines


if __name__ == "__main__":
    print(json.dumps(measure(int(sys.argv[1]), int(sys.argv[2]))))
