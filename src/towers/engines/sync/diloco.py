"""DiLoCo and Streaming DiLoCo: the step plan of ``mode="diloco:H"`` (docs/diloco.md).

DiLoCo (Douillard et al. 2023, arXiv 2311.08105): each tower takes H *inner* steps alone, with
the job's optimizer, on its shard of each global batch. Then the towers exchange
*pseudo-gradients*: the outer parameters (where the period started) minus each tower's
parameters now, weighted by the samples the tower trained on in the period. The weighted sum
travels through the one driver and its buckets, exactly as a synchronous step's gradients do,
so the step's metadata, the finite check, the skip and the gradient transforms all apply
(``compress="int8"`` compresses pseudo-gradients). The driver divides by the total sample count;
the mean lands in the outer parameters' ``.grad`` and the *outer* optimizer (default Nesterov
SGD, lr 0.6, momentum 0.5: :func:`default_outer_optimizer`) steps them. Every tower then
starts the next period from the outer parameters. A skipped outer step (a value that was not
finite) leaves the outer parameters as they were, and the towers start again from them.

With ``overlap`` (Streaming DiLoCo, Douillard et al. 2025, arXiv 2501.18512) the exchange
travels while the next inner steps run: it is launched at a boundary and applied at the next
one, one stage late, where each tower mixes its locally continued parameters with the new outer
ones: ``theta <- (1 - alpha) theta_local + alpha theta_outer``, alpha = 0.5. With ``P``
fragments the parameters are cut into P contiguous groups of about equal size, and fragment
``p`` is exchanged every H steps at offset ``p H / P`` (a boundary every ``H / P`` steps), so
that each exchange moves ``1 / P`` of the model. The last exchange of a run is blocking, over
every fragment, so that a run ends on the outer parameters.

Besides the pseudo-gradients, each exchange carries one small float64 message: every tower's
loss sum, sample count and non-finite flag for each inner step since the last exchange (so that
``TrainResult.losses`` holds one mean over all towers per global batch), its weight, and its
floating-point buffers (BatchNorm's running statistics) times that weight, averaged into the
outer module. An inner step with a non-finite loss or gradient is skipped by its tower alone and
reported with it; its samples do not count towards the tower's weight. A tower whose every inner
step since the last exchange was skipped marks the outer step as skipped.
"""

from __future__ import annotations

import copy
import itertools
import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from torch import nn

from ...comm.base import Work
from ...core.step import StepResult, local_step
from ..job import OptimizerFactory
from ..replica import Replica, cpu_state
from ..shard import ShardedState
from .driver import SyncDriver
from .message import Counts, InnerStep, pack, read, unflatten
from .outer_parts import OuterParts
from .plan import Landed

__all__ = ["ALPHA", "Periods", "default_outer_optimizer", "fragments_of"]

ALPHA = 0.5  # Streaming DiLoCo's mixing weight of the outer parameters


def default_outer_optimizer(params: Iterable[nn.Parameter]) -> torch.optim.Optimizer:
    """Nesterov SGD with lr 0.6 and momentum 0.5, the default outer optimizer.

    Chosen by measurement (docs/diloco.md, "Choosing the outer step"): the paper's lr 0.7 with
    momentum 0.9, tuned for H in the hundreds on language models, overshoots at small H (at
    H = 8 and 16 the zoo problems ended at 1.3 to 4.1 times sync's held-out loss at equal
    samples); lr 0.6 with momentum 0.5 ended at 0.98 to 1.14 times.
    """
    return torch.optim.SGD(params, lr=0.6, momentum=0.5, nesterov=True)


