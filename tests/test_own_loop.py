"""The own loop's open step: ctx.backward, ctx.mean, the same-batch check, sync_batchnorm.

Every case runs inside one spawn of 3 workers (uneven shards) and is compared here with a plain
single-process loop over the same global batches.
"""

from __future__ import annotations

import copy
import math
import warnings

import pytest
import torch
from exact import Reference, as_float64, states
from helpers import Net, mse, regression_data
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import towers
from towers.core.agree import BatchStamp, fingerprint, mean_vector, weighted_means

STEPS, BATCH, CLIP = 6, 11, 0.05


def batches(dtype: torch.dtype = torch.float32) -> list[tuple[torch.Tensor, torch.Tensor]]:
    x, y = regression_data(STEPS * BATCH)
    if dtype == torch.float64:
        x, y = as_float64((x, y))
    return [(x[i : i + BATCH], y[i : i + BATCH]) for i in range(0, STEPS * BATCH, BATCH)]


def _state(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def bn_net() -> nn.Module:
    torch.manual_seed(3)
    return nn.Sequential(nn.Linear(3, 6), nn.BatchNorm1d(6), nn.Tanh(), nn.Linear(6, 1))


def _clipped_loop(ctx):
    torch.manual_seed(ctx.rank)  # replicate() must replace these weights with rank 0's
    model = ctx.replicate(Net())
    opt = torch.optim.Adam(model.parameters(), lr=0.05)
    norms, losses = [], []
    for shard in ctx.shards(batches()):
        r = ctx.backward(mse(model, shard))
        norms.append(float(nn.utils.clip_grad_norm_(model.parameters(), CLIP)))
        opt.step()
        opt.zero_grad()
        losses.append(r.loss)
    return _state(model), norms, losses


def _scaled_loop(ctx):
    """A GradScaler as AMP scripts use it: scale, unscale, clip, scaler.step, update."""
    torch.manual_seed(0)
    model = ctx.replicate(Net())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    for shard in ctx.shards(batches()):
        ctx.backward(scaler.scale(mse(model, shard)))
        scaler.unscale_(opt)
        nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
    return _state(model)


def _batchnorm_loop(ctx):
    model = ctx.replicate(bn_net(), sync_batchnorm=True)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for shard in ctx.shards(batches()):
        ctx.step(mse(model, shard), opt)
    if ctx.rank == 0:  # evaluation on one rank alone: it must not wait for the others
        model.eval()
        model(batches()[0][0])
        model.train()
    return _state(model)


def _mistakes(ctx):
    """Each mistake raises the same error on every rank; the job goes on afterwards."""
    model = ctx.replicate(Net())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    errors = {}
    x, y = regression_data(9)
    (shard,) = ctx.shards([(x, y)])
    loss = mse(model, shard)
    loss.backward(retain_graph=True)
    try:
        ctx.backward(loss)
    except RuntimeError as exc:
        errors["twice"] = str(exc)
    opt.zero_grad()
    # A per-rank seed: every rank draws another global batch.
    (shard,) = ctx.shards([regression_data(9, seed=10 + ctx.rank)])
    try:
        ctx.backward(mse(model, shard))
    except ValueError as exc:
        errors["batch"] = str(exc)
    opt.zero_grad()
    # A NaN on rank 1's shard: skipped everywhere, every .grad None, step() a no-op.
    before = [p.detach().clone() for p in model.parameters()]
    (shard,) = ctx.shards([(x, y)])
    loss = mse(model, shard) * (math.nan if ctx.rank == 1 else 1.0)
    r = ctx.backward(loss)
    grads_none = all(p.grad is None for p in model.parameters())
    opt.step()
    unchanged = all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    return errors, (r.skipped, r.culprits, grads_none, unchanged)


def own_loop_cases():
    ctx = towers.init(timeout=60)
    try:
        clipped = _clipped_loop(ctx)
        scaled = _scaled_loop(ctx)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            ctx.replicate(bn_net())  # without sync_batchnorm: a warning
            bn_warning = [str(w.message) for w in caught]
        bn = _batchnorm_loop(ctx)
        rank_samples = [1, 4, 0][ctx.rank]
        means = ctx.mean(
            {"loss": torch.tensor(float(ctx.rank + 1)), "acc": 0.5 * ctx.rank}, rank_samples
        )
        mistakes = _mistakes(ctx)
    finally:
        ctx.close()
    after_close = ctx.rank, ctx.world_size, ctx.is_main  # what the rank was in the job
    return clipped, scaled, bn_warning, bn, means, mistakes, after_close


def _plain_clipped(dtype: torch.dtype):
    torch.manual_seed(0)
    model = Net().to(dtype)
    opt = torch.optim.Adam(model.parameters(), lr=0.05)
    norms, losses = [], []
    for batch in batches(dtype):
        loss = mse(model, batch)
        loss.backward()
        norms.append(float(nn.utils.clip_grad_norm_(model.parameters(), CLIP)))
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return model, norms, losses


def _plain_scaled(dtype: torch.dtype):
    torch.manual_seed(0)
    model = Net().to(dtype)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for batch in batches(dtype):
        mse(model, batch).backward()
        nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
        opt.zero_grad()
    return model, []


def _plain_batchnorm(dtype: torch.dtype):
    model = bn_net().to(dtype)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for batch in batches(dtype):
        mse(model, batch).backward()
        opt.step()
        opt.zero_grad()
    return model, []


def _references() -> tuple[Reference, Reference, Reference, Reference]:
    """The plain loops in float32 and float64 (tests/exact.py): the clipped loop's parameters
    and losses, its gradient norms, the scaled loop's and the BatchNorm loop's states."""
    (m32, n32, l32), (m64, n64, l64) = _plain_clipped(torch.float32), _plain_clipped(torch.float64)
    clipped = Reference(states(m32), states(m64), l32, l64)
    norms = Reference(states(m32), states(m64), n32, n64)
    return clipped, norms, Reference.run(_plain_scaled), Reference.run(_plain_batchnorm)


@pytest.mark.timeout(90)
def test_own_loop_open_step_matches_plain_loops():
    out = towers.spawn(own_loop_cases, 3)
    clipped_reference, norms_reference, scaled_reference, bn_reference = _references()
    for rank, (clipped, scaled, bn_warning, bn_state, means, mistakes, after_close) in enumerate(
        out
    ):
        errors, skip = mistakes
        # ctx.backward + clip_grad_norm_ + Adam == the same on the full batch, on every rank
        got_params, got_norms, got_losses = clipped
        assert max(got_norms) > CLIP  # the clipping did bite
        clipped_reference.check(got_params, f"rank {rank}, clipped")
        norms_reference.check_losses(got_norms, f"rank {rank}, gradient norms")
        clipped_reference.check_losses(got_losses, f"rank {rank}, clipped")
        # GradScaler: scale and unscale cancel; the result is the plain clipped loop's
        scaled_reference.check(scaled, f"rank {rank}, GradScaler")
        # BatchNorm: a warning without sync_batchnorm; with it, one process's result
        assert len(bn_warning) == 1 and "sync_batchnorm=True" in bn_warning[0]
        bn_reference.check(bn_state, f"rank {rank}, sync_batchnorm")
        # ctx.mean: weights 1, 4, 0 samples
        assert means["loss"] == pytest.approx((1 * 1 + 4 * 2) / 5)
        assert means["acc"] == pytest.approx((4 * 0.5) / 5)
        assert "loss.backward() was called first: remove it" in errors["twice"]
        assert "not on the same global batch" in errors["batch"]
        assert "DistributedSampler" in errors["batch"] and "rank 2: 9 samples" in errors["batch"]
        assert skip == (True, [1], True, True)
        assert after_close == (rank, 3, rank == 0)


def test_batch_stamp_names_the_disagreement_pure():
    stamp = BatchStamp(world=2)
    a = fingerprint((torch.arange(10.0), torch.ones(10)))
    b = fingerprint((torch.arange(10.0) + 1, torch.ones(10)))
    assert a != b and a == fingerprint((torch.arange(10.0), torch.ones(10)))
    same = stamp.pack(0, 4, 10, a) + stamp.pack(1, 4, 10, a)
    stamp.check(same)
    stamp.check(stamp.pack(0, 4, 10, a) + stamp.pack(1, 4, None, None))  # unknown: not compared
    with pytest.raises(ValueError, match=r"different steps \(rank 0: 4, rank 1: 5\)"):
        stamp.check(stamp.pack(0, 4, 10, a) + stamp.pack(1, 5, 10, a))
    with pytest.raises(ValueError, match="not on the same global batch") as two:
        stamp.check(stamp.pack(0, 4, 10, a) + stamp.pack(1, 4, 10, b))
    assert "a random draw made on some ranks only" in str(two.value)
    assert "drew another batch" not in str(two.value)  # of two ranks, neither is the odd one
    three = BatchStamp(world=3)
    with pytest.raises(ValueError, match=r"rank\(s\) 1 drew another batch than the others"):
        three.check(sum(three.pack(r, 4, 10, b if r == 1 else a) for r in range(3)))


def test_weighted_means_pure():
    values = [{"a": 1.0, "b": torch.tensor(3.0)}, {"a": 2.0, "b": torch.tensor(5.0)}]
    summed = mean_vector(values[0], 3) + mean_vector(values[1], 1)
    assert weighted_means(values[0], summed, 2) == {"a": 1.25, "b": 3.5}
    other = mean_vector({"a": 1.0}, 3) + mean_vector({"c": 1.0}, 1)
    with pytest.raises(ValueError, match="different metric names"):
        weighted_means({"a": 1.0}, other, 2)
    empty = weighted_means({"a": 1.0}, mean_vector({"a": math.nan}, 0), 1)
    assert math.isnan(empty["a"])
    with pytest.raises(ValueError, match="one number per metric"):
        mean_vector({"a": torch.ones(3)}, 2)


def test_replicate_refuses_a_ddp_model_and_shards_a_distributed_sampler():
    wrapped = nn.DataParallel(Net())
    dataset = TensorDataset(*regression_data(20))
    sampler = DistributedSampler(dataset, num_replicas=2, rank=0)
    with towers.init() as ctx:
        with pytest.raises(TypeError, match="pass the plain model"):
            ctx.replicate(copy.deepcopy(wrapped))
        with pytest.raises(ValueError, match="with the same SEED on every rank"):
            next(ctx.shards(DataLoader(dataset, batch_size=4, sampler=sampler)))
