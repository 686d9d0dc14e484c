"""`--stage-cut fit`: the cut balanced for time within each device's memory (planning/scenario.py `Scenario.cut`,
profiles/partition.py `mirrored_partition`), held against every cut of small problems and against the simulator's
peaks where the time-balanced cut does not fit."""

from __future__ import annotations

import itertools
import json
import math

import numpy as np
import pytest

from pipesim.planning import scenario
from pipesim.planning.scenario import _held_together, _outermost
from pipesim.profiles.partition import LayerCost, PartitionError, mirrored_partition, ranges, searched_partition
from pipesim.schedules import ScheduleParams, build_schedule
from pipesim.sim import Costs
from tests.conftest import build, flags_with, pipesim, simulate_json, simulated

# A 40 GB A100 and a GPT whose stages' activations, held as the schedule holds them, outgrow it where the cut is
# balanced for time alone (the head's stage is slow, so the first stages take more layers)
GPT = ("--model", "gpt", "--layers", 8, "--width", 4096, "--heads", 32, "--seq-len", 2048, "--vocab", 50304,
       "--gpu", "a100-sxm-40gb", "-p", 4, "-m", 8)


def _fullest_pair(cut: list[tuple[int, int]], stage_bytes: list[np.ndarray]) -> float:
    """The most any device holds where stage k and stages-1-k share one (the middle of an odd count alone)."""
    stages = len(cut)
    return max(stage_bytes[k][cut[k]] + (stage_bytes[stages - 1 - k][cut[stages - 1 - k]] if 2 * k + 1 != stages
                                         else 0) for k in range((stages + 1) // 2))


def _fastest_fitting(n: int, stages: int, ms: np.ndarray, stage_bytes: list[np.ndarray], cap: float) -> float:
    """Every cut tried: the least slowest stage of those that fit."""
    cuts = [list(zip((0, *inner), (*inner, n))) for inner in itertools.combinations(range(1, n), stages - 1)]
    return min((max(ms[i, j] for i, j in cut) for cut in cuts if _fullest_pair(cut, stage_bytes) <= cap),
               default=math.inf)


def test_the_mirrored_cut_is_the_fastest_of_every_cut_that_fits():
    """Random layers on 1 to 5 stages, stage k and stages-1-k on one device (DualPipe's placement, one stage alone
    in the middle): the cut found is as fast as the fastest of all that fit, and fits; none fits, refused."""
    rng = np.random.default_rng(7)
    for _ in range(120):
        n = int(rng.integers(2, 8))
        stages = int(rng.integers(1, min(n, 5) + 1))
        ms = ranges(np.concatenate([[0.0], np.cumsum(rng.integers(1, 5, n))]))
        ms[np.tri(n + 1, dtype=bool)] = math.inf  # no empty or reversed range
        stage_bytes = [ranges(np.concatenate([[0], np.cumsum(rng.integers(1, 5, n))])) * int(rng.integers(1, 4))
                       for _ in range(stages)]
        cap = float(rng.integers(5, 30))
        none = np.zeros_like(stage_bytes[0])

        def pair_bytes(k: int) -> list:
            back = stages - 1 - k
            return [(stage_bytes[k], stage_bytes[back] if back != k else none, cap)]

        want = _fastest_fitting(n, stages, ms, stage_bytes, cap)
        if want == math.inf:
            with pytest.raises(PartitionError, match=f"no cut of {n} layers into {stages} stages fits"):
                mirrored_partition([LayerCost(0.0, 0, 0)] * n, stages, pair_bytes, lambda k: ms)
            continue
        cut = mirrored_partition([LayerCost(0.0, 0, 0)] * n, stages, pair_bytes, lambda k: ms)
        assert cut[0] == 0 and cut[-1] == n and len(cut) == stages + 1 and all(np.diff(cut) > 0)
        assert max(ms[i, j] for i, j in itertools.pairwise(cut)) == want
        assert _fullest_pair(list(itertools.pairwise(cut)), stage_bytes) <= cap


def test_the_searched_cut_is_the_fastest_of_every_cut_that_fits():
    """Random layers on 2 to 6 stages, device d holding stages d, d + 2, d + 4, ... (interleaved chunks on 2
    devices): the cut found is as fast as the fastest of all that fit, and fits; none fits, None."""
    rng = np.random.default_rng(11)
    for _ in range(120):
        n = int(rng.integers(2, 9))
        stages = int(rng.integers(2, min(n, 6) + 1))
        layers = [LayerCost(float(ms), 0, 0) for ms in rng.integers(1, 5, n)]
        weight = ranges(np.concatenate([[0], np.cumsum(rng.integers(1, 5, n))]))
        held = [weight * int(rng.integers(1, 4)) for _ in range(stages)]
        cap = float(rng.integers(8, 40))

        def fullest(bounds: list[int]) -> float:  # the fuller device, with the stages cut so far
            cut = list(itertools.pairwise(bounds))
            return max(sum(held[k][cut[k]] for k in range(device, len(cut), 2)) for device in (0, 1))

        ms = ranges(np.concatenate([[0.0], np.cumsum([layer.ms for layer in layers])]))
        cuts = [[0, *inner, n] for inner in itertools.combinations(range(1, n), stages - 1)]
        fitting = [max(ms[i, j] for i, j in itertools.pairwise(cut)) for cut in cuts if fullest(cut) <= cap]
        found = searched_partition(layers, stages, lambda bounds: fullest(bounds) <= cap)
        if not fitting:
            assert found is None
            continue
        assert found is not None and fullest(found) <= cap and len(found) == stages + 1
        assert max(ms[i, j] for i, j in itertools.pairwise(found)) == min(fitting)


def test_where_the_search_is_too_long_fit_takes_the_fastest_cut_whose_devices_hold_their_stages(monkeypatch):
    """Interleaved chunks on 2 devices (device d: stages d and d + 2), 8 layers of 1 ms; stages 0 and 1 hold 3 GB
    a layer, 2 and 3 one, and a device holds the fuller of its two (their peaks do not coincide), 4 at most. The
    search too long, each stage within a share of its device (equal, or as the balanced cut holds them) leaves
    stage 0 or 2 no layer: no cut. Each within its device's whole memory, the fastest cut (stages 0 and 1 a layer
    each, 2 and 3 three) holds 3 GB on each device, and fit takes it, as tune's partitioner does (db4587b)."""
    monkeypatch.setattr(scenario, "searched_partition", lambda *args, **kwargs: None)
    sched = build_schedule("interleaved-1f1b", ScheduleParams(stages=2, microbatches=4, chunks=2))
    per_layer_gb, layer_count, ms = [3, 3, 1, 1], ranges(np.arange(9)), ranges(np.arange(9.0))

    class Memory:
        def stage(self, sched, s: int) -> np.ndarray:
            return per_layer_gb[s] * layer_count

        def device(self, sched, d: int, cut: list[int]) -> float:
            return max(self.stage(sched, s)[cut[s], cut[s + 1]] for s in sched.stages_on(d))

    cut = scenario.fitted_cut(sched, Memory(), [4, 4], [0, 5, 6, 7, 8], [LayerCost(1.0, 0, 0)] * 8, lambda k: ms)
    assert max(Memory().device(sched, d, cut) for d in (0, 1)) <= 4
    assert max(ms[i, j] for i, j in itertools.pairwise(cut)) == 3.0


@pytest.mark.parametrize(("name", "chunks"), [("interleaved-1f1b", 2), ("dualpipe", None), ("zb-v", None)])
def test_the_micro_batches_a_device_holds_together_are_the_simulators(name, chunks):
    """Each stage's activations a different size: a device's peak is the most its stages' counts held at once
    weigh (`_held_together`: a split backward's from I until W apart), below the sum of each stage's own most where
    they do not coincide."""
    sched = build(name, 4, 8, **({"chunks": chunks} if chunks else {}))
    activation_mb = [1.0 + 0.37 * s for s in range(sched.num_stages)]
    summary = simulated(sched, activation_mb=activation_mb).summary
    for device, together in enumerate(_held_together(sched)):
        stages = sched.stages_on(device)  # from F, then from I until W: half of them (kept not known)
        saved = np.array([activation_mb[s] * share for share in (1.0, Costs.wgrad_activation_fraction)
                          for s in stages])
        assert summary.devices[device].peak_memory_mb == pytest.approx(np.max(together @ saved), rel=1e-6)
        assert np.max(together @ saved) <= together.max(axis=0) @ saved
    together = _held_together(build("interleaved-1f1b", 4, 8, chunks=2))[0]
    assert np.max(together.sum(axis=1)) < together.max(axis=0).sum()  # the chunks' peaks do not coincide


def _peaks(result: dict) -> tuple[list[float], list[float]]:
    return ([device["peak_memory_mb"] for device in result["devices"]],
            [device["memory_limit_mb"] for device in result["devices"]])


@pytest.mark.parametrize("args", [("-b", 8, "-s", "1f1b"), ("-b", 4, "-s", "dualpipe"),
                                  ("-b", 5, "-s", "interleaved-1f1b", "--chunks", 2)])
def test_fit_cuts_within_every_devices_memory_where_the_balanced_cut_does_not(args):
    """1F1B (a stage a device), DualPipe (stage k of one copy beside p-1-k of the other on device k) and
    interleaved 1F1B (device d's chunks d and d + 4): the time-balanced cut runs a device out of its 40 GB, the
    fitted one keeps every device within it."""
    args = (*GPT, *args)
    (balanced,) = simulate_json(*args)
    (fitted,) = simulate_json(*args, "--stage-cut", "fit")
    peaks, limits = _peaks(balanced)
    assert any(peak > limit for peak, limit in zip(peaks, limits))
    peaks, limits = _peaks(fitted)
    assert all(peak <= limit for peak, limit in zip(peaks, limits))
    assert fitted["stage_bounds"] != balanced["stage_bounds"]
    assert balanced["stage_bounds"][0] == 0 and balanced["stage_bounds"][-1] == fitted["stage_bounds"][-1] == 10


def test_fit_holds_what_a_split_backward_keeps_from_i_until_w():
    """Under full recomputation a micro-batch's activations are its layers' inputs, while ZB-H1's W reads its
    products' saved inputs and output gradients, held from I until W (sim/costs.py `wgrad_held`). Counted as the
    activations, fit cut [0, 3, 5, 7, 10], whose last device holds 49,226 MiB in 40 GB; counted as the simulator
    holds them, the cut takes blocks off the last stage until every device fits. The faster cut with one block
    beside the head does not: the caching allocator's replay of its last device, holding from I until W what the
    simulation holds (the head's output gradients, 1.5 GiB a micro-batch, among its float32 logits' 3 GiB blocks),
    reserves 10.7 GiB beyond what it allocates, so the head is left alone."""
    args = (*GPT, "-b", 8, "-s", "zb-h1", "--recompute", "full")
    (counted_as_activations,) = simulate_json(*args, "--stage-cut", "first-last:2,2")
    assert counted_as_activations["stage_bounds"] == [0, 3, 5, 7, 10]
    peaks, limits = _peaks(counted_as_activations)
    assert peaks[3] > limits[3]
    (fitted,) = simulate_json(*args, "--stage-cut", "fit")
    assert fitted["stage_bounds"] == [0, 3, 6, 9, 10]
    assert all(peak <= limit for peak, limit in zip(*_peaks(fitted)))
    (block_beside_head,) = simulate_json(*args, "--stage-cut", "first-last:1,1")
    assert block_beside_head["stage_bounds"] == [0, 2, 5, 8, 10]
    assert block_beside_head["time_per_minibatch_ms"] < fitted["time_per_minibatch_ms"]
    peaks, limits = _peaks(block_beside_head)
    assert peaks[3] > limits[3]


def test_the_table_says_which_cut_fit_chose():
    args = (*GPT, "-b", 4, "-s", "dualpipe", "--stage-cut", "fit")
    (fitted,) = simulate_json(*args)
    code, out, err = pipesim("simulate", *args)
    held = "/".join(str(stop - start) for start, stop in itertools.pairwise(fitted["stage_bounds"]))
    assert code == 0, err
    assert f"layers a model stage, cut for time within each device's memory (--stage-cut fit): dualpipe {held};" in (
        " ".join(out.split()))


@pytest.mark.parametrize("args", [
    ("-b", 2, "-s", "dualpipe"),
    # device 0's two chunks hold their most micro-batches at different times: 38,376 MiB in 40 GB, which each
    # chunk's own most summed (42,838 MiB) would not fit
    ("-b", 4, "-s", "interleaved-1f1b", "--chunks", 2, "--seq-len", 2176),
])
def test_fit_keeps_the_balanced_cut_where_it_fits(args):
    (balanced,) = simulate_json(*flags_with(GPT, *args))
    (fitted,) = simulate_json(*flags_with(GPT, *args), "--stage-cut", "fit")
    assert all(peak <= limit for peak, limit in zip(*_peaks(balanced)))
    assert fitted["stage_bounds"] == balanced["stage_bounds"]
    assert fitted["time_per_minibatch_ms"] == balanced["time_per_minibatch_ms"]


@pytest.mark.parametrize(("args", "message"), [
    (("-b", 8, "-s", "dualpipe"), "dualpipe: --stage-cut fit: no cut of 10 layers into 4 stages fits every "
                                  "device's memory"),
    (("-b", 8, "-s", "interleaved-1f1b", "--chunks", 2), "interleaved-1f1b: --stage-cut fit: no cut of 10 layers "
                                                         "into 8 stages found that fits every device's memory"),
    (("-b", 4, "-s", "1f1b", "--pp-runtime", "torch"), "the receive buffers --pp-runtime torch keeps are not "
                                                       "counted: use --stage-cut balanced"),
    (("-b", 4, "-s", "graphpipe"), "graphpipe builds its schedule for the cut: use --stage-cut balanced"),
])
def test_fit_refuses_in_one_line(args, message):
    code, out, err = pipesim("simulate", *GPT, *args, "--stage-cut", "fit")
    assert code == 2 and not out and err.count("\n") == 1 and message in err, err


def test_a_sweep_refuses_fit_beside_torchs_runtime_once_and_writes_nothing(tmp_path):
    """Every configuration's cut would refuse it: the flags are refused in one line, not each row skipped."""
    path = tmp_path / "sweep.csv"
    code, out, err = pipesim("sweep", *GPT, "-b", 4, "--stage-cut", "fit", "--pp-runtime", "torch", "-o", path)
    assert code == 2 and not out and not path.exists()
    assert err.strip() == ("error: --stage-cut fit counts the transfers pipesim's runtime holds; the receive buffers "
                           "--pp-runtime torch keeps are not counted: use --stage-cut balanced")


def test_a_method_skipped_for_no_fitting_cut_is_named_once():
    code, out, err = pipesim("simulate", *GPT, "-b", 8, "-s", "dualpipe", "-s", "1f1b", "--stage-cut", "fit")
    assert code == 0, err
    assert "skipped: dualpipe: --stage-cut fit: no cut of 10 layers into 4 stages fits" in " ".join(err.split())


def test_fit_searches_its_cut_once_per_simulated_method(monkeypatch):
    """The costs, the reserve and simulate's JSON each take the cut (sweep's costs and reserve without it handed
    over): the search runs once a schedule all the same."""
    from pipesim.planning import scenario

    searched = []

    def counted(sched, *args):
        searched.append(sched.method)
        return fitted_cut(sched, *args)

    fitted_cut = scenario.fitted_cut
    monkeypatch.setattr(scenario, "fitted_cut", counted)
    simulate_json(*GPT, "-b", 8, "-s", "1f1b", "-s", "zb-h1", "--stage-cut", "fit")
    assert searched == ["1f1b", "zb-h1"]
    searched.clear()
    code, _, err = pipesim("sweep", *GPT[:-4], "-b", 8, "--stages", 4, "--microbatches", 8, "--schedule", "1f1b",
                           "--stage-cut", "fit", "--workers", 1)
    assert code == 0 and searched == ["1f1b"], err


def test_fit_holds_a_mirrored_pair_where_its_stages_peaks_coincide(monkeypatch, tmp_path):
    """DualPipe on 4 devices, no allocator reserve: device 0's stages 0 and 7 hold their most micro-batches at
    different times, so the cut [0, 2, 4, 6, 10] that each stage's own peak summed puts over 40 GB (what fit cut
    by until now, choosing [0, 1, 3, 5, 10] at 1,337 ms) fits as simulated (40,420 MiB of the datasheet's 40,960;
    torch is given 40,339 of it, where the catalogue's part takes the other cut), and fit takes it."""
    from pipesim.planning import scenario
    from tests.helpers import datasheet_part

    seen = []

    def kept(sched, memory, limits, *args):
        seen.append((sched, memory, limits))
        return fitted_cut(sched, memory, limits, *args)

    fitted_cut = scenario.fitted_cut
    monkeypatch.setattr(scenario, "fitted_cut", kept)
    (fitted,) = simulate_json(*GPT[:12], *datasheet_part(tmp_path, "a100-sxm-40gb"), *GPT[14:], "-b", 4,
                              "-s", "dualpipe", "--allocator", "none", "--stage-cut", "fit")
    assert fitted["stage_bounds"] == [0, 2, 4, 6, 10] and fitted["time_per_minibatch_ms"] < 1337
    assert all(peak <= limit for peak, limit in zip(*_peaks(fitted)))
    (sched, memory, limits), cut = seen[0], fitted["stage_bounds"]
    summed = sum(memory.stage(sched, s)[cut[s % 4], cut[s % 4 + 1]] for s in sched.stages_on(0))
    assert summed > limits[0] >= memory.device(sched, 0, cut)


@pytest.mark.parametrize("seed", range(4))
def test_the_cut_fit_picks_runs_within_every_devices_memory(seed):
    """Drawn GPTs, micro-batch sizes and allocators, each on the schedules that hold a stage, a mirrored pair or
    interleaved chunks a device: where fit picks a cut, every device's simulated peak (the allocator's reserve
    included) is within its 39.39 GiB (the A100 40GB's device memory); otherwise it says no cut fits."""
    rng = np.random.default_rng(seed)
    args = (*GPT[:8], "--seq-len", int(rng.choice([1024, 2048])), *GPT[10:], "-b", int(rng.integers(2, 7)),
            "--allocator", str(rng.choice(["caching", "none"])), "--stage-cut", "fit")
    schedules = ("1f1b", "dualpipe", "dualpipev", "zb-v", "interleaved-1f1b")
    code, out, err = pipesim("simulate", *args, *(flag for name in schedules for flag in ("-s", name)), "--json")
    assert code == 0, err
    results = json.loads(out)["results"]
    assert len(results) + " ".join(err.split()).count("--stage-cut fit: no cut") == len(schedules), err
    for result in results:
        assert all(peak <= limit for peak, limit in zip(*_peaks(result))), (args, result["schedule"])


def test_the_counts_kept_weigh_the_most_any_count_does():
    """`_outermost` drops a count a mix of two others holds at every column (DualPipe's device 7 of DeepSeek-V3:
    4 from I until W each, then 2 and 2 of each kind, halfway to 9 and 8 from F), and for any bytes a column weighs
    (never negative) the most a kept row weighs is the most any row does."""
    assert _outermost(np.array([[0, 0, 4, 4], [2, 2, 2, 2], [9, 8, 0, 0]])).tolist() == [[0, 0, 4, 4], [9, 8, 0, 0]]
    rng = np.random.default_rng(3)
    for _ in range(200):
        counts = np.unique(rng.integers(0, 6, (int(rng.integers(1, 12)), int(rng.integers(1, 5)))), axis=0)
        kept = _outermost(counts)
        assert {tuple(row) for row in kept} <= {tuple(row) for row in counts}
        for weights in rng.random((20, counts.shape[1])) * rng.integers(0, 2, (20, counts.shape[1])):
            assert np.max(kept @ weights) == pytest.approx(np.max(counts @ weights), rel=1e-12)
