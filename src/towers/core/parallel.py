"""``make_parallel``: towers inside one process, one per device (single-process data parallelism).

The PyTorch form of the ``make_parallel(fn, num_gpus, **kwargs)`` helper from "Effective
TensorFlow": split every input along the batch dimension, run ``fn`` on each shard on its device,
concatenate the outputs. Because moving a tensor between devices and ``torch.cat`` are
differentiable, gradients of any function of the result flow back to the parameters ``fn`` uses,
so turning a model parallel changes two lines of a training script.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import torch

from .split import batch_size, concat, map_batch, split

__all__ = ["make_parallel"]


def _devices(devices: int | Sequence[torch.device | str | int]) -> list[torch.device | None]:
    if isinstance(devices, bool):
        raise TypeError("devices must be an int or a list of devices, got a bool")
    if isinstance(devices, int):
        if devices < 1:
            raise ValueError(f"devices must be >= 1, got {devices}")
        return [None] * devices  # that many towers on the device the inputs are on
    if isinstance(devices, (str, torch.device)):
        devices = [devices]
    out: list[torch.device | None] = [torch.device(d) for d in devices]
    if not out:
        raise ValueError("devices is an empty list; give at least one device")
    return out


def _to_device(t: Any, device: torch.device) -> torch.Tensor:
    return torch.as_tensor(t).to(device)


def make_parallel(
    fn: Callable[..., Any],
    devices: int | Sequence[torch.device | str | int],
    **inputs: Any,
) -> Any:
    """Run ``fn`` once per tower on a shard of every input and concatenate the outputs.

    Every keyword input is split along dim 0 with :func:`towers.split`; tower i calls
    ``fn(**shard_i)`` with its shard moved to ``devices[i]``. Outputs (a tensor, or a tuple/dict of
    tensors with a batch dimension) are concatenated along dim 0 on the first device. Towers that
    would get no samples (a batch smaller than the number of devices) are not run.

    ``fn`` must be able to run on each device: its parameters live on that device (the usual case
    for ``devices=int``) or ``fn`` picks the replica for the device its inputs are on.

    Args:
        fn: a function of keyword tensors returning per-sample outputs.
        devices: the number of towers on the inputs' current device, or a list of devices.
        **inputs: batch tensors sharing dim 0.

    Returns:
        The concatenated outputs, with the structure ``fn`` returns.

    Example:
        >>> w = torch.ones(3, requires_grad=True)
        >>> def model(x, y):
        ...     return (x @ w - y) ** 2
        >>> loss = make_parallel(model, 2, x=torch.randn(5, 3), y=torch.randn(5)).mean()
        >>> loss.backward()  # w.grad equals the gradient of the unsplit computation
    """
    targets = _devices(devices)
    if not inputs:
        raise ValueError("make_parallel needs at least one keyword input to split")
    if batch_size(inputs) == 0:  # also validates shapes before any tower runs
        raise ValueError("make_parallel got an empty batch (dim 0 has size 0)")
    shards = split(inputs, len(targets))
    outputs = []
    for device, shard in zip(targets, shards):
        if batch_size(shard) == 0:
            continue
        if device is not None:
            shard = map_batch(functools.partial(_to_device, device=device), shard)
        outputs.append(fn(**shard))
    return concat(outputs, targets[0])
