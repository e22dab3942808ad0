"""A LightningModule on towers: the change from Lightning's DDP is the strategy's name.

```diff
 import lightning.pytorch as pl
+import towers.lightning  # registers strategy="towers"

-trainer = pl.Trainer(strategy="ddp", accelerator="cpu", devices=2)
+trainer = pl.Trainer(strategy="towers", accelerator="cpu", devices=2)
```

It fits a small CNN on scikit-learn's handwritten digits (1797 real 8x8 images, shipped with
scikit-learn: nothing is downloaded) on two CPU processes, then validates on the held-out
quarter. Lightning starts the second process itself (it runs this file once more). Every sample
of an epoch is trained once and weighted as one device weighs it, so the fit is the one a single
device makes on the same global batches of 2 x 32.

Run it::

    python examples/lightning_digits.py                     # towers, 2 processes
    python examples/lightning_digits.py --strategy ddp      # Lightning's own DDP, to compare
    python examples/lightning_digits.py --balance           # a slower process gets less

It exits non-zero if the validation accuracy is below ``--min-accuracy``.
"""

from __future__ import annotations

import argparse
import sys

import lightning.pytorch as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import towers.lightning  # noqa: F401  (registers strategy="towers")
from towers.lightning import TowersStrategy
from towers.tools.zoo import CNN, digits_data


def split_digits() -> tuple[TensorDataset, TensorDataset]:
    """The digits in a fixed shuffled order: three quarters to train on, a quarter held out."""
    x, y = digits_data()
    order = torch.randperm(len(y), generator=torch.Generator().manual_seed(0))
    cut = len(y) * 3 // 4
    train, held = order[:cut], order[cut:]
    return TensorDataset(x[train], y[train]), TensorDataset(x[held], y[held])


class Digits(pl.LightningModule):
    def __init__(self, lr: float):
        super().__init__()
        torch.manual_seed(0)
        self.net, self.lr = CNN(), lr

    def training_step(self, batch, index):
        x, y = batch
        loss = nn.functional.cross_entropy(self.net(x), y)
        self.log("train_loss", loss, on_step=False, on_epoch=True, sync_dist=True)
        return loss

    def validation_step(self, batch, index):
        x, y = batch
        correct = (self.net(x).argmax(1) == y).float().mean()
        self.log("val_accuracy", correct, sync_dist=True)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--strategy", default="towers", help="towers (default) or ddp")
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--epochs", type=int, default=8)
    parser.add_argument("--batch-size", type=int, default=32, help="per process")
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--balance", action="store_true", help="towers: balance the split")
    parser.add_argument("--min-accuracy", type=float, default=0.9)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    strategy = args.strategy
    if strategy == "towers" and args.balance:
        strategy = TowersStrategy(balance=None)
    train, held = split_digits()
    trainer = pl.Trainer(
        strategy=strategy,
        accelerator="cpu",
        devices=args.devices,
        max_epochs=args.epochs,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        logger=False,
    )
    model = Digits(args.lr)
    trainer.fit(model, DataLoader(train, batch_size=args.batch_size, shuffle=True))
    loss = float(trainer.callback_metrics["train_loss"])  # the last epoch's, over all samples
    (scores,) = trainer.validate(model, DataLoader(held, batch_size=64), verbose=False)
    accuracy = scores["val_accuracy"]
    if trainer.global_rank == 0:
        print(
            f"{args.strategy} on {args.devices} processes: last epoch's training loss "
            f"{loss:.4f}, held-out accuracy {accuracy:.3f} over {len(held)} digits"
        )
    return 0 if accuracy >= args.min_accuracy else 1


if __name__ == "__main__":
    sys.exit(main())
