"""The ``towers`` command: ``towers demo``, ``towers compare``, ``towers run``, ``towers bench``."""

from __future__ import annotations

import argparse
import functools
import os
import sys
from collections.abc import Sequence
from pathlib import Path

__all__ = ["main"]

DEMO_OUT = "towers-demo/loss.png"


def _demo(args: argparse.Namespace) -> int:
    if args.faults:
        from .faults import faults_demo

        if args.out == DEMO_OUT:
            args.out = "towers-demo/faults.png"
        return faults_demo(args)
    from .demo import demo

    return demo(args)


def _compare(args: argparse.Namespace) -> int:
    from ..core.modes import parse_mode
    from .compare import compare

    if args.link is not None:
        return _compare_link(args)
    args.workers = args.workers or 4

    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    for m in modes:
        parse_mode(m)
    if args.factor < 1:
        print(f"towers compare: --factor must be >= 1, got {args.factor}", file=sys.stderr)
        return 2
    if not 0 <= args.straggler < args.workers:
        print(
            f"towers compare: --straggler must be a tower in 0..{args.workers - 1}",
            file=sys.stderr,
        )
        return 2
    compare(
        args.problem,
        workers=args.workers,
        steps=args.steps,
        modes=modes,
        straggler=args.straggler,
        factor=args.factor,
        target=args.target,
        seed=args.seed,
        out=args.out,
        print_fn=functools.partial(print, flush=True),
    )
    return 0


def _compare_link(args: argparse.Namespace) -> int:
    from .slowlink import compare_link, parse_rate

    try:
        parse_rate(args.link)
    except ValueError as exc:
        print(f"towers compare: --link: {exc}", file=sys.stderr)
        return 2
    compare_link(
        args.link,
        workers=args.workers or 2,
        steps=args.steps or 100,
        print_fn=functools.partial(print, flush=True),
    )
    return 0


def _run(args: argparse.Namespace) -> int:
    from ..core.args import check_timeout
    from ..core.launch import MODE
    from ..core.modes import Engine, parse_mode
    from ..processes.launch import run_script

    try:
        mode = parse_mode(args.mode)
    except ValueError as exc:
        print(f"towers run: {exc}", file=sys.stderr)
        return 2
    if not Path(args.script).is_file():
        print(f"towers run: no such script: {args.script}", file=sys.stderr)
        return 2
    processes = args.nproc
    if mode.servers:
        # towers.train in the script trains in this mode; the parameter server is rank 0
        processes += mode.servers
        print(
            f"towers run: mode {mode}: rank 0 is the parameter server, ranks 1..{args.nproc} "
            "compute",
            file=sys.stderr,
        )
    os.environ[MODE] = str(mode)  # read by towers.train in the script
    if args.nnodes > 1 and not args.elastic:
        print("towers run: --nnodes > 1 needs --elastic (or use torchrun)", file=sys.stderr)
        return 2
    try:
        secret = _secret(args.secret_file)
    except (OSError, ValueError) as exc:
        print(f"towers run: {exc}", file=sys.stderr)
        return 2
    if args.elastic:
        from ..processes.elastic import run_script_elastic

        if mode.engine is not Engine.SYNC or args.max_restarts < 0:
            print("towers run: --elastic needs sync mode and --max-restarts >= 0", file=sys.stderr)
            return 2
        timeout = args.timeout
        try:
            check_timeout(timeout, "--timeout")
        except ValueError as exc:
            print(f"towers run: {exc}", file=sys.stderr)
            return 2
        if args.nnodes > 1:
            return _run_nodes(args, processes, timeout, secret)
        return run_script_elastic(
            args.script,
            processes,
            args.script_args,
            max_restarts=args.max_restarts,
            timeout=timeout,
            addr=args.addr,
            port=args.port,
            secret=secret,
        )
    return run_script(
        args.script, processes, args.script_args, addr=args.addr, port=args.port, secret=secret
    )


def _secret(path: str | None) -> str | None:
    """The job's secret: ``--secret-file``, else ``TOWERS_SECRET``, else none (a fresh one)."""
    from ..core.launch import read_launch
    from ..processes.env import read_secret_file

    if path is not None:
        return read_secret_file(path)
    return read_launch().secret


