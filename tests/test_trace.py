"""The trace contract: typed metadata and streams, the same for predicted and measured runs."""

import dataclasses
import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipesim.schedules import KINDS, ScheduleParams, build_schedule
from pipesim.sim import Cluster, Costs, simulate
from pipesim.traces import Stream, TraceError, read_trace, write_trace
from pipesim.traces.metrics import merged_intervals


@pytest.fixture(scope="module")
def predicted():
    schedule = build_schedule("pipedream", ScheduleParams(3, 2, 3))
    return simulate(schedule, Costs.per_stage(3, fwd_ms=1, bwd_ms=2, output_mb=1), Cluster.uniform(3, 0.1))


def test_streams_follow_the_kinds():
    assert [Stream.of_kind(k.value) for k in KINDS] == (
        [Stream.COMPUTE] * 7 + [Stream.NETWORK] * 6 + [Stream.SEND, Stream.RECV] * 2)


def test_a_predicted_trace_says_so_and_puts_each_op_on_its_kinds_stream(predicted):
    assert predicted.meta.source == "predicted" and predicted.meta.complete
    assert predicted.meta.samples_per_minibatch == 2
    assert np.array_equal(predicted.ops.stream, Stream.of_kinds(predicted.kinds)[predicted.ops.kind])
    assert set(predicted.ops.stream.tolist()) == {Stream.COMPUTE, Stream.SEND, Stream.RECV}


def test_a_measured_incomplete_trace_round_trips(predicted, tmp_path):
    measured = dataclasses.replace(predicted, meta=dataclasses.replace(
        predicted.meta, source="measured", costs=None, cluster=None, complete=False, failed_rank=1,
        hardware={"device": "cpu", "backend": "gloo", "threads_per_rank": 1},
        extra={"loss": [2.3, 2.1], "last_action": "1B0.1"}))
    path = tmp_path / "m.json"
    write_trace(measured, path)
    again = read_trace(path)
    assert again == measured and again.meta.failed_rank == 1 and not again.meta.complete
    assert again.meta.incomplete_text == "incomplete (rank 1 failed)"


def test_a_failed_rank_numbered_apart_from_its_device_names_both(predicted):
    """Under `run --rank-order megatron` (p = 2, d = 2) rank 1 runs replica 1's device 0, the trace's device 2."""
    meta = dataclasses.replace(predicted.meta, source="measured", complete=False, failed_rank=1,
                               extra={"device_ranks": [0, 2, 1, 3]})
    assert meta.incomplete_text == "incomplete (rank 1, device 2, failed)"
    assert dataclasses.replace(meta, extra={"device_ranks": [0, 1, 2, 3]}).incomplete_text == (
        "incomplete (rank 1 failed)")


@pytest.mark.parametrize("edit,fragment", [
    (lambda meta: meta.update(microbatches="2"), "meta.microbatches: give a whole number, without quotes (got '2')"),
    (lambda meta: meta.update(source="simulated"), "meta.source: Input should be 'predicted' or 'measured'"),
    (lambda meta: meta.pop("schedule"), "meta.schedule: required, and missing"),
    (lambda meta: meta.update(flavour=1), "meta: unknown field 'flavour'"),
    (lambda meta: meta.update(complete="yes"), "meta.complete: give true or false (got 'yes')"),
    # counts out of range: `view` drew such a trace, `compare` called it another run
    (lambda meta: meta.update(microbatches=-4), "meta.microbatches: give a whole number of at least 1 (got -4)"),
    (lambda meta: meta.update(microbatch_size=0), "meta.microbatch_size: give a whole number of at least 1 (got 0)"),
    (lambda meta: meta.update(memory_checks=[{"device": 0}]),
     "meta.memory_checks.0.limit_bytes: required, and missing"),
    (lambda meta: meta.update(memory_checks=[_check(1), _check(0), _check(2)]),
     "meta.memory_checks must hold one check for each of the 3 devices, in order"),
    (lambda meta: meta.update(memory_checks=[{**_check(0), "memory": "gpu0", "sharers": []}, _check(1), _check(2)]),
     "each sharers list naming its device among the trace's"),  # view's warning named them: an IndexError
    (lambda meta: meta.update(memory_checks=[{**_check(0), "sharers": [0, 3]}, _check(1), _check(2)]),
     "each sharers list naming its device among the trace's"),
    (lambda meta: meta.update(memory_checks=[{**_check(0), "used_bytes": float("nan")}, _check(1), _check(2)]),
     "and bytes finite and >= 0"),  # view's page data held a NaN, which its script's JSON.parse refused: a blank page
    (lambda meta: meta.update(memory_checks=[_check(0), {**_check(1), "limit_bytes": -5}, _check(2)]),
     "and bytes finite and >= 0"),
])
def test_bad_metadata_names_the_field(predicted, tmp_path, edit, fragment):
    assert fragment in _refusal_once_edited(predicted, tmp_path, lambda doc: edit(doc["pipesim"]["meta"]))


