"""An estimated Profile: a model's counted ops (profiles/workload.py) priced on a catalogue GPU, parallelised.

Each op is priced on its own shape: a matrix product at the part's large-product efficiency times how well its
output tiles fill the multiprocessors (tile and wave quantisation: the best of the curve's tiles), never faster
than the bytes it moves allow; a fused attention kernel at the curve's attention efficiency; a memory-bound op
at the achieved memory bandwidth; each kernel plus a fixed overhead. The curve's figures are published
measurements (hardware/gpus.toml names them).

Tensor parallelism t (Megatron's split, priced here, never run): every product keeps its token dimension and
divides its weight's other one by t (batched products, the attention's, divide their batch of heads); a product
split on its contraction (row-parallel forward, column-parallel input gradient) ends in an all-reduce of its
output on the node's link, or with sequence parallelism a reduce-scatter and an all-gather. Memory-bound ops
on the residual stream (norms, residual adds: tensors of the layer's output size and width) run whole on every
rank unless sequence parallelism divides them too. Activation memory follows Korthikanti et al. 2022 (arXiv
2205.05198): of a layer's saved bytes, the s×s attention core and 24/34 of the rest divide by t, 10/34 stay
whole unless sequence parallelism divides them. Recomputation: "selective" drops the core's saved bytes and
reruns its forward in the backward; "full" keeps only the layer's input and reruns its whole forward (in a
layer with attention: Megatron-LM recomputes its transformer layers, not the embedding or the head); "op" is
torchtitan's selective op policy (`_apply_ac_to_transformer_block`, selective_ac_option "op"): in such a layer it
keeps the layer's input, the output of every other matrix product (the 1st, 3rd, ... in forward order) and the
attention kernel's outputs, and reruns the rest (t = 1 only). Float8 (`Parallelism.fp8`): a transformer layer's
linear products at the part's float8 peak with the recipe's casts and saved bytes (planning/fp8.py).

Placement: the ranks numbered as the rank order says (schedules/ranks.py: pipesim's, t inside a node first, then
C, p, d; or Megatron-core's, t, C, d, then p); a stage boundary or a data-parallel group that leaves a node uses
the network (a stage boundary with t > 1: 1/t of the tensor per rank on the network, then, without sequence
parallelism, Megatron-LM's all-gather on the node's link: `_stage_link`). Pure arithmetic on counts: no torch.
"""

from __future__ import annotations

import functools
import math
import platform
from collections.abc import Callable, Mapping, Sequence, Set
from dataclasses import asdict, dataclass, field, replace
from datetime import UTC, datetime
from functools import cache, partial
from typing import TYPE_CHECKING, Any

from ..choices import choose_from
from ..hardware.catalogue import ATTENTION_KERNELS
from ..hardware.collectives import all_gather_ms, all_reduce_ms, reduce_scatter_ms
from ..memory_parts import SAVED_PARTS
from ..profiles.partition import owned_at, partition
from ..profiles.schema import (
    OPTIMIZERS,
    PASSES,
    SUMMED_BYTES,
    Environment,
    Estimate,
    EstimateLink,
    EstimatePlacement,
    FittedCurve,
    LayerProfile,
    LinkProfile,
    LinkSegmentModel,
    ModelInfo,
    Partition,
    PassIssue,
    Profile,
    StepTimes,
    Timing,
    aggregate_stages,
    boundary_bytes,
    layer_costs,
    layers_past_limits,
    optimizer_refusal,
    stage_time,
)
from ..profiles.workload import (
    GRAD_ONLY_KERNELS,
    RECOMPUTE_REGIONS,
    SPARSE_ATTENTION_KERNELS,
    TF32_PRODUCT_KERNELS,
    LayerCount,
    OpCount,
    WorkloadCount,
    layers_text,
    module_regions,
    most_stages,
    transient_peak,
    weighted_products,
)
from ..schedules.ranks import RANK_ORDERS, SettingsError, dense_grid
from ..sim.caching_allocator import LayerAllocations, left_live
from ..sim.costs import HELD_PRODUCT_SLOWDOWN, PRECISIONS, Precision, precision_refusal
from .experts import (
    ALL_TO_ALLS,
    DISPATCHERS,
    EXPERT_GEMMS,
    FLEX_DISPATCHERS,
    ROUTINGS,
    ExpertGroup,
    ExpertParallelError,
    MoePass,
    expert_group,
    held_share,
    paired_exposed_ms,
    per_expert_products,
    weight_shards,
)
from .fp8 import (
    FP8_BYTES,
    FP8_RECIPES,
    FP8_SCALE_BYTES,
    SCALE_PRECOMPUTE_KERNELS,
    SHARD_CAST_KERNELS,
    Float8Forms,
    Fp8Recipe,
    casts_weights_per_use,
    float8_products,
    float8_weight_bytes,
    float8_weights,
    gathered_in_float8,
    gathered_norm_share,
    per_use_recipes,
    saved_weight_bytes,
    step_cast_ops,
)
from .host import (
    HOST_KERNEL_US,
    TE_RECIPES,
    Kernels,
    carried_waits_ms,
    graph_replay,
    issued_ms,
    module_us,
    pass_issue,
    pass_kernels,
    synchronises,
    waits_for_tokens,
)
from .te import LINEAR_KERNELS

if TYPE_CHECKING:
    from ..hardware.catalogue import Cluster, Curve, Gpu

# --host-kernel-us and --host-module-us at most: 10 ms, 300 times the 31.9 us measured (host.py), so that a stage of
# the most kernels a count takes (workload/sizes.py's bounds), times its passes, stays within units.py's `MAX_MS`; at
# 1e15 `estimate` wrote a profile `simulate` refused, and 1e30 was refused as its fwd_ms, naming no flag
MAX_HOST_US = 1e4
RECOMPUTE = ("none", "selective", "full", "op")
SEARCHED_RECOMPUTE = RECOMPUTE[:3]  # what tune tries: Megatron-LM's; op (torchtitan's policy) only when asked for
# The recomputations under which a compiled block's saves are modelled (`_unread_kept`): torch's checkpoint around it,
# as torchtitan wraps each block before compiling it
COMPILED_RECOMPUTE = ("op", "full")
# Where an exponential moving average of the weights is kept (`Parallelism.ema`): "gpu", a float32 copy beside the
# master weights, sharded as they are and updated after each step (reads the new weights, reads and writes the
# average); "cpu", as DeepSeek-V3 kept it (its report, arXiv 2412.19437, 3.2.3: "stored in CPU memory and updated
# asynchronously after each training step [...] without incurring additional memory or time overhead"): nothing
# on the GPUs
EMA_PLACES = ("gpu", "cpu")
EMA_BYTES = 4
PEAK_DTYPE = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}  # torch's dtype names -> the catalogue's
GRADIENT_GROUP = ("cp", "dp")  # the ranks that hold the same weights and reduce their gradients (schedules/ranks.py)
# (how a weight splits, which of its products: `weighted_products`) for the products tensor parallelism splits on
# their contraction, whose partial sums a reduction ends: a row-parallel weight's forward, a column-parallel one's
# input gradient (`_Split.products`)
_CONTRACTED = (("row", "output"), ("column", "input"))
REPLICATED_SHARE = 10 / 34  # Korthikanti et al.: 10·sbh of a block's 34·sbh (s×s terms aside) stay whole under t
# NCCL's per-step latency of its Simple protocol by link (src/graph/tuning.cc, hwLat, ring): NVLink 3.4 us, PCIe
# 5.7 us, the network 14 us; xGMI is taken as NVLink
STEP_LATENCY_MS = {"nvlink": 0.0034, "xgmi": 0.0034, "pcie": 0.0057, "infiniband": 0.014, "roce": 0.014,
                   "ethernet": 0.014}


# Whose tensor-parallel layers run: Megatron-core's and TransformerEngine's (NeMo's) or torch's DTensor
# `parallelize_module` (torchtitan's); they differ in what a sequence-parallel layer keeps for its backward.
TP_RUNTIMES = ("megatron", "torch")
# How the context ring passes keys and values, by torch's rotate_method names (`set_rotate_method`): alltoall, a
# point-to-point ring (torch's `_AllToAllRotater`, and the transfers TransformerEngine's p2p ring makes, Megatron's
# and NeMo's default) or allgather (torch's `_AllGatherRotater`, torch's and torchtitan's default): `ContextRing`.
CP_ROTATES = ("alltoall", "allgather", "p2p")
# What torch's rings (alltoall, allgather) hold in float32 beside the kernel's own tensors, in tensors of the rank's
# queries' size: torch/distributed/tensor/experimental/_attention.py (read at pytorch 0123248a; the rows' torch
# 1963fc8 is not stored), whose `_cp_options.convert_to_f32` defaults True. The forward's merge of a step's block
# (`_SDPAMerger.step`: the block's output copied to float32; `_merge_one`: `out - F.sigmoid(block_lse - lse) *
# (out - block_out)`) holds the merged output, the block's float32 copy, `out - block_out` and its product with
# the sigmoid (then the product and the new merged output): 4. The backward (`_templated_ring_attention_backward`)
# holds its float32 query gradient (`torch.zeros_like(query, dtype=accum_dtype)`) and, at a load-balanced step past
# the rank (rank 0's every step after its first), `_partial_update`'s `torch.cat` of its chunks beside it: 2.
TORCH_RING_FORWARD_QUERY_COPIES = 4
TORCH_RING_BACKWARD_QUERY_COPIES = 2
# The queries a fused attention kernel's CTA takes on Hopper at head dim 128 (FlashAttention-3's causal 128 x 128:
# Dao-AILab/flash-attention hopper/tile_size.h `tile_size_fwd_sm90`; cuDNN's are not published): the unit of the
# causal tail's tiles (hardware/catalogue.py `AttentionPasses`)
ATTENTION_TILE_QUERIES = 128
# The (queries, keys) tile a fused attention kernel's CTA computes under a sliding window, per pass, for head sizes
# up to each bound (16-bit inputs, A100 and H100): a windowed kernel runs, for each block of queries, every key block
# its band touches whole (`window_tile_pairs`). FlashAttention-2: csrc/flash_attn/src/flash_fwd_launch_template.h
# `run_mha_fwd_hdim*` (read at Dao-AILab/flash-attention 01afd16d; no dropout, A100 and H100 alike but at head size
# 256, where the A100 runs 128 x 64) and flash_bwd_launch_template.h `run_mha_bwd_hdim*` (073afd59; 144 KB of shared
# memory or more). FlashAttention-3 (Hopper): hopper/tile_size.h `tile_size_fwd_sm90` with is_local (07602adc; a
# causal window is local there: flash_api.cpp sets is_causal only without a left window) and
# hopper/flash_bwd_launch_template.h `run_mha_bwd_hdim*`, Arch >= 90 (000786d2). cuDNN publishes none: taken as
# FlashAttention-3's, the Hopper kernel alike (as `ATTENTION_TILE_QUERIES` takes its causal tile for cuDNN's).
_FLASH3_WINDOW_TILES = {"fwd": ((64, 192, 160), (96, 192, 128), (128, 128, 128), (192, 128, 96), (256, 128, 64)),
                        "bwd": ((64, 128, 128), (96, 64, 128), (128, 64, 128), (192, 64, 96), (256, 64, 80))}
WINDOW_TILES: dict[str, dict[str, tuple[tuple[int, int, int], ...]]] = {
    "flash2": {"fwd": ((64, 128, 128), (192, 128, 64), (256, 64, 64)),
               "bwd": ((64, 128, 128), (128, 64, 128), (256, 64, 64))},
    "flash3": _FLASH3_WINDOW_TILES,
    "cudnn": _FLASH3_WINDOW_TILES,
}
FLOAT32_BYTES = 4
# How a backward's weight gradients are added into those accumulated over the mini-batch's micro-batches: fused,
# inside the weight-gradient product (TransformerEngine's and APEX's fuse_wgrad_accumulation: the GEMM writes
# main_grad with beta = 1, no pass of its own), or separate (torch's autograd AccumulateGrad, FSDP2's and DDP's: a
# pass over the held gradients, read, read, write, per backward after the first).
GRAD_ACCUMULATIONS = ("fused", "separate")
# Whose accumulation runs where --grad-accumulation is not given: the runtime each --precision names runs its own.
# Megatron-LM's gradient_accumulation_fusion defaults True (arguments.py `--no-gradient-accumulation-fusion`,
# store_false, since 83b1e42f30, February 2022; with 16-bit main gradients only since 07916bf245, September 2022)
# and Megatron-core, Megatron-Bridge and NeMo keep it (NVIDIA/dgxc-benchmarking's NeMo yamls at 143b90dd91 set
# `gradient_accumulation_fusion: true`, Nemotron-4 340B's with `mcore_distributed_optim` too): fused for the
# precisions named for them. torch FSDP2's is autograd's (Megatron-LM asserts `--use-torch-fsdp2` is not supported
# with gradient accumulation fusion; FSDP2 under a pipeline accumulates the unsharded gradients across
# micro-batches), and fp32 names no runtime's mixed precision, plain torch's: separate. With no --precision, no
# runtime is named: separate, the pass pipesim charged before the setting (Narayanan et al. 2021's and Korthikanti
# et al. 2022's Megatron-LM ran without the fusion: it did not exist in 2021, and with their 16-bit gradients
# arguments.py turned it off until September 2022).
PRECISION_ACCUMULATION = {"fp32": "separate", "megatron": "fused", "megatron-16bit-grads": "fused",
                          "fsdp2": "separate", "nemo-bf16-adam": "fused", "megatron-bf16-moments": "fused"}


class EstimateError(SettingsError):
    """A parallelism or part the estimate cannot price (`SettingsError`: its settings written {setting})."""


class PastLimitsError(ValueError):
    """Layers whose sizes add up past what the simulator takes (profiles/schema.py `layers_past_limits`'s line):
    a micro-batch or model too large for the part, which the command names."""


# The settings of a `Parallelism` that name one of a few choices, and those that may be None (none of it).
_CHOICES = {"expert_gemm": EXPERT_GEMMS, "token_dispatcher": DISPATCHERS, "routing": ROUTINGS,
            "rank_order": RANK_ORDERS, "recompute": RECOMPUTE, "ema": EMA_PLACES,
            "grad_accumulation": GRAD_ACCUMULATIONS, "fp8": tuple(FP8_RECIPES), "tp_runtime": TP_RUNTIMES,
            "cp_rotate": CP_ROTATES, "attention_kernel": ATTENTION_KERNELS, "linear_kernel": LINEAR_KERNELS}
_OPTIONAL = ("token_dispatcher", "ema", "grad_accumulation", "fp8", "linear_kernel")
# The layers CUDA graphs may capture whole: "mamba", each MambaLayer (`LayerCount.mamba_layer`), by Megatron-core's
# cuda_graph_modules (cuda_graph_scope before d0b3b775) under its TransformerEngine implementation
# (make_graphed_callables: a forward and a backward graph a layer); "full", each transformer layer
# (`LayerCount.transformer_layer`: its attention or mixer, MLP or mixture of experts, norms and residual adds), as
# Megatron-core's `enable_cuda_graph` swaps every TransformerLayer for its CudaGraphManager's graphed one
# (transformer_config.py, transformer_layer.py at 7094270c6f), the embedding and the head not. A pass of a captured
# layer is one graph replay the host issues (`graph_replay`)
CUDA_GRAPH_SCOPES = ("mamba", "full")


def captured(layer: LayerCount, scopes: tuple[str, ...]) -> bool:
    """Whether CUDA graphs of `scopes` (`CUDA_GRAPH_SCOPES`) capture `layer` whole."""
    return ("mamba" in scopes and layer.mamba_layer) or ("full" in scopes and layer.transformer_layer)


def runs_te_layers(linear_kernel: str | None, fp8: str | None) -> bool:
    """Megatron-core's TransformerEngine layers run the linears: `linear_kernel` te, or not given under a
    TransformerEngine float8 recipe `fp8`."""
    return linear_kernel == "te" or (linear_kernel is None and fp8 in TE_RECIPES)


