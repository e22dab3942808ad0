"""The ``towers`` command: ``towers demo``, ``towers run``, ``towers bench``."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

__all__ = ["main"]


def _demo(args: argparse.Namespace) -> int:
    import torch

    from ._problems import Parabola, parabola_data, parabola_loss
    from ._train import TrainResult, train

    data = parabola_data()
    runs: list[tuple[str, int]] = [("sync", 1), ("sync", args.workers)]
    results: list[TrainResult] = []
    print(
        f"towers demo: the parabola y = x^2 (1-5-1 tanh net, 50 points, SGD lr 0.01), "
        f"{args.steps} steps of the full batch",
        flush=True,
    )
    for mode, workers in runs:
        torch.manual_seed(args.seed)
        result = train(
            Parabola(),
            parabola_loss,
            data,
            batch_size=50,
            steps=args.steps,
            workers=workers,
            mode=mode,
            shuffle=False,
            seed=args.seed,
            progress=False,
        )
        results.append(result)

    print(f"\n{'mode':<8}{'workers':>8}{'final loss':>14}{'steps':>8}{'seconds':>10}")
    for r in results:
        print(f"{r.mode:<8}{r.workers:>8}{r.losses[-1]:>14.6f}{r.steps:>8}{r.seconds:>10.2f}")
    base = results[0].losses
    for r in results[1:]:
        gap = max(abs(a - b) / max(abs(b), 1e-12) for a, b in zip(r.losses, base))
        print(
            f"\n{r.mode}, {r.workers} workers vs 1 worker: largest relative loss difference "
            f"over all steps {gap:.1e} (the same training, split over towers)"
        )
    path = _plot(results, Path(args.out))
    print(f"\nloss curves: {path}")
    return 0


def _plot(results: Sequence[object], path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    styles = ["-", "--", ":", "-."]
    for i, r in enumerate(results):
        ax.plot(
            range(len(r.losses)),  # type: ignore[attr-defined]
            r.losses,  # type: ignore[attr-defined]
            styles[i % len(styles)],
            label=f"{r.mode}, {r.workers} worker{'s' if r.workers > 1 else ''}",  # type: ignore[attr-defined]
        )
    ax.set_yscale("log")
    ax.set_xlabel("step (global batch)")
    ax.set_ylabel("mean loss over all towers")
    ax.set_title("towers demo: parabola fit")
    ax.legend()
    ax.grid(True, alpha=0.3)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path.resolve()


def _run(args: argparse.Namespace) -> int:
    from ._launch import run_script
    from ._modes import parse_mode

    mode = parse_mode(args.mode)
    if mode.name != "sync":
        print(f"towers run: mode {args.mode!r} is not available yet; use sync", file=sys.stderr)
        return 2
    return run_script(args.script, args.nproc, args.script_args, addr=args.addr, port=args.port)


def _bench(args: argparse.Namespace) -> int:
    from ._bench import ARMS, BenchConfig, quick, run
    from ._bench_report import table, write

    options: dict = {"workers": args.workers}
    for key, least in (("steps", 1), ("warmup", 0), ("repeats", 1)):
        value = getattr(args, key)
        if value is not None and value < least:
            print(f"towers bench: --{key} must be >= {least}, got {value}", file=sys.stderr)
            return 2
        if value is not None:
            options[key] = value
    if args.models:
        options["models"] = tuple(args.models.split(","))
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
    bench.add_argument("--no-sweep", action="store_true", help="skip the all-reduce sweep")
    bench.add_argument("--quick", action="store_true", help="a smoke run of well under a minute")
    bench.add_argument("--out", default="towers-bench", help="output directory (%(default)s)")
    bench.set_defaults(func=_bench)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="towers", description="Data-parallel training of PyTorch models."
    )
    sub = parser.add_subparsers(dest="command", required=True)

    demo = sub.add_parser("demo", help="train the parabola with 1 and N local workers")
    demo.add_argument("-n", "--workers", type=int, default=4, help="workers (default 4)")
    demo.add_argument("--steps", type=int, default=2000, help="global batches (default 2000)")
    demo.add_argument("--seed", type=int, default=0)
    demo.add_argument(
        "--out", default="towers-demo/loss.png", help="PNG of the loss curves (default %(default)s)"
    )
    demo.set_defaults(func=_demo)

    run = sub.add_parser(
        "run",
        help="run a script as N local workers (the torchrun environment)",
        usage="towers run SCRIPT [-n N] [--mode M] [--addr A] [--port P] -- [ARGS ...]",
        description="Start N copies of SCRIPT with RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR and "
        "MASTER_PORT set as torchrun sets them; stop them all if one fails. Arguments after -- "
        "go to the script.",
    )
    run.add_argument("script")
    run.add_argument("-n", "--nproc", type=int, default=2, help="workers (default 2)")
    run.add_argument("--mode", default="sync", help="training mode (default sync)")
    run.add_argument("--addr", default="127.0.0.1", help="rendezvous address (default loopback)")
    run.add_argument("--port", type=int, default=None, help="rendezvous port (default: a free one)")
    run.set_defaults(func=_run)
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
    for name in ("workers", "nproc", "steps"):
        value = getattr(args, name, None)
        if value is not None and value < 1:
            print(f"towers {args.command}: --{name} must be >= 1, got {value}", file=sys.stderr)
            return 2
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
