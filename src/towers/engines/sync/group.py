"""The group a synchronous step runs in: a fixed one, or an elastic one that regroups.

The step driver (:class:`~towers.engines.sync.driver.SyncDriver`) never stores a communicator:
it asks its group for the current one. Both groups offer the same few calls:

- ``start(driver)``: bring every member to the same model and attach the driver's hooks;
- ``attempt(driver, fn)``: run one step's work; ``None`` means "redo it" (elastic only);
- ``sum_now(tensor)``: a blocking sum for collectives inside the forward pass (BatchNorm);
- ``finish(driver)``: return once every member has done every step;
- ``close()``.

:class:`PlainGroup` is a job's fixed process group: ``attempt`` just runs the work.

:class:`ElasticGroup` survives lost peers (docs/elastic.md). Sample-weighted averaging gives the
same gradient for any split of a global batch, so when a peer is lost during a step the
survivors form the next generation of members (:class:`~towers.comm.elastic.ElasticConnection`)
and redo the step among themselves. A step's sum can complete on some ranks and not on others
(a ring all-reduce's last chunk), so after every regroup the members compare how many steps
each has done, and the most advanced one sends its state to the others (the driver's
``snapshot``/``adopt``); a replacement that joins at a step boundary receives the same, from a
live peer, not from disk. Ranks never differ by more than one step, and every rank that
completed a step computed the same update, so the state sent is exact. The regroup runs after
the ``except`` clause has ended, so that no traceback keeps the abandoned group's tensors or
work alive.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable
from typing import Any, Protocol, TypeVar

import torch

from ...comm.base import Comm, PeerFailure
from ...comm.elastic import ElasticConnection
from ...comm.group import Connection
from ..broadcast import join_difference

__all__ = ["ElasticGroup", "Group", "Member", "PlainGroup"]

T = TypeVar("T")


class Member(Protocol):
    """What a group asks of the training state it keeps consistent (the step driver)."""

    def progress(self) -> int:
        """Steps done; -1 for a newcomer that has no state yet."""
        ...

    def snapshot(self) -> Any:
        """The state a member that is behind adopts."""
        ...

    def terms(self) -> dict[str, Any]:
        """What every member must share (:func:`towers.engines.broadcast.terms`)."""
        ...

    def adopt(self, snapshot: Any, newcomer: bool) -> None: ...

    def rebind(self) -> None:
        """The members changed (or were formed): same model on all, hooks on the new comm."""
        ...

    def settle(self) -> None:
        """A step completed: what a later redo must start from is the state now."""
        ...

    def rollback(self) -> None:
        """Undo what an abandoned step changed outside the optimizer (BatchNorm's statistics)."""
        ...


class Group(Protocol):
    """See the module doc."""

    elastic: bool
    joining: bool
    device: torch.device
    local_rank: int
    lost_at: float | None

    @property
    def comm(self) -> Comm: ...

    @property
    def regroup_wanted(self) -> bool: ...

    def regroup_after_step(self) -> None: ...

    def start(self, member: Member) -> None: ...

    def attempt(self, member: Member, fn: Callable[[], T]) -> T | None: ...

    def sum_now(self, tensor: torch.Tensor) -> None: ...

    def finish(self, member: Member | None) -> None: ...

    def close(self) -> None: ...


class PlainGroup:
    """A job's fixed process group (or shared memory): nothing to regroup."""

    elastic = False
    joining = False
    regroup_wanted = False
    lost_at: float | None = None

    def __init__(self, conn: Connection):
        self.conn = conn
        self.device = conn.device
        self.local_rank = conn.local_rank

    @property
    def comm(self) -> Comm:
        return self.conn.comm

    def regroup_after_step(self) -> None:
        raise AssertionError("a plain group's members never ask to regroup")

    def start(self, member: Member) -> None:
        member.rebind()

    def attempt(self, member: Member, fn: Callable[[], T]) -> T | None:
        return fn()

    def sum_now(self, tensor: torch.Tensor) -> None:
        self.comm.all_reduce_sum(tensor).wait()

    def finish(self, member: Member | None) -> None:
        pass

    def close(self) -> None:
        self.conn.close()


class ElasticGroup:
    """The generations of an elastic job; see the module doc."""

    elastic = True
    local_rank = 0

    def __init__(self, conn: ElasticConnection):
        self.conn = conn
        self.device = conn.device
        self.joining = conn.joining  # a replacement: no state until a peer sends it
        self.lost_at: float | None = None  # when the peer whose loss is being recovered died
        self._generation: int | None = None  # the generation to enter next
        self._failed = False  # the current generation lost a peer
        self._latched = False  # a forward-pass collective failed: the step must be redone
        self._move = False  # the members agreed to regroup after this step
        self._terms: str | None = None  # what the members share, as JSON (start)

    @property
    def comm(self) -> Comm:
        # A newcomer asks to be let in once its model is built (start); asked for its rank
        # before, it is let in now, and the members wait while it builds the model.
        if self._generation is None and self.joining:
            self.join()
        return self.conn.comm

    @property
    def regroup_wanted(self) -> bool:
        return self.conn.membership.regroup_wanted

    def regroup_after_step(self) -> None:
        self._move = True

    def join(self) -> None:
        """Enter the first generation (a replacement waits to be let in), without a model."""
        if self._generation is None:
            self._generation = self.conn.membership.first_generation(self.joining)
            self._enter(None)

    def start(self, member: Member) -> None:
        self._terms = json.dumps(member.terms())
        if self.joining:
            self._check_terms(self._terms)
        self.join()
        failed = False
        try:
            self._agree(member)
            member.rebind()
        except PeerFailure:
            failed = True
        if failed:
            self._next(member, failed=True)
        else:
            self._publish_terms()

    def _publish_terms(self) -> None:
        """Rank 0 of each generation says what its members share, for newcomers to compare
        (every rank 0: the first may be lost before it wrote them)."""
        if self._terms is not None and self.conn.comm.rank == 0:
            self.conn.membership.publish_terms(self._terms)

    def _check_terms(self, mine: str) -> None:
        """A newcomer that differs from the job (another model, mode or compression) stops
        before the members take it in, saying how (:class:`~towers.comm.membership.JoinRefused`).
        """
        membership = self.conn.membership
        why = join_difference(json.loads(membership.job_terms()), json.loads(mine))
        if why is not None:
            raise membership.refuse(
                f"worker {membership.id}{membership.here} is not let into the running job: {why}; "
                "start every worker with the same script and arguments"
            )

    def _next(self, member: Member | None, failed: bool) -> None:
        """Leave the current generation for the next one (and agree there, with a member)."""
        self._failed = self._failed or failed
        self._latched = False
        self._generation = self.conn.generation + 1
        self._enter(member)

    def _enter(self, member: Member | None) -> None:
        while True:
            failed_in = self.conn.generation if self._failed else None
            failed = False
            try:
                self.conn.join(self._generation)  # type: ignore[arg-type]
                if failed_in is not None:
                    # published before the next generation: readable now, whoever noticed first
                    self.lost_at = self._lost_at(failed_in) or self.lost_at
                    self._failed = False
                if member is not None:
                    self._agree(member)
                    member.rebind()
                    self._publish_terms()
            except PeerFailure:
                failed = True
            if not failed:
                return
            self._failed = True
            self._generation = self.conn.generation + 1

    def _agree(self, member: Member) -> None:
        """Every member takes the state of the one that has done the most steps.

        They also agree on when the loss being recovered from happened, so that a replacement
        that joins in the same regroup records the recovery too.
        """
        comm = self.comm
        views = comm.all_gather_object((member.progress(), self.lost_at))
        done = [d for d, _ in views]
        lost = [t for _, t in views if t is not None]
        self.lost_at = min(lost) if lost else None
        best = max(done)
        if all(d == best for d in done):
            return
        src = done.index(best)
        state = member.snapshot() if comm.rank == src else None
        state = comm.broadcast_object(state, src)
        if comm.rank != src:
            member.adopt(state, newcomer=member.progress() < 0)

    def _lost_at(self, generation: int) -> float | None:
        with contextlib.suppress(Exception):
            failure = self.conn.membership.failure(generation)
            if failure is not None:
                return failure[1]
        return None

    def attempt(self, member: Member, fn: Callable[[], T]) -> T | None:
        failed = False
        try:
            if self._latched:
                raise PeerFailure("a peer was lost in a collective of the forward pass")
            out = fn()
            if self._latched:
                raise PeerFailure("a peer was lost in a collective of the forward pass")
        except PeerFailure:
            failed = True
        if failed:  # regroup outside the except clause: see the module doc
            member.rollback()
            self._next(member, failed=True)
            return None
        member.settle()
        if self._move:  # a replacement waits: every member moves on after this step
            self._move = False
            self._next(member, failed=False)
        return out

    def sum_now(self, tensor: torch.Tensor) -> None:
        # A forward pass runs in the user's code, outside any attempt: a lost peer is
        # remembered, and the step that follows is redone after the regroup.
        if self._latched:
            return
        try:
            self.comm.all_reduce_sum(tensor).wait()
        except PeerFailure:
            self._latched = True

    def finish(self, member: Member | None) -> None:
        """Wait until every member has done every step (regrouping while peers are lost)."""
        while True:
            failed = False
            try:
                self.comm.barrier()
            except PeerFailure:
                failed = True
            if not failed:
                return
            self._next(member, failed=True)

    def close(self) -> None:
        self.conn.close()
