"""glibc's allocator settings (the one place that sets them): `pipesim simulate` keeps freed memory and opts out
of transparent huge pages (docs/benchmarks.md); benchmarks/pass_faults.py times a stage's passes with and without.

By default glibc hands a freed block above its mmap threshold back to the OS, and that threshold moves with the
process's history. The next allocation of the same size is then faulted in and zeroed again by the kernel, or
not: a stage's backward whose weight gradients (4 MiB for a Linear(1024)) are faulted in afresh takes up to 40 %
longer (docs/fidelity.md, What limits it). Calibration and the ranks keep glibc's defaults for now: with freed memory
kept in both, their predictions came out 10-25 % short, the faults having offset what calibration does not yet
price, a pass's cold caches after a wait (the same section). Elsewhere than glibc on Linux, nothing changes.
"""

from __future__ import annotations

import ctypes
from functools import cache

from .units import GIB

M_TRIM_THRESHOLD = -1  # glibc's mallopt parameters
M_MMAP_THRESHOLD = -3
PR_SET_THP_DISABLE = 41  # Linux's prctl option
KEPT_BYTES = GIB  # blocks under a GiB come from the heap, which gives memory back only when a GiB is free


@cache
def _libc():
    """The process's own C library, where it has mallopt and prctl (glibc on Linux); else None (looked up once)."""
    try:
        libc = ctypes.CDLL(None)
    except (OSError, TypeError):  # no process-wide library handle (Windows)
        return None
    return libc if hasattr(libc, "mallopt") and hasattr(libc, "prctl") else None


def keep_freed_memory() -> bool:
    """Keep what this process frees for its next allocations instead of handing it back to the OS (the process
    keeps its peak until it exits, as it would at that peak anyway). True where glibc took both settings."""
    libc = _libc()
    if libc is None:
        return False
    return bool(libc.mallopt(M_TRIM_THRESHOLD, KEPT_BYTES)) and bool(libc.mallopt(M_MMAP_THRESHOLD, KEPT_BYTES))


def no_huge_pages() -> None:
    """Opt this process out of transparent huge pages, which numpy asks for on large arrays: where the kernel
    compacts memory to find one (THP defrag "madvise", as on this project's VMs), a fault stalls for that
    (`simulate -p 128 -m 4096` spent 1.2-2.0 s in the kernel instead of 0.5 s with ordinary pages,
    docs/benchmarks.md)."""
    libc = _libc()
    if libc is not None:
        libc.prctl(PR_SET_THP_DISABLE, 1, 0, 0, 0)
