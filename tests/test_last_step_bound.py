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
from pipesim.sim import Cluster, Costs, simulate
from pipesim.sim.cluster import Link
from pipesim.traces import summarize
from tests.test_searched_bound import ROUNDING_MS, chains

PAIRED = ("interleaved-1f1b", "zb-v", "dualpipev", "dualpipe")  # v = 2 model stages per device
FLUSHING = ("gpipe", "1f1b", "zb-h1", "zb-h2", "auto", *PAIRED)


def _step_and_path_ms(name: str, params: ScheduleParams, costs: Costs, links: Cluster) -> tuple[float, float]:
    """The step as tune measures a flushing order's (the makespan's growth from N - 1 = 2 mini-batches to N = 3)
    and the critical path over its last step."""
    long_order, short_order = (search_schedule(replace(params, minibatches=n), costs, links) if name == "auto" else
                               METHODS[name].build(replace(params, minibatches=n)) for n in (3, 2))
    assert flushes(long_order)
    long_run, short_run = (summarize(simulate(order, costs, links)) for order in (long_order, short_order))
    return (long_run.makespan_ms - short_run.makespan_ms,
            tuning._critical_path_ms(long_order, costs.op_ms_table(1), costs, links, 1, 1))


@settings(max_examples=150, deadline=None)
@given(chains(), st.sampled_from(FLUSHING))
def test_the_last_steps_path_stays_at_or_below_the_simulated_step(chain, name):
    """Random stage costs of a chain of p·v stages (each with its own REDUCE over two replicas, update and
    accumulation; sends and receives holding the compute or not): never above the simulated step."""
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
