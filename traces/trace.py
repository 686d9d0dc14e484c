"""The one trace schema for predicted and measured runs, stored as Chrome Trace Event JSON.

Ops are kept as columns (numpy arrays) so that traces of a million ops stay small and fast. On disk a
trace is a Chrome Trace Event document (`traceEvents`, `ph: "X"`, `pid` = device, `tid` = stream) that
Perfetto and chrome://tracing open unchanged; pipesim's own metadata sits under the top-level key
`pipesim`, and every op's identity under its `args`, so `read_trace(write_trace(t)) == t`.
"""

from __future__ import annotations

import json
import math
import os
import re
import stat
import sys
import tempfile
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field, fields
from enum import IntEnum
from pathlib import Path
from typing import Any, Literal, NoReturn, Protocol

import numpy as np
from typing_extensions import TypedDict  # pydantic validates typing.TypedDict only from Python 3.12

from .. import __version__
from ..choices import nearest_text, optimizer_refusal
from ..files import TRACE, first_error, read_document
from ..memory_parts import MEMORY_PARTS
from ..units import COUNTER_LIMIT, number_allowed

SCHEMA_VERSION = 2


class Stream(IntEnum):
    """Where an op runs on its device (the Chrome trace's `tid`): compute, the send or receive stream, or the
    network stream of collectives across data-parallel replicas (NCCL runs them on a stream of their own)."""

    COMPUTE = 0
    SEND = 1
    RECV = 2
    NETWORK = 3

    @classmethod
    def of_kind(cls, kind: str) -> Stream:
        """The schema's rule: a kind named SEND_* runs on the send stream, RECV_* on the receive stream, a
        collective (REDUCE, GATHER, an expert-parallel all-to-all, a context-parallel ring) on the network stream,
        every other kind on the compute stream."""
        if kind in COLLECTIVE_KINDS:
            return cls.NETWORK
        return cls.SEND if kind.startswith("SEND") else cls.RECV if kind.startswith("RECV") else cls.COMPUTE

    @classmethod
    def of_kinds(cls, kinds: tuple[str, ...]) -> np.ndarray:
        """Per kind code, its stream: index it with a kind column to get the stream column."""
        return np.array([cls.of_kind(k) for k in kinds], dtype=np.int64)


COLLECTIVE_KINDS = ("REDUCE", "GATHER", "A2A_F", "A2A_B", "RING_F", "RING_B")  # schedules.COLLECTIVE_KINDS' names
STREAMS = tuple(s.name.lower() for s in Stream)

_INT_COLUMNS = ("device", "stream", "kind", "stage", "microbatch", "minibatch", "pipeline", "peer", "version",
                "prediction")
_MEASURED_COLUMNS = ("cpu_us", "wait_us")  # where a run measured them; -1.0 elsewhere, and left out of its file
_FLOAT_COLUMNS = ("start_us", "dur_us", *_MEASURED_COLUMNS)
_ARG_COLUMNS = ("stage", "microbatch", "minibatch", "pipeline", "peer", "version", "prediction")
_EVENT_FIELDS = {"device": "pid", "stream": "tid", "start_us": "ts", "dur_us": "dur"}  # the rest are args'
MAX_TRACE_US = COUNTER_LIMIT / 1e6  # the latest an op may end, in µs: the simulator's picosecond clock


class TraceError(ValueError):
    """A trace file that cannot be read; the message names the problem."""


@dataclass(eq=False)
class Ops:
    """One row per op. `kind` indexes `Trace.kinds`, `stream` indexes STREAMS; -1 means "not applicable"
    (`microbatch` of an optimizer step, `peer` of compute that runs alone (a part of an overlapped pair names
    its other part's stage), `version` of a transfer, `prediction` when the weights were not predicted).
    `cpu_us` is the CPU time an op took its rank's thread, where a run measured it (an executed SEND: its own
    cost, where its `dur_us` also holds the thread descheduled or waiting on a loaded host); `wait_us` how long a
    compute op waited for its turn on a GPU its rank shared with others (the executor's compute lock), just before
    it started: a measured gap before it holds that wait; -1.0 elsewhere (measured for none: one -1.0 broadcast over
    the rows, read-only)."""

    device: np.ndarray
    stream: np.ndarray
    kind: np.ndarray
    stage: np.ndarray
    microbatch: np.ndarray
    minibatch: np.ndarray
    pipeline: np.ndarray
    peer: np.ndarray
    version: np.ndarray
    prediction: np.ndarray
    start_us: np.ndarray
    dur_us: np.ndarray
    cpu_us: np.ndarray | None = None  # None: measured for none
    wait_us: np.ndarray | None = None  # None: measured for none

    def __post_init__(self) -> None:
        for name in _MEASURED_COLUMNS:
            if getattr(self, name) is None:  # a prediction's millions of rows hold no column of -1.0
                setattr(self, name, np.broadcast_to(-1.0, len(self.start_us)))
        for name in _INT_COLUMNS:  # integers of any width as given (a prediction's are narrow), else int64
            column = np.asarray(getattr(self, name))
            setattr(self, name, column if column.dtype.kind == "i" else column.astype(np.int64))
        for name in _FLOAT_COLUMNS:
            setattr(self, name, np.asarray(getattr(self, name), dtype=np.float64))
        lengths = {len(getattr(self, f.name)) for f in fields(self)}
        if len(lengths) > 1:
            raise TraceError(f"op columns have different lengths: {sorted(lengths)}")

    def __len__(self) -> int:
        return len(self.start_us)

    @property
    def end_us(self) -> np.ndarray:
        return self.start_us + self.dur_us

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Ops) and all(
            np.array_equal(getattr(self, f.name), getattr(other, f.name)) for f in fields(self)
        )


