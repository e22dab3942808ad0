"""Train a small CNN on real images with four towers, in the shape of TensorFlow's CIFAR-10
multi-GPU trainer.

What is kept from that trainer: a CNN of conv-relu-pool blocks and fully connected layers, a loss
computed per tower on its own shard, gradients averaged over the towers into one update, plain
SGD, and a learning rate decayed exponentially in a staircase every
``num_batches_per_epoch * epochs_per_decay`` global batches. That schedule is
``torch.optim.lr_scheduler.StepLR``; ``towers.train`` steps it once per global batch, as the
trainer's ``global_step`` counted batches.

By default it trains on scikit-learn's handwritten digits (1797 real 8x8 images, shipped with
scikit-learn, so nothing is downloaded) and checks the test accuracy. With ``--cifar-dir`` it
trains the same structure, sized for 3x32x32 input, on the CIFAR-10 binary batches found there
(``data_batch_1.bin`` ... ``data_batch_5.bin`` and ``test_batch.bin`` from
https://www.cs.toronto.edu/~kriz/cifar.html; fetch them yourself).

Run it::

    python examples/digits_cnn.py                       # digits, 4 workers, >= 95% accuracy
    python examples/digits_cnn.py --workers 2 --epochs 30
    python examples/digits_cnn.py --cifar-dir ~/data/cifar-10-batches-bin --epochs 10

It exits non-zero if the test accuracy is below ``--min-accuracy``.
"""

from __future__ import annotations

import argparse
import functools
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch
from torch import nn

import towers
from towers.tools.zoo import CIFAR, CNN, DIGITS, cross_entropy

CIFAR_SIDE = 32
CIFAR_RECORD = 1 + 3 * CIFAR_SIDE * CIFAR_SIDE  # a label byte, then the red, green, blue planes


def load_cifar10_bin(paths: Sequence[str | Path]) -> tuple[torch.Tensor, torch.Tensor]:
    """Read CIFAR-10 binary batches into images and labels.

    Each record is 3073 bytes: the label (0-9), then 1024 red, 1024 green and 1024 blue pixel
    bytes, each plane row-major 32x32. That channel-major layout is already N x C x H x W.

    Args:
        paths: binary batch files, read in the order given.

    Returns:
        ``(images, labels)``: float32 ``N x 3 x 32 x 32`` in [0, 1], and int64 ``N``.

    Example:
        >>> images, labels = load_cifar10_bin(["cifar-10-batches-bin/test_batch.bin"])
        >>> images.shape  # doctest: +SKIP
        torch.Size([10000, 3, 32, 32])
    """
    if not paths:
        raise ValueError("no CIFAR-10 batch files given")
    records = []
    for path in paths:
        raw = np.fromfile(path, dtype=np.uint8)
        if raw.size == 0 or raw.size % CIFAR_RECORD:
            raise ValueError(
                f"{path}: {raw.size} bytes is not a whole number of CIFAR-10 records of "
                f"{CIFAR_RECORD} bytes (1 label + 3072 pixels); is the file truncated, or not "
                "the binary version of the data set?"
            )
        records.append(raw.reshape(-1, CIFAR_RECORD))
    table = np.concatenate(records)
    labels = torch.from_numpy(table[:, 0].astype(np.int64))
    if labels.max() > 9:
        raise ValueError(f"label {labels.max().item()} found; CIFAR-10 labels are 0-9")
    pixels = torch.from_numpy(table[:, 1:].copy()).view(-1, 3, CIFAR_SIDE, CIFAR_SIDE)
    return pixels.float() / 255.0, labels


@torch.no_grad()
def accuracy(model: nn.Module, images: torch.Tensor, labels: torch.Tensor) -> float:
    model.eval()
    return (model(images).argmax(dim=1) == labels).float().mean().item()


def standardize(images: torch.Tensor) -> torch.Tensor:
    """Each image to zero mean and unit variance, as the trainer's
    ``tf.image.per_image_standardization``; the floor on the deviation keeps a blank image finite.
    """
    pixels = images[0].numel()
    mean = images.mean(dim=(1, 2, 3), keepdim=True)
    std = images.std(dim=(1, 2, 3), keepdim=True, correction=0).clamp(min=pixels**-0.5)
    return (images - mean) / std


Split = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]


