"""The training modes, one class each, registered by name with :mod:`towers.core.modes`.

A mode's class owns what differs between modes: its name and its argument's meaning and least
value (or its fields, :mod:`towers.core.specs`), a line of help, the engine that trains it
(``engine``; the parameter server's modes derive from
:class:`~towers.engines.ps.mode.ServerMode`), the checks against the worker count, and, on the
parameter server, the server's policy and the towers' role. A new mode is one class here with
``@register``; ``towers.train(mode=...)``, ``towers run --mode``, the command's help, ``towers
compare`` and the error messages pick it up by name. ``towers/engines/__init__.py`` imports
this module, so the modes are registered whenever an engine is.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, cast

import torch
from torch import nn

from ..core.modes import register
from ..core.specs import Field, Int, Word
from .job import OptimizerFactory
from .ps.mode import ServerMode
from .ps.policies import AsyncPolicy, BackupPolicy, LocalPolicy, Policy, SspPolicy
from .ps.worker import LocalSteps, Role
from .sync.diloco import Periods
from .sync.mode import SyncMode
from .sync.plan import StepPlan
from .transforms import GradientTransform, topk

__all__ = [
    "SPARSELOCO_BITS",
    "SPARSELOCO_DECAY",
    "SPARSELOCO_SHARE",
    "Async",
    "Backup",
    "Diloco",
    "Local",
    "SparseLoco",
    "Ssp",
    "Sync",
    "sparseloco_outer_optimizer",
]

# SparseLoCo (Sarfi et al. 2025, arXiv 2508.15706): 64 of every 4096 values (1.6%), 2 bits
# each, and an error-feedback accumulator decayed by 0.95 in place of the outer momentum
SPARSELOCO_SHARE = 1 / 64
SPARSELOCO_BITS = 2
SPARSELOCO_DECAY = 0.95


@register
class Sync(SyncMode):
    """``sync``: every tower computes its shard, the towers average their gradients
    (sample-weighted) and all take the same step."""

    name = "sync"
    exact_under_any_split = True
    reduces_every_step = True
    help = "every tower computes its shard; one sample-weighted average and step per batch"


@register
class Async(ServerMode):
    """``async``: the server applies each shard's gradient as it arrives."""

    name = "async"
    help = "a parameter server applies each shard's gradient as it arrives"

    def policy(self, towers: int) -> Policy:
        return AsyncPolicy()


@register
class Ssp(ServerMode):
    """``ssp:S``: as ``async``, but no tower more than S updates ahead of the slowest."""

    name = "ssp"
    help = "as async, but no tower more than S updates ahead of the slowest"
    example = "ssp:2"
    meaning = "S, the most updates a worker may run ahead of the slowest (>= 0)"
    minimum = 0

    def policy(self, towers: int) -> Policy:
        return SspPolicy(cast(int, self.arg))


@register
class Local(ServerMode):
    """``local:K``: each tower steps alone; the parameters are averaged every K steps."""

    name = "local"
    help = "each tower steps alone; the parameters are averaged every K steps"
    example = "local:4"
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
    help = "each step applies the first workers - B shards to arrive, drops the rest"
    example = "backup:1"
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


