"""The device's efficiency curve that `pipesim calibrate` fits to its own measured layers and stores (issue 29):
stored and read back, preferred by --curve-from, fitted at use where a profile has none, and a fit on a CPU
calibration held against that calibration's layers and another size's."""

import json
import statistics
from pathlib import Path

import pytest

from pipesim.profiles.schema import ProfileError, load_profile, profile_json
from tests.conftest import pipesim
from tests.helpers import A100
from tests.helpers import H200 as H200_PART

torch = pytest.importorskip("torch")

TRACES = Path(__file__).resolve().parents[1] / "traces" / "profiles" / "fit-curve"  # layers only: no link
H200 = Path(__file__).resolve().parents[1] / "traces" / "measured" / "gpu-check-h200" / "profile.json"
TINY = ("--model", "gpt", "--layers", "1", "--width", "128", "--heads", "2", "--seq-len", "64", "--vocab", "64")
ESTIMATE = ("estimate", "--gpu", "a100-sxm-80gb", *TINY, "-b", "2", "--dtype", "fp32")


@pytest.fixture(scope="module")
def calibrated(tmp_path_factory) -> tuple[Path, str]:
    """A tiny gpt calibrated (its layers only): the profile and what calibrate printed."""
    path = tmp_path_factory.mktemp("calibrated") / "tiny.json"
    code, out, err = pipesim("calibrate", *TINY, "-b", "2", "--device", "cpu", "--stages", "1", "--repeats", "3",
                             "--warmup", "1", "--no-links", "--no-runtime", "--no-contention", "--out", path)
    assert code == 0, err
    return path, out


def test_calibrate_stores_the_fitted_curve_and_it_round_trips(calibrated, tmp_path):
    from pipesim.commands.estimate import fit_count
    from pipesim.planning.estimate import FIT_ATTENTION, fit_rates

    path, out = calibrated
    profile = load_profile(path)
    fitted = profile.fitted_curve
    assert fitted is not None and fitted.passes == ["fwd", "bwd", "igrad"] and fitted.matmul_flops_per_ms > 0
    assert (fitted.multiprocessors, fitted.tiles) == (1, [(1, 1)])  # a CPU: no tile quantisation
    assert fitted.kernel_overhead_measured and 0 < fitted.kernel_overhead_ms < 0.1  # microseconds, timed
    assert fitted.kernel_overhead_on_device  # on the device's clock (a CPU's: the host's, its ops run as issued)
    assert all(len(residuals) == len(profile.layers) for residuals in fitted.residuals.values())
    assert fitted.residuals["igrad"][0] is None  # the embedding's input is the batch: no input gradient
    assert fitted.attention == FIT_ATTENTION
    counted = fit_count(profile, "the test")
    refitted = fit_rates(profile, counted, 1, [(1, 1)], fitted.kernel_overhead_ms)  # calibrate's fit, as it stored it
    assert (fitted.matmul_flops_per_ms, fitted.memory_bytes_per_ms) == pytest.approx(
        (refitted.matmul_flops_per_ms, refitted.memory_bytes_per_ms), rel=1e-6)
    said = out[out.index("efficiency curve (stored"):].split("\nhost ")[0]  # wrapped at the console's width
    assert "products" in said and "fit error" in said
    assert profile_json(load_profile(path)) == path.read_text()  # read back, written again: the same text
    raw = json.loads(path.read_text())
    raw["fitted_curve"]["residuals"]["fwd"].append(0.1)  # one more layer than the profile has
    (tmp_path / "bad.json").write_text(json.dumps(raw))
    with pytest.raises(ProfileError, match="fitted_curve.residuals"):
        load_profile(tmp_path / "bad.json")


