"""Parameter-server messages and their transport.

Every message, in both directions, is one flat ``uint8`` tensor of a fixed size: a float64
header, then the model's parameters (or their gradients) and buffers as raw bytes, each slot
8-byte aligned. One message per hop because a Gloo round trip costs about as much as computing a
small model's gradient (docs/async.md); a fixed size because a receiver must post a buffer of the
right size before it knows what arrives. Raw bytes carry every dtype exactly, so a parameter
travels to a worker and back bit for bit.

The server receives from each worker on its own thread with a blocking ``recv`` from that rank:
Gloo's ``Work.is_completed()`` stays ``False`` for point-to-point receives until ``wait()`` is
called, so they cannot be polled, and a receive from *any* source blocks forever when a peer dies,
whereas a receive from a dead rank raises ("Connection closed by peer") at once. A lost worker is
thus reported within milliseconds, under ``towers.spawn`` and under ``torchrun`` alike.
"""

from __future__ import annotations

import contextlib
import queue
import threading
from enum import IntEnum
from typing import NamedTuple

import torch
from torch import nn

from ...comm.base import PointToPoint, Work
from ...core.step import all_finite

__all__ = ["FIELDS", "Field", "Header", "Kind", "Layout", "ServerLink", "WorkerLink", "read_header"]


class Kind(IntEnum):
    REQUEST = 1  # worker -> server: first message, asks for work
    RESULT = 2  # worker -> server: a shard's loss and gradient (local: its loss; params every K)
    PARAMS = 3  # worker -> server (local): its parameters for an average, no shard result
    BYE = 4  # worker -> server: acknowledges STOP; the last message on this link
    WORK = 5  # server -> worker: compute (step, shard) with the attached parameters
    AVERAGE = 6  # server -> worker (local): no shard for you this round; send your parameters
    STOP = 7  # server -> worker: training is over; the final parameters are attached


class Field(IntEnum):
    KIND = 0
    VERSION = 1  # updates applied when the parameters were sent (pulled)
    STEP = 2  # global batch index
    SHARD = 3  # shard index within the global batch
    SAMPLES = 4  # samples behind the gradient (local: behind the parameters since the average)
    LOSS = 5  # loss summed over those samples
    BAD = 6  # 1: the loss or a gradient was not finite
    AUX = 7  # local: the worker's steps since the last average, before this one
    PAYLOAD = 8  # 1: the payload holds parameters (a worker loads them; local: to be averaged)
    WEIGHT = 9  # local, with parameters: samples behind them since the last average


FIELDS = len(Field)
_ALIGN = 8


def _aligned(n: int) -> int:
    return (n + _ALIGN - 1) // _ALIGN * _ALIGN


class Layout:
    """Where each parameter and buffer of a model sits in a message.

    The header is ``FIELDS`` float64 values, then one flag per parameter (1: it has a gradient,
    so a ``None`` gradient stays ``None`` on the server, as in the sync engine).
    """

    def __init__(self, model: nn.Module):
        self.n_params = len(list(model.parameters()))
        self.header_len = FIELDS + self.n_params
        start = _aligned(8 * self.header_len)
        self.slots: list[tuple[int, int]] = []
        for t in self.tensors(model):
            stop = start + t.numel() * t.element_size()
            self.slots.append((start, stop))
            start = _aligned(stop)
        self.size = start

    @staticmethod
    def tensors(model: nn.Module) -> list[torch.Tensor]:
        return [p.data for p in model.parameters()] + list(model.buffers())

    def new(self) -> torch.Tensor:
        """A message with a zeroed header; the payload is written before it is read."""
        msg = torch.empty(self.size, dtype=torch.uint8)
        self.header(msg).zero_()
        return msg

    def header(self, msg: torch.Tensor) -> torch.Tensor:
        return msg[: 8 * self.header_len].view(torch.float64)

    def _view(self, msg: torch.Tensor, i: int, like: torch.Tensor) -> torch.Tensor:
        a, b = self.slots[i]
        return msg[a:b].view(like.dtype).view(like.shape)

    def write_values(self, msg: torch.Tensor, model: nn.Module) -> None:
        """Parameters and buffers into ``msg``."""
        for i, t in enumerate(self.tensors(model)):
            self._view(msg, i, t).copy_(t.detach())

    def read_values(self, msg: torch.Tensor, model: nn.Module) -> None:
        """Parameters and buffers from ``msg`` into ``model``."""
        with torch.no_grad():
            for i, t in enumerate(self.tensors(model)):
                t.copy_(self._view(msg, i, t))

    def write_grads(self, msg: torch.Tensor, model: nn.Module) -> bool:
        """Gradients (and buffers) into ``msg``; returns whether every gradient is finite."""
        header = self.header(msg)
        finite = True
        params = list(model.parameters())
        for i, p in enumerate(params):
            view = self._view(msg, i, p)
            if p.grad is None:
                view.zero_()
                header[FIELDS + i] = 0.0
            else:
                view.copy_(p.grad.detach())
                header[FIELDS + i] = 1.0
                finite = finite and all_finite(p.grad)
        for i, b in enumerate(model.buffers(), start=len(params)):
            self._view(msg, i, b).copy_(b)
        return finite

    def grads(self, msg: torch.Tensor, model: nn.Module) -> list[torch.Tensor | None]:
        """The message's gradients as views, one per parameter (``None``: it had none)."""
        header = self.header(msg)
        return [
            self._view(msg, i, p) if header[FIELDS + i] > 0 else None
            for i, p in enumerate(model.parameters())
        ]

    def read_buffers(self, msg: torch.Tensor, model: nn.Module) -> None:
        n = self.n_params
        with torch.no_grad():
            for i, b in enumerate(model.buffers(), start=n):
                b.copy_(self._view(msg, i, b))

    def values(self, msg: torch.Tensor, model: nn.Module) -> list[torch.Tensor]:
        """The message's parameters and buffers as views."""
        return [self._view(msg, i, t) for i, t in enumerate(self.tensors(model))]

    def stamp(self, msg: torch.Tensor, kind: Kind, **fields: float) -> torch.Tensor:
        """Write ``kind`` and the named header fields (the rest keep their values)."""
        header = self.header(msg)
        header[Field.KIND] = float(kind)
        for name, value in fields.items():
            header[Field[name.upper()]] = float(value)
        return msg


