"""The memory breakdown: each device's peak split by what holds it, read from the same events as the peak."""

import json

import pytest

from pipesim.schedules import METHODS
from pipesim.sim import Costs, simulate
from pipesim.sim.caching_allocator import add_reserve
from pipesim.sim.cluster import Cluster
from pipesim.traces import summarize
from pipesim.traces.trace import MEMORY_PARTS
from pipesim.units import MIB
from tests.conftest import build, pipesim, simulate_json
from tests.helpers import A100

# Profiles whose layers say what autograd saves (boundary tensors held from F to B); graphpipe's branches.
PROFILE = "traces/profiles/gpt-cpu.json"
DAG_PROFILE = "traces/measured/fidelity-cpu2-day3-runs/two-branch-profile.json"


@pytest.mark.parametrize("name", list(METHODS))
@pytest.mark.parametrize("profiled", [False, True], ids=["typed", "profile"])
def test_parts_sum_to_the_peak_in_every_methods_json(name, profiled):
    dag = name == "graphpipe"
    if profiled:
        costs = ["--profile", DAG_PROFILE if dag else PROFILE, "-n", "2"]
    else:
        costs = ["--param-mb", "96", "--activation-mb", "12", "--output-mb", "3", "--comm", "0.4", "-n", "3",
                 *(["--graph", "examples/dag.json"] if dag else [])]
    result, = simulate_json("--schedule", name, *costs)
    for device in result["devices"]:
        parts = device["peak_memory_parts_mb"]
        assert list(parts) == list(MEMORY_PARTS)
        assert sum(parts.values()) == pytest.approx(device["peak_memory_mb"], rel=1e-12)
        assert parts["activations"] > 0 and parts["parameters"] > 0


@pytest.mark.parametrize("name", ["1f1b", "zb-h2", "pipedream", "avgpipe", "dualpipev"])
def test_parts_are_the_counters_bytes_at_the_peak_exactly(name):
    schedule = build(name, 4, 8, 2)
    costs = Costs.per_stage(schedule.num_stages, fwd_ms=1.0, bwd_ms=2.0, param_mb=7.3, activation_mb=1.1,
                            output_mb=0.7)
    trace = simulate(schedule, costs, Cluster.uniform(schedule.num_devices, 0.3))
    for d, parts in enumerate(trace.meta.peak_memory_parts):
        assert sum(parts.values()) == int(trace.counters["memory_bytes"][d].values.max())


@pytest.mark.parametrize("name", ["1f1b", "zb-h2", "pipedream", "avgpipe", "dualpipev"])
def test_a_run_without_the_parts_curves_is_the_same_run(name):
    """`part_curves=False` (simulate with no page or trace file to show them) leaves out the parts' curves alone:
    the rows, the total and activation curves, the parts at the peak and the reserve added after are the ones the
    full run gives, to the byte."""
    schedule = build(name, 4, 8, 2)
    costs = Costs.per_stage(schedule.num_stages, fwd_ms=1.0, bwd_ms=2.0, param_mb=7.3, activation_mb=1.1,
                            output_mb=0.7)
    full, lean = (simulate(schedule, costs, Cluster.uniform(schedule.num_devices, 0.3), part_curves=parts)
                  for parts in (True, False))
    assert {name for name in full.counters if name.startswith("memory_bytes.")} >= {
        f"memory_bytes.{part}" for part in MEMORY_PARTS}
    assert set(lean.counters) == {"memory_bytes", "activations", "weight_versions"}
    for trace in (full, lean):
        add_reserve(trace, [3 * MIB, 0, 5 * MIB, 1])
    assert lean.ops.start_us.tobytes() == full.ops.start_us.tobytes()
    assert lean.ops.dur_us.tobytes() == full.ops.dur_us.tobytes()
    for counter in lean.counters:
        for mine, theirs in zip(lean.counters[counter], full.counters[counter], strict=True):
            assert mine.times_us.tobytes() == theirs.times_us.tobytes()
            assert mine.values.tobytes() == theirs.values.tobytes()
    assert lean.meta.peak_memory_parts == full.meta.peak_memory_parts
    assert lean.meta.peak_activation_parts == full.meta.peak_activation_parts


