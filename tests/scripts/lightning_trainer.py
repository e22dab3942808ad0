"""Lightning's Trainer under ``strategy="towers"`` on 2 devices, every case in one launch (each
launch starts an interpreter per rank): lightning_fit.py's run of 2 epochs, then
``trainer.validate``, ``trainer.test`` and ``trainer.predict``; the same run stopped after 1 by
``ModelCheckpoint`` and resumed from ``last.ckpt``; the same run stopped by ``EarlyStopping``
(after epoch 2 of 5); the same run with ``accumulate_grad_batches=2``; manual optimization;
and lightning_diloco.py's DiLoCo. Rank 0 saves each run's parameters to OUT/NAME.pt and the
logged metrics to OUT/metrics.pt; each rank its predictions to OUT/predict-RANK.pt.

    python lightning_trainer.py OUT
"""

import sys
from pathlib import Path

import lightning.pytorch as pl
import torch
import torch.nn as nn
from lightning.pytorch.callbacks import EarlyStopping, ModelCheckpoint
from torch.utils.data import DataLoader

from towers.lightning import TowersStrategy

sys.path.insert(0, str(Path(__file__).resolve().parent))
from lightning_diloco import EVERY
from lightning_diloco import Net as DiLoCoNet
from lightning_fit import CLIP, Net, dataset

OUT = Path(sys.argv[1])  # where rank 0 saves, and the checkpoints go


class Manual(Net):
    """The same training with manual optimization."""

    def __init__(self):
        super().__init__()
        self.automatic_optimization = False

    def training_step(self, batch, index):
        optimizer = self.optimizers()
        x, y = batch
        optimizer.zero_grad()
        self.manual_backward(nn.functional.mse_loss(self.net(x), y))
        self.clip_gradients(optimizer, gradient_clip_val=CLIP)
        optimizer.step()

    def on_train_epoch_end(self):
        self.lr_schedulers().step()


def fit(model, epochs, *, clip=True, checkpoints=None, resume=None, strategy="towers", **options):
    callbacks = options.pop("callbacks", [])
    if checkpoints is not None:
        callbacks.append(ModelCheckpoint(checkpoints, save_last=True))
    trainer = pl.Trainer(
        strategy=strategy,
        accelerator="cpu",
        devices=2,
        max_epochs=epochs,
        gradient_clip_val=CLIP if clip else None,
        callbacks=callbacks,
        enable_checkpointing=checkpoints is not None,
        enable_progress_bar=False,
        logger=False,
        enable_model_summary=False,
        **options,
    )
    trainer.fit(model, DataLoader(dataset(), batch_size=16), ckpt_path=resume)
    return trainer


if __name__ == "__main__":
    runs = {"whole": Net(), "resumed": Net(), "early": Net(), "accumulated": Net()}
    runs |= {"manual": Manual(), "diloco": DiLoCoNet()}
    trainer = fit(runs["whole"], 2)
    metrics = {k: float(v) for k, v in trainer.callback_metrics.items()}
    for check in (trainer.validate, trainer.test):  # every sample once, over the ranks
        (logged,) = check(runs["whole"], DataLoader(dataset(), batch_size=16), verbose=False)
        metrics.update(logged)
    predicted = trainer.predict(runs["whole"], DataLoader(dataset(), batch_size=16))
    torch.save(torch.cat(predicted), OUT / f"predict-{trainer.global_rank}.pt")
    # the loss never improves by 1000: stopped after the second epoch, where "whole" ended
    stop = EarlyStopping(monitor="loss", min_delta=1000.0, patience=0)
    metrics["early_epochs"] = fit(runs["early"], 5, callbacks=[stop]).current_epoch
    fit(runs["accumulated"], 2, accumulate_grad_batches=2)
    fit(runs["resumed"], 1, checkpoints=OUT / "ckpt")
    fit(runs["resumed"], 2, checkpoints=OUT / "ckpt", resume=str(OUT / "ckpt" / "last.ckpt"))
    fit(runs["manual"], 2, clip=False)
    diloco = TowersStrategy(mode=f"diloco:{EVERY}")
    trainer = fit(runs["diloco"], 1, clip=False, strategy=diloco)
    if trainer.global_rank == 0:
        for name, model in runs.items():
            torch.save(model.net.state_dict(), OUT / f"{name}.pt")
        torch.save(metrics, OUT / "metrics.pt")
