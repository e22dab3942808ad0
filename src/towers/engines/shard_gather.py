"""The gather after a sharded step: every rank's updated parts into every rank's parameters.

On one host a transport that sums in shared memory lends a buffer: each rank writes its parts
and the sum, where only the owner is not zero, is every part. Over a process group (across
hosts, or ``transport="gloo"``) the parts go by all-gathers of :data:`PIECE` elements a rank,
several started at a time; on a GPU, fewer and larger calls.
"""

from __future__ import annotations

import bisect
import collections
import itertools
from collections.abc import Sequence
from typing import Any

import torch

from ..comm.base import Comm
from .shard_rules import Part

__all__ = ["GATHER_ELEMENTS", "IN_FLIGHT", "PIECE", "Gathers"]

GATHER_ELEMENTS = 1 << 20  # elements per gather call, over all ranks: bounds its buffer
GATHER_ELEMENTS_GPU = 1 << 26  # on a GPU: fewer, larger calls (256 MiB of float32)
PIECE = 1 << 15
"""Elements each rank sends in one call over a process group on CPUs (128 KiB of float32),
with up to :data:`IN_FLIGHT` calls started: the link stays busy in both directions, while no
call queues so much that the acknowledgements of the other direction wait behind it (one call
of a model's whole part, on a 100 Mbit/s link with a deep queue, went at half its speed)."""
IN_FLIGHT = 8


class Gathers:
    """The gathers of one sharding's parameters ``params`` on rank ``rank`` of ``world``, with
    the buffers a transport lent for them (one per dtype, asked for once)."""

    def __init__(self, params: Sequence[torch.Tensor], rank: int, world: int):
        self.params, self.rank, self.world = params, rank, world
        self.buffers: dict[torch.dtype, torch.Tensor | None] = {}

    def run(
        self,
        comm: Comm,
        parts: list[list[Part]],
        indices: set[int],
        params: Sequence[torch.Tensor],
    ) -> None:
        """Every rank's ``parts`` of the parameters ``indices`` into ``params`` (one tensor per
        parameter, each of its shape)."""
        by_dtype: dict[torch.dtype, list[list[Part]]] = {}
        for rank, owned in enumerate(parts):
            for part in owned:
                if part.index in indices:
                    dtype = self.params[part.index].dtype
                    by_dtype.setdefault(dtype, [[] for _ in range(self.world)])[rank].append(part)
        for dtype in sorted(by_dtype, key=str):  # the same order on every rank
            lent = self._lent(comm, dtype, parts)
            self._gather(comm, by_dtype[dtype], dtype, params, lent)

    def _gather(
        self,
        comm: Comm,
        parts: list[list[Part]],
        dtype: torch.dtype,
        params: Sequence[torch.Tensor],
        lent: torch.Tensor | None,
    ) -> None:
        width = max(sum(part.size for part in ps) for ps in parts)
        runs = [_Run(ps) for ps in parts]
        if lent is not None:
            self._gather_lent(comm, runs, width, lent, params)
        else:
            self._gather_sent(comm, runs, width, dtype, params)

    def _gather_lent(
        self,
        comm: Comm,
        runs: list[_Run],
        width: int,
        lent: torch.Tensor,
        params: Sequence[torch.Tensor],
    ) -> None:
        """Shared memory: chunk by chunk, a sum in place where only the owner is not zero."""
        step = max(1, GATHER_ELEMENTS // self.world)
        for begin in range(0, width, step):
            n = min(step, width - begin)
            out = lent[: n * self.world]
            out.zero_()
            mine = out[self.rank * n : (self.rank + 1) * n]
            self._copy(runs[self.rank], mine, begin, params, out=True)
            comm.all_reduce_sum(out).wait()
            for rank in range(self.world):  # the owner too: -0.0 arrives as +0.0 everywhere
                self._copy(runs[rank], out[rank * n : (rank + 1) * n], begin, params, out=False)

    def _gather_sent(
        self,
        comm: Comm,
        runs: list[_Run],
        width: int,
        dtype: torch.dtype,
        params: Sequence[torch.Tensor],
    ) -> None:
        """A process group: all-gathers of :data:`PIECE` elements a rank, :data:`IN_FLIGHT` of
        them started at a time (on a GPU, one at a time, of up to 64 M elements over all
        ranks: its buffer stays bounded)."""
        device = self.params[0].device
        gpu = device.type == "cuda"
        step = max(1, GATHER_ELEMENTS_GPU // self.world) if gpu else PIECE
        most = 1 if gpu else IN_FLIGHT  # on a GPU the calls queue on one stream anyway
        started: collections.deque[tuple[int, torch.Tensor, Any]] = collections.deque()

        def land() -> None:
            begin, out, work = started.popleft()
            work.wait()
            n = out.numel() // self.world
            for rank in range(self.world):
                if rank != self.rank:
                    self._copy(runs[rank], out[rank * n : (rank + 1) * n], begin, params, out=False)

        for begin in range(0, width, step):
            n = min(step, width - begin)
            chunk = torch.zeros(n, dtype=dtype, device=device)
            self._copy(runs[self.rank], chunk, begin, params, out=True)
            out = torch.empty(n * self.world, dtype=dtype, device=device)
            started.append((begin, out, comm.all_gather(out, chunk)))
            if len(started) >= most:
                land()
        while started:
            land()

    def _lent(self, comm: Comm, dtype: torch.dtype, parts: list[list[Part]]) -> torch.Tensor | None:
        """A buffer that ``comm`` sums in place (shared memory, on one host), for gathers of
        ``dtype`` over ``parts`` (every rank's): a collective, asked once per dtype; ``None``
        where the transport lends none or the ranks span hosts (a sum between hosts would move
        twice an all-gather's bytes)."""
        if dtype not in self.buffers:
            widest = max(sum(part.size for part in ps) for ps in parts)
            n = min(widest, max(1, GATHER_ELEMENTS // self.world)) * self.world
            usable = dtype.is_floating_point and comm.levels is None
            self.buffers[dtype] = comm.buffer(n, dtype) if usable else None
        return self.buffers[dtype]

    def _copy(
        self,
        run: _Run,
        chunk: torch.Tensor,
        begin: int,
        params: Sequence[torch.Tensor],
        *,
        out: bool,
    ) -> None:
        """Elements ``[begin, begin + len(chunk))`` of a rank's parts, laid end to end: into
        ``chunk`` (``out``: this rank's, to send) or from it into the parameters. Only the
        parts that overlap them are visited (a model of many parameters gathers in many
        chunks)."""
        end = begin + chunk.numel()
        for k in range(max(0, bisect.bisect_right(run.starts, begin) - 1), len(run.parts)):
            at, part = run.starts[k], run.parts[k]
            if at >= end:
                break
            lo, hi = max(at, begin), min(at + part.size, end)
            if lo < hi:
                a = part.start + lo - at
                flat = params[part.index].detach().view(-1)[a : a + hi - lo]
                there = chunk[lo - begin : hi - begin]
                (there if out else flat).copy_(flat if out else there)


class _Run:
    """A rank's parts laid end to end, with where each starts among its elements."""

    def __init__(self, parts: list[Part]):
        self.parts = parts
        self.starts = list(itertools.accumulate((p.size for p in parts[:-1]), initial=0))
