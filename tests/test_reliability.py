"""Dead workers, unreachable or busy rendezvous, loopback-only sockets."""

from __future__ import annotations

import os
import signal
import socket
import time

import pytest
from helpers import make_net, mse, regression_data

import towers
from towers.comm.net import free_port

CALLS = {"n": 0}


def mse_killing_rank_1_on_third_step(model, shard):
    CALLS["n"] += 1
    if os.environ.get("RANK") == "1" and CALLS["n"] == 3:
        os.kill(os.getpid(), signal.SIGKILL)
    return mse(model, shard)


@pytest.mark.timeout(60)
def test_dead_worker_stops_sync_training_naming_it():
    start = time.monotonic()
    with pytest.raises(towers.WorkerError, match=r"worker 1 .*died with signal SIGKILL") as info:
        towers.train(
            make_net(),
            mse_killing_rank_1_on_third_step,
            regression_data(40),
            batch_size=8,
            steps=50,
            workers=3,
            progress=False,
        )
    assert info.value.rank == 1
    assert time.monotonic() - start < 30  # the autouse fixture checks that nothing is left


def join_world():
    ctx = towers.init(timeout=10)
    ctx.close()


@pytest.mark.timeout(60)
def test_port_in_use_is_reported():
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        with pytest.raises(OSError, match=rf"127.0.0.1:{port}.*in use.*MASTER_PORT"):
            towers.spawn(join_world, 2, port=port, failure_grace=1.0)


@pytest.mark.timeout(60)
def test_unreachable_rendezvous_times_out(monkeypatch):
    # rank 1 of a job whose rank 0 never starts: nothing listens on the port
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    start = time.monotonic()
    with pytest.raises(TimeoutError, match=r"could not reach the rendezvous at 127\.0\.0\.1"):
        towers.init(timeout=2)
    assert time.monotonic() - start < 20


def listening_addresses() -> list[str]:
    """Local addresses of this process's listening TCP sockets."""
    inodes = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            for line in f.readlines()[1:]:
                fields = line.split()
                if fields[3] == "0A" and fields[9] in inodes:  # 0A: LISTEN
                    found.append(fields[1].split(":")[0])
    return found


def report_listening():
    ctx = towers.init()
    ctx.barrier()
    addresses = listening_addresses()
    ctx.close()
    return addresses


@pytest.mark.timeout(60)
def test_local_jobs_listen_on_loopback_only():
    loopback = {"0100007F", "0000000000000000FFFF00000100007F", "00000000000000000000000001000000"}
    per_rank = towers.spawn(report_listening, 2)
    assert per_rank[0], "rank 0 should listen for the rendezvous"
    for addresses in per_rank:
        assert set(addresses) <= loopback, addresses


@pytest.mark.timeout(60)
def test_a_rank_that_never_comes_is_named(monkeypatch):
    # rank 0 of a job of 3 whose ranks 1 and 2 never start
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "3")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    port = free_port()
    monkeypatch.setenv("MASTER_PORT", str(port))
    start = time.monotonic()
    message = rf"rank\(s\) 1, 2 of 3 never joined the rendezvous at 127.0.0.1:{port} within 2 s"
    with pytest.raises(TimeoutError, match=message):
        towers.init(timeout=2)
    assert time.monotonic() - start < 10
