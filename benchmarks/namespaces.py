"""Two hosts on this machine for benchmarks: network namespaces joined by a shaped veth pair.

Each host is a network namespace whose commands run under ``unshare -u -m`` with their own host
name and a fresh tmpfs on ``/dev/shm``: towers sees two hosts, and shared memory cannot reach
across. Both ends of the pair are shaped by a token bucket (``tc qdisc add dev X root tbf rate
R burst 64kb latency 500ms``; this kernel has no netem), so every byte between the hosts goes at
rate R; with no rate the pair is left unshaped, as fast as the kernel copies. Nothing can leave
the machine: the pair connects only the two namespaces.

Cleaning up does not depend on this process ending well. A janitor process, in a session of its
own (Ctrl-C in the terminal does not reach it), holds the read end of a pipe whose write end
only this process has; when this process exits, however it exits (``SIGKILL`` included), the
pipe closes and the janitor kills every process left in the namespaces and deletes them.

Needs root, ``ip`` and ``tc`` (iproute2) and ``unshare`` (util-linux).
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import subprocess
import sys
from dataclasses import dataclass
from typing import Any

__all__ = ["Host", "Hosts", "unavailable"]

# sh -c OWN sh HOSTNAME COMMAND...: this host's name and /dev/shm, then the command.
OWN = 'hostname "$1" && mount -t tmpfs -o size=2g,mode=1777 tmpfs /dev/shm && shift && exec "$@"'

# Waits for its stdin to close, then removes the namespaces named in argv and what runs in them.
JANITOR = """
import os, signal, subprocess, sys
sys.stdin.buffer.read()
for name in sys.argv[1:]:
    pids = subprocess.run(["ip", "netns", "pids", name], capture_output=True, text=True).stdout
    for pid in pids.split():
        try:
            os.kill(int(pid), signal.SIGKILL)
        except OSError:
            pass
for name in sys.argv[1:]:
    subprocess.run(["ip", "netns", "del", name], capture_output=True)
"""


def unavailable() -> str | None:
    """Why two hosts cannot be made here, or ``None``."""
    if os.geteuid() != 0:
        return "network namespaces need root: run it with sudo"
    missing = [t for t in ("ip", "tc", "unshare") if shutil.which(t) is None]
    if missing:
        return f"needs {', '.join(missing)} (iproute2, util-linux)"
    return None


def _run(*args: str) -> None:
    done = subprocess.run(list(args), capture_output=True, text=True)
    if done.returncode != 0:
        raise OSError(f"{' '.join(args)}: {done.stderr.strip()}")


@dataclass(frozen=True)
class Host:
    namespace: str
    addr: str
    link: str  # its end of the pair
    hostname: str

    def command(self, args: list[str]) -> list[str]:
        """``args`` run on this host (its namespace, host name and /dev/shm)."""
        own = ["unshare", "--uts", "--mount", "sh", "-c", OWN, "sh", self.hostname]
        return ["ip", "netns", "exec", self.namespace, *own, *args]

    def popen(self, args: list[str], **kwargs: Any) -> subprocess.Popen[str]:
        return subprocess.Popen(self.command(args), text=True, start_new_session=True, **kwargs)

    def link_bytes(self) -> tuple[int, int]:
        """Bytes its end of the pair has sent and received so far."""
        done = subprocess.run(
            ["ip", "-n", self.namespace, "-s", "-j", "link", "show", "dev", self.link],
            capture_output=True,
            text=True,
            check=True,
        )
        stats = json.loads(done.stdout)[0]["stats64"]
        return stats["tx"]["bytes"], stats["rx"]["bytes"]


class Hosts:
    """Two hosts joined by a link shaped to ``rate`` (``tc`` units: ``"100mbit"``; ``None``:
    unshaped)."""

    def __init__(self, rate: str | None):
        self.rate = rate
        tag = secrets.token_hex(3)
        self.names = [f"tbench-{tag}-{i}" for i in range(2)]
        self.links = [f"tb{tag}{i}" for i in range(2)]
        self.subnet = int(tag[:2], 16) % 250 + 1
        self.janitor: subprocess.Popen[bytes] | None = None
        self.hosts: list[Host] = []

    def __enter__(self) -> list[Host]:
        reason = unavailable()
        if reason:
            raise RuntimeError(reason)
        self.janitor = subprocess.Popen(
            [sys.executable, "-c", JANITOR, *self.names],
            stdin=subprocess.PIPE,
            start_new_session=True,
        )
        try:
            self._make()
        except BaseException:
            self.__exit__()
            raise
        return self.hosts

    def _make(self) -> None:
        for name in self.names:
            _run("ip", "netns", "add", name)
        _run("ip", "link", "add", self.links[0], "type", "veth", "peer", "name", self.links[1])
        for i, (name, link) in enumerate(zip(self.names, self.links, strict=True)):
            addr = f"10.78.{self.subnet}.{i + 1}"
            _run("ip", "link", "set", link, "netns", name)
            _run("ip", "-n", name, "addr", "add", f"{addr}/24", "dev", link)
            _run("ip", "-n", name, "link", "set", link, "up")
            _run("ip", "-n", name, "link", "set", "lo", "up")
            if self.rate is not None:
                _run("ip", "netns", "exec", name, "tc", "qdisc", "add", "dev", link, "root", "tbf",
                     "rate", self.rate, "burst", "64kb", "latency", "500ms")  # fmt: skip
            self.hosts.append(Host(name, addr, link, f"{name}-host"))

    def __exit__(self, *exc: object) -> None:
        if self.janitor is not None and self.janitor.stdin is not None:
            self.janitor.stdin.close()  # the janitor cleans up now
            self.janitor.wait()
            self.janitor = None
