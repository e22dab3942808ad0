"""Bad disks: a read-only or full checkpoint directory, before and during training."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import assert_close_lists, assert_same_parameters, make_net, mse, regression_data
from mounts import fill, tmpfs

import towers

DATA = regression_data(24)


def train(steps, **kwargs):
    return towers.train(
        make_net(), mse, DATA, batch_size=6, steps=steps, seed=3, progress=False, **kwargs
    )


def test_an_unwritable_or_full_directory_is_refused_before_training(tmp_path):
    ro, tiny = tmp_path / "ro", tmp_path / "tiny"
    message = rf"cannot write checkpoints to {ro}/ckpt: Read-only file system"
    with tmpfs(ro, "ro,size=1m"), pytest.raises(OSError, match=message):
        train(3, workers=1, checkpoint=ro / "ckpt")
    message = rf"{tiny} has 64 KiB free; one checkpoint needs about"
    with tmpfs(tiny, "size=64k"), pytest.raises(OSError, match=message):
        train(3, workers=1, checkpoint=tiny)


def mse_filling_the_disk(model, shard, directory: str, at_call: int):
    """Rank 0 fills the checkpoint directory's file system at its ``at_call``-th loss."""
    mse_filling_the_disk.calls = getattr(mse_filling_the_disk, "calls", 0) + 1
    if os.environ.get("RANK") == "0" and mse_filling_the_disk.calls == at_call:
        fill(Path(directory))
    return mse(model, shard)


# Run in its own interpreter: workers write their warnings to the stderr their process server
# was started with, which under pytest is whichever test first started one.
FILL_AND_TRAIN = """
import functools, sys, torch, towers
from test_disks import DATA, make_net, mse_filling_the_disk
disk = sys.argv[1]
loss = functools.partial(mse_filling_the_disk, directory=disk, at_call=4)
result = towers.train(make_net(), loss, DATA, batch_size=6, steps=8, seed=3, progress=False,
                      workers=2, checkpoint=disk, checkpoint_every=2)
torch.save({"losses": result.losses, "state": result.model.state_dict()}, sys.argv[2])
"""


@pytest.mark.timeout(90)
def test_a_disk_that_fills_up_keeps_the_trained_result(tmp_path):
    whole = train(8, workers=2)
    with tmpfs(tmp_path / "disk", "size=1m") as disk:
        (disk / ".tmp-left-by-a-killed-save.pt").write_bytes(b"\0" * 1000)
        out = tmp_path / "result.pt"
        env = {**os.environ, "PYTHONPATH": str(Path(__file__).parent)}
        run = subprocess.run(
            [sys.executable, "-c", FILL_AND_TRAIN, str(disk), str(out)],
            env=env,
            capture_output=True,
            text=True,
            timeout=80,
        )
        assert run.returncode == 0, run.stderr
        result = torch.load(out)
        assert_close_lists(result["losses"], whole.losses, rtol=1e-6)
        trained = make_net()
        trained.load_state_dict(result["state"])
        assert_same_parameters(trained, whole.model, rtol=1e-6, atol=1e-7)
        err = run.stderr
        assert "checkpoint of step 8 could not be written" in err, err
        assert "No space left on device" in err and "training goes on" in err
        assert f"the newest saved one is {disk}/step-00000002.pt" in err, err
        assert sorted(p.name for p in disk.iterdir()) == ["filler", "step-00000002.pt"]
