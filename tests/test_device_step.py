"""A step decided on the device (towers.core.verdict), run on the CPU.

On a GPU a synchronous step is decided where its sums are and the optimizer's step is skipped
there (towers.engines.sync.guard), so that the host never waits for the device inside a step.
``TOWERS_DECIDE_ON_DEVICE=1`` runs that same path on CPU workers; here it is held to what the
eager path guarantees: a non-finite step is skipped on every tower with its culprit named,
neither the parameters nor the optimizer's state change, the loss is read only when asked for,
and the run equals one process's.
"""

from __future__ import annotations

import copy
import functools
import math

import pytest
import torch
from exact import Reference, as_float64
from helpers import Net, make_net, mse, regression_data, towers_holding
from torch import nn

import towers
from towers.core.verdict import PendingResult, known
from towers.engines.sync.driver import DECIDE_ON_DEVICE

STEPS, BATCH, NAN_STEP, NAN_SAMPLE = 5, 9, 2, 7

OPTIMIZERS = {
    # fused: the skip is the kernel's found_inf, never read on the host after the first step
    "adamw-fused": functools.partial(torch.optim.AdamW, lr=0.05, weight_decay=0.1, fused=True),
    # any other optimizer: the guard reads the decision when it steps
    "sgd-momentum": functools.partial(torch.optim.SGD, lr=0.05, momentum=0.9),
}


@pytest.fixture
def on_device(monkeypatch):
    monkeypatch.setenv(DECIDE_ON_DEVICE, "1")


def batches(dtype: torch.dtype = torch.float32) -> list[tuple[torch.Tensor, torch.Tensor]]:
    x, y = regression_data(STEPS * BATCH)
    x[NAN_STEP * BATCH + NAN_SAMPLE, 0] = math.nan
    if dtype == torch.float64:
        x, y = as_float64((x, y))
    return [(x[i : i + BATCH], y[i : i + BATCH]) for i in range(0, STEPS * BATCH, BATCH)]


def _copied(opt: torch.optim.Optimizer, model: torch.nn.Module):
    return copy.deepcopy(opt.state_dict()), [p.detach().clone() for p in model.parameters()]


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return torch.equal(a, b)
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


def _own_loop(kind: str):
    ctx = towers.init(timeout=60)
    try:
        torch.manual_seed(0)
        # a balanced split reads each step's numbers as soon as they arrive: on a CPU, at once
        model = ctx.replicate(Net(), balance=False)
        opt = OPTIMIZERS[kind](model.parameters())
        results, seen = [], []
        for k, shard in enumerate(ctx.shards(batches())):
            r = ctx.backward(mse(model, shard))
            unread = isinstance(r, PendingResult) and not known(r)
            before = _copied(opt, model)
            opt.step()
            opt.zero_grad()
            changed = not _same(before, _copied(opt, model))
            seen.append((k, unread, known(r), changed))
            results.append(r)
        losses = [r.loss for r in results]  # read here, long after their steps
        skipped = [(k, r.culprits) for k, r in enumerate(results) if r.skipped]
        return {n: p.detach().clone() for n, p in model.state_dict().items()}, losses, skipped, seen
    finally:
        ctx.close()


def _plain(kind: str, dtype: torch.dtype):
    torch.manual_seed(0)
    model = Net().to(dtype)
    opt = OPTIMIZERS[kind](model.parameters())
    losses = []
    for batch in batches(dtype):
        loss = mse(model, batch)
        loss.backward()
        if math.isfinite(loss.item()):
            opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return model, losses


@pytest.mark.timeout(90)
@pytest.mark.parametrize("kind", sorted(OPTIMIZERS))
def test_own_loop_skips_on_the_device_and_reads_the_loss_late(on_device, kind):
    out = towers.spawn(functools.partial(_own_loop, kind), 2)
    reference = Reference.run(functools.partial(_plain, kind))
    culprit = next(t for t, s in enumerate(towers.split(torch.arange(BATCH), 2)) if NAN_SAMPLE in s)
    for rank, (state, losses, skipped, seen) in enumerate(out):
        reference.check(state, f"rank {rank}")
        reference.check_losses(losses, f"rank {rank}")
        assert skipped == [(NAN_STEP, [culprit])], skipped
        for k, unread, read_by_step, changed in seen:
            assert unread, f"step {k}: ctx.backward read the step's numbers"
            assert changed == (k != NAN_STEP), f"step {k}: the step changed {changed}"
            # the fused optimizer takes the decision on the device, after its first step
            on_host = kind != "adamw-fused" or k == 0
            assert read_by_step == on_host, f"step {k}: read by optimizer.step(): {read_by_step}"


