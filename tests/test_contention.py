"""Compute contention: how much ranks computing at once on one CPU host slow each other (calibrate/contention.py),
kept in the profile. Structure only: the measured factors depend on the machine and its load."""

import json
import math
import os
import statistics
from pathlib import Path

import pytest

from pipesim.calibrate.contention import slowdowns
from pipesim.planning.scenario import profile_cluster, profile_costs
from pipesim.profiles.schema import ProfileError, load_profile, profile_json
from tests.conftest import host_counters, pipesim, simulate_json
from tests.helpers import CNN_CPU, GPT_CPU

ROOT = Path(__file__).resolve().parents[1]
PROFILE = CNN_CPU  # measured before contention was
TINY = ["--model", "mlp", "--layers", "2", "--width", "16", "--microbatch-size", "2", "--stages", "2", "--device",
        "cpu", "--repeats", "3", "--warmup", "1", "--no-links", "--no-runtime"]
MEASURED = {"slowdown": [1.0, 1.6], "spread": [0.02, 0.1], "meta": {"processes": 2}}


def _with_contention(tmp_path, contention, beside_compute: list[float] | None = None) -> Path:
    """The committed profile with `contention` measured and, where given, its all-reduce timed beside computing
    ranks (`allreduce.beside_compute`), written over the last one this wrote."""
    doc = json.loads(PROFILE.read_text())
    doc["contention"] = contention
    if beside_compute is not None:
        doc["allreduce"]["beside_compute"] = beside_compute
    path = tmp_path / "edited.json"
    path.write_text(json.dumps(doc))
    return path


def test_a_profile_from_before_contention_loads_without_it(tmp_path):
    assert load_profile(PROFILE).contention is None
    profile = load_profile(_with_contention(tmp_path, MEASURED))
    assert profile.contention.slowdown == [1.0, 1.6]
    again = tmp_path / "again.json"
    again.write_text(profile_json(profile))
    assert load_profile(again) == profile


def test_a_profile_with_contention_puts_its_ranks_on_one_host_that_slows_them(tmp_path):
    """Simulating from such a profile shares the calibrating host's cores: GPipe's ranks compute side by side
    in the steady state, so each row that overlaps its peer's takes up to 1.6x as long and the step is longer;
    one rank alone is not slowed at all."""
    plain = load_profile(PROFILE)
    shared = _with_contention(tmp_path, MEASURED)
    cluster = profile_cluster(load_profile(shared), 2, overlap_comm=True)
    assert (cluster.hosts, cluster.contention) == (("vm", "vm"), (1.0, 1.6))
    assert profile_cluster(plain, 2, overlap_comm=True).contention == ()
    args = ("-s", "gpipe", "-m", "8")
    (alone,), (together,) = simulate_json("--profile", PROFILE, *args), simulate_json("--profile", shared, *args)
    assert 1.05 < together["time_per_minibatch_ms"] / alone["time_per_minibatch_ms"] < 1.6
    (one,), (one_shared,) = (simulate_json("--profile", path, *args, "--stages", "1") for path in (PROFILE, shared))
    assert one_shared["time_per_minibatch_ms"] == one["time_per_minibatch_ms"]


def test_the_passes_are_priced_at_their_mean_where_the_tail_was_measured(tmp_path):
    """Calibration times a stage's passes as medians; a rank advances at their mean, which the contention
    probe's solo windows give (tail = mean / median): every pass is priced that much longer, nothing else."""
    plain = load_profile(_with_contention(tmp_path, MEASURED))
    tailed = load_profile(_with_contention(tmp_path, {**MEASURED, "tail": 1.25}))
    bounds = plain.partition.bounds
    for a, b in zip(profile_costs(plain, "sgd", bounds).stages, profile_costs(tailed, "sgd", bounds).stages):
        assert (b.fwd_ms, b.bwd_ms, b.igrad_ms, b.wgrad_ms) == pytest.approx(
            (1.25 * a.fwd_ms, 1.25 * a.bwd_ms, 1.25 * a.igrad_ms, 1.25 * a.wgrad_ms))
        assert (b.opt_ms, b.activation_bytes) == (a.opt_ms, a.activation_bytes)


