"""``device=``: the choice as a pure function, its refusals before any worker starts, state that
moves between devices, and a ``GradScaler`` in the own loop, on CPU workers."""

from __future__ import annotations

import functools
import math

import pytest
import torch
from exact import Reference
from helpers import make_net, mse, regression_data

import towers
from towers.core.devices import moved, narrow, place

# -- the choice, without a GPU ---------------------------------------------------------------


def test_auto_takes_gpus_only_when_every_worker_gets_its_own():
    one = place("auto", workers=1, visible=1)
    assert (one.kind, str(one.device), one.backend) == ("cuda", "cuda:0", "nccl")
    four = [place("auto", workers=4, visible=8, local_rank=r) for r in range(4)]
    assert [str(p.device) for p in four] == ["cuda:0", "cuda:1", "cuda:2", "cuda:3"]
    # the trap of one GPU and two workers: NCCL cannot hold two ranks on one GPU
    shared = place("auto", workers=2, visible=1, local_rank=1)
    assert (shared.kind, shared.device, shared.backend) == ("cpu", torch.device("cpu"), "gloo")
    assert "2 workers but 1 GPU(s) visible" in shared.reason
    none = place("auto", workers=3, visible=0, local_rank=2)
    assert none.kind == "cpu" and "no GPU visible" in none.reason
    assert place("cpu", workers=2, visible=2).kind == "cpu"


def test_cuda_is_refused_naming_the_counts():
    with pytest.raises(ValueError, match="no CUDA device is visible"):
        place("cuda", workers=1, visible=0)
    with pytest.raises(ValueError, match="3 workers on this host, 2 GPUs visible"):
        place("cuda", workers=3, visible=2, local_rank=0)
    assert str(place("cuda", workers=2, visible=2, local_rank=1).device) == "cuda:1"


@pytest.mark.parametrize(
    ("request_", "error", "message"),
    [
        ("gpu", ValueError, "device must be one of 'auto', 'cpu', 'cuda'; got 'gpu'"),
        ("cuda:1", ValueError, "choose the GPUs with CUDA_VISIBLE_DEVICES"),
        (torch.device("cuda", 0), ValueError, "choose the GPUs with CUDA_VISIBLE_DEVICES"),
        (1, TypeError, "device must be 'auto', 'cpu' or 'cuda', got 1"),
    ],
)
def test_bad_device_requests(request_, error, message):
    with pytest.raises(error, match=message):
        place(request_, workers=1, visible=1)


def test_transports_and_backends_narrow_the_device():
    assert narrow("auto", transport="nccl") == "cuda"
    assert narrow("auto", transport="shm") == "cpu"
    assert narrow("auto", backend="gloo") == "cpu"
    assert narrow("auto", transport="auto") == "auto"
    assert narrow(torch.device("cpu")) == "cpu"
    with pytest.raises(ValueError, match="NCCL moves GPU tensors"):
        narrow("cpu", transport="nccl")
    with pytest.raises(ValueError, match="NCCL moves GPU tensors"):
        narrow("auto", transport="shm", backend="nccl")
    with pytest.raises(ValueError, match="Gloo and shared memory move CPU tensors"):
        narrow("cuda", backend="gloo")


def test_moved_walks_nested_state_and_keeps_the_rest():
    Pair = __import__("collections").namedtuple("Pair", "a b")
    state = {"a": [torch.ones(2), (torch.zeros(1), 3)], "b": None, "c": Pair(1, 2), "d": "x"}
    out = moved(state, "cpu")
    assert out["a"][1][1] == 3 and out["b"] is None and out["c"] == Pair(1, 2)
    assert isinstance(out["a"][1], tuple) and torch.equal(out["a"][0], torch.ones(2))
    assert moved(torch.ones(2, dtype=torch.float64), "meta").device.type == "meta"


# -- refused in the caller, before any worker starts -----------------------------------------


@pytest.mark.skipif(torch.cuda.device_count() > 0, reason="a machine without a GPU")
def test_train_refuses_cuda_without_a_gpu():
    with pytest.raises(ValueError, match="device='cuda' but no CUDA device is visible"):
        towers.train(make_net(), mse, regression_data(), batch_size=9, steps=2, device="cuda")
    with pytest.raises(ValueError, match="device='cuda' but no CUDA device is visible"):
        towers.train(make_net(), mse, regression_data(), batch_size=9, steps=2, transport="nccl")
    with pytest.raises(ValueError, match="device='cuda' but no CUDA device is visible"):
        towers.init(device="cuda")


def test_train_refuses_cuda_where_workers_run_on_cpu():
    data = regression_data()
    with pytest.raises(ValueError, match="elastic=True runs CPU workers"):
        towers.train(make_net(), mse, data, batch_size=9, steps=2, elastic=True, device="cuda")
    with pytest.raises(ValueError, match="Gloo and shared memory move CPU tensors"):
        towers.train(make_net(), mse, data, batch_size=9, steps=2, transport="shm", device="cuda")
    with pytest.raises(ValueError, match="device must be one of"):
        towers.train(make_net(), mse, data, batch_size=9, steps=2, device="tpu")
    with pytest.raises(ValueError, match="NCCL moves GPU tensors"):
        towers.init(backend="nccl", device="cpu")
    with pytest.raises(ValueError, match="backend must be 'gloo' or 'nccl'"):
        towers.init(backend="mpi")


