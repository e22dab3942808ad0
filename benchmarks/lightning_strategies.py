"""Lightning's Trainer on one host: ``strategy="towers"`` against Lightning's ``ddp`` and
``ddp_spawn``, side by side.

The zoo MLP (784-1024-1024-10, 1.86 M parameters) learns the digits upscaled to 28x28 for
``--epochs`` epochs on ``--devices`` CPU processes, ``--batch`` samples per rank. Each arm is
one fresh process of this script with ``--arm S`` (Lightning's launcher starts the other ranks
from it); the arms run in rotation ``--repeats`` times. Printed per arm: the median
milliseconds of a training step (rank 0's clock from a batch's start to its end, the steps after
the first five of each fit, median over them and then over the rounds), the median seconds of
``trainer.fit`` (start-up excluded) and of the whole process, each with its ratio to towers',
the last epoch's logged loss, and the load average.

Run it from the repository root::

    python benchmarks/lightning_strategies.py --repeats 3
"""

from __future__ import annotations

import argparse
import json
import math
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
WARM = 5  # steps of each fit not timed


class StepClock(pl.Callback):
    """Each training step's seconds, from its batch's start to its end, written by rank 0 to
    ``out`` at the end of training (``ddp_spawn`` trains in processes of its own)."""

    def __init__(self, out: str) -> None:
        self.out = out
        self.seconds: list[float] = []
        self.began = 0.0

    def on_train_batch_start(self, trainer, module, batch, index):
        self.began = time.perf_counter()

    def on_train_batch_end(self, trainer, module, outputs, batch, index):
        self.seconds.append(time.perf_counter() - self.began)

    def on_train_end(self, trainer, module):
        if trainer.global_rank == 0:
            Path(self.out).write_text(json.dumps(self.seconds))


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
    clock = StepClock(out + ".steps")
    trainer = pl.Trainer(
        callbacks=[clock],
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
    aborted: dict[str, list[str]] = {a: [] for a in ARMS}
    loads = []
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.repeats):
            for name in ARMS:
                out = os.path.join(tmp, f"{name}-{r}.json")
                flags = ["--devices", str(args.devices), "--batch", str(args.batch)]
                flags += ["--epochs", str(args.epochs), "--arm", name, "--out", out]
                began = time.perf_counter()
                done = subprocess.run([sys.executable, __file__, *flags],
                                      stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                      text=True)  # fmt: skip
                seconds = time.perf_counter() - began
                steps = json.loads(Path(out + ".steps").read_text())  # rank 0, training done
                result = {"step": statistics.median(steps[WARM:]) * 1e3}
                if done.returncode == 0:
                    result |= json.loads(Path(out).read_text()) | {"process": seconds}
                else:  # a rank died after training (Lightning's ddp_spawn, at its exit)
                    aborted[name].append(done.stderr.strip().splitlines()[-1])
                runs[name].append(result)
                loads.append(os.getloadavg()[0])

    def middle(values: list[float]) -> float:
        return statistics.median(values) if values else math.nan

    keys = ("step", "fit", "process", "loss")
    median = {a: {k: middle([r[k] for r in runs[a] if k in r]) for k in keys} for a in ARMS}
    print(f"{args.devices} CPU processes, {args.batch} per rank, {args.epochs} epochs, "
          f"{args.repeats} rounds; load {min(loads):.1f}-{max(loads):.1f}")  # fmt: skip
    for a in ARMS:
        if aborted[a]:
            print(f"{a}: {len(aborted[a])} of {args.repeats} runs failed after training "
                  f"({aborted[a][0]}); their fit and process times are left out")  # fmt: skip
    print(f"{'strategy':<10} {'step ms':>8} {'x towers':>9} {'fit s':>7} {'x towers':>9} "
          f"{'process s':>10} {'x towers':>9} {'loss':>8}")  # fmt: skip
    for a in ARMS:
        m, t = median[a], median["towers"]
        print(f"{a:<10} {m['step']:8.2f} {m['step'] / t['step']:9.2f} {m['fit']:7.2f} "
              f"{m['fit'] / t['fit']:9.2f} {m['process']:10.2f} "
              f"{m['process'] / t['process']:9.2f} {m['loss']:8.4f}")  # fmt: skip


if __name__ == "__main__":
    main()
