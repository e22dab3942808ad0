"""PyTorch's DDP tutorial script ("Getting Started with Distributed Data Parallel": ToyModel,
an SGD loop with gradient clipping, a loss averaged over ranks), ported to towers' own loop.

The DDP original (70 lines, run with ``torchrun --nproc-per-node 2``) became the 66 lines below
(without this docstring and the self-check marked "added") by replacing 15 lines with 11:

- imports: ``torch.distributed``, ``DistributedDataParallel`` and ``DistributedSampler`` out,
  ``import towers`` in;
- ``dist.init_process_group("gloo")``, ``dist.get_rank()`` and ``get_world_size()`` became
  ``ctx = towers.init()`` and ``ctx.rank``; ``destroy_process_group()`` became ``ctx.close()``;
- ``DDP(model)`` became ``ctx.replicate(model)``;
- the ``DistributedSampler`` with a per-rank batch of ``batch_size // world_size`` became one
  shuffled ``DataLoader`` of global batches, seeded alike on every rank, and ``for x, y in
  loader`` became ``for x, y in ctx.shards(loader)`` (no ``sampler.set_epoch``);
- ``loss.backward()``, clipping and ``optimizer.step()`` stay as they are: on the model
  ``ctx.replicate`` returned, ``loss.backward()`` leaves the global batch's gradient in ``.grad``;
- the ``all_reduce`` of ``[loss sum, count]`` became ``ctx.mean({"loss": ...}, count)``.

What towers gives besides: any number of ranks computes the gradient of the whole global batch
(DDP divides by the number of ranks, biased when shards are uneven, and its result depends on
the number of ranks through the sampler's padding), so the clipping sees the full batch's
gradient norm and the script trains exactly as one process does. The lines after the port check
that: rank 0 repeats the training in a plain loop and exits non-zero unless the parameters
agree to a relative 1e-5.

Run it::

    towers run examples/ddp_tutorial.py -n 2
    torchrun --nproc-per-node 2 examples/ddp_tutorial.py
    python examples/ddp_tutorial.py              # one rank
"""

import argparse

import torch
import torch.nn as nn
import torch.optim as optim
from torch.utils.data import DataLoader, TensorDataset

import towers


class ToyModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.net1 = nn.Linear(10, 10)
        self.relu = nn.ReLU()
        self.net2 = nn.Linear(10, 5)

    def forward(self, x):
        return self.net2(self.relu(self.net1(x)))


def make_dataset(n, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 10, generator=g)
    y = torch.tanh(x[:, :5] * 2.0) + 0.1 * torch.randn(n, 5, generator=g)
    return TensorDataset(x, y)


def demo_basic(args):
    ctx = towers.init()
    rank = ctx.rank
    print(f"Start running basic DDP example on rank {rank}.")
    torch.manual_seed(args.seed)
    model = ToyModel()
    ddp_model = ctx.replicate(model)
    loss_fn = nn.MSELoss()
    optimizer = optim.SGD(ddp_model.parameters(), lr=args.lr, momentum=0.9)
    dataset = make_dataset(args.samples, args.seed)
    generator = torch.Generator().manual_seed(args.seed)
    loader = DataLoader(dataset, batch_size=args.batch_size, shuffle=True, generator=generator)
    for epoch in range(args.epochs):
        total, count = 0.0, 0
        for x, y in ctx.shards(loader):
            optimizer.zero_grad()
            loss = loss_fn(ddp_model(x), y)
            loss.backward()
            nn.utils.clip_grad_norm_(ddp_model.parameters(), args.max_norm)
            optimizer.step()
            total += loss.item() * len(x)
            count += len(x)
        stats = ctx.mean({"loss": total / count}, count)
        if rank == 0:
            print(f"epoch {epoch}: loss {stats['loss']:.4f}")
    if rank == 0:
        check_against_plain_loop(ddp_model, stats["loss"], args, ctx.world_size)  # added
    ctx.close()
    print(f"Finished running basic DDP example on rank {rank}.")


def check_against_plain_loop(trained, last_loss, args, ranks):
    """The same training in one process over the full global batches; exit non-zero if not."""
    torch.manual_seed(args.seed)
    model = ToyModel()
    optimizer = optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    generator = torch.Generator().manual_seed(args.seed)
    dataset = make_dataset(args.samples, args.seed)
    loader = DataLoader(dataset, batch_size=args.batch_size, shuffle=True, generator=generator)
    clipped = 0
    for _ in range(args.epochs):
        total, count = 0.0, 0
        for x, y in loader:
            optimizer.zero_grad()
            loss = nn.MSELoss()(model(x), y)
            loss.backward()
            norm = nn.utils.clip_grad_norm_(model.parameters(), args.max_norm)
            clipped += int(norm > args.max_norm)
            optimizer.step()
            total += loss.item() * len(x)
            count += len(x)
    for (name, p), q in zip(trained.named_parameters(), model.parameters()):
        if not torch.allclose(p.detach().cpu(), q.detach(), rtol=1e-5, atol=1e-6):
            diff = (p.detach().cpu() - q.detach()).abs().max().item()
            raise SystemExit(f"FAIL: {name} differs from the plain loop's by {diff:.2e}")
    if abs(last_loss - total / count) > 1e-5 * abs(total / count):
        raise SystemExit(f"FAIL: last epoch's loss {last_loss} != plain loop's {total / count}")
    print(f"OK: {ranks} rank(s) trained exactly as one process (clipped {clipped} steps)")


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--samples", type=int, default=300)
    parser.add_argument("--batch-size", type=int, default=30)
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--max-norm", type=float, default=0.25)
    parser.add_argument("--seed", type=int, default=0)
    demo_basic(parser.parse_args())
