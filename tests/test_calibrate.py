"""Calibration: measuring models into profiles, partitioning them, and simulating from them (CPU only,
except the tests that skip without CUDA)."""

import itertools
import json
import math
import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pipesim.profiles.linkfit import LinkFit, LinkPoint, LinkPoints, LinkSegment
from pipesim.profiles.partition import LayerCost, PartitionError, partition, stage_memory_bytes
from pipesim.profiles.schema import boundary_held_bytes, load_profile, profile_json, stage_edges, stages_for
from pipesim.schedules import Kind, ScheduleParams, build_schedule
from pipesim.sim import Link
from tests.conftest import at_columns, pipesim, pipesim_fresh, simulate_json, stage_ms

WIDTH, BATCH = 64, 4  # a 3-block MLP of width 64 on micro-batches of 4: layer sizes are known in closed form
MLP = ["--model", "mlp", "--layers", "3", "--width", str(WIDTH), "--microbatch-size", str(BATCH), "--device", "cpu",
       "--repeats", "5", "--warmup", "1"]
FLOAT = 4
LAYERS_ONLY = ("--no-links", "--no-runtime", "--no-contention")  # the layers alone: the other probes take seconds


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def mlp_profile(tmp_path_factory):
    path = tmp_path_factory.mktemp("mlp") / "mlp.json"
    assert pipesim("calibrate", *MLP, "--stages", "2", *LAYERS_ONLY, "--out", path).code == 0
    return path


@pytest.mark.slow
def test_calibrate_end_to_end_with_links(tmp_path, monkeypatch):
    """Every probe on, printed at 80 columns: its tables never cut a number nor run past the width."""
    at_columns(monkeypatch, 80)
    out = tmp_path / "p.json"
    code, printed, err = pipesim("calibrate", *MLP, "--stages", "2", "--link-max-mb", "0.0625", "--out", out)
    assert code == 0, err
    assert "…" not in printed and max(map(len, printed.splitlines())) <= 80, printed
    profile = load_profile(out)
    env = profile.environment
    assert (env.device, env.dtype, env.microbatch_size, env.torch_version) == ("cpu", "float32", BATCH,
                                                                              torch.__version__)
    assert [layer.name for layer in profile.layers] == ["0:Sequential", "1:Sequential", "2:Sequential", "3:Linear"]
    assert profile.partition.stages == 2 and profile.partition.bounds[0] == 0 and profile.partition.bounds[-1] == 4

    first, second, _, head = profile.layers
    block_params = (WIDTH * WIDTH + WIDTH) * FLOAT
    assert first.param_bytes == first.grad_bytes == block_params
    assert first.optimizer_state_bytes["sgd"] == 0
    assert first.optimizer_state_bytes["momentum"] == block_params
    assert first.optimizer_state_bytes["adam"] >= 2 * block_params
    # Linear keeps its input, ReLU its output; the next Linear keeps that same output as its input.
    assert first.activation_bytes == 2 * BATCH * WIDTH * FLOAT
    assert (first.shared_with_previous_bytes, second.shared_with_previous_bytes) == (0, BATCH * WIDTH * FLOAT)
    assert first.output_bytes == BATCH * WIDTH * FLOAT and head.output_bytes == 0
    # Times are only checked to be there (the schema keeps them >= 0); how they compare with one another is
    # up to the machine's load. Forwards run before the full and before the split backward: twice a repeat.
    for layer in profile.layers:
        assert [t.repeats for t in (layer.fwd, layer.bwd, layer.igrad, layer.wgrad)] == [10, 5, 5, 5]
        assert layer.fwd.median_ms > 0 and layer.wgrad.median_ms > 0
    assert all(layer.igrad.median_ms > 0 for layer in profile.layers[1:])
    # A stage's times are its rows timed as one pass, as the executor runs them (forwards before the full
    # and before the split backward, but in the first stage, whose I computes nothing and whose W is B's own
    # autograd call: one forward, I and B a repeat); the layers' sums are what `stages_for` scales on another cut.
    stage = profile.stages[0]
    passes = stage.passes
    assert [t.repeats for t in (passes.fwd, passes.bwd, passes.igrad, passes.wgrad)] == [5, 5, 5, 5]
    assert passes.wgrad == passes.bwd and profile.stages[1].passes.fwd.repeats == 10
    assert (stage.fwd_ms, stage.bwd_ms, stage.igrad_ms, stage.wgrad_ms) == tuple(
        t.median_ms for t in (passes.fwd, passes.bwd, passes.igrad, passes.wgrad))
    # The first stage sends no input gradient: its split backward's input half has nothing to walk.
    assert stage.igrad_ms < stage.wgrad_ms / 4 and stage.bwd_ms > 0
    assert 0 < profile.stages[1].wgrad_fraction < 1
    assert all(stage.steps[name].step.median_ms > 0 for name in ("sgd", "momentum", "adam", "adamw"))

    # The executor's own costs, from two ranks running the probe model: every compute kind, a send, a receive;
    # its update keeps the last gradient on the weights (a memory count, not a time: exactly one).
    runtime = profile.runtime
    assert set(runtime.compute_ms) == {"F", "B", "I", "W", "OPT"} and runtime.send_ms.repeats > 0
    assert {"F", "B", "RECV_F", "SEND_B"} <= set(runtime.gap_ms)
    assert runtime.kept_gradients == 1.0
    assert runtime.meta["threads_per_rank"] == env.threads == 1 and runtime.meta["schedules"] == ["1f1b", "zb-h1"]
    assert runtime.meta["host_times_from"] == "the calibrated model"  # its gaps and sends, after its own compute
    assert "runtime per row, us: compute F" in printed
    # contention is measured in the ranks of that run, before it: one start-up for both
    assert profile.contention.meta["processes_started"] == "the ranks of the run it preceded"
    phases = [line.split(" ... ")[0] for line in err.splitlines() if " ... " in line]
    contention = phases.index("measuring contention in the run's 2 ranks, before it")
    assert phases[contention + 1].startswith("running the calibrated model (2 ranks, ")
    assert phases[contention + 1].endswith("; contention measured in its ranks first)")

    assert [p.nbytes for p in profile.link.points] == [4096, 8192, 16384, 32768, 65536]
    assert profile.link.segments and profile.link.meta["backend"] == "gloo"
    assert len(profile.allreduce.points) == 5 and profile.allreduce.world_size == 2
    assert "fwd ms" in printed and "p2p link fit (gloo, cpu)" in printed and "all-reduce (2 ranks)" in printed


def _brute_force(layers, p, cap):
    """The least slowest-stage time over every split that fits, or None."""
    n, best = len(layers), None
    for cuts in itertools.combinations(range(1, n), p - 1):
        bounds = [0, *cuts, n]
        spans = list(zip(bounds, bounds[1:]))
        if cap is not None and any(stage_memory_bytes(layers, a, b, k, p) > cap for k, (a, b) in enumerate(spans)):
            continue
        slowest = max(stage_ms(layers, a, b) for a, b in spans)
        best = slowest if best is None else min(best, slowest)
    return best


layer_costs = st.builds(LayerCost, st.floats(0, 100, allow_nan=False), st.integers(0, 50), st.integers(0, 20),
                        st.integers(0, 5))


@settings(max_examples=300, deadline=None)
@given(layers=st.lists(layer_costs, min_size=1, max_size=8), data=st.data())
def test_partition_is_optimal_against_brute_force(layers, data):
    p = data.draw(st.integers(1, len(layers)))
    cap = data.draw(st.none() | st.integers(0, 250))
    best = _brute_force(layers, p, cap)
    if best is None:
        with pytest.raises(PartitionError, match="no split"):
            partition(layers, p, cap)
        return
    bounds = partition(layers, p, cap)
    spans = list(zip(bounds, bounds[1:]))
    assert len(spans) == p and bounds[0] == 0 and bounds[-1] == len(layers) and all(a < b for a, b in spans)
    assert max(stage_ms(layers, a, b) for a, b in spans) == best
    assert cap is None or all(stage_memory_bytes(layers, a, b, k, p) <= cap for k, (a, b) in enumerate(spans))


