"""A job's secret and what derives from it: the store's key prefix, the job's id, signatures.

Every job that towers launches gets a random secret, handed to its processes outside the network
(their environment, ``TOWERS_SECRET``); across hosts the user's scheduler gives every node the
same one. From it derive, each by its own HMAC-SHA256 so that none reveals another:

- the prefix of the job's keys in the rendezvous store;
- the job's id, which the store's host publishes so that a process of another job (or with
  another secret) that reaches the same port is refused before it writes anything;
- the signatures (HMAC-SHA256) of the object messages and membership records, checked before
  anything is decoded (:mod:`towers.comm.objects`).

Pure: no process, no network; the secret itself is never part of a ``repr`` or a message.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets

__all__ = ["TAG_BYTES", "JobSecret", "new_secret"]

TAG_BYTES = 32  # an HMAC-SHA256 tag


def new_secret() -> str:
    """A fresh random secret (256 bits, hexadecimal), for a job that towers launches."""
    return secrets.token_hex(32)


class JobSecret:
    """A job's secret; ``prefix``, ``job_id`` and :meth:`sign` derive from it."""

    def __init__(self, secret: str):
        if not secret:
            raise ValueError("a job secret cannot be empty")
        self._key = hashlib.sha256(b"towers job secret\0" + secret.encode()).digest()
        self.prefix = "towers-" + self._derive(b"store prefix").hex()[:32]
        self.job_id = self._derive(b"job id").hex()[:16]

    def _derive(self, label: bytes) -> bytes:
        return hmac.new(self._key, label, hashlib.sha256).digest()

    def sign(self, purpose: bytes, data: bytes) -> bytes:
        """The tag of ``data`` for ``purpose`` (a message kind, a store key): 32 bytes."""
        mac = hmac.new(self._key, purpose + b"\0", hashlib.sha256)
        mac.update(data)
        return mac.digest()

    def verify(self, purpose: bytes, data: bytes, tag: bytes) -> bool:
        """Whether ``tag`` is ``data``'s tag for ``purpose`` (in constant time)."""
        return hmac.compare_digest(self.sign(purpose, data), tag)

    def __repr__(self) -> str:
        return f"JobSecret(job {self.job_id})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, JobSecret) and hmac.compare_digest(self._key, other._key)

    def __hash__(self) -> int:
        return hash(self.job_id)
