"""`pipesim run`: trains for real over gloo ranks and writes the measured trace; bad input is one line, exit 2,
no traceback and no output file."""

from __future__ import annotations

import itertools
import json
import math
import os
import re
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from pipesim.executor import ExecutorError, RunSpec, carried_bounds, cut
from pipesim.executor.runners import run_in_process
from pipesim.planning.replay import predict_measured
from pipesim.planning.scenario import profile_scenario
from pipesim.profiles.schema import load_profile, stages_for
from pipesim.schedules import ScheduleParams, lower
from pipesim.traces import read_trace
from pipesim.traces.compare import compare
from pipesim.workload.transport import served_rendezvous
from tests.conftest import at_columns, build, pipesim, pipesim_fresh, run
from tests.helpers import GPT_CPU

# A task a few steps of SGD learn (the class is where the first four features peak), so "the loss falls" does
# not depend on the built-in models' data. Ranks import it from the working folder, as `--model` allows.
LEARNABLE = '''
import torch
import torch.nn.functional as F
from torch import nn

from pipesim.workload.models import Model


def model():
    def make(b, gen):
        x = torch.randn(b, 16, generator=gen)
        return x, x[:, :4].argmax(dim=1)

    layers = [nn.Sequential(nn.Linear(16, 32), nn.ReLU()), nn.Sequential(nn.Linear(32, 32), nn.ReLU()),
              nn.Linear(32, 4)]
    return Model("peak", layers, make, lambda out, target: F.cross_entropy(out, target))
'''

SMALL_MLP = ["--model", "mlp", "--layers", "3", "--width", "16", "--microbatch-size", "4"]


@pytest.fixture
def learnable(tmp_path, monkeypatch):
    (tmp_path / "peak_task.py").write_text(LEARNABLE)
    monkeypatch.chdir(tmp_path)
    return "peak_task:model"


@pytest.mark.slow
def test_two_gloo_ranks_train_and_the_trace_reads_back(learnable, tmp_path):
    trace, html = tmp_path / "t.json", tmp_path / "t.html"
    code, out, err = pipesim("run", "--schedule", "1f1b", "--model", learnable, "--stages", 2, "--microbatches", 4,
                             "--minibatches", 30, "--microbatch-size", 16, "--optimizer", "adam", "--lr", 0.01,
                             "--trace", trace, "--html", html, "--json", "--no-heldout")
    assert code == 0, err
    document = json.loads(out)
    losses = document["losses"][0]
    assert len(losses) == 30 and sum(losses[-5:]) < 0.6 * sum(losses[:5])  # about 1.35 -> 0.4
    assert (document["loss_first"], document["loss_last"]) == (losses[0], losses[-1])
    assert document["complete"] and document["hardware"]["backend"] == "gloo"
    assert [d["device"] for d in document["devices"]] == [0, 1]
    assert all(d["peak_memory_mb"] > 0 for d in document["devices"])
    measured = read_trace(trace)
    assert measured.meta.source == "measured" and measured.meta.complete and measured.meta.failed_rank is None
    assert len(measured.ops) == len(lower(build("1f1b", 2, 4, 30)).table.kind)  # every row ran and is there
    assert (measured.ops.dur_us >= 0).all()
    assert measured.meta.extra["losses"][0] == document["losses"][0]
    assert html.read_text().startswith("<!DOCTYPE html>")


@pytest.fixture(scope="module")
def profile(tmp_path_factory):
    """A 2-stage partition of the small mlp (4 layers), calibrated here without links."""
    path = tmp_path_factory.mktemp("profile") / "mlp.json"
    code, _, err = pipesim("calibrate", *SMALL_MLP, "--stages", 2, "--no-links", "--no-runtime", "--no-contention",
                           "--repeats", 1, "--warmup", 0, "--out", path)
    assert code == 0, err
    return path


BAD = {
    "unknown schedule": (["--schedule", "nope", *SMALL_MLP], "--schedule: unknown 'nope'; choose from gpipe"),
    "more stages than layers": (["--schedule", "1f1b", *SMALL_MLP, "--stages", 5],
                                "--stages 5: mlp of 3 blocks (--layers) has 4 layers in all; give at most 4 stages"),
    "nccl without a GPU": (["--schedule", "1f1b", *SMALL_MLP, "--backend", "nccl"],
                           "--backend nccl sends GPU tensors only"),
    "unknown optimizer": (["--schedule", "1f1b", *SMALL_MLP, "--optimizer", "lion"], "--optimizer"),
    "learning rate not positive": (["--schedule", "1f1b", *SMALL_MLP, "--lr", 0], "--lr"),
    "negative seed": (["--schedule", "1f1b", *SMALL_MLP, "--seed", -1],  # simulate's rule (commands/common.py Seed)
                      "--seed: give a whole number from 0 to 4,294,967,295 (got -1)"),
    "seed past 32 bits": (["--schedule", "1f1b", *SMALL_MLP, "--seed", 2**32],  # its data seeds passed torch's 64
                          "--seed: give a whole number from 0 to 4,294,967,295 (got 4,294,967,296)"),
    "unknown dtype": (["--schedule", "1f1b", *SMALL_MLP, "--dtype", "int8"],
                      "--dtype: choose from fp32, bf16, fp16, float32, bfloat16, float16 (got 'int8')"),
    "unknown backend": (["--schedule", "1f1b", *SMALL_MLP, "--backend", "mpi"],
                        "--backend: choose from auto, gloo, nccl (got 'mpi')"),
    "option of another method": (["--schedule", "1f1b", *SMALL_MLP, "--elastic-alpha", 0.5], "--elastic-alpha"),
    "unknown model option": (["--schedule", "1f1b", "--model", "mlp", "--layers", 0], "--layers"),
    "auto without costs": (["--schedule", "auto", *SMALL_MLP],
                           "--fwd and --bwd, or --profile: auto searches its order from the stage costs"),
    "auto's limit below a micro-batch": (["--schedule", "auto", *SMALL_MLP, "--fwd", 1, "--bwd", 2,
                                          "--activation-limit", 0.1], "R must be at least 0.5"),
    "auto's limit not a number": (["--schedule", "auto", *SMALL_MLP, "--fwd", 1, "--bwd", 2, "--activation-limit",
                                   "lots"], "--activation-limit: give a finite number above 0 (got 'lots')"),
    "costs for a fixed order": (["--schedule", "1f1b", *SMALL_MLP, "--fwd", 1],
                                "--fwd: only a schedule searched from the costs (auto) reads it, not 1f1b"),
    "auto's limit for a fixed order": (["--schedule", "1f1b", *SMALL_MLP, "--activation-limit", 2],
                                       "--activation-limit applies to auto only, not 1f1b"),
    # torch took 10**12 threads as an overflow in each rank, which exited with code 1
    "threads past the host's cores": (["--schedule", "1f1b", *SMALL_MLP, "--threads-per-rank", 10**12],
                                      "--threads-per-rank: give 1"),  # "to N" past 1 core
    # the micro-batch the ranks are sent, made here first, was torch's allocation traceback
    "micro-batch past memory": (["--schedule", "1f1b", *SMALL_MLP[:-1], 10**12],
                                "mlp does not fit in memory at micro-batch size 1,000,000,000,000 (--microbatch-size)"),
    # a pipe per rank opened for 18 s, then "[Errno 24] Too many open files"
    "more ranks than files to start them": (["--schedule", "1f1b", *SMALL_MLP, "--data-parallel", 10**12],
                                            "--stages x --pipelines x --data-parallel: 2,000,000,000,000 ranks"),
}


