"""Nothing from the network runs code; one job per store; listeners on the address given.

docs/reliability.md, "Threat model", lists what each test here shows. The attacks come from real
processes: another user's process (uid 65534) that reaches an elastic job's store, a rank of a
group that sends a pickle, a second job on the same port, a second host with another secret.
"""

from __future__ import annotations

import os
import random
import shutil
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from exact import Reference
from helpers import elastic_loop_reference
from netns import two_hosts, unavailable

import towers
from towers.comm.base import DistComm
from towers.comm.group import init_process_group
from towers.comm.objects import RefusedMessage, decode, encode
from towers.comm.store import (
    ForeignJob,
    client_store,
    get_signed,
    host_store,
    listen,
    put_signed,
)
from towers.core.launch import read_launch
from towers.core.secret import JobSecret
from towers.tools.cli import main as cli

SCRIPTS = Path(__file__).parent / "scripts"
SRC = str(Path(__file__).resolve().parents[1] / "src")


class Payload:
    """Unpickling this creates the marker file: code run in whoever unpickles it."""

    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


def test_what_derives_from_a_secret_reveals_nothing_of_it():
    a, b = JobSecret("correct horse battery staple"), JobSecret("another secret entirely")
    assert a == JobSecret("correct horse battery staple") and a != b
    assert len({a.prefix, b.prefix}) == 2 and len({a.job_id, b.job_id}) == 2
    assert a.job_id not in a.prefix  # the published id does not give the keys' prefix away
    assert "horse" not in repr(a) + a.prefix + a.job_id
    tag = a.sign(b"purpose", b"data")
    assert a.verify(b"purpose", b"data", tag)
    assert not a.verify(b"purpose", b"datA", tag)
    assert not a.verify(b"other", b"data", tag)
    assert not b.verify(b"purpose", b"data", tag)


def test_a_message_not_signed_with_the_jobs_secret_is_refused_unread(tmp_path):
    marker = tmp_path / "ran"
    mine, theirs = JobSecret("the job's secret"), JobSecret("someone else's")
    state = {"step": 3, "params": torch.arange(4.0), "when": (1.5, None)}
    back = decode(encode(state, mine), mine, "rank 1")
    assert back["step"] == 3 and back["when"] == (1.5, None)
    torch.testing.assert_close(back["params"], torch.arange(4.0))
    forged = [
        encode(Payload(str(marker)), theirs),  # signed, with another secret
        encode(Payload(str(marker)), None),  # unsigned
        __import__("pickle").dumps(Payload(str(marker))),  # torch's own object messages
    ]
    for blob in forged:
        with pytest.raises(RefusedMessage, match="refused an object message from rank 1"):
            decode(blob, mine, "rank 1")
    blob = bytearray(encode("fine", mine))
    blob[-1] ^= 1  # one bit changed on the way
    with pytest.raises(RefusedMessage, match="not signed with this job's secret"):
        decode(bytes(blob), mine, "rank 1")
    assert not marker.exists()


def test_without_a_secret_only_tensors_and_plain_data_are_read(tmp_path):
    marker = tmp_path / "ran"
    plain = {"rng": torch.get_rng_state(), "sig": [("parameter", "w", (3, 2), "torch.float32")]}
    plain |= {"empty": b"", "bytes": b"\x00\x01", "nested": [{1: 2.5}, None, "s"]}
    back = decode(encode(plain, None), None, "rank 0")
    assert (
        back["sig"] == plain["sig"] and back["empty"] == b"" and back["nested"] == plain["nested"]
    )
    torch.testing.assert_close(back["rng"], plain["rng"])
    import io

    out = io.BytesIO()
    torch.save(Payload(str(marker)), out)
    with pytest.raises(RefusedMessage, match="only tensors and plain data are accepted"):
        decode(b"TWRS\x00" + out.getvalue(), None, "rank 2")
    with pytest.raises(RefusedMessage, match="runs with a job secret and this process without"):
        decode(encode(1, JobSecret("s")), None, "rank 2")
    assert not marker.exists()


def _victim_and_intruder(secret: str | None, marker: str) -> str:
    """Rank 1 sends a pickle with torch's own all_gather_object; rank 0 gathers with towers'."""
    init_process_group(read_launch())
    try:
        if dist.get_rank() == 1:
            try:
                dist.all_gather_object([None, None], Payload(marker))
            except Exception as exc:  # towers' message is no pickle for it either
                return f"intruder: {type(exc).__name__}"
            return "intruder: done"
        comm = DistComm(secret=None if secret is None else JobSecret(secret))
        try:
            comm.all_gather_object("rank 0's own")
        except RefusedMessage as exc:
            return str(exc)
        return "accepted"
    finally:
        dist.destroy_process_group()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("secret", ["the job's secret", None])
