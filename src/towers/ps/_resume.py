"""The parameter server's checkpoints: what it saves, how it resumes, what a resume needs.

Asynchronous training is not deterministic, so a resumed run cannot end exactly where an
uninterrupted one ends, as a synchronous one does. What a resume keeps is the record and the
parameters: every global batch is trained once as far as ``TrainResult`` goes (the shards done
after the checkpoint are done again, and recorded once), and training continues from the saved
parameters, optimizer and schedule state.

The server saves (with :func:`towers._checkpoint.save`: atomic, tensors and plain values only):

- parameters and buffers, optimizer and schedule state, ``version`` and the schedule count;
- the position: the next global batch to cut, and every shard not yet applied (queued or handed
  out: those in flight are handed out again after a resume); ``backup:B``: the step in progress,
  which is opened anew; ``local:K``: checkpoints are taken right after an average, so the saved
  parameters hold every recorded shard, and workers restart from them (with fresh optimizers);
  ``ssp:S``: clocks restart at zero;
- the record so far (losses, staleness, ahead, skipped, dropped, dead workers, times, samples,
  seconds).

A run resumes with the same number of workers: shards in flight are cut for that many.
"""

from __future__ import annotations

import copy
from typing import Any

import torch

from .._data import BatchOrder, num_samples

__all__ = ["check_resumable", "restore", "snapshot"]

FORMAT = 1


def _order(spec: Any) -> BatchOrder:
    return BatchOrder(num_samples(spec.data), spec.batch_size, spec.shuffle, spec.seed)


def check_resumable(spec: Any, state: dict[str, Any], towers: int) -> None:
    """``ValueError`` unless this run can continue ``state`` (called in the caller)."""
    _order(spec).check_config(state["data"])
    if state["towers"] != towers:
        raise ValueError(
            f"the checkpoint in {spec.checkpoint} was made with workers={state['towers']}, "
            f"this run has workers={towers}; in mode {spec.mode} resume with the same number "
            "of workers (the shards in flight are cut for that many), or use another directory"
        )
    begun = state["position"]["next_step"]
    if begun > spec.steps:
        raise ValueError(
            f"the checkpoint in {spec.checkpoint} has begun global batch {begun - 1}, beyond "
            f"steps={spec.steps}; ask for at least {begun} steps"
        )


def snapshot(server: Any) -> dict[str, Any]:
    """The server's state as a checkpoint: tensors, dicts, lists and plain values only."""
    s = server
    todo = [] if s.mode == "backup" else [*s.pending, *(shard for shard, _ in s.busy.values())]
    todo.sort(key=lambda shard: (shard.step, shard.index))
    elapsed = s.prior_seconds + s.elapsed()
    return {
        "format": FORMAT,
        "step": s.done,
        "mode": str(s.spec.mode),
        "towers": s.towers,
        "data": _order(s.spec).config,
        "model": {k: v.detach().cpu().clone() for k, v in s.model.state_dict().items()},
        "optimizer": s.opt.state_dict() if s.opt is not None else None,
        "schedule": s.schedule.state_dict() if s.schedule is not None else None,
        "scheduled": s.scheduled,
        "version": s.version,
        "position": {
            "next_step": s.next_step,
            "current": s.current,
            "final": s.final,
            "todo": torch.tensor(
                [[x.step, x.index, x.samples] for x in todo], dtype=torch.int64
            ).reshape(-1, 3),
        },
        "record": {
            "loss_sums": torch.tensor(s.loss_sums, dtype=torch.float64),
            "counts": torch.tensor(s.counts, dtype=torch.int64),
            "times": torch.tensor(s.times, dtype=torch.float64),
            "staleness": torch.tensor(s.staleness, dtype=torch.int64),
            "ahead": torch.tensor(s.ahead, dtype=torch.int64),
            "skipped": [[k, sorted(v)] for k, v in sorted(s.skipped.items())],
            "dropped": [list(d) for d in s.dropped],
            "dead_workers": list(s.dead),
            "samples": s.samples,
            "seconds": elapsed,
        },
    }


def restore(server: Any, state: dict[str, Any], shard_type: Any) -> None:
    """Load ``state`` (checked by :func:`check_resumable`) into a freshly built server."""
    s = server
    state = copy.deepcopy(state)  # private: tensors from the caller may be shared memory
    s.model.load_state_dict(state["model"])
    if s.opt is not None and state["optimizer"] is not None:
        s.opt.load_state_dict(state["optimizer"])
    if s.schedule is not None and state["schedule"] is not None:
        s.schedule.load_state_dict(state["schedule"])
    s.scheduled, s.version = state["scheduled"], state["version"]

    pos = state["position"]
    s.done = s.saved = state["step"]
    s.next_step, s.current = pos["next_step"], pos["current"]
    s.final = bool(pos["final"]) and s.done == s.steps  # more steps asked: averages go on
    for step, index, samples in pos["todo"].tolist():
        s.pending.append(shard_type(step, index, samples))
        s.left[step] = s.left.get(step, 0) + 1

    rec = state["record"]
    n = min(s.steps, len(rec["times"]))  # batches from next_step on hold nothing yet
    s.loss_sums[:n] = rec["loss_sums"][:n].tolist()
    s.counts[:n] = rec["counts"][:n].tolist()
    s.times[:n] = rec["times"][:n].tolist()
    s.staleness = rec["staleness"].tolist()
    s.ahead = rec["ahead"].tolist()
    s.skipped = {k: list(v) for k, v in rec["skipped"]}
    s.dropped = [(k, t) for k, t in rec["dropped"]]
    s.dead = list(rec["dead_workers"])
    s.samples = rec["samples"]
    s.prior_seconds = rec["seconds"]
