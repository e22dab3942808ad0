"""Modes as objects, without processes: the registry, parsing, what each mode says about itself."""

from __future__ import annotations

import pickle
from typing import ClassVar

import pytest

import towers.core.modes as core_modes
from towers.core.modes import MODES, Engine, Mode, parse_mode, register
from towers.engines import modes
from towers.engines.ps.mode import ServerMode
from towers.engines.ps.policies import AsyncPolicy, BackupPolicy, LocalPolicy, SspPolicy
from towers.engines.ps.worker import Gradients, LocalSteps


def test_the_registry_holds_every_mode_in_order():
    assert list(MODES) == ["sync", "async", "ssp", "local", "backup", "diloco", "sparseloco"]
    assert MODES["sync"] is modes.Sync and MODES["backup"] is modes.Backup


@pytest.mark.parametrize(
    ("text", "cls", "arg", "engine"),
    [
        ("sync", modes.Sync, None, Engine.SYNC),
        (" async ", modes.Async, None, Engine.SERVER),
        ("ssp:0", modes.Ssp, 0, Engine.SERVER),
        ("local:4", modes.Local, 4, Engine.SERVER),
        ("backup:1", modes.Backup, 1, Engine.SERVER),
        ("diloco:8", modes.Diloco, 8, Engine.SYNC),
        ("diloco:8:overlap", modes.Diloco, 8, Engine.SYNC),
        ("diloco:8:overlap:4", modes.Diloco, 8, Engine.SYNC),
        ("sparseloco:8", modes.SparseLoco, 8, Engine.SYNC),
    ],
)
def test_parsed_modes_are_objects_that_say_how_they_run(text, cls, arg, engine):
    mode = parse_mode(text)
    assert type(mode) is cls and mode.arg == arg and mode.engine is engine
    assert str(mode) == text.strip()  # what checkpoints store and compare
    assert mode == parse_mode(str(mode)) and hash(mode) == hash(parse_mode(str(mode)))
    assert pickle.loads(pickle.dumps(mode)) == mode  # it travels inside the Job
    assert mode.servers == (1 if engine is Engine.SERVER else 0)
    assert isinstance(mode, ServerMode) == (engine is Engine.SERVER)


def test_modes_with_different_arguments_or_names_differ():
    assert parse_mode("ssp:1") != parse_mode("ssp:2")
    assert parse_mode("ssp:1") != parse_mode("local:1")
    assert parse_mode("async") != parse_mode("sync")


@pytest.mark.parametrize(
    ("text", "error", "message"),
    [
        ("fast", ValueError, 'unknown mode \'fast\'; valid modes are "sync", "async", "ssp:S", '
         '"local:K", "backup:B", "diloco:H", "sparseloco:H"$'),
        ("sync:1", ValueError, "mode 'sync' takes no argument, got 'sync:1'"),
        ("ssp", ValueError, "mode 'ssp' needs an integer argument S, the most updates"),
        ("ssp:x", ValueError, "needs an integer argument"),
        ("ssp:-1", ValueError, r"mode 'ssp' needs S, .* \(>= 0\); got 'ssp:-1'"),
        ("local:0", ValueError, r"mode 'local' needs K, .* \(>= 1\); got 'local:0'"),
        (3, TypeError, "mode must be a string such as 'sync', got int"),
    ],
)  # fmt: skip
def test_the_registry_refuses_what_it_does_not_know(text, error, message):
    with pytest.raises(error, match=message):
        parse_mode(text)


def test_a_mode_checks_the_worker_count():
    parse_mode("backup:2").check_workers(3)
    with pytest.raises(ValueError, match="drops 2 shards per step but there are only 2 workers"):
        parse_mode("backup:2").check_workers(2)
    for text in ("sync", "async", "ssp:5", "local:7"):
        parse_mode(text).check_workers(1)


def test_each_server_mode_gives_its_policy_and_role():
    assert type(parse_mode("async").policy(3)) is AsyncPolicy
    ssp = parse_mode("ssp:2").policy(3)
    assert isinstance(ssp, SspPolicy) and ssp.bound == 2
    backup = parse_mode("backup:1").policy(3)
    assert isinstance(backup, BackupPolicy) and (backup.spares, backup.towers) == (1, 3)
    local = parse_mode("local:4")
    assert isinstance(local.policy(3), LocalPolicy) and not local.policy(3).server_optimizer
    role = local.role()
    assert isinstance(role, LocalSteps) and role.every == 4 and role.optimizer
    for text in ("async", "ssp:2", "backup:1"):
        assert type(parse_mode(text).role()) is Gradients


class Sleepy(Mode):
    """A mode made up for the test: one class and one registration."""

    name: ClassVar[str] = "sleepy"
    meaning: ClassVar[str | None] = "N, naps per step (>= 2)"
    minimum: ClassVar[int] = 2
    engine: ClassVar[Engine] = Engine.SYNC


def test_a_new_mode_is_one_class_and_one_registration(monkeypatch):
    monkeypatch.setattr(core_modes, "MODES", dict(MODES))
    assert register(Sleepy) is Sleepy
    mode = parse_mode("sleepy:3")
    assert type(mode) is Sleepy and mode.arg == 3 and str(mode) == "sleepy:3"
    with pytest.raises(ValueError, match=r"mode 'sleepy' needs N, naps per step \(>= 2\)"):
        parse_mode("sleepy:1")
    with pytest.raises(ValueError, match=r'"backup:B", "diloco:H", "sparseloco:H", "sleepy:N"$'):
        parse_mode("lazy")

    class Other(Sleepy):
        pass

    with pytest.raises(ValueError, match="mode 'sleepy' is registered twice"):
        register(Other)
    assert register(Sleepy) is Sleepy  # registering the same class again changes nothing


def test_what_a_mode_declares_is_what_its_plan_and_the_balance_check_do():
    """``reduces_every_step`` is the step plan's ``reduces`` (the loops arm before the backward
    by it), and ``exact_under_any_split`` decides alone whether a balanced split is refused."""
    from towers.core.compat import uneven_split_refusal
    from towers.engines.sync.mode import plan_for

    for name, cls in MODES.items():
        needed = [f.sample() for f in cls.fields if not f.optional]
        mode = parse_mode(":".join([name, *map(str, needed)]))
        refusal = uneven_split_refusal(mode)
        if mode.engine is Engine.SYNC:
            assert plan_for(mode).reduces == mode.reduces_every_step, name
            assert (refusal is None) == mode.exact_under_any_split, name
            if refusal is not None:
                assert refusal == (
                    f"in mode {str(mode)!r} each tower steps alone on its shard, so the split "
                    "changes what each tower learns"
                )
        else:
            assert refusal is None and not mode.reduces_every_step, name
    assert [n for n, c in MODES.items() if c.exact_under_any_split] == ["sync"]
