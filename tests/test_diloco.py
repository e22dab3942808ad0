"""mode="diloco:H": inner steps alone, outer steps on averaged pseudo-gradients (docs/diloco.md).

Every run is compared with a plain single-process DiLoCo written here: one model and one inner
optimizer per tower, the shards of the same global batches, the pseudo-gradients averaged by
sample weight, the outer optimizer; Streaming DiLoCo's overlap and fragments likewise. It runs
in float32 and in float64 over the same batches, and a run of towers may be as far from the
float64 one as tests/exact.py's bound allows (a few times the float32 one's distance).
"""

from __future__ import annotations

import copy
import functools
import importlib.util
import math
import os
import signal
import subprocess
import sys
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

import pytest
import torch
from exact import Reference, as_float64, bound
from helpers import make_net, mse, regression_data
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import towers
from towers.engines.sync.diloco import fragments_of
from towers.engines.sync.message import InnerStep, pack, read

ADAM = functools.partial(torch.optim.Adam, lr=0.03)
SGD = functools.partial(torch.optim.SGD, lr=0.1)
NESTEROV = functools.partial(torch.optim.SGD, lr=0.6, momentum=0.5, nesterov=True)
AVERAGE = functools.partial(torch.optim.SGD, lr=1.0)  # the outer step of local SGD
DATA = regression_data(47)


# -- the reference: DiLoCo in one process ---------------------------------------------------


@dataclass
class Period:
    """From global batch ``start`` on: batches split into ``split`` shards, shard i trained by
    tower ``towers[i]`` (None: nobody, its tower was lost)."""

    start: int
    split: int
    towers: list[int | None]


@dataclass
class Run:
    """What the one-process DiLoCo ended with: the outer model, each global batch's loss, the
    skipped steps (global batch, culprit towers) and the evaluations (done, loss)."""

    outer: nn.Module
    losses: list[float] = field(default_factory=list)
    skipped: list[tuple[int, list[int]]] = field(default_factory=list)
    evals: list[tuple[int, float]] = field(default_factory=list)


