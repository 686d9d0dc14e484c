"""Measure a model layer by layer, and its stages' optimizer steps, on this machine.

Times are medians over at most `repeats` runs after `warmup` runs (CUDA events on a GPU, the monotonic ns
clock on CPU), with the interquartile range as spread. A measurement stops repeating once its median is known
to the precision that matters (`precise`): at least MIN_REPEATS runs, then until the median's distribution-free
confidence interval lies within a tolerance of it. Each layer runs on its own inputs, recorded once from a full
forward pass, so a layer's time is what a pipeline stage boundary would see.
"""

from __future__ import annotations

import itertools
import math
import os
import platform
import socket
import subprocess
import time
from collections.abc import Callable, Hashable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import asdict, dataclass, replace
from datetime import datetime, timezone
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import torch

from .. import __version__
from ..choices import device_refusal
from ..executor.backward import backward_input, backward_weight, full_backward
from ..executor.runtime import Ledger, Tape, bytes_by_storage
from ..executor.weights import StageWeights, Weights, average_replicas, main_dtype
from ..profiles.linkfit import fit_link
from ..profiles.partition import partition
from ..profiles.schema import (
    COUNT_BYTES,
    OPTIMIZERS,
    SCHEMA_VERSION,
    AllReduceProfile,
    AllToAllProfile,
    Environment,
    LayerProfile,
    LinkPointModel,
    LinkProfile,
    ModelInfo,
    Partition,
    PassTimes,
    Profile,
    StagePasses,
    StageSteps,
    StepTimes,
    Timing,
    aggregate_stages,
    boundary_bytes,
    boundary_held_bytes,
    layer_costs,
)
from ..units import GIB, KIB, MIB, bytes_text
from ..workload.models import BATCH, FOLLOWS_PREVIOUS, Model, ModelError, routed_experts_of, tied_layers
from ..workload.moe import dispatches
from ..workload.optim import make_optimizer
from .cache import HostCache, fresh
from .links import (
    BESIDE_COMPUTE,
    measure_all_to_all,
    measure_allreduce,
    measure_allreduce_beside_compute,
    measure_p2p_and_allreduce,
)
from .passes import StageRun, TorchStageRun, stage_runs

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
LEARNING_RATE = 1e-3  # any value: step and prediction times do not depend on it
ELASTIC_ALPHA = 0.45  # AvgPipe's default 0.9 / P for P = 2; the time does not depend on it

Advance = Callable[[str], None]  # called as each unit of work starts, naming it
# Wraps one phase of a calibration, named by its title; the body may add notes (where a term came from).
PhaseLine = Callable[[str], AbstractContextManager[list[str]]]

MIN_REPEATS = 5  # timed runs before a measurement may stop: the fewest whose extremes bound a 90 % interval
CONFIDENCE = 0.9  # of the median's interval the stopping rule checks
FLOOR_MS = 0.002  # an interval this narrow is precise whatever the median: the clock's and the call's own jitter
QUEUED, IDLE = "queued", "idle"  # a stage pass timed behind the one before, or from an idle GPU (`measure_passes`)
LAYER_TOLERANCE = 0.1  # layers' times set the partition and scale other cuts' stages, each layer by its calibrated
# stage's ratio of pass to layers (the passes are precise to PASS_SHARE): at 5 % the default gpt's layers ran to 10
# rounds, their split backward's input gradient scattering 11 % (interquartile)
PASS_SHARE = 0.03  # a stage's pass is precise to this share of its F + B: a prediction prices the stage's rows
# per micro-batch, and between a calibration and the runs it predicts the host drifts as much (the contention
# probe's passes, each alone, against the calibrated ones: -3 to +3 % on the 2-core host); at 2 % of each pass's own
# median the default gpt's passes never stopped before 10 rounds (their 90 % intervals: 3-9 % after 10)
STEP_SHARE = 0.01  # a step or a prediction runs once per mini-batch: precise to 1 % of its stage's F + B
REPLAY_SAVING = 2  # a stage's pass is replayed (`PassTraffic`) only where that costs under half the pass
DEFAULT_CACHE_BYTES = 32 * MIB  # the last-level cache assumed where neither sysfs nor sysconf gives its size


class DeviceError(ValueError):
    """The requested device is not available here."""


@dataclass(frozen=True)
class Settings:
    """How to measure. `threads`: torch intra-op threads, as each rank of the run will have them (`pipesim run
    --threads-per-rank`): a profile timed with every core predicts a one-thread rank at about half its time."""

    device: torch.device
    dtype: torch.dtype
    microbatch_size: int
    warmup: int
    repeats: int
    threads: int = 1

    @property
    def cuda(self) -> bool:
        return self.device.type == "cuda"


def resolve_device(name: str | None) -> torch.device:
    """`cuda` only where torch sees a GPU; None picks it when there is one."""
    if name is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if (why := device_refusal(name)) is not None:
        raise DeviceError(why)
    if name == "cuda" and not torch.cuda.is_available():
        built = f"built with CUDA {torch.version.cuda}" if torch.version.cuda else "a CPU-only build"
        raise DeviceError(f"no CUDA device: torch {torch.__version__} ({built}) sees no GPU; use --device cpu")
    return torch.device(name)


@contextmanager
def threads(count: int) -> Iterator[None]:
    """torch's intra-op thread count set to `count` for the block, restored after."""
    before = torch.get_num_threads()
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _timing(samples_ms: list[float]) -> Timing:
    q1, median, q3 = np.percentile(samples_ms, [25, 50, 75])
    return Timing(median_ms=float(median), spread_ms=float(q3 - q1), repeats=len(samples_ms))


def median_interval(samples: list[float], confidence: float = CONFIDENCE) -> tuple[float, float] | None:
    """A distribution-free interval holding the median with at least `confidence`: the k-th smallest and k-th
    largest sample for the largest k whose binomial tail allows it (None: too few samples for any)."""
    n, ordered = len(samples), sorted(samples)
    outside, k = 0.0, 0  # the chance the median lies below the k-th smallest sample (and, alike, above)
    while k < n // 2 and 2 * (outside + math.comb(n, k) / 2 ** n) <= 1 - confidence:
        outside += math.comb(n, k) / 2 ** n
        k += 1
    return (ordered[k - 1], ordered[n - k]) if k else None


def precise(samples: list[float], tolerance: float, floor_ms: float = FLOOR_MS) -> bool:
    """The stopping rule: at least MIN_REPEATS samples, and the median's interval (`median_interval`) no wider
    than `tolerance` of the median, or than `floor_ms`, either side of it."""
    interval = median_interval(samples) if len(samples) >= MIN_REPEATS else None
    if interval is None:
        return False
    return (interval[1] - interval[0]) / 2 <= max(tolerance * float(np.median(samples)), floor_ms)


