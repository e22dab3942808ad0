"""Checks of arguments shared by every entry point (``train``, ``init``, ``spawn``)."""

from __future__ import annotations

import math
from typing import Any

__all__ = ["MAX_TIMEOUT", "check_timeout", "nnodes_of", "node_timeout_of"]

# torch.distributed keeps a timeout in nanoseconds in 64 bits, and Python's threads accept waits
# up to threading.TIMEOUT_MAX: both end near 9.2e9 s, and 1e10 overflows inside a worker.
MAX_TIMEOUT = 1e9  # seconds, about 31 years


def check_timeout(value: Any, name: str = "timeout") -> float | None:
    """``value`` as seconds (``None`` stays ``None``: the default applies).

    A timeout bounds every wait for a peer, so it must be a finite number of seconds above 0
    and at most :data:`MAX_TIMEOUT`: ``"10"`` is a ``TypeError``, ``0``, ``-5``, ``nan``,
    ``inf`` and ``1e15`` are ``ValueError`` s.
    """
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a number of seconds, got {type(value).__name__} {value!r}")
    accepted = f"the accepted range is 0 < {name} <= {MAX_TIMEOUT:g}"
    if not math.isfinite(value) or value <= 0:
        raise ValueError(
            f"{name} must be a finite number of seconds > 0, got {value!r}; {accepted}. For a "
            "long wait give a large number, e.g. 3600"
        )
    if value > MAX_TIMEOUT:
        raise ValueError(
            f"{name} must be at most {MAX_TIMEOUT:g} seconds (about 31 years), got {value:g}; "
            f"{accepted}: larger ones overflow the clocks of torch.distributed and of Python's "
            f"threads. For a wait with no practical limit give {MAX_TIMEOUT:g}"
        )
    return float(value)


def nnodes_of(spec: str) -> tuple[int, int]:
    """``--nnodes`` as torchrun spells it: ``"M"`` (M hosts, from start to end) or ``"MIN:MAX"``
    (the job starts with hosts 0..MIN-1 and lets in up to MAX - MIN more while it runs).

    Raises:
        ValueError: the spec is not ``M`` or ``MIN:MAX`` with 1 <= MIN <= MAX.
    """
    parts = str(spec).strip().split(":")
    try:
        if len(parts) > 2:
            raise ValueError
        least, most = int(parts[0]), int(parts[-1])
    except ValueError:
        raise ValueError(
            f"--nnodes takes M or MIN:MAX (whole numbers, as torchrun), got {spec!r}"
        ) from None
    if least < 1:
        raise ValueError(f"--nnodes {spec}: MIN must be >= 1 (the hosts the job starts with)")
    if least > most:
        raise ValueError(
            f"--nnodes {spec}: MIN ({least}) is above MAX ({most}); the job starts with MIN "
            "hosts and grows up to MAX"
        )
    return least, most


def node_timeout_of(timeout: float, given: float | None = None) -> float:
    """Seconds of silence after which node 0 drops a node: ``given``, else ``timeout / 4``.

    It must stay below the job's timeout: across a partition the other nodes' workers wait in
    a sum with the silent node's for up to the timeout, and the node cut off stops itself after
    it; dropping the silent node first lets them go on. A quarter (15 s for the default 60 s,
    as torchrun's rendezvous keep-alive: 3 missed beats of 5 s) leaves a starved or briefly
    stopped launcher seconds to spare.

    Raises:
        ValueError: ``given`` is not a positive number of seconds below ``timeout``.
    """
    if given is None:
        return timeout / 4
    if isinstance(given, bool) or not isinstance(given, (int, float)):
        raise ValueError(f"--node-timeout must be a number of seconds, got {given!r}")
    if not 0 < given < timeout:
        raise ValueError(
            f"--node-timeout must be above 0 and below --timeout ({timeout:g} s), got {given:g}: "
            "a node silent that long is dropped, and the other nodes' workers must not time out "
            f"waiting for it first (default: a quarter of --timeout, {timeout / 4:g} s)"
        )
    return float(given)
