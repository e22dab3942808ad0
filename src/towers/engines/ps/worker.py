"""A computing tower of the parameter server (ranks 1..workers).

It asks the server for work; each answer names a shard (global batch k, shard i) and, except
between averages in ``local:K`` mode, carries the parameters to compute it with. The worker
computes the shard's gradient exactly as a synchronous tower does
(:func:`~towers.engines.replica.backward_shard`); what it does with it and what it sends back
(its wire fields) is its mode's role: :class:`Gradients` sends the gradient with the loss, the
sample count and the version it pulled (one message, which also asks for the next shard);
:class:`LocalSteps` (``local:K``) steps its own optimizer instead and sends its parameters every
K steps.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

import torch

from ...core.data import BatchCache, num_samples
from ...core.split import split
from ..fetch import Fetcher
from ..job import Job
from ..replica import Replica, backward_shard
from .wire import Header, Kind, Layout, WorkerLink, read_header

__all__ = ["Gradients", "LocalSteps", "Role", "Tower", "work"]


class Tower:
    """Tower ``tower`` of ``towers``: its replica, and its ``role`` in its mode."""

    def __init__(
        self, job: Job, role: Role, layout: Layout, tower: int, towers: int, device: torch.device
    ):
        self.job, self.role, self.layout = job, role, layout
        self.tower, self.towers, self.device = tower, towers, device
        self.replica = Replica.build(job, device, optimizer=role.optimizer)
        self.slow = float(job.straggle.get(tower, 1.0))
        self.batches = BatchCache(num_samples(job.data), job.batch_size, job.shuffle, job.seed)
        self.fetch = Fetcher(job)

    def _fetch(self, micro: list[torch.Tensor]) -> Iterator[Any]:
        return self.fetch(self.job.data, micro)

    def compute(self, h: Header, out: torch.Tensor) -> dict[str, Any]:
        """Backpropagate shard ``(h.step, h.shard)`` into ``out``; the answer's header fields."""
        model = self.replica.model
        mine = split(self.batches.get(h.step), self.towers)[h.shard]
        summed, samples = backward_shard(
            self.job, model, mine, self.device, slow=self.slow, fetch=self._fetch
        )
        loss_sum = float(summed)
        finite = self.layout.write_grads(out, model) and math.isfinite(loss_sum)
        fields: dict[str, Any] = {"step": h.step, "shard": h.shard, "samples": samples}
        fields |= {"loss": loss_sum, "bad": not finite}
        return fields | self.role.answer(self, h, out, finite, samples)


class Role:
    """What a tower does with a shard's gradient, and what it tells the server."""

    optimizer = False  # whether the tower steps an optimizer of its own

    def answer(
        self, tower: Tower, h: Header, out: torch.Tensor, finite: bool, samples: int
    ) -> dict[str, Any]:
        """Act on the gradient of ``samples`` samples in the tower's model (``finite``: no NaN
        or infinity); returns the answer's mode-specific header fields, with ``out``'s payload
        written."""
        raise NotImplementedError

    def loaded(self) -> None:
        """The server's parameters were loaded into the tower's model."""

    def collect(self, tower: Tower, out: torch.Tensor) -> dict[str, Any]:
        """The server asked for the tower's parameters: write them into ``out``; returns the
        header fields."""
        raise AssertionError("the server asked a tower that sends gradients for its parameters")


class Gradients(Role):
    """``async``, ``ssp:S``, ``backup:B``: send each shard's gradient; the server steps."""

    def answer(
        self, tower: Tower, h: Header, out: torch.Tensor, finite: bool, samples: int
    ) -> dict[str, Any]:
        for p in tower.replica.model.parameters():
            p.grad = None
        return {"version": h.version, "payload": 1}


class LocalSteps(Role):
    """``local:K``: step alone; send the parameters after every K steps."""

    optimizer = True

    def __init__(self, every: int):
        self.every = every
        self.steps = self.samples = 0  # since the last average

    def answer(
        self, tower: Tower, h: Header, out: torch.Tensor, finite: bool, samples: int
    ) -> dict[str, Any]:
        replica = tower.replica
        opt = replica.optimizer
        assert opt is not None
        if finite:
            replica.schedule_to(tower.job.scheduled(h.step))
            for p in replica.model.parameters():
                if p.grad is not None:
                    p.grad.div_(samples)
            opt.step()
            self.samples += samples
        opt.zero_grad(set_to_none=True)
        fields: dict[str, Any] = {"aux": self.steps}
        self.steps += 1
        if self.steps < self.every:
            return fields | {"payload": 0}
        return fields | self.collect(tower, out)

    def loaded(self) -> None:
        self.steps = self.samples = 0

    def collect(self, tower: Tower, out: torch.Tensor) -> dict[str, Any]:
        tower.layout.write_values(out, tower.replica.model)
        fields = {"payload": 1, "weight": self.samples}
        self.steps = self.samples = 0
        return fields


def work(
    link: WorkerLink, job: Job, role: Role, tower: int, towers: int, device: torch.device
) -> None:
    """Serve as tower ``tower`` of ``towers`` in ``role`` until the server says stop."""
    torch.manual_seed(job.seed + tower)
    layout = link.layout
    me = Tower(job, role, layout, tower, towers, device)
    model = me.replica.model
    out = layout.new()
    link.send(layout.stamp(out, Kind.REQUEST))
    while True:
        msg = link.recv()
        h = read_header(layout, msg)
        if h.kind == Kind.STOP:
            me.fetch.close()
            layout.read_values(msg, model)
            link.send(layout.stamp(out, Kind.BYE))
            return
        if h.kind == Kind.AVERAGE:
            link.send(layout.stamp(out, Kind.PARAMS, **role.collect(me, out)))
            continue
        if h.payload:
            layout.read_values(msg, model)
            role.loaded()
        link.send(layout.stamp(out, Kind.RESULT, **me.compute(h, out)))
