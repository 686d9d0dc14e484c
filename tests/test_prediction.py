"""The prediction distance as a choice: each source of s (paper, code, counted) gives the distances that source
states, the choice travels with the schedule (params, trace metadata, lowering) and bad choices are one line.

Expected distances are written by hand from the sources, not computed by pipesim's formulas:
- SpecTrain paper, and its code (ntueclab/SpecTrain-PyTorch `load_predicted_weights`): s_F = k//2 + p-k-1,
  s_B = k//2.
- PipeOptim paper: s = p-k-1; its code (guanleics/PipeOptim `forward_s = world_size - rank`): p-k. No backward
  prediction.
- XPipe paper: s_F = round((p+m-k/2-2)/m), s_B = round((m+floor(k/2)-1)/m), halves rounded up.
- counted: updates between the op's weight read and the update that consumes its gradient, read off PipeDream's
  order by hand (warm-up p-k-1 forwards, then F and B in turn, an update after each mini-batch's last B). E.g.
  p=4, m=2, stage 0 runs F0 F1 F2 F3 B0 F4 B1 OPT0 F5 ...: F4 (mini-batch 2) reads version 0 and its gradient
  goes into update 2, so s = 2.
"""

import csv
import re

import pytest

from pipesim.schedules import METHODS, Kind, Prediction, ScheduleError, ScheduleParams, WeightPolicy, lower
from pipesim.traces import read_trace
from tests.conftest import build, pipesim, simulate_json, simulated

N = 8  # mini-batches: enough for every stage to reach its steady state

# (method, source, p, m) -> (largest forward s per stage, largest backward s per stage; None: not predicted)
EXPECTED = {
    ("spectrain", "paper", 4, 1): ([3, 2, 2, 1], [0, 0, 1, 1]),
    ("spectrain", "paper", 5, 3): ([4, 3, 3, 2, 2], [0, 0, 1, 1, 2]),
    ("spectrain", "code", 4, 2): ([3, 2, 2, 1], [0, 0, 1, 1]),
    ("spectrain", "counted", 4, 1): ([3, 2, 1, 0], [0, 0, 0, 0]),
    ("spectrain", "counted", 4, 2): ([2, 1, 1, 0], [0, 0, 0, 0]),
    ("pipeoptim", "paper", 4, 1): ([3, 2, 1, 0], [None] * 4),
    ("pipeoptim", "paper", 3, 4): ([2, 1, 0], [None] * 3),
    ("pipeoptim", "code", 4, 1): ([4, 3, 2, 1], [None] * 4),
    ("pipeoptim", "code", 6, 2): ([6, 5, 4, 3, 2, 1], [None] * 6),
    ("pipeoptim", "counted", 4, 1): ([3, 2, 1, 0], [None] * 4),
    ("pipeoptim", "counted", 2, 2): ([1, 0], [None] * 2),
    ("xpipe", "paper", 4, 2): ([2, 2, 2, 1], [1, 1, 1, 1]),
    ("xpipe", "paper", 4, 4): ([2, 1, 1, 1], [1, 1, 1, 1]),
    ("xpipe", "paper", 8, 2): ([4, 4, 4, 3, 3, 3, 3, 2], [1, 1, 1, 1, 2, 2, 2, 2]),
    ("xpipe", "counted", 4, 2): ([2, 1, 1, 0], [0, 0, 0, 0]),
    ("xpipe", "counted", 3, 2): ([1, 1, 0], [0, 0, 0]),
}
PRIMARY = {"spectrain": "paper", "pipeoptim": "paper", "xpipe": "paper"}


@pytest.mark.parametrize("case", list(EXPECTED), ids=lambda c: "-".join(map(str, c)))
def test_each_source_gives_the_distances_it_states(case):
    name, source, p, m = case
    forward, backward = EXPECTED[case]
    schedule = build(name, p, m, N, prediction=source)
    summary = simulated(schedule).summary
    assert [s.prediction_distance for s in summary.stages] == forward
    assert [s.backward_prediction_distance for s in summary.stages] == backward
    # the lowering carries them to the executor (test_executor_methods checks it trains on them, per source)
    lowered = lower(schedule)
    rows = lowered.table.kind == list(Kind).index(Kind.F)
    per_stage = [int(lowered.prediction[rows & (lowered.table.stage == k)].max()) for k in range(p)]
    assert per_stage == forward


@pytest.mark.parametrize("name", list(PRIMARY))
def test_the_default_is_the_primary_source_and_the_choice_is_recorded(name, tmp_path):
    default = build(name, 4, 2, N)
    assert default.params["prediction"] == PRIMARY[name]
    assert default.policy.describe()["prediction_source"] == PRIMARY[name]
    chosen = build(name, 4, 2, N, prediction="counted")
    assert chosen.params["prediction"] == "counted" and chosen.policy.describe()["prediction_source"] == "counted"
    assert chosen.to_text() == default.to_text()  # the same order and PRED actions; only s differs
    trace = tmp_path / "t.json"
    code, _, _ = pipesim("simulate", "-s", name, "-p", 4, "-m", 2, "-n", 2, "--prediction", "counted", "--trace", trace)
    assert code == 0
    meta = read_trace(trace).meta
    assert meta.params["prediction"] == "counted" and meta.policy["prediction_source"] == "counted"


