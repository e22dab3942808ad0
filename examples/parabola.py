"""Fit y = x^2 with a 1-5-1 tanh network, on one tower and on four: the same training.

The network, data, loss and optimizer are those of the "TensorFlow averaging minibatch gradients
in parallel" question (the network and loss are ``towers.tools.zoo``'s ``Parabola`` and
``parabola_loss``): 50 points of the parabola on [-2, 2], weights and biases drawn from N(0, 1)
(``tf.random_normal``), the mean over samples of the summed squared error, plain SGD with lr
0.01, 2000 steps of the full batch. The question asks for exactly what ``towers.train`` does
in sync mode: split the batch over P processes, bring the gradients back, average, apply.

Run it::

    python examples/parabola.py            # 1 worker, then 4; checks they agree
    python examples/parabola.py --workers 3 --steps 500

It exits non-zero if the loss did not drop or if the towers disagree with the single worker.
"""

from __future__ import annotations

import argparse
import time

import torch
from torch import nn

import towers
from towers.tools.zoo import Parabola, parabola_loss


def fit(
    model: nn.Module, data: tuple[torch.Tensor, torch.Tensor], workers: int, steps: int
) -> towers.TrainResult:
    return towers.train(
        model,
        parabola_loss,  # the seed's loss: summed over outputs, the mean over the shard
        data,
        batch_size=len(data[0]),  # the full batch every step, as in the question
        steps=steps,
        workers=workers,
        shuffle=False,
        progress=False,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--workers", type=int, default=4, help="towers to compare with 1")
    parser.add_argument("--steps", type=int, default=2000, help="SGD steps (full batch)")
    parser.add_argument("--points", type=int, default=50, help="samples of the parabola")
    parser.add_argument("--seed", type=int, default=0, help="seeds the initial weights")
    args = parser.parse_args()

    x = torch.linspace(-2.0, 2.0, args.points).unsqueeze(1)
    data = (x, x.square())
    torch.manual_seed(args.seed)
    model = Parabola()  # train() copies it, so both runs start from these weights

    results = {}
    for workers in (1, args.workers):
        start = time.perf_counter()
        r = fit(model, data, workers, args.steps)
        results[workers] = r
        print(
            f"{workers} worker(s): loss {r.losses[0]:.4f} -> {r.losses[-1]:.6f} "
            f"in {r.steps} steps ({time.perf_counter() - start:.1f} s with start-up)"
        )

    one, many = results[1], results[args.workers]
    if not one.losses[-1] < 0.1 * one.losses[0]:
        raise SystemExit(f"FAIL: the loss did not drop: {one.losses[0]:.4f} -> {one.losses[-1]}")
    gap = max(abs(a - b) / max(abs(a), 1e-12) for a, b in zip(one.losses, many.losses))
    if gap > 1e-5:
        raise SystemExit(f"FAIL: {args.workers} workers' losses differ from 1 worker's by {gap}")
    for (name, p), q in zip(one.model.named_parameters(), many.model.parameters()):
        if not torch.allclose(p, q, rtol=1e-5, atol=1e-6):
            diff = (p - q).abs().max().item()
            raise SystemExit(f"FAIL: parameter {name} differs between runs by {diff:.2e}")
    print(f"OK: {args.workers} workers match 1 worker (largest relative loss gap {gap:.1e})")


if __name__ == "__main__":
    main()
