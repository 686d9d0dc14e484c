"""The command line as users and scripts call it."""

import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from pipesim.files import grouped
from pipesim.schedules import METHODS
from pipesim.traces.metrics import mib_text
from tests.conftest import help_records, pipesim, pipesim_fresh, simulate_json
from tests.helpers import GPT_CPU
from tests.helpers import page_data as _page_data

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def test_issue_example_json():
    code, out, _ = pipesim("simulate", "--schedule", "gpipe", "--stages", "4", "--microbatches", "8",
                           "--minibatches", "1", "--fwd", "1", "--bwd", "2", "--json")
    assert code == 0
    (result,) = json.loads(out)["results"]
    assert result["makespan_ms"] == 33  # (m + p - 1)(F + B)
    assert result["bubble_fraction"] == pytest.approx(3 / 11)
    assert result["minibatches"] == 1 and result["steady_state"] is False
    device = result["devices"][0]
    assert {"device", "busy_ms", "peak_memory_mb", "peak_activations", "peak_weight_versions"} <= set(device)
    stage = result["stages"][0]
    assert {"stage", "forward_staleness", "backward_staleness", "prediction_distance",
            "backward_prediction_distance"} <= set(stage)


def test_several_schedules_table_and_outputs(tmp_path):
    code, out, _ = pipesim("simulate", "-s", "1f1b", "-s", "pipedream", "-p", "3", "-m", "6", "-n", "4",
                           "--fwd", "1,1.5,1", "--comm", "0.1", "--trace", str(tmp_path / "t.json"),
                           "--html", str(tmp_path / "t.html"))
    assert code == 0
    assert "1f1b" in out and "pipedream" in out
    assert (tmp_path / "t-1f1b.json").exists() and (tmp_path / "t-pipedream.json").exists()
    assert (tmp_path / "t.html").stat().st_size > 1_000_000  # plotly.js is embedded: works offline


