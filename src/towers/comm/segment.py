"""Shared-memory segments and named semaphores mapped by every rank of a job on one host.

Rank 0 creates a segment in ``/dev/shm`` (and the semaphores), the others attach, and rank 0
unlinks the names as soon as everyone has attached or failed to: the memory lives exactly as long
as the processes that map it, whatever way they end.
"""

from __future__ import annotations

import _multiprocessing
import contextlib
import mmap
import os
import secrets
import socket
from typing import Any

import torch

from .base import Comm

__all__ = ["SHM_DIR", "ShmUnavailable", "alive", "host_key", "open_shared"]

SHM_DIR = "/dev/shm"
_SEMAPHORE = 1  # multiprocessing's kind for a counting semaphore
_SEM_MAX = _multiprocessing.SemLock.SEM_VALUE_MAX


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


def open_shared(base: Comm, size: int, semaphores: int) -> tuple[torch.Tensor, list[Any]]:
    """Map a new segment of ``size`` bytes (and named semaphores) on every rank of ``base``.

    Rank 0 creates them, the others attach, and rank 0 unlinks them once all have attached (or
    failed to), so that nothing is left behind whatever happens next. A failure anywhere
    raises :class:`ShmUnavailable` on every rank.
    """
    name = f"towers-{base.all_gather_object(secrets.token_hex(8))[0]}"
    path = os.path.join(SHM_DIR, name)
    sem_names = [f"/{name}-{r}" for r in range(semaphores)]
    sems: list[Any] = []
    error = ""
    if base.rank == 0:
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
