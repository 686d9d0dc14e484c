"""DualPipe's overlapped F&B pair in the executor, and the bidirectional DualPipe.

A pair runs as its two parts: on CPU one after the other on the device's thread; the measured trace records
each part as its own op naming the other's stage (`peer`), as the simulated trace does, so `pipesim compare`
matches the pair part by part.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pipesim.executor import DeviceLoop, RunSpec, cut, run_multiprocess
from pipesim.executor.overlap import PairStreams
from pipesim.schedules import KINDS, Kind, ScheduleParams, build_schedule, lower
from pipesim.schedules.analysis import overlapped_pairs
from pipesim.sim import Cluster, Costs, simulate
from pipesim.traces.compare import compare
from pipesim.workload.transport import InProcessTransport
from tests.test_executor import assert_same, pipeline_weights, single_process, spec_for
from tests.test_executor_methods import run_loops


def pair_parts(trace) -> tuple[np.ndarray, np.ndarray]:
    """Rows of a trace's overlapped pairs: their forward parts, and their backward parts."""
    ops, kinds = trace.ops, list(trace.kinds)
    forward = np.flatnonzero((ops.kind == kinds.index("F")) & (ops.peer >= 0))
    backward = np.flatnonzero((ops.kind == kinds.index("B")) & (ops.peer >= 0))
    return forward, backward


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
