"""A pipeline transfer's NCCL kernel beside Hopper's persistent products (`Costs.transfers_hold_products`): it holds
its multiprocessors from its launch until its data has moved and shares none with compute kernels (NVIDIA/nccl
issues 689 and 1025), so the compute beside it on either device is held back while they overlap: each product it
meets by the kernel's time left or the product's own time, the less."""

import itertools
import math
from dataclasses import replace
from fractions import Fraction

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipesim.schedules import ScheduleParams, build_schedule
from pipesim.sim import Cluster, Costs, simulate
from pipesim.sim.costs import HELD_PRODUCT_SLOWDOWN, held_compute, product_delay
from pipesim.traces import summarize


def _rows(method: str, p: int, m: int, hold: bool, product_ms: float = 0.0
          ) -> tuple[float, dict[str, tuple[float, float]]]:
    """The makespan (ms) and each op's start and duration (ms) by name (kind, stage, micro-batch) of `method` on p
    devices and m micro-batches, forwards 1 ms, backwards 2 ms, every transfer 0.5 ms, products `product_ms` each
    (0: not known)."""
    costs = Costs.per_stage(p, fwd_ms=1, bwd_ms=2)
    costs = replace(costs, transfers_hold_products=hold,
                    stages=tuple(replace(c, product_ms=product_ms) for c in costs.stages))
    trace = simulate(build_schedule(method, ScheduleParams(p, m)), costs, Cluster.uniform(p, 0.5))
    ops = trace.ops
    return summarize(trace).makespan_ms, {
        f"{trace.kinds[ops.kind[i]]}{ops.stage[i]}.{ops.microbatch[i]}": (ops.start_us[i] / 1e3, ops.dur_us[i] / 1e3)
        for i in range(len(ops))}


def test_a_send_holds_the_compute_after_it_until_its_data_has_moved():
    """GPipe on two devices: device 0's second forward starts as its first's output is sent (1 to 1.5 ms) and is
    held that long; device 1's second backward likewise beside the first's gradient. Without the hold, neither."""
    free_ms, free = _rows("gpipe", 2, 2, hold=False)
    held_ms, held = _rows("gpipe", 2, 2, hold=True)
    assert (free_ms, free["F0.1"], free["B1.1"]) == (10.0, (1.0, 1.0), (5.5, 2.0))
    assert (held_ms, held["F0.1"], held["B1.1"]) == (11.0, (1.0, 1.5), (6.0, 2.5))
    assert held["SEND_F0.1"][0] == 2.5  # sent once the held forward ends


def test_a_receive_holds_the_compute_its_data_moves_beside():
    """1F1B on two devices: the second forward's output reaches device 1 (2.5 to 3 ms) while it runs its first
    backward, which its receive's kernel holds 0.5 ms, though device 1 waits for that receive only after it."""
    _, free = _rows("1f1b", 2, 3, hold=False)
    held_ms, held = _rows("1f1b", 2, 3, hold=True)
    assert free["B1.0"] == (2.5, 2.0)
    assert held["B1.0"] == (2.5, 2.5)
    assert held["RECV_F1.1"] == (2.5, 0.5)
    assert held_ms == 14.5


def test_a_kernel_delays_each_product_it_meets_by_at_most_the_products_own_time():
    """GPipe's held forward of the first test, its products 0.1 ms each: the 0.5 ms send kernel doubles the two
    products it runs beside and delays the third by the 0.1 ms it has left, 0.3 ms in all (before: 0.5 ms); products
    longer than the kernel are delayed by its whole time, as without a product time."""
    _, short = _rows("gpipe", 2, 2, hold=True, product_ms=0.1)
    _, long = _rows("gpipe", 2, 2, hold=True, product_ms=1.0)
    assert short["F0.1"] == (1.0, 1.3)
    assert long["F0.1"] == (1.0, 1.5)


def test_product_delay_doubles_each_product_while_the_kernel_runs():
    """Products of 2 ps back to back beside a kernel: one of 1 ps delays the first by 1; of 3, the first by 2 (its
    own time; the second starts after the kernel); of 5, 2 + 1; of 8, 2 + 2."""
    assert [product_delay(kernel, 2) for kernel in (1, 3, 5, 8)] == [1, 2, 3, 4]