def test_a_pickle_sent_by_a_rank_of_the_group_is_refused_naming_it(tmp_path, secret):
    marker = tmp_path / "ran"
    said, _ = towers.spawn(_victim_and_intruder, 2, secret, str(marker), timeout=50)
    assert said.startswith("refused an object message from rank 1"), said
    assert not marker.exists()


def test_membership_records_are_signed_for_their_key():
    secret = JobSecret("s" * 32)
    store = dist.TCPStore("127.0.0.1", 0, None, True, timedelta(seconds=5), wait_for_workers=False)
    put_signed(store, secret, "g0/members", "[0, 1]")
    assert get_signed(store, secret, "g0/members") == "[0, 1]"
    assert get_signed(store, JobSecret("t" * 32), "g0/members") is None
    assert get_signed(store, secret, "g1/members") is None  # absent
    store.set("g1/members", store.get("g0/members"))  # a signed record copied to another key
    assert get_signed(store, secret, "g1/members") is None
    store.set("g2/members", "0" * 64 + " [0, 1, 2]")
    assert get_signed(store, secret, "g2/members") is None
    assert get_signed(store, None, "g2/members") == "0" * 64 + " [0, 1, 2]"  # no secret: as is


def test_a_store_tells_its_own_job_from_another_before_anything_is_written():
    mine, theirs = JobSecret("m" * 32), JobSecret("t" * 32)
    host = host_store("127.0.0.1", 0, 5, mine)
    port = host.port
    client_store("127.0.0.1", port, 5, mine)  # the same job: let in
    before = host.num_keys()
    for other in (theirs, None):
        with pytest.raises(ForeignJob, match=rf"another towers job \(job {mine.job_id}, whose "):
            client_store("127.0.0.1", port, 5, other)
    assert host.num_keys() == before
    with pytest.raises(OSError, match=rf"127.0.0.1:{port}: .*the port is in use"):
        host_store("127.0.0.1", port, 5, mine)
    with pytest.raises(OSError, match=r"192\.0\.2\.1 is not an address of this host"):
        listen("192.0.2.1", 0)  # TEST-NET-1: never a local address


