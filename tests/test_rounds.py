"""`--rounds R`: a mini-batch's micro-batches run as R flushes before its one update, as torch's pipelining runs
gradient accumulation (schedules/methods.py `in_rounds`)."""

from __future__ import annotations

import json

import pytest

from pipesim.schedules import ScheduleError, ScheduleParams
from pipesim.schedules.catalogue import METHODS, build_schedule

from .conftest import pipesim


def test_each_round_flushes_and_the_replicas_reduce_once_before_the_one_update():
    """Round 0's micro-batches 0-1 flush, round 1's 2-3 follow on their own numbers, and of each mini-batch's updates
    only the last round's is left, its REDUCE once before it (not one a round)."""
    schedule = build_schedule("1f1b", ScheduleParams(2, 4, 2, data_parallel=2, rounds=2))
    assert schedule.to_text().splitlines() == [
        "0: 0F0 0F1 0B0 0B1 0F2 0F3 0B2 0B3 0REDUCE 0OPT 0F0.1 0F1.1 0B0.1 0B1.1 0F2.1 0F3.1 0B2.1 0B3.1 0REDUCE.1 "
        "0OPT.1",
        "1: 1F0 1B0 1F1 1B1 1F2 1B2 1F3 1B3 1REDUCE 1OPT 1F0.1 1B0.1 1F1.1 1B1.1 1F2.1 1B2.1 1F3.1 1B3.1 1REDUCE.1 "
        "1OPT.1"]
    assert (schedule.microbatches, schedule.minibatches, schedule.params["rounds"]) == (4, 2, 2)


def test_a_model_copys_micro_batches_stay_its_own_in_every_round():
    """DualPipe's two copies each run half of a mini-batch's micro-batches (`Schedule.copy_of_microbatch`): in rounds,
    copy 1's micro-batches of every round are numbered in its half, so each still runs on the copy that holds it."""
    method = METHODS["dualpipe"]
    schedule = method.build(method.params(4, 16, 1, rounds=2))
    for order in schedule.orders:
        for action in order:
            if action.microbatch >= 0:
                assert schedule.copy_of_microbatch(action.microbatch) == (action.stage >= 4), action


def _step_ms(*flags) -> float:
    code, out, err = pipesim("simulate", "--json", "--opt", "0", *map(str, flags))
    assert code == 0, err
    return json.loads(out)["results"][0]["time_per_minibatch_ms"]


@pytest.mark.parametrize("method, shape", [("gpipe", ()), ("1f1b", ()), ("interleaved-1f1b", ("--chunks", 2)),
                                           ("zb-h1", ()), ("dualpipev", ())])
def test_a_step_in_rounds_takes_its_flushes_back_to_back(method, shape):
    """With no update to wait for, a mini-batch of m micro-batches in R rounds takes R flushes of m / R, each
    filling and draining the pipeline: 1F1B at p = 4, m = 8, forward 1 ms and backward 2: 2 x (4 + 3) x 3 = 42 ms
    where one flush of 8 takes (8 + 3) x 3 = 33."""
    common = ("-s", method, "-p", 4, "--fwd", 1, "--bwd", 2, *shape)
    assert _step_ms(*common, "-m", 16, "--rounds", 2) == pytest.approx(2 * _step_ms(*common, "-m", 8), rel=1e-12)
    if method == "1f1b":
        assert (_step_ms(*common, "-m", 8), _step_ms(*common, "-m", 8, "--rounds", 2)) == (33.0, 42.0)


def test_torchs_runtime_keeps_one_rounds_tensors_not_the_mini_batchs():
    """torch's pipelining (`--pp-runtime torch`) keeps what a step's forwards send and the model's outputs until the
    next `schedule.step`, allocates a step's receive buffers and concatenates its outputs as it ends: in rounds, a
    round's. m = 8 in two rounds holds the communication m = 4 in one does, where kept to the update it held twice
    that, and the caching allocator's replay, which merges the outputs each step, reserves alike (it had merged a
    mini-batch's: device 3 of this gpt at p = 4 read 4,164 MiB in two rounds of 8 against 3,664 in one)."""
    def devices(*flags) -> list[dict]:
        code, out, err = pipesim("simulate", "--json", "--gpu", "h100-sxm", "--model", "gpt", "--layers", "8",
                                 "--width", "1024", "--heads", "8", "--seq-len", "1024", "--vocab", "32000",
                                 "-s", "zb-h1", "-p", "4", "--pp-runtime", "torch", *flags)
        assert code == 0, err
        return json.loads(out)["results"][0]["devices"]

    in_rounds, one_round, whole = devices("-m", "16", "--rounds", "2"), devices("-m", "8"), devices("-m", "16")
    for device in range(4):
        parts = [held[device]["peak_memory_parts_mb"]["communication"] for held in (in_rounds, one_round, whole)]
        assert parts[0] == parts[1] > 0 and parts[2] > 1.9 * parts[1]
        assert in_rounds[device]["peak_memory_mb"] == one_round[device]["peak_memory_mb"]


