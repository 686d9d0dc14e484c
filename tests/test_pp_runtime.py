"""`--pp-runtime torch`: the tensors passed between stages as torch.distributed.pipelining's stage holds them (a
receive buffer per micro-batch for every input and output gradient, kept; every forward's output and input
gradient kept until the update), against pipesim's runtime (buffers only while in flight)."""

import json
from dataclasses import replace

import pytest

from pipesim.sim import Costs, simulate
from pipesim.sim.cluster import Cluster
from pipesim.sim.costs import held_as_runtime
from pipesim.units import MIB
from tests.conftest import build, pipesim, simulate_json, tune_rows

# 1F1B on 4 devices, 8 micro-batches: 100 MiB of weights, 10 MiB of activations a micro-batch (its 2 MiB input
# among them: the first layer saves it) and 2 MiB sent to the next stage.
ONE_F_ONE_B = ["--schedule", "1f1b", "-p", "4", "-m", "8", "--param-mb", "100", "--activation-mb", "10",
               "--output-mb", "2"]
STATIC = {"parameters": 100, "gradients": 100, "optimizer_state": 200, "runtime_buffers": 0, "transient": 0,
          "reserve": 0}


def peak_parts(*args: str) -> list[dict[str, float]]:
    result, = simulate_json(*ONE_F_ONE_B, *args)
    for device in result["devices"]:
        assert sum(device["peak_memory_parts_mb"].values()) == pytest.approx(device["peak_memory_mb"], rel=1e-12)
    return [device["peak_memory_parts_mb"] for device in result["devices"]]


def test_torchs_stage_keeps_its_buffers_outputs_and_input_gradients_until_the_update():
    """The first stage at its last forward: 4 micro-batches in flight, its 8 outputs kept and 8 gradient receive
    buffers (32 MiB, where pipesim's runtime holds one sent output); the last stage at its last forward: one in
    flight without the 2 MiB input its receive buffer holds, 8 input buffers and 7 input gradients kept (30 MiB);
    a middle stage: 3 in flight, 8 + 8 buffers, 8 outputs and 5 input gradients."""
    pipesim_runtime = peak_parts("-n", "2")
    assert [p["communication"] for p in pipesim_runtime] == [2, 4, 4, 2]
    torch = peak_parts("-n", "2", "--pp-runtime", "torch")
    assert torch[0] == {**STATIC, "activations": 4 * 10, "communication": (8 + 8) * 2}
    assert torch[1] == {**STATIC, "activations": 3 * (10 - 2), "communication": (8 + 8 + 8 + 5) * 2}
    assert torch[3] == {**STATIC, "activations": 10 - 2, "communication": (8 + 7) * 2}
    assert peak_parts("-n", "3", "--pp-runtime", "torch") == torch  # freed at each update: no step adds to it


def test_the_last_stage_keeps_every_micro_batchs_model_output_until_the_update():
    """Its logits (`output_chunks`, 5 MiB each here): after its last backward all 8 and their concatenation
    (`_merge_outputs`), beside its 8 input buffers and 8 input gradients; pipesim's runtime keeps none (the loss
    reads them within the forward)."""
    schedule = build("1f1b", 4, 8, 2)
    costs = Costs.per_stage(4, fwd_ms=1.0, bwd_ms=2.0, param_mb=100, activation_mb=10, output_mb=2)
    costs = replace(costs, stages=(*costs.stages[:-1], replace(costs.stages[-1], model_output_bytes=5 * MIB)))
    for runtime, kept in (("pipesim", 2), ("torch", (8 + 8) * 2 + 2 * 8 * 5)):
        trace = simulate(schedule, held_as_runtime(costs, schedule, runtime), Cluster.uniform(4, 0.0))
        assert trace.meta.peak_memory_parts[3]["communication"] == kept * MIB


