"""Sparse sums: compress="topk:F[:BITS]" and mode="sparseloco:H".

Training with top-k is compared with the same arithmetic written out in one process in plain
torch (:func:`sparsify`, from docs/compression.md's description, not from the codec): every
tower's weighted gradient plus its residual, the largest values of each chunk of 4096 kept and
quantised, the rest carried to the next step, the kept values summed in rank order and divided
by the samples. The model has more than 4096 parameters, so its one bucket is two chunks. The
reference runs in float32 and in float64 over the same batches, and a run of towers may be as far
from the float64 one as tests/exact.py's bound allows (a few times the float32 one's distance).
"""

from __future__ import annotations

import copy
import functools
import math

import pytest
import torch
from exact import Reference, as_float64
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import towers
from towers.core.codecs import TopKCodec
from towers.engines.transforms import TopKSum, compression

CHUNK = 4096
SGD = functools.partial(torch.optim.SGD, lr=0.05, momentum=0.9)
INNER = functools.partial(torch.optim.SGD, lr=0.05)


def wide_net(dtype: torch.dtype = torch.float32) -> nn.Module:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 512), nn.Tanh(), nn.Linear(512, 1))  # 5121 parameters
    return net.to(dtype)


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(45, 8, generator=g)
    return x, (x @ torch.randn(8, 1, generator=g)).sin()


DATA = _data()


def mse(model: nn.Module, shard) -> torch.Tensor:
    x, y = shard
    return (model(x) - y).square().mean()


# -- the reference, in plain torch ----------------------------------------------------------


def sparsify(x: torch.Tensor, share: float, bits: int) -> torch.Tensor:
    """What one tower sends of ``x``: per chunk of 4096 values, the ``ceil(share * 4096)``
    largest magnitudes, at ``bits`` < 32 each a sign and the nearest of ``2**(bits-1)`` levels
    spread evenly from the smallest kept magnitude to the largest; zero elsewhere."""
    out = torch.zeros_like(x)
    size = min(CHUNK, x.numel())
    kept = math.ceil(share * size)
    for start in range(0, x.numel(), size):
        part = x[start : start + size]
        order = part.abs().argsort(descending=True)[: min(kept, part.numel())]
        values = part[order]
        if bits < 32:
            mags = values.abs()
            lo, hi, top = mags.min(), mags.max(), 2 ** (bits - 1) - 1
            level = torch.round((mags - lo) / (hi - lo) * top) if hi > lo else mags * 0
            values = torch.where(values < 0, -1.0, 1.0) * (lo + level * ((hi - lo) / top))
        out[start + order] = values
    return out


def _flat(tensors) -> torch.Tensor:
    # one bucket, its parameters in reverse order (as DDP's buckets, docs/architecture.md)
    return torch.cat([t.reshape(-1) for t in reversed(list(tensors))])


def _unflat(flat: torch.Tensor, like: list[torch.Tensor]) -> list[torch.Tensor]:
    out, at = [], 0
    for p in reversed(like):
        out.append(flat[at : at + p.numel()].view_as(p))
        at += p.numel()
    return out[::-1]


