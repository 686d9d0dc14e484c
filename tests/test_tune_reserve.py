"""tune reads each configuration's peak as simulate and sweep do, the caching allocator's reserve in
(`--allocator caching`, the default), so a configuration tune says fits is not out of memory in simulate."""

from __future__ import annotations

import json

import pytest

from tests.conftest import pipesim

MODEL = ("--gpu", "a100-sxm-80gb", "--model", "gpt", "--layers", 4, "--width", 512, "--heads", 8, "--seq-len", 512,
         "--vocab", 1000)
# One configuration open to the search: 1F1B, p = 2 over the 2 GPUs, b = 1, m = 8, no recomputation.
ONE = ("-D", 2, "-B", 8, "-s", "1f1b", "--tensor-parallel", 1, "--data-parallel", 1, "-b", 1, "--recompute", "none")


def tuned_peak_mib(*flags) -> float:
    code, out, err = pipesim("tune", *MODEL, *ONE, *flags, "--json")
    assert code == 0, err
    choice = json.loads(out)["choice"]
    assert (choice["schedule"], choice["stages"], choice["microbatches"]) == ("1f1b", 2, 8)
    return choice["peak_memory_gib"] * 1024


def simulated_peak_mib(*flags) -> float:
    code, out, err = pipesim("simulate", *MODEL, "-p", 2, "-m", 8, "-s", "1f1b", "-b", 1, "--recompute", "none",
                             *flags, "--json")
    assert code == 0, err
    return max(device["peak_memory_mb"] for device in json.loads(out)["results"][0]["devices"])


def test_tunes_peak_is_simulates_with_and_without_the_reserve():
    reserved, allocated = tuned_peak_mib(), tuned_peak_mib("--allocator", "none")
    assert reserved == pytest.approx(simulated_peak_mib())
    assert allocated == pytest.approx(simulated_peak_mib("--allocator", "none"))
    assert reserved > allocated  # the reserve is there to count


def test_a_cap_between_max_allocated_and_max_reserved_is_refused_as_simulate_marks_it():
    cap_gib = (tuned_peak_mib() + tuned_peak_mib("--allocator", "none")) / 2 / 1024
    code, _, err = pipesim("tune", *MODEL, *ONE, "--memory-gb", cap_gib)
    assert code == 2 and "no configuration fits" in err
    code, _, err = pipesim("tune", *MODEL, *ONE, "--memory-gb", cap_gib, "--allocator", "none")
    assert code == 0, err


def test_allocator_without_gpu_is_refused_in_one_line():
    code, _, err = pipesim("tune", "--profile", "traces/profiles/gpt-cpu.json", "--devices", 8, "--memory-gb", 0.3,
                           "--allocator", "none")
    assert code == 2 and "--allocator" in err and len(err.strip().splitlines()) == 1
