"""The asynchronous engine: the parameter server's modes, staleness, dead and slow workers.

Multi-process tests spawn one server and 1-4 Gloo workers on 127.0.0.1 (one spawn per test).
Reference values are computed in the test from plain PyTorch or the sync engine, never typed in.
"""

from __future__ import annotations

import collections
import copy
import functools
import math
import os
import signal
import threading
import time
from pathlib import Path

import pytest
import torch
from conftest import descendants
from exact import Reference

import towers
from towers.core.data import BatchCache, batch_len, global_batches
from towers.engines.checkpoint import checkpoint_files
from towers.engines.ps.actions import (
    Ahead,
    Apply,
    Average,
    CloseStep,
    CollectParams,
    Drop,
    HandOut,
    Idle,
    OpenStep,
    Record,
    Refill,
    Requeue,
    ShardDone,
    Skip,
    Stale,
)
from towers.engines.ps.policies import AsyncPolicy, BackupPolicy, LocalPolicy, Result, SspPolicy
from towers.engines.ps.state import ServerState, Shard
from towers.engines.ps.wire import Header, Kind, Layout, read_header
from towers.tools.zoo import Parabola, parabola_data, parabola_loss

STEPS = 300  # seed 003's parabola: 300 global batches of 50
RESUMED_STEPS = 150  # a server killed at its checkpoint of batch 100 resumes for 50 more


def _train(mode: str, workers: int, **kwargs):
    torch.manual_seed(0)
    kwargs.setdefault("steps", STEPS)
    return towers.train(
        Parabola(),
        parabola_loss,
        parabola_data(),
        batch_size=50,
        workers=workers,
        mode=mode,
        progress=False,
        timeout=60,
        **kwargs,
    )


def _full_loss(model: torch.nn.Module) -> float:
    with torch.no_grad():
        return float(parabola_loss(model, parabola_data()))


# Faults injected from inside a worker: the loss function runs there; RANK says which tower
# (tower t is rank t + 1: rank 0 is the server). Module-level so that workers can unpickle them.
_calls = {"n": 0}


def dying_loss(model, shard):
    """Tower 1 kills itself (SIGKILL, no clean-up) on its 25th shard."""
    if os.environ.get("RANK") == "2":
        _calls["n"] += 1
        if _calls["n"] == 25:
            os.kill(os.getpid(), signal.SIGKILL)
    return parabola_loss(model, shard)


def nan_loss(model, shard):
    """Tower 1's 10th shard has a NaN loss (and so NaN gradients)."""
    loss = parabola_loss(model, shard)
    if os.environ.get("RANK") == "2":
        _calls["n"] += 1
        if _calls["n"] == 10:
            return loss * math.nan
    return loss


def kill_once_checkpointed(
    directory: Path, step: int, name: str, marker: Path, limit: float = 60.0
) -> threading.Thread:
    """A thread that SIGKILLs this test's process called ``name`` (as ``ps`` shows it) once a
    checkpoint of ``step`` or later exists in ``directory``, and writes ``marker``."""

    def watch() -> None:
        deadline = time.monotonic() + limit
        while time.monotonic() < deadline:
            if any(s >= step for s, _ in checkpoint_files(directory)):
                for pid in descendants():
                    try:
                        comm = Path(f"/proc/{pid}/comm").read_text().strip()
                    except OSError:
                        continue
                    if comm == name:
                        os.kill(pid, signal.SIGKILL)
                        marker.write_text(f"killed {name} (pid {pid})")
                        return
            time.sleep(0.002)

    thread = threading.Thread(target=watch, daemon=True)
    thread.start()
    return thread


# -- pure parts -------------------------------------------------------------------------------


