"""Balanced splits: the arithmetic alone, then real slowness (a worker in a cpu cgroup capped at
a fraction of a core, or ``straggle=``) against a single-process loop."""

from __future__ import annotations

import contextlib
import copy
import functools
import importlib.util
import math
import os
import random
import threading
from pathlib import Path

import pytest
import torch
from cgroups import cpu_cgroup, join_cgroup, throttled_periods
from exact import Reference, as_float64
from helpers import make_net, mse, regression_data
from torch import nn

import towers
from towers.core.balance import DEADBAND, FLOOR, Balancer, sizes, split_sizes
from towers.core.split import cut

# -- the arithmetic ----------------------------------------------------------------------------


def test_sizes_sum_to_the_batch_in_proportion():
    assert sizes(10, [0.5, 0.25, 0.25]) == [5, 3, 2]
    assert sizes(7, [1, 1, 1]) == towers.core.split.shard_sizes(7, 3)  # ties to the first
    assert sizes(0, [0.3, 0.7]) == [0, 0]
    for _ in range(200):
        shares = [random.random() + 1e-3 for _ in range(random.randint(1, 6))]
        batch = random.randint(0, 1000)
        got = sizes(batch, shares)
        assert sum(got) == batch and all(abs(g - batch * s / sum(shares)) < 1 for g, s in
                                         zip(got, shares))  # fmt: skip
    assert split_sizes(2, [0.9, 0.05, 0.05]) == [1, 1, 0]  # fewer samples than towers
    # a small batch in very uneven shares still gives every tower a sample to be measured by
    assert sizes(8, [0.97, 0.01, 0.01, 0.01]) == [8, 0, 0, 0]
    assert split_sizes(8, [0.97, 0.01, 0.01, 0.01]) == [5, 1, 1, 1]
    assert split_sizes(5, [0.45, 0.45, 0.1]) == [2, 2, 1]
    for _ in range(200):
        shares = [random.random() + 1e-3 for _ in range(random.randint(1, 6))]
        batch = random.randint(len(shares), 50)
        got = split_sizes(batch, shares)
        assert sum(got) == batch and min(got) >= 1
    with pytest.raises(ValueError, match="cannot cut 5 samples"):
        sizes(5, [0.0, 0.0])


def test_cut_is_split_with_given_sizes():
    x = torch.arange(10)
    assert [s.tolist() for s in cut(x, [6, 0, 4])] == [[0, 1, 2, 3, 4, 5], [], [6, 7, 8, 9]]
    even = cut({"x": x, "y": -x}, towers.core.split.shard_sizes(10, 3))
    assert [s["y"].tolist() for s in even] == [s.tolist() for s in towers.split(-x, 3)]
    with pytest.raises(ValueError, match=r"shard sizes \[3, 3\] do not cut a batch of 10"):
        cut(x, [3, 3])


def test_the_balancer_follows_speeds_skipping_each_towers_first_step():
    b = Balancer(2)
    b.observe([32, 32], [1.0, 3.0])  # the first: one-time costs, not counted
    assert b.shares == [0.5, 0.5] and b.split(64) == [32, 32]
    b.observe([32, 32], [0.1, 0.3])
    assert b.shares == pytest.approx([0.75, 0.25])
    assert b.split(64) == [48, 16] and b.split(65) == [49, 16]
    for _ in range(20):  # equal times at the new split: a fixed point
        b.observe([48, 16], [0.15, 0.15])
    assert b.split(64) == [48, 16]


def test_a_tower_keeps_a_floor_and_noise_does_not_move_the_split():
    b = Balancer(4)
    for _ in range(10):
        b.observe([16] * 4, [0.1, 0.1, 0.1, 100.0])  # one tower 1000 times slower
    assert min(b.shares) == pytest.approx(FLOOR / 4) and b.split(64)[3] >= 1
    noisy, rng = Balancer(2), random.Random(0)
    moves, last = 0, noisy.split(1000)
    for _ in range(300):  # the same speed, timed with 1% noise
        split = noisy.split(1000)
        noisy.observe(split, [n * 1e-3 * (1 + rng.uniform(-0.01, 0.01)) for n in split])
        moves += noisy.split(1000) != last
        last = noisy.split(1000)
    assert moves <= 2 and abs(last[0] - 500) <= DEADBAND * 1000


def test_the_balancer_state_round_trips_and_other_widths_start_afresh():
    b = Balancer(3)
    for _ in range(3):
        b.observe([10, 10, 10], [1.0, 2.0, 4.0])
    again = Balancer(3)
    again.load_state_dict(b.state_dict())
    assert again.split(70) == b.split(70) != [24, 23, 23]
    other = Balancer(2)
    other.load_state_dict(b.state_dict())
    assert other.shares == [0.5, 0.5]