def test_curve_from_prefers_the_stored_curve_and_fits_a_profile_without_one(calibrated, tmp_path, monkeypatch):
    """The stored curve is the module's fresh calibration's, its rates set here (a CPU's: 0.125 TFLOP/s products,
    attention and memory-bound bytes at 1 TFLOP/s and 10 GB/s); the fits at use are of the committed w256
    calibration (`TRACES`), whose times are fixed: a fresh tiny calibration's few layers hardly tell the kernel
    overhead from the memory-bound bytes, and on a loaded host the free fit put the bytes at 7.25 times the A100's
    bandwidth, which --curve-from rightly refused."""
    from pipesim.planning import estimate
    from pipesim.planning.estimate import FIT_ATTENTION

    path, _ = calibrated
    raw = json.loads(path.read_text())
    raw["fitted_curve"].update(matmul_flops_per_ms=1.25e8,  # 0.125 TFLOP/s, which no fit of this calibration gives
                               attention_flops_per_ms=1e9, memory_bytes_per_ms=1e7)
    stored = tmp_path / "stored.json"
    stored.write_text(json.dumps(raw))
    fit_rates = estimate.fit_rates

    def refuse(*args, **kwargs):
        raise AssertionError("fitted although the profile stores its curve")

    monkeypatch.setattr(estimate, "fit_rates", refuse)
    code, out, err = pipesim(*ESTIMATE, "--curve-from", stored, "--out", tmp_path / "from-stored.json")
    assert code == 0, err
    curve = load_profile(tmp_path / "from-stored.json").estimate.curve
    assert curve["matmul_efficiency"] == pytest.approx(0.125 / 19.5)  # the A100's fp32 peak: 19.5 TFLOP/s
    assert curve["source"].startswith(f"stored by pipesim calibrate in {stored}")
    committed = json.loads((TRACES / "gpt-cpu-w256.json").read_text())
    committed_curve = committed.pop("fitted_curve")  # a profile from before calibrate stored its curve
    old = tmp_path / "old.json"
    old.write_text(json.dumps(committed))
    with pytest.raises(AssertionError, match="fitted although"):
        pipesim(*ESTIMATE, "--curve-from", old, "--out", tmp_path / "from-old.json")
    monkeypatch.setattr(estimate, "fit_rates", fit_rates)
    code, out, err = pipesim(*ESTIMATE, "--curve-from", old, "--out", tmp_path / "from-old.json")
    assert code == 0, err
    source = load_profile(tmp_path / "from-old.json").estimate.curve["source"]
    assert source.startswith(f"fitted to {old}") and "stored curve" not in source
    committed["fitted_curve"] = {**committed_curve, "attention": FIT_ATTENTION,  # only the tiles differ:
                                 "tiles": [[2, 1]]}  # fitted on a part whose products fill other tiles: passed over
    other = tmp_path / "other-tiles.json"
    other.write_text(json.dumps(committed))
    code, out, err = pipesim(*ESTIMATE, "--curve-from", other, "--out", tmp_path / "from-other.json")
    assert code == 0, err
    source = load_profile(tmp_path / "from-other.json").estimate.curve["source"]
    assert source.startswith(f"fitted to {other}") and ", not its stored curve (fitted on other tiles); " in source


