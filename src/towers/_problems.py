"""Built-in problems for ``towers demo`` and ``towers compare``.

The parabola is the example of the "TensorFlow averaging minibatch gradients in parallel"
question: a 1-5-1 tanh network fit to y = x^2 on 50 points in [-2, 2] with SGD, lr 0.01. Weights
and biases start from N(0, 1), as ``tf.random_normal`` initialises them there. The digits CNN is
a problem whose gradients cost real compute (``towers compare --problem digits``).
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["DigitsCNN", "Parabola", "digits_data", "digits_loss", "parabola_data", "parabola_loss"]


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


class DigitsCNN(nn.Module):
    """A small CNN for scikit-learn's 8x8 handwritten digits: conv-pool-conv-pool-linear.

    The shape of the CIFAR-10 multi-GPU trainer's network, scaled to 8x8 images, so that a
    shard's gradient costs real compute (unlike the parabola, whose cost is all communication).
    """

    def __init__(self) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(1, 16, 3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Conv2d(16, 32, 3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2),
        )
        self.classifier = nn.Linear(32 * 2 * 2, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.features(x).flatten(1))


def digits_data() -> tuple[torch.Tensor, torch.Tensor]:
    """The 1797 8x8 digits bundled with scikit-learn (no download): images in [0, 1], labels."""
    try:
        from sklearn.datasets import load_digits
    except ImportError:
        raise ImportError(
            "the digits problem needs scikit-learn: pip install 'towers-dp[examples]'"
        ) from None
    digits = load_digits()
    x = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1) / 16.0
    return x, torch.tensor(digits.target, dtype=torch.int64)


def digits_loss(model: nn.Module, shard: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    x, y = shard
    return nn.functional.cross_entropy(model(x), y)
