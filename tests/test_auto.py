"""`auto`: the schedule searched from the costs. Never slower than a fixed order that fits the same activation
limit, the limit held in the simulated memory curve, every schedule valid, the same inputs the same schedule; and
at least as good as the zero-bubble paper's own automatic schedules (ZB-1p, ZB-2p) on the paper's costs."""

import itertools
import json
import random
from dataclasses import replace
from pathlib import Path

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from pipesim.planning.auto import (
    _GRID,
    _STEADY,
    DEFAULT_SECONDS,
    ActivationLimitError,
    Knobs,
    StageTimes,
    _buffer_bytes,
    _greedy,
    _in_order,
    _roomy,
    best_pattern,
    finish_ms,
    fits,
    forget_searches,
    one_f_one_b_peak,
    schedule_frame,
    search_schedule,
    stage_times,
    within_room,
)
from pipesim.schedules import METHODS, ScheduleError, preflight
from pipesim.sim import Cluster, Costs, simulate
from pipesim.sim.engine import static_bytes
from pipesim.traces import read_trace, summarize
from pipesim.units import MIB
from tests.conftest import pipesim, simulate_json
from tests.helpers import GPT_CPU

PAPER = Path(__file__).resolve().parents[1] / "benchmarks" / "zero_bubble_paper.json"
FIXED = ("1f1b", "zb-h1", "zb-h2")


def _run(schedule, costs, comm):
    trace = simulate(schedule, costs, Cluster.uniform(schedule.num_devices, comm))
    return trace, summarize(trace)


def _peak_activation_bytes(trace, schedule, costs):
    """Per device, the simulated peak memory beyond what it holds throughout (weights, gradients, state)."""
    static = static_bytes(schedule, costs)
    return [counter.values.max() - static[d] for d, counter in enumerate(trace.counters["memory_bytes"])]


@st.composite
def scenarios(draw):
    p = draw(st.integers(2, 5))
    m = draw(st.integers(p, 3 * p))
    per_stage = st.lists(st.floats(0.5, 3.0), min_size=p, max_size=p)
    fwd = draw(per_stage)
    bwd = [f * draw(st.floats(1.2, 2.5)) for f in fwd]  # uneven stages, B about twice F
    activation = draw(st.lists(st.floats(1.0, 4.0), min_size=p, max_size=p))
    costs = Costs.per_stage(p, fwd_ms=fwd, bwd_ms=bwd, wgrad_fraction=draw(st.floats(0.2, 0.7)),
                            activation_mb=activation, output_mb=0.0, param_mb=1.0)
    return p, m, costs, draw(st.sampled_from([0.0, 0.05, 0.3]))


# R = 2 allows exactly two of the last stage's micro-batches; ZB-H2 holds them and one rounded byte more (its I
# keeps half of an odd byte count, rounded up), so it does not fit, and auto rightly takes the slower order.
BYTE_OVER = (2, 3, Costs.per_stage(2, fwd_ms=1.0, bwd_ms=2.0, wgrad_fraction=0.5, activation_mb=[1.0, 2963127 / MIB],
                                   output_mb=0.0, param_mb=1.0), 0.0)


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(scenarios(), st.sampled_from([1.0, 2.0]))
@example(BYTE_OVER, 2.0)
def test_property_auto_is_valid_within_its_limit_and_never_slower_than_a_fixed_order_that_fits(scenario, limit):
    p, m, costs, comm = scenario
    held = [c.activation_bytes for c in costs.stages]
    auto = search_schedule(METHODS["auto"].params(p, m, 2, activation_limit=limit, search_seconds=0.05), costs,
                           Cluster.uniform(p, comm))
    preflight(auto, dry_run=True)
    trace, summary = _run(auto, costs, comm)
    assert summary.max_staleness == 0
    allowed = limit * one_f_one_b_peak(held, m)  # R × what 1F1B holds at most on one device
    assert max(_peak_activation_bytes(trace, auto, costs)) <= allowed  # whole bytes, as auto and the simulator count
    for name in FIXED:
        try:
            fixed = METHODS[name].build(METHODS[name].params(p, m, 2))
        except ScheduleError:  # zb-h2 needs m >= 2p - 1
            continue
        fixed_trace, fixed_summary = _run(fixed, costs, comm)
        if max(_peak_activation_bytes(fixed_trace, fixed, costs)) <= allowed:  # not a byte over, as auto holds it
            assert summary.time_per_minibatch_ms <= fixed_summary.time_per_minibatch_ms + 1e-6, name  # ps clock


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(scenarios(), st.floats(0, 1.0), st.floats(0.5, 3.0), st.sampled_from([1.0, 3.0]))
@example((3, 7, Costs.per_stage(3, fwd_ms=[2.0, 1.0, 2.0], bwd_ms=[4.0, 2.0, 4.0], wgrad_fraction=0.5,
                                activation_mb=1.0, output_mb=0.0, param_mb=1.0), 0.0), 0.75, 1.0, 1.0)
