"""`pipesim study`: which arms it trains, that every arm gets the same sample budget, that a run is the
executor's (deterministic per seed, the schedule's staleness measured), that a diverged run is recorded rather
than raised, that a study resumes from its results file and re-plots without training, and its bad input."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from pipesim.schedules import ScheduleError
from pipesim.study.plan import Arm, Setting, arms, build
from pipesim.study.results import ResultsError, Spread, StudyFile, load_results, open_results
from tests.conftest import pipesim
from tests.helpers import PROFILES
from tests.helpers import TINY_SETTING as TINY

TINY_FLAGS = ("--layers", 2, "--width", 16, "-p", 2, "-m", 2, "-b", 4, "-n", 4, "--seeds", 2, "--no-timing")


def replaced(flags: tuple, flag: str, value) -> tuple:
    """`flags` with `flag`'s value replaced: the command line refuses a flag of one value given twice."""
    at = flags.index(flag)
    return (*flags[:at + 1], value, *flags[at + 2:])


def test_predicting_methods_also_run_every_other_source_that_changes_their_distances():
    """At p=4, m=4 (values from the sources, docs/methods.md): SpecTrain's paper and code agree (k//2 + p-k-1)
    and the count differs; PipeOptim's paper (p-k-1), code (p-k) and count all differ; XPipe has no code."""
    labels = [a.label for a in arms(Setting(), ["gpipe", "spectrain", "pipeoptim", "xpipe"])]
    assert labels == ["gpipe", "spectrain", "spectrain (counted)", "pipeoptim", "pipeoptim (code)",
                      "pipeoptim (counted)", "xpipe", "xpipe (counted)"]


def test_a_chosen_prediction_source_is_the_only_one_run():
    chosen = arms(Setting(), ["gpipe", "pipeoptim", "xpipe"], prediction="counted")
    assert chosen == [Arm("gpipe"), Arm("pipeoptim", "counted", primary=False), Arm("xpipe", "counted", primary=False)]
    with pytest.raises(ScheduleError, match="xpipe.*code"):
        arms(Setting(), ["xpipe"], prediction="code")


def test_every_arm_trains_on_the_same_sample_budget():
    setting = Setting(minibatches=8)
    for method in ("gpipe", "pipedream", "avgpipe"):
        schedule = build(setting, method)
        assert schedule.pipelines * schedule.minibatches * schedule.microbatches * setting.microbatch_size \
            == setting.samples
    assert build(setting, "avgpipe").pipelines == 2
    with pytest.raises(ScheduleError, match="multiple of 2"):
        build(Setting(minibatches=7), "avgpipe")


def test_spread_is_mean_and_sample_std_of_the_finite_values():
    spread = Spread.of([0.5, 0.7, math.nan, None])
    assert (spread.mean, spread.n) == (pytest.approx(0.6), 2)
    assert spread.std == pytest.approx(math.sqrt(0.02))
    assert Spread.of([None]).text() == "-"


@pytest.fixture(scope="module")
def trained():
    from pipesim.study.train import train

    return {(method, seed): train(TINY, Arm(method), "momentum", 0.05, seed)
            for method in ("gpipe", "1f1b", "pipedream") for seed in (0, 1)}


def test_a_run_is_deterministic_per_seed_and_the_same_for_one_synchronous_schedule_or_another(trained):
    from pipesim.study.train import train

    again = train(TINY, Arm("gpipe"), "momentum", 0.05, 0)
    assert again.losses == trained["gpipe", 0].losses
    assert trained["1f1b", 0].losses == pytest.approx(trained["gpipe", 0].losses, rel=1e-5)
    assert trained["gpipe", 1].losses != trained["gpipe", 0].losses
    assert trained["pipedream", 0].losses != pytest.approx(trained["gpipe", 0].losses, rel=1e-3)  # stale weights


