"""``towers.ddp.DistributedSampler``: torch's, without the padding that makes DDP inexact;
``towers.ddp.DistributedBatchSampler``: each step's global batch in the ranks' balanced shares.

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

from ..core.balance import split_sizes
from .balance import check_balance, choose_balance
from .ddp import batch_size_seen, context, join_all, weigh_micro_batches, wrapped_state

__all__ = ["DistributedBatchSampler", "DistributedSampler"]


def epoch_order(dataset: Dataset[Any], shuffle: bool, seed: int, epoch: int) -> list[int]:
    """The dataset's indices in an epoch's order: torch's ``DistributedSampler``'s permutation
    of ``seed + epoch`` (or as they are, unshuffled)."""
    n = len(dataset)  # type: ignore[arg-type]
    if not shuffle:
        return list(range(n))
    g = torch.Generator()
    g.manual_seed(seed + epoch)
    return torch.randperm(n, generator=g).tolist()


class DistributedSampler(distributed.DistributedSampler):
    """``torch.utils.data.distributed.DistributedSampler``'s interface: this rank's indices of
    each epoch, every sample once (``drop_last=True``: the first ``N - N % world`` of the
    shuffled order, every rank the same count, as torch's).

    The ranks' global batches must end together, or one rank would reach its next collective
    a step before the others. Where the epoch's last global batch holds fewer samples than
    there are ranks, it would leave some rank without a batch: those few samples (at most
    ``world - 1``, other ones each epoch when shuffled) are left out. That needs the loader's
    batch size: ``batch_size=`` gives it (Lightning's strategy passes it), else the wrapped
    model's first training forward tells it, and until then every sample is dealt (a rank
    that runs out first waits in empty steps at the next ``set_epoch``, ``barrier`` or
    ``destroy_process_group``). ``batch_drop_last=True``, for a loader with ``drop_last=True``,
    leaves out an incomplete last global batch whole, as one process's loader would.
    """

    def __init__(
        self,
        dataset: Dataset[Any],
        num_replicas: int | None = None,
        rank: int | None = None,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = False,
        *,
        batch_size: int | None = None,
        batch_drop_last: bool = False,
    ):
        if num_replicas is None or rank is None:
            job = context()
            num_replicas = job.world_size if num_replicas is None else num_replicas
            rank = job.rank if rank is None else rank
        super().__init__(dataset, num_replicas, rank, shuffle, seed, drop_last)
        n, world = len(dataset), self.num_replicas  # type: ignore[arg-type]
        self.total_size = n - n % world if drop_last else n
        self.batch_size, self.batch_drop_last = batch_size, batch_drop_last

    def _known_batch(self) -> int | None:
        """The loader's batch size, given or seen in a forward; ``None`` before either."""
        return self.batch_size if self.batch_size is not None else batch_size_seen()

    def _dealt(self) -> int:
        """How many positions of the order the ranks deal this epoch (see the class doc)."""
        batch = self._known_batch()
        total, world = self.total_size, self.num_replicas
        if batch is None:
            return total
        tail = total % (batch * world)
        return total - tail if (self.batch_drop_last or tail < world) else total

    def __iter__(self) -> Iterator[int]:
        return self._deal(epoch_order(self.dataset, self.shuffle, self.seed, self.epoch))

    def _deal(self, order: list[int]) -> Iterator[int]:
        """This rank's positions of ``order``, rank-strided as torch's. What is dealt is
        decided at the tail, lazily: a loader that takes its indices batch by batch has seen
        its model's first forward by then (see the class doc)."""
        world, total = self.num_replicas, self.total_size
        for p in range(self.rank, total, world):
            if p >= total - (self._known_batch() or 1) * world and p >= self._dealt():
                return
            yield order[p]

    def __len__(self) -> int:
        # torch's sampler keeps it in num_samples; here it follows what is dealt, which the
        # batch size, once known, may shorten
        self.num_samples = len(range(self.rank, self._dealt(), self.num_replicas))
        return self.num_samples

    def set_epoch(self, epoch: int) -> None:
        """The epoch's order; the ranks that ran out of batches in the last one first take
        empty steps beside the others' (on every rank, as torch's ``set_epoch`` is called)."""
        join_all()
        super().set_epoch(epoch)


class DistributedBatchSampler:
    """This rank's batches, cut from each global batch in proportion to the ranks' speeds:
    ``DataLoader(dataset, batch_sampler=DistributedBatchSampler(dataset, batch_size))`` in
    place of a ``DistributedSampler`` and ``batch_size=``.

    Each step's global batch is ``batch_size * world`` consecutive samples of the epoch's order
    (the same ``seed + epoch`` permutation as :class:`DistributedSampler`'s). Where the split
    is balanced, each rank takes a share of it in proportion to its speed, measured from its
    forwards to the end of their backward, so a slow rank (a slower device, a busy machine)
    no longer holds the others up. The wrapped model weights each rank by its samples, so the
    run stays that of one process on the global batches, whatever the shares.

    ``balance``: ``None`` balances wherever that keeps the result exact (not with BatchNorm,
    compression, DiLoCo or GPU workers; one line at the first epoch says why), ``True`` even
    then, ``False`` never (each rank takes ``batch_size`` samples a step). The shares change
    only between steps, the same on every rank, and the loader may prefetch: each batch is cut
    when the loader draws it. With gradient accumulation (``no_sync()``), each micro-batch is
    weighed as one process weighs it, whatever its shares and size (:mod:`towers.api.micro`):
    under this sampler the ranks' batches end together, which that needs.

    The last global batch of an epoch may be smaller: every rank gets a part of it (at least
    one sample), or it is left out where it holds fewer samples than there are ranks, or with
    ``drop_last=True``. Every rank therefore has the same number of batches.
    """

    def __init__(
        self,
        dataset: Dataset[Any],
        batch_size: int,
        *,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = False,
        balance: bool | None = None,
    ):
        if not isinstance(batch_size, int) or isinstance(batch_size, bool) or batch_size < 1:
            raise ValueError(f"batch_size must be a positive int, got {batch_size!r}")
        check_balance(balance)
        job = context()
        self.dataset, self.batch_size = dataset, batch_size
        self.shuffle, self.seed, self.drop_last, self.balance = shuffle, seed, drop_last, balance
        self.rank, self.num_replicas = job.rank, job.world_size
        self.epoch = 0
        self._balanced: bool | None = None  # decided at the first epoch, the model wrapped

    def set_epoch(self, epoch: int) -> None:
        """The epoch whose order the next iteration deals (as ``DistributedSampler``'s)."""
        self.epoch = epoch

    @property
    def sampler(self) -> DistributedBatchSampler:
        """Itself: where torch's ``BatchSampler`` keeps its sampler, which is where Lightning
        calls ``set_epoch`` at each epoch."""
        return self

    def _sizes(self, samples: int) -> list[int]:
        """Every rank's part of a global batch of ``samples``: balanced, or even."""
        state = wrapped_state()
        world = self.num_replicas
        if state is not None and self._balanced is None and world > 1:
            self._balanced = choose_balance(
                self.balance, None, world, state.unbalanced, "DistributedBatchSampler", self.rank
            )
            if self._balanced and state.balancer is None:
                state.balanced(True, state.unbalanced)
        if state is not None and self._balanced:
            return state.split(samples, world)
        return split_sizes(samples, [1.0] * world)

    def __iter__(self) -> Iterator[list[int]]:
        weigh_micro_batches()
        order = epoch_order(self.dataset, self.shuffle, self.seed, self.epoch)
        world = self.num_replicas
        step = self.batch_size * world
        for start in range(0, len(order), step):
            samples = min(step, len(order) - start)
            if samples < step and (self.drop_last or samples < world):
                return
            sizes = self._sizes(samples)
            first = start + sum(sizes[: self.rank])
            yield order[first : first + sizes[self.rank]]

    def __len__(self) -> int:
        n, world = len(self.dataset), self.num_replicas  # type: ignore[arg-type]
        full, tail = divmod(n, self.batch_size * world)
        return full + (1 if tail and not self.drop_last and tail >= world else 0)
