"""towers on a CUDA device, compared with plain CUDA loops; skipped without one.

Run them alone with ``python -m pytest -m gpu tests/test_gpu.py`` (``benchmarks/gpu_check.py``
runs them and the one-GPU benchmark together). What one GPU cannot test (NCCL across GPUs, two
levels across GPU hosts) is listed in docs/performance.md.
"""

from __future__ import annotations

import copy
import functools
import math
import os
import subprocess
import sys

import pytest
import torch
from exact import Reference
from helpers import SCRIPTS, make_net, mse
from torch import nn

import towers
from towers.comm.net import free_port
from towers.processes import start

pytestmark = [
    pytest.mark.gpu,
    # NVML's count: unlike torch.cuda.is_available() it leaves CUDA uninitialised here
    pytest.mark.skipif(torch.cuda.device_count() == 0, reason="needs a CUDA device"),
]

CUDA = torch.device("cuda", 0)
ADAM = functools.partial(torch.optim.Adam, lr=1e-2)


def regression(n: int = 256, d: int = 3, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, d, generator=g)
    return x, (x[:, :1] * 2 - x[:, 1:2]).sin() + 0.1 * torch.randn(n, 1, generator=g)


def cuda_mse(model: nn.Module, batch) -> torch.Tensor:
    return mse(model, tuple(t.to(CUDA) for t in batch))


def cuda_reference(data, steps: int, batch_size: int = 32, optimizer=ADAM) -> Reference:
    """The plain CUDA loop over the same global batches (DataLoader's order, seed 0), in
    float32 and in float64."""
    return Reference.of(
        make_net().to(CUDA), data, batch_size=batch_size, steps=steps, optimizer=optimizer,
        loss_fn=cuda_mse,
    )  # fmt: skip


def assert_equal_parameters(a: nn.Module, b: nn.Module) -> None:
    for (name, p), q in zip(a.state_dict().items(), b.state_dict().values(), strict=True):
        assert torch.equal(p, q), name


def assert_close_parameters(a: nn.Module, b: nn.Module, rtol: float, atol: float, what: str):
    """Where no float64 loop applies (autocast, compression): ``a`` and ``b`` within a stated
    tolerance, ``what`` saying why."""
    for (name, p), q in zip(a.state_dict().items(), b.state_dict().values(), strict=True):
        torch.testing.assert_close(p.cpu(), q.cpu(), rtol=rtol, atol=atol, msg=f"{name}: {what}")


@pytest.mark.timeout(120)
def test_one_gpu_worker_equals_a_plain_cuda_loop(capfd):
    data = regression()
    result = towers.train(
        make_net(), mse, data, batch_size=32, steps=24, workers=1, optimizer=ADAM, progress=False
    )
    assert "device='auto': 1 GPU(s) for 1 worker(s)" in capfd.readouterr().err
    assert next(result.model.parameters()).device.type == "cpu"
    reference = cuda_reference(data, 24)
    reference.check_losses(result.losses)
    reference.check(result.model)


@pytest.mark.timeout(180)
def test_a_gpu_worker_process_starts_after_the_caller_loaded_the_cuda_driver():
    torch.cuda.is_available()  # cuInit here: a child forked now could not use CUDA
    assert not start._can_fork()
    data = regression()
    # max_restarts without a checkpoint directory trains in a worker process of its own
    result = towers.train(
        make_net(), mse, data, batch_size=32, steps=12, workers=1, device="cuda",
        optimizer=ADAM, max_restarts=1, progress=False,
    )  # fmt: skip
    cuda_reference(data, 12).check(result.model)


@pytest.mark.timeout(180)
def test_two_workers_on_one_gpu_train_on_cpu_and_cuda_is_refused(capfd):
    if torch.cuda.device_count() > 1:
        pytest.skip("the machine has a GPU per worker")
    with pytest.raises(ValueError, match="2 workers on this host, 1 GPU visible"):
        towers.train(make_net(), mse, regression(), batch_size=32, steps=2, device="cuda")
    data = regression()
    result = towers.train(make_net(), mse, data, batch_size=32, steps=6, workers=2, progress=False)
    assert "2 workers but 1 GPU(s) visible" in capfd.readouterr().err
    opt = functools.partial(torch.optim.SGD, lr=0.01)  # towers.train's default
    Reference.of(make_net(), data, batch_size=32, steps=6, optimizer=opt).check(result.model)


