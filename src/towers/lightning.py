"""Lightning on towers: ``import towers.lightning``, then ``Trainer(strategy="towers")`` or
``Fabric(strategy="towers")``.

The strategy is Lightning's DDP strategy with towers' pieces in DDP's places (the drop-in of
:mod:`towers.ddp`, so the step is the own loop's one runner): each rank's gradient is weighted
by the samples of its batch, and the sampler Lightning puts in a distributed loader deals every
sample once instead of padding the dataset. A ``LightningModule`` then ends with the
parameters one device gets on the same global batches, uneven last batch included, where
Lightning's ``ddp`` averages the ranks' means over a padded dataset.

Example:
    >>> import towers.lightning  # registers "towers"
    >>> trainer = lightning.pytorch.Trainer(strategy="towers", accelerator="cpu", devices=2)
    ... # doctest: +SKIP

``TowersStrategy(compress="int8")`` or ``TowersStrategy(mode="diloco:16")`` passes towers'
options on; ``TowersStrategy(balance=None)`` cuts each global batch of the training loader in
shares that follow the ranks' speeds. Lightning starts the ranks itself
(``devices=N``: it runs the script once per rank), or runs under ``torchrun`` and ``towers run``
as its DDP does. See docs/lightning.md.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Generator
from typing import Any

try:
    from lightning.fabric.accelerators import CPUAccelerator as FabricCPU
    from lightning.fabric.accelerators import CUDAAccelerator as FabricCUDA
    from lightning.fabric.strategies import STRATEGY_REGISTRY as FABRIC_STRATEGIES
    from lightning.fabric.strategies import DDPStrategy as FabricDDPStrategy
    from lightning.fabric.strategies.strategy import _BackwardSyncControl
    from lightning.pytorch.accelerators import CPUAccelerator, CUDAAccelerator
    from lightning.pytorch.strategies import DDPStrategy, StrategyRegistry
    from lightning.pytorch.utilities.data import _update_dataloader
except ImportError as exc:  # pragma: no cover - the extra is not installed
    raise ImportError(
        "towers.lightning needs Lightning: pip install 'towers-dp[lightning]' (lightning>=2.4)"
    ) from exc
import torch
from torch import Tensor
from torch.utils.data import DataLoader, default_collate
from torch.utils.data import distributed as torch_distributed

from . import ddp
from .api.balance import COLLATE_FN, check_balance, choose_balance
from .api.ddp import join_all
from .api.runs import keeps_replicas, rebuilt, run_state
from .core.launch import TRANSPORT
from .core.transport import Transport
from .engines.replica import Replica

__all__ = ["TowersFabricStrategy", "TowersStrategy"]

NAME = "towers"
DESCRIPTION = "towers: sample-weighted, exact data parallelism"


def _join(strategy: Any, timeout: Any, transport: Transport | None) -> None:
    """Join the job as the launcher placed this rank (Lightning's own, torchrun or towers
    run): towers reads the torchrun variables, which Lightning's launcher only partly sets."""
    env = strategy.cluster_environment
    assert env is not None
    if transport is not None:
        os.environ[TRANSPORT] = str(transport)
    os.environ.update(
        RANK=str(strategy.global_rank),
        WORLD_SIZE=str(strategy.world_size),
        LOCAL_RANK=str(strategy.local_rank),
        LOCAL_WORLD_SIZE=str(strategy.num_processes),
        MASTER_ADDR=env.main_address,
        MASTER_PORT=str(env.main_port),
    )
    if not ddp.is_initialized():
        ddp.init_process_group(strategy._process_group_backend, timeout=timeout)
    strategy._process_group_backend = "nccl" if strategy.root_device.type == "cuda" else "gloo"