def test_a_curve_fitted_to_one_committed_cpu_calibration_predicts_its_layers_and_another_widths():
    """traces/profiles/fit-curve/gpt-cpu-w256.json and -w512.json: the same small gpt at widths 256 and 512, calibrated
    one after the other on a 2-core CPU (one thread, layers only; docs/hardware.md). The curve fitted to the
    narrow one's layers on today's count (the curve calibrate stored there is its fit on the count of its time:
    derived data, which a change to the count moves) gives back those layers' fitted passes within 10 % (median)
    and predicts the wider model's four passes within 15 % (median) and 40 % (worst layer), against a noise floor
    of 2-13 % median for a size calibrated twice. Measured there since 76cc5ba (the embedding's gather counted by
    the rows it reads): 10, 5, 0.6 and 7 % median; worst 36 %, the embedding's weight pass. The worst bound was
    35 % until then, restated at 40 % for a reason in the measurement, not the model: for a layer whose input is
    the batch the weight pass is the same autograd call as its full backward, and calibrate timed it 1.46x (w512)
    and 1.63x (w256) that backward (1.71x in a fresh w256 calibration), so that one layer's own spread exceeds 35 %
    (22 % worst before, the embedding's backward, whose bytes the count then overstated). Counted with the flash
    kernel torch ran there (`FIT_ATTENTION`; the math path's scores before): its own passes back within 4, 3 and
    4 % (8, 2 and 6 before), the wider model's 9, 7, 4 and 9 % median (10, 5, 0.6, 7), worst 38 %, the same pass."""
    from pipesim.commands.estimate import fit_count
    from pipesim.planning.estimate import (
        CALIBRATED_OPS,
        Device,
        Parallelism,
        curve_for,
        estimate_layer,
        fit_rates,
    )
    from pipesim.profiles.schema import PASSES, EstimateLink

    def counted(profile):
        return fit_count(profile, "the test")

    narrow, wide = (load_profile(TRACES / f"gpt-cpu-w{width}.json") for width in (256, 512))
    fitted = fit_rates(narrow, counted(narrow), 1, [(1, 1)])  # calibrated before calibrate timed the kernel overhead
    assert all(fitted.error(name)[0] < 0.10 for name in fitted.passes), fitted.residuals
    curve = curve_for(fitted, 1e9, 1e8, A100.curve, "a nominal 1 TFLOP/s, 100 GB/s part")
    device = Device(1e9, 1e8 * curve.memory_efficiency, curve)
    link = EstimateLink(kind="nvlink", latency_ms=0.0, bytes_per_ms=1.0)  # one GPU: no collective priced
    for name in PASSES:
        errors = [abs(getattr(estimate_layer(layer, device, Parallelism(), link, 4), f"{CALIBRATED_OPS[name]}_ms")
                      / getattr(timed, name).median_ms - 1)
                  for layer, timed in zip(counted(wide).layers, wide.layers) if layer.ops.get(CALIBRATED_OPS[name])]
        assert statistics.median(errors) < 0.15 and max(errors) < 0.40, (name, errors)


H200_SHAPE = ("--model", "gpt", "--layers", "8", "--width", "2048", "--heads", "16", "--seq-len", "1024", "--vocab",
              "32000", "-b", "4", "--dtype", "bfloat16")
HOST_TIMED = "its kernel overhead timed on the host's clock: the part's 4.0 us a kernel taken"


def test_the_h200_calibration_fits_below_the_parts_datasheet_and_curve_from_prices_it(tmp_path):
    """traces/measured/gpu-check-h200/profile.json: a gpt of 8 blocks (width 2048, sequence 1024, vocabulary 32,000,
    micro-batch 4, bfloat16) calibrated on an H200, where torch's attention ran its flash kernel. The curve stored
    there was fitted on the math path's count, whose blocks carry s x s scores and kernels that kernel never ran:
    products at 1.12 PFLOP/s, above the part's 989 TFLOP/s, and --curve-from refused it. Fitted on the count of the
    kernel that ran (`FIT_ATTENTION`, here at use since the stored one was fitted on another), less the part's
    kernel overhead (its calibration timed the host's issue of one, 7.4 us), every rate is below the H200's
    datasheet figure (products 636 TFLOP/s, attention 337, memory-bound 4.0 TB/s of 4.8; 663, 382 and 3.9 less
    the host's 7.4 us) and the estimate prices with it."""
    from pipesim.commands.estimate import fit_count
    from pipesim.planning.estimate import CUDA_TILES, PEAK_DTYPE, fit_rates

    profile = load_profile(H200)
    env, part = profile.environment, H200_PART
    stored = profile.fitted_curve
    assert stored.attention == "math" and stored.matmul_flops_per_ms > 1e12  # 1.12 PFLOP/s, as calibrate fitted it
    counted = fit_count(profile, "the test")
    fitted = fit_rates(profile, counted, stored.multiprocessors, CUDA_TILES, part.curve.kernel_overhead_ms)
    peak_flops_per_ms = getattr(part.dense_tflops, PEAK_DTYPE[env.dtype]) * 1e9
    assert fitted.matmul_flops_per_ms < peak_flops_per_ms and fitted.attention_flops_per_ms < peak_flops_per_ms
    assert fitted.memory_bytes_per_ms < part.memory_bandwidth_gb_s * 1e6
    code, out, err = pipesim("estimate", "--gpu", "h200", *H200_SHAPE, "--stages", "2", "--curve-from", H200,
                             "--out", tmp_path / "estimate.json")
    assert code == 0, err
    curve = load_profile(tmp_path / "estimate.json").estimate.curve
    assert curve["source"].startswith(f"fitted to {H200}")
    assert f", not its stored curve (attention counted as math, {HOST_TIMED}); " in curve["source"]  # why, not silently
    assert curve["matmul_efficiency"] == pytest.approx(fitted.matmul_flops_per_ms / peak_flops_per_ms)