def fragments_of(sizes: Sequence[int], parts: int) -> list[range]:
    """``parts`` contiguous, non-empty ranges of parameter indices of about equal total size.

    Example::

        >>> fragments_of([10, 10, 10, 10], 2)
        [range(0, 2), range(2, 4)]
    """
    n = len(sizes)
    if not 1 <= parts <= n:
        raise ValueError(
            f"cannot cut a model of {n} parameter tensors into {parts} fragments; use at most "
            f"{n} fragments"
        )
    prefix = [0]
    for s in sizes:
        prefix.append(prefix[-1] + s)
    bounds = [0]
    for f in range(1, parts):
        j = bounds[-1] + 1
        while j < n - (parts - f) and prefix[j] < prefix[n] * f / parts:
            j += 1
        bounds.append(j)
    bounds.append(n)
    return [range(a, z) for a, z in itertools.pairwise(bounds)]


def _trainable(module: nn.Module) -> list[nn.Parameter]:
    return [p for p in module.parameters() if p.requires_grad]


def _float_buffers(module: nn.Module) -> list[torch.Tensor]:
    return [b for b in module.buffers() if b.is_floating_point()]


@dataclass
class _Flight:
    """One exchange: launched, then landed (``result`` set), then applied."""

    fragment: int
    entries: int  # the window entries it carries
    extra: torch.Tensor  # the small message (see the module doc)
    work: Work | None  # its sum in flight; None once landed
    result: StepResult | None = None  # the outer step's
    deltas: list[torch.Tensor] = field(default_factory=list)  # the mean pseudo-gradient
    steps: list[StepResult] = field(default_factory=list)  # each carried inner step's
    buffers: torch.Tensor | None = None  # the averaged floating-point buffers


