"""Given the stages each device runs (`partition`'s `devices`), the cut is, among those of the least slowest stage, one
whose busiest device is least busy: a device runs each of its stages for every micro-batch, so its busy time is
their sum (Megatron-LM's interleaved schedule puts stage s of p·v on device s mod p). Checked against every cut of
small layer lists; past the search's prefixes, a local optimum of moving layers (the 70B tune's recorded cuts)."""

import functools
import itertools
import json
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipesim.profiles.partition import LayerCost, PartitionError, _least_busy_devices, _stage_blocks, partition


def _interleaved(p: int, v: int) -> tuple[tuple[int, ...], ...]:
    return tuple(tuple(range(d, p * v, p)) for d in range(p))


def _v_shaped(p: int) -> tuple[tuple[int, ...], ...]:
    return tuple((d, 2 * p - 1 - d) for d in range(p))


def _times(cut, stage_time) -> list[float]:
    return [float(stage_time(k)[i, j]) for k, (i, j) in enumerate(itertools.pairwise(cut))]


def _busiest(cut, stage_time, devices) -> float:
    times = _times(cut, stage_time)
    return max(sum(times[k] for k in held) for held in devices)


def _fits(layers: list[LayerCost], cap: int | None, cut) -> bool:
    return cap is None or all(sum(layer.static_bytes for layer in layers[i:j]) <= cap
                              for i, j in itertools.pairwise(cut))


def _every_cut(n: int, stages: int):
    return ([0, *inner, n] for inner in itertools.combinations(range(1, n), stages - 1))


def _plain(layers: list[LayerCost]):
    table = np.full((len(layers) + 1, len(layers) + 1), np.inf)
    for i, j in itertools.combinations(range(len(layers) + 1), 2):
        table[i, j] = sum(layer.ms for layer in layers[i:j])
    return lambda k: table


def test_of_the_cuts_tied_at_the_slowest_stage_the_busiest_device_is_least_busy():
    """Six layers in 2 x 2 interleaved stages: the slowest stage is 3 at best, and the earliest cut of it, [1], [2],
    [1, 1], [1, 2], gives device 1 stages 1 and 3 (5) and device 0 the rest (3); [1, 2], [1], [1], [1, 2] (4 and 4)
    is as slow at its slowest stage and no device is busier than 4, the least any cut of that slowest stage gives."""
    layers = [LayerCost(ms, 0, 0) for ms in (1, 2, 1, 1, 1, 2)]
    devices, time = _interleaved(2, 2), _plain(layers)
    earliest, cut = partition(layers, 4), partition(layers, 4, devices=devices)
    slowest = max(_times(earliest, time))
    assert _busiest(earliest, time, devices) == 5  # what the slowest stage's earliest cut gives
    least = min(_busiest(c, time, devices) for c in _every_cut(6, 4) if max(_times(c, time)) <= slowest)
    assert max(_times(cut, time)) == slowest
    assert _busiest(cut, time, devices) == least == 4


def test_a_device_of_one_stage_keeps_the_earliest_cut():
    layers = [LayerCost(ms, 0, 0) for ms in (1, 2, 1, 1, 1, 2)]
    assert partition(layers, 4, devices=((0,), (1,), (2,), (3,))) == partition(layers, 4)


@st.composite
def _problems(draw):
    placement = draw(st.sampled_from(["interleaved", "v-shaped"]))
    p = draw(st.integers(1, 3))
    v = 2 if placement == "v-shaped" else draw(st.integers(1, 3))
    stages = p * v
    n = draw(st.integers(stages, min(9, stages + 4)))
    ms = draw(st.lists(st.sampled_from([0.5, 1.0, 1.0, 1.5, 2.0, 3.0]), min_size=n, max_size=n))
    static = draw(st.lists(st.integers(0, 3), min_size=n, max_size=n))
    scale = draw(st.lists(st.sampled_from([1.0, 1.0, 1.5, 2.0]), min_size=stages, max_size=stages))
    cap = draw(st.one_of(st.none(), st.integers(2, 9)))
    devices = _interleaved(p, v) if placement == "interleaved" else _v_shaped(p)
    return [LayerCost(t, b, 0) for t, b in zip(ms, static)], stages, devices, scale, cap


@settings(max_examples=300, deadline=None)
@given(problem=_problems())
def test_the_busiest_device_is_the_least_of_every_cut_of_the_least_slowest_stage(problem):
    """Stage k's times scaled as a schedule's steps weigh them (`scale`), each stage within a memory cap where there
    is one: the cut's slowest stage is the least any cut within the cap gives, and its busiest device the least of
    the cuts of that slowest stage within the cap."""
    layers, stages, devices, scale, cap = problem
    table = _plain(layers)(0)
    time = lambda k: scale[k] * table  # noqa: E731
    fits = functools.partial(_fits, layers, cap)
    fitting = [cut for cut in _every_cut(len(layers), stages) if fits(cut)]
    if not fitting:
        with pytest.raises(PartitionError):
            partition(layers, stages, cap, stage_time=time, devices=devices)
        return
    cut = partition(layers, stages, cap, stage_time=time, devices=devices)
    slowest = min(max(_times(c, time)) for c in fitting)
    assert fits(cut) and max(_times(cut, time)) == slowest
    least = min(_busiest(c, time, devices) for c in fitting if max(_times(c, time)) <= slowest)
    assert _busiest(cut, time, devices) == pytest.approx(least, rel=1e-9)


