"""The gradient-transform seam: a transform written here, in the test, works from train(), from
the own loop and in an elastic job that loses a worker; its state is checkpointed.

``Half`` halves every gradient before the sum: with plain SGD that is exactly the plain loop at
half the learning rate. ``HalfAfter`` does the same after the sum (a continuation on a bucket
still in flight). ``Alternate`` is stateful: it counts steps and halves every other one, so a
resumed run equals an uninterrupted one only if its state was saved and restored. The plain
loops run in float32 and in float64 over the same batches; a run of towers may be as far from the
float64 one as tests/exact.py's bound allows (a few times the float32 one's distance).
"""

from __future__ import annotations

import functools
import random
import signal
import time

import pytest
import torch
from exact import Reference
from helpers import make_net, mse
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


def _reference(lr: float, steps: int = 8) -> Reference:
    """The plain loop over ``_train``'s batches with SGD of learning rate ``lr``."""
    return Reference.of(make_net(), DATA, batch_size=14, steps=steps, optimizer=_sgd(lr))


@pytest.mark.timeout(90)
@pytest.mark.parametrize("transform", [chain(Half(), allreduce()), chain(allreduce(), HalfAfter())])
def test_a_transform_from_train_equals_half_the_learning_rate(transform):
    result = _train(transform)
    half = _reference(LR / 2)
    half.check(result.model)
    half.check_losses(result.losses)


@pytest.mark.timeout(90)
def test_the_default_chain_is_the_plain_loop():
    plain = _train(None, workers=2)
    _reference(LR).check(plain.model, "transform=None")


@pytest.mark.timeout(90)
@pytest.mark.parametrize("transport", ["shm", "gloo"])
def test_the_documented_example_transform_equals_the_plain_loop(transport):
    result = _train(Float64Sum(), transport=transport)
    want = _reference(LR)
    want.check(result.model)
    want.check_losses(result.losses)


def _own_loop(transform):
    ctx = towers.init(timeout=60)
    try:
        model = ctx.replicate(make_net(), transform=transform)
        opt = torch.optim.SGD(model.parameters(), lr=LR)
        order = BatchOrder(len(DATA[0]), 14, True, 0)
        batches = [(DATA[0][i], DATA[1][i]) for i in (next(order) for _ in range(8))]
        for shard in ctx.shards(batches):
            ctx.step(mse(model, shard), opt)
        return {k: v.detach().clone() for k, v in model.state_dict().items()}
    finally:
        ctx.close()


@pytest.mark.timeout(90)
def test_a_transform_from_the_own_loop_equals_half_the_learning_rate():
    reference = _reference(LR / 2)
    for rank, state in enumerate(towers.spawn(_own_loop, 3, chain(Half(), allreduce()))):
        reference.check(state, f"rank {rank}")


@pytest.mark.timeout(120)
@pytest.mark.slow
def test_a_transform_in_an_elastic_job_that_loses_a_worker(tmp_path):
    result, *_, hit = _run_with_faults(
        tmp_path,
        workers=3,
        transport="gloo",
        faults=[signal.SIGKILL],
        restarts=1,
        seed=random.randrange(1 << 30),
        transform=chain(Half(), allreduce()),
    )
    # the default optimizer's lr is 0.01: halved gradients, half of it
    reference = Reference.of(make_net(), _data(), batch_size=16, steps=24, optimizer=_sgd(0.005))
    assert len(hit) == 1 and result.dead_workers == [hit[0][0]]
    reference.check(result.model)
    reference.check_losses(result.losses)


def slow_mse(model, shard):
    time.sleep(0.03)  # room for the newcomer to start while the others train
    return mse(model, shard)


@pytest.mark.timeout(120)
@pytest.mark.slow
def test_workers_with_a_transform_of_no_repr_join_a_growing_job(tmp_path):
    """A newcomer compares the job's compression with its own before it is let in: a transform
    without a repr of its own (its address differs in every process) is the same transform."""
    x, y = _data()
    result = towers.train(
        make_net(), slow_mse, (x, y), batch_size=16, steps=24, workers=3, elastic=True,
        min_workers=2, transform=chain(Half(), allreduce()), transport="gloo", timeout=30,
        progress=False,
    )  # fmt: skip
    reference = Reference.of(make_net(), (x, y), batch_size=16, steps=24, optimizer=_sgd(0.005))
    assert result.world[0] == 2 and result.world[-1] == 3, result.world
    reference.check(result.model)
    reference.check_losses(result.losses)


@pytest.mark.timeout(120)
def test_transform_state_is_checkpointed_and_resumed(tmp_path):
    uninterrupted = _train(Alternate(), steps=8)
    _train(Alternate(), steps=5, checkpoint=tmp_path, checkpoint_every=5)
    resumed = _train(Alternate(), steps=8, checkpoint=tmp_path)
    # the same arithmetic in the same order: the same bits
    for (name, p), q in zip(resumed.model.named_parameters(), uninterrupted.model.parameters()):
        assert torch.equal(p, q), name
    assert resumed.losses == uninterrupted.losses
    # the alternation is real: the run is the plain loop at the learning rate halved every other
    # step, which is neither the plain loop nor halving every step
    alternating = Reference.of(
        make_net(), DATA, batch_size=14, steps=8, optimizer=_sgd(LR),
        lr_schedule=lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, lambda k: 1 - k % 2 / 2),
    )  # fmt: skip
    alternating.check(uninterrupted.model)
    alternating.check_losses(uninterrupted.losses)
    for lr in (LR, LR / 2):
        other = _reference(lr).model["fc1.weight"]
        assert not torch.allclose(other, alternating.model["fc1.weight"]), (
            f"the plain loop at lr {lr} ends where halving every other step does (within "
            f"torch.allclose's default 1e-5): the alternation would not show"
        )


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