def _listening_ports(pid: int) -> list[int]:
    """Ports that process ``pid`` listens on (TCP, IPv4 and IPv6)."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    ports = []
    for table in ("tcp", "tcp6"):
        with open(f"/proc/{pid}/net/{table}") as f:
            for line in f.readlines()[1:]:
                fields = line.split()
                if fields[3] == "0A" and fields[9] in inodes:
                    ports.append(int(fields[1].rsplit(":", 1)[1], 16))
    return ports


def _wait_for(what: str, check, seconds: float = 30.0):
    deadline = time.monotonic() + seconds
    while True:
        found = check()
        if found:
            return found
        assert time.monotonic() < deadline, f"{what} did not happen within {seconds:g} s"
        time.sleep(0.02)


def _train_reference(steps: int) -> Reference:
    sys.path.insert(0, str(SCRIPTS))
    try:
        import elastic_train as job
    finally:
        sys.path.remove(str(SCRIPTS))
    return Reference.of(
        job.build(),
        job.data(),
        batch_size=12,
        steps=steps,
        optimizer=job.OPTIMIZER,
        shuffle=False,
        loss_fn=job.mse,
    )


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("setpriv") is None,
    reason="starting a process of another user needs root and setpriv(1)",
)
def test_another_users_process_cannot_join_an_elastic_job_or_run_code_in_it(tmp_path):
    """As found: a process of uid 65534 forges membership records in train(elastic=True)'s store
    and tries to join the group with a pickle. No code runs; the job trains on, unchanged."""
    marker, out, steps, go = tmp_path / "ran", tmp_path / "result.pt", 40, tmp_path / "go"
    env = {**os.environ, "PYTHONPATH": SRC, "OMP_NUM_THREADS": "1", "TRAIN_HOLD": str(go)}
    job = subprocess.Popen(
        [sys.executable, str(SCRIPTS / "elastic_train.py"), str(out), str(steps)],
        env=env,
        stderr=subprocess.PIPE,
        text=True,
    )
    # uid 65534 with no capability but reading and searching directories, to run this
    # interpreter wherever it is installed; started at once, told the port once it is known
    nobody = ["setpriv", "--reuid", "65534", "--regid", "65534", "--clear-groups"]
    nobody += ["--inh-caps", "+dac_read_search", "--ambient-caps", "+dac_read_search"]
    intruder = subprocess.Popen(
        [*nobody, sys.executable, str(SCRIPTS / "intruder.py"), str(marker)],
        env={"PYTHONPATH": SRC, "HOME": "/tmp", "PATH": os.environ.get("PATH", "")},
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    said, running_when_attacked = [], None
    try:
        port = _wait_for("the job's store", lambda: _listening_ports(job.pid))[0]
        intruder.stdin.write(f"{port} {job.pid}\n")
        intruder.stdin.close()
        for line in intruder.stdout:
            said.append(line)
            if line.startswith("forged"):
                running_when_attacked = job.poll() is None
                go.touch()  # the workers take their first shards, and may regroup
        intruder.wait(timeout=30)
        err = job.communicate(timeout=40)[1]
    finally:
        _stop(job, intruder)
    said = "".join(said)
    assert "uid 65534" in said and "cannot read the job's environment" in said, said
    assert "forged generation 1 as [0, 1, 2]" in said, said
    assert running_when_attacked, said
    assert "could not join" in said, said
    assert not marker.exists(), said
    assert job.returncode == 0, err[-3000:]
    _train_reference(steps).check(torch.load(out), "the job beside the intruder")


def _check_finals(out: Path, ranks: set[int], steps: int, why: str) -> None:
    finals = {int(p.stem.split("-")[1]): torch.load(p) for p in out.glob("*.pt")}
    assert set(finals) == ranks, why
    reference = elastic_loop_reference(steps)
    for rank, final in finals.items():
        reference.check(final, f"worker {rank}, {why}")


def _run_loop(args: list[str], tmp: Path, name: str, steps: int, **popen) -> subprocess.Popen:
    """``towers run elastic_loop.py`` with ARGS, held after 4 steps until tmp/name/go exists."""
    (tmp / name).mkdir()
    script = ["--", "--progress", str(tmp / name), "--out", str(tmp / name)]
    script += ["--steps", str(steps), "--sleep", "0.02", "--hold", str(tmp / name / "go")]
    cmd = [sys.executable, "-m", "towers", "run", str(SCRIPTS / "elastic_loop.py"), *args]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("GLOO_", "MASTER_", "TOWERS_"))}
    env |= {"PYTHONPATH": SRC, "OMP_NUM_THREADS": "1"}
    run = popen.pop("host", None)
    if run is not None:
        return run.popen([*cmd, *script], env=env, stderr=subprocess.PIPE)
    return subprocess.Popen([*cmd, *script], env=env, stderr=subprocess.PIPE, text=True)


def _steps_done(progress: Path) -> int:
    return sum(f.stat().st_size for f in progress.iterdir() if "-" in f.stem and f.suffix == "")


def _stop(*procs: subprocess.Popen | None) -> None:
    for proc in procs:
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.communicate()


def _listeners(host) -> list[tuple[str, int]]:
    """Every listening TCP socket in ``host``'s namespace: (hex address, port)."""
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        text = subprocess.run(host.command(["cat", table]), capture_output=True, text=True).stdout
        for line in text.splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A":
                addr, port = fields[1].rsplit(":", 1)
                found.append((addr, int(port, 16)))
    return found


def _hex(addr: str) -> str:
    """/proc/net/tcp's spelling of an IPv4 address (little-endian hex)."""
    return "".join(f"{int(part):02X}" for part in reversed(addr.split(".")))


@pytest.mark.slow
@pytest.mark.timeout(150)
@pytest.mark.parametrize("elastic", [False, True], ids=["plain", "elastic"])
def test_towers_run_listens_on_the_address_given_only(tmp_path, elastic):
    """In a fresh network namespace every listener is the job's: none may be on 0.0.0.0. A
    second job started on the same address and port while the first runs is refused at once,
    naming the job that holds the port, and the first trains on (the plain job)."""
    port, steps = random.randrange(20000, 30000), 12
    second = err2 = None
    with two_hosts() as (a, _):
        args = ["-n", "2", "--addr", a.addr, "--port", str(port)]
        job = _run_loop(args + (["--elastic"] if elastic else []), tmp_path, "job", steps, host=a)
        try:
            _wait_for("the job's 4 steps", lambda: _steps_done(tmp_path / "job") >= 8, 90)
            listening = _listeners(a)
            if not elastic:
                started = time.monotonic()
                second = _run_loop(args, tmp_path, "second", steps, host=a)
                err2 = second.communicate(timeout=90)[1]
                refused_in = time.monotonic() - started
                assert job.poll() is None, "the first job should still be running"
            (tmp_path / "job" / "go").touch()
            err = job.communicate(timeout=60)[1]
        finally:
            _stop(job, second)
    assert job.returncode == 0, err[-3000:]
    assert (_hex(a.addr), port) in listening, listening
    wildcard = [(addr, p) for addr, p in listening if set(addr) == {"0"}]
    assert wildcard == [], listening
    _check_finals(tmp_path / "job", {0, 1}, steps, err[-3000:])
    if second is not None:
        assert second.returncode != 0, err2[-3000:]
        assert "another towers job (job " in err2 and f"is using port {port}" in err2, err2[-3000:]
        assert "Give this job another port" in err2
        assert f"cannot listen for the rendezvous on {a.addr}:{port}" in err2  # its own rank 0
        assert "TimeoutError" not in err2
        assert refused_in < 60, refused_in  # not after the rendezvous timeout (60 s)
        assert not list((tmp_path / "second").glob("*.pt"))