def test_partition_memory_model_counts_1f1b_in_flight_activations():
    layers = [LayerCost(1.0, 100, 10, 0), LayerCost(1.0, 100, 10, 4)]
    assert stage_memory_bytes(layers, 0, 2, 0, 3) == 200 + 3 * (20 - 4)  # shared bytes count once
    assert stage_memory_bytes(layers, 0, 2, 2, 3) == 200 + 1 * (20 - 4)  # the last stage holds one micro-batch
    with pytest.raises(PartitionError, match="3 stages but the model has 2 layers"):
        partition(layers, 3)


def test_profile_round_trips(mlp_profile):
    text = mlp_profile.read_text()
    profile = load_profile(mlp_profile)
    assert profile_json(profile) == text
    again = mlp_profile.with_name("again.json")
    again.write_text(profile_json(profile))
    assert load_profile(again) == profile


def test_repeated_calibration_measures_the_same_sizes(mlp_profile, tmp_path):
    """Sizes do not depend on the machine's load: a second run must give them exactly. (Its times may differ
    by any factor on a shared machine, so they are not compared.)"""
    out = tmp_path / "again.json"
    assert pipesim("calibrate", *MLP, "--stages", "2", *LAYERS_ONLY, "--out", out).code == 0
    first, second = load_profile(mlp_profile), load_profile(out)
    sizes = {"name", "inputs", "activation_bytes", "shared_with_previous_bytes", "output_bytes", "param_bytes",
             "grad_bytes", "optimizer_state_bytes"}
    assert [layer.model_dump(include=sizes) for layer in first.layers] == [
        layer.model_dump(include=sizes) for layer in second.layers]
    moment = {"date", "load"}  # when, and the host's load then
    assert first.environment.model_dump(exclude=moment) == second.environment.model_dump(exclude=moment)


def test_calibration_runs_at_the_given_threads_and_times_the_gradient_accumulation(mlp_profile, tmp_path):
    profile = load_profile(mlp_profile)
    assert profile.schema_version == 2 and profile.environment.threads == 1  # the default: a rank's one thread
    assert profile.runtime is None  # --no-runtime
    assert all(stage.accumulate.median_ms > 0 and stage.accumulate.repeats == 5 for stage in profile.stages)
    assert all(stage.weight_copy.median_ms > 0 and stage.weight_copy.repeats == 5 for stage in profile.stages)
    out = tmp_path / "two.json"
    code, _, err = pipesim("calibrate", *MLP, "--threads", "2", *LAYERS_ONLY, "--out", out)
    assert code == 0 and load_profile(out).environment.threads == 2
    # a line per phase on stderr, though it is not a terminal here
    phases = [line.split(" ... ")[0] for line in err.splitlines() if " ... " in line]
    assert phases == ["timing layers (4)", "timing stages as one pass (2)",
                      "timing updates, predictions, averaging (2 stages, 4 optimizers)",
                      "fitting the device's efficiency curve to the layers"]
    assert torch.get_num_threads() == 1  # this process's count is given back


def test_simulate_with_a_profile(mlp_profile):
    profile = load_profile(mlp_profile)
    gpipe, xpipe = simulate_json("--profile", str(mlp_profile), "-s", "gpipe", "-s", "xpipe", "-m", "4",
                                 "--minibatches", "1")
    assert len(gpipe["devices"]) == profile.partition.stages  # --stages defaults to the profile's
    # Four forwards and backwards and the update; the backwards were timed as one pass adding into the
    # gradient buffer, as three of the four do, so no accumulation comes on top.
    assert all(stage.passes is not None for stage in profile.stages)
    for device, stage in zip(gpipe["devices"], profile.stages):
        compute = 4 * (stage.fwd_ms + stage.bwd_ms) + stage.steps["adam"].step.median_ms
        assert device["busy_ms"] == pytest.approx(compute)
        assert device["peak_memory_mb"] * 2**20 >= stage.param_bytes * 2 + stage.optimizer_state_bytes["adam"]
    order = build_schedule("xpipe", ScheduleParams(2, 4)).orders
    for device, stage, actions in zip(xpipe["devices"], profile.stages, order):  # bellwether predictions
        compute = 4 * (stage.fwd_ms + stage.bwd_ms) + stage.steps["adam"].step.median_ms
        predictions = sum(action.kind is Kind.PRED for action in actions)
        assert predictions and device["busy_ms"] == pytest.approx(
            compute + predictions * stage.steps["adam"].predict.median_ms)
    assert gpipe["samples_per_s"] == pytest.approx(4 * BATCH / gpipe["time_per_minibatch_ms"] * 1e3)

    (sgd,) = simulate_json("--profile", str(mlp_profile), "-s", "gpipe", "-m", "4", "--minibatches", "1",
                           "--optimizer", "sgd")
    first = profile.stages[0]
    assert sgd["devices"][0]["busy_ms"] == pytest.approx(
        4 * (first.fwd_ms + first.bwd_ms) + first.steps["sgd"].step.median_ms)

    # Other stage counts re-partition the layers: p = 3 devices, or 4 model stages for zb-v's two chunks.
    (three,) = simulate_json("--profile", str(mlp_profile), "-s", "1f1b", "-p", "3", "-m", "6")
    (zbv,) = simulate_json("--profile", str(mlp_profile), "-s", "zb-v", "-m", "6")
    assert len(three["devices"]) == 3 and len(zbv["devices"]) == 2 and len(zbv["stages"]) == 4
    total_ms = sum(layer.fwd.median_ms + layer.bwd.median_ms for layer in profile.layers)
    assert sum(d["busy_ms"] for d in three["devices"]) >= 6 * total_ms * (1 - 1e-9)


def test_simulate_uses_the_profile_link(mlp_profile, tmp_path):
    doc = json.loads(mlp_profile.read_text())
    without = simulate_json("--profile", str(mlp_profile), "-s", "gpipe", "-m", "2")[0]["makespan_ms"]
    doc["link"] = {"segments": [{"min_bytes": 0, "latency_ms": 5.0, "bytes_per_ms": 1e6}],
                   "points": [{"nbytes": 4096, "ms": 5.004, "spread_ms": 0.0}], "meta": {}}
    doc["allreduce"] = {"world_size": 2, "points": [], "meta": {}}
    linked = tmp_path / "linked.json"
    linked.write_text(json.dumps(doc))
    (result,) = simulate_json("--profile", str(linked), "-s", "gpipe", "-m", "2")
    # Two stages: at least the first forward's and the last backward's transfers sit on the critical path.
    assert result["makespan_ms"] >= without + 2 * 5.0
    code, _, err = pipesim("simulate", "--profile", linked, "--comm", "1")
    assert code == 2 and "--comm: the profile" in err
    assert pipesim("simulate", "--profile", mlp_profile, "-s", "1f1b", "--comm", "1").code == 0  # no link measured


def test_link_segments_match_the_fit():
    fit = LinkFit((LinkSegment(0, 0.1, 1e3), LinkSegment(5000, 0.05, 1e5), LinkSegment(200_000, 1.0, 5e5)))
    link = Link(segments=tuple((s.min_bytes, s.latency_ms, s.bytes_per_ms) for s in fit.segments))
    for nbytes in (1, 4096, 4999, 5000, 5001, 150_000, 199_999, 200_000, 10**8):
        assert link.transfer_ms(nbytes) == fit.ms(nbytes)


