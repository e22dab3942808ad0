"""The low-level API for users who keep their own training loop: ``towers.init()``.

A script written against it runs unchanged as ``python script.py`` (one tower), under
``towers run script.py -n N`` and under ``torchrun --nproc-per-node N script.py``.
"""

from __future__ import annotations

import gc
import math
import os
from collections.abc import Iterable, Iterator
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from torch import nn

from . import _checkpoint
from ._comm import Comm, DistComm, LocalComm
from ._shm import ShmComm, ShmUnavailable
from ._split import batch_size, map_batch, split
from ._sync import DEFAULT_BUCKET_BYTES, GradientSync, StepResult, broadcast_module
from ._sync import verify_same_model as _verify
from ._world import DEFAULT_TIMEOUT, init_process_group, launched_env

__all__ = ["Context", "backward_weighted", "check_loss", "init", "join"]

Batch = TypeVar("Batch")


def check_loss(loss: Any, where: str = "loss_fn") -> None:
    """Raise a clear error unless ``loss`` is a scalar floating tensor with a gradient."""
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


def backward_weighted(loss: torch.Tensor, samples: int) -> float:
    """Backpropagate ``loss * samples`` and return that loss sum (``nan`` if not finite).

    A tower's mean loss times its sample count: summed over towers and divided by the total
    count, the gradients give the gradient of the mean loss over the whole global batch.
    """
    value = float(loss.detach())
    (loss * samples).backward()
    return value * samples if math.isfinite(value) else math.nan