@pytest.mark.parametrize("args, message", BAD.values(), ids=BAD.keys())
def test_bad_input_is_one_line_and_writes_nothing(tmp_path, args, message):
    trace = tmp_path / "t.json"
    code, out, err = pipesim("run", *args, "--microbatches", 2, "--minibatches", 1, "--trace", trace,
                             "--html", tmp_path / "t.html")
    assert code == 2, err
    assert message in err and len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("command, taken", [
    (("run", "-s", "1f1b", "--stages", 2, "-m", 4), r"151\.7 TiB in float32 as run runs its forward on this host, "
                                                    r"beside 7\.16 MiB"),
    (("calibrate", "--out", "p.json"), r"151\.7 TiB in float32 as calibrate runs its forward on this host, beside "
                                       r"7\.16 MiB"),
    (("study", "--no-timing"), r"39\.95 TiB in float32 as study runs its forward on this host, beside 489 KiB"),
], ids=["run", "calibrate", "study"])
def test_a_micro_batch_past_the_hosts_memory_is_refused_before_it_is_made(tmp_path, monkeypatch, command, taken):
    """`run --model mlp -b 100000000` made its 25.6 GB micro-batch, and the line quoted torch's allocator ("[enforce
    fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: ..."); calibrate's and study's too. The micro-batch
    and its layers' outputs are sized on the meta device first: 16,680 bytes a sample of the mlp (its input's 64
    features, its 8 layers' 512 and its head's 10, in float32; study's mlp, 128 wide, 4,392)."""
    monkeypatch.chdir(tmp_path)
    code, out, err = pipesim(*command, "--model", "mlp", "-b", 10**10)
    assert (code, out) == (2, ""), err
    assert re.fullmatch(r"error: mlp does not fit in memory at micro-batch size 10,000,000,000 \(--microbatch-size\): "
                        rf"the micro-batch and its layers' outputs take {taken} of weights, and the host has "
                        r"[\d.]+ [GMK]iB available; give a smaller --microbatch-size \(past [\d,]+ this alone "
                        r"outgrows it\)\n", err)
    assert list(tmp_path.iterdir()) == []


def test_an_allocation_torch_refuses_is_one_line_without_its_allocators_text():
    """A micro-batch that passed the estimate and still failed to be made: torch's multi-line allocator message
    (its source file, "enforce fail", the error code) as the size that failed, in the units the other lines use."""
    import torch

    from pipesim.commands.common import out_of_host_memory

    with pytest.raises(RuntimeError) as failed:
        torch.empty(2**62, dtype=torch.uint8)  # past any host's address space: refused at once, nothing touched
    assert str(out_of_host_memory(failed.value, "mlp", 10**6)) == (
        "mlp does not fit in memory at micro-batch size 1,000,000 (--microbatch-size): an allocation of 4,096 PiB "
        "failed; make it smaller (--width, --layers, --microbatch-size)")


@pytest.mark.parametrize("command, module, name", [
    (("run", "-s", "1f1b", "--stages", 2, "-m", 2, "--no-heldout"), "pipesim.executor.runners", "run_multiprocess"),
    (("calibrate", "--stages", 2, "--no-links", "--no-runtime", "--no-contention", "--out", "p.json"),
     "pipesim.calibrate.measure", "calibrate"),
    (("study", "--no-timing", "-p", 2, "-s", "1f1b", "--seeds", 1), "pipesim.study.train", "train"),
], ids=["run", "calibrate", "study"])
def test_a_failed_allocation_past_the_estimate_is_one_line_in_each_command(tmp_path, monkeypatch, command, module,
                                                                          name):
    """A micro-batch that passed the estimate and still failed to be made (MemoryError, raised where the command makes
    its real batches): one line and exit 2, the same in run, calibrate and study (commands/common.py
    refuse_out_of_host_memory); an error of another kind keeps its traceback."""
    import importlib

    def fails(*args, **kwargs):
        raise failure

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(importlib.import_module(module), name, fails)
    small = ("--model", "mlp", "--layers", 3, "--width", 16, "-b", 4)
    failure = MemoryError()
    assert pipesim(*command, *small) == (2, "", "error: mlp does not fit in memory at micro-batch size 4 "
                                                "(--microbatch-size): the host ran out of memory; make it smaller "
                                                "(--width, --layers, --microbatch-size)\n")
    failure = RuntimeError("a bug's")
    with pytest.raises(RuntimeError, match="a bug's"):
        pipesim(*command, *small)

def test_a_data_parallel_runs_table_names_p_d_and_each_replicas_devices(monkeypatch):
    """4 ranks of p = 2 and d = 2: the title says both, the peaks are grouped by replica (not 'device 2/3')."""
    from pipesim.executor import runners

    monkeypatch.setattr(runners, "run_multiprocess", lambda spec, **options: run_in_process(spec))
    code, out, err = pipesim("run", "--schedule", "1f1b", *SMALL_MLP, "--microbatches", 2, "--minibatches", 2,
                             "--data-parallel", 2, "--no-heldout")
    assert code == 0, err
    assert "4 ranks (p=2, d=2)" in out and "replica 0: " in out and "replica 1: " in out and "3: " not in out


def test_a_run_without_trace_prints_its_table_and_writes_nothing(tmp_path, monkeypatch):
    from pipesim.executor import runners

    monkeypatch.setattr(runners, "run_multiprocess", lambda spec, **options: run_in_process(spec))  # no spawning
    monkeypatch.chdir(tmp_path)
    code, out, err = pipesim("run", "--schedule", "1f1b", *SMALL_MLP, "--microbatches", 2, "--minibatches", 2,
                             "--no-heldout")
    assert code == 0, err
    assert "1f1b measured: 2 mini-batches" in out and "ms/step" in out and "wrote" not in out
    assert list(tmp_path.iterdir()) == []


def test_a_run_with_no_heldout_is_not_scored_and_its_table_and_trace_say_so(tmp_path, monkeypatch):
    """--no-heldout skips the held-out score (the default gpt's 11 CPU s): the table's column says "not scored",
    not "-" (a model with no held-out set), and the trace records that it was not asked, which a trace written
    before the flag does not."""
    from pipesim.executor import runners

    monkeypatch.setattr(runners, "run_multiprocess", lambda spec, **options: run_in_process(spec))  # no spawning
    trace = tmp_path / "t.json"
    code, out, err = pipesim("run", "--schedule", "1f1b", *SMALL_MLP, "--microbatches", 2, "--minibatches", 2,
                             "--no-heldout", "--trace", trace)
    assert code == 0, err
    assert out.splitlines()[3].split()[5:7] == ["not", "scored"], out  # loss first -> last, then the column
    extra = read_trace(trace).meta.extra
    assert extra["score_heldout"] is False and "heldout" not in extra
    code, out, err = pipesim("run", "--schedule", "1f1b", *SMALL_MLP, "--microbatches", 2, "--minibatches", 2,
                             "--no-heldout", "--json")
    assert code == 0, err
    document = json.loads(out)
    assert (document["heldout"], document["heldout_scored"]) == (None, False)


@pytest.mark.parametrize("method, p, m, n", [("1f1b", 2, 4, 5), ("pipedream", 3, 2, 7), ("avgpipe", 2, 4, 4),
                                             ("interleaved-1f1b", 2, 4, 3)])
def test_progress_counts_a_minibatch_done_at_each_devices_last_row_of_it(method, p, m, n):
    """The supervisor's progress table, as its definition reads (it is now computed in one pass)."""
    from pipesim.executor.runners import _finished_after

    lowered = lower(build(method, p, m, n))
    for device in range(lowered.schedule.num_devices):
        minibatch = list(lowered.table.minibatch[lowered.rows(device).start:lowered.rows(device).stop])
        last = [max((i + 1 for i, b in enumerate(minibatch) if b == j), default=0) for j in range(n)]
        assert list(_finished_after(lowered, device)) == sorted(last)


