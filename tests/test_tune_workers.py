"""tune --gpu starts its search's worker processes before it estimates its profiles, so that they start on the core
the estimates leave idle (planning/tune.py `start_workers`), with their cycle collector held off; the search and
its answer are those of workers started by the search, and the answer that of a search without workers."""

import gc
import json
import os

from pipesim.commands import tune as command
from pipesim.planning import tune as planning
from tests.conftest import pipesim

SMALL = ("tune", "--gpu", "h100-sxm", "--model", "gpt", "--layers", 4, "--width", 64, "--heads", 4, "--seq-len", 32,
         "--vocab", 1000, "-D", 8, "-b", 1, "--json")


def _document(out: str) -> dict:
    """The JSON document less the search's seconds, which no two runs share."""
    document = json.loads(out)
    del document["search"]["seconds"]
    return document


def test_tune_starts_its_workers_before_its_estimates_and_answers_as_without_them(monkeypatch):
    events = []
    start, estimated = planning.start_workers, command._estimated_settings

    def started(workers):
        events.append(("workers", workers))
        return start(workers)

    def refused_once(workers):
        """None the first time, as the command did before it started its workers: the search starts them."""
        events.append(("workers", workers))
        return start(workers) if len(events) > 1 else None

    def estimating(*args, **kwargs):
        events.append(("estimates",))
        return estimated(*args, **kwargs)

    monkeypatch.setattr(command, "_estimated_settings", estimating)
    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    monkeypatch.setattr(planning, "start_workers", started)
    code, early, err = pipesim(*SMALL)
    assert code == 0, err
    assert events == [("workers", 2), ("estimates",)]
    events.clear()
    monkeypatch.setattr(planning, "start_workers", refused_once)
    code, late, err = pipesim(*SMALL)
    assert code == 0, err
    assert events == [("workers", 2), ("estimates",), ("workers", 2)]
    assert _document(early) == _document(late)
    monkeypatch.setattr(os, "cpu_count", lambda: 1)
    code, alone, err = pipesim(*SMALL)
    assert code == 0, err
    # What the search built depends on how many candidates its workers take at once; its answer does not.
    assert {**_document(early), "search": None} == {**_document(alone), "search": None}


def test_the_search_workers_hold_their_cycle_collector_off():
    pool = planning.start_workers(2)
    try:
        assert [pool.submit(gc.isenabled).result() for _ in range(4)] == [False] * 4
    finally:
        pool.shutdown()
    assert planning.start_workers(1) is None
