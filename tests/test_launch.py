"""The launch record: every variable a launcher sets, parsed in one place (no processes)."""

from __future__ import annotations

import pytest

from towers.core.launch import Launch, parse_launch
from towers.processes.env import worker_env

TORCHRUN = {
    "RANK": "5",
    "WORLD_SIZE": "8",
    "LOCAL_RANK": "1",
    "LOCAL_WORLD_SIZE": "4",
    "GROUP_RANK": "1",
    "GROUP_WORLD_SIZE": "2",
    "MASTER_ADDR": "10.0.0.1",
    "MASTER_PORT": "29500",
    "TORCHELASTIC_USE_AGENT_STORE": "True",
    "TORCHELASTIC_RESTART_COUNT": "2",
}


def test_torchruns_variables_are_parsed_into_one_record():
    launch = parse_launch(TORCHRUN)
    assert launch == Launch(
        launched=True,
        rank=5,
        world_size=8,
        local_rank=1,
        local_world_size=4,
        group_rank=1,
        group_world_size=2,
        master_addr="10.0.0.1",
        master_port=29500,
        agent_store=True,
        restart_count=2,
    )
    with pytest.raises(AttributeError):
        launch.rank = 0  # type: ignore[misc]


def test_a_process_without_the_four_variables_is_a_world_of_one():
    for missing in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env = {k: v for k, v in TORCHRUN.items() if k != missing}
        launch = parse_launch(env | {"TOWERS_MODE": "async"})
        assert not launch.launched and launch.rank == 0 and launch.world_size == 1
        assert launch.mode == "async"  # towers' own variables apply all the same
    assert parse_launch({}) == Launch()


def test_towers_own_variables():
    base = parse_launch({})
    assert (base.mode, base.transport, base.elastic, base.joining) == ("sync", None, False, False)
    launch = parse_launch(
        {"TOWERS_MODE": "ssp:2", "TOWERS_TRANSPORT": "gloo", "TOWERS_ELASTIC": "join"}
    )
    assert (launch.mode, launch.transport, launch.elastic, launch.joining) == (
        "ssp:2",
        "gloo",
        True,
        True,
    )
    assert parse_launch({"TOWERS_ELASTIC": "1"}).joining is False
    assert parse_launch({"TOWERS_TRANSPORT": ""}).transport is None


def test_the_secret_is_parsed_but_never_shown():
    launch = parse_launch(TORCHRUN | {"TOWERS_SECRET": "hunter2-hunter2-hunter2"})
    assert launch.secret == "hunter2-hunter2-hunter2"
    assert "hunter2" not in repr(launch)
    with pytest.raises(ValueError, match="TOWERS_SECRET is set but empty"):
        parse_launch({"TOWERS_SECRET": " "})


def test_a_malformed_number_is_named():
    with pytest.raises(ValueError, match="LOCAL_RANK must be an integer, got 'one'"):
        parse_launch(TORCHRUN | {"LOCAL_RANK": "one"})


def test_what_the_launchers_write_is_what_the_workers_read():
    env = worker_env(3, 4, "127.0.0.1", 1234)
    launch = parse_launch(env)
    assert (launch.rank, launch.local_rank, launch.world_size, launch.local_world_size) == (
        3,
        3,
        4,
        4,
    )
    assert (launch.master_addr, launch.master_port, launch.group_world_size) == (
        "127.0.0.1",
        1234,
        1,
    )
    node = worker_env(
        5, 8, "10.0.0.1", 29500, local_rank=1, local_world_size=4, group_rank=1, group_world_size=2
    )
    expected = parse_launch(TORCHRUN)
    assert parse_launch(node) == Launch(
        **{**vars(expected), "agent_store": False, "restart_count": 0}
    )
    everything = Launch(
        launched=True,
        rank=2,
        world_size=3,
        local_rank=2,
        local_world_size=3,
        master_addr="h",
        master_port=9,
        mode="local:4",
        transport="shm",
        elastic=True,
        joining=True,
        secret="s" * 20,
    )
    assert parse_launch(everything.environ()) == everything
