"""CPU ranks on one host's cores: while k of them compute at once, each runs `contention[k - 1]` times slower
than alone (processor sharing), so a row stretches while others compute and speeds up when they stop."""

import json
from dataclasses import replace

import numpy as np
import pytest

from pipesim.schedules import KINDS, Kind
from pipesim.sim import Cluster, ClusterError, Costs, load_cluster, simulate
from pipesim.sim.costs import RowOverhead
from pipesim.traces import Stream
from tests.conftest import build, pipesim


def on_one_host(cluster: Cluster, *contention: float) -> Cluster:
    return replace(cluster, hosts=("h",) * cluster.num_devices, contention=contention)


def makespan_us(trace) -> float:
    return float(trace.ops.end_us.max())


@pytest.mark.parametrize("slowdown", [1.0, 1.5, 2.0])
def test_gpipe_two_ranks_stretch_exactly_where_they_compute_together(slowdown):
    """GPipe, p = 2, m = 2, free transfers, every row f or b. Rank 0's F1 and rank 1's F0 run together, then
    rank 0's B0 and rank 1's B1: each pair takes s times a row; the rest runs alone. Makespan (2 + s)(f + b)."""
    f, b = 1.0, 2.0
    schedule = build("gpipe", 2, 2, 1)
    costs = Costs.per_stage(2, fwd_ms=f, bwd_ms=b)
    trace = simulate(schedule, costs, on_one_host(Cluster.uniform(2, 0.0), 1.0, slowdown))
    assert makespan_us(trace) == pytest.approx((2 + slowdown) * (f + b) * 1e3)
    ops, kinds = trace.ops, np.asarray(trace.kinds)[trace.ops.kind]
    together = (ops.device == 0) & (kinds == "F") & (ops.microbatch == 1)
    assert ops.start_us[together] == pytest.approx([f * 1e3])
    assert ops.dur_us[together] == pytest.approx([slowdown * f * 1e3])


def test_a_row_speeds_up_when_its_peer_stops():
    """Unequal rows: rank 1's F0 (3 ms) starts with rank 0's F1 (1 ms) at 1 ms on a host twice as slow with two
    computing: by 3 ms rank 0 is done and rank 1 has 2 ms of work left, alone at full speed until 5 ms."""
    schedule = build("gpipe", 2, 2, 1)
    costs = Costs.per_stage(2, fwd_ms=[1.0, 3.0], bwd_ms=2.0)
    trace = simulate(schedule, costs, on_one_host(Cluster.uniform(2, 0.0), 1.0, 2.0))
    ops, kinds = trace.ops, np.asarray(trace.kinds)[trace.ops.kind]
    first = (ops.device == 1) & (kinds == "F") & (ops.microbatch == 0)
    assert (ops.start_us[first][0], ops.end_us[first][0]) == pytest.approx((1e3, 5e3))
    # Slowdown 2 with two computing is one core's worth: the host never idles with work waiting, so the
    # makespan is all the compute (1 + 1 + 2 + 2 on rank 0, 3 + 3 + 2 + 2 on rank 1).
    assert makespan_us(trace) == pytest.approx(16e3)


@pytest.mark.parametrize("name,p,m,chunks", [
    ("1f1b", 4, 8, None), ("zb-h1", 4, 8, None), ("interleaved-1f1b", 2, 4, 2), ("pipedream", 4, 2, None),
    ("avgpipe", 2, 4, None), ("xpipe", 3, 4, None),
])
def test_every_row_gets_its_own_work_done_at_the_speed_the_host_allows(name, p, m, chunks):
    """Processor sharing, checked from the trace alone: over each compute row, the integral of its speed
    (1 / slowdown of the number of the host's rows computing at that moment) is its duration alone."""
    schedule = build(name, p, m, 3, **({"chunks": chunks} if chunks else {}))
    rng = np.random.default_rng(3)
    costs = Costs.per_stage(schedule.num_stages, fwd_ms=rng.uniform(0.5, 2, schedule.num_stages).round(2).tolist(),
                            bwd_ms=rng.uniform(1, 3, schedule.num_stages).round(2).tolist(), opt_ms=0.3)
    slowdown = (1.0, 1.6, 2.3, 3.1)
    contended = simulate(schedule, costs, on_one_host(Cluster.uniform(p, 0.2), *slowdown))
    alone = simulate(schedule, costs, Cluster.uniform(p, 0.2))
    compute = contended.ops.stream == Stream.COMPUTE
    start, end = contended.ops.start_us[compute], contended.ops.end_us[compute]
    edges = np.unique(np.concatenate([start, end]))
    mid = (edges[:-1] + edges[1:]) / 2
    running = ((start[None, :] < mid[:, None]) & (mid[:, None] < end[None, :])).sum(axis=1)
    speed = 1.0 / np.asarray(slowdown)[np.minimum(np.maximum(running, 1), len(slowdown)) - 1]
    inside = (start[None, :] <= edges[:-1, None]) & (edges[1:, None] <= end[None, :])  # [interval, row]
    work_us = (inside * (np.diff(edges) * speed)[:, None]).sum(axis=0)
    assert work_us == pytest.approx(alone.ops.dur_us[compute], abs=1e-3)  # same rows, same program order
    assert makespan_us(contended) > makespan_us(alone)