def test_two_branch_profile_gives_graphpipe_its_dag(tmp_path):
    out = tmp_path / "tb.json"
    assert pipesim("calibrate", "--model", "two-branch", "--layers", "1", "--width", "8", "--microbatch-size", "2",
                   "--stages", "4", "--device", "cpu", *LAYERS_ONLY, "--repeats", "3", "--out",
                   out).code == 0
    profile = load_profile(out)
    assert [layer.inputs for layer in profile.layers] == [[-1], [0], [0], [1, 2]]  # stem, branch a, b, merge
    assert stage_edges(profile.layers, profile.partition.bounds) == [(0, 1), (0, 2), (1, 3), (2, 3)]
    # As a chain, stage 1 (branch a) must pass the stem's output on to branch b; as a DAG it does not.
    chain, dag = stages_for(profile, profile.partition.bounds), stages_for(profile, profile.partition.bounds, dag=True)
    stem, a = profile.layers[0].output_bytes, profile.layers[1].output_bytes
    assert (chain[1].output_bytes, dag[1].output_bytes) == (a + stem, a)
    # What autograd saves of the boundary: the stem ends in a max-pool (its output is not saved), each branch
    # starts with a conv (its input is) and ends with a ReLU (its output is), the merge concatenates (saves
    # neither input) and ends in a Linear (its output, the logits, is not saved).
    b = profile.layers[2].output_bytes
    assert [layer.output_saved for layer in profile.layers] == [False, True, True, False]
    assert [layer.saved_input_bytes for layer in profile.layers[1:3]] == [[stem], [stem]]
    assert profile.layers[3].saved_input_bytes == [0, 0]
    # So the runtime holds the stem's sent output and the merge's received inputs from F to backward; a chain
    # also passes branch a's output through branch b's stage.
    assert [s.held_bytes for s in dag] == [stem, 0, 0, a + b]
    assert [s.held_bytes for s in chain] == [stem, 0, a, a + b]
    older = [layer.model_copy(update={"output_saved": None}) for layer in profile.layers]  # not recorded
    assert boundary_held_bytes(older, profile.partition.bounds, dag=True) == [None] * 4
    # Whether the branches side by side beat the chain depends on the measured times here; with fixed costs,
    # tests/test_catalogue.py checks it (test_graphpipe_branches_beat_the_same_stages_in_a_chain).
    (graphpipe,) = simulate_json("--profile", out, "-s", "graphpipe", "-m", "4")
    assert len(graphpipe["stages"]) == 4 and len(graphpipe["devices"]) == 4


def test_bring_your_own_model(tmp_path, monkeypatch):
    (tmp_path / "byo_calibration_model.py").write_text(
        "from torch import nn\n"
        "def build():\n    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))\n"
        "layers = [nn.Conv2d(3, 4, 3), nn.Flatten(), nn.Linear(4 * 30 * 30, 2)]\n")
    monkeypatch.chdir(tmp_path)
    for attribute, count in (("build", 3), ("layers", 3)):
        out = tmp_path / f"{attribute}.json"
        assert pipesim("calibrate", "--model", f"byo_calibration_model:{attribute}", "--stages", "2", "--device",
                       "cpu", *LAYERS_ONLY, "--repeats", "3", "--out", out).code == 0
        assert len(load_profile(out).layers) == count


def test_a_model_whose_backward_fails_is_one_line(tmp_path, monkeypatch):
    (tmp_path / "byo_broken_backward.py").write_text(
        "import torch\nfrom torch import nn\n"
        "class Refuse(torch.autograd.Function):\n"
        "    @staticmethod\n    def forward(ctx, x):\n        return x.clone()\n"
        "    @staticmethod\n    def backward(ctx, grad):\n        raise ValueError('no gradient here')\n"
        "class Layer(nn.Linear):\n    def forward(self, x):\n        return Refuse.apply(super().forward(x))\n"
        "layers = [nn.Linear(8, 8), Layer(8, 8), nn.Linear(8, 2)]\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.delattr(torch, "OutOfMemoryError", raising=False)  # as torch < 2.5, which pyproject.toml allows
    code, _, err = pipesim("calibrate", "--model", "byo_broken_backward:layers", "--no-links", "--out",
                           tmp_path / "p.json")
    assert code == 2 and "no gradient here" in err and err.strip().count("\n") == 0
    assert not (tmp_path / "p.json").exists()


def test_dtype_sets_the_bytes(tmp_path):
    out = tmp_path / "bf16.json"
    assert pipesim("calibrate", *MLP, "--dtype", "bfloat16", *LAYERS_ONLY, "--out", out).code == 0
    profile = load_profile(out)
    assert profile.environment.dtype == "bfloat16"
    assert profile.layers[0].param_bytes == (WIDTH * WIDTH + WIDTH) * 2


def test_simulate_with_a_profile_never_imports_torch(mlp_profile):
    (done,), imported = pipesim_fresh(("simulate", "--profile", mlp_profile, "-s", "1f1b", "--json"))
    assert done.code == 0 and "torch" not in imported, done.err


CUDA = torch.cuda.is_available()


@pytest.mark.parametrize("args,fragment", [
    (["--model", "nope"], "--model: unknown 'nope'; choose from mlp, cnn, gpt, two-branch"),
    (["--model", "no_such_package.models:net"], "cannot import no_such_package.models"),
    (["--model", "math:pi"], "expected a torch.nn.Sequential"),
    (["--model", "math:nothing_here"], "module math has no attribute 'nothing_here'"),
    pytest.param(["--model", "mlp", "--device", "cuda"], "no CUDA device: torch",
                 marks=pytest.mark.skipif(CUDA, reason="a GPU is present")),
    (["--model", "mlp", "--layers", "2", "--stages", "5"],
     "--stages 5: mlp of 2 blocks (--layers) has 3 layers in all; give at most 3 stages"),
    ([*MLP, "--memory-gb", "1e-6"], "no split of 4 layers into 2 stages fits"),
    # not 0 GiB
    ([*MLP, "--memory-gb", "1e-300"], "--memory-gb: give GiB per device, from 1 byte to 1,048,576 GiB (got 1e-300)"),
    (["--model", "mlp", "--heads", "2"], "--heads does not apply to mlp"),
    (["--model", "gpt", "--width", "30", "--heads", "4"], "--width: give a multiple of --heads 4 (got 30)"),
    (["--model", "mlp", "--dtype", "float64"],
     "--dtype: choose from fp32, bf16, fp16, float32, bfloat16, float16 (got 'float64')"),
    (["--model", "mlp", "--link-max-mb", "0.001"], "--link-max-mb: give from 8 KiB"),
    (["--model", "mlp", "--link-max-mb", "0.005"], "two sizes to fit a line"),
    (["--model", "mlp", "--width", "600000", "--no-links"], "mlp does not fit in memory"),
    (["--model", "mlp", "--no-links", "--link-max-mb", "1"], "--no-links skips"),
    (["--model", "mlp", "--no-contention", "--ranks", "3"], "--no-contention skips"),
    (["--model", "mlp", "--threads", str(10**12)], "--threads: give 1"),  # torch overflowed; "to N" past 1 core
    (["--model", "mlp", "--passes-as", "pipe"], "--passes-as: choose from executor, torch (got 'pipe')"),
    (["--model", "mlp", "--passes-as", "torch", "--runtime"], "leave it out with --passes-as torch"),
])
def test_bad_calibrate_input_is_one_line_exit_2_nothing_written(tmp_path, args, fragment):
    code, _, err = pipesim("calibrate", *args, "--out", tmp_path / "p.json")
    assert code == 2
    assert fragment in err
    assert "Traceback" not in err and err.strip().count("\n") == 0
    assert list(tmp_path.iterdir()) == []  # no profile, no temporary file


def test_the_mlp_built_on_the_meta_device_imports_no_compiler_for_its_initialisation():
    """calibrate, run and study check that the weights fit in host memory by building the model on the meta device
    first, where the mlp's He initialisation ran normal_'s Python reference: its first call imported torch's compiler
    (842 modules, 1.8 s; all of the check where no forward follows it there, as on a GPU)."""
    probe = ("import sys, torch; from pipesim.workload.models import build_model\n"
             "with torch.device('meta'): model = build_model('mlp')\n"
             "print(model.layers[0][0].weight.is_meta, 'torch._dynamo' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert done.stdout.split() == ["True", "False"], done.stderr


def test_a_bad_flag_is_refused_before_the_processes_server_starts_or_torch_is_imported(tmp_path):
    """calibrate started its processes' server (its own process, importing torch) and waited out its load window
    before it read a flag, and imported torch before --dtype, --optimizer, --device or a probe's flags: a mistyped
    flag took seconds to refuse on a busy host. Every flag that needs nothing started is read first."""
    bad = [["--model", "mpl"], ["--dtype", "float64"], ["--optimizer", "lion"], ["--memory-gb", "1e-300"],
           ["--threads", "0"], ["--link-max-mb", "0.001"], ["--no-contention", "--ranks", "3"],
           ["--passes-as", "pipe"], ["--passes-as", "torch", "--runtime"], ["--device", "gpu"]]
    runs, imported = pipesim_fresh(*(("calibrate", *([] if "--model" in flags else ["--model", "mlp"]), *flags,
                                      "--out", tmp_path / "p.json") for flags in bad), cwd=tmp_path)
    assert [(done.code, done.err.count("\n")) for done in runs] == [(2, 1)] * len(bad), runs
    # each for its own flag, not another refusal's (the --trace or --out check, a missing --profile)
    assert all(any(str(flag) in done.err for flag in flags if str(flag).startswith("--"))
               for flags, done in zip(bad, runs)), runs
    assert not {"torch", "multiprocessing.forkserver"} & imported and not list(tmp_path.iterdir())


@pytest.mark.parametrize(("usable", "host", "line"), [
    # it was "give 1 to 1, the cores this host lets pipesim use"
    (1, 1, "give 1 (got 2): pipesim may run on this host's 1 core, "),
    # a container's or taskset's share: the host's 64 cores are not what bounds it
    (1, 64, "give 1 (got 2): pipesim may run on 1 of this host's 64 cores (its CPU affinity), "),
    (4, 64, "give 1 to 4 (got 5): pipesim may run on 4 of this host's 64 cores (its CPU affinity), "),
])
def test_threads_past_the_usable_cores_say_how_many_are_allowed_and_why(tmp_path, monkeypatch, usable, host, line):
    """More threads than cores take turns on them: the profile's T threads would be timed at fewer cores' speed."""
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(usable)), raising=False)
    monkeypatch.setattr(os, "cpu_count", lambda: host)
    code, _, err = pipesim("calibrate", "--model", "mlp", "--threads", usable + 1, "--no-links", "--no-runtime",
                           "--no-contention", "--out", tmp_path / "p.json")
    assert (code, err) == (2, f"error: --threads: {line}and more threads than cores take turns on them, timed at "
                              "fewer cores' speed\n")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(("command", "flag"), [("calibrate", "--threads"), ("run", "--threads-per-rank")])
