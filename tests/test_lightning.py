"""``Trainer(strategy="towers")``: Lightning's Trainer over towers' step, against one device.

Lightning's launcher starts the ranks itself (it runs the script once per rank). The
distributed sampler shuffles each epoch with seed ``0 + epoch``, so one device trains on the
same global batches when it draws that permutation in chunks of the ranks' total batch.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch
from cgroups import cpu_cgroup, throttled_periods
from exact import Reference
from helpers import check_balanced_batches, load_script
from netns import torchrun_nodes, two_hosts
from test_examples import run
from torch import nn

SCRIPT = Path(__file__).resolve().parent / "scripts" / "lightning_fit.py"


def fit_module() -> ModuleType:
    return load_script(SCRIPT)


def one_device(
    global_batch: int, accumulate: int = 1, optimizer_and_schedule: Any = None, keep: Any = None
) -> tuple[Reference, float]:
    """The plain loop over the global batches, and the mean loss of its last epoch.
    ``accumulate``: micro-batches a step, each one's mean loss divided by their number, as
    Lightning's ``accumulate_grad_batches`` does (the epochs here hold whole steps).
    ``optimizer_and_schedule``: in place of lightning_fit.py's; ``keep(net, optimizer)``: what
    the reference holds at the end (default: the trained net)."""
    fit = fit_module()
    optimizer_and_schedule = optimizer_and_schedule or fit.optimizer_and_schedule
    x, y = fit.dataset().tensors
    last_epoch: list[float] = []

    def loop(dtype: torch.dtype) -> tuple[nn.Module, list[float]]:
        net = fit.make_net().to(dtype)
        optimizer, schedule = optimizer_and_schedule(net.parameters())
        for epoch in range(fit.EPOCHS):
            order = torch.randperm(fit.SAMPLES, generator=torch.Generator().manual_seed(epoch))
            total = 0.0
            for k, start in enumerate(range(0, fit.SAMPLES, global_batch)):
                idx = order[start : start + global_batch]
                loss = nn.functional.mse_loss(net(x[idx].to(dtype)), y[idx].to(dtype))
                total += float(loss.detach()) * len(idx)
                (loss / accumulate).backward()
                if (k + 1) % accumulate:
                    continue
                nn.utils.clip_grad_norm_(net.parameters(), fit.CLIP)
                optimizer.step()
                optimizer.zero_grad()
            schedule.step()
        if dtype == torch.float64:
            last_epoch.append(total / fit.SAMPLES)
        return (net if keep is None else keep(net, optimizer)), []

    return Reference.run(loop), last_epoch[0]


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_the_trainer_on_2_devices_trains_validates_tests_and_resumes_as_one_device(tmp_path):
    """tests/scripts/lightning_trainer.py, one launch, 1001 samples, 2 ranks of 16 (the last
    global batch 9):

    - the fit's parameters are as close to a float64 loop as a float32 one's, its logged loss
      is the mean over the epoch's samples, validate's and test's over every sample once;
    - predict: every sample once over the ranks, each the fitted model's prediction;
    - stopped by ModelCheckpoint after epoch 1 and resumed from last.ckpt: bit for bit;
    - stopped by EarlyStopping after epoch 2 of 5: bit for bit the 2-epoch fit;
    - accumulate_grad_batches=2, the short last batch sharing its step with a full one: the
      float64 loop that accumulates as Lightning does (towers' samples-weighted sum of the
      step was 1.1e-3 off before each micro-batch was weighed alone);
    - manual optimization: the float64 loop's parameters too;
    - TowersStrategy(mode="diloco:4"): the one-process DiLoCo of tests/test_diloco.py over
      the global batches the ranks' batches make (rank 0's first).
    """
    script = SCRIPT.parent / "lightning_trainer.py"
    result = run([sys.executable, str(script), str(tmp_path)], tmp_path, 190)
    assert result.returncode == 0, result.stdout
    names = ("whole", "resumed", "early", "accumulated", "manual", "diloco")
    saved = {n: torch.load(tmp_path / f"{n}.pt") for n in names}
    metrics = torch.load(tmp_path / "metrics.pt")
    reference, loss = one_device(global_batch=32)
    reference.check(saved["whole"], "Trainer(strategy='towers', devices=2)")
    # the loss is logged before each step, in float32, in per-rank means weighted by samples
    assert metrics["loss"] == pytest.approx(loss, rel=1e-4)
    fit = fit_module()
    x, y = fit.dataset().tensors
    net = fit.make_net()
    net.load_state_dict(saved["whole"])
    with torch.no_grad():  # every sample once, weighted as one device weighs them
        expected = float(nn.functional.mse_loss(net(x), y))
    assert metrics["val_loss"] == pytest.approx(expected, rel=1e-5)
    assert metrics["test_loss"] == pytest.approx(expected, rel=1e-5)
    predicted = torch.cat([torch.load(tmp_path / f"predict-{r}.pt") for r in range(2)])
    assert predicted.shape == (fit.SAMPLES, x.shape[1] + 1), predicted.shape
    inputs = predicted[:, : x.shape[1]]  # every sample once: the same rows, in some order
    assert torch.equal(inputs[inputs[:, 0].argsort()], x[x[:, 0].argsort()])
    with torch.no_grad():
        torch.testing.assert_close(predicted[:, -1:], net(inputs), rtol=1e-5, atol=1e-6)
    assert all(torch.equal(saved["whole"][k], saved["resumed"][k]) for k in saved["whole"])
    assert metrics["early_epochs"] == 2
    assert all(torch.equal(saved["whole"][k], saved["early"][k]) for k in saved["whole"])
    accumulated, _ = one_device(global_batch=32, accumulate=2)
    accumulated.check(saved["accumulated"], "accumulate_grad_batches=2")
    reference.check(saved["manual"], "manual optimization")
    diloco_reference(x, y).check(saved["diloco"], "TowersStrategy(mode='diloco:4')")


BALANCED = SCRIPT.parent / "lightning_balanced.py"


def balanced_fit(out: Path, *cgroup: str) -> tuple[list[float], ModuleType]:
    """tests/scripts/lightning_balanced.py on 2 devices; its batches and parameters checked
    against one device (:func:`helpers.check_balanced_batches`); the float64 loss summed over
    each global batch, and the script's module."""
    result = run([sys.executable, str(BALANCED), str(out), *cgroup], out, 140)
    assert result.returncode == 0, result.stdout
    sys.path.insert(0, str(BALANCED.parent))  # for its import of ddp_balanced
    try:
        job = load_script(BALANCED)
    finally:
        sys.path.remove(str(BALANCED.parent))
    saved = [torch.load(out / f"rank-{r}.pt") for r in range(2)]
    global_batches = []  # each epoch's order: seed 0 + epoch (set_epoch reached the sampler)
    for epoch in range(job.EPOCHS):
        order = torch.randperm(len(job.dataset()), generator=torch.Generator().manual_seed(epoch))
        global_batches += list(order.split(2 * job.BATCH))
    net = job.make_wide_net if cgroup else job.make_net
    sums = check_balanced_batches(saved, global_batches, job.dataset(), net, lr=job.LR)
    return sums, job


