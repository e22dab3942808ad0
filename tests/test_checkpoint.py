"""Checkpoints: atomic files, exact resume, fallback past a damaged file, automatic restarts."""

from __future__ import annotations

import functools
import math
import os
import signal
from pathlib import Path

import pytest
import torch
from exact import Reference, as_float64
from helpers import make_net, mse, regression_data

import towers
from towers.engines import checkpoint as _checkpoint

ADAM = functools.partial(torch.optim.Adam, lr=0.05)
DECAY = functools.partial(torch.optim.lr_scheduler.StepLR, step_size=2, gamma=0.7)
DATA = regression_data(23)  # batches of 5: 5 per epoch, the last of 3 samples


def run(steps, workers=2, **kwargs):
    return towers.train(
        make_net(),
        mse,
        DATA,
        batch_size=5,
        steps=steps,
        workers=workers,
        optimizer=ADAM,
        lr_schedule=DECAY,
        seed=11,
        progress=False,
        **kwargs,
    )


def assert_like_one_process(result, steps, what="towers"):
    """``result`` (a run of :func:`run`, resumed or not) is the plain loop's over the same
    global batches, within the bound :class:`exact.Reference` derives from float64: losses,
    each tower's loss on the split the run chose, parameters."""
    reference = Reference.of(
        make_net(), DATA, batch_size=5, steps=steps, optimizer=ADAM, lr_schedule=DECAY,
        seed=11, towers=len(result.shards[0]), shards=result.shards,  # the split it chose
    )  # fmt: skip
    assert result.skipped == [] == reference.skipped and result.steps == steps
    batches = ([5, 5, 5, 5, 3] * 3)[:steps]  # 23 samples: 5 batches an epoch, the last of 3
    assert [sum(s) for s in result.shards] == batches and result.samples == sum(batches)
    reference.check_losses(result.losses, what)
    reference.check_tower_losses(result.tower_losses, what)
    reference.check(result.model, what)


def assert_identical(a, b):
    """Two runs that did the same arithmetic in the same order: equal bit for bit."""
    assert a.losses == b.losses and a.shards == b.shards and a.skipped == b.skipped
    assert (a.steps, a.samples) == (b.steps, b.samples)
    for u, v in zip(a.tower_losses, b.tower_losses, strict=True):  # nan: a tower without samples
        assert len(u) == len(v) and all(
            x == y or (math.isnan(x) and math.isnan(y)) for x, y in zip(u, v)
        ), (u, v)
    for (name, p), q in zip(a.model.state_dict().items(), b.model.state_dict().values()):
        assert torch.equal(p, q), name


@pytest.mark.timeout(90)
def test_resume_ends_where_an_uninterrupted_run_ends(tmp_path):
    # the uninterrupted run: the plain loop (towers' own equals it, tests/test_train_sync.py)
    # 7 steps (mid-epoch), then resume to 12 with another number of workers
    first = run(7, checkpoint=tmp_path, checkpoint_every=3)
    assert [s for s, _ in _checkpoint.checkpoint_files(tmp_path)] == [7, 6]
    resumed = run(12, workers=3, checkpoint=tmp_path, checkpoint_every=3)
    assert resumed.steps == 12 and len(resumed.losses) == 12
    assert_like_one_process(first, 7, "the first 7 steps")
    assert_like_one_process(resumed, 12, "resumed at step 7 with 3 workers")
    assert resumed.losses[:7] == first.losses  # the record of the steps before the resume
    assert [len(t) for t in resumed.tower_losses] == [2] * 7 + [3] * 5
    # a finished run asked again returns its result without training
    again = run(12, checkpoint=tmp_path)
    assert_identical(again, resumed)


