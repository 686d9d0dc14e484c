"""The simulator against closed forms and against an independent longest-path evaluation."""

import dataclasses
import json
import math

import numpy as np
import pytest

from pipesim.schedules import Kind, ScheduleParams, build_schedule
from pipesim.sim import Cluster, ClusterError, Costs, Link, load_cluster, simulate
from pipesim.traces import read_trace, summarize, write_trace
from pipesim.units import MIB
from tests.conftest import build, run

GRID = [(1, 1), (2, 2), (4, 4), (4, 8), (3, 10), (8, 8), (8, 32)]


@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
@pytest.mark.parametrize("p,m", GRID)
def test_synchronous_makespan_and_bubble_closed_forms(name, p, m):
    fwd, bwd = 1.5, 2.5
    summary = run(name, p, m, fwd=fwd, bwd=bwd).summary
    assert summary.makespan_ms == pytest.approx((m + p - 1) * (fwd + bwd))
    assert summary.bubble_fraction == pytest.approx((p - 1) / (m + p - 1))
    assert summary.max_staleness == 0


def test_issue_example_gpipe_33_ms():
    summary = run("gpipe", 4, 8, fwd=1, bwd=2).summary
    assert summary.makespan_ms == 33
    assert summary.bubble_fraction == pytest.approx(3 / 11)


@pytest.mark.parametrize("p,m", [(4, 4), (4, 8), (6, 12), (8, 8)])
def test_peak_activations(p, m):
    gpipe = run("gpipe", p, m).summary
    one_f_one_b = run("1f1b", p, m).summary
    assert [d.peak_activations for d in gpipe.devices] == [m] * p
    assert [d.peak_activations for d in one_f_one_b.devices] == [p - k for k in range(p)]


@pytest.mark.parametrize("p", [2, 4, 7])
def test_pipedream_staleness_and_stashed_versions(p):
    summary = run("pipedream", p, 1, n=3 * p).summary
    assert [s.forward_staleness for s in summary.stages] == [p - 1 - k for k in range(p)]
    assert [s.backward_staleness for s in summary.stages] == [p - 1 - k for k in range(p)]
    assert [d.peak_weight_versions for d in summary.devices] == [p - k for k in range(p)]
    assert all(s.prediction_distance is None for s in summary.stages)


def test_pipedream_steady_state_has_no_flush():
    p = 4
    pipedream = run("pipedream", p, 1, n=40).summary
    flushed = run("1f1b", p, 1, n=40).summary
    assert pipedream.time_per_minibatch_ms == pytest.approx(3.0)  # F + B: every device busy
    assert flushed.time_per_minibatch_ms == pytest.approx(p * 3.0)  # one micro-batch crosses the pipe


def test_stashed_weight_memory_is_counted():
    p = 4
    pipedream = run("pipedream", p, 1, n=12, param_mb=100, activation_mb=0, output_mb=0, optimizer="sgd").summary
    # weights + gradients, plus one extra copy of the weights per stashed version
    assert [d.peak_memory_mb for d in pipedream.devices] == pytest.approx([200 + 100 * (p - k - 1) for k in range(p)])


def test_activation_memory_curve():
    p, m = 4, 8
    _, trace, summary = run("gpipe", p, m, param_mb=0, activation_mb=10, output_mb=0)
    assert [d.peak_memory_mb for d in summary.devices] == pytest.approx([10 * m] * p)
    memory = trace.counters["memory_bytes"][0]
    assert memory.values[0] == 0 and memory.values[-1] == 0 and (memory.values >= 0).all()
    assert np.all(np.diff(memory.times_us) >= 0)


