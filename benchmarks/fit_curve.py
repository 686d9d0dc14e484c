"""One calibrated size predicts another: a device's curve fitted (planning.estimate.fit_rates) to one size's
calibrated layer times and the same model's count, then every size's layers estimated on it (estimate_layer,
as `--curve-from` prices them) and compared with that size's own calibrations, per pass; and the noise floor:
the same size calibrated again, compared layer by layer.

Each size's calibrations (a size: the same model, options, micro-batch size, dtype and threads) are dealt in
the order given into two halves, alternately (rounds 1, 3, 5 ... and 2, 4, 6 ...); a half's time for a layer
pass is the least over its calibrations (a shared machine's load only ever adds time). The curve is fitted to
each size's first half, with the kernel overhead its calibrations timed (their median; the part's where a GPU
calibration timed its host's issue, as --curve-from; fitted where they are from before calibrate timed it), and
predicts every size's second half; the noise floor compares a size's two halves. With one calibration in a half
it is that calibration.

`--calibrate DIR` makes them first: `SIZES` (a small gpt at three widths and two sequence lengths, its layers
only, one thread) calibrated `--rounds` times, the sizes interleaved within each round so that the load falls on
all of them alike; the 1-minute load average before each is printed and kept. On a CPU the "part" is nominal
(its peak and bandwidth only scale the fitted efficiencies: 1 TFLOP/s and 100 GB/s here, one "multiprocessor"
and 1×1 tiles, so no tile quantisation); on a GPU give the catalogue part.

    python benchmarks/fit_curve.py --calibrate /tmp/fit --rounds 6 --json fit.json   # about a minute a round
    python benchmarks/fit_curve.py gpu-small-*.json gpu-large-*.json --gpu a100-sxm-80gb  # a GPU's calibrations

The calibration's weight pass (autograd.grad on the weights after the input pass) walks every gradient on the
way to the weights again: it is predicted as the count's full backward (`CALIBRATED_OPS`), and not fitted.
"""

from __future__ import annotations

import os
import statistics
import subprocess
from functools import partial
from pathlib import Path

from one_line_parser import OneLineParser, positive_int  # this folder's

from pipesim.commands.common import refuse_unwritable, write_json
from pipesim.commands.estimate import fit_count, timed_overhead_ms
from pipesim.hardware.catalogue import CatalogueError, Curve, load_catalogue
from pipesim.planning.estimate import (
    CALIBRATED_OPS,
    PEAK_DTYPE,
    Device,
    EstimateError,
    Parallelism,
    curve_for,
    estimate_layer,
    fit_rates,
    separated_fit,
)
from pipesim.profiles.schema import PASSES, EstimateLink, Profile, ProfileError, Timing, load_profile

CPU = Curve(matmul_efficiency=1.0, attention_efficiency=1.0, memory_efficiency=1.0, kernel_overhead_ms=0.0,
            multiprocessors=1, tiles=[(1, 1)], source="nominal CPU: 1 TFLOP/s, 100 GB/s")
NO_COLLECTIVES = EstimateLink(kind="nvlink", latency_ms=0.0, bytes_per_ms=1.0)  # t = 1: never priced
SIZES = {  # name -> the gpt's shape flags; the rest as CALIBRATE
    "w128": ["--width", "128", "--seq-len", "128"],
    "w256": ["--width", "256", "--seq-len", "128"],
    "w512": ["--width", "512", "--seq-len", "128"],
    "w256-s256": ["--width", "256", "--seq-len", "256"],
}
CALIBRATE = ["--model", "gpt", "--layers", "2", "--heads", "4", "--vocab", "1024", "-b", "4", "--dtype", "float32",
             "--threads", "1", "--stages", "1", "--no-links", "--no-runtime", "--no-contention"]


