"""Transfers that hold the compute beside them (`Costs.transfers_hold_products`): tune's bound counts the time a
device's own sends hold its compute (`planning.tune._send_holds_ms`), which must stay at or above the simulation
and leave the pruned search's answer the exhaustive one's; the engine lays the holds on the rows
(`sim.engine._held_back`) with one bisection for all of them."""

from dataclasses import replace

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipesim.planning import tune as tuning
from pipesim.planning.scenario import Scenario
from pipesim.profiles.schema import load_profile
from pipesim.schedules import ScheduleParams, build_schedule
from pipesim.sim import Cluster, Costs, simulate
from pipesim.sim.engine import _search_right
from pipesim.traces import summarize
from tests.helpers import GPT_CPU as GPT
from tests.helpers import adam_settings as scenario
from tests.helpers import bounds_over_random_costs, differences, exhaustive
from tests.helpers import tune_problem as problem


@pytest.fixture
def holding(monkeypatch):
    """Every scenario's transfers holding the compute beside them, as an H100's estimate has them."""
    monkeypatch.setattr(Scenario, "transfers_hold_products", property(lambda self: True))


def _sends_ms(schedule, costs, links):
    return tuning._send_holds_ms(schedule, tuning._ops_per_step(schedule), costs.transfers_hold_products, links,
                                 [c.output_bytes for c in costs.stages], costs)


def test_the_send_holds_bound_stays_above_the_simulation_and_lowers_some(holding):
    """Every candidate's bound, and its critical path's, at or above its simulated samples/s with the holds on;
    the holds' term the larger of the two waits on some device, and some critical paths longer for the holds."""
    profile = load_profile(GPT)
    source, prob = scenario(profile), problem(profile, 4, 1.0, schedules=("gpipe", "1f1b", "zb-h1", "zb-h2"))
    candidates, _, _ = tuning.prepare(source, prob)
    lowered = tighter = 0
    for candidate in candidates:
        result, label = tuning.evaluate(prob, candidate), candidate.config.label()
        assert candidate.costs.transfers_hold_products
        critical = tuning._with_critical_path(prob, candidate)
        assert result.samples_per_s <= critical.max_samples_per_s <= candidate.max_samples_per_s, label
        unheld = replace(candidate, costs=replace(candidate.costs, transfers_hold_products=False))
        tighter += critical.max_samples_per_s < tuning._with_critical_path(prob, unheld).max_samples_per_s
        schedule, costs = candidate.schedule, candidate.costs
        holds = _sends_ms(schedule, costs, candidate.links)
        assert not _sends_ms(schedule, replace(costs, transfers_hold_products=False), candidate.links).any()
        table = costs.op_ms_table(1)
        exposed = tuning._StepRows.of(schedule, candidate.short_minibatches).exposed_ms(table,
                                                                                       tuning._row_costs_ms(table))
        lowered += bool((holds > exposed).any())
    assert lowered > 0 and tighter > 0


def test_the_search_with_holds_gives_the_exhaustive_answer(holding):
    profile = load_profile(GPT)
    source, prob = scenario(profile), problem(profile, 4, 1.0, schedules=("gpipe", "1f1b", "zb-h1", "zb-h2"))
    found = tuning.tune(source, prob)
    assert differences(found, *exhaustive(source, prob)[:3]) == []


@settings(max_examples=200, deadline=None)
@given(st.lists(st.lists(st.integers(0, 50), max_size=8), min_size=1, max_size=6),
       st.lists(st.tuples(st.integers(0, 5), st.integers(-5, 55)), max_size=20))
def test_one_bisection_finds_what_searchsorted_finds_in_each_slice(slices, targets):
    values = np.concatenate([np.sort(np.array(s, dtype=np.int64)) for s in slices])
    bounds = np.cumsum([0] + [len(s) for s in slices])
    chosen = [(i % len(slices), at) for i, at in targets]
    lo = np.array([bounds[i] for i, _ in chosen], dtype=np.int64)
    hi = np.array([bounds[i + 1] for i, _ in chosen], dtype=np.int64)
    at = np.array([a for _, a in chosen], dtype=np.int64)
    expected = [a + np.searchsorted(values[a:b], p, "right") for a, b, p in zip(lo, hi, at)]
    assert _search_right(values, lo, hi, at).tolist() == expected


