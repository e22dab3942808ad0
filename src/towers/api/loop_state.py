"""What the members of an own loop agree on when an elastic job regroups.

The step driver (:class:`~towers.engines.sync.driver.SyncDriver`) asks its owner for the
state that the member who has done the most steps sends to the others; in the own loop that is
:class:`LoopState`: the steps done, the model's parameters and buffers, the optimizer's state
(loaded into the user's optimizer at its next step) and the last step's result. A replacement
also learns how many of ``ctx.shards``' batches to skip to reach its peers. In a job that never
regroups it just counts the steps.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch import nn

from ..core.step import StepResult

__all__ = ["LoopState"]


class LoopState:
    """The own loop's part of the state an elastic group keeps consistent (module doc)."""

    def __init__(self, joining: bool = False):
        self.steps = 0  # global batches completed
        self.model: nn.Module | None = None
        self.newcomer = joining  # a replacement: nothing until a peer sends it the state
        self.catch_up = 0  # batches a replacement skips to reach its peers
        self.redo = False  # the last step must be trained again
        self.last: StepResult | None = None
        self._optimizer: torch.optim.Optimizer | None = None
        self._pending: dict[str, Any] | None = None  # a peer's optimizer state, not loaded yet

    def optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """The loop's optimizer: remember it, and give it a peer's state if one arrived."""
        self._optimizer = optimizer
        if self._pending is not None:
            optimizer.load_state_dict(self._pending)
            self._pending = None

    def progress(self) -> int:
        return -1 if self.newcomer else self.steps

    def snapshot(self) -> dict[str, Any]:
        assert self.model is not None
        opt = self._optimizer.state_dict() if self._optimizer is not None else None
        last = dataclasses.asdict(self.last) if self.last else None
        return {"steps": self.steps, "model": self.model.state_dict(), "opt": opt, "last": last}

    def adopt(self, state: dict[str, Any]) -> None:
        assert self.model is not None
        self.model.load_state_dict(state["model"])
        self._pending = state["opt"]
        self.last = StepResult(**state["last"]) if state["last"] else None
        if self.newcomer:
            self.catch_up = state["steps"]
        self.newcomer = False
        self.steps = state["steps"]

    def regrouped(self) -> None:
        pass
