"""The what-if GPU on the command line: `simulate`, `sweep`, `tune` and `estimate` with --gpu count the model on
the meta device, estimate its profile on a catalogue part and go on as with a calibrated --profile; bad input is
one line and exit 2, with nothing written."""

import csv
import json
from pathlib import Path

import pytest

from pipesim.hardware.collectives import all_reduce_ms
from tests.conftest import pipesim, simulate_json
from tests.helpers import GPT_CPU

pytest.importorskip("torch")

SMALL = ("--model", "gpt", "--layers", "3", "--width", "64", "--heads", "4", "--seq-len", "32", "--vocab", "128")
GPU = ("--gpu", "a100-sxm-80gb")
HUGE = ("--model", "gpt", "--layers", "4", "--width", "16384", "--heads", "16", "--seq-len", "64", "--vocab", "128")


@pytest.mark.parametrize("args, fragment", [
    (("simulate", *GPU), "--gpu: give the model to estimate"),
    (("simulate", "--gpu", "nope", *SMALL), "--gpu: unknown 'nope'; known GPUs: a100-sxm-40gb, a100-sxm-80gb"),
    (("simulate", "--layers", "3"), "--layers: only --gpu's estimate reads it"),
    (("simulate", "--tensor-parallel", "2", "--recompute", "full"), "--tensor-parallel, --recompute: only --gpu's"),
    (("simulate", *GPU, *SMALL, "--fwd", "2", "--comm", "1"), "--fwd, --comm: --gpu estimates the costs"),
    (("simulate", *GPU, *SMALL, "--profile", "x.json"), "--profile: --gpu estimates the costs"),
    (("simulate", *GPU, *SMALL, "--recompute", "some"), "--recompute: choose from none, selective, full"),
    (("simulate", *GPU, *SMALL, "--dtype", "int8"), "--dtype: choose from fp32, bf16"),
    (("simulate", *GPU, *SMALL, "--tensor-parallel", "3"), "--tensor-parallel 3 does not divide the model's 4 heads: "
     "give --tensor-parallel 2"),  # the nearest that splits every size: 4 does not split its 2 key/value heads
    (("simulate", *GPU, *SMALL, "--kv-heads", "2", "--tensor-parallel", "4"),
     "--tensor-parallel 4 does not divide the model's 2 key/value heads"),
    (("simulate", *GPU, *SMALL, "--ffn", "90", "--tensor-parallel", "4"),
     "--tensor-parallel 4 does not divide the model's 90 MLP width"),
    (("estimate", *GPU, *SMALL, "-p", "9", "--out", "est.json"), "--stages 9: gpt of 3 blocks (--layers) has 5 layers"),
    (("simulate", *GPU, *SMALL, "-p", "4", "-s", "dualpipev"),
     "error: the schedule's 8 model stages (--stages x --chunks): gpt of 3 blocks (--layers) has 5 layers in all; "
     "give at most 5 stages, or a cut that may leave stages between the first and the last empty (--stage-cut "
     "layout:STRING or layers:N,N,...)"),
    (("simulate", *GPU, "--model", "cnn", "--layers", "3", "-p", "4", "-s", "interleaved-1f1b"),  # all Sequential
     "stages (--stages x --chunks): cnn of 3 blocks (--layers) has 4 layers in all; give at most 4 stages"),
    (("simulate", *GPU, *SMALL[:3], "1", *SMALL[4:], "-p", "2", "-s", "interleaved-1f1b", "--chunks", "2"),
     "stages (--stages x --chunks): gpt of 1 block (--layers) has 3 layers in all"),  # embedding, block, head
    (("tune", *GPU, *SMALL, "-D", "6", "--tensor-parallel", "4"),  # 3 and 6 divide 6, not the model's 4 heads
     "a multiple of --tensor-parallel 4 (got 6); give --devices 4 or 8, or --tensor-parallel 2"),
    (("tune", *GPU, *SMALL[:5], "96", "--heads", "6", *SMALL[8:], "-D", "6", "--tensor-parallel", "4"),
     "a multiple of --tensor-parallel 4 (got 6); give --devices 4 or 8, or --tensor-parallel 3 or 6"),
    (("tune", *GPU, *SMALL, "-D", "12", "--tensor-parallel", "8"),  # none above 8 both divides 12 and splits it
     "a multiple of --tensor-parallel 8 (got 12); give --devices 8 or 16, or --tensor-parallel 4"),
    (("tune", *GPU, *SMALL, "-D", "8", "--tensor-parallel", "2", "--data-parallel", "3"),
     "--data-parallel 3 does not divide 8; give --devices 6 or 12, or --data-parallel 2 or 4"),
    (("tune", "-D", "4"), "--profile or --gpu"),
    (("simulate", "--network-gb-s", "10"), "--network-gb-s prices the gradient all-reduce of data-parallel replicas"),
    (("simulate", *GPU, *SMALL, "--data-parallel", "2", "--network-gb-s", "10"), "--network-gb-s: --gpu estimates"),
    (("simulate", *GPU, *SMALL, "--sequence-parallel"), "--sequence-parallel splits a tensor-parallel group's"),
    (("simulate", *GPU, *SMALL, "--loss-parallel"), "--loss-parallel splits the logits by vocabulary over a "
                                                    "tensor-parallel group (torchtitan's with t > 1): give "),
    (("simulate", "--sharded-optimizer"), "--sharded-optimizer shards over data-parallel replicas"),
    # estimate wrote the profile, which --profile then refused; simulate said "fwd_ms must be a finite number"
    (("estimate", *GPU, *SMALL, "-b", str(10**12), "--out", "est.json"),
     "the estimate at micro-batch size 1,000,000,000,000 (--microbatch-size): layers' "),
    (("simulate", *GPU, *SMALL, "-b", str(10**12)),
     "the estimate at micro-batch size 1,000,000,000,000 (--microbatch-size)"),
    # the scores of math attention summed over a stage's layers past 2**63 bytes wrapped around in int64: a negative
    # wgrad_kept_bytes, StageProfile's traceback
    (("estimate", *GPU, "--model", "gpt", "--layers", "4", "--width", "256", "--heads", "4", "--seq-len", "128",
      "--vocab", "1000", "--dtype", "fp32", "--attention", "math", "-b", str(10**12), "--out", "est.json"),
     "the estimate at micro-batch size 1,000,000,000,000 (--microbatch-size): layers' activation_bytes add up to "
     "1.02e+19, more than the simulator takes (at most 1.13e+15 bytes); give a smaller micro-batch or model\n"),
])
def test_bad_input_is_one_line_exit_2(tmp_path, monkeypatch, args, fragment):
    monkeypatch.chdir(tmp_path)
    code, out, err = pipesim(*args)
    assert code == 2, err
    assert fragment in err and len(err.strip().splitlines()) == 1, err
    assert not list(tmp_path.iterdir())  # nothing written


