"""What the synchronous engine needs from a mode: its step plan, and the options it refuses.

A mode the synchronous engine trains (:class:`SyncMode`; the modes themselves are in
:mod:`towers.engines.modes`) gives the loop and the own loop's ``Context`` its step plan
(:mod:`towers.engines.sync.plan`): ``sync`` steps every global batch over all towers, ``diloco``
in periods of inner steps and outer steps. Neither loop looks at the mode again.
"""

from __future__ import annotations

from typing import Any, ClassVar

from torch import nn

from ...core.modes import Engine, Mode
from ..job import OptimizerFactory
from ..transforms import GradientTransform
from .plan import EveryStep, StepPlan

__all__ = ["SyncMode", "plan_for"]


class SyncMode(Mode):
    """A mode the synchronous engine trains: every tower computes, the towers all-reduce."""

    engine = Engine.SYNC
    # whether the mode has outer steps, and so takes outer_optimizer=
    outer_steps: ClassVar[bool] = False
    # whether the towers' BatchNorm statistics are averaged by the mode itself (then nothing
    # warns that they differ between towers)
    averages_buffers: ClassVar[bool] = False

    def plan(self, outer_optimizer: OptimizerFactory | None = None) -> StepPlan:
        """A fresh step plan for one rank."""
        return EveryStep()

    def transform(self) -> GradientTransform | None:
        """The reduction the mode itself sends its sums through (SparseLoCo's top-k), which
        ``compress=`` and ``transform=`` may not replace; ``None``: theirs, or the plain sum."""
        return None

    def check_options(self, model: nn.Module, *, sync_batchnorm: bool, elastic: bool) -> None:
        """``ValueError`` for a model or options this mode cannot serve (checked before any
        worker starts)."""

    def check_sharding(self, transform: GradientTransform | None) -> None:
        """``ValueError`` if ``shard_optimizer=True`` cannot serve this mode with ``transform``
        (its sums; ``None``: the plain sum)."""

    def check_resumable(self, state: dict[str, Any], workers: int) -> None:
        """``ValueError`` if a checkpoint of this mode cannot go on with ``workers`` towers."""


def plan_for(mode: Mode, outer_optimizer: OptimizerFactory | None = None) -> StepPlan:
    """``mode``'s step plan (a synchronous mode that is not a :class:`SyncMode`: every batch)."""
    if isinstance(mode, SyncMode):
        return mode.plan(outer_optimizer)
    assert mode.engine is Engine.SYNC, f"mode {mode} is not trained by the synchronous engine"
    return EveryStep()
