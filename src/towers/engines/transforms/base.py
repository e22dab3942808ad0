"""The gradient-transform seam: how one bucket of a step's gradients is reduced over the towers.

In the spirit of DDP's communication hooks and optax's ``GradientTransformation``: a transform
has explicit state and two functions,

- ``init(layouts) -> state``: the state for a model's buckets (:class:`BucketLayout` each);
- ``reduce(state, bucket, comm) -> (bucket, state)``: this tower's bucket in, the bucket on its
  way to holding the *sum* over all towers out, and the next state.

A bucket arrives holding this tower's ``n_i * g_i`` (its gradients already weighted by its
sample count) and must come out holding ``sum_i n_i * g_i``; the step driver then divides by
the total sample count, checks that every value is finite and hands the gradients to the
parameters (:mod:`towers.core.step`). Division stays outside the chain because the total is
only known once the step's metadata has been summed, and a step that is skipped must not
change anything. The last bucket carries that metadata in :attr:`Bucket.tail`: a transform
must deliver it summed exactly (never compressed); :func:`sum_tail` does that for transforms
that move the gradients in their own way.

Reductions overlap backward: a transform may return a bucket that is still on its way
(:meth:`Bucket.then`, or a collective's :class:`~towers.comm.base.Work` in ``pending``); the
driver calls :meth:`Bucket.wait` once every bucket has been launched.

State is per tower (an error-feedback residual is this tower's own) and is committed only when
a step is applied: a transform must not change the ``state`` it is given in place, so that a
step abandoned by a lost peer, or skipped for a non-finite value, leaves the state as it was.
``handover(state)`` (optional) says what a newcomer, such as a replacement worker in an
elastic job, starts from given a peer's state; without it a newcomer starts from ``init``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, fields, replace
from typing import Any, ClassVar, Protocol, Self, runtime_checkable

import torch

from ...comm.base import Comm, Work

__all__ = [
    "AllReduce",
    "Bucket",
    "BucketLayout",
    "Chain",
    "GradientTransform",
    "PerBucketState",
    "allreduce",
    "chain",
    "loaded_state",
    "saved_state",
    "start_from",
    "sum_tail",
]


@dataclass(frozen=True)
class BucketLayout:
    """Which parameters a bucket holds and where: what ``init`` may size its state by.

    Attributes:
        index: the bucket's place in launch order (0 is launched first).
        shapes: each parameter's shape, in the bucket's order.
        slots: each parameter's ``(start, stop)`` in the flat bucket.
        dtype, device: those of the bucket's gradients.
        params: each parameter's index among the model's trainable parameters.
    """

    index: int
    shapes: tuple[tuple[int, ...], ...]
    slots: tuple[tuple[int, int], ...]
    dtype: torch.dtype
    device: torch.device
    params: tuple[int, ...] = ()

    @property
    def numel(self) -> int:
        return self.slots[-1][1] if self.slots else 0


@dataclass
class Bucket:
    """One bucket of one step, on its way through a transform chain.

    Attributes:
        index: the bucket's place in launch order (see :class:`BucketLayout`).
        grads: the flat gradients, in this stage's representation.
        tail: the step's metadata (float values summed over towers), on the last bucket only.
        whole: where ``grads`` and ``tail`` lie back to back in one tensor (a sum can then move
            both in one message), else ``None``.
        pending: completes this stage and returns the finished bucket; ``None`` when done.
    """

    index: int
    grads: torch.Tensor
    tail: torch.Tensor | None = None
    whole: torch.Tensor | None = None
    pending: Callable[[], Bucket] | None = field(default=None, repr=False)

    def wait(self) -> Bucket:
        """The finished bucket: every pending stage run, in order."""
        b = self
        while b.pending is not None:
            b = b.pending()
        return b

    def then(self, fn: Callable[[Bucket], Bucket]) -> Bucket:
        """A bucket that, once waited for, is ``fn`` of this one finished (runs lazily)."""
        return Bucket(self.index, self.grads, self.tail, self.whole, lambda: fn(self.wait()))

    def after(self, works: Sequence[Work]) -> Bucket:
        """This bucket, finished once every collective in ``works`` is."""

        def finish() -> Bucket:
            for w in works:
                w.wait()
            return Bucket(self.index, self.grads, self.tail, self.whole)

        return Bucket(self.index, self.grads, self.tail, self.whole, finish)


@runtime_checkable
class GradientTransform(Protocol):
    """A stateful, composable reduction of gradient buckets; see the module doc."""

    def init(self, layouts: Sequence[BucketLayout]) -> Any:
        """The state for a model whose gradients travel in ``layouts``."""
        ...

    def reduce(self, state: Any, bucket: Bucket, comm: Comm) -> tuple[Bucket, Any]:
        """Move ``bucket`` towards the sum over towers; return it and the next state."""
        ...


def sum_tail(bucket: Bucket, comm: Comm) -> list[Work]:
    """Start the exact sum of ``bucket``'s metadata, if it has any (for custom transports)."""
    return [] if bucket.tail is None else [comm.all_reduce_sum(bucket.tail)]