@pytest.mark.parametrize("cluster", [
    lambda c: on_one_host(c, 1.0, 1.0, 1.0),  # measured, but no slowdown
    lambda c: replace(c, hosts=("a", "b", "c", "d"), contention=(1.0, 2.0)),  # every rank on a host of its own
    lambda c: replace(c, contention=(1.0, 2.0)),  # no hosts named
])
def test_no_contention_gives_the_trace_without_it(cluster):
    schedule = build("1f1b", 4, 8, 2)
    costs = Costs.per_stage(4, fwd_ms=[1.0, 1.5, 1.2, 0.8], bwd_ms=2.0, opt_ms=0.5)
    plain = simulate(schedule, costs, Cluster.uniform(4, 0.3))
    trace = simulate(schedule, costs, cluster(Cluster.uniform(4, 0.3)))
    assert np.array_equal(trace.ops.start_us, plain.ops.start_us)
    assert np.array_equal(trace.ops.dur_us, plain.ops.dur_us)


def test_the_cluster_file_names_hosts_and_their_contention(tmp_path):
    path = tmp_path / "c.json"
    path.write_text(json.dumps({"devices": [{"name": f"rank {d}", "host": "box"} for d in range(2)],
                                "contention": [1.0, 1.7]}))
    cluster = load_cluster(path)
    assert cluster.hosts == ("box", "box") and cluster.contention == (1.0, 1.7)
    assert cluster.describe()["contention"] == [1.0, 1.7]
    assert [d["host"] for d in cluster.describe()["devices"]] == ["box", "box"]
    for bad in ([1.5, 2.0], [1.0, -1.0], [1.0, float("inf")]):
        path.write_text(json.dumps({"devices": 2, "contention": bad}).replace("Infinity", "1e999"))
        with pytest.raises(ClusterError, match="contention"):
            load_cluster(path)
    with pytest.raises(ClusterError, match="contention"):
        Cluster(2, contention=(2.0,))


def test_the_cluster_file_sets_how_much_the_hosts_compute_slows_its_collectives(tmp_path):
    """A cluster file gives `collective_contention` as a calibration's all-reduce beside computing ranks gives it
    (it could not: a field it did not know): read, described, priced, and a bad one refused naming the field."""
    path = tmp_path / "c.json"
    on_box = {"devices": [{"name": f"rank {d}", "host": "box"} for d in range(2)], "contention": [1.0, 1.2]}
    run = ("simulate", "-s", "dualpipe", "-p", 2, "-m", 4, "--fwd", 1, "--bwd", 2, "--param-mb", 100,
           "--data-parallel", 2, "--network-gb-s", 10, "--cluster", path, "--json")
    step_ms = []
    for beside in ([], [1.0, 2.0, 3.0]):
        path.write_text(json.dumps({**on_box, "collective_contention": beside}))
        assert load_cluster(path).collective_contention == tuple(beside)
        assert load_cluster(path).describe().get("collective_contention", []) == beside
        code, out, err = pipesim(*run)
        assert code == 0, err
        step_ms.append(json.loads(out)["results"][0]["time_per_minibatch_ms"])
    assert step_ms[1] > step_ms[0]  # the all-reduce beside the other rank's compute takes longer
    for bad in ([2.0, 3.0], [1.0, 0.0], [1.0, "fast"]):
        path.write_text(json.dumps({**on_box, "collective_contention": bad}))
        code, out, err = pipesim(*run)
        assert code == 2 and out == "" and len(err.strip().splitlines()) == 1, err
        assert err.startswith(f"error: --cluster: cluster file {path}: collective_contention"), err


