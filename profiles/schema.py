"""The calibration Profile: versioned JSON of what one machine measured for one model.

Per-layer measurements are the ground truth; per-stage aggregates are kept for the partition chosen at
calibration (where the optimizer, prediction and averaging steps were timed on the stage's own weights)
and can be recomputed for any other partition (`stages_for`). Pure pydantic, no torch: the
simulator reads profiles without importing it.
"""

from __future__ import annotations

import itertools
import json
import math
import statistics
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Annotated, Any, Literal

import numpy as np
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SerializerFunctionWrapHandler,
    model_serializer,
    model_validator,
)

from ..choices import OPTIMIZERS
from ..choices import optimizer_refusal as optimizer_refusal  # re-exported: the profile's readers take it here
from ..files import PROFILE, read_document, validated
from ..memory_parts import SAVED_PARTS
from ..units import MAX_BYTES, MAX_MS, MIB, count_text, float_text, number_allowed
from .partition import (
    LayerCost,
    StageCosts,
    activation_ranges,
    empty_stages,
    exact_range_sums,
    owners,
    product_mean_ms,
    range_sums,
    stage_activation_bytes,
    stage_memory_bytes,
    with_range_ms,
)

SCHEMA_VERSION = 2  # 2 added the executor's runtime costs and gradient accumulation; version 1 still reads
SUPPORTED_VERSIONS = (1, 2)
MASTER_ONLY = "sgd"  # the optimizer whose state is a mixed-precision master copy alone (`Profile.master_bytes`)


class ProfileError(ValueError):
    """A profile file that cannot be used; the message is one line naming the file and the field."""


class _Strict(BaseModel):
    # defer_build: each model builds its validator when it first reads a profile, not at import: a run that reads
    # none (simulate, sweep or tune from cost flags) built all 23, 0.03 of simulate's 0.8 CPU s on a loaded host
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False, defer_build=True)


class Timing(_Strict):
    """Median of `repeats` timed runs after warm-up, and their interquartile range."""

    median_ms: float = Field(ge=0)
    spread_ms: float = Field(ge=0)
    repeats: int = Field(ge=1)


class Environment(_Strict):
    """Where and how the measurements were taken."""

    device: Literal["cpu", "cuda"]
    device_name: str
    device_memory_bytes: int | None = Field(ge=0)
    memory_cap_bytes: int | None = Field(gt=0)  # --memory-gb: the cap the partition respects
    dtype: Literal["float32", "bfloat16", "float16"]
    microbatch_size: int = Field(ge=1)
    threads: int = Field(ge=1)  # torch intra-op threads the times were measured with (a run's --threads-per-rank)
    torch_version: str
    cuda_version: str | None
    driver_version: str | None
    python_version: str
    pipesim_version: str
    host: str
    date: str  # ISO 8601, UTC
    # The host's load over the calibration (traces/hostload.py's HostLoad: the cores others kept busy, from CPU
    # time, where read; the 1-minute load average at its start and end, seconds, usable cpus, its own busy tasks,
    # when it began); None: not recorded (a profile from before)
    load: dict[str, Any] | None = None
    ranks: int | None = Field(None, ge=1)  # the most ranks computing at once it was calibrated for (contention)
    # the code its stages' passes were timed with (`calibrate --passes-as`): pipesim's executor, or
    # torch.distributed.pipelining's stage (calibrate/passes.py `TorchStageRun`), for predicting torch's runtime
    passes_as: Literal["executor", "torch"] = "executor"

    @model_serializer(mode="wrap")
    def _written(self, write: SerializerFunctionWrapHandler) -> dict[str, Any]:
        """Without `passes_as` where the executor's code timed the passes: such a profile is written as before."""
        written = write(self)
        if self.passes_as == "executor":
            del written["passes_as"]
        return written


class ModelInfo(_Strict):
    name: str
    options: dict[str, int | float | str]  # the size options it was built with (layers, width, dropout, norm, ...)


COUNT_BYTES = 8  # per routed expert, a mixture-of-experts layer's exchange of how many copies it gets: an int64


class PassIssue(_Strict):
    """A layer's pass as its host issues it (planning/host.py `pass_issue`), as a function of the lead it starts
    with (how many ms the GPU's queue is ahead of the host): the GPU waits max(0, `idle_ms` - lead) for the host up
    to the pass's first synchronisation (or its end) and is then max(lead, `idle_ms`) + `slack_ms` ahead (a pass
    that never waits: its GPU time less its issue); where the pass synchronises it waits `after_idle_ms` more, from
    the queue the synchronisation emptied, and ends `after_lead_ms` ahead, whatever the lead. `carried_ms`: the wait
    the layer's own times hold (the queue carried over the model's layers), which a stage's times replace by its own
    pass's (`stage_host_waits_ms`)."""

    idle_ms: float = Field(ge=0)
    slack_ms: float
    synchronises: bool = False
    after_idle_ms: float = Field(0.0, ge=0)
    after_lead_ms: float = Field(0.0, ge=0)
    carried_ms: float = Field(0.0, ge=0)


class LayerProfile(_Strict):
    """One layer for one micro-batch. `bwd` is the full backward; `igrad` then `wgrad` split it as a
    zero-bubble schedule does (autograd.grad on the input, then on the weights; their sum can exceed
    `bwd`, as the weight pass walks the graph again). `fwd` pools the forwards before both kinds of
    backward. `inputs`: the layers it reads (-1: the batch)."""

    name: str
    inputs: list[int]
    fwd: Timing
    bwd: Timing
    igrad: Timing
    wgrad: Timing
    activation_bytes: int = Field(ge=0)  # saved for backward (saved_tensors_hooks), weights excluded
    # What a weight pass deferred after the input pass keeps: of `activation_bytes` (None: not known), and gradients
    # beside them. An estimate's its products' saved inputs and output gradients (planning/estimate.py `wgrad_kept`);
    # a calibration's what the executor's I leaves for its W as the last layer of its stage: every saved tensor below
    # its topmost weight's node, and the gradients arriving at those nodes (calibrate/measure.py `measure_wgrad_held`)
    wgrad_kept_bytes: int | None = Field(None, ge=0)
    wgrad_gradient_bytes: int = Field(0, ge=0)
    # What it keeps where a later layer of its stage reads it (`wgrad_held_ranges`; None: `wgrad_kept_bytes`, as an
    # estimate's products' inputs wherever the layer lies). A calibration's all it saved: the later layer's nodes,
    # which the executor's I keeps for its W, hold the graph below them whole
    wgrad_kept_below_bytes: int | None = Field(None, ge=0)
    shared_with_previous_bytes: int = Field(ge=0)  # of those, saved by the previous layer as well
    output_bytes: int = Field(ge=0)
    param_bytes: int = Field(ge=0)
    grad_bytes: int = Field(ge=0)
    optimizer_state_bytes: dict[str, int]  # per optimizer, as measured after a step
    # Per input, the bytes of its storage the layer saves for backward (0: none); whether it saves its own
    # output (a ReLU does). None: a profile from before they were recorded.
    saved_input_bytes: list[int] | None = None
    output_saved: bool | None = None
    # Of `activation_bytes`, the bytes by what saves them (an estimate's: attention, mlp, norms, dropout, other);
    # None: not attributed (a calibration measures them whole).
    activation_parts: dict[str, int] | None = None
    # Float8 casts of the weights a float8 recipe keeps between optimizer steps (an estimate's under
    # TransformerEngine: the cast and its transpose), beside `param_bytes`, whole on every data-parallel rank
    float8_weight_bytes: int = Field(0, ge=0)
    # The weights as ZeRO-3's all-gather moves them and holds them whole, per rank (an estimate's under FSDP2's float8
    # all-gather: the float8 linears' at 1 byte an element and a float32 scale each, the rest as `param_bytes`);
    # None: `param_bytes`
    all_gather_bytes: int | None = Field(None, ge=0)
    # The last layer's: the model's output its loss reads (the logits), per rank (an estimate's; 0: none or not
    # known), which torch's pipelining keeps from the forward until the step ends (sim/costs.py `held_as_runtime`)
    model_output_bytes: int = Field(0, ge=0)
    # What the runtime keeps allocated for the whole run for the layer, per rank (an estimate's under
    # `--scores-buffer`: Megatron-LM's global memory buffer as its attention asks for it; 0: none), one buffer a
    # process, the largest asked for (sim/costs.py `StageCosts.runtime_buffer_bytes`)
    runtime_buffer_bytes: int = Field(0, ge=0)
    # Per pass (`PASSES`), the bytes of the tensors it creates and frees within itself at its peak, above its
    # inputs and what outlives it (an estimate's, from the count; a GPU calibration's, from the caching allocator,
    # calibrate/measure.py `measure_transients`; {}: none known, a CPU calibration's or one from before)
    transient_bytes: dict[str, int] = Field(default_factory=dict)
    # The link time of the key/value exchanges around the layer's context-parallel ring (an estimate's,
    # planning/estimate.py `ContextRing`) during its forward and during its backward, which the stage's RING_F and
    # RING_B rows run; how much of it the attention blocks cover; per pass (`PASSES`), the ring's buffers it holds
    ring_fwd_ms: float = Field(0.0, ge=0)
    ring_bwd_ms: float = Field(0.0, ge=0)
    ring_fwd_hidden_ms: float = Field(0.0, ge=0)
    ring_bwd_hidden_ms: float = Field(0.0, ge=0)
    ring_buffer_bytes: dict[str, int] = Field(default_factory=dict)
    # No pipeline stage may start at it: it reads what the layer before it left beside its output (a sparse attention
    # reusing the top k an earlier layer's indexer kept), which no stage boundary passes on (profiles/partition.py
    # `starts_refusal`)
    follows_previous: bool = False
    # The earlier layer whose weights are all of this one's (`LayerCount.tied_layer`: a tied head's, the
    # embedding's); -1: its own. A stage holding both holds them once (profiles/partition.py `tied_pairs`)
    tied_layer: int = Field(-1, ge=-1)
    # The network time of the layer's routed experts' all-to-alls over their expert-parallel group (an estimate's,
    # planning/experts.py) after its forward and after its backward, which the stage's A2A_F and A2A_B rows run
    all_to_all_fwd_ms: float = Field(0.0, ge=0)
    all_to_all_bwd_ms: float = Field(0.0, ge=0)
    # Of those, the time Megatron-core's overlapped pair leaves exposed, its forward beside a backward of the same
    # layer node by node (planning/experts.py `paired_exposed_ms`), and whether it was priced so (False: none
    # known, each pass hidden whole; an exposure of 0 may be priced, its compute's slowing held in it)
    all_to_all_paired_ms: float = Field(0.0, ge=0)
    all_to_all_paired_by_node: bool = False
    # The layer's forward and backward on the multiprocessors a dispatcher's kernels leave them while its
    # all-to-alls run beside them (planning/estimate.py `sharing_dispatcher`); 0: none holds any
    fwd_sharing_ms: float = Field(0.0, ge=0)
    bwd_sharing_ms: float = Field(0.0, ge=0)
    # By pass (its four, and fwd_sharing and bwd_sharing: its forward and backward beside a dispatcher's
    # all-to-alls), its issue (None: measured, or estimated before it was recorded)
    host_issue: dict[str, PassIssue] | None = None
    # How long one of its forward and backward products runs where they run persistent CTAs, their times' mean
    # weighted by their times (an estimate's, planning/estimate.py `persistent_product_ms`); 0: none or not known
    product_ms: float = Field(0.0, ge=0)
    # Of `param_bytes`, the routed experts' weights: under expert parallelism only the replicas that hold the same
    # experts reduce their gradients
    expert_param_bytes: int = Field(0, ge=0)
    # A calibration's mixture-of-experts layer (workload/moe.py), for its all-to-alls priced on the profile's
    # `all_to_all` term: its routed experts (its count exchange sends `COUNT_BYTES` per expert) and the bytes of the
    # token copies a micro-batch's dispatch sends (balanced routing; the combine returns as many); of those, per MoE
    # block its forward runs, in order, its own dispatch's (a decoder layer's one; DeepSeek's multi-token-prediction
    # layer's one a module: each exchanges its counts, dispatches and combines apart, `dispatches_bytes`; []: one)
    routed_experts: int = Field(0, ge=0)
    dispatched_bytes: int = Field(0, ge=0)
    dispatched_block_bytes: list[Annotated[int, Field(gt=0)]] = Field(default_factory=list)

    @model_validator(mode="after")
    def _per_input(self) -> LayerProfile:
        if self.saved_input_bytes is not None and len(self.saved_input_bytes) != len(self.inputs):
            raise ValueError(f"saved_input_bytes has {len(self.saved_input_bytes)} entries for "
                             f"{len(self.inputs)} inputs")
        _check_parts(self.activation_parts, self.activation_bytes)
        if self.dispatched_block_bytes and sum(self.dispatched_block_bytes) != self.dispatched_bytes:
            raise ValueError(f"dispatched_block_bytes sum to {sum(self.dispatched_block_bytes)}, not dispatched_bytes "
                             f"{self.dispatched_bytes}")
        return self

    @property
    def dispatches_bytes(self) -> list[int]:
        """The bytes of each dispatch a micro-batch's forward sends, one a MoE block (`dispatched_block_bytes`; a
        profile from before they were recorded: one of `dispatched_bytes`); [] where it routes none."""
        return self.dispatched_block_bytes or ([self.dispatched_bytes] if self.dispatched_bytes else [])

    @property
    def wgrad_fraction(self) -> float:
        total = self.igrad.median_ms + self.wgrad.median_ms
        return self.wgrad.median_ms / total if total > 0 else 0.0

    @property
    def gathered_weight_bytes(self) -> int:
        """The weights as ZeRO-3 all-gathers them (`all_gather_bytes`, else `param_bytes`)."""
        return self.param_bytes if self.all_gather_bytes is None else self.all_gather_bytes


