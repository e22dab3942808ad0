"""Checkpoints of an optimizer state sharded over the towers (:mod:`towers.engines.shard`).

Every rank writes its part (``step-NNNNNNNN.part-RRRRR.pt``: a record per slice, with its
parameter's place in the model and its element range) before rank 0 writes the checkpoint,
whose ``optimizer`` entry holds the groups' settings and the number of parts. Any number of
ranks resumes it: each reads the parts one at a time and keeps what overlaps its own slices,
so no rank holds the whole state at once.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch

from ..comm.base import Comm
from . import checkpoint
from .shard import Part, ShardedState

__all__ = [
    "consolidated",
    "describe",
    "load_agreed",
    "load_whole",
    "part_state",
    "restore_parts",
    "save_checkpoint",
    "whole_state",
]


def describe(sharding: ShardedState, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """What the checkpoint's main file holds of a sharded optimizer: its groups' settings, each
    with its parameters' places in the model (the state itself is in the ranks' part files)."""
    held = sharding.held(optimizer)
    groups = (
        held.groups if held is not None else [list(g["params"]) for g in optimizer.param_groups]
    )
    settings = []
    for group, params in zip(optimizer.param_groups, groups, strict=True):
        kept = {k: v for k, v in group.items() if k != "params"}
        settings.append({**kept, "params": [sharding.index(p) for p in params]})
    spans = [[[p.index, p.start, p.stop] for p in parts] for parts in sharding.parts]
    return {
        "sharded": {
            "groups": settings,
            "world": sharding.world,
            "type": type(optimizer).__name__,
            "spans": spans,  # each rank's parts: a reader opens only those that overlap its own
        }
    }


def needed_parts(sharding: ShardedState, described: dict[str, Any]) -> list[int]:
    """The saving ranks whose parts overlap this rank's (every one, for a checkpoint that
    does not say where its parts lie)."""
    saved = described["sharded"]
    spans = saved.get("spans")
    if spans is None:
        return list(range(saved["world"]))
    mine: dict[int, list[Part]] = {}
    for part in sharding.mine():
        mine.setdefault(part.index, []).append(part)

    def overlaps(parts: list[list[int]]) -> bool:
        return any(
            p.start < stop and start < p.stop for i, start, stop in parts for p in mine.get(i, [])
        )

    return [rank for rank, parts in enumerate(spans) if overlaps(parts)]


def part_state(sharding: ShardedState, optimizer: torch.optim.Optimizer) -> list[dict[str, Any]]:
    """This rank's part of the optimizer's state: one record per slice that has state."""
    held = sharding.held(optimizer)
    if held is None:
        return []
    records = []
    for part, view in held.slices.items():
        state = optimizer.state.get(view)
        if state:
            saved = {
                k: v.detach().cpu().clone() if torch.is_tensor(v) else v for k, v in state.items()
            }
            records.append(
                {"index": part.index, "start": part.start, "stop": part.stop, "state": saved}
            )
    return records


def load_parts(
    sharding: ShardedState,
    optimizer: torch.optim.Optimizer,
    described: dict[str, Any],
    parts: Callable[[int], list[dict[str, Any]]],
) -> None:
    """Give this rank's slices their state from the part files of a checkpoint written by any
    number of ranks (``parts(r)``: rank ``r``'s records, read one rank at a time)."""
    saved = described["sharded"]
    if saved["type"] != type(optimizer).__name__:
        raise ValueError(
            f"the checkpoint's optimizer is {saved['type']}, this loop's "
            f"{type(optimizer).__name__}: resume with the optimizer that wrote it"
        )
    groups = [list(g["params"]) for g in optimizer.param_groups]
    if [[sharding.index(p) for p in g] for g in groups] != [g["params"] for g in saved["groups"]]:
        raise ValueError(
            "the checkpoint's optimizer has other parameter groups than this loop's: build "
            "the optimizer over the same parameters, in the same groups, as the run that wrote it"
        )
    for group, kept in zip(optimizer.param_groups, saved["groups"], strict=True):
        group.update({k: v for k, v in kept.items() if k != "params"})
    held = sharding.hold(optimizer)
    for part in sharding.mine():  # as torch's load_state_dict: no state kept from before
        optimizer.state.pop(sharding.view(held, part), None)
    pieces: dict[Part, dict[str, Any]] = {}
    for rank in needed_parts(sharding, described):
        for record in parts(rank):
            for part in sharding.owned(record["index"]):
                _take(pieces, part, record)
    group_of = {id(p): g for g in optimizer.param_groups for p in g["params"]}
    for part in sharding.mine():
        state = pieces.get(part)
        if state is not None:
            p = sharding.params[part.index]
            group = group_of[id(p)]
            optimizer.state[sharding.view(held, part)] = {
                k: _placed(k, v, p, group) for k, v in state.items()
            }


def _placed(key: str, value: Any, p: torch.Tensor, group: dict[str, Any]) -> Any:
    """A saved state value as torch's ``load_state_dict`` places it for parameter ``p``: the
    step count stays where it was saved (on the CPU) unless the step is fused or capturable;
    everything else goes to ``p``'s device, floating-point values in ``p``'s dtype."""
    if not torch.is_tensor(value):
        return value
    if key == "step":
        fused = group.get("fused") or group.get("capturable")
        return value.to(device=p.device) if fused else value
    if value.is_floating_point() and p.is_floating_point():
        return value.to(dtype=p.dtype, device=p.device)
    return value.to(device=p.device)


def _take(pieces: dict[Part, dict[str, Any]], part: Part, record: dict[str, Any]) -> None:
    """Copy what ``record`` (a slice of the saving run) holds of ``part`` into its state."""
    lo, hi = max(part.start, record["start"]), min(part.stop, record["stop"])
    if lo >= hi:
        return
    into = pieces.setdefault(part, {})
    for k, v in record["state"].items():
        if torch.is_tensor(v) and v.dim() > 0:  # one value per element
            if k not in into:
                into[k] = torch.empty(part.size, dtype=v.dtype)
            into[k][lo - part.start : hi - part.start] = v[
                lo - record["start"] : hi - record["start"]
            ]
        else:  # one value for the whole parameter (the step count): the same in every slice
            into[k] = v.clone() if torch.is_tensor(v) else v


def save_checkpoint(
    directory: str,
    step: int,
    kind: str,
    payload: dict[str, Any],
    comm: Comm,
    sharding: ShardedState | None,
    optimizer: torch.optim.Optimizer | None,
) -> None:
    """Write ``kind``'s checkpoint of ``step`` (a collective: every rank calls it with the same
    ``payload`` layout): each rank's part of a sharded optimizer state first, then rank 0 the
    checkpoint itself, which names them; a write that fails warns, and leaves no part behind."""
    if not _save_parts(sharding, optimizer, directory, step, comm, payload):
        return
    if comm.rank == 0 and checkpoint.save_or_warn(directory, step, kind, payload) is None:
        checkpoint.drop_parts(directory, step)


def _save_parts(
    sharding: ShardedState | None,
    optimizer: torch.optim.Optimizer | None,
    directory: str,
    step: int,
    comm: Comm,
    payload: dict[str, Any],
) -> bool:
    """Every rank writes its part of a sharded optimizer's state for the checkpoint of ``step``
    (a collective), and ``payload``, the checkpoint, records their sha256; whether it may be
    written: every part was, where rank 0 sees it, or nothing is sharded. Otherwise every rank
    removes its part, and rank 0 warns."""
    if sharding is None or optimizer is None:
        return True
    digest = None
    with contextlib.suppress(Exception):  # a full disk, no memory: said below, on rank 0
        digest = checkpoint.save_part(directory, step, comm.rank, part_state(sharding, optimizer))
    digests = comm.all_gather_object(digest)
    unseen = [
        r
        for r, d in enumerate(digests)
        if d is None or not checkpoint.part_path(directory, step, r).exists()
    ]
    unseen = comm.broadcast_object(unseen if comm.rank == 0 else None)  # rank 0's view decides
    if not unseen:
        payload["replica"]["optimizer"]["sharded"]["parts"] = digests
        return True
    checkpoint.part_path(directory, step, comm.rank).unlink(missing_ok=True)
    if comm.rank == 0:
        checkpoint.warn_unwritten(
            directory,
            step,
            f"the parts of the optimizer's state of ranks {unseen} were not written where rank "
            "0 sees them (across hosts, checkpoint into a directory every host shares)",
        )
    return False


def restore_parts(
    sharding: ShardedState | None,
    optimizer: torch.optim.Optimizer | None,
    saved: dict[str, Any],
    directory: str,
) -> None:
    """Give this rank its part of a sharded optimizer state that ``saved`` (a checkpoint) names."""
    described = checkpoint.replica_optimizer(saved)
    if described is None or "sharded" not in described:
        if sharding is not None and described is not None:
            raise ValueError(
                f"the checkpoint in {directory} holds a whole optimizer state, not one sharded "
                "over the towers: resume it without shard_optimizer"
            )
        return
    if sharding is None or optimizer is None:
        raise ValueError(
            f"the checkpoint in {directory} holds an optimizer state sharded over the towers: "
            "resume it with shard_optimizer=True"
        )
    step = saved["step"]
    load_parts(
        sharding, optimizer, described, lambda rank: checkpoint.read_part(directory, step, rank)
    )


def load_agreed(
    directory: str,
    kind: str,
    also: tuple[str, ...],
    sharding: ShardedState | None,
    comm: Comm,
) -> dict[str, Any] | None:
    """The newest checkpoint of ``kind`` in ``directory`` that every rank finds, with every
    part of a sharded state that the ranks will read intact (a collective: each rank checks
    only the parts it reads, and all pass over a damaged one together); ``None`` if none."""
    below: int | None = None
    problems: tuple[str, ...] = ()
    while True:
        saved = checkpoint.load_latest(
            directory, kind, also=also, parts=False, below=below, problems=problems
        )
        _same_checkpoint(saved, directory, comm)
        if saved is None:
            return None
        found = unreadable_parts(sharding, saved, directory, comm)
        if not found:
            return saved
        below, problems = saved["step"], (*problems, *found)


def _same_checkpoint(saved: dict[str, Any] | None, directory: str, comm: Comm) -> None:
    """``RuntimeError`` on every rank unless every rank found the same newest checkpoint."""
    found = comm.all_gather_object(None if saved is None else saved["step"])
    if len(set(found)) > 1:
        seen = ", ".join(f"rank {r}: {s if s is not None else 'none'}" for r, s in enumerate(found))
        raise RuntimeError(
            f"the ranks found different newest checkpoints in {directory} ({seen}); every "
            "rank must resume from the same one: across hosts, checkpoint into a directory "
            "every host shares, with the same path on every rank"
        )


def unreadable_parts(
    sharding: ShardedState | None, saved: dict[str, Any], directory: str, comm: Comm
) -> list[str]:
    """What is wrong with the parts of the checkpoint ``saved`` that the ranks will read, each
    rank checking only its own (a collective): the same list on every rank, empty if none."""
    described = checkpoint.replica_optimizer(saved)
    found = []
    if sharding is not None and described is not None and "sharded" in described:
        digests = described["sharded"]["parts"]
        for rank in needed_parts(sharding, described):
            try:
                checkpoint.check_part(directory, saved["step"], rank, digests[rank])
            except ValueError as exc:
                found.append(str(exc))
    return sorted({p for problems in comm.all_gather_object(found) for p in problems})


def whole_state(
    sharding: ShardedState, optimizer: torch.optim.Optimizer, parts: list[list[dict[str, Any]]]
) -> dict[str, Any]:
    """Every rank's part (:func:`part_state`) put together: the state dict ``optimizer``'s
    class keeps in one process."""
    whole: dict[int, dict[str, Any]] = {}
    for records in parts:
        for record in records:
            p = sharding.params[record["index"]]
            into = whole.setdefault(record["index"], {})
            for k, v in record["state"].items():
                if torch.is_tensor(v) and v.dim() > 0:  # one value per element
                    if k not in into:
                        into[k] = torch.zeros(p.numel(), dtype=v.dtype)
                    into[k][record["start"] : record["stop"]] = v
                else:  # the step count: the same in every slice
                    into[k] = v
    held = sharding.held(optimizer)
    groups = held.groups if held is not None else [g["params"] for g in optimizer.param_groups]
    ids: dict[int, int] = {}
    out_groups = []
    for group, params in zip(optimizer.param_groups, groups, strict=True):
        numbers = []
        for p in params:
            numbers.append(ids.setdefault(id(p), len(ids)))
        out_groups.append({**{k: v for k, v in group.items() if k != "params"}, "params": numbers})
    state = {}
    for index, values in whole.items():
        p = sharding.params[index]
        state[ids[id(p)]] = {
            k: v.reshape(p.shape) if torch.is_tensor(v) and v.dim() > 0 else v
            for k, v in values.items()
        }
    return {"state": state, "param_groups": out_groups}


def consolidated(
    sharding: ShardedState, optimizer: torch.optim.Optimizer, to: int
) -> dict[str, Any] | None:
    """:func:`whole_state` on rank ``to`` (elsewhere ``None``), from every rank's part sent one
    at a time, so that a rank holds one part at a time, ``to`` the whole (a collective)."""
    comm = sharding.comm()
    mine, parts = part_state(sharding, optimizer), []
    for rank in range(comm.world_size):
        part = comm.broadcast_object(mine if rank == comm.rank else None, src=rank)
        parts += [part] if comm.rank == to else []
    return whole_state(sharding, optimizer, parts) if comm.rank == to else None


def load_whole(
    sharding: ShardedState, optimizer: torch.optim.Optimizer, state_dict: dict[str, Any]
) -> None:
    """Give this rank's slices their part of ``state_dict``, a whole state of ``optimizer``'s
    class (as one process's ``state_dict()``, or :func:`whole_state`, returns it)."""
    params = [p for g in optimizer.param_groups for p in g["params"]]
    saved_groups = state_dict["param_groups"]
    ids = [i for g in saved_groups for i in g["params"]]
    if len(ids) != len(params):
        raise ValueError(
            f"the state dict holds {len(ids)} parameters, this optimizer {len(params)}: "
            "load the state of an optimizer built over the same parameters"
        )
    place = dict(zip(ids, params, strict=True))
    groups = []
    for group, saved in zip(optimizer.param_groups, saved_groups, strict=True):
        kept = {k: v for k, v in saved.items() if k != "params"}
        groups.append({**kept, "params": [sharding.index(p) for p in group["params"]]})
    records = []
    for i, state in state_dict["state"].items():
        p = place[i]
        index = sharding.index(p)
        if index is None:
            continue  # a frozen parameter: no state
        flat = {k: _flat_per_element(v, p) for k, v in state.items()}
        records.append({"index": index, "start": 0, "stop": p.numel(), "state": flat})
    described = {"sharded": {"groups": groups, "world": 1, "type": type(optimizer).__name__}}
    load_parts(sharding, optimizer, described, lambda rank: records)


def _flat_per_element(value: Any, p: torch.Tensor) -> Any:
    """A state value with one entry per element of ``p``, flattened; others as they are."""
    if torch.is_tensor(value) and value.dim() > 0 and value.numel() == p.numel():
        return value.reshape(-1)
    return value
