"""Every method: complete, deadlock-free, and with the weight semantics its paper states."""

import json
import math

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pipesim.schedules import (
    METHODS,
    Kind,
    ScheduleError,
    ScheduleParams,
    StageGraph,
    check_complete,
    find_deadlock,
    weight_versions,
)
from pipesim.schedules.analysis import rows_of
from pipesim.schedules.graph import graph_schedule, load_graph, two_branch_graph
from tests.conftest import build, simulated
from tests.helpers import method_shape

SYNCHRONOUS = {"gpipe", "1f1b", "interleaved-1f1b", "zb-h1", "zb-h2", "zb-v", "dualpipev", "dualpipe", "auto",
               "avgpipe", "graphpipe"}


def test_catalogue_lists_the_fourteen_methods_of_the_design_dualpipe_and_the_searched_one():
    assert list(METHODS) == ["gpipe", "1f1b", "interleaved-1f1b", "zb-h1", "zb-h2", "zb-v", "dualpipev", "dualpipe",
                             "auto", "pipedream", "pipedream-2bw", "spectrain", "pipeoptim", "xpipe", "avgpipe",
                             "graphpipe"]


def _unit_reads(schedule, versions, kinds):
    """(stage, micro-batch, mini-batch, pipeline) -> version read, for actions of `kinds`."""
    t = schedule.table
    mask = np.isin(t.kind, [list(Kind).index(k) for k in kinds])
    keys = zip(t.stage[mask].tolist(), t.microbatch[mask].tolist(), t.minibatch[mask].tolist(),
               t.pipeline[mask].tolist())
    return dict(zip(keys, versions.read[mask].tolist()))


