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
from ..engines.shard_files import load_parts, part_state
from . import ddp
from .replicate import sharding_for

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
        sharding, comm = self._zero, ddp.context().comm
        held = sharding.held(self)  # type: ignore[arg-type]
        mine = part_state(sharding, self) if held is not None else []  # type: ignore[arg-type]
        parts = []
        for rank in range(comm.world_size):
            part = comm.broadcast_object(mine if rank == comm.rank else None, src=rank)
            if comm.rank == to:
                parts.append(part)
        self._whole = _whole(self, parts) if comm.rank == to else None  # type: ignore[arg-type]

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
        sharding = self._zero
        params = [p for g in self.param_groups for p in g["params"]]  # type: ignore[attr-defined]
        saved_groups = state_dict["param_groups"]
        ids = [i for g in saved_groups for i in g["params"]]
        if len(ids) != len(params):
            raise ValueError(
                f"the state dict holds {len(ids)} parameters, this optimizer {len(params)}: "
                "load the state of an optimizer built over the same parameters"
            )
        place = dict(zip(ids, params, strict=True))
        groups = []
        for group, saved in zip(self.param_groups, saved_groups, strict=True):  # type: ignore[attr-defined]
            kept = {k: v for k, v in saved.items() if k != "params"}
            groups.append({**kept, "params": [sharding.index(p) for p in group["params"]]})
        records = []
        for i, state in state_dict["state"].items():
            p = place[i]
            index = sharding.index(p)
            if index is None:
                continue  # a frozen parameter: no state
            flat = {k: _flat_per_element(v, p) for k, v in state.items()}
            records.append({"index": index, "start": 0, "stop": p.numel(), "state": flat})
        described = {"sharded": {"groups": groups, "world": 1, "type": type(self).__name__}}
        load_parts(sharding, self, described, lambda rank: records)  # type: ignore[arg-type]


def _flat_per_element(value: Any, p: torch.Tensor) -> Any:
    """A state value with one entry per element of ``p``, flattened; others as they are."""
    if torch.is_tensor(value) and value.dim() > 0 and value.numel() == p.numel():
        return value.reshape(-1)
    return value


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
    if state.sharding is None:
        job = ddp.context()
        sharding = sharding_for(wrapped.module, job._group, True, wrapped._steps.driver.mode)
        assert sharding is not None
        state.sharding = sharding.start()
    return state.sharding


def _whole(optimizer: torch.optim.Optimizer, parts: list[list[dict[str, Any]]]) -> dict[str, Any]:
    """Every rank's part put together: the state ``optimizer_class`` keeps in one process."""
    sharding = optimizer._zero  # type: ignore[attr-defined]
    whole: dict[int, dict[str, Any]] = {}
    for records in parts:
        for record in records:
            p = sharding.params[record["index"]]
            into = whole.setdefault(record["index"], {})
            for k, v in record["state"].items():
                if torch.is_tensor(v) and v.dim() > 0:  # one value per element
                    if k not in into:
                        into[k] = torch.zeros(p.numel(), dtype=v.dtype)
                    into[k][record["start"] : record["stop"]] = v
                else:  # the step count: the same in every slice
                    into[k] = v
    held = sharding.held(optimizer)
    groups = held.groups if held is not None else [g["params"] for g in optimizer.param_groups]
    ids: dict[int, int] = {}
    out_groups = []
    for group, params in zip(optimizer.param_groups, groups, strict=True):
        numbers = []
        for p in params:
            numbers.append(ids.setdefault(id(p), len(ids)))
        out_groups.append({**{k: v for k, v in group.items() if k != "params"}, "params": numbers})
    state = {}
    for index, values in whole.items():
        p = sharding.params[index]
        state[ids[id(p)]] = {
            k: v.reshape(p.shape) if torch.is_tensor(v) and v.dim() > 0 else v
            for k, v in values.items()
        }
    return {"state": state, "param_groups": out_groups}
