"""Who is in an elastic job: generations of members, kept in the job's TCPStore.

The supervisor (the caller of ``towers.train``, or ``towers run --elastic``) hosts the store,
so it outlives any worker. Every worker has a stable id (its first rank; a replacement gets a
new one) and a heartbeat thread that counts up ``hb/<id>`` every :data:`HEARTBEAT` seconds.

Generation ``g`` is a list of member ids (``g<g>/members``, written once by the supervisor); a
member's rank is its index in that list. Its keys:

- ``g<g>/here``: arrivals; the members form a process group (over the prefix ``g<g>/pg``) once
  all have arrived.
- ``g<g>/failed``: set by the supervisor when a member died or hung (after it killed it), with
  the dead ids and the time of death. The heartbeat thread watches it and sets the interrupt
  event, which makes a waiting collective raise :class:`~towers.comm.base.PeerFailure`; the
  members then enter ``g + 1``, which the supervisor publishes without the dead.
- ``g<g>/regroup``: a replacement is ready and waits in ``g + 1``; the members agree, in the
  metadata of a step, to move there after that step.
- ``join/<id>``: the generation a replacement enters; ``ready/<id>``: a replacement is built;
  ``left/<id>``: a worker is done and stopped its heartbeat.

Every key lives under the job's prefix, and the records that decide who is a member
(``members``, ``failed``, ``regroup``, ``join``, ``ready``) are signed with the job's secret
(:mod:`towers.comm.store`): a process that reaches the store can list the keys, but its own
records are passed over, so it cannot make itself a member.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import threading
import time
from typing import Any

from ..core.secret import JobSecret
from .base import PeerTimeout
from .store import client_store, get_signed, job_store, put_signed, read_signed

__all__ = ["HEARTBEAT", "Dropped", "Membership", "key", "open_store"]

HEARTBEAT = 0.2  # seconds between a worker's heartbeats
_POLL = 0.01  # seconds between checks while members arrive


class Dropped(RuntimeError):
    """This worker is no longer a member (the supervisor declared it lost)."""


def key(generation: int, name: str) -> str:
    return f"g{generation}/{name}"


def open_store(addr: str, port: int, timeout: float, secret: JobSecret | None) -> Any:
    """A client of the job's store (the supervisor hosts it), checked to be this job's."""
    return job_store(client_store(addr, port, timeout, secret), secret)


class Membership:
    """One worker's view of the generations, with its heartbeat thread.

    Args:
        addr, port: the job's store.
        wid: this worker's id.
        timeout: seconds to wait for a generation to be published or its members to arrive.
        secret: the job's secret, which signs the membership records.
    """

    def __init__(
        self, addr: str, port: int, wid: int, timeout: float, secret: JobSecret | None = None
    ):
        self.id = wid
        self.timeout = timeout
        self.secret = secret
        self.store = open_store(addr, port, timeout, secret)
        self.interrupt = threading.Event()  # a member of the current generation was lost
        self.generation = -1
        self._regroup = False
        self._lock = threading.Lock()
        self._stop = threading.Event()
        # The store client is not shared across threads: the heartbeat has its own.
        self._beat_store = open_store(addr, port, timeout, secret)
        self._beat_store.add(f"hb/{wid}", 1)
        self._thread = threading.Thread(target=self._beat, name="towers-heartbeat", daemon=True)
        self._thread.start()

    def _beat(self) -> None:
        store = self._beat_store
        while not self._stop.wait(HEARTBEAT):
            try:
                store.add(f"hb/{self.id}", 1)
                g = self.generation
                if g < 0:
                    continue
                failed = get_signed(store, self.secret, key(g, "failed")) is not None
                regroup = get_signed(store, self.secret, key(g, "regroup")) is not None
            except Exception:
                if self._stop.is_set():
                    return
                # The store lives in the supervisor: without it this worker would train on as
                # a ghost, so it ends now.
                print(
                    f"towers: worker {self.id} lost the job's supervisor (the caller of train, or "
                    "towers run); stopping",
                    file=sys.stderr,
                    flush=True,
                )
                os._exit(1)
            with self._lock:
                if g == self.generation:
                    if failed:
                        self.interrupt.set()
                    self._regroup = self._regroup or regroup

    @property
    def regroup_wanted(self) -> bool:
        """Whether a replacement waits to join after the current generation."""
        return self._regroup

    def failure(self, generation: int) -> tuple[list[int], float] | None:
        """The ids lost in ``generation`` and when, or ``None`` if it did not fail."""
        text = get_signed(self.store, self.secret, key(generation, "failed"))
        if text is None:
            return None
        info = json.loads(text)
        return info["dead"], info["at"]

    def members(self, generation: int) -> list[int]:
        """The members of ``generation``, once the supervisor published it."""
        try:
            text = read_signed(self.store, self.secret, key(generation, "members"), self.timeout)
        except TimeoutError:
            raise PeerTimeout(
                f"worker {self.id}: generation {generation} of the job was not published within "
                f"{self.timeout:g} s; did the supervisor (the caller of train) exit?"
            ) from None
        return list(json.loads(text))

    def first_generation(self, joining: bool) -> int:
        """0 for a worker started with the job; a replacement waits to be let in."""
        if not joining:
            return 0
        put_signed(self.store, self.secret, f"ready/{self.id}", "1")
        return int(read_signed(self.store, self.secret, f"join/{self.id}", self.timeout))

    def enter(self, generation: int) -> tuple[int, list[int]]:
        """Arrive in ``generation`` (or a later one, if it fails) once all its members are here.

        Returns:
            ``(generation, members)`` entered.

        Raises:
            Dropped: if this worker is not a member (it was declared lost).
            PeerTimeout: if the members do not all arrive within the timeout.
        """
        while True:
            members = self.members(generation)
            if self.id not in members:
                raise Dropped(f"worker {self.id} was dropped from the job")
            with self._lock:
                self.generation = generation
                self.interrupt.clear()
                self._regroup = False
            self.store.add(key(generation, "here"), 1)
            deadline = time.monotonic() + self.timeout
            while get_signed(self.store, self.secret, key(generation, "failed")) is None:
                if self.store.add(key(generation, "here"), 0) >= len(members):
                    return generation, members
                if time.monotonic() > deadline:
                    raise PeerTimeout(
                        f"worker {self.id}: not every member of generation {generation} "
                        f"({members}) arrived within {self.timeout:g} s"
                    )
                time.sleep(_POLL)
            generation += 1

    def close(self) -> None:
        """Stop the heartbeat, telling the supervisor that this worker left on purpose."""
        self._stop.set()
        self._thread.join(1.0)
        with contextlib.suppress(Exception):
            self.store.set(f"left/{self.id}", "1")
