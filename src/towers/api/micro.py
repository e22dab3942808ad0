"""Accumulated micro-batches of unequal sizes weighed as one process weighs them: Lightning's
``accumulate_grad_batches``, and a ``towers.ddp`` script's ``no_sync()`` under towers' batch
sampler, through ``towers.ddp.DistributedDataParallel.weigh_micro_batches``.

A script that accumulates K micro-batches divides each one's mean loss by K, so one process
on the ranks' batches put together computes the gradient of

    (1/K) * sum over k of (mean loss over N_k samples),

where N_k is the samples of every rank's k-th micro-batch. Weighting each rank by its samples
since the last step, as a single backward is weighted, gives that only when the micro-batches
hold equal samples: an epoch's short last batch in a step of its own is exact, one that shares
its step is not (1.1e-3 off in a Lightning fit). So each forward of an accumulated step learns
N_k (one number summed over the ranks) and its backward's gradients are scaled by n_k / N_k
as they arrive (a hook on each parameter, before they are accumulated); the step then
multiplies the accumulated gradient by N, the step's samples over all ranks, which its
division by N undoes.

A step is accumulated when its forward runs inside ``no_sync()`` (or with
``require_backward_grad_sync = False``), or follows one that did. Every rank must then run the
same forwards in every step, to the end: a rank that ran out of batches first would meet those
sums with its empty steps. So a ``towers.ddp`` script weighs this way only once its loader
takes :class:`~towers.api.sampler.DistributedBatchSampler`, under which every rank has the same
batches; with other samplers its ranks may run out unevenly. A step of one forward is weighted
as before, with no extra sum.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch

from ..comm.base import Comm

__all__ = ["MicroBatches"]


class MicroBatches:
    """The global sizes of an accumulated step's micro-batches, and the scale of the backward
    running now (see the module doc)."""

    def __init__(self, params: Iterable[torch.Tensor], comm: Callable[[], Comm]):
        self.params = [p for p in params if p.requires_grad]
        self.comm = comm
        self.totals: list[int] = []  # N_k of each micro-batch of the step so far
        self.factor = 1.0  # n_k / N_k for the backward of the last forward
        self._hooks: list[torch.utils.hooks.RemovableHandle] = []

    @property
    def active(self) -> bool:
        """The step so far has accumulated micro-batches."""
        return bool(self.totals)

    def forward(self, samples: int) -> None:
        """A forward of ``samples`` samples in an accumulated step: learn its micro-batch's size
        over all ranks, and scale its backward by this rank's share."""
        if not self._hooks:
            self._hooks = [p.register_hook(self._scaled) for p in self.params]
        device = self.params[0].device if self.params else torch.device("cpu")
        count = torch.tensor([float(samples)], dtype=torch.float64, device=device)
        self.comm().all_reduce_sum(count).wait()
        total = round(float(count.item()))
        self.totals.append(total)
        self.factor = samples / total if total > 0 else 0.0

    def _scaled(self, grad: torch.Tensor) -> torch.Tensor | None:
        return None if self.factor == 1.0 else grad * self.factor

    def scale(self) -> int:
        """What the step multiplies the accumulated gradient by: its samples over all ranks."""
        return sum(self.totals)

    def reset(self) -> None:
        """The step is done: the next starts unaccumulated."""
        self.totals, self.factor = [], 1.0

    def remove(self) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks = []
        self.reset()
