"""A small /dev/shm: data that does not fit is refused before any worker starts, nothing is left
behind, and files that killed jobs left there are swept when a job starts.

Each case runs tests/scripts/shm_room.py in a private mount namespace with a tmpfs of its own
over /dev/shm (tests/mounts.py), so the rest of the machine keeps its /dev/shm.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from mounts import small_shm

SCRIPT = str(Path(__file__).parent / "scripts" / "shm_room.py")
SRC = str(Path(__file__).resolve().parents[1] / "src")


def _run(case: str, size: str, tmp_path: Path) -> dict:
    args = ["env", f"PYTHONPATH={SRC}", sys.executable, SCRIPT, case, str(tmp_path)]
    done = small_shm(args, size, timeout=90)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.timeout(120)
def test_data_larger_than_dev_shm_is_refused_before_workers_start(tmp_path):
    out = _run("too-big", "16m", tmp_path)
    assert out["error"] == "OSError" and out["errno"] == 28, out
    message = out["message"]
    assert "need 32.5 MiB of shared memory to reach the worker processes" in message
    assert "/dev/shm has 16.0 MiB free (of 16.0 MiB)" in message
    assert "docker run --shm-size=2g" in message and "workers=1" in message
    assert out["workers"] == []  # no worker ever ran loss_fn


@pytest.mark.timeout(120)
def test_a_failed_allocation_leaves_no_file_in_dev_shm(tmp_path):
    """The room goes to another process between the check and torch's allocation (the test
    makes the check see room): torch's half-made ``torch_*`` file is removed, and the error is
    the same one."""
    out = _run("race", "16m", tmp_path)
    assert out["errno"] == 28, out
    assert "need 32.0 MiB of shared memory" in out["message"]
    assert out["left"] == [], out


@pytest.mark.timeout(120)
def test_files_of_dead_creators_are_swept_when_a_job_starts(tmp_path):
    """Stale towers segments, semaphores and torch storages go; a file whose creator lives,
    one a live process maps, another user's and names that are not ours stay."""
    out = _run("sweep", "64m", tmp_path)
    assert out["left"] == out["kept"], out
    assert not set(out["stale"]) & set(out["left"])
    assert len(out["losses"]) == 2 and out["workers"] == ["worker-0", "worker-1"]


@pytest.mark.timeout(120)
def test_an_averaging_segment_that_does_not_fit_says_so(tmp_path):
    """``auto`` averages over Gloo instead; ``shm`` fails with the room and the way out."""
    out = _run("segment", "16m", tmp_path)
    assert len(out["auto"]) == 2, out
    assert out["error"] is not None and out["left"] == [], out
    assert "transport='shm' is not available: cannot create /dev/shm/towers-" in out["error"]
    assert "No space left on device; /dev/shm has " in out["error"]
    assert "free of 16.0 MiB: give it more room" in out["error"]
    assert "average over the process group with transport='gloo'" in out["error"]