def test_a_v_schedule_trains_its_p_v_stages_as_a_chain_of_p_does():
    """zb-v, interleaved-1f1b and dualpipev at p = 2 run 4 model stages: the study cut the model into p, and each
    failed at its first run (after the calibration, leaving a results file of no run)."""
    from dataclasses import replace as replaced_setting

    from pipesim.study.train import train

    setting = replaced_setting(TINY, model_options={"layers": 4, "width": 16}, microbatches=4)  # dualpipev: m >= 2p
    chain = train(setting, Arm("1f1b"), "momentum", 0.05, 0)
    for method in ("zb-v", "interleaved-1f1b", "dualpipev"):
        record = train(setting, Arm(method), "momentum", 0.05, 0)
        assert record.status == "ok" and len(record.stages) == 4, method
        assert record.losses == pytest.approx(chain.losses, rel=1e-5), method


def test_a_run_records_what_each_stage_ran_on_and_its_heldout_scores(trained):
    pipedream, gpipe = trained["pipedream", 0], trained["gpipe", 0]
    assert [s.forward_staleness for s in pipedream.stages] == [1, 0]
    assert [s.forward_staleness for s in gpipe.stages] == [0, 0]
    assert 0 <= gpipe.heldout_accuracy <= 1 and gpipe.heldout_loss > 0
    assert gpipe.samples_per_minibatch == 2 * 4 and len(gpipe.losses) == 4


def test_a_diverged_run_is_recorded_not_raised():
    from pipesim.study.train import train

    record = train(TINY, Arm("gpipe"), "sgd", 1e9, 0)
    assert record.status == "diverged" and record.heldout_accuracy is None and math.isnan(record.final_loss)
    # the mini-batches finished before it keep their losses (the page draws the run up to where it left)
    finished = len([loss for loss in record.losses if loss is not None])
    assert finished >= 1 and all(math.isfinite(loss) for loss in record.losses[:finished])
    assert record.losses[finished:] == [None] * (len(record.losses) - finished)


def test_a_run_whose_trained_model_scores_a_nan_heldout_loss_is_recorded_as_diverged(monkeypatch):
    """The default study's pipeoptim (code), momentum, seed 0: its loss finite to the end but 2e17 there, its model
    scored NaN, and the record refused it (a pydantic traceback 74 s into `pipesim study`). Its training losses are
    kept."""
    import pipesim.study.train as training

    trained = training.run_in_process

    def blown_up(spec):
        result = trained(spec)
        result.trace.meta.extra["heldout"] = {"loss": math.nan, "accuracy": 0.1}
        return result

    monkeypatch.setattr(training, "run_in_process", blown_up)
    record = training.train(TINY, Arm("gpipe"), "momentum", 0.05, 0)
    assert record.status == "diverged" and record.diverged and math.isnan(record.final_loss)
    assert record.heldout_loss is None and record.heldout_accuracy is None
    assert len(record.losses) == TINY.minibatches and all(math.isfinite(loss) for loss in record.losses)


