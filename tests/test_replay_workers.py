"""`simulate` replays the caching allocator of a large what-if's devices in worker processes (commands/simulate.py
`_Replays`, with tune's `start_workers`), and its answer is the one it gives replaying them all in its own."""

import os
import resource

import pytest

from tests.conftest import simulate_json

pytest.importorskip("torch")

# p = 8, m = 64 over 64 layers: some 250,000 allocator ops to replay, above the workers' floor
LARGE = ("--gpu", "a100-sxm-80gb", "--model", "gpt", "--layers", "64", "--width", "64", "--heads", "4", "--seq-len",
         "32", "--vocab", "128", "-p", "8", "-m", "64", "-s", "1f1b", "-s", "zb-v")
# p = 8, m = 8 over 192 layers, recomputed: few rows (6,600 actions times their stages' layers, a fifth of LARGE's),
# and none the replay's skip leaves out, but 300,000 allocator ops to replay (Llama 3.1 405B's at m = 8: 630,000)
FEW_ROWS_MANY_OPS = ("--gpu", "a100-sxm-80gb", "--model", "gpt", "--layers", "192", "--recompute", "full", "--width",
                     "64", "--heads", "4", "--seq-len", "32", "--vocab", "128", "-p", "8", "-m", "8", "-s", "1f1b")
TWO_CORES = pytest.mark.skipif(not hasattr(os, "sched_getaffinity") or len(os.sched_getaffinity(0)) < 2,
                               reason="workers need two usable cores")


def children_cpu_s() -> float:
    used = resource.getrusage(resource.RUSAGE_CHILDREN)
    return used.ru_utime + used.ru_stime


@TWO_CORES
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


@TWO_CORES
def test_a_what_if_of_few_rows_but_many_allocator_ops_replays_in_workers():
    before = children_cpu_s()
    simulate_json(*FEW_ROWS_MANY_OPS)
    assert children_cpu_s() > before  # its replays ran in the workers, which ended
