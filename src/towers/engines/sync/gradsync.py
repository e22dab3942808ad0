"""Sample-weighted gradient averaging overlapped with backward.

Each tower backpropagates ``loss * n_i`` (its mean loss times its sample count), so its gradients
are n_i * g_i. Parameters are grouped into buckets in reverse registration order (roughly the
order backward produces their gradients); a ``register_post_accumulate_grad_hook`` on every
parameter marks it ready, and as soon as a bucket is complete it is flattened and handed to the
job's gradient transform (:mod:`towers.engines.transforms`; by default a plain sum over towers,
started asynchronously) while backward goes on. Buckets are launched strictly in index order on
every rank (as in DDP's reducer), so a rank whose gradients arrive in another order still issues
the same sequence of collectives.

The step's metadata (:class:`~towers.core.step.StepMeta`: sample counts, loss sums, non-finite
flags, which parameters got a gradient) travels in the tail of the last bucket, so a step costs
one collective per bucket and no extra round trip. The arithmetic on the summed values (the
division by N, the culprits, ``None`` gradients) lives in :mod:`towers.core.step`.

Across hosts, on a transport with two levels (:mod:`towers.comm.hierarchy`), a bucket is summed
exactly within the host first, in the hook that completes it (every rank of the host reaches
the same hooks in the same order, and the leader's sum between hosts can then start while
backward goes on); the host's leader reduces it with the transform among the leaders; once
that has arrived, the leader's result is shared within the host. The transform, and any
compression it applies, sees one rank per host; the metadata is summed exactly at every stage.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ...comm.base import Comm, Levels
from ...comm.hierarchy import share
from ...core.agree import BatchStamp
from ...core.step import (
    Finite,
    StepMeta,
    StepResult,
    apply_sums,
    assign_grads,
    both_finite,
    divide_on_device,
    finite_flag,
    mean_values,
)
from ...core.verdict import decide
from ..transforms import Bucket, BucketLayout, GradientTransform
from ..transforms.scatter import ScatterToOwners, owners_step

__all__ = [
    "DEFAULT_BUCKET_BYTES",
    "GPU_BUCKET_BYTES",
    "BucketPlan",
    "GradientSync",
    "bucket_bytes_for",
]

DEFAULT_BUCKET_BYTES = 4 * 1024 * 1024  # CPU workers: measured best on shared memory
GPU_BUCKET_BYTES = 25 * 1024 * 1024  # DDP's bucket_cap_mb: each bucket costs a few launches


def bucket_bytes_for(device: torch.device) -> int:
    """The default bucket size on ``device``: on a GPU every bucket costs kernel launches (its
    packing, its finite check, its division), which a 4 MiB bucket does not repay there."""
    return DEFAULT_BUCKET_BYTES if device.type == "cpu" else GPU_BUCKET_BYTES


def make_buckets(
    params: list[torch.Tensor], bucket_bytes: int, breaks: Sequence[int] = ()
) -> list[list[int]]:
    """Parameter indices per bucket: reverse order, one dtype and device each, ~``bucket_bytes``.

    No bucket holds parameters on both sides of a break (a parameter index that starts a group
    of parameters reduced on their own, such as a fragment of the model in Streaming DiLoCo).
    """
    buckets: list[list[int]] = []
    open_bucket: dict[tuple[torch.dtype, torch.device], list[int]] = {}
    size: dict[tuple[torch.dtype, torch.device], int] = {}
    starts = set(breaks)
    for i in reversed(range(len(params))):
        if i + 1 in starts:
            open_bucket.clear()
        p = params[i]
        key = (p.dtype, p.device)
        if key not in open_bucket:
            open_bucket[key], size[key] = [], 0
            buckets.append(open_bucket[key])
        open_bucket[key].append(i)
        size[key] += p.numel() * p.element_size()
        if size[key] >= bucket_bytes:
            del open_bucket[key]
    return buckets


@dataclass(frozen=True)
class BucketPlan:
    """Which parameters travel in which bucket: fixed for a model, whatever the group."""

    params: list[torch.Tensor]
    buckets: list[list[int]]  # parameter indices per bucket
    layouts: list[BucketLayout]

    @classmethod
    def of(
        cls, params: Sequence[torch.Tensor], bucket_bytes: int, breaks: Sequence[int] = ()
    ) -> BucketPlan:
        """``breaks``: indices (among the trainable parameters) where a bucket must end."""
        trainable = [p for p in params if p.requires_grad]
        buckets = make_buckets(trainable, bucket_bytes, breaks)
        layouts = []
        for b, indices in enumerate(buckets):
            ref, start, slots = trainable[indices[0]], 0, []
            for i in indices:
                slots.append((start, start + trainable[i].numel()))
                start += trainable[i].numel()
            shapes = tuple(tuple(trainable[i].shape) for i in indices)
            layout = BucketLayout(b, shapes, tuple(slots), ref.dtype, ref.device, tuple(indices))
            layouts.append(layout)
        return cls(trainable, buckets, layouts)


def _parts(bucket: Bucket) -> list[torch.Tensor]:
    """The tensors that hold a bucket's values: one where gradients and metadata lie together."""
    if bucket.whole is not None:
        return [bucket.whole]
    return [bucket.grads] if bucket.tail is None else [bucket.grads, bucket.tail]