class Header(NamedTuple):
    kind: Kind
    version: int
    step: int
    shard: int
    samples: int
    loss: float
    bad: bool
    aux: int
    payload: bool
    weight: int


def read_header(layout: Layout, msg: torch.Tensor) -> Header:
    h = layout.header(msg)[:FIELDS].tolist()
    return Header(
        kind=Kind(int(h[Field.KIND])),
        version=int(h[Field.VERSION]),
        step=int(h[Field.STEP]),
        shard=int(h[Field.SHARD]),
        samples=int(h[Field.SAMPLES]),
        loss=h[Field.LOSS],
        bad=h[Field.BAD] > 0,
        aux=int(h[Field.AUX]),
        payload=h[Field.PAYLOAD] > 0,
        weight=int(h[Field.WEIGHT]),
    )


class WorkerLink:
    """A worker's side: blocking send and receive with the server (rank 0)."""

    def __init__(self, comm: PointToPoint, layout: Layout):
        self.comm = comm
        self.layout = layout
        self.inbox = layout.new()

    def send(self, msg: torch.Tensor) -> None:
        self.comm.isend(msg, 0).wait()

    def recv(self) -> torch.Tensor:
        self.comm.recv(self.inbox, 0)
        return self.inbox


class ServerLink:
    """The server's side: one receiving thread per worker feeding one queue; sends from the caller.

    :meth:`get` returns ``(tower, message)`` in arrival order, or ``(tower, None)`` once that
    worker's connection failed (it died). A thread ends after a ``BYE`` or a failure.
    """

    def __init__(self, comm: PointToPoint, layout: Layout, towers: int):
        self.comm = comm
        self.layout = layout
        self.inbox: queue.Queue[tuple[int, torch.Tensor | None]] = queue.Queue()
        self.sending: dict[int, tuple[Work, torch.Tensor]] = {}
        self.threads = [
            threading.Thread(target=self._receive, args=(t,), daemon=True, name=f"towers-ps-{t}")
            for t in range(towers)
        ]
        for thread in self.threads:
            thread.start()

    def _receive(self, tower: int) -> None:
        try:
            while True:
                # a new buffer per message: the server may hold several, and no clone is needed
                msg = torch.empty(self.layout.size, dtype=torch.uint8)
                self.comm.recv(msg, tower + 1)
                self.inbox.put((tower, msg))
                if int(self.layout.header(msg)[Field.KIND]) == Kind.BYE:
                    return
        except Exception:
            self.inbox.put((tower, None))

    def get(self, timeout: float | None = None) -> tuple[int, torch.Tensor | None]:
        return self.inbox.get(timeout=timeout)

    def send(self, tower: int, msg: torch.Tensor) -> None:
        """Start sending ``msg`` (not to be modified afterwards) to ``tower``."""
        self._settle(tower)
        self.sending[tower] = (self.comm.isend(msg, tower + 1), msg)

    def _settle(self, tower: int) -> None:
        previous = self.sending.pop(tower, None)
        if previous is not None:
            # A failed send means the worker died; its receiving thread reports that.
            with contextlib.suppress(Exception):
                previous[0].wait()

    def close(self, timeout: float = 10.0) -> None:
        for tower in list(self.sending):
            self._settle(tower)
        for thread in self.threads:
            thread.join(timeout)