@dataclass(eq=False)
class Counter:
    """A step function per device: `values[i]` holds from `times_us[i]` until the next sample."""

    times_us: np.ndarray
    values: np.ndarray

    def __eq__(self, other: object) -> bool:
        return (
            isinstance(other, Counter)
            and np.array_equal(self.times_us, other.times_us)
            and np.array_equal(self.values, other.values)
        )


class RecordedMemoryCheck(TypedDict):
    """One device's peak checked against its memory as the simulation checked it (sim/cluster.py's MemoryCheck,
    field by field: `MemoryCheck.record`), so that a page drawn from the saved trace (`pipesim view`) draws the
    memory line, the OOM marks and the warning that simulate's own page drew."""

    device: int
    limit_bytes: int | None  # None: not known
    used_bytes: float
    sharers: list[int]
    memory: str | None
    peak_bytes: float


class _ScheduleShape(Protocol):
    """What a trace's meta reads off a schedule (schedules/ir.py `Schedule`), named by shape alone: a shared
    vocabulary imports nothing of ours, a type included."""

    @property
    def method(self) -> str: ...
    @property
    def params(self) -> dict[str, Any]: ...
    @property
    def microbatches(self) -> int: ...
    @property
    def minibatches(self) -> int: ...
    @property
    def pipelines(self) -> int: ...
    @property
    def placement(self) -> Any: ...
    @property
    def graph(self) -> Any: ...
    @property
    def policy(self) -> Any: ...


