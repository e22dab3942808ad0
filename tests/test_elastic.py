"""Elastic sync: a worker killed (SIGKILL) or hung (SIGSTOP) mid-run is dropped, the survivors
redo the interrupted global batch, a replacement may join, and the trained parameters still equal
a plain single-process loop's, to float32's rounding (tests/exact.py; docs/elastic.md).

The faults come from the test: the loss function leaves one file per worker process (named by
its id and pid) and grows it by a byte per call; a thread here waits until the run has made a
random amount of progress, then signals a random worker's pid.
"""

from __future__ import annotations

import functools
import os
import random
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from exact import FACTOR, Reference, bound
from helpers import elastic_loop_reference, make_net

import towers
from towers.core.data import BatchOrder
from towers.core.step import StepMeta

SCRIPTS = Path(__file__).parent / "scripts"


def _data(n: int = 90) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    x = torch.randn(n, 3, generator=g)
    return x, (x[:, :1] * 2 - x[:, 1:2]).sin()


def traced_mse(progress: str, model: torch.nn.Module, shard) -> torch.Tensor:
    """The mean squared error, slowed down a little; records which worker computed it."""
    who = os.environ.get("RANK", "caller")
    with open(os.path.join(progress, f"{who}-{os.getpid()}"), "a") as f:
        f.write(".")
    time.sleep(0.02)
    x, y = shard
    return (model(x) - y).square().mean()


class Saboteur(threading.Thread):
    """Signals a random worker each time the run's progress (loss calls) passes a threshold."""

    def __init__(self, progress: Path, faults: list[tuple[int, int]], rng: random.Random):
        super().__init__(daemon=True)
        self.progress, self.faults, self.rng = progress, faults, rng
        self.hit: list[tuple[int, int]] = []  # (worker id, signal)
        self.stop = threading.Event()

    def run(self) -> None:
        pending = list(self.faults)
        struck: set[int] = set()
        while pending and not self.stop.wait(0.01):
            files = {
                f: int(f.name.split("-")[1])
                for f in self.progress.iterdir()
                if not f.name.startswith("caller")
            }
            calls = sum(f.stat().st_size for f in files)
            if calls < pending[0][0]:
                continue
            candidates = [f for f, pid in files.items() if pid not in struck]
            victim = self.rng.choice(sorted(candidates))
            pid = files[victim]
            sig = pending.pop(0)[1]
            os.kill(pid, sig)
            struck.add(pid)
            self.hit.append((int(victim.name.split("-")[0]), sig))


def _run_with_faults(
    tmp_path, *, workers, transport, faults, restarts, seed, build=make_net, wrap=None, **train_kw
):
    rng = random.Random(seed)
    x, y = _data()
    steps, batch = 24, 16
    progress = tmp_path / "progress"
    progress.mkdir()
    # each fault at a random step (after the first few, before the last few)
    at = sorted(rng.randrange(2 * workers, 16 * workers) for _ in faults)
    saboteur = Saboteur(progress, [(a, s) for a, s in zip(at, faults)], rng)
    saboteur.start()
    try:
        result = towers.train(
            build(),
            functools.partial(traced_mse, str(progress)),
            (x, y) if wrap is None else wrap(x, y),
            batch_size=batch,
            steps=steps,
            workers=workers,
            elastic=True,
            max_restarts=restarts,
            transport=transport,
            timeout=30,
            progress=False,
            **train_kw,
        )
    finally:
        saboteur.stop.set()
        saboteur.join()
    return result, _reference(steps, batch, build), saboteur.hit


def _reference(steps: int, batch: int = 16, build=make_net) -> Reference:
    """A plain loop over the same batches with train's default optimizer, in float32 and
    float64 (tests/exact.py)."""
    return Reference.of(
        build(),
        _data(),
        batch_size=batch,
        steps=steps,
        optimizer=lambda p: torch.optim.SGD(p, lr=0.01),
        loss_fn=lambda m, s: (m(s[0]) - s[1]).square().mean(),
    )


def _grown(tmp_path, steps: int, **train_kw):
    """An elastic train() of 3 workers that starts with fewer (``min_workers`` in
    ``train_kw``); returns the result and the directory of its loss calls (traced_mse)."""
    progress = tmp_path / "progress"
    progress.mkdir()
    result = towers.train(
        make_net(),
        functools.partial(traced_mse, str(progress)),
        _data(),
        batch_size=16,
        steps=steps,
        workers=3,
        elastic=True,
        timeout=30,
        progress=False,
        **train_kw,
    )
    return result, progress


CASES = [
    # workers, transport, faults, replacements
    (3, "gloo", [signal.SIGKILL], 0),
    (4, "shm", [signal.SIGKILL, signal.SIGSTOP], 1),
    (3, "gloo", [signal.SIGSTOP], 1),
]


