"""Predicted against measured, op by op (traces/compare.py): errors worked out by hand from the schedules'
closed forms, identical traces, incomplete runs and traces of different runs."""

import json
import re
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from pipesim.traces.compare import compare
from pipesim.traces.trace import Ops, Trace, TraceError, read_trace
from tests.conftest import build, pipesim, run, simulated
from tests.helpers import GPT_CPU, page_data, profiler_event, profiler_ranks


def as_measured(trace: Trace, keep: np.ndarray | None = None, **meta) -> Trace:
    """A copy of the trace relabelled as a measurement (optionally only the ops `keep` selects)."""
    keep = slice(None) if keep is None else keep
    ops = Ops(**{name: getattr(trace.ops, name)[keep].copy() for name in trace.ops.__dataclass_fields__})
    return Trace(trace.kinds, trace.num_devices, ops, replace(trace.meta, source="measured", **meta), trace.counters)


def test_a_start_error_counts_from_its_mini_batchs_first_op():
    """A run whose first mini-batch took 800 ms longer (a GPU's one-off warm-up) runs every later op at its predicted
    time within its own mini-batch: from the run's first op every one of them read 800 ms early, each kind's median
    the warm-up's, where within its mini-batch none is off."""
    predicted = run("1f1b", 4, 8, 3, comm=0.1, param_mb=100, activation_mb=10).trace
    measured = as_measured(predicted)
    measured.ops.start_us[measured.ops.minibatch >= 1] += 800e3
    c = compare(predicted, measured)
    assert all(k.start_median_ms == 0 and k.start_p90_ms == 0 for k in c.kinds), c.kinds
    assert c.iteration_time_error != 0  # the step from mini-batch 0's end to the last's: the warm-up's share of it


def test_identical_traces_have_no_error():
    predicted = run("1f1b", 4, 8, 3, comm=0.1, param_mb=100, activation_mb=10).trace
    c = compare(predicted, as_measured(predicted))
    assert c.iteration_time_error == 0
    assert c.matched_ops == len(predicted.ops) and c.missing_in_measured == c.missing_in_predicted == 0
    assert all(k.duration_median in (0, None) and k.start_median_ms == 0 for k in c.kinds)
    assert {k.kind for k in c.kinds if k.duration_median is None} == {"OPT"}  # costs nothing here
    assert {k.kind for k in c.kinds} == {"F", "B", "OPT", "SEND_F", "RECV_F", "SEND_B", "RECV_B"}
    assert c.version_mismatches == 0
    assert all(d.peak_memory_error == 0 for d in c.devices)


def test_a_slower_forward_gives_the_errors_the_closed_form_says():
    # GPipe, p = 4, m = 8, no transfers: the makespan is (m + p - 1)(F + B): 33 ms predicted, 34.1 ms measured
    # with F = 1.1 ms; every F is 1/11 shorter in the prediction, every B exact.
    predicted = run("gpipe", 4, 8).trace
    measured = as_measured(run("gpipe", 4, 8, fwd=1.1).trace)
    c = compare(predicted, measured)
    assert c.predicted_ms == pytest.approx(33.0) and c.measured_ms == pytest.approx(34.1)
    assert c.iteration_time_error == pytest.approx((33.0 - 34.1) / 34.1)
    by_kind = {k.kind: k for k in c.kinds}
    assert by_kind["F"].duration_median == pytest.approx(0.1 / 1.1)
    assert by_kind["F"].duration_bias == pytest.approx(-0.1 / 1.1)
    assert by_kind["F"].ops == 32 and by_kind["F"].measured_ms == pytest.approx(32 * 1.1)
    assert by_kind["B"].duration_median == pytest.approx(0.0)
    # Device 3's last backward starts (m + p - 1)·F + (m - 1)·B in: 11 ms vs 12.1 ms plus 14 ms of B.
    assert by_kind["B"].start_worst.error == pytest.approx(-1.1)


def test_an_incomplete_run_compares_what_ran_and_counts_the_rest():
    predicted = run("1f1b", 2, 4, 2).trace
    early = predicted.ops.start_us < np.median(predicted.ops.start_us)
    c = compare(predicted, as_measured(predicted, keep=early, complete=False, failed_rank=1))
    assert c.matched_ops == early.sum()
    assert c.missing_in_measured == (~early).sum() and c.missing_in_predicted == 0
    assert c.missing_examples and "measured lacks it" in c.missing_examples[0]
    assert any("incomplete (rank 1 failed)" in note for note in c.notes)


def test_an_incomplete_runs_figures_are_held_against_the_prediction_of_the_ops_that_ran():
    """A run cut after 2 of its 8 mini-batches, measured exactly as predicted: its busy time and exposed
    communication were held against the whole run's prediction (each device's busy 96 ms predicted against 24 ms
    measured, exposed communication 4 ms against 1); the prediction of the ops that ran agrees with every figure."""
    predicted = run("1f1b", 2, 4, 8, comm=0.1, param_mb=100, activation_mb=10).trace
    ran = predicted.ops.minibatch < 2
    c = compare(predicted, as_measured(predicted, keep=ran, complete=False, failed_rank=1))
    assert c.missing_in_measured == (~ran).sum()
    assert c.iteration_time_error == 0 and c.predicted_bubble == pytest.approx(c.measured_bubble)
    for d in c.devices:
        assert d.predicted_busy_ms == pytest.approx(d.measured_busy_ms) and d.measured_busy_ms > 0
        assert d.predicted_exposed_comm_ms == pytest.approx(d.measured_exposed_comm_ms)
        assert d.peak_memory_error == 0
    assert any("every predicted figure, cover the ops that ran" in note for note in c.notes)


def test_a_devices_memory_the_trace_does_not_hold_is_unknown_not_zero(tmp_path):
    """A rank that failed before it reported a row leaves no memory sample: its peak is unknown ("n/a", no error),
    where a lone sample of 0 read as a measured peak of 0 MiB ("13.8 / 0")."""
    from pipesim.traces.metrics import summarize
    from pipesim.traces.trace import Counter, write_trace

    predicted = run("1f1b", 2, 4, 2, param_mb=100, activation_mb=10).trace
    counters = {**predicted.counters, "memory_bytes": [predicted.counters["memory_bytes"][0],
                                                       Counter(np.zeros(0), np.zeros(0))]}
    measured = replace(as_measured(predicted, complete=False, failed_rank=1), counters=counters)
    devices = summarize(measured).devices
    assert devices[0].peak_memory_mb > 0 and devices[1].peak_memory_mb is None
    assert summarize(measured).peak_memory_mb == devices[0].peak_memory_mb  # the peak of those known
    c = compare(predicted, measured)
    assert c.devices[1].measured_peak_memory_mb is None and c.devices[1].peak_memory_error is None
    write_trace(measured, tmp_path / "m.json")
    write_trace(predicted, tmp_path / "p.json")
    code, out, err = pipesim("compare", tmp_path / "m.json", tmp_path / "p.json")
    assert code == 0, err
    row = next(line.split() for line in out.splitlines() if re.match(r"\s+1\s", line))
    assert row[-3:] == ["/", "n/a", "-"], out


def test_view_says_a_trace_is_incomplete_and_which_rank_failed(tmp_path):
    """`view` drew a run that stopped part-way as if it had finished: its page and the terminal say it stopped,
    and the rank that failed."""
    from pipesim.traces.trace import write_trace

    trace = tmp_path / "t.json"
    write_trace(as_measured(run("1f1b", 2, 4, 3).trace, complete=False, failed_rank=0), trace)
    code, out, err = pipesim("view", trace)
    line = "the measured 1f1b is incomplete (rank 0 failed): its figures cover only the ops that ran"
    assert code == 0 and err.strip() == f"warning: {line}", err
    assert json.dumps(line) in (tmp_path / "t.html").read_text()


def test_weight_versions_must_agree():
    predicted = run("pipedream", 2, 2, 3).trace
    measured = as_measured(predicted)
    wrong = np.flatnonzero(measured.ops.version > 0)[:2]
    measured.ops.version[wrong] -= 1
    c = compare(predicted, measured)
    assert c.version_mismatches == 2 and c.versions_compared == int(np.sum(measured.ops.version >= 0))
    assert "predicted version" in c.version_examples[0]


def test_traces_of_different_runs_are_refused_naming_the_difference():
    with pytest.raises(TraceError, match="schedule gpipe measured, 1f1b predicted: predict with -s gpipe$"):
        compare(run("1f1b", 2, 4).trace, as_measured(run("gpipe", 2, 4).trace))
    with pytest.raises(TraceError, match="microbatches 8 measured, 4 predicted: predict with -m 8$"):
        compare(run("1f1b", 2, 4).trace, as_measured(run("1f1b", 2, 8).trace))
    # every difference at once, each with its flag: one at a time, a user fixing the first met the next
    with pytest.raises(TraceError, match="schedule gpipe measured, 1f1b predicted: predict with -s gpipe; "
                                         "microbatches 8 measured, 4 predicted: predict with -m 8$"):
        compare(run("1f1b", 2, 4).trace, as_measured(run("gpipe", 2, 8).trace))
    # two runs: no flag makes either
    with pytest.raises(TraceError, match=r"microbatches 8 measured, 4 in PREDICTED \(a run\)$"):
        compare(as_measured(run("1f1b", 2, 4).trace), as_measured(run("1f1b", 2, 8).trace))
    with pytest.raises(TraceError, match="activation_limit 2.0 measured, 1.0 predicted"):  # auto searched for other R
        compare(simulated(build("auto", 4, 8, activation_limit=1.0)).trace,
                as_measured(simulated(build("auto", 4, 8, activation_limit=2.0)).trace))
    # A stage graph is its set of edges: a run and its replay may list them in another order.
    plain = run("1f1b", 2, 4).trace
    predicted = replace(plain, meta=replace(plain.meta, stage_edges=[[0, 1], [0, 2]]))
    assert compare(predicted, as_measured(predicted, stage_edges=[[0, 2], [0, 1]])).iteration_time_error == 0
    with pytest.raises(TraceError, match=r"stage_edges \[\[1, 2\], \[0, 1\]\] measured"):
        compare(predicted, as_measured(predicted, stage_edges=[[1, 2], [0, 1]]))


