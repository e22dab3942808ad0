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

from ..comm.base import Comm
from ..engines import checkpoint
from ..engines.replica import Replica
from ..engines.shard_files import restore_parts, save_checkpoint, unreadable_parts
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
    together = not group.elastic and group.comm.world_size > 1  # a replacement takes a peer's
    below: int | None = None
    problems: tuple[str, ...] = ()
    while True:  # each rank checks the parts it will read; all pass over a damaged one together
        saved = checkpoint.load_latest(
            directory, "loop", also=("sync",), parts=not together, below=below, problems=problems
        )
        if not together:
            break
        _same_checkpoint(saved, directory, group.comm)
        if saved is None:
            break
        found = unreadable_parts(state.sharding, saved, os.fspath(directory), group.comm)
        if not found:
            break
        below, problems = saved["step"], (*problems, *found)
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


def _same_checkpoint(saved: dict[str, Any] | None, directory: Any, comm: Comm) -> None:
    """``RuntimeError`` on every rank unless every rank found the same newest checkpoint."""
    found = comm.all_gather_object(None if saved is None else saved["step"])
    if len(set(found)) > 1:
        seen = ", ".join(f"rank {r}: {s if s is not None else 'none'}" for r, s in enumerate(found))
        raise RuntimeError(
            f"the ranks found different newest checkpoints in {directory} ({seen}); every "
            "rank must resume from the same one: across hosts, checkpoint into a directory "
            "every host shares, with the same path on every rank"
        )
