"""Each bucket summed for its owners only, where the optimizer's state is sharded
(``shard_optimizer=True`` over a process group): the gradient's bytes of a reduce-scatter.

Sharded, each tower steps only its part of the parameters, so it needs only its part of the
summed gradient; the parameters it updates reach the others in the gather after the step. An
all-reduce of the whole gradient followed by that gather moves 1.5 times an all-reduce's bytes;
summing each part for its owner alone (a reduce-scatter: half an all-reduce) and then the
gather (the other half) moves exactly an all-reduce's, DDP's.

Here the parts follow the buckets: rank ``r`` of ``W`` owns elements ``[r * c, (r + 1) * c)`` of
every bucket of ``n`` elements, ``c = ceil(n / W)`` (:func:`owned_parts`), so that each part is
one contiguous piece of a bucket: all-to-alls send every rank its piece of each bucket, and
the owner adds the ``W`` pieces in rank order. The rest of the bucket is left zero. On CPUs a
piece goes in calls of :data:`~towers.engines.shard_gather.PIECE` elements a rank, all started
at once, as the gather's are (see there why); on a GPU, in one call.

The user's own ``clip_grad_norm_`` and ``GradScaler`` still see the whole model: the ranks
all-gather each piece's squared 2-norm and largest magnitude per parameter (and whether it is
finite, so that they decide the step alike), and once the step is decided each parameter's
gradient outside this tower's part holds stand-ins for the rest of the summed gradient
(:func:`owners_step`), so that every parameter's gradient has the 2-norm and the largest
magnitude of the global batch's gradient on every tower. Its values outside the tower's part
are not the gradient's.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch

from ...comm.base import Comm, DistComm
from ...core.step import StepResult, Tally, apply_sums
from ..shard import Part, ShardedState
from ..shard_gather import PIECE
from .base import Bucket, BucketLayout, sum_tail

__all__ = ["ScatterToOwners", "owned_parts", "owners_step", "scatter_for"]


def _chunk(numel: int, world: int) -> int:
    return max(1, -(-numel // world))


def _piece(numel: int, world: int, rank: int) -> tuple[int, int]:
    """Rank ``rank``'s piece ``[lo, hi)`` of a bucket of ``numel`` elements (empty past its end)."""
    c = _chunk(numel, world)
    return rank * c, min((rank + 1) * c, numel)


def owned_parts(layouts: Sequence[BucketLayout], world: int) -> list[list[Part]]:
    """Each rank's parts when rank ``r`` owns piece ``r`` of every bucket."""
    owned: list[list[Part]] = [[] for _ in range(world)]
    for layout in layouts:
        for r in range(world):
            lo, hi = _piece(layout.numel, world, r)
            for index, (start, stop) in zip(layout.params, layout.slots, strict=True):
                a, z = max(lo, start), min(hi, stop)
                if a < z:
                    owned[r].append(Part(index, a - start, z - start))
    for parts in owned:
        parts.sort(key=lambda p: (p.index, p.start))
    return owned


def scatter_for(sharding: ShardedState | None, transform: Any, comm: Comm, elastic: bool) -> Any:
    """The transform a sharded job's sums take: :class:`ScatterToOwners` where the ranks sum
    over a process group (across hosts: where bytes count) with no transform of the user's,
    else ``transform`` (shared memory moves no bytes on a link; two levels and compressions
    reduce in their own ways; an elastic job cuts its parts anew at every change)."""
    plain = transform is None and not elastic and isinstance(comm, DistComm)
    return ScatterToOwners(sharding) if sharding is not None and plain else transform


class ScatterToOwners:
    """The sum of piece ``r`` of every bucket on rank ``r`` alone (see the module doc); it cuts
    ``sharding``'s parts to match when the buckets are planned."""

    def __init__(self, sharding: ShardedState):
        self.sharding = sharding

    def init(self, layouts: Sequence[BucketLayout]) -> None:
        self.sharding.recut(owned_parts(layouts, self.sharding.world))
        return None

    def reduce(self, state: Any, bucket: Bucket, comm: Comm) -> tuple[Bucket, Any]:
        b = bucket.wait()
        world, rank, n = comm.world_size, comm.rank, b.grads.numel()
        c = _chunk(n, world)
        send = b.grads if n == c * world else torch.cat([b.grads, b.grads.new_zeros(c * world - n)])
        rows = send.view(world, c)
        k = c if b.grads.device.type == "cuda" else PIECE  # each rank's elements per call
        pieces = []
        for j in range(0, c, k):
            piece = rows[:, j : j + k].contiguous() if k < c else rows
            got = torch.empty_like(piece)
            pieces.append((j, got, comm.all_to_all(got.view(-1), piece.view(-1))))
        works = sum_tail(b, comm)

        def summed() -> Bucket:
            lo, hi = _piece(n, world, rank)
            mine = torch.empty(c, dtype=b.grads.dtype, device=b.grads.device)
            for j, got, work in pieces:
                work.wait()
                torch.sum(got, 0, out=mine[j : j + got.shape[1]])
            for work in works:
                work.wait()
            b.grads.zero_()
            b.grads[lo:hi].copy_(mine[: max(0, hi - lo)])
            return Bucket(b.index, b.grads, b.tail, b.whole)

        return Bucket(b.index, b.grads, b.tail, b.whole, summed), state

    def __repr__(self) -> str:
        return "scatter_to_owners()"


