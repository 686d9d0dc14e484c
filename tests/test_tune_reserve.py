"""tune reads each configuration's peak as simulate and sweep do, the caching allocator's reserve in
(`--allocator caching`, the default), so a configuration tune says fits is not out of memory in simulate."""

from __future__ import annotations

import pytest

from pipesim.units import MIB
from tests.conftest import pipesim
from tests.helpers import A100_GPT4 as MODEL
from tests.helpers import ONE_CONFIGURATION as ONE
from tests.helpers import searched_settings, simulated_peak_mib, tune_document, tuned_peak_mib


def test_tunes_peak_is_simulates_with_and_without_the_reserve():
    reserved, allocated = tuned_peak_mib(), tuned_peak_mib("--allocator", "none")
    assert reserved == pytest.approx(simulated_peak_mib())
    assert allocated == pytest.approx(simulated_peak_mib("--allocator", "none"))
    assert reserved > allocated  # the reserve is there to count


def test_a_cap_between_max_allocated_and_max_reserved_is_refused_as_simulate_marks_it():
    cap_gib = (tuned_peak_mib() + tuned_peak_mib("--allocator", "none")) / 2 / 1024
    code, _, err = pipesim("tune", *MODEL, *ONE, "--memory-gb", cap_gib)
    assert code == 2 and "no configuration fits" in err
    code, _, err = pipesim("tune", *MODEL, *ONE, "--memory-gb", cap_gib, "--allocator", "none")
    assert code == 0, err


def test_allocator_without_gpu_is_refused_in_one_line():
    code, _, err = pipesim("tune", "--profile", "traces/profiles/gpt-cpu.json", "--devices", 8, "--memory-gb", 0.3,
                           "--allocator", "none")
    assert code == 2 and "--allocator" in err and len(err.strip().splitlines()) == 1


@pytest.fixture(scope="module")
def small_gpt_settings():
    """The profiles `tune --gpu` searches for MODEL on 4 GPUs at b = 2, t = 1, no recomputation (one per p), their
    caching allocator's allocations replayed as simulate's."""
    captured = searched_settings("-D", 4, "-B", 32, "-b", 2, "--tensor-parallel", 1, "--recompute", "none")
    assert captured and all(setting.scenario.allocations is not None for setting in captured)
    return captured


def replaying_every_candidate(patch) -> None:
    """The search as it was before it replayed lazily: every candidate simulated has its reserve replayed at once."""
    from pipesim.planning import tune as tuning

    def floor(built, candidate, *beaten):
        if candidate.index not in built.floors:
            built.floors[candidate.index] = built.results[candidate.index] = tuning.evaluate(built.problem, candidate)
        return built.floors[candidate.index]

    patch.setattr(tuning._Built, "floor", floor)


def counting_replays(patch) -> list[int]:
    """Count the caching allocator's replays (one per candidate replayed) from now on."""
    from pipesim.planning import scenario

    replays = []
    real = scenario.Scenario.add_reserve

    def add_reserve(self, schedule, trace, *given):
        replays.append(self.allocations is not None)
        real(self, schedule, trace, *given)

    patch.setattr(scenario.Scenario, "add_reserve", add_reserve)
    return replays


def answer(tuning_found) -> dict:
    document = tuning_found.to_dict()
    del document["search"]["seconds"]
    return document


@pytest.mark.parametrize("cap_gib,max_staleness,workers", [(0.26, 0, 1), (0.35, 1, 1), (0.4, 0, 2)])
def test_replaying_only_the_results_the_answer_needs_gives_the_answer_of_replaying_every_one(
        small_gpt_settings, cap_gib, max_staleness, workers):
    """The caps cut between some configurations' max allocated and max reserved, and rule others out by their
    floor alone: the choice, runners-up, 'over' rows, staler winner, peaks and counts are the same (with
    workers too, which replay while the search goes on), and at the tightest cap fewer candidates are replayed
    than simulated."""
    from pipesim.planning import tune as tuning
    from pipesim.schedules import METHODS

    problem = tuning.Problem(4, int(cap_gib * tuning.GIB), 32, tuple(METHODS), max_staleness)
    with pytest.MonkeyPatch.context() as patch:
        replays = counting_replays(patch)
        lazy = tuning.tune(small_gpt_settings, problem, workers=workers)
        lazy_replays = sum(replays)
        replaying_every_candidate(patch)
        eager = tuning.tune(small_gpt_settings, problem, workers=workers)
    assert answer(lazy) == answer(eager)
    simulated = lazy.stats.simulated + lazy.stats.simulated_over_limits
    assert lazy_replays <= simulated and (cap_gib != 0.26 or lazy_replays < simulated)  # (workers' are not seen)


