"""`pipesim tune`: the pruned search must give what an exhaustive one gives, its bounds must hold, and the
command line must explain its answer and refuse bad input in one line."""

import functools
import itertools
import json
import math
import shlex
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from pipesim.commands import tune as tune_command
from pipesim.hardware.collectives import all_reduce_ms
from pipesim.planning import tune as tuning
from pipesim.planning.scenario import profile_scenario
from pipesim.profiles.partition import least_slowest
from pipesim.profiles.schema import load_profile
from pipesim.schedules import METHODS, flushes
from pipesim.sim import simulate
from pipesim.traces import summarize
from tests.conftest import Cli, at_columns, needs_transformers, pipesim, pipesim_fresh, simulate_json, tune_rows
from tests.helpers import CNN_CPU as CNN
from tests.helpers import GPT_CPU as GPT
from tests.helpers import PROFILES, accumulating, bounds_over_random_costs, differences, exhaustive, gpt_on_8, jittered
from tests.helpers import adam_settings as scenario
from tests.helpers import tune_problem as problem

GIB = tuning.GIB
GPT_UNDER_03 = ("--profile", GPT, "-D", 8, "--memory-gb", 0.3)  # the tune several tests read (`tuned`)


@functools.cache
def tuned(*args) -> Cli:
    """`pipesim tune ARGS` at the default width, run once for the tests that read the same command's output."""
    return pipesim("tune", *args)


def slow_allreduce(profile, factor=1000.0):
    """The same model on a network whose all-reduce is `factor` times slower: data parallelism gets dear."""
    points = [point.model_copy(update={"ms": point.ms * factor}) for point in profile.allreduce.points]
    return profile.model_copy(update={"allreduce": profile.allreduce.model_copy(update={"points": points})})


CASES = [
    pytest.param(GPT, 4, 0.2, {}, id="gpt-D4-0.2GiB"),
    pytest.param(GPT, 8, 0.25, {"max_staleness": 1}, id="gpt-D8-0.25GiB-staleness-1"),
    pytest.param("gpt-slow-allreduce", 8, 0.5, {}, id="gpt-slow-allreduce-D8-0.5GiB"),
    pytest.param(CNN, 8, 0.015, {}, id="cnn-D8-0.015GiB"),
    pytest.param(CNN, 4, 0.05, {"schedules": ("1f1b", "zb-h1", "pipedream-2bw", "avgpipe"), "max_pipelines": 3},
                 id="cnn-D4-four-schedules"),
]


def _profile(which):
    if which == "gpt-accumulating":
        return accumulating(load_profile(GPT))
    return slow_allreduce(load_profile(GPT)) if which == "gpt-slow-allreduce" else load_profile(which)


@pytest.mark.parametrize("which,devices,cap_gib,kw", CASES)
def test_search_equals_exhaustive_search(which, devices, cap_gib, kw):
    profile = _profile(which)
    source, prob = scenario(profile), problem(profile, devices, cap_gib, **kw)
    found = tuning.tune(source, prob)
    best, faster, staler, results = exhaustive(source, prob)
    assert differences(found, best, faster, staler) == []
    assert found.stats.simulated < len(results)  # it pruned: the bounds did work
    choice = found.choice.result
    margin = tuning.speed_key(choice.samples_per_s * (1 + tuning.OVER_MARGIN))
    within = [r for r in results if not tuning.allowed(r, prob) and r.candidate.memory_floor_bytes
              <= prob.memory_cap_bytes and tuning.speed_key(choice.samples_per_s) < tuning.speed_key(r.samples_per_s)
              <= margin]  # over a limit, beating the choice by at most the margin: counted, by bounds no lower
    counted = found.over_within_margin
    assert counted >= len(within) if len(found.excluded) < tuning.RUNNERS_UP else counted == 0
    assert any(note.startswith(f"{counted} more configuration") for note in found.notes) == (counted > 0)
    assert choice.peak_memory_bytes <= prob.memory_cap_bytes and choice.staleness <= prob.max_staleness
    fastest = max(tuning.speed_key(r.samples_per_s) for r in results if tuning.allowed(r, prob))
    assert tuning.speed_key(choice.samples_per_s) == fastest


def test_simulations_and_searches_run_in_worker_processes_and_give_the_same_answer(monkeypatch):
    """Two workers simulate several candidates, and search auto's orders, at once; results are taken in the
    order popped, so the answer is the exhaustive search's. The simulator and auto's search are broken here, in
    the parent: only the workers can have run them."""
    from pipesim.planning import auto

    profile = load_profile(CNN)
    source, prob = scenario(profile), problem(profile, 8, 0.1, max_staleness=1)
    best, faster, staler, _ = exhaustive(source, prob)

    def broken(*args, **kw):
        raise AssertionError("run in the parent")

    pool = tuning.start_workers(2)  # before they are broken: a forked worker would copy them broken
    monkeypatch.setattr(tuning, "simulate", broken)
    monkeypatch.setattr(auto, "search_schedule", broken)
    found = tuning.tune(source, prob, workers=2, pool=pool)
    assert differences(found, best, faster, staler) == []
    rows = [found.choice, *found.runners_up, *found.excluded]
    assert any(row.result.candidate.activation_limit is not None for row in rows)  # auto's were searched


def test_the_comparison_catches_a_bound_that_lies(monkeypatch):
    """Claim the true best can do no better than 1 sample/s: the search prunes it and the check must say so."""
    source, prob = gpt_on_8(1.0)  # many configurations fit: pruning starts early
    best, faster, staler, _ = exhaustive(source, prob)
    winner = best[0][0].config
    honest = tuning._candidate

    def lying(*args, **kw):
        candidate = honest(*args, **kw)
        return replace(candidate, max_samples_per_s=1.0) if candidate.config == winner else candidate

    monkeypatch.setattr(tuning, "_candidate", lying)
    wrong = differences(tuning.tune(source, prob), best, faster, staler)
    assert wrong and wrong[0].startswith("choice and runners-up")


@pytest.mark.parametrize("which,devices,cap_gib", [(GPT, 4, 0.2), (CNN, 8, 0.015), ("gpt-slow-allreduce", 4, 1.0),
                                                  ("gpt-accumulating", 4, 1.0)])
