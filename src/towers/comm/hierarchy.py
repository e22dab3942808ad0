"""Summing across hosts in two levels: within each host, then among one leader per host.

A job of H hosts with several CPU workers on some of them sums a tensor in three stages:

1. within each host, exactly, through shared memory (:class:`~towers.comm.shm.ShmComm`; the
   host's own process group where shared memory cannot be had);
2. among the hosts' leaders (each host's lowest rank), over Gloo;
3. within each host again: the leader's result goes to the others.

Only stage 2 crosses between hosts, and it is an all-reduce among H ranks whatever the number
of workers per host. A flat sum over all ranks makes every worker part of the traffic between
hosts: the all-to-all of a compressed sum sends each worker's part to every worker on the other
hosts, W times what one leader per host sends, and each of a ring's links between hosts carries
about twice the message (docs/performance.md, "Two hosts", measures both). Stage 3 is a sum as
well: the other ranks zero their tensor and add the leader's (``x + 0`` is ``x`` exactly, so
every rank holds the leader's bytes); it needs no other primitive and, on lent buffers, reads
and writes each byte once.

:func:`two_levels` decides once, when a job connects (``transport="auto"``, CPU workers on
Gloo), from every rank's :func:`~towers.comm.segment.host_key`: the ranks are grouped by host,
one process group per host with several ranks and one among the leaders. :class:`HierComm` is a
:class:`~towers.comm.base.Comm` like any other (its sums take the three stages; broadcasts,
object messages and barriers go through the job's own process group) and offers its
:class:`~towers.comm.base.Levels`, so that the gradient step
(:mod:`towers.engines.sync.gradsync`) runs the job's gradient transform (a compression) in
stage 2 only: within a host, sums stay exact.

Elastic jobs do not come here: across hosts they sum over their process group
(:mod:`towers.comm.elastic`).
"""

from __future__ import annotations

import collections
from collections.abc import Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from .base import Comm, DistComm, Levels, LocalComm, Work
from .hang import CallMismatch
from .shm import ShmComm, ShmUnavailable

__all__ = ["HierComm", "by_host", "share", "two_levels"]


def by_host(keys: Sequence[str]) -> list[list[int]]:
    """The ranks on each host, given every rank's host key; hosts in order of their lowest rank.

    Example:
        >>> by_host(["a", "b", "a", "b"])
        [[0, 2], [1, 3]]
    """
    hosts: dict[str, list[int]] = {}
    for rank, key in enumerate(keys):
        hosts.setdefault(key, []).append(rank)
    return list(hosts.values())


def share(local: Comm, tensor: torch.Tensor, leader: bool) -> Work:
    """Start giving every rank of ``local`` the leader's ``tensor`` (stage 3, module doc).

    A collective: the leader passes ``leader=True``, every other rank its own tensor of the same
    size, which is overwritten.
    """
    if not leader:
        tensor.zero_()
    return local.all_reduce_sum(tensor)


class _Sum:
    """One sum in flight: stage 1 is done; stage 2 (on a leader) in ``across``."""

    def __init__(self, comm: HierComm, tensor: torch.Tensor, across: Work | None):
        self.comm, self.tensor, self.across = comm, tensor, across
        self.done = False

    def wait(self) -> bool:
        self.comm._complete(self)
        return True

    def finish(self) -> None:
        levels = self.comm.levels
        if self.across is not None:
            self.across.wait()
        share(levels.local, self.tensor, levels.leaders is not None).wait()
        self.done = True