def _check_parts(parts: dict[str, int] | None, total: int) -> None:
    """Activation parts, where given, are `SAVED_PARTS` of whole bytes that sum to the activations."""
    if parts is None:
        return
    if set(parts) != set(SAVED_PARTS) or any(not isinstance(v, int) or v < 0 for v in parts.values()):
        raise ValueError(f"activation_parts must give whole bytes >= 0 for each of {', '.join(SAVED_PARTS)}")
    if sum(parts.values()) != total:
        raise ValueError(f"activation_parts sum to {sum(parts.values())}, not activation_bytes {total}")


class StepTimes(_Strict):
    """An optimizer's update of one stage, and its weight prediction (PipeOptim / XPipe): SGD W - s*lr*g,
    momentum W - s*lr*v, Adam(W) W - s*lr*m_hat/(sqrt(v_hat)+eps) (AdamW adds its decay)."""

    step: Timing
    predict: Timing


class PassTimes(_Strict):
    """A stage's rows timed one way: forward (`fwd`), full backward (`bwd`), and the split backward's input half
    (`igrad`) then weight half (`wgrad`)."""

    fwd: Timing
    bwd: Timing
    igrad: Timing
    wgrad: Timing


class StagePasses(PassTimes):
    """A stage's rows timed as the executor computes them (calibrate/passes.py): the stage as one module
    through functional_call under the executor's saved-tensor hooks (or, where `Environment.passes_as` says torch,
    as torch.distributed.pipelining's stage computes them: `TorchStageRun`). They exceed the sums of the
    layers timed alone by the per-layer cost of the executor's calls and by the caches a stage's several
    layers no longer fit.

    On a GPU each is timed two ways. Queued behind the pass before (its host issuing while the GPU still runs
    that one), as a run with a GPU per rank issues its rows; and `idle`: each from an idle GPU, as a run whose
    ranks share GPUs issues every row (the host-staged transport: the executor holds the GPU until a row's
    kernels finish, executor/runtime.py), so a host that issues a pass slower than its kernels run shows in it
    (the 2-rank H200 check, traces/measured/gpu-check-h200-day9-masters check.json: stage 1's W 3.77 ms queued,
    6.00 idle; I 4.16 and 5.15). A CPU runs ops as they are issued: one path, timed once (`idle` None). So is a
    profile from before both were kept, whose passes are as its calibration timed them for every placement
    (queued; from an idle GPU where it had fewer GPUs than stages, from 6521538 on). `issued` picks."""

    idle: PassTimes | None = None

    @model_serializer(mode="wrap")
    def _written(self, write: SerializerFunctionWrapHandler) -> dict[str, Any]:
        """Without `idle` where there is none (a CPU's passes): such a profile is written as before both were kept."""
        written = write(self)
        if self.idle is None:
            del written["idle"]
        return written

    def issued(self, shared_gpu: bool) -> StagePasses:
        """The passes as a run issues its rows: from an idle GPU where its ranks share GPUs (`shared_gpu`), else
        queued; the one timing a profile holds where it holds one."""
        return StagePasses(**dict(self.idle)) if shared_gpu and self.idle is not None else self


class StageProfile(_Strict):
    """Layers [first, stop) as one pipeline stage, per micro-batch; `average` is elastic averaging of one
    replica with the reference weights (AvgPipe's AVG costs P of them); `accumulate` adding one micro-batch's
    weight gradients into the mini-batch's buffer, which the executor's B (or W) does for every micro-batch
    but the first (None: a version 1 profile, not measured); `weight_copy` copying the stage's weights, which an
    update does first where later rows still read the version it supersedes (copy-on-write; None: not
    measured); `memory_bytes` the 1F1B estimate of `partition.py` for the partition's optimizer."""

    layers: tuple[int, int]
    fwd_ms: float = Field(ge=0)
    bwd_ms: float = Field(ge=0)
    igrad_ms: float = Field(ge=0)
    wgrad_ms: float = Field(ge=0)
    activation_bytes: int = Field(ge=0)
    wgrad_kept_bytes: int | None = Field(None, ge=0)  # of its layers' (`LayerProfile.wgrad_kept_bytes`; None
    wgrad_gradient_bytes: int = Field(0, ge=0)  # where one is not known), as the next (`wgrad_held_ranges`)
    output_bytes: int = Field(ge=0)  # sent to the next stage(s) per micro-batch
    param_bytes: int = Field(ge=0)
    grad_bytes: int = Field(ge=0)
    optimizer_state_bytes: dict[str, int]
    steps: dict[str, StepTimes]
    average: Timing
    memory_bytes: int = Field(ge=0)
    accumulate: Timing | None = None
    passes: StagePasses | None = None  # None: a profile from before they were measured
    weight_copy: Timing | None = None
    held_bytes: int | None = Field(None, ge=0)  # boundary tensors autograd does not save (`boundary_held_bytes`)
    activation_parts: dict[str, int] | None = None  # as its layers' (`LayerProfile.activation_parts`)
    float8_weight_bytes: int = Field(0, ge=0)  # as its layers' (`LayerProfile.float8_weight_bytes`)
    all_gather_bytes: int | None = Field(None, ge=0)  # as its layers' (`LayerProfile.all_gather_bytes`)
    gather_cast_ms: float = Field(0.0, ge=0)  # before each all-gather of its weights (FSDP2's float8 casts)
    model_output_bytes: int = Field(0, ge=0)  # as its layers' (`LayerProfile.model_output_bytes`)
    runtime_buffer_bytes: int = Field(0, ge=0)  # its layers' largest (`LayerProfile.runtime_buffer_bytes`)
    transient_bytes: dict[str, int] = Field(default_factory=dict)  # its passes' (`stage_transient_bytes`)
    all_to_all_fwd_ms: float = Field(0.0, ge=0)  # its layers' summed (`LayerProfile.all_to_all_fwd_ms`)
    all_to_all_bwd_ms: float = Field(0.0, ge=0)
    all_to_all_paired_ms: float = Field(0.0, ge=0)  # its layers' summed (`LayerProfile.all_to_all_paired_ms`)
    all_to_all_paired_by_node: bool = False  # whether any of its layers' was (`LayerProfile.all_to_all_paired_by_node`)
    fwd_sharing_ms: float = Field(0.0, ge=0)  # its layers' summed (`LayerProfile.fwd_sharing_ms`), as the next
    bwd_sharing_ms: float = Field(0.0, ge=0)
    expert_param_bytes: int = Field(0, ge=0)  # its layers' summed (`LayerProfile.expert_param_bytes`)
    ring_fwd_ms: float = Field(0.0, ge=0)  # its layers' summed (`LayerProfile.ring_fwd_ms`), as the next three
    ring_bwd_ms: float = Field(0.0, ge=0)
    ring_fwd_hidden_ms: float = Field(0.0, ge=0)
    ring_bwd_hidden_ms: float = Field(0.0, ge=0)
    ring_buffer_bytes: dict[str, int] = Field(default_factory=dict)  # per pass, its layers' largest (one at a time)
    product_ms: float = Field(0.0, ge=0)  # its layers' (`LayerProfile.product_ms`), as `product_mean_ms` weighs them

    @model_validator(mode="after")
    def _parts(self) -> StageProfile:
        _check_parts(self.activation_parts, self.activation_bytes)
        return self

    @property
    def wgrad_fraction(self) -> float:
        total = self.igrad_ms + self.wgrad_ms
        return self.wgrad_ms / total if total > 0 else 0.0


