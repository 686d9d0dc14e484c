"""The causes of prediction error modelled as terms (issue 12, item 5): the runtime's cost per row, gradient
accumulation, the gradient an update keeps, calibration at the run's thread count; read off probe traces
(calibrate/runtime.py), priced by the simulator, and turned on and off by the fidelity report. Closed forms
on fixed costs; no wall-clock values."""

import importlib
import json
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from pipesim.calibrate.runtime import WARMUP_ROWS, RuntimeProbeError, host_times, runtime_terms, warmup_ms
from pipesim.planning.replay import predict_measured
from pipesim.planning.scenario import profile_overhead, profile_scenario
from pipesim.profiles.schema import (
    COMPUTE_KINDS,
    ContentionProfile,
    LinkProfile,
    Profile,
    RuntimeProfile,
    Timing,
    load_profile,
    stages_for,
    threads_mismatch,
)
from pipesim.schedules import KIND_CODE, KINDS, METHODS, NUM_COMPUTE_KINDS, Kind, lower
from pipesim.sim import Cluster, Costs, simulate
from pipesim.sim.costs import CostError, RowOverhead, StageCosts
from pipesim.traces import summarize
from pipesim.traces.compare import compare
from pipesim.traces.trace import Ops, Stream, Trace, TraceError, write_trace
from tests.conftest import build
from tests.helpers import CNN_CPU, probe_trace, with_passes

ROOT = Path(__file__).resolve().parents[1]
PROFILE = CNN_CPU  # a version 1 profile, calibrated with 2 threads
MS = {kind: i for i, kind in enumerate(KINDS)}


def overhead(compute: dict[str, float] = {}, gaps: dict[str, float] = {}, send_ms=0.0, recv_ms=0.0) -> RowOverhead:
    return RowOverhead(tuple(compute.get(k.value, 0.0) for k in KINDS[:NUM_COMPUTE_KINDS]), send_ms, recv_ms,
                       tuple(gaps.get(k.value, 0.0) for k in KINDS))


def one_device(name: str, m: int, n: int, **costs) -> Trace:
    """`name` on one device (no transfers): F 1 ms, B 2 ms, OPT 0.5 ms, with `costs`' extra fields."""
    row = costs.pop("row", RowOverhead())
    kept = costs.pop("kept_gradients", 0.0)
    base = Costs.per_stage(1, fwd_ms=1.0, bwd_ms=2.0, opt_ms=0.5, param_mb=10.0)
    stage = replace(base.stages[0], **costs)
    return simulate(build(name, 1, m, n), replace(base, stages=(stage,), overhead=row, kept_gradients=kept),
                    Cluster.uniform(1, 0.0))


def durations(trace: Trace, kind: str) -> np.ndarray:
    return trace.ops.dur_us[trace.ops.kind == trace.kind_code(kind)] / 1e3


def test_row_overhead_adds_to_compute_rows_and_holds_the_device_between_rows():
    # GPipe on one device, m = 4, N = 2: per mini-batch 4 F (1.1 ms, then 0.01 ms of bookkeeping), 4 B (2.2 ms,
    # 0.02 ms), one OPT (0.8 ms, 0.03 ms); the last gap ends no op, so the makespan leaves it out.
    row = overhead({"F": 0.1, "B": 0.2, "OPT": 0.3}, {"F": 0.01, "B": 0.02, "OPT": 0.03})
    trace = one_device("gpipe", 4, 2, row=row)
    assert durations(trace, "F") == pytest.approx([1.1] * 8)
    assert durations(trace, "B") == pytest.approx([2.2] * 8)
    assert durations(trace, "OPT") == pytest.approx([0.8] * 2)
    assert summarize(trace).makespan_ms == pytest.approx(2 * (4 * 1.11 + 4 * 2.22 + 0.83) - 0.03)
    assert trace.meta.extra["row_overhead"]["send_ms"] == 0.0
    assert "row_overhead" not in one_device("gpipe", 4, 2).meta.extra  # a what-if without it says nothing


@pytest.mark.parametrize("name", ["1f1b", "pipedream", "zb-h1"])
def test_every_backward_but_the_first_after_an_update_accumulates(name):
    # One buffer per stage replica: m - 1 of each mini-batch's m backward passes (W for a split one) add into it.
    m, n = 4, 3
    trace = one_device(name, m, n, accumulate_ms=0.25)
    grads = durations(trace, "W" if name == "zb-h1" else "B")
    plain = durations(one_device(name, m, n), "W" if name == "zb-h1" else "B")
    assert np.count_nonzero(np.isclose(grads - plain, 0.25)) == n * (m - 1)
    assert np.count_nonzero(np.isclose(grads, plain)) == n


