"""What the members of an own loop agree on when an elastic job regroups.

The step driver (:class:`~towers.engines.sync.driver.SyncDriver`) asks its owner for the
state that the member who has done the most steps sends to the others; in the own loop that is
:class:`LoopState`: the steps done, what the mode's step plan keeps alike (``sync``: the model's
parameters and buffers and the optimizer's state, loaded into the user's optimizer at its next
step; DiLoCo: the outer parameters and outer optimizer) and the last step's result. A
replacement also learns how many of ``ctx.shards``' batches to skip to reach its peers. In a job
that never regroups it just counts the steps.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import torch
from torch import nn

from ..comm.hang import calling
from ..core.agree import BatchStamp
from ..core.step import StepResult
from ..engines.replica import Replica
from ..engines.sync.driver import SyncDriver
from ..engines.sync.group import Group
from ..engines.sync.plan import EveryStep, StepPlan

__all__ = ["LoopState"]


class LoopState:
    """The own loop's part of the state an elastic group keeps consistent (module doc)."""

    def __init__(self, joining: bool = False):
        self.steps = 0  # global batches completed
        self.model: nn.Module | None = None
        self.plan: StepPlan = EveryStep()  # what a step does: the mode's (ctx.replicate)
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

    def _replica(self) -> Replica:
        assert self.model is not None
        return Replica(self.model, self._optimizer)

    def progress(self) -> int:
        return -1 if self.newcomer else self.plan.progress(self.steps)

    def snapshot(self) -> dict[str, Any]:
        last = dataclasses.asdict(self.last) if self.last else None
        plan = self.plan.snapshot(self._replica())
        return {"steps": self.plan.progress(self.steps), "plan": plan, "last": last}

    def adopt(self, state: dict[str, Any]) -> None:
        self.plan.adopt(state["plan"], self._replica(), self.newcomer)
        if self._optimizer is None:  # the optimizer a peer's state holds, for the first step
            self._pending = state["plan"].get("optimizer")
        self.last = StepResult(**state["last"]) if state["last"] else None
        if self.newcomer:
            self.catch_up = state["steps"]
        self.newcomer = False
        self.steps = state["steps"]

    def regrouped(self) -> None:
        self.plan.regrouped(self._replica().model)

    def shared(self) -> nn.Module:
        return self.plan.shared(self._replica().model)

    def exchange(self, group: Group, driver: SyncDriver, final: bool) -> StepResult | None:
        """The exchange the plan owes after :attr:`steps` (``final``: the loop is over), redone
        until done; the last outer step's result, if any."""
        outer, plan, steps = None, self.plan, self.steps
        while plan.owes(steps, steps if final else None):
            calling(f"the outer step (step {steps})")
            comm = group.comm  # a new one after a regroup
            stamp = BatchStamp(comm.world_size).pack(comm.rank, steps, None, None)
            run = functools.partial(plan.exchange, driver, steps, final=final, stamp=stamp)
            outer = group.attempt(driver, run) or outer
        plan.results()  # the own loop keeps no record of each global batch's loss
        return outer

    def evaluated(self, model: nn.Module) -> nn.Module:
        """What evaluating ``model`` means: the replicated model is evaluated with the
        parameters every rank shares (DiLoCo: the outer ones)."""
        return self.plan.trained(model) if model is self.model else model
