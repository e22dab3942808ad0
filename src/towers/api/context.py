"""The low-level API for users who keep their own training loop: ``towers.init()``.

A script written against it runs unchanged as ``python script.py`` (one tower), under
``towers run script.py -n N`` and under ``torchrun --nproc-per-node N script.py``. The step
itself is the synchronous engine's (:class:`~towers.engines.sync.step.SyncStep`), the same one
``towers.train`` uses.

Every step checks, inside the metadata it already sends, that all ranks are at the same step
and, for shards taken with :meth:`Context.shards`, that their global batches have the same size
and fingerprint (:mod:`towers.core.agree`). A rank that cuts its shards itself can only be
checked for its step counter: it never sees the global batch.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator, Mapping
from typing import Any, TypeVar

import torch
from torch import nn

from ..comm.base import Comm
from ..comm.group import Connection, connect
from ..core.agree import BatchStamp, fingerprint, mean_vector, weighted_means
from ..core.args import check_timeout
from ..core.launch import read_launch
from ..core.split import batch_size, map_batch, split
from ..core.step import StepResult
from ..engines import checkpoint
from ..engines.replica import backward_weighted, check_loss, cpu_state
from ..engines.sync.gradsync import DEFAULT_BUCKET_BYTES
from ..engines.sync.step import SyncStep
from ..engines.syncbn import convert_batchnorm
from .mistakes import (
    BACKWARD_TWICE,
    refuse_distributed_sampler,
    refuse_wrapped_model,
    warn_unsynced_buffers,
)

__all__ = ["Context", "init"]

Batch = TypeVar("Batch")


class Context:
    """This process's place in the job and the synchronous step.

    Get one from :func:`towers.init`. Attributes: ``rank``, ``world_size``, ``local_rank``,
    ``device`` (``cuda:LOCAL_RANK`` under NCCL, else CPU) and ``is_main`` (rank 0).
    """

    def __init__(self, conn: Connection):
        self._conn = conn
        self.rank = conn.comm.rank
        self.world_size = conn.comm.world_size
        self.local_rank = conn.local_rank
        self.device = conn.device
        self.steps = 0
        self._step = SyncStep(conn.comm, conn.device)
        self._shard_samples: int | None = None
        self._batch: tuple[int, int] | None = None  # the last global batch's size, fingerprint
        self._accumulated = False  # accumulate() ran since the last step

    @property
    def comm(self) -> Comm:
        """The transport averaging runs on (shared memory, or the process group)."""
        return self._conn.comm

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def replicate(
        self,
        model: nn.Module,
        *,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        sync_batchnorm: bool = False,
    ) -> nn.Module:
        """Give every rank rank 0's parameters and buffers, and attach the averaging hooks.

        Every rank must pass a model with the same parameter and buffer names and shapes; if one
        differs, all ranks raise ``ValueError`` naming the first difference.

        Args:
            model: the plain module (not wrapped in ``DistributedDataParallel``).
            bucket_bytes: gradient bytes per averaging message.
            sync_batchnorm: make every BatchNorm layer normalise over the whole global batch
                (statistics summed over all towers, weighted by samples) so that training and
                running statistics equal a single process's; every tower then needs at least
                one sample in every training forward. Without it, each tower normalises over
                its own shard and keeps its own running statistics (docs/batchnorm.md).

        Returns:
            ``model`` itself, moved to :attr:`device`.
        """
        if not isinstance(model, nn.Module):
            raise TypeError(f"replicate() needs an nn.Module, got {type(model).__name__}")
        refuse_wrapped_model(model, "ctx.replicate()")
        if sync_batchnorm:
            convert_batchnorm(model, self.comm)
        elif self.world_size > 1:
            warn_unsynced_buffers(model, "ctx.replicate(model, sync_batchnorm=True)")
        return self._step.replicate(model, bucket_bytes)

    def shards(self, batches: Iterable[Batch]) -> Iterator[Batch]:
        """This tower's shard of each global batch (see :func:`towers.split`), on :attr:`device`.

        The shard's sample count is remembered and used by the next :meth:`backward` or
        :meth:`step` as its weight; that step also checks that every rank's global batch had the
        same size and fingerprint (so every rank must pass the same global batches).
        """
        refuse_distributed_sampler(batches)
        for batch in batches:
            shard = split(batch, self.world_size)[self.rank]
            self._shard_samples = batch_size(shard)
            self._batch = (batch_size(batch), fingerprint(batch))
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
        check_loss(loss, "the loss passed to ctx.backward()/ctx.step()")
        try:
            loss_sum = backward_weighted(loss, samples)
        except RuntimeError as exc:
            if "backward through the graph a second time" not in str(exc):
                raise
            raise RuntimeError(BACKWARD_TWICE) from None
        self._step.add(loss_sum, samples)

    def _check_no_stale_grads(self) -> None:
        """Gradients present before a step's first backward were not made by this step."""
        if self._accumulated:
            return
        for p in self._step.params:
            if p.grad is not None and bool(p.grad.any()):
                raise RuntimeError(BACKWARD_TWICE)

    def accumulate(self, loss: torch.Tensor, samples: int | None = None) -> None:
        """Backward a micro-batch's loss without communicating (gradient accumulation).

        The accumulated gradients are averaged, weighted by samples, at the next
        :meth:`backward` or :meth:`step`.
        """
        self._check_no_stale_grads()  # before the step's first micro-batch only
        self._backward(loss, self._weight(samples))
        self._accumulated = True

    def backward(self, loss: torch.Tensor | None, samples: int | None = None) -> StepResult:
        """Backward ``loss`` and leave the global batch's gradient in every ``.grad``.

        Replaces ``loss.backward()`` in a loop that steps its own optimizer: afterwards every
        parameter's ``.grad`` holds, on every rank, the gradient of the mean loss over the whole
        global batch (each tower weighted by its ``samples``, by default the size of its last
        shard from :meth:`shards`), so ``clip_grad_norm_``, a ``GradScaler`` and
        ``optimizer.step()`` work as in one process. If any tower's loss or gradient is not
        finite the step is skipped: every ``.grad`` is ``None`` on every rank, so
        ``optimizer.step()`` changes nothing. Clear the gradients (``optimizer.zero_grad()``)
        before the next step, as in any loop. Every rank must call it once per global batch; a
        tower with no samples passes ``loss=None, samples=0``.

        Returns:
            The :class:`StepResult` of this step, identical on every rank.

        Example:
            >>> r = ctx.backward(loss_fn(model, shard))  # doctest: +SKIP
            >>> torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)  # doctest: +SKIP
            >>> optimizer.step(); optimizer.zero_grad()  # doctest: +SKIP
        """
        if self._step.sync is None:
            raise RuntimeError("call ctx.replicate(model) before ctx.backward() or ctx.step()")
        samples = self._weight(samples)
        self._check_no_stale_grads()
        self._step.arm()
        self._backward(loss, samples)
        size, mark = self._batch if self._batch is not None else (None, None)
        stamp = BatchStamp(self.world_size).pack(self.rank, self.steps, size, mark)
        self._shard_samples, self._batch, self._accumulated = None, None, False
        self.steps += 1
        result = self._step.reduce(stamp)
        if result.skipped:
            self._step.zero_grad()
        return result

    def step(
        self,
        loss: torch.Tensor | None,
        optimizer: torch.optim.Optimizer,
        samples: int | None = None,
    ) -> StepResult:
        """Backward ``loss``, average gradients over all towers, and step ``optimizer``.

        The shorthand for :meth:`backward`, then ``optimizer.step()`` (unless the step is
        skipped), then clearing the gradients.

        Returns:
            The :class:`StepResult` of this step, identical on every rank.
        """
        result = self.backward(loss, samples)
        self._step.apply(result, optimizer)
        return result

    def mean(self, values: Mapping[str, Any], samples: int) -> dict[str, float]:
        """The sample-weighted mean of ``values`` over all towers; call on every rank.

        For metrics: each rank passes its means over its own ``samples`` samples (floats or
        one-element tensors, the same keys on every rank) and every rank gets the mean over all
        samples, as one process computing them on everything would (``nan`` if no rank had a
        sample).

        Example:
            >>> ctx.mean({"loss": loss.item(), "accuracy": acc}, samples=len(y))  # doctest: +SKIP
            {'accuracy': 0.93, 'loss': 0.21}
        """
        if not isinstance(values, Mapping):
            raise TypeError(f"ctx.mean() takes a dict of metrics, got {type(values).__name__}")
        if isinstance(samples, bool) or not isinstance(samples, int) or samples < 0:
            raise ValueError(f"samples must be an int >= 0, got {samples!r}")
        vector = mean_vector(values, samples).to(self.device)
        self.comm.all_reduce_sum(vector).wait()
        return weighted_means(values, vector, self.world_size)

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
        plain values only); the two newest checkpoints are kept. A write that fails (a full
        disk) warns and training goes on: the state is still in memory.
        """
        rng = self.comm.all_gather_object(torch.get_rng_state())
        if not self.is_main:
            return
        payload = {
            "model": cpu_state(model),
            "optimizer": optimizer.state_dict(),
            "schedule": schedule.state_dict() if schedule is not None else None,
            "rng": rng,
            "extra": extra or {},
        }
        checkpoint.save_or_warn(directory, step, "loop", payload)

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

        Raises:
            ValueError: if ``directory`` holds checkpoints of ``towers.train``, not of a loop.
        """
        state = checkpoint.load_latest(directory, "loop")
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
        self._step.remove()
        self._conn.close()

    def __enter__(self) -> Context:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def init(
    *, backend: str | None = None, timeout: float | None = None, transport: str | None = None
) -> Context:
    """Join a (non-elastic) job and return its :class:`Context`; see :func:`towers.init`.

    Args are as :func:`towers.init`'s (``api/join.py``), which calls this unless the job was
    started by ``towers run --elastic``.
    """
    launch = read_launch()
    mode = launch.mode
    if mode != "sync":
        raise ValueError(
            f"this job was started with --mode {mode}, which applies to scripts that call "
            "towers.train; the own-loop API (init/replicate/step) is synchronous: start the "
            "script without --mode, or train with towers.train(..., mode=...)"
        )
    timeout = check_timeout(timeout)
    return Context(connect(launch, backend=backend, timeout=timeout, transport=transport))
