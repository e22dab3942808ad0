"""Checkpoint files: one schema for every writer, atomic writes, safe loads, fallback.

A checkpoint is a dict of tensors and plain values saved with ``torch.save`` to
``DIR/step-00000123.pt``. Every writer (``towers.train`` in sync mode, the parameter server, an
own loop's ``Context.save_checkpoint``) uses one header: ``format`` ("towers"), ``version``,
``kind`` (who wrote it: ``sync``, ``ps`` or ``loop``) and ``step``; the rest is the writer's.
A reader asks for its kind, and a directory written by another kind is refused with a message
that says so, instead of a ``KeyError`` somewhere later. Files of version 1 (before the header
had a kind) are read and upgraded.

Writes go to a temporary file in the same directory, are flushed to disk, then renamed over the
final name, so a crash never leaves a half-written checkpoint under a real name; temporary files
left by a killed writer are removed when the next run starts (:func:`prepare_directory`). Every
file carries ``sha256``, a digest of its content (every tensor's bytes, dtype and shape, every
plain value), checked when it is read: a flipped bit on disk is found, not trained on. The file
stays a plain ``torch.save`` dict, so ``torch.load`` still opens it. Files are read with
``torch.load(weights_only=True)``, which refuses to unpickle arbitrary objects: a checkpoint cannot
run code. The newest two are kept; if the newest cannot be read, the previous one is used, with a
warning naming both.
"""

from __future__ import annotations

import hashlib
import io
import os
import re
import shutil
import tempfile
import warnings
from pathlib import Path
from typing import Any

import torch

from ..core.devices import moved
from ..core.messages import first_line

__all__ = [
    "KINDS",
    "VERSION",
    "check_part",
    "checkpoint_files",
    "digest",
    "estimate_bytes",
    "load_latest",
    "prepare_directory",
    "replica_optimizer",
    "save",
    "save_or_warn",
]

VERSION = 4
KINDS = {
    "sync": "towers.train in sync mode",
    "ps": "towers.train in an asynchronous mode (the parameter server)",
    "loop": "an own training loop (Context.save_checkpoint)",
}
# why a reader cannot resume another kind's checkpoint, where the reason is not plain
_UNREADABLE = {
    ("loop", "sync"): (
        " (an own loop brings its own batches: its checkpoint does not say where towers.train "
        "would stand in its data order; ctx.load_checkpoint resumes it, and resumes "
        "towers.train's too)"
    ),
    ("ps", "loop"): " (the parameter server's state is not a synchronous run's)",
    ("sync", "ps"): " (a synchronous run's state is not the parameter server's)",
    ("loop", "ps"): " (a synchronous run's state is not the parameter server's)",
}
_NAME = re.compile(r"^step-(\d+)\.pt$")
_PART = re.compile(r"^step-(\d+)\.part-\d+\.pt$")
_TMP = ".tmp-"
KEEP = 2


def digest(state: Any) -> str:
    """sha256 of a checkpoint's content: tensors by dtype, shape and bytes; plain values by repr."""
    h = hashlib.sha256()

    def walk(value: Any) -> None:
        if isinstance(value, torch.Tensor):
            t = value.detach().cpu().contiguous()
            h.update(f"T{t.dtype}{tuple(t.shape)}".encode())
            if t.numel():
                h.update(t.reshape(-1).view(torch.uint8).numpy().data)  # read in place, not copied
        elif isinstance(value, dict):
            h.update(f"D{len(value)}".encode())
            for key in sorted(value, key=lambda k: (type(k).__name__, repr(k))):
                walk(key)
                walk(value[key])
        elif isinstance(value, (list, tuple)):
            h.update(f"{type(value).__name__[0]}{len(value)}".encode())
            for item in value:
                walk(item)
        else:
            h.update(f"V{type(value).__name__}:{value!r};".encode())

    walk(state)
    return h.hexdigest()


def estimate_bytes(model: torch.nn.Module, samples: int) -> int:
    """About how large one checkpoint of ``model`` trained on ``samples`` samples will be.

    The parameters and buffers, twice the parameters again for the optimizer (Adam keeps two
    moments; SGD with momentum one), the data position (one permutation of the samples), and
    64 KiB for the rest (RNG states, the record).
    """
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    buffers = sum(b.numel() * b.element_size() for b in model.buffers())
    return 3 * params + buffers + 8 * samples + 64 * 1024