@pytest.mark.timeout(90)
@pytest.mark.parametrize(("workers", "transport", "faults", "restarts"), CASES)
@pytest.mark.slow
def test_lost_workers_leave_the_parameters_unchanged(
    tmp_path, workers, transport, faults, restarts
):
    seed = random.randrange(1 << 30)
    result, reference, hit = _run_with_faults(
        tmp_path, workers=workers, transport=transport, faults=faults, restarts=restarts, seed=seed
    )
    why = f"seed {seed}, faults {hit}, world {result.world}"
    assert len(hit) == len(faults), why
    reference.check(result.model, why)
    reference.check_losses(result.losses, why)
    assert sorted(result.dead_workers) == sorted(w for w, _ in hit), why
    assert result.restarts == min(restarts, len(faults)), why
    assert len(result.world) == result.steps == 24
    assert result.world[0] == workers and min(result.world) >= workers - len(faults), why
    if restarts == 0:
        assert result.world[-1] == workers - len(faults), why
    # every loss is recovered from by a redone step (two losses close together: by one)
    assert 1 <= len(result.recoveries) <= len(faults), why
    for step, seconds in result.recoveries:
        assert 0 <= step < 24 and 0 <= seconds < 20, why
    assert result.samples == sum(min(16, 90 - 16 * (k % 6)) for k in range(24))


class Pairs(torch.utils.data.Dataset):
    def __init__(self, x, y):
        self.x, self.y = x, y

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return self.x[i], self.y[i]


def bn_net() -> torch.nn.Module:
    torch.manual_seed(5)
    return torch.nn.Sequential(
        torch.nn.Linear(3, 8), torch.nn.BatchNorm1d(8), torch.nn.Tanh(), torch.nn.Linear(8, 1)
    )


@pytest.mark.timeout(90)
@pytest.mark.slow
def test_sync_batchnorm_and_loader_processes_survive_a_lost_worker(tmp_path):
    """BatchNorm over the global batch and planned loader processes follow the regroup."""
    seed = random.randrange(1 << 30)
    result, reference, hit = _run_with_faults(
        tmp_path,
        workers=3,
        transport="shm",
        faults=[signal.SIGKILL],
        restarts=1,
        seed=seed,
        build=bn_net,
        wrap=Pairs,
        sync_batchnorm=True,
        num_workers=1,
    )
    why = f"seed {seed}, faults {hit}, world {result.world}"
    assert len(hit) == 1 and result.dead_workers == [hit[0][0]], why
    assert min(result.world) == 2, why
    reference.check(result.model, why)  # parameters and the running statistics alike
    reference.check_losses(result.losses, why)


def test_elastic_is_refused_outside_sync_mode(monkeypatch):
    x, y = _data()
    with pytest.raises(ValueError, match=r"elastic=True applies to mode='sync'"):
        towers.train(
            make_net(), traced_mse, (x, y), batch_size=8, steps=1, mode="async", elastic=True
        )
    with pytest.raises(TypeError, match="elastic must be True or False"):
        towers.train(make_net(), traced_mse, (x, y), batch_size=8, steps=1, elastic="yes")
    launched = {"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"}
    for name, value in launched.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(ValueError, match="not for a job started by towers run or torchrun"):
        towers.train(make_net(), traced_mse, (x, y), batch_size=8, steps=1, elastic=True)
    monkeypatch.setenv("TOWERS_ELASTIC", "1")
    with pytest.raises(ValueError, match="towers run --elastic runs own-loop scripts"):
        towers.train(make_net(), traced_mse, (x, y), batch_size=8, steps=1)


@pytest.mark.timeout(90)
@pytest.mark.slow
def test_workers_join_a_job_that_started_with_fewer(tmp_path):
    result, progress = _grown(tmp_path, 30, min_workers=1)
    reference = _reference(30)
    # worker 0 starts alone; workers 1 and 2 are let in at step boundaries as they are built
    assert result.world[0] == 1 and result.world[-1] == 3, result.world
    assert result.world == sorted(result.world), result.world
    assert result.dead_workers == [] and result.restarts == 0
    assert {f.name.split("-")[0] for f in progress.iterdir()} >= {"0", "1", "2"}
    reference.check(result.model, f"world {result.world}")
    reference.check_losses(result.losses, f"world {result.world}")


def sgd_but_not_on_worker_2(params):
    if os.environ.get("RANK") == "2":
        raise RuntimeError("worker 2 cannot build its optimizer")
    return torch.optim.SGD(params, lr=0.01)


