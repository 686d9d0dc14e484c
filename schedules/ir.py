"""The schedule IR: actions, the stage graph, weight policies and schedules.

An `Action` is one unit of work on one device. Its text form extends torch.distributed.pipelining's
(`2F0` = stage 2, forward, micro-batch 0) with the mini-batch, the pipeline replica and, for transfers,
the peer stage:

    [P<pipeline>:]<stage><KIND>[<micro-batch>][.<mini-batch>][>|<<peer>]

e.g. `2F0.3` (mini-batch 3), `P1:0B5`, `1OPT.2`, `1REDUCE.2`, `1GATHER.2`, `0SEND_F4>1`, `1RECV_F4<0`,
`2A2A_F5` (stage 2's all-to-alls after its forward of micro-batch 5), `2RING_F5` (its key/value ring's exchanges
during that forward).

An *overlapped pair* (DeepSeek-V3's F&B, torch's `OVERLAP_F_B`) is one action of two parts: a forward of one
micro-batch and a full backward of another, run together on one device (DualPipe overlaps each part's
communication with the other's compute). A device's order holds its parts next to each other, forward first,
each naming the other's stage as its `peer` (`0F7&7`, `7B3&0`); a schedule's text writes the pair as torch
does, `(0F7;7B3)OVERLAP_F_B`. Its receives come before it and its sends after it, and what it costs is the
simulator's to say.
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass, field
from enum import Enum
from functools import cache, cached_property
from types import CodeType
from typing import TYPE_CHECKING, Any, Mapping, NamedTuple, Sequence

if TYPE_CHECKING:
    from .table import ActionTable


class ScheduleError(ValueError):
    """A schedule or its parameters cannot run; the message says what and why."""


class Kind(str, Enum):
    F = "F"  # forward
    B = "B"  # full backward (input and weight gradients)
    I = "I"  # input-gradient half of a split backward  # noqa: E741
    W = "W"  # weight-gradient half of a split backward
    OPT = "OPT"  # optimizer step of one stage
    PRED = "PRED"  # compute predicted weights
    AVG = "AVG"  # average weights or gradients across pipelines
    REDUCE = "REDUCE"  # all-reduce (sharded optimizer: reduce-scatter) a stage's gradients over its d replicas
    GATHER = "GATHER"  # all-gather a stage's updated weight shards over its d replicas (sharded optimizer)
    A2A_F = "A2A_F"  # a forward's all-to-alls over the expert-parallel group (its experts' dispatch and combine)
    A2A_B = "A2A_B"  # a backward's (B or I) all-to-alls: the routed tokens' gradients back and forth
    RING_F = "RING_F"  # a forward's key/value exchanges around the context-parallel ring, under its attention
    RING_B = "RING_B"  # a backward's (B or I): the keys and values again and their gradients, under its attention
    SEND_F = "SEND_F"  # send a forward activation to `peer`
    RECV_F = "RECV_F"  # receive a forward activation from `peer`
    SEND_B = "SEND_B"  # send an input gradient to `peer`
    RECV_B = "RECV_B"  # receive an input gradient from `peer`

    def __str__(self) -> str:
        return self.value


COMPUTE_KINDS = frozenset({Kind.F, Kind.B, Kind.I, Kind.W, Kind.OPT, Kind.PRED, Kind.AVG, Kind.REDUCE,
                           Kind.GATHER, Kind.A2A_F, Kind.A2A_B, Kind.RING_F, Kind.RING_B})
ALL_TO_ALL_KINDS = frozenset({Kind.A2A_F, Kind.A2A_B})  # across an expert-parallel group (`passes.add_expert_parallel`)
RING_KINDS = frozenset({Kind.RING_F, Kind.RING_B})  # around a context-parallel group (`passes.add_context_parallel`)
# A pass's own collectives, in rows right after it: its output is sent, and its device's next row starts, once
# they are done
PASS_COLLECTIVE_KINDS = ALL_TO_ALL_KINDS | RING_KINDS
# run on the device's network stream: the data-parallel replicas' collectives and the passes' own
COLLECTIVE_KINDS = frozenset({Kind.REDUCE, Kind.GATHER}) | PASS_COLLECTIVE_KINDS
BACKWARD_KINDS = frozenset({Kind.B, Kind.I, Kind.W})
SEND_KINDS = frozenset({Kind.SEND_F, Kind.SEND_B})
RECV_KINDS = frozenset({Kind.RECV_F, Kind.RECV_B})

_ACTION_RE = re.compile(
    r"^(?:P(?P<pipeline>\d+):)?(?P<stage>\d+)"
    r"(?P<kind>SEND_F|RECV_F|SEND_B|RECV_B|A2A_F|A2A_B|RING_F|RING_B|OPT|PRED|AVG|REDUCE|GATHER|F|B|I|W)"
    r"(?P<microbatch>\d+)?(?:\.(?P<minibatch>\d+))?(?:(?P<dir>[<>&])(?P<peer>\d+))?$"
)
OVERLAP_F_B = "OVERLAP_F_B"  # torch.distributed.pipelining's name, and the suffix of a pair's text
_OVERLAP_RE = re.compile(r"^\((?P<forward>[^;()]+);(?P<backward>[^;()]+)\)" + OVERLAP_F_B + "$")


OVERLAP_KINDS = frozenset({Kind.F, Kind.B})  # the kinds of an overlapped pair's parts


class Action(NamedTuple):
    """One unit of work. A tuple, so that millions of them stay cheap to build, hash and compare.

    `microbatch` is -1 for per-mini-batch work (OPT, AVG, REDUCE, GATHER, a mini-batch-wide PRED); `peer` is the other
    stage of a transfer, or of an overlapped pair's other part (`overlapped`), and -1 otherwise.
    """

    kind: Kind
    stage: int
    microbatch: int = -1
    minibatch: int = 0
    pipeline: int = 0
    peer: int = -1

    def __str__(self) -> str:
        text = f"{self.stage}{self.kind.value}"
        if self.microbatch >= 0:
            text += str(self.microbatch)
        if self.minibatch:
            text += f".{self.minibatch}"
        if self.peer >= 0:
            text += (">" if self.kind in SEND_KINDS else "<" if self.kind in RECV_KINDS else "&") + str(self.peer)
        return f"P{self.pipeline}:{text}" if self.pipeline else text

    @classmethod
    def parse(cls, text: str) -> Action:
        match = _ACTION_RE.match(text.strip())
        if match is None:
            raise ScheduleError(
                f"cannot parse action {text!r}: expected [P<pipeline>:]<stage><KIND>[<micro-batch>]"
                f"[.<mini-batch>][>|<|&<peer>] with KIND one of {', '.join(k.value for k in Kind)}"
            )
        kind = Kind(match["kind"])
        direction = match["dir"]
        wanted = ">" if kind in SEND_KINDS else "<" if kind in RECV_KINDS else None
        if direction != wanted and not (direction == "&" and kind in OVERLAP_KINDS):
            raise ScheduleError(
                f"action {text!r}: a SEND names its destination with '>peer', a RECV its source with "
                "'<peer', a part of an overlapped pair (F or B) its other part's stage with '&peer'; other actions "
                "have no peer"
            )
        return cls(
            kind,
            int(match["stage"]),
            int(match["microbatch"]) if match["microbatch"] is not None else -1,
            int(match["minibatch"] or 0),
            int(match["pipeline"] or 0),
            int(match["peer"]) if match["peer"] is not None else -1,
        )


def overlapped(forward: Action, backward: Action) -> tuple[Action, Action]:
    """The two parts of one overlapped pair (F&B), in a device's order: `forward` then `backward`, each naming the
    other's stage as its peer. They belong to one mini-batch of one pipeline and are different micro-batches'
    work (DualPipe pairs a forward with an earlier micro-batch's backward)."""
    if (forward.kind is not Kind.F or backward.kind is not Kind.B or forward.peer >= 0 or backward.peer >= 0
            or (forward.minibatch, forward.pipeline) != (backward.minibatch, backward.pipeline)
            or (forward.stage, forward.microbatch) == (backward.stage, backward.microbatch)):
        raise ScheduleError(f"an overlapped pair is a forward and a full backward of one mini-batch and pipeline, "
                            f"each of its own unit, neither paired yet (got {forward} and {backward})")
    return forward._replace(peer=backward.stage), backward._replace(peer=forward.stage)


def is_pair(forward: Action, backward: Action) -> bool:
    """Whether `forward` then `backward` are the two parts of one overlapped pair, as `overlapped` makes them."""
    return (forward.kind is Kind.F and backward.kind is Kind.B and forward.peer == backward.stage >= 0
            and backward.peer == forward.stage and (forward.minibatch, forward.pipeline)
            == (backward.minibatch, backward.pipeline))


def order_tokens(order: Sequence[Action]) -> list[str]:
    """A device's order as text tokens: one per action, an overlapped pair as torch writes it,
    `(0F7;7B3)OVERLAP_F_B` (a part without its partner next to it keeps its own form, `0F7&7`)."""
    tokens: list[str] = []
    i = 0
    while i < len(order):
        a = order[i]
        if i + 1 < len(order) and is_pair(a, order[i + 1]):
            tokens.append(f"({a._replace(peer=-1)};{order[i + 1]._replace(peer=-1)}){OVERLAP_F_B}")
            i += 2
        else:
            tokens.append(str(a))
            i += 1
    return tokens


def parse_token(text: str) -> tuple[Action, ...]:
    """The actions one text token holds: one, or an overlapped pair's two parts."""
    pair = _OVERLAP_RE.match(text.strip())
    if pair is None:
        return (Action.parse(text),)
    return overlapped(Action.parse(pair["forward"]), Action.parse(pair["backward"]))


@dataclass(frozen=True)
class StageGraph:
    """Model stages and the edges activations flow along: a chain by default, a DAG for GraphPipe.

    `copies` > 1: the stages are that many copies of one model's n = num_stages / copies stages (copy c's stage s
    is stage c·n + s, with copy 0's edges shifted by c·n), each copy fed its own share of every mini-batch's
    micro-batches (`Schedule.copy_of_microbatch`); a stage's copies hold the same weights, their gradients summed
    before each update. DualPipe feeds two copies from the two ends of the devices (DeepSeek-V3's report, 3.2.1).
    """

    num_stages: int
    edges: tuple[tuple[int, int], ...]
    copies: int = 1
    preds: tuple[tuple[int, ...], ...] = field(init=False, repr=False, compare=False)
    succs: tuple[tuple[int, ...], ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.num_stages < 1:
            raise ScheduleError(f"a stage graph needs at least one stage (got {self.num_stages})")
        preds: list[list[int]] = [[] for _ in range(self.num_stages)]
        succs: list[list[int]] = [[] for _ in range(self.num_stages)]
        for src, dst in self.edges:
            if not (0 <= src < self.num_stages and 0 <= dst < self.num_stages) or src == dst:
                raise ScheduleError(f'"edges": give [from, to] pairs of distinct stages 0..{self.num_stages - 1} '
                                    f"(got [{src}, {dst}])")
            if dst in succs[src]:  # a second transfer of the same tensor: one more buffer counted, no other effect
                raise ScheduleError(f'"edges": give each [from, to] pair once (got [{src}, {dst}] twice)')
            succs[src].append(dst)
            preds[dst].append(src)
        object.__setattr__(self, "preds", tuple(tuple(p) for p in preds))
        object.__setattr__(self, "succs", tuple(tuple(s) for s in succs))
        self.topological_order()
        self._check_copies()
        self._check_connected()

    @property
    def stages_per_copy(self) -> int:
        return self.num_stages // self.copies

    def copy_of(self, stage: int) -> int:
        return stage // self.stages_per_copy

    def _check_copies(self) -> None:
        """Every copy has copy 0's edges, shifted to its own stages, and no edge joins two copies."""
        if self.copies < 1 or self.num_stages % self.copies:
            raise ScheduleError(f"a stage graph of {self.copies} model copies needs a multiple of {self.copies} "
                                f"stages (got {self.num_stages})")
        n = self.stages_per_copy
        first = sorted((a, b) for a, b in self.edges if b < n)
        wanted = sorted((a + c * n, b + c * n) for c in range(self.copies) for a, b in first)
        if self.copies > 1 and sorted(self.edges) != wanted:
            raise ScheduleError(f"a stage graph of {self.copies} model copies holds copy 0's edges {first} shifted "
                                f"to each copy's {n} stages, and no edge between copies (got {sorted(self.edges)})")

    def _check_connected(self) -> None:
        """One model: its stages (each copy's) joined by edges (either way) into one graph; else the message names
        the parts."""
        part = [-1] * self.num_stages
        parts: list[list[int]] = []
        for first in range(self.num_stages):
            if part[first] >= 0:
                continue
            part[first], members, todo = len(parts), [first], [first]
            while todo:
                stage = todo.pop()
                for other in (*self.preds[stage], *self.succs[stage]):
                    if part[other] < 0:
                        part[other] = len(parts)
                        members.append(other)
                        todo.append(other)
            parts.append(sorted(members))
        if len(parts) > self.copies:
            named = ", ".join(map(str, parts[:-1])) + f" and {parts[-1]}"
            raise ScheduleError(f"stage graph is not connected: no edges join its {len(parts)} parts, stages {named}; "
                                "one model's stages must form one graph")

    @classmethod
    @cache
    def chain(cls, num_stages: int, copies: int = 1) -> StageGraph:
        """A chain of `num_stages` stages; `copies` chains of num_stages / copies stages each. Kept per shape: a
        graph is immutable, and every schedule of a chain (thousands in one tune) asks for its own."""
        n = num_stages // copies
        return cls(num_stages, tuple((c * n + k, c * n + k + 1) for c in range(copies) for k in range(n - 1)),
                   copies)

    def topological_order(self) -> list[int]:
        """Stages with every predecessor first; raises on a cycle, naming the stages on it."""
        indegree = [len(p) for p in self.preds]
        ready = [k for k in range(self.num_stages) if indegree[k] == 0]
        order: list[int] = []
        while ready:
            k = ready.pop()
            order.append(k)
            for nxt in self.succs[k]:
                indegree[nxt] -= 1
                if indegree[nxt] == 0:
                    ready.append(nxt)
        if len(order) < self.num_stages:
            cyclic = sorted(set(range(self.num_stages)) - set(order))
            raise ScheduleError(f"stage graph has a cycle through stages {cyclic}")
        return order


class Read(str, Enum):
    """Which weight version an action reads."""

    LATEST = "latest"  # the stage's weights as they are when the action runs
    STASHED = "stashed"  # the version its micro-batch's forward read (weight stashing)
    PREVIOUS = "previous"  # double buffering: every op of mini-batch b reads version b - 1 (PipeDream-2BW)
    BELLWETHER = "bellwether"  # the version its mini-batch's first forward read on this stage (XPipe)


_FORMULA_NODES = (ast.Expression, ast.BinOp, ast.UnaryOp, ast.Name, ast.Constant, ast.Load, ast.Add, ast.Sub,
                  ast.Mult, ast.FloorDiv, ast.USub)


COUNTED = "counted"
# Where a prediction distance s can come from: a paper's closed form, its authors' code, or the count of updates
# in the order (always available). Each is a choice of `ScheduleParams.prediction`.
PREDICTION_SOURCES = ("paper", "code", COUNTED)


@dataclass(frozen=True)
class Prediction:
    """The op runs on weights predicted `s` updates ahead (XPipe, SpecTrain, PipeOptim).

    `forms` maps each source that states s in closed form ("paper", "code") to that form, in p (stages),
    k (stage) and m (micro-batches), such as "k//2 + p-k-1". The source "counted" is implied: s counted from
    the order, the updates between the op's weight read and the update that consumes its gradient. Sources
    disagree, and the choice changes training, so all are kept and the policy says which one is in use.
    """

    forms: Mapping[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for source, text in self.forms.items():
            if source not in PREDICTION_SOURCES or source == COUNTED:
                raise ScheduleError(f"prediction source {source!r}: a closed form comes from one of "
                                    f"{', '.join(s for s in PREDICTION_SOURCES if s != COUNTED)}")
            _check_formula(text)


def _check_formula(text: str) -> ast.Expression:
    try:
        tree = ast.parse(text, mode="eval")
    except SyntaxError:
        tree = None
    if tree is None or not all(isinstance(node, _FORMULA_NODES) for node in ast.walk(tree)) or any(
        isinstance(node, ast.Name) and node.id not in ("p", "k", "m") for node in ast.walk(tree)
    ) or any(isinstance(node, ast.Constant) and type(node.value) is not int for node in ast.walk(tree)):
        raise ScheduleError(f"prediction formula {text!r}: use integers, p, k, m, + - * // and parentheses")
    return tree


@cache
def _compiled(text: str) -> CodeType:
    """A prediction formula, checked and compiled once: `weight_versions` evaluates it for every stage."""
    return compile(_check_formula(text), "<formula>", "eval")


def evaluate_formula(text: str, p: int, k: int, m: int) -> int:
    """The value of a prediction formula (checked to hold only integer arithmetic on p, k and m)."""
    return int(eval(_compiled(text), {"__builtins__": {}}, {"p": p, "k": k, "m": m}))


@dataclass(frozen=True)
class WeightPolicy:
    """A method's weight semantics as data; `schedules.analysis.weight_versions` interprets it.

    `forward` / `backward`: which version F and the backward parts read. `predict_forward` /
    `predict_backward`: how far ahead the weights those ops run on are predicted, if at all, by source.
    `primary_source`: the source of s the method publishes, used unless `chosen_source` names another.
    `extra_copies`: weight copies held besides the versions in use (the buffer predicted weights are
    written to; AvgPipe's reference model). `master_copies`: of those, the copies of the weights as the optimizer
    owns them (AvgPipe's reference, which elastic averaging pulls with the masters: float32 where 16-bit weights
    train in mixed precision, `StageCosts.owned_weight_bytes`); the rest are as the passes read them.
    """

    forward: Read = Read.LATEST
    backward: Read = Read.LATEST
    predict_forward: Prediction | None = None
    predict_backward: Prediction | None = None
    extra_copies: int = 0
    master_copies: int = 0
    primary_source: str = COUNTED
    chosen_source: str | None = None

    def __post_init__(self) -> None:
        if not 0 <= self.master_copies <= self.extra_copies:
            raise ScheduleError(f"master_copies ({self.master_copies}) counts some of extra_copies "
                                f"({self.extra_copies}): from 0 to it")
        sides = self._predicted_sides
        if len(sides) == 2 and set(sides[0].forms) != set(sides[1].forms):
            raise ScheduleError("a policy that predicts for F and for the backward needs closed forms from the same "
                                f"sources on both sides (got {sorted(sides[0].forms)} and {sorted(sides[1].forms)})")
        if not sides and self.chosen_source is not None:
            raise ScheduleError(f"chosen_source {self.chosen_source!r}: this policy predicts no weights")
        for name, source in (("primary_source", self.primary_source), ("chosen_source", self.chosen_source)):
            if sides and source is not None and source not in self.sources:
                raise ScheduleError(f"{name} {source!r}: this policy records {', '.join(self.sources)}")

    @property
    def _predicted_sides(self) -> list[Prediction]:
        return [p for p in (self.predict_forward, self.predict_backward) if p is not None]

    @property
    def sources(self) -> tuple[str, ...]:
        """The sources of s this policy can use, in PREDICTION_SOURCES' order; none without prediction."""
        sides = self._predicted_sides
        return tuple(s for s in PREDICTION_SOURCES if sides and (s == COUNTED or s in sides[0].forms))

    @property
    def source(self) -> str | None:
        """The source s is taken from: the chosen one, else the primary; None without prediction."""
        return (self.chosen_source or self.primary_source) if self.sources else None

    def formula(self, prediction: Prediction) -> str | None:
        """The closed form `prediction` (one of this policy's sides) has under the source in use; None: counted."""
        return prediction.forms.get(self.source)

    def describe(self) -> dict[str, Any]:
        """Plain data for trace metadata."""
        def prediction(p: Prediction | None) -> dict[str, str] | None:
            return None if p is None else dict(p.forms)

        return {"forward": self.forward.value, "backward": self.backward.value,
                "predict_forward": prediction(self.predict_forward),
                "predict_backward": prediction(self.predict_backward), "primary_source": self.primary_source,
                "prediction_source": self.source, "extra_copies": self.extra_copies,
                "master_copies": self.master_copies}


SYNCHRONOUS = WeightPolicy()


@dataclass(frozen=True)
class Schedule:
    """What every device runs, in which order, on which weights.

    `placement[stage]` is the device a model stage lives on; every pipeline replica uses the same
    placement. `orders[device]` is the device's action list, executed strictly in order. Every stage runs on
    `data_parallel` replicas (d, from `params`) that train on their own micro-batches and average their
    gradients in its REDUCE rows (`passes.add_data_parallel`).
    """

    method: str
    graph: StageGraph
    placement: tuple[int, ...]
    orders: Sequence[Sequence[Action]]  # tuples of Actions, or a table-backed OrderView
    policy: WeightPolicy
    microbatches: int
    minibatches: int = 1
    pipelines: int = 1
    params: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if len(self.placement) != self.graph.num_stages:
            raise ScheduleError(
                f"placement names {len(self.placement)} stages, the stage graph has {self.graph.num_stages}"
            )
        bad = [s for s, d in enumerate(self.placement) if not 0 <= d < len(self.orders)]
        if bad:
            raise ScheduleError(f"stages {bad} are placed on devices outside 0..{len(self.orders) - 1}")
        if self.microbatches % self.graph.copies:
            raise ScheduleError(f"{self.method}: {self.graph.copies} model copies share each mini-batch's "
                                f"micro-batches evenly: m must be a multiple of {self.graph.copies} (got "
                                f"{self.microbatches})")

    def copy_of_microbatch(self, microbatch: int) -> int:
        """The model copy (`StageGraph.copies`) that runs `microbatch`: copy c the c-th m / copies of them."""
        return microbatch // (self.microbatches // self.graph.copies)

    @property
    def rounds(self) -> int:
        """The flushes each mini-batch's micro-batches run in before its update (`ScheduleParams.rounds`)."""
        return int(self.params.get("rounds", 1))

    def round_of_microbatch(self, microbatch):
        """The round (`rounds`) that runs `microbatch` (an int or an array of them): within its model copy's
        m / copies, round r the r-th m / (copies·rounds) of them, as `methods.in_rounds` numbers them."""
        per_copy = self.microbatches // self.graph.copies
        return microbatch % per_copy // (per_copy // self.rounds)

    @property
    def num_devices(self) -> int:
        return len(self.orders)

    @property
    def num_stages(self) -> int:
        return self.graph.num_stages

    @cached_property
    def table(self) -> ActionTable:
        """The actions as columns, built once; checks and lowering share it."""
        from .table import ActionTable

        return ActionTable.of(self)

    @property
    def data_parallel(self) -> int:
        """d: the replicas of every pipeline that train on their own data (1 when `params` does not say)."""
        return int(self.params.get("data_parallel", 1))

    @property
    def gradient_ranks(self) -> int:
        """The ranks that hold each stage's same weights and reduce (and with ZeRO shard) its gradients: the d
        replicas times the C context-parallel ranks each device stands for (`ScheduleParams.context_parallel`),
        times the model copies that hold each of its stages (`StageGraph.copies`)."""
        return self.data_parallel * int(self.params.get("context_parallel", 1)) * self.graph.copies

    @property
    def expert_parallel(self) -> int:
        """E: the ranks a mixture of experts' routed experts are placed over (`ScheduleParams.expert_parallel`),
        whose all-to-alls follow every forward and backward (`passes.add_expert_parallel`)."""
        return int(self.params.get("expert_parallel", 1))

    @property
    def context_parallel(self) -> int:
        """C: the ranks each device stands for that split every micro-batch's sequence
        (`ScheduleParams.context_parallel`), whose key/value rings run under every forward and backward
        (`passes.add_context_parallel`)."""
        return int(self.params.get("context_parallel", 1))

    @property
    def zero(self) -> int:
        """ZeRO's stage over the d replicas (`ScheduleParams.zero`): 0 none, 1 the optimizer state sharded, 2 the
        gradients too, 3 the weights too."""
        return int(self.params.get("zero", 0))

    @property
    def sharded_optimizer(self) -> bool:
        """Whether each of the d replicas keeps 1/d of the optimizer state (ZeRO-1 and up): its REDUCE is a
        reduce-scatter, and a GATHER of the updated weights follows its OPT (ZeRO-3: precedes the passes that
        compute with them, `passes.gathered_passes`)."""
        return self.zero >= 1

    @property
    def reduce_after_flush(self) -> bool:
        """Whether a device's REDUCE rows wait for its last backward before the update, not its stage's."""
        return bool(self.params.get("reduce_after_flush", False))

    def stages_on(self, device: int) -> list[int]:
        return list(self.stages_by_device[device])

    @cached_property
    def stages_by_device(self) -> tuple[tuple[int, ...], ...]:
        """Per device, the stages placed on it, found once: tune asks for every device of hundreds of orders."""
        stages: list[list[int]] = [[] for _ in range(self.num_devices)]
        for stage, device in enumerate(self.placement):
            stages[device].append(stage)
        return tuple(map(tuple, stages))

    def to_text(self) -> str:
        """One line per device: `device: action action ...`; `from_text` reads it back."""
        return "\n".join(f"{d}: " + " ".join(order_tokens(order)) for d, order in enumerate(self.orders))

    def with_orders(self, orders: tuple[tuple[Action, ...], ...]) -> Schedule:
        return Schedule(
            self.method, self.graph, self.placement, orders, self.policy,
            self.microbatches, self.minibatches, self.pipelines, self.params,
        )

    @staticmethod
    def orders_from_text(text: str) -> tuple[tuple[Action, ...], ...]:
        """Parse the per-device lines written by `to_text`."""
        orders = []
        for number, line in enumerate(filter(str.strip, text.splitlines())):
            device, sep, rest = line.partition(":")
            if not sep or device.strip() != str(number):
                raise ScheduleError(f"line {number + 1}: expected '{number}: <actions>'")
            orders.append(tuple(a for token in rest.split() for a in parse_token(token)))
        return tuple(orders)
