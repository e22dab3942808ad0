"""An own loop on CUDA, for ``torchrun --nproc-per-node 1`` (tests/test_gpu.py).

Trains the test MLP with ``ctx.step`` on ``towers.init(device=...)``'s device, averages a metric
with ``ctx.mean``, evaluates with ``ctx.evaluate``, writes an own-loop checkpoint and saves what
the test compares: the parameters, the losses, the device and the process group's backend.

    torchrun --nproc-per-node 1 tests/scripts/gpu_loop.py OUT.pt CHECKPOINT_DIR
"""

import sys

import torch
import torch.distributed as dist
from torch import nn

import towers


def build() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 1))


def data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(256, 16, generator=g)
    return x, x[:, :1].sin() + 0.1 * torch.randn(256, 1, generator=g)


def batches(x: torch.Tensor, y: torch.Tensor, size: int = 32):
    for at in range(0, len(x), size):
        yield x[at : at + size], y[at : at + size]


def loss_fn(model: nn.Module, batch) -> torch.Tensor:
    x, y = batch
    return (model(x) - y).square().mean()


def main(out: str, checkpoints: str) -> None:
    ctx = towers.init(device="cuda", timeout=60)
    model = ctx.replicate(build())
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    x, y = data()
    losses = []
    for shard in ctx.shards(batches(x, y)):
        losses.append(ctx.step(loss_fn(model, shard), opt).loss)
    metric = ctx.mean({"last": losses[-1]}, samples=32)
    evaluated = ctx.evaluate(model, (x, y), lambda m, b: {"loss": loss_fn(m, b)}, batch_size=64)
    ctx.save_checkpoint(checkpoints, ctx.steps, model, opt)
    torch.save(
        {
            "params": [p.detach().cpu() for p in model.parameters()],
            "losses": losses,
            "mean": metric["last"],
            "eval": evaluated["loss"],
            "device": str(ctx.device),
            "param_device": str(next(model.parameters()).device),
            "backend": dist.get_backend() if dist.is_initialized() else None,
        },
        out,
    )
    ctx.close()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