def calibrate_sizes(folder: Path, rounds: int) -> tuple[list[Path], dict[str, float]]:
    """`SIZES` calibrated `rounds` times into `folder` (NAME-ROUND.json), interleaved: the profiles in the order
    made, and the 1-minute load average before each."""
    folder.mkdir(parents=True, exist_ok=True)
    paths, loads = [], {}
    for round_ in range(1, rounds + 1):
        for name, shape in SIZES.items():
            path = folder / f"{name}-{round_}.json"
            loads[path.name] = os.getloadavg()[0]
            print(f"calibrating {path.name} (load average {loads[path.name]:.2f})", flush=True)
            subprocess.run(["pipesim", "calibrate", *CALIBRATE, *shape, "--out", str(path)], check=True,
                           capture_output=True)
            paths.append(path)
    return paths, loads


def size_of(profile: Profile) -> tuple:
    env = profile.environment
    return (profile.model.name, tuple(sorted(profile.model.options.items())), env.microbatch_size, env.dtype,
            env.threads)


def least(profiles: list[Profile]) -> Profile:
    """The first profile with each layer pass's time the least over `profiles` (the same size's calibrations)."""
    return profiles[0].model_copy(update={"layers": [layer.model_copy(update={name: Timing(
        median_ms=min(getattr(p.layers[i], name).median_ms for p in profiles), spread_ms=0.0, repeats=1)
        for name in PASSES}) for i, layer in enumerate(profiles[0].layers)]})


def measured_overhead(profiles: list[Profile], part_overhead_ms: float) -> float | None:
    """The median kernel overhead calibrate timed in `profiles`, the part's for one that timed its host's issue
    (`timed_overhead_ms`, as --curve-from takes it); None: none timed it, the fit finds one."""
    timed = [ms for p in profiles if (ms := timed_overhead_ms(p, part_overhead_ms)) is not None]
    return statistics.median(timed) if timed else None


def errors(predicted: dict[str, list[float | None]], target: Profile) -> dict[str, list[float]]:
    """Per pass, each layer's predicted time over the target's measured one, less 1 (layers without work, or
    under 10 us measured, left out)."""
    return {name: [ms / getattr(timed, name).median_ms - 1 for ms, timed in zip(predicted[name], target.layers)
                   if ms is not None and getattr(timed, name).median_ms > 0.01] for name in PASSES}


def summary(found: dict[str, list[float]]) -> dict[str, dict[str, float]]:
    return {name: {"median": statistics.median(map(abs, values)), "worst": max(map(abs, values)),
                   "signed_median": statistics.median(values)} for name, values in found.items() if values}


