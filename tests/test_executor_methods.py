"""Every method of the catalogue runs in the executor with its own weight semantics.

Every op runs on the weights its lowering names: the tensors the executor hands it are checked against the
version it reads, predicted by the paper's formula from that version's weights and optimizer state as the
update left them (tests/reference.py), not against what the executor reports about itself. Synchronous
methods (AvgPipe's pipelines each are, GraphPipe's stage DAG too) train like one process. The predicting
methods match references written from the papers' rules, mini-batch by mini-batch, for every source of s:
which version each stage's forward and backward read, how far it is predicted (SpecTrain, PipeOptim, XPipe),
and AvgPipe's elastic averaging. The references cut, draw data, step and predict on their own, and
backpropagate the MLP by hand, so that a backward on other weights than its forward's is computed without
the executor's saved-tensor hooks. Versions and distances are derived from the pipeline order (1F1B with
p-k-1 warm-up forwards, an update after each mini-batch's last backward), not taken from schedules/.
"""

from __future__ import annotations

import contextlib
import math
import time
from dataclasses import dataclass, replace
from fractions import Fraction

import numpy as np
import pytest
import torch

from pipesim.executor import DeviceLoop, ExecutorError, RunSpec, Weights, cut, run_in_process, run_multiprocess
from pipesim.executor.runners import _merge
from pipesim.planning.auto import search_schedule
from pipesim.schedules import KINDS, METHODS, Kind, ScheduleParams, StageGraph, lower
from pipesim.schedules.graph import graph_schedule, two_branch_graph
from pipesim.sim import Cluster, Costs
from pipesim.traces.trace import Stream
from tests.conftest import build
from tests.helpers import assert_same, device_loops, run_loops
from tests.reference import STAGE_LAYERS, Reference, Snapshot, forward_version, single_process

REFERENCE_TOL = dict(rtol=1e-9, atol=1e-11)  # against the hand-written references (tests/reference.py)


def make_spec(method: str, *, stages: int = 2, m: int = 2, n: int = 3, optimizer: str = "sgd", lr: float = 0.05,
              model: str = "mlp", options: dict | None = None, dtype: str = "float64", **params) -> RunSpec:
    """A small run; the mlp's 5 Linear layers cut unevenly over 2 or 3 stages, so a cut that gives the extra
    layer to the wrong stage changes what the asynchronous methods train. auto is searched for conftest's costs.
    Not scored on the held-out set: the tests read the weights, losses and rows."""
    schedule = build(method, stages, m, n, **params)
    return RunSpec(schedule, model, options or {"layers": 4, "width": 12}, microbatch_size=4, optimizer=optimizer,
                   lr=lr, seed=5, dtype=dtype, heldout=False)


def run_devices(spec: RunSpec, **loop_options) -> list:
    return run_loops(device_loops(spec, **loop_options))


def final_weights(results, spec: RunSpec, pipeline: int = 0) -> list[torch.Tensor]:
    by_key = {key: ws for r in results for key, ws in r.weights.items()}
    return [torch.from_numpy(w) for k in range(spec.schedule.num_stages) for w in by_key[(k, pipeline)]]


# ------------------------------------------------------------------------------------- every method runs


@dataclass
class Ran:
    """One op: its row, the distance s the lowering names (-1: not predicted), the tensors the executor handed
    it, the version it reads as the update made it, and that version predicted s updates ahead."""

    row: int
    s: int
    used: list[torch.Tensor]
    version: list[torch.Tensor]
    expected: list[torch.Tensor]

    @property
    def moved(self) -> bool:
        """The op ran on weights other than the version's: a prediction changed them."""
        return any(not torch.equal(a, b) for a, b in zip(self.used, self.version))


