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
    def devices(self) -> tuple[str, ...]:
        """The devices whose tensors it moves (``auto``: whatever the job computes on)."""
        return _DECLARED[self][0]

    @property
    def elastic(self) -> bool:
        """Whether an elastic job can regroup over it after a lost member (``auto``: it picks
        one that can)."""
        return _DECLARED[self][1]

    @property
    def backend(self) -> bool:
        """Whether it is a process group's backend (``init(backend=...)`` names it)."""
        return _DECLARED[self][2]

    @property
    def title(self) -> str:
        """Its name in a sentence."""
        return _DECLARED[self][3]

    @property
    def cpu(self) -> bool:
        """Whether it moves CPU tensors only (Gloo, shared memory)."""
        return self.devices == ("cpu",)

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


# what each transport declares: its devices, elastic, a process group's backend, its title
_DECLARED: dict[Transport, tuple[tuple[str, ...], bool, bool, str]] = {
    Transport.AUTO: (("cpu", "cuda"), True, False, "the transport that applies"),
    Transport.SHM: (("cpu",), True, False, "shared memory"),
    Transport.GLOO: (("cpu",), True, True, "Gloo"),
    Transport.NCCL: (("cuda",), False, True, "NCCL"),
}
