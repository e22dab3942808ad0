"""Sample-weighted gradient averaging overlapped with backward.

Each tower backpropagates ``loss * n_i`` (its mean loss times its sample count), so its gradients
are n_i * g_i. Parameters are grouped into buckets in reverse registration order (roughly the
order backward produces their gradients); a ``register_post_accumulate_grad_hook`` on every
parameter marks it ready, and as soon as a bucket is complete it is flattened and its sum over
towers is started asynchronously while backward goes on. Buckets are launched strictly in index
order on every rank (as in DDP's reducer), so a rank whose gradients arrive in another order
still issues the same sequence of collectives.

The step's metadata (:class:`~towers.core.step.StepMeta`: sample counts, loss sums, non-finite
flags, which parameters got a gradient) travels in the tail of the last bucket, so a step costs
one collective per bucket and no extra round trip. The arithmetic on the summed values (the
division by N, the culprits, ``None`` gradients) lives in :mod:`towers.core.step`.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch

from ...comm.base import Comm, Work
from ...core.agree import BatchStamp
from ...core.step import StepMeta, StepResult, all_finite, assign_grads, step_result

__all__ = ["DEFAULT_BUCKET_BYTES", "GradientSync"]

DEFAULT_BUCKET_BYTES = 4 * 1024 * 1024


def make_buckets(params: list[torch.Tensor], bucket_bytes: int) -> list[list[int]]:
    """Parameter indices per bucket: reverse order, one dtype and device each, ~``bucket_bytes``."""
    buckets: list[list[int]] = []
    open_bucket: dict[tuple[torch.dtype, torch.device], list[int]] = {}
    size: dict[tuple[torch.dtype, torch.device], int] = {}
    for i in reversed(range(len(params))):
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


class GradientSync:
    """Sums ``n_i * g_i`` over ranks for ``params`` while backward runs; see the module doc."""

    def __init__(
        self,
        params: Iterable[torch.Tensor],
        comm: Comm,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    ):
        self.params = [p for p in params if p.requires_grad]
        self.comm = comm
        self.buckets = make_buckets(self.params, bucket_bytes)
        self.meta = StepMeta(comm.world_size, len(self.params))
        self.stamp = BatchStamp(comm.world_size)  # rides behind the meta (core/agree.py)
        self._no_stamp = torch.zeros(self.stamp.length, dtype=torch.float64)
        tail_length = self.meta.length + self.stamp.length
        last = len(self.buckets) - 1
        # The metadata rides in the last bucket when that bucket's dtype holds it exactly.
        self.meta_in_bucket = self.params[self.buckets[last][0]].dtype in (
            torch.float32,
            torch.float64,
        )
        self.bucket_of: dict[int, int] = {}
        self.buffers: list[torch.Tensor] = []  # each bucket's gradients, flattened
        self.slots: list[list[tuple[int, int, int]]] = []  # (param index, start, stop)
        self._storage: list[torch.Tensor] = []  # buffers, the last one with room for the meta
        for b, indices in enumerate(self.buckets):
            ref = self.params[indices[0]]
            total = sum(self.params[i].numel() for i in indices)
            extra = tail_length if b == last and self.meta_in_bucket else 0
            storage = self._buffer(total + extra, ref)
            self._storage.append(storage)
            self.buffers.append(storage[:total])
            start, slots = 0, []
            for i in indices:
                n = self.params[i].numel()
                slots.append((i, start, start + n))
                start += n
                self.bucket_of[i] = b
            self.slots.append(slots)
        self.handles = [
            p.register_post_accumulate_grad_hook(lambda _p, i=i: self._on_grad(i))
            for i, p in enumerate(self.params)
        ]
        self._armed = False
        self.regroup = False  # whether the last finished step asked every rank to regroup
        self._reset()

    def _buffer(self, numel: int, like: torch.Tensor) -> torch.Tensor:
        # A transport that sums in place (shared memory) lends its buffers: the gradients are
        # packed straight where the peers read them, saving a copy per bucket.
        lent = self.comm.buffer(numel, like.dtype) if like.device.type == "cpu" else None
        if lent is not None:
            return lent
        return torch.zeros(numel, dtype=like.dtype, device=like.device)

    def _reset(self) -> None:
        self._ready = [0] * len(self.buckets)
        self._launched = 0
        self._works: list[Work] = []
        self._had_grad = torch.zeros(len(self.params), dtype=torch.float64)
        self._bad_grad = False

    def remove(self) -> None:
        """Detach the hooks from the parameters."""
        for h in self.handles:
            h.remove()
        self.handles = []

    def arm(self) -> None:
        """The next backward is the last of this step: start averaging as gradients arrive."""
        self._armed = True

    def _on_grad(self, index: int) -> None:
        if not self._armed:
            return
        b = self.bucket_of[index]
        self._ready[b] += 1
        # The last bucket waits for finish(), which knows the step's meta.
        hook_launchable = len(self.buckets) - (1 if self.meta_in_bucket else 0)
        while self._launched < hook_launchable and self._ready[self._launched] >= len(
            self.buckets[self._launched]
        ):
            self._launch(self._launched)

    def _pack(self, b: int) -> None:
        buf = self.buffers[b]
        for i, start, stop in self.slots[b]:
            grad = self.params[i].grad
            if grad is None:
                buf[start:stop].zero_()
            else:
                buf[start:stop].copy_(grad.reshape(-1))
                self._had_grad[i] = 1.0
        self._bad_grad = self._bad_grad or not all_finite(buf)

    def _launch(self, b: int) -> None:
        self._pack(b)
        self._works.append(self.comm.all_reduce_sum(self.buffers[b]))
        self._launched = b + 1

    def finish(
        self,
        samples: int,
        loss_sum: float,
        stamp: torch.Tensor | None = None,
        regroup: bool = False,
    ) -> StepResult:
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
            The step's outcome. Unless it is skipped, each parameter's ``.grad`` holds the
            sample-weighted mean gradient (``None`` where no tower produced one).
        """
        self._armed = False
        last = len(self.buckets) - 1
        while self._launched < last:
            self._launch(self._launched)
        self._pack(last)
        bad = not math.isfinite(loss_sum) or self._bad_grad
        meta = self.meta.pack(self.comm.rank, samples, loss_sum, bad, self._had_grad, regroup)
        checked = stamp is not None  # towers.train's loop builds the batches itself: no stamp
        meta = torch.cat([meta, stamp if stamp is not None else self._no_stamp])
        if self.meta_in_bucket:
            tail = self._storage[last][-len(meta) :]
            tail.copy_(meta)
            self._works.append(self.comm.all_reduce_sum(self._storage[last]))
        else:
            self._works.append(self.comm.all_reduce_sum(self.buffers[last]))
            tail = meta.to(self.buffers[last].device)
            self._works.append(self.comm.all_reduce_sum(tail))
        self._launched = last + 1
        for w in self._works:
            w.wait()
        if checked:
            try:
                self.stamp.check(tail[self.meta.length :])
            except ValueError:
                self._reset()
                raise
        tally = self.meta.read(tail[: self.meta.length])
        self.regroup = tally.regroup
        result = step_result(tally, all(all_finite(buf) for buf in self.buffers))
        if not result.skipped:
            for buf, slots in zip(self.buffers, self.slots):
                assign_grads(self.params, buf, slots, tally.total, tally.had_grad)
        self._reset()
        return result
