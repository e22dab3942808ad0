"""A computing tower of the parameter server (ranks 1..workers).

It asks the server for work; each answer names a shard (global batch k, shard i) and, except
between averages in ``local:K`` mode, carries the parameters to compute it with. The worker
computes the shard's gradient exactly as a synchronous tower does (``loss * samples`` is
backpropagated, micro-batch by micro-batch with ``accumulate``) and sends it back with the loss,
the sample count and the version it pulled: one message, which also asks for the next shard.
In ``local:K`` mode it steps its own optimizer instead and sends its parameters every K steps.
"""

from __future__ import annotations

import copy
import functools
import math
import time
from typing import Any

import torch

from .._context import backward_weighted
from .._data import global_batches, num_samples, take
from .._split import map_batch, split
from ._wire import Kind, Layout, WorkerLink, read_header

__all__ = ["work"]


class _Batches:
    """Global batch k's sample indices, as the server and the sync engine cut them."""

    KEEP = 64  # recent batches kept; an older one (a dead worker's shard) replays the order

    def __init__(self, spec: Any):
        self.spec = spec
        self.n = num_samples(spec.data)
        self._restart()

    def _restart(self) -> None:
        spec = self.spec
        self.order = global_batches(self.n, spec.batch_size, spec.shuffle, spec.seed)
        self.next = 0
        self.cache: dict[int, torch.Tensor] = {}

    def get(self, step: int) -> torch.Tensor:
        if step < self.next and step not in self.cache:
            self._restart()
        while self.next <= step:
            self.cache[self.next] = next(self.order)
            self.cache.pop(self.next - self.KEEP, None)
            self.next += 1
        return self.cache[step]


def _straggle(factor: float, seconds: float) -> None:
    """Make this shard take ``factor`` times as long as it did (an experiment's straggler)."""
    if factor > 1.0:
        time.sleep((factor - 1.0) * seconds)


def work(link: WorkerLink, spec: Any, tower: int, towers: int, device: torch.device) -> None:
    """Serve as tower ``tower`` of ``towers`` until the server says stop."""
    torch.manual_seed(spec.seed + tower)
    model = copy.deepcopy(spec.model).to(device)
    layout: Layout = link.layout
    local = spec.mode.name == "local"
    opt = spec.optimizer(model.parameters()) if local else None
    schedule = spec.lr_schedule(opt) if opt is not None and spec.lr_schedule is not None else None
    scheduled = 0
    factor = float(spec.straggle.get(tower, 1.0))
    batches = _Batches(spec)
    to_device = functools.partial(map_batch, lambda t: t.to(device))
    since_steps = since_samples = 0  # local: since the last average
    out = layout.new()
    link.send(layout.stamp(out, Kind.REQUEST))
    while True:
        msg = link.recv()
        h = read_header(layout, msg)
        if h.kind == Kind.STOP:
            layout.read_values(msg, model)
            link.send(layout.stamp(out, Kind.BYE))
            return
        if h.kind == Kind.AVERAGE:
            layout.write_values(out, model)
            link.send(layout.stamp(out, Kind.PARAMS, payload=1, weight=since_samples))
            since_steps = since_samples = 0
            continue
        if h.payload:
            layout.read_values(msg, model)
            since_steps = since_samples = 0

        mine = split(batches.get(h.step), towers)[h.shard]
        began = time.perf_counter()
        loss_sum, samples = 0.0, 0
        for m in split(mine, spec.accumulate):
            if len(m) == 0:
                continue
            loss = spec.loss_fn(model, to_device(take(spec.data, m)))
            loss_sum += backward_weighted(loss, len(m))
            samples += len(m)
        finite = layout.write_grads(out, model) and math.isfinite(loss_sum)
        _straggle(factor, time.perf_counter() - began)

        fields = {"step": h.step, "shard": h.shard, "samples": samples, "loss": loss_sum}
        if local:
            assert opt is not None
            if finite:
                while schedule is not None and scheduled < h.step:
                    schedule.step()
                    scheduled += 1
                for p in model.parameters():
                    if p.grad is not None:
                        p.grad.div_(samples)
                opt.step()
                since_samples += samples
            opt.zero_grad(set_to_none=True)
            fields["aux"] = since_steps
            since_steps += 1
            attach = since_steps >= spec.mode.arg
            if attach:
                layout.write_values(out, model)
                fields["weight"] = since_samples
                since_steps = since_samples = 0
            fields["payload"] = attach
        else:
            for p in model.parameters():
                p.grad = None
            fields["version"] = h.version
            fields["payload"] = 1
        link.send(layout.stamp(out, Kind.RESULT, bad=not finite, **fields))