@pytest.mark.timeout(90)
def test_damaged_newest_checkpoint_falls_back_with_a_warning(tmp_path):
    run(6, checkpoint=tmp_path, checkpoint_every=2)
    newest = tmp_path / "step-00000006.pt"
    newest.write_bytes(newest.read_bytes()[:100])  # truncated, as by a crash mid-copy
    with pytest.warns(RuntimeWarning, match="step-00000006.pt cannot be read"):
        resumed = run(10, checkpoint=tmp_path, checkpoint_every=2)
    assert_like_one_process(resumed, 10, "resumed from step 4")


def test_checkpoints_hold_no_arbitrary_objects(tmp_path):
    class Payload:
        def __reduce__(self):
            return (os.system, ("echo should never run",))

    torch.save({"step": 3, "evil": Payload()}, tmp_path / "step-00000003.pt")
    with (
        pytest.warns(RuntimeWarning, match="cannot be read"),
        pytest.raises(RuntimeError, match=r"no checkpoint .* can be read"),
    ):
        _checkpoint.load_latest(tmp_path, "loop")


def test_checkpoint_mismatch_is_refused(tmp_path):
    run(3, workers=1, checkpoint=tmp_path)
    with pytest.raises(ValueError, match="made with batch_size=5, this run has batch_size=4"):
        towers.train(
            make_net(), mse, DATA, batch_size=4, steps=6, workers=1, seed=11, checkpoint=tmp_path
        )
    with pytest.raises(ValueError, match="at step 3, beyond steps=2"):
        run(2, workers=1, checkpoint=tmp_path)


def mse_dying_once(model, shard, marker: str, at_call: int):
    """Rank 1 kills itself at its ``at_call``-th loss, the first time only."""
    # counted in rank 1 only: a worker forked from the caller starts with the caller's count
    if os.environ.get("RANK") == "1":
        mse_dying_once.calls = getattr(mse_dying_once, "calls", 0) + 1
    if os.environ.get("RANK") == "1" and mse_dying_once.calls == at_call:
        path = Path(marker)
        if not path.exists():
            path.write_text("died once")
            os.kill(os.getpid(), signal.SIGKILL)
    return mse(model, shard)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("with_dir", [True, False])
def test_max_restarts_resumes_after_a_crash(tmp_path, with_dir):
    loss = functools.partial(mse_dying_once, marker=str(tmp_path / "marker"), at_call=7)
    checkpoint = tmp_path / "ckpt" if with_dir else None
    with pytest.warns(RuntimeWarning, match=r"WorkerError.*restart 1 of 2"):
        result = towers.train(
            make_net(),
            loss,
            DATA,
            batch_size=5,
            steps=10,
            workers=2,
            optimizer=ADAM,
            lr_schedule=DECAY,
            seed=11,
            progress=False,
            checkpoint=checkpoint,
            checkpoint_every=4,
            max_restarts=2,
        )
    assert (tmp_path / "marker").exists() and result.restarts == 1
    assert_like_one_process(result, 10, "restarted after a crash")


@pytest.mark.timeout(60)
def test_without_restarts_the_crash_is_reported(tmp_path):
    loss = functools.partial(mse_dying_once, marker=str(tmp_path / "marker"), at_call=2)
    with pytest.raises(towers.WorkerError, match="worker 1"):
        towers.train(make_net(), loss, DATA, batch_size=5, steps=5, workers=2, progress=False)


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_own_loop_resumes_under_torchrun_max_restarts(tmp_path):
    import subprocess
    import sys

    from towers.comm.net import free_port

    scripts = Path(__file__).parent / "scripts"
    src = str(Path(__file__).resolve().parents[1] / "src")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2"]
    cmd += ["--max-restarts", "1", "--master-port", str(free_port())]
    cmd += [str(scripts / "restarting_loop.py"), str(tmp_path)]
    env = {**os.environ, "PYTHONPATH": src}
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=100)
    assert out.returncode == 0, out.stdout + out.stderr
    assert (tmp_path / "died").read_text() == "rank 1 died at step 5"
    # the restarted ranks resumed from the checkpoint of step 4, not from the start
    assert (tmp_path / "log").read_text() == "started at 4\n"

    sys.path.insert(0, str(scripts))
    try:
        import restarting_loop as script
    finally:
        sys.path.remove(str(scripts))

    def plain_loop(dtype: torch.dtype) -> tuple[torch.nn.Module, list[float]]:
        model = script.build_model().to(dtype)
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        losses = []
        for batch in script.global_batches():
            opt.zero_grad()
            loss = script.loss_fn(model, batch if dtype == torch.float32 else as_float64(batch))
            loss.backward()
            opt.step()
            losses.append(loss.item())
        return model, losses

    final = torch.load(tmp_path / "final.pt", weights_only=True)
    Reference.run(plain_loop).check(final, "restarted under torchrun")