@pytest.mark.timeout(60)
def test_cpu_device_trains_as_before():
    data = regression_data()
    opt = functools.partial(torch.optim.SGD, lr=0.05)
    run = functools.partial(towers.train, make_net(), mse, data, batch_size=9, steps=5)
    a = run(workers=2, device="cpu", optimizer=opt, progress=False)
    b = run(workers=1, device="auto", optimizer=opt, progress=False)
    # two towers and one sum in another order: both as close to float64 as the bound allows
    reference = Reference.of(make_net(), data, batch_size=9, steps=5, optimizer=opt)
    for result, what in ((a, "device='cpu', 2 workers"), (b, "device='auto', 1 worker")):
        reference.check_losses(result.losses, what)
        reference.check(result.model, what)


# -- a GradScaler in the own loop, on CPU workers ----------------------------------------------


def _scaled_loop(nan_step: int) -> tuple[list[float], list[bool], list[float], dict]:
    """Four steps of ``ctx.backward(loss, scaler=...)``; rank 1's shard of ``nan_step`` holds a
    NaN. Returns the losses, the skips, the scales and the parameters (a state dict)."""
    ctx = towers.init(timeout=30)
    model = ctx.replicate(make_net())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**16)
    x, y = regression_data(n=32)
    x[nan_step * 8 + 6, 0] = math.nan  # the second half of global batch nan_step: rank 1's
    losses, skips, scales = [], [], []
    for shard in ctx.shards((x[a : a + 8], y[a : a + 8]) for a in range(0, 32, 8)):
        r = ctx.backward(mse(model, shard), scaler=scaler)
        if r.skipped:
            assert all(bool(p.grad.isnan().all()) for p in model.parameters())
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        losses.append(r.loss)
        skips.append(r.skipped)
        scales.append(scaler.get_scale())
    ctx.close()
    return losses, skips, scales, {k: v.clone() for k, v in model.state_dict().items()}


@pytest.mark.timeout(60)
def test_a_grad_scaler_skips_and_backs_off_on_every_rank_as_one_process_does():
    ranks = towers.spawn(_scaled_loop, 2, 2, timeout=50)
    for got in ranks:
        assert got[1] == [False, False, True, False]
        assert got[2] == [2.0**16, 2.0**16, 2.0**15, 2.0**15]

    def plain_loop(dtype: torch.dtype) -> tuple[torch.nn.Module, list[float]]:
        """One process with the same scaler over the same global batches."""
        model = make_net().to(dtype)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**16)
        x, y = (t.to(dtype) for t in regression_data(n=32))
        x[2 * 8 + 6, 0] = math.nan
        losses = []
        for a in range(0, 32, 8):
            loss = mse(model, (x[a : a + 8], y[a : a + 8]))
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
            losses.append(loss.item())
        return model, losses

    reference = Reference.run(plain_loop)
    for rank, got in enumerate(ranks):
        reference.check(got[3], f"rank {rank}")
        reference.check_losses(got[0], f"rank {rank}'s losses")  # nan at the skipped step
    assert ranks[0][0][:2] == ranks[1][0][:2]  # the same sums on both ranks
    ctx = towers.init()
    try:
        model = ctx.replicate(make_net())
        with pytest.raises(TypeError, match=r"scaler must be a torch\.amp\.GradScaler"):
            ctx.backward(mse(model, regression_data(n=4)), scaler=2.0)
    finally:
        ctx.close()


SHARED = "runs CPU workers (shared memory or Gloo)"  # what the transports declare


def test_every_elastic_refusal_follows_from_what_the_transports_declare(monkeypatch):
    """Elastic jobs regroup over transports that declare it (shared memory, Gloo), which move
    CPU tensors: the transport, backend and device refusals of train(elastic=True) and of a
    script under towers run --elastic all say so in the same words, with the fix."""
    data = regression_data()
    cases = [
        (
            dict(elastic=True, transport="nccl"),
            f"transport='nccl': elastic=True {SHARED}; pass transport='shm' or 'gloo', or drop "
            "elastic=True to train on GPUs",
        ),
        (
            dict(elastic=True, device="cuda"),
            f"device='cuda': elastic=True {SHARED}; pass device='cpu' or 'auto', or drop "
            "elastic=True to train on GPUs",
        ),
    ]
    for kwargs, message in cases:
        with pytest.raises(ValueError) as caught:
            towers.train(make_net(), mse, data, batch_size=9, steps=2, **kwargs)
        assert str(caught.value) == message
    launched = dict(RANK="0", WORLD_SIZE="2", LOCAL_RANK="0", LOCAL_WORLD_SIZE="2")
    for name, value in {**launched, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"}.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("TOWERS_ELASTIC", "1")  # a rank of towers run --elastic
    instead = "or start the job without --elastic to train on GPUs"
    cases = [
        (dict(backend="nccl"), f"backend='nccl': towers run --elastic {SHARED}; pass "),
        (dict(transport="nccl"), f"transport='nccl': towers run --elastic {SHARED}; pass "),
        (dict(device="cuda"), f"device='cuda': towers run --elastic {SHARED}; pass "),
    ]
    fixes = ["backend='gloo'", "transport='shm' or 'gloo'", "device='cpu' or 'auto'"]
    for (kwargs, message), fix in zip(cases, fixes, strict=True):
        with pytest.raises(ValueError) as caught:
            towers.init(**kwargs)
        assert str(caught.value) == f"{message}{fix}, {instead}"
