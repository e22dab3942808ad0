"""Two hosts on one machine: network namespaces joined by a veth pair, for multi-node tests.

``two_hosts()`` makes namespaces ``towers-<id>-0`` and ``-1`` with addresses 10.77.X.1/24 and
10.77.X.2/24 on the two ends of a veth pair (and loopback up in each), yields the namespaces and
addresses, and removes everything afterwards. Nothing can leave the machine: the pair connects
only the two namespaces. Each namespace sees the host name resolve to 127.0.0.1, as on many real
machines. Tests that use it are skipped, with the reason, where namespaces cannot be made (not
root, no ``ip``).

Run a command on a host with ``host.popen(args)`` (``ip netns exec``). ``host.cut()`` takes
its end of the pair down (no packet passes either way, and no socket is told: a network
partition) and ``host.mend()`` brings it back up.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest


@dataclass(frozen=True)
class Host:
    namespace: str
    addr: str
    link: str = ""  # its end of the veth pair

    def cut(self) -> None:
        """Take this host's link down: a partition, until :meth:`mend`."""
        _ip("-n", self.namespace, "link", "set", self.link, "down")

    def mend(self) -> None:
        """Bring this host's link back up (its address and route come back with it)."""
        _ip("-n", self.namespace, "link", "set", self.link, "up")

    def command(self, args: list[str]) -> list[str]:
        return ["ip", "netns", "exec", self.namespace, *args]

    def popen(self, args: list[str], **kwargs: Any) -> subprocess.Popen[str]:
        return subprocess.Popen(self.command(args), text=True, **kwargs)


def _ip(*args: str) -> None:
    done = subprocess.run(["ip", *args], capture_output=True, text=True)
    if done.returncode != 0:
        raise OSError(f"ip {' '.join(args)}: {done.stderr.strip()}")


def unavailable() -> str | None:
    """Why namespaces cannot be made here, or ``None``."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    if shutil.which("ip") is None:
        return "network namespaces need ip(8) (iproute2)"
    return None


@contextlib.contextmanager
def two_hosts() -> Iterator[tuple[Host, Host]]:
    reason = unavailable()
    if reason:
        pytest.skip(reason)
    tag = secrets.token_hex(3)
    subnet = int(tag[:2], 16) % 250 + 1
    names = [f"towers-{tag}-{i}" for i in range(2)]
    links = [f"tw{tag}{i}" for i in range(2)]
    made: list[str] = []
    try:
        for name in names:
            _ip("netns", "add", name)
            made.append(name)
        _ip("link", "add", links[0], "type", "veth", "peer", "name", links[1])
        hosts = []
        for i, (name, link) in enumerate(zip(names, links, strict=True)):
            addr = f"10.77.{subnet}.{i + 1}"
            _ip("link", "set", link, "netns", name)
            _ip("-n", name, "addr", "add", f"{addr}/24", "dev", link)
            _ip("-n", name, "link", "set", link, "up")
            _ip("-n", name, "link", "set", "lo", "up")
            hosts.append(Host(name, addr, link))
    except OSError as exc:
        for name in made:
            subprocess.run(["ip", "netns", "del", name], check=False)
        pytest.skip(f"cannot make network namespaces here: {exc}")
    try:
        yield hosts[0], hosts[1]
    finally:
        for name in names:  # deleting a namespace deletes the veth end in it, and so the pair
            subprocess.run(["ip", "netns", "del", name], check=False)
