"""How fast `pipesim sweep` gets through a grid: about 1,000 configurations of the built-in example model
around its scale (p = 4, m = 8, N = 4), end to end as a user runs it (start-up, worker processes, CSV).

Prints, per worker count, the configurations simulated and skipped, the wall time and configurations per
second (the issue's target: 1,000 configurations in under a minute on 2 cores). Run:

    python benchmarks/bench_sweep.py [--workers 1,2] [--stages 2,4,6,8] [--microbatches 4,8,16]
"""

from __future__ import annotations

import argparse
import csv
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from one_line_parser import OneLineParser, positive_ints  # this folder's
from rich.table import Table

from pipesim.commands.tables import print_table


def sweep(args: argparse.Namespace, workers: int, out: Path) -> float:
    """Wall seconds of one `pipesim sweep` in a fresh process; its exit code where it failed (a grid it refuses:
    its own line on stderr)."""
    command = [sys.executable, "-m", "pipesim.cli", "sweep", "--stages", args.stages, "--microbatches",
               args.microbatches, "--chunks", args.chunks, "--pipelines", args.pipelines, "--cost-scale",
               args.cost_scale, "--minibatches", "4", "--workers", str(workers), "--out", str(out)]
    start = time.perf_counter()
    code = subprocess.run(command, stdout=subprocess.DEVNULL).returncode
    if code:
        raise SystemExit(code)
    return time.perf_counter() - start


def main(argv: list[str] | None = None) -> None:
    parser = OneLineParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workers", type=positive_ints, default="1,2", help="comma-separated worker counts to time")
    parser.add_argument("--stages", default="2,4,6,8")
    parser.add_argument("--microbatches", default="4,8,16")
    parser.add_argument("--chunks", default="1,2,4")
    parser.add_argument("--pipelines", default="1,2,3")
    parser.add_argument("--cost-scale", default="0.5,1,1.5,2")
    args = parser.parse_args(argv)

    table = Table(title=f"pipesim sweep, all methods × p {args.stages} × m {args.microbatches} × v {args.chunks} "
                        f"× P {args.pipelines} × cost {args.cost_scale}, N = 4 (target: 1,000 in < 60 s on 2 cores)",
                  title_justify="left")
    for header in ("workers", "configs", "simulated", "skipped", "wall s", "configs/s"):
        table.add_column(header, justify="right")
    with tempfile.TemporaryDirectory() as folder:
        out = Path(folder) / "results.csv"
        for workers in args.workers:
            seconds = sweep(args, workers, out)
            with out.open(newline="") as handle:
                statuses = [row["status"] for row in csv.DictReader(handle)]
            table.add_row(str(workers), f"{len(statuses):,}", f"{statuses.count('ok'):,}",
                          f"{statuses.count('skipped'):,}", f"{seconds:.1f}", f"{len(statuses) / seconds:,.0f}")
    print_table(table)


if __name__ == "__main__":
    main()
