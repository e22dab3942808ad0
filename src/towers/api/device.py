"""``device=`` for ``towers.train`` and ``towers.init``: checked in the caller, said in one line.

The choice itself is :func:`towers.core.devices.place`; this module applies what the job
already fixes (a transport; an elastic job runs CPU workers) and prints the
line that says what ``device="auto"`` chose where there was a choice (a GPU is visible).
"""

from __future__ import annotations

import sys

from ..core.compat import elastic_devices, elastic_refusal
from ..core.devices import Placement, narrow, place, visible_gpus
from ..core.launch import Launch
from ..core.modes import Mode
from ..core.transport import Transport

__all__ = ["loop_placement", "train_placement"]


def train_placement(
    request: str, mode: Mode, workers: int, launch: Launch, transport: Transport, elastic: bool
) -> Placement:
    """Where ``towers.train``'s workers compute; rank 0's placement (every rank's ``kind`` is
    the same). Raises ``ValueError`` before any worker starts if ``request`` cannot be served."""
    request = narrow(request, transport)
    if elastic:
        request = _elastic(request, "elastic=True", "drop elastic=True")
    # the asynchronous modes' server is one more process, with a GPU of its own
    local = launch.local_world_size if launch.launched else workers + mode.servers
    rank = launch.local_rank if launch.launched else 0
    placement = place(request, local, visible_gpus(), rank)
    _announce(request, placement, launch.rank if launch.launched else 0, "towers.train")
    return placement


def loop_placement(
    request: str, launch: Launch, backend: str | None, transport: Transport
) -> Placement:
    """Where this own-loop process computes (``towers.init``)."""
    request = narrow(request, transport, backend)
    if launch.elastic:
        request = _elastic(request, "towers run --elastic", "start the job without --elastic")
    local = launch.local_world_size if launch.launched else 1
    placement = place(request, local, visible_gpus(), launch.local_rank if launch.launched else 0)
    _announce(request, placement, launch.rank, "towers.init")
    return placement


def _elastic(request: str, how: str, instead: str) -> str:
    """The device an elastic job's worker computes on, where ``request`` allows it."""
    refused = elastic_refusal(how, device=request, instead=instead)
    if refused is not None:
        raise ValueError(refused)
    return elastic_devices()[0] if request == "auto" else request


def _announce(request: str, placement: Placement, rank: int, where: str) -> None:
    """One line on stderr (rank 0) where ``auto`` had GPUs to choose from."""
    if request == "auto" and rank == 0 and visible_gpus() > 0:
        print(f"{where}: {placement.reason}", file=sys.stderr, flush=True)
