"""Every method of the catalogue runs in the executor with its own weight semantics.

Synchronous methods (AvgPipe's pipelines each are, GraphPipe's stage DAG too) train like one process. The
predicting methods match references written here from the papers' rules, mini-batch by mini-batch: which
version each stage's forward and backward read, how far it is predicted (SpecTrain, PipeOptim, XPipe), and
AvgPipe's elastic averaging. The references backpropagate the MLP by hand, so that a backward on other
weights than its forward's (the forward's activations, the backward's weights) is computed without the
executor's saved-tensor hooks. Versions and distances are derived from the pipeline order (1F1B with p-k-1
warm-up forwards, an update after each mini-batch's last backward), not taken from schedules/.
"""

from __future__ import annotations

import contextlib
import math
import threading
from dataclasses import replace
from fractions import Fraction

import numpy as np
import pytest
import torch
from torch import nn

from pipesim.executor import DeviceLoop, ExecutorError, RunSpec, cut, microbatch_data, run_in_process, run_multiprocess
from pipesim.schedules import KINDS, METHODS, Kind, ScheduleParams, StageGraph, build_schedule, lower
from pipesim.schedules.graph import graph_schedule, two_branch_graph
from pipesim.workload.models import BATCH
from pipesim.workload.optim import make_optimizer
from pipesim.workload.transport import InProcessTransport

TIGHT = dict(rtol=1e-9, atol=1e-11)


def make_spec(method: str, *, stages: int = 2, m: int = 2, n: int = 3, optimizer: str = "sgd", lr: float = 0.05,
              model: str = "mlp", options: dict | None = None, dtype: str = "float64", **params) -> RunSpec:
    schedule = build_schedule(method, METHODS[method].params(stages, m, n, **params))
    return RunSpec(schedule, model, options or {"layers": 5, "width": 12}, microbatch_size=4, optimizer=optimizer,
                   lr=lr, seed=5, dtype=dtype)


def run_devices(spec: RunSpec, **loop_options) -> list:
    """Every device's DeviceResult (what the loops measured), each device a thread over the in-process
    transport."""
    lowered = lower(spec.schedule)
    devices = spec.schedule.num_devices
    transports = InProcessTransport.connected(devices, timeout_s=60)
    loops = [DeviceLoop(spec, lowered, cut(spec), d, transports[d], **loop_options) for d in range(devices)]
    results, errors = [None] * devices, []

    def work(d: int) -> None:
        try:
            results[d] = loops[d].run()
        except Exception as exc:
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(d,)) for d in range(devices)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        raise errors[0]
    return results


def final_weights(results, spec: RunSpec, pipeline: int = 0) -> list[torch.Tensor]:
    by_key = {key: ws for r in results for key, ws in r.weights.items()}
    return [torch.from_numpy(w) for k in range(spec.schedule.num_stages) for w in by_key[(k, pipeline)]]


def assert_same(got, want, **tol) -> None:
    assert len(got) == len(want)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, **(tol or TIGHT))


# ------------------------------------------------------------------------------------- every method runs


SHAPES = {"interleaved-1f1b": dict(m=2), "zb-h1": dict(m=4), "zb-h2": dict(m=4), "zb-v": dict(m=4),
          "dualpipev": dict(m=4), "graphpipe": dict(stages=4, model="two-branch", options={"layers": 1, "width": 4})}


@pytest.mark.parametrize("method", list(METHODS))
def test_every_method_runs_on_the_versions_and_distances_of_its_lowering(method):
    spec = make_spec(method, optimizer="adam", lr=0.01, **SHAPES.get(method, {}))
    results = run_devices(spec)
    lowered = lower(spec.schedule)
    for d, result in enumerate(results):
        rows = lowered.rows(d)
        # what each op ran on, read off the weights it used, is what the IR says it reads
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


def test_predicted_ops_really_ran_on_predictions():
    """Distances > 0 appear (the test above would pass vacuously on a method that predicts nothing)."""
    for method in ("spectrain", "pipeoptim", "xpipe"):
        results = run_devices(make_spec(method, stages=3, m=2, n=3, optimizer="adam", lr=0.01))
        assert max(int(r.prediction.max()) for r in results) >= 1, method


# ------------------------------------------------------------------------------ synchronous: one process


