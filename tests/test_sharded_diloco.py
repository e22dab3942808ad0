"""mode="diloco:H" with shard_optimizer=True: the outer state sharded over the towers.

Each tower keeps its part of the outer parameters and of the outer optimizer's state
(docs/sharding.md, "DiLoCo"). Every run is compared with tests/test_diloco.py's DiLoCo in one
process, in float32 and float64, as an unsharded run is.
"""

from __future__ import annotations

import functools
import sys
from pathlib import Path

import pytest
import torch
from helpers import make_net, mse
from test_diloco import (
    ADAM,
    DATA,
    LOOP_BATCHES,
    SGD,
    _evaluate,
    _skip,
    bn_net,
    derived,
    mse_dying_once,
)
from test_examples import run as run_command

import towers
from towers.engines.shard_rules import ALIGN


def run(steps: int, workers: int = 3, model=make_net, **kwargs):
    kwargs.setdefault("optimizer", ADAM)
    kwargs.setdefault("shard_optimizer", True)
    return towers.train(
        model(), mse, DATA, batch_size=10, steps=steps, workers=workers, mode="diloco:4",
        seed=4, progress=False, **kwargs,
    )  # fmt: skip


@pytest.mark.timeout(120)
def test_the_sharded_outer_state_trains_what_one_process_does():
    """Evaluated mid-period (every 3 steps, H = 4), the outer model is put together from the
    towers' parts."""
    got = run(13, 3, transport="shm", eval_data=DATA, eval_every=3)
    want, evals, single = derived(make_net(), DATA, batch_size=10, steps=13, workers=3,
                                  every=4, seed=4, eval_every=3)  # fmt: skip
    want.check(got.model)
    want.check_losses(got.losses)
    assert got.skipped == [] and got.updates == 13
    assert [d for d, _ in got.evals] == [d for d, _ in single.evals] == [3, 6, 9, 12, 13]
    evals.check_losses([metrics["loss"] for _, metrics in got.evals], "evaluations mid-period")


@pytest.mark.timeout(120)
def test_batchnorm_statistics_are_averaged_into_the_sharded_outer_state_over_gloo():
    got = run(13, 2, bn_net, optimizer=SGD, transport="gloo")
    want, _, _ = derived(bn_net(), DATA, batch_size=10, steps=13, workers=2, every=4,
                         inner=SGD, seed=4)  # fmt: skip
    want.check(got.model)  # the running statistics too
    want.check_losses(got.losses)
    # the outer model's count of batches is the unsharded run's (the towers' own counts are not
    # averaged into it)
    plain = run(13, 2, bn_net, optimizer=SGD, transport="gloo", shard_optimizer=False)
    count = "1.num_batches_tracked"
    assert got.model.state_dict()[count] == plain.model.state_dict()[count]


@pytest.mark.timeout(180)
def test_a_sharded_run_resumes_exactly_and_its_checkpoint_is_an_unsharded_one(tmp_path):
    """A crash mid-period resumes to the same bits; the checkpoint holds the whole outer
    state in the unsharded layout, so a run resumes it with or without sharding."""
    whole = run(11, workers=2)
    loss = functools.partial(mse_dying_once, marker=str(tmp_path / "marker"), at_call=8)
    with pytest.warns(RuntimeWarning, match=r"WorkerError.*restart 1 of 1"):
        resumed = towers.train(
            make_net(), loss, DATA, batch_size=10, steps=11, workers=2, mode="diloco:4",
            seed=4, optimizer=ADAM, progress=False, checkpoint=tmp_path / "crash",
            checkpoint_every=5, max_restarts=1, shard_optimizer=True,
        )  # fmt: skip
    assert (tmp_path / "marker").exists() and resumed.restarts == 1
    for (name, p), q in zip(resumed.model.state_dict().items(), whole.model.state_dict().values()):
        assert torch.equal(p, q), (name, p, q)
    assert resumed.losses == whole.losses
    want, _, _ = derived(make_net(), DATA, batch_size=10, steps=11, workers=2, every=4, seed=4)
    # saved sharded at step 6 (mid-period), resumed unsharded; and the other way round
    for first, then in ((True, False), (False, True)):
        where = tmp_path / f"from-{first}"
        run(11, workers=2, shard_optimizer=first, checkpoint=where, checkpoint_every=6)
        (where / "step-00000011.pt").unlink()  # the one at step 6 is the newest
        got = run(11, workers=2, shard_optimizer=then, checkpoint=where)
        want.check(got.model, f"saved with shard_optimizer={first}, resumed with {then}")
        want.check_losses(got.losses)  # the first 6 from the checkpoint's record