class Context:
    """This process's place in the job and the synchronous step.

    Get one from :func:`towers.init`. Attributes: ``rank``, ``world_size``, ``local_rank``,
    ``device`` (``cuda:LOCAL_RANK`` under NCCL, else CPU) and ``is_main`` (rank 0).
    """

    def __init__(
        self,
        comm: Comm,
        local_rank: int = 0,
        device: torch.device | None = None,
        owns_group: bool = False,
    ):
        self.comm = comm
        self._owns_group = owns_group
        self.rank = comm.rank
        self.world_size = comm.world_size
        self.local_rank = local_rank
        self.device = device if device is not None else torch.device("cpu")
        self.steps = 0
        self._sync: GradientSync | None = None
        self._shard_samples: int | None = None
        self._acc_samples = 0
        self._acc_loss = 0.0

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def replicate(self, model: nn.Module, *, bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> nn.Module:
        """Give every rank rank 0's parameters and buffers, and attach the averaging hooks.

        Every rank must pass a model with the same parameter and buffer names and shapes; if one
        differs, all ranks raise ``ValueError`` naming the first difference.

        Returns:
            ``model`` itself, moved to :attr:`device`.
        """
        if not isinstance(model, nn.Module):
            raise TypeError(f"replicate() needs an nn.Module, got {type(model).__name__}")
        model.to(self.device)
        _verify(model, self.comm)
        broadcast_module(model, self.comm)
        if self._sync is not None:
            self._sync.remove()
        self._sync = GradientSync(model.parameters(), self.comm, bucket_bytes)
        if not self._sync.params:
            raise ValueError("the model has no trainable parameters (requires_grad=True)")
        return model

    def shards(self, batches: Iterable[Batch]) -> Iterator[Batch]:
        """This tower's shard of each global batch (see :func:`towers.split`), on :attr:`device`.

        The shard's sample count is remembered and used by the next :meth:`step` as its weight.
        """
        for batch in batches:
            shard = split(batch, self.world_size)[self.rank]
            self._shard_samples = batch_size(shard)
            yield map_batch(lambda t: torch.as_tensor(t).to(self.device), shard)

    def _weight(self, samples: int | None) -> int:
        if samples is None:
            return self._shard_samples if self._shard_samples is not None else 1
        if isinstance(samples, bool) or not isinstance(samples, int) or samples < 0:
            raise ValueError(f"samples must be an int >= 0, got {samples!r}")
        return samples

    def _backward(self, loss: torch.Tensor | None, samples: int) -> None:
        if samples == 0 or loss is None:
            return
        check_loss(loss, "the loss passed to step()")
        self._acc_loss += backward_weighted(loss, samples)
        self._acc_samples += samples

    def accumulate(self, loss: torch.Tensor, samples: int | None = None) -> None:
        """Backward a micro-batch's loss without communicating (gradient accumulation).

        The accumulated gradients are averaged, weighted by samples, at the next :meth:`step`.
        """
        self._backward(loss, self._weight(samples))

    def step(
        self,
        loss: torch.Tensor | None,
        optimizer: torch.optim.Optimizer,
        samples: int | None = None,
    ) -> StepResult:
        """Backward ``loss``, average gradients over all towers, and step ``optimizer``.

        The average is weighted by each tower's ``samples`` (by default the size of the last
        shard from :meth:`shards`). If any tower's loss or gradient is not finite, no tower
        updates (the result says which towers were at fault). Gradients are cleared afterwards.
        Every rank must call ``step`` once per global batch; a tower with no samples passes
        ``loss=None, samples=0``.

        Returns:
            The :class:`StepResult` of this step, identical on every rank.
        """
        if self._sync is None:
            raise RuntimeError("call ctx.replicate(model) before ctx.step()")
        samples = self._weight(samples)
        self._sync.arm()
        self._backward(loss, samples)
        result = self._sync.finish(self._acc_samples, self._acc_loss)
        if not result.skipped:
            optimizer.step()
        for p in self._sync.params:
            p.grad = None
        self._acc_samples, self._acc_loss = 0, 0.0
        self._shard_samples = None
        self.steps += 1
        return result

    def save_checkpoint(
        self,
        directory: str | os.PathLike[str],
        step: int,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        schedule: Any = None,
        extra: dict[str, Any] | None = None,
    ) -> None:
        """Save the training state of ``step`` (steps done) to ``directory``; call on every rank.

        Rank 0 writes ``step-NNNNNNNN.pt`` atomically (temporary file, then rename) with the
        model, optimizer and schedule state, every rank's RNG state and ``extra`` (tensors and
        plain values only); the two newest checkpoints are kept.
        """
        rng = self.comm.all_gather_object(torch.get_rng_state())
        if not self.is_main:
            return
        state = {
            "format": 1,
            "step": step,
            "model": {k: v.detach().cpu() for k, v in model.state_dict().items()},
            "optimizer": optimizer.state_dict(),
            "schedule": schedule.state_dict() if schedule is not None else None,
            "rng": rng,
            "extra": extra or {},
        }
        _checkpoint.save(directory, step, state)

    def load_checkpoint(
        self,
        directory: str | os.PathLike[str],
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        schedule: Any = None,
    ) -> tuple[int, dict[str, Any]]:
        """Restore the newest readable checkpoint in ``directory``; call on every rank.

        Returns:
            ``(step, extra)``: the steps already done (0 and ``{}`` if there is no checkpoint,
            so a fresh start and a restart share one code path).
        """
        state = _checkpoint.load_latest(directory)
        if state is None:
            return 0, {}
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        if schedule is not None and state["schedule"] is not None:
            schedule.load_state_dict(state["schedule"])
        if len(state["rng"]) == self.world_size:
            torch.set_rng_state(state["rng"][self.rank])
        return state["step"], state["extra"]

    def barrier(self) -> None:
        self.comm.barrier()

    def close(self) -> None:
        """Remove the hooks and, if :func:`init` created it, the process group."""
        if self._sync is not None:
            self._sync.remove()
            self._sync = None
        if isinstance(self.comm, ShmComm):
            self.comm.close()
        if self._owns_group and dist.is_initialized():
            dist.destroy_process_group()
            self._owns_group = False
            # Let go of the group now, while the interpreter is whole: a Gloo group destroyed
            # during interpreter shutdown can abort the process (std::terminate in a thread).
            self.comm = LocalComm()
            gc.collect()

    def __enter__(self) -> Context:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


TRANSPORTS = ("auto", "shm", "gloo", "nccl")


def init(
    *, backend: str | None = None, timeout: float | None = None, transport: str | None = None
) -> Context:
    """Join the job this process was launched into and return its :class:`Context`.

    Reads the torchrun environment (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``,
    ``MASTER_PORT``), set by ``torchrun``, ``towers run`` and :func:`towers.spawn`, and joins the
    process group over env:// (Gloo on CPU, NCCL when CUDA is available). Without those variables
    the process is a world of one and no process group is created.

    Args:
        backend: ``"gloo"`` or ``"nccl"``; chosen from the hardware by default.
        timeout: seconds a rank may wait for the others (rendezvous or a collective) before
            the job fails; default 60. A dead or stuck worker thus ends the job instead of
            hanging it.
        transport: how gradients are averaged: ``"shm"`` (shared memory; every rank on this
            host, CPU tensors), ``"gloo"``/``"nccl"`` (the process group), or ``"auto"``
            (default, or the ``TOWERS_TRANSPORT`` environment variable): shared memory where it
            applies, the process group otherwise. Every rank must ask for the same one.

    Example:
        >>> ctx = towers.init()
        >>> model = ctx.replicate(build_model())  # doctest: +SKIP
    """
    mode = os.environ.get("TOWERS_MODE", "sync")
    if mode != "sync":
        raise ValueError(
            f"this job was started with --mode {mode}, which applies to scripts that call "
            "towers.train; the own-loop API (init/replicate/step) is synchronous: start the "
            "script without --mode, or train with towers.train(..., mode=...)"
        )
    return join(backend=backend, timeout=timeout, transport=transport)


def join(
    *, backend: str | None = None, timeout: float | None = None, transport: str | None = None
) -> Context:
    """:func:`init` without the mode check: how ``towers.train``'s own workers join."""
    if transport is None:
        transport = os.environ.get("TOWERS_TRANSPORT") or "auto"
    if transport not in TRANSPORTS:
        raise ValueError(f"transport must be one of {', '.join(TRANSPORTS)}; got {transport!r}")
    if transport != "auto":
        backend = backend or ("gloo" if transport == "shm" else transport)
    if not launched_env():
        return Context(LocalComm())
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    owns_group = not dist.is_initialized()
    group = init_process_group(backend, timeout)
    device = torch.device("cpu")
    if dist.get_backend(group) == "nccl":
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    return Context(_comm(DistComm(group), transport, timeout), local_rank, device, owns_group)


def _comm(base: DistComm, transport: str, timeout: float | None) -> Comm:
    """Shared memory when asked for, or when ``auto`` and it applies; else the process group."""
    if transport in ("gloo", "nccl") or base.world_size == 1:
        return base
    gloo = dist.get_backend(base.group) == "gloo"
    if transport == "auto" and not gloo:
        return base
    if transport == "shm" and not gloo:
        raise ValueError(
            f"transport='shm' averages CPU tensors; this job runs on "
            f"{dist.get_backend(base.group)} (GPU): use transport='auto' or 'nccl'"
        )
    try:
        return ShmComm(base, timeout=DEFAULT_TIMEOUT if timeout is None else timeout)
    except ShmUnavailable as exc:
        if transport == "shm":
            raise RuntimeError(f"transport='shm' is not available: {exc}") from None
        return base
