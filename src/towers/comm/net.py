"""Addresses and ports: loopback checks and free ports for local jobs."""

from __future__ import annotations

import ipaddress
import socket

__all__ = ["DEFAULT_ADDR", "free_port", "is_loopback"]

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
