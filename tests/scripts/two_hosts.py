"""One node of a two-host job: the own loop (its optimizer state sharded), then towers.train,
over Gloo; rank 0 saves both.

    torchrun --nnodes 2 --node-rank R --nproc-per-node 1 --master-addr A --master-port P \\
        two_hosts.py OUT
"""

import sys

import torch

import towers

STEPS = 6


def global_batches():
    g = torch.Generator().manual_seed(5)
    return [(torch.randn(9, 3, generator=g), torch.randn(9, 1, generator=g)) for _ in range(STEPS)]


def build_model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(3, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))


def mse(model, shard):
    x, y = shard
    return (model(x) - y).square().mean()


def data():
    g = torch.Generator().manual_seed(6)
    return torch.randn(30, 3, generator=g), torch.randn(30, 1, generator=g)


def main():
    torch.set_num_threads(1)
    # Both namespaces share /dev/shm, which a real second host would not: ask for Gloo, so that
    # the sums cross the network.
    ctx = towers.init(timeout=30, transport="gloo")
    # the optimizer's state sharded: each host steps its part, the parts are gathered over the
    # link (the unsharded own loop across hosts: hier_hosts.py)
    model = ctx.replicate(build_model(), shard_optimizer=True)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for shard in ctx.shards(global_batches()):
        ctx.step(mse(model, shard), opt)
    result = towers.train(
        build_model(), mse, data(), batch_size=7, steps=5, workers=2, seed=4, progress=False,
        timeout=30, transport="gloo",
    )  # fmt: skip
    if ctx.rank == 0:
        torch.save({"loop": model.state_dict(), "train": result.model.state_dict(),
                    "losses": result.losses}, sys.argv[1])  # fmt: skip
    ctx.close()


if __name__ == "__main__":
    main()
