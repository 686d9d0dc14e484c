"""`simulate` replays the caching allocator of a large what-if's devices in worker processes (commands/simulate.py
`_Replays`, with tune's `start_workers`), and its answer is the one it gives replaying them all in its own."""

import os
import resource

import pytest

from tests.conftest import simulate_json

pytest.importorskip("torch")

# p = 8, m = 64 over 48 layers: some 32,000 rows times their stages' layers to replay, above the workers' floor
LARGE = ("--gpu", "a100-sxm-80gb", "--model", "gpt", "--layers", "48", "--width", "64", "--heads", "4", "--seq-len",
         "32", "--vocab", "128", "-p", "8", "-m", "64", "-s", "1f1b", "-s", "zb-v")


def children_cpu_s() -> float:
    used = resource.getrusage(resource.RUSAGE_CHILDREN)
    return used.ru_utime + used.ru_stime


@pytest.mark.skipif(not hasattr(os, "sched_getaffinity") or len(os.sched_getaffinity(0)) < 2,
                    reason="workers need two usable cores")
def test_a_large_what_ifs_devices_replay_in_workers_as_they_do_here():
    cores = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {min(cores)})  # one usable core: every replay in this process
    try:
        before = children_cpu_s()
        here = simulate_json(*LARGE)
        assert children_cpu_s() == before
    finally:
        os.sched_setaffinity(0, cores)
    spread = simulate_json(*LARGE)
    assert children_cpu_s() > before  # the workers replayed, and ended
    assert spread == here
    assert all(sum(device["peak_memory_parts_mb"]["reserve"] for device in result["devices"]) > 0 for result in here)