def test_the_estimate_sizes_the_logits_as_torchs_loss_reads_them(tmp_path):
    """The count's last layer: the head's output before its loss (2 × 32 tokens × 1,000 in bf16); an estimate at
    t = 2: split over t as loss_parallel's vocabulary shards, whole on every rank without it."""
    torch = pytest.importorskip("torch")
    from pipesim.workload.count import count_built

    counted = count_built("gpt", dict(layers=2, width=64, heads=4, seq_len=32, vocab=1000), 2, torch.bfloat16)
    assert [layer.model_output_bytes for layer in counted.layers] == [0, 0, 0, 2 * 32 * 1000 * 2]
    for flags, per_rank in (([], 128_000), (["--loss-parallel"], 64_000)):
        code, _, err = pipesim("estimate", "--gpu", "h100-sxm", "--model", "gpt", "--layers", 2, "--width", 64,
                               "--heads", 4, "--seq-len", 32, "--vocab", 1000, "-b", 2, "--tensor-parallel", 2,
                               "--sequence-parallel", "--tp-runtime", "torch", *flags, "-p", 2,
                               "--out", tmp_path / "gpt.json")
        assert code == 0, err
        stages = json.loads((tmp_path / "gpt.json").read_text())["stages"]
        assert [stage["model_output_bytes"] for stage in stages] == [0, per_rank]


@pytest.mark.parametrize("name", ["1f1b", "interleaved-1f1b", "zb-h1", "dualpipev", "gpipe"])
def test_parts_sum_to_the_peak_under_torchs_stage(name):
    result, = simulate_json("--schedule", name, "--param-mb", "96", "--activation-mb", "12", "--output-mb", "3",
                            "--comm", "0.4", "-n", "2", "--pp-runtime", "torch")
    for device in result["devices"]:
        assert sum(device["peak_memory_parts_mb"].values()) == pytest.approx(device["peak_memory_mb"], rel=1e-12)
        assert device["peak_memory_parts_mb"]["activations"] > 0


@pytest.mark.parametrize(("flags", "message"), [
    (["--pp-runtime", "jax"], "error: --pp-runtime: choose from pipesim, torch (got 'jax')\n"),
    (["--pp-runtime", "torch", "--schedule", "pipedream"],
     "error: pipedream: --pp-runtime torch is torch.distributed.pipelining's stage, which runs one synchronous "
     "pipeline whose stages each update once a mini-batch\n"),
    (["--pp-runtime", "torch", "--schedule", "spectrain"],  # reads the latest weights, but predicted ones
     "error: spectrain: --pp-runtime torch is torch.distributed.pipelining's stage, which runs one synchronous "
     "pipeline whose stages each update once a mini-batch\n"),
])
def test_a_runtime_that_cannot_run_it_is_one_line(flags, message):
    code, out, err = pipesim("simulate", *flags)
    assert (code, out, err) == (2, "", message)


def test_a_sweep_reads_each_configurations_peak_under_torchs_stage_as_simulate_does(tmp_path):
    """sweep --pp-runtime torch: each row's peak is simulate's under the same flag (sweep's sizes are the whole
    model's, split over the 4 stages), above pipesim's runtime's, and a method torch's stage cannot run is a
    skipped row with simulate's reason."""
    import csv

    peaks = {}
    for runtime in ("pipesim", "torch"):
        out = tmp_path / f"{runtime}.csv"
        code, _, err = pipesim("sweep", "-p", "4", "-m", "8", "--param-mb", "400", "--activation-mb", "40",
                               "--output-mb", "2", "-s", "1f1b,pipedream", "-n", "2", "--pp-runtime", runtime,
                               "--workers", "1", "--out", out)
        assert code == 0, err
        peaks[runtime] = {row["schedule"]: row for row in csv.DictReader(out.open())}
    (simulated,) = simulate_json(*ONE_F_ONE_B, "-n", "2", "--pp-runtime", "torch")
    assert float(peaks["torch"]["1f1b"]["peak_memory_mb"]) == max(d["peak_memory_mb"] for d in simulated["devices"])
    assert float(peaks["torch"]["1f1b"]["peak_memory_mb"]) > float(peaks["pipesim"]["1f1b"]["peak_memory_mb"])
    refused = peaks["torch"]["pipedream"]
    assert refused["status"] == "skipped"
    assert "--pp-runtime torch is torch.distributed.pipelining's stage" in refused["reason"]


