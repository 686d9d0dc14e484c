"""Link calibration: the piecewise α–β fit against synthetic links, and real gloo measurements on this machine."""

import itertools
import multiprocessing
import time

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipesim.calibrate.links import LinkError, measure_allreduce, measure_allreduce_beside_compute, measure_p2p
from pipesim.profiles.linkfit import LinkFit, LinkPoint, LinkSegment, default_sizes, fit_link
from pipesim.units import GIB

SIZES = default_sizes()  # 4 KiB .. 64 MiB


def synthetic(sizes, latency_ms, bytes_per_ms, noise=0.0, seed=0):
    rng = np.random.default_rng(seed)
    return [LinkPoint(n, (latency_ms + n / bytes_per_ms) * (1 + noise * rng.standard_normal()), 0.0) for n in sizes]


def test_default_sizes_are_powers_of_two_from_4_kib_to_64_mib():
    assert SIZES[0] == 4096 and SIZES[-1] == 64 << 20 and len(SIZES) == 15
    assert all(b == 2 * a for a, b in itertools.pairwise(SIZES))
    assert default_sizes(1 << 20)[-1] == 1 << 20


def test_fit_recovers_a_clean_alpha_beta_line_as_one_segment():
    fit = fit_link(synthetic(SIZES, latency_ms=0.05, bytes_per_ms=5e6))
    assert len(fit.segments) == 1
    (seg,) = fit.segments
    assert seg.latency_ms == pytest.approx(0.05, rel=1e-6)
    assert seg.bytes_per_ms == pytest.approx(5e6, rel=1e-6)


@pytest.mark.parametrize("seed", range(5))
def test_fit_recovers_a_noisy_line_and_keeps_one_segment(seed):
    fit = fit_link(synthetic(SIZES, latency_ms=0.05, bytes_per_ms=5e6, noise=0.03, seed=seed))
    assert len(fit.segments) == 1
    assert fit.segments[0].latency_ms == pytest.approx(0.05, rel=0.1)
    assert fit.segments[0].bytes_per_ms == pytest.approx(5e6, rel=0.1)


@pytest.mark.parametrize("noise", [0.0, 0.02])
def test_fit_finds_the_protocol_change(noise):
    # eager up to 256 KiB (low latency, slow copies), rendezvous from 512 KiB (handshake, then full bandwidth)
    small = [n for n in SIZES if n <= 256 << 10]
    large = [n for n in SIZES if n > 256 << 10]
    points = synthetic(small, 0.02, 1e6, noise, seed=1) + synthetic(large, 0.4, 8e6, noise, seed=2)
    fit = fit_link(points)
    assert len(fit.segments) == 2
    eager, rendezvous = fit.segments
    assert 256 << 10 < rendezvous.min_bytes <= 512 << 10
    tol = 1e-6 if noise == 0 else 0.15
    assert eager.latency_ms == pytest.approx(0.02, rel=tol)
    assert eager.bytes_per_ms == pytest.approx(1e6, rel=tol)
    assert rendezvous.latency_ms == pytest.approx(0.4, rel=tol)
    assert rendezvous.bytes_per_ms == pytest.approx(8e6, rel=tol)
    for p in points:
        assert fit.ms(p.nbytes) == pytest.approx(p.ms, rel=0.1)


def test_fit_rejects_too_few_or_bad_points():
    with pytest.raises(ValueError, match="at least two"):
        fit_link([LinkPoint(4096, 0.1, 0.0)])
    with pytest.raises(ValueError, match="distinct"):
        fit_link([LinkPoint(4096, 0.1, 0.0), LinkPoint(4096, 0.2, 0.0)])


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.floats(0, 10), st.floats(1e2, 1e9)), min_size=1, max_size=4),
       st.lists(st.integers(0, 1 << 28), min_size=2, max_size=30))
def test_ms_never_decreases_with_size(lines, sizes):
    segments = tuple(LinkSegment(k << 16, lat, bw) for k, (lat, bw) in enumerate(lines))
    fit = LinkFit(segments)
    times = [fit.ms(n) for n in sorted(sizes)]
    assert all(b >= a for a, b in itertools.pairwise(times))


