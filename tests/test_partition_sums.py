"""The partitioner's table of every range's forward + backward ms, taken off integer prefix sums, is each range's
`stage_ms` (math.fsum's correctly rounded sum) to the bit: equal ranges tie as before, so no split changes."""

import math

from hypothesis import given, settings
from hypothesis import strategies as st

from pipesim.profiles.partition import LayerCost, _forward_backward_ms
from tests.conftest import stage_ms

# times of every magnitude, including those a float prefix sum would cancel away (1e16 + 1 - 1e16)
times = st.floats(-1e16, 1e16, allow_nan=False, allow_infinity=False) | st.floats(0, 1e-300) | st.sampled_from(
    [0.1, 0.2, 0.3, 1e16, -1e16, 1.0, 5e-324])


def _ranges_off_fsum(ms: list[float]) -> list[tuple[int, int]]:
    """The ranges (i, j) whose table entry is not stage_ms's, bit for bit (NaN matching NaN)."""
    layers = [LayerCost(value, 0, 0) for value in ms]
    table = _forward_backward_ms(layers)(0)
    return [(i, j) for i in range(len(layers)) for j in range(i + 1, len(layers) + 1)
            if not (table[i, j] == stage_ms(layers, i, j)
                    or (math.isnan(stage_ms(layers, i, j)) and math.isnan(table[i, j])))]


@settings(max_examples=300, deadline=None)
@given(ms=st.lists(times, min_size=1, max_size=12))
def test_stage_time_table_is_each_ranges_exact_sum(ms):
    assert _ranges_off_fsum(ms) == []


def test_stage_time_table_keeps_what_a_float_prefix_sum_cancels():
    ms = [1e16, 1.0, -1e16, 0.1, 0.2]
    assert _ranges_off_fsum(ms) == []
    assert _forward_backward_ms([LayerCost(value, 0, 0) for value in ms])(0)[0, 3] == 1.0  # prefixes would give 0


def test_stage_time_table_sums_a_time_that_is_not_finite_as_fsum_does():
    assert _ranges_off_fsum([1.0, math.inf, 2.0]) == []