@pytest.mark.parametrize("stages, model, message", [
    (3, "mlp", "its partition has 2 stages, but 1f1b on 3 devices has 3; give --stage-cut balanced (its layers cut "
               "again), calibrate with --stages 3 or drop --profile"),
    (2, "cnn", "it profiles model 'mlp', not 'cnn'"),
    # more stages than its layers: said of the layers, where the partition's count named fixes refused in turn
    (5, "mlp", "--stages 5: the profile's mlp of 3 blocks has 4 layers in all; give at most 4 stages, or a cut that "
               "may leave stages between the first and the last empty (--stage-cut layout:STRING or layers:N,N,...)"),
])
def test_a_profile_that_does_not_match_is_refused(tmp_path, profile, stages, model, message):
    trace = tmp_path / "t.json"
    code, _, err = pipesim("run", "--schedule", "1f1b", "--model", model, "--stages", stages, "--microbatches", 2,
                           "--minibatches", 1, "--profile", profile, "--trace", trace)
    assert code == 2 and message in err and len(err.strip().splitlines()) == 1
    assert not trace.exists()


def test_a_profile_that_does_not_match_is_refused_before_torch_is_imported(tmp_path, profile):
    """The profile is held to the run's flags before torch's import (5-10 s), where run imported the executor and
    resolved the device first."""
    trace = tmp_path / "t.json"
    run = ["run", "-s", "1f1b", "--profile", profile, "--trace", trace]
    fresh = pipesim_fresh([*run, "--model", "cnn"], [*run, "--model", "mlp", "--stages", 3],
                          [*run, "--model", "mlp", "--width", 32])
    assert [run.code for run in fresh.runs] == [2, 2, 2]
    assert "it profiles model 'mlp', not 'cnn'; give --model mlp" in fresh.runs[0].err
    assert "its partition has 2 stages, but 1f1b on 3 devices has 3" in fresh.runs[1].err
    assert "--width 32: the profile" in fresh.runs[2].err
    assert "torch" not in fresh.imported and not trace.exists()


def test_a_run_of_a_profile_runs_its_model_and_without_either_says_which_to_give(tmp_path, profile, monkeypatch):
    """--profile names the model, so --model may be left out (run refused it as missing): the run builds the
    profile's model at its sizes; with neither flag the refusal names both."""
    from pipesim.executor import runners

    ran = []
    monkeypatch.setattr(runners, "run_multiprocess", lambda spec, **options: ran.append(spec) or run_in_process(spec))
    code, _, err = pipesim("run", "-s", "1f1b", "--microbatches", 2, "--minibatches", 1, "--profile", profile,
                           "--trace", tmp_path / "t.json", "--no-heldout")
    assert code == 0, err
    assert ran[0].model == "mlp" and ran[0].model_options == {"layers": 3, "width": 16}
    code, _, err = pipesim("run", "-s", "1f1b", "--trace", tmp_path / "x.json")
    assert code == 2 and "--model: give the model to run, or --profile, whose model it runs" in err
    assert not (tmp_path / "x.json").exists()


def test_a_run_of_a_profile_runs_on_the_devices_its_cut_was_made_for(tmp_path, monkeypatch):
    """A 3-stage profile run without --stages took --stages' default of 2 and was refused ("its partition has 3
    stages, but 1f1b on 2 devices has 2"), where the README runs a profile with no --stages."""
    from pipesim.executor import runners

    three = tmp_path / "three.json"
    code, _, err = pipesim("calibrate", *SMALL_MLP, "--stages", 3, "--no-links", "--no-runtime", "--no-contention",
                           "--repeats", 1, "--warmup", 0, "--out", three)
    assert code == 0, err
    ran = []
    monkeypatch.setattr(runners, "run_multiprocess", lambda spec, **options: ran.append(spec) or run_in_process(spec))
    code, _, err = pipesim("run", "-s", "1f1b", "--microbatches", 3, "--minibatches", 1, "--profile", three,
                           "--trace", tmp_path / "t.json", "--no-heldout")
    assert code == 0 and ran[0].schedule.num_devices == 3, err
    # compared with its prediction, the terms the profile skipped are said: every transfer read -100 % unexplained
    code, out, err = pipesim("compare", tmp_path / "t.json", "--json")
    assert code == 0 and json.loads(out)["notes"] == [
        "the prediction's profile was calibrated with --no-links, --no-runtime, --no-contention: it prices every "
        "transfer at 0 ms; no runtime cost on a row; ranks computing at once as fast as one alone, which the errors "
        "show"], out
    code, _, err = pipesim("run", "-s", "1f1b", "--stages", 2, "--profile", three, "--trace", tmp_path / "x.json")
    assert code == 2 and "its partition has 3 stages, but 1f1b on 2 devices has 2" in err  # given: held to it


def test_a_profiles_model_name_that_names_no_model_is_the_profiles_fault(tmp_path, profile):
    """A profile whose model.name names no model, run without --model, was refused as "--model: unknown 'nosuch'",
    a flag the user never gave."""
    document = json.loads(profile.read_text())
    document["model"]["name"] = "nosuch"
    named = tmp_path / "named.json"
    named.write_text(json.dumps(document))
    code, out, err = pipesim("run", "-s", "1f1b", "--profile", named, "--trace", tmp_path / "t.json")
    assert code == 2 and err.startswith(f"error: --profile {named}: its model.name 'nosuch' is no model run can "
                                        "build (unknown 'nosuch'; choose from mlp, cnn, gpt"), err
    assert not (tmp_path / "t.json").exists()


@pytest.mark.parametrize("minibatches, step, caption", [
    (1, r"[\d,]+\.\d\d\*", "* step: the one mini-batch, all warm-up (N=1): give --minibatches 2 or more for a "
                            "steady step"),
    (2, r"[\d,]+\.\d\d", "step: one mini-batch, the mean time between mini-batch ends from the first's on (the "
                          "warm-up left out; the last too where mini-batches overlap)"),
])
def test_runs_step_column_says_what_it_measures(tmp_path, profile, monkeypatch, minibatches, step, caption):
    """The step is the mean time between mini-batch ends from the first's on (`summarize`), where the caption said
    "from the second mini-batch's end on"; at N = 1 it is the one mini-batch, warm-up and all, marked * as simulate
    marks it, where it was shown as a steady step."""
    from pipesim.executor import runners

    monkeypatch.setattr(runners, "run_multiprocess", lambda spec, **options: run_in_process(spec))
    at_columns(monkeypatch, 200)
    code, out, err = pipesim("run", "-s", "1f1b", "--microbatches", 2, "--minibatches", minibatches, "--profile",
                             profile, "--trace", tmp_path / "t.json", "--no-heldout")
    assert code == 0, err
    row = next(line for line in out.splitlines() if re.match(r"\s*[\d,]+\.\d\d", line))
    assert re.fullmatch(step, row.split()[0]) and caption in out, out
    code, _, err = pipesim("compare", tmp_path / "t.json")  # compare warns of the run's time too
    assert code == 0, err
    said = "warning: the run is one mini-batch (N=1), all warm-up: the time compared is the whole run"
    assert (said in " ".join(err.split())) is (minibatches == 1), err


def test_a_run_of_a_torch_timed_profile_warns_as_compare_does(tmp_path, profile, monkeypatch):
    """A `calibrate --passes-as torch` profile prices each pass short of pipesim's executor (its functional_call
    and saved-tensor hooks), so a run predicted from it, as compare predicts a run from its profile, is warned of
    on stderr in one line, compare's own; a profile timed the executor's way is not."""
    from pipesim.executor import runners

    monkeypatch.setattr(runners, "run_multiprocess", lambda spec, **options: run_in_process(spec))
    document = json.loads(profile.read_text())
    document["environment"]["passes_as"] = "torch"  # as `calibrate --passes-as torch` writes it
    timed = tmp_path / "torch.json"
    timed.write_text(json.dumps(document))
    run = ["run", "-s", "1f1b", "--microbatches", 2, "--minibatches", 1, "--no-heldout"]
    code, _, err = pipesim(*run, "--profile", profile, "--trace", tmp_path / "executor-run.json")
    assert code == 0 and "warning" not in err, err
    code, _, err = pipesim(*run, "--profile", timed, "--trace", tmp_path / "run.json")
    assert code == 0 and err.count("\n") == 1, err
    assert err.startswith("warning: the profile timed its stages' passes as torch.distributed.pipelining runs them")
    assert err.endswith("calibrate without --passes-as torch\n")
    code, _, compared = pipesim("compare", tmp_path / "run.json")
    assert code == 0 and err in compared, compared


