"""A hung worker (stopped, not dead) is named, within the timeout; async modes go on without it."""

from __future__ import annotations

import functools
import os
import signal
import time
from pathlib import Path

import pytest
from helpers import make_net, mse, regression_data

import towers

CALLS = {"n": 0}


def mse_stopping_a_rank(model, shard, rank: int, at_call: int, note: str):
    """``rank`` writes its pid and the time to ``note``, then stops itself (SIGSTOP)."""
    CALLS["n"] += 1
    if os.environ.get("RANK") == str(rank) and CALLS["n"] == at_call:
        Path(note).write_text(f"{os.getpid()} {time.time()}")
        os.kill(os.getpid(), signal.SIGSTOP)
    return mse(model, shard)


@pytest.mark.timeout(90)
@pytest.mark.parametrize("transport", ["shm", "gloo"])
def test_a_stopped_worker_is_named_within_the_timeout(tmp_path, transport):
    note = tmp_path / "stopped"
    loss = functools.partial(mse_stopping_a_rank, rank=1, at_call=3, note=str(note))
    with pytest.raises(
        TimeoutError, match=r"in (a shared-memory all-reduce|a collective) for"
    ) as info:
        towers.train(
            make_net(), loss, regression_data(40), batch_size=8, steps=30, workers=3,
            progress=False, timeout=3, transport=transport,
        )  # fmt: skip
    failed_after = time.time() - float(note.read_text().split()[1])
    pid = int(note.read_text().split()[0])
    assert f"rank 1 (pid {pid}, stopped by a signal), which did not arrive" in str(info.value)
    assert info.value.ranks == [1] and info.value.pids == [pid]
    assert failed_after < 3 + 2.5, failed_after  # the timeout, then a second or two, not 10


@pytest.mark.timeout(90)
def test_a_stopped_tower_is_dropped_and_asynchronous_training_goes_on(tmp_path):
    note = tmp_path / "stopped"
    loss = functools.partial(mse_stopping_a_rank, rank=2, at_call=4, note=str(note))
    result = towers.train(
        make_net(), loss, regression_data(40), batch_size=8, steps=40, workers=3,
        mode="async", progress=False, timeout=4,
    )  # fmt: skip
    assert result.dead_workers == [1] and len(result.losses) == 40
    assert result.losses[-1] < result.losses[0]
