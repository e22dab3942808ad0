"""The compressions that ``compress=`` names, one class each, registered by name.

A compression is a :class:`~towers.core.specs.Spec` (its name, its argument's fields, a line of
help; parsed, and refused with the valid ones listed, by :mod:`towers.core.specs`) that builds a
gradient transform (:meth:`Compression.transform`) and may refuse a model it has nothing to
compress in (:meth:`Compression.check_model`), before any worker starts. A new compression is
its transform in a module of this package plus one class here with ``@register``;
``compress=``, ``ctx.replicate(compress=...)``, ``towers compare --link``, the command's help
and the error messages pick it up by name.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TypeVar, cast

from ...core.codecs import TOPK_BITS, TOPK_CHUNK, Bf16Codec, Fp16Codec, Int8Codec
from ...core.specs import Int, Real, Spec, add, parse
from .base import GradientTransform
from .coded import CodedSum
from .powersgd import PowerSGD, compressible
from .topk import TopKSum

__all__ = ["COMPRESSIONS", "Compression", "compression", "register"]


@dataclass(frozen=True)
class Compression(Spec):
    """A compression: one subclass per name, one instance per argument."""

    kind = "compression"
    keyword = "compress"
    valid = "valid ones are"

    def transform(self) -> GradientTransform:
        """A fresh transform that sums a bucket with this compression."""
        raise NotImplementedError

    def check_model(self, shapes: Sequence[tuple[int, ...]]) -> None:
        """``ValueError`` if a model of these parameter shapes leaves nothing to compress."""


# name -> compression class, in the order the error messages and the help list them
COMPRESSIONS: dict[str, type[Compression]] = {}

C = TypeVar("C", bound=type[Compression])


def register(cls: C) -> C:
    """Make ``cls`` the compression of its ``name`` (a class decorator)."""
    return add(COMPRESSIONS, cls)


def compression(spec: str, shapes: Sequence[Sequence[int]] = ()) -> GradientTransform:
    """The transform ``compress=spec`` names, checked against the model's parameter ``shapes``.

    Raises:
        ValueError: for an unknown or malformed name (listing the valid ones), or an argument
            that the model leaves nothing to compress with (a PowerSGD rank too high for
            every weight matrix).

    Example::

        >>> compression("int8")
        int8
    """
    chosen = parse(COMPRESSIONS, spec, Compression)
    if shapes:
        chosen.check_model([tuple(s) for s in shapes])
    return chosen.transform()


@register
class Bf16(Compression):
    """``bf16``: every value sent as bfloat16, summed in float32."""

    name = "bf16"
    help = "bfloat16 values, 2 bytes each, summed in float32"

    def transform(self) -> GradientTransform:
        return CodedSum(Bf16Codec())


@register
class Fp16(Compression):
    """``fp16``: every chunk scaled, its values sent as float16, summed in float32."""

    name = "fp16"
    help = "float16 values of each chunk scaled not to overflow, 2 bytes each"

    def transform(self) -> GradientTransform:
        return CodedSum(Fp16Codec())


@register
class Int8(Compression):
    """``int8``: 8-bit values with a scale per chunk; what rounding drops goes to the next step."""

    name = "int8"
    help = "8-bit values with a scale per chunk, 1 byte each, with error feedback"

    def transform(self) -> GradientTransform:
        return CodedSum(Int8Codec(), feedback=True)


@register
@dataclass(frozen=True)
class PowerSgd(Compression):
    """``powersgd:R``: the :class:`~towers.engines.transforms.powersgd.PowerSGD` transform,
    weight matrices summed as rank-R approximations."""

    name = "powersgd"
    title = "PowerSGD"
    help = "weight matrices summed as rank-R approximations, with error feedback"
    example = "powersgd:4"
    meaning = "R, the rank of the approximation (>= 1)"
    minimum = 1

    rank: int = 1

    def transform(self) -> GradientTransform:
        return cast(GradientTransform, PowerSGD(self.rank))

    def check_model(self, shapes: Sequence[tuple[int, ...]]) -> None:
        matrices = [s for s in shapes if len(s) >= 2]
        if any(compressible(s, self.rank) for s in matrices):
            return
        largest = max(matrices, key=lambda s: s[0] * _rest(s), default=None)
        where = (
            f"the largest weight is {'x'.join(map(str, largest))}"
            if largest
            else "the model has no weight matrix"
        )
        raise ValueError(
            f"compress={str(self)!r}: rank {self.rank} leaves nothing to compress ({where}; a "
            "matrix is compressed when its rank-R factors are at least 2x smaller than it): "
            "choose a smaller rank, or compress='bf16'"
        )


@register
@dataclass(frozen=True)
class TopK(Compression):
    """``topk:F[:BITS]``: the :class:`~towers.engines.transforms.topk.TopKSum` transform, the
    largest F of each chunk of 4096 values, BITS bits each (default 32), with error feedback."""

    name = "topk"
    title = "top-k"
    help = (
        f"the largest F of each chunk of {TOPK_CHUNK} values, BITS bits each (2, 4, 8 or 32, "
        "the default), with error feedback"
    )
    example = "topk:0.1"
    fields = (
        Real("F, the share of each chunk's values sent (0 < F < 1)", above=0.0, below=1.0),
        Int("BITS, the bits of each value sent (2, 4, 8 or 32)", minimum=2, optional=True),
    )

    share: float = 0.5
    bits: int = 32

    def check(self) -> None:
        if self.bits not in TOPK_BITS:
            widths = ", ".join(map(str, TOPK_BITS[:-1])) + f" or {TOPK_BITS[-1]}"
            raise ValueError(
                f"compression {str(self)!r}: BITS must be {widths} (the widths the values are "
                f"packed in), got {self.bits}; e.g. {self.name}:{self.share!r}:2"
            )

    def transform(self) -> GradientTransform:
        return cast(GradientTransform, TopKSum(self.share, self.bits))


def _rest(shape: Sequence[int]) -> int:
    out = 1
    for d in shape[1:]:
        out *= d
    return out
