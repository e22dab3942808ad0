"""What an engine is given and what it returns: a frozen :class:`Job`, an :class:`EngineResult`.

``towers.train`` checks its arguments, builds one :class:`Job` and sends it by pickle to every
worker; an engine (sync or parameter server) trains it and returns an :class:`EngineResult`,
which ``train`` turns into the public ``TrainResult``. A checkpoint to resume from travels
beside the job, never inside it: the job says what to train, not where a run got to.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from torch import nn

from ..core.data import batches_per_epoch, num_samples
from ..core.modes import Engine, Mode
from ..core.transport import Transport
from .transforms import GradientTransform

__all__ = [
    "CollateFn",
    "EngineResult",
    "EvalFn",
    "Job",
    "LossFn",
    "OptimizerFactory",
    "ScheduleFactory",
]


class LossFn(Protocol):
    """``loss_fn(model, shard) -> scalar tensor``: the mean loss over the shard."""

    def __call__(self, model: nn.Module, shard: Any, /) -> torch.Tensor: ...


class EvalFn(Protocol):
    """``eval_fn(model, batch) -> {name: value}``: each metric's mean over the batch."""

    def __call__(self, model: nn.Module, batch: Any, /) -> dict[str, Any]: ...


CollateFn = Callable[[list[Any]], Any]
OptimizerFactory = Callable[[Iterable[torch.nn.Parameter]], torch.optim.Optimizer]
ScheduleFactory = Callable[[torch.optim.Optimizer], torch.optim.lr_scheduler.LRScheduler]


def default_optimizer(params: Iterable[torch.nn.Parameter]) -> torch.optim.Optimizer:
    """SGD with lr 0.01, the optimizer of the seeds' examples."""
    return torch.optim.SGD(params, lr=0.01)


@dataclass(frozen=True)
class Job:
    """One training job, as every worker receives it. Built and checked by ``towers.train``."""

    model: nn.Module
    loss_fn: LossFn
    data: Any
    batch_size: int
    steps: int  # global batches in all
    mode: Mode  # an instance of one of the classes in towers.engines.modes
    optimizer: OptimizerFactory = default_optimizer
    lr_schedule: ScheduleFactory | None = None
    seed: int = 0
    shuffle: bool = True
    log_dir: str | None = None
    progress: bool = True
    accumulate: int = 1  # micro-batches per tower shard
    timeout: float | None = None  # seconds a rank waits for the others; None: the default
    checkpoint: str | None = None  # directory
    checkpoint_every: int = 100
    every_rank: bool = False  # every rank returns the result (launched jobs), not only rank 0
    straggle: dict[int, float] = field(default_factory=dict)  # tower -> slowdown factor
    transport: Transport = Transport.AUTO  # given, else TOWERS_TRANSPORT, parsed in the caller
    elastic: bool = False  # sync: survive lost workers (the caller supervises them)
    eval_data: Any = None  # evaluated every eval_every global batches and at the end
    eval_fn: EvalFn | None = None  # None: {"loss": loss_fn(model, batch)}
    eval_every: int | None = None
    lr_interval: str = "step"  # the schedule steps once per global batch, or per epoch
    collate_fn: CollateFn | None = None  # a Dataset's samples into a batch; None: DataLoader's
    num_workers: int = 0  # data-loading processes per tower
    sync_batchnorm: bool = False  # BatchNorm statistics over the global batch (engines/syncbn.py)
    transform: GradientTransform | None = None  # how a bucket is reduced; None: a plain sum
    outer_optimizer: OptimizerFactory | None = None  # diloco's outer steps; None: the default
    device: str = "cpu"  # "cuda": every worker on its own GPU (cuda:LOCAL_RANK), over NCCL
    balance: bool = False  # split each global batch in proportion to the towers' speeds
    shard_optimizer: bool = False  # each tower keeps the optimizer state of its part only

    @property
    def asynchronous(self) -> bool:
        """Whether a parameter server (one more process, rank 0) runs the job."""
        return self.mode.engine is Engine.SERVER

    def scheduled(self, done: int) -> int:
        """How many times the schedule has stepped once ``done`` global batches are complete."""
        if self.lr_interval == "step":
            return done
        return done // batches_per_epoch(num_samples(self.data), self.batch_size)


@dataclass
class EngineResult:
    """An engine's record of a run; ``towers.train`` makes it a ``TrainResult``."""

    state_dict: dict[str, torch.Tensor]  # the trained parameters and buffers, on the CPU
    losses: list[float]
    tower_losses: list[list[float]]
    skipped: list[tuple[int, list[int]]]
    steps: int
    samples: int
    seconds: float
    times: list[float]
    staleness: list[int] = field(default_factory=list)
    ahead: list[int] = field(default_factory=list)
    dropped: list[tuple[int, int]] = field(default_factory=list)
    dead_workers: list[int] = field(default_factory=list)
    world: list[int] = field(default_factory=list)  # sync: towers that computed each step
    recoveries: list[tuple[int, float]] = field(default_factory=list)  # (step, seconds)
    evals: list[tuple[int, dict[str, float]]] = field(default_factory=list)
    shards: list[list[int]] = field(default_factory=list)  # sync: each step's split
    shard_seconds: list[list[float]] = field(default_factory=list)  # and each shard's time