@pytest.mark.timeout(90)
@pytest.mark.parametrize("kind", sorted(OPTIMIZERS))
def test_train_skips_on_the_device_and_names_the_culprit(on_device, kind):
    x, y = regression_data(40)
    x[NAN_SAMPLE, 1] = math.nan
    workers, batch = 2, 10
    with pytest.warns(RuntimeWarning, match=r"NaN or Inf in 1 sample\(s\) \(7\)"):
        result = towers.train(
            make_net(), mse, (x, y), batch_size=batch, steps=8, workers=workers,
            optimizer=OPTIMIZERS[kind], seed=5, progress=False,
        )  # fmt: skip
    reference = Reference.of(
        make_net(), (x, y), batch_size=batch, steps=8, optimizer=OPTIMIZERS[kind], seed=5
    )
    assert len(reference.skipped) == 2
    assert [s for s, _ in result.skipped] == reference.skipped
    holding = towers_holding(NAN_SAMPLE, 40, batch, workers, seed=5, epochs=2)
    for step, culprits in result.skipped:
        assert culprits == holding[step]
    reference.check_losses(result.losses)
    reference.check(result.model)


def _disagreeing_batches():
    ctx = towers.init(timeout=60)
    try:
        torch.manual_seed(0)
        model = ctx.replicate(Net(), balance=False)
        opt = torch.optim.AdamW(model.parameters(), lr=0.05, fused=True)
        data = batches()
        r = ctx.step(mse(model, next(iter(ctx.shards(data[:1])))), opt)  # builds the state
        assert not r.skipped
        mine = data[1] if ctx.rank == 0 else data[3]  # rank 1 drew another batch
        before = _copied(opt, model)
        (shard,) = ctx.shards([mine])
        r = ctx.backward(mse(model, shard))
        opt.step()  # skipped on the device: the batches disagree
        unchanged = _same(before, _copied(opt, model))
        try:
            _ = r.loss
        except ValueError as exc:
            return unchanged, str(exc)
        return unchanged, None
    finally:
        ctx.close()


@pytest.mark.timeout(60)
def test_ranks_on_different_batches_change_nothing_and_raise_when_read(on_device):
    for unchanged, error in towers.spawn(_disagreeing_batches, 2):
        assert unchanged
        assert error is not None and "not on the same global batch" in error


def test_a_pending_result_reads_once_and_keeps_its_failure():
    reads = []

    def read(host):
        reads.append(host)
        raise ValueError("the ranks disagree")

    r = PendingResult(torch.tensor(False), torch.zeros(3), read)
    assert not known(r)
    for _ in range(2):
        with pytest.raises(ValueError, match="the ranks disagree"):
            r.skipped  # noqa: B018
    assert len(reads) == 1


def test_float16_without_a_scaler_is_named():
    with pytest.raises(ValueError, match=r"parameters are float16 without a torch.amp.GradScaler"):
        towers.train(
            make_net().half(), mse, regression_data(12), batch_size=6, steps=1, progress=False
        )
    ctx = towers.init()
    try:
        model = ctx.replicate(Net())
        x, y = regression_data(6)
        with torch.autocast("cpu", dtype=torch.float16):
            loss = mse(model, (x, y))
            with pytest.raises(ValueError, match=r"autocast\('cpu', dtype=torch.float16\)"):
                ctx.backward(loss)
        model = ctx.replicate(Net().half())
        (shard,) = ctx.shards([(x.half(), y.half())])
        with pytest.raises(ValueError, match=r"ctx.backward\(loss, scaler=torch.amp.GradScaler"):
            ctx.step(mse(model, shard), torch.optim.SGD(model.parameters(), lr=0.1))
        scaler = torch.amp.GradScaler("cpu")
        ctx.backward(mse(model, shard), scaler=scaler)  # with its scaler: trained
    finally:
        ctx.close()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("compress", ["int8", "powersgd:1"])
