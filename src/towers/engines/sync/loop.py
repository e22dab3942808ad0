"""The synchronous training loop of ``towers.train``, run by every worker.

Each global batch is cut with :func:`towers.split`; this worker backpropagates its shard (in
``accumulate`` micro-batches) and :class:`~towers.engines.sync.step.SyncStep` averages the
gradients over all towers before one update. With ``checkpoint=`` the loop saves its whole state
every ``checkpoint_every`` steps and resumes from the checkpoint the caller read, ending exactly
where an uninterrupted run ends.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from ...comm.group import Connection
from ...core.data import BatchOrder, is_dataset, num_samples
from ...core.split import split
from ...core.step import StepResult
from .. import checkpoint
from ..evaluate import combine, due, evaluate
from ..fetch import Fetcher, Planned
from ..job import EngineResult, Job
from ..replica import Replica, backward_shard, cpu_state
from ..report import Reporter
from ..syncbn import convert_batchnorm
from .step import SyncStep

__all__ = ["SyncRecord", "sync_loop"]


@dataclass
class SyncRecord:
    """What a synchronous run has done so far; saved in its checkpoints."""

    losses: list[float] = field(default_factory=list)
    tower_losses: list[list[float]] = field(default_factory=list)
    skipped: list[tuple[int, list[int]]] = field(default_factory=list)
    times: list[float] = field(default_factory=list)
    samples: int = 0
    seconds: float = 0.0  # training time of the runs before this one
    world: list[int] = field(default_factory=list)  # towers that computed each step
    recoveries: list[tuple[int, float]] = field(default_factory=list)  # elastic: see result
    evals: list[tuple[int, dict[str, float]]] = field(default_factory=list)

    def add(self, step: int, r: StepResult, at: float) -> None:
        self.samples += r.samples
        self.losses.append(r.loss)
        self.tower_losses.append(r.tower_losses)
        self.world.append(len(r.tower_samples))
        if r.skipped:
            self.skipped.append((step, r.culprits))
        self.times.append(at)

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> SyncRecord:
        record = cls(**state)
        record.skipped = [(s, list(c)) for s, c in record.skipped]
        record.recoveries = [(s, float(t)) for s, t in record.recoveries]
        record.evals = [(s, dict(m)) for s, m in record.evals]
        return record


class _Run:
    """One worker's run of a synchronous job."""

    def __init__(self, job: Job, conn: Connection, resume: dict[str, Any] | None):
        self.job, self.comm, self.device = job, conn.comm, conn.device
        torch.manual_seed(job.seed + self.comm.rank)
        self.step = SyncStep(self.comm, conn.device)
        self.replica = Replica.build(job, conn.device)
        if job.sync_batchnorm:
            convert_batchnorm(self.replica.model, self.comm)
        self.step.replicate(self.replica.model)
        self.order = BatchOrder(num_samples(job.data), job.batch_size, job.shuffle, job.seed)
        self.record = SyncRecord()
        self.first = 0
        if resume is not None:
            self._restore(resume)
        self.fetcher = Fetcher(job)  # evaluation's
        self.fetch = None  # fetch in this process; or a DataLoader's processes, planned ahead
        if job.num_workers and is_dataset(job.data):
            position = None if resume is None else resume["data"]
            self.fetch = Planned(job, self.comm.rank, self.comm.world_size, self.first, position)

    def _restore(self, state: dict[str, Any]) -> None:
        self.replica.load(state)
        self.order.load_state_dict(state["data"])
        rng = state["rng"]
        if len(rng) == self.comm.world_size:
            torch.set_rng_state(rng[self.comm.rank])
        else:  # resumed with another number of workers: fresh, but reproducible, streams
            torch.manual_seed(self.job.seed + self.comm.rank + 1000 * state["step"])
        self.record = SyncRecord.from_state(state["record"])
        # a shorter run's evaluation at its end is not one of this run's
        self.record.evals = [(d, m) for d, m in self.record.evals if due(self.job, d)]
        self.first = state["step"]

    def _save(self, done: int) -> None:
        rng = self.comm.all_gather_object(torch.get_rng_state())
        if self.comm.rank != 0:
            return
        payload = {
            "mode": str(self.job.mode),
            "data": self.order.state_dict(),
            "rng": rng,
            "record": asdict(self.record),
            **self.replica.state(),
        }
        checkpoint.save_or_warn(self.job.checkpoint, done, "sync", payload)  # type: ignore[arg-type]

    def _due(self, done: int) -> bool:
        job = self.job
        return job.checkpoint is not None and (
            done % job.checkpoint_every == 0 or done == job.steps
        )

    def _planned(self, micro: list[torch.Tensor]) -> list[Any]:
        assert self.fetch is not None
        return [self.fetch(m) for m in micro]

    def _evaluate(self, done: int, reporter: Reporter) -> None:
        comm = self.comm
        model, world = self.replica.model, comm.world_size
        mine = evaluate(self.job, model, self.device, comm.rank, world, self.fetcher)
        metrics = combine(comm.all_gather_object(mine))
        self.record.evals.append((done, metrics))
        reporter.evaluated(done, metrics)

    def train(self) -> None:
        job, comm, record, replica = self.job, self.comm, self.record, self.replica
        slow = job.straggle.get(comm.rank, 1.0)
        reporter = Reporter(job, comm.rank == 0, initial=self.first)
        comm.barrier()
        start = time.perf_counter()
        first_samples = record.samples
        try:
            for k in range(self.first, job.steps):
                mine = split(next(self.order), comm.world_size)[comm.rank]
                loss_sum, n = backward_shard(
                    job,
                    replica.model,
                    mine,
                    self.device,
                    before_last=self.step.arm,
                    slow=slow,
                    fetch=None if self.fetch is None else self._planned,
                )
                self.step.add(loss_sum, n)
                r = self.step.reduce()
                self.step.apply(r, replica.optimizer)  # type: ignore[arg-type]
                replica.schedule_to(job.scheduled(k + 1))
                elapsed = time.perf_counter() - start
                record.add(k, r, record.seconds + elapsed)
                rate = (record.samples - first_samples) / elapsed
                reporter.step(k, r.loss, r.tower_losses, rate)
                if due(job, k + 1):
                    self._evaluate(k + 1, reporter)
                if self._due(k + 1):
                    record.seconds += time.perf_counter() - start
                    start, first_samples = time.perf_counter(), record.samples
                    self._save(k + 1)
        finally:
            reporter.close()
            if self.fetch is not None:
                self.fetch.close()
            self.fetcher.close()
        record.seconds += time.perf_counter() - start

    def result(self) -> EngineResult:
        r = self.record
        return EngineResult(
            state_dict=cpu_state(self.replica.model),
            losses=r.losses,
            tower_losses=r.tower_losses,
            skipped=[(s, list(c)) for s, c in r.skipped],
            steps=self.job.steps,
            samples=r.samples,
            seconds=r.seconds,
            times=r.times,
            world=list(r.world),
            recoveries=list(r.recoveries),
            evals=list(r.evals),
        )


def sync_loop(job: Job, conn: Connection, resume: dict[str, Any] | None) -> EngineResult | None:
    """Train ``job`` synchronously on this rank; rank 0 returns the result (every rank does if
    ``job.every_rank``)."""
    run = _Run(job, conn, resume)
    try:
        run.train()
    finally:
        run.step.remove()
    if conn.comm.rank == 0 or job.every_rank:
        return run.result()
    return None