def test_bounds_hold_for_every_candidate(which, devices, cap_gib):
    """Every bound at or above the simulation; the critical path (`_with_critical_path`) is the simulated step
    itself on most flushing candidates (nothing shared on the committed profiles' links), and lowers the bound
    of some below their compute and fill-and-drain bound, of schedules that never flush too."""
    profile = _profile(which)
    source, prob = scenario(profile), problem(profile, devices, cap_gib)
    candidates, _, _ = tuning.prepare(source, prob)
    met = lowered = unflushed = 0
    for candidate in candidates:
        result = tuning.evaluate(prob, candidate)
        links = candidate.setting.scenario.links
        summary = summarize(simulate(candidate.schedule, candidate.costs, links(candidate.schedule)))
        label = candidate.config.label()
        critical = tuning._with_critical_path(prob, candidate)
        assert result.samples_per_s <= critical.max_samples_per_s <= candidate.max_samples_per_s, label
        lower = critical.max_samples_per_s < candidate.max_samples_per_s
        met += lower and critical.max_samples_per_s == pytest.approx(result.samples_per_s, rel=1e-6)
        lowered += lower
        unflushed += lower and not flushes(candidate.schedule)
        assert candidate.memory_floor_bytes <= result.peak_memory_bytes, label
        assert candidate.links == candidate.setting.scenario.links(candidate.schedule), label  # looked up by p, d
        assert result.samples_per_s <= candidate.max_samples_per_s, label
        assert candidate.staleness == summary.max_staleness, label  # read off the order = simulated
        assert result.step_ms >= candidate.busiest_ms and 0 <= result.bubble_fraction < 1, label
        if candidate.short_minibatches == 2:  # a flushing schedule: every step from the second repeats exactly
            longer = tuning.build(candidate.setting.scenario, prob, candidate.config.schedule,
                                  replace(candidate.params, minibatches=6), candidate.bounds)
            growth = (summarize(simulate(longer, candidate.costs, links(longer))).makespan_ms
                      - summary.makespan_ms) / 3
            assert growth == pytest.approx(result.step_ms, rel=1e-9), label
    assert met > 0 and lowered >= met and (unflushed > 0 or which == GPT)


def test_the_bubble_and_the_busiest_compute_count_the_gradient_accumulations_as_simulate_does():
    """The simulator prices each accumulation into the gradient buffer in its B or W row: a result's bubble and the
    busiest device's compute that a reason names count it too (they read 11% against simulate's 9.0% on a 40-layer
    GPT on A100s, "busiest device computing 6,658 ms" where simulate's busiest device computed 6,835)."""
    profile = accumulating(load_profile(GPT))
    source, prob = scenario(profile), problem(profile, 4, 1.0)
    candidates, _, _ = tuning.prepare(source, prob)
    checked = 0
    for candidate in (c for c in candidates if flushes(c.schedule)):  # every step alike: the run's mean is a step's
        result = tuning.evaluate(prob, candidate)
        summary = summarize(simulate(candidate.schedule, candidate.costs, candidate.links))
        busy_ms = [device.busy_ms / candidate.schedule.minibatches for device in summary.devices]
        label = candidate.config.label()
        assert candidate.busiest_ms == pytest.approx(max(busy_ms), rel=1e-9), label
        assert result.bubble_fraction == pytest.approx(1 - np.mean(busy_ms) / result.step_ms, rel=1e-9), label
        checked += 1
    assert checked > 0


def test_the_bubble_counts_the_compute_that_transfers_hold_as_simulate_does():
    """On an H100 NCCL's sends hold the products beside them (`Costs.transfers_hold_products`): the simulator
    lengthens those compute rows, and the bubble tune reports is simulate's, from the rows as simulated (it read
    25.1% against simulate's 24.6%: the nominal compute alone)."""
    model = ("--gpu", "h100-sxm", "--model", "gpt", "--layers", 4, "--width", 1024, "--heads", 8, "--seq-len", 1024,
             "--vocab", 32000, "-b", 1, "--tensor-parallel", 1, "--recompute", "none")
    code, out, err = pipesim("tune", *model, "-D", 4, "--data-parallel", 1, "-B", 16, "-s", "1f1b", "--json")
    assert code == 0, err
    choice = json.loads(out)["choice"]
    code, out, err = pipesim("simulate", *model, "-p", choice["stages"], "-m", choice["microbatches"], "-s", "1f1b",
                             "--json")
    assert code == 0, err
    simulated = json.loads(out)["results"][0]
    assert simulated["stage_bounds"] == choice["partition"]
    assert simulated["time_per_minibatch_ms"] == pytest.approx(choice["step_ms"], rel=1e-9)
    assert choice["bubble_fraction"] == pytest.approx(simulated["bubble_fraction"], abs=1e-3)


def test_tunes_bubble_is_its_simulate_lines_where_the_first_mini_batch_costs_more():
    """Both leave the first mini-batch out (`steady_compute_ms`): the H200 calibration's warm-up makes it the longest,
    and tune's read 50.35 % where its own simulate line read 50.50 %, tune counting it in."""
    h200 = Path(__file__).resolve().parents[1] / "traces" / "measured" / "gpu-check-h200-day42" / "profile.json"
    code, out, err = pipesim("tune", "--profile", h200, "-D", 2, "-s", "1f1b", "-s", "zb-h1", "--json")
    assert code == 0, err
    tuned = json.loads(out)
    _, _, *args = shlex.split(tuned["simulate_command"])
    [simulated] = simulate_json(*args)
    assert simulated["time_per_minibatch_ms"] == pytest.approx(tuned["choice"]["step_ms"], rel=1e-9)
    assert tuned["choice"]["bubble_fraction"] == pytest.approx(simulated["bubble_fraction"], rel=1e-9)


def test_a_fixed_order_is_built_once_for_every_number_of_replicas():
    """A stage's REDUCE sits where it does for any d > 1, so the search builds each fixed order once for all d:
    what it gives for d = 3 or 4 shares the d = 2 order's rows, and is the order built for that d."""
    from pipesim.schedules import ScheduleParams

    source = scenario(load_profile(GPT))[0].scenario
    orders = tuning._Orders()
    columns = ("device", "kind", "stage", "microbatch", "minibatch", "pipeline", "peer")
    checked = 0
    for name, method in METHODS.items():
        if method.needs_costs or method.on_graph is not None:
            continue
        for chunks in (1, 2):
            try:
                first = orders(source, name, ScheduleParams(4, 8, 3, chunks, data_parallel=2))
            except tuning.ScheduleError:
                continue
            for replicas in (3, 4):
                params = ScheduleParams(4, 8, 3, chunks, data_parallel=replicas)
                shared, direct = orders(source, name, params).schedule, method.build(params)
                assert shared.table is first.schedule.table, name
                assert shared.params == direct.params and shared.data_parallel == replicas, name
                assert all(np.array_equal(getattr(shared.table, c), getattr(direct.table, c)) for c in columns), name
                checked += 1
    assert checked >= 2 * (len(METHODS) - 2)


def test_data_parallel_is_reduce_rows_priced_on_the_measured_all_reduce():
    profile = load_profile(GPT)
    source, prob = scenario(profile), problem(profile, 4, 8.0, schedules=("1f1b",))
    candidates, _, _ = tuning.prepare(source, prob)
    for candidate in candidates:
        link = source[0].scenario.data_parallel_link(candidate.schedule)
        replicas = candidate.config.replicas
        assert candidate.schedule.data_parallel == replicas
        for stage in candidate.costs.stages:
            expected = all_reduce_ms(stage.param_bytes, replicas, link.latency_ms, link.bytes_per_ms)
            assert stage.reduce_ms == pytest.approx(expected if replicas > 1 else 0.0)
    assert {c.config.replicas for c in candidates} == {1, 2, 4}  # p = 4, 2, 1