def test_1f1b_parts_are_what_each_part_holds():
    """1F1B on 4 devices: device k holds 4 - k micro-batches' activations at its peak, Adam's two moments, and
    ZeRO-1 over d = 2 halves the state and nothing else."""
    args = ["--schedule", "1f1b", "-p", "4", "-m", "8", "--param-mb", "100", "--activation-mb", "10",
            "--output-mb", "0"]
    plain, = simulate_json(*args)
    sharded, = simulate_json(*args, "--data-parallel", "2", "--sharded-optimizer")
    for k, (device, zero1) in enumerate(zip(plain["devices"], sharded["devices"])):
        parts = device["peak_memory_parts_mb"]
        assert parts == {"parameters": 100, "gradients": 100, "optimizer_state": 200,
                         "activations": 10 * (4 - k), "communication": 0, "runtime_buffers": 0, "transient": 0,
                         "reserve": 0}
        assert zero1["peak_memory_parts_mb"] == {**parts, "optimizer_state": 100}


def test_a_stashing_methods_weight_copies_are_parameters():
    """PipeDream stashes a weight version per micro-batch in flight, and the memory breakdown must count each as
    parameters, not once: device 0 of 4 holds 2 versions at its peak at -m 4."""
    result, = simulate_json("--schedule", "pipedream", "-p", "4", "-m", "4", "-n", "4", "--param-mb", "10",
                            "--activation-mb", "1")
    device = result["devices"][0]
    assert device["peak_memory_parts_mb"]["parameters"] == 10 * device["peak_weight_versions"] > 10


def test_a_trace_keeps_its_breakdown(tmp_path):
    path = tmp_path / "t.json"
    code, _, err = pipesim("simulate", "--schedule", "1f1b", "--trace", path)
    assert code == 0, err
    from pipesim.traces import read_trace

    trace = read_trace(path)
    assert [sum(parts.values()) for parts in trace.meta.peak_memory_parts] == [
        round(d.peak_memory_mb * MIB) for d in summarize(trace).devices]
    assert "peak_memory_parts" in json.loads(path.read_text())["pipesim"]["meta"]
    assert all(len(trace.counters[f"memory_bytes.{part}"]) == trace.num_devices for part in MEMORY_PARTS)


def test_megatron_precision_holds_float32_gradients_master_weights_and_moments():
    """--param-mb is the 16-bit weights: float32 main gradients are twice them, Adam's float32 moments and master
    weights six times; fp32 (the default for typed costs) holds gradients as large as the weights."""
    args = ["--schedule", "1f1b", "-p", "2", "-m", "4", "--param-mb", "100"]
    plain, = simulate_json(*args)
    mixed, = simulate_json(*args, "--precision", "megatron")
    assert plain["devices"][0]["peak_memory_parts_mb"]["gradients"] == 100
    parts = mixed["devices"][0]["peak_memory_parts_mb"]
    assert (parts["parameters"], parts["gradients"], parts["optimizer_state"]) == (100, 200, 600)


TINY_GPT = ["--gpu", "a100-sxm-80gb", "--model", "gpt", "--layers", "2", "--width", "64", "--heads", "4",
            "--seq-len", "32", "--vocab", "128", "-p", "2", "-s", "1f1b"]


@pytest.mark.parametrize("dtype,precision,grads_per_weight", [
    ("bf16", None, 2.0),  # Megatron-LM forces float32 main gradients for bf16
    ("fp16", None, 1.0),  # and keeps fp16 ones by default
    ("bf16", "megatron-16bit-grads", 1.0),
    ("fp32", None, 1.0),
])
def test_an_estimate_holds_gradients_in_their_accumulation_dtype(dtype, precision, grads_per_weight):
    result, = simulate_json(*TINY_GPT, "--dtype", dtype, *(["--precision", precision] if precision else []))
    for device in result["devices"]:
        parts = device["peak_memory_parts_mb"]
        assert parts["gradients"] == pytest.approx(grads_per_weight * parts["parameters"], rel=1e-3)
        # Adam's two moments; beside 16-bit weights, both and a master copy in float32: 12 bytes per 2
        state_per_weight = 2.0 if dtype == "fp32" else 6.0
        assert parts["optimizer_state"] == pytest.approx(state_per_weight * parts["parameters"], rel=1e-3)