def test_layout_round_trips_values_and_gradients_bit_for_bit():
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4))
    model(torch.randn(5, 3)).sum().backward()
    model[1].weight.grad = None  # a parameter without a gradient stays without one
    layout = Layout(model)
    msg = layout.new()
    assert layout.write_grads(msg, model)
    grads = layout.grads(msg, model)
    for p, g in zip(model.parameters(), grads):
        assert (g is None) == (p.grad is None)
        if g is not None:
            assert torch.equal(g, p.grad)
    layout.write_values(msg, model)
    layout.stamp(msg, Kind.WORK, version=7, step=3, shard=2, samples=13, loss=1.5, payload=1)
    twin = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4))
    layout.read_values(msg, twin)
    for a, b in zip(model.state_dict().values(), twin.state_dict().values()):
        assert torch.equal(a, b)  # num_batches_tracked (int64) included
    h = read_header(layout, msg)
    assert (h.kind, h.version, h.step, h.shard, h.samples, h.loss, h.payload) == (
        Kind.WORK, 7, 3, 2, 13, 1.5, True,
    )  # fmt: skip


def test_layout_reports_non_finite_gradients():
    model = torch.nn.Linear(2, 1)
    model(torch.ones(1, 2)).sum().backward()
    model.bias.grad[0] = math.inf
    assert not Layout(model).write_grads(Layout(model).new(), model)


def test_batch_sizes_and_indices_match_the_sync_order():
    n, bs = 23, 5
    order = global_batches(n, bs, True, 3)
    expected = [next(order) for _ in range(12)]
    assert [batch_len(k, n, bs) for k in range(12)] == [len(b) for b in expected]
    batches = BatchCache(n, bs, True, 3)
    for k in [0, 4, 2, 11, 1, 5]:  # out of order, as requeued shards come
        assert torch.equal(batches.get(k), expected[k])


def test_invalid_backup_and_straggle_arguments_are_refused_before_any_process_starts():
    with pytest.raises(ValueError, match="B must be below workers"):
        _train("backup:4", 4)
    with pytest.raises(ValueError, match="not a tower index"):
        _train("async", 2, straggle={2: 3.0})
    with pytest.raises(ValueError, match="factor"):
        _train("async", 2, straggle={1: 0.5})


# -- policies: decisions on a state, without processes ----------------------------------------


def _header(kind=Kind.RESULT, *, step=0, shard=0, samples=5, loss=1.0, bad=False, **more):
    fields = dict(version=0, aux=0, payload=True, weight=0) | more
    return Header(kind, step=step, shard=shard, samples=samples, loss=loss, bad=bad, **fields)


def _result(tower, shard, pulled=0, **header):
    """Tower ``tower``'s answer to ``shard``, with a message of its own (compared by identity)."""
    h = _header(step=shard.step, shard=shard.index, samples=shard.samples, **header)
    return Result(tower, h, torch.zeros(8, dtype=torch.uint8), shard, pulled)


def _decide(decision, s, *args):
    """The policy's actions; a policy reads the state and never changes it."""
    before = copy.deepcopy(s)
    actions = decision(s, *args)
    assert s == before, "a policy changed the server's state"
    return actions


def _apply(action, results, samples, step, pulled):
    assert isinstance(action, Apply)
    assert (action.samples, action.step, action.pulled) == (samples, step, pulled)
    assert [m is r.message for m, r in zip(action.messages, results)] == [True] * len(results)
    assert action.culprits == tuple(sorted(r.tower for r in results))


def test_async_policy_answers_at_once_and_applies_each_result():
    s, p = ServerState.fresh(towers=2, steps=1), AsyncPolicy()
    s.clock = [2, 1]
    assert _decide(p.serve, s, 0) == [Refill(), Ahead(1), HandOut(0)]
    s.next_step = 1  # every global batch cut, and the queue empty: nothing to hand out
    assert _decide(p.serve, s, 1) == []
    r = _result(1, Shard(0, 1, 5), pulled=3, loss=2.5)
    record, use, *rest = _decide(p.on_result, s, r)
    assert record == Record(0, 1, 2.5, 5) and rest == [Idle(1), ShardDone(0)]
    _apply(use, [r], samples=5, step=0, pulled=3)
    bad = _result(0, Shard(0, 0, 5), bad=True)
    assert _decide(p.on_result, s, bad)[1:] == [Skip(0, (0,)), Idle(0), ShardDone(0)]
    lost = Shard(0, 1, 5)
    assert _decide(p.on_lost, s, 1, lost) == [Requeue(lost)]
    assert _decide(p.on_lost, s, 1, None) == []
    s.pending, s.busy = collections.deque([Shard(0, 0, 5)]), {1: (lost, 0)}
    assert p.unapplied(s) == [Shard(0, 0, 5), lost] and p.checkpointable(s)
    assert not p.finished(s)
    s.done = 1
    assert p.finished(s)


