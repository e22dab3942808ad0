"""Elastic across hosts: ``towers run --elastic --nnodes 2``, one launcher in each of two network
namespaces joined by a veth pair (tests/netns.py), and a worker of node 1 killed midway.

The survivors on both nodes regroup, a replacement started by node 1 may join, and the trained
parameters equal a plain single-process loop. A job started with ``--nnodes 2:3`` grows by a
third host launched mid-run, and refuses a fourth. The test finds its victim through the progress
files the script writes (``<id>-<pid>``) and kills it with SIGKILL.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers import (
    elastic_loop_reference,
    processes_mentioning,
    reap,
    saved_finals,
    unused_port,
)
from netns import three_hosts, two_hosts

from towers.tools.load import busy

SCRIPTS = Path(__file__).parent / "scripts"
SRC = str(Path(__file__).resolve().parents[1] / "src")
NPROC, STEPS = 2, 30


def _launcher(
    host, master, rank: int, port: int, tmp: Path, nproc: int = NPROC, extra: tuple = (),
    steps: int = STEPS, script: tuple = (),
) -> subprocess.Popen[str]:  # fmt: skip
    args = [sys.executable, "-m", "towers", "run", str(SCRIPTS / "elastic_loop.py"),
            "-n", str(nproc), "--elastic", "--max-restarts", "1", "--nnodes", "2",
            "--node-rank", str(rank), "--master-addr", master.addr, "--master-port", str(port),
            *extra, "--", "--progress", str(tmp / "progress"), "--out", str(tmp / "out"),
            "--steps", str(steps), "--sleep", "0.08", *script]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if not k.startswith(("GLOO_", "MASTER_"))}
    env |= {"PYTHONPATH": SRC, "OMP_NUM_THREADS": "1"}
    return host.popen(args, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)


def _kill_on_node_1(progress: Path, after: int, deadline: float) -> tuple[int, float]:
    """SIGKILL a worker of node 1 once the workers have made ``after`` steps in all."""
    while time.monotonic() < deadline:
        files = list(progress.iterdir())
        if sum(f.stat().st_size for f in files) >= after:
            mine = sorted(f.name for f in files if int(f.name.split("-")[0]) >= NPROC)
            if mine:
                victim = random.choice(mine)
                os.kill(int(victim.split("-")[1]), signal.SIGKILL)
                return int(victim.split("-")[0]), time.time()
        time.sleep(0.01)
    raise AssertionError("the job made no progress")


@pytest.mark.slow
@pytest.mark.timeout(90)
def test_a_worker_lost_on_node_1_leaves_the_parameters_unchanged(tmp_path):
    (tmp_path / "progress").mkdir()
    (tmp_path / "out").mkdir()
    port = random.randrange(20000, 30000)
    with two_hosts() as (a, b):
        nodes = [_launcher(a, a, 0, port, tmp_path), _launcher(b, a, 1, port, tmp_path)]
        logs = []
        try:
            after = random.randrange(2 * NPROC * 2, 8 * NPROC * 2)  # steps 2..7 of 4 workers
            lost, killed_at = _kill_on_node_1(tmp_path / "progress", after, time.monotonic() + 60)
            logs = [node.communicate(timeout=60)[0] for node in nodes]
        finally:
            left = reap(nodes, tmp_path)
    why = f"lost worker {lost} after {after} calls:\n" + "\n".join(log[-3000:] for log in logs)
    assert [node.returncode for node in nodes] == [0, 0], why
    assert left == [], why
    assert f"workers [{lost}] were lost, 1 replaced" in logs[0], why

    finals = saved_finals(tmp_path / "out")
    # the replacement (worker 4, on node 1) joins unless the others finish before it has started
    assert set(finals) - {4} == {0, 1, 2, 3} - {lost}, why
    reference = elastic_loop_reference(STEPS)
    for final in finals.values():
        assert final["steps"] == STEPS, why
        reference.check(final["model"], f"a worker, {why}")
    first = finals[0]
    reference.check_losses(first["losses"])
    # 4 towers, then 3 from the loss on (both nodes), then 4 again if the replacement joined
    world = first["world"]
    k = world.index(3)
    back = world.index(4, k) if 4 in world[k:] else len(world)
    assert world == [4] * k + [3] * (back - k) + [4] * (len(world) - back), world
    assert (4 in finals) == (back < len(world)), why
    recovery = next(t for t in first["times"] if t > killed_at) - killed_at
    print(f"recovery across hosts: {recovery:.2f} s (incl. one step); world {world}")


def _family(pid: int) -> list[int]:
    """``pid`` and its descendants, parents first."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError):
                continue
            children.setdefault(ppid, []).append(int(entry.name))
    family = [pid]
    for p in family:
        family += children.get(p, [])
    return family


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_host_stopped_on_a_busy_machine_for_less_than_the_node_timeout_stays(tmp_path):
    """Beside 2 spinning processes, host 1 (its towers run and its worker) is stopped with
    SIGSTOP for 6 s, longer than the 5 s after which node 0 used to drop a silent host, and
    2.5x shorter than the default node timeout (15 s, a quarter of the default --timeout):
    nobody is dropped, and both finish with a plain loop's parameters.

    The test holds the time itself: both workers wait after 4 steps (``--hold``) until host 1
    is stopped, so the stop always falls inside the job, and host 0 then waits in a sum with
    the stopped host for the whole stop."""
    (tmp_path / "progress").mkdir()
    (tmp_path / "out").mkdir()
    port, steps, stop = random.randrange(20000, 30000), 12, 6.0
    hold = ("--hold", str(tmp_path / "go"))
    with two_hosts() as (a, b):
        nodes = [
            _launcher(h, a, r, port, tmp_path, 1, (), steps, hold) for r, h in enumerate((a, b))
        ]
        logs = ["", ""]
        try:
            progress = tmp_path / "progress"
            deadline = time.monotonic() + 60
            while sum(f.stat().st_size for f in progress.iterdir()) < 8:  # both at the hold
                assert time.monotonic() < deadline, "the job made no progress"
                assert all(n.poll() is None for n in nodes), [n.communicate() for n in nodes]
                time.sleep(0.05)
            with busy(2):  # once the job runs: its start-up is not what this is about
                time.sleep(1)
                family = _family(nodes[1].pid)  # launcher first: it must not see its worker stop
                for pid in family:
                    os.kill(pid, signal.SIGSTOP)
                stopped = time.monotonic()
                (tmp_path / "go").touch()  # host 0 goes on, into a sum with the stopped host
                time.sleep(stop)
                for pid in reversed(family):
                    os.kill(pid, signal.SIGCONT)
                held = time.monotonic() - stopped
                logs = [node.communicate(timeout=60)[0] for node in nodes]
        finally:
            left = reap(nodes, tmp_path)
    why = "\n".join(log[-3000:] for log in logs)
    assert held < 15 / 2, f"the stop lasted {held:.1f} s, not 2x shorter than the node timeout"
    assert [node.returncode for node in nodes] == [0, 0], why
    assert left == [], why
    assert "silent" not in why and "lost" not in why, why
    finals = saved_finals(tmp_path / "out")
    assert set(finals) == {0, 1}, why
    reference = elastic_loop_reference(steps)
    for final in finals.values():
        reference.check(final, why)
        assert final["world"] == [2] * steps, final["world"]
    gap = max(t1 - t0 for t0, t1 in zip(finals[0]["times"], finals[0]["times"][1:]))
    assert gap >= stop, gap  # the stop did stall the job
    print(f"longest step through the stop: {gap:.1f} s (stopped {held:.1f} s)")