def test_the_thread_flags_help_says_the_bound_the_command_refuses_past(command, flag):
    """The help said "Torch threads per rank.", and the first the user heard of the cores' bound was a refusal."""
    code, out, err = pipesim(command, "--help")
    words = " ".join(out.split())
    assert code == 0 and f"{flag} T " in words, err
    assert "at most the cores pipesim may run on." in words.split(f"{flag} T ")[1].split("[default:")[0]


def _edited(mlp_profile, tmp_path, edit):
    doc = json.loads(mlp_profile.read_text())
    edit(doc)
    path = tmp_path / "edited.json"
    path.write_text(json.dumps(doc))
    return path


@pytest.mark.parametrize("edit,fragment", [
    (lambda d: d.update(schema_version=3), "schema_version 3 is not supported (this pipesim reads versions 1, 2)"),
    (lambda d: d["stages"][0].update(accumulate={"median_ms": -1, "spread_ms": 0, "repeats": 1}),
     "stages.0.accumulate.median_ms: Input should be greater than or equal to 0"),
    (lambda d: d.pop("schema_version"), "schema_version: missing"),
    (lambda d: d["layers"][0]["fwd"].pop("median_ms"), "layers.0.fwd.median_ms: missing: give a number"),
    (lambda d: d.pop("environment"), "environment: missing: give an object"),
    (lambda d: d["partition"].update(bounds=[0, 9]), "partition.bounds must rise strictly from 0 to 4"),
    (lambda d: d["layers"][1]["optimizer_state_bytes"].update(sgd=d["layers"][1]["optimizer_state_bytes"]["adam"] + 1),
     "layers.1.optimizer_state_bytes: sgd's is the master copy of the weights alone, part of every optimizer's"),
    (lambda d: d.update(link={"segments": [{"min_bytes": 8192, "latency_ms": 0.1, "bytes_per_ms": 1e6},
                                           {"min_bytes": 0, "latency_ms": 0.1, "bytes_per_ms": 1e6}],
                              "points": [], "meta": {}}), "min_bytes must rise"),
])
def test_bad_profile_is_one_line_naming_the_field(mlp_profile, tmp_path, edit, fragment):
    code, _, err = pipesim("simulate", "--profile", _edited(mlp_profile, tmp_path, edit), "-s", "1f1b")
    assert code == 2 and fragment in err and err.strip().count("\n") == 0 and "Traceback" not in err


@pytest.mark.parametrize("args,fragment", [
    (["--fwd", "1", "--output-mb", "2"], "--fwd, --output-mb: the profile"),
    (["-p", "9"], "the schedule's 9 model stages (--stages x --chunks): the profile's mlp of 3 blocks has 4 layers"),
    (["--profile-typo"], "has no option --profile-typo (did you mean '--profile'?)"),
])
def test_simulate_refuses_flags_the_profile_fixes(mlp_profile, args, fragment):
    code, _, err = pipesim("simulate", "--profile", mlp_profile, "-s", "1f1b", *args)
    assert code == 2 and fragment in err and err.strip().count("\n") == 0


def test_unreadable_profile_file(tmp_path):
    """A missing, non-JSON or non-UTF-8 profile is one line naming --profile (files.py `read_json`)."""
    path = tmp_path / "p.json"
    code, _, err = pipesim("simulate", "--profile", path)
    assert code == 2 and err.startswith(f"error: --profile: cannot read profile {path}: ") and err.count("\n") == 1
    path.write_text("{")
    code, _, err = pipesim("simulate", "--profile", path)
    assert code == 2 and err.startswith(f"error: --profile: profile {path} is not valid JSON: ")
    assert err.count("\n") == 1
    path.write_bytes(b"\xab\xcd")
    code, _, err = pipesim("simulate", "--profile", path)
    assert code == 2 and err == f"error: --profile: profile {path} is not a text (UTF-8) file\n"


@pytest.mark.slow
@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
def test_calibrate_on_cuda(tmp_path):
    out = tmp_path / "gpu.json"
    assert pipesim("calibrate", *[a if a != "cpu" else "cuda" for a in MLP], "--link-max-mb", "1", "--out",
                   out).code == 0
    profile = load_profile(out)
    assert profile.environment.device == "cuda" and profile.environment.cuda_version
    assert all(layer.fwd.median_ms > 0 for layer in profile.layers)
    assert not math.isnan(profile.link.segments[0].latency_ms)


@pytest.mark.parametrize("model_name, options, bounds", [("mlp", {"layers": 3, "width": 8}, [0, 1, 3, 4]),
                                                         ("mlp", {"layers": 3, "width": 8}, [0, 3, 4]),
                                                         ("two-branch", {"layers": 1, "width": 4}, [0, 1, 3, 4])])
def test_stage_runs_compute_each_stages_rows_on_the_weights_put_in_place(model_name, options, bounds):
    """Stage passes and the pass a step is timed after are `stage_runs`: each stage's F and B on the weights
    put in its place (so what it leaves in cache is what a step reads), adding into one gradient buffer as a
    mini-batch's micro-batches do; I then W add the same gradient as B."""
    from pipesim.calibrate.measure import Settings, measure_bytes
    from pipesim.calibrate.passes import stage_runs
    from pipesim.workload.models import build_model

    torch.manual_seed(0)
    model = build_model(model_name, **options)
    measure_bytes(model, Settings(torch.device("cpu"), torch.float64, 3, warmup=0, repeats=1))
    runs = stage_runs(model, bounds, "float64", 3)
    assert [run.received for run in runs][0] == [False] and all(any(run.received) for run in runs[1:])
    for run in runs:
        own = [p for p in run.module.parameters()]
        run.weights = [p.detach().clone().mul_(2.0).requires_grad_(True) for p in own]  # other weights in place
        run.backward(run.forward())
        run.backward(run.forward())
        # the same by hand: the stage module with those weights, on the same inputs, twice into .grad
        with torch.no_grad():
            for p, w in zip(own, run.weights):
                p.copy_(w)
        for _ in range(2):
            args = [a.detach().requires_grad_(edge) for a, edge in zip(run.args, run.received)]
            out = run.module(*args)
            ends = [run.loss(out)] if run.loss is not None else list(out)
            torch.autograd.backward(ends, [g for g in run.grad_outputs if g is not None] or None, inputs=own)
        for buffer, p, w in zip(run.into, own, run.weights):
            torch.testing.assert_close(buffer, p.grad)
            assert w.grad is None  # the buffer holds them, not the weights
        split = run.into
        run.into = []
        saved = run.backward_weight(run.backward_input(run.forward()))
        run.backward_weight(run.backward_input(run.forward()))
        assert saved[:2] == ([], [])  # I let go of the graph's ends; W starts from what it recorded
        for buffer, full in zip(run.into, split):
            torch.testing.assert_close(buffer, full)