def test_a_slow_network_moves_the_answer_from_data_to_pipeline_parallelism():
    fast, slow = load_profile(GPT), slow_allreduce(load_profile(GPT))
    on_fast = tuning.tune(scenario(fast), problem(fast, 8, 1.0)).choice.result.config
    on_slow = tuning.tune(scenario(slow), problem(slow, 8, 1.0)).choice.result.config
    assert on_fast.stages == 1 and on_fast.replicas == 8
    assert on_slow.stages > 1 and on_slow.replicas < 8


def test_staleness_limit():
    profile = load_profile(GPT)
    synchronous = tuning.tune(scenario(profile), problem(profile, 8, 0.25, max_staleness=0))
    stale = tuning.tune(scenario(profile), problem(profile, 8, 0.25, max_staleness=1))
    assert synchronous.choice.result.staleness == 0 and stale.choice.result.staleness == 1
    assert synchronous.choice.result.samples_per_s < stale.choice.result.samples_per_s
    assert any(row.why.startswith("staleness 1 > 0") for row in synchronous.excluded)


def test_the_fastest_config_over_the_memory_cap_alone_keeps_a_row_over_the_limits(monkeypatch):
    """At 0.3 GiB the rows over the limits rank three stale p = 2 orders above DualPipeV p = 2, 8.2 % faster than
    the choice at 0.352 GiB: with two rows shown, the stale ones filled both and hid what more memory buys."""
    settings, problem = gpt_on_8(0.3)
    shown = [row.result.config.schedule for row in tuning.tune(settings, problem).excluded]
    assert shown[3] == "dualpipev" and all(tuning._heavier(row.result, problem) == (row.result.staleness == 0)
                                           for row in tuning.tune(settings, problem).excluded)
    monkeypatch.setattr(tuning, "RUNNERS_UP", 2)
    rows = tuning.tune(settings, problem).excluded
    assert [row.result.config.schedule for row in rows] == ["pipedream", "dualpipev"]
    assert rows[1].why.startswith("over memory: 0.352 GiB > 0.3 GiB")
    monkeypatch.setattr(tuning, "RUNNERS_UP", 3)  # DualPipeV's is the fourth: the first two stale rows stay
    assert [row.result.config.schedule for row in tuning.tune(settings, problem).excluded] == [
        "pipedream", "pipeoptim", "dualpipev"]


def test_cli_table_explains_each_runner_up():
    code, out, err = tuned(*GPT_UNDER_03)
    assert code == 0, err
    assert "over memory: 0.352 GiB > 0.3 GiB" in out  # DualPipeV at p = 2 would be faster, but peaks over the cap
    assert "% slower: " in out and "partition (layers per model stage): " in out
    assert "pruned by the throughput bound" in out


def test_cli_is_synchronous_by_default_and_names_the_staler_method_it_rules_out():
    """PipeDream at p = 2 would be 9.7 % faster in the same 0.3 GiB, at staleness 1: the default keeps 1F1B's
    training and says what that costs; --max-staleness 1 chooses PipeDream as tune did before."""
    code, out, err = tuned(*GPT_UNDER_03, "--json")
    assert code == 0, err
    doc = json.loads(out)
    assert doc["problem"]["max_staleness"] == 0
    assert doc["choice"]["staleness"] == 0 and doc["choice"]["schedule"] == "1f1b"
    staler = doc["staler_winner"]
    assert staler["schedule"] == "pipedream" and staler["stages"] == 2 and staler["staleness"] == 1
    assert staler["peak_memory_gib"] <= 0.3 and staler["samples_per_s"] > doc["choice"]["samples_per_s"]
    gain = staler["samples_per_s"] / doc["choice"]["samples_per_s"] - 1
    note = f"at staleness 1, pipedream p=2 (same as pipedream-2bw p=2) fits and gives 10.6 samples/s, {100 * gain:.2g}%"
    assert [n for n in doc["notes"] if n.startswith(note) and n.endswith("--max-staleness 1 allows it")], doc["notes"]
    code, out, err = pipesim("tune", *GPT_UNDER_03, "--max-staleness", "1", "--json")
    assert code == 0, err
    doc = json.loads(out)
    assert doc["choice"]["schedule"] == "pipedream" and doc["choice"]["staleness"] == 1
    assert doc["staler_winner"] is None and not [n for n in doc["notes"] if "--max-staleness" in n]
    code, out, err = tuned(*GPT_UNDER_03)
    assert code == 0, err
    assert "staleness <= 0" in out and "note: at staleness 1, pipedream p=2" in " ".join(out.split())


def test_auto_is_searched_at_the_memory_each_device_allows_and_reports_the_r_it_holds():
    """The CNN on 4 devices, synchronous schedules: auto is searched for each device's whole memory, beats every
    fixed order, fits, and holds more activations (a larger R) the more memory there is."""
    chosen = {}
    for cap in (0.02, 0.05):
        code, out, err = pipesim("tune", "--profile", CNN, "-D", 4, "--memory-gb", cap, "-s", "auto,1f1b,zb-h1,zb-h2",
                                 "--max-staleness", 0, "--json")
        assert code == 0, err
        doc = json.loads(out)
        choice = chosen[cap] = doc["choice"]
        assert choice["schedule"] == "auto" and choice["peak_memory_gib"] <= cap and choice["activation_limit"] > 1
        fixed = [row for row in doc["runners_up"] if row["schedule"] != "auto"]
        assert fixed and all(row["samples_per_s"] < choice["samples_per_s"] and row["activation_limit"] is None
                             for row in fixed)
    assert chosen[0.02]["activation_limit"] < chosen[0.05]["activation_limit"]


def test_a_given_d_fixes_the_depth_of_a_profiles_search():
    """--data-parallel beside --profile: every row runs the d given over p = D/d (it was silently ignored, every
    p searched)."""
    code, out, err = pipesim("tune", "--profile", str(CNN), "-D", "4", "--data-parallel", "2", "--json")
    assert code == 0, err
    doc = json.loads(out)
    assert {(row["stages"], row["replicas"]) for row in tune_rows(doc)} == {(2, 2)}


