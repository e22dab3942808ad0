"""DDP's names over towers' step, for a DDP script that changes only its imports (``towers.ddp``).

Each rank brings its own batch, as under DDP. :class:`DistributedDataParallel` counts the
samples that go into each training forward (the first tensor's size along ``dim``) and towers
weights every rank's gradient by them, so the step averages over samples, not over ranks: a
rank with a smaller batch (an uneven last batch, a dataset that does not divide by the ranks)
counts for what it holds, and the run equals one process on the ranks' batches put together.
The step itself is the own loop's (:class:`~towers.api.stepper.Stepper` over the one
:class:`~towers.engines.sync.runner.StepRunner`): a script's ``loss.backward()`` arms the
reduction at its first gradient and completes it when the backward ends.

Ranks that run out of batches first (a dataset that does not divide into whole batches on
every rank) take empty steps beside the others' until every rank is out (:meth:`Stepper.join
<towers.api.stepper.Stepper.join>`): inside ``model.join()``, at the next
``sampler.set_epoch`` and at ``destroy_process_group``. The model, its buffers and its
optimizer's state are then taken from a rank that trained to the end.
"""

from __future__ import annotations

import contextlib
import datetime
import weakref
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch import nn
from torch.optim.optimizer import register_optimizer_step_post_hook
from torch.utils._pytree import tree_leaves

from ..core.devices import moved
from ..core.launch import RESTARTS_INSTEAD, read_launch
from ..core.modes import Engine, parse_mode
from ..engines.job import OptimizerFactory
from ..engines.sync.state import RunState
from ..engines.transforms import GradientTransform
from ..engines.transforms.scatter import ScatterToOwners
from .context import Context
from .join import join
from .micro import MicroBatches
from .stepper import Stepper

__all__ = [
    "DistributedDataParallel",
    "barrier",
    "batch_size_seen",
    "context",
    "destroy_process_group",
    "get_rank",
    "get_world_size",
    "init_process_group",
    "is_initialized",
    "join_all",
    "weigh_micro_batches",
    "wrapped_state",
]

_job: Context | None = None  # the job init_process_group joined
_models: weakref.WeakSet[DistributedDataParallel] = weakref.WeakSet()
_batch: int | None = None  # the samples of the first training forward: the loader's batch size


def weigh_micro_batches() -> None:
    """Every wrapped model weighs its accumulated micro-batches one by one from now on (for a
    loader whose ranks' batches end together: :class:`~towers.api.sampler.
    DistributedBatchSampler`)."""
    for model in _models:
        if model._steps.micro is None:
            model.weigh_micro_batches()


def wrapped_state() -> RunState | None:
    """The run state of the job's wrapped model (whose split a batch sampler follows), if one
    is wrapped."""
    return next((m._steps.state for m in _models), None)


def batch_size_seen() -> int | None:
    """The samples of the job's first training forward (a loader's batch size), once seen."""
    return _batch


def init_process_group(
    backend: str | None = None,
    init_method: str | None = None,
    timeout: datetime.timedelta | None = None,
    world_size: int = -1,
    rank: int = -1,
    store: Any = None,
    group_name: str = "",
    pg_options: Any = None,
    device_id: Any = None,
) -> None:
    """Join the job this process was launched into (``torchrun`` or ``towers run``), as
    ``torch.distributed.init_process_group`` does; a plain ``python script.py`` is a job of one.

    ``backend``: ``"gloo"`` (CPU workers, summed in shared memory on one host), ``"nccl"``
    (one GPU per rank) or a ``"cpu:gloo,cuda:nccl"`` pair (chosen by device); ``timeout``:
    how long a rank waits for the others. The job comes from the launcher's environment
    (env://): ``init_method``, ``store``, ``world_size`` and ``rank`` may only repeat it.
    """
    global _job
    if _job is not None:
        raise RuntimeError("init_process_group() was called twice: the job is joined already")
    if init_method not in (None, "env://") or store is not None:
        raise ValueError(
            "towers.ddp joins the job its launcher describes (env://: torchrun or towers run "
            f"set RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT); got init_method={init_method!r}"
            f"{', a store' if store is not None else ''}. Launch the script with torchrun or "
            "towers run, and call init_process_group(backend) without them"
        )
    launch = read_launch()
    if parse_mode(launch.mode).engine is not Engine.SYNC:
        raise ValueError(
            f"towers run --mode {launch.mode} runs a parameter server, which towers.ddp does "
            "not: a DDP script trains in sync (default) or in diloco:H / sparseloco:H"
        )
    if launch.elastic and launch.group_world_size == 1 and not launch.joining:
        raise SystemExit(RESTARTS_INSTEAD)  # towers run restarts every rank on a loss instead
    if launch.elastic:
        raise ValueError(
            "towers.ddp does not run under towers run --elastic across hosts: a step that "
            "loses a worker is redone on the same batch, which a script's own loss.backward() "
            "cannot be. A DDP script survives a lost worker as under torchrun: start it with "
            "torchrun --max-restarts R (or on one host towers run --max-restarts R), which "
            "restarts every rank when one fails, and let it resume from its own checkpoint; or "
            "port the loop to ctx = towers.init() and ctx.step(loss, optimizer), which goes on "
            "without the lost worker (docs/elastic.md)"
        )
    seconds = timeout.total_seconds() if timeout is not None else None
    job = join(launch, backend=_backend(backend), timeout=seconds)
    for name, given, actual in (
        ("rank", rank, job.rank),
        ("world_size", world_size, job.world_size),
    ):
        if given not in (-1, actual):
            job.close()
            raise ValueError(f"{name}={given} was passed, but the launcher made this {actual}")
    _job = job