@register
@dataclass(frozen=True)
class Diloco(SyncMode):
    """``diloco:H``: each tower takes H steps alone, then an outer step on the towers'
    averaged pseudo-gradients (docs/diloco.md). ``diloco:H:overlap``: the exchange travels
    while the next H steps run (Streaming DiLoCo); ``diloco:H:overlap:P``: the model is
    exchanged in P fragments, one every H / P steps."""

    name = "diloco"
    title = "DiLoCo"
    help = "each tower takes H steps alone, then an outer step on the averaged pseudo-gradients"
    example = "diloco:4"
    fields: ClassVar[tuple[Field, ...]] = (
        Int("H, the inner steps between outer steps (>= 1)", minimum=1),
        Word("overlap"),
        Int(
            "P, the fragments, one exchanged every H / P steps (>= 1, divides H)",
            minimum=1,
            optional=True,
        ),
    )
    outer_steps = True
    averages_buffers = True

    overlap: bool = False
    fragments: int = 1

    def check(self) -> None:
        every = cast(int, self.arg)
        if every % self.fragments:
            raise ValueError(
                f"mode {str(self)!r}: the fragments P must be an integer >= 1 that divides "
                f"H={every} (one fragment is exchanged every H / P steps); got {self.fragments}"
            )

    def plan(self, outer_optimizer: OptimizerFactory | None = None) -> StepPlan:
        every = cast(int, self.arg)
        return Periods(every, outer_optimizer, overlap=self.overlap, fragments=self.fragments)

    def check_options(self, model: nn.Module, *, sync_batchnorm: bool, elastic: bool) -> None:
        tensors = sum(1 for p in model.parameters() if p.requires_grad)
        if self.fragments > tensors:
            raise ValueError(
                f"mode {str(self)!r} exchanges the model in {self.fragments} fragments, but it "
                f"has only {tensors} trainable parameter tensors: use at most {tensors} fragments"
            )
        if sync_batchnorm:
            raise ValueError(
                f"sync_batchnorm=True sums BatchNorm's statistics over the towers in every "
                f"forward pass, but in mode {str(self)!r} the towers step alone between outer "
                "steps: drop sync_batchnorm=True (each tower keeps its own statistics, "
                "averaged at every outer step), or train in mode='sync'"
            )
        if elastic and self.overlap:
            raise ValueError(
                f"elastic=True cannot serve mode {str(self)!r}: an overlapped exchange is "
                "still travelling when the next steps run, and a regroup cannot carry it "
                f"over; use mode='diloco:{self.arg}' (blocking exchanges) with elastic=True, "
                "or drop elastic=True"
            )

    def check_sharding(self, transform: GradientTransform | None) -> None:
        if self.overlap:
            raise ValueError(
                f"shard_optimizer=True cannot serve mode {str(self)!r}: an overlapped exchange "
                "mixes each tower's own parameters with the whole outer ones, which no tower "
                f"keeps when they are sharded; use mode='diloco:{self.arg}' (blocking "
                "exchanges) with shard_optimizer=True, or drop shard_optimizer"
            )
        if transform is not None:
            raise ValueError(
                f"shard_optimizer=True cannot serve mode {str(self)!r} with the compression "
                f"{transform!r}: with the outer state sharded no tower keeps the whole outer "
                "parameters, so an exchange sums the towers' parameters instead of their "
                "pseudo-gradients, and compressing parameters would change the result. Drop "
                "the compression (the exchange then moves what an uncompressed one moves), or "
                "drop shard_optimizer=True"
            )

    def check_resumable(self, state: dict[str, Any], workers: int) -> None:
        saved = len(state["plan"]["ranks"])
        if saved != workers:
            raise ValueError(
                f"the checkpoint of mode {str(self)!r} holds the parameters and inner optimizer "
                f"of each of its {saved} workers, this run has {workers}: resume with "
                f"workers={saved}, or use another checkpoint directory"
            )


def sparseloco_outer_optimizer(params: Any) -> torch.optim.Optimizer:
    """SparseLoCo's outer step: plain SGD of lr 1, the mean sparse update applied as it is."""
    return torch.optim.SGD(params, lr=1.0)


@register
@dataclass(frozen=True)
class SparseLoco(Diloco):
    """``sparseloco:H``: DiLoCo whose pseudo-gradients travel as SparseLoCo's (Sarfi et al.
    2025): the top 1/64 of each chunk of 4096 values, 2 bits each, with an error-feedback
    accumulator decayed by 0.95 that replaces the outer momentum; the outer step is plain SGD
    of lr 1 (docs/diloco.md)."""

    name = "sparseloco"
    title = "SparseLoCo"
    help = (
        "DiLoCo with SparseLoCo's exchange: the top 1/64 of each chunk at 2 bits, error "
        "feedback (decay 0.95) in place of outer momentum"
    )
    example = "sparseloco:4"
    fields = (Int("H, the inner steps between outer steps (>= 1)", minimum=1),)

    def plan(self, outer_optimizer: OptimizerFactory | None = None) -> StepPlan:
        return Periods(cast(int, self.arg), outer_optimizer or sparseloco_outer_optimizer)

    def transform(self) -> GradientTransform:
        return topk(SPARSELOCO_SHARE, bits=SPARSELOCO_BITS, decay=SPARSELOCO_DECAY)
