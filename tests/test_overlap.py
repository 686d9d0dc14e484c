"""Overlapped pairs (DeepSeek-V3's F&B, torch's OVERLAP_F_B): their text, checks, lowering and price."""

from dataclasses import replace

import numpy as np
import pytest

from pipesim.schedules import (
    Action,
    Kind,
    Schedule,
    ScheduleError,
    ScheduleParams,
    build_schedule,
    check_complete,
    find_deadlock,
    lower,
)
from pipesim.schedules.ir import overlapped
from pipesim.sim import Cluster, CostError, Costs, simulate
from pipesim.traces import read_trace, write_trace
from pipesim.traces.trace import Stream
from tests.conftest import pipesim, simulate_json
from tests.helpers import two_stage_schedule


def test_a_pair_is_written_as_torch_writes_it_and_read_back():
    forward, backward = overlapped(Action.parse("0F7"), Action.parse("7B3"))
    assert (str(forward), str(backward)) == ("0F7&7", "7B3&0")
    assert Action.parse("7B3&0") == backward
    schedule = build_schedule("dualpipev", ScheduleParams(2, 4, 2, chunks=2))
    assert "(0F3;3B1)OVERLAP_F_B" in schedule.to_text().split()
    assert Schedule.orders_from_text(schedule.to_text()) == tuple(tuple(o) for o in schedule.orders)


@pytest.mark.parametrize("text", ["0OPT&1", "1RECV_F3&0", "0W2&1", "0SEND_B1&0"])
def test_only_a_forward_or_a_full_backward_names_a_pair_partner(text):
    with pytest.raises(ScheduleError, match="'&peer'"):
        Action.parse(text)


@pytest.mark.parametrize("token", ["(0F1;0F0)OVERLAP_F_B", "(0B1;0F0)OVERLAP_F_B", "(0F1;0B1)OVERLAP_F_B",
                                   "(0F1;0I0)OVERLAP_F_B", "(0F1;0B0.1)OVERLAP_F_B"])
def test_a_pair_is_a_forward_then_a_full_backward_of_another_micro_batch(token):
    with pytest.raises(ScheduleError, match="overlapped pair is a forward and a full backward"):
        Schedule.orders_from_text(f"0: {token}")


def test_a_part_without_its_partner_next_to_it_is_refused():
    schedule = two_stage_schedule("0F0&1 0F1 0B0 0B1 0OPT", "1F0 1B0 1F1 1B1 1OPT")
    with pytest.raises(ScheduleError, match="0F0&1 on device 0 .* its other part is not next to it"):
        check_complete(schedule)


def test_a_pair_starts_only_once_both_parts_can():
    """Run in turn, 0F1 would feed 1F1, then 1B0 would feed 0B0; as a pair, 0F1 waits for 0B0's input."""
    in_turn = two_stage_schedule("0F0 0F1 0B0 0B1 0OPT", "1F0 1F1 1B0 1B1 1OPT")
    assert find_deadlock(in_turn) == {}
    paired = two_stage_schedule("0F0 (0F1;0B0)OVERLAP_F_B 0B1 0OPT", "1F0 1F1 1B0 1B1 1OPT")
    stuck = find_deadlock(paired)
    assert str(stuck[0][0]) == "0F1&0" and stuck[1][0] == Action(Kind.F, 1, 1)