# the first stage's I and W merged into a B hold the gradient it received until the W part ends
@example((4, 8, Costs.per_stage(4, fwd_ms=[2.8575580113806773, 1.0, 0.5, 0.5],
                                bwd_ms=[5.715116022761355, 1.2, 0.95, 1.1124708385490467],
                                wgrad_fraction=0.4550621713422563, output_mb=0.0, param_mb=1.0,
                                activation_mb=[2.857558250427246, 1.0, 3.8165931701660156, 3.9452600479125977]), 0.3),
         0.5125067366239894, 1.2196139300195021, 1.0)
def test_property_auto_holds_its_sends_within_the_devices_memory(scenario, room_share, output_mb, slow):
    """A device's memory caps its activations and the sends it holds until its neighbour begins the op that takes
    them in: with a slow stage below it, a device ran ahead and held several (gpt at -D 8 --memory-gb 0.138 read out
    of memory on device 5 by 8.8 KB, where 0.135 fit)."""
    p, m, costs, comm = scenario
    stages = list(costs.stages)
    stages[-1] = replace(stages[-1], fwd_ms=stages[-1].fwd_ms * slow, bwd_ms=stages[-1].bwd_ms * slow)
    costs = replace(costs, stages=tuple(replace(c, output_bytes=round(output_mb * MIB)) for c in stages))
    frame = schedule_frame(METHODS["auto"].params(p, m, 2))
    static = static_bytes(frame, costs)
    held = [c.activation_bytes for c in costs.stages]
    memory = [round(s + _buffer_bytes(costs, d) + (1 + room_share * (m - 1)) * h)
              for d, (s, h) in enumerate(zip(static, held))]  # room for activations: from one micro-batch to all
    auto = search_schedule(METHODS["auto"].params(p, m, 2, activation_limit=float(m), search_seconds=0.05), costs,
                           Cluster.uniform(p, comm), memory)
    trace, _ = _run(auto, costs, comm)
    assert all(counter.values.max() <= memory[d] for d, counter in enumerate(trace.counters["memory_bytes"]))


@pytest.mark.parametrize("takes_input", [True, False])
def test_every_list_scheduler_variant_keeps_a_slow_devices_room_in_its_order(takes_input):
    """Device 1, five times as slow, has room for one micro-batch's activations and half an input beside it: the
    list scheduler's device 0 waited for it to make room and then ran its F at once, which its order (run as soon
    as each op can, as the simulator runs it) did not say, so the order broke that room; or it stalled. It waits for
    its own next I instead, so that the order says the wait."""
    times = StageTimes(op_ms=((1, 1, 1, 2), (5, 5, 5, 10)), opt_ms=(0, 0), send_ms=(0.0,), grad_ms=(0.0,),
                       held_bytes=(MIB, 3 * MIB), kept_bytes=(MIB / 2, 1.5 * MIB), limit_bytes=(1e18, 3.5 * MIB),
                       microbatches=4, boundary_bytes=(MIB,), room_bytes=(1e18, 3.5 * MIB),
                       takes_input=(takes_input, takes_input))
    for variant in _GRID:
        pattern = _greedy(times, Knobs.scaled(times, *variant))
        assert pattern is not None and fits(pattern, times), variant
        starts = [[] for _ in pattern]
        finish_ms(pattern, times, _STEADY, starts)
        assert within_room(pattern, times, starts, _roomy(times)), variant


