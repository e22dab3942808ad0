"""Fewer bytes per gradient value: the codecs of the compressed sums, one class each.

A codec (:class:`Codec`: ``nbytes``, ``encode``, ``decode``) turns a flat float32 chunk into a
fixed number of bytes and back. Every chunk of ``n`` values encodes to :meth:`Codec.nbytes`
bytes, whatever the values, so that a collective can move the encoded chunks of every rank in
one tensor of known size. Each codec is one class; a new one is a class here, handed to
:class:`~towers.engines.transforms.coded.CodedSum` by the compression that names it.

- ``bf16``: bfloat16 values (8 exponent bits: float32's range, 8 bits of precision); no scale.
- ``fp16``: float16 values after scaling the chunk so that its largest magnitude becomes
  :data:`FP16_TARGET`: no value can overflow float16's range (65504), and small ones keep as
  much precision as float16 allows. The scale travels with the chunk (4 bytes).
- ``int8``: symmetric 8-bit quantisation with one scale per chunk, ``q = round(x / s)``,
  ``s = max|x| / 127`` (4 bytes for the scale).
- ``topk:F[:BITS]`` (:class:`TopKCodec`): sparse. The values are cut into chunks of
  :data:`TOPK_CHUNK`; of each chunk only the ``ceil(F * chunk)`` largest magnitudes travel, each
  as its place in the chunk (2 bytes) and its value: float32 (``BITS`` 32), or ``BITS`` bits, a
  sign and a level between the chunk's smallest and largest kept magnitude (two float32 scales
  per chunk). Everything else decodes as zero. Being sparse, encoded chunks cannot be summed
  as they travel: the transform gathers every rank's and sums them after decoding.

A chunk that holds a NaN or an infinity decodes with a NaN or infinity in it again, so the
step's finite check still sees it (a compressed sum must never turn a bad step into a good one).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol

import torch

__all__ = [
    "CODECS",
    "FP16_TARGET",
    "TOPK_BITS",
    "TOPK_CHUNK",
    "Bf16Codec",
    "Codec",
    "Fp16Codec",
    "Int8Codec",
    "TopKCodec",
]

FP16_TARGET = 2.0**14  # the largest magnitude after scaling: far from 65504, and normal


class Codec(Protocol):
    """A fixed-size encoding of float32 chunks; see the module doc."""

    @property
    def name(self) -> str:
        """What ``compress=`` calls it: ``"int8"``."""

    def nbytes(self, n: int) -> int:
        """Bytes that a chunk of ``n`` values encodes to."""

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` (flat, float) as :meth:`nbytes` ``uint8`` values."""

    def decode(self, data: torch.Tensor, n: int) -> torch.Tensor:
        """The float32 values of a chunk of ``n`` values encoded in ``data``."""


@dataclass(frozen=True)
class Bf16Codec:
    """bfloat16 values: float32's range, so no scale to send."""

    name = "bf16"

    def nbytes(self, n: int) -> int:
        return 2 * n

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        return x.float().to(torch.bfloat16).view(torch.uint8)

    def decode(self, data: torch.Tensor, n: int) -> torch.Tensor:
        return data.view(torch.bfloat16).float()


def _scale(x: torch.Tensor, full: float) -> torch.Tensor:
    """The chunk's scale: its largest magnitude becomes ``full``; NaN if it is not finite."""
    peak = x.abs().max() if x.numel() else torch.zeros((), device=x.device)
    if not torch.isfinite(peak):
        return torch.tensor(float("nan"), device=x.device)  # decodes to NaN: the step is skipped
    return torch.where(peak > 0, peak / full, torch.ones_like(peak))