def test_a_prediction_calibrated_or_priced_for_another_setting_than_the_run_trained_is_refused():
    # The ops match one for one whatever the costs were measured on: only the recorded setting tells them apart.
    plain = run("1f1b", 2, 4).trace
    gpt = {"model": "gpt", "options": {"layers": 2, "width": 64}, "microbatch_size": 8, "dtype": "float32",
           "optimizer": "adam"}
    predicted = replace(plain, meta=replace(plain.meta, microbatch_size=8, calibration=gpt))
    trained = {"model": "gpt", "model_options": {"layers": 2, "width": 64}, "dtype": "float32", "optimizer": "adam"}
    assert compare(predicted, as_measured(predicted, extra=trained, calibration=None)).iteration_time_error == 0
    for extra, size, says in ((trained | {"model": "mlp"}, 8, "model mlp measured, gpt predicted"),
                              (trained | {"model": "mlp", "model_options": {"layers": 4}}, 32,  # another model's sizes
                               r"runs: model mlp measured, gpt predicted \(its costs' calibration\); microbatch_size "
                               r"32 measured, 8 predicted \(its costs' calibration\): predict from a profile of what "
                               r"ran$"),
                              (trained | {"model_options": {"layers": 4}}, 8, "model option layers 4 measured, 2 "),
                              (trained, 32, "microbatch_size 32 measured, 8 predicted"),
                              (trained | {"optimizer": "sgd"}, 8, "optimizer sgd measured.*--optimizer sgd"),
                              (trained | {"dtype": "bfloat16"}, 8, "dtype bfloat16 measured, float32 predicted")):
        with pytest.raises(TraceError, match=says):
            compare(predicted, as_measured(predicted, extra=extra, calibration=None, microbatch_size=size))
    other_run = as_measured(predicted, extra=trained, calibration=None)  # the noise floor: a run against a run
    with pytest.raises(TraceError, match=r"optimizer sgd measured, adam in PREDICTED \(a run\)$"):
        compare(other_run, as_measured(predicted, extra=trained | {"optimizer": "sgd"}, calibration=None))
    on_gpu = replace(predicted.meta, calibration=gpt | {"device": "cuda"})  # an estimate on a catalogue GPU
    with pytest.raises(TraceError, match="device cpu measured, cuda predicted"):
        compare(replace(predicted, meta=on_gpu), as_measured(predicted, extra=trained, calibration=None,
                                                             hardware={"device": "cpu"}))
    # What-if costs describe no model: compared (compare warns), as is a run that records none (torch.profiler's),
    # and a field an older file lacks.
    assert compare(plain, as_measured(plain, extra=trained, microbatch_size=32)).iteration_time_error == 0
    assert compare(predicted, as_measured(predicted, extra={}, calibration=None)).iteration_time_error == 0
    older = trained | {"optimizer": None}
    assert compare(predicted, as_measured(predicted, extra=older, calibration=None)).iteration_time_error == 0


def test_a_prediction_from_a_profile_records_the_optimizer_and_dtype_it_was_priced_for(tmp_path):
    from tests.conftest import pipesim

    trace, profile = tmp_path / "p.json", GPT_CPU
    code, _, err = pipesim("simulate", "--profile", profile, "-s", "1f1b", "--optimizer", "sgd",
                           "--trace", trace)
    assert code == 0, err
    calibration = read_trace(trace).meta.calibration
    assert (calibration["optimizer"], calibration["dtype"], calibration["model"]) == ("sgd", "float32", "gpt")


@pytest.mark.parametrize("field, value, says", [
    ("calibration.options", 5, "give an object of the model's options (got 5)"),
    ("extra.model_options", ["layers"], 'give an object of the model\'s options (got ["layers"])'),
    ("extra.optimizer", "lion", "choose from sgd, momentum, adam, adamw (got 'lion')"),
    ("calibration.optimizer", 5, "choose from sgd, momentum, adam, adamw (got 5)"),
    ("extra.bounds", [0, 5, 4, 9], "give the stages' first layers and the layer count, whole numbers from 0 never "
                                   "falling, the first and last stages holding a layer (got [0, 5, 4, 9])"),
    ("extra.bounds", [0, 0, 5, 9], "give the stages' first layers and the layer count, whole numbers from 0 never "
                                   "falling, the first and last stages holding a layer (got [0, 0, 5, 9])"),
    ("extra.model", 5, "give a name (a string) (got 5)"),
    ("hardware.compute", [0, 1], 'give a list of each rank\'s "host/device" (got [0, 1])'),
    ("hardware.threads_per_rank", "x", 'give a whole number of at least 1 (got "x")'),
    ("params.data_parallel", "2", 'give a whole number of at least 1 (got "2")'),
    ("calibration.host_terms", "x", 'give an object of the host terms, each an object (got "x")')])
def test_a_header_field_compare_reads_is_checked_as_the_trace_is_read(field, value, says):
    """Each header field compare and its prediction of a run read is checked as the trace is read, in one line
    naming it: an unknown optimizer was a KeyError's traceback from the costs, options a TypeError's, a compute
    list of numbers an AttributeError's, a data_parallel of "2" a ValueError's from compare's replica 0."""
    from pipesim.traces.trace import TraceMeta

    doc = run("1f1b", 2, 4).trace.meta.to_dict()
    section, name = field.split(".")
    doc[section] = (doc[section] or {}) | {name: value}
    with pytest.raises(TraceError) as refused:
        TraceMeta.from_dict(doc)
    assert str(refused.value) == f"pipesim header: meta.{field}: {says}"


def test_a_run_of_an_unknown_optimizer_is_one_line_with_or_without_its_prediction(tmp_path):
    """A run hand-edited to an optimizer pipesim does not price ("lion"): `compare RUN` showed a KeyError's traceback
    from the costs, and `compare RUN PREDICTED` told the user to "simulate with --optimizer lion", which simulate
    refuses; both now refuse the field as the trace is read, writing no page."""
    document = json.loads((FIDELITY_RUNS / "1f1b.json").read_text())
    document["pipesim"]["meta"]["extra"] |= {"optimizer": "lion",
                                             "profile": json.loads((FIDELITY_RUNS / "mlp-profile.json").read_text())}
    measured, predicted, page = tmp_path / "run.json", tmp_path / "p.json", tmp_path / "c.html"
    measured.write_text(json.dumps(document))
    assert pipesim("simulate", "-s", "1f1b", "-p", 2, "-m", 4, "-n", 8, "--trace", predicted).code == 0
    for given in ([measured], [measured, predicted]):
        assert pipesim("compare", *given, "--html", page) == (
            2, "", f"error: trace {measured}: pipesim header: meta.extra.optimizer: choose from sgd, momentum, adam, "
                   "adamw (got 'lion')\n")
        assert not page.exists()


def test_a_runs_cut_past_its_profiles_layers_is_refused_naming_both():
    """A run's recorded cut that ends past its profile's layers was an IndexError's traceback from the costs."""
    from pipesim.planning.replay import predict_measured

    measured = read_trace(FIDELITY_RUNS / "1f1b.json")
    extra = measured.meta.extra | {"profile": json.loads((FIDELITY_RUNS / "mlp-profile.json").read_text()),
                                   "bounds": [0, 5, 99]}
    with pytest.raises(TraceError, match=r"^cannot predict the recorded run: meta.extra.bounds \[0, 5, 99\] cut 99 "
                                         r"layers, its profile has \d+$"):
        predict_measured(replace(measured.meta, extra=extra))


def test_the_command_refuses_a_traces_model_options_that_are_not_an_object_in_the_one_wording(tmp_path):
    """A hand-edited trace's meta.calibration.options read "... must be an object of the model's options (got [2,
    64])": now "FIELD: give WHAT IS ALLOWED (got VALUE)", the value as the file writes it."""
    predicted, measured = tmp_path / "p.json", tmp_path / "m.json"
    assert pipesim("simulate", "-s", "gpipe", "-p", "2", "-m", "4", "--trace", measured).code == 0
    doc = json.loads(measured.read_text())
    doc["pipesim"]["meta"]["calibration"] = {"model": "gpt", "options": [2, 64]}
    predicted.write_text(json.dumps(doc))
    assert pipesim("compare", measured, predicted) == (
        2, "", f"error: trace {predicted}: pipesim header: meta.calibration.options: give an object of the model's "
               "options (got [2, 64])\n")


