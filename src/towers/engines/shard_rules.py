"""Which optimizers a sharded state takes (:mod:`towers.engines.shard`): those that update
every element from its own gradient and state, so that stepping parts of parameters is exact."""

from __future__ import annotations

import torch

__all__ = ["ELEMENTWISE", "refuse_unshardable"]

ELEMENTWISE: tuple[type[torch.optim.Optimizer], ...] = (
    torch.optim.SGD,
    torch.optim.Adam,
    torch.optim.AdamW,
    torch.optim.Adamax,
    torch.optim.NAdam,
    torch.optim.RAdam,
    torch.optim.RMSprop,
    torch.optim.Rprop,
)
"""Optimizers whose step updates every element from its own gradient and state (and scalars
shared by the whole parameter, such as the step count): exact when parameters are cut."""


def refuse_unshardable(optimizer: torch.optim.Optimizer) -> None:
    """Refuse an optimizer whose step is not exact on parts of parameters, with the reason (a
    class that adds no step of its own says whose it runs: ``steps_as``)."""
    kind = getattr(type(optimizer), "steps_as", type(optimizer))
    if kind not in ELEMENTWISE:
        allowed = ", ".join(k.__name__ for k in ELEMENTWISE)
        raise ValueError(
            f"shard_optimizer cannot shard {kind.__name__}: towers cuts parameters into "
            "parts, which is exact only for an optimizer that updates every element from "
            f"its own gradient and state ({allowed}); an optimizer whose state needs "
            "whole parameters (factored moments, a per-parameter trust ratio, "
            "orthogonalised updates) would change the result. Train it without "
            "shard_optimizer"
        )
    if any(group.get("differentiable") for group in optimizer.param_groups):
        raise ValueError(
            "shard_optimizer cannot shard an optimizer built with differentiable=True: its "
            "step would run on detached slices of the parameters, outside their graph"
        )