def test_cli_json_is_the_search_result():
    code, out, err = pipesim("tune", "--profile", str(CNN), "-D", "4", "--memory-gb", "0.05", "--json")
    assert code == 0, err
    doc = json.loads(out)
    profile = load_profile(CNN)
    expected = tuning.tune(scenario(profile), problem(profile, 4, 0.05))
    assert doc["choice"]["schedule"] == expected.choice.result.config.schedule
    assert doc["choice"]["samples_per_s"] == pytest.approx(expected.choice.result.samples_per_s)
    assert doc["problem"] == {"devices": 4, "memory_cap_gib": 0.05, "batch_size": 4 * 4 * 8,  # as given, not 0.04999...
                              "schedules": list(METHODS), "max_staleness": 0, "max_chunks": 4, "max_pipelines": 4,
                              "search_seconds": None, "zero": 0, "precision": None}
    assert len(doc["runners_up"]) == tuning.RUNNERS_UP and all(row["why"] for row in doc["runners_up"])
    assert doc["choice"]["partition"][0] == 0 and doc["choice"]["partition"][-1] == len(profile.layers)
    search = doc["search"]  # every configuration is accounted for exactly once
    assert search["stale"] + search["over_memory_floor"] + search["pruned"] + search["simulated"] == \
        search["configurations"]
    assert 0 <= search["simulated_over_limits"] <= search["stale"] + search["over_memory_floor"]


@pytest.mark.parametrize("args,fragment", [
    (["--devices", "4"], "--profile or --gpu: give the model's profile"),
    (["--profile", str(GPT), "--devices", "0"], "--devices"),
    (["--profile", str(GPT), "--devices", "4", "--memory-gb", "0.01"],
     "--memory-gb: no configuration fits in 0.01 GiB; the least memory a fixed order needs is 0.178 GiB per device "
     "(1f1b p=4"),
    # auto fills what the cap leaves, at each cap another order: no least memory of its own, and alone it said "no
    # configuration has staleness <= 0", of a synchronous method
    (["--profile", str(GPT), "--devices", "8", "--memory-gb", "0.12"],
     "the least memory a fixed order needs is 0.146 GiB per device (1f1b p=8, m=32); auto, searched within the cap, "
     "found no order that fits it as simulated"),
    (["--profile", str(GPT), "--devices", "8", "--memory-gb", "0.12", "-s", "auto"],
     "--memory-gb: no configuration fits in 0.12 GiB: auto, searched within the cap, found no order that fits it as "
     "simulated, and no other method was given: give more memory, or add methods (-s 1f1b, ...)"),
    (["--profile", str(GPT), "--devices", "8", "--memory-gb", "0.12", "-s", "auto", "-s", "dualpipe"],
     "auto, searched within the cap, found no order that fits it as simulated, and dualpipe refuses every shape"),
    # within the staleness limit none fits, at staleness 1 one does: it said only that pipedream's p = 1 needs more
    (["--profile", str(GPT), "--devices", "8", "--memory-gb", "0.3", "-s", "pipedream"],
     "no configuration fits in 0.3 GiB; the least memory any needs is 0.41 GiB per device (pipedream p=1, m=4) at "
     "staleness 0; pipedream p=8 fits in 0.151 GiB at staleness 1: --max-staleness 1 allows it"),
    (["--profile", str(GPT), "--devices", "4", "-s", "nope"], "--schedule: unknown 'nope'; choose from gpipe"),
    (["--profile", str(GPT), "--devices", "4", "--batch-size", "12"], "--batch-size: give a multiple of the profile's"),
    (["--profile", str(GPT), "--devices", "4", "--memory-gb", "-1"],
     "--memory-gb: give GiB per device, from 1 byte to 1,048,576 GiB (got -1)"),
    (["--profile", str(GPT), "--devices", "4", "--memory-gb", "1e-300"],  # held as 0 bytes: "fits in 0 GiB"
     "--memory-gb: give GiB per device, from 1 byte to 1,048,576 GiB (got 1e-300)"),
    (["--profile", str(GPT), "--devices", "4", "--memory-gb", "1e300"], "to 1,048,576 GiB (got 1e300)"),
    (["--profile", "missing.json", "--devices", "4"], "cannot read profile missing.json"),
    # a cap past the device's memory: the choice fitted it and ran out of memory in simulate without it
    (["--profile", str(GPT), "--devices", "4", "--memory-gb", "24"],
     "--memory-gb 24: more than the profiled device's 23.5 GiB, so a layout that fits the cap would run out of memory "
     "there: give at most 23.54"),
    (["--gpu", "h100-sxm", "--model", "gpt", "--layers", "4", "--devices", "4", "--memory-gb", "200"],
     "--memory-gb 200: more than h100-sxm's 79.1 GiB (`pipesim gpus`)"),
    (["--profile", str(GPT), "--devices", "4", "-s", "dualpipe"],
     "dualpipe refuses every shape with a batch of 128 samples on 4 devices (dualpipe: the search cuts the model "
     "into one chain of stages, and this method runs 2 copies of it; not searched yet)"),
    (["--profile", str(GPT), "--devices", "4", "--data-parallel", "3"],
     "--devices: give p x d, a multiple of 3 at --data-parallel 3 (got 4)"),
    (["--profile", str(GPT), "--devices", "64", "--data-parallel", "1"],
     "--data-parallel: give at least 4, so that p = 64/d devices a pipeline is at most the profile's 16 layers "
     "(got 1)"),
    (["--profile", str(GPT), "--devices", "4", "--max-pipelines", "17"],  # every P was tried: 10**12 ran for hours
     "--max-pipelines: give a whole number from 1 to 16 (got 17): each pipeline takes at least one of the step's 16 "
     "micro-batches (128 samples, --batch-size, of 8 each)"),
])
def test_bad_input_is_one_line_exit_2(args, fragment):
    """One line of error; on a slow host a search may first say, after a second, what it is doing."""
    code, out, err = pipesim("tune", *args)
    lines = err.strip().splitlines()
    assert code == 2 and fragment in lines[-1], err
    assert all(line.startswith("tune: ") and line.endswith(" ...") for line in lines[:-1]), err
    assert "Traceback" not in err


def test_the_default_max_pipelines_is_not_refused_under_a_small_batch():
    """--max-pipelines is refused past the step's micro-batches only where given: its default, 4, under a
    --batch-size of 2 micro-batches was refused (0ead5c6), where the search ran and chose."""
    code, out, err = pipesim("tune", "--profile", str(GPT), "--devices", "2", "--batch-size", "16", "--json")
    assert code == 0, err
    doc = json.loads(out)
    assert doc["problem"]["max_pipelines"] == 4 and doc["choice"]["pipelines"] * doc["choice"]["microbatches"] <= 2


@pytest.mark.parametrize("path", sorted(PROFILES.glob("*.json")), ids=lambda p: p.name)
def test_committed_profiles_are_small_and_name_their_device(path):
    profile = load_profile(path)
    assert path.stat().st_size < 200_000
    assert profile.environment.device_name and profile.link is not None and profile.allreduce.points


def test_tune_never_imports_torch():
    (done,), imported = pipesim_fresh(("tune", "--profile", CNN, "--devices", 2, "--json"))
    assert done.code == 0 and "torch" not in imported, done.err


