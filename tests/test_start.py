"""How local workers start: forked from the caller where safe, from a fork server otherwise."""

from __future__ import annotations

import os
import signal

import pytest
import torch

import towers


def parent_pid():
    return os.getppid()


def handlers():
    return [signal.getsignal(s) for s in (signal.SIGUSR1, signal.SIGTERM, signal.SIGINT)]


def parallel_product(a):
    torch.set_num_threads(2)  # an OpenMP parallel region with two threads
    return a @ a


@pytest.mark.timeout(60)
def test_workers_are_forked_from_the_caller_unless_told_otherwise(monkeypatch):
    assert towers.spawn(parent_pid, 2) == [os.getpid()] * 2
    monkeypatch.setenv("TOWERS_START_METHOD", "forkserver")
    assert os.getpid() not in towers.spawn(parent_pid, 2)


@pytest.mark.timeout(60)
def test_a_forked_worker_runs_openmp_after_the_caller_did():
    # GNU OpenMP's thread pool does not survive a fork: a child of a process whose pool exists
    # hangs in its first parallel region unless the pool was released before forking.
    a = torch.randn(600, 600)
    torch.set_num_threads(2)
    try:
        expected = a @ a  # starts the caller's pool
        [got] = towers.spawn(parallel_product, 1, a, timeout=45)
        # the same product with as many threads: the same numbers, bit for bit
        assert torch.equal(got, expected)
        assert torch.equal(a @ a, expected)  # and the caller's pool comes back
    finally:
        torch.set_num_threads(1)


@pytest.mark.timeout(60)
def test_a_forked_worker_drops_the_callers_signal_handlers():
    # the caller's own SIGINT handler too: a runner started in the background (SIGINT ignored,
    # which a worker keeps, as across an exec) would otherwise decide what the worker gets
    previous = [signal.signal(s, lambda *_: None) for s in (signal.SIGUSR1, signal.SIGINT)]
    try:
        for got in towers.spawn(handlers, 2):
            assert got == [signal.SIG_DFL, signal.SIG_DFL, signal.default_int_handler]
    finally:
        for sig, handler in zip((signal.SIGUSR1, signal.SIGINT), previous):
            signal.signal(sig, handler)


def test_an_unknown_start_method_is_refused(monkeypatch):
    monkeypatch.setenv("TOWERS_START_METHOD", "thread")
    with pytest.raises(ValueError, match="TOWERS_START_METHOD='thread' is not a start method"):
        towers.spawn(parent_pid, 1)
