"""Every order pays its gradient accumulations (each B or W but its span's first adds into the buffer, the engine's
`_gradient_spans`): a fixed order's bound on its costs (`planning.tune._costed`) and a searched order's on its
partition (`_searched_bound_ms`) count them, and must stay at or below the simulated step; a searched candidate's
own bound never sits above its shape's."""

import math
from collections.abc import Callable
from dataclasses import replace
from types import SimpleNamespace

import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from pipesim.planning import tune as tuning
from pipesim.planning.auto import search_schedule
from pipesim.schedules import Schedule, ScheduleParams, build_schedule
from pipesim.sim import Cluster, Costs, simulate
from pipesim.sim.cluster import Link
from tests.helpers import A100_GPT12 as MODEL
from tests.helpers import FIXED_ORDERS as FIXED
from tests.helpers import ROUNDING_MS, chains, fixed_order, searched_settings
from tests.helpers import costed_step_ms as _costed_step_ms
from tests.helpers import makespan_growth_ms as _growth_ms
from tests.helpers import measured_step_ms as _step_ms
from tests.helpers import tune_runs as _runs


@settings(max_examples=150, deadline=None)
@given(chains(), st.sampled_from(FIXED), st.booleans())
def test_a_fixed_orders_bound_with_its_accumulations_stays_at_or_below_its_step(chain, name, after_flush):
    """Random chains, accumulations up to 1 ms, two replicas' REDUCEs (after the flush or each after its stage's
    last backward), holds or not: the candidate's bound's step is never longer than tune's (`_measured`: the
    simulated growth, or the busiest device's compute where that is longer; shapes the
    method refuses left out; some forward takes time, as every profile's does, so that the bound is finite)."""
    costs, links, m = chain
    assume(any(stage.fwd_ms > 0 for stage in costs.stages))
    schedule_of = fixed_order(name, len(costs.stages), m, after_flush)
    bound_ms, busiest_ms = _costed_step_ms(schedule_of, costs, links)
    assert bound_ms <= max(_step_ms(schedule_of, costs, links), busiest_ms) * (1 + 1e-9) + ROUNDING_MS


@settings(max_examples=60, deadline=None)
@given(chains())
def test_the_partition_bound_with_its_accumulations_stays_at_or_below_the_step_auto_finds(chain):
    costs, links, m = chain
    p = len(costs.stages)
    params = ScheduleParams(p, m, 3, data_parallel=2, search_seconds=0.01)
    step_ms = _step_ms(lambda n: search_schedule(replace(params, minibatches=n), costs, links), costs, links)
    searched = search_schedule(params, costs, links)
    sends_ms = tuning._send_holds_ms(searched, tuning._ops_per_step(searched), costs.transfers_hold_products, links,
                                     [c.output_bytes for c in costs.stages], costs)
    assert tuning._searched_bound_ms(costs, m, tuning._hops_ms(links, costs, p), sends_ms) <= step_ms * (
        1 + 1e-9) + ROUNDING_MS


def test_the_fixed_orders_bound_counts_each_devices_accumulations():
    """1F1B on 4 devices, 8 micro-batches (F 1 ms, B 2), transfers 0.5 ms: each device's 7 accumulations a step
    (0.5 ms each) lengthen the bound's step by 3.5 ms, and the simulated step stays above it."""
    costs, links = Costs.per_stage(4, fwd_ms=1, bwd_ms=2), Cluster.uniform(4, 0.5)
    accumulating = replace(costs, stages=tuple(replace(stage, accumulate_ms=0.5) for stage in costs.stages))

    def schedule_of(minibatches: int):
        return build_schedule("1f1b", ScheduleParams(4, 8, minibatches))

    (plain, _), (counted, _) = (_costed_step_ms(schedule_of, c, links) for c in (costs, accumulating))
    assert counted == pytest.approx(plain + 7 * 0.5)
    assert counted <= _step_ms(schedule_of, accumulating, links)


