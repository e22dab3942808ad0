"""What a script ported from Hogwild or DDP needs to know, said and checked (docs/porting.md)."""

from __future__ import annotations

import re

import pytest
import torch
from torch.utils.data import DataLoader

import towers
from towers.api.epochs import describe_epochs
from towers.core.modes import parse_mode
from towers.tools.zoo import Parabola, parabola_data, parabola_loss


def _train(capsys, samples=50, **kwargs):
    torch.manual_seed(0)
    data = parabola_data(samples)
    result = towers.train(Parabola(), parabola_loss, data, shuffle=False, progress=False, **kwargs)
    return result, capsys.readouterr().err


@pytest.mark.timeout(120)
def test_async_epochs_are_passes_by_all_workers_and_the_start_says_so(capsys):
    # 50 samples in global batches of 20 (20, 20, 10), each split over 3 workers: 9 shards an
    # epoch, each shard one update
    result, err = _train(capsys, batch_size=20, epochs=2, workers=3, mode="async")
    line = next(x for x in err.splitlines() if x.startswith("towers.train: epochs=2"))
    assert "2 passes over the data by all 3 workers together (6 global batches of 20)" in line
    assert int(re.search(r": (\d+) updates", line).group(1)) == result.updates == 18
    assert "give epochs=6" in line

    # Hogwild: 3 processes, 2 epochs each over all 60 samples in batches of 5 (its DataLoader);
    # towers: global batches of 3 x 5, 2 x 3 passes by all 3 workers together
    hogwild_updates = 3 * 2 * len(DataLoader(range(60), batch_size=5))
    result, _ = _train(capsys, 60, batch_size=3 * 5, epochs=2 * 3, workers=3, mode="async")
    assert result.updates == hogwild_updates


@pytest.mark.timeout(60)
def test_sync_epochs_read_as_in_ddp_and_say_nothing(capsys):
    _, err = _train(capsys, batch_size=25, epochs=1, workers=2)
    assert "towers.train: epochs" not in err


def test_local_mode_describes_steps_per_worker():
    line = describe_epochs(parse_mode("local:4"), 3, samples=100, batch_size=32, workers=2)
    assert "3 passes over the data by all 2 workers together (12 global batches of 32)" in line
    assert "each worker steps 12 times on shards of about 16" in line
    assert describe_epochs(parse_mode("local:4"), None, 100, 32, 2) is None  # steps= given
    assert describe_epochs(parse_mode("backup:1"), 3, 100, 32, 2) is None  # one update a batch
