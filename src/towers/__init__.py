"""towers: data-parallel training of PyTorch models.

A global batch is split into towers; each tower computes its loss and gradients on its shard
with the same weights; the gradients are combined synchronously (a sample-weighted average, one
update per step). Runs on one machine with no setup (local worker processes over loopback) and
on clusters through ``torch.distributed`` under ``torchrun``.
"""

from ._average import average_gradients
from ._context import Context, init
from ._parallel import make_parallel
from ._split import split
from ._sync import StepResult
from ._train import TrainResult, train
from ._world import WorkerError, spawn

__all__ = [
    "Context",
    "StepResult",
    "TrainResult",
    "WorkerError",
    "average_gradients",
    "init",
    "make_parallel",
    "spawn",
    "split",
    "train",
]

__version__ = "0.1.0"
