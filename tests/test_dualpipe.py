"""DualPipe's overlapped F&B pair in the executor, and the bidirectional DualPipe.

A pair runs as its two parts: on CPU one after the other, on a GPU on two CUDA streams (executor/overlap.py). The
measured trace records each part as its own op naming the other's stage (`peer`), as the simulated trace does, so
`pipesim compare` times the pair as one F&B op, the union of its parts. DualPipe (two model copies fed from both
ends of the devices) runs the order of the DualPipe repository's figure and trains as one process.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch

from pipesim.executor import DeviceLoop, ExecutorError, RunSpec, cut, run_in_process, run_multiprocess
from pipesim.executor.overlap import PairStreams
from pipesim.executor.replicas import Layout
from pipesim.schedules import (
    KINDS,
    Kind,
    ScheduleError,
    ScheduleParams,
    StageGraph,
    build_schedule,
    check_complete,
    lower,
)
from pipesim.schedules.analysis import overlapped_pairs
from pipesim.schedules.ir import order_tokens, parse_token
from pipesim.sim import Cluster, Costs, simulate
from pipesim.traces.compare import compare
from pipesim.workload.transport import InProcessTransport
from tests.helpers import assert_same, device_loops, dp_spec, pair_parts, pipeline_weights, run_loops, spec_for
from tests.helpers import in_one_process as whole
from tests.helpers import plain_training as single_process
from tests.reference import initial_model
from tests.reference import single_process as reference_single_process


@pytest.mark.slow
def test_dualpipev_on_two_gloo_ranks_trains_like_one_process_and_records_its_pairs():
    """Every pair's parts run, in the order the IR gives them (forward, then backward, on one rank), the weights
    are single-process training's, and the measured pairs match the simulated ones op by op."""
    spec = spec_for("dualpipev", stages=2, chunks=2, m=4, n=2)
    real = run_multiprocess(spec, timeout_s=120)
    want, losses = single_process(spec)
    assert_same(pipeline_weights(real, spec.schedule.num_stages), want)
    np.testing.assert_allclose(real.losses[0], losses, rtol=1e-6)

    measured = real.trace
    forward, backward = pair_parts(measured)
    assert len(forward) == len(backward) == overlapped_pairs(spec.schedule) > 0
    t = lower(spec.schedule).table  # the measured ops are the lowering's rows, in order
    assert (t.peer[forward] == t.stage[forward + 1]).all() and (forward + 1 == backward).all()
    ops = measured.ops
    assert (ops.device[forward] == ops.device[backward]).all()
    assert (ops.start_us[backward] >= ops.start_us[forward] + ops.dur_us[forward]).all()  # one after the other

    predicted = simulate(spec.schedule, Costs.per_stage(spec.schedule.num_stages, fwd_ms=1.0, bwd_ms=2.0),
                         Cluster.uniform(2, 0.0))
    result = compare(predicted, measured)
    assert result.matched_ops == len(measured.ops) == len(predicted.ops)
    assert result.missing_in_measured == result.missing_in_predicted == result.version_mismatches == 0
    assert identities(predicted) == identities(measured)


def identities(trace) -> set[tuple[int, ...]]:
    """Each pair part as (device, kind, stage, micro-batch, mini-batch, peer)."""
    rows, ops = np.concatenate(pair_parts(trace)), trace.ops
    return {tuple(int(getattr(ops, c)[i]) for c in ("device", "kind", "stage", "microbatch", "minibatch", "peer"))
            for i in rows}


