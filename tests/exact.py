"""How close a distributed run must come to one process: a bound derived from float64.

towers sums a global batch's gradient in another order than one process does (each tower's
part, then over the towers; after a regroup, over other members), so its float32 rounding
differs from a single process's, though it is no larger in kind. A fixed ``rtol`` guesses how
large that is; here it is measured instead. Every check runs the plain single-process loop
twice over the same batches: in float32, as a user's own script computes, and in float64,
the exact result to float32's eye. A value of towers may be as far from the float64 loop as
``FACTOR`` times the float32 loop is at most over all the values compared (the whole model's
parameters and buffers, or every step's loss: the largest absolute difference), and never
less than ``FACTOR`` roundings of float32 at their scale (a short loop can land on float64's
values exactly). A failed check prints both distances, the bound and where it came from.

``FACTOR`` is 4: two float32 loops that sum in different orders differ from float64 by about
as much, and over the suite the largest ratio of towers' distance to the float32 loop's was
measured at 2.5 (docs/testing.md); 4 leaves room, and a wrong result (a missed tower, a
weight off by one sample) is orders of magnitude beyond it.

    reference = Reference.of(make_net(), data, batch_size=8, steps=6, optimizer=sgd)
    reference.check(result.model)         # parameters and float buffers
    reference.check_losses(result.losses)
"""

from __future__ import annotations

import copy
import json
import math
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

__all__ = ["FACTOR", "Reference", "as_float64", "bound", "states"]

FACTOR = 4.0
EPS32 = torch.finfo(torch.float32).eps


def as_float64(data: Any) -> Any:
    """``data`` (a tensor, or a tuple/list/dict of them) with every float tensor in float64."""
    if isinstance(data, torch.Tensor):
        return data.double() if data.is_floating_point() else data
    if isinstance(data, tuple | list):
        return type(data)(as_float64(d) for d in data)
    if isinstance(data, Mapping):
        return {k: as_float64(v) for k, v in data.items()}
    return data