@pytest.mark.timeout(150)
def test_a_balanced_trainer_gives_the_slower_rank_less_and_equals_one_device(tmp_path: Path):
    """TowersStrategy(balance=None) on 2 devices, rank 1's training step doing more work. The
    training loader gets towers' batch sampler: rank 1's share of each global batch shrinks,
    each step's batches together are the global batch of Lightning's order (seed 0 + epoch, two
    epochs), and both ranks end with one device's parameters. The progress bar, a CSV and a
    TensorBoard logger work; the CSV's epoch losses are one device's means over the samples."""
    sums, job = balanced_fit(tmp_path)
    rows = (tmp_path / "csv" / "version_0" / "metrics.csv").read_text().split()
    logged = [float(row.split(",")[2]) for row in rows[1:]]
    per_epoch = len(sums) // job.EPOCHS
    samples = len(job.dataset())
    expected = [sum(sums[e * per_epoch : (e + 1) * per_epoch]) / samples for e in (0, 1)]
    assert logged == pytest.approx(expected, rel=1e-5), (logged, expected)
    assert list((tmp_path / "tb" / "version_0").glob("events.out.tfevents.*"))


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_a_worker_in_a_capped_cpu_cgroup_gets_the_smaller_share_under_lightning(tmp_path: Path):
    """The same fit, rank 1 moved into a cpu cgroup capped at a tenth of a core as training
    starts (a slow worker, not more work), on a net wide enough that a step outlasts the
    cap's quota: it gets less, and the result stays one device's."""
    with cpu_cgroup(0.1) as cg:
        balanced_fit(tmp_path, str(cg))
        throttled = throttled_periods(cg)
    assert throttled > 0, "the cap never held rank 1 back"


