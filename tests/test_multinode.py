"""Two hosts for real: network namespaces joined by a veth pair, torchrun --nnodes 2 in each.

The host name resolves to 127.0.0.1 in both (as in many containers): towers must still pick the
interface that reaches MASTER_ADDR by itself (GLOO_SOCKET_IFNAME unset). Both the own loop and
towers.train are compared with a plain loop in float32 and float64 over the same batches, within
tests/exact.py's bound.
"""

from __future__ import annotations

import functools
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from exact import Reference
from helpers import host_script_reference
from netns import two_hosts

SCRIPTS = Path(__file__).parent / "scripts"
SRC = str(Path(__file__).resolve().parents[1] / "src")


def torchrun(host, master, rank: int, out: Path) -> subprocess.Popen[str]:
    args = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node-rank",
            str(rank), "--nproc-per-node", "1", "--master-addr", master.addr, "--master-port",
            "29517", str(SCRIPTS / "two_hosts.py"), str(out)]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if not k.startswith(("GLOO_", "MASTER_"))}
    env |= {"PYTHONPATH": SRC, "OMP_NUM_THREADS": "1"}
    return host.popen(args, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_two_hosts_train_like_one(tmp_path):
    out = tmp_path / "result.pt"
    with two_hosts() as (a, b):
        nodes = [torchrun(a, a, 0, out), torchrun(b, a, 1, out)]
        logs = []
        for node in nodes:
            try:
                logs.append(node.communicate(timeout=100)[0])
            finally:
                if node.poll() is None:
                    node.kill()
                    node.communicate()
        for node, log in zip(nodes, logs, strict=True):
            assert node.returncode == 0, log[-3000:]
    got = torch.load(out, weights_only=True)

    # under a name of its own: benchmarks/ has a two_hosts.py too
    spec = importlib.util.spec_from_file_location("script_two_hosts", SCRIPTS / "two_hosts.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)

    host_script_reference(script).check(got["loop"], "the own loop")

    sgd = functools.partial(torch.optim.SGD, lr=0.01)
    reference = Reference.of(
        script.build_model(), script.data(), batch_size=7, steps=5, optimizer=sgd, seed=4,
        loss_fn=script.mse,
    )  # fmt: skip
    reference.check_losses(got["losses"], "towers.train")
    reference.check(got["train"], "towers.train")
