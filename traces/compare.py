"""Predicted against measured: two traces of the same schedule matched op by op.

An op's identity is what it does, not when or where: (kind, stage, micro-batch, mini-batch, pipeline, and the
peer stage of a transfer; ops alike in all of these are numbered in time order). Both sources name ops that
way, so matching needs no timing and works on an incomplete run (what exists is compared, against the
prediction of the same ops, and what is missing is counted). Errors are signed, prediction minus measurement: a
duration error relative to the measured duration, a start error in ms from its mini-batch's first op in each
trace, the iteration time relative (the headline: (predicted - measured) / measured).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, fields, replace

import numpy as np

from .hostload import LOAD_TOLERANCE_PER_CORE, HostLoad, loads_differ, ranks_per_host, seconds_between
from .metrics import Summary, summarize
from .trace import Counter, Ops, Stream, Trace, TraceError

_IDENTITY = ("stage", "microbatch", "minibatch", "pipeline", "peer")
_SHAPE = ("schedule", "microbatches", "minibatches", "pipelines", "placement", "stage_edges")
# the simulate flag giving a prediction a shape a run had ("minibatches 20 measured, 8 predicted" said no more)
_SHAPE_FLAGS = {"schedule": "-s", "microbatches": "-m", "minibatches": "-n", "pipelines": "--pipelines"}
# and of the recorded parameters (the schedule's); interleaved 1F1B's group goes with m (a group m needs)
_PARAM_FLAGS = {"stages": "-p", "chunks": "--chunks", "rounds": "--rounds", "microbatch_group": "--microbatch-group",
                "data_parallel": "--data-parallel", "zero": "--zero", "context_parallel": "--context-parallel",
                "expert_parallel": "--expert-parallel", "overlap_expert_comm": "--overlap-expert-comm",
                "reduce_after_flush": "--reduce-after-flush", "advance": "--advance",
                "average_every": "--average-every", "elastic_alpha": "--elastic-alpha", "prediction": "--prediction",
                "activation_limit": "--activation-limit"}


def _flag_text(flag: str, value) -> str:
    """The simulate flag that gives a parameter `value`: its number or name, a switch alone, or without it where
    the run had it off or left to its default (None)."""
    if value is None or value is False:
        return f"without {flag}"
    return flag if value is True else f"{flag} {value}"


@dataclass(frozen=True)
class OpError:
    """The worst op of a kind: its label, device, and its error."""

    op: str
    device: int
    error: float


@dataclass(frozen=True)
class KindErrors:
    """Per-op errors of one kind over the matched ops (an overlapped pair whose two parts ran is one op, of kind
    F&B: `_Units`). Duration errors are relative to the measured duration
    (ops measured shorter than `min_dur_us` are left out: their relative error is noise); start errors in ms.
    `median`/`p90` are of the absolute error, `bias` the median signed error (+: predicted too long/late)."""

    kind: str
    ops: int
    predicted_ms: float  # total duration of the kind's matched ops
    measured_ms: float
    duration_median: float | None  # None: no op of the kind lasted `min_dur_us`
    duration_p90: float | None
    duration_bias: float | None
    duration_worst: OpError | None
    start_median_ms: float
    start_p90_ms: float
    start_worst: OpError | None


@dataclass(frozen=True)
class DeviceErrors:
    device: int
    predicted_busy_ms: float
    measured_busy_ms: float
    predicted_exposed_comm_ms: float
    measured_exposed_comm_ms: float
    predicted_peak_memory_mb: float
    measured_peak_memory_mb: float | None  # None: the measurement records no memory (torch's profiler traces)
    peak_memory_error: float | None  # relative; None when the measured peak is unknown or zero


@dataclass(frozen=True)
class HostTerm:
    """A term of the prediction's profile measured on the host rather than the model: whether the calibration
    reused it from the host cache, how long before the run it was measured (None: not said), and the host's
    load then (None: not recorded)."""

    name: str
    reused: bool
    before_run_s: float | None
    load: HostLoad | None
    load_differs: bool  # from the run's, by more than LOAD_TOLERANCE_PER_CORE per core


@dataclass(frozen=True)
class Conditions:
    """What the prediction's profile was measured under against what the run ran under: the host's load while
    calibrating and while running, the ranks computing at once it was calibrated for and the ranks the run had,
    how long before the run it was calibrated, and its host terms (None where not recorded: a profile or trace
    from before these were, or a torch.distributed.pipelining run)."""

    calibrated_load: HostLoad | None
    run_load: HostLoad | None
    load_differs: bool
    calibrated_ranks: int | None
    run_ranks: int | None  # on its busiest host
    ranks_differ: bool  # the run had more ranks computing at once than the contention was calibrated for
    calibrated_before_run_s: float | None
    host_terms: list[HostTerm]


@dataclass(frozen=True)
class Comparison:
    """Everything `pipesim compare` reports."""

    schedule: str
    predicted_source: str
    measured_source: str
    predicted_ms: float  # steady-state time per mini-batch
    measured_ms: float
    iteration_time_error: float
    predicted_bubble: float
    measured_bubble: float
    matched_ops: int
    missing_in_measured: int  # predicted ops the measurement lacks (an incomplete run, or another runtime)
    missing_in_predicted: int
    missing_examples: list[str]
    kinds: list[KindErrors]
    overlapped_pairs: int  # matched pairs whose two parts ran: each one op of kind F&B in `kinds`
    compute_duration_median: float | None  # |relative duration error| over the matched compute ops, a pair as one
    compute_duration_bias: float | None  # the median signed one (+: predicted too long)
    devices: list[DeviceErrors]
    versions_compared: int  # matched compute ops whose weight version both traces record (torch's records none)
    version_mismatches: int  # of those, the ops whose weight version differs: must be 0
    version_examples: list[str]
    measured_complete: bool
    predicted_calibration: dict | None  # the profile the prediction's costs came from; None: what-if costs
    warnings: list[str] = field(default_factory=list)  # what makes the comparison itself misleading
    notes: list[str] = field(default_factory=list)
    conditions: Conditions | None = None  # None: the prediction's costs came from no calibration

    def to_dict(self) -> dict:
        return asdict(self)


def _param(params: dict, name: str):
    """A recorded schedule parameter as it shaped the order: 1 where not recorded (`rounds` before it existed);
    interleaved 1F1B's micro-batch group p where left to its default, as given (said here, as traces/ reads the
    recorded parameters by name and imports no schedule: tests/test_layering.py)."""
    value = params.get(name, 1)
    return params.get("stages") if name == "microbatch_group" and value is None else value


def _sides(predicted: Trace, measured: Trace) -> tuple[str, str]:
    """How a refusal names each trace: by what it is, measured or predicted, and by its argument where it is not
    what its argument asks for (a prediction given as MEASURED, a run as PREDICTED)."""
    return ("measured" if measured.meta.source == "measured" else "in MEASURED (a prediction)",
            "predicted" if predicted.meta.source == "predicted" else "in PREDICTED (a run)")


def check_comparable(predicted: Trace, measured: Trace) -> None:
    """Raise TraceError naming every thing in which the two runs differ, each with the flag that predicts the run
    where one does: what the prediction's costs were calibrated on (model, micro-batch size, dtype, optimizer,
    device), then the schedule, shape and placement, then a parameter both record (e.g. the activation limit auto
    was searched for) and the devices; one at a time, a user fixing the first met the next."""
    ran, predicts = _sides(predicted, measured)
    differences = _setting_differences(predicted, measured, ran, predicts)
    hinted = predicted.meta.source == "predicted"  # the flags that predict the run, said to a prediction alone
    recorded, planned = measured.meta.params, predicted.meta.params
    for name in _SHAPE:
        a, b = getattr(predicted.meta, name), getattr(measured.meta, name)
        # a stage graph is its set of edges, in whatever order its builder listed them; of another stage count (a
        # placement's length), they differ with it and are not said
        same = (sorted(map(tuple, a)) == sorted(map(tuple, b)) or len(predicted.meta.placement)
                != len(measured.meta.placement)) if name == "stage_edges" else a == b
        if same:
            continue
        if name == "placement":  # the devices, and the chunks each runs, that place the run's stages so
            shaping = [(_PARAM_FLAGS[key], recorded.get(key)) for key in ("stages", "chunks")
                       if recorded.get(key) is not None and recorded.get(key) != planned.get(key)]
            if "stages" not in recorded and measured.num_devices != predicted.num_devices:  # a run that records
                shaping = [(_PARAM_FLAGS["stages"], measured.num_devices)]  # no parameters
        else:
            shaping = [(_SHAPE_FLAGS[name], b)] if name in _SHAPE_FLAGS else []
        group = recorded.get("microbatch_group")
        if name == "microbatches" and group is not None and group != planned.get("microbatch_group"):
            shaping.append((_PARAM_FLAGS["microbatch_group"], group))  # a group the run's m needs
        fix = " ".join(_flag_text(flag, value) for flag, value in shaping)
        differences.append(f"{name} {b} {ran}, {a} {predicts}" + (f": predict with {fix}" if hinted and fix else ""))
    if not differences:  # the schedule's parameters and its devices (else they differ with the shape: p's group)
        # a trace written before --rounds existed ran its micro-batches in one flush
        for name in sorted((set(planned) & set(recorded)) | {"rounds"}):
            a, b = _param(planned, name), _param(recorded, name)
            if a != b:
                flag = _PARAM_FLAGS.get(name) if hinted else None
                differences.append(f"{name} {b} {ran}, {a} {predicts}"
                                   + (f": predict with {_flag_text(flag, b)}" if flag else ""))
        if predicted.num_devices != measured.num_devices and not differences:
            differences.append(f"{measured.num_devices} devices {ran}, {predicted.num_devices} {predicts}")
    if differences:
        raise TraceError(f"the traces describe different runs: {'; '.join(differences)}")


def _setting_differences(predicted: Trace, measured: Trace, ran: str, predicts: str) -> list[str]:
    """`check_comparable`'s differences in what the runs trained, or the prediction's costs were calibrated on
    (`_setting_of`), where both record it; the fix once, after the last."""
    trained, calibrated = _setting_of(measured), _setting_of(predicted)
    if trained is None or calibrated is None:
        return []
    options = [(f"model option {key}", trained["options"][key], calibrated["options"][key])  # of the same model
               for key in sorted(set(trained["options"]) & set(calibrated["options"]))
               if trained["model"] == calibrated["model"]]
    differ = [(name, b, a) for name, b, a in [(name, trained[name], calibrated[name]) for name in _SETTING] + options
              if a != b and None not in (a, b)]
    if not differ:
        return []
    if predicted.meta.calibration is None:  # two runs, one held against the other (the noise floor)
        return [f"{name} {b} {ran}, {a} {predicts}" for name, b, a in differ]
    said = [f"{name} {b} {ran}, {a} {predicts} (its costs' calibration)" for name, b, a in differ]
    again = (f"simulate with --optimizer {differ[0][1]}" if [name for name, *_ in differ] == ["optimizer"]
             else "predict from a profile of what ran")
    return [*said[:-1], f"{said[-1]}: {again}"]


_SETTING = ("model", "microbatch_size", "dtype", "optimizer", "device")  # besides the model's size options


def _setting_of(trace: Trace) -> dict | None:
    """What a prediction's costs were calibrated on and priced for (`_SETTING` and the model's size `options`), or
    what a run trained and on which device kind; None where the trace does not record it (what-if costs,
    torch.profiler's traces), and a field None where it does not record that one (an older file). A prediction from
    another model's profile, an A100's estimate against a CPU run, or one priced for another optimizer matches a
    run's ops one for one and reports a meaningless error."""
    if trace.meta.calibration is not None:
        c = trace.meta.calibration
        return {name: c.get(name) for name in _SETTING} | {"options": c.get("options") or {}}
    extra = trace.meta.extra
    if trace.meta.source == "measured" and isinstance(extra.get("model"), str):
        return {"model": extra["model"], "microbatch_size": trace.meta.microbatch_size, "dtype": extra.get("dtype"),
                "optimizer": extra.get("optimizer"), "device": (trace.meta.hardware or {}).get("device"),
                "options": extra.get("model_options") or {}}
    return None


def _replica_zero(predicted: Trace, measured: Trace) -> tuple[Trace, list[str]]:
    """A run measured on d > 1 data-parallel replicas holds every rank as a device at its place (replica x p +
    device, whatever its rank order: replica 0 is devices 0 .. p-1), a prediction one replica (the others run the
    same rows): the measurement's replica 0, and a note saying so."""
    replicas, devices = int(measured.meta.params.get("data_parallel", 1)), predicted.num_devices
    if replicas == 1 or measured.num_devices != replicas * devices:
        return measured, []
    counters = {name: series[:devices] for name, series in measured.counters.items()}
    ranks = measured.meta.extra.get("device_ranks") or list(range(measured.num_devices))
    ranks_text = (f"ranks 0-{devices - 1}" if ranks[:devices] == list(range(devices))  # another order's: listed
                  else f"ranks {', '.join(map(str, ranks[:devices]))}")
    return (replace(measured, num_devices=devices, ops=_taken(measured.ops, measured.ops.device < devices),
                    counters=counters),
            [f"measured on {replicas} data-parallel replicas: replica 0 ({ranks_text}) is compared op by op, the "
             "step and bubble are the whole run's; the others ran the same rows"])


def _taken(ops: Ops, keep: np.ndarray) -> Ops:
    """The ops `keep` selects (a mask, or indices in order)."""
    return Ops(**{f.name: getattr(ops, f.name)[keep] for f in fields(Ops)})


def _ran_part(predicted: Trace, at_p: np.ndarray) -> Trace:
    """The prediction of the part of an incomplete run that ran: the predicted ops it matched (`at_p`), and each
    device's counters up to the end of its last of them (its first sample at least: a device none of whose ops ran
    keeps a peak), so that the predicted time per mini-batch, bubble, busy time, exposed communication and peak
    memory are those of the ops measured: a run cut after 2 of its 8 mini-batches had device 0's 150 ms busy held
    against the whole run's 479 predicted."""
    ops = _taken(predicted.ops, np.sort(at_p))
    last_us = np.full(predicted.num_devices, -np.inf)
    np.maximum.at(last_us, ops.device, ops.end_us)

    def cut(counter: Counter, end_us: float) -> Counter:
        kept = max(1, int(np.searchsorted(counter.times_us, end_us, side="right")))
        return Counter(counter.times_us[:kept], counter.values[:kept])

    counters = {name: [cut(counter, end_us) for counter, end_us in zip(curves, last_us)]
                for name, curves in predicted.counters.items()}
    return replace(predicted, ops=ops, counters=counters)


def _identities(predicted: Trace, measured: Trace) -> tuple[np.ndarray, np.ndarray]:
    """One dense int64 id per op identity, shared by both traces (kinds matched by name)."""
    names = sorted(set(predicted.kinds) | set(measured.kinds))

    def columns(trace: Trace) -> np.ndarray:
        kind = np.array([names.index(k) for k in trace.kinds], dtype=np.int64)[trace.ops.kind]
        same = np.column_stack([kind, *(getattr(trace.ops, c) for c in _IDENTITY)])
        # Ops that share all of that (XPipe's two PREDs of one bellwether, F's then B's) are told apart by
        # their order in time.
        return np.column_stack([same, _occurrence(same, trace.ops.start_us)])

    both = np.concatenate([columns(predicted), columns(measured)])
    ids = np.unique(both, axis=0, return_inverse=True)[1].reshape(-1)
    return ids[:len(predicted.ops)], ids[len(predicted.ops):]


def _match(predicted: Trace, measured: Trace) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, list[str]]:
    key_p, key_m = _identities(predicted, measured)
    for label, keys, trace in (("predicted", key_p, predicted), ("measured", key_m, measured)):
        unique, first = np.unique(keys, return_index=True)
        if len(unique) != len(keys):
            twice = np.setdiff1d(np.arange(len(keys)), first)[0]
            raise TraceError(f"the {label} trace holds op {trace.op_label(int(twice))} twice")
    common, at_p, at_m = np.intersect1d(key_p, key_m, assume_unique=True, return_indices=True)
    only_p = np.setdiff1d(np.arange(len(key_p)), at_p)
    only_m = np.setdiff1d(np.arange(len(key_m)), at_m)
    examples = [f"{predicted.op_label(int(i))} on device {predicted.ops.device[i]} (measured lacks it)"
                for i in only_p[:3]]
    examples += [f"{measured.op_label(int(i))} on device {measured.ops.device[i]} (predicted lacks it)"
                 for i in only_m[:3]]
    return at_p, at_m, only_p, only_m, examples


