"""Data for towers.train: Datasets of any size, collate_fn, num_workers, DataLoader as data."""

from __future__ import annotations

import pickle
import resource

import pytest
import torch
from exact import Reference, as_float64
from helpers import make_net, mse, reference_loop
from torch.utils.data import DataLoader, Dataset

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
    for p, q in zip(out["module"].state_dict().values(), obj["module"].state_dict().values()):
        assert torch.equal(p, q)
    out["x"][0, 1] = 100.0
    assert out["column"][0] == 100.0 and x[0, 1] == 1.0  # shared among views, not with the caller
    # each storage is its own size: a copy or a checkpoint of one tensor is not the whole buffer
    assert out["module"].weight.untyped_storage().nbytes() == 4 * 4
    storage = unpack(pack(x.untyped_storage()))  # a storage on its own is sent the same way
    assert storage.nbytes() == 12 * 4 and torch.equal(
        torch.tensor(storage).view(torch.float32), x.flatten()
    )
    generator = torch.Generator().manual_seed(5)
    expected = torch.rand(3, generator=generator)
    generator.manual_seed(5)
    generator.set_state(unpack(pack(generator.get_state())))  # checks the state's exact size
    assert torch.equal(torch.rand(3, generator=generator), expected)


def test_pack_puts_any_number_of_tensors_in_one_buffer():
    data = PerSample(1000)
    packed = pack(data)
    assert packed.buffer.numel() >= 1000 * 2 * 4 * 3
    assert len(packed.pickled) < len(pickle.dumps(data)) / 3  # the data is not in the pickle
    assert torch.equal(unpack(packed)[999][0], data[999][0])


@pytest.mark.timeout(120)
def test_a_dataset_of_more_one_tensor_samples_than_open_files_trains_like_a_plain_loop():
    # Each sample's tensors used to travel to the workers as one file descriptor each: a few
    # hundred samples failed with "too many fds" or "Too many open files". Here 10,000 tensors
    # travel from a caller, and to workers, allowed 1,024 open files.
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    data = PerSample(5_000)
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(1024, soft), hard))
    try:
        result = towers.train(
            make_net(), mse, data, batch_size=64, steps=4, workers=2, optimizer=SGD,
            progress=False,
        )  # fmt: skip
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))

    def plain_loop(dtype):
        model = make_net().to(dtype)
        samples = data if dtype == torch.float32 else Float64(data)
        losses, _, _ = reference_loop(model, samples, batch_size=64, steps=4, optimizer=SGD)
        return model, losses

    reference = Reference.run(plain_loop)
    reference.check_losses(result.losses)
    reference.check(result.model)


def SGD(params):
    return torch.optim.SGD(params, lr=0.1)


class Float64(Dataset):
    """``dataset``'s samples with every float tensor in float64: a plain loop's data in
    float64, for :class:`exact.Reference`."""

    def __init__(self, dataset: Dataset):
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, i: int):
        return as_float64(self.dataset[i])


class Sequences(Dataset):
    """Variable-length sequences (1 to 6 steps of 2 features) with a regression target."""

    def __init__(self, n: int, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        lengths = torch.randint(1, 7, (n,), generator=g).tolist()
        self.items = []
        for length in lengths:
            x = torch.randn(length, 2, generator=g)
            self.items.append((x, x.sum(0)[:1].tanh()))

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int):
        return self.items[i]


def pad(items):
    """Pad to the longest sequence of the batch; the mask marks real steps."""
    longest = max(len(x) for x, _ in items)
    x = torch.zeros(len(items), longest, 2)
    mask = torch.zeros(len(items), longest)
    for i, (seq, _) in enumerate(items):
        x[i, : len(seq)] = seq
        mask[i, : len(seq)] = 1
    return x, mask, torch.stack([y for _, y in items])


class SeqNet(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(2, 1)

    def forward(self, x, mask):
        pooled = (x * mask[..., None]).sum(1) / mask.sum(1, keepdim=True)
        return self.fc(torch.tanh(pooled))


def make_seqnet():
    torch.manual_seed(3)
    return SeqNet()


def seq_loss(model, batch):
    x, mask, y = batch
    return (model(x, mask) - y).square().mean()


def plain_padded_loop(data, *, batch_size, steps, eval_data=None, seed=0, dtype=torch.float32):
    """The plain loop over padded batches, in ``dtype`` (float64: model and batches cast)."""
    collate = pad if dtype == torch.float32 else lambda items: as_float64(pad(items))
    loader = DataLoader(
        data,
        batch_size=batch_size,
        shuffle=True,
        collate_fn=collate,
        generator=torch.Generator().manual_seed(seed),
    )
    model = make_seqnet().to(dtype)
    opt = SGD(model.parameters())
    losses, it = [], iter(loader)
    for _ in range(steps):
        batch = next(it, None)
        if batch is None:
            it = iter(loader)
            batch = next(it)
        opt.zero_grad()
        loss = seq_loss(model, batch)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    evaluated = None
    if eval_data is not None:
        with torch.no_grad():
            everything = collate([eval_data[i] for i in range(len(eval_data))])
            evaluated = seq_loss(model, everything).item()
    return model, losses, evaluated


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    ("workers", "mode", "num_workers", "accumulate"),
    [(3, "sync", 2, 2), (1, "async", 1, 1)],  # async: one tower, so the order is a plain loop's
)
def test_padding_collate_fn_and_loader_processes_match_a_plain_loop(
    workers, mode, num_workers, accumulate
):
    data, eval_data = Sequences(50), Sequences(11, seed=1)
    result = towers.train(
        make_seqnet(),
        seq_loss,
        data,
        batch_size=8,
        steps=9,  # crosses an epoch (7 batches, the last of 2 samples)
        workers=workers,
        mode=mode,
        optimizer=SGD,
        collate_fn=pad,
        num_workers=num_workers,
        accumulate=accumulate,
        eval_data=eval_data,
        progress=False,
    )
    evaluated = {}

    def plain_loop(dtype):
        model, losses, evaluated[dtype] = plain_padded_loop(
            data, batch_size=8, steps=9, eval_data=eval_data, dtype=dtype
        )
        return model, losses

    reference = Reference.run(plain_loop)
    reference.check_losses(result.losses)
    reference.check(result.model)
    assert result.evals[-1][0] == 9
    # the held-out loss of the trained model: as close to the float64 loop's as the float32
    # loop's evaluation is, times the factor
    single, exact = [evaluated[torch.float32]], [evaluated[torch.float64]]
    Reference({}, {}, single, exact).check_losses([result.evals[-1][1]["loss"]], "evaluation")