def test_the_caption_says_whose_runtime_held_the_tensors_between_stages():
    """The peaks differ by the runtime, so the table says which one held the boundary tensors, where not pipesim's."""
    said = {}
    for runtime in ("pipesim", "torch"):
        code, out, err = pipesim("simulate", *ONE_F_ONE_B, "--pp-runtime", runtime)
        assert code == 0, err
        said[runtime] = " ".join(out.split())
    assert "tensors between stages held as torch's pipeline runtime holds them (--pp-runtime torch)" in said["torch"]
    assert "--pp-runtime" not in said["pipesim"]


def test_the_json_records_whose_runtime_held_the_tensors_between_stages():
    """--json's results say the runtime their peaks were held under, as the table's caption does."""
    for runtime in ("pipesim", "torch"):
        (result,) = simulate_json(*ONE_F_ONE_B, "--pp-runtime", runtime)
        assert result["pp_runtime"] == runtime


@pytest.mark.parametrize(("name", "why"), [
    ("dualpipe", "which runs one model's stages, not 2 copies of them"),
    ("graphpipe", "whose stages form one chain (each receives from the one before), not a branching graph"),
])
def test_torchs_stage_refuses_a_stage_graph_it_cannot_run(name, why):
    """torch's PipelineStage receives from the stage before and sends to the next: DualPipe's two model copies and
    GraphPipe's branching stages are one line, exit 2; DualPipeV's and ZB-V's V-shaped chain runs."""
    code, out, err = pipesim("simulate", *ONE_F_ONE_B[2:], "--schedule", name, "--pp-runtime", "torch")
    assert (code, out, err) == (2, "", f"error: {name}: --pp-runtime torch is torch.distributed.pipelining's "
                                       f"stage, {why}\n")
    for runs in ("dualpipev", "zb-v"):
        code, _, err = pipesim("simulate", *ONE_F_ONE_B[2:], "--schedule", runs, "--pp-runtime", "torch")
        assert code == 0, err


def test_tune_prices_the_chosen_configuration_as_simulate_does_under_torchs_runtime():
    """tune --pp-runtime torch holds the tensors between stages as simulate --pp-runtime torch does: its choice's
    peak is simulate's, above the one pipesim's runtime holds (torch's stage keeps its buffers to the update)."""
    from tests.helpers import simulated_peak_mib, tuned_peak_mib

    torch = tuned_peak_mib("--pp-runtime", "torch")
    assert torch == pytest.approx(simulated_peak_mib("--pp-runtime", "torch"))
    assert torch > tuned_peak_mib()


def tuned(*flags) -> dict:
    from tests.helpers import A100_GPT4 as MODEL

    code, out, err = pipesim("tune", *MODEL, "-D", 2, "-B", 8, "-b", 1, "--tensor-parallel", 1, "--recompute",
                             "none", *flags, "--json")
    assert code == 0, err
    return json.loads(out)


def test_tune_refuses_per_shape_the_methods_torchs_stage_cannot_run():
    """Under --pp-runtime torch, PipeDream's asynchronous updates and AvgPipe's P > 1 pipelines are shapes refused
    by their method (the search goes on); AvgPipe's one pipeline, synchronous, still runs."""
    flags = ("-s", "1f1b,pipedream,avgpipe", "--max-staleness", 1)
    runtimes = {runtime: tuned(*flags, "--pp-runtime", runtime) for runtime in ("pipesim", "torch")}

    def configurations(document):
        rows = [*tune_rows(document), document["staler_winner"]]
        return {(row["schedule"], row["pipelines"]) for row in rows if row}

    assert ("pipedream", 1) in configurations(runtimes["pipesim"])
    assert {name for name, _ in configurations(runtimes["torch"])} <= {"1f1b", "avgpipe"}
    assert all(pipelines == 1 for _, pipelines in configurations(runtimes["torch"]))
    pipesim_search, torch_search = runtimes["pipesim"]["search"], runtimes["torch"]["search"]
    assert torch_search["shapes"] == pipesim_search["shapes"]
    assert torch_search["refused"] > pipesim_search["refused"]


