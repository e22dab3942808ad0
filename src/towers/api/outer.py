"""What DiLoCo's default outer step costs in quality, said at the start of a job that uses it.

No outer step keeps ``diloco:H`` as good as ``sync`` at equal samples on every model: the
towers drift apart within a period, and the outer step that suits one model overshoots on
another (docs/diloco.md, "Choosing the outer step"). A job in a DiLoCo mode with the default
outer optimizer therefore says, once, what the default measured against ``sync`` and what to
do for results that must equal it.
"""

from __future__ import annotations

import sys
from typing import Any

from ..core.modes import Mode

__all__ = ["announce_outer", "describe_outer"]


def describe_outer(mode: Mode, outer_optimizer: Any, towers: int, where: str) -> str | None:
    """The line :func:`announce_outer` prints, or ``None`` where there is nothing to say."""
    if mode.name != "diloco" or outer_optimizer is not None or towers < 2:
        return None
    return (
        f"{where}: mode {str(mode)!r} with the default outer step (Nesterov SGD, lr 0.6, "
        "momentum 0.5): at equal samples DiLoCo ended 0.98 to 1.14 times sync's held-out loss "
        "on the model zoo at H = 8 and 16 (docs/diloco.md). For results equal to one "
        "process's, train in mode 'sync' (compress= for a slow link); to tune DiLoCo for your "
        "model, pass outer_optimizer="
    )


def announce_outer(mode: Mode, outer_optimizer: Any, towers: int, where: str, rank: int) -> None:
    """Print :func:`describe_outer`'s line to stderr, once per job (by ``rank`` 0)."""
    line = describe_outer(mode, outer_optimizer, towers, where)
    if line is not None and rank == 0:
        print(line, file=sys.stderr, flush=True)
