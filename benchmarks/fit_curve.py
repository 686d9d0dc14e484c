"""One calibrated size predicts another: the efficiency curve fitted (planning.estimate.fit_curve) to a
calibration's measured layer times and the same model's count, then the other size's layers estimated on the
fitted curve and compared with that size's own calibration.

On a CPU the "part" is nominal (its peak and bandwidth only scale the fitted efficiencies: 1 TFLOP/s and
100 GB/s here, one "multiprocessor" and 1×1 tiles, so no tile quantisation); on a GPU give the catalogue part.

    pipesim calibrate --model gpt --layers 2 --width 256 --heads 4 --seq-len 128 --vocab 1024 -b 4 \\
        --dtype float32 --threads 1 --stages 1 --no-links --no-runtime --no-contention --out small.json
    pipesim calibrate ... --width 512 --seq-len 256 ... --out large.json
    python benchmarks/fit_curve.py small.json large.json           # fit on small, predict large
    python benchmarks/fit_curve.py small.json large.json --gpu a100-sxm-80gb   # a GPU's calibrations
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

import torch

from pipesim.hardware.catalogue import Curve, load_catalogue
from pipesim.planning.estimate import FIT_PASSES, PEAK_DTYPE, Device, Parallelism, estimate_layer, fit_curve
from pipesim.profiles.schema import EstimateLink, Profile, load_profile
from pipesim.workload.count import WorkloadCount, count_built

CPU = Curve(matmul_efficiency=1.0, attention_efficiency=1.0, memory_efficiency=1.0, kernel_overhead_ms=0.0,
            multiprocessors=1, tiles=[(1, 1)], source="nominal CPU: 1 TFLOP/s, 100 GB/s")


def counted(profile: Profile) -> WorkloadCount:
    env = profile.environment
    return count_built(profile.model.name, dict(profile.model.options), env.microbatch_size,
                       getattr(torch, env.dtype))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("fit", type=Path, help="the calibration the curve is fitted to")
    parser.add_argument("predict", type=Path, help="the calibration of another size, predicted")
    parser.add_argument("--gpu", help="the catalogue part both were calibrated on (default: a nominal CPU)")
    args = parser.parse_args()
    fit_on, target = load_profile(args.fit), load_profile(args.predict)
    if args.gpu:
        gpu = load_catalogue().find(args.gpu)
        peak = getattr(gpu.dense_tflops, PEAK_DTYPE[fit_on.environment.dtype]) * 1e9
        datasheet = Device(peak, gpu.memory_bandwidth_gb_s * 1e6, gpu.curve)
    else:
        datasheet = Device(1e9, 1e8, CPU)
    curve = fit_curve(fit_on, counted(fit_on), datasheet, f"fitted to {args.fit.name}")
    print(f"fitted on {args.fit.name}: matmul {curve.matmul_efficiency:.3g}, memory {curve.memory_efficiency:.3g}, "
          f"kernel overhead {curve.kernel_overhead_ms * 1e3:.1f} us")
    device = Device(datasheet.peak_flops_per_ms, datasheet.memory_bytes_per_ms * curve.memory_efficiency, curve)
    no_collectives = EstimateLink(kind="nvlink", latency_ms=0.0, bytes_per_ms=1.0)  # t = 1: never priced
    element = 4 if target.environment.dtype == "float32" else 2
    errors = []
    print(f"{'layer':<12} {'pass':<6} {'predicted ms':>12} {'measured ms':>12} {'error':>8}")
    for layer, timed in zip(counted(target).layers, target.layers):
        priced = estimate_layer(layer, device, Parallelism(), no_collectives, element)
        for name in FIT_PASSES:
            predicted, measured = getattr(priced, f"{name}_ms"), getattr(timed, name).median_ms
            errors.append(abs(predicted / measured - 1))
            print(f"{layer.name:<12} {name:<6} {predicted:>12.3f} {measured:>12.3f} {predicted / measured - 1:>+8.1%}")
    print(f"|error| over {len(errors)} layer passes: median {statistics.median(errors):.1%}, worst {max(errors):.1%}")


if __name__ == "__main__":
    main()