class GradientSync:
    """Sums ``n_i * g_i`` over ranks for ``plan``'s parameters while backward runs.

    One instance serves one communicator; the transform's state is passed in and the next
    state returned by :meth:`finish`, so the caller decides when it is committed.
    """

    def __init__(
        self, plan: BucketPlan, comm: Comm, transform: GradientTransform, state: Any = None
    ):
        self.plan, self.params, self.buckets = plan, plan.params, plan.buckets
        self.comm, self.transform = comm, transform
        self.state = state  # the transform state this step starts from
        self.meta = StepMeta(comm.world_size, len(self.params))
        self.stamp = BatchStamp(comm.world_size)  # rides behind the meta (core/agree.py)
        self._no_stamp = torch.zeros(self.stamp.length, dtype=torch.float64)
        tail_length = self.meta.length + self.stamp.length
        last = len(self.buckets) - 1
        # The metadata rides in the last bucket when that bucket's dtype holds it exactly.
        self.meta_in_bucket = plan.layouts[last].dtype in (torch.float32, torch.float64)
        self.bucket_of = {i: b for b, indices in enumerate(self.buckets) for i in indices}
        self.buffers: list[torch.Tensor] = []  # each bucket's gradients, flattened
        self.slots: list[list[tuple[int, int, int]]] = []  # (param index, start, stop)
        self._storage: list[torch.Tensor] = []  # buffers, the last one with room for the meta
        for b, (indices, layout) in enumerate(zip(self.buckets, plan.layouts)):
            extra = tail_length if b == last and self.meta_in_bucket else 0
            storage = self._buffer(layout.numel + extra, self.params[indices[0]])
            self._storage.append(storage)
            self.buffers.append(storage[: layout.numel])
            self.slots.append([(i, a, z) for i, (a, z) in zip(indices, layout.slots)])
        self.handles = [
            p.register_post_accumulate_grad_hook(lambda _p, i=i: self._on_grad(i))
            for i, p in enumerate(self.params)
        ]
        self._armed = False
        # called when a gradient arrives unarmed; True if it armed this step (a backward the
        # caller did not arm, such as a script's own loss.backward())
        self.on_unarmed: Callable[[], bool] | None = None
        self.regroup = False  # whether the last finished step asked every rank to regroup
        self.defer = False  # decide steps on the device (towers.core.verdict), where it can
        # (a step decided there, its transform state after it): committed by settle()
        self._uncommitted: tuple[StepResult, Any] | None = None
        self._chosen: list[int] = []  # the buckets of the step in flight, in launch order
        self._checked = False  # whether the step in flight carries a batch stamp
        self._reset()

    def _buffer(self, numel: int, like: torch.Tensor) -> torch.Tensor:
        # A transport that sums in place (shared memory) lends its buffers: the gradients are
        # packed straight where the peers read them, saving a copy per bucket.
        lent = self.comm.buffer(numel, like.dtype) if like.device.type == "cpu" else None
        if lent is not None:
            return lent
        return torch.zeros(numel, dtype=like.dtype, device=like.device)

    def _reset(self) -> None:
        """Ready for the next step (``_scale``: what each gradient is multiplied by as it is
        packed)."""
        self._ready = [0] * len(self.buckets)
        self._launched = 0
        self._out: list[Bucket] = []
        self._next_state = self.state
        self._had_grad = torch.zeros(len(self.params), dtype=torch.float64)
        self._values: Mapping[int, torch.Tensor] | None = None  # reduced instead of .grad
        self._scale = 1
        self._finite: Finite = True  # every gradient packed so far (a tensor on a GPU)

    def commit(self, state: Any) -> None:
        """The transform state the next step starts from (the caller applied the last one)."""
        self.state = self._next_state = state
        self._uncommitted = None

    def settle(self) -> None:
        """Commit the state after the last step decided on the device if that step was
        applied, once its numbers are read (the next step's first bucket asks: its numbers
        were copied before the next step's kernels were queued, so they have usually arrived)."""
        pending, self._uncommitted = self._uncommitted, None
        if pending is not None and not pending[0].skipped:
            self.commit(pending[1])

    def remove(self) -> None:
        """Detach the hooks from the parameters."""
        for h in self.handles:
            h.remove()
        self.handles = []

    def arm(self, scale: int = 1) -> None:
        """The next backward is the last of this step: start averaging as gradients arrive.

        ``scale``: multiply each gradient by it as it is packed (the samples behind a mean
        loss that was backpropagated as it is, not times its samples)."""
        self._armed, self._scale = True, scale

    def _on_grad(self, index: int) -> None:
        if not self._armed and (self.on_unarmed is None or not self.on_unarmed()):
            return
        b = self.bucket_of[index]
        self._ready[b] += 1
        # The last bucket waits for finish(), which knows the step's meta.
        last = len(self.buckets) - 1
        while self._launched < last and self._ready[self._launched] >= len(
            self.buckets[self._launched]
        ):
            self._launch(self._launched)

    def _pack(self, b: int) -> None:
        buf = self.buffers[b]
        if self._values is None:
            grads = [self.params[i].grad for i, _, _ in self.slots[b]]
        else:
            grads = [self._values.get(i) for i, _, _ in self.slots[b]]
        if buf.device.type != "cpu" and all(g is not None for g in grads):
            # one kernel for the bucket: on a GPU, launches cost more than the copy itself
            torch.cat([g.reshape(-1) for g in grads if g is not None], out=buf)
            self._had_grad[[i for i, _, _ in self.slots[b]]] = 1.0
        else:
            for (i, start, stop), grad in zip(self.slots[b], grads, strict=True):
                if grad is None:
                    buf[start:stop].zero_()
                else:
                    buf[start:stop].copy_(grad.reshape(-1))
                    self._had_grad[i] = 1.0
        if self._scale != 1:
            buf.mul_(self._scale)
        self._finite = both_finite(self._finite, finite_flag(buf))

    def _reduce(self, bucket: Bucket) -> None:
        if self._uncommitted is not None:
            self.settle()
        levels = self.comm.levels
        if levels is None:
            out, self._next_state = self.transform.reduce(self._next_state, bucket, self.comm)
        else:
            out = self._reduce_in_levels(bucket, levels)
        self._out.append(out)
        self._launched = bucket.index + 1

    def _reduce_in_levels(self, bucket: Bucket, levels: Levels) -> Bucket:
        """Sum within the host, the transform among the leaders, then share (module doc)."""
        parts = _parts(bucket)
        for t in parts:
            levels.local.all_reduce_sum(t).wait()
        leader = levels.leaders is not None
        out = bucket
        if levels.leaders is not None:
            out, self._next_state = self.transform.reduce(self._next_state, bucket, levels.leaders)

        def shared(done: Bucket) -> Bucket:
            if leader:  # the transform may deliver its sums in tensors of its own
                for mine, got in ((bucket.grads, done.grads), (bucket.tail, done.tail)):
                    if mine is not None and got is not None and got.data_ptr() != mine.data_ptr():
                        mine.copy_(got)
            for t in parts:
                share(levels.local, t, leader).wait()
            return Bucket(bucket.index, bucket.grads, bucket.tail, bucket.whole)

        return out.then(shared)

    def _launch(self, b: int) -> None:
        self._pack(b)
        self._reduce(Bucket(b, self.buffers[b]))

    def _launch_last(self, meta: torch.Tensor, last: int, on_gpu: tuple[Any, Finite]) -> None:
        """Reduce the last bucket with ``meta`` (built on the CPU) behind it; ``on_gpu``: the
        loss sum and finite flag that are still GPU tensors, placed there without a wait."""
        grads = self.buffers[last]
        if grads.device.type != "cpu":  # pinned and non-blocking: the host does not wait
            meta = meta.pin_memory().to(grads.device, non_blocking=True)
            self.meta.place(meta, self.comm.rank, *on_gpu)
        if self.meta_in_bucket and last == len(self.buckets) - 1:
            whole = self._storage[last]
            tail = whole[grads.numel() :]
            tail.copy_(meta)
            self._reduce(Bucket(last, grads, tail, whole))
        else:
            self._reduce(Bucket(last, grads, meta))

    def finish(
        self,
        samples: int,
        loss_sum: float | torch.Tensor,
        stamp: torch.Tensor | None = None,
        regroup: bool = False,
    ) -> tuple[StepResult, Any]:
        """Complete the averaging; every rank must call this once per step.

        Args:
            samples: this tower's sample count for the step (0 for an empty tower).
            loss_sum: this tower's loss summed over its samples (mean loss times ``samples``).
            stamp: this rank's :class:`~towers.core.agree.BatchStamp` vector (step, global
                batch size, fingerprint), checked against the other ranks'; ``None``: unknown.
            regroup: ask every rank to regroup after this step (a replacement waits to join);
                afterwards :attr:`regroup` says, identically on every rank, whether any asked.

        Raises:
            ValueError: on every rank, if the ranks' stamps disagree.

        Returns:
            The step's outcome and the transform's state after it. Unless the step is skipped,
            each parameter's ``.grad`` holds the sample-weighted mean gradient (``None`` where
            no tower produced one).
        """
        self.launch(samples, loss_sum, stamp, regroup)
        result, state, _ = self.land()
        return result, state

    def launch(
        self,
        samples: int,
        loss_sum: float | torch.Tensor | None,
        stamp: torch.Tensor | None = None,
        regroup: bool = False,
        values: Mapping[int, torch.Tensor] | None = None,
        seconds: float = 0.0,
    ) -> None:
        """The first half of :meth:`finish`: pack and start reducing every bucket not yet
        started, the metadata in the last; :meth:`land` completes it.

        ``values``: reduce these tensors (by trainable-parameter index, shaped as the
        parameter) instead of the gradients, in the buckets that hold them (each wholly: e.g.
        one fragment of the model), the metadata riding in the last of them.
        """
        self._armed = False
        if values is None:
            chosen = list(range(len(self.buckets)))
            while self._launched < chosen[-1]:
                self._launch(self._launched)
        else:
            self._values = values
            chosen = [b for b, indices in enumerate(self.buckets) if indices[0] in values]
            assert chosen and all(all(i in values for i in self.buckets[b]) for b in chosen), (
                "values must fill whole buckets (break the buckets where they start)"
            )
            for b in chosen[:-1]:
                self._launch(b)
        last = chosen[-1]
        self._pack(last)
        # On a GPU the loss sum stays a tensor: reading it would wait for the whole backward.
        pending = None
        loss_ok: Finite
        if loss_sum is None:  # not seen (a script's own loss.backward()): its gradients tell
            loss_sum, loss_ok = math.nan, True
        elif isinstance(loss_sum, torch.Tensor) and loss_sum.device.type != "cpu":
            pending, loss_sum = loss_sum, 0.0
            loss_ok = finite_flag(pending)
        else:
            loss_ok = math.isfinite(loss_sum)
        finite = both_finite(self._finite, loss_ok)
        meta = self.meta.pack(
            self.comm.rank,
            samples,
            float(loss_sum),
            finite is False,
            self._had_grad,
            regroup,
            seconds,
        )
        self._checked = stamp is not None  # towers.train's loop builds the batches: no stamp
        meta = torch.cat([meta, stamp if stamp is not None else self._no_stamp])
        self._launch_last(meta, last, (pending if samples else None, finite))
        self._chosen = chosen

    def land(self) -> tuple[StepResult, Any, dict[int, torch.Tensor | None]]:
        """Wait for what :meth:`launch` started and decide the step (see :meth:`finish`);
        with ``values`` launched, their means are returned (flat, by parameter index) and no
        ``.grad`` is touched."""
        sums = [out.wait() for out in self._out]
        tail = sums[-1].tail
        assert tail is not None, "a gradient transform dropped the step's metadata"
        chosen = [(self.buffers[b], self.slots[b]) for b in self._chosen]
        for out, (buf, _) in zip(sums, chosen, strict=True):
            if out.grads.data_ptr() != buf.data_ptr():
                buf.copy_(out.grads)
        if self._decides_on_device():
            return self._land_pending(tail, chosen)
        finite, divided = None, tail.device.type != "cpu"
        if divided:  # the host waits once per step, with nothing left to queue but the update
            tail, finite = divide_on_device(tail, self.meta.world, [b for b, _ in chosen])
        if self._checked:
            try:
                self.stamp.check(tail[self.meta.length :])
            except ValueError:
                self._reset()
                raise
        tally = self.meta.read(tail[: self.meta.length])
        self.regroup = tally.regroup
        means: dict[int, torch.Tensor | None] = {}
        if self._values is None and isinstance(self.transform, ScatterToOwners):
            result = owners_step(self.transform, self.comm, tally, chosen, divided)
        elif self._values is None:
            result = apply_sums(self.params, tally, chosen, finite, divided)
        else:
            result, means = mean_values(tally, chosen, finite, divided)
        state = self._next_state
        self._reset()
        return result, state, means

    def _decides_on_device(self) -> bool:
        """Whether this step is decided without the host reading it (:mod:`towers.core.verdict`):
        where asked, for gradients (not values) summed whole (not for owners: the host fills
        the stand-ins), and where every parameter had a gradient here, so that none is left
        ``None`` by the sum. A transform's state is committed at the next step (:meth:`settle`)."""
        whole = self._values is None and not isinstance(self.transform, ScatterToOwners)
        return self.defer and whole and bool(self._had_grad.all())

    def _land_pending(
        self, tail: torch.Tensor, chosen: list[tuple[torch.Tensor, Any]]
    ) -> tuple[StepResult, Any, dict[int, torch.Tensor | None]]:
        """:meth:`land`, decided on the device: every ``.grad`` holds its mean (whatever it
        holds), and the result's ``ok`` says whether it may be applied."""
        result = decide(
            self.meta, tail, [b for b, _ in chosen], self.stamp if self._checked else None
        )
        every = [True] * len(self.params)  # every parameter had a gradient here
        for buf, slots in chosen:
            assign_grads(self.params, buf, slots, None, every)
        self.regroup = False
        if self._next_state is not self.state:
            self._uncommitted = (result, self._next_state)
        self._reset()
        return result, None, {}
