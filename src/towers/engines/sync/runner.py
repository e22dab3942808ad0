"""A rank's synchronous step: the one orchestration behind every way of training.

``towers.train``'s loop (:mod:`towers.engines.sync.loop`), the own loop's ``ctx.step`` and
``ctx.backward`` and a script's own ``loss.backward()`` (:mod:`towers.api.stepper`) all take
their steps through a :class:`StepRunner`:

1. :meth:`~StepRunner.shard_taken`: the step's first shard is in hand. The step's clock starts;
   its seconds, up to :meth:`~StepRunner.complete`, are what a balanced split follows.
2. :meth:`~StepRunner.arm`: before the step's last backward, where the mode reduces every step,
   so that its gradients travel as they arrive. A backward nobody armed (a script's own
   ``loss.backward()``) is armed from its first gradient (:meth:`~StepRunner.arm_plain`) and
   completed when it ends.
3. :meth:`~StepRunner.complete`: the mode's plan reduces and applies (DiLoCo: the tower steps
   alone), and the step is counted.
4. :meth:`~StepRunner.land`: the results over all towers that arrived steer the split (the loop
   also records them); :meth:`~StepRunner.exchange`: an exchange the plan owes (DiLoCo's outer
   step), between steps of the own loop, then the landing.

Each is done inside the group's attempt (:meth:`~StepRunner.attempt`): an elastic group redoes
it, from the state the members agreed on, after a lost peer.
"""

from __future__ import annotations

import collections
import functools
import math
import time
from collections.abc import Callable
from typing import Any, TypeVar

import torch

from ...comm.hang import calling
from ...core.agree import BatchStamp
from ...core.step import StepResult
from ...core.verdict import PendingResult
from .driver import SyncDriver
from .group import Group
from .plan import Landed
from .state import LastResult, RunState

__all__ = ["DeviceClock", "StepRunner"]

T = TypeVar("T")


class DeviceClock:
    """A tower's compute seconds on a GPU, timed by events in its stream, not on the host.

    :meth:`start` records an event when the step's shard is taken, :meth:`stop` one after its
    backward. The host does not wait for them: a step's time is known once its events have
    passed, usually a step later, so :meth:`stop` reports the seconds this step's samples take
    at the pace of the last step measured (0, which the balancer leaves out, until one is).
    ``event``: the event class (``torch.cuda.Event``).
    """

    def __init__(self, event: Callable[..., Any] | None = None):
        self.event = event if event is not None else torch.cuda.Event
        self.pending: collections.deque[tuple[Any, Any, int]] = collections.deque()
        self.per_sample: float | None = None  # seconds per sample, the last step measured
        self._start: Any = None

    def start(self) -> None:
        self._start = self.event(enable_timing=True)
        self._start.record()

    def stop(self, samples: int) -> float:
        """This step's ``samples`` are queued: their seconds, at the last measured pace."""
        end = self.event(enable_timing=True)
        end.record()
        self.pending.append((self._start, end, samples))
        while self.pending and self.pending[0][1].query():
            start, done, n = self.pending.popleft()
            if n > 0:
                self.per_sample = start.elapsed_time(done) / 1000.0 / n
        return 0.0 if self.per_sample is None else self.per_sample * samples


