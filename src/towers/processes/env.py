"""The environment of a worker process: torchrun's variables, threads, names, exit statuses.

Every worker sees what ``torchrun`` would give it (``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``,
``LOCAL_WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``), so code written for ``towers.spawn`` or
``towers run`` runs unchanged under ``torchrun``.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import signal

import torch

from ..comm.net import is_loopback
from ..core.launch import ENV_KEYS, Launch

__all__ = [
    "ENV_KEYS",
    "cpu_count",
    "describe_exit",
    "read_secret_file",
    "set_process_name",
    "set_worker_threads",
    "worker_env",
]

_PR_SET_NAME = 15


def cpu_count() -> int:
    """Cores this process may run on (respects CPU affinity and container limits)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not Linux
        return max(1, os.cpu_count() or 1)


def worker_env(
    rank: int,
    world_size: int,
    addr: str,
    port: int,
    *,
    local_rank: int | None = None,
    local_world_size: int | None = None,
    group_rank: int = 0,
    group_world_size: int = 1,
    secret: str | None = None,
    restart_count: int = 0,
) -> dict[str, str]:
    """The variables torchrun sets for one worker (:meth:`towers.core.launch.Launch.environ`).

    By default a single-node job: the local rank and world are the global ones. ``secret`` is
    the job's (``TOWERS_SECRET``): the worker gets it in its environment, never over the
    network. On a loopback address Gloo is also told to use the loopback interface, so that no
    socket of a local job listens on the network.
    """
    env = {}
    if is_loopback(addr) and os.path.exists("/sys/class/net/lo"):
        env["GLOO_SOCKET_IFNAME"] = os.environ.get("GLOO_SOCKET_IFNAME", "lo")
    launch = Launch(
        launched=True,
        rank=rank,
        world_size=world_size,
        local_rank=rank if local_rank is None else local_rank,
        local_world_size=world_size if local_world_size is None else local_world_size,
        group_rank=group_rank,
        group_world_size=group_world_size,
        master_addr=addr,
        master_port=port,
        secret=secret,
        restart_count=restart_count,
    )
    return env | launch.environ()


def read_secret_file(path: str) -> str:
    """The job's secret from ``path`` (``towers run --secret-file``), stripped of blank ends.

    Raises:
        FileNotFoundError: no such file.
        PermissionError: other users may read or write it (``chmod 600`` it).
        ValueError: it is empty.
    """
    mode = os.stat(path).st_mode
    if mode & 0o077:
        raise PermissionError(
            f"the secret file {path} can be read or written by other users (mode "
            f"{oct(mode & 0o777)}): chmod 600 {path}"
        )
    with open(path) as f:
        secret = f.read().strip()
    if not secret:
        raise ValueError(
            f"the secret file {path} is empty: write the job's secret in it, the same on every "
            f"node (e.g. openssl rand -hex 32 > {path})"
        )
    return secret


def describe_exit(exitcode: int | None) -> str:
    """'exit code 3' or 'signal SIGKILL' for a process's exit status."""
    if exitcode is None:
        return "no exit status"
    if exitcode < 0:
        try:
            return f"signal {signal.Signals(-exitcode).name}"
        except ValueError:
            return f"signal {-exitcode}"
    return f"exit code {exitcode}"


def thread_share(local_world_size: int) -> int:
    """Threads for one of the local workers: an equal share of the cores, at least one."""
    return max(1, cpu_count() // max(1, local_world_size))


def set_worker_threads(local_world_size: int) -> None:
    """Give each of the local workers an equal share of the cores (at least one thread)."""
    torch.set_num_threads(thread_share(local_world_size))


def set_process_name(name: str) -> None:
    """Show this process as ``name`` (15 characters at most) in ``ps``, ``top`` and ``pkill``.

    An operator can tell the parameter server from the towers at a glance; does nothing where
    the kernel offers no way to.
    """
    libc_name = ctypes.util.find_library("c")
    if libc_name is None:
        return
    try:
        libc = ctypes.CDLL(libc_name, use_errno=True)
        libc.prctl(_PR_SET_NAME, name.encode()[:15], 0, 0, 0)
    except (OSError, AttributeError):
        pass
