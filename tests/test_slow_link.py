"""``towers compare --link RATE``: compressions against exact sums over a simulated slow link.

The simulated link (a gradient transform around the arm's own) must leave the numbers alone
and make each step wait at least as long as its bytes take at the rate; the command prints one
row per arm and refuses a rate it cannot read.
"""

from __future__ import annotations

import pytest
import torch

import towers
from towers.tools.cli import main
from towers.tools.slowlink import LINK_ARMS, OverLink, parse_rate
from towers.transforms import allreduce


def test_rates_are_read_in_tc_notation():
    assert parse_rate("100mbit") == 100e6
    assert parse_rate("1gbit") == 1e9
    assert parse_rate("2.5kbit") == 2500
    for bad in ("100", "100mb", "fast", "0mbit"):
        with pytest.raises(ValueError, match="like 100mbit"):
            parse_rate(bad)


def _wide():
    torch.manual_seed(0)
    return torch.nn.Linear(1000, 250)  # 250,250 parameters: about 1 MB of gradients


def _mse(model, shard):
    x, y = shard
    return (model(x) - y).square().mean()


@pytest.mark.timeout(120)
def test_the_simulated_link_delays_each_sum_by_its_bytes_and_changes_no_number():
    g = torch.Generator().manual_seed(1)
    data = (torch.randn(64, 1000, generator=g), torch.randn(64, 250, generator=g))
    # bit for bit: the even split (a balanced one follows timings, and its rounding with them)
    kw = {"batch_size": 32, "steps": 3, "workers": 2, "progress": False, "timeout": 60}
    kw |= {"balance": False}
    plain = towers.train(_wide(), _mse, data, **kw)
    rate = 40e6
    slow = towers.train(_wide(), _mse, data, transform=OverLink(allreduce(), rate), **kw)
    assert slow.losses == plain.losses
    for (name, p), q in zip(slow.model.state_dict().items(), plain.model.state_dict().values()):
        assert torch.equal(p, q), name
    # two workers: each sends the whole gradient (plus the step's few metadata values) a step
    link_seconds = 250_250 * 4 * 8 / rate
    assert slow.seconds >= 3 * link_seconds, (slow.seconds, link_seconds)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_compare_link_prints_every_arm_over_a_simulated_link(capsys):
    # 3 steps, fewer than the 5 between evaluations: each run is evaluated at its end
    assert main(["compare", "--link", "10gbit", "--steps", "3"]) == 0
    out = capsys.readouterr().out
    assert "SIMULATED link" in out
    rows = {line.split()[0]: line.split()[1:] for line in out.splitlines() if line.split()[:1]}
    for label, _ in LINK_ARMS:
        assert label in rows
    # PowerSGD trains twice the global batches, so that it can reach the exact run's loss
    assert rows["sync"][0] == "3" and rows["powersgd:4"][0] == "6", out


def test_compare_link_refuses_a_rate_it_cannot_read(capsys):
    assert main(["compare", "--link", "fast"]) == 2
    assert "like 100mbit" in capsys.readouterr().err
