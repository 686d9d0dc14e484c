"""tune's later passes (what beats the choice over a limit, and the staler note) search the stale candidates only once
the choice is known; idle workers in the first pass take their critical paths, simulations and replays ahead
(planning/tune.py `_Built.ahead_of_staler`), which the later passes read when they come to them: the same answer and
counts as without them."""

import os

from pipesim.planning import tune as planning
from tests.conftest import pipesim
from tests.helpers import GPT_CPU as GPT
from tests.helpers import tune_document

NOTED = ("tune", "--profile", str(GPT), "--devices", 8, "--memory-gb", 0.3, "--json")  # PipeDream p = 2 is noted


def test_the_later_passes_read_the_stale_candidates_simulated_ahead_and_answer_as_without(monkeypatch):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(2)))
    floor, ahead_of_staler = planning._Built.floor, planning._Built.ahead_of_staler
    taken = []

    def reading(self, candidate, *beaten):
        if candidate.staleness > self.problem.max_staleness:
            running = self._simulating.get(candidate.index)
            taken.append(running is not None and running.done())
        return floor(self, candidate, *beaten)

    def waiting_for_workers(self, beaten):
        ahead_of_staler(self, beaten)
        for running in list(self._running):  # each step done before the search goes on: the later passes find them
            running.result()

    monkeypatch.setattr(planning._Built, "floor", reading)
    monkeypatch.setattr(planning._Built, "ahead_of_staler", waiting_for_workers)
    code, ahead, err = pipesim(*NOTED)
    assert code == 0, err
    assert any(taken), taken
    monkeypatch.setattr(planning._Built, "ahead_of_staler", lambda self, beaten: None)
    code, alone, err = pipesim(*NOTED)
    assert code == 0, err
    assert tune_document(ahead) == tune_document(alone) and tune_document(alone)["staler_winner"] is not None