def test_nemos_bf16_distributed_adam_holds_16_bit_gradients_and_moments_and_no_master_copy():
    """NeMo's distributed Adam with optim.dtype and grad_sync_dtype bf16 (NVIDIA's Nemotron-4 340B benchmark):
    per 16-bit weight, a 16-bit gradient and two 16-bit moments, sharded over the d replicas; Megatron-LM's
    default keeps a float32 master copy and float32 moments (12 bytes per 2)."""
    args = (*TINY_GPT, "--dtype", "bf16", "--data-parallel", "2", "--sharded-optimizer")
    (nemo,), (megatron,) = (simulate_json(*args, "--precision", name) for name in ("nemo-bf16-adam", "megatron"))
    for held, state_per_weight, grads_per_weight in ((nemo, 1.0, 1.0), (megatron, 3.0, 2.0)):
        for device in held["devices"]:
            parts = device["peak_memory_parts_mb"]
            assert parts["gradients"] == pytest.approx(grads_per_weight * parts["parameters"], rel=1e-3)
            assert parts["optimizer_state"] == pytest.approx(state_per_weight * parts["parameters"], rel=1e-3)


def test_deepseek_v3s_bf16_moments_keep_float32_master_weights_and_gradients():
    """DeepSeek-V3's AdamW moments in BF16 (arXiv 2412.19437, section 3.3.3) beside float32 master weights and
    gradients: per 16-bit weight, 4 bytes of gradient and 4 + 2 + 2 of optimizer state; Megatron-LM's default
    holds its moments in float32 (4 + 4 + 4)."""
    args = (*TINY_GPT, "--dtype", "bf16")
    (moments,), (megatron,) = (simulate_json(*args, "--precision", name)
                               for name in ("megatron-bf16-moments", "megatron"))
    for held, state_per_weight in ((moments, 4.0), (megatron, 6.0)):
        for device in held["devices"]:
            parts = device["peak_memory_parts_mb"]
            assert parts["gradients"] == pytest.approx(2.0 * parts["parameters"], rel=1e-3)
            assert parts["optimizer_state"] == pytest.approx(state_per_weight * parts["parameters"], rel=1e-3)


@pytest.mark.parametrize("dtype,precision,reference_per_weight", [
    ("bf16", None, 2.0),  # as Megatron-LM keeps bf16 weights: float32 masters
    ("bf16", "megatron", 2.0),
    ("fp16", None, 2.0),
    ("bf16", "nemo-bf16-adam", 1.0),  # no master copy: the optimizer updates the 16-bit weights themselves
    ("fp32", None, 1.0),
])
def test_an_estimates_avgpipe_reference_copies_the_weights_its_optimizer_owns(dtype, precision,
                                                                              reference_per_weight, tmp_path):
    """AvgPipe's reference model is a copy of the weights the optimizer averages (`WeightPolicy.master_copies`):
    beside P = 2 replicas of an estimate's 16-bit weights, the float32 masters its precision keeps, twice their
    bytes (priced as a 16-bit copy before), else the weights; a profile estimated so and read back holds the same."""
    held = ("--dtype", dtype, *(["--precision", precision] if precision else []))
    path = tmp_path / "estimate.json"
    code, _, err = pipesim("estimate", *TINY_GPT[:-4], *held, "--stages", 2, "--out", path)
    assert code == 0, err
    for costs in ((*TINY_GPT[:-2], *held), ("--profile", path, "-p", 2)):
        plain, averaged = simulate_json(*costs, "-s", "1f1b", "-s", "avgpipe")
        for weights, device in zip(plain["devices"], averaged["devices"], strict=True):
            parameters = weights["peak_memory_parts_mb"]["parameters"]
            assert device["peak_memory_parts_mb"]["parameters"] == pytest.approx(
                (2 + reference_per_weight) * parameters, rel=1e-12)