def test_the_engines_hold_and_a_held_pass_take_a_product_beside_a_long_kernel_alike():
    """A pass priced beside a communication kernel (planning/estimate.py `op_ms` on `Device.products_held_on`)
    takes each product `HELD_PRODUCT_SLOWDOWN` times its time; the engine's hold delays products back to back beside
    a kernel as long as n of them so held by the difference, so the two rules give one rate."""
    product_ps = 3
    for n in (1, 2, 5):
        kernel_ps = n * HELD_PRODUCT_SLOWDOWN * product_ps
        assert product_delay(kernel_ps, product_ps) == n * (HELD_PRODUCT_SLOWDOWN - 1) * product_ps


def test_only_hoppers_estimates_hold_their_compute_beside_transfers():
    """An interleaved gpt estimated on an H100 (persistent products) is slower for the hold; on an A100 (products
    in waves) its costs leave it off."""
    from tests.helpers import interleaved_gpt as _interleaved

    _, costs, step_ms = _interleaved("h100-sxm")
    assert costs.transfers_hold_products
    assert step_ms(costs) > step_ms(replace(costs, transfers_hold_products=False))
    _, a100, _ = _interleaved("a100-sxm-80gb")
    assert not a100.transfers_hold_products


def test_an_estimate_knows_its_products_time_where_they_run_persistent_ctas():
    """The interleaved gpt above: on an H100 every stage's products run a known time, shorter than its forward,
    and its step is no longer for them than with every hold whole; on an A100 (products in waves) none is given."""
    from tests.helpers import interleaved_gpt as _interleaved

    _, costs, step_ms = _interleaved("h100-sxm")
    assert all(0 < c.product_ms < c.fwd_ms for c in costs.stages)
    whole = replace(costs, stages=tuple(replace(c, product_ms=0.0) for c in costs.stages))
    assert step_ms(costs) <= step_ms(whole)
    _, a100, _ = _interleaved("a100-sxm-80gb")
    assert not any(c.product_ms for c in a100.stages)


def test_a_device_weighs_its_stages_products_as_a_stage_weighs_its_layers():
    """One rule for a mean of product times (`product_mean_ms`): a device of two stages, one running products of
    0.1 ms and one none known (0), meets the known one's, as a profile's stage of such layers does; weighted by
    forward + backward, 0.1 and 0.4 ms over 3 and 1 ms give 0.175; a device with none known reads 0."""
    from pipesim.profiles.schema import OPTIMIZERS, LayerProfile, Timing, aggregate_stages
    from pipesim.sim.engine import device_product_ms

    costs = Costs.per_stage(3, fwd_ms=1, bwd_ms=2)
    costs = replace(costs, stages=(replace(costs.stages[0], product_ms=0.1), costs.stages[1],
                                   replace(costs.stages[2], fwd_ms=0.5, bwd_ms=0.5, product_ms=0.4)))
    assert device_product_ms([[0, 1], [1], [0, 2]], costs) == pytest.approx([0.1, 0.0, 0.175])

    def timing(ms: float) -> Timing:
        return Timing(median_ms=ms, spread_ms=0.0, repeats=1)

    def layer(product_ms: float, fwd_ms: float, bwd_ms: float) -> LayerProfile:
        return LayerProfile(name="l", inputs=[-1], fwd=timing(fwd_ms), bwd=timing(bwd_ms), igrad=timing(0),
                            wgrad=timing(bwd_ms), activation_bytes=0, shared_with_previous_bytes=0, output_bytes=0,
                            param_bytes=0, grad_bytes=0, optimizer_state_bytes=dict.fromkeys(OPTIMIZERS, 0),
                            product_ms=product_ms)

    layers = [layer(0.1, 1, 2), layer(0.0, 1, 2), layer(0.4, 0.5, 0.5)]
    steps = [({}, timing(0), None, None)] * 3
    stages = aggregate_stages(layers, [0, 2, 3], "adam", [0, 0], steps[:2])
    assert [stage.product_ms for stage in stages] == pytest.approx([0.1, 0.4])
    pair = aggregate_stages([layers[0], layers[2]], [0, 2], "adam", [0], steps[:1])
    assert pair[0].product_ms == pytest.approx(0.175)