def test_a_send_and_a_receive_hold_their_device():
    costs = Costs.per_stage(2, fwd_ms=1.0, bwd_ms=2.0)
    plain = simulate(build("1f1b", 2, 4), costs, Cluster.uniform(2, 0.5))
    held = simulate(build("1f1b", 2, 4), replace(costs, overhead=overhead(send_ms=0.2, recv_ms=0.3)),
                    Cluster.uniform(2, 0.5))

    def start(trace: Trace, device: int, kind: str, microbatch: int) -> float:
        ops = trace.ops
        at = (ops.device == device) & (ops.kind == trace.kind_code(kind)) & (ops.microbatch == microbatch)
        return float(ops.start_us[at][0]) / 1e3

    assert start(held, 0, "F", 1) - start(plain, 0, "F", 1) == pytest.approx(0.2)  # after SEND_F0
    # The message leaves as its send is posted; the receiver then takes it.
    assert start(held, 1, "F", 0) - start(plain, 1, "F", 0) == pytest.approx(0.3)


def test_a_kept_gradient_adds_one_gradient_from_the_second_mini_batch_on():
    # GPipe on one device, m = 2: mini-batch 1's first B runs 8.5-10.5 ms, its update ends at 13 ms.
    plain, kept = one_device("gpipe", 2, 3), one_device("gpipe", 2, 3, kept_gradients=1.0)
    param = plain.meta.costs[0]["param_bytes"]
    assert summarize(kept).peak_memory_mb - summarize(plain).peak_memory_mb == pytest.approx(param / 2**20)

    def extra_at(ms: float) -> int:
        a, b = plain.counters["memory_bytes"][0], kept.counters["memory_bytes"][0]
        return int(b.values[np.searchsorted(b.times_us, ms * 1e3, "right") - 1]
                   - a.values[np.searchsorted(a.times_us, ms * 1e3, "right") - 1])

    assert [extra_at(ms) for ms in (5.0, 6.6, 9.0, 12.9, 13.1, 30.0)] == [0, 0, param, param, 0, 0]


def test_a_fresh_ranks_first_rows_cost_their_warm_up_in_compute_and_host_time():
    # GPipe on one device, m = 4: per mini-batch 4 F (1.1 ms, then 0.01 ms), 4 B (2.2 ms, 0.02 ms) and one OPT
    # (0.8 ms, 0.03 ms), 13.75 ms at steady pace; its first 9 compute rows (mini-batch 0) cost 0.5 ms more each,
    # the next 9 0.2 ms: in a compute row's own time, and in the host time after any other row.
    row = overhead({"F": 0.1, "B": 0.2, "OPT": 0.3}, {"F": 0.01, "B": 0.02, "OPT": 0.03})
    trace = one_device("gpipe", 4, 4, row=replace(row, warmup_ms=(0.5, 0.2), warmup_rows=9))
    assert durations(trace, "F") == pytest.approx([1.6] * 4 + [1.3] * 4 + [1.1] * 8)
    assert durations(trace, "OPT") == pytest.approx([1.3, 1.0, 0.8, 0.8])
    steady = 4 * 1.11 + 4 * 2.22 + 0.83
    assert summarize(trace).makespan_ms == pytest.approx(4 * steady + 9 * 0.5 + 9 * 0.2 - 0.03)
    # from mini-batch 0's last row's end (its update's gap still to come) to mini-batch 3's
    assert summarize(trace).time_per_minibatch_ms == pytest.approx((3 * steady + 9 * 0.2) / 3)
    with pytest.raises(CostError, match="row overhead times must be finite numbers from 0"):
        RowOverhead(warmup_ms=(-0.5,))
    # in steps of 8 compute rows, the ninth F (mini-batch 1's first) is already past the first step
    assert durations(one_device("gpipe", 4, 2, row=replace(row, warmup_ms=(1.0,))), "F") == pytest.approx(
        [2.1] * 4 + [1.1] * 4)
    # two devices: a SEND holds its device the extra after it, a RECV too (not its wait)
    costs = Costs.per_stage(2, fwd_ms=1.0, bwd_ms=2.0)
    plain = simulate(build("gpipe", 2, 2), costs, Cluster.uniform(2, 0.0))
    cold = simulate(build("gpipe", 2, 2), replace(costs, overhead=RowOverhead(warmup_ms=(0.25,))),
                    Cluster.uniform(2, 0.0))
    # device 0: F0, SEND_F0, F1, SEND_F1, ...: F1 starts 0.25 (F0) + 0.25 (after SEND_F0) later
    f1 = lambda t: float(t.ops.start_us[(t.ops.device == 0) & (t.ops.kind == t.kind_code("F"))  # noqa: E731
                                        & (t.ops.microbatch == 1)][0]) / 1e3
    assert f1(cold) - f1(plain) == pytest.approx(0.5)


