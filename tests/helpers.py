"""Small builders shared by the tests."""

from pipesim.schedules import ScheduleParams, build_schedule
from pipesim.sim import Cluster, Costs, simulate
from pipesim.traces import summarize


def run(name, p, m, n=1, fwd=1.0, bwd=2.0, comm=0.0, **cost_kw):
    schedule = build_schedule(name, ScheduleParams(p, m, n))
    costs = Costs.per_stage(p, fwd_ms=fwd, bwd_ms=bwd, **cost_kw)
    trace = simulate(schedule, costs, Cluster.uniform(p, comm))
    return schedule, trace, summarize(trace)