def test_a_pair_receives_both_inputs_before_it_and_sends_both_outputs_after_it():
    lowered = lower(build_schedule("dualpipev", ScheduleParams(3, 6, chunks=2)))
    t = lowered.table
    pairs = np.flatnonzero((t.kind == list(Kind).index(Kind.F)) & (t.peer >= 0))
    assert len(pairs) and (t.kind[pairs + 1] == list(Kind).index(Kind.B)).all()
    checked = 0
    kinds = [Kind(k) for k in (list(Kind)[c] for c in t.kind)]
    for f in pairs.tolist():
        before, after = f, f + 2
        while before > 0 and kinds[before - 1] in (Kind.RECV_F, Kind.RECV_B) and t.device[before - 1] == t.device[f]:
            before -= 1
        while after < len(kinds) and kinds[after] in (Kind.SEND_F, Kind.SEND_B) and t.device[after] == t.device[f]:
            after += 1
        received = {(int(t.stage[i]), int(t.microbatch[i])) for i in range(before, f)}
        sent = {(int(t.stage[i]), int(t.microbatch[i])) for i in range(f + 2, after)}
        parts = {(int(t.stage[f]), int(t.microbatch[f])), (int(t.stage[f + 1]), int(t.microbatch[f + 1]))}
        assert received <= parts and sent <= parts
        checked += len(received) + len(sent)
    # and every part's transfers are there: those of the same order run without pairs
    plain = build_schedule("dualpipev", ScheduleParams(3, 6, chunks=2))
    unpaired = lower(plain.with_orders(tuple(tuple(a._replace(peer=-1) for a in o) for o in plain.orders)))
    paired_transfers = sorted(lowered.transfer[lowered.transfer >= 0])
    assert paired_transfers == sorted(unpaired.transfer[unpaired.transfer >= 0])
    assert checked > len(pairs)  # the pairs' own transfers were found around them


@pytest.mark.parametrize("fraction", [0.0, 0.25, 1.0])
def test_a_pair_costs_both_parts_less_the_hidden_share_of_the_shorter(fraction):
    fwd_ms, bwd_ms = 1.0, 3.0
    schedule = build_schedule("dualpipev", ScheduleParams(2, 4, chunks=2))
    costs = replace(Costs.per_stage(4, fwd_ms=fwd_ms, bwd_ms=bwd_ms), overlap_hidden_fraction=fraction)
    ops = simulate(schedule, costs, Cluster.uniform(2, 0.0)).ops
    compute = np.flatnonzero(ops.stream == Stream.COMPUTE)
    forward = compute[(ops.kind[compute] == list(Kind).index(Kind.F)) & (ops.peer[compute] >= 0)]
    assert len(forward)
    backward = np.array([compute[np.searchsorted(compute, f) + 1] for f in forward])
    assert np.allclose(ops.start_us[backward], ops.start_us[forward] + ops.dur_us[forward])  # back to back
    assert np.allclose(ops.dur_us[forward] + ops.dur_us[backward], 1e3 * (fwd_ms + bwd_ms - fraction * fwd_ms))
    assert np.allclose(ops.dur_us[backward], 1e3 * bwd_ms)  # the longer part keeps its time


def test_a_pair_whose_parts_ran_at_once_is_counted_once():
    """On a GPU the executor runs a pair's parts on two streams at once, each row spanning its part
    (executor/overlap.py): a device's compute is the time its rows run, so that run's busy time and bubble are the
    simulation's, whose pair runs its parts back to back in the same time. Summed, each pair counted its forward
    part twice."""
    from pipesim.traces.metrics import steady_compute_ms, summarize

    schedule = build_schedule("dualpipev", ScheduleParams(2, 4, 2, chunks=2))
    costs = replace(Costs.per_stage(4, fwd_ms=1.0, bwd_ms=3.0), overlap_hidden_fraction=0.5)
    predicted = simulate(schedule, costs, Cluster.uniform(2, 0.0))
    ops = predicted.ops
    compute = np.flatnonzero(ops.stream == Stream.COMPUTE)
    forward = compute[(ops.kind[compute] == list(Kind).index(Kind.F)) & (ops.peer[compute] >= 0)]
    backward = compute[np.searchsorted(compute, forward) + 1]
    start_us, dur_us = ops.start_us.copy(), ops.dur_us.copy()
    start_us[backward] = start_us[forward]  # both streams start the pair; the backward part ends it
    dur_us[backward] += dur_us[forward]
    measured = replace(predicted, meta=replace(predicted.meta, source="measured"),
                       ops=replace(ops, start_us=start_us, dur_us=dur_us))
    assert len(forward) and np.all(ops.dur_us[forward] > 0) and np.array_equal(measured.ops.end_us, ops.end_us)
    both = summarize(predicted), summarize(measured)
    assert [d.busy_ms for d in both[1].devices] == pytest.approx([d.busy_ms for d in both[0].devices], rel=1e-12)
    assert both[1].bubble_fraction == pytest.approx(both[0].bubble_fraction, abs=1e-12)
    assert steady_compute_ms(measured) == pytest.approx(steady_compute_ms(predicted), rel=1e-12)
    assert both[0].bubble_fraction > 0


