"""The ``towers`` command as a new user meets it: help for everything, and readable output."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from towers.core.modes import MODES, Engine, Mode
from towers.engines.transforms import COMPRESSIONS, Compression
from towers.tools.bench import ARMS
from towers.tools.cli_args import BENCH_ARMS, build_parser

SRC = str(Path(__file__).resolve().parents[1] / "src")


def _commands() -> dict[str, argparse.ArgumentParser]:
    parser = build_parser(dict.fromkeys(("demo", "compare", "run", "bench"), lambda a: 0))
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(sub.choices)


def test_every_command_and_option_says_what_it_does_and_its_default():
    commands = _commands()
    assert set(commands) == {"demo", "compare", "run", "bench"}
    for name, command in commands.items():
        assert command.description, f"towers {name} has no description"
        for action in command._actions:
            if isinstance(action, argparse._HelpAction):
                continue
            where = f"towers {name} {'/'.join(action.option_strings) or action.dest}"
            assert action.help, f"{where} has no help"
            if action.option_strings and not isinstance(action, argparse._StoreTrueAction):
                assert "default" in action.help, f"{where} does not say its default"
    # the values the help lists are the ones the code accepts
    assert list(BENCH_ARMS) == ARMS


class Nap(Mode):
    """A mode made up for the test: registered, it is in the help."""

    name = "nap"
    help = "every tower naps N times a step"
    meaning = "N, naps per step (>= 1)"
    minimum = 1
    engine = Engine.SYNC


class Squeeze(Compression):
    """A compression made up for the test."""

    name = "squeeze"
    help = "every value squeezed"


def test_the_help_lists_every_registered_mode_and_compression(monkeypatch):
    monkeypatch.setitem(MODES, Nap.name, Nap)
    monkeypatch.setitem(COMPRESSIONS, Squeeze.name, Squeeze)
    run, compare = _commands()["run"].format_help(), _commands()["compare"].format_help()
    flat = " ".join(compare.split())  # argparse wraps the options' help
    for cls in MODES.values():
        for text in (run, compare):
            assert cls.synopsis() in text and cls.summary().split()[-1] in text, cls.name
        assert f" {cls.usage()}," in flat or f" {cls.usage()} (default" in flat, cls.name
    assert "nap:N" in run and "every tower naps N times a step" in run
    default = _commands()["compare"].get_default("modes")
    assert default == "sync,sync+balance,async,ssp:2,local:4,backup:1,diloco:4,sparseloco:4,nap:1"
    for cls in COMPRESSIONS.values():
        assert cls.synopsis() in compare and cls.typical() in flat, cls.name
    assert "squeeze" in compare and "every value squeezed" in compare


def test_run_usage_and_options_agree_and_say_that_the_separator_is_optional():
    text = _commands()["run"].format_help()
    assert "towers run SCRIPT [-n N]" in text and "-n N, --nproc N" in text
    assert "The -- before them is optional" in text and "[--] [ARGS ...]" in text


def test_nnodes_takes_m_or_min_max_as_torchrun_does():
    from towers.core.args import nnodes_of

    assert nnodes_of("3") == (3, 3)
    assert nnodes_of("2:4") == (2, 4)
    assert nnodes_of(" 1:1 ") == (1, 1)
    for spec in ("", "a", "2:", ":3", "1:2:3", "1.5", "2-3"):
        with pytest.raises(ValueError, match=r"--nnodes takes M or MIN:MAX \(whole numbers"):
            nnodes_of(spec)
    with pytest.raises(ValueError, match=r"--nnodes 0:2: MIN must be >= 1"):
        nnodes_of("0:2")
    with pytest.raises(ValueError, match=r"--nnodes 3:2: MIN \(3\) is above MAX \(2\)"):
        nnodes_of("3:2")


def test_a_bad_nnodes_or_a_node_rank_past_max_is_refused_at_once(capsys, tmp_path):
    from towers.tools.cli import main

    script = tmp_path / "s.py"
    script.write_text("")
    node = ["run", str(script), "--elastic", "--master-port", "29500", "--nnodes"]
    for spec, said in (("3:2", "MIN (3) is above MAX (2)"), ("x:2", "got 'x:2'")):
        assert main([*node, spec]) == 2
        assert said in capsys.readouterr().err
    assert main([*node, "2:3", "--node-rank", "3"]) == 2
    err = capsys.readouterr().err
    assert "--node-rank (if given) in 0..2 (MAX-1), got --node-rank 3" in err
    assert main(["run", str(script), "--nnodes", "1:2"]) == 2
    assert "--nnodes > 1 needs --elastic" in capsys.readouterr().err
    assert main(["run", str(script), "--compress", "int7"]) == 2
    assert "towers run: --compress: " in capsys.readouterr().err
    assert main(["run", str(script), "--max-restarts", "-1"]) == 2
    assert "--max-restarts must be >= 0, got -1" in capsys.readouterr().err
    assert "TOWERS_COMPRESS" not in os.environ


SCRIPT = textwrap.dedent(
    """
    import os
    import sys

    rank = int(os.environ["RANK"])
    print(f"hello from {rank} of {os.environ['WORLD_SIZE']}, args {sys.argv[1:]}")
    print(f"warning on {rank}", file=sys.stderr)
    print(f"[rank{rank}]: named already, as PyTorch names a rank's traceback", file=sys.stderr)
    sys.stdout.write("no newline at the end")
    if "--fail" in sys.argv and rank == 1:
        print("rank 1 cannot go on", file=sys.stderr)
        sys.exit(3)
    """
)


def towers_run(tmp_path: Path, *args: str, fresh: bool = False) -> subprocess.CompletedProcess[str]:
    """``towers run`` of a script that needs no torch; ``fresh``: its ranks are new interpreters,
    not forked from a zygote that imports torch for them (the same output, less CPU)."""
    script = tmp_path / "hello.py"
    script.write_text(SCRIPT)
    cmd = [sys.executable, "-m", "towers", "run", str(script), *args]
    env = {**os.environ, "PYTHONPATH": SRC, **({"TOWERS_START_METHOD": "spawn"} if fresh else {})}
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=50)


@pytest.mark.timeout(100)  # two launchers, each call bounded by 50 s
def test_towers_run_prefixes_every_line_with_its_rank(tmp_path):
    done = towers_run(tmp_path, "-n", "2", "--x", "1")  # no --: --x is not an option of run
    assert done.returncode == 0, done.stderr
    for rank in range(2):
        assert f"[rank{rank}]: hello from {rank} of 2, args ['--x', '1']\n" in done.stdout
        assert f"[rank{rank}]: no newline at the end\n" in done.stdout
        assert f"[rank{rank}]: warning on {rank}\n" in done.stderr
        assert f"\n[rank{rank}]: named already, as PyTorch" in done.stderr  # not twice
    assert all(line.startswith(("[rank0]: ", "[rank1]: ")) for line in done.stdout.splitlines())
    alone = towers_run(tmp_path, "-n", "1", fresh=True)  # one rank: its output as it is
    assert alone.stdout == "hello from 0 of 1, args []\nno newline at the end"


@pytest.mark.slow
@pytest.mark.timeout(150)  # four launchers, each importing torch; each call is bounded by 50 s
def test_towers_run_shows_only_the_ranks_asked_for(tmp_path):
    done = towers_run(tmp_path, "-n", "3", "--show-ranks", "0", fresh=True)
    assert done.returncode == 0, done.stderr
    assert done.stdout == "hello from 0 of 3, args []\nno newline at the end"
    assert "warning on 0" in done.stderr and "on 1" not in done.stderr
    two = towers_run(tmp_path, "-n", "3", "--show-ranks", "0,2", fresh=True)
    assert "[rank2]: hello from 2 of 3" in two.stdout and "from 1" not in two.stdout
    # a hidden rank that fails still tells why (forked, as by default)
    failed = towers_run(tmp_path, "-n", "2", "--show-ranks", "0", "--", "--fail")
    assert failed.returncode == 3
    assert "towers run: rank 1 failed with exit code 3\n" in failed.stderr
    assert "[rank1]: rank 1 cannot go on" in failed.stderr
    wrong = towers_run(tmp_path, "-n", "2", "--show-ranks", "2", fresh=True)
    assert wrong.returncode == 2 and "--show-ranks takes ranks in 0..1" in wrong.stderr
