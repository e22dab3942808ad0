"""Data for towers.train: Datasets of any size, collate_fn, num_workers, DataLoader as data."""

from __future__ import annotations

import pickle

import pytest
import torch
from helpers import assert_close_lists, assert_same_parameters, make_net, mse, reference_loop
from torch.utils.data import Dataset

import towers
from towers.processes.pack import pack, unpack


class PerSample(Dataset):
    """One pair of tensors per sample: a Dataset as a user typically writes one."""

    def __init__(self, n: int, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        x = torch.randn(n, 3, generator=g)
        y = x.sum(1, keepdim=True).sin()
        self.items = [(x[i].clone(), y[i].clone()) for i in range(n)]

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int):
        return self.items[i]


def test_pack_keeps_views_shared_storages_parameters_and_dtypes():
    x = torch.arange(12.0).reshape(3, 4)
    obj = {
        "x": x,
        "column": x[:, 1],  # a view of x: must stay a view of the same storage
        "transposed": x.t(),
        "param": torch.nn.Parameter(torch.ones(2)),
        "empty": torch.zeros(0),
        "int16": torch.arange(3, dtype=torch.int16),
        "offset64": torch.arange(4, dtype=torch.float64)[1:],
        "module": torch.nn.Linear(2, 2),
    }
    packed = pack(obj)
    assert packed.buffer.is_shared()
    out = unpack(packed)
    for key in ("x", "column", "transposed", "empty", "int16", "offset64"):
        assert out[key].dtype == obj[key].dtype
        torch.testing.assert_close(out[key], obj[key], rtol=0, atol=0, msg=key)
    assert isinstance(out["param"], torch.nn.Parameter) and out["param"].requires_grad
    assert_same_parameters(out["module"], obj["module"], rtol=0, atol=0)
    out["x"][0, 1] = 100.0
    assert out["column"][0] == 100.0 and x[0, 1] == 1.0  # shared among views, not with the caller


def test_pack_puts_any_number_of_tensors_in_one_buffer():
    data = PerSample(1000)
    packed = pack(data)
    assert packed.buffer.numel() >= 1000 * 2 * 4 * 3
    assert len(packed.pickled) < len(pickle.dumps(data)) / 3  # the data is not in the pickle
    assert torch.equal(unpack(packed)[999][0], data[999][0])


@pytest.mark.timeout(120)
def test_a_dataset_of_100000_one_tensor_samples_trains_like_a_plain_loop():
    # Each sample's tensors used to travel to the workers as one file descriptor each: a few
    # hundred samples failed with "too many fds" or "Too many open files".
    data = PerSample(100_000)
    result = towers.train(
        make_net(), mse, data, batch_size=64, steps=4, workers=2, optimizer=SGD, progress=False
    )
    reference = make_net()
    losses, _, _ = reference_loop(reference, data, batch_size=64, steps=4, optimizer=SGD)
    assert_close_lists(result.losses, losses)
    assert_same_parameters(result.model, reference)


def SGD(params):
    return torch.optim.SGD(params, lr=0.1)