@pytest.mark.parametrize("edit,message", [
    ({"precision": "fp8"}, "precision: choose from fp32, megatron, megatron-16bit-grads, fsdp2, nemo-bf16-adam, "
                           "megatron-bf16-moments (got 'fp8')"),
    ({"precision": "fp32"}, "precision: fp32 holds 32-bit weights; the model is counted in bfloat16"),
])
def test_an_estimated_profile_whose_precision_cannot_hold_is_one_line(edit, message, tmp_path):
    """An estimate's weights are held as its recorded precision says (planning/scenario.py `held_weights`): a
    profile edited to name one unknown, or one that cannot hold its count's dtype, is refused in one line, not a
    traceback."""
    path = tmp_path / "estimate.json"
    code, _, err = pipesim("estimate", *TINY_GPT[:-4], "--dtype", "bf16", "--stages", 2, "--out", path)
    assert code == 0, err
    profile = json.loads(path.read_text())
    profile["estimate"]["parallelism"].update(edit)
    path.write_text(json.dumps(profile))
    code, out, err = pipesim("simulate", "--profile", path, "-p", 2, "-s", "1f1b")
    assert code == 2 and out == "" and err.startswith(f"error: --profile: the estimate's {message}") and \
        err.count("\n") == 1, err


@pytest.mark.parametrize("args,message", [
    (["--precision", "fp8"],
     "--precision: choose from fp32, megatron, megatron-16bit-grads, fsdp2, nemo-bf16-adam, megatron-bf16-moments "
     "(got 'fp8')"),
    (["--profile", PROFILE, "--precision", "megatron"], "--precision: a profile holds"),
    ([*TINY_GPT, "--dtype", "fp32", "--precision", "megatron"],
     "--precision megatron holds 16-bit weights; the model is counted in float32"),
])
def test_a_precision_that_cannot_apply_is_one_line(args, message):
    code, out, err = pipesim("simulate", *args)
    assert code == 2 and out == "" and err.startswith(f"error: {message}") and err.count("\n") == 1


def test_a_trace_whose_breakdown_misses_a_device_is_refused(tmp_path):
    from pipesim.traces import TraceError, read_trace

    path = tmp_path / "t.json"
    assert pipesim("simulate", "--schedule", "1f1b", "--trace", path).code == 0
    doc = json.loads(path.read_text())
    doc["pipesim"]["meta"]["peak_memory_parts"].pop()
    path.write_text(json.dumps(doc))
    with pytest.raises(TraceError, match="peak_memory_parts must hold, for each of the 4 devices"):
        read_trace(path)


def test_the_memory_view_fits_100_columns_with_every_part_whole(monkeypatch):
    from pipesim.commands import common

    monkeypatch.setenv("COLUMNS", "100")
    monkeypatch.setattr(common.stdout, "width", 100)
    args = ["--schedule", "1f1b", "--schedule", "zb-h2", "-p", "4", "-m", "8", "--param-mb", "100",
            "--activation-mb", "10", "--output-mb", "0", "--optimizer", "momentum"]
    code, out, err = pipesim("simulate", *args, "--memory")
    assert code == 0, err
    lines = out.splitlines()
    assert max(map(len, lines)) <= 100
    header = next(line for line in lines if "weights" in line).split()
    assert header == ["schedule", "device", "weights", "gradients", "optimizer", "activations", "buffers", "transient",
                      "peak"]
    rows = [line.split() for line in lines if line.split()[:1] in (["1f1b"], ["zb-h2"])]
    assert rows[0] == ["1f1b", "0", "100", "100", "100", "40", "0", "0", "340"]
    assert rows[1][:2] == ["zb-h2", "0"]
    code, _, err = pipesim("simulate", *args, "--memory", "--json")
    assert code == 2 and err.startswith("error: --memory is a table; --json gives")


def test_the_memory_view_says_what_it_wrote(tmp_path):
    """`--memory --html` wrote the page without a word, where the plain table says "wrote PATH"."""
    page, trace = tmp_path / "m.html", tmp_path / "m.json"
    code, out, err = pipesim("simulate", "-s", "1f1b", "-p", 2, "--memory", "--html", page, "--trace", trace)
    assert code == 0, err
    assert out.splitlines()[-2:] == [f"wrote {trace}", f"wrote {page}"] and page.is_file() and trace.is_file()