def test_an_own_loop_resumes_a_train_checkpoint_and_train_refuses_a_loops(tmp_path):
    """One layout: ``ctx.load_checkpoint`` continues what ``towers.train`` saved, and ends where
    one process ends; ``train`` cannot know where a loop's batches stood in its data order."""
    run(3, workers=1, checkpoint=tmp_path / "train")
    ctx = towers.init()
    model = ctx.replicate(make_net())
    opt = ADAM(model.parameters())
    schedule = DECAY(opt)
    assert ctx.load_checkpoint(tmp_path / "train", model, opt, schedule) == (3, {})
    order = torch.utils.data.DataLoader(
        torch.utils.data.TensorDataset(*DATA),
        batch_size=5,
        shuffle=True,
        generator=torch.Generator().manual_seed(11),
    )  # train's order of global batches
    batches = [tuple(b) for _ in range(2) for b in order][:6]  # an epoch is 5 batches
    for shard in ctx.shards(batches[3:]):
        ctx.step(mse(model, shard), opt)
        schedule.step()
    Reference.of(
        make_net(), DATA, batch_size=5, steps=6, optimizer=ADAM, lr_schedule=DECAY, seed=11
    ).check(model, "train's 3 steps, then an own loop's 3")
    ctx.save_checkpoint(tmp_path / "loop", 6, model, opt, schedule)
    with pytest.raises(
        ValueError,
        match=r"holds checkpoints of an own training loop .*, not of "
        r"towers.train in sync mode \(an own loop brings its own batches",
    ):
        run(8, workers=1, checkpoint=tmp_path / "loop")
    ctx.close()


def test_an_own_loop_refuses_a_checkpoint_of_another_mode(tmp_path):
    run(4, workers=1, checkpoint=tmp_path)
    ctx = towers.init()
    model = ctx.replicate(make_net(), mode="diloco:2")
    opt = ADAM(model.parameters())
    with pytest.raises(
        ValueError,
        match=r"is of a 'sync' run, this loop replicates its model in "
        r"mode 'diloco:2'; pass mode='sync' to ctx.replicate",
    ):
        ctx.load_checkpoint(tmp_path, model, opt)
    ctx.close()


def _flat(state):
    """``state`` (today's layout) as version 3 wrote it: its parts side by side at the top;
    DiLoCo's outer model as ``model``, its own keys under ``diloco``; a loop's without its
    mode."""
    flat = {k: v for k, v in state.items() if k not in ("sha256", "replica", "streams", "plan")}
    replica = state["replica"] or state["plan"]["ranks"][0]["local"]
    flat |= {k: v for k, v in replica.items() if k != "model"} | state["streams"]
    if state["plan"]:
        flat["diloco"] = state["plan"]
    if state["kind"] == "loop":
        del flat["mode"]
    flat["version"] = 3
    return flat


def test_checkpoints_of_the_first_format_are_read(tmp_path):
    """Files written before the header named its kind (format 1) still resume."""
    whole = run(6, workers=1)  # in this process: the resumed run repeats its arithmetic
    run(4, workers=1, checkpoint=tmp_path)
    state = _flat(torch.load(tmp_path / "step-00000004.pt", weights_only=True))
    old = {k: v for k, v in state.items() if k not in ("kind", "version", "scheduled", "sha256")}
    old["format"] = 1
    old["history"] = old.pop("record")
    for path in tmp_path.iterdir():
        path.unlink()
    torch.save(old, tmp_path / "step-00000004.pt")
    assert_identical(run(6, workers=1, checkpoint=tmp_path), whole)


