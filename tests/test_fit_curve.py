"""The device's efficiency curve that `pipesim calibrate` fits to its own measured layers and stores (issue 29):
stored and read back, preferred by --curve-from, fitted at use where a profile has none, and a fit on a CPU
calibration held against that calibration's layers and another size's."""

import json
from pathlib import Path

import pytest

from pipesim.profiles.schema import ProfileError, load_profile, profile_json
from tests.conftest import pipesim

torch = pytest.importorskip("torch")

TRACES = Path(__file__).resolve().parents[1] / "traces" / "profiles"
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
    path, out = calibrated
    profile = load_profile(path)
    fitted = profile.fitted_curve
    assert fitted is not None and fitted.passes == ["fwd", "bwd", "igrad"] and fitted.matmul_flops_per_ms > 0
    assert (fitted.multiprocessors, fitted.tiles) == (1, [(1, 1)])  # a CPU: no tile quantisation
    assert all(len(residuals) == len(profile.layers) for residuals in fitted.residuals.values())
    assert fitted.residuals["igrad"][0] is None  # the embedding's input is the batch: no input gradient
    line = next(line for line in out.splitlines() if line.startswith("efficiency curve (stored"))
    assert "products" in line and "fit error" in line
    assert profile_json(load_profile(path)) == path.read_text()  # read back, written again: the same text
    raw = json.loads(path.read_text())
    raw["fitted_curve"]["residuals"]["fwd"].append(0.1)  # one more layer than the profile has
    (tmp_path / "bad.json").write_text(json.dumps(raw))
    with pytest.raises(ProfileError, match="fitted_curve.residuals"):
        load_profile(tmp_path / "bad.json")


def test_curve_from_prefers_the_stored_curve_and_fits_a_profile_without_one(calibrated, tmp_path, monkeypatch):
    from pipesim.planning import estimate

    path, _ = calibrated
    raw = json.loads(path.read_text())
    raw["fitted_curve"]["matmul_flops_per_ms"] = 1.25e8  # 0.125 TFLOP/s, which no fit of this calibration gives
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
    del raw["fitted_curve"]  # a profile from before calibrate stored its curve
    old = tmp_path / "old.json"
    old.write_text(json.dumps(raw))
    with pytest.raises(AssertionError, match="fitted although"):
        pipesim(*ESTIMATE, "--curve-from", old, "--out", tmp_path / "from-old.json")
    monkeypatch.setattr(estimate, "fit_rates", fit_rates)
    code, out, err = pipesim(*ESTIMATE, "--curve-from", old, "--out", tmp_path / "from-old.json")
    assert code == 0, err
    assert load_profile(tmp_path / "from-old.json").estimate.curve["source"].startswith(f"fitted to {old}")
