"""DiLoCo's outer state sharded over the towers (``mode="diloco:H"``, ``shard_optimizer=True``).

Unsharded, every tower keeps two copies of the model beside its own: the outer parameters (where
the period started) and the outer optimizer's state (Nesterov momentum). Sharded, each tower
keeps its part of both, the parts of :mod:`towers.engines.shard` (balanced by elements, cut
inside parameters): about ``2 / N`` of a model instead of 2. The outer optimizer is built over
the tower's own model, whose parameters hold the whole outer ones right after each exchange,
and steps only this tower's slices (:meth:`~towers.engines.shard.ShardedState.step`).

No tower keeps the whole outer copy, so none can form a pseudo-gradient outside its part. An
exchange sums the towers' parameters instead, each times its weight, through the same driver
and buckets: the weighted mean ``M`` lands on every tower, the owner of each part forms the
mean pseudo-gradient ``outer - M`` there, steps the part, and every tower gathers the new outer
parts into its model. ``outer - mean(local)`` is ``mean(outer - local)`` up to float32 rounding
at the parameters' magnitude. A compression would compress parameters, not pseudo-gradients,
so the mode refuses one (:meth:`towers.engines.modes.Diloco.check_sharding`).
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import nn

from ..job import OptimizerFactory
from ..shard import Part, ShardedState
from ..shard_files import consolidated, load_whole
from .message import unflatten

__all__ = ["OuterParts", "refuse_low_precision"]


def refuse_low_precision(model: nn.Module) -> None:
    """``ValueError`` for parameters below float32: an exchange sums the parameters
    themselves, and in 16 bits that rounds away updates smaller than a few thousandths of a
    parameter, which a pseudo-gradient sum keeps."""
    low = sorted(
        {str(p.dtype) for p in model.parameters() if p.requires_grad and p.dtype.itemsize < 4}
    )
    if low:
        raise ValueError(
            f"shard_optimizer=True in DiLoCo needs float32 (or float64) parameters, the model "
            f"has {', '.join(low)} ones: with the outer state sharded an exchange sums the "
            "parameters themselves, and in 16 bits that rounds away updates smaller than a "
            "few thousandths of a parameter. Keep the parameters in float32 (autocast for the "
            "compute), or drop shard_optimizer=True"
        )


class OuterParts:
    """This tower's part of DiLoCo's outer parameters and outer optimizer state."""

    def __init__(self, sharding: ShardedState, model: nn.Module, factory: OptimizerFactory):
        refuse_low_precision(model)
        self.sharding, self.model = sharding, model
        self.params = sharding.params  # the model's trainable parameters, in order
        self.optimizer = factory(self.params)
        sharding.hold(self.optimizer)  # refuses an optimizer that is not element-wise
        self.kept: dict[Part, torch.Tensor] = {}  # this tower's part of the outer parameters
        self.buffers: dict[str, torch.Tensor] = {}  # the outer buffers, whole (they are small)
        self._floats = {n for n, b in model.named_buffers() if b.is_floating_point()}
        self._saved = set(model.state_dict())  # what the local model takes from the outer one
        self.take()

    def take(self) -> None:
        """The model holds the outer parameters and buffers now: keep this tower's part."""
        for part in self.sharding.mine():
            self.kept[part] = part.of(self.params[part.index]).clone()
        self.buffers = {n: b.detach().clone() for n, b in self.model.named_buffers()}

    def load(self, state: dict[str, Any]) -> None:
        """Keep this tower's part of a checkpoint's outer model ``state`` (a state dict)."""
        names = [n for n, p in self.model.named_parameters() if p.requires_grad]
        for part in self.sharding.mine():
            whole = state[names[part.index]].reshape(-1)[part.start : part.stop]
            kept = self.kept[part]
            kept.copy_(whole.to(device=kept.device, dtype=kept.dtype))
        for n, b in self.buffers.items():
            if n in state:
                b.copy_(state[n])

    def values(self, indices: range, weight: float) -> dict[int, torch.Tensor]:
        """What this tower sums at an exchange: its parameters ``indices`` times its weight."""
        return {i: self.params[i].detach() * weight for i in indices}

    def apply(self, means: list[torch.Tensor], skipped: bool, buffers: torch.Tensor | None) -> None:
        """The outer step on this tower's part from the towers' mean parameters ``means``
        (unless ``skipped``), then every tower's model holds the whole new outer parameters
        and buffers (a collective)."""
        with torch.no_grad():
            for part, kept in self.kept.items():  # the outer values, where this tower owns them
                part.of(self.params[part.index]).copy_(kept)
            if skipped:
                self.sharding.gather(set(range(len(self.params))))
            else:
                for index in {part.index for part in self.kept}:
                    self.params[index].grad = torch.zeros_like(self.params[index])
                for part, kept in self.kept.items():  # the mean pseudo-gradient, outer - M
                    grad = self.params[part.index].grad
                    assert grad is not None
                    mean = part.of(means[part.index])
                    torch.sub(kept, mean.to(kept.device), out=part.of(grad))
                self.sharding.step(self.optimizer)  # this tower's slices, then the gather
                for p in self.params:
                    p.grad = None
                for part, kept in self.kept.items():
                    kept.copy_(part.of(self.params[part.index]))
                if buffers is not None:
                    unflatten(buffers, [b for n, b in self.buffers.items() if n in self._floats])
            for n, b in self.model.named_buffers():  # the floating-point ones follow the outer
                if n in self._floats:
                    b.copy_(self.buffers[n])

    def restart(self) -> None:
        """The model's buffers become the outer ones (its parameters are, after an exchange)."""
        with torch.no_grad():
            for n, b in self.model.named_buffers():
                if n in self._saved:
                    b.copy_(self.buffers[n])

    def whole(self, gather: bool = True) -> nn.Module:
        """The whole outer model, a copy: the model's parameters with every tower's part
        gathered into them (a collective; ``gather=False`` right after an exchange, where they
        are the outer ones), and the outer buffers (the integer ones, which the model counts on,
        too)."""
        outer = copy.deepcopy(self.model)
        params = [p for p in outer.parameters() if p.requires_grad]
        with torch.no_grad():
            if gather:
                for part, kept in self.kept.items():
                    part.of(params[part.index]).copy_(kept)
                self.sharding.gather(set(range(len(params))), into=params)
            for n, b in outer.named_buffers():
                b.copy_(self.buffers[n])
        return outer

    def state_dict(self) -> dict[str, Any] | None:
        """The outer optimizer's whole state, in its class's own layout (what an unsharded run
        saves), on rank 0 (elsewhere ``None``; a collective)."""
        return consolidated(self.sharding, self.optimizer, to=0)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Take this tower's part of a whole outer optimizer state."""
        load_whole(self.sharding, self.optimizer, state)