@pytest.mark.timeout(90)
@pytest.mark.slow
def test_a_newcomer_that_fails_before_it_is_let_in_leaves_the_job_untouched(tmp_path, capfd):
    result, _ = _grown(tmp_path, 20, min_workers=2, optimizer=sgd_but_not_on_worker_2)
    reference = _reference(20)
    said = capfd.readouterr().err
    assert "towers: worker 2, a newcomer, failed before the job let it in (" in said, said
    assert "worker 2 cannot build its optimizer" in said and "the job goes on without it" in said
    assert result.world == [2] * 20
    reference.check(result.model)


def test_a_joiner_is_told_how_it_differs_from_the_job():
    from torch import nn

    from towers.engines.broadcast import join_difference, terms

    job = terms(make_net(), "sync", "none")
    assert join_difference(job, terms(make_net(), "sync", "none")) is None
    assert join_difference(job, terms(make_net(), "diloco:8", "none")) == (
        "it trains mode 'diloco:8', the job 'sync'"
    )
    assert join_difference(job, terms(make_net(), "sync", "int8")) == (
        "its compression is 'int8', the job's 'none'"
    )
    longer = make_net()
    longer.fc3 = nn.Linear(1, 1)
    assert join_difference(job, terms(longer, "sync", "none")) == (
        "its model differs from the job's: parameter 'fc3.weight' [1, 1] exists only in this "
        "worker's"
    )
    assert join_difference(terms(make_net().half(), "sync", "none"), job) == (
        "its model differs from the job's at parameter #0: the job has parameter 'fc1.weight' "
        "[8, 3] torch.float16, this worker parameter 'fc1.weight' [8, 3] torch.float32"
    )


def test_min_workers_is_checked():
    x, y = _data()
    args = (make_net(), traced_mse, (x, y))
    with pytest.raises(ValueError, match=r"min_workers applies to elastic=True"):
        towers.train(*args, batch_size=8, steps=1, workers=2, min_workers=1)
    with pytest.raises(ValueError, match=r"min_workers must be in 1..workers \(2\), got 3"):
        towers.train(*args, batch_size=8, steps=1, workers=2, elastic=True, min_workers=3)
    with pytest.raises(ValueError, match=r"got 0"):
        towers.train(*args, batch_size=8, steps=1, workers=2, elastic=True, min_workers=0)
    with pytest.raises(TypeError, match=r"min_workers must be an int or None, got 1.5"):
        towers.train(*args, batch_size=8, steps=1, workers=2, elastic=True, min_workers=1.5)


def test_seek_redoes_a_batch_in_dataloader_order():
    order = BatchOrder(10, 3, True, seed=5)
    plain = [next(order).tolist() for _ in range(9)]  # three epochs of 4, 3, ... batches
    for step in (5, 0, 7, 4, 3, 6):
        order.seek(step)
        assert [next(order).tolist(), next(order).tolist()] == plain[step : step + 2]