def _backend(backend: str | None) -> str | None:
    """towers' backend for torch's name: one of gloo and nccl, or ``None`` to follow the
    device (a per-device pair, or none given)."""
    if backend is None or "," in backend or ":" in backend:
        return None
    if backend.lower() in ("gloo", "nccl"):
        return backend.lower()
    raise ValueError(
        f"backend must be 'gloo' or 'nccl' (or a 'cpu:gloo,cuda:nccl' pair), got {backend!r}"
    )


def context() -> Context:
    """The job :func:`init_process_group` joined."""
    if _job is None:
        raise RuntimeError(
            "Default process group has not been initialized: call "
            "towers.ddp.init_process_group() first"
        )
    return _job


def is_initialized() -> bool:
    """Whether :func:`init_process_group` has joined the job (and it has not been left)."""
    return _job is not None


def get_rank() -> int:
    return context().rank


def get_world_size() -> int:
    return context().world_size


def barrier() -> None:
    """Wait for every rank; ranks that ran out of batches first join the others first."""
    join_all()
    context().barrier()


def join_all() -> None:
    """Every wrapped model's ranks out of batches together (see the module doc); on every
    rank."""
    for model in list(_models):
        model.join_now()


def destroy_process_group(group: Any = None) -> None:
    """Leave the job: ranks that ran out of batches first wait in empty steps until the others
    are done (their model then equals theirs), and the hooks come off every wrapped model."""
    global _job, _batch
    if group is not None:
        raise ValueError("towers.ddp has one group, the job's: call destroy_process_group()")
    job = context()
    try:
        for model in list(_models):
            model.finish()
    finally:
        for model in list(_models):
            model.remove_hooks()
        _job, _batch = None, None
        job.close()


