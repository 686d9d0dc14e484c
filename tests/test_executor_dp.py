"""Data parallelism in the executor: d replicas of the pipeline, each training on its own share of the
mini-batch and averaging its gradients with the others' in REDUCE rows, train exactly as one process on the whole
mini-batch (d x m micro-batches). The reference (tests/reference.py) draws, cuts and steps on its own: its whole
mini-batch is micro-batches 0 .. d*m-1, of which replica q trains on q*m .. q*m+m-1.
"""

from __future__ import annotations

import threading
from dataclasses import replace

import numpy as np
import pytest
import torch

from pipesim.executor import DeviceLoop, ExecutorError, RunSpec, cut, replicas, run_in_process, run_multiprocess
from pipesim.executor import weights as weights_module
from pipesim.executor.replicas import DistReplicas, Layout, bucket, thread_replicas
from pipesim.executor.runners import TorchrunEnv, run_torchrun
from pipesim.schedules import KINDS, Kind, lower
from pipesim.sim import Cluster, Costs, simulate
from pipesim.traces import read_trace
from pipesim.traces.compare import compare
from pipesim.traces.metrics import summarize
from pipesim.traces.trace import Stream
from pipesim.workload.transport import InProcessTransport
from tests.conftest import build, pipesim
from tests.helpers import DP_REPLICAS as D
from tests.helpers import TIGHT, assert_same, dp_spec, run_loops
from tests.helpers import in_one_process as whole
from tests.reference import Reference, draw, forward_version, initial_model, single_process


def replica_weights(result, spec: RunSpec, replica: int) -> list[torch.Tensor]:
    weights = result.replica_weights[replica]
    return [w for k in range(spec.schedule.num_stages) for w in weights[(k, 0)]]


def assert_every_replica_is(result, spec: RunSpec, want: list[torch.Tensor]) -> None:
    """Replica 0 holds `want`, and every other replica exactly replica 0's weights."""
    first = replica_weights(result, spec, 0)
    assert_same(first, want)
    for q in range(1, spec.schedule.data_parallel):
        assert all(torch.equal(a, b) for a, b in zip(replica_weights(result, spec, q), first, strict=True))


SYNCHRONOUS = [("gpipe", 2, "sgd"), ("1f1b", 2, "adam"), ("interleaved-1f1b", 4, "sgd"), ("zb-h1", 4, "momentum"),
               ("zb-h2", 4, "sgd"), ("zb-v", 4, "adamw"), ("dualpipev", 4, "sgd"), ("auto", 4, "sgd")]


@pytest.mark.parametrize("method,m,optimizer", SYNCHRONOUS)
def test_every_synchronous_method_with_two_replicas_trains_as_one_process_on_the_whole_minibatch(method, m,
                                                                                                   optimizer):
    spec = dp_spec(method, m, optimizer=optimizer)
    assert [a.kind for a in spec.schedule.orders[0]].count(Kind.REDUCE) > 0
    result = run_in_process(spec)
    assert_every_replica_is(result, spec, single_process(whole(spec)))


def test_without_the_all_reduce_the_replicas_would_train_apart():
    """The check above can fail: each replica alone, on its own half of the mini-batch, ends elsewhere."""
    spec = dp_spec("1f1b", 2)
    alone = replace(spec, schedule=build("1f1b", 2, 2, 2))  # d = 1: replica 0's share only
    want = single_process(whole(spec))
    got = replica_weights(run_in_process(alone), alone, 0)
    assert any(not torch.allclose(a, b, **TIGHT) for a, b in zip(got, want))


@pytest.mark.parametrize("method,m,optimizer", [("1f1b", 2, "adam"), ("zb-h1", 4, "momentum"), ("dualpipev", 4, "sgd")])
def test_replicas_in_bfloat16_average_their_float32_main_gradients(method, m, optimizer):
    """In bfloat16 each replica adds its micro-batches' 16-bit gradients into float32 main gradients (B, or W after
    I), REDUCE averages those and the update steps float32 masters: the replicas end as one process trained so on
    the whole mini-batch (a few bfloat16 gradients sum exactly in float32, so to the last bit). Averaging them in
    16 bits ends elsewhere (88-93 % of the first layer's weights differ)."""
    spec = replace(dp_spec(method, m, optimizer=optimizer), dtype="bfloat16")
    assert_every_replica_is(run_in_process(spec), spec, single_process(whole(spec)))