def test_the_json_is_the_one_replaying_every_candidate_gives():
    """The command line (its worker processes replay) prints what replaying every simulated candidate prints: the
    same answer, rows and counts, but for how the candidates split between pruned and simulated. Where a bound
    lies within rounding of its candidate's result (this small model's: least layer times), the lazy search may
    simulate one that replaying every candidate had pruned (8 against 7), never a different candidate set."""
    flags = (*MODEL, "--host-kernel-us", 0, "-D", 4, "-B", 16, "-b", 2, "--tensor-parallel", 1, "--memory-gb", 0.3,
             "--json")
    code, out, err = pipesim("tune", *flags)
    assert code == 0, err
    with pytest.MonkeyPatch.context() as patch:
        replaying_every_candidate(patch)
        code, eager, err = pipesim("tune", *flags)
    assert code == 0, err
    lazy, eager = tune_document(out), tune_document(eager)
    considered = [run["search"].pop("pruned") + run["search"].pop("simulated") for run in (lazy, eager)]
    assert lazy == eager and considered[0] == considered[1]


def test_a_candidate_is_simulated_on_the_links_its_schedule_has(small_gpt_settings):
    """The search looks an estimate's links up once per p and d: they are the ones each schedule's placement
    gives (`Scenario.links`), for every method."""
    from pipesim.planning import tune as tuning
    from pipesim.schedules import METHODS

    candidates, _, _ = tuning.prepare(small_gpt_settings, tuning.Problem(4, int(0.4 * tuning.GIB), 32, tuple(METHODS)))
    assert {c.config.stages for c in candidates} == {1, 2, 4}
    for candidate in candidates:
        assert candidate.links == candidate.setting.scenario.links(candidate.schedule), candidate.config.label()


def test_a_replay_reads_the_long_run_its_simulation_kept_and_gives_the_peak_simulating_with_the_reserve_gives(
        small_gpt_settings, monkeypatch):
    """A result's replay (`_Built.result`) adds the reserve to what its simulation kept of the long run (`_floor`),
    simulating nothing again, and gives the peak of simulating with the reserve at once (`evaluate`)."""
    from pipesim.planning import tune as tuning
    from pipesim.schedules import METHODS

    problem = tuning.Problem(4, int(0.4 * tuning.GIB), 32, tuple(METHODS))
    candidates = tuning.prepare(small_gpt_settings, problem)[0][::7]
    built = tuning._Built(problem, tuning._Orders())
    for candidate in candidates:
        built.floor(candidate)

    def simulated_again(*_):
        raise AssertionError("the replay simulated the long run again")

    monkeypatch.setattr(tuning, "simulate", simulated_again)
    peaks = [built.result(candidate).peak_memory_bytes for candidate in candidates]
    monkeypatch.undo()
    assert len({c.config.schedule for c in candidates}) > 3
    assert peaks == [tuning.evaluate(problem, candidate).peak_memory_bytes for candidate in candidates]


def test_the_replay_cuts_the_layers_where_the_candidate_cuts_them(small_gpt_settings):
    """A candidate's partition (searched under the memory cap) can differ from its profile's time-balanced cut
    (`Scenario.cut`): the reserve replayed is the one of the candidate's own cut, where its costs and memory are,
    both simulated at once (`evaluate`) and replayed later (`_Built.result`)."""
    from pipesim.planning import tune as tuning
    from pipesim.schedules import METHODS
    from pipesim.sim import simulate
    from pipesim.traces import summarize

    def peak_bytes(candidate, bounds) -> int:
        trace = simulate(candidate.schedule, candidate.costs, candidate.links)
        candidate.setting.scenario.add_reserve(candidate.schedule, trace, bounds)
        return round(summarize(trace).peak_memory_mb * MIB)

    problem = tuning.Problem(4, int(0.4 * tuning.GIB), 32, tuple(METHODS))
    cut_apart = [candidate for candidate in tuning.prepare(small_gpt_settings, problem)[0]
                 if candidate.bounds != candidate.setting.scenario.cut(candidate.schedule)]
    own = [peak_bytes(candidate, candidate.bounds) for candidate in cut_apart]
    balanced = [peak_bytes(candidate, candidate.setting.scenario.cut(candidate.schedule)) for candidate in cut_apart]
    assert own != balanced  # the two cuts' reserves differ here
    built = tuning._Built(problem, tuning._Orders())
    for candidate in cut_apart:
        built.floor(candidate)
    assert [tuning.evaluate(problem, candidate).peak_memory_bytes for candidate in cut_apart] == own
    assert [built.result(candidate).peak_memory_bytes for candidate in cut_apart] == own