def test_a_bad_flag_is_refused_before_the_processes_server_starts_or_torch_is_imported(tmp_path):
    """run started its ranks' server (its own process, importing torch) before it read a flag, and imported torch
    before a misspelt --model, --device or a Hugging Face model without its profile was refused: a mistyped flag
    took seconds to refuse on a busy host. Every flag that needs nothing started is read first."""
    bad = [["--model", "mpl"], ["--device", "gpu"], ["--optimizer", "lion"], ["--backend", "mpi"], ["--lr", "0"],
           ["--dtype", "float64"], ["--model", "hf:examples/llama3.1-70b"],
           ["--trace", tmp_path / "missing" / "t.json"], ["--stages", "3", "--profile", tmp_path / "absent.json"]]
    runs, imported = pipesim_fresh(*(("run", "-s", "1f1b", *([] if "--model" in flags else ["--model", "mlp"]),
                                      *([] if "--trace" in flags else ["--trace", tmp_path / "t.json"]), *flags)
                                     for flags in bad), cwd=tmp_path)
    assert [(done.code, done.err.count("\n")) for done in runs] == [(2, 1)] * len(bad), runs
    # each for its own flag, not another refusal's (the --trace or --out check, a missing --profile)
    assert all(any(str(flag) in done.err for flag in flags if str(flag).startswith("--"))
               for flags, done in zip(bad, runs)), runs
    assert not {"torch", "multiprocessing.forkserver"} & imported and not list(tmp_path.iterdir())


def test_an_estimate_of_another_depth_is_refused_naming_estimate_not_calibrate(tmp_path):
    estimate = tmp_path / "e.json"
    assert pipesim("estimate", "--gpu", "a100-sxm-80gb", "--model", "gpt", "--layers", 2, "--width", 64, "--heads", 4,
                   "--seq-len", 128, "--vocab", 2048, "-b", 8, "-p", 2, "--out", estimate).code == 0
    code, _, err = pipesim("run", "--schedule", "1f1b", "--model", "gpt", "--stages", 3, "--microbatches", 2,
                           "--minibatches", 1, "--profile", estimate)
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert ("its partition has 2 stages, but 1f1b on 3 devices has 3; give --stage-cut balanced (its layers cut "
            "again), estimate with --stages 3 or drop --profile") in err


def test_a_run_trains_in_its_profiles_dtype_and_refuses_another(tmp_path, profile, monkeypatch):
    """A profile calibrated in bfloat16 is run in bfloat16 (the run once built the model in float32 whatever the
    profile said, and on a GPU measured float32 kernels ten times slower than the bf16 ones it was compared with);
    its weights come back widened to float32, which numpy holds and bfloat16 it does not."""
    from pipesim.executor import runners

    document = json.loads(profile.read_text())
    document["environment"]["dtype"] = "bfloat16"
    in_bf16 = tmp_path / "bf16.json"
    in_bf16.write_text(json.dumps(document))
    ran = []
    monkeypatch.setattr(runners, "run_multiprocess", lambda spec, **options: ran.append(spec) or run_in_process(spec))
    trace = tmp_path / "t.json"
    code, out, err = pipesim("run", "--schedule", "1f1b", *SMALL_MLP[:-2], "--microbatches", 2, "--minibatches", 2,
                             "--profile", in_bf16, "--trace", trace, "--no-heldout")
    assert code == 0, err
    assert ran[0].dtype == "bfloat16" and read_trace(trace).meta.extra["dtype"] == "bfloat16"
    # the table says what it trained in
    assert "in bfloat16 with float32 master weights and gradients (--optimizer, --lr, --dtype)" in " ".join(out.split())
    code, _, err = pipesim("run", "--schedule", "1f1b", *SMALL_MLP[:-2], "--microbatches", 2, "--minibatches", 2,
                           "--profile", in_bf16, "--dtype", "fp32", "--trace", tmp_path / "x.json")
    assert code == 2 and "calibrated in bfloat16, and its times hold there only" in err
    assert not (tmp_path / "x.json").exists()


def test_an_estimated_profile_refuses_another_dtype_micro_batch_or_size_as_estimated(tmp_path):
    """An estimate's times hold in its dtype, micro-batch and model sizes as a calibration's do, but it was never
    calibrated: the refusal says so, and to estimate it again."""
    estimate = tmp_path / "e.json"
    code, _, err = pipesim("estimate", "--model", "mlp", "--gpu", "h100-sxm", "--stages", 2, "--out", estimate)
    assert code == 0, err
    for flag, value, held in (("--dtype", "fp32", "in bfloat16"), ("--microbatch-size", 3, "at 1 sample per"),
                              ("--width", 7, "with width 512")):
        code, _, err = pipesim("run", "--schedule", "1f1b", "--model", "mlp", "--microbatches", 2, "--profile",
                               estimate, flag, value, "--trace", tmp_path / "t.json")
        assert code == 2 and f"{flag} {value}: the profile {estimate} was estimated {held}" in err, err
        assert "drop the flag or estimate it again" in err
    assert not (tmp_path / "t.json").exists()


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_a_16_bit_calibration_probes_its_runtime_and_a_run_of_it_compares(tmp_path, dtype, monkeypatch):
    """`calibrate --dtype bfloat16` on a GPU died in its runtime probe, whose ranks hand their trained weights back
    as numpy, which holds no bfloat16; the calibrations in 16 bits here timed the layers alone. Both 16-bit dtypes
    calibrate with the probe (its ranks, then the calibrated model's), run in their dtype, score the trained model
    and compare with the profile's prediction."""
    from pipesim.executor import runners

    profile, trace = tmp_path / "p.json", tmp_path / "t.json"
    code, _, err = pipesim("calibrate", *SMALL_MLP, "--stages", 2, "--dtype", dtype, "--no-links", "--no-contention",
                           "--repeats", 1, "--warmup", 0, "--out", profile)
    assert code == 0, err
    assert load_profile(profile).runtime is not None and load_profile(profile).environment.dtype == dtype
    monkeypatch.setattr(runners, "run_multiprocess", lambda spec, **options: run_in_process(spec))
    code, _, err = pipesim("run", "--schedule", "1f1b", *SMALL_MLP[:-2], "--microbatches", 2, "--minibatches", 2,
                           "--profile", profile, "--trace", trace)
    assert code == 0, err
    measured = read_trace(trace)
    assert measured.meta.extra["dtype"] == dtype and math.isfinite(measured.meta.extra["heldout"]["loss"])
    code, out, err = pipesim("compare", trace, "--json")
    assert code == 0, err
    assert math.isfinite(json.loads(out)["iteration_time_error"])


@pytest.mark.parametrize("stages", [4, 5, 6])
@pytest.mark.parametrize("layers", [1, 2, 3, 4])
def test_without_bounds_a_branching_model_is_cut_along_graphpipes_stage_graph(stages, layers):
    """The default cut is the even one where the diamond carries it, else the most even one it carries: the
    stem first, each branch on its own stages, the head last (two-branch has 2 * layers + 2 layers)."""
    spec = RunSpec(build("graphpipe", stages, 2, 1), "two-branch", {"layers": layers, "width": 4})
    total = 2 * layers + 2
    if total < stages:
        with pytest.raises(ExecutorError, match=f"cannot cut {total} layers into {stages} stages"):
            cut(spec)
        return
    bounds = cut(spec).bounds
    cuts = [[0, *inner, total] for inner in itertools.combinations(range(1, total), stages - 1)]
    model = spec.build_model()  # built once: a cut does not change the model, and up to 126 cuts are tried
    fits = [b for b in cuts if carried_bounds(replace(spec, bounds=tuple(b)), model=model) == tuple(b)]
    even = [0, *itertools.accumulate(len(part) for part in np.array_split(range(total), stages))]
    assert bounds in fits
    assert bounds == even if even in fits else max(np.diff(bounds)) == min(max(np.diff(b)) for b in fits)
    assert (layers, stages) != (2, 4) or even not in fits  # the case: [0, 2, 4, 5, 6] failed the run