def test_a_device_that_keeps_more_to_its_w_than_its_i_held_is_checked_for_room():
    """What an I keeps until its W may exceed what the F held (sim/costs.py `wgrad_held`): four micro-batches each
    keeping 3 MiB fill 12 MiB, past a room of 11 that four F's alone (4 MiB) would not reach."""
    times = StageTimes(op_ms=((1, 1, 1, 2), (1, 1, 1, 2)), opt_ms=(0, 0), send_ms=(0.0,), grad_ms=(0.0,),
                       held_bytes=(MIB, MIB), kept_bytes=(MIB, 3 * MIB), limit_bytes=(1e18, 1e18), microbatches=4,
                       boundary_bytes=(MIB / 2,), room_bytes=(1e18, 11 * MIB), takes_input=(True, True))
    assert _roomy(times) == [True, False]


@pytest.mark.parametrize("cap_gib", [0.135, 0.138])
def test_tune_fits_auto_within_the_cap_where_a_device_ran_ahead_of_the_next(cap_gib):
    """gpt at -D 8 --memory-gb 0.138 found nothing that fits, where 0.135 fit: auto's order ran device 5 out of
    memory by 8.8 KB with the inputs it had received from the faster device 4 and not yet taken in."""
    code, out, err = pipesim("tune", "--profile", GPT_CPU, "-D", 8, "--memory-gb", cap_gib, "--json")
    assert code == 0, err
    choice = json.loads(out)["choice"]
    assert choice["schedule"] == "auto" and choice["peak_memory_gib"] <= cap_gib
    assert choice["samples_per_s"] == pytest.approx(3.495, abs=1e-3)


def test_the_same_inputs_give_the_same_schedule():
    costs = Costs.per_stage(4, fwd_ms=[1.0, 1.4, 0.8, 1.1], bwd_ms=[2.2, 2.6, 1.5, 2.0], activation_mb=2.0)
    params = METHODS["auto"].params(4, 10, 2, activation_limit=1.5)
    first = search_schedule(params, costs, Cluster.uniform(4, 0.1)).to_text()
    forget_searches()
    assert search_schedule(params, costs, Cluster.uniform(4, 0.1)).to_text() == first


def test_the_search_reports_its_progress_up_to_done():
    costs = Costs.per_stage(4, fwd_ms=1.0, bwd_ms=2.0, activation_mb=2.0)
    shares = []
    search_schedule(METHODS["auto"].params(4, 8, 2, search_seconds=0.01), costs, Cluster.uniform(4, 0.1), (),
                    shares.append)
    assert shares == sorted(shares) and 0 < shares[0] and shares[-1] == 1.0


def test_auto_needs_costs_and_a_limit_that_holds_one_microbatch():
    with pytest.raises(ScheduleError, match="auto searches its order from the stage costs"):
        METHODS["auto"].build(METHODS["auto"].params(4, 8))
    costs = Costs.per_stage(4, fwd_ms=1.0, bwd_ms=2.0, activation_mb=[1.0, 1.0, 4.0, 1.0])  # 1F1B's peak: 8 MiB
    with pytest.raises(ActivationLimitError, match="--activation-limit: R = 0.45 lets a device hold 3.6 MiB .* "
                                                   "device 2's .* R must be at least 0.5$"):
        search_schedule(METHODS["auto"].params(4, 8, activation_limit=0.45), costs, Cluster.uniform(4, 0.0))