def test_a_catalogue_cluster_names_its_part_and_bounds_the_gpus(tmp_path):
    catalogue = tmp_path / "mine.toml"
    catalogue.write_text('[cluster.mine]\ngpu = "a100-sxm-80gb"\nnodes = 2\ngpus_per_node = 4\n')
    [result] = simulate_json("--gpu", "mine", "--gpus", catalogue, *SMALL, "-p", 2, "-s", "1f1b",
                             "--tensor-parallel", 2, "--data-parallel", 2)
    assert result["gpus"] == 8
    code, _, err = pipesim("simulate", "--gpu", "mine", "--gpus", catalogue, *SMALL, "-p", 4, "-s", "1f1b",
                           "--tensor-parallel", 2, "--data-parallel", 2)
    assert code == 2 and "--gpu: the cluster has 8 GPUs, fewer than t x p x d = 2 x 4 x 2 = 16" in err


def test_simulate_reports_mfu_tokens_and_memory_per_gpu():
    p, t, d, seq = 2, 2, 2, 32
    one, zb = simulate_json(*GPU, *SMALL, "-p", p, "-m", 4, "--tensor-parallel", t, "--data-parallel", d,
                            "-s", "1f1b", "-s", "zb-h1")
    for result in (one, zb):
        assert result["gpus"] == p * t * d
        assert result["tokens_per_s"] == pytest.approx(result["samples_per_s"] * seq)
        assert 0 < result["mfu"] < 1
        assert all(device["peak_memory_mb"] > 0 and device["out_of_memory"] is False for device in result["devices"])
    assert zb["mfu"] / one["mfu"] == pytest.approx(one["time_per_minibatch_ms"] / zb["time_per_minibatch_ms"])


