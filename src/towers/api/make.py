"""From ``towers.train``'s arguments to one checked :class:`~towers.engines.job.Job`.

Every argument is checked here, in the caller, before any worker starts (the checks themselves
live in :mod:`towers.api.validate`, :mod:`towers.api.options` and :mod:`towers.api.mistakes`);
then the job is probed (:func:`~towers.api.validate.preflight`: the optimizer, the schedule
and one shard's loss are built and computed here), and the checkpoint directory is prepared.
"""

from __future__ import annotations

import copy
import dataclasses
import os
from typing import Any

from ..core.args import check_timeout
from ..core.compat import server_refusal
from ..core.data import batches_per_epoch
from ..core.launch import Launch, read_launch
from ..core.modes import Engine, Mode, parse_mode
from ..core.transport import Transport
from ..engines import checkpoint as checkpoint_files
from ..engines.checkpoint import estimate_bytes
from ..engines.job import Job, default_optimizer
from ..engines.sync.mode import SyncMode
from ..engines.transforms import check_transform, compression
from ..processes.guard import check_main_guard
from .balance import choose_balance, unbalanced_because
from .device import train_placement
from .epochs import announce_epochs
from .mistakes import check_sync_batchnorm, refuse_sample_list, refuse_wrapped_model
from .options import check_options, preflight_eval, refuse_loader
from .outer import announce_outer
from .validate import (
    averages_buffers,
    check_arguments,
    check_elastic,
    check_min_workers,
    check_mode_options,
    check_picklable,
    check_sharding,
    check_straggle,
    check_workers,
    launched_workers,
    preflight,
)

__all__ = ["RunPlan", "make_job", "reduction"]

# train()'s keywords that a Job carries under the same name, as given
_AS_GIVEN = (
    "batch_size",
    "lr_schedule",
    "seed",
    "accumulate",
    "checkpoint_every",
    "eval_data",
    "eval_fn",
    "eval_every",
    "lr_interval",
    "collate_fn",
    "num_workers",
)


@dataclasses.dataclass(frozen=True)
class RunPlan:
    """How a checked job runs: its towers, whether it was launched, restarts allowed."""

    workers: int
    launched: bool
    max_restarts: int
    min_workers: int  # elastic: the workers that start the job; the others join it


def make_job(args: dict[str, Any]) -> tuple[Job, RunPlan]:
    """Check ``train``'s arguments (a dict of its parameters) and build the job they ask for."""
    model, data = args["model"], args["data"]
    refuse_loader("data", data)
    refuse_wrapped_model(model, "train()")
    refuse_sample_list(data)
    ints = ("batch_size", "workers", "accumulate", "checkpoint_every")
    n = check_arguments(
        model,
        args["loss_fn"],
        data,
        ints={k: args[k] for k in ints},
        optional_ints={"steps": args["steps"], "epochs": args["epochs"]},
        max_restarts=args["max_restarts"],
        checkpoint=args["checkpoint"],
        seed=args["seed"],
        log_dir=args["log_dir"],
    )
    check_options(data, **{k: args[k] for k in _OPTIONS})
    launch = read_launch()
    transport = Transport.parse(args["transport"], launch.transport)
    mode = _mode(args["mode"], launch)
    workers = launched_workers(mode, args["workers"], launch)
    check_workers(mode, workers, launched := launch.launched)
    batch_size, accumulate = args["batch_size"], args["accumulate"]
    announce_epochs(mode, args["epochs"], n, batch_size, workers, launch.rank)
    announce_outer(mode, args["outer_optimizer"], workers, "towers.train", launch.rank)
    check_mode_options(
        mode, model, args["sync_batchnorm"], args["elastic"], args["outer_optimizer"]
    )
    if args["sync_batchnorm"] or not averages_buffers(mode):
        check_sync_batchnorm(
            args["sync_batchnorm"], model, mode, workers, n, batch_size, accumulate
        )
    if not launched and (workers > 1 or mode.servers or args["max_restarts"]):
        check_main_guard("towers.train()")  # before any worker starts, and never restarted
    check_elastic(args["elastic"], mode, transport, launch)
    if (refused := server_refusal(mode, transport)) is not None:  # the server sums nothing
        raise ValueError(refused)
    least = check_min_workers(args["min_workers"], workers, args["elastic"])
    placement = train_placement(args["device"], mode, workers, launch, transport, args["elastic"])
    transform = reduction(args["transform"], args["compress"], model, mode)
    shard_optimizer = check_sharding(
        args["shard_optimizer"], mode, args["elastic"], transform, args["checkpoint"]
    )
    because = unbalanced_because(
        model, args["sync_batchnorm"], args["collate_fn"], placement.kind, mode, transform
    )
    balance = choose_balance(args["balance"], mode, workers, because, "towers.train", launch.rank)
    job = Job(
        model=_on_cpu(model),
        loss_fn=args["loss_fn"],
        data=data,
        steps=_total_steps(args["steps"], args["epochs"], n, batch_size),
        mode=mode,
        optimizer=args["optimizer"] if args["optimizer"] is not None else default_optimizer,
        shuffle=bool(args["shuffle"]),
        log_dir=None if args["log_dir"] is None else str(args["log_dir"]),
        progress=bool(args["progress"]),
        timeout=check_timeout(args["timeout"]),
        checkpoint=None if args["checkpoint"] is None else os.fspath(args["checkpoint"]),
        every_rank=launched,
        straggle=check_straggle(args["straggle"], workers),
        sync_batchnorm=bool(args["sync_batchnorm"]),
        elastic=bool(args["elastic"]),
        transform=transform,
        outer_optimizer=args["outer_optimizer"],
        device=placement.kind,
        transport=transport,
        balance=balance,
        shard_optimizer=shard_optimizer,
        **{k: args[k] for k in _AS_GIVEN},
    )
    here = launched or (workers + mode.servers == 1 and not args["max_restarts"])
    # GPU workers in processes of their own check their loss at their first step: computed
    # here, it would hold a CUDA context on their GPU for the whole run.
    probe = placement.device if here or not placement.cuda else None
    preflight(job, workers, probe)
    if job.checkpoint is not None and (not launched or launch.rank == 0):
        checkpoint_files.prepare_directory(job.checkpoint, estimate_bytes(model, n))
    preflight_eval(job, workers, probe)
    return job, RunPlan(workers, launched, args["max_restarts"], least)


