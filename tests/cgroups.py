"""Cgroups of a test's own: a memory limit, so that the kernel's OOM killer acts, or a cpu cap, so
that a worker is really slow.

``memory_cgroup(limit)`` makes a child of this process's memory cgroup (cgroup v2, or v1's
memory controller) with that limit and yields its directory; a command started as
``sh -c 'echo $$ > DIR/cgroup.procs && exec …'`` runs inside it. Skipped, with the reason,
where no cgroup can be made (not root, a read-only /sys/fs/cgroup, no memory controller).
"""

from __future__ import annotations

import contextlib
import os
import secrets
import time
from collections.abc import Iterator
from pathlib import Path

import pytest


def _own_memory_cgroup() -> tuple[Path, str] | None:
    """This process's memory cgroup directory and the file that sets its limit."""
    lines = Path("/proc/self/cgroup").read_text().splitlines()
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if "memory" in controllers.split(","):
            where = Path("/sys/fs/cgroup/memory") / path.lstrip("/")
            if where.is_dir():
                return where, "memory.limit_in_bytes"
    for line in lines:
        _, controllers, path = line.split(":", 2)
        where = Path("/sys/fs/cgroup") / path.lstrip("/")
        if controllers == "" and "memory" in (where / "cgroup.subtree_control").read_text():
            return where, "memory.max"
    return None


@contextlib.contextmanager
def memory_cgroup(limit: int) -> Iterator[Path]:
    if os.geteuid() != 0:
        pytest.skip("a memory cgroup needs root")
    try:
        own = _own_memory_cgroup()
    except OSError as exc:
        pytest.skip(f"cannot read this process's cgroups: {exc}")
    if own is None:
        pytest.skip("no memory cgroup to make a child of (no memory controller here)")
    parent, knob = own
    with _child(parent, {knob: str(limit)}, "a memory cgroup with a limit") as child:
        yield child


@contextlib.contextmanager
def cpu_cgroup(share: float, period_us: int = 10_000) -> Iterator[Path]:
    """A child cpu cgroup (v1's cpu controller) capped at ``share`` of one core:
    ``cpu.cfs_quota_us`` over a ``period_us`` period. A process moves itself in with
    :func:`join_cgroup`. Skipped where none can be made."""
    root = Path("/sys/fs/cgroup/cpu")
    if os.geteuid() != 0:
        pytest.skip("a cpu cgroup needs root")
    if not (root / "cpu.cfs_quota_us").exists():
        pytest.skip("no cgroup v1 cpu controller at /sys/fs/cgroup/cpu")
    knobs = {
        "cpu.cfs_period_us": str(period_us),
        "cpu.cfs_quota_us": str(max(1000, round(share * period_us))),
    }
    with _child(root, knobs, "a cpu cgroup") as child:
        yield child


@contextlib.contextmanager
def _child(parent: Path, knobs: dict[str, str], what: str) -> Iterator[Path]:
    """A new cgroup under ``parent`` with ``knobs`` written, in order; skipped, naming
    ``what``, where it cannot be made; removed afterwards."""
    child = parent / f"towers-test-{secrets.token_hex(3)}"
    try:
        child.mkdir()
        for knob, value in knobs.items():
            (child / knob).write_text(value)
    except OSError as exc:
        with contextlib.suppress(OSError):
            child.rmdir()
        pytest.skip(f"cannot make {what} here: {exc}")
    try:
        yield child
    finally:
        _remove(child)


def throttled_periods(cgroup: Path) -> int:
    """How many periods a cpu cgroup's processes were held back for (v1 ``cpu.stat``)."""
    stat = dict(line.split() for line in (cgroup / "cpu.stat").read_text().splitlines())
    return int(stat["nr_throttled"])


def join_cgroup(cgroup: Path | str) -> None:
    """Move this process, every thread of it, into ``cgroup``."""
    Path(cgroup, "cgroup.procs").write_text(str(os.getpid()))


def _remove(cgroup: Path) -> None:
    """Remove ``cgroup`` once it is empty: its processes may take a moment to be gone."""
    deadline = time.monotonic() + 10
    while True:
        try:
            cgroup.rmdir()
            return
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)
