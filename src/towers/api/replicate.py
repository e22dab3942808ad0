"""What ``ctx.replicate`` checks and builds before the model is replicated.

The mode, BatchNorm across towers, the gradient transform and the balanced split, each
checked on every rank before any collective, so that a mistake is one clear error on every
rank instead of a hang: the own loop's counterpart of :mod:`towers.api.make`.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from ..engines.job import OptimizerFactory
from ..engines.shard import ShardedState
from ..engines.sync.group import Group
from ..engines.sync.mode import plan_for
from ..engines.sync.plan import StepPlan
from ..engines.syncbn import convert_batchnorm
from ..engines.transforms import GradientTransform
from ..engines.transforms.scatter import scatter_for
from .balance import choose_balance, unbalanced_because
from .make import reduction
from .mistakes import refuse_wrapped_model, warn_unsynced_buffers
from .outer import announce_outer
from .validate import averages_buffers, check_mode_options, check_sharding, loop_mode

__all__ = ["Prepared", "prepare", "sharding_for"]


class Prepared:
    """The step plan, the gradient transform and whether the split is balanced (``because``:
    why an uneven split would change the result, if it would)."""

    def __init__(
        self,
        plan: StepPlan,
        transform: GradientTransform | None,
        balance: bool,
        mode: str,
        because: str | None = None,
    ):
        self.plan, self.transform, self.balance = plan, transform, balance
        self.mode = mode  # as the job names it
        self.because = because


def prepare(
    model: nn.Module,
    group: Group,
    *,
    sync_batchnorm: bool,
    transform: GradientTransform | None,
    compress: str | None,
    mode: str,
    outer_optimizer: OptimizerFactory | None,
    balance: Any,
) -> Prepared:
    """Check ``ctx.replicate``'s arguments and build what it needs (see its docstring)."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"replicate() needs an nn.Module, got {type(model).__name__}")
    refuse_wrapped_model(model, "ctx.replicate()")
    parsed = loop_mode(mode)
    check_mode_options(parsed, model, sync_batchnorm, group.elastic, outer_optimizer)
    # A newcomer to an elastic job is let in once its model is built: it does not know its
    # rank yet, and says nothing. An elastic job may grow: balance is decided as for two
    # towers or more, the same on every member whatever the width when each joined.
    world, rank = (1, -1) if group.joining else (group.comm.world_size, group.comm.rank)
    announce_outer(parsed, outer_optimizer, world, "ctx.replicate", rank)
    reduced = reduction(transform, compress, model, parsed)
    because = unbalanced_because(model, sync_batchnorm, None, group.device.type, parsed, reduced)
    towers = max(world, 2) if group.elastic else world
    balanced = choose_balance(balance, parsed, towers, because, "ctx.replicate", rank)
    if sync_batchnorm:
        convert_batchnorm(model, group)
    elif world > 1 and not averages_buffers(parsed):
        warn_unsynced_buffers(model, "ctx.replicate(model, sync_batchnorm=True)")
    return Prepared(plan_for(parsed, outer_optimizer), reduced, balanced, str(parsed), because)


def sharding_for(
    model: nn.Module, group: Group, shard_optimizer: Any, ready: Prepared
) -> ShardedState | None:
    """``shard_optimizer=True``: the sharding of the optimizer's state over the ranks, checked
    (the same on every rank, before any collective); where the ranks sum over a process group,
    ``ready``'s transform becomes the one that sums each part for its owner only."""
    if not check_sharding(shard_optimizer, loop_mode(ready.mode), group.elastic, ready.transform):
        return None
    sharding = ShardedState(model, lambda: group.comm)
    if ready.plan.reduces:  # the user's optimizer: summed for the owners, where bytes count
        ready.transform = scatter_for(sharding, ready.transform, group.comm, group.elastic)
    return sharding