def _integrated_end(kernels: list[tuple[int, int]], start: int, work: int, product: int | None,
                    slower: Fraction) -> Fraction:
    """When `work` ps of compute begun at `start` ends beside `kernels`, stepped to each next whole ps (kernels begin
    and end on whole ps, so within one nothing changes) or to where the work or a product ends inside it, in exact
    fractions: without persistent products (`product` 0) it does 1/`slower` ps of work each ps some kernel runs,
    none where their time is not known (None); with them it runs, from each ps it meets a running kernel, products
    of `product` (the last the work left) back to back, each ending once it has run its own time plus the time it
    ran beside a kernel, at most `slower` - 1 times its own, until one ends where no kernel runs; one ps of work a ps
    otherwise."""
    def running(at: Fraction) -> bool:
        return any(begin <= at < end for begin, end in kernels)

    clock, done = Fraction(start), Fraction(0)
    while done < work:
        if product and running(clock):
            piece = min(product, work - done)
            most, ran, beside = (slower - 1) * piece, Fraction(0), Fraction(0)
            while ran < piece + min(beside, most):
                # beside a kernel its time and its time beside grow alike: it ends once the latter reaches `most`
                to_end = piece + (most if running(clock) else min(beside, most)) - ran
                step = min(math.floor(clock) + 1 - clock, to_end)
                beside += step * running(clock)
                clock, ran = clock + step, ran + step
            done += piece
            continue
        rate = Fraction(1) if not running(clock) else Fraction(0) if product is None else 1 / slower
        step = math.floor(clock) + 1 - clock
        if rate and done + rate * step >= work:
            return clock + (work - done) / rate
        clock, done = clock + step, done + rate * step
    return clock


@st.composite
def _beside_kernels(draw, product: int) -> list[tuple[int, int]]:
    """Kernels of several streams, shuffled: spans apart, each one to three kernels that overlap or touch; with
    persistent products the spans at least a product apart (the product a span ends in ends before the next)."""
    kernels, clock = [], draw(st.integers(0, 40))
    for _ in range(draw(st.integers(0, 4))):
        begin = clock + draw(st.integers(max(product, 1), 40))
        clock = begin + draw(st.integers(1, 30))
        cuts = sorted(draw(st.lists(st.integers(begin, clock), max_size=2)))
        edges = [begin, *cuts, clock]
        kernels += [(lo, min(hi + draw(st.integers(0, 5)), clock)) for lo, hi in itertools.pairwise(edges)
                    if hi > lo]
    return draw(st.permutations(kernels))


@settings(max_examples=300, deadline=None)
@given(st.data(), st.integers(0, 60), st.integers(1, 60), st.fractions(1, 4, max_denominator=100),
       st.one_of(st.none(), st.just(0), st.integers(1, 12)))
def test_held_compute_steps_the_rule_a_picosecond_at_a_time_would(data, start_ps, work_ps, slower, product_ps):
    """One stepping rule for compute beside kernels (`held_compute`: the engine's and Megatron-core's pair's) ends
    the work where the same rule integrated a picosecond at a time does, exactly, kernels of several streams in any
    order, overlapping or touching, the products `slower` times their time beside them a whole number or a fraction
    (the pair's, 1.37); its holds add up to the delay, at ascending points of the work, in whole ps where the
    products' time is known or not known and `slower` is whole. Given `slower` as a float (as the pair does), it ends
    the work within 1e-9 of that: float rounding alone (about 1e-16 a step), the rule being checked exactly above."""
    kernels = data.draw(_beside_kernels(product_ps or 0))
    end, holds = held_compute(kernels, start_ps, work_ps, product_ps, slower, hold_tag=7)
    assert end == _integrated_end(kernels, start_ps, work_ps, product_ps, slower)
    assert holds[0::3] == [7] * (len(holds) // 3)
    assert holds[1::3] == sorted(holds[1::3]) and all(0 <= done < work_ps for done in holds[1::3])
    assert sum(holds[2::3]) == end - start_ps - work_ps
    if product_ps != 0 and slower.denominator == 1:  # the engine's integers
        whole_end, whole_holds = held_compute(kernels, start_ps, work_ps, product_ps, int(slower), hold_tag=7)
        assert (whole_end, whole_holds) == (end, holds)
        assert isinstance(whole_end, int) and all(isinstance(held, int) for held in whole_holds)
    float_end, _ = held_compute(kernels, start_ps, work_ps, product_ps, float(slower))
    assert float_end == pytest.approx(end, rel=1e-9)


def test_a_kernel_that_never_ends_holds_the_work_it_meets_for_good():
    """A kernel ending at inf (ms beside compute whose products' time is not known) holds the work for good, alone
    or joined to one before it; the one pass over the sorted kernels once joined it to its end-of-list span and
    held nothing, ending the work at its own speed (4.0)."""
    for kernels in ([(0.0, math.inf)], [(0.0, 2.0), (2.0, math.inf)]):
        assert held_compute(kernels, 1.0, 3.0, None, hold_tag=7) == (math.inf, [7, 0, math.inf])