@pytest.mark.parametrize("which,devices,cap_gib,seed", [(GPT, 8, 1.0, 1), (GPT, 4, 0.2, 2), (CNN, 8, 0.05, 3),
                                                       (CNN, 4, 0.02, 4)])
def test_bounds_hold_over_random_costs(which, devices, cap_gib, seed):
    """Shape bound >= candidate bound >= simulated samples/s for every configuration of random costs: what makes
    the pruned search exact. On the GPT the flushing chains' bound binds (it is what prunes them; the CNN's
    compute dominates its bubbles)."""
    counts = bounds_over_random_costs(which, devices, cap_gib, seed)
    assert counts["checked"] > 0
    assert all(counts[k] for k in ("bubbles", "shape_bubbles", "cut", "planned")) or which == CNN


@pytest.mark.parametrize("seed", [5, 6])
def test_search_equals_exhaustive_search_over_random_costs(seed):
    profile = jittered(load_profile(GPT), seed)
    source, prob = scenario(profile), problem(profile, 8, 0.3, search_seconds=0.02)
    best, faster, staler, results = exhaustive(source, prob)
    found = tuning.tune(source, prob)
    assert differences(found, best, faster, staler) == []
    built = found.stats.simulated + found.stats.simulated_over_limits
    assert built < len(results)


def test_a_step_over_a_second_says_what_it_does_on_stderr_when_piped(monkeypatch):
    """Piped, a long search must not look hung: one line once a step passes NOTE_AFTER_S (a second; 0.2 s here, the
    same rule, a second sooner), then how far it is at most every PIPED_EVERY_S (a 70B's search over 64 GPUs said
    nothing more for 50 s: a new user's pass); a quick one says nothing."""
    import contextlib
    import io
    import time

    from pipesim.commands import tune
    from pipesim.commands.tune import _working

    monkeypatch.setattr(tune, "NOTE_AFTER_S", 0.2)
    monkeypatch.setattr("pipesim.commands.tables.PIPED_EVERY_S", 0.3)
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        with _working("estimating") as report:
            report("estimating: 1 done")  # within PIPED_EVERY_S of the start: not said
            time.sleep(0.5)
            report("estimating: 2 done")
        with _working("searching") as report:
            report("searching: 3 built")
    assert err.getvalue() == "tune: estimating ...\ntune: estimating: 2 done\n"


@pytest.mark.parametrize(("flags", "refusal"), [
    (("--expert-parallel", 2), "--expert-parallel 2, but the model has no routed experts to place"),
    (("--experts", 4, "--expert-parallel", 8), "--expert-parallel 8 does not divide the model's 4 routed experts"),
    (("--expert-gemm", "per-expert"), "--expert-gemm per-expert runs a mixture of experts' routed products")])
def test_a_refusal_that_needs_the_counted_model_comes_before_the_progress_note(monkeypatch, flags, refusal):
    """Bad input is one line: a rule that needs the model counted refuses before tune's note starts (it would print
    'tune: estimating ...' first when counting passes a second, as it does on a host that has not kept the count)."""
    from pipesim.commands import tune

    def working(what):
        raise AssertionError(f"the note {what!r} started before the refusal")

    monkeypatch.setattr(tune, "_working", working)
    code, _, err = pipesim("tune", "--gpu", "h100-sxm", "--model", "gpt", "--layers", 2, "--width", 64, "--heads", 4,
                           "--seq-len", 32, "--vocab", 100, "-D", 8, *flags)
    assert code == 2 and refusal in err and len(err.strip().splitlines()) == 1, err


@settings(max_examples=200, deadline=None)
@given(st.lists(st.one_of(st.just(0.0), st.just(1.0), st.floats(0, 1e3)), min_size=1, max_size=8))
@example([0.1] * 7)  # equal layers: sums in another order differ in their last bit
def test_least_slowest_is_the_best_split_by_brute_force(weights):
    """The best split's busiest part, for every part count, against every split: never above it (a bound the
    search prunes by must not overshoot), and below it by rounding only."""
    least = least_slowest(weights)
    n = len(weights)
    assert least[0] == np.inf
    for parts in range(1, n + 1):
        best = min(max(math.fsum(weights[a:b]) for a, b in itertools.pairwise([0, *cuts, n]))
                   for cuts in itertools.combinations(range(1, n), parts - 1))
        assert best * (1 - 1e-9) - 1e-12 <= least[parts] <= best * (1 + 1e-12) + 1e-300, (parts, best)


def test_all_to_alls_are_not_counted_as_compute():
    """An expert-parallel all-to-all runs on the device's network lane (hidden under the other part's compute in an
    F&B pair), so the bounds, which count compute from below, must not count it as compute."""
    from pipesim.schedules import KIND_CODE, Kind, ScheduleParams, build_schedule

    schedule = build_schedule("dualpipev", ScheduleParams(stages=2, microbatches=4, chunks=2, expert_parallel=2))
    t = schedule.table
    all_to_all = np.isin(t.kind, [KIND_CODE[Kind.A2A_F], KIND_CODE[Kind.A2A_B]])
    assert all_to_all.any()
    codes = tuning._row_codes(t, schedule.num_stages, tuning._accumulates(schedule))
    computed = tuning._row_costs_ms(np.ones((schedule.num_stages, len(tuning.COMPUTE))))[codes]
    assert not computed[all_to_all].any() and computed[t.kind == KIND_CODE[Kind.F]].all()


def test_settings_of_a_chain_model_share_a_graph_methods_orders_and_a_branching_models_do_not():
    """A chain of layers cut anywhere is a chain of stages, so GraphPipe's order at a shape is one for every setting
    of the model (the search looks it up instead of building it per setting); a model whose layers branch is cut
    into its own DAG, so each setting's is its own."""
    chain = load_profile(GPT)
    branching = chain.model_copy(update={"layers": [layer.model_copy(update={"inputs": [1, 2]}) if i == 3 else layer
                                                    for i, layer in enumerate(chain.layers)]})
    for profile, shared in ((chain, True), (branching, False)):
        orders = tuning._Orders()
        scenarios = [profile_scenario(profile, "adam") for _ in "ab"]  # both alive: an order may be keyed by one's id
        first, second = (orders.of_shape(each, "graphpipe", 4, 8, 1, 1) for each in scenarios)
        assert (first is second) == shared


@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(*[st.floats(0, 100)] * 3), min_size=1, max_size=7), st.integers(1, 4), st.floats(1, 16),
       st.booleans(), st.lists(st.floats(0, 50), min_size=3, max_size=3), st.floats(0, 50), st.floats(0.5, 2))
