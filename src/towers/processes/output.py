"""What ``towers run`` shows of its ranks' output: every line with its rank, or some ranks only.

With several ranks printing to one terminal, the same line N times says nothing of who printed
it; like torchrun's line prefixes (``[rank1]: ...``), each line of a shown rank is prefixed with
its rank, on the stream it was written to (a line that already starts with it, as PyTorch
writes the traceback of a rank in a process group, keeps the one). ``--show-ranks 0`` (torchrun's
``--local-ranks-filter``) shows one rank only: that rank writes to the terminal itself, unprefixed
(so a progress bar still finds a terminal), and the others' standard output is dropped. The
last lines a hidden rank wrote to standard error are kept, to be shown if it fails.
"""

from __future__ import annotations

import collections
import subprocess
import sys
import threading
from collections.abc import Collection
from typing import IO, Any

__all__ = ["RankOutput"]

TAIL_LINES = 20


class RankOutput:
    """The output streams of ``workers`` ranks, of which ``show`` (default: all) are shown."""

    def __init__(self, workers: int, show: Collection[int] | None = None):
        self.shown = set(range(workers)) if show is None else set(show)
        self.prefixed = len(self.shown) > 1
        self.tails: dict[int, collections.deque[bytes]] = {}
        self.readers: dict[int, list[threading.Thread]] = collections.defaultdict(list)
        self.lock = threading.Lock()

    def streams(self, rank: int) -> dict[str, Any]:
        """``subprocess.Popen`` keywords for rank ``rank``'s standard output and error."""
        if rank in self.shown:
            if not self.prefixed:
                return {}  # the one shown rank writes to the terminal itself
            return {"stdout": subprocess.PIPE, "stderr": subprocess.PIPE}
        self.tails[rank] = collections.deque(maxlen=TAIL_LINES)
        return {"stdout": subprocess.DEVNULL, "stderr": subprocess.PIPE}

    def env(self, rank: int) -> dict[str, str]:
        """Variables for rank ``rank``: a Python whose output is prefixed writes it line by line
        (into a pipe it would hold it back in blocks of 8 KiB)."""
        return {"PYTHONUNBUFFERED": "1"} if self.prefixed and rank in self.shown else {}

    def attach(self, rank: int, proc: Any) -> None:
        """Start copying rank ``rank``'s pipes (if it has any): ``proc.stdout``, ``proc.stderr``
        of a ``subprocess.Popen`` or a :class:`~towers.processes.zygote.Rank`."""
        for pipe, out in ((proc.stdout, sys.stdout), (proc.stderr, sys.stderr)):
            if pipe is not None:
                args = (rank, pipe, out)
                reader = threading.Thread(target=self._copy, args=args, daemon=True)
                reader.start()
                self.readers[rank].append(reader)

    def tail(self, rank: int, wait: float = 1.0) -> list[str]:
        """The last lines a hidden rank wrote to standard error, once it has closed it."""
        if rank not in self.tails:
            return []
        for reader in self.readers[rank]:
            reader.join(wait)
        with self.lock:
            return [line.decode(errors="replace").rstrip("\n") for line in self.tails[rank]]

    def close(self, wait: float = 2.0) -> None:
        """Wait (up to ``wait`` seconds each) until every copied line is out."""
        for readers in self.readers.values():
            for reader in readers:
                reader.join(wait)

    def _copy(self, rank: int, pipe: IO[bytes], out: IO[str]) -> None:
        prefix = f"[rank{rank}]: ".encode()
        with pipe:
            for line in iter(pipe.readline, b""):
                with self.lock:
                    if rank in self.tails:
                        self.tails[rank].append(line)
                        continue
                    if not line.startswith(prefix[:-1]):  # PyTorch prefixes its tracebacks
                        line = prefix + line
                    _write(out, line if line.endswith(b"\n") else line + b"\n")


def _write(out: IO[str], data: bytes) -> None:
    buffer = getattr(out, "buffer", None)
    if buffer is not None:
        out.flush()
        buffer.write(data)
        buffer.flush()
    else:  # a text stream without bytes underneath (e.g. captured by a test harness)
        out.write(data.decode(errors="replace"))
        out.flush()
