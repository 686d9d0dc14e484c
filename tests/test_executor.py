"""The executor trains for real: synchronous methods match single-process training, asynchronous ones match
an independent reference that applies their weight-version rule, the trace carries the lowering's versions,
and a split backward (I then W) gives what a full one (B) gives."""

from __future__ import annotations

import collections
import re
import time
from collections.abc import Callable
from dataclasses import replace
from functools import partial

import numpy as np
import pytest
import torch
from torch import nn
from torch.func import functional_call
from torch.utils._python_dispatch import TorchDispatchMode

from pipesim.executor import (
    DivergedError,
    ExecutorError,
    RunSpec,
    backward_input,
    backward_weight,
    cut,
    even_bounds,
    full_backward,
    microbatch_data,
    run_in_process,
    run_multiprocess,
)
from pipesim.executor.stages import check_bounds
from pipesim.executor.weights import StageWeights, average_replicas
from pipesim.schedules import ScheduleParams, build_schedule, lower
from pipesim.traces.trace import Stream, read_trace, write_trace
from pipesim.workload.models import Model, gpt, mlp
from pipesim.workload.optim import make_optimizer
from tests.helpers import assert_same, pipeline_weights, spec_for
from tests.helpers import plain_training as single_process


def versioned_reference(spec: RunSpec, read) -> list[torch.Tensor]:
    """Asynchronous weight semantics applied mini-batch by mini-batch, without any pipeline: stage k's forward
    and backward of micro-batch j of mini-batch b both run on stage k's version `read(k, b, j)` (version v =
    the weights after v updates); after mini-batch b every stage applies its optimizer, on its newest weights,
    to the gradients summed over b's micro-batches."""
    model = spec.build_model()
    schedule = spec.schedule
    p, m = schedule.num_stages, schedule.microbatches
    bounds = even_bounds(len(model.layers), p)
    modules = [nn.Sequential(*model.layers[bounds[k]:bounds[k + 1]]) for k in range(p)]
    names = [[name for name, _ in mod.named_parameters()] for mod in modules]
    newest = [[w.detach().clone() for w in mod.parameters()] for mod in modules]
    optimizers = [make_optimizer(spec.optimizer, ws, spec.lr) for ws in newest]
    history = [[[w.clone() for w in ws]] for ws in newest]  # history[k][v]
    for b in range(schedule.minibatches):
        sums = [[torch.zeros_like(w) for w in ws] for ws in newest]
        for j in range(m):
            x, target = microbatch_data(spec, model, b, j)
            used = [[w.clone().requires_grad_(True) for w in history[k][read(k, b, j)]] for k in range(p)]
            for k in range(p):
                x = functional_call(modules[k], dict(zip(names[k], used[k])), (x,))
            loss = model.loss(x, target) / m
            grads = torch.autograd.grad(loss, [w for ws in used for w in ws])
            flat = iter(grads)
            for k in range(p):
                for acc in sums[k]:
                    acc.add_(next(flat))
        for k in range(p):
            for w, g in zip(newest[k], sums[k]):
                w.grad = g
            optimizers[k].step()
            history[k].append([w.detach().clone() for w in newest[k]])
    return [w for ws in newest for w in ws]


SYNCHRONOUS = [("gpipe", 2, 1), ("1f1b", 2, 1), ("interleaved-1f1b", 2, 2), ("zb-h1", 2, 1), ("zb-h2", 2, 1),
               ("zb-v", 2, 2), ("dualpipev", 2, 2), ("1f1b", 4, 1), ("zb-h2", 4, 1), ("interleaved-1f1b", 4, 2),
               ("zb-v", 4, 2), ("dualpipev", 4, 2)]


@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
@pytest.mark.parametrize("method,stages,chunks", SYNCHRONOUS)
def test_synchronous_methods_train_exactly_like_one_process(method, stages, chunks, optimizer):
    m = 8 if stages == 4 else 4
    spec = spec_for(method, stages=stages, chunks=chunks, m=m, n=2 if stages == 4 else 3, optimizer=optimizer)
    result = run_in_process(spec)
    want, losses = single_process(spec)
    assert_same(pipeline_weights(result, spec.schedule.num_stages), want)
    np.testing.assert_allclose(result.losses[0], losses, rtol=1e-6)  # the loss itself is taken in float32