# the 70B tune's cuts where the search stopped at its prefixes: stage k's ms over every range it may hold (within the
# least slowest stage and the memory cap), "ranges"[k][s - 1][r] a digit of "values_ms" for layers k + r ..
# k + r + s - 1, "." where refused; "first_ms" the slowest-stage cut's busiest device, "searched_ms" the search's
# with 100,000 prefixes
SEVENTY_B = Path(__file__).parent / "data" / "partition_devices_70b.json"
DIGITS = "0123456789abcdefghijklmnopqrstuvwxyz"


def _recorded(case: dict):
    n, stages = case["layers"], case["stages"]
    tables = []
    for k, sizes in enumerate(case["ranges"]):
        table = np.full((n + 1, n + 1), np.inf)
        for size, digits in enumerate(sizes, start=1):
            for r, digit in enumerate(digits):
                if digit != ".":
                    table[k + r, k + r + size] = case["values_ms"][DIGITS.index(digit)]
        tables.append(table)
    p = case["devices"]
    devices = _interleaved(p, stages // p) if case["placement"] == "interleaved" else _v_shaped(p)
    return [LayerCost(0.0, 0, 0)] * n, stages, tables.__getitem__, devices


@pytest.mark.parametrize("case", json.loads(SEVENTY_B.read_text())["cases"], ids=lambda case: str(case["search"]))
def test_past_its_prefixes_the_cut_is_levelled_to_what_a_longer_search_finds(case):
    """The 70B's p16 and p32 cuts of 82 layers into 32 and 64 stages: the search's first 1,000 prefixes find nothing
    below the slowest-stage cut (`first_ms`); from there, moving layers between stages levels the busiest device to
    what the search finds with 100,000 prefixes (`searched_ms`), the slowest stage unchanged."""
    layers, stages, time, devices = _recorded(case)
    earliest, cut = partition(layers, stages, stage_time=time), partition(layers, stages, stage_time=time,
                                                                         devices=devices)
    assert _busiest(earliest, time, devices) == pytest.approx(case["first_ms"], abs=0.05)
    assert max(_times(cut, time)) == max(_times(earliest, time))
    assert _busiest(cut, time, devices) <= case["searched_ms"] + 0.05 < case["first_ms"]


@settings(max_examples=200, deadline=None)
@given(problem=_problems())
def test_levelled_cuts_keep_the_slowest_stage_and_no_move_of_a_layer_improves_them(problem):
    """With no prefixes to search, the slowest-stage cut levelled by moving layers: every stage within the least
    slowest stage and the cap, the busiest device no busier, and no single move (one layer from a stage to another,
    the stages between shifted) lowers the busiest device."""
    layers, stages, devices, scale, cap = problem
    table = _plain(layers)(0)
    time = lambda k: scale[k] * table  # noqa: E731
    fits = functools.partial(_fits, layers, cap)
    try:
        earliest = partition(layers, stages, cap, stage_time=time)
    except PartitionError:
        return
    slowest = max(_times(earliest, time))
    rows = range(len(layers) - stages + 1)  # `_least_busy_devices`' [k, r, c]: stage k over layers k + r .. k + c
    over = None if cap is None else np.array([[[sum(layer.static_bytes for layer in layers[k + r:k + 1 + c]) > cap
                                                for c in rows] for r in rows] for k in range(stages)])
    cut = _least_busy_devices(len(layers), _stage_blocks(len(layers), stages, time), devices, slowest, over, earliest,
                              max_prefixes=0)
    assert fits(cut) and max(_times(cut, time)) <= slowest
    busiest = _busiest(cut, time, devices)
    assert busiest <= _busiest(earliest, time, devices) * (1 + 1e-9)
    for first, last in itertools.combinations(range(1, stages + 1), 2):
        for step in (-1, 1):
            moved = list(cut)
            moved[first:last] = [bound + step for bound in cut[first:last]]
            if all(i < j for i, j in itertools.pairwise(moved)) and fits(moved) and max(_times(moved, time)) <= slowest:
                assert _busiest(moved, time, devices) >= busiest * (1 - 1e-9)


def test_the_scenarios_cut_of_an_interleaved_schedule_levels_its_devices():
    """`Scenario.cut` hands `partition` the stages each device runs (`device_stages`): the CNN profile's 9 layers
    in 4 x 2 interleaved stages tie at the slowest stage, and the earliest tied cut leaves a device busier than the
    cut the scenario takes."""
    from pipesim.planning.scenario import device_stages, profile_scenario
    from pipesim.profiles.schema import layer_costs, load_profile, profile_stage_time
    from pipesim.schedules import ScheduleParams
    from tests.helpers import CNN_CPU as CNN

    measured = load_profile(CNN)
    scenario = profile_scenario(measured, "adam")
    schedule = scenario.build("interleaved-1f1b", ScheduleParams(stages=4, microbatches=8, chunks=2))
    devices, time = device_stages(schedule, 8), profile_stage_time(measured)
    assert devices == ((0, 4), (1, 5), (2, 6), (3, 7))
    cut, earliest = scenario.cut(schedule), partition(layer_costs(measured.layers, "adam"), 8, stage_time=time)
    assert max(_times(cut, time)) == max(_times(earliest, time))
    assert _busiest(cut, time, devices) < _busiest(earliest, time, devices)
