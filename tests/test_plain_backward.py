"""A DDP loop keeps its own lines: ``loss.backward()``, ``clip_grad_norm_``, ``optimizer.step()``
and ``zero_grad()`` on the model ``ctx.replicate`` returned, compared with one process."""

from __future__ import annotations

import importlib.util
import math
import os
import subprocess
import sys
import warnings

import pytest
import torch
from exact import Reference, as_float64
from helpers import SCRIPTS, make_net, mse, regression_data

import towers
from towers.comm.net import free_port
from towers.core.split import cut

STEPS, BATCH = 8, 14  # 14 over 3 ranks: shards of 5, 5 and 4


def _batches(n_batches: int, size: int):
    x, y = regression_data(n=n_batches * size)
    return [(x[k * size : (k + 1) * size], y[k * size : (k + 1) * size]) for k in range(n_batches)]


def _ddp_loop(accumulate: str | None = None, nan_at: int | None = None, sharded: bool = False):
    """Steps as a DDP script writes them; ``accumulate``: two micro-batches a step, kept local
    by ``ctx.no_sync()`` or by nanoGPT's ``require_backward_grad_sync``; ``sharded``: the
    optimizer's state sharded over the towers."""
    ctx = towers.init(timeout=60)
    model = ctx.replicate(make_net(), balance=False, shard_optimizer=sharded)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    micro = 2 if accumulate else 1
    batches = _batches(STEPS * micro, BATCH)
    if nan_at is not None:
        batches[nan_at][0][-1, 0] = math.nan  # the last rank's shard
    shards = iter(ctx.shards(batches))
    results = []
    for _ in range(STEPS):
        opt.zero_grad()
        for m in range(micro):
            shard = next(shards)
            last = m == micro - 1
            loss = mse(model, shard) / micro
            if accumulate == "no_sync" and not last:
                with ctx.no_sync():
                    loss.backward()
            else:
                model.require_backward_grad_sync = last  # nanoGPT's way (harmless otherwise)
                loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        results.append(ctx.last)
    ctx.close()
    return results, _state(model)


def _state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _one_process(accumulate: bool = False, nan_at: int | None = None) -> Reference:
    """The same steps in one plain process, in float32 and in float64 (tests/exact.py)."""

    def loop(dtype: torch.dtype):
        model = make_net().to(dtype)
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        micro = 2 if accumulate else 1
        batches = _batches(STEPS * micro, BATCH)
        if nan_at is not None:
            batches[nan_at][0][-1, 0] = math.nan
        batches = [as_float64(b) if dtype == torch.float64 else b for b in batches]
        for k in range(STEPS):
            opt.zero_grad()
            for m in range(micro):
                (mse(model, batches[k * micro + m]) / micro).backward()
            if all(torch.isfinite(p.grad).all() for p in model.parameters()):
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                opt.step()
        return model, []

    return Reference.run(loop)


@pytest.mark.timeout(120)
def test_loss_backward_on_the_replicated_model_trains_as_one_process():
    ranks = towers.spawn(_ddp_loop, 3, timeout=100)
    expected = _one_process()
    for rank, (results, params) in enumerate(ranks):
        expected.check(params, f"rank {rank}")
        assert [r.tower_samples for r in results] == [[5, 5, 4]] * STEPS
        assert all(math.isnan(r.loss) and not r.skipped for r in results)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("accumulate", ["no_sync", "require_backward_grad_sync"])
def test_accumulation_stays_local_until_the_last_micro_batch(accumulate):
    ranks = towers.spawn(_ddp_loop, 2, accumulate, timeout=100)
    expected = _one_process(accumulate=True)
    for rank, (results, params) in enumerate(ranks):
        expected.check(params, f"rank {rank}")
        assert [r.tower_samples for r in results] == [[14, 14]] * STEPS  # two shards of 7 each


def _warned(*args):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        results, params = _ddp_loop(*args)
    return results, params, [str(w.message) for w in caught if "skipped" in str(w.message)]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("sharded", [False, True])
