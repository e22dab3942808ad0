"""The synchronous loop of an elastic run: lose a worker, redo the batch, same parameters.

Sample-weighted averaging gives the same gradient for any split of a global batch, so when a
peer is lost during step k the survivors form the next generation of members
(:class:`~towers.comm.elastic.ElasticConnection`), split global batch k over themselves and
redo it: the parameters stay those of an uninterrupted single-process loop.

A step's sum can complete on some ranks and not on others (a ring all-reduce's last chunk), so
after every regroup the members compare how many steps each has done, and the most advanced
one sends its state (parameters, buffers, optimizer and schedule state, the record) to the
others; a replacement that joins at a step boundary receives the same, from a live peer, not
from disk. Ranks never differ by more than one step, and every rank that completed a step
computed the same update, so the state sent is exact.

The recovery runs after the ``except`` clause has ended, so that no traceback keeps the
abandoned group's tensors or work alive.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import asdict
from typing import Any

import torch

from ...comm.base import PeerFailure
from ...comm.elastic import ElasticConnection
from ...core.data import BatchOrder, num_samples
from ...core.launch import read_launch
from ...core.split import split
from ...core.step import StepResult
from ..evaluate import due
from ..fetch import Fetcher
from ..job import EngineResult, Job
from ..replica import Replica, backward_shard
from ..report import Reporter
from .loop import SyncRecord, _Run
from .step import SyncStep

__all__ = ["elastic_loop"]


class _ElasticRun(_Run):
    """One worker's run of an elastic synchronous job."""

    def __init__(self, job: Job, conn: ElasticConnection, resume: dict[str, Any] | None):
        self.job, self.conn, self.device = job, conn, conn.device
        self.comm = conn.comm
        torch.manual_seed(job.seed + conn.id)
        self.replica = Replica.build(job, conn.device)
        self.order = BatchOrder(num_samples(job.data), job.batch_size, job.shuffle, job.seed)
        self.record = SyncRecord()
        self.first = 0
        self.step = SyncStep(self.comm, self.device)
        if resume is not None:
            self.replica.load(resume)
            self.order.load_state_dict(resume["data"])
            self.record = SyncRecord.from_state(resume["record"])
            self.record.evals = [(d, m) for d, m in self.record.evals if due(job, d)]
            self.first = resume["step"]
        self.fetcher = Fetcher(job)  # evaluation's
        self.fetch = None
        # Steps done; a replacement has none until a peer sends it the state.
        self.done = -1 if conn.joining else self.first
        self.lost_at: float | None = None  # when the peer whose loss is being recovered died
        self.failed = False  # the current generation lost a peer
        self.reporter = Reporter(job, conn.id == 0, initial=self.first)
        self.start = time.perf_counter()

    def _enter(self, generation: int) -> None:
        """Form ``generation``'s group, agree on the state, and attach the averaging."""
        self.step.remove()
        for p in self.replica.model.parameters():
            p.grad = None
        failed_in = self.conn.generation if self.failed else None
        self.conn.join(generation)
        if failed_in is not None:
            # published before the next generation: readable now, whoever noticed first
            self.lost_at = self._lost_at(failed_in) or self.lost_at
            self.failed = False
        self.comm = self.conn.comm
        self.step = SyncStep(self.comm, self.device)
        self._agree()
        self.step.replicate(self.replica.model)

    def _agree(self) -> None:
        """Every member takes the state of the one that has done the most steps.

        They also agree on when the loss being recovered from happened, so that a replacement
        that joins in the same regroup records the recovery too (any member may return the
        result).
        """
        views = self.comm.all_gather_object((self.done, self.lost_at))
        done = [d for d, _ in views]
        lost = [t for _, t in views if t is not None]
        self.lost_at = min(lost) if lost else None
        best = max(done)
        if all(d == best for d in done):
            return
        src = done.index(best)
        state = None
        if self.comm.rank == src:
            state = {"done": best, "replica": self.replica.state(), "record": asdict(self.record)}
        state = self.comm.broadcast_object(state, src)
        if self.comm.rank != src:
            self.replica.load(state["replica"])
            self.record = SyncRecord.from_state(state["record"])
            self.done = state["done"]

    def _attempt(self, k: int) -> StepResult:
        """Train global batch ``k``, split over the current members."""
        job, comm, replica = self.job, self.comm, self.replica
        self.order.seek(k)
        mine = split(next(self.order), comm.world_size)[comm.rank]
        slow = job.straggle.get(comm.rank, 1.0)
        loss_sum, n = backward_shard(
            job, replica.model, mine, self.device, before_last=self.step.arm, slow=slow
        )
        self.step.add(loss_sum, n)
        r = self.step.reduce(regroup=self.conn.membership.regroup_wanted)
        self.step.apply(r, replica.optimizer)  # type: ignore[arg-type]
        replica.schedule_to(job.scheduled(k + 1))
        return r

    def _lost_at(self, generation: int) -> float | None:
        with contextlib.suppress(Exception):
            failure = self.conn.membership.failure(generation)
            if failure is not None:
                return failure[1]
        return None

    def _completed(self, r: StepResult) -> None:
        k, self.done = self.done, self.done + 1
        elapsed = time.perf_counter() - self.start
        self.record.add(k, r, self.record.seconds + elapsed)
        if self.lost_at is not None:
            self.record.recoveries.append((k, max(0.0, time.time() - self.lost_at)))
            self.lost_at = None
        self.reporter.step(k, r.loss, r.tower_losses, self.record.samples / max(elapsed, 1e-9))

    def train(self) -> None:
        job = self.job
        generation = self.conn.membership.first_generation(self.conn.joining)
        self.start = time.perf_counter()
        entered = False
        try:
            while True:
                failed = False
                try:
                    if not entered:
                        self._enter(generation)
                        entered = True
                    if self.done >= job.steps:
                        self.comm.barrier()  # every member has done every step
                        break
                    self._completed(self._attempt(self.done))
                    if due(job, self.done):
                        self._evaluate(self.done, self.reporter)
                    if self._due(self.done):
                        self._save(self.done)
                except PeerFailure:
                    failed = True
                if failed:  # regroup outside the except clause: see the module doc
                    self.failed = True
                    generation, entered = self.conn.generation + 1, False
                elif self.step.regroup:  # a replacement waits: all move on after this step
                    generation, entered = self.conn.generation + 1, False
        finally:
            self.reporter.close()
            self.fetcher.close()  # evaluation's loaders, as the plain loop does
        self.record.seconds += time.perf_counter() - self.start


def elastic_loop(job: Job, resume: dict[str, Any] | None, joining: bool) -> EngineResult:
    """Train ``job`` as one elastic worker; every worker returns the (identical) result."""
    conn = ElasticConnection(read_launch(), job.transport or "auto", job.timeout, joining)
    try:
        run = _ElasticRun(job, conn, resume)
        try:
            run.train()
        finally:
            run.step.remove()
        return run.result()
    finally:
        conn.close()
