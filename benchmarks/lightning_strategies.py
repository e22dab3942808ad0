"""Lightning's Trainer on one host: ``strategy="towers"`` against Lightning's ``ddp`` and
``ddp_spawn``, side by side.

The zoo MLP (784-1024-1024-10, 1.86 M parameters) learns the digits upscaled to 28x28 for
``--epochs`` epochs on ``--devices`` CPU processes, ``--batch`` samples per rank. Each arm is
one fresh process of this script with ``--arm S`` (Lightning's launcher starts the other ranks
from it); the arms run in rotation ``--repeats`` times. Printed per arm: the median
seconds of ``trainer.fit`` (rank 0's clock, start-up excluded) and of the whole process, their
ratio to towers', the last epoch's logged loss, and the load average.

Run it from the repository root::

    python benchmarks/lightning_strategies.py --repeats 3
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader, TensorDataset

import towers.lightning  # noqa: F401  (registers "towers")
from towers.tools.zoo import cross_entropy, digits_flat, mlp

ARMS = ("towers", "ddp", "ddp_spawn")


class Model(pl.LightningModule):
    """The zoo MLP with SGD and momentum, its loss logged per epoch (a module-level class:
    ``ddp_spawn`` pickles it)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = mlp()

    def training_step(self, batch, index):
        loss = cross_entropy(self.net, batch)
        self.log("loss", loss, on_step=False, on_epoch=True, sync_dist=True)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)


def arm(strategy: str, devices: int, batch: int, epochs: int, out: str) -> None:
    """One fit (every rank runs this; Lightning's launcher starts them)."""
    torch.set_num_threads(1)
    x, y = digits_flat()
    trainer = pl.Trainer(
        strategy=strategy,
        accelerator="cpu",
        devices=devices,
        max_epochs=epochs,
        enable_progress_bar=False,
        logger=False,
        enable_checkpointing=False,
        enable_model_summary=False,
    )
    began = time.perf_counter()
    trainer.fit(Model(), DataLoader(TensorDataset(x, y), batch_size=batch, shuffle=True))
    seconds = time.perf_counter() - began
    if trainer.global_rank == 0:
        loss = float(trainer.callback_metrics["loss"])
        Path(out).write_text(json.dumps({"fit": seconds, "loss": loss}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--batch", type=int, default=64, help="per rank")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--arm", choices=ARMS, help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.arm is not None:
        arm(args.arm, args.devices, args.batch, args.epochs, args.out)
        return
    runs: dict[str, list[dict[str, float]]] = {a: [] for a in ARMS}
    loads = []
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.repeats):
            for name in ARMS:
                out = os.path.join(tmp, f"{name}-{r}.json")
                flags = ["--devices", str(args.devices), "--batch", str(args.batch)]
                flags += ["--epochs", str(args.epochs), "--arm", name, "--out", out]
                began = time.perf_counter()
                subprocess.run([sys.executable, __file__, *flags], check=True,
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
                result = json.loads(Path(out).read_text())
                result["process"] = time.perf_counter() - began
                runs[name].append(result)
                loads.append(os.getloadavg()[0])
    median = {a: {k: statistics.median(r[k] for r in runs[a]) for k in runs[a][0]} for a in ARMS}
    print(f"{args.devices} CPU processes, {args.batch} per rank, {args.epochs} epochs, "
          f"{args.repeats} rounds; load {min(loads):.1f}-{max(loads):.1f}")  # fmt: skip
    print(f"{'strategy':<10} {'fit s':>7} {'x towers':>9} {'process s':>10} {'x towers':>9} "
          f"{'loss':>8}")  # fmt: skip
    for a in ARMS:
        m, t = median[a], median["towers"]
        print(f"{a:<10} {m['fit']:7.2f} {m['fit'] / t['fit']:9.2f} {m['process']:10.2f} "
              f"{m['process'] / t['process']:9.2f} {m['loss']:8.4f}")  # fmt: skip


if __name__ == "__main__":
    main()