_OPTIONS = ("eval_data", "eval_fn", "eval_every", "lr_interval", "collate_fn", "num_workers")


def _on_cpu(model: Any) -> Any:
    """The job's copy of ``model``, on the CPU: every worker moves its own copy to its device
    (a model sent on a GPU would be rebuilt on that GPU in every worker)."""
    if all(t.device.type == "cpu" for t in (*model.parameters(), *model.buffers())):
        return model
    return copy.deepcopy(model).cpu()


def _total_steps(steps: int | None, epochs: int | None, samples: int, batch_size: int) -> int:
    """Global batches to train: ``steps``, or ``epochs`` passes over ``samples``."""
    if steps is not None and epochs is None:
        return steps
    if epochs is not None and steps is None:
        return epochs * batches_per_epoch(samples, batch_size)
    raise ValueError(
        "give either steps= (global batches) or epochs= (passes over the data), not "
        + ("neither" if steps is None else "both")
    )


def _mode(mode: str, launch: Launch) -> Mode:
    """The mode to train in: ``towers run --mode M`` makes ``M`` the default."""
    if launch.launched and mode == "sync":  # train()'s default
        mode = launch.mode
    return parse_mode(mode)


def reduction(transform: Any, compress: Any, model: Any, mode: Mode | None = None) -> Any:
    """The gradient transform that ``transform=`` or ``compress=`` asks for (``None``: a sum).

    Only the synchronous engine reduces buckets; a compression name is checked against the
    model's weights here, before any worker starts.
    """
    given = "transform=" if compress is None else "compress="
    if isinstance(mode, SyncMode) and (own := mode.transform()) is not None:
        if transform is not None or compress is not None:
            raise ValueError(
                f"mode {str(mode)!r} sends its exchanges through its own compression ({own!r}); "
                f"drop {given}, or train in mode='diloco:{mode.arg}' with {given}"
            )
        return own
    if transform is None and compress is None:
        return None
    if transform is not None and compress is not None:
        raise ValueError(
            "give transform= or compress=, not both; to combine a transform with a compression, "
            "chain them: towers.transforms.chain(my_transform, towers.transforms.compression(...))"
        )
    if mode is not None and mode.engine is not Engine.SYNC:
        raise ValueError(
            f"{given} applies to mode='sync' and 'diloco:H' (it reduces each bucket of a "
            f"synchronous step); mode {str(mode)!r} sends every tower's gradient to the "
            f"parameter server: drop {given} or train in sync mode"
        )
    if compress is not None:
        shapes = [tuple(p.shape) for p in model.parameters() if p.requires_grad]
        return compression(compress, shapes)
    check_transform(transform)
    check_picklable("transform", transform, "define its class at module level")
    return transform
