"""The synchronous training loop of ``towers.train``, run by every worker, plain or elastic.

Each global batch is cut with :func:`towers.split`; this worker backpropagates its shard (in
``accumulate`` micro-batches) and the step driver (:class:`~towers.engines.sync.driver.SyncDriver`)
reduces the gradients over all towers before one update. The loop is the same for a fixed group
and an elastic one (:mod:`towers.engines.sync.group`): a step the elastic group asks to redo
(a peer was lost) is simply trained again, split over the survivors, from the state the members
agreed on. With ``checkpoint=`` the loop saves its whole state every ``checkpoint_every`` steps
and resumes from the checkpoint the caller read, ending exactly where an uninterrupted run ends.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from ...comm.elastic import ElasticConnection
from ...comm.group import Connection
from ...core.data import BatchOrder, is_dataset, num_samples
from ...core.launch import read_launch
from ...core.split import cut
from ...core.step import StepResult
from ..evaluate import combine, due, evaluate
from ..fetch import Fetcher, Planned
from ..job import EngineResult, Job
from ..replica import Replica, backward_shard, cpu_state
from ..report import Reporter
from ..shard import ShardedState
from ..shard_files import load_agreed, restore_parts, save_checkpoint
from ..syncbn import convert_batchnorm
from ..transforms.scatter import scatter_for
from .driver import SyncDriver
from .group import ElasticGroup, Group, PlainGroup
from .mode import plan_for
from .runner import StepRunner
from .state import RunState

__all__ = ["SyncRecord", "elastic_loop", "sync_loop"]


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
    shards: list[list[int]] = field(default_factory=list)  # each step's split
    shard_seconds: list[list[float]] = field(default_factory=list)  # each shard's compute time

    def add(self, step: int, r: StepResult, at: float) -> None:
        self.samples += r.samples
        self.shards.append(list(r.tower_samples))
        self.shard_seconds.append(list(r.tower_seconds))
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
        record.shards = [list(s) for s in record.shards]
        record.shard_seconds = [list(s) for s in record.shard_seconds]
        return record

    def state_dict(self) -> dict[str, Any]:
        """As plain data (a :class:`~towers.engines.sync.state.Journal`)."""
        return asdict(self)

    def load_state_dict(self, saved: dict[str, Any]) -> None:
        """Become the record ``saved`` holds (a peer's, after a regroup)."""
        self.__dict__.update(SyncRecord.from_state(saved).__dict__)


class _Run:
    """One worker's run of a synchronous job over ``group``.

    ``worker``: this worker's launch rank (an elastic worker's id), which seeds its RNG and
    says whether it reports progress.
    """

    def __init__(self, job: Job, group: Group, worker: int, resume: dict[str, Any] | None):
        self.job, self.group, self.device = job, group, group.device
        torch.manual_seed(job.seed + worker)
        self.replica = Replica.build(job, group.device)
        if job.sync_batchnorm:
            convert_batchnorm(self.replica.model, group)
        self.plan = plan_for(job.mode, job.outer_optimizer)  # what each global batch does
        self.record = SyncRecord()
        self.state = RunState(
            self.plan,
            self.record,
            joining=group.joining,
            regrouped=self._regrouped,
            balance=job.balance,
        )
        self.state.rebuilds = job.shard_optimizer and group.elastic
        self.started = False  # the first members formed and began (see _rebuild)
        # an elastic sharded job's first checkpoint (a resumed one, or one it writes at its
        # start; a replacement's members wrote theirs)
        self.saved_once = resume is not None or group.joining
        self.state.replica = self.replica
        # the user's optimizer, or the plan's own (DiLoCo's outer); an elastic job's is cut
        # once its members are formed (_regrouped)
        if job.shard_optimizer and not group.elastic:
            sharding = ShardedState(self.replica.model, lambda: group.comm)
            self.state.sharding = None if self.plan.shard(sharding) else sharding
        transform = scatter_for(self.state.sharding, job.transform, group.comm, group.elastic)
        self.driver = SyncDriver(
            group, transform, owner=self.state, mode=str(job.mode),
            defer=False if job.shard_optimizer else None,
        )  # fmt: skip
        self.runner = StepRunner(group, self.state, self.driver)
        self.breaks = self.plan.attach(self.replica.model)
        self.order = BatchOrder(num_samples(job.data), job.batch_size, job.shuffle, job.seed)
        # a replacement takes the state from a live peer, not from the checkpoint the job
        # started from
        self.resume = None if group.joining else resume
        if self.resume is not None:
            self._restore(self.resume)
        self.first = self.done
        self.fetcher = Fetcher(job)  # evaluation's
        self.fetch: Planned | None = None  # a DataLoader's processes, planned ahead
        self._planned: list[float] | None = None  # the shares they were planned with
        self.reporter = Reporter(job, worker == 0, initial=self.first)
        self.start, self.first_samples = time.perf_counter(), self.record.samples

    @property
    def done(self) -> int:
        """Global batches completed."""
        return self.state.steps

    @done.setter
    def done(self, value: int) -> None:
        self.state.steps = value

    def _regrouped(self) -> None:
        """The members changed (or formed): a sharded state is rebuilt, loading is planned."""
        if self.state.rebuilds:
            self._rebuild()
        self._plan_loading()

    def _rebuild(self) -> None:
        """An elastic job's sharded optimizer state, cut for the members just formed: at the
        start, the state there is; after a change of members, the newest checkpoint's (a lost
        tower's part is nowhere else), from whose step every member trains on, training again
        the global batches since (a collective; docs/sharding.md, "Elastic jobs")."""
        job, comm, optimizer = self.job, self.group.comm, self.replica.optimizer
        assert job.checkpoint is not None and optimizer is not None
        if self.state.sharding is not None:
            self.state.sharding.remove()
        optimizer.state.clear()  # the state of the parts cut for the members before
        self.state.sharding = ShardedState(self.replica.model, lambda: self.group.comm).start()
        self.state.newcomer = False
        if not (self.started or self.group.joining):
            return  # the start: the state there is
        # each rank checks the parts it will read; all pass over a damaged one together
        saved = load_agreed(job.checkpoint, "sync", (), self.state.sharding, comm)
        if saved is None and self.done == 0:
            return  # a loss before the first checkpoint was written: nothing trained yet
        if saved is None:
            raise RuntimeError(
                f"an elastic job with shard_optimizer=True rebuilds its state from its newest "
                f"checkpoint, but {job.checkpoint} holds none: checkpoint into a directory "
                "every host shares, and leave it in place while the job runs"
            )
        # what the checkpoint does not know, the same on every member (a newcomer knows none)
        views = comm.all_gather_object((self.record.recoveries, self._clock()))
        kept = max(views, key=lambda view: len(view[0]))
        self._restore(saved)
        reseed = job.seed + comm.rank + 1000 * saved["step"]  # as a resume on other towers
        self.state.restore(saved, self.driver, reseed=reseed)
        restore_parts(self.state.sharding, optimizer, saved, job.checkpoint)
        self.record.recoveries, self.record.seconds = kept
        self.start, self.first_samples = time.perf_counter(), self.record.samples

    def _first_save(self) -> bool:
        self._save(self.done)
        return True

    def _plan_loading(self) -> None:
        """Plan this tower's part of the remaining batches for the current members and split
        (the data-loading processes fetch ahead of the loop)."""
        job, comm = self.job, self.group.comm
        if self.fetch is not None:
            self.fetch.close()
            self.fetch = None
        if job.num_workers and is_dataset(job.data):
            self.order.seek(self.done)
            position = self.order.state_dict()
            self._planned = self._shares()
            where = comm.rank, comm.world_size
            self.fetch = Planned(job, *where, self.done, position, self._planned)

    def _shares(self) -> list[float] | None:
        """The shares of a balanced split, if it is one, for this many members."""
        return self.state.shares(self.group.comm.world_size)

    def _restore(self, state: dict[str, Any]) -> None:
        """What the loop itself keeps of the checkpoint resumed: the data position, the
        record, the steps done (the rest is :meth:`_restore_state`'s, once the members are
        formed)."""
        self.order.load_state_dict(state["data"])
        self.record.load_state_dict(state["record"])
        # a shorter run's evaluation at its end is not one of this run's
        self.record.evals = [(d, m) for d, m in self.record.evals if due(self.job, d)]
        self.done = state["step"]

    def _restore_state(self) -> None:
        """The replica, this rank's random stream and transform state, and the plan's own,
        from the checkpoint resumed."""
        if self.resume:
            # resumed with another number of workers: fresh, but reproducible, streams
            reseed = self.job.seed + self.group.comm.rank + 1000 * self.resume["step"]
            self.state.restore(self.resume, self.driver, reseed=reseed)
            restore_parts(
                self.state.sharding, self.replica.optimizer, self.resume, str(self.job.checkpoint)
            )

    # -- one step --------------------------------------------------------------------------

    def _advance(self) -> None:
        """One piece of work: the exchange the plan owes, or the next global batch; then
        evaluate and save if due. In an elastic job each is attempted (and redone) alone."""
        job = self.job
        if self.plan.owes(self.done, job.steps):
            self.runner.exchange_once(final=self.done == job.steps)
        else:
            self._train(self.done)
        self._land()
        if self.plan.owes(self.done, job.steps):
            return  # evaluate and save what the exchange brings
        if due(job, self.done):
            self._evaluate(self.done)
        if self._checkpoint_due(self.done):
            self.record.seconds += time.perf_counter() - self.start
            self.start, self.first_samples = time.perf_counter(), self.record.samples
            self._save(self.done)

    def _train(self, k: int) -> None:
        """Train global batch ``k``, split over the current members."""
        job, comm, replica = self.job, self.group.comm, self.replica
        self.order.seek(k)
        batch = next(self.order)
        mine = cut(batch, self.state.split(len(batch), comm.world_size))[comm.rank]
        if self.fetch is not None and self._planned != self._shares():
            self._plan_loading()  # the split moved: the loaders fetch the new shards
        slow = job.straggle.get(comm.rank, 1.0)
        fetch = None if self.fetch is None else self._fetch_planned
        replica.schedule_to(job.scheduled(k))  # a replacement catches up
        self.runner.shard_taken()
        loss_sum, samples = backward_shard(
            job, replica.model, mine, self.device, before_last=self.runner.arm, slow=slow,
            fetch=fetch,
        )  # fmt: skip
        self.driver.add(loss_sum, samples)
        self.runner.complete(replica.optimizer, at=self._clock)
        replica.schedule_to(job.scheduled(k + 1))

    def _clock(self) -> float:
        """Seconds of training so far, the runs this one resumed included."""
        return self.record.seconds + time.perf_counter() - self.start

    def _land(self, wait: bool = False) -> None:
        """Record the steps whose results over all towers arrived (``wait``: every step's)."""
        landed = self.runner.land(wait)  # the next split follows the speeds measured
        for k, r, at in landed:
            self._completed(k, r, self._clock() if at is None else at)
        if landed and self.group.lost_at is not None:
            k = landed[-1][0]
            self.record.recoveries.append((k, max(0.0, time.time() - self.group.lost_at)))
            self.group.lost_at = None

    def _fetch_planned(self, micro: list[torch.Tensor]) -> list[Any]:
        assert self.fetch is not None
        return [self.fetch(m) for m in micro]

    def _completed(self, k: int, r: StepResult, at: float) -> None:
        self.record.add(k, r, at)
        elapsed = time.perf_counter() - self.start
        rate = (self.record.samples - self.first_samples) / max(elapsed, 1e-9)
        self.reporter.step(k, r.loss, r.tower_losses, rate, r.tower_samples)

    def _evaluate(self, done: int) -> None:
        comm = self.group.comm
        model, world = self.plan.trained(self.replica.model), comm.world_size
        where = self.device, comm.rank, world
        mine = evaluate(self.job, model, *where, self.fetcher, shares=self._shares())
        metrics = combine(comm.all_gather_object(mine))
        self.record.evals.append((done, metrics))
        self.reporter.evaluated(done, metrics)

    def _checkpoint_due(self, done: int) -> bool:
        job = self.job
        return job.checkpoint is not None and (
            done % job.checkpoint_every == 0 or done == job.steps
        )

    def _save(self, done: int) -> None:
        self._land(wait=True)  # the record holds every step saved
        payload = {
            "mode": str(self.job.mode),
            "data": self.order.state_dict(),
            "record": self.record.state_dict(),
            **self.state.checkpoint(self.driver),
        }
        save_checkpoint(
            str(self.job.checkpoint), done, "sync", payload, self.group.comm,
            self.state.sharding, self.replica.optimizer,
        )  # fmt: skip

    # -- the run ---------------------------------------------------------------------------

    def train(self) -> None:
        group, job = self.group, self.job
        try:
            if self.state.sharding is not None:
                self.state.sharding.start()
            self.driver.replicate(self.replica.model, breaks=self.breaks)
            self._restore_state()
            self.started = True
            while self.state.rebuilds and not self.saved_once:  # what a loss goes back to
                self.saved_once = self.runner.attempt(self._first_save) or False
            if not group.elastic:  # start the clock together (a replacement joins mid-run)
                group.comm.barrier()
            self.start, self.first_samples = time.perf_counter(), self.record.samples
            while self.done < job.steps or self.plan.owes(self.done, job.steps):
                self.runner.attempt(self._advance)
            self._land(wait=True)
            group.finish(self.driver)
        finally:
            self.driver.remove()
            if self.state.sharding is not None:
                self.state.sharding.remove()
            self.reporter.close()
            if self.fetch is not None:
                self.fetch.close()
            self.fetcher.close()
        self.record.seconds += time.perf_counter() - self.start

    def result(self) -> EngineResult:
        r = self.record
        return EngineResult(
            state_dict=cpu_state(self.plan.trained(self.replica.model)),
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
            shards=[list(s) for s in r.shards],
            shard_seconds=[list(s) for s in r.shard_seconds],
        )


def sync_loop(job: Job, conn: Connection, resume: dict[str, Any] | None) -> EngineResult | None:
    """Train ``job`` synchronously on this rank; rank 0 returns the result (every rank does if
    ``job.every_rank``)."""
    run = _Run(job, PlainGroup(conn), conn.comm.rank, resume)
    run.train()
    if conn.comm.rank == 0 or job.every_rank:
        return run.result()
    return None


def elastic_loop(job: Job, resume: dict[str, Any] | None, joining: bool) -> EngineResult:
    """Train ``job`` as one elastic worker; every worker returns the (identical) result."""
    conn = ElasticConnection(read_launch(), job.transport, job.timeout, joining).start()
    group = ElasticGroup(conn)
    try:
        run = _Run(job, group, conn.id, resume)
        run.train()
        return run.result()
    finally:
        group.close()
