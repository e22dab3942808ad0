"""Compressed sums on the wire: ``bf16``, ``fp16`` and ``int8`` (with error feedback).

A plain all-reduce moves ``2 (W-1)/W`` times a bucket's float32 bytes per rank. Here the bucket
is cut into ``W`` chunks, one per rank, and the sum runs in two collectives that move encoded
chunks (:mod:`towers.core.codecs`):

1. all-to-all: rank r receives every rank's encoded chunk r and sums them **in float32**;
2. all-gather: every rank receives every rank's encoded sum.

The same ``2 (W-1)/W`` chunks per rank travel, at 2 bytes a value (``bf16``, ``fp16``) or about
1 (``int8``) instead of 4. Summing in float32 keeps the rounding to one encoding per stage: no
sum of W values is ever rounded to 16 or 8 bits along the way.

``int8`` keeps error feedback (Seide et al. 2014; Karimireddy et al. 2019, "Error Feedback
Fixes SignSGD"): what quantisation dropped from this rank's bucket (stage 1) and from the chunk
of the sum it encoded (stage 2) is added to the next step's values, so no part of a gradient is
lost for good, only delayed. The residuals are this rank's own state, committed only when a step
is applied. The step's metadata (:attr:`Bucket.tail`) is summed exactly beside the chunks.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from ...comm.base import Comm
from ...core.codecs import Codec
from .base import AllReduce, Bucket, BucketLayout, PerBucketState, sum_tail

__all__ = ["CodedState", "CodedSum"]


def _chunked(x: torch.Tensor, world: int) -> tuple[torch.Tensor, int]:
    """``x`` zero-padded to ``world`` equal chunks, and the chunk length."""
    n = -(-x.numel() // world)
    if x.numel() == n * world:
        return x, n
    padded = torch.zeros(n * world, dtype=x.dtype, device=x.device)
    padded[: x.numel()] = x
    return padded, n


@dataclass(kw_only=True)
class CodedState(PerBucketState):
    """:class:`CodedSum`'s state: per bucket, what this tower's encoding dropped (``sent``)
    and what its encoding of its chunk of the sum dropped (``summed``); ``at``: the chunk
    (rank, world) this tower encodes."""

    LISTS: ClassVar[tuple[str, ...]] = ("sent", "summed")
    sent: list[torch.Tensor | None]
    summed: list[torch.Tensor | None]
    at: tuple[int, int] = (0, 0)


class CodedSum:
    """The sum over towers with every value encoded by ``codec`` on the wire (module doc);
    ``feedback``: carry what the encoding dropped to the next step."""

    State = CodedState  # what init returns, typed; saved as its dict

    def __init__(self, codec: Codec, feedback: bool = False):
        self.codec = codec
        self.feedback = feedback

    def __repr__(self) -> str:
        return self.codec.name

    def init(self, layouts: Sequence[BucketLayout]) -> CodedState:
        """No residual yet (``None``: zeros of the right length, made at first use)."""
        n = len(layouts)
        return CodedState(sent=[None] * n, summed=[None] * n, last=n - 1)

    def reduce(self, state: CodedState, bucket: Bucket, comm: Comm) -> tuple[Bucket, Any]:
        b = bucket.wait()
        world = comm.world_size
        new = state.next(b.index)
        if world == 1 or b.grads.dtype != torch.float32:
            return AllReduce().reduce(None, b, comm)[0], new
        at = (comm.rank, world)  # this rank encodes chunk `rank` of `world` of the sum
        new.at = at
        if tuple(state.at) != at:  # after a regroup: another chunk is this rank's now
            new.summed = [None] * len(new.summed)
        x = b.grads
        sent = new.sent[b.index]
        if self.feedback and sent is not None:
            x = x + sent
        chunks, n = _chunked(x, world)
        size = self.codec.nbytes(n)
        send = torch.empty(world * size, dtype=torch.uint8, device=x.device)
        for r in range(world):
            send[r * size : (r + 1) * size] = self.codec.encode(chunks[r * n : (r + 1) * n])
        if self.feedback:
            dropped = chunks - self._decode_all(send, world, n)
            new.sent[b.index] = dropped[: x.numel()].clone()
        received = torch.empty_like(send)
        works = [comm.all_to_all(received, send), *sum_tail(b, comm)]

        def gather(done: Bucket) -> Bucket:
            mine = self._decode_all(received, world, n).view(world, n).sum(0)
            left = new.summed[b.index]
            if self.feedback and left is not None:
                mine = mine + left
            encoded = self.codec.encode(mine)
            if self.feedback:
                new.summed[b.index] = mine - self.codec.decode(encoded, n)
            gathered = torch.empty(world * size, dtype=torch.uint8, device=x.device)
            comm.all_gather(gathered, encoded).wait()
            done.grads.copy_(self._decode_all(gathered, world, n)[: done.grads.numel()])
            return done

        return b.after(works).then(gather), new

    def _decode_all(self, data: torch.Tensor, world: int, n: int) -> torch.Tensor:
        size = self.codec.nbytes(n)
        parts = [self.codec.decode(data[r * size : (r + 1) * size], n) for r in range(world)]
        return torch.cat(parts)
