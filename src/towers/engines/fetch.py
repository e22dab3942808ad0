"""How a tower fetches its samples: in its own process, or with ``num_workers`` loader processes.

Tensors are indexed directly. A Dataset's samples are collated with the job's ``collate_fn``
(DataLoader's ``default_collate`` if none), in the tower's process when ``num_workers`` is 0.
With ``num_workers > 0`` a ``torch.utils.data.DataLoader`` does the fetching:

- the synchronous loop knows every batch it will train on, so :class:`Planned` keeps one
  DataLoader for the whole run over this tower's micro-batches of every remaining global batch:
  its processes start once and fetch ahead (``prefetch_factor`` batches each) while the tower
  computes;
- elsewhere (evaluation; the asynchronous modes' towers, which learn their shard when the server
  hands it out) a :class:`Fetcher` keeps one DataLoader per Dataset with persistent processes
  and hands it the batches asked for at each call (measured: a DataLoader started per call
  costs several times the in-process loading it replaces, see docs/training.md).

Loader processes are forked (DataLoader's default on Linux): a forked process shares the
dataset's memory, where a started one would need the dataset pickled again.
"""

from __future__ import annotations

import multiprocessing
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset, default_collate

from ..core.balance import shard_of
from ..core.data import BatchOrder, is_dataset, num_samples, take
from ..core.split import split
from .job import Job

__all__ = ["Fetcher", "Planned", "load"]


def _context() -> Any:
    methods = multiprocessing.get_all_start_methods()
    return multiprocessing.get_context("fork") if "fork" in methods else None


def _loader(
    job: Job, data: Any, batches: Iterable[list[int]], persistent: bool = False
) -> DataLoader[Any]:
    return DataLoader(
        _Indexed(data),
        batch_sampler=batches,  # type: ignore[arg-type]
        collate_fn=_Collate(job.collate_fn or default_collate),
        num_workers=job.num_workers,
        multiprocessing_context=_context(),
        persistent_workers=persistent,
    )


def load(job: Job, data: Any, batches: list[torch.Tensor]) -> Iterator[Any]:
    """The batch at each index tensor of ``batches``, in order, fetched in this process."""
    for indices in batches:
        yield take(data, indices, job.collate_fn)


class Fetcher:
    """Batches by index, with ``job.num_workers`` persistent loader processes per Dataset (or
    in this process when there are none); :meth:`close` stops them."""

    def __init__(self, job: Job):
        self.job = job
        self.loaders: dict[int, tuple[DataLoader[Any], list[list[int]]]] = {}

    def __call__(self, data: Any, batches: list[torch.Tensor]) -> Iterator[Any]:
        if self.job.num_workers == 0 or not is_dataset(data):
            yield from load(self.job, data, batches)
            return
        if id(data) not in self.loaders:
            asked: list[list[int]] = []  # the sampler: refilled before every pass
            self.loaders[id(data)] = (_loader(self.job, data, asked, persistent=True), asked)
        loader, asked = self.loaders[id(data)]
        asked[:] = [b.tolist() for b in batches]
        for _, batch in loader:  # a new pass reuses the persistent processes
            yield batch

    def close(self) -> None:
        self.loaders.clear()  # DataLoader's processes stop when it is dropped


class _Indexed(Dataset[tuple[int, Any]]):
    """A Dataset whose items carry their index, so a prefetched batch can be checked."""

    def __init__(self, data: Any):
        self.data = data

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, i: int) -> tuple[int, Any]:
        return i, self.data[i]


class _Collate:
    def __init__(self, collate: Any):
        self.collate = collate

    def __call__(self, items: list[tuple[int, Any]]) -> tuple[list[int], Any]:
        return [i for i, _ in items], self.collate([sample for _, sample in items])


class _Plan:
    """This tower's micro-batches of global batches ``first..steps-1``, as index lists;
    ``shares``: each tower's share of a global batch, where the split is balanced."""

    def __init__(
        self,
        job: Job,
        rank: int,
        world: int,
        first: int,
        position: Any,
        shares: Sequence[float] | None = None,
    ):
        self.job, self.rank, self.world, self.first = job, rank, world, first
        self.position = position  # the batch order's state at ``first``; None: from the start
        self.shares = shares

    def __iter__(self) -> Iterator[list[int]]:
        job = self.job
        order = BatchOrder(num_samples(job.data), job.batch_size, job.shuffle, job.seed)
        if self.position is not None:
            order.load_state_dict(self.position)
        for _ in range(self.first, job.steps):
            mine = shard_of(next(order), self.rank, self.world, self.shares)
            for micro in split(mine, job.accumulate):
                if len(micro):
                    yield micro.tolist()


class Planned:
    """The synchronous loop's fetcher with ``num_workers > 0``; call it with the indices the
    loop is about to train on (they must come in the planned order)."""

    def __init__(
        self,
        job: Job,
        rank: int,
        world: int,
        first: int,
        position: Any,
        shares: Sequence[float] | None = None,
    ):
        plan = _Plan(job, rank, world, first, position, shares)
        self.batches: Iterator[tuple[list[int], Any]] | None = iter(_loader(job, job.data, plan))

    def __call__(self, indices: torch.Tensor) -> Any:
        assert self.batches is not None
        got, batch = next(self.batches)
        assert got == indices.tolist(), "the data loader's plan and the loop disagree"
        return batch

    def close(self) -> None:
        self.batches = None  # DataLoader's iterator stops its processes when dropped