def test_a_model_no_cut_of_which_the_stage_graph_carries_is_one_line_naming_the_layers_that_work(tmp_path):
    trace = tmp_path / "t.json"
    code, _, err = pipesim("run", "-s", "graphpipe", "--model", "mlp", "--layers", 5, "--stages", 4, "--trace", trace)
    assert code == 2 and len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert "carries no cut of model 'mlp'" in err and "no --layers from 1 to 12 gives one" in err
    assert err.endswith(": give a model that branches as the graph does (--model two-branch carries one at --layers "
                        "1 to 12)\n")  # the built-in model that does, named
    assert not trace.exists()


@pytest.mark.slow
def test_graphpipe_runs_the_two_branch_model_at_its_default_layers_and_tables_the_run(tmp_path):
    trace = tmp_path / "g.json"
    code, out, err = pipesim("run", "-s", "graphpipe", "--model", "two-branch", "--stages", 4, "--microbatches", 4,
                             "--minibatches", 2, "--trace", trace, "--no-heldout")
    assert code == 0, err
    assert read_trace(trace).meta.extra["bounds"] not in (None, [0, 2, 4, 5, 6])  # the even cut, which it cannot carry
    for text in ("ms/step", "samples/s", "loss first -> last", "peak MiB per device", f"wrote {trace}",
                 "sgd at lr 0.05 in float32 (--optimizer, --lr, --dtype)"):  # the defaults it trained with, named
        assert text in " ".join(out.split())


def test_a_profiles_chain_cut_that_graphpipes_diamond_cannot_carry_runs_on_the_best_cut_it_carries(tmp_path):
    """Calibration cuts a branching model as a chain: layers [0, 1, 2, 4, 6] put branch a's two layers on
    stages 1 and 2, layer 2 reading layer 1, which the diamond has no edge for. The run says so, runs on the
    cut the diamond carries whose slowest stage is fastest (by the profile's layers) and records it, and
    compare predicts it from the profile re-cut there."""
    path = tmp_path / "tb.json"
    code, _, err = pipesim("calibrate", "--model", "two-branch", "--layers", 2, "--width", 8, "--microbatch-size", 2,
                           "--stages", 4, "--no-links", "--no-runtime", "--no-contention", "--repeats", 1,
                           "--warmup", 0, "--out", path)
    assert code == 0, err
    profile = load_profile(path)
    bounds = [0, 1, 2, 4, 6]
    chained = profile.model_copy(update={"partition": profile.partition.model_copy(update={"bounds": bounds}),
                                         "stages": stages_for(profile, bounds)})
    path.write_text(chained.model_dump_json())
    trace = tmp_path / "t.json"
    code, out, err = pipesim("run", "--schedule", "graphpipe", "--model", "two-branch", "--stages", 4,
                             "--microbatches", 2, "--minibatches", 2, "--profile", path, "--trace", trace,
                             "--no-heldout")
    assert code == 0, err
    assert "graphpipe's stage graph cannot carry the profile's partition (layers [0, 1, 2, 4, 6]" in " ".join(
        out.split())
    used = read_trace(trace).meta.extra["bounds"]
    schedule = build("graphpipe", 4, 2, 2)
    costs = np.cumsum([0.0] + [layer.fwd.median_ms + layer.bwd.median_ms for layer in profile.layers])

    def carried(bounds):
        try:
            cut(RunSpec(schedule, "two-branch", {"layers": 2, "width": 8}, bounds=tuple(bounds)))
        except ExecutorError:
            return False
        return True

    cuts = [[0, *inner, 6] for inner in itertools.combinations(range(1, 6), 3)]
    fits = [b for b in cuts if carried(b)]
    assert bounds not in fits and used in fits and len(fits) < len(cuts)
    assert max(np.diff(costs[used])) == min(max(np.diff(costs[b])) for b in fits)
    code, out, err = pipesim("compare", trace, "--json")
    assert code == 0, err
    assert json.loads(out)["matched_ops"] == len(read_trace(trace).ops)
    # a chain model has no cut the diamond carries (stage 2 would read stage 1): none, not a crash
    chain = RunSpec(schedule, "mlp", {"layers": 3, "width": 8}, bounds=(0, 1, 2, 3, 4))
    assert carried_bounds(chain, [1.0] * 4) is None


@pytest.mark.parametrize("rank", [0, 2])
def test_a_torchrun_world_of_another_size_is_refused_once_per_host(rank, tmp_path, monkeypatch):
    """Every rank torchrun starts meets the refusal; the first on a host says it, the others exit as quietly: 3
    ranks printed it 3 times."""
    for name, value in {"RANK": str(rank), "WORLD_SIZE": "3", "LOCAL_RANK": str(rank), "MASTER_ADDR": "127.0.0.1",
                        "MASTER_PORT": "29999"}.items():
        monkeypatch.setenv(name, value)
    trace = tmp_path / "t.json"
    code, out, err = pipesim("run", "--schedule", "1f1b", *SMALL_MLP, "--stages", 2, "--microbatches", 2,
                             "--minibatches", 1, "--trace", trace)
    assert code == 2 and not trace.exists() and not out
    if rank == 0:
        assert "torchrun started 3 ranks" in err and "runs on 2 devices" in err
        assert len(err.strip().splitlines()) == 1
    else:
        assert not err


def test_a_torchrun_rank_refused_by_what_it_measured_of_its_host_says_so_whatever_its_local_rank(monkeypatch):
    """Each rank measures the host's available memory when it gets there, so one may be refused alone: the second
    rank on a host exited 2 saying nothing, while its peers waited for it (review)."""
    for name, value in {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "MASTER_ADDR": "127.0.0.1",
                        "MASTER_PORT": "29999"}.items():
        monkeypatch.setenv(name, value)
    code, _, err = pipesim("run", "-s", "1f1b", "--model", "gpt", "--layers", 64, "--width", 8192)
    assert code == 2 and "gpt does not fit in memory" in err, err


def test_a_failure_a_torchrun_rank_may_meet_alone_is_said_by_that_rank(monkeypatch, capsys):
    """The executor's errors (a device's own) are printed by every rank that meets one, bad input by the first."""
    from pipesim.commands.common import fail

    for name, value in {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "MASTER_ADDR": "127.0.0.1"}.items():
        monkeypatch.setenv(name, value)
    for every_rank in (False, True):
        with pytest.raises(SystemExit) as ended:
            fail("device 1: its own failure", every_rank=every_rank)
        assert ended.value.code == 2
        assert ("device 1: its own failure" in capsys.readouterr().err) is every_rank


@pytest.mark.slow
def test_a_diverging_learning_rate_stops_at_its_minibatch_and_keeps_the_trace(tmp_path):
    trace, html = tmp_path / "t.json", tmp_path / "t.html"
    code, out, err = pipesim("run", "--schedule", "1f1b", *SMALL_MLP, "--stages", 2, "--microbatches", 2,
                             "--minibatches", 20, "--lr", 1e8, "--trace", trace, "--html", html)
    assert code == 2, err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert "training diverged" in err and "at mini-batch" in err and "rank 1" in err
    assert f"wrote {trace} (incomplete)" in out and not html.exists()
    measured = read_trace(trace)
    assert not measured.meta.complete and measured.meta.failed_rank == 1
    assert any(math.isnan(loss) for loss in measured.meta.extra["losses"][0])