def test_study_trains_writes_its_results_and_page_then_resumes_without_training_again(tmp_path, monkeypatch):
    results, page = tmp_path / "study.json", tmp_path / "study.html"
    flags = ("study", "-s", "gpipe", "-s", "pipedream", "--optimizer", "momentum=0.05")
    args = (*flags, *TINY_FLAGS, "--results", results, "--html", page)
    code, out, err = pipesim(*args, "--json")
    assert code == 0, err
    document = json.loads(out)
    assert [(a["arm"], a["seeds"]) for a in document["arms"]] == [("gpipe", 2), ("pipedream", 2)]
    assert 0 < document["arms"][0]["heldout_accuracy"]["mean"] <= 1
    saved = load_results(results)
    assert len(saved.runs) == 4 and "<html" in page.read_text()
    stamps = [r.wall_s for r in saved.runs]

    more_seeds = replaced(TINY_FLAGS, "--seeds", 3)
    monkeypatch.setattr("pipesim.commands.tables.PIPED_EVERY_S", 0.0)  # a line a run (10 s apart at the most)
    code, out, err = pipesim(*flags, *more_seeds, "--results", results, "--html", page)
    assert code == 0, err
    # piped (a log, CI), its progress is a line on stderr: a study of minutes said nothing there
    assert [line for line in err.splitlines() if line.startswith("study: ")] == [
        "study: 0/2 done; training gpipe, momentum, seed 2", "study: 1/2 done; training pipedream, momentum, seed 2"]
    resumed = load_results(results)
    assert len(resumed.runs) == 6 and [r.wall_s for r in resumed.runs[:4]] == stamps  # the old runs were kept
    assert "pipedream" in out and "0,0" in out

    page.unlink()
    code, out, err = pipesim("study", "--plot-only", "--results", results, "--html", page)
    assert code == 0, err
    assert page.exists() and load_results(results).runs == resumed.runs
    assert " ".join(out.split()).endswith(f"wrote {page}"), out
    code, out, err = pipesim("study", "--plot-only", "--results", results, "--html", page)  # as view says it
    assert code == 0 and " ".join(out.split()).endswith(f"wrote {page} (replaced the file that was there)"), out


def test_a_timing_of_other_repeats_than_given_is_taken_again_and_said(tmp_path, monkeypatch, capsys):
    """A resumed study with --timing-repeats 2 kept the file's timing of one run and said "one run each
    (--timing-repeats 1)": the flag changed nothing. Left to the default, the file's timing is kept."""
    import pipesim.study.train as training
    from pipesim.commands.study import _train
    from pipesim.study.results import TimingRecord

    arm, path = Arm("gpipe"), tmp_path / "study.json"
    saved = StudyFile(format_version=1, setting=TINY.as_dict(), profile={},
                      runs=[training.train(TINY, arm, "momentum", 0.05, 0)])
    once = TimingRecord(method="gpipe", source=None, optimizer="momentum", lr=0.05, seed=0, repeats=1,
                        measured_samples_per_s=10.0, measured_spread=0.0, predicted_samples_per_s=11.0, ranks=2)
    saved.timings = [once]
    timed = []
    monkeypatch.setattr(training, "time_arm", lambda *args: timed.append(args[-1]) or once.model_copy(
        update={"repeats": args[-1]}))
    monkeypatch.setattr("pipesim.profiles.schema.Profile.model_validate", lambda document: None)
    train_once = {"momentum": 0.05}
    _train(saved, TINY, [arm], train_once, [0], True, 3, path, quiet=True)  # the default: kept
    assert timed == [] and saved.timings == [once]
    _train(saved, TINY, [arm], train_once, [0], True, 2, path, quiet=True, repeats_given=True)
    assert timed == [2] and [t.repeats for t in saved.timings] == [2] and load_results(path).timings == saved.timings
    assert "note: timing gpipe again: --results" in capsys.readouterr().err


def test_a_searched_method_is_refused_naming_the_flag_and_the_command_that_trains_it(tmp_path):
    """auto's build refused it in the planner's words ("planning.scenario.Scenario.build"), naming no flag."""
    code, out, err = pipesim("study", "-s", "auto", *TINY_FLAGS, "--results", tmp_path / "s.json")
    assert (code, out) == (2, "") and err == (
        "error: --schedule auto: its order is searched from the stages' costs, which a study does not price: train it "
        "with `pipesim run -s auto --profile PROFILE`, or give a fixed method\n")
    assert list(tmp_path.iterdir()) == []


def test_a_results_file_of_another_setting_is_refused_naming_what_differs(tmp_path):
    results = tmp_path / "study.json"
    StudyFile(format_version=1, setting=TINY.as_dict()).save(results)
    with pytest.raises(ResultsError, match="microbatch_size 4, not 16"):
        open_results(results, Setting("mlp", {"layers": 2, "width": 16}, stages=2, microbatches=2, minibatches=4))
    code, _, err = pipesim("study", *replaced(TINY_FLAGS, "-n", 6), "--results", results, "--html", tmp_path / "p.html")
    assert code == 2 and "minibatches 4, not 6" in err


