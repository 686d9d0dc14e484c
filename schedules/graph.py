"""GraphPipe (Jeon et al. 2024): pipeline stages that form a DAG, so independent branches run at once.

Each stage runs synchronous 1F1B whose warm-up is the longest path of stages below it (the chain's
p-k-1 when the graph is a chain), then flushes and updates once per mini-batch. A stage DAG comes from a
small JSON file or from the built-in two-branch model.
"""

from __future__ import annotations

from functools import cache
from pathlib import Path

from ..files import GRAPH_FILE, GRAPH_KEYS, read_document
from ..units import number_allowed
from .ir import Schedule, ScheduleError, StageGraph
from .methods import MAX_STAGES, Method, ScheduleParams, flushed_1f1b, make_schedule, require_degree


def two_branch_graph(stages: int) -> StageGraph:
    """A stem, two parallel branches of (stages-2)/2 stages (the first one longer when odd), a merging head."""
    if stages < 4:
        raise ScheduleError(f"--stages: graphpipe's built-in graph (a stem, two branches and a head) needs 4 or more "
                            f"(got {stages}); pipesim simulate --graph takes a stage graph of your own")
    long = (stages - 1) // 2
    first = list(range(1, 1 + long))
    second = list(range(1 + long, stages - 1))
    head = stages - 1
    edges = []
    for branch in (first, second):
        path = [0, *branch, head]
        edges += list(zip(path, path[1:]))
    return StageGraph(stages, tuple(edges))


def graph_schedule(
    params: ScheduleParams, graph: StageGraph, placement: tuple[int, ...] | None = None, name: str = "graphpipe"
) -> Schedule:
    """1F1B per stage with warm-up = the longest downstream path; one stage per device (stage s on
    device s unless `placement` says otherwise)."""
    for field in ("chunks", "pipelines"):
        require_degree(params, field, 1, f"{name} places one stage per device in one pipeline")
    if graph.num_stages != params.stages:
        raise ScheduleError(f"{name}: the stage graph has {graph.num_stages} stages, stages is {params.stages}")

    @cache
    def below(s: int) -> int:
        return max((1 + below(t) for t in graph.succs[s]), default=0)

    placement = placement or tuple(range(graph.num_stages))
    return make_schedule(name, params, flushed_1f1b(params, below, placement), graph=graph, placement=placement)


def graphpipe(params: ScheduleParams) -> Schedule:
    return graph_schedule(params, two_branch_graph(params.stages))


def load_graph(path: Path) -> tuple[StageGraph, tuple[int, ...]]:
    """A stage DAG and its placement from JSON: {"stages": n, "edges": [[from, to], ...], "placement":
    [device of stage 0, ...]} (placement optional: stage s on device s; one stage per device)."""
    doc = read_document(path, GRAPH_FILE, ScheduleError)  # another kind is named, not by the keys it lacks
    if not isinstance(doc, dict) or "stages" not in doc or set(doc) - GRAPH_KEYS:
        raise ScheduleError(f'graph file {path}: expected an object with "stages", "edges" and optionally '
                            '"placement"')
    stages, edges = doc["stages"], doc.get("edges", [])

    def whole(v: object) -> bool:
        return isinstance(v, int) and not isinstance(v, bool)

    if not whole(stages) or not 1 <= stages <= MAX_STAGES:  # 10**12 stages: a MemoryError making the placement
        raise ScheduleError(f'graph file {path}: "stages": {number_allowed(1, MAX_STAGES)}, the '
                            f"model stages pipesim simulates (got {f'{stages:,}' if whole(stages) else repr(stages)})")
    placement = doc.get("placement", list(range(stages)))
    if not isinstance(edges, list) or not all(isinstance(e, list) and len(e) == 2 and all(map(whole, e))
                                              for e in edges):
        raise ScheduleError(f'graph file {path}: "edges": give a list of [from, to] stage pairs')
    if not isinstance(placement, list) or len(placement) != stages or not all(map(whole, placement)):
        raise ScheduleError(f'graph file {path}: "placement": give a device for each of the {stages:,} stages')
    if sorted(placement) != list(range(stages)):
        raise ScheduleError(f'graph file {path}: "placement": give each stage its own device '
                            f"0..{stages - 1} (got {placement})")
    try:
        graph = StageGraph(stages, tuple((a, b) for a, b in edges))
    except ScheduleError as exc:
        raise ScheduleError(f"graph file {path}: {exc}") from None
    return graph, tuple(placement)


GRAPH = (
    Method("graphpipe", "GraphPipe: a DAG of stages; branches on different devices run concurrently", graphpipe,
           options=frozenset({"graph"}), on_graph=graph_schedule),
)
