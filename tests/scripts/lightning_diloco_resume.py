"""``Trainer(strategy=TowersStrategy(mode="diloco:5"), devices=2)`` on lightning_diloco.py's
model: a fit of two epochs, and the same fit stopped by ``ModelCheckpoint`` after one epoch and
resumed from its ``last.ckpt`` (an epoch's 32 steps end between outer steps, so the checkpoint
holds inner steps not yet exchanged). Rank 0 saves both fits' parameters to ``OUT/fits.pt``.

    python lightning_diloco_resume.py OUT
"""

import sys
from pathlib import Path

import lightning.pytorch as pl
import torch

from towers.lightning import TowersStrategy

sys.path.insert(0, str(Path(__file__).resolve().parent))
from lightning_diloco import Net
from lightning_fit import checkpointed_fit

EVERY = 5


def fit(out: Path, epochs: int, resume: Path | None = None) -> tuple[pl.Trainer, Net]:
    model = Net()
    strategy = TowersStrategy(mode=f"diloco:{EVERY}")
    return checkpointed_fit(model, strategy, out, epochs, resume), model


if __name__ == "__main__":
    out = Path(sys.argv[1])
    _, whole = fit(out / "whole", 2)
    fit(out / "stopped", 1)
    trainer, resumed = fit(out / "stopped", 2, resume=out / "stopped" / "last.ckpt")
    if trainer.global_rank == 0:
        fits = {"whole": whole.net.state_dict(), "resumed": resumed.net.state_dict()}
        torch.save(fits, out / "fits.pt")
