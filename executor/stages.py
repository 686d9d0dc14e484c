"""The model cut into the schedule's stages: contiguous layer ranges, one module per stage (several inputs
and outputs where the layers form a DAG, as GraphPipe's stages do), the data every rank draws alike, and what
crosses each stage edge: the layer outputs a later stage reads, as one flat tensor.

Every rank builds the whole model from one seed, so a stage's initial weights equal those of the same layers
in a single-process run, whichever rank holds it. A schedule of several model copies (DualPipe's two:
`StageGraph.copies`) cuts the model once, into one copy's stages; every copy's stage s holds stage s's layers.
"""

from __future__ import annotations

import bisect
import copy
import itertools
import math
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

import torch
from torch import nn

from ..profiles.partition import starts_refusal
from ..profiles.schema import RECV_WINDOW
from ..profiles.workload import follows_flags
from ..schedules import Schedule, StageGraph
from ..workload.models import BATCH, Model, build_model, tied_layers

DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16, "float16": torch.float16}


class ExecutorError(RuntimeError):
    """A run that cannot start or could not finish; one line saying which part and why."""


class DivergedError(ExecutorError):
    """The loss went non-finite: the training diverged (bad input, not a fault of the run). `losses`: per
    pipeline, the loss of each mini-batch that finished before it, in order (known where every rank is a thread
    of this process; [] where not), so a study can draw a diverged run up to where it left."""

    def __init__(self, message: str, losses: list[list[float]] | None = None) -> None:
        super().__init__(message)
        self.losses = losses or []


def even_bounds(layers: int, stages: int) -> list[int]:
    """Layer boundaries of `stages` contiguous ranges as even as can be (earlier stages take the extra layers):
    stage k holds layers bounds[k]:bounds[k+1]."""
    if not 1 <= stages <= layers:
        raise ExecutorError(f"cannot cut {layers} layers into {stages} stages: each stage needs at least one layer")
    base, extra = divmod(layers, stages)
    bounds = [0]
    for k in range(stages):
        bounds.append(bounds[-1] + base + (1 if k < extra else 0))
    return bounds


def check_bounds(bounds: Sequence[int], layers: int, stages: int) -> list[int]:
    """`bounds` as ints, refused unless they cut `layers` into `stages`: a stage between the first and the last
    may hold no layer (a Megatron-core layout's empty stage, which passes its input on: `StageModule`)."""
    bounds = [int(b) for b in bounds]
    if len(bounds) != stages + 1 or bounds[0] != 0 or bounds[-1] != layers or any(
            a > b for a, b in zip(bounds, bounds[1:])) or bounds[1] == 0 or bounds[-2] == layers:
        raise ExecutorError(f"stage bounds {bounds}: expected {stages + 1} layer indices rising from 0 to "
                            f"{layers}, the first and last stages holding at least one layer")
    return bounds


@dataclass(frozen=True)
class RunSpec:
    """What one run trains and how: everything a rank needs to rebuild the same setup on its own (picklable as
    long as `model` is a name or a module-level callable returning a Model).

    `model`: a built-in name or `package.module:attr` (with `model_options`), or a callable returning a
    Model. `bounds`: the stage partition (default: an even split of the layers, or the most even
    split the stage graph carries). `microbatch_size`: samples
    per micro-batch. `recv_window`: how many receives a rank keeps posted ahead of the row it runs. `heldout`:
    score the trained model on its held-out set after the run (a run timed for its rows alone needs no score: the
    default gpt's is one forward of 256 x 128 tokens, about 11 CPU s, more than a short run's training), recorded
    in the trace's meta as `score_heldout`, so that a reader tells a run not scored from one whose model has no
    held-out set. `rank_order`: how the processes' ranks are numbered over the replicas' devices (executor/
    replicas.py `Layout`), recorded in the trace's meta.
    """

    schedule: Schedule
    model: str | Callable[[], Model] = "mlp"
    model_options: dict[str, int] = field(default_factory=dict)
    microbatch_size: int = 4
    optimizer: str = "sgd"
    lr: float = 0.01
    seed: int = 0
    dtype: str = "float32"
    bounds: tuple[int, ...] | None = None
    threads_per_rank: int = 1
    timeout_s: float = 120.0
    recv_window: int = RECV_WINDOW
    heldout: bool = True
    rank_order: str = "pipesim"

    @property
    def torch_dtype(self) -> torch.dtype:
        if self.dtype not in DTYPES:
            raise ExecutorError(f"dtype must be one of {', '.join(DTYPES)} (got {self.dtype!r})")
        return DTYPES[self.dtype]

    def build_model(self) -> Model:
        """The model, initialised from `seed`, in `dtype` (the same on every rank and in any reference)."""
        torch.manual_seed(self.seed)
        model = self.model() if callable(self.model) else build_model(self.model, **self.model_options)
        for layer in model.layers:
            layer.to(self.torch_dtype)
        return model


