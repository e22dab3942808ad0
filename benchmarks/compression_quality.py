"""What each compression gives up: final held-out loss at equal steps, against uncompressed sync.

Trains the digits CNN (8x8 digits) and the 784-1024-1024-10 MLP (the digits upscaled to 28x28)
with ``compress=None, "bf16", "fp16", "int8", "powersgd:4", "topk:0.1", "topk:0.02",
"topk:0.02:2"``, every arm on the same global
batches from the same start, and evaluates on held-out digits (the last 297 of 1797) every
``--every`` steps. A single evaluation moves by several percent from one step to the next, and
any perturbation (even rounding) sends two runs on different paths, so each arm reports the
mean of its last five evaluations, and the uncompressed run is repeated with another data
order (``seed 1``) to show how far two exact runs land apart. Timing is not the point here (see
``benchmarks/two_hosts.py``). Results go to docs/compression.md::

    python benchmarks/compression_quality.py --workers 4 --out quality.json
    python benchmarks/compression_quality.py --arms None,topk:0.02  # some arms only
"""

from __future__ import annotations

import argparse
import functools
import json

import torch
from torch import nn

import towers
from towers.tools.zoo import CNN, cross_entropy, digits_data, digits_flat, mlp

ARMS: tuple[tuple[str | None, int], ...] = (
    (None, 0),
    (None, 1),  # another data order: how far apart two exact runs end
    ("bf16", 0),
    ("fp16", 0),
    ("int8", 0),
    ("powersgd:4", 0),
    ("topk:0.1", 0),
    ("topk:0.02", 0),
    ("topk:0.02:2", 0),
)


def accuracy(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> dict[str, torch.Tensor]:
    x, y = batch
    logits = model(x)
    hits = (logits.argmax(1) == y).float().mean()
    return {"loss": nn.functional.cross_entropy(logits, y), "accuracy": hits}


def _model(name: str) -> nn.Module:
    torch.manual_seed(0)
    return CNN() if name == "cnn" else mlp()


def run(name: str, compress: str | None, seed: int, args: argparse.Namespace) -> dict[str, float]:
    x, y = digits_data() if name == "cnn" else digits_flat()
    train, held = (x[:1500], y[:1500]), (x[1500:], y[1500:])
    result = towers.train(
        _model(name), cross_entropy, train, batch_size=args.batch, steps=args.steps,
        workers=args.workers, optimizer=functools.partial(torch.optim.SGD, lr=0.02, momentum=0.9),
        compress=compress, eval_data=held, eval_fn=accuracy, eval_every=args.every, seed=seed,
        transport="gloo", progress=False,
    )  # fmt: skip
    last = [metrics for _, metrics in result.evals[-5:]]
    return {key: sum(m[key] for m in last) / len(last) for key in ("loss", "accuracy")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--every", type=int, default=20, help="steps between evaluations")
    parser.add_argument("--models", default="cnn,mlp")
    parser.add_argument("--out", default=None)
    parser.add_argument("--arms", default=None, help="compressions to run (None: uncompressed)")
    args = parser.parse_args()
    chosen = None if args.arms is None else args.arms.split(",")
    report: dict[str, dict[str, dict[str, float]]] = {}
    for name in args.models.split(","):
        report[name] = {}
        for arm, seed in ARMS:
            if chosen is not None and (str(arm) not in chosen or seed):
                continue
            label = f"{arm} (seed {seed})" if seed else str(arm)
            report[name][label] = got = run(name, arm, seed, args)
            base = report[name]["None"]["loss"]
            print(
                f"{name} {label:14} held-out loss {got['loss']:.4f} "
                f"({100 * (got['loss'] - base) / base:+.1f}% vs uncompressed), "
                f"accuracy {100 * got['accuracy']:.1f}%",
                flush=True,
            )
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"config": vars(args), "results": report}, f, indent=1)


if __name__ == "__main__":
    main()
