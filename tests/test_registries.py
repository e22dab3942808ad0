"""A transport, a mode and a compression are each one module and one registration.

``tests/scripts/toys.py`` registers a toy of each (docs/architecture.md, "Where to add
things"); ``towers.train`` asks for all three by name and must train exactly what one process
does with the same clipping. The toys are registered in a process of their own, so that the
registries of the suite's own processes hold only towers' own.
"""

from __future__ import annotations

import functools
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from exact import Reference, bound
from helpers import make_net, mse, regression_data

import towers
from towers.core.compat import elastic_refusal
from towers.core.modes import MODES
from towers.core.transport import TRANSPORTS, Transport, declare
from towers.engines.transforms.compressions import COMPRESSIONS

SCRIPTS = Path(__file__).parent / "scripts"
sys.path.insert(0, str(SCRIPTS))
from toy_train import BATCH, CLIP, STEPS  # noqa: E402  (the constants only)


class ClippedSGD(torch.optim.SGD):
    """One process's clipping: the whole batch's gradient clipped to ``CLIP``, then SGD."""

    def step(self, closure=None):
        params = [p for group in self.param_groups for p in group["params"]]
        torch.nn.utils.clip_grad_norm_(params, CLIP)
        return super().step(closure)


@pytest.mark.timeout(180)
def test_a_toy_transport_mode_and_compression_train_exactly_by_name(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, str(SCRIPTS / "toy_train.py"), str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=150,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    saved = torch.load(tmp_path / "result.pt")
    data = regression_data()
    loop = {"batch_size": BATCH, "steps": STEPS}
    reference = Reference.of(
        make_net(), data, optimizer=functools.partial(ClippedSGD, lr=0.1), **loop
    )
    reference.check(saved["model"])
    reference.check_losses(saved["losses"])
    # the clipping is the toy mode's doing: without it the run ends elsewhere
    unclipped = Reference.of(
        make_net(), data, optimizer=functools.partial(torch.optim.SGD, lr=0.1), **loop
    )
    names = sorted(unclipped.exact)
    _, allowed = bound([unclipped.single[k] for k in names], [unclipped.exact[k] for k in names])
    apart = max(float((saved["model"][k].double() - unclipped.exact[k]).abs().max()) for k in names)
    assert apart > 100 * allowed, (apart, allowed)
    # every rank's sums went through the toy transport: the step's metadata, once a step
    # (the raw compression moves the gradients themselves by all-to-all and all-gather)
    for rank in (0, 1):
        carried = json.loads((tmp_path / f"rank-{rank}.json").read_text())
        assert carried["sums"] == STEPS and carried["gathers"] == STEPS, carried


def test_the_suite_registers_no_toy() -> None:
    """The toys live in their own process: the registries here hold towers' own only (the
    tests of the command's help and of the registries' order rely on it)."""
    assert "toys" not in sys.modules
    assert "ordered" not in TRANSPORTS and "clipped" not in MODES and "raw" not in COMPRESSIONS


def test_what_a_transport_declares_decides_what_it_is_refused() -> None:
    """Refusals are written from the declaration: a transport that does not say it can
    regroup is refused for elastic jobs; one that only sums, for the parameter server."""
    toy = Transport("toy", "a toy", ("cpu",))  # declared, not registered
    assert elastic_refusal("elastic=True", transport=toy, instead="drop elastic=True") == (
        "transport='toy': elastic=True runs CPU workers (shared memory or Gloo); pass "
        "transport='shm' or 'gloo', or drop elastic=True to train on GPUs"
    )
    with pytest.raises(ValueError, match=r"transport='toy' carries the towers' sums, and in "):
        towers.train(
            make_net(), mse, regression_data(), batch_size=8, steps=2, mode="async", workers=2,
            transport=toy,
        )  # fmt: skip
    with pytest.raises(ValueError, match="transport 'gloo' is registered already"):
        declare(Transport("gloo", "another Gloo", ("cpu",)))
    assert Transport.parse("gloo").title == "Gloo"