def microbatch_data(spec: RunSpec, model: Model, minibatch: int, microbatch: int, pipeline: int = 0,
                    replica: int = 0) -> tuple[torch.Tensor, Any]:
    """Micro-batch `microbatch` of mini-batch `minibatch` for pipeline `pipeline` in data-parallel replica
    `replica`: (input, target), drawn from a generator seeded by those numbers, so every rank (and a reference)
    draws the same samples. The d replicas' micro-batches are numbered one after another: replica q's j-th is
    the whole mini-batch's (q * m + j)-th, as one process training on d x m micro-batches draws it."""
    schedule = spec.schedule
    index = ((pipeline * schedule.minibatches + minibatch) * schedule.data_parallel + replica) * schedule.microbatches \
        + microbatch
    generator = torch.Generator().manual_seed(spec.seed * 1_000_003 + index)
    x, target = model.make_batch(spec.microbatch_size, generator)
    if x.is_floating_point():
        x = x.to(spec.torch_dtype)
    return x, target


Carried = list[tuple[int, tuple[int, ...]]]  # the layer outputs one stage edge carries: (layer, shape)


def _flat(tensors: list[torch.Tensor]) -> torch.Tensor:
    """What goes over an edge: its layer outputs as one flat tensor, sharing a lone contiguous output's memory yet
    not an autograd view of it (aten's `_unsafe_view`, as torch's matmul returns its reshaped result), since
    torch.distributed.pipelining's `stage_backward_input` detaches a middle stage's outputs in place, which a view
    refuses ("Can't detach views in-place"): every zero-bubble schedule of torch's failed on a stage that is
    neither first nor last. Not being a view, it has a version counter of its own, which autograd's check on the
    layer's saved output does not read: `_refuse_writes` reads it."""
    if len(tensors) > 1:
        return torch.cat([t.reshape(-1) for t in tensors])
    out = tensors[0]
    if not out.is_contiguous():
        return out.reshape(-1)
    flat = torch.ops.aten._unsafe_view(out, (-1,))
    if flat.grad_fn is not None:
        _refuse_writes(flat)
    return flat


def _refuse_writes(flat: torch.Tensor) -> None:
    """Refuse `flat`'s backward if it, or what was sent of it (a `detach()`, a slice: they share its version
    counter), was written in place since the forward: the layer's saved output, its memory, would have changed
    unseen, and the gradient with it. Held by weak reference: a backward from `flat` has it alive."""
    version, held = flat._version, weakref.ref(flat)

    def check(grad: torch.Tensor) -> None:
        now = held()
        if now is not None and now._version != version:
            raise ExecutorError("a stage's output was written in place after its forward: its backward would give "
                                "a wrong gradient (write to a copy of it)")

    flat.register_hook(check)


