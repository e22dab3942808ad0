"""An elastic job across hosts: one ``towers run --elastic`` launcher per node, one store.

``towers run --elastic --nnodes M --node-rank R --master-addr A --master-port P -n N`` starts N
workers on each of M nodes; worker ids (first ranks) are ``R * N + local rank``. Node 0's
launcher hosts the job's store on ``A:P`` (bound to that address only) and keeps the
generations (:mod:`towers.comm.membership`); every launcher supervises its own workers as on
one host (process, heartbeat, a replacement for each of its own lost workers), and tells node
0 of a loss through the store. The launcher is the one elastic supervisor
(:class:`~towers.processes.elastic.Supervisor`), handed :class:`Nodes` as its peers; the
store's keys (named in :mod:`towers.comm.protocol`):

- ``notice/<n>``: the n-th loss, posted by the node that killed it; node 0 marks the
  generations it was in as failed and publishes the next one. ``restarts``: replacements,
  job-wide (at most ``--max-restarts``); ``ids``: newcomer ids given out, the n-th
  ``M * N + n - 1``, each let in at the members' next step once it is built.
- ``node/<r>/claim``: a ``towers run`` holds node ``r`` (a second one is refused). With
  ``--nnodes MIN:MAX``, a node MIN..MAX-1 may join the running job: its workers are newcomers,
  and node 0 watches it from its first heartbeat on.
- ``finishing``: every member has done every step: no more replacements, and latecomers are
  stopped by their own node. ``abort``: a worker failed: every node stops and exits.
- ``node/<r>/beat``, ``node/<r>/done``: each launcher's heartbeat (every 0.2 s from a thread
  of its own, :class:`~towers.comm.membership.Pulse`, alive on a starved machine too), and that
  it has no workers left. Node 0 keeps the store up until every node is done; a node silent for
  the node timeout (:func:`~towers.core.args.node_timeout_of`) is lost with all its workers,
  and the others train on. A node that loses node 0 (the store) stops.
- ``node/<r>/dropped``, ``lost/<id>``: node 0 dropped node ``r`` (silent, not necessarily
  dead: a network partition, a stopped host), and when. Node ``r``, if it hears from the job
  again before it ends, stops its dropped workers (not taken for failed ones), starts as many
  newcomers, and says ``node/<r>/back``: node 0 watches it again. If the job is ending, it
  stops with a line of its own instead.

Across a network partition node 0's store neither answers nor fails: every other node's
launcher times its calls to the store (:class:`~towers.comm.membership.WatchedStore`), and
one that has had no answer for the job's timeout stops its workers and exits, saying that
this node lost contact with the job and since when.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import signal
import socket
import sys
from collections.abc import Mapping
from typing import Any

from ..comm import protocol
from ..comm.membership import Pulse, WatchedStore, clock, open_store, own_client
from ..comm.store import get_signed
from ..core.args import nnodes_of, node_timeout_of
from ..core.secret import JobSecret
from .elastic_coordinator import Coordinator
from .elastic_members import NodeDropped, NodeRefused, serve_store
from .elastic_workers import Worker
from .env import worker_env
from .lifeline import end_now
from .spawn import WorkerError

__all__ = ["NodeDropped", "NodeRefused", "Nodes"]


class Nodes:
    """Where the peers of one node's supervisor live: on every node, over one store (see the
    module doc). Node 0's hosts the store and keeps the generations. ``nnodes``: the nodes the
    job starts with, or ``(MIN, MAX)``: nodes MIN..MAX-1 join it while it runs. The store, this
    node's place in the job and its heartbeat come with :meth:`connect`, not the constructor."""

    store: Any  # the job's: hosted here (node 0, the coordinator) or node 0's, watched
    coordinator: Coordinator | None  # node 0's part: the generations, losses and nodes
    joiner: bool  # a node that joins the running job
    local_rank: dict[int, int]  # worker id -> local rank (a joiner's come as it joins)
    first: list[int]  # the workers this node starts with
    pulse: Pulse  # this node's heartbeat

    def __init__(
        self,
        nproc: int,
        nnodes: int | tuple[int, int],
        node: int | None,
        max_restarts: int,
        addr: str,
        port: int,
        timeout: float,
        secret: str | None = None,
        node_timeout: float | None = None,
    ):
        least, self.most = (nnodes, nnodes) if isinstance(nnodes, int) else nnodes
        self.nproc, self.nnodes = nproc, least
        self.silence = node_timeout_of(timeout, node_timeout)  # a node silent this long is dropped
        self.workers, self.max_restarts = nproc * least, max_restarts
        self.addr, self.port, self.timeout = addr, port, timeout
        self.secret = secret  # the workers get it; it signs the membership records
        self.signer = None if secret is None else JobSecret(secret)
        self.running: Mapping[int, Worker] = {}
        self.node = -1 if node is None else node  # -1: claimed from node 0's store (_claim)
        self.local_new: set[int] = set()  # this node's replacements
        self.finishing = False  # a worker has finished, here or on another node
        self.told: set[str] = set()
        self._stale: list[Pulse] = []  # pulses replaced on a rejoin, closed again at the end

    def connect(self) -> Nodes:
        """Host or reach the job's store, take this node's place and start its heartbeat;
        returns itself. Raises :class:`NodeRefused` (the job does not take this node) or
        ``WorkerError`` (its ``-n`` or ``--nnodes`` differs from node 0's)."""
        self.store, hosting = self._connect()
        self.coordinator = None
        if hosting:
            self.coordinator = Coordinator(
                self.store, self.signer, self.nproc, self.nnodes, self.most, self.silence,
                self.timeout, f"{self.addr}:{self.port}",
            )  # fmt: skip
        self._same_width()
        self.joiner = self.node >= self.nnodes
        ids = range(self.node * self.nproc, (self.node + 1) * self.nproc)
        self.local_rank = {} if self.joiner else {wid: wid - ids[0] for wid in ids}
        self.first = self._take_place() if self.joiner else list(self.local_rank)
        if self.coordinator is not None:
            self.coordinator.start()
        self.pulse = self._pulse()
        return self

    def _pulse(self) -> Pulse:
        """This node's heartbeat, on a store client of its own (node 0 watches it; the main
        loop's calls are watched here)."""
        beat = own_client(self.addr, self.port, self.timeout, self.signer)
        return Pulse(beat, protocol.node(self.node, "beat"), min(0.2, self.silence / 10)).start()

    def stop_beating(self) -> None:
        """End this node's heartbeats before it exits (see :func:`own_client`)."""
        for pulse in [*self._stale, self.pulse]:
            pulse.close()

    def _connect(self) -> tuple[Any, bool]:
        """The job's store, and whether this node hosts it: node 0 does; without a node rank,
        the host that can listen on the address (its own, and the port free) does."""
        if self.node in (0, -1):
            try:
                store = serve_store(self.addr, self.port, self.timeout, self.signer)
            except OSError as exc:  # not this host's address, or node 0 listens on it here
                if self.node == 0 or exc.errno not in (errno.EADDRNOTAVAIL, errno.EADDRINUSE):
                    raise
            else:
                self.node = 0
                return store, True
        # refused at once if node 0's store is another job's, or has another secret
        client = open_store(self.addr, self.port, self.timeout, self.signer)
        return WatchedStore(client, self.timeout, self._cut_off).start(), False

    def join(self, running: Mapping[int, Worker]) -> tuple[list[int], bool]:
        self.running = running
        return self.first, self.joiner

    def _same_width(self) -> None:
        """Every node must start as many workers as node 0 (worker ids depend on it), with the
        same ``--nnodes``; a node that differs stops the job, or, joining, only itself."""
        if self.coordinator is not None:
            self.store.set(protocol.NPROC, f"{self.nproc} {self.span}")
            return
        self.store.wait([protocol.NPROC])
        theirs, span = self.store.get(protocol.NPROC).decode().split()
        if int(theirs) != self.nproc:
            error = f"-n {self.nproc} here but -n {theirs} on node 0: every node needs the same -n"
        elif span != self.span:
            error = f"--nnodes {self.span} here but {span} on node 0: every node needs the same"
        else:
            self._claim()
            return
        # A node without a rank takes none; one that would join (by node 0's MIN) stops alone.
        if self.node < 0 or self.node >= nnodes_of(span)[0]:
            raise NodeRefused(f"{error}; the job goes on without this node")
        self.store.set(protocol.ABORT, protocol.Abort(self.node, error, 2).dumps())
        raise WorkerError(error, -1, 2)

    @property
    def span(self) -> str:
        """``--nnodes`` as given: ``M`` or ``MIN:MAX``."""
        return str(self.most) if self.nnodes == self.most else f"{self.nnodes}:{self.most}"

    def _claim(self) -> None:
        """Take this node's place in the job, which only one towers run may hold; without a
        node rank, the first free one (hosts 1..MIN-1 start the job, later ones join it)."""
        if self.node < 0:
            for r in range(1, self.most):
                if self.store.add(protocol.node(r, "claim"), 1) == 1:
                    self.node = r
                    return
            raise NodeRefused(
                f"no node rank is free: the job already has its {self.most} nodes (--nnodes "
                f"{self.span})"
            )
        if self.store.add(protocol.node(self.node, "claim"), 1) == 1:
            return
        taken = [r for r in range(1, self.most) if self.store.check([protocol.node(r, "claim")])]
        full = (
            f"; the job already has its {self.most} nodes (--nnodes {self.span})"
            if len(taken) == self.most - 1
            else f"; nodes {self.nnodes}..{self.most - 1} may join, those not taken: "
            f"{sorted(set(range(self.nnodes, self.most)) - set(taken))}"
        )
        raise NodeRefused(
            f"node {self.node} is already in the job (another towers run has --node-rank "
            f"{self.node}){full}"
        )

    def _take_place(self) -> list[int]:
        """A joining node's first workers: newcomers with fresh ids, let in at the members' next
        step with the state of a live peer, as replacements are (not counted as restarts).

        Raises:
            NodeRefused: the job is ending.
        """
        if self.store.check([protocol.FINISHING]):
            raise NodeRefused("the job is ending: nothing is left to join")
        return [self._new_id(local) for local in range(self.nproc)]

    def _cut_off(self, since: float) -> None:
        """Node 0's store has not answered for the timeout: stop this node's workers, and exit.

        Called on the store's watch thread while the supervisor waits for an answer that may
        never come, so it ends the process itself (:func:`~towers.processes.lifeline.end_now`).
        """
        workers = sorted(self.running)
        for handle in list(self.running.values()):
            with contextlib.suppress(OSError):
                os.kill(handle.pid, signal.SIGKILL)
        end_now(
            f"towers run (node {self.node}, host {socket.gethostname()}): lost contact with the "
            f"job at {clock(since)}: node 0's store at {self.addr}:{self.port} has not answered "
            f"for {self.timeout:g} s (the timeout); a network partition, or node 0 stopped. This "
            f"node's workers {workers} are stopped (node 0 drops a node silent for "
            f"{self.silence:g} s, and the others train on)"
        )

    def dropped(self, wid: int) -> bool:
        return bool(self.store.check([protocol.lost(wid)]))

    def place(self, wid: int) -> dict[str, str]:
        return worker_env(
            wid,
            self.workers,
            self.addr,
            self.port,
            local_rank=self.local_rank[wid],
            local_world_size=self.nproc,
            group_rank=self.node,
            group_world_size=self.most,  # > 1 if hosts may join: never shared memory
            secret=self.secret,
        )

    def busy(self) -> bool:
        return self.coordinator is not None and self.coordinator.busy()

    def lost(self, wid: int, at: float, replace: bool) -> int | None:
        n = self.store.add(protocol.NOTICES, 1)
        self.store.set(protocol.notice(n), protocol.Notice(wid, at).dumps())
        if self.coordinator is not None:
            self.coordinator.read_notices()
        if not replace or self.finishing:
            return None
        if self.store.add(protocol.RESTARTS, 1) > self.max_restarts:
            return None
        return self._new_id(self.local_rank[wid])

    def _new_id(self, local: int) -> int:
        """A newcomer's id, job-wide, for this node's local rank ``local``."""
        new = self.workers + self.store.add(protocol.IDS, 1) - 1
        self.store.set(protocol.node_of(new), str(self.node))
        self.local_rank[new] = local
        self.local_new.add(new)
        return new

    def _formed(self, g: int) -> bool:
        members = get_signed(self.store, self.signer, protocol.generation(g, "members"))
        return self.store.add(protocol.generation(g, "here"), 0) >= len(json.loads(members or "[]"))

    def _latecomers(self) -> list[int]:
        """This node's replacements that the finished members will never take in."""
        stop = []
        for wid in sorted(self.local_new & set(self.running)):
            joined = get_signed(self.store, self.signer, protocol.joined(wid))
            if joined is None or not self._formed(int(joined)):
                stop.append(wid)
        return stop

    def _tell(self, name: str) -> None:
        if name not in self.told:
            self.store.set(name, "1")
            self.told.add(name)

    def tick(self, finishing: bool) -> tuple[list[int], list[int]]:
        self.finishing = self.finishing or finishing
        if self.coordinator is None and self.store.check([protocol.node(self.node, "dropped")]):
            return self._rejoin()
        if self.finishing:
            self._tell(protocol.FINISHING)
        elif self.store.check([protocol.FINISHING]):
            self.finishing = True
        if self.store.check([protocol.ABORT]):
            abort = protocol.Abort.loads(self.store.get(protocol.ABORT))
            raise WorkerError(f"node {abort.node}: {abort.error}", -1, abort.code)
        if not self.running:
            self._tell(protocol.node(self.node, "done"))
        if self.coordinator is not None:
            self.coordinator.read_notices()
            self.coordinator.watch()
        if self.finishing:
            stop = self._latecomers()
            if set(self.running) <= set(stop):  # its last workers are stopped: it is done
                self._tell(protocol.node(self.node, "done"))
            return stop, []
        if self.coordinator is not None:
            self.coordinator.admit()
        return [], []

    def _rejoin(self) -> tuple[list[int], list[int]]:
        """Node 0 dropped this node, which hears from the job again: stop the dropped workers
        and start as many newcomers, let in at the members' next step with the state of a live
        peer (as replacements are, and not counted as restarts). Returns (stop, start).

        Raises:
            NodeDropped: the job is ending: nothing is left to rejoin.
        """
        dropped = protocol.DroppedNode.loads(self.store.get(protocol.node(self.node, "dropped")))
        old = sorted(self.running)
        said = (
            f"this node (host {socket.gethostname()}) was dropped from the job at "
            f"{clock(dropped.at)}: node 0 heard nothing from its towers run for "
            f"{dropped.silent:g} s (a network partition, or this host stalled). Its workers "
            f"{old} are stopped"
        )
        if self.finishing or self.store.check([protocol.FINISHING]):
            raise NodeDropped(f"{said}; the others train on without them")
        self.store.delete_key(protocol.node(self.node, "dropped"))
        new = [self._new_id(local) for local in range(self.nproc)]
        # A heartbeat sent during the cut may wait for TCP's next resend, seconds after the link
        # is back (the interval doubles with each one lost): beat on a fresh connection.
        # Not waited for, nor broken off (c10d would log the broken call as a failure): its
        # resend comes, or its end at exit does.
        self.pulse.close(wait=None)
        self._stale.append(self.pulse)
        self.pulse = self._pulse()
        self.store.add(protocol.node(self.node, "back"), 1)
        print(
            f"towers run (node {self.node}): {said}; it rejoins with workers {new}, let in at "
            "the job's next step",
            file=sys.stderr,
            flush=True,
        )
        return old, new

    def fail(self, exc: WorkerError) -> None:
        """Tell every node that the job failed (unless it learnt that from another node)."""
        if exc.rank >= 0:
            abort = protocol.Abort(self.node, str(exc), exc.exitcode or 1)
            self.store.set(protocol.ABORT, abort.dumps())