def test_no_arguments_runs_the_built_in_example(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    code, out, _ = pipesim("simulate")
    assert code == 0
    for name in METHODS:  # the seeds' methods and their rivals in one table
        assert f"\n {name} " in out
    assert (tmp_path / "pipesim-example.html").exists() and out.endswith("wrote pipesim-example.html\n"), out


def test_the_built_in_example_says_it_replaced_the_page_of_its_last_run(tmp_path, monkeypatch):
    """The example writes a page under a name of its own, as view and study do; they said when they replaced a
    file there, and the example replaced it without a word."""
    monkeypatch.chdir(tmp_path)
    assert pipesim("simulate")[0] == 0
    code, out, _ = pipesim("simulate")
    assert code == 0 and out.endswith("wrote pipesim-example.html (replaced the file that was there)\n"), out


def test_the_built_in_examples_next_command_is_one_line_at_80_columns_and_runs(tmp_path, monkeypatch):
    """"Try: pipesim simulate --schedule 1f1b ... --stages 8 --microbatches 32 --html t.html" ran on after a
    sentence and broke at 80 columns: the line a user copied ran without --stages and --microbatches."""
    from pipesim.commands import common

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(common.stdout, "width", 80)
    code, out, _ = pipesim("simulate")
    (line,) = [line for line in out.splitlines() if line.startswith("Try: ")]
    command = line.removeprefix("Try: ").split()
    assert code == 0 and command[:2] == ["pipesim", "simulate"] and "-m" in command and command[-2] == "--html"
    code, out, err = pipesim(*command[1:])
    assert code == 0 and "xpipe" in out and (tmp_path / command[-1]).exists(), err


def test_by_default_every_method_compared_reaches_its_steady_state():
    """The issue's comparison: one mini-batch showed PipeDream and XPipe as 1F1B (same step, no staleness)."""
    default = simulate_json("-s", "pipedream", "-s", "xpipe", "-s", "1f1b", "-p", "8", "-m", "4")
    assert {r["minibatches"] for r in default} == {6} and all(r["steady_state"] for r in default)
    longer = simulate_json("-s", "pipedream", "-s", "xpipe", "-s", "1f1b", "-p", "8", "-m", "4", "-n", "12")
    for short, long in zip(default, longer):  # more mini-batches change neither the step nor the staleness
        assert short["time_per_minibatch_ms"] == pytest.approx(long["time_per_minibatch_ms"], rel=1e-3)
        assert short["stages"] == long["stages"]
    pipedream, xpipe, one_f_one_b = default
    assert pipedream["time_per_minibatch_ms"] < one_f_one_b["time_per_minibatch_ms"]  # no flush, no bubble per step
    assert [s["forward_staleness"] for s in pipedream["stages"]] == [-(-(7 - k) // 4) for k in range(8)]  # ⌈(p-1-k)/m⌉
    (alone,) = simulate_json("-s", "1f1b")  # a flushing schedule repeats its step from the second mini-batch on
    assert alone["minibatches"] == 2 and alone["time_per_minibatch_ms"] == 33


def test_the_tables_counts_of_activations_and_copies_are_grouped_in_thousands():
    """Peak act and copies printed "2000" and "1001 in every row", and the row's label "avgpipe (P=1000)", beside
    "1,160,248" MiB (avgpipe of 1,000 pipelines): every other count in pipesim's tables is grouped in thousands."""
    code, out, _ = pipesim("simulate", "-s", "avgpipe", "--pipelines", 1000, "-p", 2, "-m", 2, "-n", 1, "--fwd",
                           0.001, "--bwd", 0.001)
    assert code == 0
    assert re.search(r"^ avgpipe \(P=1,000\) .* 2,000 +4\.002 *$", out, re.M), out
    assert "copies: versions of one stage's weights held, 1,001 in every row" in " ".join(out.split())


def test_a_run_short_of_the_steady_state_says_so():
    code, out, _ = pipesim("simulate", "-s", "pipedream", "-s", "1f1b", "-n", "1")
    assert code == 0
    assert re.search(r"^ pipedream +33\.000\* +242\.4\* ", out, re.M)
    assert "one mini-batch (N=1) is all warm-up" in " ".join(out.split())
    assert "stale: 0* in every row" in " ".join(out.split())  # the two agree: said once, under the table
    code, out, _ = pipesim("simulate", "-s", "pipedream", "-s", "1f1b", "-p", "8", "-m", "4", "-n", "3")
    assert code == 0
    assert re.search(r"^ 1f1b +33\.000 ", out, re.M)  # it flushes: three mini-batches are steady
    assert "pipedream needs N>=6" in " ".join(out.split())
    code, out, _ = pipesim("simulate", "-s", "pipedream", "-s", "1f1b")
    assert code == 0 and "*" not in out


def test_schedules_lists_methods():
    code, out, _ = pipesim("schedules")
    assert code == 0
    assert "gpipe" in out and "pipedream" in out and "1f1b" in out


@pytest.mark.parametrize("args,fragment", [
    (["--schedule", "nope"], "unknown 'nope'"),
    (["--stages", "0"], "--stages"),
    (["--microbatches", "0"], "--microbatches"),
    (["--stages", "four"], "--stages"),
    (["--fwd", "1,2,3"], "--fwd: 3 values given"),
    (["--bwd", "fast"], "--bwd: give a number or comma-separated numbers (got 'fast')"),
    (["--fwd", "-1"], "--fwd: give a finite number from 0 to 1,000,000,000 (got -1)"),
    (["--comm", "nan"], "--comm: give a finite number from 0 to 1,000,000,000 (got nan)"),
    (["--fwd", "0", "--bwd", "0,0,0,0"], "--fwd, --bwd: every forward and backward takes 0 ms"),  # read 0.0 samples/s
    (["--param-mb", "1,2"], "--param-mb"),
    (["--optimizer", "lion"], "--optimizer: choose from"),
    (["--wgrad-fraction", "2"], "--wgrad-fraction"),
    (["--cluster", "/no/such/cluster.json"], "--cluster: cannot read cluster file"),
    (["-s", "1f1b", "--jitter", "0.1", "--seed", "-3"], "--seed"),  # numpy's traceback: a seed is not negative
    (["-s", "1f1b", "--seed", str(2**32)], "--seed: give a whole number from 0 to 4,294,967,295 (got 4,294,967,296)"),
    (["--html", "/no/such/dir/x.html"], "--html: cannot write"),
    (["--trace", "/no/such/dir/x.json"], "--trace: cannot write"),
    (["--frobnicate"], "`pipesim simulate` has no option --frobnicate; see `pipesim simulate --help`"),
    (["-s", "interleaved-1f1b", "-m", "6"], "multiple of stages"),
    (["-s", "1f1b", "--advance", "2"], "--advance applies to avgpipe only"),
    (["-s", "1f1b", "--microbatch-group", "4"], "--microbatch-group applies to interleaved-1f1b only, not 1f1b"),
    (["-s", "interleaved-1f1b", "-m", "10", "--microbatch-group", "4"], "--microbatch-group: its last group would "
                                                                         "hold m mod G = 2 micro-batches, fewer than "
                                                                         "p = 4"),
    (["-s", "avgpipe", "--elastic-alpha", "0"], "--elastic-alpha"),
    (["-s", "graphpipe", "--graph", "/no/such/graph.json"], "--graph: cannot read graph file /no/such/graph.json"),
    (["-s", "graphpipe", "--graph", EXAMPLES / "dag.json", "-p", "3"],  # graphpipe ran at p = 6 with no word
     "--stages: give 6, the --graph file's stages (graphpipe's p), or leave it out (got 3)"),
    (["-s", "pipedream-2bw", "-p", "8", "-m", "4"], "m >= p-1"),
    (["-s", "1f1b", "-p", "64", "-m", "100000"], "lower m (--microbatches)"),
    # the picosecond clock: a run whose times overflow it showed a traceback, a link's time past it a wrong answer
    (["-s", "1f1b", "--fwd", "1e8", "-m", "100"], "error: the run's times add up to 8e+10 ms, more than the "
                                                  "simulator's picosecond clock holds (4.61e+09 ms, about 53 days)"),
    (["-s", "1f1b", "--comm", "1e10"], "error: --comm: give a finite number from 0 to 1,000,000,000 (got 1e10)"),
    (["-s", "1f1b", "--comm", "1e9"], "error: the run's times add up to 9.6e+10 ms, more than the simulator's"),
    # sizes: one past MAX_BYTES overflowed numpy's int64 (a traceback), many micro-batches' the counter (wrong peaks)
    (["-s", "1f1b", "--param-mb", "1e30", "--optimizer", "sgd"],
     "error: --param-mb: give a finite number from 0 to 1,073,741,824 (got 1e30)"),
    # adam's state, twice the weights, past MAX_BYTES: refused as "optimizer_state_bytes must be ...", no flag named
    (["-s", "1f1b", "--param-mb", "600000000"], "error: --param-mb: give a finite number from 0 to 536,870,912 "
                                                "(got 600,000,000): MiB of weights, whose gradients and adam "
                                                "state under --precision fp32 take up to 2 times their bytes"),
    (["-s", "gpipe", "--activation-mb", "1e9", "-m", "10000", "-n", "1"],
     "error: device 0's rows add and free more bytes than the simulator's counters hold (4.61e+18)"),
    # each float flag names itself and its range: nan read "should be >= 0", inf and 1e30 a cost unnamed
    # ("opt_ms must be a finite number ..."), --jitter inf the simulator's clock summing to nan ms
    *(([flag, value, "-s", "avgpipe"], f"error: {flag}: give a finite number from 0 to "
                                       f"1,000,000,000 (got {got})")
      for flag in ("--opt", "--pred", "--avg") for value, got in (("nan", "nan"), ("inf", "inf"), ("1e30", "1e30"))),
    (["-s", "1f1b", "--jitter", "inf"], "error: --jitter: give a finite number from 0 to 3 "
                                        "(got inf)"),
    (["-s", "zb-h1", "--wgrad-fraction", "nan"], "error: --wgrad-fraction: give a finite "
                                                 "number from 0 to 1 (got nan)"),
    (["-s", "dualpipev", "--fb-hidden-fraction", "nan"], "error: --fb-hidden-fraction: give a "
                                                         "finite number from 0 to 1 (got nan)"),
    (["-s", "auto", "--memory-gb", "0"], "error: --memory-gb: give GiB per device, from 1 byte to 1,048,576 GiB"),
    # a collective past an op's longest: it named StageCosts' field ("reduce_ms must be a finite number ...")
    (["-s", "1f1b", "--data-parallel", "1000", "--network-gb-s", "0.001", "--param-mb", "1000000"],
     "error: stage 0's data-parallel collectives over 1,000 ranks take 2.1e+09 ms on their link, more than the 1e+09 "
     "ms an op may take: give fewer ranks (--data-parallel), smaller weights (--param-mb) or a faster network "
     "(--network-gb-s)"),
    # it seeds --jitter alone: taken without one, it changed nothing
    (["-s", "1f1b", "--seed", "5"], "error: --seed seeds --jitter's draws, and no --jitter was given: give --jitter "
                                    "SIGMA, or leave --seed out"),
    # it prices the W a split backward runs apart: taken for orders that run none, it changed nothing
    (["-s", "gpipe", "-s", "1f1b", "--wgrad-fraction", "0.3"],
     "error: --wgrad-fraction prices the weight gradient a split backward runs apart (W), and none of gpipe, 1f1b "
     "splits it (zb-h1, zb-h2, zb-v, dualpipev, dualpipe, auto do): leave it out"),
    # they price PRED and AVG rows alone: taken for orders that run none, they changed nothing
    (["-s", "1f1b", "--pred", "3", "--avg", "3"],
     "error: --pred prices the weight prediction (PRED), and none of 1f1b predicts weights (spectrain, pipeoptim, "
     "xpipe do): leave it out"),
    (["-s", "1f1b", "-s", "xpipe", "--avg", "3"],
     "error: --avg prices the elastic averaging of pipelines (AVG), and none of 1f1b, xpipe averages pipelines "
     "(avgpipe does): leave it out"),
    # a factor taking a stage's time past the simulator's: it named StageCosts' field ("fwd_ms must be ...")
    (["-s", "1f1b", "--cost-scale", "1e10"],
     "error: --cost-scale 1e+10 makes stage 0's bwd_ms 2e+10, more than the simulator takes (at most 1e+09 ms): "
     "give a smaller factor"),
    # a cap past the profiled device's memory: what fits it would not fit the device
    (["-s", "1f1b", "--profile", "traces/profiles/gpt-cpu.json", "--memory-gb", "24"],
     "error: --memory-gb 24: more than the profiled device's 23.5 GiB, so a layout that fits the cap would run out "
     "of memory there: give at most 23.54"),
    # the catalogue's 79.11 GiB, read back from its bytes as 79.1099..., was "give at most 79.1" (79.11 runs)
    (["-s", "1f1b", "--gpu", "h100-sxm", "--model", "gpt", "--layers", "2", "-p", "2", "--memory-gb", "79.12"],
     "error: --memory-gb 79.12: more than h100-sxm's 79.11 GiB (`pipesim gpus`), so a layout that fits the cap would "
     "run out of memory there: give at most 79.11"),
    # a cluster file's devices give their memory too: a cap past it was taken
    (["-s", "1f1b", "-p", "4", "--cluster", "examples/cluster.json", "--memory-gb", "1000"],
     "error: --memory-gb 1000: more than the 80 GiB of --cluster examples/cluster.json's gpu0, so a layout that fits "
     "the cap would run out of memory there: give at most 80"),
])
def test_bad_input_is_one_line_and_exit_2(args, fragment):
    code, out, err = pipesim("simulate", *args)
    assert code == 2
    assert fragment in err
    assert "Traceback" not in err and err.strip().count("\n") == 0


def test_memory_gb_is_held_to_the_cluster_devices_a_run_uses(tmp_path):
    """A 2-device run on a cluster file whose third and fourth devices hold less was refused for a device it never
    runs on."""
    devices = [{"name": f"gpu{k}", "memory_gib": gib} for k, gib in enumerate((80, 80, 40, 40))]
    (cluster := tmp_path / "c.json").write_text(json.dumps({"devices": devices}))
    assert pipesim("simulate", "-s", "1f1b", "-p", 2, "--cluster", cluster, "--memory-gb", 60).code == 0
    code, _, err = pipesim("simulate", "-s", "1f1b", "-p", 4, "--cluster", cluster, "--memory-gb", 60)
    assert code == 2 and f"more than the 40 GiB of --cluster {cluster}'s gpu2" in err, err


def test_a_collective_past_an_ops_longest_names_the_fix_a_profile_takes(tmp_path):
    """A profile's measured all-reduce prices its collectives: the line named --param-mb and --network-gb-s, which
    a profile refuses in turn."""
    profile = json.loads(Path(GPT_CPU).read_text())
    for point in profile["allreduce"]["points"]:
        point["ms"] *= 1e9
    slow = tmp_path / "slow.json"
    slow.write_text(json.dumps(profile))
    code, _, err = pipesim("simulate", "-s", "1f1b", "--profile", slow, "--data-parallel", 2)
    assert code == 2 and err.rstrip().endswith("give fewer ranks (--data-parallel) or a profile calibrated on a "
                                               "faster link"), err


@pytest.mark.parametrize("args, line", [
    (["-s", "gpipe", "--chunks", "2"], "--chunks: give 1, as gpipe places one model stage per device (got 2)"),
    (["-s", "avgpipe", "--chunks", "2"], "--chunks: give 1, as avgpipe places one model stage per device (got 2)"),
    (["-s", "1f1b", "--pipelines", "2"], "--pipelines: give 1, as 1f1b runs a single pipeline (got 2)"),
    (["-s", "zb-v", "--chunks", "3"], "--chunks: give 2, as zb-v folds the model into a V of two chunks per device "
                                      "(device i holds stages i and 2p-1-i) (got 3)"),
    (["-s", "graphpipe", "--pipelines", "2"], "--pipelines: give 1, as graphpipe places one stage per device in one "
                                              "pipeline (got 2)"),
])
def test_a_methods_shape_is_refused_naming_the_flag_in_the_one_wording(args, line):
    """A method's v or P read "zb-v ...: chunks must be 2 (got 3)", naming no flag (graphpipe's not the value):
    now "FLAG: give WHAT IS ALLOWED, as WHY (got VALUE)"."""
    code, out, err = pipesim("simulate", *args)
    assert (code, out, err) == (2, "", f"error: {line}\n")


@pytest.mark.parametrize("args, line", [
    (["sweep", "-j", "0"], "-j (--workers): give a whole number of at least 1 (got 0)"),  # said "--workers" alone
    (["sweep", "--workers=0"], "--workers: give a whole number of at least 1 (got 0)"),
    (["simulate", "-p0"], "-p (--stages): give a whole number of at least 1 (got 0)"),
    (["simulate", "-p", "1.5"], "-p (--stages): give a whole number of at least 1 (got 1.5)"),
    (["simulate", "-m", "abc"], "-m (--microbatches): give a whole number of at least 1 (got 'abc')"),
    (["study", "--seeds", "5000"], "--seeds: give a whole number from 1 to 1,000 (got 5,000)"),  # "to 1000"
    # a billion replicas ran, at 5.7 billion samples/s: tune's bound on its devices, ten times the largest clusters
    (["simulate", "--data-parallel", "1000000001"], "--data-parallel: give a whole number from 1 to 1,000,000 (got "
                                                    "1,000,000,001)"),
    (["simulate", "--seed", "-1"], "--seed: give a whole number from 0 to 4,294,967,295 (got -1)"),
    (["simulate", "--opt", "x"], "--opt: give a number (got 'x')"),
])
def test_a_value_the_option_parser_refuses_names_the_flag_typed_the_value_and_what_is_allowed(args, line):
    """click's refusals ("--workers: Input should be greater than or equal to 1") named the long flag where `-j`
    was typed, never the value given, and grouped a bound of five digits or more alone ("1000")."""
    code, out, err = pipesim(*args)
    assert (code, out, err) == (2, "", f"error: {line}\n")


@pytest.mark.parametrize("args, line", [
    (["simulate", "--memory", "0"], "--memory is a flag and takes no value (got '0'): give --memory alone"),
    (["gpus", "h100"], "`pipesim gpus` takes no arguments, only options (got 'h100'); see `pipesim gpus --help`"),
    (["compare", "a.json", "b.json", "c.json"], "`pipesim compare` takes MEASURED [PREDICTED] (got 'c.json' too); "
                                                "see `pipesim compare --help`"),
])
def test_a_word_the_command_has_no_place_for_is_named_with_what_it_takes(args, line):
    """click said "Got unexpected extra argument(s) (0)" for `--memory 0`, where --memory is a flag, and for a GPU
    named to `pipesim gpus`, which lists them all."""
    code, out, err = pipesim(*args)
    assert (code, out, err) == (2, "", f"error: {line}\n")


@pytest.mark.parametrize("args", [["-h"], ["simulate", "-h"], ["gpus", "-h"]])
def test_h_is_help_as_help_is(args):
    """`pipesim simulate -h` said "No such option: -h", exit 2: -h is what many command lines take for help."""
    code, out, err = pipesim(*args)
    assert (code, err) == (0, "") and out == pipesim(*args[:-1], "--help").out


@pytest.mark.parametrize("args", [["help"], ["help", "simulate"]])
def test_help_as_a_command_is_the_help_of_what_follows_it(args):
    """`pipesim help` said "No such command 'help'", exit 2: git's and pip's users type it."""
    code, out, err = pipesim(*args)
    assert (code, err) == (0, "") and out == pipesim(*args[1:], "--help").out


def test_a_messages_whole_numbers_of_four_digits_and_more_are_grouped_and_a_paths_are_not():
    """pydantic's "less than or equal to 1000" was left as it came, where pipesim's own refusals say "1,000"."""
    assert grouped("at most 1000 or 1000000 (run_12345/tmp2024.json, 86400.5 s)") == \
        "at most 1,000 or 1,000,000 (run_12345/tmp2024.json, 86400.5 s)"


@pytest.mark.parametrize("flag, value", [("--host-kernel-us", "nan"), ("--host-kernel-us", "1e30"),
                                         ("--host-kernel-us", "1e15"), ("--host-module-us", "inf")])
def test_a_host_time_past_its_range_is_refused_at_its_flag_and_nothing_is_written(tmp_path, flag, value):
    """1e30 read "fwd_ms must be a finite number from 0 to 1e+09", naming no flag; at 1e15 estimate wrote a profile
    simulate then refused; nan read "should be >= 0"."""
    out = tmp_path / "profile.json"
    code, stdout, err = pipesim("estimate", "--gpu", "h100-sxm", "--model", "gpt", "--experts", 4, flag, value,
                                "--out", out)
    assert code == 2 and stdout == "" and not out.exists(), err
    what = "to issue a kernel" if flag == "--host-kernel-us" else "a module call adds"
    assert err.startswith(f"error: {flag}: the host's microseconds {what}, a finite number from 0 to 10,000 (got "), err
    assert len(err.strip().splitlines()) == 1, err


@pytest.mark.parametrize("command, args, fragment", [
    ("sweep", ["--opt", "1e30"], "error: --opt: give a finite number from 0 to 1,000,000,000"),
    ("run", ["-s", "1f1b", "-p", "2", "-m", "2", "--model", "gpt", "--timeout", "1e30"],
     "error: --timeout: give a finite number above 0 and at most 86,400 (got 1e30)"),
])
def test_other_commands_name_a_float_flag_past_its_range(command, args, fragment):
    """run's --timeout 1e30 was a rank's OverflowError in torch's wait."""
    code, out, err = pipesim(command, *args)
    assert code == 2 and out == "" and err.startswith(fragment) and len(err.strip().splitlines()) == 1, err


def test_zero_cost_flags_beside_a_profile_are_refused_as_flags_the_profile_fixes():
    """--fwd 0 --bwd 0 with --profile: the profile gives the costs, so the flags are what is wrong, not a step of
    no compute ('every forward and backward takes 0 ms' would send the user after values the profile ignores)."""
    profile = GPT_CPU
    code, _, err = pipesim("simulate", "--profile", profile, "-s", "1f1b", "-m", "2", "--fwd", "0", "--bwd", "0")
    assert code == 2 and err.startswith(f"error: --fwd, --bwd: the profile {profile} gives the costs"), err


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs Linux's /dev/full")
@pytest.mark.parametrize("args, flag", [
    (["simulate", "-s", "1f1b", "-p", "2", "-m", "4", "--trace", "/dev/full"], "--trace"),
    (["simulate", "-s", "1f1b", "-p", "2", "-m", "4", "--html", "/dev/full"], "--html"),
    (["sweep", "-s", "1f1b", "-p", "2", "-m", "4", "--html", "/dev/full"], "--html"),
])
def test_an_output_that_fails_once_written_names_its_flag(args, flag):
    """A full disk is known only when the output is written, after the checks: the line still names the flag
    whose file it was, as the checks' refusals do."""
    code, _, err = pipesim(*args)
    assert code == 2 and err == f"error: {flag}: cannot write /dev/full: No space left on device\n", err


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs Linux's /dev/full")
@pytest.mark.parametrize("command", [["view", "TRACE"], ["compare", "TRACE", "TRACE"]])
def test_a_page_of_read_traces_that_fails_once_written_names_its_flag(tmp_path, command):
    """view and compare write their --html after reading the traces: a full disk is the same one line, exit 2, not
    a traceback."""
    trace = tmp_path / "t.json"
    assert pipesim("simulate", "-s", "1f1b", "-p", "2", "-m", "4", "--trace", trace)[0] == 0
    code, _, err = pipesim(*(trace if word == "TRACE" else word for word in command), "--html", "/dev/full")
    assert code == 2 and err.endswith("error: --html: cannot write /dev/full: No space left on device\n"), err


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs Linux's /dev/full")
def test_a_run_whose_trace_cannot_be_written_still_shows_what_it_measured(tmp_path):
    """`run --trace /dev/full` trained, then said only that the trace could not be written: the run's results (its
    step, losses and memory) were lost with it. They are shown, the page that could be written is written, and the
    write's failure is said after them, exit 2."""
    page = tmp_path / "r.html"
    code, out, err = pipesim("run", "-s", "1f1b", "--model", "mlp", "-p", "2", "-m", "2", "-n", "2", "--no-heldout",
                             "--trace", "/dev/full", "--html", page)
    assert code == 2 and err == "error: --trace: cannot write /dev/full: No space left on device\n", err
    assert "1f1b measured: 2 mini-batches" in out and "loss first -> last" in out, out
    assert f"wrote {page}" in out and page.exists() and "wrote /dev/full" not in out, out
    code, out, err = pipesim("run", "-s", "1f1b", "--model", "mlp", "-p", "2", "-m", "2", "-n", "2", "--no-heldout",
                             "--trace", "/dev/full", "--html", "/dev/full")  # each write that fails is said
    assert code == 2 and "loss first -> last" in out and err == "".join(
        f"error: {flag}: cannot write /dev/full: No space left on device\n" for flag in ("--trace", "--html")), err


def test_malformed_cluster_file(tmp_path):
    path = tmp_path / "c.json"
    path.write_text('{"devices": 2}')
    code, _, err = pipesim("simulate", "--cluster", str(path))
    assert code == 2 and "needs 4 devices, the cluster has 2" in err
    path.write_text("[1, 2")
    code, _, err = pipesim("simulate", "--cluster", str(path))
    assert code == 2 and "--cluster: cluster file" in err and "not valid JSON" in err
    path.write_bytes(b"\xab\xcd")  # a traceback (UnicodeDecodeError) before files.py's read_json read it
    code, _, err = pipesim("simulate", "--cluster", str(path))
    assert code == 2 and err == f"error: --cluster: cluster file {path} is not a text (UTF-8) file\n"
    for field, fragment in (({"overlap_comm": "yes"}, "overlap_comm: give true or false (got 'yes')"),  # read true
                            ({"devices": [{"name": "g", "memory_gib": 1e30}] * 4},  # a memory no counter holds
                             "devices.0.memory_gib: give GiB per device, from 1 byte to 1,048,576 GiB (got 1e30)"),
                            ({"devices": [{"name": "g", "memory_gib": 1e-300}] * 4},  # held as 0 bytes: nothing fits
                             "devices.0.memory_gib: give GiB per device, from 1 byte to 1,048,576 GiB (got 1e-300)"),
                            ({"link": {"latency_us": 1e15}},  # the engine's clock check, naming no field
                             "link.latency_us: Input should be less than or equal to 1,000,000,000,000 (got 1e+15)"),
                            ({"devices": 10**12},  # a MemoryError's traceback, listing them
                             "devices: give a whole number from 1 to 15,000,000 (the most any schedule pipesim "
                             "simulates runs on), or a list of devices (got 1,000,000,000,000)"),
                            # each read "X must be ..." or said no value: "sizes must increase and times must be ..."
                            ({"devices": 0}, "devices: give a whole number from 1 to 15,000,000 (the most any "
                                             "schedule pipesim simulates runs on), or a list of devices (got 0)"),
                            ({"devices": []}, "devices: give at least one device (got [])"),
                            ({"links": [{"src": 0, "dst": 5}]},
                             "links: give src and dst two distinct devices 0..3 (got 0->5)"),
                            ({"link": {"table": [[10, 1]]}},
                             "link.table: give at least two [bytes, ms] points (got 1)"),
                            ({"link": {"table": [[10, 1], [5, 2]]}},
                             "link.table: give [bytes, ms] points, their bytes increasing (got 5 bytes after 10)"),
                            ({"link": {"table": [[10, 1], [20, 2e9]]}},
                             "link.table: give [bytes, ms] points, each ms a finite number from 0 to 1,000,000,000 "
                             "(got 2,000,000,000 at 20 bytes)"),
                            # each of its field's type: true was read as 1 GiB or device 1, "80" as 80
                            ({"devices": [{"name": "g", "memory_gib": True}] * 4},
                             "devices.0.memory_gib: give a number (got true)"),
                            ({"devices": [{"name": "g", "memory_gib": "80"}] * 4},
                             "devices.0.memory_gib: give a number, without quotes (got '80')"),
                            ({"links": [{"src": True, "dst": 0}]}, "links.0.src: give a whole number (got true)"),
                            ({"link": {"table": [[10, 1], [20, "2"]]}},
                             "link.table.1.1: give a number, without quotes (got '2')"),
                            ({"contention": [1.5, 2.5]},
                             "contention: give slowdowns with 1, 2, ... devices computing at once, the first 1 and "
                             "each a finite number above 0 (got [1.5, 2.5])")):
        path.write_text(json.dumps({"devices": 4, **field}))
        code, _, err = pipesim("simulate", "--cluster", str(path))
        assert code == 2 and err == f"error: --cluster: cluster file {path}: {fragment}\n", err
    path.write_text(json.dumps({"devices": 4, "link": {"bandwidth_gb_per_s": 1e-15}}))  # no one bound: the sum's
    code, _, err = pipesim("simulate", "--cluster", str(path))
    assert code == 2 and "most of them the transfers between stages (--comm, or a --cluster file's latency_us, " \
                         "bandwidth_gb_per_s or table)" in err, err


def test_a_profile_past_what_the_simulator_takes_names_the_file_and_field(tmp_path):
    """A size past MAX_BYTES or a time past MAX_MS was refused by StageCosts in its own words ('param_bytes must
    be ...'), naming neither --profile nor the file; the layers' sums are bounded, since a stage may hold them all."""
    profile = json.loads(GPT_CPU.read_text())
    profile["layers"][0]["param_bytes"] = 2**51
    path = tmp_path / "p.json"
    path.write_text(json.dumps(profile))
    code, _, err = pipesim("simulate", "--profile", path, "-s", "1f1b")
    assert code == 2 and err == (f"error: --profile: profile {path}: layers' param_bytes add up to 2.25e+15, more "
                                 "than the simulator takes (at most 1.13e+15 bytes)\n"), err


def test_a_file_saved_with_a_byte_order_mark_reads_as_without(tmp_path):
    """Windows editors begin a UTF-8 file with one, which json refused: 'not valid JSON: Unexpected UTF-8 BOM'.
    Every JSON and TOML file pipesim reads goes through files.py's read_text."""
    plain, marked = tmp_path / "plain.json", tmp_path / "marked.json"
    plain.write_text((EXAMPLES / "cluster.json").read_text())
    marked.write_bytes(b"\xef\xbb\xbf" + plain.read_bytes())
    assert simulate_json("-s", "1f1b", "--cluster", marked) == simulate_json("-s", "1f1b", "--cluster", plain)


def test_nothing_half_written_when_one_output_is_bad(tmp_path):
    code, _, _ = pipesim("simulate", "-s", "1f1b", "--trace", str(tmp_path / "t.json"),
                         "--html", str(tmp_path / "missing" / "t.html"))
    assert code == 2
    assert os.listdir(tmp_path) == []


def test_console_script_starts_without_torch():
    (done,), imported = pipesim_fresh(("simulate", "-s", "1f1b", "--json"))
    assert done.code == 0 and not {"torch", "plotly"} & imported, done.err  # no heavy import at start-up


def test_method_defaults_and_avgpipe_options():
    zbv, avg, plain = simulate_json("-s", "zb-v", "-s", "avgpipe", "-s", "1f1b")
    assert len(zbv["stages"]) == 8  # two chunks per device by default
    assert [d["peak_weight_versions"] for d in avg["devices"]] == [3] * 4  # two pipelines' replicas, the reference
    (three,) = simulate_json("-s", "avgpipe", "--pipelines", "3", "--advance", "0")
    assert [d["peak_weight_versions"] for d in three["devices"]] == [4] * 4
    assert three["peak_memory_mb"] > avg["peak_memory_mb"]
    assert three["time_per_minibatch_ms"] > avg["time_per_minibatch_ms"]  # three pipelines share the devices


def test_graph_file(tmp_path):
    path = tmp_path / "g.json"
    path.write_text(json.dumps({"stages": 5, "edges": [[0, 1], [0, 2], [0, 3], [1, 4], [2, 4], [3, 4]]}))
    (result,) = simulate_json("-s", "graphpipe", "--graph", path, "--fwd", "1", "--bwd", "2", "-m", "8", "-n", "1")
    assert result["makespan_ms"] == pytest.approx((8 + 3 - 1) * 3)  # three branches side by side: depth 3
    path.write_text(json.dumps({"stages": 2, "edges": [[0, 1], [1, 0]]}))
    code, _, err = pipesim("simulate", "-s", "graphpipe", "--graph", str(path))
    assert code == 2 and "cycle" in err
    path.write_text(json.dumps({"stages": 10**12, "edges": [[0, 1]]}))  # a MemoryError's traceback
    code, _, err = pipesim("simulate", "-s", "graphpipe", "--graph", str(path))
    assert code == 2 and err == (f'error: --graph: graph file {path}: "stages": give a whole number from 1 to 4,096, '
                                 "the model stages pipesim simulates (got 1,000,000,000,000)\n")


@pytest.mark.parametrize("graph, said", [
    ({"stages": 2, "edges": [0, 1]}, '"edges": give a list of [from, to] stage pairs'),
    ({"stages": 2, "edges": [[0, 1]], "placement": [0]}, '"placement": give a device for each of the 2 stages'),
    ({"stages": 2, "edges": [[0, 5]]}, '"edges": give [from, to] pairs of distinct stages 0..1 (got [0, 5])'),
    ({"stages": 2, "edges": [[1, 1]]}, '"edges": give [from, to] pairs of distinct stages 0..1 (got [1, 1])'),
    # a second transfer of one tensor: a buffer more at the peak, 1,248 MiB for 1,232 at --comm 1
    ({"stages": 3, "edges": [[0, 1], [0, 1], [1, 2]]}, '"edges": give each [from, to] pair once (got [0, 1] twice)'),
    ({"stages": 2, "edges": [[0, 1]], "placement": [0, 0]}, '"placement": give each stage its own device 0..1 '
                                                            "(got [0, 0])"),
])
def test_a_graph_files_field_is_refused_as_any_files_field(tmp_path, graph, said):
    """A graph file's field read '"edges" must be ...' (an edge out of range "stage graph edge 0->5: both ends must be
    distinct stages in 0..1") where every other file's field reads "FIELD: give ..."."""
    path = tmp_path / "g.json"
    path.write_text(json.dumps(graph))
    code, _, err = pipesim("simulate", "-s", "graphpipe", "--graph", str(path))
    assert (code, err) == (2, f"error: --graph: graph file {path}: {said}\n")


@pytest.mark.parametrize("command", [("simulate", "-s", "graphpipe", "-p", "2"),
                                     ("run", "-s", "graphpipe", "--model", "mlp", "--stages", "2")])
def test_graphpipes_built_in_graph_at_too_few_stages_names_the_flag(command):
    code, out, err = pipesim(*command)
    assert (code, out) == (2, "") and err == ("error: --stages: graphpipe's built-in graph (a stem, two branches and a "
                                              "head) needs 4 or more (got 2); pipesim simulate --graph takes a stage "
                                              "graph of your own\n")


def devices_busy(result: dict) -> list[float]:
    return [d["busy_ms"] for d in result["devices"]]


def test_a_comparison_skips_the_methods_that_cannot_run():
    code, out, err = pipesim("simulate", "--stages", "8", "--json")
    assert code == 0
    document = json.loads(out)
    skipped = {entry["schedule"]: entry["reason"] for entry in document["skipped"]}
    assert set(skipped) == {"zb-h2", "dualpipev", "dualpipe"} and "2p-1 = 15 micro-batches" in skipped["zb-h2"]
    assert [r["schedule"] for r in document["results"]] == [n for n in METHODS if n not in skipped]
    assert "skipped: zb-h2 runs 2p-1 forwards" in err
    code, out, err = pipesim("simulate", "--microbatches", "2")  # the table: a row per skipped method
    assert code == 0
    assert re.search(r"^ interleaved-1f1b +skipped +$", out, re.M)
    assert "skipped: interleaved-1f1b with 2 chunks per device needs micro-batches to be a multiple" in err


def test_a_method_named_alone_that_cannot_run_is_an_error():
    code, out, err = pipesim("simulate", "-s", "zb-h2", "-p", "8")
    assert code == 2 and out == ""
    assert err.startswith("error: zb-h2 runs 2p-1 forwards") and err.count("\n") == 1
    code, _, err = pipesim("simulate", "-s", "zb-h2", "-s", "dualpipev", "-p", "8")
    assert code == 2 and err.startswith("error: none of the 2 methods can run: zb-h2 ") and "dualpipev needs" in err
    assert err.count("\n") == 1


def test_one_cost_is_a_devices_share_split_over_its_chunks():
    plain, zbv = simulate_json("-s", "1f1b", "-s", "zb-v", "--fwd", "1", "--bwd", "2", "-n", "1")
    assert devices_busy(zbv) == devices_busy(plain) == [24.0] * 4  # the same model: 8 x (1 + 2) ms per device
    assert zbv["time_per_minibatch_ms"] < plain["time_per_minibatch_ms"]  # zb-v's smaller bubble shows
    assert [d["peak_memory_mb"] for d in zbv["devices"]] < [d["peak_memory_mb"] + 64 for d in plain["devices"]]
    (split,) = simulate_json("-s", "zb-v", "--fwd", "1,1,1,2", "--bwd", "2", "-n", "1")  # p values: one per device
    assert devices_busy(split) == [24.0, 24.0, 24.0, 32.0]
    # p·v values: one per model stage; zb-v's V puts stages 0 and 7 on device 0
    (staged,) = simulate_json("-s", "zb-v", "--fwd", "0.5,0.5,0.5,0.5,0.5,0.5,0.5,1.5", "--bwd", "2", "-n", "1")
    assert devices_busy(staged) == [32.0, 24.0, 24.0, 24.0]


def test_the_table_says_what_the_costs_describe():
    code, out, _ = pipesim("simulate", "-s", "1f1b", "-s", "zb-v")
    assert code == 0 and "costs: per device, split over its chunks;" in " ".join(out.split())
    code, out, err = pipesim("simulate", "-s", "1f1b", "-s", "zb-v", "--fwd", ",".join(["1"] * 8))
    assert code == 0 and "--fwd per model stage (p·v values)" in " ".join(out.split())
    assert "skipped: 1f1b: --fwd: 8 values given; give one number, or one per device (4) for 1f1b" in err


@pytest.mark.parametrize("args,message", [
    (["-s", "zb-v", "--fwd", "1,2,3"], "--fwd: 3 values given; give one number, one per device (4) or one per model "
                                       "stage (8) for zb-v"),
    (["--bwd", "1,2,3"], "--bwd: 3 values given; give one number, or 4 (one per device) or 8 (one per model stage: "
                         "interleaved-1f1b, zb-v, dualpipev, dualpipe)"),
    (["-s", "1f1b", "-s", "zb-v", "--output-mb", "1,2,3"], "--output-mb: 3 values given; give one number, or 4 (one "
                                                           "per model stage: 1f1b) or 8 (one per model stage: zb-v)"),
])
def test_a_cost_list_that_fits_no_method_names_the_lengths(args, message):
    code, _, err = pipesim("simulate", *args)
    assert code == 2 and message in err and err.count("\n") == 1


def cluster_file(tmp_path, memory_gib):
    path = tmp_path / "c.json"
    path.write_text(json.dumps({"devices": [{"name": f"gpu{d}", "memory_gib": gib} for d, gib in enumerate(memory_gib)],
                                "link": {"latency_us": 10, "bandwidth_gb_per_s": 25}}))
    return path


def test_memory_is_checked_against_the_clusters_devices(tmp_path):
    small = cluster_file(tmp_path, [80, 0.5, 80, 80])
    code, out, err = pipesim("simulate", "-s", "1f1b", "--cluster", small, "--json")
    assert code == 0
    devices = json.loads(out)["results"][0]["devices"]
    assert [d["memory_limit_mb"] for d in devices] == [80 * 1024, 512, 80 * 1024, 80 * 1024]
    assert [d["out_of_memory"] for d in devices] == [False, True, False, False]
    assert f"warning: 1f1b runs out of memory: device 1 peaks at {mib_text(devices[1]['peak_memory_mb'])} MiB, more " \
           "than its 512 MiB" in err
    code, out, _ = pipesim("simulate", "-s", "1f1b", "--cluster", small)
    assert code == 0 and "OOM on device 1" in out
    code, out, err = pipesim("simulate", "-s", "1f1b", "--cluster", cluster_file(tmp_path, [80] * 4))
    assert code == 0 and "fits" in out and "OOM" not in out and "warning" not in err
    (unknown,) = simulate_json("-s", "1f1b")  # no cluster: nothing to check against
    assert {(d["memory_limit_mb"], d["out_of_memory"]) for d in unknown["devices"]} == {(None, False)}


def test_the_memory_column_writes_runs_of_devices_out_of_memory_as_ranges(tmp_path):
    """The column lists three entries: devices 1 to 5 and 7 out of memory read "OOM on devices 1, 2, 3, …", hiding
    how many and which (DeepSeek-V3's ZB-V in the README, out of memory on devices 10 to 15: "10, 11, 12, …")."""
    code, out, err = pipesim("simulate", "-s", "1f1b", "-p", 8, "--cluster",
                             cluster_file(tmp_path, [80, 0.5, 0.5, 0.5, 0.5, 0.5, 80, 0.5]))
    assert code == 0 and "OOM on devices 1-5, 7" in out, out


def test_simulates_memory_column_says_oom_or_fits_and_the_caption_names_the_devices(tmp_path):
    """Where some rows fit and others do not, the column says which ("OOM" or "fits", as sweep's) and the caption
    on which devices: the cell "OOM on devices 10-15" took 20 of 80 columns in the README's DeepSeek-V3 what-if."""
    code, out, err = pipesim("simulate", "-s", "gpipe", "-s", "1f1b", "--cluster", cluster_file(tmp_path, [1.4] * 4))
    rows = {cells[0]: cells[-1] for cells in map(str.split, out.splitlines()) if cells[:1] in (["gpipe"], ["1f1b"])}
    assert code == 0 and rows == {"gpipe": "OOM", "1f1b": "fits"}, out
    assert "memory: gpipe OOM on devices 0-3, the others fit" in " ".join(out.split()), out


def test_the_page_says_which_methods_run_out_of_memory(tmp_path):
    """Its bars and memory curves show no device's memory: the warning is a note under the title."""
    page, small = tmp_path / "t.html", cluster_file(tmp_path, [80, 0.5, 80, 80])
    code, _, err = pipesim("simulate", "-s", "1f1b", "-s", "gpipe", "--cluster", small, "--html", page)
    warnings = [line.removeprefix("warning: ") for line in err.splitlines()]
    assert code == 0 and len(warnings) == 2 and _page_data(page.read_text())["notes"] == warnings
    assert warnings[0].startswith("1f1b runs out of memory: device 1 peaks at")


def test_the_pages_chart_marks_a_step_that_is_no_steady_state_as_the_table_does(tmp_path):
    """PipeDream at N = 3 is short of its steady state: the table printed 24.000* and 333.3*, the page's bars 24.000
    and 333.3, with nothing to say why."""
    page = tmp_path / "t.html"
    code, out, _ = pipesim("simulate", "-s", "1f1b", "-s", "pipedream", "-p", 4, "-m", 8, "-n", 3, "--html", page)
    data = _page_data(page.read_text())
    texts = {bar["name"]: bar["text"] for bar in data["summary"]["data"]}
    assert code == 0 and "pipedream 24.000* 333.3*" in " ".join(out.split())
    assert texts["samples/s (more is better)"] == ["242.4", "333.3*"]
    assert texts["time per mini-batch (ms)"] == ["33.000", "24.000*"] and texts["bubble"] == ["27.3%", "0.0%"]
    assert data["notes"] == ["* marks no steady state: N=3 is short of it (pipedream needs N>=4), so step and "
                             "samples/s include the warm-up and staleness can be below a longer run's; leave out "
                             "--minibatches for enough"]
    # one method's page has no chart to mark: its note names the method
    code, _, _ = pipesim("simulate", "-s", "pipedream", "-p", 4, "-m", 8, "-n", 3, "--html", page)
    data = _page_data(page.read_text())
    assert code == 0 and data["summary"] is None and data["notes"][0].startswith("pipedream is no steady state: N=3")


def test_the_page_says_which_methods_were_skipped_as_stderr_does(tmp_path):
    """Each starting with its method's name, whether its reason did (zb-h2's) or not (1f1b's --fwd)."""
    page = tmp_path / "t.html"
    code, _, err = pipesim("simulate", "-s", "1f1b", "-s", "zb-v", "-s", "zb-h2", "-p", "8", "--fwd",
                           ",".join(["1"] * 16), "--html", page)
    skipped = [line for line in err.splitlines() if line.startswith("skipped: ")]
    assert code == 0 and [line.split()[1] for line in skipped] == ["1f1b:", "zb-h2"]
    assert _page_data(page.read_text())["notes"] == skipped


def test_a_stage_graph_that_is_not_connected_is_refused(tmp_path):
    path = tmp_path / "g.json"
    path.write_text(json.dumps({"stages": 3, "edges": []}))
    code, _, err = pipesim("simulate", "-s", "graphpipe", "--graph", path)
    assert code == 2 and "stage graph is not connected: no edges join its 3 parts, stages [0], [1] and [2]" in err
    path.write_text(json.dumps({"stages": 4, "edges": [[0, 1], [2, 3]]}))
    code, _, err = pipesim("simulate", "-s", "graphpipe", "--graph", path)
    assert code == 2 and "stages [0, 1] and [2, 3]" in err


@pytest.mark.parametrize("args,fragment", [
    (["-s", "1f1b", "-p", "100000"], "p=100,000: 100,000 model stages, more than the 4,096 pipesim simulates: "
                                     "lower p (--stages)"),
    (["-s", "interleaved-1f1b", "-p", "4", "-v", "2000", "-m", "4"], "lower v (--chunks)"),
    (["-s", "1f1b", "-p", "64", "-m", "100000", "-n", "1"], "p=64 × m=100,000: about 38,000,000 ops and transfers to "
                                                             "simulate, more than the 30,000,000 pipesim simulates"),
    (["-s", "1f1b", "-p", "2048", "-m", "8", "-n", "1000"], "lower p (--stages)"),
    (["-s", "avgpipe", "-p", "8", "-m", "8", "-P", "100000"], "lower P (--pipelines)"),
])
def test_the_size_guard_names_the_parameter_to_lower(args, fragment):
    code, _, err = pipesim("simulate", *args)
    assert code == 2 and fragment in err and err.count("\n") == 1


def test_ctrl_c_is_one_line_and_exit_130(tmp_path, monkeypatch):
    from pipesim import sim

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(sim, "simulate", interrupted)
    code, out, err = pipesim("simulate", "-s", "1f1b", "--trace", tmp_path / "t.json", "--html", tmp_path / "t.html")
    assert (code, out, err.strip()) == (130, "", "interrupted")
    assert os.listdir(tmp_path) == []


def test_help_reads_well_at_80_columns():
    result = subprocess.run([sys.executable, "-c", "from pipesim.cli import main; main()", "simulate", "--help"],
                            capture_output=True, text=True, env={**os.environ, "COLUMNS": "80"})
    assert result.returncode == 0
    lines = result.stdout.splitlines()
    assert max(map(len, lines)) <= 80
    assert '"edges": [[a, b], ...]' in result.stdout  # not eaten as markup
    assert not any(box in result.stdout for box in "│╭─")
    assert any(line.lstrip().startswith("--fwd MS[,MS...]") for line in lines)


def test_calibrate_without_torch_says_what_to_install(tmp_path):
    blocker = ("import sys\n"
               "class NoTorch:\n"
               "    def find_spec(self, name, path=None, target=None):\n"
               "        if name == 'torch' or name.startswith('torch.'):\n"
               "            raise ModuleNotFoundError(f'No module named {name!r}', name=name)\n"
               "sys.meta_path.insert(0, NoTorch())\n"
               "from pipesim.cli import main\n"
               "main()\n")
    out = tmp_path / "p.json"
    result = subprocess.run([sys.executable, "-c", blocker, "calibrate", "--model", "mlp", "--out", str(out)],
                            capture_output=True, text=True)
    assert result.returncode == 2
    assert result.stderr == ("error: pipesim calibrate needs PyTorch, which is not installed: pip install "
                             "'pipesim[torch]' (or your CUDA build of torch)\n")
    assert not out.exists()


def test_torch_is_an_optional_extra():
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        import tomli as tomllib
    from pathlib import Path

    project = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())["project"]
    assert not any(d.replace(" ", "").startswith(("torch", "scikit-learn")) for d in project["dependencies"])
    assert project["optional-dependencies"]["torch"] == ["torch>=2.3,<3", "scikit-learn>=1.3"]  # digits data
    assert "pipesim[torch]" in project["optional-dependencies"]["test"]


def test_a_profiles_table_names_the_optimizer_that_priced_its_updates():
    """The profile's costs hold every optimizer's step; the caption says which one the table used (Adam's unless
    --optimizer says), since `run` trains with SGD unless told otherwise and its memory differs by that state."""
    profile = GPT_CPU
    memory = {}
    for optimizer, flags in (("adam", ()), ("sgd", ("--optimizer", "sgd"))):
        code, out, err = pipesim("simulate", "--profile", profile, "-s", "1f1b", "-m", "2", *flags)
        assert code == 0, err
        assert f"costs: measured (--profile), {optimizer}'s updates and state (--optimizer)" in " ".join(out.split())
        (result,) = simulate_json("--profile", profile, "-s", "1f1b", "-m", "2", *flags)
        memory[optimizer] = result["peak_memory_mb"]
    assert memory["sgd"] < memory["adam"]


def test_bare_pipesim_prints_its_help_and_version_prints_the_installed_one():
    from importlib import metadata

    code, out, err = pipesim()
    assert (code, err) == (0, "") and out.startswith("Usage: pipesim [OPTIONS] COMMAND")
    assert "--version" in out
    assert pipesim("--version") == (0, f"pipesim {metadata.version('pipesim')}\n", "")


def _help_texts():
    """Each command's name, its own flags, and its options' help texts (the docstring left out: it may name other
    commands' flags)."""
    import typer

    from pipesim.cli import make_app

    for name, command in typer.main.get_command(make_app()).commands.items():
        flags = {flag for param in command.params for flag in (*param.opts, *param.secondary_opts)}
        yield name, flags, [" ".join((param.help or "").split()) for param in command.params]


def test_each_commands_help_names_only_its_own_flags_and_no_other_commands_words():
    """simulate, sweep and estimate said "tune: searched if not given"; estimate's --gpu said "instead of
    --profile", a flag estimate does not have."""
    from pipesim.cli import COMMANDS

    for name, flags, helps in _help_texts():
        for text in helps:
            # "(`pipesim calibrate --device cuda`)" and "from simulate --trace" name another command's flags
            unquoted = re.sub(rf"`[^`]*`|\b({'|'.join(COMMANDS)}) --[a-z-]+", "", text)
            assert set(re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*", unquoted)) <= flags, (name, text)  # --fp8-recipe
            assert not [other for other in COMMANDS if other != name  # "tune: ..." opens a sentence for tune
                        and re.search(rf"(^|[.;(] *){other}: ", unquoted)], (name, text)
    tune = dict((name, helps) for name, _, helps in _help_texts())["tune"]
    assert sum(text.endswith("Default: searched.") for text in tune) == 3  # -t, --data-parallel, --recompute


def test_the_costs_only_auto_reads_say_so_in_run_and_export():
    """run and export refuse --wgrad-fraction beside any method but auto, as they refuse --fwd, --bwd, --comm and
    --activation-mb; its help said "(split-backward schedules)", which read as zb-h1's too."""
    import typer

    from pipesim.cli import make_app
    from pipesim.commands.common import SEARCH_COSTS

    commands = typer.main.get_command(make_app()).commands
    helps = {(name, param.name): param.help for name in ("run", "export") for param in commands[name].params}
    assert not [key for key in helps if key[1] in SEARCH_COSTS and not helps[key].startswith("auto: ")], helps
    assert {name for name, param in helps if param == "wgrad_fraction"} == {"run", "export"}


def test_usage_lines_name_arguments_plainly_and_help_shows_the_models_default_sizes():
    code, out, _ = pipesim("compare", "--help")
    assert code == 0 and "Usage: pipesim compare [OPTIONS] MEASURED [PREDICTED]\n" in out
    code, out, _ = pipesim("view", "--help")
    assert code == 0 and "Usage: pipesim view [OPTIONS] TRACE...\n" in out
    assert "<list[Path]>" not in out and "{" not in out
    code, out, _ = pipesim("count", "--help")
    words = " ".join(out.split()).replace("- ", "-")  # click's wrapping breaks after a hyphen: "two-", "branch"
    assert code == 0 and "Default: mlp 8, cnn 6, gpt 4, two-branch 2." in words
    assert "Default: mlp 512, cnn 32, gpt 256, two-branch 32." in words and "vocabulary size (default 2048)" in words


@pytest.mark.parametrize("command", [["simulate"], ["estimate", "--out", "e.json"]])
def test_too_many_stages_says_the_blocks_asked_for_and_the_layers_cut(tmp_path, monkeypatch, command):
    """--layers 4 with 16 stages read "a model of 6 layers": gpt's 4 blocks and its embedding and head."""
    monkeypatch.chdir(tmp_path)
    code, _, err = pipesim(*command, "--gpu", "h100-sxm", "--model", "gpt", "--layers", 4, "--stages", 16)
    assert code == 2 and list(tmp_path.iterdir()) == []
    assert err == ("error: --stages 16: gpt of 4 blocks (--layers) has 6 layers in all; give at most 6 stages (each "
                   "needs at least one layer)\n")


def test_every_option_that_takes_a_value_names_it_as_its_help_explains():
    """calibrate, count, estimate, export, run, study, sweep, tune, compare and view listed 74 options with typer's
    types for a name ("--layers <int range>", "--out <path>", "-s, --schedule <list[str]>") where simulate wrote
    "--stages P" and "--fwd MS[,MS...]": every option that takes a value has a metavar of capitals."""
    import click

    unnamed = []
    for name, param, record in help_records():
        if isinstance(param, click.Option) and not param.is_flag and record is not None:
            metavar = record[0].split(" ", 1 + record[0].count(", "))[-1]
            if not re.fullmatch(r"[A-Z][A-Z0-9_/]*(\[,[A-Z0-9_/]+\.\.\.\]|\.\.\.)?", metavar):
                unnamed.append(f"{name} {record[0]}")
    assert not unnamed, unnamed


def test_an_option_whose_help_says_its_default_in_words_does_not_say_it_twice():
    """"(default 8, or the profile's).  [default: 8; x>=1]" and "torch (...; the default) or megatron (...).
    [default: torch]": typer's default beside the words, which say more (the profile's b, when one is given, and
    what the default choice does), in every command; a range stays. Calibrate's --threads said "(`pipesim run
    --threads-per-rank`, default 1).  [default: 1; x>=1]": the words now leave the default to the bracket."""
    said = []
    for name, param, record in help_records():
        text = (record or ("", ""))[1]
        if re.search(r"the default[),]|(\(|; |, )default \d|Default \d", text):
            said.append(f"{name} {param.name}")
            assert "[default:" not in text, f"{name} {param.name}: {text}"
            assert not getattr(param, "min", None) or re.search(r"\[[\d.]*(<=)?x", text), text
    assert {"simulate fb_hidden_fraction", "tune max_staleness", "run microbatch_size", "export stages",
            "study pipelines", "simulate cross_entropy", "sweep allocator"} <= set(said)


@pytest.mark.parametrize("args,refusal", [
    (["simulate", "-s", "1f1b", "--trace", "{t}", "--html", "{t}"], "--html: {t} is also --trace's output"),
    (["simulate", "-s", "1f1b", "--profile", "{p}", "--trace", "{p}"],
     "--trace: {p} is also --profile, which it reads"),
    (["view", "{t}", "--html", "{t}"], "--html: {t} is also the trace it reads"),
    (["compare", "{t}", "--html", "{t}"], "--html: {t} is also the measured trace it reads"),
    (["study", "--plot-only", "--results", "{t}", "--html", "{t}"], "--html: {t} is also --results, which it reads"),
    (["sweep", "-s", "1f1b", "--out", "{o}", "--html", "{o}"], "--html: {o} is also --out's output"),
    (["simulate", "-s", "1f1b", "--gpu", "h100-sxm", "--model", "hf:{t}", "--trace", "{t}"],
     "--trace: {t} is also --model, which it reads"),
    (["sweep", "-s", "1f1b", "--gpu", "h100-sxm", "--model", "gpt", "--curve-from", "{p}", "--html", "{p}"],
     "--html: {p} is also --curve-from, which it reads"),
    (["estimate", "--gpu", "h100-sxm", "--model", "gpt", "--gpus", "{p}", "--out", "{p}"],
     "--out: {p} is also --gpus, which it reads"),
    pytest.param(["calibrate", "--model", "hf:{t}", "--out", "{t}", "--no-runtime", "--no-contention", "--no-links"],
                 "--out: {t} is also --model, which it reads",
                 marks=pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="calibrate needs torch")),
])
def test_an_output_never_replaces_another_output_or_a_file_the_command_reads(tmp_path, args, refusal):
    """`simulate --trace t.json --html t.json` kept the page and lost the trace, and `view t.json --html t.json`
    wrote the page over the trace it drew: one line naming both, exit 2, every file as it was."""
    names = {"t": tmp_path / "t.json", "p": tmp_path / "p.json", "o": tmp_path / "o.csv"}
    names["t"].write_text("{}")
    names["p"].write_text("{}")
    before = {path: path.read_bytes() for path in tmp_path.iterdir()}
    code, out, err = pipesim(*[arg.format(**names) for arg in args])
    flag = refusal.split(":")[0]
    assert code == 2 and out == "" and err == f"error: {refusal.format(**names)}; give {flag} a file of its own\n"
    assert {path: path.read_bytes() for path in tmp_path.iterdir()} == before


def test_the_table_says_the_makespans_unit():
    """The makespan column, unlike ms/step and peak MiB, said no unit anywhere."""
    code, out, err = pipesim("simulate", "-s", "gpipe", "-p", "4", "-m", "8", "-n", "1")
    assert code == 0, err
    assert "makespan" in out.splitlines()[1] and "makespan: ms from the first op to the last" in " ".join(out.split())


def test_help_never_breaks_a_flag_at_its_hyphens(monkeypatch):
    """At 80 columns click's wrapper broke lines after a hyphen: calibrate's help printed "`pipesim run --threads-"
    and "per-rank`" on the next line, and simulate's "--fp8-param-" / "gather": the half a user copies is no flag."""
    from pipesim.cli import COMMANDS

    monkeypatch.setenv("COLUMNS", "80")
    broken = []
    for name in COMMANDS:
        code, out, err = pipesim(name, "--help")
        assert code == 0, err
        broken += [f"{name}: {line.strip()}" for line in out.splitlines()
                   if re.search(r"--[a-z0-9-]*-$", line.rstrip())]
    assert not broken, broken


def test_help_never_cuts_a_word_at_80_columns(monkeypatch):
    """A word longer than the help column is cut where the line ends: --allocator's help printed
    "PYTORCH_CUDA_ALLOC_CONF=expan" and "dable_segments:True," on the next line, which pasted sets nothing."""
    import typer

    from pipesim.cli import make_app

    monkeypatch.setenv("COLUMNS", "80")
    cut = []
    for name, command in typer.main.get_command(make_app()).commands.items():
        code, out, err = pipesim(name, "--help")
        assert code == 0, err
        words = " ".join(out.split()).replace("- ", "-")  # click's wrapping breaks after a hyphen: "two-", "branch"
        cut += [f"{name} {param.opts[0]}: {word}" for param in command.params
                for word in (param.help or "").split() if word not in words]
    assert not cut, cut


def test_the_command_list_says_each_command_whole_at_80_columns(monkeypatch):
    """`pipesim --help`, a new user's first command, cut every command's first sentence at 80 columns: "Predict
    timelines, bubbles, memory and staleness of...", "Compare a measured run with its prediction op by op:..."."""
    from pipesim.cli import COMMANDS

    monkeypatch.setenv("COLUMNS", "80")
    code, out, err = pipesim("--help")
    assert code == 0, err
    listed = out.split("Commands:\n")[1].splitlines()
    assert [line.split()[0] for line in listed] == list(COMMANDS)
    assert not [line for line in listed if line.rstrip().endswith("...") or len(line) > 80], listed


def test_the_command_list_says_each_commands_first_sentence():
    """`pipesim --help` lists each command by its line in cli.COMMANDS, its module not imported: the line is the
    sentence its own help opens with, as the list said when it built every command."""
    import typer

    from pipesim.cli import COMMANDS, make_app

    built = typer.main.get_command(make_app()).commands
    assert {name: built[name].get_short_help_str(limit=1000) for name in COMMANDS} == \
        {name: command.summary for name, command in COMMANDS.items()}


def test_version_and_help_import_no_commands_module():
    """`pipesim --version` and `pipesim --help` built all thirteen commands, so they imported numpy, pydantic and
    rich, 0.3 of their 0.4 CPU seconds; `pipesim simulate --help` builds simulate's alone, which imports neither torch
    nor plotly nor the simulator (simpy)."""
    listed = pipesim_fresh(["--version"], ["--help"])
    assert [run.code for run in listed.runs] == [0, 0] and "Commands:\n  simulate " in listed.runs[1].out
    assert listed.imported & {"numpy", "pydantic", "rich", "torch", "plotly", "simpy"} == set()
    (helped,), imported = pipesim_fresh(["simulate", "--help"])
    assert helped.code == 0 and helped.out.startswith("Usage: pipesim simulate [OPTIONS]")
    assert imported & {"torch", "plotly", "simpy"} == set()


def test_simulate_without_a_profile_builds_no_profile_model():
    """The profile schema's pydantic models built their validators when simulate imported them, in a run that reads
    no profile: each builds it at its first profile now."""
    probe = ("from pipesim.cli import main\nfrom pipesim.profiles import schema\n"
             "try:\n    main(['simulate', '-s', '1f1b', '-p', '2', '-m', '4', '--json'])\nexcept SystemExit as exc:\n"
             "    print(exc.code, sorted(name for name, model in vars(schema).items() if isinstance(model, type)\n"
             "          and issubclass(model, schema.BaseModel) and model.__pydantic_complete__))")
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert done.stdout.splitlines()[-1] == "0 []"


def test_simulate_without_a_profile_imports_no_profile_schema():
    """A run from cost flags imported profiles/schema.py, 0.05 of its 0.8 CPU s, and read no profile: it took the
    schema for a pass issue's type (planning/host.py) and the --optimizer names alone (choices.py now)."""
    probe = ("import sys\nfrom pipesim.cli import main\n"
             "try:\n    main(['simulate', '-s', '1f1b', '-p', '2', '-m', '4', '--optimizer', 'adam'])\n"
             "except SystemExit as exc:\n    print(exc.code, 'pipesim.profiles.schema' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert done.stdout.splitlines()[-1] == "0 False"


def test_help_never_abbreviates_milliseconds_as_ms_capitalised():
    """--comm's help opened "Ms per activation or gradient transfer": Ms is megaseconds; ms is written out where it
    opens a sentence."""
    said = [f"{name} {param.name}: {record[1]}" for name, param, record in help_records()
            if record is not None and re.search(r"(^|\. )Ms\b", record[1])]
    assert not said, said


def test_simulate_writes_every_methods_trace_or_none(tmp_path, monkeypatch):
    """--trace with several methods writes one file each: a later one that cannot be written (a disk that fills
    after the check beforehand made and removed each file's temporary) leaves no earlier one, the error names the
    flag and the file."""
    import errno
    import tempfile

    from pipesim.traces import trace as trace_module

    made, real = [], tempfile.mkstemp

    def mkstemp(*args, **kwargs):  # the second file's, at its write (its first is the check's)
        made.append(kwargs.get("prefix"))
        if made.count(".t-zb-h1.json.") == 2:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(*args, **kwargs)

    monkeypatch.setattr(trace_module.tempfile, "mkstemp", mkstemp)
    code, out, err = pipesim("simulate", "-s", "1f1b", "-s", "zb-h1", "-p", 2, "-m", 2, "-n", 1,
                             "--trace", tmp_path / "t.json")
    assert code == 2 and err == f"error: --trace: cannot write {tmp_path / 't-zb-h1.json'}: No space left on device\n"
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("schedules", [["1f1b"], ["1f1b", "zb-h1"]])
def test_a_folder_given_to_trace_is_refused_for_one_method_or_several(tmp_path, schedules):
    """Several methods' traces are PATH-<method>: a folder given as PATH wrote `folder-1f1b`, ... beside it (exit 0),
    where one method's was refused."""
    folder = tmp_path / "traces"
    folder.mkdir()
    code, out, err = pipesim("simulate", *(arg for name in schedules for arg in ("-s", name)), "-p", 2, "-m", 2,
                             "--trace", folder)
    assert code == 2 and out == "" and err == f"error: --trace: {folder} is a directory; give a file path\n"
    assert list(tmp_path.iterdir()) == [folder] and list(folder.iterdir()) == []


@pytest.mark.parametrize("flag", ["--trace", "--html"])
@pytest.mark.parametrize("given, said", [("-", "- names no file here; give a file path, or /dev/stdout for the "
                                               "standard output"),
                                         ("", "give a file path (got the current folder)")])
def test_a_dash_or_an_empty_output_path_is_refused_as_what_it_is(tmp_path, monkeypatch, flag, given, said):
    """`--trace -` wrote a file named "-" ("wrote -"), where many tools read - as the standard output; `--html ""`
    said ". is a directory"."""
    monkeypatch.chdir(tmp_path)
    code, out, err = pipesim("simulate", "-s", "1f1b", "-p", 2, "-m", 2, flag, given)
    assert code == 2 and out == "" and err == f"error: {flag}: {said}\n", err
    assert list(tmp_path.iterdir()) == []


def test_a_stream_given_to_trace_is_refused_for_several_methods(tmp_path):
    """Several methods' traces are PATH-<method>: --trace /dev/stdout wrote /dev/stdout-1f1b, ... (exit 0), and a
    FIFO's traces went to new files beside it, not down the FIFO."""
    fifo = tmp_path / "traces"
    os.mkfifo(fifo)
    code, out, err = pipesim("simulate", "-s", "1f1b", "-s", "zb-h1", "-p", 2, "-m", 2, "--trace", fifo)
    assert code == 2 and out == "" and err == (f"error: --trace: {fifo} takes one trace, and 2 methods' are written to "
                                               "files named from PATH (PATH-<method>): give a file path, or one "
                                               "method\n")
    assert list(tmp_path.iterdir()) == [fifo]


# Each command with a required option or argument, and the opening of the line that names its first one
REQUIRED = {"estimate": "--gpu NAME is required: A GPU of the catalogue (`pipesim gpus`): count --model on torch's",
            "view": "TRACE is required: Trace files (from simulate --trace or run --trace).",
            "compare": "MEASURED is required: Measured trace (from `pipesim run --trace`), or a folder of",
            "tune": "--devices D is required: Devices D: d = D/(p·t) data-parallel replicas of a p-deep pipeline",
            "export": "--schedule NAME is required: Method to export (see `pipesim schedules`).",
            "run": "--schedule NAME is required: Method to run (see `pipesim schedules`).",
            "calibrate": "--model NAME is required: mlp, cnn, gpt, two-branch, package.module:attribute naming a"}


def test_every_command_with_a_required_flag_or_argument_is_checked_below():
    assert {name for name, param, _ in help_records() if param.required} == set(REQUIRED)


@pytest.mark.parametrize("command, line", REQUIRED.items(), ids=list(REQUIRED))
def test_a_required_flag_or_argument_left_out_is_named_with_what_it_takes(command, line):
    """Click's "Missing option '--format'." named the flag but not what to give: the line says it in the help's
    words, for every command's first required option or argument."""
    code, out, err = pipesim(command)
    assert code == 2 and out == "" and err.startswith(f"error: {line}") and err.count("\n") == 1, err


HUGE = 99_999_999_999
HUGE_VALUES = [("simulate", "-s", "1f1b", "-m", HUGE), ("run", "-s", "1f1b", "--model", "mlp", "--stages", HUGE),
               ("simulate", "--gpu", "h100-sxm", "--model", "gpt", "-s", "1f1b", "--tensor-parallel", HUGE),
               ("simulate", "--gpu", "h100-sxm", "--model", "gpt", "-s", "1f1b", "--stages", HUGE),
               ("tune", "--gpu", "h100-sxm", "--model", "gpt", "--devices", 6, "--tensor-parallel", HUGE),
               ("calibrate", "--model", "mlp", "--stages", HUGE, "--out", "p.json")]


@pytest.mark.parametrize("args", HUGE_VALUES, ids=[f"{args[0]} {args[args.index(HUGE) - 1]}" for args in HUGE_VALUES])
def test_a_huge_value_is_refused_with_its_thousands_grouped(tmp_path, monkeypatch, args):
    """The lines that repeat a huge value grouped it as the others do: "p=4 × m=99999999999 × N=2" (the schedule's
    size), "--tensor-parallel 99999999999 does not divide" (planning's refusals, through `flag_line`), "--stages
    99999999999: mlp ... has 9 layers" (calibrate's and the estimate's)."""
    monkeypatch.chdir(tmp_path)
    code, out, err = pipesim(*args)
    assert (code, out) == (2, "") and "99,999,999,999" in err, err
    assert re.findall(r"\d{5,}", err) == [], err


def test_tunes_devices_past_the_largest_cluster_planned_are_refused_before_any_search():
    """`tune --devices 99999999999 --tensor-parallel 7` searched the divisors of D for its suggestions, past 60 s:
    D is bounded as the largest cluster one plans, so every search over it stays short."""
    code, out, err = pipesim("tune", "--gpu", "h100-sxm", "--model", "gpt", "--devices", 1_000_001,
                             "--tensor-parallel", 7)
    assert (code, out) == (2, "") and err.startswith("error: --devices: give at most 1,000,000,"), err
    assert "(got 1,000,001)" in err and err.count("\n") == 1, err


@pytest.mark.parametrize("flag", ["--repeats", "--warmup"])
def test_calibrates_runs_a_measurement_are_bounded_with_the_other_flags(tmp_path, flag):
    """`calibrate --repeats 99999999999` started timing with no end in sight: the runs are bounded and refused with
    the other flags, before anything starts (--link-max-mb 0, refused next, shows that it is checked first)."""
    out_path = tmp_path / "p.json"
    code, out, err = pipesim("calibrate", "--model", "mlp", flag, 1_001, "--link-max-mb", 0, "--out", out_path)
    assert (code, out) == (2, "") and err == f"error: {flag}: give at most 1,000 runs a measurement, a hundred " \
                                            "times the default --repeats (got 1,001)\n", err
    assert not out_path.exists()


def test_a_cluster_file_of_more_devices_than_ran_says_which_of_them_ran():
    """examples/cluster.json lists 4 devices; at -p 2 the schedule ran on the first two without a word, and a
    device out of memory was named by a number the file does not give. The caption names them; at -p 4 nothing."""
    code, out, err = pipesim("simulate", "-s", "1f1b", "-p", "2", "--cluster", EXAMPLES / "cluster.json")
    assert code == 0, err
    assert "run on devices 0-1 (gpu0, gpu1), the first 2 of the --cluster file's 4" in " ".join(out.split())
    code, out, err = pipesim("simulate", "-s", "1f1b", "-p", "4", "--cluster", EXAMPLES / "cluster.json")
    assert code == 0 and "--cluster file's" not in out, err


def test_an_option_of_another_command_says_which_take_it():
    """`pipesim run --zero 1` said "No such option: --zero (Possible options: --lr)": click's nearest option, however
    far, and nothing of simulate, sweep, tune and estimate, which take it (a new user's pass)."""
    code, out, err = pipesim("run", "-s", "1f1b", "--zero", "1")
    assert (code, out, err) == (2, "", "error: `pipesim run` has no option --zero (simulate, sweep, tune and estimate "
                                       "take it); see `pipesim run --help`\n")
    code, _, err = pipesim("simulate", "--schedul", "1f1b")
    assert code == 2 and "has no option --schedul (did you mean '--schedule' or '--schedule-file'?);" in err


def test_a_short_option_of_another_command_says_which_take_it_and_what_it_stands_for():
    """`pipesim estimate -m 8` said "No such option: -m", as click says it (a new user's pass)."""
    code, out, err = pipesim("estimate", "--gpu", "h100-sxm", "--model", "gpt", "-m", "8")
    assert (code, out) == (2, "") and err == ("error: `pipesim estimate` has no option -m (simulate, run, export, "
                                              "sweep and study take it, as --microbatches); see `pipesim estimate "
                                              "--help`\n")
    code, _, err = pipesim("sweep", "-x")
    assert code == 2 and err == "error: `pipesim sweep` has no option -x; see `pipesim sweep --help`\n"


def test_an_option_given_last_without_its_value_says_what_it_takes():
    """`pipesim sweep -s` said "Option '-s' requires an argument.", click's line (a new user's pass)."""
    code, out, err = pipesim("sweep", "-s")
    assert (code, out) == (2, "") and err == "error: -s (--schedule) needs a value (NAME[,NAME...]): Methods, " \
                                            "comma-separated (default: all).\n"
    code, _, err = pipesim("run", "--lr")
    assert code == 2 and err == "error: --lr needs a value (LR): Learning rate.\n"


@pytest.mark.parametrize("flags, ending", [(["--fwd", "3"], "--fwd: the profile"), (["--fwd", "3", "--bwd", "6"],
                                                                                    "--fwd, --bwd: the profile")])
def test_flags_a_profile_fixes_are_refused_in_the_number_given(flags, ending):
    """One flag was told "drop these flags" (a new user's pass)."""
    code, _, err = pipesim("simulate", "-s", "1f1b", "--profile", GPT_CPU, *flags)
    assert code == 2 and err.startswith(f"error: {ending}"), err
    assert err.rstrip().endswith("drop --fwd" if len(flags) == 2 else "drop these flags"), err


def test_a_profiles_model_too_short_for_the_stages_names_no_flag_that_was_not_given():
    """The profile's model came from its file: "gpt of 14 blocks (--layers)" pointed at a flag no one gave."""
    code, _, err = pipesim("simulate", "-s", "1f1b", "--profile", GPT_CPU, "-p", "64")
    assert code == 2 and "the profile's gpt of 14 blocks has 16 layers in all; give at most 16 stages" in err, err
    assert "--layers" not in err


def test_an_estimated_profiles_model_too_short_names_the_profile_not_the_estimates_flag(tmp_path):
    """A profile `estimate --out` wrote, given to simulate, was "gpt of 4 blocks (--layers)": the flag of the
    estimate that wrote it, not of this command; the same model sized by simulate's own flags names --layers."""
    profile = tmp_path / "e.json"
    code, _, err = pipesim("estimate", "--gpu", "h100-sxm", "--model", "gpt", "--layers", "4", "-p", "2", "-o",
                           str(profile))
    assert code == 0, err
    code, _, err = pipesim("simulate", "-s", "gpipe", "--profile", str(profile), "-p", "8")
    assert code == 2 and "the profile's gpt of 4 blocks has 6 layers in all" in err and "--layers" not in err, err
    code, _, err = pipesim("simulate", "-s", "interleaved-1f1b", "--gpu", "h100-sxm", "--model", "gpt", "--layers",
                           "4", "-p", "4", "-v", "2")
    assert code == 2 and "8 model stages (--stages x --chunks): gpt of 4 blocks (--layers) has 6 layers" in err, err


def test_a_microbatch_group_is_given_to_interleaved_1f1b_alone():
    """Beside 1f1b, --microbatch-group shapes interleaved-1f1b's order only: the table labels that row alone, and
    --json records the group (and v) per row."""
    flags = ("--gpu", "h100-sxm", "--model", "gpt", "--layers", 8, "--seq-len", 256, "-b", 1, "-p", 4, "-m", 10,
             "-s", "1f1b", "-s", "interleaved-1f1b", "--microbatch-group", 5)
    code, out, err = pipesim("simulate", *flags)
    assert code == 0, err
    assert re.search(r"^ interleaved-1f1b \(v=2, g=5\) ", out, re.M) and re.search(r"^ 1f1b +[0-9]", out, re.M), out
    rows = {r["schedule"]: (r["chunks"], r["microbatch_group"]) for r in simulate_json(*flags)}
    assert rows == {"1f1b": (1, None), "interleaved-1f1b": (2, 5)}


def test_a_microbatch_group_of_p_reads_as_the_default():
    """--microbatch-group p is Megatron-core's default order: the table, --json and the trace read as without it."""
    shape = ("-p", 2, "-m", 8, "-s", "interleaved-1f1b")
    given, default = simulate_json(*shape, "--microbatch-group", 2), simulate_json(*shape)
    assert given == default and given[0]["microbatch_group"] is None
    code, out, err = pipesim("simulate", *shape, "--microbatch-group", 2)
    assert code == 0 and re.search(r"^ interleaved-1f1b \(v=2\) ", out, re.M), out
