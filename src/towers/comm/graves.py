"""Process groups of abandoned generations: let go of at once, shut down once nothing waits.

Destroying a Gloo group joins its threads, and so waits for the work it has in flight. After a
lost peer that work can wait on another *survivor*: with a collective in two phases (int8's
all-to-all, then an all-gather) one survivor can finish the first phase and wait in the second
for a survivor whose first phase failed, which has abandoned the generation but still holds its
sockets open while it, in turn, destroys its own group. Both then sit in the destroy until
Gloo's timeout (30-60 s of a recovery that otherwise takes 0.1 s). An elastic worker therefore
only unregisters an abandoned default group, so that the next generation forms at once, and
keeps the group object here; it is shut down once its work has surely ended (Gloo's own
timeout has passed since it was abandoned) or when the connection closes, while the interpreter
is whole.
"""

from __future__ import annotations

import contextlib
import time
from typing import Any

import torch.distributed as dist

__all__ = ["Graves"]


class Graves:
    """Abandoned process groups of one process, each kept until ``timeout`` has passed."""

    def __init__(self, timeout: float):
        self.timeout = timeout
        self._kept: list[tuple[float, Any]] = []  # (when abandoned, the group)

    def bury(self) -> None:
        """Let go of the default process group without waiting for its work."""
        c10d = dist.distributed_c10d
        try:
            groups = list(c10d._world.pg_names)  # the default group and any subgroup
            forget = _forgetter(c10d)
        except AttributeError:  # another torch: wait, as before
            dist.destroy_process_group()
            return
        now = time.monotonic()
        self._kept += [(now, pg) for pg in groups]
        forget()
        self.release(due_only=True)

    def release(self, due_only: bool = False) -> None:
        """Shut down the kept groups (``due_only``: those whose work has surely ended)."""
        now, kept = time.monotonic(), []
        for at, pg in self._kept:
            if due_only and now - at < self.timeout + 1:
                kept.append((at, pg))
                continue
            with contextlib.suppress(RuntimeError):
                pg.shutdown()
        self._kept = kept

    def __len__(self) -> int:
        return len(self._kept)


def _forgetter(c10d: Any) -> Any:
    """What ``destroy_process_group()`` does to the registry of groups, without shutting the
    default group down (torch's own bookkeeping, checked before anything is changed)."""
    world = c10d._world
    maps = [
        getattr(world, name)
        for name in (
            "pg_map",
            "pg_names",
            "pg_group_ranks",
            "pg_backend_config",
            "pg_to_tag",
            "tags_to_pg",
            "pg_coalesce_state",
        )
    ]
    update, unregister = c10d._update_default_pg, c10d._unregister_all_process_groups

    def forget() -> None:
        update(None)
        for registry in maps:
            registry.clear()
        unregister()
        world.group_count = 0

    return forget
