"""The one synchronous step: backward of the weighted loss, reduce, finite check, apply or skip.

``towers.train``'s loop and the own loop's ``Context``, plain or elastic, all step through a
:class:`SyncDriver`. It is given a group (:mod:`towers.engines.sync.group`) and asks it for the
current communicator rather than storing one, and a gradient transform
(:mod:`towers.engines.transforms`) that reduces each bucket. A step is

1. ``arm()`` before the last backward, so that each bucket's reduction starts as soon as its
   gradients are complete (:class:`~towers.engines.sync.gradsync.GradientSync`);
2. ``add()`` of the tower's loss sum and samples (:meth:`backward` does both for one loss);
3. ``reduce(stamp)``: the step's metadata (and, in the own loop, the batch stamp) rides with
   the last bucket; every rank decides the step identically (:mod:`towers.core.step`): the mean
   gradients in ``.grad``, or a skipped step with every ``.grad`` cleared;
4. ``apply(result, optimizer)``: the optimizer steps unless the step was skipped.

The loops call them in that order, through the mode's step plan
(:mod:`towers.engines.sync.plan`), which says whether a step reduces at all (DiLoCo's inner
steps do not). The transform's state is this tower's
and is committed only when a step is applied; it is saved in checkpoints and, in elastic jobs,
kept by survivors and handed to replacements (``snapshot``/``adopt``).
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

import torch
from torch import nn

from ...comm.base import Work
from ...core.devices import moved
from ...core.step import StepResult
from ...core.verdict import PendingResult, known
from ..broadcast import broadcast_module, terms, verify_same_model
from ..replica import backward_weighted
from ..transforms import (
    GradientTransform,
    check_transform,
    loaded_state,
    saved_state,
    start_from,
)
from .gradsync import BucketPlan, GradientSync, bucket_bytes_for
from .group import Group
from .guard import StepGuard

__all__ = ["DECIDE_ON_DEVICE", "Owner", "SyncDriver"]

DECIDE_ON_DEVICE = "TOWERS_DECIDE_ON_DEVICE"


class Owner(Protocol):
    """The training state the driver keeps consistent across an elastic group's regroups."""

    def progress(self) -> int: ...

    def snapshot(self) -> Any: ...

    def adopt(self, snapshot: Any) -> None: ...

    def regrouped(self) -> None:
        """The driver is attached to a new set of members (their rank and number may differ)."""
        ...

    def shared(self) -> nn.Module:
        """What every member must hold alike, copied from rank 0 whenever the members change:
        the model, or in DiLoCo the outer parameters (each worker's own are its own)."""
        ...


