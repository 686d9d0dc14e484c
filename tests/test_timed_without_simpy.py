"""Where devices share nothing but links each taken by one device's sends (a queue per link direction, as
estimates and calibrations price them), with transfers that hold the compute beside them
(`Costs.transfers_hold_products`) or not, the engine runs without SimPy (`sim.engine._Model._run_timed`): the same
timelines to the bit as SimPy's time-ordered run of the same program, which stays the run wherever devices share
more (a link two devices send on, a compute resource, a host's cores)."""

from dataclasses import fields, replace

import numpy as np
import simpy
from hypothesis import given, settings
from hypothesis import strategies as st

from pipesim.schedules import ScheduleParams, build_schedule
from pipesim.schedules.lowering import lower
from pipesim.sim import Cluster, Costs
from pipesim.sim.cluster import Link
from pipesim.sim.engine import _Model, _price, _trace
from pipesim.traces.trace import Ops

METHODS = ("gpipe", "1f1b", "interleaved-1f1b", "zb-h1", "zb-h2", "zb-v", "dualpipev", "pipedream")
ONE_CHUNK = ("gpipe", "1f1b", "zb-h1", "zb-h2", "pipedream")
# Few distinct times, so that compute, transfers and holds often end and begin at the same picosecond.
TIMES_MS = (0.25, 0.5, 1.0, 1.5, 2.0)


def _run(schedule, costs, cluster, on_simpy: bool):
    """The trace, and whether the engine chose to run without SimPy; `on_simpy` runs the program on SimPy
    whatever it chose."""
    program = _price(lower(schedule), costs, cluster, 0.0, 0)
    model = _Model(program, cluster.overlap_comm, costs.transfers_hold_products)
    without_simpy = model.env is None
    if on_simpy:
        model.env = simpy.Environment()
    model.run()
    assert model.finished == len(program.start_clock)
    return _trace(costs, cluster, program, model, 0.0, 0), without_simpy


def _differences(fast, oracle) -> list[str]:
    """The columns, counters and peak breakdowns in which two traces differ."""
    out = [f.name for f in fields(Ops) if not np.array_equal(getattr(fast.ops, f.name), getattr(oracle.ops, f.name))]
    for name, curves in oracle.counters.items():
        if any(not (np.array_equal(a.times_us, b.times_us) and np.array_equal(a.values, b.values))
               for a, b in zip(fast.counters[name], curves, strict=True)):
            out.append(name)
    if fast.meta.peak_memory_parts != oracle.meta.peak_memory_parts:
        out.append("peak_memory_parts")
    return out


@st.composite
def timed_problems(draw):
    """A small schedule of a random method, with or without data parallelism, random stage and transfer times
    (links with a queue of their own direction or none), blocking or overlapped sends, transfers holding the
    compute (mostly) or not, for their whole time or each product at most its own."""
    method = draw(st.sampled_from(METHODS))
    p = draw(st.integers(2, 4))
    if method == "interleaved-1f1b":
        m = draw(st.integers(1, 3)) * p
    else:  # enough for every method's warm-up (zb-h2's 2p - 1 forwards, dualpipev's 2p), or any for those that run any
        m = draw(st.integers(1 if method in ("gpipe", "1f1b", "zb-h1", "pipedream") else 2 * p, 3 * p))
    d = draw(st.sampled_from((1, 2)))
    schedule = build_schedule(method, ScheduleParams(p, m, minibatches=draw(st.integers(1, 2)), data_parallel=d,
                                                     chunks=1 if method in ONE_CHUNK else 2))
    stages = schedule.num_stages
    ms = st.lists(st.sampled_from(TIMES_MS), min_size=stages, max_size=stages)
    costs = Costs.per_stage(stages, fwd_ms=draw(ms), bwd_ms=draw(ms), opt_ms=draw(st.sampled_from((0.0, 0.5))),
                            output_mb=draw(st.lists(st.sampled_from((1.0, 2.0, 4.0)), min_size=stages,
                                                    max_size=stages)),
                            wgrad_fraction=draw(st.sampled_from((0.25, 0.5))))
    reduce_ms = draw(st.lists(st.sampled_from((0.0, *TIMES_MS)), min_size=stages, max_size=stages)) if d > 1 \
        else [0.0] * stages
    holding = draw(st.sampled_from((True, True, True, False)))
    product_ms = draw(st.sampled_from((0.0, 0.1, 0.25, 1.0)))  # a product held at most its own time (0: whole)
    costs = replace(costs, transfers_hold_products=holding,
                    stages=tuple(replace(c, reduce_ms=r, product_ms=product_ms)
                                 for c, r in zip(costs.stages, reduce_ms)))
    links = {}
    for src in range(p):
        for dst in range(p):
            if src != dst:
                queued = draw(st.booleans()) or not holding  # a program SimPy runs is timed: holds or queues
                links[src, dst] = Link(latency_ms=draw(st.sampled_from((0.0, *TIMES_MS))),
                                       bandwidth_bytes_per_ms=2**20 * draw(st.sampled_from((1.0, 4.0))),
                                       resource=f"link {src}->{dst}" if queued else None)
    cluster = Cluster(p, links=links, overlap_comm=draw(st.booleans()))
    return schedule, costs, cluster


@settings(max_examples=150, deadline=None)
@given(timed_problems())
def test_the_run_without_simpy_gives_simpys_timeline_to_the_bit(problem):
    schedule, costs, cluster = problem
    fast, without_simpy = _run(schedule, costs, cluster, on_simpy=False)
    oracle, _ = _run(schedule, costs, cluster, on_simpy=True)
    assert without_simpy
    assert _differences(fast, oracle) == []


def test_devices_sharing_more_than_their_own_links_run_on_simpy():
    """A link two devices send on (a NIC), or two devices on one GPU: the order in which they take it is simulated
    time's, so SimPy runs them; links of their own, with holds or not, do not need it."""
    schedule = build_schedule("1f1b", ScheduleParams(4, 8))
    costs = replace(Costs.per_stage(4, fwd_ms=1, bwd_ms=2, output_mb=1), transfers_hold_products=True)
    own = {(s, s + 1): Link(latency_ms=0.5, resource=f"link {s}->{s + 1}") for s in range(3)}
    nic = {(s, s + 1): Link(latency_ms=0.5, resource="nic") for s in range(3)}
    assert _run(schedule, costs, Cluster(4, links=own), on_simpy=False)[1]
    assert not _run(schedule, costs, Cluster(4, links=nic), on_simpy=False)[1]
    assert not _run(schedule, costs, Cluster(4, default_link=Link(0.5), compute=("gpu", "gpu", None, None)),
                    on_simpy=False)[1]
    assert _run(schedule, replace(costs, transfers_hold_products=False), Cluster(4, links=own), on_simpy=False)[1]