def _refuse_options(strategy: Any, layer_sync: Any) -> None:
    """Lightning's options that would not keep their meaning under towers, refused when the
    Trainer or Fabric is made, before any rank starts."""
    accelerator = strategy.accelerator
    if not isinstance(accelerator, CPUAccelerator | CUDAAccelerator | FabricCPU | FabricCUDA):
        raise ValueError(
            f"strategy='towers' trains on accelerator='cpu' or 'cuda', got "
            f"{type(accelerator).__name__}: pass accelerator='cpu' (or 'cuda' with GPUs)"
        )
    # the Trainer's strategies hold a precision_plugin, Fabric's a precision
    plugin = getattr(strategy, "precision_plugin", None) or strategy.precision
    precision = str(getattr(plugin, "precision", "32-true"))
    if precision.startswith("16") and isinstance(accelerator, CPUAccelerator | FabricCPU):
        raise ValueError(
            f"precision={precision!r} computes in float16, which CPUs do slowly and, with no "
            "loss scaling, inexactly: on accelerator='cpu' pass precision='bf16-mixed' (or "
            "'32-true')"
        )
    if layer_sync is not None:
        raise ValueError(
            "sync_batchnorm=True is not available under strategy='towers' yet: each rank's "
            "batch brings its own loss, and torch's SyncBatchNorm would weigh batches of "
            "different sizes alike. Leave sync_batchnorm off (each rank normalises over its "
            "own batch), or train in towers' own loop with ctx.replicate(model, "
            "sync_batchnorm=True) (docs/batchnorm.md)"
        )


def _towers_sampler(dataloader: object, balance: bool | None = False) -> object:
    """The sampler Lightning put in a distributed loader (torch's, which pads the dataset with
    repeated samples) replaced by towers' (every sample once, the same order); with
    ``balance`` (a training loader), towers' batch sampler, which cuts each global batch in the
    ranks' balanced shares."""
    sampler = getattr(dataloader, "sampler", None)
    if isinstance(dataloader, DataLoader) and type(sampler) is torch_distributed.DistributedSampler:
        if balance is not False and _balanceable(dataloader, balance, sampler):
            assert dataloader.batch_size is not None
            batches = ddp.DistributedBatchSampler(
                sampler.dataset,
                dataloader.batch_size,
                shuffle=sampler.shuffle,
                seed=sampler.seed,
                drop_last=dataloader.drop_last,
                balance=balance,
            )
            return rebuilt(dataloader, batches)
        ours = ddp.DistributedSampler(
            sampler.dataset,
            sampler.num_replicas,
            sampler.rank,
            shuffle=sampler.shuffle,
            seed=sampler.seed,
            drop_last=sampler.drop_last,
            batch_size=dataloader.batch_size,
            batch_drop_last=dataloader.drop_last,
        )
        return _update_dataloader(dataloader, ours)
    return dataloader


def _balanceable(loader: DataLoader, balance: bool | None, sampler: Any) -> bool:
    """Whether a training loader can take the balanced batch sampler; where ``balance`` is
    ``None`` and a custom ``collate_fn`` could make the split change the result, rank 0 says
    so in one line."""
    if type(loader) is not DataLoader or loader.batch_size is None:
        return False  # a loader of another class, or batches of its own: as it is
    because = None if loader.collate_fn is default_collate else COLLATE_FN
    world, rank = sampler.num_replicas, sampler.rank
    return choose_balance(balance, None, world, because, "TowersStrategy", rank)


def _float_mean(tensor: Any, reduce_op: Any) -> Any:
    """A mean of integers is taken in float64: the ranks' sample counts differ by one under
    towers' sampler, and Lightning's mean of its logged metrics' batch sizes (501 and 500)
    would otherwise truncate to 500."""
    mean = isinstance(reduce_op, str) and reduce_op.lower() in ("mean", "avg")
    if isinstance(tensor, Tensor) and mean and not tensor.is_floating_point():
        return tensor.double()
    return tensor


