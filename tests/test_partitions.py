"""Network partitions in an elastic job across hosts: the link between two hosts cut mid-run.

Two ``towers run --elastic --nnodes 2`` launchers, one worker each, in two network namespaces
joined by a veth pair (tests/netns.py); the test takes host 1's end of the pair down (no packet
passes, and no socket is told) for good, or for a few seconds. Whatever happens to host 1,
host 0 trains on and ends with the parameters of a plain single-process loop
(tests/scripts/elastic_loop.py writes them), and every host ends within the timeout, saying why.
"""

from __future__ import annotations

import contextlib
import os
import random
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from helpers import elastic_loop_reference, reap, saved_finals
from netns import Host, two_hosts

SCRIPTS = Path(__file__).parent / "scripts"
SRC = str(Path(__file__).resolve().parents[1] / "src")


def _launcher(host: Host, master: Host, rank: int, port: int, tmp: Path, steps: int,
              timeout: float) -> subprocess.Popen[str]:  # fmt: skip
    args = [sys.executable, "-m", "towers", "run", str(SCRIPTS / "elastic_loop.py"),
            "-n", "1", "--elastic", "--nnodes", "2", "--node-rank", str(rank),
            "--master-addr", master.addr, "--master-port", str(port), "--timeout", str(timeout),
            "--", "--progress", str(tmp / "progress"), "--out", str(tmp / "out"),
            "--steps", str(steps), "--sleep", "0.05", "--timeout", str(timeout)]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if not k.startswith(("GLOO_", "MASTER_"))}
    env |= {"PYTHONPATH": SRC, "OMP_NUM_THREADS": "1"}
    return host.popen(args, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)


def _partition(tmp: Path, steps: int, timeout: float, blip: float | None):
    """Run the job, cut host 1's link after a few steps (for ``blip`` seconds, or for good).

    Returns each launcher's exit code, log and seconds from the cut to its exit, the final
    files of the workers that finished, and when (wall time) the link came back.
    """
    (tmp / "progress").mkdir()
    (tmp / "out").mkdir()
    port = random.randrange(20000, 30000)
    with two_hosts() as (a, b):
        nodes = [_launcher(a, a, 0, port, tmp, steps, timeout),
                 _launcher(b, a, 1, port, tmp, steps, timeout)]  # fmt: skip
        ended: list[float | None] = [None, None]
        mended = None
        try:
            deadline = time.monotonic() + 40
            while sum(f.stat().st_size for f in (tmp / "progress").iterdir()) < 16:
                assert time.monotonic() < deadline, "the job made no progress"
                assert all(n.poll() is None for n in nodes), [n.communicate() for n in nodes]
                time.sleep(0.02)
            b.cut()
            cut = time.monotonic()
            if blip is not None:
                time.sleep(blip)
                b.mend()
                mended = time.time()
            while None in ended and time.monotonic() < cut + 60:
                for i, node in enumerate(nodes):
                    if ended[i] is None and node.poll() is not None:
                        ended[i] = time.monotonic() - cut
                time.sleep(0.05)
        finally:
            for node in nodes:
                if node.poll() is None:
                    node.kill()
            logs = [node.communicate()[0] for node in nodes]
        left = reap(nodes, tmp)
    assert left == [], logs
    finals = saved_finals(tmp / "out")
    return [n.returncode for n in nodes], logs, ended, finals, mended


def _check_trained(final: dict, steps: int, worlds: set[int]) -> None:
    assert final["steps"] == steps
    elastic_loop_reference(steps).check(final, "host 0's worker after a partition")
    assert set(final["world"]) == worlds, final["world"]


@pytest.mark.slow
@pytest.mark.timeout(90)
def test_a_host_cut_off_for_good_stops_within_the_timeout(tmp_path):
    """Host 0 drops host 1 after 2 s (a quarter of the timeout) and trains on; host 1 stops
    after the timeout, saying so."""
    codes, logs, ended, finals, _ = _partition(tmp_path, steps=90, timeout=8, blip=None)
    why = "\n".join(log[-3000:] for log in logs)
    assert codes == [0, 1], why
    assert ended[1] is not None and ended[1] < 8 + 6, (ended, why)
    line = r"towers run \(node 1, host [^)]+\): lost contact with the job at \d\d:\d\d:\d\d: "
    line += r"node 0's store at 10\.77\.\d+\.1:\d+ has not answered for 8 s \(the timeout\)"
    assert len(re.findall(line, logs[1])) == 1, why
    assert "node 1's launcher has been silent for 2 s; its workers [1] are lost" in logs[0]
    assert "failed" not in logs[0] + logs[1], why
    assert set(finals) == {0}, why
    _check_trained(finals[0], 90, {2, 1})
    print(f"host 1 stopped {ended[1]:.1f} s after the cut (timeout 8 s)")


