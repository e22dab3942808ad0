"""DiLoCo against sync at the same number of samples: held-out accuracy and loss over training.

Two problems from the model zoo, each split once into 1497 training and 300 held-out images:

- ``cnn``: the digits CNN (``zoo.CNN`` on the 8x8 digits), held-out accuracy;
- ``mlp``: the 784-1024-1024-10 MLP (``zoo.mlp`` on ``zoo.digits_flat``), held-out loss.

Every arm trains the same global batches (``batch_size`` samples each, split over ``workers``)
with the same inner optimizer (AdamW); ``sync`` takes one averaged step per batch, the DiLoCo
arms an inner step per worker per batch and an outer step every H batches (Nesterov SGD, lr 0.7,
momentum 0.9; an arm ``diloco:8@1.0`` sets another outer lr, ``diloco:8@1.0/0`` a plain SGD
step). The held-out metrics are evaluated every ``--eval-every`` global batches (DiLoCo: of the
outer parameters). Prints a table, writes the curves as JSON and a PNG::

    python benchmarks/diloco_quality.py --problem cnn --modes sync,diloco:8,diloco:8@1.0 \
        --seeds 0,1,2
    python benchmarks/diloco_quality.py --problem mlp --steps 400
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

import towers
from towers.tools import zoo
from towers.tools.plots import save_loss_panels

HELD_OUT = 300


def split_data(problem: str) -> tuple[Any, Any]:
    """(training, held-out) tensors of ``problem``, cut by one fixed permutation."""
    x, y = zoo.digits_data() if problem == "cnn" else zoo.digits_flat()
    order = torch.randperm(len(x), generator=torch.Generator().manual_seed(0))
    test, train = order[:HELD_OUT], order[HELD_OUT:]
    return (x[train], y[train]), (x[test], y[test])


def build(problem: str) -> nn.Module:
    torch.manual_seed(0)
    return zoo.CNN() if problem == "cnn" else zoo.mlp()


def metrics(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> dict[str, Any]:
    """Held-out loss and accuracy (means over the batch)."""
    x, y = batch
    logits = model(x)
    accuracy = (logits.argmax(dim=1) == y).float().mean()
    return {"loss": nn.functional.cross_entropy(logits, y), "accuracy": accuracy}


def run_arm(problem: str, arm: str, seed: int, args: argparse.Namespace) -> dict[str, Any]:
    """``arm``: a mode, or ``MODE@LR[/MOMENTUM]`` for a DiLoCo mode with another outer step
    (Nesterov SGD; momentum 0.9 unless given, plain SGD at momentum 0)."""
    train, held_out = split_data(problem)
    mode, _, outer_spec = arm.partition("@")
    outer = None
    if outer_spec:
        lr, _, momentum = outer_spec.partition("/")
        m = float(momentum or 0.9)
        outer = functools.partial(torch.optim.SGD, lr=float(lr), momentum=m, nesterov=m > 0)
    began = time.perf_counter()
    result = towers.train(
        build(problem), zoo.cross_entropy, train, batch_size=args.batch_size, steps=args.steps,
        workers=args.workers, mode=mode, seed=seed, progress=False,
        optimizer=functools.partial(torch.optim.AdamW, lr=args.lr),
        outer_optimizer=outer, eval_data=held_out, eval_fn=metrics, eval_every=args.eval_every,
    )  # fmt: skip
    return {
        "mode": arm,
        "seed": seed,
        "evals": [(done, values) for done, values in result.evals],
        "losses": result.losses,
        "seconds": result.seconds,
        "wall": time.perf_counter() - began,
    }


def _spread(values: list[float]) -> str:
    return f"{statistics.fmean(values):.4f} ({min(values):.4f}..{max(values):.4f})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--problem", choices=["cnn", "mlp"], default="cnn")
    parser.add_argument("--modes", default="sync,diloco:8,diloco:8:overlap")
    parser.add_argument("-n", "--workers", type=int, default=4)
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--eval-every", type=int, default=50)
    parser.add_argument("--seeds", default="0", help="batch orders to average over, e.g. 0,1,2")
    parser.add_argument("--out", default="diloco-quality")
    args = parser.parse_args()
    seeds = [int(x) for x in args.seeds.split(",")]
    modes = [m.strip() for m in args.modes.split(",")]
    runs = [run_arm(args.problem, m, seed, args) for seed in seeds for m in modes]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{args.problem}.json").write_text(json.dumps({"args": vars(args), "runs": runs}))
    samples = args.batch_size * args.steps
    print(f"{args.problem}: {args.workers} workers, {args.steps} global batches of "
          f"{args.batch_size} ({samples} samples), AdamW lr {args.lr}, batch orders {seeds}; "
          "held-out metrics at the end, mean (min..max) over the orders")  # fmt: skip
    print(f"{'arm':<24}{'accuracy':>22}{'loss':>24}{'seconds':>9}")
    for mode in modes:
        mine = [r for r in runs if r["mode"] == mode]
        acc = [r["evals"][-1][1]["accuracy"] for r in mine]
        loss = [r["evals"][-1][1]["loss"] for r in mine]
        secs = statistics.fmean(r["seconds"] for r in mine)
        print(f"{mode:<24}{_spread(acc):>22}{_spread(loss):>24}{secs:>9.1f}")
    arms = [r for r in runs if r["seed"] == seeds[0]]
    panels = [
        (
            "samples (all workers)",
            [
                (
                    [done * args.batch_size for done, _ in arm["evals"]],
                    [v[metric] for _, v in arm["evals"]],
                    {"label": f"{arm['mode']} ({metric})", "marker": ".", "linewidth": 1},
                )
                for arm in arms
            ],
        )
        for metric in ("loss", "accuracy")
    ]
    path = save_loss_panels(
        panels[:1], out / f"{args.problem}.png", title=f"held-out loss, {args.problem}",
        ylabel="held-out cross-entropy",
    )  # fmt: skip
    print(f"curves: {path}")


if __name__ == "__main__":
    main()
