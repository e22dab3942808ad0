"""One rank of an arm of ``benchmarks/two_hosts.py``, started there under ``torchrun``.

    torchrun ... two_hosts_worker.py ARM_JSON OUT LINK

The problem (the arm's ``problem``, a key of :data:`PROBLEMS`); every arm of a problem starts
from the same weights and trains the same global batches, in DataLoader's order from seed 0,
with the held-out loss every ``eval_every`` global batches and at the end:

- ``mlp``: the 784-1024-1024-10 MLP (:func:`towers.tools.zoo.mlp`) on the digits upscaled to
  28x28 (:func:`~towers.tools.zoo.digits_flat`), the first 1497 of a fixed permutation to
  train on and the other 300 held out; global batches of 256, SGD lr 0.05 momentum 0.9.
- ``gpt``: a character-level GPT (``benchmarks/gpu_check.py``'s decoder, 4 layers, 4 heads,
  128 wide, 0.81 M parameters, tied embeddings) on the first million characters of the
  standard library's top-level ``.py`` files in name order (nothing is downloaded; the
  vocabulary is the text's characters). The first 90% is cut into rows of 65 characters
  (64 inputs, each with the next as target) to train on; 64 rows spread evenly over the last
  10% are held out (4096 predictions). Global batches of 32 rows (2048 predicted characters),
  AdamW lr 1e-3.

An arm is a dict: ``{"train": {...}}`` is ``towers.train(**...)``'s keywords over this
problem (any of them: ``compress``, ``transport``, ``mode``...); ``{"ddp": "plain" |
"powersgd:R" | "powersgd-1bucket:R" | "postlocal:P"}`` is DistributedDataParallel over Gloo,
plain, with ``powerSGD_hook`` (default buckets, or every gradient in one bucket), or with
``post_localSGD_hook`` and ``PostLocalSGDOptimizer`` averaging parameters every P steps;
``"zero"`` is torch's ``ZeroRedundancyOptimizer`` over DDP, and ``"ported-zero"`` the same
script on ``towers.ddp``'s names (its ``DistributedDataParallel`` and
``ZeroRedundancyOptimizer``).
``{"lightning": "ddp" | {...}}`` is a LightningModule fitted by a Trainer with Lightning's
``ddp`` strategy or ``TowersStrategy(**...)`` (``mode``, ``compress``, ...), one node per host.

Rank 0 counts the bytes through its end of the link between the hosts (LINK: sent and
received) after every global batch, and writes the run to OUT as JSON: per global batch the
seconds since the loop started and the bytes so far; the held-out losses; or the error. In
towers arms the counting is done by the learning-rate schedule (a constant one: ``LambdaLR``
at factor 1), the one place ``towers.train`` calls back once per global batch; an arm that
brings its own ``lr_schedule`` keeps it and is not counted per batch.
"""

from __future__ import annotations

import functools
import json
import os
import sys
import sysconfig
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, TensorDataset

import towers
import towers.ddp
from towers.tools.zoo import cross_entropy, digits_flat, mlp

LINK = ""  # this host's end of the link
TICKS: dict[int, tuple[float, int]] = {}  # global batches done -> (perf_counter, bytes so far)


def crossed() -> int:
    """Bytes sent and received through this host's end of the link so far."""
    stats = Path("/sys/class/net", LINK, "statistics")
    return sum(int((stats / f"{d}_bytes").read_text()) for d in ("tx", "rx"))


def tick(done: int) -> None:
    if int(os.environ.get("RANK", "0")) == 0:
        TICKS[done] = (time.perf_counter(), crossed())


def counted(done: int) -> float:
    """The constant schedule that counts: called by ``LambdaLR`` once per global batch."""
    tick(done)
    return 1.0


def counting_schedule(opt: torch.optim.Optimizer) -> Any:
    return torch.optim.lr_scheduler.LambdaLR(opt, counted)


@dataclass(frozen=True)
class Problem:
    data: tuple[torch.Tensor, ...]  # to train on
    held: tuple[torch.Tensor, ...]  # held out
    model: Callable[[], torch.nn.Module]  # the same initial weights at every call
    loss: Callable[[torch.nn.Module, tuple[torch.Tensor, ...]], torch.Tensor]
    optimizer: Callable[..., torch.optim.Optimizer]
    batch: int  # samples per global batch


def digits() -> Problem:
    x, y = digits_flat()
    order = torch.randperm(len(x), generator=torch.Generator().manual_seed(0))
    train, held = order[: len(x) - 300], order[len(x) - 300 :]

    def model() -> torch.nn.Module:
        torch.manual_seed(0)
        return mlp()

    sgd = functools.partial(torch.optim.SGD, lr=0.05, momentum=0.9)
    return Problem((x[train], y[train]), (x[held], y[held]), model, cross_entropy, sgd, 256)