# -- real slowness -----------------------------------------------------------------------------


class Wide(nn.Module):
    """Enough arithmetic per sample that a tower's time is its compute, not its overhead."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(64, 512), nn.Tanh(), nn.Linear(512, 512), nn.Tanh())
        self.out = nn.Linear(512, 1)

    def forward(self, x):
        return self.out(self.net(x))


def wide_data(n: int = 4096) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(5)
    x = torch.randn(n, 64, generator=g)
    return x, x[:, :1].sin() + 0.1 * torch.randn(n, 1, generator=g)


def slow_rank_1(model: nn.Module, shard, cgroup: str) -> torch.Tensor:
    """``mse``, but rank 1 moves itself into ``cgroup`` (a cpu cap) before its first shard."""
    if os.environ.get("RANK") == "1" and not getattr(slow_rank_1, "joined", False):
        join_cgroup(cgroup)
        slow_rank_1.joined = True  # type: ignore[attr-defined]
    return mse(model, shard)


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_a_worker_capped_at_a_tenth_of_a_core_gets_a_smaller_shard_and_results_stay_exact():
    data, steps, batch = wide_data(), 48, 256  # the split settles within about 10 steps
    opt = functools.partial(torch.optim.SGD, lr=0.05)
    # a tenth of a core: a quota of 1 ms every 10 ms, which even a small shard's compute
    # outlasts (each wait for the other tower starts it on a fresh quota), so rank 1 is several
    # times slower than rank 0 also beside two other busy processes (capped at a third or a
    # quarter of a core, it was often about as fast as rank 0 there)
    with cpu_cgroup(0.1) as cg:
        loss = functools.partial(slow_rank_1, cgroup=str(cg))
        run = functools.partial(
            towers.train, Wide(), loss, data, batch_size=batch, workers=2, optimizer=opt,
            progress=False, transport="shm",
        )  # fmt: skip
        # the even split needs no time to settle: a few steps show it stays even, and exact
        balanced, even = run(steps=steps, balance=True), run(steps=8, balance=False)
    for result in (balanced, even):
        reference = Reference.of(Wide(), data, batch_size=batch, steps=result.steps, optimizer=opt)
        what = "balanced" if result is balanced else "even split"
        reference.check_losses(result.losses, what)
        reference.check(result.model, what)
    assert even.steps == 8 and all(s == [128, 128] for s in even.shards)
    assert all(sum(s) == batch for s in balanced.shards) and balanced.shards[0] == [128, 128]
    # 0.9 where rank 0 has a core of its own; a capped process runs in bursts (its quota, then
    # a wait for the next period), and the machine is shared: the half that matters, on average
    _skip_unless_slower(balanced.shards[-24:], balanced.shard_seconds[-24:], "rank 1")
    late = [s[0] for s in balanced.shards[-24:]]
    assert sum(late) / len(late) > 0.55 * batch, balanced.shards


def _skip_unless_slower(shards: list[list[int]], seconds: list[list[float]], slow: str) -> None:
    """Skip, saying why, where the capped tower (the second) was not clearly the slower over
    these steps (under 1.3 times the other's compute time a sample; split in proportion, that
    is under 57% of the batch to the other): on a machine so busy that the other tower got
    hardly more than the cap, there is no slow tower to balance against. A split that does not
    follow the speeds is not skipped: the capped tower, given as much as the other or more,
    measures far slower a sample."""
    pace = [sum(t[i] for t in seconds) / max(1, sum(s[i] for s in shards)) for i in (0, 1)]
    if pace[1] < 1.3 * pace[0]:
        pytest.skip(
            f"the machine was too busy for the cap to make {slow} clearly the slower: "
            f"{pace[0] * 1e3:.3f} and {pace[1] * 1e3:.3f} ms a sample"
        )


def _own_loop(balance: bool | None, steps: int = 30) -> tuple[list[list[int]], dict]:
    ctx = towers.init(timeout=60)
    model = ctx.replicate(make_net(), balance=balance)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    x, y = regression_data(n=steps * 48)
    splits = []
    for shard in ctx.shards(
        (x[k * 48 : k * 48 + 48], y[k * 48 : k * 48 + 48]) for k in range(steps)
    ):
        if ctx.rank == 1:
            end = torch.randn(256, 256)  # a tower that is slower: more work per step
            for _ in range(6):
                end = end @ end.tanh()
        r = ctx.step(mse(model, shard), opt)
        splits.append(list(r.tower_samples))
    ctx.close()
    return splits, {k: v.clone() for k, v in model.state_dict().items()}


@pytest.mark.timeout(120)
def test_the_own_loop_balances_its_shards_and_equals_one_process():
    ranks = towers.spawn(_own_loop, 2, True, timeout=100)
    splits, params = ranks[0]
    assert splits == ranks[1][0] and all(sum(s) == 48 for s in splits)
    assert splits[-1][0] > splits[-1][1], splits[-5:]  # rank 1 does more per step

    def plain_loop(dtype: torch.dtype) -> tuple[nn.Module, list[float]]:
        x, y = (t.to(dtype) for t in regression_data(n=30 * 48))
        model = make_net().to(dtype)
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        losses = []
        for k in range(30):
            opt.zero_grad()
            loss = mse(model, (x[k * 48 : k * 48 + 48], y[k * 48 : k * 48 + 48]))
            loss.backward()
            opt.step()
            losses.append(loss.item())
        return model, losses

    Reference.run(plain_loop).check(params, "the own loop, balanced")
    assert towers.spawn(_own_loop, 2, False, 6, timeout=100)[0][0] == [[24, 24]] * 6


def _float64_distance(model: nn.Module | dict, exact: dict[str, torch.Tensor]) -> float:
    """How far ``model``'s parameters are from ``exact`` (float64), relative, over them all."""
    state = model.state_dict() if isinstance(model, nn.Module) else model
    got = torch.cat([state[k].detach().double().reshape(-1) for k in exact])
    ref = torch.cat([v.reshape(-1) for v in exact.values()])
    return float((got - ref).norm() / ref.norm())