class _Options:
    """towers' options of a strategy, and the wrapper they make."""

    def __init__(
        self, mode: str, compress: str | None, outer_optimizer: Any, transport: str | None
    ):
        self.mode, self.compress, self.outer_optimizer = mode, compress, outer_optimizer
        # a misspelt name is refused here, with the valid ones listed
        self.transport = None if transport is None else Transport.parse(transport)

    def wrap(self, module: Any) -> ddp.DistributedDataParallel:
        wrapped = ddp.DistributedDataParallel(
            module, compress=self.compress, mode=self.mode, outer_optimizer=self.outer_optimizer
        )
        # Accumulating (accumulate_grad_batches, a GradientAccumulationScheduler, a Fabric
        # loop's no_backward_sync), each micro-batch's mean loss is divided by their number:
        # one device weighs them alike, a short last one too. Lightning's loaders end the
        # ranks' batches together (towers' sampler), and a step that does not accumulate costs
        # nothing more.
        wrapped.weigh_micro_batches()
        return wrapped


class TowersStrategy(DDPStrategy):
    """Lightning's ``DDPStrategy`` with towers' sample-weighted step and unpadded sampler.

    Args:
        mode: ``"sync"`` (default), or ``"diloco:H"`` / ``"sparseloco:H"``: each rank's
            optimizer steps it alone, and every H steps the ranks take an outer step (and a
            last one at the end of ``fit``).
        compress: a compression by name, as ``towers.train``'s (``"bf16"``, ``"int8"``,
            ``"powersgd:R"``, ...).
        outer_optimizer: DiLoCo's outer optimizer, ``params -> Optimizer``.
        transport: how the sums travel, as ``towers.init``'s (``"auto"``: shared memory on
            one host; ``"gloo"``, ``"nccl"``, ``"shm"``); by default ``TOWERS_TRANSPORT``'s.
        balance: ``False`` (default): every rank takes the loader's batch size, and runs
            repeat bit for bit; ``None``: the training loader's global batches are cut in
            shares that follow the ranks' speeds wherever that keeps the result exact (one
            line says why not where it does not), ``True``: even then. A balanced run equals
            one device's to float tolerance, not bit for bit: the shares follow timings.
        **kwargs: ``DDPStrategy``'s (``start_method``, ``timeout``, ``process_group_backend``,
            the cluster environment, ...).
    """

    strategy_name = NAME

    def __init__(
        self,
        *,
        mode: str = "sync",
        compress: str | None = None,
        outer_optimizer: Any = None,
        transport: str | None = None,
        balance: bool | None = False,
        **kwargs: Any,
    ):
        check_balance(balance)
        super().__init__(**kwargs)
        self._towers = _Options(mode, compress, outer_optimizer, transport)
        self._balance = balance

    def _configure_launcher(self) -> None:
        _refuse_options(self, self._layer_sync)
        super()._configure_launcher()

    def setup_distributed(self) -> None:
        self.set_world_ranks()
        _join(self, self._timeout, self._towers.transport)

    def _setup_model(self, model: Any) -> Any:
        return self._towers.wrap(model)

    def configure_ddp(self) -> None:
        self.model = self._setup_model(self.model)

    @contextlib.contextmanager
    def block_backward_sync(self) -> Generator[None, None, None]:
        """Gradient accumulation: backward calls stay on this rank until the last."""
        if isinstance(self.model, ddp.DistributedDataParallel):
            with self.model.no_sync():
                yield None
        else:
            yield None

    def process_dataloader(self, dataloader: object) -> object:
        module = self.lightning_module
        training = module is not None and module.trainer.training
        return _towers_sampler(dataloader, self._balance if training else False)

    def reduce(self, tensor: Any, group: Any | None = None, reduce_op: Any | None = "mean") -> Any:
        return super().reduce(_float_mean(tensor, reduce_op), group, reduce_op)

    def barrier(self, *args: Any, **kwargs: Any) -> None:
        join_all()  # a rank out of batches first takes empty steps beside the others'
        super().barrier(*args, **kwargs)

    def save_checkpoint(
        self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any = None
    ) -> None:
        """DiLoCo: every rank's own state and the outer step's go into the checkpoint (under
        ``towers``, a collective: Lightning saves on every rank, rank 0 writes), and its
        ``state_dict`` holds the outer parameters, what the ranks share."""
        if isinstance(self.model, ddp.DistributedDataParallel) and keeps_replicas(self.model):
            towers_state = run_state(self.model, self._replica(), save=None)
            checkpoint = {**checkpoint, "towers": towers_state, "state_dict": towers_state["model"]}
        super().save_checkpoint(checkpoint, filepath, storage_options)

    def load_optimizer_state_dict(self, checkpoint: Any) -> None:
        super().load_optimizer_state_dict(checkpoint)
        saved = checkpoint.get("towers")
        if saved is not None and isinstance(self.model, ddp.DistributedDataParallel):
            run_state(self.model, self._replica(), save=saved)  # each rank's own state again

    def _replica(self) -> Replica:
        """The wrapped module with the fit's (first) optimizer and schedule."""
        assert isinstance(self.model, ddp.DistributedDataParallel)
        optimizer = self.optimizers[0] if self.optimizers else None
        configs = (
            self.lightning_module.trainer.lr_scheduler_configs if self.lightning_module else []
        )
        return Replica(self.model.module, optimizer, configs[0].scheduler if configs else None)

    def teardown(self) -> None:
        if isinstance(self.model, ddp.DistributedDataParallel):
            self.model.finish()  # DiLoCo's last exchange; else ranks out of batches join
            self.model.remove_hooks()
            self.model = self.lightning_module
        super().teardown()

    @classmethod
    def register_strategies(cls, strategy_registry: Any) -> None:
        strategy_registry.register(cls.strategy_name, cls, description=DESCRIPTION)