def test_nnodes_asks_for_elastic_a_port_and_a_node_rank_in_range(capsys, tmp_path):
    from towers.tools.cli import main

    script = tmp_path / "s.py"
    script.write_text("")
    assert main(["run", str(script), "--nnodes", "2", "--master-port", "29500"]) == 2
    assert "--nnodes > 1 needs --elastic (or use torchrun)" in capsys.readouterr().err
    base = ["run", str(script), "--elastic", "--nnodes", "2"]
    assert main([*base, "--node-rank", "1"]) == 2
    assert main([*base, "--master-port", "29500", "--node-rank", "2"]) == 2
    err = capsys.readouterr().err
    assert "needs --master-port, and --node-rank (if given) in 0..NNODES-1" in err
    assert main([*base, "--master-port", "29500", "--node-rank", "1", "--node-timeout", "0"]) == 2
    err = capsys.readouterr().err
    assert "--node-timeout must be a finite number of seconds > 0, got 0.0" in err
    node = [*base, "--master-port", "29500", "--node-rank", "1", "--timeout", "20"]
    assert main([*node, "--node-timeout", "20"]) == 2
    err = capsys.readouterr().err
    assert "--node-timeout must be above 0 and below --timeout (20 s), got 20" in err
    assert "(default: a quarter of --timeout, 5 s)" in err
    assert main(["run", str(script), "--elastic", "--node-timeout", "5"]) == 2
    assert "--node-timeout applies to --elastic --nnodes > 1" in capsys.readouterr().err