class Recorder(DeviceLoop):
    """A device loop that keeps what each of its ops ran on. After every update or averaging, each replica of
    the stage is snapshotted (weights and the optimizer's direction then); each F, B, I and W records the
    tensors the loop hands it beside the snapshot of the version the lowering names, predicted by the test's
    own formula over the lowering's s."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, on_row=self._after_row, **kwargs)
        self.history = {key: {0: Snapshot.of(state.optimizer, state.current)} for key, state in self.weights.items()}
        self.ran: list[Ran] = []

    def _after_row(self, row: int) -> None:
        if KINDS[self.lowered.table.kind[row]] in (Kind.OPT, Kind.AVG):
            stage = int(self.lowered.table.stage[row])
            for (k, r), state in self.weights.items():
                if k == stage:
                    self.history[(k, r)][state.version] = Snapshot.of(state.optimizer, state.current)

    def _weights(self, i: int, unit: tuple[int, int, int, int]) -> Weights:
        weights = super()._weights(i, unit)
        read = self.history[(unit[0], unit[3])][int(self.lowered.version[i])]
        s = int(self.lowered.prediction[i])
        self.ran.append(Ran(i, s, [w.detach().clone() for w in weights.tensors], read.weights, read.predicted(s)))
        return weights


def recorded(spec: RunSpec) -> tuple[list, list[Ran]]:
    """The run's device results and every op it ran, each checked to have run on the weights its lowering names."""
    loops = device_loops(spec, Recorder)
    results = run_loops(loops)
    ran = [op for loop in loops for op in loop.ran]
    for op in ran:
        assert_same(op.used, op.expected, **REFERENCE_TOL)
    return results, ran


SHAPES = {"interleaved-1f1b": dict(m=2), "zb-h1": dict(m=4), "zb-h2": dict(m=4), "zb-v": dict(m=4),
          "dualpipev": dict(m=4), "dualpipe": dict(m=4),
          "graphpipe": dict(stages=4, model="two-branch", options={"layers": 1, "width": 4})}


@pytest.mark.parametrize("method", list(METHODS))
def test_every_method_runs_on_the_versions_and_distances_of_its_lowering(method):
    spec = make_spec(method, optimizer="adam", lr=0.01, **SHAPES.get(method, {}))
    results, ran = recorded(spec)
    lowered = lower(spec.schedule)
    passes = [KINDS.index(k) for k in (Kind.F, Kind.B, Kind.I, Kind.W)]
    assert len(ran) == int(np.isin(lowered.table.kind, passes).sum())
    if (lowered.prediction > 0).any():  # the check above is not vacuous: some predictions move the weights
        assert any(op.moved for op in ran)
    for d, result in enumerate(results):
        rows = lowered.rows(d)
        # and the trace reports the version and distance each op used
        np.testing.assert_array_equal(result.version, lowered.version[rows.start:rows.stop])
        np.testing.assert_array_equal(result.prediction, lowered.prediction[rows.start:rows.stop])
        assert result.rows_done == len(rows)
        assert result.activation_bytes[-1] == 0, "every saved activation is released by its backward"
        assert (result.memory_bytes > 0).all()
    losses = {key: v for r in results for key, v in r.losses.items()}
    assert len(losses) == spec.schedule.pipelines * spec.schedule.minibatches
    assert all(np.isfinite(v) for v in losses.values())


@pytest.mark.parametrize("method", METHODS)
def test_the_weight_copies_held_stay_within_the_lowerings_budget(method):
    """After each compute row, the copies of the fullest stage replica (versions, prediction buffers, a
    reference model) are at most what the lowering budgets, and reach it: a prediction buffer is freed after
    its last reader where the lowering keeps its copy for the whole run."""
    spec = make_spec(method, n=4, **SHAPES.get(method, {}))
    lowered = lower(spec.schedule)
    for d, result in enumerate(run_devices(spec)):
        rows = lowered.rows(d)
        compute = lowered.is_compute[rows.start:rows.stop]
        budget = lowered.held_after[rows][compute]
        assert (result.held[compute] <= budget).all()
        assert result.held[compute].max() == budget.max()


@pytest.mark.parametrize("method", ["spectrain", "pipeoptim", "xpipe"])
def test_predicted_ops_really_ran_on_predictions(method):
    """Every distance s > 0 the lowering names moves the weights of some op that reads it, to the test's own
    prediction: a run that skipped the prediction, or predicted over another s, fails here."""
    spec = make_spec(method, stages=3, m=2, n=4, optimizer="adam", lr=0.01)
    _, ran = recorded(spec)
    distances = {int(s) for s in lower(spec.schedule).prediction if s > 0}
    assert len(distances) >= 1
    assert {op.s for op in ran if op.moved} == distances


# ------------------------------------------------------------------------------ synchronous: one process


@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_graphpipe_runs_the_two_branch_dag_like_one_process(optimizer):
    spec = make_spec("graphpipe", stages=4, m=3, n=2, optimizer=optimizer, lr=0.02, model="two-branch",
                     options={"layers": 1, "width": 4})
    assert set(spec.schedule.graph.edges) == {(0, 1), (0, 2), (1, 3), (2, 3)}
    assert_same(final_weights(run_devices(spec), spec), single_process(spec))


