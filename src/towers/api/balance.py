"""``balance=``: whether each global batch is split in proportion to the towers' speeds.

A balanced split keeps the sync guarantee (parameters equal to one process to float
tolerance) whenever a tower's loss over its shard is the mean of per-sample losses: the
averaged gradient is then the whole batch's for any split (:mod:`towers.core.balance`). By
default it is on exactly when that holds for the job at hand, and where it does not, one line
at the start says why and the split stays even:

- BatchNorm without ``sync_batchnorm``: each tower normalises over its own shard, so the
  shard sizes change the result;
- a ``collate_fn``: it may pad or pack the samples of the shard it is given;
- GPU workers on a torch without CUDA events: their time on the host measures how fast
  kernels are queued, not how fast the GPU runs them (with events they are timed on the GPU);
- DiLoCo's modes: each tower steps alone on its shard;
- a gradient transform (``compress=``): it reduces each tower's own values.

``balance=True`` balances even then (after the same line, as a warning); ``False`` keeps the
even split, whose results are also reproducible bit for bit from run to run (a balanced split
follows timings, so its float rounding does not repeat exactly).
"""

from __future__ import annotations

import sys
import warnings
from typing import Any

from torch import nn

from ..core.compat import uneven_split_refusal
from ..core.devices import KINDS
from ..core.modes import Engine, Mode

__all__ = ["COLLATE_FN", "check_balance", "choose_balance", "unbalanced_because"]

# why a collate_fn keeps the split even (towers.train's, and a Lightning training loader's)
COLLATE_FN = (
    "a collate_fn may pad or pack the samples of the shard it is given, so the shard sizes "
    "could change the result (pass balance=True if yours treats every sample alone)"
)


def unbalanced_because(
    model: nn.Module,
    sync_batchnorm: bool,
    collate_fn: Any,
    device: str,
    mode: Mode | None = None,
    transform: Any = None,
) -> str | None:
    """Why an uneven split could change this job's result, or ``None`` if it cannot
    (``device``: the workers' kind, ``"cpu"`` or ``"cuda"``)."""
    why = None if mode is None else uneven_split_refusal(mode)
    if why is not None:
        return why
    if transform is not None:
        return (
            "a gradient transform (compress=, transform=) reduces each tower's own values (an "
            "error-feedback residual, a quantisation), so the split changes the result"
        )
    norms = [m for m in model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
    if norms and not sync_batchnorm:
        return (
            f"the model's {len(norms)} BatchNorm layer(s) normalise over each tower's shard, so "
            "the shard sizes change the result (sync_batchnorm=True normalises over the global "
            "batch and allows it)"
        )
    if collate_fn is not None:
        return COLLATE_FN
    return KINDS[device].untimed


def check_balance(balance: Any) -> None:
    """``TypeError`` unless ``balance`` is ``True``, ``False`` or ``None``."""
    if balance is not None and not isinstance(balance, bool):
        raise TypeError(
            f"balance must be True, False or None (on where it keeps results exact), got "
            f"{balance!r}"
        )


def choose_balance(
    balance: Any, mode: Mode | None, towers: int, because: str | None, where: str, rank: int
) -> bool:
    """The ``balance=`` a job runs with (see the module doc); ``where`` names the call.

    Raises:
        TypeError: ``balance`` is not ``True``, ``False`` or ``None``.
        ValueError: ``balance=True`` with an asynchronous mode.
    """
    check_balance(balance)
    if mode is not None and mode.engine is not Engine.SYNC:
        if balance:
            raise ValueError(
                f"balance=True splits the global batch of a synchronous step; mode "
                f"{str(mode)!r} never waits for a slow tower (the server hands out shards as "
                "towers ask for them): drop balance=True"
            )
        return False
    if balance is False or towers < 2:
        return False
    if because is not None:
        line = f"{where}: balance {'on' if balance else 'off'}: {because}"
        if balance:
            warnings.warn(line, RuntimeWarning, stacklevel=4)
        elif rank == 0:
            print(line, file=sys.stderr, flush=True)
        return bool(balance)
    return True