@pytest.mark.slow
def test_under_torchrun_rank_0_gathers_and_writes_the_trace(learnable, tmp_path):
    trace = tmp_path / "t.json"
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--standalone",
                           "-m", "pipesim.cli", "run", "--schedule", "1f1b", "--model", learnable,
                           "--stages", "2", "--microbatches", "2", "--minibatches", "3", "--trace", str(trace),
                           "--json"], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    document = json.loads(done.stdout)  # rank 0 alone prints
    assert document["hardware"]["launcher"] == "torchrun" and document["hardware"]["clock_offsets_ns"] == [0, 0]
    measured = read_trace(trace)
    assert measured.meta.complete and len(measured.ops) == len(lower(build("1f1b", 2, 2, 3)).table.kind)


@pytest.mark.slow
def test_a_run_with_a_profile_is_predicted_again_from_it_and_compared_op_by_op(tmp_path, profile):
    """calibrate -> run --profile -> compare MEASURED: the run records its profile, the simulator predicts the
    same schedule from it, every op matches, and the weight versions the executor used are the predicted ones
    (XPipe with the counted distances: versions and prediction both follow the order)."""
    trace = tmp_path / "m.json"
    code, _, err = pipesim("run", "--schedule", "xpipe", *SMALL_MLP, "--stages", 2, "--microbatches", 2,
                           "--minibatches", 4, "--optimizer", "adam", "--prediction", "counted", "--profile", profile,
                           "--trace", trace, "--no-heldout")
    assert code == 0, err
    measured = read_trace(trace)
    assert measured.meta.params["prediction"] == "counted" and measured.meta.extra["profile"]["model"]["name"] == "mlp"
    code, out, err = pipesim("compare", trace, "--json")
    assert code == 0, err
    c = json.loads(out)
    assert c["missing_in_measured"] == c["missing_in_predicted"] == 0 and c["matched_ops"] == len(measured.ops)
    # the fixture's profile skipped the host terms, which the note says (profiles/schema.py `unmeasured_terms`)
    assert c["version_mismatches"] == 0 and [note.split(":")[0] for note in c["notes"]] == [
        "the prediction's profile was calibrated with --no-links, --no-runtime, --no-contention"]
    assert np.isfinite(c["iteration_time_error"])
    code, _, err = pipesim("run", "--schedule", "1f1b", *SMALL_MLP[:-2], "--microbatch-size", 8, "--profile", profile,
                           "--trace", tmp_path / "x.json")
    assert code == 2 and "calibrated at 4 samples per micro-batch" in err


@pytest.mark.slow
def test_auto_runs_the_order_searched_for_its_profile_and_compare_searches_it_again(tmp_path, profile):
    """run -s auto --profile: two gloo ranks run the order searched for the profile's costs at the limit given;
    the trace records R, and `compare` predicts the run by searching again from the recorded profile: the same
    ops, on the same weight versions."""
    trace = tmp_path / "m.json"
    code, _, err = pipesim("run", "--schedule", "auto", *SMALL_MLP, "--stages", 2, "--microbatches", 4,
                           "--minibatches", 2, "--activation-limit", 1.5, "--profile", profile, "--trace", trace,
                           "--no-heldout")
    assert code == 0, err
    measured = read_trace(trace)
    assert measured.meta.schedule == "auto" and measured.meta.params["activation_limit"] == 1.5
    searched = profile_scenario(load_profile(profile), "sgd").build("auto", ScheduleParams(**measured.meta.params),
                                                                    measured.meta.extra["bounds"])
    assert len(measured.ops) == len(lower(searched).table.kind)
    code, out, err = pipesim("compare", trace, "--json")
    assert code == 0, err
    c = json.loads(out)
    assert c["missing_in_measured"] == c["missing_in_predicted"] == 0 and c["matched_ops"] == len(measured.ops)
    assert c["version_mismatches"] == 0 and np.isfinite(c["iteration_time_error"])


AHEAD_NS = 5_000_000_000  # rank 1's clock in the test below: 5 s ahead of rank 0's


def _offsets_rank(rank: int, rendezvous, out: str) -> None:
    import torch.distributed as dist

    from pipesim.executor.runners import TorchrunEnv, _clock_offsets

    rendezvous.join("gloo", rank, 2)
    try:
        if rank == 0:
            readings: list[int] = []
            offsets = _clock_offsets(dist.group.WORLD, TorchrunEnv(0, 2, 0, 1), host="here",
                                     clock_ns=lambda: readings.append(time.perf_counter_ns()) or readings[-1])
            shortest_round_trip_ns = min(back - sent for sent, back in zip(readings[::2], readings[1::2]))
            Path(out).write_text(json.dumps({"offsets": offsets, "shortest_round_trip_ns": shortest_round_trip_ns}))
        else:
            _clock_offsets(dist.group.WORLD, TorchrunEnv(1, 2, 0, 1), host="elsewhere",
                           clock_ns=lambda: time.perf_counter_ns() + AHEAD_NS)
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_ranks_on_other_hosts_get_their_clock_offset_by_ping_pong(tmp_path):
    """Two ranks that say they are on different hosts, rank 1's clock 5 s ahead: rank 0 measures that offset
    to within half its shortest round trip (rank 1 reads its clock inside that trip, and the offset is taken from
    the trip's midpoint), a bound that holds however busy the host. The ranks start as a run's do (forked from the
    server that imported torch once, workload/processes.py)."""
    import torch.multiprocessing

    from pipesim.workload.processes import rank_context

    out = tmp_path / "offsets.json"
    with served_rendezvous() as rendezvous:
        torch.multiprocessing.start_processes(_offsets_rank, args=(rendezvous, str(out)), nprocs=2,
                                              start_method=rank_context().get_start_method())
    measured = json.loads(out.read_text())
    first, second = measured["offsets"]
    assert first == 0 and abs(second - AHEAD_NS) <= (measured["shortest_round_trip_ns"] + 1) // 2


@pytest.mark.slow
def test_under_torchrun_a_dead_rank_leaves_rank_0s_rows_as_an_incomplete_trace(learnable, tmp_path):
    """Rank 1 is killed (SIGKILL) after 6 rows: rank 0's transfer fails or torchrun stops it, and rank 0 still
    writes the rows it ran, marked incomplete; the job fails."""
    from pipesim.executor.runners import FAULT_ENV

    trace = tmp_path / "t.json"
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--standalone",
                           "-m", "pipesim.cli", "run", "--schedule", "1f1b", "--model", learnable,
                           "--stages", "2", "--microbatches", "2", "--minibatches", "50", "--timeout", "20",
                           "--trace", str(trace)], capture_output=True, text=True, timeout=120, cwd=tmp_path,
                          env={**os.environ, FAULT_ENV: "1:6:KILL"})
    assert done.returncode != 0
    assert f"wrote {trace} (incomplete)" in done.stdout, done.stdout + done.stderr
    measured = read_trace(trace)
    assert not measured.meta.complete and measured.meta.failed_rank is None
    rank_0_rows = len(lower(build("1f1b", 2, 2, 50)).rows(0))
    assert set(measured.ops.device.tolist()) == {0} and 0 < len(measured.ops) < rank_0_rows
    memory = measured.counters["memory_bytes"][0]  # and their memory (it was one sample of 0)
    assert len(memory.values) > len(measured.ops) and memory.values.max() > 0


WEIGHTY_MLP = ["--model", "mlp", "--layers", "3", "--width", "96", "--microbatch-size", "2"]


@pytest.fixture(scope="module")
def weighty_profile(tmp_path_factory):
    """A 2-stage mlp whose weights outweigh its activations, so weight copies decide its peak memory; with the
    runtime probe, which measures the gradient an update keeps."""
    path = tmp_path_factory.mktemp("profile") / "weighty.json"
    code, _, err = pipesim("calibrate", *WEIGHTY_MLP, "--stages", 2, "--no-links", "--no-contention",
                           "--repeats", 1, "--warmup", 0, "--out", path)
    assert code == 0, err
    return load_profile(path)


