"""Joining a job: the process group from the launcher's environment, and the transport choice.

Every worker sees what ``torchrun`` would give it (``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``,
``MASTER_ADDR``, ``MASTER_PORT``), parsed by the layer above into a
:class:`~towers.core.launch.Launch`; :func:`connect` joins the process group it describes over
env:// rendezvous the way torchrun's own scripts do, and puts the transport the engines use on
top of it: shared memory for CPU workers on one host; for CPU workers on several hosts with
several on some, sums in two levels, within each host and then among one leader per host
(:mod:`towers.comm.hierarchy`); the process group (Gloo, NCCL) otherwise.
The store listens on ``MASTER_ADDR`` only, holds the job's keys under a prefix derived from its
secret, and refuses a rank of another job (:mod:`towers.comm.store`); object messages are
signed (:mod:`towers.comm.objects`). Tensors travel unauthenticated and unencrypted: a job across
hosts belongs on a trusted network (docs/reliability.md, threat model).
"""

from __future__ import annotations

import gc
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from ..core.launch import Launch
from ..core.messages import first_line
from ..core.secret import JobSecret
from ..core.transport import Transport
from .base import DEFAULT_TIMEOUT, Comm, DistComm, LocalComm
from .hierarchy import by_host, two_levels
from .net import is_loopback
from .rendezvous import choose_interface, join
from .segment import host_key
from .store import check_owner, claim, client_store, host_store, job_store
from .transports import build

__all__ = [
    "DEFAULT_TIMEOUT",
    "Connection",
    "connect",
    "init_process_group",
]


def _store(launch: Launch, secret: JobSecret | None, timeout: timedelta) -> Any:
    """The job's rendezvous store, its keys under the job's prefix.

    Rank 0 hosts it, listening on ``MASTER_ADDR`` only (torch's TCPStore alone listens on every
    interface), unless torchrun's agent hosts it. Every other rank first checks that the store is
    this job's (:func:`towers.comm.store.client_store`): a rank that reaches another job's store
    is refused before it writes anything.
    """
    addr, port, rank, world = launch.master_addr, launch.master_port, launch.rank, launch.world_size
    seconds = timeout.total_seconds()
    if launch.agent_store:
        # torchrun's agent hosts the store. After a restart (--max-restarts) the keys of the
        # failed attempt can still be there, and Gloo would dial the dead workers' addresses:
        # keep each attempt's keys apart.
        client = dist.TCPStore(addr, port, world, False, timeout)
        raw = dist.PrefixStore(f"towers/attempt_{launch.restart_count}", client)
        if rank == 0:
            claim(raw, secret)
        else:
            check_owner(raw, secret, f"{addr}:{port}", seconds)
    elif rank == 0:
        raw = host_store(addr, port, seconds, secret, world)
    else:
        try:
            raw = client_store(addr, port, seconds, secret, world)
        except dist.DistError as exc:
            raise TimeoutError(
                f"rank {rank} could not reach the rendezvous at {addr}:{port} within "
                f"{seconds:g} s: is rank 0 running, and are MASTER_ADDR and MASTER_PORT right? "
                f"({first_line(exc)})"
            ) from None
    return job_store(raw, secret)