def test_tune_with_only_methods_torchs_stage_cannot_run_is_one_line():
    from tests.helpers import A100_GPT4 as MODEL

    flags = (*MODEL, "-D", 2, "-B", 8, "-b", 1, "-s", "pipedream", "--max-staleness", 1)
    assert pipesim("tune", *flags)[0] == 0
    code, out, err = pipesim("tune", *flags, "--pp-runtime", "torch")
    assert (code, out) == (2, "") and len(err.splitlines()) == 1
    assert "pipedream: --pp-runtime torch is torch.distributed.pipelining's stage" in err
    code, out, err = pipesim("tune", *flags, "--pp-runtime", "jax")
    assert (code, out, err) == (2, "", "error: --pp-runtime: choose from pipesim, torch (got 'jax')\n")


def test_tunes_memory_floor_stays_below_the_peak_under_torchs_runtime():
    """A candidate's memory floor prunes it unsimulated, so it must not exceed what simulating it holds: under
    torch's stage the input a forward computes on is its receive buffer, counted once."""
    from pipesim.planning import tune as tuning
    from pipesim.schedules import METHODS
    from tests.helpers import searched_settings

    settings = searched_settings("-D", 2, "-B", 8, "-b", 1, "--tensor-parallel", 1, "--recompute", "none",
                                 "--pp-runtime", "torch")
    problem = tuning.Problem(2, 80 * tuning.GIB, 8, tuple(METHODS), 0)
    candidates, _, _ = tuning.prepare(settings, problem)
    assert any(c.costs.kept_until_update for c in candidates)
    for candidate in candidates:
        assert candidate.memory_floor_bytes <= tuning._measured(problem, candidate, reserve=False)[0][3]


def test_the_last_stages_merged_outputs_take_a_segment_after_its_last_backward():
    """torch's schedules return the last stage's kept outputs concatenated (`_merge_outputs`) once its last
    backward ends: a 48 MiB tensor (4 micro-batches' 12 MiB) no cached block holds, so its segment adds to what
    the device reserves; the other stage merges nothing."""
    from pipesim.sim.caching_allocator import LayerAllocations, device_reserves

    trace = simulate(build("1f1b", 2, 4, 1), Costs.per_stage(2, fwd_ms=1.0, bwd_ms=2.0), Cluster.uniform(2, 0.0))
    layer = LayerAllocations({"fwd": [(0, 30 * MIB), (1, 12 * MIB), (1, -12 * MIB)],
                              "bwd": [(0, 20 * MIB), (0, -20 * MIB), (1, 4 * MIB)]})
    layers = {0: [layer], 1: [layer]}
    kept = device_reserves(trace, layers, [None, None])
    merged = device_reserves(trace, layers, [None, None], merged_bytes={1: 12 * MIB})
    assert merged == [kept[0], kept[1] + 4 * 12 * MIB]


def test_the_merge_waits_for_the_devices_last_backward():
    """Interleaved on 2 devices, the last stage's device runs its first chunk's backwards after the last stage's
    own: torch's step merges once it has run them all (PipelineScheduleMulti.step), so the merged logits (4 of
    5 MiB) join, at that backward's end, the 24 MiB of receive buffers and 44 kept (stage 1's 4 outputs and input
    gradients, stage 3's 4 logits and input gradients), until the update."""
    from pipesim.schedules import Kind

    schedule = build("interleaved-1f1b", 2, 4, 1, chunks=2)
    costs = Costs.per_stage(4, fwd_ms=1.0, bwd_ms=2.0, activation_mb=10, output_mb=2)
    costs = replace(costs, stages=(*costs.stages[:-1], replace(costs.stages[-1], model_output_bytes=5 * MIB)))
    trace = simulate(schedule, held_as_runtime(costs, schedule, "torch"), Cluster.uniform(2, 0.0))
    ops = trace.ops
    last_backward_ends_us = ops.end_us[(ops.device == 1) & (ops.kind == trace.kinds.index(Kind.B.value))].max()
    curve = trace.counters["memory_bytes.communication"][1]
    assert curve.values.max() == (24 + 44 + 4 * 5) * MIB
    assert curve.times_us[curve.values.argmax()] == last_backward_ends_us
    assert last_backward_ends_us > ops.end_us[(ops.stage == 3) & (ops.kind == trace.kinds.index(Kind.B.value))].max()
