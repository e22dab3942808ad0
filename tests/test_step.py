"""The arithmetic of a step, without processes: metadata, culprits, division, None.

The synchronous step divides an all-reduced flat buffer (``assign_grads``); the parameter server
sums the towers' per-parameter gradients (``sum_grads``) and divides them (``assign_mean``). Both
follow one rule, checked here against each other and against ``average_gradients``.
"""

from __future__ import annotations

import math

import pytest
import torch

from towers import average_gradients
from towers.core.step import (
    StepMeta,
    assign_grads,
    assign_mean,
    local_step,
    mean_values,
    step_result,
    sum_grads,
)


def _summed(meta: StepMeta, towers: list[tuple[int, float, bool, list[float]]]) -> torch.Tensor:
    """What an all-reduce of every tower's packed vector gives."""
    vectors = [
        meta.pack(rank, samples, loss_sum, bad, torch.tensor(had, dtype=torch.float64))
        for rank, (samples, loss_sum, bad, had) in enumerate(towers)
    ]
    return torch.stack(vectors).sum(0)


def test_metadata_survives_the_sum_over_towers():
    meta = StepMeta(world=3, params=2)
    towers = [(4, 8.0, False, [1, 0]), (3, 1.5, True, [1, 0]), (0, 123.0, False, [0, 0])]
    tally = meta.read(_summed(meta, towers))
    assert tally.counts == [4, 3, 0]
    assert tally.sums == [8.0, 1.5, 0.0]  # an empty tower's loss sum does not count
    assert tally.culprits == [1]
    assert tally.had_grad == [True, False]
    assert tally.total == 7


def test_step_result_weights_by_samples_and_names_culprits():
    meta = StepMeta(world=3, params=1)
    towers = [(4, 8.0, False, [1]), (2, 1.0, False, [1]), (0, 0.0, False, [0])]
    ok = step_result(meta.read(_summed(meta, towers)), sums_finite=True)
    assert ok.loss == pytest.approx(9.0 / 6)
    assert ok.tower_losses[:2] == [2.0, 0.5] and math.isnan(ok.tower_losses[2])
    assert ok.tower_samples == [4, 2, 0] and ok.samples == 6
    assert not ok.skipped and ok.culprits == []

    nan_tower = [(4, math.nan, True, [1]), (2, 1.0, False, [1]), (0, 0.0, False, [0])]
    bad = step_result(meta.read(_summed(meta, nan_tower)), sums_finite=False)
    assert bad.skipped and bad.culprits == [0] and math.isnan(bad.loss)
    # finite losses, but the summed gradients overflowed: skipped, no tower to blame
    overflow = step_result(meta.read(_summed(meta, [(1, 1.0, False, [1])] * 3)), False)
    assert overflow.skipped and overflow.culprits == []


def test_a_step_without_samples_is_skipped_with_no_tower_to_blame():
    """Every rank of a DDP-style job out of batches: nothing to apply, nobody at fault."""
    meta = StepMeta(world=2, params=1)
    empty = step_result(meta.read(_summed(meta, [(0, 0.0, False, [0])] * 2)), True)
    assert empty.skipped and empty.culprits == [] and empty.samples == 0
    assert math.isnan(empty.loss) and all(math.isnan(x) for x in empty.tower_losses)


def test_assigned_gradients_are_the_weighted_average():
    """Summing n_i * g_i and dividing by N gives average_gradients weighted by n_i."""
    torch.manual_seed(0)
    params = [torch.zeros(3, 2, requires_grad=True), torch.zeros(4, requires_grad=True)]
    counts = [5, 2, 1]
    grads = [[torch.randn(3, 2), torch.randn(4)] for _ in counts]
    flat = sum(torch.cat([g.reshape(-1) * n for g in gs]) for gs, n in zip(grads, counts))
    assert isinstance(flat, torch.Tensor)
    slots = [(0, 0, 6), (1, 6, 10)]
    assign_grads(params, flat, slots, total=sum(counts), had_grad=[True, True])
    expected = average_gradients([list(zip(gs, params)) for gs in grads], weights=counts)
    for p, (g, _) in zip(params, expected):
        torch.testing.assert_close(p.grad, g)


def test_a_parameter_no_tower_had_a_gradient_for_keeps_none():
    params = [torch.zeros(2, requires_grad=True), torch.zeros(2, requires_grad=True)]
    flat = torch.tensor([2.0, 4.0, 0.0, 0.0])
    assign_grads(params, flat, [(0, 0, 2), (1, 2, 4)], total=2, had_grad=[True, False])
    assert params[0].grad.tolist() == [1.0, 2.0]
    assert params[1].grad is None


