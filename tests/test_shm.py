"""Shared-memory averaging gives Gloo's numbers, keeps the async and order contracts, leaves
nothing in /dev/shm, and fails instead of hanging when a peer is gone."""

from __future__ import annotations

import os
import re
import signal
import time
from typing import Any

import pytest
import torch
import torch.distributed as dist
from helpers import Net, mse

import towers
from towers.comm.base import DistComm
from towers.comm.group import init_process_group
from towers.comm.shm import SHM_DIR, SMALL_BYTES, ShmComm
from towers.core.launch import read_launch


def _ours() -> set[str]:
    return {n for n in os.listdir(SHM_DIR) if "towers-" in n}


def _orphaned(names: set[str]) -> set[str]:
    """The files among ``names`` made by this process or by one that has exited (a test
    running beside this one may hold files of its own; every name carries its creator's
    process id)."""
    orphans = set()
    for name in names:
        found = re.search(r"towers-(\d+)-", name)
        pid = None if found is None else int(found[1])
        if pid is None or pid == os.getpid() or not os.path.exists(f"/proc/{pid}"):
            orphans.add(name)
    return orphans


@pytest.fixture(autouse=True)
def no_shm_leftovers():
    before = _ours()
    yield
    assert _orphaned(_ours() - before) == set(), "shared-memory files left behind"