@pytest.mark.parametrize("args,message", [
    (("--optimizer", "rmsprop"), "--optimizer: choose from"),
    (("--optimizer", "adam=-1"), "finite learning rate above 0 (got 'adam=-1')"),
    (("--optimizer", "adam="), "--optimizer: give NAME=LR with a finite learning rate above 0 (got 'adam=')"),  # 0.002
    (("--optimizer", "adam", "--optimizer", "adam=0.01"), "--optimizer: give each optimizer once (got 'adam' twice)"),
    (("-s", "nosuch"), "--schedule: unknown 'nosuch'"),
    (("-s", "pipedream-2bw", "-p", 4, "-m", 2, "--layers", 8), "m >= p-1"),
    (("-p", 4, "--layers", 2), "--stages 4: mlp of 2 blocks (--layers) has 3 layers in all; give at most 3 stages"),
    (("-s", "zb-v", "-p", 2, "--layers", 2), "--stages 2 x zb-v's 2 chunks: mlp of 2 blocks (--layers) has 3 layers"),
    (("-s", "graphpipe", "-p", 4, "--layers", 8), "--schedule graphpipe: its stage graph [(0, 1), (0, 2), (1, 3), "
                                                  "(2, 3)] branches, and study's models (mlp, cnn) are chains"),
    (("--prediction", "guess"), "--prediction: choose from"),
    (("--model", "gpt"), "--model: choose from mlp, cnn (got 'gpt')"),  # it trained for minutes instead
    (("--seeds", 10**12), "--seeds: give a whole number from 1 to 1,000 (got 1,000,000,000,000)"),  # MemoryError
    (("-b", 10**12), "mlp does not fit in memory at micro-batch size 1,000,000,000,000 (--microbatch-size)"),  # torch's
    (("-s", "1f1b", "--pipelines", 3), "--pipelines applies to avgpipe only, not 1f1b"),  # dropped: 1f1b trained
    (("-s", "bogus", "--pipelines", 3), "--schedule: unknown 'bogus'; choose from"),  # was "not bogus"
    (("--timing-repeats", 5), "--timing-repeats sizes the timing, which --no-timing skips: give one"),  # dropped
])
def test_bad_flags_are_one_line_and_exit_2(tmp_path, args, message):
    code, _, err = pipesim("study", "--no-timing", "--results", tmp_path / "r.json", "--html", tmp_path / "p.html",
                           *args)
    assert code == 2 and message in err and "Traceback" not in err
    assert not (tmp_path / "r.json").exists()


@pytest.mark.parametrize("content,message", [
    (None, "cannot read"), ("{", "is not valid JSON"), ('{"format_version": 1}', "setting: missing: give an object"),
])
def test_plot_only_needs_a_readable_results_file(tmp_path, content, message):
    results = tmp_path / "r.json"
    if content is not None:
        results.write_text(content)
    code, _, err = pipesim("study", "--plot-only", "--results", results, "--html", tmp_path / "p.html")
    assert code == 2 and err.startswith("error: --results: ") and message in err