@pytest.mark.parametrize("window, held_mib", [(0, [0, 1, 1, 1, 1, 0]), (2, [2, 3, 3, 2, 1, 0])])
def test_a_posted_receive_holds_its_buffer_from_its_posting(window, held_mib):
    # GPipe, 2 devices, m = 4, F 1 ms, 1 MiB per activation, transfers 0.5 ms: device 1's receives arrive at
    # 1.5, 2.5, 3.5, 4.5 ms and its F j runs from 1.5 + j ms, freeing receive j as it ends. With no window a
    # buffer is held from its arrival; with 2, receives 0 and 1 are posted at the start, receive 2 as F 0 is
    # reached (1.5 ms), receive 3 as F 1 is (2.5 ms).
    costs = replace(Costs.per_stage(2, fwd_ms=1.0, bwd_ms=2.0, output_mb=1.0), recv_window=window)
    trace = simulate(build("gpipe", 2, 4), costs, Cluster.uniform(2, 0.5))
    memory = trace.counters["memory_bytes"][1]
    at = [int(memory.values[np.searchsorted(memory.times_us, ms * 1e3, "right") - 1]) for ms in (0.1, 2, 3, 4, 5, 6)]
    assert at == [mib * 2**20 for mib in held_mib]
    assert trace.meta.extra.get("recv_window") == (window or None)


def test_profile_overhead_prices_pred_and_avg_as_opt_and_fills_unseen_gaps():
    t = lambda ms: Timing(median_ms=ms, spread_ms=0.0, repeats=3)  # noqa: E731
    runtime = RuntimeProfile(compute_ms={k: t(0.1 * (i + 1)) for i, k in enumerate(COMPUTE_KINDS)}, send_ms=t(0.05),
                             recv_ms=t(0.02), delivery_ms=t(0.1), delivery_bytes=4096,
                             gap_ms={"F": t(0.01), "OPT": t(0.04), "RECV_F": t(0.1)}, kept_gradients=1.0, meta={})
    row = profile_overhead(runtime)
    assert row.compute_ms[MS["PRED"]] == row.compute_ms[MS["AVG"]] == row.compute_ms[MS["OPT"]] == pytest.approx(0.5)
    assert row.gap_ms[MS["AVG"]] == 0.04 and row.gap_ms[MS["F"]] == 0.01
    assert row.gap_ms[MS["B"]] == pytest.approx(0.04)  # not seen: the median of those seen
    assert row.host_ms[MS["SEND_F"]] == pytest.approx(0.05 + 0.04) and row.host_ms[MS["RECV_F"]] == pytest.approx(0.12)


# ------------------------------------------------------------------------------------- the runtime probe


def test_runtime_terms_recover_what_the_probe_trace_holds():
    probe = load_profile(PROFILE)  # its first two stages' times stand for the probe's layers
    extra = {"F": 0.3, "B": 0.2, "I": 0.15, "W": 0.1, "OPT": 0.25}
    # A SEND row held its rank 0.12 ms, 0.03 of them posting it: its own cost, the rest descheduled or waiting.
    trace = probe_trace(probe, extra, gap_ms=0.04, send_ms=0.12, recv_ms=0.02, kept=1.0, send_cpu_ms=0.03)
    waited = trace.ops.dur_us[trace.ops.stream == Stream.RECV] > 0.021e3
    assert waited.any() and not waited.all()  # some messages were waited for: those do not price a receive
    terms = runtime_terms([trace], probe, {"boundary_bytes": 4096})
    assert {k: t.median_ms for k, t in terms.compute_ms.items()} == pytest.approx(extra)
    assert terms.send_ms.median_ms == pytest.approx(0.03) and terms.recv_ms.median_ms == pytest.approx(0.02)
    assert terms.delivery_ms.median_ms == pytest.approx(0.12)  # a message is there once its send is posted
    assert terms.delivery_bytes == 4096
    assert set(terms.gap_ms) == {"F", "B", "I", "W", "OPT", "SEND_F", "SEND_B", "RECV_F", "RECV_B"}
    assert all(t.median_ms == pytest.approx(0.04) for t in terms.gap_ms.values())
    assert terms.kept_gradients == 1.0 and terms.meta == {"boundary_bytes": 4096}
    # The warm-up mini-batch is dropped: a probe of one mini-batch gives nothing, and says so in one line.
    first = trace.ops.minibatch == 0
    short = replace(trace, ops=Ops(**{name: getattr(trace.ops, name)[first] for name in Ops.__dataclass_fields__}))
    with pytest.raises(RuntimeProbeError, match="the runtime probe recorded no receive whose message had arrived"):
        runtime_terms([short], probe, {"boundary_bytes": 4096})
    # Runs of the calibrated model itself give the host time between rows and a send's: after its larger
    # compute that host work is slower; the rest still comes from the probe.
    host = probe_trace(probe, {kind: 1.0 for kind in extra}, gap_ms=0.09, send_ms=8.0, recv_ms=0.05, kept=1.0,
                       send_cpu_ms=0.3)
    both = host_times(terms, [host])
    assert all(t.median_ms == pytest.approx(0.09) for t in both.gap_ms.values())
    assert both.send_ms.median_ms == pytest.approx(0.3)  # not the 8 ms its rows held a descheduled rank
    untimed = replace(host, ops=replace(host.ops, cpu_us=None))  # a trace that did not time its sends
    with pytest.raises(RuntimeProbeError, match="the runtime probe recorded no SEND rows' CPU time"):
        host_times(terms, [untimed])
    assert both.compute_ms == terms.compute_ms and both.recv_ms == terms.recv_ms
    assert both.delivery_ms == terms.delivery_ms and both.kept_gradients == terms.kept_gradients
    assert terms.warmup_ms == [0.0] and both.warmup_ms == terms.warmup_ms  # its first rows ran as the rest