def test_a_profile_whose_tail_was_taken_in_wall_time_is_warned_of_where_it_held_the_hosts_load(tmp_path):
    """A profile calibrated before the tail was taken in CPU time (no `tail_from`) priced every pass at a wall-time
    tail that held the host's busy moment (3.2-7.5x on a full host): simulate says so, once, and still answers; a
    CPU-time tail, or a wall-time one within what CPU time gives, is not warned of."""
    warned = "was taken in wall time"
    args = ("-s", "gpipe", "-m", "4")
    for tail, meta, warns in ((5.579, {}, True), (1.05, {}, False), (5.579, {"tail_from": "process CPU time"}, False)):
        path = _with_contention(tmp_path, {**MEASURED, "tail": tail, "meta": {**MEASURED["meta"], **meta}})
        code, out, err = pipesim("simulate", "--profile", path, *args, "--json")
        assert code == 0 and json.loads(out)["results"]
        assert err.count(warned) == warns, err


@pytest.mark.parametrize("edit,fragment", [
    ({"slowdown": [1.2, 1.6]}, "contention: slowdown.0: give 1, one rank computing alone (got 1.2)"),
    ({"slowdown": [1.0, -1.0]}, "contention.slowdown.1: Input should be greater than 0"),
    ({"slowdown": [1.0, 0.0]}, "contention.slowdown.1: Input should be greater than 0"),
    ({"slowdown": [1.0, math.inf]}, "contention.slowdown.1: Input should be a finite number"),
    ({"slowdown": []}, "contention.slowdown: List should have at least 1 item"),
    ({"spread": [0.1]}, "contention: spread: give one entry per slowdown entry, 2 (got 1)"),
    ({"spread": [0.1, -0.1]}, "contention.spread.1: Input should be greater than or equal to 0"),
    ({"meta": None}, "contention.meta: Input should be an object"),
])
def test_a_bad_contention_term_names_its_field(tmp_path, edit, fragment):
    with pytest.raises(ProfileError) as caught:
        load_profile(_with_contention(tmp_path, {**MEASURED, **edit}))
    assert fragment in str(caught.value) and "\n" not in str(caught.value)


@pytest.mark.parametrize("edit,line", [
    ({"slowdown": [1.2, 1.6]}, "contention: slowdown.0: give 1, one rank computing alone (got 1.2)"),
    ({"spread": [0.1]}, "contention: spread: give one entry per slowdown entry, 2 (got 1)"),
])
def test_the_command_refuses_a_contention_term_in_the_one_wording(tmp_path, edit, line):
    """They read "slowdown[0] is one rank computing alone and must be 1.0, got 1.2" and "spread must have one entry
    per slowdown entry (2), got 1": now "FIELD: give WHAT IS ALLOWED (got VALUE)"."""
    path = _with_contention(tmp_path, {**MEASURED, **edit})
    code, out, err = pipesim("simulate", "--profile", path, "-s", "gpipe", "-m", "4")
    assert (code, out, err) == (2, "", f"error: --profile: profile {path}: {line}\n")


