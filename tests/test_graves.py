"""An abandoned generation's group is let go of at once, even while its work waits on a survivor.

Two processes form a Gloo group with a 4 s timeout; rank 1 starts a sum that rank 0 never
joins, as after a lost peer one survivor can wait in a collective that another survivor, whose
own collective failed, will never make, and rank 0 still holds the group (as an engine holds a
bucket's work until it regroups). Destroying the group waits for rank 1's work (the timeout);
burying it (:mod:`towers.comm.graves`) returns at once, a next group forms over a fresh prefix of
the store and sums correctly, and closing shuts the buried group down.
"""

from __future__ import annotations

import multiprocessing
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from towers.comm.graves import Graves
from towers.comm.net import free_port

TIMEOUT = 4.0


def _member(rank: int, port: int, bury: bool, out: multiprocessing.Queue) -> None:
    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, 2, rank == 0, timeout=timedelta(seconds=30))
    graves = Graves(TIMEOUT)
    timeout = timedelta(seconds=TIMEOUT)
    first = dist.PrefixStore("g0", store)
    dist.init_process_group("gloo", store=first, rank=rank, world_size=2, timeout=timeout)
    held = None
    if rank == 1:  # a sum that rank 0 never joins, and that rank 1 gives up waiting for
        dist.all_reduce(torch.ones(4), async_op=True)
    else:  # what an engine still holds of a group it leaves (a bucket's work) keeps it open
        held = dist.distributed_c10d._get_default_group()
    store.set(f"ready/{rank}", "1")
    store.wait([f"ready/{1 - rank}"])
    began = time.monotonic()
    if bury:
        graves.bury()
    else:
        dist.destroy_process_group()
    left = time.monotonic() - began
    total = torch.full((2,), float(rank + 1))
    if bury:  # the next generation forms and sums at once
        second = dist.PrefixStore("g1", store)
        dist.init_process_group("gloo", store=second, rank=rank, world_size=2, timeout=timeout)
        dist.all_reduce(total)
        dist.destroy_process_group()
    elif rank == 0:  # rank 0 still holds the group while rank 1 leaves it
        store.wait(["done"])
    del held
    graves.release()
    out.put((rank, left, total.tolist(), len(graves)))
    if rank == 1:
        store.set("done", "1")
    else:
        store.wait(["done"])  # rank 0 hosts the store: it leaves last


def _run(bury: bool) -> dict[int, list]:
    ctx = multiprocessing.get_context("spawn")
    out, port = ctx.Queue(), free_port()
    procs = [ctx.Process(target=_member, args=(r, port, bury, out)) for r in range(2)]
    for p in procs:
        p.start()
    try:
        got = dict((r, rest) for r, *rest in (out.get(timeout=60) for _ in procs))
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
                p.join()
    assert [p.exitcode for p in procs] == [0, 0]
    return got


@pytest.mark.timeout(90)
@pytest.mark.slow
def test_a_buried_group_is_left_at_once_and_a_destroyed_one_waits_for_its_work():
    buried = _run(bury=True)
    for rank, (left, total, kept) in buried.items():
        assert left < TIMEOUT / 4, f"rank {rank} took {left:.1f} s to leave a buried group"
        assert total == [3.0, 3.0] and kept == 0
    destroyed = _run(bury=False)
    assert destroyed[1][0] > TIMEOUT / 2, destroyed  # what burying saves: the wait for the work
    print(f"left a group with work waiting on a peer: buried {buried[1][0]:.2f} s, "
          f"destroyed {destroyed[1][0]:.1f} s")  # fmt: skip