PAIR_KIND = "F&B"  # an overlapped pair's two parts as compare times them: one unit


@dataclass(frozen=True)
class _Units:
    """The matched ops as compare times them, in both traces: each op alone, but an overlapped pair's two parts
    (F&B) as one unit, timed as the union of its parts. The simulator runs a pair's parts one after the other, the
    shorter part shortened by what the longer hides of it, while a GPU runs them at once on two streams, each part
    spanning the pair: part by part the two say different things (the forward's share of the pair is a fiction of
    the simulator's), and summed, the measured pair counts its time twice."""

    kind: np.ndarray  # str: the op's kind, PAIR_KIND for a pair
    measured_row: np.ndarray  # the measured op's row (a pair's: its forward part's)
    measured_partner: np.ndarray  # a pair's backward part's measured row; -1 for an op alone
    compute: np.ndarray  # bool
    start_p: np.ndarray  # us, the predicted unit's first start
    dur_p: np.ndarray  # us, the predicted unit's time (a pair's: its parts' union)
    start_m: np.ndarray
    dur_m: np.ndarray

    def label(self, measured: Trace, unit: int) -> str:
        """The unit's label: its measured op's (`F3`), a pair's its parts' (`F3;B1`)."""
        text = measured.op_label(int(self.measured_row[unit]))
        partner = int(self.measured_partner[unit])
        return text if partner < 0 else f"{text};{measured.op_label(partner)}"


