"""Mixed precision in the own loop: ``ctx.backward(loss, scaler=GradScaler)``.

bf16 autocast needs nothing from towers: the parameters and their gradients stay float32. A
float16 loop scales its loss with a ``torch.amp.GradScaler`` so that small gradients do not
flush to zero, and the scaler skips the optimizer step (and lowers the scale) when a scaled
gradient overflows. towers scales what it backpropagates, averages the scaled gradients (the
average of scaled gradients is the scaled average), and on a skipped step hands every rank the
same non-finite gradients, so that every rank's scaler skips and backs off together.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch

__all__ = ["check_scaler", "poison_grads"]


def check_scaler(scaler: Any) -> Any:
    """``scaler`` if it is ``None`` or behaves as a ``GradScaler``; else a ``TypeError``."""
    if scaler is not None and not all(hasattr(scaler, a) for a in ("scale", "step", "update")):
        raise TypeError(
            f"scaler must be a torch.amp.GradScaler (or None), got {type(scaler).__name__}"
        )
    return scaler


def poison_grads(params: Sequence[torch.Tensor]) -> None:
    """Give every parameter a NaN gradient: what ``scaler.step`` must see on a skipped step."""
    for p in params:
        p.grad = torch.full_like(p, math.nan)