def test_graphpipe_with_longer_branches():
    spec = make_spec("graphpipe", stages=6, m=2, n=2, model="two-branch", options={"layers": 2, "width": 4})
    assert_same(final_weights(run_devices(spec), spec), single_process(spec))


def auto_spec(stages: int) -> RunSpec:
    """auto searched for a last stage three times as slow as the others, at twice 1F1B's activations: an order no
    fixed method has, with split backwards whose W's fill the bubbles."""
    slow = [1.0] * (stages - 1) + [3.0]
    costs = Costs.per_stage(stages, fwd_ms=slow, bwd_ms=[2 * ms for ms in slow], activation_mb=64.0)
    schedule = search_schedule(METHODS["auto"].params(stages, 2 * stages, 2, activation_limit=2.0), costs,
                               Cluster.uniform(stages, 0.1))
    return RunSpec(schedule, "mlp", {"layers": 4, "width": 12}, microbatch_size=4, optimizer="adam", lr=0.01, seed=5,
                   dtype="float64", heldout=False)


@pytest.mark.parametrize("stages", [2, 4])
def test_auto_searched_for_uneven_costs_trains_like_one_process(stages):
    spec = auto_spec(stages)
    kinds = {a.kind for order in spec.schedule.orders for a in order}
    assert {Kind.I, Kind.W} <= kinds
    assert_same(final_weights(run_devices(spec), spec), single_process(spec))


@pytest.mark.slow
def test_auto_on_gloo_ranks_trains_like_one_process():
    """The searched order over four real ranks (a first, two middle and a last stage; two stages' searched order
    is checked in-process above): every op on the version its lowering names, and single-process training's
    weights at float64 tolerance."""
    ranks = 4
    spec = auto_spec(ranks)
    real = run_multiprocess(spec, timeout_s=120)
    assert real.trace.meta.hardware["backend"] == "gloo" and real.trace.meta.hardware["ranks"] == ranks
    np.testing.assert_array_equal(real.trace.ops.version, lower(spec.schedule).version)
    assert_same([w for k in range(ranks) for w in real.weights[(k, 0)]], single_process(spec))


def test_avgpipe_with_one_pipeline_trains_like_one_process():
    spec = make_spec("avgpipe", stages=2, m=2, n=3, pipelines=1)
    assert_same(final_weights(run_devices(spec), spec), single_process(spec))


@pytest.mark.parametrize("method,stages", [("1f1b", 2), ("gpipe", 3), ("zb-h1", 3)])
def test_a_chain_schedule_carries_a_dag_models_outputs_and_passes_skips_on(method, stages):
    """The two-branch model on a chain of stages: with 2, edge 0->1 carries the stem's and branch a's
    outputs together; with 3, stage 1 passes the stem's output on to branch b on stage 2."""
    spec = make_spec(method, stages=stages, m=4, n=2, model="two-branch", options={"layers": 1, "width": 4})
    assert_same(final_weights(run_devices(spec), spec), single_process(spec))


def test_a_model_the_stage_graph_cannot_carry_fails_in_one_line():
    with pytest.raises(ExecutorError, match=r"layer 4 on stage 2 reads layer 3 on stage 1, but the graphpipe "
                                            r"stage graph .* has no path from 1 to 2"):
        run_in_process(make_spec("graphpipe", stages=4, m=2, n=1, options={"layers": 5, "width": 12}))
    graph = two_branch_graph(4)
    extra = graph_schedule(ScheduleParams(4, 2, 1), StageGraph(4, (*graph.edges, (0, 3))))
    with pytest.raises(ExecutorError, match="stage edge 0->3 of the graphpipe stage graph would carry nothing"):
        run_in_process(RunSpec(extra, "two-branch", {"layers": 1, "width": 4}))


# -------------------------------------------------------------- the asynchronous methods' reference


def test_the_stages_hold_the_layers_of_the_references_cut():
    """An even cut, the earlier stages taking the extra layer, as tests/reference.py writes it out."""
    for stages in (2, 3):
        layers = STAGE_LAYERS[(5, stages)]
        assert cut(make_spec("pipedream", stages=stages)).bounds == [*(ls[0] for ls in layers), layers[-1][-1] + 1]


