"""What a run shows while it trains: a progress bar and TensorBoard scalars.

One reporter per job, in the process that holds the record: rank 0 (in the asynchronous modes,
the parameter server). The bar appears only when stderr is a terminal; scalars are written only
with ``log_dir=``.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping, Sequence

from .job import Job

__all__ = ["Reporter"]


class Reporter:
    """Progress bar and TensorBoard scalars; does nothing unless ``main``.

    ``initial``: global batches already done (a resumed run's bar starts there).
    """

    def __init__(self, job: Job, main: bool, initial: int = 0):
        self.bar = None
        self.writer = None
        self.shown: dict[str, str] = {}  # the last step's loss and rate
        self.last_eval: dict[str, str] = {}  # shown beside the loss until the next evaluation
        if not main:
            return
        if job.progress and sys.stderr.isatty():
            from tqdm.auto import tqdm

            self.bar = tqdm(
                total=job.steps, initial=initial, desc=f"towers {job.mode}", unit="step"
            )
        if job.log_dir is not None:
            from torch.utils.tensorboard import SummaryWriter

            self.writer = SummaryWriter(job.log_dir)

    def step(
        self,
        step: int,
        loss: float,
        tower_losses: Sequence[float] | Mapping[int, float],
        rate: float,
        shards: Sequence[int] = (),
    ) -> None:
        """Global batch ``step`` is complete; ``tower_losses``: all, or ``{tower: loss}``;
        ``shards``: each tower's samples (sync modes), shown where the split is not even."""
        uneven = len(set(shards)) > 1 and max(shards) - min(shards) > 1
        if self.bar is not None:
            self.shown = {"loss": f"{loss:.4g}", "samples_s": f"{rate:.0f}"}
            if uneven:  # a balanced split: where it stands
                self.shown["split"] = "/".join(map(str, shards))
            self.bar.set_postfix(**self.shown, **self.last_eval, refresh=False)
            self.bar.update(1)
        if self.writer is not None:
            self.writer.add_scalar("loss/mean", loss, step)
            towers = (
                tower_losses.items()
                if isinstance(tower_losses, Mapping)
                else enumerate(tower_losses)
            )
            for i, value in towers:
                self.writer.add_scalar(f"loss/tower_{i}", value, step)
            self.writer.add_scalar("samples_per_second", rate, step)
            for i, n in enumerate(shards):
                self.writer.add_scalar(f"shard/tower_{i}", n, step)

    def evaluated(self, done: int, metrics: Mapping[str, float]) -> None:
        """An evaluation after ``done`` global batches (TensorBoard: ``eval/NAME`` at ``done``)."""
        self.last_eval = {f"eval_{name}": f"{value:.4g}" for name, value in metrics.items()}
        if self.bar is not None:
            self.bar.set_postfix(**self.shown, **self.last_eval, refresh=True)
        if self.writer is not None:
            for name, value in metrics.items():
                self.writer.add_scalar(f"eval/{name}", value, done)

    def staleness(self, update: int, value: int) -> None:
        """The asynchronous modes' staleness of update number ``update``."""
        if self.writer is not None:
            self.writer.add_scalar("staleness", value, update)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        if self.writer is not None:
            self.writer.close()
