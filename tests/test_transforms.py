"""The gradient-transform seam: a transform written here, in the test, works from train(), from
the own loop and in an elastic job that loses a worker; its state is checkpointed.

``Half`` halves every gradient before the sum: with plain SGD that is exactly the plain loop at
half the learning rate. ``HalfAfter`` does the same after the sum (a continuation on a bucket
still in flight). ``Alternate`` is stateful: it counts steps and halves every other one, so a
resumed run equals an uninterrupted one only if its state was saved and restored.
"""

from __future__ import annotations

import functools
import random
import signal
import time

import pytest
import torch
from helpers import assert_close_lists, assert_same_parameters, make_net, mse, reference_loop
from test_elastic import _data, _run_with_faults

import towers
from towers.core.data import BatchOrder
from towers.transforms import Bucket, BucketLayout, allreduce, chain, sum_tail

LR = 0.1
DATA = _data(60)


class Half:
    """Every gradient halved before the sum."""

    def init(self, layouts):
        return None

    def reduce(self, state, bucket, comm):
        bucket.grads.mul_(0.5)
        return bucket, state


class HalfAfter:
    """Every summed gradient halved, once the sum has arrived."""

    def init(self, layouts):
        return None

    def reduce(self, state, bucket, comm):
        def halve(b: Bucket) -> Bucket:
            b.grads.mul_(0.5)
            return b

        return bucket.then(halve), state


class Alternate:
    """Halves the gradients of every other step: the state is the number of steps seen."""

    def init(self, layouts):
        return {"steps": 0, "buckets": len(layouts)}

    def reduce(self, state, bucket, comm):
        if state["steps"] % 2:
            bucket.grads.mul_(0.5)
        last = bucket.index == state["buckets"] - 1
        return allreduce().reduce(None, bucket, comm)[0], {
            "steps": state["steps"] + last,
            "buckets": state["buckets"],
        }


class Float64Sum:
    """docs/architecture.md's example: sums in float64 on the wire, counts its steps."""

    def init(self, layouts):
        return {"steps": 0, "last": len(layouts) - 1}

    def reduce(self, state, bucket, comm):
        wide = bucket.grads.double()
        works = [comm.all_reduce_sum(wide), *sum_tail(bucket, comm)]

        def land(b):
            b.grads.copy_(wide)
            return b

        counted = state["steps"] + (bucket.index == state["last"])
        return bucket.after(works).then(land), {**state, "steps": counted}


def _sgd(lr: float):
    return functools.partial(torch.optim.SGD, lr=lr)


def _train(transform, workers=3, steps=8, **kw):
    return towers.train(
        make_net(),
        mse,
        DATA,
        batch_size=14,
        steps=steps,
        workers=workers,
        optimizer=_sgd(LR),
        transform=transform,
        progress=False,
        **kw,
    )


def _reference(lr: float, steps: int = 8):
    model = make_net()
    losses, _, _ = reference_loop(
        model, DATA, batch_size=14, steps=steps, optimizer=_sgd(lr), loss_fn=mse
    )
    return model, losses


@pytest.mark.timeout(90)
@pytest.mark.parametrize("transform", [chain(Half(), allreduce()), chain(allreduce(), HalfAfter())])
def test_a_transform_from_train_equals_half_the_learning_rate(transform):
    result = _train(transform)
    model, losses = _reference(LR / 2)
    assert_same_parameters(result.model, model)
    assert_close_lists(result.losses, losses)
    # and the default chain is the plain loop itself
    plain = _train(None, workers=2)
    model, losses = _reference(LR)
    assert_same_parameters(plain.model, model)


@pytest.mark.timeout(90)
@pytest.mark.parametrize("transport", ["shm", "gloo"])
def test_the_documented_example_transform_equals_the_plain_loop(transport):
    result = _train(Float64Sum(), transport=transport)
    model, losses = _reference(LR)
    assert_same_parameters(result.model, model)
    assert_close_lists(result.losses, losses)


def _own_loop(transform):
    ctx = towers.init(timeout=60)
    try:
        model = ctx.replicate(make_net(), transform=transform)
        opt = torch.optim.SGD(model.parameters(), lr=LR)
        order = BatchOrder(len(DATA[0]), 14, True, 0)
        batches = [(DATA[0][i], DATA[1][i]) for i in (next(order) for _ in range(8))]
        for shard in ctx.shards(batches):
            ctx.step(mse(model, shard), opt)
        return [p.detach().clone() for p in model.parameters()]
    finally:
        ctx.close()