@example([(1.0, 2.0, 1.5)] * 5, 3, 10.0, True, [0.5, 0.5, 0.5], 3.0, 1.0)
def test_best_cut_bound_is_the_least_over_every_cut_by_brute_force(layers, stages, passes, splits, hops, tail, scale):
    """`_best_cut_ms`, which bounds a flushing chain's shape before it is cut, against every cut into p stages:
    max over devices d of S_d + H_d + c·X_d + tail, X_0 without its input pass where the chain splits backwards.
    Never above the least (a bound the search prunes by must not overshoot), and below it by the bisection's
    tolerance only."""
    forward, backward, input_grad = (np.array(column) for column in zip(*layers))
    first = forward if splits else forward + backward
    rest = forward + (np.minimum(backward, input_grad) if splits else backward)
    work = tuning._ChainWork(*(np.concatenate([[0.0], np.cumsum(w)]).tolist() for w in (
        forward, forward + backward, forward + np.minimum(backward, input_grad))), first_param_bytes=0,
        first_expert_bytes=0, first_grad_bytes=0, sent_bytes=())
    reach = np.concatenate([[0.0], np.cumsum(hops)])[:stages].tolist()  # H_d
    bound = tuning._best_cut_ms(work, passes, splits, scale, reach, tail)
    n = len(layers)
    if stages > n:
        assert bound == 0.0
        return
    least = math.inf
    for cuts in itertools.combinations(range(1, n), stages - 1):
        edges = [0, *cuts, n]
        x = [scale * math.fsum((first if d == 0 else rest)[a:b]) for d, (a, b) in enumerate(itertools.pairwise(edges))]
        least = min(least, max(math.fsum(x[:d]) + reach[d] + passes * x[d] + tail for d in range(stages)))
    assert least * (1 - 1e-6) - 1e-9 <= bound <= least * (1 + 1e-9) + 1e-9, (bound, least)


def _flush_chain_per_device(schedule) -> tuple[int, bool] | None:
    """`_flush_chain` as it was written, one device at a time: the oracle of its one pass over the rows."""
    if not tuning._is_flushing_chain(schedule):
        return None
    t, fewest = schedule.table, None
    for d in range(schedule.num_devices):
        kinds = t.kind[(t.minibatch == 1) & (t.device == d)]
        backward = np.flatnonzero(np.isin(kinds, [tuning.KIND_CODE[tuning.Kind.B], tuning.KIND_CODE[tuning.Kind.I]]))
        if not len(backward):
            return None
        counted = min(int(np.count_nonzero(kinds[:backward[-1] + 1] == tuning.KIND_CODE[tuning.Kind.F])),
                      len(backward))
        fewest = counted if fewest is None else min(fewest, counted)
    return fewest, bool(np.any(t.kind == tuning.KIND_CODE[tuning.Kind.I]))


def test_a_flushing_chain_is_read_in_one_pass_as_device_by_device():
    """`_flush_chain` reads every device's fewest forwards and input-gradient passes up to its last one in one
    pass over the step's rows: the same as device by device, for every fixed method's orders of small shapes."""
    found = set()
    for name, p, m, v in itertools.product(METHODS, range(1, 6), range(1, 9), (1, 2)):
        method = METHODS[name]
        if method.needs_costs or method.on_graph is not None:
            continue
        try:
            schedule = method.build(tuning.ScheduleParams(p, m, 2, v, data_parallel=2))
        except tuning.ScheduleError:
            continue
        chain = tuning._flush_chain(schedule)
        assert chain == _flush_chain_per_device(schedule), (name, p, m, v)
        found.add(chain is None)
    assert found == {True, False}


def test_a_runner_ups_reason_shows_its_figures_apart():
    """"1.6% slower: bubble 11% vs 11%" explained nothing, and its bubbles were 10.8% against the choice's 10.9%:
    a reason names the busiest device's work or idle ms that decided it, with the digits at which they differ; where
    one grew past the whole loss and the other shrank, the step and both (DeepSeek-V3's "2.6% slower: busiest device
    17,571 vs 12,953 ms/step" told no reader why it lost). The loss is a share as every table writes one ("1.0%",
    where "1%" stood beside "1.7%"). A peak over the cap reads over it ("0.3 GiB > 0.3 GiB" said nothing)."""
    from types import SimpleNamespace

    def result(samples_per_s: float, step_ms: float, busiest_ms: float, bubble: float, gib: float = 1.0):
        return SimpleNamespace(staleness=0, peak_memory_bytes=gib * GIB, samples_per_s=samples_per_s,
                               step_ms=step_ms, bubble_fraction=bubble, config=(samples_per_s, step_ms),
                               candidate=SimpleNamespace(busiest_ms=busiest_ms))

    problem = SimpleNamespace(max_staleness=0, memory_cap_bytes=1 << 40)
    choice = result(100.0, 10.0, 8.9, 0.11)
    assert (tuning.explain(result(98.3, 10.17, 8.9, 0.108), choice, problem)  # its bubble share less
            == "1.7% slower: busiest device idle 1.27 vs 1.1 ms/step")
    assert (tuning.explain(result(99.9, 10.0004, 8.9, 0.11), choice, problem)
            == "0.1% slower: busiest device idle 1.1004 vs 1.1 ms/step")
    assert (tuning.explain(result(99.996, 10.0004, 8.9, 0.11), choice, problem)  # not "0.0% slower"
            == "under 0.1% slower: busiest device idle 1.1004 vs 1.1 ms/step")
    assert (tuning.explain(result(99.0, 10.0004, 8.9004, 0.11), choice, problem)
            == "1.0% slower: busiest device computing 8.9004 vs 8.9 ms/step")
    assert (tuning.explain(result(99.0, 10.03, 8.93, 0.11), choice, problem)
            == "1.0% slower: busiest device computing 8.93 vs 8.9 ms/step")
    lean = result(100.0, 10.0, 6.0, 0.3)  # where one part grew past the whole loss, the other shrinking: the step, both
    assert (tuning.explain(result(97.4, 10.27, 8.0, 0.2), lean, problem)
            == "2.6% slower: step 10.3 vs 10 ms: busiest device computing 8 vs 6 ms, idle 2.27 vs 4 ms")
    assert (tuning.explain(result(97.4, 10.27, 5.5, 0.4), lean, problem)
            == "2.6% slower: step 10.3 vs 10 ms: busiest device computing 5.5 vs 6 ms, idle 4.77 vs 4 ms")
    assert (tuning.explain(result(100.0, 10.0, 8.9, 0.11, gib=1.0004), choice, problem)
            == "as fast, more memory: 1.0004 GiB vs 1 GiB")
    capped = SimpleNamespace(max_staleness=0, memory_cap_bytes=0.3 * GIB)  # over it by less than its last digit
    assert (tuning.explain(result(110.0, 9.0, 8.0, 0.1, gib=0.3004), choice, capped)
            == "over memory: 0.3004 GiB > 0.3 GiB (10.0% faster)")


