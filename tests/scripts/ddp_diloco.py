"""A DDP-style script under ``towers.ddp`` with ``mode="diloco:4"``: each rank draws its own
shard of the same global batches (tests/test_diloco.py's), ``loss.backward()`` stays on the
rank, its own Adam steps it alone, and every 4 steps the ranks take an outer step. Rank 0
saves the parameters after ``destroy_process_group`` (the last exchange) to OUT.

    towers run ddp_diloco.py -n 2 -- OUT
"""

import sys
from pathlib import Path

import torch
from torch.utils.data import DataLoader, TensorDataset

import towers
import towers.ddp as dist
from towers.ddp import DistributedDataParallel as DDP

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from helpers import make_net, mse, regression_data

STEPS, BATCH, SEED = 14, 10, 4

if __name__ == "__main__":
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    data = regression_data(47)
    loader = DataLoader(TensorDataset(*data), BATCH, shuffle=True,
                        generator=torch.Generator().manual_seed(SEED))  # fmt: skip
    batches = [b for _ in range(-(-STEPS // len(loader))) for b in loader][:STEPS]
    model = DDP(make_net(), mode="diloco:4")
    optimizer = torch.optim.Adam(model.parameters(), lr=0.03)
    for batch in batches:
        shard = towers.split(tuple(batch), world)[rank]  # this rank's own batch
        mse(model, shard).backward()
        optimizer.step()
        optimizer.zero_grad()
    dist.destroy_process_group()
    if rank == 0:
        torch.save(model.module.state_dict(), sys.argv[1])