def test_ranks_sharing_a_gpu_price_neither_their_turns_as_host_time_nor_host_buffers_as_its_memory(tmp_path):
    """Two ranks on one GPU take turns for compute (the executor's lock): a compute row waits for the other rank's
    before it starts, as the simulator runs them on that GPU, so that wait is no host time between rows (left in,
    the H200 run's gap after RECV_F was 9.9 ms, the other stage's backward). Their receives are posted in host
    memory, so the memory around an update holds no receive buffers to take off its kept gradients; what their
    allocators hold beyond the books (cuBLAS's workspaces: 82 MiB a rank in the H200 check's runs, over the probe's
    1-16 MiB gradients 16-31 of them read as kept) is no gradient either."""
    from pipesim.traces import read_trace

    probe = load_profile(PROFILE)
    extra = {"F": 0.3, "B": 0.2, "I": 0.15, "W": 0.1, "OPT": 0.25}
    write_trace(probe_trace(probe, extra, gap_ms=0.04, send_ms=0.12, recv_ms=0.02, kept=1.0, turn_ms=3.0,
                            beyond_bytes=82 * 2**20), tmp_path / "t.json")
    shared = read_trace(tmp_path / "t.json")  # the waits as the run's trace file holds them
    assert set(shared.ops.wait_us[shared.ops.stream == Stream.COMPUTE]) == {3000.0}
    terms = runtime_terms([shared], probe, {"boundary_bytes": 4096})
    assert all(t.median_ms == pytest.approx(0.04) for t in terms.gap_ms.values())
    assert terms.kept_gradients == 1.0 and terms.warmup_ms == [0.0]
    assert {k: t.median_ms for k, t in terms.compute_ms.items()} == pytest.approx(extra)
    assert all(t.median_ms == pytest.approx(0.04) for t in host_times(terms, [shared]).gap_ms.values())


@pytest.mark.parametrize("kept", [0.0, 2.0])
@pytest.mark.parametrize("in_flight_bytes", [0, 1024])
def test_the_kept_gradients_are_what_a_device_holds_before_an_update_over_the_first(kept, in_flight_bytes):
    """An update's kept gradients are read from the memory before each update at a flush over the memory before the
    run's first, in gradients: weights, the mini-batch's gradient, the receives posted ahead and what a GPU's
    allocator holds beyond the books (82 MiB) cancel, so a runtime that frees its last gradient reads 0 and one that
    keeps two reads 2, not the allocator's bytes as gradients; nor a send still in flight at the first update (a
    CPU run's under load), which would read as fewer."""
    probe = load_profile(PROFILE)
    extra = {"F": 0.3, "B": 0.2, "I": 0.15, "W": 0.1, "OPT": 0.25}
    trace = probe_trace(probe, extra, gap_ms=0.04, send_ms=0.12, recv_ms=0.02, kept=kept, beyond_bytes=82 * 2**20,
                        in_flight_bytes=in_flight_bytes)
    assert runtime_terms([trace], probe, {"boundary_bytes": 4096}).kept_gradients == kept