@dataclass(kw_only=True)
class PerBucketState:
    """The state of a transform that keeps something per bucket (a residual, a warm start): a
    typed record, one subclass per transform, whose per-bucket lists are named in ``LISTS``.

    ``steps`` counts the steps (at the bucket ``last``). It travels and is saved as a plain
    dict (:meth:`state_dict`, as torch's ``Stateful``), which a checkpoint's safe loader reads
    and which is what earlier checkpoints hold; :meth:`from_state_dict` reads it back.
    """

    LISTS: ClassVar[tuple[str, ...]] = ()
    steps: int = 0
    last: int = 0
    copied: int | None = None  # the step whose first bucket copied the lists

    def next(self, index: int) -> Self:
        """The state to return for bucket ``index`` of a step.

        The per-bucket lists are copied once per step, by its first bucket: a bucket fills
        its entry in only when its sum lands, after the step's later buckets were reduced, so
        those must share the copies rather than copy stale ones; the state before the step
        stays as it was (an elastic redo starts from it).
        """
        new = replace(self, steps=self.steps + (index == self.last))
        if self.copied != self.steps:
            new.copied = self.steps
            for name in self.LISTS:
                setattr(new, name, list(getattr(self, name)))
        return new

    def state_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    @classmethod
    def from_state_dict(cls, saved: dict[str, Any]) -> Self:
        return cls(**{f.name: saved[f.name] for f in fields(cls) if f.name in saved})


def saved_state(state: Any) -> Any:
    """``state`` as it travels and is saved: typed records as their dicts (a chain's by
    position), anything else as it is."""
    if isinstance(state, PerBucketState):
        return state.state_dict()
    if isinstance(state, tuple):
        return tuple(saved_state(s) for s in state)
    return state


class AllReduce:
    """The plain sum over towers of every value, in the bucket's own dtype (the default).

    The metadata rides in the same message where it lies behind the gradients, as it does
    unless the model's gradients are of a dtype that cannot hold it exactly.
    """

    def init(self, layouts: Sequence[BucketLayout]) -> None:
        return None

    def reduce(self, state: Any, bucket: Bucket, comm: Comm) -> tuple[Bucket, Any]:
        b = bucket.wait()
        if b.whole is not None:
            works = [comm.all_reduce_sum(b.whole)]
        else:
            works = [comm.all_reduce_sum(b.grads), *sum_tail(b, comm)]
        return b.after(works), state

    def __repr__(self) -> str:
        return "allreduce()"


def allreduce() -> AllReduce:
    """The default reduction: a plain sum over towers (what ``transform=None`` means)."""
    return AllReduce()


class Chain:
    """Transforms applied in order, each to the bucket the one before returned."""

    def __init__(self, *transforms: GradientTransform):
        for t in transforms:
            if not isinstance(t, GradientTransform):
                raise TypeError(
                    f"chain() takes gradient transforms (objects with init(layouts) and "
                    f"reduce(state, bucket, comm)), got {type(t).__name__}"
                )
        self.transforms = transforms

    def init(self, layouts: Sequence[BucketLayout]) -> tuple[Any, ...]:
        return tuple(t.init(layouts) for t in self.transforms)

    def reduce(self, state: Any, bucket: Bucket, comm: Comm) -> tuple[Bucket, Any]:
        states = []
        for t, s in zip(self.transforms, state, strict=True):
            bucket, s = t.reduce(s, bucket, comm)
            states.append(s)
        return bucket, tuple(states)

    def __repr__(self) -> str:
        return f"chain({', '.join(map(repr, self.transforms))})"


def chain(*transforms: GradientTransform) -> Chain:
    """Compose transforms: each reduces the bucket the one before it returned.

    Exactly one of them (usually the last but a cast back or a rescale) must communicate, so
    that the bucket comes out summed over the towers.

    Example:
        >>> towers.transforms.chain(Half(), towers.transforms.allreduce())  # doctest: +SKIP
    """
    return Chain(*transforms)


def loaded_state(transform: GradientTransform, saved: Any) -> Any:
    """The state ``saved`` (:func:`saved_state`'s) as ``transform`` keeps it: its ``State``
    record, where it has one."""
    if isinstance(transform, Chain):
        return tuple(loaded_state(t, s) for t, s in zip(transform.transforms, saved, strict=True))
    kind = getattr(transform, "State", None)
    return kind.from_state_dict(saved) if kind is not None and isinstance(saved, dict) else saved


def start_from(transform: GradientTransform, peer: Any, layouts: Sequence[BucketLayout]) -> Any:
    """The state a newcomer starts from, given a peer's: ``handover(peer)``, else ``init``.

    ``handover`` is optional (most transforms have nothing to hand over), so it is looked up.
    """
    if isinstance(transform, Chain):
        parts = zip(transform.transforms, peer, strict=True)
        return tuple(start_from(t, s, layouts) for t, s in parts)
    method = getattr(transform, "handover", None)
    return transform.init(layouts) if method is None else method(peer)
