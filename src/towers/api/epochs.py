"""What ``epochs=`` means in the modes where workers update on their own, said at the start.

towers counts an epoch as one pass over the data by all workers together (DataLoader's and
DDP's reading: each global batch is split over the workers). A Hogwild script
(``torch.multiprocessing`` with a shared model) counts epochs per process: each process passes
over all the data, so "2 epochs" there are twice as many updates as ``epochs=2`` here with 2
workers. In the modes where each shard is an update of its own (``async``, ``ssp:S``) or each
worker steps its own optimizer (``local:K``), :func:`announce_epochs` prints one line that says
which reading applies, how many updates follow from it, and what to write for the other.
"""

from __future__ import annotations

import sys

from ..core.data import batches_per_epoch
from ..core.modes import Mode

__all__ = ["announce_epochs", "describe_epochs"]

_OWN_UPDATES = ("async", "ssp", "local")


def describe_epochs(
    mode: Mode, epochs: int | None, samples: int, batch_size: int, workers: int
) -> str | None:
    """The line :func:`announce_epochs` prints, or ``None`` where ``epochs`` reads as in DDP."""
    if epochs is None or mode.name not in _OWN_UPDATES:
        return None
    per_epoch = batches_per_epoch(samples, batch_size)
    last = samples - (per_epoch - 1) * batch_size  # DataLoader keeps a smaller last batch
    shard = batch_size / workers
    if mode.name == "local":
        work = f"each worker steps {epochs * per_epoch} times on shards of about {shard:.0f}"
    else:
        shards = (per_epoch - 1) * min(workers, batch_size) + min(workers, last)
        work = f"{epochs * shards} updates, one per shard of about {shard:.0f} samples"
    plural = "s" if workers > 1 else ""
    return (
        f"towers.train: epochs={epochs} in mode {mode} = {epochs} pass{'es' * (epochs > 1)} "
        f"over the data by all {workers} worker{plural} together ({epochs * per_epoch} global "
        f"batches of {batch_size}): {work}. Hogwild scripts count epochs per process: for "
        f"{epochs} pass{'es' * (epochs > 1)} by each worker, give epochs={epochs * workers} "
        "(docs/porting.md)."
    )


def announce_epochs(
    mode: Mode, epochs: int | None, samples: int, batch_size: int, workers: int, rank: int
) -> None:
    """Print :func:`describe_epochs`'s line to stderr, once per job (by ``rank`` 0)."""
    line = describe_epochs(mode, epochs, samples, batch_size, workers)
    if line is not None and rank == 0:
        print(line, file=sys.stderr, flush=True)