class Partition(_Strict):
    """Stage k holds layers bounds[k] .. bounds[k+1]-1; planned for `optimizer`'s state under the cap."""

    bounds: list[int]
    optimizer: Literal["sgd", "momentum", "adam", "adamw"]

    @property
    def stages(self) -> int:
        return len(self.bounds) - 1


class LinkSegmentModel(_Strict):
    min_bytes: int = Field(ge=0)
    latency_ms: float = Field(ge=0)
    bytes_per_ms: float = Field(gt=0)


class LinkPointModel(_Strict):
    nbytes: int = Field(gt=0)
    ms: float = Field(ge=0)
    spread_ms: float = Field(ge=0)


class LinkProfile(_Strict):
    """Point-to-point: the piecewise α–β fit (profiles/linkfit.py; calibrate/links.py measures the points), its
    raw points, and how they were measured. The link, the all-reduce and the runtime probe's terms depend on the
    host, not the model: `meta["host_cache"]` (absent where not cached) says when they were measured
    (`measured_at`, UTC), how old that was at calibration (`age_s`), whether this calibration `reused` them
    from the host cache (calibrate/cache.py), the host's `load` while they were measured (traces/hostload.py;
    None: not recorded) and, where measured by this calibration, why (`measured_because`)."""

    segments: list[LinkSegmentModel] = Field(min_length=1)
    points: list[LinkPointModel]
    meta: dict[str, Any]

    @model_validator(mode="after")
    def _rising(self) -> LinkProfile:
        starts = [segment.min_bytes for segment in self.segments]
        if any(b <= a for a, b in zip(starts, starts[1:])):
            raise ValueError(f"link.segments: min_bytes must rise from one segment to the next (got {starts})")
        return self


class AllToAllProfile(LinkProfile):
    """All-to-all time per size over `world_size` local ranks (calibrate/links.py, the size being each rank's
    buffer, split evenly among them), its points' piecewise α–β fit, and how and under what load they were
    measured (`meta`, as the link's): prices a calibrated mixture of experts' A2A rows for an expert-parallel
    group of that many ranks (planning/scenario.py `measured_all_to_alls`)."""

    world_size: int = Field(ge=2)


class AllReduceProfile(_Strict):
    """All-reduce time per size over `world_size` local ranks, for data-parallel what-ifs: the simulator's
    AvgPipe averages replicas that share a device, so it does not read these times. `beside_compute[k]`: on a CPU
    host, the all-reduce's time while k of its ranks compute beside it over its time alone, never below the one for
    fewer computing (gloo's threads share the cores; calibrate/links.py `measure_allreduce_beside_compute`, which takes
    calibrate/contention.py `slowdowns`' rule; `meta` says at which size, beside what and the times;
    `beside_compute[0]` is 1; None: a GPU, or a profile from before it was measured), which the simulator prices
    on the host's cores with its contention (sim/engine.py `_SharedCores`)."""

    world_size: int = Field(ge=2)
    points: list[LinkPointModel]
    meta: dict[str, Any]
    beside_compute: list[Annotated[float, Field(gt=0)]] | None = None

    @model_validator(mode="after")
    def _alone_first(self) -> AllReduceProfile:
        factors = self.beside_compute
        if factors is not None and (len(factors) != self.world_size + 1 or factors[0] != 1.0):
            raise ValueError(f"beside_compute: one factor per count of computing ranks, 0 to world_size "
                             f"({self.world_size}), the first (none computing) 1.0; got {factors}")
        return self


COMPUTE_KINDS = ("F", "B", "I", "W", "OPT")  # the rows whose fixed cost the runtime probe measures
RECV_WINDOW = 16  # receives pipesim's executor keeps posted ahead of the row it runs, by default


class RuntimeProfile(_Strict):
    """What the executor itself costs per row, beyond the work the row runs (calibrate/runtime.py measures it
    by running the executor on a model of tiny layers over the run's transport and threads):

    - `compute_ms`: per compute kind, a row's time minus its stage's own pass (`StagePasses`; its layers' sum
      in a probe from before passes): drawing the micro-batch, the loss item, the optimizer's bookkeeping
      around its step;
    - `send_ms`: what a SEND row costs its rank: the CPU time posting the message takes its thread (the row's wall
      time also holds the thread descheduled or waiting on a loaded host); `meta["host_times_from"]` says whether
      this and `gap_ms` come from runs of the calibrated model itself, after whose compute they run slower;
    - `recv_ms`: a RECV row whose message had already arrived (the cost of taking it);
    - `delivery_ms`: from a send's post to its message being there, for receives that waited for it (their end
      less `recv_ms`), at the probe's message size `delivery_bytes`: what a pre-posted receive sees in a run,
      where a ping-pong (the link fit) also pays for waking a blocked rank;
    - `gap_ms`: per kind of the row before, the time until the next row starts (the loop's memory and version
      bookkeeping, and posting the next receive after a RECV);
    - `kept_gradients`: copies of a stage's weight gradient an update leaves held (what a device holds before an
      update at a flush over what it held before the run's first, in gradients: calibrate/runtime.py
      `runtime_terms`): a runtime that keeps the last gradient holds a second buffer while the next mini-batch
      accumulates;
    - `recv_window`: receives the executor keeps posted ahead of the row it runs, each holding its buffer from
      its posting (the probe's; a profile from before it was recorded ran with the same default; 0 leaves
      them out, holding a buffer from its message's arrival);
    - `warmup_ms`: what a fresh rank's first rows cost each beyond their steady time (with the host time after
      them), per `warmup_rows` compute rows (step j: after j·`warmup_rows` of them), from the probe's run, whose
      ranks start fresh (none in a profile from before it was measured).
    PRED and AVG are priced as OPT is (the same bookkeeping around an elementwise pass). `meta["host_cache"]`
    as for the link: the probe's terms may be a cached measurement; the gaps and sends, measured on the
    calibrated model, never are."""

    compute_ms: dict[str, Timing]
    send_ms: Timing
    recv_ms: Timing
    delivery_ms: Timing
    delivery_bytes: int = Field(gt=0)
    gap_ms: dict[str, Timing]
    kept_gradients: float = Field(ge=0)
    recv_window: int = Field(RECV_WINDOW, ge=0)
    warmup_ms: list[Annotated[float, Field(ge=0.0)]] = Field(default_factory=list)
    warmup_rows: int = Field(8, ge=1)
    meta: dict[str, Any]

    @model_validator(mode="after")
    def _kinds(self) -> RuntimeProfile:
        if set(self.compute_ms) != set(COMPUTE_KINDS):
            raise ValueError(f"compute_ms must have exactly the keys {', '.join(COMPUTE_KINDS)}")
        return self


class ContentionProfile(_Strict):
    """How much ranks computing at the same time on one CPU host slow each other (shared cores, caches and
    memory bandwidth; oversubscription when ranks x threads exceed the cores). calibrate/contention.py runs
    the calibrated stages' forward and full backward in as many processes as the run has ranks, each first
    alone, then k at once: `slowdown[k - 1]` is the median over the k of a rank's mean iteration time with k
    computing over its mean alone (so `slowdown[0]` is 1), `spread[k - 1]` the interquartile range of that
    ratio over fifths of each window. The simulator shares a host's compute among the ranks computing on it:
    each advances at 1 / slowdown[k - 1] of its own speed. `tail`: a rank's mean iteration alone over its
    median in CPU time (1: a profile from before it was measured; one without `meta.tail_from` took wall time,
    which held the host's load); the stages' passes, timed as medians, are priced at their mean, since an
    iteration adds its ops' times up."""

    slowdown: list[Annotated[float, Field(gt=0)]] = Field(min_length=1)
    spread: list[Annotated[float, Field(ge=0)]]
    tail: float = Field(1.0, gt=0)
    meta: dict[str, Any]  # processes, threads per process, window seconds, the host's cores, the workload

    @model_validator(mode="after")
    def _alone_first(self) -> ContentionProfile:
        if self.slowdown[0] != 1.0:
            raise ValueError(f"slowdown.0: give 1, one rank computing alone (got {float_text(self.slowdown[0])})")
        if len(self.spread) != len(self.slowdown):
            raise ValueError(f"spread: give one entry per slowdown entry, {len(self.slowdown):,} (got "
                             f"{len(self.spread):,})")
        return self

    @property
    def tail_in_wall_time(self) -> bool:
        """Whether `tail` was taken in wall time, as before calibrate/contention.py took it in CPU time (its meta
        says `tail_from` since), holding the calibrating host's load."""
        return "tail_from" not in self.meta


