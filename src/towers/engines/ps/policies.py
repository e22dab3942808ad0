"""The parameter server's modes as policies: they decide, the server acts.

A policy reads the server's state (:class:`~towers.engines.ps.state.ServerState`, never changed
here) and returns what to do as a list of actions (:mod:`towers.engines.ps.actions`), which the
server carries out in order. A policy may keep bookkeeping of its own (results held for an
average, the step it opened). The server asks:

- ``serve(state, tower)``: an idle tower waits; answer it (a shard, a request for parameters) or
  hold it (no actions);
- ``on_result(state, result)``: a tower answered its shard (the server has already taken the
  shard off the tower's hands); ``on_params``: a tower sent its parameters (``local:K``);
- ``on_lost(state, tower, shard)``: a tower died (the server has already let it go) holding
  ``shard``;
- ``settle(state)``: after an event's actions are done, anything that follows from the new state
  (``local:K``: the average, once every live tower has sent its parameters);
- ``finished``, ``checkpointable``, ``unapplied``: whether training is over, whether the state
  may be saved now, and which shards a checkpoint must hand out again.

The modes:

- ``async``: answer at once; apply each gradient on arrival; staleness = updates applied between
  the worker's pull and the arrival of its gradient.
- ``ssp:S``: as async, but hold a request while the tower is more than S results ahead of the
  slowest live tower (stale synchronous parallel, Ho et al., NIPS 2013).
- ``backup:B``: synchronous: all shards of step k are pulled at the same version; the step
  applies the sample-weighted average of the first ``workers - B`` shards to arrive and drops the
  others (Chen et al., "Revisiting Distributed Synchronous SGD", 2016).
- ``local:K``: towers step their own optimizers, tower t on shard t of each global batch in
  turn; after K steps a tower sends its parameters, and once every live tower has, the server
  averages them weighted by the samples behind them (local SGD) and sends the average back.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

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
from .state import ServerState, Shard
from .wire import Header

__all__ = ["AsyncPolicy", "BackupPolicy", "LocalPolicy", "Policy", "Result", "SspPolicy"]


@dataclass(frozen=True)
class Result:
    """Tower ``tower``'s answer to ``shard``, pulled at version ``pulled``."""

    tower: int
    header: Header
    message: torch.Tensor
    shard: Shard
    pulled: int


def _available(s: ServerState) -> bool:
    """Whether a shard is left to hand out (queued, or in a global batch not cut yet)."""
    return bool(s.pending) or s.next_step < s.steps


def _recorded(result: Result) -> Record:
    h = result.header
    return Record(result.shard.step, result.tower, h.loss, h.samples)


class Policy:
    """What every policy shares; each mode's policy overrides what differs."""

    server_optimizer = True  # the server owns an optimizer and applies gradients

    def serve(self, s: ServerState, tower: int) -> list[Action]:
        raise NotImplementedError

    def on_result(self, s: ServerState, result: Result) -> list[Action]:
        raise NotImplementedError

    def on_params(self, s: ServerState, tower: int, h: Header, msg: torch.Tensor) -> list[Action]:
        raise AssertionError(f"tower {tower} sent parameters unasked")

    def on_lost(self, s: ServerState, tower: int, shard: Shard | None) -> list[Action]:
        # its shard in flight goes to the others
        return [] if shard is None else [Requeue(shard)]

    def settle(self, s: ServerState) -> list[Action]:
        return []

    def finished(self, s: ServerState) -> bool:
        return s.done == s.steps

    def checkpointable(self, s: ServerState) -> bool:
        return True

    def unapplied(self, s: ServerState) -> list[Shard]:
        return [*s.pending, *(shard for shard, _ in s.busy.values())]


class AsyncPolicy(Policy):
    """``async``: every request answered at once, every gradient applied on arrival."""

    def serve(self, s: ServerState, tower: int) -> list[Action]:
        if not _available(s):
            return []
        return [Refill(), Ahead(s.lead(tower)), HandOut(tower)]

    def on_result(self, s: ServerState, result: Result) -> list[Action]:
        h, step, tower = result.header, result.shard.step, result.tower
        if h.bad:
            use: Action = Skip(step, (tower,))
        else:
            use = Apply((result.message,), h.samples, step, result.pulled, (tower,))
        return [_recorded(result), use, Idle(tower), ShardDone(step)]


class SspPolicy(AsyncPolicy):
    """``ssp:S``: no tower more than S results ahead of the slowest live one."""

    def __init__(self, bound: int):
        self.bound = bound

    def serve(self, s: ServerState, tower: int) -> list[Action]:
        if s.lead(tower) > self.bound:
            return []  # a pull now would put it more than S results ahead: hold the request
        return super().serve(s, tower)