def _batches(steps: int, batch_size: int = 10, dtype: torch.dtype = torch.float32) -> list:
    data = as_float64(DATA) if dtype == torch.float64 else DATA
    loader = DataLoader(TensorDataset(*data), batch_size, shuffle=False)
    return [b for _ in range(-(-steps // len(loader))) for b in loader][:steps]


def sync_reference(share: float, bits: int, steps: int, workers: int, dtype=torch.float32):
    """Synchronous top-k with error feedback, one tower after another in one process, in
    ``dtype``."""
    model = wide_net(dtype)
    params = list(model.parameters())
    opt = SGD(params)
    residual = [torch.zeros(sum(p.numel() for p in params), dtype=dtype) for _ in range(workers)]
    losses = []
    for batch in _batches(steps, dtype=dtype):
        sent, loss_sum, total = None, 0.0, 0
        for t, shard in enumerate(towers.split(tuple(batch), workers)):
            n = len(shard[0])
            model.zero_grad()
            loss = mse(model, shard)
            (loss * n).backward()
            values = residual[t] + _flat(p.grad for p in params)
            c = sparsify(values, share, bits)
            residual[t] = values - c
            sent = c if sent is None else sent + c
            loss_sum, total = loss_sum + loss.item() * n, total + n
        for p, g in zip(params, _unflat(sent / total, params)):
            p.grad = g.clone()
        opt.step()
        losses.append(loss_sum / total)
    return model, losses


def sparseloco_reference(
    every: int, steps: int, workers: int, dtype: torch.dtype = torch.float32
) -> tuple[nn.Module, list[float]]:
    """SparseLoCo in one process, in ``dtype``: H inner steps per tower, ``e <- 0.95 e + w *
    delta``, send the top 1/64 at 2 bits, ``e <- e - sent``, outer SGD of lr 1 on the mean of
    what was sent."""
    outer = wide_net(dtype)
    outer_opt = torch.optim.SGD(outer.parameters(), lr=1.0)
    n = sum(p.numel() for p in outer.parameters())
    residual = [torch.zeros(n, dtype=dtype) for _ in range(workers)]
    local = [copy.deepcopy(outer) for _ in range(workers)]
    inner = [INNER(m.parameters()) for m in local]
    weights, losses = [0] * workers, []
    for k, batch in enumerate(_batches(steps, dtype=dtype)):
        loss_sum, total = 0.0, 0
        for t, shard in enumerate(towers.split(tuple(batch), workers)):
            inner[t].zero_grad()
            loss = mse(local[t], shard)
            loss.backward()
            inner[t].step()
            weights[t] += len(shard[0])
            loss_sum, total = loss_sum + loss.item() * len(shard[0]), total + len(shard[0])
        losses.append(loss_sum / total)
        if (k + 1) % every:
            continue
        sent = None
        for t in range(workers):
            pairs = zip(outer.parameters(), local[t].parameters())
            delta = _flat((o.detach() - m.detach()).mul_(weights[t]) for o, m in pairs)
            values = residual[t] * 0.95 + delta
            c = sparsify(values, 1 / 64, 2)
            residual[t] = values - c
            sent = c if sent is None else sent + c
        outer_params = list(outer.parameters())
        for p, g in zip(outer_params, _unflat(sent / sum(weights), outer_params)):
            p.grad = g.clone()
        outer_opt.step()
        for m in local:
            m.load_state_dict(outer.state_dict())
        weights = [0] * workers
    return outer, losses


# -- the codec, without processes -----------------------------------------------------------


@pytest.mark.parametrize("bits", [2, 4, 8, 32])
def test_the_codec_sends_what_the_reference_keeps(bits):
    g = torch.Generator().manual_seed(bits)
    for n, share in ((10_000, 0.02), (4096, 0.1), (37, 0.05)):
        x = torch.randn(n, generator=g) * 1e-3
        codec = TopKCodec(share, bits)
        data = codec.encode(x)
        assert data.dtype == torch.uint8 and data.numel() == codec.nbytes(n)
        back = codec.decode(data, n)
        want = sparsify(x, share, bits)
        torch.testing.assert_close(back, want, rtol=1e-6, atol=0.0)
        kept = math.ceil(share * min(n, CHUNK)) * -(-n // CHUNK)
        assert int((back != 0).sum()) == kept
    # the bytes: 2 for each place, BITS for each value, 8 per chunk for the scales
    assert TopKCodec(0.02, 2).nbytes(8192) == 2 * 82 * 2 + 2 * 82 * 2 // 8 + 2 * 8
    assert TopKCodec(0.02).nbytes(8192) == 2 * 82 * (2 + 4)


@pytest.mark.parametrize("bits", [2, 32])
def test_a_non_finite_value_arrives_as_one(bits):
    for bad in (math.nan, math.inf, -math.inf):
        x = torch.ones(5000)
        x[4500] = bad
        back = TopKCodec(0.01, bits).decode(TopKCodec(0.01, bits).encode(x), 5000)
        assert not torch.isfinite(back[4096:]).all() and torch.isfinite(back[:4096]).all()


# -- training against the reference ---------------------------------------------------------


def _train(compress=None, steps=8, workers=3, **kwargs):
    kwargs.setdefault("optimizer", SGD)
    return towers.train(
        wide_net(), mse, DATA, batch_size=10, steps=steps, workers=workers, compress=compress,
        shuffle=False, progress=False, **kwargs,
    )  # fmt: skip


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    ("spec", "share", "bits"), [("topk:0.02:2", 0.02, 2), ("topk:0.05", 0.05, 32)]
)
def test_topk_equals_the_same_arithmetic_in_one_process(spec, share, bits):
    # batches of 10 over 3 towers: shards of 4, 3, 3 (the epoch's last batch: 2, 2, 1)
    got = _train(spec, steps=9)
    want = Reference.run(functools.partial(sync_reference, share, bits, 9, 3))
    want.check(got.model)
    want.check_losses(got.losses)  # the metadata travels exactly
    assert got.skipped == []


@pytest.mark.timeout(120)
def test_a_share_close_to_one_at_32_bits_is_the_plain_sum():
    whole = _train("topk:0.9999")  # ceil(0.9999 * 4096) = 4096: every value, as it is
    # what the plain sum trains: the plain loop in one process (tests/exact.py's bound)
    want = Reference.of(wide_net(), DATA, batch_size=10, steps=8, optimizer=SGD, shuffle=False,
                        loss_fn=mse)  # fmt: skip
    want.check(whole.model)
    want.check_losses(whole.losses)


def _own_loop(steps, optimizer, mode, compress):
    """The own loop over ``steps`` batches; the parameters (a state dict)."""
    ctx = towers.init()
    model = ctx.replicate(wide_net(), mode=mode, compress=compress)
    opt = optimizer(model.parameters())
    for shard in ctx.shards(_batches(steps)):
        ctx.step(mse(model, shard), opt)
    ctx.end_period()  # sync mode: nothing to do
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    ctx.close()
    return state


@pytest.mark.timeout(120)
def test_every_rank_ends_with_the_same_parameters_to_the_last_bit():
    states = towers.spawn(_own_loop, 3, 6, SGD, "sync", "topk:0.02:2")
    assert all(torch.equal(states[0][k], s[k]) for s in states[1:] for k in states[0])
    Reference.run(functools.partial(sync_reference, 0.02, 2, 6, 3)).check(states[0])


@pytest.mark.timeout(120)
def test_a_resumed_topk_run_equals_an_uninterrupted_one(tmp_path):
    whole = _train("topk:0.02:2", steps=12, workers=2)
    _train("topk:0.02:2", steps=6, workers=2, checkpoint=tmp_path, checkpoint_every=6)
    resumed = _train("topk:0.02:2", steps=12, workers=2, checkpoint=tmp_path)
    # the same arithmetic in the same order, residuals included: the same bits
    for (name, p), q in zip(resumed.model.named_parameters(), whole.model.parameters()):
        assert torch.equal(p, q), name
    assert resumed.losses == whole.losses


# -- SparseLoCo -------------------------------------------------------------------------------


@pytest.mark.timeout(120)
def test_sparseloco_equals_sparseloco_in_one_process():
    got = _train(None, steps=9, mode="sparseloco:3", optimizer=INNER)
    want = Reference.run(functools.partial(sparseloco_reference, 3, 9, 3))
    want.check(got.model)
    want.check_losses(got.losses)
    assert got.mode == "sparseloco:3" and got.skipped == []
    spelled = _train(
        None, steps=9, mode="diloco:3", optimizer=INNER,
        transform=towers.transforms.topk(1 / 64, bits=2, decay=0.95),
        outer_optimizer=functools.partial(torch.optim.SGD, lr=1.0),
    )  # fmt: skip
    # the same arithmetic in the same order: the same bits
    pairs = zip(spelled.model.parameters(), got.model.parameters())
    assert all(torch.equal(p, q) for p, q in pairs)


@pytest.mark.timeout(120)
def test_the_own_loop_trains_sparseloco_too():
    states = towers.spawn(_own_loop, 3, 9, INNER, "sparseloco:3", None)
    want = Reference.run(functools.partial(sparseloco_reference, 3, 9, 3))
    for rank, state in enumerate(states):
        want.check(state, f"rank {rank}")


# -- refusals --------------------------------------------------------------------------------


def test_bad_topk_compressions_are_refused_before_any_worker_starts():
    for bad, message in (
        ("topk:0", r"compression 'topk' needs F, the share of each chunk's values sent "
                   r"\(0 < F < 1\); got 'topk:0'$"),
        ("topk:1.5", r"needs F, .* \(0 < F < 1\); got 'topk:1.5'$"),
        ("topk:1", r"needs F, .* \(0 < F < 1\); got 'topk:1'$"),
        ("topk:x", r"needs a number F"),
        ("topk:0.02:3", r"compression 'topk:0.02:3': BITS must be 2, 4, 8 or 32 "),
        ("topk:0.02:1", r"needs BITS, the bits of each value sent \(2, 4, 8 or 32\)"),
        ("topk:0.02:2:1", r"top-k compressions are written 'topk:F' or 'topk:F:BITS'$"),
    ):  # fmt: skip
        with pytest.raises(ValueError, match=message):
            compression(bad)
        with pytest.raises(ValueError, match=message):
            _train(bad)
    assert isinstance(compression("topk:0.02:2"), TopKSum)
    assert str(compression("topk:0.02:2")) == "topk:0.02:2"
    with pytest.raises(ValueError, match=r"compress= applies to mode='sync' and 'diloco:H'.* "
                                         r"mode 'async' sends every tower's gradient"):  # fmt: skip
        _train("topk:0.02", mode="async")
    own = r"mode 'sparseloco:4' sends its exchanges through its own compression .*"
    with pytest.raises(ValueError, match=own + r"train in mode='diloco:4' with compress="):
        _train("topk:0.02", mode="sparseloco:4")
    with pytest.raises(ValueError, match=r"mode 'sparseloco:4' .* drop transform="):
        _train(None, mode="sparseloco:4", transform=towers.transforms.allreduce())