@pytest.mark.timeout(240)
def test_over_a_long_run_a_balanced_split_drifts_from_float64_no_more_than_one_process():
    data, steps, batch = regression_data(n=512), 80, 64
    opt = functools.partial(torch.optim.SGD, lr=0.1, momentum=0.9)
    balanced = towers.train(
        make_net(), mse, data, batch_size=batch, steps=steps, workers=3, optimizer=opt,
        straggle={2: 3.0}, balance=True, progress=False,
    )  # fmt: skip
    assert len({tuple(s) for s in balanced.shards}) > 1  # the split moved
    # A drift over many steps, not one step's rounding: the relative distance from float64 over
    # all parameters, against twice the float32 single process's (its own drift over the same
    # batches; the 1e-7 for a run that lands on float64 exactly)
    reference = Reference.of(make_net(), data, batch_size=batch, steps=steps, optimizer=opt)
    one_process = _float64_distance(reference.single, reference.exact)
    drift = _float64_distance(balanced.model, reference.exact)
    assert drift <= 2 * one_process + 1e-7, (
        f"a balanced split over {steps} steps is {drift:.3g} from a float64 loop (relative, "
        f"all parameters), above twice the {one_process:.3g} a float32 single process is"
    )
    reference.check(balanced.model, f"a balanced split over {steps} steps")


def test_bad_balance_arguments_are_refused_before_any_worker_starts(capfd):
    data = regression_data()
    with pytest.raises(TypeError, match="balance must be True, False or None"):
        towers.train(make_net(), mse, data, batch_size=9, steps=1, balance="yes")
    with pytest.raises(ValueError, match="mode 'async' never waits for a slow tower"):
        towers.train(make_net(), mse, data, batch_size=9, steps=1, mode="async", balance=True)
    bn = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Linear(4, 1))
    towers.train(bn, mse, data, batch_size=9, steps=2, workers=2, progress=False)
    assert "balance off: the model's 1 BatchNorm layer(s)" in capfd.readouterr().err
    with pytest.warns(RuntimeWarning, match="balance on: the model's 1 BatchNorm"):
        towers.train(bn, mse, data, batch_size=9, steps=2, workers=2, balance=True, progress=False)
    result = towers.train(make_net(), mse, data, batch_size=9, steps=2, workers=1)
    assert result.shards == [[9], [9]] and not math.isnan(result.losses[-1])


@pytest.mark.timeout(120)
def test_diloco_balances_its_inner_steps_and_moves_the_split_only_at_exchanges():
    data = wide_data(n=2048)
    result = towers.train(
        Wide(), mse, data, batch_size=128, steps=16, workers=2, mode="diloco:4", balance=True,
        straggle={1: 4.0}, optimizer=functools.partial(torch.optim.SGD, lr=0.05),
        progress=False,
    )  # fmt: skip
    periods = [result.shards[k : k + 4] for k in range(0, 16, 4)]
    assert all(len({tuple(s) for s in p}) == 1 for p in periods), result.shards
    assert all(sum(s) == 128 for s in result.shards)
    assert periods[-1][0][0] > periods[-1][0][1], result.shards  # the straggler's is smaller
    assert all(math.isfinite(v) for v in result.losses)


