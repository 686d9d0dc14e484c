"""DualPipe's overlapped F&B pair in the executor, and the bidirectional DualPipe.

A pair runs as its two parts: on CPU one after the other on the device's thread; the measured trace records
each part as its own op naming the other's stage (`peer`), as the simulated trace does, so `pipesim compare`
matches the pair part by part.
"""

from __future__ import annotations

import numpy as np
import pytest

from pipesim.executor import run_multiprocess
from pipesim.schedules import lower
from pipesim.schedules.analysis import overlapped_pairs
from pipesim.sim import Cluster, Costs, simulate
from pipesim.traces.compare import compare
from tests.test_executor import assert_same, pipeline_weights, single_process, spec_for


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