def load_digits_split(seed: int) -> Split:
    """scikit-learn's digits, 80/20 stratified, each image standardized."""
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    digits = load_digits()
    images = standardize(torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1))
    labels = torch.tensor(digits.target, dtype=torch.int64)
    x_train, x_test, y_train, y_test = train_test_split(
        images, labels, test_size=0.2, random_state=seed, stratify=labels
    )
    return x_train, y_train, x_test, y_test


def load_cifar_split(directory: Path) -> Split:
    train_files = sorted(directory.glob("data_batch_*.bin"))
    test_file = directory / "test_batch.bin"
    if not train_files or not test_file.is_file():
        raise SystemExit(
            f"no CIFAR-10 binary batches in {directory}: expected data_batch_1.bin ... and "
            "test_batch.bin (the 'binary version' from https://www.cs.toronto.edu/~kriz/cifar.html)"
        )
    x_train, y_train = load_cifar10_bin(train_files)
    x_test, y_test = load_cifar10_bin([test_file])
    return standardize(x_train), y_train, standardize(x_test), y_test


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--workers", type=int, default=4, help="towers (worker processes)")
    parser.add_argument("--epochs", type=int, default=None, help="default: 20 digits, 10 CIFAR")
    parser.add_argument("--batch-size", type=int, default=64, help="global batch, all towers")
    parser.add_argument("--lr", type=float, default=None, help="default: 0.2 digits, 0.1 CIFAR")
    parser.add_argument("--epochs-per-decay", type=float, default=10.0)
    parser.add_argument("--decay-factor", type=float, default=0.1)
    parser.add_argument("--seed", type=int, default=0, help="seeds the split, weights, order")
    parser.add_argument("--cifar-dir", type=Path, default=None, help="train on CIFAR-10 instead")
    parser.add_argument(
        "--min-accuracy", type=float, default=None, help="default: 0.95 digits, 0.5 CIFAR"
    )
    args = parser.parse_args()

    cifar = args.cifar_dir is not None
    x_train, y_train, x_test, y_test = (
        load_cifar_split(args.cifar_dir) if cifar else load_digits_split(args.seed)
    )
    epochs = args.epochs if args.epochs is not None else (10 if cifar else 20)
    lr = args.lr if args.lr is not None else (0.1 if cifar else 0.2)
    min_accuracy = args.min_accuracy if args.min_accuracy is not None else (0.5 if cifar else 0.95)

    # As in the trainer: decay_steps = int(num_batches_per_epoch * NUM_EPOCHS_PER_DECAY).
    num_batches_per_epoch = len(x_train) / args.batch_size
    decay_steps = max(1, int(num_batches_per_epoch * args.epochs_per_decay))
    schedule = functools.partial(
        torch.optim.lr_scheduler.StepLR, step_size=decay_steps, gamma=args.decay_factor
    )

    torch.manual_seed(args.seed)
    model = CNN(CIFAR if cifar else DIGITS)
    name = "CIFAR-10" if cifar else "digits"
    print(
        f"{name}: {len(x_train)} training and {len(x_test)} test images, {args.workers} "
        f"workers, {epochs} epoch(s), lr {lr} x {args.decay_factor} every {decay_steps} steps",
        flush=True,
    )
    start = time.perf_counter()
    result = towers.train(
        model,
        cross_entropy,  # the mean over each tower's shard; towers weights it by the shard's size
        (x_train, y_train),
        batch_size=args.batch_size,
        epochs=epochs,
        workers=args.workers,
        optimizer=functools.partial(torch.optim.SGD, lr=lr),
        lr_schedule=schedule,
        seed=args.seed,
    )
    acc = accuracy(result.model, x_test, y_test)
    print(
        f"{result.steps} steps in {time.perf_counter() - start:.1f} s: "
        f"loss {result.losses[0]:.3f} -> {result.losses[-1]:.3f}, test accuracy {acc:.1%}"
    )
    if result.skipped:
        print(f"skipped steps (non-finite loss or gradient): {result.skipped}")
    if acc < min_accuracy:
        raise SystemExit(f"FAIL: test accuracy {acc:.1%} is below {min_accuracy:.0%}")
    print(f"OK: test accuracy {acc:.1%} >= {min_accuracy:.0%}")


if __name__ == "__main__":
    main()
