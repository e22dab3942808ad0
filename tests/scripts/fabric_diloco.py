"""lightning_diloco.py's training in a loop of one's own under
``Fabric(strategy=TowersFabricStrategy(mode="diloco:H"), devices=2)``: each rank's SGD steps
it alone on its batches of 16 (one epoch of 32, the last shorter), every H steps the ranks take
DiLoCo's outer step, and ``fabric.barrier()`` at the end takes the last one, of the steps since;
rank 0 then saves the parameters to OUT. With ``save``, the loop ends with ``fabric.save(OUT,
{"model": model})`` instead, which takes it first.

    python fabric_diloco.py OUT H [save]
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
    every = int(sys.argv[2])
    fabric = Fabric(
        strategy=TowersFabricStrategy(mode=f"diloco:{every}"), accelerator="cpu", devices=2
    )
    fabric.launch()
    net = make_net()
    model, optimizer = fabric.setup(
        net, torch.optim.SGD(net.parameters(), lr=LR, momentum=MOMENTUM)
    )
    loader = fabric.setup_dataloaders(DataLoader(dataset(), batch_size=16, shuffle=True))
    for x, y in loader:
        fabric.backward(nn.functional.mse_loss(model(x), y))
        optimizer.step()
        optimizer.zero_grad()
    if sys.argv[3:] == ["save"]:
        fabric.save(sys.argv[1], {"model": model})  # the outer step first, then the save
    else:
        fabric.barrier()  # the outer step of the steps since the last one
        if fabric.global_rank == 0:
            torch.save({"model": net.state_dict()}, sys.argv[1])
