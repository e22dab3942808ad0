"""Fewer bytes per gradient value: the codecs of the compressed sums, as pure functions.

A codec turns a flat float32 chunk into a fixed number of bytes and back. Every chunk of ``n``
values encodes to :meth:`Codec.nbytes` bytes, whatever the values, so that a collective can
move the encoded chunks of every rank in one tensor of known size.

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

import torch

__all__ = ["CODECS", "FP16_TARGET", "Codec"]

FP16_TARGET = 2.0**14  # the largest magnitude after scaling: far from 65504, and normal


def _scale_bytes(scale: torch.Tensor) -> torch.Tensor:
    return scale.reshape(1).to(torch.float32).view(torch.uint8)


def _read_scale(data: torch.Tensor) -> torch.Tensor:
    return data[-4:].clone().view(torch.float32)[0]


@dataclass(frozen=True)
class Codec:
    """A fixed-size encoding of float32 chunks; see the module doc."""

    name: str

    def nbytes(self, n: int) -> int:
        """Bytes that a chunk of ``n`` values encodes to."""
        if self.name == "int8":
            return n + 4
        return 2 * n + (4 if self.name == "fp16" else 0)

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` (flat, float) as :meth:`nbytes` ``uint8`` values."""
        x = x.float()
        if self.name == "bf16":
            return x.to(torch.bfloat16).view(torch.uint8)
        peak = x.abs().max() if x.numel() else torch.zeros((), device=x.device)
        if not torch.isfinite(peak):
            scale = torch.tensor(float("nan"), device=x.device)  # decodes to NaN: skipped
        else:
            full = FP16_TARGET if self.name == "fp16" else 127.0
            scale = torch.where(peak > 0, peak / full, torch.ones_like(peak))
        if self.name == "fp16":
            body = (x / scale).to(torch.float16).view(torch.uint8)
        else:
            body = torch.round(x / scale).clamp_(-127, 127).to(torch.int8).view(torch.uint8)
        return torch.cat([body, _scale_bytes(scale)])

    def decode(self, data: torch.Tensor, n: int) -> torch.Tensor:
        """The float32 values of a chunk of ``n`` values encoded in ``data``."""
        if self.name == "bf16":
            return data.view(torch.bfloat16).float()
        scale = _read_scale(data)
        if self.name == "fp16":
            body = data[: 2 * n].view(torch.float16)
        else:
            body = data[:n].view(torch.int8)
        return body.float() * scale


CODECS = {name: Codec(name) for name in ("bf16", "fp16", "int8")}
