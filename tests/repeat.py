"""Run tests many times and count how often each passes: ``python -m tests.repeat``.

    python -m tests.repeat -k partitions -n 20              # each selected test, 20 runs
    python -m tests.repeat tests/test_elastic.py -n 5 --busy 2   # beside 2 spinning processes
    python -m tests.repeat -k sync_matches -n 3 --tolerances     # how much of each bound is used
    python -m tests.repeat tests/test_balance.py -n 20 --workers 2 --keep /tmp/failed

Each run is one pytest process over the selection (``-n 0`` by default: one test at a time,
as "alone" means; ``--workers 3`` as the README's command runs them), with its own JUnit
report; the summary lists every test with its passes, failures and median time, the failures'
first lines, and the load average. With ``--busy K``, K processes spin on the CPU for the
whole repetition (``towers.tools.load.busy``). ``--tolerances`` records how much of its
float64-derived bound every check used (tests/exact.py: a value's distance from the float64
loop over the float32 loop's, which the bound allows up to ``FACTOR``) and prints the
largest per test. ``--keep DIR`` copies the report of every run with a failure into DIR: it
holds each test's captured output, so what a worker printed before it died (a C++ abort's
message) is there. The exit code is 0 only if every test passed in every run.
docs/testing.md records the rates measured with it.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _outcomes(report: Path) -> dict[str, tuple[str, float, str]]:
    """Test id -> (outcome, seconds, first line of the failure) from a JUnit report."""
    found = {}
    for case in ET.parse(report).iter("testcase"):
        test = f"{case.get('classname', '').replace('.', '/')}.py::{case.get('name')}"
        outcome, why = "passed", ""
        for kind in ("failure", "error", "skipped"):
            element = case.find(kind)
            if element is not None:
                outcome = {"failure": "failed", "error": "error", "skipped": "skipped"}[kind]
                message = (element.get("message") or "").splitlines() or [""]
                why = message[0][:160] if kind != "skipped" else ""
                break
        found[test] = (outcome, float(case.get("time", 0.0)), why)
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m tests.repeat", description=(__doc__ or "").split("\n")[0]
    )
    parser.add_argument("paths", nargs="*", help="test files or ids (default: tests/)")
    parser.add_argument("-k", dest="pattern", help="pytest's -k expression")
    parser.add_argument("-m", dest="marker", help="pytest's -m expression")
    parser.add_argument("-n", "--runs", type=int, default=20, help="repetitions (default 20)")
    parser.add_argument("--busy", type=int, default=0, help="spinning processes beside the runs")
    parser.add_argument("--workers", default="0", help="pytest-xdist processes (default 0)")
    parser.add_argument("--tolerances", action="store_true", help="report the bounds' use")
    parser.add_argument(
        "--keep", type=Path, help="copy the JUnit report of a run that failed here (with every "
        "test's captured output: what a worker printed before it died)"
    )  # fmt: skip
    args = parser.parse_args(argv)
    if args.runs < 1:
        parser.error(f"--runs must be >= 1, got {args.runs}")

    from towers.tools.load import busy

    selection = [*(args.paths or ["tests"])]
    if args.pattern:
        selection += ["-k", args.pattern]
    if args.marker:
        selection += ["-m", args.marker]
    results: dict[str, list[tuple[str, float, str]]] = defaultdict(list)
    walls, loads = [], []
    with tempfile.TemporaryDirectory() as tmp, busy(args.busy):
        env = dict(os.environ)
        log = Path(tmp) / "tolerances.jsonl"
        if args.tolerances:
            env["TOWERS_TOLERANCE_LOG"] = str(log)
        for run in range(args.runs):
            report = Path(tmp) / f"run-{run}.xml"
            command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n"]
            command += [args.workers, f"--junitxml={report}", "-o", "junit_logging=all"]
            command += selection
            began = time.monotonic()
            done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True)
            walls.append(time.monotonic() - began)
            loads.append(os.getloadavg()[0])
            if not report.exists():
                print(done.stdout[-3000:] + done.stderr[-3000:], file=sys.stderr)
                return 2
            for test, outcome in _outcomes(report).items():
                results[test].append(outcome)
            failed = sum(o[0] in ("failed", "error") for o in _outcomes(report).values())
            print(f"run {run + 1}/{args.runs}: {walls[-1]:.0f} s, {failed} failed, "
                  f"load {loads[-1]:.1f}", flush=True)  # fmt: skip
            if failed and args.keep:
                args.keep.mkdir(parents=True, exist_ok=True)
                print(f"  its report: {shutil.copy(report, args.keep / report.name)}", flush=True)
        used = _bounds_used(log) if args.tolerances else {}
    return _summary(results, walls, loads, args, used)


def _bounds_used(log: Path) -> dict[str, float]:
    """Test id -> the largest ratio of a check: towers' distance from the float64 loop over
    the float32 loop's (tests/exact.py allows up to ``FACTOR``)."""
    used: dict[str, float] = {}
    if log.exists():
        for line in log.read_text().splitlines():
            entry = json.loads(line)
            used[entry["test"]] = max(used.get(entry["test"], 0.0), entry["ratio"])
    return used


def _summary(results, walls, loads, args, used: dict[str, float]) -> int:
    bad = 0
    wall, low, high = statistics.median(walls), min(loads), max(loads)
    print(f"\n{len(results)} tests, {args.runs} runs (workers {args.workers}, busy {args.busy}): "
          f"median run {wall:.0f} s, load {low:.1f}-{high:.1f}")  # fmt: skip
    for test, outcomes in sorted(results.items()):
        passed = sum(o[0] == "passed" for o in outcomes)
        skipped = sum(o[0] == "skipped" for o in outcomes)
        failures = [o[2] for o in outcomes if o[0] in ("failed", "error")]
        bad += bool(failures)
        median = statistics.median(o[1] for o in outcomes)
        ratio = f"  x{used[test]:.2f} of float32's distance" if test in used else ""
        status = "skipped" if skipped == len(outcomes) else f"{passed}/{len(outcomes) - skipped}"
        print(f"{status:>7}  {median:6.1f} s  {test}{ratio}")
        for why in failures[:3]:
            print(f"           {why}")
    if used:
        largest = max(used.values())
        print(f"largest distance from float64, over a float32 loop's: x{largest:.2f} (FACTOR 4)")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