def test_device_memory_caps_the_limit():
    """Where a device's memory is known, what fits beside its weights, gradients and optimizer state caps R."""
    costs = Costs.per_stage(4, fwd_ms=1.0, bwd_ms=2.0, activation_mb=10.0, param_mb=10.0, output_mb=0.0)
    memory = [(10 + 10 + 20 + 25) * MIB] * 4  # weights, gradients, Adam's two moments, and 25 MiB
    auto = search_schedule(METHODS["auto"].params(4, 8, 2, activation_limit=4.0), costs, Cluster.uniform(4, 0.0),
                           memory)
    trace, _ = _run(auto, costs, 0.0)
    assert max(_peak_activation_bytes(trace, auto, costs)) <= 25 * MIB  # not R = 4: sixteen micro-batches


def test_simulate_shows_auto_beside_the_fixed_schedules_and_refuses_bad_limits():
    results = simulate_json("-s", "auto", "-s", "1f1b", "-s", "zb-h1", "--fwd", "1,1.5,1,1.2", "--bwd", "2,3,2,2.4",
                            "--comm", "0.1", "--activation-limit", "1")
    step = {r["schedule"]: r["time_per_minibatch_ms"] for r in results}
    assert list(step) == ["auto", "1f1b", "zb-h1"] and step["auto"] <= min(step.values())
    for args, fragment in ((["--activation-limit", "0.1"], "--activation-limit: R = 0.1 lets a device hold"),
                           (["--activation-limit", "x"], "give a finite number above 0 (got 'x')"),
                           (["--search-seconds", "-1"], "--search-seconds: give a finite number above 0"),
                           (["--activation-limit", "inf"], "--activation-limit: give a finite number above 0")):
        code, _, err = pipesim("simulate", "-s", "auto", *args)
        assert code == 2 and fragment in err and err.count("\n") == 1, err
    code, _, err = pipesim("simulate", "-s", "1f1b", "--activation-limit", "2")
    assert code == 2 and "--activation-limit applies to auto only" in err


def _paper_rows(max_stages: int):
    rows = json.loads(PAPER.read_text())["rows"]
    return [pytest.param(row, id=f"{row['model']}-m{row['m']}") for row in rows if row["p"] <= max_stages]


@pytest.mark.parametrize("row", _paper_rows(8))
def test_auto_matches_or_beats_the_zero_bubble_papers_automatic_schedules(row):
    """Qi et al. (ICLR 2024), Table 9's profiled costs: auto at R = 1 and 2 against Table 5's ZB-1p and ZB-2p
    bubble rates, 1 - m(F + B + W) / step, the step in steady state (benchmarks/zero_bubble.py: every row)."""
    p, m = row["p"], row["m"]
    ideal = m * (row["fwd_ms"] + row["igrad_ms"] + row["wgrad_ms"])
    costs = Costs.per_stage(p, fwd_ms=row["fwd_ms"], bwd_ms=row["igrad_ms"] + row["wgrad_ms"],
                            wgrad_fraction=row["wgrad_ms"] / (row["igrad_ms"] + row["wgrad_ms"]), activation_mb=1.0,
                            output_mb=0.0)
    for limit, published in ((1.0, row["bubble"]["zb-1p"]), (2.0, row["bubble"]["zb-2p"])):
        auto = search_schedule(METHODS["auto"].params(p, m, 2, activation_limit=limit), costs,
                               Cluster.uniform(p, row["comm_ms"]))
        bubble = 1 - ideal / _run(auto, costs, row["comm_ms"])[1].time_per_minibatch_ms
        assert round(bubble, 4) <= published, (limit, bubble, published)


