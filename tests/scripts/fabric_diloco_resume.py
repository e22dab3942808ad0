"""fabric_diloco.py's training for two epochs under ``TowersFabricStrategy(mode="diloco:5")``,
whole or saved and resumed between the epochs: ``whole`` ends the first epoch with
``fabric.barrier()``, ``first`` with ``fabric.save(OUT/ckpt.pt, ...)`` (each takes the outer step
of the epoch's last 2 inner steps), and ``second``, a new launch, loads that file and trains the
second epoch. Rank 0 saves the parameters to ``OUT/PHASE.pt``.

    python fabric_diloco_resume.py OUT whole|first|second
"""

import sys
from pathlib import Path

import torch
import torch.nn as nn
from lightning.fabric import Fabric
from torch.utils.data import DataLoader

from towers.lightning import TowersFabricStrategy

sys.path.insert(0, str(Path(__file__).resolve().parent))
from lightning_diloco import LR, MOMENTUM
from lightning_fit import dataset, make_net

if __name__ == "__main__":
    out, phase = Path(sys.argv[1]), sys.argv[2]
    fabric = Fabric(strategy=TowersFabricStrategy(mode="diloco:5"), accelerator="cpu", devices=2)
    fabric.launch()
    net = make_net()
    model, optimizer = fabric.setup(
        net, torch.optim.SGD(net.parameters(), lr=LR, momentum=MOMENTUM)
    )
    loader = fabric.setup_dataloaders(DataLoader(dataset(), batch_size=16, shuffle=True))
    epochs = 2 if phase == "whole" else 1
    if phase == "second":
        remainder = fabric.load(out / "ckpt.pt", {"model": model, "optimizer": optimizer})
        assert "towers" not in remainder, sorted(remainder)
        next(iter(loader))  # the epoch done: Fabric sets the sampler's epoch to its loader's
        # count of iterations, not to what the loop asks for
    for _ in range(epochs):
        for x, y in loader:
            fabric.backward(nn.functional.mse_loss(model(x), y))
            optimizer.step()
            optimizer.zero_grad()
        if phase == "first":
            fabric.save(out / "ckpt.pt", {"model": model, "optimizer": optimizer})
        else:
            fabric.barrier()
    if fabric.global_rank == 0:
        torch.save(net.state_dict(), out / f"{phase}.pt")
