"""Balanced splits: each global batch cut over the towers in proportion to their measured speed.

towers weights every tower's gradient by its samples, so the averaged gradient is the gradient
of the whole global batch for *any* split of it: the split can follow the towers' speeds and a
synchronous step stays exact. A step then takes about ``B / (v_1 + ... + v_N)`` instead of
``(B / N) / v_slowest`` (``v_i``: tower i's samples per second).

Every tower measures its own compute time for its shard (forward and backward, no waits) and
the time rides in the step's metadata, so after each step every rank holds every tower's
samples and seconds, identically, and derives the same next split from them with
:class:`Balancer`: pure arithmetic, no communication. It smooths each tower's seconds and
samples apart (exponential averages, whose ratio is the seconds per sample: one step of a
process that is throttled now and then, by a cgroup's quota say, measures far off; the first
step after a (re)start is skipped: it pays for one-time costs), keeps every tower at least
:data:`FLOOR` of an even share (a tower given nothing could never be measured again), and
moves the split only when some tower's share would change by more than :data:`DEADBAND` of
the batch, so that timing noise does not make the split oscillate. :func:`sizes` turns
shares into integer shard sizes that sum to the batch.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from .split import batch_size, cut

__all__ = ["DEADBAND", "FLOOR", "SMOOTHING", "Balancer", "shard_of", "sizes", "split_sizes"]

SMOOTHING = 0.2  # weight of the newest step in a tower's smoothed seconds and samples
FLOOR = 0.1  # a tower's least share, as a fraction of an even share (1 / towers)
DEADBAND = 0.02  # the least change of some tower's share (a fraction of the batch) applied


def sizes(batch: int, shares: Sequence[float]) -> list[int]:
    """Integer shard sizes summing to ``batch``, in proportion to ``shares`` (largest
    remainders, ties to the lower index): the same numbers on every rank.

    Example::

        >>> sizes(10, [0.5, 0.25, 0.25])
        [5, 3, 2]
    """
    if batch < 0 or not shares or any(not s >= 0 for s in shares) or sum(shares) <= 0:
        raise ValueError(f"cannot cut {batch} samples in shares {list(shares)}")
    total = math.fsum(shares)
    exact = [batch * s / total for s in shares]
    out = [math.floor(x) for x in exact]
    order = sorted(range(len(shares)), key=lambda i: (-(exact[i] - out[i]), i))
    for i in order[: batch - sum(out)]:
        out[i] += 1
    return out


def split_sizes(batch: int, shares: Sequence[float]) -> list[int]:
    """The shard sizes of a global batch of ``batch`` samples in ``shares``: :func:`sizes`,
    but a batch smaller than the towers is cut as :func:`towers.split` cuts it (one sample
    each, the first towers first), and in a larger one every tower gets at least one sample
    (taken from the largest shard), so that no tower starves for want of a share.

    Example::

        >>> split_sizes(8, [0.97, 0.01, 0.01, 0.01])
        [5, 1, 1, 1]
    """
    if batch < len(shares):
        return sizes(batch, [1.0] * len(shares))
    out = sizes(batch, shares)
    for i in [i for i, n in enumerate(out) if n == 0]:
        donor = max(range(len(out)), key=lambda j: (out[j], -j))
        out[donor] -= 1
        out[i] = 1
    return out


def shard_of(batch: Any, rank: int, world: int, shares: Sequence[float] | None = None) -> Any:
    """Tower ``rank``'s shard of ``batch`` (samples along dim 0) among ``world`` towers: in
    ``shares`` where the split is balanced for them, else :func:`towers.split`'s (the same
    sizes as :func:`split_sizes` of equal shares)."""
    if shares is None or len(shares) != world:
        shares = [1.0] * world
    return cut(batch, split_sizes(batch_size(batch), shares))[rank]


class Balancer:
    """Each tower's share of the next global batch, from the speeds measured so far.

    Every rank holds one and feeds it the same numbers (:meth:`observe`), so every rank
    computes the same :meth:`split`. Its state is saved in checkpoints and sent to the
    members behind in an elastic job (:meth:`state_dict`).
    """

    def __init__(self, towers: int):
        if towers < 1:
            raise ValueError(f"a balance needs at least one tower, got {towers}")
        self.towers = towers
        self.seconds: list[float | None] = [None] * towers  # smoothed compute seconds a step
        self.samples: list[float | None] = [None] * towers  # and smoothed samples a step
        self.seen = [0] * towers  # measurements received (the first is skipped)
        self.shares = [1.0 / towers] * towers

    def observe(self, samples: Sequence[int], seconds: Sequence[float]) -> None:
        """One step's shard sizes and compute seconds, every tower's."""
        if len(samples) != self.towers or len(seconds) != self.towers:
            raise ValueError(
                f"{len(samples)} shard sizes and {len(seconds)} times for {self.towers} towers"
            )
        for i, (n, t) in enumerate(zip(samples, seconds)):
            if n <= 0 or not t > 0 or not math.isfinite(t):
                continue
            self.seen[i] += 1
            if self.seen[i] == 1:
                continue  # a (re)start: allocations, caches, lazy set-up
            self.seconds[i] = _smoothed(self.seconds[i], t)
            self.samples[i] = _smoothed(self.samples[i], n)
        self._reshare()

    def _reshare(self) -> None:
        if any(t is None for t in self.seconds):
            return  # some tower is not measured yet: keep the split
        speeds = [n / t for n, t in zip(self.samples, self.seconds) if n and t]
        target = _floored([v / sum(speeds) for v in speeds], FLOOR / self.towers)
        if max(abs(a - b) for a, b in zip(target, self.shares)) > DEADBAND:
            self.shares = target

    def split(self, batch: int) -> list[int]:
        """The shard sizes of a global batch of ``batch`` samples, by tower."""
        return split_sizes(batch, self.shares)

    def state_dict(self) -> dict[str, Any]:
        return {
            "seconds": list(self.seconds),
            "samples": list(self.samples),
            "seen": list(self.seen),
            "shares": list(self.shares),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if len(state["shares"]) != self.towers:
            return  # saved with another number of towers: measure afresh
        self.seconds = list(state["seconds"])
        self.samples = list(state["samples"])
        self.seen = list(state["seen"])
        self.shares = list(state["shares"])


def _smoothed(old: float | None, new: float) -> float:
    return new if old is None else (1 - SMOOTHING) * old + SMOOTHING * new


def _floored(shares: list[float], floor: float) -> list[float]:
    """``shares`` with none below ``floor``, the rest scaled down to keep the sum at one."""
    fixed: set[int] = set()
    while True:
        low = {i for i, s in enumerate(shares) if s < floor and i not in fixed}
        if not low:
            return shares
        fixed |= low
        free = [i for i in range(len(shares)) if i not in fixed]
        rest = sum(shares[i] for i in free)
        left = 1.0 - floor * len(fixed)
        shares = [floor if i in fixed else shares[i] * left / rest for i in range(len(shares))]
