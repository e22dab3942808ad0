"""Built-in problems for ``towers demo`` and ``towers compare``.

The parabola is the example of the "TensorFlow averaging minibatch gradients in parallel"
question: a 1-5-1 tanh network fit to y = x^2 on 50 points in [-2, 2] with SGD, lr 0.01. Weights
and biases start from N(0, 1), as ``tf.random_normal`` initialises them there.
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["Parabola", "parabola_data", "parabola_loss"]


class Parabola(nn.Module):
    """1-5-1 network with a tanh hidden layer."""

    def __init__(self, hidden: int = 5):
        super().__init__()
        self.hidden = nn.Linear(1, hidden)
        self.out = nn.Linear(hidden, 1)
        for p in self.parameters():
            nn.init.normal_(p, 0.0, 1.0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.tanh(self.hidden(x)))


def parabola_data(n: int = 50) -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.linspace(-2.0, 2.0, n).unsqueeze(1)
    return x, x.square()


def parabola_loss(model: nn.Module, shard: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """Mean over samples of the summed squared error, as in the original ``loss``."""
    x, y = shard
    return (y - model(x)).square().sum(dim=1).mean()
