"""One rank's synchronous run: the state its group keeps consistent and its checkpoints hold.

``towers.train``'s loop (:mod:`towers.engines.sync.loop`) and the own loop's ``Context`` both
keep their run in a :class:`RunState`: the replica (model, optimizer, schedule), the mode's
step plan (:mod:`towers.engines.sync.plan`), the global batches done, and a *journal* of what
the run reports (``train``: every step's record; the own loop: the last step's result).

It is the driver's owner (:class:`~towers.engines.sync.driver.Owner`): when an elastic group
regroups, the member that has done the most sends :meth:`snapshot` and the others
:meth:`adopt` it; a replacement receives the same, from a live peer. It writes and reads the
part of a checkpoint both loops share (:meth:`checkpoint`, :meth:`restore`), each part under a
key of its own: the model the members share, the replica, every rank's random streams and
transform state, the plan's own state (DiLoCo: the outer optimizer, every rank's inner state)
and the balanced split's.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import torch
from torch import nn

from ...core.balance import Balancer
from ...core.split import shard_sizes
from ...core.step import StepResult
from ..replica import Replica, cpu_state
from ..shard import ShardedState
from ..shard_files import describe
from .driver import SyncDriver
from .plan import EveryStep, StepPlan

__all__ = ["Journal", "LastResult", "RunState"]


class Journal(Protocol):
    """What a run reports, kept alike on every member: plain data out, plain data in."""

    def state_dict(self) -> Any: ...

    def load_state_dict(self, saved: Any) -> None: ...


class LastResult:
    """The own loop's journal: the last step's result (a peer's, after a regroup)."""

    def __init__(self) -> None:
        self.result: StepResult | None = None

    def state_dict(self) -> Any:
        r = self.result
        return None if r is None else {k: getattr(r, k) for k in r.__dataclass_fields__}

    def load_state_dict(self, saved: Any) -> None:
        self.result = None if saved is None else StepResult(**saved)


class RunState:
    """See the module doc.

    Args:
        plan: the mode's step plan.
        journal: what the run reports.
        joining: a replacement: it has no state until a peer sends it.
        replays: the loop can train again the batches since the agreed progress (``train``'s
            loop can; an own loop's batches come from the user's iterator and cannot be
            rewound, so its members only redo the step in flight).
        regrouped: called after the plan is told that the members changed (``train``: the
            data-loading processes are planned anew).
    """

    def __init__(
        self,
        plan: StepPlan,
        journal: Journal,
        *,
        joining: bool = False,
        replays: bool = True,
        regrouped: Callable[[], None] | None = None,
        balance: bool = False,
    ):
        self.plan, self.journal = plan, journal
        # each global batch split in proportion to the towers' speeds (core/balance.py)
        self.balancer: Balancer | None = Balancer(1) if balance else None
        self.unbalanced: str | None = None  # why an uneven split would change the result
        self.replays, self._regrouped = replays, regrouped
        self.replica: Replica | None = None  # the model once it is known
        self.steps = 0  # global batches completed
        self.newcomer = joining
        self.catch_up = 0  # batches a replacement of an own loop skips to reach its peers
        self._pending: dict[str, Any] | None = None  # a peer's optimizer state, not loaded yet
        self.sharding: ShardedState | None = None  # the optimizer's state, sharded over ranks
        # every member rebuilds the state from the newest checkpoint when the members change
        # (an elastic job's sharded state: a lost tower's part is nowhere else): none is sent
        self.rebuilds = False

    def _replica(self) -> Replica:
        assert self.replica is not None, "the run has no model yet"
        return self.replica

    def optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """The own loop's optimizer, known at its first step: give it a peer's state if one
        arrived before it."""
        replica = self._replica()
        replica.optimizer = optimizer
        if self._pending is not None:
            optimizer.load_state_dict(self._pending)
            self._pending = None

    # -- what the group keeps consistent (the driver's owner) ------------------------------

    def progress(self) -> int:
        if self.rebuilds:
            return 0  # the same on every member: nothing to send
        return -1 if self.newcomer else self.plan.progress(self.steps)

    def snapshot(self) -> dict[str, Any]:
        replica = self._replica()
        state = {
            "steps": self.plan.progress(self.steps),
            "plan": self.plan.snapshot(replica),
            "journal": self.journal.state_dict(),
            "balance": self._balance_state(),
        }
        if self.replays:
            # The members behind adopt this state and train on from it; so does this one, so
            # that every member trains the same shards (DiLoCo: the batches since the last
            # exchange; a synchronous step leaves none).
            self.plan.adopt(state["plan"], replica, newcomer=False)
            self.steps = state["steps"]
        return state

    def adopt(self, state: dict[str, Any]) -> None:
        replica = self._replica()
        self.plan.adopt(state["plan"], replica, self.newcomer)
        if replica.optimizer is None:  # the optimizer a peer's state holds, for the first step
            self._pending = state["plan"].get("optimizer")
        self.journal.load_state_dict(state["journal"])
        self._load_balance(state["balance"])
        if self.newcomer:
            self.catch_up = state["steps"]
        self.newcomer = False
        self.steps = state["steps"]

    def regrouped(self) -> None:
        self.plan.regrouped(self._replica().model)
        if self._regrouped is not None:
            self._regrouped()

    def shared(self) -> nn.Module:
        return self.plan.shared(self._replica().model)

    # -- checkpoints -----------------------------------------------------------------------

    def checkpoint(self, driver: SyncDriver, replica: Replica | None = None) -> dict[str, Any]:
        """The checkpoint's part both loops share, each part under its own key (a collective:
        every rank calls it; rank 0 writes it). ``replica``: the model, optimizer and schedule
        to save (default: the run's).

        - ``model``: the parameters and buffers every member shares, the trained model (sync:
          the replica's; DiLoCo: the outer ones);
        - ``replica``: the model, optimizer and schedule (``None`` where the plan keeps every
          rank's, which differ: DiLoCo's);
        - ``streams``: every rank's random streams and gradient-transform state;
        - ``plan``: the mode's own (DiLoCo: the outer optimizer and every rank's inner state);
        - ``balance``: the balanced split's measured speeds.
        """
        replica = replica or self._replica()
        streams = driver.gather_streams()
        planned = self.plan.checkpoint(driver, replica)
        own = replica.state_dict(optimizer=self.sharding is None)
        if self.sharding is not None and replica.optimizer is not None:
            own["optimizer"] = describe(self.sharding, replica.optimizer)  # the parts: per rank
        shared = self.plan.trained(replica.model)
        return {
            "model": own["model"] if shared is replica.model else cpu_state(shared),
            "replica": None if self.plan.keeps_replicas else own,
            "streams": streams,
            "plan": planned,
            "balance": self._balance_state(),
        }

    def restore(
        self,
        state: dict[str, Any],
        driver: SyncDriver,
        replica: Replica | None = None,
        reseed: int | None = None,
    ) -> None:
        """Restore :meth:`checkpoint`'s part on every rank, once the members are formed;
        ``reseed``: the random stream of a rank when the checkpoint has another number of
        ranks (see :meth:`SyncDriver.restore_streams`)."""
        replica = replica or self._replica()
        if state["replica"] is not None:
            replica.load_state_dict(state["replica"])
        driver.restore_streams(state["streams"], reseed)
        self.plan.restore(state, driver, replica)
        self._load_balance(state.get("balance"))

    # -- the split of each global batch ----------------------------------------------------

    def balanced(self, on: bool, because: str | None = None) -> None:
        """Balance the split from now on (the own loop says so at ``ctx.replicate``);
        ``because``: why an uneven split would change this run's result, if it would."""
        self.balancer = Balancer(1) if on else None
        self.unbalanced = because

    def split(self, batch: int, towers: int) -> list[int]:
        """The shard sizes of the next global batch of ``batch`` samples over ``towers``:
        balanced if asked for, else :func:`towers.split`'s (the same on every rank)."""
        if self.balancer is None:
            return shard_sizes(batch, towers)
        if self.balancer.towers != towers:  # the members changed: measure them afresh
            self.balancer = Balancer(towers)
        return self.balancer.split(batch)

    def shares(self, towers: int) -> list[float] | None:
        """Each tower's share of a batch where the split is balanced for ``towers``."""
        b = self.balancer
        return None if b is None or b.towers != towers else list(b.shares)

    def observe(self, result: StepResult) -> None:
        """A step's result over all towers: its shard sizes and compute times steer the split."""
        b = self.balancer
        if b is not None and len(result.tower_seconds) == b.towers == len(result.tower_samples):
            b.observe(result.tower_samples, result.tower_seconds)

    def _balance_state(self) -> dict[str, Any] | None:
        if self.balancer is None:
            return None
        return {"towers": self.balancer.towers, **self.balancer.state_dict()}

    def _load_balance(self, state: dict[str, Any] | None) -> None:
        if self.balancer is not None and state is not None:
            self.balancer = Balancer(state["towers"])
            self.balancer.load_state_dict(state)

    # -- the own loop's evaluation ----------------------------------------------------------

    def evaluated(self, model: nn.Module) -> nn.Module:
        """What evaluating ``model`` means: the replicated model is evaluated with the
        parameters every rank shares (DiLoCo: the outer ones)."""
        if self.replica is not None and model is self.replica.model:
            return self.plan.trained(model)
        return model

    @property
    def every_step(self) -> bool:
        """Whether every global batch is one averaged step (``sync``, not DiLoCo)."""
        return isinstance(self.plan, EveryStep)