def _run_nodes(args: argparse.Namespace, processes: int, timeout: float, secret: str | None) -> int:
    from ..processes.elastic_nodes import run_script_nodes

    if args.port is None or not 0 <= args.node_rank < args.nnodes:
        print(
            "towers run: --nnodes > 1 needs --master-port and --node-rank in 0..NNODES-1",
            file=sys.stderr,
        )
        return 2
    if secret is None:
        print(
            f"towers run (node {args.node_rank}): no job secret (TOWERS_SECRET or "
            "--secret-file): the nodes cannot tell this job from another on the same port, and "
            "whoever reaches the port can disturb it; messages are limited to tensors and plain "
            "data. Give every node the same secret (docs/reliability.md, threat model)",
            file=sys.stderr,
        )
    return run_script_nodes(
        args.script,
        processes,
        args.script_args,
        nnodes=args.nnodes,
        node_rank=args.node_rank,
        addr=args.addr,
        port=args.port,
        max_restarts=args.max_restarts,
        timeout=timeout,
        secret=secret,
    )


def _bench(args: argparse.Namespace) -> int:
    from .bench import ARMS, BenchConfig, quick, run
    from .bench_report import table, write

    options: dict = {"workers": args.workers}
    for key, least in (("steps", 1), ("warmup", 0), ("repeats", 1), ("load", 0)):
        value = getattr(args, key)
        if value is not None and value < least:
            print(f"towers bench: --{key} must be >= {least}, got {value}", file=sys.stderr)
            return 2
        if value is not None:
            options[key] = value
    if args.models is not None:  # "" times no model (e.g. with --startup alone)
        options["models"] = tuple(m for m in args.models.split(",") if m)
    if args.arms:
        unknown = set(args.arms.split(",")) - set(ARMS)
        if unknown:
            print(f"towers bench: unknown arms {sorted(unknown)}; known: {ARMS}", file=sys.stderr)
            return 2
        options["arms"] = tuple(args.arms.split(","))
    if args.buckets is not None:
        options["bucket_mib"] = tuple(float(b) for b in args.buckets.split(",") if b)
    if args.no_sweep:
        options["sweep_bytes"] = ()
    if args.startup:
        options["startup"] = True
    cfg = quick(**options) if args.quick else BenchConfig(**options)
    results = run(cfg, log=lambda line: print(line, flush=True))
    paths = write(results, Path(args.out))
    print("\n" + table(results))
    print("\n" + "\n".join(f"{kind}: {path.resolve()}" for kind, path in paths.items()))
    return 0


def _add_bench(sub: argparse._SubParsersAction) -> None:
    bench = sub.add_parser(
        "bench",
        help="step times against one process and DDP, and an all-reduce sweep",
        description="Train the same model on the same global batches in every arm (one process "
        "with 1 and N threads, N processes without averaging, DDP over Gloo, towers on each "
        "transport, towers async), interleaved repeats, medians; then time all-reduces of 4 KB "
        "to 64 MB on each transport next to memcpy. Writes bench.json, bench.txt, sweep.png.",
    )
    bench.add_argument("-n", "--workers", type=int, default=2, help="workers (default 2)")
    bench.add_argument("--models", default=None, help="comma-separated: mlp,cnn (default both)")
    bench.add_argument("--arms", default=None, help="comma-separated subset of the arms")
    bench.add_argument("--steps", type=int, default=None, help="timed steps per run (20)")
    bench.add_argument("--warmup", type=int, default=None, help="untimed steps first (5)")
    bench.add_argument("--repeats", type=int, default=None, help="interleaved repeats (3)")
    bench.add_argument(
        "--buckets", default=None, help="extra towers-shm bucket sizes in MiB (default 1,25)"
    )
    bench.add_argument(
        "--load",
        type=int,
        default=None,
        metavar="K",
        help="start K CPU-spinning processes beside every arm, as on a busy machine (0)",
    )
    bench.add_argument(
        "--startup",
        action="store_true",
        help="also time start-up: towers.train and towers run, first and later calls",
    )
    bench.add_argument("--no-sweep", action="store_true", help="skip the all-reduce sweep")
    bench.add_argument("--quick", action="store_true", help="a smoke run of well under a minute")
    bench.add_argument("--out", default="towers-bench", help="output directory (%(default)s)")
    bench.set_defaults(func=_bench)