def text(chars: int = 1_000_000, block: int = 64) -> Problem:
    from gpu_check import GPT, Size, loss_fn  # its decoder, and next-character cross-entropy

    parts, size = [], 0
    for path in sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py")):
        parts.append(path.read_text(encoding="utf-8", errors="replace"))
        size += len(parts[-1])
        if size >= chars:
            break
    source = "".join(parts)[:chars]
    vocab = {c: i for i, c in enumerate(sorted(set(source)))}
    ids = torch.tensor([vocab[c] for c in source])
    cut = int(0.9 * len(ids))
    # each row's last character is the next row's first: every character is predicted once
    rows = ids[:cut].unfold(0, block + 1, block).contiguous()
    tail = ids[cut:].unfold(0, block + 1, block)
    held = tail[torch.linspace(0, len(tail) - 1, 64).long()]
    shape = Size(vocab=len(vocab), block=block, layers=4, heads=4, width=128, batch=32)

    def model() -> torch.nn.Module:
        torch.manual_seed(0)
        return GPT(shape)

    adamw = functools.partial(torch.optim.AdamW, lr=1e-3)
    return Problem((rows,), (held,), model, loss_fn, adamw, shape.batch)


PROBLEMS: dict[str, Callable[[], Problem]] = {"mlp": digits, "gpt": text}


def run_towers(p: Problem, arm: dict[str, Any], steps: int, every: int) -> dict[str, Any]:
    keywords = {"lr_schedule": counting_schedule} | arm["train"]
    workers = int(os.environ["WORLD_SIZE"])
    result = towers.train(
        p.model(), p.loss, p.data, batch_size=p.batch, steps=steps, workers=workers,
        optimizer=p.optimizer, seed=0, progress=False, timeout=300, eval_data=p.held,
        eval_every=every, **keywords,
    )  # fmt: skip
    done = range(1, steps + 1)
    counts = [TICKS[k][1] for k in done] if all(k in TICKS for k in done) else []
    return {
        "times": result.times,
        "bytes": counts,
        "evals": [(k, m["loss"]) for k, m in result.evals],
        "losses": result.losses,
    }


def _ddp_model(p: Problem, kind: str) -> tuple[Any, torch.optim.Optimizer]:
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as psgd
    from torch.nn.parallel import DistributedDataParallel

    name, _, arg = kind.partition(":")
    if name == "ported-zero":  # the same script on towers.ddp's names
        model = towers.ddp.DistributedDataParallel(p.model(), bucket_cap_mb=25)
        opt = p.optimizer(model.parameters())
        zero = towers.ddp.ZeroRedundancyOptimizer
        return model, zero(model.parameters(), optimizer_class=type(opt), **opt.defaults)
    one_bucket = name == "powersgd-1bucket"
    ddp = DistributedDataParallel(p.model(), bucket_cap_mb=100 if one_bucket else 25)
    opt = p.optimizer(ddp.parameters())
    if name in ("powersgd", "powersgd-1bucket"):
        state = psgd.PowerSGDState(None, matrix_approximation_rank=int(arg), start_powerSGD_iter=10)
        ddp.register_comm_hook(state, psgd.powerSGD_hook)
    elif name == "postlocal":
        from torch.distributed.algorithms.ddp_comm_hooks.post_localSGD_hook import (
            PostLocalSGDState,
            post_localSGD_hook,
        )
        from torch.distributed.algorithms.model_averaging.averagers import PeriodicModelAverager
        from torch.distributed.optim import PostLocalSGDOptimizer

        # new_subgroups() alone refuses CPU ("Default group size only takes effect when CUDA
        # is available"): the local steps sum within each host
        local, _ = dist.new_subgroups(group_size=int(os.environ["LOCAL_WORLD_SIZE"]))
        state = PostLocalSGDState(None, subgroup=local, start_localSGD_iter=10)
        ddp.register_comm_hook(state, post_localSGD_hook)
        averager = PeriodicModelAverager(period=int(arg), warmup_steps=10)
        opt = PostLocalSGDOptimizer(optim=opt, averager=averager)
    elif name == "zero":  # torch's ZeroRedundancyOptimizer: each rank steps whole parameters
        from torch.distributed.optim import ZeroRedundancyOptimizer

        opt = ZeroRedundancyOptimizer(ddp.parameters(), optimizer_class=type(opt), **opt.defaults)
    elif name != "plain":
        raise ValueError(f"unknown DDP arm {kind!r}")
    return ddp, opt