def _check_rule(name, schedule, versions, summary):
    """The method's version rule, stated independently of how weight_versions computes it."""
    p = schedule.num_stages
    forward = _unit_reads(schedule, versions, [Kind.F])
    backward = _unit_reads(schedule, versions, [Kind.B, Kind.I, Kind.W])
    if name in SYNCHRONOUS:
        assert all(v == b for (s, j, b, q), v in {**forward, **backward}.items())
        assert summary.max_staleness == 0
    elif name == "pipedream":
        assert backward == forward  # weight stashing
    elif name == "pipedream-2bw":
        assert all(v == max(b - 1, 0) for (s, j, b, q), v in {**forward, **backward}.items())
    elif name in ("spectrain", "pipeoptim"):
        assert all(v == b for (s, j, b, q), v in backward.items())  # the backward sees the latest weights
    elif name == "xpipe":
        for (s, j, b, q), v in forward.items():
            assert v == forward[(s, 0, b, q)]  # the bellwether's weights for every micro-batch
        for (s, j, b, q), v in backward.items():
            assert v == backward[(s, 0, b, q)]
    t = schedule.table
    predicted = versions.prediction >= 0
    if name == "spectrain":
        k = t.stage[predicted]
        f = t.kind[predicted] == list(Kind).index(Kind.F)
        assert np.array_equal(versions.prediction[predicted], np.where(f, k // 2 + p - k - 1, k // 2))
    elif name == "pipeoptim":
        assert np.array_equal(versions.prediction[predicted], p - 1 - t.stage[predicted])
    elif name == "xpipe":  # the paper's round((p+m-k/2-2)/m) and round((m+floor(k/2)-1)/m), halves rounded up
        k, m = t.stage[predicted], schedule.microbatches
        f = t.kind[predicted] == list(Kind).index(Kind.F)
        published = np.where(f, np.floor((p + m - k / 2 - 2) / m + 0.5), np.floor((m + k // 2 - 1) / m + 0.5))
        assert np.array_equal(versions.prediction[predicted], published)
    else:
        assert not predicted.any()


@pytest.mark.parametrize("name", list(METHODS))
@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_property_every_method_is_complete_deadlock_free_and_follows_its_rule(name, data):
    p, m, n = method_shape(name, data.draw)
    schedule = build(name, p, m, n)
    check_complete(schedule)
    assert find_deadlock(schedule) == {}
    if not METHODS[name].needs_costs:  # what --wgrad-fraction, --pred, --avg are refused by (a searched order may
        for kind in (Kind.W, Kind.PRED, Kind.AVG):  # merge its W's)
            assert (rows_of(schedule, kind) > 0) == METHODS[name].runs(kind), kind
    versions = weight_versions(schedule)
    _, trace, summary = simulated(schedule, param_mb=8, activation_mb=1, output_mb=0.5)
    _check_rule(name, schedule, versions, summary)
    for counter in (*trace.counters["memory_bytes"], *trace.counters["activations"]):
        assert counter.values.min() >= 0
    assert all(counter.values[-1] == counter.values[0] for counter in trace.counters["activations"])
    assert summary.bubble_fraction >= -1e-9


def test_pipedream_2bw_staleness_one_two_versions_no_flush():
    p, m = 4, 4
    summary = simulated(build("pipedream-2bw", p, m, 12)).summary
    assert [s.forward_staleness for s in summary.stages] == [1] * p
    assert [s.backward_staleness for s in summary.stages] == [1] * p
    assert [d.peak_weight_versions for d in summary.devices] == [2] * p
    assert summary.time_per_minibatch_ms == pytest.approx(m * 3.0)  # no flush: every device always busy


def test_pipedream_2bw_rejects_too_few_microbatches():
    with pytest.raises(ScheduleError, match="m >= p-1"):
        build("pipedream-2bw", 6, 2, 3)


@pytest.mark.parametrize("p, m", [(2, 1), (4, 2), (4, 4), (8, 3)])
def test_pipedreams_staleness_is_what_schedules_lists_in_minibatches(p, m):
    """`pipesim schedules` said p-1-k, while tables count mini-batches (1 at p = m = 4)."""
    assert "staleness ⌈(p-1-k)/m⌉ mini-batches" in METHODS["pipedream"].summary
    summary = simulated(build("pipedream", p, m, 4 * p)).summary
    assert [s.forward_staleness for s in summary.stages] == [math.ceil((p - 1 - k) / m) for k in range(p)]


@pytest.mark.parametrize("p", [2, 4, 6])
def test_pipeoptim_predicts_p_minus_1_minus_k_and_keeps_two_copies(p):
    summary = simulated(build("pipeoptim", p, 1, 4 * p)).summary
    assert [s.prediction_distance for s in summary.stages] == [p - 1 - k for k in range(p)]
    assert [s.backward_prediction_distance for s in summary.stages] == [None] * p
    # the paper's s equals the count of updates (the forward's staleness) in PipeDream's order
    assert [s.forward_staleness for s in summary.stages] == [p - 1 - k for k in range(p)]
    assert [s.backward_staleness for s in summary.stages] == [0] * p
    assert [d.peak_weight_versions for d in summary.devices] == [2] * p


@pytest.mark.parametrize("p", [2, 4, 5])
def test_spectrain_uses_the_published_distances(p):
    summary = simulated(build("spectrain", p, 1, 4 * p)).summary
    assert [s.prediction_distance for s in summary.stages] == [k // 2 + p - k - 1 for k in range(p)]
    assert [s.backward_prediction_distance for s in summary.stages] == [k // 2 for k in range(p)]
    assert [s.forward_staleness for s in summary.stages] == [p - 1 - k for k in range(p)]  # the count


def test_prediction_costs_time():
    p = 4
    plain = simulated(build("pipedream", p, 1, 16)).summary
    predicted = simulated(build("spectrain", p, 1, 16), opt_ms=0.25).summary
    assert predicted.time_per_minibatch_ms == pytest.approx(plain.time_per_minibatch_ms + 2 * 0.25 + 0.25)


def test_xpipe_bellwether_uses_the_published_distances_and_counts_on_request():
    p, m = 4, 2
    schedule = build("xpipe", p, m, 8)
    summary = simulated(schedule).summary
    assert schedule.params["prediction"] == "paper"
    assert [s.prediction_distance for s in summary.stages] == [2, 2, 2, 1]
    assert [s.backward_prediction_distance for s in summary.stages] == [1, 1, 1, 1]
    assert [d.peak_weight_versions for d in summary.devices] == [3] * p  # the current, F's and B's buffers
    counted = simulated(build("xpipe", p, m, 8, prediction="counted")).summary
    assert [s.prediction_distance for s in counted.stages] == [2, 1, 1, 0]
    assert [s.backward_prediction_distance for s in counted.stages] == [0, 0, 0, 0]
    preds = [a for a in schedule.orders[0] if a.kind is Kind.PRED]
    assert len(preds) == 2 * 8 and all(a.microbatch == 0 for a in preds)  # once per mini-batch, F and B


def test_avgpipe_memory_grows_with_pipelines_and_advance_sets_warmup():
    p, m = 4, 8
    peaks = []
    for copies in (1, 2, 4):
        summary = simulated(build("avgpipe", p, m, 2, pipelines=copies), param_mb=16, activation_mb=2).summary
        peaks.append(summary.peak_memory_mb)
        assert summary.max_staleness == 0
    assert peaks[0] < peaks[1] < peaks[2]
    for advance, first_backward in ((0, [p - k for k in range(p)]), (None, [2 * (p - k) - 1 for k in range(p)]),
                                    (2, [p - k + 2 for k in range(p)]), (m, [m] * p)):
        schedule = build("avgpipe", p, m, 1, pipelines=1, advance=advance)
        forwards_first = [next(i for i, a in enumerate(order) if a.kind is Kind.B) for order in schedule.orders]
        assert forwards_first == first_backward
    averaging = [a for a in build("avgpipe", p, m, 6, average_every=3).orders[0] if a.kind is Kind.AVG]
    assert [a.minibatch for a in averaging] == [2, 5]


def test_avgpipe_reference_model_is_an_extra_copy():
    summary = simulated(build("avgpipe", 2, 4, 1, pipelines=2), param_mb=10, activation_mb=0,
                        optimizer="sgd").summary
    # two replicas of weights and gradients, plus the reference model's weights
    assert summary.devices[0].peak_memory_mb == pytest.approx(2 * 2 * 10 + 10)
    # in mixed precision a copy of the float32 masters it averages with (16-bit weights of 10 MB: 20 MB each of
    # gradients and masters, SGD's state), where a prediction's buffer is one of the 16-bit weights
    for name, copy_mb in (("avgpipe", 20), ("spectrain", 10)):
        schedule = build(name, 2, 4, 1, pipelines=2 if name == "avgpipe" else 1)
        summary = simulated(schedule, param_mb=10, activation_mb=0, optimizer="sgd", precision="megatron").summary
        assert summary.devices[0].peak_memory_mb == pytest.approx(schedule.pipelines * 50 + copy_mb), name


def test_graphpipe_branches_beat_the_same_stages_in_a_chain():
    params = ScheduleParams(4, 8)
    dag = simulated(graph_schedule(params, two_branch_graph(4))).summary
    chain = simulated(graph_schedule(params, StageGraph.chain(4))).summary
    assert dag.makespan_ms == pytest.approx((8 + 3 - 1) * 3.0)  # depth 3: the branches overlap
    assert chain.makespan_ms == pytest.approx((8 + 4 - 1) * 3.0)
    assert dag.makespan_ms < chain.makespan_ms
    assert sum(d.peak_activations for d in dag.devices) < sum(d.peak_activations for d in chain.devices)


def test_graph_file_and_its_errors(tmp_path):
    path = tmp_path / "g.json"
    path.write_text(json.dumps({"stages": 3, "edges": [[0, 1], [0, 2]], "placement": [2, 0, 1]}))
    graph, placement = load_graph(path)
    schedule = graph_schedule(ScheduleParams(3, 4), graph, placement)
    assert schedule.orders[2][0].stage == 0 and find_deadlock(schedule) == {}
    for doc, message in (
        ({"stages": 3, "edges": [[0, 1], [1, 2], [2, 0]]}, "cycle"),
        ({"stages": 3, "edges": [[0, 1]], "placement": [0, 1]}, "placement"),
        ({"stages": 2, "edges": [[0, 5]]}, "edge"),
        ({"stages": 2, "edges": [[0, 1]], "placement": [0, 0]}, "its own device"),
        ({"edges": []}, "stages"),
    ):
        path.write_text(json.dumps(doc))
        with pytest.raises(ScheduleError, match=message):
            load_graph(path)
    path.write_text("{")
    with pytest.raises(ScheduleError, match="not valid JSON"):
        load_graph(path)