def test_the_runtime_host_time_between_rows_shares_the_cores_as_compute_does():
    """The gaps after rows and a transfer's host time need a core as a compute row does. 1F1B on two ranks of a
    host with one core's throughput (two at once each run at half speed), free transfers: one of the two is
    always working, so the makespan is all the work, compute alone plus host time, but the gap after each
    rank's last row (which ends nothing). Host time running beside compute for free gave 62.5 of 85.8 ms."""
    overhead = RowOverhead(gap_ms=(0.5,) * len(KINDS), send_ms=0.2, recv_ms=0.1)
    costs = replace(Costs.per_stage(2, fwd_ms=1.0, bwd_ms=2.0), overhead=overhead)
    schedule = build("1f1b", 2, 4, 2)
    trace = simulate(schedule, costs, on_one_host(Cluster.uniform(2, 0.0), 1.0, 2.0))
    compute = trace.ops.stream == Stream.COMPUTE
    host_ms = overhead.host_ms[[KINDS.index(Kind(trace.kinds[k])) for k in trace.ops.kind]].sum()
    alone_ms = simulate(schedule, costs, Cluster.uniform(2, 0.0)).ops.dur_us[compute].sum() / 1e3
    assert makespan_us(trace) / 1e3 == pytest.approx(alone_ms + host_ms - 2 * 0.5)


def dualpipe_reducing(reduce_ms: float) -> tuple:
    """DualPipe on two ranks, each device all-reducing its two stages' gradients with the other's copies."""
    schedule = build("dualpipe", 2, 4, 2)
    costs = Costs.per_stage(schedule.num_stages, fwd_ms=1.0, bwd_ms=2.0)
    return schedule, replace(costs, stages=tuple(replace(stage, reduce_ms=reduce_ms) for stage in costs.stages))


def test_a_collective_beside_compute_on_shared_cores_takes_as_long_as_they_let_it():
    """A collective on a host's shared cores (gloo's threads) advances at 1 / beside[k] of its speed alone while
    k of the host's ranks compute: checked from the trace, over each REDUCE the integral of that speed is its
    time alone; one running beside compute takes longer than alone, and the rows that wait for it start later."""
    schedule, costs = dualpipe_reducing(3.0)
    beside = (1.0, 2.0, 3.0)
    host = on_one_host(Cluster.uniform(2, 0.1), 1.0, 1.2)
    trace = simulate(schedule, costs, replace(host, collective_contention=beside))
    ops, kinds = trace.ops, np.asarray(trace.kinds)[trace.ops.kind]
    compute, reduces = ops.stream == Stream.COMPUTE, np.flatnonzero(kinds == "REDUCE")
    for row in reduces:
        edges = np.unique(np.clip(np.r_[ops.start_us[compute], ops.end_us[compute]], ops.start_us[row],
                                  ops.end_us[row]))
        mid = (edges[:-1] + edges[1:]) / 2
        running = ((ops.start_us[compute][None, :] < mid[:, None]) & (mid[:, None] < ops.end_us[compute][None, :]))
        speed = 1.0 / np.asarray(beside)[running.sum(axis=1)]
        assert (np.diff(edges) * speed).sum() == pytest.approx(3e3, abs=1e-3)
    assert ops.dur_us[reduces].max() > 3e3
    without = simulate(schedule, costs, host)
    assert np.array_equal(without.ops.dur_us[reduces], np.full(len(reduces), 3e3))
    assert makespan_us(trace) > makespan_us(without)


def test_collectives_on_cores_of_their_own_are_not_slowed():
    """A GPU's ranks (no host named): the measured factors change nothing."""
    schedule, costs = dualpipe_reducing(3.0)
    plain = simulate(schedule, costs, Cluster.uniform(2, 0.1))
    trace = simulate(schedule, costs, replace(Cluster.uniform(2, 0.1), contention=(1.0, 1.2),
                                              collective_contention=(1.0, 2.0, 3.0)))
    assert np.array_equal(trace.ops.start_us, plain.ops.start_us)
    assert np.array_equal(trace.ops.dur_us, plain.ops.dur_us)
    with pytest.raises(ClusterError, match="collective_contention: give slowdowns with 0, 1"):
        Cluster(2, collective_contention=(1.0, -2.0))
