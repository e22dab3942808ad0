"""Every rank starts from rank 0's model: check that the ranks built the same one, then copy it.

Initial parameters and buffers come from rank 0; a rank whose model differs in parameter names
or shapes fails at start, on every rank alike, with an error naming the first difference.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from ..comm.base import Comm

__all__ = ["broadcast_module", "join_difference", "terms", "verify_same_model"]


Entry = tuple[str, str, tuple[int, ...], str]  # kind, name, shape, dtype


def _signature(module: nn.Module) -> list[Entry]:
    sig = [("parameter", n, tuple(p.shape), str(p.dtype)) for n, p in module.named_parameters()]
    sig += [("buffer", n, tuple(b.shape), str(b.dtype)) for n, b in module.named_buffers()]
    return sig


def _first_difference(
    ref: Sequence[Sequence[Any]], sig: Sequence[Sequence[Any]]
) -> tuple[int, bool] | None:
    """``None`` if equal, else where they first differ: ``(#, True)`` where both have an entry
    and the two differ, ``(#, False)`` where one ends (entry # is only the longer one's)."""
    for k, (theirs, mine) in enumerate(zip(ref, sig)):
        if _plain(theirs) != _plain(mine):
            return k, True
    if len(ref) == len(sig):
        return None
    return min(len(ref), len(sig)), False


def _plain(entry: Sequence[Any]) -> Entry:
    kind, name, shape, dtype = entry  # a shape read back from JSON is a list
    return kind, name, tuple(shape), dtype


def _said(entry: Sequence[Any]) -> str:
    kind, name, shape, dtype = entry
    return f"{kind} {name!r} {list(shape)} {dtype}"


def verify_same_model(module: nn.Module, comm: Comm) -> None:
    """Raise ``ValueError`` on every rank if any rank's parameters or buffers differ from rank 0's.

    The message names the first differing parameter or buffer and the rank it differs on.
    """
    sigs = comm.all_gather_object(_signature(module))
    ref = sigs[0]
    for rank, sig in enumerate(sigs[1:], start=1):
        found = _first_difference(ref, sig)
        if found is None:
            continue
        k, both = found
        if both:
            raise ValueError(
                f"the model on rank {rank} differs from rank 0's at {ref[k][0]} #{k}: rank 0 has "
                f"{_said(ref[k])}, rank {rank} has {_said(sig[k])}; every rank must build the "
                "same model"
            )
        longer, who = (ref, 0) if len(ref) > len(sig) else (sig, rank)
        kind, name, shape, _ = longer[k]
        raise ValueError(
            f"the model on rank {rank} differs from rank 0's: {kind} {name!r} {list(shape)} exists "
            f"only on rank {who}; every rank must build the same model"
        )


def terms(module: nn.Module, mode: str, compression: str) -> dict[str, Any]:
    """What a worker that joins a running job must share with its members, as plain data: the
    model's parameters and buffers (names, shapes, dtypes), the mode and the compression."""
    return {
        "model": [
            [kind, name, list(shape), dtype] for kind, name, shape, dtype in _signature(module)
        ],
        "mode": mode,
        "compression": compression,
    }


def join_difference(job: dict[str, Any], mine: dict[str, Any]) -> str | None:
    """How a joining worker's :func:`terms` differ from the job's, in words; ``None`` if alike."""
    if mine["mode"] != job["mode"]:
        return f"it trains mode {mine['mode']!r}, the job {job['mode']!r}"
    if mine["compression"] != job["compression"]:
        return f"its compression is {mine['compression']!r}, the job's {job['compression']!r}"
    ref, sig = job["model"], mine["model"]
    found = _first_difference(ref, sig)
    if found is None:
        return None
    k, both = found
    if both:
        return (
            f"its model differs from the job's at {ref[k][0]} #{k}: the job has {_said(ref[k])}, "
            f"this worker {_said(sig[k])}"
        )
    longer, whose = (ref, "the job's") if len(ref) > len(sig) else (sig, "this worker's")
    return (
        f"its model differs from the job's: {longer[k][0]} {longer[k][1]!r} {list(longer[k][2])} "
        f"exists only in {whose}"
    )


def broadcast_module(module: nn.Module, comm: Comm, src: int = 0) -> None:
    """Copy ``src``'s parameters and buffers to every rank, one flat message per dtype."""
    tensors = [p.data for p in module.parameters()] + list(module.buffers())
    if comm.world_size == 1 or not tensors:
        return
    groups: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}
    for t in tensors:
        groups.setdefault((t.dtype, t.device), []).append(t)
    for group in groups.values():
        flat = torch.cat([t.reshape(-1) for t in group])
        comm.broadcast(flat, src)
        _unflatten_into(flat, group)


def _unflatten_into(flat: torch.Tensor, tensors: Sequence[torch.Tensor]) -> None:
    start = 0
    with torch.no_grad():
        for t in tensors:
            n = t.numel()
            t.copy_(flat[start : start + n].view_as(t))
            start += n
