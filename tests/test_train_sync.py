"""towers.train in sync mode against a plain single-process PyTorch loop."""

from __future__ import annotations

import functools
import math

import pytest
import torch
from exact import Reference
from helpers import Net, dict_mse, make_net, mse, regression_data, towers_holding
from torch.utils.data import Dataset

import towers

SGD_MOMENTUM = functools.partial(torch.optim.SGD, lr=0.05, momentum=0.9)
# Seed 001's staircase exponential decay: lr * 0.5 ** floor(step / 3).
STAIRCASE = functools.partial(torch.optim.lr_scheduler.StepLR, step_size=3, gamma=0.5)


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("workers", "transport"),
    [(1, "auto"), (2, "shm"), (2, "gloo"), (3, "shm"), (3, "gloo"), (4, "shm"), (4, "gloo")],
)
def test_sync_matches_single_process_loop(workers, transport):
    # 45 samples in batches of 10: shards of 10 and of the epoch's last batch (5) are uneven for
    # 3 and 4 workers; 12 steps cross an epoch boundary (a new permutation).
    data = regression_data(45)
    model = make_net()
    result = towers.train(
        model,
        mse,
        data,
        batch_size=10,
        steps=12,
        workers=workers,
        optimizer=SGD_MOMENTUM,
        lr_schedule=STAIRCASE,
        seed=7,
        progress=False,
        transport=transport,
    )
    reference = Reference.of(
        make_net(),
        data,
        batch_size=10,
        steps=12,
        optimizer=SGD_MOMENTUM,
        lr_schedule=STAIRCASE,
        seed=7,
        towers=workers,
        shards=result.shards,  # the split the run chose (balanced: each step's own)
    )
    assert reference.skipped == [] and result.skipped == []
    assert all(
        sum(s) == n for s, n in zip(result.shards, [10] * 4 + [5] + [10] * 4 + [5] + [10] * 2)
    )
    reference.check_losses(result.losses)
    reference.check_tower_losses(result.tower_losses)
    reference.check(result.model)
    assert (result.steps, result.samples, result.workers, result.mode) == (12, 110, workers, "sync")
    assert result.staleness == [] and result.seconds > 0
    # the caller's model is left as it was
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), make_net().parameters()))


class PairDataset(Dataset):
    def __init__(self, x, y):
        self.x, self.y = x, y

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return self.x[i], self.y[i]


@pytest.mark.timeout(60)
def test_dataset_dict_data_and_accumulation_match_reference():
    x, y = regression_data(30)
    adam = functools.partial(torch.optim.Adam, lr=0.01)
    ref = Reference.of(make_net(), (x, y), batch_size=8, steps=6, optimizer=adam, seed=3)

    # a map-style Dataset, gradient accumulation over 2 micro-batches per tower
    r1 = towers.train(
        make_net(),
        mse,
        PairDataset(x, y),
        batch_size=8,
        steps=6,
        workers=3,
        optimizer=adam,
        seed=3,
        accumulate=2,
        progress=False,
    )
    # a dict of tensors, epochs instead of steps (30 samples / 8 = 4 batches per epoch)
    r2 = towers.train(
        make_net(),
        dict_mse,
        {"x": x, "y": y},
        batch_size=8,
        epochs=2,
        workers=2,
        optimizer=adam,
        seed=3,
        progress=False,
    )
    ref.check_losses(r1.losses)
    ref.check(r1.model)
    ref8 = Reference.of(make_net(), (x, y), batch_size=8, steps=8, optimizer=adam, seed=3)
    assert r2.steps == 8
    ref8.check_losses(r2.losses)
    ref8.check(r2.model)


def nan_at_sample_7(model, shard):
    return mse(model, shard)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("transport", ["shm", "gloo"])
def test_nan_in_one_sample_skips_the_step_on_every_tower(transport):
    x, y = regression_data(40)
    x[7, 1] = float("nan")
    workers, batch = 3, 10
    with pytest.warns(RuntimeWarning, match=r"NaN or Inf in 1 sample\(s\) \(7\)"):
        result = towers.train(
            make_net(),
            mse,
            (x, y),
            batch_size=batch,
            steps=8,
            workers=workers,
            optimizer=SGD_MOMENTUM,
            seed=5,
            progress=False,
            transport=transport,
        )
    reference = Reference.of(
        make_net(), (x, y), batch_size=batch, steps=8, optimizer=SGD_MOMENTUM, seed=5
    )
    # sample 7 is in one batch per epoch: two epochs of 4 batches, so two skipped steps
    assert len(reference.skipped) == 2
    assert [s for s, _ in result.skipped] == reference.skipped
    # the culprit is the tower whose shard holds sample 7
    holding = towers_holding(7, 40, batch, workers, seed=5, epochs=2)
    for step, culprits in result.skipped:
        assert culprits == holding[step]
        assert math.isnan(result.losses[step])
        assert sum(math.isnan(v) for v in result.tower_losses[step]) == 1
    reference.check_losses(result.losses)
    assert all(torch.isfinite(p).all() for p in result.model.parameters())
    reference.check(result.model)


@pytest.mark.timeout(60)
def test_fewer_samples_than_workers_in_a_batch():
    # batches of 3 over 4 towers: one tower has nothing each step and weighs nothing
    x, y = regression_data(9)
    sgd = functools.partial(torch.optim.SGD, lr=0.1)
    result = towers.train(
        make_net(), mse, (x, y), batch_size=3, steps=5, workers=4, optimizer=sgd, progress=False
    )
    reference = Reference.of(make_net(), (x, y), batch_size=3, steps=5, optimizer=sgd)
    reference.check_losses(result.losses)
    assert all(math.isnan(t[3]) for t in result.tower_losses)
    reference.check(result.model)


class Unused(Net):
    """A parameter that never gets a gradient stays without one (and Adam leaves it alone)."""

    def __init__(self):
        super().__init__()
        self.unused = torch.nn.Parameter(torch.ones(2))


def test_parameter_without_gradient_is_not_updated():
    torch.manual_seed(0)
    model = Unused()
    x, y = regression_data(12)
    adam = functools.partial(torch.optim.Adam, lr=0.1, weight_decay=0.1)
    result = towers.train(
        model, mse, (x, y), batch_size=6, steps=3, workers=1, optimizer=adam, progress=False
    )
    assert torch.equal(result.model.unused, torch.ones(2))


def test_all_finite_matches_the_elementwise_check():
    from towers.core.step import all_finite

    big = torch.full((4,), 3e38)  # finite, but its float32 sum overflows
    cases = [torch.zeros(0), torch.randn(1000), big, torch.arange(5)]
    for bad in (math.nan, math.inf, -math.inf):
        t = torch.randn(1000)
        t[617] = bad
        cases.append(t)
    both = torch.tensor([math.inf, -math.inf])  # sums to nan
    for t in [*cases, both, big.double()]:
        expected = bool(torch.isfinite(t).all())
        assert all_finite(t) == expected, t
