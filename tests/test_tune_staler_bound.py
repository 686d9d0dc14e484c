"""tune's staleness note (planning/tune.py `_staler`): where the rows over a limit hold no stale configuration, the
stale candidates are searched best bound first only up to the first that beats the choice within the cap; the note
names it, exact, and where an unsimulated stale candidate's bound is higher, says how much more the limit may cost
by that bound; where none is, the figure is the fastest's and the note has no "up to"."""

from dataclasses import replace

import pytest

from pipesim.planning import tune as tuning
from pipesim.traces.metrics import percent_text, rate_text
from tests.helpers import differences, exhaustive, gpt_on_8

LOOSE = 1e6  # samples/s: a bound no candidate reaches, so still a bound


def _loosened(monkeypatch, label: str) -> None:
    """The candidate `label` bounded by LOOSE instead of its own bounds, as built and once its critical path is in:
    searched first wherever it is eligible."""
    candidate, tighten = tuning._Built.candidate, tuning._Built.tighten

    def loose(built, made):
        if made is not None and made.config.label() == label:
            made = built.candidates[made.index] = replace(made, max_samples_per_s=LOOSE)
        return made

    monkeypatch.setattr(tuning._Built, "candidate", lambda built, shape: loose(built, candidate(built, shape)))
    monkeypatch.setattr(tuning._Built, "tighten", lambda built, made: loose(built, tighten(built, made)))


@pytest.fixture(scope="module")
def searched_exhaustively() -> tuple:
    """The small GPT on 8 devices of 0.2 GiB, its settings and problem, and its exhaustive search (`exhaustive`:
    every candidate simulated, the answer held at the unpatched RUNNERS_UP), made once for the module's tests,
    where each simulated every candidate again."""
    settings, problem = gpt_on_8(0.2)
    return settings, problem, exhaustive(settings, problem)


@pytest.mark.parametrize("workers", [1, 2])
def test_the_note_stops_at_the_first_stale_configuration_that_beats_the_choice_and_gives_the_bound_left(
        monkeypatch, workers, searched_exhaustively):
    """The small GPT on 8 devices of 0.2 GiB: five stale configurations at p = 4 and five at p = 8 beat 1F1B p = 4,
    and the fastest rows over a limit are interleaved ones over the cap. One row over a limit shown (not five),
    SpecTrain p = 8, the slowest stale one that beats the choice, bounded loosely, comes first: the note names it
    at its simulated speed, and says the limit may cost up to the bound of PipeDream p = 4 and the rest; the same
    with two worker processes, whose results are taken in the order popped."""
    settings, problem, (best, faster, staler, _) = searched_exhaustively
    slowest = staler[-1][0]
    assert slowest.config.label() == "spectrain p=8" and staler[0][0].config.label() == "pipedream p=4"
    monkeypatch.setattr(tuning, "RUNNERS_UP", 1)
    _loosened(monkeypatch, "spectrain p=8")
    found = tuning.tune(settings, problem, workers=workers)
    assert differences(found, best, faster[:1], staler) == []
    assert found.staler.result.config.label() == "spectrain p=8"
    assert found.staler.result.samples_per_s == slowest.samples_per_s  # simulated: exact
    bound = found.staler_bound
    assert bound is not None and bound.max_samples_per_s >= staler[0][0].samples_per_s > slowest.samples_per_s
    choice = found.choice.result.samples_per_s
    gain, most = slowest.samples_per_s / choice - 1, bound.max_samples_per_s / choice - 1
    note = next(n for n in found.notes if "--max-staleness" in n)
    assert note.startswith(f"at staleness 1, spectrain p=8 fits and gives {rate_text(slowest.samples_per_s)} "
                           f"samples/s, {percent_text(gain)} ") and most > gain
    assert f"more than 1f1b p=4, up to {percent_text(most)} more by the bounds of the {bound.configurations} stale " \
           "configurations not simulated; it trains on stale weights" in note, note
    document = found.to_dict()["staler_winner"]
    assert document["bound_samples_per_s"] == bound.max_samples_per_s >= document["samples_per_s"]
    assert document["bound_configurations"] == bound.configurations > 0


def test_the_note_is_exact_where_nothing_unsimulated_could_beat_the_configuration_it_names(monkeypatch,
                                                                                          searched_exhaustively):
    """The same problem with one row over a limit shown and the bounds as they are: the note's search stops at
    PipeDream p = 4, the fastest; its twin PipeDream-2BW p = 4, bounded a billionth over it, is a tie, not a
    higher bound: no "up to", and the JSON's bound is null. The twin is not simulated, so not listed."""
    settings, problem, (best, faster, staler, _) = searched_exhaustively
    monkeypatch.setattr(tuning, "RUNNERS_UP", 1)
    found = tuning.tune(settings, problem)
    assert differences(found, best, faster[:1], staler) == []
    assert found.staler.result.config.label() == "pipedream p=4" and found.staler_bound is None
    assert found.staler.twins == []
    note = next(n for n in found.notes if "--max-staleness" in n)
    assert note.startswith("at staleness 1, pipedream p=4 fits and gives 8.63 samples/s") and "up to" not in note
    assert found.to_dict()["staler_winner"]["bound_samples_per_s"] is None