def test_the_warm_up_of_a_trace_in_memory_is_that_of_the_trace_read_back(tmp_path):
    """A prediction keeps its byte-wide kinds in memory; its keys per kind and stage must not wrap (128 stages)."""
    from pipesim.traces import read_trace

    costs = replace(Costs.per_stage(128, fwd_ms=1, bwd_ms=2), overhead=RowOverhead(warmup_ms=(0.5,)))
    trace = simulate(build("1f1b", 128, 32, 2), costs, Cluster.uniform(128, 0.1), jitter=0.05, seed=1)
    write_trace(trace, tmp_path / "t.json")
    assert warmup_ms([trace]) == warmup_ms([read_trace(tmp_path / "t.json")]) == pytest.approx([0.5] + [0.0] * 5)


def test_calibration_reads_a_fresh_ranks_warm_up_off_the_probes_run():
    # A device's first 8 compute rows (of 18) cost 0.6 ms more each, and the host time after a row among them
    # as much again (the rest is steady: the first half of the run is priced against the second); receives
    # that waited for a slower peer are not the device's time.
    probe = load_profile(PROFILE)
    extra = {"F": 0.3, "B": 0.2, "I": 0.15, "W": 0.1, "OPT": 0.25}
    trace = probe_trace(probe, extra, gap_ms=0.04, send_ms=0.12, recv_ms=0.02, kept=1.0, warmup_ms=(0.6,))
    assert warmup_ms([trace]) == pytest.approx([1.2], abs=1e-4)
    terms = runtime_terms([trace], probe, {"boundary_bytes": 4096})
    assert profile_overhead(terms).warmup_ms == pytest.approx((1.2,), abs=1e-4)
    assert profile_overhead(terms).warmup_rows == WARMUP_ROWS
    # first rows that ran faster than the rest are noise, priced as none
    assert warmup_ms([probe_trace(probe, extra, 0.04, 0.12, 0.02, 1.0, warmup_ms=(-0.01,))]) == [0.0]


# ------------------------------------------------------------------------------- the run's own conditions


def recorded_run(threads_per_rank: int, profile: Profile | None = None) -> tuple[Trace, Profile]:
    """A prediction from `profile` (default: the committed one) relabelled as a run that recorded that profile,
    as `pipesim run --profile` records it, with `threads_per_rank`."""
    profile = profile or load_profile(PROFILE)
    scenario = profile_scenario(profile, "sgd")
    schedule = scenario.build("1f1b", METHODS["1f1b"].params(4, 4, 2))
    trace = simulate(schedule, scenario.costs(schedule), scenario.links(schedule))
    meta = replace(trace.meta, source="measured", hardware={"threads_per_rank": threads_per_rank},
                   extra={"profile": profile.model_dump(mode="json"), "bounds": profile.partition.bounds,
                          "optimizer": "sgd"})
    return replace(trace, meta=meta), profile


def test_a_run_is_predicted_only_from_a_profile_timed_with_its_thread_count():
    run, profile = recorded_run(threads_per_rank=2)  # the profile was calibrated with 2 threads
    assert profile.environment.threads == 2 and threads_mismatch(profile, 2) is None
    again = predict_measured(run.meta)
    assert compare(again, run).iteration_time_error == 0  # the replay is the prediction, bit for bit
    one_thread, _ = recorded_run(threads_per_rank=1)
    with pytest.raises(TraceError, match="calibrated with 2 threads and the run uses 1 per rank.*--threads 1"):
        predict_measured(one_thread.meta)
    # A profile handed over explicitly is a what-if (the fidelity report's terms off): not refused.
    assert predict_measured(one_thread.meta, profile).meta.schedule == "1f1b"


def test_a_stage_fed_by_the_batch_alone_has_an_empty_input_half():
    # The executor's I on the first stage has no input to differentiate, and its W walks the whole backward
    # (the first layers' weight gradients need the later layers' input gradients): priced as such.
    profile = load_profile(PROFILE)
    for bounds in (profile.partition.bounds, [0, 2, 4, len(profile.layers)]):
        first, *rest = stages_for(profile, bounds)
        assert (first.igrad_ms, first.wgrad_ms) == (0.0, first.bwd_ms)
        for stage in rest:
            start, stop = stage.layers
            assert stage.igrad_ms == pytest.approx(sum(layer.igrad.median_ms for layer in profile.layers[start:stop]))
            assert stage.igrad_ms > 0
    costs = profile_scenario(profile, "sgd").costs(build("zb-h1", 2, 4))
    assert costs.op_ms_table(1)[0][KINDS.index(Kind.I)] == 0.0