def test_the_command_prints_the_signed_iteration_time_error_and_refuses_what_it_cannot_compare(tmp_path):
    import json

    from tests.conftest import pipesim

    predicted, measured = tmp_path / "p.json", tmp_path / "m.json"
    assert pipesim("simulate", "-s", "gpipe", "-p", "4", "-m", "8", "--trace", predicted).code == 0
    assert pipesim("simulate", "-s", "gpipe", "-p", "4", "-m", "8", "--fwd", "1.1", "--trace", measured).code == 0
    code, out, err = pipesim("compare", measured, predicted, "--json")
    assert code == 0, err
    assert json.loads(out)["iteration_time_error"] == pytest.approx((33.0 - 34.1) / 34.1)
    code, out, err = pipesim("compare", measured, predicted, "--html", tmp_path / "c.html")
    assert code == 0 and "error -3.2%" in out and (tmp_path / "c.html").stat().st_size > 0
    assert " ".join(err.split()) == f"warning: {TWO_PREDICTIONS}"  # a prediction given as the run is said to be
    # One argument predicts the run again from the profile it recorded: a prediction has none.
    code, _, err = pipesim("compare", predicted)
    assert code == 2 and f"MEASURED {predicted}: a predicted trace, not a measured one" in err, err
    assert "Traceback" not in err
    (tmp_path / "bad.json").write_text('{"traceEvents": [')
    code, _, err = pipesim("compare", tmp_path / "bad.json", predicted)
    assert code == 2 and "not valid JSON" in err
    (tmp_path / "bad.json").write_bytes(b"\xab\xcd")
    code, _, err = pipesim("compare", tmp_path / "bad.json", predicted)
    assert code == 2 and "is not a text (UTF-8) file" in err and "Traceback" not in err
    other = tmp_path / "o.json"
    assert pipesim("simulate", "-s", "1f1b", "-p", "4", "-m", "8", "--trace", other).code == 0
    code, _, err = pipesim("compare", other, predicted)
    assert code == 2 and "schedule 1f1b in MEASURED (a prediction), gpipe predicted" in err
    # A run given second, its prediction first: refused, naming the order (it reported the run's time as predicted)
    run = Path(__file__).parent.parent / "traces" / "measured" / "fidelity-cpu2-day3-runs" / "1f1b.json"
    assert pipesim("simulate", "-s", "1f1b", "-p", 2, "-m", 4, "-n", 8, "--trace", other).code == 0  # the run's shape
    assert pipesim("compare", run, other).code == 0
    code, out, err = pipesim("compare", other, run)
    assert code == 2 and not out and err.strip() == (
        f"error: MEASURED {other} is a predicted trace and PREDICTED {run} a measured one: the run comes first: "
        f"pipesim compare {run} {other}")


def test_view_draws_several_traces_on_one_page_and_refuses_a_bad_file(tmp_path):
    from tests.conftest import pipesim

    a, b = tmp_path / "a.json", tmp_path / "b.json"
    for path, fwd in ((a, "1"), (b, "1.2")):
        assert pipesim("simulate", "-s", "1f1b", "-p", "2", "-m", "4", "--fwd", fwd, "--trace", path).code == 0
    code, out, err = pipesim("view", a, b)
    page = (tmp_path / "a.html").read_text()
    assert code == 0 and "wrote" in out and "all, device by device" in page
    assert "<title>pipesim: 1f1b, predicted (a.json); 1f1b, predicted (b.json)</title>" in page  # alike: files named
    code, _, err = pipesim("view", tmp_path / "missing.json")
    assert code == 2 and "cannot read trace" in err and not (tmp_path / "missing.html").exists()


def test_view_titles_a_trace_by_its_method_and_source_not_its_file_name(tmp_path):
    """A run saved as measured.json was titled "measured (measured)": the page names the method and source, and
    leaves the shape to its view line ("(p=2, m=4, N=3, ... ops, measured)"), where the title gave it too."""
    from pipesim.traces.trace import write_trace
    from tests.conftest import pipesim

    measured = tmp_path / "measured.json"
    write_trace(as_measured(run("1f1b", 2, 4, 3).trace), measured)
    code, _, _ = pipesim("view", measured)
    page = (tmp_path / "measured.html").read_text()
    assert code == 0 and "<title>pipesim: 1f1b, measured</title>" in page and "<h1>pipesim: 1f1b, measured</h1>" in page
    assert page.count("p=2, m=4, N=3") == 1  # the view line's shape (the page's data)
    assert "measured (measured)" not in page


def test_view_replaces_only_a_page_of_its_own(tmp_path):
    from tests.conftest import pipesim

    trace, page = tmp_path / "t.json", tmp_path / "t.html"
    assert pipesim("simulate", "-s", "1f1b", "-p", "2", "-m", "4", "--trace", trace).code == 0
    code, out, _ = pipesim("view", trace)
    assert code == 0 and out.split() == ["wrote", str(page)]
    code, out, _ = pipesim("view", trace)  # the page it drew before: replaced, and said so
    assert code == 0 and " ".join(out.split()) == f"wrote {page} (replaced the file that was there)"
    page.write_text("<html>notes of my own</html>")
    code, out, err = pipesim("view", trace)  # not a pipesim page, and not named: left alone
    assert code == 2 and out == "" and page.read_text() == "<html>notes of my own</html>"
    assert f"{page} exists and is not a pipesim page" in err and err.count("\n") == 1
    code, out, err = pipesim("view", trace, "--html", page)  # named: the same, as every writer refuses
    assert code == 2 and out == "" and page.read_text() == "<html>notes of my own</html>", err


TORCH_RUNS = Path(__file__).parent.parent / "traces" / "measured"
MLP_PROFILE = TORCH_RUNS / "fidelity-cpu2-day3-runs" / "mlp-profile.json"


def test_the_duration_table_says_its_ms_are_the_kinds_ops_summed(tmp_path):
    """Its predicted and measured ms are each kind's ops summed (64 forwards of 1 ms against 1.1: 4 devices, 8
    micro-batches, 2 mini-batches), which the table did not say: "predicted ms 64.00" under "duration error by kind,
    relative" read as one op's time."""
    from tests.conftest import pipesim

    predicted, measured = tmp_path / "p.json", tmp_path / "m.json"
    assert pipesim("simulate", "-s", "gpipe", "-p", "4", "-m", "8", "--trace", predicted).code == 0
    assert pipesim("simulate", "-s", "gpipe", "-p", "4", "-m", "8", "--fwd", "1.1", "--trace", measured).code == 0
    code, out, err = pipesim("compare", measured, predicted)
    assert code == 0, err
    assert "duration by kind, ms summed over its ops; error relative (worst: op@device)" in out
    forwards = next(line.split() for line in out.splitlines() if line.split()[:1] == ["F"])
    assert forwards[1:4] == ["64", "64.00", "70.40"]


def test_view_says_that_compare_reads_a_torch_profiler_trace(tmp_path):
    """It said only "not a pipesim trace: the top-level 'pipesim' key is missing", naming no file."""
    from tests.conftest import pipesim

    page = tmp_path / "p.html"
    code, out, err = pipesim("view", TORCH_RUNS / "torch-1f1b-2cpu" / "rank0.json", "--html", page)
    assert code == 2 and out == "" and err.count("\n") == 1 and not page.exists(), err
    assert "rank0.json is a torch.profiler trace, not pipesim's: `pipesim compare FOLDER PREDICTED` reads " \
           "torch.profiler traces, a folder of them one per rank" in err
    code, out, err = pipesim("view", TORCH_RUNS / "torch-1f1b-2cpu", "--html", page)  # their folder
    assert code == 2 and out == "" and err.count("\n") == 1 and not page.exists(), err
    assert "torch-1f1b-2cpu is a folder; give a pipesim trace file (`pipesim compare FOLDER PREDICTED` reads" in err


def test_a_torch_f_or_b_that_waits_for_its_receive_is_read_as_the_recv_then_its_compute(tmp_path):
    """torch's runtime waits for a received activation inside the F that reads it, and for a gradient inside the B
    (its RECV only posts the receive), where pipesim's RECV row is the wait and its F or B the compute after it: such
    a range is read as the RECV up to its first op on the range's thread and the F or B from there. An F with no
    RECV of its own (the first stage's) and a range with no op inside it (a trace pruned before) are read whole."""
    from pipesim.planning.torch_profile import read_torch_profile
    from pipesim.traces.trace import read_trace
    from tests.conftest import pipesim

    predicted = tmp_path / "p.json"
    assert pipesim("simulate", "-s", "1f1b", "-p", "2", "-m", "1", "-n", "1", "--trace", predicted).code == 0

    event = profiler_event
    ranks = [[event("PP:0F0", 0, 1000), event("aten::linear", 50, 900), event("PP:0SEND_F0", 1000, 10),
              event("PP:0RECV_B0", 1010, 10), event("PP:0B0", 2000, 3000), event("aten::mm", 4000, 900)],
             [event("PP:1RECV_F0", 0, 20), event("PP:1F0", 30, 2000), event("gloo:recv", 100, 10, tid=2),
              event("aten::linear", 1030, 900), event("PP:1B0", 2100, 800), event("PP:1SEND_B0", 2900, 10)]]
    like = read_trace(predicted)
    ops = read_torch_profile(profiler_ranks(tmp_path, ranks), like).ops
    read = {(like.kinds[k], int(d)): (float(start), float(dur))
            for k, d, start, dur in zip(ops.kind, ops.device, ops.start_us, ops.dur_us)}
    assert read[("RECV_F", 1)] == (30, 1000) and read[("F", 1)] == (1030, 1000)  # tid 2's event is not its op
    assert read[("RECV_B", 0)] == (2000, 2000) and read[("B", 0)] == (4000, 1000)
    assert read[("F", 0)] == (0, 1000) and read[("B", 1)] == (2100, 800)  # no RECV of their own; no op inside


