"""What the ``towers`` command accepts: each command's description, options, help and defaults.

The commands themselves are in :mod:`towers.tools.cli`. Every option says its default and, where
only some values are valid, which: the modes and the compressions, with a line of help each,
are listed from their registries (:mod:`towers.core.specs`), so a new one appears here by being
registered.
"""

from __future__ import annotations

import argparse
import textwrap
from collections.abc import Callable, Iterable

from ..core.modes import MODES
from ..core.specs import Spec
from ..engines.transforms import COMPRESSIONS

__all__ = ["BENCH_ARMS", "DEMO_OUT", "build_parser", "options_help"]

Handler = Callable[[argparse.Namespace], int]
DEMO_OUT = "towers-demo/loss.png"
# towers.tools.bench.ARMS, named here without importing torch (tests/test_cli.py checks they agree)
BENCH_ARMS = (
    "single-1t",
    "single-Nt",
    "floor",
    "ddp",
    "towers-gloo",
    "towers-shm",
    "towers-async",
    "towers-nccl",
    "train-sync",
    "train-elastic",
    "train-even",
)


def _add_bench(sub: argparse._SubParsersAction, handler: Handler) -> None:
    bench = sub.add_parser(
        "bench",
        help="step times against one process and DDP, and an all-reduce sweep",
        description="Train the same model on the same global batches in every arm (one process "
        "with 1 and N threads, N processes without averaging, DDP over Gloo, towers on each "
        "transport, towers async), interleaved repeats, medians; then time all-reduces of 4 KB "
        "to 64 MB on each transport next to memcpy. Writes bench.json, bench.txt, sweep.png.",
    )
    bench.add_argument(
        "-n", "--workers", type=int, default=2, metavar="N", help="workers (default 2)"
    )
    bench.add_argument(
        "--models",
        default=None,
        metavar="M[,M...]",
        help="comma-separated, of mlp and cnn (default: both; '' for none, e.g. with --startup)",
    )
    bench.add_argument(
        "--arms",
        default=None,
        metavar="A[,A...]",
        help=f"comma-separated, of {', '.join(BENCH_ARMS)} (default: all but the train-* arms)",
    )
    bench.add_argument(
        "--steps", type=int, default=None, metavar="S", help="timed steps per run (default 20)"
    )
    bench.add_argument(
        "--warmup", type=int, default=None, metavar="W", help="untimed steps first (default 5)"
    )
    bench.add_argument(
        "--repeats",
        type=int,
        default=None,
        metavar="R",
        help="interleaved repeats, each running every arm once (default 3)",
    )
    bench.add_argument(
        "--buckets",
        default=None,
        metavar="MiB[,MiB...]",
        help="extra towers-shm arms with these bucket sizes in MiB (default 1,25)",
    )
    bench.add_argument(
        "--load",
        type=int,
        default=None,
        metavar="K",
        help="start K CPU-spinning processes beside every arm, as on a busy machine (default 0)",
    )
    bench.add_argument(
        "--startup",
        action="store_true",
        help="also time start-up: towers.train and towers run, first and later calls, and a "
        "first job in a fresh interpreter beside mp.spawn + DDP (--repeats times)",
    )
    bench.add_argument("--no-sweep", action="store_true", help="skip the all-reduce sweep")
    bench.add_argument(
        "--quick", action="store_true", help="a smoke run of well under a minute (tiny sizes)"
    )
    bench.add_argument(
        "--out", default="towers-bench", help="output directory (default %(default)s)"
    )
    bench.set_defaults(func=handler)


