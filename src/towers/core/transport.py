"""The transports a job may ask for: each declares what it supports, and is registered by name.

``transport=`` (``towers.train``, ``towers.init``) and ``TOWERS_TRANSPORT`` are text; the API
turns them into a registered :class:`Transport` with :meth:`Transport.parse`, and every layer
below compares the registered objects, so a misspelt name is refused where the user wrote it,
with the valid ones listed, and never silently compares unequal deeper down.

A transport is a declaration here (what it moves and where it can serve, read by
:mod:`towers.core.compat` and :mod:`towers.core.devices` to allow or refuse a job) and a
builder in the comm layer (:mod:`towers.comm.transports`, which registers both with one call).
Four are built in: ``auto``, ``shm``, ``gloo`` and ``nccl``.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import ClassVar

__all__ = ["TRANSPORTS", "Transport", "declare"]


@dataclass(frozen=True, eq=False)
class Transport:
    """How the towers' sums travel; one registered object per name (compared with ``is``).

    Args:
        name: what ``transport=`` spells.
        title: its name in a sentence (``"shared memory"``).
        devices: the devices whose tensors it moves (``auto``: whatever the job computes on).
        elastic: an elastic job can regroup over it after a lost member.
        backend: it is a process group's backend (``init(backend=...)`` names it).
        one_host: it joins only ranks on one host (shared memory).
        help: one line for the command's help.
        module: the module that registers it, imported to find it in another process (a
            transport travels to the workers by name, as an enum member would).
    """

    name: str
    title: str
    devices: tuple[str, ...]
    elastic: bool = False
    backend: bool = False
    one_host: bool = False
    help: str = ""
    module: str = __name__

    AUTO: ClassVar[Transport]  # shared memory where it applies, two levels across hosts, ...
    SHM: ClassVar[Transport]  # shared memory: every rank on this host, CPU tensors
    GLOO: ClassVar[Transport]  # the process group, on Gloo (CPU tensors)
    NCCL: ClassVar[Transport]  # the process group, on NCCL (GPU tensors)

    def __str__(self) -> str:
        return self.name

    def __repr__(self) -> str:
        return f"<Transport {self.name!r}>"

    def __reduce__(self) -> tuple[object, tuple[str, str]]:
        return _registered, (self.name, self.module)

    @property
    def cpu(self) -> bool:
        """Whether it moves CPU tensors only (Gloo, shared memory)."""
        return self.devices == ("cpu",)

    @classmethod
    def parse(cls, given: Transport | str | None, launched: str | None = None) -> Transport:
        """``given``, else ``launched`` (``TOWERS_TRANSPORT``), else :attr:`AUTO`.

        A registered transport is returned as it is, so a value already parsed can pass through
        again.

        Raises:
            ValueError: a name that is not a registered transport's, with the valid ones listed.

        Example::

            >>> Transport.parse(None, "shm")
            <Transport 'shm'>
        """
        if given is None:
            given = launched or cls.AUTO
        if isinstance(given, Transport):
            return given
        found = TRANSPORTS.get(given) if isinstance(given, str) else None
        if found is None:
            valid = ", ".join(TRANSPORTS)
            raise ValueError(f"transport must be one of {valid}; got {given!r}")
        return found

    @classmethod
    def registered(cls) -> list[Transport]:
        """Every transport, in the order of registration (``auto`` first)."""
        return list(TRANSPORTS.values())


TRANSPORTS: dict[str, Transport] = {}


def declare(transport: Transport) -> Transport:
    """Register ``transport``'s declaration under its name (its builder is registered beside it,
    :func:`towers.comm.transports.register`); a name taken by another is refused."""
    taken = TRANSPORTS.get(transport.name)
    if taken is not None and taken != transport:
        raise ValueError(f"transport {transport.name!r} is registered already")
    TRANSPORTS[transport.name] = transport
    return transport


def _registered(name: str, module: str) -> Transport:
    """The transport registered as ``name``, importing ``module`` (which registers it) if this
    process has not yet."""
    if name not in TRANSPORTS:
        importlib.import_module(module)
    return TRANSPORTS[name]


Transport.AUTO = declare(
    Transport(
        "auto", "the transport that applies", ("cpu", "cuda"), elastic=True,
        help="shared memory on one host, two levels across hosts, else the process group",
    )
)  # fmt: skip
Transport.SHM = declare(
    Transport(
        "shm", "shared memory", ("cpu",), elastic=True, one_host=True,
        help="sums in shared memory between the CPU workers of one host",
    )
)  # fmt: skip
Transport.GLOO = declare(
    Transport(
        "gloo", "Gloo", ("cpu",), elastic=True, backend=True,
        help="the process group on Gloo: CPU tensors, any hosts",
    )
)  # fmt: skip
Transport.NCCL = declare(
    Transport(
        "nccl", "NCCL", ("cuda",), backend=True, help="the process group on NCCL: GPU tensors"
    )
)