def init_process_group(launch: Launch, backend: str = "gloo", timeout: float | None = None) -> Any:
    """Initialise the default process group of the job ``launch`` describes.

    Under torchrun the agent's store is used, one key space per restart attempt. A job of our
    own gets a store that listens on ``MASTER_ADDR`` only (:func:`_store`). Every rank
    checks in before the group is built, so that a rank that never comes is named after
    ``timeout`` (:func:`towers.comm.rendezvous.join`), and a Gloo group is used once (a barrier)
    before it is returned, so that no rank closes it while a peer is still connecting. Across
    hosts, Gloo is pointed at the interface that reaches ``MASTER_ADDR`` unless
    ``GLOO_SOCKET_IFNAME`` says otherwise.
    """
    if dist.is_initialized():
        return dist.group.WORLD
    wait = timedelta(seconds=DEFAULT_TIMEOUT if timeout is None else timeout)
    kwargs: dict[str, Any] = {"backend": backend, "timeout": wait}
    if backend == "nccl":
        kwargs["device_id"] = torch.device("cuda", launch.local_rank)
    addr, port = launch.master_addr, launch.master_port
    rank, world = launch.rank, launch.world_size
    store = _store(launch, launch.job_secret, wait)
    if not is_loopback(addr):
        choose_interface(addr, backend)
    join(store, rank, world, wait, f"{addr}:{port}", backend)
    dist.init_process_group(store=store, rank=rank, world_size=world, **kwargs)
    if backend == "gloo":
        # A rank whose side of Gloo's full mesh is done may otherwise go on, finish and close
        # while a peer is still connecting, which then fails with "Connection closed by peer"
        # (a job that closes right after joining, on a loaded 2-core machine: 11 of 450 times).
        dist.barrier()
    return dist.group.WORLD


@dataclass
class Connection:
    """This process's link to the job: the transport, its device, and who owns the group."""

    comm: Comm
    device: torch.device
    local_rank: int = 0
    owns_group: bool = False
    secret: JobSecret | None = None  # signs the job's object messages

    def close(self) -> None:
        """Release the transport and, if :func:`connect` created it, the process group."""
        self.comm.close()
        if self.owns_group and dist.is_initialized():
            dist.destroy_process_group()
            self.owns_group = False
            # Let go of the group now, while the interpreter is whole: a Gloo group destroyed
            # during interpreter shutdown can abort the process (std::terminate in a thread).
            self.comm = LocalComm()
            gc.collect()


def connect(
    launch: Launch,
    *,
    timeout: float | None = None,
    transport: Transport | str | None = None,
    device: str = "cpu",
) -> Connection:
    """Join the job ``launch`` describes (a world of one if the process was not launched).

    ``transport``: as parsed by the API (a name is parsed here too; ``None``: the launch's
    ``TOWERS_TRANSPORT``, else auto). ``device``: ``"cuda"`` (this rank computes on
    ``cuda:LOCAL_RANK`` and the group is NCCL's) or ``"cpu"`` (Gloo); chosen above this layer
    (:func:`towers.core.devices.place`).
    """
    transport = Transport.parse(transport, launch.transport)
    local_rank = launch.local_rank if launch.launched else 0
    here = torch.device("cuda", local_rank) if device == "cuda" else torch.device("cpu")
    if device == "cuda":
        torch.cuda.set_device(here)
    if not launch.launched:
        return Connection(LocalComm(), here)
    owns_group = not dist.is_initialized()
    group = init_process_group(launch, "nccl" if device == "cuda" else "gloo", timeout)
    if (dist.get_backend(group) == "nccl") != (device == "cuda"):
        raise ValueError(
            f"this process already belongs to a {dist.get_backend(group)} process group, and "
            f"device={device!r} needs {'nccl' if device == 'cuda' else 'gloo'}: pass the "
            "device that matches the group, or let towers create the group"
        )
    wait = DEFAULT_TIMEOUT if timeout is None else timeout
    secret = launch.job_secret
    comm = choose_transport(DistComm(group, wait, secret=secret), transport, wait)
    return Connection(comm, here, local_rank, owns_group, secret)


def choose_transport(base: DistComm, transport: Transport, timeout: float) -> Comm:
    """What sums over ``base``'s ranks: two levels across hosts (``auto``, CPU workers, several
    hosts and several workers on some), else the transport's own
    (:func:`towers.comm.transports.build`)."""
    auto = transport is Transport.AUTO
    if auto and base.world_size > 1 and dist.get_backend(base.group) == "gloo":
        hosts = by_host(base.all_gather_object(host_key()))
        if len(hosts) > 1:
            return two_levels(base, hosts, timeout)
    return build(base, transport, timeout)