def test_a_searched_candidates_bound_is_capped_at_its_shapes(monkeypatch):
    """A 12-layer GPT on 8 A100s, auto's first shape on its partition: a candidate built with a bound over the
    shape's comes out with the shape's."""
    prob = tuning.Problem(8, 80 * tuning.GIB, 32, ("auto",), 0, search_seconds=0.02)
    settings_ = searched_settings("-D", 8, "-B", 32, "-s", "auto", "-b", 2, "--tensor-parallel", 1, model=MODEL)
    orders = tuning._Orders()
    shapes, _, _ = tuning._shapes(settings_, prob, orders)
    built = tuning._Built(prob, orders)
    shape = next(item for item in map(built.advance, shapes) if isinstance(item, tuning.Shape))
    build = tuning._candidate
    monkeypatch.setattr(tuning, "_candidate", lambda *args: replace(build(*args), max_samples_per_s=1e12))
    candidate = built.candidate(shape)
    assert candidate.max_samples_per_s == shape.max_samples_per_s < 1e12


def test_a_partitions_accumulations_before_costing_are_its_costs_own():
    """The 12-layer GPT's estimates on 8 A100s (tests/test_tune_digests.py's 48 settings, every fixed method): on
    each chain's partition, the accumulations `_cut_accumulates_ms` reads off the profile before costing are the
    ones its costs price, on the calibrated cut and off it; so the partitioned bound, which counts them, stays at
    or above the candidate's, and lowers some below what it gives without them."""
    from tests.helpers import searched_shapes

    problem, orders, shapes = searched_shapes()
    built = tuning._Built(problem, orders)
    cuts, lowered = set(), 0
    for shape in shapes:
        partitioned = built.advance(shape)
        while isinstance(partitioned, tuning.Shape) and not partitioned.partitioned:
            partitioned = built.advance(partitioned)
        if not isinstance(partitioned, tuning.Shape):
            continue
        candidate = built.candidate(partitioned)
        profile = shape.setting.scenario.measured
        accumulates_ms = tuning._cut_accumulates_ms(profile, candidate.bounds)
        assert accumulates_ms.tolist() == [c.accumulate_ms for c in candidate.costs.stages]
        assert accumulates_ms.any()
        cuts.add(candidate.bounds == profile.partition.bounds)
        assert candidate.max_samples_per_s <= partitioned.max_samples_per_s * (1 + 1e-9)
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(tuning, "_cut_accumulates_ms", lambda profile, bounds: np.zeros(len(bounds) - 1))
            unheld = tuning._Built(problem, orders)
            plain = unheld.advance(shape)
            while not plain.partitioned:
                plain = unheld.advance(plain)
        lowered += partitioned.max_samples_per_s < plain.max_samples_per_s
    assert cuts == {True, False} and lowered > 0


def test_a_chain_whose_accumulations_settle_after_the_window_is_measured_at_its_steady_compute():
    """PipeDream-2BW on three stages, two replicas (a reviewer's case): tune's window reads the makespan's growth
    at 18.83 ms, before device 0's steady step (18 ms of compute and 1 ms adding its second micro-batch's
    gradients) sets in; the step `_measured` takes is that 19 ms (the periodic regime's, and the busiest device's
    steady compute), so the bound, which counts the accumulation, stays at or below it."""
    base = Costs.per_stage(3, fwd_ms=1.0, bwd_ms=2.0)
    none = dict(opt_ms=0.0, reduce_ms=0.0, output_bytes=0)
    given_costs = [dict(fwd_ms=3.5, bwd_ms=5.5, igrad_ms=1.0, wgrad_ms=4.5, accumulate_ms=1.0, **none),
                   dict(fwd_ms=0.0, bwd_ms=0.0, igrad_ms=0.0, wgrad_ms=0.0, accumulate_ms=0.0, **none),
                   dict(fwd_ms=0.0, bwd_ms=9.0, igrad_ms=4.0, wgrad_ms=5.0, accumulate_ms=0.0, **none)]
    costs = replace(base, stages=tuple(replace(stage, **g) for stage, g in zip(base.stages, given_costs)))
    links = Cluster(3, Link(latency_ms=0.0, bandwidth_bytes_per_ms=500.0))

    def schedule_of(minibatches: int) -> Schedule:
        return build_schedule("pipedream-2bw", ScheduleParams(3, 2, minibatches, data_parallel=2))

    bound_ms, steady_ms = _costed_step_ms(schedule_of, costs, links)
    assert _growth_ms(schedule_of, costs, links)[0] == pytest.approx(18.0 + 5 / 6)
    assert _step_ms(schedule_of, costs, links) == steady_ms == pytest.approx(19.0)
    assert bound_ms <= steady_ms


