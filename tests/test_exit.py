"""A rank's exit right after its job's last collective ends the process cleanly."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from helpers import unused_port

SCRIPT = Path(__file__).parent / "scripts" / "last_collective.py"


@pytest.mark.timeout(120)
def test_a_sum_completed_during_interpreter_shutdown_does_not_abort_the_process(tmp_path):
    """Gloo's thread lets go of a finished work a moment after it completes; holding the last
    reference to a tensor, it would take the GIL to free it, and just before the interpreter
    shuts down that ends the process with "terminate called without an active exception"."""
    port = str(unused_port())
    ranks = [
        subprocess.Popen(
            [sys.executable, str(SCRIPT), str(rank), port, str(tmp_path)],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for rank in (0, 1)
    ]
    try:
        out1, _ = ranks[1].communicate(timeout=90)
        (tmp_path / "release").write_text("")
        out0, _ = ranks[0].communicate(timeout=30)
    finally:
        for p in ranks:
            p.kill()
    assert (tmp_path / "exiting").exists(), out1
    assert ranks[1].returncode == 0, out1
    assert "terminate called" not in out1
    assert ranks[0].returncode == 0, out0
