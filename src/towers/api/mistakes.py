"""Mistakes people make when they port a script to towers, caught with a message that says the fix.

Each message is one paragraph: what happened, why, and what to write instead. They are raised (or
warned) in the caller, before any worker starts where that is possible.
"""

from __future__ import annotations

import warnings
from typing import Any

from torch import nn
from torch.utils.data import DistributedSampler

from ..core.messages import shorten
from ..core.modes import Engine

__all__ = [
    "BACKWARD_IN_DILOCO",
    "BACKWARD_TWICE",
    "NO_SAMPLES",
    "PLAIN_BACKWARD_ELASTIC",
    "PLAIN_BACKWARD_EMPTY_SHARD",
    "PLAIN_BACKWARD_NO_SHARDS",
    "PLAIN_BACKWARD_SKIPPED",
    "SHARDED_JOIN",
    "check_sync_batchnorm",
    "has_batchnorm",
    "refuse_distributed_sampler",
    "refuse_meta_model",
    "refuse_sample_list",
    "refuse_wrapped_model",
    "warn_unsynced_buffers",
]

BACKWARD_IN_DILOCO = (
    "ctx.backward() leaves every step's averaged gradients in .grad, but in DiLoCo each tower "
    "steps alone between outer steps: use ctx.step(loss, optimizer)"
)
PLAIN_BACKWARD_ELASTIC = (
    "loss.backward() on the replicated model steps it as ctx.backward(loss) would, which is not "
    "available here: under towers run --elastic a step interrupted by a lost worker must be "
    "redone, and in DiLoCo each tower steps alone between outer steps. Use "
    "ctx.step(loss, optimizer) in place of loss.backward() and optimizer.step()"
)
NO_SAMPLES = (
    "step {step}: no tower had any samples; every step needs at least one. A rank with no "
    "samples passes loss=None, samples=0 and the others pass theirs"
)
PLAIN_BACKWARD_NO_SHARDS = (
    "loss.backward() on the replicated model averages the gradients over all towers, each "
    "weighted by its samples, and no shard was taken with ctx.shards() since the last step, "
    "so this tower's samples are unknown. Take the batches with `for shard in "
    "ctx.shards(batches)`, or call ctx.backward(loss, samples=n) in place of loss.backward()"
)
PLAIN_BACKWARD_EMPTY_SHARD = (
    "loss.backward() on the replicated model after an empty shard: a global batch of {batch} "
    "samples over {world} towers left this tower none, and the mean loss over no samples is "
    "nan. Give every global batch (every micro-batch drawn for ctx.shard) at least {world} "
    "samples, or take such steps with ctx.backward(loss, samples=n), passing loss=None and "
    "samples=0 on a tower whose shard is empty"
)
SHARDED_JOIN = (
    "tower(s) {towers} ran out of batches while the others trained on (model.join()), and the "
    "optimizer's state is sharded over the towers (ZeroRedundancyOptimizer): every tower must "
    "step its part at every step. Give every rank as many batches (towers.ddp's "
    "DistributedSampler ends the ranks' batches together), or step a whole optimizer"
)
PLAIN_BACKWARD_SKIPPED = (
    "step {step} skipped: a gradient was not finite on tower(s) {towers}, so every .grad "
    "holds NaN on every rank, the next optimizer.step() changes nothing and a GradScaler "
    "lowers its scale as in one process (said once)"
)
BACKWARD_TWICE = (
    "the parameters already hold gradients when ctx.backward()/ctx.step() starts. Either "
    "loss.backward() was called first: remove it, because ctx.backward(loss) and ctx.step(loss, "
    "optimizer) backpropagate the loss themselves (weighted by the tower's samples, then "
    "averaged over the towers); or the last step's gradients were not cleared: call "
    "optimizer.zero_grad() after optimizer.step(). For gradient accumulation use "
    "ctx.accumulate(loss) for every micro-batch but the last"
)


def refuse_wrapped_model(model: Any, where: str) -> None:
    """``TypeError`` for a model wrapped in ``DistributedDataParallel`` or ``DataParallel``;
    ``ValueError`` for one on the meta device (:func:`refuse_meta_model`)."""
    if isinstance(model, (nn.parallel.DistributedDataParallel, nn.DataParallel)):
        raise TypeError(
            f"{where} got a model wrapped in {type(model).__name__}; pass the plain model "
            "(model.module, or drop the wrapping line from the script). towers averages the "
            "gradients itself, weighted by each tower's samples, and the wrapper would average "
            "them a second time, divided by the world size"
        )
    refuse_meta_model(model, where)