def test_an_order_whose_reduces_settle_after_the_window_is_measured_at_its_periodic_step():
    """PipeDream on two stages, one micro-batch a mini-batch, two replicas (hypothesis's shrunk example: stage 0
    F 3.5 ms, W 1.5, a 2 ms REDUCE; stage 1 no compute but a 2 ms update after a 4.5 ms REDUCE): its steps take
    6.5 ms for its first seven mini-batches, then 7 (stage 1's REDUCE chain and update) for good; the window
    from its warm-up's 6 mini-batches to 18 reads 6.96, under the bound; the step tune measures is the periodic
    regime's 7 ms, and the bound stays at or below it."""
    base = Costs.per_stage(2, fwd_ms=1.0, bwd_ms=2.0)
    given_costs = [dict(fwd_ms=3.5, bwd_ms=1.5, igrad_ms=0.0, wgrad_ms=1.5, opt_ms=0.0, reduce_ms=2.0),
                   dict(fwd_ms=0.0, bwd_ms=0.0, igrad_ms=0.0, wgrad_ms=0.0, opt_ms=2.0, reduce_ms=4.5)]
    costs = replace(base, stages=tuple(replace(stage, output_bytes=0, **g) for stage, g in zip(base.stages,
                                                                                              given_costs)))
    links = Cluster(2, Link(latency_ms=0.0, bandwidth_bytes_per_ms=500.0))

    def schedule_of(minibatches: int) -> Schedule:
        return build_schedule("pipedream", ScheduleParams(2, 1, minibatches, data_parallel=2))

    assert _runs(schedule_of) == (6, 18)
    assert _growth_ms(schedule_of, costs, links)[0] == pytest.approx(6.5 + 11 / 24)
    bound_ms, _ = _costed_step_ms(schedule_of, costs, links)
    assert bound_ms == pytest.approx(7.0)
    assert _step_ms(schedule_of, costs, links) == pytest.approx(7.0)
    assert bound_ms <= _step_ms(schedule_of, costs, links)


def _lagging_reduces() -> tuple[Callable[[int], Schedule], Costs, Cluster, list[int]]:
    """PipeDream on four stages, one micro-batch, REDUCEs after the flush, whose steps alternate 9 and 9.5 ms for
    twenty mini-batches while device 0's REDUCE chain falls behind, then take 9.5 for good: its order by its
    mini-batches, its costs and links, and the mini-batches of each order built, as built."""
    given_costs = [dict(fwd_ms=2.0, igrad_ms=1.0, wgrad_ms=1.0, bwd_ms=2.0, opt_ms=0.5, reduce_ms=5.0, output_bytes=0),
                   dict(fwd_ms=0.0, igrad_ms=0.0, wgrad_ms=1.0, bwd_ms=1.0, opt_ms=1.0, reduce_ms=1.0,
                        output_bytes=1000),
                   dict(fwd_ms=3.0, igrad_ms=0.5, wgrad_ms=2.0, bwd_ms=2.5, opt_ms=0.0, reduce_ms=0.0,
                        output_bytes=4000),
                   dict(fwd_ms=0.0, igrad_ms=1.0, wgrad_ms=3.0, bwd_ms=4.0, opt_ms=0.0, reduce_ms=5.0,
                        output_bytes=1000)]
    base = Costs.per_stage(4, fwd_ms=1.0, bwd_ms=2.0)
    costs = replace(base, stages=tuple(replace(stage, **g) for stage, g in zip(base.stages, given_costs)))
    links = Cluster(4, Link(latency_ms=0.5, bandwidth_bytes_per_ms=1000.0))
    built = []

    def schedule_of(minibatches: int) -> Schedule:
        built.append(minibatches)
        return build_schedule("pipedream", ScheduleParams(4, 1, minibatches, data_parallel=2,
                                                          reduce_after_flush=True))

    return schedule_of, costs, links, built


