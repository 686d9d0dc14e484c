"""What one kernel costs beyond its work on the calibrated device: a chain of elementwise adds on one-element
tensors, issued from Python as a layer's forward issues its ops. The efficiency curve's fit (planning/estimate.py)
takes it as measured: one calibration's layers cannot tell it from the memory-bound ops' bytes, which come in
about the same ratio to the kernels in every layer of one model size."""

from __future__ import annotations

import statistics
import time

import torch

CHAIN = 1000  # adds per timed chain
ROUNDS = 7  # chains timed; their median is kept


def kernel_overhead_ms(device: torch.device, dtype: torch.dtype) -> float:
    """The median over `ROUNDS` chains of `CHAIN` dependent adds of one element each, per add (ms), after one
    untimed chain; on CUDA the chain is waited for once at its end, as a stream of kernels runs."""
    value = torch.zeros(1, device=device, dtype=dtype)
    step = torch.ones(1, device=device, dtype=dtype)

    def chain() -> float:
        nonlocal value
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        started = time.perf_counter_ns()
        for _ in range(CHAIN):
            value = torch.add(value, step)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return (time.perf_counter_ns() - started) / 1e6 / CHAIN

    chain()
    return statistics.median(chain() for _ in range(ROUNDS))
