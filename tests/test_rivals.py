"""The synchronous rivals of 1F1B against closed forms, the papers' figures and their bounds.

Costs are per model stage (per chunk for interleaved and V schedules); I costs bwd·(1−f), W bwd·f.
"""

import pytest

from pipesim.schedules import Kind, Schedule, ScheduleError, ScheduleParams, build_schedule, validate
from tests.conftest import build, run, simulated

RIVALS = ["interleaved-1f1b", "zb-h1", "zb-h2", "zb-v", "dualpipev"]


def device_text(schedule: Schedule, device: int) -> str:
    return schedule.to_text().splitlines()[device].partition(": ")[2]


# Interleaved 1F1B (Megatron)


def test_interleaved_issue_example_28_5_ms():
    summary = run("interleaved-1f1b", 4, 8, chunks=2, fwd=0.5, bwd=1).summary
    assert summary.makespan_ms == pytest.approx(28.5)


@pytest.mark.parametrize("p,v,m", [(2, 2, 4), (4, 4, 8), (3, 3, 9), (8, 2, 16), (4, 3, 12)])
def test_interleaved_bubble_divided_by_chunks(p, v, m):
    fwd_ms, bwd_ms = 0.5, 1.25  # per chunk
    per_device_ms = v * (fwd_ms + bwd_ms)
    summary = run("interleaved-1f1b", p, m, chunks=v, fwd=fwd_ms, bwd=bwd_ms).summary
    assert summary.makespan_ms == pytest.approx(m * per_device_ms + (p - 1) * per_device_ms / v)


@pytest.mark.parametrize("p,m,n", [(4, 7, 2), (3, 5, 1), (1, 3, 1)])
def test_interleaved_with_one_chunk_is_1f1b(p, m, n):
    params = ScheduleParams(p, m, n)
    assert build_schedule("interleaved-1f1b", params).orders == build_schedule("1f1b", params).orders


def test_interleaved_megatron_order():
    """p=2, v=2, m=4 by hand: device 0 holds stages 0 and 2; warm-up (p−1)·2 + (v−1)·p = 4 forwards go
    through chunk 0 for micro-batches 0, 1, then chunk 1; backwards start on the last chunk."""
    schedule = build_schedule("interleaved-1f1b", ScheduleParams(2, 4, chunks=2))
    assert schedule.placement == (0, 1, 0, 1)
    assert device_text(schedule, 0) == (
        "0F0 0F1 2F0 2F1 0F2 2B0 0F3 2B1 2F2 0B0 2F3 0B1 2B2 2B3 0B2 0B3 0OPT 2OPT")


def _megatron_interleaved_text(p: int, m: int, v: int, g: int, rank: int) -> str:
    """What Megatron-core's forward_backward_pipelining_with_interleaving runs on pipeline `rank`, written as its
    loops run (schedules.py at d98e8a64: `get_schedule_table`, `get_pp_rank_microbatches`, `get_model_chunk_id`),
    in pipesim's text form: stage c·p + rank of chunk c."""
    table = []
    for first in range(0, m, g):
        last = m if first + g >= m else first + g
        table += [(microbatch, chunk) for chunk in range(v) for microbatch in range(first, last)]
    total = m * v
    warmup = min((p - rank - 1) * 2 + (v - 1) * g, total)

    def step(i: int, forward: bool) -> str:
        microbatch, chunk = table[i]
        return f"{(chunk if forward else v - 1 - chunk) * p + rank}{'F' if forward else 'B'}{microbatch}"

    steps = [step(i, True) for i in range(warmup)]
    for k in range(total - warmup):
        steps += [step(k + warmup, True), step(k, False)]
    steps += [step(k, False) for k in range(total - warmup, total)]
    return " ".join(steps + [f"{c * p + rank}OPT" for c in range(v)])


