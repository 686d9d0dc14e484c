"""Methods that trade staleness for throughput, and AvgPipe's parallel pipelines.

PipeDream-2BW, SpecTrain, PipeOptim and XPipe all run PipeDream's order (1F1B across mini-batches, no
flush, an update after each mini-batch's last backward); they differ only in which weights each op
reads, which is their `WeightPolicy`, and in the PRED actions that compute predicted weights.
Distances s are in updates of the stage's weights; see `ir.Prediction`.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from ..units import degree_text
from .ir import SYNCHRONOUS, Kind, Prediction, Read, Schedule, ScheduleError, WeightPolicy
from .methods import Method, ScheduleParams, interleave_1f1b_rows, make_schedule, pipedream_order, require_degree
from .table import KIND_CODE, ActionTable

_F, _B, _OPT, _AVG = (KIND_CODE[k] for k in (Kind.F, Kind.B, Kind.OPT, Kind.AVG))

# PipeDream-2BW: double buffering; every op of mini-batch b reads W(b-1) (Narayanan et al. 2021).
TWO_BW_POLICY = WeightPolicy(forward=Read.PREVIOUS, backward=Read.PREVIOUS)
# SpecTrain (Chen et al. 2019): predict before F and before B, restore after. Its code (ntueclab/SpecTrain-PyTorch,
# `load_predicted_weights` in src/optimizer.py) states the paper's s with rank for k. One saved copy to restore from.
SPECTRAIN_POLICY = WeightPolicy(
    predict_forward=Prediction({"paper": "k//2 + p-k-1", "code": "k//2 + p-k-1"}),
    predict_backward=Prediction({"paper": "k//2", "code": "k//2"}),
    extra_copies=1, primary_source="paper",
)
# PipeOptim (Guan et al.): predict before every F with s = p-k-1 (paper); its code (guanleics/PipeOptim,
# `forward_s = world_size - rank`) uses p-k. The backward runs on the current weights, nothing is stashed; one
# copy holds the weights the prediction replaced.
PIPEOPTIM_POLICY = WeightPolicy(predict_forward=Prediction({"paper": "p-k-1", "code": "p-k"}), extra_copies=1,
                                primary_source="paper")
# XPipe (Guan et al. 2019): the bellwether (a mini-batch's first micro-batch) predicts with Adam's moments, in F
# and in B, and the mini-batch's other micro-batches reuse its predicted weights. The paper's closed forms,
# round((p+m-k/2-2)/m) and round((m+floor(k/2)-1)/m) with halves rounded up, are its published s (no code is
# public); they count to the update that completes the mini-batch on GPU 0, so "counted" differs.
XPIPE_POLICY = WeightPolicy(
    forward=Read.BELLWETHER,
    backward=Read.BELLWETHER,
    predict_forward=Prediction({"paper": "(2*p + 3*m - k - 4)//(2*m)"}),
    predict_backward=Prediction({"paper": "(3*m + 2*(k//2) - 2)//(2*m)"}),
    extra_copies=2, primary_source="paper",  # the F and the B bellwether buffers are alive at once
)
# AvgPipe (Zhang et al. 2023): each pipeline is synchronous; the reference model is an extra copy, of the weights
# elastic averaging updates: those the optimizer owns (executor/weights.py `average_replicas`; a 16-bit model's
# float32 masters).
AVGPIPE_POLICY = WeightPolicy(extra_copies=1, master_copies=1)


def pipedream_2bw(params: ScheduleParams) -> Schedule:
    """PipeDream's order with two weight buffers: staleness 1 everywhere, two versions held."""
    if params.microbatches < params.stages - 1:
        raise ScheduleError(
            f"pipedream-2bw needs m >= p-1 micro-batches per mini-batch (got {degree_text('m', params.microbatches)}, "
            f"{degree_text('p', params.stages)}): otherwise the input stage starts mini-batch b before W(b-1) exists"
        )
    return pipedream_order("pipedream-2bw", params, TWO_BW_POLICY)


