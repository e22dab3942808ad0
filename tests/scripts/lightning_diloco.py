"""``Trainer(strategy=TowersStrategy(mode="diloco:4"), devices=2)``: each rank's SGD steps it
alone on its batches of lightning_fit.py's data, and every 4 steps the ranks take DiLoCo's
outer step (one epoch of 32 batches, and a last exchange at the end of fit). Rank 0 saves the
parameters to OUT.

    python lightning_diloco.py OUT
"""

import sys
from pathlib import Path

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader

from towers.lightning import TowersStrategy

sys.path.insert(0, str(Path(__file__).resolve().parent))
import lightning_fit
from lightning_fit import dataset

LR, MOMENTUM, EVERY = 0.1, 0.9, 4


class Net(lightning_fit.Net):
    """lightning_fit.py's model with plain SGD and momentum: no schedule."""

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=LR, momentum=MOMENTUM)


if __name__ == "__main__":
    model = Net()
    trainer = pl.Trainer(
        strategy=TowersStrategy(mode=f"diloco:{EVERY}"),
        accelerator="cpu",
        devices=2,
        max_epochs=1,
        enable_progress_bar=False,
        logger=False,
        enable_checkpointing=False,
        enable_model_summary=False,
    )
    trainer.fit(model, DataLoader(dataset(), batch_size=16))
    if trainer.global_rank == 0:
        torch.save(model.net.state_dict(), sys.argv[1])