@pytest.mark.slow
@pytest.mark.timeout(90)
def test_a_blip_shorter_than_a_node_s_silence_goes_unnoticed(tmp_path):
    """The link down for 5 s with the default timeout (60 s), less than the node timeout (a
    quarter of it: 15 s): both hosts finish with the same model, nobody is dropped."""
    codes, logs, _, finals, _ = _partition(tmp_path, steps=60, timeout=60, blip=5.0)
    why = "\n".join(log[-3000:] for log in logs)
    assert codes == [0, 0], why
    assert "silent" not in why and "dropped" not in why, why
    assert set(finals) == {0, 1}, why
    for final in finals.values():
        _check_trained(final, 60, {2})
    for name, value in finals[0]["model"].items():  # every rank applied the same update
        assert torch.equal(value, finals[1]["model"][name]), name
    gap = max(b - a for a, b in zip(finals[0]["times"], finals[0]["times"][1:]))
    assert gap >= 5.0, gap  # the blip did stall the job
    print(f"longest step through the blip: {gap:.1f} s")


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_host_dropped_during_a_blip_rejoins_and_ends_with_the_same_model(tmp_path):
    """The link down for 6.5 s: host 0 drops host 1 after 5 s and trains on; host 1, when the
    link is back, learns that it was dropped, stops its worker (not as a failed one) and
    rejoins with a newcomer, which a live peer gives the state at the next step. Both hosts end
    with the parameters of a plain loop."""
    steps = 400
    codes, logs, _, finals, mended = _partition(tmp_path, steps, timeout=20, blip=6.5)
    why = "\n".join(log[-3000:] for log in logs)
    assert codes == [0, 0], why
    line = r"towers run \(node 1\): this node \(host [^)]+\) was dropped from the job at "
    line += r"\d\d:\d\d:\d\d: node 0 heard nothing from its towers run for 5 s \(.*\)\. "
    line += r"Its workers \[1\] are stopped; it rejoins with workers \[2\], let in at the job's"
    assert len(re.findall(line, logs[1])) == 1, why
    assert "failed" not in logs[0] + logs[1], why
    assert "Traceback" not in logs[1], why
    assert set(finals) == {0, 2}, why  # worker 1 was dropped; worker 2 took its node's place
    _check_trained(finals[0], steps, {2, 1})
    world = finals[0]["world"]
    k = world.index(1)
    back = world.index(2, k)
    assert world == [2] * k + [1] * (back - k) + [2] * (steps - back), world
    reference = elastic_loop_reference(steps)
    late = finals[2]
    assert late["steps"] == steps and late["world"] == [2] * (steps - back), late["world"]
    reference.check_losses(late["losses"], "the rejoined worker", start=back)
    reference.check(late["model"], "the rejoined worker")
    print(f"link back to the first step with the rejoined node: {late['times'][0] - mended:.1f} s")


def test_a_dropped_worker_stops_with_one_line_saying_when_and_why():
    """What a worker of a host that node 0 dropped sees once the link is back: not a member of
    the next generation, and why (written by node 0 before it published that generation)."""
    from towers.comm import protocol
    from towers.comm.membership import Dropped, Membership
    from towers.comm.net import free_port
    from towers.processes.elastic_members import serve_store

    port = free_port("127.0.0.1")
    store = serve_store("127.0.0.1", port, 10, None)
    store.set(protocol.generation(0, "members"), "[0]")
    store.set(protocol.lost(1), protocol.Lost(0, "node 1's towers run was silent for 5 s").dumps())
    member = Membership("127.0.0.1", port, 1, 10).start()
    try:
        with pytest.raises(Dropped) as dropped:
            member.enter(0)
    finally:
        member.close()
    assert isinstance(dropped.value, SystemExit)  # no `except Exception` keeps it training
    when = time.strftime("%H:%M:%S", time.localtime(0))
    assert str(dropped.value) == (
        f"towers: worker 1 was dropped from the job at {when} (node 1's towers run was silent "
        "for 5 s); the others train on without it. This worker stops"
    )


