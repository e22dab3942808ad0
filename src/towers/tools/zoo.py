"""The model zoo: every model and small data set that the demo, compare, bench and the examples
train, defined once.

- :class:`Parabola`: seed 003's example, a 1-5-1 tanh network fit to y = x^2 on 50 points in
  [-2, 2] with SGD, lr 0.01; weights and biases start from N(0, 1), as ``tf.random_normal``
  initialises them there.
- :class:`CNN`: the shape of TensorFlow's CIFAR-10 multi-GPU trainer (seed 001), two
  conv-relu-pool blocks, two relu fully connected layers and a classifier, sized by a
  :class:`Shape`: :data:`DIGITS` for scikit-learn's 8x8 digits, :data:`CIFAR` for 3x32x32 images.
- :func:`mlp`: the 784-1024-1024-10 MLP of the benchmarks (1.86 M parameters), which learns the
  digits upscaled to 28x28 (:func:`digits_flat`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

__all__ = [
    "CIFAR",
    "CNN",
    "DIGITS",
    "Parabola",
    "Shape",
    "cross_entropy",
    "digits_data",
    "digits_flat",
    "mlp",
    "parabola_data",
    "parabola_loss",
]


class Parabola(nn.Module):
    """1-5-1 with a tanh hidden layer, every weight and bias from N(0, 1)."""

    def __init__(self, hidden: int = 5):
        super().__init__()
        self.hidden = nn.Linear(1, hidden)
        self.out = nn.Linear(hidden, 1)
        for p in self.parameters():
            nn.init.normal_(p, 0.0, 1.0)  # tf.random_normal, not PyTorch's default

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.tanh(self.hidden(x)))


def parabola_data(n: int = 50) -> tuple[torch.Tensor, torch.Tensor]:
    """``n`` points of y = x^2 on [-2, 2]."""
    x = torch.linspace(-2.0, 2.0, n).unsqueeze(1)
    return x, x.square()


def parabola_loss(model: nn.Module, shard: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """``reduce_mean(reduce_sum(square(ys - prediction), axis=1))``, the seed's loss: summed over
    outputs, the mean over samples (towers weights each tower by its shard's size)."""
    x, y = shard
    return (y - model(x)).square().sum(dim=1).mean()


@dataclass(frozen=True)
class Shape:
    """A CNN's layer sizes, so one structure serves 8x8 digits and 32x32 CIFAR images."""

    channels: int  # of the input
    side: int  # input height and width
    conv: tuple[int, int]  # output channels of the two conv blocks
    kernel: int
    fc: tuple[int, int]  # widths of the two hidden fully connected layers


DIGITS = Shape(channels=1, side=8, conv=(32, 64), kernel=3, fc=(128, 64))
# The trainer's own sizes: 64-channel 5x5 convolutions, then 384 and 192 units.
CIFAR = Shape(channels=3, side=32, conv=(64, 64), kernel=5, fc=(384, 192))


class CNN(nn.Module):
    """Two conv-relu-pool blocks, two relu fully connected layers, a linear classifier."""

    def __init__(self, shape: Shape = DIGITS, classes: int = 10) -> None:
        super().__init__()
        c1, c2 = shape.conv
        pad = shape.kernel // 2  # "same" padding: only the pools shrink the image
        self.features = nn.Sequential(
            nn.Conv2d(shape.channels, c1, shape.kernel, padding=pad),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Conv2d(c1, c2, shape.kernel, padding=pad),
            nn.ReLU(),
            nn.MaxPool2d(2),
        )
        f1, f2 = shape.fc
        self.classifier = nn.Sequential(
            nn.Flatten(),
            nn.Linear(c2 * (shape.side // 4) ** 2, f1),
            nn.ReLU(),
            nn.Linear(f1, f2),
            nn.ReLU(),
            nn.Linear(f2, classes),
        )

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.features(images))


def mlp() -> nn.Module:
    """784-1024-1024-10 with ReLUs: 1.86 M parameters, a model whose averaging costs."""
    return nn.Sequential(
        nn.Linear(784, 1024), nn.ReLU(), nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 10)
    )


def digits_data() -> tuple[torch.Tensor, torch.Tensor]:
    """The 1797 8x8 digits bundled with scikit-learn (no download): images in [0, 1], labels."""
    try:
        from sklearn.datasets import load_digits
    except ImportError:
        raise ImportError(
            "the digits data need scikit-learn: pip install 'towers-dp[examples]'"
        ) from None
    digits = load_digits()
    x = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1) / 16.0
    return x, torch.tensor(digits.target, dtype=torch.int64)


def digits_flat(side: int = 28) -> tuple[torch.Tensor, torch.Tensor]:
    """The digits upscaled to ``side`` x ``side`` and flattened: :func:`mlp`'s 784 inputs."""
    x, y = digits_data()
    big = nn.functional.interpolate(x, size=(side, side), mode="bilinear", align_corners=False)
    return big.flatten(1), y


def cross_entropy(model: nn.Module, shard: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """Mean cross-entropy of ``model(inputs)`` against integer labels."""
    x, y = shard
    return nn.functional.cross_entropy(model(x), y)
