"""One rank's synchronous step: replicate the model, accumulate, average, guard, update.

The pieces that ``towers.train``'s synchronous loop and the own-loop ``Context`` share. A step is
``arm()`` before the last backward (so that averaging overlaps it), ``add()`` of the tower's loss
sum and samples, ``reduce()`` (the weighted average and the non-finite guard, identical on every
rank), then ``apply()`` (the optimizer step unless the step is skipped, and clearing gradients).
"""

from __future__ import annotations

import torch
from torch import nn

from ...comm.base import Comm
from ...core.step import StepResult
from ..broadcast import broadcast_module, verify_same_model
from .gradsync import DEFAULT_BUCKET_BYTES, GradientSync

__all__ = ["SyncStep"]


class SyncStep:
    """The synchronous step of one rank over ``comm``; see the module doc."""

    def __init__(self, comm: Comm, device: torch.device):
        self.comm = comm
        self.device = device
        self.sync: GradientSync | None = None
        self.samples = 0  # this tower's samples since the last reduce()
        self.loss_sum = 0.0  # and their loss sum

    def replicate(self, model: nn.Module, bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> nn.Module:
        """Give every rank rank 0's parameters and buffers, and attach the averaging hooks."""
        model.to(self.device)
        verify_same_model(model, self.comm)
        broadcast_module(model, self.comm)
        self.remove()
        self.sync = GradientSync(model.parameters(), self.comm, bucket_bytes)
        if not self.sync.params:
            raise ValueError("the model has no trainable parameters (requires_grad=True)")
        return model

    @property
    def params(self) -> list[torch.Tensor]:
        return self._sync().params

    def _sync(self) -> GradientSync:
        if self.sync is None:
            raise RuntimeError("call ctx.replicate(model) first")
        return self.sync

    def arm(self) -> None:
        """The next backward is this step's last: average its gradients as they arrive."""
        self._sync().arm()

    def add(self, loss_sum: float, samples: int) -> None:
        """Count a backpropagated micro-batch: its loss summed over ``samples`` samples."""
        self.loss_sum += loss_sum
        self.samples += samples

    def reduce(self, stamp: torch.Tensor | None = None, regroup: bool = False) -> StepResult:
        """Average the gradients over all towers, weighted by samples; the same on every rank.

        Afterwards each parameter's ``.grad`` holds the global batch's gradient, unless the step
        is skipped (a loss or gradient was not finite on some tower). ``stamp``: see
        :meth:`GradientSync.finish`. ``regroup``: this rank asks all to regroup after the step
        (see :attr:`regroup`).
        """
        sync = self._sync()
        try:
            return sync.finish(self.samples, self.loss_sum, stamp, regroup)
        finally:
            self.samples, self.loss_sum = 0, 0.0

    @property
    def regroup(self) -> bool:
        """Whether some rank asked, in the last step, that every rank regroup after it."""
        return self._sync().regroup

    def apply(self, result: StepResult, optimizer: torch.optim.Optimizer) -> None:
        """Step ``optimizer`` unless ``result`` is skipped, then clear the gradients."""
        if not result.skipped:
            optimizer.step()
        self.zero_grad()

    def zero_grad(self) -> None:
        for p in self._sync().params:
            p.grad = None

    def remove(self) -> None:
        """Detach the hooks (the model trains on without averaging)."""
        if self.sync is not None:
            self.sync.remove()
            self.sync = None