def test_ssp_policy_holds_a_tower_more_than_s_results_ahead():
    s = ServerState.fresh(towers=3, steps=10)
    s.clock = [4, 1, 3]
    assert _decide(SspPolicy(2).serve, s, 0) == []  # 3 ahead of tower 1: held
    assert _decide(SspPolicy(2).serve, s, 2) == [Refill(), Ahead(2), HandOut(2)]
    assert _decide(SspPolicy(3).serve, s, 0) == [Refill(), Ahead(3), HandOut(0)]
    s.live.discard(1)  # the slowest died: the bound counts from the slowest live tower
    assert _decide(SspPolicy(0).serve, s, 0) == []  # 1 ahead of tower 2
    assert _decide(SspPolicy(1).serve, s, 0) == [Refill(), Ahead(1), HandOut(0)]


def test_backup_policy_applies_the_first_shards_and_drops_the_late_one():
    s, p = ServerState.fresh(towers=3, steps=2), BackupPolicy(spares=1, towers=3)
    assert _decide(p.serve, s, 0) == [OpenStep(0), HandOut(0)]
    # as the server left it: step 0 cut into 3 shards, the first handed out
    s.left[0], s.pending = 3, collections.deque([Shard(0, 1, 4), Shard(0, 2, 4)])
    assert _decide(p.serve, s, 1) == [HandOut(1)]
    s.pending.clear()
    assert _decide(p.serve, s, 2) == []  # held: the step has no shard left
    first = _result(2, Shard(0, 2, 4), pulled=0, loss=1.0)
    assert _decide(p.on_result, s, first) == [Idle(2)]  # 1 of the 3 - 1 needed
    second = _result(0, Shard(0, 0, 5), pulled=0, loss=3.0)
    actions = _decide(p.on_result, s, second)
    assert actions[:2] == [Record(0, 2, 1.0, 4), Record(0, 0, 3.0, 5)]
    _apply(actions[2], [first, second], samples=9, step=0, pulled=0)
    assert actions[3:] == [CloseStep(0), Idle(0)]
    s.current = 1  # the server closed step 0
    late = _result(1, Shard(0, 1, 4))
    assert _decide(p.on_result, s, late) == [Drop(0, 1), Idle(1)]
    assert _decide(p.on_lost, s, 1, Shard(0, 1, 4)) == []  # its step was applied without it
    # step 1 has a single shard: it needs only that one; a non-finite one skips the step
    assert _decide(p.serve, s, 1) == [OpenStep(1), HandOut(1)]
    s.left[1] = 1
    assert _decide(p.on_lost, s, 1, Shard(1, 0, 3)) == [Requeue(Shard(1, 0, 3))]
    bad = _result(2, Shard(1, 0, 3), bad=True, loss=math.nan)
    actions = _decide(p.on_result, s, bad)
    assert actions[1:] == [Skip(1, (2,)), CloseStep(1), Idle(2)]
    assert p.unapplied(s) == []  # the step in progress is opened anew after a resume