def main(argv: list[str] | None = None) -> None:
    parser = OneLineParser(description=__doc__.splitlines()[0])
    parser.add_argument("profiles", type=Path, nargs="*", help="calibrations of two sizes or more")
    parser.add_argument("--calibrate", type=Path, metavar="DIR", help="calibrate SIZES into DIR first")
    parser.add_argument("--rounds", type=positive_int, default=6, help="with --calibrate: calibrations of each size")
    parser.add_argument("--gpu", help="the catalogue part they were calibrated on (default: a nominal CPU)")
    parser.add_argument("--json", type=Path, help="write the results here")
    args = parser.parse_args(argv)
    refuse_unwritable(("--json", args.json))
    paths, loads = calibrate_sizes(args.calibrate, args.rounds) if args.calibrate else (args.profiles, {})
    if not paths:
        parser.error("give calibrations, or --calibrate DIR")
    sizes: dict[tuple, list[list[Profile]]] = {}
    names: dict[tuple, str] = {}
    for path in paths:
        try:
            profile = load_profile(path)
        except ProfileError as exc:  # it names the file and what is wrong with it
            parser.error(str(exc))
        halves = sizes.setdefault(size_of(profile), [[], []])
        names.setdefault(size_of(profile), path.stem.rsplit("-", 1)[0])
        halves[len(halves[0]) > len(halves[1])].append(profile)
    if args.gpu:
        try:
            gpu = load_catalogue().find(args.gpu)
        except CatalogueError as exc:  # it names the parts the catalogue knows
            parser.error(f"--gpu: {exc}")
        dtype = next(iter(sizes.values()))[0][0].environment.dtype
        peak, bandwidth, shape = getattr(gpu.dense_tflops, PEAK_DTYPE[dtype]) * 1e9, gpu.memory_bandwidth_gb_s * 1e6, \
            gpu.curve
    else:
        peak, bandwidth, shape = 1e9, 1e8, CPU
    counts = {key: fit_count(halves[0][0], "benchmarks/fit_curve.py") for key, halves in sizes.items()}
    widths = max(map(len, names.values())) + 2

    def row(first: str, second: str, result: dict[str, dict[str, float]]) -> None:
        print(f"{first:<{widths}} {second:<{widths}} " + " ".join(
            f"{result[n]['median']:>8.1%} ({result[n]['worst']:>4.0%})" if n in result else f"{'-':>16}"
            for n in PASSES))

    print(f"{'fitted on':<{widths}} {'predicts':<{widths}} " + " ".join(f"{name:>16}" for name in PASSES)
          + "   (|error| over the layers: median (worst))")
    results, across = [], {name: [] for name in PASSES}
    element = 4 if next(iter(sizes.values()))[0][0].environment.dtype == "float32" else 2
    for key, (first, _) in sizes.items():
        # fitted as --curve-from fits: the attention held at the part's where the free fit outruns the datasheet
        refit = partial(fit_rates, least(first), counts[key], shape.multiprocessors, shape.tiles,
                        measured_overhead(first, shape.kernel_overhead_ms))
        try:
            fitted, held = separated_fit(refit(), refit, peak, bandwidth, shape)
            curve = curve_for(fitted, peak, bandwidth, shape, f"fitted to {names[key]}{held}")
        except EstimateError as exc:
            parser.error(f"{names[key]}: {exc}")
        device = Device(peak, bandwidth * curve.memory_efficiency, curve)
        print(f"  {names[key]} ({len(first)} calibrations): products {fitted.matmul_flops_per_ms / 1e6:.1f} GFLOP/s, "
              f"memory-bound {(fitted.memory_bytes_per_ms or 0) / 1e6:.1f} GB/s, "
              f"{fitted.kernel_overhead_ms * 1e3:.1f} us a kernel{' (measured)' * fitted.kernel_overhead_measured}"
              + held)
        for target_key, (_, second) in sizes.items():
            if not second:
                continue
            layers = counts[target_key].layers
            priced = [estimate_layer(layer, device, Parallelism(), NO_COLLECTIVES, element) for layer in layers]
            predicted = {name: [getattr(p, f"{CALIBRATED_OPS[name]}_ms") if layer.ops.get(CALIBRATED_OPS[name])
                                else None for p, layer in zip(priced, layers)] for name in PASSES}
            found = errors(predicted, least(second))
            if target_key != key:
                for name, values in found.items():
                    across[name] += values
            results.append({"fitted_on": names[key], "predicts": names[target_key], "errors": summary(found)})
            row(names[key], "itself (again)" if target_key == key else names[target_key], summary(found))
    if any(across.values()):
        row("any size", "another", summary(across))
    print("noise floor: a size's two halves, layer by layer")
    floors, floor = [], {name: [] for name in PASSES}
    for key, (first, second) in sizes.items():
        if not second:
            continue
        once = least(first)
        measured = {name: [getattr(timed, name).median_ms for timed in once.layers] for name in PASSES}
        found = errors(measured, least(second))
        for name, values in found.items():
            floor[name] += values
        floors.append({"size": names[key], "errors": summary(found)})
        row(names[key], "", summary(found))
    if any(floor.values()):
        row("every size", "", summary(floor))
    write_json(args.json, {"predictions": results, "across_sizes": summary(across), "noise_floor": floors,
                           "noise_floor_pooled": summary(floor), "load_average": loads})


if __name__ == "__main__":
    main()