@pytest.mark.parametrize("held_mb,peaks", [
    (None, [42, 42]),  # buffers of their own: a message on top of 4 F's activations, sent (0) or received (1)
    (0, [42, 40]),  # saved by the stages: a boundary activation is counted once, only 0's received gradient adds
    (2, [50, 48]),  # saved by neither: each F holds its output (stage 0) or input (stage 1) until its B
])
def test_boundary_tensors_are_counted_once_where_the_stage_holds_them(held_mb, peaks):
    """GPipe on 2 devices, 4 micro-batches of 10 MiB activations and 2 MiB messages that take 0.5 ms."""
    schedule = build_schedule("gpipe", ScheduleParams(stages=2, microbatches=4))
    costs = Costs.per_stage(2, fwd_ms=1.0, bwd_ms=2.0, param_mb=0, activation_mb=10, output_mb=2)
    held = None if held_mb is None else held_mb << 20
    costs = dataclasses.replace(costs, stages=tuple(dataclasses.replace(c, held_bytes=held) for c in costs.stages))
    summary = summarize(simulate(schedule, costs, Cluster.uniform(2, 0.5)))
    assert [d.peak_memory_mb for d in summary.devices] == pytest.approx(peaks)
    assert summary.makespan_ms == pytest.approx(5 * 3.0 + 2 * 0.5)  # how a tensor is counted costs no time


def test_a_tensor_handed_over_on_one_device_is_counted_once():
    """ZB-V puts stages 1 and 2 on device 1: stage 1's output is stage 2's input, one tensor with no transfer,
    which stage 1 holds until its own backward. With every boundary tensor unsaved (held by the stages), device
    1 peaks as stage 2's input-gradient half starts: both stages' 10 MiB activations, stage 1's received input
    and its output (2 MiB each, the output also stage 2's input), stage 2's output and the gradient it received
    (2 MiB each): 28 MiB, not 30."""
    schedule = build_schedule("zb-v", ScheduleParams(stages=2, microbatches=1, chunks=2))
    assert schedule.placement == (0, 1, 1, 0)
    costs = Costs.per_stage(4, fwd_ms=1.0, bwd_ms=2.0, param_mb=0, activation_mb=10, output_mb=2)
    held = [2 << 20, 4 << 20, 4 << 20, 2 << 20]  # the boundary tensors each stage sends or receives
    costs = dataclasses.replace(costs, stages=tuple(dataclasses.replace(c, held_bytes=h)
                                                    for c, h in zip(costs.stages, held)))
    assert summarize(simulate(schedule, costs, Cluster.uniform(2, 0.5))).devices[1].peak_memory_mb == 28


def longest_path(schedule, fwd, bwd, comm):
    """Independent timing of a chain schedule: each op starts when the previous op on its device and
    every input (plus `comm` if it crosses devices) are done; sends never block."""
    end = {}
    pointer = [0] * schedule.num_devices
    p = schedule.num_stages
    remaining = len(schedule.table.kind)
    while remaining:
        progressed = False
        for d, order in enumerate(schedule.orders):
            while pointer[d] < len(order):
                a = order[pointer[d]]
                j, b = a.microbatch, a.minibatch
                if a.kind is Kind.F:
                    inputs = [(("F", a.stage - 1, j, b), comm)] if a.stage > 0 else []
                    cost = fwd[a.stage]
                elif a.kind is Kind.B:
                    inputs = [(("F", a.stage, j, b), 0.0)]
                    if a.stage < p - 1:
                        inputs.append((("B", a.stage + 1, j, b), comm))
                    cost = bwd[a.stage]
                else:  # OPT: costs nothing here, ordered after its stage's backwards
                    inputs, cost = [], 0.0
                if any(key not in end for key, _ in inputs):
                    break
                previous = end.get(("dev", d), 0.0)
                start = max([previous] + [end[key] + delay for key, delay in inputs])
                end[(a.kind.value, a.stage, j, b)] = end[("dev", d)] = start + cost
                pointer[d] += 1
                remaining -= 1
                progressed = True
        assert progressed, "reference evaluator stuck"
    return max(v for k, v in end.items() if k[0] == "dev"), end


