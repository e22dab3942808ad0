"""Keep your own training loop and make it data-parallel with ``towers.init()``.

The script is an ordinary PyTorch loop with four additions: ``towers.init()`` joins the job,
``ctx.replicate`` gives every tower rank 0's weights, ``ctx.shards`` hands each tower its part of
every global batch, and ``ctx.step`` replaces ``backward(); optimizer.step(); zero_grad()`` with
the same plus a sample-weighted average of the gradients over all towers.

Run it, unchanged, any of these ways::

    towers run examples/own_loop.py -n 2
    torchrun --nproc-per-node 2 examples/own_loop.py
    python examples/own_loop.py                 # a single tower

Rank 0 then repeats the training in a plain single-process loop over the same global batches
and exits non-zero unless the parameters agree to a relative 1e-5: the towers computed exactly
the full-batch gradient, even though 31 samples do not split evenly.
"""

from __future__ import annotations

import argparse

import torch
from torch import nn

import towers

Batch = tuple[torch.Tensor, torch.Tensor]


def build_model() -> nn.Module:
    return nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 1))


def make_batches(steps: int, batch_size: int, seed: int) -> list[Batch]:
    """The global batches, drawn from ``seed``: every rank builds the same list."""
    g = torch.Generator().manual_seed(seed)
    batches = []
    for _ in range(steps):
        x = torch.randn(batch_size, 8, generator=g)
        y = (x[:, :1].sin() + x[:, 1:2] * x[:, 2:3]).detach()
        batches.append((x, y))
    return batches


def loss_fn(model: nn.Module, batch: Batch) -> torch.Tensor:
    x, y = batch
    return nn.functional.mse_loss(model(x), y)  # the mean over the batch or shard


def make_optimizer(model: nn.Module, lr: float) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)


def plain_loop(model: nn.Module, batches: list[Batch], lr: float) -> None:
    """The loop this script started as, before it was made parallel."""
    opt = make_optimizer(model, lr)
    for batch in batches:
        loss = loss_fn(model, batch)
        loss.backward()
        opt.step()
        opt.zero_grad()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=100, help="global batches")
    parser.add_argument("--batch-size", type=int, default=31, help="samples per global batch")
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    ctx = towers.init()
    try:
        # Each rank starts from different random weights on purpose: replicate() replaces them
        # with rank 0's, so the towers train one model.
        torch.manual_seed(args.seed + ctx.rank)
        model = ctx.replicate(build_model())
        start = {k: v.detach().clone() for k, v in model.state_dict().items()}
        opt = make_optimizer(model, args.lr)
        batches = make_batches(args.steps, args.batch_size, args.seed)

        losses = []
        for step, shard in enumerate(ctx.shards(batches)):
            r = ctx.step(loss_fn(model, shard), opt)  # weighted by this shard's sample count
            losses.append(r.loss)
            if ctx.is_main and (step % 20 == 0 or step == args.steps - 1):
                towers_ = " ".join(f"{t:.4f}" for t in r.tower_losses)
                print(f"step {step:4d}  loss {r.loss:.4f}  towers [{towers_}]", flush=True)
        if not ctx.is_main:
            return

        reference = build_model()
        reference.load_state_dict(start)
        plain_loop(reference, batches, args.lr)
        for (name, p), q in zip(model.named_parameters(), reference.parameters()):
            if not torch.allclose(p.detach().cpu(), q.detach(), rtol=1e-5, atol=1e-6):
                diff = (p.detach().cpu() - q.detach()).abs().max().item()
                raise SystemExit(f"FAIL: {name} differs from the plain loop's by {diff:.2e}")
        if not losses[-1] < 0.5 * losses[0]:
            raise SystemExit(f"FAIL: the loss did not drop: {losses[0]:.4f} -> {losses[-1]:.4f}")
        print(f"OK: {ctx.world_size} tower(s) match the plain loop over the same global batches")
    finally:
        ctx.close()


if __name__ == "__main__":
    main()