class HierComm:
    """A :class:`~towers.comm.base.Comm` over several hosts whose sums take two levels.

    Built by :func:`two_levels`. ``all_reduce_sum`` sums within the host at once (every rank of
    the host reaches it in the same order), starts the leaders' sum and returns; ``wait()``
    completes the sums in launch order, as :class:`~towers.comm.shm.ShmComm` does. The other
    collectives go through ``base``, the job's process group, after the pending sums.
    """

    def __init__(self, base: DistComm, levels: Levels, groups: Sequence[Any] = ()):
        self.base = base
        self.levels: Levels = levels
        self.rank, self.world_size = base.rank, base.world_size
        self._groups = list(groups)  # the process groups made for the levels: closed with us
        self._pending: collections.deque[_Sum] = collections.deque()

    def all_reduce_sum(self, tensor: torch.Tensor) -> Work:
        levels = self.levels
        levels.local.all_reduce_sum(tensor).wait()
        across = None if levels.leaders is None else levels.leaders.all_reduce_sum(tensor)
        op = _Sum(self, tensor, across)
        self._pending.append(op)
        return op

    def _complete(self, op: _Sum) -> None:
        while not op.done:
            self._pending[0].finish()
            self._pending.popleft()

    def _drain(self) -> None:
        if self._pending:
            self._complete(self._pending[-1])

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> None:
        self._drain()
        self.base.broadcast(tensor, src)

    def all_to_all(self, output: torch.Tensor, input: torch.Tensor) -> Work:
        self._drain()
        return self.base.all_to_all(output, input)

    def all_gather(self, output: torch.Tensor, input: torch.Tensor) -> Work:
        self._drain()
        return self.base.all_gather(output, input)

    def all_gather_object(self, obj: Any) -> list[Any]:
        self._drain()
        return self.base.all_gather_object(obj)

    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        self._drain()
        return self.base.broadcast_object(obj, src)

    def barrier(self) -> None:
        self._drain()
        self.base.barrier()

    def agree_call(self, what: str) -> None:
        """Through the job's rendezvous store, which spans every rank (no collective)."""
        self.base.agree_call(what)

    def mismatched_calls(self) -> CallMismatch | None:
        return self.base.mismatched_calls()

    def buffer(self, numel: int, dtype: torch.dtype) -> torch.Tensor | None:
        """A buffer this host's shared memory sums in place (stages 1 and 3), or ``None``."""
        return self.levels.local.buffer(numel, dtype)

    def close(self) -> None:
        """Finish pending sums, release the host's shared memory and the levels' groups."""
        try:
            self._drain()
        finally:
            self.levels.local.close()
            if self.levels.leaders is not None:
                self.levels.leaders.close()
            for group in self._groups:
                dist.destroy_process_group(group)
            self._groups = []


class _Part(DistComm):
    """The process group of one level (a host's ranks, or the leaders): when a rank gives up
    waiting in it, the job's store (which spans every rank) tells whether the ranks were in
    different calls (:mod:`towers.comm.hang`); the level's own group has no store of its own."""

    def __init__(self, group: Any, timeout: float, job: DistComm):
        super().__init__(group, timeout, secret=job.secret)
        self.job = job

    def mismatched_calls(self) -> CallMismatch | None:
        return self.job.mismatched_calls()

    def name_stuck(self, exc: BaseException) -> BaseException:
        mismatch = self.job.mismatched_calls()
        return exc if mismatch is None else mismatch


def two_levels(base: DistComm, hosts: list[list[int]], timeout: float) -> Comm:
    """``base`` summed in two levels over ``hosts`` (:func:`by_host`); ``base`` itself when no
    host has more than one rank (a flat sum already crosses once per host).

    A collective over every rank of ``base``: each makes the same process groups, in the same
    order (one per host with several ranks, then the leaders').
    """
    if all(len(ranks) == 1 for ranks in hosts):
        return base
    wait = timedelta(seconds=timeout)
    rank = base.rank
    groups, local, leaders = [], None, None
    for ranks in hosts:
        if len(ranks) > 1:
            group = dist.new_group(ranks, timeout=wait, backend="gloo")
            if rank in ranks:
                groups.append(group)
                local = _Part(group, timeout, base)
    heads = [ranks[0] for ranks in hosts]
    group = dist.new_group(heads, timeout=wait, backend="gloo")
    if rank in heads:
        groups.append(group)
        leaders = _Part(group, timeout, base)
    return HierComm(base, Levels(_fast(local, timeout), leaders, len(hosts)), groups)


def _fast(local: DistComm | None, timeout: float) -> Comm:
    """This host's ranks over shared memory, else their process group (a lone rank: itself)."""
    if local is None:
        return LocalComm()
    try:
        return ShmComm(local, timeout=timeout)
    except ShmUnavailable:  # on every rank of the host alike
        return local