@dataclass
class TraceMeta:
    """What a trace describes, the same for predicted and measured runs, so either can be compared with
    the other or re-simulated.

    `params`: the schedule's build parameters; `placement` (stage -> device) and `stage_edges` its stage
    graph; `policy`: its weight policy as data. A prediction records its per-stage `costs` and `cluster`;
    a measurement its `hardware` (devices, backend, threads). A prediction's `calibration` names the profile
    its costs were measured into (model, micro-batch size, dtype, device, threads) and the optimizer whose step
    they price; None: typed what-if costs, whose times describe no machine. `complete` is false when a run stopped
    early, `failed_rank` then names the rank that failed, if one did. `peak_memory_parts`: per device, the bytes
    of each of `MEMORY_PARTS` at the moment of its `memory_bytes` peak, which they sum to (None: the source does
    not break memory down, as a measurement); `peak_activation_parts` splits its activations likewise by what saves
    them (attention, mlp, norms, dropout, other: all other where the costs do not say). `memory_checks`: per
    device, its peak against its memory as simulate checked it (None: not checked, as a measurement, or a trace
    written before they were recorded). `extra` holds what a source adds (a measured run's losses, say).
    """

    source: Literal["predicted", "measured"]
    schedule: str
    params: dict[str, Any]
    microbatches: int
    minibatches: int
    pipelines: int
    microbatch_size: int
    placement: list[int]
    stage_edges: list[list[int]]
    policy: dict[str, Any]
    tool: str
    costs: list[dict[str, Any]] | None = None
    cluster: dict[str, Any] | None = None
    hardware: dict[str, Any] | None = None
    jitter: float = 0.0
    seed: int = 0
    complete: bool = True
    failed_rank: int | None = None
    calibration: dict[str, Any] | None = None
    peak_memory_parts: list[dict[str, int]] | None = None
    peak_activation_parts: list[dict[str, int]] | None = None
    memory_checks: list[RecordedMemoryCheck] | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def batch_copies(self) -> tuple[tuple[int, str], ...]:
        """The copies of m micro-batches one update trains on, as (count, noun): one on each of the d data-parallel
        replicas and of the P pipelines (AvgPipe's), so that a caption names every factor of `samples_per_minibatch`,
        which samples/s counts (run's "4 x 8 samples" under P = 2 left half of them out)."""
        return (int(self.params.get("data_parallel", 1)), "replica"), (self.pipelines, "pipeline")

    @property
    def rounds(self) -> int:
        """The flushes each mini-batch's micro-batches ran in (`--rounds`; a trace from before it: one)."""
        return int(self.params.get("rounds", 1))

    @property
    def samples_per_minibatch(self) -> int:
        """Samples one update trains on: m micro-batches of b on each of its `batch_copies`."""
        return self.microbatches * self.microbatch_size * math.prod(count for count, _ in self.batch_copies)

    @property
    def incomplete_text(self) -> str:
        """A run that stopped part-way as compare's and view's notes name it: "incomplete (rank 1 failed)", or
        "incomplete" where no rank was at fault (Ctrl-C, a time limit); "" for a complete trace. Where the ranks
        were numbered in another order than the trace's devices (`pipesim run --rank-order megatron`), the rank's
        device too: "rank 1, device 2, failed"."""
        if self.complete:
            return ""
        if self.failed_rank is None:
            return "incomplete"
        device_ranks = self.extra.get("device_ranks") or []
        device = device_ranks.index(self.failed_rank) if self.failed_rank in device_ranks else self.failed_rank
        where = "" if device == self.failed_rank else f", device {device},"
        return f"incomplete (rank {self.failed_rank}{where} failed)"

    @property
    def shares_gpu(self) -> bool:
        """Whether the run's ranks shared GPUs: the host-staged transport on CUDA (workload/transport.py
        `HostStagedTransport`), under which the executor holds a GPU until a row's kernels finish, so each row
        was issued to an idle GPU (executor/runtime.py)."""
        hardware = self.hardware or {}
        return bool(hardware.get("host_staged")) and hardware.get("device") == "cuda"

    @property
    def counts_posted_receives(self) -> bool:
        """Whether the memory a run measured holds the buffers of its receives posted ahead: not where a
        host-staged GPU run posts them in host memory (`shares_gpu`)."""
        return not self.shares_gpu

    @classmethod
    def of_schedule(cls, source: Literal["predicted", "measured"], schedule: _ScheduleShape, microbatch_size: int,
                    **recorded: Any) -> TraceMeta:
        """The meta of a trace of `schedule`: its shape, placement, stage graph and weight policy, which simulate
        (sim/engine.py) and run (executor/runners.py) record alike, so that either trace re-simulates or compares
        as the other; `recorded`: the fields one source adds (a prediction's costs, a run's hardware)."""
        return cls(source=source, schedule=schedule.method, params=dict(schedule.params),
                   microbatches=schedule.microbatches, minibatches=schedule.minibatches, pipelines=schedule.pipelines,
                   microbatch_size=microbatch_size, placement=list(schedule.placement),
                   stage_edges=[list(e) for e in schedule.graph.edges], policy=schedule.policy.describe(),
                   tool=f"pipesim {__version__}", **recorded)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, doc: Any) -> TraceMeta:
        """Check a stored document field by field; TraceError names the first field that is wrong."""
        from pydantic import TypeAdapter, ValidationError

        if not isinstance(doc, dict):
            raise TraceError(f"pipesim header: meta: give an object of fields (got {json.dumps(doc)[:40]})")
        unknown = sorted(set(doc) - {f.name for f in fields(cls)})
        if unknown:
            known = [f.name for f in fields(cls)]
            raise TraceError(f"pipesim header: meta: unknown field {unknown[0]!r}{nearest_text(unknown[0], known)}")
        try:
            meta = TypeAdapter(cls).validate_json(json.dumps(doc), strict=True)  # JSON types, no coercion
        except ValidationError as exc:  # a field's error: its loc names it (`doc` is an object)
            raise TraceError(f"pipesim header: meta.{first_error(exc)}") from None
        for name in ("microbatches", "minibatches", "pipelines", "microbatch_size"):  # a count, which view drew
            if getattr(meta, name) < 1:  # from whatever it was
                given = getattr(meta, name)
                raise TraceError(f"pipesim header: meta.{name}: {number_allowed(1, None)} (got {given:,})")
        if (refusal := _recorded_refusal(meta)) is not None:
            raise TraceError(f"pipesim header: meta.{refusal}")
        return meta


def _whole(least: int) -> Callable[[Any], bool]:
    return lambda value: isinstance(value, int) and not isinstance(value, bool) and value >= least


def _stage_bounds(value: Any) -> bool:
    """Stage bounds (executor/stages.py `check_bounds`): from 0, never falling, the first and last stages holding a
    layer; any stage between them may hold none (a layout's empty stage)."""
    return (isinstance(value, list) and len(value) >= 2 and value[0] == 0 and all(map(_whole(0), value))
            and all(a <= b for a, b in zip(value, value[1:])) and value[1] > 0 and value[-2] < value[-1])


def _is(kind: type) -> Callable[[Any], bool]:
    return lambda value: isinstance(value, kind)