def refuse_meta_model(model: Any, where: str) -> None:
    """``ValueError`` for a model whose parameters or buffers have shapes but no values."""
    if not isinstance(model, nn.Module):
        return
    tensors = [*model.named_parameters(), *model.named_buffers()]
    meta = [(name, t) for name, t in tensors if t.is_meta]
    if not meta:
        return
    name, first = meta[0]
    raise ValueError(
        f"{where} got a model on the meta device: {len(meta)} of its {len(tensors)} parameters "
        f"and buffers (the first: {name} {list(first.shape)}) have a shape but no values, so "
        "there is nothing to train or to send to the workers. Give them values first: "
        "model.to_empty(device='cpu'), then initialise them (model.apply(init_weights), "
        "reset_parameters() on each layer, or model.load_state_dict(state)); or build the "
        "model on the CPU, outside `with torch.device('meta'):`"
    )


def refuse_distributed_sampler(loader: Any) -> None:
    """``ValueError`` for a DataLoader that gives each rank its own part of the data."""
    samplers = [getattr(loader, "sampler", None)]
    samplers.append(getattr(getattr(loader, "batch_sampler", None), "sampler", None))
    if any(isinstance(s, DistributedSampler) for s in samplers):
        raise ValueError(
            "ctx.shards() got a DataLoader with a DistributedSampler, which hands every rank a "
            "different part of the data; ctx.shards() then would split each rank's part again. "
            "Give every rank the same global batches instead: DataLoader(dataset, "
            "batch_size=GLOBAL_BATCH, shuffle=True, generator=torch.Generator().manual_seed(SEED)) "
            "with the same SEED on every rank, and ctx.shards() cuts out each rank's part"
        )


def refuse_sample_list(data: Any) -> None:
    """``TypeError`` for a list of ``(x, y)`` samples, with the call to write instead."""
    if not isinstance(data, list) or not data or not isinstance(data[0], (tuple, list, dict)):
        return
    first = shorten(repr(data[0]), 80)
    raise TypeError(
        f"data is a list of {len(data)} samples (the first is {first}); towers takes the "
        "samples stacked along dim 0, a tuple of tensors such as (x, y) with x[i], y[i] the "
        "i-th sample, or a map-style Dataset. Stack them: data = tuple(torch.stack(column) for "
        "column in zip(*samples)), or wrap the list in a Dataset class with __len__ and "
        "__getitem__"
    )


def has_batchnorm(model: nn.Module) -> list[str]:
    """The names of ``model``'s layers that keep running statistics in training."""
    return [
        name or type(m).__name__
        for name, m in model.named_modules()
        if isinstance(m, nn.modules.batchnorm._NormBase) and m.track_running_stats
    ]


def warn_unsynced_buffers(model: nn.Module, fix: str, stacklevel: int = 3) -> None:
    """Warn that each tower's BatchNorm layers see only its shard (see docs/batchnorm.md)."""
    layers = has_batchnorm(model)
    if not layers:
        return
    shown = ", ".join(layers[:3]) + (", ..." if len(layers) > 3 else "")
    warnings.warn(
        f"the model has {len(layers)} BatchNorm layer(s) ({shown}); without sync_batchnorm "
        "each tower normalises over its own shard and updates its own running statistics, so "
        "training differs from one process over the whole global batch (the trained model "
        f"keeps rank 0's running statistics). For a single process's result pass {fix}; see "
        "docs/batchnorm.md",
        UserWarning,
        stacklevel=stacklevel,
    )


def check_sync_batchnorm(
    sync_batchnorm: Any,
    model: nn.Module,
    mode: Any,
    workers: int,
    samples: int,
    batch_size: int,
    accumulate: int,
) -> None:
    """Refuse ``sync_batchnorm=True`` where it cannot be exact; warn when it is off and needed."""
    if not isinstance(sync_batchnorm, bool):
        raise TypeError(f"sync_batchnorm must be True or False, got {sync_batchnorm!r}")
    if not sync_batchnorm:
        if workers > 1:
            fix = "train(..., sync_batchnorm=True)"
            if mode.engine is not Engine.SYNC:
                fix += " in mode='sync'"
            warn_unsynced_buffers(model, fix, stacklevel=5)
        return
    if mode.engine is not Engine.SYNC:
        raise ValueError(
            f"sync_batchnorm=True needs mode='sync' (got {mode}): in the asynchronous modes the "
            "towers do not run their forward passes together"
        )
    if accumulate != 1:
        raise ValueError(
            f"sync_batchnorm=True needs accumulate=1 (got {accumulate}): with micro-batches "
            "BatchNorm normalises over each micro-batch, which one process over the global "
            "batch never does; lower batch_size instead"
        )
    last = samples % batch_size or batch_size
    smallest = min(batch_size, last, samples)
    if smallest < workers:
        raise ValueError(
            f"sync_batchnorm=True needs at least one sample per tower in every global batch, "
            f"but with {samples} samples and batch_size={batch_size} a batch of {smallest} "
            f"meets {workers} workers: raise batch_size, or drop the last "
            f"{samples % batch_size} sample(s) from data"
        )