class EstimateLink(_Strict):
    """A link an estimate prices on: its kind (nvlink, infiniband, ...), NCCL's latency per step, and the bytes
    per ms per GPU and direction (hardware/collectives.py prices collectives on it)."""

    kind: str
    latency_ms: float = Field(ge=0)
    bytes_per_ms: float = Field(gt=0)


class EstimatePlacement(_Strict):
    """What the links of every placement follow from (planning/estimate.py's `links_of`): the GPUs of a node,
    the link inside it (at the curve's measured fraction of its datasheet rate) and the network's (at the fraction
    of its line rate NCCL moves through a NIC, `Curve.network_efficiency`; a profile estimated before dfb5e92 holds
    the line rate). Recorded so that a profile read back at another p or d is priced on that placement's links."""

    gpus_per_node: int = Field(ge=1)
    node_link: EstimateLink
    network_link: EstimateLink


ESTIMATE_DEGREES = ("tensor", "pipeline", "data", "context", "expert", "expert_tensor")  # an estimate's ranks


class Estimate(_Strict):
    """A profile estimated, not measured (planning/estimate.py): the catalogue part (`gpu`, its name), the
    parallelism its per-GPU figures hold for (tensor, pipeline, data, context, sequence_parallel, recompute,
    sharded_optimizer), the attention kernel counted, the efficiency curve used (with its `source`), and the
    links of the placement: inside a tensor-parallel group, between stages, the data-parallel group's (with
    context parallelism its C·d ranks), which prices a stage's gradient all-reduce, and the context ring's;
    `placement` what they follow from (None: an estimate from before it was recorded, whose links hold for its own
    p and d only). For MFU: the model's FLOPs per sample without
    recomputation (forward and both halves of the backward, as counted) and the part's dense peak FLOP/s in the
    model's dtype (None: an estimate from before they were recorded)."""

    gpu: str
    parallelism: dict[str, Any]
    attention: str | None  # None: the model computes no attention
    curve: dict[str, Any]
    tensor_link: EstimateLink
    stage_link: EstimateLink
    data_parallel_link: EstimateLink
    context_link: EstimateLink | None = None  # the context-parallel ring's (None: C = 1)
    model_flops_per_sample: float | None = Field(None, gt=0)
    peak_flops_per_s: float | None = Field(None, gt=0)
    placement: EstimatePlacement | None = None

    @model_validator(mode="after")
    def _whole_degrees(self) -> Estimate:
        """The ranks its parallelism gives are whole numbers, 1 or more (a profile edited by hand: the commands
        read them as int, an expert_parallel of 'x' or 0 was a traceback); an expert_tensor of None is t. Refused in
        the command line's words for a number out of range (units.py `number_allowed`)."""
        for name in ESTIMATE_DEGREES:
            value = self.parallelism.get(name, 1)
            if not (value is None and name == "expert_tensor") and (
                    isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(f"parallelism.{name}: {number_allowed(1, None)} (got {json.dumps(value)})")
        return self

    @property
    def degrees(self) -> tuple[int, int, int]:
        """t, p and d as estimated."""
        return tuple(int(self.parallelism.get(name, 1)) for name in ("tensor", "pipeline", "data"))


PASSES = ("fwd", "bwd", "igrad", "wgrad")  # a layer's timed passes (`LayerProfile`)
RING_TIMES = ("ring_fwd_ms", "ring_bwd_ms", "ring_fwd_hidden_ms", "ring_bwd_hidden_ms")  # a stage sums its layers'
SHARING_TIMES = ("fwd_sharing_ms", "bwd_sharing_ms")  # a stage sums its layers'

Pass = Literal["fwd", "bwd", "igrad", "wgrad"]


class FittedCurve(_Strict):
    """The device's efficiency curve, fitted by `pipesim calibrate` to its own measured layers and the same
    model's count (planning/estimate.py's `fit_rates`). Achieved rates, not fractions of a datasheet, so that
    any part's datasheet turns them into its curve (`curve_for`) and one measured device prices other models:
    large matrix products' FLOP/ms (before their tile fill over `multiprocessors` × `tiles`), fused attention
    kernels' (None: the count has none), memory-bound bytes/ms (None: they cost nothing measurable), and what
    each kernel costs beyond its work (`kernel_overhead_measured`: timed on the device, calibrate/kernel.py,
    rather than fitted; `kernel_overhead_on_device`: on the device's clock, False in a CUDA calibration from
    before, whose chain timed its host's issue). `passes`: the layer passes fitted, on the model counted with
    `attention`; `residuals`: per pass the calibration times, each layer's time from the fitted curve over its
    measured time, less 1 (None: a pass the count gives the layer no work for)."""

    matmul_flops_per_ms: float = Field(gt=0)
    attention_flops_per_ms: float | None = Field(None, gt=0)
    memory_bytes_per_ms: float | None = Field(None, gt=0)
    kernel_overhead_ms: float = Field(ge=0)
    kernel_overhead_measured: bool = False
    kernel_overhead_on_device: bool = False
    multiprocessors: int = Field(ge=1)
    tiles: list[tuple[Annotated[int, Field(ge=1)], Annotated[int, Field(ge=1)]]] = Field(min_length=1)
    passes: list[Pass] = Field(min_length=1)
    attention: str | None  # None: the model computes no attention
    residuals: dict[Pass, list[float | None]]

    def error(self, name: str) -> tuple[float, float] | None:
        """Median and worst |residual| of pass `name` over the layers (None: no layer has work in it)."""
        found = [abs(r) for r in self.residuals.get(name, ()) if r is not None]
        return (statistics.median(found), max(found)) if found else None


class Profile(_Strict):
    schema_version: Literal[1, 2]
    environment: Environment
    model: ModelInfo
    layers: list[LayerProfile] = Field(min_length=1)
    partition: Partition
    stages: list[StageProfile]
    link: LinkProfile | None  # None: calibrated with --no-links
    allreduce: AllReduceProfile | None
    runtime: RuntimeProfile | None = None  # None: calibrated with --no-runtime, or a version 1 profile
    contention: ContentionProfile | None = None  # None: --no-contention, a GPU, or a profile from before it
    estimate: Estimate | None = None  # None: measured by `pipesim calibrate`
    fitted_curve: FittedCurve | None = None  # None: an estimate, a profile from before, or a model not counted
    all_to_all: AllToAllProfile | None = None  # None: a model without routed experts, --no-links, or from before

    @model_validator(mode="after")
    def _consistent(self) -> Profile:
        n, bounds = len(self.layers), self.partition.bounds
        if self.fitted_curve is not None and any(len(r) != n for r in self.fitted_curve.residuals.values()):
            raise ValueError(f"fitted_curve.residuals: one entry per layer ({n}) in every pass")
        if len(bounds) < 2 or bounds[0] != 0 or bounds[-1] != n or any(b <= a for a, b in zip(bounds, bounds[1:])):
            raise ValueError(f"partition.bounds must rise strictly from 0 to {n} (the layer count), got {bounds}")
        if [tuple(s.layers) for s in self.stages] != list(zip(bounds, bounds[1:])):
            raise ValueError("stages: one entry per partition stage, with the partition's layer ranges")
        idle = {stage.passes is not None and stage.passes.idle is not None for stage in self.stages}
        if idle == {True, False} or (True in idle and self.environment.device != "cuda"):
            raise ValueError("stages.*.passes.idle: timed on a GPU for every stage or for none (a CPU's passes are one "
                             "timing)")
        for i, layer in enumerate(self.layers):
            if not layer.inputs or any(not -1 <= s < i for s in layer.inputs):
                raise ValueError(f"layers.{i}.inputs must name earlier layers or -1 (the batch), got {layer.inputs}")
            if layer.tied_layer >= i:
                raise ValueError(f"layers.{i}.tied_layer must name an earlier layer or -1 (its own weights), got "
                                 f"{layer.tied_layer}")
        keyed = [(f"layers.{i}.optimizer_state_bytes", layer.optimizer_state_bytes)
                 for i, layer in enumerate(self.layers)]
        keyed += [(f"stages.{k}.{name}", getattr(stage, name)) for k, stage in enumerate(self.stages)
                  for name in ("optimizer_state_bytes", "steps")]
        for where, values in keyed:
            if set(values) != set(OPTIMIZERS):
                raise ValueError(f"{where} must have exactly the keys {', '.join(OPTIMIZERS)}")
        for i, layer in enumerate(self.layers):
            state = layer.optimizer_state_bytes
            if any(held < state[MASTER_ONLY] for held in state.values()):
                raise ValueError(f"layers.{i}.optimizer_state_bytes: {MASTER_ONLY}'s is the master copy of the weights "
                                 f"alone, part of every optimizer's state, so none may be less (got {state})")
        return self

    @property
    def contention_tail(self) -> float:
        """The factor on every pass's median time as priced (`ContentionProfile.tail`: a rank's mean iteration over
        its median); 1 where contention was not measured."""
        return self.contention.tail if self.contention is not None else 1.0

    @property
    def estimated_parallelism(self) -> dict[str, Any]:
        """The parallelism an estimate was made at; {} for a measured profile, each degree then read as 1."""
        return self.estimate.parallelism if self.estimate is not None else {}

    @property
    def estimated_degrees(self) -> tuple[int, int, int]:
        """An estimate's t (GPUs per stage), C (context-parallel ranks a device stands for) and E (ranks its routed
        experts are placed over), which its schedules run with (`Scenario.order_params`); 1 each for a calibration."""
        return tuple(int(self.estimated_parallelism.get(name, 1)) for name in ("tensor", "context", "expert"))

    def master_bytes(self, start: int, stop: int) -> int:
        """The master copy of layers [start, stop)'s weights the optimizer owns (0: none, it updates the weights
        themselves): a calibration's SGD state, since SGD keeps none of its own (calibrate/measure.py
        `_state_bytes` records a 16-bit layer's float32 masters with every optimizer's state; a profile from before
        mixed precision, none). 0 for an estimate, whose state may hold a moving average and be sharded: its precision
        says (planning/scenario.py `held_weights`)."""
        if self.estimate is not None:
            return 0
        return sum(layer.optimizer_state_bytes[MASTER_ONLY] for layer in owners(self.layers, start, stop))

    def describe(self) -> dict:
        """What the profile measured, as a prediction made from it records it: the model and the setting its
        times hold for (micro-batch size, dtype, device, threads, torch), and for an estimate what it was made from."""
        env = self.environment
        return {"model": self.model.name, "options": dict(self.model.options), "microbatch_size": env.microbatch_size,
                "dtype": env.dtype, "device": env.device, "device_name": env.device_name, "threads": env.threads,
                "torch_version": env.torch_version,
                **({"passes_as": env.passes_as} if env.passes_as != "executor" else {}),
                **({"estimate": self.estimate.model_dump(mode="json")} if self.estimate is not None else {}),
                **({"date": env.date, "load": env.load, "ranks": env.ranks, "host_terms": self.host_terms()}
                   if env.load is not None else {}),
                **({"unmeasured": unmeasured} if (unmeasured := self.unmeasured_terms()) else {})}

    def unmeasured_terms(self) -> list[str]:
        """The host terms a calibration skipped (calibrate's --no-links, --no-runtime, --no-contention), whose costs a
        prediction from it leaves out: its transfers at 0 ms, its rows at no runtime cost, ranks computing at once
        as fast as one alone. Contention is a CPU host's (a GPU's ranks do not share cores); none for an estimate."""
        if self.estimate is not None:
            return []
        terms = [("link and all-reduce", self.link), ("runtime probe", self.runtime)]
        if self.environment.device == "cpu":
            terms.append(("contention", self.contention))
        return [name for name, term in terms if term is None]

    def host_terms(self) -> dict[str, dict]:
        """Per term measured on the host rather than the model (the link and all-reduce, the all-reduce beside
        computing ranks, its own host-cache entry on a CPU host, the all-to-all, the runtime probe, contention),
        what its host cache's meta says: when and under what load it was measured, and whether the calibration
        reused it from the host cache."""
        found = {"link and all-reduce": (self.link, "host_cache"),
                 "all-reduce beside compute": (self.allreduce, "beside_compute_host_cache"),
                 "all-to-all": (self.all_to_all, "host_cache"), "runtime probe": (self.runtime, "host_cache"),
                 "contention": (self.contention, "host_cache")}
        return {name: term.meta[key] for name, (term, key) in found.items() if term is not None and key in term.meta}


def _stage_of(bounds: list[int]) -> list[int]:
    return [k for k in range(len(bounds) - 1) for _ in range(bounds[k], bounds[k + 1])]


def stage_edges(layers: list[LayerProfile], bounds: list[int]) -> list[tuple[int, int]]:
    """The stage DAG the layers' edges induce when cut at `bounds` (a chain for a chain model)."""
    stage_of = _stage_of(bounds)
    return sorted({(stage_of[s], stage_of[i]) for i, layer in enumerate(layers) for s in layer.inputs
                   if s >= 0 and stage_of[s] != stage_of[i]})


def boundary_bytes(layers: list[LayerProfile], bounds: list[int], dag: bool) -> list[int]:
    """Bytes each stage sends per micro-batch. `dag`: the stages form the graph of `stage_edges`, so a
    stage sends its own layers' outputs that other stages read. Otherwise they run as a chain, and stage k
    sends on every output a later stage reads (a skip connection over stage k passes through it)."""
    stage_of = _stage_of(bounds)
    last_reader: dict[int, int] = {}  # layer -> the last stage reading its output
    for i, layer in enumerate(layers):
        for s in layer.inputs:
            if s >= 0:
                last_reader[s] = max(last_reader.get(s, 0), stage_of[i])
    sent = [0] * (len(bounds) - 1)
    for s, last in last_reader.items():
        first = stage_of[s]
        for k in ([first] if dag and last > first else range(first, last)):
            sent[k] += layers[s].output_bytes
    return sent


def boundary_held_bytes(layers: list[LayerProfile], bounds: list[int], dag: bool) -> list[int | None]:
    """Per stage, what a runtime holds from a micro-batch's forward until its backward beyond what autograd
    saves: the inputs it receives and the outputs it sends (`boundary_bytes`'s) that no layer of the stage
    saves, since the backward starts from those outputs and ends at those inputs. A tensor passed through a
    chain stage is received, and counted, once; a stage holding no layer (a layout's empty stage) sends on a copy
    of it, which pipesim's runtime keeps as it keeps every stage's sent output (executor/stages.py `StageModule`:
    Megatron-core's TransformerBlock of no layers clones its input). None for every stage where the layers do not
    say (an estimate, priced as Megatron-core runs it), but an empty stage: it holds what it passes on, as
    Megatron-core's schedule keeps each chunk's received input until its backward, and its copy not (its schedule
    frees each sent output's storage, `deallocate_output_tensor`)."""
    empty = set(empty_stages(bounds))
    if any(layer.saved_input_bytes is None or layer.output_saved is None for layer in layers):
        return [passed if k in empty else None for k, passed in enumerate(boundary_bytes(layers, bounds, dag))]
    stage_of = _stage_of(bounds)
    readers: dict[int, dict[int, bool]] = {}  # layer -> {stage reading its output: whether a reader saves it}
    for i, layer in enumerate(layers):
        for s, saved in zip(layer.inputs, layer.saved_input_bytes):
            if s >= 0:
                mine = readers.setdefault(s, {})
                mine[stage_of[i]] = mine.get(stage_of[i], False) or saved > 0
    held = [0] * (len(bounds) - 1)
    for s, stages in readers.items():
        nbytes, first = layers[s].output_bytes, stage_of[s]
        saved_within = stages.pop(first, False)  # by a reader in the producing stage
        if not stages:
            continue  # read inside its own stage only: no boundary tensor
        if not (layers[s].output_saved or saved_within):
            held[first] += nbytes  # sent
        for k in (stages if dag else range(first + 1, max(stages) + 1)):  # a chain passes it through
            if not stages.get(k, False):
                held[k] += nbytes * (2 if k in empty else 1)  # received (and an empty stage's copy)
    return held


def layer_costs(layers: list[LayerProfile], optimizer: str) -> list[LayerCost]:
    """The partitioner's view: forward + backward ms (their all-to-alls with them, and what of their context rings'
    exchanges their attention does not hide), weights + gradients + `optimizer`'s state."""
    return [LayerCost(layer.fwd.median_ms + layer.bwd.median_ms + layer.all_to_all_fwd_ms + layer.all_to_all_bwd_ms
                      + max(layer.ring_fwd_ms - layer.ring_fwd_hidden_ms, 0.0)
                      + max(layer.ring_bwd_ms - layer.ring_bwd_hidden_ms, 0.0),
                      layer_static_bytes(layer, optimizer), layer.activation_bytes, layer.shared_with_previous_bytes,
                      layer.follows_previous, layer.tied_layer)
            for layer in layers]


def layer_static_bytes(layer: LayerProfile, optimizer: str) -> int:
    """What a layer holds throughout a step (`LayerCost.static_bytes`): its weights, their float8 copies, their
    gradients and `optimizer`'s state."""
    return layer.param_bytes + layer.float8_weight_bytes + layer.grad_bytes + layer.optimizer_state_bytes[optimizer]


# a stage's (optimizer steps, averaging, accumulation, copy-on-write copy of its weights)
StageSteps = tuple[dict[str, StepTimes], Timing, Timing | None, Timing | None]


def _summed(layers: list[LayerProfile], start: int, stop: int, fwd_scale: Sequence[float],
            bwd_scale: Sequence[float], p2p_sync: bool = False) -> dict[str, float]:
    """A stage's times as the sums of its layers' (layer i's forward times fwd_scale[i], its backward halves
    times bwd_scale[i]), its host's waits with them (`stage_host_waits_ms`, `p2p_sync` its). A stage fed by the
    batch alone (the first of a chain) has no input gradient to send: its split backward's input half is empty,
    and the weight half does the whole backward, since its first layers' weight gradients need the input
    gradients of the layers after them."""
    def total(kind: str, scale: Sequence[float]) -> float:
        return math.fsum(getattr(layers[i], kind).median_ms * scale[i] for i in range(start, stop)) + \
            stage_host_waits_ms(layers, start, stop, kind, p2p_sync)

    bwd_ms = total("bwd", bwd_scale)
    fed = fed_by_the_batch(layers[start:stop], start)
    return {"fwd_ms": total("fwd", fwd_scale), "bwd_ms": bwd_ms,
            "igrad_ms": 0.0 if fed else total("igrad", bwd_scale),
            "wgrad_ms": bwd_ms if fed else total("wgrad", bwd_scale)}


def fed_by_the_batch(mine: Sequence[LayerProfile], start: int) -> bool:
    """Whether a stage of the layers `mine` from layer `start` reads nothing another stage makes (the first of a
    chain): it has no input gradient to compute, so its split backward's input half runs none of its layers and
    frees nothing, and its weight half runs their whole backward (`_summed`, `stage_passes`, `wgrad_held_ranges`), as
    pipesim's executor runs it (executor/backward.py `backward_input`: no input wants a gradient, W walks the graph)
    and torch's stage (torch/distributed/pipelining/stage.py at torch 2.13, `backward_one_chunk`: `is_first` skips
    stage_backward_input; `backward_weight_one_chunk`: stage 0's W a full backward)."""
    return not any(0 <= source < start for layer in mine for source in layer.inputs)


def fed_ranges(layers: Sequence[LayerProfile]) -> np.ndarray:
    """`fed_by_the_batch` of every range [i, j) of `layers` at once: no layer of it reads a layer before i."""
    n = len(layers)
    earliest = np.array([min((source for source in layer.inputs if source >= 0), default=n) for layer in layers],
                        dtype=np.int64).reshape(n)
    starts = np.arange(n + 1)[:, None]
    read = np.where(np.arange(n)[None, :] >= starts, earliest[None, :], n)  # [i, l]: what layer l >= i reads first
    reached = np.minimum.accumulate(np.hstack([np.full((n + 1, 1), n), read]), axis=1)  # [i, j]: of layers i .. j-1
    return reached >= starts


def wgrad_held_ranges(layers: Sequence[LayerProfile], activations: np.ndarray
                      ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """What a stage of layers i .. j-1 keeps from its input-gradient pass until its weight pass, [i, j] for every
    range at once (`StageProfile.wgrad_kept_bytes`, `wgrad_gradient_bytes`), of its `activations`
    (`activation_ranges`): the saved bytes, the gradients beside them, and whether known (each layer's
    `wgrad_kept_bytes` is). A layer that no later layer of the stage reads (its last, a branch's last) keeps its
    `wgrad_kept_bytes`, one that a later layer reads its `wgrad_kept_below_bytes`; the stage its activations less
    what its layers do not keep, a storage two layers save counted once as there. So an estimate's stage keeps its
    layers' summed; a calibrated one (pipesim's executor) its activations less what its last layer's I frees: the
    later layers' nodes, which that I keeps for W, hold the graph below them. The gradients: its layers' summed. A
    stage fed by the batch alone (`fed_by_the_batch`) keeps all its activations, since its I frees nothing, and no
    output gradients, since it makes none."""
    n = len(layers)
    saved = np.array([layer.activation_bytes for layer in layers], dtype=np.int64).reshape(n, 1)
    kept = np.array([layer.wgrad_kept_bytes or 0 for layer in layers], dtype=np.int64).reshape(n, 1)
    below = np.array([layer.wgrad_kept_bytes or 0 if layer.wgrad_kept_below_bytes is None else
                      layer.wgrad_kept_below_bytes for layer in layers], dtype=np.int64).reshape(n, 1)
    first_reader = np.full(n, n, dtype=np.int64)
    for reader, layer in enumerate(layers):
        for source in layer.inputs:
            if 0 <= source < reader:
                first_reader[source] = min(first_reader[source], reader)
    # [l, j]: what layer l does not keep in a stage ending before layer j, which it tops where none before j reads it
    released = saved - np.where(first_reader[:, None] >= np.arange(n + 1)[None, :], kept, below)
    prefix = np.vstack([np.zeros((1, n + 1), dtype=np.int64), np.cumsum(released, axis=0)])
    fed = fed_ranges(layers)
    return (np.where(fed, activations, activations - (np.diagonal(prefix)[None, :] - prefix)),
            np.where(fed, 0, range_sums(layer.wgrad_gradient_bytes for layer in layers)),
            fed | (range_sums(layer.wgrad_kept_bytes is None for layer in layers) == 0))


def stage_host_waits_ms(layers: list[LayerProfile], start: int, stop: int, name: str, p2p_sync: bool = False) -> float:
    """What a stage's pass `name` (a key of `LayerProfile.host_issue`) waits for its host beyond the waits its
    layers' times hold (`PassIssue`; planning/host.py says why): each stage is a process of its own, whose host
    waits for the GPU only where one of its own layers synchronises, and then starts each pass with its host not
    ahead, each layer from the queue the one before it left (the backward's last layer first). A pass that nothing
    synchronises runs in no less than its layers' issue: it waits for the host as long as their issue outlasts their
    GPU time. `p2p_sync`: its runtime synchronises the device after each exchange with another stage
    (Megatron-core's batched point-to-point, `_communicate` under batch_p2p_comm and batch_p2p_sync;
    docs/hardware.md, "Host-bound execution"), so a pass whose input it receives (a forward but the first stage's,
    a backward but the last's) starts so too, whether or not its layers synchronise."""
    forward = name.startswith("fwd")
    received = p2p_sync and (start > 0 if forward else stop < len(layers))
    mine = layers[start:stop]
    if not mine:
        return 0.0  # an empty stage: its clone of the input (Megatron-core's) is all it runs
    issues = [layer.host_issue for layer in mine]
    if issues and not received and all(issue is not None and not issue["fwd"].synchronises for issue in issues):
        passes = [issue[name] for issue in issues]  # nothing synchronises: no layer's lead is read, in any order
        return _unsynchronised_ms([passed.slack_ms for passed in passes], [passed.carried_ms for passed in passes])
    *_, waited = _host_waits_ms(mine if forward else mine[::-1], name, received, every=False)
    return waited


def stage_host_share(layers: list[LayerProfile], start: int, stop: int, p2p_sync: bool = False) -> float:
    """The share of a stage's forward and backward its host's issue of their kernels holds the GPU waiting: the waits
    its layers' times carry and those its own passes add (`stage_host_waits_ms`) over the passes' times; 0 where its
    layers' issue is not known (measured, or an empty stage). Of the whole backward: a zero-bubble schedule's split
    halves (igrad, wgrad) wait by their own issue, which this does not part."""
    mine = layers[start:stop]
    if not mine or any(layer.host_issue is None for layer in mine):
        return 0.0
    passes = ("fwd", "bwd")
    carried = math.fsum(layer.host_issue[name].carried_ms for layer in mine for name in passes)
    own = math.fsum(stage_host_waits_ms(layers, start, stop, name, p2p_sync) for name in passes)
    total = math.fsum(getattr(layer, name).median_ms for layer in mine for name in passes) + own
    return (carried + own) / total if total > 0 else 0.0


def _unsynchronised_ms(slack: Sequence[float], carried: Sequence[float]) -> float:
    """What a pass that nothing synchronises waits for its host beyond the waits its layers' times carry: its
    issue's excess over its GPU time, of its layers' `slack` and `carried` waits (`_host_waits_ms`)."""
    return max(0.0, -math.fsum(slack)) - math.fsum(carried)


def _host_waits_ms(layers: Sequence[LayerProfile], name: str, received: bool, every: bool = True) -> Iterator[float]:
    """`stage_host_waits_ms` of the stages whose pass `name` runs the first 1, 2, ... of `layers` (given in the order
    the pass runs them), one after another: the pass's queue is followed layer by layer, so one sweep gives every
    stage that starts (a forward) or ends (a backward) at one layer. `received`: the pass starts with its host not
    ahead, as one whose input a synchronising exchange brings does. Not `every`: the stage of all `layers` alone
    (the sums over the shorter ones, a stage's cost squared in its layers, left out)."""
    carried, slack, waited = [], [], []
    lead, synchronised, measured = 0.0, received, False
    last = len(layers) - 1
    for i, layer in enumerate(layers):
        issue = layer.host_issue
        measured = measured or issue is None
        if not measured:
            passed = issue[name]
            carried.append(passed.carried_ms)
            slack.append(passed.slack_ms)
            waited.append(max(0.0, passed.idle_ms - lead) + passed.after_idle_ms)
            lead = passed.after_lead_ms if passed.synchronises else max(lead, passed.idle_ms) + passed.slack_ms
            synchronised = synchronised or issue["fwd"].synchronises
        if every or i == last:
            yield 0.0 if measured else (math.fsum(waited) - math.fsum(carried) if synchronised else
                                        _unsynchronised_ms(slack, carried))


def stage_waits_ms(layers: list[LayerProfile], name: str, p2p_sync: bool = False) -> np.ndarray:
    """[i, j]: `stage_host_waits_ms` of a stage of layers i .. j-1 for every range at once (0 where j <= i), each
    to the bit. A range whose pass nothing synchronises waits its issue's excess over its GPU time, less its
    carried waits: their sums over every range at once, each rounded once as math.fsum rounds it
    (`exact_range_sums`); the rest, a sweep of `_host_waits_ms` from each first layer (a forward) or last (a
    backward) whose ranges synchronise. Kept by what it reads (each layer's issue of the pass and whether its
    forward synchronises), each caller given its own copy: tune splits many profiles whose layers are alike (a
    Qwen3-30B-A3B tune on 64 GPUs asks 2,600 tables, 627 of them distinct), and the sweeps were its most costly
    Python."""
    key = (name, p2p_sync, tuple(None if layer.host_issue is None else
                                 (layer.host_issue[name], layer.host_issue["fwd"].synchronises) for layer in layers))
    if key not in _STAGE_WAITS_MS:
        if sum(table.nbytes for table in _STAGE_WAITS_MS.values()) >= _STAGE_WAITS_KEPT_BYTES:
            _STAGE_WAITS_MS.clear()
        _STAGE_WAITS_MS[key] = _stage_waits_table(layers, name, p2p_sync)
    return _STAGE_WAITS_MS[key].copy()


_STAGE_WAITS_MS: dict[tuple, np.ndarray] = {}  # `stage_waits_ms` by what it reads
_STAGE_WAITS_KEPT_BYTES = 64 * MIB  # the tables kept at most, all dropped when full


def _stage_waits_table(layers: list[LayerProfile], name: str, p2p_sync: bool) -> np.ndarray:
    """`stage_waits_ms`, computed."""
    n = len(layers)
    issues = [layer.host_issue for layer in layers]
    table = np.zeros((n + 1, n + 1))
    if all(issue is None for issue in issues):
        return table
    forward = name.startswith("fwd")
    if all(issue is not None for issue in issues):
        slack = exact_range_sums(issue[name].slack_ms for issue in issues)
        carried = exact_range_sums(issue[name].carried_ms for issue in issues)
        above = np.triu(np.ones((n + 1, n + 1), dtype=bool), k=1)
        np.subtract(np.maximum(0.0, -slack, where=above, out=np.zeros_like(table)), carried, where=above, out=table)
        synchronising = [i for i, issue in enumerate(issues) if issue["fwd"].synchronises]
    else:  # a range holding a layer without its issue waits nothing beyond its times: swept
        synchronising = list(range(n))
    if forward:
        last = max(synchronising, default=-1)
        for start in range(n if p2p_sync else last + 1):
            table[start, start + 1:] = list(_host_waits_ms(layers[start:], name, p2p_sync and start > 0))
    else:
        first = min(synchronising, default=n)
        for stop in range(1 if p2p_sync else first + 1, n + 1):
            table[stop - 1::-1, stop] = list(_host_waits_ms(layers[stop - 1::-1], name, p2p_sync and stop < n))
    return table


def stage_time(layers: list[LayerProfile], p2p_sync: bool = False) -> StageCosts:
    """The partitioner's stage time (`partition`'s `stage_time`): every range's forward + backward as `layer_costs`
    sums them, and what its stage's forward and backward wait for their host beyond (`stage_waits_ms`), so that a
    cut balances what each stage takes where its kernels' issue, not its GPU time, sets its passes' pace (planning/
    host.py), and where they never wait, the layers' times alone, to the bit."""
    return with_range_ms(layer_costs(layers, "sgd"),
                         stage_waits_ms(layers, "fwd", p2p_sync) + stage_waits_ms(layers, "bwd", p2p_sync))


def profile_stage_time(profile: Profile) -> StageCosts:
    """`stage_time` of the profile's layers, as its stages run them (`p2p_synced`)."""
    return stage_time(profile.layers, p2p_synced(profile))


def p2p_synced(profile: Profile) -> bool:
    """Whether the profile's runtime synchronises after each exchange between stages (an estimate's --p2p-sync)."""
    return bool(profile.estimated_parallelism.get("p2p_sync"))


def fused_accumulation(profile: Profile) -> bool:
    """Whether the profile's runtime accumulates its weight gradients fused (an estimate's --grad-accumulation
    fused): the pass over the weights no product accumulates is in every backward, not after each but the first
    (planning/scenario.py `_stage_costs`)."""
    return profile.estimated_parallelism.get("grad_accumulation") == "fused"


def aggregate_stages(layers: list[LayerProfile], bounds: list[int], optimizer: str, output_bytes: list[int],
                     steps: list[StageSteps], passes: list[StagePasses] | None = None,
                     held_bytes: list[int | None] | None = None,
                     costs: list[LayerCost] | None = None, p2p_sync: bool = False) -> list[StageProfile]:
    """Per-stage sums of the layers' measurements; `steps` gives each stage's measured (optimizer steps,
    averaging, gradient accumulation, weight copy), `passes` (where measured) its rows timed as the executor
    runs them, which are then its times. `memory_bytes` is the partitioner's 1F1B estimate for `optimizer`, of
    the layers' `layer_costs` (`costs`, where the caller has them already). `p2p_sync`: the runtime synchronises
    after each exchange between stages (`stage_host_waits_ms`)."""
    costs = layer_costs(layers, optimizer) if costs is None else costs
    p = len(bounds) - 1
    ones = [1.0] * len(layers)
    out = []
    kept, gradients, known = wgrad_held_ranges(layers, activation_ranges(costs))
    for k, (start, stop) in enumerate(zip(bounds, bounds[1:])):
        mine, own = layers[start:stop], owners(layers, start, stop)  # (`own`: a tied layer's weights once)
        activation_bytes = stage_activation_bytes(costs, start, stop)
        times = (_summed(layers, start, stop, ones, ones, p2p_sync) if passes is None else
                 {f"{kind}_ms": getattr(passes[k], kind).median_ms for kind in ("fwd", "bwd", "igrad", "wgrad")})
        out.append(StageProfile(
            layers=(start, stop),
            **times,
            activation_bytes=activation_bytes,
            wgrad_kept_bytes=int(kept[start, stop]) if known[start, stop] else None,
            wgrad_gradient_bytes=int(gradients[start, stop]),
            output_bytes=output_bytes[k],
            param_bytes=sum(layer.param_bytes for layer in own),
            grad_bytes=sum(layer.grad_bytes for layer in own),
            optimizer_state_bytes={name: sum(layer.optimizer_state_bytes[name] for layer in own)
                                   for name in OPTIMIZERS},
            float8_weight_bytes=sum(layer.float8_weight_bytes for layer in own),
            all_gather_bytes=(None if all(layer.all_gather_bytes is None for layer in own) else
                              sum(layer.gathered_weight_bytes for layer in own)),
            model_output_bytes=sum(layer.model_output_bytes for layer in mine),
            runtime_buffer_bytes=max((layer.runtime_buffer_bytes for layer in mine), default=0),
            transient_bytes=stage_transient_bytes(layers, start, stop),
            all_to_all_fwd_ms=math.fsum(layer.all_to_all_fwd_ms for layer in mine),
            all_to_all_bwd_ms=math.fsum(layer.all_to_all_bwd_ms for layer in mine),
            all_to_all_paired_ms=math.fsum(layer.all_to_all_paired_ms for layer in mine),
            all_to_all_paired_by_node=any(layer.all_to_all_paired_by_node for layer in mine),
            **{name: math.fsum(getattr(layer, name) for layer in mine)
               + stage_host_waits_ms(layers, start, stop, name.removesuffix("_ms"), p2p_sync)
               for name in SHARING_TIMES},
            expert_param_bytes=sum(layer.expert_param_bytes for layer in mine),
            **{name: math.fsum(getattr(layer, name) for layer in mine) for name in RING_TIMES},
            ring_buffer_bytes=stage_ring_buffer_bytes(layers, start, stop),
            product_ms=product_mean_ms((layer.product_ms, layer.fwd.median_ms + layer.bwd.median_ms) for layer in mine),
            steps=steps[k][0],
            average=steps[k][1],
            memory_bytes=stage_memory_bytes(costs, start, stop, k, p),
            held_bytes=held_bytes[k] if held_bytes is not None else None,
            activation_parts=_stage_parts(mine, activation_bytes),
            accumulate=steps[k][2],
            weight_copy=steps[k][3],
            passes=passes[k] if passes is not None else None,
        ))
    return out


def stage_transient_bytes(layers: list[LayerProfile], start: int, stop: int) -> dict[str, int]:
    """Per pass, the most a stage's pass holds above its activations (which a prediction counts whole from the
    forward's start until the backward frees them) while one of its layers runs: layer i's transient in the pass
    its layers run there, less what the layers after it save where the pass frees as it goes (`stage_passes`)."""
    mine = layers[start:stop]
    after = _saved_after(mine)
    return {name: _running_peak(mine, after, *runs) if runs else 0 for name, runs in stage_passes(mine, start).items()}


def stage_ring_buffer_bytes(layers: list[LayerProfile], start: int, stop: int) -> dict[str, int]:
    """Per pass with a context ring, what its buffers add to the most the stage's layers hold above its activations
    (`stage_transient_bytes`' peak), which a prediction holds beside that peak while the pass runs: a layer's ring
    buffers exist while its attention runs, so they are held beside that layer's own transient (less what the
    layers after it save, as there), not beside another layer's peak, the loss's say, where no ring runs. A pass
    holds the ring of the layers' pass it runs, freeing as that peak does (`stage_passes`): a stage fed by the
    batch alone its backward's in its weight pass, none in its empty input-gradient pass."""
    mine = layers[start:stop]
    if not any(layer.ring_buffer_bytes for layer in mine):
        return {}
    after = _saved_after(mine)
    return {name: _running_peak(mine, after, *runs, ring=True) - _running_peak(mine, after, *runs)
            for name, runs in stage_passes(mine, start).items()
            if runs and any(runs[0] in layer.ring_buffer_bytes for layer in mine)}


def stage_passes(mine: list[LayerProfile], start: int) -> dict[str, tuple[str, bool] | None]:
    """Per pass of a stage of the layers `mine` from layer `start`, the layers' pass it runs and whether it frees as
    it goes (None: it runs none). The forward and the full backward do (in the forward the layers after one have
    not saved yet, in the backward, which runs them first, they have freed already); a split backward keeps its
    graph for the weight pass, so neither half frees anything as it goes. A stage fed by the batch alone runs an
    empty input-gradient pass and its whole backward as the weight pass (`_summed`). The one rule a stage's
    transient and its ring's buffers are held by, and its layers' passes replayed (planning/scenario.py
    `Scenario._reserves`)."""
    if not fed_by_the_batch(mine, start):
        return {"fwd": ("fwd", True), "bwd": ("bwd", True), "igrad": ("igrad", False), "wgrad": ("wgrad", False)}
    return {"fwd": ("fwd", True), "bwd": ("bwd", True), "igrad": None, "wgrad": ("bwd", True)}


def _saved_after(mine: list[LayerProfile]) -> list[int]:
    """Per layer of a stage's `mine`, what the layers after it save."""
    return list(itertools.accumulate((layer.activation_bytes for layer in reversed(mine[1:])), initial=0))[::-1]


def _running_peak(mine: list[LayerProfile], after: list[int], name: str, freeing: bool, ring: bool = False) -> int:
    """The most a stage's pass `name` holds above its activations while one of its layers `mine` runs: the layer's
    transient, with `ring` its ring's buffers too, less what the layers after it save (`after`) where the pass is
    `freeing` (not yet saved in the forward, freed already in the full backward)."""
    return max([0, *(layer.transient_bytes.get(name, 0) + (layer.ring_buffer_bytes.get(name, 0) if ring else 0)
                     - (later if freeing else 0) for layer, later in zip(mine, after))])


def _stage_parts(layers: list[LayerProfile], activation_bytes: int) -> dict[str, int] | None:
    """A stage's activations by part: its layers' summed, where each layer has them and they sum to the stage's
    (layers that share what they save do not say whose part the shared bytes were); else None."""
    if any(layer.activation_parts is None for layer in layers):
        return None
    parts = {part: sum(layer.activation_parts[part] for layer in layers) for part in SAVED_PARTS}
    return parts if sum(parts.values()) == activation_bytes else None


def stages_for(profile: Profile, bounds: list[int], dag: bool = False,
               optimizers: Sequence[str] = OPTIMIZERS, shared_gpu: bool = False) -> list[StageProfile]:
    """The profile's layers as the stages `bounds` cuts, linked as a chain or (`dag`) by `stage_edges`.

    The optimizer, prediction, averaging, accumulation and copy steps were timed on the calibrated partition's
    stages only; for another partition they are those stages' total times shared out by parameter bytes (the
    steps are elementwise passes over the weights, so their time follows the bytes), `optimizers`' steps alone
    (a caller pricing one optimizer's steps needs no other's: sharing them out is most of a stage's cost). So
    were the stages' rows as one pass (`StagePasses`): another cut's stage takes its layers' times, each scaled
    by the ratio of the pass to the layers' sum in the calibrated stage holding the layer. The passes are as a run
    whose ranks share GPUs issues them where `shared_gpu`, else as one with a GPU per rank (`StagePasses.issued`)."""
    if bounds == profile.partition.bounds:
        steps = [(stage.steps, stage.average, stage.accumulate, stage.weight_copy) for stage in profile.stages]
    else:
        steps = _shared_steps(profile, step_shares(profile, bounds), optimizers)
    return aggregate_stages(profile.layers, bounds, profile.partition.optimizer,
                            boundary_bytes(profile.layers, bounds, dag), steps,
                            _passes_for(profile, bounds, shared_gpu),
                            boundary_held_bytes(profile.layers, bounds, dag),
                            p2p_sync=p2p_synced(profile))


def _passes_for(profile: Profile, bounds: list[int], shared_gpu: bool) -> list[StagePasses] | None:
    """The stages' passes at `bounds` as issued (`shared_gpu`: `StagePasses.issued`): the measured ones on the
    calibrated cut, scaled layer sums on another (None where the profile measured none)."""
    if any(stage.passes is None for stage in profile.stages):
        return None
    measured = [stage.passes.issued(shared_gpu) for stage in profile.stages]
    if bounds == profile.partition.bounds:
        return measured
    layers, ones = profile.layers, [1.0] * len(profile.layers)
    fwd_scale, bwd_scale = [], []
    for (start, stop), found in zip(itertools.pairwise(profile.partition.bounds), measured):
        summed = _summed(layers, start, stop, ones, ones)
        fwd_scale += [_ratio(found.fwd.median_ms, summed["fwd_ms"])] * (stop - start)
        bwd_scale += [_ratio(found.bwd.median_ms, summed["bwd_ms"])] * (stop - start)
    repeats = measured[0].fwd.repeats

    def timing(ms: float) -> Timing:
        return Timing(median_ms=ms, spread_ms=0.0, repeats=repeats)

    return [StagePasses(**{kind[:-3]: timing(ms) for kind, ms in
                           _summed(layers, start, stop, fwd_scale, bwd_scale).items()})
            for start, stop in itertools.pairwise(bounds)]


def _ratio(measured_ms: float, summed_ms: float) -> float:
    return measured_ms / summed_ms if summed_ms > 0 else 1.0


# a step's times summed over the calibrated stages: (median ms, spread ms, repeats), None where a stage measured none
SummedTiming = tuple[float, float, int]
# `optimizers`' (step, prediction) by name, the averaging, the accumulation and the weight copy, each summed
SummedSteps = tuple[dict[str, tuple[SummedTiming, SummedTiming]], SummedTiming, SummedTiming | None,
                    SummedTiming | None]


def step_totals(profile: Profile, optimizers: Sequence[str]) -> SummedSteps:
    """The calibrated stages' step times summed (`optimizers`' steps), which another cut's stages share out by their
    layers' parameter bytes (`stages_for`)."""
    def total(pick: Callable[[StageProfile], Timing]) -> SummedTiming:
        timings = [pick(stage) for stage in profile.stages]
        return math.fsum(t.median_ms for t in timings), math.fsum(t.spread_ms for t in timings), timings[0].repeats

    def measured(pick: Callable[[StageProfile], Timing | None]) -> SummedTiming | None:
        return total(pick) if all(pick(stage) is not None for stage in profile.stages) else None

    steps = {name: (total(lambda s, n=name: s.steps[n].step), total(lambda s, n=name: s.steps[n].predict))
             for name in optimizers}
    return steps, total(lambda s: s.average), measured(lambda s: s.accumulate), measured(lambda s: s.weight_copy)


def step_shares(profile: Profile, bounds: Sequence[int]) -> list[float]:
    """Each stage's share of the step times at `bounds`: its layers' parameter bytes over the calibrated stages'."""
    total_bytes = sum(stage.param_bytes for stage in profile.stages) or 1
    return [sum(layer.param_bytes for layer in owners(profile.layers, start, stop)) / total_bytes
            for start, stop in zip(bounds, bounds[1:])]


def _shared_steps(profile: Profile, shares: Sequence[float], optimizers: Sequence[str]) -> list[StageSteps]:
    """Each of `shares` of the calibrated stages' summed step times (`step_totals`). The sums are taken once and the
    shares' timings built without validating again (each is a valid timing scaled by a share >= 0): a what-if
    search costs thousands of cuts."""
    steps, average, accumulate, copy = step_totals(profile, optimizers)

    def timing(summed: SummedTiming | None, share: float) -> Timing | None:
        return None if summed is None else Timing.model_construct(
            median_ms=summed[0] * share, spread_ms=summed[1] * share, repeats=summed[2])

    return [({name: StepTimes.model_construct(step=timing(step, share), predict=timing(predict, share))
              for name, (step, predict) in steps.items()},
             timing(average, share), timing(accumulate, share), timing(copy, share)) for share in shares]


def load_profile(path: str | Path) -> Profile:
    """Read and check a profile; ProfileError names the file and the first field that is wrong."""
    raw = read_document(path, PROFILE, ProfileError)  # another kind is named, not by the schema_version it lacks
    if isinstance(raw, dict) and "model_type" in raw and "schema_version" not in raw:  # transformers' config.json
        raise ProfileError(f"profile {path}: a Hugging Face model config (model_type {raw['model_type']!r}), not a "
                           f"profile: give it as --model hf:{path} (with --gpu NAME to estimate its costs)")
    if not isinstance(raw, dict) or "schema_version" not in raw:
        raise ProfileError(f"profile {path}: schema_version: missing (is this a pipesim calibrate profile?)")
    if raw["schema_version"] not in SUPPORTED_VERSIONS:
        raise ProfileError(f"profile {path}: schema_version {raw['schema_version']!r} is not supported (this "
                           f"pipesim reads versions {', '.join(map(str, SUPPORTED_VERSIONS))}); re-run pipesim "
                           "calibrate")
    profile = validated(Profile, raw, path, PROFILE, ProfileError)
    if (past := past_limits(profile)) is not None:
        raise ProfileError(f"profile {path}: {past}")
    return profile


def past_limits(profile: Profile) -> str | None:
    """Which size or time of the profile the simulator cannot take, or None: a stage's sizes up to MAX_BYTES and
    its times up to MAX_MS (sim/costs.py `StageCosts`), and a stage may hold every layer, so the layers' sums are
    bounded (`layers_past_limits`), and each calibrated stage's own figures. Said here naming the file's field, where
    StageCosts would name its own."""
    return layers_past_limits(profile.layers) or _named_past_limits(
        (f"stages.{i}.", name, "is", value) for i, stage in enumerate(profile.stages)
        for name, value in _numbers(stage.model_dump()))


# The sizes a stage sums over its layers in int64 arrays (`wgrad_held_ranges`, partition.py `activation_ranges`)
SUMMED_BYTES = ("activation_bytes", "shared_with_previous_bytes", "wgrad_kept_bytes", "wgrad_kept_below_bytes",
                "wgrad_gradient_bytes")


def layers_past_limits(layers: Sequence[LayerProfile], names: Sequence[str] | None = None) -> str | None:
    """Which of the layers' sizes or times add up past what a stage may take (`past_limits`), or None; of the fields
    `names` alone where given: an estimate's `SUMMED_BYTES`, checked before its stages sum them in int64 arrays,
    which wrapped around to a negative wgrad_kept_bytes (a traceback) at a micro-batch of 10**12, in microseconds
    for each of tune's candidates, where every number of a layer's took milliseconds."""
    totals: dict[str, float] = {}
    for layer in layers:
        numbers = _numbers(layer.model_dump()) if names is None else (
            (name, getattr(layer, name)) for name in names if getattr(layer, name) is not None)
        for name, value in numbers:
            totals[name] = totals.get(name, 0.0) + value
    return _named_past_limits(("layers' ", name, "add up to", value) for name, value in totals.items())


def _named_past_limits(named: Iterable[tuple[str, str, str, float]]) -> str | None:
    """The first of `named` (where, field, verb, value) past its limit (a time's MAX_MS, a size's MAX_BYTES)."""
    for where, name, verb, value in named:
        most, unit = (MAX_MS, "ms") if name.endswith("_ms") else (MAX_BYTES, "bytes") if "bytes" in name else (0, "")
        if unit and value > most:
            return f"{where}{name} {verb} {value:.3g}, more than the simulator takes (at most {most:.3g} {unit})"
    return None


def _numbers(tree: Any, name: str = "") -> Iterator[tuple[str, float]]:
    """Every number in a dumped model's `tree` with its dotted field name (a list's items under the list's)."""
    if isinstance(tree, dict):
        for key, value in tree.items():
            yield from _numbers(value, f"{name}.{key}" if name else str(key))
    elif isinstance(tree, list):
        for value in tree:
            yield from _numbers(value, name)
    elif isinstance(tree, (int, float)) and not isinstance(tree, bool):
        yield name, tree


def threads_mismatch(profile: Profile, threads_per_rank: int) -> str | None:
    """Why a run with `threads_per_rank` torch threads per rank cannot be predicted from `profile` (its times
    hold for the thread count it was measured with), or None when they agree."""
    measured = profile.environment.threads
    if measured == threads_per_rank:
        return None
    return (f"the profile was calibrated with {count_text(measured, 'thread')} and the run uses "
            f"{threads_per_rank} per rank: its times do not hold for this run; calibrate with --threads "
            f"{threads_per_rank} or run with --threads-per-rank {measured}")


def profile_json(profile: Profile) -> str:
    return profile.model_dump_json(indent=1) + "\n"
