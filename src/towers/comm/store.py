"""A job's rendezvous store: listening on the address given, one job per store, signed records.

``torch.distributed``'s TCPStore has no authentication: whoever reaches its port can read, list
and write every key. This module keeps what towers needs from it safe:

- :func:`host_store` listens on the address given only (TCPStore alone listens on every
  interface), and publishes who holds it (``towers/owner``: the job's id, derived from its
  secret, the host and the pid).
- :func:`client_store` reads that record before writing anything, and refuses a store held by
  another job (or by this job under another secret) at once: :class:`ForeignJob`. Two jobs given
  the same port thus never join each other.
- :func:`job_store` puts the job's keys under a prefix derived from its secret.
- :func:`put_signed` / :func:`get_signed` sign and check the records that decide who is in a
  job (an elastic job's members, losses and admissions): a key anyone can list is still not a
  record anyone can forge.

Without a secret (a job under plain ``torchrun`` with no ``TOWERS_SECRET``) the job's id is
``"none"``, keys are not prefixed and records not signed, as before.
"""

from __future__ import annotations

import errno
import json
import os
import socket
import time
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from ..core.secret import JobSecret

__all__ = [
    "OWNER",
    "ForeignJob",
    "ForgedRecord",
    "claim",
    "client_store",
    "get_signed",
    "host_store",
    "job_id",
    "job_store",
    "listen",
    "put_signed",
    "read_signed",
]

OWNER = "towers/owner"
_POLL = 0.01


class ForeignJob(RuntimeError):
    """The store reached belongs to another towers job, or to this job under another secret."""


class ForgedRecord(RuntimeError):
    """A record in the job's store is not signed with the job's secret: someone else wrote it."""


def job_id(secret: JobSecret | None) -> str:
    return "none" if secret is None else secret.job_id


def listen(addr: str, port: int) -> socket.socket:
    """A socket listening on ``addr``:``port`` only (never every interface).

    Raises:
        OSError: the port is taken, or ``addr`` is not an address of this host; said plainly.
    """
    family = socket.getaddrinfo(addr, port, type=socket.SOCK_STREAM)[0][0]
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((addr, port))
        sock.listen()
    except OSError as exc:
        sock.close()
        if exc.errno == errno.EADDRNOTAVAIL:
            why = f"{addr} is not an address of this host; give one of its own addresses"
        else:
            why = (
                "the port is in use (by another process, perhaps another towers job): choose "
                "another port (towers run --port, MASTER_PORT), or leave it unset for a free one"
            )
        raise OSError(
            exc.errno, f"cannot listen for the rendezvous on {addr}:{port}: {exc.strerror}; {why}"
        ) from None
    return sock


def claim(store: Any, secret: JobSecret | None) -> None:
    """Publish that this job holds ``store``: its id, this host and this process."""
    record = {"job": job_id(secret), "host": socket.gethostname(), "pid": os.getpid()}
    store.set(OWNER, json.dumps(record | {"since": time.strftime("%H:%M:%S")}))


def host_store(
    addr: str, port: int, timeout: float, secret: JobSecret | None, world: int | None = None
) -> Any:
    """Host the job's store on ``addr``:``port`` (that address only), claimed for this job."""
    sock = listen(addr, port)
    store = dist.TCPStore(
        addr,
        port,
        world,
        True,
        timedelta(seconds=timeout),
        wait_for_workers=False,
        master_listen_fd=sock.detach(),
    )
    claim(store, secret)
    return store


def check_owner(store: Any, secret: JobSecret | None, where: str, timeout: float) -> None:
    """Raise :class:`ForeignJob` unless ``store`` is claimed by this process's job.

    Raises:
        TimeoutError: nobody claimed the store within ``timeout`` (its host never came).
    """
    try:
        store.wait([OWNER], timedelta(seconds=timeout))
    except dist.DistError:
        raise TimeoutError(
            f"the job's store at {where} was not set up within {timeout:g} s: is rank 0 (or the "
            "launcher that hosts it) running, and are the address and port right?"
        ) from None
    owner = json.loads(store.get(OWNER))
    if owner["job"] == job_id(secret):
        return
    port = where.rpartition(":")[2]
    raise ForeignJob(
        f"another towers job (job {owner['job']}, whose store is hosted by pid {owner['pid']} on "
        f"{owner['host']} since {owner['since']}) is using port {port}: the store at {where} "
        f"is not this process's job ({job_id(secret)}). Give this job another port (towers run "
        "--port, MASTER_PORT, or leave it unset for a free one); if it is the same job, give "
        "every process the same secret (TOWERS_SECRET or towers run --secret-file)"
    )


def client_store(
    addr: str, port: int, timeout: float, secret: JobSecret | None, world: int | None = None
) -> Any:
    """A client of the job's store at ``addr``:``port``, checked to be this job's first.

    Raises:
        ForeignJob: the store belongs to another job; nothing was written to it.
    """
    store = dist.TCPStore(addr, port, world, False, timedelta(seconds=timeout))
    check_owner(store, secret, f"{addr}:{port}", timeout)
    return store


def job_store(store: Any, secret: JobSecret | None) -> Any:
    """``store`` with this job's keys under the prefix its secret gives (none without one)."""
    return store if secret is None else dist.PrefixStore(secret.prefix, store)


def _seal(secret: JobSecret | None, name: str, value: str) -> str:
    if secret is None:
        return value
    return f"{secret.sign(b'store:' + name.encode(), value.encode()).hex()} {value}"


def put_signed(store: Any, secret: JobSecret | None, name: str, value: str) -> None:
    """Set ``name`` to ``value`` signed for that key (plain without a secret)."""
    store.set(name, _seal(secret, name, value))


def get_signed(store: Any, secret: JobSecret | None, name: str) -> str | None:
    """``name``'s value if it exists and was signed with ``secret`` for that key, else ``None``."""
    if not store.check([name]):
        return None
    raw = store.get(name).decode()
    if secret is None:
        return raw
    tag, _, value = raw.partition(" ")
    try:
        good = secret.verify(b"store:" + name.encode(), value.encode(), bytes.fromhex(tag))
    except ValueError:
        good = False
    return value if good else None


def read_signed(store: Any, secret: JobSecret | None, name: str, timeout: float) -> str:
    """Wait up to ``timeout`` for ``name`` to hold a value signed with ``secret``.

    A forged value is passed over (the job's own writer may still overwrite it).

    Raises:
        TimeoutError: nothing was written in time.
        ForgedRecord: only forged values were there.
    """
    deadline = time.monotonic() + timeout
    try:
        store.wait([name], timedelta(seconds=timeout))
    except dist.DistError:
        raise TimeoutError(f"{name} was not written within {timeout:g} s") from None
    while True:
        value = get_signed(store, secret, name)
        if value is not None:
            return value
        if time.monotonic() > deadline:
            raise ForgedRecord(
                f"the record {name} in the job's store is not signed with this job's secret: "
                "another process, which can reach the store's port, wrote it; it was refused. "
                "Keep the port out of others' reach (docs/reliability.md, threat model)"
            )
        time.sleep(_POLL)
