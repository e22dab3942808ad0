"""What a job can run on, derived from what its parts declare: one check per question.

A transport declares the devices whose tensors it moves and whether an elastic job can regroup
over it (:class:`~towers.core.transport.Transport`); a mode declares whether its result is
exact under any split of the global batch and whether it reduces every step
(:class:`~towers.core.modes.Mode`). The refusals below are written from those declarations,
so a new transport or mode is refused or allowed by what it declares, in the same words, and
no caller states "elastic means CPU" or "only sync is exact" again.
"""

from __future__ import annotations

from .modes import Engine, Mode
from .transport import Transport

__all__ = ["elastic_devices", "elastic_refusal", "server_refusal", "uneven_split_refusal"]


def _regroupable() -> list[Transport]:
    """The registered transports an elastic job can regroup over (``auto`` picks one)."""
    return [t for t in Transport.registered() if t.elastic and t is not Transport.AUTO]


def elastic_devices() -> list[str]:
    """The devices an elastic job's workers can compute on: those of the transports it can
    regroup over."""
    found: list[str] = []
    for t in _regroupable():
        found += [d for d in t.devices if d not in found]
    return found


def _elastic_transports() -> str:
    return " or ".join(t.title for t in _regroupable())


def elastic_refusal(
    how: str,
    *,
    device: str = "auto",
    transport: Transport = Transport.AUTO,
    asked: str | None = None,
    instead: str,
) -> str | None:
    """Why an elastic job (``how``: ``"elastic=True"``, ``"towers run --elastic"``) cannot run
    on ``device`` over ``transport``, or ``None`` if it can. ``asked``: how the transport was
    asked for, as the user wrote it (default ``transport='...'``); ``instead``: how to train
    without it (``"drop elastic=True"``)."""
    devices = elastic_devices()
    runs = f"{how} runs {'/'.join(d.upper() for d in devices)} workers ({_elastic_transports()})"
    if not transport.elastic:
        named = asked or f"transport={transport.name!r}"
        kind = named.split("=")[0]  # transport=, or a process group's backend=
        usable = [t for t in _regroupable() if kind != "backend" or t.backend]
        values = " or ".join(repr(t.name) for t in usable)
        return f"{named}: {runs}; pass {kind}={values}, or {instead} to train on GPUs"
    if device != "auto" and device not in devices:
        choices = " or ".join(repr(d) for d in [*devices, "auto"])
        return f"device={device!r}: {runs}; pass device={choices}, or {instead} to train on GPUs"
    return None


def uneven_split_refusal(mode: Mode) -> str | None:
    """Why a split other than :func:`towers.split`'s would change ``mode``'s result, or
    ``None`` if the mode is exact under any split (or is not trained by splitting batches)."""
    if mode.engine is Engine.SYNC and not mode.exact_under_any_split:
        return (
            f"in mode {str(mode)!r} each tower steps alone on its shard, so the split changes "
            "what each tower learns"
        )
    return None


def server_refusal(mode: Mode, transport: Transport) -> str | None:
    """Why the parameter server's ``mode`` cannot send its messages over ``transport``, or
    ``None`` if it can: the server and its towers message each other point to point, over
    their own shared memory on one host or over a process group's backend, and sum nothing."""
    if mode.engine is not Engine.SERVER:
        return None
    if transport is Transport.AUTO or transport is Transport.SHM or transport.backend:
        return None
    usable = [t for t in Transport.registered() if t is Transport.SHM or t.backend]
    return (
        f"transport={transport.name!r} carries the towers' sums, and in mode {str(mode)!r} a "
        "parameter server and its towers send each other messages instead: pass transport="
        f"{' or '.join(repr(t.name) for t in [Transport.AUTO, *usable])}"
    )