def _with_scale(body: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return torch.cat([body, scale.reshape(1).to(torch.float32).view(torch.uint8)])


def _read_scale(data: torch.Tensor) -> torch.Tensor:
    return data[-4:].clone().view(torch.float32)[0]


@dataclass(frozen=True)
class Fp16Codec:
    """float16 values of the chunk scaled to :data:`FP16_TARGET`, and the scale."""

    name = "fp16"

    def nbytes(self, n: int) -> int:
        return 2 * n + 4

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        x = x.float()
        scale = _scale(x, FP16_TARGET)
        return _with_scale((x / scale).to(torch.float16).view(torch.uint8), scale)

    def decode(self, data: torch.Tensor, n: int) -> torch.Tensor:
        return data[: 2 * n].view(torch.float16).float() * _read_scale(data)


@dataclass(frozen=True)
class Int8Codec:
    """Symmetric 8-bit quantisation with one scale per chunk, and the scale."""

    name = "int8"

    def nbytes(self, n: int) -> int:
        return n + 4

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        x = x.float()
        scale = _scale(x, 127.0)
        body = torch.round(x / scale).clamp_(-127, 127).to(torch.int8).view(torch.uint8)
        return _with_scale(body, scale)

    def decode(self, data: torch.Tensor, n: int) -> torch.Tensor:
        return data[:n].view(torch.int8).float() * _read_scale(data)


CODECS: dict[str, Codec] = {c.name: c for c in (Bf16Codec(), Fp16Codec(), Int8Codec())}


TOPK_CHUNK = 4096  # values per chunk of top-k: a place in it fits 2 bytes (SparseLoCo's size)
TOPK_BITS = (2, 4, 8, 32)  # the widths top-k's values are packed in; 32: float32 as they are


@dataclass(frozen=True)
class TopKCodec:
    """The ``ceil(share * chunk)`` largest magnitudes of each chunk, ``bits`` bits a value.

    Every chunk of :attr:`chunk` values (the last may be shorter; a shorter input is one chunk)
    keeps the same number of values, so every input of ``n`` values encodes to
    :meth:`nbytes` bytes: the places (int16), the values (float32, or ``bits``-bit codes packed
    into bytes), and for ``bits`` < 32 each chunk's smallest and largest kept magnitude.

    A code is ``2 * level + sign``: the magnitude is rounded to the nearest of ``2**(bits-1)``
    levels spread evenly from the chunk's smallest kept magnitude to its largest (at 2 bits:
    either one). A chunk holding a NaN or an infinity decodes with NaN in it.
    """

    share: float
    bits: int = 32
    chunk: int = TOPK_CHUNK

    def __post_init__(self) -> None:
        assert 0.0 < self.share < 1.0 and self.bits in TOPK_BITS, (self.share, self.bits)
        assert 1 <= self.chunk <= 32768, self.chunk  # a place must fit an int16

    @property
    def name(self) -> str:
        return f"topk:{self.share!r}" + ("" if self.bits == 32 else f":{self.bits}")

    def layout(self, n: int) -> tuple[int, int, int]:
        """``(size, chunks, kept)``: values per chunk, chunks, and values kept per chunk."""
        size = max(1, min(self.chunk, n))
        kept = min(size, max(1, math.ceil(self.share * size - 1e-9)))
        return size, -(-n // size), kept

    def _sizes(self, n: int) -> tuple[int, int, int]:
        """Bytes of the places, the values and the scales."""
        _, chunks, kept = self.layout(n)
        m = chunks * kept
        if self.bits == 32:
            return 2 * m, 4 * m, 0
        return 2 * m, -(-m * self.bits // 8), 8 * chunks

    def nbytes(self, n: int) -> int:
        return sum(self._sizes(n))

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        x = x.detach().reshape(-1).float()
        n = x.numel()
        size, chunks, kept = self.layout(n)
        rows = torch.zeros(chunks * size, device=x.device)
        rows[:n] = x
        rows = rows.view(chunks, size)
        key = torch.nan_to_num(rows.abs(), nan=math.inf)  # a NaN is kept: it must arrive
        key.view(-1)[n:] = -1.0  # padding never outranks a value
        places = torch.topk(key, kept, dim=1, sorted=False).indices
        values = rows.gather(1, places)
        bad = ~torch.isfinite(rows).all(1, keepdim=True)
        parts = [places.to(torch.int16).reshape(-1).view(torch.uint8)]
        if self.bits == 32:
            values = torch.where(bad, math.nan, values)
            return torch.cat([*parts, values.reshape(-1).view(torch.uint8)])
        real = key.gather(1, places) >= 0
        mags = values.abs()
        lo = torch.where(real, mags, math.inf).min(1, keepdim=True).values
        hi = mags.max(1, keepdim=True).values
        lo, hi = torch.where(bad, math.nan, lo), torch.where(bad, math.nan, hi)
        top = 2 ** (self.bits - 1) - 1
        span = torch.where(hi > lo, hi - lo, torch.ones_like(hi))
        level = torch.round((mags - lo) / span * top).nan_to_num_(0.0).clamp_(0, top)
        codes = level.to(torch.uint8) * 2 + (values < 0).to(torch.uint8)
        scales = torch.cat([lo.reshape(-1), hi.reshape(-1)]).view(torch.uint8)
        return torch.cat([*parts, _pack(codes.reshape(-1), self.bits), scales])

    def decode(self, data: torch.Tensor, n: int) -> torch.Tensor:
        size, chunks, kept = self.layout(n)
        a, b, _ = self._sizes(n)
        places = data[:a].clone().view(torch.int16).long().view(chunks, kept)
        if self.bits == 32:
            values = data[a : a + b].clone().view(torch.float32).view(chunks, kept)
        else:
            codes = _unpack(data[a : a + b], self.bits, chunks * kept).view(chunks, kept)
            scales = data[a + b :].clone().view(torch.float32).view(2, chunks, 1)
            lo, hi = scales[0], scales[1]
            top = 2 ** (self.bits - 1) - 1
            mags = lo + (codes // 2).float() * ((hi - lo) / top)
            values = torch.where(codes % 2 == 1, -mags, mags)
        rows = torch.zeros(chunks, size, device=data.device)
        rows.scatter_(1, places, values)
        return rows.view(-1)[:n]


def _pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """``bits``-bit codes (``uint8``), ``8 // bits`` to a byte, the first in the lowest bits."""
    per = 8 // bits
    padded = torch.zeros(-(-codes.numel() // per) * per, dtype=torch.uint8, device=codes.device)
    padded[: codes.numel()] = codes
    lanes = padded.view(-1, per)
    out = torch.zeros(lanes.shape[0], dtype=torch.uint8, device=codes.device)
    for i in range(per):
        out |= lanes[:, i] << (bits * i)
    return out


def _unpack(data: torch.Tensor, bits: int, count: int) -> torch.Tensor:
    """The first ``count`` codes that :func:`_pack` packed into ``data``."""
    per, mask = 8 // bits, (1 << bits) - 1
    lanes = [(data >> (bits * i)) & mask for i in range(per)]
    return torch.stack(lanes, 1).reshape(-1)[:count]
