"""Checkpoint files: atomic writes, safe loads, fallback past a damaged newest file.

A checkpoint is a dict of tensors and plain values saved with ``torch.save`` to
``DIR/step-00000123.pt``: written to a temporary file in the same directory, flushed to disk,
then renamed over the final name, so a crash never leaves a half-written checkpoint under a real
name. Files are read with ``torch.load(weights_only=True)``, which refuses to unpickle arbitrary
objects: a checkpoint cannot run code. The newest few are kept; if the newest cannot be read, the
previous one is used, with a warning.
"""

from __future__ import annotations

import os
import re
import tempfile
import warnings
from pathlib import Path
from typing import Any

import torch

__all__ = ["checkpoint_files", "load_latest", "save"]

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


def save(directory: str | os.PathLike[str], step: int, state: dict[str, Any]) -> Path:
    """Write ``state`` as the checkpoint of ``step`` atomically; keep the newest ``KEEP``."""
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


def load_latest(directory: str | os.PathLike[str]) -> dict[str, Any] | None:
    """The newest readable checkpoint in ``directory``, or ``None`` if there is none.

    A file that cannot be read (truncated, corrupt, or holding objects other than tensors and
    plain values) is skipped with a warning in favour of the previous one. If files exist but
    none can be read, ``RuntimeError`` is raised rather than silently starting over.
    """
    files = checkpoint_files(directory)
    problems = []
    for step, path in files:
        try:
            state = torch.load(path, map_location="cpu", weights_only=True)
            if not isinstance(state, dict) or state.get("step") != step:
                raise ValueError("not a towers checkpoint (wrong layout or step)")
        except Exception as exc:
            problems.append(f"{path.name}: {str(exc).splitlines()[0]}")
            warnings.warn(
                f"checkpoint {path} cannot be read ({problems[-1]}); trying the previous one",
                RuntimeWarning,
                stacklevel=2,
            )
            continue
        return state
    if files:
        raise RuntimeError(
            f"no checkpoint in {directory} can be read: {'; '.join(problems)}. Remove the "
            "directory to start over, or point checkpoint= elsewhere"
        )
    return None
