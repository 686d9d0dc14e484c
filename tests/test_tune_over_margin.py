"""tune's rows over the limits (planning/tune.py OVER_MARGIN): a configuration over a limit that could beat the
choice by no more than the margin is not simulated to show what the limits cost; it is counted, in a note and in
the JSON's `over_within_margin`, and neither a row nor the staleness note names it."""

from pipesim.planning import tune as tuning
from tests.helpers import differences, exhaustive, gpt_on_8


def _stale_simulations(monkeypatch, limit: int) -> list[str]:
    """The labels of the candidates over the staleness limit simulated from now on (one process: `_floor` here)."""
    simulated, floor = [], tuning._floor

    def counted(problem, candidate, beaten):
        if candidate.staleness > limit:
            simulated.append(candidate.config.label())
        return floor(problem, candidate, beaten)

    monkeypatch.setattr(tuning, "_floor", counted)
    return simulated


def test_what_could_beat_the_choice_by_no_more_than_the_margin_is_counted_not_simulated(monkeypatch):
    """The small GPT on 8 devices of 0.2 GiB: ten stale configurations beat 1F1B p = 4, by 13 % and more. With
    the margin as it is they are rows (and the staleness note's) and stale candidates are simulated; with a
    margin over every bound, none is simulated, no row over a limit is shown, no staleness note is given, and
    every one of them is counted, by its bound, in one note and the JSON."""
    settings, problem = gpt_on_8(0.2)
    stale = _stale_simulations(monkeypatch, problem.max_staleness)
    found = tuning.tune(settings, problem)
    assert found.excluded and found.staler is not None and stale and found.over_within_margin == 0
    assert not any("might beat the choice" in note for note in found.notes)

    monkeypatch.setattr(tuning, "OVER_MARGIN", 100.0)  # 10,000 %: over every bound
    best, faster, staler, results = exhaustive(settings, problem)
    assert faster == [] and staler == []
    choice = tuning.speed_key(best[0][0].samples_per_s)
    over = [r for r in results if not tuning.allowed(r, problem) and tuning.speed_key(r.samples_per_s) > choice
            and r.candidate.memory_floor_bytes <= problem.memory_cap_bytes]
    assert len(over) >= 10
    stale.clear()
    found = tuning.tune(settings, problem)
    assert differences(found, best, faster, staler) == []
    assert stale == [] and found.stats.simulated_over_limits == 0  # counted by their bounds alone
    assert found.excluded == [] and found.staler is None
    counted = found.over_within_margin
    assert counted >= len(over)
    assert f"{counted} more configurations over the limits might beat the choice by at most 10,000% (by their " \
           "bounds; not shown)" in found.notes
    assert not any("--max-staleness" in note for note in found.notes)
    assert found.to_dict()["over_within_margin"] == counted
