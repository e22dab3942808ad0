"""The own-loop ``Context`` of a job started by ``towers run --elastic``.

The same calls as :class:`~towers.api.context.Context`; underneath, the job survives lost
workers the way ``train(elastic=True)`` does (docs/elastic.md). When a peer is lost during
``ctx.step``, the step regroups the survivors and returns a result with ``redo=True`` (and no
update); ``ctx.shards`` then yields this tower's part of the *same* global batch, split over
the survivors. The loop must only skip what it does after a step when ``r.redo`` is true (a
schedule's ``step()``, logging). A replacement receives the parameters, buffers, optimizer
state and the position in ``ctx.shards`` from a live peer; a learning-rate schedule the loop
builds itself is not sent, so build it from ``ctx.steps`` (e.g. ``LambdaLR(opt, lambda _:
f(ctx.steps))``) if replacements may join.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Iterator
from typing import Any, TypeVar

import torch
from torch import nn

from ..comm.base import PeerFailure
from ..comm.elastic import ElasticConnection
from ..core.agree import BatchStamp, fingerprint
from ..core.split import batch_size, map_batch, split
from ..core.step import StepResult
from ..engines.sync.gradsync import DEFAULT_BUCKET_BYTES
from ..engines.sync.step import SyncStep
from .context import Context

__all__ = ["ElasticContext"]

Batch = TypeVar("Batch")


class ElasticContext(Context):
    """An own-loop context whose job goes on without lost workers; see the module doc."""

    def __init__(self, conn: ElasticConnection):
        self._econn = conn
        self.local_rank = 0
        self.device = conn.device
        self.steps = 0  # global batches completed
        self._shard_samples: int | None = None
        self._batch: tuple[int, int] | None = None  # the last global batch's size, fingerprint
        self._accumulated = False
        self._model: nn.Module | None = None
        self._opt: torch.optim.Optimizer | None = None
        self._pending_opt: dict[str, Any] | None = None
        self._last: StepResult | None = None
        self._redo = False
        self._bucket_bytes = DEFAULT_BUCKET_BYTES
        self._joining = conn.joining
        self._generation = conn.membership.first_generation(conn.joining)
        self._step = SyncStep(conn.comm, self.device)
        self._regroup(model_ready=False)

    @property
    def rank(self) -> int:  # type: ignore[override]
        return self._econn.comm.rank

    @property
    def world_size(self) -> int:  # type: ignore[override]
        return self._econn.comm.world_size

    @property
    def comm(self) -> Any:
        return self._econn.comm

    def _regroup(self, model_ready: bool = True) -> None:
        """Form the next generation (retrying while peers are lost) and agree on the state."""
        while True:
            try:
                self._step.remove()
                self._econn.join(self._generation)
                self._step = SyncStep(self._econn.comm, self.device)
                if model_ready:
                    self._agree()
                return
            except PeerFailure:
                self._generation = self._econn.generation + 1

    def _agree(self) -> None:
        model = self._model
        assert model is not None
        comm = self._econn.comm
        done = comm.all_gather_object(-1 if self._joining else self.steps)
        best = max(done)
        if any(d != best for d in done):
            src = done.index(best)
            state = None
            if comm.rank == src:
                opt = self._opt.state_dict() if self._opt is not None else None
                state = {"steps": best, "model": model.state_dict(), "opt": opt}
                state["last"] = dataclasses.asdict(self._last) if self._last else None
            state = comm.broadcast_object(state, src)
            if comm.rank != src:
                model.load_state_dict(state["model"])
                self._pending_opt = state["opt"]
                self._last = StepResult(**state["last"]) if state["last"] else None
                self.steps = state["steps"]
        self._joining = False
        self._step.replicate(model, self._bucket_bytes)

    def replicate(
        self,
        model: nn.Module,
        *,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        sync_batchnorm: bool = False,
    ) -> nn.Module:
        if sync_batchnorm:
            raise ValueError("towers run --elastic does not combine with sync_batchnorm=True yet")
        if not isinstance(model, nn.Module):
            raise TypeError(f"replicate() needs an nn.Module, got {type(model).__name__}")
        self._model, self._bucket_bytes = model.to(self.device), bucket_bytes
        failed = False
        try:
            self._agree()
        except PeerFailure:
            failed = True
        if failed:
            self._generation = self._econn.generation + 1
            self._regroup()
        return model

    def shards(self, batches: Iterable[Batch]) -> Iterator[Batch]:
        """As :meth:`Context.shards`; after a lost peer, the same global batch again."""
        done = 0
        for batch in batches:
            if done < self.steps:  # a replacement starts where the others are
                done += 1
                continue
            while True:
                shard = split(batch, self.world_size)[self.rank]
                self._shard_samples = batch_size(shard)
                self._batch = (batch_size(batch), fingerprint(batch))
                yield map_batch(lambda t: torch.as_tensor(t).to(self.device), shard)
                if not self._redo:
                    break
                self._redo = False
            done += 1

    def step(
        self,
        loss: torch.Tensor | None,
        optimizer: torch.optim.Optimizer,
        samples: int | None = None,
    ) -> StepResult:
        """As :meth:`Context.step`; ``redo=True`` in the result if a peer was lost."""
        if self._step.sync is None:
            raise RuntimeError("call ctx.replicate(model) before ctx.step()")
        self._opt = optimizer
        if self._pending_opt is not None:
            optimizer.load_state_dict(self._pending_opt)
            self._pending_opt = None
        samples = self._weight(samples)
        size, mark = self._batch if self._batch is not None else (None, None)
        stamp = BatchStamp(self.world_size).pack(self.rank, self.steps, size, mark)
        before, failed = self.steps, False
        try:
            self._step.arm()
            self._backward(loss, samples)
            result = self._step.reduce(stamp, regroup=self._econn.membership.regroup_wanted)
            self._step.apply(result, optimizer)
        except PeerFailure:
            failed = True
        self._shard_samples, self._batch, self._accumulated = None, None, False
        if failed:
            self._step.zero_grad()
            self._generation = self._econn.generation + 1
            self._regroup()
            if self.steps > before and self._last is not None:  # a peer had completed it
                return self._last
            self._redo = True
            return StepResult(math.nan, [], [], skipped=True, redo=True)
        self.steps += 1
        self._last = result
        if self._step.regroup:
            self._generation = self._econn.generation + 1
            self._regroup()
        return result

    def backward(self, loss: torch.Tensor | None, samples: int | None = None) -> StepResult:
        """Not under ``towers run --elastic``: a lost peer could not be redone after it."""
        raise ValueError(
            "ctx.backward() is not available under towers run --elastic (a step interrupted by "
            "a lost worker must be redone inside ctx.step); use ctx.step(loss, optimizer)"
        )

    def close(self) -> None:
        """Wait until every member has done every step, then leave the job."""
        while True:
            failed = False
            try:
                self._econn.comm.barrier()
            except PeerFailure:
                failed = True
            if not failed:
                break
            self._generation = self._econn.generation + 1
            self._regroup(model_ready=self._model is not None)
        self._step.remove()
        self._econn.close()
