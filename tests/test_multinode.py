"""Two hosts for real: network namespaces joined by a veth pair, torchrun --nnodes 2 in each.

The host name resolves to 127.0.0.1 in both (as in many containers): towers must still pick the
interface that reaches MASTER_ADDR by itself (GLOO_SOCKET_IFNAME unset).
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
from helpers import reference_loop
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
    reference = script.build_model()
    opt = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    for batch in script.global_batches():
        opt.zero_grad()
        script.mse(reference, batch).backward()
        opt.step()
    for name, p in reference.state_dict().items():
        torch.testing.assert_close(got["loop"][name], p, rtol=1e-5, atol=1e-6)

    reference = script.build_model()
    sgd = functools.partial(torch.optim.SGD, lr=0.01)
    losses, _, _ = reference_loop(
        reference, script.data(), batch_size=7, steps=5, optimizer=sgd, seed=4, loss_fn=script.mse
    )
    torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(losses), rtol=1e-5, atol=0)
    for name, p in reference.state_dict().items():
        torch.testing.assert_close(got["train"][name], p, rtol=1e-5, atol=1e-6)
