"""ZeRO-3 (FSDP) beside the pipeline as rows of the IR (schedules/passes.py `gathered_passes`): a GATHER of a
stage's whole weights ahead of the passes that compute with them, issued one row early as FSDP2 prefetches, on the
data-parallel link; the reduce-scatter of the gradients after the stage's last backward; memory from the gather."""

import numpy as np
import pytest

from pipesim.planning.scenario import CollectiveLink, collective_costs
from pipesim.schedules import KIND_CODE, Kind, ScheduleError, build_schedule, check_complete, lower
from pipesim.schedules.catalogue import METHODS
from pipesim.sim import Cluster, Costs, simulate
from pipesim.units import MIB

GB_PER_S = 1e6  # bytes per ms in a GB/s


def _schedule(name: str, stages: int, zero: int = 3, d: int = 2, m: int = 4, n: int = 2):
    return build_schedule(name, METHODS[name].params(stages, m, n, data_parallel=d, zero=zero))


def _text(order) -> list[str]:
    return [str(a) for a in order]


def test_a_pipeline_gathers_each_stage_once_a_mini_batch_ahead_of_its_first_forward():
    """1F1B, p = 4: one GATHER per stage and mini-batch (the first mini-batch's too), none after an update; the
    first right before the device's first forward, the next right after the stage's own update (the weights it
    gathers are the updated ones)."""
    schedule = _schedule("1f1b", 4)
    for k, order in enumerate(schedule.orders):
        text = _text(order)
        assert text.count(f"{k}GATHER0") == 1 and text.count(f"{k}GATHER0.1") == 1
        assert text[:2] == [f"{k}GATHER0", f"{k}F0"]
        assert text[text.index(f"{k}OPT") + 1:text.index(f"{k}OPT") + 3] == [f"{k}GATHER0.1", f"{k}F0.1"]
        assert text[-1] == f"{k}OPT.1"  # nothing gathered after the last update


@pytest.mark.parametrize(("name", "second"), [("interleaved-1f1b", 2), ("zb-v", 3), ("dualpipev", 3)])
def test_a_devices_stages_are_all_gathered_before_its_first_row_of_the_mini_batch(name, second):
    """Two stages a device: as torch's runtime lowers a multi-stage schedule (`_add_unshard_reshard`: the next
    three stages unsharded before the step's first action), both GATHERs come before the device's first row of
    each mini-batch, in the order the stages are first used, and after both updates of the mini-batch before."""
    text = _text(_schedule(name, 2).orders[0])
    assert text[:3] == ["0GATHER0", f"{second}GATHER0", "0F0"]
    at = text.index("0GATHER0.1")
    assert text[at - 2:at] in (["0OPT", f"{second}OPT"], [f"{second}OPT", "0OPT"])
    assert text[at + 1:at + 3] == [f"{second}GATHER0.1", "0F0.1"]


def test_one_stage_gathers_before_every_pass_one_pass_ahead_and_reduces_after_every_backward():
    """No pipeline (FSDP2 alone, resharding after forward): a GATHER for every F and B, each issued before the
    pass ahead of the one it is for, and the lowering makes that pass wait for it; a REDUCE (reduce-scatter)
    right after every backward, as FSDP2 syncs each backward's gradients when no pipeline turns that off."""
    schedule = _schedule("1f1b", 1, m=4, n=1)
    text = _text(schedule.orders[0])
    assert text[:8] == ["0GATHER0", "0GATHER0", "0F0", "0GATHER1", "0B0", "0REDUCE0", "0GATHER1", "0F1"]
    assert text.count("0GATHER0") == 2 and sum(s.startswith("0GATHER") for s in text) == 2 * 4
    assert [text[i - 1] for i, s in enumerate(text) if s.startswith("0REDUCE")] == [f"0B{j}" for j in range(4)]
    assert text[-2:] == ["0REDUCE3", "0OPT"]
    lowered = lower(schedule)
    t = lowered.table
    gathers = np.flatnonzero(t.kind == KIND_CODE[Kind.GATHER])
    passes = np.flatnonzero(np.isin(t.kind, [KIND_CODE[Kind.F], KIND_CODE[Kind.B]]))
    assert lowered.awaits[passes].tolist() == gathers.tolist()
    reduces = np.flatnonzero(t.kind == KIND_CODE[Kind.REDUCE])
    assert lowered.awaits[t.kind == KIND_CODE[Kind.OPT]].tolist() == [reduces[-1]]  # the update, for the last


