"""Reference implementations the tests compare towers against: plain single-process PyTorch."""

from __future__ import annotations

import importlib.util
import math
import os
import signal
import subprocess
from pathlib import Path
from types import ModuleType

import torch
from exact import Reference, as_float64
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from towers import split
from towers.core.split import cut

SCRIPTS = Path(__file__).parent / "scripts"


class Net(nn.Module):
    def __init__(self, d_in: int = 3, hidden: int = 8):
        super().__init__()
        self.fc1 = nn.Linear(d_in, hidden)
        self.fc2 = nn.Linear(hidden, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.tanh(self.fc1(x)))


def make_net(seed: int = 0) -> Net:
    torch.manual_seed(seed)
    return Net()


def mse(model: nn.Module, shard) -> torch.Tensor:
    x, y = shard
    return (model(x) - y).square().mean()


def dict_mse(model: nn.Module, shard) -> torch.Tensor:
    return (model(shard["x"]) - shard["y"]).square().mean()


def regression_data(n: int = 45, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 3, generator=g)
    y = (x[:, :1] * 2 - x[:, 1:2]).sin() + 0.1 * torch.randn(n, 1, generator=g)
    return x, y


def towers_holding(sample: int, samples: int, batch: int, workers: int, seed: int, epochs: int):
    """For each global batch of ``towers.train``'s shuffled order (DataLoader's, from ``seed``)
    over ``epochs`` epochs: the towers whose even shard holds ``sample`` (a step's culprits,
    where that sample is not finite)."""
    order = DataLoader(
        range(samples),
        batch_size=batch,
        shuffle=True,
        generator=torch.Generator().manual_seed(seed),
    )
    batches = [b for _ in range(epochs) for b in order]
    return [[i for i, s in enumerate(split(b, workers)) if sample in s.tolist()] for b in batches]


def reference_loop(
    model: nn.Module,
    data,
    *,
    batch_size: int,
    steps: int,
    optimizer,
    lr_schedule=None,
    seed: int = 0,
    shuffle: bool = True,
    loss_fn=mse,
    towers: int | None = None,
    shards: list[list[int]] | None = None,
):
    """A plain loop over DataLoader batches; skips a step whose loss or gradient isn't finite.

    Returns (losses, per-tower losses of the split batch if ``towers`` is given, skipped steps);
    ``shards``: each step's split (a ``TrainResult.shards``), instead of ``towers.split``'s.
    """
    dataset = TensorDataset(*data) if isinstance(data, tuple) else data
    loader = DataLoader(
        dataset,
        batch_size=batch_size,
        shuffle=shuffle,
        generator=torch.Generator().manual_seed(seed),
    )
    opt = optimizer(model.parameters())
    schedule = lr_schedule(opt) if lr_schedule else None
    losses, tower_losses, skipped = [], [], []
    it = iter(loader)
    for step in range(steps):
        try:
            batch = next(it)
        except StopIteration:
            it = iter(loader)
            batch = next(it)
        if towers is not None:
            with torch.no_grad():
                tower_losses.append(
                    [
                        loss_fn(model, s).item() if len(s[0]) else math.nan
                        for s in (
                            split(tuple(batch), towers)
                            if shards is None
                            else cut(tuple(batch), shards[step])
                        )
                    ]
                )
        opt.zero_grad()
        loss = loss_fn(model, batch)
        loss.backward()
        grads_ok = all(
            torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None
        )
        if math.isfinite(loss.item()) and grads_ok:
            opt.step()
        else:
            skipped.append(step)
        if schedule is not None:
            schedule.step()
        losses.append(loss.item())
    return losses, tower_losses, skipped


def assert_same_parameters(a: nn.Module, b: nn.Module, rtol: float = 1e-5, atol: float = 1e-6):
    for (name, p), q in zip(a.named_parameters(), b.parameters(), strict=True):
        torch.testing.assert_close(p.detach(), q.detach(), rtol=rtol, atol=atol, msg=name)


def assert_close_lists(got, expected, rtol: float = 1e-5, atol: float = 1e-7):
    assert len(got) == len(expected)
    for i, (g, e) in enumerate(zip(got, expected, strict=True)):
        if math.isnan(e):
            assert math.isnan(g), f"step {i}: {g} != nan"
        else:
            assert math.isclose(g, e, rel_tol=rtol, abs_tol=atol), f"step {i}: {g} != {e}"


def elastic_loop_reference(steps: int, batchnorm: bool = False) -> Reference:
    """tests/scripts/elastic_loop.py's training in one plain process, in float32 and float64."""
    script = load_script(SCRIPTS / "elastic_loop.py")

    def loop(dtype: torch.dtype) -> tuple[nn.Module, list[float]]:
        model = script.build(batchnorm).to(dtype)
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        losses = []
        for x, y in script.batches(steps):
            loss = torch.nn.functional.mse_loss(model(x.to(dtype)), y.to(dtype))
            losses.append(loss.item())
            opt.zero_grad()
            loss.backward()
            opt.step()
        return model, losses

    return Reference.run(loop)