def test_a_compressed_step_decided_on_the_device_trains_as_the_eager_one(monkeypatch, compress):
    """A transform with state (an error-feedback residual, PowerSGD's warm start) commits it
    only for applied steps; decided on the device, it is committed when the next step needs
    it. With a NaN step among them, both paths train to the same parameters, bit for bit."""
    x, y = regression_data(40)
    x[NAN_SAMPLE, 1] = math.nan
    options = dict(batch_size=10, steps=8, workers=2, seed=5, progress=False, balance=False)
    runs = []
    for on in ("1", "0"):
        monkeypatch.setenv(DECIDE_ON_DEVICE, on)
        with pytest.warns(RuntimeWarning, match=r"NaN or Inf in 1 sample"):
            opt = OPTIMIZERS["adamw-fused"]
            runs.append(
                towers.train(make_net(), mse, (x, y), optimizer=opt, compress=compress, **options)
            )
    device, eager = runs
    assert device.skipped == eager.skipped and len(eager.skipped) == 2
    assert device.losses == pytest.approx(eager.losses, nan_ok=True, rel=0, abs=0)
    for a, b in zip(device.model.parameters(), eager.model.parameters()):
        assert torch.equal(a, b)


class _TwoHeads(nn.Module):
    """A model whose second head a step may leave out (no tower has its gradient then)."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(3, 1), nn.Linear(3, 1)

    def forward(self, x: torch.Tensor, both: bool = True) -> torch.Tensor:
        return self.a(x) + (self.b(x) if both else 0)


def _habits(kind: str):
    """What scripts do around a step: a GradScaler over a fused optimizer after a plain
    ``loss.backward()``; two optimizers over halves of the model; a loop that steps only the
    steps it reads as applied, then a step decided on the host (one head without a gradient)."""
    ctx = towers.init(timeout=60)
    try:
        torch.manual_seed(0)
        model = ctx.replicate(_TwoHeads(), balance=False)
        params = list(model.parameters())
        if kind == "two optimizers":
            opts = [torch.optim.AdamW(ps, lr=0.05, fused=True) for ps in (params[:2], params[2:])]
        else:
            opts = [torch.optim.SGD(params, lr=0.05, momentum=0.9, fused=kind == "scaler")]
        scaler = torch.amp.GradScaler("cpu", init_scale=1024.0) if kind == "scaler" else None
        for k, (x, y) in enumerate(ctx.shards(batches())):
            loss = nn.functional.mse_loss(model(x, both=k != STEPS - 1), y)
            if scaler is not None:
                scaler.scale(loss).backward()
                scaler.step(opts[0])
                scaler.update()
            elif kind == "two optimizers":
                ctx.backward(loss)
                for opt in opts:
                    opt.step()
            elif not ctx.backward(loss).skipped:  # read at once: steps only applied steps
                opts[0].step()
            for opt in opts:
                opt.zero_grad()
        return {n: p.detach().clone() for n, p in model.state_dict().items()}
    finally:
        ctx.close()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("kind", ["scaler", "two optimizers", "reads then steps"])
def test_a_script_s_habits_train_as_on_the_eager_path(monkeypatch, kind):
    """Each habit with a NaN step among them: decided on the device, the run ends where the
    eager path's does, bit for bit (a GradScaler's own found_inf is kept, every optimizer over
    the model is guarded, and a skipped step's decision never reaches a later step)."""
    runs = []
    for on in ("1", "0"):
        monkeypatch.setenv(DECIDE_ON_DEVICE, on)
        runs.append(towers.spawn(functools.partial(_habits, kind), 2)[0])
    device, eager = runs
    assert all(torch.isfinite(v).all() for v in eager.values())
    for name, value in eager.items():
        assert torch.equal(device[name], value), name
