"""benchmarks/torch_pipelining.py runs what a calibration profile measured, so that a prediction from that
profile describes the torch run; without one it prints the calibrate command that matches its flags."""

import io
import json
import shlex
from pathlib import Path

import pytest
import typer
from rich.console import Console

from pipesim.schedules.ir import Kind, ScheduleError
from tests.conftest import script_module
from tests.helpers import CNN_CPU, profiler_event

ROOT = Path(__file__).parent.parent
PROFILE = ROOT / "traces" / "measured" / "fidelity-cpu2-day3-runs" / "mlp-profile.json"


@pytest.fixture(scope="module")
def script():
    with script_module("torch_pipelining") as module:
        yield module


def test_a_profile_fixes_the_model_its_cut_micro_batch_size_threads_and_stages(script):
    measured = json.loads(PROFILE.read_text())
    args = script.arguments(["--profile", str(PROFILE), "--stages", "2", "--out", "run/"])  # agreeing: accepted
    assert (args.model, json.loads(args.model_options)) == (measured["model"]["name"], measured["model"]["options"])
    assert args.bounds == tuple(measured["partition"]["bounds"]) == (0, 5, 9)  # not the even cut of 9 layers
    assert (args.microbatch_size, args.threads_per_rank, args.stages) == (
        measured["environment"]["microbatch_size"], measured["environment"]["threads"], 2)
    steps = script._next_steps(args)
    assert f"pipesim simulate -s 1f1b -p 2 -m 8 -n 5 --profile {PROFILE} --optimizer sgd" in steps
    assert "pipesim calibrate" not in steps
    # its passes were timed as pipesim's executor runs them (before --passes-as): the note says how to time torch's
    assert f"note: {PROFILE} timed its stages' passes as pipesim's executor runs them" in steps


@pytest.mark.parametrize("flags,message", [
    (["--microbatch-size", "16"], "--microbatch-size 16: the profile"),
    (["--model-options", '{"layers": 8, "width": 1024}'], "--model-options"),
    (["--stages", "4"], "--stages 4"),
])
def test_a_flag_that_contradicts_the_profile_is_refused(script, capsys, flags, message):
    with pytest.raises(SystemExit) as exc:
        script.arguments(["--profile", str(PROFILE), *flags, "--out", "run/"])
    assert exc.value.code == 2 and message in capsys.readouterr().err


@pytest.mark.parametrize("schedule,runtime", [("zb-v", "zbv"), ("interleaved-1f1b", "interleaved-zb")])
def test_a_v_or_interleaved_schedule_runs_a_profiles_stages_two_a_rank(script, schedule, runtime):
    """A schedule of two stages a rank runs a 4-stage profile on 2 ranks, and without a profile its calibrate
    command asks for the 4 stages it runs. Before, the ranks were the profile's 4 (zb-v on them: 8 stages,
    refused), and the command asked for -p 2, a profile refused in turn."""
    args = script.arguments(["--profile", str(CNN_CPU), "--schedule", schedule, "--torch-schedule", runtime,
                             "--out", "run/"])
    assert (args.stages, args.bounds) == (2, (0, 2, 4, 6, 9))  # the profile's cut, two stages a rank
    assert f"pipesim simulate -s {schedule} -p 2 -m 8 -n 5 --profile {CNN_CPU}" in script._next_steps(args)
    args = script.arguments(["--schedule", schedule, "--torch-schedule", runtime, "--out", "run/"])
    assert " -p 4 " in next(line for line in script._next_steps(args).splitlines() if "pipesim calibrate" in line)
    with pytest.raises(ScheduleError, match="its cut has 3 stages, and zb-v places 2 a rank: calibrate with -p a "
                                            "multiple of 2"):
        script.profile_ranks(3, "zb-v")


