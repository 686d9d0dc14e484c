"""What tune reads off each shape and candidate before it simulates (the shapes' bounds and floors, the partitions,
each candidate's costs, bounds and critical path), held against digests recorded before that code was made faster
(tests/tune_digests.json), so a faster `Scenario.costs`, `_shapes`, `_plan` or critical path that changes one
figure fails here. Recorded with
`python -c "import json, tests.test_tune_digests as t; json.dump(t.digests(), open(t.RECORDED, 'w'), indent=0)"`.
"""

import dataclasses
import hashlib
import json
from pathlib import Path

from tests.helpers import searched_shapes

RECORDED = Path(__file__).with_name("tune_digests.json")


def _given(costs) -> tuple:
    """The costs' fields and their stages' that are not at their defaults (a field added later at its default
    changes no digest), but the profile's description (`calibration`, which each new estimate flag extends)."""
    def default(field: dataclasses.Field):
        if field.default_factory is not dataclasses.MISSING:
            return field.default_factory()
        return field.default  # MISSING where there is none: every value differs from it

    def given(value) -> tuple:
        return tuple((field.name, getattr(value, field.name)) for field in dataclasses.fields(value)
                     if getattr(value, field.name) != default(field))

    return given(dataclasses.replace(costs, stages=(), calibration=None)), tuple(given(stage) for stage in costs.stages)


def digests() -> dict[str, str]:
    """Per shape (its configuration's label and enumeration index): the hash of what the search knows of it
    unbuilt (`_shapes`: staleness, bound, memory floor) and, where built (`_candidate` on `_plan`'s partition:
    every method but auto, whose search has a time budget), its partition, costs (every field, every stage),
    compute per device, floor, bound and the bound its critical path gives (`_with_critical_path`)."""
    from pipesim.planning import tune as tuning

    problem, orders, shapes = searched_shapes()
    built = tuning._Built(problem, orders)
    found: dict[str, str] = {}
    for shape in shapes:
        digest = hashlib.sha256(repr((shape.staleness, shape.max_samples_per_s, shape.memory_floor_bytes)).encode())
        candidate = built.candidate(shape)
        if candidate is not None:
            critical = tuning._with_critical_path(problem, candidate)
            digest.update(repr((candidate.bounds, _given(candidate.costs), candidate.busy_ms.tolist(),
                                candidate.memory_floor_bytes, candidate.max_samples_per_s, candidate.staleness,
                                candidate.allreduce_ms, critical.max_samples_per_s)).encode())
        found[f"{shape.index} {shape.config.label()}"] = digest.hexdigest()
    return found


def test_tunes_shapes_plans_costs_and_critical_paths_are_as_recorded():
    recorded = json.loads(RECORDED.read_text())
    found = digests()
    assert found.keys() == recorded.keys()
    assert [key for key in found if found[key] != recorded[key]] == []