def _inputs(rank: int) -> list[torch.Tensor]:
    """Messages of every path: empty, tiny, odd, around the small/large switch, several chunks."""
    g = torch.Generator().manual_seed(100 + rank)
    sizes = [0, 1, 7, 1000, SMALL_BYTES // 4 + 3, 100_003, 70_001]
    out = [torch.randn(n, generator=g) for n in sizes]
    out.append(torch.randn(5000, generator=g, dtype=torch.float64))
    out.append(torch.randint(-1000, 1000, (3001,), generator=g))
    nan = torch.randn(300_000, generator=g)
    if rank == 1:  # a non-finite gradient on one tower poisons the sum on every tower
        nan[12345] = float("nan")
        nan[299_999] = float("inf")
    out.append(nan)
    return out


def _compare(threaded: bool, slot_bytes: int) -> list[tuple[bool, float, bool]]:
    init_process_group(read_launch())
    base = DistComm()
    comm = ShmComm(base, threaded=threaded, slot_bytes=slot_bytes)
    try:
        mine, gloo = _inputs(comm.rank), _inputs(comm.rank)
        # launch all, then wait in reverse: the async contract
        works = [comm.all_reduce_sum(t) for t in mine]
        for w in reversed(works):
            assert w.wait()
        for t in gloo:
            base.all_reduce_sum(t).wait()
        raw = [t.numpy().tobytes() for t in mine]
        same_everywhere = comm.all_gather_object(raw)
        out = []
        for a, b, k in zip(mine, gloo, range(len(mine))):
            identical = all(r[k] == raw[k] for r in same_everywhere)
            a, b = a.double(), b.double()
            close = torch.allclose(a, b, rtol=1e-5, atol=1e-5, equal_nan=True)
            out.append((close, float((a - b).abs().nan_to_num().sum()), identical))
        return out
    finally:
        comm.close()
        dist.destroy_process_group()


@pytest.mark.timeout(90)
@pytest.mark.parametrize(
    ("workers", "threaded", "slot_bytes"),
    [(2, True, 4 << 20), (3, False, 4 << 20), (4, True, 64 << 10), (4, False, 1 << 20)],
)
def test_sum_matches_gloo_and_is_identical_on_every_rank(workers, threaded, slot_bytes):
    # 64 KiB slots cut the larger messages into several chunks of the large path
    results = towers.spawn(_compare, workers, threaded, slot_bytes, timeout=80)
    for rank, rows in enumerate(results):
        for k, (close, diff, identical) in enumerate(rows):
            assert close, f"rank {rank}, message {k}: differs from Gloo (sum of differences {diff})"
            assert identical, f"message {k}: ranks hold different bytes"


def _in_place(threaded: bool) -> list[tuple[bool, bool]]:
    init_process_group(read_launch())
    base = DistComm()
    comm = ShmComm(base, threaded=threaded)
    try:
        g = torch.Generator().manual_seed(comm.rank)
        out = []
        for numel, dtype, view in [
            (300_001, torch.float32, slice(None)),
            (200_000, torch.float64, slice(1000, 150_003)),  # a view at an offset
            (50, torch.float32, slice(None)),  # small: the general path
        ]:
            buf = comm.buffer(numel, dtype)
            assert not buf.any(), "a fresh buffer is zeroed"
            buf.copy_(torch.randn(numel, generator=g, dtype=dtype))
            expected = buf[view].clone()
            base.all_reduce_sum(expected).wait()
            for _ in range(3):  # again and again: the buffer is reused, as bucket buffers are
                before = buf[view].clone()
                comm.all_reduce_sum(buf[view]).wait()
                got = buf[view].clone()
                buf[view].copy_(before)
            same = comm.all_gather_object(got.numpy().tobytes())
            out.append((torch.allclose(got, expected, rtol=1e-5, atol=1e-5), len(set(same)) == 1))
            del buf
        assert comm._regions == [], "a dropped buffer is forgotten"
        return out
    finally:
        comm.close()
        dist.destroy_process_group()


@pytest.mark.timeout(60)
@pytest.mark.parametrize(("workers", "threaded"), [(2, True), (3, False), (4, True)])
def test_sums_in_lent_buffers_match_gloo(workers, threaded):
    for rank, rows in enumerate(towers.spawn(_in_place, workers, threaded, timeout=50)):
        for k, (close, identical) in enumerate(rows):
            assert close and identical, f"rank {rank}, buffer {k}: {close=}, {identical=}"


def _nan_result() -> tuple[bool, bool]:
    init_process_group(read_launch())
    comm = ShmComm(DistComm())
    try:
        x = _inputs(comm.rank)[-1]
        comm.all_reduce_sum(x).wait()
        return bool(x[12345].isnan()), bool(x[299_999].isinf())
    finally:
        comm.close()
        dist.destroy_process_group()


@pytest.mark.timeout(60)
def test_non_finite_values_reach_every_rank():
    assert towers.spawn(_nan_result, 3, timeout=50) == [(True, True)] * 3


def _transport(requested: str | None) -> str:
    ctx = towers.init(transport=requested)
    try:
        return type(ctx.comm).__name__
    finally:
        ctx.close()


@pytest.mark.timeout(60)
def test_auto_picks_shared_memory_for_local_cpu_workers(monkeypatch):
    assert towers.spawn(_transport, 2, None, timeout=50) == ["ShmComm"] * 2
    assert towers.spawn(_transport, 2, "gloo", timeout=50) == ["DistComm"] * 2
    monkeypatch.setenv("TOWERS_TRANSPORT", "gloo")
    assert towers.spawn(_transport, 2, None, timeout=50) == ["DistComm"] * 2
    assert towers.spawn(_transport, 2, "shm", timeout=50) == ["ShmComm"] * 2


def test_unknown_transport_is_refused():
    with pytest.raises(ValueError, match="transport must be one of"):
        towers.init(transport="tcp")
    x = torch.randn(8, 3)
    with pytest.raises(ValueError, match="transport must be one of"):
        towers.train(Net(), mse, (x, x[:, :1]), batch_size=4, steps=1, transport="tcp")


def _full_shm(*args):
    raise OSError(28, "No space left on device")


def _short_of_shared_memory(when: str) -> Any:
    """Train 3 steps with /dev/shm full from the start, or only once the comm exists."""
    import towers.comm.segment as shm

    if when == "start":
        shm.os.posix_fallocate = _full_shm
        assert type(towers.init().comm).__name__ == "DistComm"
        try:
            towers.init(transport="shm")
        except RuntimeError as exc:
            return str(exc)
        return "no error"
    ctx = towers.init(transport=None if when == "never" else "shm")
    if when == "buckets":
        shm.os.posix_fallocate = _full_shm
    torch.manual_seed(0)
    model = ctx.replicate(Net())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.linspace(-1, 1, 24).reshape(8, 3)
    for _ in range(3):
        shard = towers.split((x, x[:, :1] ** 2), ctx.world_size)[ctx.rank]
        ctx.step(mse(model, shard), opt, samples=len(shard[0]))
    lent = bool(getattr(ctx.comm, "_regions", None))
    ctx.close()
    return lent, [p.detach().clone() for p in model.parameters()]


@pytest.mark.timeout(60)
def test_short_of_shared_memory_falls_back_cleanly():
    errors = towers.spawn(_short_of_shared_memory, 2, "start", timeout=50)
    assert all("No space left" in e for e in errors)
    (lent, expected), _ = towers.spawn(_short_of_shared_memory, 2, "never", timeout=50)
    assert lent  # bucket buffers were lent normally
    (lent, got), _ = towers.spawn(_short_of_shared_memory, 2, "buckets", timeout=50)
    assert not lent  # the buckets stayed private and were summed by copy
    for a, b in zip(got, expected, strict=True):
        torch.testing.assert_close(a, b)


def _refuse_a_device_tensor() -> str:
    ctx = towers.init(transport="shm")
    try:
        ctx.comm.all_reduce_sum(torch.ones(3, device="meta"))
    except ValueError as exc:
        return str(exc)
    finally:
        ctx.close()
    return "accepted"


@pytest.mark.timeout(60)
def test_shared_memory_refuses_tensors_off_the_cpu():
    assert all("CPU tensors" in r for r in towers.spawn(_refuse_a_device_tensor, 2, timeout=50))


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() == 0, reason="needs a CUDA device")
@pytest.mark.timeout(60)
def test_auto_keeps_nccl_on_gpus():
    # one worker per GPU, as torchrun would start them; 1 GPU: a world of one still runs NCCL
    workers = min(2, torch.cuda.device_count())
    assert towers.spawn(_transport, workers, None, timeout=50) == ["DistComm"] * workers


