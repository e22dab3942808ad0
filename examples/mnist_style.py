"""A typical MNIST training script, ported to towers: 4 towers, per-epoch test and StepLR.

The script has the shape of PyTorch's own MNIST example (pytorch/examples, ``mnist/main.py``):
a CNN with dropout and ``log_softmax``, a Dataset, Adadelta, ``StepLR(step_size=1, gamma)``
stepped once per epoch, and a test pass (mean loss and accuracy) after every epoch. MNIST
cannot be downloaded here, so the data is scikit-learn's handwritten digits (1797 real 8x8
images, shipped with scikit-learn), cut into the same train/test split every run.

Both versions are below: ``plain_main`` with ``train`` and ``test`` is the original, ``main``
with ``loss_fn`` and ``metrics`` the port. What changes: the loss moves into ``loss_fn``; the
test pass becomes ``metrics``, which returns means over its batch instead of running sums; the
loaders, the epoch loop, ``zero_grad``/``backward``/``step`` and ``scheduler.step()`` become
keywords of one ``towers.train`` call (``lr_interval="epoch"`` and ``eval_every`` = batches per
epoch keep the per-epoch schedule and test). A line diff of those functions (blank lines aside)
removes 29 lines of 32 and adds 27, 17 of them the ``towers.train`` call written one keyword per
line; the model, the Dataset, the arguments and the report are unchanged.

Run it::

    python examples/mnist_style.py                 # 4 towers, 8 epochs, >= 90% test accuracy
    python examples/mnist_style.py --workers 2 --epochs 3 --min-accuracy 0.8
    python examples/mnist_style.py --plain         # the original single-process loop

It prints the test loss and accuracy after every epoch and exits non-zero if the last accuracy
is below ``--min-accuracy``.
"""

from __future__ import annotations

import argparse
import functools
import math

import torch
import torch.nn.functional as F
from torch import nn, optim
from torch.optim.lr_scheduler import StepLR
from torch.utils.data import DataLoader, Dataset

import towers


class Net(nn.Module):
    """PyTorch's MNIST CNN, sized for 8x8 images."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 16, 3, 1)
        self.conv2 = nn.Conv2d(16, 32, 3, 1)
        self.dropout1 = nn.Dropout(0.25)
        self.dropout2 = nn.Dropout(0.5)
        self.fc1 = nn.Linear(32 * 2 * 2, 64)
        self.fc2 = nn.Linear(64, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.conv1(x))
        x = F.relu(self.conv2(x))
        x = F.max_pool2d(x, 2)
        x = self.dropout1(torch.flatten(x, 1))
        x = self.dropout2(F.relu(self.fc1(x)))
        return F.log_softmax(self.fc2(x), dim=1)


class Digits(Dataset):
    """scikit-learn's digits as a Dataset of (1x8x8 image, label), normalised per sample."""

    MEAN, STD = 4.88, 6.02  # of the pixels (0..16), as MNIST's transform uses its own

    def __init__(self, train: bool) -> None:
        from sklearn.datasets import load_digits

        digits = load_digits()
        order = torch.randperm(len(digits.target), generator=torch.Generator().manual_seed(0))
        cut = int(0.8 * len(order))
        keep = order[:cut] if train else order[cut:]
        self.images = torch.tensor(digits.images, dtype=torch.float32)[keep]
        self.labels = torch.tensor(digits.target, dtype=torch.int64)[keep]

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return ((self.images[i] - self.MEAN) / self.STD).unsqueeze(0), self.labels[i]


# -- the port ------------------------------------------------------------------------------


def loss_fn(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    data, target = batch
    return F.nll_loss(model(data), target)


def metrics(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> dict[str, torch.Tensor]:
    data, target = batch
    output = model(data)
    correct = output.argmax(dim=1).eq(target).float()
    return {"loss": F.nll_loss(output, target), "accuracy": correct.mean()}


def main(args: argparse.Namespace) -> float:
    train_set, test_set = Digits(train=True), Digits(train=False)
    torch.manual_seed(args.seed)
    result = towers.train(
        Net(),
        loss_fn,
        train_set,
        batch_size=args.batch_size,
        epochs=args.epochs,
        workers=args.workers,
        optimizer=functools.partial(optim.Adadelta, lr=args.lr),
        lr_schedule=functools.partial(StepLR, step_size=1, gamma=args.gamma),
        lr_interval="epoch",
        eval_data=test_set,
        eval_fn=metrics,
        eval_every=math.ceil(len(train_set) / args.batch_size),  # once per epoch
        seed=args.seed,
        progress=False,
    )
    for epoch, (_, values) in enumerate(result.evals, start=1):
        report(epoch, values["loss"], values["accuracy"], len(test_set))
    return result.evals[-1][1]["accuracy"]


# -- the original ----------------------------------------------------------------------------


def train(model, train_loader, optimizer):
    model.train()
    for data, target in train_loader:
        optimizer.zero_grad()
        output = model(data)
        loss = F.nll_loss(output, target)
        loss.backward()
        optimizer.step()


def test(model, test_loader):
    model.eval()
    test_loss, correct = 0.0, 0
    with torch.no_grad():
        for data, target in test_loader:
            output = model(data)
            test_loss += F.nll_loss(output, target, reduction="sum").item()
            correct += output.argmax(dim=1).eq(target).sum().item()
    n = len(test_loader.dataset)
    return test_loss / n, correct / n


def plain_main(args: argparse.Namespace) -> float:
    train_set, test_set = Digits(train=True), Digits(train=False)
    torch.manual_seed(args.seed)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, shuffle=True)
    test_loader = DataLoader(test_set, batch_size=1000)
    model = Net()
    optimizer = optim.Adadelta(model.parameters(), lr=args.lr)
    scheduler = StepLR(optimizer, step_size=1, gamma=args.gamma)
    for epoch in range(1, args.epochs + 1):
        train(model, train_loader, optimizer)
        test_loss, accuracy = test(model, test_loader)
        report(epoch, test_loss, accuracy, len(test_set))
        scheduler.step()
    return accuracy


def report(epoch: int, loss: float, accuracy: float, samples: int) -> None:
    print(f"epoch {epoch}: test loss {loss:.4f}, accuracy {accuracy:.1%} of {samples}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--epochs", type=int, default=8)
    parser.add_argument("--lr", type=float, default=1.0)
    parser.add_argument("--gamma", type=float, default=0.7)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--plain", action="store_true", help="run the original loop instead")
    parser.add_argument("--min-accuracy", type=float, default=0.9)
    args = parser.parse_args()
    accuracy = (plain_main if args.plain else main)(args)
    if accuracy < args.min_accuracy:
        raise SystemExit(f"test accuracy {accuracy:.1%} is below {args.min_accuracy:.0%}")
    print(f"ok: test accuracy {accuracy:.1%}")
