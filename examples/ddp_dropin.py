"""A plain DDP training script on towers by its imports alone (``towers.ddp``).

Everything below is written as for ``torch.nn.parallel.DistributedDataParallel``: each rank
draws its own batches through a ``DistributedSampler``, ``loss.backward()`` sums the
gradients, the loop clips, steps and schedules as usual. The three lines marked ``# towers`` are
the whole port; with torch's imports in their place it is a DDP script again::

    -import torch.distributed as dist
    -from torch.nn.parallel import DistributedDataParallel as DDP
    -from torch.utils.data.distributed import DistributedSampler
    +import towers.ddp as dist
    +from towers.ddp import DistributedDataParallel as DDP
    +from towers.ddp import DistributedSampler

What changes: towers weights each rank by the samples of its batch and its sampler repeats no
sample, so the run equals one process training on the ranks' batches put together, at any
number of ranks, uneven last batch included (1001 samples do not divide by 2, 4 or the batch
size; one rank runs out a batch early, and waits in empty steps at the next ``set_epoch``).
DDP averages the ranks' means and pads the dataset with repeated samples.

Run it::

    towers run examples/ddp_dropin.py -n 2
    torchrun --nproc-per-node 4 examples/ddp_dropin.py
    python examples/ddp_dropin.py               # one process, no DDP
"""

import argparse
import os

import torch
import torch.nn as nn
from torch.utils.data import DataLoader, TensorDataset

import towers.ddp as dist  # towers
from towers.ddp import DistributedDataParallel as DDP  # towers
from towers.ddp import DistributedSampler  # towers


def make_dataset(n: int, seed: int = 0) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 12, generator=g)
    y = (x[:, :4].sum(1) > 0).long() + 2 * (x[:, 4:8].sum(1) > 0).long()
    return TensorDataset(x, y)


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(12, 32), nn.Tanh(), nn.Linear(32, 4))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--samples", type=int, default=1001)
    parser.add_argument("--batch-size", type=int, default=16, help="per rank")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--lr", type=float, default=0.2)
    parser.add_argument("--out", default=None, help="save the trained state_dict here")
    args = parser.parse_args()

    ddp = "RANK" in os.environ
    if ddp:
        dist.init_process_group("gloo")
        rank = dist.get_rank()
    else:
        rank = 0
    data = make_dataset(args.samples)
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    schedule = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.7)
    if ddp:
        model = DDP(model)
        sampler = DistributedSampler(data, shuffle=True, seed=1)
        loader = DataLoader(data, batch_size=args.batch_size, sampler=sampler)
    else:
        g = torch.Generator().manual_seed(1)
        loader = DataLoader(data, batch_size=args.batch_size, shuffle=True, generator=g)
    for epoch in range(args.epochs):
        if ddp:
            sampler.set_epoch(epoch)
        for x, y in loader:
            loss = nn.functional.cross_entropy(model(x), y)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            optimizer.zero_grad()
        schedule.step()

    with torch.no_grad():  # the mean loss over every sample, each counted once
        x, y = data.tensors
        part = slice(rank, None, dist.get_world_size()) if ddp else slice(None)
        total = torch.tensor(
            [nn.functional.cross_entropy(model(x[part]), y[part], reduction="sum"), len(y[part])]
        )
        if ddp:
            dist.all_reduce(total)
    if rank == 0:
        print(f"mean loss over {int(total[1])} samples: {total[0] / total[1]:.6f}")
        if args.out:
            raw = model.module if ddp else model
            torch.save(raw.state_dict(), args.out)
    if ddp:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
