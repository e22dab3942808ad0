"""The parameter server (rank 0): owns the parameters and the optimizer, hands out shards,
applies what comes back, and keeps the record that becomes the ``TrainResult``.

Work is handed out on request, one shard (global batch k, shard i) at a time, so a fast worker
takes more shards than a slow one and a dead worker's shard in flight goes back to the queue.
Global batches and their split are those of the sync engine (``global_batches`` and ``split``
over ``workers``), so every mode sees the same data. The event loop here is the same for every
mode; what differs (when a request is answered, what an arriving result does) is decided by the
mode's policy (:mod:`towers.engines.ps.policies`), which returns actions
(:mod:`towers.engines.ps.actions`) that the server carries out: only the server changes its
state (:class:`~towers.engines.ps.state.ServerState`), sends messages and steps the optimizer.

A tower that does not answer its work within half the timeout (stopped, stuck) is treated as a
dead one: its shard goes to the others and training goes on.

A non-finite loss or gradient is never applied: the shard (backup: the step) is reported in
``skipped`` with the worker that computed it.

With ``checkpoint=``, the server saves its state every ``checkpoint_every`` completed global
batches and at the end, and a server built from such a checkpoint goes on from it
(:mod:`towers.engines.ps.resume`).
"""

from __future__ import annotations

import collections
import math
import queue
import time
import warnings
from typing import Any, cast

import torch

from ...comm.group import DEFAULT_TIMEOUT
from ...core.data import batch_len, num_samples
from ...core.split import shard_sizes
from ...core.step import assign_mean, sum_grads
from .. import checkpoint
from ..evaluate import combine, due, evaluate
from ..fetch import Fetcher
from ..job import EngineResult, Job
from ..replica import Replica, cpu_state
from ..report import Reporter
from . import resume
from .actions import (
    Action,
    Ahead,
    Apply,
    Average,
    CloseStep,
    CollectParams,
    Drop,
    HandOut,
    Idle,
    OpenStep,
    Record,
    Refill,
    Requeue,
    ShardDone,
    Skip,
    Stale,
)
from .policies import Policy, Result
from .state import ServerState, Shard
from .wire import Header, Kind, Layout, ServerLink, read_header

__all__ = ["Server"]