@pytest.mark.parametrize("method", ["pipedream", "pipedream-2bw", "spectrain", "pipeoptim", "xpipe"])
def test_stashed_and_predicted_weights_cost_what_the_simulator_counts(weighty_profile, method):
    """Each device's peak memory, measured, is what the simulator counts from the profile's bytes. A stashed
    version or a used prediction is freed at its last read, though the graph of a forward that ran on it holds
    it until the backward (one copy per micro-batch in flight, 30-60 % over, before), and a row's peak is taken
    before it lets go of what it read last (a stashed version while the next mini-batch's gradient builds)."""
    schedule = build(method, 2, 4, 4)
    spec = RunSpec(schedule, "mlp", {"layers": 3, "width": 96}, microbatch_size=2, optimizer="momentum",
                   bounds=tuple(weighty_profile.partition.bounds), heldout=False)  # memory alone: no score
    measured = run_in_process(spec).trace
    predicted = predict_measured(measured.meta, weighty_profile)
    for device in compare(predicted, measured).devices:
        assert device.peak_memory_error == pytest.approx(0, abs=0.03), device


@pytest.fixture(scope="module")
def weighty_bf16_profile(tmp_path_factory):
    """`weighty_profile`'s model calibrated in bfloat16, the runtime probe with it."""
    path = tmp_path_factory.mktemp("profile") / "weighty-bf16.json"
    code, _, err = pipesim("calibrate", *WEIGHTY_MLP, "--stages", 2, "--dtype", "bfloat16", "--no-links",
                           "--no-contention", "--repeats", 1, "--warmup", 0, "--out", path)
    assert code == 0, err
    return load_profile(path)


@pytest.mark.parametrize("method, pipelines", [("1f1b", 1), ("pipedream", 1), ("pipeoptim", 1), ("avgpipe", 2)])
def test_mixed_precision_weights_cost_what_the_simulator_counts(weighty_bf16_profile, method, pipelines):
    """In bfloat16 the executor keeps float32 masters (the optimizer's state, so SGD's is that copy alone) and float32
    main gradients beside its 16-bit weights; calibration records them so (a layer's gradient twice its weights'
    bytes, SGD's state as much, momentum's twice that) and each device's peak memory, measured, is what the
    simulator counts from them: versions and predictions in 16 bits, an update's kept gradient in float32, AvgPipe's
    reference a copy of the float32 masters (priced as a 16-bit copy it measured 4.9 % over)."""
    layers = [layer for layer in weighty_bf16_profile.layers if layer.param_bytes]
    assert layers and all(layer.grad_bytes == 2 * layer.param_bytes for layer in layers)
    assert all(layer.optimizer_state_bytes["sgd"] == 2 * layer.param_bytes
               and layer.optimizer_state_bytes["momentum"] == 4 * layer.param_bytes for layer in layers)
    spec = RunSpec(build(method, 2, 4, 4, pipelines=pipelines), "mlp", {"layers": 3, "width": 96},
                   microbatch_size=2, optimizer="momentum", dtype="bfloat16",
                   bounds=tuple(weighty_bf16_profile.partition.bounds), heldout=False)  # memory alone: no score
    measured = run_in_process(spec).trace
    predicted = predict_measured(measured.meta, weighty_bf16_profile)
    for device in compare(predicted, measured).devices:
        assert device.peak_memory_error == pytest.approx(0, abs=0.03), device


SMALL_GPT = {"layers": 3, "width": 64, "heads": 4, "seq_len": 64, "vocab": 2000}


def _zb_h1_calibrated_peaks(tmp_path, model: str, options: dict[str, int], dtype: str):
    """A 2-stage CPU calibration of `model` in `dtype`, and its ZB-H1 (m = n = 4, momentum) run on its cut: the
    profile and, per device, predicted against measured peak memory (`compare`)."""
    path = tmp_path / f"{model}.json"
    flags = [str(a) for key, value in options.items() for a in (f"--{key.replace('_', '-')}", value)]
    code, _, err = pipesim("calibrate", "--model", model, *flags, "--microbatch-size", 2, "--stages", 2,
                           "--dtype", dtype, "--no-links", "--no-contention", "--repeats", 1, "--warmup", 0,
                           "--out", path)
    assert code == 0, err
    profile = load_profile(path)
    spec = RunSpec(build("zb-h1", 2, 4, 4), model, options, microbatch_size=2, optimizer="momentum",
                   dtype=dtype, bounds=tuple(profile.partition.bounds), heldout=False)  # memory alone: no score
    measured = run_in_process(spec).trace
    return profile, compare(predict_measured(measured.meta, profile), measured).devices


def test_a_split_backward_holds_until_its_weight_pass_what_calibration_measured(tmp_path):
    """A gpt's last stage (a block and the head) in ZB-H1, bfloat16: its I keeps for its W the block's saved tensors,
    the head's input and the gradients arriving where the weights' gradients branch off (the logits' among them),
    and calibration records them so (calibrate/measure.py `measure_wgrad_held`): each device's peak memory, measured,
    is what the simulator counts. Before, the profile held none (priced as half the activations) and the executor's
    books left the gradients out: +7.3 % on the last stage."""
    profile, devices = _zb_h1_calibrated_peaks(tmp_path, "gpt", SMALL_GPT, "bfloat16")
    head = profile.layers[-1]
    assert head.wgrad_gradient_bytes > 2 * 64 * 2000 * 2 > head.wgrad_kept_bytes  # the logits' gradient, not its loss
    for device in devices:
        assert device.peak_memory_error == pytest.approx(0, abs=0.01), device


def test_a_calibrated_stage_keeps_until_its_weight_pass_all_its_lower_layers_saved(tmp_path):
    """The default cnn's last stage in ZB-H1: its I frees only what its last layer saves above its linear, the lower
    layers' ReLU outputs and max-pool indices stay for W (profiles/schema.py `wgrad_held_ranges`), and its peak
    memory, measured, is what the simulator counts. Before, the stage summed its layers' kept as if each were last:
    8.0 % under."""
    profile, devices = _zb_h1_calibrated_peaks(tmp_path, "cnn", {}, "float32")
    stage = profile.stages[-1]
    mine, last = profile.layers[slice(*stage.layers)], profile.layers[stage.layers[1] - 1]
    assert stage.wgrad_kept_bytes == stage.activation_bytes - (last.activation_bytes - last.wgrad_kept_bytes) > sum(
        layer.wgrad_kept_bytes for layer in mine)
    assert devices[-1].peak_memory_error == pytest.approx(0, abs=0.01), devices[-1]


@pytest.fixture(scope="module")
def dag_profile(tmp_path_factory, weighty_profile):
    """GraphPipe's two-branch DAG in 4 stages whose messages outweigh its weights, with the runtime terms the
    probe measured for `weighty_profile`: the receives kept posted and the gradients an update keeps are the
    executor's, not the model's (the probe measures them on its own tiny model), so a second probe (4 ranks
    spawned twice) would measure the same memory terms again."""
    path = tmp_path_factory.mktemp("profile") / "dag.json"
    code, _, err = pipesim("calibrate", "--model", "two-branch", "--layers", 2, "--width", 16, "--microbatch-size", 8,
                           "--stages", 4, "--no-links", "--no-runtime", "--no-contention", "--repeats", 1, "--warmup",
                           0, "--out", path)
    assert code == 0, err
    return load_profile(path).model_copy(update={"runtime": weighty_profile.runtime})


def test_posted_receives_hold_their_buffers_as_the_simulator_counts(dag_profile):
    """A rank keeps up to 16 receives posted ahead, and the transport allocates each buffer as it posts it: the
    executor counts it from then, the simulator prices the same window (GraphPipe's branches: 14-27 % under
    on three of four devices while neither counted them). The boundary tensors are counted once, as the stage's
    own from F to its backward: the stem's max-pool output and the merge's inputs, which autograd does not
    save, are held by the executor as the backward's roots and leaves (5-8 % off while the simulator counted
    them as messages in transit instead), and a backward's peak is at its start, before it frees them."""
    spec = RunSpec(build("graphpipe", 4, 4, 2), "two-branch", {"layers": 2, "width": 16}, microbatch_size=8,
                   bounds=(0, 1, 3, 5, 6), heldout=False)  # stem, branch a, branch b, head; memory alone: no score
    measured = run_in_process(spec).trace
    assert measured.meta.extra["recv_window"] == 16
    predicted = predict_measured(measured.meta, dag_profile)
    for device in compare(predicted, measured).devices:
        assert device.peak_memory_error == pytest.approx(0, abs=0.02), device
    unposted = replace(measured.meta, extra={**measured.meta.extra, "recv_window": 0})
    assert min(d.peak_memory_error for d in compare(predict_measured(unposted, dag_profile), measured).devices) < -0.1