def test_stages_are_priced_at_their_passes_and_another_cut_scales_each_layer_by_its_stage():
    plain = load_profile(PROFILE)
    p = plain.partition.stages
    profile = with_passes(plain, [1.5, 1.2, 1.1, 1.3][:p], [2.0, 1.4, 1.6, 1.25][:p])
    own = stages_for(profile, profile.partition.bounds)
    assert [(s.fwd_ms, s.bwd_ms, s.igrad_ms, s.wgrad_ms) for s in own] == [tuple(
        t.median_ms for t in (s.passes.fwd, s.passes.bwd, s.passes.igrad, s.passes.wgrad)) for s in profile.stages]
    # Cut every calibrated stage in two: each half scales its layers by its stage's ratios, so the halves add
    # up to the measured passes, and a half takes its own layers' share.
    bounds = profile.partition.bounds
    halves = sorted({*bounds, *((a + b) // 2 for a, b in zip(bounds, bounds[1:]) if b - a > 1)})
    finer = stages_for(profile, halves)
    for kind in ("fwd_ms", "bwd_ms"):
        assert sum(getattr(s, kind) for s in finer) == pytest.approx(sum(getattr(s, kind) for s in own))
    plain_finer = stages_for(plain, halves)
    assert finer[0].fwd_ms == pytest.approx(plain_finer[0].fwd_ms * 1.5)
    assert finer[0].bwd_ms == pytest.approx(plain_finer[0].bwd_ms * 2.0)
    assert (finer[0].igrad_ms, finer[0].wgrad_ms) == (0.0, finer[0].bwd_ms)  # fed by the batch, still
    assert finer[-1].igrad_ms == pytest.approx(plain_finer[-1].igrad_ms * [2.0, 1.4, 1.6, 1.25][p - 1])
    # The passes add into the gradient buffer as they run: no accumulation is priced on top of them.
    accumulated = plain.model_copy(update={"stages": [s.model_copy(update={"accumulate": Timing(
        median_ms=0.5, spread_ms=0.0, repeats=5)}) for s in plain.stages]})
    costs = profile_scenario(accumulated, "sgd").costs(build("1f1b", p, 4))
    assert all(stage.accumulate_ms == 0.5 for stage in costs.stages)
    measured = with_passes(accumulated, [1.0] * p, [1.0] * p)
    costs = profile_scenario(measured, "sgd").costs(build("1f1b", p, 4))
    assert all(stage.accumulate_ms == 0 for stage in costs.stages)


def test_an_update_that_leaves_its_old_version_to_later_readers_pays_for_copying_the_weights():
    """The executor's OPT copies the weights first where the lowering keeps the superseded version
    (copies_delta > 0: PipeDream's stash, 2BW's double buffer), never where it updates in place (1F1B)."""
    def opt_ms(method: str, copy_ms: float) -> list[float]:
        costs = Costs(tuple(StageCosts(fwd_ms=1.0, bwd_ms=2.0, opt_ms=0.5, param_bytes=1 << 20, copy_ms=copy_ms)
                            for _ in range(2)))
        trace = simulate(build(method, 2, 4, 3), costs, Cluster(2))
        ops, kinds = trace.ops, np.asarray(trace.kinds)
        return (ops.dur_us[kinds[ops.kind] == "OPT"] / 1e3).tolist()

    in_place = opt_ms("1f1b", 0.0)
    assert opt_ms("1f1b", 0.3) == in_place == [0.5] * len(in_place)
    lowered = lower(build("pipedream-2bw", 2, 4, 3))
    opts = lowered.table.kind == KIND_CODE[Kind.OPT]
    copying = (lowered.copies_delta[opts] > 0).tolist()
    assert any(copying) and opt_ms("pipedream-2bw", 0.3) == [0.8 if c else 0.5 for c in copying]


def test_a_version_1_profile_prices_no_runtime_terms():
    profile = load_profile(PROFILE)
    assert profile.schema_version == 1 and profile.runtime is None
    assert all(stage.accumulate is None for stage in profile.stages)
    costs = profile_scenario(profile, "sgd").costs(build("1f1b", 4, 4))
    assert costs.overhead == RowOverhead() and costs.kept_gradients == 0
    assert all(stage.accumulate_ms == 0 for stage in costs.stages)


# ------------------------------------------------------------------------------------ the fidelity report


@pytest.fixture(scope="module")
def fidelity():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        yield importlib.import_module("fidelity")
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))


def test_the_report_turns_the_terms_on_one_after_another(fidelity):
    t = Timing(median_ms=0.1, spread_ms=0.0, repeats=3)
    profile = load_profile(PROFILE)
    profile = profile.model_copy(update={"environment": profile.environment.model_copy(update={"threads": 1}),
                                         "stages": [s.model_copy(update={"accumulate": t}) for s in profile.stages],
                                         "link": LinkProfile(segments=[{"min_bytes": 0, "latency_ms": 1.0,
                                                                        "bytes_per_ms": 4.096e6}], points=[], meta={}),
                                         "runtime": RuntimeProfile(
                                             compute_ms={k: t for k in COMPUTE_KINDS}, send_ms=t, recv_ms=t,
                                             delivery_ms=t, delivery_bytes=4096, gap_ms={"F": t}, kept_gradients=1.0,
                                             warmup_ms=[0.5], meta={}),
                                         "contention": ContentionProfile(slowdown=[1.0, 1.5], spread=[0, 0], tail=1.25,
                                                                         meta={}),
                                         "layers": [layer.model_copy(update={  # autograd saves no boundary tensor
                                             "saved_input_bytes": [0] * len(layer.inputs), "output_saved": False})
                                             for layer in profile.layers]})
    profile = with_passes(profile, [1.5] * 4, [2.0] * 4)
    profile = profile.model_copy(update={"stages": [s.model_copy(update={"weight_copy": t}) for s in profile.stages]})
    variants = fidelity.term_variants(profile, load_profile(PROFILE))
    schedule = build("1f1b", 4, 4, 2)
    costs = [profile_scenario(p, "sgd").costs(schedule) for _, p in variants]
    assert variants[0][1].environment.threads == 2 and variants[1][1].environment.threads == 1
    assert [c.stages[0].accumulate_ms for c in costs] == [0, 0, 0.1] + [0] * 12  # then inside the passes
    first, n = profile.stages[0], len(variants)
    assert [c.stages[0].fwd_ms for c in costs][1:] == pytest.approx(
        [first.fwd_ms] * 2 + [first.passes.fwd.median_ms] * 10 + [1.25 * first.passes.fwd.median_ms] * 2)  # tail
    assert [c.stages[0].copy_ms for c in costs] == [0] * 4 + [0.1] * (n - 4)
    assert [c.overhead.compute_ms[0] for c in costs] == [0] * 5 + [0.1] * (n - 5)
    assert [c.overhead.send_ms for c in costs] == [0] * 6 + [0.1] * (n - 6)
    # The link's fit takes 1 ms + 1 us at the probe's 4 KiB until delivery is on, then 0.1 ms there.
    assert [profile_scenario(p, "sgd").links(schedule).link(0, 1).transfer_ms(4096) for _, p in variants] == \
        pytest.approx([1.001] * 7 + [0.1] * (n - 7))
    assert [c.overhead.gap_ms[0] for c in costs] == [0] * 8 + [0.1] * (n - 8)
    assert [c.kept_gradients for c in costs] == [0] * 9 + [1.0] * (n - 9)
    assert [c.recv_window for c in costs] == [0] * 10 + [16] * (n - 10)
    # the boundary tensors: a stage's received input and sent output, held from F to its backward
    boundary = profile.layers[profile.stages[0].layers[1] - 1].output_bytes
    assert [c.stages[0].held_bytes for c in costs] == [None] * 11 + [boundary] * (n - 11)
    assert [profile_scenario(p, "sgd").links(schedule).contention for _, p in variants] == \
        [()] * 12 + [(1.0, 1.5)] * (n - 12)
    assert [c.overhead.warmup_ms for c in costs] == [()] * (n - 1) + [(0.5,)]  # the warm-up, last
    assert variants[-1][1] == profile


def test_a_report_row_of_identical_runs_has_no_error_and_no_spread(fidelity):
    run, _ = recorded_run(threads_per_rank=2)
    found = [compare(predict_measured(run.meta), run)] * 3
    row = fidelity.row("1f1b", found, [run] * 3)
    assert (row.iteration_error, row.spread, row.per_op_error, row.memory_error, row.per_op_noise) == (0, 0, 0, 0, 0)
    assert row.measured_ms == row.predicted_ms
    slower = replace(run, ops=replace(run.ops, dur_us=run.ops.dur_us * 1.1))
    assert fidelity.row("1f1b", found, [run, slower]).per_op_noise == pytest.approx(1 - 1 / 1.1)  # |a - b| / b


def test_measured_op_times_leave_the_structure_alone(fidelity):
    # A run that is its own prediction (no contention, so every op of a kind on a stage takes the same time; the
    # accumulation off, so every B does): given its own op times, the simulator gives it back.
    profile = load_profile(PROFILE)
    profile = profile.model_copy(update={"stages": [s.model_copy(update={"accumulate": None}) for s in profile.stages]})
    run, _ = recorded_run(threads_per_rank=2, profile=profile)
    again = fidelity.with_measured_ops(run, profile)
    assert compare(again, run).iteration_time_error == pytest.approx(0, abs=1e-9)
    # Twice as slow ops: the structure's prediction follows them.
    slower = replace(run, ops=replace(run.ops, dur_us=np.where(np.isin(run.ops.kind, [run.kind_code(k) for k in
                                                                                      ("F", "B", "OPT")]),
                                                               run.ops.dur_us * 2, run.ops.dur_us)))
    assert summarize(fidelity.with_measured_ops(slower, profile)).time_per_minibatch_ms > \
        1.5 * summarize(again).time_per_minibatch_ms


def test_the_report_reads_what_a_measurement_kept(fidelity, tmp_path, capsys):
    # Runs "measured" as the full profile predicts them: the report finds no error with every term on, and
    # some with them off. Nothing runs: the folder is what `--keep` would have filled.
    t = Timing(median_ms=0.2, spread_ms=0.0, repeats=3)
    full = load_profile(PROFILE).model_copy(update={
        "environment": load_profile(PROFILE).environment.model_copy(update={"threads": 1}),
        "link": LinkProfile(segments=[{"min_bytes": 0, "latency_ms": 0.5, "bytes_per_ms": 1e6}], points=[], meta={}),
        "runtime": RuntimeProfile(compute_ms={k: t for k in COMPUTE_KINDS}, send_ms=t, recv_ms=t, delivery_ms=t,
                                  delivery_bytes=4096, gap_ms={"F": t}, kept_gradients=1.0, meta={}),
        "contention": ContentionProfile(slowdown=[1.0, 1.3], spread=[0, 0], meta={})})
    (tmp_path / "mlp.json").write_text(full.model_dump_json())
    (tmp_path / "cores.json").write_text(load_profile(PROFILE).model_dump_json())
    for repeat in range(2):
        run, _ = recorded_run(threads_per_rank=1, profile=full)
        write_trace(run, tmp_path / f"1f1b.{repeat}.json")
    fidelity.report(False, tmp_path, fidelity.Console(width=200), tmp_path / "out.json")
    printed = capsys.readouterr().out
    assert "noise floor: the same run repeated varies by 0.0%" in printed
    doc = json.loads((tmp_path / "out.json").read_text())
    assert doc["methods"][0]["iteration_error"] == 0 and doc["noise_floor"] == 0
    errors = [line["methods"][0]["iteration_error"] for line in doc["terms"]]
    # Each term left out makes it faster, but those that only cost memory (the kept gradient, the posted
    # buffers, the boundary tensors), and the passes' tail and the warm-up, which this profile did not measure.
    assert errors[-3] == errors[-2] == errors[-1] == 0 and all(error < 0 for error in errors[:-3])
    assert errors[-6] == errors[-5] == errors[-4]


@pytest.mark.parametrize("method", ["gpipe", "1f1b"])
def test_torchs_cost_per_action_is_what_the_probes_measured_time_needs(fidelity, method):
    """The probe's measured time, inverted through pipesim's timeline of the probe: a time the timeline takes
    with 0.37 ms per forward and backward gives back 0.37 ms; one its passes alone already exceed gives 0."""
    chain, _ = fidelity.workloads(False)
    probe = load_profile(PROFILE)  # stands in for the probe's calibration: any profile cut into 2 stages
    probe_workload = fidelity.torch_probe(chain)
    assert probe_workload.options == {**chain.options, "layers": 1}  # a block and the classifier: a stage each
    measured = fidelity.torch_predicted_ms(method, probe_workload, probe, 0.37)
    assert measured > fidelity.torch_predicted_ms(method, probe_workload, probe, 0.0)
    assert fidelity.torch_action_ms(method, chain, probe, measured) == pytest.approx(0.37, abs=1e-3)
    assert fidelity.torch_action_ms(method, chain, probe, 0.5 * measured) == 0.0


def test_from_a_file_or_a_missing_folder_is_one_line_not_a_traceback(fidelity, tmp_path, capsys):
    """`fidelity.py --from` reads a folder `--keep` filled; a committed JSON record given instead (as a reader of
    traces/measured/ would try) is refused by the parser, exit 2, naming the flag. Its `main` in this process: a
    traceback would be its exception raised here (two fresh interpreters importing it cost 3.4 CPU s)."""
    record = tmp_path / "run.json"
    record.write_text("{}")
    for source in (record, tmp_path / "missing"):
        with pytest.raises(SystemExit) as exited:
            fidelity.main(["--from", str(source)])
        err = capsys.readouterr().err
        assert exited.value.code == 2 and "Traceback" not in err
        assert f"--from {source}: give the folder a run's --keep filled" in err