class DistributedDataParallel(nn.Module):
    """``torch.nn.parallel.DistributedDataParallel``'s interface over towers' synchronous step.

    The model keeps its place as ``.module``; a forward is the module's. After
    ``loss.backward()`` every ``.grad`` holds the mean gradient over every sample of every
    rank's batch (each rank weighted by the samples of its forwards since the last step; a
    forward with no tensor counts one). ``no_sync()`` and ``require_backward_grad_sync =
    False`` keep a backward on this rank (gradient accumulation), ``join()`` lets ranks run out
    of batches at different steps.

    towers' own options come as keywords: ``compress`` (``"bf16"``, ``"int8"``,
    ``"powersgd:R"``, ...; by default what ``towers run --compress`` or ``TOWERS_COMPRESS``
    names, so that a script ported by its imports alone can compress), ``transform``, and
    ``mode="diloco:H"`` with ``outer_optimizer`` (the script's ``optimizer.step()`` is then the
    tower's inner step, and every H-th is followed by the outer step; by default the mode of
    ``towers run --mode`` or ``TOWERS_MODE``, else ``"sync"``)
    (``sync_batchnorm`` is refused: not yet exact when the ranks' batches differ in size). One
    model per job. torch's ``device_ids`` must name the device the job put this rank on
    (``cuda:LOCAL_RANK`` under NCCL), ``bucket_cap_mb`` sizes the buckets;
    ``find_unused_parameters``, ``gradient_as_bucket_view`` and ``static_graph`` are accepted
    (towers tolerates parameters without gradients and hands out gradients as views of its
    buckets anyway). ``broadcast_buffers`` is accepted, but towers gives every rank rank 0's
    buffers at the start only: BatchNorm's running statistics then follow each rank's own
    batches, where DDP copies rank 0's at every forward.
    """

    def __init__(
        self,
        module: nn.Module,
        device_ids: Sequence[int | torch.device] | None = None,
        output_device: int | torch.device | None = None,
        dim: int = 0,
        broadcast_buffers: bool = True,
        process_group: Any = None,
        bucket_cap_mb: float | None = None,
        find_unused_parameters: bool = False,
        check_reduction: bool = False,
        gradient_as_bucket_view: bool = False,
        static_graph: bool = False,
        *,
        compress: str | None = None,
        sync_batchnorm: bool = False,
        transform: GradientTransform | None = None,
        mode: str | None = None,
        outer_optimizer: OptimizerFactory | None = None,
    ):
        super().__init__()
        job = context()
        if process_group is not None:
            raise ValueError("towers.ddp trains over the whole job: pass no process_group")
        if _models:
            raise ValueError(
                "towers.ddp wraps one model per job, and one is wrapped already: its steps and "
                "the next one's would share one reduction. Wrap a module that holds both (a "
                "GAN's generator and discriminator as one nn.Module), or port the loop to "
                "towers.init()"
            )
        if sync_batchnorm:
            raise ValueError(
                "sync_batchnorm is not available under towers.ddp yet: each rank's batch "
                "brings its own loss, and BatchNorm's gradient over the ranks would weigh them "
                "alike whatever their sizes. Port the loop to towers.init() and "
                "ctx.replicate(model, sync_batchnorm=True) (docs/batchnorm.md)"
            )
        _check_devices(job.device, device_ids)
        bucket = None if bucket_cap_mb is None else int(bucket_cap_mb * 2**20)
        if job._stepper().model is not None:  # a model was wrapped and let go: a new run
            job._restart()
        launch = read_launch()
        if compress is None and transform is None:
            compress = launch.compress  # towers run --compress, or TOWERS_COMPRESS
        mode = launch.mode if mode is None else mode  # towers run --mode, or TOWERS_MODE
        self.module = job.replicate(
            module,
            bucket_bytes=bucket,
            sync_batchnorm=sync_batchnorm,
            transform=transform,
            compress=compress,
            mode=mode,
            outer_optimizer=outer_optimizer,
            balance=False,
        )
        self.dim = dim
        self._steps: Stepper = job._stepper()
        # DiLoCo: backward calls stay on the tower, and the script's optimizer steps it alone
        self._steps.alone = not self._steps.state.plan.reduces
        self._params = {id(p) for p in self.module.parameters()}
        self._optimizers: list[weakref.ref[torch.optim.Optimizer]] = []  # in first-step order
        self._hook = register_optimizer_step_post_hook(self._stepped)
        _models.add(self)

    def weigh_micro_batches(self) -> None:
        """Weigh each accumulated micro-batch as one process on the ranks' batches would, also
        where they hold unequal samples (:mod:`towers.api.micro`): each forward of an
        accumulated step then sums its samples over the ranks. For a caller whose ranks run the
        same forwards in every step, to the end (Lightning's strategy: its sampler ends the
        ranks' batches together); a rank that ran out first would meet those sums with its
        empty steps."""
        self._steps.micro = MicroBatches(self.module.parameters(), lambda: context().comm)

    # -- DDP's switches --------------------------------------------------------------------

    @property
    def require_backward_grad_sync(self) -> bool:
        """``False``: backward calls stay on this rank (nanoGPT's switch for accumulation)."""
        return not self._steps.local

    @require_backward_grad_sync.setter
    def require_backward_grad_sync(self, value: bool) -> None:
        self._steps.local = not value

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward calls inside stay on this rank; the first one outside sums what the
        forwards since the last step accumulated, weighted by their samples."""
        before = self.require_backward_grad_sync
        self.require_backward_grad_sync = False
        try:
            yield
        finally:
            self.require_backward_grad_sync = before

    @contextlib.contextmanager
    def join(
        self,
        divide_by_initial_world_size: bool = True,
        enable: bool = True,
        throw_on_early_termination: bool = False,
    ) -> Iterator[None]:
        """Ranks may run out of batches at different steps inside: at the end, those that ran
        out first take empty steps beside the others' until all are out, and then hold the
        model, buffers and optimizer state of a rank that trained to the end.

        towers needs no ``divide_by_initial_world_size``: every step divides by the samples
        the ranks actually had.
        """
        if throw_on_early_termination:
            raise ValueError(
                "throw_on_early_termination is not needed under towers: the ranks that run out "
                "first take empty steps, and every step stays the mean over its samples"
            )
        yield
        if enable:
            self.join_now()

    def join_now(self) -> None:
        """Empty steps until every rank is out of batches; then every rank takes the state of
        one that trained to the end (the lowest rank among those that sat out least). DiLoCo's
        towers step alone: nothing to join."""
        if self._steps.alone:
            return
        sat_out = self._steps.join()
        comm = context().comm
        counts = comm.all_gather_object(sat_out)
        if max(counts) == 0:
            return
        source = counts.index(min(counts))
        with torch.no_grad():
            for t in [*self.module.parameters(), *self.module.buffers()]:
                comm.broadcast(t.data, source)
        optimizers = [o for o in (ref() for ref in self._optimizers) if o is not None]
        mine = [moved(o.state_dict(), "cpu") for o in optimizers]
        theirs = comm.broadcast_object(mine, source)  # one message, whatever each rank holds
        if len(theirs) == len(optimizers):  # a rank that never stepped keeps its own
            for optimizer, state in zip(optimizers, theirs):
                optimizer.load_state_dict(state)

    def finish(self) -> None:
        """The end of training: DiLoCo's last exchange (the model then holds the outer
        parameters on every rank); otherwise the join."""
        if self._steps.alone:
            self._steps.runner.exchange(final=True)
        else:
            self.join_now()

    def _stepped(self, optimizer: torch.optim.Optimizer, *args: Any) -> None:
        """An optimizer stepped: remember it if it steps this model (a join hands its state
        from a rank that trained to the end to those that sat out); in DiLoCo, count the
        tower's inner step."""
        ours = any(optimizer is ref() for ref in self._optimizers)
        if not ours and any(
            id(p) in self._params for g in optimizer.param_groups for p in g["params"]
        ):
            self._optimizers.append(weakref.ref(optimizer))
            ours = True
        if ours and self._steps.alone:
            self._steps.stepped_alone()

    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        if torch.is_grad_enabled():
            global _batch
            samples = _samples(inputs, kwargs, self.dim)
            _batch = samples if _batch is None else _batch
            self._steps.own_forward(samples)
        return self.module(*inputs, **kwargs)

    def remove_hooks(self) -> None:
        """Stop averaging: the module trains on alone (Lightning unwraps it after ``fit``, and
        a later ``fit`` wraps it again)."""
        self._hook.remove()
        self._steps.driver.remove()
        if self._steps.micro is not None:
            self._steps.micro.remove()
            self._steps.micro = None
        if self._steps.state.sharding is not None:  # a ZeroRedundancyOptimizer's
            self._steps.state.sharding.remove()
            self._steps.state.sharding = None
            if isinstance(self._steps.driver.transform, ScatterToOwners):
                self._steps.driver.retransform(None)
        _models.discard(self)


def _samples(inputs: tuple[Any, ...], kwargs: dict[str, Any], dim: int) -> int:
    """The samples of a forward: the first tensor's size along ``dim`` (1 without one)."""
    for leaf in tree_leaves((inputs, kwargs)):
        if isinstance(leaf, torch.Tensor):
            return int(leaf.shape[dim]) if leaf.dim() > dim else 1
    return 1


def _check_devices(device: torch.device, device_ids: Sequence[int | torch.device] | None) -> None:
    """``device_ids`` as DDP takes them: none, or the one device this rank computes on."""
    if not device_ids:
        return
    if len(device_ids) != 1:
        raise ValueError(f"one device per rank: device_ids={list(device_ids)!r} names several")
    (asked,) = device_ids
    wanted = torch.device("cuda", asked) if isinstance(asked, int) else torch.device(asked)
    if wanted != device:
        raise ValueError(
            f"device_ids={list(device_ids)!r}, but this rank computes on {device} (the job's "
            "placement: cuda:LOCAL_RANK under NCCL, else the CPU); pass device_ids=None"
        )
