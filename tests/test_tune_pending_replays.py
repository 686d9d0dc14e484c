"""tune's search replays a result's caching allocator only where the bar it sets decides something
(`top_groups`' pending results): a slow result whose bound came up first, later put out of the groups kept by
faster ones, is never replayed (the 70B's three, 4 CPU s), and the groups kept are the ones replaying every result
gives."""

from __future__ import annotations

import math

import numpy as np
import pytest

from pipesim.planning import tune as tuning
from tests.helpers import two_stage_schedule


class _Search:
    """A search's `_Built` as `top_groups` reads it, one candidate at a time: each candidate's speed given (its peak
    without the reserve 0, with it its index), its replays counted in order."""

    window, parallel = 1, False

    def __init__(self, speeds: dict[int, float], replaying_every_result: bool = False) -> None:
        self.speeds, self.results, self.replayed = speeds, {}, []
        self.every = replaying_every_result

    def known(self, candidate):
        return candidate

    def ahead(self, *args) -> None:
        pass

    def submit(self, *args) -> None:
        pass

    def replay(self, candidate) -> None:
        pass

    def floor(self, candidate, beaten: float = -math.inf) -> tuning.Result:
        floor = tuning.Result(candidate, self.speeds[candidate.index], 1.0, 0.0, 0)
        return self.result(candidate) if self.every else floor

    def result(self, candidate) -> tuning.Result:
        if candidate.index not in self.results:
            self.replayed.append(candidate.index)
            self.results[candidate.index] = tuning.Result(candidate, self.speeds[candidate.index], 1.0, 0.0,
                                                          candidate.index)
        return self.results[candidate.index]


def _candidate(index: int, bound: float) -> tuning.Candidate:
    """A flushing candidate bounded by `bound` samples/s, its critical path read (`top_groups` simulates it next)."""
    schedule = two_stage_schedule("0F0 0B0 0OPT", "1F0 1B0 1OPT")
    return tuning.Candidate(tuning.Config("1f1b", 2, 1, 1, 1, 1), None, index, None, [0, 1, 2], schedule, 0, None,
                            None, 0, np.zeros(2), 0, 0.0, bound, None, critical=True)


@pytest.mark.parametrize("groups", [1, 2, 3])
def test_slow_results_whose_bounds_came_first_are_put_out_unreplayed(groups):
    """Bounds 100-97 come first, the results 10, 11 (slow) then 30, 31; the bounds 20 and 5 after: the groups kept
    are the fastest `groups` of them, as replaying every result keeps them, and only the results that can still rank
    among them when the bar decides are replayed: at `groups` = 2, 31 and 30 alone, where replaying each as it came
    replayed all four. (At 1, 30 is replayed before 31 is in: the bound 20 comes up while 31 is still out.)"""
    bounds = {0: 100.0, 1: 99.0, 2: 98.0, 3: 97.0, 4: 20.0, 5: 5.0}
    speeds = {0: 10.0, 1: 11.0, 2: 30.0, 3: 31.0, 4: 19.0, 5: 4.0}
    candidates = [_candidate(index, bound) for index, bound in bounds.items()]
    kept = {}
    for every in (False, True):
        search = _Search(speeds, replaying_every_result=every)
        found, _ = tuning.top_groups(candidates, search, lambda item: True, lambda result: True, -math.inf,
                                     groups=groups)
        kept[every] = [[result.candidate.index for result in group] for group in found]
        replayed = search.replayed
    assert kept[False] == kept[True] == [[3], [2], [4]][:groups]
    assert replayed == [0, 1, 2, 3, 4][:4 + (groups == 3)]  # every one simulated, before the bar stops the search
    search = _Search(speeds)
    tuning.top_groups(candidates, search, lambda item: True, lambda result: True, -math.inf, groups=groups)
    # where the bar decides (the bound 20 or 5 comes up), the results that can still set it, fastest first: 10 never
    assert search.replayed == {1: [2, 3], 2: [3, 2], 3: [3, 2, 1, 4]}[groups]