def test_a_torch_overlapped_pair_is_read_as_its_forward_then_its_backward(tmp_path):
    """torch's dualpipev runs an overlapped pair as one `(3F2;0B0)OVERLAP_F_B` range, its forward then its full
    backward: it is split where the backward's first autograd node begins, the forward ending with the last op
    before it, and each part read as a range of its own (a wait before its first op is its RECV's), naming the
    other's stage as the prediction's parts do. The node may run on another thread (CUDA's autograd thread). Before,
    the range was no action: the pairs' forwards and backwards were missing from the measurement."""
    from pipesim.planning.torch_profile import read_torch_profile

    predicted = tmp_path / "p.json"
    assert pipesim("simulate", "-s", "dualpipev", "-p", "2", "-m", "4", "-n", "1", "--trace", predicted).code == 0

    event, node = profiler_event, "autograd::engine::evaluate_function: AddmmBackward0"
    ranks = [[event("PP:3RECV_F2", 0, 10), event("PP:0RECV_B0", 10, 10), event("PP:(3F2;0B0)OVERLAP_F_B", 20, 3000),
              event("aten::linear", 120, 800), event("aten::relu", 950, 50), event("aten::clamp_min", 960, 30),
              event(node, 1400, 500), event("aten::mm", 1450, 400)],
             [event("PP:(1F3;2B1)OVERLAP_F_B", 0, 2000), event("aten::linear", 0, 600), event(node, 900, 900, tid=2)]]
    like = read_trace(predicted)
    ops = read_torch_profile(profiler_ranks(tmp_path, ranks), like).ops
    read = {(like.kinds[k], int(s), int(m), int(p)): (float(start), float(dur)) for k, s, m, p, start, dur in
            zip(ops.kind, ops.stage, ops.microbatch, ops.peer, ops.start_us, ops.dur_us) if like.kinds[k] in "FB"}
    assert read == {("F", 3, 2, 0): (120, 880), ("B", 0, 0, 3): (1400, 1620),  # their RECVs' waits before them
                    ("F", 1, 3, 2): (0, 600), ("B", 2, 1, 1): (600, 1400)}  # no RECV of their own
    received = {like.kinds[k]: (float(start), float(dur)) for k, d, start, dur in
                zip(ops.kind, ops.device, ops.start_us, ops.dur_us) if d == 0 and like.kinds[k].startswith("RECV")}
    assert received == {"RECV_F": (20, 100), "RECV_B": (1000, 400)}


@pytest.mark.parametrize("event, info, message", [
    (profiler_event("PP:0F0", "x", 10), {"rank": 0}, "event 'PP:0F0': ts: give a finite number of µs (got \"x\")"),
    (profiler_event("PP:0F0", 0, "ten"), {"rank": 0}, "event 'PP:0F0': dur: give a finite number of µs (got \"ten\")"),
    (profiler_event("PP:0F0", 0, 10), {"rank": "one"},
     "distributedInfo.rank: give a whole number of at least 0 (got \"one\")"),
])
def test_a_torch_profiler_trace_with_a_wrong_field_is_one_line_naming_it(tmp_path, event, info, message):
    """A hand-edited or truncated torch.profiler file: its field named in one line, nothing written, where a time
    that is no number or a rank that is no whole number raised a traceback."""
    predicted, html = tmp_path / "p.json", tmp_path / "c.html"
    assert pipesim("simulate", "-s", "1f1b", "-p", "2", "-m", "1", "-n", "1", "--trace", predicted).code == 0
    run = tmp_path / "run"
    run.mkdir()
    paths = profiler_ranks(run, [[event], [profiler_event("PP:1F0", 0, 10)]])
    paths[0].write_text(json.dumps({"traceEvents": [event], "distributedInfo": info}))
    code, out, err = pipesim("compare", run, predicted, "--html", html)
    assert (code, out, err) == (2, "", f"error: {paths[0]}: {message}\n") and not html.exists()


def test_a_torch_dualpipev_run_matches_every_op_of_its_prediction(tmp_path):
    """A committed torch.profiler recording of torch's runtime running pipesim's dualpipev order (2 gloo ranks, 4
    stages, m = 8, 2 profiled steps: benchmarks/torch_pipelining.py --schedule dualpipev --model-options
    '{"layers": 8, "width": 256}' --microbatches 8 --steps 2 --warmup 1) matches every op of the prediction, each
    overlapped pair's forward and backward: the 88 parts of its 44 pairs were missing before."""
    predicted = tmp_path / "p.json"
    assert pipesim("simulate", "-s", "dualpipev", "-p", "2", "-m", "8", "-n", "2", "--trace", predicted).code == 0
    code, out, err = pipesim("compare", TORCH_RUNS / "torch-dualpipev-2cpu", predicted, "--json")
    assert code == 0, err
    c = json.loads(out)
    assert c["missing_in_measured"] == c["missing_in_predicted"] == 0 and c["matched_ops"] == len(read_trace(
        predicted).ops)
    by_kind = {k["kind"]: k for k in c["kinds"]}
    assert by_kind["F&B"]["ops"] == 44  # each pair one unit (the test below)
    assert by_kind["F"]["ops"] + 44 == by_kind["B"]["ops"] + by_kind["I"]["ops"] + 44 == 4 * 8 * 2
    assert all(by_kind[kind]["duration_median"] is not None for kind in ("F", "B", "F&B"))


def paired_run(fraction: float = 0.5) -> Trace:
    """dualpipev on 2 devices, 4 stages, m = 8, 2 mini-batches, F 1 ms and B 2 ms a stage, each overlapped pair
    hiding `fraction` of its shorter part: 44 pairs."""
    from pipesim.sim import Cluster, Costs, simulate

    costs = replace(Costs.per_stage(4, fwd_ms=1.0, bwd_ms=2.0), overlap_hidden_fraction=fraction)
    return simulate(build("dualpipev", 2, 8, 2), costs, Cluster.uniform(2, 0.1))


def test_an_overlapped_pair_run_at_once_is_compared_as_one_unit_not_twice():
    """On a GPU an overlapped pair's two parts run at once on two streams (executor/overlap.py), each row spanning
    the pair, where the simulator runs them one after the other, the shorter part shortened by what the longer
    hides (--fb-hidden-fraction). A run that took exactly the predicted pair time was summed twice in the duration
    table (the forwards' and backwards' ms each holding every pair's) and each part read 17-100 % off; compared as
    one F&B unit, the union of its parts, it has no error, and the table's ms are the device's."""
    from pipesim.traces.compare import pair_rows

    predicted = paired_run()
    forward, backward = pair_rows(predicted)
    assert len(forward) == 44 and np.all(predicted.ops.end_us[forward] == predicted.ops.start_us[backward])
    measured = as_measured(predicted)
    pair_us = measured.ops.dur_us[forward] + measured.ops.dur_us[backward]
    measured.ops.start_us[backward] = measured.ops.start_us[forward]  # both parts begin with the pair
    measured.ops.dur_us[forward] = measured.ops.dur_us[backward] = pair_us  # and span it
    c = compare(predicted, measured)
    by_kind = {k.kind: k for k in c.kinds}
    assert [k.kind for k in c.kinds][:3] == ["F", "B", "F&B"] and by_kind["F&B"].ops == c.overlapped_pairs == 44
    assert by_kind["F&B"].measured_ms == pytest.approx(by_kind["F&B"].predicted_ms) == pytest.approx(
        pair_us.sum() / 1e3)
    assert by_kind["F&B"].duration_median == 0 and by_kind["F&B"].start_median_ms == 0
    assert c.compute_duration_median == 0 and c.iteration_time_error == 0
    assert by_kind["F"].ops == 4 * 8 * 2 - 44  # the forwards that run alone keep their own row
    assert sum(k.ops for k in c.kinds) == c.matched_ops - 44
    found = pair_rows(measured)  # matched in time order either way, though each pair's parts now start together
    assert found[0].tolist() == forward.tolist() and found[1].tolist() == backward.tolist()


def test_a_pairs_time_is_the_union_of_its_parts_from_the_first_to_start():
    """A pair whose backward part began 3 us before its forward part and overlapped it partly, and one whose parts
    ran apart with 5 us between them: each is timed from its first part's start, for the time either part ran
    (the gap left out, as the predicted pair's back-to-back parts leave none)."""
    from pipesim.traces.compare import pair_rows

    predicted = paired_run()
    forward, backward = pair_rows(predicted)
    measured = as_measured(predicted)
    ops = measured.ops
    ops.start_us[backward[::2]] = ops.start_us[forward[::2]] - 3.0
    ops.start_us[backward[1::2]] += 5.0
    f_us, b_us = ops.dur_us[forward], ops.dur_us[backward]
    union_us = f_us + b_us
    union_us[::2] -= np.minimum(f_us[::2], b_us[::2] - 3.0)  # [s - 3, s - 3 + B) over [s, s + F)
    c = compare(predicted, measured)
    pairs = next(k for k in c.kinds if k.kind == "F&B")
    assert pairs.ops == 44 and pairs.measured_ms == pytest.approx(union_us.sum() / 1e3)
    assert pairs.start_worst.error == pytest.approx(0.003) and pairs.start_worst.op.startswith("F")
    assert pairs.start_median_ms == pytest.approx(0.0015)  # 22 pairs 3 us early, 22 on time