def test_r_1_admits_1f1b_where_the_first_stage_saves_little():
    """R counts against 1F1B's fullest device, not its first: on the GPT profile at 16 stages (stage 0, the
    embedding, saves 0.07 MiB a micro-batch, the others 16 MiB) the default R = 1 runs, and auto, which may then
    hold what 1F1B holds, is no slower than 1F1B."""
    results = simulate_json("-s", "auto", "-s", "1f1b", "--profile", GPT_CPU, "-p", "16")
    step = {r["schedule"]: r["time_per_minibatch_ms"] for r in results}
    assert step["auto"] <= step["1f1b"]
    peak = {r["schedule"]: max(d["peak_activations"] for d in r["devices"][1:]) for r in results}
    assert peak["auto"] <= peak["1f1b"]  # stages 1-15 save alike: none holds more micro-batches than 1F1B's fullest


def test_a_first_stage_that_saves_nothing_still_has_a_limit():
    """Stage 0 saving no activations used to make 1F1B's reference 0 (every R refused, 'at least nan')."""
    results = simulate_json("-s", "auto", "-s", "1f1b", "-p", "4", "--fwd", "1", "--bwd", "2",
                            "--activation-mb", "0,64,64,64")
    assert results[0]["time_per_minibatch_ms"] <= results[1]["time_per_minibatch_ms"]
    code, _, err = pipesim("simulate", "-s", "auto", "-p", "4", "--activation-mb", "0,64,64,64",
                           "--activation-limit", "0.1")
    assert code == 2 and "R must be at least 0.334" in err and "nan" not in err, err  # 64 of 3 × 64 MiB


def test_the_least_r_suggested_is_rounded_up_and_works():
    args = ("simulate", "-s", "auto", "-p", "3", "-m", "3", "--activation-mb", "1")  # 1F1B's peak: 3 micro-batches
    code, _, err = pipesim(*args, "--activation-limit", "0.3")
    assert code == 2 and err.rstrip().endswith("R must be at least 0.334"), err  # 1/3, not "0.333"
    assert pipesim(*args, "--activation-limit", "0.333").code == 2
    assert pipesim(*args, "--activation-limit", "0.334").code == 0


def test_the_least_r_suggested_is_the_fullest_short_devices():
    """Stage 2 saves four times what the others do: the R suggested admits it, not only the first device short."""
    args = ("simulate", "-s", "auto", "-p", "4", "-m", "8", "--activation-mb", "1,1,4,1")  # 1F1B's peak: 2 × 4 MiB
    code, _, err = pipesim(*args, "--activation-limit", "0.1")
    assert code == 2 and "device 2's (4.0 MiB)" in err and err.rstrip().endswith("R must be at least 0.5"), err
    assert pipesim(*args, "--activation-limit", "0.5").code == 0


def test_short_device_memory_asks_for_memory_not_a_larger_r():
    costs = Costs.per_stage(4, fwd_ms=1.0, bwd_ms=2.0, activation_mb=64.0, param_mb=80.0, output_mb=0.0)
    memory = [(80 + 80 + 160 + 20) * MIB] * 4  # weights, gradients, Adam's two moments, and 20 MiB
    with pytest.raises(ScheduleError, match="device 0's memory leaves 20.0 MiB for activations .* no "
                                            "--activation-limit helps") as refused:
        search_schedule(METHODS["auto"].params(4, 8, activation_limit=4.0), costs, Cluster.uniform(4, 0.0), memory)
    assert not isinstance(refused.value, ActivationLimitError) and "R must be" not in str(refused.value)


def test_no_numpy_warning_leaks(recwarn):
    """R = 1e308 saturates (1F1B's peak times R is infinite); a stage saving nothing divides nothing by zero."""
    for args, expected in ((["--activation-limit", "1e308"], 0),
                           (["--activation-mb", "0,64,64,64", "--activation-limit", "0.1"], 2)):
        code, _, err = pipesim("simulate", "-s", "auto", "-p", "4", *args)
        assert code == expected and "Warning" not in err, err
    assert not [w for w in recwarn if issubclass(w.category, RuntimeWarning)]


def test_a_trace_records_the_r_and_budget_used_defaults_included(tmp_path):
    assert pipesim("simulate", "-s", "auto", "-p", "4", "--trace", tmp_path / "t.json").code == 0
    params = read_trace(tmp_path / "t.json").meta.params
    assert (params["activation_limit"], params["search_seconds"]) == (1.0, DEFAULT_SECONDS)


