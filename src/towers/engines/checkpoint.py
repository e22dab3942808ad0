"""Checkpoint files: one schema for every writer, atomic writes, safe loads, fallback.

A checkpoint is a dict of tensors and plain values saved with ``torch.save`` to
``DIR/step-00000123.pt``. Every writer (``towers.train`` in sync mode, the parameter server, an
own loop's ``Context.save_checkpoint``) uses one header: ``format`` ("towers"), ``version``,
``kind`` (who wrote it: ``sync``, ``ps`` or ``loop``) and ``step``; the rest is the writer's.
A reader asks for its kind, and a directory written by another kind is refused with a message
that says so, instead of a ``KeyError`` somewhere later. Files of version 1 (before the header
had a kind) are read and upgraded.

Writes go to a temporary file in the same directory, are flushed to disk, then renamed over the
final name, so a crash never leaves a half-written checkpoint under a real name. Files are read
with ``torch.load(weights_only=True)``, which refuses to unpickle arbitrary objects: a checkpoint
cannot run code. The newest two are kept; if the newest cannot be read, the previous one is used,
with a warning.
"""

from __future__ import annotations

import os
import re
import tempfile
import warnings
from pathlib import Path
from typing import Any

import torch

from ..core.messages import first_line

__all__ = ["KINDS", "VERSION", "checkpoint_files", "load_latest", "save"]

VERSION = 2
KINDS = {
    "sync": "towers.train in sync mode",
    "ps": "towers.train in an asynchronous mode (the parameter server)",
    "loop": "an own training loop (Context.save_checkpoint)",
}
_NAME = re.compile(r"^step-(\d+)\.pt$")
KEEP = 2


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
    state = header | payload
    root = Path(directory)
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"step-{step:08d}.pt"
    fd, tmp = tempfile.mkstemp(dir=root, prefix=".tmp-", suffix=".pt")
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(state, f)
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
    for _, old in checkpoint_files(root)[KEEP:]:
        old.unlink(missing_ok=True)
    return final


def _upgrade(state: dict[str, Any]) -> dict[str, Any]:
    """A version-1 checkpoint in today's schema (version 1 had no kind)."""
    if state.get("format") == "towers":
        return state
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


def _read(path: Path, step: int) -> dict[str, Any]:
    state = torch.load(path, map_location="cpu", weights_only=True)
    if not isinstance(state, dict):
        raise ValueError("not a towers checkpoint (not a dict)")
    state = _upgrade(state)
    if state.get("step") != step:
        raise ValueError(f"not a towers checkpoint (it says step {state.get('step')!r})")
    if state["version"] > VERSION:
        raise ValueError(
            f"written by a newer towers (checkpoint version {state['version']}, this towers "
            f"reads up to {VERSION}); upgrade towers"
        )
    return state


def load_latest(directory: str | os.PathLike[str], kind: str) -> dict[str, Any] | None:
    """The newest readable checkpoint of ``kind`` in ``directory``, or ``None`` if there is none.

    A file that cannot be read (truncated, corrupt, or holding objects other than tensors and
    plain values) is skipped with a warning in favour of the previous one. If files exist but
    none can be read, ``RuntimeError`` is raised rather than silently starting over.

    Raises:
        ValueError: if the newest readable checkpoint was written by another kind of run.
    """
    files = checkpoint_files(directory)
    problems = []
    for step, path in files:
        try:
            state = _read(path, step)
        except Exception as exc:
            problems.append(f"{path.name}: {first_line(exc)}")
            warnings.warn(
                f"checkpoint {path} cannot be read ({problems[-1]}); trying the previous one",
                RuntimeWarning,
                stacklevel=2,
            )
            continue
        if state["kind"] != kind:
            raise ValueError(
                f"the checkpoint directory {directory} holds checkpoints of "
                f"{KINDS.get(state['kind'], state['kind'])}, not of {KINDS[kind]}; use "
                "another directory for this run"
            )
        return state
    if files:
        raise RuntimeError(
            f"no checkpoint in {directory} can be read: {'; '.join(problems)}. Remove the "
            "directory to start over, or point checkpoint= elsewhere"
        )
    return None