def test_the_peak_column_keeps_its_figures_zeros():
    """tune's peak column sets figures one under another: the context-parallel run in docs/sweep-and-tune.md read
    "19 GiB" and "20 GiB" under "19.4 GiB", as if cut. Three significant digits, the zeros kept, whole GiB never
    rounded away (1,234, not 1230), and 99.96 rounded to 100, not 100.0."""
    cells = [tuning.memory_text(gib * GIB, zeros=True) for gib in (19.4, 19.0, 20.0, 0.3, 0.0105, 1234.0, 99.96)]
    assert cells == ["19.4 GiB", "19.0 GiB", "20.0 GiB", "0.300 GiB", "0.0105 GiB", "1,234 GiB", "100 GiB"]


def test_the_cap_and_the_peak_column_write_a_thousand_gib_alike():
    """The cap, the why-not texts and the peak column write GiB by one rule: the cap read "1230 GiB" over a peak
    column's "1,234 GiB" (no separator, whole GiB rounded away); only the column keeps zeros after the point."""
    texts = [tuning.memory_text(gib * GIB) for gib in (1234.0, 19.0, 1.0004, 0.0105)]
    assert texts == ["1,234 GiB", "19 GiB", "1 GiB", "0.0105 GiB"]


@pytest.mark.parametrize("flags", [
    GPT_UNDER_03,
    # auto at a cap under 1F1B's peak: its order searched with the cap binding, R 0.875 reached; simulate's search at
    # that R (each device up to 0.875 of 1F1B's fullest) found another order, 169 MiB where tune's held 141
    ("--profile", GPT, "-D", 8, "--memory-gb", 0.145),
    ("--gpu", "h100-sxm", "--model", "gpt", "--layers", 8, "--width", 1024, "--heads", 8, "--seq-len", 1024,
     "--vocab", 32000, "-D", 8, "--memory-gb", 2, "--zero", 1, "-s", "1f1b", "-s", "interleaved-1f1b",
     "--max-chunks", 2, "--max-pipelines", 1),
    # the caching allocator's cache carries over steps, and this choice's step takes a segment more from its third:
    # tune runs N = 3, simulate's default is 2, and both read the steady reserve (`steady_rows`)
    pytest.param(("--gpu", "h100-sxm", "--model", "hf:examples/llama3.1-8b", "--seq-len", 8192, "-D", 16, "-B", 64,
                  "-s", "1f1b", "-s", "zb-h1", "--tensor-parallel", 2), marks=needs_transformers),
    # under a cap the caching allocator's reserve is replayed within it, as the line's --memory-gb has simulate do:
    # tune replayed it within the part's 80 GB, 40,053 MiB where the line gave 39,559
    pytest.param(("--gpu", "h100-sxm", "--model", "hf:examples/llama3.1-8b", "--seq-len", 8192, "-D", 16, "-b", 1,
                  "--tensor-parallel", 2, "--recompute", "selective", "--sequence-parallel", "-s", "1f1b",
                  "--data-parallel", 4, "--rank-order", "megatron", "--zero", 1, "--memory-gb", 40),
                 marks=needs_transformers)])
def test_the_simulate_command_tune_prints_gives_its_choice(flags, monkeypatch):
    """tune prints the `pipesim simulate` command that reproduces its choice, the cut as layers:N,N,... (its
    partition printed as 0-6 | 7-15 could be had only as first-last:6,8, in blocks, which nothing said), and --json
    holds it: run, it gives the choice's step, samples/s and peak, and at 80 columns each line ends in ` \\` and
    no number is cut. The --gpu case searches t, b, recomputation and p on 8 H100s at v <= 2, P = 1: 570 shapes,
    and the same choice (interleaved-1f1b p = 2 v = 2, t = 2, d = 2, ZeRO 1) as the default v <= 4, P <= 4's 2,232."""
    code, out, err = tuned(*flags, "--json")
    assert code == 0, err
    document = json.loads(out)
    choice, command = document["choice"], document["simulate_command"]
    assert command.startswith("pipesim simulate ") and "--stage-cut layers:" in command
    if "0.145" in map(str, flags):  # the case of auto's line
        assert choice["schedule"] == "auto" and " --memory-gb 0.145 " in command, command
    assert command.count(" -s ") == 1, command  # the choice's method, not the ones tune searched
    code, out, err = pipesim(*shlex.split(command)[1:], "--json")
    assert code == 0, err
    simulated = json.loads(out)["results"][0]
    assert simulated["stage_bounds"] == choice["partition"]
    assert simulated["time_per_minibatch_ms"] == pytest.approx(choice["step_ms"], rel=1e-12)
    assert simulated["samples_per_s"] == pytest.approx(choice["samples_per_s"], rel=1e-12)
    assert simulated["peak_memory_mb"] / 1024 == pytest.approx(choice["peak_memory_gib"], rel=1e-12)
    if flags == GPT_UNDER_03:  # the table's lines, printed (the search again, so once); the others' through its wrap
        at_columns(monkeypatch, 80)
        code, out, err = pipesim("tune", *flags)
        assert code == 0, err
        printed = out[out.index("the choice, as simulate gives it:\n"):].splitlines()[1:]
        lines = printed[:next(k for k, line in enumerate(printed) if not line.endswith(" \\")) + 1]
    else:
        words, pieces = shlex.split(command), []
        for word in words[2:]:  # a flag and its values a piece, as the command is built
            if word.startswith("-") or not pieces:
                pieces.append([word])
            else:
                pieces[-1].append(word)
        lines = tune_command._shell_lines([words[:2], *pieces], 80).splitlines()
    assert len(lines) > 1 and all(len(line) <= 80 for line in lines)
    assert shlex.split(" ".join(line.removesuffix(" \\") for line in lines)) == shlex.split(command)


def test_the_simulate_command_carries_autos_search_budget_where_auto_is_chosen():
    """--search-seconds is auto's budget, which shapes the order it finds: the printed command gives it where the
    choice is auto (simulate would search with its default)."""
    code, out, err = pipesim("tune", "--profile", GPT, "-D", 8, "--memory-gb", 0.3, "-s", "auto", "--search-seconds",
                             0.05, "--json")
    assert code == 0, err
    command = json.loads(out)["simulate_command"]
    assert "--search-seconds 0.05" in command, command
    code, _, err = pipesim(*shlex.split(command)[1:], "--json")
    assert code == 0, err


@pytest.mark.parametrize("methods", [["1f1b"], ["1f1b", "zb-h1"]])
def test_autos_search_budget_without_auto_is_refused_as_simulate_refuses_it(methods):
    """`tune -s 1f1b --search-seconds 5` searched without a word of the budget it dropped (it was left out of the
    printed command), where `simulate -s 1f1b --search-seconds 5` refuses it."""
    code, out, err = pipesim("tune", "--profile", GPT, "-D", 8, "--memory-gb", 0.3, "-s", ",".join(methods),
                             "--search-seconds", 5)
    assert (code, out, err) == (2, "", f"error: --search-seconds applies to auto only, not {', '.join(methods)}\n")