def test_a_non_finite_gradient_skips_the_step_on_every_rank(sharded):
    ranks = towers.spawn(_warned, 3, None, 3, sharded, timeout=100)
    expected = _one_process(nan_at=3)
    for rank, (results, params, said) in enumerate(ranks):
        expected.check(params, f"rank {rank}")
        assert [k for k, r in enumerate(results) if r.skipped] == [3]
        assert results[3].culprits == [2]
        # rank 0 says so once, and what a GradScaler does with it
        assert len(said) == (rank == 0)
    assert "step 3 skipped: a gradient was not finite on tower(s) 2" in ranks[0][2][0]
    assert "holds NaN on every rank, the next optimizer.step() changes nothing" in ranks[0][2][0]


def _scaled_loop(transport: str) -> tuple[list[float], dict[str, torch.Tensor]]:
    """A GradScaler over the script's own ``scaler.scale(loss).backward()``, the optimizer's
    state sharded; one sample of step 1's last shard is infinite."""
    ctx = towers.init(timeout=60, transport=transport)
    try:
        model = ctx.replicate(make_net(), shard_optimizer=True)
        opt = torch.optim.AdamW(model.parameters(), lr=0.05)
        scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
        scales = []
        for shard in ctx.shards(_infinite_at_1()):
            scaler.scale(mse(model, shard)).backward()
            scaler.unscale_(opt)
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
            scales.append(scaler.get_scale())
        return scales, _state(model)
    finally:
        ctx.close()


def _infinite_at_1() -> list:
    batches = _batches(4, BATCH)
    batches[1][0][-1, 0] = math.inf
    return batches


@pytest.mark.timeout(120)
@pytest.mark.parametrize("transport", ["shm", "gloo"])
def test_a_scaler_over_a_plain_backward_skips_a_sharded_step_as_one_process(transport):
    """The skipped step's gradients hold NaN on every rank, as unsharded: the scaler finds the
    inf, skips the step and halves its scale (it used to find no gradient and fail)."""

    def loop(dtype: torch.dtype):
        model = make_net().to(dtype)
        opt = torch.optim.AdamW(model.parameters(), lr=0.05)
        scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
        for batch in _infinite_at_1():
            batch = as_float64(batch) if dtype == torch.float64 else batch
            scaler.scale(mse(model, batch)).backward()
            scaler.unscale_(opt)
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
        return model, []

    expected = Reference.run(loop)
    for rank, (scales, params) in enumerate(towers.spawn(_scaled_loop, 3, transport)):
        assert scales == [1024.0, 512.0, 512.0, 512.0], scales
        expected.check(params, f"{transport}, rank {rank}")


def _prefetching_loop(micro: int, batch: int):
    """nanoGPT's loop: each micro-batch drawn from the global RNG one ahead of its step, its
    shard taken with ``ctx.shard`` at the forward, ``loss / micro`` and the flag of DDP."""
    ctx = towers.init(timeout=60)
    torch.manual_seed(0)  # the same draws on every rank
    model = ctx.replicate(make_net())  # balanced where that stays exact: shards may be uneven
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    draw = lambda: regression_data(n=batch, seed=int(torch.randint(1 << 30, ())))  # noqa: E731
    x, y = draw()
    samples = []
    for _ in range(STEPS):
        for m in range(micro):
            model.require_backward_grad_sync = m == micro - 1
            loss = mse(model, ctx.shard((x, y))) / micro
            x, y = draw()  # the next micro-batch, drawn before this one's backward
            loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        samples.append(sum(ctx.last.tower_samples))
    ctx.close()
    return samples, _state(model)


def _prefetching_one_process(micro: int, batch: int) -> Reference:
    def loop(dtype: torch.dtype):
        torch.manual_seed(0)
        model = make_net().to(dtype)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)

        def draw():
            xy = regression_data(n=batch, seed=int(torch.randint(1 << 30, ())))
            return as_float64(xy) if dtype == torch.float64 else xy

        x, y = draw()
        for _ in range(STEPS):
            for _ in range(micro):
                loss = mse(model, (x, y)) / micro
                x, y = draw()
                loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        return model, []

    return Reference.run(loop)