def test_loader_processes_resume_where_the_checkpoint_left_off(tmp_path):
    data = Sequences(30)
    common = dict(batch_size=8, workers=1, optimizer=SGD, collate_fn=pad, progress=False)
    towers.train(
        make_seqnet(), seq_loss, data, steps=5, checkpoint=tmp_path, num_workers=1, **common
    )
    resumed = towers.train(
        make_seqnet(), seq_loss, data, steps=9, checkpoint=tmp_path, num_workers=1, **common
    )
    whole = towers.train(make_seqnet(), seq_loss, data, steps=9, **common)
    assert resumed.losses == whole.losses  # one process each, the same arithmetic: bit for bit
    for (name, p), q in zip(resumed.model.state_dict().items(), whole.model.state_dict().values()):
        assert torch.equal(p, q), name


def test_a_dataloader_as_data_is_refused_with_the_call_to_write():
    loader = DataLoader(Sequences(10), batch_size=4, shuffle=True, collate_fn=pad, num_workers=2)
    with pytest.raises(TypeError) as info:
        towers.train(make_seqnet(), seq_loss, loader, batch_size=4, steps=1)
    assert (
        "pass the loader's dataset and settings instead: towers.train(model, loss_fn, "
        "loader.dataset, batch_size=4, shuffle=True, collate_fn=pad, num_workers=2, ...)"
    ) in str(info.value)
    plain = DataLoader(Sequences(10), batch_size=5, drop_last=True)
    with pytest.raises(TypeError, match=r"batch_size=5, shuffle=False, \.\.\.\).*drop_last"):
        towers.train(make_seqnet(), seq_loss, plain, batch_size=5, steps=1)
    weighted = DataLoader(
        Sequences(10), sampler=torch.utils.data.WeightedRandomSampler([1] * 10, 10)
    )
    with pytest.raises(TypeError, match=r"custom sampler.*WeightedRandomSampler"):
        towers.train(make_seqnet(), seq_loss, weighted, batch_size=5, steps=1)
    replaced = DataLoader(
        Sequences(10),
        batch_size=2,
        sampler=torch.utils.data.RandomSampler(range(10), replacement=True),
    )
    with pytest.raises(TypeError, match="with replacement"):
        towers.train(make_seqnet(), seq_loss, replaced, batch_size=2, steps=1)
    batched = DataLoader(Sequences(10), batch_sampler=[[0, 1], [2, 3]])
    with pytest.raises(TypeError, match=r"custom batch_sampler \(list\)"):
        towers.train(make_seqnet(), seq_loss, batched, batch_size=2, steps=1)
    with pytest.raises(TypeError, match=r"loss_fn, data, eval_data=loader\.dataset, \.\.\.\)"):
        towers.train(
            make_seqnet(),
            seq_loss,
            Sequences(10),
            batch_size=5,
            steps=1,
            eval_data=DataLoader(Sequences(4)),
        )
    with pytest.raises(TypeError, match=r"eval_data=loader\.dataset"):
        towers.train(
            make_seqnet(), seq_loss, Sequences(10), batch_size=5, steps=1, eval_data=loader
        )


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"num_workers": -1}, "num_workers must be an int >= 0"),
        ({"collate_fn": "pad"}, "collate_fn must be callable"),
        ({"collate_fn": lambda items: items}, "collate_fn cannot be sent"),
    ],
)
def test_bad_loading_arguments_are_refused(overrides, message):
    with pytest.raises((TypeError, ValueError), match=message):
        towers.train(make_seqnet(), seq_loss, Sequences(10), batch_size=5, steps=1, **overrides)


def test_collate_fn_and_num_workers_need_a_dataset():
    for key, value in (("collate_fn", pad), ("num_workers", 2)):
        with pytest.raises(ValueError, match=f"{key}= applies to a Dataset's samples"):
            towers.train(
                make_net(),
                mse,
                (torch.ones(4, 3), torch.ones(4, 1)),
                batch_size=2,
                steps=1,
                **{key: value},
            )
