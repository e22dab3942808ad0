"""The wait primitive of shared-memory barriers: polls while waits are short, sleeps otherwise."""

from __future__ import annotations

import threading
import time

import pytest

from towers.comm.wait import Waiter


def _wait(waiter: Waiter, sem: threading.Semaphore, need: int) -> None:
    start = waiter.start()
    need = waiter.poll(need)
    while need:
        assert sem.acquire(True, 5.0)
        need -= 1
    waiter.done(start)


def test_long_waits_turn_polling_off_and_short_ones_bring_it_back():
    sem = threading.Semaphore(0)
    waiter = Waiter(sem, spin=1e-3)
    assert waiter.budget == pytest.approx(1e-3)
    for _ in range(3):  # a peer that arrives 20 ms late, three times
        threading.Timer(0.02, sem.release).start()
        _wait(waiter, sem, 1)
    assert waiter.budget == 0.0
    # no token and no budget: poll returns at once, however long the peer will take
    start = time.perf_counter()
    assert waiter.poll(1) == 1
    assert time.perf_counter() - start < 1e-3
    for _ in range(40):  # peers that are already there
        sem.release()
        sem.release()
        _wait(waiter, sem, 2)
    assert 0.0 < waiter.budget <= 1e-3


def test_poll_takes_tokens_already_posted_and_reports_the_rest():
    sem = threading.Semaphore(0)
    waiter = Waiter(sem, spin=0.0)
    sem.release()
    assert waiter.poll(3) == 2
    with pytest.raises(ValueError, match="spin must be >= 0"):
        Waiter(sem, spin=-1.0)
