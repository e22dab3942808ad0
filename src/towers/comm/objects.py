"""Object messages between ranks that cannot run a stranger's code.

``torch.distributed``'s object collectives pickle on one rank and unpickle on the others, and
unpickling runs whatever code the bytes name: any process that gets into the group (it needs
only to reach the job's ports) could run code in every worker. towers' object messages
(:meth:`~towers.comm.base.DistComm.all_gather_object`, ``broadcast_object``, ``send_object``)
go through :func:`encode` and :func:`decode` instead:

- in a job with a secret (every job towers launches; ``TOWERS_SECRET`` under torchrun) a message
  is a pickle with its HMAC-SHA256 tag, and :func:`decode` checks the tag before it unpickles a
  byte: a message not signed with the job's secret is refused (:class:`RefusedMessage`);
- without a secret, a message is written with ``torch.save`` and read with
  ``torch.load(weights_only=True)``, PyTorch's restricted unpickler, which builds tensors and
  plain data (numbers, strings, lists, tuples, dicts) and refuses everything else.
"""

from __future__ import annotations

import contextlib
import io
import pickle
from typing import Any

import torch

from ..core.secret import TAG_BYTES, JobSecret

__all__ = ["RefusedMessage", "decode", "encode"]

_SIGNED = b"TWRS\x01"  # a pickle with its tag
_PLAIN = b"TWRS\x00"  # torch.save data, read with weights_only=True
_PURPOSE = b"object message"
_FIX = (
    "Every process of a job needs the same secret (TOWERS_SECRET, or towers run --secret-file), "
    "and the job's ports must be out of others' reach (docs/reliability.md, threat model)"
)


def _plain_globals() -> contextlib.AbstractContextManager[Any]:
    """Allow ``bytes`` too (pickle protocol 2 writes ``b""`` as a call to it); torch >= 2.5."""
    allow = getattr(torch.serialization, "safe_globals", None)
    return contextlib.nullcontext() if allow is None else allow([bytes])


class RefusedMessage(RuntimeError):
    """An object message that is not the job's own was refused; nothing of it was unpickled."""


def encode(obj: Any, secret: JobSecret | None) -> bytes:
    """``obj`` as the bytes of one object message."""
    if secret is None:
        out = io.BytesIO()
        torch.save(obj, out)
        return _PLAIN + out.getvalue()
    data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    return _SIGNED + secret.sign(_PURPOSE, data) + data


def decode(blob: bytes, secret: JobSecret | None, sender: str) -> Any:
    """The object in ``blob``, sent by ``sender`` (for the error); checked before it is read.

    Raises:
        RefusedMessage: ``blob`` is not signed with ``secret`` (with a secret), or holds more than
            tensors and plain data (without one).
    """
    head, body = blob[: len(_SIGNED)], blob[len(_SIGNED) :]
    if secret is not None:
        tag, data = body[:TAG_BYTES], body[TAG_BYTES:]
        if head != _SIGNED or not secret.verify(_PURPOSE, data, tag):
            raise RefusedMessage(
                f"refused an object message from {sender}: it is not signed with this job's "
                f"secret, so it was not unpickled. Another process reached the job's ports, or "
                f"that rank runs with another secret (or none). {_FIX}"
            )
        return pickle.loads(data)
    if head == _SIGNED:
        raise RefusedMessage(
            f"refused an object message from {sender}: it runs with a job secret and this "
            f"process without one. {_FIX}"
        )
    if head != _PLAIN:
        raise RefusedMessage(f"refused an object message from {sender}: it is not towers'. {_FIX}")
    try:
        with _plain_globals():
            return torch.load(io.BytesIO(body), weights_only=True)
    except Exception as exc:  # refused globals (UnpicklingError), or bytes that are no file
        raise RefusedMessage(
            f"refused an object message from {sender}: without a job secret only tensors and "
            f"plain data are accepted, and it holds more ({str(exc).splitlines()[0]}). {_FIX}"
        ) from None
