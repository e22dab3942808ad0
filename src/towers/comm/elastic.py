"""An elastic worker's link to its job: the process group of the current generation, rebuilt.

When a peer is lost the old group is abandoned (its pending work is never waited on again) and a
fresh one is built for the next generation of members (:mod:`towers.comm.membership`): a new
Gloo process group over a new prefix of the job's store, and, for local CPU workers, a new
shared-memory segment laid out for the survivors (never across hosts: a job of several nodes,
``GROUP_WORLD_SIZE`` > 1, sums over Gloo). The engines see an ordinary
:class:`~towers.comm.base.Comm` whose collectives raise
:class:`~towers.comm.base.PeerFailure` when a peer is lost.
"""

from __future__ import annotations

import gc
from datetime import timedelta

import torch
import torch.distributed as dist

from ..core.args import check_timeout
from ..core.launch import Launch
from ..core.transport import Transport
from . import protocol
from .base import Comm, DistComm, LocalComm, PeerFailure
from .graves import Graves
from .group import DEFAULT_TIMEOUT
from .membership import Membership
from .transports import build

__all__ = ["ElasticConnection"]


class ElasticConnection:
    """This worker's membership and the transport of its current generation.

    ``launch`` gives the worker's id (its ``RANK``), the supervisor's store (``MASTER_ADDR``,
    ``MASTER_PORT``) and the number of nodes; ``joining`` is true for a replacement started
    mid-run. :meth:`start` connects.
    """

    def __init__(
        self, launch: Launch, transport: Transport, timeout: float | None, joining: bool = False
    ):
        self.transport = transport
        timeout = check_timeout(timeout)
        self.timeout = DEFAULT_TIMEOUT if timeout is None else timeout
        self.id = launch.rank
        addr, port = launch.master_addr, launch.master_port
        self.secret = launch.job_secret  # signs the membership records and object messages
        node = launch.group_rank if launch.group_world_size > 1 else None
        self.membership = Membership(addr, port, self.id, self.timeout, self.secret, node)
        self.joining = joining
        self.hosts = launch.group_world_size > 1  # a job across hosts
        self.comm: Comm = LocalComm()
        self.device = torch.device("cpu")
        self.generation = -1
        self.members: list[int] = []
        self._graves = Graves(self.timeout)  # abandoned groups, until their work has ended

    def start(self) -> ElasticConnection:
        """Connect to the job's store and start the heartbeat; returns itself."""
        self.membership.start()
        return self

    def join(self, generation: int) -> None:
        """Leave the current group and form ``generation``'s (or a later one's, if it fails).

        Raises:
            PeerFailure: if the new group cannot be formed (the caller tries the next one).
        """
        self._abandon()
        self.generation, self.members = self.membership.enter(generation)
        rank, world = self.members.index(self.id), len(self.members)
        store = dist.PrefixStore(protocol.generation(self.generation, "pg"), self.membership.store)
        try:
            dist.init_process_group(
                "gloo",
                store=store,
                rank=rank,
                world_size=world,
                timeout=timedelta(seconds=self.timeout),
            )
            base = DistComm(
                None, self.timeout, self.membership.interrupt, self.hosts, secret=self.secret
            )
            self.comm = self._transport(base)
        except PeerFailure:
            raise
        except RuntimeError as exc:  # a member died while the group formed
            raise PeerFailure(f"generation {self.generation} could not form: {exc}") from None

    def _transport(self, base: DistComm) -> Comm:
        if self.hosts:  # never a transport of one host across hosts
            if self.transport.one_host:
                raise RuntimeError(
                    f"transport={self.transport.name!r} is not available across hosts: use 'gloo'"
                )
            return base
        return build(base, self.transport, self.timeout, self.membership.interrupt)

    def _abandon(self) -> None:
        # A broken group's pending work is dropped, not waited on (comm/graves.py): its work
        # can wait on a survivor that has left it too.
        self.comm = LocalComm()
        if dist.is_initialized():
            self._graves.bury()

    def close(self) -> None:
        self._abandon()
        # Let go of the groups now, while the interpreter is whole: a Gloo group destroyed
        # during interpreter shutdown can abort the process (std::terminate in a thread). Every
        # member is done, so what an abandoned group still waits for ends within its timeout.
        self._graves.release()
        gc.collect()
        self.membership.close()
