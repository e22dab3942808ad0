"""Who is in an elastic job, as the one supervisor that decides it keeps it: the job's store,
hosted by that supervisor, and the generations of members it publishes there (signed with the
job's secret, :mod:`towers.comm.membership` has the workers' side)."""

from __future__ import annotations

import json
from typing import Any

from ..comm import protocol
from ..comm.store import get_signed, host_store, job_store, put_signed
from ..core.secret import JobSecret
from .spawn import WorkerError

__all__ = ["Generations", "NodeDropped", "NodeRefused", "serve_store"]


class NodeDropped(Exception):
    """Node 0 dropped this node (it heard nothing from it for a while) and the job is ending,
    so nothing is left to rejoin: it stops, the job goes on."""


class NodeRefused(Exception):
    """The job does not take this node (its place is taken, or it differs from node 0's): it
    stops at once, and the job goes on untouched."""


def serve_store(addr: str, port: int, timeout: float, secret: JobSecret | None) -> Any:
    """The job's store, listening on ``addr`` only, with the job's keys under its prefix."""
    return job_store(host_store(addr, port, timeout, secret), secret)


class Generations:
    """The members of each generation of the job, kept by the one supervisor that publishes
    them (signed with the job's secret, so that no process that reaches the store can)."""

    def __init__(self, store: Any, secret: JobSecret | None):
        self.store, self.secret = store, secret
        self.members: dict[int, list[int]] = {}
        self.marked: set[int] = set()  # generations announced as failed
        self.waiting: set[int] = set()  # replacements not yet let in
        self.admitted: dict[int, int] = {}  # replacement -> the generation it was let into

    @property
    def latest(self) -> list[int]:
        return self.members[len(self.members) - 1]

    def publish(self, members: list[int]) -> int:
        g = len(self.members)
        self.members[g] = members
        put_signed(self.store, self.secret, protocol.generation(g, "members"), json.dumps(members))
        return g

    def drop(self, wid: int, at: float) -> None:
        """Mark the generations ``wid`` was in as failed and publish the next without it."""
        if wid in self.waiting:
            self.waiting.discard(wid)
            return
        info = json.dumps({"dead": [wid], "at": at})
        for g, members in self.members.items():
            if wid in members and g not in self.marked:
                put_signed(self.store, self.secret, protocol.generation(g, "failed"), info)
                self.marked.add(g)
        if wid in self.latest:
            survivors = [m for m in self.latest if m != wid]
            if not survivors:
                raise WorkerError(
                    f"every worker of the elastic job was lost (the last: worker {wid}); "
                    "nothing is left to resume from: use checkpoint= to keep the progress "
                    "on disk",
                    wid,
                )
            self.publish(survivors)

    def admit(self) -> None:
        """Let each built replacement into the next generation, at the members' next step."""
        for wid in sorted(self.waiting):
            if get_signed(self.store, self.secret, protocol.ready(wid)) is None:
                continue
            self.waiting.discard(wid)
            current = len(self.members) - 1
            g = self.publish([*self.members[current], wid])
            self.admitted[wid] = g
            put_signed(self.store, self.secret, protocol.joined(wid), str(g))
            put_signed(self.store, self.secret, protocol.generation(current, "regroup"), "1")
