"""Gradient transforms: how a bucket of gradients is reduced over the towers (see ``base``).

The compressions a user names with ``compress=`` are classes registered in
:data:`COMPRESSIONS` (:mod:`.compressions`); a new one is its transform in a module here plus
one class there.
"""

from __future__ import annotations

from .base import (
    AllReduce,
    Bucket,
    BucketLayout,
    Chain,
    GradientTransform,
    PerBucketState,
    allreduce,
    chain,
    loaded_state,
    saved_state,
    start_from,
    sum_tail,
)
from .coded import CodedState, CodedSum
from .compressions import COMPRESSIONS, Compression, compression
from .powersgd import PowerSGD, PowerSGDState, compressible
from .topk import TopKState, TopKSum, topk

__all__ = [
    "COMPRESSIONS",
    "AllReduce",
    "Bucket",
    "BucketLayout",
    "Chain",
    "CodedState",
    "CodedSum",
    "Compression",
    "GradientTransform",
    "PerBucketState",
    "PowerSGD",
    "PowerSGDState",
    "TopKState",
    "TopKSum",
    "allreduce",
    "chain",
    "check_transform",
    "compressible",
    "compression",
    "loaded_state",
    "saved_state",
    "start_from",
    "sum_tail",
    "topk",
]


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