def _replica_in(state: dict[str, Any], strategy: TowersFabricStrategy) -> Replica:
    """The wrapped module with the optimizer among a Fabric checkpoint's objects (no schedule:
    a Fabric loop keeps its own)."""
    assert strategy._wrapped is not None
    optimizer = next((v for v in state.values() if isinstance(v, torch.optim.Optimizer)), None)
    return Replica(strategy._wrapped.module, optimizer)


class _NoSync(_BackwardSyncControl):
    """``fabric.no_backward_sync(model)``: towers' wrapper keeps backward calls local."""

    def no_backward_sync(self, module: Any, enabled: bool) -> contextlib.AbstractContextManager:
        if not enabled:
            return contextlib.nullcontext()
        if not isinstance(module, ddp.DistributedDataParallel):
            raise TypeError(
                "fabric.no_backward_sync needs the model fabric.setup returned (wrapped by "
                f"towers), got {type(module).__name__}"
            )
        return module.no_sync()


# why Fabric's strategy takes no balance=, and how a Fabric loop balances its split
FABRIC_BALANCE = (
    "TowersFabricStrategy cannot tell a training loader from one a loop evaluates on, and a "
    "balanced split would leave a mean over the ranks' means wrong: give the training loader "
    "towers.ddp.DistributedBatchSampler(dataset, batch_size, shuffle=True, balance={balance}) "
    "as its batch_sampler, set it up with fabric.setup_dataloaders(loader, "
    "use_distributed_sampler=False), and call its set_epoch(epoch) (docs/lightning.md)"
)


