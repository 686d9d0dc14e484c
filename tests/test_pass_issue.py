"""A profile's stage passes timed both ways on a GPU, queued and from an idle GPU, and priced by the placement.

The executor holds a GPU its ranks share until a row's kernels finish (the host-staged transport), so each row is
issued to an idle GPU and a host that issues a pass slower than its kernels run shows in it; with a GPU per rank a
row is queued behind the one before, its issue hidden. The committed H200 check timed both in one process
(traces/measured/gpu-check-h200-day9-masters/check.json `pass_issue_ms`: stage 1's W 3.77 ms queued, 6.00 idle);
its profile holds its passes from an idle GPU alone (its ranks shared the GPU).
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from pipesim.calibrate.runtime import runtime_terms
from pipesim.planning.replay import predict_measured
from pipesim.planning.scenario import profile_costs, profile_scenario
from pipesim.profiles.schema import PASSES, PassTimes, Profile, StagePasses, Timing, profile_json, stages_for
from pipesim.schedules import ScheduleParams
from pipesim.traces.trace import read_trace
from tests.conftest import script_module
from tests.helpers import probe_trace

CHECK = Path(__file__).resolve().parents[1] / "traces" / "measured" / "gpu-check-h200-day9-masters"
CPU_RUNS = CHECK.parent / "fidelity-cpu2-day3-runs"  # a CPU calibration's, its passes timed once


def _idle_only() -> Profile:
    """The check's profile: its ranks shared the GPU, so it timed its passes from an idle GPU alone."""
    return Profile.model_validate_json((CHECK / "profile.json").read_text())


def _both_ways() -> Profile:
    """The check's profile as a calibration now records it: its passes queued as the check timed them
    (`pass_issue_ms`), which are the stages' times, and from an idle GPU as it timed them itself."""
    idle_only = _idle_only()
    queued = json.loads((CHECK / "check.json").read_text())["pass_issue_ms"]["queued"]
    stages = []
    for stage, ms in zip(idle_only.stages, queued):
        timed = {name: Timing(median_ms=ms[name], spread_ms=0.0, repeats=5) for name in PASSES}
        idle = PassTimes(**{name: getattr(stage.passes, name) for name in PASSES})
        stages.append(stage.model_copy(update={"passes": StagePasses(**timed, idle=idle),
                                               **{f"{name}_ms": ms[name] for name in PASSES}}))
    return Profile.model_validate({**idle_only.model_dump(), "stages": [s.model_dump() for s in stages]})


def _ms(profile: Profile, way: str) -> list[dict[str, float]]:
    passes = [stage.passes if way == "queued" else stage.passes.idle for stage in profile.stages]
    return [{name: getattr(times, name).median_ms for name in PASSES} for times in passes]


def _priced(costs) -> list[dict[str, float]]:
    return [{name: getattr(stage, f"{name}_ms") for name in PASSES} for stage in costs.stages]


def test_a_profile_with_both_timings_prices_each_placement_with_its_own():
    """Ranks with a GPU each take the passes timed queued, ranks sharing a GPU those from an idle GPU: the one
    rule (`StagePasses.issued`), whatever prices them (the costs of a cut, a scenario on its cluster)."""
    both = _both_ways()
    bounds = both.partition.bounds
    queued, idle = _ms(both, "queued"), _ms(both, "idle")
    assert idle[1]["wgrad"] - queued[1]["wgrad"] > 2.0  # the check's W: its host's issue outlasts its kernels
    assert _priced(profile_costs(both, "adam", bounds)) == [pytest.approx(q) for q in queued]
    assert _priced(profile_costs(both, "adam", bounds, shared_gpu=True)) == [pytest.approx(i) for i in idle]
    scenario = profile_scenario(both, "adam")
    sched = scenario.build("zb-h1", ScheduleParams(stages=2, microbatches=8))
    one_each = scenario.links(sched)
    assert not one_each.shares_compute(2)  # a profile's own cluster: a GPU per rank
    assert _priced(scenario.costs(sched)) == [pytest.approx(q) for q in queued]
    shared = replace(scenario, topology=replace(one_each, compute=("gpu0", "gpu0")))
    assert _priced(shared.costs(sched)) == [pytest.approx(i) for i in idle]
    # another cut scales each layer by its calibrated stage's pass over its layers, as the placement issues it
    other = [0, 5, 10]
    assert _priced(profile_costs(both, "adam", other)) != _priced(profile_costs(both, "adam", other, shared_gpu=True))
    assert stages_for(both, other, shared_gpu=True)[1].fwd_ms == pytest.approx(
        stages_for(_idle_only(), other)[1].fwd_ms)