_NAME, _OBJECT = (_is(str), "a name (a string)"), (_is(dict), "an object of the model's options")
_COUNT = (_whole(1), number_allowed(1, None).removeprefix("give "))
# The fields of the meta's open objects (`params`, `extra`, `hardware`, `calibration`) that pipesim reads back
# (compare, its prediction of a run from what the run recorded, view), each with what it allows: checked as the
# trace is read, so that a hand-edited value is one line naming it, not the KeyError or TypeError of a reader. Any
# may be absent (a file from before it was recorded, a torch.distributed.pipelining run, a prediction's own fields);
# the optimizers are `optimizer_refusal`'s, and a host's load is read where it is whole (traces/hostload.py).
_RECORDED: dict[str, tuple[Callable[[Any], bool], str]] = {
    "params.data_parallel": _COUNT,
    "extra.model": _NAME, "extra.dtype": _NAME, "extra.model_options": _OBJECT,
    "extra.bounds": (_stage_bounds, "the stages' first layers and the layer count, whole numbers from 0 never "
                                    "falling, the first and last stages holding a layer"),
    "hardware.device": _NAME, "hardware.runtime": _NAME, "hardware.host_staged": (_is(bool), "true or false"),
    "hardware.compute": (lambda value: isinstance(value, list) and all(map(_is(str), value)),
                         'a list of each rank\'s "host/device"'),
    "hardware.ranks": _COUNT, "hardware.threads_per_rank": _COUNT,
    "calibration.model": _NAME, "calibration.dtype": _NAME, "calibration.device": _NAME,
    "calibration.passes_as": _NAME, "calibration.options": _OBJECT,
    "calibration.ranks": _COUNT,
    "calibration.unmeasured": (lambda value: isinstance(value, list) and all(map(_is(str), value)),
                               "a list of the host terms not measured"),
    "calibration.host_terms": (lambda value: isinstance(value, dict) and all(map(_is(dict), value.values())),
                               "an object of the host terms, each an object"),
}


def _recorded_refusal(meta: TraceMeta) -> str | None:
    """The first of `_RECORDED`'s fields and recorded optimizers that `meta` holds a value outside what it allows,
    as "FIELD: give WHAT (got VALUE)" (the field under meta, the value as the file writes it); None where all hold."""
    for section in ("extra", "calibration"):
        name = (getattr(meta, section) or {}).get("optimizer")
        if name is not None and (refusal := optimizer_refusal(name, f"{section}.optimizer")) is not None:
            return refusal
    for where, (allows, allowed) in _RECORDED.items():
        section, name = where.split(".")
        value = (getattr(meta, section) or {}).get(name)
        if value is not None and not allows(value):
            return f"{where}: give {allowed} (got {json.dumps(value)[:60]})"
    return None


@dataclass(eq=False)
class Trace:
    """What happened (or is predicted to happen), when, on which weights, with how much memory.

    counters: name -> one Counter per device. Known names: `memory_bytes`, `sending_bytes` (a measured run's: of
    its memory, what only sends still in flight hold), `activations` (micro-batches
    whose activations are held), `weight_versions` (copies of one stage's weights held), and a prediction's
    `memory_bytes.PART` for each of `MEMORY_PARTS`, which add up to `memory_bytes` on each device whose curves
    they hold (every device's from the engine; the fullest's only, reserve included, once a planning `Scenario`
    adds the reserve: the others' are empty), and `memory_bytes.activations.SAVER` for each
    of what saves activations (attention, mlp, norms, dropout, other), which add up to its activations.
    """

    kinds: tuple[str, ...]
    num_devices: int
    ops: Ops
    meta: TraceMeta
    counters: dict[str, list[Counter]] = field(default_factory=dict)

    def __eq__(self, other: object) -> bool:
        return (
            isinstance(other, Trace)
            and self.kinds == other.kinds
            and self.num_devices == other.num_devices
            and self.ops == other.ops
            and self.counters == other.counters
            and self.meta == other.meta
        )

    def kind_code(self, name: str) -> int:
        """The code of kind `name` in this trace, or -1 when it has none."""
        return self.kinds.index(name) if name in self.kinds else -1

    def op_label(self, i: int) -> str:
        """A short display name, e.g. `F3` or `F3.1` (micro-batch 3 of mini-batch 1), `OPT.1`."""
        ops = self.ops
        label = self.kinds[ops.kind[i]]
        if ops.microbatch[i] >= 0:
            label += str(ops.microbatch[i])
        if ops.minibatch[i]:
            label += f".{ops.minibatch[i]}"
        return label


