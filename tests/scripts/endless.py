"""Training that never ends on its own, for tests that stop it from outside.

python endless.py train MODE DIR   # towers.train, 2 workers, a checkpoint every 20 steps
towers run endless.py -n 2 -- loop DIR   # an own loop; rank 0 writes DIR/ready once running
"""

import sys
from pathlib import Path

import torch

import towers


def mse(model, shard):
    x, y = shard
    return (model(x) - y).square().mean()


def main():
    what, directory = sys.argv[1], sys.argv[-1]
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    data = (torch.randn(64, 3), torch.randn(64, 1))
    if what == "train":
        towers.train(
            model,
            mse,
            data,
            batch_size=8,
            steps=10**5,
            workers=2,
            mode=sys.argv[2],
            progress=False,
            checkpoint=directory,
            checkpoint_every=20,
        )
        return
    ctx = towers.init()
    model = ctx.replicate(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    while True:
        ctx.step(mse(model, towers.split(data, ctx.world_size)[ctx.rank]), opt)
        if ctx.rank == 0 and not (Path(directory) / "ready").exists():
            (Path(directory) / "ready").write_text("running")


if __name__ == "__main__":
    main()