def states(model: nn.Module | Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A module's parameters and buffers by name (a state dict as it is), detached, on CPU."""
    items = model.state_dict() if isinstance(model, nn.Module) else model
    return {k: v.detach().cpu() for k, v in items.items()}


def bound(
    single: torch.Tensor | Sequence[torch.Tensor],
    exact: torch.Tensor | Sequence[torch.Tensor],
    factor: float = FACTOR,
) -> tuple[float, float]:
    """(the float32 loop's largest distance from float64 over all the values given, the bound
    a distributed run gets for each of them)."""
    pairs = [(single, exact)] if isinstance(exact, torch.Tensor) else list(zip(single, exact))
    pairs = [(s.double(), e.double()) for s, e in pairs if e.numel()]
    off = max((float((s - e).abs().max()) for s, e in pairs), default=0.0)
    scale = max((float(e.abs().max()) for _, e in pairs), default=0.0)
    return off, factor * max(off, EPS32 * scale)


def _record(what: str, name: str, got: float, off: float, allowed: float, factor: float) -> None:
    """With ``TOWERS_TOLERANCE_LOG=FILE``, append how much of its bound a check used (for
    measuring ``FACTOR`` over the suite: ``python -m tests.repeat --tolerances``)."""
    log = os.environ.get("TOWERS_TOLERANCE_LOG")
    if log:
        test = os.environ.get("PYTEST_CURRENT_TEST", "?").split(" ")[0]
        used = got / (allowed / factor) if allowed > 0 else (0.0 if got == 0 else math.inf)
        with open(log, "a") as f:
            f.write(json.dumps({"test": test, "what": what, "name": name, "ratio": used}) + "\n")


def _describe(what: str, name: str, got: float, off: float, allowed: float, factor: float) -> str:
    return (
        f"{what}: {name} is {got:.3g} from a float64 loop (largest absolute difference), above "
        f"the bound {allowed:.3g} = {factor:g} x max(the {off:.3g} a float32 single process is "
        f"from that loop at most, over all the values compared; one float32 rounding at their "
        f"scale)"
    )


@dataclass
class Reference:
    """One plain loop's results in float32 (``single``) and float64 (``exact``)."""

    single: dict[str, torch.Tensor]
    exact: dict[str, torch.Tensor]
    losses: list[float] = field(default_factory=list)  # the float32 loop's
    exact_losses: list[float] = field(default_factory=list)
    tower_losses: list[list[float]] = field(default_factory=list)  # the float32 loop's
    exact_tower_losses: list[list[float]] = field(default_factory=list)
    skipped: list[int] = field(default_factory=list)
    factor: float = FACTOR

    @classmethod
    def of(cls, model: nn.Module, data: Any, **loop: Any) -> Reference:
        """``helpers.reference_loop`` from ``model``'s parameters (left as they are), in
        float32 and in float64, with the same keywords."""
        from helpers import reference_loop

        single, exact = copy.deepcopy(model), copy.deepcopy(model).double()
        losses, towers, skipped = reference_loop(single, data, **loop)
        exact_losses, exact_towers, _ = reference_loop(exact, as_float64(data), **loop)
        return cls(
            states(single), states(exact), losses, exact_losses, towers, exact_towers, skipped
        )

    @classmethod
    def run(
        cls, loop: Callable[[torch.dtype], tuple[nn.Module, Sequence[float]]], **kw: Any
    ) -> Reference:
        """From a loop of the test's own: ``loop(dtype) -> (trained model, losses)``, run in
        float32 and in float64 over the same batches."""
        single, losses = loop(torch.float32)
        exact, exact_losses = loop(torch.float64)
        return cls(states(single), states(exact), list(losses), list(exact_losses), **kw)

    @property
    def model(self) -> dict[str, torch.Tensor]:
        """The float32 loop's state, for a test that reads a value."""
        return self.single

    def check(self, got: nn.Module | Mapping[str, Any], what: str = "towers") -> None:
        """``got``'s parameters and buffers (a module, a state dict, or a dict with ``model``
        and ``losses``, as tests/scripts save) are as close to float64 as the bound allows."""
        if isinstance(got, Mapping) and "model" in got and "losses" in got:
            self.check(got["model"], what)
            self.check_losses(got["losses"], what)
            return
        mine = states(got)  # type: ignore[arg-type]
        assert mine.keys() == self.exact.keys(), f"{what}: {sorted(mine)} != {sorted(self.exact)}"
        floats = [n for n, t in self.exact.items() if t.is_floating_point()]
        singles, exacts = [self.single[n] for n in floats], [self.exact[n] for n in floats]
        off, allowed = bound(singles, exacts, self.factor)
        for name, exact in self.exact.items():
            value = mine[name]
            assert value.shape == exact.shape, f"{what}: {name} {value.shape} != {exact.shape}"
            if not exact.is_floating_point():
                assert torch.equal(value, exact), f"{what}: {name} {value} != {exact}"
                continue
            got_off = float((value.double() - exact).abs().max()) if value.numel() else 0.0
            _record(what, name, got_off, off, allowed, self.factor)
            assert got_off <= allowed, _describe(what, name, got_off, off, allowed, self.factor)

    def check_losses(self, got: Sequence[float], what: str = "towers", start: int = 0) -> None:
        """Per-step losses: as close to the float64 loop's as the bound allows (the bound over
        all steps; ``nan`` where the loop's loss is ``nan``). ``start``: ``got`` begins at
        that step (a worker that joined later)."""
        self._check_values(got, self.losses[start:], self.exact_losses[start:], what, start)

    def check_tower_losses(self, got: Sequence[Sequence[float]], what: str = "towers") -> None:
        """Per-step, per-tower losses (the reference run with ``towers=``), as
        :meth:`check_losses` (the bound over all steps and towers)."""
        assert [len(t) for t in got] == [len(t) for t in self.exact_tower_losses], (
            f"{what}: towers per step {[len(t) for t in got]}, expected "
            f"{[len(t) for t in self.exact_tower_losses]}"
        )
        flat = [v for step in got for v in step]
        single = [v for step in self.tower_losses for v in step]
        exact = [v for step in self.exact_tower_losses for v in step]
        self._check_values(flat, single, exact, f"{what} (tower losses, flattened)", 0)

    def _check_values(
        self,
        got: Sequence[float],
        single_values: Sequence[float],
        exact_values: Sequence[float],
        what: str,
        start: int,
    ) -> None:
        expected = len(exact_values)
        assert len(got) == expected, f"{what}: {len(got)} values, expected {expected}"
        exact = torch.tensor(list(exact_values), dtype=torch.float64)
        mine = torch.tensor(list(got), dtype=torch.float64)
        single = torch.tensor(list(single_values), dtype=torch.float64)
        finite = exact.isfinite()
        assert torch.equal(mine.isfinite(), finite), f"{what}: {list(got)} vs {list(single_values)}"
        off, allowed = bound([single[finite]], [exact[finite]], self.factor)
        worst = (mine[finite] - exact[finite]).abs()
        _record(
            what, "values", float(worst.max()) if worst.numel() else 0.0, off, allowed, self.factor
        )
        if worst.numel() and float(worst.max()) > allowed:
            step = int(finite.nonzero()[int(worst.argmax())])
            name = f"value {start + step} ({float(mine[step])!r})"
            raise AssertionError(
                _describe(what, name, float(worst.max()), off, allowed, self.factor)
            )
