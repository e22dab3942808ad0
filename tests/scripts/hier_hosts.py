"""One node of a job on two hosts with two workers each; rank 0 saves what the test checks.

    torchrun --nnodes 2 --node-rank R --nproc-per-node 2 --master-addr A --master-port P \\
        hier_hosts.py OUT LINK

The hosts have their own host names and /dev/shm (tests/netns.py, ``own=True``), and the
transport is left to towers (``auto``): sums within a host through shared memory, across hosts
among one leader per host. LINK is this host's end of the link between the hosts: rank 0 counts
the bytes that cross it while the own loop runs in two levels and then flat over Gloo.
"""

import sys
from pathlib import Path

import torch

import towers
from towers.transforms import allreduce

STEPS = 5
SIDE = 64  # Linear(SIDE, SIDE): the bytes per step that cross between hosts are its gradients


def build_model():
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(3, SIDE), torch.nn.Tanh(), torch.nn.Linear(SIDE, SIDE), torch.nn.Tanh(),
        torch.nn.Linear(SIDE, 1),
    )  # fmt: skip


def mse(model, shard):
    x, y = shard
    return (model(x) - y).square().mean()


def global_batches():
    g = torch.Generator().manual_seed(5)
    x, y = torch.randn(STEPS * 11, 3, generator=g), torch.randn(STEPS * 11, 1, generator=g)
    return list(zip(x.split(11), y.split(11), strict=True))


def data():
    g = torch.Generator().manual_seed(6)
    return torch.randn(60, 3, generator=g), torch.randn(60, 1, generator=g)


class Recording:
    """A plain sum that writes down, per bucket, how many ranks it was asked to sum over."""

    seen: list[tuple[int, bool]] = []  # noqa: RUF012  (world size, carried the metadata)

    def init(self, layouts):
        return None

    def reduce(self, state, bucket, comm):
        Recording.seen.append((comm.world_size, bucket.tail is not None))
        return allreduce().reduce(state, bucket, comm)


def crossed(link: str) -> int:
    stats = Path("/sys/class/net", link, "statistics")
    return sum(int((stats / f"{d}_bytes").read_text()) for d in ("tx", "rx"))


def own_loop(ctx, link: str) -> tuple[dict, int]:
    """The own loop over ``global_batches``; its parameters and the bytes that crossed."""
    model = ctx.replicate(build_model())
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    ctx.barrier()
    before = crossed(link)
    for shard in ctx.shards(global_batches()):
        ctx.step(mse(model, shard), opt)
    ctx.barrier()
    return model.state_dict(), crossed(link) - before


def main():
    torch.set_num_threads(1)
    out, link = sys.argv[1], sys.argv[2]
    ctx = towers.init(timeout=60)
    levels = ctx.comm.levels
    shape = None if levels is None else (levels.hosts, levels.leaders is not None)
    loop, hier_bytes = own_loop(ctx, link)
    flat = towers.init(timeout=60, transport="gloo")  # the same job, summed flat over Gloo
    flat_loop, flat_bytes = own_loop(flat, link)
    flat.close()
    kw = {"batch_size": 10, "steps": 4, "workers": 4, "seed": 4, "progress": False, "timeout": 60}
    result = towers.train(build_model(), mse, data(), transform=Recording(), **kw)
    coded = towers.train(build_model(), mse, data(), compress="int8", **kw)
    gathered = ctx.comm.all_gather_object((shape, Recording.seen))
    if ctx.rank == 0:
        torch.save(
            {
                "levels": [s for s, _ in gathered],
                "seen": [r for _, r in gathered],
                "loop": loop,
                "flat_loop": flat_loop,
                "bytes": {"hier": hier_bytes, "flat": flat_bytes},
                "train": result.model.state_dict(),
                "losses": result.losses,
                "coded_losses": coded.losses,
                "coded_tower_losses": coded.tower_losses,
            },
            out,
        )
    ctx.close()


if __name__ == "__main__":
    main()
