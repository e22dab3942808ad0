"""The own loop's steps: what ``ctx.backward``, ``ctx.step``, ``ctx.accumulate`` and a script's
own ``loss.backward()`` do over the group (``Context`` holds one :class:`Stepper`).

A step arms the driver (when the mode reduces every step), backpropagates, and hands the step
to the mode's plan, inside the group's attempt (an elastic job redoes it after a lost peer).

A script that keeps DDP's ``loss.backward()`` gets the same step from the driver's hooks: the
first gradient of a backward the script did not arm arms it, weighting every gradient by the
samples of the shards ``ctx.shards`` gave since the last step (the loss is a mean over them),
and the step is completed when that backward ends (autograd's end-of-backward callback, as
DDP finishes its reduction there), so that ``optimizer.step()`` right after sees the global
batch's gradient. ``no_sync()`` (or DDP's ``require_backward_grad_sync = False``, as nanoGPT
sets it) keeps a backward local, for gradient accumulation. towers does not see such a loss:
the step's result (``ctx.last``) has its shard sizes and skips, and its loss is ``nan``.
"""

from __future__ import annotations

import contextlib
import functools
import time
import warnings
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from ..comm.hang import calling
from ..core.agree import BatchStamp
from ..core.step import StepResult
from ..core.verdict import known, when_known
from ..engines.replica import check_loss
from ..engines.sync.driver import SyncDriver
from ..engines.sync.group import Group
from ..engines.sync.runner import StepRunner
from ..engines.sync.state import LastResult, RunState
from .amp import FIX_LOOP, FLOAT16, float16_without_scaler, poison_grads
from .micro import MicroBatches
from .mistakes import (
    BACKWARD_TWICE,
    NO_SAMPLES,
    PLAIN_BACKWARD_ELASTIC,
    PLAIN_BACKWARD_EMPTY_SHARD,
    PLAIN_BACKWARD_NO_SHARDS,
    PLAIN_BACKWARD_SKIPPED,
    SHARDED_JOIN,
)

__all__ = ["Stepper"]