def _occurrence(same: np.ndarray, start_us: np.ndarray) -> np.ndarray:
    """Each row's place in time among the rows whose columns `same` are alike (0 for the first)."""
    group = np.unique(same, axis=0, return_inverse=True)[1].reshape(-1)
    order = np.lexsort((start_us, group))
    first = np.searchsorted(group[order], group[order])
    occurrence = np.empty(len(group), dtype=np.int64)
    occurrence[order] = np.arange(len(group)) - first
    return occurrence


def pair_rows(trace: Trace) -> tuple[np.ndarray, np.ndarray]:
    """The rows of each overlapped pair's forward part and of its backward part: on one device, of one mini-batch
    and pipeline, each part naming the other's stage (`schedules.ir.overlapped`); pairs alike in all of these are
    matched in time order, the k-th forward with the k-th backward."""
    ops = trace.ops
    code = {name: k for k, name in enumerate(trace.kinds)}
    forward = np.flatnonzero((ops.kind == code.get("F", -1)) & (ops.peer >= 0))
    backward = np.flatnonzero((ops.kind == code.get("B", -1)) & (ops.peer >= 0))

    def keyed(rows: np.ndarray, forward_stage: np.ndarray, backward_stage: np.ndarray) -> np.ndarray:
        same = np.column_stack([ops.device[rows], ops.minibatch[rows], ops.pipeline[rows], forward_stage,
                                backward_stage])
        return np.column_stack([same, _occurrence(same, ops.start_us[rows])])

    keys = np.concatenate([keyed(forward, ops.stage[forward], ops.peer[forward]),
                           keyed(backward, ops.peer[backward], ops.stage[backward])])
    ids = np.unique(keys, axis=0, return_inverse=True)[1].reshape(-1)
    _, at_f, at_b = np.intersect1d(ids[:len(forward)], ids[len(forward):], assume_unique=True, return_indices=True)
    return forward[at_f], backward[at_b]