def test_typed_costs_price_the_all_reduce_on_the_network_given():
    """1F1B's stage 0 ends its backwards last: its all-reduce (256 MiB over d = 4) is exposed whole."""
    shape = ("-p", 4, "-m", 8, "-s", "1f1b", "--data-parallel", 4, "--comm", 0.01)
    [unlimited], [limited] = simulate_json(*shape), simulate_json(*shape, "--network-gb-s", 25)
    ring = [all_reduce_ms(256 * 2**20, 4, 0.01, rate) for rate in (25e6, float("inf"))]
    assert limited["time_per_minibatch_ms"] - unlimited["time_per_minibatch_ms"] == pytest.approx(ring[0] - ring[1])
    assert limited["samples_per_s"] == pytest.approx(4 * 8 / limited["time_per_minibatch_ms"] * 1e3)  # d x m
    [sharded] = simulate_json(*shape, "--network-gb-s", 25, "--sharded-optimizer")  # ZeRO-1: 1/4 of Adam's state
    assert limited["peak_memory_mb"] - sharded["peak_memory_mb"] == pytest.approx(2 * 256 * 3 / 4)


def test_a_model_that_fits_no_device_is_marked_out_of_memory_not_refused():
    """12.9 G parameters with Adam's state in mixed precision (16 bytes each) on two 80 GB GPUs."""
    code, out, err = pipesim("simulate", *GPU, *HUGE, "-p", 2, "-s", "1f1b")
    assert code == 0, err
    assert "OOM on devices 0," in out and "1f1b runs out of memory" in err
    [result] = simulate_json(*GPU, *HUGE, "-p", 2, "-s", "1f1b")
    assert all(device["out_of_memory"] for device in result["devices"])
    [fits] = simulate_json(*GPU, *HUGE, "-p", 2, "-s", "1f1b", "--tensor-parallel", 4)  # a quarter on each GPU
    assert not any(device["out_of_memory"] for device in fits["devices"])


def test_an_estimate_written_and_read_back_simulates_as_the_flags_do(tmp_path):
    est, traced = tmp_path / "est.json", tmp_path / "t.json"
    shape = ("-p", 2, "--tensor-parallel", 2, "--recompute", "selective")
    code, out, err = pipesim("estimate", *GPU, *SMALL, *shape, "--out", est)
    assert code == 0, err
    direct = simulate_json(*GPU, *SMALL, *shape, "-s", "1f1b", "-m", 4)
    [reread] = simulate_json("--profile", est, "-s", "1f1b", "-m", 4, "--trace", traced)
    assert reread["time_per_minibatch_ms"] == direct[0]["time_per_minibatch_ms"]
    assert reread["mfu"] == direct[0]["mfu"]
    meta = json.loads(traced.read_text())["pipesim"]["meta"]
    assert meta["calibration"]["estimate"]["gpu"] == "NVIDIA A100 SXM4 80GB"
    assert meta["calibration"]["estimate"]["parallelism"]["recompute"] == "selective"


def test_the_estimates_peak_is_named_allocated_where_simulate_gpu_adds_the_allocators_reserve(tmp_path):
    """The estimate's table counts the tensors alone; simulate --gpu adds the caching allocator's reserve, so the
    estimate names its column and says why the two peaks differ."""
    code, out, err = pipesim("estimate", *GPU, *SMALL, "-p", 2, "--out", tmp_path / "est.json")
    assert code == 0, err
    assert "alloc MiB" in out and "peak MiB" not in out
    words = " ".join(out.split())  # the caption wraps at the terminal's width
    assert "(max allocated)" in words and "(max reserved, --allocator caching)" in words
    [reserved] = simulate_json(*GPU, *SMALL, "-p", 2, "-s", "1f1b")
    assert reserved["devices"][0]["peak_memory_parts_mb"]["reserve"] > 0


KERNELS = ("--cross-entropy", "megatron", "--rotary-percent", "1", "--rope-kernel", "fused", "--no-swiglu-fusion")


@pytest.fixture(scope="module")
def kernels_estimate(tmp_path_factory) -> Path:
    """An estimate counted with every kernel that is not the default."""
    est = tmp_path_factory.mktemp("kernels") / "est.json"
    code, _, err = pipesim("estimate", *GPU, *SMALL, "-p", 2, *KERNELS, "--out", est)
    assert code == 0, err
    return est


def test_an_estimate_records_the_kernels_it_counted_and_the_costs_line_names_those_not_the_default(
        kernels_estimate, tmp_path):
    parallelism = json.loads(kernels_estimate.read_text())["estimate"]["parallelism"]
    assert (parallelism["cross_entropy"], parallelism["rope_kernel"], parallelism["swiglu_fusion"]) == (
        "megatron", "fused", False)
    code, out, err = pipesim("simulate", "--profile", kernels_estimate, "-s", "1f1b", "-m", 4)
    assert code == 0, err
    assert "no swiglu fusion, cross entropy megatron, rope kernel fused" in " ".join(out.split())
    code, out, err = pipesim("estimate", *GPU, *SMALL, "-p", 2, "--out", tmp_path / "defaults.json")
    assert code == 0, err
    assert not any(name in " ".join(out.split()) for name in ("swiglu", "cross entropy", "rope kernel"))