def test_interleaved_with_a_microbatch_group_trains_exactly_like_one_process():
    """m = 5 on p = 2, v = 2 runs only with a group of 3 (the last group 2, at least p): Megatron-core's order."""
    spec = replace(spec_for("interleaved-1f1b", chunks=2, m=4, n=2),
                   schedule=build_schedule("interleaved-1f1b", ScheduleParams(2, 5, 2, chunks=2, microbatch_group=3)))
    result = run_in_process(spec)
    want, losses = single_process(spec)
    assert_same(pipeline_weights(result, 4), want)
    np.testing.assert_allclose(result.losses[0], losses, rtol=1e-6)


@pytest.mark.parametrize("method, bounds", [("interleaved-1f1b", [0, 3, 4, 4, 8]), ("zb-v", [0, 3, 3, 5, 8])])
def test_an_empty_stage_passes_its_input_on_and_trains_exactly_like_one_process(method, bounds):
    """A layout's empty stage (interleaved's stage 2 on device 0; zb-v's stage 1, on device 1 in the V): its rank
    clones what it receives, sends it on and passes the gradient back."""
    spec = replace(spec_for(method, chunks=2, m=4, n=2, optimizer="adam"), bounds=tuple(bounds))
    result = run_in_process(spec)
    want, losses = single_process(spec)
    assert_same(pipeline_weights(result, 4), want)
    np.testing.assert_allclose(result.losses[0], losses, rtol=1e-6)


@pytest.mark.parametrize("bounds", [[0, 0, 3, 7], [0, 3, 7, 7], [0, 4, 3, 7]])
def test_the_first_and_last_stages_hold_a_layer_and_bounds_never_fall(bounds):
    with pytest.raises(ExecutorError, match="the first and last stages holding at least one layer"):
        check_bounds(bounds, 7, 3)


def test_the_trace_carries_the_lowerings_versions_and_the_copies_held():
    for method in ("pipedream", "pipedream-2bw", "zb-v"):
        spec = spec_for(method, chunks=2 if method == "zb-v" else 1, m=2, n=4)
        trace = run_in_process(spec).trace
        lowered = lower(spec.schedule)
        assert trace.meta.source == "measured" and trace.meta.schedule == method
        np.testing.assert_array_equal(trace.ops.version, lowered.version)
        np.testing.assert_array_equal(trace.ops.prediction, lowered.prediction)
        assert (trace.ops.dur_us >= 0).all() and (trace.ops.start_us >= 0).all()
        for d, counter in enumerate(trace.counters["weight_versions"]):
            rows = lowered.rows(d)
            compute = lowered.is_compute[rows.start:rows.stop]
            # what the device really held after each compute row = what the lowering says it must hold
            np.testing.assert_array_equal(counter.values[1:][compute], lowered.held_after[rows][compute])
        assert np.isfinite(trace.meta.extra["losses"][0]).all()


def test_the_trace_times_each_send_by_the_cpu_it_took_its_rank(tmp_path):
    """A SEND row's wall time also holds the time its thread was descheduled or blocked (on a loaded host,
    most of it); its op's `cpu_us` is what posting it cost the rank, no more than the row, kept through the
    trace's file; no other op is timed so."""
    trace = run_in_process(spec_for("1f1b", m=4, n=2)).trace
    sends = trace.ops.stream == Stream.SEND
    cpu_us = trace.ops.cpu_us
    assert sends.sum() > 0 and (cpu_us[sends] >= 0).all() and (cpu_us[~sends] == -1).all()
    assert (cpu_us[sends] <= trace.ops.dur_us[sends] + 1).all()
    write_trace(trace, tmp_path / "run.json")
    assert np.array_equal(read_trace(tmp_path / "run.json").ops.cpu_us, cpu_us)


def pipedream_paper_version(p: int):
    """PipeDream (one micro-batch per mini-batch): stage k's forward of mini-batch b runs on the newest
    weights, which have seen the updates of mini-batches 0 .. b-(p-k), i.e. staleness p-1-k; its backward runs
    on the version stashed at that forward."""
    return lambda k, b, j: max(0, b - (p - 1 - k))


