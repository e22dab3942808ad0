"""Synchronous engine: sample-weighted gradient averaging overlapped with backward, NaN guard.

Each tower backpropagates ``loss * n_i`` (its mean loss times its sample count), so its gradients
are n_i * g_i. Parameters are grouped into buckets in reverse registration order (roughly the
order backward produces their gradients); a ``register_post_accumulate_grad_hook`` on every
parameter marks it ready, and as soon as a bucket is complete it is flattened and its sum over
towers is started asynchronously while backward goes on. Buckets are launched strictly in index
order on every rank (as in DDP's reducer), so a rank whose gradients arrive in another order
still issues the same sequence of collectives.

After the last bucket, one small all-reduce carries per-tower sample counts, loss sums,
non-finite flags and which parameters got a gradient at all. Dividing the summed buckets by the
total count N gives sum(n_i g_i) / N, the gradient of the mean loss over the global batch. If any
tower's loss or gradient is not finite, every tower skips the update (all ranks see the same
all-reduced flags, so none diverges), and the culprits are named.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

from ._comm import Comm, Work

__all__ = ["GradientSync", "StepResult", "broadcast_module", "verify_same_model"]

DEFAULT_BUCKET_BYTES = 4 * 1024 * 1024


@dataclass
class StepResult:
    """What one synchronous step did, identical on every rank.

    Attributes:
        loss: the sample-weighted mean loss over all towers (before the update).
        tower_losses: each tower's mean loss (``nan`` for a tower that had no samples).
        tower_samples: each tower's sample count.
        skipped: whether the update was skipped because a loss or gradient was not finite.
        culprits: the towers whose loss or gradient was not finite.
    """

    loss: float
    tower_losses: list[float]
    tower_samples: list[int]
    skipped: bool = False
    culprits: list[int] = field(default_factory=list)

    @property
    def samples(self) -> int:
        return sum(self.tower_samples)


def all_finite(t: torch.Tensor) -> bool:
    """Whether every element of ``t`` is finite.

    A NaN or infinity makes the sum non-finite, so a finite sum proves it in one pass without
    a mask: ``isfinite(t).all()`` costs about 20 times as much on CPU (3.8 ms against 0.11 ms
    for 1.9M float32). Only a sum that overflows needs the exact check.
    """
    if not t.is_floating_point() and not t.is_complex():
        return True
    return bool(torch.isfinite(t.sum())) or bool(torch.isfinite(t).all())


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
        self.buckets = self._make_buckets(bucket_bytes)
        self.bucket_of = {}
        self.buffers: list[torch.Tensor] = []  # each bucket's gradients, flattened
        self.slots: list[list[tuple[int, int, int]]] = []  # (param index, start, stop)
        # Per-tower counts, loss sums and non-finite flags, and which parameters got a gradient:
        # carried in the tail of the last bucket, so that a step costs one collective per bucket
        # and no extra round trip (small all-reduces cost milliseconds over Gloo).
        self.meta_len = 3 * comm.world_size + len(self.params)
        last = len(self.buckets) - 1
        self.meta_in_bucket = self.params[self.buckets[last][0]].dtype in (
            torch.float32,
            torch.float64,
        )
        self._storage: list[torch.Tensor] = []  # buffers, the last one with room for the meta
        for b, indices in enumerate(self.buckets):
            ref = self.params[indices[0]]
            total = sum(self.params[i].numel() for i in indices)
            extra = self.meta_len if b == last and self.meta_in_bucket else 0
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
        self._reset()

    def _buffer(self, numel: int, like: torch.Tensor) -> torch.Tensor:
        # A transport that can sum its own buffers in place (shared memory) lends them: the
        # gradients are packed straight where the peers read them, saving a copy per bucket.
        lend = getattr(self.comm, "buffer", None)
        lent = lend(numel, like.dtype) if lend is not None and like.device.type == "cpu" else None
        if lent is not None:
            return lent
        return torch.zeros(numel, dtype=like.dtype, device=like.device)

    def _make_buckets(self, bucket_bytes: int) -> list[list[int]]:
        buckets: list[list[int]] = []
        open_bucket: dict[tuple[torch.dtype, torch.device], list[int]] = {}
        size: dict[tuple[torch.dtype, torch.device], int] = {}
        for i in reversed(range(len(self.params))):
            p = self.params[i]
            key = (p.dtype, p.device)
            if key not in open_bucket:
                open_bucket[key], size[key] = [], 0
                buckets.append(open_bucket[key])
            open_bucket[key].append(i)
            size[key] += p.numel() * p.element_size()
            if size[key] >= bucket_bytes:
                del open_bucket[key]
        return buckets

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

    def finish(self, samples: int, loss_sum: float) -> StepResult:
        """Complete the averaging; every rank must call this once per step.

        Args:
            samples: this tower's sample count for the step (0 for an empty tower).
            loss_sum: this tower's loss summed over its samples (mean loss times ``samples``).

        Returns:
            The step's outcome. Unless it is skipped, each parameter's ``.grad`` holds the
            sample-weighted mean gradient (``None`` where no tower produced one).
        """
        self._armed = False
        last = len(self.buckets) - 1
        while self._launched < last:
            self._launch(self._launched)
        self._pack(last)
        world, rank = self.comm.world_size, self.comm.rank
        bad_local = not math.isfinite(loss_sum) or self._bad_grad
        meta = torch.zeros(self.meta_len, dtype=torch.float64)
        meta[rank] = samples
        meta[world + rank] = loss_sum if samples > 0 else 0.0
        meta[2 * world + rank] = 1.0 if bad_local else 0.0
        meta[3 * world :] = self._had_grad
        if self.meta_in_bucket:
            tail = self._storage[last][-self.meta_len :]
            tail.copy_(meta)
            self._works.append(self.comm.all_reduce_sum(self._storage[last]))
        else:
            self._works.append(self.comm.all_reduce_sum(self.buffers[last]))
            tail = meta.to(self.buffers[last].device)
            self._works.append(self.comm.all_reduce_sum(tail))
        self._launched = last + 1
        for w in self._works:
            w.wait()
        meta = tail.double().cpu()
        counts = [round(c) for c in meta[:world].tolist()]
        sums = meta[world : 2 * world].tolist()
        culprits = [r for r, f in enumerate(meta[2 * world : 3 * world].tolist()) if f > 0]
        had_grad = meta[3 * world :].tolist()
        total = sum(counts)
        if total <= 0:
            raise ValueError("no tower had any samples in this step; every step needs >= 1")
        tower_losses = [s / c if c > 0 else math.nan for s, c in zip(sums, counts)]
        loss = sum(sums) / total
        reduced_ok = all(all_finite(buf) for buf in self.buffers)
        skipped = bool(culprits) or not reduced_ok
        if not skipped:
            for b, buf in enumerate(self.buffers):
                buf.div_(total)
                for i, start, stop in self.slots[b]:
                    p = self.params[i]
                    p.grad = buf[start:stop].view_as(p) if had_grad[i] > 0 else None
        self._reset()
        return StepResult(loss, tower_losses, counts, skipped, culprits)


def _signature(module: nn.Module) -> list[tuple[str, str, tuple[int, ...], str]]:
    sig = [("parameter", n, tuple(p.shape), str(p.dtype)) for n, p in module.named_parameters()]
    sig += [("buffer", n, tuple(b.shape), str(b.dtype)) for n, b in module.named_buffers()]
    return sig


def verify_same_model(module: nn.Module, comm: Comm) -> None:
    """Raise ``ValueError`` on every rank if any rank's parameters or buffers differ from rank 0's.

    The message names the first differing parameter or buffer and the rank it differs on.
    """
    sigs = comm.all_gather_object(_signature(module))
    ref = sigs[0]
    for rank, sig in enumerate(sigs[1:], start=1):
        if sig == ref:
            continue
        for k, (mine, theirs) in enumerate(zip(sig, ref)):
            if mine != theirs:
                kind, name, shape, dtype = theirs
                raise ValueError(
                    f"the model on rank {rank} differs from rank 0's at {kind} #{k}: rank 0 has "
                    f"{kind} {name!r} {list(shape)} {dtype}, rank {rank} has {mine[0]} "
                    f"{mine[1]!r} {list(mine[2])} {mine[3]}; every rank must build the same model"
                )
        shorter, longer = (sig, ref) if len(sig) < len(ref) else (ref, sig)
        kind, name, shape, _ = longer[len(shorter)]
        who = 0 if longer is ref else rank
        raise ValueError(
            f"the model on rank {rank} differs from rank 0's: {kind} {name!r} {list(shape)} exists "
            f"only on rank {who}; every rank must build the same model"
        )


def broadcast_module(module: nn.Module, comm: Comm, src: int = 0) -> None:
    """Copy ``src``'s parameters and buffers to every rank, one flat message per dtype."""
    tensors = [p.data for p in module.parameters()] + list(module.buffers())
    if comm.world_size == 1 or not tensors:
        return
    groups: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}
    for t in tensors:
        groups.setdefault((t.dtype, t.device), []).append(t)
    for group in groups.values():
        flat = torch.cat([t.reshape(-1) for t in group])
        comm.broadcast(flat, src)
        _unflatten_into(flat, group)


def _unflatten_into(flat: torch.Tensor, tensors: Sequence[torch.Tensor]) -> None:
    start = 0
    with torch.no_grad():
        for t in tensors:
            n = t.numel()
            t.copy_(flat[start : start + n].view_as(t))
            start += n