def test_sweep_holds_the_precision_it_is_given(tmp_path):
    """Each 1F1B stage of 2 holds half of 100 MiB of 16-bit weights: megatron adds their float32 gradients' second
    half (50 MiB) and Adam's float32 moments and master copy beyond fp32's moments (200 MiB): 250 MiB more."""
    import csv

    peaks = []
    for precision in ("fp32", "megatron"):
        path = tmp_path / f"{precision}.csv"
        code, _, err = pipesim("sweep", "-s", "1f1b", "-p", "2", "-m", "8", "--param-mb", "100", "--precision",
                               precision, "--out", path)
        assert code == 0, err
        (row,) = csv.DictReader(path.open())
        peaks.append(float(row["peak_memory_mb"]))
    assert peaks[1] - peaks[0] == 250


S, H, A = 32, 64, 4  # a small GPT block: sequence, width, heads (fp16, Megatron-LM's 0.1 dropouts)


@pytest.fixture(scope="module")
def gpt_block():
    torch = pytest.importorskip("torch")
    from pipesim.workload.count import count_built

    return count_built("gpt", dict(layers=2, width=H, heads=A, seq_len=S, vocab=128, dropout=0.1), 1,
                       torch.float16).layers[1]


def test_the_count_says_what_saves_each_activation_as_korthikanti_groups_them(gpt_block):
    """Korthikanti et al.'s 34·sbh + 5·as²b (bytes, fp16), grouped by what saves them: the attention's 11·sbh and
    5·as²b less its output dropout's mask, the MLP's 19·sbh less its mask, the norms' 4·sbh, the two 1-byte
    dropout masks; beyond the paper, the attention's s × s causal mask and the norms' float32 mean and 1/std."""
    from collections import Counter

    held = Counter()
    for (_, nbytes), saver in zip(gpt_block.saved_tensors, gpt_block.saved_parts):
        held[saver] += nbytes
    sbh = S * H
    assert held == {"attention": 10 * sbh + 5 * A * S * S + S * S, "mlp": 18 * sbh, "norms": 4 * sbh + 2 * 2 * 4 * S,
                    "dropout": 2 * sbh}


