"""A searched order's (auto's) bound on its partition, before its search: each device's own step, from its first
forward to the next step's (`planning.tune._searched_device_bound_ms`), must stay at or below the step of the order
auto finds, and prunes searches `_searched_bound_ms` alone leaves to run."""

from dataclasses import replace

from hypothesis import given, settings

from pipesim.planning import tune as tuning
from pipesim.planning.auto import search_schedule
from pipesim.schedules import ScheduleParams
from pipesim.sim import Cluster, Costs
from tests.helpers import A100_GPT12 as MODEL
from tests.helpers import ROUNDING_MS, chains, makespan_ms, searched_settings


@settings(max_examples=120, deadline=None)
@given(chains())
def test_the_device_bound_stays_at_or_below_the_step_of_the_order_auto_finds(chain):
    """The step as tune measures it (the makespan's growth from two mini-batches to three, `_measured`) of auto's
    own order, REDUCEs, accumulations and holds in, is never shorter than the bound."""
    costs, links, m = chain
    p = len(costs.stages)
    params = ScheduleParams(p, m, 3, data_parallel=2, search_seconds=0.01)
    long_order, short_order = (search_schedule(replace(params, minibatches=n), costs, links) for n in (3, 2))
    step_ms = makespan_ms(long_order, costs, links) - makespan_ms(short_order, costs, links)
    holds = tuning._sends_hold(long_order, costs.transfers_hold_products, links)
    assert holds == costs.transfers_hold_products
    assert tuning._searched_device_bound_ms(costs, m, links, holds) <= step_ms * (1 + 1e-9) + ROUNDING_MS


def test_the_device_bound_counts_both_waits_of_a_device_and_its_accumulations():
    """1F1B's costs on 4 devices, 8 micro-batches (F 1 ms, I 1, W 1, transfers 0.5 ms each way): the last device
    waits for 3 stages' fill and drain besides its own 8 F's and I's, device 0 for the 3 others' round trip; each
    accumulation (0.25 ms, 7 a step) adds on every device, which the partition bound counts on each device's
    compute only (8 x 3 + 7 x 0.25 = 25.75 over the chain's 25)."""
    costs, links = Costs.per_stage(4, fwd_ms=1, bwd_ms=2), Cluster.uniform(4, 0.5)
    assert tuning._searched_device_bound_ms(costs, 8, links, False) == 26.0  # 8 + 8 + 3 x 3 + the last W
    assert tuning._searched_bound_ms(costs, 8, tuning._hops_ms(links, costs, 4), [0.0] * 4) == 25.0
    accumulating = replace(costs, stages=tuple(replace(stage, accumulate_ms=0.25) for stage in costs.stages))
    assert tuning._searched_device_bound_ms(accumulating, 8, links, False) == 26.0 + 8 * 0.25 - 0.25
    assert tuning._searched_bound_ms(accumulating, 8, tuning._hops_ms(links, costs, 4), [0.0] * 4) == 25.75


def test_the_device_bound_prunes_searches_and_keeps_the_answer(monkeypatch):
    """A 12-layer GPT on 8 A100s (t = 1, b = 2, the host free: at 31.9 us a kernel its passes are the host's and one
    stage is fastest, where auto's order is zb-h1's), auto among the methods and chosen: the search with the device
    bound runs fewer of auto's searches than with `_searched_bound_ms` alone, and gives the same rows, figures and
    notes."""
    flags = ("-D", 8, "-B", 32, "-s", "auto,1f1b,zb-h1", "-b", 2, "--tensor-parallel", 1, "--host-kernel-us", 0)
    prob = tuning.Problem(8, 80 * tuning.GIB, 32, ("auto", "1f1b", "zb-h1"), 0, search_seconds=0.02)
    searched = []
    build = tuning._candidate

    def counted(setting, problem, config, *args):
        searched.append(config.schedule == "auto")
        return build(setting, problem, config, *args)

    def answer() -> tuple[dict, int]:
        searched.clear()
        found = tuning.tune(searched_settings(*flags, model=MODEL), prob).to_dict()
        return {key: value for key, value in found.items() if key != "search"}, sum(searched)

    monkeypatch.setattr(tuning, "_candidate", counted)
    bounded, bounded_searches = answer()
    monkeypatch.setattr(tuning, "_searched_device_bound_ms", lambda *args: 0.0)
    unbounded, searches = answer()
    assert bounded == unbounded and bounded["choice"]["schedule"] == "auto"
    assert bounded_searches < searches