def test_torch_stage_runs_compute_what_the_executor_does_into_grad_as_torchs_stage_does():
    """`calibrate --passes-as torch` times each stage as torch.distributed.pipelining's stage computes it: the
    same gradients as the executor's rows (B, and I then W), added into the module's own `.grad`; a first stage's
    I computes nothing (torch skips it: its W is the whole backward)."""
    from pipesim.calibrate.measure import Settings, measure_bytes
    from pipesim.calibrate.passes import TorchStageRun, stage_runs
    from pipesim.workload.models import build_model

    torch.manual_seed(0)
    model = build_model("mlp", layers=3, width=8)
    measure_bytes(model, Settings(torch.device("cpu"), torch.float64, 3, warmup=0, repeats=1))
    for run in stage_runs(model, [0, 1, 3, 4], "float64", 3):
        theirs, own = TorchStageRun(run), list(run.module.parameters())
        run.backward(run.forward())
        run.backward(run.forward())
        theirs.backward(theirs.forward())
        theirs.backward(theirs.forward())
        for buffer, p, w in zip(run.into, own, run.weights):
            torch.testing.assert_close(p.grad, buffer)
            assert w.grad is None
        full = [p.grad.clone() for p in own]
        saved = theirs.backward_input(theirs.forward())
        assert [torch.equal(p.grad, g) for p, g in zip(own, full)] == [True] * len(own)  # I adds to no weight
        assert (saved[2] is None) == (not run.input_gradients)  # the first stage's I leaves nothing for W
        theirs.backward_weight(saved)
        for p, g in zip(own, full):
            torch.testing.assert_close(p.grad, 1.5 * g)  # a third micro-batch's gradient, as one B adds


def test_passes_as_torch_is_recorded_said_and_leaves_out_the_runtime_probe(tmp_path, mlp_profile):
    """`--passes-as torch` times the stages through `TorchStageRun` and says so, in the profile and the summary;
    the runtime probe, which times pipesim's executor, is left out without --no-runtime."""
    out = tmp_path / "torch.json"
    code, printed, err = pipesim("calibrate", *MLP, "--stages", "2", "--passes-as", "torch", "--no-links",
                                 "--no-contention", "--out", out)
    assert code == 0, err
    profile = load_profile(out)
    assert (profile.environment.passes_as, profile.runtime) == ("torch", None)
    assert all(stage.passes is not None for stage in profile.stages)
    assert "each stage timed as one pass as torch.distributed.pipelining runs it" in " ".join(printed.split())
    assert "as torch runs them" in err  # its phase line
    assert load_profile(mlp_profile).environment.passes_as == "executor"


def test_torch_stage_runs_leave_out_the_executors_functional_call_and_hooks():
    """The executor's rows cost more than torch's stage computing the same: functional_call swaps the weights in
    and its saved-tensor hooks pack every saved tensor, 0.3-0.5 ms a pass on the 2-core CPUs here, so a width-16 MLP
    stage's F + B takes 1.65-1.78x its CPU time under torch's code (medians of interleaved rounds, this thread's
    CPU time: another process's load does not count in it); a profile timing the executor's predicted torch
    runs of small models that much slow."""
    import statistics
    import time

    from pipesim.calibrate.passes import TorchStageRun, stage_runs
    from pipesim.workload.models import build_model

    torch.manual_seed(0)
    runs = stage_runs(build_model("mlp", layers=8, width=16), [0, 4, 9], "float32", 32)

    def cpu_ns(run) -> int:
        start = time.thread_time_ns()
        run.backward(run.forward())
        return time.thread_time_ns() - start

    ratios = [[cpu_ns(run) / cpu_ns(TorchStageRun(run)) for _ in range(25)][3:] for run in runs]
    assert [statistics.median(r) > 1.3 for r in ratios] == [True, True], ratios


def test_a_stage_without_input_gradients_times_its_backward_once_for_b_and_w():
    """The first stage's I computes nothing and its W is B's own autograd call: one sequence times F, I and B
    (W's time), the other stages time B and I then W apart."""
    from pipesim.calibrate.measure import Settings, measure_bytes, measure_passes
    from pipesim.calibrate.passes import stage_runs
    from pipesim.workload.models import build_model

    model = build_model("mlp", layers=3, width=8)
    settings = Settings(torch.device("cpu"), torch.float32, 3, warmup=1, repeats=5)
    measure_bytes(model, settings)
    runs = stage_runs(model, [0, 1, 3, 4], "float32", 3)
    assert [run.input_gradients for run in runs] == [False, True, True]
    runs[0].backward = None  # never called: its backward is timed through W
    passes = measure_passes(runs, settings, lambda what: None, [1.0] * 3)
    assert passes[0].wgrad == passes[0].bwd and passes[0].bwd.median_ms > 0
    assert all(p.wgrad != p.bwd and p.igrad.median_ms > 0 for p in passes[1:])


def test_a_stages_passes_repeat_until_known_to_a_share_of_its_f_plus_b(monkeypatch):
    """A stage whose F + B is large knows its passes after MIN_REPEATS rounds; one with none left to spare (no
    floor either) repeats them to --repeats. The first round is untimed."""
    from pipesim.calibrate import measure
    from pipesim.calibrate.passes import stage_runs
    from pipesim.workload.models import build_model

    model = build_model("mlp", layers=3, width=8)
    settings = measure.Settings(torch.device("cpu"), torch.float32, 3, warmup=2, repeats=8)
    measure.measure_bytes(model, settings)
    runs = stage_runs(model, [0, 2, 4], "float32", 3)
    roomy = measure.measure_passes(runs, settings, lambda what: None, [1e6, 1e6])
    assert {p.bwd.repeats for p in roomy} == {p.igrad.repeats for p in roomy} == {measure.MIN_REPEATS}
    monkeypatch.setattr(measure, "FLOOR_MS", 0.0)
    counted = []
    strict = measure.measure_passes(runs, settings, lambda what: counted.append(what), [0.0, 0.0])
    assert {p.bwd.repeats for p in strict} == {8} and len(counted) == 1 + 8


class _Scaled(torch.nn.Module):
    """A layer whose forward depends on a plain attribute its repr does not show."""

    def __init__(self, scale: float) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(8, 8)
        self.scale = scale

    def forward(self, x):
        return self.linear(x) * self.scale


def test_alike_layers_are_timed_once_and_share_the_times():
    """Layers with the same module tree, tensors and input shapes are timed as the first of them; a different
    child, hyperparameter, shape, plain attribute or input, and the last layer (it adds the loss), are not."""
    from torch import nn

    from pipesim.calibrate.measure import Settings, alike_layers, measure_bytes, measure_times
    from pipesim.workload.models import Model

    def block(activation=nn.ReLU, bias=True, width=8):
        return nn.Sequential(nn.Linear(8, width, bias=bias), activation())

    layers = [nn.Sequential(nn.Linear(4, 8), nn.ReLU()), block(), block(), block(nn.GELU), block(bias=False),
              block(), nn.Sequential(nn.Linear(8, 8), nn.Dropout(0.1)), nn.Sequential(nn.Linear(8, 8), nn.Dropout(0.2)),
              _Scaled(1.0), _Scaled(2.0), _Scaled(1.0), block(width=6), nn.Linear(6, 6)]
    expected = [0, 1, 1, 3, 4, 1, 6, 7, 8, 9, 8, 11, 12]
    model = Model("toy", layers, lambda b, gen: (torch.randn(b, 4, generator=gen), None),
                  lambda out, target: out.square().mean())
    settings = Settings(torch.device("cpu"), torch.float32, 3, warmup=1, repeats=5)
    recording, profiles = measure_bytes(model, settings)
    assert alike_layers(model, recording) == expected
    chain = Model("chain", [nn.Linear(8, 8) for _ in range(3)], lambda b, gen: (torch.randn(b, 8, generator=gen), None),
                  lambda out, target: out.square().mean())
    assert alike_layers(chain, measure_bytes(chain, settings)[0]) == [0, 1, 2]  # the batch needs no gradient

    calls = [0] * len(layers)
    for i, layer in enumerate(layers):
        layer.register_forward_hook(lambda module, args, out, i=i: calls.__setitem__(i, calls[i] + 1))
    timed = measure_times(model, settings, recording, profiles, lambda what: None)
    assert [bool(n) for n in calls] == [i == first for i, first in enumerate(expected)]  # only the first is run
    for i, first in enumerate(expected):
        assert all(getattr(timed[i], kind) == getattr(timed[first], kind) for kind in ("fwd", "bwd", "igrad", "wgrad"))
        assert timed[i].fwd.median_ms > 0 and timed[i].name == profiles[i].name