def test_the_estimate_keeps_each_savers_share_and_selective_recomputation_drops_the_attentions_core(gpt_block):
    from pipesim.planning.estimate import Device, Parallelism, estimate_layer, placement_links

    device = Device(A100.dense_tflops.fp16 * 1e9, A100.memory_bandwidth_gb_s * 1e6, A100.curve)

    def kept(**how):
        parallel = Parallelism(tensor=4, sequence_parallel=True, **how)
        return estimate_layer(gpt_block, device, parallel, placement_links(A100, parallel).tensor, 2)

    plain, selective = kept(), kept(recompute="selective")
    for layer in (plain, selective):
        assert sum(layer.activation_parts.values()) == layer.activation_bytes
    # the scores, probabilities, their dropout mask and the causal mask: the core recomputed, 1/t of it on a rank
    assert plain.activation_parts["attention"] - selective.activation_parts["attention"] == (5 * A * S * S
                                                                                           + S * S) // 4
    assert {k: v for k, v in plain.activation_parts.items() if k != "attention"} == {
        k: v for k, v in selective.activation_parts.items() if k != "attention"}
    assert kept(recompute="full").activation_parts == {"attention": 0, "mlp": 0, "norms": 0, "dropout": 0,
                                                       "other": S * H * 2 // 4}


@pytest.fixture(scope="module")
def estimated_gpt(tmp_path_factory):
    path = tmp_path_factory.mktemp("estimate") / "gpt.json"
    code, _, err = pipesim("estimate", "--gpu", "a100-sxm-80gb", "--model", "gpt", "--layers", "4", "--width", H,
                           "--heads", A, "--seq-len", S, "--vocab", 128, "--dropout", 0.1, "--dtype", "fp16",
                           "--stages", 2, "--out", path)
    assert code == 0, err
    return path


@pytest.mark.parametrize("name", [n for n in METHODS if n != "graphpipe"])
def test_the_activations_split_by_saver_sum_to_the_activations_part_in_every_methods_json(name, estimated_gpt):
    result, = simulate_json("--schedule", name, "--profile", estimated_gpt, "-n", "2")
    for device in result["devices"]:
        savers = device["peak_activation_parts_mb"]
        assert sum(savers.values()) == pytest.approx(device["peak_memory_parts_mb"]["activations"], rel=1e-12)
        assert savers["attention"] > 0 and savers["mlp"] > 0 and savers["norms"] > 0 and savers["dropout"] > 0


def test_typed_costs_say_nothing_of_what_saves_the_activations():
    result, = simulate_json("--schedule", "1f1b", "--activation-mb", "10", "--output-mb", "0")
    assert result["devices"][0]["peak_activation_parts_mb"] == {"attention": 0, "mlp": 0, "norms": 0,
                                                                "dropout": 0, "other": 40}


def test_a_trace_whose_savers_do_not_sum_to_its_activations_is_refused(tmp_path):
    from pipesim.traces import TraceError, read_trace

    path = tmp_path / "t.json"
    assert pipesim("simulate", "--schedule", "1f1b", "--trace", path).code == 0
    doc = json.loads(path.read_text())
    doc["pipesim"]["meta"]["peak_activation_parts"][0]["other"] += 1
    path.write_text(json.dumps(doc))
    with pytest.raises(TraceError, match="peak_activation_parts must hold, for each device, bytes that sum"):
        read_trace(path)


@pytest.mark.parametrize("command", [["simulate", "-s", "1f1b", "-p", "4"], ["estimate", "-p", "4", "-o", "OUT"]])
def test_an_unknown_precision_with_gpu_is_one_line_before_the_model_is_counted(command, tmp_path):
    out = tmp_path / "e.json"
    args = [str(out) if a == "OUT" else a for a in command]
    code, _, err = pipesim(*args, "--gpu", "a100-sxm-80gb", "--model", "gpt", "--precision", "bogus")
    assert code == 2 and err.count("\n") == 1 and "--precision: choose from fp32, megatron" in err, err
    assert not out.exists()


def test_the_memory_views_whole_mib_add_up_to_its_peak():
    """Parts of fractional MiB rounded each alone printed 863 beside a peak of 864; rounded at their running
    total, the row adds up."""
    code, out, err = pipesim("simulate", "-s", "1f1b", "-s", "zb-v", "-p", "4", "-m", "8", "--param-mb", "10.4",
                             "--activation-mb", "3.3,2.7,4.4,1.6", "--output-mb", "0.45", "--memory")
    assert code == 0, err
    rows = [[int(v.replace(",", "")) for v in line.split()[-7:]] for line in out.splitlines()
            if line.split() and line.split()[-1].replace(",", "").isdigit() and len(line.split()) >= 8]
    assert len(rows) >= 8
    assert all(sum(row[:6]) == row[6] for row in rows), rows


@pytest.mark.parametrize("name", list(METHODS))
@pytest.mark.parametrize("zero", ["2", "3"])
@pytest.mark.parametrize("profiled", [False, True], ids=["typed", "profile"])
def test_parts_sum_to_the_peak_under_zero_2_and_3(name, zero, profiled):
    if profiled:
        costs = ["--profile", DAG_PROFILE if name == "graphpipe" else PROFILE]
    else:
        costs = ["--param-mb", "96", "--activation-mb", "12", "--output-mb", "3",
                 *(["--graph", "examples/dag.json"] if name == "graphpipe" else [])]
    result, = simulate_json("--schedule", name, *costs, "-n", "2", "--data-parallel", "2", "--zero", zero)
    for device in result["devices"]:
        assert sum(device["peak_memory_parts_mb"].values()) == pytest.approx(device["peak_memory_mb"], rel=1e-12)


def _part_curve(zero: int, part: str, stages: int = 4) -> list[tuple[float, int]]:
    """Device 0's `part` (MiB) over time, 1F1B, m = 8, two mini-batches, d = 2, 100 MiB of weights."""
    schedule = build("1f1b", stages, 8, 2, data_parallel=2, zero=zero)
    costs = Costs.per_stage(schedule.num_stages, fwd_ms=1.0, bwd_ms=2.0, param_mb=100, activation_mb=10, output_mb=0)
    counter = simulate(schedule, costs, Cluster.uniform(schedule.num_devices, 0.1)).counters[f"memory_bytes.{part}"][0]
    return [(float(t), int(v) // MIB) for t, v in zip(counter.times_us, counter.values)]


def test_zero_stages_shard_exactly_their_parts():
    """d = 2, 1F1B: ZeRO-1 halves the optimizer state; ZeRO-2 holds the gradients whole from a stage's first
    backward of a mini-batch until its last (torch's pipelining defers FSDP's reduce-scatter to it), then their
    half until the update; ZeRO-3 holds half the weights, and all of them from the first forward until the last
    backward."""
    args = ["--schedule", "1f1b", "-p", "4", "-m", "8", "--param-mb", "100", "--activation-mb", "10",
            "--output-mb", "0", "--data-parallel", "2"]
    peaks = {zero: [d["peak_memory_parts_mb"] for d in simulate_json(*args, "--zero", str(zero))[0]["devices"]]
             for zero in (0, 1, 2, 3)}
    for k in range(4):
        whole = {"parameters": 100, "gradients": 100, "optimizer_state": 200, "activations": 10 * (4 - k),
                 "communication": 0, "runtime_buffers": 0, "transient": 0, "reserve": 0}
        assert peaks[0][k] == whole
        assert peaks[1][k] == peaks[2][k] == {**whole, "optimizer_state": 100}
        assert peaks[3][k] == {**whole, "parameters": 150, "optimizer_state": 100}
    assert [mib for _, mib in _part_curve(1, "gradients")] == [100]
    grads = _part_curve(2, "gradients")
    assert [mib for _, mib in grads] == [0, 100, 50, 0, 100, 50, 0]
    weights = _part_curve(3, "parameters")
    assert [mib for _, mib in weights] == [50, 150, 50, 150, 50]
    assert [t for t, _ in weights][2] == [t for t, _ in grads][2]  # resharded at the last backward's end


def test_zero_3_with_one_stage_gathers_each_pass():
    """No pipeline (FSDP2 alone): every pass gathers the weights and frees them after, each backward's gradients
    whole until reduce-scattered into the shard, which is whole from the first backward's end until the update."""
    weights = _part_curve(3, "parameters", stages=1)
    assert max(mib for _, mib in weights) == 150 and weights[-1][1] == 50
    assert sum(1 for (_, before), (_, after) in zip(weights, weights[1:]) if after > before) == 2 * 8 * 2
    grads = _part_curve(3, "gradients", stages=1)
    assert [mib for _, mib in grads[:4]] == [0, 100, 50, 150]  # the shard whole once the first backward ends
    assert max(mib for _, mib in grads) == 150 and grads[-1][1] == 0


@pytest.mark.parametrize(("flags", "message"), [
    (["--zero", "2"], "--zero 2 shards over data-parallel replicas: give --data-parallel 2 or more"),
    (["--data-parallel", "2", "--zero", "3", "--sharded-optimizer"], "--sharded-optimizer is --zero 1, but --zero 3"),
    (["--data-parallel", "2", "--zero", "4"], "--zero: choose from 0, 1, 2, 3 (got 4)"),
])
@pytest.mark.parametrize("command", [["simulate", "--schedule", "1f1b"], ["sweep", "--schedule", "1f1b"],
                                     ["estimate", "--gpu", "h100-sxm", "--model", "gpt", "--out", "e.json"]])
def test_bad_zero_is_one_line(command, flags, message, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    code, out, err = pipesim(*command, *flags)
    assert code == 2 and out == "" and len(err.strip().splitlines()) == 1 and message in err


def test_fsdp2_precision_keeps_float32_shards_and_gathers_16_bit_copies():
    """FSDP2's mixed precision as torchtitan sets it, d = 2: 100 MiB of 16-bit weights are 200 MiB stored in
    float32, half of them per replica, beside the 100 MiB gathered; float32 gradients; Adam's two float32 moments
    sharded; no master copy."""
    args = ["--schedule", "1f1b", "-p", "4", "-m", "8", "--param-mb", "100", "--activation-mb", "10",
            "--output-mb", "0", "--data-parallel", "2", "--zero", "3"]
    fsdp2, = simulate_json(*args, "--precision", "fsdp2")
    megatron, = simulate_json(*args, "--precision", "megatron")
    for k, (device, other) in enumerate(zip(fsdp2["devices"], megatron["devices"])):
        held = {"parameters": 100 + 100, "gradients": 200, "optimizer_state": 200, "activations": 10 * (4 - k),
                "communication": 0, "runtime_buffers": 0, "transient": 0, "reserve": 0}
        assert device["peak_memory_parts_mb"] == held
        assert other["peak_memory_parts_mb"] == {**held, "parameters": 50 + 100, "optimizer_state": 300}


def test_an_fsdp2_estimate_stores_float32_weights(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    model = ["--model", "gpt", "--layers", "4", "--width", "256", "--heads", "4", "--seq-len", "128"]
    code, out, err = pipesim("estimate", *model, "--gpu", "h100-sxm", "-p", "2", "--data-parallel", "2", "--zero", "3",
                           "--precision", "fsdp2", "--out", "e.json")
    assert code == 0, err
    assert "ZeRO-3: the profile holds each GPU's whole weights and gradients" in " ".join(out.split())
    code, out, err = pipesim("simulate", "--profile", "e.json", "-s", "1f1b", "-m", "4", "--data-parallel", "2",
                             "--zero", "1")
    assert code == 2 and out == "" and "--profile: estimated with --precision fsdp2" in err
    result, = simulate_json("--profile", "e.json", "-s", "1f1b", "-m", "4", "--data-parallel", "2", "--zero", "3")
    # its own d restated keeps its ZeRO-3 (it was refused, as if --zero 0 had been asked for)
    assert simulate_json("--profile", "e.json", "-s", "1f1b", "-m", "4", "--data-parallel", "2") == [result]
    layers = json.loads((tmp_path / "e.json").read_text())["layers"]
    weights = sum(layer["param_bytes"] for layer in layers[:3]) / MIB  # stage 0's, 16-bit
    assert result["devices"][0]["peak_memory_parts_mb"]["parameters"] == pytest.approx(
        2 * weights / 2 + weights, abs=0.5)


@pytest.mark.parametrize("command", [["simulate", "--schedule", "1f1b"], ["sweep", "--schedule", "1f1b"]])
def test_fsdp2_precision_needs_zero_3(command):
    code, out, err = pipesim(*command, "--data-parallel", "2", "--zero", "2", "--precision", "fsdp2")
    assert code == 2 and out == "" and "--precision fsdp2 is FSDP2's mixed precision" in err


def test_a_sweeps_rows_say_their_zero_and_are_sharded_alike(tmp_path):
    """sweep --zero shards as simulate does: a row's peak is simulate's for the same flags."""
    import csv

    flags = ["--data-parallel", "2", "--zero", "3", "--param-mb", "400", "--activation-mb", "40", "--output-mb", "0"]
    code, _, err = pipesim("sweep", "--schedule", "1f1b", "--stages", "4", "--microbatches", "8", *flags,
                           "--out", tmp_path / "rows.csv")
    assert code == 0, err
    (row,) = list(csv.DictReader((tmp_path / "rows.csv").open()))
    assert row["zero"] == "3"
    result, = simulate_json("--schedule", "1f1b", "-p", "4", "-m", "8", "-n", row["minibatches"],
                            "--data-parallel", "2", "--zero", "3", "--param-mb", "100", "--activation-mb", "10",
                            "--output-mb", "0")
    assert float(row["peak_memory_mb"]) == pytest.approx(result["peak_memory_mb"])


def test_a_schedule_file_with_data_parallel_replicas_is_refused_not_ignored():
    code, out, err = pipesim("simulate", "--schedule-file", "examples/order.csv", "--data-parallel", "2", "--zero", "3")
    assert code == 2 and out == "" and "--data-parallel: the schedule file is one pipeline's ranks" in err


@pytest.mark.parametrize("memory", [[], ["--memory"]])
def test_the_tables_title_says_what_the_replicas_shard(memory):
    code, out, err = pipesim("simulate", "--schedule", "1f1b", "--data-parallel", "2", "--zero", "3", *memory)
    assert code == 0, err
    assert "d=2" in out.splitlines()[0] and out.splitlines()[0].endswith(", ZeRO-3")