def test_a_missing_gather_is_named():
    schedule = _schedule("1f1b", 2, n=1)
    orders = [[a for a in order if str(a) != "1GATHER0"] for order in schedule.orders]
    with pytest.raises(ScheduleError, match=r"1GATHER appears 0 times \(d = 2, ZeRO-3: 1 per update\)"):
        check_complete(schedule.with_orders(tuple(tuple(o) for o in orders)))


@pytest.mark.parametrize("zero", [1, 2])
def test_below_zero_3_the_gather_follows_the_update(zero):
    text = _text(_schedule("1f1b", 2, zero=zero).orders[0])
    assert text[:1] == ["0F0"] and text[text.index("0OPT") + 1] == "0GATHER"


@pytest.mark.parametrize("d", [2, 8])
def test_the_rows_move_16_bit_weights_and_reduce_scatter_float32_gradients(d):
    """FSDP2's mixed precision: a GATHER moves (d-1)/d of the stage's 16-bit weights per rank, its REDUCE is a
    reduce-scatter of (d-1)/d of the float32 gradients (twice the bytes)."""
    schedule = _schedule("1f1b", 2, d=d)
    costs = Costs.per_stage(2, fwd_ms=1.0, bwd_ms=2.0, param_mb=100, precision="fsdp2")
    priced = collective_costs(costs, schedule, CollectiveLink(0.0, 10 * GB_PER_S, "test"))
    stage = priced.stages[0]
    assert stage.gather_ms == pytest.approx(100 * MIB * (d - 1) / d / (10 * GB_PER_S))
    assert stage.reduce_ms == pytest.approx(2 * stage.gather_ms)


def _one_stage_trace(gb_per_s: float):
    """One stage, 4 micro-batches, F 1 ms and B 2 ms, 100 MiB of weights gathered over d = 2 at `gb_per_s`: its
    costs and its trace."""
    schedule = _schedule("1f1b", 1, m=4, n=1)
    costs = Costs.per_stage(1, fwd_ms=1.0, bwd_ms=2.0, param_mb=100)
    costs = collective_costs(costs, schedule, CollectiveLink(0.0, gb_per_s * GB_PER_S, "test"))
    return costs, simulate(schedule, costs, Cluster.uniform(1, 0.0))


def _one_stage_run(gb_per_s: float):
    """`_one_stage_trace`'s gather time and its passes' and gathers' starts and ends, in ms."""
    costs, trace = _one_stage_trace(gb_per_s)
    kinds = list(trace.kinds)
    ops = trace.ops
    passes = np.flatnonzero(np.isin(ops.kind, [kinds.index("F"), kinds.index("B")]))
    gathers = np.flatnonzero(ops.kind == kinds.index("GATHER"))
    start, end = ops.start_us / 1e3, (ops.start_us + ops.dur_us) / 1e3
    return costs.stages[0].gather_ms, start[passes], end[passes], start[gathers], end[gathers]


def test_a_fast_links_gathers_hide_behind_the_pass_ahead():
    """26 us gathers: only the first is exposed; every later pass starts where the one before it ends."""
    gather_ms, start, end, _, gather_end = _one_stage_run(2000.0)
    assert gather_ms < 0.1
    assert start[0] == pytest.approx(gather_end[0]) == pytest.approx(gather_ms)
    assert start[1:] == pytest.approx(end[:-1])


def test_a_slow_links_gathers_are_exposed():
    """2.6 ms gathers, longer than any pass (F 1 ms, B 2 ms): each pass waits for its own, idle before it."""
    gather_ms, start, end, _, gather_end = _one_stage_run(20.0)
    assert gather_ms > 2.5
    assert start == pytest.approx(gather_end)
    assert np.all(start[1:] > end[:-1])