def assert_trains_like_reference(spec: RunSpec, reads, other_reads=None) -> None:
    """The executor's final weights are the reference's trained by `reads(k, b, j)` -> ((forward version, s),
    (backward version, s)), and differ from the reference's trained by `other_reads` (default: the same versions
    unpredicted, so that the prediction matters to the result)."""
    reference = Reference(spec)
    reference.train(reads)
    got = final_weights(run_devices(spec), spec)
    assert_same(got, reference.flat(), **REFERENCE_TOL)
    other = Reference(spec)
    other.train(other_reads or (lambda k, b, j: tuple((version, 0) for version, _ in reads(k, b, j))))
    assert any(not torch.allclose(a, w) for a, w in zip(got, other.flat()))


SOURCES = ["paper", "code", "counted"]


@pytest.mark.parametrize("source", SOURCES)
@pytest.mark.parametrize("stages,m,dtype", [(3, 1, "float64"), (2, 3, "float64"), (3, 2, "float64"),
                                            (3, 2, "bfloat16")])
def test_spectrain_predicts_forward_and_backward_weights_with_momentum(stages, m, dtype, source):
    """SpecTrain: F of micro-batch j of mini-batch b on stage k reads the version it finds, B version b (b's
    own update comes after it). The paper and its code predict F s_F = k//2 + p-k-1 and B s_B = k//2 ahead;
    counted, F b - version (the updates before the one that consumes its gradient) and B 0. In bfloat16 the
    prediction extrapolates the float32 masters and the op computes with its 16-bit copy."""
    spec = make_spec("spectrain", stages=stages, m=m, n=5, optimizer="momentum", lr=0.05, prediction=source,
                     dtype=dtype)
    p = stages

    def reads(k, b, j):
        v = forward_version(p, m, k, b, j)
        return ((v, b - v), (b, 0)) if source == "counted" else ((v, k // 2 + p - k - 1), (b, k // 2))
    assert_trains_like_reference(spec, reads)


@pytest.mark.parametrize("source", SOURCES)
@pytest.mark.parametrize("stages,m,optimizer,dtype", [(3, 1, "momentum", "float64"), (2, 3, "adam", "float64"),
                                                      (3, 2, "momentum", "float64"), (3, 2, "adamw", "float64"),
                                                      (3, 2, "adamw", "bfloat16")])
def test_pipeoptim_predicts_the_forward_and_runs_the_backward_on_current_weights(stages, m, optimizer, dtype,
                                                                                 source):
    """PipeOptim: F reads the version it finds, predicted by the optimizer's own rule (SGD-momentum: v; Adam:
    m_hat / (sqrt(v_hat) + eps); AdamW: that + decay * W) s = p-k-1 ahead (paper), p-k (code) or b - version
    (counted); B runs on the current weights, version b, unpredicted."""
    spec = make_spec("pipeoptim", stages=stages, m=m, n=5, optimizer=optimizer, lr=0.02, prediction=source,
                     dtype=dtype)
    p = stages

    def reads(k, b, j):
        v = forward_version(p, m, k, b, j)
        return (v, {"paper": p - k - 1, "code": p - k, "counted": b - v}[source]), (b, -1)
    assert_trains_like_reference(spec, reads)


def half_up(x: Fraction) -> int:
    return math.floor(x + Fraction(1, 2))


@pytest.mark.parametrize("source", ["counted", "paper"])
@pytest.mark.parametrize("stages,m,dtype", [(2, 2, "float64"), (3, 2, "float64"), (2, 3, "float64"),
                                            (3, 2, "bfloat16")])
def test_xpipe_bellwether_predicts_once_per_minibatch_with_adam(stages, m, dtype, source):
    """XPipe: every micro-batch of mini-batch b reads what its bellwether (micro-batch 0) read: in F the
    version stage k had at the bellwether's forward, in B version b (b's own update follows it), each
    predicted s ahead with Adam's moments. s counted: the updates still to come before the one that consumes
    b's gradient (b - version; 0 in B). s from the paper: round((p+m-k/2-2)/m) in F, round((m+floor(k/2)-1)/m)
    in B, halves rounded up."""
    spec = make_spec("xpipe", stages=stages, m=m, n=5, optimizer="adam", lr=0.02, prediction=source, dtype=dtype)
    p = stages

    def reads(k, b, j):
        v = forward_version(p, m, k, b)
        if source == "counted":
            return (v, b - v), (b, 0)
        return (v, half_up(Fraction(2 * (p + m - 2) - k, 2 * m))), (b, half_up(Fraction(m + k // 2 - 1, m)))
    assert_trains_like_reference(spec, reads)


@pytest.mark.parametrize("pipelines,dtype", [(2, "float64"), (3, "float64"), (2, "bfloat16")])
def test_avgpipe_averages_its_pipelines_elastically(pipelines, dtype):
    """AvgPipe: P synchronous pipelines on their own data; after every mini-batch each replica X_i takes
    alpha of its distance to the reference model R and R takes alpha of the sum of the distances (EASGD),
    alpha = 0.9 / P; R starts at the initial weights. In bfloat16 X_i are the float32 masters and R is float32."""
    spec = make_spec("avgpipe", stages=2, m=2, n=4, optimizer="momentum", lr=0.05, pipelines=pipelines, dtype=dtype)
    alpha = 0.9 / pipelines
    replicas = [Reference(spec) for _ in range(pipelines)]
    center = [[w.clone() for w in ws] for ws in replicas[0].weights]
    for b in range(spec.schedule.minibatches):
        for r, replica in enumerate(replicas):
            replica.minibatch(lambda k, b, j: ((b, 0), (b, 0)), b, pipeline=r)
        for k in range(spec.schedule.num_stages):
            with torch.no_grad():
                diffs = [[x - c for x, c in zip(replica.weights[k], center[k])] for replica in replicas]
                for replica, diff in zip(replicas, diffs):
                    for x, d in zip(replica.weights[k], diff):
                        x.add_(d, alpha=-alpha)
                for i, c in enumerate(center[k]):
                    c.add_(sum(diff[i] for diff in diffs), alpha=alpha)
            for replica in replicas:  # the averaged weights are the version the next mini-batch reads
                replica.history[k][-1] = replica.snapshot(k)
    results = run_devices(spec)
    for r, replica in enumerate(replicas):
        assert_same(final_weights(results, spec, r), replica.flat(), **REFERENCE_TOL)


@pytest.mark.parametrize("method,m", [("pipedream", 1), ("pipedream-2bw", 2)])
def test_stashed_versions_hold_in_mixed_precision(method, m):
    """PipeDream's stashing (F and B of mini-batch b on stage k read version b - (p-1-k)) and 2BW's double buffer
    (every op of b reads b - 1) in bfloat16: a version is the 16-bit copy of the float32 masters as its update left
    them, made afresh where an older version is still read, and the micro-batches' gradients add up in float32.
    Updating the 16-bit weights themselves ended elsewhere, as does reading the newest version."""
    spec = make_spec(method, stages=3, m=m, n=5, optimizer="adam", lr=0.02, dtype="bfloat16")

    def reads(k, b, j):
        version = max(0, b - (2 - k)) if method == "pipedream" else max(0, b - 1)
        return ((version, 0),) * 2
    assert_trains_like_reference(spec, reads, other_reads=lambda k, b, j: ((b, 0),) * 2)  # reading the newest


# ----------------------------------------------------------------------------------- memory and hooks


def test_memory_follows_the_activations_each_schedule_keeps():
    """GPipe's first stage holds all m micro-batches' saved activations before its first backward; 1F1B's
    at most p; both free them all."""
    peaks = {}
    for method in ("gpipe", "1f1b"):
        results = run_devices(make_spec(method, stages=2, m=6, n=1))
        peaks[method] = int(results[0].activation_bytes.max())
        assert results[0].activation_bytes[-1] == 0
        assert (results[0].memory_bytes >= results[0].activation_bytes).all()
    assert peaks["gpipe"] >= 3 * peaks["1f1b"] > 0


def test_rows_are_reported_and_compute_runs_under_the_lock():
    """Ranks that share a GPU take turns for compute under a lock; each compute row records how long it waited for
    its turn (the other ranks' compute, which the simulator runs on the shared GPU: calibrate/runtime.py takes it
    off the host time between rows), and the trace carries it."""
    spec = make_spec("1f1b", stages=2, m=2, n=2)
    seen: list[int] = []
    turn_s = 0.002

    class CountingLock(contextlib.AbstractContextManager):
        entered = 0

        def __enter__(self):
            self.entered += 1
            time.sleep(turn_s)  # the other rank's compute
            return self

        def __exit__(self, *exc):
            return None

    lock = CountingLock()
    results = run_devices(spec, on_row=seen.append, compute_lock=lock)
    lowered = lower(spec.schedule)
    assert sorted(seen) == list(range(len(lowered.table.kind)))
    assert lock.entered == int(lowered.is_compute.sum())
    assert {key for r in results for key in r.losses} == {(0, 0), (0, 1)}
    trace = _merge(spec, lowered, results, {}).trace
    waited = trace.ops.wait_us >= 0
    assert (trace.ops.stream[waited] == Stream.COMPUTE).all() and waited.sum() == lock.entered
    assert (trace.ops.wait_us[waited] >= turn_s * 1e6).all()
    assert (run_in_process(spec).trace.ops.wait_us == -1.0).all()  # threads that share no GPU take no turns


def test_a_forwards_micro_batch_is_drawn_before_its_row_starts(monkeypatch):
    """The micro-batch a forward reads is drawn between rows, as a training loop's data loader hands it over, not
    inside the forward's row: on a GPU, whose rows are timed by events, a GPT micro-batch of 4 x 1,024 tokens held
    the device idle 2.8 ms in its row (drawing it), which no calibrated pass holds."""
    spec = make_spec("1f1b", stages=2, m=2, n=2)
    drawn: dict[tuple[int, int, int], int] = {}  # (device, micro-batch, mini-batch) -> when its draw began
    draw = DeviceLoop.draw

    def timed(loop, unit):
        began = time.perf_counter_ns()
        draw(loop, unit)
        if unit in loop.drawn:
            drawn[(loop.device, unit[1], unit[2])] = began

    monkeypatch.setattr(DeviceLoop, "draw", timed)
    results = run_devices(spec)
    lowered = lower(spec.schedule)
    t, started = lowered.table, {}
    for d, result in enumerate(results):
        rows = lowered.rows(d)
        for i in rows:
            if KINDS[t.kind[i]] is Kind.F:
                started[(d, int(t.microbatch[i]), int(t.minibatch[i]))] = int(result.start_ns[i - rows.start])
    assert drawn.keys() == started.keys()  # both stages draw: the first reads the batch, the last the target
    assert all(at < started[key] for key, at in drawn.items())


def test_a_diverging_loss_stops_at_once_naming_the_minibatch():
    spec = replace(make_spec("1f1b", stages=2, m=2, n=6, lr=1e12), timeout_s=3.0)  # the other device gives up
    with pytest.raises(ExecutorError, match=r"loss is (nan|inf) at mini-batch \d+ \(pipeline 0\) on stage 1"):
        run_in_process(spec)


# ---------------------------------------------------------------------------------------------- real ranks


@pytest.mark.slow
def test_a_predicting_method_on_two_gloo_ranks_matches_the_in_process_run():
    spec = make_spec("pipeoptim", stages=2, m=2, n=3, optimizer="adam", lr=0.01, dtype="float32")
    real = run_multiprocess(spec, timeout_s=120)
    local = run_in_process(spec)
    for k in range(2):
        assert_same(real.weights[(k, 0)], local.weights[(k, 0)], rtol=1.3e-6, atol=1e-5)
    np.testing.assert_allclose(real.losses[0], local.losses[0], rtol=1e-5)
    assert KINDS.index(Kind.PRED) in set(real.trace.ops.kind.tolist())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_ranks_sharing_one_gpu_take_turns_and_train_as_on_cpu():
    """Two ranks on the one GPU (host-staged gloo, the compute lock, CUDA-event timing): compute rows of the two
    ranks never overlap, the versions are the IR's, and the weights equal the CPU run's at fp32 tolerances."""
    from pipesim.executor import run_multiprocess

    spec = make_spec("xpipe", stages=2, m=2, n=3, optimizer="adam", lr=0.01, dtype="float32")
    gpu = run_multiprocess(spec, device="cuda")
    cpu = run_multiprocess(spec)
    assert gpu.trace.meta.hardware["transport"] == "host-staged"
    ops = gpu.trace.ops
    compute = np.flatnonzero(ops.stream == 0)
    order = compute[np.argsort(ops.start_us[compute])]
    assert (ops.start_us[order][1:] >= ops.end_us[order][:-1] - 1e-3).all(), "compute rows overlap on one GPU"
    assert np.array_equal(ops.version, lower(spec.schedule).version)
    for key, weights in cpu.weights.items():
        for a, b in zip(gpu.weights[key], weights, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