@pytest.mark.parametrize("p,v,m,g", [(2, 2, 4, None), (4, 2, 8, None), (3, 3, 9, None), (2, 2, 5, 3),
                                     (4, 2, 10, 5), (4, 2, 10, 6), (4, 3, 10, 10), (13, 2, 32, 16)])
def test_interleaved_runs_megatron_cores_order_with_any_microbatch_group(p, v, m, g):
    """Every device's order is the one Megatron-core's loops run, with its default group of p micro-batches a
    chunk and with --microbatch-group (GLM-5.2's pretraining recipe: p = 13, v = 2, m = 32, g = 16)."""
    schedule = build_schedule("interleaved-1f1b", ScheduleParams(p, m, chunks=v, microbatch_group=g))
    for rank in range(p):
        assert device_text(schedule, rank) == _megatron_interleaved_text(p, m, v, p if g is None else g, rank)


def test_a_larger_microbatch_group_holds_more_microbatches_in_flight():
    """The warm-up grows by (v - 1) per micro-batch added to the group, and with it the activations device 0
    holds: (p - 1)·2 + (v - 1)·g + 1 chunks' worth."""
    for g, held in ((5, 12), (6, 13), (10, 17)):
        summary = simulated(build("interleaved-1f1b", 4, 10, chunks=2, microbatch_group=g), fwd=0.5, bwd=1).summary
        assert summary.devices[0].peak_activations == held


# Zero bubble, handcrafted (Qi et al. 2023, figure 3)


@pytest.mark.parametrize("p,m,fwd,bwd,wgrad", [
    (4, 8, 1, 2, 0.5), (4, 16, 1, 2, 0.3), (8, 16, 1.3, 2.1, 0.4), (3, 7, 1, 2, 0.5), (2, 4, 1, 3, 0.25)])
def test_zb_h1_bubble_closed_form(p, m, fwd, bwd, wgrad):
    """(p−1)(F + I − W): the W's the later stages defer fill all but F + I − W of each bubble (needs W ≤ I)."""
    input_ms, weight_ms = bwd * (1 - wgrad), bwd * wgrad
    summary = run("zb-h1", p, m, fwd=fwd, bwd=bwd, wgrad_fraction=wgrad).summary
    assert summary.makespan_ms == pytest.approx(m * (fwd + bwd) + (p - 1) * (fwd + input_ms - weight_ms))


def test_zb_h1_issue_example_27_ms():
    assert run("zb-h1", 4, 8, fwd=1, bwd=2, wgrad_fraction=0.5).summary.makespan_ms == pytest.approx(27)


def test_zb_h1_and_h2_match_the_papers_figure():
    """Figure 3, p=4, m=8 (1-based there): device 1 and device 4 of ZB-H1 and ZB-H2."""
    h1 = build_schedule("zb-h1", ScheduleParams(4, 8))
    assert device_text(h1, 0) == ("0F0 0F1 0F2 0F3 0I0 0W0 0F4 0I1 0W1 0F5 0I2 0W2 0F6 0I3 0W3 0F7 0I4 0W4 "
                                  "0I5 0W5 0I6 0W6 0I7 0W7 0OPT")
    assert device_text(h1, 3) == ("3F0 3I0 3F1 3I1 3F2 3I2 3F3 3I3 3W0 3F4 3I4 3W1 3F5 3I5 3W2 3F6 3I6 3W3 "
                                  "3F7 3I7 3W4 3W5 3W6 3W7 3OPT")
    h2 = build_schedule("zb-h2", ScheduleParams(4, 8))
    assert device_text(h2, 0) == ("0F0 0F1 0F2 0F3 0F4 0F5 0F6 0I0 0W0 0F7 0I1 0W1 0I2 0W2 0I3 0W3 0I4 0W4 "
                                  "0I5 0W5 0I6 0W6 0I7 0W7 0OPT")
    assert device_text(h2, 3) == ("3F0 3I0 3F1 3I1 3F2 3I2 3F3 3I3 3F4 3I4 3F5 3I5 3F6 3I6 3W0 3F7 3I7 3W1 "
                                  "3W2 3W3 3W4 3W5 3W6 3W7 3OPT")


