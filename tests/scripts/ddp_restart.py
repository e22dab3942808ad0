"""A DDP script on towers by its imports that checkpoints every step and resumes from its
checkpoint when it is started again, as scripts run under ``torchrun --max-restarts`` do.

    towers run ddp_restart.py -n 2 --max-restarts 1 -- OUT [KILL_AT]

Rank 0 saves the model, the optimizer and the step after every step to ``OUT/checkpoint.pt``
(written to a temporary name, then renamed). With ``KILL_AT``, rank 1 of the first attempt
kills itself with ``SIGKILL`` when it reaches that step: the worker is lost as if its host had
taken it. Each attempt appends ``attempt A started at step S`` to ``OUT/attempts-R.txt``, and
rank 0 saves the final parameters to ``OUT/final.pt``.
"""

import os
import signal
import sys
from pathlib import Path

import torch
import torch.nn as nn
from torch.utils.data import DataLoader, TensorDataset

import towers.ddp as dist
from towers.ddp import DistributedDataParallel as DDP
from towers.ddp import DistributedSampler

SAMPLES, BATCH, EPOCHS = 96, 8, 2


def data() -> TensorDataset:
    g = torch.Generator().manual_seed(5)
    x = torch.randn(SAMPLES, 4, generator=g)
    return TensorDataset(x, x[:, :1] - 0.5 * x[:, 1:2] + 0.1 * torch.randn(SAMPLES, 1, generator=g))


def main(out: Path, kill_at: int | None) -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    torch.manual_seed(0)
    model = DDP(nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 1)))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.02, weight_decay=0.1)
    dataset = data()
    sampler = DistributedSampler(dataset, seed=1)
    loader = DataLoader(dataset, batch_size=BATCH, sampler=sampler)
    path, step = out / "checkpoint.pt", 0
    if path.exists():
        saved = torch.load(path)
        model.module.load_state_dict(saved["model"])
        optimizer.load_state_dict(saved["optimizer"])
        step = saved["step"]
    with open(out / f"attempts-{rank}.txt", "a") as log:
        log.write(f"attempt {attempt} started at step {step}\n")
    per_epoch = len(loader)
    for epoch in range(step // per_epoch, EPOCHS):
        sampler.set_epoch(epoch)
        for k, (x, y) in enumerate(loader):
            if epoch * per_epoch + k < step:
                continue  # trained before the restart
            if kill_at is not None and attempt == 0 and rank == 1 and step == kill_at:
                os.kill(os.getpid(), signal.SIGKILL)
            loss = nn.functional.mse_loss(model(x), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            step += 1
            if rank == 0:
                state = {"model": model.module.state_dict(), "optimizer": optimizer.state_dict()}
                torch.save({**state, "step": step}, out / "checkpoint.tmp")
                os.replace(out / "checkpoint.tmp", path)
            dist.barrier()  # the checkpoint of this step is on disk before the next one starts
    if rank == 0:
        torch.save(model.module.state_dict(), out / "final.pt")
    dist.destroy_process_group()


if __name__ == "__main__":
    torch.set_num_threads(1)
    main(Path(sys.argv[1]), int(sys.argv[2]) if len(sys.argv) > 2 else None)