class Periods:
    """The DiLoCo step plan of one rank; see the module doc."""

    reduces = False  # inner steps are each tower's own
    keeps_replicas = True  # every rank's own model and inner optimizer, in its checkpoint

    def __init__(
        self,
        every: int,
        outer_optimizer: OptimizerFactory | None = None,
        *,
        overlap: bool = False,
        fragments: int = 1,
        alpha: float = ALPHA,
    ):
        assert every % fragments == 0 and (overlap or fragments == 1), (every, fragments)
        self.every, self.overlap, self.parts, self.alpha = every, overlap, fragments, alpha
        self.stage = every // fragments  # inner steps between boundaries
        self.factory = outer_optimizer or default_outer_optimizer
        self.model: nn.Module | None = None  # this tower's, as the loop trains it
        self.outer: nn.Module | None = None
        self.outer_opt: torch.optim.Optimizer | None = None
        self.groups: list[range] = []  # trainable-parameter indices of each fragment
        self.window: list[InnerStep] = []  # inner steps not yet carried by an exchange
        self.counts = [Counts() for _ in range(fragments)]
        self.boundary = 0  # global batches trained at the last exchange
        self.flight: _Flight | None = None  # overlap: the exchange travelling
        self.fresh = True  # the local parameters have not been set from the outer ones yet
        self._landed: list[Landed] = []
        self.sharding: ShardedState | None = None  # shard_optimizer=True: the outer state's
        self.sharded: OuterParts | None = None  # this tower's part of the outer state

    # -- the model -------------------------------------------------------------------------

    def shard(self, sharding: ShardedState) -> bool:
        self.sharding = sharding
        return True

    def attach(self, model: nn.Module) -> Sequence[int]:
        self.model = model
        if self.sharding is not None:  # no whole outer copy: this tower's part of it
            self.sharded = OuterParts(self.sharding, model, self.factory)
            self.outer_opt = self.sharded.optimizer
        else:
            self.outer = copy.deepcopy(model)
            self.outer_opt = self.factory(_trainable(self.outer))
        self.groups = fragments_of([p.numel() for p in _trainable(model)], self.parts)
        return [g.start for g in self.groups[1:]]

    def shared(self, model: nn.Module) -> nn.Module:
        if self.sharded is not None:  # broadcast before the towers start from it
            return model if self.fresh else self.sharded.whole()
        return self._outer()

    def regrouped(self, model: nn.Module) -> None:
        if self.fresh:
            self._start_from_outer(model)

    def trained(self, model: nn.Module) -> nn.Module:
        if self.sharded is not None:  # right after an exchange: the model's parameters
            return self.sharded.whole(gather=not self._at_outer())
        return self._outer()

    def _at_outer(self) -> bool:
        return self.flight is None and not any(c.steps for c in self.counts)

    def _outer(self) -> nn.Module:
        assert self.outer is not None, "attach() the model first"
        return self.outer

    def _model(self) -> nn.Module:
        assert self.model is not None, "attach() the model first"
        return self.model

    def _start_from_outer(self, model: nn.Module) -> None:
        """The local parameters and buffers become the outer ones; nothing is pending."""
        if self.sharded is None:
            with torch.no_grad():
                for mine, outer in zip(
                    model.state_dict().values(), self._outer().state_dict().values()
                ):
                    mine.copy_(outer)
        elif self.fresh:  # sharded: the model holds what every tower starts from
            self.sharded.take()
        else:  # sharded, after an exchange: the parameters are the outer ones already
            self.sharded.restart()
        self.window, self.counts = [], [Counts() for _ in range(self.parts)]
        self.flight, self.fresh = None, False

    # -- inner steps -----------------------------------------------------------------------

    def step(
        self,
        driver: SyncDriver,
        optimizer: torch.optim.Optimizer | None,
        index: int,
        *,
        stamp: torch.Tensor | None = None,
        at: Callable[[], float] | None = None,
    ) -> StepResult:
        """Inner step on global batch ``index``: this tower's optimizer steps on its shard's
        mean gradient, unless a loss or gradient was not finite. Returns this tower's result."""
        assert optimizer is not None, "DiLoCo's inner steps need the optimizer"
        loss_sum, samples, seconds = driver.take()  # never armed: nothing was reduced
        where = driver.rank, driver.world_size
        result = local_step(driver.params, loss_sum, samples, *where, seconds)
        if samples > 0 and not result.skipped:
            optimizer.step()
        driver.zero_grad()
        bad = result.skipped
        entry = InnerStep(
            index, loss_sum if samples else 0.0, samples, bad, at() if at else 0.0, seconds
        )
        self.window.append(entry)
        for c in self.counts:
            c.add(entry)
        return result

    def owes(self, done: int, steps: int | None) -> bool:
        boundary = done > 0 and done != self.boundary and done % self.stage == 0
        if done == steps:  # the end: also anything not yet in the outer parameters
            return boundary or self.flight is not None or any(c.steps for c in self.counts)
        return boundary

    # -- exchanges -------------------------------------------------------------------------

    def exchange(
        self, driver: SyncDriver, done: int, *, final: bool, stamp: torch.Tensor | None = None
    ) -> StepResult | None:
        """The exchange due after ``done`` global batches: this boundary's, or at the end
        (``final``) the last one, blocking, of every fragment trained since its own. Returns
        the last outer step applied (``None`` if none was: an overlapped exchange only left)."""
        applied: list[_Flight] = []
        if self.flight is not None:  # overlap: the one launched at the last boundary
            if self.flight.work is not None:
                self._land(driver, self.flight)
            applied.append(self._apply(driver, self.flight, mix=True))
            self.flight = None
        if done != self.boundary and done % self.stage == 0:
            fragment = (done // self.stage) % self.parts
            if self.overlap:
                self.flight = self._launch(driver, fragment, stamp)
            else:
                applied.append(self._exchange_now(driver, fragment, stamp))
            self.boundary = done
        elif final:
            for f in range(self.parts):
                if self.counts[f].steps:  # the same on every tower
                    applied.append(self._exchange_now(driver, f, stamp))
            self._start_from_outer(self._model())  # every fragment ends on the outer values
            self.boundary = done
        self._emit(applied)
        return applied[-1].result if applied else None

    def _exchange_now(self, driver: SyncDriver, f: int, stamp: torch.Tensor | None) -> _Flight:
        """A blocking exchange of fragment ``f``: launched, landed, applied."""
        flight = self._launch(driver, f, stamp)
        self._land(driver, flight)
        return self._apply(driver, flight, mix=False)

    def _launch(self, driver: SyncDriver, f: int, stamp: torch.Tensor | None) -> _Flight:
        """Start fragment ``f``'s exchange: the small message, then the pseudo-gradients."""
        c = self.counts[f]
        bad = c.applied == 0 and c.computed > 0  # every step skipped: nothing to contribute
        weight = c.computed if bad else c.applied
        buffers = _float_buffers(self._model())
        message = pack(self.window, driver.rank, driver.world_size, weight, buffers)
        extra, work = driver.start_sum(message)
        if self.sharded is not None:  # sharded: the parameters themselves (see OuterParts)
            deltas = self.sharded.values(self.groups[f], weight)
        else:
            local, outer = _trainable(self._model()), _trainable(self._outer())
            deltas = {
                i: (outer[i].detach() - local[i].detach()).mul_(weight) for i in self.groups[f]
            }
        driver.add(math.nan if bad else c.loss, weight)
        driver.launch(stamp, values=deltas)
        return _Flight(f, len(self.window), extra, work)

    def _land(self, driver: SyncDriver, flight: _Flight) -> None:
        """Wait for ``flight``; keep the mean pseudo-gradient and what the message says."""
        result, means = driver.land_values()
        assert flight.work is not None
        flight.work.wait()
        flight.deltas = means or []
        flight.result, flight.work = result, None
        w = driver.world_size
        flight.steps, flight.buffers = read(flight.extra, flight.entries, w)

    def _apply(self, driver: SyncDriver, flight: _Flight, mix: bool) -> _Flight:
        """The outer step of a landed ``flight``, then the towers' parameters follow it."""
        assert flight.result is not None and self.outer_opt is not None
        if self.sharded is not None:  # sharded: never mixed (no overlap)
            self.sharded.apply(flight.deltas, flight.result.skipped, flight.buffers)
            return self._applied(flight)
        model, outer = self._model(), self._outer()
        local, outer_params = _trainable(model), _trainable(outer)
        group = self.groups[flight.fragment]
        skipped = flight.result.skipped
        with torch.no_grad():
            if not skipped:
                for i, delta in zip(group, flight.deltas, strict=True):
                    outer_params[i].grad = delta.to(outer_params[i].device)
                self.outer_opt.step()
                for i in group:
                    outer_params[i].grad = None
                if flight.buffers is not None:
                    unflatten(flight.buffers, _float_buffers(outer))
            keep = 1.0 - self.alpha if mix and not skipped else 0.0
            pairs: list[tuple[torch.Tensor, torch.Tensor]] = [
                (local[i], outer_params[i]) for i in group
            ]
            pairs += zip(_float_buffers(model), _float_buffers(outer))
            for mine, theirs in pairs:
                if keep:
                    mine.mul_(keep).add_(theirs, alpha=1.0 - keep)
                else:  # a copy, also over a tower's values that are not finite
                    mine.copy_(theirs)
        return self._applied(flight)

    def _applied(self, flight: _Flight) -> _Flight:
        """The window and counts after ``flight``'s outer step."""
        carried, self.window = self.window[: flight.entries], self.window[flight.entries :]
        # what the fragment trained on since this exchange left: the steps still in the window
        self.counts[flight.fragment] = Counts()
        for entry in self.window:
            self.counts[flight.fragment].add(entry)
        self._landed += [(e.index, r, e.at) for e, r in zip(carried, flight.steps, strict=True)]
        return flight

    def _emit(self, applied: list[_Flight]) -> None:
        """A skipped outer step is reported at the last global batch its exchange carried."""
        culprits = {t for f in applied if f.result and f.result.skipped for t in f.result.culprits}
        if any(f.result and f.result.skipped for f in applied) and self._landed:
            index, last, at = self._landed[-1]
            merged = sorted(set(last.culprits) | culprits)
            skipped = StepResult(last.loss, last.tower_losses, last.tower_samples, True, merged)
            self._landed[-1] = (index, skipped, at)

    def results(self, wait: bool = False) -> list[Landed]:
        landed, self._landed = self._landed, []
        return landed

    # -- elastic agreement and checkpoints -------------------------------------------------

    def progress(self, done: int) -> int:
        return self.boundary

    def snapshot(self, replica: Replica) -> dict[str, Any]:
        assert self.outer_opt is not None and self.sharded is None  # not sharded when elastic
        return {
            "boundary": self.boundary,
            "outer": cpu_state(self._outer()),
            "outer_optimizer": self.outer_opt.state_dict(),
        }

    def adopt(self, state: dict[str, Any], replica: Replica, newcomer: bool) -> None:
        """Take a peer's outer state and start from it (a survivor keeps its inner optimizer;
        a newcomer's starts afresh)."""
        assert self.outer_opt is not None
        state = copy.deepcopy(state)  # the optimizer keeps the tensors it loads
        self._outer().load_state_dict(state["outer"])
        self.outer_opt.load_state_dict(state["outer_optimizer"])
        self.boundary = state["boundary"]
        self._start_from_outer(replica.model)

    def checkpoint(self, driver: SyncDriver, replica: Replica) -> dict[str, Any]:
        """The outer optimizer, the exchange in flight (waited for) and every rank's own state
        (the outer parameters are the checkpoint's ``model``: what the members share)."""
        assert self.outer_opt is not None
        flight = self.flight
        if flight is not None and flight.work is not None:
            self._land(driver, flight)
        mine = {
            "local": replica.state_dict(),
            "window": [asdict(e) for e in self.window],
            "counts": [asdict(c) for c in self.counts],
        }
        ranks = driver.all_gather_object(mine)
        landed = None
        if flight is not None:
            assert flight.result is not None
            landed = {
                "fragment": flight.fragment,
                "entries": flight.entries,
                "result": asdict(flight.result),
                "deltas": [d.detach().cpu().clone() for d in flight.deltas],
                "steps": [asdict(s) for s in flight.steps],
                "buffers": None if flight.buffers is None else flight.buffers.cpu(),
            }
        # sharded: the whole state, as unsharded, in rank 0's checkpoint
        outer = self.outer_opt if self.sharded is None else self.sharded
        return {
            "boundary": self.boundary,
            "outer_optimizer": outer.state_dict(),
            "flight": landed,
            "ranks": ranks,
        }

    def restore(self, state: dict[str, Any], driver: SyncDriver, replica: Replica) -> None:
        assert self.outer_opt is not None
        # a private copy: a checkpoint sent to local workers lies in memory they all share, and
        # an optimizer loads its state tensors as they are
        state = copy.deepcopy(state)
        saved = state["plan"]
        if self.sharded is not None:
            self.sharded.load(state["model"])
            self.sharded.load_state_dict(saved["outer_optimizer"])
        else:
            self._outer().load_state_dict(state["model"])
            self.outer_opt.load_state_dict(saved["outer_optimizer"])
        self.boundary = saved["boundary"]
        mine = saved["ranks"][driver.rank]
        replica.load_state_dict(mine["local"])
        self.window = [InnerStep(**e) for e in mine["window"]]
        self.counts = [Counts(**c) for c in mine["counts"]]
        self.fresh, self.flight = False, None
        landed = saved["flight"]
        if landed is not None:
            device = driver.device
            self.flight = _Flight(
                landed["fragment"],
                landed["entries"],
                torch.zeros(0, dtype=torch.float64),
                None,
                StepResult(**landed["result"]),
                [d.to(device) for d in landed["deltas"]],
                [StepResult(**s) for s in landed["steps"]],
                None if landed["buffers"] is None else landed["buffers"].to(device),
            )
