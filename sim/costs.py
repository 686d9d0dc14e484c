"""What each op costs: time per kind and stage, and the bytes a stage holds and sends."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import TypeVar

import numpy as np

from ..choices import choose_from
from ..schedules import (
    COLLECTIVE_KINDS,
    KIND_CODE,
    KINDS,
    NUM_COMPUTE_KINDS,
    SYNCHRONOUS,
    Kind,
    Schedule,
    ScheduleError,
    StageGraph,
)
from ..units import MAX_BYTES, MAX_MS, MIB, number_allowed, value_text

# The passes a stage's `transient_bytes` name, and the row each is (`KINDS`)
TRANSIENT_KINDS = {"fwd": Kind.F, "bwd": Kind.B, "igrad": Kind.I, "wgrad": Kind.W}
COLLECTIVE_KIND_NAMES = tuple(sorted(kind.value for kind in COLLECTIVE_KINDS))
OPTIMIZER_STATE_FACTOR = {"sgd": 0, "momentum": 1, "adam": 2, "adamw": 2}
# How many times its own time a persistent product takes beside a communication kernel longer than it: the CTAs
# that find their multiprocessors held run their tiles after the others' (`product_delay`; a held pass's products,
# planning/estimate.py `op_ms`)
HELD_PRODUCT_SLOWDOWN = 2
# The share of a micro-batch's activations a split backward keeps from its I until its W where a stage does not say
# (`Costs.wgrad_activation_fraction`'s default)
WGRAD_ACTIVATION_FRACTION = 0.5
# A time in one unit throughout: the engine's integer picoseconds, or ms (`held_compute`)
Time = TypeVar("Time", int, float)
# A span that joins none before it (`held_compute`): NaN compares false with every end, even a kernel's that never
# ends (inf), which an (inf, inf) span would join and so leave unheld
_NO_KERNEL = (math.nan, math.nan)


def product_delay(kernel: float, product: float, slower: float = HELD_PRODUCT_SLOWDOWN) -> float:
    """How much later compute ends for a `kernel` beside it that holds some multiprocessors (any one unit: the
    engine's picoseconds, tune's and planning/experts.py's ms; `held_compute` steps it), its products of `product`
    each run back to back from the kernel's launch (or from where the compute meets it): a persistent product's CTAs
    that find theirs held start when the kernel ends or when its other CTAs free theirs, whichever comes first, so
    while the kernel runs each product takes `slower` times its time (`HELD_PRODUCT_SLOWDOWN`: twice; a pass's time
    beside the kernel over its own, planning/experts.py's pair's), and the one it ends in is later by what of the
    kernel it met, at most by what a product beside it adds (CUTLASS's sm90 `StaticPersistentTileScheduler`: a fixed
    share of the tiles per CTA; "nearly doubles" beside an all-gather on an H100, NVIDIA developer forums topic
    337991). `product` 0: compute of no persistent products (in waves, or on a share of the multiprocessors), evenly
    `slower` while the kernel runs: the kernel's time less what the compute does meanwhile. A kernel longer than a
    product delays it by that rate and, for the product it ends in, at most (1 - 1/`slower`) of a product more."""
    if not product:
        return kernel * (1 - 1 / slower)
    spans, left = divmod(kernel, slower * product)
    most = (slower - 1) * product  # in the product the kernel ends in
    return spans * (slower - 1) * product + (left if left <= most else most)


def held_compute(kernels: Sequence[tuple[Time, Time]], start: Time, work: Time, product: Time | None,
                 slower: float = HELD_PRODUCT_SLOWDOWN, hold_tag: int = 0) -> tuple[Time, list[Time]]:
    """When `work` of compute begun at `start` ends beside `kernels` (begin, end: any order, overlapping, several
    streams'), in one unit (the engine's integer ps, planning/experts.py's ms), and its holds, three numbers each:
    `hold_tag` (the engine's clock index), how far into the work it began, and how much later it made the work end.
    Wherever some kernel runs (kernels that overlap or touch joined: the multiprocessors stay held) it delays the
    work as `product_delay` says for its products of `product` each, `slower` times their time beside a kernel, at
    most to `slower` times the work left; at its own speed otherwise. `product` 0: none persistent (in waves on the
    multiprocessors the kernel leaves, or given a target), evenly `slower`. None: persistent products whose time is
    not known (the engine's device without a product time), each held for the kernel's time left or its own, the
    less, so for the kernel's whole time: the work makes no progress while any kernel runs."""
    stop = start + work
    for begin, end in kernels:
        if end > start and begin < stop:
            break
    else:  # none runs beside the work (about half the engine's calls): spare the spans, which would hold nothing
        return stop, []
    clock, done, holds = start, 0, []
    spans = sorted(kernels)
    spans.append(_NO_KERNEL)  # after the last: the spans joined up to it are held
    spans = iter(spans)
    begin, end = next(spans)
    for later_begin, later_end in spans:
        if later_begin <= end:  # overlaps or touches the kernels joined so far: one span
            if later_end > end:
                end = later_end
            continue
        if end > clock:
            if begin >= clock + work - done:
                break
            if begin > clock:
                done += begin - clock
                clock = begin
            if product is None:
                held = end - clock
            else:
                held, most = product_delay(end - clock, product, slower), (work - done) * (slower - 1)
                if held > most:
                    held = most
            holds += hold_tag, done, held
            clock += held
        begin, end = later_begin, later_end
    return clock + work - done, holds


@dataclass(frozen=True)
class Precision:
    """How a runtime holds each parameter, in bytes: the weights the passes read, their gradients as accumulated,
    the optimizer's float32 master copy of the weights (0: it updates the weights themselves) and each tensor of
    its state (a moment). The master copy is optimizer state, sharded with it. `stored_bytes`: the weights as
    stored between passes, which the passes read as copies of `weight_bytes` gathered from them (FSDP2's mixed
    precision: float32 shards, 16-bit compute copies; None: the weights the passes read are the stored ones).
    `adam_moments`: whose setting holds Adam's moments so, one no other optimizer reads ("": it holds any
    optimizer's state)."""

    weight_bytes: int
    grad_bytes: int
    master_bytes: int
    state_bytes: int
    stored_bytes: int | None = None
    adam_moments: str = ""

    def optimizer_state_bytes(self, weight_bytes: int, optimizer: str) -> int:
        """The state `optimizer` keeps, master copy included, for weights of `weight_bytes`."""
        params = weight_bytes / self.weight_bytes
        return round(params * (self.master_bytes + OPTIMIZER_STATE_FACTOR[optimizer] * self.state_bytes))

    def gradient_bytes(self, weight_bytes: int) -> int:
        return round(weight_bytes / self.weight_bytes * self.grad_bytes)

    def master_weight_bytes(self, weight_bytes: int) -> int:
        """The master copy of weights the passes read as `weight_bytes` (0: none)."""
        return round(weight_bytes / self.weight_bytes * self.master_bytes)

    def stored_weight_bytes(self, weight_bytes: int) -> int | None:
        """The stored weights of weights the passes read as `weight_bytes` (None: those themselves)."""
        return None if self.stored_bytes is None else round(weight_bytes / self.weight_bytes * self.stored_bytes)


# `--precision`: fp32 holds everything in float32; megatron is Megatron-LM's mixed precision (--bf16: 16-bit
# weights, float32 main gradients, float32 master weights and moments); megatron-16bit-grads accumulates and
# reduces the gradients in 16 bits (Megatron-core's DistributedDataParallelConfig(grad_reduce_in_fp32=False));
# fsdp2 is torch FSDP2's MixedPrecisionPolicy as torchtitan sets it (param_dtype bfloat16, reduce_dtype float32;
# torchtitan/parallelisms/parallelize_llama.py `apply_fsdp`): the sharded parameters stay float32 and are what
# the optimizer updates (no master copy), each pass computes with 16-bit copies all-gathered from them
# (`FSDPParam.all_gather_inputs` casts them to param_dtype), gradients are reduced and accumulated in float32
# (`to_accumulated_grad_if_needed`) and Adam's moments follow the float32 parameters. Only with --zero 3.
# nemo-bf16-adam is NeMo's distributed Adam (Apex's DistributedFusedAdam) with `optim.dtype: bf16` and
# `optim.grad_sync_dtype: bf16`, as NVIDIA's Nemotron-4 340B benchmark sets them (NVIDIA/dgxc-benchmarking
# nemotron/nemotron4-340b-synth.yaml, NeMo 24.09): gradients accumulated and reduced in 16 bits, the moments in
# 16 bits, and no master copy, since NeMo's `setup_optimization` (megatron_base_model.py) sets `store_params=False`
# when the optimizer's dtype is the model's. megatron-bf16-moments is megatron with AdamW's two moments in 16 bits,
# as DeepSeek-V3 trained (arXiv 2412.19437, section 3.3.3, "Low-Precision Optimizer States": "We adopt the BF16
# data format instead of FP32 to track the first and second moments in the AdamW optimizer [...] However, the
# master weights (stored by the optimizer) and gradients (used for batch size accumulation) are still retained in
# FP32").
PRECISIONS = {"fp32": Precision(4, 4, 0, 4), "megatron": Precision(2, 4, 4, 4),
              "megatron-16bit-grads": Precision(2, 2, 4, 4), "fsdp2": Precision(2, 4, 0, 4, stored_bytes=4),
              "nemo-bf16-adam": Precision(2, 2, 0, 2, adam_moments="NeMo's distributed Adam, which runs Adam alone"),
              "megatron-bf16-moments": Precision(2, 4, 4, 2, adam_moments="Megatron-LM's exp_avg_dtype, which its Adam "
                                                                          "alone reads")}


def owned_bytes(param_bytes: int, master_bytes: int, stored_bytes: int | None) -> int:
    """Weights the passes read as `param_bytes` as the optimizer owns them, which a policy's master copies are of
    (`WeightPolicy.master_copies`): its master copy (`master_bytes`), else the weights it updates itself, as stored
    (`stored_bytes`; None: as the passes read them). A stage's (`StageCosts.owned_weight_bytes`) and tune's
    partitioner's, layer by layer."""
    return master_bytes or (param_bytes if stored_bytes is None else stored_bytes)


def precision_refusal(name: str, flag: str = "precision") -> str | None:
    """The one line refusing a precision that is not one of `PRECISIONS`, naming it as its reader does (`flag`: the
    commands' --precision); None for one that is. The typed costs and the estimate's parallelism refuse with it."""
    return None if name in PRECISIONS else choose_from(flag, PRECISIONS, name)


def precision_optimizer_refusal(precision: str | None, optimizer: str, profile: bool = False) -> str | None:
    """The one line refusing SGD, with or without momentum, under a precision that holds Adam's moments
    (`Precision.adam_moments`), given as --precision or, with `profile`, as the profile was estimated; None where
    they go together, or where either is none known (its reader refuses it)."""
    if precision not in PRECISIONS or not PRECISIONS[precision].adam_moments or optimizer not in ("sgd", "momentum"):
        return None
    held = f"holds Adam's two moments ({PRECISIONS[precision].adam_moments}); {optimizer} keeps neither"
    if profile:
        return (f"--optimizer {optimizer}: the profile was estimated with --precision {precision}, which {held}: give "
                "--optimizer adam or adamw, or estimate it with another --precision")
    return (f"--optimizer {optimizer}: --precision {precision} {held}: give --optimizer adam or adamw, or another "
            "--precision")


# Whose pipeline runtime holds the boundary tensors (`--pp-runtime`, `held_as_runtime`).
PP_RUNTIMES = ("pipesim", "torch")


class CostError(ValueError):
    """Costs that cannot describe a run; the message names the field and what is allowed."""


@dataclass(frozen=True)
class StageCosts:
    """One model stage for one micro-batch (times) or in total (parameter and optimizer bytes).

    `activation_bytes` are saved from the forward until the backward frees them; `output_bytes` is the
    boundary tensor sent to each next stage (its gradient travels back with the same size). A split
    backward's parts cost `igrad_ms` and `wgrad_ms` where measured (run apart they take longer than B,
    since the weight pass walks the graph again), else `wgrad_fraction` of `bwd_ms` is the W part.
    `avg_ms` is the elastic averaging of one pipeline's replica with the reference weights; what an AVG
    of P pipelines costs is `Costs.op_ms_table`'s to say. `accumulate_ms` is adding one micro-batch's
    weight gradients into the mini-batch's buffer: a runtime that keeps one buffer pays it in every B (or W)
    but the first after an update, which the simulator prices row by row. `copy_ms` is copying the stage's
    weights, which an update does first where later rows still read the version it supersedes (the
    lowering's `copies_delta` > 0 at the OPT: copy-on-write). `held_bytes`, where known (a profile's layers
    say what autograd saves), is what the runtime holds from a micro-batch's F until its backward beyond
    `activation_bytes`: the received inputs and sent outputs no layer saves (the backward's leaves and roots);
    the boundary tensors are then the stage's own from F to backward, counted once. None: they are buffers of
    their own, a received one held until its consumer ends, a sent one until its transfer does. `reduce_ms`:
    the network time of the stage's gradient synchronisation over its data-parallel replicas (a REDUCE: an
    all-reduce, or with a sharded optimizer a reduce-scatter), `gather_ms` that of the all-gather of its updated
    weights (a GATHER); the simulator runs them on the device's network stream, beside its compute.
    `grad_bytes`: the weight gradients as accumulated (float32 under Megatron-LM's mixed precision; None: as
    large as the weights); `optimizer_state_bytes` includes a mixed-precision master copy of the weights, of
    `master_bytes` (0: none, the optimizer updates the weights themselves).
    `activation_parts`: of `activation_bytes`, the bytes by what saves them (attention, mlp, norms, dropout,
    other), summing to them; None: not attributed. `stored_bytes`: the weights as stored between passes where
    ZeRO-3 shards them, if not as the passes read them (FSDP2's float32 shards of 16-bit compute copies; None:
    `param_bytes`). `gathered_bytes`: under ZeRO-3 with one stage and no pipeline, the whole weights one pass
    holds at a time (FSDP2 gathers each wrapped module before its pass and the next one's during it; None: the
    stage's whole weights). `all_gather_bytes`: the stage's weights as ZeRO-3's all-gather moves them and holds them
    whole (FSDP2's float8 all-gather: its float8 linears' at 1 byte an element; None: `param_bytes`), or below
    ZeRO-3 as the distributed optimizer gathers them and holds them between steps (TransformerEngine's float8
    weights, planning/estimate.py `gathered_weight_bytes`), and
    `gather_cast_ms` the work before each all-gather on the rank's shard (that all-gather's casts to float8), both
    in its GATHER. `float8_weight_bytes`: float8 casts of the weights a float8 recipe holds between
    updates beside them (TransformerEngine's), whole on every data-parallel rank. `all_to_all_fwd_ms` and
    `all_to_all_bwd_ms`: the network time of the all-to-alls of the stage's routed experts over their
    expert-parallel group after a forward (an A2A_F) and after a backward (an A2A_B), on the network stream;
    `all_to_all_paired_ms`: of both, what Megatron-core's overlapped pair of a forward and a backward leaves exposed
    (its layers' nodes side by side: planning/experts.py `paired_exposed_ms`; 0: not known, each part's all-to-alls
    hidden under the other part's whole compute), half of it its forward's and half its backward's, and
    `all_to_all_paired_by_node` whether it was priced so (an exposure of 0 may be: all hidden, slowed or not);
    `pair_layer_bytes`: the largest of its layers' `activation_bytes`, which an overlapped pair's forward holds
    beside its backward's micro-batch while the pair runs (None: not known, its whole activations): the pair runs
    layer i's forward beside layer L-1-i's backward and frees each backward layer's state as it goes
    (megatron/core/models/common/model_chunk_schedule_plan.py `TransformerModelChunkSchedulePlan.run` at
    Megatron-LM 01cf4fb5: `get_layer(i)` beside `pop_layer()`, `release_state()` after each pair), so the newer
    micro-batch grows a layer as the older shrinks by one: one micro-batch and a layer at the most (a pair with
    all-to-alls, Megatron-core's; one without keeps both micro-batches': sim/engine.py `_paired_forwards_held`);
    `fwd_sharing_ms` and `bwd_sharing_ms`: the forward and backward beside the dispatcher's kernels, on the
    multiprocessors they leave, persistent products held (planning/estimate.py `sharing_dispatcher`; 0: none held),
    which an overlapped pair's part runs at while the other part's all-to-alls run (`Costs.sharing_dispatcher_ms`;
    Megatron-core's pair, node by node, in its `all_to_all_paired_ms` instead);
    `collective_delay_ms`: how long the stage's REDUCE and GATHER hold back the products of its device's other
    stages they run beside (their whole time where products run persistent CTAs: planning/scenario.py's
    `_collectives_beside_products`), paid in its OPT row, which runs that much longer;
    `expert_param_bytes`, of `param_bytes`, the routed experts' weights, whose gradients under E-way expert
    parallelism only the d/E replicas that hold the same experts reduce. `expert_shards`: W, the rank holds 1/W of
    the model's routed experts (E·ETP/t, planning/experts.py `weight_shards`), so their own data-parallel group, over
    which ZeRO shards them (Megatron-core's expert data-parallel group, d·C·t/(E·ETP) ranks), is W times smaller than
    the d·C the rest shard over: a shard holds `shard_scale` times 1/(d·C) of the stage's weights, gradients and state.
    `ring_fwd_ms` and `ring_bwd_ms`: the link time of the key/value exchanges of the stage's attention around its
    context-parallel ring during a forward (a RING_F) and during a backward (a RING_B: the keys and values again
    and their gradients, and a full recomputation's forward ring), on the network stream; `ring_fwd_hidden_ms`
    and `ring_bwd_hidden_ms`: how much of that the pass's attention blocks cover, each step's exchange under its
    own block (planning/estimate.py's `ContextRing.exchange_ms`), which the simulator subtracts from them
    (`hidden_ms_table`). `ring_buffer_bytes`: per pass
    (`TRANSIENT_KINDS`' names), the ring's send and receive buffers it holds while it runs, as communication.
    `model_output_bytes`: the last stage's, the model's output its loss reads (the logits) per micro-batch, which
    torch's pipelining keeps until the step ends (`held_as_runtime`; 0: none known).
    Where the runtime keeps the tensors passed between stages (`held_as_runtime`; all 0 otherwise), per
    micro-batch: `receive_buffer_bytes`, the receive buffers the stage keeps the whole step (held from the start,
    as communication); `buffered_input_bytes`, of those, the inputs its forward computes on in place (no longer
    among its activations); `forward_kept_bytes` and `backward_kept_bytes`, what each forward (its sent outputs,
    the model's output) and each B or I (its inputs' gradients) leaves until the stage's update.
    `runtime_buffer_bytes`: a buffer the runtime keeps allocated for the whole run for the stage's layers, one a
    process however many of its stages ask, the largest kept (Megatron-LM's global memory buffer: the unfused
    attention's baddbmm input, `--scores-buffer`, planning/estimate.py); held from the start as `runtime_buffers`.
    `transient_bytes`: per pass (fwd, bwd, igrad, wgrad: an F, B, I, W row), what it holds above the stage's
    activations while it runs, created and freed within it (`profiles.schema.stage_transient_bytes`; none: 0).
    `wgrad_kept_bytes`: what a split backward keeps of `activation_bytes` from the end of its input-gradient part
    (I) until its weight-gradient part (W) ends: Megatron-LM's deferred W its products' saved inputs
    (planning/estimate.py `wgrad_kept`), pipesim's executor its graph below its weights' nodes (a calibration's,
    calibrate/measure.py `measure_wgrad_held`), torch's pipelining all of them (`held_as_runtime`); None: not known,
    `Costs.wgrad_activation_fraction` of them. `wgrad_gradient_bytes`: the products' output gradients the I makes
    and leaves for the W beside them (0 where `wgrad_kept_bytes` is None). A stage fed by the batch alone runs none
    of its layers in its I: all of its activations kept, no gradients (profiles/schema.py `wgrad_held_ranges`).
    `product_ms`: how long one of its passes' persistent products runs, the mean of their times weighted by their
    times (the product a kernel launched at a random moment meets; an estimate's `LayerProfile.product_ms`), by
    which a transfer's kernel beside it delays it at most (`Costs.transfers_hold_products`); 0: none known, left out
    of its device's mean (sim/engine.py `device_product_ms`), a device with none held the kernel's whole time.
    """

    fwd_ms: float
    bwd_ms: float
    wgrad_fraction: float = 0.5
    opt_ms: float = 0.0
    pred_ms: float = 0.0
    avg_ms: float = 0.0
    param_bytes: int = 0
    activation_bytes: int = 0
    output_bytes: int = 0
    optimizer_state_bytes: int = 0
    igrad_ms: float | None = None
    wgrad_ms: float | None = None
    accumulate_ms: float = 0.0
    copy_ms: float = 0.0
    held_bytes: int | None = None
    reduce_ms: float = 0.0
    gather_ms: float = 0.0
    grad_bytes: int | None = None
    activation_parts: dict[str, int] | None = None
    stored_bytes: int | None = None
    gathered_bytes: int | None = None
    float8_weight_bytes: int = 0
    all_gather_bytes: int | None = None
    gather_cast_ms: float = 0.0
    transient_bytes: dict[str, int] = field(default_factory=dict)
    all_to_all_fwd_ms: float = 0.0
    all_to_all_bwd_ms: float = 0.0
    all_to_all_paired_ms: float = 0.0
    all_to_all_paired_by_node: bool = False
    fwd_sharing_ms: float = 0.0
    bwd_sharing_ms: float = 0.0
    collective_delay_ms: float = 0.0
    expert_param_bytes: int = 0
    expert_shards: float = 1.0
    ring_fwd_ms: float = 0.0
    ring_bwd_ms: float = 0.0
    ring_fwd_hidden_ms: float = 0.0
    ring_bwd_hidden_ms: float = 0.0
    ring_buffer_bytes: dict[str, int] = field(default_factory=dict)
    model_output_bytes: int = 0
    receive_buffer_bytes: int = 0
    buffered_input_bytes: int = 0
    forward_kept_bytes: int = 0
    backward_kept_bytes: int = 0
    runtime_buffer_bytes: int = 0
    product_ms: float = 0.0
    wgrad_kept_bytes: int | None = None
    wgrad_gradient_bytes: int = 0
    master_bytes: int = 0
    pair_layer_bytes: int | None = None

    @property
    def gradient_bytes(self) -> int:
        return self.param_bytes if self.grad_bytes is None else self.grad_bytes

    @property
    def owned_weight_bytes(self) -> int:
        return owned_bytes(self.param_bytes, self.master_bytes, self.stored_bytes)

    @property
    def gathered_weight_bytes(self) -> int:
        return self.param_bytes if self.all_gather_bytes is None else self.all_gather_bytes

    @property
    def stored_param_bytes(self) -> int:
        return self.param_bytes if self.stored_bytes is None else self.stored_bytes

    @property
    def shard_scale(self) -> float:
        """A ZeRO shard over the stage's d·C ranks in 1/(d·C)s of what it shards: the dense weights' 1/(d·C) and
        the routed experts' 1/(d·C/W) (`expert_shards`), 1 + (W - 1)·f for the experts' share f of the weights."""
        if not self.param_bytes:
            return 1.0
        return 1 + (self.expert_shards - 1) * self.expert_param_bytes / self.param_bytes

    def __post_init__(self) -> None:
        given = self.__dict__
        for name, limit, optional in _STAGE_NUMBERS:
            value = given[name]
            if value is None and optional:
                continue
            if not isinstance(value, (int, float)) or not math.isfinite(value) or not 0 <= value <= limit:
                raise CostError(f"{name} must be a finite number from 0 to {limit:g} (got {value!r})")
        if not (isinstance(self.expert_shards, (int, float)) and math.isfinite(self.expert_shards)
                and self.expert_shards > 0):
            raise CostError(f"expert_shards must be a finite number over 0 (got {self.expert_shards!r})")
        if not 0.0 <= self.wgrad_fraction <= 1.0:
            raise CostError(f"wgrad_fraction must be between 0 and 1 (got {self.wgrad_fraction!r})")
        for name in ("transient_bytes", "ring_buffer_bytes"):
            if any(pass_name not in TRANSIENT_KINDS or not isinstance(value, int) or value < 0
                   for pass_name, value in getattr(self, name).items()):
                raise CostError(f"{name} must give whole bytes >= 0 for some of {', '.join(TRANSIENT_KINDS)} "
                                f"(got {getattr(self, name)!r})")
        if self.activation_parts is not None and sum(self.activation_parts.values()) != self.activation_bytes:
            raise CostError(f"activation_parts must sum to activation_bytes ({self.activation_bytes})")


_STAGE_TIMES = ("fwd_ms", "bwd_ms", "opt_ms", "pred_ms", "avg_ms", "igrad_ms", "wgrad_ms", "accumulate_ms", "copy_ms",
                "reduce_ms", "gather_ms", "all_to_all_fwd_ms", "all_to_all_bwd_ms", "ring_fwd_ms", "ring_bwd_ms",
                "ring_fwd_hidden_ms", "ring_bwd_hidden_ms", "fwd_sharing_ms", "bwd_sharing_ms", "all_to_all_paired_ms",
                "gather_cast_ms", "collective_delay_ms", "product_ms")
_STAGE_OPTIONAL = ("igrad_ms", "wgrad_ms", "held_bytes", "grad_bytes", "stored_bytes", "gathered_bytes",
                   "all_gather_bytes", "wgrad_kept_bytes", "pair_layer_bytes")
# What `StageCosts.__post_init__` checks, in its order: each number field, the most it may be (a time's MAX_MS, a
# size's MAX_BYTES), and whether it may be None; worked out once, since a search builds tens of thousands of stages'
# costs
_STAGE_NUMBERS = tuple((name, MAX_MS if name in _STAGE_TIMES else MAX_BYTES, name in _STAGE_OPTIONAL) for name in (
    *_STAGE_TIMES, "param_bytes", "activation_bytes", "output_bytes", "optimizer_state_bytes", "expert_param_bytes",
    "float8_weight_bytes", "model_output_bytes", "receive_buffer_bytes", "buffered_input_bytes", "forward_kept_bytes",
    "backward_kept_bytes", "wgrad_gradient_bytes", "runtime_buffer_bytes", "master_bytes", *_STAGE_OPTIONAL[2:]))


@dataclass(frozen=True)
class RowOverhead:
    """What a runtime costs per row beyond the row's work (a calibration profile's `runtime`; zero by default):
    `compute_ms[kind]` is added to every compute row of that kind (kinds in `KINDS` order, the compute ones);
    a SEND holds its device for `send_ms` after issuing its transfer, a RECV for `recv_ms` after its message
    arrives; and after a row of kind `KINDS[i]` the device spends `gap_ms[i]` before its next row starts.
    None of it is in a row's own duration but `compute_ms`, as a measured trace times its rows.
    `warmup_ms[j]`: what a fresh rank's rows after its first j·`warmup_rows` compute rows and before the next
    `warmup_rows` (j < len) cost beyond their steady time, each (a compute row in its duration, another in the
    host time after it): a process's first passes, updates and sends run cold code; a short run's time per
    mini-batch carries it, a long run's hardly."""

    compute_ms: tuple[float, ...] = (0.0,) * NUM_COMPUTE_KINDS
    send_ms: float = 0.0
    recv_ms: float = 0.0
    gap_ms: tuple[float, ...] = (0.0,) * len(KINDS)
    warmup_ms: tuple[float, ...] = ()
    warmup_rows: int = 8

    def __post_init__(self) -> None:
        if len(self.compute_ms) != NUM_COMPUTE_KINDS or len(self.gap_ms) != len(KINDS):
            raise CostError(f"row overhead: give {NUM_COMPUTE_KINDS} compute and {len(KINDS)} gap times, one per kind")
        for value in (*self.compute_ms, self.send_ms, self.recv_ms, *self.gap_ms, *self.warmup_ms):
            if not isinstance(value, (int, float)) or not math.isfinite(value) or not 0 <= value <= MAX_MS:
                raise CostError(f"row overhead times must be finite numbers from 0 to {MAX_MS:g} (got {value!r})")
        if not isinstance(self.warmup_rows, int) or self.warmup_rows < 1:
            raise CostError(f"warmup_rows: {number_allowed(1, None)} (got {value_text(self.warmup_rows)})")

    def warmup_extra_ms(self, computed_before: np.ndarray) -> np.ndarray:
        """Per row, given the compute rows its device ran before it, what it costs beyond its steady time (0
        past the warm-up)."""
        extra = np.asarray((*self.warmup_ms, 0.0), dtype=float)
        return extra[np.minimum(computed_before // self.warmup_rows, len(self.warmup_ms))]

    @property
    def host_ms(self) -> np.ndarray:
        """Per kind (`KINDS` order), the time a row of it holds its device beyond its own duration."""
        extra = {Kind.SEND_F: self.send_ms, Kind.SEND_B: self.send_ms, Kind.RECV_F: self.recv_ms,
                 Kind.RECV_B: self.recv_ms}
        return np.array([gap + extra.get(kind, 0.0) for kind, gap in zip(KINDS, self.gap_ms)])


def wgrad_held(activation_bytes: Sequence[int] | np.ndarray, kept_bytes: Sequence[int] | np.ndarray,
               gradient_bytes: Sequence[int] | np.ndarray, known: Sequence[bool] | np.ndarray,
               fraction: float) -> tuple[np.ndarray, np.ndarray]:
    """Elementwise, of stages (or of ranges of layers) with these activations: what a split backward holds from the
    end of its I until the end of its W: what its W reads (`kept_bytes` where `known`, as
    `StageCosts.wgrad_kept_bytes`; else `fraction` of the activations, rounded to whole bytes), and the output
    gradients its I makes for the W beside them (none where not known). Not bounded by the activations: under
    recomputation the I saves its products' inputs again, more than the forward kept (planning/estimate.py
    `wgrad_kept`), all held until W; only the simulator's split of it, the part the forward saved, is at most them
    (sim/engine.py `_memory_tables`). The simulator's memory and auto's activation limit read it through
    `Costs.wgrad_held_bytes`, --stage-cut fit for every range of a profile's layers (planning/scenario.py
    `StageMemory`): what the search and the cut hold within memory the simulation holds too."""
    known = np.asarray(known, dtype=bool)
    kept = np.where(known, kept_bytes, np.round(fraction * np.asarray(activation_bytes, dtype=float)))
    return kept.astype(np.int64), np.where(known, gradient_bytes, 0).astype(np.int64)


@dataclass(frozen=True)
class Costs:
    """Per-stage costs of a whole model.

    `wgrad_activation_fraction`: share of a micro-batch's activations a split backward keeps from its
    input-gradient part (I) until its weight-gradient part (W) where a stage does not say what it keeps
    (`StageCosts.wgrad_kept_bytes`). `overhead`: the runtime's own cost per row.
    `kept_gradients`: copies of a stage's weight gradient its update leaves held (pipesim's executor keeps the
    last one on the weights, which SGD's prediction extrapolates), so from the first backward after an update
    until the next update a second gradient buffer is held as well. `recv_window`: receives the runtime keeps
    posted ahead of the row it runs (pipesim's executor: 16), each holding its buffer from its posting; 0 holds
    a received buffer from its message's arrival. `calibration`: the profile the costs were measured into
    (`Profile.describe`), which traces record; None: typed what-if costs.

    `overlap_hidden_fraction`: of an overlapped pair (DualPipe's F&B: a forward and another micro-batch's backward
    on one device), the share of its shorter part that runs hidden under its longer part, so the pair takes
    F + B − fraction × min(F, B) (`overlapped_ms`). 0 by default: both parts compute on the same device, and what
    DualPipe hides under the other part's compute is each part's communication (expert parallelism's all-to-all),
    which these costs have none of; a measured F&B gives the fraction (F + B − F&B) / min(F, B).

    `collective_links`: per collective kind (its name), the link its rows run on where it is not the device's
    network (none named: every collective on that one). The simulator keeps a stream per device and link: rows on
    one link run one after another, on different links side by side (a context ring on NVLink beside the
    data-parallel reduce-scatter across nodes, as Megatron runs them on their own communicators).

    `kept_until_update`: the tensors sent and received are the receive buffers and kept outputs a runtime holds
    until each stage's update (`held_as_runtime`, torch's stage), not buffers of their own; False: pipesim's
    runtime, a received tensor a buffer from its arrival until its consumer ends, a sent one until its transfer
    ends. `merges_outputs`: the runtime concatenates the model outputs a stage kept into a new tensor after its
    device's last full or weight backward of a mini-batch, held until its update begins (`merges_outputs`).

    `transfers_hold_products`: the devices' products run persistent CTAs (Hopper: `Curve.persistent_products`),
    so a point-to-point transfer's NCCL kernel, which holds its multiprocessors from its launch until its data
    has moved and shares none with compute kernels (NVIDIA/nccl issues 689 and 1025), holds back the compute
    beside it on either device (the engine's, by `held_compute`): a send's from its issue until its data has
    arrived, a receive's while its data moves. A product's CTAs that find their multiprocessors held start when
    the kernel ends or when its other CTAs free theirs, whichever comes first, so each product it meets ends later
    by the kernel's time left or its own time, the less (the stages' `product_ms`; not known: the kernel's whole
    time, as the collectives beside products are charged, `StageCosts.collective_delay_ms`). What a receive
    posted ahead holds before its data
    moves (Megatron-core's `overlap_p2p_comm` posts each with the send before it) is not counted: the simulator
    knows when data moves, not when a runtime posts a receive. False (products in waves, an A100's): the compute
    runs on the SMs the kernel leaves, 1-2 fewer (NCCL's channels to a peer), which is not charged: under 0.1 % of
    a step (docs/hardware.md, "Beside a transfer before Hopper").

    `pairs_by_node`: an overlapped pair runs its layers' nodes side by side, as Megatron-core's expert-parallel
    overlap does (`overlap_moe_expert_parallel_comm`): each part's all-to-alls under the one node beside them, so
    its A2A rows hold their lane at least for what the stages' `StageCosts.all_to_all_paired_ms` leave exposed, and
    a stage whose layers priced the pair so (`all_to_all_paired_by_node`) keeps its parts' own times beside the
    dispatcher's kernels; False: each part's all-to-alls under the other part's whole compute (DualPipe's pairs).
    Set where the costs are built for a schedule that pairs so (planning/scenario.py `Scenario.costs`).
    """

    stages: tuple[StageCosts, ...]
    microbatch_size: int = 1
    wgrad_activation_fraction: float = WGRAD_ACTIVATION_FRACTION
    overhead: RowOverhead = RowOverhead()
    kept_gradients: float = 0.0
    recv_window: int = 0
    calibration: dict | None = None
    overlap_hidden_fraction: float = 0.0
    collective_links: dict[str, str] = field(default_factory=dict)
    kept_until_update: bool = False
    merges_outputs: bool = False
    transfers_hold_products: bool = False
    pairs_by_node: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.recv_window, int) or self.recv_window < 0:
            raise CostError(f"recv_window: {number_allowed(0, None)} (got {value_text(self.recv_window)})")
        if any(kind not in COLLECTIVE_KIND_NAMES or not isinstance(link, str) or not link
               for kind, link in self.collective_links.items()):
            raise CostError(f"collective_links must name a link for some of {', '.join(COLLECTIVE_KIND_NAMES)} "
                            f"(got {self.collective_links!r})")
        fraction = self.overlap_hidden_fraction
        if isinstance(fraction, bool) or not isinstance(fraction, (int, float)) or not 0.0 <= fraction <= 1.0:
            raise CostError(f"overlap_hidden_fraction must be a number from 0 to 1 (got {fraction!r})")

    def overlapped_ms(self, forward_ms: np.ndarray, backward_ms: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """What an overlapped pair's parts take, run together: the longer part its own time, the shorter part what
        of it is not hidden under the longer (`overlap_hidden_fraction`; a forward as long as its backward is taken
        for the shorter)."""
        forward_ms, backward_ms = np.asarray(forward_ms, dtype=float), np.asarray(backward_ms, dtype=float)
        hidden = self.overlap_hidden_fraction * np.minimum(forward_ms, backward_ms)
        forward_shorter = forward_ms <= backward_ms
        return forward_ms - hidden * forward_shorter, backward_ms - hidden * ~forward_shorter

    def sharing_dispatcher_ms(self, stage: np.ndarray, forward: bool, part_ms: np.ndarray,
                              beside_ms: np.ndarray) -> np.ndarray:
        """What an overlapped pair's part (a forward, or a backward: `forward`) of `stage` takes while the other
        part's all-to-alls run `beside_ms` beside it on kernels that hold multiprocessors (DeepEP's, NCCL's): for as
        long as they run, it computes at its own time over its time beside them (`StageCosts.fwd_sharing_ms`), the
        rest at full speed; unchanged where none are held. Its persistent products, each twice its time beside them,
        so lose half the kernels' time they meet: `product_delay`'s rate for kernels longer than a product (its step
        adds at most half a product a span; Megatron-core's pair takes it node by node, planning/experts.py
        `paired_exposed_ms`, by `held_compute`)."""
        own = np.array([c.fwd_ms if forward else c.bwd_ms for c in self.stages])[stage]
        sharing = np.array([c.fwd_sharing_ms if forward else c.bwd_sharing_ms for c in self.stages])[stage]
        slower = np.divide(sharing, own, out=np.ones_like(own), where=(sharing > 0) & (own > 0))
        return part_ms + np.minimum(beside_ms, part_ms * slower) * (1 - 1 / slower)

    def op_ms_table(self, pipelines: int) -> np.ndarray:
        """Ms of one op per (model stage, compute kind), kinds in `KINDS` order (F, B, I, W, OPT, PRED, AVG,
        REDUCE, GATHER): the one place that prices an op by its kind. An AVG averages all `pipelines` replicas
        with the reference, one after another, so it costs `pipelines` × `avg_ms`. A REDUCE or GATHER is
        network time, on a stream of its own."""
        return np.array([_op_ms(c, pipelines) for c in self.stages], dtype=float).reshape(-1, NUM_COMPUTE_KINDS)

    def wgrad_held_bytes(self) -> tuple[np.ndarray, np.ndarray]:
        """Per stage, what a split backward holds from the end of its I until the end of its W (`wgrad_held`)."""
        stages = self.stages
        return wgrad_held([c.activation_bytes for c in stages], [c.wgrad_kept_bytes or 0 for c in stages],
                          [c.wgrad_gradient_bytes for c in stages], [c.wgrad_kept_bytes is not None for c in stages],
                          self.wgrad_activation_fraction)

    def hidden_ms_table(self) -> np.ndarray:
        """Ms per (model stage, compute kind), as `op_ms_table`: of a collective row's network time, the part its
        pass's compute covers (a ring's exchanges under the attention blocks they run beside: a RING_F's under its
        forward's, a RING_B's under its backward's); 0 for every other kind."""
        hidden = np.zeros((len(self.stages), NUM_COMPUTE_KINDS))
        hidden[:, KIND_CODE[Kind.RING_F]] = [c.ring_fwd_hidden_ms for c in self.stages]
        hidden[:, KIND_CODE[Kind.RING_B]] = [c.ring_bwd_hidden_ms for c in self.stages]
        return hidden

    @classmethod
    def per_stage(
        cls,
        num_stages: int,
        *,
        fwd_ms: float | Sequence[float],
        bwd_ms: float | Sequence[float],
        wgrad_fraction: float = 0.5,
        opt_ms: float = 0.0,
        pred_ms: float | None = None,
        avg_ms: float | None = None,
        param_mb: float | Sequence[float] = 0.0,
        activation_mb: float | Sequence[float] = 0.0,
        output_mb: float | Sequence[float] = 0.0,
        optimizer: str = "adam",
        microbatch_size: int = 1,
        precision: str = "fp32",
    ) -> Costs:
        """Costs from what-if numbers: each either one value for every stage or one value per stage; `param_mb`
        is the weights as the passes read them, their gradients and optimizer state held as `precision` (one of
        `PRECISIONS`) says.

        A weight prediction (PRED) and an elastic averaging step (AVG) read and write a stage's weights and
        optimizer state as an update does, so they cost `opt_ms` unless given."""
        if optimizer not in OPTIMIZER_STATE_FACTOR:
            raise CostError(f"optimizer must be one of {', '.join(OPTIMIZER_STATE_FACTOR)} (got {optimizer!r})")
        if precision not in PRECISIONS:
            raise CostError(f"precision must be one of {', '.join(PRECISIONS)} (got {precision!r})")
        held = PRECISIONS[precision]
        if not isinstance(microbatch_size, int) or microbatch_size < 1:
            raise CostError(f"microbatch_size: {number_allowed(1, None)} (got {value_text(microbatch_size)})")
        values = {
            name: _expand(name, value, num_stages)
            for name, value in {"fwd_ms": fwd_ms, "bwd_ms": bwd_ms, "param_mb": param_mb,
                                "activation_mb": activation_mb, "output_mb": output_mb}.items()
        }
        stages = []
        for k in range(num_stages):
            param_bytes = _bytes(values["param_mb"][k])
            stages.append(StageCosts(
                fwd_ms=values["fwd_ms"][k],
                bwd_ms=values["bwd_ms"][k],
                wgrad_fraction=wgrad_fraction,
                opt_ms=opt_ms,
                pred_ms=opt_ms if pred_ms is None else pred_ms,
                avg_ms=opt_ms if avg_ms is None else avg_ms,
                param_bytes=param_bytes,
                activation_bytes=_bytes(values["activation_mb"][k]),
                output_bytes=_bytes(values["output_mb"][k]),
                optimizer_state_bytes=held.optimizer_state_bytes(param_bytes, optimizer),
                grad_bytes=held.gradient_bytes(param_bytes), stored_bytes=held.stored_weight_bytes(param_bytes),
                master_bytes=held.master_weight_bytes(param_bytes),
            ))
        return cls(tuple(stages), microbatch_size)


def _op_ms(c: StageCosts, pipelines: int) -> list[float]:
    """One stage's row of `Costs.op_ms_table`."""
    by_kind = {
        Kind.F: c.fwd_ms,
        Kind.B: c.bwd_ms,
        Kind.I: c.igrad_ms if c.igrad_ms is not None else c.bwd_ms * (1.0 - c.wgrad_fraction),
        Kind.W: c.wgrad_ms if c.wgrad_ms is not None else c.bwd_ms * c.wgrad_fraction,
        Kind.OPT: c.opt_ms + c.collective_delay_ms,
        Kind.PRED: c.pred_ms,
        Kind.AVG: c.avg_ms * pipelines,
        Kind.REDUCE: c.reduce_ms,
        Kind.GATHER: c.gather_ms,
        Kind.A2A_F: c.all_to_all_fwd_ms,
        Kind.A2A_B: c.all_to_all_bwd_ms,
        Kind.RING_F: c.ring_fwd_ms,
        Kind.RING_B: c.ring_bwd_ms,
    }
    return [by_kind[kind] for kind in KINDS[:NUM_COMPUTE_KINDS]]


def _expand(name: str, value: float | Sequence[float], num_stages: int) -> list[float]:
    values = list(value) if isinstance(value, Sequence) else [value]
    if len(values) == 1:
        values *= num_stages
    if len(values) != num_stages:
        raise CostError(
            f"{name} has {len(values)} values but the schedule has {num_stages} model stages: "
            "give one value, or one per stage"
        )
    for v in values:
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
            raise CostError(f"{name} values must be finite numbers >= 0 (got {v!r})")
    return [float(v) for v in values]


def _bytes(mib: float) -> int:
    """MiB (validated by `_expand`) to whole bytes."""
    return round(mib * MIB)


def held_as_runtime(costs: Costs, schedule: Schedule, pp_runtime: str) -> Costs:
    """`costs` with the tensors passed between `schedule`'s stages held as `pp_runtime`'s runtime (`PP_RUNTIMES`)
    holds them, as each stage's fields (`StageCosts.receive_buffer_bytes` and after), which sim/engine.py reads
    as it reads any cost. pipesim's: none, its buffers live only while in flight. torch's:
    torch.distributed.pipelining's stage (torch/distributed/pipelining/stage.py as torchtitan ran it in December
    2024, torch 1963fc8; docs/benchmarks.md) makes one receive buffer per micro-batch for every input from another
    device (`_prepare_forward_infra`) and every gradient of an output to one (`_prepare_backward_infra`) at its
    first step and keeps them, computes a forward on its input's buffer, keeps every forward's sent output
    (`output_chunks`; the last stage's, its `StageCosts.model_output_bytes`, are what the schedule merges and
    returns) and leaves every input's gradient on its buffer (`stage_backward` reads `.grad`) until the next
    step's `clear_runtime_states` (`Costs.kept_until_update`). Its split backward keeps every saved tensor from I
    until W (`StageCosts.wgrad_kept_bytes`, where known; the received inputs it computes on are its receive
    buffers, held the whole step): `stage_backward_input` runs autograd.grad with retain_graph=True and keeps the
    nodes where the weights' gradients branch off with the gradients arriving at them, which hold the graph up to
    the stage's input, until `stage_backward_weight` walks it (torch/distributed/pipelining/_backward.py at torch
    2.13); its schedules then merge the last stage's outputs (`merges_outputs`). Run once, where the scenario
    builds the costs (planning/scenario.py `Scenario.costs`). Raises ScheduleError for a stage graph torch's
    pipelining cannot run (`_torch_graph_refusal`)."""
    if pp_runtime == "pipesim":
        return costs
    refusal = _torch_graph_refusal(schedule)
    if refusal is not None:
        raise ScheduleError(refusal)
    stages = costs.stages
    inputs, outputs = [0] * len(stages), [0] * len(stages)
    for src, dst in schedule.graph.edges:
        if schedule.placement[src] != schedule.placement[dst]:
            inputs[dst] += stages[src].output_bytes
            outputs[src] += stages[src].output_bytes
    held = tuple(replace(c, receive_buffer_bytes=inputs[k] + outputs[k], buffered_input_bytes=inputs[k],
                       forward_kept_bytes=c.model_output_bytes + outputs[k], backward_kept_bytes=inputs[k],
                       wgrad_kept_bytes=(None if c.wgrad_kept_bytes is None else
                                         max(c.activation_bytes - inputs[k], 0)))
                 for k, c in enumerate(stages))
    return replace(costs, stages=held, kept_until_update=True, merges_outputs=merges_outputs(pp_runtime))


def keeps_saved_until_weights(pp_runtime: str) -> bool:
    """Whether `pp_runtime`'s split backward keeps every saved tensor of a pass from I until W (torch's
    `stage_backward_input` with retain_graph=True, as `held_as_runtime` holds it), where pipesim's runtime keeps only
    what the weight pass reads (Megatron-LM's zero-bubble `WeightGradStore`: `StageCosts.wgrad_kept_bytes`)."""
    return pp_runtime == "torch"


def merges_outputs(pp_runtime: str) -> bool:
    """Whether `pp_runtime`'s runtime concatenates the model outputs its last stage kept
    (`StageCosts.model_output_bytes`, one a micro-batch) into a new tensor once the stage's device has run its last
    backward of a mini-batch (`Costs.merges_outputs`; the caching allocator's replay: sim/caching_allocator.py
    `MERGE`), freed before the update. torch's: each schedule's `step` returns `_merge_outputs(output_chunks)` on
    the last stage after running all its actions (schedules.py, PipelineScheduleSingle and PipelineScheduleMulti
    alike), merge_chunks' `torch.cat` of every micro-batch's output (microbatch.py), which torchtitan's train loop
    drops as `step` returns (train.py at 9dec370); unconditionally until `step`'s `return_outputs`
    (pytorch#159251, after torchtitan's December 2024 pin, torch 1963fc8)."""
    return pp_runtime == "torch"


def _torch_graph_refusal(schedule: Schedule) -> str | None:
    """Why torch.distributed.pipelining cannot run `schedule`'s stage graph (None: it can). Its `PipelineStage`
    receives its input from stage_index - 1 and sends its output to stage_index + 1
    (torch/distributed/pipelining/stage.py at torch 2.13), so one model's stages form one chain; its schedules
    (schedules.py: ScheduleGPipe, Schedule1F1B, ScheduleLoopedBFS, ScheduleInterleaved1F1B,
    ScheduleInterleavedZeroBubble, ScheduleZBVZeroBubble, ScheduleDualPipeV) each run one such chain, DualPipeV's
    and ZB-V's two stages a rank as one V-shaped chain, none two model copies fed from both ends (DualPipe)."""
    graph = schedule.graph
    if graph.copies > 1:
        return (f"{_TORCH_STAGE.format(schedule.method)}, which runs one model's stages, not {graph.copies} "
                "copies of them")
    if sorted(graph.edges) != sorted(StageGraph.chain(graph.num_stages).edges):
        return (f"{_TORCH_STAGE.format(schedule.method)}, whose stages form one chain (each receives from the one "
                "before), not a branching graph")
    return None


def runtime_refusal(schedule: Schedule, pp_runtime: str) -> str | None:
    """Why `pp_runtime`'s pipeline runtime cannot run `schedule` (None: it can): torch's, a stage graph that is
    not one chain or stages that do not each update once a mini-batch, synchronously, in one pipeline. What
    `held_as_runtime` and the simulator refuse, asked of the order alone (`pipesim tune` refuses shapes by it)."""
    if pp_runtime == "pipesim":
        return None
    return _torch_graph_refusal(schedule) or kept_until_update_refusal(schedule)


def kept_until_update_refusal(schedule: Schedule) -> str | None:
    """Why costs that keep the tensors passed between stages until each stage's update (`Costs.kept_until_update`,
    torch's stage) cannot describe `schedule` (None: they can): torch's stage frees them as each update ends, so
    it runs one pipeline whose stages each update once a mini-batch with the weights their passes read (no
    stash, prediction or extra copy)."""
    t = schedule.table
    opt = t.kind == KIND_CODE[Kind.OPT]
    updated = np.unique((t.minibatch[opt].astype(np.int64) * schedule.graph.num_stages + t.stage[opt])
                        * schedule.pipelines + t.pipeline[opt])  # each (mini-batch, stage, pipeline) updated
    if (schedule.pipelines != 1 or schedule.policy != SYNCHRONOUS
            or len(updated) != schedule.graph.num_stages * schedule.minibatches):
        return (f"{_TORCH_STAGE.format(schedule.method)}, which runs one synchronous pipeline whose stages each "
                "update once a mini-batch")
    return None


_TORCH_STAGE = "{}: --pp-runtime torch is torch.distributed.pipelining's stage"
