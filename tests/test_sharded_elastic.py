"""An elastic job with its optimizer state sharded (``elastic=True, shard_optimizer=True``).

A lost tower takes its part of the optimizer's state with it, so whenever the members change
every member rebuilds the whole state from the newest checkpoint, cut for the new members,
and trains again the global batches since (docs/sharding.md, "Elastic jobs"). Every run is
held to a plain single-process loop over the same global batches, in float32 and float64.
"""

from __future__ import annotations

import functools
import os
from pathlib import Path

import pytest
import torch
from exact import Reference
from helpers import make_net
from test_diloco import DATA, SignedDyingOnce, mse_dying_once, slow_mse

import towers
from towers.engines.shard_rules import ALIGN

ADAMW = functools.partial(torch.optim.AdamW, lr=0.03, weight_decay=0.1)


def run(loss, steps: int, tmp_path, **kwargs):
    return towers.train(
        make_net(), loss, DATA, batch_size=10, steps=steps, seed=4, optimizer=ADAMW,
        progress=False, elastic=True, shard_optimizer=True, checkpoint=tmp_path / "ckpt",
        checkpoint_every=4, timeout=30, **kwargs,
    )  # fmt: skip


def plain_loop(steps: int) -> Reference:
    return Reference.of(make_net(), DATA, batch_size=10, steps=steps, optimizer=ADAMW, seed=4)


@pytest.mark.timeout(120)
def test_a_lost_towers_part_is_rebuilt_from_the_newest_checkpoint_exactly(tmp_path):
    """Tower 1 is killed (SIGKILL) at its 7th loss, in global batch 7: the survivors take the
    checkpoint of step 4, cut its state in two parts, and train batches 4 to 11 again."""
    loss = functools.partial(mse_dying_once, marker=str(tmp_path / "marker"), at_call=7)
    got = run(loss, 12, tmp_path, workers=3, transport="shm")
    assert got.dead_workers == [1] and got.restarts == 0
    assert got.world == [3] * 4 + [2] * 8  # the batches trained again count once, at 2 towers
    assert [k for k, _ in got.recoveries] == [4]
    want = plain_loop(12)
    want.check(got.model)
    want.check_losses(got.losses)
    # the checkpoint of step 0, written before the first step, is what a loss before step 4
    # would have gone back to; the two newest are kept, each with both towers' parts
    files = sorted(p.name for p in (tmp_path / "ckpt").iterdir())
    assert files == [f"step-{s:08d}{part}.pt" for s in (8, 12) for part in
                     (".part-00000", ".part-00001", "")]  # fmt: skip


def dying_over_a_damaged_part(model, shard, marker: str, part: str):
    """Rank 1, at its 11th loss (global batch 10), damages a part of the checkpoint of step
    8 and kills itself (once)."""
    if os.environ.get("RANK") == "1" and not Path(marker).exists():
        calls = dying_over_a_damaged_part.calls = getattr(dying_over_a_damaged_part, "calls", 0) + 1
        if calls == 11:
            Path(part).write_bytes(Path(part).read_bytes()[:-100])
    return mse_dying_once(model, shard, marker, at_call=11)


@pytest.mark.timeout(120)
def test_each_tower_holds_its_part_and_a_damaged_part_sends_every_member_further_back(tmp_path):
    """The newest checkpoint's part of tower 0 is damaged as tower 1 dies: the survivors find
    it, together, and rebuild from the checkpoint before (step 4) instead."""
    part = tmp_path / "ckpt" / "step-00000008.part-00000.pt"
    loss = functools.partial(dying_over_a_damaged_part, marker=str(tmp_path / "marker"),
                             part=str(part))  # fmt: skip
    got = run(loss, 16, tmp_path, workers=3, transport="gloo")
    assert got.dead_workers == [1] and got.world == [3] * 4 + [2] * 12
    want = plain_loop(16)
    want.check(got.model)
    want.check_losses(got.losses)
    # each tower wrote its part only: one copy of the state between the two of them
    parts = [torch.load(tmp_path / "ckpt" / f"step-00000016.part-{r:05d}.pt") for r in (0, 1)]
    held = [sum(record["stop"] - record["start"] for record in p) for p in parts]
    total = sum(p.numel() for p in make_net().parameters())
    assert sum(held) == total and all(abs(h - total / 2) <= ALIGN for h in held), held


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_a_replacement_and_newcomers_receive_their_parts_from_the_checkpoint(tmp_path):
    """A replacement joins after a loss, and in another job newcomers join a job that started
    with one tower: each change of members goes back to the newest checkpoint, cut for the
    new members, and the run stays one process's."""
    replaced = run(SignedDyingOnce(str(tmp_path), at_call=6), 36, tmp_path / "a", workers=3,
                   max_restarts=1, transport="gloo")  # fmt: skip
    assert replaced.dead_workers == [1] and replaced.restarts == 1
    assert len(replaced.recoveries) == 1  # the replacement's record says so too
    assert replaced.world[:4] == [3] * 4 and replaced.world[-1] == 3, replaced.world
    grown = run(slow_mse, 32, tmp_path / "b", workers=3, min_workers=1, transport="gloo")
    # it grows (1, 2, 3 towers); newcomers let in before the first checkpoint after step 0
    # send it back to step 0, so its record may start at any width
    assert grown.world == sorted(grown.world) and grown.world[-1] == 3, grown.world
    # the replacement was let in while the survivors rebuilt, or after: the batches from the
    # checkpoint the loss sent them back to were trained again at the width they ended with
    for name, got, steps in (("replaced", replaced, 36), ("grown", grown, 32)):
        # the members change where a checkpoint was written: every 4 global batches
        changes = [k for k in range(1, steps) if got.world[k] != got.world[k - 1]]
        assert all(k % 4 == 0 for k in changes), (name, got.world)
        want = plain_loop(steps)
        want.check(got.model, name)
        want.check_losses(got.losses, name)
