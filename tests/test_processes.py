"""Worker processes: spawn, failures, the low-level step API, towers run."""

from __future__ import annotations

import os
import signal
import textwrap

import pytest
import torch
from exact import Reference, as_float64
from helpers import Net, make_net, mse, regression_data

import towers


def env_report():
    import towers.processes.env as w

    return {k: os.environ.get(k) for k in w.ENV_KEYS}, torch.get_num_threads()


def raise_on_rank_1():
    if os.environ["RANK"] == "1":
        raise KeyError("rank 1 could not find its data")
    return "fine"


def kill_rank_1():
    if os.environ["RANK"] == "1":
        os.kill(os.getpid(), signal.SIGKILL)
    ctx = towers.init(timeout=60)
    ctx.barrier()  # blocks: rank 1 never arrives; the caller must stop us


@pytest.mark.timeout(60)
def test_spawn_gives_every_worker_the_torchrun_environment():
    reports = towers.spawn(env_report, 3)
    ports = {r[0]["MASTER_PORT"] for r in reports}
    assert len(ports) == 1
    for rank, (env, threads) in enumerate(reports):
        assert env["RANK"] == env["LOCAL_RANK"] == str(rank)
        assert env["WORLD_SIZE"] == env["LOCAL_WORLD_SIZE"] == "3"
        assert env["MASTER_ADDR"] == "127.0.0.1"
        assert threads == max(1, len(os.sched_getaffinity(0)) // 3)


@pytest.mark.timeout(60)
def test_worker_exception_is_raised_in_the_caller_with_its_type():
    with pytest.raises(KeyError, match="rank 1 could not find its data") as info:
        towers.spawn(raise_on_rank_1, 2)
    assert any("raised in towers worker 1" in note for note in info.value.__notes__)


@pytest.mark.timeout(60)
def test_killed_worker_is_named_and_the_others_are_stopped():
    with pytest.raises(towers.WorkerError, match=r"worker 1 .* died with signal SIGKILL") as info:
        towers.spawn(kill_rank_1, 3, failure_grace=1.0)
    assert info.value.rank == 1 and info.value.exitcode == -signal.SIGKILL


def different_model_on_rank_1():
    ctx = towers.init()
    model = make_net() if ctx.rank == 0 else torch.nn.Sequential(torch.nn.Linear(3, 8))
    try:
        ctx.replicate(model)
    finally:
        ctx.close()


@pytest.mark.timeout(60)
def test_a_different_model_on_one_rank_fails_at_start_naming_the_parameter():
    with pytest.raises(ValueError, match=r"rank 1 differs from rank 0's .*'fc1.weight'"):
        towers.spawn(different_model_on_rank_1, 2)


def low_level_steps():
    """Own loop: rank 0's initial weights win; samples weigh the towers; empty towers work."""
    ctx = towers.init()
    torch.manual_seed(ctx.rank)  # different initial weights: replicate must fix that
    model = ctx.replicate(Net())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = regression_data(7)
    results = []
    # global batches of 7 and of 2 samples: uneven shards, and an empty one for rank 2
    for shard in ctx.shards([(x, y), (x[:2], y[:2])]):
        loss = mse(model, shard) if len(shard[0]) else None
        results.append(ctx.step(loss, opt))
    params = {k: v.detach().clone() for k, v in model.state_dict().items()}
    ctx.close()
    return results, params


def plain_steps(dtype: torch.dtype) -> tuple[torch.nn.Module, list[float]]:
    """low_level_steps' two global batches in one plain process."""
    torch.manual_seed(0)
    model = Net().to(dtype)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = regression_data(7)
    x, y = (x, y) if dtype == torch.float32 else as_float64((x, y))
    losses = []
    for batch in [(x, y), (x[:2], y[:2])]:
        opt.zero_grad()
        loss = mse(model, batch)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return model, losses


@pytest.mark.timeout(60)
def test_low_level_step_matches_a_plain_loop():
    out = towers.spawn(low_level_steps, 3)
    reference = Reference.run(plain_steps)
    for rank, (results, params) in enumerate(out):
        assert [r.tower_samples for r in results] == [[3, 2, 2], [1, 1, 0]]
        assert not any(r.skipped for r in results)
        reference.check_losses([r.loss for r in results], f"rank {rank}")
        reference.check(params, f"rank {rank}")


def test_init_without_a_launcher_is_a_world_of_one(monkeypatch):
    for key in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(key, raising=False)
    with towers.init() as ctx:
        assert (ctx.rank, ctx.world_size, ctx.is_main) == (0, 1, True)
        model = ctx.replicate(make_net())
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        r = ctx.step(mse(model, regression_data(4)), opt, samples=4)
        assert r.tower_samples == [4] and not r.skipped


SCRIPT = textwrap.dedent(
    """
    import os
    import sys
    import time


    def loss_fn(model, shard):
        x, y = shard
        return (model(x) - y).square().mean()


    if __name__ == "__main__":
        rank = int(os.environ["RANK"])
        # one write per line: ranks share the pipe, and print() writes the newline separately
        sys.stdout.write(f"rank {rank} of {os.environ['WORLD_SIZE']} args {sys.argv[1:]}\\n")
        sys.stdout.flush()
        if "--fail" in sys.argv:  # before torch is imported: every rank is up at once
            if rank == 1:
                sys.exit(3)
            time.sleep(60)  # the launcher must stop this rank once rank 1 failed
            sys.exit(0)
        import torch
        import towers

        torch.manual_seed(0)
        x = torch.linspace(-2, 2, 40).unsqueeze(1)
        r = towers.train(torch.nn.Linear(1, 1), loss_fn, (x, 3 * x), batch_size=8, steps=10,
                         workers=2, progress=False)
        if r.mode != "sync" or rank == 0:
            sys.stdout.write(f"rank {rank} {r.mode} {r.workers} {len(r.staleness)}\\n")
    """
)


@pytest.mark.slow
@pytest.mark.timeout(180)  # five fresh processes that import torch
def test_towers_run_mode_sets_the_mode_of_train(tmp_path, capsys, monkeypatch):
    """Every rank gets its rank, the world size and the script's arguments; without --mode,
    towers.train in the script trains sync over the ranks; --mode async adds rank 0, the
    parameter server. ``towers run``'s code runs in this process (``python -m towers`` only
    adds ``sys.exit``: test_cli.py and the launcher tests of test_plain_backward.py and
    test_elastic.py run the command)."""
    from towers.tools.cli import main

    # towers run sets TOWERS_MODE for its ranks: taken back after the test
    monkeypatch.setenv("TOWERS_MODE", "sync")
    script = tmp_path / "train_script.py"
    script.write_text(SCRIPT)
    base = ["run", str(script), "-n", "2"]
    assert main([*base, "--", "--x", "1"]) == 0, capsys.readouterr().err
    out, err = capsys.readouterr()
    assert sorted(out.splitlines()) == [  # each line names its rank
        "[rank0]: rank 0 of 2 args ['--x', '1']",
        "[rank0]: rank 0 sync 2 0",
        "[rank1]: rank 1 of 2 args ['--x', '1']",
    ], out + err
    # --mode async: three processes, rank 0 the parameter server; every rank gets the result
    assert main([*base, "--mode", "async", "--", "--x", "1"]) == 0, capsys.readouterr().err
    out, err = capsys.readouterr()
    assert "rank 0 is the parameter server" in err
    assert sorted(out.splitlines()) == [
        line
        for r in range(3)  # 10 batches x 2 shards
        for line in (
            f"[rank{r}]: rank {r} async 2 20",
            f"[rank{r}]: rank {r} of 3 args ['--x', '1']",
        )
    ], out + err


@pytest.mark.timeout(60)
def test_towers_run_starts_ranks_and_stops_them_when_one_fails(tmp_path, capsys):
    """``towers run``'s code in this process, as above: every rank starts with its arguments;
    when one fails, the others are stopped at once (they would sleep a minute) and its exit
    code is the run's."""
    import time

    from towers.tools.cli import main

    script = tmp_path / "script.py"
    script.write_text(SCRIPT)
    start = time.monotonic()
    assert main(["run", str(script), "-n", "3", "--", "--fail"]) == 3
    assert time.monotonic() - start < 30  # 5 s of grace, then terminated
    out, err = capsys.readouterr()
    for rank in range(3):
        assert f"[rank{rank}]: rank {rank} of 3 args ['--fail']" in out, out
    assert "rank 1 failed with exit code 3" in err
    # a missing script: refused before anything starts
    assert main(["run", str(tmp_path / "missing.py"), "-n", "2"]) == 2
    assert "no such script" in capsys.readouterr().err


@pytest.mark.timeout(60)
def test_own_loop_refuses_an_asynchronous_towers_run_mode(monkeypatch):
    monkeypatch.setenv("TOWERS_MODE", "async")
    with pytest.raises(ValueError, match="--mode async, which applies to scripts that call"):
        towers.init()
