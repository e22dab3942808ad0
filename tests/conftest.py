"""Shared test fixtures: every test must leave no process behind; how the suite is run.

The suite runs in two processes (pytest-xdist, ``-n auto`` below, at most 2 on any machine):
most tests wait on processes of their own, which leave a core idle. Tests marked ``slow``
go first, so that no long test starts last while the other process has nothing left to do.
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


def pytest_xdist_auto_num_workers(config: pytest.Config) -> int:
    """``-n auto``: two test processes where there are two cores (one where there is one).

    Every test that starts a job starts 2-4 processes of its own; more test processes than
    two would only make the machine busier than the timing tests allow (docs/testing.md).
    """
    return max(1, min(2, os.cpu_count() or 1))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The ``slow`` tests first, each file's in their order (see the module doc)."""
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)


@pytest.fixture(autouse=True)
def no_leftover_processes():
    torch.set_num_threads(1)
    yield
    multiprocessing.active_children()  # reaps finished children
    alive = leftover_processes()
    assert not alive, f"processes left behind: {sorted(alive)}"