def reference(
    model: nn.Module,
    data,
    *,
    batch_size: int,
    steps: int,
    every: int,
    workers: int | None = None,
    periods: Sequence[Period] | None = None,
    inner=ADAM,
    outer=NESTEROV,
    overlap: bool = False,
    fragments: int = 1,
    loss_fn: Callable = mse,
    seed: int = 0,
    eval_every: int | None = None,
    batches: list | None = None,
) -> Run:
    """DiLoCo (and Streaming DiLoCo) over the DataLoader's global batches (or ``batches``), in
    one process, in ``model``'s dtype."""
    periods = periods or [Period(0, workers, list(range(workers)))]  # type: ignore[arg-type]
    if batches is None:
        seeded = torch.Generator().manual_seed(seed)
        loader = DataLoader(TensorDataset(*data), batch_size, shuffle=True, generator=seeded)
        batches = [b for _ in range(-(-steps // len(loader))) for b in loader][:steps]
    out = Run(copy.deepcopy(model))
    outer_opt = outer(out.outer.parameters())
    local: dict[int, nn.Module] = {}
    inner_opts: dict[int, torch.optim.Optimizer] = {}
    groups = fragments_of([p.numel() for p in model.parameters()], fragments)
    stage = every // fragments
    since: list[dict[int, int]] = [{} for _ in range(fragments)]  # applied samples per tower
    trained = [0] * fragments  # inner steps since each fragment's exchange
    flight = None

    def launch(f: int):
        """Fragment f's mean pseudo-gradient and the mean statistics, weighted by samples."""
        weights, since[f], trained[f] = since[f], {}, 0
        total = sum(weights.values())
        outer_params = list(out.outer.parameters())
        deltas = [
            sum(n * (outer_params[i].detach() - list(local[t].parameters())[i].detach())
                for t, n in weights.items()) / total
            for i in groups[f]
        ]  # fmt: skip
        stats = {
            name: sum(n * dict(local[t].named_buffers())[name] for t, n in weights.items()) / total
            for name, b in out.outer.named_buffers()
            if b.is_floating_point()
        }
        return f, deltas, stats

    def apply(sent, mix: bool) -> None:
        """The outer step; each tower then takes (or, mixing, half takes) the outer values."""
        f, deltas, stats = sent
        outer_params = list(out.outer.parameters())
        for i, d in zip(groups[f], deltas):
            outer_params[i].grad = d
        outer_opt.step()
        outer_opt.zero_grad(set_to_none=True)
        outer_buffers = dict(out.outer.named_buffers())
        with torch.no_grad():
            for name, value in stats.items():
                outer_buffers[name].copy_(value)
            for t in local:
                mine = list(local[t].parameters())
                pairs = [(mine[i], outer_params[i]) for i in groups[f]]
                pairs += [(dict(local[t].named_buffers())[n], outer_buffers[n]) for n in stats]
                for a, b in pairs:
                    a.copy_(0.5 * a + 0.5 * b if mix else b)

    for k, batch in enumerate(batches):
        period = [p for p in periods if p.start <= k][-1]
        shards = towers.split(tuple(batch), period.split)
        sums, counts, bad = 0.0, 0, []
        for t, shard in zip(period.towers, shards):
            if t is None or len(shard[0]) == 0:
                continue
            if t not in local:  # a tower starts (or a replacement joins) from the outer model
                local[t] = copy.deepcopy(out.outer)
                inner_opts[t] = inner(local[t].parameters())
            inner_opts[t].zero_grad()
            loss = loss_fn(local[t], shard)
            loss.backward()
            n = len(shard[0])
            finite = math.isfinite(loss.item()) and all(
                torch.isfinite(p.grad).all() for p in local[t].parameters()
            )
            if finite:
                inner_opts[t].step()
                for s in since:
                    s[t] = s.get(t, 0) + n
            else:
                bad.append(period.towers.index(t))
            sums += loss.item() * n
            counts += n
        out.losses.append(sums / counts)
        if bad:
            out.skipped.append((k, bad))
        done = k + 1
        for f in range(fragments):
            trained[f] += 1
        if done % stage == 0:  # a boundary: the flight lands, the next leaves
            if flight is not None:
                apply(flight, mix=True)
                flight = None
            f = (done // stage) % fragments
            if overlap:
                flight = launch(f)
            else:
                apply(launch(f), mix=False)
        if done == steps:  # the end: every fragment trained since its exchange, blocking
            if flight is not None:
                apply(flight, mix=True)
            for f in range(fragments):
                if trained[f]:
                    apply(launch(f), mix=False)
        if eval_every and (done % eval_every == 0 or done == steps):
            with torch.no_grad():
                out.evals.append((done, float(loss_fn(out.outer, data))))
    return out


def derived(model: nn.Module, data, batches: list | None = None, **options) -> tuple:
    """:func:`reference` from ``model`` in float32 and in float64 over the same batches: the
    outer model and losses as a tests/exact.py ``Reference``, the evaluations as another (their
    losses), and the float32 run (its skipped steps)."""
    runs: dict[torch.dtype, Run] = {}

    def loop(dtype: torch.dtype) -> tuple[nn.Module, list[float]]:
        cast = as_float64 if dtype == torch.float64 else (lambda d: d)
        run = reference(copy.deepcopy(model).to(dtype), cast(data), batches=cast(batches),
                        **options)  # fmt: skip
        runs[dtype] = run
        return run.outer, run.losses

    outer = Reference.run(loop)
    single, wide = runs[torch.float32], runs[torch.float64]
    assert single.skipped == wide.skipped, (single.skipped, wide.skipped)
    evals = Reference({}, {}, [v for _, v in single.evals], [v for _, v in wide.evals])
    return outer, evals, single


# -- train(mode="diloco:H") against the reference -------------------------------------------


def run(mode: str, steps: int, workers: int = 3, **kwargs):
    kwargs.setdefault("optimizer", ADAM)
    return towers.train(
        make_net(), mse, DATA, batch_size=10, steps=steps, workers=workers, mode=mode,
        seed=4, progress=False, **kwargs,
    )  # fmt: skip


CASES = [
    # mode, workers, transport, reference options
    ("diloco:4", 3, "shm", {"every": 4}),
    ("diloco:3", 2, "gloo", {"every": 3}),
    ("diloco:4:overlap", 3, "shm", {"every": 4, "overlap": True}),
    ("diloco:4:overlap:2", 3, "gloo", {"every": 4, "overlap": True, "fragments": 2}),
]


@pytest.mark.timeout(120)
@pytest.mark.parametrize(("mode", "workers", "transport", "options"), CASES)
def test_diloco_equals_diloco_in_one_process(mode, workers, transport, options):
    # batches of 10 over 3 towers: shards of 4, 3, 3; the epoch's last batch has 7 samples
    got = run(mode, 13, workers, transport=transport, eval_data=DATA, eval_every=4)
    want, evals, single = derived(
        make_net(), DATA, batch_size=10, steps=13, workers=workers, seed=4, eval_every=4,
        **options,
    )  # fmt: skip
    want.check(got.model)
    want.check_losses(got.losses)
    assert got.skipped == [] and got.updates == 13 and got.mode == mode
    assert len(got.times) == 13 and got.times == sorted(got.times)
    assert got.world == [workers] * 13 and got.samples == 10 * 13 - 3 * 2
    # evaluations are of the outer parameters
    assert [d for d, _ in got.evals] == [d for d, _ in single.evals] == [4, 8, 12, 13]
    evals.check_losses([metrics["loss"] for _, metrics in got.evals], "towers' evaluations")


@pytest.mark.timeout(120)
def test_local_k_is_diloco_k_with_an_outer_sgd_of_lr_1():
    """local:K (the parameter server) and diloco:K (all-reduce) train the same parameters."""
    momentum = functools.partial(torch.optim.SGD, lr=0.05, momentum=0.9)
    local = run("local:4", 14, optimizer=momentum)
    diloco = run("diloco:4", 14, optimizer=momentum, outer_optimizer=AVERAGE)
    # the two average in different ways (parameters, pseudo-gradients): each is checked against
    # the one-process DiLoCo in float64
    want, _, _ = derived(make_net(), DATA, batch_size=10, steps=14, workers=3, every=4,
                         inner=momentum, outer=AVERAGE, seed=4)  # fmt: skip
    for name, got in (("local:4", local), ("diloco:4", diloco)):
        want.check(got.model, name)
        want.check_losses(got.losses, name)


@pytest.mark.timeout(120)
def test_compression_applies_to_the_pseudo_gradients():
    squeezed = run("diloco:4", 12, compress="bf16")
    want, _, _ = derived(make_net(), DATA, batch_size=10, steps=12, workers=3, every=4, seed=4)
    # a lossy exchange, not rounding: bf16 keeps 8 significant bits, so each exchange's mean
    # pseudo-gradient is off by at most 2**-8 of its size (each tower's rounded once, the sum
    # once more: docs/compression.md). The bound: 4 x 2**-8 of how far the run moved each
    # tensor from the one-process DiLoCo's start to its end (the rounding is relative to the
    # outer steps' size, and Adam's inner steps carry it on; measured: at most 13% of the
    # bound); a wrong exchange is off by a good part of the movement itself
    beyond_rounding = []
    for name, p in squeezed.model.state_dict().items():
        exact, start = want.exact[name], make_net().state_dict()[name].double()
        off, moved = float((p.double() - exact).abs().max()), float((exact - start).abs().max())
        assert off <= 4 * 2**-8 * moved, (
            f"diloco:4, {name}: the run with bf16 exchanges is {off:.3g} from the one-process "
            f"DiLoCo in float64, above 4 x 2**-8 x the {moved:.3g} the parameters moved"
        )
        beyond_rounding.append(off > bound(want.single[name], exact)[1])
    # bf16 on the wire rounds the pseudo-gradients: every tensor is further from the exact
    # exchanges than float32's rounding takes a run (tests/exact.py's bound; measured: 270 to
    # 1300 times as far)
    assert all(beyond_rounding)
    # the first period exchanges nothing: its losses are exact ones
    first = replace(want, losses=want.losses[:4], exact_losses=want.exact_losses[:4])
    first.check_losses(squeezed.losses[:4], "bf16, the first period")


@pytest.mark.timeout(120)
def test_a_non_finite_inner_step_is_skipped_by_its_tower_alone():
    x, y = DATA[0].clone(), DATA[1].clone()
    x[7, 1] = math.nan  # one sample: every global batch holding it skips on one tower
    with pytest.warns(RuntimeWarning, match="skipped .* by the tower whose shard holds it"):
        got = towers.train(make_net(), mse, (x, y), batch_size=10, steps=10, workers=3,
                       mode="diloco:4", optimizer=ADAM, seed=4, progress=False)  # fmt: skip
    want, _, single = derived(make_net(), (x, y), batch_size=10, steps=10, workers=3, every=4,
                              seed=4)  # fmt: skip
    assert got.skipped == single.skipped and len(got.skipped) >= 1
    want.check_losses(got.losses)
    assert all(len(culprits) == 1 for _, culprits in got.skipped)
    want.check(got.model)
    assert all(torch.isfinite(p).all() for p in got.model.parameters())
    assert got.updates == 10 - len(got.skipped)


def bn_net() -> nn.Module:
    torch.manual_seed(5)
    return nn.Sequential(nn.Linear(3, 8), nn.BatchNorm1d(8), nn.Tanh(), nn.Linear(8, 1))


@pytest.mark.timeout(120)
def test_batchnorm_statistics_are_averaged_at_every_outer_step():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = towers.train(bn_net(), mse, DATA, batch_size=10, steps=9, workers=3,
                           mode="diloco:4", optimizer=SGD, seed=4, progress=False)  # fmt: skip
    assert not [w for w in caught if "sync_batchnorm" in str(w.message)]
    want, _, _ = derived(bn_net(), DATA, batch_size=10, steps=9, workers=3, every=4, inner=SGD,
                         seed=4)  # fmt: skip
    want.check(got.model)  # the running statistics too


# -- checkpoints -----------------------------------------------------------------------------


def mse_dying_once(model, shard, marker: str, at_call: int):
    """Rank 1 kills itself at its ``at_call``-th loss, the first time only."""
    mse_dying_once.calls = getattr(mse_dying_once, "calls", 0) + 1
    if os.environ.get("RANK") == "1" and mse_dying_once.calls == at_call:
        path = Path(marker)
        if not path.exists():
            path.write_text("died once")
            os.kill(os.getpid(), signal.SIGKILL)
    return mse(model, shard)


@pytest.mark.timeout(180)
@pytest.mark.parametrize("mode", ["diloco:3", "diloco:4:overlap:2"])
def test_a_restart_resumes_exactly_mid_period(tmp_path, mode):
    """Checkpoints hold the outer state, every worker's own parameters and inner optimizer and
    the exchange in flight: a run that crashed and resumed ends where an uninterrupted one does."""
    whole = run(mode, 11, workers=2)
    loss = functools.partial(mse_dying_once, marker=str(tmp_path / "marker"), at_call=8)
    with pytest.warns(RuntimeWarning, match=r"WorkerError.*restart 1 of 1"):
        resumed = towers.train(
            make_net(), loss, DATA, batch_size=10, steps=11, workers=2, mode=mode, seed=4,
            optimizer=ADAM, progress=False, checkpoint=tmp_path / "ckpt", checkpoint_every=5,
            max_restarts=1,
        )  # fmt: skip
    assert (tmp_path / "marker").exists() and resumed.restarts == 1
    # the same arithmetic in the same order: the same bits
    for (name, p), q in zip(resumed.model.state_dict().items(), whole.model.state_dict().values()):
        assert torch.equal(p, q), (name, p, q)
    assert resumed.losses == whole.losses
    assert resumed.samples == whole.samples
    with pytest.raises(ValueError, match=r"holds the parameters .* of each of its 2 workers"):
        run(mode, 12, workers=3, checkpoint=tmp_path / "ckpt")


# -- elastic ---------------------------------------------------------------------------------


@pytest.mark.timeout(180)
@pytest.mark.slow
def test_a_worker_lost_mid_period_drops_its_partial_period(tmp_path):
    loss = functools.partial(mse_dying_once, marker=str(tmp_path / "marker"), at_call=6)
    got = towers.train(
        make_net(), loss, DATA, batch_size=10, steps=12, workers=3, mode="diloco:4", seed=4,
        optimizer=ADAM, progress=False, elastic=True, transport="shm", timeout=30,
    )  # fmt: skip
    assert got.dead_workers == [1] and got.world == [3] * 4 + [2] * 8
    assert len(got.recoveries) == 1 and got.recoveries[0][0] == 7
    # tower 1 died in the second period (its 6th loss): the survivors exchange that period
    # weighted by their own samples, then split each global batch in two
    periods = [Period(0, 3, [0, 1, 2]), Period(4, 3, [0, None, 2]), Period(8, 2, [0, 2])]
    want, _, _ = derived(make_net(), DATA, batch_size=10, steps=12, every=4, periods=periods,
                         seed=4)  # fmt: skip
    want.check(got.model)
    want.check_losses(got.losses)


class SignedDyingOnce:
    """Rank 1's loss kills it at its ``at_call``-th call, the first time only. Every process that
    receives the loss signs in (``__setstate__`` runs as a worker unpickles it), and after the
    death the survivors hold their steps until a process has signed in since: the replacement
    then joins while they still have steps to take, however long the machine takes to start it."""

    def __init__(self, folder: str, at_call: int):
        self.folder, self.at_call = folder, at_call

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        after = (Path(self.folder) / "marker").exists()
        (Path(self.folder) / f"in-{os.getpid()}").write_text("after" if after else "before")

    def __call__(self, model, shard):
        time.sleep(0.1)  # room for the replacement to register while the others train
        folder = Path(self.folder)
        deadline = time.monotonic() + 60
        while (folder / "marker").exists() and time.monotonic() < deadline:
            if any(p.read_text() == "after" for p in folder.glob("in-*")):
                break
            time.sleep(0.05)
        return mse_dying_once(model, shard, str(folder / "marker"), self.at_call)


@pytest.mark.timeout(180)
@pytest.mark.slow
def test_a_replacement_receives_the_outer_state_at_an_exchange(tmp_path):
    loss = SignedDyingOnce(str(tmp_path), at_call=6)
    got = towers.train(
        make_net(), loss, DATA, batch_size=10, steps=36, workers=3, mode="diloco:4", seed=4,
        optimizer=ADAM, progress=False, elastic=True, max_restarts=1, transport="gloo",
        timeout=30,
    )  # fmt: skip
    assert got.dead_workers == [1] and got.restarts == 1 and got.world[:8] == [3] * 4 + [2] * 4
    joined = got.world.index(3, 8)  # the replacement (worker 3) joined at an exchange
    assert joined % 4 == 0 and set(got.world[joined:]) == {3}, got.world
    periods = [
        Period(0, 3, [0, 1, 2]),
        Period(4, 3, [0, None, 2]),
        Period(8, 2, [0, 2]),
        Period(joined, 3, [0, 2, 3]),  # its inner optimizer starts afresh, from the outer model
    ]
    want, _, _ = derived(make_net(), DATA, batch_size=10, steps=36, every=4, periods=periods,
                         seed=4)  # fmt: skip
    want.check(got.model)
    want.check_losses(got.losses)


def slow_mse(model, shard):
    time.sleep(0.05)  # room for the newcomers to start while the first worker trains
    return mse(model, shard)


@pytest.mark.timeout(180)
@pytest.mark.slow
def test_workers_that_join_a_growing_job_start_from_the_outer_state():
    got = towers.train(
        make_net(), slow_mse, DATA, batch_size=10, steps=32, workers=3, mode="diloco:4", seed=4,
        optimizer=ADAM, progress=False, elastic=True, min_workers=1, transport="gloo",
        timeout=30,
    )  # fmt: skip
    assert got.world[:4] == [1] * 4 and got.world[-1] == 3, got.world
    starts = [k for k in range(32) if k == 0 or got.world[k] != got.world[k - 1]]
    assert all(k % 4 == 0 for k in starts), got.world  # newcomers join at exchanges
    # each newcomer trains the shard after the members' with a fresh inner optimizer, from the
    # outer model of the exchange it joined at
    periods = [Period(k, got.world[k], list(range(got.world[k]))) for k in starts]
    want, _, _ = derived(make_net(), DATA, batch_size=10, steps=32, every=4, periods=periods,
                         seed=4)  # fmt: skip
    want.check(got.model)
    want.check_losses(got.losses)


# -- the own loop ----------------------------------------------------------------------------

LOOP_BATCHES = [(DATA[0][i : i + 11], DATA[1][i : i + 11]) for i in range(0, 44, 11)] * 2


def _loop(ctx, mode: str, steps: int, checkpoint: str | None = None, stop: int | None = None):
    """A plain own loop in ``mode``; with ``checkpoint``: saves at step 5, resumes from it."""
    model = ctx.replicate(make_net(), mode=mode)
    opt = ADAM(model.parameters())
    done, _ = ctx.load_checkpoint(checkpoint, model, opt) if checkpoint else (0, {})
    results = []
    for shard in ctx.shards(LOOP_BATCHES[done:steps]):
        results.append(ctx.step(mse(model, shard), opt))
        if checkpoint and ctx.steps == 5:
            ctx.save_checkpoint(checkpoint, ctx.steps, model, opt)
        if ctx.steps == stop:
            return None
    results.append(ctx.end_period())
    return {k: v.detach().clone() for k, v in model.state_dict().items()}, results


def own_loop_case(case: str, tmp: str):
    """One case of the own loop in a fresh job: its ``ctx.steps`` count from 0."""
    ctx = towers.init()
    if case == "plain":
        out = _loop(ctx, "diloco:3", 8), _skip(ctx), _errors(ctx), _evaluate(ctx)
    elif case == "overlap":
        out = _loop(ctx, "diloco:4:overlap:2", 8)
    elif case == "interrupted":  # stopped after the save at step 5
        out = _loop(ctx, "diloco:3", 8, checkpoint=tmp, stop=6)
    else:
        out = _loop(ctx, "diloco:3", 8, checkpoint=tmp)
    ctx.close()
    return out


def _skip(ctx, **options):
    """A tower whose parameters went bad: the outer step is skipped, the outer model kept
    (``options``: ``ctx.replicate``'s)."""
    model = ctx.replicate(make_net(), mode="diloco:2", **options)
    opt = SGD(model.parameters())
    first = [ctx.step(mse(model, s), opt) for s in ctx.shards(LOOP_BATCHES[:2])]
    kept = [p.detach().clone() for p in model.parameters()]
    if ctx.rank == 1:
        with torch.no_grad():
            next(model.parameters()).fill_(math.inf)
    bad = [ctx.step(mse(model, s), opt) for s in ctx.shards(LOOP_BATCHES[2:4])]
    return first[-1], bad[-1], all(torch.equal(p, q) for p, q in zip(model.parameters(), kept))


def _evaluate(ctx, **options):
    """ctx.evaluate of the replicated model right after an outer step, mid-period, and of a
    copy of this tower's own parameters mid-period (``options``: ``ctx.replicate``'s)."""
    model = ctx.replicate(make_net(), mode="diloco:2", **options)
    opt = ADAM(model.parameters())
    metrics = functools.partial(ctx.evaluate, data=DATA, fn=lambda m, b: {"loss": mse(m, b)})
    out = []
    for shard in ctx.shards(LOOP_BATCHES[:3]):
        ctx.step(mse(model, shard), opt)
        out.append(metrics(model, batch_size=16))
    out.append(metrics(copy.deepcopy(model), batch_size=16))
    ctx.end_period()
    return out


def _errors(ctx):
    model = ctx.replicate(make_net(), mode="diloco:2")
    errors = []
    for call in (
        lambda: ctx.backward(mse(model, LOOP_BATCHES[0])),
        lambda: ctx.replicate(make_net(), mode="async"),
    ):
        try:
            call()
        except ValueError as exc:
            errors.append(str(exc))
    return errors


@pytest.fixture(scope="module")
def plain_own_loop(tmp_path_factory):
    """The "plain" case's job, which two tests read (it writes no checkpoint)."""
    return towers.spawn(own_loop_case, 3, "plain", str(tmp_path_factory.mktemp("plain")))


@pytest.mark.timeout(180)
def test_the_own_loop_takes_outer_steps_every_h_steps(tmp_path, plain_own_loop):
    for case, options in (
        ("plain", {"every": 3}),
        ("overlap", {"every": 4, "overlap": True, "fragments": 2}),
    ):
        if case == "plain":
            outs = plain_own_loop
        else:
            outs = towers.spawn(own_loop_case, 3, case, str(tmp_path))
        want, _, _ = derived(make_net(), DATA, batch_size=11, steps=8, workers=3,
                             batches=LOOP_BATCHES[:8], **options)  # fmt: skip
        for rank, out in enumerate(outs):
            params, _ = out[0] if case == "plain" else out
            want.check(params, f"{case}, rank {rank}")
        if case == "plain":
            # every third step returns the outer step's result, the same on every rank
            outer = [out[0][1][2] for out in outs]
            assert outer[0] == outer[1] == outer[2]
            period = Reference({}, {}, [sum(want.losses[:3]) / 3], [sum(want.exact_losses[:3]) / 3])
            period.check_losses([outer[0].loss], "the first period's mean loss")
            # the others this tower's own
            inner = [out[0][1][0] for out in outs]
            assert [i.tower_samples for i in inner] == [[4, 0, 0], [0, 4, 0], [0, 0, 3]]
            for out in outs:
                first, bad, kept = out[1]
                assert not first.skipped and bad.skipped and bad.culprits == [1] and kept
                errors = out[2]
                assert "in DiLoCo each tower steps alone between outer steps" in errors[0]
                assert "an own loop trains mode='sync' or 'diloco:H', not 'async'" in errors[1]
                # mid-period, ctx.evaluate(model) evaluates the outer parameters: those of the
                # outer step before, not this tower's own, which have moved on
                _, at_outer, mid, own = out[3]
                assert mid == at_outer and own["loss"] != mid["loss"]


@pytest.mark.timeout(120)
def test_the_own_loop_resumes_exactly_mid_period(tmp_path, plain_own_loop):
    whole = plain_own_loop  # the same loop, uninterrupted
    towers.spawn(own_loop_case, 3, "interrupted", str(tmp_path))
    resumed = towers.spawn(own_loop_case, 3, "resumed", str(tmp_path))
    # the same arithmetic in the same order: the same bits
    for got, want in zip(resumed, whole, strict=True):
        for name, p in got[0].items():
            assert torch.equal(p, want[0][0][name]), (name, p, want[0][0][name])


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_the_own_loop_under_towers_run_elastic_drops_a_lost_workers_period(tmp_path):
    script = Path(__file__).parent / "scripts" / "diloco_loop.py"
    cmd = [sys.executable, "-m", "towers", "run", str(script), "-n", "3", "--elastic", "--"]
    cmd += ["--out", str(tmp_path), "--victim", "1", "--die-at", "5"]
    env = {**os.environ, "PYTHONPATH": str(Path(towers.__file__).parents[1])}
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=110)
    assert done.returncode == 0, done.stderr[-3000:]
    finals = {int(p.stem.split("-")[1]): torch.load(p) for p in tmp_path.glob("final-*.pt")}
    assert set(finals) == {0, 2}
    spec = importlib.util.spec_from_file_location("diloco_loop", script)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    periods = [Period(0, 3, [0, 1, 2]), Period(4, 3, [0, None, 2]), Period(8, 2, [0, 2])]
    mse_loss = lambda model, shard: nn.functional.mse_loss(model(shard[0]), shard[1])  # noqa: E731
    want, _, _ = derived(module.build(), None, batch_size=21, steps=12, every=4,
                         periods=periods, batches=module.batches(12), loss_fn=mse_loss)  # fmt: skip
    for rank, final in finals.items():
        want.check(final["model"], f"rank {rank}")
        # the second outer step was taken by the two survivors, weighted by their samples
        assert [(s, w) for s, w, _ in final["outer"]] == [(4, 3), (8, 2), (12, 2)]
        assert final["outer"][1][2] == [28, 28]  # 4 global batches of 7 samples each


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_train_in_diloco_across_two_hosts_under_torchrun(tmp_path):
    from netns import torchrun_nodes, two_hosts

    scripts, out = Path(__file__).parent / "scripts", tmp_path / "result.pt"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("GLOO_", "MASTER_"))}
    env |= {"PYTHONPATH": str(Path(towers.__file__).parents[1]), "OMP_NUM_THREADS": "1"}
    with two_hosts() as hosts:
        torchrun_nodes(hosts, str(scripts / "diloco_hosts.py"), [str(out)], 29523, env)
    got = torch.load(out, weights_only=True)
    spec = importlib.util.spec_from_file_location("diloco_hosts", scripts / "diloco_hosts.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    want, _, _ = derived(module.build_model(), module.data(), batch_size=7, steps=7, every=3,
                         workers=2, inner=module.INNER, outer=module.OUTER, loss_fn=module.mse,
                         seed=4)  # fmt: skip
    want.check(got)  # the model and the losses


# -- bad input -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"mode": "diloco:0"}, ValueError, r"mode 'diloco' needs H, .* \(>= 1\); got 'diloco:0'"),
        ({"mode": "diloco:2.5"}, ValueError, "needs an integer argument H"),
        ({"mode": "diloco:8:fast"}, ValueError, "unknown option 'fast'; DiLoCo modes are"),
        ({"mode": "diloco:8:overlap:3"}, ValueError, "P must be an integer >= 1 that divides H"),
        ({"mode": "diloco:8:overlap:8"}, ValueError, "only 4 trainable parameter tensors"),
        ({"mode": "diloco:8", "outer_optimizer": torch.optim.SGD(make_net().parameters(), 0.1)},
         TypeError, r"not an instance; e\.g\. functools\.partial\(torch\.optim\.SGD"),
        ({"mode": "diloco:8", "outer_optimizer": 0.7}, TypeError, "outer_optimizer must be"),
        ({"outer_optimizer": AVERAGE}, ValueError, "outer_optimizer= applies to mode='diloco:H'"),
        ({"mode": "diloco:8", "sync_batchnorm": True}, ValueError,
         "towers step alone between outer steps: drop sync_batchnorm=True"),
        ({"mode": "diloco:8:overlap", "elastic": True, "transport": "shm"}, ValueError,
         r"use mode='diloco:8' \(blocking exchanges\) with elastic=True"),
    ],
)  # fmt: skip
def test_diloco_refuses_what_it_cannot_serve_before_any_worker_starts(kwargs, error, message):
    with pytest.raises(error, match=message):
        towers.train(make_net(), mse, DATA, batch_size=10, steps=4, workers=2, progress=False,
                     **kwargs)  # fmt: skip


