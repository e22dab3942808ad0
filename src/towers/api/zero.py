"""``towers.ddp.ZeroRedundancyOptimizer``: torch's sharded optimizer, by its name, over towers'
sharding.

A DDP script that builds ``ZeroRedundancyOptimizer(model.parameters(), optimizer_class=AdamW,
lr=...)`` ports by its import. The optimizer is ``optimizer_class``'s own (an instance of a
subclass made for it, so that schedules and ``isinstance`` checks take it), and the wrapped
model's towers shard its state (:mod:`towers.engines.shard`, docs/sharding.md): each keeps the
state of its part of the parameters, the parts balanced by elements and cut inside parameters
where torch's gives each rank whole ones, and every tower gets the updated parameters after each
step. torch's checkpoint calls keep their meaning: ``consolidate_state_dict(to)`` on every rank,
then ``state_dict()`` on rank ``to`` is the whole state in ``optimizer_class``'s own layout, and
``load_state_dict`` of such a state on every rank gives each tower its part.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from ..engines.shard import ShardedState, refuse_unshardable
from ..engines.shard_files import consolidated, load_whole
from ..engines.transforms import AllReduce
from ..engines.transforms.scatter import scatter_for
from . import ddp
from .validate import check_sharding, loop_mode

__all__ = ["ZeroRedundancyOptimizer"]

_MADE: dict[type, type] = {}  # optimizer_class -> its ZeroRedundancyOptimizer subclass


class ZeroRedundancyOptimizer:
    """``torch.distributed.optim.ZeroRedundancyOptimizer``'s interface (see the module doc).

    ``params`` must be parameters (or groups of them) of the model the job's
    ``DistributedDataParallel`` wraps, built after wrapping it. ``parameters_as_bucket_view``
    is accepted (it changes no result); ``process_group`` and ``overlap_with_ddp=True`` are
    refused.
    """

    _zero: ShardedState
    _whole: dict[str, Any] | None

    def __new__(cls, *args: Any, **kwargs: Any) -> Any:
        if cls is not ZeroRedundancyOptimizer:
            return super().__new__(cls)
        optimizer_class = kwargs.get("optimizer_class", args[1] if len(args) > 1 else None)
        if not (
            isinstance(optimizer_class, type) and issubclass(optimizer_class, torch.optim.Optimizer)
        ):
            raise TypeError(
                "ZeroRedundancyOptimizer needs optimizer_class=, a torch.optim.Optimizer "
                f"class such as torch.optim.AdamW; got {optimizer_class!r}"
            )
        made = _MADE.get(optimizer_class)
        if made is None:
            name = f"ZeroRedundancy{optimizer_class.__name__}"
            # it adds no step of its own: towers shards it as it would optimizer_class
            made = _MADE[optimizer_class] = type(
                name, (ZeroRedundancyOptimizer, optimizer_class), {"steps_as": optimizer_class}
            )
        return super().__new__(made)

    def __init__(
        self,
        params: Iterable[Any],
        optimizer_class: type[torch.optim.Optimizer],
        process_group: Any = None,
        parameters_as_bucket_view: bool = False,
        overlap_with_ddp: bool = False,
        **defaults: Any,
    ):
        if process_group is not None:
            raise ValueError("towers.ddp shards over the whole job: pass no process_group")
        if overlap_with_ddp:
            raise ValueError(
                "overlap_with_ddp=True steps each bucket inside DDP's communication hook, which "
                "towers' wrapper does not run: leave it False (towers gathers the updated parts "
                "after each step)"
            )
        super().__init__(params, **defaults)  # type: ignore[call-arg]
        refuse_unshardable(self)  # type: ignore[arg-type]  # before any step, with the reason
        self._zero = _sharding(self)  # type: ignore[arg-type]
        self._whole = None

    def consolidate_state_dict(self, to: int = 0) -> None:
        """Gather the whole state on rank ``to`` (a collective: every rank calls it), one
        rank's part at a time; ``state_dict()`` there then returns it."""
        self._whole = consolidated(self._zero, self, to)  # type: ignore[arg-type]

    def state_dict(self) -> dict[str, Any]:
        """The whole state (``optimizer_class``'s layout) on the rank it was consolidated on."""
        if self._whole is not None:
            return self._whole
        if self._zero.held(self) is None:  # type: ignore[arg-type]
            return super().state_dict()  # type: ignore[misc]  # no state yet: the settings
        raise RuntimeError(
            "this optimizer's state is sharded over the towers: call "
            "consolidate_state_dict(to=RANK) on every rank first; state_dict() on rank RANK "
            "then returns the whole state"
        )

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Give this tower its part of ``state_dict``, a whole state of ``optimizer_class`` (as
        :meth:`state_dict` returns it); on every rank."""
        load_whole(self._zero, self, state_dict)  # type: ignore[arg-type]


def _sharding(optimizer: torch.optim.Optimizer) -> ShardedState:
    """The sharding of the wrapped model whose parameters ``optimizer`` steps, started once."""
    mine = {id(p) for g in optimizer.param_groups for p in g["params"]}
    wrapped = next((m for m in ddp._models if mine & m._params), None)
    if wrapped is None:
        raise ValueError(
            "ZeroRedundancyOptimizer shards the state of the model towers.ddp's "
            "DistributedDataParallel wraps: wrap the model first, then build the optimizer on "
            "model.parameters()"
        )
    state = wrapped._steps.state
    if not state.every_step:
        raise ValueError(
            f"ZeroRedundancyOptimizer shards the state of the optimizer it wraps, but in mode "
            f"{wrapped._steps.driver.mode!r} each tower steps its own optimizer on its own "
            "shard, so there is no one state to share: build the optimizer class itself"
        )
    if state.sharding is None:
        group, driver = ddp.context()._group, wrapped._steps.driver
        check_sharding(True, loop_mode(driver.mode), group.elastic, None)
        sharding = ShardedState(wrapped.module, lambda: group.comm)
        scatter = scatter_for(sharding, None, group.comm, group.elastic)
        same = [id(p) for p in sharding.params] == [id(p) for p in driver.params]  # none frozen
        if scatter is not None and same and isinstance(driver.transform, AllReduce):
            driver.retransform(scatter)  # each part summed for its owner alone: DDP's bytes
        state.sharding = sharding.start()
    return state.sharding
