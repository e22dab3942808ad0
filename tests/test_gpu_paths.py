"""What the CUDA path chooses, checked on a machine without a GPU (docs/gpu.md, "Several GPUs").

Where a worker computes is a pure function of the request and the visible GPUs
(tests/test_devices.py); from there the CUDA path must pick NCCL, 25 MiB buckets, a step decided
on the device and towers timed by CUDA events. None of these choices needs a GPU to be made,
so each is checked here, with a device count passed in where one is needed.
"""

from __future__ import annotations

import math
import types

import pytest
import torch

from towers.core.devices import KINDS, _no_events, place
from towers.engines.sync.driver import SyncDriver
from towers.engines.sync.gradsync import GPU_BUCKET_BYTES, BucketPlan, bucket_bytes_for
from towers.engines.sync.plan import EveryStep
from towers.engines.sync.runner import DeviceClock, StepRunner
from towers.engines.sync.state import LastResult, RunState


def _group(device: str, elastic: bool = False):
    """What the driver and the runner read of a group before it is joined."""
    return types.SimpleNamespace(device=torch.device(device), elastic=elastic)


@pytest.mark.parametrize("gpus", [2, 4, 8])
def test_every_rank_of_a_gpu_host_gets_its_own_gpu_over_nccl(gpus):
    placed = [place("auto", workers=gpus, visible=gpus, local_rank=r) for r in range(gpus)]
    assert {p.backend for p in placed} == {"nccl"}
    assert [str(p.device) for p in placed] == [f"cuda:{r}" for r in range(gpus)]


def test_gpu_buckets_are_ddp_s_size_in_reverse_order():
    model = torch.nn.Sequential(*[torch.nn.Linear(1024, 1024) for _ in range(28)])  # 29.4 M
    params = [p for p in model.parameters() if p.requires_grad]
    size = bucket_bytes_for(torch.device("cuda"))
    assert size == GPU_BUCKET_BYTES == 25 * 1024 * 1024  # DDP's bucket_cap_mb
    assert bucket_bytes_for(torch.device("cpu")) < size
    plan = BucketPlan.of(params, size)
    order = [i for bucket in plan.buckets for i in bucket]
    assert order == list(reversed(range(len(params))))  # the order backward produces them
    total = sum(p.numel() * p.element_size() for p in params)
    assert len(plan.buckets) == pytest.approx(total / size, abs=1.5)
    for bucket in plan.buckets:  # as DDP's: a bucket closes with the parameter that fills it
        nbytes = [params[i].numel() * params[i].element_size() for i in bucket]
        assert sum(nbytes[:-1]) < size


@pytest.mark.parametrize(
    ("device", "elastic", "decided_on_device"),
    [("cuda", False, True), ("cuda", True, False), ("cpu", False, False)],
)
def test_a_gpu_step_is_decided_on_the_device(monkeypatch, device, elastic, decided_on_device):
    monkeypatch.delenv("TOWERS_DECIDE_ON_DEVICE", raising=False)
    driver = SyncDriver(_group(device, elastic))  # type: ignore[arg-type]
    assert driver.defer is decided_on_device


def test_gpu_towers_are_timed_by_events():
    assert KINDS["cuda"].untimed is None  # this torch has CUDA events: balance=None balances
    cuda = StepRunner(_group("cuda"), RunState(EveryStep(), LastResult()), None)  # type: ignore[arg-type]
    cpu = StepRunner(_group("cpu"), RunState(EveryStep(), LastResult()), None)  # type: ignore[arg-type]
    assert isinstance(cuda.clock, DeviceClock) and cpu.clock is None


def test_without_events_balance_is_off_with_one_line(monkeypatch):
    monkeypatch.setattr(torch.cuda, "Event", None)
    why = _no_events()
    assert why is not None and "\n" not in why and "torch.cuda.Event.elapsed_time" in why


class _Event:
    """A stand-in for ``torch.cuda.Event`` whose work is done when the test says so."""

    def __init__(self, clock: list[float], enable_timing: bool = False):
        self.clock, self.at, self.done = clock, math.nan, False

    def record(self) -> None:
        self.at = self.clock[0]

    def query(self) -> bool:
        return self.done

    def elapsed_time(self, end: _Event) -> float:
        return (end.at - self.at) * 1000.0  # milliseconds, as CUDA's


def test_the_device_clock_reports_the_last_measured_pace_without_waiting():
    now = [0.0]
    events: list[_Event] = []

    def event(**kw) -> _Event:
        events.append(_Event(now, **kw))
        return events[-1]

    clock = DeviceClock(event)
    clock.start()
    now[0] = 2.0
    assert clock.stop(10) == 0.0  # not passed yet: unknown, which the balancer leaves out
    clock.start()
    now[0] = 3.0
    events[1].done = True  # the first step's end has passed on the device
    assert clock.stop(20) == pytest.approx(20 * 0.2)  # 2 s for 10 samples
    for e in events:
        e.done = True
    clock.start()
    assert clock.stop(5) == pytest.approx(5 * 1.0 / 20)  # the second step: 1 s for 20
    assert len(clock.pending) == 1  # only the step just queued is still to be measured