@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
@pytest.mark.parametrize("stages", [2, 3])
def test_pipedream_weight_stashing_matches_the_papers_version_rule(stages, optimizer):
    spec = spec_for("pipedream", stages=stages, m=1, n=6, optimizer=optimizer)
    got = pipeline_weights(run_in_process(spec), stages)
    assert_same(got, versioned_reference(spec, pipedream_paper_version(stages)))
    # and stashing matters: training as if synchronous gives other weights
    sync = versioned_reference(spec, lambda k, b, j: b)
    assert any(not torch.allclose(a, s) for a, s in zip(got, sync))


@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
@pytest.mark.parametrize("stages,m", [(2, 2), (2, 4), (3, 3)])
def test_pipedream_2bw_double_buffer_reads_the_previous_minibatchs_weights(stages, m, optimizer):
    spec = spec_for("pipedream-2bw", stages=stages, m=m, n=5, optimizer=optimizer)
    got = pipeline_weights(run_in_process(spec), stages)
    assert_same(got, versioned_reference(spec, lambda k, b, j: max(0, b - 1)))  # W(b-1) for every op of b


def test_pipedream_with_several_microbatches_follows_the_latest_at_each_forward():
    """With m > 1 the newest version changes inside a mini-batch; the reference reads, per forward, the number
    of the stage's updates that completed before it (counted from the stage's own order), stashed for B."""
    spec = spec_for("pipedream", stages=2, m=2, n=4)
    schedule = spec.schedule
    reads = {}
    for d, order in enumerate(schedule.orders):
        updates = {}
        for action in order:
            if action.kind.value == "OPT":
                updates[action.stage] = updates.get(action.stage, 0) + 1
            elif action.kind.value == "F":
                reads[(action.stage, action.minibatch, action.microbatch)] = updates.get(action.stage, 0)
    got = pipeline_weights(run_in_process(spec), 2)
    assert_same(got, versioned_reference(spec, lambda k, b, j: reads[(k, b, j)]))


# --------------------------------------------------------------------------------------------- split backward


def _stage_and_input(which: str):
    torch.manual_seed(1)
    if which == "mlp":
        module = nn.Sequential(*mlp(4, 16).layers[:4]).double()
        x = torch.randn(8, 64, dtype=torch.float64)
    else:
        module = nn.Sequential(*gpt(2, 32, 4, 8, 50).layers[1:3]).double()
        x = torch.randn(2, 8, 32, dtype=torch.float64)
    names = [name for name, _ in module.named_parameters()]
    weights = [p.detach().clone().requires_grad_(True) for p in module.parameters()]

    def forward():
        leaf = x.clone().requires_grad_(True)
        return leaf, functional_call(module, dict(zip(names, weights)), (leaf,))
    return forward, weights


def test_backward_adds_into_the_gradient_buffer_in_place():
    """B and W add into the buffer's own tensors (no second copy of a stage's gradients) and leave the weights'
    `.grad` (the last update's gradient, which SGD's prediction reads) as it was."""
    forward, weights = _stage_and_input("mlp")
    last = [torch.full_like(w, 7.0) for w in weights]
    for w, g in zip(weights, last):
        w.grad = g
    buffer, expected = [None] * len(weights), []
    for _ in range(2):
        x, out = forward()
        grad = torch.randn_like(out)
        expected.append(torch.autograd.grad(out, weights, grad, retain_graph=True))
        first = list(buffer)  # after the first pass: the tensors the second must add into
        full_backward([out], [grad], [x], weights, buffer)
    assert all(b is f for b, f in zip(buffer, first)), "the second backward must add into the first one's tensors"
    assert_same(buffer, [a + b for a, b in zip(*expected)])
    assert all(w.grad is g for w, g in zip(weights, last))

    x, out = forward()
    _, pending = backward_input([out], [torch.ones_like(out)], [x], weights)
    split = [b.clone() for b in buffer]
    backward_weight(pending, weights, buffer)
    assert all(b is f for b, f in zip(buffer, first))
    added = torch.autograd.grad(forward()[1], weights, torch.ones_like(out))
    assert_same(buffer, [s + g for s, g in zip(split, added)])


