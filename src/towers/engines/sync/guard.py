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

A decision guards every optimizer step over these parameters until the next step is
decided: a model whose parameters two optimizers share between them skips both. A
``GradScaler`` that steps a fused optimizer hands it its own ``found_inf``; the decision is
added to it.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.optim.optimizer import (
    register_optimizer_step_post_hook,
    register_optimizer_step_pre_hook,
)

from ...core.step import StepResult
from ...core.verdict import PendingResult, known

__all__ = ["StepGuard", "takes_found_inf"]


def takes_found_inf(optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``optimizer`` skips on a device flag with nothing left behind: a torch optimizer
    that supports a ``GradScaler``'s ``found_inf``, fused, with its state already built (or
    one that keeps none: SGD without momentum)."""
    if not getattr(optimizer, "_step_supports_amp_scaling", False):
        return False
    if not all(g.get("fused") for g in optimizer.param_groups):
        return False
    if isinstance(optimizer, torch.optim.SGD) and all(
        g["momentum"] == 0 for g in optimizer.param_groups
    ):
        return True
    params = [p for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
    return bool(params) and all(p in optimizer.state for p in params)


class StepGuard:
    """Guards every optimizer step over ``params`` with a pending step's ``ok``, until the
    next step is decided (or :meth:`clear`)."""

    def __init__(self, params: list[torch.Tensor]):
        self.params = params
        self._ids = {id(p) for p in params}
        self.pending: StepResult | None = None
        self._handles: list[Any] = []
        self._armed: dict[int, bool] = {}  # optimizer id -> its flag is ours to remove after

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

    def guard(self, result: StepResult) -> None:
        """The optimizer steps until the next decision are ``result``'s (one decided on the
        device, or a skipped one whose ``.grad`` hold NaN for a ``GradScaler`` to see)."""
        self.pending = result

    def clear(self) -> None:
        """The next optimizer steps are no decided step's (the next step was decided on the
        host, and its ``.grad`` say what it was)."""
        self.pending = None

    def _ours(self, optimizer: torch.optim.Optimizer) -> bool:
        return any(id(p) in self._ids for g in optimizer.param_groups for p in g["params"])

    def _before(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        pending = self.pending
        if pending is None or not self._ours(optimizer):
            return
        if not known(pending) and takes_found_inf(optimizer):
            assert isinstance(pending, PendingResult)
            flag = (~pending.ok).float()
            scaler_s = getattr(optimizer, "found_inf", None)
            if scaler_s is not None:  # a GradScaler's step: its flag and ours, its to remove
                optimizer.found_inf = torch.maximum(scaler_s, flag.to(scaler_s.device))  # type: ignore[attr-defined]
                return
            optimizer.found_inf = flag  # type: ignore[attr-defined]
            optimizer.grad_scale = None  # type: ignore[attr-defined]
            self._armed[id(optimizer)] = True
        elif pending.skipped:  # read on the host: nothing to step
            for p in self.params:
                p.grad = None

    def _after(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if self._armed.pop(id(optimizer), False):
            del optimizer.found_inf, optimizer.grad_scale  # type: ignore[attr-defined]
