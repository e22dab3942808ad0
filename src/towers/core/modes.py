"""Training modes: what a mode is, and the registry of modes by name.

A mode is an object (a frozen dataclass holding its argument) whose class says everything that
differs between modes: its name, what its argument means and its range, which engine trains
it, and what it asks of the worker count. A mode is a :class:`~towers.core.specs.Spec`, so
``"name:arg"`` is parsed, and refused with the valid modes listed, by :mod:`towers.core.specs`.
Only the pure part lives here; the classes of the modes themselves live with the engines
(:mod:`towers.engines.modes`), which add the engine-facing parts (the parameter server's
policy, what a computing tower sends back) and register each class with :func:`register`.
``str(mode)`` is the text the user wrote, normalised (``"ssp:2"``); checkpoints store it and
compare it.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import ClassVar, TypeVar

from .specs import Spec, add, parse

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
class Mode(Spec):
    """A training mode: one subclass per mode name, one instance per argument.

    Subclasses set the class attributes of a :class:`~towers.core.specs.Spec` (``name``,
    ``help``, ``meaning`` and ``minimum`` or ``fields``) and ``engine``, may override
    :meth:`check_workers`, and are registered by name with :func:`register`. A mode with more
    fields than ``arg`` declares the rest as dataclass fields after it, in order.
    """

    arg: int | None = None

    kind = "mode"
    keyword = "mode"
    valid = "valid modes are"
    engine: ClassVar[Engine]
    # whether any split of a global batch over the towers trains the same model (each step is
    # the global batch's gradient): what a balanced split needs to keep the result
    exact_under_any_split: ClassVar[bool] = False
    # whether every global batch is one reduction over all towers (the loops arm before backward)
    reduces_every_step: ClassVar[bool] = False

    @property
    def servers(self) -> int:
        """Processes besides the computing towers that this mode needs (the parameter server)."""
        return self.engine.servers

    def check_workers(self, workers: int) -> None:
        """``ValueError`` if this mode cannot train with ``workers`` computing towers."""


# name -> mode class, in the order the error messages and the help list them
MODES: dict[str, type[Mode]] = {}

M = TypeVar("M", bound=type[Mode])


def register(cls: M) -> M:
    """Make ``cls`` the mode of its ``name`` (a class decorator)."""
    return add(MODES, cls)


def parse_mode(mode: object) -> Mode:
    """``"ssp:3"`` -> the ``ssp`` mode with argument 3; ``ValueError`` listing the valid modes
    otherwise.

    Example::

        >>> str(parse_mode(" ssp:3 "))
        'ssp:3'
    """
    return parse(MODES, mode, Mode)