def test_bad_input_is_one_line_before_any_rank_starts(script, capsys, tmp_path):
    for argv, message in ((["--model-options", "{layers"], "--model-options: not JSON"),
                          (["--profile", str(tmp_path / "none.json")], "cannot read profile"),
                          # it ran, profiled no mini-batch and wrote empty traces
                          (["--steps", "0"], "argument --steps: give a whole number of at least 1 (got 0)"),
                          (["--warmup", "-1"], "argument --warmup: give a whole number of at least 0 (got -1)"),
                          (["--stages", "two"], "argument --stages: give a whole number of at least 1 (got 'two')"),
                          # torch's classes place their own stages; the CSV says synchronous orders only
                          (["--schedule", "1f1b", "--torch-schedule", "zbv"],
                           "--torch-schedule zbv: torch's ScheduleZBVZeroBubble places stages [0, 1, 1, 0] on the "
                           "ranks, 1f1b places them [0, 1]"),
                          (["--schedule", "zb-v", "--torch-schedule", "interleaved-zb"],
                           "ScheduleInterleavedZeroBubble places stages [0, 1, 0, 1] on the ranks, zb-v places them "
                           "[0, 1, 1, 0]"),
                          (["--schedule", "pipedream"], "runs synchronous schedules only"),
                          # built in the parent too: a traceback there, where each rank's was before
                          (["--schedule", "1f1b-x"], "--schedule: unknown '1f1b-x'"),
                          (["--schedule", "interleaved-1f1b", "--microbatches", "3"],
                           "needs micro-batches to be a multiple of stages")):
        with pytest.raises(SystemExit) as exc:
            script.arguments([*argv, "--out", "run/"])
        assert exc.value.code == 2 and message in capsys.readouterr().err


def test_without_a_profile_it_prints_the_calibrate_command_that_matches_its_run(script):
    from pipesim.cli import app

    args = script.arguments(["--model-options", '{"layers": 4, "width": 256}', "--microbatch-size", "16",
                             "--stages", "2", "--out", "run/"])
    assert args.bounds is None
    line = next(line for line in script._next_steps(args).splitlines() if "pipesim calibrate" in line)
    argv = shlex.split(line)[2:]
    command = typer.main.get_command(app).commands["calibrate"]
    params = command.make_context("calibrate", argv).params  # pipesim calibrate parses it as written
    assert (params["model"], params["layers"], params["width"], params["microbatch_size"], params["stages"],
            params["threads"], params["device"], params["passes_as"]) == ("mlp", 4, 256, 16, 2, 1, "cpu", "torch")


def test_the_commands_it_prints_wrap_between_words_on_a_terminal_and_stay_whole_piped(script):
    """Its closing hint printed with print(), so a terminal of 80 columns broke the calibrate command inside a flag
    ("--optimizer s" over "gd"): on a terminal it wraps between words at the width, piped each command is one
    line."""
    args = script.arguments(["--out", "run/"])
    text = f"wrote 2 profiler traces to run/; {script._next_steps(args)}"
    for terminal in (True, False):
        console = Console(width=80, file=io.StringIO(), force_terminal=terminal, color_system=None)
        script.print_written(args, console)
        out = console.file.getvalue()
        if terminal:
            assert max(map(len, out.splitlines())) <= 80 and out.split() == text.split(), out
        else:
            assert out == text + "\n"


def test_the_first_stages_example_is_laid_out_as_the_micro_batches_torch_hands_it(script):
    """torch's stage checks each micro-batch's strides against the input it was built with: a gpt's token ids, a
    slice of seq_len + 1 tokens, stopped every gpt run in its first step ("stride mismatch: (9, 1) vs (8, 1)")."""
    import torch

    from pipesim.executor import RunSpec, cut, microbatch_data
    from pipesim.schedules import build_schedule
    from pipesim.schedules.catalogue import method_named

    m = 2
    spec = RunSpec(schedule=build_schedule("1f1b", method_named("1f1b").params(2, m)), model="gpt",
                   model_options={"layers": 2, "width": 16, "heads": 2, "seq_len": 8, "vocab": 32}, microbatch_size=2)
    stages = cut(spec)
    minibatch = torch.cat([microbatch_data(spec, stages.model, 0, j)[0] for j in range(m)])
    handed = minibatch.tensor_split(m)[0]  # as torch's schedule splits the mini-batch rank 0 is given
    example = script.stage_example(spec, stages, 0)
    assert (example.shape, example.stride()) == (handed.shape, handed.stride()) == ((2, 8), (8, 1))


