"""A collective whose members are rows of several simulated devices (a stage's REDUCE where two model copies hold
it, as DualPipe's devices i and p-1-i do) begins once the last member has issued it, on every runtime path of the
engine; one whose other members are not simulated (d replicas) begins at its own issue."""

from dataclasses import replace

import numpy as np
import pytest

from pipesim.sim import Cluster, Costs, simulate
from tests.conftest import build

REDUCE_MS = 3.0


def slow_first_device(schedule) -> Costs:
    """Each stage's REDUCE takes REDUCE_MS; device 0's stages compute twice as long as device 1's, so that device 0
    issues each of its REDUCEs later than device 1 issues the same model stage's."""
    costs = Costs.per_stage(schedule.num_stages, fwd_ms=1.0, bwd_ms=2.0)
    on_first = set(schedule.stages_on(0))
    return replace(costs, stages=tuple(
        replace(c, reduce_ms=REDUCE_MS, fwd_ms=c.fwd_ms * (2 if s in on_first else 1),
                bwd_ms=c.bwd_ms * (2 if s in on_first else 1)) for s, c in enumerate(costs.stages)))


RUNTIMES = {  # the engine's paths: plain coroutines, SimPy (ranks on one GPU), timed coroutines (kernels hold)
    "coroutines": (Cluster.uniform(2, 0.1), False),
    "simpy": (replace(Cluster.uniform(2, 0.1), compute=("gpu", "gpu")), False),
    "timed": (Cluster.uniform(2, 0.1), True),
}


@pytest.mark.parametrize("runtime", list(RUNTIMES))
def test_a_collective_of_two_devices_ends_its_time_after_the_later_member_issues_it(runtime):
    """DualPipe, p = 2: devices 0 and 1 each hold both model stages and all-reduce each one's gradients with the
    other's copy. Each member is issued when its device's last backward of that stage ends; device 0 computes
    slower, so the members' issues differ, and both members begin at the later and end REDUCE_MS after."""
    cluster, hold = RUNTIMES[runtime]
    schedule = build("dualpipe", 2, 4, 1)
    costs = replace(slow_first_device(schedule), transfers_hold_products=hold)
    trace = simulate(schedule, costs, cluster)
    ops, kinds = trace.ops, np.asarray(trace.kinds)[trace.ops.kind]
    n = schedule.graph.stages_per_copy
    reduces = np.flatnonzero(kinds == "REDUCE")
    assert len(reduces) == 2 * n
    backward = np.isin(kinds, ("B", "I", "W"))
    for model_stage in range(n):
        members = reduces[ops.stage[reduces] % n == model_stage]
        assert sorted(ops.device[members].tolist()) == [0, 1]
        issued = [ops.end_us[backward & (ops.device == ops.device[row]) & (ops.stage == ops.stage[row])].max()
                  for row in members]
        assert max(issued) > min(issued) + 500  # the members' issues differ by more than half a millisecond
        assert ops.start_us[members] == pytest.approx([max(issued)] * 2)
        assert ops.end_us[members] == pytest.approx([max(issued) + REDUCE_MS * 1e3] * 2)


def test_a_collective_among_replicas_not_simulated_begins_at_its_own_issue():
    """1F1B with d = 2 replicas: each device's REDUCE stands for its replicas', which issue it as it does; it
    begins at its own issue, whatever the other devices' REDUCEs do."""
    schedule = build("1f1b", 2, 4, 1, data_parallel=2)
    trace = simulate(schedule, slow_first_device(schedule), Cluster.uniform(2, 0.1))
    ops, kinds = trace.ops, np.asarray(trace.kinds)[trace.ops.kind]
    reduces = np.flatnonzero(kinds == "REDUCE")
    backward = np.isin(kinds, ("B", "W"))
    issued = [ops.end_us[backward & (ops.stage == ops.stage[row])].max() for row in reduces]
    assert ops.start_us[reduces] == pytest.approx(issued)
    assert issued[0] != pytest.approx(issued[1])