def test_the_whole_weights_are_held_from_the_gather():
    """1F1B, p = 2, d = 2, ZeRO-3: device 0's parameters rise from their half to the whole when the GATHER starts,
    which is before its first forward of the mini-batch by the gather's time."""
    schedule = _schedule("1f1b", 2, n=2)
    costs = Costs.per_stage(2, fwd_ms=1.0, bwd_ms=2.0, param_mb=100)
    costs = collective_costs(costs, schedule, CollectiveLink(0.0, 20 * GB_PER_S, "test"))
    trace = simulate(schedule, costs, Cluster.uniform(2, 0.0))
    counter = trace.counters["memory_bytes.parameters"][0]
    rises = [float(t) / 1e3 for t, v, before in zip(counter.times_us[1:], counter.values[1:], counter.values)
             if v > before]
    kinds = list(trace.kinds)
    ops = trace.ops
    mine = ops.device == 0
    gathers = np.flatnonzero(mine & (ops.kind == kinds.index("GATHER")))
    forwards = np.flatnonzero(mine & (ops.kind == kinds.index("F")) & (ops.microbatch == 0))
    assert rises == pytest.approx((ops.start_us[gathers] / 1e3).tolist())
    assert ops.start_us[forwards] / 1e3 == pytest.approx(ops.start_us[gathers] / 1e3 + costs.stages[0].gather_ms)
    assert max(counter.values) // MIB == 150


@pytest.mark.parametrize(("gb_per_s", "exposed"), [
    (2000.0, lambda gather, reduce: gather + reduce),  # the first gather and the last reduce-scatter
    (20.0, lambda gather, reduce: 8 * gather + 4 * reduce - 10.0),  # all but the 10 ms of compute beside it
])
def test_the_page_draws_the_gathers_on_the_network_lane_and_the_summary_counts_what_they_expose(gb_per_s, exposed):
    """The timeline's data hold one GATHER per pass of the one-stage run on the network stream; the summary's
    exposed collective time is what the passes do not hide: on a fast link the first gather and the last
    backward's reduce-scatter, on a slow one every collective but the compute beside them: the link is busy from
    the start to the last gather's end, under every pass but the last backward, which runs after it and before
    its reduce-scatter."""
    from pipesim.traces import summarize
    from pipesim.traces.view import decode_column, trace_data

    costs, trace = _one_stage_trace(gb_per_s)
    page = trace_data(trace)
    kind = decode_column(page["columns"]["kind"])
    stream = decode_column(page["columns"]["stream"])
    gathers = kind == page["kinds"].index("GATHER")
    assert gathers.sum() == 8 and {page["streams"][s] for s in stream[gathers]} == {"network"}
    stage = costs.stages[0]
    assert summarize(trace).devices[0].exposed_collective_ms == pytest.approx(exposed(stage.gather_ms,
                                                                                      stage.reduce_ms))


@pytest.mark.parametrize(("name", "stages"), [(name, stages) for stages in (1, 2) for name in METHODS if name not in
                                               ("auto", "graphpipe") and (name, stages) != ("dualpipe", 1)])
def test_every_method_gathers_and_simulates_under_zero_3(name, stages):
    """A GATHER per pass where one stage runs alone (FSDP2's resharding after forward), else one per stage a
    device holds and mini-batch; each simulates with the memory parts summing to the peak."""
    from pipesim.traces import summarize

    schedule = build_schedule(name, METHODS[name].params(stages, 4, 2, data_parallel=2, zero=3))
    kinds = [a.kind for a in schedule.orders[0]]
    alone = schedule.num_stages == 1 and schedule.pipelines == 1
    passes = sum(k in (Kind.F, Kind.B, Kind.I, Kind.W) for k in kinds)
    held = len(schedule.stages_on(0)) * schedule.pipelines * 2
    assert kinds.count(Kind.GATHER) == (passes if alone else held)
    costs = Costs.per_stage(schedule.num_stages, fwd_ms=1.0, bwd_ms=2.0, param_mb=100, activation_mb=10,
                            output_mb=1)
    costs = collective_costs(costs, schedule, CollectiveLink(0.0, 100 * GB_PER_S, "test"))
    summary = summarize(simulate(schedule, costs, Cluster.uniform(schedule.num_devices, 0.1)))
    for device in summary.devices:
        assert sum(device.peak_memory_parts_mb.values()) == pytest.approx(device.peak_memory_mb, rel=1e-12)
