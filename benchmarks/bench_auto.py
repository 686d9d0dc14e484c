"""`auto`: how long its search takes, and how good its schedules are on the zero-bubble paper's costs.

    python benchmarks/bench_auto.py time [--sizes 32x256,8x32] [--repeats 7] [--search-seconds S]
    python benchmarks/bench_auto.py paper [--search-seconds S]

`time`: seconds to build `auto` (the search and the schedule, nothing cached: every repeat searches afresh) at
R = 1 and 2 for each p x m, F = 1 ms, B = 2 ms (a third of it W), 0.1 ms transfers; median, min and max of the
repeats, the noise floor (the spread of the same build repeated, (max - min) / median) and the median CPU seconds
(what a loaded machine's wall clock hides). The search's budget
is counted in ops, not on the clock, so every repeat builds the same schedule and only the time varies.

`paper`: every row of the zero-bubble paper (Qi et al., ICLR 2024; benchmarks/zero_bubble_paper.json, from its
Tables 9 and 5): pipesim simulates 1F1B, ZB-H1, ZB-H2 and auto at R = 1 and 2 on the profiled F, B, W and
transfer times, and prints the bubble rate the paper uses, 1 - m(F + B + W) / (time per mini-batch in steady
state), beside the paper's published rates, as a markdown table.
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path

from pipesim.planning import auto
from pipesim.schedules import METHODS
from pipesim.sim import Cluster, Costs, simulate
from pipesim.traces import summarize

try:  # the tests import this file as benchmarks.bench_auto; run as a script, this folder is on sys.path
    from .one_line_parser import OneLineParser, pipeline_sizes, positive_int, positive_number
except ImportError:
    from one_line_parser import OneLineParser, pipeline_sizes, positive_int, positive_number

PAPER = Path(__file__).with_name("zero_bubble_paper.json")


def build_seconds(p: int, m: int, limit: float, budget: float | None) -> tuple[float, float]:
    """One cold build of auto, wall and CPU seconds: the caches emptied, so the search runs in full."""
    auto.forget_searches()
    costs = Costs.per_stage(p, fwd_ms=1.0, bwd_ms=2.0, wgrad_fraction=1 / 3, activation_mb=64, output_mb=8)
    start, cpu = time.perf_counter(), time.process_time()
    auto.search_schedule(METHODS["auto"].params(p, m, 2, activation_limit=limit, search_seconds=budget), costs,
                         Cluster.uniform(p, 0.1))
    return time.perf_counter() - start, time.process_time() - cpu


def time_search(sizes: list[tuple[int, int]], repeats: int, budget: float | None) -> None:
    print("| p | m | R | median s | min s | max s | noise floor | median CPU s |")
    print("|---|---|---|---|---|---|---|---|")
    for p, m in sizes:
        for limit in (1.0, 2.0):
            runs, cpu = zip(*(build_seconds(p, m, limit, budget) for _ in range(repeats)))
            median = statistics.median(runs)
            print(f"| {p} | {m} | {limit:g} | {median:.3f} | {min(runs):.3f} | {max(runs):.3f} | "
                  f"{(max(runs) - min(runs)) / median:.0%} | {statistics.median(cpu):.3f} |")


def bubble(name: str, row: dict, limit: float | None, budget: float | None) -> float:
    """The paper's bubble rate of one schedule, from pipesim's steady-state time per mini-batch."""
    p, m = row["p"], row["m"]
    backward = row["igrad_ms"] + row["wgrad_ms"]
    costs = Costs.per_stage(p, fwd_ms=row["fwd_ms"], bwd_ms=backward, wgrad_fraction=row["wgrad_ms"] / backward,
                            activation_mb=1.0, output_mb=0.0)
    links = Cluster.uniform(p, row["comm_ms"])
    if limit is None:
        schedule = METHODS[name].build(METHODS[name].params(p, m, 2))
    else:
        schedule = auto.search_schedule(METHODS[name].params(p, m, 2, activation_limit=limit,
                                                             search_seconds=budget), costs, links)
    step = summarize(simulate(schedule, costs, links)).time_per_minibatch_ms
    return 1 - m * (row["fwd_ms"] + backward) / step


def paper_table(budget: float | None) -> None:
    doc = json.loads(PAPER.read_text())
    print(f"Source: {doc['source']}\n")
    print("| model | p | m | 1F1B paper / ours | ZB-H1 paper / ours | ZB-H2 paper / ours | ZB-1p paper | auto R=1 "
          "| ZB-2p paper | auto R=2 |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for row in doc["rows"]:
        published = row["bubble"]
        fixed = {name: bubble(name, row, None, budget) for name in ("1f1b", "zb-h1", "zb-h2")}
        ours = {limit: bubble("auto", row, limit, budget) for limit in (1.0, 2.0)}
        print(f"| {row['model']} | {row['p']} | {row['m']} | "
              + " | ".join(f"{published[name]:.4f} / {fixed[name]:.4f}" for name in fixed)
              + f" | {published['zb-1p']:.4f} | {ours[1.0]:.4f} | {published['zb-2p']:.4f} | {ours[2.0]:.4f} |")


def main(argv: list[str] | None = None) -> None:
    parser = OneLineParser(description=__doc__.splitlines()[0])
    parser.add_argument("mode", choices=("time", "paper"))
    parser.add_argument("--sizes", type=pipeline_sizes, default="32x256,8x32", help="p x m, comma-separated (time)")
    parser.add_argument("--repeats", type=positive_int, default=7, help="builds per size and limit (time)")
    parser.add_argument("--search-seconds", type=positive_number, default=None,
                        help="the search's budget (default: auto's)")
    args = parser.parse_args(argv)
    if args.mode == "time":
        time_search(args.sizes, args.repeats, args.search_seconds)
    else:
        paper_table(args.search_seconds)


if __name__ == "__main__":
    main()
