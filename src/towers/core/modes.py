"""Training modes: what a mode is, the registry of modes by name, and parsing ``"name:arg"``.

A mode is an object (a frozen dataclass holding its argument) whose class says everything that
differs between modes: its name, what its argument means and its least value, which engine
trains it, and what it asks of the worker count. Only the pure part lives here; the classes of
the modes themselves live with the engines (:mod:`towers.engines.modes`), which add the
engine-facing parts (the parameter server's policy, what a computing tower sends back) and
register each class with :func:`register`. ``str(mode)`` is the text the user wrote, normalised
(``"ssp:2"``); checkpoints store it and compare it.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import ClassVar, TypeVar

__all__ = ["MODES", "Engine", "Mode", "parse_mode", "register"]


class Engine(enum.Enum):
    """Which engine trains a mode; the value is the kind of checkpoint that engine writes."""

    SYNC = "sync"  # every tower computes, the towers all-reduce (engines/sync)
    SERVER = "ps"  # a parameter server, rank 0, one process besides the towers (engines/ps)

    @property
    def servers(self) -> int:
        """Processes the engine runs besides the computing towers."""
        return 1 if self is Engine.SERVER else 0


@dataclass(frozen=True)
class Mode:
    """A training mode: one subclass per mode name, one instance per argument.

    Subclasses set the class attributes and may override :meth:`check_workers`; they are
    registered by name with :func:`register`.
    """

    arg: int | None = None

    name: ClassVar[str]
    meaning: ClassVar[str | None] = None  # what the argument means; None: takes no argument
    minimum: ClassVar[int] = 0  # the argument's least value
    engine: ClassVar[Engine]

    def __str__(self) -> str:
        return self.name if self.arg is None else f"{self.name}:{self.arg}"

    @property
    def servers(self) -> int:
        """Processes besides the computing towers that this mode needs (the parameter server)."""
        return self.engine.servers

    def check_workers(self, workers: int) -> None:
        """``ValueError`` if this mode cannot train with ``workers`` computing towers."""

    @classmethod
    def parse(cls, mode: str, arg: str | None) -> Mode:
        """The mode ``mode`` names, given the text after its name's colon (``None``: no colon).

        The default reads one integer of at least :attr:`minimum`; a mode with options of its
        own overrides this (and ``__str__``, which must give back what this parses).
        """
        name = cls.name
        if cls.meaning is None:
            if arg is not None:
                raise ValueError(f"mode {name!r} takes no argument, got {mode!r}")
            return cls()
        try:
            value = int(arg or "")
        except ValueError:
            raise ValueError(
                f"mode {name!r} needs an integer argument {cls.meaning}; got {mode!r}"
            ) from None
        if value < cls.minimum:
            raise ValueError(f"mode {name!r} needs {cls.meaning}; got {mode!r}")
        return cls(value)


# name -> mode class, in the order the error messages list them
MODES: dict[str, type[Mode]] = {}

M = TypeVar("M", bound=type[Mode])


def register(cls: M) -> M:
    """Make ``cls`` the mode of its ``name`` (a class decorator)."""
    if cls.name in MODES and MODES[cls.name] is not cls:
        raise ValueError(f"mode {cls.name!r} is registered twice: {MODES[cls.name]} and {cls}")
    MODES[cls.name] = cls
    return cls


def _valid() -> str:
    return ", ".join(
        f'"{n}:{c.meaning.split(",")[0]}"' if c.meaning else f'"{n}"' for n, c in MODES.items()
    )


def parse_mode(mode: str) -> Mode:
    """``"ssp:3"`` -> the ``ssp`` mode with argument 3; ``ValueError`` listing the valid modes
    otherwise.

    Example::

        >>> str(parse_mode(" ssp:3 "))
        'ssp:3'
    """
    if not isinstance(mode, str):
        raise TypeError(f"mode must be a string such as 'sync', got {type(mode).__name__}")
    name, sep, arg = mode.strip().partition(":")
    cls = MODES.get(name)
    if cls is None:
        raise ValueError(f"unknown mode {mode!r}; valid modes are {_valid()}")
    return cls.parse(mode.strip(), arg if sep else None)
