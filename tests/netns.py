"""Two hosts on one machine: network namespaces joined by a veth pair, for multi-node tests.

``two_hosts()`` makes namespaces ``towers-<pid>-<id>-0`` and ``-1`` with addresses 10.77.X.1/24
and 10.77.X.2/24 on the two ends of a veth pair (and loopback up in each), yields the namespaces and
addresses, and removes everything afterwards. Nothing can leave the machine: the pair connects
only the two namespaces. Each namespace sees the host name resolve to 127.0.0.1, as on many real
machines. Tests that use it are skipped, with the reason, where namespaces cannot be made (not
root, no ``ip``).

``three_hosts()`` makes three, joined by a bridge, for a host that joins a running job.

Run a command on a host with ``host.popen(args)`` (``ip netns exec``). ``host.cut()`` takes
its end of the pair down (no packet passes either way, and no socket is told: a network
partition) and ``host.mend()`` brings it back up.

``two_hosts(own=True)`` gives each host what a second machine has and a namespace alone does
not: its own host name and its own ``/dev/shm`` (each command runs under ``unshare -u -m``
with a fresh tmpfs there, gone when the command ends), so that towers sees two hosts and
shared memory cannot reach across. ``rate="100mbit"`` shapes both ends of the pair with a
token bucket (``tc ... tbf``); ``host.link_bytes()`` reads what its end has sent and received.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import secrets
import shutil
import subprocess
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import pytest

# Run as: sh -c OWN sh HOSTNAME COMMAND...: this host's name and /dev/shm, then the command.
OWN = 'hostname "$1" && mount -t tmpfs -o size=1g,mode=1777 tmpfs /dev/shm && shift && exec "$@"'


@dataclass(frozen=True)
class Host:
    namespace: str
    addr: str
    link: str = ""  # its end of the veth pair
    hostname: str = ""  # its own host name and /dev/shm (two_hosts(own=True)), or the machine's

    def cut(self) -> None:
        """Take this host's link down: a partition, until :meth:`mend`."""
        _ip("-n", self.namespace, "link", "set", self.link, "down")

    def mend(self) -> None:
        """Bring this host's link back up (its address and route come back with it)."""
        _ip("-n", self.namespace, "link", "set", self.link, "up")

    def command(self, args: list[str]) -> list[str]:
        if self.hostname:
            args = ["unshare", "--uts", "--mount", "sh", "-c", OWN, "sh", self.hostname, *args]
        return ["ip", "netns", "exec", self.namespace, *args]

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

    def popen(self, args: list[str], **kwargs: Any) -> subprocess.Popen[str]:
        return subprocess.Popen(self.command(args), text=True, **kwargs)


def _ip(*args: str) -> None:
    done = subprocess.run(["ip", *args], capture_output=True, text=True)
    if done.returncode != 0:
        raise OSError(f"ip {' '.join(args)}: {done.stderr.strip()}")


def _shape(namespace: str, link: str, rate: str) -> None:
    done = subprocess.run(
        ["ip", "netns", "exec", namespace, "tc", "qdisc", "add", "dev", link, "root", "tbf",
         "rate", rate, "burst", "64kb", "latency", "500ms"],
        capture_output=True, text=True,
    )  # fmt: skip
    if done.returncode != 0:
        raise OSError(f"tc qdisc add dev {link} tbf rate {rate}: {done.stderr.strip()}")