@pytest.mark.timeout(60)
def test_a_worker_whose_store_dies_raises_job_lost_in_its_main_thread():
    """The heartbeat finds the store gone, interrupts the wait in progress, and the worker's
    next call to its membership raises JobLost (a SystemExit with the line saying why) in the
    main thread: no thread of the library ends the process."""
    from towers.comm.membership import JobLost, Membership
    from towers.comm.net import free_port

    port = free_port("127.0.0.1")
    serve = "import sys, time; from towers.processes.elastic_members import serve_store; "
    serve += f"s = serve_store('127.0.0.1', {port}, 30, None); print('up', flush=True); "
    serve += "time.sleep(60)"
    server = subprocess.Popen([sys.executable, "-c", serve], stdout=subprocess.PIPE, text=True)
    try:
        assert server.stdout is not None and server.stdout.readline() == "up\n"
        member = Membership("127.0.0.1", port, 3, 3).start()
        member.generation = 0  # beating for a generation: every beat reads the store
        server.kill()
        server.wait()
        # a beat every 0.2 s meets the closed port at once; 30 s is a margin for a busy machine
        assert member.interrupt.wait(30), "the heartbeat never noticed the store was gone"
    finally:
        server.kill()
        server.wait()
    with pytest.raises(JobLost) as lost:
        member.enter(1)
    member.close()
    assert isinstance(lost.value, SystemExit) and lost.value.code is not None
    assert str(lost.value).startswith(
        "towers: worker 3 lost the job's supervisor (the caller of train, or towers run: its "
        f"store at 127.0.0.1:{port} stopped answering at "
    )


# A launcher whose heartbeat's call waits on a store that stopped answering (a link cut, or
# node 0 stopped) as it exits; the store answers (its process is killed) as the interpreter
# shuts down (the atexit function registered first runs last).
_BEATING_AT_EXIT = """
import atexit, os, signal, subprocess, sys, time
from towers.comm.membership import Pulse, own_client
port = int(sys.argv[1])
serve = "import sys, time; from towers.processes.elastic_members import serve_store; "
serve += f"s = serve_store('127.0.0.1', {port}, 30, None); print('up', flush=True); time.sleep(60)"
server = subprocess.Popen([sys.executable, "-c", serve], stdout=subprocess.PIPE, text=True,
                          stderr=subprocess.DEVNULL)
atexit.register(os.kill, server.pid, signal.SIGKILL)
print(server.pid, flush=True)
assert server.stdout.readline() == "up\\n"
pulse = Pulse(own_client("127.0.0.1", port, 30, None), "beat", every=0.05).start()
os.kill(server.pid, signal.SIGSTOP)
time.sleep(0.5)  # the pulse's call now waits
began = time.monotonic()
pulse.close()
print(f"{time.monotonic() - began:.1f} {pulse._thread.is_alive()}", flush=True)
"""


@pytest.mark.timeout(60)
def test_a_heartbeat_whose_call_is_stuck_is_broken_off_before_its_launcher_exits():
    """A daemon thread that returns from a store call while the interpreter shuts down dies in
    C++ frames and aborts the process ("terminate called without an active exception", exit
    -6), as `towers run` did when the heartbeat's call, held up by a cut, ended as it exited.
    Closing the heartbeat waits 2 s for its call, then breaks its connection: the thread ends
    and the process exits normally."""
    env = {**os.environ, "PYTHONPATH": SRC}
    port = random.randrange(20000, 30000)
    done = subprocess.run([sys.executable, "-c", _BEATING_AT_EXIT, str(port)], env=env,
                          capture_output=True, text=True, timeout=40)  # fmt: skip
    server, *closed = done.stdout.split()
    with contextlib.suppress(ProcessLookupError):
        os.kill(int(server), signal.SIGKILL)
    assert done.returncode == 0, done.stderr[-2000:]
    assert closed[1] == "False" and 2.0 <= float(closed[0]) < 4.0, closed  # ended, 2 s late