@pytest.mark.parametrize("replay_saving", [0.0, math.inf])  # always the replayed pass, always the real one
def test_steps_are_timed_as_the_executor_updates_on_a_fresh_gradient_buffer(monkeypatch, replay_saving):
    """The update and the prediction a profile prices are the executor's own (`StageWeights.step`, in place,
    and `.predict`), each update on the buffer a mini-batch's first backward makes afresh (a buffer kept from
    step to step stays in cache, and an SGD step on it came out at 0.6x a run's OPT rows), after the stage's
    pass or its replayed traffic."""
    from pipesim.calibrate import measure
    from pipesim.calibrate.measure import OPTIMIZERS, Settings, measure_bytes, measure_steps
    from pipesim.calibrate.passes import stage_runs
    from pipesim.executor.weights import StageWeights
    from pipesim.workload.models import build_model

    steps, predictions = [], []
    step, predict = StageWeights.step, StageWeights.predict

    def recording_step(self, keep_old):
        steps.append((self.optimizer, keep_old, [id(g) for g in self.grads], [g.clone() for g in self.grads]))
        step(self, keep_old)

    def recording_predict(self, key):
        assert not self.predicted  # each prediction is freed after it is timed: none builds up
        predicted = predict(self, key)
        predictions.append((key, any(not torch.equal(p, w) for p, w in zip(predicted.tensors, self.current))))
        return predicted

    monkeypatch.setattr(StageWeights, "step", recording_step)
    monkeypatch.setattr(StageWeights, "predict", recording_predict)
    monkeypatch.setattr(measure, "REPLAY_SAVING", replay_saving)
    monkeypatch.setattr(measure, "last_level_cache_bytes", lambda device: 1 << 20)  # a small eviction: quick
    torch.manual_seed(0)
    model = build_model("mlp", layers=2, width=8)
    settings = Settings(torch.device("cpu"), torch.float64, 3, warmup=1, repeats=2)
    measure_bytes(model, settings)
    runs = stage_runs(model, [0, 2, 3], "float64", 3)
    measured = measure_steps(runs, settings, lambda what: None)
    rounds = settings.warmup + settings.repeats
    assert len(steps) == len(runs) * len(OPTIMIZERS) * rounds
    assert all(not keep_old for _, keep_old, _, _ in steps)  # in place: a copy-on-write update adds `copy`
    for (a, _, ids_a, grads_a), (b, _, ids_b, _) in itertools.pairwise(steps):
        if a is b:  # the same stage and optimizer, one round later: a new buffer (the old one is still held)
            assert not set(ids_a) & set(ids_b)
    assert all(g.abs().sum() > 0 for _, _, _, grads in steps for g in grads)  # a backward filled it
    assert len(predictions) == len(steps) and all(key[1:] == (1, "F") for key, _ in predictions)  # one update ahead
    assert all(moved for _, moved in predictions)  # each after an update: there is a direction to extrapolate
    for stage_steps, *_ in measured:
        assert set(stage_steps) == set(OPTIMIZERS)
        assert all(t.step.repeats == t.predict.repeats == settings.repeats and t.step.median_ms > 0
                   and t.predict.median_ms > 0 for t in stage_steps.values())


def test_weight_ops_are_timed_on_tensors_kept_from_the_round_before(monkeypatch):
    """Calibration times a prediction, the copy a copy-on-write update makes, elastic averaging and Adam's step on
    tensors the stage's spares kept from the round before, as the executor runs them (workload/optim.py `Spares`):
    only the first round makes them, so more rounds make no more. Made afresh in every round, a 4.3 MB prediction
    landed on reused heap or on fresh pages as glibc's history had it: 0.30 to 6.7 ms over five calibrations."""
    from pipesim.calibrate import measure
    from pipesim.calibrate.measure import Settings, measure_bytes, measure_steps
    from pipesim.calibrate.passes import stage_runs
    from pipesim.workload.models import build_model

    monkeypatch.setattr(measure, "last_level_cache_bytes", lambda device: 1 << 20)  # a small eviction: quick
    empty_strided = torch.empty_strided
    made = []
    monkeypatch.setattr(torch, "empty_strided", lambda *args, **kw: made.append(args[0]) or empty_strided(*args, **kw))

    def tensors_made(repeats: int) -> int:
        torch.manual_seed(0)
        model = build_model("mlp", layers=2, width=8)
        settings = Settings(torch.device("cpu"), torch.float64, 3, warmup=1, repeats=repeats)
        measure_bytes(model, settings)
        made.clear()
        measure_steps(stage_runs(model, [0, 2, 3], "float64", 3), settings, lambda what: None)
        return len(made)

    once = tensors_made(1)
    assert once > 0 and tensors_made(4) == once


def test_pass_traffic_writes_the_gradients_as_a_backward_and_evicts_twice_the_cache(monkeypatch):
    """The replayed pass leaves what a backward leaves: a fresh gradient buffer equal to a backward's, which the
    update consumes, or those gradients added into the kept buffer; its buffer is twice the last-level cache."""
    from pipesim.calibrate import measure
    from pipesim.calibrate.measure import PassTraffic, eviction_buffer, last_level_cache_bytes
    from pipesim.executor.weights import StageWeights

    assert measure._cache_size_bytes("32768K\n") == 32 << 20 and measure._cache_size_bytes("1M") == 1 << 20
    assert last_level_cache_bytes(torch.device("cpu")) >= 64 << 10  # sysfs, sysconf or the default: some size
    monkeypatch.setattr(measure, "last_level_cache_bytes", lambda device: 1 << 20)
    module = torch.nn.Linear(4, 3)
    made = [torch.randn(3, 4), torch.randn(3)]
    traffic = PassTraffic(eviction_buffer(torch.device("cpu")), 12 << 10, made)
    assert traffic.buffer.numel() * 4 == 2 << 20 and traffic.activations.numel() * 4 == 12 << 10
    state = StageWeights(module, "momentum", 0.1, label="stage 0")
    traffic(state.current, state)
    assert all(torch.equal(g, m) and g is not m for g, m in zip(state.grads, made))  # a new buffer, as B's
    kept = [torch.ones_like(m) for m in made]
    before = [k.clone() for k in kept]
    traffic(state.current, None, kept)
    assert all(torch.equal(k, b + m) for k, b, m in zip(kept, before, made))


@settings(max_examples=200, deadline=None)
@given(samples=st.lists(st.floats(0, 1e3, allow_nan=False), min_size=1, max_size=40))
def test_the_median_interval_holds_the_median_from_five_samples_on(samples):
    from pipesim.calibrate.measure import MIN_REPEATS, median_interval

    interval = median_interval(samples)
    assert (interval is None) == (len(samples) < MIN_REPEATS)
    if interval is not None:
        assert interval[0] <= float(np.median(samples)) <= interval[1]


