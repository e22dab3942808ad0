"""Shared test fixtures: every test must leave no process behind."""

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


@pytest.fixture(autouse=True)
def no_leftover_processes():
    torch.set_num_threads(1)
    yield
    multiprocessing.active_children()  # reaps finished children
    alive = leftover_processes()
    assert not alive, f"processes left behind: {sorted(alive)}"
