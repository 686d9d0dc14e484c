"""The runtime terms' plan (calibrate/runtime.py): how much of the calibrated model's run its host time needs."""

from dataclasses import replace

import pytest

from pipesim.calibrate.runtime import (
    HOST_KINDS,
    HOST_MARGIN,
    HOST_SHARE,
    HOST_STEADY,
    HOST_WARMED,
    PROBE_MICROBATCHES,
    RunPlan,
    host_plan,
    host_share,
)
from pipesim.profiles.schema import COMPUTE_KINDS, RuntimeProfile, Timing, load_profile
from tests.helpers import CNN_CPU

PROFILE = CNN_CPU  # stages of 5.6-6.9 ms F + B


def _timing(ms: float) -> Timing:
    return Timing(median_ms=ms, spread_ms=0.0, repeats=1)


def _runtime(gap_ms: float, send_ms: float) -> RuntimeProfile:
    """Probe terms whose gaps after every kind of row are `gap_ms` and whose SEND rows hold `send_ms`."""
    return RuntimeProfile(compute_ms={kind: _timing(0.05) for kind in COMPUTE_KINDS}, send_ms=_timing(send_ms),
                          recv_ms=_timing(0.03), delivery_ms=_timing(0.1), delivery_bytes=4096,
                          gap_ms={kind: _timing(gap_ms) for kind in (*HOST_KINDS, "I", "W", "OPT")},
                          kept_gradients=0.0, meta={})


def _with_passes(fwd_ms: float, bwd_ms: float):
    profile = load_profile(PROFILE)
    return profile.model_copy(update={"stages": [stage.model_copy(update={"fwd_ms": fwd_ms, "bwd_ms": bwd_ms})
                                                 for stage in profile.stages]})


def test_the_host_share_is_a_micro_batchs_host_time_over_the_shortest_stage():
    profile = load_profile(PROFILE)
    shortest_ms = min(stage.fwd_ms + stage.bwd_ms for stage in profile.stages)
    assert host_share(profile, _runtime(0.1, 0.3)) == pytest.approx((0.3 + 0.1 * len(HOST_KINDS)) / shortest_ms)


def test_the_calibrated_models_run_is_sized_by_what_its_host_time_can_change():
    """Small passes: the probe's micro-batches and HOST_STEADY mini-batches per schedule. Long ones: fewer, at
    least ZB-H1's 2p micro-batches and one steady mini-batch; and none at all where what HOST_MARGIN times the
    probe's host time per micro-batch adds to it is under HOST_SHARE of a stage's F + B (stages of seconds)."""
    probe = _runtime(0.1, 0.3)  # 0.9 ms per micro-batch
    assert host_plan(load_profile(PROFILE), probe) == RunPlan(PROBE_MICROBATCHES, HOST_STEADY, HOST_WARMED)
    assert host_plan(_with_passes(300.0, 600.0), _runtime(3.0, 5.0)) == RunPlan(2 * 4, 1, HOST_WARMED)  # 2.6 %
    assert host_plan(_with_passes(300.0, 600.0), probe) is None  # 0.1 %
    threshold_ms = (HOST_MARGIN - 1) * 0.9 / HOST_SHARE  # the F + B of which the margin's host time is HOST_SHARE
    assert host_plan(_with_passes(0.33 * threshold_ms, 0.66 * threshold_ms), probe) is not None
    assert host_plan(_with_passes(0.34 * threshold_ms, 0.67 * threshold_ms), probe) is None


def test_a_run_timed_for_its_rows_alone_scores_no_trained_model():
    """Calibration's runs (the probe's, the calibrated model's) need their rows, not the held-out score that a run
    computes after its last row (the default gpt's: 2.6 s)."""
    from pipesim.executor import RunSpec
    from pipesim.executor.runners import run_in_process
    from pipesim.schedules import ScheduleParams, build_schedule

    spec = RunSpec(build_schedule("1f1b", ScheduleParams(stages=2, microbatches=2, minibatches=1)), "mlp",
                   {"layers": 2, "width": 8}, microbatch_size=2)
    assert run_in_process(spec).trace.meta.extra["heldout"]["accuracy"] >= 0
    assert "heldout" not in run_in_process(replace(spec, heldout=False)).trace.meta.extra


def test_a_runtime_probe_kept_under_one_transport_is_not_reused_under_another(monkeypatch):
    """The probe's compute terms are its rows less its passes, which two ranks sharing a GPU time from an idle GPU
    (calibrate/measure.py `idle_passes`), and its sends go over its transport: the host cache keys the probe by
    the transport its two ranks take, so one made on two GPUs is not reused on one."""
    import torch

    from pipesim.calibrate.measure import Settings
    from pipesim.commands.calibrate import measure_runtime

    class Looked(Exception):
        """The cache asked for the probe: its key, in args[0]."""

    class Cache:
        def get(self, kind: str, key: dict, measure, own_tasks: int):
            raise Looked(key)

    profile = load_profile(PROFILE.parents[1] / "measured" / "gpu-check-h200-day9" / "profile.json")
    settings = Settings(torch.device("cuda"), torch.bfloat16, profile.environment.microbatch_size, 1, 5)
    keys = {}
    for gpus in (1, 2):
        monkeypatch.setattr(torch.cuda, "device_count", lambda gpus=gpus: gpus)
        with pytest.raises(Looked) as looked:
            measure_runtime(profile, settings, lambda what: None, "gpt", {}, cache=Cache())
        keys[gpus] = looked.value.args[0]
    assert (keys[1].pop("transport"), keys[2].pop("transport")) == ("host-staged", "nccl")
    assert keys[1] == keys[2]
