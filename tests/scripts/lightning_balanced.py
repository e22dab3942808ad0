"""A LightningModule fitted by ``Trainer(strategy=TowersStrategy(balance=None), devices=2)``
while rank 1's training step does more work (a slower device). Each rank saves the dataset
indices of its batches and its final parameters to ``OUT/rank-R.pt``. Lightning's launcher
runs this file once per rank.

    python lightning_balanced.py OUT
"""

import sys
from pathlib import Path

import lightning.pytorch as pl
import torch
import torch.nn as nn
from torch.utils.data import DataLoader, TensorDataset

from towers.lightning import TowersStrategy

SAMPLES, BATCH, LR, EPOCHS = 2903, 48, 0.05, 2


def dataset() -> TensorDataset:
    g = torch.Generator().manual_seed(5)
    x = torch.randn(SAMPLES, 6, generator=g)
    y = x[:, :2] * 0.5 - x[:, 2:4] + 0.1 * torch.randn(SAMPLES, 2, generator=g)
    return TensorDataset(x, y, torch.arange(SAMPLES))


def make_net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 2))


class Net(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = make_net()
        self.seen: list[list[int]] = []

    def training_step(self, batch, index):
        x, y, samples = batch
        if self.global_rank == 1:
            end = torch.randn(192, 192)
            for _ in range(6):
                end = end @ end.tanh()
        self.seen.append(samples.tolist())
        return nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=LR)


if __name__ == "__main__":
    torch.set_num_threads(1)
    out = Path(sys.argv[1])
    model = Net()
    trainer = pl.Trainer(
        strategy=TowersStrategy(balance=None),
        accelerator="cpu",
        devices=2,
        max_epochs=EPOCHS,
        enable_progress_bar=False,
        logger=False,
        enable_checkpointing=False,
        enable_model_summary=False,
    )
    trainer.fit(model, DataLoader(dataset(), batch_size=BATCH, shuffle=True))
    state = {k: v.clone() for k, v in model.net.state_dict().items()}
    torch.save({"batches": model.seen, "model": state}, out / f"rank-{trainer.global_rank}.pt")