def test_compare_predicts_a_run_on_a_shared_gpu_from_the_passes_timed_idle():
    """`pipesim compare` prices the run as it was placed: the check's ZB-H1 ran both ranks on one GPU, so its
    W rows take stage 1's W timed idle; the same run with a GPU per rank, the queued one."""
    meta = read_trace(CHECK / "run-zb-h1.json").meta
    both = _both_ways()
    apart = replace(meta, hardware={**meta.hardware, "host_staged": False, "compute": ["vm/cuda:0", "vm/cuda:1"]})
    assert meta.shares_gpu and not apart.shares_gpu

    def w_ms(trace) -> float:  # stage 1's W rows, median (the rows' runtime terms are the same both ways)
        ops = trace.ops
        rows = (np.asarray(trace.kinds)[ops.kind] == "W") & (ops.stage == 1)
        return float(np.median(ops.dur_us[rows])) / 1e3

    queued, idle = _ms(both, "queued")[1]["wgrad"], _ms(both, "idle")[1]["wgrad"]
    assert w_ms(predict_measured(meta, both)) - w_ms(predict_measured(apart, both)) == pytest.approx(idle - queued)
    # host-staged with a GPU per rank (--backend gloo, or the first pipeline's ranks when d > 1): every rank's rows
    # still take turns under one lock, each issued to an idle GPU
    staged_apart = replace(meta, hardware={**meta.hardware, "gpus": 2, "compute": ["vm/cuda:0", "vm/cuda:1"]})
    assert w_ms(predict_measured(staged_apart, both)) == pytest.approx(w_ms(predict_measured(meta, both)))
    # a profile that holds one timing prices every placement with it, as before
    idle_only = _idle_only()
    assert w_ms(predict_measured(meta, idle_only)) == pytest.approx(w_ms(predict_measured(apart, idle_only)))
    assert w_ms(predict_measured(meta, idle_only)) == pytest.approx(w_ms(predict_measured(meta, both)))


def test_the_gpu_checks_calibrated_figures_are_the_passes_its_runs_issue_from_an_idle_gpu():
    """benchmarks/gpu_check.py runs both ranks on the one GPU, so its "calibrated" figures (check.json
    `calibrated_stages_ms`, the table's column) are the passes `compare` prices its runs from: those timed idle,
    not the stages' stored (queued) times."""
    both = _both_ways()
    with script_module("gpu_check") as check:
        shown = check.calibrated_ms(both)
    assert shown == [pytest.approx(ms) for ms in _ms(both, "idle")]
    assert shown[1]["wgrad"] != pytest.approx(both.stages[1].wgrad_ms)


@pytest.mark.parametrize("edit, why", [
    (lambda doc: doc["stages"][0]["passes"].pop("idle"), "timed on a GPU for every stage or for none"),
    (lambda doc: doc["environment"].update(device="cpu"), "timed on a GPU for every stage or for none"),
])
def test_passes_timed_idle_on_some_stages_or_on_a_cpu_are_refused(edit, why):
    doc = _both_ways().model_dump(mode="json")
    edit(doc)
    with pytest.raises(ValueError, match=f"stages.\\*.passes.idle: {why}"):
        Profile.model_validate(doc)