def dag_forward(model, x: torch.Tensor) -> torch.Tensor:
    outputs = {BATCH: x}
    for i, layer in enumerate(model.layers):
        outputs[i] = layer(*(outputs[s] for s in model.inputs[i]))
    return outputs[len(model.layers) - 1]


def single_process(spec: RunSpec) -> list[torch.Tensor]:
    model = spec.build_model()
    params = [p for layer in model.layers for p in layer.parameters()]
    optimizer = make_optimizer(spec.optimizer, params, spec.lr)
    m = spec.schedule.microbatches
    for b in range(spec.schedule.minibatches):
        for j in range(m):
            x, target = microbatch_data(spec, model, b, j)
            (model.loss(dag_forward(model, x), target) / m).backward()
        optimizer.step()
        optimizer.zero_grad()
    return [p.detach() for p in params]


@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_graphpipe_runs_the_two_branch_dag_like_one_process(optimizer):
    spec = make_spec("graphpipe", stages=4, m=3, n=2, optimizer=optimizer, lr=0.02, model="two-branch",
                     options={"layers": 1, "width": 4})
    assert set(spec.schedule.graph.edges) == {(0, 1), (0, 2), (1, 3), (2, 3)}
    assert_same(final_weights(run_devices(spec), spec), single_process(spec), rtol=1e-10, atol=1e-12)


def test_graphpipe_with_longer_branches():
    spec = make_spec("graphpipe", stages=6, m=2, n=2, model="two-branch", options={"layers": 2, "width": 4})
    assert_same(final_weights(run_devices(spec), spec), single_process(spec), rtol=1e-10, atol=1e-12)