def test_the_pruned_trace_keeps_where_each_actions_wait_for_its_receive_ends(script, tmp_path):
    """The profiler records every aten op; the script keeps the pipelining ranges and the first op inside each, which
    tells an F's or B's wait for its receive from its compute (planning/torch_profile.py), and in an overlapped
    pair's range the forward's last op and the backward's first autograd node, where it splits it, and nothing
    else."""
    from pipesim.planning.torch_profile import _actions

    event = profiler_event
    events = [event("PP:1RECV_F0", 0, 20), event("PP:1F0", 30, 2000), event("gloo:recv", 100, 10, tid=2),
              event("aten::linear", 1030, 900), event("aten::addmm", 1040, 800), event("aten::relu", 1900, 20),
              event("PP:1B0", 2100, 800), event("aten::mm", 2150, 300), event("aten::mm", 2500, 300),
              event("PP:(1F1;2B0)OVERLAP_F_B", 3000, 2000), event("aten::linear", 3100, 400),
              event("aten::relu", 3550, 50), event("aten::clamp_min", 3560, 30),
              event("autograd::engine::evaluate_function: AddmmBackward0", 3900, 600), event("aten::mm", 3950, 500)]
    path = tmp_path / "rank1.json"
    path.write_text(json.dumps({"traceEvents": events, "distributedInfo": {"rank": 1}}))
    whole = _actions(path, 1)
    script._prune(path)
    kept = json.loads(path.read_text())
    assert [e["name"] for e in kept["traceEvents"]] == [
        "PP:1RECV_F0", "PP:1F0", "PP:1B0", "PP:(1F1;2B0)OVERLAP_F_B", "aten::linear", "aten::mm", "aten::linear",
        "autograd::engine::evaluate_function: AddmmBackward0", "aten::relu"]
    assert _actions(path, 1) == whole and whole[1][1][6] == 1000  # F0 waited 1 ms for its receive
    assert whole[1][3:] == [(Kind.F, 1, 1, 2, 3000, 600, 100), (Kind.B, 2, 0, 1, 3600, 1400, 300)]  # split at 3.6 ms


def test_torchs_input_backward_takes_a_middle_stages_outputs():
    """torch's zero-bubble schedules compute a stage's I with `stage_backward_input`, which detaches the stage's
    outputs in place: a middle stage's, flat views of its last layer's output, refused it ("Can't detach views
    in-place"). Its I then W give autograd's gradients, and the outputs let go of their graph."""
    import torch
    from torch.distributed.pipelining._backward import stage_backward_input, stage_backward_weight

    from pipesim.executor import RunSpec, cut
    from pipesim.schedules import build_schedule
    from pipesim.schedules.catalogue import method_named

    spec = RunSpec(schedule=build_schedule("gpipe", method_named("gpipe").params(3, 1)), model="mlp",
                   model_options={"layers": 3, "width": 8}, microbatch_size=2)
    stages = cut(spec)
    middle, weights = stages.modules[1], list(stages.modules[1].parameters())
    torch.manual_seed(0)
    received = torch.randn(stages.edge_shapes[(0, 1)])
    grad = torch.randn(stages.edge_shapes[(1, 2)])
    leaf = received.clone().requires_grad_(True)
    expected = torch.autograd.grad(middle(leaf), [leaf, *weights], [grad])
    leaf = received.clone().requires_grad_(True)
    outputs = list(middle(leaf))
    _, groups = stage_backward_input(outputs, [grad], [leaf], middle.parameters())
    stage_backward_weight(middle.parameters(), groups)
    assert [out.grad_fn for out in outputs] == [None]
    for got, want in zip([leaf.grad, *(w.grad for w in weights)], expected, strict=True):
        torch.testing.assert_close(got, want)


def test_torchs_zero_bubble_schedule_runs_pipesims_stages_on_two_gloo_ranks(tmp_path):
    """torch's ScheduleZBVZeroBubble on pipesim's zb-v stages (two a rank, stages 1 and 2 in the middle) of a
    4-stage profile runs and records each stage's I and W; it stopped at the first middle stage's I, and a profile
    of a V's stages was refused."""
    import subprocess
    import sys

    run = subprocess.run([sys.executable, ROOT / "benchmarks" / "torch_pipelining.py", "--schedule", "zb-v",
                          "--torch-schedule", "zbv", "--profile", CNN_CPU, "--microbatches", "2", "--steps", "1",
                          "--warmup", "0", "--out", tmp_path], capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    for rank, (first, second) in enumerate(((0, 3), (1, 2))):
        names = {e["name"] for e in json.loads((tmp_path / f"rank{rank}.json").read_text())["traceEvents"]}
        assert {f"PP:{k}{kind}{j}" for k in (first, second) for kind in "FIW" for j in (0, 1)} <= names, names
