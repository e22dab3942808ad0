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

__all__ = ["check_scaler", "float16_without_scaler", "poison_grads"]

FLOAT16 = (
    "{what} float16 without a torch.amp.GradScaler: float16 gradients under 6e-8 flush to zero "
    "and large ones overflow, so steps are lost or skipped without a word. {fix}"
)
FIX_LOOP = (
    "Pass the scaler to ctx.backward(loss, scaler=torch.amp.GradScaler()) and step with "
    "scaler.step(optimizer); or compute under torch.autocast(dtype=torch.bfloat16) with float32 "
    "parameters, which needs no scaler (docs/gpu.md, Mixed precision)"
)


def float16_without_scaler(params: Sequence[torch.Tensor], device_type: str) -> str | None:
    """What computes in float16 here (parameters, or autocast on ``device_type`` at this call),
    said for a step that has no ``GradScaler``; ``None`` if nothing does."""
    if any(p.dtype == torch.float16 for p in params):
        return "the model's parameters are"
    if torch.is_autocast_enabled(device_type) and (
        torch.get_autocast_dtype(device_type) == torch.float16
    ):
        return f"this step runs under torch.autocast({device_type!r}, dtype=torch.float16),"
    return None


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
