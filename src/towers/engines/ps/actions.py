"""What a mode's policy may ask the parameter server to do: small, plain values.

A policy (:mod:`towers.engines.ps.policies`) reads the server's state and returns a list of
these; the server (:class:`~towers.engines.ps.server.Server`) carries them out in order, and is
the only one that changes its state, sends messages or touches the parameters.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .state import Shard

__all__ = [
    "Action",
    "Ahead",
    "Apply",
    "Average",
    "CloseStep",
    "CollectParams",
    "Drop",
    "HandOut",
    "Idle",
    "OpenStep",
    "Record",
    "Refill",
    "Requeue",
    "ShardDone",
    "Skip",
    "Stale",
]


@dataclass(frozen=True)
class Refill:
    """Cut the next global batches into the queue until it holds a shard per tower (and, with
    ``until``, a shard of that index)."""

    until: int | None = None


@dataclass(frozen=True)
class OpenStep:
    """``backup``: the queue becomes global batch ``step``'s shards (and nothing else)."""

    step: int


@dataclass(frozen=True)
class HandOut:
    """Send the queue's first shard to ``tower``, with the parameters unless ``params`` is False.

    ``pick``: the first shard of that index, or of a tower that was lost, if the queue holds one.
    """

    tower: int
    params: bool = True
    pick: int | None = None


@dataclass(frozen=True)
class CollectParams:
    """``local``: no shard for ``tower`` this round; ask it for its parameters."""

    tower: int


@dataclass(frozen=True)
class Ahead:
    """Record a pull's lead over the slowest live tower (``TrainResult.ahead``)."""

    lead: int


@dataclass(frozen=True)
class Idle:
    """``tower`` waits to be served."""

    tower: int


@dataclass(frozen=True)
class Record:
    """Count ``tower``'s loss sum and samples in global batch ``step``'s record."""

    step: int
    tower: int
    loss: float
    samples: int


@dataclass(frozen=True)
class Apply:
    """Step the optimizer with the gradients of ``messages`` summed and divided by ``samples``.

    On success the update's staleness is the updates applied since ``pulled``; if a summed
    gradient is not finite nothing is applied and ``step`` is skipped, naming ``culprits``.
    The buffers (BatchNorm's statistics) come from the last message.
    """

    messages: tuple[torch.Tensor, ...]
    samples: int
    step: int
    pulled: int
    culprits: tuple[int, ...]


@dataclass(frozen=True)
class Skip:
    """Report global batch ``step`` as skipped for a non-finite value of ``towers``."""

    step: int
    towers: tuple[int, ...]


@dataclass(frozen=True)
class Stale:
    """Record a staleness (``local``: the tower's steps since the last average)."""

    value: int


@dataclass(frozen=True)
class Drop:
    """``backup``: ``tower``'s shard of ``step`` arrived after the step was applied."""

    step: int
    tower: int


@dataclass(frozen=True)
class ShardDone:
    """One more shard of global batch ``step`` is finished (the last one completes it)."""

    step: int


@dataclass(frozen=True)
class CloseStep:
    """``backup``: global batch ``step`` is complete; the next one becomes current."""

    step: int


@dataclass(frozen=True)
class Requeue:
    """Put ``shard`` (a lost tower's) at the front of the queue."""

    shard: Shard


@dataclass(frozen=True)
class Average:
    """``local``: the parameters become the sample-weighted average of ``submitted``
    (``(message, samples)`` pairs); ``final``: it is the last one, training is over."""

    submitted: tuple[tuple[torch.Tensor, int], ...]
    final: bool


Action = (
    Refill
    | OpenStep
    | HandOut
    | CollectParams
    | Ahead
    | Idle
    | Record
    | Apply
    | Skip
    | Stale
    | Drop
    | ShardDone
    | CloseStep
    | Requeue
    | Average
)