def _times(p, m, fwd, bwd, wgrad_fraction, comm):
    costs = Costs.per_stage(p, fwd_ms=fwd, bwd_ms=bwd, wgrad_fraction=wgrad_fraction)
    params = METHODS["auto"].params(p, m, 2)
    return stage_times(params, costs, Cluster.uniform(p, comm), (), static_bytes(schedule_frame(params), costs))


def _step_ms(pattern, times):
    done = finish_ms(pattern, times, 2)
    return None if done is None else done[1] - done[0]


def _every_in_order(m, held, kept, limit):
    """Brute force: every order of one device's F, I and W of m micro-batches, each kind in micro-batch order, I
    after its F and W after its I, whose activations stay within `limit`."""
    for codes in set(itertools.permutations([0] * m + [1] * m + [2] * m)):
        count, level, ops, peak = [0, 0, 0], 0.0, [], 0.0
        for code in codes:
            count[code] += 1
            level += (held, kept - held, -kept)[code]
            peak = max(peak, level)
            ops.append((code, count[code] - 1))
        if peak <= limit + 1e-9 and all((c - 1, j) in ops[:n] for n, (c, j) in enumerate(ops) if c):
            yield tuple(ops)


def _best_in_order_ms(times):
    """The shortest steady step any combination of the devices' in-order orders (`_every_in_order`) takes."""
    steps = (_step_ms(pattern, times) for pattern in itertools.product(*(
        list(_every_in_order(times.microbatches, times.held_bytes[k], times.kept_bytes[k], times.limit_bytes[k]))
        for k in range(times.stages))))
    return min(step for step in steps if step is not None)


@pytest.mark.parametrize("m, limit", [(1, 1.0), (2, 1.0), (2, 2.0), (3, 2.0), (3, 3.0)])
def test_a_devices_in_order_patterns_are_every_one_within_its_limit_f_then_i_then_w_first(m, limit):
    """`_in_order` lists every in-order order (the brute force's), in the order a depth-first search trying F,
    then I, then W finds them: their codes' lexicographic order; None where there are more than `most`."""
    every = sorted(_every_in_order(m, 1.0, 0.5, limit))
    assert _in_order(m, 1.0, 0.5, limit, len(every)) == every
    assert _in_order(m, 1.0, 0.5, limit, len(every) - 1) is None


def test_auto_finds_the_issues_in_order_pattern():
    """Issue 39: the knobs' list scheduler stopped at 41 ms, even with 5 s to search; an in-order order of 39 ms fits
    R = 1 (device 1's compute alone: nothing is faster)."""
    args = ("-p", "4", "-m", "3", "--fwd", "5,5,1,1", "--bwd", "2,8,8,7", "--wgrad-fraction", "0.75", "--comm", "0.5")
    assert simulate_json("-s", "auto", *args)[0]["time_per_minibatch_ms"] <= 39.0


def test_auto_lists_a_long_devices_in_order_patterns_past_pythons_recursion_limit():
    """An in-order pattern is 3m ops deep: listing them recursively raised RecursionError from m = 333
    (`simulate -s auto -p 2 -m 340`, and `tune` wherever it tried auto at such an m)."""
    rows = simulate_json("-s", "auto", "-p", "2", "-m", "340", "-n", "2")
    assert rows[0]["time_per_minibatch_ms"] > 0


@pytest.mark.parametrize("seed", range(12))
def test_auto_is_no_slower_than_any_in_order_pattern_on_small_pipelines(seed):
    rng = random.Random(seed)
    p = rng.choice([2, 3, 4])
    m = rng.choice([2, 3]) if p == 2 else 2
    times = _times(p, m, [rng.choice([1, 2, 3, 4, 5]) for _ in range(p)], [rng.choice([2, 4, 6, 8]) for _ in range(p)],
                   rng.choice([0.25, 0.5, 0.75]), rng.choice([0.0, 0.5, 1.0]))
    forget_searches()
    assert _step_ms(best_pattern(times), times) <= _best_in_order_ms(times) + 1e-9