class TowersFabricStrategy(FabricDDPStrategy):
    """``Fabric(strategy="towers")``: Fabric's ``DDPStrategy`` with towers' step and sampler,
    as :class:`TowersStrategy` is the Trainer's; ``mode``, ``compress``, ``outer_optimizer``,
    ``transport`` and Fabric's own arguments.

    In DiLoCo's modes ``fabric.barrier()`` and ``fabric.save()`` take the outer step of the
    steps since the last one first: end the loop with either, and every rank holds the outer
    parameters (the saved ones too). A balanced split comes from the training loader's sampler
    (:data:`FABRIC_BALANCE`).
    """

    def __init__(
        self,
        *,
        mode: str = "sync",
        compress: str | None = None,
        outer_optimizer: Any = None,
        transport: str | None = None,
        balance: bool | None = False,
        **kwargs: Any,
    ):
        check_balance(balance)
        if balance is not False:
            raise ValueError(f"balance={balance}: {FABRIC_BALANCE.format(balance=balance)}")
        super().__init__(**kwargs)
        self._towers = _Options(mode, compress, outer_optimizer, transport)
        self._backward_sync_control = _NoSync()
        self._wrapped: ddp.DistributedDataParallel | None = None

    def _configure_launcher(self) -> None:
        _refuse_options(self, None)
        super()._configure_launcher()

    def _setup_distributed(self) -> None:
        self._set_world_ranks()
        _join(self, self._timeout, self._towers.transport)

    def setup_module(self, module: Any) -> Any:
        self._wrapped = self._towers.wrap(module)
        return self._wrapped

    def process_dataloader(self, dataloader: DataLoader) -> DataLoader:
        return _towers_sampler(dataloader)  # type: ignore[return-value]

    def all_reduce(
        self, tensor: Any, group: Any | None = None, reduce_op: Any | None = "mean"
    ) -> Any:
        return super().all_reduce(_float_mean(tensor, reduce_op), group, reduce_op)

    def _outer_step(self) -> None:
        """DiLoCo: the outer step of the steps since the last one, on every rank."""
        if self._wrapped is not None and keeps_replicas(self._wrapped):
            self._wrapped.finish()

    def barrier(self, *args: Any, **kwargs: Any) -> None:
        self._outer_step()
        join_all()  # a rank out of batches first takes empty steps beside the others'
        super().barrier(*args, **kwargs)

    def save_checkpoint(
        self, path: Any, state: dict[str, Any], storage_options: Any = None, filter: Any = None
    ) -> None:
        """DiLoCo: the outer step first (every rank saves, rank 0 writes: the file holds the
        outer parameters), and every rank's own state beside the loop's, under ``towers``."""
        self._outer_step()
        if self._wrapped is not None and keeps_replicas(self._wrapped):
            state = {**state, "towers": run_state(self._wrapped, _replica_in(state, self), None)}
        super().save_checkpoint(path, state, storage_options=storage_options, filter=filter)

    def load_checkpoint(
        self, path: Any, state: Any = None, strict: bool = True, weights_only: bool | None = None
    ) -> dict[str, Any]:
        """:meth:`save_checkpoint`'s ``towers`` part restored on every rank, not handed back."""
        remainder = super().load_checkpoint(path, state, strict=strict, weights_only=weights_only)
        saved = remainder.pop("towers", None)
        if saved is not None and self._wrapped is not None and isinstance(state, dict):
            run_state(self._wrapped, _replica_in(state, self), saved)  # each rank's own again
        return remainder

    def get_module_state_dict(self, module: Any) -> dict[str, Any]:
        if isinstance(module, ddp.DistributedDataParallel):
            module = module.module
        return super().get_module_state_dict(module)

    def load_module_state_dict(
        self, module: Any, state_dict: dict[str, Any], strict: bool = True
    ) -> None:
        if isinstance(module, ddp.DistributedDataParallel):
            module = module.module
        super().load_module_state_dict(module=module, state_dict=state_dict, strict=strict)

    @classmethod
    def register_strategies(cls, strategy_registry: Any) -> None:
        strategy_registry.register(NAME, cls, description=DESCRIPTION)


if NAME not in StrategyRegistry:
    TowersStrategy.register_strategies(StrategyRegistry)
if NAME not in FABRIC_STRATEGIES:
    TowersFabricStrategy.register_strategies(FABRIC_STRATEGIES)
