"""Run by tests/test_shm_room.py with a small /dev/shm of its own; prints one JSON line.

python shm_room.py too-big MARKERS   # train() with data larger than /dev/shm
python shm_room.py sweep MARKERS     # files left by dead processes, then train()
python shm_room.py race MARKERS      # the room goes between the check and torch's allocation
"""

from __future__ import annotations

import json
import mmap
import os
import subprocess
import sys
from pathlib import Path

import torch

import towers

SHM = Path("/dev/shm")


def mse(model, shard):
    if "RANK" in os.environ:  # a worker: say that one started
        (Path(sys.argv[2]) / f"worker-{os.environ['RANK']}").touch()
    x, y = shard
    return (model(x) - y).square().mean()


def train(samples: int, transport: str = "auto"):
    g = torch.Generator().manual_seed(0)
    data = (torch.randn(samples, 64, generator=g), torch.randn(samples, 1, generator=g))
    return towers.train(
        torch.nn.Linear(64, 1), mse, data, batch_size=32, steps=2, workers=2, progress=False,
        timeout=30, transport=transport,
    )  # fmt: skip


def too_big() -> dict:
    try:
        train(128 * 1024)  # 32.5 MiB of samples
    except OSError as exc:
        return {"error": type(exc).__name__, "errno": exc.errno, "message": str(exc)}
    return {"error": None}


def sweep() -> dict:
    dead = subprocess.Popen(["true"])
    dead.wait()
    stale = [f"torch_{dead.pid}_123_0", f"towers-{dead.pid}-0123456789abcdef",
             f"sem.towers-{dead.pid}-0123456789abcdef-0"]  # fmt: skip
    kept = [f"torch_{os.getpid()}_1_0", "torch_other_name", f"towers-{dead.pid}x"]
    mapped, foreign = f"torch_{dead.pid}_7_0", f"torch_{dead.pid}_8_0"
    for name in [*stale, *kept, mapped, foreign]:
        (SHM / name).write_bytes(b"\0" * 4096)
    os.chown(SHM / foreign, 65534, 65534)  # another user's: not ours to remove
    with open(SHM / mapped, "r+b") as f:  # a live process maps it: in use
        view = mmap.mmap(f.fileno(), 4096)
    result = train(256)
    view.close()
    return {
        "left": sorted(p.name for p in SHM.iterdir()),
        "stale": stale,
        "kept": sorted([*kept, mapped, foreign]),
        "losses": result.losses,
    }


def segment() -> dict:
    """Four 4 MiB slots and a result area do not fit in 16 MiB: shm fails, auto falls back."""
    auto = train(256).losses
    try:
        train(256, "shm")
    except RuntimeError as exc:
        return {"auto": auto, "error": str(exc), "left": os.listdir(SHM)}
    return {"auto": auto, "error": None}


def race() -> dict:
    """Another process takes the room after the check: torch fails, and its file goes too."""
    from towers.processes import pack

    pack.free_space = lambda directory=None: (1 << 40, 1 << 40)  # the check sees room
    try:
        pack.pack(torch.zeros(32 << 20, dtype=torch.uint8))
    except OSError as exc:
        return {"errno": exc.errno, "message": str(exc), "left": os.listdir(SHM)}
    return {"errno": None, "left": os.listdir(SHM)}


if __name__ == "__main__":
    torch.set_num_threads(1)
    out = {"too-big": too_big, "sweep": sweep, "race": race, "segment": segment}[sys.argv[1]]()
    out["workers"] = sorted(p.name for p in Path(sys.argv[2]).glob("worker-*"))
    print(json.dumps(out))
