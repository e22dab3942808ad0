"""Addresses and ports: loopback checks, free ports for local jobs, the interface to a peer."""

from __future__ import annotations

import contextlib
import fcntl
import ipaddress
import socket
import struct

__all__ = ["DEFAULT_ADDR", "free_port", "interface_to", "is_loopback"]

_SIOCGIFADDR = 0x8915

DEFAULT_ADDR = "127.0.0.1"


def free_port(addr: str = DEFAULT_ADDR) -> int:
    """A TCP port that is free on ``addr`` right now (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((addr, 0))
        return int(s.getsockname()[1])


def is_loopback(addr: str) -> bool:
    """Whether ``addr`` (a name or an address) resolves to a loopback address."""
    try:
        return ipaddress.ip_address(socket.gethostbyname(addr)).is_loopback
    except (OSError, ValueError):
        return False


def interface_to(addr: str) -> str | None:
    """The name of the network interface this host reaches ``addr`` through, or ``None``.

    The kernel's routing answers which local address a datagram to ``addr`` would leave from
    (``connect`` on a UDP socket sends nothing); the interface is the one holding that address.
    """
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.connect((socket.gethostbyname(addr), 9))
            local = probe.getsockname()[0]
        names = [name for _, name in socket.if_nameindex()]
    except OSError:
        return None
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for name in names:
            with contextlib.suppress(OSError):
                request = struct.pack("256s", name.encode()[:15])
                answer = fcntl.ioctl(s.fileno(), _SIOCGIFADDR, request)
                if socket.inet_ntoa(answer[20:24]) == local:
                    return name
    return None
