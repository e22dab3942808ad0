"""Shared test fixtures: every test must leave no process behind; how the suite is run.

The suite runs in three processes (pytest-xdist, ``-n auto`` below, one on a 1-core machine):
most tests wait on processes of their own, which leave a core idle. Each process starts on
its share of the tests marked ``slow``, so that no long test starts last while the others
have nothing left to do.
"""

from __future__ import annotations

import multiprocessing
import os
import time

import pytest
import torch


def _infrastructure() -> set[int]:
    """multiprocessing's own long-lived helpers (forkserver, resource tracker): not leaks."""
    pids = set()
    from multiprocessing import forkserver, resource_tracker

    for owner in (forkserver._forkserver, resource_tracker._resource_tracker):
        pid = getattr(owner, "_forkserver_pid", None) or getattr(owner, "_pid", None)
        if pid:
            pids.add(pid)
    return pids


def descendants(root: int | None = None) -> set[int]:
    """Every live process below ``root`` (this process by default), from /proc."""
    root = os.getpid() if root is None else root
    parent_of = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if fields[0] != "Z":  # zombies are already dead
            parent_of[int(entry)] = int(fields[1])
    found, frontier = set(), {root}
    while frontier:
        frontier = {pid for pid, ppid in parent_of.items() if ppid in frontier} - found
        found |= frontier
    return found


def leftover_processes(grace: float = 5.0) -> set[int]:
    """Worker processes still alive after ``grace`` seconds (infrastructure excluded)."""
    deadline = time.monotonic() + grace
    while True:
        infra = _infrastructure()
        alive = descendants() - infra
        if not alive or time.monotonic() > deadline:
            return alive
        time.sleep(0.05)


# Every process a test starts (workers, torchrun's ranks, a host's launcher) prints the Python
# stack of each of its threads if it dies of a signal it raised itself (a C++ abort, a segfault),
# so that the test's captured output says where a rare crash happened.
os.environ.setdefault("PYTHONFAULTHANDLER", "1")


def pytest_xdist_auto_num_workers(config: pytest.Config) -> int:
    """``-n auto``: three test processes where there are two cores or more (one on one core).

    Most tests spend much of their time waiting (on a timeout, a stopped host, a job's
    start-up); a third test process fills that time, and keeps each test beside two others,
    the load every timing test is written to pass beside (docs/testing.md). More would only
    make every job start slower.
    """
    return 3 if (os.cpu_count() or 1) >= 2 else 1


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Each test process's share of the ``slow`` tests first (see the module doc).

    ``--dist worksteal`` gives each process a contiguous part of this order and lets an idle
    process take the end of another's: each part starts with every n-th slow test, so every
    process starts on the long tests and the ends, which others may take, are short ones.
    """
    workers = getattr(config, "workerinput", {}).get("workercount", 1)
    slow = [item for item in items if item.get_closest_marker("slow")]
    fast = [item for item in items if not item.get_closest_marker("slow")]
    items[:] = [item for w in range(workers) for item in slow[w::workers] + fast[w::workers]]


@pytest.fixture(autouse=True)
def no_leftover_processes():
    torch.set_num_threads(1)
    yield
    multiprocessing.active_children()  # reaps finished children
    alive = leftover_processes()
    assert not alive, f"processes left behind: {sorted(alive)}"