# a name (None: run untimed, as `_time` says), and the work: the previous phase's result in, its own out
Phase = tuple[Hashable | None, Callable[[Any], Any]]


def _time(settings: Settings, *sequences: list[Phase], advance: Advance | None = None,
          tolerance: float = LAYER_TOLERANCE, floor_ms: Callable[[Hashable], float] = lambda name: FLOOR_MS,
          idle: Callable[[Hashable], bool] = lambda name: False) -> dict[Hashable, Timing]:
    """Time every phase of every sequence on its own, in rounds that each run all the sequences in turn, so a
    slow spell of a shared machine spreads over all of them instead of bending one: `warmup` rounds, then
    timed ones until every phase is `precise` (to `tolerance`, or `floor_ms(name)`) or `repeats` rounds are
    timed. A sequence whose phases are all precise leaves the rounds: repeating it would only add work (the
    untimed pass before a step costs a hundred times the step), so one noisy phase repeats its own sequence,
    not every other. A phase hands its result to the next (a forward's graph to its backward), so no untimed
    work is repeated just to set one up; the last result is released after the clock stops, so freeing it is
    not charged to any phase. A phase named None is run untimed: the work a timed one needs done before or after it
    (the pass whose caches a step finds, the spares a prediction gives back). A name in several sequences pools
    their samples. On a GPU a phase is queued behind the one before it, its host issuing while the GPU still runs
    that one; one whose name is `idle` starts on an idle GPU instead (the device synchronised first), so the time
    its host takes to issue it, where that outlasts its kernels, is in its time (`StagePasses`)."""
    samples: dict[Hashable, list[float]] = {}
    rounds = settings.warmup + settings.repeats
    active = list(sequences)
    for repeat in range(rounds):
        if advance is not None:
            advance(f"round {repeat + 1}/{rounds}")
        timed: list[tuple[Hashable, Any]] = []
        for sequence in active:
            state = None
            for name, run in sequence:
                if name is None:
                    state = run(state)
                elif settings.cuda:
                    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    if idle(name):
                        torch.cuda.synchronize()
                    start.record()
                    state = run(state)
                    end.record()
                    timed.append((name, (start, end)))
                else:
                    t0 = time.perf_counter_ns()
                    state = run(state)
                    timed.append((name, (time.perf_counter_ns() - t0) / 1e6))
            del state
        if repeat < settings.warmup:
            continue
        if settings.cuda:
            torch.cuda.synchronize()
        for name, sample in timed:
            samples.setdefault(name, []).append(sample[0].elapsed_time(sample[1]) if settings.cuda else sample)
        active = [sequence for sequence in active
                  if not all(precise(samples[name], tolerance, floor_ms(name)) for name, _ in sequence
                             if name is not None)]
        if not active:
            break
    return {name: _timing(ms) for name, ms in samples.items()}


def _call_with(fn: Callable[..., Any], *args: Any) -> Callable[[Any], Any]:
    """A phase that calls fn(*args) and ignores the previous phase's result."""
    return lambda _: fn(*args)


def _zero(settings: Settings) -> Timing:
    """The timing of work that does not exist (the backward of a layer nothing differentiates)."""
    return Timing(median_ms=0.0, spread_ms=0.0, repeats=settings.repeats)


def _nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def _with_grads(params: list[torch.nn.Parameter]) -> list[torch.Tensor]:
    """Copies of `params` holding small random gradients: optimizer steps are measured on these, so the
    model's own weights stay as they were and keep no gradient memory while the layers are timed."""
    copies = [p.detach().clone().requires_grad_(True) for p in params]
    for c in copies:
        c.grad = torch.randn_like(c) * 1e-3
    return copies


def _grad_bytes(weights: list[torch.nn.Parameter]) -> int:
    """Bytes of the gradients of `weights` as the executor accumulates them (float32 main gradients of 16-bit
    weights: executor/weights.py `main_dtype`)."""
    main = main_dtype(weights)
    return sum(w.numel() * (w.element_size() if main is None else main.itemsize) for w in weights)


def _state_bytes(name: str, weights: list[torch.nn.Parameter]) -> int:
    """Bytes of the state `name` keeps for `weights`, as measured after one step, with the executor's float32
    master copy of 16-bit weights (the optimizer's then, as Megatron-LM's and sim/costs.py's "megatron" have it)."""
    if not weights:
        return 0
    main = main_dtype(weights)
    owned = _with_grads(weights if main is None else [w.to(main) for w in weights])
    optimizer = make_optimizer(name, owned, LEARNING_RATE)
    optimizer.step()
    masters = 0 if main is None else _nbytes(owned)
    return masters + sum(_nbytes(v for v in state.values() if torch.is_tensor(v))
                         for state in optimizer.state.values())


@dataclass
class Recording:
    """One forward pass on the sample batch: every layer's inputs, to time each layer alone, and the
    loss target the last layer needs."""

    inputs: list[list[torch.Tensor]]
    target: Any


def place(model: Model, device: torch.device, dtype: torch.dtype) -> None:
    """The model's layers on `device` in `dtype`, in training mode, as calibration times them."""
    for layer in model.layers:
        layer.to(device=device, dtype=dtype)
        layer.train()