@pytest.mark.parametrize("p,m", [(4, 8), (4, 2), (6, 12), (8, 16)])
def test_zb_h1_peak_memory_is_1f1b_peak(p, m):
    """A deferred W keeps its activations, so stage k holds p−k + k micro-batches: never more than 1F1B's
    peak (p, at stage 0), which is the paper's claim; later stages hold more than 1F1B's p−k there."""
    kw = {"fwd": 1, "bwd": 2, "activation_mb": 10, "param_mb": 0, "output_mb": 0}
    h1 = run("zb-h1", p, m, **kw).summary
    one_f_one_b = run("1f1b", p, m, **kw).summary
    peak = min(p, m)
    assert h1.devices[0].peak_activations == one_f_one_b.devices[0].peak_activations == peak
    assert max(d.peak_activations for d in h1.devices) == peak
    assert h1.peak_memory_mb <= one_f_one_b.peak_memory_mb


@pytest.mark.parametrize("p,m", [(2, 3), (4, 7), (4, 8), (6, 20)])
def test_zb_h2_activations_and_parallelogram(p, m):
    """Stage 0 runs 2p−1 forwards before its first I. With F = I = W nothing idles after the warm-up,
    so the last stage, which cannot start before (p−1)·F, runs without a gap: m(F+B) + (p−1)F."""
    fwd, bwd = 1.0, 2.0
    summary = run("zb-h2", p, m, fwd=fwd, bwd=bwd, wgrad_fraction=0.5).summary
    assert summary.devices[0].peak_activations == 2 * p - 1
    assert summary.makespan_ms == pytest.approx(m * (fwd + bwd) + (p - 1) * fwd)


@pytest.mark.parametrize("fwd,bwd,wgrad,comm", [(1, 2, 0.5, 0), (1, 2, 0.3, 0.2), (1.3, 2.1, 0.6, 0.1),
                                                (1, 3, 0.5, 0.5)])
def test_zb_h2_never_slower_than_h1_and_h1_never_slower_than_1f1b(fwd, bwd, wgrad, comm):
    for p in (2, 3, 5):
        for m in range(1, 3 * p + 1):
            kw = {"fwd": fwd, "bwd": bwd, "wgrad_fraction": wgrad, "comm": comm}
            h1 = run("zb-h1", p, m, **kw).summary.makespan_ms
            assert h1 <= run("1f1b", p, m, **kw).summary.makespan_ms + 1e-9, (p, m)
            if m >= 2 * p - 1:
                assert run("zb-h2", p, m, **kw).summary.makespan_ms <= h1 + 1e-9, (p, m)


# V schedules: ZB-V and DualPipeV


@pytest.mark.parametrize("name,p,m", [("zb-v", p, m) for p in (1, 2, 3, 5) for m in (1, 2, p, 2 * p - 1, 3 * p)]
                         + [("dualpipev", p, m) for p in (1, 2, 3, 5) for m in (2 * p, 2 * p + 1, 3 * p + 2)])
def test_v_schedules_are_valid_and_fold_the_chain(name, p, m):
    schedule = build_schedule(name, ScheduleParams(p, m, 2, chunks=2))
    validate(schedule)
    assert schedule.num_stages == 2 * p
    assert all(schedule.stages_on(i) == [i, 2 * p - 1 - i] for i in range(p))