def test_the_strategy_s_balance_must_be_a_bool_or_none():
    from towers.lightning import TowersStrategy

    with pytest.raises(
        TypeError,
        match=r"balance must be True, False or None \(on where it keeps results exact\), got 1",
    ):
        TowersStrategy(balance=1)  # type: ignore[arg-type]


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_the_trainer_across_two_hosts_under_torchrun_equals_one_device(tmp_path: Path):
    """Two namespace hosts, each with its own host name and /dev/shm, torchrun on each:
    ``Trainer(strategy="towers", devices=2, num_nodes=2)``, 8 samples a rank (sums in two
    levels: shared memory within a host, Gloo between them). The fit equals one device's on
    global batches of 32, and its logged loss is one device's mean."""
    out = tmp_path / "fit.pt"
    keep = ("GLOO_", "MASTER_", "TOWERS_", "RANK", "WORLD_SIZE", "LOCAL_")
    env = {k: v for k, v in os.environ.items() if not k.startswith(keep)}
    env |= {"PYTHONPATH": str(SCRIPT.parents[2] / "src"), "OMP_NUM_THREADS": "1"}
    args = ["towers", "2", "8", str(out), "2"]  # 2 processes a host, 8 samples each, 2 nodes
    with two_hosts(own=True) as hosts:
        logs = torchrun_nodes(hosts, str(SCRIPT), args, 29533, env, 200, per_host=2)
    for log in logs:
        assert "terminate called" not in log, log[-3000:]
    saved = torch.load(out)
    reference, loss = one_device(global_batch=32)
    reference.check(saved["model"], "Trainer(strategy='towers', devices=2, num_nodes=2)")
    assert saved["metrics"]["loss"] == pytest.approx(loss, rel=1e-4)
    assert saved["comm"] == "HierComm"  # towers saw two hosts


def diloco_reference(x: torch.Tensor, y: torch.Tensor, every: int = 4) -> Reference:
    """One-process DiLoCo (H=``every``, SGD with momentum inside) over one epoch's global
    batches: each rank's rank-strided batches of 16 put together, rank 0's first."""
    import functools

    from test_diloco import derived

    fit = fit_module()
    order = torch.randperm(fit.SAMPLES, generator=torch.Generator().manual_seed(0))
    ranks = [order[r::2] for r in range(2)]
    batches = [
        (x[idx], y[idx])
        for idx in (torch.cat([part[k : k + 16] for part in ranks]) for k in range(0, 501, 16))
    ]
    inner = functools.partial(torch.optim.SGD, lr=0.1, momentum=0.9)
    outer, _, _ = derived(fit.make_net(), (x, y), batches=batches, batch_size=32,
                          steps=len(batches), every=every, workers=2, inner=inner)  # fmt: skip
    return outer


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_fabric_with_devices_2_ends_with_one_device_s_parameters(tmp_path: Path):
    """The same training in a loop of one's own under Fabric(strategy="towers"), accumulating
    two micro-batches a step under fabric.no_backward_sync: the short last batch shares its
    step with a full one, and each micro-batch is weighed as one device weighs it."""
    script = SCRIPT.parent / "fabric_fit.py"
    out = tmp_path / "fabric.pt"
    cmd = [sys.executable, str(script), "towers", "2", "16", str(out), "2"]
    result = run(cmd, tmp_path, 140)
    assert result.returncode == 0, result.stdout
    reference, _ = one_device(global_batch=32, accumulate=2)
    reference.check(torch.load(out)["model"], "Fabric(strategy='towers', devices=2), accumulating")