@pytest.mark.parametrize("stages,m", [(2, 8), (3, 8), (4, 12)])
def test_a_pairs_forward_part_takes_the_stream_its_partners_kernels_do_not_use(stages, m):
    """Planned from the rows alone (here on CPU): the backward part's kernels run where its micro-batch's forward
    ran (the device's stream, or a side stream if that forward was a pair's part), so the forward part takes the
    other side stream, and the backward part is issued on the side the forward part left."""
    lowered = lower(build_schedule("dualpipev", ScheduleParams(stages, m, 2, chunks=2)))
    t = lowered.table
    for device in range(stages):
        plan = PairStreams(lowered, device, torch.device("cpu"))
        assert not plan.on_gpu and not plan.sides
        forward_ran_on: dict[tuple[int, ...], int] = {}  # unit -> side stream of its forward (-1: the device's)
        parts = 0
        for i in lowered.rows(device):
            unit = (int(t.stage[i]), int(t.microbatch[i]), int(t.minibatch[i]))
            if KINDS[t.kind[i]] is Kind.F:
                forward_ran_on[unit] = plan.side.get(i, -1)
            elif KINDS[t.kind[i]] is Kind.B and t.peer[i] >= 0:
                parts += 2
                assert plan.side[i - 1] != forward_ran_on[unit] and plan.side[i] == 1 - plan.side[i - 1]
        rows = lowered.rows(device)
        assert parts == len(plan.side) == int(np.count_nonzero(t.peer[rows][lowered.is_compute[rows]] >= 0))
        assert set(forward_ran_on.values()) == {-1, 0, 1}  # forwards on the device's stream and on both sides


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_on_a_gpu_a_pairs_parts_run_side_by_side_and_train_as_on_cpu():
    """Two devices on the GPU in one process: the weights are single-process training's at fp32 tolerance, and
    some pair's backward part starts before its forward part ends (the parts' kernels large enough to outlast
    issuing the other part's)."""
    spec = RunSpec(build_schedule("dualpipev", ScheduleParams(2, 4, 2, chunks=2)), "mlp",
                   {"layers": 8, "width": 2048}, microbatch_size=512, lr=0.01, seed=3)
    lowered = lower(spec.schedule)
    transports = InProcessTransport.connected(2, device="cuda", timeout_s=120)
    loops = [DeviceLoop(spec, lowered, cut(spec), d, transports[d]) for d in range(2)]
    assert all(loop.pairs.on_gpu for loop in loops)
    results = run_loops(loops)
    want, _ = single_process(spec)
    got = [torch.from_numpy(w) for k in range(spec.schedule.num_stages) for r in results
           for w in r.weights.get((k, 0), [])]
    assert_same(got, want, rtol=1e-4, atol=1e-5)
    overlapped = 0
    for d, result in enumerate(results):
        rows = lowered.rows(d)
        for i in loops[d].pairs.seconds:
            b, f = i - rows.start, i - 1 - rows.start
            overlapped += int(result.start_ns[b] < result.end_ns[f])
    assert overlapped > 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_on_a_gpu_a_pairs_parts_add_bfloat16_gradients_into_float32_main_gradients_as_in_turn():
    """In bfloat16 a hook adds each weight's 16-bit gradient into its float32 main gradient on the stream autograd
    accumulates that weight on (executor/backward.py): with a pair's parts on two streams the update is the one
    with the same parts run in turn on the device's stream, to the order cuBLAS reduces in on several streams;
    a micro-batch's gradient lost, or added before its stream made it, moves it by a quarter or more."""
    spec = RunSpec(build_schedule("dualpipev", ScheduleParams(2, 4, 2, chunks=2)), "mlp",
                   {"layers": 8, "width": 2048}, microbatch_size=512, lr=0.01, seed=3, dtype="bfloat16")
    lowered = lower(spec.schedule)
    start = torch.cat([p.detach().float().reshape(-1) for layer in initial_model(spec).layers
                       for p in layer.parameters()])

    def update(side_by_side: bool) -> torch.Tensor:
        transports = InProcessTransport.connected(2, device="cuda", timeout_s=120)
        loops = [DeviceLoop(spec, lowered, cut(spec), d, transports[d]) for d in range(2)]
        assert all(loop.pairs.on_gpu for loop in loops)
        for loop in loops:
            loop.pairs.on_gpu = side_by_side
        results = run_loops(loops)
        return torch.cat([torch.from_numpy(w).reshape(-1) for k in range(spec.schedule.num_stages)
                          for r in results for w in r.weights.get((k, 0), [])]) - start

    in_turn = update(False)
    assert float(in_turn.norm()) > 0
    assert float((update(True) - in_turn).norm() / in_turn.norm()) < 0.01


# ---------------------------------------------------------------------------------- the bidirectional DualPipe

