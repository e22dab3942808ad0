"""Fit y = x^2 with a 1-5-1 tanh network, on one tower and on four: the same training.

The network, data, loss and optimizer are those of the "TensorFlow averaging minibatch gradients
in parallel" question: 50 points of the parabola on [-2, 2], weights and biases drawn from
N(0, 1) (``tf.random_normal``), the mean over samples of the summed squared error, plain SGD with
lr 0.01, 2000 steps of the full batch. The question asks for exactly what ``towers.train`` does
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


class Net(nn.Module):
    """1-5-1 with a tanh hidden layer, every weight and bias from N(0, 1)."""

    def __init__(self, hidden: int = 5) -> None:
        super().__init__()
        self.hidden = nn.Linear(1, hidden)
        self.out = nn.Linear(hidden, 1)
        for p in self.parameters():
            nn.init.normal_(p, mean=0.0, std=1.0)  # tf.random_normal, not PyTorch's default

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.tanh(self.hidden(x)))


def loss_fn(model: nn.Module, shard: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    # reduce_mean(reduce_sum(square(ys - prediction), axis=1)): sum over outputs, mean over
    # samples. The mean over the shard is what towers expects; it weights towers by their size.
    x, y = shard
    return (y - model(x)).square().sum(dim=1).mean()


def fit(
    model: nn.Module, data: tuple[torch.Tensor, torch.Tensor], workers: int, steps: int
) -> towers.TrainResult:
    return towers.train(
        model,
        loss_fn,
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
    model = Net()  # train() copies it, so both runs start from these weights

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