def test_the_loss_is_the_whole_minibatchs():
    """Mini-batch 0 runs on the initial weights: its loss is the mean over all d x m micro-batches."""
    spec = dp_spec("gpipe", 2)
    reference = whole(spec)
    model = initial_model(reference)
    with torch.no_grad():
        first = np.mean([float(model.loss(model.forward(x), target))
                         for x, target in (draw(reference, model, 0, j) for j in range(D * 2))])
    assert run_in_process(spec).losses[0][0] == pytest.approx(first, rel=1e-12)


def test_the_trace_holds_every_ranks_rows_and_each_reduce_ends_before_its_update():
    spec = dp_spec("1f1b", 2, n=3)
    trace = run_in_process(spec).trace
    lowered = lower(spec.schedule)
    p = spec.schedule.num_devices
    assert trace.num_devices == p * D and trace.meta.hardware["ranks"] == p * D
    ops = trace.ops
    kinds = np.array(KINDS)[ops.kind]
    for rank in range(p * D):
        mine = ops.device == rank
        rows = slice(lowered.rows(rank % p).start, lowered.rows(rank % p).stop)  # replica rank // p's device
        for column in ("kind", "stage", "microbatch", "minibatch", "peer"):
            np.testing.assert_array_equal(getattr(ops, column)[mine], getattr(lowered.table, column)[rows])
        np.testing.assert_array_equal(ops.version[mine], lowered.version[rows])
        reduces = np.flatnonzero(mine & (kinds == Kind.REDUCE))
        updates = np.flatnonzero(mine & (kinds == Kind.OPT))
        assert len(reduces) == len(updates) == 3 * len(spec.schedule.stages_on(rank % p))
        assert (ops.stream[reduces] == Stream.NETWORK).all()
        assert (ops.end_us[reduces] <= ops.start_us[updates] + 1e-3).all()


def test_compare_matches_replica_0_with_the_prediction_op_by_op():
    spec = dp_spec("zb-v", 4)
    measured = run_in_process(spec).trace
    predicted = simulate(spec.schedule, Costs.per_stage(spec.schedule.num_stages, fwd_ms=1.0, bwd_ms=2.0),
                         Cluster.uniform(spec.schedule.num_devices, 0.1))
    result = compare(predicted, measured)
    assert result.matched_ops == len(predicted.ops) and result.missing_in_measured == result.missing_in_predicted == 0
    assert result.versions_compared > 0 and result.version_mismatches == 0
    assert [d.device for d in result.devices] == [0, 1]
    assert any("replica 0 (ranks 0-1) is compared op by op" in note for note in result.notes)
    # the step and bubble are the whole run's, as `run` and the page give them (replica 0's alone read 58.809 ms
    # where they said 59.017)
    ran = summarize(measured)
    assert (result.measured_ms, result.measured_bubble) == (ran.time_per_minibatch_ms, ran.bubble_fraction)
    # in Megatron-core's order replica 0 ran on ranks 0 and 2, and the note says so; the ops match alike
    megatron = compare(predicted, run_in_process(replace(spec, rank_order="megatron")).trace)
    assert megatron.matched_ops == result.matched_ops and megatron.version_mismatches == 0
    assert any("replica 0 (ranks 0, 2) is compared op by op" in note for note in megatron.notes), megatron.notes


def test_ranks_that_take_turns_for_compute_wait_for_their_replicas_outside_the_turn():
    """Ranks sharing one GPU compute under one lock; an update waits for its all-reduce without it (inside, a
    rank would hold the GPU while waiting for a replica that needs the GPU to get there)."""
    spec = replace(dp_spec("gpipe", 2), timeout_s=10.0)
    lowered, layout = lower(spec.schedule), Layout(2, D)
    transports = InProcessTransport.connected(layout.ranks)
    _, members = thread_replicas(layout, spec.timeout_s)
    turn = threading.Lock()
    loops = [DeviceLoop(spec, lowered, cut(spec), device, transports[rank], replica=replica, replicas=members[rank],
                        compute_lock=turn) for rank, (device, replica) in enumerate(map(layout.place, range(4)))]
    results = run_loops(loops)
    want = single_process(whole(spec))
    assert_same([torch.from_numpy(w) for k in range(2) for w in results[layout.rank(k, 1)].weights[(k, 0)]], want)


def test_a_stage_without_weights_has_nothing_to_wait_for():
    """Every replica of a weightless stage skips its all-reduce alike, so none waits for the others."""
    _, members = thread_replicas(Layout(1, D), timeout_s=0.5)
    assert members[0].start([]).wait() > 0