@pytest.mark.parametrize("which", ["mlp", "gpt"])
def test_input_then_weight_gradient_equals_a_full_backward(which):
    forward, weights = _stage_and_input(which)
    x, out = forward()
    grad = torch.randn_like(out)
    dw = [None] * len(weights)
    (dx,) = full_backward([out], [grad], [x], weights, dw)
    x, out = forward()
    (dx_split,), pending = backward_input([out], [grad], [x], weights)
    assert pending.groups, "the split must start W from I's anchors, not from the output"
    del out, x
    dw_split = [None] * len(weights)
    backward_weight(pending, weights, dw_split)
    assert_same([dx_split, *dw_split], [dx, *dw])


def _matmuls(fn) -> int:
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        fn()
    return sum(e.count for e in prof.key_averages() if e.key in ("aten::mm", "aten::addmm", "aten::bmm"))


def test_split_backward_does_not_recompute_the_input_chain():
    """I runs only the input-gradient products and W only the weight-gradient ones: I + W do B's matrix
    products, no more. Prints (I + W) / B for a 4-layer MLP stage, one thread; asserts nothing about time."""
    torch.manual_seed(0)
    module = nn.Sequential(*mlp(5, 512).layers[1:5])  # four width x width blocks (the first reads 64 features)
    names = [name for name, _ in module.named_parameters()]
    weights = [p.detach().clone().requires_grad_(True) for p in module.parameters()]
    x0, grad = torch.randn(64, 512), torch.randn(64, 512)

    def forward():
        x = x0.clone().requires_grad_(True)
        return x, functional_call(module, dict(zip(names, weights)), (x,))

    dw = [None] * len(weights)  # the gradient buffer every pass below adds into
    x, y = forward()
    b_products = _matmuls(partial(full_backward, [y], [grad], [x], weights, dw))
    x, y = forward()
    held = {}
    i_products = _matmuls(partial(lambda y, x: held.update(pending=backward_input([y], [grad], [x], weights)[1]), y, x))
    y = None
    w_products = _matmuls(lambda: backward_weight(held["pending"], weights, dw))
    assert (i_products, w_products, b_products) == (4, 4, 8)

    def time_b():
        x, out = forward()
        t = time.perf_counter()
        full_backward([out], [grad], [x], weights, dw)
        return time.perf_counter() - t

    def time_iw():
        x, out = forward()
        t = time.perf_counter()
        _, pending = backward_input([out], [grad], [x], weights)
        del out
        backward_weight(pending, weights, dw)
        return time.perf_counter() - t

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for _ in range(3):
            time_b(), time_iw()
        b = float(np.median([time_b() for _ in range(15)]))
        iw = float(np.median([time_iw() for _ in range(15)]))
    finally:
        torch.set_num_threads(threads)
    print(f"\nsplit backward: B {b * 1e3:.2f} ms, I + W {iw * 1e3:.2f} ms, (I + W) / B = {iw / b:.2f}")


@pytest.mark.parametrize("dtype", ["float64", "bfloat16"])
def test_zero_bubble_split_gives_the_same_weights_as_full_backward(dtype):
    """In bfloat16 too, where W adds its 16-bit gradients into the float32 main gradients as B does."""
    split = run_in_process(spec_for("zb-h1", m=4, n=2, optimizer="adam", dtype=dtype))
    full = run_in_process(spec_for("1f1b", m=4, n=2, optimizer="adam", dtype=dtype))
    assert_same(pipeline_weights(split, 2), pipeline_weights(full, 2))


def test_a_bfloat16_run_learns_as_float32_does():
    """A bfloat16 run trains with float32 master weights and main gradients: its loss falls as float32's does. The
    executor once updated the 16-bit weights in place, and each update smaller than their resolution was lost: the
    gpt below, in bfloat16, went 5.690 -> 5.623 over 20 steps where float32 went to 5.594 (bfloat16 now to 5.595).
    A vocabulary of 256 and sequences of 32 tokens, at lr 0.01 so that most updates fall below that resolution: a
    CPU without bfloat16 products runs the default gpt's (2,048 words, 128 tokens) several times slower."""
    def run(dtype: str) -> tuple[list[float], list[torch.Tensor]]:
        schedule = build_schedule("1f1b", ScheduleParams(stages=2, microbatches=4, minibatches=20))
        result = run_in_process(RunSpec(schedule, "gpt", {"layers": 2, "width": 128, "vocab": 256, "seq_len": 32},
                                        microbatch_size=4, lr=0.01, dtype=dtype, heldout=False))
        return result.losses[0], result.weights[(0, 0)]
    (first, *_, last), weights = run("bfloat16")
    (first_32, *_, last_32), _ = run("float32")
    learnt = first_32 - last_32
    assert learnt > 0.01
    assert first - last > 0.9 * learnt
    assert abs(last - last_32) < 0.05 * learnt
    assert all(w.dtype == torch.float32 for w in weights)  # the trained weights are the float32 masters


