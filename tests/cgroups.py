"""A memory cgroup of its own for one test: a small limit, so that the kernel's OOM killer acts.

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
    child = parent / f"towers-test-{secrets.token_hex(3)}"
    try:
        child.mkdir()
        (child / knob).write_text(str(limit))
    except OSError as exc:
        with contextlib.suppress(OSError):
            child.rmdir()
        pytest.skip(f"cannot make a memory cgroup with a limit here: {exc}")
    try:
        yield child
    finally:
        deadline = time.monotonic() + 10
        while True:  # its processes may take a moment to be gone
            try:
                child.rmdir()
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.1)
