"""How fast the simulator runs and how it scales: 1F1B at several (p, m) over N mini-batches (2 by default, as
`pipesim simulate -s 1f1b` picks for a flushing schedule), transfers and memory modelled.

Each size runs in a fresh process, so its peak resident memory is its own. Prints, per size, the
seconds of each phase (build the schedule, check it, lower it, price the rows' times, the device run, the trace
with its memory counters, the metrics), the simulation's CPU seconds (user + system: on a shared machine they
vary less than the wall clock, which counts time other processes held the cores), simulated F+B ops per second
end to end, and peak memory per op; the scaling is linear when ops/s and bytes/op stay flat as the sizes grow.
Each process sets the allocator as the command does (pipesim/allocator.py: freed memory kept, no transparent
huge pages). Run:

    python benchmarks/bench_simulate.py [--sizes 64x1024,128x4096] [--minibatches N] [--profile]
"""

from __future__ import annotations

import argparse
import cProfile
import multiprocessing
import os
import pstats
import resource
import time

from one_line_parser import OneLineParser, pipeline_sizes, positive_int  # this folder's
from rich.table import Table

from pipesim.allocator import keep_freed_memory, no_huge_pages
from pipesim.commands.tables import print_table
from pipesim.schedules import ScheduleParams, build_schedule
from pipesim.schedules.lowering import lower, preflight
from pipesim.sim import Cluster, Costs, engine
from pipesim.traces import summarize
from pipesim.units import KIB, MIB

PHASES = ("build", "check", "lower", "price", "run", "trace", "metrics")


def measure(p: int, m: int, n: int, comm_ms: float) -> dict[str, float]:
    """One simulation of 1F1B at (p, m) over n mini-batches, phase by phase, with its process's peak memory."""
    marks = [time.perf_counter()]
    schedule = build_schedule("1f1b", ScheduleParams(p, m, n))
    marks.append(time.perf_counter())
    cpu_before = os.times()
    costs = Costs.per_stage(p, fwd_ms=1.0, bwd_ms=2.0, param_mb=100, activation_mb=10, output_mb=1)
    cluster = Cluster.uniform(p, comm_ms)
    preflight(schedule)
    marks.append(time.perf_counter())
    lowered = lower(schedule)
    marks.append(time.perf_counter())
    program = engine._price(lowered, costs, cluster, 0.0, 0)
    marks.append(time.perf_counter())
    model = engine._Model(program, cluster.overlap_comm)
    model.run()
    marks.append(time.perf_counter())
    trace = engine._trace(costs, cluster, program, model, 0.0, 0)
    marks.append(time.perf_counter())
    cpu_after = os.times()
    summary = summarize(trace)
    marks.append(time.perf_counter())
    fb_ops = 2 * p * m * n
    assert summary.makespan_ms > 0
    return {
        "p": p, "m": m, "fb_ops": fb_ops, "rows": len(trace.ops),
        **{phase: b - a for phase, a, b in zip(PHASES, marks, marks[1:])},
        "cpu": (cpu_after.user - cpu_before.user) + (cpu_after.system - cpu_before.system),
        "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * KIB / MIB,  # Linux counts it in KiB
    }


def _child(args: tuple[int, int, int, float]) -> dict[str, float]:
    keep_freed_memory()  # the allocator's settings `pipesim simulate` runs with
    no_huge_pages()
    return measure(*args)


def main(argv: list[str] | None = None) -> None:
    parser = OneLineParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", type=pipeline_sizes, default="16x256,32x1024,64x1024,128x2048,128x4096",
                        help="comma-separated PxM")
    parser.add_argument("--minibatches", type=positive_int, default=2, help="N, mini-batches simulated")
    parser.add_argument("--comm", type=float, default=0.05, help="ms per transfer")
    parser.add_argument("--profile", action="store_true", help="print the top of a cProfile of the first size")
    args = parser.parse_args(argv)
    if args.profile:
        p, m = args.sizes[0]
        cProfile.runctx("measure(p, m, args.minibatches, args.comm)", globals(), locals(), "/tmp/pipesim.prof")
        pstats.Stats("/tmp/pipesim.prof").sort_stats("cumulative").print_stats(25)

    table = Table(title=f"1F1B, N = {args.minibatches}: seconds per phase; simulate = check + lower + price + run + "
                        "trace (issue 28's target: the whole `pipesim simulate -s 1f1b -p 128 -m 4096`, N = 2, "
                        "under 2 s)",
                  title_justify="left")
    for header in ("p x m", "F+B ops", "rows", *PHASES, "simulate s", "CPU s", "F+B ops/s", "rows/s", "peak MiB",
                   "bytes/row"):
        table.add_column(header, justify="right")
    context = multiprocessing.get_context("spawn")
    for p, m in args.sizes:
        with context.Pool(1) as pool:  # a fresh process per size: its peak memory is this size's
            r = pool.apply(_child, ((p, m, args.minibatches, args.comm),))
        simulate_s = r["check"] + r["lower"] + r["price"] + r["run"] + r["trace"]
        table.add_row(
            f"{p}x{m}", f"{r['fb_ops']:,}", f"{r['rows']:,}", *(f"{r[phase]:.3f}" for phase in PHASES),
            f"{simulate_s:.2f}", f"{r['cpu']:.2f}", f"{r['fb_ops'] / simulate_s:,.0f}",
            f"{r['rows'] / simulate_s:,.0f}",
            f"{r['peak_rss_mib']:,.0f}", f"{r['peak_rss_mib'] * MIB / r['rows']:,.0f}",
        )
    print_table(table)


if __name__ == "__main__":
    main()
