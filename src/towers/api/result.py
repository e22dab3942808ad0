"""``TrainResult``: what :func:`towers.train` returns."""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field

from torch import nn

from ..core.modes import Engine, parse_mode

__all__ = ["TrainResult", "warn_if_untrained"]


@dataclass
class TrainResult:
    """What :func:`towers.train` returns.

    Attributes:
        model: the trained model, on the CPU (a copy; the model passed in is not modified).
        losses: per step, the sample-weighted mean loss over all towers, computed with the
            parameters before that step's update.
        tower_losses: per step, each tower's mean loss (``nan`` for a tower with no samples).
        skipped: ``(step, culprit towers)`` for every step skipped because a loss or gradient was
            not finite.
        steps: global batches trained on.
        samples: samples trained on (all towers, all steps).
        seconds: wall time of the training loop, excluding process start-up.
        staleness: asynchronous modes: one entry per applied update (updates the server applied
            between a worker's pull and the arrival of its gradient; ``local:K``: the worker's
            steps since the last average); empty in sync mode.
        mode: the mode trained in.
        workers: the number of (computing) towers.
        restarts: how many times the workers were relaunched after a failure.
        times: per step, seconds from the start until its loss was complete (for plots of loss
            against wall time).
        ahead: ``async`` and ``ssp:S``: per pull, how many results the pulling worker had sent
            beyond the slowest live worker (``ssp:S`` keeps it <= S).
        dropped: ``backup:B``: ``(step, tower)`` for each late shard left out of its step.
        dead_workers: towers that died during training (their shards went to the others). In
            an elastic sync run: the ids of the workers lost (a worker's id is its first rank;
            replacements get ``workers``, ``workers + 1``, ...).
        world: sync mode: per step, the number of towers that computed it (changes in an
            elastic run when a worker is lost or a replacement joins).
        recoveries: elastic sync runs: ``(step, seconds)`` for each recovery from lost workers
            (two losses close together are recovered by one): the step that was redone by the
            survivors, and the seconds from the loss (the death, or the last heartbeat of a
            hung worker) until that step completed.
        evals: with ``eval_data=``: ``(global batches completed, {metric: value})`` for every
            evaluation, in order; the last is at ``steps``, of the trained parameters.
        shards: sync modes: per step, each tower's shard size (the split of that global
            batch: even, or with ``balance`` in proportion to the towers' speeds).
        shard_seconds: sync modes: per step, each tower's compute time for its shard
            (forward and backward, no waits), what a balanced split follows.
    """

    model: nn.Module
    losses: list[float]
    tower_losses: list[list[float]]
    skipped: list[tuple[int, list[int]]]
    steps: int
    samples: int
    seconds: float
    staleness: list[int] = field(default_factory=list)
    mode: str = "sync"
    workers: int = 1
    restarts: int = 0
    times: list[float] = field(default_factory=list)
    ahead: list[int] = field(default_factory=list)
    dropped: list[tuple[int, int]] = field(default_factory=list)
    dead_workers: list[int] = field(default_factory=list)
    world: list[int] = field(default_factory=list)
    recoveries: list[tuple[int, float]] = field(default_factory=list)
    evals: list[tuple[int, dict[str, float]]] = field(default_factory=list)
    shards: list[list[int]] = field(default_factory=list)
    shard_seconds: list[list[float]] = field(default_factory=list)

    @property
    def updates(self) -> int:
        """Parameter updates applied (sync: steps not skipped; diloco: each tower's inner
        steps, one per global batch, not skipped)."""
        if parse_mode(self.mode).engine is Engine.SYNC:
            return self.steps - len(self.skipped)
        return len(self.staleness)

    @property
    def samples_per_second(self) -> float:
        return self.samples / self.seconds if self.seconds > 0 else float("nan")


def warn_if_untrained(result: TrainResult) -> TrainResult:
    """``result``, after a ``RuntimeWarning`` if not one update was applied in its steps."""
    if result.steps == 0 or result.updates > 0:
        return result
    first = result.skipped[0] if result.skipped else None
    culprits = f" (the first: step {first[0]}, towers {first[1]})" if first else ""
    warnings.warn(
        f"no update was applied: all {result.steps} steps were skipped because a loss or "
        f"gradient was not finite{culprits}, so the returned model is the model passed in. "
        "Look for NaN or Inf in the data, for log(0) or 0/0 in loss_fn, and for a loss that "
        "overflows (a smaller learning rate); TrainResult.skipped lists every step with its "
        "culprit towers",
        RuntimeWarning,
        stacklevel=3,
    )
    return result
