"""Splitting a global batch into towers: pure functions, no process group.

A batch is a tensor (or NumPy array) or a nested tuple/list/dict of them, all sharing dim 0.
Unlike ``tf.split`` in the TensorFlow tower examples, any batch size is accepted: shard sizes
differ by at most one (larger shards first), and each tower is weighted by its sample count so
that N towers together compute exactly the full-batch gradient.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar

import numpy as np
import torch

from .messages import shorten

Batch = TypeVar("Batch")

__all__ = [
    "batch_size",
    "concat",
    "cut",
    "leaves",
    "map_batch",
    "shard_bounds",
    "shard_sizes",
    "split",
]


def shard_sizes(total: int, n: int) -> list[int]:
    """Sizes of ``n`` contiguous shards of ``total`` samples: larger first, differing by <= 1."""
    if n < 1:
        raise ValueError(f"the number of towers must be >= 1, got {n}")
    if total < 0:
        raise ValueError(f"a batch cannot have {total} samples")
    base, extra = divmod(total, n)
    return [base + 1 if i < extra else base for i in range(n)]


def shard_bounds(total: int, n: int) -> list[tuple[int, int]]:
    """``(start, stop)`` of each of the ``n`` shards of ``total`` samples."""
    bounds = []
    start = 0
    for size in shard_sizes(total, n):
        bounds.append((start, start + size))
        start += size
    return bounds


def _is_leaf(x: Any) -> bool:
    return isinstance(x, (torch.Tensor, np.ndarray))


def leaves(batch: Any, path: str = "batch") -> list[tuple[str, Any]]:
    """Every (path, leaf) of a nested batch in a fixed order; rejects leaves that aren't arrays."""
    if _is_leaf(batch):
        return [(path, batch)]
    if isinstance(batch, Mapping):
        out = []
        for key, value in batch.items():
            out.extend(leaves(value, f"{path}[{key!r}]"))
        return out
    if isinstance(batch, (tuple, list)):
        out = []
        for i, value in enumerate(batch):
            out.extend(leaves(value, f"{path}[{i}]"))
        return out
    raise ValueError(
        f"{path} is a {type(batch).__name__}, which cannot be split along a batch dimension; "
        "a batch must be a tensor or NumPy array, or a tuple/list/dict of them"
    )


def batch_size(batch: Any) -> int:
    """The common dim-0 size of every tensor in ``batch``.

    Raises:
        ValueError: if ``batch`` holds no tensor, a 0-dim tensor, a leaf that is not a tensor or
            array, or tensors whose dim-0 sizes differ.
    """
    found = leaves(batch)
    if not found:
        raise ValueError("the batch holds no tensor to split")
    sizes = {}
    for path, leaf in found:
        if leaf.ndim == 0:
            raise ValueError(
                f"{path} is a 0-dim tensor; every tensor in a batch needs a batch dimension (dim 0)"
            )
        sizes[path] = leaf.shape[0]
    if len(set(sizes.values())) > 1:
        listing = shorten(", ".join(f"{p}: {s}" for p, s in sizes.items()), 200)
        raise ValueError(f"tensors in a batch must share their dim-0 size; got {listing}")
    return next(iter(sizes.values()))


def map_batch(fn: Callable[[Any], Any], batch: Any) -> Any:
    """Apply ``fn`` to every leaf of ``batch``, keeping its structure (tuple, list, dict)."""
    if _is_leaf(batch):
        return fn(batch)
    if isinstance(batch, Mapping):
        return type(batch)({k: map_batch(fn, v) for k, v in batch.items()})  # type: ignore[call-arg]
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):  # namedtuple
        return type(batch)(*(map_batch(fn, v) for v in batch))
    if isinstance(batch, (tuple, list)):
        return type(batch)(map_batch(fn, v) for v in batch)
    raise ValueError(f"cannot map over a {type(batch).__name__}")


def split(batch: Batch, n: int) -> list[Batch]:
    """Split ``batch`` along dim 0 into ``n`` contiguous shards, one per tower.

    Shard sizes differ by at most one, larger shards first; a batch of fewer than ``n`` samples
    gives empty trailing shards (never an error). Every shard keeps the structure of ``batch``.
    Shards are views, not copies.

    Args:
        batch: a tensor or NumPy array, or a nested tuple/list/dict of them sharing dim 0.
        n: the number of towers, >= 1.

    Returns:
        A list of ``n`` shards.

    Raises:
        ValueError: on mismatched dim-0 sizes, a leaf that is not a tensor or array, or ``n < 1``.

    Example:
        >>> x = torch.arange(10)
        >>> [s.tolist() for s in split(x, 3)]
        [[0, 1, 2, 3], [4, 5, 6], [7, 8, 9]]
    """
    if isinstance(n, bool) or not isinstance(n, int):
        raise TypeError(f"n must be an int, got {type(n).__name__}")
    return [
        map_batch(functools.partial(_rows, start=a, stop=b), batch)
        for a, b in shard_bounds(batch_size(batch), n)
    ]


def cut(batch: Batch, sizes: Sequence[int]) -> list[Batch]:
    """Split ``batch`` along dim 0 into contiguous shards of the given ``sizes`` (which must add
    up to its samples): :func:`split` with sizes of the caller's choosing, e.g. a balanced
    split's (:mod:`towers.core.balance`).

    Example:
        >>> [s.tolist() for s in cut(torch.arange(5), [3, 0, 2])]
        [[0, 1, 2], [], [3, 4]]
    """
    total = batch_size(batch)
    if sum(sizes) != total or any(n < 0 for n in sizes):
        raise ValueError(f"shard sizes {list(sizes)} do not cut a batch of {total} samples")
    shards, start = [], 0
    for n in sizes:
        shards.append(map_batch(functools.partial(_rows, start=start, stop=start + n), batch))
        start += n
    return shards


def _rows(t: Any, start: int, stop: int) -> Any:
    return t[start:stop]


def concat(outputs: Sequence[Any], device: torch.device | None = None) -> Any:
    """Concatenate per-tower outputs (tensor, or tuple/list/dict of tensors) along dim 0."""
    first = outputs[0]
    if isinstance(first, torch.Tensor):
        if first.ndim == 0:
            raise ValueError(
                "a tower returned a 0-dim tensor, which cannot be concatenated along dim 0; "
                "return per-sample values (e.g. reduction='none') and reduce after combining"
            )
        return torch.cat([o.to(device) if device is not None else o for o in outputs], dim=0)
    if isinstance(first, Mapping):
        return type(first)({k: concat([o[k] for o in outputs], device) for k in first})  # type: ignore[call-arg]
    if isinstance(first, (tuple, list)):
        parts = [concat([o[i] for o in outputs], device) for i in range(len(first))]
        if isinstance(first, tuple) and hasattr(first, "_fields"):
            return type(first)(*parts)
        return type(first)(parts)
    raise ValueError(
        f"a tower returned a {type(first).__name__}; "
        "outputs must be tensors or tuples/dicts of tensors"
    )
