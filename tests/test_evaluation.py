"""Evaluation during training and per-epoch schedules, against a plain single-process loop."""

from __future__ import annotations

import copy
import functools

import pytest
import torch
from exact import Reference, as_float64
from helpers import make_net, mse, regression_data
from torch.utils.data import DataLoader, TensorDataset

import towers

SGD = functools.partial(torch.optim.SGD, lr=0.1, momentum=0.5)
HALVE_EACH_EPOCH = functools.partial(torch.optim.lr_scheduler.StepLR, step_size=1, gamma=0.5)


def metrics(model, batch):
    x, y = batch
    out = model(x)
    return {"mse": (out - y).square().mean(), "mae": (out - y).abs().mean()}


def plain_evaluate(model, data, eval_fn=None):
    """One process, one batch holding all of the evaluation data."""
    model.eval()
    with torch.no_grad():
        out = eval_fn(model, data) if eval_fn else {"loss": mse(model, data)}
    model.train()
    return {k: float(v) for k, v in out.items()}


def plain_loop(
    data, eval_data, *, batch_size, epochs, eval_every, eval_fn=None, seed=0, dtype=torch.float32
):
    """A typical script: a DataLoader, a per-epoch StepLR, evaluation every ``eval_every``;
    in ``dtype`` (float64: the model, the data and the evaluation data cast)."""
    model = make_net().to(dtype)
    if dtype == torch.float64:
        data, eval_data = as_float64(data), as_float64(eval_data)
    loader = DataLoader(
        TensorDataset(*data),
        batch_size=batch_size,
        shuffle=True,
        generator=torch.Generator().manual_seed(seed),
    )
    opt = SGD(model.parameters())
    schedule = HALVE_EACH_EPOCH(opt)
    losses, evals, done = [], [], 0
    for _ in range(epochs):
        for batch in loader:
            opt.zero_grad()
            loss = mse(model, batch)
            loss.backward()
            opt.step()
            losses.append(loss.item())
            done += 1
            if done % eval_every == 0:
                evals.append((done, plain_evaluate(model, eval_data, eval_fn)))
        schedule.step()
    if not evals or evals[-1][0] != done:
        evals.append((done, plain_evaluate(model, eval_data, eval_fn)))
    return model, losses, evals


def values(evals) -> list[float]:
    """Every metric of every evaluation, in order (by step, then by name)."""
    return [e[key] for _, e in evals for key in sorted(e)]


def assert_evals_like(got, single, exact, what="towers' evaluations"):
    """``got`` (a run's ``evals``) at the steps and with the metrics of the plain loop's, each
    value within the bound :class:`exact.Reference` derives from the plain evaluations in
    float32 (``single``) and float64 (``exact``), over all the values."""
    assert [(d, sorted(e)) for d, e in got] == [(d, sorted(e)) for d, e in exact]
    Reference({}, {}, values(single), values(exact)).check_losses(values(got), what)


def evaluation_reference(model, data, eval_fn=None):
    """``plain_evaluate`` of ``model``'s parameters as they are, in float32 and in float64:
    ``(float32 evals, float64 evals)``, each a list of one ``(0, metrics)``."""
    single = plain_evaluate(copy.deepcopy(model), data, eval_fn)
    exact = plain_evaluate(copy.deepcopy(model).double(), as_float64(data), eval_fn)
    return [(0, single)], [(0, exact)]


def plain_runs(data, eval_data, **loop):
    """:func:`plain_loop` in float32 and in float64: a Reference of the training and the two
    lists of evaluations."""
    evals = {}

    def run(dtype):
        model, losses, evals[dtype] = plain_loop(data, eval_data, dtype=dtype, **loop)
        return model, losses

    reference = Reference.run(run)
    return reference, evals[torch.float32], evals[torch.float64]


@pytest.mark.timeout(90)
def test_sync_evaluation_and_epoch_schedule_match_a_plain_loop():
    # 45 samples in batches of 10: 5 batches per epoch, the last of 5; 3 towers get uneven
    # shards, and 13 evaluation samples in chunks of 10 split over 3 towers are uneven too.
    data, eval_data = regression_data(45), regression_data(13, seed=5)
    result = towers.train(
        make_net(),
        mse,
        data,
        batch_size=10,
        epochs=3,
        workers=3,
        optimizer=SGD,
        lr_schedule=HALVE_EACH_EPOCH,
        lr_interval="epoch",
        eval_data=eval_data,
        eval_fn=metrics,
        eval_every=4,
        progress=False,
    )
    reference, single, exact = plain_runs(
        data, eval_data, batch_size=10, epochs=3, eval_every=4, eval_fn=metrics
    )
    reference.check_losses(result.losses)
    reference.check(result.model)
    assert [d for d, _ in result.evals] == [4, 8, 12, 15]
    assert_evals_like(result.evals, single, exact)


@pytest.mark.timeout(90)
def test_async_server_evaluates_and_schedules_per_epoch():
    # One tower: the server applies every gradient in order, as a plain loop does.
    data, eval_data = regression_data(45), regression_data(13, seed=5)
    result = towers.train(
        make_net(),
        mse,
        data,
        batch_size=10,
        epochs=2,
        workers=1,
        mode="async",
        optimizer=SGD,
        lr_schedule=HALVE_EACH_EPOCH,
        lr_interval="epoch",
        eval_data=eval_data,
        eval_every=5,
        progress=False,
    )
    reference, single, exact = plain_runs(data, eval_data, batch_size=10, epochs=2, eval_every=5)
    reference.check_losses(result.losses)
    reference.check(result.model)
    assert_evals_like(result.evals, single, exact)


