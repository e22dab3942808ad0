"""One tower's copy of the training state, and how a tower computes its shard's gradient.

Shared by every engine: the synchronous loop, the parameter server and its workers build their
model, optimizer and schedule here, backpropagate a shard here (micro-batch by micro-batch,
``loss * samples``, optionally stretched for a straggler experiment), and catch a learning-rate
schedule up to a global batch here.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..core.split import map_batch, split
from .fetch import load
from .job import Job

__all__ = ["Replica", "backward_shard", "backward_weighted", "check_loss", "cpu_state"]


def cpu_state(module: nn.Module) -> dict[str, torch.Tensor]:
    """A private CPU copy of ``module``'s parameters and buffers."""
    return {k: v.detach().cpu().clone() for k, v in module.state_dict().items()}


def to_device(batch: Any, device: torch.device) -> Any:
    """``batch`` with every tensor moved to ``device``.

    To a GPU through pinned memory without waiting: a copy from pageable memory makes the host
    wait for everything queued on the GPU before it (the last step's update), and the GPU then
    idles while the host queues the next forward. The pinned buffer is kept until the copy is
    done (torch's pinned-memory allocator records the copy).
    """
    if device.type == "cpu":
        return map_batch(lambda t: torch.as_tensor(t).to(device), batch)
    return map_batch(lambda t: _to_gpu(torch.as_tensor(t), device), batch)