def test_the_regroup_flag_is_agreed_through_the_sum():
    meta = StepMeta(world=3, params=2)
    grads = torch.ones(2)
    vectors = [meta.pack(r, 4, 1.0, False, grads, regroup=(r == 1)) for r in range(3)]
    tally = meta.read(sum(vectors))
    assert tally.regroup and tally.counts == [4, 4, 4] and tally.had_grad == [True, True]
    quiet = meta.read(sum(meta.pack(r, 4, 1.0, False, grads) for r in range(3)))
    assert not quiet.regroup


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_demo_with_faults_shows_the_same_parameters(tmp_path):
    png = tmp_path / "faults.png"
    cmd = [sys.executable, "-m", "towers", "demo", "--faults", "-n", "2", "--steps", "90"]
    env = {**os.environ, "PYTHONPATH": str(Path(towers.__file__).parents[1])}
    out = subprocess.run(
        [*cmd, "--out", str(png)], env=env, capture_output=True, text=True, timeout=110
    )
    assert out.returncode == 0, out.stderr
    rows = {line[:24].strip(): line[24:].split() for line in out.stdout.splitlines()}
    assert rows["undisturbed"][1:3] == ["-", "2x90"]
    assert rows["SIGKILL, not replaced"][1] == "1"  # worker 1 lost, the other trains on
    assert rows["SIGKILL, not replaced"][2].startswith("2x") and "1x" in out.stdout
    assert rows["SIGSTOP, replaced"][1] == "1"
    gaps = re.findall(r"differ from the undisturbed run's by (\S+) at most", out.stdout)
    assert len(gaps) == 2, out.stdout
    allowed = _demo_gap_bound(steps=90)
    assert all(float(g) <= allowed for g in gaps), (
        f"the disturbed runs' parameters differ from the undisturbed run's by {gaps} (largest "
        f"relative difference), above {allowed:.3g}: twice the bound of tests/exact.py (each run "
        f"may be {FACTOR:g} x as far from a float64 loop as a float32 single process is, relative "
        "to the parameter's largest value)"
    )
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def _demo_gap_bound(steps: int) -> float:
    """How far apart two runs of ``towers demo --faults`` (seed 0) may end, in the demo's
    measure (per parameter, the largest difference over the largest value): each may be as
    far from a float64 loop as tests/exact.py allows, so two are at most twice that apart."""
    from towers.tools.zoo import Parabola, parabola_data, parabola_loss

    torch.manual_seed(0)
    reference = Reference.of(
        Parabola(),
        parabola_data(),
        batch_size=50,
        steps=steps,
        optimizer=lambda p: torch.optim.SGD(p, lr=0.01),
        shuffle=False,
        loss_fn=parabola_loss,
    )
    return max(
        2 * bound(reference.single[name], exact)[1] / float(exact.abs().max())
        for name, exact in reference.exact.items()
    )


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_own_loop_under_towers_run_elastic_loses_workers_exactly(tmp_path):
    """Two of three workers SIGKILLed under ``towers run --elastic --max-restarts 1``: the first
    is replaced, the second is not (the budget is spent); sync BatchNorm's statistics follow
    the regroups, and every worker ends with one process's parameters and buffers."""
    seed = random.randrange(1 << 30)
    progress, out = tmp_path / "progress", tmp_path / "out"
    progress.mkdir()
    out.mkdir()
    rng = random.Random(seed)
    first = rng.randrange(6, 15)  # loss calls: between steps 2 and 5 of 40
    at = [first, first + rng.randrange(6, 15)]  # then a few steps of two workers
    saboteur = Saboteur(progress, [(a, signal.SIGKILL) for a in at], rng)
    saboteur.start()
    cmd = [sys.executable, "-m", "towers", "run", str(SCRIPTS / "elastic_loop.py"), "-n", "3"]
    cmd += ["--elastic", "--max-restarts", "1", "--"]
    cmd += ["--progress", str(progress), "--out", str(out), "--steps", "40", "--sleep", "0.1"]
    cmd += ["--batchnorm"]
    env = {**os.environ, "PYTHONPATH": str(Path(towers.__file__).parents[1])}
    try:
        done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=110)
    finally:
        saboteur.stop.set()
        saboteur.join()
    why = f"seed {seed}, faults {saboteur.hit}: {done.stderr[-2000:]}"
    assert done.returncode == 0, why
    assert len(saboteur.hit) == 2, why
    lost = sorted(w for w, _ in saboteur.hit)  # the second may be the replacement, worker 3
    finals = {int(p.stem.split("-")[1]): torch.load(p) for p in out.glob("final-*.pt")}
    # the replacement (worker 3) joins unless the others finish before it has started
    assert set(finals) - {3} == {0, 1, 2} - set(lost), why
    said = re.search(r"towers run: workers \[([\d, ]+)\] were lost, 1 replaced", done.stderr)
    assert said and sorted(int(w) for w in said[1].split(",")) == lost, why

    reference = elastic_loop_reference(40, batchnorm=True)
    faults = f"seed {seed}, faults {saboteur.hit}"
    for rank, final in finals.items():
        assert final["steps"] == 40, why
        reference.check(final["model"], f"worker {rank}, {faults}")  # BatchNorm's statistics too
    # a worker that was there from the start saw every step's loss once
    reference.check_losses(finals[min(finals)]["losses"], f"worker {min(finals)}, {faults}")
    # the workers apply the same sums: they hold the same numbers, bit for bit
    first = finals[min(finals)]["model"]
    for rank, final in finals.items():
        assert all(torch.equal(v, first[k]) for k, v in final["model"].items()), (rank, faults)


def failing_mse(model: torch.nn.Module, shard) -> torch.Tensor:
    """Raises in worker 1 on its third shard: a bug, not a lost worker."""
    if os.environ.get("RANK") == "1":
        failing_mse.calls = getattr(failing_mse, "calls", 0) + 1
        if failing_mse.calls == 3:
            raise ArithmeticError("a bug in loss_fn")
    x, y = shard
    return (model(x) - y).square().mean()


@pytest.mark.timeout(60)
def test_a_worker_that_raises_fails_an_elastic_job_with_its_error():
    x, y = _data()
    with pytest.raises(ArithmeticError, match="a bug in loss_fn") as info:
        towers.train(
            make_net(), failing_mse, (x, y), batch_size=16, steps=6, workers=2, elastic=True
        )
    assert "raised in towers worker 1" in "".join(getattr(info.value, "__notes__", []))
