"""The baseline methods and what every schedule function shares.

Each method is one small, pure schedule function plus its weight policy. p stages (k = 0 is the input
stage), m micro-batches per mini-batch, N mini-batches, one optimizer update per stage and mini-batch.
The registry of all methods is `catalogue.METHODS`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field

from .ir import SYNCHRONOUS, Action, Kind, Read, Schedule, ScheduleError, StageGraph, WeightPolicy

Unit = tuple[int, int]  # (micro-batch, mini-batch)


@dataclass(frozen=True)
class ScheduleParams:
    """What a schedule is built for: p (`stages`), m, N, v (`chunks`), P (`pipelines`), and AvgPipe's
    advance forwards (None: its own rule), averaging period (mini-batches) and elastic coefficient
    (None: 0.9 / P)."""

    stages: int
    microbatches: int
    minibatches: int = 1
    chunks: int = 1
    pipelines: int = 1
    advance: int | None = None
    average_every: int = 1
    elastic_alpha: float | None = None

    def __post_init__(self) -> None:
        for name in ("stages", "microbatches", "minibatches", "chunks", "pipelines", "average_every"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ScheduleError(f"{name} must be a whole number >= 1 (got {value!r})")
        if self.advance is not None and (not isinstance(self.advance, int) or self.advance < 0):
            raise ScheduleError(f"advance must be a whole number >= 0 (got {self.advance!r})")
        if self.elastic_alpha is not None and not 0 < self.elastic_alpha <= 1:
            raise ScheduleError(f"elastic_alpha must be in (0, 1] (got {self.elastic_alpha!r})")

    @property
    def alpha(self) -> float:
        """EASGD's coefficient: each replica moves alpha of the way to the reference, which takes alpha of
        every replica's difference (beta = 0.9 shared by the P replicas unless given)."""
        return self.elastic_alpha if self.elastic_alpha is not None else 0.9 / self.pipelines


@dataclass(frozen=True)
class Method:
    """A method by its command-line name; `defaults` are parameters it uses unless the user sets them
    (the V schedules need two chunks, AvgPipe runs two pipelines)."""

    name: str
    summary: str
    build: Callable[[ScheduleParams], Schedule]
    defaults: Mapping[str, int] = field(default_factory=dict)


def require_plain(method: str, params: ScheduleParams) -> None:
    if params.chunks != 1:
        raise ScheduleError(f"{method} places one model stage per device: chunks must be 1 (got {params.chunks})")
    if params.pipelines != 1:
        raise ScheduleError(f"{method} runs a single pipeline: pipelines must be 1 (got {params.pipelines})")


def make_schedule(
    method: str,
    params: ScheduleParams,
    orders: Sequence[Sequence[Action]],
    policy: WeightPolicy = SYNCHRONOUS,
    *,
    placement: Sequence[int] | None = None,
    graph: StageGraph | None = None,
) -> Schedule:
    """Package a method's orders; by default a chain of p stages, stage k on device k, one pipeline."""
    graph = graph or StageGraph.chain(len(placement) if placement is not None else params.stages)
    return Schedule(
        method=method,
        graph=graph,
        placement=tuple(placement) if placement is not None else tuple(range(graph.num_stages)),
        orders=tuple(tuple(order) for order in orders),
        policy=policy,
        microbatches=params.microbatches,
        minibatches=params.minibatches,
        pipelines=params.pipelines,
        params=asdict(params),
    )


def one_forward_one_backward(units: Sequence[Unit], warmup: int) -> Iterator[tuple[Kind, Unit]]:
    """`warmup` forwards, then one forward and one backward in turn, then the remaining backwards."""
    warm = min(warmup, len(units))
    for unit in units[:warm]:
        yield Kind.F, unit
    for i in range(warm, len(units)):
        yield Kind.F, units[i]
        yield Kind.B, units[i - warm]
    for unit in units[len(units) - warm :]:
        yield Kind.B, unit


def gpipe(params: ScheduleParams) -> Schedule:
    """All forwards, then all backwards, then a flush and one update per mini-batch."""
    require_plain("gpipe", params)
    m = params.microbatches
    orders = []
    for k in range(params.stages):
        order: list[Action] = []
        for b in range(params.minibatches):
            order += [Action(Kind.F, k, j, b) for j in range(m)]
            order += [Action(Kind.B, k, j, b) for j in range(m)]
            order.append(Action(Kind.OPT, k, -1, b))
        orders.append(order)
    return make_schedule("gpipe", params, orders)


def one_f_one_b(params: ScheduleParams) -> Schedule:
    """PipeDream-Flush / DAPPLE: min(p-k-1, m) warm-up forwards, 1F1B, cool-down; flush; update."""
    require_plain("1f1b", params)
    p, m = params.stages, params.microbatches
    orders = []
    for k in range(p):
        order: list[Action] = []
        for b in range(params.minibatches):
            units = [(j, b) for j in range(m)]
            order += [Action(kind, k, j, b) for kind, (j, b) in one_forward_one_backward(units, p - k - 1)]
            order.append(Action(Kind.OPT, k, -1, b))
        orders.append(order)
    return make_schedule("1f1b", params, orders)


PIPEDREAM_POLICY = WeightPolicy(forward=Read.LATEST, backward=Read.STASHED)


def pipedream(params: ScheduleParams) -> Schedule:
    """1F1B across mini-batches with no flush; each stage updates after a mini-batch's last backward,
    and a backward uses the weights its forward stashed."""
    require_plain("pipedream", params)
    p, m = params.stages, params.microbatches
    units = [(j, b) for b in range(params.minibatches) for j in range(m)]
    orders = []
    for k in range(p):
        order: list[Action] = []
        for kind, (j, b) in one_forward_one_backward(units, p - k - 1):
            order.append(Action(kind, k, j, b))
            if kind is Kind.B and j == m - 1:
                order.append(Action(Kind.OPT, k, -1, b))
        orders.append(order)
    return make_schedule("pipedream", params, orders, PIPEDREAM_POLICY)


BASELINES = (
    Method("gpipe", "GPipe: all forwards, then all backwards; flush and update per mini-batch", gpipe),
    Method("1f1b", "1F1B (PipeDream-Flush, DAPPLE): warm-up, one forward one backward, flush", one_f_one_b),
    Method("pipedream", "PipeDream: asynchronous 1F1B without flush; weight stashing, staleness p-1-k", pipedream),
)
