"""The own loop's checkpoints: what ``Context.save_checkpoint`` writes and ``load_checkpoint``
reads (kind ``loop``, :mod:`towers.engines.checkpoint`).

A checkpoint holds what ``towers.train``'s do, in the same layout
(:meth:`~towers.engines.sync.state.RunState.checkpoint`): the model the members share, the
replica (model, optimizer and schedule state as the loop passes them), every rank's RNG and
gradient-transform state, what the mode's step plan keeps besides (DiLoCo: the outer
optimizer, every rank's own parameters, inner optimizer and inner steps not yet exchanged),
the mode, and the loop's ``extra``, so that a resumed loop continues exactly.

A loop also resumes a checkpoint of ``towers.train`` in a synchronous mode: the same state,
after the steps it counts (its ``extra`` is empty; its record of losses and its place in its
own data order are ``train``'s, which a loop that brings its own batches does not use).
"""

from __future__ import annotations

import os
from typing import Any

from ..engines import checkpoint
from ..engines.replica import Replica
from ..engines.shard_files import load_agreed, restore_parts, save_checkpoint
from ..engines.sync.driver import SyncDriver
from ..engines.sync.state import RunState

__all__ = ["load_loop", "save_loop"]


def save_loop(
    directory: str | os.PathLike[str],
    step: int,
    driver: SyncDriver,
    state: RunState,
    replica: Replica,
    extra: dict[str, Any] | None,
) -> None:
    """Write the loop's state of ``step`` (a collective: every rank calls it; rank 0 writes)."""
    payload = {**state.checkpoint(driver, replica), "mode": driver.mode, "extra": extra or {}}
    save_checkpoint(
        os.fspath(directory), step, "loop", payload, driver.group.comm, state.sharding,
        replica.optimizer,
    )  # fmt: skip


def load_loop(
    directory: str | os.PathLike[str], driver: SyncDriver, state: RunState, replica: Replica
) -> tuple[int, dict[str, Any]] | None:
    """Restore the newest loop checkpoint in ``directory`` into ``replica`` and the run's
    state; its ``(step, extra)``, or ``None`` if there is none."""
    group = driver.group
    if not group.elastic and group.comm.world_size > 1:  # a replacement takes a peer's
        saved = load_agreed(os.fspath(directory), "loop", ("sync",), state.sharding, group.comm)
    else:
        saved = checkpoint.load_latest(directory, "loop", also=("sync",))
    if saved is None:
        return None
    mode = saved.get("mode", driver.mode)  # an own loop's of version 3 or before: unsaid
    if mode != driver.mode:
        raise ValueError(
            f"the checkpoint in {directory} is of a {mode!r} run, this loop replicates its "
            f"model in mode {driver.mode!r}; pass mode={mode!r} to ctx.replicate, or use another "
            "checkpoint directory"
        )
    state.restore(saved, driver, replica)
    restore_parts(state.sharding, replica.optimizer, saved, os.fspath(directory))
    return saved["step"], saved.get("extra", {})
