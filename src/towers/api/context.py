"""The low-level API for users who keep their own training loop: ``towers.init()``.

A script written against it runs unchanged as ``python script.py`` (one tower), under ``towers
run``, ``torchrun`` and ``towers run --elastic``. The step is ``towers.train``'s
(:class:`~towers.engines.sync.driver.SyncDriver`) over the job's group
(:mod:`towers.engines.sync.group`): a fixed one, or an elastic one that survives lost workers.

Every step checks, inside the metadata it already sends, that all ranks are at the same step
and, for shards taken with :meth:`Context.shards`, that their global batches have the same size
and fingerprint (:mod:`towers.core.agree`). A rank that cuts its shards itself can only be
checked for its step counter: it never sees the global batch.

Under ``towers run --elastic``, a step that lost a peer returns ``redo=True`` (no update) and
``ctx.shards`` yields the *same* global batch again, split over the survivors; a replacement
receives the parameters, buffers, optimizer state and position from a live peer, but not a
schedule the loop builds itself (build it from ``ctx.steps``). See docs/elastic.md.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any, TypeVar

import torch
from torch import nn

from ..comm.base import Comm
from ..core.agree import fingerprint, mean_vector, weighted_means
from ..core.split import batch_size, cut
from ..core.step import StepResult
from ..engines.evaluate import combine, evaluate_loop_data
from ..engines.job import OptimizerFactory
from ..engines.replica import Replica, to_device
from ..engines.sync.driver import SyncDriver
from ..engines.sync.group import Group
from ..engines.sync.plan import EveryStep
from ..engines.sync.state import LastResult, RunState
from ..engines.transforms import GradientTransform
from .amp import check_scaler, poison_grads
from .loop_files import load_loop, save_loop
from .mistakes import BACKWARD_IN_DILOCO, refuse_distributed_sampler
from .replicate import prepare, sharding_for
from .stepper import Stepper

__all__ = ["Context"]

Batch = TypeVar("Batch")


class Context:
    """This process's place in the job and the synchronous step (get one from :func:`init`):
    ``rank``, ``world_size``, ``local_rank``, ``device`` (``cuda:LOCAL_RANK`` under NCCL, else
    CPU), ``is_main`` (rank 0) and ``steps`` (global batches completed)."""

    def __init__(self, group: Group):
        self._group = group
        self.local_rank = group.local_rank
        self.device = group.device
        self._begin()
        self._left: tuple[int, int] | None = None  # rank and world size, once closed

    def _begin(self) -> None:
        """A run's state from its start: no step taken, no model replicated yet."""
        self._last = LastResult()  # the last step's result: a peer's after a regroup
        # the user's batches cannot be replayed: the state agreed on elastic jobs says so
        self._state = RunState(EveryStep(), self._last, joining=self._group.joining, replays=False)
        self._steps = Stepper(self._group, self._state, self._last)

    @property
    def steps(self) -> int:
        """Global batches completed (in an elastic job, by the job: a replacement catches up)."""
        return self._state.steps

    @property
    def rank(self) -> int:
        return self._left[0] if self._left is not None else self._group.comm.rank

    @property
    def world_size(self) -> int:
        return self._left[1] if self._left is not None else self._group.comm.world_size

    @property
    def comm(self) -> Comm:
        """The transport averaging runs on (shared memory, or the process group)."""
        return self._group.comm

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    # -- the model and the data ------------------------------------------------------------

    def replicate(
        self,
        model: nn.Module,
        *,
        bucket_bytes: int | None = None,
        sync_batchnorm: bool = False,
        transform: GradientTransform | None = None,
        compress: str | None = None,
        mode: str = "sync",
        outer_optimizer: OptimizerFactory | None = None,
        balance: bool | None = None,
        shard_optimizer: bool = False,
    ) -> nn.Module:
        """Give every rank rank 0's parameters and buffers, and attach the averaging hooks.

        Every rank must pass a model with the same parameter and buffer names and shapes; if one
        differs, all ranks raise ``ValueError`` naming the first difference. In an elastic job
        the members agree on the most advanced state first (a replacement receives it).

        Args:
            model: the plain module (not wrapped in ``DistributedDataParallel``).
            bucket_bytes: gradient bytes per averaging message; default 4 MiB on the CPU,
                25 MiB on a GPU.
            sync_batchnorm: make every BatchNorm layer normalise over the whole global batch
                (statistics summed over all towers, weighted by samples) so that training and
                running statistics equal a single process's; every tower then needs at least
                one sample in every training forward. Without it, each tower normalises over
                its own shard and keeps its own running statistics (docs/batchnorm.md).
            transform: how each bucket of gradients is reduced over the towers (see
                :mod:`towers.transforms`); default: a plain sum. Every rank passes the same.
            compress: a compression by name, as ``towers.train``'s (``"bf16"``, ``"fp16"``,
                ``"int8"``, ``"powersgd:R"``, ``"topk:F[:BITS]"``); not with ``transform``.
            mode: ``"sync"``, or ``"diloco:H"`` (and its ``:overlap`` forms, docs/diloco.md):
                each :meth:`step` is then an inner step of this tower alone, and every H-th
                also the outer step over all towers; call :meth:`end_period` after the loop.
                ``"sparseloco:H"`` as ``"diloco:H"``, with SparseLoCo's exchange.
            outer_optimizer: ``"diloco:H"``: ``params -> Optimizer`` for the outer steps;
                default Nesterov SGD with lr 0.6 and momentum 0.5.
            balance: :meth:`shards` splits each global batch in proportion to the ranks'
                measured speed (the time from a shard to its backward); ``None`` (default):
                wherever that keeps results exact, as ``towers.train``'s ``balance``.
            shard_optimizer: each tower keeps the optimizer's state (DiLoCo: the outer
                state) of its part of the parameters only, steps it, gathers the others'
                (docs/sharding.md)

        Returns:
            ``model`` itself, moved to :attr:`device`.
        """
        ready = prepare(
            model,
            self._group,
            sync_batchnorm=sync_batchnorm,
            transform=transform,
            compress=compress,
            mode=mode,
            outer_optimizer=outer_optimizer,
            balance=balance,
        )
        sharding = sharding_for(model, self._group, shard_optimizer, ready)
        if self._state.sharding is not None:  # the model replicated before: no longer sharded
            self._state.sharding.remove()
        self._state.replica = Replica(model)
        self._state.plan = ready.plan
        self._state.balanced(ready.balance, ready.because)
        driver = SyncDriver(
            self._group,
            ready.transform,
            owner=self._state,
            mode=ready.mode,
            on_unarmed=self._steps.on_unarmed,
            defer=False if sharding is not None else None,
        )
        self._steps.attach(driver, model)
        own = sharding is not None and not ready.plan.shard(sharding)  # DiLoCo: its outer state
        breaks = self._state.plan.attach(model.to(self.device))
        self._state.sharding = sharding.start() if own and sharding is not None else None
        return driver.replicate(model, bucket_bytes, breaks)

    def shards(self, batches: Iterable[Batch]) -> Iterator[Batch]:
        """This tower's shard of each global batch, on :attr:`device`: :func:`towers.split`'s,
        or in proportion to the ranks' speeds where :meth:`replicate` balances.

        The shard's sample count is remembered and used by the next :meth:`backward` or
        :meth:`step` as its weight; that step also checks that every rank's global batch had the
        same size and fingerprint (so every rank must pass the same global batches). In an
        elastic job, a step that must be redone gets the same global batch again, split over
        the survivors, and a replacement starts where its peers are.
        """
        refuse_distributed_sampler(batches)
        for batch in batches:
            if self._state.catch_up > 0:
                self._state.catch_up -= 1
                continue
            while True:
                yield self._shard(batch)
                if not self._steps.redo:
                    break
                self._steps.redo = False

    def shard(self, batch: Batch) -> Batch:
        """This tower's shard of one global ``batch``, as :meth:`shards` gives it.

        For a loop that draws each batch itself (nanoGPT's ``get_batch``): take the shard right
        before the forward, ``model(*ctx.shard((x, y)))``, so that a batch drawn ahead (a
        prefetch) counts for the step it is trained in. Every rank must pass the same global
        batch. Under ``towers run --elastic`` use :meth:`shards`, which gives a redone step its
        batch again.
        """
        if self._group.elastic:
            raise ValueError(
                "ctx.shard() is not available under towers run --elastic (a step interrupted by "
                "a lost worker is redone on the same global batch): loop over ctx.shards(batches)"
            )
        return self._shard(batch)

    def _shard(self, batch: Batch) -> Batch:
        total = batch_size(batch)
        shard = cut(batch, self._state.split(total, self.world_size))[self.rank]
        self._steps.shard(batch_size(shard), (total, fingerprint(batch)))
        return to_device(shard, self.device)

    # -- the step --------------------------------------------------------------------------

    def accumulate(
        self, loss: torch.Tensor, samples: int | None = None, *, scaler: Any = None
    ) -> None:
        """Backward a micro-batch's loss without communicating (gradient accumulation).

        The accumulated gradients are averaged, weighted by samples, at the next
        :meth:`backward` or :meth:`step`. Pass each micro-batch's *mean* loss as it is: do not
        divide it by the number of micro-batches, as DDP scripts do (``loss / accum_steps``).
        towers already weights every micro-batch by its samples; a divided loss shrinks the
        gradient by that factor and makes results depend on how many ranks share the batch.
        With a ``GradScaler``, pass it here as to :meth:`backward`.
        """
        steps = self._steps
        steps.check_no_stale_grads()  # before the step's first micro-batch only
        steps.backward(loss, steps.weight(samples), check_scaler(scaler))
        steps.accumulated = True

    @property
    def last(self) -> StepResult | None:
        """The last step's result (after ``ctx.backward``, ``ctx.step`` or a plain
        ``loss.backward()``; that one's loss is ``nan``: towers does not see the loss)."""
        return self._last.result

    def no_sync(self) -> contextlib.AbstractContextManager[None]:
        """Backward calls inside stay on this tower, as inside DDP's ``model.no_sync()``:
        accumulate micro-batches with a plain ``loss.backward()``, the last one outside (or
        set ``model.require_backward_grad_sync``, as nanoGPT does). The shards ``ctx.shards``
        gave since the last step weight the step."""
        return self._steps.no_sync()

    def end_period(self) -> StepResult | None:
        """``"diloco:H"``: exchange and take the outer step now, whatever is left of the period
        (an overlapped exchange included); every rank calls it, once its loop is done.

        Afterwards the model holds the outer parameters on every rank. Returns the last outer
        step's result (``None`` in sync mode, or if nothing was left to exchange).
        """
        return self._steps.runner.exchange(final=True)

    def backward(
        self, loss: torch.Tensor | None, samples: int | None = None, *, scaler: Any = None
    ) -> StepResult:
        """Backward ``loss`` and leave the global batch's gradient in every ``.grad``.

        Replaces ``loss.backward()`` in a loop that steps its own optimizer: afterwards every
        parameter's ``.grad`` holds, on every rank, the gradient of the mean loss over the whole
        global batch (each tower weighted by its ``samples``, by default the size of its last
        shard from :meth:`shards`), so ``clip_grad_norm_``, a ``GradScaler`` and
        ``optimizer.step()`` work as in one process. If any tower's loss or gradient is not
        finite the step is skipped: every ``.grad`` is ``None`` on every rank (on a GPU, where
        the step is decided on the device, they hold the sums and the next ``optimizer.step()``
        is skipped there: docs/gpu.md), so ``optimizer.step()`` changes nothing. Clear the
        gradients before the next step, as in any loop. Every rank must call it once per
        global batch; a tower with no samples passes ``loss=None, samples=0``. Under autocast,
        pass the loss as it comes; with float16, pass the ``torch.amp.GradScaler`` as
        ``scaler`` and give it the unscaled loss: the gradients come out scaled for
        ``scaler.step(optimizer)``, and a skipped step leaves NaN in every ``.grad``, so that
        ``scaler.step`` skips and ``scaler.update()`` lowers the scale on every rank alike. Not
        under ``towers run --elastic``, where a lost worker's step is redone in :meth:`step`.

        Returns:
            The :class:`StepResult` of this step, identical on every rank.

        Example:
            >>> r = ctx.backward(loss_fn(model, shard))  # doctest: +SKIP
            >>> torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)  # doctest: +SKIP
            >>> optimizer.step(); optimizer.zero_grad()  # doctest: +SKIP
        """
        if self._group.elastic:
            raise ValueError(
                "ctx.backward() is not available under towers run --elastic (a step interrupted "
                "by a lost worker must be redone inside ctx.step); use ctx.step(loss, optimizer)"
            )
        if not self._state.every_step:
            raise ValueError(BACKWARD_IN_DILOCO)
        result = self._steps.run(loss, samples, None, check_scaler(scaler))
        if scaler is not None and result.skipped:
            poison_grads(self._steps.driver.params)
        return result

    def step(
        self,
        loss: torch.Tensor | None,
        optimizer: torch.optim.Optimizer,
        samples: int | None = None,
    ) -> StepResult:
        """Backward ``loss``, average gradients over all towers, and step ``optimizer``.

        :meth:`backward`, then ``optimizer.step()`` (unless skipped), then clearing the
        gradients; returns the :class:`StepResult`, identical on every rank (under ``towers run
        --elastic``, ``redo=True`` if a peer was lost: see the module doc).
        """
        self._state.optimizer(optimizer)
        return self._steps.run(loss, samples, optimizer)

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
        vector = mean_vector(values, samples).to(self.device)
        self.comm.agree_call(f"ctx.mean({sorted(map(str, values))})")
        self.comm.all_reduce_sum(vector).wait()
        return weighted_means(values, vector, self.world_size)

    def evaluate(
        self,
        model: nn.Module,
        data: Any,
        fn: Callable[[nn.Module, Any], Mapping[str, Any]],
        *,
        batch_size: int,
        collate_fn: Callable[[list[Any]], Any] | None = None,
    ) -> dict[str, float]:
        """Evaluate ``fn`` over all of ``data``, split over the ranks; call on every rank.

        ``data`` (tensors, a tuple/dict of tensors, or a map-style Dataset, the same on every
        rank) is cut into chunks of ``batch_size`` samples, each split over the ranks as
        :meth:`shards` splits a batch, and evaluated in eval mode under ``no_grad``; every rank
        gets the sample-weighted metrics one process would compute (as ``train(eval_data=)``).

        Args:
            model: the model to evaluate (e.g. the one :meth:`replicate` returned; in DiLoCo
                that one is evaluated with the outer parameters, the ones every rank shares).
            data: the evaluation samples.
            fn: ``fn(model, batch) -> {name: mean over the batch}`` (tensors or numbers).
            batch_size: samples per chunk, all ranks together.
            collate_fn: for a Dataset, as DataLoader's (default ``default_collate``).

        Example:
            >>> ctx.evaluate(model, (x_val, y_val), lambda m, b: {"loss": loss_fn(m, b)},
            ...              batch_size=256)  # doctest: +SKIP
            {'loss': 0.31}
        """
        model = self._state.evaluated(model)
        where = (self.device, self.rank, self.world_size)
        shares = self._state.shares(self.world_size)  # a balanced split's, as the shards'
        part = evaluate_loop_data(model, data, fn, batch_size, collate_fn, *where, shares)
        self.comm.agree_call("ctx.evaluate")
        return combine(self.comm.all_gather_object(part))

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
        model, optimizer and schedule state, every rank's RNG state and gradient-transform state,
        the mode's own (DiLoCo: outer parameters and optimizer, every rank's inner state) and
        ``extra`` (tensors and plain values only); the two newest checkpoints are kept. A
        write that fails (a full disk) warns and training goes on: the state is still in memory.
        """
        self.comm.agree_call(f"ctx.save_checkpoint(step {step})")
        replica = Replica(model, optimizer, schedule)
        save_loop(directory, step, self._steps.driver, self._state, replica, extra)

    def load_checkpoint(
        self,
        directory: str | os.PathLike[str],
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        schedule: Any = None,
    ) -> tuple[int, dict[str, Any]]:
        """Restore the newest readable checkpoint in ``directory`` (``towers.train``'s too, in a
        synchronous mode); call on every rank.

        Returns:
            ``(step, extra)``: the steps already done (0 and ``{}`` if there is no checkpoint,
            so a fresh start and a restart share one code path).

        Raises:
            ValueError: ``directory`` holds another mode's, or the parameter server's, state.
            RuntimeError: on every rank, if the ranks found different newest checkpoints.
        """
        replica = Replica(model, optimizer, schedule)
        loaded = load_loop(directory, self._steps.driver, self._state, replica)
        if loaded is None:
            return 0, {}
        self._state.steps = loaded[0]  # where the mode's periods continue
        return loaded

    def _stepper(self) -> Stepper:
        """The steps' owner, for ``towers.ddp``'s wrapper (its switches and its join)."""
        return self._steps

    def _restart(self) -> None:
        """Start a new run in the same job (``towers.ddp`` wraps a model after the last one was
        let go, as Lightning does for every ``fit``): its steps count from 0 again, as the
        mode's periods do."""
        self._steps.driver.remove()
        if self._state.sharding is not None:
            self._state.sharding.remove()
        self._begin()

    def barrier(self) -> None:
        self.comm.agree_call("ctx.barrier")
        self.comm.barrier()

    def close(self) -> None:
        """Leave the job: remove the hooks and, if :func:`init` created it, the process group.
        In an elastic job, first wait until every member has done every step. Afterwards
        :attr:`rank`, :attr:`world_size` and :attr:`is_main` keep their values in the job.
        """
        if self._left is None:
            self._left = (self.rank, self.world_size)
        driver = self._steps.driver
        try:
            self._steps.runner.land(wait=True)  # the last steps decided on the device: read
        finally:
            self._group.finish(driver if driver.model is not None else None)
            driver.remove()
            if self._state.sharding is not None:
                self._state.sharding.remove()
            self._group.close()

    def __enter__(self) -> Context:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
