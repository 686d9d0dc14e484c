"""Contention probe settings: how reproducible the factor is, and what it costs, at each setting.

Runs `ContentionProbe` (calibrate/contention.py) on a calibrated profile's model, in fresh processes each time,
at the settings named, interleaved (A B A B ...: a slow spell of the shared host falls on all of them), and
prints per setting the median two-at-once factor, its spread over repeats ((max - min) / median: the noise floor
is the first setting's), the median of the rounds taken, and the median seconds the windows took (from the
processes answering ready to the last window; their start-up is the same at every setting and left out).

    pipesim calibrate --model mlp --stages 2 -b 16 --no-runtime --no-contention --no-links --out mlp.json
    python benchmarks/contention_settings.py mlp.json --repeats 6 \
        --setting old:WINDOW_S=0.5,MIN_ITERATIONS=5 --setting new:WINDOW_S=0.25,MIN_ITERATIONS=3
"""

from __future__ import annotations

import argparse
import time

import numpy as np
from one_line_parser import OneLineParser, positive_int  # this folder's
from rich.table import Table

from pipesim.calibrate import contention
from pipesim.commands.tables import print_table
from pipesim.profiles.schema import ProfileError, load_profile


def parse_setting(text: str) -> tuple[str, dict[str, float]]:
    """`name:CONSTANT=value,...` -> (name, {CONSTANT: value}); the constants are contention.py's parent-side ones.
    An argparse type: a constant it lacks or a value not a number is refused on the command line."""
    name, _, assignments = text.partition(":")
    values = {}
    for assignment in filter(None, assignments.split(",")):
        constant, _, value = assignment.partition("=")
        if not hasattr(contention, constant):
            raise argparse.ArgumentTypeError(f"calibrate/contention.py has no {constant} (in {text!r})")
        try:
            values[constant] = type(getattr(contention, constant))(float(value))
        except ValueError:
            raise argparse.ArgumentTypeError(f"{constant}: give a number (got {value!r} in {text!r})") from None
    return name, values


def probe_once(profile, values: dict[str, float]) -> tuple[float, int, float]:
    """One probe at `values`: (two-at-once factor, rounds, seconds from ready to the last window)."""
    saved = {constant: getattr(contention, constant) for constant in values}
    began: list[float] = []

    def advance(what: str) -> None:
        if "round 1/" in what and not began:
            began.append(time.perf_counter())

    try:
        for constant, value in values.items():
            setattr(contention, constant, value)
        probe = contention.ContentionProbe(profile, profile.model.name, profile.model.options, advance)
        probe.run()
        seconds = time.perf_counter() - began[0]
    finally:
        for constant, value in saved.items():
            setattr(contention, constant, value)
    result = probe.result()
    return result.meta["measured_slowdown"][1], result.meta["rounds"], seconds


def main(argv: list[str] | None = None) -> None:
    parser = OneLineParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("profile")
    parser.add_argument("--repeats", type=positive_int, default=6)
    parser.add_argument("--setting", action="append", required=True, type=parse_setting,
                        help="name:CONSTANT=value,...")
    args = parser.parse_args(argv)
    try:
        profile = load_profile(args.profile)
    except ProfileError as exc:
        parser.error(str(exc))
    settings = args.setting
    measured: dict[str, list[tuple[float, int, float]]] = {name: [] for name, _ in settings}
    for repeat in range(args.repeats):
        order = settings if repeat % 2 == 0 else settings[::-1]
        for name, values in order:
            measured[name].append(probe_once(profile, values))
            factor, rounds, seconds = measured[name][-1]
            print(f"repeat {repeat + 1}/{args.repeats} {name}: {factor:.3f}x, {rounds} rounds, {seconds:.1f} s",
                  flush=True)
    table = Table(title=f"contention probe on {profile.model.name} (bounds {profile.partition.bounds}), "
                        f"{args.repeats} repeats, interleaved")
    for header in ("setting", "factor (median)", "spread", "factors", "rounds", "windows s (median)"):
        table.add_column(header)
    for name, values in settings:
        factors, rounds, seconds = map(np.asarray, zip(*measured[name]))
        median = float(np.median(factors))
        table.add_row(f"{name} {values}", f"{median:.3f}", f"{np.ptp(factors) / median:.1%}",
                      " ".join(f"{f:.2f}" for f in factors), f"{np.median(rounds):g}", f"{np.median(seconds):.2f}")
    print_table(table)


if __name__ == "__main__":
    main()