def unavailable() -> str | None:
    """Why namespaces cannot be made here, or ``None``."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    if shutil.which("ip") is None:
        return "network namespaces need ip(8) (iproute2)"
    return None


@contextlib.contextmanager
def _namespaces(
    count: int, join: Callable[[str, int, list[str]], list[Host]]
) -> Iterator[list[Host]]:
    """``count`` namespaces ``towers-<pid>-<tag>-0..`` (a test process that dies without removing
    them leaves them to the next one's sweep), joined by ``join(tag, subnet, names)``, which
    returns their hosts; skipped, with the reason, where they cannot be made; all removed
    afterwards (deleting a namespace deletes the links and bridges in it)."""
    reason = unavailable()
    if reason:
        pytest.skip(reason)
    _sweep()
    tag = secrets.token_hex(3)
    subnet = int(tag[:2], 16) % 250 + 1
    names = [f"towers-{os.getpid()}-{tag}-{i}" for i in range(count)]
    made: list[str] = []
    try:
        for name in names:
            _ip("netns", "add", name)
            made.append(name)
        hosts = join(tag, subnet, names)
    except OSError as exc:
        for name in made:
            subprocess.run(["ip", "netns", "del", name], check=False)
        pytest.skip(f"cannot make network namespaces here: {exc}")
    try:
        yield hosts
    finally:
        for name in names:
            subprocess.run(["ip", "netns", "del", name], check=False)


def _sweep() -> None:
    """Delete the namespaces of test processes that died without removing them (killed by a
    signal, which runs no ``finally``): their names carry the pid that made them."""
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    for name in (line.split()[0] for line in listed.splitlines() if line.strip()):
        found = re.fullmatch(r"towers-(\d+)-[0-9a-f]+-\d+", name)
        if found is None:
            continue
        try:
            os.kill(int(found[1]), 0)
        except ProcessLookupError:
            subprocess.run(["ip", "netns", "del", name], check=False)
        except PermissionError:
            pass  # alive, another user's


@contextlib.contextmanager
def two_hosts(own: bool = False, rate: str | None = None) -> Iterator[tuple[Host, Host]]:
    """Two hosts (see the module doc); ``own``: their own host names and /dev/shm; ``rate``:
    the pair shaped to that rate (``tc`` units, ``"100mbit"``)."""

    def pair(tag: str, subnet: int, names: list[str]) -> list[Host]:
        links = [f"tw{tag}{i}" for i in range(2)]
        _ip("link", "add", links[0], "type", "veth", "peer", "name", links[1])
        hosts = []
        for i, (name, link) in enumerate(zip(names, links, strict=True)):
            addr = f"10.77.{subnet}.{i + 1}"
            _ip("link", "set", link, "netns", name)
            _ip("-n", name, "addr", "add", f"{addr}/24", "dev", link)
            _ip("-n", name, "link", "set", link, "up")
            _ip("-n", name, "link", "set", "lo", "up")
            if rate is not None:
                _shape(name, link, rate)
            hosts.append(Host(name, addr, link, f"{name}-host" if own else ""))
        return hosts

    with _namespaces(2, pair) as hosts:
        yield hosts[0], hosts[1]


@contextlib.contextmanager
def three_hosts() -> Iterator[tuple[Host, Host, Host]]:
    """Three hosts on one link: namespaces ``towers-<pid>-<id>-0..2``, 10.77.X.1..3/24, each
    joined by a veth pair to a bridge in the first (so that every host reaches every other, as
    Gloo's full mesh needs), all removed afterwards. A host's ``cut`` takes its own end down (the
    first host's: its end of the bridge, which cuts it from both others)."""

    def bridged(tag: str, subnet: int, names: list[str]) -> list[Host]:
        bridge = f"tb{tag}"
        _ip("-n", names[0], "link", "add", bridge, "type", "bridge")
        _ip("-n", names[0], "link", "set", bridge, "up")
        hosts = []
        for i, name in enumerate(names):
            addr, link = f"10.77.{subnet}.{i + 1}", f"tw{tag}{i}"
            _ip("link", "add", link, "type", "veth", "peer", "name", f"tw{tag}b{i}")
            _ip("link", "set", link, "netns", name)
            _ip("link", "set", f"tw{tag}b{i}", "netns", names[0])
            _ip("-n", names[0], "link", "set", f"tw{tag}b{i}", "master", bridge, "up")
            _ip("-n", name, "addr", "add", f"{addr}/24", "dev", link)
            _ip("-n", name, "link", "set", link, "up")
            _ip("-n", name, "link", "set", "lo", "up")
            hosts.append(Host(name, addr, link))
        return hosts

    with _namespaces(3, bridged) as hosts:
        yield hosts[0], hosts[1], hosts[2]


def torchrun_nodes(
    hosts: tuple[Host, ...],
    script: str,
    args: list[str],
    port: int,
    env: dict[str, str],
    timeout: float = 120,
    started: Any = None,
    per_host: int = 1,
) -> list[str]:
    """Run ``script args`` under torchrun, one node per host (``per_host`` processes each, node
    0 on the first host's address); ``started(nodes)`` is called once they are launched. Returns
    their output; fails the test, with every node's output, unless every node exits 0."""
    import sys

    nodes = [
        host.popen([sys.executable, "-m", "torch.distributed.run", "--nnodes", str(len(hosts)),
                    "--node-rank", str(rank), "--nproc-per-node", str(per_host), "--master-addr",
                    hosts[0].addr, "--master-port", str(port), script, *args], env=env,
                   stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        for rank, host in enumerate(hosts)
    ]  # fmt: skip
    if started is not None:
        started(nodes)
    logs = []
    for node in nodes:
        try:
            logs.append(node.communicate(timeout=timeout)[0])
        finally:
            if node.poll() is None:
                node.kill()
                node.communicate()
    assert all(n.returncode == 0 for n in nodes), "\n".join(log[-2500:] for log in logs)
    return logs