def _rank_list(text: str) -> tuple[int, ...]:
    try:
        ranks = tuple(int(r) for r in text.split(",") if r.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected ranks such as 0 or 0,2; got {text!r}") from None
    if not ranks or min(ranks) < 0:
        raise argparse.ArgumentTypeError(f"expected ranks such as 0 or 0,2; got {text!r}")
    return ranks


def _add_run(sub: argparse._SubParsersAction, handler: Handler) -> None:
    run = sub.add_parser(
        "run",
        help="run a script as N local workers (the torchrun environment)",
        usage="towers run SCRIPT [-n N] [--mode M] [--show-ranks R[,R...]] [--addr A] "
        "[--port P] [--secret-file F] [--max-restarts R] [--elastic [--timeout S] "
        "[--nnodes M|MIN:MAX [--node-rank R] [--node-timeout S]]] [--] [ARGS ...]",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="""\
Start N copies of SCRIPT with RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR and
MASTER_PORT set as torchrun sets them; stop them all if one fails. When more
than one rank's output is shown, each line starts with its rank: [rank1]: ...

ARGS go to the script. The -- before them is optional: it is needed only when
one of them is also an option of towers run (such as -n or --mode).

Every job gets a secret (TOWERS_SECRET in the workers' environment) that signs
its messages: a fresh one, or --secret-file / TOWERS_SECRET.

examples:
  towers run train.py -n 4 --lr 0.1
  towers run train.py -n 4 --show-ranks 0 -- --mode fast""",
        epilog=options_help("modes (--mode)", MODES.values()),
    )
    run.add_argument("script", metavar="SCRIPT", help="the Python script to run in every rank")
    run.add_argument("-n", "--nproc", type=int, default=2, metavar="N", help="workers (default 2)")
    run.add_argument(
        "--mode",
        default="sync",
        metavar="M",
        help=f"mode for towers.train in the script, one of {_modes()} (default sync); an "
        "asynchronous mode adds the parameter server as rank 0. A script on towers.ddp takes "
        "sync, diloco:H or sparseloco:H",
    )
    run.add_argument(
        "--compress",
        default=None,
        metavar="C",
        help="for a script on towers.ddp (a DDP script ported by its imports): how its "
        "gradients travel, one of bf16, fp16, int8, powersgd:R, topk:F[:BITS] (default: exact "
        "sums); TOWERS_COMPRESS under torchrun",
    )
    run.add_argument(
        "--show-ranks",
        type=_rank_list,
        default=None,
        metavar="R[,R...]",
        help="show only these ranks' output (default: every rank's, each line prefixed with "
        "its rank); --show-ranks 0: rank 0's alone, unprefixed. A hidden rank's last lines of "
        "standard error are shown if it fails",
    )
    run.add_argument(
        "--addr",
        "--master-addr",
        default="127.0.0.1",
        metavar="A",
        help="rendezvous address; the store listens there only (default 127.0.0.1: this "
        "machine only)",
    )
    run.add_argument(
        "--port",
        "--master-port",
        type=int,
        default=None,
        metavar="P",
        help="rendezvous port (default: a free one)",
    )
    run.add_argument(
        "--secret-file",
        default=None,
        metavar="F",
        help="the job's secret, read from F (mode 600), the same on every node; default: "
        "TOWERS_SECRET, else a fresh one (one host)",
    )
    _add_run_elastic(run)
    run.set_defaults(func=handler)


def _add_run_elastic(run: argparse.ArgumentParser) -> None:
    """``towers run``'s options for elastic jobs, across hosts or on one."""
    run.add_argument(
        "--nnodes",
        default="1",
        metavar="M|MIN:MAX",
        help="with --elastic: hosts, one towers run on each, N workers per host; MIN:MAX: the "
        "job starts with MIN and lets up to MAX - MIN more join while it runs (default 1)",
    )
    run.add_argument(
        "--node-rank",
        type=int,
        default=None,
        metavar="R",
        help="with --nnodes: this host's rank, 0 hosts the store; MIN..MAX-1 join a running "
        "job (default: 0 on the host that has --master-addr, else the first rank free, as "
        "torchrun's rendezvous hands them out)",
    )
    run.add_argument(
        "--elastic",
        action="store_true",
        help="own-loop scripts: go on without a worker that dies or hangs (docs/elastic.md)",
    )
    run.add_argument(
        "--max-restarts",
        type=int,
        default=0,
        metavar="R",
        help="with --elastic: replacements that may join a running job; without: restart every "
        "rank when one fails, up to R times, as torchrun's --max-restarts does (the script "
        "resumes from its own checkpoint; TORCHELASTIC_RESTART_COUNT says the attempt), the way "
        "a script on towers.ddp survives a lost worker (default 0)",
    )
    run.add_argument(
        "--timeout",
        type=float,
        default=60.0,
        metavar="S",
        help="with --elastic: seconds without an answer from the job before a host stops "
        "(default 60)",
    )
    run.add_argument(
        "--node-timeout",
        type=float,
        default=None,
        metavar="S",
        help="with --elastic --nnodes: seconds of silence from a host's towers run before node 0 "
        "drops its workers and the others train on; below --timeout (default: a quarter of "
        "--timeout)",
    )


def _compared() -> list[str]:
    """``towers compare``'s rows: every mode's typical form, and sync balanced beside sync."""
    typical = [cls.typical() for cls in MODES.values()]
    at = typical.index("sync") + 1 if "sync" in typical else len(typical)
    return [*typical[:at], "sync+balance", *typical[at:]]


def _modes() -> str:
    return ", ".join(cls.usage() for cls in MODES.values())


def options_help(title: str, specs: Iterable[type[Spec]]) -> str:
    """A help section: ``title``, then each option's forms and its line of help."""
    lines = [f"{title}:"]
    for cls in specs:
        lines += textwrap.wrap(
            cls.summary(),
            width=79,
            initial_indent=f"  {cls.synopsis():<24}",
            subsequent_indent=" " * 26,
        )
    return "\n".join(lines)


def _add_demo(sub: argparse._SubParsersAction, handler: Handler) -> None:
    demo = sub.add_parser(
        "demo",
        help="train the parabola with 1 and N local workers, in every mode",
        description="Fit the parabola y = x^2 (a 1-5-1 tanh net, 50 points, SGD lr 0.01) with "
        "1 and N workers in sync mode and with N workers in each asynchronous mode; print a "
        "table that explains its columns and rows and write a PNG of the loss curves. Then time "
        "a 1.86 M-parameter MLP in one process and with towers, one worker per core.",
    )
    demo.add_argument(
        "-n", "--workers", type=int, default=4, metavar="N", help="workers (default 4)"
    )
    demo.add_argument(
        "--steps",
        type=int,
        default=1000,
        metavar="S",
        help="global batches of the sync rows (default 1000)",
    )
    demo.add_argument(
        "--async-steps",
        type=int,
        default=200,
        metavar="S",
        help="global batches of the rows through the parameter server (async, ssp:2, local:4, "
        "backup:1), at most --steps (default 200)",
    )
    demo.add_argument(
        "--seed", type=int, default=0, help="seeds the initial weights and the batches (default 0)"
    )
    demo.add_argument(
        "--speed-steps",
        type=int,
        default=10,
        metavar="S",
        help="global batches of the speed comparison on an MLP; 0 skips it (default 10)",
    )
    demo.add_argument(
        "--out", default=DEMO_OUT, help="PNG of the loss curves (default %(default)s)"
    )
    demo.add_argument(
        "--faults",
        action="store_true",
        help="instead: an elastic run that loses a worker midway, against an undisturbed one",
    )
    demo.set_defaults(func=handler)


def _add_compare(sub: argparse._SubParsersAction, handler: Handler) -> None:
    cmp = sub.add_parser(
        "compare",
        help="train one problem in every mode, with and without a straggler",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description=textwrap.fill(
            "Train the same problem in every mode without and with one slowed tower; print "
            "mode, updates, final loss, time to a target loss, staleness and updates/s, and "
            "write a PNG of loss against wall time. With --link RATE instead: exact sums "
            "against each compression over a simulated link of RATE, time to a held-out loss.",
            width=79,
        ),
        epilog=options_help("modes (--modes)", MODES.values())
        + "\n\n"
        + options_help("compressions (--link compares each)", COMPRESSIONS.values()),
    )
    cmp.add_argument(
        "--problem",
        choices=["parabola", "digits"],
        default="parabola",
        help="parabola: the 1-5-1 net on 50 points; digits: a CNN on scikit-learn's 8x8 digits "
        "(default parabola)",
    )
    cmp.add_argument(
        "-n",
        "--workers",
        type=int,
        default=None,
        metavar="N",
        help="computing towers (default 4; with --link: 2)",
    )
    cmp.add_argument(
        "--steps",
        type=int,
        default=None,
        metavar="S",
        help="global batches per run (default: 500 for parabola, 300 for digits, 100 with --link)",
    )
    cmp.add_argument(
        "--modes",
        default=",".join(_compared()),
        metavar="M[,M...]",
        help=f"comma-separated modes, each one of {_modes()}, or sync+balance (sync with "
        "balance=True; plain sync keeps the even split) (default %(default)s)",
    )
    cmp.add_argument(
        "--straggler", type=int, default=1, metavar="T", help="the slowed tower (default 1)"
    )
    cmp.add_argument(
        "--factor",
        type=float,
        default=3.0,
        metavar="F",
        help="the straggler takes F times as long per shard, F >= 1 (default 3)",
    )
    cmp.add_argument(
        "--target",
        type=float,
        default=None,
        metavar="L",
        help="the loss whose first crossing is timed (default: 1.1 x sync's last loss)",
    )
    cmp.add_argument(
        "--seed", type=int, default=0, help="seeds the initial weights and the batches (default 0)"
    )
    cmp.add_argument(
        "--out", default="towers-compare/loss.png", help="PNG path (default %(default)s)"
    )
    cmp.add_argument(
        "--link",
        default=None,
        metavar="RATE",
        help="instead: exact sums against each compression ("
        + ", ".join(cls.typical() for cls in COMPRESSIONS.values())
        + ") over a SIMULATED link of RATE "
        "(e.g. 100mbit) between the workers: time to a held-out loss on the 28x28 digits MLP "
        "(default: off)",
    )
    cmp.set_defaults(func=handler)


def build_parser(handlers: dict[str, Handler]) -> argparse.ArgumentParser:
    """The ``towers`` parser; each command's ``func`` is its entry in ``handlers``."""
    parser = argparse.ArgumentParser(
        prog="towers",
        description="Data-parallel training of PyTorch models. Each command has its own "
        "--help (towers run --help).",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _add_demo(sub, handlers["demo"])
    _add_compare(sub, handlers["compare"])
    _add_run(sub, handlers["run"])
    _add_bench(sub, handlers["bench"])
    return parser
