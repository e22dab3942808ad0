"""The parameter server's checkpoints: what it saves, how it resumes, what a resume needs.

Asynchronous training is not deterministic, so a resumed run cannot end exactly where an
uninterrupted one ends, as a synchronous one does. What a resume keeps is the record and the
parameters: every global batch is trained once as far as ``TrainResult`` goes (the shards done
after the checkpoint are done again, and recorded once), and training continues from the saved
parameters, optimizer and schedule state.

The server saves (through :mod:`towers.engines.checkpoint`, kind ``ps``):

- parameters and buffers, optimizer and schedule state, the updates applied (the version) and
  the schedule count;
- the position: the next global batch to cut, and every shard not yet applied (queued or handed
  out: those in flight are handed out again after a resume); ``backup:B``: the step in progress,
  which is opened anew; ``local:K``: checkpoints are taken right after an average, so the saved
  parameters hold every recorded shard, and workers restart from them (with fresh optimizers);
  ``ssp:S``: clocks restart at zero;
- the record so far (:class:`~towers.engines.ps.state.Record`), evaluations included.

A run resumes with the same number of workers: shards in flight are cut for that many.
"""

from __future__ import annotations

from typing import Any

import torch

from ...core.data import BatchOrder, num_samples
from ..job import Job
from ..replica import Replica
from .state import Record, ServerState, Shard

__all__ = ["check_resumable", "restore", "snapshot"]


def _order(job: Job) -> BatchOrder:
    return BatchOrder(num_samples(job.data), job.batch_size, job.shuffle, job.seed)


def check_resumable(job: Job, state: dict[str, Any], towers: int) -> None:
    """``ValueError`` unless this run can continue ``state`` (called in the caller)."""
    _order(job).check_config(state["data"])
    if state["towers"] != towers:
        raise ValueError(
            f"the checkpoint in {job.checkpoint} was made with workers={state['towers']}, "
            f"this run has workers={towers}; in mode {job.mode} resume with the same number "
            "of workers (the shards in flight are cut for that many), or use another directory"
        )
    begun = state["position"]["next_step"]
    if begun > job.steps:
        raise ValueError(
            f"the checkpoint in {job.checkpoint} has begun global batch {begun - 1}, beyond "
            f"steps={job.steps}; ask for at least {begun} steps"
        )


def snapshot(
    job: Job, s: ServerState, replica: Replica, todo: list[Shard], seconds: float
) -> dict[str, Any]:
    """The server's state as a checkpoint payload: tensors, dicts, lists and plain values only.

    ``todo``: the shards not applied yet, to be handed out after a resume.
    """
    todo = sorted(todo, key=lambda shard: (shard.step, shard.index))
    rec = s.record
    return {
        "mode": str(job.mode),
        "towers": s.towers,
        "data": _order(job).config,
        **replica.state_dict(),
        "updates": s.version,
        "position": {
            "next_step": s.next_step,
            "current": s.current,
            "final": s.final,
            "todo": torch.tensor(
                [[x.step, x.index, x.samples] for x in todo], dtype=torch.int64
            ).reshape(-1, 3),
        },
        "record": {
            "loss_sums": torch.tensor(rec.loss_sums, dtype=torch.float64),
            "counts": torch.tensor(rec.counts, dtype=torch.int64),
            "times": torch.tensor(rec.times, dtype=torch.float64),
            "staleness": torch.tensor(rec.staleness, dtype=torch.int64),
            "ahead": torch.tensor(rec.ahead, dtype=torch.int64),
            "skipped": [[k, sorted(v)] for k, v in sorted(rec.skipped.items())],
            "dropped": [list(d) for d in rec.dropped],
            "dead_workers": list(rec.dead),
            "evals": [[done, dict(metrics)] for done, metrics in rec.evals],
            "samples": rec.samples,
            "seconds": seconds,
        },
    }


def restore(s: ServerState, replica: Replica, state: dict[str, Any]) -> None:
    """Load ``state`` (checked by :func:`check_resumable`) into a fresh server's state."""
    replica.load_state_dict(state)
    s.version = state["updates"]
    pos = state["position"]
    s.done = s.saved = state["step"]
    s.next_step, s.current = pos["next_step"], pos["current"]
    s.final = bool(pos["final"]) and s.done == s.steps  # more steps asked: averages go on
    for step, index, samples in pos["todo"].tolist():
        s.pending.append(Shard(step, index, samples))
        s.left[step] = s.left.get(step, 0) + 1
    s.record = _record(state["record"], s.steps, s.towers)


def _record(saved: dict[str, Any], steps: int, towers: int) -> Record:
    rec = Record.empty(steps, towers)
    n = min(steps, len(saved["times"]))  # batches from next_step on hold nothing yet
    rec.loss_sums[:n] = saved["loss_sums"][:n].tolist()
    rec.counts[:n] = saved["counts"][:n].tolist()
    rec.times[:n] = saved["times"][:n].tolist()
    rec.staleness = saved["staleness"].tolist()
    rec.ahead = saved["ahead"].tolist()
    rec.skipped = {k: list(v) for k, v in saved["skipped"]}
    rec.dropped = [(k, t) for k, t in saved["dropped"]]
    rec.dead = list(saved["dead_workers"])
    rec.evals = [(done, dict(metrics)) for done, metrics in saved.get("evals", [])]
    rec.samples = saved["samples"]
    rec.prior_seconds = saved["seconds"]
    return rec
