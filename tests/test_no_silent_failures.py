"""Runs that used to go wrong without a word: each now ends in an error or a warning with
the fix."""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers import make_net, mse, regression_data

import towers
import towers.api.train
from towers.tools.cli import main

DATA = regression_data(24)
SRC = str(Path(__file__).resolve().parents[1] / "src")
SCRIPTS = Path(__file__).parent / "scripts"


def train(**kwargs):
    options = {"batch_size": 6, "steps": 4, "workers": 2, "progress": False, "timeout": 30}
    model, loss_fn = kwargs.pop("model", make_net()), kwargs.pop("loss_fn", mse)
    return towers.train(model, loss_fn, DATA, **(options | kwargs))


@pytest.fixture
def no_spawn(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("a worker process was started")

    monkeypatch.setattr(towers.api.train, "spawn", refuse)


def test_a_timeout_out_of_range_is_refused_in_the_caller(no_spawn, monkeypatch, capsys):
    expected = r"timeout must be at most 1e\+09 seconds \(about 31 years\), got 1e\+15; the "
    expected += r"accepted range is 0 < timeout <= 1e\+09"
    with pytest.raises(ValueError, match=expected):
        train(timeout=1e15)
    with pytest.raises(ValueError, match="the accepted range is 0 < timeout <= 1e"):
        train(timeout=0)
    with pytest.raises(ValueError, match=expected):
        towers.init(timeout=1e15)
    with pytest.raises(ValueError, match=expected):
        towers.spawn(print, 1, timeout=1e15)
    script = SCRIPTS / "elastic_loop.py"
    assert main(["run", str(script), "--elastic", "--timeout", "1e15"]) == 2
    assert "--timeout must be at most 1e+09 seconds" in capsys.readouterr().err
    # an own loop under towers run --elastic: refused before it connects to anything
    env = {"TOWERS_ELASTIC": "1", "RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": "1"}  # fmt: skip
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(ValueError, match=expected):
        towers.init(timeout=1e15)


def rank(*_):
    ctx = towers.init(timeout=1e9)
    return ctx.rank


@pytest.mark.timeout(90)
def test_the_largest_timeout_works():
    """1e9 s passes through torch.distributed, Python's threads and a 24-day limit of poll(2)."""
    assert towers.spawn(rank, 2, timeout=1e9) == [0, 1]
    assert train(timeout=1e9).steps == 4