def predicting_order(method: str, params: ScheduleParams, policy: WeightPolicy) -> Schedule:
    """PipeDream's order with `policy`'s s taken from the source `params.prediction` names (None: the policy's
    primary source). The schedule's params name the source used, so a trace says which s it ran with."""
    source = params.prediction or policy.primary_source
    if source not in policy.sources:
        raise ScheduleError(f"{method}: prediction {source!r} is not a source of s it records; choose from "
                            f"{', '.join(policy.sources)}")
    return pipedream_order(method, replace(params, prediction=source), replace(policy, chosen_source=source))


def spectrain(params: ScheduleParams) -> Schedule:
    return predicting_order("spectrain", params, SPECTRAIN_POLICY)


def pipeoptim(params: ScheduleParams) -> Schedule:
    return predicting_order("pipeoptim", params, PIPEOPTIM_POLICY)


def xpipe(params: ScheduleParams) -> Schedule:
    return predicting_order("xpipe", params, XPIPE_POLICY)


def avgpipe(params: ScheduleParams) -> Schedule:
    """P synchronous pipelines on the same p devices, averaged elastically every `average_every` mini-batches.

    Advance forward propagation: stage k runs `advance` forwards beyond 1F1B's warm-up before its first
    backward (capped at m): 0 is 1F1B, >= m is all forwards first; unset, AvgPipe's rule of p-k-1
    more, so 2(p-k)-1 forwards come first. The pipelines' actions alternate on each device; after every
    pipeline's update of an averaged mini-batch, one AVG per stage pulls the replicas and the reference
    model together.
    """
    require_degree(params, "chunks", 1, "avgpipe places one model stage per device")
    p, m, n, copies = params.stages, params.microbatches, params.minibatches, params.pipelines
    # One pipeline has nothing to average with: no AVG and no reference model, plain 1F1B with advance forwards.
    averaged = [b for b in range(n) if (b + 1) % params.average_every == 0 or b == n - 1] if copies > 1 else []
    k = np.arange(p)  # row k: stage k's actions, on device k (every stage's at once)
    advance = p - k - 1 if params.advance is None else params.advance
    backward, position = interleave_1f1b_rows(m, np.minimum(m - 1, p - k - 1 + advance))
    step = 2 * m + 1  # one pipeline's mini-batch: its pattern, then its update

    def each_step(pattern: np.ndarray, update: int) -> np.ndarray:
        """Per stage, `pattern` then `update`, each action once per pipeline in turn (the pipelines' actions
        alternate), for every mini-batch."""
        return np.tile(np.repeat(np.concatenate([pattern, np.full((p, 1), update)], axis=1), copies, axis=1), n)

    kind, microbatch = each_step(np.where(backward, _B, _F), _OPT), each_step(position, -1)
    pipeline = np.broadcast_to(np.tile(np.arange(copies), n * step), kind.shape)
    minibatch = np.broadcast_to(np.repeat(np.arange(n), copies * step), kind.shape)
    after = [(b + 1) * copies * step for b in averaged]  # AVG once every pipeline updated
    kind, microbatch = np.insert(kind, after, _AVG, axis=1), np.insert(microbatch, after, -1, axis=1)
    minibatch, pipeline = np.insert(minibatch, after, averaged, axis=1), np.insert(pipeline, after, 0, axis=1)
    return make_schedule("avgpipe", params, ActionTable.from_device_rows(kind, k[:, None], microbatch, minibatch,
                                                                      pipeline),
                         AVGPIPE_POLICY if copies > 1 else SYNCHRONOUS)


PREDICTS = frozenset({"prediction"})  # the option that chooses the source of s
ASYNCHRONOUS = (
    Method("pipedream-2bw", "PipeDream-2BW: PipeDream's order with two weight buffers; staleness 1",
           pipedream_2bw),
    Method("spectrain", "SpecTrain: PipeDream's order; weights predicted s updates ahead for F and B",
           spectrain, options=PREDICTS),
    Method("pipeoptim", "PipeOptim: PipeDream's order; optimizer-aware prediction for F, B on current weights",
           pipeoptim, options=PREDICTS),
    Method("xpipe", "XPipe: micro-batched asynchronous 1F1B; bellwether predicts once per mini-batch",
           xpipe, options=PREDICTS),
    Method("avgpipe", "AvgPipe: P synchronous pipelines co-scheduled, advance forwards, elastic averaging",
           avgpipe, defaults={"pipelines": 2}, options=frozenset({"advance", "average_every", "elastic_alpha"})),
)