def to_chrome(trace: Trace) -> dict[str, Any]:
    """The Chrome Trace Event document for `trace`."""
    events: list[dict[str, Any]] = []
    for d in range(trace.num_devices):
        events.append({"ph": "M", "name": "process_name", "pid": d, "args": {"name": f"device {d}"}})
        events.append({"ph": "M", "name": "process_sort_index", "pid": d, "args": {"sort_index": d}})
        for stream in Stream:
            events.append({"ph": "M", "name": "thread_name", "pid": d, "tid": int(stream),
                           "args": {"name": STREAMS[stream]}})
    ops = trace.ops
    columns = {name: getattr(ops, name).tolist() for name in _INT_COLUMNS + _FLOAT_COLUMNS}
    for i in range(len(ops)):
        events.append({
            "ph": "X",
            "name": trace.op_label(i),
            "cat": trace.kinds[columns["kind"][i]],
            "pid": columns["device"][i],
            "tid": columns["stream"][i],
            "ts": columns["start_us"][i],
            "dur": columns["dur_us"][i],
            "args": {name: columns[name][i] for name in _ARG_COLUMNS}
            | {name: columns[name][i] for name in _MEASURED_COLUMNS if columns[name][i] >= 0},
        })
    for name, per_device in trace.counters.items():
        for d, counter in enumerate(per_device):
            for t, v in zip(counter.times_us.tolist(), counter.values.tolist()):
                events.append({"ph": "C", "name": name, "pid": d, "ts": t, "args": {"value": v}})
    return {
        "traceEvents": events,
        "displayTimeUnit": "ms",
        "pipesim": {
            "schema_version": SCHEMA_VERSION,
            "kinds": list(trace.kinds),
            "streams": list(STREAMS),
            "num_devices": trace.num_devices,
            "counters": list(trace.counters),
            "meta": trace.meta.to_dict(),
        },
    }


_HEADER_KEYS = ("schema_version", "kinds", "streams", "num_devices", "counters", "meta")  # `to_chrome`'s


