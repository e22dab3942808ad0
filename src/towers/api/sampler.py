"""``towers.ddp.DistributedSampler``: torch's, without the padding that makes DDP inexact.

torch's sampler pads the dataset with repeated samples until it divides by the ranks, so an
epoch trains some samples twice. This one deals the same shuffled order (the same
``seed + epoch`` permutation, the same rank-strided dealing, so that each step's batches
together are the global batch one process would draw at the ranks' total batch size) and
keeps every sample once: ranks differ by at most one sample. Where that leaves some rank a
batch fewer, the ranks that ran out take empty steps at the next ``set_epoch`` (see
:mod:`towers.api.ddp`).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from torch.utils.data import Dataset, distributed

from .ddp import batch_size_seen, context, join_all

__all__ = ["DistributedSampler"]


class DistributedSampler(distributed.DistributedSampler):
    """``torch.utils.data.distributed.DistributedSampler``'s interface: this rank's indices of
    each epoch, every sample once (``drop_last=True``: the first ``N - N % world`` of the
    shuffled order, every rank the same count, as torch's)."""

    def __init__(
        self,
        dataset: Dataset[Any],
        num_replicas: int | None = None,
        rank: int | None = None,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = False,
    ):
        if num_replicas is None or rank is None:
            job = context()
            num_replicas = job.world_size if num_replicas is None else num_replicas
            rank = job.rank if rank is None else rank
        super().__init__(dataset, num_replicas, rank, shuffle, seed, drop_last)
        n, world = len(dataset), self.num_replicas  # type: ignore[arg-type]
        self.total_size = n - n % world if drop_last else n
        self.num_samples = len(range(self.rank, self.total_size, world))

    def __iter__(self) -> Iterator[int]:
        n = len(self.dataset)  # type: ignore[arg-type]
        if self.shuffle:
            g = torch.Generator()
            g.manual_seed(self.seed + self.epoch)
            order = torch.randperm(n, generator=g).tolist()
        else:
            order = list(range(n))
        return self._deal(order)

    def _deal(self, order: list[int]) -> Iterator[int]:
        """This rank's positions of ``order``, but never a last global batch of fewer samples
        than ranks: it would leave some rank a batch fewer than the others (the ranks would
        reach their next collective a step apart). Those few samples (at most ``world - 1``,
        others each epoch when shuffled) are left out, decided from the loader's batch size,
        which the wrapped model's first training forward tells; before that, every sample
        is dealt, and a rank that runs out first waits in empty steps at the next
        ``set_epoch``, ``barrier`` or ``destroy_process_group``."""
        world, total = self.num_replicas, self.total_size
        for p in range(self.rank, total, world):
            if p >= total - world and _in_short_tail(p, total, world):
                return
            yield order[p]

    def __len__(self) -> int:
        return self.num_samples

    def set_epoch(self, epoch: int) -> None:
        """The epoch's order; the ranks that ran out of batches in the last one first take
        empty steps beside the others' (on every rank, as torch's ``set_epoch`` is called)."""
        join_all()
        super().set_epoch(epoch)


def _in_short_tail(p: int, total: int, world: int) -> bool:
    """Whether position ``p`` is in a last global batch of fewer than ``world`` samples."""
    batch = batch_size_seen()
    if batch is None:
        return False
    tail = total % (batch * world)
    return 0 < tail < world and p >= total - tail
