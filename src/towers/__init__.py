"""towers: data-parallel training of PyTorch models.

A global batch is split into towers; each tower computes its loss and gradients on its shard
with the same weights; the gradients are combined synchronously (a sample-weighted average, one
update per step) or asynchronously (a parameter server). Runs on one machine with no setup
(local worker processes over loopback) and on clusters through ``torch.distributed`` under
``torchrun``.

The names below are the public API; the subpackages are internal (docs/architecture.md).
"""

from . import transforms
from .api.context import Context
from .api.join import init
from .api.result import TrainResult
from .api.train import train
from .core.average import average_gradients
from .core.parallel import make_parallel
from .core.split import split
from .core.step import StepResult
from .processes.spawn import WorkerError, spawn

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
    "transforms",
]

__version__ = "0.1.0"
