"""The training modes, one class each, registered by name with :mod:`towers.core.modes`.

A mode's class owns what differs between modes: its name and its argument's meaning and least
value, the engine that trains it (``engine``; the parameter server's modes derive from
:class:`~towers.engines.ps.mode.ServerMode`), the checks against the worker count, and, on the
parameter server, the server's policy and the towers' role. A new mode is one class here with
``@register``; ``towers.train(mode=...)``, ``towers run --mode`` and the checks pick it up by
name. ``towers/engines/__init__.py`` imports this module, so the modes are registered whenever
an engine is.
"""

from __future__ import annotations

from typing import cast

from ..core.modes import Engine, Mode, register
from .ps.mode import ServerMode
from .ps.policies import AsyncPolicy, BackupPolicy, LocalPolicy, Policy, SspPolicy
from .ps.worker import LocalSteps, Role

__all__ = ["Async", "Backup", "Local", "Ssp", "Sync"]


@register
class Sync(Mode):
    """``sync``: every tower computes its shard, the towers average their gradients
    (sample-weighted) and all take the same step."""

    name = "sync"
    engine = Engine.SYNC


@register
class Async(ServerMode):
    """``async``: the server applies each shard's gradient as it arrives."""

    name = "async"

    def policy(self, towers: int) -> Policy:
        return AsyncPolicy()


@register
class Ssp(ServerMode):
    """``ssp:S``: as ``async``, but no tower more than S updates ahead of the slowest."""

    name = "ssp"
    meaning = "S, the most updates a worker may run ahead of the slowest (>= 0)"
    minimum = 0

    def policy(self, towers: int) -> Policy:
        return SspPolicy(cast(int, self.arg))


@register
class Local(ServerMode):
    """``local:K``: each tower steps alone; the parameters are averaged every K steps."""

    name = "local"
    meaning = "K, the steps between parameter averages (>= 1)"
    minimum = 1

    def policy(self, towers: int) -> Policy:
        return LocalPolicy(towers)

    def role(self) -> Role:
        return LocalSteps(cast(int, self.arg))


@register
class Backup(ServerMode):
    """``backup:B``: each step applies the first ``workers - B`` shards to arrive."""

    name = "backup"
    meaning = "B, the late shards dropped per step (>= 1, fewer than workers)"
    minimum = 1

    def check_workers(self, workers: int) -> None:
        if cast(int, self.arg) >= workers:
            raise ValueError(
                f"mode {self} drops {self.arg} shards per step but there are only {workers} "
                f"workers; B must be below workers"
            )

    def policy(self, towers: int) -> Policy:
        return BackupPolicy(cast(int, self.arg), towers)