def run_ddp(p: Problem, kind: str, steps: int, every: int) -> dict[str, Any]:
    """DDP over the same global batches (each split with towers.split, as towers splits them)."""
    os.environ["GLOO_SOCKET_IFNAME"] = LINK
    on = towers.ddp if kind.startswith("ported") else dist
    on.init_process_group("gloo")
    rank, world = on.get_rank(), on.get_world_size()
    ddp, opt = _ddp_model(p, kind)
    loader = DataLoader(
        TensorDataset(*p.data), batch_size=p.batch, shuffle=True,
        generator=torch.Generator().manual_seed(0),
    )  # fmt: skip
    record, batches = new_record(), iter(())
    on.barrier()
    start = time.perf_counter()
    for k in range(1, steps + 1):
        batch = next(batches, None)
        if batch is None:
            batches = iter(loader)
            batch = next(batches)
        shard = towers.split(tuple(batch), world)[rank]
        opt.zero_grad(set_to_none=True)
        p.loss(ddp, shard).backward()
        opt.step()
        stepped(record, k, start, p, ddp.module, every, steps, rank)
    on.barrier()
    on.destroy_process_group()
    return record


def new_record() -> dict[str, Any]:
    """An arm's record of a loop of its own, filled by :func:`stepped`."""
    return {"times": [], "bytes": [], "evals": [], "losses": []}


def stepped(
    record: dict[str, Any], k: int, start: float, p: Problem, model: torch.nn.Module,
    every: int, steps: int, rank: int,
) -> None:  # fmt: skip
    """Global batch ``k`` is done (the loop began at ``start``): its time and bytes, and rank
    0's held-out loss every ``every`` global batches and at the last."""
    if rank == 0 and (k % every == 0 or k == steps):
        with torch.no_grad():
            record["evals"].append((k, float(p.loss(model, p.held))))
    tick(k)
    record["times"].append(time.perf_counter() - start)
    record["bytes"].append(TICKS[k][1] if rank == 0 else 0)


def run_lightning(p: Problem, arm: dict[str, Any], steps: int, every: int) -> dict[str, Any]:
    """A LightningModule over the problem, fitted by a Trainer under this torchrun (one node
    per host): Lightning's own ``ddp``, or ``TowersStrategy(**arm["lightning"])``. Each rank
    brings its part of the global batch from Lightning's distributed sampler (seed 0)."""
    import lightning.pytorch as pl

    from towers.lightning import TowersStrategy

    os.environ["GLOO_SOCKET_IFNAME"] = LINK
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    record = new_record()

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = p.model()

        def training_step(self, batch: Any, index: int) -> torch.Tensor:
            return p.loss(self.model, tuple(batch))

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return p.optimizer(self.parameters())

    class Clock(pl.Callback):
        """Each global batch's time and bytes, and rank 0's held-out loss every ``every``."""

        def on_train_start(self, trainer: Any, module: Any) -> None:
            self.start = time.perf_counter()

        def on_train_batch_end(self, trainer: Any, module: Any, *args: Any) -> None:
            stepped(record, trainer.global_step, self.start, p, module.model, every, steps, rank)

    kind = arm["lightning"]
    trainer = pl.Trainer(
        strategy="ddp" if kind == "ddp" else TowersStrategy(**kind),
        accelerator="cpu",
        devices=int(os.environ["LOCAL_WORLD_SIZE"]),
        num_nodes=world // int(os.environ["LOCAL_WORLD_SIZE"]),
        max_steps=steps,
        callbacks=[Clock()],
        logger=False,
        enable_progress_bar=False,
        enable_checkpointing=False,
        enable_model_summary=False,
    )
    loader = DataLoader(TensorDataset(*p.data), batch_size=p.batch // world, shuffle=True)
    trainer.fit(Module(), loader)
    return record


def main() -> None:
    global LINK
    torch.set_num_threads(1)
    arm, out, LINK = json.loads(sys.argv[1]), sys.argv[2], sys.argv[3]
    steps, every = arm["steps"], arm["eval_every"]
    try:
        p = PROBLEMS[arm.get("problem", "mlp")]()
        if "ddp" in arm:
            record = run_ddp(p, arm["ddp"], steps, every)
        elif "lightning" in arm:
            record = run_lightning(p, arm, steps, every)
        else:
            record = run_towers(p, arm, steps, every)
    except Exception as exc:
        lines = str(exc).strip().splitlines() or [""]
        record = {"error": f"{type(exc).__name__}: {lines[0][:400]}"}
        if int(os.environ["RANK"]) == 0:
            Path(out).write_text(json.dumps(record))
        raise
    if int(os.environ["RANK"]) == 0:
        Path(out).write_text(json.dumps(record))


if __name__ == "__main__":
    main()