@pytest.mark.parametrize("p,m", [(2, 3), (4, 8), (6, 20)])
def test_zb_v_reaches_the_lower_bound_when_f_i_w_are_equal(p, m):
    """With F = I = W (ZB-V's "zero bubble" case) the last device, whose first input arrives after p−1
    forwards, never idles again: makespan (p−1)F + 2m(F+B), the least any order can do. (DualPipeV's overlapped
    pairs wait for both parts' inputs, so it does not: its bubble is the README's, test_deepseek_table.)"""
    fwd, bwd = 1.0, 2.0
    summary = run("zb-v", p, m, chunks=2, fwd=fwd, bwd=bwd, wgrad_fraction=0.5).summary
    assert summary.makespan_ms == pytest.approx((p - 1) * fwd + 2 * m * (fwd + bwd))


@pytest.mark.parametrize("p,m", [(2, 4), (4, 8), (4, 13), (6, 12)])
def test_zb_v_activation_memory_is_1f1b_peak(p, m):
    """ZB-V holds at most 2p chunk micro-batches; a chunk is half a 1F1B stage, so that is 1F1B's p."""
    zbv = run("zb-v", p, m, chunks=2, fwd=0.5, bwd=1, activation_mb=5, param_mb=0, output_mb=0).summary
    one_f_one_b = run("1f1b", p, m, fwd=1, bwd=2, activation_mb=10, param_mb=0, output_mb=0).summary
    assert max(d.peak_activations for d in zbv.devices) == 2 * p
    assert zbv.peak_memory_mb <= one_f_one_b.peak_memory_mb


def test_dualpipev_matches_the_readme_figure():
    """DualPipe README, DualPipeV with 4 ranks and 10 micro-batches (images/dualpipev.png): device 0 (stages 0 and
    7) and device 3 (stages 3 and 4), each cell in order, two cells in one black border an overlapped pair; the
    last device's first F and B stand apart, as dualpipev.py's step 4 runs them."""
    schedule = build_schedule("dualpipev", ScheduleParams(4, 10, chunks=2))
    assert device_text(schedule, 0) == (
        "0F0 0F1 0F2 0F3 0F4 0F5 0F6 7F0 7I0 7W0 7F1 7I1 7W1 7F2 7I2 7W2 7F3 "
        "(0F7;7B3)OVERLAP_F_B (7F4;0B0)OVERLAP_F_B (0F8;7B4)OVERLAP_F_B (7F5;0B1)OVERLAP_F_B "
        "(0F9;7B5)OVERLAP_F_B (7F6;0B2)OVERLAP_F_B "
        "7B6 (7F7;0B3)OVERLAP_F_B 7B7 (7F8;0B4)OVERLAP_F_B 7B8 (7F9;0B5)OVERLAP_F_B "
        "7B9 0I6 0W6 0I7 0W7 0I8 0W8 0I9 0W9 0OPT 7OPT")
    assert device_text(schedule, 3) == (
        "3F0 4F0 3F1 4F1 3F2 4F2 3F3 4F3 3F4 4B0 (4F4;3B0)OVERLAP_F_B (3F5;4B1)OVERLAP_F_B (4F5;3B1)OVERLAP_F_B "
        "(3F6;4B2)OVERLAP_F_B (4F6;3B2)OVERLAP_F_B (3F7;4B3)OVERLAP_F_B (4F7;3B3)OVERLAP_F_B (3F8;4B4)OVERLAP_F_B "
        "(4F8;3B4)OVERLAP_F_B (3F9;4B5)OVERLAP_F_B (4F9;3B5)OVERLAP_F_B "
        "4B6 3B6 4B7 3B7 4I8 3I8 4I9 3I9 4W8 3W8 4W9 3W9 3OPT 4OPT")


@pytest.mark.parametrize("p,m,fwd,bwd,wgrad", [(2, 4, 1, 2, 0.5), (4, 8, 1, 2, 0.3), (4, 16, 1.3, 2.1, 0.6),
                                               (8, 16, 1, 3, 0.5)])