def test_resume_keeps_evaluations_and_the_epoch_schedule(tmp_path):
    data, eval_data = regression_data(45), regression_data(13, seed=5)
    common = dict(
        batch_size=10,
        workers=1,
        optimizer=SGD,
        lr_schedule=HALVE_EACH_EPOCH,
        lr_interval="epoch",
        eval_data=eval_data,
        eval_every=5,
        progress=False,
    )
    # workers=1: each run trains in this process, the resumed one as the whole one did
    whole = towers.train(make_net(), mse, data, steps=13, **common)
    towers.train(make_net(), mse, data, steps=7, checkpoint=tmp_path, checkpoint_every=7, **common)
    resumed = towers.train(make_net(), mse, data, steps=13, checkpoint=tmp_path, **common)
    assert [d for d, _ in resumed.evals] == [5, 10, 13]
    assert resumed.evals == whole.evals  # the same arithmetic: equal bit for bit
    for (name, p), q in zip(resumed.model.state_dict().items(), whole.model.state_dict().values()):
        assert torch.equal(p, q), name


def test_default_eval_fn_is_the_loss_over_all_samples():
    data, eval_data = regression_data(45), regression_data(13, seed=5)
    result = towers.train(
        make_net(), mse, data, batch_size=10, steps=3, workers=1, eval_data=eval_data
    )
    assert [d for d, _ in result.evals] == [3]
    single, exact = evaluation_reference(result.model, eval_data)
    assert_evals_like([(0, result.evals[0][1])], single, exact)


def not_a_dict(model, batch):
    return mse(model, batch)


def per_sample(model, batch):
    x, y = batch
    return {"loss": (model(x) - y).square().flatten()}


@pytest.mark.parametrize(
    ("overrides", "error", "message"),
    [
        ({"eval_every": 5}, ValueError, "eval_every= needs eval_data="),
        ({"eval_fn": metrics}, ValueError, "eval_fn= needs eval_data="),
        ({"eval_data": regression_data(5), "eval_every": 0}, ValueError, "eval_every must be"),
        ({"eval_data": regression_data(5), "eval_fn": lambda m, b: {}}, ValueError, "lambda"),
        ({"eval_data": regression_data(5), "eval_fn": not_a_dict}, TypeError, "non-empty dict"),
        ({"eval_data": regression_data(5), "eval_fn": per_sample}, ValueError, "scalar"),
        ({"eval_data": (torch.zeros(0, 3), torch.zeros(0, 1))}, ValueError, "no samples"),
        ({"lr_interval": "batch"}, ValueError, "lr_interval must be 'step'"),
    ],
)
def test_bad_evaluation_arguments_are_refused_in_the_caller(overrides, error, message):
    kwargs = dict(batch_size=10, steps=2, workers=2, progress=False) | overrides
    with pytest.raises(error, match=message):
        towers.train(make_net(), mse, regression_data(45), **kwargs)


def test_eval_curve_plots_one_metric_against_global_batches(tmp_path):
    from towers.tools.plots import eval_curve, save_loss_plot

    evals = [(5, {"loss": 0.5, "acc": 0.7}), (10, {"loss": 0.25, "acc": 0.9})]
    xs, ys, style = eval_curve(evals, "acc", color="C1")
    assert (xs, ys) == ([5, 10], [0.7, 0.9]) and style["color"] == "C1"
    path = save_loss_plot(
        [([1, 2, 3], [1.0, 0.5, 0.2], {"label": "train"}), eval_curve(evals)],
        tmp_path / "p.png",
        title="t",
        xlabel="global batches",
        ylabel="loss",
    )
    assert path.stat().st_size > 1000


@pytest.mark.timeout(90)
def test_local_sgd_evaluates_the_final_average_at_the_end():
    data, eval_data = regression_data(45), regression_data(13, seed=5)
    result = towers.train(
        make_net(),
        mse,
        data,
        batch_size=10,
        steps=6,
        workers=2,
        mode="local:4",  # the last average comes after the last shard's result
        optimizer=SGD,
        eval_data=eval_data,
        eval_every=3,
        progress=False,
    )
    assert [d for d, _ in result.evals] == [3, 6]
    single, exact = evaluation_reference(result.model, eval_data)
    assert_evals_like([(0, result.evals[-1][1])], single, exact)


class Pairs(torch.utils.data.Dataset):
    def __init__(self, x, y):
        self.x, self.y = x, y

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return self.x[i], self.y[i]


def _own_loop_evaluation():
    ctx = towers.init(timeout=60)
    try:
        model = ctx.replicate(make_net())
        x, y = regression_data(23, seed=4)  # 23 samples in chunks of 5 over 3 ranks: uneven
        tensors = ctx.evaluate(model, (x, y), metrics, batch_size=5)
        dataset = ctx.evaluate(model, Pairs(x, y), metrics, batch_size=5)
        errors = []
        for bad in ({"batch_size": 0}, {"batch_size": 5, "fn": 3}):
            try:
                ctx.evaluate(model, (x, y), bad.pop("fn", metrics), **bad)
            except (ValueError, TypeError) as exc:
                errors.append(str(exc))
        return tensors, dataset, errors, model.training
    finally:
        ctx.close()


@pytest.mark.timeout(60)
def test_own_loop_evaluation_equals_one_process():
    single, exact = evaluation_reference(make_net(), regression_data(23, seed=4), metrics)
    for tensors, dataset, errors, training in towers.spawn(_own_loop_evaluation, 3):
        assert_evals_like([(0, tensors)], single, exact, "ctx.evaluate of tensors")
        assert_evals_like([(0, dataset)], single, exact, "ctx.evaluate of a Dataset")
        assert training  # the model is back in training mode
        assert "batch_size must be an int >= 1, got 0" in errors[0]
        assert "fn must be callable" in errors[1]
