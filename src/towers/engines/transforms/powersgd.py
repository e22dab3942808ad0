"""PowerSGD (Vogels, Karimireddy and Jaggi, NeurIPS 2019): low-rank sums with error feedback.

Each weight matrix ``M`` (a parameter of two or more dimensions, viewed as ``rows x rest``)
whose rank-``r`` factors are much smaller than it is summed as a rank-``r`` approximation: with
``Q`` shared by every rank,

1. ``P = sum_i M_i Q`` (one all-reduce of ``rows x r`` values per matrix), then ``P`` is
   orthonormalised (every rank gets the same ``P`` from the same sum);
2. ``Q = sum_i M_i^T P`` (one all-reduce of ``rest x r`` values);
3. ``P Q^T`` approximates ``sum_i M_i``; ``Q`` starts the next step (warm start: one power
   iteration per step tracks the gradient's leading subspace over time).

``M_i`` is this rank's gradient plus its residual: what the approximation missed (its share,
``M_i - P Q^T / W``) is added to the next step's gradient (error feedback), so nothing is lost
for good. Vectors (biases, norms), small matrices and matrices whose factors would not be at
least :data:`MIN_RATE` times smaller travel uncompressed in the first all-reduce, beside the
step's metadata, which stays exact. As in the paper's experiments and PyTorch's hook, the first
``start`` steps are plain sums (the residual stays empty), so that the early, fast-changing
gradients are not approximated.

Bytes per step: ``(rows + rest) r`` values per compressed matrix instead of ``rows x rest``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any, ClassVar

import torch

from ...comm.base import Comm
from .base import AllReduce, Bucket, BucketLayout, PerBucketState, sum_tail

__all__ = ["MIN_RATE", "PowerSGD", "PowerSGDState", "compressible"]

MIN_RATE = 2.0  # a matrix is compressed when its factors are at least this many times smaller


def compressible(shape: Sequence[int], rank: int) -> bool:
    """Whether a parameter of ``shape`` is summed as rank-``rank`` factors."""
    if len(shape) < 2:
        return False
    rows, rest = shape[0], 1
    for d in shape[1:]:
        rest *= d
    return (rows + rest) * rank * MIN_RATE < rows * rest


@dataclass(frozen=True)
class _Plan:
    """Where a bucket's compressed matrices and plain values lie."""

    matrices: list[tuple[int, int, int, int]]  # (start, stop, rows, rest) in the flat bucket
    plain: torch.Tensor  # flat positions summed uncompressed


def _plan(layout: BucketLayout, rank: int) -> _Plan:
    matrices, plain = [], []
    for shape, (start, stop) in zip(layout.shapes, layout.slots):
        if compressible(shape, rank):
            matrices.append((start, stop, shape[0], (stop - start) // shape[0]))
        else:
            plain.append(torch.arange(start, stop))
    index = torch.cat(plain) if plain else torch.zeros(0, dtype=torch.long)
    return _Plan(matrices, index)


def _orthonormal(p: torch.Tensor) -> torch.Tensor:
    """``p``'s columns made orthonormal (the same on every rank for the same ``p``)."""
    q, _ = torch.linalg.qr(p, mode="reduced")
    return q


@dataclass(kw_only=True)
class PowerSGDState(PerBucketState):
    """:class:`PowerSGD`'s state: per bucket, each matrix's ``Q`` (the warm start of the next
    step) and what the approximation left out (``error``, fed back next step)."""

    LISTS: ClassVar[tuple[str, ...]] = ("q", "error")
    q: list[list[torch.Tensor]]
    error: list[torch.Tensor | None]


class PowerSGD:
    """Rank-``rank`` PowerSGD sums after ``start`` plain steps (module doc)."""

    State = PowerSGDState  # what init returns, typed; saved as its dict

    def __init__(self, rank: int, start: int = 10, seed: int = 0):
        self.rank, self.start, self.seed = rank, start, seed
        self._plans: dict[int, _Plan] = {}

    def __repr__(self) -> str:
        return f"powersgd:{self.rank}"

    def __getstate__(self) -> dict[str, Any]:
        return {"rank": self.rank, "start": self.start, "seed": self.seed, "_plans": {}}

    def init(self, layouts: Sequence[BucketLayout]) -> PowerSGDState:
        self._plans = {lay.index: _plan(lay, self.rank) for lay in layouts}
        qs = []
        for lay in layouts:
            g = torch.Generator().manual_seed(self.seed + lay.index)
            shapes = [(rest, self.rank) for _, _, _, rest in self._plans[lay.index].matrices]
            qs.append([torch.randn(s, generator=g).to(lay.device) for s in shapes])
        return PowerSGDState(last=len(layouts) - 1, q=qs, error=[None] * len(layouts))

    def handover(self, state: PowerSGDState) -> PowerSGDState:
        """A newcomer shares the step count and ``Q``; its residual starts empty."""
        return replace(state, error=[None] * len(state.error))

    def reduce(self, state: PowerSGDState, bucket: Bucket, comm: Comm) -> tuple[Bucket, Any]:
        b = bucket.wait()
        new = state.next(b.index)
        plan = self._plans[b.index]
        if state.steps < self.start or not plan.matrices or comm.world_size == 1:
            return AllReduce().reduce(None, b, comm)[0], new
        fed = state.error[b.index]  # what the last step left out
        m = b.grads if fed is None else b.grads + fed
        mats = [m[a:z].view(rows, rest) for a, z, rows, rest in plan.matrices]
        ps = [mat @ q for mat, q in zip(mats, state.q[b.index])]
        tail = b.tail if b.tail is not None and b.tail.dtype == torch.float32 else None
        first = torch.cat([*(p.reshape(-1) for p in ps), m[plan.plain.to(m.device)]])
        if tail is not None:
            first = torch.cat([first, tail])
        works = [comm.all_reduce_sum(first)]
        if tail is None:
            works += sum_tail(b, comm)

        def second(done: Bucket) -> Bucket:
            at, summed_ps = 0, []
            for p in ps:
                summed_ps.append(_orthonormal(first[at : at + p.numel()].view_as(p)))
                at += p.numel()
            n_plain = plan.plain.numel()
            done.grads[plan.plain.to(m.device)] = first[at : at + n_plain]
            if tail is not None:
                tail.copy_(first[at + n_plain :])
            qs = [mat.T @ p for mat, p in zip(mats, summed_ps)]
            flat = torch.cat([q.reshape(-1) for q in qs])
            comm.all_reduce_sum(flat).wait()
            q_sums = _split(flat, qs)
            error = m.clone()
            for (a, z, _, _), p, q_sum in zip(plan.matrices, summed_ps, q_sums):
                approx = (p @ q_sum.T).reshape(-1)
                done.grads[a:z] = approx
                error[a:z] -= approx / comm.world_size
            error[plan.plain.to(m.device)] = 0.0
            new.q[b.index] = q_sums  # the next step's start (warm start)
            new.error[b.index] = error
            return done

        return b.after(works).then(second), new


def _split(flat: torch.Tensor, like: list[torch.Tensor]) -> list[torch.Tensor]:
    out, at = [], 0
    for t in like:
        out.append(flat[at : at + t.numel()].view_as(t))
        at += t.numel()
    return out
