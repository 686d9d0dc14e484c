"""A layer no stage may start at (`LayerCost.follows_previous`: a sparse attention reusing the top k an earlier layer
of its stage kept, GLM-5.2's) is never a stage's first in any cut the partitioner searches: the time-balanced split,
the mirrored pairs' and the searched one each find the least slowest stage of the cuts that start stages only where
they may, and a count of stages more than the layers that may start one is refused in one line."""

import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipesim.profiles.partition import (
    LayerCost,
    PartitionError,
    leanest_partition,
    mirrored_partition,
    partition,
    searched_partition,
    starts_refusal,
)


@st.composite
def _layers(draw):
    n = draw(st.integers(2, 9))
    ms = draw(st.lists(st.sampled_from([0.5, 1.0, 2.0, 3.0, 7.25]), min_size=n, max_size=n))
    follows = draw(st.lists(st.booleans(), min_size=n, max_size=n))
    return [LayerCost(t, 1, 1, follows_previous=f) for t, f in zip(ms, follows, strict=True)], draw(st.integers(1, n))


def _least_slowest(layers, stages):
    """The least slowest stage over every cut whose stages start where they may, by brute force (None: no cut)."""
    n = len(layers)
    slowest = [max(sum(layer.ms for layer in layers[a:b]) for a, b in itertools.pairwise([0, *inner, n]))
               for inner in itertools.combinations(range(1, n), stages - 1)
               if not any(layers[start].follows_previous for start in inner)]
    return min(slowest, default=None)


def _slowest(layers, bounds):
    return max(sum(layer.ms for layer in layers[a:b]) for a, b in itertools.pairwise(bounds))


@settings(max_examples=300, deadline=None)
@given(problem=_layers())
def test_every_search_cuts_only_where_a_stage_may_start_and_finds_the_least_slowest(problem):
    layers, stages = problem
    least = _least_slowest(layers, stages)
    follows = [layer.follows_previous for layer in layers]
    searches = (lambda: partition(layers, stages),
                lambda: mirrored_partition(layers, stages, lambda k: []),
                lambda: searched_partition(layers, stages, lambda prefix: True),
                lambda: leanest_partition(layers, stages)[1])
    for search in searches:
        if least is None:
            with pytest.raises(PartitionError, match="stages, but a stage may start only at the"):
                search()
            continue
        bounds = search()
        assert starts_refusal(follows, bounds) is None
        if search is not searches[-1]:  # the leanest split minimises memory, not time
            assert np.isclose(_slowest(layers, bounds), least)


def test_a_cut_that_starts_a_stage_at_a_layer_reading_the_top_k_before_it_is_refused_naming_it():
    follows = [False, False, True, True, False, True, False]
    assert starts_refusal(follows, [0, 4, 7]) is None
    refused = starts_refusal(follows, [0, 2, 4, 7])
    assert refused == ("a stage would start at layer 2, which reuses the top k a sparse attention before it kept, "
                       "which no stage boundary passes on: start each stage at one of the 4 of the 7 layers that may "
                       "(0, 1, 4, 6)")
