"""The transports a job may ask for, parsed once into :class:`Transport`.

``transport=`` (``towers.train``, ``towers.init``) and ``TOWERS_TRANSPORT`` are text; the API
turns them into a member of :class:`Transport` with :meth:`Transport.parse`, and every layer
below compares members, so a misspelt name is refused where the user wrote it, with the valid
ones listed, and never silently compares unequal deeper down.
"""

from __future__ import annotations

import enum

__all__ = ["Transport"]


class Transport(enum.Enum):
    """How the towers' sums travel; the value is what ``transport=`` spells."""

    AUTO = "auto"  # shared memory where it applies, two levels across hosts, else the group
    SHM = "shm"  # shared memory: every rank on this host, CPU tensors
    GLOO = "gloo"  # the process group, on Gloo (CPU tensors)
    NCCL = "nccl"  # the process group, on NCCL (GPU tensors)

    def __str__(self) -> str:
        return self.value

    @property
    def cpu(self) -> bool:
        """Whether it moves CPU tensors only (Gloo, shared memory)."""
        return self in (Transport.GLOO, Transport.SHM)

    @classmethod
    def parse(cls, given: Transport | str | None, launched: str | None = None) -> Transport:
        """``given``, else ``launched`` (``TOWERS_TRANSPORT``), else :attr:`AUTO`.

        A member is returned as it is, so a value already parsed can pass through again.

        Raises:
            ValueError: a name that is not a transport's, with the valid ones listed.

        Example::

            >>> Transport.parse(None, "shm")
            <Transport.SHM: 'shm'>
        """
        if given is None:
            given = launched or cls.AUTO
        if isinstance(given, Transport):
            return given
        try:
            return cls(given)
        except ValueError:
            valid = ", ".join(t.value for t in cls)
            raise ValueError(f"transport must be one of {valid}; got {given!r}") from None