def measure_bytes(model: Model, settings: Settings) -> tuple[Recording, list[LayerProfile]]:
    """Move the model to the device and dtype and run it once: each layer's weight, gradient, optimizer
    state, output and saved-activation bytes, and a mixture of experts' routed experts (in each layer that
    dispatches: the model's `experts` option, as the estimate reads them, a Hugging Face config's too; where a
    model built by its own code carries no options, its gpt blocks' `routed_experts_of`) and the token copies they
    are dispatched (workload/moe.py `dispatches`; timings left at zero: `measure_times` fills them, so a memory cap
    nothing fits fails before the slow part).

    Saved activations are what autograd keeps for backward (saved_tensors_hooks), weights and buffers excluded
    (the module holds them whatever autograd saves), each storage counted once per layer."""
    place(model, settings.device, settings.dtype)
    batch, target = model.make_batch(settings.microbatch_size, torch.Generator().manual_seed(0))
    batch = batch.to(settings.device, settings.dtype if batch.is_floating_point() else batch.dtype)
    target = target.to(settings.device) if torch.is_tensor(target) else target

    params = {p.untyped_storage().data_ptr() for layer in model.layers
              for p in (*layer.parameters(), *layer.buffers())}
    outputs: dict[int, torch.Tensor] = {BATCH: batch}
    names, last = model.layer_names(), len(model.layers) - 1
    zero = _zero(settings)
    inputs, layers, keep = [], [], []
    previous: dict[int, int] = {}
    tied = tied_layers(model.layers)
    for i, layer in enumerate(model.layers):
        args = [outputs[s].detach() for s in model.inputs[i]]
        saved: dict[int, int] = {}  # storage address -> bytes

        def pack(t: torch.Tensor, saved: dict[int, int] = saved) -> torch.Tensor:
            storage = t.untyped_storage()
            if storage.data_ptr() and storage.data_ptr() not in params:
                saved[storage.data_ptr()] = storage.nbytes()
            keep.append(t)  # alive until the pass ends, so no storage address is reused meanwhile
            return t

        try:
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), dispatches() as routed:
                leaves = _leaves(args, model.inputs[i])
                out = _call(model, i, layer, leaves, target)
                if torch.is_tensor(out) and out.requires_grad:  # the backward must run too, before timing it
                    wrt = [a for a in leaves if a.requires_grad] + [p for p in layer.parameters() if p.requires_grad]
                    torch.autograd.grad(out, wrt, torch.ones_like(out), retain_graph=True, allow_unused=True)
        except Exception as exc:  # the user's model: report whatever it raised, in one line
            if isinstance(exc, (MemoryError, torch.cuda.OutOfMemoryError)):
                raise
            raise ModelError(f"layer {names[i]} failed on its sample input: {type(exc).__name__}: "
                             f"{(str(exc).splitlines() or [''])[0]}") from None
        if not torch.is_tensor(out):
            raise ModelError(f"layer {names[i]} returned {type(out).__name__}; pipeline layers must return one "
                             "tensor")
        outputs[i] = out.detach()
        inputs.append(args)
        weights = [p for p in layer.parameters() if p.requires_grad]
        layers.append(LayerProfile(
            name=names[i], inputs=list(model.inputs[i]), fwd=zero, bwd=zero, igrad=zero, wgrad=zero,
            activation_bytes=sum(saved.values()),
            shared_with_previous_bytes=sum(n for ptr, n in saved.items() if ptr in previous),
            output_bytes=0 if i == last else _nbytes([out]),  # the last layer's output is its loss
            param_bytes=_nbytes(layer.parameters()), grad_bytes=_grad_bytes(weights),
            optimizer_state_bytes={name: _state_bytes(name, weights) for name in OPTIMIZERS},
            saved_input_bytes=[saved.get(a.untyped_storage().data_ptr(), 0) for a in args],
            output_saved=out.untyped_storage().data_ptr() in saved, expert_param_bytes=routed.expert_weight_bytes,
            routed_experts=(model.options.get("experts") or routed_experts_of(layer) or 0) if routed.blocks else 0,
            dispatched_bytes=routed.token_bytes,
            dispatched_block_bytes=[block.sent_bytes for block in routed.blocks],
            follows_previous=bool(getattr(layer, FOLLOWS_PREVIOUS, False)), tied_layer=tied[i]))
        previous = saved
    return Recording(inputs, target), layers


def _leaves(args: list[torch.Tensor], sources: list[int]) -> list[torch.Tensor]:
    """Fresh inputs for one layer: those from another layer need a gradient, the sample batch does not
    (no pipeline differentiates its data, so the first stage's backward computes none for it)."""
    return [a.detach().requires_grad_(source != BATCH and a.is_floating_point()) for a, source in zip(args, sources)]


def _call(model: Model, i: int, layer: torch.nn.Module, args: list[torch.Tensor], target: Any) -> torch.Tensor:
    """The layer's forward; the last layer's includes the loss, which is part of its stage's work."""
    out = layer(*args)
    return model.loss(out, target) if i == len(model.layers) - 1 else out


def _passes(model: Model, i: int, recording: Recording) -> list[list[Phase]]:
    """Layer i's timed passes: a forward then the split backward (the input gradient, then the weight
    gradient), and a forward then the full backward; only the forward when nothing needs a gradient."""
    layer = model.layers[i]
    weights = [p for p in layer.parameters() if p.requires_grad]

    def forward(_) -> tuple[list[torch.Tensor], torch.Tensor]:
        args = _leaves(recording.inputs[i], model.inputs[i])
        return args, _call(model, i, layer, args, recording.target)

    _, sample = forward(None)
    if not sample.requires_grad:
        return [[((i, "fwd"), forward)]]
    grad_out = None if i == len(model.layers) - 1 else torch.randn_like(sample)

    def grads(wrt_input: bool, wrt_weights: bool, retain: bool = False) -> Callable[[Any], Any]:
        def run(state):
            args, out = state
            wrt = [a for a in args if a.requires_grad and wrt_input] + (weights if wrt_weights else [])
            if wrt:
                torch.autograd.grad(out, wrt, grad_out, retain_graph=retain, allow_unused=True)
            return state
        return run

    split = [((i, "fwd"), forward), ((i, "igrad"), grads(True, False, retain=True)), ((i, "wgrad"), grads(False, True))]
    return [split, [((i, "fwd"), forward), ((i, "bwd"), grads(True, True))]]


def measure_times(model: Model, settings: Settings, recording: Recording, layers: list[LayerProfile],
                  advance: Advance) -> list[LayerProfile]:
    """`layers` with their forward, full backward, and input-then-weight gradient times filled in (a layer
    nothing differentiates keeps zero backward times). Alike layers (`alike_layers`: a GPT's blocks) are timed
    once, as the first of them, and share its times. One untimed round at most comes first: `measure_bytes` ran
    every layer forward and backward just before."""
    settings = replace(settings, warmup=min(settings.warmup, 1))
    timed_as = alike_layers(model, recording)
    passes = [sequence for i in sorted(set(timed_as)) for sequence in _passes(model, i, recording)]
    times = _time(settings, *passes, advance=lambda what: advance(f"timing layers, {what}"))
    return [layer.model_copy(update={kind: timing for (j, kind), timing in times.items() if j == timed_as[i]})
            for i, layer in enumerate(layers)]


def measure_transients(model: Model, settings: Settings, recording: Recording,
                       layers: list[LayerProfile]) -> list[LayerProfile]:
    """`layers` with, on a GPU, each pass's transient bytes (`LayerProfile.transient_bytes`): what the pass makes
    and frees within itself at its peak, which the simulator holds beside the activations while the pass's row
    runs. The caching allocator's allocated bytes at the pass's peak less the most of those before it (its inputs,
    and a backward's activations, which the simulator holds until it ends) and after it (what it leaves: a
    forward's saved tensors and output, a backward's input gradient), each pass run as the executor runs it
    (executor/backward.py: the weights' gradients added into a started buffer, in float32 for 16-bit weights, each
    freed as it is added) after one untimed round. The loss's float32 softmax gradients are most of its backward's
    (the H200 check's stage-1 peaks fall in its B or I: traces/measured/gpu-check-h200-day9-masters). Alike layers
    share the first's, as their times. On a CPU none: the executor counts the tensors its rows hold there, not an
    allocator's peak, so a run's measured memory holds no transients (executor/runtime.py `_memory`)."""
    if not settings.cuda:
        return layers
    timed_as = alike_layers(model, recording)
    found = {i: _transient_bytes(model, i, recording, settings.device) for i in sorted(set(timed_as))}
    return [layer.model_copy(update={"transient_bytes": found[timed_as[i]]}) for i, layer in enumerate(layers)]


