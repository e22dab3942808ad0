"""The benchmark suite, as a script: the same as ``towers bench``.

Run it from the repository root::

    python benchmarks/bench.py --out towers-bench            # a few minutes on 2 cores
    python benchmarks/bench.py --quick --out /tmp/bench      # a smoke run, under a minute
    python benchmarks/bench.py -n 4 --models mlp --no-sweep

The suite itself lives in the package (``towers.tools.bench``, reports in
``towers.tools.bench_report``) so that ``towers bench`` works wherever towers is installed, and
so that its worker functions can be sent to worker processes by reference. Import ``run`` and
``BenchConfig`` from here to drive it from Python.
"""

from __future__ import annotations

import sys

from towers.tools.bench import ARMS, BenchConfig, quick, run
from towers.tools.bench_report import table, write
from towers.tools.cli import main

__all__ = ["ARMS", "BenchConfig", "quick", "run", "table", "write"]

if __name__ == "__main__":
    sys.exit(main(["bench", *sys.argv[1:]]))