def own_loop(tmp: str):
    """An own loop whose outer state is sharded: 8 steps (diloco:3) with saves at steps 2
    (before any outer step) and 5, the size of each tower's part, a skipped outer step and
    evaluations mid-period."""
    ctx = towers.init()
    model = ctx.replicate(make_net(), mode="diloco:3", shard_optimizer=True)
    opt = ADAM(model.parameters())
    for shard in ctx.shards(LOOP_BATCHES[:8]):
        ctx.step(mse(model, shard), opt)
        if ctx.steps in (2, 5):
            ctx.save_checkpoint(f"{tmp}/{ctx.steps}", ctx.steps, model, opt)
    ctx.end_period()
    trained = {k: v.detach().clone() for k, v in model.state_dict().items()}
    outer = ctx._state.plan.sharded  # this tower's part of the outer state
    kept = sum(t.numel() for t in outer.kept.values())
    momentum = sum(
        s["momentum_buffer"].numel() for s in outer.optimizer.state.values() if s
    )  # fmt: skip
    # rolled back in place to step 2: the outer momentum it holds since is dropped, as
    # torch's load_state_dict drops state the file does not hold
    done, _ = ctx.load_checkpoint(f"{tmp}/2", model, opt)
    for shard in ctx.shards(LOOP_BATCHES[done:8]):
        ctx.step(mse(model, shard), opt)
    ctx.end_period()
    back = {k: v.detach().clone() for k, v in model.state_dict().items()}
    resumed = ctx.replicate(make_net(), mode="diloco:3", shard_optimizer=True)
    opt = ADAM(resumed.parameters())
    done, _ = ctx.load_checkpoint(f"{tmp}/5", resumed, opt)
    for shard in ctx.shards(LOOP_BATCHES[done:8]):
        ctx.step(mse(resumed, shard), opt)
    ctx.end_period()
    again = {k: v.detach().clone() for k, v in resumed.state_dict().items()}, back
    sharded = {"shard_optimizer": True}
    out = trained, (kept, momentum), again, _skip(ctx, **sharded), _evaluate(ctx, **sharded)
    ctx.close()
    return out


@pytest.mark.timeout(180)
def test_the_own_loop_keeps_one_outer_copy_between_its_towers(tmp_path):
    outs = towers.spawn(own_loop, 3, str(tmp_path))
    want, _, _ = derived(make_net(), DATA, batch_size=11, steps=8, workers=3, every=3,
                         batches=LOOP_BATCHES[:8])  # fmt: skip
    total = sum(p.numel() for p in make_net().parameters())
    for rank, (trained, (kept, momentum), (again, back), skip, evaluated) in enumerate(outs):
        want.check(trained, f"rank {rank}")
        # resumed from step 5 (mid-period), and rolled back to step 2 in place: the same bits
        assert all(torch.equal(again[k], v) for k, v in trained.items()), rank
        assert all(torch.equal(back[k], v) for k, v in trained.items()), rank
        # this tower's part of the outer parameters and of the momentum: a third, give or take
        # the alignment of a cut inside a parameter
        assert kept == momentum and abs(kept - total / 3) <= ALIGN, (kept, total)
        first, bad, unchanged = skip
        assert not first.skipped and bad.skipped and bad.culprits == [1] and unchanged
        start, at_outer, mid, own = evaluated
        # mid-period, the outer parameters (put together from the parts): those of the outer
        # step before, not this tower's own, which have moved on
        assert mid == at_outer and start != at_outer and own["loss"] != mid["loss"]
    # one copy between them
    assert sum(kept for _, (kept, _), *_ in outs) == total


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"mode": "diloco:4:overlap"}, r"use mode='diloco:4' \(blocking exchanges\)"),
        ({"mode": "diloco:4", "compress": "int8"}, "compressing parameters would change"),
        ({"mode": "sparseloco:4"}, "compressing parameters would change"),
        ({"mode": "diloco:4", "elastic": True}, "not available in an elastic job of mode"),
        ({"mode": "diloco:4", "outer_optimizer": torch.optim.Adagrad}, "cannot shard Adagrad"),
        ({"mode": "diloco:4", "dtype": torch.bfloat16}, "needs float32 .* torch.bfloat16 ones"),
    ],
)
def test_what_a_sharded_outer_state_cannot_serve_is_refused_before_any_worker_starts(
    kwargs, message
):
    model = make_net().to(kwargs.pop("dtype", torch.float32))
    with pytest.raises(ValueError, match=message):
        towers.train(model, mse, DATA, batch_size=10, steps=4, workers=2, progress=False,
                     shard_optimizer=True, **kwargs)  # fmt: skip


@pytest.mark.timeout(120)
def test_zero_redundancy_optimizer_in_a_diloco_job_is_refused_with_the_reason(tmp_path):
    """Under towers run --mode diloco:2, each rank's optimizer is its own: there is no one
    state for torch's sharded optimizer to share."""
    script = Path(__file__).parent / "scripts" / "ddp_zero.py"
    cmd = [sys.executable, "-m", "towers", "run", "--mode", "diloco:2", str(script), "-n", "2"]
    done = run_command([*cmd, "--", str(tmp_path), "first"], tmp_path, timeout=100)
    assert done.returncode != 0
    assert "in mode 'diloco:2' each tower steps its own optimizer on its own" in done.stdout
    assert "ValueError" in done.stdout
