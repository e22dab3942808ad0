"""Training modes: parsing ``"sync"``, ``"async"``, ``"ssp:S"``, ``"local:K"``, ``"backup:B"``."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["MODES", "Mode", "parse_mode"]

# name -> what its argument means (None: takes no argument)
MODES: dict[str, str | None] = {
    "sync": None,
    "async": None,
    "ssp": "S, the most updates a worker may run ahead of the slowest (>= 0)",
    "local": "K, the steps between parameter averages (>= 1)",
    "backup": "B, the late shards dropped per step (>= 1, fewer than workers)",
}
_MIN_ARG = {"ssp": 0, "local": 1, "backup": 1}


def _valid() -> str:
    return ", ".join(f'"{n}:{a.split(",")[0]}"' if a else f'"{n}"' for n, a in MODES.items())


@dataclass(frozen=True)
class Mode:
    name: str
    arg: int | None = None

    def __str__(self) -> str:
        return self.name if self.arg is None else f"{self.name}:{self.arg}"


def parse_mode(mode: str) -> Mode:
    """``"ssp:3"`` -> ``Mode("ssp", 3)``; ``ValueError`` listing the valid modes otherwise."""
    if not isinstance(mode, str):
        raise TypeError(f"mode must be a string such as 'sync', got {type(mode).__name__}")
    name, sep, arg = mode.strip().partition(":")
    if name not in MODES:
        raise ValueError(f"unknown mode {mode!r}; valid modes are {_valid()}")
    if MODES[name] is None:
        if sep:
            raise ValueError(f"mode {name!r} takes no argument, got {mode!r}")
        return Mode(name)
    try:
        value = int(arg)
    except ValueError:
        raise ValueError(
            f"mode {name!r} needs an integer argument {MODES[name]}; got {mode!r}"
        ) from None
    if value < _MIN_ARG[name]:
        raise ValueError(f"mode {name!r} needs {MODES[name]}; got {mode!r}")
    return Mode(name, value)