def test_server_arithmetic_is_the_weighted_average_and_the_sync_step_bit_for_bit():
    """Per-tower gradients (n_i * g_i) summed and divided by N: average_gradients weighted by
    n_i, and exactly what assign_grads makes of the same sums in a flat buffer."""
    torch.manual_seed(0)
    params = [torch.zeros(3, 2, requires_grad=True), torch.zeros(4, requires_grad=True)]
    counts = [5, 2, 1]
    grads = [[torch.randn(3, 2), torch.randn(4)] for _ in counts]
    summed = sum_grads([[g * n for g in gs] for gs, n in zip(grads, counts)])
    assert assign_mean(params, summed, total=sum(counts))
    expected = average_gradients([list(zip(gs, params)) for gs in grads], weights=counts)
    for p, (g, _) in zip(params, expected):
        torch.testing.assert_close(p.grad, g)

    twins = [torch.zeros_like(p, requires_grad=True) for p in params]
    flat = torch.cat([g.reshape(-1) for g in summed if g is not None])
    assign_grads(twins, flat, [(0, 0, 6), (1, 6, 10)], sum(counts), had_grad=[True, True])
    for p, twin in zip(params, twins):
        assert torch.equal(p.grad, twin.grad)


def test_server_arithmetic_keeps_none_where_no_tower_had_a_gradient():
    a, b, c = (torch.zeros(2, requires_grad=True) for _ in range(3))
    g = torch.tensor([2.0, 4.0])
    summed = sum_grads([[g, None, None], [torch.tensor([2.0, 0.0]), torch.ones(2), None]])
    # a None in some towers counts as zero, in every tower it stays None
    assert summed[0].tolist() == [4.0, 4.0] and summed[1].tolist() == [1.0, 1.0]
    assert summed[2] is None
    assert sum_grads([[g, None]])[0] is g  # a single contributor is used as it is
    assert assign_mean([a, b, c], summed, total=2)
    assert a.grad.tolist() == [2.0, 2.0] and b.grad.tolist() == [0.5, 0.5] and c.grad is None


@pytest.mark.parametrize("bad", [math.nan, math.inf])
def test_server_arithmetic_touches_nothing_when_a_sum_is_not_finite(bad):
    a, b = torch.zeros(2, requires_grad=True), torch.zeros(1, requires_grad=True)
    before = torch.tensor([7.0, 7.0])
    a.grad = before
    summed = sum_grads([[torch.ones(2), torch.tensor([bad])], [torch.ones(2), None]])
    assert not assign_mean([a, b], summed, total=3)
    assert a.grad is before and b.grad is None


def test_mean_values_decide_as_a_step_and_leave_grad_alone():
    """The means of values reduced in place of gradients: divided, ``None`` where no tower had
    one, nothing when a tower was at fault; no ``.grad`` is touched."""
    meta = StepMeta(world=2, params=2)
    summed = meta.pack(0, 3, 1.5, False, torch.tensor([1.0, 0.0])) + meta.pack(
        1, 1, 0.5, False, torch.tensor([1.0, 0.0])
    )
    flat = torch.tensor([4.0, 8.0, 0.0])
    result, means = mean_values(meta.read(summed), [(flat, [(0, 0, 2), (1, 2, 3)])])
    assert not result.skipped and result.loss == 0.5
    assert means[0].tolist() == [1.0, 2.0] and means[1] is None
    bad = meta.pack(0, 3, 1.5, True, torch.tensor([1.0, 1.0])) + summed
    result, means = mean_values(meta.read(bad), [(torch.ones(3), [(0, 0, 2), (1, 2, 3)])])
    assert result.skipped and result.culprits == [0] and means == {}


def test_a_local_step_divides_its_own_gradients_or_skips():
    p = torch.zeros(2, requires_grad=True)
    p.grad = torch.tensor([6.0, 3.0])  # of loss * 3 samples
    r = local_step([p], loss_sum=1.5, samples=3, rank=1, world=2)
    assert p.grad.tolist() == [2.0, 1.0] and not r.skipped
    assert r.loss == 0.5 and r.tower_samples == [0, 3] and math.isnan(r.tower_losses[0])
    p.grad = torch.tensor([float("inf"), 3.0])
    r = local_step([p], loss_sum=1.5, samples=3, rank=1, world=2)
    assert r.skipped and r.culprits == [1] and p.grad[1] == 3.0  # not divided
    assert local_step([p], math.nan, 3, 0, 1).skipped