def test_a_cpus_passes_are_written_without_idle_timings_and_a_gpus_with_them():
    """A CPU's passes are timed once (`idle` None): its profile is written as before both were kept, no "idle" in
    any stage's passes, and reads back the same; a GPU's keeps both."""
    cpu = Profile.model_validate_json((CPU_RUNS / "mlp-profile.json").read_text())
    for profile, timed_idle in ((cpu, False), (_both_ways(), True)):
        written = json.loads(profile_json(profile))
        assert [("idle" in stage["passes"]) for stage in written["stages"]] == [timed_idle] * len(profile.stages)
        assert Profile.model_validate(written) == profile


@pytest.mark.parametrize("device", ["cuda", "cpu"])
def test_calibration_times_a_gpus_passes_both_ways_in_the_same_rounds_and_a_cpus_once(monkeypatch, device):
    """On a GPU every pass is timed queued and from an idle GPU, in one `_time` (its rounds spread a slow spell
    over both); a CPU runs ops as issued, so its passes are timed once (no doubled calibration)."""
    from pipesim.calibrate import measure

    seen = []

    def timed(settings, *sequences, idle, **_):
        names = [name for sequence in sequences for name, _ in sequence]
        seen.extend(names)
        return {name: Timing(median_ms=2.0 if idle(name) else 1.0, spread_ms=0.0, repeats=5) for name in names}

    monkeypatch.setattr(measure, "_time", timed)
    work = lambda state: state  # noqa: E731
    runs = [SimpleNamespace(differentiable=True, input_gradients=False, forward=work, backward_input=work,
                            backward_weight=work),
            SimpleNamespace(differentiable=True, input_gradients=True, forward=work, backward=work,
                            backward_input=work, backward_weight=work)]
    settings = measure.Settings(torch.device(device), torch.float32, 1, warmup=0, repeats=5)
    passes = measure.measure_passes(runs, settings, lambda what: None, [1.0, 1.0])
    assert len(seen) == (2 if device == "cuda" else 1) * (3 + 5)
    assert all(getattr(stage, name).median_ms == 1.0 for stage in passes for name in PASSES)
    if device == "cpu":
        assert all(stage.idle is None for stage in passes)
    else:
        assert all(getattr(stage.idle, name).median_ms == 2.0 for stage in passes for name in PASSES)
        assert passes[1].issued(shared_gpu=True) == StagePasses(**dict(passes[1].idle))
        assert passes[1].issued(shared_gpu=False) == passes[1]


def test_the_runtime_probe_reads_its_rows_against_the_passes_as_its_run_issued_them():
    """The probe's two ranks on one GPU issued each row to an idle GPU: a row's runtime term is its time less its
    stage's pass timed so (less the queued one, its host's issue would be counted twice)."""
    probe = _both_ways()
    issued = probe.model_copy(update={"stages": stages_for(probe, probe.partition.bounds, shared_gpu=True)})
    extra = {"F": 0.3, "B": 0.2, "I": 0.15, "W": 0.1, "OPT": 0.25}
    trace = probe_trace(issued, extra, gap_ms=0.04, send_ms=0.12, recv_ms=0.02, kept=1.0, turn_ms=3.0)
    assert trace.meta.shares_gpu
    terms = runtime_terms([trace], probe, {"boundary_bytes": 4096})
    assert {kind: t.median_ms for kind, t in terms.compute_ms.items()} == pytest.approx(extra)


def test_calibrate_names_each_stage_whose_passes_from_an_idle_gpu_it_prints_by_its_own_index(capsys):
    """A stage without passes from an idle GPU is left out of calibrate's line, and the rest keep their numbers."""
    from pipesim.commands.calibrate import _print_profile

    both = _both_ways()
    first = both.stages[0]
    stages = [first.model_copy(update={"passes": first.passes.model_copy(update={"idle": None})}), *both.stages[1:]]
    _print_profile(both.model_copy(update={"stages": stages}))
    printed = " ".join(capsys.readouterr().out.split())
    idle = both.stages[1].passes.idle
    assert ("(F/B/I/W ms): stage 1 " + "/".join(f"{getattr(idle, name).median_ms:.3f}" for name in PASSES)
            in printed)
    assert "stage 0 " not in printed.split("(F/B/I/W ms):")[1]