def test_avgpipe_with_one_pipeline_trains_like_one_process():
    spec = make_spec("avgpipe", stages=2, m=2, n=3, pipelines=1)
    assert_same(final_weights(run_devices(spec), spec), single_process(spec), rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("method,stages", [("1f1b", 2), ("gpipe", 3), ("zb-h1", 3)])
def test_a_chain_schedule_carries_a_dag_models_outputs_and_passes_skips_on(method, stages):
    """The two-branch model on a chain of stages: with 2, edge 0->1 carries the stem's and branch a's
    outputs together; with 3, stage 1 passes the stem's output on to branch b on stage 2."""
    spec = make_spec(method, stages=stages, m=4, n=2, model="two-branch", options={"layers": 1, "width": 4})
    assert_same(final_weights(run_devices(spec), spec), single_process(spec), rtol=1e-10, atol=1e-12)


def test_a_model_the_stage_graph_cannot_carry_fails_in_one_line():
    with pytest.raises(ExecutorError, match=r"layer 4 on stage 2 reads layer 3 on stage 1, but the graphpipe "
                                            r"stage graph .* has no path from 1 to 2"):
        run_in_process(make_spec("graphpipe", stages=4, m=2, n=1))
    graph = two_branch_graph(4)
    extra = graph_schedule(ScheduleParams(4, 2, 1), StageGraph(4, (*graph.edges, (0, 3))))
    with pytest.raises(ExecutorError, match="stage edge 0->3 of the graphpipe stage graph would carry nothing"):
        run_in_process(RunSpec(extra, "two-branch", {"layers": 1, "width": 4}))


# -------------------------------------------------------------- the asynchronous methods' reference


class Reference:
    """The MLP's stages trained mini-batch by mini-batch with explicit weights per op. Stage k's weights
    are a flat list (weight, bias, weight, bias, ...) of its Linear layers; every Linear but the model's last
    is followed by a ReLU. `history[k][v]` holds version v (after v updates) with the optimizer's state then,
    from which a prediction s updates ahead is made by the paper's formula."""

    def __init__(self, spec: RunSpec) -> None:
        self.spec = spec
        self.model = spec.build_model()
        stages = cut(spec, self.model)
        self.p, self.m = spec.schedule.num_stages, spec.schedule.microbatches
        self.weights = [[w.detach().clone() for w in module.parameters()] for module in stages.modules]
        self.optimizers = [make_optimizer(spec.optimizer, ws, spec.lr) for ws in self.weights]
        self.history = [[self.snapshot(k)] for k in range(self.p)]

    def snapshot(self, k: int) -> tuple[list[torch.Tensor], list[torch.Tensor] | None]:
        """(weights, the direction one update moves them by / lr), as the papers predict with."""
        weights = [w.detach().clone() for w in self.weights[k]]
        optimizer = self.optimizers[k]
        states = [optimizer.state.get(w, {}) for w in self.weights[k]]
        if not states or not states[0]:
            return weights, None
        group = optimizer.param_groups[0]
        if isinstance(optimizer, torch.optim.Adam):  # m_hat / (sqrt(v_hat) + eps)
            beta1, beta2 = group["betas"]
            steps = [float(s["step"]) for s in states]
            return weights, [(s["exp_avg"] / (1 - beta1 ** t)) / ((s["exp_avg_sq"] / (1 - beta2 ** t)).sqrt()
                                                                    + group["eps"]) for s, t in zip(states, steps)]
        return weights, [s["momentum_buffer"].clone() for s in states]  # SGD with momentum: v

    def predicted(self, k: int, version: int, s: int) -> list[torch.Tensor]:
        weights, direction = self.history[k][version]
        if s <= 0 or direction is None:
            return weights
        lr = self.optimizers[k].param_groups[0]["lr"]
        return [w - s * lr * d for w, d in zip(weights, direction)]

    def gradients(self, forward: list[list[torch.Tensor]], backward: list[list[torch.Tensor]], x, target
                  ) -> list[list[torch.Tensor]]:
        """One micro-batch's weight gradients: forward on `forward`, the input gradients through `backward`
        (the weights the backward op runs on), by hand."""
        linears_f = [(ws[i], ws[i + 1]) for ws in forward for i in range(0, len(ws), 2)]
        linears_b = [ws[i] for ws in backward for i in range(0, len(ws), 2)]
        saved, h = [], x
        for i, (w, b) in enumerate(linears_f):
            z = nn.functional.linear(h, w, b)  # the op the model runs, so the float32 loss sees equal logits
            mask = (z > 0) if i < len(linears_f) - 1 else None
            saved.append((h, mask))
            h = z * mask if mask is not None else z
        logits = h.detach().requires_grad_(True)
        (dh,) = torch.autograd.grad(self.model.loss(logits, target) / self.m, logits)
        grads: list[torch.Tensor] = []
        for i in reversed(range(len(linears_f))):
            h, mask = saved[i]
            dz = dh * mask if mask is not None else dh
            grads[:0] = [dz.T @ h, dz.sum(0)]
            dh = dz @ linears_b[i]
        flat = iter(grads)
        return [[next(flat) for _ in ws] for ws in forward]

    def update(self, k: int, grads: list[torch.Tensor]) -> None:
        for w, g in zip(self.weights[k], grads):
            w.grad = g
        self.optimizers[k].step()
        self.history[k].append(self.snapshot(k))

    def train(self, rule, pipeline: int = 0) -> None:
        """rule(k, b, j) -> ((forward version, s), (backward version, s)); s <= 0: not predicted."""
        for b in range(self.spec.schedule.minibatches):
            self.minibatch(rule, b, pipeline)

    def minibatch(self, rule, b: int, pipeline: int = 0) -> None:
        sums = [[torch.zeros_like(w) for w in ws] for ws in self.weights]
        for j in range(self.m):
            x, target = microbatch_data(self.spec, self.model, b, j, pipeline)
            reads = [rule(k, b, j) for k in range(self.p)]
            forward = [self.predicted(k, *reads[k][0]) for k in range(self.p)]
            backward = [self.predicted(k, *reads[k][1]) for k in range(self.p)]
            for acc, grads in zip(sums, self.gradients(forward, backward, x, target)):
                for a, g in zip(acc, grads):
                    a.add_(g)
        for k in range(self.p):
            self.update(k, sums[k])


def forward_version(p: int, m: int, k: int, b: int, j: int = 0) -> int:
    """Updates stage k has made when it starts the forward of micro-batch j of mini-batch b: in 1F1B with
    p-k-1 warm-up forwards, backwards 0 .. u-(p-k-1)-1 are done before forward u = b*m + j, and an update
    follows every m-th backward."""
    return max(0, b * m + j - (p - k - 1)) // m


@pytest.mark.parametrize("stages", [2, 3])
def test_spectrain_predicts_forward_and_backward_weights_with_momentum(stages):
    """SpecTrain (m = 1): F of mini-batch b on stage k reads version b-(p-1-k) predicted s_F = k//2 + p-k-1
    ahead; B reads version b (its own update comes after it) predicted s_B = k//2 ahead."""
    spec = make_spec("spectrain", stages=stages, m=1, n=6, optimizer="momentum", lr=0.05)
    p = stages
    reference = Reference(spec)
    reference.train(lambda k, b, j: ((forward_version(p, 1, k, b), k // 2 + p - k - 1), (b, k // 2)))
    got = final_weights(run_devices(spec), spec)
    assert_same(got, [w for ws in reference.weights for w in ws])
    plain = Reference(spec)  # and the prediction matters
    plain.train(lambda k, b, j: ((forward_version(p, 1, k, b), 0), (forward_version(p, 1, k, b), 0)))
    assert any(not torch.allclose(a, w) for a, w in zip(got, [w for ws in plain.weights for w in ws]))


@pytest.mark.parametrize("optimizer", ["momentum", "adam"])
@pytest.mark.parametrize("stages", [2, 3])
def test_pipeoptim_predicts_the_forward_and_runs_the_backward_on_current_weights(stages, optimizer):
    """PipeOptim (m = 1): F reads version b-(p-1-k) predicted s = p-k-1 ahead by the optimizer's own rule
    (SGD-momentum: v; Adam: m_hat / (sqrt(v_hat) + eps)); B runs on the current weights, version b."""
    spec = make_spec("pipeoptim", stages=stages, m=1, n=6, optimizer=optimizer, lr=0.02)
    p = stages
    reference = Reference(spec)
    reference.train(lambda k, b, j: ((forward_version(p, 1, k, b), p - k - 1), (b, 0)))
    assert_same(final_weights(run_devices(spec), spec), [w for ws in reference.weights for w in ws])


def half_up(x: Fraction) -> int:
    return math.floor(x + Fraction(1, 2))


@pytest.mark.parametrize("source", ["counted", "paper"])
@pytest.mark.parametrize("stages,m", [(2, 2), (3, 2), (2, 3)])
def test_xpipe_bellwether_predicts_once_per_minibatch_with_adam(stages, m, source):
    """XPipe: every micro-batch of mini-batch b reads what its bellwether (micro-batch 0) read: in F the
    version stage k had at the bellwether's forward, in B version b (b's own update follows it), each
    predicted s ahead with Adam's moments. s counted: the updates still to come before the one that consumes
    b's gradient (b - version; 0 in B). s from the paper: round((p+m-k/2-2)/m) in F, round((m+floor(k/2)-1)/m)
    in B, halves rounded up."""
    spec = make_spec("xpipe", stages=stages, m=m, n=5, optimizer="adam", lr=0.02, prediction=source)
    p = stages
    reference = Reference(spec)

    def rule(k, b, j):
        v = forward_version(p, m, k, b)
        if source == "counted":
            return (v, b - v), (b, 0)
        return (v, half_up(Fraction(2 * (p + m - 2) - k, 2 * m))), (b, half_up(Fraction(m + k // 2 - 1, m)))
    reference.train(rule)
    assert_same(final_weights(run_devices(spec), spec), [w for ws in reference.weights for w in ws])


@pytest.mark.parametrize("pipelines", [2, 3])
def test_avgpipe_averages_its_pipelines_elastically(pipelines):
    """AvgPipe: P synchronous pipelines on their own data; after every mini-batch each replica X_i takes
    alpha of its distance to the reference model R and R takes alpha of the sum of the distances (EASGD),
    alpha = 0.9 / P; R starts at the initial weights."""
    spec = make_spec("avgpipe", stages=2, m=2, n=4, optimizer="momentum", lr=0.05, pipelines=pipelines)
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
        assert_same(final_weights(results, spec, r), [w for ws in replica.weights for w in ws])


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
    spec = make_spec("1f1b", stages=2, m=2, n=2)
    seen: list[int] = []

    class CountingLock(contextlib.AbstractContextManager):
        entered = 0

        def __enter__(self):
            self.entered += 1
            return self

        def __exit__(self, *exc):
            return None

    lock = CountingLock()
    results = run_devices(spec, on_row=seen.append, compute_lock=lock)
    lowered = lower(spec.schedule)
    assert sorted(seen) == list(range(len(lowered.table.kind)))
    assert lock.entered == int(lowered.is_compute.sum())
    assert {key for r in results for key in r.losses} == {(0, 0), (0, 1)}


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
        for a, b in zip(gpu.weights[key], weights):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