class Server:
    """Serves ``towers`` workers (ranks 1..towers) over ``link`` as ``policy`` decides; see the
    module docstring."""

    def __init__(
        self,
        job: Job,
        link: ServerLink,
        layout: Layout,
        towers: int,
        device: torch.device,
        policy: Policy,
        state: dict[str, Any] | None = None,
    ):
        self.job, self.link, self.layout, self.device = job, link, layout, device
        self.policy = policy
        self.replica = Replica.build(job, device, optimizer=self.policy.server_optimizer)
        self.model = self.replica.model
        self.n = num_samples(job.data)
        self.state = ServerState.fresh(towers, job.steps)
        if state is not None:
            resume.restore(self.state, self.replica, state)
            # a shorter run's evaluation at its end is not one of this run's
            evals = self.state.record.evals
            evals[:] = [(d, m) for d, m in evals if due(job, d)]
        # progress bar and TensorBoard: the server holds the record, so it reports
        self.reporter = Reporter(job, main=True, initial=self.state.done)
        self.first_samples = self.state.record.samples  # samples/s counts this run's only
        self.start = 0.0
        self.seconds = math.nan
        self.evaluated_final = False
        # the version the last evaluation saw (resumed: the saved one, whose evaluations the
        # checkpoint holds)
        self.evaluated_version = self.state.version
        self.fetch = Fetcher(job)
        # A tower that holds work this long without a word is hung, and treated as dead. Half
        # the timeout: the towers waiting for that work must get it before their own receives
        # (bounded by the timeout) give up.
        self.hang_after = (DEFAULT_TIMEOUT if job.timeout is None else job.timeout) / 2
        self.expecting: dict[int, float] = {}  # tower -> when it was sent work to answer

    # -- the loop --------------------------------------------------------------------------

    def run(self) -> EngineResult:
        self.start = time.perf_counter()
        try:
            self._loop()
        finally:
            self.reporter.close()
            self.fetch.close()
        self.link.close()
        return self._result()

    def _loop(self) -> None:
        s = self.state
        while s.live - s.byes:
            got = self._next()
            if got is None:  # a tower hung, and was let go
                self._serve()
                continue
            tower, msg = got
            self.expecting.pop(tower, None)
            if tower not in s.live:
                continue  # a tower let go as hung that woke up: its messages are stale
            if msg is None:
                self.lost(tower)
            else:
                self._message(tower, msg)
            self._serve()
            self._maybe_evaluate()
            self._maybe_save()

    def _message(self, tower: int, msg: torch.Tensor) -> None:
        s, h = self.state, read_header(self.layout, msg)
        if h.kind == Kind.REQUEST:
            s.idle.add(tower)
        elif h.kind == Kind.BYE:
            s.byes.add(tower)
        elif h.kind == Kind.RESULT:
            shard, pulled = self._answered(tower, h)
            self._do(self.policy.on_result(s, Result(tower, h, msg, shard, pulled)))
        else:
            assert h.kind == Kind.PARAMS, f"tower {tower} sent a {h.kind.name} message"
            self._do(self.policy.on_params(s, tower, h, msg))
        self._do(self.policy.settle(s))

    def _next(self) -> tuple[int, torch.Tensor | None] | None:
        """The next message, or ``None`` after letting go of a tower that hung."""
        if not self.expecting:
            return self.link.get()
        tower, since = min(self.expecting.items(), key=lambda item: item[1])
        try:
            return self.link.get(timeout=max(0.0, since + self.hang_after - time.monotonic()))
        except queue.Empty:
            pass
        del self.expecting[tower]
        warnings.warn(
            f"tower {tower} (rank {tower + 1}) has not answered for {self.hang_after:g} s (half "
            "the timeout); it is treated as dead and its work goes to the other towers",
            RuntimeWarning,
            stacklevel=2,
        )
        # Nothing is sent to it: a send to a stopped process can block once its socket buffer
        # is full. If it wakes up, its messages are ignored.
        self.lost(tower)
        return None

    def elapsed(self) -> float:
        """Seconds since this run's loop started (the record holds earlier runs')."""
        return time.perf_counter() - self.start

    def _serve(self) -> None:
        s = self.state
        if self.policy.finished(s):
            if math.isnan(self.seconds):
                self.seconds = s.record.prior_seconds + self.elapsed()
            for t in sorted(s.idle):
                self._send(t, Kind.STOP, payload=True)
            s.idle.clear()
            return
        for t in sorted(s.idle):
            self._do(self.policy.serve(s, t))

    def _maybe_evaluate(self) -> None:
        """Evaluate the server's parameters every ``eval_every`` global batches and at the end.

        The server evaluates alone, between messages: the towers wait meanwhile. The evaluation
        at the end is of the final parameters: one made once every global batch was complete
        but before the parameters last changed (``local:K``: before the final average) is made
        again.
        """
        job, s = self.job, self.state
        if job.eval_data is None or self.evaluated_final:
            return
        evals = s.record.evals
        last = evals[-1][0] if evals else 0
        if self.policy.finished(s):
            self.evaluated_final = True
            if last == s.steps:
                if self.evaluated_version == s.version:
                    return
                evals.pop()
        elif not (job.eval_every and s.done // job.eval_every > last // job.eval_every):
            return
        metrics = combine([evaluate(job, self.model, self.device, 0, 1, self.fetch)])
        self.evaluated_version = s.version
        evals.append((s.done, metrics))
        self.reporter.evaluated(s.done, metrics)

    def _maybe_save(self) -> None:
        """Checkpoint once ``checkpoint_every`` more global batches are complete, and at the end."""
        s, every = self.state, self.job.checkpoint_every
        if self.job.checkpoint is None or s.done == s.saved:
            return
        if not self.policy.checkpointable(s):
            return
        if s.done // every > s.saved // every or self.policy.finished(s):
            seconds = s.record.prior_seconds + self.elapsed()
            todo = self.policy.unapplied(s)
            payload = resume.snapshot(self.job, s, self.replica, todo, seconds)
            checkpoint.save_or_warn(self.job.checkpoint, s.done, "ps", payload)
            s.saved = s.done

    # -- carrying out the policy's actions -------------------------------------------------

    def _do(self, actions: list[Action]) -> None:
        """Carry out ``actions`` in order (:mod:`towers.engines.ps.actions`)."""
        s, rec = self.state, self.state.record
        for a in actions:
            match a:
                case Refill():
                    while s.next_step < s.steps and (
                        len(s.pending) < s.towers
                        or (a.until is not None and all(x.index != a.until for x in s.pending))
                    ):
                        s.pending.extend(self._shards(s.next_step))
                        s.next_step += 1
                case OpenStep():
                    s.pending = collections.deque(self._shards(a.step))
                case HandOut():
                    self._hand_out(a.tower, self._take(a.pick), a.params)
                case CollectParams():
                    s.idle.discard(a.tower)
                    self._send(a.tower, Kind.AVERAGE)
                case Ahead():
                    rec.ahead.append(a.lead)
                case Idle():
                    s.idle.add(a.tower)
                case Record():
                    rec.loss_sums[a.step][a.tower] += a.loss
                    rec.counts[a.step][a.tower] += a.samples
                    rec.samples += a.samples
                case Apply():
                    if self._apply(a.messages, a.samples, a.step):
                        self._stale(s.version - 1 - a.pulled)
                    else:
                        rec.skipped.setdefault(a.step, []).extend(a.culprits)
                case Skip():
                    rec.skipped.setdefault(a.step, []).extend(a.towers)
                case Stale():
                    self._stale(a.value)
                case Drop():
                    rec.dropped.append((a.step, a.tower))
                case ShardDone():
                    s.left[a.step] -= 1
                    if s.left[a.step] == 0:
                        self._step_done(a.step)
                case CloseStep():
                    self._step_done(a.step)
                    s.current = a.step + 1
                    s.pending.clear()
                case Requeue():
                    s.pending.appendleft(a.shard)
                case Average():
                    self._average(a.submitted)
                    s.version += 1
                    s.final = s.final or a.final

    def _shards(self, step: int) -> list[Shard]:
        """Global batch ``step`` cut for the towers (the empty shards left out)."""
        s = self.state
        sizes = shard_sizes(batch_len(step, self.n, self.job.batch_size), s.towers)
        shards = [Shard(step, i, size) for i, size in enumerate(sizes) if size > 0]
        s.left[step] = len(shards)
        return shards

    def _take(self, pick: int | None) -> Shard:
        """The queue's first shard of index ``pick`` or of a lost tower, else its first."""
        s = self.state
        if pick is not None:
            for shard in s.pending:
                if shard.index == pick or shard.index not in s.live:
                    s.pending.remove(shard)
                    return shard
        return s.pending.popleft()

    def _hand_out(self, t: int, shard: Shard, params: bool) -> None:
        s = self.state
        s.idle.discard(t)
        self._send(t, Kind.WORK, params, step=shard.step, shard=shard.index, samples=shard.samples)
        s.busy[t] = (shard, s.version)

    def _send(self, t: int, kind: Kind, payload: bool = False, **fields: float) -> None:
        msg = self.layout.new()
        if payload:
            self.layout.write_values(msg, self.model)
        self.layout.stamp(msg, kind, version=self.state.version, payload=payload, **fields)
        self.link.send(t, msg)
        if kind in (Kind.WORK, Kind.AVERAGE):
            self.expecting[t] = time.monotonic()

    def _answered(self, t: int, h: Header) -> tuple[Shard, int]:
        """Tower ``t``'s shard in flight, now answered by ``h``, and the version it pulled."""
        shard, pulled = self.state.busy.pop(t)
        assert (shard.step, shard.index) == (h.step, h.shard), "a worker answered another shard"
        self.state.clock[t] += 1
        return shard, pulled

    def _stale(self, value: int) -> None:
        rec = self.state.record
        rec.staleness.append(value)
        self.reporter.staleness(len(rec.staleness) - 1, value)

    def _step_done(self, step: int) -> None:
        s, rec = self.state, self.state.record
        elapsed = self.elapsed()
        rec.times[step] = rec.prior_seconds + elapsed
        s.done += 1
        loss, per_tower = rec.step_losses(step)
        rate = (rec.samples - self.first_samples) / elapsed if elapsed > 0 else math.nan
        self.reporter.step(step, loss, per_tower, rate)

    def lost(self, t: int) -> None:
        """Worker ``t`` died: forget it, and let the policy hand its work to the others."""
        s = self.state
        if t not in s.live:
            return
        s.live.discard(t)
        s.record.dead.append(t)
        s.idle.discard(t)
        shard = s.busy.pop(t)[0] if t in s.busy else None
        self._do(self.policy.on_lost(s, t, shard))
        self._do(self.policy.settle(s))
        if not s.live and not self.policy.finished(s):
            raise RuntimeError(
                f"every worker died (towers {sorted(s.record.dead)}); training cannot go on "
                f"after {s.done} of {s.steps} steps"
            )

    def _apply(self, msgs: tuple[torch.Tensor, ...], total: int, step: int) -> bool:
        """Apply the summed gradients of ``msgs`` divided by ``total``; False if not finite."""
        params = list(self.model.parameters())
        summed = sum_grads([self.layout.grads(m, self.model) for m in msgs])
        if not assign_mean(params, summed, total):
            return False
        opt = cast(torch.optim.Optimizer, self.replica.optimizer)
        self.replica.schedule_to(self.job.scheduled(step))
        opt.step()
        for p in params:
            p.grad = None
        self.layout.read_buffers(msgs[-1], self.model)
        self.state.version += 1
        return True

    def _average(self, submitted: tuple[tuple[torch.Tensor, int], ...]) -> None:
        """The model becomes the sample-weighted average of the towers' parameters."""
        total = sum(w for _, w in submitted)
        if total <= 0:
            return
        heaviest = max(submitted, key=lambda s: s[1])[0]
        views = [(self.layout.values(m, self.model), w) for m, w in submitted]
        with torch.no_grad():
            for i, t in enumerate(self.layout.tensors(self.model)):
                if t.is_floating_point():
                    # float64 sums: a single contributor comes back bit for bit
                    acc = cast(torch.Tensor, sum(v[i].double() * w for v, w in views if w > 0))
                    t.copy_(acc / total)
                else:  # integer buffers (e.g. BatchNorm's counter): the busiest worker's
                    t.copy_(self.layout.values(heaviest, self.model)[i])

    # -- the result ------------------------------------------------------------------------

    def _result(self) -> EngineResult:
        s, rec = self.state, self.state.record
        losses, tower_losses = [], []
        for step in range(s.steps):
            loss, per_tower = rec.step_losses(step)
            losses.append(loss)
            tower_losses.append([per_tower.get(t, math.nan) for t in range(s.towers)])
        return EngineResult(
            state_dict=cpu_state(self.model),
            losses=losses,
            tower_losses=tower_losses,
            skipped=sorted((k, sorted(v)) for k, v in rec.skipped.items()),
            steps=s.steps,
            samples=rec.samples,
            seconds=self.seconds,
            times=rec.times,
            staleness=rec.staleness,
            ahead=rec.ahead,
            dropped=sorted(rec.dropped),
            dead_workers=sorted(set(rec.dead)),  # a restarted run may lose one again
            evals=list(rec.evals),
        )
