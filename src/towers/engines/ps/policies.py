"""The asynchronous modes as policies: when a request is answered, what an arriving result does.

Every policy has the same few methods, called by the server's event loop
(:class:`~towers.engines.ps.server.Server`): ``serve`` answers an idle tower (or leaves it
waiting), ``on_result`` takes a tower's message, ``on_lost`` a tower's death, ``finished`` says
whether training is over, ``checkpointable`` whether the state may be saved now, and
``unapplied`` lists the shards a checkpoint must hand out again. :class:`Async` is the base; the
other modes change what differs:

- ``async``: answer at once; apply each gradient on arrival; staleness = updates applied between
  the worker's pull and the arrival of its gradient.
- ``ssp:S``: as async, but hold a request while the tower is more than S results ahead of the
  slowest live tower (stale synchronous parallel, Ho et al., NIPS 2013).
- ``backup:B``: synchronous: all shards of step k are pulled at the same version; the step
  applies the sample-weighted average of the first ``workers - B`` shards to arrive and drops the
  others (Chen et al., "Revisiting Distributed Synchronous SGD", 2016).
- ``local:K``: towers step their own optimizers; after K steps a tower sends its parameters, and
  once every live tower has, the server averages them weighted by the samples behind them (local
  SGD) and sends the average back.
"""

from __future__ import annotations

import collections
from typing import TYPE_CHECKING, cast

import torch

from ...core.modes import Mode
from .state import Shard
from .wire import Header, Kind

if TYPE_CHECKING:
    from .server import Server

__all__ = ["Async", "Backup", "Local", "Ssp", "make_policy"]


class Async:
    """``async``, and the base of the other policies."""

    server_optimizer = True  # the server owns an optimizer and applies gradients

    def __init__(self, arg: int | None, towers: int):
        self.arg = arg

    def serve(self, server: Server, tower: int) -> None:
        shard = server.take()
        if shard is not None:
            server.state.record.ahead.append(server.state.lead(tower))
            server.hand_out(tower, shard)

    def on_result(self, server: Server, tower: int, h: Header, msg: torch.Tensor) -> None:
        s = server.state
        shard, pulled = server.answered(tower, h)
        server.record(shard.step, tower, h)
        if not h.bad and server.apply([msg], h.samples, shard.step):
            server.stale(s.version - 1 - pulled)
        else:
            s.record.skipped.setdefault(shard.step, []).append(tower)
        s.idle.add(tower)
        server.finish_shard(shard.step)

    def on_lost(self, server: Server, tower: int, shard: Shard | None) -> None:
        if shard is not None:
            server.state.pending.appendleft(shard)  # its shard in flight goes to the others

    def finished(self, server: Server) -> bool:
        return server.state.done == server.state.steps

    def checkpointable(self, server: Server) -> bool:
        return True

    def unapplied(self, server: Server) -> list[Shard]:
        s = server.state
        return [*s.pending, *(shard for shard, _ in s.busy.values())]


class Ssp(Async):
    """``ssp:S``: no tower more than S results ahead of the slowest live one."""

    def serve(self, server: Server, tower: int) -> None:
        if server.state.lead(tower) > cast(int, self.arg):
            return  # a pull now would put it more than S results ahead: hold the request
        super().serve(server, tower)