def _transient_bytes(model: Model, i: int, recording: Recording, device: torch.device) -> dict[str, int]:
    """Layer i's transient bytes per pass (`measure_transients`): a forward then the full backward, and a forward
    then the split backward, once untimed and once read; only the forward when nothing needs a gradient."""
    layer = model.layers[i]
    weights = [p for p in layer.parameters() if p.requires_grad]
    into: list[torch.Tensor | None] = [None] * len(weights)
    main = main_dtype(layer.parameters())
    forward = _layer_forward(model, i, recording)
    sample = forward(None)[1][0]
    sequences: list[list[Phase]] = [[("fwd", forward)]]
    if sample.requires_grad:
        grad_outputs = _output_gradients(model, i, sample)
        sequences = [
            [("fwd", forward), ("bwd", lambda state: full_backward(state[1], grad_outputs, state[0], weights, into,
                                                                     main))],
            [("fwd", forward), ("igrad", lambda state: backward_input(state[1], grad_outputs, state[0], weights)),
             ("wgrad", lambda state: backward_weight(state[1], weights, into, main))]]
    del sample
    found: dict[str, int] = {}
    for read in (False, True):
        for sequence in sequences:
            state = None
            for name, run in sequence:
                before = torch.cuda.memory_allocated(device)
                torch.cuda.reset_peak_memory_stats(device)
                state = run(state)  # what the pass before left is freed here, what this one leaves is kept
                made = torch.cuda.max_memory_allocated(device) - max(before, torch.cuda.memory_allocated(device))
                if read:
                    found[name] = max(found.get(name, 0), made)
    return found


def _layer_forward(model: Model, i: int, recording: Recording
                   ) -> Callable[[Any], tuple[list[torch.Tensor], list[torch.Tensor]]]:
    """Layer i's forward as a phase: fresh leaves of its recorded inputs, and [its output] (the last layer's loss)."""
    def forward(_: Any) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        args = _leaves(recording.inputs[i], model.inputs[i])
        return args, [_call(model, i, model.layers[i], args, recording.target)]
    return forward


def _output_gradients(model: Model, i: int, output: torch.Tensor) -> list[torch.Tensor | None]:
    """What layer i's backward starts from: a gradient of its output, or [None] under the last layer's loss."""
    return [None if i == len(model.layers) - 1 else torch.randn_like(output)]


def measure_wgrad_held(model: Model, recording: Recording, layers: list[LayerProfile]) -> list[LayerProfile]:
    """`layers` with what each one's input-gradient pass leaves for its weight pass (`LayerProfile.wgrad_kept_bytes`,
    `wgrad_gradient_bytes`, `wgrad_kept_below_bytes`), as the executor's split backward leaves it
    (executor/backward.py): its I runs autograd.grad with retain_graph and keeps the nodes where the weights'
    gradients branch off the path to the input, with the gradients arriving at them, for its W; so every saved tensor
    below the topmost such node stays until W (the head's input, beside the logits' gradient arriving at its
    product), and what the graph holds above it (the loss's saved softmax) goes as I ends.
    Measured as the layer its stage ends with. Below another layer of its stage a layer keeps all it saved (the later
    layer's nodes hold its whole graph): a dropout's mask after a block's last linear, the cnn's ReLU outputs and
    max-pool indices, which a stage's sum of its layers' kept left out (its 2-stage ZB-H1 on CPU: stage 1 priced
    8.0 % under its measured peak; profiles/schema.py `wgrad_held_ranges`). The saved tensors are counted as
    `measure_bytes` counts the activations, each storage once and the weights and buffers left out, through the
    executor's saved-tensor hooks (its Ledger: what its graph still holds), and the gradients as tensors too
    (`PendingWeightGrad.gradients`), on either device, as the executor counts a CPU run's memory
    (executor/runtime.py `_memory`). One forward and I per layer, alike layers sharing the first's; a layer
    that reads no other (the first stage's: its I walks nothing, W the whole backward) keeps all it saved."""
    timed_as = alike_layers(model, recording)
    found = {i: _wgrad_held(model, i, recording) for i in sorted(set(timed_as))}
    return [layer.model_copy(update=dict(zip(("wgrad_kept_bytes", "wgrad_gradient_bytes"), found[timed_as[i]]),
                                         wgrad_kept_below_bytes=layer.activation_bytes))
            for i, layer in enumerate(layers)]


def _wgrad_held(model: Model, i: int, recording: Recording) -> tuple[int, int]:
    """Layer i's saved bytes and gradient bytes its input-gradient pass leaves for its weight pass
    (`measure_wgrad_held`)."""
    layer = model.layers[i]
    ledger = Ledger()
    tape = Tape(Weights([*layer.parameters(), *layer.buffers()], 0), ledger)
    with torch.autograd.graph.saved_tensors_hooks(tape.pack, tape.unpack):
        args, (out,) = _layer_forward(model, i, recording)(None)
    if not out.requires_grad:
        return 0, 0
    _, pending = backward_input([out], _output_gradients(model, i, out), args,
                                [p for p in layer.parameters() if p.requires_grad])
    del args, out  # the graph above the weights' nodes goes with the output, as the executor drops it after I
    return ledger.total, sum(bytes_by_storage(pending.gradients()).values())


def alike_layers(model: Model, recording: Recording) -> list[int]:
    """Per layer, the first layer alike to it (itself if none before is): the same module tree (each module's
    class, `extra_repr` and plain attributes), parameters and buffers of the same names, shapes, dtypes and
    gradient flags, and inputs of the same shapes and dtypes from the same kind of source. Such layers run the
    same kernels on the same sizes, so one's time is another's. The last layer computes the loss too: it is
    alike to none."""
    first: dict[Hashable, int] = {}
    last = len(model.layers) - 1
    return [i if i == last else first.setdefault(_structure(layer, recording.inputs[i], model.inputs[i]), i)
            for i, layer in enumerate(model.layers)]


def _structure(layer: torch.nn.Module, args: list[torch.Tensor], sources: tuple[int, ...]) -> Hashable:
    """What decides a layer's work, hashable (see `alike_layers`)."""
    modules = tuple((name, type(module), module.extra_repr(), _plain_attributes(module))
                    for name, module in layer.named_modules())
    tensors = tuple((name, tuple(t.shape), t.dtype, t.requires_grad)
                    for name, t in [*layer.named_parameters(), *layer.named_buffers()])
    inputs = tuple((tuple(a.shape), a.dtype, source == BATCH) for a, source in zip(args, sources))
    return modules, tensors, inputs


