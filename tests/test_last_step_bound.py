"""A flushing schedule's critical path over its last step (`planning.tune._critical_path_ms`) also bounds the step
by the longest chain of waits from some device's first row of the last mini-batch (`_longest_from_ms`): whichever
device ended the mini-batch before last starts the last one no earlier than the short run ends. It must stay at or
below the step tune measures, and prunes the 70B's p = 32 candidates whose devices with the longest updates start
their next step last."""

from dataclasses import replace

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from pipesim.planning import tune as tuning
from pipesim.planning.auto import search_schedule
from pipesim.schedules import METHODS, ScheduleError, ScheduleParams, flushes
from pipesim.sim import Cluster, Costs
from pipesim.sim.cluster import Link
from tests.helpers import ROUNDING_MS, chains, makespan_ms

PAIRED = ("interleaved-1f1b", "zb-v", "dualpipev", "dualpipe")  # v = 2 model stages per device
FLUSHING = ("gpipe", "1f1b", "zb-h1", "zb-h2", "auto", *PAIRED)


def _step_and_path_ms(name: str, params: ScheduleParams, costs: Costs, links: Cluster) -> tuple[float, float]:
    """The step as tune measures a flushing order's (the makespan's growth from N - 1 = 2 mini-batches to N = 3)
    and the critical path over its last step."""
    long_order, short_order = (search_schedule(replace(params, minibatches=n), costs, links) if name == "auto" else
                               METHODS[name].build(replace(params, minibatches=n)) for n in (3, 2))
    assert flushes(long_order)
    return (makespan_ms(long_order, costs, links) - makespan_ms(short_order, costs, links),
            tuning._critical_path_ms(long_order, costs.op_ms_table(1), costs, links, 1, 1))


@st.composite
def chains_and_links(draw):
    """`chains`, with some links between two devices their own: a pass of no time between two sends shows where
    the links out of its device are slower than those into it (a receive's hold is not counted)."""
    costs, links, m = draw(chains())
    own = {(a, b): Link(latency_ms=draw(st.floats(0.0, 2.0)), bandwidth_bytes_per_ms=draw(st.floats(500, 1e4)))
           for a in range(links.num_devices) for b in range(links.num_devices) if a != b and draw(st.booleans())}
    return costs, Cluster(links.num_devices, links.default_link, own), m


@settings(max_examples=150, deadline=None)
@given(chains_and_links(), st.sampled_from(FLUSHING))
def test_the_last_steps_path_stays_at_or_below_the_simulated_step(chain, name):
    """Random stage costs of a chain of p·v stages (each with its own REDUCE over two replicas, update and
    accumulation; sends and receives holding the compute or not; links of their own): never above the simulated
    step."""
    costs, links, m = chain
    chunks = 2 if name in PAIRED else 1
    assume(len(costs.stages) % chunks == 0)
    try:
        step_ms, path_ms = _step_and_path_ms(name, ScheduleParams(len(costs.stages) // chunks, m, 3, chunks,
                                                                  data_parallel=2, search_seconds=0.01), costs, links)
    except ScheduleError:
        assume(False)
    assert path_ms <= step_ms * (1 + 1e-9) + ROUNDING_MS


def test_a_later_devices_longer_update_lengthens_the_path_to_the_step():
    """1F1B on two stages, the second's REDUCE six times the first's: device 1 ends each step last, after device 0
    has started the next, which device 0's path (16.9 ms) misses; the least chain from a device's first row of the
    last step to the end of a row is the simulated step, 18.7 ms."""
    costs = Costs.per_stage(2, fwd_ms=1.0, bwd_ms=2.0)
    costs = replace(costs, stages=(replace(costs.stages[0], reduce_ms=1.0, opt_ms=0.5),
                                   replace(costs.stages[1], reduce_ms=6.0, opt_ms=0.5)))
    links = Cluster(2, Link(latency_ms=0.1, bandwidth_bytes_per_ms=1e4))
    params = ScheduleParams(2, 4, 3, data_parallel=2)
    step_ms, path_ms = _step_and_path_ms("1f1b", params, costs, links)
    longer = METHODS["1f1b"].build(replace(params, minibatches=4))  # its step 1 is not its last: device 0's alone
    device_0_ms = tuning._critical_path_ms(longer, costs.op_ms_table(1), costs, links, 1, 1)
    assert device_0_ms == pytest.approx(16.9) and path_ms == pytest.approx(step_ms) == pytest.approx(18.7)


@pytest.mark.parametrize("others_ms", [1.0, 0.01])
def test_a_pass_of_no_time_is_not_held_so_its_send_holds_the_next_row_beside_the_one_before(others_ms):
    """1F1B on three stages whose sends hold the compute, stage 1's forward of no time between its 10 ms backwards,
    the links into device 1 free and those out of it 1 ms: the gradient it sends back and the activation its
    forward sends on run together and hold its next backward 1 ms, not 2 (the engine holds only compute left to
    do). Counted one after the other, the path was 51.0 ms against the simulated step's 50.0 (the other stages'
    passes 1 ms), device 1's sends' holds 8 ms beside its 40 ms of compute against 45.05 (0.01 ms), and auto's
    device bound 47.0 against its order's 46.015 (0.01 ms)."""
    costs = Costs.per_stage(3, fwd_ms=others_ms, bwd_ms=others_ms)
    costs = replace(costs, stages=(costs.stages[0], replace(costs.stages[1], fwd_ms=0.0, bwd_ms=10.0),
                                   costs.stages[2]), transfers_hold_products=True)
    free = Link(latency_ms=0.0, bandwidth_bytes_per_ms=1e4)
    links = Cluster(3, Link(latency_ms=1.0, bandwidth_bytes_per_ms=1e4), {(0, 1): free, (2, 1): free})
    params = ScheduleParams(3, 4, 3)
    step_ms, path_ms = _step_and_path_ms("1f1b", params, costs, links)
    schedule = METHODS["1f1b"].build(params)
    holds_ms = tuning._send_holds_ms(schedule, tuning._ops_per_step(schedule), True, links,
                                     [c.output_bytes for c in costs.stages], costs)
    assert path_ms <= step_ms + ROUNDING_MS and 4 * 10.0 + holds_ms[1] <= step_ms + ROUNDING_MS
    assert holds_ms.tolist() == [0.0, 4.0, 0.0]  # its backwards' sends alone
    searched_ms, _ = _step_and_path_ms("auto", replace(params, search_seconds=0.01), costs, links)
    assert tuning._searched_device_bound_ms(costs, 4, links, True) <= searched_ms + ROUNDING_MS