def from_chrome(doc: Any) -> Trace:
    """Read a document written by `to_chrome`; raises TraceError naming what is missing or wrong."""
    if not isinstance(doc, dict) or not isinstance(doc.get("traceEvents"), list):
        raise TraceError("not a Chrome trace: expected an object with a 'traceEvents' list")
    head = doc.get("pipesim")
    if not isinstance(head, dict):
        raise TraceError("not a pipesim trace: the top-level 'pipesim' key is missing")
    if head.get("schema_version") != SCHEMA_VERSION:
        raise TraceError(
            f"trace schema_version {head.get('schema_version')!r} is not supported (this pipesim reads "
            f"{SCHEMA_VERSION})"
        )
    unknown = sorted(set(head) - set(_HEADER_KEYS))
    if unknown:  # `num_devicez` was read as no field at all, and the trace as one without it
        raise TraceError(f"pipesim header: unknown field {unknown[0]!r}{nearest_text(unknown[0], _HEADER_KEYS)}; "
                         f"allowed: {', '.join(_HEADER_KEYS)}")
    try:
        kinds = tuple(head["kinds"])
        num_devices = head["num_devices"]
        counter_names = list(head["counters"])
        meta = head["meta"]
    except (KeyError, TypeError, ValueError) as exc:
        raise TraceError(f"pipesim header: missing or malformed field {exc}") from None
    events = len(doc["traceEvents"])  # each device runs one at least: 10**12 devices took minutes to read
    if not events:  # said as the devices' count "from 1 to 1" before
        raise TraceError("traceEvents: empty, where a pipesim trace holds every op its devices ran")
    if not isinstance(num_devices, int) or isinstance(num_devices, bool) or not 1 <= num_devices <= events:
        raise TraceError(f"pipesim header: num_devices: {number_allowed(1, events)} (no more than the trace's "
                         f"events: each device runs one at least; got {json.dumps(num_devices)})")
    streams = tuple(head.get("streams", ()))
    if streams != STREAMS[:max(len(streams), 3)]:  # a trace written before the network stream names three
        raise TraceError(f"pipesim header: streams: give {json.dumps(list(STREAMS))} (got {json.dumps(list(streams))})")
    kind_codes = {k: i for i, k in enumerate(kinds)}
    columns: dict[str, list] = {name: [] for name in _INT_COLUMNS + _FLOAT_COLUMNS}
    samples: dict[tuple[str, int], tuple[list, list]] = {}
    op_events: list[int] = []  # each op's index in traceEvents
    index = 0
    try:
        for index, event in enumerate(doc["traceEvents"]):
            if not isinstance(event, dict):
                raise TraceError(f"trace event {index:,}: give an object (got {json.dumps(event)[:40]})")
            phase = event.get("ph")
            if phase == "X":
                if event.get("cat") not in kind_codes:
                    raise TraceError(f"trace event {index:,}: cat: give one of the header's kinds ({', '.join(kinds)}) "
                                     f"(got {json.dumps(event.get('cat'))[:40]})")
                op_events.append(index)
                args = event["args"]
                columns["device"].append(event["pid"])
                columns["stream"].append(event["tid"])
                columns["kind"].append(kind_codes[event["cat"]])
                columns["start_us"].append(event["ts"])
                columns["dur_us"].append(event["dur"])
                for name in _MEASURED_COLUMNS:  # written where measured
                    columns[name].append(args.get(name, -1.0))
                for name in _ARG_COLUMNS:
                    columns[name].append(args[name])
            elif phase == "C":
                times, values = samples.setdefault((event["name"], event["pid"]), ([], []))
                times.append(event["ts"])
                values.append(event["args"]["value"])
    except (KeyError, TypeError, AttributeError) as exc:
        raise TraceError(f"malformed trace event {index:,}: missing or wrong field {exc}") from None
    # JSON's numbers of the right kind ("0", 0.5 or true read as a stage), that numpy holds (10**20 a stage, 10**400 a
    # time: numpy's traceback)
    if any(not set(map(type, values)) <= ({int} if name in _INT_COLUMNS else {int, float})
           for name, values in columns.items()):
        _refuse_number(columns, op_events)
    try:
        ops = Ops(**columns)
    except OverflowError:
        _refuse_number(columns, op_events)
    # an op that ends before it starts would break every interval computed from the trace (summarize's merge)
    bad = np.flatnonzero(~np.isfinite(ops.start_us) | ~np.isfinite(ops.dur_us) | (ops.dur_us < 0)
                         | (np.abs(ops.start_us) + np.abs(ops.dur_us) > MAX_TRACE_US))
    if len(bad):
        i = int(bad[0])
        raise TraceError(f"{_op_text(i, ops, kinds, op_events)}: ts, dur: "
                         f"give finite numbers of µs, dur of at least 0, within {MAX_TRACE_US:.3g} µs of 0 (the "
                         f"simulator's clock; got ts={float(ops.start_us[i]):g}, dur={float(ops.dur_us[i]):g})")
    outside = np.flatnonzero((ops.device < 0) | (ops.device >= num_devices))
    if len(outside):
        i = int(outside[0])
        raise TraceError(f"trace event {op_events[i]:,} ({kinds[ops.kind[i]]}): pid {int(ops.device[i])} is not one "
                         f"of the trace's {num_devices} devices (0..{num_devices - 1})")
    # a counter's sample on no device of the trace: its curve was never drawn, and its device's memory read n/a
    stray = next(((name, pid) for name, pid in samples if name in counter_names
                  and (not isinstance(pid, int) or isinstance(pid, bool) or not 0 <= pid < num_devices)), None)
    if stray is not None:
        raise TraceError(f"counter {stray[0]!r}: pid {json.dumps(stray[1])} is not one of the trace's {num_devices} "
                         f"devices (0..{num_devices - 1})")
    counters = {}
    for name in counter_names:
        per_device = []
        for d in range(num_devices):
            times, values = (np.asarray(column) for column in samples.get((name, d), ([], [])))
            if len(times) and not (times.dtype.kind in "iuf" and values.dtype.kind in "iuf"
                                   and np.isfinite(times).all() and np.isfinite(values).all()
                                   and (values >= 0).all()):
                raise TraceError(f"counter {name!r} on device {d}: ts, args.value: give finite numbers, the value "
                                 "at least 0")
            per_device.append(Counter(times.astype(np.float64), values))
        counters[name] = per_device
    meta = TraceMeta.from_dict(meta)
    ranks = (meta.hardware or {}).get("ranks") or num_devices  # a data-parallel run's trace holds its p·d devices
    if meta.failed_rank is not None and not 0 <= meta.failed_rank < ranks:  # "rank 7 failed" of a 2-rank run
        raise TraceError(f"pipesim header: meta.failed_rank: {number_allowed(0, ranks - 1)}, one of the run's "
                         f"{ranks:,} ranks (got {meta.failed_rank:,})")
    _check_op_fields(ops, kinds, meta, op_events)
    parts = meta.peak_memory_parts
    later = {"runtime_buffers", "transient", "reserve"}  # the parts counted since breakdowns were first recorded
    if parts is not None and all(set(MEMORY_PARTS) - later <= set(held) <= set(MEMORY_PARTS) for held in parts):
        parts = meta.peak_memory_parts = [{part: held.get(part, 0) for part in MEMORY_PARTS} for held in parts]
    if parts is not None and (len(parts) != num_devices or any(set(held) != set(MEMORY_PARTS) for held in parts)):
        raise TraceError(f"pipesim header: meta.peak_memory_parts must hold, for each of the {num_devices} devices, "
                         f"the bytes of {', '.join(MEMORY_PARTS)}")
    savers = meta.peak_activation_parts
    if savers is not None and (parts is None or len(savers) != num_devices or any(
            sum(held.values()) != whole["activations"] for held, whole in zip(savers, parts))):
        raise TraceError("pipesim header: meta.peak_activation_parts must hold, for each device, bytes that sum to "
                         "its peak_memory_parts' activations")
    checks = meta.memory_checks
    devices = set(range(num_devices))
    if checks is not None and ([check["device"] for check in checks] != list(range(num_devices)) or any(
            check["device"] not in check["sharers"] or not set(check["sharers"]) <= devices  # the warning names them
            or not 0 <= check["used_bytes"] < math.inf or not 0 <= check["peak_bytes"] < math.inf  # a NaN: no page
            or (check["limit_bytes"] or 0) < 0 for check in checks)):
        raise TraceError(f"pipesim header: meta.memory_checks must hold one check for each of the {num_devices} "
                         "devices, in order, each sharers list naming its device among the trace's, and bytes "
                         "finite and >= 0")
    return Trace(kinds, num_devices, ops, meta, counters)


