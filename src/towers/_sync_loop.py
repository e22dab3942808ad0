"""The synchronous training loop of ``towers.train``, run by every worker.

Each global batch is cut with :func:`towers.split`; this worker's shard (in ``accumulate``
micro-batches) goes through :meth:`Context.step`, which averages gradients over all towers. With
``checkpoint=`` the loop saves its whole state every ``checkpoint_every`` steps and resumes from
the checkpoint the caller read, ending exactly where an uninterrupted run ends.
"""

from __future__ import annotations

import copy
import functools
import time
from typing import TYPE_CHECKING, Any

import torch

from . import _checkpoint
from ._context import Context
from ._data import BatchOrder, num_samples, take
from ._report import Reporter
from ._split import map_batch, split

if TYPE_CHECKING:
    from ._train import _Spec

__all__ = ["sync_loop"]


def _restore(
    ctx: Context, spec: _Spec, state: dict[str, Any], parts: dict[str, Any]
) -> dict[str, Any]:
    """Load a checkpoint into the run's parts; return the results recorded so far."""
    parts["model"].load_state_dict(state["model"])
    parts["optimizer"].load_state_dict(state["optimizer"])
    if parts["schedule"] is not None and state["schedule"] is not None:
        parts["schedule"].load_state_dict(state["schedule"])
    parts["order"].load_state_dict(state["data"])
    rng = state["rng"]
    if len(rng) == ctx.world_size:
        torch.set_rng_state(rng[ctx.rank])
    else:  # resumed with another number of workers: fresh, but reproducible, streams
        torch.manual_seed(spec.seed + ctx.rank + 1000 * state["step"])
    return state["history"]


def _save(ctx: Context, spec: _Spec, step: int, parts: dict[str, Any], history: dict) -> None:
    rng = ctx.comm.all_gather_object(torch.get_rng_state())
    if not ctx.is_main:
        return
    schedule = parts["schedule"]
    state = {
        "format": 1,
        "step": step,
        "mode": str(spec.mode),
        "model": {k: v.detach().cpu() for k, v in parts["model"].state_dict().items()},
        "optimizer": parts["optimizer"].state_dict(),
        "schedule": schedule.state_dict() if schedule is not None else None,
        "data": parts["order"].state_dict(),
        "rng": rng,
        "history": history,
    }
    _checkpoint.save(spec.checkpoint, step, state)  # type: ignore[arg-type]


def sync_loop(ctx: Context, spec: _Spec) -> dict[str, Any] | None:
    torch.manual_seed(spec.seed + ctx.rank)
    # Always a private copy: tensors sent to local workers travel through shared memory, so
    # without it every worker would update one and the same parameter storage.
    model = ctx.replicate(copy.deepcopy(spec.model))
    opt = spec.optimizer(model.parameters())
    schedule = spec.lr_schedule(opt) if spec.lr_schedule is not None else None
    to_device = functools.partial(map_batch, lambda t: t.to(ctx.device))
    order = BatchOrder(num_samples(spec.data), spec.batch_size, spec.shuffle, spec.seed)
    parts = {"model": model, "optimizer": opt, "schedule": schedule, "order": order}
    history: dict[str, Any] = {
        "losses": [],
        "tower_losses": [],
        "skipped": [],
        "times": [],
        "samples": 0,
        "seconds": 0.0,
    }
    first = 0
    if spec.resume is not None:
        # A private copy, as for the model: optimizer state loaded from shared tensors would
        # be shared, and updated, by every worker.
        history = _restore(ctx, spec, copy.deepcopy(spec.resume), parts)
        first = spec.resume["step"]
    losses, tower_losses, skipped = history["losses"], history["tower_losses"], history["skipped"]
    times = history["times"]
    samples = first_samples = history["samples"]
    slow = spec.straggle.get(ctx.rank, 1.0)
    reporter = Reporter(spec, ctx.is_main, initial=first)
    ctx.barrier()
    start = time.perf_counter()
    try:
        for step in range(first, spec.steps):
            mine = split(next(order), ctx.world_size)[ctx.rank]
            micro = [m for m in split(mine, spec.accumulate) if len(m)]
            began = time.perf_counter()
            for m in micro[:-1]:
                ctx.accumulate(spec.loss_fn(model, to_device(take(spec.data, m))), len(m))
            if micro and slow > 1:
                # A straggler backpropagates without communicating, so that its compute can be
                # timed and stretched; the step then averages the accumulated gradients.
                last = to_device(take(spec.data, micro[-1]))
                ctx.accumulate(spec.loss_fn(model, last), len(micro[-1]))
                time.sleep((slow - 1) * (time.perf_counter() - began))
                r = ctx.step(None, opt, 0)
            elif micro:
                shard = to_device(take(spec.data, micro[-1]))
                r = ctx.step(spec.loss_fn(model, shard), opt, len(micro[-1]))
            else:
                r = ctx.step(None, opt, 0)
            if schedule is not None:
                schedule.step()
            samples += r.samples
            losses.append(r.loss)
            tower_losses.append(r.tower_losses)
            if r.skipped:
                skipped.append((step, r.culprits))
            elapsed = time.perf_counter() - start
            times.append(history["seconds"] + elapsed)
            reporter.step(step, r.loss, r.tower_losses, (samples - first_samples) / elapsed)
            done = step + 1
            if spec.checkpoint is not None and (
                done % spec.checkpoint_every == 0 or done == spec.steps
            ):
                history["samples"] = samples
                history["seconds"] += time.perf_counter() - start
                start = time.perf_counter()
                first_samples = samples
                _save(ctx, spec, done, parts, history)
    finally:
        reporter.close()
    history["seconds"] += time.perf_counter() - start
    if not (ctx.is_main or spec.every_rank):
        return None
    return {
        "state_dict": {k: v.detach().cpu().clone() for k, v in model.state_dict().items()},
        "losses": losses,
        "tower_losses": tower_losses,
        "skipped": [tuple(s) for s in skipped],
        "steps": spec.steps,
        "samples": samples,
        "seconds": history["seconds"],
        "times": times,
    }