def test_a_corrupt_or_empty_newest_file_falls_back_naming_both(tmp_path):
    run(4, workers=1, checkpoint=tmp_path, checkpoint_every=2)
    newest, previous = tmp_path / "step-00000004.pt", tmp_path / "step-00000002.pt"
    raw = newest.read_bytes()
    weight = torch.load(newest, weights_only=True)["model"]["fc1.weight"]
    at = raw.index(weight.numpy().tobytes())
    flipped = bytes(b ^ 0x7F for b in raw[at : at + 8])  # 8 bytes of one tensor, as a bad disk
    newest.write_bytes(raw[:at] + flipped + raw[at + 8 :])
    pattern = (
        rf"{newest} cannot be read .*sha256.*corrupt.*resuming from the previous one, {previous}"
    )
    with pytest.warns(RuntimeWarning, match=pattern):
        assert _checkpoint.load_latest(tmp_path, "sync")["step"] == 2
    newest.write_bytes(b"")
    with pytest.warns(RuntimeWarning, match=rf"{newest} cannot be read .*empty.*{previous}"):
        assert _checkpoint.load_latest(tmp_path, "sync")["step"] == 2


def _diloco_loop(directory: Path, steps: range, save_at: int | None) -> dict[str, torch.Tensor]:
    """An own loop in ``diloco:4`` over ``steps`` of one fixed stream of batches, resuming from
    ``directory``; saves after ``save_at`` steps. Returns the trained (outer) parameters."""
    x, y = regression_data(n=64)
    ctx = towers.init()
    model = ctx.replicate(make_net(), mode="diloco:4")
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    start, _ = ctx.load_checkpoint(directory, model, opt)
    assert start == steps.start
    for k in steps:
        ctx.step(mse(model, (x[k * 8 : k * 8 + 8], y[k * 8 : k * 8 + 8])), opt)
        if ctx.steps == save_at:
            ctx.save_checkpoint(directory, ctx.steps, model, opt)
    ctx.end_period()
    trained = {k: v.clone() for k, v in model.state_dict().items()}
    ctx.close()
    return trained


def test_own_loop_checkpoints_of_the_previous_layouts_resume(tmp_path):
    """Before version 4 a checkpoint's parts lay side by side at the top; before version 3 an
    own loop kept its mode's keys under ``plan`` and its local model as ``model``. Such files
    resume as the current layout does."""
    whole = _diloco_loop(tmp_path / "whole", range(8), None)
    _diloco_loop(tmp_path / "new", range(6), save_at=6)  # mid-period: inner steps pending
    resumed = _diloco_loop(tmp_path / "new", range(6, 8), None)
    path = tmp_path / "new" / "step-00000006.pt"
    state = torch.load(path, weights_only=True)
    assert state["version"] == _checkpoint.VERSION and state["replica"] is None
    three = _flat(state)
    plan = {"model": three["model"], "diloco": three["diloco"]}
    two = {k: v for k, v in three.items() if k != "diloco"}
    two |= {"version": 2, "plan": plan, "model": plan["diloco"]["ranks"][0]["local"]["model"]}
    for name, old in [("three", three), ("two", two)]:
        old["sha256"] = _checkpoint.digest(old)
        (tmp_path / name).mkdir()
        torch.save(old, tmp_path / name / path.name)
    from_three = _diloco_loop(tmp_path / "three", range(6, 8), None)
    from_two = _diloco_loop(tmp_path / "two", range(6, 8), None)
    for name, value in whole.items():  # one process each: the same arithmetic, bit for bit
        assert torch.equal(resumed[name], value), name
        assert torch.equal(from_three[name], value), name
        assert torch.equal(from_two[name], value), name
