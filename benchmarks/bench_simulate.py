"""How fast the simulator runs: 1F1B at p = 64, m = 1024 (and other sizes with --sizes).

Prints simulated F and B ops per second, for the whole `simulate` call (lowering, the SimPy run and
building the trace) and for each phase. Run: python benchmarks/bench_simulate.py [--sizes 64x1024,128x4096]
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import time

from pipesim.schedules import ScheduleParams, build_schedule
from pipesim.sim import Cluster, Costs, engine
from pipesim.traces import summarize


def measure(p: int, m: int, comm_ms: float) -> dict[str, float]:
    t0 = time.perf_counter()
    schedule = build_schedule("1f1b", ScheduleParams(p, m))
    t1 = time.perf_counter()
    costs = Costs.per_stage(p, fwd_ms=1.0, bwd_ms=2.0, param_mb=100, activation_mb=10, output_mb=1)
    cluster = Cluster.uniform(p, comm_ms)
    engine.check_complete(schedule)
    assert engine.local_order_ok(schedule)
    t2 = time.perf_counter()
    program = engine._lower(schedule, costs, cluster, 0.0, 0)
    t3 = time.perf_counter()
    model = engine._Model(program, cluster.overlap_comm)
    model.run()
    t4 = time.perf_counter()
    trace = engine._trace(schedule, costs, cluster, program, model, 0.0, 0)
    t5 = time.perf_counter()
    summary = summarize(trace)
    t6 = time.perf_counter()
    fb_ops = 2 * p * m
    transfers = 2 * (p - 1) * m  # one activation and one gradient per link and micro-batch
    return {
        "simulate F+B+transfer ops/s": (fb_ops + transfers) / (t5 - t1),
        "p": p, "m": m, "F+B ops": fb_ops, "all ops": len(trace.ops),
        "build s": t1 - t0, "validate s": t2 - t1, "lower s": t3 - t2, "SimPy run s": t4 - t3,
        "trace s": t5 - t4, "metrics s": t6 - t5,
        "simulate F+B ops/s": fb_ops / (t5 - t1), "SimPy-run F+B ops/s": fb_ops / (t4 - t3),
        "makespan ms": summary.makespan_ms,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--sizes", default="64x1024", help="comma-separated PxM pairs")
    parser.add_argument("--comm", type=float, default=0.05, help="ms per transfer")
    parser.add_argument("--profile", action="store_true", help="print the top of a cProfile of the first size")
    args = parser.parse_args()
    sizes = [tuple(map(int, s.split("x"))) for s in args.sizes.split(",")]
    if args.profile:
        p, m = sizes[0]
        cProfile.runctx("measure(p, m, args.comm)", globals(), locals(), "/tmp/pipesim.prof")
        pstats.Stats("/tmp/pipesim.prof").sort_stats("cumulative").print_stats(25)
    for p, m in sizes:
        r = measure(p, m, args.comm)
        print(f"1f1b p={p} m={m}: {r['F+B ops']:,} F+B ops ({r['all ops']:,} with transfers and OPT)")
        for key in ("build s", "validate s", "lower s", "SimPy run s", "trace s", "metrics s"):
            print(f"  {key:<12} {r[key]:8.3f}")
        print(f"  simulate (validate+lower+run+trace): {r['simulate F+B ops/s']:,.0f} F+B ops/s "
              f"(target >= 250,000); counting transfers too: {r['simulate F+B+transfer ops/s']:,.0f} ops/s; "
              f"SimPy run alone: {r['SimPy-run F+B ops/s']:,.0f} F+B ops/s; "
              f"makespan {r['makespan ms']:.1f} ms")


if __name__ == "__main__":
    main()
