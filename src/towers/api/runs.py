"""A wrapped model's run in towers' checkpoint layout, for a framework's own checkpoints.

Lightning's Trainer and Fabric save and load their checkpoints themselves; towers' strategies
put the run's state beside theirs under ``towers`` where the framework's state alone cannot
resume it (DiLoCo's modes: every rank's own parameters and inner optimizer, the outer step's).
"""

from __future__ import annotations

from typing import Any

from torch.utils.data import DataLoader

from ..engines.replica import Replica
from .ddp import DistributedDataParallel

__all__ = ["keeps_replicas", "rebuilt", "run_state"]


def keeps_replicas(wrapped: DistributedDataParallel) -> bool:
    """Whether the ranks' models differ between outer steps (DiLoCo's modes)."""
    return wrapped._steps.state.plan.keeps_replicas


def run_state(
    wrapped: DistributedDataParallel, replica: Replica, save: dict[str, Any] | None
) -> dict[str, Any]:
    """The run's state in towers' checkpoint layout (``save=None``: gathered from every rank),
    or ``save`` restored on every rank, the steps done included (a collective either way)."""
    state, driver = wrapped._steps.state, wrapped._steps.driver
    if save is None:
        return {"steps": state.steps, **state.checkpoint(driver, replica)}
    state.restore(save, driver, replica)
    state.steps = save["steps"]
    return save


def rebuilt(loader: DataLoader, batches: Any) -> DataLoader:
    """``loader`` with ``batches`` (a batch sampler) in its place, everything else as it was."""
    return DataLoader(
        loader.dataset,
        batch_sampler=batches,
        num_workers=loader.num_workers,
        collate_fn=loader.collate_fn,
        pin_memory=loader.pin_memory,
        timeout=loader.timeout,
        worker_init_fn=loader.worker_init_fn,
        multiprocessing_context=loader.multiprocessing_context,
        generator=loader.generator,
        prefetch_factor=loader.prefetch_factor,
        persistent_workers=loader.persistent_workers,
        pin_memory_device=loader.pin_memory_device,
    )