@pytest.mark.timeout(60)
def test_make_parallel_on_cuda_devices():
    torch.manual_seed(0)
    w = torch.randn(5, 3, device=CUDA, requires_grad=True)
    x, y = torch.randn(7, 5), torch.randn(7, 3)

    def fn(x, y):
        return (x @ w - y).square()

    out = towers.make_parallel(fn, ["cuda:0", "cuda:0"], x=x, y=y)
    assert out.device == CUDA and out.shape == (7, 3)
    out.mean().backward()

    def plain(dtype: torch.dtype) -> tuple[dict[str, torch.Tensor], list[float]]:
        """The gradient of the same mean in one piece, in ``dtype``."""
        w_ = w.detach().to(dtype).requires_grad_()
        (x.to(CUDA, dtype) @ w_ - y.to(CUDA, dtype)).square().mean().backward()
        return {"grad": w_.grad}, []

    Reference.run(plain).check({"grad": w.grad}, "make_parallel's gradient")
    assert towers.make_parallel(fn, 3, x=x.to(CUDA), y=y.to(CUDA)).device == CUDA


@pytest.mark.timeout(180)
def test_own_loop_under_torchrun_with_nccl(tmp_path):
    out = tmp_path / "out.pt"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "1"]
    cmd += ["--master-port", str(free_port()), str(SCRIPTS / "gpu_loop.py"), str(out)]
    cmd += [str(tmp_path / "checkpoints")]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=150, env=env)
    assert done.returncode == 0, done.stdout + done.stderr
    got = torch.load(out)
    assert (got["device"], got["param_device"], got["backend"]) == ("cuda:0", "cuda:0", "nccl")
    sys.path.insert(0, str(SCRIPTS))
    try:
        import gpu_loop
    finally:
        sys.path.remove(str(SCRIPTS))
    evaluated = {}

    def plain_loop(dtype: torch.dtype) -> tuple[nn.Module, list[float]]:
        """The script's training in one plain CUDA loop, in ``dtype``; its final evaluation
        over all the data (as ``ctx.evaluate``) kept in ``evaluated``."""
        model = gpu_loop.build().to(CUDA, dtype)
        opt = torch.optim.Adam(model.parameters(), lr=1e-2)
        x, y = (t.to(CUDA, dtype) for t in gpu_loop.data())
        losses = []
        for batch in gpu_loop.batches(x, y):
            loss = gpu_loop.loss_fn(model, batch)
            losses.append(loss.item())
            opt.zero_grad()
            loss.backward()
            opt.step()
        with torch.no_grad():
            evaluated[dtype] = gpu_loop.loss_fn(model, (x, y)).item()
        return model, losses

    reference = Reference.run(plain_loop)
    names = [name for name, _ in gpu_loop.build().named_parameters()]
    reference.check(dict(zip(names, got["params"], strict=True)), "the own loop on CUDA")
    reference.check_losses(got["losses"], "the own loop on CUDA")
    # ctx.mean of the last loss over one rank; ctx.evaluate over all the data
    last = Reference({}, {}, reference.losses[-1:], reference.exact_losses[-1:])
    last.check_losses([got["mean"]], "ctx.mean of the last loss")
    final = Reference({}, {}, [evaluated[torch.float32]], [evaluated[torch.float64]])
    final.check_losses([got["eval"]], "ctx.evaluate")
    # the loop's checkpoint, written on the GPU, resumes in a CPU process
    ctx = towers.init(device="cpu")
    cpu_model = ctx.replicate(gpu_loop.build())
    cpu_opt = torch.optim.Adam(cpu_model.parameters(), lr=1e-2)
    step, _ = ctx.load_checkpoint(tmp_path / "checkpoints", cpu_model, cpu_opt)
    ctx.close()
    assert step == len(reference.losses)
    for p, q in zip(got["params"], cpu_model.parameters(), strict=True):
        torch.testing.assert_close(p, q.detach())
    assert all(s.device.type == "cpu" for v in cpu_opt.state.values() for s in v.values())


class _Net(nn.Module):  # matrices of powers of two: bf16/fp16 rounding as in the plain loop
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.fc1, self.fc2 = nn.Linear(32, 64), nn.Linear(64, 1)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))


def _amp_steps(dtype, own_loop: bool, init_scale: float | None, steps: int = 12):
    """Losses, skipped steps, scales and the model after an autocast loop, plain or towers'."""
    model = _Net().to(CUDA)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    scaler = None
    if init_scale is not None:  # one overflow brings the scale down to 2**6 for good
        scaler = torch.amp.GradScaler("cuda", init_scale=init_scale, backoff_factor=2.0**-34)
    ctx = towers.init(device="cuda") if own_loop else None
    if ctx is not None:
        model = ctx.replicate(model)
    g = torch.Generator().manual_seed(3)
    losses, skipped, scales = [], [], []
    for step in range(steps):
        x = torch.randn(64, 32, generator=g).to(CUDA)
        y = x[:, :1].cos()
        with torch.autocast("cuda", dtype=dtype):
            loss = (model(x).float() - y).square().mean()
        if ctx is not None:
            r = ctx.backward(loss, scaler=scaler)
            bad = r.skipped
            losses.append(r.loss)
        else:
            losses.append(loss.item())
            (loss if scaler is None else scaler.scale(loss)).backward()
            bad = not all(torch.isfinite(p.grad).all() for p in model.parameters())
        if scaler is not None:
            scaler.step(opt)
            scaler.update()
            scales.append(scaler.get_scale())
        elif not bad:
            opt.step()
        if bad:
            skipped.append(step)
        opt.zero_grad()
    if ctx is not None:
        ctx.close()
    return losses, skipped, scales, model