def test_a_reduced_stage_accumulates_into_one_bucket_that_its_all_reduce_sums_in_place(monkeypatch):
    """A stage that REDUCE rows average keeps its gradients as views of one flat buffer from its first backward on,
    and the all-reduce sums that buffer itself: no flattened copy, no copy of the mean back. Gradients that are not
    one buffer end to end are flattened into a copy and the mean copied back, as before."""
    reduced = []

    def start(member, n, tensors):
        reduced.append(replicas.flat_buffer(tensors))
        return started(member, n, tensors)
    started = replicas.ThreadReplicas._start
    monkeypatch.setattr(replicas.ThreadReplicas, "_start", start)
    spec = dp_spec("1f1b", 2)
    assert_every_replica_is(run_in_process(spec), spec, single_process(whole(spec)))
    assert len(reduced) == 2 * D * spec.schedule.minibatches and all(flat is not None for flat in reduced)

    summed = []

    class Work:
        def wait(self, timeout):
            return True

        def get_future(self):
            done = torch.futures.Future()
            done.set_result(None)
            return done

    def all_reduce(tensor, group, async_op):
        summed.append(tensor)
        tensor.mul_(D)  # D replicas of the same gradients
        return Work()
    monkeypatch.setattr(replicas.dist, "all_reduce", all_reduce)
    member = DistReplicas(None, list(range(D)), 0, False, 1.0)
    weights = [torch.randn(3, 4), torch.randn(4)]
    grads = bucket(weights)
    for grad, weight in zip(grads, weights):
        grad.add_(weight)
    member.start(grads).wait()
    assert summed[0].data_ptr() == grads[0].data_ptr() and summed[0].numel() == 16
    assert all(torch.equal(grad, weight) for grad, weight in zip(grads, weights))
    for loose in ([w.clone() for w in weights], grads[::-1]):
        member.start(loose).wait()
        assert summed[-1].data_ptr() not in {t.data_ptr() for t in loose}
        assert all(torch.equal(grad, weight) for grad, weight in zip(sorted(loose, key=len), sorted(weights, key=len)))
    assert bucket([torch.zeros(2), torch.zeros(2, dtype=torch.float64)]) is None


def test_a_reduced_stage_zeroes_a_bucket_made_before_in_place_where_each_mini_batch_made_a_new_one(monkeypatch):
    """Two buckets a stage replica, made once: mini-batch b + 2 accumulates in b's buffer, zeroed in place before
    its first backward (b + 1's is the last update's gradient, on the weights' `.grad`), and training is one
    process's still."""
    reduced: dict[int, list[torch.Tensor]] = {}  # id of a rank's member -> the buffers it all-reduced, in order
    zeroed = []  # per reused buffer: (held a gradient before, all zero after)

    def start(member, n, tensors):
        reduced.setdefault(id(member), []).append(replicas.flat_buffer(tensors))  # held: no address is reused
        return started(member, n, tensors)

    def made(weights, flat=None):
        before = None if flat is None else bool(flat.any())
        views = bucketed(weights, flat)
        if flat is not None:
            zeroed.append((before, all(not v.any() for v in views) and views[0].data_ptr() == flat.data_ptr()))
        return views
    started, bucketed = replicas.ThreadReplicas._start, weights_module.bucket
    monkeypatch.setattr(replicas.ThreadReplicas, "_start", start)
    monkeypatch.setattr(weights_module, "bucket", made)
    spec = dp_spec("1f1b", 2, n=4)
    assert_every_replica_is(run_in_process(spec), spec, single_process(whole(spec)))
    assert len(reduced) == 2 * D
    for flats in reduced.values():
        ptrs = [flat.data_ptr() for flat in flats]
        assert len(ptrs) == 4 and ptrs[2] == ptrs[0] and ptrs[3] == ptrs[1] and ptrs[0] != ptrs[1]
    assert zeroed == [(True, True)] * (2 * 2 * D)


def test_a_new_bucket_leaves_the_last_updates_gradient_that_plain_sgds_prediction_reads(monkeypatch):
    """SpecTrain with plain SGD predicts from the weights' `.grad`, the last update's gradient, after the next
    mini-batch's first backward: the bucket zeroed for that backward is never the one `.grad` holds."""
    kept = []  # per bucket started after an update: the last update's gradient is as it was

    def start(state):
        last = [None if w.grad is None else w.grad.clone() for w in state.owned]
        started(state)
        if None not in last:
            kept.append(all(torch.equal(w.grad, g) and g.any() for w, g in zip(state.owned, last)))
    started = weights_module.StageWeights.start_bucket
    monkeypatch.setattr(weights_module.StageWeights, "start_bucket", start)
    spec = dp_spec("spectrain", 2, n=4)
    assert [a.kind for a in spec.schedule.orders[0]].count(Kind.PRED) > 0
    run_in_process(spec)
    assert kept == [True] * (2 * 3 * D)