def test_every_bound_stays_above_the_simulation_with_the_holds(holding):
    """Shape, partitioned (a searched order's too: `_searched_bound_ms` with its sends' holds), candidate and
    critical-path bounds all at or above the simulation of random costs with the holds on."""
    counts = bounds_over_random_costs(GPT, 4, 0.2, 2)
    assert counts["held"] == counts["checked"] > 0
    assert counts["bubbles"] and counts["cut"] and counts["planned"]


def test_every_bound_stays_above_the_simulation_with_products_held_at_most_their_own_time(holding, monkeypatch):
    """As above, each layer's products an eighth of its forward (`LayerProfile.product_ms`), which a transfer's
    kernel delays at most: the bounds count the least such a hold can be (`tuning._least_hold`)."""
    import tests.helpers as with_profiles  # bounds_over_random_costs loads its profile there

    loaded = with_profiles.load_profile
    monkeypatch.setattr(with_profiles, "load_profile", lambda path: _with_products(loaded(path)))
    counts = bounds_over_random_costs(GPT, 4, 0.2, 2)
    assert counts["held"] == counts["checked"] > 0


def _with_products(profile):
    return profile.model_copy(update={"layers": [layer.model_copy(update={"product_ms": layer.fwd.median_ms / 8})
                                                 for layer in profile.layers]})


def test_a_send_holds_the_bound_by_at_most_the_products_it_meets():
    """1F1B as below, products 0.1 ms: each 0.5 ms send holds the next row 0.3 ms (two products doubled, the third
    by what is left), so the middle devices' sends add 16 x 0.3 ms a step, not 16 x 0.5."""
    costs = replace(Costs.per_stage(4, fwd_ms=1, bwd_ms=2), transfers_hold_products=True)
    costs = replace(costs, stages=tuple(replace(c, product_ms=0.1) for c in costs.stages))
    schedule, links = build_schedule("1f1b", ScheduleParams(4, 8)), Cluster.uniform(4, 0.5)
    held = _sends_ms(schedule, costs, links)
    assert np.allclose(held, [2.4, 4.8, 4.8, 2.4])
    assert tuning._searched_bound_ms(costs, 8, tuning._hops_ms(links, costs, 4), held) <= summarize(
        simulate(schedule, costs, links)).makespan_ms


def test_each_device_is_held_for_the_outputs_it_sends():
    """1F1B on 4 devices, 8 micro-batches, forwards 1 ms, backwards 2 ms, every transfer 0.5 ms: the ends send
    8 outputs a step, the middle 16, so a searched order's bound rises from 25 ms (stage 3's chain of passes) to
    32 (a middle device's 24 ms of compute and 8 of sends), still below the simulated step, and so does a fixed
    order's on its partition, from 24."""
    costs = replace(Costs.per_stage(4, fwd_ms=1, bwd_ms=2), transfers_hold_products=True)
    schedule, links = build_schedule("1f1b", ScheduleParams(4, 8)), Cluster.uniform(4, 0.5)
    sends_ms = _sends_ms(schedule, costs, links)
    assert sends_ms.tolist() == [4.0, 8.0, 8.0, 4.0]
    hops_ms = tuning._hops_ms(links, costs, 4)
    assert tuning._searched_bound_ms(costs, 8, hops_ms, np.zeros(4)) == 25.0
    assert tuning._searched_bound_ms(costs, 8, hops_ms, sends_ms) == 32.0 < summarize(
        simulate(schedule, costs, links)).makespan_ms
    assert not _sends_ms(schedule, replace(costs, transfers_hold_products=False), links).any()
    order, table = tuning._Order.of(schedule), costs.op_ms_table(1)
    assert tuning._planned_bound_ms(order, 1, table, np.zeros(4), hops_ms, np.zeros(4), np.zeros(4)) == 24.0
    assert tuning._planned_bound_ms(order, 1, table, np.zeros(4), hops_ms, sends_ms, np.zeros(4)) == 32.0