@pytest.mark.timeout(120)
def test_evaluation_is_split_as_the_batches_are_and_equals_one_process():
    data, held_out = regression_data(n=256), regression_data(n=77, seed=9)
    result = towers.train(
        make_net(), mse, data, batch_size=32, steps=12, workers=2, balance=True,
        straggle={1: 4.0}, eval_data=held_out, eval_every=6, progress=False,
    )  # fmt: skip
    assert result.shards[-1][0] > result.shards[-1][1]  # balanced, away from the straggler
    assert result.evals[-1][0] == 12

    def evaluate(dtype: torch.dtype) -> tuple[nn.Module, list[float]]:
        """The trained model's held-out loss in one process, one batch, in ``dtype``."""
        model = copy.deepcopy(result.model).to(dtype)
        with torch.no_grad():
            data = held_out if dtype == torch.float32 else as_float64(held_out)
            return model, [mse(model, data).item()]

    Reference.run(evaluate).check_losses([result.evals[-1][1]["loss"]], "balanced evaluation")


def _children(parent: int) -> list[int]:
    """The live processes whose parent is ``parent``, from /proc."""
    found = []
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                with open(f"/proc/{entry.name}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            if ppid == parent:
                found.append(int(entry.name))
    return found


def _cap_while_training(
    launcher: int, script: str, cgroup: Path, out: Path, done: threading.Event
) -> None:
    """Hold the worker that torchrun ``launcher`` starts (it runs ``script``) in ``cgroup``
    while it trains: from when it holds a socket (it has imported torch and joins the job) to
    when rank 0 has saved the result to ``out``. So the cap slows its training, not its
    start-up, its exit or its launcher's. From here: a namespace host sees a /sys of its own.
    Never moved (the job ended first): the cap never throttles, and the test skips."""
    worker, before = None, None
    while not done.wait(0.1 if worker is None else 0.01):
        try:
            if worker is None:
                for pid in _children(launcher):
                    if script in Path(f"/proc/{pid}/cmdline").read_text(errors="replace"):
                        worker = pid
                continue
            fds = os.listdir(f"/proc/{worker}/fd")
            links = [os.readlink(f"/proc/{worker}/fd/{fd}") for fd in fds]
            if any(link.startswith("socket:") for link in links):
                lines = Path(f"/proc/{worker}/cgroup").read_text().splitlines()
                before = next(ln.split(":", 2)[2] for ln in lines if ln.split(":")[1] == "cpu")
                (cgroup / "cgroup.procs").write_text(str(worker))
                break
        except OSError:  # gone meanwhile
            continue
    while not done.wait(0.05):
        if out.exists():  # trained: its exit at full speed, and the cgroup empty to remove
            with contextlib.suppress(OSError, TypeError):
                Path("/sys/fs/cgroup/cpu", before.lstrip("/"), "cgroup.procs").write_text(
                    str(worker)
                )
            return


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_two_hosts_of_different_speed_balance_and_equal_one_process(tmp_path):
    from netns import torchrun_nodes, two_hosts

    scripts, out = Path(__file__).parent / "scripts", tmp_path / "result.pt"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("GLOO_", "MASTER_"))}
    env |= {"PYTHONPATH": str(Path(towers.__file__).parents[1]), "OMP_NUM_THREADS": "1"}
    script = str(scripts / "balance_hosts.py")
    # a quarter of a core: beside two other busy processes host a still gets about half a
    # core, twice host b's (capped at half a core, host b was as fast as host a there)
    with cpu_cgroup(0.25) as slow, two_hosts() as hosts:
        done = threading.Event()

        def cap_host_b(nodes: list) -> None:
            args = (nodes[1].pid, script, slow, out, done)
            threading.Thread(target=_cap_while_training, args=args, daemon=True).start()

        try:
            torchrun_nodes(hosts, script, [str(out)], 29531, env, 150, started=cap_host_b)
        finally:
            done.set()
        throttled = throttled_periods(slow)
    got = torch.load(out, weights_only=True)
    spec = importlib.util.spec_from_file_location("balance_hosts", scripts / "balance_hosts.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    opt = functools.partial(torch.optim.SGD, lr=module.LR)
    reference = Reference.of(
        module.build_model(), module.data(), batch_size=module.BATCH, steps=module.STEPS,
        optimizer=opt, shuffle=False, loss_fn=module.mse,
    )  # fmt: skip
    reference.check(got["model"], "two hosts, balanced")
    if throttled == 0:  # the kernel never held host b back: there was no slow host
        pytest.skip("the cpu cap never throttled host b's processes here")
    # the host capped at a quarter of a core gets less: its shard takes several of the cap's
    # 10 ms periods, so the cap, not the noise of a millisecond's step, sets the split
    _skip_unless_slower(got["shards"][-12:], got["seconds"][-12:], "host b")
    late = [s[0] for s in got["shards"][-12:]]
    assert sum(late) / len(late) > 0.55 * module.BATCH, (got["shards"], got["seconds"][-12:])