class StageModule(nn.Module):
    """Layers `first:last` of a model, wired as the model's `inputs` say.

    `forward(*inputs)` takes the batch (when one of its layers reads it), then one flat tensor per incoming
    stage edge holding the layer outputs `incoming[e]` lists; it returns one flat tensor per outgoing edge,
    holding `outgoing[e]`'s layer outputs (its own, or ones it passes on), or, on the last stage, the model's
    output. One tensor per edge, as the lowering has one transfer per edge and micro-batch."""

    def __init__(self, model: Model, first: int, last: int, reads_batch: bool, incoming: list[Carried],
                 outgoing: list[Carried]) -> None:
        super().__init__()
        self.layers = nn.ModuleList(model.layers[first:last])
        self.first = first
        self.wiring = [tuple(model.inputs[i]) for i in range(first, last)]
        self.reads_batch = reads_batch
        self.incoming, self.outgoing = incoming, outgoing

    def forward(self, *inputs: torch.Tensor) -> torch.Tensor | tuple[torch.Tensor, ...]:
        args = iter(inputs)
        outputs = {BATCH: next(args)} if self.reads_batch else {}
        for carried, flat in zip(self.incoming, args):
            offset = 0
            for layer, shape in carried:
                size = math.prod(shape)
                outputs[layer] = flat[offset:offset + size].view(shape)
                offset += size
        if not self.layers:  # an empty stage: Megatron-core's TransformerBlock of no layers clones its input
            outputs = {layer: out.clone() for layer, out in outputs.items()}
        for offset, (layer, reads) in enumerate(zip(self.layers, self.wiring)):
            outputs[self.first + offset] = layer(*(outputs[s] for s in reads))
        if self.outgoing:
            return tuple(_flat([outputs[layer] for layer, _ in carried]) for carried in self.outgoing)
        return outputs[self.first + len(self.layers) - 1]

    @cached_property
    def aliases(self) -> dict[str, str]:
        """Each further name of a tensor the stage holds under several (tied weights) -> the name its parameters
        and buffers give it first. Every forward runs through functional_call, whose tie_weights walks the whole
        module tree for these on each call (torch.nn.utils.stateless `_untie_named_tensors_map`): host time
        before the pass's first kernel, 0.1 ms of a six-layer gpt stage's 1.1 on a CPU; found once here."""
        first: dict[int, str] = {}
        aliases = {}
        for name, tensor in [*self.named_parameters(remove_duplicate=False),
                             *self.named_buffers(remove_duplicate=False)]:
            seen = first.setdefault(id(tensor), name)
            if seen != name:
                aliases[name] = seen
        return aliases


@dataclass
class Stages:
    """The model cut into the schedule's stages: `modules[k]` runs layers `bounds[k]:bounds[k+1]` (with several
    model copies, of p stages each, `bounds[k mod p]:bounds[k mod p + 1]`);
    `in_edges[k]` / `out_edges[k]` the stage edges into and out of stage k, in the order its module takes
    and returns them; `reads_batch[k]` whether it takes the batch first; `edge_shapes[e]` / `edge_dtypes[e]`
    what crosses edge e (its gradient comes back with the same)."""

    model: Model
    bounds: list[int]
    modules: list[StageModule]
    in_edges: list[list[tuple[int, int]]]
    out_edges: list[list[tuple[int, int]]]
    reads_batch: list[bool]
    edge_shapes: dict[tuple[int, int], tuple[int, ...]]
    edge_dtypes: dict[tuple[int, int], torch.dtype]
    outputs: LayerOutputs  # what `cut` read them from: another cut of the same spec may take it (`cut(outputs=)`)


def _path(graph: StageGraph, src: int, dst: int) -> list[int] | None:
    """The shortest path of stages from `src` to `dst` along the graph's edges (the lowest stages first on
    a tie), None when there is none."""
    previous = {src: src}
    frontier = [src]
    while frontier and dst not in previous:
        reached = []
        for k in frontier:
            for nxt in sorted(graph.succs[k]):
                if nxt not in previous:
                    previous[nxt] = k
                    reached.append(nxt)
        frontier = reached
    if dst not in previous:
        return None
    path = [dst]
    while path[-1] != src:
        path.append(previous[path[-1]])
    return path[::-1]


def _one_copy(schedule: Schedule) -> StageGraph:
    """The stage graph of one model copy: the schedule's, or its first copy's stages and edges."""
    graph = schedule.graph
    n = graph.stages_per_copy
    return graph if graph.copies == 1 else StageGraph(n, tuple(e for e in graph.edges if e[1] < n))


