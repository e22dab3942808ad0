"""A LightningModule fitted by ``Trainer(strategy=STRATEGY, devices=N)`` on 1001 samples (an
uneven last batch), with gradient clipping and a learning-rate schedule, then validated on
the same samples; rank 0 saves the parameters and the logged metrics to OUT. Lightning's
launcher runs this file once per rank.

    python lightning_fit.py STRATEGY DEVICES BATCH_PER_RANK OUT [NUM_NODES]

With ``NUM_NODES``, the ranks are started by ``torchrun`` on each node instead.
"""

import sys

import lightning.pytorch as pl
import torch
import torch.nn as nn
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader, TensorDataset

import towers.api.ddp
import towers.lightning  # registers strategy="towers"

SAMPLES, EPOCHS, LR, CLIP = 1001, 2, 0.1, 0.5


def dataset() -> TensorDataset:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(SAMPLES, 6, generator=g)
    return TensorDataset(x, x[:, :1] * 2 + 0.1 * torch.randn(SAMPLES, 1, generator=g))


def make_net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 1))


def optimizer_and_schedule(params):
    optimizer = torch.optim.SGD(params, lr=LR, momentum=0.9)
    return optimizer, torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)


class Net(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = make_net()

    def training_step(self, batch, index):
        x, y = batch
        if index == 0 and torch.distributed.is_initialized():
            # the module's own collectives work beside the strategy's
            ones = torch.ones(1)
            torch.distributed.all_reduce(ones)
            assert ones.item() == self.trainer.world_size, ones
        loss = nn.functional.mse_loss(self.net(x), y)
        self.log("loss", loss, on_step=False, on_epoch=True, sync_dist=True)
        return loss

    def validation_step(self, batch, index):
        x, y = batch
        self.log("val_loss", nn.functional.mse_loss(self.net(x), y), sync_dist=True)

    def test_step(self, batch, index):
        x, y = batch
        self.log("test_loss", nn.functional.mse_loss(self.net(x), y), sync_dist=True)

    def predict_step(self, batch, index):
        x, _ = batch
        return torch.cat([x, self.net(x)], 1)  # each prediction beside its input

    def configure_optimizers(self):
        optimizer, schedule = optimizer_and_schedule(self.parameters())
        return {"optimizer": optimizer, "lr_scheduler": schedule}


def checkpointed_fit(
    model: pl.LightningModule, strategy, out, epochs: int, resume=None, **options
) -> pl.Trainer:
    """``model`` fitted on 2 CPU devices for ``epochs`` epochs (batches of 16, shuffled) under
    ``strategy``, ``ModelCheckpoint`` saving ``last.ckpt`` in ``out``, resumed from ``resume``
    if given; ``options``: more of the Trainer's."""
    trainer = pl.Trainer(
        strategy=strategy,
        accelerator="cpu",
        devices=2,
        max_epochs=epochs,
        callbacks=[ModelCheckpoint(dirpath=out, save_last=True)],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        **options,
    )
    trainer.fit(model, DataLoader(dataset(), batch_size=16, shuffle=True), ckpt_path=resume)
    return trainer


if __name__ == "__main__":
    strategy, devices, batch, out = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    nodes = int(sys.argv[5]) if len(sys.argv) > 5 else 1
    model = Net()
    trainer = pl.Trainer(
        strategy=strategy,
        accelerator="cpu",
        devices=devices,
        num_nodes=nodes,
        max_epochs=EPOCHS,
        gradient_clip_val=CLIP,
        enable_progress_bar=False,
        logger=False,
        enable_checkpointing=False,
        enable_model_summary=False,
    )
    trainer.fit(model, DataLoader(dataset(), batch_size=batch))
    metrics = {k: float(v) for k, v in trainer.callback_metrics.items()}
    # every sample once, 1001 over the ranks (torch's sampler would repeat one)
    (validated,) = trainer.validate(model, DataLoader(dataset(), batch_size=batch), verbose=False)
    if trainer.global_rank == 0:
        metrics["val_loss"] = validated["val_loss"]
        comm = type(towers.api.ddp.context().comm).__name__ if strategy == "towers" else None
        torch.save({"model": model.net.state_dict(), "metrics": metrics, "comm": comm}, out)