@dataclass(frozen=True)
class Parallelism:
    """Tensor (t), pipeline (p) and data (d) parallel degrees, context parallelism (C: the sequence split over C
    ranks holding the same weights, `ContextRing`), expert parallelism (E: a mixture of experts' routed experts
    over E ranks, each expert split over ETP `expert_tensor` ranks, `planning.experts`), the order the ranks are
    numbered in (`schedules.ranks`), and how activations, gradients and optimizer state are kept:
    `precision` is one of `PRECISIONS` (None: as Megatron-LM keeps the count's dtype: float32 main gradients for
    bfloat16, which it forces, 16-bit ones for float16, its default there)."""

    tensor: int = 1
    pipeline: int = 1
    data: int = 1
    context: int = 1
    expert: int = 1  # expert parallelism's E ranks (planning/experts.py)
    expert_tensor: int | None = None  # ETP: the ranks each routed expert is split over (None: t; schedules/ranks.py)
    rank_order: str = "pipesim"  # how the ranks are numbered, of `RANK_ORDERS` (schedules/ranks.py)
    hot_expert_share: float | None = None  # the busiest expert's share of the routed tokens (None: balanced)
    routing: str = "balanced"  # how the router spreads the tokens, of planning/experts.py's `ROUTINGS`
    token_dispatcher: str | None = None  # how tokens reach the experts (planning/experts.py; None: alltoall)
    dispatcher_sms: int | None = None  # the flex dispatcher's (None: `FLEX_DISPATCHER_MULTIPROCESSORS`)
    sequence_parallel: bool = False
    recompute: str = "none"
    recompute_modules: tuple[str, ...] = ()  # of `RECOMPUTE_REGIONS`, their outputs dropped and rerun (`Regions`)
    torch_compile: bool = False  # each transformer layer compiled: saved as AOTAutograd saves it (`_unread_kept`)
    ema: str | None = None  # where the weights' moving average is kept, of `EMA_PLACES` (None: none is kept)
    scores_buffer: bool = False  # Megatron-LM's attention's global memory buffer kept (`scores_buffer_bytes`)
    grad_accumulation: str | None = None  # of `GRAD_ACCUMULATIONS` (None: the precision's, `accumulation`)
    sharded_optimizer: bool = False
    precision: str | None = None
    fp8: str | None = None  # a float8 recipe of `FP8_RECIPES` (planning/fp8.py) for the linear products; None: none
    fsdp_float8_all_gather: bool = False  # FSDP2 all-gathers the float8 linears' weights cast (planning/fp8.py)
    fp8_param_gather: bool = False  # TransformerEngine's float8 weights, gathered so by ZeRO (`gathered_weight_bytes`)
    tp_overlap: bool = False  # sequence parallelism's collectives overlapped with the products (`overlapped_ms`)
    tp_runtime: str = "megatron"  # whose tensor-parallel layers, of `TP_RUNTIMES` (`input_gather_ms`)
    # whose linear layers, of planning/te.py's LINEAR_KERNELS (None: te under a TransformerEngine float8 recipe, else
    # eager; `bias_gradients_fused`)
    linear_kernel: str | None = None
    tp_overlap_no_margin: bool = False  # the forward's pipelined products on every SM (`userbuffers_forward_ms`)
    tp_overlap_fp8_buf: bool = False  # the forward's pipelined reduce-scatters of float8 outputs (`estimate_layer`)
    loss_parallel: bool = False  # the loss counted as torch's loss_parallel computes it (workload/loss.py)
    cp_rotate: str = "alltoall"  # how the context ring passes keys and values, of `CP_ROTATES` (`ContextRing`)
    attention_kernel: str = "flash2"  # the fused attention kernel, of `ATTENTION_KERNELS` (`kernel_curve`)
    host_kernel_us: float = HOST_KERNEL_US  # the issue of a kernel: floors every pass, exposed after a sync (host.py)
    host_module_us: float | None = None  # a TransformerEngine module call's Python (None: by the runtime, host.py)
    expert_gemm: str = "grouped"  # how a rank runs its local experts' products, of planning/experts.py's EXPERT_GEMMS
    p2p_sync: bool = False  # the device synchronised after each exchange between stages (`stage_host_waits_ms`)
    cuda_graphs: tuple[str, ...] = ()  # of `CUDA_GRAPH_SCOPES`: the layers whose passes replay a CUDA graph

    def __post_init__(self) -> None:
        for name in ("tensor", "pipeline", "data", "context", "expert", "expert_tensor", "dispatcher_sms"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise EstimateError(f"{name}: {getattr(self, name)}; at least 1")
        for name, what in (("host_kernel_us", "to issue a kernel"), ("host_module_us", "a module call adds")):
            us = getattr(self, name)
            if us is not None and not 0 <= us <= MAX_HOST_US:
                raise EstimateError(f"{{{name}}}: the host's microseconds {what}, a finite number from 0 to "
                                    f"{MAX_HOST_US:,.0f} (got {us:g})")
        for name, choices in _CHOICES.items():
            value = getattr(self, name)
            if value not in choices and (value is not None or name not in _OPTIONAL):
                raise EstimateError(choose_from(f"{{{name}}}", choices, value))
        if self.dispatcher_sms is not None and self.token_dispatcher not in FLEX_DISPATCHERS:
            raise EstimateError("{dispatcher_sms}: the multiprocessors DeepEP's or HybridEP's kernels hold; give "
                                f"{{token_dispatcher}} {' or '.join(FLEX_DISPATCHERS)}")
        if (any(name not in RECOMPUTE_REGIONS for name in self.recompute_modules)
                or len(set(self.recompute_modules)) < len(self.recompute_modules)):
            raise EstimateError(f"{{recompute_modules}}: a comma list of {', '.join(RECOMPUTE_REGIONS)}, each once "
                                f"(got {','.join(self.recompute_modules)!r})")
        if any(scope not in CUDA_GRAPH_SCOPES for scope in self.cuda_graphs) or len(set(self.cuda_graphs)) < len(
                self.cuda_graphs):
            raise EstimateError(f"{{cuda_graphs}}: a comma list of {', '.join(CUDA_GRAPH_SCOPES)}, each once (got "
                                f"{','.join(self.cuda_graphs)!r})")
        if "full" in self.cuda_graphs and len(self.cuda_graphs) > 1:
            raise EstimateError("{cuda_graphs} full captures every transformer layer, a Mamba-2 one too: give it "
                                "alone (Megatron-core refuses full beside another scope)")
        if "full" in self.cuda_graphs and (self.recompute != "none" or self.recompute_modules):
            raise EstimateError("{cuda_graphs} full captures each transformer layer whole, which Megatron-core "
                                "refuses beside recomputation (transformer_config.py: \"CUDA graphs not supported "
                                "with activation recomputation\"): give {recompute} none without "
                                "{recompute_modules}, or leave full out")
        if self.cuda_graphs and self.precision == "fsdp2":
            raise EstimateError(f"{{cuda_graphs}} {','.join(self.cuda_graphs)}: the layers Megatron-core graphs under "
                                "TransformerEngine, and {precision} fsdp2 is torchtitan's FSDP2, which graphs none; "
                                "leave {cuda_graphs} out")
        if self.recompute_modules and self.recompute not in ("none", "selective"):
            raise EstimateError("{recompute_modules} reruns parts of a layer beside {recompute} none or "
                                f"selective; {{recompute}} {self.recompute} already decides what every layer keeps")
        if self.torch_compile and self.recompute not in COMPILED_RECOMPUTE:
            raise EstimateError("{torch_compile} models what AOTAutograd's partitioner saves of a block compiled "
                                "inside torch's checkpoint, as torchtitan runs it: give {recompute} "
                                f"{' or '.join(COMPILED_RECOMPUTE)} (got {self.recompute})")
        if self.recompute == "op" and self.tensor > 1:
            raise EstimateError("{recompute} op (torchtitan's selective op policy) is modelled for {tensor} 1 only "
                                f"(got {{tensor}} {self.tensor})")
        if self.precision is not None and (refused := precision_refusal(self.precision, "{precision}")) is not None:
            raise EstimateError(refused)
        if self.fsdp_float8_all_gather and (self.precision != "fsdp2" or self.fp8 is None
                                            or not casts_weights_per_use(FP8_RECIPES[self.fp8])):
            raise EstimateError("{fsdp_float8_all_gather}: FSDP2 casting torchao's float8 weights before it "
                                f"all-gathers them; give {{fp8}} {' or '.join(per_use_recipes())} and {{precision}} "
                                f"fsdp2 (got {{fp8}} {self.fp8 or 'none'}, {{precision}} "
                                f"{self.precision or 'not given'})")
        if self.fp8_param_gather and (self.fp8 not in TE_RECIPES or self.precision == "fsdp2" or self.expert > 1):
            raise EstimateError("{fp8_param_gather}: TransformerEngine's float8 weights all-gathered by the "
                                f"distributed optimizer; give {{fp8}} {' or '.join(TE_RECIPES)}, a {{precision}} other "
                                "than fsdp2 and {expert} 1 (a routed expert's float8 gather is not modelled)")
        if self.tp_overlap and not self.sequence_parallel:
            raise EstimateError("{tp_overlap} overlaps sequence parallelism's all-gathers and reduce-scatters with the "
                                "products (Megatron's and torch's): give {sequence_parallel} too")
        for name, what in (("tp_overlap_no_margin", "the SMs"), ("tp_overlap_fp8_buf", "the buffer")):
            if getattr(self, name) and not (self.tp_overlap and self.tp_runtime == "megatron"):
                raise EstimateError(f"{{{name}}} sets {what} of TransformerEngine's pipelined reduce-scatters: give "
                                    "{tp_overlap} under {tp_runtime} megatron")
        if None not in (self.linear_kernel, self.fp8) and (self.linear_kernel == "te") != (self.fp8 in TE_RECIPES):
            whose = "TransformerEngine's modules" if self.fp8 in TE_RECIPES else "linear layers of its own"
            raise EstimateError(f"{{linear_kernel}} {self.linear_kernel}: {{fp8}} {self.fp8} runs {whose}; leave "
                                "{linear_kernel} out")
        if self.tp_overlap_fp8_buf and self.fp8 not in TE_RECIPES:
            raise EstimateError(f"{{tp_overlap_fp8_buf}}: TransformerEngine's float8 userbuffers; give {{fp8}} "
                                f"{' or '.join(TE_RECIPES)} (got {self.fp8 or 'none'})")

    @property
    def float8_recipe(self) -> Fp8Recipe | None:
        """The float8 recipe the passes run (None: none), with no weight cast under FSDP2's float8 all-gather."""
        if self.fp8 is None:
            return None
        recipe = FP8_RECIPES[self.fp8]
        return gathered_in_float8(recipe) if self.fsdp_float8_all_gather else recipe

    @property
    def te_layers(self) -> bool:
        """Megatron-core's TransformerEngine layers run the linears (`runs_te_layers`)."""
        return runs_te_layers(self.linear_kernel, self.fp8)

    @property
    def bias_gradients_fused(self) -> bool:
        """The attention's input projection's bias gradient comes out of its product's backward (planning/te.py):
        under TransformerEngine's layers (`te_layers`) in 16 bits, or in float8 where the recipe fuses it
        (`Fp8Recipe.fuses_bias_gradients`)."""
        return self.te_layers and (self.fp8 is None or FP8_RECIPES[self.fp8].fuses_bias_gradients)

    @property
    def recomputed_regions(self) -> tuple[str, ...]:
        """The count's regions (profiles/workload.py `TRACED_REGIONS`) `recompute_modules` reruns under this run's
        linears (`module_regions`)."""
        return tuple(region for name in self.recompute_modules for region in module_regions(name, self.te_layers))

    def float8_forms(self, element_bytes: int) -> Float8Forms:
        """The layers as this run's recipe and runtime run them (`Float8Forms`), each built once."""
        return Float8Forms(self.float8_recipe, element_bytes, self.bias_gradients_fused)

    @property
    def accumulation(self) -> str:
        """How the gradients are accumulated: as given, else as the named precision's runtime runs it
        (`PRECISION_ACCUMULATION`), else separate."""
        return self.grad_accumulation or PRECISION_ACCUMULATION.get(self.precision, "separate")

    def held(self, dtype: str) -> Precision:
        """How a model counted in `dtype` (torch's name) holds its weights, gradients and optimizer state."""
        return held_precision(self.precision, dtype, self.fp8_param_gather)

    @property
    def gpus(self) -> int:
        return self.tensor * self.context * self.pipeline * self.data

    @property
    def collective_copies(self) -> frozenset[str]:
        """Which of DTensor's sequence-parallel collectives copy their whole tensor once more under torch's TP
        (`_with_collective_copies`): "gather", an all-gather's (a column-parallel product's input, a row-parallel
        one's output gradient), "product", a reduce-scatter of one product's partial sums, and "sum", one of
        autograd's sum of Partial gradients. DTensor gathers and scatters the sequence dimension (Shard(1))
        through torch/distributed/_functional_collectives.py, which collects on the first dimension only: for
        another, `all_gather_tensor` concatenates the gathered chunks, `torch.cat(torch.chunk(res, group_size,
        dim=0), dim=gather_dim)`, and `reduce_scatter_tensor` those to be scattered first, `torch.cat(torch.chunk(
        self, group_size, dim=scatter_dim))`, a new tensor each (read at pytorch 000f488b; so to 2.6, the torchtitan
        rows' 1963fc8 of December 2024; a view for one sample a micro-batch only since `_maybe_view_chunk_cat`,
        2026). Async TP (`tp_overlap`: Inductor's micro_pipeline_tp pass, torchtitan's `_micro_pipeline_tp`)
        fuses each all-gather with the products that read it and each product with its reduce-scatter
        (`fuse_all_gather_matmul`, `fuse_matmul_reduce_scatter`), gathering into one whole tensor
        (`_fused_all_gather_matmul`'s `ag_out`, torch/distributed/_symmetric_memory/__init__.py as of late 2024) and
        writing the partial sums once (`stacked_partials`), each through the caching allocator beside a
        workspace of one shard outside it (`get_symm_mem_workspace`), and forcing its input's producer to write
        the layout it reads (`force_stride_order`), so no copy; a sum it does not fuse (its producer is no
        product), but compiled, Inductor writes the sum into the concatenation (one pointwise kernel), so a sum's
        copy is eager's alone."""
        if not (self.tp_runtime == "torch" and self.sequence_parallel and self.tensor > 1):
            return frozenset()
        return frozenset((*(() if self.tp_overlap else ("gather", "product")), *(() if self.torch_compile else
                                                                                ("sum",))))


def held_precision(precision: str | None, dtype: str, fp8_param_gather: bool = False) -> Precision:
    """How a model counted in `dtype` (torch's name) holds its weights, gradients and optimizer state under
    `precision` (of `PRECISIONS`; None: as Megatron-LM keeps the dtype, `Parallelism`), with TransformerEngine's
    float8 weights where `fp8_param_gather`: an estimate's, and a profile estimated so (planning/scenario.py
    `held_weights`). EstimateError naming the precision or dtype that is not one of those known."""
    refusal = (choose_from("dtype", PEAK_DTYPE, dtype) if dtype not in PEAK_DTYPE
               else precision_refusal(precision) if precision is not None else None)
    if refusal is not None:
        raise EstimateError(refusal)
    name = precision or {"float32": "fp32", "bfloat16": "megatron", "float16": "megatron-16bit-grads"}[dtype]
    held = PRECISIONS[name]
    if held.weight_bytes != _element_bytes(dtype):
        raise EstimateError(f"precision: {name} holds {8 * held.weight_bytes}-bit weights; the model is "
                            f"counted in {dtype}")
    if fp8_param_gather and not held.master_bytes:
        # float8 weights cannot stand in for the master copy: NeMo's setup_optimization (megatron_base_model.py)
        # sets `store_params = True` under `fp8_params`, a master shard in the optimizer's dtype
        return replace(held, master_bytes=held.state_bytes)
    return held


@dataclass(frozen=True)
class Device:
    """What pricing an op needs of the part: peak FLOP/ms in the count's dtype, achieved bytes/ms of memory, the
    float8 peak FLOP/ms that a float8 product runs at (None: no float8 products)."""

    peak_flops_per_ms: float
    memory_bytes_per_ms: float
    curve: Curve
    fp8_peak_flops_per_ms: float | None = None
    # the TF32 peak FLOP/ms a float32 product runs at where TF32 is on (`TF32_PRODUCT_KERNELS`; the part's float32 peak
    # where the catalogue gives no TF32 one); None: no such products priced
    tf32_peak_flops_per_ms: float | None = None
    attention_kernel: str = "flash2"  # the fused attention kernel, of `WINDOW_TILES`: the tiles a window runs
    # beside kernels that hold some of the part's multiprocessors, where its products run persistent CTAs and no SM
    # target is given them: the whole part, on which each product is launched and held (`sharing_dispatcher`)
    products_held_on: Device | None = None

    @classmethod
    def of(cls, gpu: Gpu, dtype: str, curve: Curve | None = None, fp8: bool = False,
           attention_kernel: str = "flash2") -> Device:
        """The catalogue's part pricing ops in `dtype` (its name there: bf16, fp16, ...) on `curve` (default: the
        part's own; a kernel's curve keeps its memory efficiency), with its float8 peak where `fp8`."""
        curve = curve or gpu.curve
        return cls(getattr(gpu.dense_tflops, dtype) * 1e9, gpu.memory_bandwidth_gb_s * 1e6 * curve.memory_efficiency,
                   curve, fp8_peak_tflops(gpu, repr(gpu.name)) * 1e9 if fp8 else None,
                   (gpu.dense_tflops.tf32 or gpu.dense_tflops.fp32) * 1e9, attention_kernel)


def tile_fill(shape: tuple[int, ...], multiprocessors: int, tiles: list[tuple[int, int]]) -> float:
    """How well a product (batch, m, n, k) fills the multiprocessors: useful output over waves × multiprocessors
    × tile area, for the best of the tiles (tile and wave quantisation)."""
    batch, m, n, _ = shape
    return max(batch * m * n / (math.ceil(batch * math.ceil(m / tm) * math.ceil(n / tn) / multiprocessors)
                                * multiprocessors * tm * tn) for tm, tn in tiles)


def matmul_ms(op: OpCount, device: Device) -> float:
    """One call of a matrix product: its FLOPs at the large-product efficiency times its tile fill (of the float8
    peak for a float8 product, at the split-accumulation efficiency for one that accumulates so:
    `Curve.product_efficiency`), or its bytes at the memory bandwidth, whichever is slower, then the bytes of an
    output it adds into (`OpCount.epilogue_bytes`, `accumulating`) at the memory bandwidth, plus the kernel
    overhead. A product running beside `op.streams - 1` others like it on streams of their own takes its share of
    the wave they fill together, overhead included."""
    curve = device.curve
    streams = op.streams
    fill = tile_fill((op.shape[0] * streams, *op.shape[1:]), curve.multiprocessors, curve.tiles)
    peak = device.fp8_peak_flops_per_ms if op.float8 else device.peak_flops_per_ms
    if peak is None:
        raise EstimateError("fp8: the part has no float8 peak")
    compute = streams * op.flops / (peak * curve.product_efficiency(op.split_accumulation) * fill)
    return (curve.kernel_overhead_ms + max(compute, streams * op.moved_bytes / device.memory_bytes_per_ms)
            + streams * op.epilogue_bytes / device.memory_bytes_per_ms) / streams


def kernel_flops(op: OpCount, kernel: str = "flash2") -> float:
    """The FLOPs `op`'s kernel computes (`kernel`, of `WINDOW_TILES`), as its benchmarks count them: torch's count
    (`sdpa_flop_count` ignores is_causal: the whole s x s), of a causal attention kernel half of it. FlashAttention
    skips the blocks past the diagonal (Dao 2023, arXiv 2307.08691, 3.1.1), and its benchmarks, in which the
    catalogue's attention efficiencies are published (FlashAttention-2 and -3 on A100 and H100, arXiv 2307.08691
    and 2407.08608), count a causal kernel's FLOPs as half the square's (flash-attn's
    benchmarks/benchmark_flash_attention.py, `flops`): the same work at the same efficiency. Under a sliding window
    of w keys (`OpCount.window`: Mistral's, gpt-oss's sliding layers) the kernel skips the blocks wholly outside the
    band too, but computes every block the band touches whole (flash-attn's `window_size`: each block of queries
    runs its key blocks from n_block_min to n_block_max, hopper/block.h `get_n_block_min_max`; cuDNN's sliding
    window likewise): the causal kernel's FLOPs in the share of its tiles the band touches (`window_tile_pairs`),
    about twice the band's s·w - w(w-1)/2 pairs at w = 128 and 128 x 128 tiles."""
    if op.kind != "attention" or not op.causal:
        return op.flops
    _, queries, keys, head_size = op.shape
    window = op.window
    if not window or window >= keys:
        return op.flops / 2
    tile = window_tile(kernel, op.op.endswith("_backward"), head_size)
    return op.flops / 2 * window_tile_pairs(queries, keys, window, tile) / window_tile_pairs(queries, keys, keys, tile)


def window_tile(kernel: str, backward: bool, head_size: int) -> tuple[int, int]:
    """The (queries, keys) tile `kernel` computes a windowed pass in at `head_size` (`WINDOW_TILES`; past its
    largest head size, its largest's)."""
    tiles = WINDOW_TILES[kernel]["bwd" if backward else "fwd"]
    return next(((q, k) for bound, q, k in tiles if head_size <= bound), tiles[-1][1:])


@cache
def window_tile_pairs(queries: int, keys: int, window: int, tile: tuple[int, int]) -> int:
    """The query-key pairs of the `tile`s a kernel computes for a causal band of `window` keys (each query its
    `window` latest, itself the last; the queries the last of the keys, as flash-attn aligns them): for each block
    of queries, the key blocks from the first its earliest query reaches to the last its latest does, whole."""
    block_queries, block_keys = tile
    offset = keys - queries
    blocks = 0
    for block in range(math.ceil(queries / block_queries)):
        last = min(math.ceil(keys / block_keys), math.ceil(((block + 1) * block_queries + offset) / block_keys))
        first = max(0, (block * block_queries + offset - window + 1) // block_keys)
        blocks += max(0, last - first)
    return blocks * block_queries * block_keys


# The share of the 16-bit peak DeepSeek Sparse Attention's fused kernels run at (`SPARSE_ATTENTION_KERNELS`):
# FlashMLA's token-level sparse prefill kernel, "up to 640 TFlops" on an H800 (github.com/deepseek-ai/FlashMLA,
# README, 2025.09.29), of its 989.4 dense BF16; the others (cuDNN's indexer scores and backward, the loss's score
# recompute, the sparse backward), whose rates no source gives, taken alike
SPARSE_ATTENTION_FRACTION = 640 / 989.4


def op_ms(op: OpCount, device: Device) -> float:
    """One call of `op` on `device` (a product held on it, `Device.products_held_on`, `HELD_PRODUCT_SLOWDOWN` times
    its time there); another kernel with products at the products' rate (`SPARSE_ATTENTION_FRACTION` of the peak
    for DSA's; of the TF32 peak for a float32 product, `TF32_PRODUCT_KERNELS`)."""
    curve = device.curve
    if op.kind == "matmul":
        held_on = device.products_held_on
        return matmul_ms(op, device) if held_on is None else HELD_PRODUCT_SLOWDOWN * matmul_ms(op, held_on)
    if op.kind == "memory":
        return curve.kernel_overhead_ms + op.moved_bytes / device.memory_bytes_per_ms
    if op.kind == "attention":
        return attention_kernel_ms(kernel_flops(op, device.attention_kernel), op.moved_bytes,
                                   op.op.endswith("_backward"), op.causal, device, query_tiles(op))
    efficiency = SPARSE_ATTENTION_FRACTION if op.op in SPARSE_ATTENTION_KERNELS else curve.matmul_efficiency
    peak = device.tf32_peak_flops_per_ms if op.op in TF32_PRODUCT_KERNELS else device.peak_flops_per_ms
    if peak is None:
        raise EstimateError(f"{op.op}: a float32 product, and the part's float32 peak is not known")
    return curve.kernel_overhead_ms + max(op.flops / (peak * efficiency), op.moved_bytes / device.memory_bytes_per_ms)


def query_tiles(op: OpCount) -> int:
    """The CTAs an attention kernel `op` (batch·heads, queries, keys, head size) runs: one a block of
    `ATTENTION_TILE_QUERIES` queries of each batch·head."""
    return op.shape[0] * math.ceil(op.shape[1] / ATTENTION_TILE_QUERIES)


def attention_kernel_ms(flops: float, moved_bytes: float, backward: bool, causal: bool, device: Device,
                        tiles: int | None = None) -> float:
    """One fused attention kernel computing `flops` (as its benchmarks count them: `kernel_flops`), a `backward`
    one or a forward, `causal` (its diagonal blocks masked) or unmasked, over `tiles` query tiles (`query_tiles`;
    None: as its rate was measured), at the kernel's published fraction of the peak for that pass, mask and tiles
    (`Curve.attention_fraction`), or its bytes at the memory's rate where slower."""
    fraction = device.curve.attention_fraction(backward, causal, tiles)
    return device.curve.kernel_overhead_ms + max(flops / (device.peak_flops_per_ms * fraction),
                                                 moved_bytes / device.memory_bytes_per_ms)


@dataclass(frozen=True)
class _Reduction:
    """The collective that ends a product split on its contraction, on one rank: `op`, the product whose output it
    reduces, and `part`, the share of it one product carries. Column-parallel products that read one input (a
    Hugging Face model's separate q, k and v, gate and up) reduce its gradient once, summed: `op` is then their
    fused product and `part` a product's share of its contraction. Megatron-core fuses them, q, k and v into
    linear_qkv and a gated MLP's gate and up into linear_fc1 (megatron/core/transformer/attention.py and mlp.py),
    one ColumnParallelLinear each, whose backward all-reduces or reduce-scatters its `grad_input` once
    (megatron/core/tensor_parallel/layers.py `LinearWithGradAccumulationAndAsyncCommunication.backward`, read at
    NVIDIA/Megatron-LM d98e8a64); torchtitan keeps wq, wk and wv (w1 and w3) separate, ColwiseParallel on the one
    DTensor that `PrepareModuleInput` on `attention` (`feed_forward`) redistributed from Shard(1) to Replicate
    (torchtitan/parallelisms/parallelize_llama.py `apply_tp`, read at pytorch/torchtitan 004b3148): autograd sums
    their Partial gradients into that tensor's before the redistribute's backward reduces it, once, a reduce-scatter
    torch's async TP does not overlap (`async_tp_ms`)."""

    op: OpCount
    part: float = 1.0
    # "reduce": reduced as the layout's collectives reduce (`reduced_ms`); "gather": no reduction but the all-gather
    # sequence parallelism pairs with one (torch's latent down-projections, whose input gradient is whole on every
    # rank); "all-reduce": a Partial gradient of a whole input made Replicate (torch's MLA up-projections, which read
    # the latent): `_Split.products`
    collective: str = "reduce"

    @property
    def summed(self) -> bool:
        """Whether it reduces a sum of products' gradients (an add's output), not one product's output."""
        return self.part < 1

    def ms(self, product_ms: float, device: Device, reduced_ms: Callable[[_Reduction, float], float]) -> float:
        """A product of `product_ms` with its part of the reduction: `reduced_ms` of the reduction and the reduced
        product's time (the product and its collective, overlapped as the runtime overlaps them), less that
        product's own time."""
        fused_ms = op_ms(self.op, device) if self.summed else product_ms
        return product_ms - self.part * fused_ms + self.part * reduced_ms(self, fused_ms)


@dataclass(frozen=True)
class _Split:
    """How one layer divides over t tensor-parallel and C context-parallel ranks: its width (the output's last
    dimension), tokens (the output's other dimensions) and sequence length, which tell residual-stream tensors,
    token dimensions and the s×s core; the head's, whose output is the loss, from the stream it reads
    (`_read_stream`)."""

    t: int
    sequence_parallel: bool
    width: int
    tokens: int
    seq: int | None
    context: int = 1
    # per product with weights (its index in `LayerCount.weight_grad_outputs`), "column", "row", "replicated" or
    # "latent" (`_weight_splits`)
    weights: dict[int, str] = field(default_factory=dict, compare=False)
    # per pass, per product shape, each of the pass's products of that shape with a role (`weighted_products`):
    # (how its weight splits, which product it is, the weight's side tensor parallelism divides, that side summed
    # over the column-parallel products that read its input: `_input_groups`)
    roles: dict[str, dict[tuple[int, ...], tuple[tuple[str, str, int, int], ...]]] = field(default_factory=dict,
                                                                                             compare=False)
    # per product with weights that shares its input with others, the products whose input gradients one
    # reduction sums with its (`_input_groups`)
    groups: dict[int, tuple[int, ...]] = field(default_factory=dict, compare=False)
    # whose layers run (`TP_RUNTIMES`): Megatron-core fuses the products that share an input into one
    runtime: str = "megatron"
    # the sequence-parallel collectives that copy their whole tensor once more (`Parallelism.collective_copies`)
    collective_copies: frozenset[str] = frozenset()
    # the forward's storages whole on every rank beside the latent products (`_latent_storages`), and the
    # column-parallel products that read one (by index: torch's MLA up-projections)
    latent_storages: frozenset[int] = frozenset()
    latent_readers: frozenset[int] = frozenset()

    @classmethod
    def of(cls, layer: LayerCount, parallel: Parallelism) -> _Split:
        shape = _stream_shape(layer)
        width = shape[-1] if shape else 0
        tokens = math.prod(shape[:-1]) if shape else 0
        forward = weighted_products(layer, {}, "fwd") if parallel.tensor > 1 else {}  # its products, found once
        weights = _weight_splits(layer, forward, tokens, width, parallel.tp_runtime)
        groups = _input_groups(layer, forward, weights, parallel.tp_runtime) if weights else {}
        latent = [j for j, how in weights.items() if how == "latent"]
        storages = _latent_storages(layer, forward, latent) if latent else frozenset()
        reads = dict(layer.forward_reads) if latent else {}
        readers = frozenset(j for number, (j, _, _) in forward.items()
                            if weights.get(j) == "column" and storages.intersection(reads.get(number, ())))
        roles: dict[str, dict[tuple[int, ...], tuple[tuple[str, str, int, int], ...]]] = {}
        for name in PASSES if weights else ():
            shapes = dict(layer.product_allocations.get(name, ()))
            for number, (j, how, role) in weighted_products(layer, weights, name).items():
                if how == "latent" and any(weights.get(i) == "column" for i in groups.get(j, ())):
                    how = "replicated"  # its input's gradient reduced, and the gather carried, by a column product's
                if j in readers:
                    how = "up"  # column-parallel on a whole input (`products`)
                if how:
                    side = layer.weight_grad_outputs[j][0][2 if how in ("column", "latent", "up") else 3]
                    together = sum(layer.weight_grad_outputs[i][0][2] for i in groups.get(j, ())
                                   if weights.get(i) == how) if how in ("column", "latent") else side
                    of_pass, key = roles.setdefault(name, {}), tuple(shapes[number])
                    of_pass[key] = (*of_pass.get(key, ()), (how, role, side, together or side))
        return cls(parallel.tensor, parallel.sequence_parallel, width, tokens, shape[-2] if len(shape) >= 3 else None,
                   parallel.context, weights, roles, groups, parallel.tp_runtime,
                   parallel.collective_copies, storages, readers)

    def context_share(self, op: OpCount) -> OpCount:
        """The op on one of C context-parallel ranks: every op works per token, so 1/C of its FLOPs and bytes,
        its first token or sequence dimension divided (an attention's queries: with the causal load balance each
        rank's queries meet an even share of the keys, `ContextRing`); a product adding into a weight's gradient
        (`OpCount.accumulates_into`) its contraction, the tokens, whatever its weight's sides measure: its output, the
        whole weight's gradient, is every rank's (a 70B's 8,192-wide weights beside 8,192 tokens a micro-batch)."""
        if self.context == 1:
            return op
        dims = list(op.shape)
        at = 3 if op.accumulates_into else next(
            (i for i in range(1 if len(dims) == 4 else 0, len(dims)) if dims[i] in (self.tokens, self.seq)), None)
        if at is not None:
            dims[at] = max(dims[at] // self.context, 1)
        return _scaled(op, tuple(dims), self.context)

    def attention(self, op: OpCount) -> OpCount:
        """An attention kernel on one of the t·C ranks: its t-th of the heads, its C-th of the queries."""
        return self.context_share(_scaled(op, (max(op.shape[0] // self.t, 1), *op.shape[1:]), self.t))

    def residual(self, shape: tuple[int, ...]) -> bool:
        return bool(shape) and shape[-1] == self.width and math.prod(shape) == self.tokens * self.width

    def core(self, shape: tuple[int, ...]) -> bool:
        """An attention core's s x s tensor (its scores, their softmax), which t splits by heads; not a tensor of the
        residual stream's shape, which at s tokens as wide as the model (a 70B's 8,192 at --seq-len 8192) ends in
        (s, s) too: a norm's output was taken for a core tensor, split by t and dropped by selective recomputation."""
        return (self.seq is not None and len(shape) >= 2 and shape[-2:] == (self.seq, self.seq)
                and not self.residual(shape))

    def products(self, op: OpCount, name: str) -> tuple[tuple[OpCount, _Reduction | None, float], ...]:
        """Pass `name`'s product `op` on one of the t·C ranks, as (its share, the reduction it takes part in where
        it was split on its contraction, else None, the share of its calls so split); a routed expert's as it
        comes, at its rank's shape (`ExpertGroup.local`). Split by its weight's role where the count's products of
        its shape have roles (`weighted_products`), in their proportions, else as `matmul` splits it by its shape.
        A column-parallel weight (q, k and v, a gated MLP's gate and up: ColumnParallelLinear in Megatron-core,
        ColwiseParallel in torch's tensor parallelism) is split on its output features: the forward on its output,
        the input gradient on its contraction (reduced); a row-parallel one (the attention's output projection,
        the MLP's down: RowParallelLinear, RowwiseParallel) on its input features: the forward on its contraction
        (reduced), the input gradient on its output; a weight gradient, (out, in, tokens) or (in, out, tokens), on
        the side its weight's split divides. Telling them by shape alone takes a Hugging Face model's separate q
        projection, width x width as the output projection is, for a row-parallel one. Column-parallel products
        that read one input (a Hugging Face model's separate q, k and v, gate and up) reduce their summed input
        gradient once (`_Reduction`). A replicated weight (a router's) is whole on every rank: its products run on
        the tokens the rank holds, reducing nothing (`_replicated_at`). A latent one (torch's MLA down-projections,
        `_weight_splits`) runs whole on every token, its input gradient whole too; under sequence parallelism the
        backward still gathers the attention output projection's gradient from the tokens' shards (DTensor's
        Shard(1) to Replicate), which the input-gradient reduction of the column-parallel products reading the
        attention's input carries elsewhere (`reduced_ms`: a reduce-scatter and an all-gather): theirs carries that
        gather alone (`_Reduction.collective`), once for the products sharing the input. A column-parallel product
        that reads the latent (torch's MLA up-projections, `_Split.latent_readers`) reads it whole on every rank: its
        input gradient, Partial, is all-reduced to Replicate (DTensor), not reduce-scattered."""
        if op.routed:
            return ((op, None, 1.0),)
        roles = self.roles.get(name, {}).get(op.shape, ())
        if self.t == 1 or not roles:
            product, reduced = self.matmul(op, name == "fwd")
            mine = self.context_share(product)
            return ((mine, _Reduction(mine) if reduced else None, 1.0),)
        splits: dict[tuple[int | None, str | None, int], int] = {}
        _, m, _, _ = op.shape
        for how, role, side, together in roles:
            split_at = {"output": 2 if how == "row" else 1, "input": 2 if how in ("column", "up") else 1}
            at = (None if how == "latent" else self._replicated_at(role) if how == "replicated"
                  else split_at.get(role, 0 if m == side else 1))
            collective = ("reduce" if (how, role) in _CONTRACTED else "all-reduce" if (how, role) == ("up", "input")
                          else "gather" if (how, role) == ("latent", "input") and self.sequence_parallel else None)
            key = (at, collective, together if role == "input" else side)
            splits[key] = splits.get(key, 0) + 1
        return tuple((self.context_share(self._divided(op, at)),
                      self._reduction(op, at, together, collective) if collective else None,
                      n / len(roles)) for (at, collective, together), n in splits.items())

    def _reduction(self, op: OpCount, at: int | None, together: int, collective: str) -> _Reduction:
        """The reduction (`_Reduction.collective`) a product split on its dimension `at` takes part in: its own, or
        where products that share its input contract over `together` features in all, theirs summed, as the fused
        product of them all writes it, of which `op` carries its share of the features."""
        mine = self.context_share(self._divided(op, at))
        batch, m, n, k = op.shape
        if together == k:
            return _Reduction(mine, collective=collective)
        elements = m * n + (m + n) * together, m * n + (m + n) * k  # its output and inputs, fused and its own
        fused = replace(op, shape=(batch, m, n, together), flops=op.flops * together // k,
                        moved_bytes=op.moved_bytes * elements[0] // elements[1])
        return _Reduction(self.context_share(self._divided(fused, at)), k / together, collective)

    def _replicated_at(self, role: str) -> int | None:
        """Where a replicated weight's product (`role`, `weighted_products`) divides over t: on its tokens, m of
        its output and input gradient, k of its weight gradient, where the rank holds 1/t of them (Megatron-core
        under sequence parallelism, whose router reads the rank's tokens before the dispatcher gathers them:
        megatron/core/transformer/moe/moe_layer.py `MoELayer.forward` and router.py at 7094270c6f, core_r0.12.0);
        None, whole, where every rank holds all of them (Megatron-core without sequence parallelism; torch's, whose
        MoE gathers its input to Replicate before the router, `NoParallel` on `moe.router.gate`: torchtitan/
        models/llama4/infra/parallelize.py `apply_moe_ep_tp`)."""
        if not (self.sequence_parallel and self.runtime == "megatron"):
            return None
        return 2 if role == "weight" else 0

    def replicated_whole(self, product: tuple[int, str, str] | None) -> bool:
        """Whether a product (`weighted_products`' (index, how its weight splits, which product it is)) of a
        replicated weight writes its output whole on the rank, as it runs (`_replicated_at`): its weight gradient
        always, its output and input gradient where the rank holds all the tokens (Megatron-core's router without
        sequence parallelism, torch's after its gather; torch's latent down-projections always), not 1/t as a
        tensor of its shape otherwise is."""
        return product is not None and (product[1] == "latent" or product[1] == "replicated"
                                        and self._replicated_at(product[2]) not in (0, 1))

    def _divided(self, op: OpCount, at: int | None) -> OpCount:
        """`op` with its dimension `at` of (m, n, k) divided by t (None: whole)."""
        if at is None:
            return op
        dims = list(op.shape[1:])
        dims[at] = max(dims[at] // self.t, 1)
        return _scaled(op, (op.shape[0], *dims), self.t)

    def matmul(self, op: OpCount, forward: bool) -> tuple[OpCount, bool]:
        """The product on one of t ranks, and whether it was split on its contraction (ends in an all-reduce), by
        its shape alone (`products` tells a product with weights by its role where the count records them).
        A width × width weight (the attention's output projection) is row-parallel: split on its contraction
        in the forward, on its output in the backward."""
        batch, m, n, k = op.shape
        if self.t == 1:
            return op, False
        if batch > 1:
            return _scaled(op, (max(batch // self.t, 1), m, n, k), self.t), False
        dims = [m, n, k]
        free = [i for i in range(3) if dims[i] != self.tokens] or [2]
        split = next((i for i in free if dims[i] != self.width), free[-1] if forward else free[0])
        return self._divided(op, split), split == 2

    def memory(self, op: OpCount) -> OpCount:
        whole = self.residual(op.shape) and not self.sequence_parallel
        return op if whole or self.t == 1 else _scaled(op, op.shape, self.t)


def _stream_shape(layer: LayerCount) -> tuple[int, ...]:
    """The residual stream's shape in `layer`: its output's, the head's the stream it reads (`_read_stream`)."""
    return layer.output_shape or _read_stream(layer)


def _read_stream(layer: LayerCount) -> tuple[int, ...]:
    """The residual stream's shape at a layer whose output is the loss (the head): that of the tensor in the
    stream's layout its column-parallel product reads (`LayerCount.sequence_inputs`: its final norm's output),
    which its input gradient is too, whole on each rank before its reduction (`_Split.residual`); () where the
    count marks none."""
    made = {number: shape for number, shape, nbytes, _ in layer.allocations.get("fwd", ()) if nbytes > 0}
    return next((made.get(number, layer.saved_tensors[i][0]) for i, number in layer.sequence_inputs), ())


def _scaled(op: OpCount, shape: tuple[int, ...], t: int) -> OpCount:
    return replace(op, shape=shape, flops=op.flops // t, moved_bytes=op.moved_bytes // t)


@dataclass(frozen=True)
class PlacementLinks:
    """The links the placement gives (latency ms per step, bytes/ms per GPU and direction); `context`: the
    context-parallel ring's (None where the placement was read back from an estimate that has no ring)."""

    tensor: EstimateLink
    stage: EstimateLink
    data: EstimateLink
    context: EstimateLink | None = None


def _link(kind: str, gb_s: float) -> EstimateLink:
    return EstimateLink(kind=kind, latency_ms=STEP_LATENCY_MS[kind], bytes_per_ms=gb_s * 1e6)


def node_placement(gpu: Gpu, cluster: Cluster | None = None, curve: Curve | None = None) -> EstimatePlacement:
    """What every placement's links follow from: the node's size and link and the network (a cluster's replace
    the part's). The node's link runs at the curve's measured fraction of its datasheet rate, the network at the
    fraction of its line rate NCCL moves through a NIC (`Curve.network_efficiency`)."""
    intra = cluster.intra_node if cluster and cluster.intra_node else gpu.intra_node
    network = cluster.network if cluster and cluster.network else gpu.network
    curve = curve or gpu.curve
    return EstimatePlacement(
        gpus_per_node=cluster.gpus_per_node if cluster and cluster.gpus_per_node else gpu.intra_node.gpus_per_node,
        node_link=_link(intra.link, intra.gb_s_per_direction * (curve.link_efficiency if curve else 1.0)),
        network_link=_link(network.kind, network.gbit_s / 8 * (curve.network_efficiency if curve else 1.0)))


def placement_links(gpu: Gpu, parallel: Parallelism, cluster: Cluster | None = None,
                    curve: Curve | None = None) -> PlacementLinks:
    """The links of `parallel`'s placement on the part (or cluster): `links_of` its `node_placement`."""
    return links_of(node_placement(gpu, cluster, curve), parallel.tensor, parallel.pipeline, parallel.data,
                    parallel.context, parallel.rank_order, parallel.sequence_parallel)


def links_of(placement: EstimatePlacement, t: int, p: int, d: int, c: int = 1,
             order: str = "pipesim", sequence_parallel: bool = False) -> PlacementLinks:
    """The links of the groups as `order` numbers the ranks (schedules/ranks.py; "pipesim": t inside a node first,
    then the C context-parallel ranks, then p, then d; "megatron": t, C, d, then p): a group within one node talks
    over the node's link, else over the network: the context ring once t·C exceeds a node (a ring step waits for its
    slowest hop, a GPU's own NIC), the stage boundaries once the pipeline's block of ranks does (`_stage_link`),
    the data-parallel group once its block does. The gradients are reduced over the C·d ranks that hold the same
    weights; with k of them on each node the group crosses nodes on k NICs at once (NCCL runs a ring per channel,
    each through its own NIC), up to the node's link. A tensor-parallel group larger than a node fills whole nodes
    and crosses them likewise (`_across_nodes`)."""
    node, inside, outside = placement.gpus_per_node, placement.node_link, placement.network_link
    if t > node and t % node:
        raise EstimateError(f"tensor: {t} spans nodes of {node} GPUs and must fill them: give a multiple of {node}")
    grid = dense_grid(order, t, c, p, d)
    members = grid.per_node(GRADIENT_GROUP, node)
    tensor = inside if t <= node else _across_nodes(outside, inside, node, t)
    return PlacementLinks(tensor, inside if grid.within_node(("pp",), node) else _stage_link(outside, tensor, t,
                                                                                             sequence_parallel),
                          inside if grid.within_node(GRADIENT_GROUP, node) else _across(outside, inside, members),
                          inside if grid.within_node(("cp",), node) else outside)


def placed(placement: EstimatePlacement, counted: WorkloadCount, parallel: Parallelism, curve: Curve
           ) -> tuple[ExpertGroup, PlacementLinks, int]:
    """All an estimate reads of where `parallel`'s rank order puts its ranks: the expert-parallel group, the
    groups' links and how many of the gradient group share a node (`gradient_ranks_per_node`, which the scenario
    prices the replicas' reduce by); two orders that place alike estimate alike (tune searches the second only where
    they differ). A group the order cannot place is `EstimateError`."""
    try:
        experts = expert_group(placement, parallel.expert, counted.options.get("experts"), parallel.tensor,
                               parallel.context, parallel.pipeline, parallel.data, parallel.hot_expert_share,
                               parallel.token_dispatcher, parallel.rank_order, parallel.expert_tensor,
                               _routing_groups(counted.options), parallel.routing, curve.hybridep,
                               counted.top_k)
    except ExpertParallelError as exc:
        raise EstimateError(*exc.args) from None  # its {settings} as they are
    return (experts, links_of(placement, parallel.tensor, parallel.pipeline, parallel.data, parallel.context,
                              parallel.rank_order, parallel.sequence_parallel),
            gradient_ranks_per_node(placement.gpus_per_node, parallel.tensor, parallel.pipeline, parallel.context,
                                    parallel.data, parallel.rank_order))


def gradient_ranks_per_node(gpus_per_node: int, t: int, p: int, c: int, d: int, order: str = "pipesim") -> int:
    """How many of the C·d ranks that reduce the same gradients (`links_of`'s placement) share each node."""
    return dense_grid(order, t, c, p, d).per_node(GRADIENT_GROUP, gpus_per_node)


def _across(network: EstimateLink, node: EstimateLink, members: int) -> EstimateLink:
    """A group with `members` ranks on each of its nodes: it crosses nodes on as many NICs at once, up to the
    node's link, each step at the network's latency."""
    return EstimateLink(kind=network.kind, latency_ms=network.latency_ms,
                        bytes_per_ms=min(members * network.bytes_per_ms, node.bytes_per_ms))


def _across_nodes(network: EstimateLink, node: EstimateLink, per_node: int, ranks: int) -> EstimateLink:
    """A tensor-parallel group of `ranks` filling ranks/per_node whole nodes: its bytes cross on the nodes' NICs,
    all of them at once (`_across`), its slowest link. NCCL's tuner (src/graph/tuning.cc, ncclTopoTuneModel)
    times a ring all-reduce of n ranks on k nodes as 2k steps at the network's latency and the other 2(n-1) - 2k
    at the node link's: its step latency here is that mean."""
    steps = 2 * (ranks - 1)
    crossing_steps = min(2 * (ranks // per_node), steps)
    return _across(network, node, per_node).model_copy(update={"latency_ms": (
        crossing_steps * network.latency_ms + (steps - crossing_steps) * node.latency_ms) / steps})


def _stage_link(network: EstimateLink, node: EstimateLink, t: int, sequence_parallel: bool) -> EstimateLink:
    """The link between stages on other nodes, each of the t ranks sending 1/t of the boundary tensor on its own
    NIC (the profile's boundary bytes are that share). Without sequence parallelism the receiving ranks then
    all-gather it on their group's link `node` (Megatron-LM's scatter/gather, `scatter_gather_tensors_in_pipeline`):
    (t-1) steps of the same share, so a byte sent costs 1/network + (t-1)/node. Under sequence parallelism the
    share is the rank's own sequence shard and nothing is gathered: Megatron-LM skips the scatter/gather there
    (megatron/p2p_communication.py `_communicate`: `and not args.model_parallel_memory_opt` from 6658158b58, the
    flag renamed `sequence_parallel` in cfd2e21607, 2022), Megatron-core has none (core_v0.9.0:
    p2p_communication.py sends the tensor as given, its shape seq_length/t under sequence parallelism, schedules.py
    `get_tensor_shapes` and the interleaved schedule's `tensor_shape`), and torchtitan's stages pass their blocks'
    Shard(1) local outputs: the network alone. Not priced: Megatron-core without sequence parallelism, where each
    rank sends the whole tensor (t shares) on its NIC and gathers nothing; every published row without it ran
    Megatron-LM's scatter/gather."""
    if t == 1 or sequence_parallel:
        return network
    return EstimateLink(kind=network.kind, latency_ms=network.latency_ms + (t - 1) * node.latency_ms,
                        bytes_per_ms=1 / (1 / network.bytes_per_ms + (t - 1) / node.bytes_per_ms))


@dataclass(frozen=True)
class LayerEstimate:
    """One layer on one GPU: times (ms) per pass, recomputation and tensor-parallel collectives included, and
    activation bytes kept for the backward."""

    fwd_ms: float
    bwd_ms: float
    igrad_ms: float
    wgrad_ms: float
    activation_bytes: int
    activation_parts: dict[str, int]  # of those, by what saves them (`SAVED_PARTS`), summing to them
    transient_bytes: dict[str, int]  # per pass of `PASSES`, what it creates and frees within itself at its peak
    ring_fwd: RingExchange | None = None  # the context ring's exchanges during a forward (None: C = 1)
    ring_bwd: RingExchange | None = None  # during a backward (B or I), a recomputed forward's with them
    # what a weight pass deferred after the input pass keeps (`wgrad_kept`): its products' saved inputs (None: the
    # count does not say which they are) and their output gradients
    wgrad_kept_bytes: int | None = None
    wgrad_gradient_bytes: int = 0
    # per pass, its ops in the order the host issues them, each with its time (`_pass_ms`): a backward's rerun of
    # the forward first; what planning/host.py's `issued_ms` prices a pass after a synchronisation by
    timed_ops: dict[str, tuple[tuple[OpCount, float], ...]] = field(default_factory=dict)
    ring: ContextRing | None = None  # the context ring its attention runs on (None: C = 1), whose kernels it issues


@dataclass(frozen=True)
class RingExchange:
    """A pass's key/value exchanges around the context-parallel ring (`ContextRing`), which its RING_F or RING_B
    row runs: their link time, how much of it the attention blocks cover (`ContextRing.exchange_ms`), and the
    most buffer bytes one of its attention calls holds for them."""

    link_ms: float = 0.0
    hidden_ms: float = 0.0
    buffer_bytes: int = 0

    def __add__(self, other: RingExchange) -> RingExchange:
        """Both passes' exchanges, one after the other: their times add, their buffers do not meet."""
        return RingExchange(self.link_ms + other.link_ms, self.hidden_ms + other.hidden_ms,
                            max(self.buffer_bytes, other.buffer_bytes))


@dataclass(frozen=True)
class ContextRing:
    """Ring attention over the C ranks of a context-parallel group, as torch's context parallel runs it (pytorch/pytorch
    torch/distributed/tensor/experimental/_context_parallel/_attention.py, `_templated_ring_attention` and
    `_templated_ring_attention_backward`, its ring rotater) and Megatron-core's through TransformerEngine
    (cp_comm_type p2p: `rotate` p2p, below). Each rank holds 2 of the sequence's 2C chunks, i and 2C-1-i, so that
    under a causal mask every rank's queries meet the same share of the keys: the forward runs C steps, each a block
    of 1/C of the rank's attention, while the keys and values it holds go on to the next rank (C - 1 transfers); the
    backward passes them round again and, after each step, the key and value gradients so far, in float32 (torch's
    `convert_to_f32`): C transfers, the last after the last step. A step's transfer runs under its block; the
    exchanges are the pass's RING_F or RING_B row (`schedules.passes.add_context_parallel`), priced here as their
    link time and how much of it the blocks cover (`exchange_ms`); the simulator runs what the blocks leave on the
    device's network stream, after the collectives issued before it. The elementwise passes that merge the blocks
    are priced with them (`merge_ms`). `rotate` (of `CP_ROTATES`) is torch's rotate_method: alltoall the ring above
    (`_AllToAllRotater`), allgather torch's default (`_AllGatherRotater`): the keys and values of all C ranks
    gathered once, at the first step, under its block, the other steps sending none; the backward gathers them so
    too, and its key and value gradients still go round the ring (its gradient rotater is `_AllToAllRotater`
    whatever the option). p2p is the alltoall ring as TransformerEngine 1.x's `AttnFuncWithCPAndKVP2P` runs it
    (Megatron-core's cp_comm_type p2p, NeMo's; transformer_engine/pytorch/attention.py at v1.10): its backward's
    two buffers hold the keys and values with their gradients, all in the keys' dtype; step 0 sends the keys and
    values, each later step both, the last step the gradients alone, whose receive it waits for before it returns: C
    transfers, each under its step's block, none after the last."""

    ranks: int
    link: EstimateLink
    rotate: str = "alltoall"

    @staticmethod
    def keys_values(op: OpCount) -> int:
        """The elements of the keys and values one call of the rank's attention kernel `op` sends a step."""
        heads, queries, _, head_size = op.shape
        return 2 * max(heads // op.kv_group, 1) * queries * head_size

    def step_bytes(self, op: OpCount, element_bytes: int) -> tuple[list[int], int]:
        """Bytes sent during each of the C steps of one call of the rank's attention kernel `op` (its shape: the
        rank's (batch·heads, queries, keys, head size), its keys and values as many tokens as its queries, at their
        own heads: 1/`kv_group` of the queries' under grouped-query attention, at least one, as TransformerEngine's
        ring (`AttnFuncWithCPAndKVP2P`) and torch's pass the K and V the kernel takes), and those sent after the
        last step. Under allgather, the first step's is the all-gather, each rank receiving the other C - 1 ranks'
        keys and values, and the backward's gradients go one a step after it."""
        keys_values = self.keys_values(op)
        if self.rotate == "allgather":
            gradients = keys_values * 4 if op.op.endswith("_backward") else 0
            return [(self.ranks - 1) * keys_values * element_bytes] + [gradients] * (self.ranks - 1), gradients
        if not op.op.endswith("_backward"):
            return [keys_values * element_bytes] * (self.ranks - 1) + [0], 0
        if self.rotate == "p2p":
            sent = keys_values * element_bytes
            return [sent] + [2 * sent] * (self.ranks - 2) + [sent], 0
        gradients = keys_values * 4
        return [keys_values * element_bytes + (gradients if i else 0) for i in range(self.ranks - 1)] + [gradients], \
            gradients

    def step_pairs(self, rank: int) -> list[float]:
        """The (query chunk, key chunk) pairs `rank` computes at each of the C steps under the causal mask, a pair
        on the diagonal half masked: it holds chunks rank and 2C-1-rank, and at step i the keys and values of rank
        (rank - i) mod C (torch's round-robin load balance, `_is_causal_behavior` and the branches after it)."""
        c = self.ranks

        def chunks(holder: int) -> tuple[int, int]:
            return holder, 2 * c - 1 - holder

        return [sum(1.0 if key < query else 0.5 if key == query else 0.0
                    for query in chunks(rank) for key in chunks((rank - i) % c)) for i in range(c)]

    def transfer_ms(self, nbytes: int) -> float:
        return self.link.latency_ms + nbytes / self.link.bytes_per_ms

    def step_link_ms(self, step: int, nbytes: int) -> float:
        """The link time of a step's `nbytes`: one transfer, or under allgather the first step's all-gather, NCCL's
        ring of C - 1 transfers (`all_gather_ms`)."""
        if self.rotate == "allgather" and step == 0:
            return all_gather_ms(nbytes * self.ranks / (self.ranks - 1), self.ranks, self.link.latency_ms,
                                 self.link.bytes_per_ms)
        return self.transfer_ms(nbytes)

    def blocks_ms(self, op: OpCount, device: Device) -> list[float]:
        """One call of the rank's attention `op` (its 1/C share, `_Split.context_share`) run as the ring's C
        blocks, each step at the pace of its busiest rank. The pairs are the work a causal kernel computes
        (`kernel_flops`): a block is priced as that share of it, at the causal kernel's rate for the first step's
        (every rank's own chunks, the diagonal masked: TransformerEngine's `AttnFuncWithCPAndKVP2P` passes
        attn_mask_type causal at its forward's i == 0, torch's ring is_causal at its first step of either pass) and
        the unmasked kernel's for the others (half the queries or half the keys, "no_mask"), where the part
        publishes them apart (`Curve.attention_fraction`). TransformerEngine's backward runs the forward's steps in
        reverse, its causal block at i == cp_size - 1; under p2p that step's transfer (the gradients alone) is the
        first's size (the keys and values alone), so pricing the causal block first covers the same link time."""
        if 0 < op.window < op.shape[2]:  # its ring would pass keys and values the window never reaches; a window of
            # every key (Mistral's 4,096 at --seq-len 4096 or less) is the causal kernel, as `kernel_flops` prices it
            raise EstimateError(f"{{context}} {self.ranks}, but the model's attention has a sliding window of "
                                f"{op.window} keys, which pipesim's context-parallel ring does not run; give "
                                "{context} 1")
        # the load balance gives every rank the same pairs at every step (tests/test_context_parallel.py), so rank
        # 0's are every step's busiest, and its op is its share of them all: taken over every rank, C^2 steps' pairs
        # priced one by one, C = 1,024 took 11 s and 4,096 minutes
        steps = self.step_pairs(0)
        share = 1 / sum(steps)  # of the rank's op
        backward = op.op.endswith("_backward")
        flops = kernel_flops(op, device.attention_kernel)

        @functools.cache
        def block_ms(pairs: float, causal: bool) -> float:
            return attention_kernel_ms(flops * pairs * share, op.moved_bytes * pairs * share, backward, causal, device,
                                       query_tiles(op))

        return [block_ms(pairs, op.causal and step == 0) for step, pairs in enumerate(steps)]

    def merge_ms(self, op: OpCount, device: Device, element_bytes: int) -> float:
        """The elementwise passes that join one call's C blocks, as TransformerEngine 1.x's
        `AttnFuncWithCP` runs them (transformer_engine/pytorch/attention.py, the p2p ring Megatron-core's
        cp_comm_type p2p runs): the forward copies the keys and values into the first send buffer (`torch.cat`),
        zeroes the output and adds each step's block output into it scaled by its softmax statistics
        (`flash_attn_fwd_out_correction`, compiled: one kernel reading the block's output and reading and writing
        the sum); the backward copies the keys and values into its send buffer and, after each step, joins the
        block's key and value gradients (`torch.cat`) and adds them into the travelling sum, and adds the block's
        query gradient into the rank's (`dq.add_`, `dkv.add_`). Each pass counted over the whole tensor: the halves
        of the masked steps (half the queries or the keys) and the first step's copies where later steps add are
        taken as the others. The softmax statistics (one float a query row: 0.5 MB a rank at Llama 3.1 8B, C = 2)
        cost their kernels, not their bytes: the forward clones the first step's and widens them to float64
        (`torch.clone(...).to(torch.double)`), joins each later step's into them
        (`flash_attn_fwd_softmax_lse_correction`, compiled: one kernel each) and narrows them to float32 again
        before the output's corrections, C + 2 kernels; the backward copies their second half
        (`softmax_lse_[..., 1, :].contiguous()`), one. torch's ring (`_SDPAMerger`) merges in float32: at least these
        bytes. Each pass a kernel at the memory's rate."""
        queries = op.shape[0] * op.shape[1] * op.shape[3] * element_bytes
        keys_values = self.keys_values(op) * element_bytes
        if op.op.endswith("_backward"):
            moved = 2 * keys_values + self.ranks * (5 * keys_values + 3 * queries)
        else:
            moved = 2 * keys_values + queries + self.ranks * 3 * queries
        return self.merge_kernels(op) * device.curve.kernel_overhead_ms + moved / device.memory_bytes_per_ms

    def merge_kernels(self, op: OpCount) -> int:
        """The kernels `merge_ms` prices for one call of `op`: the backward's 2 + 3C, the forward's 4 + 2C."""
        return 2 + 3 * self.ranks if op.op.endswith("_backward") else 4 + 2 * self.ranks

    def copy_kernels(self, op: OpCount) -> int:
        """The kernels `copies_ms` prices for one call of `op`: v's copy in p2p's forward, else none."""
        return 1 if self.rotate == "p2p" and not op.op.endswith("_backward") else 0

    def kernels(self, op: OpCount) -> int:
        """The kernels one call of the attention `op` runs on the ring, each one the host issues (planning/host.py
        `pass_kernels`): its C blocks, their merges and copies. The exchanges' sends and receives are the link's
        time on the network stream (`exchange_ms`), not kernels the passes count."""
        return self.ranks + self.merge_kernels(op) + self.copy_kernels(op)

    def copies_ms(self, op: OpCount, device: Device, element_bytes: int) -> float:
        """The copies TransformerEngine's ring (p2p; torch's rings hand their kernels views) makes of what it hands
        cuDNN, which `merge_ms` does not count (transformer_engine/pytorch/attention.py at v1.10): FusedAttention's
        context-parallel branch makes q, k and v contiguous (`x.contiguous()`), and v, a view of Megatron-core's
        fused QKV product (`SplitAlongDim`; q and k come whole out of its reshape and the RoPE), is copied: one
        kernel reading and writing v, at the memory's rate, in the forward. The halves the unmasked steps take copy
        nothing: in Megatron-core's sbhd layout `AttnFuncWithCPAndKVP2P` views its contiguous q, k and v as [2, s/2,
        ...] and its key-value buffer as [2, s/2, b, 2, ...], so `q[1]`, `kv_inputs[i % 2][0]`, `out[1]`, `dout[1]`
        and `kv[0]` are contiguous slices and their `.contiguous()` returns them as they are (bshd's `q[:, 1, ...]`
        would copy)."""
        return self.copy_kernels(op) * (device.curve.kernel_overhead_ms
                                        + self.keys_values(op) * element_bytes / device.memory_bytes_per_ms)

    def kept(self, layer: LayerCount) -> LayerCount:
        """`layer` keeping for the backward what the ring's forward keeps: under p2p the attention's inputs made
        contiguous before TransformerEngine's ring takes them (FusedAttention's context-parallel branch,
        `x.contiguous()`, transformer_engine/pytorch/attention.py at v1.10) and its own `torch.cat` of the keys and
        values saved (`AttnFuncWithCPAndKVP2P.forward`: `q, kv, out, softmax_lse`), so a fused QKV product that the
        kernel's v viewed is freed, not kept beside the rotated q and k (`LayerCount.attention_copied_bytes`); torch's
        rings save their kernels' views as given. A layer whose saves the ring leaves as they are is itself."""
        if self.rotate != "p2p" or not layer.attention_copied_bytes:
            return layer
        saved = tuple((shape, copied) for (shape, _), copied in zip(layer.saved_tensors, layer.attention_copied_bytes))
        if saved == layer.saved_tensors:
            return layer
        freed = sum(nbytes for _, nbytes in layer.saved_tensors) - sum(nbytes for _, nbytes in saved)
        return replace(layer, saved_tensors=saved, saved_bytes=layer.saved_bytes - freed)

    def attention_ms(self, op: OpCount, device: Device) -> float:
        """One call of the rank's attention `op` as its C blocks, the exchanges aside (`exchange_ms`)."""
        return sum(self.blocks_ms(op, device))

    def exchange_ms(self, op: OpCount, device: Device, element_bytes: int) -> tuple[float, float]:
        """The link time of one call's exchanges (its steps' transfers and the one after the last step), and how
        much of it the blocks cover: each step's transfer runs under that step's block, and the next step waits
        for both (the ring's next keys and values), so a block covers its own step's transfer up to its length,
        never another step's slack; the transfer after the last step runs under none."""
        steps, after = self.step_bytes(op, element_bytes)
        sending = [(self.step_link_ms(step, nbytes), block_ms)
                   for step, (nbytes, block_ms) in enumerate(zip(steps, self.blocks_ms(op, device))) if nbytes]
        link_ms = sum(transfer_ms for transfer_ms, _ in sending) + (self.transfer_ms(after) if after else 0.0)
        return link_ms, sum(min(transfer_ms, block_ms) for transfer_ms, block_ms in sending)

    def buffer_bytes(self, op: OpCount, element_bytes: int) -> int:
        """The ring's buffers one call holds at its busiest step (torch's `_AllToAllRotater`, the ring it
        sends on): the keys and values it computes with once they are received, the copy it sends and the one it
        receives (two of them with C = 2, whose last step sends nothing); in the backward also the key and value
        gradients in float32: the sum it adds to, the copy it sends and the one it receives. Under allgather
        (`_AllGatherRotater`) the keys and values are the gathered C copies and the one concatenated to send, and in
        the backward with C > 2 also the next step's concatenation beside it (`_templated_ring_attention_backward`
        concatenates one at every step but the last while the last one sent is still held). Under p2p
        (TransformerEngine's) the forward keeps every step's key/value buffer until it returns (its
        `p2p_comm_buffers`, C of them) and the backward its two buffers of the keys and values with their
        gradients, in their dtype. torch's rings also merge the blocks in float32, tensors of the queries' size
        (TORCH_RING_FORWARD_QUERY_COPIES, TORCH_RING_BACKWARD_QUERY_COPIES; the log-sum-exp's, one float a
        query row, left out)."""
        keys_values = self.keys_values(op)
        backward = op.op.endswith("_backward")
        if self.rotate == "p2p":
            return (4 if backward else self.ranks) * keys_values * element_bytes
        if self.rotate == "allgather":
            kept = (self.ranks + (2 if backward and self.ranks > 2 else 1)) * keys_values * element_bytes
        else:
            kept = min(self.ranks, 3) * keys_values * element_bytes
        queries = op.shape[0] * op.shape[1] * op.shape[3]
        merged = (TORCH_RING_BACKWARD_QUERY_COPIES if backward else TORCH_RING_FORWARD_QUERY_COPIES) * queries
        return kept + ((3 * keys_values if backward else 0) + merged) * FLOAT32_BYTES


# TransformerEngine's userbuffers defaults for the `pipeline` method, which runs the row-parallel forward products'
# reduce-scatters (proj_fprop, fc2_fprop): `initialize_ub`'s default config in transformer_engine/pytorch/module/
# base.py, num_splits 4, num_sm 16 with set_sm_margin (the product leaves those multiprocessors to the
# communication kernels; NeMo's per-model userbuffer configs set 8-24, tp_overlap_configs/userbuffers.py).
TE_PIPELINE_SPLITS = 4
TE_PIPELINE_MULTIPROCESSORS = 16


# The multiprocessors DeepEP's dispatch and combine kernels hold while they run: its `Buffer.num_sms` default 20,
# Megatron-core's `moe_deepep_num_sms` default 20 (transformer_config.py), the "only 20 SMs" DeepSeek-V3's report
# gives its communication (arXiv 2412.19437, section 3.2.2). Whatever computes beside them gets the rest
# (`sharing_dispatcher`). HybridEP's: Megatron-core's `moe_hybridep_num_sms` default 16 (transformer_config.py at
# b0cc2706: "In pure NVL scenarios, 16 SMs can generally achieve good bandwidth"); Megatron-Bridge's performance
# scripts set 32 (scripts/performance/utils/overrides.py at v0.3.0), which `--dispatcher-sms` gives.
FLEX_DISPATCHER_MULTIPROCESSORS = {"deepep": 20, "hybridep": 16}
# The multiprocessors NCCL's all-to-all holds while it runs (`--token-dispatcher alltoall`): one CTA a channel, on an
# SM of its own that no compute kernel shares, 16 on a DGX with 8 NICs (NCCL's maintainer, github.com/NVIDIA/nccl
# issue 689); all_to_all_single's ncclDevKernel_SendRecv launched 16 CTAs (issue 1598).
NCCL_ALL_TO_ALL_MULTIPROCESSORS = 16
# The float8 recipes whose products run on the multiprocessors the dispatcher leaves them: DeepSeek's, whose
# framework sets "the ratio of GPU SMs dedicated to communication versus computation" for each overlapped pair
# (DeepSeek-V3's report, arXiv 2412.19437, section 3.2.1), its GEMMs DeepGEMM's with a target (`set_num_sms`,
# "the maximum SM count for all GEMM kernels to use"). TransformerEngine's are given none (`sharing_dispatcher`).
SM_TARGET_RECIPES = frozenset({"deepseek"})


def check_dispatcher_sms(held: int, multiprocessors: int) -> None:
    """EstimateError where the dispatcher's kernels hold every multiprocessor of the part (`sharing_dispatcher`)."""
    if held >= multiprocessors:
        raise EstimateError(f"dispatcher_sms: {held} of the part's {multiprocessors} multiprocessors leaves none to "
                            "compute on; give fewer")


def sharing_dispatcher(device: Device, parallel: Parallelism) -> Device | None:
    """`device` as a pass computing beside the dispatcher's kernels sees it, DeepEP's or HybridEP's
    (`--dispatcher-sms`) or NCCL's all-to-all's, each holding its multiprocessors until its data has moved; None
    without expert parallelism. Its kernels run on the multiprocessors they leave (`on_multiprocessors`), products
    in waves among them; but where products run persistent CTAs (`Curve.persistent_products`: Hopper) a product
    is launched on every multiprocessor, as TransformerEngine launches its GEMMs in Megatron-core's pair (cuBLAS
    gets an SM target, `CUBLASLT_MATMUL_DESC_SM_COUNT_TARGET`, only from `NVTE_EXT_MARGIN_SM`, which no recipe
    sets: pytorch/csrc/extensions/gemm.cpp, cpp_extensions/gemm.py, common/gemm/cublaslt_gemm.cu at v2.12), and
    the CTAs that find theirs held start when the others free theirs: beside kernels that outlast it, twice its
    time (`Device.products_held_on`; sim/costs.py `product_delay`, the engine's rule for compute beside the
    pipeline's transfers), unless its recipe gives its products their multiprocessors (`SM_TARGET_RECIPES`).
    Only an overlapped pair computes beside them, for as long as they run (sim/costs.py
    `Costs.sharing_dispatcher_ms`): without the expert overlap the dispatch is a row the next pass waits for."""
    if parallel.expert == 1:
        return None
    held = NCCL_ALL_TO_ALL_MULTIPROCESSORS
    if parallel.token_dispatcher in FLEX_DISPATCHERS:
        held = (FLEX_DISPATCHER_MULTIPROCESSORS[parallel.token_dispatcher] if parallel.dispatcher_sms is None
                else parallel.dispatcher_sms)
    check_dispatcher_sms(held, device.curve.multiprocessors)
    left = on_multiprocessors(device, device.curve.multiprocessors - held)
    held_products = device.curve.persistent_products and parallel.fp8 not in SM_TARGET_RECIPES
    return replace(left, products_held_on=device) if held_products else left


def on_multiprocessors(device: Device, multiprocessors: int) -> Device:
    """`device` running a kernel on `multiprocessors` of its own: the peaks in that share, the tiles' waves over
    that many (`tile_fill`), its products too (given that many as their target, none is held)."""
    share = multiprocessors / device.curve.multiprocessors
    fp8, tf32 = device.fp8_peak_flops_per_ms, device.tf32_peak_flops_per_ms
    return replace(device, peak_flops_per_ms=device.peak_flops_per_ms * share,
                   fp8_peak_flops_per_ms=None if fp8 is None else fp8 * share,
                   tf32_peak_flops_per_ms=None if tf32 is None else tf32 * share,
                   curve=device.curve.model_copy(update={"multiprocessors": multiprocessors}), products_held_on=None)


def userbuffers_forward_ms(op: OpCount, device: Device, t: int, nbytes: int, link: EstimateLink,
                           sm_margin: bool = True, gathered_nbytes: int | None = None) -> float:
    """A row-parallel forward product (split on its contraction) with its reduce-scatter and the next product's
    all-gather (of an `nbytes` tensor over t sequence-parallel ranks) as TransformerEngine's userbuffers run them
    under Megatron-LM's --tp-comm-overlap (`--tp-runtime megatron --tp-overlap`). The reduce-scatter is the
    `pipeline` method (`CommOverlapBase::split_overlap_rs`): the product in `TE_PIPELINE_SPLITS` splits of its
    rows, each split's reduce-scatter (1/splits of the tensor) beside the next split, the last one's after it,
    exposed. With `sm_margin` (`set_sm_margin`, which NeMo's userbuffers configs set for this method) each split
    runs on the multiprocessors the communication kernels leave it and the reduce-scatter hides under it up to
    its length; without (TransformerEngine 1.x's default, `initialize_ub`, which a run without a config gets) each
    split runs on every multiprocessor beside the reduce-scatter, exposed as `bulk_exposed_ms` says. The
    all-gather into the next column-parallel product is `ring_exchange_ms`, of `gathered_nbytes` (None: `nbytes`;
    under float8 the input's float8 copy, `estimate_layer`)."""
    batch, m, n, k = op.shape
    splits = TE_PIPELINE_SPLITS
    split = _scaled(op, (batch, max(m // splits, 1), n, k), splits)
    scatter_ms = reduce_scatter_ms(nbytes / splits, t, link.latency_ms, link.bytes_per_ms)
    if sm_margin:
        split_ms = op_ms(split, on_multiprocessors(device, device.curve.multiprocessors -
                                                   TE_PIPELINE_MULTIPROCESSORS))
        beside_ms = max(scatter_ms - split_ms, 0.0)
    else:
        split_ms = op_ms(split, device)
        beside_ms = bulk_exposed_ms(scatter_ms, split_ms, device)
    reduce_scattered = splits * split_ms + (splits - 1) * beside_ms + scatter_ms
    gathered = nbytes if gathered_nbytes is None else gathered_nbytes
    return reduce_scattered + ring_exchange_ms(op, device, t, gathered, link)


def userbuffers_backward_ms(op: OpCount, device: Device, t: int, nbytes: int, link: EstimateLink,
                            gathered_nbytes: int | None = None) -> float:
    """A column-parallel input-gradient product (split on its contraction in the backward) with its reduce-scatter
    and the all-gather of the output gradient the next row-parallel input gradient reads, as TransformerEngine's
    userbuffers run them in NeMo's configs (nemo/collections/llm/recipes/tp_overlap_configs/userbuffers.py: the
    qkv_wgrad and fc1_wgrad `bulk` overlaps without set_sm_margin, proj_dgrad and fc2_dgrad `ring_exchange`).
    The product runs whole; its reduce-scatter is a bulk overlap under the weight-gradient product (of the same
    m·n·k, taken as this one's time), exposed as `bulk_exposed_ms` says; the all-gather is the ring exchange
    `ring_exchange_ms` prices, of `gathered_nbytes` (None: `nbytes`; under float8 the gradient's float8 copy)."""
    product_ms = op_ms(op, device)
    scatter_ms = reduce_scatter_ms(nbytes, t, link.latency_ms, link.bytes_per_ms)
    gathered = nbytes if gathered_nbytes is None else gathered_nbytes
    return product_ms + bulk_exposed_ms(scatter_ms, product_ms, device) + ring_exchange_ms(op, device, t, gathered,
                                                                                            link)


def bulk_exposed_ms(collective_ms: float, product_ms: float, device: Device) -> float:
    """What a collective kernel launched beside a product leaves exposed, where the product runs on every
    multiprocessor: TransformerEngine's `bulk` overlaps (`CommOverlapBase::bulk_overlap`: the communication kernel
    on num_sm multiprocessors first, then the product on `_math_sms`, all of them without `set_sm_margin`, which
    every bulk overlap of NeMo's configs leaves 0 and TransformerEngine 1.x defaults to) and Megatron-core's
    asynchronous all-gather before the input-gradient product. On a part whose products run persistent CTAs, one
    per multiprocessor with a fixed share of the tiles (`Curve.persistent_products`: Hopper; CUTLASS's sm90
    `StaticPersistentTileScheduler`, and TransformerEngine orders the two launches because "Hopper ... uses
    persistent CTA execution", comm_gemm_overlap.cpp), the CTAs whose multiprocessors the collective holds start
    when it ends and still run their whole share: the product ends the collective's time late, all of it exposed
    (on an H100, a GEMM of 132 CTAs beside NCCL's 24-CTA all-gather nearly doubled: NVIDIA developer forums, topic
    337991). Elsewhere the product's waves take up the held multiprocessors' work and only what outlasts the
    product is exposed; the waves' share of the SMs the collective holds meanwhile is not charged (docs/hardware.md,
    "Beside a transfer before Hopper")."""
    if device.curve.persistent_products:
        return collective_ms
    return max(collective_ms - product_ms, 0.0)


def persistent_product_ms(layer: LayerCount, device: Device, parallel: Parallelism, element_bytes: int,
                          float8: Float8Forms | None = None, passes: Sequence[str] = ("fwd", "bwd")) -> float:
    """How long one of the layer's products of `passes` (its forward and backward) runs on one of its t·C ranks
    where products run persistent CTAs (`Curve.persistent_products`; else 0): their times' mean weighted by their
    times, the product a pipeline transfer's kernel launched at a random moment of the passes meets, which it delays
    by at most that (sim/costs.py `Costs.transfers_hold_products`). Each product alone, without the collectives
    priced with it. `float8`: the estimate's layers as its recipe runs them (`Float8Forms`), else built here."""
    if not device.curve.persistent_products:
        return 0.0
    layer = (float8 or parallel.float8_forms(element_bytes)).of(layer)
    split = _Split.of(layer, parallel)
    total_ms = squared_ms = 0.0
    for name in passes:
        for op in layer.ops.get(name, ()):
            if op.kind != "matmul":
                continue
            for mine, _, share in split.products(op, name):
                ms = op_ms(mine, device)
                total_ms += op.count * share * ms
                squared_ms += op.count * share * ms * ms
    return squared_ms / total_ms if total_ms else 0.0


def ring_exchange_ms(op: OpCount, device: Device, t: int, nbytes: int, link: EstimateLink) -> float:
    """What an all-gather of an `nbytes` tensor over t ranks adds to the product that reads it, run as
    TransformerEngine's `ring_exchange` (copy engines, no multiprocessors held; `CommOverlapP2PBase`): the product
    in t chunks, each of the t-1 transfers under one, only what outlasts its chunk exposed, and what chunking
    costs the product. The product is taken as `op`'s size (a GPT block's products on either side are as large
    or larger)."""
    batch, m, n, k = op.shape
    chunk_ms = op_ms(_scaled(op, (batch, max(m // t, 1), n, k), t), device)
    step_ms = link.latency_ms + nbytes / t / link.bytes_per_ms
    return t * chunk_ms - op_ms(op, device) + (t - 1) * max(step_ms - chunk_ms, 0.0)


def overlapped_ms(op: OpCount, device: Device, t: int, nbytes: int, link: EstimateLink) -> float:
    """A product split on its contraction, on one of t sequence-parallel ranks, with its reduce-scatter and the
    next product's all-gather (of an `nbytes` tensor) overlapped as torch's async TP runs them (`--tp-runtime
    torch`; torch/distributed/_symmetric_memory/__init__.py: `_pipelined_all_gather_and_consume`,
    `_pipelined_produce_and_all2all`; Megatron-LM's --tp-comm-overlap: `userbuffers_forward_ms`,
    `userbuffers_backward_ms`): the product in t chunks of
    1/t of its rows, the local chunk first; each collective's t-1 transfers of 1/t of the tensor (a step of
    `reduce_scatter_ms`) go one under each other chunk, and only what outlasts its chunk is exposed. The
    all-gather hides under the next column-parallel product's chunks, taken as this one's (a GPT block's QKV and
    first MLP products are as large or larger). The chunks' own kernels and tile fill are priced."""
    batch, m, n, k = op.shape
    chunk_ms = op_ms(_scaled(op, (batch, max(m // t, 1), n, k), t), device)
    step_ms = link.latency_ms + nbytes / t / link.bytes_per_ms
    return t * chunk_ms + 2 * (t - 1) * max(step_ms - chunk_ms, 0.0)


def async_tp_ms(op: OpCount, device: Device, t: int, nbytes: int, link: EstimateLink, summed: bool = False) -> float:
    """`overlapped_ms` as torch's async TP ends it (`--tp-runtime torch`): `_fused_matmul_reduce_scatter_impl`
    (torch/distributed/_symmetric_memory/__init__.py) has each rank's t chunks written into the owners' stacked
    partials (the whole `nbytes` output, t pieces of 1/t) and only then sums them in one reduction kernel, reading
    all of it and writing the rank's 1/t, after the last chunk: exposed, at the memory bandwidth.
    Inductor's micro-pipeline TP pass makes that fused product only of a reduce-scatter whose input a matmul writes
    (torch 2.13, torch/_inductor/fx_passes/micro_pipeline_tp.py: `fuse_matmul_reduce_scatter` gives up where
    `_find_producer_matmul` finds none): a `summed` gradient, the add of separate products' (a Hugging Face q, k
    and v, which autograd sums into their one input's, `_Reduction`), is reduce-scattered by NCCL after `op`'s
    products run whole, exposed. The all-gather still hides under the matmuls that read it
    (`fuse_all_gather_matmul` takes every one `_find_consumer_matmuls` finds, all of them in each chunk):
    `ring_exchange_ms`."""
    if summed:
        return (op_ms(op, device) + reduce_scatter_ms(nbytes, t, link.latency_ms, link.bytes_per_ms)
                + ring_exchange_ms(op, device, t, nbytes, link))
    batch, m, n, _ = op.shape
    reduction = OpCount("sum", "memory", (batch, max(m // t, 1), n), 0, nbytes + nbytes // t, 1)
    return overlapped_ms(op, device, t, nbytes, link) + op_ms(reduction, device)


def input_gather_ms(nbytes: int, product_ms: float, t: int, link: EstimateLink, device: Device) -> float:
    """What stays exposed of the backward's all-gather of a column-parallel product's input (`nbytes`, gathered
    over t sequence-parallel ranks): sequence parallelism saves each rank's 1/t of the input and gathers it again
    for the weight gradient (Korthikanti et al. 2022, arXiv 2205.05198, section 4.2.2), the backward's fifth and
    sixth collectives of a layer. Megatron-core launches it before the input-gradient product and waits for it
    after (`LinearWithGradAccumulationAndAsyncCommunication.backward`, async_op=True, with
    CUDA_DEVICE_MAX_CONNECTIONS=1 so it starts first), as TransformerEngine's `_Linear` backward does (its
    userbuffers run it as the bulk overlap `ub_bulk_dgrad`): exposed as `bulk_exposed_ms` says beside that
    `product_ms`.
    Under float8 it gathers the float8 copy TransformerEngine's forward saved (`ln_out` or `inputmat`, gathered
    in float8 and transposed for the float8 weight-gradient product), 1 byte an element.
    torch's tensor parallelism gathers nothing here: its DTensor redistribute hands the gathered input to the
    product, whose autograd keeps it whole for the weight gradient (`--tp-runtime torch`)."""
    return bulk_exposed_ms(all_gather_ms(nbytes, t, link.latency_ms, link.bytes_per_ms), product_ms, device)


def gathered_gradient_element_bytes(layer: LayerCount, parallel: Parallelism, element_bytes: int) -> int:
    """An element of a row-parallel product's output gradient as sequence parallelism gathers it (`_rank_pass`):
    float8 where the runtime casts it before it gathers, TransformerEngine's recipes (`gathers_float8`:
    `grad_output_preprocess`) and torchao's under DTensor (torchao/float8/float8_tensor_parallel.py at eab345c,
    `Float8RowwiseParallel._prepare_output_fn`: `NoopFwToFloat8BwDynamic` after the redistribute, so the backward
    casts the rank's 1/t first and the redistribute's backward gathers the float8 copy), in a float8 layer."""
    casts_first = parallel.fp8 is not None and (FP8_RECIPES[parallel.fp8].gathers_float8
                                                or parallel.tp_runtime == "torch")
    return FP8_BYTES if casts_first and layer.transformer_layer else element_bytes


def scores_buffer_bytes(layer: LayerCount, parallel: Parallelism) -> int:
    """What `layer` has one rank keep for the whole run under `Parallelism.scores_buffer` (0 without it):
    Megatron-LM's unfused attention as its CoreAttention runs it (megatron/model/transformer.py, and
    megatron/core/transformer/dot_product_attention.py, at the zero-bubble fork's 425b42e5) asks its global memory
    buffer (megatron/core/utils.py `GlobalMemoryBuffer.get_tensor`: one tensor per name and dtype, the largest asked
    for, kept in parallel_state.py's `_GLOBAL_MEMORY_BUFFER` and never freed) for a tensor the size of its scores,
    b x a/t x s x s in the queries' dtype, and hands it to torch.baddbmm with beta 0: an input only, so the scores
    are still made each forward (the count's) and the buffer is held beside them for the whole run, one a process
    (sim/costs.py `StageCosts.runtime_buffer_bytes`): the layer's `LayerCount.scores_bytes` on one of t ranks.
    Megatron-LM at de7dc40f88 (2021) made that input with torch.empty each forward, a transient: not this."""
    return layer.scores_bytes // parallel.tensor if parallel.scores_buffer else 0


def gathered_saves(layer: LayerCount, parallel: Parallelism) -> tuple[tuple[int, int], ...]:
    """The saved tensors of `layer` a rank holds whole, not 1/t (`LayerCount.sequence_inputs`: index in
    saved_tensors, number in allocations["fwd"]): under torch's tensor parallelism with sequence parallelism, each
    column-parallel product's input, which DTensor gathers from the tokens' shards (torch/distributed/tensor/
    parallel/style.py at 2.6: ColwiseParallel and PrepareModuleInput redistribute the Shard(1) input to Replicate;
    torchao float8_tensor_parallel.py at eab345c, `PrepareFloat8ModuleInput`, casts it to float8 first, as the
    recipe's saved copy is, planning/fp8.py) and hands to the product, whose autograd saves it whole for the weight
    gradient: the attention's and the MLP's inputs, and the head's (torchtitan 9dec370's plan: `output`
    ColwiseParallel with input_layouts Shard(1)). None under Megatron's runtime, whose products save the rank's
    1/t and gather it again in the backward (`input_gather_ms`; Korthikanti et al. 2022, section 4.2.2)."""
    if not (parallel.sequence_parallel and parallel.tp_runtime == "torch" and parallel.tensor > 1):
        return ()
    return layer.sequence_inputs


def float8_weights_on_rank(layer: LayerCount, parallel: Parallelism, split: _Split | None = None
                           ) -> tuple[float, int]:
    """Of `layer`'s float8 linears' weights (`float8_weights`), the elements one of the t ranks holds, 1/t of each
    but a latent product's (torch's MLA down-projections, `_weight_splits`; "replicated" in `_Split.roles` beside a
    column-parallel product, as no router is a float8 linear), whole, and how many tensors. `split`: the layer's, where
    made (else made here)."""
    recipe = parallel.float8_recipe
    elements, tensors = float8_weights(layer, recipe)
    t = parallel.tensor
    if t == 1 or parallel.tp_runtime != "torch":
        return elements / t, tensors
    roles = (split or _Split.of(layer, parallel)).roles.get("fwd", {})
    whole = sum(op.count * op.shape[0] * op.shape[2] * op.shape[3] * sum(how in ("latent", "replicated")
                                                                         for how, *_ in of_shape)
                / len(of_shape) for op in float8_products(layer, recipe) if (of_shape := roles.get(op.shape)))
    return (elements - whole) / t + whole, tensors


def _float8_shards(layers: Sequence[LayerCount], parallel: Parallelism) -> tuple[float, int]:
    """Of `layers`' float8 linears' weights, the elements of this rank's shard under FSDP2 (its tensor-parallel
    share, `float8_weights_on_rank`, of which 1/(d·C)) and how many tensors."""
    counted = [float8_weights_on_rank(layer, parallel) for layer in layers]
    elements, tensors = sum(found[0] for found in counted), sum(found[1] for found in counted)
    return elements / (parallel.data * parallel.context), tensors


def shard_cast_ms(layers: Sequence[LayerCount], parallel: Parallelism, device: Device) -> float:
    """FSDP2's float8 all-gather's casts before each all-gather of `layers`' weights: each float8 linear's
    float32 shard on this rank cast with its precomputed scale by `SHARD_CAST_KERNELS` (planning/fp8.py)."""
    shard, tensors = _float8_shards(layers, parallel)
    return sum(tensors * device.curve.kernel_overhead_ms + shard * (read + written) / device.memory_bytes_per_ms
               for read, written in SHARD_CAST_KERNELS)


def scale_precompute_ms(layers: Sequence[LayerCount], parallel: Parallelism, device: Device,
                        link: EstimateLink) -> float:
    """torchao's `precompute_float8_dynamic_scale_for_fsdp` after a stage's optimizer step under FSDP2's float8
    all-gather (torchtitan runs it per model part): one `_foreach_norm` over the float8 linears' float32 shards,
    `SCALE_PRECOMPUTE_KERNELS` small kernels, and one all-reduce of their float32 amaxes over the d·C ranks
    sharing the shards (DTensor's, on the compute stream); 0 without it or float8 linears."""
    if not parallel.fsdp_float8_all_gather:
        return 0.0
    shard, tensors = _float8_shards(layers, parallel)
    if not tensors:
        return 0.0
    return ((1 + SCALE_PRECOMPUTE_KERNELS) * device.curve.kernel_overhead_ms
            + shard * PRECISIONS["fsdp2"].stored_bytes / device.memory_bytes_per_ms
            + all_reduce_ms(tensors * FP8_SCALE_BYTES, parallel.data * parallel.context, link.latency_ms,
                            link.bytes_per_ms))


def gathered_transposes_ms(elements: int, t: int, device: Device, norm_share: float = 0.0) -> float:
    """The float8 transposes TransformerEngine 1.x makes after a sequence-parallel gather, for a backward's
    column-parallel input gradient of `elements` (its whole, gathered tokens x width): its weight gradient's input
    (LayerNormLinear.backward: `ln_out_total_t = tex.fp8_transpose(ln_out_total)`) and the output gradient the
    row-parallel product before it gathered (`grad_output_preprocess`, "FP8 case with gather: unfused bgrad, cast,
    transpose for efficient gather": cast_to_fp8 on the rank's share, the gather, then `tex.fp8_transpose` of the
    gathered tensor; with userbuffers the same after the dgrad product). Each reads and writes the gathered float8
    tensor, where the recipe's fused cast-transpose (`cast_ops`) wrote a transpose of the rank's 1/t share only:
    that share is taken off here. Of the inputs, the `norm_share` a norm wrote in float8 (planning/fp8.py
    `gathered_norm_share`) have the rank's share transposed by a kernel of the layer's own already
    (`norms_in_float8`): its read and write, and that kernel, are taken off instead."""
    share = elements // t
    moved = (2 * (2 * elements - share) - norm_share * share) * FP8_BYTES
    return (2 - norm_share) * device.curve.kernel_overhead_ms + moved / device.memory_bytes_per_ms


def _pass_ms(ops: tuple[OpCount, ...], split: _Split, device: Device,
             reduced_ms: Callable[[_Reduction, float], float], name: str, only_core: bool = False,
             ring: ContextRing | None = None, element_bytes: int = 2) -> tuple[tuple[OpCount, float], ...]:
    """Pass `name`'s ops on one of the t·C ranks, each with its time (all its `count` calls): split
    (`_Split.products`), a product split on its contraction with its collective (`reduced_ms` of its reduction
    and the reduced product's time), an attention kernel as the context ring's blocks, their merges and copies
    (its exchanges are the ring's row: `_ring_of`); in the pass's order, the ops `only_core` leaves out left out."""
    timed = []
    for op in ops:
        if op.kind in ("matmul", "attention"):
            core = op.kind == "attention" or (op.shape[0] > 1 and not op.routed)  # a routed product runs once
            if only_core and not core:
                continue
            if op.kind == "attention":
                mine = split.attention(op)
                spent = op_ms(mine, device) if ring is None else (ring.attention_ms(mine, device) + ring.merge_ms(
                    mine, device, element_bytes) + ring.copies_ms(mine, device, element_bytes))
                timed.append((op, op.count * spent))
                continue
            spent = 0.0
            for mine, reduction, share in split.products(op, name):
                product_ms = op_ms(mine, device)
                spent += share * (product_ms if reduction is None else reduction.ms(product_ms, device, reduced_ms))
            timed.append((op, op.count * spent))
        elif not only_core or split.core(op.shape):
            mine = split.memory(op) if op.kind == "memory" else _scaled(op, op.shape, split.t)
            timed.append((op, op.count * op_ms(split.context_share(mine), device)))
    return tuple(timed)


def _ring_of(ops: Sequence[OpCount], split: _Split, ring: ContextRing, device: Device,
             element_bytes: int) -> RingExchange:
    """The ring's exchanges of a pass's attention calls, each on one of the t·C ranks (`_Split.attention`)."""
    total = RingExchange()
    for op in ops:
        if op.kind == "attention":
            mine = split.attention(op)
            link_ms, hidden_ms = ring.exchange_ms(mine, device, element_bytes)
            total += RingExchange(op.count * link_ms, op.count * hidden_ms, ring.buffer_bytes(mine, element_bytes))
    return total


def _head_exchanges(layer: LayerCount, split: _Split, ring: ContextRing, element_bytes: int,
                    second_only: bool = False) -> RingExchange:
    """A pass's all-to-alls around `layer`'s Gated DeltaNet mixers over the C context-parallel ranks
    (`LayerCount.context_exchanges`: Megatron-core's trade of the sequence's split for one of the heads, and back;
    the backward's of their gradients), none hidden: they run on the compute stream, the conv waiting for the first
    and out_proj for the second. Each sends the other C - 1 ranks their heads of the rank's tokens: (C - 1)/C of the
    rank's 1/t of the channels (tensor parallelism splits the heads first) at 1/C of the tokens. `second_only`: the
    normed value's back alone."""
    c = ring.ranks
    share = split.tokens / c * (c - 1) / c / split.t * element_bytes
    return RingExchange(sum(ring.transfer_ms(round(width * share)) for widths in layer.context_exchanges
                            for width in (widths[1:] if second_only else widths)))


def accumulating(op: OpCount, grad_bytes: int, element_bytes: int) -> OpCount:
    """A product `op`, counted writing its output at `element_bytes` an element, adding it instead into a tensor of
    `grad_bytes` an element: cuBLASLt's D = A·B + beta·C with beta 1 and C = D, whose epilogue reads each element of
    C and writes it back after the main loop of its tile, so those bytes come on top of the product's time
    (`matmul_ms`), not under its FLOPs. The H200 probe (traces/measured/gpu-probe-h200-dense.json, `python
    benchmarks/probe_dense.py`): BF16 weight gradients added into float32 (torch.addmm, cuBLAS's `badd` kernels) ran
    18-20 % slower than the same products writing BF16, their 8 bytes an element at 2.8-3.3 TB/s on top of the
    FLOPs, priced so at 0.95-0.98 of measured (under the FLOPs, 0.81-0.83); float8 products writing float32
    without reading it ran 3-5 % slower, its store overlapping the main loop as a 16-bit output's does."""
    batch, m, n, _ = op.shape
    return replace(op, moved_bytes=op.moved_bytes - batch * m * n * element_bytes, accumulates_into=grad_bytes)


def accumulated_in_products(layer: LayerCount, grad_bytes: int, element_bytes: int) -> LayerCount:
    """`layer` with its weight gradients accumulated inside their products (`--grad-accumulation fused`): each
    weight-gradient product (the matmuls of its wgrad pass, and as many calls of the same in its full backward)
    adds its output into the accumulated gradient, `grad_bytes` an element, where the count's writes it at
    `element_bytes` (`accumulating`). TransformerEngine hands `main_grad` to the GEMM as its output with accumulate
    on (linear.py, layernorm_linear.py and grouped_linear.py `fuse_wgrad_accumulation`: `general_gemm`/
    `general_grouped_gemm` with `accumulate=True`, out=main_grad; cuBLASLt's D = A·B + C with C = D, cublaslt_gemm.cu
    at v2.2 to v2.9; in 1.10, 08a85d3, its float8 weight gradient alike: linear.py's `fp8_gemm(...,
    accumulate=accumulate_wgrad_into_param_main_grad, out=weight.main_grad)`, beta 1 and C = D whatever the
    inputs' type in cublaslt_gemm.cu `cublas_gemm`), so the product's epilogue reads and writes `grad_bytes` an
    element of the gradient (float32 main_grad under Megatron-core's default, the parameters' dtype under
    `grad_reduce_in_fp32` False). It weighs most where the tokens a product contracts over are few beside its
    weight: a rank's routed experts each see tokens·k/E of them (FLOPs per gradient element 2·K, bytes
    2·grad_bytes)."""
    accumulated = partial(accumulating, grad_bytes=grad_bytes, element_bytes=element_bytes)
    products = [op for op in layer.ops.get("wgrad", ()) if op.kind == "matmul"]
    if not products:
        return layer
    backward: list[OpCount] = []
    for op in layer.ops.get("bwd", ()):
        match = next((p for p in products if replace(p, count=op.count) == op), None)
        if match is None:
            backward.append(op)
            continue
        products.remove(match)
        backward.append(accumulated(replace(op, count=match.count)))
        if op.count > match.count:  # an input-gradient product of the same shape
            backward.append(replace(op, count=op.count - match.count))
    wgrad = tuple(accumulated(op) if op.kind == "matmul" else op for op in layer.ops.get("wgrad", ()))
    return replace(layer, ops={**layer.ops, "bwd": tuple(backward), "wgrad": wgrad})


def unfused_weight_share(layer: LayerCount, element_bytes: int) -> float:
    """Of `layer`'s weights (by bytes), the share whose gradients no weight-gradient product accumulates under
    `--grad-accumulation fused` (`accumulated_in_products`): the weights no product reads (an embedding table, a
    norm's scale, a bias), whose gradient autograd hands over whole, so the runtime adds it into the accumulated
    one in a pass of its own every backward: Megatron-core's DDP hook (`param.main_grad.add_(param.grad.data)`
    where `grad_added_to_main_grad` is unset, megatron/core/distributed/distributed_data_parallel.py
    `_make_backward_post_hook` at core_v0.9.0) and NeMo's distributed Adam, Apex's DistributedFusedAdam
    (`_grad_copy`: `grad_out.add_(grad_in)` into its gradient bucket, apex/contrib/optimizers/
    distributed_fused_adam.py at f9f19d5c). A product's weights are its (n, k), each routed expert's (batch) too;
    `element_bytes`: the count's. A layer without products (an embedding): all of it."""
    if not layer.param_bytes:
        return 0.0
    in_products = sum(batch * n * k for (batch, _, n, k), _, _ in layer.weight_grad_outputs) * element_bytes
    return max(0.0, 1.0 - in_products / layer.param_bytes)


def replicated_share(layer: LayerCount, element_bytes: int, runtime: str) -> float:
    """Of `layer`'s weights (by bytes), the share tensor parallelism keeps whole on every rank, not 1/t, its gradient
    and optimizer state too (Megatron-core's distributed optimizer shards them over the data-parallel ranks only);
    `element_bytes`: the count's. Its router's (`_weight_splits`' "replicated") and its norms' (`LayerCount.
    norm_param_bytes`): Megatron-core's norms are no tensor-parallel layers, each rank holds the whole scale (and
    shift), as TransformerEngine's LayerNormLinear holds its `layer_norm_weight` (megatron/core/fusions/
    fused_layer_norm.py `FusedLayerNorm`, megatron/core/extensions/transformer_engine.py `TENorm` at core_v0.14.0;
    transformer_engine/pytorch/module/layernorm_linear.py at d0067d0d), as torchtitan's plan, whose norms are
    `SequenceParallel()`, keeps their weights Replicate ("unsharded@TP": torchtitan/models/common/
    decoder_sharding.py `norm_config` at b5bcd76c66). Its row-parallel products' biases (`_row_bias_bytes`) and its
    learned position embedding (`LayerCount.position_embedding_bytes`) too: Megatron-core's LanguageModelEmbedding
    holds it as a plain Embedding, not a vocabulary-parallel one. Under torch's `runtime` its latent
    down-projections' too (MLA's, `_weight_splits`), NoParallel in torchtitan's plan."""
    if not layer.param_bytes:
        return 0.0
    whole = list(layer.weight_grad_router) or [False] * len(layer.weight_grad_outputs)  # (): a layer without routers
    if runtime == "torch" and layer.forward_reads:
        shape = _stream_shape(layer)
        splits = _weight_splits(layer, weighted_products(layer, {}, "fwd"), math.prod(shape[:-1]) if shape else 0,
                                shape[-1] if shape else 0, runtime)
        whole = [router or splits.get(j) == "latent" for j, router in enumerate(whole)]
    products = sum(n * k for ((_, _, n, k), _, _), kept in zip(layer.weight_grad_outputs, whole) if kept)
    return (products * element_bytes + layer.norm_param_bytes + _row_bias_bytes(layer)
            + layer.position_embedding_bytes) / layer.param_bytes


def _row_bias_bytes(layer: LayerCount, splits: Mapping[int, str] | None = None) -> int:
    """The bytes of `layer`'s row-parallel products' biases (`_biases`, of `splits`), whole on every rank."""
    return sum(nbytes for nbytes, row in _biases(layer, splits) if row)


def _biases(layer: LayerCount, splits: Mapping[int, str] | None = None) -> list[tuple[int, bool]]:
    """Per product's bias (`LayerCount.weight_grad_bias_bytes`, none where 0), its bytes and whether its product is
    row-parallel (`_weight_splits`: the attention's output projection's, the MLP's down projection's), whole on every
    rank: Megatron-core's RowParallelLinear adds its whole bias after the reduction (megatron/core/tensor_parallel/
    layers.py `RowParallelLinear.__init__` at core_v0.14.0: `self.bias` of `output_size`, its `sequence_parallel`
    attribute set), as torch's RowwiseParallel replicates it (torch/distributed/tensor/parallel/style.py
    `_partition_linear_fn`); a column-parallel product's split with it. `splits`: `_weight_splits`' where found
    (`_Split.weights`), else found here."""
    if not any(layer.weight_grad_bias_bytes):
        return []
    if splits is None:
        shape = _stream_shape(layer)
        splits = _weight_splits(layer, weighted_products(layer, {}, "fwd"), math.prod(shape[:-1]) if shape else 0,
                                shape[-1] if shape else 0, "megatron")  # its rows are either runtime's
    return [(nbytes, splits.get(j) == "row") for j, nbytes in enumerate(layer.weight_grad_bias_bytes) if nbytes]


def _replicated_gradients(layer: LayerCount, name: str, weights: frozenset[int],
                          splits: Mapping[int, str]) -> frozenset[int]:
    """Of the parameters' gradients pass `name` leaves (`weights`, `_weight_gradients`), those of the weights tensor
    parallelism keeps whole on every rank (`replicated_share`), which a rank makes whole: its norms'
    (`LayerCount.norm_param_bytes`), its row-parallel products' biases (`_biases`) and its learned position embedding
    (`LayerCount.position_embedding_bytes`); its router's, a product's, by its role (`_Split.replicated_whole`). The
    count does not link a storage to its parameter, so they are told by their bytes, which is all a replay reads: the
    position embedding's, a storage of its bytes that is no vector; the norms' and row biases', the vectors (one
    dimension above 1) no product makes, once each column-parallel bias has taken one of its bytes, where they add up
    to those weights' bytes (else none: the count's storages are not told apart). `splits`: the layer's products'
    (`_Split.weights`)."""
    made = {number: (shape, nbytes) for number, shape, nbytes, _ in layer.allocations.get(name, ())
            if nbytes > 0 and number in weights}
    products = weighted_products(layer, {}, name)
    vectors = sorted((nbytes, number) for number, (shape, nbytes) in made.items()
                     if sum(size > 1 for size in shape) <= 1 and number not in products)
    for nbytes, row in _biases(layer, splits):
        taken = next((vector for vector in vectors if vector[0] == nbytes), None) if not row else None
        if taken is not None:
            vectors.remove(taken)
    vector_bytes = layer.norm_param_bytes + _row_bias_bytes(layer, splits)
    whole = {number for _, number in vectors} if sum(nbytes for nbytes, _ in vectors) == vector_bytes else set()
    embedding = next((number for number, (shape, nbytes) in made.items()
                      if nbytes == layer.position_embedding_bytes and sum(size > 1 for size in shape) > 1), None)
    return frozenset(whole | ({embedding} if embedding is not None else set()))  # none where the layer has none


def rank_share(layer: LayerCount, share: float, parallel: Parallelism, element_bytes: int) -> float:
    """t times the share of `layer`'s weights one of the t ranks holds where it holds `share` of their t-th (of the
    routed experts' its 1/(E·ETP), `held_share`; of every weight under a sharded optimizer, whose shards are taken
    apart): its replicated weights whole, t - 1 more of them (`replicated_share`)."""
    t = parallel.tensor
    return share + (t - 1) * replicated_share(layer, element_bytes, parallel.tp_runtime) if t > 1 else share


def state_share(layer: LayerCount, parallel: Parallelism, weight_shards: int, element_bytes: int) -> float:
    """Of `layer`'s weights (by bytes), t times the share whose optimizer state and step one of the t ranks holds
    (`rank_share`): all of them where the optimizer is sharded (over the d replicas either way), else the share one
    of the E·ETP ranks holds (`held_share`)."""
    held = 1.0 if parallel.sharded_optimizer else held_share(layer, weight_shards)
    return rank_share(layer, held, parallel, element_bytes)


def replicated_reduce_ms(layers: Sequence[LayerCount], parallel: Parallelism, held: Precision, element_bytes: int,
                         link: EstimateLink) -> float:
    """The all-reduce over the t ranks of `layers`' replicated weights' gradients (`replicated_share`) once a step,
    before the optimizer's, under Megatron-core with sequence parallelism: each rank's router, norms and row-parallel
    biases saw only its own tokens, so their gradients are partial sums. The router's weight carries
    `sequence_parallel` (router.py `Router.__init__`), as the norms' (fused_layer_norm.py; TransformerEngine's
    LayerNorm, RMSNorm and LayerNormLinear's `layer_norm_weight`) and RowParallelLinear's bias do, and
    finalize_model_grads all-reduces every such parameter's main_grad over the tensor-parallel group, coalesced
    (megatron/core/distributed/finalize_model_grads.py at 7094270c6f, core_r0.12.0: `_allreduce_layernorm_grads`;
    at core_v0.14.0 `_allreduce_non_tensor_model_parallel_grads`).
    Without sequence parallelism each rank's router and norms saw every token, but its query's and key's norms
    (`LayerCount.qk_norm_param_bytes`) normalise its own heads only, so their gradients are partial sums too, which
    the same all-reduce takes under `qk_layernorm` (`"q_layernorm" in name or "k_layernorm" in name`; at
    core_r0.12.0 in `_allreduce_layernorm_grads` likewise): those alone. `held`: the precision whose gradient bytes
    it moves. 0 under torch: its `NoParallel` router reads the gathered input, and its sequence-parallel norms'
    partial gradients are left to FSDP's reduction (torchtitan's `norm_config`, `replicated_share`)."""
    t = parallel.tensor
    if not (t > 1 and parallel.tp_runtime == "megatron"):
        return 0.0
    nbytes = held.gradient_bytes(round(sum(layer.grad_bytes * _partial_gradient_share(layer, parallel, element_bytes)
                                           for layer in layers)))
    return all_reduce_ms(nbytes, t, link.latency_ms, link.bytes_per_ms) if nbytes else 0.0


def _partial_gradient_share(layer: LayerCount, parallel: Parallelism, element_bytes: int) -> float:
    """Of `layer`'s weights (by bytes), the share whose gradients are partial sums on each of Megatron-core's t ranks
    (`replicated_reduce_ms`): under sequence parallelism every replicated weight's but the learned position
    embedding's, a plain Embedding without `sequence_parallel` that adds to every token before the embedding's
    scatter, so each rank's gradient is whole (megatron/core/models/common/embeddings/language_model_embedding.py
    `LanguageModelEmbedding` at core_v0.14.0); else its query's and key's norms'."""
    if parallel.sequence_parallel:
        positions = layer.position_embedding_bytes / layer.param_bytes if layer.param_bytes else 0.0
        return replicated_share(layer, element_bytes, parallel.tp_runtime) - positions
    return layer.qk_norm_param_bytes / layer.param_bytes if layer.param_bytes else 0.0


def estimate_layer(layer: LayerCount, device: Device, parallel: Parallelism, tensor_link: EstimateLink,
                   element_bytes: int, context_link: EstimateLink | None = None,
                   float8: Float8Forms | None = None, grad_bytes: int | None = None) -> LayerEstimate:
    """`layer` priced on one of the t·C ranks of its stage (see the module docstring); `context_link`: the
    context-parallel ring's, where C > 1; `float8`: the estimate's layers as its recipe runs them (`Float8Forms`),
    else built here; `grad_bytes`: an element of the gradients its weight-gradient products accumulate into
    (`accumulated_in_products`; None: accumulated by a pass of their own, not in the products)."""
    t, c = parallel.tensor, parallel.context
    if c > 1 and context_link is None:
        raise EstimateError(f"context: {c} ranks need the ring's link")
    ring = ContextRing(c, context_link, parallel.cp_rotate) if c > 1 else None
    layer = (float8 or parallel.float8_forms(element_bytes)).of(layer, ring)
    if grad_bytes is not None:
        layer = accumulated_in_products(layer, grad_bytes, element_bytes)
    split = _Split.of(layer, parallel)
    # TransformerEngine's recipes (`gathers_float8`) cast before they gather: a column-parallel
    # product's input is cast (LayerNormLinear's fused norm writes float8 into the userbuffer, `fp8_buf` for every
    # all-gather overlap in initialize_ub; gather_along_first_dim of the float8 `ln_out` without one) and that copy
    # saved and gathered again in the backward, and the backward's output gradient is cast before its gather
    # (`grad_output_preprocess`): every sequence-parallel all-gather of a float8 layer moves 1 byte an element
    gathered_bytes = FP8_BYTES if parallel.fp8 is not None and FP8_RECIPES[parallel.fp8].gathers_float8 \
        and layer.transformer_layer else element_bytes
    norm_share = gathered_norm_share(layer, FP8_RECIPES[parallel.fp8]) \
        if parallel.sequence_parallel and gathered_bytes == FP8_BYTES else 0.0

    def reduced_ms(reduction: _Reduction, product_ms: float, forward: bool) -> float:
        op = reduction.op
        batch, m, n, _ = op.shape
        nbytes, gathered = batch * m * n * element_bytes, batch * m * n * gathered_bytes
        if reduction.collective == "gather" and parallel.tp_overlap:  # hidden as async TP hides one (`async_tp_ms`)
            return product_ms + ring_exchange_ms(op, device, t, gathered, tensor_link)
        if reduction.collective == "gather":
            return product_ms + all_gather_ms(gathered, t, tensor_link.latency_ms, tensor_link.bytes_per_ms)
        if reduction.collective == "all-reduce":  # no reduce-scatter for async TP to fuse: exposed
            return product_ms + all_reduce_ms(nbytes, t, tensor_link.latency_ms, tensor_link.bytes_per_ms)
        regathers = parallel.sequence_parallel and parallel.tp_runtime == "megatron" and not forward
        gather_ms = input_gather_ms(gathered, product_ms, t, tensor_link, device) if regathers else 0.0
        if regathers and gathered_bytes == FP8_BYTES:
            gather_ms += gathered_transposes_ms(batch * m * n, t, device, norm_share)
        if parallel.tp_overlap and parallel.tp_runtime == "torch":
            return async_tp_ms(op, device, t, nbytes, tensor_link, reduction.summed) + gather_ms
        if parallel.tp_overlap and forward:
            # with `fp8_buf` (a userbuffers config's, proj_fprop and fc2_fprop) the product writes its float8 output
            # into the userbuffer and the reduce-scatter sums float8 into 16 bits (TransformerEngine 1.10's
            # _Linear forward, `is_fp8_ubuf`; comm_gemm_overlap.h, `reducescatter2_userbuff_stridedoutput_fp8`)
            scattered = gathered if parallel.tp_overlap_fp8_buf else nbytes
            return userbuffers_forward_ms(op, device, t, scattered, tensor_link,
                                          sm_margin=not parallel.tp_overlap_no_margin,
                                          gathered_nbytes=gathered) + gather_ms
        if parallel.tp_overlap:
            return userbuffers_backward_ms(op, device, t, nbytes, tensor_link, gathered_nbytes=gathered) + gather_ms
        if parallel.sequence_parallel:
            return product_ms + reduce_scatter_ms(nbytes, t, tensor_link.latency_ms, tensor_link.bytes_per_ms) \
                + all_gather_ms(gathered, t, tensor_link.latency_ms, tensor_link.bytes_per_ms) + gather_ms
        return product_ms + all_reduce_ms(nbytes, t, tensor_link.latency_ms, tensor_link.bytes_per_ms)

    def pass_ops(ops: Sequence[OpCount], name: str, only_core: bool = False) -> tuple[tuple[OpCount, float], ...]:
        forward = name == "fwd"
        return _pass_ms(tuple(ops), split, device, lambda reduction, fused_ms: reduced_ms(reduction, fused_ms, forward),
                        name, only_core, ring, element_bytes)

    timed = {name: pass_ops(layer.ops.get(name, ()), name) for name in ("fwd", "bwd", "igrad", "wgrad")}
    saved = layer.saved_bytes
    rest_share = _rest_share(parallel)
    # Per part (what saved it; a count from before parts were recorded: all other), the bytes kept on one rank:
    # a core tensor (split by t) 1/t of itself, unless selective recomputation drops it; a product's input DTensor
    # gathered whole (`gathered_saves`) whole; the rest its share.
    parts = dict.fromkeys(SAVED_PARTS, 0.0)
    named = layer.saved_parts or ("other",) * len(layer.saved_tensors)
    regions = Regions.of(layer, parallel.recomputed_regions)
    whole = {i for i, _ in gathered_saves(layer, parallel)} | _latent_saves(layer, split)
    rerun_bytes = 0.0  # what the backward makes again of the saved tensors below
    region_rerun: list[tuple[int, float]] = []  # of it, a recomputed region's: (index in saved_tensors, bytes)
    for i, ((shape, nbytes), part) in enumerate(zip(layer.saved_tensors, named)):
        core = split.core(shape)
        kept_bytes = nbytes / t if core else nbytes if i in whole else nbytes * rest_share
        selective = core and parallel.recompute == "selective"  # made again by selective recomputation
        if selective or i in regions.dropped:
            rerun_bytes += kept_bytes
            if not selective:
                region_rerun.append((i, kept_bytes))
        else:
            parts[part] += kept_bytes
    parts["other"] += (saved - sum(nbytes for _, nbytes in layer.saved_tensors)) * rest_share  # a count lists all
    parts["other"] += sum(nbytes for _, _, nbytes in regions.inputs) * rest_share
    saved_unless_rerun = sum(parts.values()) + rerun_bytes
    rerun: list[tuple[tuple[OpCount, float], ...]] = []  # what the backward reruns of the forward, timed, by part
    rerun_ops: Sequence[OpCount] = ()  # what the backward recomputes of the forward
    transformer = layer.transformer_layer
    if parallel.recompute == "op" and transformer:
        kept_parts, rerun_ops = _op_policy(layer.ops.get("fwd", ()), element_bytes)
        parts = {**dict.fromkeys(SAVED_PARTS, 0.0), **kept_parts}
        if parallel.torch_compile:  # what AOTAutograd's partitioner saves of it (`_unread_kept`; t = 1 here)
            unread = _unread_kept(layer)
            parts["other"] -= sum(nbytes for number, _, nbytes, _ in layer.allocations.get("fwd", ())
                                  if number in unread and nbytes > 0)
        parts["other"] += split.tokens * split.width * element_bytes  # the layer's input
        rerun = [pass_ops(rerun_ops, "fwd")]
    elif parallel.recompute == "selective":
        rerun_ops = [op for op in layer.ops.get("fwd", ()) if op.kind == "attention"]  # the core it reruns has them
        rerun = [pass_ops(layer.ops.get("fwd", ()), "fwd", only_core=True)]
    elif parallel.recompute == "full" and transformer:
        inputs = split.tokens * split.width * element_bytes
        parts = {**dict.fromkeys(SAVED_PARTS, 0.0), "other": inputs / t if parallel.sequence_parallel else inputs}
        rerun_ops = layer.ops.get("fwd", ())
        rerun = [timed["fwd"]]
        timed["fwd"] = tuple(entry for entry in timed["fwd"] if entry[0].op not in GRAD_ONLY_KERNELS)
    if regions.ops:
        rerun.append(pass_ops(regions.first, "fwd"))
        rerun_ops = (*rerun_ops, *regions.ops)
    at_experts = pass_ops(regions.at_experts, "fwd")  # rerun where the backward reaches the experts' down product
    parts = {name: value / c for name, value in parts.items()}  # every saved tensor holds the rank's tokens only
    # a recipe's saved float8 weight copies (planning/fp8.py), not the tokens': made again where the forward reruns
    weight_copies = saved_weight_bytes(parallel.float8_recipe, *float8_weights_on_rank(layer, parallel, split)) \
        if parallel.fp8 is not None else 0.0
    parts["other"] += 0.0 if parallel.recompute in ("op", "full") else weight_copies
    kept = sum(parts.values())
    total = round(min(kept, saved / c + weight_copies) if parallel.recompute in ("selective", "full")
                  else kept)  # op's: its own
    exchanged = RingExchange() if ring is None else _head_exchanges(layer, split, ring, element_bytes)
    # the exchanges the backward runs again: the whole forward's under full recomputation, the second's (the normed
    # value's, inside Megatron-core's `_gated_norm_and_a2a`) where gdn_norm_out reruns the gated norm
    rerun_exchanged = exchanged if parallel.recompute == "full" and transformer else (
        _head_exchanges(layer, split, ring, element_bytes, second_only=True)
        if ring is not None and "gdn_norm_out" in parallel.recompute_modules else RingExchange())
    rings = (None, None) if ring is None else (
        _ring_of(layer.ops.get("fwd", ()), split, ring, device, element_bytes) + exchanged,
        _ring_of((*rerun_ops, *layer.ops.get("bwd", ())), split, ring, device, element_bytes) + exchanged
        + rerun_exchanged)
    times = {name: sum(ms for _, ms in ops) for name, ops in timed.items()}
    rerun_ms = sum(sum(ms for _, ms in part) for part in (*rerun, at_experts))  # part by part, each its own sum
    rerun_timed = tuple(timed_op for part in rerun for timed_op in part)
    timed = {"fwd": timed["fwd"], "bwd": rerun_timed + _rerun_at_experts(timed["bwd"], at_experts),
             "igrad": rerun_timed + _rerun_at_experts(timed["igrad"], at_experts), "wgrad": timed["wgrad"]}
    return LayerEstimate(times["fwd"], times["bwd"] + rerun_ms, times["igrad"] + rerun_ms, times["wgrad"], total,
                         whole_parts(parts, total),
                         _transient_bytes(layer, split, saved_unless_rerun / c + weight_copies - total,
                                          gathered_gradient_element_bytes(layer, parallel, element_bytes),
                                          tuple((i, nbytes / c) for i, nbytes in region_rerun)
                                          if parallel.recompute in ("none", "selective") else (),
                                          parallel.recomputed_regions),
                         *rings, *wgrad_kept(layer, split, rest_share), timed, ring)


def _rest_share(parallel: Parallelism) -> float:
    """Of a tensor neither the attention core's nor gathered whole, the share one of the t ranks holds."""
    t = parallel.tensor
    return 1 / t if parallel.sequence_parallel else REPLICATED_SHARE + (1 - REPLICATED_SHARE) / t


def wgrad_kept(layer: LayerCount, split: _Split, rest_share: float) -> tuple[int | None, int]:
    """What Megatron-LM's deferred weight pass keeps of `layer` on one of its stage's t·C ranks, from the end of the
    input pass (B) until it runs (W): each product's saved input and its output gradient, which the zero-bubble fork's B
    puts in `WeightGradStore` and its W reads (megatron/core/tensor_parallel/layers.py,
    `LinearWithGradAccumulationAndAsyncCommunication.backward`, sail-sg/zero-bubble-pipeline-parallelism at 425b42e5;
    under sequence parallelism as the fork rebased in August 2024 has it (47d9a8ed, read at 3664da69), keeping the input
    as saved and gathering it again in W: 425b42e5 kept the gathered `total_input`, the shared "mpu" buffer that the
    next product's gather overwrites):
    (the inputs, None where the count does not mark them; the output gradients). An input on the rank as its activations
    are (a core tensor 1/t, any other its share); an output gradient as the product runs on the rank: a column-parallel
    product's 1/t, a row-parallel one's whole (its output reduced after it; under sequence parallelism its gradient
    all-gathered into it), products that read one input column-parallel (Megatron-core fuses them: q, k and v its
    linear_qkv, a gated MLP's gate and up its linear_fc1), any other as `_Split.matmul` splits it; both 1/C. Whatever
    the recomputation: a recomputed layer's products save their inputs again in B, which puts them in the store as the
    forward's would have been. Not a mixture of experts' gating products (`LayerCount.weight_grad_router`): the
    router's weight is a plain Parameter its `gating` multiplies by torch.nn.functional.linear (megatron/core/
    transformer/moe/router.py at 7094270c6f; core_v0.14.0's RouterGatingLinearFunction makes its weight gradient in
    its own backward), not through that store, so autograd makes its weight gradient in B, which frees what it read
    then: its output gradient, and its input where nothing else saves it (`LayerCount.router_input_saves`)."""
    inputs, gradients = wgrad_kept_tensors(layer, split, rest_share)
    return (None if inputs is None else round(sum(inputs) / split.context)), round(sum(gradients) / split.context)


def wgrad_kept_tensors(layer: LayerCount, split: _Split, rest_share: float
                       ) -> tuple[tuple[float, ...] | None, tuple[float, ...]]:
    """`wgrad_kept`'s tensors one by one, their bytes on one of the t ranks (1/C of each on one of the t·C): the
    products' saved inputs (None where the count does not mark them), then their output gradients."""
    if not layer.linear_input_saves:
        return None, ()
    inputs = tuple(nbytes / split.t if split.core(shape) else nbytes * rest_share
                   for shape, nbytes in map(layer.saved_tensors.__getitem__, _deferred_saves(layer)))
    gradients = []
    for (shape, nbytes, shares_input), router in zip(layer.weight_grad_outputs, _gating(layer), strict=True):
        if router:
            continue
        batch, m, n, _ = split.matmul(OpCount("mm", "matmul", shape, 0, 0, 1), forward=True)[0].shape
        gradients.append(nbytes / split.t if shares_input
                         else nbytes * (batch * m * n) / (shape[0] * shape[1] * shape[2]))
    return inputs, tuple(gradients)


def _gating(layer: LayerCount) -> tuple[bool, ...]:
    """Per product of `layer.weight_grad_outputs`, whether it is a gating product (`LayerCount.weight_grad_router`)."""
    return layer.weight_grad_router or (False,) * len(layer.weight_grad_outputs)


def _routed(layer: LayerCount) -> tuple[bool, ...]:
    """Per product of `layer.weight_grad_outputs`, whether it is a routed expert's (`LayerCount.weight_grad_routed`)."""
    return layer.weight_grad_routed or (False,) * len(layer.weight_grad_outputs)


def _deferred_saves(layer: LayerCount) -> list[int]:
    """The indices in `layer.saved_tensors` of the products' inputs a deferred weight pass keeps (`wgrad_kept`)."""
    routers = set(layer.router_input_saves)
    return [i for i, how in enumerate(layer.linear_input_saves) if how and i not in routers]


def _rerun_at_experts(ops: tuple[tuple[OpCount, float], ...], rerun: tuple[tuple[OpCount, float], ...]
                      ) -> tuple[tuple[OpCount, float], ...]:
    """A backward pass's timed `ops` with the regions' rerun there (`rerun`: `Regions.at_experts`, timed) before
    its first routed product, the experts' down product's gradient, where Megatron-core's checkpoint reruns them
    (`RERUN_AT_EXPERTS`); first where it has none."""
    at = next((i for i, (op, _) in enumerate(ops) if op.routed and op.kind == "matmul"), 0)
    return (*ops[:at], *rerun, *ops[at:])


# The regions whose output-discarding checkpoint Megatron-core hangs on the routed experts' down product's output,
# so that the backward reruns them when it reaches that product, not at the layer's start as the others:
# TEGroupedMLP's "moe_act" (`self.activation_checkpoint.discard_output_and_register_recompute(output)` after
# linear_fc2, megatron/core/transformer/moe/experts.py at 0d8e0714cd, b0cc2706 and core_v0.17.0)
RERUN_AT_EXPERTS = ("moe_act",)


@dataclass(frozen=True)
class Regions:
    """What recomputing a layer's regions (profiles/workload.py `RECOMPUTE_REGIONS`, `--recompute-modules`) does, as
    Megatron-core's output-discarding checkpoints run it (CheckpointWithoutOutput, megatron/core/tensor_parallel/
    random.py): the saved tensors the regions created are dropped after the forward and made again before the
    backward needs them, from what the regions read, which is kept (the checkpoint's inputs); a region's input
    that another recomputed region made is made again too. `dropped`: indices in the layer's saved_tensors;
    `inputs`: (number in allocations["fwd"], negative: made before the layer; shape; bytes) of those kept that
    nothing saved; `first`: the forward's ops the backward reruns at its start, `at_experts` those it reruns at the
    routed experts' down product (`RERUN_AT_EXPERTS`); `made`: the allocations they make again."""

    dropped: frozenset[int] = frozenset()
    inputs: tuple[tuple[int, tuple[int, ...], int], ...] = ()
    first: tuple[OpCount, ...] = ()
    made: frozenset[int] = frozenset()
    at_experts: tuple[OpCount, ...] = ()

    @property
    def ops(self) -> tuple[OpCount, ...]:
        """The forward's ops the backward reruns."""
        return (*self.first, *self.at_experts)

    @classmethod
    def of(cls, layer: LayerCount, modules: Sequence[str]) -> Regions:
        run = [name for name in modules if name in layer.region_saves]
        inputs = {number: (number, shape, nbytes) for name in run
                  for number, shape, nbytes, made_by, saved in layer.region_inputs.get(name, ())
                  if saved < 0 and not set(made_by) & set(run)}
        return cls(frozenset(i for name in run for i in layer.region_saves[name]), tuple(inputs.values()),
                   tuple(op for name in run if name not in RERUN_AT_EXPERTS for op in layer.region_ops.get(name, ())),
                   frozenset(n for name in run for n in layer.region_allocations.get(name, ())),
                   tuple(op for name in run if name in RERUN_AT_EXPERTS for op in layer.region_ops.get(name, ())))


def _transient_bytes(layer: LayerCount, split: _Split, recomputed: float, gradient_element_bytes: int,
                     region_rerun: Sequence[tuple[int, float]] = (), recomputed_regions: Sequence[str] = ()
                     ) -> dict[str, int]:
    """Per pass, the bytes of the transient tensors at the pass's peak on one of the t·C ranks: under tensor or
    context parallelism the peak of the pass's allocations as the rank makes them (`_rank_pass` with
    `gradient_element_bytes`: a residual-stream tensor whole without sequence parallelism, as Megatron-LM keeps it,
    any other 1/t, a head's, an MLP's or the vocabulary's share; under sequence parallelism what a product holds
    whole; each 1/C but a parameter's gradient), which need not be the tensors live at the count's peak (the head's
    input gradient, whole before its reduction, outweighs its vocabulary-split logits' gradients at t ranks), else
    the count's; and in the input-gradient and full backward the `recomputed` bytes, which the backward recreates
    before it frees them (Korthikanti et al. 2022, section 4: full recomputation holds one layer's activations during
    its backward), for the whole pass; but a recomputed region's saved tensors of them, `region_rerun` ((index in
    `saved_tensors`, bytes on the rank)), where the count says when the pass reads them (`LayerCount.saved_reads`),
    only from the backward's entry into the submodule a region of `recomputed_regions` that made them runs in
    (`LayerCount.saved_region_entries`: the earliest of those regions', not of a region that made them and is
    kept) until the node that last reads them ends: the module's input-gradient pass reaches its decoder layer's
    norms after its head's cross entropy, whose gradients are freed by then."""
    def peak(name: str, placed: Sequence[tuple[int, int, float]]) -> float:
        if not placed and ((split.t == 1 and split.context == 1) or not layer.allocations.get(name)):
            return sum(_on_rank(shape, nbytes, split) for shape, nbytes in layer.transient_tensors.get(name, ()))
        events = _rank_pass(layer, split, name, gradient_element_bytes)
        if placed:  # positions among the count's events, mapped into the rank's, which adds collectives' storages
            counted = 1 + max(number for number, *_ in layer.allocations[name])
            at = [i for i, (number, _) in enumerate(events) if number < counted] + [len(events)]
            events = _with_placed(events, [(at[start], at[end], nbytes) for start, end, nbytes in placed])
        made: dict[int, int] = {}
        for number, nbytes in events:
            made.setdefault(number, nbytes)
        return sum(made[number] for number in transient_peak(events, beside_kept=name == "fwd"))

    transient = {}
    for name in PASSES:
        reads = layer.saved_reads.get(name, ()) if layer.allocations.get(name) else ()
        entries = layer.saved_region_entries.get(name, ()) or ({},) * len(reads)  # per region that made it
        placed = [(min([first, *(entries[i].get(kind, first) for kind in recomputed_regions)]), end, nbytes)
                  for i, nbytes in region_rerun if i < len(reads) for first, end in (reads[i],) if first >= 0]
        whole = max(recomputed - sum(nbytes for *_, nbytes in placed), 0.0) if name in ("bwd", "igrad") else 0.0
        transient[name] = round(peak(name, placed) + whole)
    return transient


def _with_placed(events: Sequence[tuple[int, int]], placed: Sequence[tuple[int, int, float]]
                 ) -> list[tuple[int, int]]:
    """A pass's `events` ((number, bytes) in order) with the tensors `placed` ((made before event, freed before
    event, bytes)) made and freed among them, numbered after its own; at one position a free before a make."""
    unmade = 1 + max((number for number, _ in events), default=-1)
    inserted = sorted((at, made, unmade + k, round(nbytes) if made else -round(nbytes))
                      for k, (start, end, nbytes) in enumerate(placed) for at, made in ((start, 1), (end, 0)))
    merged: list[tuple[int, int]] = []
    taken = 0  # of `events`, those merged
    for at, _, number, nbytes in inserted:
        merged.extend(events[taken:at])
        taken = max(taken, at)
        merged.append((number, nbytes))
    return merged + list(events[taken:])


def _rank_pass(layer: LayerCount, split: _Split, name: str,
               gradient_element_bytes: int) -> tuple[tuple[int, int], ...]:
    """Pass `name`'s allocations (`LayerCount.allocations`, as (number, bytes)) as one of the t·C ranks makes them:
    each `_on_rank`, and under sequence parallelism what a tensor-parallel product holds whole while it runs, 1/C
    (Korthikanti et al. 2022, section 4.2.2, Figure 6's g and its conjugate), each product told by its role
    (`weighted_products`), not its shape:
    - a product split on its contraction writes its partial sums whole, tokens x width, before their
      reduce-scatter: in the forward a row-parallel product's output (Megatron-core's RowParallelLinear, then
      `reduce_scatter_to_sequence_parallel_region`; torch's RowwiseParallel, its Partial output redistributed to
      Shard(1); async TP's `stacked_partials`, `_fused_matmul_reduce_scatter_impl` in torch/distributed/
      _symmetric_memory/__init__.py at 2.6), in the backward a column-parallel product's input gradient (megatron/
      core/tensor_parallel/layers.py at core_v0.9.0, `LinearWithGradAccumulationAndAsyncCommunication.backward`:
      `grad_input = grad_output.matmul(weight)`, then `reduce_scatter_tensor` into `sub_grad_input`; DTensor's
      gradient of the Replicate input it gathered, Partial, redistributed to Shard(1)); of the column-parallel
      products that share an input, under Megatron-core the first the pass runs only, their fused product's
      (`_Reduction`), under torch's each, and autograd's running sums of them, Partial too, full size on each rank
      (DTensor's Partial gradients, summed out of place, a tensor subclass's: torch/csrc/autograd/input_buffer.cpp
      `accumulate`, before their one reduce-scatter);
    - a row-parallel product's output gradient arrives split by tokens and is gathered whole,
      `gradient_element_bytes` an element, before the first of its gradient products the pass runs and freed after
      the last (`_ReduceScatterToSequenceParallelRegion.backward`: `_gather_along_first_dim`, a torch.empty of its
      own, megatron/core/tensor_parallel/mappings.py at core_v0.9.0; DTensor's backward of Partial to Shard(1)).
    Without the count's products, or without sequence parallelism, `_on_rank`'s alone, but for what a replicated
    weight's product writes (`_Split.replicated_whole`), a replicated weight's gradient (`_replicated_gradients`),
    the forward's storages beside torch's latent products (`_Split.latent_storages`) and the input gradients of the
    products that read them (`_Split.latent_readers`); a parameter's gradient whole on each of the C ranks
    (`_weight_gradients`)."""
    events = layer.allocations.get(name, ())
    roles = weighted_products(layer, split.weights, name) if split.weights else {}
    weights = _weight_gradients(layer, name)
    replicated = _replicated_gradients(layer, name, weights, split.weights) if split.t > 1 else frozenset()
    latent = split.latent_storages if name == "fwd" else frozenset()
    if split.latent_readers:  # an up-projection's input gradient, a Partial of the whole latent
        latent |= {number for number, (j, _, role) in roles.items() if j in split.latent_readers and role == "input"}
    rank = [(number, round(_on_rank(shape, nbytes, split, replicated=number in replicated or number in latent
                                    or split.replicated_whole(roles.get(number)), weight=number in weights)))
            for number, shape, nbytes, _ in events]
    if not (split.sequence_parallel and split.t > 1 and layer.product_allocations.get(name)):
        return tuple(rank)
    whole = {number for number, shape, nbytes, _ in events if nbytes > 0 and number in roles
             and split.residual(shape) and roles[number][1:] in _CONTRACTED}
    partial: set[int] = set()
    if split.runtime == "megatron":  # products that share an input: one fused product's partial sums (`_Reduction`)
        shared: dict[tuple[int, ...], list[int]] = {}
        for number, (j, _, role) in roles.items():
            if number in whole and role == "input":
                shared.setdefault(split.groups.get(j, (j,)), []).append(number)
        whole -= {number for numbers in shared.values() for number in numbers[1:]}
    else:  # autograd's sums of Partial gradients, made while one is live: Partial, whole too
        partial = {number for number in whole
                   if roles[number][2] == "input" and len(split.groups.get(roles[number][0], ())) > 1}
        live: set[int] = set()
        for number, shape, nbytes, _ in events:
            if number in partial:
                (live.add if nbytes > 0 else live.discard)(number)
            elif live and nbytes > 0 and number not in roles and split.residual(shape):
                whole.add(number)
    gather = round(split.tokens * split.width * gradient_element_bytes / split.context)
    runs: dict[int, list[int]] = {}  # a row-parallel product's gradient products in the pass, in order
    for number, (j, parallel, role) in roles.items():
        if parallel == "row" and role != "output":
            runs.setdefault(j, []).append(number)
    gathered = {numbers[0]: numbers[-1] for numbers in runs.values()}  # a row-parallel product's first -> last
    unmade = 1 + max(number for number, *_ in events)  # a gathered gradient's number
    out: list[tuple[int, int]] = []
    frees: dict[int, int] = {}  # a product's number -> the gathered gradient freed after it
    for (number, _, nbytes, _), (_, on_rank) in zip(events, rank):
        if nbytes > 0 and number in gathered:
            out.append((unmade, gather))
            frees[gathered[number]] = unmade
            unmade += 1
        out.append((number, round(nbytes / split.context) if number in whole else on_rank))
        if nbytes > 0 and number in frees:
            out.append((frees[number], -gather))
    sums = whole - roles.keys()
    scattered = _reduce_scattered(out, whole, partial, sums)
    copied = {"product": scattered - sums, "sum": scattered & sums}
    held: dict[int, int] = {}  # Megatron-core's input gradient -> its product's weight gradient, made after it
    if split.runtime == "megatron":
        awaiting: dict[int, int] = {}  # a product's index -> its reduce-scattered input gradient
        for number in dict.fromkeys(number for number, _ in out):  # each storage's allocation, in order
            j, _, role = roles.get(number, (-1, "", ""))
            if role == "input" and number in scattered:
                awaiting[j] = number
            elif role == "weight" and j in awaiting:
                held[awaiting.pop(j)] = number
    return _with_collective_copies(out, split.t, set(frees.values()) if "gather" in split.collective_copies else set(),
                                   scattered, {number for kind in split.collective_copies
                                               for number in copied.get(kind, ())}, sums, held)


def _reduce_scattered(events: Sequence[tuple[int, int]], whole: Set[int], partials: Set[int],
                      sums: Set[int]) -> set[int]:
    """Of the `whole` storages of a rank's pass (`events`), the partial sums a reduce-scatter reads: a row-parallel
    product's output, a column-parallel product's input gradient where no other product reads its input, and the
    last of autograd's `sums` of the Partial gradients of those that share one (`partials`): DTensor
    reduce-scatters the sum, not the gradients it sums nor a sum another is made from (one made while it is
    live)."""
    live: set[int] = set()
    superseded: set[int] = set()
    for number, nbytes in events:
        if number in sums and nbytes > 0:
            superseded |= live
            live.add(number)
        elif number in sums:
            live.discard(number)
    return set(whole) - set(partials) - superseded


def _with_collective_copies(events: Sequence[tuple[int, int]], tensor: int, gathered: Set[int],
                            scattered: Set[int] = frozenset(), concatenated: Set[int] = frozenset(),
                            sums: Set[int] = frozenset(), held: Mapping[int, int] | None = None
                            ) -> tuple[tuple[int, int], ...]:
    """A rank's pass (`events`) with what each sequence-parallel collective allocates beside its whole tensor, each
    a storage numbered after the pass's. Under torch's TP (`Parallelism.collective_copies`) an all-gather's output
    on the first dimension before each `gathered` storage (the concatenation on the sequence), made and freed once
    it is. Each `scattered` storage (partial sums) has its reduce-scatter's output, 1/`tensor` of it, made while
    it lives, and freed at once (the count's storage, held whole, stands for it after) or, where `held` names the
    storage, after that allocation of the pass: every runtime allocates the output before the collective reads its
    input (torch/csrc/distributed/c10d/Functional.cpp's `reduce_scatter_tensor_coalesced`,
    `allocate_reduce_scatter_output`; Megatron-core's `_reduce_scatter_along_first_dim`, a torch.empty of 1/t
    before `_reduce_scatter_base`, and `LinearWithGradAccumulationAndAsyncCommunication.backward`'s
    `sub_grad_input`, live with `grad_input` through the weight-gradient product, megatron/core/tensor_parallel/
    mappings.py and layers.py at core_v0.9.0; async TP's `_fused_matmul_reduce_scatter_impl`, whose reduction of
    `stacked_partials` writes the output, torch/distributed/_symmetric_memory/__init__.py at 2.6). Of those, each
    `concatenated` has before its output the concatenation on the first dimension that funcol's reduce-scatter
    reads, the whole tensor's bytes, freed after the output is made. Of autograd's `sums` of Partial gradients,
    the reduce-scatter waits for the frees that follow the sum, before the pass's next allocation:
    torch/csrc/autograd/input_buffer.cpp's `accumulate` replaces the buffer's gradient with the sum (`buffer[pos]
    = old_var + var`, a tensor subclass's out of place) and drops the one it added, their last uses, before the
    next node, the redistribution's backward, runs its reduce-scatter."""
    out: list[tuple[int, int]] = []
    copy = 1 + max((number for number, _ in events), default=-1)
    waiting: tuple[int, int] | None = None  # a sum (number, bytes) whose reduce-scatter waits for an allocation
    lingering: dict[int, tuple[int, int]] = {}  # an allocation of the pass -> an output freed after it

    def reduce_scatter(number: int, nbytes: int) -> list[tuple[int, int]]:
        nonlocal copy
        made = [(copy, nbytes)] if number in concatenated else []
        output = (copy + len(made), round(nbytes / tensor))
        copy = output[0] + 1
        freed = [(made_number, -made_bytes) for made_number, made_bytes in made]
        if held and number in held:
            lingering[held[number]] = output
            return [*made, output, *freed]
        return [*made, output, *freed, (output[0], -output[1])]

    for number, nbytes in events:
        if nbytes > 0 and waiting is not None:
            out += reduce_scatter(*waiting)
            waiting = None
        if nbytes > 0 and number in gathered:
            out += [(copy, nbytes), (number, nbytes), (copy, -nbytes)]
            copy += 1
            continue
        out.append((number, nbytes))
        if nbytes > 0 and number in scattered and number in sums:
            waiting = (number, nbytes)
        elif nbytes > 0 and number in scattered:
            out += reduce_scatter(number, nbytes)
        if number in lingering:
            output, output_bytes = lingering.pop(number)
            out.append((output, -output_bytes))
    return tuple(out + (reduce_scatter(*waiting) if waiting is not None else []))


def _weight_splits(layer: LayerCount, forward: dict[int, tuple[int, str, str]], tokens: int,
                   width: int, runtime: str) -> dict[int, str]:
    """How tensor parallelism splits each product with weights (`LayerCount.weight_grad_outputs`, by index; the routed
    experts' aside; `forward`: the forward's, `weighted_products` with no splits), told by its role in the count, not
    its shape: "replicated", not split, a mixture of experts' router (`LayerCount.weight_grad_router`): Megatron-core's
    Router holds its weight, experts x hidden, whole on every rank, a plain Parameter, not a tensor-parallel linear, and
    its gating product reads the rank's own tokens and reduces no gradient (megatron/core/transformer/moe/router.py at
    7094270c6f, core_r0.12.0, the DGX Cloud rows' pin, and at core_v0.14.0: `Router.__init__`, `gating`), as
    torchtitan's `NoParallel` router (`_Split._replicated_at`), and as its SharedExpertMLP holds its `gate_weight`, 1 x
    hidden, on the rank's tokens too (shared_experts.py at core_v0.14.0; Qwen2-MoE's `shared_expert_gate`, which
    transformers' TP plan leaves unsplit), which the count marks with it; "column" where it shares its input (q, k and
    v, a gated MLP's gate and up) or reads one sequence parallelism gathers (`LayerCount.sequence_inputs`: a norm's
    output, the layer's input); "row" where it writes the residual stream's (tokens x width) otherwise (wo, w2); the
    rest none. Telling them by shape alone misreads a Hugging Face model's separate q, k, v and o projections, which are
    all width x width, and its router, which reads a float32 copy of the norm's output. "latent" under torch's
    (`runtime`), MLA's down-projections (`_latent_products`): torchtitan's plan leaves wq_a and wkv_a `NoParallel`,
    whole on every rank on the gathered input, and splits wq_b and wkv_b column-wise (torchtitan/models/deepseek_v3/
    infra/parallelize.py `apply_non_moe_tp` at 018740b7), as transformers' DeepSeek-V3 TP plan names q_b_proj and
    kv_b_proj alone (`_Split.products`); Megatron-core's are column-parallel (`_input_groups`). Empty where the count
    does not record its products' storages."""
    outputs = layer.weight_grad_outputs
    routed, router = _routed(layer), _gating(layer)
    reads = dict(layer.forward_reads)
    sequence = {number for _, number in layer.sequence_inputs}
    weights: dict[int, str] = {}
    for number, (j, _, _) in forward.items():
        shape, _, shares_input = outputs[j]
        read = reads.get(number, ())
        if routed[j]:
            continue
        if router[j]:
            weights[j] = "replicated"
        elif shares_input or sequence.intersection(read) or (-1 in sequence and not read):
            weights[j] = "column"
        elif shape[1:3] == (tokens, width):
            weights[j] = "row"
    if runtime == "torch":
        weights |= dict.fromkeys(_latent_products(layer, forward, weights), "latent")
    return weights


def _latent_products(layer: LayerCount, forward: dict[int, tuple[int, str, str]],
                     weights: dict[int, str]) -> list[int]:
    """The products with weights (`LayerCount.weight_grad_outputs`, by index; `forward`: the forward's, as
    `_weight_splits` takes them) that share their input with others and whose output reaches the input of a
    column-parallel product (`weights`) of MLA's up-projection region (`LayerCount.region_allocations`' "mla_up_proj":
    q_b_proj, kv_b_proj, and the norms before them unless kept apart) through ops other than products: MLA's
    down-projections, whose
    outputs the norms and the up-projections read (the latent). Not a Gated DeltaNet's in_proj_qkvz and in_proj_ba,
    whose outputs reach out_proj through its gated norm: Megatron-core fuses them into one in_proj (megatron/core/
    ssm/gated_delta_net.py), one reduction. None for a count without its reads or regions."""
    outputs = layer.weight_grad_outputs
    reads = dict(layer.forward_reads)
    products = forward if reads else {}
    made_from: dict[int, list[int]] = {}  # a storage -> those made from it, a product's output made by no other
    for number, read in reads.items():
        for source in read if number not in products else ():
            made_from.setdefault(source, []).append(number)
    up_projection = set(layer.region_allocations.get("mla_up_proj", ()))
    column_inputs = {source for number, (j, _, _) in products.items()
                     if weights.get(j) == "column" and number in up_projection for source in reads.get(number, ())}

    def feeds_a_column_product(number: int) -> bool:
        seen, todo = {number}, [number]
        while todo:
            storage = todo.pop()
            if storage in column_inputs:
                return True
            todo.extend(made for made in made_from.get(storage, ()) if made not in seen)
            seen.update(made_from.get(storage, ()))
        return False

    return [j for number, (j, _, _) in products.items() if outputs[j][2] and feeds_a_column_product(number)]


def _latent_storages(layer: LayerCount, forward: dict[int, tuple[int, str, str]], latent: list[int]) -> frozenset[int]:
    """The forward's storages (numbers in `allocations["fwd"]`) a rank holds whole beside torch's latent products
    (`_weight_splits`' "latent", by index; `forward`: the forward's products): their outputs, and what ops other
    than products make of those and of storages no product's output reaches (the rotary tables) alone: the norms'
    copies, statistics and outputs, the keys' rotary part; not what meets a split tensor (that part concatenated
    with wkv_b's heads), nor what a product makes (wq_b's, wkv_b's outputs, column-split)."""
    derived = set(forward)  # storages a product's output reaches through ops other than products
    whole = {number for number, (j, _, _) in forward.items() if j in latent}
    for number, read in sorted(layer.forward_reads):  # each after those it reads
        if number in forward or not derived.intersection(read):
            continue
        derived.add(number)
        if whole.intersection(read) and all(source in whole or source not in derived for source in read):
            whole.add(number)
    return frozenset(whole)


def _latent_saves(layer: LayerCount, split: _Split) -> set[int]:
    """The indices in `saved_tensors` of the latent storages (`_Split.latent_storages`) autograd saves
    (`LayerCount.saved_storages`; none for a count from before it was recorded, which is held 1/t: a host-cached
    count is made again by the code that records it, `count_sources`)."""
    return {i for i, number in enumerate(layer.saved_storages) if number in split.latent_storages}


def _input_groups(layer: LayerCount, forward: dict[int, tuple[int, str, str]], weights: dict[int, str],
                  runtime: str) -> dict[int, tuple[int, ...]]:
    """Per product with weights (`LayerCount.weight_grad_outputs`, by index; `forward`: the forward's, as
    `_weight_splits` takes them) that shares its input with others, the products whose input gradients one reduction
    sums, in the forward's order, told by what each forward product read (`LayerCount.forward_reads`; nothing made
    inside: the layer's input): under torch's (`runtime`) all that read it, one DTensor whose Partial gradients autograd
    sums (MLA's latent down-projections' group the gather alone, `_Split.products`); under Megatron-core's those it
    fuses into one ColumnParallelLinear (q, k and v, gate and up), not MLA's down-projections (`_latent_products`), a
    TEColumnParallelLinear each, linear_q_down_proj and linear_kv_down_proj, each reducing its own input gradient
    (megatron/core/models/gpt/gpt_layer_specs.py and megatron/core/transformer/multi_latent_attention.py at 7094270c6f,
    core_r0.12.0, NeMo 25.04's). Empty for a count without its reads."""
    outputs = layer.weight_grad_outputs
    reads = dict(layer.forward_reads)
    alone = _latent_products(layer, forward, weights) if runtime == "megatron" else []
    by_input: dict[tuple[int, ...], list[int]] = {}
    for number, (j, _, _) in forward.items() if reads else ():
        if outputs[j][2] and j not in alone:
            by_input.setdefault(reads.get(number, ()), []).append(j)
    return {j: (j,) for j in alone} | {j: tuple(group) for group in by_input.values() for j in group}


def _on_rank(shape: tuple[int, ...], nbytes: int, split: _Split, *, replicated: bool = False,
             weight: bool = False) -> float:
    """A tensor of the count's on one of the t·C ranks: a residual-stream tensor (tokens x width, not a `weight` of
    that shape) whole without sequence parallelism (as Megatron-LM keeps it), a `replicated` one
    (`_Split.replicated_whole`) whole, any other 1/t (a head's, an MLP's or the vocabulary's share); every one 1/C
    but a `weight` one (a parameter's gradient, `_weight_gradients`): context parallelism splits the tokens, and each
    of its C ranks holds the weights, their gradients and their optimizer state whole (Megatron-core's
    DistributedDataParallel reduces the gradients over the data- and context-parallel group together)."""
    whole = replicated or (not weight and split.residual(shape) and not split.sequence_parallel)
    return (nbytes if whole or split.t == 1 else nbytes / split.t) / (1 if weight else split.context)


def _weight_gradients(layer: LayerCount, name: str) -> frozenset[int]:
    """The storages pass `name` of `layer` leaves live that are its parameters' gradients (autograd's .grad): all
    the weight-gradient pass leaves, and of the full backward's all but its input gradients (as many of each shape
    and size as the input-gradient pass leaves live); none of another pass's."""
    if name not in ("bwd", "wgrad"):
        return frozenset()

    def left(pass_name: str) -> dict[int, tuple[tuple[int, ...], int]]:  # a storage -> its (shape, bytes)
        events = layer.allocations.get(pass_name, ())
        shapes = {number: shape for number, shape, _, _ in events}
        return {number: (shapes[number], nbytes)
                for number, nbytes in left_live([(number, nbytes) for number, _, nbytes, _ in events]).items()}

    inputs = list(left("igrad").values()) if name == "bwd" else []
    grads = set()
    for number, tensor in left(name).items():
        if tensor in inputs:
            inputs.remove(tensor)
        else:
            grads.add(number)
    return frozenset(grads)


def gathered_weight_bytes(layer: LayerCount, weight_bytes: int, parallel: Parallelism, element_bytes: int) -> int:
    """A layer's weights on a rank (`weight_bytes`) as they are all-gathered: with FSDP2's float8 all-gather its
    float8 linears' at 1 byte an element and a float32 scale each (torchao's fsdp_post_all_gather makes each a
    Float8Tensor over the gathered bytes); with TransformerEngine's float8 weights (`fp8_param_gather`: NeMo's
    `fp8_params`, TE's `fp8_model_init`; Megatron-core's `--fp8-param-gather`) at 1 byte an element and no scale,
    as NeMo's distributed Adam syncs them (nemo/core/optim/distributed_adam.py, `init_params_bucket`: a bucket of
    Float8Tensor weights takes `param_sync_dtype = torch.uint8`, and each rank casts its float32 shard to float8
    before the gather, `_check_params_shard_dtypes`; the scale-inverses come from the all-reduced amaxes, not the
    gather), and held so between steps (`init_param_buffer` makes each Float8Tensor's data a view into the
    optimizer's uint8 param buffer); the rest as the passes read them."""
    if not (parallel.fsdp_float8_all_gather or parallel.fp8_param_gather):
        return weight_bytes
    elements, tensors = float8_weights_on_rank(layer, parallel)
    scales = tensors * FP8_SCALE_BYTES if parallel.fsdp_float8_all_gather else 0
    return weight_bytes - int(elements) * (element_bytes - FP8_BYTES) + scales


def allocations_key(parallel: Parallelism) -> Parallelism:
    """What `layer_allocations` reads of `parallel`: all of it but the depth p, the rank order (where the ranks sit
    moves no tensor) and the replicas d but under FSDP2 (`_unsharded`'s shards), so that tune replays one list for
    every p, d and rank order of a t, b, E and recomputation."""
    return replace(parallel, pipeline=1, data=parallel.data if parallel.precision == "fsdp2" else 1,
                   rank_order="pipesim")


def layer_allocations(counted: WorkloadCount, parallel: Parallelism,
                      megatron_step: bool = False) -> list[LayerAllocations]:
    """Every counted layer's allocations on one of its stage's t·C ranks under `parallel`'s recomputation
    (`_rank_allocations`), in the model's order: what the caching allocator replays of a device's step, with
    FSDP2's whole weights and gradients per parameter (`_unsharded`), those of a layer other than a transformer
    layer its root's (`LayerAllocations.fsdp_root`), what a deferred weight pass keeps (`_wgrad_kept_storages`), and
    with `megatron_step`, what Megatron-LM's 16-bit optimizer makes of each parameter each step (`_stepped`),
    refused where the precision keeps no float32 master weights or the optimizer is sharded (its distributed
    optimizer, not replayed so). A layer alike one before it but for its name and inputs (a model's repeated
    blocks, or blocks of a few kinds in turn) shares that one's, made once (`_per_block`)."""
    held = parallel.held(counted.dtype)
    if megatron_step and not held.master_bytes:
        raise EstimateError(f"megatron is Megatron-LM's 16-bit optimizer, whose float32 master weights {{precision}} "
                            f"{parallel.precision or 'fp32'} does not keep; give 16-bit weights and {{precision}} "
                            "megatron, megatron-16bit-grads or megatron-bf16-moments")
    if megatron_step and parallel.sharded_optimizer:
        raise EstimateError("megatron is Megatron-LM's 16-bit optimizer unsharded; its distributed optimizer "
                            "({sharded_optimizer}) allocates otherwise and is not replayed so")
    element = _element_bytes(counted.dtype)
    forms = parallel.float8_forms(element)

    def allocations_of(layer: LayerCount) -> LayerAllocations:
        gathered = gathered_saves(layer, parallel)
        saved = forms.of(layer).saved_tensors if gathered else ()  # a gathered input as the recipe saves it
        split = _Split.of(layer, parallel)
        made = _rank_allocations(layer, split, parallel.recompute,
                                 parallel.recomputed_regions, parallel.torch_compile,
                                 tuple((number, saved[i][1]) for i, number in gathered),
                                 gathered_gradient_element_bytes(layer, parallel, element))
        unsharded = _unsharded(layer, made, parallel, element)
        wgrad_kept, wgrad_inputs, wgrad_gradients = _wgrad_kept_storages(forms.of(layer), split, parallel)
        return replace(made, unsharded=unsharded, fsdp_root=bool(unsharded) and not layer.transformer_layer,
                       stepped=_stepped(tuple(_gradient_storages(made).values()), held, element) if megatron_step
                       else (), wgrad_kept=wgrad_kept, wgrad_inputs=wgrad_inputs, wgrad_gradients=wgrad_gradients)

    return _per_block(counted, allocations_of)


def _wgrad_kept_storages(layer: LayerCount, split: _Split, parallel: Parallelism
                         ) -> tuple[frozenset[int] | None, tuple[int, ...], tuple[int, ...]]:
    """What a deferred weight pass keeps of `layer` on a rank (`wgrad_kept_tensors`), as the caching allocator's
    replay holds it (`LayerAllocations.wgrad_kept`, `wgrad_inputs`, `wgrad_gradients`): each product's saved input
    the forward made, held where it is: matched by bytes to the saved storages the weighted products (not the gating
    ones) read, in the order the forward made them (the count records which saved tensor a product saves, not its
    storage, but which storages the op making each product's output read: `forward_reads` of `product_allocations`;
    a count from before those, to every storage autograd saves); the bytes on the rank of the inputs matched to none
    (the layer's own input, a float8 copy) and of the output gradients. (None, (), ()) where the count does not mark
    the inputs."""
    inputs, gradients = wgrad_kept_tensors(layer, split, _rest_share(parallel))
    if inputs is None:
        return None, (), ()
    made = {number: nbytes for number, _, nbytes, _ in layer.allocations.get("fwd", ()) if nbytes > 0}
    unmatched = list(layer.saved_allocations)
    if layer.forward_reads and layer.product_allocations:
        weighted = {tuple(shape) for (shape, _, _), router in zip(layer.weight_grad_outputs, _gating(layer))
                    if not router}
        reads = dict(layer.forward_reads)
        read = {number for product, shape in layer.product_allocations.get("fwd", ()) if tuple(shape) in weighted
                for number in reads.get(product, ())}
        unmatched = [number for number in unmatched if number in read]
    held: set[int] = set()
    elsewhere = []
    saves = [layer.saved_tensors[i][1] for i in _deferred_saves(layer)]
    for nbytes, on_rank in zip(saves, inputs, strict=True):
        number = next((number for number in unmatched if made.get(number) == nbytes), None)
        if number is None:
            elsewhere.append(on_rank)
        else:
            unmatched.remove(number)
            held.add(number)

    def ranked(tensors: Sequence[float]) -> tuple[int, ...]:
        return tuple(nbytes for nbytes in (round(each / split.context) for each in tensors) if nbytes)

    return frozenset(held), ranked(elsewhere), ranked(gradients)


def _gradient_storages(made: LayerAllocations) -> dict[int, int]:
    """The bytes of each storage a layer's weight-gradient pass on a rank leaves live, by its number: its
    parameters' gradients (autograd's .grad), one a parameter, in the order the pass makes them."""
    live = left_live(made.passes.get("wgrad", ()))
    return {number: live[number] for number in sorted(live)}


def _stepped(grads: Sequence[int], held: Precision, element_bytes: int) -> tuple[tuple[int, int], ...]:
    """Under Megatron-LM's 16-bit optimizer (a precision keeping a float32 master copy of 16-bit weights), per
    parameter of gradient bytes `grads` on a rank: the float32 main gradient each step makes where the gradients
    are accumulated in 16 bits (`_copy_model_grads_to_main_grads`: `main_grad.float()`, which copies them; float32
    ones it reads as they are) and one Adam moment's bytes (LayerAllocations.stepped)."""
    main_bytes = 4 if held.grad_bytes < 4 else 0
    return tuple((grad * main_bytes // element_bytes, grad * held.state_bytes // element_bytes) for grad in grads)


def _unsharded(layer: LayerCount, made: LayerAllocations, parallel: Parallelism,
               element_bytes: int) -> tuple[tuple[int, int, int], ...]:
    """Under FSDP2 (`--precision fsdp2`), per parameter of `layer` on a rank, its whole weights as gathered
    (`gathered_weight_bytes`), its whole gradient as accumulated (float32) and that gradient's shard over the ranks
    FSDP2 shards it over: each parameter one storage the count's weight-gradient pass leaves live (autograd's
    .grad), the layer's bytes shared among them as those storages' are (LayerAllocations.unsharded); () under any
    other precision. The layer's bytes on the rank as the estimate holds them (`held_share`, `rank_share`): its
    replicated weights (its norms', its router's) whole, and of its routed experts' (the storages of their grouped
    products' weight gradients, `LayerCount.weight_grad_routed`, every expert's in the count) the rank's local
    experts' alone, 1/(E·ETP/t) of them (`weight_shards`): torchtitan shards each routed expert parameter, a DTensor
    already split over the E ranks, with fully_shard over `dp_mod_ep`, the data-parallel ranks left once the
    experts are placed (d·C·t/(E·ETP) of them, its parallel_dims' dp_shard_mod_ep), so its unshard gathers the local
    experts whole and its reduce-scatter shards their gradient over those ranks; the rest over the d·C ranks."""
    if parallel.precision != "fsdp2":
        return ()
    live = _gradient_storages(made)
    if not sum(live.values()):
        return ()
    routed = _routed(layer)
    experts = {number for number, (j, _, role) in weighted_products(layer, {}, "wgrad").items()
               if role == "weight" and routed[j]}
    t, local = parallel.tensor, weight_shards(parallel.expert, parallel.expert_tensor, parallel.tensor)
    shards = {number: parallel.data * parallel.context / (local if number in experts else 1) for number in live}
    grads = {number: nbytes / (local if number in experts else 1) for number, nbytes in live.items()}
    share = rank_share(layer, held_share(layer, local), parallel, element_bytes)  # t x the rank's
    weights = round(layer.param_bytes * share) // t
    gathered = gathered_weight_bytes(layer, weights, parallel, element_bytes)
    accumulated = PRECISIONS["fsdp2"].gradient_bytes(round(layer.grad_bytes * share)) // t
    total = sum(grads.values())
    return tuple((round(grad * gathered / total), round(grad * accumulated / total),
                  round(grad * accumulated / total / shards[number])) for number, grad in grads.items())


def _rank_allocations(layer: LayerCount, split: _Split, recompute: str, modules: Sequence[str] = (),
                      torch_compile: bool = False, gathered: Sequence[tuple[int, int]] = (),
                      gradient_element_bytes: int = 2) -> LayerAllocations:
    """The count's allocations (`LayerCount.allocations`) as one of the t·C ranks makes them (`_on_rank`), with
    what `recompute` has the backward make again: a transformer layer's whole forward under full recomputation,
    and under torchtitan's op policy all but what it keeps, every second product's output and the fused
    attention's (`_op_policy`); the attention core (s x s tensors) under Megatron-LM's selective; and what the
    recomputed `modules` make, keeping what they read (`Regions`); `torch_compile`: of what op keeps, only what the
    backward reads (`_unread_kept`), the rest neither kept nor rerun, and its first forward freeing what it reruns
    (`_compiled_checkpoint_forward`). `gathered`: the saved tensors a rank holds whole (`gathered_saves`), each as
    (its number in allocations["fwd"], its bytes whole as saved): a product's input the layer makes (a norm's
    output) made so, the layer's own input (number -1) gathered into a storage of its own as the forward begins,
    saved; each pass as the rank makes it (`_rank_pass`, `gradient_element_bytes` an element of a gathered
    output gradient). What the caching allocator replays (sim/caching_allocator.py)."""
    whole = {number: nbytes for number, nbytes in gathered if number >= 0}
    passes = {name: _rank_pass(layer, split, name, gradient_element_bytes) for name in layer.allocations}
    if whole:
        passes["fwd"] = tuple((number, round(math.copysign(whole[number], nbytes) / split.context)
                               if number in whole else nbytes) for number, nbytes in passes["fwd"])
    first = 1 + max((number for number, _ in passes.get("fwd", ())), default=-1)
    gathers = tuple((first + n, round(nbytes / split.context))
                    for n, nbytes in enumerate(nbytes for number, nbytes in gathered if number < 0))
    if gathers:
        passes["fwd"] = gathers + passes.get("fwd", ())
    if "gather" in split.collective_copies and gathered:
        passes["fwd"] = _with_collective_copies(passes["fwd"], split.t,
                                                whole.keys() | {number for number, _ in gathers})
    made = [(number, shape) for number, shape, nbytes, _ in layer.allocations.get("fwd", ()) if nbytes >= 0]
    kept: frozenset[int] = frozenset()
    rerun: frozenset[int] | None = None
    first_forward: tuple[tuple[int, int], ...] | None = None
    if recompute == "selective":
        rerun = frozenset(number for number, shape in made if split.core(shape))
    elif recompute in ("full", "op") and layer.transformer_layer:
        kept = _op_kept(layer) if recompute == "op" else frozenset()
        unread = _unread_kept(layer, kept) if torch_compile else frozenset()
        kept -= unread
        copies = {number for number, nbytes in passes.get("fwd", ()) if nbytes > 0} - {number for number, _ in made}
        rerun = frozenset(number for number, _ in made) - kept - unread | (copies - {number for number, _ in gathers})
        if torch_compile:
            first_forward = _compiled_checkpoint_forward(passes.get("fwd", ()), layer.forward_reads,
                                                         frozenset(layer.saved_allocations) & rerun)
    regions = Regions.of(layer, modules)
    if regions.made:
        rerun = (rerun or frozenset()) | regions.made
        kept |= {number for number, _, _ in regions.inputs if number >= 0}
    return LayerAllocations(passes, frozenset(layer.saved_allocations) | {number for number, _ in gathers}, rerun,
                            kept, first_forward=first_forward)


def _compiled_checkpoint_forward(events: Sequence[tuple[int, int]], reads: Sequence[tuple[int, Sequence[int]]],
                                 rerun_saved: frozenset[int]) -> tuple[tuple[int, int], ...]:
    """A compiled block's first forward under its checkpoint (`LayerAllocations.first_forward`), from the count's
    eager one (`events`, a rank's passes["fwd"]): each storage of `rerun_saved` (what autograd saves and the
    checkpoint reruns) freed once the last storage made from it (the count's data flow, `reads`:
    `LayerCount.forward_reads`) is made, or as soon as it is made where none is. The checkpoint holds none of
    them (torch/utils/checkpoint.py `_checkpoint_hook`: its pack hook keeps a `_Holder`, not the tensor),
    compiled the partitioner saves none (they are recomputed), and Inductor frees each buffer after its last use
    (torch/_inductor/scheduler.py `compute_last_usage`, `free_buffers`), where the count, autograd saving them,
    held them to the block's end. The count records a later in-place write's reads as its storage's (`reads`), not
    when the write ran; it ran once the last storage it reads was made, so a storage's ops count at that making
    where it is later than its own: the written storage is held until then (freed at its own making, it went before
    the write), and so is each storage the write reads. A count without its data flow: as counted."""
    if not reads:
        return tuple(events)
    written = {number: max((number, *read)) for number, read in reads}  # its last op's making or later
    last = {number: written.get(number, number) for number in rerun_saved}
    for number, read in reads:
        for source in rerun_saved.intersection(read):
            last[source] = max(last[source], written[number])
    frees: dict[int, list[tuple[int, int]]] = {}
    made = {number: nbytes for number, nbytes in events if nbytes > 0}
    for number in sorted(rerun_saved & made.keys()):
        frees.setdefault(last[number], []).append((number, -made[number]))
    out: list[tuple[int, int]] = []
    for number, nbytes in events:  # a storage's first event is its making (an empty one's, 0 bytes, too)
        out.append((number, nbytes))
        out += frees.pop(number, ())
    return tuple(out)


def _all_to_alls_ms(layer: LayerCount, experts: ExpertGroup, parallel: Parallelism) -> tuple[float, float]:
    """The network time of `layer`'s routed experts' all-to-alls (`planning.experts`) after its forward and after
    its backward: each MoE block's own (`LayerCount.routed_blocks`), each of the t·C ranks sending its share of
    the block's token copies, its top-k of each token, the busiest receiving `layer_load` times as many; a
    recomputation of the whole block (`reruns_dispatch`) reruns the forward's in the backward."""
    load, ranks = experts.layer_load(layer), parallel.tensor * parallel.context
    each = math.fsum(experts.all_to_all_ms(block.sent_bytes * load / ranks, block.top_k)
                     for block in layer.routed_blocks)
    rerun = ALL_TO_ALLS["fwd"] * each if reruns_dispatch(parallel) else 0.0
    return ALL_TO_ALLS["fwd"] * each, ALL_TO_ALLS["bwd"] * each + rerun


def reruns_dispatch(parallel: Parallelism) -> bool:
    """Whether the backward reruns a mixture of experts' forward whole, its dispatch and combine with it (and,
    dropless, the dispatcher's wait for the tokens each expert receives): under full recomputation, or with the
    block recomputed ("moe", Megatron-core's MoELayer forward under tensor_parallel.checkpoint: moe_layer.py at
    d98e8a64dd)."""
    return parallel.recompute == "full" or "moe" in parallel.recompute_modules


def paired_passes(priced: LayerEstimate, routed: LayerEstimate, combined: LayerEstimate, all_to_all_fwd_ms: float,
                  all_to_all_bwd_ms: float, issued: dict[str, dict[str, float]],
                  product_ms: tuple[float, float] = (0.0, 0.0)) -> tuple[MoePass, MoePass]:
    """A MoE layer's forward and backward (`priced` on the GPU; its routed experts' part, `_routed_part`, priced
    `routed`; what its combine node runs beside the all-to-all, `_combine_part`, priced `combined`) as
    Megatron-core's overlapped pair runs them node by node (`planning.experts.MoePass`): dispatch and combine
    alike; of the backward, the weight gradients `delay_wgrad_compute` runs after each part's input gradients; and
    where the layer makes the host wait, each part's issue (the host's issue of each pass, by part and pass name:
    "layer" the whole layer's, "experts" its routed part's, "combine" its combine node's; 0 where it never waits),
    its weight gradients' of it (the weight-gradient pass's, within the backward's). `product_ms`: the forward's
    and the backward's mean product where it holds every multiprocessor (`MoePass.product_ms`)."""

    def split_issue(name: str) -> tuple[float, float, float]:  # (the attention node's, the experts', the combine's)
        experts, combine = issued["experts"][name], issued["combine"][name]
        return issued["layer"][name] - experts - combine, experts, combine

    (attention_fwd, experts_fwd, combine_fwd), (attention_bwd, experts_bwd, combine_bwd), (
        attention_wgrad, experts_wgrad, _) = (split_issue(name) for name in ("fwd", "bwd", "wgrad"))
    forward = MoePass(priced.fwd_ms - routed.fwd_ms - combined.fwd_ms, routed.fwd_ms, all_to_all_fwd_ms / 2,
                      all_to_all_fwd_ms / 2, attention_issue_ms=attention_fwd, experts_issue_ms=experts_fwd,
                      combine_compute_ms=combined.fwd_ms, combine_issue_ms=combine_fwd, product_ms=product_ms[0])
    attention_bwd_ms = priced.bwd_ms - routed.bwd_ms - combined.bwd_ms
    backward = MoePass(attention_bwd_ms, routed.bwd_ms, all_to_all_bwd_ms / 2, all_to_all_bwd_ms / 2,
                       min(max(priced.wgrad_ms - routed.wgrad_ms, 0.0), attention_bwd_ms),
                       min(routed.wgrad_ms, routed.bwd_ms), attention_bwd, experts_bwd,
                       min(attention_wgrad, attention_bwd), min(experts_wgrad, experts_bwd),
                       combined.bwd_ms, combine_bwd, product_ms[1])
    return forward, backward


@dataclass(frozen=True)
class _HostIssue:
    """A layer's passes as the host issues them (`pass_kernels`, by pass), beside the dispatcher's multiprocessors
    (`sharing`, where it holds some), and its overlapped pair's
    passes (`paired_passes`, where its experts run on ranks of their own), which `_with_host_waits` prices."""

    kernels: dict[str, list[Kernels]]
    sharing: dict[str, list[Kernels]] | None
    pair: tuple[MoePass, MoePass] | None
    experts_wait: bool  # the pair's host waits again for the dispatched tokens (`paired_exposed_ms`)


def _with_host_waits(layers: list[LayerProfile], issues: list[_HostIssue], waits: bool) -> list[LayerProfile]:
    """The layers' passes, priced on the GPU, with the GPU's waits for the host where a layer makes it wait
    (`waits`; planning/host.py `carried_waits_ms`: over the model's layers in their order, so that a layer's price
    does not depend on the stage cut, which the simulator may change), each pass's issue kept (`pass_issue`) for a
    stage to compose its own or floor its passes by (profiles/schema.py `stage_host_waits_ms`), and each overlapped
    pair's exposure beyond them."""
    def carried(passes: list[dict[str, list[Kernels]]], names: Sequence[str]) -> dict[str, list[float]]:
        return {name: carried_waits_ms([kernels[name] for kernels in passes], name != "fwd") if waits
                else [0.0] * len(layers) for name in names}

    maps: dict[int, PassIssue] = {}

    def mapped(kernels: list[Kernels], carried_ms: float) -> PassIssue:
        """`pass_issue` found once per list of kernels: a layer alike one before it shares that one's lists
        (`estimate_profile`), and only the wait each carries differs between them."""
        if id(kernels) not in maps:
            maps[id(kernels)] = pass_issue(kernels, 0.0)
        return maps[id(kernels)].model_copy(update={"carried_ms": carried_ms})

    waited = carried([issue.kernels for issue in issues], PASSES)
    shares = [issue.sharing for issue in issues if issue.sharing is not None]
    sharing = carried(shares, ("fwd", "bwd")) if len(shares) == len(issues) else None
    timed = []
    for i, (layer, issue) in enumerate(zip(layers, issues, strict=True)):
        times = {name: getattr(layer, name).median_ms + waited[name][i] for name in PASSES}
        update: dict[str, Any] = {name: _timing(ms) for name, ms in times.items()}
        update["host_issue"] = {name: mapped(issue.kernels[name], waited[name][i]) for name in PASSES}
        update["host_issue"] |= {f"{name}_sharing": PassIssue(idle_ms=0.0, slack_ms=0.0) if sharing is None
                                 else mapped(issue.sharing[name], sharing[name][i]) for name in ("fwd", "bwd")}
        if sharing is not None:
            update |= {"fwd_sharing_ms": layer.fwd_sharing_ms + sharing["fwd"][i],
                       "bwd_sharing_ms": layer.bwd_sharing_ms + sharing["bwd"][i]}
        # the pair's nodes are the GPU's times, the host's issue apart (`MoePass`): so is how much slower they run
        # beside the all-to-alls, where the waits each series carries from layer to layer would skew it
        slower = tuple(getattr(layer, f"{name}_sharing_ms") / getattr(layer, name).median_ms
                       if getattr(layer, f"{name}_sharing_ms") > 0 and getattr(layer, name).median_ms > 0 else 1.0
                       for name in ("fwd", "bwd"))
        update["all_to_all_paired_by_node"] = issue.pair is not None
        update["all_to_all_paired_ms"] = 0.0 if issue.pair is None else paired_exposed_ms(
            *issue.pair, charged_ms=times["fwd"] + times["bwd"], experts_wait=issue.experts_wait, slower=slower)
        timed.append(layer.model_copy(update=update))
    return timed


def _routed_part(layer: LayerCount) -> LayerCount:
    """`layer`'s routed experts' ops alone (`OpCount.routed`): what Megatron-core's `mlp` node of an overlapped
    pair runs between the dispatch and the combine (`planning.experts.paired_exposed_ms`), of its recomputed
    regions' reruns too (`Regions`: moe_act's, not the norms' outside the experts)."""
    return replace(layer, ops={name: tuple(op for op in ops if op.routed) for name, ops in layer.ops.items()},
                   region_ops={name: tuple(op for op in ops if op.routed) for name, ops in layer.region_ops.items()})


def _combine_part(layer: LayerCount) -> LayerCount:
    """What Megatron-core's `moe_combine` node of an overlapped pair computes beside its all-to-all, on the
    communication stream (models/gpt/fine_grained_callables.py `submodule_combine_forward`): of `layer`'s ops,
    the unpermutation (the count's scatter back of the routed experts' outputs, workload/moe.py `routed_experts`:
    `index_put` in the forward, its gradient's gather `index` in a backward) and one call of the residual add over
    the layer's output (`mlp_bda`, whose gradient passes through: no kernel in the count). A shared expert's add
    (`postprocess`) is not told apart and stays in the attention node."""
    def mine(name: str, op: OpCount) -> OpCount | None:
        if op.routed:
            return None
        if name == "fwd" and op.op == "add" and op.shape == tuple(layer.output_shape):
            return replace(op, count=1)
        return op if op.op == ("index_put" if name == "fwd" else "index") else None

    ops = {name: tuple(filter(None, (mine(name, op) for op in ops))) for name, ops in layer.ops.items()}
    return replace(layer, ops=ops, region_ops={}, decoder_block=False)  # a node of the block, told by its own ops


def _op_kept(layer: LayerCount) -> frozenset[int]:
    """The numbers in `layer`'s allocations["fwd"] of what torchtitan's op policy keeps (`_op_policy`): every second
    product's output (the 1st, 3rd, ...) and the attention kernel's."""
    kinds = {op.op: op.kind for op in layer.ops.get("fwd", ())}
    made = [(number, op) for number, _, nbytes, op in layer.allocations.get("fwd", ()) if nbytes >= 0]
    products = [number for number, op in made if kinds.get(op) == "matmul"]
    return frozenset(products[::2]) | {number for number, op in made if kinds.get(op) == "attention"}


def _unread_kept(layer: LayerCount, kept: frozenset[int] | None = None) -> frozenset[int]:
    """Of what a recomputation policy keeps of `layer`'s forward (`kept`, by number in allocations["fwd"]; None:
    torchtitan's op policy's, `_op_kept`), what its backward never reads once the block is compiled, so that
    AOTAutograd saves none of it. torch.compile traces the checkpoint's policy into tags, and the min-cut
    partitioner (torch/_functorch/partitioners.py, late 2024 as at torch 1963fc8, the rows' commit, and since)
    never saves a PREFER_RECOMPUTE node (`must_recompute`: tied to the sink) and bans recomputing a MUST_SAVE one
    (`should_ban_recomputation`); then `_extract_fwd_bwd_modules` drops every saved value the backward's graph,
    its recomputed nodes included, does not read ("filter out saved values that don't actually end up being used
    by the backwards pass"). So a tensor kept is saved where autograd saves it or something made from it through
    tensors not kept (the count's data flow, `forward_reads`), while eager checkpointing keeps it whatever reads it
    (torch/utils/checkpoint.py's `_CachingTorchDispatchMode` stores every MUST_SAVE op's output). In a Llama
    block: the last product's output, which only the residual add reads. A count without its data flow: nothing."""
    kept = _op_kept(layer) if kept is None else kept
    if not layer.forward_reads:
        return frozenset()
    made_from = dict(layer.forward_reads)
    read: set[int] = set()
    seen: set[int] = set()
    stack = list(layer.saved_allocations)
    while stack:
        number = stack.pop()
        if number in seen:
            continue
        seen.add(number)
        if number in kept:
            read.add(number)
        else:
            stack.extend(made_from.get(number, ()))
    return kept - read


def _op_policy(ops: Sequence[OpCount], element_bytes: int) -> tuple[dict[str, float], list[OpCount]]:
    """torchtitan's selective op policy over a layer's forward `ops` (in the order the count first saw them, each
    call of a product numbered in turn): the bytes it keeps by part, every other product's output (odd numbers:
    `_custom_policy` recomputes each second aten.mm) as other and the fused attention's output and its float32
    log-sum-exp as attention; and the ops it reruns in the backward (the rest)."""
    kept = {"attention": 0.0, "other": 0.0}
    rerun: list[OpCount] = []
    products = 0
    for op in ops:
        if op.kind == "matmul":
            saved = (products + op.count + 1) // 2 - (products + 1) // 2  # odd numbers in products+1..+count
            products += op.count
            batch, m, n, _ = op.shape
            kept["other"] += saved * batch * m * n * element_bytes
            if op.count > saved:
                rerun.append(replace(op, count=op.count - saved))
        elif op.kind == "attention":
            heads, queries, _, head_size = op.shape
            kept["attention"] += op.count * heads * queries * (head_size * element_bytes + 4)
        else:
            rerun.append(op)
    return kept, rerun


def whole_parts(parts: dict[str, float], total: int) -> dict[str, int]:
    """`parts` scaled to sum to `total` in whole bytes, the remainders to the largest fractions."""
    scale = total / sum(parts.values()) if sum(parts.values()) else 0.0
    scaled = {name: value * scale for name, value in parts.items()}
    whole = {name: math.floor(value) for name, value in scaled.items()}
    for name in sorted(scaled, key=lambda n: whole[n] - scaled[n])[:total - sum(whole.values())]:
        whole[name] += 1
    return whole


def check_ring_attention(c: int, attention: str | None) -> None:
    """C > 1 context-parallel ranks run their ring on a fused attention kernel (torch's context parallel dispatches
    its SDPA kernels only, Megatron's TransformerEngine's): the model counted with `attention` flash."""
    if c > 1 and attention != "flash":
        raise EstimateError("{context}: ring attention runs on a fused attention kernel (torch's and "
                            "TransformerEngine's context parallel): give {attention} flash")


def no_sequence_refusal(c: int, model: str) -> str:
    """The line refusing C context-parallel ranks for `model`, whose samples are no sequence (mlp's, cnn's)."""
    return f"context: {c} splits the sequence, and {model} has none"


def check_context(counted: WorkloadCount, c: int, tensor: int, rotate: str) -> None:
    """C context-parallel ranks need a sequence of 2C equal chunks (the causal load balance) and a fused attention
    kernel for the ring to run (`check_ring_attention`), and Gated DeltaNet layers (workload/gdn.py) heads that C
    divides on each of the `tensor` ranks, as Megatron-core asserts, and Megatron-core's ring (`rotate` p2p): its
    all-to-alls around those layers are Megatron-core's own, and torch's context parallel, whose rings alltoall and
    allgather are, shards SDPA's calls alone (torch/distributed/tensor/experimental/_attention.py). A model whose
    attention runs within chunks past one (Llama 4's, workload/hf.py `_chunked`) is refused: NeMo's Llama 4 asserts
    each rank holds whole chunks (nemo/collections/llm/gpt/model/llama4_utils.py, `cp_chunk_len %
    self.attention_chunk_size == 0`), whose layers then need no ring, and pipesim would price the ring for them."""
    seq = counted.options.get("seq_len")
    if not seq:
        raise EstimateError(no_sequence_refusal(c, counted.model))
    if counted.options.get("sparse_attention_keys"):
        raise EstimateError(f"context: {c} splits the sequence, and {counted.model}'s sparse attention runs context-"
                            "parallel by gathering every key to each rank (Megatron-core's DSA takes cp_comm_type "
                            "allgather alone), which pipesim does not price yet; leave {context} out")
    if counted.options.get("mamba_heads"):
        raise EstimateError(f"context: {c} splits the sequence for attention's ring, and {counted.model}'s Mamba-2 "
                            "layers scan the whole of it, which pipesim does not split; leave {context} out")
    for name, what in (("linear_key_heads", "key"), ("linear_value_heads", "value")):
        if (heads := counted.options.get(name)) and heads % (tensor * c):
            fitting = [n for n in range(2, heads // tensor + 1) if not heads % (tensor * n)]
            raise EstimateError(f"context: {c} does not divide the {heads // tensor:,} gated delta rule {what} heads "
                                f"of {counted.model} a tensor-parallel rank holds (Megatron-core splits them over the "
                                "context-parallel ranks, around its Gated DeltaNet layers); "
                                + (f"give {{context}} {' or '.join(map(str, fitting))}" if fitting
                                   else "leave {context} out"))
    if counted.options.get("linear_value_heads") and rotate != "p2p":
        raise EstimateError(f"cp_rotate: {rotate} is a ring of torch's context parallel, which shards SDPA's calls "
                            f"alone, and {counted.model}'s Gated DeltaNet layers run context-parallel under "
                            "Megatron-core (an all-to-all around each): give {cp_rotate} p2p (Megatron-core's ring)")
    if (chunk := counted.options.get("attention_chunk")) is not None:
        raise EstimateError(f"context: {c} splits the sequence for attention's ring, and {counted.model}'s chunked "
                            f"attention layers attend within chunks of {chunk:,} tokens, which pipesim's ring does not "
                            "run (each rank would hold whole chunks: no ring for them); leave {context} out, or give a "
                            f"{{seq_len}} of {chunk:,} or less (one chunk)")
    if seq % (2 * c):
        fitting = [n for n in range(2, seq // 2 + 1) if not seq % (2 * n)]
        nearest = [n for n in fitting if n < c][-1:] + [n for n in fitting if n > c][:1]
        instead = (f"{{context}} {' or '.join(map(str, nearest))} (C must divide {{seq_len}} / 2 = {seq // 2:,})"
                   if nearest else "an even {seq_len} (C must divide {seq_len} / 2)" if seq % 2
                   else f"a {{seq_len}} that {2 * c} divides (2 x C tokens, a chunk each)")
        raise EstimateError(f"context: {c} does not split the sequence of {seq:,} tokens into 2 x {c} equal chunks "
                            f"(the causal load balance); give {instead}")
    check_ring_attention(c, counted.attention)


def check_sparse_attention_recompute(parallel: Parallelism) -> None:
    """The recomputation a sparse attention model's layers (workload/dsa.py) refuse: selective, which reruns the
    attention core pipesim finds by its s x s tensors, which DSA has none of, and mla_up_proj under float8, which
    Megatron-core refuses for an absorbed MLA (absorbed_mla.py, recompute_up_proj: `assert not quantization, "FP8/FP4
    is not supported for AbsorbedMLA"`)."""
    if parallel.recompute == "selective":
        raise EstimateError("recompute: selective reruns the attention core pipesim finds by its s x s tensors, which "
                            "the model's sparse attention has none of (Megatron-core's core_attn checkpoint of DSA is "
                            "not priced yet); give {recompute} full or none, or {recompute_modules}")
    if parallel.fp8 and "mla_up_proj" in parallel.recompute_modules:
        raise EstimateError("recompute_modules: mla_up_proj reruns the up-projections of the model's absorbed MLA "
                            "(its sparse attention's), which Megatron-core refuses under float8; leave mla_up_proj "
                            "out, or give {dtype} bf16")


def check_sequence_split(counted: WorkloadCount, parallel: Parallelism) -> None:
    """Sequence parallelism splits each rank's tokens over the t ranks, which must divide them: Megatron-core's
    reduce-scatter into the sequence-parallel region asserts "First dimension of the tensor should be divisible by
    tensor parallel size" (tensor_parallel/mappings.py `_reduce_scatter_along_first_dim`), the C context-parallel
    ranks' share of the sequence where C > 1 (a sequence they did not divide was priced, 8,193 tokens at t = 2)."""
    seq, t, c = counted.options.get("seq_len"), parallel.tensor, parallel.context
    if parallel.sequence_parallel and t > 1 and seq and (seq // c) % t:
        share = f"a rank's {seq // c} of its {seq} tokens" if c > 1 else f"its {seq} tokens"
        raise EstimateError(f"sequence_parallel: splits {share} over the {t} tensor-parallel ranks, which do not "
                            f"divide them (Megatron-core asserts they do): give {{seq_len}} a multiple of {t * c}, or "
                            "leave {sequence_parallel} out")


def _ring_fields(priced: LayerEstimate) -> dict[str, Any]:
    """A layer profile's context-ring fields (`LayerProfile.ring_fwd_ms` and on) of its estimate (none: C = 1)."""
    if priced.ring_fwd is None or priced.ring_bwd is None:
        return {}
    forward, backward = priced.ring_fwd, priced.ring_bwd
    return dict(ring_fwd_ms=forward.link_ms, ring_bwd_ms=backward.link_ms, ring_fwd_hidden_ms=forward.hidden_ms,
                ring_bwd_hidden_ms=backward.hidden_ms,
                ring_buffer_bytes={"fwd": forward.buffer_bytes, "bwd": backward.buffer_bytes,
                                   "igrad": backward.buffer_bytes})


def _timing(ms: float) -> Timing:
    return Timing(median_ms=ms, spread_ms=0.0, repeats=1)


def _element_bytes(dtype: str) -> int:
    return 4 if dtype == "float32" else 2


def fp8_peak_tflops(gpu: Gpu, named: str) -> float:
    """The part's dense float8 peak, at which a float8 recipe's products run; a part without float8 tensor cores has
    none in the catalogue, and runs no recipe (`named`: the part as its reader names it)."""
    if gpu.dense_tflops.fp8 is None:
        raise EstimateError(f"{{dtype}} fp8: {named} has no FP8 peak in the catalogue (no float8 tensor cores)")
    return gpu.dense_tflops.fp8


def check_float8_products(counted: WorkloadCount) -> None:
    """pipesim prices float8 in a transformer layer's linear products alone (planning/fp8.py): a model with none
    (mlp, cnn) was priced in 16 bits all through under {dtype} fp8, with TransformerEngine's float8 module calls
    added: EstimateError."""
    if not any(layer.transformer_layer for layer in counted.layers):
        raise EstimateError(f"{{dtype}} fp8: pipesim prices float8 in a transformer layer's linear products, and "
                            f"{counted.model} has none: give {{dtype}} bf16")


def check_float8_shapes(counted: WorkloadCount, parallel: Parallelism, experts: ExpertGroup) -> None:
    """Each product the recipe runs in float8 (`float8_products`), at its shape on the busiest rank, in the multiples
    its runtime takes (`Fp8Recipe.product_multiples`), which otherwise refuses it (TransformerEngine's assertion,
    torch._scaled_mm's check): EstimateError naming the product and the dimension. A recipe that casts before a
    sequence-parallel all-gather (`gathers_float8`: TransformerEngine's Linear asserts on the rank's input, then
    gathers it) holds a column-parallel product's rows to them before the gather, its t-th. A routed expert's rows
    are not held to them: Megatron-core pads each local expert's tokens for float8 (`ExpertGroup.float8_padded`)."""
    recipe = FP8_RECIPES[parallel.fp8]
    gathered_after = recipe.gathers_float8 and parallel.sequence_parallel
    for layer, same in zip(counted.layers, counted.same_as, strict=True):
        products = [] if same is not None else float8_products(layer, recipe)
        if not products:
            continue
        split = _Split.of(layer, parallel)
        routed = [op for op in products if op.routed]
        local = dict(zip(map(id, routed), [op.shape for op in experts.local(layer).ops["fwd"] if op.routed and
                                           op.kind == "matmul"] if routed else [], strict=True))
        for op in products:
            shapes = [local[id(op)]] if op.routed else [mine.shape for mine, _, _ in split.products(op, "fwd")]
            for _, rows, outputs, inputs in shapes:
                if gathered_after and not op.routed and outputs < op.shape[2]:  # column-parallel: split outputs
                    rows //= parallel.tensor
                dims = {"rows": None if op.routed else rows, "output features": outputs, "input features": inputs}
                wrong = [f"{name} in multiples of {multiple}" for (name, size), multiple
                         in zip(dims.items(), recipe.product_multiples, strict=True)
                         if size is not None and size % multiple]
                if wrong:
                    kind, ranks = (("a routed expert's product", "an {expert_tensor}") if op.routed else
                                   ("a product", "a {tensor} and {context}"))
                    raise EstimateError(
                        f"{{fp8}} {parallel.fp8}: layer {layer.name} has {kind} of {inputs:,} to {outputs:,} "
                        f"features{'' if op.routed else f' on {rows:,} rows a rank'}, and the recipe's float8 "
                        f"kernels take {' and '.join(wrong)}: give {{dtype}} bf16, or sizes and {ranks} that keep "
                        "them so")


def kernel_curve(curve: Curve, kernel: str, gpu: str) -> Curve:
    """`curve` pricing fused attention at `kernel`'s published rate on the part: which kernel a run's attention
    takes is the framework's choice (TransformerEngine: FlashAttention-2 with NVTE_FUSED_ATTN=0, cuDNN's fused
    attention with NVTE_FUSED_ATTN=1, which `get_attention_backend` prefers on Hopper), and on an H100 cuDNN's runs
    1.5 times FlashAttention-2's rate (arXiv 2407.08608, figures 5 and 6)."""
    efficiency = curve.attention_kernel_efficiency(kernel)
    if efficiency is None:
        published = ", ".join(name for name in ATTENTION_KERNELS if curve.attention_kernel_efficiency(name))
        raise EstimateError(f"{{attention_kernel}}: no published {kernel} rate for {gpu} in its curve (published: "
                            f"{published}; a --gpus file can add attention_kernels)")
    return curve.model_copy(update={"attention_efficiency": efficiency,
                                    "attention_passes": curve.attention_passes_of(kernel)})


def _routing_groups(options: dict) -> tuple[int, int] | None:
    """The count's group-limited routing, (G groups, M a token), as `expert_group` takes it (None: none)."""
    return (options["expert_groups"], options["groups_per_token"]) if options.get("expert_groups") else None


@dataclass
class LayerMemo:
    """The layer profiles of one count's estimates on one part and curve, by what else they depend on
    (`estimate_profile`'s key: the parallelism but its depth p and replicas d, the ranks the optimizer's state is
    sharded over, the expert group and the tensor and context links), so that an estimate at another p or d takes
    them as made: tune estimates every p of each t, b and recomputation, and a layer is priced on one of its
    stage's ranks whatever the stages and replicas (p and d only place the ranks: the links and groups)."""

    counted: WorkloadCount
    gpu: Gpu
    curve: Curve | None = None
    layers: dict[tuple, list[LayerProfile]] = field(default_factory=dict)
    # the same layers by their key but the optimizer state's sharding (on or off, and over which ranks), which alone
    # they differ by: under ZeRO those ranks are d's, so each p of a t would price every layer again (576 layer
    # estimates against 252 in a tune of 8 GPUs), and once more at d = 1, which shards nothing
    priced: dict[tuple, list[LayerProfile]] = field(default_factory=dict)
    found: dict[tuple, Any] = field(default_factory=dict)  # what `kept` found of each key's layers

    def kept(self, key: tuple, make: Callable[[], Any]) -> Any:
        """`make()`, found once: what an estimate reads of its layers alone (their costs, their stage time, the
        bytes each one's optimizer step moves), by their key in `layers` and what else it reads."""
        if key not in self.found:
            self.found[key] = make()
        return self.found[key]


def _step_casts_ms(counted: WorkloadCount, parallel: Parallelism, device: Device, element_bytes: int,
                   weight_shards: int) -> list[tuple[float, ...]]:
    """Per layer of `counted`, the time of each of its float8 recipe's weight casts once per step (TransformerEngine's;
    none without a recipe), each weight 1/t of itself; of float8 weights gathered over the d·C ranks, each rank's
    shard cast and the whole transposed (`step_cast_ops`). Found once a layer, one alike a layer before it taking
    that one's, so that each stage sums its layers' in their order without building them again."""
    if parallel.fp8 is None:
        return [()] * len(counted.layers)
    float8_shards = parallel.data * parallel.context if parallel.fp8_param_gather else None
    return _per_block(counted, lambda layer: tuple(
        op.count * op_ms(_scaled(op, op.shape, parallel.tensor), device)
        for op in step_cast_ops(layer, FP8_RECIPES[parallel.fp8], element_bytes, weight_shards, float8_shards)))


def _per_block(counted: WorkloadCount, of: Callable[[LayerCount], Any]) -> list:
    """`of` each layer of `counted`, found once a kind of block: one the same as a layer before it
    (`WorkloadCount.same_as`) takes that one's, for an `of` that reads neither a layer's name nor its inputs (tune
    estimates a count hundreds of times)."""
    found: list = []
    for layer, same in zip(counted.layers, counted.same_as, strict=True):
        found.append(of(layer) if same is None else found[same])
    return found


def tensor_split_refusal(options: dict[str, Any], tensor: int, expert_tensor: int | None) -> str | None:
    """Why `tensor` ranks cannot split the model counted with `options` (None: they can): Megatron splits its heads,
    key/value heads and MLP width over the t ranks, an expert's MLP width over `expert_tensor` (ETP) where given,
    else over t. The line starts with the Parallelism field to blame, as the estimate's refusals do."""
    refusal = _unsplit(options, tensor, expert_tensor)
    if refusal is None:
        if options.get("sparse_attention_keys") and tensor > 1:
            return (f"tensor: {tensor} ranks would each run the whole indexer of the model's sparse attention, which "
                    "Megatron-core duplicates on every tensor-parallel rank over the gathered sequence, and pipesim "
                    "does not price so yet: give 1")
        return None
    field_name, ranks, size, what = refusal
    divisors = sorted({d for k in range(1, math.isqrt(size) + 1) if not size % k for d in (k, size // k)})
    splits = [n for n in divisors if _unsplit(options, *(  # each must divide `size`: its divisors, not up to ranks
        (n, expert_tensor) if field_name == "tensor" else (tensor, n))) is None]
    nearest = [n for n in splits if n < ranks][-1:] + [n for n in splits if n > ranks][:1]
    instead = f": give {{{field_name}}} {' or '.join(f'{n:,}' for n in nearest)}" if nearest else ""
    return f"{field_name}: {ranks} does not divide the model's {size:,} {what}{instead}"


def _unsplit(options: dict[str, Any], tensor: int, expert_tensor: int | None) -> tuple[str, int, int, str] | None:
    """`tensor_split_refusal`'s first size that the ranks do not divide: (the field to blame, its ranks, the size,
    what it is), None where they divide every one."""
    expert_split = ("tensor", tensor) if expert_tensor is None else ("expert_tensor", expert_tensor)
    for name, what, (field_name, ranks) in (("heads", "heads", ("tensor", tensor)),
                                            ("kv_heads", "key/value heads", ("tensor", tensor)),
                                            ("ffn", "MLP width", ("tensor", tensor)),
                                            ("expert_ffn", "experts' MLP width", expert_split),
                                            ("mamba_heads", "Mamba-2 heads", ("tensor", tensor)),
                                            ("mamba_groups", "Mamba-2 groups", ("tensor", tensor)),
                                            ("linear_key_heads", "gated delta rule key heads", ("tensor", tensor)),
                                            ("linear_value_heads", "gated delta rule value heads", ("tensor", tensor))):
        size = options.get(name)
        if size and size % ranks:
            return field_name, ranks, size, what
    return None


def estimate_profile(counted: WorkloadCount, gpu: Gpu, parallel: Parallelism, *, optimizer: str = "adam",
                     cluster: Cluster | None = None, curve: Curve | None = None,
                     bounds: list[int] | None = None, memo: LayerMemo | None = None) -> Profile:
    """The Profile of `counted` on `gpu` parallelised as `parallel` says, per GPU: every layer's times and bytes
    on one of its stage's t ranks, the stages cut at `bounds` (default: p stages balanced by time), the link
    between stages from the placement, the optimizer step as the bytes it moves. Weights, gradients and optimizer
    state are held as `parallel.precision` says (a 16-bit count: as Megatron-LM, float32 master weights and
    moments). `curve` replaces the part's. `memo` keeps the layers for the next estimate of the same count, part
    and curve."""
    if memo is not None and (memo.counted is not counted or memo.gpu is not gpu or memo.curve is not curve):
        raise ValueError("memo: made for another count, part or curve")
    curve = curve or gpu.curve
    if curve is None:
        raise EstimateError(f"gpu {gpu.name!r} has no efficiency curve (curve = {{...}} in its catalogue entry)")
    curve = kernel_curve(curve, parallel.attention_kernel, gpu.name)
    if parallel.attention_kernel == "cudnn" and any(op.softcap for layer in counted.layers
                                                    for ops in layer.ops.values() for op in ops):
        # TransformerEngine's FusedAttention caps scores only through cuDNN frontend's experimental score_mod, which
        # takes no mask (dot_product_attention.py `score_mod`, TransformerEngine d0067d0): not the causal kernel
        raise EstimateError("{attention_kernel} cudnn: the model soft-caps its attention scores, which cuDNN's "
                            "causal fused attention does not compute; use flash2 or flash3 (their softcap), or "
                            "count it with --attention math")
    if (refused := optimizer_refusal(optimizer, "{optimizer}")) is not None:
        raise EstimateError(refused)
    if (refused := tensor_split_refusal(counted.options, parallel.tensor, parallel.expert_tensor)) is not None:
        raise EstimateError(refused)
    if parallel.pipeline > most_stages(counted.layers):
        raise EstimateError(f"pipeline: {parallel.pipeline} stages for a model of {layers_text(counted.layers)}")
    if parallel.scores_buffer and counted.attention != "math":
        raise EstimateError("{scores_buffer} keeps the buffer Megatron-LM's unfused attention ({attention} math) "
                            "computes its scores beside; " + (
                                "this model has no attention: drop {scores_buffer}" if counted.attention is None else
                                f"the model was counted with {counted.attention} attention: count it with "
                                "{attention} math"))
    if parallel.context > 1:
        check_context(counted, parallel.context, parallel.tensor, parallel.cp_rotate)
    if counted.options.get("sparse_attention_keys"):
        check_sparse_attention_recompute(parallel)
    check_sequence_split(counted, parallel)
    if parallel.fp8 is not None:
        check_float8_products(counted)
    placement = node_placement(gpu, cluster, curve)
    if parallel.tp_overlap and parallel.tensor > placement.gpus_per_node:
        raise EstimateError(f"tp_overlap: moves its chunks between the GPUs of one node (userbuffers, symmetric "
                            f"memory), and a tensor-parallel group of {parallel.tensor} spans nodes of "
                            f"{placement.gpus_per_node} GPUs: give {{tensor}} {placement.gpus_per_node} or fewer, or "
                            "leave {tp_overlap} out")
    experts, links, _ = placed(placement, counted, parallel, curve)
    if parallel.fp8 is not None:
        check_float8_shapes(counted, parallel, experts)
    peak = getattr(gpu.dense_tflops, PEAK_DTYPE[counted.dtype])
    if peak is None:
        raise EstimateError(f"gpu {gpu.name!r} has no {counted.dtype} peak in the catalogue")
    device = Device.of(gpu, PEAK_DTYPE[counted.dtype], curve, fp8=parallel.fp8 is not None,
                       attention_kernel=parallel.attention_kernel)
    element = _element_bytes(counted.dtype)
    held = parallel.held(counted.dtype)
    t = parallel.tensor
    shards = t * (parallel.data * parallel.context if parallel.sharded_optimizer else 1)  # C ranks shard as d do
    widen = held.state_bytes // element  # the count's state is in its dtype; mixed precision keeps it in float32
    ema = EMA_BYTES if parallel.ema == "gpu" else 0  # a float32 average of each weight, with the master copy
    # the logits split over t under torch's loss_parallel, else whole on every rank (torchtitan's head:
    # ColwiseParallel, output_layouts Replicate unless loss_parallel); only torch's pipelining keeps them
    vocabulary_ranks = t if parallel.loss_parallel else 1
    # the layers but their optimizer state depend on neither p, d nor whether that state is sharded
    priced_key = (replace(parallel, pipeline=1, data=1, sharded_optimizer=False), experts, links.tensor, links.context)
    key = (*priced_key, parallel.sharded_optimizer, shards)

    def state_bytes(layer: LayerCount) -> dict[str, int]:
        """The layer's optimizer state on the rank, over the `shards` ranks it is split over."""
        held_state = state_share(layer, parallel, experts.weight_shards, element)  # of them t x its optimizer's
        return {name: round((layer.optimizer_state_bytes[name] * widen + (held.master_bytes + ema)
                             * layer.param_bytes // element) * held_state) // shards for name in OPTIMIZERS}

    made = None if memo is None else memo.layers.get(key)  # by an estimate at another p or d
    if made is None and memo is not None and priced_key in memo.priced:  # at another d sharding the state
        made = [profile.model_copy(update={"optimizer_state_bytes": state_bytes(layer)})
                for profile, layer in zip(memo.priced[priced_key], counted.layers, strict=True)]
    layers = [] if made is None else made
    sharing = sharing_dispatcher(device, parallel)
    float8 = parallel.float8_forms(element)  # each layer's form built once for all that price it
    accumulated = held.grad_bytes if parallel.accumulation == "fused" else None  # in the weight-gradient products
    # a TransformerEngine module call's Python: in transformer layers alone (Megatron-core's embedding and output
    # layer are its own modules, VocabParallelEmbedding and ColumnParallelLinear, not TransformerEngine's)
    modules_us = module_us(parallel.fp8, parallel.host_module_us)

    issues: list[_HostIssue] = []
    for layer, same in () if made is not None else zip(counted.layers, counted.same_as, strict=True):
        if same is not None:
            layers.append(layers[same].model_copy(update={"name": layer.name, "inputs": list(layer.inputs)}))
            issues.append(issues[same])
            continue  # that layer renamed: every figure is its layer's, which equals that one's
        busiest = experts.local(layer)
        if parallel.fp8 in TE_RECIPES:
            busiest = experts.float8_padded(busiest, dropless=counted.options.get("capacity_factor") is None)
        if parallel.expert_gemm == "per-expert":
            busiest = per_expert_products(busiest)
        priced = estimate_layer(busiest, device, parallel, links.tensor, element, links.context, float8, accumulated)
        shared = None if sharing is None else estimate_layer(busiest, sharing, parallel, links.tensor, element,
                                                              links.context, float8, accumulated)
        paired = parallel.expert > 1 and layer.dispatched_bytes
        routed, combined = (estimate_layer(part(busiest), device, parallel, links.tensor, element, links.context,
                                           float8, accumulated) if paired else None
                            for part in (_routed_part, _combine_part))
        share = rank_share(layer, held_share(layer, experts.weight_shards), parallel, element)  # t x the rank's
        params = round(layer.param_bytes * share) // t
        all_to_all_fwd_ms, all_to_all_bwd_ms = _all_to_alls_ms(layer, experts, parallel)
        synced = synchronises(busiest, counted.options)
        tokens_wait = waits_for_tokens(busiest, counted.options)  # before the dispatch, of `synced`

        # the experts' biases on the rank, each added into its main_grad by Megatron-core DDP's hook where the
        # products accumulate the weights' gradients (its gradient accumulation fusion): one kernel each a backward
        bias_adds = layer.expert_bias_tensors // experts.ranks if parallel.accumulation == "fused" else 0

        def kernels(estimate: LayerEstimate, names: Sequence[str], hook_adds: int = bias_adds
                    ) -> dict[str, list[Kernels]]:
            """The passes `names` of the layer as the host issues them (`pass_kernels`: a backward's rerun of the
            forward first), its all-to-alls (held apart in its profile) among its kernels, `hook_adds` after each
            pass that takes the weights' gradients."""
            return {name: pass_kernels(
                estimate.timed_ops[name], [op for op, _ in estimate.timed_ops["fwd"]], float8.recipe is not None,
                parallel.host_kernel_us, name, modules_us if layer.transformer_layer else 0.0,
                {"fwd": all_to_all_fwd_ms, "wgrad": 0.0}.get(name, all_to_all_bwd_ms),
                tokens_wait and (name == "fwd" or (name != "wgrad" and reruns_dispatch(parallel))),
                None if estimate.ring is None else estimate.ring.kernels,
                hook_adds if name in ("bwd", "wgrad") else 0) for name in names}

        def issued(passes: dict[str, list[Kernels]]) -> dict[str, float]:
            """The host's issue of each of `passes` (`issued_ms`) where the layer makes it wait (so the model
            does: `waits`), else 0."""
            return {name: issued_ms(passes[name]) if synced else 0.0 for name in PASSES}

        def replayed(given: dict[str, list[Kernels]]) -> dict[str, list[Kernels]]:
            """The passes `given` as the host issues them where the layer is captured in CUDA graphs
            (`CUDA_GRAPH_SCOPES`): each one replay (`graph_replay`)."""
            if not captured(layer, parallel.cuda_graphs):
                return given
            return {name: graph_replay(run, parallel.host_kernel_us) for name, run in given.items()}

        passes = replayed(kernels(priced, PASSES))
        pair = None
        if routed is not None and combined is not None:
            parts_issued = {part: issued(kernels(estimate, PASSES, adds) if synced else {})
                            for part, estimate, adds in (("experts", routed, bias_adds), ("combine", combined, 0))}
            held_products = sharing is not None and sharing.products_held_on is not None  # on every multiprocessor
            pair = paired_passes(priced, routed, combined, all_to_all_fwd_ms, all_to_all_bwd_ms,
                                 {"layer": issued(passes), **parts_issued}, tuple(
                                     persistent_product_ms(busiest, device, parallel, element, float8, (name,))
                                     if held_products else 0.0 for name in ("fwd", "bwd")))
        issues.append(_HostIssue(passes, None if shared is None else replayed(kernels(shared, ("fwd", "bwd"))), pair,
                                 tokens_wait and parallel.token_dispatcher == "deepep"))
        layers.append(LayerProfile(
            name=layer.name, inputs=list(layer.inputs), fwd=_timing(priced.fwd_ms), bwd=_timing(priced.bwd_ms),
            igrad=_timing(priced.igrad_ms), wgrad=_timing(priced.wgrad_ms), activation_bytes=priced.activation_bytes,
            wgrad_kept_bytes=priced.wgrad_kept_bytes, wgrad_gradient_bytes=priced.wgrad_gradient_bytes,
            activation_parts=priced.activation_parts, transient_bytes=priced.transient_bytes,
            float8_weight_bytes=(float8_weight_bytes(layer, FP8_RECIPES[parallel.fp8], experts.weight_shards,
                                                     parallel.fp8_param_gather) // t if parallel.fp8 else 0),
            shared_with_previous_bytes=0, output_bytes=layer.output_bytes // (t * parallel.context),
            model_output_bytes=layer.model_output_bytes // (vocabulary_ranks * parallel.context),
            runtime_buffer_bytes=scores_buffer_bytes(layer, parallel), follows_previous=layer.follows_previous,
            tied_layer=layer.tied_layer,
            param_bytes=params,
            all_gather_bytes=(gathered_weight_bytes(layer, params, parallel, element)
                              if parallel.fsdp_float8_all_gather or parallel.fp8_param_gather else None),
            grad_bytes=held.gradient_bytes(round(layer.grad_bytes * share)) // t,
            all_to_all_fwd_ms=all_to_all_fwd_ms, all_to_all_bwd_ms=all_to_all_bwd_ms,
            fwd_sharing_ms=shared.fwd_ms if shared else 0.0, bwd_sharing_ms=shared.bwd_ms if shared else 0.0,
            product_ms=persistent_product_ms(busiest, device, parallel, element, float8),
            **_ring_fields(priced),
            expert_param_bytes=layer.expert_param_bytes // experts.weight_shards // t,
            optimizer_state_bytes=state_bytes(layer)))
    if made is None:
        # the host, in some layer or at each exchange between stages
        waits = parallel.p2p_sync or any(synchronises(layer, counted.options) for layer in counted.layers)
        layers = _with_host_waits(layers, issues, waits)
    if memo is not None:
        memo.layers[key] = layers
        memo.priced.setdefault(priced_key, layers)

    def kept(what: tuple, make: Callable[[], Any]) -> Any:
        return make() if memo is None else memo.kept((key, *what), make)

    if (past := layers_past_limits(layers, SUMMED_BYTES)) is not None:
        raise PastLimitsError(past)
    costs = kept(("costs", optimizer), lambda: layer_costs(layers, optimizer))
    if bounds is None:
        bounds = partition(costs, parallel.pipeline,
                           stage_time=kept(("stage time",), lambda: stage_time(layers, parallel.p2p_sync)))
    weight_shards = experts.weight_shards

    def step_moved_bytes(layer: LayerCount) -> dict[str, float]:
        held = state_share(layer, parallel, weight_shards, element)
        return {name: (layer.optimizer_step_moved_bytes[name] * widen + 3 * ema * layer.param_bytes // element) * held
                for name in OPTIMIZERS}

    def layers_step_bytes() -> dict[str, list[float]]:
        moved = _per_block(counted, step_moved_bytes)
        return {name: [layer_moved[name] for layer_moved in moved] for name in OPTIMIZERS}

    # each layer's bytes an optimizer's step moves, found once a block and key: a stage's are its layers' summed in
    # their order
    step_bytes = kept(("step bytes",), layers_step_bytes)

    def memory_ms(nbytes: float) -> float:
        return curve.kernel_overhead_ms + nbytes / device.memory_bytes_per_ms

    step_casts_ms = _step_casts_ms(counted, parallel, device, element, weight_shards)
    stage_steps = []
    for start, stop in zip(bounds, bounds[1:]):
        # the weights this rank holds (its 1/t, and of the routed experts its 1/(E·ETP)), which its accumulation,
        # averaging, prediction and copy pass over: each layer's held `param_bytes` above
        own = owned_at(layers, start, stop)  # a tied layer's weights once
        params = sum(layers[i].param_bytes for i in own)
        # the step's work besides its optimizer's pass: float8 casts, the routers' all-reduce, scales' precompute
        besides_ms = sum(ms for layer_casts in step_casts_ms[start:stop] for ms in layer_casts)
        besides_ms += replicated_reduce_ms(counted.layers[start:stop], parallel, held, element, links.tensor)
        besides_ms += scale_precompute_ms(counted.layers[start:stop], parallel, device, links.data)
        passes_weights = _timing(memory_ms(3 * params))  # a prediction's and the averaging's pass (frozen: shared)
        steps = {name: StepTimes(step=_timing(besides_ms + memory_ms(sum(step_bytes[name][i] for i in own) / shards)),
                                 predict=passes_weights) for name in OPTIMIZERS}
        # a pass of its own over the weights it accumulates, read, read, write: all of them (separate), or those no
        # product accumulates (fused: `unfused_weight_share`)
        accumulated = params if parallel.accumulation == "separate" else sum(
            layer.param_bytes * unfused_weight_share(count, element)
            for layer, count in zip(layers[start:stop], counted.layers[start:stop], strict=True))
        accumulate_ms = memory_ms(3 * accumulated) if accumulated else 0.0
        stage_steps.append((steps, passes_weights, _timing(accumulate_ms), _timing(memory_ms(2 * params))))
    stages = aggregate_stages(layers, bounds, optimizer, boundary_bytes(layers, bounds, dag=False), stage_steps,
                              costs=costs, p2p_sync=parallel.p2p_sync)
    if parallel.fsdp_float8_all_gather:
        stages = [stage.model_copy(update={"gather_cast_ms": shard_cast_ms(counted.layers[start:stop], parallel,
                                                                            device)})
                  for stage, start, stop in zip(stages, bounds, bounds[1:])]
    link = LinkProfile(segments=[LinkSegmentModel(min_bytes=0, latency_ms=links.stage.latency_ms,
                                                  bytes_per_ms=links.stage.bytes_per_ms)],
                       points=[], meta={"estimated": f"{links.stage.kind} by the placement"})
    environment = Environment(
        device="cuda", device_name=gpu.name, device_memory_bytes=gpu.device_memory_bytes,
        memory_cap_bytes=None, dtype=counted.dtype, microbatch_size=counted.microbatch_size, threads=1,
        torch_version="", cuda_version=None, driver_version=None, python_version=platform.python_version(),
        pipesim_version=_version(), host="estimate", date=datetime.now(UTC).isoformat(timespec="seconds"))
    flops = sum(_per_block(counted, lambda layer: layer.model_flops))
    estimate = Estimate(gpu=gpu.name, parallelism={**asdict(parallel), "grad_accumulation": parallel.accumulation},
                        attention=counted.attention,
                        curve=curve.model_dump(), tensor_link=links.tensor, stage_link=links.stage,
                        context_link=links.context if parallel.context > 1 else None,
                        data_parallel_link=links.data, model_flops_per_sample=flops / counted.microbatch_size or None,
                        peak_flops_per_s=peak * 1e12, placement=placement)
    return Profile(schema_version=2, environment=environment, model=ModelInfo(
        name=counted.model, options={k: v for k, v in counted.options.items() if v is not None}),
        layers=layers, partition=Partition(bounds=list(bounds), optimizer=optimizer), stages=stages, link=link,
        allreduce=None, estimate=estimate)


# A layer's passes as the calibration times them, each as the count's ops describe it: its weight pass
# (autograd.grad on the weights after the input pass, the graph kept) walks every gradient on the way to the
# weights again, which in a layer whose first op has weights (a norm, an embedding) is the full backward's work.
CALIBRATED_OPS = {"fwd": "fwd", "bwd": "bwd", "igrad": "igrad", "wgrad": "bwd"}
FIT_PASSES = ("fwd", "bwd", "igrad")  # fitted; the weight pass repeats the backward's work and is only predicted
# The attention the fit counts a calibration's layers with: the kernel torch's scaled_dot_product_attention ran
# there, a fused one that keeps no s x s scores wherever calibrate runs (on CUDA flash in float16 and bfloat16 from
# sm80, else the memory-efficient kernel; on a CPU its own flash kernel since torch 2.2: torch._fused_sdp_choice
# answers FLASH_ATTENTION for a gpt's q, k and v there), which the count's "flash" is. Counted as "math", each gpt
# block of the first H200 calibration (traces/measured/gpu-check-h200) carried 0.75 GB of scores and 14 kernels
# its flash kernel never ran, and the fit put the products at 1.12 PFLOP/s, above the part's 989 peak. Not told
# apart: a CPU's math path under attention dropout, which its flash kernel does not take.
FIT_ATTENTION = "flash"
# The output tiles a CUDA device's matrix products pick from (NVIDIA's matmul guide, as the catalogue's parts list)
CUDA_TILES = ((256, 128), (128, 256), (128, 128))


def curve_terms(layer: LayerCount, name: str, multiprocessors: int, tiles: list[tuple[int, int]]
                ) -> tuple[float, float, float, int]:
    """The work of a pass of `layer` (the count's ops `CALIBRATED_OPS[name]`) as the curve's linear terms, one
    device, no parallelism: FLOPs of its products and other counted FLOPs over their tile fill, FLOPs of its
    attention kernels, bytes of its memory-bound ops, and its kernels. Its time is their sum, each over its
    achieved rate, plus a kernel overhead each, leaving out the roofline's floor, which large products never
    reach. A causal attention kernel's FLOPs are those it computes (`kernel_flops`)."""
    products = attention = memory = 0.0
    kernels = 0
    for op in layer.ops.get(CALIBRATED_OPS[name], ()):
        kernels += op.count
        if op.kind == "memory":
            memory += op.count * op.moved_bytes
        elif op.kind == "attention":
            attention += op.count * kernel_flops(op)
        else:
            fill = tile_fill(op.shape, multiprocessors, tiles) if op.kind == "matmul" else 1.0
            products += op.count * op.flops / fill
    return products, attention, memory, kernels


def fit_rates(measured: Profile, counted: WorkloadCount, multiprocessors: int, tiles: list[tuple[int, int]],
              kernel_overhead_ms: float | None = None, attention_flops_per_ms: float | None = None) -> FittedCurve:
    """A device's achieved rates fitted by non-negative least squares (numpy) to a calibration's measured
    per-layer times (the `FIT_PASSES` of every layer the count gives work in) on the same model's count, with
    the products' tile fill over `multiprocessors` × `tiles`. Each time is weighted by its inverse: the fit
    minimises relative errors, and a short layer counts as much as a long one. `kernel_overhead_ms` is the
    kernel overhead as measured on the device (calibrate/kernel.py); None fits it too, though one model size's
    layers hardly tell it from the memory-bound bytes (both grow with a layer's ops alike). A term whose weight
    comes out negative is left out (its rate: None, costs nothing measurable; refused for the products).
    `attention_flops_per_ms` holds the attention's rate rather than fitting it: one model size's blocks carry
    their attention and products in near-fixed ratio in every pass, so the fit splits them by small differences
    of noisy times (`separated_fit`). EstimateError where the calibration and the count are not of the same model,
    or the times do not follow the count."""
    import numpy as np

    if len(measured.layers) != len(counted.layers):
        raise EstimateError(f"the profile has {len(measured.layers)} layers, the count {len(counted.layers)}: "
                            "count the model the profile calibrated")
    work = {name: [curve_terms(layer, name, multiprocessors, tiles) for layer in counted.layers] for name in PASSES}
    rows, times = [], []
    for i, timed in enumerate(measured.layers):
        for name in FIT_PASSES:
            if work[name][i][3]:  # a pass the count gives work in
                rows.append(work[name][i])
                times.append(getattr(timed, name).median_ms)
    measured_ms = np.array(times)
    if not rows or (measured_ms <= 0).any():
        raise EstimateError("the profile has a layer pass of 0 ms the count gives work in: nothing to fit")
    terms = np.array(rows, dtype=float) / measured_ms[:, None]
    target = np.ones_like(measured_ms)
    used = terms.any(axis=0)
    coefficients = np.zeros(terms.shape[1])
    held = {3: kernel_overhead_ms,  # measured: the rest is fitted to what the kernels leave
            1: None if attention_flops_per_ms is None or not used[1] else 1 / attention_flops_per_ms}
    for i, value in held.items():
        if value is not None:
            coefficients[i], used[i] = value, False
            target -= terms[:, i] * value
    while True:  # non-negative: a term whose weight comes out negative is left out and the rest refitted
        coefficients[used] = np.linalg.lstsq(terms[:, used], target, rcond=None)[0]
        if (coefficients >= 0).all():
            break
        used &= coefficients > 0
        coefficients[coefficients < 0] = 0.0
    if coefficients[0] <= 0:
        raise EstimateError("the fit finds the matrix products cost nothing: the times do not follow the count")

    def rate(i: int) -> float | None:
        return 1 / float(coefficients[i]) if coefficients[i] > 0 else None

    residuals = {name: [float(np.dot(coefficients, done) / getattr(timed, name).median_ms - 1)
                        if done[3] and getattr(timed, name).median_ms > 0 else None
                        for done, timed in zip(work[name], measured.layers)] for name in PASSES}
    return FittedCurve(matmul_flops_per_ms=rate(0), attention_flops_per_ms=rate(1), memory_bytes_per_ms=rate(2),
                       kernel_overhead_ms=float(coefficients[3]),
                       kernel_overhead_measured=kernel_overhead_ms is not None, multiprocessors=multiprocessors,
                       tiles=list(tiles), passes=list(FIT_PASSES), attention=counted.attention, residuals=residuals)


def _efficiencies(fitted: FittedCurve, peak_flops_per_ms: float, memory_bytes_per_ms: float,
                  base: Curve) -> dict[str, float]:
    """The fitted rates over the datasheet's figures, as `curve_for` takes them."""
    return {"matmul_efficiency": fitted.matmul_flops_per_ms / peak_flops_per_ms,
            "attention_efficiency": (fitted.attention_flops_per_ms / peak_flops_per_ms
                                     if fitted.attention_flops_per_ms else base.attention_efficiency),
            "memory_efficiency": (fitted.memory_bytes_per_ms / memory_bytes_per_ms
                                  if fitted.memory_bytes_per_ms else 1.0)}


def separated_fit(fitted: FittedCurve, refit: Callable[[float], FittedCurve], peak_flops_per_ms: float,
                  memory_bytes_per_ms: float, base: Curve) -> tuple[FittedCurve, str]:
    """`fitted`, or where it puts a rate above the datasheet and prices attention, `refit` (the same layers fitted
    with the attention's rate held, FLOP/ms: `fit_rates`) at `base`'s attention efficiency, and a note saying so
    (empty where kept). One model size's blocks carry their attention and products in near-fixed ratio in every
    pass (a GPT block's fwd, bwd and igrad: products 1 : 2 : 1, attention 0.4 : 1 : 1), so the fit parts the two
    by small differences of noisy times, and a rate above the datasheet says that split is off, not the device:
    the H200 calibration traces/measured/gpu-check-h200-day9-masters timed its blocks' igrad 25 % slower than the
    one before it (1.042 ms, spread 0.11; fwd and bwd within 1 %), and the free fit put the products at 1.33 of
    the datasheet, the attention at 0.085. `curve_for` still refuses a refit above the datasheet: layers that ran
    faster than the part given can."""
    free = _efficiencies(fitted, peak_flops_per_ms, memory_bytes_per_ms, base)
    if max(free.values()) <= 1 or fitted.attention_flops_per_ms is None:
        return fitted, ""
    return refit(base.attention_efficiency * peak_flops_per_ms), (
        f", refitted with the attention held at the part's {base.attention_efficiency:.3g} of the datasheet (the "
        f"layers do not separate it from the products: fitted free, products {free['matmul_efficiency']:.3g}, "
        f"attention {free['attention_efficiency']:.3g})")


def curve_for(fitted: FittedCurve, peak_flops_per_ms: float, memory_bytes_per_ms: float, base: Curve,
              source: str) -> Curve:
    """The fitted rates as the curve of a part with this datasheet peak (FLOP/ms, the count's dtype) and memory
    bandwidth (bytes/ms): each rate over its datasheet figure. A rate the fit left out takes `base`'s
    efficiency (attention) or the datasheet's (memory); `base` gives the link's and the network's efficiencies
    (`Curve.network_efficiency`), which a fit to the layers does not give. EstimateError naming
    the efficiency where a rate exceeds the datasheet."""
    efficiencies = _efficiencies(fitted, peak_flops_per_ms, memory_bytes_per_ms, base)
    bad = [key for key, value in efficiencies.items() if value > 1]
    if bad:
        raise EstimateError(f"{bad[0]}: the fit gives {efficiencies[bad[0]]:.3g}, above 1: the datasheet figures "
                            "given are below what the calibration measured")
    measured = {"attention_passes": None} if fitted.attention_flops_per_ms else {}  # its one rate prices every pass
    return base.model_copy(update={**efficiencies, **measured, "kernel_overhead_ms": fitted.kernel_overhead_ms,
                                   "multiprocessors": fitted.multiprocessors, "tiles": list(fitted.tiles),
                                   "source": source})


@cache
def _version() -> str:
    """The installed pipesim's version, read from its metadata once a process (a search estimates hundreds)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("pipesim")
    except PackageNotFoundError:
        return "unknown"