@pytest.mark.timeout(90)
def test_a_transform_from_the_own_loop_equals_half_the_learning_rate():
    reference, _ = _reference(LR / 2)
    for params in towers.spawn(_own_loop, 3, chain(Half(), allreduce())):
        for p, q in zip(params, reference.parameters(), strict=True):
            torch.testing.assert_close(p, q.detach(), rtol=1e-5, atol=1e-6)


@pytest.mark.timeout(120)
def test_a_transform_in_an_elastic_job_that_loses_a_worker(tmp_path):
    result, _, _, hit = _run_with_faults(
        tmp_path,
        workers=3,
        transport="gloo",
        faults=[signal.SIGKILL],
        restarts=1,
        seed=random.randrange(1 << 30),
        transform=chain(Half(), allreduce()),
    )
    x, y = _data()
    reference = make_net()  # the default optimizer's lr is 0.01: halved gradients, half of it
    losses, _, _ = reference_loop(
        reference, (x, y), batch_size=16, steps=24, optimizer=_sgd(0.01 / 2), loss_fn=mse
    )
    assert len(hit) == 1 and result.dead_workers == [hit[0][0]]
    assert_same_parameters(result.model, reference)
    assert_close_lists(result.losses, losses)


def slow_mse(model, shard):
    time.sleep(0.03)  # room for the newcomer to start while the others train
    return mse(model, shard)


@pytest.mark.timeout(120)
def test_workers_with_a_transform_of_no_repr_join_a_growing_job(tmp_path):
    """A newcomer compares the job's compression with its own before it is let in: a transform
    without a repr of its own (its address differs in every process) is the same transform."""
    x, y = _data()
    result = towers.train(
        make_net(), slow_mse, (x, y), batch_size=16, steps=24, workers=3, elastic=True,
        min_workers=2, transform=chain(Half(), allreduce()), transport="gloo", timeout=30,
        progress=False,
    )  # fmt: skip
    reference = make_net()
    losses, _, _ = reference_loop(
        reference, (x, y), batch_size=16, steps=24, optimizer=_sgd(0.01 / 2), loss_fn=mse
    )
    assert result.world[0] == 2 and result.world[-1] == 3, result.world
    assert_same_parameters(result.model, reference)
    assert_close_lists(result.losses, losses)


@pytest.mark.timeout(120)
def test_transform_state_is_checkpointed_and_resumed(tmp_path):
    uninterrupted = _train(Alternate(), steps=8)
    _train(Alternate(), steps=5, checkpoint=tmp_path, checkpoint_every=5)
    resumed = _train(Alternate(), steps=8, checkpoint=tmp_path)
    assert_same_parameters(resumed.model, uninterrupted.model, rtol=0, atol=0)
    assert resumed.losses == uninterrupted.losses
    # the alternation is real: it is neither the plain run nor halving every step
    for other in (_train(None, steps=8), _train(chain(Half(), allreduce()), steps=8)):
        assert not torch.allclose(other.model.fc1.weight, uninterrupted.model.fc1.weight)


def test_transforms_are_checked_before_any_worker_starts():
    with pytest.raises(TypeError, match="transform must be a gradient transform"):
        _train(object())
    with pytest.raises(TypeError, match="chain\\(\\) takes gradient transforms"):
        chain(Half(), 3)
    with pytest.raises(ValueError, match="transform= applies to mode='sync'"):
        _train(Half(), mode="async")


def test_bucket_continuations_run_in_order_when_waited_for():
    seen: list[str] = []
    b = Bucket(0, torch.ones(3))

    def step(name: str):
        def run(x: Bucket) -> Bucket:
            seen.append(name)
            return x

        return run

    out = b.then(step("a")).then(step("b"))
    assert seen == []  # lazy: nothing runs until the driver waits
    assert out.wait().grads is b.grads and seen == ["a", "b"]
    layout = BucketLayout(0, ((2, 3), (4,)), ((0, 6), (6, 10)), torch.float32, torch.device("cpu"))
    assert layout.numel == 10
