"""The ``towers`` command: ``towers demo``, ``towers compare``, ``towers run``, ``towers bench``."""

from __future__ import annotations

import argparse
import functools
import os
import sys
from collections.abc import Sequence
from pathlib import Path

from ..core.args import nnodes_of
from .cli_args import DEMO_OUT, build_parser

__all__ = ["main"]


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
    from .compare import compare, mode_of

    if args.link is not None:
        return _compare_link(args)
    args.workers = args.workers or 4

    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    try:
        for m in modes:
            parse_mode(mode_of(m)[0])
    except ValueError as exc:
        print(f"towers compare: --modes: {exc}", file=sys.stderr)
        return 2
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
    from ..core.launch import COMPRESS, MODE
    from ..core.modes import Engine, parse_mode
    from ..engines.transforms import compression
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
    if args.compress is not None:
        try:
            compression(args.compress)
        except ValueError as exc:
            print(f"towers run: --compress: {exc}", file=sys.stderr)
            return 2
        os.environ[COMPRESS] = args.compress  # read by a towers.ddp model in the script
    if args.show_ranks is not None and (args.elastic or max(args.show_ranks) >= processes):
        print(
            f"towers run: --show-ranks takes ranks in 0..{processes - 1}, without --elastic; "
            f"got {','.join(map(str, args.show_ranks))}",
            file=sys.stderr,
        )
        return 2
    try:
        args.nnodes = nnodes_of(args.nnodes)
    except ValueError as exc:
        print(f"towers run: {exc}", file=sys.stderr)
        return 2
    if args.nnodes[1] > 1 and not args.elastic:
        print("towers run: --nnodes > 1 needs --elastic (or use torchrun)", file=sys.stderr)
        return 2
    if args.node_timeout is not None and args.nnodes[1] < 2:
        print(
            "towers run: --node-timeout applies to --elastic --nnodes > 1 (how long node 0 "
            "waits for a silent host)",
            file=sys.stderr,
        )
        return 2
    try:
        secret = _secret(args.secret_file)
    except (OSError, ValueError) as exc:
        print(f"towers run: {exc}", file=sys.stderr)
        return 2
    if args.max_restarts < 0:
        print(f"towers run: --max-restarts must be >= 0, got {args.max_restarts}", file=sys.stderr)
        return 2
    if args.elastic:
        if mode.engine is not Engine.SYNC or args.max_restarts < 0:
            print("towers run: --elastic needs sync mode and --max-restarts >= 0", file=sys.stderr)
            return 2
        return _run_elastic(args, processes, secret)
    return run_script(
        args.script,
        processes,
        args.script_args,
        addr=args.addr,
        port=args.port,
        secret=secret,
        show_ranks=args.show_ranks,
        max_restarts=args.max_restarts,
    )


def _run_elastic(args: argparse.Namespace, processes: int, secret: str | None) -> int:
    from ..core.args import check_timeout, node_timeout_of
    from ..processes.elastic import run_script_elastic

    timeout = args.timeout
    try:
        check_timeout(timeout, "--timeout")
        if args.node_timeout is not None:
            check_timeout(args.node_timeout, "--node-timeout")
            node_timeout_of(timeout, args.node_timeout)
    except ValueError as exc:
        print(f"towers run: {exc}", file=sys.stderr)
        return 2
    if args.nnodes[1] > 1:
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


def _secret(path: str | None) -> str | None:
    """The job's secret: ``--secret-file``, else ``TOWERS_SECRET``, else none (a fresh one)."""
    from ..core.launch import read_launch
    from ..processes.env import read_secret_file

    if path is not None:
        return read_secret_file(path)
    return read_launch().secret


def _run_nodes(args: argparse.Namespace, processes: int, timeout: float, secret: str | None) -> int:
    from ..processes.elastic_launch import run_script_nodes

    least, most = args.nnodes
    rank = args.node_rank
    if args.port is None or (rank is not None and not 0 <= rank < most):
        span = "NNODES-1" if least == most else f"{most - 1} (MAX-1)"
        print(
            f"towers run: --nnodes > 1 needs --master-port, and --node-rank (if given) in "
            f"0..{span}, got --node-rank {rank}",
            file=sys.stderr,
        )
        return 2
    if secret is None:
        print(
            f"towers run ({'this node' if rank is None else f'node {rank}'}): no job secret "
            "(TOWERS_SECRET or --secret-file): the nodes cannot tell this job from another on "
            "the same port, and whoever reaches the port can disturb it; messages are limited to "
            "tensors and plain data. Give every node the same secret (docs/reliability.md, threat "
            "model)",
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
        node_timeout=args.node_timeout,
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


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    script_args: list[str] = []
    if "--" in argv:  # everything after the first -- belongs to the script of `towers run`
        cut = argv.index("--")
        argv, script_args = argv[:cut], argv[cut + 1 :]
    parser = build_parser({"demo": _demo, "compare": _compare, "run": _run, "bench": _bench})
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
