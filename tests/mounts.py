"""A small file system mounted for one test: read-only, or full after a few kilobytes.

Needs root and ``mount``; tests that use :func:`tmpfs` are skipped with the reason otherwise.
:func:`small_shm` runs a command with a /dev/shm of its own, in a private mount namespace
(``unshare -m``), so that the rest of the machine keeps its /dev/shm.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest


@contextlib.contextmanager
def tmpfs(path: Path, options: str) -> Iterator[Path]:
    """Mount a tmpfs with ``options`` (e.g. ``"size=64k"``, ``"ro"``) at ``path``."""
    if os.geteuid() != 0 or shutil.which("mount") is None:
        pytest.skip("mounting a tmpfs needs root and mount(8)")
    path.mkdir(parents=True, exist_ok=True)
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(path)], capture_output=True, text=True
    )
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


def fill(directory: Path) -> None:
    """Write to ``directory`` until its file system is full."""
    fd = os.open(directory / "filler", os.O_WRONLY | os.O_CREAT)
    try:
        while os.write(fd, b"\0" * 4096):
            pass
    except OSError:
        pass
    finally:
        os.close(fd)


def small_shm(args: list[str], size: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    """Run ``args`` with a tmpfs of ``size`` (e.g. ``"16m"``) over /dev/shm, seen by it alone."""
    if os.geteuid() != 0 or shutil.which("unshare") is None or shutil.which("mount") is None:
        pytest.skip("a private /dev/shm needs root, unshare(1) and mount(8)")
    mount = f"mount -t tmpfs -o size={size},mode=1777 tmpfs /dev/shm"
    done = subprocess.run(
        ["unshare", "-m", "--propagation", "private", "sh", "-c", f'{mount} && exec "$@"', "sh",
         *args],
        capture_output=True,
        text=True,
        timeout=timeout,
    )  # fmt: skip
    if done.returncode != 0 and "mount" in done.stderr and "tmpfs" in done.stderr:
        pytest.skip(f"cannot mount a private /dev/shm here: {done.stderr.strip()}")
    return done