def _node(host, master, rank: int, port: int, tmp: Path, secret_args: list[str], env=None):
    (tmp / f"node{rank}").mkdir(exist_ok=True)
    args = [sys.executable, "-m", "towers", "run", str(SCRIPTS / "elastic_loop.py"),
            "-n", "1", "--elastic", "--nnodes", "2", "--node-rank", str(rank),
            "--master-addr", master.addr, "--master-port", str(port), *secret_args,
            "--", "--progress", str(tmp / f"node{rank}"), "--out", str(tmp / "out"),
            "--steps", "30", "--sleep", "0.05"]  # fmt: skip
    base = {k: v for k, v in os.environ.items() if not k.startswith(("GLOO_", "MASTER_", "TOWERS"))}
    base |= {"PYTHONPATH": SRC, "OMP_NUM_THREADS": "1"} | (env or {})
    return host.popen(args, env=base, stderr=subprocess.PIPE)


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_node_with_another_secret_is_refused_and_the_job_goes_on(tmp_path):
    """Node 0 gets its secret from TOWERS_SECRET; two launchers claim node 1 with --secret-file:
    the one with a wrong secret is refused (naming the fix), the other trains with node 0."""
    if unavailable():
        pytest.skip(unavailable())
    (tmp_path / "out").mkdir()
    right, wrong = tmp_path / "right", tmp_path / "wrong"
    for path, text in ((right, "the shared secret of this job\n"), (wrong, "another secret")):
        path.write_text(text)
        path.chmod(0o600)
    port = random.randrange(20000, 30000)
    with two_hosts() as (a, b):
        node0 = _node(
            a, a, 0, port, tmp_path, [], {"TOWERS_SECRET": "the shared secret of this job"}
        )
        node1 = good = None
        try:  # both at once: on a loaded machine one after the other may pass node 0's timeout
            node1 = _node(b, a, 1, port, tmp_path, ["--secret-file", str(wrong)])
            good = _node(b, a, 1, port, tmp_path, ["--secret-file", str(right)])
            refused = node1.communicate(timeout=60)[1]
            logs = [node0.communicate(timeout=60)[1], good.communicate(timeout=60)[1]]
        finally:
            _stop(node0, node1, good)
    assert node1.returncode == 1, refused[-3000:]
    assert "towers run (node 1): another towers job (job " in refused, refused[-3000:]
    assert f"is using port {port}" in refused and "give every process the same secret" in refused
    assert "no job secret" not in refused
    assert [node0.returncode, good.returncode] == [0, 0], "\n".join(log[-3000:] for log in logs)
    _check_finals(tmp_path / "out", {0, 1}, 30, logs[0][-3000:])


def test_a_secret_file_others_can_read_or_an_empty_one_is_refused(tmp_path, capsys):
    script = tmp_path / "s.py"
    script.write_text("")
    secret = tmp_path / "secret"
    secret.write_text("s" * 40)
    secret.chmod(0o644)
    assert cli(["run", str(script), "--secret-file", str(secret)]) == 2
    assert f"can be read or written by other users (mode 0o644): chmod 600 {secret}" in (
        capsys.readouterr().err
    )
    secret.write_text("\n")
    secret.chmod(0o600)
    assert cli(["run", str(script), "--secret-file", str(secret)]) == 2
    assert "is empty: write the job's secret in it" in capsys.readouterr().err
    assert cli(["run", str(script), "--secret-file", str(tmp_path / "none")]) == 2
    assert "No such file" in capsys.readouterr().err


def _report_secret() -> tuple[bool, str | None]:
    return read_launch().secret is not None, os.environ.get("TOWERS_SECRET")


@pytest.mark.timeout(60)
def test_every_local_job_gets_its_own_secret_in_its_workers_environment():
    first = towers.spawn(_report_secret, 2)
    second = towers.spawn(_report_secret, 2)
    assert first[0][1] == first[1][1] and first[0][0]
    assert second[0][1] != first[0][1]