def owners_step(
    transform: ScatterToOwners,
    comm: Comm,
    tally: Tally,
    sums: Sequence[tuple[torch.Tensor, Sequence[tuple[int, int, int]]]],
    divided: bool,
) -> StepResult:
    """Decide a step whose sums each rank holds its piece of: every rank's piece finite (one
    all-gather of each piece's squared 2-norm and largest magnitude per parameter), then the
    division and the stand-ins that give each gradient the global batch's 2-norm and largest
    magnitude (:func:`_fill`)."""
    params, world = transform.sharding.params, comm.world_size
    mine = _pieces(len(params), sums, comm)
    views = torch.empty(world * mine.numel(), dtype=torch.float64, device=params[0].device)
    comm.all_gather(views, mine.to(params[0].device)).wait()
    every = views.cpu().view(world, 2, -1)  # [rank, (squares | peaks), parameter + 1]
    finite = bool(every[:, 0, -1].sum() == 0)
    result = apply_sums(params, tally, sums, finite, divided)
    if not result.skipped:
        scale = 1.0 if divided else float(tally.total or 1)
        others = torch.cat([every[: comm.rank], every[comm.rank + 1 :]])  # the other pieces
        rest = others[:, 0, :-1].sum(0) / scale**2
        peaks = others[:, 1, :-1].max(0).values if len(others) else torch.zeros(len(params))
        _fill(params, transform.sharding.mine(), rest, peaks / scale)
    return result


def _pieces(count: int, sums: Sequence[tuple[torch.Tensor, Any]], comm: Comm) -> torch.Tensor:
    """Over this rank's piece of the summed buckets: each parameter's squared 2-norm (in
    float64), then whether any is not finite (a value that is not makes its square sum so);
    each parameter's largest magnitude, then 0. Only the piece is read: the rest is zero."""
    out = torch.zeros(2, count + 1, dtype=torch.float64)
    for flat, slots in sums:
        lo, hi = _piece(flat.numel(), comm.world_size, comm.rank)
        for i, start, stop in slots:
            a, z = max(start, lo), min(stop, hi)
            if a < z:
                piece = flat[a:z]
                norm = float(torch.linalg.vector_norm(piece, dtype=torch.float64))
                out[0, i] += norm * norm  # inf past float64's range (where ** 2 would raise)
                out[1, i] = max(float(out[1, i]), float(torch.linalg.vector_norm(piece, math.inf)))
    out[0, -1] = 0.0 if bool(torch.isfinite(out[0, :-1]).all()) else 1.0
    return out.view(-1)


def _fill(
    params: Sequence[torch.Tensor],
    parts: Sequence[Part],
    rests: torch.Tensor,
    peaks: torch.Tensor,
) -> None:
    """Give each parameter's gradient outside this tower's part stand-ins for the rest of the
    global batch's gradient: ``k - 1`` elements of the others' largest magnitude ``m`` and one
    of the remainder, ``k = ceil(rest**2 / m**2)``, so that the gradient's 2-norm and largest
    magnitude (``clip_grad_norm_``'s default and ``norm_type=inf``) are the global batch's;
    ``rests`` and ``peaks``: each parameter's squared 2-norm and largest magnitude over the
    other ranks' pieces."""
    owned = {part.index: part for part in parts}  # a parameter meets a rank's piece once
    for i, p in enumerate(params):
        if p.grad is None:
            continue
        flat = p.grad.view(-1)
        part = owned.get(i)
        lo, hi = (part.start, part.stop) if part is not None else (0, 0)
        outside = flat.numel() - (hi - lo)
        if outside == 0:
            continue  # wholly this tower's
        rest, m = float(rests[i]), float(peaks[i])
        if rest == 0.0 or m == 0.0:
            continue
        k = min(outside, max(1, math.ceil(rest / (m * m) - 1e-9)))
        last = math.sqrt(max(0.0, rest - (k - 1) * m * m))
        before = min(k, lo)  # the stand-ins: first before this tower's part, then after it
        flat[:before].fill_(m)
        flat[hi : hi + k - before].fill_(m)
        flat[k - 1 if k <= lo else hi + k - before - 1] = last