# deepseek-ai/DualPipe's README figure (images/dualpipe.png: 8 ranks, 20 micro-batches in two directions), rows
# of devices 0, 3, 4 and 7 read off it cell by cell: a forward-direction cell as drawn (F, B, I, W and its
# micro-batch), a reverse-direction cell, whose micro-batch the figure omits, in lower case; two cells in one
# border (an overlapped forward and backward) in parentheses. Idle cells are left out.
FIGURE = {
    0: "F0 F1 F2 F3 F4 F5 F6 f i w f i w f i w f (F7;b) (f;B0) (F8;b) (f;B1) (F9;b) (f;B2) b (f;B3) b (f;B4) b "
       "(f;B5) b I6 W6 I7 W7 I8 W8 I9 W9",
    3: "F0 f F1 f F2 f F3 f F4 b (f;B0) (F5;b) (f;B1) (F6;b) (f;B2) (F7;b) (f;B3) (F8;b) (f;B4) (F9;b) (f;B5) b B6 "
       "b B7 i I8 i I9 w W8 w W9",
    4: "f F0 f F1 f F2 f F3 f B0 (F4;b) (f;B1) (F5;b) (f;B2) (F6;b) (f;B3) (F7;b) (f;B4) (F8;b) (f;B5) (F9;b) B6 "
       "b B7 b I8 i I9 i W8 w W9 w",
    7: "f f f f f f f F0 I0 W0 F1 I1 W1 F2 I2 W2 F3 (f;B3) (F4;b) (f;B4) (F5;b) (f;B5) (F6;b) B6 (F7;b) B7 (F8;b) "
       "B8 (F9;b) B9 i w i w i w i w",
}


def as_figure(schedule, device: int) -> str:
    """A device's order of one mini-batch in the figure's notation: copy 0 (fed from device 0) is the forward
    direction, whose micro-batches 0..m/2-1 it numbers; copy 1's are the reverse direction's."""
    copy_size = schedule.graph.stages_per_copy

    def cell(a) -> str:
        return f"{a.kind.value}{a.microbatch}" if a.stage < copy_size else a.kind.value.lower()

    cells = []
    for token in order_tokens(schedule.orders[device]):
        parts = parse_token(token)
        if parts[0].kind in (Kind.F, Kind.B, Kind.I, Kind.W):
            cells.append(f"({cell(parts[0])};{cell(parts[1])})" if len(parts) == 2 else cell(parts[0]))
    return " ".join(cells)


def test_dualpipe_runs_the_order_of_the_repositorys_figure():
    schedule = build_schedule("dualpipe", ScheduleParams(8, 20, chunks=2))
    assert {d: as_figure(schedule, d) for d in FIGURE} == FIGURE
    # copy 0's stage s on device s, copy 1's on device p-1-s; copy 1 runs micro-batches 10..19
    assert schedule.placement == (0, 1, 2, 3, 4, 5, 6, 7, 7, 6, 5, 4, 3, 2, 1, 0) and schedule.graph.copies == 2
    assert {a.microbatch for a in schedule.orders[0] if a.stage == 15 and a.kind is Kind.F} == set(range(10, 20))


@pytest.mark.parametrize("stages,m", [(3, 12), (4, 6), (4, 9)])
def test_dualpipe_refuses_what_the_repository_asserts_against(stages, m):
    with pytest.raises(ScheduleError, match=r"dualpipe needs an even number of devices and an even number of "
                                            rf"micro-batches, at least 2p .*: got p={stages}, m={m}"):
        build_schedule("dualpipe", ScheduleParams(stages, m, chunks=2))


def test_model_copies_share_the_microbatches_and_hold_their_own_stages():
    """A graph of copies is each copy's edges shifted, none between copies; m splits evenly; a stage runs only its
    copy's micro-batches."""
    assert StageGraph.chain(6, copies=2).edges == ((0, 1), (1, 2), (3, 4), (4, 5))
    with pytest.raises(ScheduleError, match=r"holds copy 0's edges \[\(0, 1\)\] shifted .* no edge between copies"):
        StageGraph(4, ((0, 1), (2, 3), (1, 2)), copies=2)
    with pytest.raises(ScheduleError, match="needs a multiple of 2 stages"):
        StageGraph(3, ((0, 1),), copies=2)
    schedule = build_schedule("dualpipe", ScheduleParams(2, 4, chunks=2))
    assert [schedule.copy_of_microbatch(j) for j in range(4)] == [0, 0, 1, 1]
    with pytest.raises(ScheduleError, match="m must be a multiple of 2"):
        replace(schedule, microbatches=5)
    swapped = [tuple(a._replace(microbatch={0: 2, 2: 0}.get(a.microbatch, a.microbatch)) if a.stage in (0, 1) else a
                     for a in order) for order in schedule.orders]
    with pytest.raises(ScheduleError, match=r"0F2: its micro-batch is another model copy's"):
        check_complete(schedule.with_orders(tuple(swapped)))