def test_an_incomplete_run_compares_the_pairs_that_ran_whole_and_the_parts_alone():
    """A run cut part-way through its pairs: a pair both of whose parts ran is one F&B op, a part whose other part
    never ran keeps its own kind (F or B), and every matched op is in the tables once."""
    from pipesim.traces.compare import pair_rows

    predicted = paired_run(0.0)
    forward, backward = pair_rows(predicted)
    cut = (predicted.ops.start_us[forward[20]] + predicted.ops.end_us[forward[20]]) / 2  # in pair 20's forward
    ran = predicted.ops.start_us < cut
    c = compare(predicted, as_measured(predicted, keep=ran, complete=False, failed_rank=0))
    whole = int(np.count_nonzero(ran[forward] & ran[backward]))
    assert 0 < whole < 44 and c.overlapped_pairs == whole
    by_kind = {k.kind: k for k in c.kinds}
    assert by_kind["F&B"].ops == whole and sum(k.ops for k in c.kinds) == c.matched_ops - whole
    assert by_kind["F&B"].duration_median == 0  # no part hidden (fraction 0): each pair F + B as predicted


@pytest.mark.parametrize("flags, refusal", [
    (("-s", "gpipe", "-m", "8", "-n", "3"), "the torch run is not the predicted gpipe: rank 0's first step runs "
                                             "0F0 0F1 0B0 0F2 at pass 3, the prediction 0F0 0F1 0F2 0F3"),
    (("-s", "1f1b", "-m", "4", "-n", "3"), "it ran 8 micro-batches, the prediction 4: predict with -m 8"),
    (("-s", "1f1b", "-m", "8", "-n", "2"), "it ran 3 steps (mini-batches), the prediction 2: predict with -n 3"),
])
def test_a_torch_run_held_against_the_prediction_of_another_is_refused(tmp_path, flags, refusal):
    """A torch run's traces take the prediction's metadata, which its profiler records none of, so compare's checks
    passed trivially: a GPipe prediction, or one of other m or N, was held against the committed 1F1B run (m = 8,
    3 steps) and printed an error. Its micro-batches, steps and each rank's order are read off its actions."""
    predicted = tmp_path / "p.json"
    assert pipesim("simulate", *flags, "-p", "2", "--trace", predicted).code == 0
    code, out, err = pipesim("compare", TORCH_RUNS / "torch-1f1b-2cpu", predicted)
    assert (code, out) == (2, "") and refusal in err and len(err.strip().splitlines()) == 1, err
    assert pipesim("simulate", "-s", "1f1b", "-p", "2", "-m", "8", "-n", "3", "--trace", predicted).code == 0
    code, out, err = pipesim("compare", TORCH_RUNS / "torch-1f1b-2cpu", predicted, "--json")
    assert code == 0 and any("record no model" in note for note in json.loads(out)["notes"]), err


def test_the_page_says_the_warnings_and_notes_the_command_prints(tmp_path):
    """The page showed a what-if prediction's -95.5 % without the warning that it says nothing of pipesim's
    accuracy, which only stderr gave."""
    predicted, page = tmp_path / "p.json", tmp_path / "c.html"
    assert pipesim("simulate", "-s", "1f1b", "-p", 2, "-m", 8, "-n", 3, "--trace", predicted).code == 0
    code, out, err = pipesim("compare", TORCH_RUNS / "torch-1f1b-2cpu", predicted, "--html", page)
    notes = page_data(page.read_text())["notes"]
    assert code == 0 and [note.split(":")[0] for note in notes] == ["warning", "note"], notes
    assert notes[0].startswith("warning: the prediction's costs are what-if numbers"), notes
    assert all(" ".join(note.split()) in " ".join((err + out).split()) for note in notes), (notes, err, out)


def test_two_runs_held_one_against_the_other_are_said_to_be_runs():
    """The same run repeated gives the noise floor; its second trace, given as PREDICTED, was called predicted with
    nothing to say it was a run, where a prediction given as MEASURED is warned of."""
    runs = TORCH_RUNS / "gpu-check-h200-day41"
    code, out, err = pipesim("compare", runs / "run-zb-h1-again.json", runs / "run-zb-h1.json", "--json")
    assert code == 0 and json.loads(out)["notes"] == [
        "PREDICTED is a run too: what the tables call predicted is that run, and the errors one run's against the "
        "other (the same run repeated: the noise floor)"], out


def test_a_prediction_that_gives_ranks_which_shared_a_gpu_their_own_is_warned_of(tmp_path):
    """The H200 run's two ranks shared the one GPU lent; a prediction from its profile gives each its own, and the
    error (-23.6 %) is mostly that: the one-argument compare places them as they ran (-3.1 %) and is not warned."""
    runs, predicted = TORCH_RUNS / "gpu-check-h200-day41", tmp_path / "p.json"
    code, _, err = pipesim("simulate", "--profile", runs / "profile.json", "--optimizer", "sgd", "-s", "1f1b", "-p", 2,
                           "-m", 8, "-n", 8, "--trace", predicted)
    assert code == 0, err
    code, out, err = pipesim("compare", runs / "run-1f1b.json", predicted, "--json")
    assert code == 0 and [w for w in json.loads(out)["warnings"] if "shared GPUs" in w] == [
        "the run's ranks shared GPUs (ranks 0, 1 on vm/cuda:0), where the prediction gives each rank a GPU of its own: "
        "their compute and memory are priced apart; `pipesim compare MEASURED` alone predicts the run as it was "
        "placed"], out
    code, out, _ = pipesim("compare", runs / "run-1f1b.json", "--json")
    assert code == 0 and not [w for w in json.loads(out)["warnings"] if "shared GPUs" in w], out
    # CPU ranks (a gloo run's two, 'vm/cpu' both) share the host's cores, which the calibration's contention prices:
    # no GPU was shared
    runs = TORCH_RUNS / "fidelity-cpu2-day3-runs"
    code, _, err = pipesim("simulate", "--profile", runs / "mlp-profile.json", "--optimizer", "sgd", "-s", "1f1b",
                           "-p", 2, "-m", 4, "-n", 8, "--trace", predicted)
    assert code == 0, err
    code, out, _ = pipesim("compare", runs / "1f1b.json", predicted, "--json")
    assert code == 0 and json.loads(out)["warnings"] == [], out


def test_the_page_says_the_conditions_the_prediction_was_calibrated_in(tmp_path):
    """A GPU run on the H200 compared with the prediction its own calibration gives: its conditions, one line."""
    page = tmp_path / "c.html"
    code, out, err = pipesim("compare", TORCH_RUNS / "gpu-check-h200-day41" / "run-1f1b.json", "--html", page)
    notes = page_data(page.read_text())["notes"]
    assert code == 0 and {note.split(":")[0] for note in notes} == {"conditions"}, notes
    assert notes[:2] == ["conditions: calibrated: 26 s before the run", "conditions: others' load on the host: 0.04 on "
                         "16 cores (0.00 per core, from CPU time) while calibrating; 0.02 on 16 cores (0.00 per core, "
                         "from CPU time) while running"], notes


def test_a_folder_of_gzipped_profiler_traces_is_read_and_one_of_other_files_is_named(tmp_path):
    """torch.profiler's tensorboard_trace_handler writes .pt.trace.json.gz: such a folder read "a folder with no .json
    files". A folder of JSON that is no profiler trace read "holds torch profiler traces"; two traces of one rank
    named one of them and "another"."""
    import gzip
    import shutil

    gzipped, other, twice = (tmp_path / name for name in ("gz", "other", "twice"))
    for folder in (gzipped, other, twice):
        folder.mkdir()
    for path in sorted((TORCH_RUNS / "torch-1f1b-2cpu").glob("*.json")):
        (gzipped / f"{path.stem}.pt.trace.json.gz").write_bytes(gzip.compress(path.read_bytes()))
        shutil.copy(path, twice / path.name)
    shutil.copy(TORCH_RUNS / "torch-1f1b-2cpu" / "rank0.json", twice / "rank0-again.json")
    (other / "notes.json").write_text('{"a": 1}')
    predicted = tmp_path / "p.json"
    assert pipesim("simulate", "-s", "1f1b", "-p", 2, "-m", 8, "-n", 3, "--trace", predicted).code == 0
    code, out, err = pipesim("compare", gzipped, predicted, "--json")
    assert code == 0 and json.loads(out)["matched_ops"] > 0, err
    code, out, err = pipesim("compare", other)
    assert (code, out, err) == (2, "", f"error: {other / 'notes.json'}: not a Chrome trace (no traceEvents list)\n")
    code, out, err = pipesim("compare", twice, predicted)
    assert (code, out) == (2, "") and err == (f"error: two profiler traces are of rank 0 ({twice / 'rank0-again.json'} "
                                              f"and {twice / 'rank0.json'}): give one per rank\n"), err


