"""The own loop's checkpoints: what ``Context.save_checkpoint`` writes and ``load_checkpoint``
reads (kind ``loop``, :mod:`towers.engines.checkpoint`).

A checkpoint holds the model, optimizer and schedule state as the loop passes them, every rank's
RNG and gradient-transform state, the loop's ``extra``, and what the mode's step plan keeps
besides (DiLoCo: the outer parameters and optimizer, every rank's own parameters, inner
optimizer and inner steps not yet exchanged), so that a resumed loop continues exactly.
"""

from __future__ import annotations

import os
from typing import Any

from torch import nn

from ..engines import checkpoint
from ..engines.replica import Replica, cpu_state
from ..engines.sync.driver import SyncDriver
from ..engines.sync.plan import StepPlan

__all__ = ["load_loop", "save_loop"]


def save_loop(
    directory: str | os.PathLike[str],
    step: int,
    driver: SyncDriver,
    plan: StepPlan,
    replica: Replica,
    extra: dict[str, Any] | None,
) -> None:
    """Write the loop's state of ``step`` (a collective: every rank calls it; rank 0 writes)."""
    comm = driver.group.comm
    streams = driver.gather_streams()
    planned = plan.checkpoint(driver, replica)
    if comm.rank != 0:
        return
    assert replica.optimizer is not None
    payload = {
        "model": cpu_state(replica.model),
        "optimizer": replica.optimizer.state_dict(),
        "schedule": replica.schedule.state_dict() if replica.schedule is not None else None,
        **streams,
        "extra": extra or {},
    }
    if planned:  # the plan's own model (the outer one) beside the loop's
        payload["plan"] = planned
    checkpoint.save_or_warn(directory, step, "loop", payload)


def load_loop(
    directory: str | os.PathLike[str], driver: SyncDriver, plan: StepPlan, replica: Replica
) -> tuple[int, dict[str, Any]] | None:
    """Restore the newest loop checkpoint in ``directory`` into ``replica`` and the plan; its
    ``(step, extra)``, or ``None`` if there is none."""
    state = checkpoint.load_latest(directory, "loop")
    if state is None:
        return None
    model: nn.Module = replica.model
    model.load_state_dict(state["model"])
    if replica.optimizer is not None:
        replica.optimizer.load_state_dict(state["optimizer"])
    if replica.schedule is not None and state["schedule"] is not None:
        replica.schedule.load_state_dict(state["schedule"])
    driver.restore_streams(state)
    if "plan" in state:
        plan.restore(state["plan"], driver, replica)
    return state["step"], state["extra"]