def _die_or_wait(victim: int) -> None:
    ctx = towers.init(timeout=30)
    comm = ctx.comm
    assert isinstance(comm, ShmComm)
    comm.all_reduce_sum(torch.ones(10)).wait()
    if comm.rank == victim:
        os.kill(os.getpid(), signal.SIGKILL)
    start = time.monotonic()
    try:
        comm.all_reduce_sum(torch.ones(10)).wait()
    except RuntimeError as exc:
        assert time.monotonic() - start < 10
        raise RuntimeError(f"peer loss noticed: {exc}") from None


@pytest.mark.timeout(60)
def test_a_dead_peer_is_reported_not_waited_for():
    start = time.monotonic()
    with pytest.raises((towers.WorkerError, RuntimeError)) as info:
        towers.spawn(_die_or_wait, 3, 1, timeout=50, failure_grace=20)
    # the death is what spawn reports; the survivors stopped by themselves, long before their
    # 30 s timeout or the 20 s after which spawn would have killed them
    assert "worker 1" in str(info.value)
    assert time.monotonic() - start < 15


def _skip_one_collective(timeout: float) -> str:
    ctx = towers.init(timeout=timeout)
    comm = ctx.comm
    if comm.rank == 0:
        time.sleep(timeout + 3)
        return "slept"
    try:
        comm.all_reduce_sum(torch.ones(4)).wait()
    except TimeoutError as exc:
        return str(exc)
    return "no timeout"


@pytest.mark.timeout(60)
def test_waiting_for_a_stuck_peer_times_out():
    results = towers.spawn(_skip_one_collective, 2, 1.0, timeout=50)
    assert results[0] == "slept"
    assert "waited more than 1 s" in results[1]
