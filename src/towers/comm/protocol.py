"""The elastic job's store: every key and every record in it, named once.

An elastic job (``towers.train`` with ``elastic=``, ``towers run --elastic``) keeps who is in
it in one TCPStore, hosted by its supervisor or node 0 (:mod:`towers.comm.membership`,
:mod:`towers.processes.elastic_nodes`). Its keys, under the job's prefix:

===========================  ===================================================================
key                          what it holds
===========================  ===================================================================
``g<g>/members``             generation ``g``'s member ids, signed (:func:`generation`)
``g<g>/here``                arrivals at generation ``g``, counted
``g<g>/failed``              dead ids and when, signed; ``g<g>/regroup``: move on after a step
``hb/<id>``                  a worker's heartbeat, counted up (:func:`heartbeat`)
``join/<id>``                the generation a newcomer enters, signed (:func:`joined`)
``ready/<id>``               a newcomer is built, signed (:func:`ready`)
``refused/<id>``             why a newcomer differs from the job, signed (:func:`refused`)
``left/<id>``                a worker is done and stopped its heartbeat (:func:`left`)
``lost/<id>``                a :class:`Lost` record: when and why a worker was dropped
``terms``                    what every member shares, signed (:data:`TERMS`)
``notices``, ``notice/<n>``  a count, and each a :class:`Notice`: a node saw a worker die
``restarts``, ``ids``        replacements made, and newcomer ids handed out, counted
``node_of/<id>``             the node a newcomer runs on
``node/<r>/<what>``          a node's own keys (:func:`node`): ``beat``, ``claim``, ``done``,
                             ``back``, and ``dropped``, a :class:`DroppedNode` record
``nproc``                    node 0's workers per node and ``--nnodes``, as ``"N MIN:MAX"``
``finishing``                a worker has done every step: no more replacements
``abort``                    an :class:`Abort` record: a node failed and the job stops
===========================  ===================================================================

Records travel as JSON; nothing read from the store is unpickled.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from typing import Any, TypeVar

__all__ = [
    "ABORT",
    "FINISHING",
    "IDS",
    "NOTICES",
    "NPROC",
    "RESTARTS",
    "TERMS",
    "Abort",
    "DroppedNode",
    "Lost",
    "Notice",
    "generation",
    "heartbeat",
    "joined",
    "left",
    "lost",
    "node",
    "node_of",
    "notice",
    "ready",
    "refused",
]

TERMS = "terms"
NPROC = "nproc"
FINISHING = "finishing"
ABORT = "abort"
NOTICES = "notices"
RESTARTS = "restarts"
IDS = "ids"

NODE_KEYS = ("beat", "claim", "done", "back", "dropped")


def generation(g: int, name: str) -> str:
    """A key of generation ``g``: ``members``, ``here``, ``failed``, ``regroup``, ``pg``."""
    return f"g{g}/{name}"


def heartbeat(wid: int) -> str:
    return f"hb/{wid}"


def joined(wid: int) -> str:
    return f"join/{wid}"


def ready(wid: int) -> str:
    return f"ready/{wid}"


def refused(wid: int) -> str:
    return f"refused/{wid}"


def left(wid: int) -> str:
    return f"left/{wid}"


def lost(wid: int) -> str:
    return f"lost/{wid}"


def notice(n: int) -> str:
    return f"notice/{n}"


def node_of(wid: int) -> str:
    return f"node_of/{wid}"


def node(r: int, what: str) -> str:
    """Node ``r``'s key ``what`` (one of :data:`NODE_KEYS`)."""
    if what not in NODE_KEYS:
        raise ValueError(f"a node has no key {what!r}; its keys: {', '.join(NODE_KEYS)}")
    return f"node/{r}/{what}"


R = TypeVar("R", bound="_Record")


class _Record:
    """A record kept in the store as a JSON object of its fields."""

    def dumps(self) -> str:
        return json.dumps(asdict(self))  # type: ignore[call-overload]

    @classmethod
    def loads(cls: type[R], raw: bytes | str) -> R:
        fields: dict[str, Any] = json.loads(raw)
        return cls(**fields)


@dataclass(frozen=True)
class Lost(_Record):
    """``lost/<id>``: the worker was dropped from the job ``at`` (epoch seconds), and ``why``."""

    at: float
    why: str


@dataclass(frozen=True)
class DroppedNode(_Record):
    """``node/<r>/dropped``: node 0 dropped node ``r`` ``at``, after ``silent`` seconds without
    a heartbeat from its ``towers run``."""

    at: float
    silent: float


@dataclass(frozen=True)
class Notice(_Record):
    """``notice/<n>``: a node saw worker ``dead`` die ``at``."""

    dead: int
    at: float


@dataclass(frozen=True)
class Abort(_Record):
    """``abort``: ``node`` failed with ``error``; every node stops with exit ``code``."""

    node: int
    error: str
    code: int