@pytest.mark.slow
@pytest.mark.timeout(90)
def test_a_lost_launcher_loses_its_node_and_the_other_trains_on(tmp_path):
    """SIGKILL node 1's towers run: its worker dies with it, node 0's trains on alone."""
    (tmp_path / "progress").mkdir()
    (tmp_path / "out").mkdir()
    port = random.randrange(20000, 30000)
    with two_hosts() as (a, b):
        extra = ("--timeout", "20")  # node 0 drops a silent node after 20 / 4 = 5 s
        nodes = [_launcher(h, a, r, port, tmp_path, 1, extra) for r, h in enumerate((a, b))]
        logs = ["", ""]
        try:
            progress = tmp_path / "progress"
            deadline = time.monotonic() + 60
            while sum(f.stat().st_size for f in progress.iterdir()) < 8:
                assert time.monotonic() < deadline, "the job made no progress"
                time.sleep(0.01)
            nodes[1].kill()
            killed_at = time.time()
            logs[0] = nodes[0].communicate(timeout=60)[0]
        finally:
            left = reap(nodes, tmp_path)
    assert nodes[0].returncode == 0, logs[0][-3000:]
    assert left == [], logs[0][-3000:]
    assert "node 1's launcher has been silent for 5 s; its workers [1] are lost" in logs[0]
    finals = saved_finals(tmp_path / "out")
    assert set(finals) == {0}
    elastic_loop_reference(STEPS).check(finals[0], "node 0's worker")
    world = finals[0]["world"]
    assert world == [2] * world.index(1) + [1] * (len(world) - world.index(1)), world
    recovery = next(t for t in finals[0]["times"] if t > killed_at) - killed_at
    print(f"recovery from a lost launcher: {recovery:.2f} s (incl. one step)")


@pytest.mark.timeout(60)
def test_nodes_with_different_widths_stop_with_the_reason(tmp_path):
    """Two launchers on one host (127.0.0.1), -n 1 and -n 2: both stop at once, saying why."""
    run = [sys.executable, "-m", "towers", "run", str(SCRIPTS / "elastic_loop.py"), "--elastic",
           "--nnodes", "2", "--master-port", str(unused_port())]  # fmt: skip
    script = ["--", "--progress", str(tmp_path), "--out", str(tmp_path)]
    env = {**os.environ, "PYTHONPATH": SRC}
    nodes = [
        subprocess.Popen(
            [*run, "-n", str(n), "--node-rank", str(n - 1), *script],
            env=env,
            stderr=subprocess.PIPE,
            text=True,
        )
        for n in (1, 2)
    ]
    try:
        logs = [node.communicate(timeout=40)[1] for node in nodes]
    finally:
        for node in nodes:
            if node.poll() is None:
                node.kill()
                node.communicate()
    assert [node.returncode for node in nodes] == [2, 2], logs
    reason = "-n 2 here but -n 1 on node 0: every node needs the same -n"
    assert f"towers run (node 1): {reason}" in logs[1]
    assert f"towers run (node 0): node 1: {reason}" in logs[0]
    assert processes_mentioning(tmp_path) == []


@pytest.mark.timeout(60)
def test_a_node_that_never_connects_fails_the_job_after_the_timeout(tmp_path, capsys):
    from towers.processes.elastic_launch import run_script_nodes

    args = ["--progress", str(tmp_path), "--out", str(tmp_path)]
    port = unused_port()  # outside the ephemeral range: no connection's port takes it
    code = run_script_nodes(
        str(SCRIPTS / "elastic_loop.py"), 1, args, nnodes=2, node_rank=0, addr="127.0.0.1",
        port=port, timeout=3,
    )  # fmt: skip
    assert code == 1
    err = capsys.readouterr().err
    assert f"node 1 never connected to the job's store at 127.0.0.1:{port} within 3 s" in err
    assert processes_mentioning(tmp_path) == []