def test_curve_from_takes_the_parts_kernel_overhead_where_calibrate_timed_its_hosts_issue(tmp_path):
    """traces/measured/gpu-check-h200-day9-idle-passes/profile.json: the 8-block gpt calibrated on the H200 again,
    whose kernel overhead calibrate/kernel.py then timed on the host's clock, a chain of one-element adds issued
    from Python: 9.7 us an add (6.2 us in the calibration before it, traces/measured/gpu-check-h200-day9), the
    host's issue, which the layers the fit subtracts it from hide behind their kernels. Less 9.7 us a kernel, the
    fit put the products at 993 TFLOP/s, above the part's 989, and --curve-from refused the profile (exit 2). The
    stored curve is passed over, said so, and the layers fitted less the part's kernel overhead: products 0.907 of
    the datasheet (0.923 on the calibration before, 0.955 with its own host's 6.2 us); a curve whose overhead was
    timed on the device's clock is taken as stored."""
    from pipesim.commands.estimate import fit_count
    from pipesim.planning.estimate import CUDA_TILES, PEAK_DTYPE, fit_rates

    again = H200.parents[1] / "gpu-check-h200-day9-idle-passes" / "profile.json"
    profile = load_profile(again)
    part = H200_PART
    stored = profile.fitted_curve
    assert stored.kernel_overhead_measured and not stored.kernel_overhead_on_device
    fitted = fit_rates(profile, fit_count(profile, "the test"), stored.multiprocessors, CUDA_TILES,
                       part.curve.kernel_overhead_ms)
    peak_flops_per_ms = getattr(part.dense_tflops, PEAK_DTYPE[profile.environment.dtype]) * 1e9
    estimate = ("estimate", "--gpu", "h200", *H200_SHAPE, "--stages", "2", "--curve-from")
    code, out, err = pipesim(*estimate, again, "--out", tmp_path / "estimate.json")
    assert code == 0, err
    curve = load_profile(tmp_path / "estimate.json").estimate.curve
    assert curve["source"].startswith(f"fitted to {again}") and f"stored curve ({HOST_TIMED}); " in curve["source"]
    assert curve["matmul_efficiency"] == pytest.approx(fitted.matmul_flops_per_ms / peak_flops_per_ms)
    assert 0.85 < curve["matmul_efficiency"] < 0.95 and curve["kernel_overhead_ms"] == part.curve.kernel_overhead_ms
    raw = json.loads(again.read_text())
    raw["fitted_curve"]["kernel_overhead_on_device"] = True  # the same curve, as if timed on the device
    (tmp_path / "on-device.json").write_text(json.dumps(raw))
    code, out, err = pipesim(*estimate, tmp_path / "on-device.json", "--out", tmp_path / "stored.json")
    assert code == 0, err  # products 1.004 as stored: refitted with the attention held (`separated_fit`)
    curve = load_profile(tmp_path / "stored.json").estimate.curve
    assert ", refitted with the attention held at the part's 0.35 of the datasheet (" in curve["source"]
    assert curve["matmul_efficiency"] < 1 and curve["kernel_overhead_ms"] == stored.kernel_overhead_ms


