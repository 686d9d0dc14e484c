"""auto's search held against digests recorded from the search before it was made faster (tests/auto_digests.json),
so a faster search that changes one pattern, one finish time's last bit or one choice fails here. On a grid of
random pipelines (uneven and tied costs, zero transfers and W's, limits from R = 1 to none, one device capped by
its memory) and three searches of tune's 70B Llama (`recorded`): the list scheduler's pattern at every variant of
`_GRID`, each pattern's finish times and peaks, the fixed orders' finish times, and the pattern the whole search
returns; and on pipelines with free ops (`free_ops`), the list scheduler's pattern at random knobs. Recorded on
planning/auto.py as of d918cba with
`python -c "import json, tests.test_auto_digests as t; json.dump(t.digests(), open(t.RECORDED, 'w'), indent=0)"`.
"""

import hashlib
import json
import math
import random
from dataclasses import replace
from pathlib import Path

import pytest

from pipesim.planning.auto import (
    _F,
    _GRID,
    _I,
    _STEADY,
    Knobs,
    StageTimes,
    _fixed_patterns,
    _greedy,
    best_pattern,
    finish_ms,
    forget_searches,
    one_f_one_b_peak,
    peak_bytes,
)

RECORDED = Path(__file__).with_name("auto_digests.json")
PIPELINES = 48
# Pipelines where some F or I takes no time, so a device's output arrives as it decides and the order in which
# devices decide at equal times shows (the old code run on 1272's knobs differs if a device waiting for an arrival
# at the time another device is due decides first).
FREE_OPS = range(1250, 1300)


def random_times(seed: int) -> tuple[StageTimes, float]:
    """A pipeline's search inputs and budget: stages and micro-batches as tune and simulate give them, costs
    whole (ties) or uneven, some transfers, W's and updates free, R between 1 and unbounded."""
    rng = random.Random(seed)
    p, m = rng.choice([1, 2, 3, 4, 5, 6, 8, 12]), rng.choice([1, 2, 3, 4, 6, 8, 12, 16, 24])
    whole = rng.random() < 0.5

    def ms(low: float, high: float) -> float:
        return float(rng.randint(math.ceil(low), math.floor(high))) if whole else rng.uniform(low, high)

    op_ms = []
    for _ in range(p):
        f, i, w = ms(1, 4), ms(1, 4), 0.0 if rng.random() < 0.2 else ms(0, 3)
        op_ms.append((f, i, w, (i + w) * rng.choice([0.9, 1.0, 1.1])))
    link = rng.choice([0.0, 0.0, 0.5, 1.0]) if whole else rng.uniform(0.0, 0.7)
    send = tuple(link * rng.choice([1.0, 1.0, 2.0]) for _ in range(p - 1))
    held = [float(rng.choice([1, 2, 3, 4]) * 2 ** 20 + rng.randint(0, 1)) for _ in range(p)]
    kept = [float(round(rng.choice([0.25, 0.5, 0.75]) * h)) for h in held]
    limit = rng.choice([1.0, 1.0, 1.3, 2.0, 4.0, 1e6]) * one_f_one_b_peak(held, m)
    limits = [limit] * p
    if rng.random() < 0.3:  # one device's memory binds below R
        d = rng.randrange(p)
        limits[d] = max(held[d], rng.uniform(0.5, 1.0) * limit)
    times = StageTimes(tuple(op_ms), tuple(ms(0, 2) for _ in range(p)), send, tuple(reversed(send)), tuple(held),
                       tuple(kept), tuple(limits), m)
    return times, rng.choice([0.002, 0.01, 0.03])


def free_ops(seed: int) -> tuple[StageTimes, list[Knobs]]:
    """`random_times`'s pipeline with some F or I free and six random settings of the list scheduler's knobs."""
    times, _ = random_times(seed)
    rng = random.Random(seed)
    if rng.random() < 0.3:
        op_ms = [list(ops) for ops in times.op_ms]
        for ops in op_ms:
            if rng.random() < 0.5:
                ops[rng.choice([_F, _I])] = 0.0
        times = replace(times, op_ms=tuple(map(tuple, op_ms)))
    p, m = times.stages, times.microbatches
    return times, [Knobs(tuple(rng.randint(1, m) for _ in range(p)), tuple(rng.randint(0, m) for _ in range(p)),
                         tuple(rng.random() < 0.3 for _ in range(p))) for _ in range(6)]


def free_ops_digest(seed: int) -> str:
    """The list scheduler's pattern and its finish times at each of `free_ops`'s knobs, as a digest."""
    times, settings = free_ops(seed)
    hashed = hashlib.sha256()
    for knobs in settings:
        pattern = _greedy(times, knobs)
        hashed.update(repr(pattern).encode())
        if pattern is not None:
            hashed.update(repr(finish_ms(pattern, times, _STEADY)).encode())
    return hashed.hexdigest()[:16]


def recorded_times() -> list[tuple[StageTimes, float]]:
    """Three of the searches `tune --gpu h100-sxm` runs for the 70B Llama on 256 GPUs (issue 40), as it ran them."""
    return [(StageTimes(**{name: tuple(map(tuple, value)) if name == "op_ms" else
                           value if name == "microbatches" else tuple(value) for name, value in inputs.items()}),
             budget) for inputs, budget in json.loads(RECORDED.read_text())["recorded"]]


def digest(times: StageTimes, budget: float) -> str:
    """What the search computes on `times`, as a digest: every variant's pattern, finish times and peaks, the fixed
    orders' finish times, then the pattern the search returns with `budget`."""
    hashed = hashlib.sha256()
    patterns = [_greedy(times, Knobs.scaled(times, *variant)) for variant in _GRID]
    for pattern in [*patterns, *_fixed_patterns(times.stages, times.microbatches)]:
        hashed.update(repr(pattern).encode())
        if pattern is not None:
            hashed.update(repr((finish_ms(pattern, times, _STEADY), peak_bytes(pattern, times))).encode())
    forget_searches()
    hashed.update(repr(best_pattern(times, budget)).encode())
    return hashed.hexdigest()[:16]


def digests() -> dict:
    """The file as recorded: the random pipelines' digests, tune's searches (kept from the file) and theirs."""
    recorded = json.loads(RECORDED.read_text())["recorded"]
    return {"random": [digest(*random_times(seed)) for seed in range(PIPELINES)], "recorded": recorded,
            "recorded_digests": [digest(*inputs) for inputs in recorded_times()],
            "free_ops": [free_ops_digest(seed) for seed in FREE_OPS]}


@pytest.mark.parametrize("seed", range(PIPELINES))
def test_the_search_on_random_pipelines_is_the_recorded_one(seed):
    assert digest(*random_times(seed)) == json.loads(RECORDED.read_text())["random"][seed]


def test_the_list_scheduler_with_free_ops_is_the_recorded_one():
    assert [free_ops_digest(seed) for seed in FREE_OPS] == json.loads(RECORDED.read_text())["free_ops"]


def test_tunes_70b_searches_are_the_recorded_ones():
    expected = json.loads(RECORDED.read_text())["recorded_digests"]
    assert [digest(*inputs) for inputs in recorded_times()] == expected