def _route(model: Model, bounds: list[int], schedule: Schedule, follows: Sequence[bool]
           ) -> dict[tuple[int, int], set[int]]:
    """Per edge of one model copy's stage graph, the layer outputs it carries when `model`'s layers, wired by its
    `inputs`, are cut at `bounds`; ExecutorError where the stage graph cannot carry the cut, or where a stage would
    start at a layer no stage may start at (`follows`: profiles/workload.py `follows_flags`)."""
    name, inputs = model.name, model.inputs
    refused = starts_refusal(follows, bounds)
    if refused is not None:
        raise ExecutorError(f"model {name!r} cut at layers {bounds}: {refused}")
    graph = _one_copy(schedule)
    p = graph.num_stages
    stage_of = [k for k in range(p) for _ in range(bounds[k], bounds[k + 1])]
    sinks = [k for k in range(p) if not graph.succs[k]]
    if sinks != [stage_of[-1]]:
        raise ExecutorError(f"the model's last layer is on stage {stage_of[-1]}, but stages {sinks} end the "
                            f"{schedule.method} stage graph; the loss needs the last layer on its one final stage")
    carried: dict[tuple[int, int], set[int]] = {e: set() for e in graph.edges}
    for i, reads in enumerate(inputs):
        for s in reads:
            if s == BATCH or stage_of[s] == stage_of[i]:
                continue
            path = _path(graph, stage_of[s], stage_of[i])
            if path is None:
                raise ExecutorError(f"model {name!r} cut at layers {bounds}: layer {i} on stage {stage_of[i]} "
                                    f"reads layer {s} on stage {stage_of[s]}, but the {schedule.method} stage graph "
                                    f"{sorted(graph.edges)} has no path from {stage_of[s]} to {stage_of[i]}")
            for edge in zip(path, path[1:]):
                carried[edge].add(s)
    empty = sorted(e for e, outs in carried.items() if not outs)
    if empty:
        raise ExecutorError(f"model {name!r} cut at layers {bounds}: stage edge {empty[0][0]}->{empty[0][1]} "
                            f"of the {schedule.method} stage graph would carry nothing")
    return carried


MAX_CUTS_SEARCHED = 100_000


def carried_bounds(spec: RunSpec, layer_ms: Sequence[float] | None = None,
                   model: Model | None = None) -> tuple[int, ...] | None:
    """`spec.bounds` (without them, the even cut) where the schedule's stage graph can carry that cut;
    otherwise, of the cuts it can carry, the one whose slowest stage by `layer_ms` (one per layer; default one
    each: the fewest layers) is fastest; None where it can carry none (fewer layers than stages, or too many
    cuts to search).
    A branching model cut as a chain (by a profile's partition, or evenly) may not fit a graph schedule's
    stages (GraphPipe's diamond): its branches must land on the graph's branches."""
    model = model if model is not None else spec.build_model()
    layers, p, follows = len(model.layers), spec.schedule.graph.stages_per_copy, follows_flags(model.layers)

    def carries(bounds: Sequence[int]) -> bool:
        try:
            _route(model, check_bounds(bounds, layers, p), spec.schedule, follows)
        except ExecutorError:
            return False
        return True

    if spec.bounds is not None and carries(spec.bounds):  # a given cut may leave stages empty (a layout's)
        return tuple(spec.bounds)
    if layers < p:
        return None
    if spec.bounds is None and carries(even := even_bounds(layers, p)):
        return tuple(even)
    if math.comb(layers - 1, p - 1) > MAX_CUTS_SEARCHED:
        return None
    totals = [0.0, *itertools.accumulate(layer_ms if layer_ms is not None else [1.0] * layers)]
    best = min(((max(totals[b] - totals[a] for a, b in itertools.pairwise(bounds)), bounds)
                for inner in itertools.combinations(range(1, layers), p - 1)
                if carries(bounds := [0, *inner, layers])), default=None)
    return tuple(best[1]) if best else None