def test_a_window_not_yet_periodic_is_run_longer(monkeypatch):
    """`_lagging_reduces`' PipeDream: tune's window reads 9.29, the rows of its long run show no periodic regime
    yet, and the runs it makes longer find the 9.5. Allowed no longer run, the step is the least over the periods
    of the long run's largest mean step per row, each at or above the steady step: 9.5 here too (device 0's rows,
    one mini-batch apart), not the 9.29."""
    schedule_of, costs, links, built = _lagging_reduces()
    assert _growth_ms(schedule_of, costs, links)[0] == pytest.approx(9.0 + 7 / 24)
    del built[:]
    assert _step_ms(schedule_of, costs, links) == pytest.approx(9.5)
    assert max(built) > _runs(schedule_of)[1]
    monkeypatch.setattr(tuning, "LONGEST_STEADY_STEPS", tuning.STEADY_STEPS)
    assert _step_ms(schedule_of, costs, links) == pytest.approx(9.5)


def test_a_step_known_to_lose_is_bounded_from_below_without_a_longer_run():
    """`_lagging_reduces`' PipeDream: its long run's rows end at least 18.5 ms later two mini-batches on, so no
    steady step is under 9.25 (the steady one is 9.5). Asked only whether the step reaches 9.2 ms (`losing_ms`),
    `_periodic_step_ms` answers 9.25 from that run, building no longer one; asked whether it reaches 9.3, it runs
    on to the 9.5."""
    schedule_of, costs, links, built = _lagging_reduces()
    short, long = _runs(schedule_of)
    growth_ms, long_trace = _growth_ms(schedule_of, costs, links)
    del built[:]
    assert tuning._periodic_step_ms(schedule_of, short, schedule_of(long), long_trace, costs, links, growth_ms,
                                    9.2) == pytest.approx(9.25)
    assert built == [long]
    assert tuning._periodic_step_ms(schedule_of, short, schedule_of(long), long_trace, costs, links, growth_ms,
                                    9.3) == pytest.approx(9.5)
    assert max(built) > long


@settings(max_examples=120, deadline=None)
@given(chains(), st.sampled_from(("pipedream", "pipedream-2bw", "xpipe")), st.booleans())
def test_the_lower_bound_of_a_never_flushing_orders_step_stays_at_or_below_its_step(chain, name, after_flush):
    """Random chains, each order that never flushes, REDUCEs after the flush or not: asked only whether the step
    reaches 0 ms, `_periodic_step_ms` answers from tune's long run with its lower bound where that run shows no
    period (the rows' least shift c mini-batches on, over c), never above the step it measures when asked for it
    exactly (the periodic regime's, or the least of its upper bounds)."""
    costs, links, m = chain
    schedule_of = fixed_order(name, len(costs.stages), m, after_flush)
    short, long = _runs(schedule_of)
    growth = growth_ms, long_trace = _growth_ms(schedule_of, costs, links)
    lower_ms = tuning._periodic_step_ms(schedule_of, short, schedule_of(long), long_trace, costs, links, growth_ms,
                                        0.0)
    assert lower_ms <= _step_ms(schedule_of, costs, links, growth) * (1 + 1e-9) + ROUNDING_MS


