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


@settings(max_examples=200, deadline=None)
@given(sizes=st.lists(st.integers(0, 10**12), min_size=2, max_size=10), data=st.data())
def test_every_ranges_weights_hold_a_tied_layers_once_where_its_tie_is_in_the_range(sizes, data):
    """A tied layer's weights are its tie's (a tied head's, the embedding's): the range table of weights, the
    stage sums (`owners`) and the partitioner's 1F1B bytes count them once in a range holding both, each copy in a
    range holding one."""
    import numpy as np

    from pipesim.profiles.partition import owned_at, range_sums, stage_memory_bytes, tied_pairs

    k = data.draw(st.integers(1, len(sizes) - 1))
    tie = data.draw(st.integers(0, k - 1))
    layers = [LayerCost(1.0, size, 0, tied_layer=tie if i == k else -1) for i, size in enumerate(sizes)]
    assert tied_pairs(layers) == [(k, tie)]
    table = range_sums((layer.static_bytes for layer in layers), tied_pairs(layers))
    for i in range(len(sizes)):
        for j in range(i + 1, len(sizes) + 1):
            held = sum(sizes[i:j]) - (sizes[k] if i <= tie and k < j else 0)
            assert table[i, j] == held == sum(sizes[at] for at in owned_at(layers, i, j))
            assert stage_memory_bytes(layers, i, j, 0, 1) == held
    assert np.array_equal(range_sums(sizes), range_sums(sizes, ()))


def test_a_profiles_master_copy_holds_a_tied_layers_weights_once_where_its_tie_is_in_the_range():
    """A calibration's float32 masters of a tied head are the embedding's: a review found `Profile.master_bytes`
    counted them twice at p = 1 (avgpipe's parameters 1.0898 MiB where 0.9648 are held)."""
    from pathlib import Path

    from pipesim.profiles.schema import MASTER_ONLY, load_profile

    profile = load_profile(Path(__file__).resolve().parents[1] / "traces" / "profiles" / "gpt-cpu.json")
    last = len(profile.layers) - 1
    layers = [layer.model_copy(update={"optimizer_state_bytes": {**layer.optimizer_state_bytes, MASTER_ONLY: 8 + i},
                                       "tied_layer": 0 if i == last else -1})
              for i, layer in enumerate(profile.layers)]
    tied = profile.model_copy(update={"layers": layers})
    assert tied.master_bytes(0, last + 1) == sum(8 + i for i in range(last))
    assert tied.master_bytes(1, last + 1) == sum(8 + i for i in range(1, last + 1))
