"""How fast `pipesim tune --gpu` answers: the issue's 70B Llama-shaped model on 256 H100s (batch 1,024), and a
1.3B GPT on 64, end to end as a user runs them (a fresh process each, output piped).

The first run of a shape counts the model on torch's meta device and keeps the count in the host cache (cold);
later runs read it (warm). Prints per problem: the cold run (the count cache emptied first, with --cold), then
the median, min and max of `--repeats` warm runs, the noise floor ((max - min) / median of the same command
repeated), the median CPU seconds, the host's load while it ran, and the search's own line (configurations
built and simulated). The issue's target: the 70B under 10 s, median of 3. No assertion: the figures are the
result. Run:

    python benchmarks/bench_tune.py [--repeats 3] [--cold] [--only 70b]
"""

from __future__ import annotations

import argparse
import os
import re
import resource
import statistics
import subprocess
import sys
import tempfile
import time

from one_line_parser import OneLineParser, positive_int  # this folder's

PROBLEMS = {
    "70b": ["--model", "gpt", "--layers", "80", "--width", "8192", "--heads", "64", "--kv-heads", "8", "--ffn",
            "28672", "--gated", "--attention", "flash", "--devices", "256", "--batch-size", "1024"],
    "1.3b": ["--model", "gpt", "--layers", "24", "--width", "2048", "--heads", "16", "--devices", "64"],
}


def run(flags: list[str], env: dict[str, str]) -> tuple[float, float, str]:
    """Wall and CPU seconds of one `pipesim tune --gpu h100-sxm` in a fresh process, and its search line."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "pipesim.cli", "tune", "--gpu", "h100-sxm", *flags], env=env,
                          check=True, capture_output=True, text=True)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime
    found = re.search(r"searched [\d,]+ configurations .*?; [\d.]+ s", " ".join(done.stdout.split()))
    return wall, cpu, found.group(0) if found else ""


def main(argv: list[str] | None = None) -> None:
    parser = OneLineParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=positive_int, default=3)
    parser.add_argument("--cold", action="store_true", help="first time a run with an empty count cache")
    parser.add_argument("--only", choices=sorted(PROBLEMS), help="one problem only")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as cache:
        env = {**os.environ, "PIPESIM_CACHE_DIR": cache} if args.cold else dict(os.environ)
        for name, flags in PROBLEMS.items():
            if args.only and name != args.only:
                continue
            if args.cold:
                wall, cpu, _ = run(flags, env)
                print(f"{name}: cold (model counted on the meta device) {wall:.1f} s wall, {cpu:.1f} s CPU")
            else:
                run(flags, env)  # fills the count cache if empty: the runs timed below are warm
            walls, cpus = [], []
            load = os.getloadavg()[0]
            for _ in range(args.repeats):
                wall, cpu, search = run(flags, env)
                walls.append(wall)
                cpus.append(cpu)
            median = statistics.median(walls)
            print(f"{name}: warm median {median:.1f} s wall (min {min(walls):.1f}, max {max(walls):.1f}; noise floor "
                  f"{(max(walls) - min(walls)) / median:.0%}), median CPU {statistics.median(cpus):.1f} s, load "
                  f"{load:.1f} -> {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores; {search}")


if __name__ == "__main__":
    main()
