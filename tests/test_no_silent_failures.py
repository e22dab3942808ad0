"""Runs that used to go wrong without a word: each now ends in an error or a warning with the fix.

A run in which every step was skipped, a loss cut from the model, a timeout too large for the
clocks underneath, a model on the meta device, a worker killed by the OOM killer, more workers
than cores.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
from cgroups import memory_cgroup
from helpers import make_net, mse, regression_data

import towers
import towers.api.train
from towers.processes.env import cpu_count
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


def nan_loss(model, shard):
    return mse(model, shard) * float("nan")


def nan_once(model, shard):
    nan_once.calls += 1
    return mse(model, shard) * (float("nan") if nan_once.calls == 3 else 1.0)


@pytest.mark.timeout(90)
def test_a_run_that_applies_no_update_says_so():
    model = make_net()
    with pytest.warns(RuntimeWarning) as caught:
        result = train(model=model, loss_fn=nan_loss)
    message = (
        "no update was applied: all 4 steps were skipped because a loss or gradient was not "
        "finite (the first: step 0, towers [0, 1]), so the returned model is the model passed in"
    )
    assert [str(w.message).startswith(message) for w in caught] == [True], caught
    assert result.updates == 0 and len(result.skipped) == 4
    for a, b in zip(result.model.parameters(), model.parameters(), strict=True):
        assert torch.equal(a, b)
    # one skipped step of four (the preflight's loss is call 1; one worker: in this process)
    nan_once.calls = 0
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert train(loss_fn=nan_once, workers=1).updates == 3


def cut_loss(model, shard):
    return mse(model, shard).detach().requires_grad_()


GLOBAL = make_net(seed=1)


def another_models_loss(model, shard):
    return mse(GLOBAL, shard)


def test_a_loss_with_no_path_to_a_parameter_is_refused(no_spawn):
    leaf = r"returned a tensor that is a leaf of the autograd graph .*change no parameter"
    with pytest.raises(ValueError, match=rf"loss_fn {leaf}.*loss\.detach\(\)\.requires_grad_"):
        train(loss_fn=cut_loss)
    other = r"reaches none of the trainable parameters of the model it was given \(was it"
    with pytest.raises(ValueError, match=rf"loss_fn returned a tensor that {other} computed"):
        train(loss_fn=another_models_loss)
    ctx = towers.init()  # a world of one: the own loop checks its loss too
    model = ctx.replicate(make_net())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match=rf"ctx\.backward\(\)/ctx\.step\(\) {leaf}"):
        ctx.step(cut_loss(model, DATA), opt)


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


def test_a_meta_model_is_refused_with_the_fix(no_spawn):
    with torch.device("meta"):
        model = make_net()
    what = r"got a model on the meta device: 4 of its 4 parameters and buffers \(the first: "
    what += r"fc1.weight \[8, 3\]\) have a shape but no values"
    fix = r"model\.to_empty\(device='cpu'\), then initialise them .* or build the model on the CPU"
    with pytest.raises(ValueError, match=rf"train\(\) {what}.*{fix}"):
        train(model=model)
    with pytest.raises(ValueError, match=rf"ctx\.replicate\(\) {what}.*{fix}"):
        towers.init().replicate(model)


@pytest.mark.timeout(90)
def test_more_workers_than_cores_warn_what_it_costs():
    workers = cpu_count() + 1
    cost = rf"workers={workers} on {cpu_count()} cores: the towers take turns on the cores .* "
    cost += rf"a step takes about {workers / cpu_count():.3g} times one tower's compute"
    with pytest.warns(UserWarning, match=cost + rf".*workers={cpu_count()} gives the same result"):
        result = train(workers=workers, steps=2)
    assert result.workers == workers


def kill_myself():
    if os.environ["RANK"] == "1":
        os.kill(os.getpid(), signal.SIGKILL)
    return 0


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_a_worker_killed_by_the_oom_killer_is_named_so():
    """A real OOM kill: train() runs in a memory cgroup of 1.5 GiB, and worker 1 allocates 4."""
    with memory_cgroup(3 << 29) as cgroup:
        done = subprocess.run(
            ["sh", "-c", f'echo $$ > {cgroup}/cgroup.procs && exec "$@"', "sh", sys.executable,
             str(SCRIPTS / "oom_caller.py")],
            capture_output=True, text=True, timeout=150, env={**os.environ, "PYTHONPATH": SRC},
        )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out["rank"] == 1 and out["exitcode"] == -9, out
    assert out["error"].startswith("worker 1 (pid "), out
    assert (
        "died with signal SIGKILL before returning a result: killed by the out-of-memory killer "
        f"(the OOM-kill count of the memory cgroup {cgroup} rose from 0 to 1 while it ran). It "
        "needed more memory than the machine or its cgroup allows: lower batch_size"
    ) in out["error"]
    # SIGKILL without an OOM kill is not taken for one
    with pytest.raises(towers.WorkerError) as plain:
        towers.spawn(kill_myself, 2)
    assert "died with signal SIGKILL before returning a result" in str(plain.value)
    assert "out-of-memory" not in str(plain.value)
