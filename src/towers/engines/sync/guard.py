"""The optimizer's step under a step decided on the device: skipped there, not on the host.

A step that :func:`towers.core.verdict.decide` decided leaves the summed (and divided)
gradients in ``.grad`` whatever they hold, and its ``ok`` on the device. Whoever steps the
optimizer next, towers' loop or a script's own ``optimizer.step()`` after ``ctx.backward`` or
``loss.backward()``, goes through torch's global step hooks, where :class:`StepGuard` makes the
step a no-op when ``ok`` is false:

- torch's fused optimizers (``fused=True``: Adam, AdamW, SGD, Adagrad) take the flag as
  ``found_inf``, as a ``GradScaler`` hands it to them: their kernels skip the update and undo the
  step count on the device. The host never waits.
- any other optimizer, and a fused one whose state is still empty (a skipped first step would
  leave state behind), has the flag read on the host before it steps: a skipped step then
  clears every ``.grad`` first, so that the step changes nothing, as in the eager path.

Each decision guards one optimizer step (the next one after it over these parameters).
"""

from __future__ import annotations

from typing import Any

import torch
from torch.optim.optimizer import (
    register_optimizer_step_post_hook,
    register_optimizer_step_pre_hook,
)

from ...core.verdict import PendingResult

__all__ = ["StepGuard", "takes_found_inf"]


def takes_found_inf(optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``optimizer`` skips on a device flag with nothing left behind: a torch optimizer
    that supports a ``GradScaler``'s ``found_inf``, fused, with its state already built."""
    if not getattr(optimizer, "_step_supports_amp_scaling", False):
        return False
    if not all(g.get("fused") for g in optimizer.param_groups):
        return False
    params = [p for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
    return bool(params) and all(p in optimizer.state for p in params)


class StepGuard:
    """Guards the next optimizer step over ``params`` with a pending step's ``ok``."""

    def __init__(self, params: list[torch.Tensor]):
        self.params = params
        self._ids = {id(p) for p in params}
        self.pending: PendingResult | None = None
        self._handles: list[Any] = []
        self._armed: torch.optim.Optimizer | None = None

    def start(self) -> StepGuard:
        if not self._handles:
            self._handles = [
                register_optimizer_step_pre_hook(self._before),
                register_optimizer_step_post_hook(self._after),
            ]
        return self

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles, self.pending = [], None

    def guard(self, result: PendingResult) -> None:
        """The next optimizer step over these parameters is ``result``'s."""
        self.pending = result

    def _ours(self, optimizer: torch.optim.Optimizer) -> bool:
        return any(id(p) in self._ids for g in optimizer.param_groups for p in g["params"])

    def _before(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        pending = self.pending
        if pending is None or not self._ours(optimizer):
            return
        self.pending = None
        if not pending.resolved() and takes_found_inf(optimizer):
            optimizer.found_inf = (~pending.ok).float()  # type: ignore[attr-defined]
            optimizer.grad_scale = None  # type: ignore[attr-defined]
            self._armed = optimizer
        elif pending.skipped:  # read on the host: nothing to step
            for p in self.params:
                p.grad = None

    def _after(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if self._armed is optimizer:
            del optimizer.found_inf, optimizer.grad_scale  # type: ignore[attr-defined]
            self._armed = None