def _size(n: int) -> str:
    return f"{n / 2**20:.1f} MiB" if n >= 2**20 else f"{n / 1024:.0f} KiB"


def prepare_directory(directory: str | os.PathLike[str], need_bytes: int) -> None:
    """Make sure a checkpoint can be written to ``directory`` before training starts.

    Creates it, removes temporary files a killed writer left, writes and removes a probe file,
    and checks that ``need_bytes`` (one more checkpoint) fit on its file system.

    Raises:
        OSError: naming the directory, the problem and the fix.
    """
    root = Path(directory)
    try:
        root.mkdir(parents=True, exist_ok=True)
        for stale in root.glob(f"{_TMP}*"):
            stale.unlink(missing_ok=True)
        fd, probe = tempfile.mkstemp(dir=root, prefix=_TMP, suffix=".probe")
        os.close(fd)
        os.unlink(probe)
    except OSError as exc:
        raise type(exc)(
            exc.errno,
            f"cannot write checkpoints to {root}: {exc.strerror}; make it writable or choose "
            "another checkpoint= directory",
        ) from None
    free = shutil.disk_usage(root).free
    if free < need_bytes:
        raise OSError(
            28,  # ENOSPC
            f"the checkpoint directory {root} has {_size(free)} free; one checkpoint needs "
            f"about {_size(need_bytes)} (parameters, optimizer state, data position): free some "
            "space or choose another checkpoint= directory",
        )


def checkpoint_files(directory: str | os.PathLike[str]) -> list[tuple[int, Path]]:
    """``(step, path)`` of every checkpoint in ``directory``, newest first."""
    root = Path(directory)
    if not root.is_dir():
        return []
    found = []
    for path in root.iterdir():
        match = _NAME.match(path.name)
        if match:
            found.append((int(match.group(1)), path))
    return sorted(found, reverse=True)


def save(directory: str | os.PathLike[str], step: int, kind: str, payload: dict[str, Any]) -> Path:
    """Write ``payload`` as ``kind``'s checkpoint of ``step`` atomically; keep the newest two."""
    header = {"format": "towers", "version": VERSION, "kind": kind, "step": step}
    assert kind in KINDS and not set(header) & set(payload), (kind, sorted(payload))
    state = moved(header | payload, "cpu")  # a checkpoint written on GPUs loads anywhere
    state["sha256"] = digest(state)
    # Serialise in memory first: a full disk then fails in a plain write with ENOSPC, not deep
    # in torch's zip writer ("unexpected pos").
    buffer = io.BytesIO()
    torch.save(state, buffer)
    root = Path(directory)
    final = root / f"step-{step:08d}.pt"
    _write(root, final, buffer)
    for _, old in checkpoint_files(root)[KEEP:]:
        old.unlink(missing_ok=True)
    kept = {s for s, _ in checkpoint_files(root)}
    for part in root.glob("step-*.part-*.pt"):
        # the dropped checkpoints' parts, and parts left without a checkpoint; not those of a
        # later step, which other ranks may be writing for the next checkpoint
        written = _PART.match(part.name)
        if written and int(written.group(1)) < step and int(written.group(1)) not in kept:
            part.unlink(missing_ok=True)
    return final


def _write(root: Path, final: Path, buffer: io.BytesIO) -> None:
    """Write ``buffer`` to ``final`` atomically (a temporary file, then a rename), durably."""
    root.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=root, prefix=_TMP, suffix=".pt")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(buffer.getbuffer())
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, final)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    dir_fd = os.open(root, os.O_RDONLY)
    try:
        os.fsync(dir_fd)  # the rename itself survives a power loss
    finally:
        os.close(dir_fd)


def part_path(directory: str | os.PathLike[str], step: int, rank: int) -> Path:
    """Where rank ``rank`` writes its part of a sharded state for the checkpoint of ``step``
    (written before the checkpoint itself, which says how many parts it has)."""
    return Path(directory) / f"step-{step:08d}.part-{rank:05d}.pt"


