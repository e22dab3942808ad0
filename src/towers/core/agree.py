"""Do all ranks train on the same global batch? Pure arithmetic for a check that costs nothing.

In the own loop every rank builds its global batches itself and :meth:`Context.shards` cuts its
part out. If the ranks' batches differ (a per-rank seed for shuffling or data generation, a
``DistributedSampler`` left over from a DDP script, which hands every rank a different subset),
the gradients are still averaged and nothing fails: the model silently trains on the wrong data.

Each rank can know three things about the step without talking to the others: how many steps it
has taken, how many samples its global batch holds, and a fingerprint of that batch (a hash of a
few bytes sampled from every tensor, :func:`fingerprint`). :class:`BatchStamp` lays them out in
one float64 vector per rank, slot ``r`` for rank ``r``, so that the *sum* over ranks (the
all-reduce the step already does) holds every rank's values; the vector rides in the step's
metadata, so the check adds no round trip. A value of 0 means unknown (a rank that did not get
its shard from ``shards()``) and is not compared.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from .split import leaves

__all__ = ["BatchStamp", "fingerprint", "key_code", "mean_vector", "weighted_means"]

_PROBES = 16  # elements sampled from each tensor
# Values stay below 2**24, so they survive a float32 bucket exactly (one nonzero rank per slot).
_MOD = 2**24 - 1


def fingerprint(batch: Any) -> int:
    """A hash in ``[1, 2**24)`` of the shapes, dtypes and ``16`` evenly spaced elements of every
    tensor of ``batch``: equal batches agree, different ones almost surely do not.

    Costs microseconds whatever the batch size (it reads 16 elements per tensor).
    """
    h = hashlib.blake2b(digest_size=8)
    for _, leaf in leaves(batch):
        t = torch.as_tensor(leaf).detach()
        h.update(f"{tuple(t.shape)}{t.dtype}".encode())
        flat = t.reshape(-1)
        if flat.numel():
            idx = torch.linspace(0, flat.numel() - 1, min(_PROBES, flat.numel())).long()
            probe = flat[idx.to(flat.device)].cpu()
            h.update(probe.numpy().tobytes() if probe.dtype != torch.bfloat16 else b"")
    return int.from_bytes(h.digest(), "little") % (_MOD - 1) + 1


def key_code(keys: list[str]) -> int:
    """A number in ``[1, 2**20]`` naming a set of metric names, to check that ranks agree."""
    digest = hashlib.blake2b("\0".join(keys).encode(), digest_size=4).digest()
    return int.from_bytes(digest, "little") % 2**20 + 1


@dataclass(frozen=True)
class BatchStamp:
    """Where each rank's step counter, global batch size and fingerprint sit in a vector.

    Three blocks of ``world`` slots; rank r writes slot r of each (its value + 1 for the step
    counter, so that 0 stays "unknown"), the others stay 0.
    """

    world: int

    @property
    def length(self) -> int:
        return 3 * self.world

    def pack(self, rank: int, step: int, size: int | None, mark: int | None) -> torch.Tensor:
        v = torch.zeros(self.length, dtype=torch.float64)
        v[rank] = step % _MOD + 1
        v[self.world + rank] = size or 0
        v[2 * self.world + rank] = mark or 0
        return v

    def agrees(self, summed: torch.Tensor) -> torch.Tensor:
        """:meth:`check`'s condition where ``summed`` is, read by nobody: every rank at the same
        step, and every rank with samples on the same batch size and fingerprint (a 0-dim
        bool tensor)."""
        w = self.world
        steps, sizes, marks = summed[:w], summed[w : 2 * w], summed[2 * w :]
        first = torch.argmax(sizes)
        same = (sizes == sizes[first]) & (marks == marks[first])
        return (steps == steps[0]).all() & (same | (sizes == 0)).all()

    def check(self, summed: torch.Tensor) -> None:
        """Raise ``ValueError`` (the same on every rank) unless the known values agree."""
        values = [round(x) for x in summed.double().cpu().tolist()]
        w = self.world
        steps, sizes, marks = values[:w], values[w : 2 * w], values[2 * w :]
        if len(set(steps)) > 1:
            listing = ", ".join(f"rank {r}: {s - 1}" for r, s in enumerate(steps))
            raise ValueError(
                f"the ranks are at different steps ({listing}): every rank must call "
                "ctx.backward() or ctx.step() once per global batch, in the same order. Look "
                "for a step taken on some ranks only (e.g. under `if ctx.rank == 0`) or data of "
                "different lengths per rank; a rank with no samples passes loss=None, samples=0"
            )
        known = [(r, n, m) for r, (n, m) in enumerate(zip(sizes, marks)) if n > 0]
        if len({(n, m) for _, n, m in known}) > 1:
            listing = ", ".join(f"rank {r}: {n} samples, fingerprint {m:08x}" for r, n, m in known)
            raise ValueError(
                f"step {steps[0] - 1}: the ranks are not on the same global batch ({listing})"
                f"{_odd_ones(known)}. Every rank must build the same global batches in the same "
                "order and pass them to ctx.shards() or ctx.shard(), which give each rank its "
                "part. Likely causes: a random draw made on some ranks only (an evaluation on "
                "rank 0 that draws from the global RNG, as nanoGPT's estimate_loss under `if "
                "master_process`: put @torch.random.fork_rng() on the evaluation function, so "
                "that it leaves the global RNG as it found it, or draw the batches from a "
                "generator of their own, torch.Generator().manual_seed(seed), or evaluate on "
                "every rank with ctx.evaluate); a seed that depends on the rank (seed "
                "shuffling and data generation the same on every rank); or a DistributedSampler "
                "left from a DDP script (remove it: ctx.shards() does the split)"
            )


def _odd_ones(known: list[tuple[int, int, int]]) -> str:
    """Where most ranks agree, the ones that do not, for the message."""
    counts: dict[tuple[int, int], int] = {}
    for _, n, m in known:
        counts[(n, m)] = counts.get((n, m), 0) + 1
    common, most = max(counts.items(), key=lambda kv: kv[1])
    if most * 2 <= len(known):
        return ""
    odd = [r for r, n, m in known if (n, m) != common]
    return f": rank(s) {', '.join(map(str, odd))} drew another batch than the others"


def weighted_means(values: Mapping[str, Any], summed: torch.Tensor, world: int) -> dict[str, float]:
    """Read the sum over ranks of ``[samples, key_code, samples * v for v in values]``.

    Raises:
        ValueError: if the ranks passed different metric names.
    """
    keys = sorted(values)
    total, code = float(summed[0]), float(summed[1])
    if not math.isclose(code, world * key_code(keys)):
        raise ValueError(
            f"ctx.mean() got different metric names on different ranks (this rank: {keys}); "
            "every rank must pass the same keys"
        )
    if total <= 0:
        return {k: math.nan for k in keys}
    return {k: float(summed[2 + i]) / total for i, k in enumerate(keys)}


def mean_vector(values: Mapping[str, Any], samples: int) -> torch.Tensor:
    """This rank's contribution to :func:`weighted_means` (``ctx.mean``'s arguments checked)."""
    if not isinstance(values, Mapping):
        raise TypeError(f"ctx.mean() takes a dict of metrics, got {type(values).__name__}")
    if isinstance(samples, bool) or not isinstance(samples, int) or samples < 0:
        raise ValueError(f"samples must be an int >= 0, got {samples!r}")
    keys = sorted(values)
    out = np.zeros(2 + len(keys))
    out[0], out[1] = samples, key_code(keys)
    if samples > 0:
        for i, k in enumerate(keys):
            v = values[k]
            if isinstance(v, torch.Tensor) and v.numel() != 1:
                raise ValueError(
                    f"ctx.mean(): {k!r} is a tensor of shape {list(v.shape)}; pass one number "
                    "per metric (the mean over this rank's samples), e.g. loss.detach()"
                )
            out[2 + i] = samples * float(v)
    return torch.from_numpy(out)
