"""Porting mistakes get a short message that says the fix; sync_batchnorm equals one process."""

from __future__ import annotations

import functools
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from exact import Reference
from helpers import Net, mse, regression_data
from torch import nn

import towers
from towers.api.mistakes import check_sync_batchnorm
from towers.comm.hang import CallMismatch
from towers.core.modes import parse_mode
from towers.processes.guard import unguarded_line

SRC = str(Path(__file__).resolve().parents[1] / "src")


def bn_model() -> nn.Module:
    torch.manual_seed(5)
    return nn.Sequential(nn.Linear(3, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 1))


@pytest.mark.timeout(60)
def test_sync_batchnorm_train_equals_one_process():
    x, y = regression_data(40)
    sgd = functools.partial(torch.optim.SGD, lr=0.1, momentum=0.9)
    kwargs = dict(batch_size=13, steps=7, optimizer=sgd, seed=3)  # last batch of an epoch: 1
    with pytest.raises(ValueError, match="a batch of 1 meets 3 workers"):
        towers.train(bn_model(), mse, (x, y), workers=3, sync_batchnorm=True, **kwargs)
    x, y = x[:39], y[:39]  # batches of 13: shards of 5, 4, 4
    # Gloo here; the own-loop test runs the same layers over shared memory.
    result = towers.train(
        bn_model(), mse, (x, y), workers=3, sync_batchnorm=True, progress=False,
        transport="gloo", **kwargs,
    )  # fmt: skip
    reference = Reference.of(bn_model(), (x, y), **kwargs)
    reference.check_losses(result.losses)
    reference.check(result.model)  # parameters and running statistics


def test_batchnorm_without_sync_warns_and_the_refusals_say_why():
    model, sync = bn_model(), parse_mode("sync")
    with pytest.warns(UserWarning, match=r"1 BatchNorm layer\(s\) \(1\).*sync_batchnorm=True"):
        check_sync_batchnorm(False, model, sync, 2, 100, 10, 1)
    with pytest.raises(ValueError, match="needs mode='sync'"):
        check_sync_batchnorm(True, model, parse_mode("async"), 2, 100, 10, 1)
    with pytest.raises(ValueError, match="needs accumulate=1"):
        check_sync_batchnorm(True, model, sync, 2, 100, 10, 2)
    with pytest.raises(TypeError, match="True or False"):
        check_sync_batchnorm("yes", model, sync, 2, 100, 10, 1)


def test_a_list_of_samples_and_a_ddp_model_are_refused_with_the_fix():
    x, y = regression_data(300)
    samples = list(zip(x, y))
    with pytest.raises(TypeError) as info:
        towers.train(Net(), mse, samples, batch_size=10, steps=1)
    message = str(info.value)
    assert "list of 300 samples" in message and "torch.stack(column)" in message
    assert len(message) < 600
    with pytest.raises(TypeError, match="wrapped in DataParallel; pass the plain model"):
        towers.train(nn.DataParallel(Net()), mse, (x, y), batch_size=10, steps=1)


def test_unguarded_line_finds_calls_outside_the_main_guard():
    source = textwrap.dedent(
        """\
        import towers
        def main():
            towers.train()
        main()
        if __name__ == "__main__":
            main()
        if "__main__" == __name__:
            main()
        """
    )
    assert [unguarded_line(source, n) for n in (3, 4, 6, 8)] == [False, True, False, False]


@pytest.mark.timeout(60)
def test_a_script_without_main_guard_is_stopped_before_workers_start(tmp_path):
    script = tmp_path / "unguarded.py"
    script.write_text(
        textwrap.dedent(
            """\
            import torch
            import towers

            def loss_fn(model, shard):
                x, y = shard
                return (model(x) - y).square().mean()

            x = torch.randn(20, 1)
            towers.train(torch.nn.Linear(1, 1), loss_fn, (x, x), batch_size=10, steps=2)
            """
        )
    )
    env = {"PYTHONPATH": SRC, "PATH": "/usr/bin:/bin"}
    out = subprocess.run(
        [sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=50
    )
    assert out.returncode == 1
    assert "line 9: towers.train() is called when the script is imported" in out.stderr
    assert 'if __name__ == "__main__":' in out.stderr
    assert "WorkerError" not in out.stderr and len(out.stderr.splitlines()) < 40


def _rank0_only_mean(transport: str, other: str) -> None:
    """rank 0 logs a metric through ctx.mean alone (a master-only estimate_loss)."""
    ctx = towers.init(timeout=5, transport=transport)
    model = ctx.replicate(Net())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = regression_data(40)
    for shard in ctx.shards([(x[:20], y[:20]), (x[20:], y[20:])]):
        r = ctx.step(mse(model, shard), opt)
        if ctx.rank == 0:
            ctx.mean({"loss": r.loss}, samples=10)
        elif other == "barrier":
            ctx.barrier()
    ctx.close()


@pytest.mark.timeout(90)
@pytest.mark.parametrize(
    ("transport", "other"), [("shm", "step"), ("gloo", "step"), ("gloo", "barrier")]
)
def test_a_collective_called_on_some_ranks_only_names_who_called_what(transport, other):
    import time

    start = time.monotonic()
    with pytest.raises(CallMismatch) as info:
        towers.spawn(_rank0_only_mean, 2, transport, other, timeout=60)
    text = str(info.value)
    assert "the ranks made different calls (rank 0 in ctx.mean(['loss'])" in text
    theirs = "ctx.barrier" if other == "barrier" else "ctx.step (step 1)"
    assert f"rank 1 in {theirs}" in text and "every rank must make the same" in text
    # within the timeout (5 s) and the check-in; a different call at once
    assert time.monotonic() - start < (15 if other == "step" else 8) + 10