def test_where_transfers_hold_the_compute_the_windows_lower_bound_gives_way_to_the_hold_free_orders():
    """XPipe on three stages, one micro-batch, REDUCEs after the flush, transfers holding the compute: its long
    run's rows end at least 16.49 ms later a mini-batch on, yet its steady step is 16.2 (a kernel that begins later
    can let the compute beside it end sooner: the engine is not max-plus there). Asked only whether the step
    reaches 0 ms, `_periodic_step_ms` answers the same order's without the holds, whose rows end no later: its
    period's 16.2, where the held run's window answered 16.49 and tune could cut a candidate that wins."""
    given_costs = [dict(fwd_ms=0.0, bwd_ms=2.0, igrad_ms=2.0, wgrad_ms=0.0, opt_ms=2.8, reduce_ms=4.8, product_ms=1.0),
                   dict(fwd_ms=1.2, bwd_ms=4.3, igrad_ms=1.0, wgrad_ms=3.6, opt_ms=4.0, reduce_ms=4.6, product_ms=0.1),
                   dict(fwd_ms=2.1, bwd_ms=5.3, igrad_ms=4.5, wgrad_ms=0.8, opt_ms=4.3, reduce_ms=4.5, product_ms=0.1)]
    accumulate_ms, output_bytes = (0.4, 0.4, 0.8), (947, 947, 87)
    costs = Costs.per_stage(3, fwd_ms=1.0, bwd_ms=2.0)
    costs = replace(costs, transfers_hold_products=True, stages=tuple(
        replace(stage, **given, accumulate_ms=accumulated, output_bytes=size)
        for stage, given, accumulated, size in zip(costs.stages, given_costs, accumulate_ms, output_bytes)))
    links = Cluster(3, Link(latency_ms=1.34, bandwidth_bytes_per_ms=7214.0))
    schedule_of = fixed_order("xpipe", 3, 1, True)
    short, long = _runs(schedule_of)
    growth = growth_ms, long_trace = _growth_ms(schedule_of, costs, links)
    step_ms = _step_ms(schedule_of, costs, links, growth)
    assert step_ms == pytest.approx(16.2)
    _, _, held_lower_ms = tuning._window_steps(tuning._row_ends_ps(long_trace), long - 3, short)
    assert held_lower_ms == pytest.approx(16.4919, abs=1e-4)
    assert tuning._periodic_step_ms(schedule_of, short, schedule_of(long), long_trace, costs, links, growth_ms,
                                    0.0) == pytest.approx(step_ms)


def _held_chain(given_costs: list[dict], link: Link) -> tuple[Costs, Cluster]:
    """A chain's costs from each stage's `given_costs`, its transfers holding the compute, on `link`."""
    costs = Costs.per_stage(len(given_costs), fwd_ms=1.0, bwd_ms=2.0)
    return replace(costs, transfers_hold_products=True, stages=tuple(
        replace(stage, **given) for stage, given in zip(costs.stages, given_costs))), Cluster(len(given_costs), link)


def _held_xpipe() -> tuple[Costs, Cluster, Callable[[int], Schedule], list[int]]:
    """XPipe on four stages, two micro-batches, transfers holding the compute (hypothesis's random chain, rounded):
    its costs, links, order by its mini-batches, and the mini-batches of each order built, in order."""
    costs, links = _held_chain([
        dict(fwd_ms=2.5, bwd_ms=4.9, igrad_ms=4.3, wgrad_ms=4.0, opt_ms=1.4, reduce_ms=2.0, accumulate_ms=1.0,
             product_ms=0.0, output_bytes=38),
        dict(fwd_ms=1.1, bwd_ms=0.5, igrad_ms=0.0, wgrad_ms=0.5, opt_ms=2.9, reduce_ms=3.1, accumulate_ms=0.5,
             product_ms=0.0, output_bytes=349),
        dict(fwd_ms=3.6, bwd_ms=3.1, igrad_ms=0.0, wgrad_ms=3.1, opt_ms=0.0, reduce_ms=2.3, accumulate_ms=0.9,
             product_ms=0.1, output_bytes=126),
        dict(fwd_ms=4.2, bwd_ms=4.7, igrad_ms=0.1, wgrad_ms=4.6, opt_ms=0.0, reduce_ms=0.0, accumulate_ms=0.0,
             product_ms=0.0, output_bytes=1211)], Link(latency_ms=0.0, bandwidth_bytes_per_ms=1541.0))
    xpipe = fixed_order("xpipe", 4, 2, False)
    built = []

    def schedule_of(minibatches: int) -> Schedule:
        built.append(minibatches)
        return xpipe(minibatches)

    return costs, links, schedule_of, built