def drop_parts(directory: str | os.PathLike[str], step: int) -> None:
    """Remove the parts of the checkpoint of ``step`` (its main file could not be written)."""
    for part in Path(directory).glob(f"step-{step:08d}.part-*.pt"):
        part.unlink(missing_ok=True)


def save_part(directory: str | os.PathLike[str], step: int, rank: int, part: Any) -> str:
    """Write one rank's part of the checkpoint of ``step`` atomically; its sha256, which the
    checkpoint records."""
    buffer = io.BytesIO()
    torch.save(part, buffer)
    _write(Path(directory), part_path(directory, step, rank), buffer)
    return hashlib.sha256(buffer.getbuffer()).hexdigest()


def read_part(directory: str | os.PathLike[str], step: int, rank: int) -> Any:
    """One rank's part of the checkpoint of ``step``, mapped rather than read whole (reading
    the checkpoint, :func:`load_latest`, checked every part against its recorded sha256)."""
    return torch.load(
        part_path(directory, step, rank), map_location="cpu", weights_only=True, mmap=True
    )


def check_part(directory: str | os.PathLike[str], step: int, rank: int, sha256: str) -> None:
    """``ValueError`` unless rank ``rank``'s part of the checkpoint of ``step`` is there, whole."""
    path = part_path(directory, step, rank)
    found = hashlib.sha256()
    try:
        with open(path, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                found.update(block)
    except FileNotFoundError:
        raise ValueError(
            f"{path.name} is missing: the checkpoint of step {step} has a part from every "
            "tower, written where that tower runs; across hosts, checkpoint into a directory "
            "every host shares"
        ) from None
    if found.hexdigest() != sha256:
        raise ValueError(f"{path.name} does not match the sha256 its checkpoint recorded")


def save_or_warn(
    directory: str | os.PathLike[str], step: int, kind: str, payload: dict[str, Any]
) -> Path | None:
    """:func:`save`, but a failed write (full disk, a directory gone read-only) only warns.

    Training goes on with its state in memory, and its result is returned as usual; only a
    resume would start from an older checkpoint, which the warning names.
    """
    try:
        return save(directory, step, kind, payload)
    except OSError as exc:
        warn_unwritten(directory, step, first_line(exc))
        return None


def warn_unwritten(directory: str | os.PathLike[str], step: int, why: str) -> None:
    """Warn that the checkpoint of ``step`` was not written, and which one a resume would use."""
    files = checkpoint_files(directory)
    previous = f"the newest saved one is {files[0][1]}" if files else "none was saved"
    warnings.warn(
        f"checkpoint of step {step} could not be written to {directory} ({why}); "
        f"training goes on and its result is kept in memory, but a resume would start from "
        f"an older checkpoint ({previous})",
        RuntimeWarning,
        stacklevel=3,
    )


def _upgrade(state: dict[str, Any]) -> dict[str, Any]:
    """An older checkpoint in today's schema: version 1 had no kind; before version 3 an own
    loop's checkpoint kept its mode's own keys under ``plan`` (and, in DiLoCo, its local model
    as ``model``), where ``towers.train``'s kept them at the top; before version 4 a synchronous
    run's parts lay side by side at the top (:func:`_nested`)."""
    if state.get("format") != "towers":
        state = _first(state)
    if state["kind"] == "loop" and state["version"] < 3 and "plan" in state:
        state = dict(state)
        state.update(state.pop("plan"))
    if state["kind"] in ("sync", "loop") and state["version"] < 4:
        state = _nested(state)
    return state


def _first(state: dict[str, Any]) -> dict[str, Any]:
    """A checkpoint of version 1, which had no kind, with its kind."""
    if state.get("format") != 1:
        raise ValueError("not a towers checkpoint (no format header)")
    state = dict(state)
    if "extra" in state:
        state["kind"] = "loop"
    elif "position" in state:
        state["kind"] = "ps"
        state["updates"] = state.pop("version")
    else:
        state["kind"] = "sync"
        state["record"] = state.pop("history")
        state["scheduled"] = state["step"]
    state["format"], state["version"] = "towers", 1
    return state


def _nested(state: dict[str, Any]) -> dict[str, Any]:
    """A synchronous run's checkpoint of version 3 or before, whose replica, random streams
    and plan lay side by side at the top (DiLoCo's outer model as ``model``, replacing the
    replica's, and its own keys under ``diloco``), with each part under its own key."""
    state = dict(state)
    streams = {k: state.pop(k) for k in ("rng", "transform", "cuda_rng") if k in state}
    own = {k: state.pop(k, None) for k in ("optimizer", "schedule", "scheduled")}
    plan = state.pop("diloco", None)
    replica = None if plan is not None else {"model": state["model"], **own}
    state.update(replica=replica, streams=streams, plan=plan or {})
    state.setdefault("balance", None)
    return state


def replica_optimizer(state: dict[str, Any]) -> Any:
    """The replica's optimizer state in a checkpoint of today's layout (a sharded one: its
    description, whose parts lie in files of their own); ``None`` where it has none (DiLoCo's
    replicas are the plan's)."""
    return (state.get("replica") or {}).get("optimizer")


def _read(path: Path, step: int, parts: bool = True) -> dict[str, Any]:
    if path.stat().st_size == 0:
        raise ValueError("the file is empty (0 bytes)")
    state = torch.load(path, map_location="cpu", weights_only=True)
    if not isinstance(state, dict):
        raise ValueError("not a towers checkpoint (not a dict)")
    expected = state.pop("sha256", None)  # files written before checksums have none
    if expected is not None and digest(state) != expected:
        raise ValueError("its content does not match its sha256 checksum: the file is corrupt")
    state = _upgrade(state)
    if state.get("step") != step:
        raise ValueError(f"not a towers checkpoint (it says step {state.get('step')!r})")
    if state["version"] > VERSION:
        raise ValueError(
            f"written by a newer towers (checkpoint version {state['version']}, this towers "
            f"reads up to {VERSION}); upgrade towers"
        )
    optimizer = replica_optimizer(state)
    if parts and isinstance(optimizer, dict) and "sharded" in optimizer:  # every part, whole
        for rank, sha256 in enumerate(optimizer["sharded"]["parts"]):
            check_part(path.parent, step, rank, sha256)
    return state


def load_latest(
    directory: str | os.PathLike[str],
    kind: str,
    also: tuple[str, ...] = (),
    *,
    parts: bool = True,
    below: int | None = None,
    problems: tuple[str, ...] = (),
) -> dict[str, Any] | None:
    """The newest readable checkpoint of ``kind`` (or of a kind in ``also``, which the reader
    resumes too) in ``directory``, or ``None`` if there is none.

    ``parts=False`` leaves the parts of a sharded optimizer state unchecked (the ranks that read
    them check their own); ``below``: only checkpoints of earlier steps, after the newer ones
    had ``problems``.

    A file that cannot be read (truncated, corrupt, or holding objects other than tensors and
    plain values) is skipped with a warning in favour of the previous one. If files exist but
    none can be read, ``RuntimeError`` is raised rather than silently starting over.

    Raises:
        ValueError: if the newest readable checkpoint was written by another kind of run.
    """
    files = [(s, p) for s, p in checkpoint_files(directory) if below is None or s < below]
    found = list(problems)  # the newer ones' (``below``), then each file's that cannot be read
    newest = None if below is None else Path(directory) / f"step-{below:08d}.pt"
    for step, path in files:
        newest = newest or path
        try:
            state = _read(path, step, parts)
        except Exception as exc:
            found.append(f"{path.name}: {first_line(exc)}")
            continue
        if found:
            warnings.warn(
                f"checkpoint {newest} cannot be read ({'; '.join(found)}); "
                f"resuming from the previous one, {path}",
                RuntimeWarning,
                stacklevel=2,
            )
        if state["kind"] != kind and state["kind"] not in also:
            theirs = state["kind"]
            why = _UNREADABLE.get((theirs, kind), "")
            raise ValueError(
                f"the checkpoint directory {directory} holds checkpoints of "
                f"{KINDS.get(theirs, theirs)}, not of {KINDS[kind]}{why}; use another "
                "directory for this run"
            )
        return state
    if found:
        warnings.warn(
            f"checkpoints in {directory} cannot be read ({'; '.join(found)})",
            RuntimeWarning,
            stacklevel=2,
        )
        raise RuntimeError(
            f"no checkpoint in {directory} can be read: {'; '.join(found)}. Remove the "
            "directory to start over, or point checkpoint= elsewhere"
        )
    return None
