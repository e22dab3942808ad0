"""The sequence of global batches: depends on the data size, ``batch_size``, ``shuffle`` and
``seed`` only, never on the number of workers.

The order is exactly what ``torch.utils.data.DataLoader(data, batch_size, shuffle=shuffle,
generator=torch.Generator().manual_seed(seed))`` yields when iterated epoch after epoch (the index
sampler is DataLoader's own), so a plain single-process loop over such a DataLoader sees the same
batches as towers do. The last batch of an epoch may be smaller; it is kept.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, IterableDataset, default_collate

from .split import batch_size as _batch_size
from .split import map_batch

__all__ = [
    "BatchCache",
    "BatchOrder",
    "batch_len",
    "batches_per_epoch",
    "global_batches",
    "is_dataset",
    "num_samples",
    "take",
]


def num_samples(data: Any) -> int:
    """How many samples ``data`` holds; ``ValueError``/``TypeError`` if it is not usable data."""
    if isinstance(data, IterableDataset):
        raise TypeError(
            "data is an IterableDataset; towers needs random access to split global batches "
            "reproducibly: pass a map-style Dataset (with __len__ and __getitem__) or tensors"
        )
    if isinstance(data, Dataset):
        if not hasattr(data, "__len__"):
            raise TypeError("data is a Dataset without __len__; towers needs its length")
        return len(data)  # type: ignore[arg-type]
    if isinstance(data, (torch.Tensor, np.ndarray, tuple, list, Mapping)):
        try:
            return _batch_size(data)
        except ValueError as exc:
            raise ValueError(f"data: {exc}") from None
    raise TypeError(
        f"data must be a tensor, a tuple/dict of tensors sharing dim 0, or a map-style "
        f"torch.utils.data.Dataset; got {type(data).__name__}"
    )


def batches_per_epoch(n: int, batch_size: int) -> int:
    return math.ceil(n / batch_size)


def batch_len(step: int, n: int, batch_size: int) -> int:
    """Samples in global batch ``step``: DataLoader keeps the smaller last batch of an epoch."""
    return min(batch_size, n - (step % batches_per_epoch(n, batch_size)) * batch_size)


class BatchOrder:
    """Indices of each global batch, epoch after epoch, with a resumable position.

    The position is the epoch, the index of the next batch in it, the epoch's permutation and
    the generator state after drawing it: restoring them continues the exact sequence.
    """

    def __init__(self, n: int, batch_size: int, shuffle: bool, seed: int):
        self.config = {"samples": n, "batch_size": batch_size, "shuffle": shuffle, "seed": seed}
        self.generator = torch.Generator()
        self.generator.manual_seed(seed)
        indices: Any = range(n)  # a sequence of indices is all DataLoader needs
        self.loader: DataLoader[Any] = DataLoader(
            indices, batch_size=batch_size, shuffle=shuffle, generator=self.generator
        )
        self.epoch = -1
        self.index = 0
        self.batches: list[torch.Tensor] = []

    def __iter__(self) -> Iterator[torch.Tensor]:
        return self

    def __next__(self) -> torch.Tensor:
        if self.index >= len(self.batches):
            self.batches = list(self.loader)  # draws this epoch's permutation
            self.epoch += 1
            self.index = 0
        batch = self.batches[self.index]
        self.index += 1
        return batch

    def seek(self, step: int) -> None:
        """Make global batch ``step`` the next one (an elastic run redoes an interrupted batch).

        Epochs already drawn are kept; going back to an earlier epoch draws the permutations
        again from ``seed``, which gives the same ones.
        """
        per_epoch = batches_per_epoch(self.config["samples"], self.config["batch_size"])
        epoch, index = divmod(step, per_epoch)
        if epoch < self.epoch:
            self.generator.manual_seed(self.config["seed"])
            self.epoch, self.batches = -1, []
        while self.epoch < epoch:
            self.batches = list(self.loader)
            self.epoch += 1
        self.index = index

    def state_dict(self) -> dict[str, Any]:
        permutation = torch.cat(self.batches) if self.batches else torch.zeros(0, dtype=torch.long)
        return {
            **self.config,
            "epoch": self.epoch,
            "index": self.index,
            "permutation": permutation,
            "generator": self.generator.get_state(),
        }

    def check_config(self, state: dict[str, Any]) -> None:
        """``ValueError`` unless ``state`` is of this data size, batch_size, shuffle and seed."""
        for key, value in self.config.items():
            if state[key] != value:
                raise ValueError(
                    f"the checkpoint was made with {key}={state[key]!r}, this run has "
                    f"{key}={value!r}; resume with the same data, batch_size, shuffle and seed, "
                    "or use another checkpoint directory"
                )

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.check_config(state)
        self.generator.set_state(state["generator"])
        self.batches = list(state["permutation"].split(self.config["batch_size"]))
        self.epoch, self.index = state["epoch"], state["index"]


def global_batches(n: int, batch_size: int, shuffle: bool, seed: int) -> Iterator[torch.Tensor]:
    """Indices of each global batch, epoch after epoch, without end."""
    return BatchOrder(n, batch_size, shuffle, seed)


class BatchCache:
    """Global batch k's indices by number, for engines that visit batches out of order.

    Recent batches are kept; an older one (a dead worker's shard, handed out again) replays the
    order from the start, which is cheap next to training on it.
    """

    KEEP = 64

    def __init__(self, n: int, batch_size: int, shuffle: bool, seed: int):
        self.args = (n, batch_size, shuffle, seed)
        self._restart()

    def _restart(self) -> None:
        self.order = BatchOrder(*self.args)
        self.next = 0
        self.cache: dict[int, torch.Tensor] = {}

    def get(self, step: int) -> torch.Tensor:
        if step < self.next and step not in self.cache:
            self._restart()
        while self.next <= step:
            self.cache[self.next] = next(self.order)
            self.cache.pop(self.next - self.KEEP, None)
            self.next += 1
        return self.cache[step]


def is_dataset(data: Any) -> bool:
    """Whether ``data`` is a map-style Dataset (its samples are fetched and collated)."""
    return isinstance(data, Dataset) and not isinstance(data, (torch.Tensor, tuple, list, Mapping))


def take(data: Any, indices: torch.Tensor, collate_fn: Any = None) -> Any:
    """The samples at ``indices``: tensors indexed, or a Dataset's items collated (with
    ``collate_fn``, DataLoader's ``default_collate`` if ``None``)."""
    if is_dataset(data):
        collate = default_collate if collate_fn is None else collate_fn
        return collate([data[i] for i in indices.tolist()])
    return map_batch(
        lambda t: torch.from_numpy(t[indices.numpy()]) if isinstance(t, np.ndarray) else t[indices],
        data,
    )
