"""Optimizer state sharded over the towers (``shard_optimizer=True``): one copy between them.

The model's trainable parameters, in model order, are laid end to end, and rank ``r`` of ``N``
owns elements ``[r * P, (r + 1) * P)`` of that line (``P = ceil(total / N)``): parts balanced
by elements, cut inside parameters where a boundary falls. The optimizers allowed
(:data:`ELEMENTWISE`) update every element from that element's gradient and state alone, so
stepping a part's slices is exactly the step of the whole parameters, restricted to the part.

The user's optimizer keeps the whole parameters in its groups between steps, so
``zero_grad``, a ``GradScaler``'s ``unscale_``, ``clip_grad_norm_`` over
``model.parameters()`` and learning-rate schedules see what they see in one process (every
tower's gradients are the global batch's, summed before the step). Only inside ``step()`` are
its groups' parameters this rank's slices (views of the parameters, with views of their
gradients), so its state is created for the slices alone: about ``1/N`` of the unsharded
state on each tower. After the step every tower gathers the parts into its parameters.

Two hooks on every optimizer's step (torch's global step hooks) do the swapping and the
gathering; an optimizer over none of the model's parameters is left alone.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn
from torch.optim.optimizer import (
    register_optimizer_step_post_hook,
    register_optimizer_step_pre_hook,
)

from ..comm.base import Comm
from .shard_gather import Gathers
from .shard_rules import ELEMENTWISE, Part, layout, refuse_unshardable

__all__ = [
    "ELEMENTWISE",
    "Held",
    "Part",
    "ShardedState",
    "layout",
    "refuse_unshardable",
]


class Held:
    """One optimizer's slices: the views its state is kept for, and its groups' parameters."""

    def __init__(self, params: list[list[torch.Tensor]]):
        self.groups = params  # the whole parameters of each group, as the user built them
        self.slices: dict[Part, torch.Tensor] = {}  # this rank's parts -> their views
        self.swapped = False


class ShardedState:
    """The sharding of ``model``'s optimizer state over the ranks of ``comm()``."""

    def __init__(self, model: nn.Module, comm: Callable[[], Comm]):
        self.params = [p for p in model.parameters() if p.requires_grad]
        for name, p in model.named_parameters():
            if p.requires_grad and not p.is_contiguous():
                raise ValueError(
                    f"shard_optimizer needs contiguous parameters; {name} is not (a "
                    "channels_last layout?): call .contiguous() on it before replicating"
                )
        self._index = {id(p): i for i, p in enumerate(self.params)}
        # frozen parameters stay whole in the optimizer's groups: without a gradient it skips them
        self._frozen = {id(p) for p in model.parameters() if not p.requires_grad}
        self._comm = comm
        current = comm()
        self.rank, self.world = current.rank, current.world_size
        self.parts: list[list[Part]] = []
        self._owned: dict[int, list[Part]] = {}  # this rank's parts of each parameter
        self._cut(layout([p.numel() for p in self.params], self.world))
        self._held: weakref.WeakKeyDictionary[torch.optim.Optimizer, Held] = (
            weakref.WeakKeyDictionary()
        )
        self._gathers = Gathers(self.params, self.rank, self.world)
        # a step skipped over all towers whose .grad hold NaN (for a GradScaler to see): the
        # next optimizer step changes nothing, until a new step is decided
        self.skipping = False
        self._hooks: list[Any] = []

    def start(self) -> ShardedState:
        """Shard every optimizer over the model's parameters from now on (torch's global step
        hooks, until :meth:`remove`)."""
        if not self._hooks:
            self._hooks = [
                register_optimizer_step_pre_hook(self._before),
                register_optimizer_step_post_hook(self._after),
            ]
        return self

    def remove(self) -> None:
        """Stop sharding: remove the step hooks (an optimizer keeps the state it has)."""
        for hook in self._hooks:
            hook.remove()
        self._hooks = []

    def recut(self, parts: list[list[Part]]) -> None:
        """Each rank's parts are ``parts`` from now on (before any state is kept for them)."""
        if parts == self.parts:
            return  # the same cut (a transform's state started again)
        assert not any(h.slices for h in self._held.values()), "cut before any state is kept"
        self._cut(parts)

    def _cut(self, parts: list[list[Part]]) -> None:
        self.parts = parts
        self._owned = {}
        for part in parts[self.rank]:
            self._owned.setdefault(part.index, []).append(part)

    def comm(self) -> Comm:
        """The ranks the state is sharded over, now."""
        return self._comm()

    def mine(self) -> list[Part]:
        return self.parts[self.rank]

    def owned(self, index: int) -> list[Part]:
        """This rank's parts of parameter ``index``."""
        return self._owned.get(index, [])

    def index(self, p: torch.Tensor) -> int | None:
        """``p``'s place among the model's trainable parameters (``None``: not one of them)."""
        return self._index.get(id(p))

    def held(self, optimizer: torch.optim.Optimizer) -> Held | None:
        """What ``optimizer`` holds sharded, once it has stepped or loaded its part."""
        return self._held.get(optimizer)

    def hold(self, optimizer: torch.optim.Optimizer) -> Held:
        """Shard ``optimizer`` from now on (before its first step: to load its part)."""
        held = self._held.get(optimizer)
        if held is None:
            groups = [list(g["params"]) for g in optimizer.param_groups]
            held = self._adopt(optimizer, groups, self._ours(groups))
        return held

    def _ours(self, groups: list[list[torch.Tensor]]) -> list[torch.Tensor]:
        """The model's parameters among ``groups``' (frozen ones too)."""
        return [p for g in groups for p in g if id(p) in self._index or id(p) in self._frozen]

    def view(self, held: Held, part: Part) -> torch.Tensor:
        """The slice of ``part`` that ``held``'s optimizer keeps state for (made once)."""
        view = held.slices.get(part)
        if view is None:
            view = held.slices[part] = part.of(self.params[part.index])
        return view

    # -- the step -------------------------------------------------------------------------------

    def _before(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> Any:
        held = self._held.get(optimizer)
        if held is not None and held.swapped:  # the last step raised inside: whole again
            self._unswap(optimizer, held)
        groups = [list(g["params"]) for g in optimizer.param_groups]
        ours = self._ours(groups)
        if not ours or all(id(p) in self._frozen for p in ours):
            return  # another model's optimizer
        if held is None:
            held = self._adopt(optimizer, groups, ours)
        _refuse_own_hooks(optimizer)
        if [[id(p) for p in g] for g in groups] != [[id(p) for p in g] for g in held.groups]:
            raise ValueError(
                "shard_optimizer: the optimizer's parameters changed after its first step (a "
                "parameter group added?); every tower keeps the state of its part of the "
                "parameters the first step saw: add every group before the first step"
            )
        for p in ours:
            if p.grad is not None and p.grad.is_sparse:  # the same on every rank
                raise ValueError("shard_optimizer cannot shard a parameter with a sparse gradient")
            if p.grad is not None and id(p) in self._frozen:
                raise ValueError(
                    "shard_optimizer: a parameter frozen (requires_grad=False) when the model "
                    "was replicated has a gradient now; towers neither averages nor shards it. "
                    "Unfreeze every parameter you will train before ctx.replicate"
                )
        self._swap(optimizer, held)
        closure = args[1] if len(args) > 1 else kwargs.get("closure")  # args[0] is the optimizer
        if closure is None:
            return None

        def whole_for_the_closure() -> Any:
            """The closure (zero_grad, forward, backward) sees the whole parameters; the step
            after it, the slices with the gradients it computed."""
            self._unswap(optimizer, held)
            loss = closure()
            self._swap(optimizer, held)
            return loss

        if len(args) > 1:
            return (args[0], whole_for_the_closure, *args[2:]), kwargs
        return args, {**kwargs, "closure": whole_for_the_closure}

    def _swap(self, optimizer: torch.optim.Optimizer, held: Held) -> None:
        """Give ``optimizer``'s groups this rank's slices, with views of the gradients (none
        while :attr:`skipping`)."""
        swapped = [self._slices(held, params) for params in held.groups]
        if self.skipping:
            for view in held.slices.values():
                view.grad = None
        for group, params in zip(optimizer.param_groups, swapped, strict=True):
            group["params"] = params
        held.swapped = True

    def _unswap(self, optimizer: torch.optim.Optimizer, held: Held) -> None:
        """Give ``optimizer``'s groups their whole parameters back."""
        for group, params in zip(optimizer.param_groups, held.groups, strict=True):
            group["params"] = params
        for view in held.slices.values():
            view.grad = None  # a view of the gradient keeps the whole gradient alive
        held.swapped = False

    def _adopt(
        self, optimizer: torch.optim.Optimizer, groups: list[list[torch.Tensor]], ours: list[Any]
    ) -> Held:
        refuse_unshardable(optimizer)
        if sum(len(g) for g in groups) != len(ours):
            raise ValueError(
                "shard_optimizer: the optimizer holds tensors that are not the replicated "
                "model's trainable parameters; build it on model.parameters() (or groups of "
                "them) of the model ctx.replicate returned"
            )
        if any(optimizer.state.values()):  # a defaultdict: a read adds an empty entry
            raise ValueError(
                "shard_optimizer: the optimizer already has state for whole parameters (it "
                "stepped before the model was replicated, or loaded a state dict): build it "
                "after replicating, and resume through ctx.load_checkpoint"
            )
        held = Held(groups)
        self._held[optimizer] = held
        optimizer.register_state_dict_pre_hook(_refuse_state_dict)
        optimizer.register_load_state_dict_pre_hook(_refuse_state_dict)
        return held

    def _slices(self, held: Held, params: list[torch.Tensor]) -> list[torch.Tensor]:
        """This rank's slices of ``params``, each with the matching view of the gradient."""
        out = []
        for p in params:
            if id(p) in self._frozen:
                out.append(p)
                continue
            for part in self.owned(self._index[id(p)]):
                view = self.view(held, part)
                grad = p.grad
                view.grad = None if grad is None else part.of(grad)
                out.append(view)
        return out

    def _after(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        held = self._held.get(optimizer)
        if held is None or not held.swapped:
            return
        self._unswap(optimizer, held)
        if self.world > 1:
            self.gather(
                {self._index[id(p)] for g in held.groups for p in g if id(p) in self._index}
            )

    def step(self, optimizer: torch.optim.Optimizer) -> None:
        """Step ``optimizer`` on this rank's slices and gather every rank's, without the global
        hooks (an optimizer of towers' own: DiLoCo's outer one; a collective)."""
        self._before(optimizer, (optimizer,), {})
        held = self._held[optimizer]
        try:
            optimizer.step()
        except BaseException:
            self._unswap(optimizer, held)
            raise
        self._after(optimizer, (optimizer,), {})

    def gather(self, indices: set[int], into: Sequence[torch.Tensor] | None = None) -> None:
        """Every rank's updated parts of the parameters ``indices`` into every rank's copy
        (``into``: into these tensors instead, one per parameter, each of its shape)."""
        self._gathers.run(self._comm(), self.parts, indices, self.params if into is None else into)


def _refuse_state_dict(optimizer: torch.optim.Optimizer, *args: Any) -> None:
    raise RuntimeError(
        "this optimizer's state is sharded over the towers (shard_optimizer=True): each tower "
        "holds only its part, so its state_dict is not the whole state. Save and resume with "
        "ctx.save_checkpoint and ctx.load_checkpoint, which write every tower's part"
    )


def _refuse_own_hooks(optimizer: torch.optim.Optimizer) -> None:
    """An optimizer's own step hooks would see only the slices: refused, with the reason."""
    own = getattr(optimizer, "_optimizer_step_pre_hooks", {}) or getattr(
        optimizer, "_optimizer_step_post_hooks", {}
    )
    if own:
        raise ValueError(
            "shard_optimizer: the optimizer has step hooks of its own (register_step_pre_hook "
            "or register_step_post_hook); they would run while it holds only this tower's "
            "slices, before the other towers' parts are gathered. Do that work before or after "
            "optimizer.step() instead"
        )
