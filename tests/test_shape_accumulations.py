"""A shape's bound (`planning.tune._shape_bound`, before any partition) counts the gradient accumulations every order
pays at the sketch's m (each stage's B and W less its updates, `_Sketch.accumulations`), over the least total any
cut gives (`_least_accumulate_ms`): it must stay at or below tune's measured step."""

import math
from dataclasses import replace

import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from pipesim.planning import tune as tuning
from pipesim.schedules import ScheduleParams, build_schedule
from pipesim.sim import Costs
from pipesim.sim.costs import KIND_CODE, Kind
from tests.helpers import A100_GPT12 as MODEL
from tests.helpers import FIXED_ORDERS as FIXED
from tests.helpers import ROUNDING_MS, chains, fixed_order, searched_settings
from tests.helpers import costed_step_ms as _costed_step_ms
from tests.helpers import measured_step_ms as _step_ms


def _work_of(costs: Costs) -> tuning._Work:
    """The costs' stages as the layers a shape's bound sums (`_work`): F, B, least backward, update and
    accumulation totals; no slowest-stage term."""
    table = costs.op_ms_table(1)
    f, b, i, w, opt = (table[:, KIND_CODE[kind]] for kind in (Kind.F, Kind.B, Kind.I, Kind.W, Kind.OPT))
    return tuning._Work(fwd_ms=math.fsum(f), bwd_ms=math.fsum(b), least_bwd_ms=math.fsum(np.minimum(b, i + w)),
                        static_bytes=0, param_bytes=0, expert_param_bytes=0, grad_bytes=0,
                        slowest_ms=np.zeros(len(f) + 2), step_ms=(math.fsum(opt), 0.0, 0.0),
                        accumulate_ms=math.fsum(stage.accumulate_ms for stage in costs.stages))


def _shape_step_ms(name: str, costs: Costs, schedule_of, chain: bool = True) -> float:
    """The least step `_shape_bound` allows a shape of `name` on these costs, its sketch read at m itself (`chain`:
    with a flushing chain's fill and drain)."""
    schedule = schedule_of(2)
    config = tuning.Config(name, schedule.num_devices, 1, 1, schedule.microbatches, 2)
    problem = tuning.Problem(schedule.num_devices, 0, 1000, (name,))
    sketch = tuning._Sketch.of(tuning._Order.of(schedule))
    return problem.batch_size / tuning._shape_bound(problem, config, _work_of(costs), sketch, 1.0, chain=chain) * 1e3


@settings(max_examples=120, deadline=None)
@given(chains(), st.sampled_from(FIXED), st.booleans())
def test_a_shapes_bound_with_its_accumulations_stays_at_or_below_its_step(chain, name, after_flush):
    """Random chains, accumulations up to 1 ms, two replicas' REDUCEs, holds or not: the shape's bound's step is
    never longer than tune's (the simulated growth, or the busiest device's compute where that is longer)."""
    costs, links, m = chain
    assume(any(stage.fwd_ms > 0 for stage in costs.stages))
    schedule_of = fixed_order(name, len(costs.stages), m, after_flush)
    busiest_ms = _costed_step_ms(schedule_of, costs, links)[1]
    assert _shape_step_ms(name, costs, schedule_of) <= max(_step_ms(schedule_of, costs, links), busiest_ms) * (
        1 + 1e-9) + ROUNDING_MS


def test_a_shapes_bound_counts_every_stages_accumulations_at_the_sketchs_m_only():
    """1F1B on 4 devices, 8 micro-batches (F 1 ms, B 2): the mean device computes 24 ms a step, and each stage's 7
    accumulations (0.5 ms) add 3.5; a sketch read at another m counts none, as its updates may not be m's."""
    costs = Costs.per_stage(4, fwd_ms=1, bwd_ms=2)
    accumulating = replace(costs, stages=tuple(replace(stage, accumulate_ms=0.5) for stage in costs.stages))

    def schedule_of(minibatches: int):
        return build_schedule("1f1b", ScheduleParams(4, 8, minibatches))

    assert tuning._Sketch.of(tuning._Order.of(schedule_of(2))).accumulations == 7
    assert _shape_step_ms("1f1b", costs, schedule_of, chain=False) == pytest.approx(24.0)
    assert _shape_step_ms("1f1b", accumulating, schedule_of, chain=False) == pytest.approx(27.5)
    problem = tuning.Problem(4, 0, 1000, ("1f1b",))
    sketch = tuning._Sketch.of(tuning._Order.of(schedule_of(2)))
    at_another_m = tuning._shape_bound(problem, tuning.Config("1f1b", 4, 1, 1, 16, 1), _work_of(accumulating),
                                       sketch, 1.0, chain=False)
    assert problem.batch_size / at_another_m * 1e3 == pytest.approx(2 * 24.0)


@settings(max_examples=40, deadline=None)
@given(st.data())
def test_the_least_accumulation_is_no_more_than_any_cuts(data):
    """The 12-layer GPT's estimates (each t, b, recomputation): every cut of its layers into stages, calibrated or
    not, prices its stages' accumulations at least at `_least_accumulate_ms`, which is some."""
    settings_ = _settings()
    profile = settings_[data.draw(st.integers(0, len(settings_) - 1))].scenario.measured
    layers = len(profile.layers)
    inner = data.draw(st.lists(st.integers(1, layers - 1), unique=True, max_size=layers - 1))
    least_ms = tuning._least_accumulate_ms(profile)
    assert least_ms > 0
    for bounds in ([0, *sorted(inner), layers], profile.partition.bounds):
        assert least_ms <= math.fsum(tuning._cut_accumulates_ms(profile, bounds)) * (1 + 1e-12)


_cached: list = []


def _settings() -> list:
    if not _cached:
        _cached.extend(searched_settings("-D", 8, "-B", 32, "-b", 2, "--recompute", "selective", model=MODEL))
    return _cached