@pytest.mark.parametrize("field,value,message", [
    (("runs", "losses"), [], "runs.0.losses: List should have at least 1 item"),  # was an IndexError's traceback
    (("runs", "heldout_accuracy"), 5.0, "runs.0.heldout_accuracy: Input should be less than or equal to 1"),
    (("runs", "method"), "foo", "runs.0.method: one of gpipe, 1f1b, "),  # was a row of the table
    (("timings", "measured_samples_per_s"), -1, "timings.0.measured_samples_per_s: Input should be greater than 0"),
])
def test_plot_only_refuses_a_results_file_whose_values_cannot_be(tmp_path, field, value, message):
    """The committed study with one value no run can give: one line naming it, exit 2, no page."""
    document = json.loads((PROFILES.parent / "study" / "digits-mlp-p4.json").read_text())
    document[field[0]][0][field[1]] = value
    results = tmp_path / "r.json"
    results.write_text(json.dumps(document))
    code, _, err = pipesim("study", "--plot-only", "--results", results, "--html", tmp_path / "p.html")
    assert code == 2 and err.startswith("error: --results: ") and message in err, err
    assert not (tmp_path / "p.html").exists()


def test_plot_only_says_another_commands_json_is_no_study(tmp_path):
    """`simulate --json`'s document, or a JSON array, given as --results was refused by its first field,
    "format_version: Field required" or "Input should be a valid dictionary or instance of StudyFile": the line
    names the file, the field a study's results begin with, and what writes them."""
    code, printed, _ = pipesim("simulate", "-s", "1f1b", "--json")
    assert code == 0
    (tmp_path / "simulated.json").write_text(printed)
    (tmp_path / "array.json").write_text("[1, 2]")
    said = [pipesim("study", "--plot-only", "--results", tmp_path / name, "--html", tmp_path / "p.html")
            for name in ("simulated.json", "array.json")]
    study = ("(a study's results are an object of format_version, setting, runs and timings); give the --results "
             "file `pipesim study` wrote\n")
    assert said == [(2, "", f"error: --results: {tmp_path / 'simulated.json'} is a pipesim simulate report, not a "
                            "study results file: `pipesim simulate --json` printed it, and no command reads it back; "
                            "give the --results file `pipesim study` wrote\n"),
                    (2, "", f"error: --results: {tmp_path / 'array.json'} is not a study results file: it is not a "
                            f"JSON object {study}")]
    assert not (tmp_path / "p.html").exists()


def test_plot_only_without_a_study_here_says_how_to_get_one(tmp_path, monkeypatch):
    """docs/study.md's second line, `pipesim study --plot-only`, in a folder where no study ran said only that
    study.json could not be read: it names the command that writes it and the committed study it can show, by a path
    that is there from the user's folder: relative from the repository's root, whole from any other folder, where
    "traces/study/digits-mlp-p4.json" was missing too and, given, was refused with the same advice."""
    monkeypatch.chdir(tmp_path)
    code, out, err = pipesim("study", "--plot-only")
    assert code == 2 and out == "" and not list(tmp_path.iterdir())
    assert err == ("error: --results: cannot read study results file study.json: No such file or directory; "
                   "`pipesim study` writes it (about 3 minutes on 2 cores), or show the committed study: --results "
                   f"{COMMITTED}\n"), err
    code, out, err = pipesim("study", "--plot-only", "--results", err.split()[-1], "--html", tmp_path / "s.html")
    assert code == 0 and (tmp_path / "s.html").exists(), err  # the advice, followed, shows it
    monkeypatch.chdir(COMMITTED.parents[2])
    code, out, err = pipesim("study", "--plot-only", "--results", tmp_path / "none.json")
    assert code == 2 and err.endswith("show the committed study: --results traces/study/digits-mlp-p4.json\n"), err


@pytest.mark.parametrize("args,flags", [
    (("-p", 2), "--stages"), (("-s", "1f1b", "--model", "cnn"), "--schedule, --model"),
    (("--no-timing",), "--timing/--no-timing"),
])
def test_plot_only_refuses_the_flags_of_a_study_it_does_not_train(tmp_path, args, flags):
    """They were ignored: `--plot-only -p 2` showed the recorded p = 4 study as though it were p = 2's."""
    code, out, err = pipesim("study", "--plot-only", "--results", COMMITTED, "--html", tmp_path / "p.html", *args)
    assert code == 2 and out == "" and not list(tmp_path.iterdir())
    assert err == f"error: {flags}: --plot-only trains nothing and shows --results as it was recorded; leave it out\n"