def _grower(
    host, master, rank: int | None, port: int, tmp: Path, secret: str, steps: int,
    extra: tuple = (),
):  # fmt: skip
    ranked = () if rank is None else ("--node-rank", str(rank))  # None: the first free
    args = [sys.executable, "-m", "towers", "run", str(SCRIPTS / "elastic_loop.py"),
            "-n", "1", "--elastic", "--nnodes", "2:4", *ranked,
            "--master-addr", master.addr, "--master-port", str(port),
            "--", "--progress", str(tmp / "progress"), "--out", str(tmp / "out"),
            "--steps", str(steps), "--sleep", "0.05", "--hold", str(tmp / "go"),
            *extra]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if not k.startswith(("GLOO_", "MASTER_", "TOWERS"))}
    env |= {"PYTHONPATH": SRC, "OMP_NUM_THREADS": "1", "TOWERS_SECRET": secret}
    return host.popen(args, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_host_that_joins_mid_run_grows_the_job_and_others_are_refused(tmp_path):
    """``--nnodes 2:4``: hosts 0 and 1 start (one worker each, no node ranks given: the host
    with the address hosts the store, the other takes rank 1) and hold after 4 steps; node 3, whose
    script builds a wider model, is refused before the job waits for it; host 2's towers run is
    launched (without a rank: it takes 2, the first free), and a launcher with another secret
    beside it, which is refused; once host 2's worker runs (its node taken), a second launcher
    for node 2 is refused too (the job has its 4 nodes), and so is one without a node rank (none
    is free). Then the job goes on, host 2's newcomer joins at a step with the live state, and
    everyone ends with a plain loop's parameters."""
    (tmp_path / "progress").mkdir()
    (tmp_path / "out").mkdir()
    port, steps, secret = random.randrange(20000, 30000), 30, "the secret of the growing job"
    with three_hosts() as (a, b, c):
        nodes = [_grower(h, a, None, port, tmp_path, secret, steps) for h in (a, b)]
        refused, logs, said = [], [], []
        try:
            progress, deadline = tmp_path / "progress", time.monotonic() + 60
            while sum(f.stat().st_size for f in progress.iterdir()) < 4:
                assert time.monotonic() < deadline, "the job made no progress"
                assert all(n.poll() is None for n in nodes), [n.communicate() for n in nodes]
                time.sleep(0.02)
            other = _grower(c, a, 3, port, tmp_path, secret, steps, ("--hidden", "16"))
            refused.append(other)
            said.append(other.communicate(timeout=60)[0])
            launched = time.time()
            nodes.append(_grower(c, a, None, port, tmp_path, secret, steps))
            refused.append(_grower(c, a, 2, port, tmp_path, "another secret", steps))
            # each wait has its own minute, from what it waits for: a bound that only catches
            # a hang, never the sum of the steps before it on a loaded machine
            deadline = time.monotonic() + 60
            while len(_family(nodes[2].pid)) < 2:  # its worker started: node 2 is taken
                assert time.monotonic() < deadline, "node 2 started no worker"
                assert nodes[2].poll() is None, nodes[2].communicate()
                time.sleep(0.02)
            refused.append(_grower(c, a, 2, port, tmp_path, secret, steps))
            refused.append(_grower(c, a, None, port, tmp_path, secret, steps))
            said += [r.communicate(timeout=60)[0] for r in refused[1:]]
            # node 2's newcomer (id 3) asks in from ctx.replicate: let the job go on once it is
            # there, or on a busy machine the job may end before it is built
            deadline = time.monotonic() + 60
            while not (tmp_path / "out" / "replicating-3").exists():
                assert time.monotonic() < deadline, "node 2's worker never got to replicate"
                assert nodes[2].poll() is None, nodes[2].communicate()
                time.sleep(0.02)
            (tmp_path / "go").touch()
            logs = [node.communicate(timeout=60)[0] for node in nodes]
        finally:
            left = reap(nodes + refused, tmp_path)
    why = "\n".join(log[-3000:] for log in logs + said)
    assert [node.returncode for node in nodes] == [0, 0, 0], why
    assert [r.returncode for r in refused] == [2, 1, 2, 2], why
    differs = (
        "is not let into the running job: its model differs from the job's at parameter #0: the "
        "job has parameter '0.weight' [8, 3] torch.float32, this worker parameter '0.weight' "
        "[16, 3] torch.float32; start every worker with the same script and arguments"
    )
    assert differs in said[0], why
    assert "towers run (node 3): refused: the running job did not let its workers in" in said[0]
    assert "towers run (node 2): another towers job (job " in said[1], why
    full = "refused: node 2 is already in the job (another towers run has --node-rank 2); the"
    assert f"{full} job already has its 4 nodes (--nnodes 2:4)" in said[2], why
    free = "refused: no node rank is free: the job already has its 4 nodes (--nnodes 2:4)"
    assert f"towers run (this node): {free}" in said[3], why
    assert left == [], why
    assert "towers run: node 2 joins the job" in logs[0], why
    refused = "towers run: newcomers [2] were not let in (their nodes said why); the others"
    assert refused in logs[0] and "were lost" not in logs[0], why

    finals = saved_finals(tmp_path / "out")
    assert set(finals) == {0, 1, 3}, why  # node 2's worker: id 3 (id 2 went to node 3's)
    reference = elastic_loop_reference(steps)
    for final in finals.values():
        assert final["steps"] == steps, why
        reference.check(final["model"], f"a worker, {why}")
    reference.check_losses(finals[0]["losses"])
    world = finals[0]["world"]  # 2 towers, then 3 from the step host 2's worker is let in
    k = world.index(3)
    assert k >= 4 and world == [2] * k + [3] * (steps - k), world
    assert finals[3]["world"] == [3] * (steps - k), finals[3]["world"]
    joined = finals[3]["times"][0] - launched  # the job held for the refusals meanwhile
    print(f"from host 2's launch to its first step: {joined:.2f} s; joined at step {k + 1}")
