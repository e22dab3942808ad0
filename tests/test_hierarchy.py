"""Sums in two levels across hosts: within each host, among one leader per host, then shared.

On one machine, four local workers are told that ranks {0, 2} and {1, 3} are two hosts
(``two_levels`` with that grouping): the sums and the own loop's steps are compared with flat
sums and a plain single-process loop (in float32 and float64 over the same batches, within
tests/exact.py's bound). On two network-namespace hosts with their own host names
and /dev/shm (tests/netns.py), ``torchrun --nnodes 2 --nproc-per-node 2`` picks the two levels
by itself, trains like one process, runs the job's gradient transform among the leaders only,
and sends fewer bytes between the hosts than the same job summed flat over Gloo.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from exact import Reference, as_float64, states
from helpers import host_script_reference
from netns import two_hosts

import towers
from towers.comm.group import connect
from towers.comm.hang import CallMismatch
from towers.comm.hierarchy import by_host, two_levels
from towers.core.launch import read_launch
from towers.engines.sync.group import PlainGroup
from towers.transforms import allreduce

SCRIPTS = Path(__file__).parent / "scripts"
SRC = str(Path(__file__).resolve().parents[1] / "src")
PRETEND = [[0, 2], [1, 3]]  # two "hosts" of two ranks each, on this machine


def test_by_host_groups_ranks_by_host_in_order_of_their_lowest_rank():
    assert by_host(["b", "a", "b", "c", "a"]) == [[0, 2], [1, 4], [3]]
    assert by_host(["h", "h"]) == [[0, 1]]


# -- four local workers told that they are on two hosts ----------------------------------------


class Recording:
    """A plain sum that writes down how many ranks each bucket was summed over."""

    def __init__(self):
        self.seen = []

    def init(self, layouts):
        return None

    def reduce(self, state, bucket, comm):
        self.seen.append(comm.world_size)
        return allreduce().reduce(state, bucket, comm)


def _net():
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(3, 40), torch.nn.Tanh(), torch.nn.Linear(40, 40), torch.nn.Tanh(),
        torch.nn.Linear(40, 1),
    )  # fmt: skip


def _mse(model, shard):
    x, y = shard
    return (model(x) - y).square().mean()


def _batches(steps=5, size=13):
    g = torch.Generator().manual_seed(2)
    x, y = torch.randn(steps * size, 3, generator=g), torch.randn(steps * size, 1, generator=g)
    return list(zip(x.split(size), y.split(size), strict=True))


def _sums(comm):
    """Two sums in flight at once, one of them on a lent buffer, and an object gather between."""
    rank = comm.rank
    g = torch.Generator().manual_seed(rank)
    # whole numbers: every order of summation gives the same bits
    a = torch.randint(-1000, 1000, (100_003,), generator=g).float()
    lent = comm.buffer(70_001, torch.float32)
    b = lent if lent is not None else torch.empty(70_001)
    b.copy_(torch.randint(-1000, 1000, (70_001,), generator=g).float())
    inputs = (a.clone(), b.clone())
    works = [comm.all_reduce_sum(a), comm.all_reduce_sum(b)]
    ranks = comm.all_gather_object(rank)  # completes the pending sums first
    for w in works:
        w.wait()
    everyone = comm.all_gather_object(inputs)
    expected = [sum(x[i] for x in everyone) for i in range(2)]
    return ranks, lent is not None, all(torch.equal(s, e) for s, e in zip((a, b), expected))


def _pretend_hosts_worker():
    torch.set_num_threads(1)
    conn = connect(read_launch(), timeout=30, transport="gloo")
    conn.comm = two_levels(conn.comm, PRETEND, 30)
    ctx = towers.Context(PlainGroup(conn))
    levels = ctx.comm.levels
    out = {"levels": (levels.hosts, levels.leaders is not None), "sums": _sums(ctx.comm)}
    for name, options in (("plain", {}), ("int8", {"compress": "int8"})):
        recording = Recording()
        if not options:
            options = {"transform": recording}
        model = ctx.replicate(_net(), bucket_bytes=4096, **options)  # several buckets
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        results = [ctx.step(_mse(model, s), opt) for s in ctx.shards(_batches())]
        out[name] = {
            "params": {k: v.detach().clone() for k, v in model.state_dict().items()},
            "losses": [r.loss for r in results],
            "tower_losses": [r.tower_losses for r in results],
            "seen": recording.seen,
        }
    ctx.close()
    return out


@pytest.mark.timeout(120)
def test_two_levels_sum_and_train_like_one_process():
    outs = towers.spawn(_pretend_hosts_worker, 4, timeout=90)
    leaders = {0, 1}  # the lowest rank of each pretend host
    for rank, out in enumerate(outs):
        assert out["levels"] == (2, rank in leaders)
        ranks, lent, equal = out["sums"]
        assert ranks == [0, 1, 2, 3] and lent and equal, (rank, out["sums"])

    reference = _plain_loop()
    for rank, out in enumerate(outs):
        plain = out["plain"]
        reference.check(plain["params"], f"rank {rank}")
        reference.check_losses(plain["losses"], f"rank {rank}")
        reference.check_tower_losses(plain["tower_losses"], f"rank {rank}")
        # the transform runs on the leaders only, among the two of them, for every bucket
        assert plain["seen"] == (outs[0]["plain"]["seen"] if rank in leaders else [])
        # int8 among the leaders; the metadata exact: step 0's losses, per tower too, are the
        # plain run's to the last bit (the same model, shards and arithmetic)
        coded = out["int8"]
        assert coded["losses"][0] == plain["losses"][0]
        assert coded["tower_losses"][0] == plain["tower_losses"][0]
        # lossy by design: int8 rounds each value to 1/254 of its chunk's largest magnitude
        # (test_compression.py's round trip); over 5 steps of SGD the losses stay within 5% of
        # the plain loop's (measured: 0.03%), while they move by 12-170% from step to step
        for step, (got, want) in enumerate(zip(coded["losses"], reference.losses, strict=True)):
            assert abs(got - want) <= 0.05 * abs(want), (
                f"rank {rank}, step {step}: int8's loss {got:.6g} is more than 5% from the "
                f"plain loop's {want:.6g}"
            )
    seen = outs[0]["plain"]["seen"]
    assert len(seen) > len(reference.losses) and set(seen) == {2}  # buckets a step, 2 ranks each
    for out in outs[1:]:  # every rank holds the same parameters, bit for bit
        for name, a in out["int8"]["params"].items():
            assert torch.equal(a, outs[0]["int8"]["params"][name]), name


def _plain_loop() -> Reference:
    """The plain loop over ``_batches()`` (SGD with momentum, per-tower losses of the split
    batch), in float32 and in float64."""
    runs = {}
    for dtype in (torch.float32, torch.float64):
        model = _net().to(dtype)
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        losses, tower_losses = [], []
        for batch in _batches():
            batch = as_float64(batch) if dtype == torch.float64 else batch
            with torch.no_grad():
                tower_losses.append([_mse(model, s).item() for s in towers.split(batch, 4)])
            opt.zero_grad()
            loss = _mse(model, batch)
            loss.backward()
            opt.step()
            losses.append(loss.item())
        runs[dtype] = model, losses, tower_losses
    (single, losses, tower_losses), (exact, exact_losses, exact_tower_losses) = runs.values()
    return Reference(
        states(single), states(exact), losses, exact_losses, tower_losses, exact_tower_losses
    )


def _rank0_only_mean():
    """rank 0 logs a metric through ctx.mean alone while the others step: on two pretend hosts."""
    torch.set_num_threads(1)
    conn = connect(read_launch(), timeout=5, transport="gloo")
    conn.comm = two_levels(conn.comm, PRETEND, 5)
    ctx = towers.Context(PlainGroup(conn))
    model = ctx.replicate(_net())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for shard in ctx.shards(_batches(steps=2, size=8)):
        r = ctx.step(_mse(model, shard), opt)
        if ctx.rank == 0:
            ctx.mean({"loss": r.loss}, samples=2)
    ctx.close()


@pytest.mark.timeout(90)
def test_two_levels_name_the_calls_when_one_rank_calls_alone():
    with pytest.raises(CallMismatch) as info:
        towers.spawn(_rank0_only_mean, 4, timeout=60)
    text = str(info.value)
    # whichever rank reports it: rank 0 in ctx.mean, another rank in the next step
    assert "the ranks made different calls" in text and "rank 0 in ctx.mean(['loss'])" in text
    assert "in ctx.step (step 1)" in text, text


# -- two hosts of their own ----------------------------------------------------------------------


def torchrun(host, master, rank: int, out: Path) -> subprocess.Popen[str]:
    args = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node-rank",
            str(rank), "--nproc-per-node", "2", "--master-addr", master.addr, "--master-port",
            "29531", str(SCRIPTS / "hier_hosts.py"), str(out), host.link]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if not k.startswith(("GLOO_", "MASTER_", "TOWERS_"))}
    env |= {"PYTHONPATH": SRC, "OMP_NUM_THREADS": "1"}
    return host.popen(args, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_two_hosts_of_two_workers_sum_in_two_levels(tmp_path):
    out = tmp_path / "result.pt"
    with two_hosts(own=True) as (a, b):
        nodes = [torchrun(a, a, 0, out), torchrun(b, a, 1, out)]
        logs = []
        for node in nodes:
            try:
                logs.append(node.communicate(timeout=200)[0])
            finally:
                if node.poll() is None:
                    node.kill()
                    node.communicate()
        for node, log in zip(nodes, logs, strict=True):
            assert node.returncode == 0, log[-3000:]
    got = torch.load(out, weights_only=True)
    # ranks 0, 1 on the first host, 2, 3 on the second; leaders 0 and 2
    assert got["levels"] == [(2, True), (2, False), (2, True), (2, False)]
    assert got["seen"] == [[(2, True)] * 4, [], [(2, True)] * 4, []]

    sys.path.insert(0, str(SCRIPTS))
    try:
        import hier_hosts as script
    finally:
        sys.path.remove(str(SCRIPTS))

    # the own loop in two levels and flat over Gloo sum in different orders: each against the
    # plain loop in float64
    reference = host_script_reference(script)
    reference.check(got["loop"], "the own loop in two levels")
    reference.check(got["flat_loop"], "the own loop, flat over Gloo")

    sgd = functools.partial(torch.optim.SGD, lr=0.01)
    reference = Reference.of(
        script.build_model(), script.data(), batch_size=10, steps=4, optimizer=sgd, seed=4,
        loss_fn=script.mse, towers=4,
    )  # fmt: skip
    reference.check_losses(got["losses"])
    reference.check(got["train"])
    # int8 between the hosts; the metadata exact: step 0's loss is the plain run's to the last
    # bit (the same model, shards and arithmetic), its tower losses the plain loop's
    assert got["coded_losses"][0] == got["losses"][0]
    first = dataclasses.replace(
        reference,
        tower_losses=reference.tower_losses[:1],
        exact_tower_losses=reference.exact_tower_losses[:1],
    )
    first.check_tower_losses(got["coded_tower_losses"][:1], "int8, step 0")

    # between the hosts: one sum among two leaders instead of one among four ranks
    hier, flat = got["bytes"]["hier"], got["bytes"]["flat"]
    grads = sum(v.numel() for v in reference.model.values()) * 4 * script.STEPS
    assert hier < flat, got["bytes"]
    assert hier < 2.5 * grads, (got["bytes"], grads)  # tx and rx: about twice the gradients
