"""Every rank starts from rank 0's model: check that the ranks built the same one, then copy it.

Initial parameters and buffers come from rank 0; a rank whose model differs in parameter names
or shapes fails at start, on every rank alike, with an error naming the first difference.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from ..comm.base import Comm

__all__ = ["broadcast_module", "verify_same_model"]


def _signature(module: nn.Module) -> list[tuple[str, str, tuple[int, ...], str]]:
    sig = [("parameter", n, tuple(p.shape), str(p.dtype)) for n, p in module.named_parameters()]
    sig += [("buffer", n, tuple(b.shape), str(b.dtype)) for n, b in module.named_buffers()]
    return sig


def verify_same_model(module: nn.Module, comm: Comm) -> None:
    """Raise ``ValueError`` on every rank if any rank's parameters or buffers differ from rank 0's.

    The message names the first differing parameter or buffer and the rank it differs on.
    """
    sigs = comm.all_gather_object(_signature(module))
    ref = sigs[0]
    for rank, sig in enumerate(sigs[1:], start=1):
        if sig == ref:
            continue
        for k, (mine, theirs) in enumerate(zip(sig, ref)):
            if mine != theirs:
                kind, name, shape, dtype = theirs
                raise ValueError(
                    f"the model on rank {rank} differs from rank 0's at {kind} #{k}: rank 0 has "
                    f"{kind} {name!r} {list(shape)} {dtype}, rank {rank} has {mine[0]} "
                    f"{mine[1]!r} {list(mine[2])} {mine[3]}; every rank must build the same model"
                )
        shorter, longer = (sig, ref) if len(sig) < len(ref) else (ref, sig)
        kind, name, shape, _ = longer[len(shorter)]
        who = 0 if longer is ref else rank
        raise ValueError(
            f"the model on rank {rank} differs from rank 0's: {kind} {name!r} {list(shape)} exists "
            f"only on rank {who}; every rank must build the same model"
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
