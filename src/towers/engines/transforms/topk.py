"""Sparse sums: ``topk:F[:BITS]``, the largest values of each chunk, with error feedback.

Each tower sends only the ``ceil(F * 4096)`` largest magnitudes of each chunk of 4096 values
of its bucket, quantised to BITS bits (:class:`~towers.core.codecs.TopKCodec`). What it did
not send, and what quantisation rounded off, is its *residual*: added to the next step's
values before they are selected (error feedback: Seide et al. 2014; Stich et al. 2018,
"Sparsified SGD with Memory"), so that no part of a gradient is lost for good, only delayed.
With ``decay`` below 1 the residual is scaled by it first: SparseLoCo's accumulator
(Sarfi et al. 2025, arXiv 2508.15706), ``e <- decay * e + x``, send ``c = Q(TopK(e))``,
``e <- e - c``, which stands in for DiLoCo's outer momentum.

Two towers' sparse values lie at different places, so they cannot be summed on the way as a
ring all-reduce sums dense ones. Every tower's encoded bucket (all the same size) is
all-gathered instead, and every tower decodes each and adds them up in rank order: the same
numbers in the same order, so every tower holds the same sum to the last bit. A tower receives
``W - 1`` encoded buckets, each about ``F * (2 + BITS / 8)`` bytes a value.

The step's metadata (:attr:`Bucket.tail`) is summed exactly beside them, so the weighting of
the towers, the reported losses and the finite check are those of an uncompressed step. The
residuals are this tower's own, committed only when a step is applied, saved in checkpoints;
a replacement worker in an elastic job starts with none.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from ...comm.base import Comm
from ...core.codecs import TOPK_BITS, TOPK_CHUNK, TopKCodec
from .base import AllReduce, Bucket, BucketLayout, PerBucketState, sum_tail

__all__ = ["TopKState", "TopKSum", "topk"]


@dataclass(kw_only=True)
class TopKState(PerBucketState):
    """:class:`TopKSum`'s state: per bucket, what the top-k left out (fed back, decayed)."""

    LISTS: ClassVar[tuple[str, ...]] = ("residual",)
    residual: list[torch.Tensor | None]


class TopKSum:
    """The sum over towers of each tower's top ``share`` of every chunk, ``bits`` bits a value,
    with error feedback whose residual is multiplied by ``decay`` each step (module doc).

    Example::

        >>> TopKSum(0.02, bits=2)
        topk:0.02:2
    """

    State = TopKState  # what init returns, typed; saved as its dict

    def __init__(self, share: float, bits: int = 32, decay: float = 1.0, chunk: int = TOPK_CHUNK):
        if not 0.0 < decay <= 1.0:
            raise ValueError(f"decay must be in (0, 1], got {decay!r}")
        self.codec = TopKCodec(share, bits, chunk)
        self.decay = decay

    def __repr__(self) -> str:
        return self.codec.name + ("" if self.decay == 1.0 else f" (decay {self.decay!r})")

    def init(self, layouts: Sequence[BucketLayout]) -> TopKState:
        """No residual yet (``None``: zeros, made at first use)."""
        n = len(layouts)
        return TopKState(residual=[None] * n, last=n - 1)

    def reduce(self, state: TopKState, bucket: Bucket, comm: Comm) -> tuple[Bucket, Any]:
        b = bucket.wait()
        new = state.next(b.index)
        world = comm.world_size
        if world == 1:  # nothing travels: the sum is this tower's values, exactly
            return AllReduce().reduce(None, b, comm)[0], new
        n = b.grads.numel()
        values = b.grads.float()
        residual = state.residual[b.index]
        if residual is not None:
            values = residual * self.decay + values
        payload = self.codec.encode(values)
        new.residual[b.index] = values - self.codec.decode(payload, n)
        size = payload.numel()
        gathered = torch.empty(world * size, dtype=torch.uint8, device=payload.device)
        works = [comm.all_gather(gathered, payload), *sum_tail(b, comm)]

        def land(done: Bucket) -> Bucket:
            total = self.codec.decode(gathered[:size], n)
            for r in range(1, world):  # rank order: the same sum, bit for bit, on every tower
                total += self.codec.decode(gathered[r * size : (r + 1) * size], n)
            done.grads.copy_(total)
            return done

        return b.after(works).then(land), new


def topk(share: float, bits: int = 32, decay: float = 1.0) -> TopKSum:
    """The top-k sum with error feedback (module doc): what ``compress="topk:F[:BITS]"`` names
    when ``decay`` is 1, and with ``decay=0.95`` and 2 bits the transform of SparseLoCo.

    Example::

        >>> topk(1 / 64, bits=2, decay=0.95)
        topk:0.015625:2 (decay 0.95)
    """
    if not 0.0 < share < 1.0:
        raise ValueError(f"share must be between 0 and 1 (both excluded), got {share!r}")
    if bits not in TOPK_BITS:
        raise ValueError(f"bits must be one of {', '.join(map(str, TOPK_BITS))}, got {bits!r}")
    return TopKSum(share, bits, decay)
