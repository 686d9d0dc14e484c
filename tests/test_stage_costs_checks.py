"""A stage's costs refuse a number out of range in one line naming the field (sim/costs.py `StageCosts`): a time
(`*_ms`) from 0 to MAX_MS, a size from 0 to MAX_BYTES (above it, the memory counters overflowed: a traceback), finite
either way; the optional ones may be None. The checks are worked out once for the class (`_STAGE_NUMBERS`), so every
number field must be among them."""

import dataclasses
import math

import pytest

from pipesim.sim.costs import MAX_BYTES, MAX_MS, CostError, StageCosts

NUMBERS = [field for field in dataclasses.fields(StageCosts)
           if field.type in ("float", "int", "float | None", "int | None")
           and field.name not in ("wgrad_fraction", "expert_shards")]  # each a range of its own, tested below


@pytest.mark.parametrize("name", [field.name for field in NUMBERS])
def test_every_number_is_checked_and_named(name):
    limit = MAX_MS if name.endswith("_ms") else MAX_BYTES
    for bad in (-1, math.nan, math.inf, "1", limit * 2):
        with pytest.raises(CostError) as refused:
            StageCosts(**{"fwd_ms": 1.0, "bwd_ms": 1.0, name: bad})
        assert str(refused.value) == f"{name} must be a finite number from 0 to {limit:g} (got {bad!r})"
    StageCosts(**{"fwd_ms": 1.0, "bwd_ms": 1.0, name: limit})
    optional = next(field for field in NUMBERS if field.name == name).type.endswith("| None")
    if optional:
        StageCosts(**{"fwd_ms": 1.0, "bwd_ms": 1.0, name: None})
    else:
        with pytest.raises(CostError, match=f"^{name} must be a finite number"):
            StageCosts(**{"fwd_ms": 1.0, "bwd_ms": 1.0, name: None})


def test_the_first_field_out_of_range_is_named():
    with pytest.raises(CostError, match="^fwd_ms must"):
        StageCosts(fwd_ms=-1.0, bwd_ms=-1.0, param_bytes=-1)
    with pytest.raises(CostError, match="^param_bytes must"):
        StageCosts(fwd_ms=1.0, bwd_ms=1.0, param_bytes=-1, held_bytes=-1)


@pytest.mark.parametrize("bad", [-1, 0, math.nan, math.inf, "1"])
def test_expert_shards_is_a_finite_number_over_zero(bad):
    """W = E·ETP/t may be a fraction (ETP under t) but never 0: a rank holds 1/W of the routed experts."""
    with pytest.raises(CostError) as refused:
        StageCosts(fwd_ms=1.0, bwd_ms=1.0, expert_shards=bad)
    assert str(refused.value) == f"expert_shards must be a finite number over 0 (got {bad!r})"
    assert StageCosts(fwd_ms=1.0, bwd_ms=1.0, expert_shards=0.5).expert_shards == 0.5
