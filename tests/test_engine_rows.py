"""`simulate(..., memory=False)`, the rows alone (tune's longer runs for a steady step read only when rows end):
the same rows to the bit as the full trace's, without its counters or its memory at the peak."""

from dataclasses import fields, replace

import numpy as np
import pytest

from pipesim.schedules import ScheduleParams, build_schedule
from pipesim.sim import Cluster, Costs, simulate
from pipesim.sim.cluster import Link
from pipesim.traces.trace import Ops


@pytest.mark.parametrize("method,data_parallel,holds,queued", [
    ("1f1b", 1, False, False),  # coroutines, no clock of their own
    ("pipedream", 2, True, True),  # timed, transfers holding the compute, each link its sender's queue
    ("zb-h2", 2, True, False),
    ("interleaved-1f1b", 1, False, True),
])
def test_rows_alone_are_the_full_traces_rows(method, data_parallel, holds, queued):
    p = 4
    schedule = build_schedule(method, ScheduleParams(p, 8, minibatches=3, data_parallel=data_parallel,
                                                     chunks=2 if method == "interleaved-1f1b" else 1))
    stages = schedule.num_stages
    costs = Costs.per_stage(stages, fwd_ms=[1.0 + 0.25 * (k % 3) for k in range(stages)], bwd_ms=2.0, opt_ms=0.5,
                            output_mb=2.0, wgrad_fraction=0.5)
    costs = replace(costs, transfers_hold_products=holds,
                    stages=tuple(replace(c, reduce_ms=1.5 * (data_parallel > 1), product_ms=0.25)
                                 for c in costs.stages))
    links = {(src, dst): Link(latency_ms=0.5, bandwidth_bytes_per_ms=2**20,
                              resource=f"link {src}->{dst}" if queued else None)
             for src in range(p) for dst in range(p) if src != dst}
    cluster = Cluster(p, links=links)
    full, rows = simulate(schedule, costs, cluster), simulate(schedule, costs, cluster, memory=False)
    assert [f.name for f in fields(Ops) if not np.array_equal(getattr(full.ops, f.name), getattr(rows.ops, f.name))
            ] == []
    assert full.counters["memory_bytes"] and rows.counters == {}
    assert full.meta.peak_memory_parts is not None and rows.meta.peak_memory_parts is None
