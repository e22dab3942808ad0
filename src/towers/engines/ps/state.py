"""The parameter server's state: where the job is, who is doing what, and the record so far.

Plain data, typed, in one place: the server changes it (its event loop, and the actions the
mode's policy returns), the policies only read it, and the resume module saves and restores it
(:mod:`towers.engines.ps.resume`).
"""

from __future__ import annotations

import collections
import math
from dataclasses import dataclass, field

__all__ = ["Record", "ServerState", "Shard"]


@dataclass(frozen=True)
class Shard:
    """Shard ``index`` of global batch ``step``, holding ``samples`` samples."""

    step: int
    index: int
    samples: int


@dataclass
class Record:
    """What the run has done: the numbers that become the ``TrainResult``."""

    loss_sums: list[list[float]]  # per global batch, per tower: loss summed over its samples
    counts: list[list[int]]  # per global batch, per tower: samples applied
    times: list[float]  # per global batch: seconds from the start until it was complete
    staleness: list[int] = field(default_factory=list)  # per applied update
    ahead: list[int] = field(default_factory=list)  # async, ssp: per pull
    skipped: dict[int, list[int]] = field(default_factory=dict)  # step -> culprit towers
    dropped: list[tuple[int, int]] = field(default_factory=list)  # backup: (step, tower)
    dead: list[int] = field(default_factory=list)  # towers lost
    evals: list[tuple[int, dict[str, float]]] = field(default_factory=list)  # (done, metrics)
    samples: int = 0
    prior_seconds: float = 0.0  # training time of the runs this one resumed

    @classmethod
    def empty(cls, steps: int, towers: int) -> Record:
        return cls(
            loss_sums=[[0.0] * towers for _ in range(steps)],
            counts=[[0] * towers for _ in range(steps)],
            times=[math.nan] * steps,
        )

    def step_losses(self, step: int) -> tuple[float, dict[int, float]]:
        """Global batch ``step``'s mean loss, and each tower's where it computed samples."""
        sums, counts = self.loss_sums[step], self.counts[step]
        total = sum(counts)
        per_tower = {t: s / c for t, (s, c) in enumerate(zip(sums, counts)) if c}
        return (sum(sums) / total if total else math.nan), per_tower


@dataclass
class ServerState:
    """The server's position in the job and its workers' state."""

    towers: int
    steps: int
    record: Record
    pending: collections.deque[Shard] = field(default_factory=collections.deque)
    next_step: int = 0  # the next global batch to cut into shards
    left: dict[int, int] = field(default_factory=dict)  # step -> shards not finished yet
    current: int = 0  # backup: the step in progress
    done: int = 0  # global batches complete
    final: bool = False  # local: the last average is done
    version: int = 0  # updates (local: averages) applied
    saved: int = 0  # global batches complete at the last checkpoint
    busy: dict[int, tuple[Shard, int]] = field(default_factory=dict)  # tower -> (shard, pulled)
    idle: set[int] = field(default_factory=set)  # towers waiting for an answer
    live: set[int] = field(default_factory=set)
    byes: set[int] = field(default_factory=set)  # towers that acknowledged STOP
    clock: list[int] = field(default_factory=list)  # results received per tower

    @classmethod
    def fresh(cls, towers: int, steps: int) -> ServerState:
        return cls(
            towers=towers,
            steps=steps,
            record=Record.empty(steps, towers),
            live=set(range(towers)),
            clock=[0] * towers,
        )

    def lead(self, tower: int) -> int:
        """How many results ``tower`` has sent beyond the slowest live tower."""
        return self.clock[tower] - min(self.clock[v] for v in self.live)