class StepRunner:
    """One rank's steps over ``group``, with the run's ``state``, through ``driver``."""

    def __init__(self, group: Group, state: RunState, driver: SyncDriver):
        self.group, self.state, self.driver = group, state, driver
        self.began: float | None = None  # when the step's first shard was taken
        # on a GPU the host only queues the work: CUDA events time it on the device
        self.clock = DeviceClock() if group.device.type == "cuda" else None

    def use(self, driver: SyncDriver) -> None:
        """Step through ``driver`` from now on (the own loop's, once its model is replicated)."""
        self.driver = driver

    def attempt(self, work: Callable[[], T]) -> T | None:
        """``work()`` inside the group: its result, or ``None`` where an elastic group lost a
        peer and regrouped (the work must be redone, its shard taken again)."""
        try:
            return self.group.attempt(self.driver, work)
        finally:
            self.began = None

    def step(self, work: Callable[[], StepResult], last: LastResult) -> StepResult:
        """A whole step of the own loop: ``work`` (arm, backward, :meth:`complete`) inside the
        group's attempt, then the exchange it owes and the landing of the results.

        Returns the step's result (the outer step's, where the step ended a DiLoCo period); in
        an elastic job that lost a peer, the result a peer had already completed (``last``,
        as the members agreed), or else a result with ``redo=True``: nothing was updated, and
        the caller trains the same global batch again.
        """
        before = self.state.steps
        result = self.attempt(work)
        if result is not None:
            outer = self.exchange(final=False)  # and the results steer the split
            return result if outer is None else outer
        self.driver.zero_grad()
        if self.state.steps > before and last.result is not None:  # a peer had completed it
            return last.result
        return StepResult(math.nan, [], [], skipped=True, redo=True)

    # -- one step --------------------------------------------------------------------------

    def shard_taken(self) -> None:
        """This tower has its shard of the step (the first one, if it accumulates several)."""
        if self.began is None:
            self.began = time.perf_counter()
            if self.clock is not None:
                self.clock.start()

    def waited(self, seconds: float) -> None:
        """This tower waited ``seconds`` for the others inside its step (an accumulated
        forward's sum of sizes): not its compute, so not a time the balanced split follows."""
        if self.began is not None:
            self.began += seconds

    def arm(self) -> None:
        """The next backward is the step's last: reduce its gradients as they arrive, where
        the mode reduces every step."""
        if self.state.plan.reduces:
            self.driver.arm()

    def arm_plain(self, samples: int, finish: Callable[[], None], scale: int | None = None) -> None:
        """A backward nobody armed has reached its first gradient (a script's own
        ``loss.backward()``): reduce it, each gradient times ``samples`` (its loss is a mean
        over them; ``scale``: times that instead, for gradients weighted already), and call
        ``finish`` when the backward ends, as DDP finishes its reduction there (autograd's
        end-of-backward callback)."""
        self.driver.arm(scale=samples if scale is None else scale)
        self.driver.add(0.0, samples)
        self.driver.loss_unseen()
        torch.autograd.Variable._execution_engine.queue_callback(finish)

    def complete(
        self,
        optimizer: torch.optim.Optimizer | None,
        *,
        stamp: torch.Tensor | None = None,
        at: Callable[[], float] | None = None,
    ) -> StepResult:
        """The step after its backward: the mode's plan reduces and, with an ``optimizer``,
        applies (see :meth:`~towers.engines.sync.plan.StepPlan.step`); the step is counted."""
        began, self.began = self.began, None  # the next step's clock starts at its shard
        if began is not None:
            seconds = time.perf_counter() - began
            if self.clock is not None:
                seconds = self.clock.stop(self.driver.samples)
            self.driver.add(0.0, 0, seconds)
        state = self.state
        result = state.plan.step(self.driver, optimizer, state.steps, stamp=stamp, at=at)
        state.steps += 1
        return result

    def land(self, wait: bool = False) -> list[Landed]:
        """The steps whose results over all towers arrived, in order (``wait``: every step
        taken, waiting for those still on their way); their shard sizes and times steer the
        next split."""
        landed = self.state.plan.results(wait)
        for _, result, _ in landed:
            if isinstance(result, PendingResult):
                result.read()  # arrived: read without a wait, and its checks run
            self.state.observe(result)
        return landed

    # -- exchanges -------------------------------------------------------------------------

    def exchange_once(self, *, final: bool, stamp: torch.Tensor | None = None) -> StepResult | None:
        """The exchange the plan owes after the steps done (``final``: training ends after it);
        the outer step it applied, if any."""
        return self.state.plan.exchange(self.driver, self.state.steps, final=final, stamp=stamp)

    def exchange(self, final: bool) -> StepResult | None:
        """Between steps (the own loop): the exchange the plan owes, redone until done, then
        the results that arrived steer the split (:meth:`land`); the last outer step's result,
        if any."""
        outer, plan, steps = None, self.state.plan, self.state.steps
        while plan.owes(steps, steps if final else None):
            calling(f"the outer step (step {steps})")
            comm = self.group.comm  # a new one after a regroup
            stamp = BatchStamp(comm.world_size).pack(comm.rank, steps, None, None)
            run = functools.partial(plan.exchange, self.driver, steps, final=final, stamp=stamp)
            outer = self.attempt(run) or outer
        self.land()
        return outer
