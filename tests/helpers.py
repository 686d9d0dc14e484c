"""Small builders shared by the tests."""

import pytest

from pipesim.cli import main
from pipesim.schedules import ScheduleParams, build_schedule
from pipesim.sim import Cluster, Costs, simulate
from pipesim.traces import summarize


def run(name, p, m, n=1, fwd=1.0, bwd=2.0, comm=0.0, **cost_kw):
    schedule = build_schedule(name, ScheduleParams(p, m, n))
    costs = Costs.per_stage(p, fwd_ms=fwd, bwd_ms=bwd, **cost_kw)
    trace = simulate(schedule, costs, Cluster.uniform(p, comm))
    return schedule, trace, summarize(trace)


def pipesim(capsys, *args):
    """Run the command line in-process: (exit code, stdout, stderr); arguments may be numbers or paths."""
    with pytest.raises(SystemExit) as exc:
        main([str(a) for a in args])
    out, err = capsys.readouterr()
    return exc.value.code, out, err
