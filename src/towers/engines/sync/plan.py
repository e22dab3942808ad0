"""What a synchronous mode does with each global batch: its step plan.

``towers.train``'s loop (:mod:`towers.engines.sync.loop`) and the own loop's ``Context`` hand
every global batch to their mode's plan, and ask it when the towers must communicate. The plan
steps through the one driver (:class:`~towers.engines.sync.driver.SyncDriver`); it never
stores a communicator. Two plans exist:

- :class:`EveryStep` (``sync``): every global batch is one step of the driver, reduced over all
  towers and applied at once;
- :class:`~towers.engines.sync.diloco.Periods` (``diloco:H``): each tower steps alone, and
  every H global batches the towers reduce their pseudo-gradients and take an outer step.

A loop asks, before each global batch, whether the plan :meth:`~StepPlan.owes` an exchange
(then it runs :meth:`~StepPlan.exchange`, on its own: in an elastic job it is the part that
may have to be redone), and otherwise trains the batch: it arms the driver before its last
backward if the plan :attr:`~StepPlan.reduces` every step, backpropagates its shard, and
hands the step to :meth:`~StepPlan.step` (the reduction and the update, or DiLoCo's inner
step). A step reads top to bottom in the loop that runs it::

    if plan.reduces:
        driver.arm()                 # before the last backward: buckets reduce as they fill
    driver.backward(loss, samples)   # (train: each micro-batch's; the own loop: the user's)
    result = plan.step(driver, optimizer, index)   # sync: driver.reduce(), driver.apply()
 The steps
whose results are known over all towers come out of :meth:`~StepPlan.results`, in order, with
the time each was trained at.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch
from torch import nn

from ...core.step import StepResult
from ...core.verdict import PendingResult
from ..replica import Replica
from ..shard import ShardedState
from .driver import SyncDriver

__all__ = ["EveryStep", "Landed", "StepPlan"]

# (global batch, its result over all towers, the run's seconds when trained; None: now)
Landed = tuple[int, StepResult, float | None]


class StepPlan(Protocol):
    """How a synchronous mode trains; see the module doc."""

    reduces: bool  # every step reduces gradients: the loop arms the driver before backward
    keeps_replicas: bool  # its checkpoint holds every rank's replica (they differ)

    def attach(self, model: nn.Module) -> Sequence[int]:
        """Take ``model`` (on its device, before the driver replicates it); returns where the
        driver's buckets must break (trainable-parameter indices)."""
        ...

    def shard(self, sharding: ShardedState) -> bool:
        """``shard_optimizer=True``, before :meth:`attach`: whether the plan shards its own
        optimizer's state with ``sharding`` (DiLoCo's outer one); ``False``: the user's
        optimizer is to be sharded."""
        ...

    def shared(self, model: nn.Module) -> nn.Module:
        """What every member holds alike (broadcast from rank 0 when the members change)."""
        ...

    def regrouped(self, model: nn.Module) -> None:
        """The members changed, or were formed: what they hold alike has been broadcast."""
        ...

    def step(
        self,
        driver: SyncDriver,
        optimizer: torch.optim.Optimizer | None,
        index: int,
        *,
        stamp: torch.Tensor | None = None,
        at: Callable[[], float] | None = None,
    ) -> StepResult:
        """Complete global batch ``index``, whose backward the loop has run (``at``: the run's
        clock); the step's result: over all towers for ``sync``, this tower's own for DiLoCo's
        inner steps. ``optimizer``: ``None`` leaves the averaged gradients in ``.grad``
        (``ctx.backward``; sync only)."""
        ...

    def owes(self, done: int, steps: int | None) -> bool:
        """Whether an exchange is due once ``done`` global batches are trained (``steps``: the
        run's total, ``None`` if unknown)."""
        ...

    def exchange(
        self, driver: SyncDriver, done: int, *, final: bool, stamp: torch.Tensor | None = None
    ) -> StepResult | None:
        """The exchange :meth:`owes` asked for (``final``: training ends after it); the outer
        step it applied, if any."""
        ...

    def results(self, wait: bool = False) -> list[Landed]:
        """The steps whose results over all towers arrived since the last call, in order
        (``wait``: all of them, waiting for those decided on a device,
        :mod:`towers.core.verdict`)."""
        ...

    def trained(self, model: nn.Module) -> nn.Module:
        """The module to evaluate and to return as the trained model."""
        ...

    def progress(self, done: int) -> int:
        """Global batches whose update every member has applied (elastic agreement)."""
        ...

    def snapshot(self, replica: Replica) -> Any:
        """What a member that is behind adopts (see :meth:`adopt`)."""
        ...

    def adopt(self, state: Any, replica: Replica, newcomer: bool) -> None: ...

    def checkpoint(self, driver: SyncDriver, replica: Replica) -> dict[str, Any]:
        """The plan's part of a checkpoint, saved as its ``plan`` (a collective: every rank
        calls it)."""
        ...

    def restore(self, state: dict[str, Any], driver: SyncDriver, replica: Replica) -> None:
        """Restore :meth:`checkpoint`'s part from the checkpoint ``state`` (its ``plan``, and
        its ``model``: what the members share), on every rank once the members are formed."""
        ...


class EveryStep:
    """``sync``: every global batch is one averaged step of the driver."""

    reduces = True
    keeps_replicas = False

    def __init__(self) -> None:
        self._landed: list[Landed] = []

    def attach(self, model: nn.Module) -> Sequence[int]:
        return ()

    def shard(self, sharding: ShardedState) -> bool:
        return False

    def shared(self, model: nn.Module) -> nn.Module:
        return model

    def regrouped(self, model: nn.Module) -> None:
        pass

    def step(
        self,
        driver: SyncDriver,
        optimizer: torch.optim.Optimizer | None,
        index: int,
        *,
        stamp: torch.Tensor | None = None,
        at: Callable[[], float] | None = None,
    ) -> StepResult:
        result = driver.reduce(stamp)
        if optimizer is not None:
            driver.apply(result, optimizer)
        self._landed.append((index, result, None))
        return result

    def owes(self, done: int, steps: int | None) -> bool:
        return False

    def exchange(
        self, driver: SyncDriver, done: int, *, final: bool, stamp: torch.Tensor | None = None
    ) -> StepResult | None:
        raise AssertionError("a synchronous step exchanges within the step")

    def results(self, wait: bool = False) -> list[Landed]:
        landed, n = self._landed, len(self._landed)
        if not wait and landed and isinstance(landed[-1][1], PendingResult):
            # A step decided on the device lands at the next one, read or not, on every rank
            # and device alike: the balanced split that follows it must be the same everywhere.
            n -= 1
        landed, self._landed = landed[:n], landed[n:]
        return landed

    def trained(self, model: nn.Module) -> nn.Module:
        return model

    def progress(self, done: int) -> int:
        return done

    def snapshot(self, replica: Replica) -> Any:
        return replica.state_dict()

    def adopt(self, state: Any, replica: Replica, newcomer: bool) -> None:
        replica.load_state_dict(state)

    def checkpoint(self, driver: SyncDriver, replica: Replica) -> dict[str, Any]:
        return {}

    def restore(self, state: dict[str, Any], driver: SyncDriver, replica: Replica) -> None:
        pass