# -- the small message, without processes ---------------------------------------------------


def test_the_message_sums_to_every_towers_losses_and_the_weighted_buffers():
    steps = [
        [InnerStep(5, 6.0, 3, False, 0.0), InnerStep(6, math.nan, 2, True, 0.0)],
        [InnerStep(5, 2.0, 4, False, 0.0), InnerStep(6, 0.0, 0, False, 0.0)],
    ]
    buffers = [[torch.tensor([1.0, 2.0])], [torch.tensor([4.0, 8.0])]]
    weights = [3, 6]
    summed = sum(pack(steps[r], r, 2, weights[r], buffers[r]) for r in range(2))
    results, mean = read(summed, 2, 2)
    assert results[0].loss == pytest.approx(8 / 7) and results[0].tower_samples == [3, 4]
    assert results[0].tower_losses == [2.0, 0.5] and not results[0].skipped
    assert results[1].skipped and results[1].culprits == [0] and math.isnan(results[1].loss)
    assert math.isnan(results[1].tower_losses[1])  # an empty shard
    torch.testing.assert_close(mean, torch.tensor([3.0, 6.0], dtype=torch.float64))


def test_fragments_cut_the_model_in_contiguous_parts_of_about_equal_size():
    assert fragments_of([10, 10, 10, 10], 2) == [range(0, 2), range(2, 4)]
    assert fragments_of([100, 1, 1, 1], 2) == [range(0, 1), range(1, 4)]
    assert fragments_of([1, 1, 100], 3) == [range(0, 1), range(1, 2), range(2, 3)]
    with pytest.raises(ValueError, match="use at most 3 fragments"):
        fragments_of([1, 1, 1], 4)


