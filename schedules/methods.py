"""The baseline methods and what every schedule function shares.

Each method is one small, pure schedule function plus its weight policy. p stages (k = 0 is the input
stage), m micro-batches per mini-batch, N mini-batches, one optimizer update per stage and mini-batch.
The registry of all methods is `catalogue.METHODS`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, fields, replace

import numpy as np

from ..choices import choose_from
from ..units import float_text, given_text, number_allowed, value_text
from .ir import (
    COLLECTIVE_KINDS,
    PREDICTION_SOURCES,
    SYNCHRONOUS,
    Action,
    Kind,
    Read,
    Schedule,
    ScheduleError,
    StageGraph,
    WeightPolicy,
)
from .passes import add_context_parallel, add_data_parallel, add_expert_parallel, overlap_expert_communication
from .table import FIELD_DTYPE, KIND_CODE, KIND_DTYPE, ActionTable, OrderView, kind_mask

MAX_ROWS = 30_000_000  # ops and transfers (a send and a receive row each): about 430 bytes per row while simulating
MAX_STAGES = 4_096  # model stages (p·v) of one pipeline: per-device and per-stage work grows faster than rows
# ZeRO's stages (Rajbhandari et al. 2020) as `ScheduleParams.zero` says what d data-parallel replicas shard: 0
# nothing, 1 the optimizer state (its master weights included), 2 the weight gradients as well, 3 the weights too
# (FSDP); what each holds when is sim/engine.py's `static_parts` and `_unsharded_spans`.
ZERO_STAGES = (0, 1, 2, 3)


# What `ScheduleParams` allows of a value the commands read before building one, as one line naming the value as
# its reader does (`flag`: the commands' flag), None where it is allowed: the rule stated once for both.
def prediction_refusal(source: str | None, flag: str = "prediction") -> str | None:
    """A source of the prediction distance s: one of `PREDICTION_SOURCES` (None: the method's primary one)."""
    if source is None or source in PREDICTION_SOURCES:
        return None
    return choose_from(flag, PREDICTION_SOURCES, source)


def zero_refusal(zero: int, flag: str = "zero") -> str | None:
    """ZeRO's stage: one of `ZERO_STAGES`."""
    if zero in ZERO_STAGES and not isinstance(zero, bool):
        return None
    return choose_from(flag, ZERO_STAGES, zero)


def elastic_alpha_refusal(alpha: float | None, flag: str = "elastic_alpha") -> str | None:
    """AvgPipe's elastic averaging coefficient: in (0, 1] (None: its default, 0.9 / P)."""
    if alpha is None or 0 < alpha <= 1:
        return None
    return f"{flag}: {number_allowed(0, 1, whole=False, finite=True, above=True)} (got {float_text(float(alpha))})"


# auto's search budget at most, a day (as run's --timeout): past it the search over one-op moves of p >= 4 stages,
# which ends only when its budget does, ran on unseen (`export -s auto --search-seconds 1e12` past 2 minutes)
MAX_SEARCH_SECONDS = 86_400


def above_zero_refusal(value: float | None, flag: str, given: str | None = None, most: float = math.inf) -> str | None:
    """A number above 0 (a searched schedule's knob, `activation_limit`, `search_seconds`; --network-gb-s): a finite
    number above 0 and at most `most` (None: its default); `given`, the value as the reader wrote it."""
    if value is None or (not isinstance(value, bool) and isinstance(value, (int, float)) and 0 < value < math.inf
                         and value <= most):
        return None
    allowed = number_allowed(0, most if most < math.inf else None, whole=False, finite=True, above=True)
    return f"{flag}: {allowed} (got {given_text(given) if given is not None else value_text(value)})"


_FLAGS = {"m": "--microbatches", "N": "--minibatches", "p": "--stages", "v": "--chunks", "P": "--pipelines"}


@dataclass(frozen=True)
class ScheduleParams:
    """What a schedule is built for: p (`stages`), m, N, v (`chunks`), P (`pipelines`), AvgPipe's
    advance forwards (None: its own rule), averaging period (mini-batches) and elastic coefficient
    (None: 0.9 / P), the source of a predicting method's distances s (`prediction`, one of
    PREDICTION_SOURCES; None: the method's primary source), and for a searched schedule the peak activation
    memory any device may hold as a multiple of 1F1B's peak on its fullest device (`activation_limit`; None:
    1) and the search's time budget (`search_seconds`; None: the search's default). `data_parallel` (d) replicas of
    every pipeline train on their own micro-batches and average gradients in REDUCE rows, sharding over them as
    `zero` says (ZeRO's stage, `ZERO_STAGES`), together with each device's `context_parallel` (C) ranks, which
    split every micro-batch's sequence, hold the same weights and so reduce and shard with the replicas;
    `expert_parallel` (E) ranks hold a mixture of experts' routed experts, whose dispatch and combine are all-to-all
    rows after every forward and backward; `reduce_after_flush`: a device starts its stages' REDUCEs only once
    its last backward of the mini-batch is done (Megatron-LM's own DDP), instead of each right after its stage's
    last backward, overlapping the device's remaining backward work (torch DDP). `rounds`: the m micro-batches of a
    mini-batch run as that many flushes of m / rounds each before its one update, as torch's pipelining runs
    gradient accumulation (torchtitan's and NeMo AutoModel's `schedule.step` once a round: `in_rounds`)."""

    stages: int
    microbatches: int
    minibatches: int = 1
    chunks: int = 1
    pipelines: int = 1
    advance: int | None = None
    average_every: int = 1
    elastic_alpha: float | None = None
    prediction: str | None = None
    activation_limit: float | None = None
    search_seconds: float | None = None
    data_parallel: int = 1
    zero: int = 0
    reduce_after_flush: bool = False
    context_parallel: int = 1
    expert_parallel: int = 1
    overlap_expert_comm: bool = False  # Megatron-core's EP overlap: `passes.overlap_expert_communication`
    rounds: int = 1
    # interleaved-1f1b: the micro-batches each chunk takes in turn (Megatron-core's
    # microbatch_group_size_per_vp_stage); None: p, Megatron-core's default
    microbatch_group: int | None = None

    def __post_init__(self) -> None:
        for name in ("stages", "microbatches", "minibatches", "chunks", "pipelines", "average_every", "data_parallel",
                     "context_parallel", "expert_parallel", "rounds"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ScheduleError(f"{name}: {number_allowed(1, None)} (got {value_text(value)})")
        if self.microbatch_group is not None and (not isinstance(self.microbatch_group, int)
                                                  or self.microbatch_group < 1):
            raise ScheduleError(f"microbatch_group: {number_allowed(1, None)} (got "
                                f"{value_text(self.microbatch_group)})")
        if self.advance is not None and (not isinstance(self.advance, int) or self.advance < 0):
            raise ScheduleError(f"advance: {number_allowed(0, None)} (got {value_text(self.advance)})")
        refused = (elastic_alpha_refusal(self.elastic_alpha) or prediction_refusal(self.prediction)
                   or above_zero_refusal(self.activation_limit, "activation_limit")
                   or above_zero_refusal(self.search_seconds, "search_seconds", most=MAX_SEARCH_SECONDS))
        if refused:
            raise ScheduleError(refused)
        for name in ("reduce_after_flush", "overlap_expert_comm"):
            if not isinstance(getattr(self, name), bool):
                raise ScheduleError(f"{name}: give true or false (got {value_text(getattr(self, name))})")
        if (refused := zero_refusal(self.zero)) is not None:
            raise ScheduleError(refused)
        if self.microbatches % self.rounds:
            raise ScheduleError(f"--rounds: each of the {self.rounds:,} rounds runs an equal share of the m "
                                f"micro-batches: give a divisor of m = {self.microbatches:,} (got {self.rounds:,})")
        self._check_size()

    @classmethod
    def recorded(cls, params: Mapping) -> ScheduleParams:
        """The parameters a trace recorded (`TraceMeta.params`), an older pipesim's too, which wrote ZeRO-1 as
        `sharded_optimizer`."""
        params = dict(params)
        if "sharded_optimizer" in params:
            params["zero"] = int(bool(params.pop("sharded_optimizer")))
        return cls(**params)

    def _check_size(self) -> None:
        """Refuse what would take minutes or more memory than a machine has, naming the parameter to lower: the
        largest factor of the estimated rows (F and B of every stage and micro-batch, and with more than one
        device a send and a receive for each activation and gradient between stages)."""
        p, v, stages = self.stages, self.chunks, self.stages * self.chunks
        factors = {"p": p, "v": v, "m": self.microbatches, "N": self.minibatches, "P": self.pipelines}

        def shape(*names: str) -> str:  # the factors that count, those that are 1 left out
            return " × ".join(f"{name}={factors[name]:,}" for name in names if factors[name] > 1 or name in "pm")

        if stages > MAX_STAGES:
            name = "p" if p >= v else "v"
            raise ScheduleError(f"{shape('p', 'v')}: {stages:,} model stages, more than the {MAX_STAGES:,} pipesim "
                                f"simulates: lower {name} ({_FLAGS[name]})")
        units = self.microbatches * self.minibatches * self.pipelines
        rows = units * (2 * stages + (4 * (stages - 1) if p > 1 else 0))
        if rows > MAX_ROWS:
            name = max("mNpvP", key=factors.__getitem__)  # on a tie, the micro-batches
            raise ScheduleError(f"{shape(*factors)}: about {rows:,} ops and transfers to simulate, more than the "
                                f"{MAX_ROWS:,} pipesim simulates (about 12 GiB of memory): lower {name} "
                                f"({_FLAGS[name]})")

    @property
    def alpha(self) -> float:
        """EASGD's coefficient: each replica moves alpha of the way to the reference, which takes alpha of
        every replica's difference (beta = 0.9 shared by the P replicas unless given)."""
        return self.elastic_alpha if self.elastic_alpha is not None else 0.9 / self.pipelines


@dataclass(frozen=True)
class Method:
    """A method by its command-line name; `defaults` are the shapes it takes unless the user sets them
    (the V schedules need two chunks, AvgPipe runs two pipelines); `options` the optional inputs only it
    reads (AvgPipe's averaging knobs); `on_graph`, for a method that runs any stage DAG, builds it on one
    (GraphPipe); `needs_costs`, for a method whose order is searched from the stage costs (`auto`): `build`
    refuses, and the planning side (`planning.scenario.Scenario.build`) builds it with the costs it knows. A
    searched order flushes every mini-batch, so its weight policy is SYNCHRONOUS. `partitioned_as`: the method
    whose order tune cuts a searched one's stages for, before the search has costs to order by (`auto`: 1F1B,
    whose order and activations its search always admits). `p2p_sync`: Megatron-core runs the method with its
    batched point-to-point, which synchronises the device after each exchange, so that a pass whose input its
    stage receives starts with the host not ahead, what `--p2p-sync` prices (profiles/schema.py
    `stage_host_waits_ms`; docs/hardware.md, "Host-bound execution"). `exchanges_per_step`: where it has virtual
    stages, its runtime posts one exchange for each forward and the backward it runs next, not one after each
    (`--blocking-comm`, schedules/passes.py `exchange_order`): Megatron-core's interleaved schedule
    (megatron/core/pipeline_parallel/schedules.py at NVIDIA/Megatron-LM d98e8a64dd,
    `forward_backward_pipelining_with_interleaving`: in its steady state a forward, a backward, then
    `send_forward_backward_recv_forward_backward`, line 1935), where its 1F1B exchanges between them
    (`send_forward_recv_backward`, line 2416). `splits_backward`: its order runs a backward's weight gradient
    apart (W rows), or a searched order may, so that it reads `--wgrad-fraction`. Callers ask `reads` and `shape`
    rather than `defaults` and `options`, so the rules live here."""

    name: str
    summary: str
    make: Callable[[ScheduleParams], Schedule]  # its schedule for params of one round (`build`)
    defaults: Mapping[str, int] = field(default_factory=dict)
    options: frozenset[str] = frozenset()
    on_graph: Callable[..., Schedule] | None = None
    needs_costs: bool = False
    partitioned_as: str | None = None  # with needs_costs; None: its own order
    p2p_sync: bool = False
    exchanges_per_step: bool = False
    splits_backward: bool = False
    fixed: frozenset[str] = frozenset()  # shapes of `defaults` it runs at that value alone (a V's two chunks)

    def build(self, params: ScheduleParams) -> Schedule:
        """This method's schedule for `params`, each mini-batch's micro-batches in `rounds` flushes where asked
        (`in_rounds`)."""
        return self.make(params) if params.rounds == 1 else in_rounds(self.make, params)

    def runs(self, kind: Kind) -> bool:
        """Whether its order runs rows of `kind`, one a cost flag prices alone (W, PRED or AVG: --wgrad-fraction,
        --pred and --avg, refused where no order compared runs them): W where it splits the backward, PRED where it
        reads a prediction source, AVG where it reads an elastic alpha."""
        return {Kind.W: self.splits_backward, Kind.PRED: self.reads("prediction"),
                Kind.AVG: self.reads("elastic_alpha")}[kind]

    def reads(self, option: str) -> bool:
        """Whether this method reads `option`, an input only some methods read (chunks, pipelines, AvgPipe's
        knobs, GraphPipe's graph): a shape it has a default for, or one of its own options."""
        return option in self.defaults or option in self.options

    def read_options(self, options: Mapping[str, object]) -> dict[str, object]:
        """The entries of `options` this method `reads`. A command holds its optional inputs (the search's knobs, a
        prediction source) for every method it builds, several in one comparison, and gives each only its own:
        `params` refuses a prediction source for a method that predicts none, and a schedule's params record only
        what shaped it. (A flag that no method the user named reads is refused before, by the command.)"""
        return {option: value for option, value in options.items() if self.reads(option)}

    def swept(self, shape: str, given: tuple) -> tuple:
        """The values of `shape` (chunks, pipelines) a sweep's `given` values give this method: each where it reads
        the shape, its own alone where that is fixed and given (`--chunks 1,2` ran zb-v at v = 1 too, a row
        skipped in every sweep of the example grid), its default where it does not read it."""
        own = self.defaults.get(shape, 1)
        if not given or not self.reads(shape):
            return (own,)
        return (own,) if shape in self.fixed and own in given else given

    def shape(self, chunks: int | None = None, pipelines: int | None = None) -> tuple[int, int]:
        """(v, P): the values given, else the method's defaults (1 where it has none)."""
        return (self.defaults.get("chunks", 1) if chunks is None else chunks,
                self.defaults.get("pipelines", 1) if pipelines is None else pipelines)

    def params(self, stages: int, microbatches: int, minibatches: int = 1, chunks: int | None = None,
               pipelines: int | None = None, **options) -> ScheduleParams:
        """The parameters to build this method with: `shape`'s v and P, and `options` (advance, average_every,
        elastic_alpha, prediction) as given. A prediction source for a method that predicts no weights is
        refused rather than ignored: the user asked for something that cannot happen."""
        if options.get("prediction") is not None and not self.reads("prediction"):
            raise ScheduleError(f"{self.name} predicts no weights: leave prediction unset (got "
                                f"{options['prediction']!r})")
        return ScheduleParams(stages, microbatches, minibatches, *self.shape(chunks, pipelines), **options)


def require_degree(params: ScheduleParams, field: str, allowed: int, why: str) -> None:
    """Refuse `params`' `field` (chunks, pipelines) other than `allowed`, naming its flag and `why` the method takes
    only that: "--chunks: give 1, as gpipe places one model stage per device (got 2)"."""
    given = getattr(params, field)
    if given != allowed:
        raise ScheduleError(f"--{field}: give {allowed}, as {why} (got {given:,})")


def require_single_pipeline(method: str, params: ScheduleParams) -> None:
    require_degree(params, "pipelines", 1, f"{method} runs a single pipeline")


def require_plain(method: str, params: ScheduleParams) -> None:
    require_degree(params, "chunks", 1, f"{method} places one model stage per device")
    require_single_pipeline(method, params)


def make_schedule(
    method: str,
    params: ScheduleParams,
    orders: Sequence[Sequence[Action]] | ActionTable,
    policy: WeightPolicy = SYNCHRONOUS,
    *,
    placement: Sequence[int] | None = None,
    graph: StageGraph | None = None,
) -> Schedule:
    """Package a method's orders (Action lists, or a table with rows grouped by device); by default a
    chain of p stages, stage k on device k, one pipeline. With d > 1 data-parallel replicas, their gradient
    synchronisation is inserted (`add_data_parallel`); with E > 1 expert-parallel ranks, the all-to-alls after
    every forward and backward (`add_expert_parallel`), paired first as Megatron-core overlaps them where
    `overlap_expert_comm` asks (`overlap_expert_communication`); with C > 1 context-parallel ranks, their key/value
    rings (`add_context_parallel`)."""
    graph = graph or StageGraph.chain(len(placement) if placement is not None else params.stages)
    placement = tuple(placement) if placement is not None else tuple(range(graph.num_stages))
    if isinstance(orders, ActionTable):
        orders = OrderView(orders, max(placement) + 1)
    else:
        orders = tuple(tuple(order) for order in orders)
    return add_context_parallel(add_expert_parallel(add_data_parallel(overlap_expert_communication(Schedule(
        method=method,
        graph=graph,
        placement=placement,
        orders=orders,
        policy=policy,
        microbatches=params.microbatches,
        minibatches=params.minibatches,
        pipelines=params.pipelines,
        params={f.name: getattr(params, f.name) for f in fields(params)},  # its scalars: asdict would deep-copy
    )))))


def in_rounds(make: Callable[[ScheduleParams], Schedule], params: ScheduleParams) -> Schedule:
    """`make`'s schedule with each mini-batch's m micro-batches run as `params.rounds` flushes of m / rounds before
    its one update, as torch's pipelining accumulates gradients over several `schedule.step` calls (torchtitan's
    train.py and NeMo AutoModel's train_ft.py call it once per gradient-accumulation step, the optimizer after the
    last): `make`'s order for m / rounds micro-batches and rounds times the mini-batches (its expert-parallel
    pairs per flush), each round's micro-batches numbered after the previous round's (a model copy's, DualPipe's,
    after its own), every update but the last round's left out, then the replicas' synchronisation once a
    mini-batch and the passes' collectives (`make_schedule`'s passes). A method that never flushes (a weight
    policy other than SYNCHRONOUS) has no rounds to run."""
    rounds, share = params.rounds, params.microbatches // params.rounds
    try:
        one = make(replace(params, microbatches=share, minibatches=params.minibatches * rounds, rounds=1,
                           data_parallel=1, zero=0, context_parallel=1, reduce_after_flush=False))
    except ScheduleError as error:
        raise ScheduleError(f"--rounds {rounds}: each round runs m / rounds = {share:,} micro-batches, and {error}") \
            from None
    if one.policy != SYNCHRONOUS:
        raise ScheduleError(f"--rounds: {one.method} never flushes, and a round is a flush of a synchronous schedule: "
                            "leave --rounds out, or give gpipe, 1f1b, interleaved-1f1b, zb-h1, ...")
    t, copies = one.table, one.graph.copies
    round_of, per_copy = t.minibatch.astype(np.int64) % rounds, share // copies
    copy, place = np.divmod(t.microbatch.astype(np.int64), per_copy)
    microbatch = np.where(t.microbatch >= 0, (copy * rounds + round_of) * per_copy + place, -1)
    kept = ~kind_mask(t.kind, *COLLECTIVE_KINDS) & ((t.kind != KIND_CODE[Kind.OPT]) | (round_of == rounds - 1))
    table = ActionTable(t.device[kept], t.kind[kept], t.stage[kept], microbatch[kept].astype(FIELD_DTYPE),
                        (t.minibatch[kept] // rounds).astype(FIELD_DTYPE), t.pipeline[kept], t.peer[kept])
    merged = Schedule(one.method, one.graph, one.placement, OrderView(table, one.num_devices), one.policy,
                      params.microbatches, params.minibatches, one.pipelines,
                      params={f.name: getattr(params, f.name) for f in fields(params)})
    return add_context_parallel(add_expert_parallel(add_data_parallel(merged)))


def interleave_1f1b(count: int, warmup: int) -> tuple[np.ndarray, np.ndarray]:
    """The 1F1B pattern over `count` units as arrays (is backward, unit position): `warmup` forwards,
    then one forward and one backward in turn, then the remaining backwards. warmup >= count is GPipe's
    all forwards, then all backwards."""
    backward, position = interleave_1f1b_rows(count, np.array([warmup]))
    return backward[0], position[0]


def interleave_1f1b_rows(count: int, warmups: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """`interleave_1f1b` for many rows at once, row r's warm-up `warmups[r]`: (rows, 2·count) arrays. Position j
    of a row's pattern is a warm-up forward (j < w), a cool-down backward (j >= 2·count − w), or in between a
    forward (even j − w) or a backward (odd j − w) of the pair (j − w) // 2."""
    w = np.minimum(warmups, count)[:, None]
    j = np.arange(2 * count)[None, :]
    pair, second = (j - w) >> 1, (j - w) & 1  # divmod by 2 (floored, as an arithmetic shift is), without dividing
    backward = (j >= 2 * count - w) | ((j >= w) & (second == 1))
    position = np.where(j < w, j, np.where(j >= 2 * count - w, j - count, pair + w * (1 - second)))
    return backward, position


_F, _B, _OPT, _PRED = (KIND_CODE[k] for k in (Kind.F, Kind.B, Kind.OPT, Kind.PRED))


def flushed_1f1b(
    params: ScheduleParams, warmup: Callable[[int], int], placement: Sequence[int] | None = None
) -> ActionTable:
    """Stage k (on device placement[k], default k; one stage per device) runs `interleave_1f1b(m,
    warmup(k))` then its update, once per mini-batch. Built for all stages at once (`interleave_1f1b_rows`)."""
    m, n = params.microbatches, params.minibatches
    placement = np.asarray(placement if placement is not None else range(params.stages), dtype=FIELD_DTYPE)
    stages = np.argsort(placement, kind="stable")  # in device order
    backward, position = interleave_1f1b_rows(m, np.array([warmup(int(k)) for k in stages]))
    per_step = len(stages), n, 2 * m + 1  # a mini-batch: the pattern, then the update

    def each_step(pattern: np.ndarray, update: int, dtype: type = FIELD_DTYPE) -> np.ndarray:
        row = np.concatenate([pattern, np.full((len(stages), 1), update)], axis=1).astype(dtype)
        return np.broadcast_to(row[:, None, :], per_step).ravel()

    rows_per_stage = n * (2 * m + 1)
    return ActionTable(np.repeat(placement[stages], rows_per_stage),
                       each_step(np.where(backward, _B, _F), _OPT, KIND_DTYPE),
                       np.repeat(stages.astype(FIELD_DTYPE), rows_per_stage), each_step(position, -1),
                       np.broadcast_to(np.arange(n, dtype=FIELD_DTYPE)[None, :, None], per_step).ravel(),
                       np.zeros(len(stages) * rows_per_stage, dtype=FIELD_DTYPE),
                       np.full(len(stages) * rows_per_stage, -1, dtype=FIELD_DTYPE))


def gpipe(params: ScheduleParams) -> Schedule:
    """All forwards, then all backwards, then a flush and one update per mini-batch."""
    require_plain("gpipe", params)
    return make_schedule("gpipe", params, flushed_1f1b(params, lambda k: params.microbatches))


def one_f_one_b(params: ScheduleParams) -> Schedule:
    """PipeDream-Flush / DAPPLE: min(p-k-1, m) warm-up forwards, 1F1B, cool-down; flush; update."""
    require_plain("1f1b", params)
    return make_schedule("1f1b", params, flushed_1f1b(params, lambda k: params.stages - k - 1))


def pipedream_order(method: str, params: ScheduleParams, policy: WeightPolicy) -> Schedule:
    """PipeDream's order: 1F1B across mini-batches with no flush (warm-up p-k-1), each stage updating
    after a mini-batch's last backward. A PRED comes before every op the policy predicts for (with
    bellwether reads, only before micro-batch 0's, whose weights the mini-batch reuses)."""
    require_plain(method, params)
    p, m, n = params.stages, params.microbatches, params.minibatches
    backward, position = interleave_1f1b_rows(n * m, p - np.arange(p) - 1)  # row k: stage k, on device k
    minibatch, microbatch = np.repeat(np.arange(n), m)[position], np.tile(np.arange(m), n)[position]  # divmod by m
    predicted = np.zeros(backward.shape, bool)
    for side, read, prediction in ((~backward, policy.forward, policy.predict_forward),
                                   (backward, policy.backward, policy.predict_backward)):
        if prediction is not None:
            predicted |= side & ((microbatch == 0) if read is Read.BELLWETHER else True)
    # every stage's row one after another: an update right after its mini-batch's last backward, a PRED right
    # before each op it predicts for (an update before a PRED at one spot), of the stage and mini-batch of `of`
    after, spots = np.flatnonzero(backward & (microbatch == m - 1)) + 1, np.flatnonzero(predicted)
    before, of = np.concatenate([after, spots]), np.concatenate([after - 1, spots])
    passes = ActionTable.from_device_rows(np.where(backward, _B, _F), np.arange(p)[:, None], microbatch, minibatch)
    return make_schedule(method, params, passes.with_rows(
        before, of, kind=np.repeat([_OPT, _PRED], [len(after), len(spots)]),
        microbatch=np.concatenate([np.full(len(after), -1), passes.microbatch[spots]])), policy)


PIPEDREAM_POLICY = WeightPolicy(forward=Read.LATEST, backward=Read.STASHED)


def pipedream(params: ScheduleParams) -> Schedule:
    """1F1B across mini-batches with no flush; a backward uses the weights its forward stashed."""
    return pipedream_order("pipedream", params, PIPEDREAM_POLICY)


BASELINES = (
    Method("gpipe", "GPipe: all forwards, then all backwards; flush and update per mini-batch", gpipe),
    Method("1f1b", "1F1B (PipeDream-Flush, DAPPLE): warm-up, one forward one backward, flush", one_f_one_b,
           p2p_sync=True),
    Method("pipedream", "PipeDream: asynchronous 1F1B without flush; weight stashing, staleness ⌈(p-1-k)/m⌉ "
                        "mini-batches", pipedream),
)
