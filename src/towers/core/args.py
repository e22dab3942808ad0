"""Checks of arguments shared by every entry point (``train``, ``init``, ``spawn``)."""

from __future__ import annotations

import math
from typing import Any

__all__ = ["check_timeout"]


def check_timeout(value: Any, name: str = "timeout") -> float | None:
    """``value`` as seconds (``None`` stays ``None``: the default applies).

    A timeout bounds every wait for a peer, so it must be a finite number of seconds above 0:
    ``"10"`` is a ``TypeError``, ``0``, ``-5``, ``nan`` and ``inf`` are ``ValueError`` s.
    """
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a number of seconds, got {type(value).__name__} {value!r}")
    if not math.isfinite(value) or value <= 0:
        raise ValueError(
            f"{name} must be a finite number of seconds > 0, got {value!r}; for a long wait "
            "give a large number, e.g. 3600"
        )
    return float(value)