@pytest.mark.parametrize("ranks", [None, 3])
def test_calibrate_measures_contention_on_cpu(tmp_path, ranks, monkeypatch):
    """One process per stage, or as many as `--ranks` (AvgPipe's pipelines), each repeating its stage."""
    from pipesim.calibrate import contention as probe

    monkeypatch.setattr(probe, "WINDOW_S", 0.2)  # the parent sets the windows: shorter ones for a test
    out = tmp_path / "p.json"
    code, printed, err = pipesim("calibrate", *TINY, *(["--ranks", ranks] if ranks else []), "--out", out)
    assert code == 0, err
    profile = load_profile(out)
    contention = profile.contention
    count = ranks or 2
    assert len(contention.slowdown) == len(contention.spread) == count and contention.slowdown[0] == 1.0
    assert all(math.isfinite(s) and s > 0 for s in contention.slowdown)
    assert all(math.isfinite(s) and s >= 0 for s in contention.spread)
    meta = contention.meta
    # the tail: a rank's mean iteration alone over its median, window by window (the host drifts between rounds)
    tails = meta["solo_tail_by_round"]
    assert len(tails) == meta["rounds"] and all(len(by_rank) == count for by_rank in tails)
    assert contention.tail == pytest.approx(statistics.median(t for by_rank in tails for t in by_rank), rel=1e-3)
    # each round: a ratio per k >= 2, taken within it; the factor is their median over rounds
    by_round = meta["measured_slowdown_by_round"]
    assert len(by_round) == meta["rounds"] and all(len(ratios) == count - 1 for ratios in by_round)
    assert meta["measured_slowdown"][1:] == pytest.approx(
        [statistics.median(ratios[k] for ratios in by_round) for k in range(count - 1)], rel=1e-3)
    assert (meta["processes"], meta["threads_per_process"], meta["cpu_count"]) == (count, 1, os.cpu_count())
    assert meta["window_s"] > meta["warmup_s"] > 0
    # alone, a window needs no room for the others: each k's windows are sized for k at once, the last for all
    assert len(meta["window_s_by_count"]) == count and meta["window_s_by_count"][-1] == meta["window_s"]
    assert meta["window_s_by_count"] == sorted(meta["window_s_by_count"])
    assert meta["workload"] == {"model": "mlp", "options": {"layers": 2, "width": 16}, "dtype": "float32",
                                "microbatch_size": 2, "bounds": profile.partition.bounds,
                                "stages": [rank % 2 for rank in range(count)],
                                "pass": "forward and full backward, as the executor runs them"}
    assert len(meta["iterations"]) == meta["rounds"] and all(len(windows) == count for windows in meta["iterations"])
    assert all(n > 0 for windows in meta["iterations"] for window in windows for n in window)
    assert "contention: 2 ranks computing at once" in printed
    # each rank alone runs its stage's calibrated passes: the line says how far the host drifted in between
    flat = " ".join(printed.split())  # the console wraps at 120 columns
    drift = flat.split("against its stage's calibrated F + B: ")[1].split(" (the same code")[0]
    assert len(drift.split(", ")) == count and all(d.endswith("%") for d in drift.split(", "))


def test_calibrate_told_not_to_measures_no_contention(tmp_path):
    skipped = tmp_path / "skipped.json"
    code, printed, err = pipesim("calibrate", *TINY, "--no-contention", "--out", skipped)
    assert code == 0, err
    assert load_profile(skipped).contention is None and "contention" not in printed


