"""The rules of a sharded state (:mod:`towers.engines.shard`): how the parameters are cut into
each rank's parts, and which optimizers it takes (those that update every element from its own
gradient and state, so that stepping parts of parameters is exact)."""

from __future__ import annotations

import dataclasses

import torch

__all__ = ["ALIGN", "ELEMENTWISE", "Part", "layout", "refuse_unshardable"]

ALIGN = 64
"""A cut inside a parameter falls on a multiple of this many elements from its start, so that a
slice is processed by the same vectorised loop as the whole parameter (its tail is the
parameter's): the element-wise step of a slice is the whole parameter's, bit for bit."""


@dataclasses.dataclass(frozen=True)
class Part:
    """Elements ``[start, stop)`` of parameter ``index`` (flattened), owned by one rank."""

    index: int
    start: int
    stop: int

    @property
    def size(self) -> int:
        return self.stop - self.start

    def of(self, t: torch.Tensor) -> torch.Tensor:
        """This part's elements of ``t`` (the parameter, or a tensor of its shape), flattened:
        a view where ``t`` is contiguous."""
        return _flat(t.detach())[self.start : self.stop]


def layout(sizes: list[int], world: int) -> list[list[Part]]:
    """Each rank's parts of parameters of ``sizes`` elements: balanced by elements, within
    :data:`ALIGN` elements, as a cut inside a parameter falls on a multiple of ``ALIGN``."""
    per = max(1, -(-sum(sizes) // world))
    owned: list[list[Part]] = [[] for _ in range(world)]
    offset = 0
    for index, size in enumerate(sizes):
        at = 0
        while at < size:
            rank = (offset + at) // per
            stop = (rank + 1) * per - offset  # where the rank's elements end, in this parameter
            stop = size if stop >= size else min(size, -(-stop // ALIGN) * ALIGN)
            owned[rank].append(Part(index, at, stop))
            at = stop
        offset += size
    return owned


def _flat(t: torch.Tensor) -> torch.Tensor:
    return t.view(-1) if t.is_contiguous() else t.reshape(-1)


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
