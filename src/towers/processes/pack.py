"""Send a job to worker processes with all its tensors in one shared-memory buffer.

``multiprocessing`` pickles a process's arguments with PyTorch's reducers, which move every
tensor's storage to shared memory and pass it as one file descriptor of its own. A Dataset that
holds one tensor per sample then needs one descriptor per sample: ``forkserver`` refuses more
than a few hundred ("too many fds"), and other start methods hit the open-file limit ("Too many
open files"). :func:`pack` instead pickles the arguments with every CPU storage left out
(a reduction of their own, as ``torch.save`` does) and copies the storages, back to back, into one
shared buffer: one descriptor whatever the number of tensors, one copy of the data in the caller,
none in the workers, whose tensors are views of the buffer. The caller's tensors are not moved.

The buffer lives in ``/dev/shm``, often small in containers (Docker gives 64 MB). A job whose
tensors do not fit is refused before any worker starts, saying how much is needed and free and
what to do; torch's own failure would leave its half-made file behind. Files that killed jobs
left there are swept first (:func:`towers.comm.segment.sweep`).
"""

from __future__ import annotations

import contextlib
import contextvars
import ctypes
import errno
import io
import os
import pickle
import re
from dataclasses import dataclass
from typing import Any

import torch

from ..comm.segment import SHM_DIR, free_space, size_text, sweep

__all__ = ["Packed", "check_picklable", "pack", "unpack"]

_TYPED = torch.storage.TypedStorage
_ALIGN = 64  # bytes: every storage starts on a cache line, so any dtype's view is aligned


@dataclass
class Packed:
    """Pickled bytes and the one shared buffer their storages live in."""

    pickled: bytes
    buffer: torch.Tensor  # uint8, in shared memory
    spans: list[tuple[int, int]]  # (offset, bytes) of each storage in the buffer


class _Source:
    """The buffer being unpacked: each storage as its own storage object, made once."""

    def __init__(self, packed: Packed):
        self.whole = packed.buffer.untyped_storage()
        self.spans = packed.spans
        self.made: dict[int, torch.UntypedStorage] = {}

    def storage(self, i: int) -> torch.UntypedStorage:
        if i not in self.made:
            start, size = self.spans[i]
            # a storage of its own size (sharing the buffer's memory): copying or saving a
            # tensor copies its storage, which must not be the whole buffer
            self.made[i] = self.whole[start : start + size]
        return self.made[i]


_SOURCE: contextvars.ContextVar[_Source] = contextvars.ContextVar("towers_unpacking")


def _rebuild_tensor(
    i: int,
    dtype: torch.dtype,
    offset: int,
    size: tuple[int, ...],
    stride: tuple[int, ...],
    requires_grad: bool,
) -> torch.Tensor:
    untyped = _SOURCE.get().storage(i)
    t = torch.empty(0, dtype=dtype).set_(untyped, offset, size, stride)  # type: ignore[call-overload]
    return t.requires_grad_(requires_grad) if requires_grad else t


def _rebuild_storage(i: int, dtype: torch.dtype | None) -> Any:
    untyped = _SOURCE.get().storage(i)
    if dtype is None:
        return untyped
    return torch.storage.TypedStorage(wrap_storage=untyped, dtype=dtype, _internal=True)