@pytest.mark.parametrize("edit,fragment", [
    (lambda doc: doc["pipesim"]["meta"].update(microbatchez=4),
     "meta: unknown field 'microbatchez' (did you mean 'microbatches'?)"),
    (lambda doc: doc["pipesim"].update(num_devicez=3),  # read as no field at all
     "pipesim header: unknown field 'num_devicez' (did you mean 'num_devices'?); allowed: schema_version, kinds, "),
    (lambda doc: [event for event in doc["traceEvents"] if event["ph"] == "X"][0].update(args=None),
     "malformed trace event {first}: missing or wrong field"),
])
def test_a_misspelt_header_field_or_a_broken_event_is_named_with_what_was_meant(predicted, tmp_path, edit, fragment):
    """A new user's pass: a misspelt meta field was "unknown field" with nothing meant, a misspelt header field was
    read as none, and an event without its args was not said which."""
    from pipesim.traces.trace import to_chrome

    first = next(i for i, event in enumerate(to_chrome(predicted)["traceEvents"]) if event["ph"] == "X")
    assert fragment.format(first=first) in _refusal_once_edited(predicted, tmp_path, edit)


def _check(device: int) -> dict:
    from pipesim.sim.cluster import MemoryCheck

    return MemoryCheck(device, 2**30, 2.0**29, (device,), None, 2.0**29).record()


def test_memory_checks_round_trip_and_a_trace_written_before_them_reads_without(predicted, tmp_path):
    """simulate records each device's memory check, which `view` draws from: it reads back as written, the
    MemoryCheck it came from; a trace without them (written before) reads with None."""
    from pipesim.sim.cluster import MemoryCheck

    checked = dataclasses.replace(predicted, meta=dataclasses.replace(predicted.meta,
                                                                      memory_checks=[_check(d) for d in range(3)]))
    path = tmp_path / "t.json"
    write_trace(checked, path)
    again = read_trace(path)
    assert again == checked
    assert MemoryCheck.of_record(again.meta.memory_checks[1]) == MemoryCheck(1, 2**30, 2.0**29, (1,), None, 2.0**29)
    doc = json.loads(path.read_text())
    del doc["pipesim"]["meta"]["memory_checks"]
    path.write_text(json.dumps(doc))
    assert read_trace(path).meta.memory_checks is None


def _refusal_once_edited(trace, tmp_path, edit) -> str:
    """`trace` written, its document changed by `edit` and read again: the message it is refused with."""
    path = tmp_path / "t.json"
    write_trace(trace, path)
    doc = json.loads(path.read_text())
    edit(doc)
    path.write_text(json.dumps(doc))
    with pytest.raises(TraceError) as refused:
        read_trace(path)
    return str(refused.value)


@pytest.mark.parametrize("edit,fragment", [
    (lambda doc: doc["pipesim"].update(num_devices=-1), "num_devices: give a whole number from 1 to "),
    # 10**12 took minutes, infinity showed int()'s OverflowError, 2.5 read as 2 and "3" as 3
    *((lambda doc, bad=bad: doc["pipesim"].update(num_devices=bad),
       f"(no more than the trace's events: each device runs one at least; got {json.dumps(bad)})")
      for bad in (10**12, float("inf"), 2.5, "3", True, 0)),
    # said as "num_devices: give a whole number from 1 to 1, the trace's events (got 3)"
    (lambda doc: doc.update(traceEvents=[]), "traceEvents: empty, where a pipesim trace holds every op its devices"),
    (lambda doc: next(e for e in doc["traceEvents"] if e.get("ph") == "X").update(pid=3),
     "trace event 18 (F): pid 3 is not one of the trace's 3 devices (0..2)"),  # its index in traceEvents
])
def test_devices_out_of_range_are_refused(predicted, tmp_path, edit, fragment):
    """`view` drew a trace of -1 devices, and an op on a device the trace does not have."""
    assert fragment in _refusal_once_edited(predicted, tmp_path, edit)


@pytest.mark.parametrize("edit,line", [
    (lambda doc: doc["pipesim"].update(meta=[1]), "pipesim header: meta: give an object of fields (got [1])"),
    (lambda doc: doc["pipesim"].update(streams=["compute", "send"]),
     'pipesim header: streams: give ["compute", "send", "recv", "network"] (got ["compute", "send"])'),
    (lambda doc: doc["pipesim"]["meta"].update(minibatches=-1200),
     "pipesim header: meta.minibatches: give a whole number of at least 1 (got -1,200)"),
])
def test_a_header_field_is_refused_in_the_one_wording(predicted, tmp_path, edit, line):
    """A trace file's header field is refused as a flag is, "FIELD: give WHAT IS ALLOWED (got VALUE)", where it read
    "meta must be an object" or "streams must be [...]" (which did not say what the file held)."""
    assert _refusal_once_edited(predicted, tmp_path, edit) == f"trace {tmp_path / 't.json'}: {line}"


