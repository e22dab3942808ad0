"""A rank whose last collective completes while its interpreter shuts down.

    python last_collective.py RANK PORT DIR

Rank 1 starts a sum through towers' Gloo transport, drops the tensor and the work at once and
ends its script. Its exit then holds the GIL for a few seconds (an ``atexit`` function busy in
C, as a save or a logger's flush can be). Rank 0 joins the sum only once rank 1 is in that
function, so Gloo's thread completes the work while the interpreter is about to shut down.
Rank 0 then waits for the file ``DIR/release`` before it exits.
"""

import atexit
import sys
import time
from pathlib import Path

rank, port, out = int(sys.argv[1]), int(sys.argv[2]), Path(sys.argv[3])


def hold_the_gil() -> None:
    (out / "exiting").write_text("")
    sum(range(150_000_000))  # a few seconds in C, the GIL held throughout


if rank == 1:
    atexit.register(hold_the_gil)  # registered before torch's own: runs last

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from towers.comm.base import DistComm  # noqa: E402

torch.set_num_threads(1)
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
comm = DistComm()
comm.barrier()
if rank == 1:
    comm.all_reduce_sum(torch.ones(1000))
else:
    while not (out / "exiting").exists():
        time.sleep(0.01)
    total = torch.ones(1000)
    comm.all_reduce_sum(total).wait()
    assert total.eq(2).all(), total
    while not (out / "release").exists():
        time.sleep(0.05)