def _stepped(dtype: torch.dtype, optimizer: str, device: str = "cpu") -> StageWeights:
    """A stage of four equal layers in `dtype` after one update, with the next mini-batch's gradients added."""
    torch.manual_seed(0)
    state = StageWeights(nn.Sequential(*(nn.Linear(64, 64) for _ in range(4))).to(dtype), optimizer, 0.1,
                         label="stage 0", device=device)
    state.grads = [torch.randn_like(w) for w in state.owned]
    state.step(False)
    state.grads = [torch.randn_like(w) for w in state.owned]
    return state


class _Ops(TorchDispatchMode):
    """The aten ops run inside it, counted."""

    def __enter__(self):
        self.ops = collections.Counter()
        return super().__enter__()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[func] += 1
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("optimizer", ["momentum", "adam"])
def test_a_copy_on_write_update_adds_to_one_in_place_the_copy_calibration_times(dtype, optimizer):
    """The simulator prices a copy-on-write OPT as the in-place update (calibration's `step`) plus the profile's
    `weight_copy` (`StageWeights.fresh_copies`): the update runs exactly their ops, and makes the same weights. In
    16 bits the in-place update casts the stepped masters into the newest version; a copy-on-write one casts them
    into new tensors instead, once: it used to cast them afresh where the copy timed a cast too (one cast of the
    stage's weights counted twice at each pipedream and 2BW OPT)."""
    in_place, copy_on_write, copied = _stepped(dtype, optimizer), _stepped(dtype, optimizer), _stepped(dtype, optimizer)
    with _Ops() as step:
        in_place.step(False)
    with _Ops() as step_keeping:
        copy_on_write.step(True)
    with _Ops() as copy:
        copied.fresh_copies()
    assert step_keeping.ops == step.ops + copy.ops
    assert all(torch.equal(a, b) for a, b in zip(copy_on_write.current, in_place.current))
    assert copy_on_write.versions[1] is not copy_on_write.current and len(copy_on_write.versions) == 2


def _allocated_bytes(run: Callable[[], object], device: str) -> tuple[int, int]:
    """What `run` allocated on `device` and holds at its peak, and at its end: on CUDA the allocator's counters, on
    the CPU the profiler's record of each allocation and free, in order."""
    if device == "cuda":
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        run()
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - before, torch.cuda.memory_allocated() - before
    held = np.cumsum([0, *_cpu_memory_changes(run)])
    return int(held.max()), int(held[-1])