def _to_gpu(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    if t.device.type != "cpu":
        return t.to(device)
    return (t if t.is_pinned() else t.pin_memory()).to(device, non_blocking=True)


def check_loss(loss: Any, where: str = "loss_fn", model: nn.Module | None = None) -> None:
    """Raise a clear error unless ``loss`` is a scalar floating tensor with a gradient.

    A loss that is a leaf of the autograd graph (``requires_grad`` but no ``grad_fn``, as
    ``loss.detach().requires_grad_()`` makes) reaches no parameter; with ``model`` given, the
    whole graph is searched for one of its trainable parameters (once, in the caller: the
    search costs a walk over every node).
    """
    if not isinstance(loss, torch.Tensor):
        raise TypeError(
            f"{where} must return a scalar tensor (the mean loss over the shard), "
            f"got {type(loss).__name__}"
        )
    if loss.numel() != 1:
        raise ValueError(
            f"{where} must return a scalar tensor (the mean loss over the shard), got a tensor "
            f"of shape {list(loss.shape)}; reduce it, e.g. with .mean()"
        )
    if not loss.is_floating_point():
        raise TypeError(f"{where} must return a floating-point tensor, got {loss.dtype}")
    if not loss.requires_grad:
        raise ValueError(
            f"{where} returned a tensor that does not depend on any trainable parameter "
            "(requires_grad is False); compute it from the model's output"
        )
    detached = loss.grad_fn is None and not isinstance(loss, nn.Parameter)
    if detached or (model is not None and not _reaches(loss, model)):
        what = "is a leaf of the autograd graph (requires_grad but no grad_fn)"
        if not detached:
            what = (
                "reaches none of the trainable parameters of the model it was given (was it "
                "computed with another model, a global variable?)"
            )
        raise ValueError(
            f"{where} returned a tensor that {what}: its backward would change no parameter, "
            "and every step would train nothing. A loss is cut from the model's output by "
            "loss.detach().requires_grad_(), torch.tensor(loss.item(), requires_grad=True) or "
            "a copy through numpy; return the loss computed from the model's output, as it is"
        )


def _reaches(loss: torch.Tensor, model: nn.Module) -> bool:
    """Whether ``loss``'s autograd graph leads to a trainable parameter of ``model``."""
    params = {id(p) for p in model.parameters() if p.requires_grad}
    seen, stack = set(), [loss.grad_fn]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        if id(getattr(node, "variable", None)) in params:
            return True
        stack.extend(next_node for next_node, _ in node.next_functions)
    return id(loss) in params


def backward_weighted(loss: torch.Tensor, samples: int, scaler: Any = None) -> torch.Tensor:
    """Backpropagate ``loss * samples`` and return that loss sum, a detached 0-dim tensor.

    A tower's mean loss times its sample count: summed over towers and divided by the total
    count, the gradients give the gradient of the mean loss over the whole global batch.
    With a ``torch.amp.GradScaler``, ``scaler.scale(loss * samples)`` is backpropagated (the
    gradients come out scaled, as ``scaler.step`` expects) and the loss sum returned unscaled.
    The sum is not read here: on a GPU that would wait for the forward (and, after the
    backward, for the backward too); the step reads it with the others' sums.
    """
    weighted = loss * samples
    (weighted if scaler is None else scaler.scale(weighted)).backward()
    return loss.detach().double() * samples


def backward_shard(
    job: Job,
    model: nn.Module,
    indices: torch.Tensor,
    device: torch.device,
    *,
    before_last: Callable[[], None] | None = None,
    slow: float = 1.0,
    fetch: Callable[[list[torch.Tensor]], Iterable[Any]] | None = None,
) -> tuple[float | torch.Tensor, int]:
    """Backpropagate the samples at ``indices`` in ``job.accumulate`` micro-batches.

    ``before_last`` runs before the last micro-batch's backward (the sync engine arms its
    gradient hooks there, so that averaging overlaps that backward). ``slow > 1`` stretches the
    shard to ``slow`` times its compute time, for straggler experiments; the hooks are then not
    armed, so that the sleep comes before any communication. ``fetch`` turns the micro-batches'
    indices into batches (default: :func:`~towers.engines.fetch.load`).

    Returns:
        ``(loss sum, samples)`` over the shard; the loss sum is a 0-dim tensor on ``device``
        (0.0 for an empty shard), read by the caller when the step needs it.
    """
    micro = [m for m in split(indices, job.accumulate) if len(m)]
    began = time.perf_counter()
    loss_sum: float | torch.Tensor = 0.0
    samples = 0
    batches = load(job, job.data, micro) if fetch is None else fetch(micro)
    for i, (m, batch) in enumerate(zip(micro, batches, strict=True)):
        if before_last is not None and i == len(micro) - 1 and slow <= 1.0:
            before_last()
        loss = job.loss_fn(model, to_device(batch, device))
        check_loss(loss)
        loss_sum += backward_weighted(loss, len(m))
        samples += len(m)
    if slow > 1.0:
        time.sleep((slow - 1.0) * (time.perf_counter() - began))
    return loss_sum, samples


@dataclass
class Replica:
    """A model with its optimizer and learning-rate schedule, as one process trains them."""

    model: nn.Module
    optimizer: torch.optim.Optimizer | None = None
    schedule: torch.optim.lr_scheduler.LRScheduler | None = None
    scheduled: int = 0  # schedule.step() calls so far

    @classmethod
    def build(cls, job: Job, device: torch.device, *, optimizer: bool = True) -> Replica:
        """A private copy of the job's model on ``device``, with its optimizer and schedule.

        Always a copy: tensors sent to local workers travel through shared memory, so without it
        every worker would update one and the same parameter storage.
        """
        model = copy.deepcopy(job.model).to(device)
        opt = job.optimizer(model.parameters()) if optimizer else None
        schedule = job.lr_schedule(opt) if opt is not None and job.lr_schedule is not None else None
        return cls(model, opt, schedule)

    def schedule_to(self, count: int) -> None:
        """Step the schedule until it has been stepped ``count`` times (see ``Job.scheduled``)."""
        while self.schedule is not None and self.scheduled < count:
            self.schedule.step()
            self.scheduled += 1

    def state_dict(self, optimizer: bool = True) -> dict[str, Any]:
        """Model, optimizer (unless not ``optimizer``) and schedule state, for a checkpoint."""
        return {
            "model": cpu_state(self.model),
            "optimizer": self.optimizer.state_dict() if optimizer and self.optimizer else None,
            "schedule": self.schedule.state_dict() if self.schedule is not None else None,
            "scheduled": self.scheduled,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` (the optimizer's state is copied: an optimizer keeps the
        tensors it loads, and a checkpoint sent to local workers lies in memory they share)."""
        self.model.load_state_dict(state["model"])
        saved = state.get("optimizer")
        if self.optimizer is not None and saved is not None and "sharded" not in saved:
            self.optimizer.load_state_dict(copy.deepcopy(state["optimizer"]))
        if self.schedule is not None and state.get("schedule") is not None:
            self.schedule.load_state_dict(copy.deepcopy(state["schedule"]))
        self.scheduled = state.get("scheduled", 0)
