"""Weighted averaging of tower gradients: pure functions, no process group.

``average_gradients`` keeps the input and output shape of the TensorFlow CIFAR-10 multi-GPU
trainer's function of the same name (a list per tower of ``(grad, var)`` pairs in, one list of
``(grad, var)`` pairs out), and adds per-tower sample weights: tower i with n_i samples and
mean-reduced gradient g_i contributes n_i * g_i, so the result sum(n_i g_i) / sum(n_i) is the
gradient of the mean loss over the whole global batch even when shards are uneven. (An unweighted
mean, as DDP computes it, is biased for uneven shards: pytorch/pytorch#37359.)
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

__all__ = ["average_gradients", "normalized_weights", "weighted_mean"]

GradVar = tuple[Any, Any]


def normalized_weights(weights: Sequence[float] | None, n: int) -> list[float]:
    """Per-tower weights that sum to one; ``None`` gives equal weights.

    Raises:
        ValueError: if the count differs from ``n``, a weight is negative or not finite, or all
            weights are zero.
    """
    if weights is None:
        return [1.0 / n] * n
    weights = [float(w) for w in weights]
    if len(weights) != n:
        raise ValueError(f"got {len(weights)} weights for {n} towers; give one weight per tower")
    for i, w in enumerate(weights):
        if not math.isfinite(w) or w < 0:
            raise ValueError(f"weight of tower {i} is {w}; weights must be finite and >= 0")
    total = sum(weights)
    if total <= 0:
        raise ValueError("all tower weights are zero; at least one tower must have samples")
    return [w / total for w in weights]


def weighted_mean(values: Sequence[float], weights: Sequence[float] | None = None) -> float:
    """Sample-weighted mean of per-tower scalars (e.g. losses); towers of weight 0 are ignored."""
    w = normalized_weights(weights, len(values))
    return float(sum(wi * float(v) for wi, v in zip(w, values) if wi > 0))


def _shape(x: Any) -> tuple[int, ...] | None:
    shape = getattr(x, "shape", None)
    return tuple(shape) if shape is not None else None


def _var_name(var: Any, index: int) -> str:
    if isinstance(var, str):
        return repr(var)
    shape = _shape(var)
    return f"variable {index}" + (f" (shape {list(shape)})" if shape is not None else "")


def average_gradients(
    tower_grads: Sequence[Sequence[GradVar]],
    weights: Sequence[float] | None = None,
) -> list[GradVar]:
    """Average each variable's gradient over towers, weighted by per-tower sample counts.

    Args:
        tower_grads: one list per tower of ``(grad, var)`` pairs, the variables in the same order
            in every tower. Gradients are tensors, NumPy arrays, or ``None`` (no gradient).
        weights: per-tower sample counts (or any non-negative weights); ``None`` weighs towers
            equally.

    Returns:
        One list of ``(grad, var)`` pairs: the weighted mean gradient and the variable of tower 0.
        A gradient that is ``None`` in every tower stays ``None``; ``None`` in some towers counts
        as zero there.

    Raises:
        ValueError: if towers hold different numbers of variables, a variable's shape (or name)
            differs between towers, a gradient's shape differs from its variable's, or the
            weights are invalid.

    Example:
        >>> w = torch.zeros(2)
        >>> towers = [[(torch.tensor([1.0, 1.0]), w)], [(torch.tensor([4.0, 4.0]), w)]]
        >>> average_gradients(towers, weights=[2, 1])[0][0]
        tensor([2., 2.])
    """
    if len(tower_grads) == 0:
        raise ValueError("tower_grads is empty; give one list of (grad, var) pairs per tower")
    w = normalized_weights(weights, len(tower_grads))
    reference = list(tower_grads[0])
    for t, pairs in enumerate(tower_grads):
        if len(pairs) != len(reference):
            raise ValueError(
                f"tower {t} has {len(pairs)} (grad, var) pairs but tower 0 has {len(reference)}; "
                "every tower must list the same variables in the same order"
            )

    averaged: list[GradVar] = []
    for i, per_tower in enumerate(zip(*tower_grads)):
        var0 = per_tower[0][1]
        name = _var_name(var0, i)
        grad_shape = None
        for t, (grad, var) in enumerate(per_tower):
            if var is not var0:
                if isinstance(var0, str) or isinstance(var, str):
                    if var != var0:
                        raise ValueError(
                            f"tower {t} has variable {var!r} where tower 0 has {var0!r} "
                            f"(position {i})"
                        )
                elif _shape(var) != _shape(var0):
                    raise ValueError(
                        f"tower {t}, {_var_name(var, i)}: shape differs from tower 0's "
                        f"{list(_shape(var0) or ())}"
                    )
            if grad is None:
                continue
            shape = _shape(grad)
            expected = _shape(var) if _shape(var) is not None else grad_shape
            if expected is not None and shape != expected:
                raise ValueError(
                    f"tower {t}, {name}: gradient has shape {list(shape or ())}, "
                    f"expected {list(expected)}"
                )
            grad_shape = shape
        averaged.append((_combine([g for g, _ in per_tower], w), var0))
    return averaged


def _combine(grads: Sequence[Any], w: Sequence[float]) -> Any:
    present = [(g, wi) for g, wi in zip(grads, w) if g is not None]
    if not present:
        return None
    first = present[0][0]
    if isinstance(first, np.ndarray):
        total = np.zeros_like(first, dtype=np.result_type(first.dtype, np.float32))
        for g, wi in present:
            total += wi * np.asarray(g)
        return total.astype(first.dtype, copy=False)
    acc = torch.zeros_like(first)
    for g, wi in present:
        if wi > 0:
            acc.add_(g.to(acc.device), alpha=wi)
    return acc