def _cpu_memory_changes(run: Callable[[], object]) -> list[int]:
    """The bytes of each allocation (+) and free (-) `run` made on the CPU, in order: the profiler's record. A free of
    a block made before `run` shows too where an earlier profile saw it made (the profiler keeps the sizes it saw by
    address, and glibc hands the address out again), so only the allocations are `run`'s own for certain."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as profiler:
        run()
    return [nbytes for _, nbytes in sorted((e.start_ns(), e.nbytes()) for e in profiler.profiler.kineto_results.events()
                                           if e.name() == "[memory]")]


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU"))])
@pytest.mark.parametrize("optimizer", ["momentum", "adam"])
def test_a_16_bit_prediction_holds_one_tensors_float32_transient(optimizer, device):
    """A PRED in 16 bits extrapolates the float32 masters and keeps the prediction in 16 bits, which the simulator
    prices (one 16-bit copy of the weights). It predicts and casts tensor by tensor, so what it holds beyond that copy
    at its peak is one tensor's float32 prediction and Adam's float32 denominator. Predicting all the masters before
    casting held twice the 16-bit weights' bytes beyond them (Adam's denominators twice more): 3-5x what is priced.
    The CPU runs' memory, counted from the tensors the executor holds, cannot see it; a GPU's allocator does."""
    state = _stepped(torch.bfloat16, optimizer, device)
    largest = max(m.nbytes for m in state.masters)
    peak, end = _allocated_bytes(lambda: state.predict((state.version, 2, "F")), device)
    predicted = state.read_predicted((state.version, 2, "F")).tensors
    assert sum(w.nbytes for w in state.masters) >= 4 * largest
    assert end >= sum(p.nbytes for p in predicted)  # the allocations were seen
    assert peak - end < 3 * largest  # two float32 tensors at most, and room for the allocator's rounding
    assert all(p.dtype == torch.bfloat16 for p in predicted)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("optimizer", ["momentum", "adam"])
def test_weight_ops_run_on_kept_tensors_once_a_first_round_made_them(dtype, optimizer):
    """A prediction, a copy-on-write update's copies, elastic averaging and an update take their tensors from the
    replica's spares and give them back when done (workload/optim.py `Spares`), so after a first round they allocate
    nothing on CPU: glibc gave a freshly allocated 4.3 MB prediction 1.2-1.7 ms on fresh pages and 0.2-0.3 on reused
    heap, and calibration, which times these ops so, caught either."""
    state = _stepped(dtype, optimizer)
    reference = [w.detach().clone() for w in state.owned]

    def one_round() -> None:
        key = (state.version, 2, "F")
        state.predict(key)
        state.free_predicted(key)
        state.spares.give(state.fresh_copies())
        average_replicas([state], reference, 0.5)
        state.step(False)

    grads = [g.clone() for g in state.grads]  # the next round's, made before it
    one_round()
    state.grads = grads
    made = [nbytes for nbytes in _cpu_memory_changes(one_round) if nbytes > 0]
    assert max(made, default=0) < min(w.nbytes for w in state.current)  # a scalar's few bytes, no weight's


# ---------------------------------------------------------------------------------------------- bad input


def test_more_stages_than_layers_and_bad_bounds_fail_clearly():
    spec = spec_for("1f1b", stages=4, m=4, n=1, layers=2)
    with pytest.raises(ExecutorError, match="cannot cut 3 layers into 4 stages"):
        run_in_process(spec)
    with pytest.raises(ExecutorError, match="bounds"):
        cut(RunSpec(spec_for("1f1b").schedule, "mlp", {"layers": 3, "width": 16}, bounds=(0, 4, 4)))


def test_a_device_that_fails_stops_the_others_and_is_named_alone():
    """The last stage diverges; the devices waiting on it stop at once (their timeout would be 10 minutes),
    and the error is the cause, not their abandoned receives."""
    spec = replace(spec_for("1f1b", stages=2, m=2, n=50, layers=3, lr=1e9), timeout_s=600)
    with pytest.raises(DivergedError) as caught:
        run_in_process(spec)
    assert str(caught.value).startswith("device 1: DivergedError: loss is") and "abandoned" not in str(caught.value)
    # it keeps the losses of the mini-batches finished before it: those a run stopped there measures
    diverged_at = int(re.search(r"at mini-batch (\d+)", str(caught.value))[1])
    assert diverged_at >= 1 and len(caught.value.losses) == 1 and len(caught.value.losses[0]) == diverged_at
    before = run_in_process(replace(spec_for("1f1b", stages=2, m=2, n=diverged_at, layers=3, lr=1e9), timeout_s=600))
    assert caught.value.losses == before.losses


# ---------------------------------------------------------------------------------------------- real ranks


@pytest.mark.slow
def test_two_gloo_ranks_match_the_in_process_run():
    """A stashing order over real ranks (synchronous orders: auto's tests in test_executor_methods and test_run)."""
    spec = spec_for("pipedream", m=2, n=3, optimizer="adam", dtype="float32", lr=0.01)
    spec = RunSpec(**{**spec.__dict__, "timeout_s": 60.0})
    real = run_multiprocess(spec, timeout_s=120)
    local = run_in_process(spec)
    assert_same(pipeline_weights(real, 2), pipeline_weights(local, 2), rtol=1.3e-6, atol=1e-5)
    np.testing.assert_allclose(real.losses[0], local.losses[0], rtol=1e-5)
    assert real.trace.meta.hardware["backend"] == "gloo"
    np.testing.assert_array_equal(real.trace.ops.version, lower(spec.schedule).version)


def test_the_held_out_set_is_scored_in_chunks_that_bound_its_outputs(monkeypatch):
    """A held-out set whose outputs pass HELDOUT_CHUNK_ELEMENTS is scored in chunks of samples, each weighted by its
    samples, as the whole set in one forward scores it (the GPU check's GPT made 34 GB of logits at once, and its
    scoring took the run's parent minutes on a CPU: it now scores on the run's device)."""
    from pipesim.executor import stages

    spec = replace(spec_for("1f1b", n=1, layers=2), heldout=True)
    trained = run_in_process(spec)
    whole = trained.trace.meta.extra["heldout"]
    assert whole == stages.heldout_scores(spec, trained.weights, device="cpu")
    monkeypatch.setattr(stages, "HELDOUT_CHUNK_ELEMENTS", 7 * 10)  # 7 samples of 10 logits: 52 chunks of 360
    scored, score = [], Model.score

    def counted(model, output, target):
        scored.append(output.numel())
        return score(model, output, target)

    monkeypatch.setattr(Model, "score", counted)
    chunked = stages.heldout_scores(spec, trained.weights)
    assert len(scored) == 52 and max(scored) == 70 and sum(scored) == 10 * 360  # each chunk's outputs bounded
    assert chunked.keys() == whole.keys() == {"loss", "accuracy"}
    assert chunked == pytest.approx(whole, rel=1e-6)  # the loss is float32 whatever the model's dtype
    # where the whole model does not fit on the run's device (a GPU), the CPU scores it after the run
    cut = stages.cut

    def fits_on_cpu(spec, model=None, outputs=None):
        if next(model.layers[0].parameters()).device.type != "cpu":
            raise torch.cuda.OutOfMemoryError("CUDA out of memory")
        return cut(spec, model, outputs)

    monkeypatch.setattr(stages, "cut", fits_on_cpu)
    monkeypatch.delattr(torch, "OutOfMemoryError", raising=False)  # as torch < 2.5, which pyproject.toml allows
    assert stages.heldout_scores(spec, trained.weights, device="meta") == chunked


def test_a_cut_given_its_layers_outputs_runs_no_forward():
    """A spawned rank cuts the model with the layers' outputs its parent's cut found (`Stages.outputs`), not by a
    forward of the whole model on its one CPU thread (the GPU check's GPT: tens of seconds a rank)."""
    spec = spec_for("1f1b", stages=3)
    found = cut(spec)
    model = spec.build_model()

    def refuse(*_):
        raise AssertionError("a forward")

    for layer in model.layers:
        layer.register_forward_pre_hook(refuse)
    again = cut(spec, model, outputs=found.outputs)
    assert again.edge_shapes == found.edge_shapes and again.edge_dtypes == found.edge_dtypes
    with pytest.raises(AssertionError, match="a forward"):
        cut(spec, model)


def test_a_rows_memory_on_a_gpu_is_one_read_of_the_allocators_counters(monkeypatch):
    """On CUDA a row's memory and peak are the caching allocator's allocated bytes, now and at their peak, as
    torch.cuda.memory_allocated and max_memory_allocated give them; read as one nested dict, since each of those
    flattens and sorts all the allocator's counters in Python (memory_stats), twice a row."""
    from types import SimpleNamespace

    from pipesim.executor.runtime import DeviceLoop

    pools = ("all", "large_pool", "small_pool")
    nested = {name: {pool: {"current": 3 * n + 1, "peak": 5 * n + 2, "allocated": 1, "freed": 0} for pool in pools}
              for n, name in enumerate(("allocation", "allocated_bytes", "reserved_bytes", "active_bytes"))}
    monkeypatch.setattr(torch.cuda.memory, "memory_stats_as_nested_dict", lambda device=None: nested)
    want = (torch.cuda.memory_allocated(0), torch.cuda.max_memory_allocated(0))  # torch's reading of the same counters
    assert want == (4, 7)

    def flattened(device=None):
        raise AssertionError("every counter flattened")

    monkeypatch.setattr(torch.cuda.memory, "memory_stats", flattened)
    monkeypatch.setattr(torch.cuda, "memory_stats_as_nested_dict", lambda device=None: nested)
    loop = SimpleNamespace(on_cuda=True, torch_device=torch.device("cuda", 0))
    assert DeviceLoop._memory(loop, {}, 0, 0) == (*want, 0)  # no sends in flight counted on CUDA