@pytest.mark.timeout(120)
def test_bf16_autocast_in_the_own_loop_equals_the_plain_loop():
    losses, skipped, _, model = _amp_steps(torch.bfloat16, True, None)
    plain_losses, _, _, plain = _amp_steps(torch.bfloat16, False, None)
    assert skipped == []
    # bf16 rounding on both sides, not float32's: no float64 loop to derive a bound from
    assert losses == pytest.approx(plain_losses, rel=1e-5)
    assert_close_parameters(model, plain, 1e-5, 1e-6, "bf16 autocast, towers vs the plain loop")


@pytest.mark.timeout(120)
def test_fp16_gradscaler_skips_overflowing_steps_and_backs_off_as_the_plain_loop():
    # 2**40 overflows float16 gradients: the first step is skipped and the scale backs off.
    # (towers backpropagates the loss times the shard's 64 samples: with a scale of 2**12
    # instead of 2**6 it would overflow where the plain loop does not.)
    got = _amp_steps(torch.float16, True, 2.0**40)
    plain = _amp_steps(torch.float16, False, 2.0**40)
    losses, skipped, scales, model = got
    assert skipped == plain[1] == [0]
    assert scales == plain[2] and scales[0] == 2.0**6
    assert all(math.isfinite(v) for v in losses)  # reported unscaled, also on skipped steps
    # fp16 rounding and overflow on both sides: no float64 loop to derive a bound from
    assert losses == pytest.approx(plain[0], rel=1e-5)
    assert_close_parameters(model, plain[3], 1e-5, 1e-6, "fp16 GradScaler, towers vs plain")


@pytest.mark.timeout(180)
def test_checkpoints_move_between_gpu_and_cpu(tmp_path):
    data = regression()
    run = functools.partial(
        towers.train, make_net(), mse, data, batch_size=32, workers=1, optimizer=ADAM,
        progress=False, checkpoint_every=5,
    )  # fmt: skip
    gpu_then_cpu = tmp_path / "a"
    run(steps=10, device="cuda", checkpoint=gpu_then_cpu)
    saved = torch.load(sorted(gpu_then_cpu.glob("step-*.pt"))[-1], weights_only=True)
    devices = set()

    def walk(v):
        if isinstance(v, torch.Tensor):
            devices.add(v.device.type)
        elif isinstance(v, dict):
            [walk(x) for x in v.values()]
        elif isinstance(v, (list, tuple)):
            [walk(x) for x in v]

    walk(saved)
    assert devices == {"cpu"}
    resumed_on_cpu = run(steps=20, device="cpu", checkpoint=gpu_then_cpu)
    cpu_then_gpu = tmp_path / "b"
    run(steps=10, device="cpu", checkpoint=cpu_then_gpu)
    resumed_on_gpu = run(steps=20, device="cuda", checkpoint=cpu_then_gpu)
    whole_on_gpu = run(steps=20, device="cuda")
    assert resumed_on_cpu.losses[:10] == whole_on_gpu.losses[:10]  # the first ten are GPU's
    # CPU and GPU kernels round differently: each run as close to float64 as the bound allows
    reference = Reference.of(make_net(), data, batch_size=32, steps=20, optimizer=ADAM)
    for result, what in (
        (resumed_on_cpu, "GPU, then resumed on CPU"),
        (resumed_on_gpu, "CPU, then resumed on GPU"),
        (whole_on_gpu, "GPU throughout"),
    ):
        reference.check_losses(result.losses, what)
        reference.check(result.model, what)


def _nan_at_step_3(model, shard):
    loss = mse(model, shard)
    return loss * float("nan") if bool((shard[0][:, 2] == 99.0).any()) else loss