def test_local_policy_averages_once_every_live_tower_sent_its_parameters():
    s, p = ServerState.fresh(towers=3, steps=1), LocalPolicy(towers=3)
    # tower t takes shard t of each global batch (a lost tower's first): diloco:K's shards
    assert _decide(p.serve, s, 0) == [Refill(until=0), HandOut(0, params=True, pick=0)]
    held = [Refill(until=0), HandOut(0, params=False, pick=0)]  # it holds the parameters
    assert _decide(p.serve, s, 0) == held
    one = _result(0, Shard(0, 0, 5), aux=0, payload=False, loss=2.0)
    assert _decide(p.on_result, s, one) == [Record(0, 0, 2.0, 5), Stale(0), Idle(0), ShardDone(0)]
    kth = _result(1, Shard(0, 1, 5), aux=3, weight=20, loss=1.0)  # its K-th step: it waits
    assert _decide(p.on_result, s, kth) == [Record(0, 1, 1.0, 5), Stale(3), ShardDone(0)]
    bad = _result(2, Shard(0, 2, 5), aux=1, payload=False, bad=True)
    assert _decide(p.on_result, s, bad)[1:] == [Skip(0, (2,)), Idle(2), ShardDone(0)]
    assert _decide(p.settle, s) == []  # towers 0 and 2 have not sent their parameters
    s.next_step = 1  # no shard left this round
    assert _decide(p.serve, s, 2) == [CollectParams(2)]
    params = torch.zeros(8, dtype=torch.uint8)
    assert _decide(p.on_params, s, 2, _header(Kind.PARAMS, weight=7), params) == []
    s.live.discard(0)  # tower 0 died: the average does not wait for it
    assert _decide(p.on_lost, s, 0, None) == []
    s.done = 1  # every global batch is complete: this average is the last
    average, *idle = _decide(p.settle, s)
    assert isinstance(average, Average) and average.final
    assert [(m is want, w) for (m, w), want in zip(average.submitted, [kth.message, params])] == [
        (True, 20),
        (True, 7),
    ]
    assert sorted(idle, key=lambda a: a.tower) == [Idle(1), Idle(2)]
    assert p.checkpointable(s) and not p.checkpointable(s)  # once, right after the average
    s.next_step = 0
    average = [Refill(until=1), HandOut(1, params=True, pick=1)]  # the average
    assert _decide(p.serve, s, 1) == average
    assert not p.finished(s) and p.server_optimizer is False
    s.final = True
    assert p.finished(s) and _decide(p.settle, s) == []


# -- modes ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def sync_reference():
    """Sync in this process: by the sync engine's guarantee, any number of workers matches it."""
    return _train("sync", 1)


@pytest.fixture(scope="module")
def short_sync_reference():
    """The same, over RESUMED_STEPS."""
    return _train("sync", 1, steps=RESUMED_STEPS)


def fits_about_as_well(model: torch.nn.Module, sync: torch.nn.Module, what: str) -> None:
    """The parabola's full loss at most 20% above sync's after as many global batches. Not a
    bound on rounding: stale and averaged updates take another path than sync's on purpose,
    and 20% is this suite's stated margin for "about as well" (measured on this parabola:
    local:4 and backup:1 end within 1% of sync, async and ssp far below it, as they make one
    update per shard)."""
    got, expected = _full_loss(model), _full_loss(sync)
    assert got <= 1.2 * expected, (
        f"{what}: full loss {got:.4g} is above 1.2 x sync's {expected:.4g} after as many steps"
    )


@pytest.mark.timeout(60)
@pytest.mark.parametrize("mode", ["async", "ssp:2", "local:4", "backup:1"])
def test_each_mode_fits_the_parabola_about_as_well_as_sync(mode, sync_reference):
    r = _train(mode, 4)
    fits_about_as_well(r.model, sync_reference.model, f"{mode}, 4 workers, {STEPS} steps")
    assert r.steps == STEPS and len(r.losses) == STEPS and len(r.tower_losses) == STEPS
    assert all(math.isfinite(x) for x in r.losses)
    assert not r.skipped and not r.dead_workers
    if mode == "backup:1":  # one update per step from the first 3 shards of 4, all fresh
        assert r.staleness == [0] * STEPS
        assert 37 * STEPS <= r.samples <= 38 * STEPS  # shards of 13, 13, 12, 12: 3 count
    else:  # one update per shard
        assert len(r.staleness) == 4 * STEPS and r.samples == 50 * STEPS


ONE_WORKER = dict(
    steps=120,
    lr_schedule=functools.partial(torch.optim.lr_scheduler.StepLR, step_size=40, gamma=0.5),
    optimizer=functools.partial(torch.optim.SGD, lr=0.02, momentum=0.9),
    accumulate=2,
)


@pytest.fixture(scope="module")
def one_worker_sync():
    """The sync engine with one worker, and the plain loop in float32 and float64."""
    torch.manual_seed(0)
    plain = Reference.of(
        Parabola(),
        parabola_data(),
        batch_size=50,
        steps=ONE_WORKER["steps"],
        optimizer=ONE_WORKER["optimizer"],
        lr_schedule=ONE_WORKER["lr_schedule"],
        loss_fn=parabola_loss,
    )
    return _train("sync", 1, **ONE_WORKER), plain