def _add_run(sub: argparse._SubParsersAction) -> None:
    run = sub.add_parser(
        "run",
        help="run a script as N local workers (the torchrun environment)",
        usage="towers run SCRIPT [-n N] [--mode M] [--addr A] [--port P] [--secret-file F] "
        "[--elastic [--max-restarts R] [--timeout S] [--nnodes M --node-rank R]] -- [ARGS ...]",
        description="Start N copies of SCRIPT with RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR and "
        "MASTER_PORT set as torchrun sets them; stop them all if one fails. Arguments after -- "
        "go to the script. Every job gets a secret (TOWERS_SECRET in the workers' environment) "
        "that signs its messages: a fresh one, or --secret-file / TOWERS_SECRET.",
    )
    run.add_argument("script")
    run.add_argument("-n", "--nproc", type=int, default=2, help="workers (default 2)")
    run.add_argument(
        "--mode",
        default="sync",
        help="mode for towers.train in the script (default sync); an asynchronous mode adds "
        "the parameter server as rank 0",
    )
    run.add_argument(
        "--addr",
        "--master-addr",
        default="127.0.0.1",
        help="rendezvous address; the store listens there only (default loopback)",
    )
    run.add_argument(
        "--port", "--master-port", type=int, default=None, help="rendezvous port (default: free)"
    )
    run.add_argument(
        "--secret-file",
        default=None,
        metavar="F",
        help="the job's secret, read from F (mode 600), the same on every node; default: "
        "TOWERS_SECRET, else a fresh one (one host)",
    )
    run.add_argument(
        "--nnodes",
        type=int,
        default=1,
        help="with --elastic: hosts, one towers run on each, N workers per host (default 1)",
    )
    run.add_argument(
        "--node-rank",
        type=int,
        default=0,
        help="with --nnodes: this host's rank (0 hosts the store)",
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
        help="with --elastic: replacements that may join a running job (default 0)",
    )
    run.add_argument(
        "--timeout",
        type=float,
        default=60.0,
        help="with --elastic: seconds without an answer from the job before a host stops "
        "(default 60)",
    )
    run.set_defaults(func=_run)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="towers", description="Data-parallel training of PyTorch models."
    )
    sub = parser.add_subparsers(dest="command", required=True)

    demo = sub.add_parser("demo", help="train the parabola with 1 and N local workers")
    demo.add_argument("-n", "--workers", type=int, default=4, help="workers (default 4)")
    demo.add_argument("--steps", type=int, default=1000, help="global batches (default 1000)")
    demo.add_argument(
        "--async-steps",
        type=int,
        default=200,
        help="global batches for the asynchronous rows (default 200)",
    )
    demo.add_argument("--seed", type=int, default=0)
    demo.add_argument(
        "--speed-steps",
        type=int,
        default=10,
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
    demo.set_defaults(func=_demo)

    cmp = sub.add_parser(
        "compare",
        help="train one problem in every mode, with and without a straggler",
        description="Train the same problem in every mode without and with one slowed tower; "
        "print mode, updates, final loss, time to a target loss, staleness and updates/s, and "
        "write a PNG of loss against wall time.",
    )
    cmp.add_argument("--problem", choices=["parabola", "digits"], default="parabola")
    cmp.add_argument(
        "-n", "--workers", type=int, default=None, help="computing towers (default 4; --link: 2)"
    )
    cmp.add_argument("--steps", type=int, default=None, help="global batches per run")
    cmp.add_argument(
        "--modes", default="sync,async,ssp:2,local:4,backup:1", help="comma-separated modes"
    )
    cmp.add_argument("--straggler", type=int, default=1, help="the slowed tower (default 1)")
    cmp.add_argument("--factor", type=float, default=3.0, help="its slowdown (default 3)")
    cmp.add_argument(
        "--target", type=float, default=None, help="loss target (default 1.1 x sync's last)"
    )
    cmp.add_argument("--seed", type=int, default=0)
    cmp.add_argument(
        "--out", default="towers-compare/loss.png", help="PNG path (default %(default)s)"
    )
    cmp.add_argument(
        "--link",
        default=None,
        metavar="RATE",
        help="instead: exact sums against each compression over a SIMULATED link of RATE "
        "(e.g. 100mbit) between the workers: time to a held-out loss on the 28x28 digits MLP",
    )
    cmp.set_defaults(func=_compare)

    _add_run(sub)
    _add_bench(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    script_args: list[str] = []
    if "--" in argv:  # everything after the first -- belongs to the script of `towers run`
        cut = argv.index("--")
        argv, script_args = argv[:cut], argv[cut + 1 :]
    parser = _parser()
    args, unknown = parser.parse_known_args(argv)
    if args.command != "run" and (unknown or script_args):
        parser.error(f"unrecognized arguments: {' '.join(unknown + script_args)}")
    args.script_args = unknown + script_args
    for name in ("workers", "nproc", "steps", "async_steps"):
        value = getattr(args, name, None)
        if value is not None and value < 1:
            print(f"towers {args.command}: --{name} must be >= 1, got {value}", file=sys.stderr)
            return 2
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
