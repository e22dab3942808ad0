"""Run by tests/test_no_silent_failures.py inside a small memory cgroup: worker 1 of a train()
allocates 4 GiB, the OOM killer kills it; prints the WorkerError as one JSON line."""

import json
import os

import torch

import towers


def hog(model, shard):
    if os.environ.get("RANK") == "1":
        torch.ones(1 << 30)  # 4 GiB of float32, every page written
    x, y = shard
    return (model(x) - y).square().mean()


if __name__ == "__main__":
    torch.set_num_threads(1)
    x, y = torch.randn(16, 3), torch.randn(16, 1)
    try:
        towers.train(
            torch.nn.Linear(3, 1), hog, (x, y), batch_size=8, steps=2, workers=2, progress=False,
            timeout=30,
        )  # fmt: skip
        print(json.dumps({"error": None}))
    except towers.WorkerError as exc:
        print(json.dumps({"error": str(exc), "rank": exc.rank, "exitcode": exc.exitcode}))