def _plain_attributes(module: torch.nn.Module) -> tuple[tuple[str, Hashable], ...]:
    """A module's own public attributes besides its parameters, buffers and children (a flag, a scale, a
    function its forward calls), each as itself where hashable, else as its repr."""
    def key(value: Any) -> Hashable:
        try:
            hash(value)
        except TypeError:
            return repr(value)
        return value
    return tuple(sorted((name, key(value)) for name, value in vars(module).items() if not name.startswith("_")))


def measure_passes(runs: list[StageRun], settings: Settings, advance: Advance,
                   stage_ms: list[float]) -> list[StagePasses]:
    """Each stage's F, B, I and W timed as the executor runs them (calibrate/passes.py): a forward then the
    full backward, and a forward then the split one, every stage in every round (a stage nothing
    differentiates has its forward only). Where no input needs a gradient (the first stage), I has nothing to
    compute and W is B's own autograd call over the whole graph: one sequence times F, I and then B, which is
    W's time too. Each is timed until its median is known to PASS_SHARE of its stage's F + B (`stage_ms`, as its
    layers sum them). One untimed round at most comes first (the default gpt's passes: the first round 1.3-4.8x the
    later median, the second 1.0-1.2x, as the later ones scatter: one such sample among five or more moves a
    median by half a rank at most). On a GPU each is timed both ways in the same rounds, queued behind the pass
    before and from an idle GPU, as a run's rows are issued with a GPU per rank and on GPUs its ranks share
    (`StagePasses`); a CPU runs ops as issued, one path, timed once."""
    settings = replace(settings, warmup=min(settings.warmup, 1))
    ways = (QUEUED, IDLE) if settings.cuda else (QUEUED,)
    sequences = []
    for way, (k, run) in itertools.product(ways, enumerate(runs)):
        if not run.differentiable:
            phases = [[("fwd", run.forward)]]
        elif not run.input_gradients:
            phases = [[("fwd", run.forward), ("igrad", run.backward_input), ("bwd", run.backward_weight)]]
        else:
            phases = [[("fwd", run.forward), ("bwd", run.backward)],
                      [("fwd", run.forward), ("igrad", run.backward_input), ("wgrad", run.backward_weight)]]
        sequences += [[((way, k, kind), work) for kind, work in phase] for phase in phases]
    times = _time(settings, *sequences, advance=lambda what: advance(f"timing stages as one pass, {what}"),
                  tolerance=0.0, floor_ms=lambda name: max(FLOOR_MS, PASS_SHARE * stage_ms[name[1]]),
                  idle=lambda name: name[0] == IDLE)
    zero = _zero(settings)

    def timed(way: str, k: int) -> PassTimes:
        bwd = times.get((way, k, "bwd"), zero)
        return PassTimes(fwd=times[way, k, "fwd"], bwd=bwd, igrad=times.get((way, k, "igrad"), zero),
                         wgrad=times.get((way, k, "wgrad"), bwd))

    return [StagePasses(**dict(timed(QUEUED, k)), idle=timed(IDLE, k) if settings.cuda else None)
            for k in range(len(runs))]


def measure_steps(runs: list[StageRun], settings: Settings, advance: Advance,
                  passes: list[StagePasses] | None = None) -> list[StageSteps]:
    """Per stage: each optimizer's update and weight prediction, one replica's elastic averaging, adding one
    micro-batch's weight gradients into the mini-batch's buffer (as the executor's backward does), and what a
    copy-on-write update adds over one in place (the executor's own: `StageWeights.fresh_copies`,
    `average_replicas`; in 16 bits the new tensors the masters' cast fills, and the masters averaged, then cast).

    Each is timed on the caches a forward and backward of its stage leave, as it runs in a pipeline: these ops
    stream the weights, gradients and optimizer state through memory, and timed back to back they find them
    in cache (a momentum step of 4 MiB of weights: 0.4-0.5 ms hot, 0.8 ms after the stage's pass). The pass
    may cost a hundred times the op (the default gpt's 0.25-0.3 s against 1-10 ms), so where replaying its
    memory traffic (`PassTraffic`, 5-20 ms) costs under half the pass, the replay stands in for it: each of
    the default gpt's 22 ops timed after the replay and after a real pass, in 10 interleaved rounds on the
    2-core host (loaded), differed by 5.0 % (median), the real pass from itself by 5.5 %. The update and the
    prediction are the executor's own (`StageWeights.step` and `.predict`), the update on a gradient buffer
    made afresh, as a mini-batch's first backward makes it: a buffer kept from step to step stays in cache (an
    SGD step of a 4 MiB stage, timed in turn on the 2-core CPUs here: mean 0.37 ms on a kept buffer, 0.44-0.52
    ms on a fresh one). Accumulation, the copy and averaging follow gradients added into a kept buffer, in that
    order, as a later micro-batch's backward adds them. The prediction, the copy, averaging and Adam's step take
    their tensors from the stage's spares and give them back, as the executor's do (workload/optim.py `Spares`):
    the first round makes them, and none is timed on the allocator, which on CPU gave a 4.3 MB prediction 0.21-0.30
    ms on reused heap and 1.2-1.7 ms on fresh pages, as glibc's history had it. Given the stages' `passes`, each
    op stops repeating once known to STEP_SHARE of its stage's F + B. One untimed round at most comes first: the
    stage's passes were just timed, and it makes the optimizer's state and the spares."""
    out = []
    settings = replace(settings, warmup=min(settings.warmup, 1))
    buffer = None
    for k, run in enumerate(runs):
        if not run.weights:
            zero = _zero(settings)
            out.append(({name: StepTimes(step=zero, predict=zero) for name in OPTIMIZERS}, zero, zero, zero))
            continue
        enough_ms = max(FLOOR_MS, STEP_SHARE * (passes[k].fwd.median_ms + passes[k].bwd.median_ms) if passes else 0.0)

        def floor_ms(name: Hashable, enough_ms: float = enough_ms) -> float:  # every timed phase's alike
            return enough_ms
        stage_pass = partial(_stage_pass, run)
        if passes and len(run.into) == len(run.weights):  # they left its gradients and what a forward saves
            pass_ms = passes[k].fwd.median_ms + passes[k].bwd.median_ms
        else:
            pass_ms = _wall_ms(settings, stage_pass, run.weights)
        made = [torch.zeros_like(w) if g is None else g for w, g in zip(run.weights, run.into)]  # 0: w unused
        buffer = eviction_buffer(settings.device) if buffer is None else buffer
        traffic = PassTraffic(buffer, run.saved_bytes, made)
        after_pass = traffic if REPLAY_SAVING * _wall_ms(settings, traffic, run.weights) < pass_ms else stage_pass
        steps = {}
        for name in OPTIMIZERS:
            advance(f"stage {k}: {name} step and prediction")
            state = StageWeights(run.module, name, LEARNING_RATE, label=f"stage {k}", device=settings.device)
            # The step runs first in every round, so the prediction always has a direction to extrapolate.
            times = _time(settings, [(None, _call_with(after_pass, state.current, state)),
                                     ("step", _call_with(state.step, False))],
                          [(None, _call_with(after_pass, state.current)),
                           ("predict", lambda _, state=state: state.predict((state.version, 1, "F"))),
                           (None, lambda predicted, state=state: state.free_predicted(
                               (predicted.version, predicted.distance, "F")))],
                          floor_ms=floor_ms)
            steps[name] = StepTimes(step=times["step"], predict=times["predict"])
        advance(f"stage {k}: gradient accumulation, weight copy, elastic averaging")
        state = StageWeights(run.module, "sgd", LEARNING_RATE, label=f"stage {k}", device=settings.device)  # no step
        made = [torch.randn_like(w) * 1e-3 for w in state.current]  # one micro-batch's gradients, as `_with_grads`
        kept = [torch.zeros_like(w) for w in state.owned]  # the mini-batch's buffer (float32 main gradients)
        reference = [w.detach().clone() for w in state.owned]
        average = _call_with(average_replicas, [state], reference, ELASTIC_ALPHA)
        accumulate = _call_with(_accumulate, kept, made)
        times = _time(settings, [(None, _call_with(after_pass, state.current, None, kept)),
                                 ("accumulate", accumulate), ("copy", _call_with(state.fresh_copies)),
                                 (None, state.spares.give), ("average", average)],
                      floor_ms=floor_ms)
        out.append((steps, times["average"], times["accumulate"], times["copy"]))
    return out


