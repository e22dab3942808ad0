"""BatchNorm over the whole global batch: statistics summed over the towers, weighted by samples.

A BatchNorm layer in training normalises with the mean and variance of the batch it sees and
folds them into its running statistics. Split over towers, each tower would see only its shard:
other normalisation, other gradients, other running statistics than one process over the global
batch. :func:`convert_batchnorm` swaps every BatchNorm layer for :class:`TowerBatchNorm`, which
sums ``count, sum(x), sum(x^2)`` per channel over the towers (float64, one small all-reduce) in
the forward pass and ``sum(dy), sum(dy * x_hat)`` in the backward pass, through the job's group
(:mod:`towers.engines.sync.group`), which hands them to its current communicator (shared memory
or the process group alike); in an elastic job, a peer lost during a forward pass makes the
step that follows be redone among the survivors. The result equals one process over the global
batch, uneven shards included.

Why not ``torch.nn.SyncBatchNorm``: it needs a process group and a GPU in training, and it
weighs towers' statistics by sample count in the forward pass but leaves the backward to DDP's
division by world size (the bias pytorch/pytorch#37359 describes for the gradient). Here towers
backpropagate ``n_i * L_i`` and the gradient sum is divided by the global sample count, so the
backward formula below, with sums over all towers, is exact.

Every tower must run the forward and backward of every step (a tower with no samples would not,
and the others would wait for it): every global batch needs at least one sample per tower.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch
from torch import nn

__all__ = ["Summer", "TowerBatchNorm", "convert_batchnorm"]


class Summer(Protocol):
    """Sums a tensor in place over the towers, now (the step's group)."""

    def sum_now(self, tensor: torch.Tensor) -> None: ...


def _channel_dims(x: torch.Tensor) -> list[int]:
    return [0, *range(2, x.dim())]


def _shape(v: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    return v.view(1, -1, *([1] * (x.dim() - 2)))


class _Normalise(torch.autograd.Function):
    """``y = (x - mean) * invstd * w + b`` with the global statistics; backward sums too."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        x: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor,
        mean: torch.Tensor,
        invstd: torch.Tensor,
        total: float,
        group: Summer,
    ) -> torch.Tensor:
        x_hat = (x - _shape(mean, x)) * _shape(invstd, x)
        ctx.save_for_backward(x_hat, weight, invstd)
        ctx.total, ctx.group = total, group
        return x_hat * _shape(weight, x) + _shape(bias, x)

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> tuple[Any, ...]:  # type: ignore[override]
        x_hat, weight, invstd = ctx.saved_tensors
        dims = _channel_dims(dy)
        sum_dy = dy.sum(dims)
        sum_dy_xhat = (dy * x_hat).sum(dims)
        both = torch.cat([sum_dy, sum_dy_xhat]).double()
        ctx.group.sum_now(both)
        c = sum_dy.numel()
        mean_dy = _shape((both[:c] / ctx.total).to(dy.dtype), dy)
        mean_dy_xhat = _shape((both[c:] / ctx.total).to(dy.dtype), dy)
        dx = (dy - mean_dy - x_hat * mean_dy_xhat) * _shape(weight * invstd, dy)
        return dx, sum_dy_xhat, sum_dy, None, None, None, None


class TowerBatchNorm(nn.modules.batchnorm._BatchNorm):
    """A BatchNorm layer (any dimension) whose training statistics span every tower."""

    def __init__(self, source: nn.modules.batchnorm._BatchNorm, group: Summer):
        super().__init__(
            source.num_features,
            source.eps,
            source.momentum,  # type: ignore[arg-type]
            source.affine,
            source.track_running_stats,
        )
        # The same Parameter and buffer objects: an optimizer built before still holds them.
        self.weight, self.bias = source.weight, source.bias
        for name in ("running_mean", "running_var", "num_batches_tracked"):
            setattr(self, name, getattr(source, name))
        self.training = source.training
        self.group = group

    def _check_input_dim(self, input: torch.Tensor) -> None:
        if input.dim() < 2:
            raise ValueError(f"expected at least 2D input (got {input.dim()}D input)")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training:
            # Evaluation communicates nothing (towers may evaluate different numbers of
            # batches); a layer without running statistics normalises over its own batch.
            return super().forward(x)
        self._check_input_dim(x)
        dims = _channel_dims(x)
        xd = x.detach().double()
        count = torch.tensor([x.numel() / max(1, x.shape[1])], dtype=torch.float64)
        stats = torch.cat([count.to(x.device), xd.sum(dims), xd.square().sum(dims)])
        self.group.sum_now(stats)
        c = x.shape[1]
        total = float(stats[0])
        mean = stats[1 : c + 1] / total
        var = (stats[c + 1 :] / total - mean.square()).clamp_min(0.0)
        if self.training and self.track_running_stats:
            self._update_running(mean, var, total)
        invstd = (var + self.eps).rsqrt()
        weight = self.weight if self.weight is not None else torch.ones_like(mean, dtype=x.dtype)
        bias = self.bias if self.bias is not None else torch.zeros_like(mean, dtype=x.dtype)
        return _Normalise.apply(  # type: ignore[no-any-return]
            x, weight, bias, mean.to(x.dtype), invstd.to(x.dtype), total, self.group
        )

    @torch.no_grad()
    def _update_running(self, mean: torch.Tensor, var: torch.Tensor, total: float) -> None:
        assert self.running_mean is not None and self.running_var is not None
        factor = self.momentum
        if self.num_batches_tracked is not None:
            self.num_batches_tracked.add_(1)
            if factor is None:  # cumulative moving average, as torch does
                factor = 1.0 / float(self.num_batches_tracked)
        unbiased = var * (total / max(total - 1.0, 1.0))
        rm, rv = self.running_mean, self.running_var
        rm.mul_(1 - factor).add_(mean.to(rm.dtype), alpha=factor)  # type: ignore[operator]
        rv.mul_(1 - factor).add_(unbiased.to(rv.dtype), alpha=factor)  # type: ignore[operator]


def convert_batchnorm(model: nn.Module, group: Summer) -> list[str]:
    """Swap every BatchNorm layer of ``model`` (in place) for a :class:`TowerBatchNorm`.

    Parameters and buffers keep their names and objects, so state dicts and optimizers built
    before are unaffected. Returns the names of the swapped layers.
    """
    swapped = []
    for name, module in list(model.named_modules()):
        for child_name, child in list(module.named_children()):
            if isinstance(child, nn.modules.batchnorm._BatchNorm) and not isinstance(
                child, TowerBatchNorm
            ):
                setattr(module, child_name, TowerBatchNorm(child, group))
                swapped.append(f"{name}.{child_name}" if name else child_name)
    return swapped