def test_an_idle_time_of_the_subtractions_rounding_reads_0():
    """The busiest device of auto at p = 8 computes its whole step but for the subtraction's rounding: "why not" read
    "idle 2.01e-10 vs 0.99 ms"."""
    code, out, err = pipesim("tune", "--profile", "traces/profiles/cnn-cpu.json", "--devices", 8, "--memory-gb", 0.02,
                             "-s", "gpipe", "-s", "1f1b", "-s", "auto")
    assert code == 0, err
    row = next(line for line in out.splitlines() if " auto       8 " in line)
    assert "idle 0 vs 0.99 ms" in row and "e-" not in row, row


@pytest.mark.parametrize("flag, readers", [("--max-chunks", "interleaved-1f1b, zb-v, dualpipev, dualpipe"),
                                           ("--max-pipelines", "avgpipe")])
def test_a_bound_on_a_shape_no_method_given_takes_is_refused(flag, readers):
    """`tune -s 1f1b --max-chunks 3` searched 1F1B at v = 1 without a word of the bound it could not apply."""
    code, out, err = pipesim("tune", "--profile", GPT, "-D", 8, "--memory-gb", 0.3, "-s", "1f1b,zb-h1", flag, 3)
    assert (code, out, err) == (2, "", f"error: {flag} applies to {readers} only, not 1f1b, zb-h1\n")


def test_every_tune_flag_is_passed_on_to_simulate_as_it_parses_there_or_left_out_as_tunes_own():
    """tune's simulate command gives the user's flags that simulate takes alike (`given_simulate_flags`, by name) and
    are not the choice's: each parses in simulate as tune prints it, and each of the choice's flags is one of
    simulate's parameter's."""
    from types import SimpleNamespace

    import typer

    from pipesim.cli import make_app
    from pipesim.commands.tune import _choice_flags

    commands = typer.main.get_command(make_app()).commands
    takes = {param.name: param for param in commands["simulate"].params}
    config = SimpleNamespace(schedule="1f1b", stages=2, chunks=1, pipelines=2, microbatches=4, replicas=2, tensor=2,
                             microbatch_size=1, recompute="full", expert=2, sequence_parallel=True, zero=1,
                             rank_order="megatron", microbatch_group=3)
    chosen = _choice_flags(config, SimpleNamespace(bounds=[0, 3, 5], activation_limit=2,
                                                   params=SimpleNamespace(activation_limit=16.0)))
    assert all(value is not None for _, _, value in chosen)  # every flag the choice can give, given
    assert all(flag in takes[name].opts for name, flag, _ in chosen), chosen
    assert ("activation_limit", "--activation-limit", "16") in chosen  # the R auto's search held, not the one reached
    own = {*(name for name, _, _ in chosen), "as_json"}
    assert {"schedule", "zero"} <= own and not {"devices", "max_chunks"} & set(takes)
    passed = [param for param in commands["tune"].params if param.name in takes and param.name not in own]
    assert len(passed) > 40, [param.name for param in passed]  # the model's, the costs' and the runtime's flags
    assert "memory_gb" in {param.name for param in passed}  # the cap: simulate's OOM marks and auto's search
    for param in passed:
        there = takes[param.name]
        assert param.opts[0] in there.opts and param.multiple == there.multiple, param.name
        assert param.secondary_opts[:1] == there.secondary_opts[:1], param.name  # a switch's off side, as printed


def test_a_cut_by_layers_names_what_it_must_sum_to():
    """--stage-cut layers:N,N,... (tune's cut) must give each of the p·v stages its layers, all of them: one line."""
    code, _, err = pipesim("simulate", "--profile", GPT, "-s", "1f1b", "-p", 2, "-m", 4, "--stage-cut", "layers:7,8")
    assert code == 2 and "p·v = 2 model stages' layers, 16 in all (got 2 stages, 15 layers)" in err
    assert len(err.strip().splitlines()) == 1, err
    for cut in ("layers:0,16", "layers:", f"layers:8,{'9' * 5000}"):  # int() refuses 5,000 digits in a traceback
        code, _, err = pipesim("simulate", "--profile", GPT, "-s", "1f1b", "-p", 2, "-m", 4, "--stage-cut", cut)
        assert code == 2 and "the first and last stages' from 1" in err and len(err.strip().splitlines()) == 1, err
    # a stage between the first and the last may hold none: a --json's stage_bounds [0, 3, 3, 4, 16], differenced
    (cut,) = simulate_json("--profile", GPT, "-s", "interleaved-1f1b", "-p", 2, "-m", 4,
                           "--stage-cut", "layers:3,0,1,12")
    assert cut["stage_bounds"] == [0, 3, 3, 4, 16]


def test_tune_runs_interleaved_1f1b_in_megatron_cores_least_group_where_m_is_no_multiple_of_p():
    """10 samples on 4 GPUs: m = 5 at p = 2, 10 at p = 4, which Megatron-core's default group (p) refuses and its
    least group takes (3 and 5: `least_microbatch_group`); the chosen one's simulate line, with its group, gives its
    samples/s."""
    from pipesim.schedules.rivals import least_microbatch_group

    assert [least_microbatch_group(p, m) for p, m in ((2, 5), (4, 10), (13, 32), (4, 8), (4, 3), (4, 7))] == \
        [3, 5, 16, None, None, 7]
    code, out, err = pipesim("tune", "--gpu", "h100-sxm", "--model", "gpt", "--layers", 12, "--seq-len", 1024, "-D", 4,
                             "-B", 10, "-b", 1, "-s", "interleaved-1f1b", "--json")
    assert code == 0, err
    document = json.loads(out)
    chosen = document["choice"]
    assert chosen["chunks"] > 1 and chosen["microbatch_group"] == least_microbatch_group(chosen["stages"],
                                                                                          chosen["microbatches"])
    line = document["simulate_command"]
    assert f"--microbatch-group {chosen['microbatch_group']}" in line
    (simulated,) = simulate_json(*shlex.split(line)[2:])
    assert simulated["samples_per_s"] == pytest.approx(chosen["samples_per_s"], rel=1e-9)


def test_twins_are_named_in_catalogue_order_whatever_order_s_gives():
    """At v = 1 interleaved 1F1B is 1F1B: the choice reads as the plainer method in either order of -s (given
    interleaved-1f1b first, the row and its simulate line named it)."""
    for order in (("interleaved-1f1b", "1f1b"), ("1f1b", "interleaved-1f1b")):
        code, out, err = pipesim("tune", *GPT_UNDER_03, *(flag for name in order for flag in ("-s", name)), "--json")
        assert code == 0, err
        choice = json.loads(out)["choice"]
        assert (choice["schedule"], choice["same_result"]) == ("1f1b", ["interleaved-1f1b p=2"])