@pytest.mark.slow
def test_timing_measures_spawned_ranks_and_predicts_them_from_a_calibration_with_the_runtime_terms(tmp_path,
                                                                                                  monkeypatch):
    """The command's whole timing path at a tiny size: the setting calibrated as `pipesim calibrate` does it
    (the model, the executor's cost per row, contention), then the arm timed on spawned ranks and predicted."""
    from pipesim.calibrate import contention
    from pipesim.profiles.schema import Profile

    monkeypatch.setattr(contention, "WINDOW_S", 0.2)  # the parent sets the windows: shorter ones for a test

    results = tmp_path / "study.json"
    flags = [flag for flag in replaced(TINY_FLAGS, "--seeds", 1) if flag != "--no-timing"]
    code, out, err = pipesim("study", "-s", "1f1b", "--optimizer", "momentum", *flags,
                             "--timing-repeats", 1, "--results", results, "--html", tmp_path / "s.html", "--json")
    assert code == 0, err
    (arm,) = json.loads(out)["arms"]
    assert arm["measured_samples_per_s"] > 0 and arm["predicted_samples_per_s"] > 0
    saved = load_results(results)
    profile = Profile.model_validate(saved.profile)
    assert profile.environment.threads == 1 and profile.environment.microbatch_size == TINY.microbatch_size
    assert profile.runtime is not None and profile.runtime.meta["host_times_from"] == "the calibrated model"
    assert "host_cache" in profile.runtime.meta  # the per-host probe terms as `pipesim calibrate` keeps them
    assert profile.contention is not None and len(profile.contention.slowdown) >= 2  # one rank alone, two at once
    assert [t.ranks for t in saved.timings] == [2]


COMMITTED = Path(__file__).resolve().parents[1] / "traces" / "study" / "digits-mlp-p4.json"


def test_the_committed_study_replays_and_is_consistent_with_the_semantics(tmp_path):
    """The README's study (`traces/study/`), re-plotted: gpipe and 1f1b are one computation, and so are
    SpecTrain and PipeOptim on the count (F predicted 1,1,1,0 updates ahead; SpecTrain's B at s = 0 is
    PipeOptim's B on the current weights), so each pair trained to the same numbers."""
    from pipesim.study.results import recorded_arms, summarize

    code, out, err = pipesim("study", "--plot-only", "--results", COMMITTED, "--html", tmp_path / "s.html", "--json")
    assert code == 0, err
    arms = {(a["arm"], a["optimizer"]): a for a in json.loads(out)["arms"]}
    assert len(arms) == 24 and all(a["seeds"] == 3 for a in arms.values())
    saved = load_results(COMMITTED)
    by_arm = {(s.arm.label, s.optimizer): s for s in summarize(saved, *recorded_arms(saved))}
    for optimizer in ("momentum", "adam"):
        for a, b in (("gpipe", "1f1b"), ("spectrain (counted)", "pipeoptim (counted)")):
            for ours, theirs in zip(by_arm[a, optimizer].runs, by_arm[b, optimizer].runs, strict=True):
                assert ours.losses == pytest.approx(theirs.losses, rel=1e-5)
    accuracy = {key: a["heldout_accuracy"]["mean"] for key, a in arms.items()}
    assert accuracy["pipedream", "momentum"] < accuracy["gpipe", "momentum"]  # the staleness the study is about


def test_the_tables_caption_says_how_many_runs_each_measured_rate_is_the_median_of():
    """At --timing-repeats 1 it read "median of repeats" of one run."""
    from pipesim.commands.study import _repeats_text

    assert _repeats_text([1]) == "one run each (--timing-repeats 1)"
    assert _repeats_text([3]) == "median of 3 runs" and _repeats_text([1, 3]) == "median of 1 or 3 runs"