def test_methods_without_prediction_take_no_source():
    assert build("pipedream", 4, 2).params["prediction"] is None
    with pytest.raises(ScheduleError, match="gpipe predicts no weights: leave prediction unset"):
        METHODS["gpipe"].params(4, 2, prediction="paper")


def test_bad_sources_are_refused_naming_what_is_allowed():
    with pytest.raises(ScheduleError, match=r"prediction: choose from paper, code, counted \(got 'papers'\)"):
        ScheduleParams(4, 2, prediction="papers")
    with pytest.raises(ScheduleError, match="xpipe: prediction 'code' is not a source of s it records; choose from "
                                            "paper, counted"):
        build("xpipe", 4, 2, prediction="code")
    with pytest.raises(ScheduleError, match="same sources on both sides"):
        WeightPolicy(predict_forward=Prediction({"paper": "p-k"}), predict_backward=Prediction({"code": "k"}))
    with pytest.raises(ScheduleError, match="a closed form comes from one of paper, code"):
        Prediction({"counted": "p-k"})


def test_done_when_xpipe_paper_and_counted_forward_distances():
    for source, forward in (("paper", [2, 2, 2, 1]), ("counted", [2, 1, 1, 0])):
        (result,) = simulate_json("-s", "xpipe", "-p", 4, "-m", 2, "-n", 8, "--prediction", source)
        assert result["prediction"] == source
        assert [s["prediction_distance"] for s in result["stages"]] == forward


def test_the_table_names_the_source_of_each_predicting_method():
    code, out, _ = pipesim("simulate", "-s", "1f1b", "-s", "pipeoptim", "-p", 4, "-m", 4, "-n", 4,
                           "--prediction", "code")
    assert code == 0
    assert "pipeoptim (s: code)" in out and "1f1b (" not in out
    (plain,) = simulate_json("-s", "1f1b", "-p", 4, "-m", 4)
    assert plain["prediction"] is None


def test_schedules_states_each_primary_source():
    code, out, _ = pipesim("schedules")
    assert code == 0
    assert out.count("paper (primary)") == len(PRIMARY)
    assert "F: p-k" in out and re.search(r"^ +counted +from the order *$", out, re.M)


@pytest.mark.parametrize("args,fragment", [
    (["simulate", "-s", "xpipe", "--prediction", "bogus"], "--prediction: choose from paper, code, counted"),
    (["simulate", "-s", "xpipe", "--prediction", "code"], "xpipe: prediction 'code' is not a source of s"),
    (["simulate", "-s", "gpipe", "--prediction", "paper"], "--prediction applies to spectrain, pipeoptim, xpipe"),
    (["sweep", "-s", "xpipe", "--prediction", "paper,nope"], "--prediction: unknown 'nope'"),
])
def test_bad_prediction_flags_exit_2_with_one_line(args, fragment):
    code, out, err = pipesim(*args)
    assert code == 2 and out == ""
    assert fragment in err and len(err.strip().splitlines()) == 1 and "Traceback" not in err


def test_sweep_multiplies_only_predicting_methods_and_names_the_source_used(tmp_path):
    out = tmp_path / "r.csv"
    code, text, _ = pipesim("sweep", "-s", "1f1b,xpipe,pipeoptim", "-p", 4, "-m", 2, "-n", 4,
                            "--prediction", "code,counted", "-j", 1, "--out", out)
    assert code == 0
    with open(out, newline="") as handle:
        rows = [(r["schedule"], r["prediction"], r["status"]) for r in csv.DictReader(handle)]
    assert rows == [("1f1b", "", "ok"), ("xpipe", "code", "skipped"), ("xpipe", "counted", "ok"),
                    ("pipeoptim", "code", "ok"), ("pipeoptim", "counted", "ok")]
    code, _, _ = pipesim("sweep", "-s", "spectrain", "-p", 4, "-m", 2, "-n", 4, "-j", 1, "--out", out)
    with open(out, newline="") as handle:
        assert [r["prediction"] for r in csv.DictReader(handle)] == ["paper"]  # the default, named



@pytest.mark.parametrize("minibatches", [4, 8])
def test_a_predicting_methods_step_holds_every_devices_work(minibatches):
    """Where weight prediction takes time, the next mini-batch's predictions run beside a mini-batch, so the last
    mini-batch, with no next one, ends early: counting it, XPipe's step was 37.33 ms at N = 4 (38.29 at 8) where
    each device computes 39 ms a step, and its bubble, negative, read 0.0%. With the last left out the step is the
    work a device does in it, at every N, as PipeDream's without a prediction (29 ms)."""
    results = simulate_json("-s", "xpipe", "-s", "spectrain", "-s", "pipeoptim", "-s", "pipedream", "--opt", 5,
                            "-p", 4, "-m", 8, "-n", minibatches)
    steps = {result["schedule"]: result["time_per_minibatch_ms"] for result in results}
    assert steps == {"xpipe": 39.0, "spectrain": 109.0, "pipeoptim": 69.0, "pipedream": 29.0}
    for result in results:  # each device busy the whole step: no bubble, and none hidden below 0
        busy = [device["busy_ms"] / minibatches for device in result["devices"]]
        assert max(busy) == pytest.approx(result["time_per_minibatch_ms"]), (result["schedule"], busy)