class SyncDriver:
    """One rank's synchronous step over ``group``; see the module doc."""

    def __init__(
        self,
        group: Group,
        transform: GradientTransform | None = None,
        owner: Owner | None = None,
        mode: str = "sync",
        on_unarmed: Callable[[], bool] | None = None,
        defer: bool | None = None,
    ):
        self.group = group
        self.mode = mode  # as the job names it: a newcomer must train the same
        self.device = group.device
        self.transform = check_transform(transform)
        self.owner = owner
        self.model: nn.Module | None = None
        self.plan: BucketPlan | None = None
        self.sync: GradientSync | None = None
        self._state: Any = None  # the transform's committed state (see state)
        self.samples = 0  # this tower's samples since the last reduce()
        self.loss_sum: float | torch.Tensor = 0.0  # and their loss sum (a tensor, unread)
        self.seconds = 0.0  # and the compute time they took
        self.loss_known = True  # False: a backward the caller did not see (loss.backward())
        # called when a gradient arrives while the step is not armed (see GradientSync)
        self.on_unarmed = on_unarmed
        self._settled: list[torch.Tensor] = []  # buffers after the last completed step
        # Decide steps on the device, without the host waiting (towers.core.verdict): by
        # default where work is queued (a GPU; on the CPU too with TOWERS_DECIDE_ON_DEVICE=1,
        # which runs the GPU's path there), outside elastic jobs, which read every step's
        # numbers to agree on regroups.
        if defer is None:
            queued = self.device.type == "cuda" or os.environ.get(DECIDE_ON_DEVICE) == "1"
            defer = queued and not group.elastic
        self.defer = defer
        self.guard: StepGuard | None = None

    # -- the model -------------------------------------------------------------------------

    def replicate(
        self,
        model: nn.Module,
        bucket_bytes: int | None = None,
        breaks: Sequence[int] = (),
    ) -> nn.Module:
        """Give every rank the same parameters and buffers, and attach the hooks.

        ``bucket_bytes``: default 4 MiB on the CPU, 25 MiB on a GPU (:func:`bucket_bytes_for`).
        ``breaks``: trainable-parameter indices where a bucket must end (see
        :meth:`launch`'s ``buckets``).
        """
        model.to(self.device)
        size = bucket_bytes_for(self.device) if bucket_bytes is None else bucket_bytes
        plan = BucketPlan.of(list(model.parameters()), size, breaks)
        if not plan.params:
            raise ValueError("the model has no trainable parameters (requires_grad=True)")
        self.remove()
        self.model, self.plan = model, plan
        self.state = self.transform.init(plan.layouts)
        self.group.start(self)
        return model

    def rebind(self) -> None:
        """Copy rank 0's model to every member and attach the hooks to the current comm."""
        assert self.model is not None and self.plan is not None
        self.remove()
        self.zero_grad()
        comm = self.group.comm
        verify_same_model(self.model, comm)
        broadcast_module(self.model if self.owner is None else self.owner.shared(), comm)
        self.sync = GradientSync(self.plan, comm, self.transform, self.state)
        self.sync.on_unarmed = self.on_unarmed
        self.sync.defer = self.defer
        if self.group.elastic:
            self.settle()
        if self.owner is not None:
            self.owner.regrouped()

    def settle(self) -> None:
        """Remember the buffers (BatchNorm's statistics): a redone step starts from them."""
        assert self.model is not None
        self._settled = [b.detach().clone() for b in self.model.buffers()]

    def rollback(self) -> None:
        """Restore the buffers of the last completed step (a step was abandoned)."""
        assert self.model is not None
        with torch.no_grad():
            for b, saved in zip(self.model.buffers(), self._settled, strict=True):
                b.copy_(saved)

    def gather_streams(self) -> dict[str, list[Any]]:
        """Every rank's random stream and transform state (a collective), for a checkpoint."""
        comm = self.group.comm
        streams = {
            "rng": comm.all_gather_object(torch.get_rng_state()),
            "transform": comm.all_gather_object(moved(saved_state(self.state), "cpu")),
        }
        if self.device.type == "cuda":  # dropout on a GPU draws from the GPU's generator
            streams["cuda_rng"] = comm.all_gather_object(torch.cuda.get_rng_state(self.device))
        return streams

    def restore_streams(self, saved: dict[str, Any], reseed: int | None = None) -> None:
        """This rank's random stream and transform state from :meth:`gather_streams`' record.

        Saved with another number of ranks, the random stream is seeded with ``reseed`` (if
        given) and the transform starts as a newcomer would.
        """
        comm = self.group.comm
        rng, states = saved.get("rng"), saved.get("transform")
        cuda_rng = saved.get("cuda_rng") if self.device.type == "cuda" else None
        if rng is not None and len(rng) == comm.world_size:
            torch.set_rng_state(rng[comm.rank])
            if cuda_rng is not None and len(cuda_rng) == comm.world_size:
                torch.cuda.set_rng_state(cuda_rng[comm.rank], self.device)
        elif rng is not None and reseed is not None:
            torch.manual_seed(reseed)
        if states is not None and self.plan is not None:
            if len(states) == comm.world_size:
                self.state = loaded_state(self.transform, moved(states[comm.rank], self.device))
            else:
                first = loaded_state(self.transform, moved(states[0], self.device))
                self.state = start_from(self.transform, first, self.plan.layouts)
            self._sync().commit(self.state)

    @property
    def params(self) -> list[torch.Tensor]:
        return self._plan().params

    def _plan(self) -> BucketPlan:
        if self.plan is None:
            raise RuntimeError("call ctx.replicate(model) first")
        return self.plan

    def _sync(self) -> GradientSync:
        if self.sync is None:
            raise RuntimeError("call ctx.replicate(model) first")
        assert self.sync.comm is self.group.comm, "the group changed without a rebind"
        return self.sync

    # -- what an elastic group agrees on ---------------------------------------------------

    def progress(self) -> int:
        return self.owner.progress() if self.owner is not None else 0

    def snapshot(self) -> Any:
        owner = self.owner.snapshot() if self.owner is not None else None
        return {"owner": owner, "transform": saved_state(self.state)}

    def terms(self) -> dict[str, Any]:
        assert self.model is not None
        # A transform without a repr of its own shows its address, and its module is
        # __mp_main__ in a forked worker: neither says what it does.
        name = re.sub(r" at 0x[0-9a-fA-F]+", "", repr(self.transform))
        name = name.replace("__mp_main__.", "__main__.")
        return terms(self.model, self.mode, "none" if name == "allreduce()" else name)

    def adopt(self, snapshot: Any, newcomer: bool) -> None:
        if self.owner is not None:
            self.owner.adopt(snapshot["owner"])
        if newcomer:  # a survivor keeps its own (an error-feedback residual is its own)
            peer = loaded_state(self.transform, snapshot["transform"])
            self.state = start_from(self.transform, peer, self._plan().layouts)

    # -- the step --------------------------------------------------------------------------

    def arm(self, scale: int = 1) -> None:
        """The next backward is this step's last: reduce its gradients as they arrive
        (``scale``: each gradient times it, for a mean loss backpropagated as it is)."""
        self._sync().arm(scale)

    def add(self, loss_sum: float | torch.Tensor, samples: int, seconds: float = 0.0) -> None:
        """Count a backpropagated micro-batch: its loss summed over ``samples`` samples, and
        the ``seconds`` it took to compute (what a balanced split follows)."""
        self.loss_sum += loss_sum
        self.samples += samples
        self.seconds += seconds

    def loss_unseen(self) -> None:
        """The step's loss is not known to towers (a script's own ``loss.backward()``): its
        result's loss is ``nan``."""
        self.loss_known = False

    def backward(self, loss: torch.Tensor, samples: int, scaler: Any = None) -> None:
        """Backpropagate ``loss * samples`` (scaled by ``scaler``, a ``GradScaler``, if given)
        and count it (see :func:`backward_weighted`)."""
        self.add(backward_weighted(loss, samples, scaler), samples)

    def take(self) -> tuple[float, int, float]:
        """The loss sum, samples and seconds counted since the last reduction, no longer
        counted: for a step that this tower takes alone (DiLoCo's inner steps)."""
        counted = float(self.loss_sum), self.samples, self.seconds
        self.samples, self.loss_sum, self.seconds = 0, 0.0, 0.0
        return counted

    def reduce(self, stamp: torch.Tensor | None = None) -> StepResult:
        """Sum the gradients over all towers and decide the step; the same on every rank.

        Afterwards each parameter's ``.grad`` holds the global batch's gradient, or, if the step
        is skipped (a loss or gradient was not finite on some tower), ``None``.
        """
        self.launch(stamp)
        return self.land()

    def launch(
        self,
        stamp: torch.Tensor | None = None,
        values: Mapping[int, torch.Tensor] | None = None,
    ) -> None:
        """Start :meth:`reduce`: the buckets travel while the caller goes on; :meth:`land`
        completes it. ``values``: reduce these tensors (by trainable-parameter index, shaped as
        the parameter; whole buckets, e.g. a fragment of the model that ``breaks`` bounded)
        through the same buckets, transform and metadata, instead of the gradients, weighted
        as the caller counted them with :meth:`add`; :meth:`land` returns their means."""
        sync = self._sync()
        try:
            regroup = self.group.regroup_wanted
            loss = self.loss_sum if self.loss_known else None
            sync.launch(self.samples, loss, stamp, regroup, values, self.seconds)
        finally:
            self.samples, self.loss_sum, self.seconds = 0, 0.0, 0.0
            self.loss_known = True

    def land(self) -> StepResult:
        """Wait for the reduction :meth:`launch` started and decide it (see :meth:`reduce`)."""
        return self.land_values()[0]

    def land_values(self) -> tuple[StepResult, list[torch.Tensor] | None]:
        """:meth:`land`; with ``values`` launched, also their means over all towers, in the
        order of their indices and shaped as the parameters (``None`` if the step is skipped).
        The values' ``.grad`` are not touched."""
        sync = self._sync()
        result, state, means = sync.land()
        if isinstance(result, PendingResult):  # decided on the device: the step guards
            self.hold(result)
            return result, None
        if self.guard is not None:  # decided on the host: its .grad say it
            self.guard.clear()
        if sync.regroup:
            self.group.regroup_after_step()
        if result.skipped:
            self.zero_grad()
        else:
            self.state = state  # committed to the sync
        if result.skipped or not means:
            return result, None
        params = self._plan().params
        return result, [_shaped(means[i], params[i]) for i in sorted(means)]

    @property
    def rank(self) -> int:
        """This tower's rank among the current members."""
        return self.group.comm.rank

    @property
    def world_size(self) -> int:
        """The current members."""
        return self.group.comm.world_size

    def all_gather_object(self, obj: Any) -> list[Any]:
        """Every member's ``obj``, by rank (a collective)."""
        return self.group.comm.all_gather_object(obj)

    def start_sum(self, tensor: torch.Tensor) -> tuple[torch.Tensor, Work]:
        """Start summing ``tensor`` over the members, beside the buckets: the tensor (on this
        tower's device) that holds the sum once the returned work is waited for."""
        on_device = tensor.to(self.device)
        return on_device, self.group.comm.all_reduce_sum(on_device)

    def apply(self, result: StepResult, optimizer: torch.optim.Optimizer) -> None:
        """Step ``optimizer`` unless ``result`` is skipped, then clear the gradients. A step
        decided on the device steps the optimizer under its guard, which skips it there."""
        if not known(result) or not result.skipped:
            optimizer.step()
        self.zero_grad()

    def hold(self, result: StepResult) -> None:
        """Guard the optimizer steps until the next decision with ``result``'s: skipped on the
        device if it was decided there, else as its ``skipped`` says."""
        if self.guard is None:
            self.guard = StepGuard(self._plan().params).start()
        self.guard.guard(result)

    def zero_grad(self) -> None:
        if self.plan is not None:
            for p in self.plan.params:
                p.grad = None

    @property
    def state(self) -> Any:
        """The transform's committed state (after a step decided on the device, once that
        step's numbers are read): the attached sync's, which commits it."""
        if self.sync is not None:
            self.sync.settle()
            self._state = self.sync.state
        return self._state

    @state.setter
    def state(self, state: Any) -> None:
        self._state = state
        if self.sync is not None:
            self.sync.commit(state)

    def retransform(self, transform: GradientTransform | None) -> None:
        """Sum with ``transform`` (``None``: the default sum) from the next step on, from its
        first state (between steps)."""
        self.transform = check_transform(transform)
        if self.sync is not None:
            self.sync.transform = self.transform
        self.state = self.transform.init(self._plan().layouts)

    def remove(self) -> None:
        """Detach the hooks (the model trains on without averaging)."""
        if self.sync is not None:
            self._state = self.state  # settled, before the sync goes
            self.sync.remove()
            self.sync = None
        if self.guard is not None:
            self.guard.remove()
            self.guard = None


def _shaped(mean: torch.Tensor | None, param: torch.Tensor) -> torch.Tensor:
    """A parameter's mean, shaped as the parameter (zero where no tower had a value)."""
    return torch.zeros_like(param) if mean is None else mean.view_as(param)