@pytest.mark.timeout(60)
@pytest.mark.parametrize("mode", ["async", "ssp:0", "local:3"])
def test_one_worker_trains_exactly_like_sync(mode, one_worker_sync):
    """With one tower nothing is stale: the same updates as the sync engine, bit for bit."""
    ref, plain = one_worker_sync
    r = _train(mode, 1, **ONE_WORKER)
    for name, value in ref.model.state_dict().items():
        assert torch.equal(r.model.state_dict()[name], value), name
    plain.check(r.model, mode)
    # the sync engine carries losses in the float32 gradient bucket, the server in float64:
    # each as close to a float64 loop's as tests/exact.py allows
    plain.check_losses(ref.losses, "sync")
    plain.check_losses(r.losses, mode)
    assert r.staleness == ([0] * 120 if mode != "local:3" else [0, 1, 2] * 40)


@pytest.mark.timeout(60)
def test_ssp_never_exceeds_its_bound_even_with_a_straggler():
    bound = 2
    r = _train("ssp:2", 4, straggle={1: 4.0}, steps=50)
    assert len(r.ahead) == 4 * 50  # one record per pull
    assert max(r.ahead) == bound  # the straggler makes the bound bite, and it holds
    assert len(r.staleness) == 4 * 50
    free = _train("async", 4, straggle={1: 4.0}, steps=50)
    assert max(free.ahead) > bound  # without the bound, fast workers run further ahead


# -- failures ---------------------------------------------------------------------------------


@pytest.mark.timeout(60)
@pytest.mark.parametrize("mode", ["async", "ssp:1", "backup:1"])
def test_a_killed_worker_does_not_stop_training(mode):
    torch.manual_seed(0)
    r = towers.train(
        Parabola(),
        dying_loss,
        parabola_data(),
        batch_size=50,
        steps=80,
        workers=4,
        mode=mode,
        progress=False,
        timeout=60,
    )
    assert r.dead_workers == [1]
    assert r.steps == 80 and all(math.isfinite(x) for x in r.losses)
    assert all(math.isfinite(t) for t in r.times)  # every step completed
    # it computed 24 shards (the 25th killed it) and no more, however late it got to them on a
    # busy machine: its slot of the last steps was once assumed empty, and was not under load
    computed = [k for k, losses in enumerate(r.tower_losses) if not math.isnan(losses[1])]
    assert 0 < len(computed) <= 24 and math.isnan(r.tower_losses[-1][1]), computed
    if mode != "backup:1":  # every shard applied, the dead worker's by the others
        assert len(r.staleness) == 4 * 80 and r.samples == 50 * 80
    else:
        assert len(r.staleness) == 80
    assert all(torch.isfinite(p).all() for p in r.model.parameters())


@pytest.mark.timeout(120)
@pytest.mark.parametrize("mode", ["async", "ssp:1", "local:4", "backup:1"])
def test_a_killed_server_is_resumed_from_its_checkpoint(mode, short_sync_reference, tmp_path):
    # The test kills the server (SIGKILL) once, as soon as its checkpoint of batch 100 exists
    # (local:4: the first average after it), as a lost server machine would end it.
    marker = tmp_path / "killed"
    killer = kill_once_checkpointed(tmp_path / "ckpt", 100, "towers-server", marker)
    n = RESUMED_STEPS
    with pytest.warns(RuntimeWarning, match=r"WorkerError: worker 0 .*SIGKILL.*restart 1 of 1"):
        r = _train(
            mode, 4, steps=n, checkpoint=tmp_path / "ckpt", checkpoint_every=50, max_restarts=1
        )
    killer.join()
    assert marker.exists() and r.restarts == 1
    # every global batch trained, and recorded, once
    assert r.steps == n and len(r.losses) == n and len(r.times) == n
    assert all(math.isfinite(x) for x in r.losses) and all(math.isfinite(t) for t in r.times)
    assert not r.skipped and not r.dead_workers
    if mode == "backup:1":
        assert r.staleness == [0] * n
    else:
        assert len(r.staleness) == 4 * n and r.samples == 50 * n
    # the restarted server went on from the checkpoint's parameters, not from the start
    assert sum(r.losses[100:105]) / 5 < 0.75 * r.losses[0]
    assert all(torch.isfinite(p).all() for p in r.model.parameters())
    fits_about_as_well(r.model, short_sync_reference.model, f"{mode}, resumed, {n} steps")


