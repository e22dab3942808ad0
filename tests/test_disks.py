"""Bad disks: a read-only or full checkpoint directory, before and during training."""

from __future__ import annotations

import functools
import os
from pathlib import Path

import pytest
import torch
from helpers import make_net, mse, regression_data
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
    if os.environ.get("RANK", "0") == "0" and mse_filling_the_disk.calls == at_call:
        fill(Path(directory))
    return mse(model, shard)


@pytest.mark.timeout(90)
def test_a_disk_that_fills_up_keeps_the_trained_result(tmp_path):
    whole = train(8, workers=1)  # in this process, as the run below: equal bit for bit
    with tmpfs(tmp_path / "disk", "size=1m") as disk:
        (disk / ".tmp-left-by-a-killed-save.pt").write_bytes(b"\0" * 1000)
        loss = functools.partial(mse_filling_the_disk, directory=str(disk), at_call=4)
        # one worker: the job runs in this process, where the warnings can be caught
        message = (
            r"checkpoint of step 4 could not be written .*No space left on device.*training "
            rf"goes on .*the newest saved one is {disk}/step-00000002.pt"
        )
        with pytest.warns(RuntimeWarning, match=message):
            result = towers.train(
                make_net(), loss, DATA, batch_size=6, steps=8, seed=3, progress=False,
                workers=1, checkpoint=disk, checkpoint_every=2,
            )  # fmt: skip
        assert result.losses == whole.losses
        for (name, p), q in zip(
            result.model.state_dict().items(), whole.model.state_dict().values()
        ):
            assert torch.equal(p, q), name
        assert sorted(p.name for p in disk.iterdir()) == ["filler", "step-00000002.pt"]