@pytest.mark.timeout(150)
def test_a_sharded_adamw_under_the_trainer_checkpoints_whole_and_resumes_as_one_device(tmp_path):
    """tests/scripts/lightning_zero.py: towers.ddp's ZeroRedundancyOptimizer (AdamW, a schedule,
    gradients clipped to a norm over the whole model) under Trainer(strategy="towers",
    devices=2). Lightning consolidates the sharded state into ModelCheckpoint's file: after
    two epochs, the second resumed from the first's last.ckpt, that file holds one device's
    AdamW state, and the parameters are one device's."""
    script = SCRIPT.parent / "lightning_zero.py"
    result = run([sys.executable, str(script), str(tmp_path)], tmp_path, 140)
    assert result.returncode == 0, result.stdout
    job = load_script(script)

    def moments(net: nn.Module, optimizer: Any) -> dict[str, torch.Tensor]:
        names = [n for n, _ in net.named_parameters()]
        state = optimizer.state_dict()["state"]
        kept = {f"{names[i]}.{k}": v for i, s in state.items() for k, v in s.items() if k != "step"}
        return {**{k: v.detach() for k, v in net.state_dict().items()}, **kept}

    checkpoint = torch.load(tmp_path / "last.ckpt", weights_only=False)
    net = fit_module().make_net()
    net.load_state_dict(torch.load(tmp_path / "zero.pt"))

    class Saved:  # the checkpoint's optimizer state, read as an optimizer's
        def state_dict(self) -> dict[str, Any]:
            return checkpoint["optimizer_states"][0]

    reference, _ = one_device(32, optimizer_and_schedule=job.adamw_and_schedule, keep=moments)
    reference.check(moments(net, Saved()), "a sharded AdamW under TowersStrategy, resumed")


@pytest.mark.timeout(150)
def test_a_diloco_fit_resumed_from_its_checkpoint_equals_an_uninterrupted_one(tmp_path: Path):
    """tests/scripts/lightning_diloco_resume.py: TowersStrategy(mode="diloco:5") on 2 devices,
    a fit of two epochs, and one stopped after the first epoch (2 inner steps past its last
    outer step) and resumed from ModelCheckpoint's last.ckpt. The checkpoint holds every rank's
    own state and the outer step's (under "towers"); the resumed fit ends bit for bit where
    the uninterrupted one does. (Without them it ended 0.74 away.)"""
    script = SCRIPT.parent / "lightning_diloco_resume.py"
    result = run([sys.executable, str(script), str(tmp_path)], tmp_path, 140)
    assert result.returncode == 0, result.stdout
    fits = torch.load(tmp_path / "fits.pt")
    for name, value in fits["whole"].items():
        assert torch.equal(fits["resumed"][name], value), name
    saved = torch.load(tmp_path / "stopped" / "last.ckpt", weights_only=False)
    assert len(saved["towers"]["plan"]["ranks"]) == 2 and saved["towers"]["steps"] == 64


@pytest.mark.timeout(220)
def test_fabric_diloco_ends_with_one_process_diloco_after_its_barrier_or_save(tmp_path: Path):
    """TowersFabricStrategy(mode="diloco:5") in a Fabric loop of one's own: each rank's SGD
    steps it alone, every 5 steps the outer step, and at the end the last one, of the epoch's
    last 2 steps, taken by fabric.barrier() or first thing in fabric.save(). The parameters
    (rank 0's, or the saved ones) are one-process DiLoCo's over the same global batches
    (without the barrier, rank 0 kept its own inner parameters, 0.115 away)."""
    x, y = fit_module().dataset().tensors
    reference = diloco_reference(x, y, every=5)
    for end in ("barrier", "save"):
        out = tmp_path / f"{end}.pt"
        cmd = [sys.executable, str(SCRIPT.parent / "fabric_diloco.py"), str(out), "5", end]
        result = run(cmd, tmp_path, 100)
        assert result.returncode == 0, result.stdout
        reference.check(torch.load(out)["model"], f"diloco:5 under Fabric, ended by {end}")