@pytest.mark.parametrize("args", [
    ("simulate", "-s", "1f1b", "--cross-entropy", "torch"), ("simulate", "-s", "1f1b", "--norm-kernel", "eager"),
    ("simulate", "-s", "1f1b", "--swiglu-fusion"), ("simulate", "-s", "1f1b", "--grad-accumulation", "fused"),
    ("simulate", "-s", "1f1b", "--attention-kernel", "cudnn"),
    ("simulate", "-s", "1f1b", "--recompute-modules", "layernorm"), ("simulate", "-s", "1f1b", "--fp8-recipe", "te"),
    ("simulate", "-s", "1f1b", "--ema", "cpu"), ("sweep", "-s", "1f1b", "--ema", "cpu"),
    ("tune", "--devices", 2, "--ema", "cpu"), ("simulate", "-s", "1f1b", "--no-swiglu-fusion"),
    ("tune", "--devices", 2, "--no-sequence-parallel"),
])
def test_a_setting_the_profile_was_priced_with_given_again_beside_it_is_refused_in_one_line(kernels_estimate, args):
    code, out, err = pipesim(*args, "--profile", kernels_estimate)
    assert code == 2 and out == "" and len(err.strip().splitlines()) == 1, err
    setting = [arg for arg in args if str(arg).startswith("--")][-1]
    assert err.startswith(f"error: {setting}: --profile's costs are priced already"), err


@pytest.mark.parametrize("command", [("simulate", "-s", "1f1b"), ("sweep", "-s", "1f1b"), ("tune", "--devices", 2)])
def test_a_model_setting_beside_a_calibrated_profile_names_calibrate_not_estimate(command):
    """A calibration's costs were measured: the refusal of --layers beside it names calibrate's flag (it said to
    write another with `pipesim estimate`), and one calibrate does not take (--tensor-parallel) only --gpu."""
    calibration = GPT_CPU
    code, out, err = pipesim(*command, "--profile", calibration, "--layers", 4, "--tensor-parallel", 2)
    assert code == 2 and out == "" and len(err.strip().splitlines()) == 1, err
    assert err.startswith("error: --layers, --tensor-parallel: --profile's costs were measured by `pipesim calibrate`")
    assert "calibrate again with `pipesim calibrate ... --layers`, or give --gpu NAME" in err
    assert "pipesim estimate" not in err
    code, _, err = pipesim(*command, "--profile", calibration, "--tensor-parallel", 2)
    assert code == 2 and "settings; give --gpu NAME and --model in place of --profile" in err, err


@pytest.mark.parametrize("command", [("simulate", "-s", "1f1b"), ("sweep", "-s", "1f1b"), ("tune", "--devices", 2)])
def test_a_model_setting_beside_a_file_that_is_not_a_profile_refuses_the_file(command, tmp_path):
    """The refusal of --layers beside --profile reads the profile to say whether it was estimated: a file that is
    not one is refused by the profile's own checks, not taken for an estimate."""
    (tmp_path / "notes.json").write_text('{"fwd": 1}')
    code, out, err = pipesim(*command, "--profile", tmp_path / "notes.json", "--layers", 4)
    assert code == 2 and out == "" and len(err.strip().splitlines()) == 1, err
    assert err.startswith("error: --profile: profile ") and "schema_version: missing" in err, err


def test_a_switch_turned_off_is_named_as_given_and_estimate_is_told_only_flags_it_takes(kernels_estimate):
    """--no-swiglu-fusion and tune's --no-sequence-parallel read as their on sides; estimate has no
    --no-sequence-parallel (off is its default), so the refusal does not tell to write one with it."""
    code, _, err = pipesim("simulate", "-s", "1f1b", "--no-swiglu-fusion")
    assert code == 2 and err.startswith("error: --no-swiglu-fusion: only --gpu's estimate reads it"), err
    code, _, err = pipesim("tune", "--devices", 2, "--no-sequence-parallel", "--profile", kernels_estimate)
    assert code == 2 and "write another with `pipesim estimate ...`, or" in err, err