MASTERS = H200.parents[1] / "gpu-check-h200-day9-masters" / "profile.json"


def test_curve_from_holds_the_attention_where_the_layers_do_not_separate_it_from_the_products(tmp_path):
    """traces/measured/gpu-check-h200-day9-masters/profile.json: the 8-block gpt on the H200 once more, its kernel
    overhead timed on the device (1.8 us). Its layers' fwd and bwd are within 2 % of the calibration before
    (gpu-check-h200-day9-idle-passes), its blocks' igrad 25 % slower (1.042 ms, spread 0.11; 0.833 before). A
    block's attention and products come in near-fixed ratio in every pass, so the fit splits them by the igrad's
    excess over the fwd: the stored curve puts the attention at 0.085 of the datasheet and the products at 1.33,
    above what the part can, and --curve-from refused the profile (exit 2). The attention is held at the part's
    catalogue efficiency and the rest refitted: products 0.77, said so in the curve's source. A part whose
    datasheet the layers outran even so (an A100's 312 TFLOP/s) is still refused."""
    from pipesim.commands.estimate import fit_count
    from pipesim.planning.estimate import CUDA_TILES, PEAK_DTYPE, fit_rates

    profile = load_profile(MASTERS)
    part = H200_PART
    stored = profile.fitted_curve
    peak_flops_per_ms = getattr(part.dense_tflops, PEAK_DTYPE[profile.environment.dtype]) * 1e9
    assert stored.kernel_overhead_on_device and stored.matmul_flops_per_ms > 1.3 * peak_flops_per_ms
    estimate = ("estimate", *H200_SHAPE, "--stages", "2", "--curve-from", MASTERS)
    code, out, err = pipesim(*estimate, "--gpu", "h200", "--out", tmp_path / "estimate.json")
    assert code == 0, err
    curve = load_profile(tmp_path / "estimate.json").estimate.curve
    held = fit_rates(profile, fit_count(profile, "the test"), stored.multiprocessors, CUDA_TILES,
                     stored.kernel_overhead_ms, part.curve.attention_efficiency * peak_flops_per_ms)
    assert curve["source"].startswith(f"stored by pipesim calibrate in {MASTERS}")
    assert ("refitted with the attention held at the part's 0.35 of the datasheet (the layers do not separate it "
            "from the products: fitted free, products 1.33, attention 0.0851); fit error") in curve["source"]
    assert curve["matmul_efficiency"] == pytest.approx(held.matmul_flops_per_ms / peak_flops_per_ms)
    assert 0.7 < curve["matmul_efficiency"] < 0.85
    assert curve["attention_efficiency"] == pytest.approx(part.curve.attention_efficiency)
    assert curve["kernel_overhead_ms"] == stored.kernel_overhead_ms
    code, out, err = pipesim(*estimate, "--gpu", "a100-sxm-80gb", "--out", tmp_path / "a100.json")
    assert code == 2 and "--curve-from: matmul_efficiency: the fit gives" in err
    assert not (tmp_path / "a100.json").exists()


def test_fit_curve_takes_the_parts_kernel_overhead_where_a_gpu_calibration_timed_its_hosts_issue():
    """benchmarks/fit_curve.py fits a size's calibrations less the kernel overhead they timed, by the same rule as
    --curve-from (commands/estimate.py `timed_overhead_ms`): the H200 calibration of day 9 timed its host's issue
    of the chain (9.7 us an add), so the part's is taken; a CPU's chain runs as it is issued, so its own is; a
    calibration from before calibrate timed one leaves the fit to find it."""
    from tests.conftest import script_module

    again = load_profile(H200.parents[1] / "gpu-check-h200-day9-idle-passes" / "profile.json")
    assert again.fitted_curve.kernel_overhead_ms > 0.009
    untimed = load_profile(TRACES / "gpt-cpu-w256.json")  # calibrated before the overhead was timed
    timed = untimed.model_copy(update={"fitted_curve": untimed.fitted_curve.model_copy(
        update={"kernel_overhead_ms": 0.002, "kernel_overhead_measured": True})})
    with script_module("fit_curve") as fit_curve:
        assert fit_curve.measured_overhead([again], 0.004) == 0.004
        assert fit_curve.measured_overhead([timed], 0.004) == 0.002
        assert fit_curve.measured_overhead([untimed], 0.004) is None