@pytest.mark.parametrize("run_dir, schedule, recorded", [
    ("torch-1f1b-2cpu", "1f1b", {"F", "B", "OPT", "SEND_F", "RECV_F", "SEND_B", "RECV_B"}),  # PP:<action> ranges
    ("torch-gpipe-2cpu", "gpipe", {"F", "B", "OPT"}),  # ScheduleGPipe's Forward i / Backward i ranges
])
def test_a_torch_pipelining_run_compares_with_its_prediction(tmp_path, run_dir, schedule, recorded):
    """Committed torch.profiler traces of torch's own runtime (benchmarks/torch_pipelining.py: 2 gloo ranks,
    m = 8, 3 profiled steps), matched op by op with pipesim's prediction of the same schedule."""
    import json

    from tests.conftest import pipesim

    predicted = tmp_path / "p.json"
    assert pipesim("simulate", "-s", schedule, "-p", "2", "-m", "8", "-n", "3", "--trace", predicted).code == 0
    code, out, err = pipesim("compare", TORCH_RUNS / run_dir, predicted, "--json")
    assert code == 0, err
    c = json.loads(out)
    assert {k["kind"] for k in c["kinds"]} == recorded
    by_kind = {k["kind"]: k for k in c["kinds"]}
    assert by_kind["F"]["ops"] == by_kind["B"]["ops"] == 2 * 8 * 3 and by_kind["OPT"]["ops"] == 2 * 3
    assert c["missing_in_predicted"] == 0  # every torch action is one pipesim predicts
    assert c["missing_in_measured"] == (0 if "SEND_F" in recorded else 4 * 8 * 3)  # GPipe's transfers untimed
    assert c["measured_ms"] > 0 and c["versions_compared"] == c["version_mismatches"] == 0
    # a device idles in each step (GPipe's fill and drain): the bubble of the mini-batches the step is timed over,
    # where the compute of one more (a step left out where the next mini-batch began before it ended) read 0 %
    assert 0.05 < c["measured_bubble"] < 0.5, c["measured_bubble"]
    assert [note.split(":")[0] for note in c["notes"]] == ["torch's profiler traces record no model, micro-batch size, "
                                                           "optimizer or dtype"]
    # torch's profiler records no memory: unknown, not zero, and no error is made of it
    assert all(d["measured_peak_memory_mb"] is None and d["peak_memory_error"] is None for d in c["devices"])
    assert all(d["predicted_peak_memory_mb"] > 0 for d in c["devices"])
    # The prediction came from what-if costs: one warning, on stderr (and in --json), says so.
    assert c["predicted_calibration"] is None and len(c["warnings"]) == 1 and "what-if" in c["warnings"][0]
    assert err.count("\n") == 1 and err.startswith("warning: the prediction's costs are what-if numbers")
    code, out, err = pipesim("compare", TORCH_RUNS / run_dir, predicted)
    assert code == 0 and "weight versions: not compared (the measurement records none)" in out
    assert "agree" not in out and re.search(r"/ n/a +- *$", out, re.M)
    assert not re.findall(r"(?<![\d,.])\d{4,}", out), out  # start errors of 1,536.34 ms wrote "1536.34"
    # From a calibration profile the profile is named, and one whose passes pipesim's executor timed is warned of
    # (`calibrate --passes-as torch` times them as torch's stage computes them).
    assert pipesim("simulate", "-s", schedule, "-p", "2", "-m", "8", "-n", "3", "--profile", MLP_PROFILE,
                   "--optimizer", "sgd", "--trace", predicted).code == 0
    code, out, err = pipesim("compare", TORCH_RUNS / run_dir, predicted, "--json")
    assert code == 0 and err.count("\n") == 1 and err.endswith("calibrate with --passes-as torch\n"), err
    c = json.loads(out)
    assert c["warnings"] == [err.removeprefix("warning: ").strip()] and c["predicted_calibration"]["model"] == "mlp"
    assert c["predicted_calibration"]["microbatch_size"] == 32
    profile = json.loads(MLP_PROFILE.read_text())
    profile["environment"]["passes_as"] = "torch"  # as `calibrate --passes-as torch` writes it
    (tmp_path / "torch.json").write_text(json.dumps(profile))
    assert pipesim("simulate", "-s", schedule, "-p", "2", "-m", "8", "-n", "3", "--profile", tmp_path / "torch.json",
                   "--optimizer", "sgd", "--trace", predicted).code == 0
    code, out, err = pipesim("compare", TORCH_RUNS / run_dir, predicted, "--json")
    assert code == 0 and err == "" and json.loads(out)["warnings"] == []
    # Without the prediction nothing says what torch ran.
    code, _, err = pipesim("compare", TORCH_RUNS / run_dir)
    assert code == 2 and "give the predicted trace too" in err
    # A prediction of another shape is refused.
    other = tmp_path / "o.json"
    assert pipesim("simulate", "-s", schedule, "-p", "4", "-m", "8", "-n", "3", "--trace", other).code == 0
    code, _, err = pipesim("compare", TORCH_RUNS / run_dir, other)
    assert code == 2 and "ranks [0, 1]" in err


TWO_PREDICTIONS = ("MEASURED is a prediction (`pipesim simulate --trace`), not a run: what the tables call measured is "
                   "that prediction, and the error one prediction's against the other")


def test_two_predictions_from_a_torch_timed_profile_compare_without_a_runtime_warning(tmp_path):
    """Neither is a run, so no runtime differs from the profile's: a `--passes-as torch` profile's prediction held
    against another prediction was warned of as "this is pipesim's run"; that MEASURED is a prediction is said."""
    profile = json.loads(MLP_PROFILE.read_text())
    profile["environment"]["passes_as"] = "torch"
    (tmp_path / "torch.json").write_text(json.dumps(profile))
    for name, jitter in (("a.json", "0"), ("b.json", "0.1")):
        assert pipesim("simulate", "-s", "1f1b", "-p", "2", "-m", "8", "-n", "3", "--profile", tmp_path / "torch.json",
                       "--optimizer", "sgd", "--jitter", jitter, "--trace", tmp_path / name).code == 0
    code, out, err = pipesim("compare", tmp_path / "b.json", tmp_path / "a.json", "--json")
    assert code == 0 and json.loads(out)["warnings"] == [TWO_PREDICTIONS]
    assert " ".join(err.split()) == f"warning: {TWO_PREDICTIONS}"


def test_the_replay_places_ranks_where_they_computed():
    """Ranks that computed on one GPU share one compute resource; CPU ranks share their host's cores where the
    profile measured their contention, and only then."""
    from dataclasses import replace

    from pipesim.planning.replay import _placed
    from pipesim.sim import Cluster

    cluster = Cluster.uniform(2, 0.1)
    shared = _placed(cluster, {"device": "cuda", "compute": ["h/cuda:0", "h/cuda:0"]})
    assert shared.compute == ("h/cuda:0", "h/cuda:0") and shared.compute_peers(2) == [(0, 1), (0, 1)]
    for own in ({"device": "cuda", "compute": ["h/cuda:0", "h/cuda:1"]}, {"device": "cpu", "compute": ["h/cpu"] * 2}):
        assert _placed(cluster, own) is cluster
    # host-staged: one lock over every rank, though each computed on a GPU of its own (--backend gloo, or d > 1)
    staged = _placed(cluster, {"device": "cuda", "host_staged": True, "compute": ["h/cuda:0", "h/cuda:1"]}, True)
    assert staged.compute_peers(2) == [(0, 1), (0, 1)]
    contended = replace(cluster, contention=(1.0, 1.5))
    on_cpu = {"device": "cpu", "compute": ["node-a/cpu", "node-b/cpu"]}
    assert _placed(contended, on_cpu).hosts == ("node-a", "node-b")
    assert _placed(contended, on_cpu).host_peers(2) == [(0,), (1,)]
    assert _placed(contended, {"device": "cpu", "compute": ["h/cpu"] * 2}).host_peers(2) == [(0, 1), (0, 1)]


FIDELITY_RUNS = Path(__file__).parent.parent / "traces" / "measured" / "fidelity-cpu2-day3-runs"


@pytest.mark.parametrize("run, profile, iteration_error", [
    ("graphpipe.json", "two-branch-profile.json", -0.1832),  # 4 gloo ranks on 2 cores, the two-branch DAG
    ("1f1b.json", "mlp-profile.json", 0.1181),  # 2 gloo ranks, mlp 8 x 512
])
def test_a_committed_run_reproduces_its_prediction_and_its_memory(run, profile, iteration_error):
    """Runs of the fidelity report (repeat 0 of traces/measured/fidelity-cpu2-day3-passes-at-mean.json) with
    the profile calibrated just before them: the prediction from that profile reproduces the error the
    report recorded, and every device's peak memory, boundary tensors and posted receives included, to
    within 0.5 %."""
    from pipesim.planning.replay import predict_measured
    from pipesim.profiles.schema import load_profile

    measured = read_trace(FIDELITY_RUNS / run)
    found = compare(predict_measured(measured.meta, load_profile(FIDELITY_RUNS / profile)), measured)
    assert found.iteration_time_error == pytest.approx(iteration_error, abs=1e-4)
    assert found.version_mismatches == 0 and found.measured_complete
    assert all(abs(d.peak_memory_error) < 0.005 for d in found.devices), found.devices