def test_tune_searches_t_d_b_and_recomputation_under_the_gpu_memory():
    code, out, err = pipesim("tune", *GPU, *SMALL, "-D", 4, "-s", "1f1b", "--recompute", "none", "--json")
    assert code == 0, err
    document = json.loads(out)
    rows = [document["choice"], *document["runners_up"]]
    assert document["problem"]["memory_cap_gib"] == pytest.approx(79.15)  # what torch is given of 80
    assert len({row["microbatch_size"] for row in rows}) > 1  # b searched
    assert len({row["tensor_parallel"] for row in rows}) > 1  # t searched (4 heads: 1, 2, 4)
    for row in rows:
        assert row["stages"] * row["replicas"] * row["tensor_parallel"] == 4 and row["recompute"] == "none"
        assert 0 < row["mfu"] < 1
    code, out, err = pipesim("tune", *GPU, *SMALL, "-D", 4, "-s", "1f1b", "--recompute", "none")
    assert code == 0 and "MFU" in out and "recomp" in out, err


def test_sweep_estimates_each_depth_and_runs_d_replicas(tmp_path):
    out = tmp_path / "r.csv"
    code, _, err = pipesim("sweep", *GPU, *SMALL, "-p", "1,2", "-m", 4, "-s", "1f1b", "--data-parallel", 2, "-j", 1,
                           "--out", out)
    assert code == 0, err
    rows = list(csv.DictReader(out.open()))
    assert [(row["stages"], row["data_parallel"], row["status"]) for row in rows] == [("1", "2", "ok"),
                                                                                      ("2", "2", "ok")]
    [one] = simulate_json(*GPU, *SMALL, "-p", 2, "-m", 4, "-s", "1f1b", "--data-parallel", 2, "-n", 4)
    assert float(rows[1]["time_per_minibatch_ms"]) == pytest.approx(one["time_per_minibatch_ms"])


def test_a_built_in_models_count_is_kept_and_read_back_without_counting(tmp_path, monkeypatch):
    from pipesim.workload import count as counting

    monkeypatch.setenv("PIPESIM_CACHE_DIR", str(tmp_path))
    first = simulate_json(*GPU, *SMALL, "-s", "1f1b", "-p", "2")
    kept = list((tmp_path / "counts").iterdir())
    assert len(kept) == 1

    def refuse(*args, **kwargs):
        raise AssertionError("counted again although the count was kept")

    monkeypatch.setattr(counting, "count_built", refuse)
    assert simulate_json(*GPU, *SMALL, "-s", "1f1b", "-p", "2") == first  # read back: the same prediction
    with pytest.raises(AssertionError, match="counted again"):  # another micro-batch size is another count
        simulate_json(*GPU, *SMALL, "-s", "1f1b", "-p", "2", "-b", "2")
    kept[0].write_text("{not json")  # a damaged file is counted again, not an error
    with pytest.raises(AssertionError, match="counted again"):
        simulate_json(*GPU, *SMALL, "-s", "1f1b", "-p", "2")


def test_a_change_to_any_code_the_count_is_made_by_counts_again(tmp_path, monkeypatch):
    """A kept count's key reads all of workload/: a list by hand left out optim.py, whose change to the optimizer
    step the count takes moved a GPT's estimate (3677.506 -> 3685.586 ms) while a count kept before was read back."""
    from pipesim.commands.estimate import _count_cache

    monkeypatch.setenv("PIPESIM_CACHE_DIR", str(tmp_path))
    shape = ("gpt", {"layers": 2}, 1, "bfloat16", "math", False, True, "torch", "eager", "eager", "none", False)
    kept = _count_cache(*shape)
    read_bytes = Path.read_bytes
    monkeypatch.setattr(Path, "read_bytes", lambda path: read_bytes(path) + b"#" * (path.name == "optim.py"))
    assert _count_cache(*shape) != kept


def test_a_count_that_cannot_be_kept_leaves_no_temporary_file(tmp_path, monkeypatch):
    """The count is written beside its file and renamed over it: a rename that fails (here, every one) skips the
    cache and leaves nothing behind (it left a .tmp file in counts/ each time)."""
    import os

    monkeypatch.setenv("PIPESIM_CACHE_DIR", str(tmp_path))

    def fails(*_):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(os, "replace", fails)
    (result,) = simulate_json(*GPU, *SMALL, "-s", "1f1b", "-p", "2")  # priced on the count it could not keep
    assert result["makespan_ms"] > 0 and list((tmp_path / "counts").iterdir()) == []