LayerOutputs = dict[int, tuple[tuple[int, ...], torch.dtype]]  # layer -> the shape and dtype of its output


@torch.no_grad()
def layer_outputs(spec: RunSpec, model: Model) -> LayerOutputs:
    """The shape and dtype of every layer's output on micro-batch 0, from a forward of the model on its device."""
    x, _ = microbatch_data(spec, model, 0, 0)
    device = next((p.device for layer in model.layers for p in layer.parameters()), torch.device("cpu"))
    return {i: (tuple(out.shape), out.dtype) for i, out in model.outputs(x.to(device)).items() if i != BATCH}


def cut(spec: RunSpec, model: Model | None = None, outputs: LayerOutputs | None = None) -> Stages:
    """Cut `spec`'s model into its schedule's stages (contiguous layer ranges) and route every layer output
    another stage reads along the stage graph: over the edge between the two stages, or, where there is none
    (a skip connection over a stage of a chain), along the shortest path, the stages between passing it on.
    A model the stage graph cannot carry (an output with no path to its reader, an edge that would carry
    nothing, the last layer not on the one final stage) fails with one clear message. Without `spec.bounds`
    the cut is the even one where the stage graph carries it, else the most even one it carries. The layers'
    `outputs` (`layer_outputs`; another cut's of the same spec) spare their forward: a spawned rank takes its
    parent's, which the GPU check's GPT took a rank's one CPU thread tens of seconds to compute."""
    schedule = spec.schedule
    graph = _one_copy(schedule)
    model = model if model is not None else spec.build_model()
    layers, p = len(model.layers), graph.num_stages
    if spec.bounds is None:  # the even cut, or the most even one the stage graph carries
        default = carried_bounds(spec, model=model)
        bounds = list(default) if default is not None else even_bounds(layers, p)  # none: _route says why not
    else:
        bounds = check_bounds(spec.bounds, layers, p)
    carried = _route(model, bounds, schedule, follows_flags(model.layers))
    outputs = layer_outputs(spec, model) if outputs is None else outputs
    edge_dtypes = {}
    for edge, outs in carried.items():
        dtypes = {outputs[s][1] for s in outs}
        if len(dtypes) > 1:
            raise ExecutorError(f"stage edge {edge[0]}->{edge[1]} would carry layers {sorted(outs)} of dtypes "
                                f"{sorted(map(str, dtypes))}; the executor sends one tensor of one dtype per edge")
        edge_dtypes[edge] = dtypes.pop()
    shaped = {e: [(s, outputs[s][0]) for s in sorted(outs)] for e, outs in carried.items()}
    in_edges = [sorted((q, k) for q in graph.preds[k]) for k in range(p)]
    out_edges = [sorted((k, q) for q in graph.succs[k]) for k in range(p)]
    reads_batch = [any(BATCH in model.inputs[i] for i in range(bounds[k], bounds[k + 1])) for k in range(p)]
    modules = [StageModule(model, bounds[k], bounds[k + 1], reads_batch[k], [shaped[e] for e in in_edges[k]],
                           [shaped[e] for e in out_edges[k]]) for k in range(p)]
    edge_shapes = {e: (sum(math.prod(shape) for _, shape in outs),) for e, outs in shaped.items()}
    copies = schedule.graph.copies  # copy c's stage s: stage c·p + s, its own module of stage s's layers and weights
    modules += [copy.deepcopy(modules[s]) for _ in range(1, copies) for s in range(p)]

    def shifted(edges: list[tuple[int, int]], c: int) -> list[tuple[int, int]]:
        return [(a + c * p, b + c * p) for a, b in edges]

    return Stages(model, bounds, modules, [shifted(in_edges[s], c) for c in range(copies) for s in range(p)],
                  [shifted(out_edges[s], c) for c in range(copies) for s in range(p)], reads_batch * copies,
                  {shifted([e], c)[0]: shape for c in range(copies) for e, shape in edge_shapes.items()},
                  {shifted([e], c)[0]: dtype for c in range(copies) for e, dtype in edge_dtypes.items()}, outputs)


