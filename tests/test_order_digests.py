"""Every method's order, table and weight versions at a grid of shapes, held against digests recorded from the
order-building code before it was made faster (tests/order_digests.json), so a faster build that changes one
action, one table cell or one refusal fails here. Recorded with
`python -c "import json, tests.test_order_digests as t; json.dump(t.digests(), open(t.RECORDED, 'w'), indent=0)"`;
the long runs' (LONG) and the methods' own options' (OPTIONS) at 316e5be, before the weight versions and the V and
AvgPipe orders were made faster.
"""

import hashlib
import json
from pathlib import Path

from pipesim.schedules import METHODS, ScheduleError, ScheduleParams, build_schedule, weight_versions

RECORDED = Path(__file__).with_name("order_digests.json")
STAGES = (1, 2, 3, 4, 8)
MICROBATCHES = (1, 2, 3, 4, 6, 7, 8, 12, 16, 24)
CHUNKS = (1, 2, 3)
PIPELINES = (1, 2)
# tune's own shapes: a deep pipeline at the candidate's m, with two data-parallel replicas (their REDUCE rows)
LARGE = ((16, (32,), 1, 1, 2), (16, (32,), 2, 1, 2), (8, (64,), 2, 1, 1))
# runs as long as tune's (p, micro-batch counts, v, P, d, N): a flushing order's 3 mini-batches; one that never
# flushes, 2·ceil(p·v / m) + 2 warm-up and 12 steady ones (`planning.tune.STEADY_STEPS`), 16 or 18 here
LONG = ((4, (1, 4, 6), 1, 1, 2, 16), (6, (3, 12), 1, 1, 1, 18), (4, (4, 8), 2, 1, 2, 3), (8, (8, 16), 1, 2, 1, 3))
# a method's own options (p, micro-batch counts, N, options): AvgPipe's advance forwards and averaging period
OPTIONS = {"avgpipe": ((4, (3, 8), 5, {"advance": 0, "average_every": 2}),
                       (5, (2, 7), 3, {"advance": 50, "average_every": 1, "pipelines": 3}),
                       (3, (1, 4), 4, {"advance": 2, "average_every": 3, "pipelines": 1}))}


def shape_digest(method: str, params: ScheduleParams, digest) -> None:
    """Add to `digest` everything the built schedule shows: its printed orders, placement, graph and policy, its
    action table's columns and its weight versions; the refusal's message where it refuses."""
    try:
        schedule = build_schedule(method, params)
    except ScheduleError as exc:
        digest.update(f"refused: {exc}".encode())
        return
    digest.update(schedule.to_text().encode())
    digest.update(repr((schedule.placement, schedule.graph, schedule.policy, schedule.microbatches,
                        schedule.minibatches, schedule.pipelines)).encode())
    t = schedule.table
    for column in (t.device, t.kind, t.stage, t.microbatch, t.minibatch, t.pipeline, t.peer):
        digest.update(column.dtype.str.encode() + column.tobytes())
    try:
        versions = weight_versions(schedule)
    except ScheduleError as exc:
        digest.update(f"versions refused: {exc}".encode())
    else:
        for column in (versions.read, versions.prediction, versions.copies_delta, versions.held_after):
            digest.update(column.dtype.str.encode() + column.tobytes())


def digests() -> dict[str, dict[str, str]]:
    """Per method, per shape "p,v,P,d" (two mini-batches) or "p,v,P,d,N" (N): the hash of its `shape_digest`s over
    the micro-batch counts."""
    shapes = [(p, MICROBATCHES, v, q, 1, 2) for p in STAGES for v in CHUNKS for q in PIPELINES]
    shapes += [(*shape, 2) for shape in LARGE] + list(LONG)
    found: dict[str, dict[str, str]] = {}
    for method in METHODS:
        for p, counts, v, q, d, n in shapes:
            digest = hashlib.sha256()
            for m in counts:
                shape_digest(method, ScheduleParams(p, m, n, v, q, data_parallel=d), digest)
            found.setdefault(method, {})[f"{p},{v},{q},{d}" + (f",{n}" if n != 2 else "")] = digest.hexdigest()[:16]
        for p, counts, n, options in OPTIONS.get(method, ()):
            digest = hashlib.sha256()
            for m in counts:
                shape_digest(method, METHODS[method].params(p, m, n, **options), digest)
            found[method][",".join([str(p), str(n), *(f"{k}={v}" for k, v in options.items())])] = \
                digest.hexdigest()[:16]
    return found


def test_every_method_builds_the_recorded_orders():
    recorded = json.loads(RECORDED.read_text())
    built = digests()
    assert built.keys() == recorded.keys()
    changed = {method: [shape for shape, digest in built[method].items() if recorded[method].get(shape) != digest]
               for method in built}
    assert not any(changed.values()), {method: shapes[:8] for method, shapes in changed.items() if shapes}