def test_where_transfers_hold_the_compute_a_run_with_no_period_is_run_on_to_its_period():
    """`_held_xpipe`: every window up to tune's longest run (N = 102) reads a least upper bound of 19.274 ms, yet by
    N = 198 the step is 19.299 for good (the engine is not max-plus with holds, so no window bounds it).
    `_periodic_step_ms` runs it on to N = 198, where the period shows. Asked only whether the step reaches 19.1,
    it answers from the same order without the holds, whose rows end no later: its period's 19.2 (at N = 54), no
    longer held run built."""
    costs, links, schedule_of, built = _held_xpipe()
    short, long = _runs(schedule_of)
    longest = short + tuning.LONGEST_STEADY_STEPS
    _, least_ms, _ = tuning._window_steps(tuning._row_ends_ps(simulate(schedule_of(longest), costs, links)),
                                          longest - 2, short)
    assert least_ms == pytest.approx(19.274, abs=1e-3)
    growth_ms, long_trace = _growth_ms(schedule_of, costs, links)
    del built[:]
    assert tuning._periodic_step_ms(schedule_of, short, schedule_of(long), long_trace, costs, links,
                                    growth_ms) == pytest.approx(19.298637248)
    assert max(built) == short + 2 * tuning.LONGEST_STEADY_STEPS
    del built[:]
    assert tuning._periodic_step_ms(schedule_of, short, schedule_of(long), long_trace, costs, links, growth_ms,
                                    19.1) == pytest.approx(19.2)
    assert max(built) == short + 4 * tuning.STEADY_STEPS


def test_row_ends_are_each_rows_end_by_its_place_among_rows_alike_and_its_minibatch(monkeypatch):
    """`_row_ends_ps` of `_held_xpipe`'s long run, as its docstring defines it, counted out row by row in the order
    the trace lists them; the same where every key `_ordinal` packs is numbered densely as soon as it would pass 64
    values."""
    costs, links, schedule_of, _ = _held_xpipe()
    ops = simulate(schedule_of(_runs(schedule_of)[1]), costs, links).ops
    alike: dict[tuple, int] = {}
    ends: dict[tuple, dict[int, int]] = {}
    for i in range(len(ops.device)):
        row = tuple(int(column[i]) for column in (ops.device, ops.stream, ops.kind, ops.stage, ops.microbatch,
                                                    ops.pipeline, ops.peer))
        place = alike.get((row, int(ops.minibatch[i])), 0)
        alike[row, int(ops.minibatch[i])] = place + 1
        ends.setdefault((*row, place), {})[int(ops.minibatch[i])] = int(np.rint(ops.start_us[i] * 1e6)) + int(
            np.rint(ops.dur_us[i] * 1e6))
    expected = np.array([[by_minibatch[k] for k in sorted(by_minibatch)] for _, by_minibatch in sorted(ends.items())])
    trace = SimpleNamespace(ops=ops)
    assert np.array_equal(tuning._row_ends_ps(trace), expected)
    monkeypatch.setattr(tuning, "_ORDINAL_VALUES", 64)
    assert np.array_equal(tuning._row_ends_ps(trace), expected)


def test_the_hold_free_order_is_run_no_longer_once_its_step_is_known_to_stay_under_the_losing_one(monkeypatch):
    """`_held_xpipe`, asked whether its step reaches 19.25 ms: the hold-free order's first run (N = 18) bounds that
    order's steady step from above under 19.25 (it is max-plus: its window's least upper bound holds), and every
    lower bound its longer runs could give stays at or below that step, so it is run no longer (it was at N = 30
    and 54 for its period, 19.2, which could not reach 19.25 either); the held order runs on to its period, the
    step it answers with no limit asked (19.299, over the limit)."""
    costs, links, schedule_of, _ = _held_xpipe()
    short, long = _runs(schedule_of)
    growth_ms, long_trace = _growth_ms(schedule_of, costs, links)
    simulated = []
    run = tuning.simulate
    monkeypatch.setattr(tuning, "simulate", lambda schedule, costs, links, **options: simulated.append(
        (schedule.minibatches, costs.transfers_hold_products)) or run(schedule, costs, links, **options))
    step_ms = tuning._periodic_step_ms(schedule_of, short, schedule_of(long), long_trace, costs, links, growth_ms,
                                       19.25)
    assert step_ms == tuning._periodic_step_ms(schedule_of, short, schedule_of(long), long_trace, costs, links,
                                               growth_ms) == pytest.approx(19.298637248)
    assert [n for n, held in simulated if not held] == [long]