def test_the_trace_records_the_stage_bounds_the_run_cut_at():
    """A run without explicit bounds is cut evenly; the trace says where, so its prediction cuts the same."""
    measured = run_in_process(RunSpec(build("1f1b", 2, 2, 1), "mlp", {"layers": 3, "width": 8}, heldout=False)).trace
    assert measured.meta.extra["bounds"] == [0, 2, 4]  # 3 blocks and the classifier


def test_cuda_without_a_gpu_is_refused_before_any_rank_starts(tmp_path, monkeypatch):
    """As calibrate refuses it (calibrate/measure.py resolve_device): one line naming the flag to give instead,
    before the ranks start (it was the transport's "device 'cuda' asked for", under the progress bar)."""
    import torch

    from pipesim.executor import runners

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(runners, "run_multiprocess", lambda *_, **__: pytest.fail("ranks started"))
    code, out, err = pipesim("run", "-s", "1f1b", "--model", "mlp", "--device", "cuda", "--trace", "t.json")
    assert code == 2 and out == "" and err.startswith("error: no CUDA device: torch ") and err.endswith(
        "sees no GPU; use --device cpu\n"), err
    assert list(tmp_path.iterdir()) == []


def test_nccl_on_cpu_ranks_is_refused_before_any_rank_starts(tmp_path, monkeypatch):
    """NCCL sends GPU tensors only: one line naming --backend and --device, before the ranks start (it was the
    transport's "backend 'nccl' sends GPU tensors only", after the progress bar)."""
    from pipesim.executor import runners

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(runners, "run_multiprocess", lambda *_, **__: pytest.fail("ranks started"))
    code, out, err = pipesim("run", "-s", "1f1b", "--model", "mlp", "--backend", "nccl", "--trace", "t.json")
    assert code == 2 and out == "" and err == ("error: --backend nccl sends GPU tensors only: with --device cpu use "
                                               "--backend gloo or auto; on a GPU, --device cuda\n"), err
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(("replicas", "pipelines", "shown"), [
    (1, 2, "4 mini-batches of 2 pipelines x 4 x 8 samples, 2 ranks over"),
    (2, 1, "4 mini-batches of 2 replicas x 4 x 8 samples, 4 ranks (p=2, d=2) over"),
    (2, 3, "4 mini-batches of 2 replicas x 3 pipelines x 4 x 8 samples, 4 ranks (p=2, d=2) over")])
def test_the_run_tables_title_names_every_copy_of_the_micro_batches_its_samples_per_s_counts(capsys, replicas,
                                                                                             pipelines, shown):
    """samples/s counts every pipeline's and every replica's micro-batches (`TraceMeta.samples_per_minibatch`), and
    the title names both by one rule (`TraceMeta.batch_copies`): AvgPipe's "4 mini-batches of 4 x 8 samples" at
    923.5 samples/s and 69.30 ms/step was 64 samples a step, P = 2 pipelines of 4 x 8, the pipelines left out."""
    from types import SimpleNamespace

    from pipesim.commands.run import _print_table

    trace = run("avgpipe", 2, 4, 4, comm=0.1).trace
    meta = replace(trace.meta, microbatch_size=8, pipelines=pipelines,
                               params={**trace.meta.params, "data_parallel": replicas},
                               hardware={"ranks": 2 * replicas, "transport": "gloo", "device": "cpu"},
                               extra={"optimizer": "sgd", "lr": 0.05, "dtype": "float32"})
    assert meta.samples_per_minibatch == replicas * pipelines * 4 * 8
    summary = SimpleNamespace(devices=[SimpleNamespace(peak_memory_mb=1.0)] * (2 * replicas),
                              time_per_minibatch_ms=69.3, samples_per_s=923.5)
    _print_table(SimpleNamespace(trace=replace(trace, meta=meta), losses=[[2.0, 1.0]]), summary, None,
                 None)
    assert f"avgpipe measured: {shown} gloo (cpu)" in " ".join(capsys.readouterr().out.split())


@pytest.mark.parametrize(("first", "shown"), [(2.443, "2.443"), (2469.0, "2,469"), (2.47e8, "2.47e+08"),
                                               (0.0004, "<0.001")])
def test_the_run_table_writes_each_loss_to_a_thousandth_as_the_study_does(capsys, first, shown):
    """The table's losses are written as the study's table and page write them (metrics.loss_text), to a
    thousandth: four significant digits wrote "0.6890" and "0.4590" here, "0.614" there; a diverging run's 2469
    is whole, its 2.47e8 in powers of ten, and a loss trained near zero "<0.001", not "0.000"."""
    from types import SimpleNamespace

    from pipesim.commands.run import _print_table
    from pipesim.traces.trace import TraceMeta

    meta = TraceMeta("measured", "xpipe", {}, microbatches=4, minibatches=50, pipelines=1, microbatch_size=8,
                     placement=[0, 1], stage_edges=[[0, 1]], policy={}, tool="pipesim",
                     hardware={"ranks": 2, "transport": "gloo", "device": "cpu"},
                     extra={"optimizer": "sgd", "lr": 0.05, "dtype": "float32",
                            "heldout": {"loss": 0.45903468, "accuracy": 0.8333}})
    summary = SimpleNamespace(devices=[SimpleNamespace(peak_memory_mb=21.1), SimpleNamespace(peak_memory_mb=15.4)],
                              time_per_minibatch_ms=17.95, samples_per_s=1783.0)
    _print_table(SimpleNamespace(trace=SimpleNamespace(meta=meta), losses=[[first, 0.68904]]), summary, None, None)
    row = capsys.readouterr().out.splitlines()[3].split()
    assert row[2:8] == [shown, "->", "0.689", "0.459", "/", "83.3%"]


def test_run_takes_the_gpt_sizes_calibrate_takes(tmp_path):
    """`run --model gpt --heads 4` said "has no option --heads": the docs' small gpt ran only through a profile
    (a new user's pass). The sizes reach the model, and a profile's are held against them."""
    code, _, err = pipesim("run", "-s", "1f1b", "--model", "gpt", "--layers", 2, "--width", 64, "--heads", 3)
    assert (code, err) == (2, "error: --width: give a multiple of --heads 3 (got 64)\n")
    code, _, err = pipesim("run", "-s", "1f1b", "--profile", GPT_CPU, "--heads", 8, "-n", 1)
    assert code == 2 and "--heads 8: the profile" in err and "was calibrated with heads 4" in err, err


def test_a_run_piped_to_a_file_says_how_far_it_is(tmp_path, monkeypatch):
    """Piped, run printed nothing until its table: 44 s of an empty stderr for 64 replicas (a new user's pass)."""
    monkeypatch.setattr("pipesim.commands.tables.PIPED_EVERY_S", 0.0)
    code, out, err = pipesim("run", "--schedule", "1f1b", *SMALL_MLP, "--stages", 2, "--microbatches", 2,
                             "--minibatches", 3)
    said = [line for line in err.splitlines() if line.startswith("run: ")]
    assert code == 0 and said and all(re.fullmatch(r"run: [0-3]/3 mini-batches(, loss [\d.e+-]+)?", line)
                                      for line in said) and said[-1].startswith("run: 3/3"), err
    code, out, err = pipesim("run", "--schedule", "1f1b", *SMALL_MLP, "--stages", 2, "--microbatches", 2,
                             "--minibatches", 3, "--json")
    assert code == 0 and "run: " not in err and json.loads(out)  # --json: its document alone
