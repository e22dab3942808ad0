"""The parameter server (rank 0): owns the parameters and the optimizer, hands out shards,
applies what comes back, and keeps the record that becomes the :class:`towers.TrainResult`.

Work is handed out on request, one shard (global batch k, shard i) at a time, so a fast worker
takes more shards than a slow one and a dead worker's shard in flight goes back to the queue.
Global batches and their split are those of the sync engine (``global_batches`` and ``split``
over ``workers``), so every mode sees the same data. The modes differ only in when a request is
answered and what an arriving result does:

- ``async``: answer at once; apply each gradient on arrival; staleness = updates applied between
  the worker's pull and the arrival of its gradient.
- ``ssp:S``: as async, but hold a request while the worker is more than S results ahead of the
  slowest live worker (stale synchronous parallel, Ho et al., NIPS 2013).
- ``backup:B``: synchronous: all shards of step k are pulled at the same version; the step
  applies the sample-weighted average of the first ``workers - B`` shards to arrive and drops the
  others (Chen et al., "Revisiting Distributed Synchronous SGD", 2016).
- ``local:K``: workers step their own optimizers; after K steps a worker sends its parameters, and
  once every live worker has, the server averages them weighted by the samples behind them
  (local SGD) and sends the average back.

A non-finite loss or gradient is never applied: the shard (backup: the step) is reported in
``skipped`` with the worker that computed it.

With ``checkpoint=``, the server saves its state every ``checkpoint_every`` completed global
batches and at the end, and a server built from such a checkpoint goes on from it (``_resume``).
"""

from __future__ import annotations

import collections
import copy
import math
import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import torch

from .. import _checkpoint
from .._data import batches_per_epoch, num_samples
from .._report import Reporter
from .._split import shard_sizes
from . import _resume
from ._wire import Header, Kind, Layout, ServerLink, read_header

__all__ = ["Server"]


# For tests only: "K:PATH" makes the server kill itself with SIGKILL once K global batches are
# complete, unless PATH exists (it is created first, so the restarted server goes on). It stands
# in for a lost server machine, which no loss_fn can simulate: the server computes no loss.
_KILL_ENV = "TOWERS_PS_TEST_KILL"


def _kill_hook() -> tuple[int, Path] | None:
    value = os.environ.get(_KILL_ENV)
    if not value:
        return None
    at, _, path = value.partition(":")
    return int(at), Path(path)


@dataclass(frozen=True)
class _Shard:
    step: int
    index: int
    samples: int


def _batch_len(step: int, n: int, batch_size: int) -> int:
    """Samples in global batch ``step``: DataLoader keeps the smaller last batch of an epoch."""
    return min(batch_size, n - (step % batches_per_epoch(n, batch_size)) * batch_size)