def test_dropout_is_counted_and_priced():
    plain, dropped = (simulate_json(*GPU, *SMALL, "-s", "gpipe", "-p", "2", "--allocator", "none", *extra)[0]
                      for extra in ((), ("--dropout", "0.1")))
    assert dropped["time_per_minibatch_ms"] > plain["time_per_minibatch_ms"]
    assert dropped["peak_memory_mb"] > plain["peak_memory_mb"]  # its masks are kept for the backward (allocated)


def test_curve_from_a_calibration_fits_the_part_to_its_measured_layers(tmp_path):
    from statistics import median

    from pipesim.hardware.catalogue import load_catalogue
    from pipesim.planning.estimate import FIT_ATTENTION
    from pipesim.profiles.schema import load_profile

    calibration = GPT_CPU
    measured = load_profile(calibration)
    shape = [f"--{key.replace('_', '-')}={value}" for key, value in measured.model.options.items()]
    def estimate(b: int) -> tuple:  # the kernel torch ran there, as the fit counts
        return ("estimate", *GPU, "--model", "gpt", *shape, "-b", b, "--dtype", "fp32", "--attention", FIT_ATTENTION,
                "--out")

    args = estimate(measured.environment.microbatch_size)
    code, out, err = pipesim(*args, str(tmp_path / "fitted.json"), "--curve-from", str(calibration))
    assert code == 0, err
    part = load_catalogue().gpu[GPU[1]].name
    assert err == (f"note: --curve-from {calibration} was calibrated on the cpu ({measured.environment.device_name}): "
                   f"{part} is priced at that device's own rates, not a GPU's (calibrate on the part: --device "
                   "cuda)\n")  # a fit's check: taken, but not in silence
    code, out, err = pipesim(*estimate(10**12), tmp_path / "huge.json", "--curve-from", calibration)
    assert code == 2 and err.startswith("error: the estimate at micro-batch size") and err.count("\n") == 1, err
    fitted = load_profile(tmp_path / "fitted.json")
    assert "fitted to" in fitted.estimate.curve["source"] and "gpt-cpu.json" in fitted.estimate.curve["source"]
    errors = [abs(estimated.fwd.median_ms / timed.fwd.median_ms - 1)
              for estimated, timed in zip(fitted.layers, measured.layers)]
    assert median(errors) < 0.25  # the CPU's own layers, from a curve fitted to them (the catalogue's: 1000x off)
    code, out, err = pipesim(*args, str(tmp_path / "bad.json"), "--curve-from", str(tmp_path / "fitted.json"))
    assert code == 0, err  # an estimate is a profile too, though fitting to one only gives its curve back
    code, out, err = pipesim(*args, str(tmp_path / "no.json"), "--curve-from", str(tmp_path / "missing.json"))
    assert code == 2 and err.startswith("error: --curve-from:") and len(err.strip().splitlines()) == 1, err


# Every setting whose value was read with its default standing in for an empty one (a MoE with each parallelism on)
EVERY_SETTING = ("--gpu", "h100-sxm", "--model", "gpt", "--layers", "2", "--width", "64", "--heads", "4", "--seq-len",
                 "96", "--experts", "4", "--data-parallel", "2", "--expert-parallel", "2", "--attention", "flash",
                 "--context-parallel", "2", "--dtype", "fp8", "--tensor-parallel", "2", "--sequence-parallel")


@pytest.mark.parametrize("flag, choices", [
    ("--recompute", "none, selective, full, op"), ("--expert-gemm", "grouped, per-expert"),
    ("--rank-order", "pipesim, megatron"), ("--routing", "balanced, random"), ("--tp-runtime", "megatron, torch"),
    ("--cp-rotate", "alltoall, allgather, p2p"), ("--attention-kernel", "flash2, cudnn, flash3"),
    ("--fp8-recipe", "te, torchao, te-current, deepseek, torchao-2024")])
def test_an_empty_choice_is_refused_not_run_as_the_default(tmp_path, monkeypatch, flag, choices):
    """`--expert-gemm ''` ran as grouped (the value read as `or "grouped"`), and `--recompute ''` raised a
    traceback past the check that let it through as none."""
    monkeypatch.chdir(tmp_path)
    code, out, err = pipesim("simulate", "-s", "1f1b", "-p", "2", "-m", "4", *EVERY_SETTING, flag, "", "--html",
                             "t.html")
    assert (code, out, err) == (2, "", f"error: {flag}: choose from {choices} (got '')\n")
    assert not list(tmp_path.iterdir())