def test_where_devices_queue_on_one_link_a_run_with_no_period_is_run_on_to_its_period():
    """PipeDream on four stages, one micro-batch, every transfer queued on one bus first come, first served, and
    holding the compute (hypothesis's random chain, rounded): tune's longest run (N = 106) reads a least upper bound
    of 12.87 ms, yet the step settles at 14.61 (period 2) by N = 202, where `_periodic_step_ms` runs it on to. A bus
    the devices share is no max-plus rule even without the holds; a link per direction, each one device's, is."""
    bus = Link(latency_ms=1.644, bandwidth_bytes_per_ms=3561.1, resource="bus")
    costs, links = _held_chain([
        dict(fwd_ms=3.672, bwd_ms=5.135, igrad_ms=4.983, wgrad_ms=0.152, opt_ms=2.004, reduce_ms=0.0,
             accumulate_ms=0.0, product_ms=0.3, output_bytes=433),
        dict(fwd_ms=1.577, bwd_ms=0.865, igrad_ms=0.79, wgrad_ms=0.139, opt_ms=0.938, reduce_ms=0.777,
             accumulate_ms=0.457, product_ms=1.0, output_bytes=2909),
        dict(fwd_ms=1.035, bwd_ms=2.712, igrad_ms=1.5, wgrad_ms=2.571, opt_ms=0.0, reduce_ms=0.243,
             accumulate_ms=0.938, product_ms=0.0, output_bytes=1),
        dict(fwd_ms=3.064, bwd_ms=4.723, igrad_ms=3.672, wgrad_ms=1.577, opt_ms=0.0, reduce_ms=4.92,
             accumulate_ms=0.116, product_ms=0.0, output_bytes=104)], bus)
    schedule_of = fixed_order("pipedream", 4, 1, False)
    short, long = _runs(schedule_of)
    longest = short + tuning.LONGEST_STEADY_STEPS
    _, least_ms, _ = tuning._window_steps(tuning._row_ends_ps(simulate(schedule_of(longest), costs, links)),
                                          longest - 4, short)
    assert least_ms == pytest.approx(12.870, abs=1e-3)
    assert _step_ms(schedule_of, costs, links) == pytest.approx(14.60674491)
    unheld = replace(costs, transfers_hold_products=False)
    own = {(src, dst): replace(bus, resource=f"{src}->{dst}") for src in range(4) for dst in range(4)}
    assert not tuning._max_plus(unheld, links, 4) and tuning._max_plus(unheld, replace(links, links=own), 4)


def test_a_floor_bounded_against_a_higher_bar_is_found_again_for_a_lower_one(monkeypatch):
    """`_Built.floor` (1e52466): a candidate simulated against a bar (a speed key) it does not beat may come back
    with a bound from above of its speed, at or under the bar; asked again against a bar that bound beats, it is
    simulated again against that one, and once it beats the bar it was found against, its speed is exact and kept.
    The exact speed here is 100 samples/s, and each bound half a sample under its bar."""
    bars = []

    def floor(problem, candidate, beaten):
        bars.append(beaten)
        return ((100.0 if 100.0 > beaten else beaten - 0.5, 1.0, 0.0, 0), None)

    monkeypatch.setattr(tuning, "_floor", floor)
    built = tuning._Built(tuning.Problem(8, 80 * tuning.GIB, 32, ("1f1b",)), tuning._Orders())
    candidate = SimpleNamespace(index=0)
    found = [built.floor(candidate, bar).samples_per_s for bar in (150.0, 149.5, 120.0, 50.0, -math.inf)]
    assert found == [149.5, 149.5, 119.5, 100.0, 100.0]
    assert bars == [150.0, 120.0, 50.0]  # 149.5 does not beat 149.5, and 100 beat the bar it was found against
    assert built.result(candidate).samples_per_s == 100.0  # exact: nothing to replay