def last_level_cache_bytes(device: torch.device) -> int:
    """The size of the device's last-level data cache: a GPU's L2 (CUDA's device properties), a CPU's largest
    data or unified cache (sysfs, else glibc's sysconf), else DEFAULT_CACHE_BYTES."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).L2_cache_size
    sizes = []
    for index in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*"):
        try:
            if (index / "type").read_text().strip() != "Instruction":
                sizes.append(_cache_size_bytes((index / "size").read_text()))
        except (OSError, ValueError):
            continue
    for name in ("SC_LEVEL3_CACHE_SIZE", "SC_LEVEL2_CACHE_SIZE"):
        if not sizes and name in os.sysconf_names:
            sizes.append(max(os.sysconf(name), 0))
    return max(sizes, default=0) or DEFAULT_CACHE_BYTES


def _cache_size_bytes(text: str) -> int:
    """sysfs' cache size ("32768K", "1M") in bytes."""
    text = text.strip().upper()
    return int(text.rstrip("KMG")) * {"K": KIB, "M": MIB, "G": GIB}.get(text[-1:], 1)


def _wall_ms(settings: Settings, fn: Callable[..., Any], *args: Any) -> float:
    """How long one call takes, the device's queued work included (to choose between ways to do one thing)."""
    start = time.perf_counter_ns()
    fn(*args)
    if settings.cuda:
        torch.cuda.synchronize()
    return (time.perf_counter_ns() - start) / 1e6


def _stage_pass(run: StageRun, weights: list[torch.Tensor], state: StageWeights | None = None,
                kept: list[torch.Tensor] | None = None) -> None:
    """The stage's forward and backward on `weights`, its gradients into a new buffer, as a mini-batch's first
    backward makes it (the update of `state`, if given, consumes it), or added into `kept`, as a later one
    adds them."""
    run.weights = weights
    run.into = [None] * len(weights) if kept is None else kept
    run.backward(run.forward())
    if state is not None:
        state.grads = run.into