def test_pipedream_with_two_replicas_stashes_as_with_one_and_averages_each_update():
    """An asynchronous method runs too: each replica reads the versions PipeDream's rule names for its own
    micro-batch j, and every update applies the mean gradient of both replicas' micro-batches."""
    spec = dp_spec("pipedream", 2, n=4)
    p, m = 2, 2

    def reads(k: int, b: int, j: int):
        v = forward_version(p, m, k, b, j % m)  # replica j // m's micro-batch j % m
        return (v, 0), (v, 0)

    reference = Reference(whole(spec))
    reference.train(reads)
    assert_every_replica_is(run_in_process(spec), spec, reference.flat())


def test_a_failing_replica_stops_the_run_naming_its_rank():
    spec = replace(dp_spec("1f1b", 2), lr=1e30, optimizer="sgd")
    with pytest.raises(ExecutorError, match=r"rank \d \(device 1, replica \d\): DivergedError"):
        run_in_process(spec)


@pytest.mark.parametrize("zero", [1, 3])
def test_a_sharded_optimizer_is_refused_in_one_line(zero):
    spec = replace(dp_spec("1f1b", 2), schedule=build("1f1b", 2, 2, 1, data_parallel=2, zero=zero))
    with pytest.raises(ExecutorError, match=rf"does not run a sharded optimizer \(ZeRO-{zero}: .*without --zero$"):
        run_in_process(spec)


@pytest.mark.slow
def test_two_replicas_of_two_gloo_ranks_train_as_one_process():
    """The real thing: 4 processes, a gloo group per device's replicas."""
    spec = dp_spec("1f1b", 2, optimizer="adam")
    result = run_multiprocess(spec, timeout_s=120)
    assert result.trace.meta.hardware["backend"] == "gloo" and result.trace.meta.hardware["ranks"] == 4
    assert_every_replica_is(result, spec, single_process(whole(spec)))


def test_torchrun_must_start_a_rank_per_device_and_replica():
    with pytest.raises(ExecutorError, match=r"runs on 2 devices x 2 data-parallel replicas: start 4 ranks"):
        run_torchrun(dp_spec("1f1b", 2), TorchrunEnv(rank=0, world_size=2, local_rank=0, local_world_size=2))


def test_run_refuses_a_data_parallel_degree_below_one(tmp_path):
    code, _, err = pipesim("run", "-s", "1f1b", "--model", "mlp", "--data-parallel", 0, "--trace",
                           tmp_path / "t.json")
    assert code == 2 and "--data-parallel" in err
    assert not (tmp_path / "t.json").exists()


def test_run_numbers_its_ranks_in_the_order_given_and_traces_them_by_place(tmp_path):
    """`run --rank-order megatron`: a stage's two replicas on consecutive ranks (0-1, 2-3), the pipeline's transfers
    between the pairs; the trace names each rank by its place (replica x p + device), so the page reads it as
    pipesim's order's, and it trains as that order does. A misspelt order is one line naming the choices."""
    traces = {}
    for order in ("pipesim", "megatron"):
        traces[order] = tmp_path / f"{order}.json"
        code, out, err = pipesim("run", "-s", "1f1b", "--model", "mlp", "-m", 2, "-n", 2, "--data-parallel", 2,
                                 "--rank-order", order, "--no-heldout", "--trace", traces[order])
        assert code == 0 and ("Megatron-core's rank order" in " ".join(out.split())) == (order == "megatron"), err
    pipesim_order, megatron = (read_trace(traces[order]).meta.extra for order in ("pipesim", "megatron"))
    assert pipesim_order["device_ranks"] == [0, 1, 2, 3] and megatron["device_ranks"] == [0, 2, 1, 3]
    assert megatron["rank_order"] == "megatron" and megatron["losses"] == pipesim_order["losses"]
    code, out, err = pipesim("view", traces["megatron"], "--html", tmp_path / "page.html")
    assert code == 0 and "replica 1 \\u00b7 device 0" in (tmp_path / "page.html").read_text(), err  # JSON-escaped
    code, _, err = pipesim("run", "-s", "1f1b", "--model", "mlp", "--data-parallel", 2, "--rank-order", "megatorn",
                           "--trace", tmp_path / "bad.json")
    assert code == 2 and err.strip().splitlines() == [
        "error: --rank-order: choose from pipesim, megatron (got 'megatorn')"], err
    assert not (tmp_path / "bad.json").exists()