def test_the_trace_says_how_its_pairs_were_priced(tmp_path):
    schedule = build_schedule("dualpipev", ScheduleParams(2, 4, chunks=2))
    costs = Costs.per_stage(4, fwd_ms=1.0, bwd_ms=2.0)
    assert "overlap_hidden_fraction" not in simulate(schedule, costs, Cluster.uniform(2, 0.0)).meta.extra
    trace = simulate(schedule, replace(costs, overlap_hidden_fraction=0.5), Cluster.uniform(2, 0.0))
    write_trace(trace, tmp_path / "t.json")
    assert read_trace(tmp_path / "t.json").meta.extra["overlap_hidden_fraction"] == 0.5


@pytest.mark.parametrize("fraction", [-0.1, 1.5, float("nan"), True])
def test_a_hidden_share_outside_0_to_1_is_refused(fraction):
    with pytest.raises(CostError, match="overlap_hidden_fraction must be a number from 0 to 1"):
        replace(Costs.per_stage(2, fwd_ms=1.0, bwd_ms=2.0), overlap_hidden_fraction=fraction)


def test_simulate_says_how_many_pairs_each_method_overlaps_and_prices_them_by_the_flag():
    """DualPipeV on 4 ranks, 8 micro-batches: rank r overlaps 2m - 3p + r + 1 pairs (dualpipev.py's steps 4 and
    5), the last rank one fewer (its first F and B apart): 5 + 6 + 7 + 7."""
    args = ("-s", "dualpipev", "-s", "1f1b", "-p", 4, "-m", 8, "-n", 1)
    plain, hidden = simulate_json(*args), simulate_json(*args, "--fb-hidden-fraction", 1)
    assert [(r["schedule"], r["overlapped_pairs"], r["fb_hidden_fraction"]) for r in plain] == [
        ("dualpipev", 25, 0.0), ("1f1b", 0, None)]
    assert hidden[0]["fb_hidden_fraction"] == 1.0
    assert hidden[0]["makespan_ms"] < plain[0]["makespan_ms"] and hidden[1] == plain[1]
    code, out, _ = pipesim("simulate", *args)
    caption = " ".join(out.split())  # the pairs of every device together: "dualpipev 867" read as one device's
    assert code == 0, caption
    assert ("F&B pairs per mini-batch over all devices: dualpipev 25, each taking F + B, neither compute hidden "
            "under the other") in caption


def test_the_pairs_caption_writes_thousands_separated():
    """DeepSeek-V3's DualPipe on 16 ranks, 120 micro-batches (docs/hardware.md) read "dualpipe 1606" beside the
    table's "19,483.322"; DualPipeV on 8 ranks, 160 micro-batches overlaps 2,403 pairs a mini-batch."""
    code, out, err = pipesim("simulate", "-s", "dualpipev", "-p", 8, "-m", 160, "-n", 1)
    assert code == 0 and "over all devices: dualpipev 2,403, each" in " ".join(out.split()), err


@pytest.mark.parametrize("args,fragment", [
    (("-s", "1f1b", "--fb-hidden-fraction", "0.3"), "--fb-hidden-fraction prices overlapped F&B pairs, and none of"),
    (("-s", "dualpipev", "--fb-hidden-fraction", "1.5"), "--fb-hidden-fraction"),
    (("-s", "dualpipev", "--fb-hidden-fraction", "half"), "--fb-hidden-fraction"),
])
def test_a_bad_hidden_share_is_one_line_and_exit_2(args, fragment, tmp_path):
    page = tmp_path / "t.html"
    code, _, err = pipesim("simulate", *args, "--html", page)
    assert code == 2 and fragment in err and err.strip().count("\n") == 0
    assert not page.exists()
