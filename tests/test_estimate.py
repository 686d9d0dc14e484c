"""The time model of issue 29 held against closed forms: NCCL's collectives, a big GEMM at its efficiency,
tensor parallelism's split and collectives, Korthikanti et al.'s activation memory."""

import math

import pytest

from pipesim.hardware import collectives


@pytest.mark.parametrize("ranks", [2, 3, 8, 64])
def test_ring_all_reduce_is_nccl_tests_bus_bandwidth_factor(ranks):
    nbytes, latency_ms, bytes_per_ms = 1e9, 0.005, 1e8
    bus_factor = 2 * (ranks - 1) / ranks  # nccl-tests PERFORMANCE.md: busbw = algbw * 2(n-1)/n
    expected = 2 * (ranks - 1) * latency_ms + nbytes * bus_factor / bytes_per_ms
    assert collectives.ring_all_reduce_ms(nbytes, ranks, latency_ms, bytes_per_ms) == pytest.approx(expected)
    half = (ranks - 1) * latency_ms + nbytes * (ranks - 1) / ranks / bytes_per_ms
    assert collectives.reduce_scatter_ms(nbytes, ranks, latency_ms, bytes_per_ms) == pytest.approx(half)
    assert collectives.all_gather_ms(nbytes, ranks, latency_ms, bytes_per_ms) == pytest.approx(half)


def test_all_reduce_takes_the_tree_for_small_buffers_over_many_ranks_and_the_ring_for_large():
    latency_ms, bytes_per_ms, ranks = 0.01, 1e8, 256
    small, large = 1e3, 1e10
    tree_small = collectives.tree_all_reduce_ms(small, ranks, latency_ms, bytes_per_ms)
    assert tree_small == pytest.approx(2 * math.log2(ranks) * latency_ms
                                        + 2 * small / (collectives.TREE_BANDWIDTH_FACTOR * bytes_per_ms))
    assert collectives.all_reduce_ms(small, ranks, latency_ms, bytes_per_ms) == tree_small
    assert collectives.all_reduce_ms(large, ranks, latency_ms, bytes_per_ms) == \
        collectives.ring_all_reduce_ms(large, ranks, latency_ms, bytes_per_ms)


def test_one_rank_costs_nothing_and_bad_sizes_name_the_field():
    assert collectives.all_reduce_ms(1e9, 1, 0.01, 1e6) == 0.0
    with pytest.raises(ValueError, match="ranks"):
        collectives.all_reduce_ms(1e9, 0, 0.01, 1e6)
    with pytest.raises(ValueError, match="nbytes"):
        collectives.reduce_scatter_ms(-1, 2, 0.01, 1e6)