def host_script_reference(script) -> Reference:
    """A two-host script's training (``build_model``, ``global_batches``, ``mse``: SGD with
    momentum, tests/scripts/two_hosts.py and hier_hosts.py) in one plain process, in float32
    and float64."""

    def loop(dtype: torch.dtype) -> tuple[nn.Module, list[float]]:
        model = script.build_model().to(dtype)
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        for batch in script.global_batches():
            opt.zero_grad()
            script.mse(model, as_float64(batch) if dtype == torch.float64 else batch).backward()
            opt.step()
        return model, []

    return Reference.run(loop)


def processes_mentioning(tmp: Path) -> list[int]:
    """Processes still running (not this one) whose command line names ``tmp``: a test's job."""
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and int(entry.name) != os.getpid():
            try:
                if str(tmp).encode() in (entry / "cmdline").read_bytes():
                    pids.append(int(entry.name))
            except OSError:
                pass
    return pids


def reap(nodes: list[subprocess.Popen[str]], tmp: Path) -> list[int]:
    """Kill the launchers in ``nodes`` still running and every other process whose command line
    names ``tmp``; returns the pids of the latter (a test asserts there were none)."""
    for node in nodes:
        if node.poll() is None:
            node.kill()
            node.communicate()
    left = processes_mentioning(tmp)
    for pid in left:
        os.kill(pid, signal.SIGKILL)
    return left


def saved_finals(out: Path) -> dict[int, dict]:
    """The final states that tests/scripts/elastic_loop.py's workers saved in ``out``
    (``final-RANK.pt``), by rank."""
    return {int(p.stem.split("-")[1]): torch.load(p) for p in out.glob("*.pt")}


def unused_port() -> int:
    """A port of 127.0.0.1 that nothing holds now, below the kernel's ephemeral range (from
    32768): a port picked inside that range can become an outgoing connection's local port (a
    store client's, a Gloo pair's) before the test's listener binds it."""
    import random
    import socket

    while True:
        port = random.randrange(20000, 32768)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        return port


def check_balanced_batches(
    saved: list[dict], global_batches: list[torch.Tensor], dataset: TensorDataset, make_model,
    lr: float, per_step: list[int] | None = None,
) -> list[float]:  # fmt: skip
    """Two ranks' batches under towers' balanced batch sampler, rank 1 the slower (each saved
    ``{"batches": [indices of each batch], "model": state dict}``): each step's batches
    together are its global batch (rank 0's part first), rank 0's share grew once both ranks
    were measured (above 60% on average over the last third of the batches), and both ranks
    end with the parameters of one process taking SGD steps of ``lr`` on the global batches
    (mean squared error; ``per_step``: how many global batches each step accumulates, each
    one's mean loss divided by the most a step holds, else one a step). Returns that process's
    loss summed over each global batch's samples, in float64."""
    steps = list(zip(saved[0]["batches"], saved[1]["batches"], strict=True))
    assert len(steps) == len(global_batches)
    for (mine, theirs), whole in zip(steps, global_batches):
        assert mine + theirs == whole.tolist() and mine and theirs
    assert [len(a) for a, _ in steps[:2]] == [len(b) for _, b in steps[:2]]  # even at first
    # the last third of the run: the split settles within about ten steps where nothing else
    # runs, more slowly beside a whole test suite (steps of two micro-batches: twenty batches)
    late = [len(a) / (len(a) + len(b)) for a, b in steps[2 * len(steps) // 3 :]]
    assert sum(late) / len(late) > 0.6, [(len(a), len(b)) for a, b in steps]

    def loop(dtype: torch.dtype) -> tuple[nn.Module, list[float]]:
        model = make_model().to(dtype)
        optimizer = torch.optim.SGD(model.parameters(), lr=lr)
        sums, at, most = [], 0, max(per_step or [1])
        for held in per_step or [1] * len(global_batches):
            for whole in global_batches[at : at + held]:
                x, y = (t.to(dtype) for t in dataset[whole][:2])
                loss = nn.functional.mse_loss(model(x), y)
                (loss / most).backward()
                sums.append(float(loss.detach()) * len(whole))
            at += held
            optimizer.step()
            optimizer.zero_grad()
        return model, sums

    reference = Reference.run(loop)
    for rank, state in enumerate(saved):
        reference.check(state["model"], f"rank {rank}")
    return reference.exact_losses


def load_script(path: Path) -> ModuleType:
    """A script's module, its ``main`` not run."""
    spec = importlib.util.spec_from_file_location(path.stem, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
