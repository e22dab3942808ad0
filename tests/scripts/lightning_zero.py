"""lightning_fit.py's model under ``Trainer(strategy="towers", devices=2)`` with towers.ddp's
``ZeroRedundancyOptimizer`` (AdamW with weight decay, a StepLR schedule, gradients clipped to
the norm 0.5): a fit of one epoch that ``ModelCheckpoint`` saves, then a fit of two resumed
from its ``last.ckpt``. Rank 0 saves the parameters to ``OUT/zero.pt``; ``OUT/last.ckpt``
then holds the second epoch's whole optimizer state.

    python lightning_zero.py OUT
"""

import sys
from pathlib import Path

import lightning.pytorch as pl
import torch

import towers.lightning  # noqa: F401  (registers "towers")
from towers.ddp import ZeroRedundancyOptimizer

sys.path.insert(0, str(Path(__file__).resolve().parent))
import lightning_fit
from lightning_fit import CLIP, EPOCHS, checkpointed_fit

LR, DECAY = 0.01, 0.1


def adamw_and_schedule(params, zero: bool = False):
    if zero:
        optimizer = ZeroRedundancyOptimizer(
            params, optimizer_class=torch.optim.AdamW, lr=LR, weight_decay=DECAY
        )
    else:
        optimizer = torch.optim.AdamW(params, lr=LR, weight_decay=DECAY)
    return optimizer, torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)


class Net(lightning_fit.Net):
    def configure_optimizers(self):
        optimizer, schedule = adamw_and_schedule(self.parameters(), zero=True)
        return {"optimizer": optimizer, "lr_scheduler": schedule}


def fit(out: Path, epochs: int, resume: Path | None = None) -> tuple[pl.Trainer, Net]:
    model = Net()
    return checkpointed_fit(model, "towers", out, epochs, resume, gradient_clip_val=CLIP), model


if __name__ == "__main__":
    out = Path(sys.argv[1])
    fit(out, 1)
    trainer, model = fit(out, EPOCHS, resume=out / "last.ckpt")
    if trainer.global_rank == 0:
        torch.save(model.net.state_dict(), out / "zero.pt")