@pytest.mark.parametrize("name", ["gpipe", "1f1b", "pipedream"])
@pytest.mark.parametrize("p,m,n,comm", [(4, 8, 1, 0.3), (3, 5, 3, 0.7), (5, 2, 4, 1.3), (6, 12, 2, 0.05)])
def test_non_uniform_costs_and_comm_match_longest_path(name, p, m, n, comm):
    rng = np.random.default_rng(p * 100 + m)
    fwd = rng.uniform(0.5, 2.0, p).round(3).tolist()
    bwd = rng.uniform(1.0, 4.0, p).round(3).tolist()
    schedule = build_schedule(name, ScheduleParams(p, m, n))
    trace = simulate(schedule, Costs.per_stage(p, fwd_ms=fwd, bwd_ms=bwd), Cluster.uniform(p, comm))
    expected_makespan, expected_end = longest_path(schedule, fwd, bwd, comm)
    assert summarize(trace).makespan_ms == pytest.approx(expected_makespan)
    ops = trace.ops
    compute = (ops.stream == 0) & (ops.kind != trace.kind_code("OPT"))
    for i in np.flatnonzero(compute)[:: max(1, compute.sum() // 200)]:
        key = (trace.kinds[ops.kind[i]], int(ops.stage[i]), int(ops.microbatch[i]), int(ops.minibatch[i]))
        assert ops.end_us[i] / 1e3 == pytest.approx(expected_end[key])


def test_same_inputs_same_trace_and_seeded_jitter():
    schedule = build_schedule("1f1b", ScheduleParams(4, 8, 2))
    costs = Costs.per_stage(4, fwd_ms=[1, 1.2, 0.9, 1.1], bwd_ms=2, param_mb=10, activation_mb=5, output_mb=1)
    cluster = Cluster.uniform(4, 0.2)
    assert simulate(schedule, costs, cluster) == simulate(schedule, costs, cluster)
    a = simulate(schedule, costs, cluster, jitter=0.1, seed=1)
    assert a == simulate(schedule, costs, cluster, jitter=0.1, seed=1)
    b = simulate(schedule, costs, cluster, jitter=0.1, seed=2)
    assert a != b and summarize(a).makespan_ms != summarize(b).makespan_ms


def test_alpha_beta_link_time():
    latency_ms, gb_per_s = 0.01, 10.0
    link = Link(latency_ms=latency_ms, bandwidth_bytes_per_ms=gb_per_s * 1e9 / 1e3, resource="l")
    schedule = build_schedule("gpipe", ScheduleParams(2, 1))
    costs = Costs.per_stage(2, fwd_ms=1, bwd_ms=2, output_mb=64)
    cluster = Cluster(2, link, {(0, 1): link, (1, 0): link})
    transfer_ms = latency_ms + 64 * MIB / (gb_per_s * 1e6)
    assert summarize(simulate(schedule, costs, cluster)).makespan_ms == pytest.approx(6 + 2 * transfer_ms)


def test_shared_link_serialises_transfers():
    """Stage 0 feeds two branches on devices 1 and 2; through one shared NIC the sends queue."""
    from pipesim.schedules import SYNCHRONOUS, Action, Schedule, StageGraph

    graph = StageGraph(4, ((0, 1), (0, 2), (1, 3), (2, 3)))
    orders = (
        (Action(Kind.F, 0, 0), Action(Kind.B, 0, 0), Action(Kind.OPT, 0)),
        (Action(Kind.F, 1, 0), Action(Kind.B, 1, 0), Action(Kind.OPT, 1)),
        (Action(Kind.F, 2, 0), Action(Kind.B, 2, 0), Action(Kind.OPT, 2)),
        (Action(Kind.F, 3, 0), Action(Kind.B, 3, 0), Action(Kind.OPT, 3)),
    )
    schedule = Schedule("branches", graph, (0, 1, 2, 3), orders, SYNCHRONOUS, microbatches=1)
    costs = Costs.per_stage(4, fwd_ms=1, bwd_ms=1, output_mb=0)

    def makespan(shared):
        links = {(s, d): Link(latency_ms=2.0, resource="nic0" if shared and s == 0 else f"{s}->{d}")
                 for s in range(4) for d in range(4) if s != d}
        return summarize(simulate(schedule, costs, Cluster(4, Link(), links))).makespan_ms

    # private links: F0 | 2 | F1,F2 | 2 | F3 B3 | 2 | B1,B2 | 2 | B0 = 1+2+1+2+2+2+1+2+1
    assert makespan(shared=False) == pytest.approx(14)
    assert makespan(shared=True) == pytest.approx(16)  # the second send from device 0 waits 2 ms


def test_blocking_sends_hold_the_compute_stream():
    schedule = build_schedule("gpipe", ScheduleParams(2, 4))
    costs = Costs.per_stage(2, fwd_ms=1, bwd_ms=1)
    overlapped = summarize(simulate(schedule, costs, Cluster.uniform(2, 0.5))).makespan_ms
    blocking = summarize(simulate(schedule, costs, Cluster.uniform(2, 0.5, overlap_comm=False))).makespan_ms
    assert blocking > overlapped


def test_size_table_interpolates_and_extrapolates():
    link = Link(table_bytes=(1000.0, 2000.0, 4000.0), table_ms=(1.0, 1.5, 2.0))
    assert link.transfer_ms(1500) == pytest.approx(1.25)
    assert link.transfer_ms(8000) == pytest.approx(3.0)
    assert link.transfer_ms(10) == pytest.approx(1.0)


def test_trace_round_trips_through_chrome_json(tmp_path):
    trace = run("pipedream", 3, 2, n=3, comm=0.1, param_mb=1, activation_mb=1, output_mb=1).trace
    path = tmp_path / "t.json"
    write_trace(trace, path)
    doc = json.loads(path.read_text())
    assert {e["ph"] for e in doc["traceEvents"]} == {"M", "X", "C"}
    assert read_trace(path) == trace


def test_cluster_file(tmp_path):
    path = tmp_path / "c.json"
    path.write_text(json.dumps({
        "devices": [{"name": "gpu0", "memory_gib": 80}, {"name": "gpu1", "memory_gib": 80}],
        "link": {"latency_us": 5, "bandwidth_gb_per_s": 25},
        "links": [{"src": 0, "dst": 1, "latency_us": 2, "bandwidth_gb_per_s": 100, "shared": "nvlink"}],
    }))
    cluster = load_cluster(path)
    assert cluster.device_names == ("gpu0", "gpu1")
    assert cluster.link(0, 1).resource == "nvlink"
    assert cluster.link(0, 1).transfer_ms(10**8) == pytest.approx(0.002 + 1.0)
    assert cluster.link(1, 0).transfer_ms(0) == pytest.approx(0.005)
    assert math.isinf(Cluster.uniform(3, 1.0).link(0, 1).bandwidth_bytes_per_ms)


@pytest.mark.parametrize("content,fragment", [
    ("{", "not valid JSON"),
    ("{}", "devices"),
    ('{"devices": 2, "links": [{"src": 0, "dst": 5}]}', "links: give src and dst two distinct devices 0..1"),
    ('{"devices": 2, "link": {"latency_us": -1}}', "link.latency_us"),
    ('{"devices": 2, "link": {"table": [[10, 1], [5, 2]]}}', "their bytes increasing"),
    ('{"devices": 2, "colour": "red"}', "colour"),
])
def test_bad_cluster_files(tmp_path, content, fragment):
    path = tmp_path / "c.json"
    path.write_text(content)
    with pytest.raises(ClusterError, match=fragment):
        load_cluster(path)


def test_too_few_devices_in_cluster():
    from pipesim.schedules import ScheduleError

    schedule = build_schedule("1f1b", ScheduleParams(4, 4))
    with pytest.raises(ScheduleError, match="needs 4 devices, the cluster has 2"):
        simulate(schedule, Costs.per_stage(4, fwd_ms=1, bwd_ms=1), Cluster.uniform(2, 0))


@pytest.mark.parametrize("name", ["1f1b", "zb-v", "interleaved-1f1b", "xpipe", "avgpipe", "graphpipe"])
@pytest.mark.parametrize("overlap", [True, False])
def test_sweeping_every_device_at_once_gives_the_coroutines_trace(name, overlap, monkeypatch):
    """Wide pipelines run their steps in sweeps (`_Model._lockstep`: every device one step per sweep) and hand
    over to the coroutines once sweeping stops paying. Made to sweep here on 4 devices, and to hand over after
    every window of 1 or 3 sweeps, or never, it must give the coroutines' trace bit for bit: blocking sends, the
    data-parallel collectives' lanes and jittered times included."""
    from pipesim.schedules.lowering import lower
    from pipesim.sim import engine

    schedule = build(name, 4, 8, 2, data_parallel=2)
    costs = Costs.per_stage(schedule.num_stages, fwd_ms=[1.0 + 0.1 * (s % 3) for s in range(schedule.num_stages)],
                            bwd_ms=2, opt_ms=0.3, param_mb=10, activation_mb=5, output_mb=1)
    costs = dataclasses.replace(costs, stages=tuple(dataclasses.replace(c, reduce_ms=0.7 + 0.1 * s, gather_ms=0.2)
                                                    for s, c in enumerate(costs.stages)))
    cluster = Cluster.uniform(schedule.num_devices, 0.05, overlap_comm=overlap)
    monkeypatch.setattr(engine, "_SWEEP_PAYS", 10**9)  # never: the coroutines alone
    alone = simulate(schedule, costs, cluster, jitter=0.1, seed=3)
    monkeypatch.setattr(engine, "_SWEEP_PAYS", 1)
    for window in (1, 3, 10**9):
        monkeypatch.setattr(engine, "_SWEEP_WINDOW", window)
        swept = simulate(schedule, costs, cluster, jitter=0.1, seed=3)
        assert swept.ops == alone.ops and swept.counters == alone.counters
    program = engine._price(lower(schedule), costs, cluster, 0.0, 0)
    reached = engine._Model(program, overlap)._lockstep()  # never handing over, the sweeps run every step
    assert [first for first, _ in reached] == np.diff(program.step_offsets).tolist()


@pytest.mark.parametrize("name", ["1f1b", "zb-v", "interleaved-1f1b", "xpipe", "avgpipe", "graphpipe"])
@pytest.mark.parametrize("overlap", [True, False])
def test_devices_run_without_simpy_where_nothing_is_shared_and_give_simpys_trace(name, overlap):
    """Where no resource is shared the device processes run as plain coroutines, sends on private links as no
    steps; with every link a resource of its own that no transfer ever queues on (they are sent farther apart than
    they take), each send is a step of the timed coroutines (`_Model._run_timed`), and SimPy's time-ordered run of
    that program must give the same trace too, bit for bit."""
    import simpy

    from pipesim.schedules.lowering import lower
    from pipesim.sim import engine

    schedule = build(name, 4, 8, 2)
    costs = Costs.per_stage(schedule.num_stages, fwd_ms=[1.0 + 0.1 * (s % 3) for s in range(schedule.num_stages)],
                            bwd_ms=2, opt_ms=0.3, param_mb=10, activation_mb=5, output_mb=1)
    plain = Cluster.uniform(schedule.num_devices, 0.05, overlap_comm=overlap)
    own_links = dataclasses.replace(plain, links={(s, d): Link(latency_ms=0.05, resource=f"{s}->{d}")
                                                  for s in range(plain.num_devices)
                                                  for d in range(plain.num_devices) if s != d})
    assert [engine._price(lower(schedule), costs, cluster, 0.0, 0).timed for cluster in (plain, own_links)] == \
        [False, True]
    for jitter in (0.0, 0.2):
        coroutines = simulate(schedule, costs, plain, jitter=jitter, seed=3)
        timed = simulate(schedule, costs, own_links, jitter=jitter, seed=3)
        program = engine._price(lower(schedule), costs, own_links, jitter, 3)
        model = engine._Model(program, overlap)
        model.env = simpy.Environment()
        model.run()
        on_simpy = engine._trace(costs, own_links, program, model, jitter, 3)
        assert coroutines.ops == timed.ops == on_simpy.ops
        assert coroutines.counters == timed.counters == on_simpy.counters