def test_the_stopping_rule_bounds_the_median_by_order_statistics():
    from pipesim.calibrate.measure import median_interval, precise

    assert median_interval([1.0, 2.0, 3.0, 4.0]) is None  # the extremes of 4 hold the median 87.5 % of the time
    assert median_interval([5.0, 1.0, 4.0, 2.0, 3.0]) == (1.0, 5.0)  # of 5: 93.75 %
    assert median_interval([float(x) for x in range(10, 0, -1)]) == (2.0, 9.0)  # the 3rd of 10 would be 89 %
    tight = [10.0, 10.1, 9.9, 10.05, 9.95]
    assert precise(tight, 0.02) and not precise(tight[:4], 0.02)  # four are too few, however close
    wide = [10.0, 12.0, 8.0, 11.0, 9.0]
    assert not precise(wide, 0.05) and precise(wide, 0.05, floor_ms=2.0)  # known well enough for its purpose


def _clock(increments_ns):
    """A stand-in for the measure module's `time` whose readings step by `increments_ns` in turn: a phase timed
    between two readings takes every second increment."""
    from types import SimpleNamespace

    readings = itertools.accumulate(itertools.cycle(increments_ns))
    return SimpleNamespace(perf_counter_ns=lambda: next(readings))


@pytest.mark.parametrize("increments, floor_ms, timed", [
    ((0, 1_000_000), None, 5),  # every run takes 1 ms: precise at the fewest runs
    ((0, 1_000_000) * 2 + (0, 3_000_000) * 2, None, 20),  # 1 and 3 ms round by round: never within 2 %
    ((0, 1_000_000) * 2 + (0, 3_000_000) * 2, 1.0, 5),  # ... enough where +-1 ms is all that matters
])
def test_timing_stops_once_every_median_is_precise_and_not_before(monkeypatch, increments, floor_ms, timed):
    from pipesim.calibrate import measure

    monkeypatch.setattr(measure, "time", _clock(increments))
    settings = measure.Settings(torch.device("cpu"), torch.float32, 1, warmup=2, repeats=20)
    runs = []
    times = measure._time(settings, [("a", lambda _: runs.append("a")), ("b", lambda _: runs.append("b"))],
                          tolerance=0.02, **({"floor_ms": lambda name: floor_ms} if floor_ms else {}))
    assert len(runs) == 2 * (settings.warmup + timed)  # the warm-up rounds, then the timed ones
    assert times["a"].repeats == times["b"].repeats == timed


def test_a_sequence_leaves_the_rounds_once_its_phases_are_precise(monkeypatch):
    """The untimed pass before a step is the costly part: a precise step must not repeat it for a noisy one. A
    phase named None (the pass, the spares a prediction gives back) is run and not timed."""
    from pipesim.calibrate import measure

    monkeypatch.setattr(measure, "time", _clock((0, 1_000_000) * 2 + (0, 3_000_000) * 2))  # never within 2 %
    settings = measure.Settings(torch.device("cpu"), torch.float32, 1, warmup=2, repeats=20)
    runs = []
    times = measure._time(settings, [(None, lambda _: runs.append("pass")), ("a", lambda _: runs.append("a"))],
                          [("b", lambda _: runs.append("b"))], tolerance=0.02,
                          floor_ms=lambda name: 1.0 if name == "a" else measure.FLOOR_MS)
    assert set(times) == {"a", "b"} and times["a"].repeats == 5 and times["b"].repeats == 20
    assert runs.count("pass") == runs.count("a") == settings.warmup + 5
    assert runs.count("b") == settings.warmup + 20


class _FakeEvent:
    """A CUDA event that logs its recording (the GPU-less stand-in for `torch.cuda.Event`)."""

    log: list[str] = []

    def __init__(self, enable_timing: bool = False) -> None:
        pass

    def record(self) -> None:
        self.log.append("record")

    def elapsed_time(self, other: "_FakeEvent") -> float:
        return 1.0


@pytest.mark.parametrize("idle", [(), ("F", "W"), ("W",)])
def test_passes_for_ranks_sharing_a_gpu_start_each_on_an_idle_gpu(monkeypatch, idle):
    """The executor holds a GPU its ranks share until a row's kernels finish, so each row is issued to an empty
    queue: the passes such a run predicts from are timed from a synchronised device, each phase's start event
    recorded after the synchronisation; otherwise queued behind the phase before (phase by phase: a calibration
    times a GPU's passes both ways in the same rounds, `measure_passes`)."""
    from pipesim.calibrate import measure

    log = _FakeEvent.log = []
    monkeypatch.setattr(torch.cuda, "Event", _FakeEvent)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: log.append("sync"))
    settings = measure.Settings(torch.device("cuda"), torch.float32, 1, warmup=0, repeats=5)
    measure._time(settings, [("F", lambda _: log.append("F")), ("W", lambda _: log.append("W"))],
                  idle=lambda name: name in idle)
    round_log = log[:log.index("sync", log.index("W"))]  # the first round, up to the reading of its events
    assert round_log == [*(["sync"] if "F" in idle else []), "record", "F", "record",
                         *(["sync"] if "W" in idle else []), "record", "W", "record"]


def test_a_gpus_kernel_overhead_is_timed_on_its_clock_from_a_hold_that_outlasts_the_issue(monkeypatch):
    """calibrate/kernel.py times a CUDA chain of kernels by the device's events from a start a spinning kernel holds
    back until the host has issued the whole chain (its start event not yet reached), the hold doubled while it was
    not, so that the chain runs one kernel behind another as a calibrated layer's do: on the host's clock a chain
    issued from Python is its host's issue (6.2 and 9.7 us an add on the H200 check's host), which put the fitted
    products above the part's peak. Refused where no hold tried outlasts the issue."""
    from pipesim.calibrate import kernel

    log = []

    class Event(_FakeEvent):
        reached = iter(())

        def query(self) -> bool:  # whether the device has reached the event
            return next(self.reached)

        def synchronize(self) -> None:
            log.append("wait")

        def elapsed_time(self, other: "Event") -> float:
            return 2.5

    Event.log = log
    Event.reached = iter([True, True, False])  # the device at the start before the chain was issued, twice
    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: log.append("sync"))
    monkeypatch.setattr(torch.cuda, "_sleep", lambda cycles: log.append(cycles))
    assert kernel.device_ms(lambda: log.append("chain")) == 2.5
    held = kernel.HOLD_CYCLES
    assert log == [step for cycles in (held, 2 * held, 4 * held)
                   for step in ("sync", cycles, "record", "chain", "record", "wait")]
    Event.reached = iter([True] * kernel.HOLDS)
    with pytest.raises(RuntimeError, match=f"a hold of {held << (kernel.HOLDS - 1)} GPU cycles"):
        kernel.device_ms(lambda: None)
    # a CUDA device's chains on its clock, never the host's (the tensors made on the CPU here)
    zeros, ones = torch.zeros, torch.ones
    monkeypatch.setattr(torch, "zeros", lambda *shape, device, dtype: zeros(*shape, dtype=dtype))
    monkeypatch.setattr(torch, "ones", lambda *shape, device, dtype: ones(*shape, dtype=dtype))
    monkeypatch.setattr(kernel, "host_ms", None)
    monkeypatch.setattr(kernel, "device_ms", lambda run: run() or 0.002 * kernel.CHAIN)
    assert kernel.kernel_overhead_ms(torch.device("cuda"), torch.float32) == pytest.approx(0.002)


def test_the_runtime_probe_runs_its_schedules_in_turn_in_one_valid_schedule():
    from pipesim.calibrate.runtime import PROBE_SCHEDULES, probe_schedule
    from pipesim.schedules.analysis import validate

    schedule = probe_schedule(2, 8, 3)
    validate(schedule)
    assert PROBE_SCHEDULES == ("1f1b", "zb-h1") and schedule.minibatches == 2 * (1 + 3)
    assert schedule.params["warmup_minibatches"] == [0, 4]  # each schedule's first, dropped from every term
    for device, order in enumerate(schedule.orders):
        # 1F1B for a warm-up mini-batch and three more, then ZB-H1 alike, numbered on
        parts = [build_schedule(name, ScheduleParams(stages=2, microbatches=8, minibatches=4)).orders[device]
                 for name in PROBE_SCHEDULES]
        assert list(order) == list(parts[0]) + [a._replace(minibatch=a.minibatch + 4) for a in parts[1]]
    kinds = {b: {a.kind for order in schedule.orders for a in order if a.minibatch == b} for b in range(8)}
    assert all(kinds[b] == {Kind.F, Kind.B, Kind.OPT} for b in range(4))
    assert all(kinds[b] == {Kind.F, Kind.I, Kind.W, Kind.OPT} for b in range(4, 8))
    # the calibrated model's run warms up its first schedule only: ZB-H1 follows on warm ranks
    warmed_once = probe_schedule(2, 8, 3, warmed=1)
    validate(warmed_once)
    assert warmed_once.minibatches == 1 + 2 * 3 and warmed_once.params["warmup_minibatches"] == [0]
    assert [a for a in warmed_once.orders[0] if a.minibatch >= 4] == [
        a._replace(minibatch=a.minibatch + 4) for a in build_schedule(
            "zb-h1", ScheduleParams(stages=2, microbatches=8, minibatches=3)).orders[0]]