@pytest.mark.parametrize("field,value,fragment", [
    ("dur", -1.0, "dur of at least 0, within 4.61e+12 µs of 0 (the simulator's clock; got ts="),
    ("ts", float("nan"), "trace event 18 (F on device 0): ts, dur: give finite numbers of µs, dur of at least 0, "
                         "within 4.61e+12 µs of 0 (the simulator's clock; got ts=nan, dur="),
    ("dur", "long", 'trace event 18: dur: give a number that numpy holds (got "long")'),
    ("ts", 10**400, "trace event 18: ts: give a number that numpy holds (got 1000000000"),
    # past the simulator's clock: compare read "no op took time", view drew the rest
    ("ts", 1e300, "(the simulator's clock; got ts=1e+300, dur="),
    ("dur", 1e18, "(the simulator's clock; got ts=0, dur=1e+18)"),
])
def test_an_op_that_ends_before_it_starts_or_is_not_a_time_is_refused(predicted, tmp_path, field, value, fragment):
    def edit(doc):
        next(e for e in doc["traceEvents"] if e.get("ph") == "X").update({field: value})

    assert fragment in _refusal_once_edited(predicted, tmp_path, edit)


def _first_op(doc) -> dict:
    return next(e for e in doc["traceEvents"] if e.get("ph") == "X")


def _first_memory_sample(doc) -> dict:
    return next(e for e in doc["traceEvents"] if e.get("ph") == "C" and e["name"] == "memory_bytes")


@pytest.mark.parametrize("edit,line", [
    # a counter's sample: null was numpy's TypeError, a string its UFuncNoLoopError, NaN and negative bytes drawn
    *((lambda doc, bad=bad: _first_memory_sample(doc)["args"].update(value=bad),
       "counter 'memory_bytes' on device 0: ts, args.value: give finite numbers, the value at least 0")
      for bad in (None, "12", float("nan"), -1)),
    (lambda doc: _first_memory_sample(doc).update(ts="x"),
     "counter 'memory_bytes' on device 0: ts, args.value: give finite numbers, the value at least 0"),
    # an op's indices: "0", 0.5 and true were read as stage 0; past the run's they were drawn or "not predicted"
    *((lambda doc, bad=bad: _first_op(doc)["args"].update(stage=bad),
       f"trace event 18: args.stage: give a whole number that numpy holds (got {json.dumps(bad)})")
      for bad in ("0", 0.5, True, 10**20)),
    (lambda doc: _first_op(doc)["args"].update(microbatch=99),
     "trace event 18 (F on device 0): args.microbatch: give a whole number from -1 to 1 (got 99)"),
    (lambda doc: _first_op(doc)["args"].update(minibatch=99),
     "trace event 18 (F on device 0): args.minibatch: give a whole number from 0 to 2 (got 99)"),
    (lambda doc: _first_op(doc)["args"].update(stage=-1),
     "trace event 18 (F on device 0): args.stage: give a whole number from 0 to 2 (got -1)"),
    (lambda doc: doc["traceEvents"].append(dict(_first_op(doc))),
     "(F on device 0): stage 0, micro-batch 0 of mini-batch 0 runs twice: each compute op runs once"),
    # said "missing or wrong field 'ZZZ'" and "'NoneType' object has no attribute 'get'"
    (lambda doc: _first_op(doc).update(cat="ZZZ"),
     'trace event 18: cat: give one of the header\'s kinds (F, B, I, W, OPT, '),
    (lambda doc: doc["traceEvents"].insert(0, None), "trace event 0: give an object (got null)"),
])
def test_a_hand_edited_op_or_counter_is_one_line_naming_its_field(predicted, tmp_path, edit, line):
    assert line in _refusal_once_edited(predicted, tmp_path, edit)


@settings(max_examples=80, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 30), st.integers(0, 8)), max_size=25))
def test_merged_intervals_are_the_runs_a_sweep_by_start_finds(intervals):
    """merged_intervals sorts starts and ends apart: nested, overlapping, touching and repeated intervals give the
    runs of the plain sweep (by start, extending a run while an interval starts before it has ended)."""
    runs: list[list[float]] = []
    for start, end in sorted((float(s), float(s + d)) for s, d in intervals):
        if runs and start <= runs[-1][1]:
            runs[-1][1] = max(runs[-1][1], end)
        else:
            runs.append([start, end])
    starts = np.array([s for s, _ in intervals], dtype=float)
    merged = merged_intervals(starts, starts + np.array([d for _, d in intervals], dtype=float))
    assert [list(pair) for pair in zip(*(column.tolist() for column in merged))] == runs