@pytest.mark.parametrize(("fwd", "bwd", "wgrad_fraction", "comm", "best_ms"), [
    ([5, 5, 1, 1], [2, 8, 8, 7], 0.75, 0.5, 39.0),
    ([2, 5, 3, 2], [4, 8, 6, 8], 0.75, 1.0, 42.0)])
def test_auto_matches_the_in_order_optimum_at_four_stages(fwd, bwd, wgrad_fraction, comm, best_ms):
    """p = 4, m = 3, where the knobs alone fell short (41 and 44.5 ms); `best_ms` is the shortest step over all 42^4
    in-order patterns (`_best_in_order_ms`, tens of seconds: too slow to run here)."""
    times = _times(4, 3, fwd, bwd, wgrad_fraction, comm)
    forget_searches()
    assert _step_ms(best_pattern(times), times) <= best_ms + 1e-9


def test_the_caption_says_when_a_fixed_order_beside_auto_steps_faster_by_holding_more_than_its_limit():
    """Llama 3.1 8B at p = 8 on H100s: the last stages save a quarter more a micro-batch, so ZB-H1 holds 1.1 times
    1F1B's peak activations there, over R = 1, and steps 0.7 % ahead of auto; the caption says so and names the R
    that lets auto hold as much, at which auto steps with it and the caption is quiet. ZB-H2, faster still but out
    of memory, is no order to hold as much as."""
    shape = ("simulate", "--model", "hf:examples/llama3.1-8b", "--seq-len", 8192, "--gpu", "h100-sxm", "-p", 8,
             "-m", 16, "-s", "auto", "-s", "zb-h1", "-s", "1f1b")
    code, out, err = pipesim(*shape)
    assert code == 0, err
    said = " ".join(out.split())
    assert ("zb-h1, holding 1.1 times 1F1B's peak activations where auto's --activation-limit R = 1 holds less, "
            "steps 0.7% faster (1.1 lets auto hold as much)") in said
    assert "1f1b," not in said  # slower than auto: nothing to say
    code, out, err = pipesim(*shape[:-4], "-s", "zb-h2")
    assert code == 0, err
    assert "zb-h2 OOM" in out and "holding" not in out  # faster, but out of memory: no order to hold as much as
    code, out, err = pipesim(*shape, "--activation-limit", "1.1")
    assert code == 0, err
    assert "faster than auto" not in " ".join(out.split())
    rows = {line.split()[0]: line.split()[1] for line in out.splitlines() if line.split()[:1] in (["auto"], ["zb-h1"])}
    assert rows["auto"] == rows["zb-h1"]


def test_timing_every_in_order_pattern_reports_its_progress_as_it_goes(monkeypatch):
    """The walk over every in-order pattern (p <= 4, where the budget affords it) reported once, at its end: at p = 4,
    m = 3 (docs/auto.md) the bar sat at 0 % for 10 s, then jumped to 100 %. It reports after each order of its first
    devices, rising."""
    from pipesim.planning import auto

    shares, walked = [], []
    walk = auto._Search.time_every_in_order

    def counted(search):
        before = len(shares)
        done = walk(search)
        walked.append((done, shares[before:]))
        return done

    monkeypatch.setattr(auto._Search, "time_every_in_order", counted)
    costs = Costs.per_stage(4, fwd_ms=[5, 5, 1, 1], bwd_ms=[2, 8, 8, 7], wgrad_fraction=0.75)
    search_schedule(METHODS["auto"].params(4, 2, 2, search_seconds=5), costs, Cluster.uniform(4, 0.5), (),
                    shares.append)
    [(done, during)] = walked
    assert done and len(during) > 4 and during == sorted(during) and during[0] < during[-1] < 1.0