def _check_op_fields(ops: Ops, kinds: tuple[str, ...], meta: TraceMeta, op_events: list[int]) -> None:
    """Each op's indices within what the header says the run had (its stages, N mini-batches, P pipelines and m
    micro-batches, -1 where none applies: a micro-batch of 99 in a run of 4 was "not predicted", a mini-batch past
    N drawn as a step of -0.593 ms), and each compute op run once (a second F0 was "not predicted", where the
    prediction has one): TraceError naming the first op's event and field."""
    ranges = {"stage": (0, len(meta.placement)), "minibatch": (0, meta.minibatches), "pipeline": (0, meta.pipelines),
              "microbatch": (-1, meta.microbatches), "peer": (-1, None), "version": (-1, None),
              "prediction": (-1, None)}
    for name, (least, bound) in ranges.items():
        column = getattr(ops, name)
        bad = np.flatnonzero((column < least) | (column >= bound if bound is not None else False))
        if len(bad):
            i = int(bad[0])
            raise TraceError(f"{_op_text(i, ops, kinds, op_events)}: "
                             f"args.{name}: {number_allowed(least, None if bound is None else bound - 1)} (got "
                             f"{int(column[i]):,})")
    compute = np.flatnonzero(np.isin(ops.kind, [kinds.index(k) for k in ("F", "B", "I", "W") if k in kinds]))
    keys = np.stack([getattr(ops, name)[compute] for name in ("device", "kind", "stage", "microbatch", "minibatch",
                                                               "pipeline")], axis=1)
    order = np.lexsort(keys.T)
    repeats = np.flatnonzero((keys[order][1:] == keys[order][:-1]).all(axis=1))
    if len(repeats):
        i = int(compute[max(order[repeats[0]], order[repeats[0] + 1])])  # the later of the two
        raise TraceError(f"{_op_text(i, ops, kinds, op_events)}: stage "
                         f"{ops.stage[i]}, micro-batch {ops.microbatch[i]} of mini-batch {ops.minibatch[i]} runs "
                         "twice: each compute op runs once")


def _refuse_number(columns: dict[str, list], op_events: list[int]) -> NoReturn:
    """TraceError naming the first op's field that is no number numpy holds (`_numeric`)."""
    name, i = next((name, i) for name, values in columns.items() for i, value in enumerate(values)
                   if not _numeric(value, name in _INT_COLUMNS))
    raise TraceError(f"trace event {op_events[i]:,}: {_EVENT_FIELDS.get(name, 'args.' + name)}: give "
                     f"{'a whole number' if name in _INT_COLUMNS else 'a number'} that numpy holds (got "
                     f"{json.dumps(columns[name][i])[:40]})")


def _numeric(value: Any, whole: bool) -> bool:
    """A JSON number (not a boolean), and a whole one where `whole`, that numpy holds: a whole number in int64, any
    other in float64 (JSON's floats are; an integer beyond 2**1023 is not)."""
    if isinstance(value, bool) or not isinstance(value, int if whole else (int, float)):
        return False
    return isinstance(value, float) or -2 ** (63 if whole else 1023) <= value < 2 ** (63 if whole else 1023)


def _op_text(i: int, ops: Ops, kinds: tuple[str, ...], op_events: list[int]) -> str:
    """How a refusal names op `i`: its event's index in traceEvents, its kind and device."""
    return f"trace event {op_events[i]:,} ({kinds[ops.kind[i]]} on device {ops.device[i]})"


_OWN_FD = re.compile(r"/(?:proc/(self|\d+)/fd|dev/fd)/(\d+)")  # a descriptor of a process, by number


def _own_descriptor(path: str | os.PathLike[str]) -> int | None:
    """The descriptor of this process that `path` names (/dev/stdout, /dev/fd/N, /proc/self/fd/N, perhaps
    through symlinks), else None."""
    hop = os.path.abspath(path)
    for _ in range(40):  # the symlinks of the last component, as far as the kernel would follow them
        match = _OWN_FD.fullmatch(hop)
        if match and match[1] in (None, "self", str(os.getpid())):
            return int(match[2])
        try:
            hop = os.path.normpath(os.path.join(os.path.dirname(hop), os.readlink(hop)))
        except OSError:
            return None
    return None


def writes_in_place(path: str | os.PathLike[str]) -> bool:
    """Whether `write_atomic` writes `path` directly instead of replacing it: it is (perhaps through symlinks)
    one of this process's descriptors (/dev/stdout), a FIFO, a device, or anything else not a regular file."""
    if _own_descriptor(path) is not None:
        return True
    try:
        return not stat.S_ISREG(os.stat(path).st_mode)
    except OSError:  # nothing there yet (or a dangling link): a new file
        return False


