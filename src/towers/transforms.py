"""Gradient transforms: how each bucket of a synchronous step's gradients is reduced.

The seam for compression and other reductions, in the spirit of DDP's communication hooks and
optax's transforms: a transform is an object with ``init(layouts) -> state`` and
``reduce(state, bucket, comm) -> (bucket, state)``; :func:`chain` composes them. Pass one as
``towers.train(..., transform=...)`` or ``ctx.replicate(model, transform=...)``. A bucket comes
in holding this tower's gradients weighted by its samples and must come out holding their sum
over the towers; towers divides by the total sample count, checks that every value is finite
and hands the mean to the parameters. See docs/architecture.md ("Where to add things").

Example:
    >>> class Half:  # every gradient halved, then summed as usual
    ...     def init(self, layouts):
    ...         return None
    ...     def reduce(self, state, bucket, comm):
    ...         bucket.grads.mul_(0.5)
    ...         return bucket, state
    >>> towers.train(..., transform=chain(Half(), allreduce()))  # doctest: +SKIP

``compression("powersgd:4")`` builds the transform that ``compress="powersgd:4"`` names;
``topk(share, bits, decay)`` the top-k sum with error feedback, also with a decayed residual
(SparseLoCo's, ``mode="sparseloco:H"``).
"""

from .engines.transforms import (
    Bucket,
    BucketLayout,
    GradientTransform,
    allreduce,
    chain,
    compression,
    sum_tail,
    topk,
)

__all__ = [
    "Bucket",
    "BucketLayout",
    "GradientTransform",
    "allreduce",
    "chain",
    "compression",
    "sum_tail",
    "topk",
]