@pytest.mark.timeout(90)
def test_async_training_continues_from_its_checkpoint(tmp_path):
    first = _train("async", 2, steps=60, checkpoint=tmp_path, checkpoint_every=25)
    assert [s for s, _ in checkpoint_files(tmp_path)] == [60, 50]
    with pytest.raises(ValueError, match="made with workers=2, this run has workers=3"):
        _train("async", 3, steps=120, checkpoint=tmp_path)
    more = _train("async", 2, steps=120, checkpoint=tmp_path, checkpoint_every=25)
    assert len(more.losses) == len(more.tower_losses) == len(more.times) == 120
    same = functools.partial(torch.testing.assert_close, rtol=0, atol=0, equal_nan=True)
    same(torch.tensor(more.losses[:60]), torch.tensor(first.losses))
    same(torch.tensor(more.tower_losses[:60]), torch.tensor(first.tower_losses))
    assert more.staleness[: 2 * 60] == first.staleness and len(more.staleness) == 2 * 120
    assert more.samples == 50 * 120 and more.seconds >= first.seconds
    # the second call went on from the first one's parameters (full batches: a smooth curve)
    assert more.losses[60] < 1.2 * first.losses[-1] < 0.5 * first.losses[0]
    assert _full_loss(more.model) < _full_loss(first.model)
    # a finished run asked again returns its record without training
    again = _train("async", 2, steps=120, checkpoint=tmp_path)
    assert again.losses == more.losses and again.staleness == more.staleness
    for name, value in more.model.state_dict().items():
        assert torch.equal(again.model.state_dict()[name], value), name


@pytest.mark.timeout(60)
def test_a_non_finite_gradient_is_never_applied():
    torch.manual_seed(0)
    r = towers.train(
        Parabola(), nan_loss, parabola_data(), batch_size=50, steps=60, workers=2,
        mode="async", progress=False, timeout=60,
    )  # fmt: skip
    assert len(r.skipped) == 1 and r.skipped[0][1] == [1]
    step = r.skipped[0][0]
    assert math.isnan(r.tower_losses[step][1]) and math.isnan(r.losses[step])
    assert len(r.staleness) == 2 * 60 - 1
    assert all(torch.isfinite(p).all() for p in r.model.parameters())


@pytest.mark.timeout(60)
def test_backup_drops_the_straggler_late_shards():
    r = _train("backup:1", 4, straggle={1: 20.0}, steps=60)
    assert len(r.staleness) == 60 and set(r.staleness) == {0}
    # steps each tower's shards were part of: the straggler's always arrive too late
    used = [sum(math.isfinite(losses[t]) for losses in r.tower_losses) for t in range(4)]
    assert used[1] <= 6 and min(used[t] for t in (0, 2, 3)) >= 30
    assert 1 in {t for _, t in r.dropped}


@pytest.mark.timeout(90)
def test_compare_prints_every_mode_with_and_without_the_straggler(tmp_path, capsys):
    from towers.tools.cli import main

    png = tmp_path / "loss.png"
    argv = ["compare", "-n", "2", "--steps", "15", "--modes", "sync,async", "--out", str(png)]
    assert main(argv) == 0
    out = capsys.readouterr().out
    rows = [line.split() for line in out.splitlines() if line.startswith(("sync ", "async "))]
    assert [(r[0], r[1]) for r in rows] == [("sync", "-"), ("sync", "3x"), ("async", "-"),
                                            ("async", "3x")]  # fmt: skip
    assert [int(r[2]) for r in rows] == [15, 15, 30, 30]  # updates: async one per shard
    assert "updates/s relative to sync" in out and png.stat().st_size > 0