def write_atomic(path: str | os.PathLike[str], text: str | bytes) -> None:
    """Write `text` (or bytes) to `path`, leaving no half-written file: a new or regular file is written to a
    temporary file beside it and renamed over it (keeping its permissions); through a symlink the file it
    points to is replaced and the link kept. A FIFO or a device cannot be replaced, so it is written directly,
    and /dev/stdout (any descriptor of this process) through the descriptor itself, after what was printed,
    even when it is a regular file. An OSError names `path` as given."""
    write_all_atomic([(path, text)])


def write_all_atomic(files: Iterable[tuple[str | os.PathLike[str], str | bytes]]) -> None:
    """Write each (path, text) of `files` as `write_atomic` does, all or none where it can be: every file to be
    replaced is first written to its temporary file, one text at a time, and only once all are written are they
    renamed over their paths, so a write that fails (a full disk) leaves every one as it was. Not held back: a
    file written in place (a FIFO, /dev/stdout), written as its turn comes, and the renames themselves: one that
    fails (rare: the folder's entries, not its space) leaves those renamed before it replaced."""
    staged: list[tuple[str, Path, str | os.PathLike[str]]] = []  # (temporary file, the file it replaces, as given)
    try:
        for path, text in files:
            data = text.encode("utf-8") if isinstance(text, str) else text
            try:
                fd = _own_descriptor(path)
                if fd is not None:
                    for stream in (sys.stdout, sys.stderr):  # what was printed comes first
                        if stream is not None:
                            stream.flush()
                    view = memoryview(data)
                    while view:
                        view = view[os.write(fd, view):]
                elif writes_in_place(path):
                    with open(path, "wb") as handle:
                        handle.write(data)
                else:
                    target = Path(os.path.realpath(path))
                    staged.append((_stage(target, data), target, path))
            except OSError as exc:
                raise _named(exc, path) from None
        for tmp, target, path in staged:
            try:
                os.replace(tmp, target)
            except OSError as exc:
                raise _named(exc, path) from None
    except BaseException:
        for tmp, *_ in staged:
            Path(tmp).unlink(missing_ok=True)
        raise


def _named(exc: OSError, path: str | os.PathLike[str]) -> OSError:
    """`exc` naming `path` as the user gave it."""
    return OSError(exc.errno, exc.strerror or str(exc), os.fspath(path))


def _stage(target: Path, data: bytes) -> str:
    """`data` in a temporary file beside `target`, with the permissions `target` has (a new file's: what open()
    would give it), to be renamed over it."""
    try:
        mode = stat.S_IMODE(os.stat(target).st_mode)
    except FileNotFoundError:
        umask = os.umask(0)
        os.umask(umask)
        mode = 0o666 & ~umask  # what open() would give a new file
    fd, tmp = _temporary_beside(target)
    try:
        os.chmod(tmp, mode)  # mkstemp makes 0600
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return tmp


def _temporary_beside(target: Path) -> tuple[int, str]:
    """A new temporary file in `target`'s folder, hidden and named after it: (its descriptor, its path)."""
    return tempfile.mkstemp(prefix=f".{target.name}.", dir=target.parent)


def check_stageable(path: str | os.PathLike[str]) -> None:
    """Make and remove the temporary file `write_atomic` would write `path`'s text to, so that a folder that takes
    no new file is found before the work, not at the write: a file system's refusal (/proc, /sys, a read-only
    mount) that a permission check passes for root. An OSError says why."""
    fd, tmp = _temporary_beside(Path(os.path.realpath(path)))
    os.close(fd)
    os.unlink(tmp)


def write_trace(trace: Trace, path: str | os.PathLike[str]) -> None:
    write_traces([(trace, path)])


def write_traces(traces: Iterable[tuple[Trace, str | os.PathLike[str]]]) -> None:
    """Each (trace, path), all or none as `write_all_atomic` can: a later one that cannot be written leaves no
    earlier (but for one written in place, or a rename that fails after others succeeded)."""
    write_all_atomic((path, json.dumps(to_chrome(trace), separators=(",", ":"))) for trace, path in traces)


# where a torch.profiler trace (or a folder of them) is given as pipesim's: what reads it
TORCH_PROFILER_READER = ("`pipesim compare FOLDER PREDICTED` reads torch.profiler traces, a folder of them one per "
                         "rank, against a predicted trace (`pipesim simulate ... --trace`)")


def read_trace(path: str | os.PathLike[str]) -> Trace:
    if os.path.isdir(path):  # False where the path cannot be looked at: read_json says why
        raise TraceError(f"{path} is a folder; give a pipesim trace file ({TORCH_PROFILER_READER})")
    doc = read_document(path, TRACE, TraceError)  # another kind is named, not "not a Chrome trace: expected ..."
    if isinstance(doc, dict) and "schemaVersion" in doc and "pipesim" not in doc:  # Kineto's key, torch.profiler's
        raise TraceError(f"{path} is a torch.profiler trace, not pipesim's: {TORCH_PROFILER_READER}")
    try:
        return from_chrome(doc)
    except TraceError as exc:
        raise TraceError(f"trace {path}: {exc}") from None