def training_cut(spec: RunSpec, outputs: LayerOutputs | None = None) -> Stages:
    """`cut`, refused where a layer whose weights are another's (a tied head's, the embedding's) lies on another
    stage than its tie: each stage would train its copy on its own gradients, where one process (and Megatron-LM,
    which all-reduces the copies' gradients) trains one on both. Calibration times such stages' passes as they are."""
    stages = cut(spec, outputs=outputs)
    names = stages.model.layer_names()
    for layer, tie in enumerate(tied_layers(stages.model.layers)):
        if tie < 0:
            continue
        first, last = (bisect.bisect_right(stages.bounds, at) - 1 for at in (tie, layer))
        if first != last:
            raise ExecutorError(
                f"layer {names[layer]}'s weights are layer {names[tie]}'s (tied, as a Hugging Face config's "
                f"tie_word_embeddings ties its head to its embedding), and {spec.schedule.method}'s stages {first} "
                f"and {last} would each train a copy on its own gradients alone, not as one process trains them: "
                "give --stages 1 with a schedule of one stage a device (-s 1f1b), or an untied config (pipesim's "
                "executor does not all-reduce the copies' gradients as Megatron-LM does)")
    return stages


HELDOUT_CHUNK_ELEMENTS = 1 << 26  # the most output elements one forward of the held-out set makes: the GPU check's
# GPT (256 sequences of 1,024 tokens over 32,000 words) made 8.4 G of logits at once, 34 GB in float32


def heldout_scores(spec: RunSpec, weights: dict[tuple[int, int], list[torch.Tensor]], pipeline: int = 0,
                   device: torch.device | str = "cpu") -> dict[str, float] | None:
    """The trained model (pipeline `pipeline`'s replica of every stage, `weights` keyed (stage, pipeline) in
    each stage module's parameter order) scored on its model's held-out set, on `device` (the run's: by its FLOPs
    the GPU check's GPT spent most of the H200 run's 317 s there on the parent's CPU), or on the CPU where the
    whole model does not fit on it: loss, and accuracy for a classifier, over chunks of samples whose outputs hold
    at most HELDOUT_CHUNK_ELEMENTS, each weighted by its samples (one chunk where they fit). None when the model has
    no held-out set or a stage's weights are missing."""
    try:
        return _scores(spec, weights, pipeline, device)
    except torch.cuda.OutOfMemoryError:  # torch.OutOfMemoryError is the same class, but only from torch 2.5 on
        return _scores(spec, weights, pipeline, "cpu")


@torch.no_grad()
def _scores(spec: RunSpec, weights: dict[tuple[int, int], list[torch.Tensor]], pipeline: int,
            device: torch.device | str) -> dict[str, float] | None:
    model = spec.build_model()
    for layer in model.layers:
        layer.to(device)
    stages = cut(spec, model)  # its shapes from a forward on `device`
    if model.heldout is None or any((k, pipeline) not in weights for k in range(len(stages.modules))):
        return None
    for k, module in enumerate(stages.modules):
        for parameter, trained in zip(module.parameters(), weights[(k, pipeline)]):
            parameter.copy_(trained)
    x, target = model.heldout()
    x = x.to(device, spec.torch_dtype if x.is_floating_point() else x.dtype)
    target = target.to(device) if torch.is_tensor(target) else target
    # a chunk's samples from the last layer's output on micro-batch 0, which the cut's forward already found
    output_elements = math.prod(stages.outputs[len(model.layers) - 1][0])
    rows = (max(1, HELDOUT_CHUNK_ELEMENTS * spec.microbatch_size // output_elements) if torch.is_tensor(target)
            else len(x))
    if rows >= len(x):
        return model.score(model.forward(x), target)
    parts = [(len(chunk), model.score(model.forward(chunk), target[start:start + rows]))
             for start, chunk in zip(range(0, len(x), rows), x.split(rows))]
    return {key: sum(n * score[key] for n, score in parts) / len(x) for key in parts[0][1]}