def test_a_measured_trace_of_an_unknown_schedule_is_refused_naming_the_trace_not_a_flag():
    """compare takes the schedule from the trace, not from --schedule (which it does not have): an unknown one
    says it is the trace's, as method_named's refusal (naming --schedule for run and study) would not."""
    from pipesim.planning.replay import predict_measured
    from pipesim.profiles.schema import load_profile

    measured, profile = read_trace(FIDELITY_RUNS / "1f1b.json"), load_profile(FIDELITY_RUNS / "mlp-profile.json")
    with pytest.raises(TraceError, match=r"^cannot predict the recorded run: its schedule: unknown '1f1bx' \(did you "
                                         r"mean '1f1b'\?\); choose from gpipe, 1f1b,") as refused:
        predict_measured(replace(measured.meta, schedule="1f1bx"), profile)
    assert "--schedule" not in str(refused.value)


def test_a_runs_recorded_profile_edited_wrong_is_refused_naming_its_field():
    """compare MEASURED predicts from the profile the run recorded: one that fails its checks names the field, as
    a profile file's refusal does (it said "7 validation errors for Profile")."""
    from pipesim.planning.replay import predict_measured
    from pipesim.profiles.schema import load_profile

    measured = read_trace(FIDELITY_RUNS / "1f1b.json")
    recorded = load_profile(FIDELITY_RUNS / "mlp-profile.json").model_dump(mode="json")
    del recorded["environment"]
    for document, field in ((recorded, "environment: missing: give an object"), ("x", "Input should be an object")):
        meta = replace(measured.meta, extra=measured.meta.extra | {"profile": document})
        with pytest.raises(TraceError, match=f"^the run's recorded profile \\(meta.extra.profile\\) is not valid: "
                                             f"{field}"):
            predict_measured(meta)


def test_a_runs_recorded_profile_whose_tail_was_taken_in_wall_time_is_warned_of(tmp_path):
    """compare MEASURED predicts from the profile the run recorded, every pass at its contention tail: one taken in
    wall time (calibrated before it was taken in CPU time) above 1.2x is warned of, in one line, as simulate's
    --profile is, and the comparison still runs; the run's own profile (1.03x) is not."""
    import json

    from tests.conftest import pipesim

    document = json.loads((FIDELITY_RUNS / "1f1b.json").read_text())
    profile = json.loads((FIDELITY_RUNS / "mlp-profile.json").read_text())
    for tail, warns in ((profile["contention"]["tail"], False), (5.579, True)):
        profile["contention"]["tail"] = tail
        document["pipesim"]["meta"]["extra"]["profile"] = profile
        (tmp_path / "run.json").write_text(json.dumps(document))
        code, out, err = pipesim("compare", tmp_path / "run.json", "--json")
        assert code == 0 and json.loads(out)
        assert err.count("recorded profile: its contention tail, 5.58x on every pass, was taken in wall time") == warns


@pytest.mark.parametrize("window, shown", [("many", "'many'"), (2.5, "2.5"), (-3, "-3")])
def test_a_runs_malformed_receive_window_is_one_line(tmp_path, window, shown):
    """compare predicts a run with the receive window its trace records: one that is not a whole number >= 0 is
    refused in one line naming it (a string showed int()'s traceback)."""
    import json

    from tests.conftest import pipesim

    document = json.loads((FIDELITY_RUNS / "1f1b.json").read_text())
    extra = document["pipesim"]["meta"]["extra"]
    extra["profile"] = json.loads((FIDELITY_RUNS / "mlp-profile.json").read_text())
    extra["recv_window"] = window
    (tmp_path / "run.json").write_text(json.dumps(document))
    code, out, err = pipesim("compare", tmp_path / "run.json")
    assert code == 2 and out == "", err
    assert err.strip().splitlines() == [f"error: MEASURED {tmp_path / 'run.json'}: cannot predict the recorded run: "
                                        f"recv_window: give a whole number of at least 0 (got {shown})"]


@pytest.mark.parametrize("predicted", [False, True])
def test_compare_names_a_folder_without_traces(tmp_path, predicted):
    """An empty folder was said to "hold torch profiler traces" (without PREDICTED), or to be "no torch profiler
    traces given" (with it), naming no folder."""
    from tests.conftest import pipesim

    folder, page = tmp_path / "ranks", tmp_path / "c.html"
    folder.mkdir()
    trace = tmp_path / "p.json"
    assert pipesim("simulate", "-s", "1f1b", "-p", "2", "-m", "4", "--trace", trace).code == 0
    code, out, err = pipesim("compare", folder, *([trace] if predicted else []), "--html", page)
    assert code == 2 and out == "" and err.count("\n") == 1 and not page.exists(), err
    assert f"MEASURED: {folder} is a folder with no .json or .json.gz files" in err


@pytest.mark.parametrize("predicted", [False, True])
def test_compare_names_a_pipesim_trace_in_a_folder_and_the_file_to_give(tmp_path, predicted):
    """A folder holding the trace `pipesim run --trace` wrote was said to "hold torch profiler traces, which say
    nothing about the run's schedule" (without PREDICTED), or to be "profiler traces of ranks [0]" (with it): now
    the file, and the command that compares it; where it holds more than one, their names."""
    folder, page, trace = tmp_path / "ranks", tmp_path / "c.html", tmp_path / "p.json"
    folder.mkdir()
    (folder / "measured.json").write_bytes((FIDELITY_RUNS / "1f1b.json").read_bytes())
    assert pipesim("simulate", "-s", "1f1b", "-p", 2, "-m", 4, "-n", 8, "--trace", trace).code == 0
    given = [trace] if predicted else []
    assert pipesim("compare", folder, *given, "--html", page) == (
        2, "", f"error: MEASURED: {folder} holds a pipesim trace, not torch.profiler traces: give the file itself: "
               f"pipesim compare {' '.join(map(str, [folder / 'measured.json', *given]))}\n")
    (folder / "rank1.json").write_text(json.dumps({"traceEvents": []}))  # a profiler trace beside it
    assert pipesim("compare", folder, *given, "--html", page) == (
        2, "", f"error: MEASURED: {folder} holds a pipesim trace (measured.json), not torch.profiler traces alone: "
               "give the measured trace file itself, or a folder of torch.profiler traces, one per rank\n")
    assert not page.exists()


def test_an_estimate_predicts_a_gpu_run_over_the_links_that_run_was_calibrated_on():
    """benchmarks/gpu_check.py prices its estimate as the run ran: `links_from` gives the transfers the
    calibration's host-staged links (an estimate's own are its catalogue placement's NVLink), the compute stays
    the estimate's, and both ranks compute on the one GPU they shared."""
    from pipesim.planning.replay import predict_measured
    from pipesim.profiles.schema import load_profile

    check = TORCH_RUNS / "gpu-check-h200-day9"
    measured = read_trace(check / "run-1f1b.json")
    calibrated, estimate = load_profile(check / "profile.json"), load_profile(check / "estimate-fitted.json")
    traces = [predict_measured(measured.meta), predict_measured(measured.meta, estimate),
              predict_measured(measured.meta, estimate, links_from=calibrated)]
    kinds = [np.asarray(trace.kinds)[trace.ops.kind] for trace in traces]
    send, forward = [[trace.ops.dur_us[names == kind] for trace, names in zip(traces, kinds)]
                     for kind in ("SEND_F", "F")]
    assert np.array_equal(send[2], send[0]) and send[1].max() < send[0].min() / 10
    assert np.array_equal(forward[2], forward[1]) and not np.array_equal(forward[1], forward[0])
    busy_ms = float(traces[2].ops.dur_us[np.isin(kinds[2], ("F", "B"))].sum()) / 1e3  # both ranks' compute
    assert compare(traces[2], measured).predicted_ms >= busy_ms / measured.meta.minibatches


def test_the_commands_peak_memory_is_written_as_the_pages(tmp_path):
    """A prediction of a few KiB against a run of 2,432 MiB: its devices' table read "0.0 / 2,432.0" (",.1f"),
    the few KiB as nothing, where the page writes "<0.01" and "2,432" (`mib_text`), and its error "-100.0%", where
    the page writes a share from 100 % up whole and one short of it with the decimals that keep it so
    (`percent_text`): the few KiB are not nothing."""
    from tests.conftest import pipesim

    predicted, measured = tmp_path / "p.json", tmp_path / "m.json"
    shape = ("-s", "1f1b", "-p", 2, "-m", 4, "-n", 2)
    assert pipesim("simulate", *shape, "--param-mb", 0.001, "--activation-mb", 0.0005, "--output-mb", 0.0005,
                   "--trace", predicted).code == 0
    assert pipesim("simulate", *shape, "--activation-mb", 700, "--trace", measured).code == 0
    code, out, err = pipesim("compare", measured, predicted)
    assert code == 0, err
    rows = [line.split() for line in out.splitlines() if re.match(r"\s+[01]\s", line)]
    assert [row[-4:] for row in rows] == [["<0.01", "/", "2,432", "-99.9998%"], ["<0.01", "/", "1,732", "-99.9997%"]
                                          ], out


