"""Telling a worker killed by the out-of-memory killer from one killed by a person.

Both die of ``SIGKILL``, and the exit status says nothing more. The kernel counts its kills,
though: for the whole machine (``oom_kill`` in ``/proc/vmstat``, Linux 4.13 and later) and per
memory cgroup (``oom_kill`` in ``memory.events`` under cgroup v2, in ``memory.oom_control``
under v1), which is where a container's or a batch job's memory limit lives. :class:`OomWatch`
reads the counters when workers start; a worker that later dies of ``SIGKILL`` while one of them
rose was, all but certainly, killed for memory.
"""

from __future__ import annotations

import contextlib
import os
import signal

__all__ = ["OomWatch"]


def _counter(path: str, name: str = "oom_kill") -> int | None:
    """The value of ``name`` in a ``key value`` file, or ``None`` if it cannot be read."""
    try:
        with open(path) as f:
            for line in f:
                parts = line.split()
                if len(parts) == 2 and parts[0] == name:
                    return int(parts[1])
    except (OSError, ValueError):
        pass
    return None


def _mounts() -> list[tuple[str, str, str, str]]:
    """``(root, mount point, type, super options)`` of every cgroup file system."""
    found = []
    with contextlib.suppress(OSError), open("/proc/self/mountinfo") as f:
        for line in f:
            left, _, right = line.partition(" - ")
            fields, kind = left.split(), right.split()
            if len(fields) >= 5 and len(kind) >= 3 and kind[0] in ("cgroup", "cgroup2"):
                found.append((fields[3], fields[4], kind[0], kind[2]))
    return found


def _cgroup_counter_files() -> list[str]:
    """This process's memory cgroup's OOM-kill counter file(s), v2 or v1."""
    files = []
    with contextlib.suppress(OSError), open("/proc/self/cgroup") as f:
        lines = [line.rstrip("\n").split(":", 2) for line in f]
    mounts = _mounts()
    for parts in lines if mounts else []:
        if len(parts) != 3:
            continue
        _, controllers, path = parts
        for root, point, kind, options in mounts:
            v2 = kind == "cgroup2" and controllers == ""
            v1 = kind == "cgroup" and "memory" in controllers.split(",")
            if not (v2 or (v1 and "memory" in options.split(","))):
                continue
            inner = path[len(root) :] if root != "/" and path.startswith(root) else path
            name = "memory.events" if v2 else "memory.oom_control"
            files.append(os.path.join(point, inner.lstrip("/"), name))
    return files


class OomWatch:
    """The machine's and this process's memory cgroup's OOM-kill counters, read now.

    Workers forked after this belong to the same cgroup (unless something moves them).
    """

    def __init__(self) -> None:
        self.sources = {}  # what the counter is -> its file; the most specific first
        for path in _cgroup_counter_files():
            where = os.path.dirname(path)
            self.sources[f"the OOM-kill count of the memory cgroup {where}"] = path
        self.sources["the machine's OOM-kill count (/proc/vmstat)"] = "/proc/vmstat"
        self.start = {what: _counter(path) for what, path in self.sources.items()}

    def rose(self) -> str | None:
        """``"the … count rose from 0 to 1"`` if a counter rose since this was made, or ``None``."""
        for what, path in self.sources.items():
            before, now = self.start[what], _counter(path)
            if before is not None and now is not None and now > before:
                return f"{what} rose from {before} to {now}"
        return None

    def explain(self, exitcode: int | None) -> str:
        """What to add to a worker's death by ``exitcode``: the OOM killer and what to do."""
        if exitcode != -signal.SIGKILL:
            return ""
        rose = self.rose()
        if rose is None:
            return ""
        return (
            f": killed by the out-of-memory killer ({rose} while it ran). It needed more memory "
            "than the machine or its cgroup allows: lower batch_size (or split each shard with "
            "accumulate=K), run fewer workers (each holds the model, its gradients, the "
            "optimizer's state and its shard), or raise the memory limit"
        )