def test_copies_that_would_reduce_different_stages_together_are_refused():
    """Device 0 holds copy 0's stage 0 and copy 1's stage 1, device 1 the others: each pair's all-reduces meet in
    the order the devices start them, so both must reduce model stage 1, then 0 (DualPipe's mirrored orders do)."""
    schedule = build_schedule("dualpipe", ScheduleParams(2, 4, chunks=2))
    assert Layout.of(schedule).peers == ((0, 1), (0, 1)) and Layout.of(schedule).group(0) == [0, 1]
    order = list(schedule.orders[0])
    first, second = (i for i, a in enumerate(order) if a.kind is Kind.REDUCE)
    order[first], order[second] = order[second], order[first]
    with pytest.raises(ExecutorError, match=r"devices 0 and 1 hold the same model stages \[0, 1\] but reduce their "
                                            r"gradients in different orders \(\[0, 1\] and \[1, 0\]\)"):
        Layout.of(schedule.with_orders((tuple(order), tuple(schedule.orders[1]))))


@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
@pytest.mark.parametrize("stages,m,n", [(2, 4, 3), (4, 8, 2)])
def test_dualpipe_trains_exactly_like_one_process(stages, m, n, optimizer):
    """Each copy trains on its half of every mini-batch; averaging the copies' gradients before each update keeps
    both copies at single-process training's weights."""
    spec = spec_for("dualpipe", stages=stages, chunks=2, m=m, n=n, optimizer=optimizer)
    result = run_in_process(spec)
    want, losses = single_process(spec)
    assert_same(pipeline_weights(result, stages), want)
    assert_same([w for k in range(stages, 2 * stages) for w in result.weights[(k, 0)]], want)
    np.testing.assert_allclose(result.losses[0], losses, rtol=1e-6)


@pytest.mark.slow
def test_dualpipe_on_two_gloo_ranks_trains_like_one_process():
    spec = spec_for("dualpipe", stages=2, chunks=2, m=4, n=2)
    real = run_multiprocess(spec, timeout_s=120)
    assert real.trace.meta.hardware["backend"] == "gloo" and real.trace.meta.hardware["ranks"] == 2
    want, losses = single_process(spec)
    assert_same(pipeline_weights(real, 2), want)
    assert_same([w for k in (2, 3) for w in real.weights[(k, 0)]], want)
    np.testing.assert_allclose(real.losses[0], losses, rtol=1e-6)


def test_dualpipe_with_two_data_parallel_replicas_trains_as_one_process_on_the_whole_minibatch():
    """A stage's REDUCE averages over both copies of both replicas (4 ranks of 2 devices): every copy of every
    replica ends at one process's weights on the d x m micro-batches."""
    spec = dp_spec("dualpipe", 4)
    assert Layout.of(spec.schedule).group(0) == [0, 1, 2, 3]
    result = run_in_process(spec)
    want = reference_single_process(whole(spec))
    for weights in result.replica_weights:
        for copy in (0, 1):
            assert_same([w for k in (2 * copy, 2 * copy + 1) for w in weights[(k, 0)]], want)


def test_a_pairs_loss_is_read_once_both_its_parts_are_issued():
    """Reading a loss waits for it on a GPU, so a pair whose forward part computes the loss leaves it unread until
    its backward part is issued; a forward alone reads its own."""
    spec = spec_for("dualpipev", stages=2, chunks=2, m=4, n=1)
    lowered = lower(spec.schedule)
    t = lowered.table
    read: dict[int, int] = {}  # row -> losses its device had read after it

    def after(row: int) -> None:
        read[row] = sum(loops[int(t.device[row])].loss_parts.values())

    loops = device_loops(spec, on_row=after)
    run_loops(loops)
    last = spec.schedule.num_stages - 1
    forwards = [i for i in range(len(t.kind)) if KINDS[t.kind[i]] is Kind.F and t.stage[i] == last]
    paired = [i for i in forwards if t.peer[i] >= 0]
    assert paired and len(paired) < len(forwards)
    for i in forwards:
        before = read.get(i - 1, 0) if t.device[i - 1] == t.device[i] else 0
        assert read[i] == before + (i not in paired)
        assert read[i + 1] == before + 1
