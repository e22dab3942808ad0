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

A chunk that holds a NaN or an infinity decodes with a NaN or infinity in it again, so the
step's finite check still sees it (a compressed sum must never turn a bad step into a good one).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

__all__ = ["CODECS", "FP16_TARGET", "Bf16Codec", "Codec", "Fp16Codec", "Int8Codec"]

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
