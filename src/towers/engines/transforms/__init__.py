"""Gradient transforms: how a bucket of gradients is reduced over the towers (see ``base``).

The compressions a user names with ``compress=`` are registered in :data:`COMPRESSIONS`; a new
one is a module here plus one entry there.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from ...core.codecs import Bf16Codec, Fp16Codec, Int8Codec
from .base import (
    AllReduce,
    Bucket,
    BucketLayout,
    Chain,
    GradientTransform,
    allreduce,
    chain,
    start_from,
    sum_tail,
)
from .coded import CodedSum
from .powersgd import PowerSGD, compressible

__all__ = [
    "COMPRESSIONS",
    "AllReduce",
    "Bucket",
    "BucketLayout",
    "Chain",
    "CodedSum",
    "GradientTransform",
    "PowerSGD",
    "allreduce",
    "chain",
    "check_transform",
    "compression",
    "start_from",
    "sum_tail",
]

# name -> (what its argument means or None, how to build it)
COMPRESSIONS: dict[str, tuple[str | None, Callable[[int | None], GradientTransform]]] = {
    "bf16": (None, lambda _: CodedSum(Bf16Codec())),
    "fp16": (None, lambda _: CodedSum(Fp16Codec())),
    "int8": (None, lambda _: CodedSum(Int8Codec(), feedback=True)),
    "powersgd": ("R, the rank of the approximation (>= 1)", lambda r: PowerSGD(r)),  # type: ignore[arg-type]
}


def _valid() -> str:
    return ", ".join(f'"{n}:R"' if a else f'"{n}"' for n, (a, _) in COMPRESSIONS.items())


def compression(spec: str, shapes: Sequence[Sequence[int]] = ()) -> GradientTransform:
    """The transform ``compress=spec`` names, checked against the model's parameter ``shapes``.

    Raises:
        ValueError: for an unknown or malformed name (listing the valid ones), or a PowerSGD
            rank below 1 or too high for every weight matrix of the model.
    """
    if not isinstance(spec, str):
        raise TypeError(f"compress must be a string such as 'bf16', got {type(spec).__name__}")
    name, sep, arg = spec.strip().partition(":")
    if name not in COMPRESSIONS:
        raise ValueError(f"unknown compression {spec!r}; valid ones are {_valid()}")
    meaning, build = COMPRESSIONS[name]
    if meaning is None:
        if sep:
            raise ValueError(f"compression {name!r} takes no argument, got {spec!r}")
        return build(None)
    try:
        value = int(arg)
    except ValueError:
        raise ValueError(
            f"compression {name!r} needs an integer argument {meaning}; got {spec!r}"
        ) from None
    if value < 1:
        raise ValueError(f"compression {name!r} needs {meaning}; got {spec!r}")
    matrices = [tuple(s) for s in shapes if len(s) >= 2]
    if shapes and not any(compressible(s, value) for s in matrices):
        largest = max(matrices, key=lambda s: s[0] * _rest(s), default=None)
        where = (
            f"the largest weight is {'x'.join(map(str, largest))}"
            if largest
            else "the model has no weight matrix"
        )
        raise ValueError(
            f"compress={spec!r}: rank {value} leaves nothing to compress ({where}; a matrix is "
            f"compressed when its rank-R factors are at least 2x smaller than it): choose a "
            "smaller rank, or compress='bf16'"
        )
    return build(value)


def _rest(shape: Sequence[int]) -> int:
    out = 1
    for d in shape[1:]:
        out *= d
    return out


def check_transform(transform: object, where: str = "transform") -> GradientTransform:
    """``transform``, or the default sum for ``None``; ``TypeError`` for anything else."""
    if transform is None:
        return AllReduce()
    if not isinstance(transform, GradientTransform):
        raise TypeError(
            f"{where} must be a gradient transform (an object with init(layouts) and "
            f"reduce(state, bucket, comm), see towers.transforms), got {type(transform).__name__}"
        )
    return transform