def test_dualpipev_beats_1f1b_with_the_same_work_per_device(p, m, fwd, bwd, wgrad):
    """1F1B on p devices with stages twice as long (2F, 2B) has the same work per device and bubble
    (p−1)·2(F+B); DualPipeV, its overlapped pairs priced F + B (nothing to hide), still has less. Activations: the
    README's PP+1 = 2p+1 chunks; weights: one copy per stage. (Its README bubble: test_deepseek_table.)"""
    dpv = run("dualpipev", p, m, chunks=2, fwd=fwd, bwd=bwd, wgrad_fraction=wgrad).summary
    one_f_one_b = run("1f1b", p, m, fwd=2 * fwd, bwd=2 * bwd).summary
    assert dpv.makespan_ms < one_f_one_b.makespan_ms
    assert [d.peak_activations for d in dpv.devices] == [2 * p + 1] * p
    assert [d.peak_weight_versions for d in dpv.devices] == [1] * p


# Every rival


@pytest.mark.parametrize("name", RIVALS)
def test_rivals_are_synchronous_and_flush_per_minibatch(name):
    p, m, n = 3, 6, 3
    schedule, _, summary = run(name, p, m, n)  # each in its default shape: v = 2 for the interleaved and V
    assert summary.max_staleness == 0
    assert all(d.peak_weight_versions == 1 for d in summary.devices)
    for order in schedule.orders:
        opt_at = {(a.stage, a.minibatch): i for i, a in enumerate(order) if a.kind is Kind.OPT}
        for i, a in enumerate(order):
            if a.microbatch >= 0:
                assert opt_at.get((a.stage, a.minibatch - 1), -1) < i < opt_at[(a.stage, a.minibatch)]


@pytest.mark.parametrize("name,params,fragment", [
    ("interleaved-1f1b", ScheduleParams(4, 6, chunks=2), "multiple of stages"),
    ("interleaved-1f1b", ScheduleParams(4, 9, chunks=2), r"microbatch_group_size_per_vp_stage\), here 5 at the "
                                                         "least$"),
    ("interleaved-1f1b", ScheduleParams(4, 8, pipelines=2), "--pipelines: give 1, as "),
    ("interleaved-1f1b", ScheduleParams(4, 10, chunks=2), "simulate, run and export take --microbatch-group G"),
    ("interleaved-1f1b", ScheduleParams(4, 10, chunks=2, microbatch_group=3), r"give 4 \(p\) to 10 \(m\)"),
    ("interleaved-1f1b", ScheduleParams(4, 10, chunks=2, microbatch_group=11), r"give 4 \(p\) to 10 \(m\)"),
    ("interleaved-1f1b", ScheduleParams(4, 10, chunks=2, microbatch_group=4), "m mod G = 2 micro-batches, fewer"),
    ("interleaved-1f1b", ScheduleParams(4, 8, microbatch_group=4), "at v = 1 runs Megatron's plain 1F1B"),
    ("interleaved-1f1b", ScheduleParams(4, 2, chunks=2, microbatch_group=4), "m = 2 is fewer than p = 4"),
    ("zb-h1", ScheduleParams(4, 8, chunks=2), "--chunks: give 1, as "),
    ("zb-h2", ScheduleParams(4, 8, chunks=2), "--chunks: give 1, as "),
    ("zb-h2", ScheduleParams(4, 6), "at least 2p-1 = 7 micro-batches"),
    ("zb-v", ScheduleParams(4, 8), "--chunks: give 2, as "),
    ("zb-v", ScheduleParams(4, 8, chunks=3), "--chunks: give 2, as "),
    ("zb-v", ScheduleParams(4, 8, chunks=2, pipelines=2), "--pipelines: give 1, as "),
    ("dualpipev", ScheduleParams(4, 8, chunks=1), "--chunks: give 2, as "),
    ("dualpipev", ScheduleParams(4, 7, chunks=2), "at least 2p micro-batches"),
])
def test_bad_configurations_say_what_is_wrong(name, params, fragment):
    with pytest.raises(ScheduleError, match=fragment):
        build_schedule(name, params)