def eviction_buffer(device: torch.device) -> torch.Tensor:
    """A buffer twice the device's last-level cache: streamed through it, it leaves nothing else there."""
    return torch.ones(2 * last_level_cache_bytes(device) // 4, dtype=torch.float32, device=device)


class PassTraffic:
    """A stage's forward and backward as the caches see them, for a few milliseconds instead of the pass:
    first a buffer twice the last-level cache streamed through it (what ran before is gone, as after a pass
    whose activations outgrow it), then the pass's own traffic in its order: the forward reads each weight
    and writes its share of the `activation_bytes` the stage saves (at most the buffer); the backward, last
    weight first, reads that share and writes it over (as it writes the activations' gradients: reading alone
    left the caches clean where a pass leaves them dirty, and the gpt's accumulation after it 21-23 % faster
    than after a real pass; writing, 13-14 %), reads the weight and writes the weight's gradient (one
    backward's, `made`)."""

    def __init__(self, buffer: torch.Tensor, activation_bytes: int, made: list[torch.Tensor]) -> None:
        self.buffer = buffer  # `eviction_buffer`'s, shared by every stage's replay
        self.activations = buffer[:activation_bytes // buffer.element_size()]
        self.made = made

    def __call__(self, weights: list[torch.Tensor], state: StageWeights | None = None,
                 kept: list[torch.Tensor] | None = None) -> None:
        """As `_stage_pass` leaves the caches, its gradients written as it writes them."""
        self.buffer.add_(1.0)
        shares = self.activations.tensor_split(len(weights))
        for weight, share in zip(weights, shares):
            weight.sum()
            share.fill_(1.0)
        fresh = []
        for j in reversed(range(len(weights))):
            shares[j].add_(1.0)
            weights[j].sum()
            if kept is None:
                fresh.append(self.made[j].clone())
            else:
                kept[j].add_(self.made[j].clone())
        if state is not None:
            state.grads = fresh[::-1]


def _accumulate(buffer: list[torch.Tensor], grads: list[torch.Tensor]) -> None:
    """The executor's gradient accumulation (executor/weights.py), one in-place add per tensor."""
    for total, grad in zip(buffer, grads):
        total.add_(grad)


def environment(settings: Settings, dtype_name: str, memory_cap_bytes: int | None,
                passes_as: str = "executor") -> Environment:
    if settings.cuda:
        props = torch.cuda.get_device_properties(settings.device)
        name, memory = props.name, props.total_memory
    else:
        name, memory = _cpu_name(), os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return Environment(
        device=settings.device.type, device_name=name, device_memory_bytes=memory,
        memory_cap_bytes=memory_cap_bytes, dtype=dtype_name, microbatch_size=settings.microbatch_size,
        threads=settings.threads, torch_version=torch.__version__, cuda_version=torch.version.cuda,
        driver_version=_nvidia_driver() if settings.cuda else None, python_version=platform.python_version(),
        pipesim_version=__version__, host=socket.gethostname(),
        date=datetime.now(timezone.utc).isoformat(timespec="seconds"), passes_as=passes_as)


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as info:
            for line in info:
                if line.startswith("model name"):
                    return f"{line.split(':', 1)[1].strip()} ({os.cpu_count()} cores)"
    except OSError:
        pass
    return f"{platform.processor() or platform.machine()} ({os.cpu_count()} cores)"


def _nvidia_driver() -> str | None:
    """The NVIDIA driver version; torch does not report it, nvidia-smi does (None without it)."""
    try:
        result = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                capture_output=True, text=True, timeout=10, check=True)
    except (OSError, subprocess.SubprocessError):
        return None
    return result.stdout.splitlines()[0].strip() if result.stdout.strip() else None


def calibrate(model: Model, settings: Settings, *, stages: int, optimizer: str, memory_cap_bytes: int | None,
              link_sizes: list[int], dtype_name: str, advance: Advance, cache: HostCache | None = None,
              phase: PhaseLine = lambda title: nullcontext([]), expert_parallel: int = 2,
              passes_as: str = "executor") -> Profile:
    """Everything `pipesim calibrate` measures in process, as a Profile: layers, the partition into `stages`
    (under the cap, for `optimizer`'s state), the stages' passes and steps, and, given sizes, the p2p link and
    all-reduce (`measure_links`; on a CPU the all-reduce past them too, up to the largest stage's gradients:
    `with_sizes_covering`, and beside computing ranks: `with_beside_compute`), and for a mixture of experts the
    all-to-all over `expert_parallel` ranks at the sizes its layers exchange (`measure_all_to_alls`), each from
    `cache` where it holds them for this host. Each of these runs inside `phase(title)`. `passes_as`: the code the
    stages' passes are timed with, the executor's (`StageRun`) or torch.distributed.pipelining's (`TorchStageRun`)."""
    with threads(settings.threads):  # the bytes too: every core's threads wait on each other on a busy host
        with phase(f"timing layers ({len(model.layers)})"):
            recording, layers = measure_bytes(model, settings)
            partition(layer_costs(layers, optimizer), stages, memory_cap_bytes)  # no split fits the cap: fail now
            layers = measure_times(model, settings, recording, layers, advance)
            layers = measure_transients(model, settings, recording, layers)
            layers = measure_wgrad_held(model, recording, layers)
        bounds = partition(layer_costs(layers, optimizer), stages, memory_cap_bytes)
        runs = stage_runs(model, bounds, dtype_name, settings.microbatch_size)
        ways = ", queued and from an idle GPU" if settings.cuda else ""
        timed = [TorchStageRun(run) for run in runs] if passes_as == "torch" else runs
        with phase(f"timing stages as one pass ({stages}{ways}{', as torch runs them' if timed is not runs else ''})"):
            passes = measure_passes(timed, settings, advance, [sum(layer.fwd.median_ms + layer.bwd.median_ms
                                                                   for layer in layers[first:stop])
                                                               for first, stop in zip(bounds, bounds[1:])])
        if timed is not runs:  # torch's passes added into the modules' own gradients, which nothing after reads
            for parameter in (p for run in runs for p in run.module.parameters()):
                parameter.grad = None
        with phase(f"timing updates, predictions, averaging ({stages} stages, {len(OPTIMIZERS)} optimizers)"):
            steps = measure_steps(runs, settings, advance, passes)
    link = allreduce = None
    if link_sizes:
        with phase(f"measuring the p2p link and all-reduce ({len(link_sizes)} sizes)") as notes:
            key = {"device": settings.device.type, "sizes": link_sizes, "repeats": settings.repeats,
                   "warmup": settings.warmup}
            measure = lambda: measure_links(link_sizes, settings, advance)  # noqa: E731
            links = cache.get("links", key, measure, own_tasks=2) if cache is not None else fresh(measure)
            link = LinkProfile.model_validate(links.value["link"])
            allreduce = AllReduceProfile.model_validate(links.value["allreduce"])
            if cache is not None:
                notes.append(links.describe())
                link = link.model_copy(update={"meta": {**link.meta, "host_cache": links.meta()}})
                allreduce = allreduce.model_copy(update={"meta": {**allreduce.meta, "host_cache": links.meta()}})
        if settings.device.type == "cpu":
            gradient_bytes = max(sum(layer.param_bytes for layer in layers[first:stop])
                                 for first, stop in zip(bounds, bounds[1:]))
            past = sizes_covering(link_sizes, gradient_bytes)
            if past:
                with phase(f"timing the all-reduce past the link's sizes, up to {bytes_text(past[-1])} (a stage's "
                           f"gradients: {bytes_text(gradient_bytes)})") as notes:
                    allreduce = with_sizes_covering(allreduce, max(link_sizes), past, settings, advance, cache, notes)
            with phase(f"timing the all-reduce beside computing ranks ({bytes_text(gradient_bytes)})") as notes:
                allreduce = with_beside_compute(allreduce, gradient_bytes, settings, cache, notes)
    sizes = all_to_all_sizes(layers, expert_parallel)
    all_to_all = None
    if link_sizes and sizes:
        with phase(f"measuring the all-to-all over {expert_parallel} ranks ({len(sizes)} sizes)") as notes:
            key = {"device": settings.device.type, "sizes": sizes, "world_size": expert_parallel,
                   "repeats": settings.repeats, "warmup": settings.warmup}
            measure = lambda: measure_all_to_alls(sizes, expert_parallel, settings, advance)  # noqa: E731
            measured = cache.get("all-to-all", key, measure, own_tasks=expert_parallel) if cache is not None \
                else fresh(measure)
            all_to_all = AllToAllProfile.model_validate(measured.value)
            if cache is not None:
                notes.append(measured.describe())
                all_to_all = all_to_all.model_copy(update={"meta": {**all_to_all.meta,
                                                                    "host_cache": measured.meta()}})
    return Profile(
        schema_version=SCHEMA_VERSION, environment=environment(settings, dtype_name, memory_cap_bytes, passes_as),
        model=ModelInfo(name=model.name, options=model.options), layers=layers,
        partition=Partition(bounds=bounds, optimizer=optimizer),
        stages=aggregate_stages(layers, bounds, optimizer, boundary_bytes(layers, bounds, dag=False), steps,
                                passes, boundary_held_bytes(layers, bounds, dag=False)),
        link=link, allreduce=allreduce, all_to_all=all_to_all)


def sizes_covering(link_sizes: list[int], nbytes: int) -> list[int]:
    """Powers of two past the largest of `link_sizes`, up to the first that holds `nbytes` (none where it does)."""
    sizes, size = [], max(link_sizes)
    while size < nbytes:
        size *= 2
        sizes.append(size)
    return sizes


def with_sizes_covering(allreduce: AllReduceProfile, link_max_bytes: int, sizes: list[int], settings: Settings,
                        advance: Advance, cache: HostCache | None, notes: list[str]) -> AllReduceProfile:
    """`allreduce` with points at `sizes` too (`sizes_covering`: the powers of two past `link_max_bytes`, the link's
    largest size, up to the first that holds the largest stage's gradients, which its REDUCE row all-reduces in one
    call, the executor's one flat bucket a stage: executor/replicas.py `bucket`). A fit of the link's sizes alone
    (1 MiB at most, as `benchmarks/fidelity.py` calibrates) priced a 4 MB all-reduce by extrapolation.

    Host cache entries of their own (`allreduce-past`), each keyed by what fixes its measurement (device, repeats,
    warmup: its ranks run links.py LINK_THREADS whatever --threads) and the size its powers start past, holding them
    up to its `covers_bytes`: a model whose gradients an entry covers takes its points up to `sizes[-1]`; one that
    needs more takes them all and goes on from `covers_bytes` to the entry keyed there, measuring (and keeping
    there) only the sizes no entry holds. Each entry is reused or measured again under the cache's rule on its own,
    so that points measured at different times each say when and under what load: in
    `meta["sizes_covering"]["host_cache"]`, one for each entry, with the sizes taken from it."""
    points: list[dict[str, Any]] = []
    kept: list[dict[str, Any]] = []
    start_bytes = link_max_bytes
    while start_bytes < sizes[-1]:
        missing = [size for size in sizes if size > start_bytes]
        key = {"device": settings.device.type, "repeats": settings.repeats, "warmup": settings.warmup,
               "past_bytes": start_bytes}
        measure = partial(_measure_allreduce_past, missing, settings, advance)
        measured = cache.get("allreduce-past", key, measure, own_tasks=2) if cache is not None else fresh(measure)
        taken = [point for point in measured.value["points"] if point["nbytes"] <= sizes[-1]]
        points += taken
        if cache is not None:
            taken_sizes = [point["nbytes"] for point in taken]
            span = " to ".join(bytes_text(size) for size in dict.fromkeys([taken_sizes[0], taken_sizes[-1]]))
            notes.append(f"{span} {measured.describe()}")
            kept.append({"sizes": taken_sizes, **measured.meta()})
        start_bytes = measured.value["covers_bytes"]
    covering = {"sizes": sizes, "covers_bytes": sizes[-1], **({"host_cache": kept} if cache is not None else {})}
    return allreduce.model_copy(update={"points": [*allreduce.points, *(LinkPointModel(**point) for point in points)],
                                        "meta": {**allreduce.meta, "sizes_covering": covering}})


def _measure_allreduce_past(sizes: list[int], settings: Settings, advance: Advance) -> dict[str, Any]:
    """The all-reduce's points at `sizes` and what they cover (the largest, `covers_bytes`), as JSON."""
    points = measure_allreduce(sizes, device=settings.device.type, repeats=settings.repeats, warmup=settings.warmup,
                               progress=lambda done, total: advance(f"all-reduce: round {done}/{total}"))
    return {"points": [asdict(point) for point in points], "covers_bytes": max(sizes)}


def with_beside_compute(allreduce: AllReduceProfile, gradient_bytes: int, settings: Settings,
                        cache: HostCache | None, notes: list[str]) -> AllReduceProfile:
    """`allreduce` with its time beside computing ranks at `gradient_bytes` (calibrate/links.py
    `measure_allreduce_beside_compute`): a host cache entry of its own, keyed by its workload and bytes, so that
    another model or cut reuses the link and the all-reduce's sizes and measures only this; where it came from in
    `meta["beside_compute_host_cache"]`."""
    key = {"device": settings.device.type, "repeats": settings.repeats, "warmup": settings.warmup,
           **BESIDE_COMPUTE, "bytes": gradient_bytes}
    measure = lambda: measure_allreduce_beside_compute(gradient_bytes, repeats=settings.repeats,  # noqa: E731
                                                       warmup=settings.warmup)
    measured = cache.get("beside", key, measure, own_tasks=2) if cache is not None else fresh(measure)
    meta = {**allreduce.meta, **measured.value}
    if cache is not None:
        notes.append(measured.describe())
        meta["beside_compute_host_cache"] = measured.meta()
    return allreduce.model_copy(update={"beside_compute": meta.pop("beside_compute"), "meta": meta})


def measure_links(link_sizes: list[int], settings: Settings, advance: Advance) -> dict[str, Any]:
    """The p2p link (its points and fit) and the all-reduce between two local ranks (the same two, started
    once), in `repeats` rounds over the sizes, each reported to `advance` as it starts: {"link": LinkProfile,
    "allreduce": AllReduceProfile}, as JSON."""
    def rounds(what: str) -> Callable[[int, int], None]:
        return lambda done, total: advance(f"{what}: round {done}/{total}")

    p2p, reduced = measure_p2p_and_allreduce(link_sizes, device=settings.device.type, repeats=settings.repeats,
                                             warmup=settings.warmup,
                                             progress=(rounds("p2p link"), rounds("all-reduce")))
    fit = fit_link(p2p)
    link = LinkProfile(segments=[asdict(s) for s in fit.segments], points=[asdict(p) for p in p2p],
                       meta=dict(fit.meta))
    allreduce = AllReduceProfile(world_size=reduced.meta["world_size"], points=[asdict(p) for p in reduced],
                                 meta=reduced.meta)
    return {"link": link.model_dump(mode="json"), "allreduce": allreduce.model_dump(mode="json")}


def all_to_all_sizes(layers: list[LayerProfile], ranks: int) -> list[int]:
    """The per-rank buffers a mixture of experts' layers exchange over `ranks` ranks (their counts, their token
    copies: workload/moe.py `exchanged_experts`, each MoE block's apart), each rounded down to an even split, and
    powers of four between the least and the most so that the fit sees the curve's shape; [] for a model without
    routed experts."""
    exchanged = {size for layer in layers if layer.dispatched_bytes
                 for size in (COUNT_BYTES * layer.routed_experts, *layer.dispatches_bytes)}
    if not exchanged:
        return []
    between = {1 << e for e in range(0, max(exchanged).bit_length(), 2) if min(exchanged) < 1 << e < max(exchanged)}
    return sorted({max(ranks, size - size % ranks) for size in exchanged | between})


def measure_all_to_alls(sizes: list[int], ranks: int, settings: Settings, advance: Advance) -> dict[str, Any]:
    """The all-to-all over `ranks` local ranks at `sizes` (calibrate/links.py) in `repeats` rounds, its points
    and their fit, as an AllToAllProfile's JSON."""
    points = measure_all_to_all(sizes, world_size=ranks, device=settings.device.type, repeats=settings.repeats,
                                warmup=settings.warmup,
                                progress=lambda done, total: advance(f"all-to-all: round {done}/{total}"))
    fit = fit_link(points)
    return AllToAllProfile(world_size=ranks, segments=[asdict(s) for s in fit.segments],
                           points=[asdict(p) for p in points], meta=dict(fit.meta)).model_dump(mode="json")
