"""Shared-memory segments and named semaphores mapped by every rank of a job on one host.

Rank 0 creates a segment in ``/dev/shm`` (and the semaphores), the others attach, and rank 0
unlinks the names as soon as everyone has attached or failed to: the memory lives exactly as long
as the processes that map it, whatever way they end.

A process killed in that window (or in torch's, between creating a ``torch_*`` file and
unlinking it) leaves its file behind. Every name carries its creator's process id (``towers-PID-
…``, ``sem.towers-PID-…``, torch's ``torch_PID_…``), so :func:`sweep` can remove, when a job
starts, the files whose creator is dead and that no live process maps or holds open.
"""

from __future__ import annotations

import _multiprocessing
import contextlib
import mmap
import os
import re
import secrets
import socket
from typing import Any

import torch

from .base import Comm

__all__ = [
    "SHM_DIR",
    "ShmUnavailable",
    "alive",
    "free_space",
    "host_key",
    "open_shared",
    "size_text",
    "sweep",
]

SHM_DIR = "/dev/shm"
_SEMAPHORE = 1  # multiprocessing's kind for a counting semaphore
_SEM_MAX = _multiprocessing.SemLock.SEM_VALUE_MAX
# towers' segments and semaphores, and torch's shared storages: the creator's pid in the name
_CREATED_BY = re.compile(r"^(?:sem\.)?towers-(\d+)-|^torch_(\d+)_")


class ShmUnavailable(RuntimeError):
    """Shared-memory averaging cannot run here (other hosts, no /dev/shm, ...)."""


def host_key() -> str:
    """Equal on two processes exactly when they run on the same booted machine."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = ""
    return f"{socket.gethostname()}/{boot}"


def alive(pid: int) -> bool:
    """Whether process ``pid`` exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except OSError:
        return False


def size_text(n: float) -> str:
    """``n`` bytes as people read them: ``512 KiB``, ``16.0 MiB``, ``2.5 GiB``."""
    if n >= 2**30:
        return f"{n / 2**30:.1f} GiB"
    return f"{n / 2**20:.1f} MiB" if n >= 2**20 else f"{n / 1024:.0f} KiB"


def free_space(directory: str = SHM_DIR) -> tuple[int, int]:
    """``(free, total)`` bytes of the file system holding ``directory``."""
    st = os.statvfs(directory)
    return st.f_bavail * st.f_frsize, st.f_blocks * st.f_frsize


def sweep(directory: str = SHM_DIR) -> list[str]:
    """Remove the shared-memory files that killed jobs left in ``directory``; return their paths.

    A file is removed only if its name says towers or torch made it (see the module doc), this
    user owns it, its creator is dead, and no live process maps it or holds it open (a tensor
    handed to a process that outlived its creator keeps its file).
    """
    try:
        names = os.listdir(directory)
    except OSError:
        return []
    stale = {}
    for name in names:
        found = _CREATED_BY.match(name)
        if found is None or alive(int(found.group(1) or found.group(2))):
            continue
        path = os.path.join(directory, name)
        with contextlib.suppress(OSError):
            st = os.lstat(path)
            if st.st_uid == os.geteuid():
                stale[path] = (st.st_dev, st.st_ino)
    if not stale:
        return []
    used = _in_use(directory)
    removed = []
    for path, ident in stale.items():
        if ident in used:
            continue
        with contextlib.suppress(OSError):
            os.unlink(path)
            removed.append(path)
    return removed


def _in_use(directory: str) -> set[tuple[int, int]]:
    """(device, inode) of the files in ``directory`` that a live process maps or holds open.

    The device counts: a process in another mount namespace sees another tmpfs at the same
    path, whose inode numbers are small integers like this one's.
    """
    used: set[tuple[int, int]] = set()
    prefix = directory.rstrip("/") + "/"
    for pid in filter(str.isdigit, os.listdir("/proc")):
        with contextlib.suppress(OSError, ValueError), open(f"/proc/{pid}/maps") as maps:
            for line in maps:
                fields = line.split(maxsplit=5)
                if len(fields) == 6 and fields[5].startswith(prefix):
                    major, minor = (int(part, 16) for part in fields[3].split(":"))
                    used.add((os.makedev(major, minor), int(fields[4])))
        with contextlib.suppress(OSError):
            for fd in os.listdir(f"/proc/{pid}/fd"):
                with contextlib.suppress(OSError):
                    if os.readlink(f"/proc/{pid}/fd/{fd}").startswith(prefix):
                        st = os.stat(f"/proc/{pid}/fd/{fd}")
                        used.add((st.st_dev, st.st_ino))
    return used


def open_shared(base: Comm, size: int, semaphores: int) -> tuple[torch.Tensor, list[Any]]:
    """Map a new segment of ``size`` bytes (and named semaphores) on every rank of ``base``.

    Rank 0 creates them, the others attach, and rank 0 unlinks them once all have attached (or
    failed to), so that nothing is left behind whatever happens next. A failure anywhere
    raises :class:`ShmUnavailable` on every rank.
    """
    name = f"towers-{base.all_gather_object(f'{os.getpid()}-{secrets.token_hex(8)}')[0]}"
    path = os.path.join(SHM_DIR, name)
    sem_names = [f"/{name}-{r}" for r in range(semaphores)]
    sems: list[Any] = []
    error = ""
    if base.rank == 0:
        sweep()
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
            try:
                os.ftruncate(fd, size)
                # Reserve the pages now: on a full tmpfs a write to a sparse page is SIGBUS,
                # while this fails cleanly and the job falls back to the process group.
                os.posix_fallocate(fd, 0, size)
            finally:
                os.close(fd)
            sems = [_multiprocessing.SemLock(_SEMAPHORE, 0, _SEM_MAX, n, False) for n in sem_names]
        except Exception as exc:
            error = f"cannot create {path} ({size} bytes) or its semaphores: {exc}"
            with contextlib.suppress(OSError):
                free, total = free_space()
                error += (
                    f"; {SHM_DIR} has {size_text(free)} free of {size_text(total)}: give it more "
                    "room (docker run --shm-size=1g, or mount -o remount,size=1G /dev/shm as "
                    "root), or average over the process group with transport='gloo'"
                )
    try:
        errors = base.all_gather_object(error)
        if errors[0]:
            raise ShmUnavailable(errors[0])
        try:
            fd = os.open(path, os.O_RDWR)
            try:
                mapped = mmap.mmap(fd, size)
            finally:
                os.close(fd)
            if base.rank != 0:
                sems = [
                    _multiprocessing.SemLock._rebuild(0, _SEMAPHORE, _SEM_MAX, n) for n in sem_names
                ]
        except Exception as exc:  # reported on every rank: all fall back, or all fail
            error = f"rank {base.rank} cannot attach to {path}: {exc}"
        errors = base.all_gather_object(error)
    finally:
        if base.rank == 0:
            unlink(path, sem_names)
    failed = [e for e in errors if e]
    if failed:
        raise ShmUnavailable(failed[0])
    return torch.frombuffer(mapped, dtype=torch.uint8), sems


def unlink(path: str, sem_names: list[str]) -> None:
    """Remove a segment's and its semaphores' names (mappings stay valid)."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
    for n in sem_names:
        with contextlib.suppress(OSError):
            _multiprocessing.sem_unlink(n)
