"""A synchronous step decided on the device, and read by the host only when asked.

On a GPU the host queues kernels ahead of the device. Reading a step's numbers (its loss, its
sample counts, whether it is finite) makes the host wait until the device has run everything
queued so far, so the next step's kernels start late. Here the step is decided where its sums
are: :func:`decide` checks the summed gradients, the towers' fault flags and their batch stamps
in the device's stream, divides the sums by the total sample count there, and starts copying the
summed numbers to the host without waiting. The decision is a 0-dim bool tensor
(:attr:`PendingResult.ok`) that the optimizer's step reads on the device
(:mod:`towers.engines.sync.guard`); the numbers become a :class:`~towers.core.step.StepResult`
the first time any of its fields is read (:class:`PendingResult`), which waits only for that
copy, long done by the next step.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import Any

import torch

from .agree import BatchStamp
from .step import StepMeta, StepResult, divided_in_stream, step_result

__all__ = ["PendingResult", "decide", "known", "when_known"]

# read lazily; ``redo`` is known: a step decided on the device is never redone
_FIELDS = frozenset(f.name for f in dataclasses.fields(StepResult)) - {"redo"}


class PendingResult(StepResult):
    """A :class:`StepResult` whose numbers are still on their way to the host.

    ``ok``: whether the step is applied, a 0-dim bool tensor on the device. Reading any field
    (``loss``, ``skipped``, ``culprits``, ...) waits for the step's numbers, decides it as
    :func:`~towers.core.step.step_result` does, and runs the checks added with
    :meth:`then` (which may raise: the ranks' batches disagreed, say); a failed check raises
    again on every later read.
    """

    def __init__(self, ok: torch.Tensor, host: torch.Tensor, read: Callable[[torch.Tensor], Any]):
        self._pending: tuple[Any, ...] | None = (ok, host, read, _marker(ok.device))
        self._ok = ok
        self._checks: list[Callable[[StepResult], None]] = []
        self._failure: Exception | None = None
        super().__init__(math.nan, [], [])  # placeholders: a field read resolves first

    @property
    def ok(self) -> torch.Tensor:
        return object.__getattribute__(self, "_ok")

    def resolved(self) -> bool:
        """Whether the numbers were read already."""
        return object.__getattribute__(self, "_pending") is None

    def read(self) -> None:
        """:meth:`resolve`, unless that was done (or failed) before: the numbers of a step
        that has landed, whose failure, if any, was raised once already."""
        if not self.resolved() and object.__getattribute__(self, "_failure") is None:
            self.resolve()

    def then(self, check: Callable[[StepResult], None]) -> None:
        """Call ``check(self)`` once the numbers are read (now, if they are)."""
        if self.resolved():
            check(self)
        else:
            object.__getattribute__(self, "_checks").append(check)

    def resolve(self) -> None:
        """Read the numbers now (waiting for them), decide, and run the checks."""
        failure = object.__getattribute__(self, "_failure")
        if failure is not None:
            raise failure
        pending = object.__getattribute__(self, "_pending")
        if pending is None:
            return
        _, host, read, marker = pending
        if marker is not None:
            marker.synchronize()
        try:
            decided = read(host)
        except Exception as exc:
            object.__setattr__(self, "_failure", exc)
            raise
        for name in _FIELDS:
            object.__setattr__(self, name, getattr(decided, name))
        object.__setattr__(self, "_pending", None)
        checks = object.__getattribute__(self, "_checks")
        object.__setattr__(self, "_checks", [])
        failures = []
        for check in checks:  # every one runs; the first failure is raised
            try:
                check(self)
            except Exception as exc:
                failures.append(exc)
        if failures:
            raise failures[0]

    def __getattribute__(self, name: str) -> Any:
        if name in _FIELDS and object.__getattribute__(self, "_pending") is not None:
            object.__getattribute__(self, "resolve")()
        return object.__getattribute__(self, name)

    def __repr__(self) -> str:
        return StepResult.__repr__(self) if self.resolved() else "PendingResult(not read yet)"


def known(result: StepResult) -> bool:
    """Whether ``result``'s numbers can be read without waiting for a device."""
    return not isinstance(result, PendingResult) or result.resolved()


def when_known(result: StepResult, check: Callable[[StepResult], None]) -> None:
    """``check(result)``: now where the numbers are known, else once they are read."""
    if isinstance(result, PendingResult):
        result.then(check)
    else:
        check(result)


def _marker(device: torch.device) -> Any:
    """An event after the copy to the host, on a device whose work is queued."""
    if device.type != "cuda":
        return None
    event = torch.cuda.Event()
    event.record()
    return event


def decide(
    meta: StepMeta,
    tail: torch.Tensor,
    flats: Sequence[torch.Tensor],
    stamp: BatchStamp | None,
) -> PendingResult:
    """Decide a step from its summed ``tail`` (:class:`StepMeta`'s vector, then the batch
    stamp where ``stamp`` is given) and its summed gradients ``flats``, without the host
    waiting: each flat is divided by the total sample count in place, and the result's ``ok``
    says, on the device, whether the step is applied (every sum finite, no tower at fault, a
    sample somewhere, and the batch stamps agreeing). Its numbers are read when first asked;
    a disagreement of the stamps then raises ``ValueError``, as the eager check does."""
    w = meta.world
    finite, total = divided_in_stream(tail, w, flats)
    ok = finite & (tail[2 * w : 3 * w].sum() == 0) & (total > 0)
    if stamp is not None:
        ok = ok & stamp.agrees(tail[meta.length :])
    numbers = torch.cat([tail.double(), finite.double().reshape(1)])
    host = numbers.to("cpu", non_blocking=True)

    def read(host: torch.Tensor) -> StepResult:
        if stamp is not None:
            stamp.check(host[meta.length : -1])
        return step_result(meta.read(host[: meta.length]), bool(host[-1]))

    return PendingResult(ok, host, read)