class Backup(Async):
    """``backup:B``: each step applies the first ``workers - B`` shards to arrive."""

    def __init__(self, arg: int | None, towers: int):
        super().__init__(arg, towers)
        self.towers = towers
        self.opened = -1  # the step whose shards are out
        self.need = 0
        self.arrived: list[tuple[int, Header, torch.Tensor]] = []

    def _open(self, server: Server) -> None:
        s = server.state
        shards = server.shards(s.current)
        s.pending = collections.deque(shards)
        self.arrived = []
        self.need = min(self.towers - cast(int, self.arg), len(shards))
        self.opened = s.current

    def serve(self, server: Server, tower: int) -> None:
        s = server.state
        if self.opened != s.current and s.current < s.steps:
            self._open(server)
        if s.pending:
            server.hand_out(tower, s.pending.popleft())

    def on_result(self, server: Server, tower: int, h: Header, msg: torch.Tensor) -> None:
        s = server.state
        shard, _ = server.answered(tower, h)
        if shard.step == s.current:
            self.arrived.append((tower, h, msg))
            if len(self.arrived) >= self.need:
                self._close(server)
        else:  # the step was applied without it
            s.record.dropped.append((shard.step, tower))
        s.idle.add(tower)

    def _close(self, server: Server) -> None:
        s = server.state
        step = s.current
        for t, h, _ in self.arrived:
            server.record(step, t, h)
        bad = sorted({t for t, h, _ in self.arrived if h.bad})
        total = sum(h.samples for _, h, _ in self.arrived)
        pulled = min(h.version for _, h, _ in self.arrived)
        if not bad and server.apply([m for _, _, m in self.arrived], total, step):
            server.stale(s.version - 1 - pulled)
        else:
            s.record.skipped[step] = bad or sorted({t for t, _, _ in self.arrived})
        server.step_done(step)
        s.current += 1
        s.pending.clear()

    def on_lost(self, server: Server, tower: int, shard: Shard | None) -> None:
        if shard is not None and shard.step == server.state.current:
            server.state.pending.appendleft(shard)

    def unapplied(self, server: Server) -> list[Shard]:
        return []  # the step in progress is opened anew after a resume


class Local(Async):
    """``local:K``: towers step alone; their parameters are averaged every K steps."""

    server_optimizer = False

    def __init__(self, arg: int | None, towers: int):
        super().__init__(arg, towers)
        self.fresh = set(range(towers))  # towers to send the server's parameters to
        self.submitted: dict[int, tuple[torch.Tensor, int]] = {}  # tower -> (params, weight)
        self.averaged = False  # parameters were just averaged: a consistent state to save

    def serve(self, server: Server, tower: int) -> None:
        shard = server.take()
        if shard is not None:
            server.hand_out(tower, shard, params=tower in self.fresh)
            self.fresh.discard(tower)
        else:  # no shard left this round: its parameters go into the average
            server.state.idle.discard(tower)
            server.send(tower, Kind.AVERAGE)

    def on_result(self, server: Server, tower: int, h: Header, msg: torch.Tensor) -> None:
        s = server.state
        if h.kind == Kind.PARAMS:
            self.submitted[tower] = (msg, h.weight)
            self._maybe_average(server)
            return
        shard, _ = server.answered(tower, h)
        server.record(shard.step, tower, h)
        if h.bad:
            s.record.skipped.setdefault(shard.step, []).append(tower)
        else:
            server.stale(h.aux)
        if h.payload:
            self.submitted[tower] = (msg, h.weight)
        else:
            s.idle.add(tower)
        server.finish_shard(shard.step)
        self._maybe_average(server)

    def on_lost(self, server: Server, tower: int, shard: Shard | None) -> None:
        self.submitted.pop(tower, None)  # its steps since the last average are lost
        super().on_lost(server, tower, shard)
        self._maybe_average(server)

    def _maybe_average(self, server: Server) -> None:
        s = server.state
        if s.final or not self.submitted or not set(self.submitted) >= s.live:
            return
        server.average(list(self.submitted.values()))
        s.version += 1
        self.averaged = True
        for tower in self.submitted:
            s.idle.add(tower)
            self.fresh.add(tower)
        self.submitted.clear()
        if s.done == s.steps:
            s.final = True

    def finished(self, server: Server) -> bool:
        return server.state.final

    def checkpointable(self, server: Server) -> bool:
        # only right after an average: then no tower holds more than the saved parameters
        averaged, self.averaged = self.averaged, False
        return averaged


def make_policy(mode: Mode, towers: int) -> Async:
    """The policy object of ``mode`` (any mode but sync)."""
    kinds: dict[str, type[Async]] = {"async": Async, "ssp": Ssp, "backup": Backup, "local": Local}
    return kinds[mode.name](mode.arg, towers)