# -- reporting and the tools -----------------------------------------------------------------


@pytest.mark.timeout(120)
def test_tensorboard_gets_one_loss_per_global_batch(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    got = run("diloco:4:overlap", 10, log_dir=str(tmp_path))
    events = EventAccumulator(str(tmp_path))
    events.Reload()
    logged = {e.step: e.value for e in events.Scalars("loss/mean")}
    # TensorBoard keeps a scalar in float32: the result's losses, rounded so, to the last bit
    assert logged == {k: torch.tensor(v).item() for k, v in enumerate(got.losses)}


@pytest.mark.timeout(120)
def test_compare_has_diloco_rows(tmp_path, capsys):
    from towers.tools.cli import main

    modes = "diloco:4,diloco:4:overlap:2"
    argv = [
        "compare",
        "-n",
        "2",
        "--steps",
        "8",
        "--modes",
        modes,
        "--out",
        str(tmp_path / "c.png"),
    ]
    assert main(argv) == 0
    out = capsys.readouterr().out
    rows = [line.split() for line in out.splitlines() if line.startswith("diloco")]
    assert [(r[0], r[1], r[2]) for r in rows] == [
        ("diloco:4", "-", "8"),
        ("diloco:4", "3x", "8"),
        ("diloco:4:overlap:2", "-", "8"),
        ("diloco:4:overlap:2", "3x", "8"),
    ]


@pytest.mark.timeout(60)
def test_the_default_outer_step_says_what_it_costs_against_sync(capfd):
    from towers.api.outer import describe_outer
    from towers.core.modes import parse_mode as parse

    line = describe_outer(parse("diloco:8"), None, 4, "towers.train")
    assert line is not None and "0.98 to 1.14 times sync's held-out loss" in line
    assert "train in mode 'sync'" in line and "outer_optimizer=" in line
    assert describe_outer(parse("diloco:8"), NESTEROV, 4, "towers.train") is None
    assert describe_outer(parse("sparseloco:8"), None, 4, "towers.train") is None
    assert describe_outer(parse("diloco:8"), None, 1, "towers.train") is None
    x, y = regression_data(n=16)
    towers.train(make_net(), mse, (x, y), batch_size=8, steps=2, workers=2, mode="diloco:2",
                 progress=False)  # fmt: skip
    said = [ln for ln in capfd.readouterr().err.splitlines() if "default outer step" in ln]
    assert len(said) == 1 and said[0].startswith("towers.train: mode 'diloco:2'")