def test_fit_curve_holds_the_attention_as_curve_from_does_and_refuses_an_outrun_part_in_one_line(monkeypatch, capsys):
    """benchmarks/fit_curve.py --gpu fits a GPU calibration as --curve-from does (`separated_fit`): the
    day9-masters profile, whose free fit puts the products at 1.33 of the H200's datasheet, is refitted with the
    attention held (products 0.77, as --curve-from's); an A100's datasheet the layers outran is refused in one line,
    exit 2 (both were a traceback)."""
    from tests.conftest import script_module

    with script_module("fit_curve") as fit_curve:
        monkeypatch.setattr("sys.argv", ["fit_curve.py", str(MASTERS), "--gpu", "h200"])
        fit_curve.main()
        out = capsys.readouterr().out
        assert "refitted with the attention held at the part's 0.35 of the datasheet" in out
        assert "products 761" in out  # GFLOP/s: 0.77 of the H200's 989 TFLOP/s
        monkeypatch.setattr("sys.argv", ["fit_curve.py", str(MASTERS), "--gpu", "a100-sxm-80gb"])
        with pytest.raises(SystemExit) as exited:
            fit_curve.main()
    err = capsys.readouterr().err
    assert exited.value.code == 2 and "matmul_efficiency: the fit gives" in err and "Traceback" not in err


@pytest.mark.parametrize("flags,message", [
    ([], "error: give calibrations, or --calibrate DIR"),
    (["/nonexistent/profile.json"], "error: cannot read profile /nonexistent/profile.json"),
    ([str(TRACES / "gpt-cpu-w256.json"), "--gpu", "h300"], "error: --gpu: unknown GPU 'h300' (did you mean "),
])
def test_fit_curve_refuses_no_calibrations_a_file_that_is_no_profile_and_an_unknown_part_in_one_line(
        monkeypatch, capsys, flags, message):
    from tests.conftest import script_module

    with script_module("fit_curve") as fit_curve:
        monkeypatch.setattr("sys.argv", ["fit_curve.py", *flags])
        with pytest.raises(SystemExit) as exited:
            fit_curve.main()
    err = capsys.readouterr().err
    assert exited.value.code == 2 and err.startswith(message) and err.count("\n") == 1


def test_every_fit_counts_a_calibration_as_it_ran(calibrated):
    """`fit_count`, the one count calibrate, --curve-from and benchmarks/fit_curve.py fit a curve on: attention as
    the fused kernel torch ran (no s x s scores) and a gated model's SwiGLU as its own torch ops (the estimate's
    default fuses it into one kernel), so a gated calibration is not fitted on kernels it never ran."""
    from pipesim.commands.estimate import fit_count
    from pipesim.workload.count import count_built

    profile = load_profile(calibrated[0])
    gated = profile.model_copy(update={"model": profile.model.model_copy(
        update={"options": {**profile.model.options, "gated": 1}})})
    env, options = profile.environment, dict(gated.model.options)
    counted = fit_count(gated, "the test")
    assert counted == count_built("gpt", options, env.microbatch_size, torch.float32, "flash", swiglu_fusion=False)
    assert counted != count_built("gpt", options, env.microbatch_size, torch.float32, "flash")
    assert counted != count_built("gpt", options, env.microbatch_size, torch.float32, "math", swiglu_fusion=False)
