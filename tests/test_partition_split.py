"""The partitioner's split (`partition`, `leanest_partition`) is the plain dynamic programme's, cut for cut: the least
slowest stage, and on a tie the earliest start of the last stage, then of the stage before within the least slowest
of the layers left to it, and so on. The reference below is that definition written out in Python, one range at a
time; profiles/partition.py computes it over blocks of ranges at once (only the ranges a stage can hold)."""

import itertools
import math
from functools import cache

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from pipesim.profiles import partition as partition_module
from pipesim.profiles.partition import (
    LayerCost,
    OverCapError,
    PartitionError,
    ScaledRanges,
    leanest_partition,
    partition,
)

# few distinct values, so that ties are common; negative ones only where no range is (i >= j)
COSTS = st.sampled_from([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 7.25])


def _reference(n: int, stages: int, cost) -> tuple[float, list[int]]:
    """The least slowest stage over every split of n layers into `stages` and its cut, `cost(k, i, j)` stage k's
    cost over layers i .. j-1: best(k, j) is the least slowest of layers 0 .. j-1 in stages 0 .. k, stage k's
    start the first that reaches it."""

    @cache
    def best(k: int, j: int) -> tuple[float, tuple[int, ...]]:
        if k == 0:
            return cost(0, 0, j), (0, j)
        chosen = None
        for i in range(k, j):  # stages 0 .. k-1 need a layer each
            slowest = max(best(k - 1, i)[0], cost(k, i, j))
            if chosen is None or slowest < chosen[0]:
                chosen = (slowest, best(k - 1, i)[1] + (j,))
        return chosen

    slowest, bounds = best(stages - 1, n)
    return slowest, list(bounds)


def _least_over_every_cut(n: int, stages: int, cost) -> float:
    return min(max(cost(k, i, j) for k, (i, j) in enumerate(itertools.pairwise([0, *inner, n])))
               for inner in itertools.combinations(range(1, n), stages - 1))


@st.composite
def _problems(draw):
    n = draw(st.integers(1, 9))
    stages = draw(st.integers(1, n))
    below = np.tri(n + 1, dtype=bool)  # [i, j], i >= j: no range, any value
    times = draw(arrays(np.float64, (stages, n + 1, n + 1), elements=COSTS))
    times = np.where(below, -draw(arrays(np.float64, (n + 1, n + 1), elements=COSTS)), times)
    held = draw(arrays(np.int64, (stages, n + 1, n + 1), elements=st.integers(0, 12)))
    return n, stages, times, held, draw(st.integers(0, 12))


@settings(max_examples=400, deadline=None)
@given(problem=_problems())
def test_the_split_within_a_cap_is_the_references(problem):
    n, stages, times, held, cap = problem
    layers = [LayerCost(1.0, 0, 0)] * n

    def capped(k: int, i: int, j: int) -> float:
        return math.inf if held[k, i, j] > cap else float(times[k, i, j])

    slowest, bounds = _reference(n, stages, capped)
    assert slowest == _least_over_every_cut(n, stages, capped)
    if slowest == math.inf:
        try:
            partition(layers, stages, cap, held.__getitem__, times.__getitem__)
        except PartitionError as refused:
            least = _reference(n, stages, lambda k, i, j: float(held[k, i, j]))[0]
            assert f"{least / 2**30:.3g} GiB" in str(refused)
        else:
            raise AssertionError("a cap no split fits was not refused")
    else:
        assert partition(layers, stages, cap, held.__getitem__, times.__getitem__) == bounds
    assert partition(layers, stages, None, held.__getitem__, times.__getitem__) == \
        _reference(n, stages, lambda k, i, j: float(times[k, i, j]))[1]


@settings(max_examples=300, deadline=None)
@given(problem=_problems())
def test_the_leanest_split_is_the_references(problem):
    n, stages, _, held, _ = problem
    least, bounds = _reference(n, stages, lambda k, i, j: float(held[k, i, j]))
    assert leanest_partition([LayerCost(1.0, 0, 0)] * n, stages, held.__getitem__) == (least, bounds)


@settings(max_examples=300, deadline=None)
@given(ms=st.lists(COSTS, min_size=1, max_size=9), data=st.data())
def test_the_default_split_of_layer_times_is_the_references(ms, data):
    """Forward + backward summed per range, each stage alike: the split `simulate` re-partitions profiles with."""
    stages = data.draw(st.integers(1, len(ms)))
    layers = [LayerCost(value, 0, 0) for value in ms]
    assert partition(layers, stages) == _reference(len(ms), stages, lambda k, i, j: math.fsum(ms[i:j]))[1]


def test_stages_whose_costs_differ_in_type_are_compared_as_numbers():
    """One stage's bytes counted in integers, another's in fractions (a share of a buffer): neither is cast to the
    other's type (cast to stage 0's integers, stage 1's 3.75 would read 3)."""
    held = [np.array([[0, 3, 5, 9], [0, 0, 2, 6], [0, 0, 0, 4], [0, 0, 0, 0]]), np.full((4, 4), 2.5)]
    held[1][1, 3] = 3.75
    assert leanest_partition([LayerCost(1.0, 0, 0)] * 3, 2, held.__getitem__) == (3.75, [0, 1, 3]) == \
        _reference(3, 2, lambda k, i, j: float(held[k][i, j]))


def test_a_cap_no_split_fits_builds_the_1f1b_memory_tables_once(monkeypatch):
    """The cap's check and the leanest split it falls back on read the same 1F1B tables, built once."""
    built = []

    def counted(layers, stages):
        built.append(stages)
        return one_f_one_b_bytes(layers, stages)

    one_f_one_b_bytes = partition_module._one_f_one_b_bytes
    monkeypatch.setattr(partition_module, "_one_f_one_b_bytes", counted)
    with pytest.raises(OverCapError) as refused:
        partition([LayerCost(1.0, 100, 10)] * 4, 2, memory_cap_bytes=50)
    assert built == [2] and refused.value.leanest == leanest_partition([LayerCost(1.0, 100, 10)] * 4, 2)[1]


@settings(max_examples=300, deadline=None)
@given(data=st.data())
def test_scaled_ranges_read_at_once_are_each_stages_table(data):
    """`ScaledRanges`' blocks of every stage, read at once off strided views of its tables (`_stage_blocks`), are
    those cut from each stage's whole table, `base + scales[k] · table + ...`, entry for entry, and over a cap."""
    n = data.draw(st.integers(1, 8))
    stages = data.draw(st.integers(1, n))
    table = arrays(np.int64, (n + 1, n + 1), elements=st.integers(0, 1_000))
    terms = tuple((data.draw(st.lists(st.integers(0, 5), min_size=stages, max_size=stages)), data.draw(table))
                  for _ in range(data.draw(st.integers(0, 2))))
    costs = ScaledRanges(data.draw(table), terms)
    whole = [costs(k) for k in range(stages)]  # each stage's (n+1) x (n+1) table, as a plain `StageCosts`
    cap = data.draw(st.integers(0, 6_000))
    for above in (None, cap):
        assert np.array_equal(partition_module._stage_blocks(n, stages, costs, above),
                              partition_module._stage_blocks(n, stages, whole.__getitem__, above))