@pytest.mark.timeout(120)
def test_a_prefetching_loop_with_ctx_shard_trains_as_one_process():
    ranks = towers.spawn(_prefetching_loop, 3, 2, 10, timeout=100)
    expected = _prefetching_one_process(2, 10)
    for rank, (samples, params) in enumerate(ranks):
        expected.check(params, f"rank {rank}")
        assert samples == [20] * STEPS  # each step weighs its own two micro-batches


@pytest.mark.timeout(60)
def test_an_empty_shard_under_loss_backward_is_named():
    with pytest.raises(RuntimeError, match=r"a global batch of 2 samples over 3 towers"):
        towers.spawn(_prefetching_loop, 3, 1, 2, timeout=30)


def _without_shards() -> str:
    ctx = towers.init()
    model = ctx.replicate(make_net())
    x, y = regression_data(n=4)
    try:
        mse(model, (x, y)).backward()
    except RuntimeError as exc:
        return str(exc)
    finally:
        ctx.close()
    return "no error"


def test_mistakes_are_named_at_the_first_backward():
    assert "no shard was taken with ctx.shards()" in _without_shards()
    ctx = towers.init()
    model = ctx.replicate(make_net(), mode="diloco:2")
    shard = next(iter(ctx.shards([regression_data(n=4)])))
    with pytest.raises(RuntimeError, match=r"in DiLoCo each tower steps alone.*ctx\.step"):
        mse(model, shard).backward()
    ctx.close()


def test_a_single_process_keeps_its_loop_unchanged():
    """One rank: the plain loop's numbers, its losses included where ctx.step is used."""
    ctx = towers.init()
    model = ctx.replicate(make_net())
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for shard in ctx.shards(_batches(STEPS, BATCH)):
        opt.zero_grad()
        mse(model, shard).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
    assert ctx.steps == STEPS and ctx.last.tower_samples == [BATCH]
    ctx.close()
    _one_process().check(model, "one rank")
    assert cut(torch.arange(3), [3])[0].tolist() == [0, 1, 2]


def _one_process_of_the_script() -> Reference:
    spec = importlib.util.spec_from_file_location("ddp_habits", SCRIPTS / "ddp_habits.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)

    def loop(dtype: torch.dtype):
        model = script.build().to(dtype)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        torch.manual_seed(1337)
        for _ in range(script.STEPS):
            opt.zero_grad(set_to_none=True)
            for _ in range(script.MICRO):
                x, y = script.get_batch()
                x, y = x.to(dtype), y.to(dtype)
                ((model(x) - y).square().mean() / script.MICRO).backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
        return model, []

    return Reference.run(loop)


@pytest.mark.slow
@pytest.mark.timeout(180)
@pytest.mark.parametrize("launcher", ["towers run", "torchrun"])
def test_a_ddp_script_with_its_setup_changed_equals_one_process(tmp_path, launcher):
    out, script = tmp_path / "params.pt", str(SCRIPTS / "ddp_habits.py")
    if launcher == "torchrun":
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
               "--master-port", str(free_port()), script, str(out)]  # fmt: skip
    else:
        cmd = [sys.executable, "-m", "towers", "run", script, "-n", "2", "--", str(out)]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    # one job: it trains and saves, then trains again with rank 0's extra draw, refused
    done = subprocess.run(
        [*cmd, "--rank0-eval"], capture_output=True, text=True, timeout=150, env=env
    )
    said = done.stdout[-3000:] + done.stderr[-3000:]
    assert done.returncode != 0, said
    assert "a random draw made on some ranks only" in done.stdout + done.stderr, said
    _one_process_of_the_script().check(torch.load(out), f"rank 0 under {launcher}")
