"""allocator.py: with freed memory kept, a backward's weight gradient comes from the heap instead of pages mapped
and faulted in afresh each time (what `pipesim simulate` and benchmarks/pass_faults.py rely on)."""

from __future__ import annotations

import multiprocessing
import os
import statistics

import pytest

from pipesim import allocator

WIDTH = 3200  # a Linear whose weight gradient (40 MiB) is above glibc's largest self-set mmap threshold (32 MiB)


def _backward_faults(out) -> None:
    """In a fresh process: per backward of a Linear(WIDTH), its weight gradient made afresh each time, the page
    faults over that gradient's pages (about 1 where it is faulted in afresh, about 0 where freed memory is
    kept), the median of five after three, with glibc's defaults and then with freed memory kept."""
    import resource

    import torch

    torch.set_num_threads(1)
    layer, x = torch.nn.Linear(WIDTH, WIDTH), torch.randn(8, WIDTH)
    pages = layer.weight.nelement() * 4 / os.sysconf("SC_PAGESIZE")

    def faults() -> float:
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        layer(x).sum().backward()
        layer.weight.grad = layer.bias.grad = None
        return (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / pages

    def settled() -> float:  # a backward now and then finds no free block that fits
        return statistics.median([faults() for _ in range(8)][3:])

    default = settled()
    out.put((default, allocator.keep_freed_memory(), settled()))


@pytest.mark.skipif(allocator._libc() is None, reason="glibc's mallopt is not here")
def test_kept_freed_memory_stops_a_backward_faulting_its_gradient_in_again():
    context = multiprocessing.get_context("spawn")  # glibc's defaults: this process may have kept its memory
    out = context.Queue()
    proc = context.Process(target=_backward_faults, args=(out,))
    proc.start()
    default, kept, held = out.get(timeout=120)
    proc.join(timeout=10)
    assert kept
    assert held < 0.1 < 0.5 < default
