"""A DDP script with torch's ``ZeroRedundancyOptimizer``, on towers by its imports: AdamW with
weight decay and the gradient's norm clipped, over rank-strided batches of 16 (torch's order,
unpadded: 203 samples make 6 global batches of 32 and one of 11).

    towers run ddp_zero.py -n 2 -- OUT first|resume|frozen

``first`` trains the first 4 steps, consolidates the optimizer's state on rank 0, which saves
it with the parameters to ``OUT/first.pt``; every rank saves the state elements it holds to
``OUT/held-R.pt``. ``resume`` loads ``OUT/first.pt`` on every rank and trains the other 3 steps;
rank 0 saves the parameters to ``OUT/resume.pt``. ``frozen`` freezes the first bias after
wrapping the model and trains all 7 steps; rank 0 saves the parameters to ``OUT/frozen.pt``.
"""

import sys
from pathlib import Path

import torch
import torch.nn as nn
from torch.utils.data import DataLoader, TensorDataset

import towers.ddp as dist
from towers.ddp import DistributedDataParallel as DDP
from towers.ddp import DistributedSampler, ZeroRedundancyOptimizer

SAMPLES, BATCH, FIRST, LR, DECAY, CLIP = 203, 16, 4, 0.01, 0.1, 0.05


def data() -> TensorDataset:
    g = torch.Generator().manual_seed(3)
    x = torch.randn(SAMPLES, 6, generator=g)
    return TensorDataset(x, x[:, :2] * 0.5 - x[:, 2:4] + 0.1 * torch.randn(SAMPLES, 2, generator=g))


def make_model() -> nn.Module:
    """578 parameters: on 2 ranks the cut falls inside the first weight (at element 320)."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 64), nn.Tanh(), nn.Linear(64, 2))


def main(out: Path, phase: str) -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    model = DDP(make_model())
    if phase == "frozen":  # frozen after wrapping: its towers keep summing the whole gradient
        model.module[0].bias.requires_grad_(False)
    optimizer = ZeroRedundancyOptimizer(
        model.parameters(), optimizer_class=torch.optim.AdamW, lr=LR, weight_decay=DECAY
    )
    dataset = data()
    loader = DataLoader(dataset, batch_size=BATCH, sampler=DistributedSampler(dataset))
    if phase == "resume":
        saved = torch.load(out / "first.pt")
        model.module.load_state_dict(saved["model"])
        optimizer.load_state_dict(saved["optimizer"])
    for k, (x, y) in enumerate(loader):
        if phase != "frozen" and (k >= FIRST) == (phase == "first"):
            continue
        loss = nn.functional.mse_loss(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)  # over the whole model
        optimizer.step()
    if phase == "first":
        optimizer.consolidate_state_dict(to=0)
        if rank == 0:
            state = {"model": model.module.state_dict(), "optimizer": optimizer.state_dict()}
            torch.save(state, out / "first.pt")
        held = [v for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v)]
        torch.save(sum(v.numel() for v in held if v.dim() > 0), out / f"held-{rank}.pt")
    elif rank == 0:
        torch.save(model.module.state_dict(), out / f"{phase}.pt")
    dist.destroy_process_group()


if __name__ == "__main__":
    torch.set_num_threads(1)
    main(Path(sys.argv[1]), sys.argv[2])