def test_a_calibration_of_the_same_workload_reuses_its_factors_until_fresh(tmp_path, monkeypatch):
    """Contention depends on the host and on the model's workload: kept in the host cache under both, a second
    calibration of the same model (one cut: two layers on two stages) under the same load takes it from there
    and says how old it is and under what load it was measured; one under another load measures it again and
    says why; `--fresh` (a fresh cache) measures it again, and another workload or way of taking the windows is
    another entry. Each profile records the host's load while calibrating and the ranks it was calibrated for."""
    from pipesim.calibrate import contention as probe
    from pipesim.calibrate.cache import HostCache
    from pipesim.traces import hostload
    from pipesim.traces.hostload import HostLoad

    monkeypatch.setattr(probe, "WINDOW_S", 0.1)  # the parent sets the windows: shorter ones for a test
    monkeypatch.setattr(probe, "MIN_ROUNDS", 1)  # what is kept and reused is one factor however many rounds gave it
    monkeypatch.setenv("PIPESIM_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(hostload, "usable_cpus", lambda: 2)
    at = TINY.index("--layers")  # the command line refuses an option given twice
    one_cut = [*TINY[:at], "--layers", "1", *TINY[at + 2:]]
    runs = []
    for name, load in (("first", 1.8), ("again", 1.8), ("quiet", 0.2)):  # busy (0.9 per core), then quiet
        monkeypatch.setattr(hostload, "sample", host_counters(load))
        code, printed, err = pipesim("calibrate", *one_cut, "--out", tmp_path / f"{name}.json")
        assert code == 0, err
        runs.append((load_profile(tmp_path / f"{name}.json"), err, " ".join(printed.split())))
    (profile, first_err, first_out), (again, again_err, again_out), (quiet, quiet_err, _) = runs
    load = HostLoad.from_dict(profile.environment.load)
    assert (load.others_cores, load.cpus) == (1.8, 2) and profile.environment.ranks == 2
    assert f"host while calibrating: {load.describe()}; calibrated for 2 ranks computing at once" in first_out
    factors_load = HostLoad.from_dict(profile.contention.meta["host_cache"]["load"])
    assert factors_load.others_cores == 1.8 and factors_load.own_tasks == 2  # its two processes, one thread each
    assert f"contention (2 processes): measured now at {factors_load.describe()}, kept in the host cache; none " \
           "was cached" in first_err
    assert f"at {factors_load.describe()}" in again_out  # reused, under the load it was measured at
    # the quiet calibration measures the busy factors again, and says why
    assert not quiet.contention.meta["host_cache"]["reused"] and quiet.contention.meta["host_cache"]["load"][
        "others_cores"] == 0.2
    assert f"the cached one's calibration began at {load.describe()}, this one at 0.10 per core" in quiet_err
    described = quiet.describe()  # what a prediction from it records
    assert described["ranks"] == 2 and described["load"]["others_cores"] == 0.2
    assert described["host_terms"]["contention"]["reused"] is False
    first, reused = profile.contention, again.contention
    assert (first.meta["host_cache"]["reused"], reused.meta["host_cache"]["reused"]) == (False, True)
    assert "measuring contention (2 processes) ... " in first_err and "measuring contention" not in again_err
    assert "contention (2 processes) ... 0.0 s (from the host cache, measured " in again_err
    assert "the factors from the host cache, measured " in again_out
    assert reused.model_copy(update={"meta": {}}) == first.model_copy(update={"meta": {}})
    assert reused.meta["host_cache"]["measured_at"] == first.meta["host_cache"]["measured_at"]
    # the key: the workload each process runs, the processes, and how the windows are taken
    options = {"layers": 1, "width": 16}
    key = probe.ContentionProbe(profile, "mlp", options).cache_key()
    assert key["workload"] == {"model": "mlp", "options": options, "dtype": "float32", "microbatch_size": 2,
                               "threads": 1, "bounds": [0, 1, 2]} and key["processes"] == 2
    assert HostCache().find("contention", key) is not None and HostCache(fresh=True).find("contention", key) is None
    monkeypatch.setattr(hostload, "sample", host_counters(1.8))
    assert HostCache().find("contention", key) is None  # kept from the quiet hour: a busy one measures again
    assert key != probe.ContentionProbe(profile, "mlp", options, ranks=3).cache_key()
    monkeypatch.setattr(probe, "MIN_ITERATIONS", 4)
    assert key != probe.ContentionProbe(profile, "mlp", options).cache_key()


def _calibrate_own_model(tmp_path, monkeypatch, module: str, source: str):
    """`pipesim calibrate` of the bring-your-own model `build` of `module` (its `source`), layers and contention
    only: (exit code, stdout, stderr), and the profile's path."""
    (tmp_path / f"{module}.py").write_text(source)
    monkeypatch.chdir(tmp_path)
    out = tmp_path / "p.json"
    return pipesim("calibrate", "--model", f"{module}:build", "--stages", "2", "--device", "cpu", "--repeats", "3",
                   "--warmup", "1", "--no-links", "--no-runtime", "--out", out), out


def test_a_measurement_process_that_fails_is_one_line_exit_2(tmp_path, monkeypatch):
    """The user's model builds in calibrate's own process but fails in the measurement's: the failure comes
    back from the process, names it, and nothing is written."""
    (code, _, err), out = _calibrate_own_model(tmp_path, monkeypatch, "byo_only_in_parent",
                                               "import multiprocessing\nfrom torch import nn\n"
                                               "def build():\n"
                                               "    if multiprocessing.parent_process() is not None:\n"
                                               "        raise RuntimeError('not in a child')\n"
                                               "    return nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))"
                                               "\n")
    assert code == 2 and "contention measurement: process 0 failed: ModelError" in err and "not in a child" in err
    *phases, error = err.strip().splitlines()  # a line per phase done, then the error's one line
    assert all(line.endswith(" s") and " ... " in line for line in phases) and "failed" in error
    assert "Traceback" not in err and not out.exists()


def test_more_ranks_at_once_are_never_priced_faster_than_fewer():
    """A ratio below the one before it is the host's noise: it takes the one before; the rest stand."""
    assert slowdowns([1.0, 0.81, 1.47, 1.3, 2.5]) == [1.0, 1.0, 1.47, 1.47, 2.5]
    assert slowdowns([1.0, 1.08, 1.47, 2.53]) == [1.0, 1.08, 1.47, 2.53]


def test_one_slow_spell_sets_no_factor():
    """Alone and together windows alternate over rounds and each ratio is taken within its round: a round whose
    together window met a slow spell of the host (1.84x was once measured so, 1.09-1.14 around it), or whose
    solo windows did, is outvoted by the others."""
    from pipesim.calibrate.contention import measured_slowdowns

    def round_(solo_ms, together_ms):
        return [[solo_ms] * 20, [solo_ms] * 20], [[[together_ms] * 20, [together_ms] * 20]]

    calm = round_(2.0, 2.2)
    measured, by_round = measured_slowdowns([calm, round_(2.0, 3.7), calm])
    assert measured == pytest.approx([1.0, 1.1]) and by_round[1] == [pytest.approx(1.85)]
    measured, _ = measured_slowdowns([round_(2.0, 2.2), round_(2.6, 2.86), round_(1.0, 1.1)])  # drift between
    assert measured == pytest.approx([1.0, 1.1])  # rounds: each ratio against its own round's solo windows
    assert measured_slowdowns([round_(2.0, 2.2), round_(2.0, 3.7), round_(3.0, 2.2)])[0][1] == pytest.approx(1.1)


def test_rounds_stop_when_two_agree_and_a_third_outvotes_a_slow_spell():
    """The stopping rule of the rounds: two that agree within AGREEMENT are enough; a round in a slow spell
    disagrees with the other, so a third is run and the median sets the factor."""
    from pipesim.calibrate.contention import AGREEMENT, MIN_ROUNDS, ROUNDS, measured_slowdowns, rounds_agree

    def measured_round(slowdown: float):  # two ranks, 10 ms an iteration alone, `slowdown` times that together
        return [[10.0] * 4, [10.0] * 4], [[[10.0 * slowdown] * 4, [10.0 * slowdown] * 4]]

    assert (MIN_ROUNDS, ROUNDS) == (2, 3)
    assert not rounds_agree([measured_round(1.1)])  # one round is never enough
    assert rounds_agree([measured_round(1.1), measured_round(1.1 * (1 + AGREEMENT / 2))])
    spell = [measured_round(1.1), measured_round(1.84)]
    assert not rounds_agree(spell)
    assert measured_slowdowns([*spell, measured_round(1.12)])[0] == pytest.approx([1.0, 1.12])


def test_windows_are_sized_for_the_oversubscription_of_the_cores_and_warm_up_past_every_first_iteration(
        monkeypatch):
    """k ranks of t threads on c usable cores run k*t/c times slower where that exceeds 1, else as fast as alone:
    a window holds the warm-up (WARMUP_S, or WARMUP_ITERATIONS of those iterations), MIN_ITERATIONS kept and one
    running past the end; WINDOW_S at least."""
    from pipesim.calibrate import contention

    monkeypatch.setattr(contention, "_usable_cpus", lambda: 2)
    windows = contention.Windows(iteration_s=0.2, threads=1)
    assert [windows.slowed_s(k) for k in (1, 2, 3, 4)] == pytest.approx([0.2, 0.2, 0.3, 0.4])
    assert contention.Windows(0.2, threads=2).slowed_s(2) == pytest.approx(0.4)
    for k in (1, 2, 3):
        warmup_s = contention.WARMUP_ITERATIONS * windows.slowed_s(k)
        assert windows.warmup_s(k) == pytest.approx(warmup_s) and warmup_s > windows.slowed_s(k)
        assert windows.length_s(k) == pytest.approx(warmup_s + (contention.MIN_ITERATIONS + 1) * windows.slowed_s(k))
    short = contention.Windows(iteration_s=0.001, threads=1)
    assert short.warmup_s(2) == contention.WARMUP_S and short.length_s(2) == contention.WINDOW_S


def test_a_window_keeps_the_iterations_that_began_after_its_warm_up_and_ended_within_it():
    """The warm-up is the window's own (here shorter than WARMUP_S), and nothing begins after the end."""
    import time

    from pipesim.calibrate.contention import WARMUP_S, _run_window

    ran = []

    def iteration():
        began = time.monotonic()
        time.sleep(0.02)
        ran.append((began, time.monotonic()))

    start_s = time.monotonic() + 0.01
    warm_s, end_s = start_s + 0.02, start_s + 0.3
    assert warm_s < start_s + WARMUP_S
    kept = _run_window(iteration, start_s, warm_s, end_s)
    inside = [(b, e) for b, e in ran if b >= warm_s and e <= end_s]
    after_constant = [b for b, e in inside if b >= start_s + WARMUP_S]  # what a fixed WARMUP_S would keep
    assert abs(len(kept.wall_ms) - len(inside)) <= 1 and len(inside) > len(after_constant) + 1
    assert all(ms >= 20 for ms in kept.wall_ms) and ran[-1][0] < end_s
    assert len(kept.cpu_ms) == len(kept.wall_ms)


def test_a_wait_for_a_core_at_the_cpu_clocks_reading_is_in_the_iterations_wall_time(monkeypatch):
    """Reading the process's CPU clock brings the kernel's accounting up to date, and a rank past its share of a
    core waits right there: both readings lie inside the iteration's wall span, so such a wait is the iteration's
    (its slowdown) and not its CPU time's. Here each reading is followed by a 5 ms wait off the CPU."""
    import time

    from pipesim.calibrate.contention import _run_window

    reading = time.process_time

    def read_then_wait() -> float:
        now = reading()
        time.sleep(0.005)
        return now

    monkeypatch.setattr(time, "process_time", read_then_wait)
    start_s = time.monotonic() + 0.01
    kept = _run_window(lambda: None, start_s, start_s, start_s + 0.2)
    assert kept.wall_ms and all(wall - cpu >= 10 for wall, cpu in zip(kept.wall_ms, kept.cpu_ms))


def test_a_ranks_tail_is_its_passes_own_not_its_waits_for_a_core():
    """`contention.tail` prices every pass at its mean over its median: what the pass itself costs now and then
    beyond it, not the waits for a core that the host's other work sets (docs/auto.md's --width 16 mlp at others'
    load 0.81-0.92 per core: 3.2-7.5x in wall time). Here every fourth iteration waits 30 ms off the
    CPU after its 2 ms of work, as a rank descheduled by others' work does: its wall time's mean is over twice
    its median, its CPU time's is not; an iteration that costs more CPU (a cold one) is still counted."""
    import time

    from pipesim.calibrate.contention import ContentionProbe, _run_window, pass_tail

    count = [0]

    def iteration():
        began = time.process_time()
        while time.process_time() - began < 0.002:  # 2 ms of CPU work, however loaded the host
            pass
        count[0] += 1
        if count[0] % 4 == 0:
            time.sleep(0.03)

    start_s = time.monotonic() + 0.01
    kept = _run_window(iteration, start_s, start_s, start_s + 1.0)
    waits = [ms for ms in kept.wall_ms if ms >= 30]
    assert len(waits) >= len(kept.wall_ms) // 5  # the sample has its outliers, in wall time
    assert pass_tail(kept.cpu_ms) < 1.2
    # the probe's tail, from two rounds of two ranks alone: 2 ms iterations, every fourth waiting 30 ms for a core
    probe = ContentionProbe(load_profile(PROFILE), "cnn", {}, ranks=2)
    waited, worked = ([2.0, 2.0, 2.0, 32.0] * 10, [2.0] * 40)
    probe.rounds = [([waited, waited], [[waited, waited]])] * 2
    probe.solo_cpu_ms = [[worked, worked]] * 2
    assert probe.result().tail == 1.0  # in wall time: 4.75
    cold = [20.0] + [2.0] * 39  # a cold iteration of 20 ms: the pass's own cost, counted
    probe.solo_cpu_ms = [[cold, cold]] * 2
    assert probe.result().tail == pytest.approx(pass_tail(cold)) and pass_tail(cold) == pytest.approx(98 / 80)


@pytest.mark.slow
def test_a_window_no_iteration_fits_in_is_taken_again_longer(tmp_path, monkeypatch):
    """A rank that finishes no iteration in a window (here: the measurement processes run a model 0.4 s slower
    than the one calibration timed, as a host too loaded to run them would) gets a window twice as long."""
    from pipesim.calibrate import contention

    monkeypatch.setattr(contention, "WINDOW_S", 0.5)  # its first retake holds an iteration: one retake per window
    monkeypatch.setattr(contention, "MIN_ROUNDS", 1)  # a round's windows are retaken as any round's: one is enough
    (code, _, err), out = _calibrate_own_model(tmp_path, monkeypatch, "slow_in_child",
                                               "import multiprocessing, time\nfrom torch import nn\n"
                                               "class Slow(nn.Linear):\n"
                                               "    def forward(self, x):\n"
                                               "        if multiprocessing.parent_process() is not None:\n"
                                               "            time.sleep(0.4)\n"
                                               "        return super().forward(x)\n"
                                               "def build():\n"
                                               "    return nn.Sequential(Slow(8, 8), nn.ReLU(), nn.Linear(8, 2))\n")
    assert code == 0, err
    meta = load_profile(out).contention.meta
    assert meta["window_s"] == 0.5 and meta["windows_retaken"] and set(meta["windows_retaken"]) <= {0.5, 1.0}
    assert all(n >= 1 for by_count in meta["iterations"] for ns in by_count for n in ns)


def test_contention_is_measured_in_the_ranks_of_the_calibrated_models_run_before_it(monkeypatch):
    """`ContentionProbe.prelude`: the windows run in the executor's own rank processes, before their run (which
    then completes as without it), so the two share one start-up."""
    from pipesim.calibrate import contention
    from pipesim.calibrate.contention import ContentionProbe

    monkeypatch.setattr(contention, "WINDOW_S", 0.2)  # the parent sets the windows: shorter ones for a test
    from pipesim.calibrate.runtime import probe_schedule
    from pipesim.executor import Prelude, RunSpec, run_multiprocess
    from pipesim.traces.trace import Stream

    shipped = load_profile(PROFILE)  # its stages' times only size the windows: the tiny mlp's cut and batch
    profile = shipped.model_copy(update={
        "partition": shipped.partition.model_copy(update={"bounds": [0, 1, 3]}),
        "environment": shipped.environment.model_copy(update={"microbatch_size": 2, "threads": 1})})
    options = {"layers": 2, "width": 16}
    probe = ContentionProbe(profile, "mlp", options)
    prelude = probe.prelude()
    measured_in = []

    def parent(conns, procs):
        measured_in.extend(proc.name for proc in procs if proc.is_alive())
        prelude.parent(conns, procs)

    spec = RunSpec(probe_schedule(2, 4, 1), "mlp", options, microbatch_size=2, optimizer="sgd",
                   bounds=tuple(profile.partition.bounds), heldout=False)
    trace = run_multiprocess(spec, prelude=Prelude(prelude.rank, parent)).trace
    assert measured_in == ["pipesim-rank-0", "pipesim-rank-1"] and probe.done
    assert sum(trace.ops.stream == Stream.COMPUTE) == sum(map(len, spec.schedule.orders))  # every row ran
    contention = probe.result()
    assert contention.meta["processes_started"] == "the ranks of the run it preceded"
    assert len(contention.slowdown) == 2 and contention.slowdown[0] == 1.0
    assert all(n > 0 for windows in contention.meta["iterations"] for window in windows for n in window)


def test_collectives_beside_computing_ranks_take_as_long_as_the_calibration_measured(tmp_path):
    """DualPipe's REDUCE rows (each device's all-reduce of a stage with the other copy's device) run on the
    host's cores beside its ranks' compute: with the all-reduce measured 3x as long beside computing ranks,
    the step is longer; a profile without the measurement prices them as before."""
    beside = _with_contention(tmp_path, MEASURED, [1.0, 2.0, 3.0])
    assert profile_cluster(load_profile(beside), 4, overlap_comm=True).collective_contention == (1.0, 2.0, 3.0)
    args = ("-s", "dualpipe", "-p", "4", "-m", "8")
    (before,), (after,) = (simulate_json("--profile", _with_contention(tmp_path, MEASURED, factors), *args)
                           for factors in (None, [1.0, 2.0, 3.0]))  # each written, then simulated
    assert after["time_per_minibatch_ms"] > before["time_per_minibatch_ms"]


@pytest.mark.parametrize("beside,fragment", [
    ([1.2, 2.0, 3.0], "allreduce: beside_compute: one factor per count of computing ranks, 0 to world_size (2), the "
                      "first (none computing) 1.0; got [1.2, 2.0, 3.0]"),
    ([1.0, 2.0], "got [1.0, 2.0]"),
    ([1.0, 0.0, 3.0], "allreduce.beside_compute.1: Input should be greater than 0"),
])
def test_a_bad_collective_factor_is_one_line_exit_2(tmp_path, beside, fragment):
    result = pipesim("simulate", "--profile", _with_contention(tmp_path, MEASURED, beside), "-s", "dualpipe", "-p", "4")
    assert result.code == 2 and fragment in result.err and len(result.err.strip().splitlines()) == 1


def test_the_all_reduce_beside_compute_is_a_host_term_with_its_own_cache_conditions():
    profile = load_profile(GPT_CPU)
    cached = {"measured_at": "2026-01-01T00:00:00+00:00", "age_s": 3.0, "reused": True, "load": None}
    assert "all-reduce beside compute" not in profile.host_terms()  # measured before it had an entry of its own
    beside = profile.allreduce.model_copy(update={"meta": {**profile.allreduce.meta,
                                                           "beside_compute_host_cache": cached}})
    terms = profile.model_copy(update={"allreduce": beside}).host_terms()
    assert terms["all-reduce beside compute"] == cached  # when and under what load, as compare's conditions show
