"""What one kernel costs on the device beyond its work, as a layer's kernels run one behind another: a chain of
elementwise adds on one-element tensors, timed on the device's clock. The efficiency curve's fit
(planning/estimate.py) takes it as measured: one calibration's layers cannot tell it from the memory-bound ops'
bytes, which come in about the same ratio to the kernels in every layer of one model size."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch

CHAIN = 500  # adds per timed chain: fewer than the launches a CUDA stream queues before its host waits (~1,000)
ROUNDS = 7  # chains timed; their median is kept
# The GPU clock cycles a chain's start is held back at first (2 x 10^7: 10 ms at Hopper's 1.98 GHz boost, where the
# H200 check's host issued a chain in 3-5 ms), doubled up to `HOLDS` times while the host has not issued it by then
HOLD_CYCLES = 2 * 10**7
HOLDS = 6


def kernel_overhead_ms(device: torch.device, dtype: torch.dtype) -> float:
    """The median over `ROUNDS` chains of `CHAIN` dependent adds of one element each, per add (ms), after one
    untimed chain. On CUDA each chain is timed by the device's events behind a held device (`device_ms`): timed on
    the host's clock, a chain issued from Python runs at the host's issue, not the device's, which the layers it is
    subtracted from do not (calibrate times each behind the one before, its host issuing while the device runs):
    6.2 and 9.7 us an add on the H200 check's host in two calibrations an hour apart
    (traces/measured/gpu-check-h200-day9 and -idle-passes), and the fit put the products above the part's peak on
    the second. On a CPU the ops run as they are issued: the host's clock is the device's."""
    value = torch.zeros(1, device=device, dtype=dtype)
    step = torch.ones(1, device=device, dtype=dtype)

    def chain() -> None:
        nonlocal value
        for _ in range(CHAIN):
            value = torch.add(value, step)

    timed = device_ms if device.type == "cuda" else host_ms
    timed(chain)
    return statistics.median(timed(chain) for _ in range(ROUNDS)) / CHAIN


def host_ms(run: Callable[[], None]) -> float:
    """`run`'s time on the host's clock (ms)."""
    started = time.perf_counter_ns()
    run()
    return (time.perf_counter_ns() - started) / 1e6


def device_ms(run: Callable[[], None]) -> float:
    """`run`'s kernels' time on the current CUDA device's clock (ms), from a start the device reaches only after a
    spinning kernel (`torch.cuda._sleep`) that outlasts the host's issue of them, so that they run one behind
    another as a queued layer's do; the hold doubled while the device reached the start before the host had
    issued them. RuntimeError where no hold tried outlasts the issue."""
    cycles = HOLD_CYCLES
    for _ in range(HOLDS):
        torch.cuda.synchronize()
        torch.cuda._sleep(cycles)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        run()
        end.record()
        held = not start.query()  # the device still spinning: every kernel of `run` was queued before it started
        end.synchronize()
        if held:
            return start.elapsed_time(end)
        cycles *= 2
    raise RuntimeError(f"the kernel chain's issue outlasted a hold of {cycles // 2} GPU cycles")