@pytest.mark.timeout(200)
def test_a_fabric_diloco_loop_saved_and_loaded_equals_an_uninterrupted_one(tmp_path: Path):
    """tests/scripts/fabric_diloco_resume.py: two epochs of diloco:5 under Fabric, whole, or
    saved with fabric.save after the first and loaded with fabric.load in a new launch. The
    file holds every rank's own state and the outer step's beside the loop's (fabric.load
    restores them and does not hand them back), and the resumed loop ends bit for bit where
    the uninterrupted one does. (Without them it ended 0.70 away.)"""
    script = SCRIPT.parent / "fabric_diloco_resume.py"
    for phase in ("whole", "first", "second"):
        result = run([sys.executable, str(script), str(tmp_path), phase], tmp_path, 60)
        assert result.returncode == 0, result.stdout
    whole, resumed = torch.load(tmp_path / "whole.pt"), torch.load(tmp_path / "second.pt")
    for name, value in whole.items():
        assert torch.equal(resumed[name], value), name


@pytest.mark.timeout(150)
def test_a_fabric_loop_balances_through_towers_batch_sampler(tmp_path: Path):
    """tests/scripts/fabric_balanced.py: the training loader takes towers.ddp's
    DistributedBatchSampler, set up with use_distributed_sampler=False, and rank 1's forward
    does more work. Rank 0's share of each global batch grows, each step's batches together
    are the global batch (seed 7 + epoch), and both ranks end with one process's parameters."""
    script = SCRIPT.parent / "fabric_balanced.py"
    result = run([sys.executable, str(script), str(tmp_path)], tmp_path, 140)
    assert result.returncode == 0, result.stdout
    job = load_script(script.parent / "ddp_balanced.py")
    saved = [torch.load(tmp_path / f"rank-{r}.pt") for r in range(2)]
    global_batches = []
    for epoch in range(job.EPOCHS):
        order = torch.randperm(job.SAMPLES, generator=torch.Generator().manual_seed(7 + epoch))
        global_batches += list(order.split(2 * job.BATCH))
    check_balanced_batches(saved, global_batches, job.data(), job.make_model, lr=0.05)


def test_lightning_options_that_cannot_keep_their_meaning_are_refused_before_ranks_start():
    """Refused when the Trainer or Fabric is made: no rank has started yet."""
    import lightning.fabric as lf
    import lightning.pytorch as pl
    from lightning.pytorch.accelerators import Accelerator

    from towers.lightning import TowersFabricStrategy, TowersStrategy

    class Elsewhere(Accelerator):
        """An accelerator of a kind towers does not train on (its devices are CPUs here)."""

        def setup_device(self, device):
            pass

        def teardown(self):
            pass

        @staticmethod
        def parse_devices(devices):
            return int(devices)

        @staticmethod
        def get_parallel_devices(devices):
            return [torch.device("cpu")] * int(devices)

        @staticmethod
        def auto_device_count():
            return 1

        @staticmethod
        def is_available():
            return True

        def get_device_stats(self, device):
            return {}

        @classmethod
        def name(cls):
            return "elsewhere"

    def trainer(**kw):
        return pl.Trainer(strategy=TowersStrategy(), devices=2, logger=False, **kw)

    with pytest.raises(ValueError, match=r"sync_batchnorm=True is not available under strategy="):
        trainer(accelerator="cpu", sync_batchnorm=True)
    with pytest.raises(ValueError, match=r"precision='16-true' computes in float16.*bf16-mixed"):
        trainer(accelerator="cpu", precision="16-true")
    with pytest.raises(ValueError, match=r"accelerator='cpu' or 'cuda', got Elsewhere"):
        trainer(accelerator=Elsewhere())
    fabric = TowersFabricStrategy()
    with pytest.raises(ValueError, match=r"precision='16-true' computes in float16"):
        lf.Fabric(strategy=fabric, accelerator="cpu", devices=2, precision="16-true")
    with pytest.raises(ValueError, match=r"transport must be one of auto, shm, gloo, nccl"):
        TowersStrategy(transport="tcp")
    with pytest.raises(ValueError, match=r"balance=None: TowersFabricStrategy cannot tell a "
                       r"training loader .* towers.ddp.DistributedBatchSampler\(dataset, "
                       r"batch_size, shuffle=True, balance=None\)"):  # fmt: skip
        TowersFabricStrategy(balance=None)
    with pytest.raises(TypeError, match=r"balance must be True, False or None"):
        TowersFabricStrategy(balance="yes")
    assert trainer(accelerator="cpu", precision="bf16-mixed").strategy is not None
