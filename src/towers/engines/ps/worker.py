"""A computing tower of the parameter server (ranks 1..workers).

It asks the server for work; each answer names a shard (global batch k, shard i) and, except
between averages in ``local:K`` mode, carries the parameters to compute it with. The worker
computes the shard's gradient exactly as a synchronous tower does
(:func:`~towers.engines.replica.backward_shard`) and sends it back with the loss, the sample
count and the version it pulled: one message, which also asks for the next shard. In ``local:K``
mode it steps its own optimizer instead and sends its parameters every K steps.
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

__all__ = ["work"]


class _Tower:
    """Tower ``tower`` of ``towers``: its replica and what it owes the server."""

    def __init__(self, job: Job, tower: int, towers: int, device: torch.device):
        self.job, self.tower, self.towers, self.device = job, tower, towers, device
        self.local = job.mode.name == "local"
        self.replica = Replica.build(job, device, optimizer=self.local)
        self.slow = float(job.straggle.get(tower, 1.0))
        self.batches = BatchCache(num_samples(job.data), job.batch_size, job.shuffle, job.seed)
        self.since_steps = self.since_samples = 0  # local: since the last average
        self.fetch = Fetcher(job)

    def _fetch(self, micro: list[torch.Tensor]) -> Iterator[Any]:
        return self.fetch(self.job.data, micro)

    def compute(self, h: Header, layout: Layout, out: torch.Tensor) -> dict[str, Any]:
        """Backpropagate shard ``(h.step, h.shard)`` into ``out``; the answer's header fields."""
        model = self.replica.model
        mine = split(self.batches.get(h.step), self.towers)[h.shard]
        loss_sum, samples = backward_shard(
            self.job, model, mine, self.device, slow=self.slow, fetch=self._fetch
        )
        finite = layout.write_grads(out, model) and math.isfinite(loss_sum)
        fields: dict[str, Any] = {"step": h.step, "shard": h.shard, "samples": samples}
        fields |= {"loss": loss_sum, "bad": not finite}
        if not self.local:
            for p in model.parameters():
                p.grad = None
            return fields | {"version": h.version, "payload": 1}
        return fields | self._local_step(h, layout, out, finite, samples)

    def _local_step(
        self, h: Header, layout: Layout, out: torch.Tensor, finite: bool, samples: int
    ) -> dict[str, Any]:
        replica = self.replica
        opt = replica.optimizer
        assert opt is not None
        if finite:
            replica.schedule_to(self.job.scheduled(h.step))
            for p in replica.model.parameters():
                if p.grad is not None:
                    p.grad.div_(samples)
            opt.step()
            self.since_samples += samples
        opt.zero_grad(set_to_none=True)
        fields: dict[str, Any] = {"aux": self.since_steps}
        self.since_steps += 1
        attach = self.since_steps >= self.job.mode.arg  # type: ignore[operator]
        if attach:
            layout.write_values(out, replica.model)
            fields["weight"] = self.since_samples
            self.since_steps = self.since_samples = 0
        return fields | {"payload": attach}


def work(link: WorkerLink, job: Job, tower: int, towers: int, device: torch.device) -> None:
    """Serve as tower ``tower`` of ``towers`` until the server says stop."""
    torch.manual_seed(job.seed + tower)
    me = _Tower(job, tower, towers, device)
    model, layout = me.replica.model, link.layout
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
            layout.write_values(out, model)
            link.send(layout.stamp(out, Kind.PARAMS, payload=1, weight=me.since_samples))
            me.since_steps = me.since_samples = 0
            continue
        if h.payload:
            layout.read_values(msg, model)
            me.since_steps = me.since_samples = 0
        link.send(layout.stamp(out, Kind.RESULT, **me.compute(h, layout, out)))
