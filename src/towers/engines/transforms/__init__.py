"""Gradient transforms: how a bucket of gradients is reduced over the towers (see ``base``)."""

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

__all__ = [
    "AllReduce",
    "Bucket",
    "BucketLayout",
    "Chain",
    "GradientTransform",
    "allreduce",
    "chain",
    "check_transform",
    "start_from",
    "sum_tail",
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