class BackupPolicy(Policy):
    """``backup:B``: each step applies the first ``workers - B`` shards to arrive."""

    def __init__(self, spares: int, towers: int):
        self.spares, self.towers = spares, towers
        self.opened = -1  # the step whose shards are out
        self.arrived: list[Result] = []

    def serve(self, s: ServerState, tower: int) -> list[Action]:
        if self.opened != s.current and s.current < s.steps:
            self.opened, self.arrived = s.current, []
            return [OpenStep(s.current), HandOut(tower)]  # a global batch has a shard or more
        return [HandOut(tower)] if s.pending else []

    def on_result(self, s: ServerState, result: Result) -> list[Action]:
        tower = result.tower
        if result.shard.step != s.current:  # the step was applied without it
            return [Drop(result.shard.step, tower), Idle(tower)]
        self.arrived.append(result)
        # s.left[step]: the step's shards, counted when it was opened
        if len(self.arrived) < min(self.towers - self.spares, s.left[s.current]):
            return [Idle(tower)]
        return [*self._close(s.current), Idle(tower)]

    def _close(self, step: int) -> list[Action]:
        arrived, self.arrived = self.arrived, []
        actions: list[Action] = [_recorded(r) for r in arrived]
        bad = tuple(sorted({r.tower for r in arrived if r.header.bad}))
        if bad:
            actions.append(Skip(step, bad))
        else:
            total = sum(r.header.samples for r in arrived)
            pulled = min(r.header.version for r in arrived)
            culprits = tuple(sorted({r.tower for r in arrived}))
            actions.append(Apply(tuple(r.message for r in arrived), total, step, pulled, culprits))
        return [*actions, CloseStep(step)]

    def on_lost(self, s: ServerState, tower: int, shard: Shard | None) -> list[Action]:
        if shard is not None and shard.step == s.current:
            return [Requeue(shard)]
        return []

    def unapplied(self, s: ServerState) -> list[Shard]:
        return []  # the step in progress is opened anew after a resume


class LocalPolicy(Policy):
    """``local:K``: towers step alone; their parameters are averaged every K steps."""

    server_optimizer = False

    def __init__(self, towers: int):
        self.fresh = set(range(towers))  # towers to send the server's parameters to
        self.submitted: dict[int, tuple[torch.Tensor, int]] = {}  # tower -> (params, weight)
        self.averaged = False  # parameters were just averaged: a consistent state to save

    def serve(self, s: ServerState, tower: int) -> list[Action]:
        if not self._left_for(s, tower):  # its parameters go into the average
            return [CollectParams(tower)]
        params = tower in self.fresh
        self.fresh.discard(tower)
        # Tower t takes shard t of each global batch in turn (a lost tower's shards first), as
        # in diloco:K, whose special case local:K is (docs/diloco.md): the same shards give the
        # same parameters. A batch with fewer shards than towers is skipped by the others.
        return [Refill(until=tower), HandOut(tower, params=params, pick=tower)]

    @staticmethod
    def _left_for(s: ServerState, tower: int) -> bool:
        """Whether a shard is left for ``tower``: a global batch to cut, or a queued shard of
        its own or of a lost tower (a live tower's shards wait for it)."""
        if s.next_step < s.steps:
            return True
        return any(x.index == tower or x.index not in s.live for x in s.pending)

    def on_params(self, s: ServerState, tower: int, h: Header, msg: torch.Tensor) -> list[Action]:
        self.submitted[tower] = (msg, h.weight)
        return []

    def on_result(self, s: ServerState, result: Result) -> list[Action]:
        h, step, tower = result.header, result.shard.step, result.tower
        actions: list[Action] = [_recorded(result), Skip(step, (tower,)) if h.bad else Stale(h.aux)]
        if h.payload:  # its K-th step: its parameters go into the average
            self.submitted[tower] = (result.message, h.weight)
        else:
            actions.append(Idle(tower))
        return [*actions, ShardDone(step)]

    def on_lost(self, s: ServerState, tower: int, shard: Shard | None) -> list[Action]:
        self.submitted.pop(tower, None)  # its steps since the last average are lost
        return super().on_lost(s, tower, shard)

    def settle(self, s: ServerState) -> list[Action]:
        if s.final or not self.submitted or not set(self.submitted) >= s.live:
            return []
        submitted, self.submitted = self.submitted, {}
        self.averaged = True
        self.fresh |= set(submitted)
        average = Average(tuple(submitted.values()), final=s.done == s.steps)
        return [average, *(Idle(t) for t in submitted)]

    def finished(self, s: ServerState) -> bool:
        return s.final

    def checkpointable(self, s: ServerState) -> bool:
        # only right after an average: then no tower holds more than the saved parameters
        averaged, self.averaged = self.averaged, False
        return averaged
