"""Bad input to towers.train is refused in the caller, before any process starts."""

from __future__ import annotations

import functools

import pytest
import torch
from helpers import make_net, mse, regression_data

import towers
import towers.api.train


@pytest.fixture(autouse=True)
def no_spawn(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("a worker process was started")

    monkeypatch.setattr(towers.api.train, "spawn", refuse)


DATA = regression_data(20)


def call(**overrides):
    kwargs = {
        "model": make_net(),
        "loss_fn": mse,
        "data": DATA,
        "batch_size": 5,
        "steps": 3,
        "workers": 2,
    }
    kwargs.update(overrides)
    return towers.train(kwargs.pop("model"), kwargs.pop("loss_fn"), kwargs.pop("data"), **kwargs)


class Stream(torch.utils.data.IterableDataset):
    def __iter__(self):
        yield from DATA[0]


def returns_vector(model, shard):
    x, y = shard
    return (model(x) - y).square()


def returns_float(model, shard):
    return 1.0


def returns_constant(model, shard):
    return torch.tensor(1.0)


@pytest.mark.parametrize(
    ("overrides", "error", "message"),
    [
        ({"batch_size": 0}, ValueError, "batch_size must be >= 1, got 0"),
        ({"batch_size": 2.5}, TypeError, "batch_size must be an int"),
        ({"workers": 0}, ValueError, "workers must be >= 1, got 0"),
        ({"workers": "4"}, TypeError, "workers must be an int"),
        ({"steps": None}, ValueError, "give either steps= .* or epochs= .*, not neither"),
        ({"epochs": 2}, ValueError, "not both"),
        ({"steps": -1}, ValueError, "steps must be >= 1"),
        ({"loss_fn": lambda m, s: mse(m, s)}, ValueError, "loss_fn cannot be sent to worker"),
        ({"loss_fn": "mse"}, TypeError, "loss_fn must be callable"),
        ({"data": (torch.zeros(20, 3), torch.zeros(19, 1))}, ValueError, "dim-0 size"),
        ({"data": [1, 2, 3]}, ValueError, "cannot be split along a batch dimension"),
        ({"data": "abc"}, TypeError, "data must be a tensor"),
        ({"data": torch.zeros(0, 3)}, ValueError, "no samples"),
        ({"data": Stream()}, TypeError, "IterableDataset; towers needs random access"),
        ({"checkpoint": 3}, TypeError, "checkpoint must be a directory path"),
        ({"checkpoint": __file__}, ValueError, "exists and is not a directory"),
        ({"max_restarts": -1}, ValueError, "max_restarts must be an int >= 0"),
        ({"checkpoint_every": 0}, ValueError, "checkpoint_every must be >= 1"),
        ({"timeout": "10"}, TypeError, "timeout must be a number of seconds, got str '10'"),
        ({"timeout": 0}, ValueError, "timeout must be a finite number of seconds > 0, got 0"),
        ({"timeout": -5}, ValueError, "timeout must be a finite number of seconds > 0, got -5"),
        ({"timeout": float("nan")}, ValueError, "finite number of seconds > 0, got nan"),
        ({"mode": 3}, TypeError, "mode must be a string"),
        ({"model": "net"}, TypeError, "model must be a torch.nn.Module"),
        ({"model": torch.nn.ReLU()}, ValueError, "no trainable parameters"),
        ({"mode": "fast"}, ValueError, 'unknown mode .*valid modes are "sync", "async"'),
        ({"mode": "ssp:x"}, ValueError, "needs an integer argument"),
        ({"loss_fn": returns_vector}, ValueError, r"scalar tensor .* shape \[3, 1\]"),
        ({"loss_fn": returns_float}, TypeError, "must return a scalar tensor .* got float"),
        ({"loss_fn": returns_constant}, ValueError, "does not depend on any trainable"),
        (
            {"optimizer": torch.optim.SGD(make_net().parameters(), lr=0.1)},
            TypeError,
            "optimizer must be a callable that returns a new Optimizer",
        ),
        (
            {"optimizer": functools.partial(torch.optim.SGD, lr=0.1), "lr_schedule": 3},
            TypeError,
            "lr_schedule must be callable",
        ),
    ],
)
def test_bad_input_is_refused_with_advice(overrides, error, message):
    with pytest.raises(error, match=message):
        call(**overrides)


@pytest.mark.parametrize("mode", ["async", "ssp:1", "local:2", "backup:1"])
def test_checkpoints_and_restarts_are_accepted_in_every_mode(mode, tmp_path):
    # validation lets the job start, and the failed start is retried once
    with (
        pytest.warns(RuntimeWarning, match="restart 1 of 1"),
        pytest.raises(AssertionError, match="a worker process was started"),
    ):
        call(mode=mode, checkpoint=tmp_path, max_restarts=1)


def test_an_empty_error_message_still_restarts(monkeypatch, tmp_path):
    def fail_silently(*args, **kwargs):
        raise RuntimeError()

    monkeypatch.setattr(towers.api.train, "spawn", fail_silently)
    with (
        pytest.warns(RuntimeWarning, match=r"training failed \(RuntimeError\); restart 1 of 1"),
        pytest.raises(RuntimeError),
    ):
        call(checkpoint=tmp_path, max_restarts=1)


@pytest.mark.parametrize("timeout", ["10", 0, float("inf")])
def test_init_and_spawn_check_their_timeout(timeout):
    error = TypeError if isinstance(timeout, str) else ValueError
    with pytest.raises(error, match="timeout must be"):
        towers.init(timeout=timeout)
    with pytest.raises(error, match="timeout must be"):
        towers.spawn(print, 1, timeout=timeout)