@settings(max_examples=100, deadline=None)
@given(st.lists(st.floats(1e-3, 1e3), min_size=2, max_size=15))
def test_any_fit_is_monotone(times_ms):
    """Whatever the measured times, fit_link returns a fit (LinkFit itself refuses a negative latency or a
    bandwidth <= 0) whose times never fall with size, across and around every segment start."""
    sizes = SIZES[: len(times_ms)]
    fit = fit_link([LinkPoint(n, t, 0.0) for n, t in zip(sizes, times_ms)])
    grid = sorted(set(sizes) | {0, 1, GIB} | {s.min_bytes for s in fit.segments} |
                  {s.min_bytes - 1 for s in fit.segments})
    times = [fit.ms(n) for n in grid]
    assert all(b >= a for a, b in itertools.pairwise(times))


# Real gloo ranks on this machine. Nothing below compares one measured time with another: on a shared 2-core
# VM a wake-up can wait for a timer tick and the load changes between sizes, so only what cannot depend on
# the machine's speed is checked (sizes, metadata, progress, that each size took some time, that it fits).
# The synthetic fits above check the fitting itself.


@pytest.mark.slow
def test_real_gloo_p2p_measurement_gives_a_point_per_size_and_fits():
    sizes = [4 << 10, 16 << 10, 64 << 10, 256 << 10, 1 << 20, 4 << 20, 16 << 20]
    calls = []
    points = measure_p2p(sizes, repeats=10, min_time_s=0.05, progress=lambda done, total: calls.append((done, total)))
    assert [p.nbytes for p in points] == sizes
    assert points.meta["backend"] == "gloo" and points.meta["host_staged"] is False
    assert calls[0] == (0, 10) and calls[-1] == (10, 10)
    assert all(np.isfinite(p.ms) and p.ms > 0 and np.isfinite(p.spread_ms) and p.spread_ms >= 0 for p in points)
    assert fit_link(points).meta["backend"] == "gloo"  # the fit says how its points were measured


@pytest.mark.slow
def test_real_gloo_allreduce_with_two_ranks():
    sizes = [4 << 10, 16 << 20]
    points = measure_allreduce(sizes, world_size=2, repeats=5, min_time_s=0.05)
    assert points.meta["op"] == "allreduce" and points.meta["world_size"] == 2
    assert [p.nbytes for p in points] == sizes and all(np.isfinite(p.ms) and p.ms > 0 for p in points)


@pytest.mark.slow
def test_real_gloo_allreduce_is_timed_beside_zero_one_and_two_computing_ranks():
    """On a CPU host the two ranks time an all-reduce beside 0, 1 and 2 of them computing: a factor per
    count over none computing's time (1.0), each from its own point at that size."""
    measured = measure_allreduce_beside_compute(256 << 10, repeats=3)
    points = measured["beside_compute_points"]
    assert [p["nbytes"] for p in points] == [256 << 10] * 3 and all(p["ms"] > 0 for p in points)
    ratios = [p["ms"] / points[0]["ms"] for p in points]
    assert measured["beside_compute"] == [round(max(ratios[:k + 1]), 4) for k in range(3)]
    assert measured["beside_compute"][0] == 1.0


@pytest.mark.slow
def test_a_measurement_that_runs_too_long_fails_fast_and_leaves_no_ranks():
    """The ranks would measure for a minute; the 1.5 s timeout ends them and says so. The bound on the wait
    is 20 times the timeout (spawning on a loaded machine) and half the minute: not a race between timings."""
    start = time.monotonic()
    with pytest.raises(LinkError, match="timed out after 1.5 s"):
        measure_p2p([4096], min_time_s=60, timeout_s=1.5)
    assert time.monotonic() - start < 30
    assert multiprocessing.active_children() == []


def test_bad_devices_are_refused_before_spawning():
    with pytest.raises(ValueError, match="device must be"):
        measure_p2p([4096], device="tpu")
    import torch

    if not torch.cuda.is_available():
        with pytest.raises(LinkError, match="no GPU"):
            measure_p2p([4096], device="cuda")
