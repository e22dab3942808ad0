"""Meeting the other ranks across hosts: the interface Gloo uses, and a bounded rendezvous.

Two things go wrong on real clusters that never show on one machine:

- Gloo picks its network interface from the host name, and on many machines (containers, cloud
  images, ``/etc/hosts`` written by an installer) the host name resolves to ``127.0.0.1``: Gloo
  then listens on loopback and the other hosts cannot connect (``connectFullMesh failed``).
  :func:`choose_interface` sets ``GLOO_SOCKET_IFNAME`` to the interface that routes to
  ``MASTER_ADDR``, unless the user set it.
- A rank that never comes (not started, wrong address, a firewall) leaves the others waiting in
  the process group's set-up, where the error (if any) does not say who is missing.
  :func:`join` has every rank check in under its own key in the rendezvous store first, and
  fails after ``timeout`` naming the ranks that never did.
"""

from __future__ import annotations

import logging
import os
import socket
import time
from datetime import timedelta
from typing import Any

from .net import interface_to

__all__ = ["choose_interface", "join"]

log = logging.getLogger("towers")


def choose_interface(addr: str, backend: str) -> None:
    """Point Gloo at the interface that reaches ``addr`` (a non-loopback ``MASTER_ADDR``)."""
    if backend != "gloo" or "GLOO_SOCKET_IFNAME" in os.environ:
        return
    name = interface_to(addr)
    if name is not None:
        os.environ["GLOO_SOCKET_IFNAME"] = name
        log.debug("towers: Gloo uses interface %s, which routes to MASTER_ADDR %s", name, addr)


def join(
    store: Any, rank: int, world: int, timeout: timedelta, where: str, backend: str = "gloo"
) -> None:
    """Check in under ``towers/joined/RANK`` and wait for every rank to, for up to ``timeout``;
    then check that every rank asks for the same ``backend``.

    Raises:
        TimeoutError: naming the ranks that never checked in.
        ValueError: some ranks would build a NCCL group and others a Gloo one (GPU workers on
            some hosts, CPU workers on others), which would hang instead of failing.
    """
    store.set(f"towers/joined/{rank}", f"{socket.gethostname()} {os.getpid()} {backend}")
    deadline = time.monotonic() + timeout.total_seconds()
    missing = list(range(world))
    while True:
        missing = [r for r in missing if not store.check([f"towers/joined/{r}"])]
        if not missing:
            _same_backend(store, rank, world, backend)
            return
        if time.monotonic() > deadline:
            ranks = ", ".join(map(str, missing))
            raise TimeoutError(
                f"rank {rank}: rank(s) {ranks} of {world} never joined the rendezvous at {where} "
                f"within {timeout.total_seconds():g} s: are they started, with the same "
                "MASTER_ADDR, MASTER_PORT and WORLD_SIZE, and can their hosts reach this address?"
            )
        time.sleep(0.02)


def _same_backend(store: Any, rank: int, world: int, backend: str) -> None:
    """Every rank checked in with the same backend; else name the first one that did not."""
    if world > 256:  # one read per rank: keep the rendezvous of big jobs as it was
        return
    for r in range(world):
        host, _pid, theirs = store.get(f"towers/joined/{r}").decode().split(" ")
        if theirs != backend:
            raise ValueError(
                f"rank {rank} computes with {backend} and rank {r} (on {host}) with {theirs}: "
                "every rank of a job must use the same device kind. A host with fewer GPUs than "
                "workers falls back to CPU workers under device='auto'; pass device='cuda' or "
                "device='cpu' on every host"
            )