class Stepper:
    """One rank's steps over ``group``; see the module doc."""

    def __init__(self, group: Group, state: RunState, last: LastResult):
        self.group, self.state, self.last = group, state, last
        self.runner = StepRunner(group, state, SyncDriver(group, owner=state))
        self.model: nn.Module | None = None
        self.redo = False  # the last step must be trained again (a peer was lost)
        self.shard_samples: int | None = None  # the last shard's samples
        self.since_step = 0  # samples of every shard since the last step
        self.empty: tuple[int, int] | None = None  # an empty shard since: (batch, towers)
        self.batch: tuple[int, int] | None = None  # the last global batch's size, fingerprint
        self.accumulated = False  # accumulate() ran since the last step
        self.local = False  # no_sync(): a backward that stays on this tower
        self._own = False  # inside a backward that towers runs itself
        self.warned_skip = False  # a plain backward's skipped step was reported
        self.joining = False  # out of batches: empty steps beside the others' (DDP's join)
        self.alone = False  # a script's optimizer steps this tower alone (DiLoCo, towers.ddp)
        self.micro: MicroBatches | None = None  # towers.ddp: accumulated micro-batches' sizes

    @property
    def driver(self) -> SyncDriver:
        return self.runner.driver

    def attach(self, driver: SyncDriver, model: nn.Module) -> None:
        """The driver of the replicated ``model``, made with :meth:`on_unarmed`: a backward
        nobody armed arms itself."""
        self.runner.use(driver)
        self.model = model

    def shard(self, samples: int, batch: tuple[int, int]) -> None:
        """``ctx.shards`` yields a shard of ``samples`` of a global batch (size, fingerprint)."""
        self.batch = batch
        if samples == 0:
            self.empty = (batch[0], self.group.comm.world_size)
        self.own_batch(samples)

    def own_batch(self, samples: int) -> None:
        """A batch of ``samples`` goes into this tower's forward (a shard of ``ctx.shards``, or
        a DDP-style script's own batch): the next step weights this tower by its samples since
        the last step."""
        self.shard_samples = samples
        self.since_step += samples
        self.runner.shard_taken()  # the forward and backward start here

    def own_forward(self, samples: int) -> None:
        """A DDP-style script's training forward of ``samples`` samples (:meth:`own_batch`);
        in an accumulated step, its micro-batch's size over all ranks is learned too
        (:mod:`towers.api.micro`)."""
        self.own_batch(samples)
        micro = self.micro
        if micro is None or self.alone or not self.state.plan.reduces or self.group.elastic:
            return
        if micro.active or self.kept_local():
            began = time.perf_counter()
            micro.forward(samples)  # waits for every rank's forward to reach it
            self.runner.waited(time.perf_counter() - began)

    def kept_local(self) -> bool:
        """A backward now stays on this tower: inside ``no_sync()``, or with nanoGPT's
        ``require_backward_grad_sync = False`` on the model."""
        return self.local or not getattr(self.model, "require_backward_grad_sync", True)

    def weight(self, samples: int | None) -> int:
        if samples is None:
            return self.shard_samples if self.shard_samples is not None else 1
        if isinstance(samples, bool) or not isinstance(samples, int) or samples < 0:
            raise ValueError(f"samples must be an int >= 0, got {samples!r}")
        return samples

    def backward(self, loss: torch.Tensor | None, samples: int, scaler: Any = None) -> None:
        """Backpropagate ``loss * samples`` on this tower (towers' own backward)."""
        if samples == 0 or loss is None:
            return
        check_loss(loss, "the loss passed to ctx.backward()/ctx.step()")
        self._own = True
        try:
            self.driver.backward(loss, samples, scaler)
        except RuntimeError as exc:
            if "backward through the graph a second time" not in str(exc):
                raise
            raise RuntimeError(BACKWARD_TWICE) from None
        finally:
            self._own = False

    def check_no_stale_grads(self) -> None:
        """Gradients present before a step's first backward were not made by this step."""
        if self.accumulated:
            return
        grads = [p.grad for p in self.driver.params if p.grad is not None]
        if grads and bool(torch.stack([g.any() for g in grads]).any()):  # one read, not one each
            raise RuntimeError(BACKWARD_TWICE)

    def _stamp(self) -> torch.Tensor:
        size, mark = self.batch if self.batch is not None else (None, None)
        comm = self.group.comm
        return BatchStamp(comm.world_size).pack(comm.rank, self.state.steps, size, mark)

    def _complete(self, optimizer: torch.optim.Optimizer | None, stamp: torch.Tensor) -> StepResult:
        """The step after its backward: the plan reduces (and applies), the step is counted."""
        if self.state.sharding is not None:  # a new step: its own gradients decide
            self.state.sharding.skipping = False
        result = self.runner.complete(optimizer, stamp=stamp)
        self.last.result = result
        if not self.joining:
            when_known(result, functools.partial(_some_samples, step=self.state.steps - 1))
        return result

    def _done(self) -> None:
        self.shard_samples, self.batch, self.accumulated = None, None, False
        self.since_step, self.empty = 0, None
        if self.micro is not None:
            self.micro.reset()

    def run(
        self,
        loss: torch.Tensor | None,
        samples: int | None,
        optimizer: torch.optim.Optimizer | None,
        scaler: Any = None,
    ) -> StepResult:
        """The step over the group: a result, or (elastic) a redo after a lost peer."""
        if self.driver.sync is None:
            raise RuntimeError("call ctx.replicate(model) before ctx.backward() or ctx.step()")
        weight = self.weight(samples)
        device = self.driver.device.type
        if (
            loss is not None
            and scaler is None
            and (what := float16_without_scaler(self.driver.params, device))
        ):
            raise ValueError(FLOAT16.format(what=what, fix=FIX_LOOP))
        self.check_no_stale_grads()
        stamp = self._stamp()
        calling(
            f"{'ctx.step' if optimizer is not None else 'ctx.backward'} (step {self.state.steps})"
        )

        def one() -> StepResult:  # attempted, and redone in an elastic job
            self.runner.arm()
            self.backward(loss, weight, scaler)
            return self._complete(optimizer, stamp)

        try:
            result = self.runner.step(one, self.last)
        finally:
            self._done()
        self.redo = result.redo
        return result

    def join(self) -> int:
        """Take empty steps beside the other ranks' until every rank has run out of batches
        (a step with no samples on any rank), as DDP's ``join()`` shadows the steps of the ranks
        that still train; every rank calls it once its batches are done. Returns the steps this
        rank sat out."""
        sat_out, self.joining = 0, True
        try:
            while True:
                self.driver.zero_grad()  # this rank's own steps are done
                self._done()
                result = self.run(None, 0, None)
                self.driver.zero_grad()  # the others' gradient, not this rank's to apply
                if result.samples == 0:
                    return sat_out
                self._refuse_sharded_join(result)
                sat_out += 1
        finally:
            self.joining = False

    def stepped_alone(self) -> None:
        """The script's own optimizer has stepped this tower alone (DiLoCo's inner step under
        ``towers.ddp``): the plan counts the step, weighted by the samples of the forwards since
        the last one, and the exchange it owes follows."""
        self.driver.add(0.0, self.since_step)
        try:
            self._complete(_Stepped(), self._stamp())  # type: ignore[arg-type]
        finally:
            self._done()
        self.runner.exchange(final=False)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward calls inside stay on this tower (gradient accumulation, as DDP's)."""
        before, self.local = self.local, True
        try:
            yield
        finally:
            self.local = before

    # -- a script's own loss.backward() ----------------------------------------------------

    def on_unarmed(self) -> bool:
        """A gradient arrived in a backward nobody armed: a script's ``loss.backward()``."""
        if self._own or self.alone or self.kept_local():
            return False
        if self.group.elastic or not self.state.plan.reduces:
            raise RuntimeError(PLAIN_BACKWARD_ELASTIC)
        if self.empty is not None:
            batch, world = self.empty
            raise RuntimeError(PLAIN_BACKWARD_EMPTY_SHARD.format(batch=batch, world=world))
        if self.since_step == 0:
            raise RuntimeError(PLAIN_BACKWARD_NO_SHARDS)
        micro = self.micro
        scale = micro.scale() if micro is not None and micro.active else None
        self.runner.arm_plain(self.since_step, self._finish_plain, scale=scale)
        return True

    def _finish_plain(self) -> None:
        """The end of a script's ``loss.backward()``: the step over all towers, as
        ``ctx.backward`` takes it, so that ``.grad`` holds the global batch's gradient."""
        calling(f"loss.backward() (step {self.state.steps})")
        try:
            result = self._complete(None, self._stamp())
        finally:
            self._done()
        if known(result) and result.skipped:  # NaN for a scaler
            poison_grads(self.driver.params)
            if self.state.sharding is not None:  # and the script's optimizer.step() changes
                self.state.sharding.skipping = True  # nothing
            else:
                self.driver.hold(result)
        when_known(result, functools.partial(self._plain_done, step=self.state.steps - 1))
        self.runner.exchange(final=False)

    def _plain_done(self, result: StepResult, step: int) -> None:
        """A plain ``loss.backward()``'s step, once its numbers are read: a sharded join is
        refused, and the first skipped step is said."""
        if result.samples > 0:
            self._refuse_sharded_join(result)
        if result.skipped and not self.warned_skip and self.group.comm.rank == 0:
            self.warned_skip = True
            towers_of = ", ".join(map(str, result.culprits)) or "the sum"
            warnings.warn(
                PLAIN_BACKWARD_SKIPPED.format(step=step, towers=towers_of),
                RuntimeWarning,
                stacklevel=2,
            )

    def _refuse_sharded_join(self, result: StepResult) -> None:
        """A step some towers sat out (a join) while the optimizer is sharded: every tower
        raises at this same step, before any steps its part (each would wait for the others)."""
        idle = [t for t, n in enumerate(result.tower_samples) if n == 0]
        if self.state.sharding is not None and idle:
            raise RuntimeError(SHARDED_JOIN.format(towers=", ".join(map(str, idle))))


def _some_samples(result: StepResult, step: int) -> None:
    """A step the own loop asked for had samples on some tower."""
    if result.samples == 0:
        raise ValueError(NO_SAMPLES.format(step=step))


class _Stepped:
    """An optimizer that has already stepped: the plan's inner step must not step it again."""

    def step(self) -> None:
        pass
