"""A LightningModule fitted by ``Trainer(strategy=TowersStrategy(balance=None), devices=2)``
while rank 1 is the slower: its training step does more work (a slower device), or, given a
cpu cgroup, it moves itself into it as training starts (and back as it ends, so that it saves
and exits at full speed) and both train a wider net, whose step the cap slows. Each rank saves
the dataset indices of its batches and its final parameters to ``OUT/rank-R.pt``; the run logs
its epoch loss to a CSV and a TensorBoard logger under ``OUT``, with the progress bar on.
Lightning's launcher runs this file once per rank.

    python lightning_balanced.py OUT [CGROUP]
"""

import os
import sys
from pathlib import Path

import lightning.pytorch as pl
import torch
import torch.nn as nn
from ddp_balanced import BATCH, EPOCHS  # the drop-in's balanced test: its data and net
from ddp_balanced import data as dataset
from ddp_balanced import make_model as make_net
from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger
from torch.utils.data import DataLoader

from towers.lightning import TowersStrategy

LR = 0.05


def make_wide_net() -> nn.Module:
    """A net whose step outlasts the cgroup's quota (1 ms every 10 ms), so that the cap, not
    the machine's other work, decides which rank is the slower."""
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(6, 512), nn.Tanh(), nn.Linear(512, 512), nn.Tanh(), nn.Linear(512, 2)
    )


def _cpu_cgroup() -> Path:
    """This process's cpu cgroup (v1) directory."""
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        if "cpu" in controllers.split(","):
            return Path("/sys/fs/cgroup/cpu") / path.lstrip("/")
    raise RuntimeError("no cpu cgroup")


class Net(pl.LightningModule):
    def __init__(self, cgroup: str | None):
        super().__init__()
        self.net, self.cgroup = make_net() if cgroup is None else make_wide_net(), cgroup
        self.seen: list[list[int]] = []

    def on_train_start(self):
        if self.cgroup is not None and self.global_rank == 1:
            self.home = _cpu_cgroup()
            Path(self.cgroup, "cgroup.procs").write_text(str(os.getpid()))

    def on_train_end(self):
        if self.cgroup is not None and self.global_rank == 1:
            Path(self.home, "cgroup.procs").write_text(str(os.getpid()))

    def training_step(self, batch, index):
        x, y, samples = batch
        if self.cgroup is None and self.global_rank == 1:
            end = torch.randn(192, 192)
            for _ in range(6):
                end = end @ end.tanh()
        self.seen.append(samples.tolist())
        loss = nn.functional.mse_loss(self.net(x), y)
        self.log("train_loss", loss, on_step=False, on_epoch=True, sync_dist=True)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=LR)


if __name__ == "__main__":
    torch.set_num_threads(1)
    out = Path(sys.argv[1])
    model = Net(sys.argv[2] if len(sys.argv) > 2 else None)
    trainer = pl.Trainer(
        strategy=TowersStrategy(balance=None),
        accelerator="cpu",
        devices=2,
        max_epochs=EPOCHS,
        logger=[CSVLogger(out, name="csv"), TensorBoardLogger(out, name="tb")],
        enable_checkpointing=False,
        enable_model_summary=False,
    )
    trainer.fit(model, DataLoader(dataset(), batch_size=BATCH, shuffle=True))
    state = {k: v.clone() for k, v in model.net.state_dict().items()}
    torch.save({"batches": model.seen, "model": state}, out / f"rank-{trainer.global_rank}.pt")