@pytest.mark.timeout(120)
def test_the_nan_guard_on_cuda_tensors_skips_the_step():
    x, y = regression(n=32 * 6)
    x[3 * 32 + 5, 2] = 99.0  # a sample of the fourth global batch (no shuffling)
    result = towers.train(
        make_net(), _nan_at_step_3, (x, y), batch_size=32, steps=6, workers=1, device="cuda",
        shuffle=False, optimizer=ADAM, progress=False,
    )  # fmt: skip
    assert result.skipped == [(3, [0])]

    def plain_loop(dtype: torch.dtype) -> tuple[nn.Module, list[float]]:
        """The plain CUDA loop that leaves out step 3, in ``dtype``."""
        model = make_net().to(CUDA, dtype)
        opt = ADAM(model.parameters())
        for step in range(6):
            if step != 3:
                opt.zero_grad()
                batch = (t[step * 32 : (step + 1) * 32].to(CUDA, dtype) for t in (x, y))
                mse(model, tuple(batch)).backward()
                opt.step()
        return model, []

    Reference.run(plain_loop).check(result.model, "a step skipped on CUDA")
    # the own loop: on a GPU the step is decided on the device (docs/gpu.md): its .grad keep
    # the non-finite sums, and the next optimizer.step() changes nothing, with a fused
    # optimizer (found_inf) as with any other
    ctx = towers.init(device="cuda")
    model = ctx.replicate(make_net())
    for fused in (True, False):
        opt = torch.optim.AdamW(model.parameters(), lr=0.1, fused=fused)
        ctx.step(mse(model, (x[:8].to(CUDA), y[:8].to(CUDA))), opt)  # builds the state
        before = copy.deepcopy((model.state_dict(), opt.state_dict()))
        r = ctx.backward(mse(model, (x[:8].to(CUDA), y[:8].to(CUDA))) * float("inf"))
        opt.step()
        opt.zero_grad()
        after = (model.state_dict(), opt.state_dict())
        assert r.skipped and r.culprits == [0]
        assert all(torch.equal(a, b) for a, b in zip(before[0].values(), after[0].values()))
        for s0, s1 in zip(before[1]["state"].values(), after[1]["state"].values()):
            assert all(torch.equal(s0[k], s1[k]) for k in s0), f"fused={fused}"
    ctx.close()


@pytest.mark.timeout(240)
@pytest.mark.parametrize(
    "options",
    [
        {"compress": "bf16"},
        {"compress": "int8"},
        {"compress": "powersgd:1"},
        {"mode": "diloco:4"},
        {"eval_every": 4},
    ],
    ids=lambda o: next(iter(o.values())) if "eval_every" not in o else "eval",
)
def test_sync_features_run_on_cuda_as_on_cpu(options):
    data = regression()
    extra = {"eval_data": regression(n=64, seed=2)} if "eval_every" in options else {}
    run = functools.partial(
        towers.train, make_net(), mse, data, batch_size=32, steps=12, workers=1,
        optimizer=ADAM, progress=False, **options, **extra,
    )  # fmt: skip
    on_gpu, on_cpu = run(device="cuda"), run(device="cpu")
    # towers on CPU and on CUDA with the same (lossy) option: no plain loop to compare with;
    # rtol=1e-3 allows for the kernels' rounding carried through a lossy compression
    assert on_gpu.losses == pytest.approx(on_cpu.losses, rel=1e-3)
    assert_close_parameters(on_gpu.model, on_cpu.model, 1e-3, 1e-4, f"{options}, CUDA vs CPU")
    if extra:
        assert [e[0] for e in on_gpu.evals] == [4, 8, 12]
        for (_, a), (_, b) in zip(on_gpu.evals, on_cpu.evals, strict=True):
            assert a["loss"] == pytest.approx(b["loss"], rel=1e-4)


def test_a_model_given_on_the_gpu_is_trained_from_a_cpu_copy():
    model = make_net().to(CUDA)
    before = copy.deepcopy(model)
    result = towers.train(model, mse, regression(), batch_size=32, steps=3, workers=1)
    assert_equal_parameters(model, before)  # the caller's model is not modified
    assert next(result.model.parameters()).device.type == "cpu"


def test_workers_are_not_forked_once_the_cuda_driver_is_loaded():
    code = (
        "import os, torch, towers\n"
        "from towers.processes.start import _CUDA_DRIVER, _can_fork, _mapped_files\n"
        "def driver():\n"
        "    return any(os.path.basename(p).startswith(_CUDA_DRIVER) for p in _mapped_files())\n"
        "seen = [driver()]\n"
        "torch.cuda.device_count()\n"
        "seen.append(driver())\n"
        "torch.cuda.is_available()\n"
        "seen.append(driver())\n"
        "assert seen[-1], 'is_available() did not load the CUDA driver'\n"
        "assert not _can_fork(), 'would fork after the CUDA driver was loaded'\n"
        "print('driver loaded after import, count, is_available:', seen)\n"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert done.returncode == 0, done.stdout + done.stderr
    print(done.stdout)