@pytest.mark.parametrize("flags, refusal", [
    (("-s", "xpipe", "-m", "8", "--rounds", "2"), "--rounds: xpipe never flushes"),
    (("-s", "auto", "-m", "8", "--rounds", "2"), "--rounds: auto searches its order for one flush, not several"),
    (("-s", "1f1b", "-m", "8", "--rounds", "3"), "--rounds: each of the 3 rounds runs an equal share of the m "
                                                 "micro-batches: give a divisor of m = 8 (got 3)"),
    (("-s", "dualpipe", "--chunks", "2", "-m", "8", "--rounds", "2"),
     "--rounds 2: each round runs m / rounds = 4 micro-batches, and dualpipe needs an even number of devices and an "
     "even number of micro-batches, at least 2p"),
    (("-s", "1f1b", "-m", "8", "--rounds", "0"), "--rounds"),
])
def test_rounds_a_method_cannot_run_are_one_line(flags, refusal):
    code, out, err = pipesim("simulate", "-p", "4", *flags)
    assert code == 2 and refusal in err and "Traceback" not in err, err
    assert err.strip().count("\n") == 0 or "skipped:" in err


def test_the_params_refuse_rounds_that_do_not_divide_m():
    with pytest.raises(ScheduleError, match="give a divisor of m = 6"):
        ScheduleParams(2, 6, rounds=4)


@pytest.mark.slow
def test_a_run_in_rounds_trains_as_the_same_mini_batch_in_one(tmp_path):
    """The executor runs the rounds' order as it is: each mini-batch's gradients summed over its micro-batches of
    every round before its one update, so two gloo ranks train to the same losses, bit for bit, in two rounds of 2
    as in one flush of 4, and the trace says the rounds."""
    def losses(*flags) -> list:
        code, out, err = pipesim("run", "-s", "1f1b", "--model", "mlp", "-p", "2", "-m", "4", "-n", "2", "--json",
                                 "--no-heldout", *flags)
        assert code == 0, err
        return json.loads(out)["losses"]

    trace = tmp_path / "rounds.json"
    assert losses("--rounds", "2", "--trace", str(trace)) == losses()
    assert json.loads(trace.read_text())["pipesim"]["meta"]["params"]["rounds"] == 2


def test_a_schedule_file_refuses_rounds_it_would_ignore():
    """A torch CSV fixes its step's order, so --rounds would change nothing: refused, as --microbatches is."""
    code, out, err = pipesim("simulate", "--schedule-file", "examples/order.csv", "--rounds", "2")
    assert code == 2 and err.startswith("error: --rounds: the schedule file fixes stages, chunks"), err


def test_compare_names_rounds_that_differ_and_reads_an_older_trace_as_one_flush(tmp_path):
    """A prediction in one flush held against a trace run in two says so with the flag to give; a trace written
    before --rounds (no such param) is one flush, not passed over. --json says each result's rounds."""
    shape = ("-s", "1f1b", "-p", "2", "-m", "4", "-n", "3")
    rounds, one = tmp_path / "rounds.json", tmp_path / "one.json"
    code, out, err = pipesim("simulate", *shape, "--rounds", "2", "--trace", str(rounds), "--json")
    assert code == 0 and json.loads(out)["results"][0]["rounds"] == 2, err
    assert pipesim("simulate", *shape, "--trace", str(one)).code == 0
    older = json.loads(rounds.read_text())
    older["pipesim"]["meta"]["params"].pop("rounds")
    (tmp_path / "older.json").write_text(json.dumps(older))
    ran = "in MEASURED (a prediction)"  # both simulated
    for measured, predicted, said in ((rounds, one, f"rounds 2 {ran}, 1 predicted: predict with --rounds 2"),
                                      (tmp_path / "older.json", rounds, f"rounds 1 {ran}, 2 predicted")):
        code, out, err = pipesim("compare", str(measured), str(predicted))
        assert code == 2 and said in err, err


def test_a_torch_profile_is_not_held_against_a_prediction_in_rounds(tmp_path):
    """A profiler trace is read one schedule.step a mini-batch, so a prediction in rounds is refused, naming why,
    rather than told to predict -m of a step with the rounds' updates left out."""
    predicted = tmp_path / "p.json"
    assert pipesim("simulate", "-s", "1f1b", "-p", "2", "-m", "24", "--rounds", "3", "-n", "1",
                   "--trace", str(predicted)).code == 0
    code, out, err = pipesim("compare", "traces/measured/torch-1f1b-2cpu", str(predicted))
    assert code == 2 and "runs each mini-batch in 3 rounds (--rounds)" in err, err
