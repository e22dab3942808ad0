"""What a process was launched into: one frozen record, parsed from the environment in one place.

A launcher (``torchrun``, ``towers run``, :func:`towers.spawn`, an elastic supervisor) tells
each worker who it is through environment variables; :func:`parse_launch` reads them all from a
mapping (pure: tests give it a dict) and :func:`read_launch` from this process's environment.
Everything below the API layer receives the :class:`Launch` record (or its values) as
arguments, and the launchers write the variables with :meth:`Launch.environ`, so the names are
spelt in this module only.

torchrun's variables: ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``,
``GROUP_RANK`` and ``GROUP_WORLD_SIZE`` (nodes), ``MASTER_ADDR`` and ``MASTER_PORT``, and its
agent's store (``TORCHELASTIC_USE_AGENT_STORE``, ``TORCHELASTIC_RESTART_COUNT``). towers' own:
``TOWERS_MODE`` (``towers run --mode``), ``TOWERS_TRANSPORT``, ``TOWERS_ELASTIC`` (``"1"``, or
``"join"`` for a replacement, under ``towers run --elastic``) and ``TOWERS_SECRET`` (the job's
secret, :mod:`towers.core.secret`).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field

from .secret import JobSecret

__all__ = [
    "COMPRESS",
    "ELASTIC",
    "ENV_KEYS",
    "MODE",
    "SECRET",
    "TRANSPORT",
    "Launch",
    "parse_launch",
    "read_launch",
]

# torchrun's variables that every worker gets (towers.spawn and towers run set them too).
ENV_KEYS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
_REQUIRED = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
MODE = "TOWERS_MODE"
TRANSPORT = "TOWERS_TRANSPORT"
ELASTIC = "TOWERS_ELASTIC"
COMPRESS = "TOWERS_COMPRESS"
# The exit code of a towers.ddp script's ranks under towers run --elastic on one host: its
# steps cannot be redone without a lost worker, so the launcher restarts every rank instead.
RESTARTS_INSTEAD = 76
SECRET = "TOWERS_SECRET"
_AGENT_STORE = "TORCHELASTIC_USE_AGENT_STORE"
_RESTART_COUNT = "TORCHELASTIC_RESTART_COUNT"


@dataclass(frozen=True)
class Launch:
    """This process's place in a job; a world of one (``launched`` false) if it has none.

    Attributes:
        launched: a launcher set ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR`` and ``MASTER_PORT``.
        rank, world_size, local_rank, local_world_size: as torchrun sets them.
        group_rank, group_world_size: this node's rank and the number of nodes.
        master_addr, master_port: the rendezvous store.
        agent_store: torchrun's agent hosts the store (the workers are all its clients).
        restart_count: torchrun's restart attempt (``--max-restarts``).
        mode: the mode ``towers run --mode`` asked for (``"sync"`` by default).
        transport: ``TOWERS_TRANSPORT`` if set, else ``None``.
        elastic: started by ``towers run --elastic``; ``joining``: as a replacement.
        compress: the compression ``towers run --compress`` asked for (``TOWERS_COMPRESS``),
            which a ``towers.ddp`` model takes when its script names none; else ``None``.
        secret: the job's secret (``TOWERS_SECRET``), or ``None``; never shown in ``repr``.
    """

    launched: bool = False
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    local_world_size: int = 1
    group_rank: int = 0
    group_world_size: int = 1
    master_addr: str = "127.0.0.1"
    master_port: int = 0
    agent_store: bool = False
    restart_count: int = 0
    mode: str = "sync"
    transport: str | None = None
    elastic: bool = False
    joining: bool = False
    compress: str | None = None
    secret: str | None = field(default=None, repr=False)

    @property
    def job_secret(self) -> JobSecret | None:
        """The job's secret with what derives from it, or ``None`` if the job has none."""
        return None if self.secret is None else JobSecret(self.secret)

    def environ(self) -> dict[str, str]:
        """The variables that tell a worker this record (what :func:`parse_launch` reads)."""
        env = {
            "RANK": str(self.rank),
            "LOCAL_RANK": str(self.local_rank),
            "WORLD_SIZE": str(self.world_size),
            "LOCAL_WORLD_SIZE": str(self.local_world_size),
            "GROUP_RANK": str(self.group_rank),
            "GROUP_WORLD_SIZE": str(self.group_world_size),
            "MASTER_ADDR": self.master_addr,
            "MASTER_PORT": str(self.master_port),
        }
        if self.mode != "sync":
            env[MODE] = self.mode
        if self.transport is not None:
            env[TRANSPORT] = self.transport
        if self.elastic:
            env[ELASTIC] = "join" if self.joining else "1"
        if self.compress is not None:
            env[COMPRESS] = self.compress
        if self.secret is not None:
            env[SECRET] = self.secret
        if self.restart_count:
            env[_RESTART_COUNT] = str(self.restart_count)
        return env


def _int(env: Mapping[str, str], name: str, default: int | None = None) -> int:
    text = env.get(name)
    if text is None or (text == "" and default is not None):
        if default is None:
            raise KeyError(name)
        return default
    try:
        return int(text)
    except ValueError:
        raise ValueError(
            f"the environment variable {name} must be an integer, got {text!r}: it is set by "
            "the launcher (torchrun, towers run); unset it or give a number"
        ) from None


def parse_launch(env: Mapping[str, str]) -> Launch:
    """The :class:`Launch` that the variables in ``env`` describe.

    Without all of ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR`` and ``MASTER_PORT`` the process was
    not launched: a world of one, whatever else is set (towers' own variables still apply).

    Raises:
        ValueError: a variable that must be a number is not, or ``TOWERS_SECRET`` is empty.
    """
    elastic = env.get(ELASTIC) or ""
    secret = env.get(SECRET)
    if secret is not None and not secret.strip():
        raise ValueError(
            f"{SECRET} is set but empty: give every process of the job the same non-empty "
            f"secret, or unset {SECRET}"
        )
    towers = {
        "mode": env.get(MODE) or "sync",
        "transport": env.get(TRANSPORT) or None,
        "elastic": bool(elastic),
        "joining": elastic == "join",
        "compress": env.get(COMPRESS) or None,
        "secret": secret,
    }
    if not all(name in env for name in _REQUIRED):
        return Launch(**towers)  # type: ignore[arg-type]
    return Launch(
        launched=True,
        rank=_int(env, "RANK"),
        world_size=_int(env, "WORLD_SIZE"),
        local_rank=_int(env, "LOCAL_RANK", 0),
        local_world_size=_int(env, "LOCAL_WORLD_SIZE", 1),
        group_rank=_int(env, "GROUP_RANK", 0),
        group_world_size=_int(env, "GROUP_WORLD_SIZE", 1),
        master_addr=env["MASTER_ADDR"],
        master_port=_int(env, "MASTER_PORT"),
        agent_store=env.get(_AGENT_STORE) == "True",
        restart_count=_int(env, _RESTART_COUNT, 0),
        **towers,  # type: ignore[arg-type]
    )


def read_launch() -> Launch:
    """This process's :class:`Launch`, from its environment as it is now."""
    return parse_launch(os.environ)
