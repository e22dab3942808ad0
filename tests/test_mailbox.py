"""The parameter server's shared-memory messages: order, content, limits, and the async engine."""

from __future__ import annotations

import functools

import pytest
import torch
import torch.distributed as dist

import towers
from towers.comm.base import DistComm
from towers.comm.group import init_process_group
from towers.comm.mailbox import ShmPointToPoint
from towers.core.launch import read_launch
from towers.tools.zoo import Parabola, parabola_data, parabola_loss

SIZE = 4096 + 8


def _message(rank: int, i: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * rank + i)
    return torch.randint(0, 256, (SIZE,), dtype=torch.uint8, generator=g)


def _exchange(rounds: int) -> list[str]:
    """Rank 0 answers every worker's message with one of its own; rounds of that, then errors."""
    init_process_group(read_launch(), "gloo")
    try:
        link = ShmPointToPoint(DistComm(), SIZE, timeout=30)
        rank, world = link.rank, link.world_size
        got = torch.empty(SIZE, dtype=torch.uint8)
        problems = []
        for i in range(rounds):
            if rank == 0:
                for w in range(1, world):
                    link.recv(got, w)
                    if not torch.equal(got, _message(w, i)):
                        problems.append(f"round {i}: rank 0 got a wrong message from {w}")
                for w in range(1, world):
                    link.isend(_message(0, 100 * w + i), w).wait()
            else:
                link.isend(_message(rank, i), 0).wait()
                link.recv(got, 0)
                if not torch.equal(got, _message(0, 100 * rank + i)):
                    problems.append(f"round {i}: rank {rank} got a wrong message")
        if rank == 1:
            try:
                link.isend(torch.zeros(SIZE + 1, dtype=torch.uint8), 0)
            except ValueError as exc:
                problems.append(str(exc))
            try:
                link.isend(got, 2)
            except ValueError as exc:
                problems.append(str(exc))
        dist.barrier()
        return problems
    finally:
        dist.destroy_process_group()


@pytest.mark.timeout(60)
def test_messages_arrive_whole_and_in_order_between_the_server_and_each_worker():
    results = towers.spawn(_exchange, 3, 30, timeout=50)
    assert results[0] == [] and results[2] == []
    too_big, sideways = results[1]
    assert "4105 bytes does not fit a 4104-byte slot" in too_big
    assert "between rank 0 and one other rank; got 1 -> 2" in sideways


@pytest.mark.timeout(60)
def test_async_over_shared_memory_equals_async_over_gloo():
    """One worker: no staleness, so both transports must give the same parameters, bit for bit."""
    opt = functools.partial(torch.optim.SGD, lr=0.02, momentum=0.9)
    runs = {}
    for transport in ("shm", "gloo"):
        torch.manual_seed(0)
        runs[transport] = towers.train(
            Parabola(),
            parabola_loss,
            parabola_data(),
            batch_size=50,
            steps=60,
            workers=1,
            mode="async",
            optimizer=opt,
            progress=False,
            timeout=60,
            transport=transport,
        )
    for name, value in runs["gloo"].model.state_dict().items():
        assert torch.equal(runs["shm"].model.state_dict()[name], value), name
    assert runs["shm"].losses == runs["gloo"].losses