class _Pickler(pickle.Pickler):
    """Pickles CPU tensors and storages as references to the buffer (``reducer_override`` is
    called for objects of non-builtin types only: cheaper than ``persistent_id``, called for
    every object)."""

    def __init__(self, file: Any):
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
        self.storages: list[torch.UntypedStorage] = []
        self.index: dict[int, int] = {}

    def reducer_override(self, obj: Any) -> Any:
        kind = type(obj)
        if kind is torch.Tensor:
            # A plain dense CPU tensor, directly: torch's own reduction costs several times
            # more, which counts for a Dataset of one small tensor per sample.
            if (
                obj.device.type != "cpu"
                or obj.layout != torch.strided
                or obj.is_quantized
                or obj._backward_hooks
                or obj.__dict__
            ):
                return NotImplemented
            i = self._add(obj.untyped_storage())
            shape = tuple(obj.shape)  # a plain tuple: torch.Size reduces in Python, per tensor
            args = (i, obj.dtype, obj.storage_offset(), shape, obj.stride(), obj.requires_grad)
            return _rebuild_tensor, args
        if kind is _TYPED and obj.device.type == "cpu":
            return _rebuild_storage, (self._add(obj._untyped_storage), obj.dtype)
        if kind is torch.UntypedStorage and obj.device.type == "cpu":
            return _rebuild_storage, (self._add(obj), None)
        return NotImplemented  # pickled as usual (GPU storages by value, rebuilt on device)

    def _add(self, untyped: torch.UntypedStorage) -> int:
        key = untyped._cdata  # storages shared by several tensors are sent once
        if key not in self.index:
            self.index[key] = len(self.storages)
            self.storages.append(untyped)
        return self.index[key]


def pack(obj: Any) -> Packed:
    """``obj`` pickled, its CPU tensors' storages copied into one shared-memory buffer."""
    out = io.BytesIO()
    pickler = _Pickler(out)
    pickler.dump(obj)
    spans, end = [], 0
    for s in pickler.storages:
        spans.append((end, s.nbytes()))
        end += -(-s.nbytes() // _ALIGN) * _ALIGN
    buffer = _shared(end)
    base = buffer.data_ptr()
    for s, (start, size) in zip(pickler.storages, spans):
        if size:
            ctypes.memmove(base + start, s.data_ptr(), size)  # no tensor per storage: cheaper
    return Packed(out.getvalue(), buffer, spans)


def _shared(nbytes: int) -> torch.Tensor:
    """``nbytes`` of shared memory, or an ``OSError`` that says how to make room for them."""
    sweep()
    try:
        free, total = free_space()
    except OSError:  # no /dev/shm: torch says what it cannot do
        return torch.empty(nbytes, dtype=torch.uint8).share_memory_()
    if nbytes > free:
        raise _no_room(nbytes, free, total)
    try:
        return torch.empty(nbytes, dtype=torch.uint8).share_memory_()
    except RuntimeError as exc:  # the room went to another process meanwhile
        made = re.search(r"<(/torch_\d+_[^>]*)>", str(exc))
        if made is not None:  # torch leaves the file it could not fill
            with contextlib.suppress(OSError):
                os.unlink(SHM_DIR + made.group(1))
        if "No space left" not in str(exc):
            raise
        raise _no_room(nbytes, *free_space()) from None


def _no_room(nbytes: int, free: int, total: int) -> OSError:
    return OSError(
        errno.ENOSPC,
        f"the job's tensors (the data, the model and whatever else goes to the workers) need "
        f"{size_text(nbytes)} of shared memory to reach the worker processes, and {SHM_DIR} has "
        f"{size_text(free)} free (of {size_text(total)}). Give {SHM_DIR} more room (docker run "
        "--shm-size=2g, or as root: mount -o remount,size=2G /dev/shm), or send less: a "
        "Dataset that reads its samples from disk in __getitem__ is sent as the object alone, "
        "and train(..., workers=1) trains in this process",
    )


def check_picklable(obj: Any) -> None:
    """Raise what :func:`pack` would raise for ``obj``, without copying any tensor's data."""
    _Pickler(_Discard()).dump(obj)  # type: ignore[arg-type]


class _Discard:
    def write(self, data: bytes) -> int:
        return len(data)


def unpack(packed: Packed) -> Any:
    """The object :func:`pack` packed; its tensors are views of the shared buffer."""
    token = _SOURCE.set(_Source(packed))
    try:
        return pickle.loads(packed.pickled)
    finally:
        _SOURCE.reset(token)