def _minibatch_origin_us(ops: Ops) -> np.ndarray:
    """Per op, the start of its mini-batch's first op in its own trace, which its start error counts from: from the
    run's first op, a GPU run's one-off warm-up (820 ms on an H200, against a 299 ms step) shifted every later op
    alike and each kind's start error read it, not the order's timing within a step, which the iteration time's
    error already leaves the warm-up out of."""
    if not len(ops):
        return np.zeros(0)
    first_us = np.full(int(ops.minibatch.max()) + 1, np.inf)
    np.minimum.at(first_us, ops.minibatch, ops.start_us)
    return first_us[ops.minibatch]


def _units(predicted: Trace, measured: Trace, at_p: np.ndarray, at_m: np.ndarray) -> _Units:
    """The units of the matched ops (`at_p`, `at_m`): a pair of the prediction whose parts both ran is one; a part
    whose other part never ran (an incomplete run) stays an op of its own kind."""
    slot = np.full(len(predicted.ops), -1)
    slot[at_p] = np.arange(len(at_p))
    forward, backward = (slot[rows] for rows in pair_rows(predicted))
    both = (forward >= 0) & (backward >= 0)
    forward, backward = forward[both], backward[both]
    alone = np.ones(len(at_p), dtype=bool)
    alone[forward] = alone[backward] = False
    single = np.flatnonzero(alone)

    def timed(trace: Trace, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        ops = trace.ops
        start = ops.start_us - _minibatch_origin_us(ops)
        f, b = rows[forward], rows[backward]
        shared = np.maximum(np.minimum(ops.end_us[f], ops.end_us[b]) - np.maximum(ops.start_us[f], ops.start_us[b]),
                            0.0)
        return (np.concatenate([start[rows[single]], np.minimum(start[f], start[b])]),
                np.concatenate([ops.dur_us[rows[single]], ops.dur_us[f] + ops.dur_us[b] - shared]))

    start_p, dur_p = timed(predicted, at_p)
    start_m, dur_m = timed(measured, at_m)
    return _Units(
        kind=np.concatenate([np.array(measured.kinds)[measured.ops.kind[at_m[single]]],
                             np.full(len(forward), PAIR_KIND)]),
        measured_row=np.concatenate([at_m[single], at_m[forward]]),
        measured_partner=np.concatenate([np.full(len(single), -1), at_m[backward]]),
        compute=np.concatenate([predicted.ops.stream[at_p[single]] == Stream.COMPUTE, np.ones(len(forward), bool)]),
        start_p=start_p, dur_p=dur_p, start_m=start_m, dur_m=dur_m)


def _worst(measured: Trace, units: _Units, rows: np.ndarray, errors: np.ndarray) -> OpError | None:
    if len(rows) == 0:
        return None
    i = int(np.argmax(np.abs(errors)))
    return OpError(units.label(measured, int(rows[i])), int(measured.ops.device[units.measured_row[rows[i]]]),
                   float(errors[i]))


def _kind_errors(measured: Trace, units: _Units, min_dur_us: float) -> list[KindErrors]:
    """Per kind (the measured trace's order, an overlapped pair's F&B after B), the units' errors."""
    kinds = measured.kinds
    order = [*kinds[:kinds.index("B") + 1], PAIR_KIND, *kinds[kinds.index("B") + 1:]] if "B" in kinds else kinds
    out = []
    for name in [k for k in order if k in set(units.kind.tolist())]:
        rows = np.flatnonzero(units.kind == name)
        dur_p, dur_m = units.dur_p[rows], units.dur_m[rows]
        timed = dur_m >= min_dur_us
        rel = (dur_p[timed] - dur_m[timed]) / dur_m[timed]
        start_err_ms = (units.start_p[rows] - units.start_m[rows]) / 1e3

        def stats(values: np.ndarray) -> tuple[float | None, float | None]:
            if len(values) == 0:
                return None, None
            return float(np.median(np.abs(values))), float(np.percentile(np.abs(values), 90))

        d_med, d_p90 = stats(rel)
        s_med, s_p90 = stats(start_err_ms)
        out.append(KindErrors(
            kind=name, ops=len(rows), predicted_ms=float(dur_p.sum() / 1e3), measured_ms=float(dur_m.sum() / 1e3),
            duration_median=d_med, duration_p90=d_p90,
            duration_bias=float(np.median(rel)) if len(rel) else None,
            duration_worst=_worst(measured, units, rows[timed], rel), start_median_ms=s_med, start_p90_ms=s_p90,
            start_worst=_worst(measured, units, rows, start_err_ms)))
    return out


def _device_errors(p: Summary, m: Summary) -> list[DeviceErrors]:
    out = []
    for dp, dm in zip(p.devices, m.devices):
        error = ((dp.peak_memory_mb - dm.peak_memory_mb) / dm.peak_memory_mb
                 if dm.peak_memory_mb else None)
        out.append(DeviceErrors(dp.device, dp.busy_ms, dm.busy_ms, dp.exposed_comm_ms, dm.exposed_comm_ms,
                                dp.peak_memory_mb, dm.peak_memory_mb, error))
    return out


# per host term a profile records as unmeasured (profiles/schema.py `unmeasured_terms`), calibrate's flag that
# skipped it and what a prediction from the profile prices without it
UNMEASURED = {"link and all-reduce": ("--no-links", "every transfer at 0 ms"),
              "runtime probe": ("--no-runtime", "no runtime cost on a row"),
              "contention": ("--no-contention", "ranks computing at once as fast as one alone")}
TORCH_RUNTIME = "torch.distributed.pipelining"  # a measured torch run's `hardware.runtime` (planning/torch_profile.py)


def _warnings(predicted: Trace, measured: Trace) -> list[str]:
    """A run of one mini-batch is all warm-up: the time compared is the whole run (`summarize`'s step at N = 1,
    which run marks *), not a steady step; and the costs' warnings (`_cost_warnings`)."""
    whole_run = ["the run is one mini-batch (N=1), all warm-up: the time compared is the whole run, the pipeline's "
                 "fill and drain included, not a steady step; run with --minibatches 2 or more"]
    return (whole_run * (measured.meta.minibatches == 1) + _cost_warnings(predicted, measured)
            + _placement_warnings(predicted, measured))


def _shared_compute(devices: Sequence[str | None]) -> dict[str, list[int]]:
    """The compute resources (GPUs) two ranks or more ran on, each with its ranks (`devices`: each rank's, None: one
    of its own)."""
    ranks: dict[str, list[int]] = {}
    for rank, device in enumerate(devices):
        if device is not None:
            ranks.setdefault(device, []).append(rank)
    return {device: held for device, held in ranks.items() if len(held) > 1}


def _placement_warnings(predicted: Trace, measured: Trace) -> list[str]:
    """A run whose ranks shared GPUs (one GPU lent, DESIGN's §5) held against a prediction that gives each rank its
    own: the shared GPU's compute and memory are priced apart, and the error is mostly that (an H200 run's 1F1B: -23.6
    % against -3.1 % from the prediction compare makes of the run itself)."""
    hardware = measured.meta.hardware or {}
    if measured.meta.source != "measured" or predicted.meta.source != "predicted" or hardware.get("device") != "cuda":
        return []  # CPU ranks share the host's cores, as the calibration's contention prices them, not a GPU
    shared = _shared_compute(hardware.get("compute") or [])
    placed = [device.get("compute") for device in ((predicted.meta.cluster or {}).get("devices") or [])]
    # host-staged ranks take turns as one GPU's do, whatever GPUs they ran on (`TraceMeta.shares_gpu`, as replayed)
    if not (shared or measured.meta.shares_gpu) or _shared_compute(placed):
        return []
    ran = ("; ".join(f"ranks {', '.join(map(str, ranks))} on {device}" for device, ranks in shared.items())
           or "the host-staged transport: one rank's rows at a time")
    return [f"the run's ranks shared GPUs ({ran}), where the prediction gives each rank a GPU of its own: their "
            "compute and memory are priced apart; `pipesim compare MEASURED` alone predicts the run as it was placed"]


def _cost_warnings(predicted: Trace, measured: Trace) -> list[str]:
    """A prediction given as MEASURED is no run: the error is one prediction's against another. A prediction from
    typed what-if costs describes no machine: its error against a run measures the numbers typed, not pipesim.
    One whose profile timed its stages' passes with another runtime's code than the run's (`calibrate
    --passes-as`) prices each pass at that runtime's cost."""
    if measured.meta.source == "predicted":
        return ["MEASURED is a prediction (`pipesim simulate --trace`), not a run: what the tables call measured is "
                "that prediction, and the error one prediction's against the other"]
    if predicted.meta.source != "predicted":
        return []
    calibration = predicted.meta.calibration
    if calibration is None:
        return ["the prediction's costs are what-if numbers (--fwd, --bwd, ... or their defaults), not a calibration "
                "profile, so this error says nothing about pipesim's accuracy: calibrate the model (`pipesim "
                "calibrate`) and predict with `pipesim simulate --profile PROFILE`"]
    torch_run = (measured.meta.hardware or {}).get("runtime") == TORCH_RUNTIME
    return [] if torch_run == (calibration.get("passes_as") == "torch") else [passes_warning(torch_run)]


def _unrecorded_notes(predicted: Trace, measured: Trace) -> list[str]:
    """For a torch.profiler run: what its traces do not record, which compare takes as the prediction's (its
    schedule, micro-batches and steps are read off its actions and checked: planning/torch_profile.py)."""
    if (measured.meta.hardware or {}).get("runtime") != TORCH_RUNTIME:
        return []
    setting = _setting_of(predicted) or {}
    taken = [f"{label} {setting[name]}" for name, label in (("model", "model"), ("microbatch_size", "micro-batch size"),
                                                              ("optimizer", "optimizer"), ("dtype", "dtype"))
             if setting.get(name) is not None]
    return ["torch's profiler traces record no model, micro-batch size, optimizer or dtype: compare takes the "
            f"prediction's{' (' + ', '.join(taken) + ')' if taken else ''}; predict with what torch ran"]


def passes_warning(torch_run: bool) -> str:
    """What compare and `pipesim run --profile` say of a profile whose stages' passes were timed with the other
    runtime's code than the run's (`calibrate --passes-as`; `torch_run`: the run is torch's, else pipesim's): a
    prediction from it prices each pass at that runtime's cost."""
    if torch_run:
        return ("the profile timed its stages' passes as pipesim's executor runs them (functional_call "
                f"under saved-tensor hooks), and this is a {TORCH_RUNTIME} run: calibrate with --passes-as torch")
    return (f"the profile timed its stages' passes as {TORCH_RUNTIME} runs them, short of "
            "pipesim's executor (functional_call under saved-tensor hooks), and this is pipesim's run: calibrate "
            "without --passes-as torch")


def conditions(predicted: Trace, measured: Trace) -> Conditions | None:
    """The conditions the prediction's profile was calibrated under beside those the run ran under (None: the
    prediction has no calibration)."""
    calibration = predicted.meta.calibration
    if calibration is None:
        return None
    run_load = HostLoad.from_dict(measured.meta.extra.get("host_load"))
    calibrated_load = HostLoad.from_dict(calibration.get("load"))
    ran = ranks_per_host(measured.meta.hardware)
    calibrated_for = calibration.get("ranks") if isinstance(calibration.get("ranks"), int) else None
    run_began = run_load.began_at if run_load is not None else None
    terms = []
    for name, term in (calibration.get("host_terms") or {}).items():
        if not isinstance(term, dict):
            continue
        load = HostLoad.from_dict(term.get("load"))
        terms.append(HostTerm(name, bool(term.get("reused")), seconds_between(term.get("measured_at"), run_began),
                              load, loads_differ(load, run_load)))
    return Conditions(
        calibrated_load, run_load, loads_differ(calibrated_load, run_load), calibrated_for, ran,
        # contention is measured for CPU ranks sharing a host; a GPU profile has none to outgrow
        calibration.get("device") == "cpu" and None not in (ran, calibrated_for) and ran > calibrated_for,
        seconds_between(calibration.get("date"), run_began), terms)


def _condition_warnings(found: Conditions | None) -> list[str]:
    """A sentence for each condition that differs enough to explain an error by itself."""
    if found is None:
        return []
    out = []
    if found.load_differs:
        out.append(f"the host's load differed: {found.calibrated_load.per_core:.2f} per core while calibrating, "
                   f"{found.run_load.per_core:.2f} while running (more than {LOAD_TOLERANCE_PER_CORE} apart); the "
                   "profile's times and contention hold under the first, so part of this error is the host's: "
                   "calibrate and run under the same load")
    if found.ranks_differ:
        out.append(f"the run had {found.run_ranks} ranks, the profile's contention was measured for "
                   f"{found.calibrated_ranks} computing at once (beyond that the simulator holds its last factor): "
                   f"calibrate with --ranks {found.run_ranks}")
    busy = [f"{load.per_core:.2f} per core {when} (busy from {load.busy_from:g}, {load.measure})"
            for load, when in ((found.calibrated_load, "while calibrating"), (found.run_load, "while running"))
            if load is not None and load.busy]
    if busy:
        out.append(f"the host was busy (others' load {', '.join(busy)}: other work shared every rank's core): its "
                   "load moves from minute to minute, so part of this error is the host's; calibrate and run on a "
                   "quieter host to judge the prediction")
    for term in found.host_terms:
        if term.reused and term.load_differs:
            out.append(f"the profile's {term.name} came from the host cache, measured at others' load "
                       f"{term.load.per_core:.2f} per core, the run's was {found.run_load.per_core:.2f}")
    return out


def compare(predicted: Trace, measured: Trace, *, min_dur_us: float = 1.0) -> Comparison:
    """Match the two traces op by op and measure how far the prediction is from the measurement (of a run on
    several data-parallel replicas, replica 0's)."""
    return compared(predicted, measured, min_dur_us=min_dur_us)[0]


def compared(predicted: Trace, measured: Trace, *, min_dur_us: float = 1.0) -> tuple[Comparison, Trace]:
    """`compare`'s comparison, and the prediction it holds against `measured`: whole for a complete run, else of
    the ops that ran (`_ran_part`), so that a page draws what the figures are of (an interrupted run's page drew all
    2,000 predicted mini-batches beside the 60 that ran, and titled them with the whole prediction's makespan)."""
    whole = measured  # every replica's ranks: the run's step and bubble, as `run` and the page give them
    measured, notes = _replica_zero(predicted, measured)
    check_comparable(predicted, measured)
    at_p, at_m, only_p, only_m, examples = _match(predicted, measured)
    held = predicted if measured.meta.complete else _ran_part(predicted, at_p)
    sp = summarize(held)
    sm = summarize(whole)  # replica 0's alone read 58.809 ms where run and the page said 59.017
    compute = predicted.ops.stream[at_p] == Stream.COMPUTE
    recorded = compute & (measured.ops.version[at_m] >= 0)  # torch's runtime records no versions
    v_p, v_m = predicted.ops.version[at_p][recorded], measured.ops.version[at_m][recorded]
    wrong = np.flatnonzero(v_p != v_m)
    version_examples = [f"{measured.op_label(int(at_m[recorded][i]))} on device "
                        f"{measured.ops.device[at_m[recorded][i]]}: predicted version {v_p[i]}, measured {v_m[i]}"
                        for i in wrong[:3]]
    notes += _unrecorded_notes(predicted, measured)
    if unmeasured := [UNMEASURED.get(term, (term, "nothing")) for term in
                      (predicted.meta.calibration or {}).get("unmeasured") or []]:
        notes.append(f"the prediction's profile was calibrated with {', '.join(flag for flag, _ in unmeasured)}: it "
                     f"prices {'; '.join(priced for _, priced in unmeasured)}, which the errors show")
    if predicted.meta.source == "measured" and measured.meta.source == "measured":  # a run against another
        notes.append("PREDICTED is a run too: what the tables call predicted is that run, and the errors one run's "
                     "against the other (the same run repeated: the noise floor)")
    if not measured.meta.complete:
        notes.append(f"the measured run is {measured.meta.incomplete_text}: {len(only_p):,} predicted ops were never "
                     "run; the errors, and every predicted figure, cover the ops that ran")
    if sm.time_per_minibatch_ms <= 0:
        raise TraceError("the measured trace has no time per mini-batch to compare with (no op took time)")
    error = (sp.time_per_minibatch_ms - sm.time_per_minibatch_ms) / sm.time_per_minibatch_ms
    units = _units(predicted, measured, at_p, at_m)
    timed = units.compute & (units.dur_m >= min_dur_us)
    rel = (units.dur_p[timed] - units.dur_m[timed]) / units.dur_m[timed]
    found = conditions(predicted, measured)
    return Comparison(
        schedule=predicted.meta.schedule, predicted_source=predicted.meta.source,
        measured_source=measured.meta.source, predicted_ms=sp.time_per_minibatch_ms,
        measured_ms=sm.time_per_minibatch_ms, iteration_time_error=float(error),
        predicted_bubble=sp.bubble_fraction, measured_bubble=sm.bubble_fraction, matched_ops=len(at_p),
        missing_in_measured=len(only_p), missing_in_predicted=len(only_m), missing_examples=examples,
        kinds=_kind_errors(measured, units, min_dur_us),
        overlapped_pairs=int(np.count_nonzero(units.measured_partner >= 0)),
        compute_duration_median=float(np.median(np.abs(rel))) if len(rel) else None,
        compute_duration_bias=float(np.median(rel)) if len(rel) else None,
        devices=_device_errors(sp, sm), versions_compared=int(recorded.sum()), version_mismatches=len(wrong),
        version_examples=version_examples, measured_complete=measured.meta.complete,
        predicted_calibration=predicted.meta.calibration,
        warnings=_warnings(predicted, measured) + _condition_warnings(found), notes=notes, conditions=found), held