def test_host_cache_reuses_a_term_until_fresh_and_measures_again_what_it_cannot_read(tmp_path):
    from pipesim.calibrate.cache import HostCache

    measured = []

    def measure():
        measured.append(len(measured) + 1)
        return {"ms": measured[-1], "sizes": (4096,)}

    first = HostCache(tmp_path).get("links", {"sizes": (4096,)}, measure, 2)
    again = HostCache(tmp_path).get("links", {"sizes": (4096,)}, measure, 2)
    assert first.fresh and not again.fresh and again.value == {"ms": 1, "sizes": [4096]} and measured == [1]
    assert again.measured_at == first.measured_at and again.meta()["reused"] and "from the host cache" in \
        again.describe()
    assert HostCache(tmp_path).get("links", {"sizes": (8192,)}, measure, 2).value["ms"] == 2  # other settings
    assert HostCache(tmp_path, fresh=True).get("links", {"sizes": (4096,)}, measure, 2).value["ms"] == 3
    assert HostCache(tmp_path).get("links", {"sizes": (4096,)}, measure, 2).value["ms"] == 3  # the new one kept
    for path in tmp_path.iterdir():
        path.write_text("{half written")
    assert HostCache(tmp_path).get("links", {"sizes": (4096,)}, measure, 2).value["ms"] == 4  # unreadable: again
    blocked = tmp_path / "a-file"
    blocked.write_text("")
    cache = HostCache(blocked / "cache")
    assert cache.get("links", {"sizes": (4096,)}, measure, 2).fresh and "a-file" in cache.unwritable


@pytest.mark.slow
def test_a_second_calibration_reuses_the_host_terms_and_fresh_measures_them(tmp_path, monkeypatch):
    monkeypatch.setenv("PIPESIM_CACHE_DIR", str(tmp_path / "cache"))
    args = (*MLP, "--stages", "2", "--link-max-mb", "0.0078125", "--no-contention")
    runs = {}
    for name, extra in (("cold", ()), ("warm", ()), ("fresh", ("--fresh",))):
        code, _, err = pipesim("calibrate", *args, *extra, "--out", tmp_path / f"{name}.json")
        assert code == 0, err
        runs[name] = (load_profile(tmp_path / f"{name}.json"), err)
    for name, reused in (("cold", False), ("warm", True), ("fresh", False)):
        profile, err = runs[name]
        for cached in (profile.link.meta["host_cache"], profile.allreduce.meta["host_cache"],
                       *profile.allreduce.meta["sizes_covering"]["host_cache"],
                       profile.allreduce.meta["beside_compute_host_cache"], profile.runtime.meta["host_cache"]):
            assert cached["reused"] is reused
        assert (err.count("from the host cache") == 4) is reused and (err.count("measured now") == 4) is not reused
        assert profile.runtime.meta["host_times_from"] == "the calibrated model"  # measured every time
    cold, warm = runs["cold"][0], runs["warm"][0]
    assert warm.link == cold.link.model_copy(update={"meta": warm.link.meta})
    assert warm.runtime.compute_ms == cold.runtime.compute_ms and warm.runtime.gap_ms != cold.runtime.gap_ms
    assert warm.link.meta["host_cache"]["measured_at"] == cold.link.meta["host_cache"]["measured_at"]
    # the host's terms, the digits split the mlp draws from (workload/data.py), and the model's count the fitted
    # curve prices (commands/estimate.py)
    assert sorted(p.name.split("-")[0] for p in (tmp_path / "cache").iterdir()) == ["allreduce", "beside", "counts",
                                                                                   "digits", "links", "runtime"]


def test_a_second_model_reuses_the_link_and_all_reduce_and_measures_its_all_reduce_beside_compute(tmp_path,
                                                                                                monkeypatch):
    """The link and the all-reduce's sizes are the host's, the all-reduce beside computing ranks is at the largest
    stage's gradients: two models on one cache measure the links once and the beside factor once per size, and
    each profile records where each part came from."""
    import pipesim.calibrate.measure as measure
    from pipesim.calibrate.cache import HostCache
    from pipesim.workload.models import build_model

    measured = []
    real_links = measure.measure_links

    def links(link_sizes, settings, advance):
        measured.append("links")
        return real_links(link_sizes, settings, advance)

    def beside(nbytes, **_):
        measured.append(("beside", nbytes))
        return {"beside_compute": [1.0, 1.5, 2.0], "beside_compute_points": [], "beside_compute_workload": {}}

    monkeypatch.setattr(measure, "measure_links", links)
    monkeypatch.setattr(measure, "measure_p2p_and_allreduce", lambda sizes, **_: tuple(
        LinkPoints([LinkPoint(s, 0.01 + s / 1e6, 0.0) for s in sizes], {"world_size": 2}) for _ in range(2)))
    monkeypatch.setattr(measure, "measure_allreduce_beside_compute", beside)
    settings = measure.Settings(torch.device("cpu"), torch.float32, BATCH, warmup=0, repeats=1)
    profiles = [measure.calibrate(build_model("mlp", layers=3, width=width), settings, stages=1, optimizer="sgd",
                                  memory_cap_bytes=None, link_sizes=[4096, 65536], dtype_name="float32",
                                  advance=lambda what: None, cache=HostCache(tmp_path))
                for width in (8, 16, 8)]
    gradients = [p.stages[0].param_bytes for p in profiles]  # one stage: the whole model's, whatever the times
    assert gradients[0] != gradients[1] and gradients[0] == gradients[2]
    assert measured == ["links", ("beside", gradients[0]), ("beside", gradients[1])]
    assert [p.allreduce.meta["host_cache"]["reused"] for p in profiles] == [False, True, True]
    assert [p.allreduce.meta["beside_compute_host_cache"]["reused"] for p in profiles] == [False, False, True]
    assert all(p.allreduce.beside_compute == [1.0, 1.5, 2.0] and "beside_compute" not in p.allreduce.meta
               for p in profiles)
    assert sorted(path.name.split("-")[0] for path in tmp_path.iterdir()) == ["beside", "beside", "links"]


def test_an_empty_stage_holds_what_it_receives_and_the_copy_it_sends_on_in_pipesims_runtime():
    """A layout's empty stage clones its input (executor/stages.py `StageModule`, as Megatron-core's TransformerBlock
    of no layers does) and pipesim's runtime keeps every sent output until its backward: a calibration's stage holds
    both; an estimate's (the layers not saying what they save) the received input alone, Megatron-core's schedule
    freeing each sent output's storage (`deallocate_pipeline_outputs`)."""
    from tests.helpers import GPT_CPU

    measured = load_profile(GPT_CPU)
    said = [layer.model_copy(update={"output_saved": False,
                                     "saved_input_bytes": [measured.layers[s].output_bytes if s >= 0 else 0
                                                           for s in layer.inputs]})
            for layer in measured.layers]
    nbytes = said[2].output_bytes
    bounds = [0, 3, 3, len(said)]
    assert boundary_held_bytes(said, bounds, dag=False) == [nbytes, 2 * nbytes, 0]
    assert boundary_held_bytes(said, [0, 3, len(said)], dag=False) == [nbytes, 0]
    assert boundary_held_bytes(measured.layers, bounds, dag=False) == [None, nbytes, None]