def test_the_commands_shares_are_written_as_the_pages(tmp_path):
    """Transfers predicted 16 times too long: the kinds' table read "1500.0% 1500.0% +1500.0%", its worst op
    "+1500%", where the error chart writes "1,500%" (`percent_text`, whole from 100 % up)."""
    from tests.conftest import pipesim

    predicted, measured = tmp_path / "p.json", tmp_path / "m.json"
    shape = ("-s", "1f1b", "-p", 2, "-m", 4, "-n", 2)
    assert pipesim("simulate", *shape, "--comm", 1.6, "--trace", predicted).code == 0
    assert pipesim("simulate", *shape, "--fwd", 1.05, "--comm", 0.1, "--trace", measured).code == 0
    code, out, err = pipesim("compare", measured, predicted)
    assert code == 0, err
    send = next(line.split() for line in out.splitlines() if line.split()[:1] == ["SEND_F"])  # the kinds' table
    assert send[4:] == ["1,500%", "1,500%", "+1,500%", "SEND_F0@0", "+1,500%"], send
    assert "error +36.7%" in out and "median duration error 2.4% (bias -2.4%)" in out


@pytest.mark.parametrize("day", ["day40", "day41", "day42"])
@pytest.mark.parametrize("run,within", [("1f1b", 0.05), ("zb-h1", 0.15), ("zb-h1-again", 0.15)])
def test_the_h200_checks_runs_at_this_code_are_predicted_from_their_calibration_as_the_check_printed(day, run, within):
    """traces/measured/gpu-check-h200-day40, -day41 and -day42 (benchmarks/gpu_check.py on an H200 at a0d6bc90,
    session 40, at 6ad80e01, session 41, and at 37de0933, session 42): each run replayed from its own calibration
    gives the iteration time the check printed (check.json), and that lies within `within` of the run's measured time
    (1F1B -2.3 %, -3.1 % and -2.0 %; ZB-H1 +3.1 % and +13.3 %, then +10.4 % and +5.8 %, then -6.8 % and -1.6 %: its
    two runs lie 9 %, 4 % and 5 % apart, the noise floor)."""
    from pipesim.planning.replay import predict_measured

    check = TORCH_RUNS / f"gpu-check-h200-{day}"
    step = json.loads((check / "check.json").read_text())["steps"][run]
    measured = read_trace(check / f"run-{run}.json")
    result = compare(predict_measured(measured.meta), measured)
    assert result.predicted_ms == pytest.approx(step["calibrated_ms"], rel=1e-9)
    assert result.measured_ms == pytest.approx(step["measured_ms"], rel=1e-9)
    assert abs(result.predicted_ms / result.measured_ms - 1) < within


def test_an_incomplete_runs_page_draws_the_prediction_of_the_ops_that_ran(tmp_path, monkeypatch):
    """compare's terminal held an interrupted run against the prediction of the ops that ran, but its page drew the
    whole prediction (2,000 mini-batches beside the 60 that ran, its makespan in the title): the page draws what
    the figures are of."""
    from pipesim.traces import view
    from pipesim.traces.compare import compared
    from pipesim.traces.trace import write_trace

    predicted = run("1f1b", 2, 4, 8, comm=0.1, param_mb=100, activation_mb=10).trace
    ran = predicted.ops.minibatch < 2
    measured = as_measured(predicted, keep=ran, complete=False, failed_rank=1)
    assert compared(predicted, as_measured(predicted))[1] is predicted
    assert len(compared(predicted, measured)[1].ops) == ran.sum() < len(predicted.ops)
    drawn = []
    monkeypatch.setattr(view, "write_timeline_page", lambda traces, *_, **__: drawn.extend(traces))
    write_trace(measured, tmp_path / "m.json")
    write_trace(predicted, tmp_path / "p.json")
    code, _, err = pipesim("compare", tmp_path / "m.json", tmp_path / "p.json", "--html", tmp_path / "c.html")
    assert code == 0, err
    assert [len(trace.ops) for trace in drawn] == [ran.sum(), ran.sum()]


def test_a_torch_run_whose_pairs_could_not_be_split_compares_what_was_read(tmp_path):
    """A dualpipev run whose overlapped ranges lost their autograd node (a pruned trace) leaves the pairs out, their
    parts counted missing, as before the run's order was checked: that check, which would read the ops left as
    another schedule's, is skipped where the reader dropped passes (a review of 1dec9402)."""
    run_dir = tmp_path / "pruned"
    run_dir.mkdir()
    for path in sorted((TORCH_RUNS / "torch-dualpipev-2cpu").glob("*.json")):
        doc = json.loads(path.read_text())
        doc["traceEvents"] = [event for event in doc["traceEvents"]
                              if not str(event.get("name", "")).startswith("autograd::engine")]
        (run_dir / path.name).write_text(json.dumps(doc))
    predicted = tmp_path / "p.json"
    assert pipesim("simulate", "-s", "dualpipev", "-p", "2", "-m", "8", "-n", "2", "--trace", predicted).code == 0
    code, out, err = pipesim("compare", run_dir, predicted, "--json")
    assert code == 0, err
    assert json.loads(out)["missing_in_measured"] == 88  # the 44 pairs' parts


def test_a_torch_run_that_recorded_no_pass_is_refused_saying_so(tmp_path):
    """torch's Schedule1F1B records no profiler range: traces of its optimizer steps alone were refused as "it ran
    0 micro-batches ... predict with -m 0" (a review of 1dec9402)."""
    run_dir = tmp_path / "steps"
    run_dir.mkdir()
    for path in sorted((TORCH_RUNS / "torch-1f1b-2cpu").glob("*.json")):
        doc = json.loads(path.read_text())
        doc["traceEvents"] = [event for event in doc["traceEvents"] if not str(event.get("name", "")).startswith(
            "PP:") or str(event["name"]).endswith("OPT")]
        (run_dir / path.name).write_text(json.dumps(doc))
    predicted = tmp_path / "p.json"
    assert pipesim("simulate", "-s", "1f1b", "-p", "2", "-m", "8", "-n", "3", "--trace", predicted).code == 0
    code, out, err = pipesim("compare", run_dir, predicted)
    assert (code, out) == (2, "") and "the profiler traces hold no forward or backward pass" in err, err


def test_a_micro_batch_group_of_p_compares_with_the_default_and_another_does_not(tmp_path):
    """--microbatch-group p is interleaved 1F1B's default order: a trace given it and one without are the same run;
    a group of m is another."""
    from pipesim.traces.compare import check_comparable

    traces = {}
    for group in (None, 2, 4):
        path = tmp_path / f"{group}.json"
        code, _, err = pipesim("simulate", "-s", "interleaved-1f1b", "-p", 2, "-m", 4, "--trace", path,
                               *(("--microbatch-group", group) if group else ()))
        assert code == 0, err
        traces[group] = read_trace(path)
    check_comparable(traces[None], traces[2])
    with pytest.raises(TraceError, match=r"microbatch_group 4 in MEASURED \(a prediction\), 2 predicted: predict "
                                         r"with --microbatch-group 4$"):
        check_comparable(traces[None], traces[4])


@pytest.mark.parametrize("run, prediction, said", [
    (("-p", 4), ("-p", 2), "placement [0, 1, 2, 3] in MEASURED (a prediction), [0, 1] predicted: predict with -p 4"),
    (("-s", "interleaved-1f1b", "-p", 2, "--chunks", 3), ("-s", "interleaved-1f1b", "-p", 2, "--chunks", 2),
     "placement [0, 1, 0, 1, 0, 1] in MEASURED (a prediction), [0, 1, 0, 1] predicted: predict with --chunks 3"),
    (("-p", 4), ("-p", 4, "--data-parallel", 2),
     "data_parallel 1 in MEASURED (a prediction), 2 predicted: predict with --data-parallel 1"),
    (("-s", "zb-h1", "-p", 4, "--reduce-after-flush", "--data-parallel", 2),
     ("-s", "zb-h1", "-p", 4, "--data-parallel", 2),
     "reduce_after_flush True in MEASURED (a prediction), False predicted: predict with --reduce-after-flush"),
])
def test_each_difference_names_the_flag_that_predicts_the_run(tmp_path, run, prediction, said):
    """The placement (another p or v) and the schedule's recorded parameters said what differed and no flag, as the
    shape's -m and -n did; the stage graph's edges, which differ with another stage count, are not said too."""
    from pipesim.traces.compare import check_comparable

    paths = [tmp_path / "run.json", tmp_path / "prediction.json"]
    for path, flags in zip(paths, (run, prediction)):
        code, _, err = pipesim("simulate", *(() if "-s" in flags else ("-s", "1f1b")), *flags, "--trace", path)
        assert code == 0, err
    with pytest.raises(TraceError) as refused:
        check_comparable(read_trace(paths[1]), read_trace(paths[0]))
    assert str(refused.value) == f"the traces describe different runs: {said}"


def test_a_shape_that_needs_its_group_is_predicted_with_it(tmp_path):
    """Interleaved 1F1B at m = 5, p = 2 runs in a group of its own: "predict with -m 5" alone was refused by
    simulate (m no multiple of p), which needs the run's --microbatch-group beside it."""
    from pipesim.traces.compare import check_comparable

    paths = [tmp_path / "grouped.json", tmp_path / "default.json"]
    for path, shape in zip(paths, [("-m", 5, "--microbatch-group", 3), ("-m", 4)]):
        code, _, err = pipesim("simulate", "-s", "interleaved-1f1b", "-p", 2, "--chunks", 2, *shape, "--trace", path)
        assert code == 0, err
    with pytest.raises(TraceError, match=r"microbatches 5 in MEASURED \(a prediction\), 4 predicted: predict with "
                                         r"-m 5 --microbatch-group 3$"):
        check_comparable(read_trace(paths[1]), read_trace(paths[0]))
