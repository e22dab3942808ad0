"""``towers.ddp``: a DDP script on towers by its imports, against one process and against DDP.

The drop-in example (examples/ddp_dropin.py) runs as it is under ``torchrun``, and with
torch's imports put back as a real DDP job under ``towers run``; both are compared with a
float64 loop over the global batches the ranks' batches make together. Ranks that run out of
batches first join the others under ``towers run``.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from types import ModuleType

import pytest
import torch
from exact import Reference, states
from helpers import check_balanced_batches, load_script, unused_port
from test_examples import run
from torch import nn

import towers.ddp as dist
from towers.api.sampler import DistributedSampler
from towers.core.launch import RESTARTS_INSTEAD

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "ddp_dropin.py"
TOWERS_IMPORTS = (
    "import towers.ddp as dist  # towers\n"
    "from towers.ddp import DistributedDataParallel as DDP  # towers\n"
    "from towers.ddp import DistributedSampler  # towers\n"
)
TORCH_IMPORTS = (
    "import torch.distributed as dist\n"
    "from torch.nn.parallel import DistributedDataParallel as DDP\n"
    "from torch.utils.data.distributed import DistributedSampler\n"
)


def example() -> ModuleType:
    return load_script(EXAMPLE)


def dropin_reference(world: int, samples: int, batch: int = 16, epochs: int = 3) -> Reference:
    """One process over the global batches of the example's ranks: each epoch's shuffled order
    in chunks of ``world * batch``, without a last chunk of fewer than ``world`` samples (the
    sampler leaves those out rather than leave a rank a batch short)."""
    ex = example()
    data = ex.make_dataset(samples)
    kept = dropin_reference_kept(samples, world, batch)

    def loop(dtype: torch.dtype) -> tuple[nn.Module, list[float]]:
        model = ex.make_model().to(dtype)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.9)
        schedule = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.7)
        x, y = data.tensors[0].to(dtype), data.tensors[1]
        for epoch in range(epochs):
            order = torch.randperm(samples, generator=torch.Generator().manual_seed(1 + epoch))
            for start in range(0, kept, world * batch):
                idx = order[start : min(start + world * batch, kept)]
                nn.functional.cross_entropy(model(x[idx]), y[idx]).backward()
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                optimizer.step()
                optimizer.zero_grad()
            schedule.step()
        return model, []

    return Reference.run(loop)


def dropin_reference_kept(samples: int, world: int, batch: int) -> int:
    """The samples of an epoch the ranks train on: all, but a last global batch of fewer
    samples than ranks."""
    tail = samples % (world * batch)
    return samples - tail if 0 < tail < world else samples


def launch(tmp_path: Path, script: Path, ranks: int, launcher: str, *flags: str) -> str:
    if launcher == "towers":
        args = ["-m", "towers", "run", str(script), "-n", str(ranks), "--", *flags]
    else:
        args = ["-m", "torch.distributed.run", "--nproc-per-node", str(ranks)]
        args += ["--master-port", str(unused_port()), str(script), *flags]
    result = run([sys.executable, *args], tmp_path, timeout=100)
    assert result.returncode == 0, result.stdout
    return result.stdout


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_the_dropin_equals_one_process_where_ddp_with_its_padding_does_not(tmp_path: Path):
    """1001 samples on 2 ranks under torchrun: towers is as close to the float64 loop as a
    float32 process; the same script with torch's imports (DDP and torch's sampler) is orders
    of magnitude off. The DDP job runs under ``towers run``, whose forked ranks must end: a
    DDP model freed after ``destroy_process_group()`` used to hang 1 run in 4 (as_script.py)."""
    text = EXAMPLE.read_text()
    assert text.count(TOWERS_IMPORTS) == 1  # the port is these three lines
    ddp_script = tmp_path / "ddp_torch.py"
    ddp_script.write_text(text.replace(TOWERS_IMPORTS, TORCH_IMPORTS))
    launch(tmp_path, EXAMPLE, 2, "torchrun", "--out", str(tmp_path / "towers.pt"))
    launch(tmp_path, ddp_script, 2, "towers", "--out", str(tmp_path / "ddp.pt"))
    reference = dropin_reference(world=2, samples=1001)
    reference.check(torch.load(tmp_path / "towers.pt"), "towers.ddp on 2 ranks")
    ddp = states(torch.load(tmp_path / "ddp.pt"))
    off = max(float((ddp[n].double() - t).abs().max()) for n, t in reference.exact.items())
    single = max(float((reference.single[n] - t).abs().max()) for n, t in reference.exact.items())
    assert off > 1000 * single, f"DDP is {off:.2g} from one process, a float32 loop {single:.2g}"


@pytest.mark.timeout(90)
def test_ranks_that_run_out_first_join_and_end_with_the_others_state(tmp_path: Path):
    """tests/scripts/ddp_join.py: rank 0 takes 3 steps, rank 1 two, each of two micro-batches
    (the first under no_sync); both end with the parameters one process gets from the steps'
    batches put together, and with the same optimizer state."""
    script = ROOT / "tests" / "scripts" / "ddp_join.py"
    launch(tmp_path, script, 2, "towers", str(tmp_path))
    job = load_script(script)
    per_rank = [job.batches(0), job.batches(1)]

    def loop(dtype: torch.dtype) -> tuple[nn.Module, list[float]]:
        model = job.make_model().to(dtype)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        for step in range(3):
            micro = [b for rank in per_rank if step < len(rank) for b in rank[step]]
            x = torch.cat([x for x, _ in micro]).to(dtype)
            y = torch.cat([y for _, y in micro]).to(dtype)
            nn.functional.mse_loss(model(x), y).backward()
            optimizer.step()
            optimizer.zero_grad()
        return model, []

    reference = Reference.run(loop)
    saved = [torch.load(tmp_path / f"rank-{r}.pt") for r in range(2)]
    for rank, state in enumerate(saved):
        reference.check(state["model"], f"rank {rank}")
    momentum = [s["optimizer"]["state"] for s in saved]
    assert momentum[0].keys() == momentum[1].keys() and momentum[0]
    for key in momentum[0]:
        assert torch.equal(momentum[0][key]["momentum_buffer"], momentum[1][key]["momentum_buffer"])


@pytest.mark.timeout(120)
def test_balanced_batches_give_the_slower_rank_less_and_equal_one_process(tmp_path: Path):
    """tests/scripts/ddp_balanced.py under towers run: rank 1's forward does more work, and
    towers' DistributedBatchSampler moves samples of each global batch to rank 0. Each step's
    batches together are the global batch (every sample once, in the epoch's order), and both
    ranks end with the parameters of one process on the global batches."""
    script = ROOT / "tests" / "scripts" / "ddp_balanced.py"
    launch(tmp_path, script, 2, "towers", str(tmp_path))
    job = load_script(script)
    saved = [torch.load(tmp_path / f"rank-{r}.pt") for r in range(2)]
    dataset, world, per_rank = job.data(), 2, job.BATCH
    global_batches = []
    for epoch in range(job.EPOCHS):
        order = torch.randperm(job.SAMPLES, generator=torch.Generator().manual_seed(7 + epoch))
        global_batches += list(order.split(per_rank * world))
    assert saved[0]["len"] == saved[1]["len"] == len(global_batches) // job.EPOCHS == 31
    check_balanced_batches(saved, global_batches, dataset, job.make_model, lr=0.05)


@pytest.mark.timeout(120)
def test_balanced_batches_with_accumulation_weigh_each_micro_batch_as_one_process(tmp_path):
    """ddp_balanced.py accumulating two micro-batches a step, on 2807 samples: each epoch's
    last step holds a full global batch and the short one of 23, cut in the balanced shares.
    Each micro-batch is weighed as one process weighs it (the loss of each divided by 2), not
    by its samples: the ranks end with that process's parameters."""
    script = ROOT / "tests" / "scripts" / "ddp_balanced.py"
    launch(tmp_path, script, 2, "towers", str(tmp_path), "2")
    job = load_script(script)
    saved = [torch.load(tmp_path / f"rank-{r}.pt") for r in range(2)]
    global_batches = []
    for epoch in range(job.EPOCHS):
        order = torch.randperm(job.ACCUMULATED, generator=torch.Generator().manual_seed(7 + epoch))
        global_batches += list(order.split(2 * job.BATCH))
    assert saved[0]["len"] == len(global_batches) // job.EPOCHS == 30
    assert len(global_batches[29]) == 23  # the short one, in a step with a full one
    dataset = job.data(job.ACCUMULATED)
    check_balanced_batches(saved, global_batches, dataset, job.make_model, lr=0.05,
                           per_step=[2] * 30)  # fmt: skip


def test_the_sampler_deals_every_sample_once_in_torch_s_order():
    """torch's permutation and rank-strided dealing, without its padding."""
    data = list(range(11))
    ours = [list(DistributedSampler(data, 3, r, seed=5)) for r in range(3)]
    theirs = [
        list(torch.utils.data.distributed.DistributedSampler(data, 3, r, seed=5)) for r in range(3)
    ]
    assert (
        sorted(i for part in ours for i in part) == data
    )  # every sample once (torch's repeats one)
    assert [len(x) for x in ours] == [4, 4, 3] and [len(x) for x in theirs] == [4, 4, 4]
    assert all(t[: len(o)] == o for o, t in zip(ours, theirs))
    dropped = [list(DistributedSampler(data, 3, r, seed=5, drop_last=True)) for r in range(3)]
    assert dropped == [t[:3] for t in theirs] and [len(DistributedSampler(data, 3, 0))] == [4]


def test_a_last_global_batch_of_fewer_samples_than_ranks_is_left_out(monkeypatch):
    """993 samples on 2 ranks of 16: the last global batch would be 1 sample, a batch for rank
    0 and none for rank 1 (the ranks would reach their next collective a step apart). Once a
    forward has told the batch size, the sampler leaves that sample out; before, it deals it."""
    from towers.api import ddp

    data = list(range(993))
    before = [list(DistributedSampler(data, 2, r, seed=3)) for r in range(2)]
    assert [len(x) for x in before] == [497, 496]
    monkeypatch.setattr(ddp, "_batch", 16)
    after = [list(DistributedSampler(data, 2, r, seed=3)) for r in range(2)]
    assert [len(x) for x in after] == [496, 496] and after[1] == before[1]
    assert after[0] == before[0][:496]
    assert dropin_reference_kept(993, 2, 16) == 992
    # a loader's length is what is dealt: 10 samples on 4 ranks of 2 deal one batch each
    monkeypatch.setattr(ddp, "_batch", None)
    told = [DistributedSampler(list(range(10)), 4, r, batch_size=2) for r in range(4)]
    assert [len(s) for s in told] == [2, 2, 2, 2] == [len(list(s)) for s in told]
    # a loader with drop_last=True: the incomplete last global batch (5 of 8) whole
    whole = [DistributedSampler(list(range(13)), 4, r, batch_size=2, batch_drop_last=True)
             for r in range(4)]  # fmt: skip
    assert [len(list(s)) for s in whole] == [2, 2, 2, 2] == [len(s) for s in whole]
    # 1001 = 31 x 32 + 9: a last global batch of 9, uneven (5 and 4) but every rank has one
    monkeypatch.setattr(ddp, "_batch", 16)
    assert [len(list(DistributedSampler(list(range(1001)), 2, r))) for r in range(2)] == [501, 500]


@pytest.fixture
def job_of_one():
    """``init_process_group`` in this process, with no launcher: a job of one."""
    dist.init_process_group("gloo")
    yield
    if dist.is_initialized():
        dist.destroy_process_group()


def test_a_job_of_one_trains_as_the_plain_module(job_of_one):
    torch.manual_seed(0)
    plain = nn.Linear(3, 2)
    model = dist.DistributedDataParallel(nn.Linear(3, 2).requires_grad_(True))
    model.module.load_state_dict(plain.state_dict())
    x = torch.randn(5, 3)
    for m in (plain, model):
        m(x).square().mean().backward()
    assert dist.get_rank() == 0 and dist.get_world_size() == 1
    # the mean's gradient times 5 samples, over 5: a float32 rounding or two from the plain one
    torch.testing.assert_close(model.module.weight.grad, plain.weight.grad)
    assert model.require_backward_grad_sync
    with model.no_sync():
        assert not model.require_backward_grad_sync


def test_towers_run_s_compression_reaches_a_model_whose_script_names_none(monkeypatch):
    """towers run --compress int8 sets TOWERS_COMPRESS for the ranks: a script ported by its
    imports alone compresses; a compression the script names wins."""
    monkeypatch.setenv("TOWERS_COMPRESS", "int8")
    dist.init_process_group("gloo")
    try:
        chosen = dist.DistributedDataParallel(nn.Linear(3, 2))
        assert repr(chosen._steps.driver.transform) == "int8"
        chosen.remove_hooks()  # one wrapped model at a time
        named = dist.DistributedDataParallel(nn.Linear(3, 2), compress="bf16")
        assert repr(named._steps.driver.transform) == "bf16"
    finally:
        dist.destroy_process_group()


def test_ddp_s_arguments_that_cannot_hold_are_refused(job_of_one):
    with pytest.raises(ValueError, match="trains over the whole job: pass no process_group"):
        dist.DistributedDataParallel(nn.Linear(2, 2), process_group=object())
    with pytest.raises(ValueError, match=r"device_ids=\[0\], but this rank computes on cpu"):
        dist.DistributedDataParallel(nn.Linear(2, 2), device_ids=[0])
    with pytest.raises(ValueError, match="one device per rank"):
        dist.DistributedDataParallel(nn.Linear(2, 2), device_ids=[0, 1])
    with pytest.raises(RuntimeError, match=r"init_process_group\(\) was called twice"):
        dist.init_process_group("gloo")
    with pytest.raises(ValueError, match=r"sync_batchnorm is not available under towers\.ddp"):
        dist.DistributedDataParallel(nn.Sequential(nn.BatchNorm1d(2)), sync_batchnorm=True)
    dist.DistributedDataParallel(nn.Linear(2, 2))
    with pytest.raises(ValueError, match="wraps one model per job, and one is wrapped already"):
        dist.DistributedDataParallel(nn.Linear(2, 2))


def test_a_model_wrapped_before_the_job_is_joined_is_refused():
    assert not dist.is_initialized()
    with pytest.raises(RuntimeError, match=r"call towers.ddp.init_process_group\(\) first"):
        dist.DistributedDataParallel(nn.Linear(2, 2))
    with pytest.raises(ValueError, match="joins the job its launcher describes"):
        dist.init_process_group("gloo", init_method="tcp://10.0.0.1:23456")
    with pytest.raises(ValueError, match="backend must be 'gloo' or 'nccl'"):
        dist.init_process_group("mpi")
    assert not dist.is_initialized()


def test_a_parameter_server_mode_is_refused_before_the_job_is_joined(monkeypatch):
    monkeypatch.setenv("TOWERS_MODE", "async")
    with pytest.raises(ValueError, match=r"--mode async runs a parameter server"):
        dist.init_process_group("gloo")
    assert not dist.is_initialized()


def test_an_elastic_job_restarts_on_one_host_and_is_refused_across_hosts(monkeypatch):
    """Under towers run --elastic a lost worker's step is redone, which a script's own
    loss.backward() cannot be. On one host the ranks hand the job back to towers run, which
    restarts every rank instead (the exit code says so); across hosts it is refused with the
    way out. Both before any connection."""
    monkeypatch.setenv("TOWERS_ELASTIC", "1")
    with pytest.raises(SystemExit) as exited:
        dist.init_process_group("gloo")
    assert exited.value.code == RESTARTS_INSTEAD
    launched = {"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"}
    for name, value in {**launched, "GROUP_RANK": "0", "GROUP_WORLD_SIZE": "2"}.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(
        ValueError, match=r"--elastic across hosts.*torchrun --max-restarts R.*ctx\.step"
    ):
        dist.init_process_group("gloo")
    assert not dist.is_initialized()


@pytest.mark.timeout(90)
def test_diloco_under_the_dropin_equals_diloco_in_one_process(tmp_path: Path):
    """DDP's own call under towers run --mode diloco:4 (ddp_diloco.py names the mode; the
    keyword's path is test_lightning's DiLoCo): the script's own loss.backward() and
    optimizer.step() are each tower's inner steps, the outer steps come every 4 of them and at
    destroy_process_group; the result is tests/test_diloco.py's one-process DiLoCo."""
    from helpers import make_net
    from test_diloco import ADAM, DATA, derived

    script = ROOT / "tests" / "scripts" / "ddp_diloco.py"
    # DDP's own call, the mode from towers run --mode (the keyword: test_lightning's DiLoCo)
    text = script.read_text()
    assert text.count('DDP(make_net(), mode="diloco:4")') == 1
    plain = tmp_path / "ddp_plain.py"
    text = text.replace("Path(__file__).resolve().parents[1]", repr(str(ROOT / "tests")))
    plain.write_text(text.replace('DDP(make_net(), mode="diloco:4")', "DDP(make_net())"))
    args = ["-m", "towers", "run", str(plain), "-n", "2", "--mode", "diloco:4", "--"]
    result = run([sys.executable, *args, str(tmp_path / "flag.pt")], tmp_path, timeout=80)
    assert result.returncode == 0, result.stdout
    outer, _, _ = derived(make_net(), DATA, batch_size=10, steps=14, every=4, workers=2,
                          inner=ADAM, seed=4)  # fmt: skip
    outer.check(torch.load(tmp_path / "flag.pt"), "towers run --mode diloco:4 on 2 ranks")


def test_the_batch_sampler_in_a_job_of_one_deals_the_order_in_batches(job_of_one):
    """One rank takes each global batch whole: the epoch's permutation in batch_size chunks;
    the last, smaller one kept, or left out with drop_last."""
    data = list(range(23))
    order = torch.randperm(23, generator=torch.Generator().manual_seed(4 + 1)).tolist()
    sampler = dist.DistributedBatchSampler(data, 5, seed=4)
    sampler.set_epoch(1)
    assert list(sampler) == [order[k : k + 5] for k in range(0, 23, 5)] and len(sampler) == 5
    kept = dist.DistributedBatchSampler(data, 5, shuffle=False, drop_last=True)
    assert list(kept) == [list(range(k, k + 5)) for k in range(0, 20, 5)] and len(kept) == 4


def test_the_batch_sampler_s_bad_arguments_are_named(job_of_one):
    with pytest.raises(ValueError, match=r"batch_size must be a positive int, got 0"):
        dist.DistributedBatchSampler(list(range(4)), 0)
    with pytest.raises(
        TypeError,
        match=r"balance must be True, False or None \(on where it keeps results exact\), got 'yes'",
    ):
        dist.DistributedBatchSampler(list(range(4)), 2, balance="yes")  # type: ignore[arg-type]


@pytest.mark.timeout(150)
def test_zero_redundancy_optimizer_shards_adamw_exactly_and_its_whole_state_resumes(
    tmp_path, monkeypatch
):
    """tests/scripts/ddp_zero.py: torch's ZeroRedundancyOptimizer by its name, AdamW with
    weight decay and clipping that bites, on 2 ranks. The first 4 steps sum over Gloo, where
    each rank's part is its piece of the one bucket (half each: the sum goes to the owners
    alone), with steps decided as on a GPU (where the clipped norm needs the host); the state
    consolidated on rank 0 is one process's AdamW state, in AdamW's own layout, and loaded on
    every rank (under torchrun, over shared memory, where the parts are cut inside the first
    weight) it resumes to one process's parameters after all 7 steps (the last batch short).
    A run whose first bias is frozen after wrapping keeps the whole sum and ends as one
    process does."""
    script = ROOT / "tests" / "scripts" / "ddp_zero.py"
    monkeypatch.setenv("TOWERS_TRANSPORT", "gloo")
    monkeypatch.setenv("TOWERS_DECIDE_ON_DEVICE", "1")
    launch(tmp_path, script, 2, "towers", str(tmp_path), "first")
    launch(tmp_path, script, 2, "towers", str(tmp_path), "frozen")
    monkeypatch.delenv("TOWERS_TRANSPORT")
    monkeypatch.delenv("TOWERS_DECIDE_ON_DEVICE")
    launch(tmp_path, script, 2, "torchrun", str(tmp_path), "resume")
    job = load_script(script)
    dataset = job.data()
    order = torch.randperm(job.SAMPLES, generator=torch.Generator().manual_seed(0))
    ranks = [order[r::2] for r in range(2)]
    size = job.BATCH
    batches = [torch.cat([part[k : k + size] for part in ranks]) for k in range(0, 112, size)]
    assert len(batches) == 7 and len(batches[-1]) == 11

    def trained(
        steps: int, dtype: torch.dtype, moments: bool, frozen: bool = False
    ) -> tuple[dict, list[float]]:
        model = job.make_model().to(dtype)
        model[0].bias.requires_grad_(not frozen)
        opt = torch.optim.AdamW(model.parameters(), lr=job.LR, weight_decay=job.DECAY)
        for index in batches[:steps]:
            x, y = (t.to(dtype) for t in dataset[index])
            opt.zero_grad()
            nn.functional.mse_loss(model(x), y).backward()
            clipped = nn.utils.clip_grad_norm_(model.parameters(), job.CLIP)
            assert clipped > job.CLIP  # it bites
            opt.step()
        return _with_moments(model, opt.state_dict()["state"] if moments else {}), []

    first = torch.load(tmp_path / "first.pt")
    assert all(float(s["step"]) == 4 for s in first["optimizer"]["state"].values())
    model = job.make_model()
    model.load_state_dict(first["model"])
    got = _with_moments(model, first["optimizer"]["state"])
    Reference.run(lambda dtype: trained(4, dtype, True)).check(got, "the consolidated state")
    final = Reference.run(lambda dtype: trained(7, dtype, False))
    final.check(torch.load(tmp_path / "resume.pt"), "resumed from the consolidated state")
    frozen = Reference.run(lambda dtype: trained(7, dtype, False, frozen=True))
    frozen.check(torch.load(tmp_path / "frozen.pt"), "a bias frozen after wrapping")
    held = [torch.load(tmp_path / f"held-{r}.pt") for r in range(2)]
    assert held == [2 * 289, 2 * 289]  # exp_avg and exp_avg_sq of each rank's piece


@pytest.mark.timeout(120)
def test_a_lost_worker_restarts_every_rank_from_the_script_s_checkpoint(tmp_path):
    """tests/scripts/ddp_restart.py under towers run --max-restarts 1: rank 1 is killed with
    SIGKILL at step 5 of 24; every rank starts again, the script resumes from its checkpoint
    of step 5, and it ends with the parameters of a run that lost nothing, bit for bit."""
    script = ROOT / "tests" / "scripts" / "ddp_restart.py"
    lost, whole = tmp_path / "lost", tmp_path / "whole"
    lost.mkdir(), whole.mkdir()
    base = [sys.executable, "-m", "towers", "run", str(script), "-n", "2"]
    result = run([*base, "--max-restarts", "1", "--", str(lost), "5"], tmp_path, timeout=100)
    assert result.returncode == 0, result.stdout
    assert "rank 1 failed with signal SIGKILL" in result.stdout
    assert "restarting all 2 ranks (restart 1 of 1, TORCHELASTIC_RESTART_COUNT=1)" in result.stdout
    for r in range(2):
        attempts = (lost / f"attempts-{r}.txt").read_text().splitlines()
        assert attempts == ["attempt 0 started at step 0", "attempt 1 started at step 5"]
    assert run([*base, "--", str(whole)], tmp_path, timeout=100).returncode == 0
    got, expected = torch.load(lost / "final.pt"), torch.load(whole / "final.pt")
    assert all(torch.equal(got[k], expected[k]) for k in expected)
    # under --elastic the same: the script is on towers.ddp, so every rank restarts
    elastic = tmp_path / "elastic"
    elastic.mkdir()
    again = run([*base, "--elastic", "--max-restarts", "1", "--", str(elastic), "5"], tmp_path, 100)
    assert again.returncode == 0, again.stdout
    assert "runs on towers.ddp, whose steps cannot be redone without a lost worker" in again.stdout
    got = torch.load(elastic / "final.pt")
    assert all(torch.equal(got[k], expected[k]) for k in expected)
    # without restarts the job fails with the lost rank's code
    once = tmp_path / "once"
    once.mkdir()
    failed = run([*base, "--", str(once), "5"], tmp_path, timeout=100)
    assert failed.returncode == 137 and "restarting" not in failed.stdout


@pytest.mark.timeout(120)
def test_a_join_with_a_sharded_optimizer_stops_every_rank_at_once(tmp_path):
    """ddp_join.py with ZeroRedundancyOptimizer: rank 1 runs out of batches after two steps.
    Each tower must step its part at every step, so at the third every rank raises, saying
    why, instead of waiting for the others (a collective each would never meet)."""
    script = ROOT / "tests" / "scripts" / "ddp_join.py"
    args = ["-m", "towers", "run", str(script), "-n", "2", "--", str(tmp_path), "zero"]
    began = time.monotonic()
    result = run([sys.executable, *args], tmp_path, timeout=100)
    assert result.returncode != 0
    assert "tower(s) 1 ran out of batches while the others trained on" in result.stdout
    assert time.monotonic() - began < 60  # well within the collectives' 60 s timeout


def test_zero_redundancy_optimizer_s_arguments_that_cannot_hold_are_refused(job_of_one):
    zero = dist.ZeroRedundancyOptimizer
    model = dist.DistributedDataParallel(nn.Linear(2, 2))
    try:
        with pytest.raises(TypeError, match=r"needs optimizer_class=, a torch\.optim\.Optimizer"):
            zero(model.parameters(), optimizer_class="adam")
        with pytest.raises(ValueError, match="shards over the whole job: pass no process_group"):
            zero(model.parameters(), torch.optim.SGD, process_group=object(), lr=0.1)
        with pytest.raises(ValueError, match=r"overlap_with_ddp=True steps each bucket inside"):
            zero(model.parameters(), torch.optim.SGD, overlap_with_ddp=True, lr=0.1)
        with pytest.raises(ValueError, match="cannot shard Adagrad: towers cuts parameters"):
            zero(model.parameters(), torch.optim.Adagrad, lr=0.1)
        with pytest.raises(ValueError, match="wrap the model first, then build the optimizer"):
            zero(nn.Linear(2, 2).parameters(), torch.optim.SGD, lr=0.1)
        opt = zero(model.parameters(), optimizer_class=torch.optim.Adam, lr=0.1)
        assert isinstance(opt, torch.optim.Adam) and isinstance(opt, zero)
        assert opt.state_dict()["state"] == {}  # nothing to consolidate before a step
        model(torch.randn(4, 2)).sum().backward()
        opt.step()
        with pytest.raises(RuntimeError, match=r"call consolidate_state_dict\(to=RANK\) on "):
            opt.state_dict()
        opt.consolidate_state_dict(to=0)
        assert opt.state_dict()["state"][0]["exp_avg"].shape == (2, 2)
    finally:
        model.remove_hooks()


def _with_moments(model: nn.Module, state: dict[int, dict]) -> dict[str, torch.Tensor]:
    """A model's parameters and its AdamW moments, by name (state ids in parameter order)."""
    names = [n for n, _ in model.named_parameters()]
    moments = {f"{names[i]}.{k}": v for i, s in state.items() for k, v in s.items() if k != "step"}
    return {**states(model), **moments}
