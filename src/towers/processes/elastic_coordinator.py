"""Node 0's part in an elastic job across hosts: the generations, the losses and the nodes.

Every node's ``towers run --elastic`` is a member (:class:`~towers.processes.elastic_nodes.Nodes`:
it supervises its own workers, posts their losses and beats); node 0's also coordinates, with
the :class:`Coordinator` here. It publishes the generations of members
(:class:`~towers.processes.elastic_members.Generations`), reads every node's loss notices and
publishes the next generation without the lost, lets in newcomers at the members' next step,
and watches every node's heartbeat: a node silent for the node timeout is dropped with its
workers, and a node that comes back, or joins the running job, is watched again. The store's
keys are named in :mod:`towers.comm.protocol`.
"""

from __future__ import annotations

import sys
import time
from typing import Any

from ..comm import protocol
from ..core.secret import JobSecret
from .elastic_members import Generations
from .spawn import WorkerError

__all__ = ["Coordinator"]


class Coordinator:
    """Node 0's coordination of a job of ``nnodes`` nodes (up to ``most``) of ``nproc`` workers
    each, over the ``store`` node 0 hosts at ``where``; ``silence``: a node silent this long is
    dropped; ``timeout``: how long a node may take to connect at all."""

    def __init__(
        self,
        store: Any,
        signer: JobSecret | None,
        nproc: int,
        nnodes: int,
        most: int,
        silence: float,
        timeout: float,
        where: str,
    ):
        self.store, self.nproc, self.most = store, nproc, most
        self.workers = nproc * nnodes  # the first ids; newcomers' come after
        self.silence, self.timeout, self.where = silence, timeout, where
        self.generations = Generations(store, signer)
        self.seen = 0  # notices read
        self.gone: set[int] = set()  # every worker lost, job-wide
        self.node_beats: dict[int, tuple[int, float]] = {}
        self.nodes_done: set[int] = set()
        self.away: set[int] = set()  # nodes dropped, until they come back
        self.watched = set(range(nnodes))  # the nodes node 0 waits for: those in the job
        self.launched = time.monotonic()

    def start(self) -> None:
        """Publish the first generation: every node's first workers."""
        self.generations.publish(list(range(self.workers)))

    def busy(self) -> bool:
        """Whether a node it watches still has workers (node 0 keeps the store up till then)."""
        return not self.watched <= self.nodes_done

    def read_notices(self) -> None:
        """Drop the workers that the nodes' notices since the last call report lost."""
        total = self.store.add(protocol.NOTICES, 0)
        while self.seen < total:
            name = protocol.notice(self.seen + 1)
            if not self.store.check([name]):
                return  # still being written
            told = protocol.Notice.loads(self.store.get(name))
            self.seen += 1
            self.forget(told.dead, told.at)

    def forget(self, wid: int, at: float, why: str = "") -> None:
        if wid not in self.gone:
            self.gone.add(wid)
            if why:  # it may still run: tell it, before it can see the generation without it
                self.store.set(protocol.lost(wid), protocol.Lost(at, why).dumps())
            self.generations.drop(wid, at)

    def admit(self) -> None:
        """Let in the newcomers whose ids the nodes gave out, at the members' next step."""
        for new in range(self.workers, self.workers + self.store.add(protocol.IDS, 0)):
            if new not in self.generations.admitted and new not in self.gone:
                self.generations.waiting.add(new)
        self.generations.admit()

    def watch(self) -> None:
        """Take in joining nodes, and drop a node whose launcher has been silent too long.

        Raises:
            WorkerError: a node never connected within the timeout.
        """
        now = time.monotonic()
        for r in range(self.most):
            if r not in self.watched and self.store.add(protocol.node(r, "beat"), 0) > 0:
                self.watched.add(r)  # a node joins: node 0 waits for it, and watches it
                print(f"towers run: node {r} joins the job", file=sys.stderr, flush=True)
            if r not in self.watched:
                continue
            if r in self.away and self.store.check([protocol.node(r, "back")]):
                self.store.delete_key(protocol.node(r, "back"))  # it rejoins: watch it again
                self.away.discard(r)
                self.nodes_done.discard(r)
                self.node_beats.pop(r, None)
            if r in self.nodes_done:
                continue
            if self.store.check([protocol.node(r, "done")]):
                self.nodes_done.add(r)
                continue
            count = self.store.add(protocol.node(r, "beat"), 0)
            seen = self.node_beats.get(r)
            if count == 0 and now - self.launched > self.timeout:
                raise WorkerError(
                    f"node {r} never connected to the job's store at {self.where} "
                    f"within {self.timeout:g} s: is its towers run started, with the same "
                    "--master-addr and --master-port, and can its host reach this address?",
                    -1,
                    1,
                )
            if count == 0:
                continue
            if seen is None or seen[0] != count:
                self.node_beats[r] = (count, now)
            elif now - seen[1] > self.silence:
                self._node_lost(r, time.time() - (now - seen[1]))

    def _node_of(self, wid: int) -> int:
        if wid < self.workers:
            return wid // self.nproc
        name = protocol.node_of(wid)
        return int(self.store.get(name)) if self.store.check([name]) else -1

    def _node_lost(self, r: int, at: float) -> None:
        """Node ``r``'s launcher is silent: its workers are lost (they die with it, or it stops
        them if it comes back)."""
        self.nodes_done.add(r)
        self.away.add(r)
        latest, waiting = self.generations.latest, self.generations.waiting
        lost = [w for w in sorted(set(latest) | waiting) if self._node_of(w) == r]
        print(
            f"towers run: node {r}'s launcher has been silent for {self.silence:g} s; its "
            f"workers {lost} are lost",
            file=sys.stderr,
            flush=True,
        )
        self.store.set(protocol.node(r, "dropped"), protocol.DroppedNode(at, self.silence).dumps())
        why = f"node {r}'s towers run was silent for {self.silence:g} s"
        for wid in lost:
            self.forget(wid, at, why)
