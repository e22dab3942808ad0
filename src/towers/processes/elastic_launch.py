"""One node of ``towers run --elastic --nnodes M``: its supervisor over :class:`Nodes`, and the
line and exit code each way a node can end (see :mod:`towers.processes.elastic_nodes`)."""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Sequence

import torch.distributed as dist

from ..comm import protocol
from ..comm.rendezvous import choose_interface
from ..comm.store import ForeignJob, get_signed
from .elastic import HANG_SECONDS, Supervisor
from .elastic_nodes import NodeDropped, NodeRefused, Nodes
from .elastic_workers import ScriptStarter
from .spawn import WorkerError

__all__ = ["run_script_nodes"]


def run_script_nodes(
    script: str,
    nproc: int,
    args: Sequence[str] = (),
    *,
    nnodes: int | tuple[int, int],
    node_rank: int | None,
    addr: str,
    port: int,
    max_restarts: int = 0,
    timeout: float = 60.0,
    secret: str | None = None,
    node_timeout: float | None = None,
) -> int:
    """One node of ``towers run --elastic --nnodes M``: supervise this node's ``nproc`` workers.

    ``node_rank``: ``None`` for node 0 where this host can listen on ``addr``:``port``, else
    the first node rank free in the job. ``nnodes``: the nodes the job starts with, or
    ``(MIN, MAX)`` (:func:`towers.core.args.nnodes_of`): nodes 0..MIN-1 start it, and a node
    MIN..MAX-1 joins it while it runs; its workers are let in at the members' next step with
    the state of a live peer.

    ``secret`` is the job's, the same on every node (``TOWERS_SECRET``, ``--secret-file``); a
    node whose secret differs from node 0's is refused at once. ``node_timeout``: seconds of
    silence after which node 0 drops a node (``--node-timeout``,
    :func:`~towers.core.args.node_timeout_of`). Returns 0 when every worker of this node that
    was not lost has exited 0 (on node 0: and every other node is done), else the failed
    worker's exit code, 1 if the store is lost or is another job's, or 2 if the job refused
    this node (its place, its width, or its workers differ from the job's).
    """
    choose_interface(addr, "gloo")  # the workers inherit GLOO_SOCKET_IFNAME
    start = ScriptStarter(script, args, nproc)
    where = "this node" if node_rank is None else f"node {node_rank}"
    nodes: Nodes | None = None
    sup: Supervisor | None = None
    place = (nproc, nnodes, node_rank, max_restarts, addr, port, timeout, secret, node_timeout)
    try:
        nodes = Nodes(*place).connect()
        where = f"node {nodes.node}"  # claimed from node 0's store if not given
        sup = Supervisor(nodes, start, min(HANG_SECONDS, timeout), timeout)
        outcome = sup.run(until_all=True)
    except NodeDropped as exc:
        print(f"towers run ({where}): {exc}", file=sys.stderr)
        return 1
    except NodeRefused as exc:  # the job goes on untouched
        print(f"towers run ({where}): refused: {exc}", file=sys.stderr)
        return 2
    except WorkerError as exc:
        if nodes is not None:
            with contextlib.suppress(dist.DistError):
                nodes.fail(exc)
        print(f"towers run ({where}): {exc}", file=sys.stderr)
        code = exc.exitcode or 1
        return code if code > 0 else 128 - code
    except (ForeignJob, TimeoutError) as exc:  # node 0's store is not this job's
        print(f"towers run ({where}): {exc}", file=sys.stderr)
        return 1
    except OSError as exc:  # node 0 cannot listen on addr:port
        print(
            f"towers run ({where}): cannot host the job's store on {addr}:{port}: {exc}",
            file=sys.stderr,
        )
        return 1
    except dist.DistError as exc:
        print(
            f"towers run ({where}): lost the job's store at {addr}:{port} (node 0's towers run "
            f"ended or cannot be reached): stopping this node's workers ({exc})".splitlines()[0],
            file=sys.stderr,
        )
        return 1
    finally:
        if sup is not None:
            sup.stop()
        if nodes is not None:
            nodes.stop_beating()
        start.close()
    if outcome.refused and not sup.finishing and nodes.joiner:  # none of its workers trained
        print(
            f"towers run ({where}): refused: the running job did not let its workers in "
            "(above); the job goes on without this node",
            file=sys.stderr,
        )
        return 2
    gone = set() if nodes.coordinator is None else nodes.coordinator.gone  # node 0 knows
    turned = {w for w in gone if get_signed(nodes.store, nodes.signer, protocol.refused(w))}
    if turned:
        print(
            f"towers run: newcomers {sorted(turned)} were not let in (their nodes said why); "
            "the others trained on",
            file=sys.stderr,
        )
    if gone - turned:
        replaced = min(nodes.store.add(protocol.RESTARTS, 0), max_restarts)
        print(
            f"towers run: workers {sorted(gone - turned)} were lost, {replaced} replaced; "
            "the others trained on",
            file=sys.stderr,
        )
    elif outcome.dead:
        print(
            f"towers run ({where}): this node's workers {outcome.dead} were lost, "
            f"{outcome.replacements} replaced",
            file=sys.stderr,
        )
    return 0