class Server:
    """Serves ``towers`` workers (ranks 1..towers) over ``link``; see the module docstring."""

    def __init__(self, spec: Any, link: ServerLink, layout: Layout, towers: int, device: Any):
        self.spec = spec
        self.link = link
        self.layout = layout
        self.towers = towers
        self.mode = spec.mode.name
        self.arg = spec.mode.arg
        self.steps = spec.steps
        self.model = copy.deepcopy(spec.model).to(device)
        self.opt = None if self.mode == "local" else spec.optimizer(self.model.parameters())
        self.schedule = (
            spec.lr_schedule(self.opt)
            if self.opt is not None and spec.lr_schedule is not None
            else None
        )
        self.scheduled = 0  # schedule.step() calls so far: one per global batch
        self.version = 0  # updates applied
        self.n = num_samples(spec.data)

        self.pending: collections.deque[_Shard] = collections.deque()
        self.next_step = 0  # the next global batch to cut into shards
        self.left: dict[int, int] = {}  # step -> shards not finished yet
        self.busy: dict[int, tuple[_Shard, int]] = {}  # tower -> (shard, version pulled)
        self.idle: set[int] = set()  # towers waiting for an answer
        self.live = set(range(towers))
        self.clock = [0] * towers  # results received per tower
        self.fresh = set(range(towers))  # local: towers to send the server's parameters to
        self.submitted: dict[int, tuple[torch.Tensor, int]] = {}  # local: params, weight
        self.arrived: list[tuple[int, Header, torch.Tensor]] = []  # backup: this step's results
        self.current = 0  # backup: the step in progress
        self.done = 0  # steps complete
        self.final = False  # local: the last average is done
        self.byes: set[int] = set()

        self.loss_sums = [[0.0] * towers for _ in range(self.steps)]
        self.counts = [[0] * towers for _ in range(self.steps)]
        self.times = [math.nan] * self.steps
        self.staleness: list[int] = []
        self.ahead: list[int] = []
        self.skipped: dict[int, list[int]] = {}
        self.dropped: list[tuple[int, int]] = []
        self.dead: list[int] = []
        self.samples = 0
        self.start = 0.0
        self.seconds = math.nan
        self.prior_seconds = 0.0  # training time before this run (resumed from a checkpoint)
        self.saved = 0  # steps complete at the last checkpoint
        self.averaged = False  # local: parameters were just averaged (a consistent state)
        self.kill_at = _kill_hook()

        if spec.resume is not None:
            _resume.restore(self, spec.resume, _Shard)
        if self.mode == "backup" and self.current < self.steps:
            self._open_step()
        # progress bar and TensorBoard: the server holds the record, so it reports
        self.reporter = Reporter(spec, main=True, initial=self.done)
        self.first_samples = self.samples  # samples/s counts this run's only

    # -- the loop --------------------------------------------------------------------------

    def run(self) -> dict[str, Any]:
        self.start = time.perf_counter()
        try:
            self._loop()
        finally:
            self.reporter.close()
        self.link.close()
        return self._report()

    def _loop(self) -> None:
        while self.live - self.byes:
            tower, msg = self.link.get()
            if msg is None:
                self._lost(tower)
            else:
                h = read_header(self.layout, msg)
                if h.kind == Kind.REQUEST:
                    self.idle.add(tower)
                elif h.kind == Kind.RESULT:
                    self._result(tower, h, msg)
                elif h.kind == Kind.PARAMS:
                    self.submitted[tower] = (msg, h.weight)
                elif h.kind == Kind.BYE:
                    self.byes.add(tower)
            self._serve()
            self._maybe_save()

    def elapsed(self) -> float:
        """Seconds since this run's loop started (``prior_seconds`` holds earlier runs')."""
        return time.perf_counter() - self.start

    def _finished(self) -> bool:
        return self.final if self.mode == "local" else self.done == self.steps

    def _serve(self) -> None:
        if self.mode == "local":
            self._maybe_average()
        if self._finished():
            if math.isnan(self.seconds):
                self.seconds = self.prior_seconds + self.elapsed()
            for t in sorted(self.idle):
                self._send(t, Kind.STOP, payload=True)
            self.idle.clear()
            return
        for t in sorted(self.idle):
            if self.mode == "backup":
                shard = self.pending.popleft() if self.pending else None
            else:
                shard = self._next_shard(t)
            if shard is not None:
                self._hand_out(t, shard)
            elif self.mode == "local" and not self._more_shards():
                self.idle.discard(t)
                self._send(t, Kind.AVERAGE)

    def _more_shards(self) -> bool:
        self._refill()
        return bool(self.pending)

    def _next_shard(self, t: int) -> _Shard | None:
        if not self._more_shards():
            return None
        if self.mode == "ssp" and self._lead(t) > self.arg:
            return None  # a pull now would put t more than S results ahead of the slowest
        return self.pending.popleft()

    def _lead(self, t: int) -> int:
        return self.clock[t] - min(self.clock[v] for v in self.live)

    def _refill(self) -> None:
        while len(self.pending) < self.towers and self.next_step < self.steps:
            self.pending.extend(self._shards(self.next_step))
            self.next_step += 1

    def _shards(self, step: int) -> list[_Shard]:
        sizes = shard_sizes(_batch_len(step, self.n, self.spec.batch_size), self.towers)
        shards = [_Shard(step, i, s) for i, s in enumerate(sizes) if s > 0]
        self.left[step] = len(shards)
        return shards

    def _hand_out(self, t: int, shard: _Shard) -> None:
        self.idle.discard(t)
        if self.mode in ("async", "ssp"):
            self.ahead.append(self._lead(t))
        payload = self.mode != "local" or t in self.fresh
        self.fresh.discard(t)
        self._send(t, Kind.WORK, payload, step=shard.step, shard=shard.index, samples=shard.samples)
        self.busy[t] = (shard, self.version)

    def _send(self, t: int, kind: Kind, payload: bool = False, **fields: float) -> None:
        msg = self.layout.new()
        if payload:
            self.layout.write_values(msg, self.model)
        self.layout.stamp(msg, kind, version=self.version, payload=payload, **fields)
        self.link.send(t, msg)

    # -- events ----------------------------------------------------------------------------

    def _result(self, t: int, h: Header, msg: torch.Tensor) -> None:
        shard, pulled = self.busy.pop(t)
        assert (shard.step, shard.index) == (h.step, h.shard), "a worker answered another shard"
        self.clock[t] += 1
        if self.mode == "backup":
            if shard.step == self.current:
                self.arrived.append((t, h, msg))
                if len(self.arrived) >= self.need:
                    self._close_step()
            else:  # the step was applied without it
                self.dropped.append((shard.step, t))
            self.idle.add(t)
            return
        self._record(shard.step, t, h)
        if self.mode == "local":
            if h.bad:
                self.skipped.setdefault(shard.step, []).append(t)
            else:
                self._stale(h.aux)
            if h.payload:
                self.submitted[t] = (msg, h.weight)
            else:
                self.idle.add(t)
        else:
            if not h.bad and self._apply([msg], h.samples, shard.step):
                self._stale(self.version - 1 - pulled)
            else:
                self.skipped.setdefault(shard.step, []).append(t)
            self.idle.add(t)
        self.left[shard.step] -= 1
        if self.left[shard.step] == 0:
            self._step_done(shard.step)

    def _lost(self, t: int) -> None:
        """Worker ``t`` died: forget it, and give its shard in flight to the others."""
        if t not in self.live:
            return
        self.live.discard(t)
        self.dead.append(t)
        self.idle.discard(t)
        self.submitted.pop(t, None)  # local: its steps since the last average are lost
        if t in self.busy:
            shard, _ = self.busy.pop(t)
            if self.mode != "backup" or shard.step == self.current:
                self.pending.appendleft(shard)
        if not self.live and not self._finished():
            raise RuntimeError(
                f"every worker died (towers {sorted(self.dead)}); training cannot go on "
                f"after {self.done} of {self.steps} steps"
            )

    def _record(self, step: int, t: int, h: Header) -> None:
        self.loss_sums[step][t] += h.loss
        self.counts[step][t] += h.samples
        self.samples += h.samples

    def _step_done(self, step: int) -> None:
        elapsed = self.elapsed()
        self.times[step] = self.prior_seconds + elapsed
        self.done += 1
        loss, per_tower = self._step_losses(step)
        rate = (self.samples - self.first_samples) / elapsed if elapsed > 0 else math.nan
        self.reporter.step(step, loss, per_tower, rate)
        if self.kill_at is not None and self.done == self.kill_at[0]:
            marker = self.kill_at[1]
            if not marker.exists():
                marker.write_text(f"server killed after {self.done} global batches")
                os.kill(os.getpid(), signal.SIGKILL)

    def _step_losses(self, step: int) -> tuple[float, dict[int, float]]:
        """Global batch ``step``'s mean loss, and each tower's where it computed samples."""
        sums, counts = self.loss_sums[step], self.counts[step]
        total = sum(counts)
        per_tower = {t: s / c for t, (s, c) in enumerate(zip(sums, counts)) if c}
        return (sum(sums) / total if total else math.nan), per_tower

    def _stale(self, value: int) -> None:
        self.staleness.append(value)
        self.reporter.staleness(len(self.staleness) - 1, value)

    def _maybe_save(self) -> None:
        """Checkpoint once ``checkpoint_every`` more global batches are complete, and at the end."""
        every = self.spec.checkpoint_every
        if self.spec.checkpoint is None or self.done == self.saved:
            return
        if self.mode == "local":  # only right after an average: then no worker holds more
            if not self.averaged:
                return
            self.averaged = False
        if self.done // every > self.saved // every or self._finished():
            _checkpoint.save(self.spec.checkpoint, self.done, _resume.snapshot(self))
            self.saved = self.done

    def _apply(self, msgs: list[torch.Tensor], total: int, step: int) -> bool:
        """Apply the summed gradients of ``msgs`` divided by ``total``; False if not finite."""
        params = list(self.model.parameters())
        per_msg = [self.layout.grads(m, self.model) for m in msgs]
        grads: list[torch.Tensor | None] = []
        for i in range(len(params)):
            present = [g for grads_of_msg in per_msg if (g := grads_of_msg[i]) is not None]
            if not present:
                grads.append(None)
                continue
            g = present[0] if len(present) == 1 else torch.stack(present).sum(0)
            if not bool(torch.isfinite(g).all()):
                return False
            grads.append(g)
        assert self.opt is not None
        while self.schedule is not None and self.scheduled < step:
            self.schedule.step()
            self.scheduled += 1
        for p, g in zip(params, grads):
            # The worker backpropagated loss * samples, as the sync engine does; dividing here
            # gives a one-tower step the same rounding as a synchronous one.
            p.grad = None if g is None else g.to(p.device).div(total)
        self.opt.step()
        for p in params:
            p.grad = None
        self.layout.read_buffers(msgs[-1], self.model)
        self.version += 1
        return True

    # -- backup:B ------------------------------------------------------------------------------

    def _open_step(self) -> None:
        shards = self._shards(self.current)
        self.pending = collections.deque(shards)
        self.arrived = []
        self.need = min(self.towers - self.arg, len(shards))

    def _close_step(self) -> None:
        step = self.current
        for t, h, _ in self.arrived:
            self._record(step, t, h)
        bad = sorted({t for t, h, _ in self.arrived if h.bad})
        total = sum(h.samples for _, h, _ in self.arrived)
        pulled = min(h.version for _, h, _ in self.arrived)
        if not bad and self._apply([m for _, _, m in self.arrived], total, step):
            self._stale(self.version - 1 - pulled)
        else:
            self.skipped[step] = bad or sorted({t for t, _, _ in self.arrived})
        self._step_done(step)
        self.current += 1
        if self.current < self.steps:
            self._open_step()
        else:
            self.pending.clear()

    # -- local:K -------------------------------------------------------------------------------

    def _maybe_average(self) -> None:
        if self.final or not self.submitted or not set(self.submitted) >= self.live:
            return
        total = sum(w for _, w in self.submitted.values())
        if total > 0:
            heaviest = max(self.submitted.values(), key=lambda s: s[1])[0]
            views = [(self.layout.values(m, self.model), w) for m, w in self.submitted.values()]
            with torch.no_grad():
                for i, t in enumerate(self.layout.tensors(self.model)):
                    if t.is_floating_point():
                        # float64 sums: a single contributor comes back bit for bit
                        acc = cast(torch.Tensor, sum(v[i].double() * w for v, w in views if w > 0))
                        t.copy_(acc / total)
                    else:  # integer buffers (e.g. BatchNorm's counter): the busiest worker's
                        t.copy_(self.layout.values(heaviest, self.model)[i])
        self.version += 1
        self.averaged = True
        for tower in self.submitted:
            self.idle.add(tower)
            self.fresh.add(tower)
        self.submitted.clear()
        if self.done == self.steps:
            self.final = True

    # -- the result ------------------------------------------------------------------------------

    def _report(self) -> dict[str, Any]:
        losses, tower_losses = [], []
        for step in range(self.steps):
            loss, per_tower = self._step_losses(step)
            losses.append(loss)
            tower_losses.append([per_tower.get(t, math.nan) for t in range(self.towers)])
        state = {k: v.detach().cpu().clone() for k, v in self.model.state_dict().items()}
        return {
            "state_dict": state,
            "losses": losses,
            "tower_losses": tower_losses,
            "skipped": sorted((k, sorted(v)) for k, v in self.skipped.items()),
            "steps": self.steps,
            "samples": self.samples,
            "seconds": self.seconds,
            "staleness": self.staleness,
            "ahead": self.ahead,
            "dropped": sorted(self.dropped),
            "dead_workers": sorted(set(self.dead)),  # a restarted run may lose one again
            "times": self.times,
        }
