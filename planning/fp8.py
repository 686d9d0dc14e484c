"""Float8 training (`--dtype fp8`) as the estimate prices it: a transformer layer's linear products run at the
part's float8 peak (the catalogue's `fp8`) on the same efficiency curve and tile fill, reading float8 inputs and
writing 16-bit outputs; everything else stays in the count's 16-bit dtype: the attention's core
(TransformerEngine's DotProductAttention runs in bf16 unless the recipe sets fp8_dpa, False by default;
torchao.float8 converts nn.Linear modules only), norms, activations, the embedding and the output head
(Megatron-LM's output layer is not a TransformerEngine module; torchtitan's float8 converter skipped `output`,
its module_filter_fn of December 2024) and a mixture of experts' router (`OpCount.gating`: DeepSeek-V3's report,
3.3.1, keeps "MoE gating modules" in their original precision; Megatron-core's TopKRouter is no TransformerEngine
module). The recipe adds the scaling's memory-bound work as ops of their own, and
says what the forward saves for the backward. The recipes, `--fp8-recipe`:

te: TransformerEngine's delayed scaling (recipe.DelayedScaling, its default) as Megatron-LM runs it. A cast is
  one fused cast-transpose kernel: it reads the 16-bit tensor and writes its float8 copy and that copy's
  transpose (Hopper's float8 products take one layout only), recording the amax on the way (the scale comes
  from the amax history: no second pass). The forward casts each product's input, the backward its output's
  gradient once for both products. The weights are cast once per optimizer step and the casts kept
  (Linear.forward's `is_first_microbatch`, which Megatron-LM's TELinear passes for a step's first micro-batch):
  counted with the step, and held until the next (the cast and its transpose: 2 bytes a weight, beside the
  16-bit weights). The forward saves its float8 copy of each product's input, not the 16-bit one
  (transformer_engine/pytorch/module/linear.py: `saved_inputmat_t = inputmat_t` under fp8). A norm's output
  that Megatron-core's TELayerNormColumnParallelLinear reads (linear_qkv's, a dense MLP's linear_fc1's) is cast
  by the norm's own kernel, which writes it in float8, and transposed in the backward (`norms_in_float8`).
te-current: TransformerEngine's current scaling (recipe.Float8CurrentScaling; Megatron-core's fp8_recipe
  "tensorwise", Megatron-Bridge's fp8cs configs, the performance summaries' FP8-CS) as te otherwise: each tensor's
  scale comes from its own amax, so a cast is four kernels (transformer_engine/pytorch/csrc/quantizer.cpp,
  `Float8CurrentScalingQuantizer::quantize_impl`, at TransformerEngine v2.9, v2.12 and v2.14): the amax
  (`nvte_compute_amax_with_config`, which zeroes it first with a one-thread kernel and then reads the tensor:
  common/recipe/current_scaling.cu `launch_amax_kernel`'s `zero_amax_kernel<<<1, 1>>>` and `amax_kernel`), the
  scale from it (`nvte_compute_scale_from_amax`, one value) and the cast-transpose (`nvte_quantize_v2`); a norm's
  output that TELayerNormColumnParallelLinear reads three, no amax pass: the norm's kernel takes its amax as it
  writes it in 16 bits (`Fp8Recipe.norm_cast_kernels`). The amaxes' all-reduce over the tensor-parallel group it
  runs for a sequence-parallel input is not modelled.
torchao: torchao.float8's tensorwise dynamic scaling as torchtitan runs it (float8_linear.py,
  `matmul_with_hp_or_float8_args`). A cast is two kernels: the amax (reads the tensor) and the scaled cast
  (reads it, writes float8). The forward casts the input and the weight; the backward casts the output's
  gradient and the weight for the input gradient, then the output's gradient and the input again for the weight
  gradient, since the forward saves the 16-bit input and weight (`ctx.save_for_backward(input_hp,
  weight_hp_t)`): activation memory is the 16-bit run's. Under FSDP2 with its float8 all-gather
  (`gathered_in_float8`) no pass casts a weight. torchao has run so since pytorch/ao#1480 (January 2025: the
  input's cast moved into the autograd function, its 16-bit input saved) and #2594 (July 2025, c6de9b42a: the
  weight's too).
torchao-2024: torchao.float8's tensorwise dynamic scaling as it was at eab345c (December 2024), the commit
  torchtitan's December 2024 benchmarks name (docs/performance.md; benchmarks/published/). `Float8Linear.forward`
  casts the input and the weight once each (`cast_input_to_float8`, `cast_weight_to_float8_t`: amax and scaled
  cast, as torchao's), `manual_float8_matmul_with_args_in_float8` saves both float8 copies
  (`ctx.save_for_backward(input_fp8, weight_fp8_t)`) and reuses them for the input and weight gradients, and
  `NoopFwToFloat8BwDynamic` casts the output's gradient once for both backward products. So the backward casts
  the gradient only, the forward keeps each product's input as its float8 copy (1 byte an element, as te) and,
  per micro-batch until its backward, a float8 copy of each weight and its float32 scale (1/t of the weight on
  each of t tensor-parallel ranks, not split by tokens): a copy the activation recomputation torchtitan runs
  (full, or its op policy, whose save list keeps no cast) makes again in the backward instead. Under FSDP2's
  float8 all-gather the saved weight is the gathered parameter itself (FSDP2 frees and gathers it again): no copy.

The routed experts' grouped products (a mixture of experts', `OpCount.routed`): te runs them in float8 too, as
Megatron-core's TEGroupedMLP does (TransformerEngine's GroupedLinear under the same fp8_autocast, each expert's
input, output gradient and, once a step, weight cast as a linear product's; a rank casts and holds only its E
expert-parallel share of the weights); torchao does not (torchtitan's float8 converter swaps nn.Linear modules,
and its grouped experts are not: their products stay 16-bit). Under te a routed product keeps its input's float8
copy for the backward, as a linear product does (transformer_engine/pytorch/module/grouped_linear.py keeps the
quantized `inputmats`, their transposes only); the count marks it a product's input (workload/count.py).

deepseek: DeepSeek-V3's own (its report, arXiv 2412.19437, section 3.3): te's casts, float8 copies of the products'
  inputs saved and weights cast once a step (its 1x128 activation tiles and 128x128 weight blocks are cast as one
  pass each, as te's), and its low-precision storage (3.3.3): the attention's output, which its backward and the
  output projection's weight gradient both read, kept once in its E5M6 format (12 bits: 1.5 bytes an element; the
  kernel's own 16-bit copy dropped); the routed experts' SwiGLU inputs kept in float8 (1 byte); what else it keeps
  stays 16-bit. Each cached copy is one cast in the forward (reads 16 bits, writes the format) and one read back
  in the backward (`cache_ops`). Of the output gradients a split backward keeps from I until W (DualPipe's
  `WeightGradStore`, planning/estimate.py `wgrad_kept`), the routed down-projection's at 1 byte an element and a
  float32 scale a 1x128 tile of each row, a row's partial tile too (`routed_output_gradient_tile`): 3.3.3, "A
  similar strategy is applied to the activation gradient before MoE down-projections" (quantized into FP8 with
  power-of-2 scales, as the dispatched activation, so that the backward converts its 1x128 tiles to the 128x1 the
  Wgrad GEMM reads without another 16-bit copy, as it does the attention output's; the sentence is the
  communication paragraph's: the gradient arrives in FP8, and that a deferred W keeps that copy is our reading,
  no text says which copy W keeps); 3.3.2, "the Wgrad operation is performed in FP8". Every other
  output gradient stays 16-bit until W: the report quantizes them for the products but says not which copy a
  deferred W keeps, and DualPipe's example linear (deepseek-ai/DualPipe, examples/example_dualpipe.py
  `LinearFunc.backward`) puts the 16-bit `grad_output` in the store.

FSDP2's float8 all-gather (torchtitan's `enable_fsdp_float8_all_gather` with
`precompute_float8_dynamic_scale_for_fsdp`, as its Llama 3.1 405B config sets them at 9dec370; torchao
float8/fsdp_utils.py at eab345c, the commit its December 2024 benchmarks name): a Float8Linear's weight is a
`WeightWithDynamicFloat8CastTensor`, whose `fsdp_pre_all_gather` casts the rank's shard to float8 with the scale
`precompute_float8_dynamic_scale_for_fsdp` computed after the optimizer step (one `_foreach_norm` over the shards
and one all-reduce of the amaxes for all of them), FSDP2 all-gathers the float8 bytes, and `fsdp_post_all_gather`
wraps the gathered bytes as the Float8Tensor the products read: the whole weight held at 1 byte an element (and its
float32 scale), and no pass casts it again (`cast_weight_to_float8_t`, and the backward's `tensor_already_casted_
to_fp8`, return it as it is). Only the recipes whose weights are cast per use can (`casts_weights_per_use`).

Accumulation (`split_accumulation`): Hopper's float8 tensor cores accumulate in reduced precision, so a product
may add its partial sums into float32 every few steps instead (cuBLASLt's CUBLASLT_MATMUL_DESC_FAST_ACCUM off),
which runs slower. te and te-current run the forward's products with fast accumulation and the backward's without
(transformer_engine/pytorch/module/base.py: `_2X_ACC_FPROP = False`, `_2X_ACC_DGRAD = True`, `_2X_ACC_WGRAD =
True`; common/gemm/cublaslt_gemm.cu sets `fastAccuMode = use_split_accumulator ? 0 : 1`); torchao the same
(Float8LinearConfig: `use_fast_accum` for the output only, pytorch/ao#2377). Such a product runs at the curve's
`fp8_split_accumulation_efficiency` (hardware/catalogue.py: the float8 MAMF, measured through torch._scaled_mm
with its default `use_fast_accum=False`), a fast-accumulating one at `matmul_efficiency` (fast accumulation
measured 1.1-1.2x faster, pytorch/ao#2377: about the bf16 share). deepseek's products are DeepSeek's own kernels
(DeepGEMM: promotion to CUDA cores every 128 elements, "up to 1550 TFLOPS on H800", 78 % of the peak, in all
passes), not cuBLAS's: none is priced split.

Not modelled: casts fused into an activation kernel (LayerNormMLP's, which Megatron-core's layers do not run:
their activation is a kernel of its own, its output cast by linear_fc2 as priced; TransformerEngine 1.x's
row-parallel casts under sequence parallelism, a cast and a later transpose, counted as one cast-transpose: under
0.5 % of any published run, docs/hardware.md "Casts TransformerEngine 1.10 fuses or splits"), a norm recomputed
alone (`--recompute-modules layernorm`) rerun writing float8, torch.compile's fusions of torchao's casts. Pure
arithmetic on counts: no torch.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

from ..profiles.workload import LayerCount, OpCount
from .te import BIAS_GRADIENT_PASSES, float8_norm_outputs, norm_read_products, te_modules, without_fused_bias_sums

if TYPE_CHECKING:
    from .estimate import ContextRing

FP8_BYTES = 1
BACKWARD_PASSES = ("bwd", "igrad", "wgrad")


@dataclass(frozen=True)
class Fp8Recipe:
    """A float8 recipe's extra work and memory. `casts`: per pass, the tensors cast for each linear product
    (input, weight, grad: its output's gradient); `kernels`: one cast's kernels, each as (name, 16-bit reads,
    float8 writes) per element; `weights_per_step`: the weights cast once per optimizer step instead of in the
    passes, and their casts held until the next, `weight_copy_bytes` a weight; `saves_float8_inputs`: the
    forward saves each product's input as its float8 copy; `routed`: the routed experts' grouped products run in
    float8 too; `attention_output_bytes`: the attention's output (the count's "attention_out" region) kept once,
    for the attention's backward and the next product's, at that many bytes an element; `activation_input_bytes`:
    the routed experts' activation inputs (the "moe_act" region's, saved) at that many (None: as counted);
    `split_accumulation`: the passes whose float8 products add their partial sums into float32 every few steps
    (`OpCount.split_accumulation`) rather than accumulate fast in the tensor cores; `saves_float8_weights`: the
    forward saves each product's float8 weight copy and its scale for the backward (`saved_weight_bytes`);
    `gathers_float8`: a sequence-parallel all-gather moves the float8 copy, cast before it gathers
    (TransformerEngine's, planning/estimate.py); `fuses_split_casts`: a routed product run per local expert
    (planning/experts.py `per_expert_products`) has its experts' splits cast by one kernel, where otherwise each
    split is cast on its own (TransformerEngine's `split_quantize`, pytorch/csrc/extensions/cast.cpp
    `multi_tensor_quantize_impl` at 006b336: `nvte_multi_cast_transpose` for delayed scaling's quantizers only,
    "Quantize kernels individually" for the rest); `routed_output_gradient_tile`: the routed experts'
    down-projection's output gradient kept for a deferred weight pass in float8, a float32 scale a tile of that many
    elements of a row (None: as counted); `delayed_scaling`: TransformerEngine's delayed scaling as its 1.x
    modules run it (te's, as the H100 runs' v1.10-era containers ran it); the work it adds beside the products is
    its three properties' (`fuses_bias_gradients`, `clones_scale_inverses`, `reduces_and_updates_amaxes`);
    `product_multiples`: what the float8 products' shapes on a rank must be multiples of, as (rows, output
    features, input features), where the runtime refuses others (planning/estimate.py `check_float8_shapes`);
    `norm_cast_kernels`: the kernels that cast a product's input a TransformerEngine LayerNormLinear's norm wrote
    (planning/te.py `float8_norm_outputs`), its norm's kernel doing the rest: under delayed scaling none, the norm
    writes float8 (`norms_write_float8`, `norms_in_float8`), at v1.7 to v1.11 and v2.x alike (csrc/extensions/
    normalization.cpp, "Always used fused kernel for FP8 delayed scaling"); under current scaling the norm takes its
    output's amax and writes 16 bits, and the cast zeroes the amax first, then runs the scale and the cast-transpose
    but no amax pass (`create_hp_tensor_with_amax` and `quantize_with_amax`: normalization.cpp's
    `force_unfused_kernel` at v2.7, its `Impl::FUSED_NORM_AMAX_FP8` at v2.9, v2.12 and v2.14)."""

    casts: dict[str, tuple[str, ...]]
    kernels: tuple[tuple[str, int, int], ...]
    weights_per_step: bool
    saves_float8_inputs: bool
    weight_copy_bytes: int = 0
    routed: bool = False
    attention_output_bytes: float | None = None  # the attention's output kept once at this many bytes an element
    activation_input_bytes: float | None = None  # the routed experts' activation (SwiGLU) inputs kept so
    split_accumulation: tuple[str, ...] = ()  # the passes (of PASSES) whose float8 products accumulate split
    saves_float8_weights: bool = False  # the forward saves each product's float8 weight copy for the backward
    gathers_float8: bool = False  # sequence-parallel all-gathers move the float8 copies
    fuses_split_casts: bool = False  # a per-expert product's splits cast by one kernel (`per_expert_products`)
    routed_output_gradient_tile: int | None = None  # the routed down-projection's output gradient kept so until W
    delayed_scaling: bool = False  # TransformerEngine's delayed scaling, an amax history, as its 1.x modules run it
    # the kernels that cast a product's input a LayerNormLinear's norm wrote, its norm kernel doing the rest (None: as
    # any input's, `kernels`)
    norm_cast_kernels: tuple[tuple[str, int, int], ...] | None = None
    # TransformerEngine's `assert_dim_for_fp8_exec` on a float8 product's input and weight (pytorch/utils.py: all
    # but the last dimension's product a multiple of 8, the last of 16): rows, output features 8, input features 16
    product_multiples: tuple[int, int, int] = (8, 8, 16)

    @property
    def fuses_bias_gradients(self) -> bool:
        """Under TransformerEngine's layers (`--linear-kernel te`) a product's bias gradient comes out of its output
        gradient's cast (planning/te.py): under delayed scaling, at v1.10 and v2.9 alike."""
        return self.delayed_scaling

    @property
    def clones_scale_inverses(self) -> bool:
        """Each TransformerEngine module's forward clones its scale-inverses, one small kernel a module
        (planning/te.py `te_modules`) and forward (`in_float8`): `fp8_meta["scaling_fwd"].scale_inv.clone()` in
        linear.py and layernorm_linear.py at v1.7 to v1.10, grouped_linear.py at v1.9 and v1.10, gone from the
        three at v1.11, from layernorm_mlp.py at v2.0. A 2.x run of delayed scaling has none: a recipe for one
        would state this apart from `delayed_scaling`."""
        return self.delayed_scaling

    @property
    def reduces_and_updates_amaxes(self) -> bool:
        """Delayed scaling's amax history, all-reduced when a chunk's forward and its backward end and updated by
        the kernels around that (`reduce_and_update_fp8_tensors`: fp8.py at v1.7, v1.10 and v1.12, quantization.py
        at v2.9; planning/scenario.py `amax_reduction_ms`, `amax_update_ms`); current scaling takes each tensor's
        amax as it casts it and DeepSeek-V3 each tile's, with no history."""
        return self.delayed_scaling

    @property
    def norms_write_float8(self) -> bool:
        """A TransformerEngine LayerNormLinear's norm writes its product's input in float8, the whole cast
        (`norms_in_float8`): no kernel of the cast is left to the product (`norm_cast_kernels`)."""
        return self.norm_cast_kernels == ()


FP8_RECIPES = {
    "te": Fp8Recipe(casts={"fwd": ("input",), "bwd": ("grad",), "igrad": ("grad",), "wgrad": ()},
                    kernels=(("cast_transpose", 1, 2),), weights_per_step=True, saves_float8_inputs=True,
                    weight_copy_bytes=2 * FP8_BYTES, routed=True, split_accumulation=BACKWARD_PASSES,
                    gathers_float8=True, fuses_split_casts=True, delayed_scaling=True, norm_cast_kernels=()),
    "torchao": Fp8Recipe(casts={"fwd": ("input", "weight"), "bwd": ("grad", "weight", "grad", "input"),
                                "igrad": ("grad", "weight"), "wgrad": ("grad", "input")},
                         kernels=(("amax", 1, 0), ("cast", 1, 1)), weights_per_step=False, saves_float8_inputs=False,
                         split_accumulation=BACKWARD_PASSES,
                         # torch._scaled_mm takes both operands' dimensions in multiples of 16 but the first's rows
                         # (aten/src/ATen/native/cuda/Blas.cpp), and the weight gradient's first operand is the
                         # output gradient transposed: its rows, the tokens, are a contraction there
                         product_multiples=(16, 16, 16)),
}
FP8_RECIPES["te-current"] = replace(FP8_RECIPES["te"], kernels=(("zero_amax", 0, 0), ("amax", 1, 0), ("scale", 0, 0),
                                                                  ("cast_transpose", 1, 2)), fuses_split_casts=False,
                                    delayed_scaling=False,
                                    norm_cast_kernels=(("zero_amax", 0, 0), ("scale", 0, 0), ("cast_transpose", 1, 2)))
FP8_SCALE_BYTES = 4  # a tensorwise scale: one float32 a tensor
# the scale-inverses a TransformerEngine 1.x module's forward keeps: its input's, weight's and output's
# (fp8_meta["scaling_fwd"], `num_gemms * 3`), which `clones_scale_inverses` copies
SCALE_INVERSES = 3
# DeepSeek-V3's activation tile (its report, 3.3.2): 1x128 elements a float32 scale, as deepseek-ai/DeepGEMM's
# `gemm_fp8_fp8_bf16_nt` takes them (its LHS scales: float32, (m, ceil(k / 128)))
TILE_ELEMENTS = 128
FP8_RECIPES["deepseek"] = replace(FP8_RECIPES["te"], attention_output_bytes=1.5, activation_input_bytes=FP8_BYTES,
                                  split_accumulation=(), delayed_scaling=False, norm_cast_kernels=None,
                                  routed_output_gradient_tile=TILE_ELEMENTS)
FP8_RECIPES["torchao-2024"] = replace(FP8_RECIPES["torchao"], casts={"fwd": ("input", "weight"), "bwd": ("grad",),
                                                                      "igrad": ("grad",), "wgrad": ()},
                                      saves_float8_inputs=True, saves_float8_weights=True)


# FSDP2's float8 all-gather's cast of a rank's float32 shard with its precomputed scale, eager in the pre-all-gather
# hook (torchao's hp_tensor_and_scale_to_float8: `tensor.to(torch.float32) * scale`, then to_fp8_saturated's clamp
# and `.to(float8_dtype)`): per kernel, the bytes it reads and writes an element
SHARD_CAST_KERNELS = ((4, 4), (4, 4), (4, FP8_BYTES))
# NeMo's distributed Adam casting a rank's float32 shard of a TransformerEngine float8 weight: one kernel reading
# 4 bytes and writing 1 an element (`step_cast_ops`)
SHARD_FLOAT8_CAST_BYTES = 4 + FP8_BYTES
# precompute_float8_dynamic_scale_for_fsdp's kernels beside its one pass over the shards (`_foreach_norm`): the
# amaxes stacked, clamped, widened to float64 and divided into the format's largest value
SCALE_PRECOMPUTE_KERNELS = 4


def casts_weights_per_use(recipe: Fp8Recipe) -> bool:
    """The recipe casts a weight in the passes that read it (torchao's), which FSDP2's float8 all-gather moves to
    the rank's shard before the gather."""
    return any("weight" in roles for roles in recipe.casts.values())


def per_use_recipes() -> tuple[str, ...]:
    """The names of the recipes that cast weights per use (`casts_weights_per_use`): those FSDP2's float8
    all-gather takes, which its refusals name."""
    return tuple(name for name, recipe in FP8_RECIPES.items() if casts_weights_per_use(recipe))


def gathered_in_float8(recipe: Fp8Recipe) -> Fp8Recipe:
    """The recipe under FSDP2's float8 all-gather: the weights arrive as float8, so no pass casts one, and a
    forward that saves its float8 weight saves the gathered parameter, which FSDP2 frees and gathers again."""
    return replace(recipe, casts={name: tuple(role for role in roles if role != "weight")
                                  for name, roles in recipe.casts.items()}, saves_float8_weights=False)


def saved_weight_bytes(recipe: Fp8Recipe, elements: float, tensors: int) -> float:
    """The float8 weight copies and their float32 scales the recipe's forward saves for the backward (torchao at
    eab345c), per micro-batch on a rank that holds `elements` of its float8 linears' `tensors` weights
    (planning/estimate.py `float8_weights_on_rank`), whatever the tokens; 0 for a recipe that saves none."""
    if not recipe.saves_float8_weights:
        return 0.0
    return elements * FP8_BYTES + tensors * FP8_SCALE_BYTES


def float8_products(layer: LayerCount, recipe: Fp8Recipe) -> list[OpCount]:
    """A transformer layer's forward products the recipe runs in float8 (none in another layer)."""
    return [op for op in layer.ops.get("fwd", ()) if _converted(op, recipe)] if layer.transformer_layer else []


def float8_weights(layer: LayerCount, recipe: Fp8Recipe) -> tuple[int, int]:
    """The weights of a transformer layer's products the recipe runs in float8 (its float8 linears): their elements
    and how many tensors (none in another layer). A routed product's are its experts' all."""
    products = float8_products(layer, recipe)
    return (sum(op.count * op.shape[0] * op.shape[2] * op.shape[3] for op in products),
            sum(op.count * op.shape[0] for op in products))


def _linear(op: OpCount) -> bool:
    return op.kind == "matmul" and op.shape[0] == 1 and not op.routed


def _converted(op: OpCount, recipe: Fp8Recipe) -> bool:
    """A product the recipe runs in float8: a linear one, or with `recipe.routed` a routed experts' grouped one; not
    a router's gating product, which stays in its own precision (DeepSeek-V3's report, 3.3.1; Megatron-core's
    router is no TransformerEngine module)."""
    return not op.gating and (_linear(op) or (recipe.routed and op.kind == "matmul" and op.routed))


def _in_float8(op: OpCount, element_bytes: int, split_accumulation: bool) -> OpCount:
    """A linear product reading float8 inputs (1 byte an element) and writing its 16-bit output, its partial sums
    added into float32 every few steps where `split_accumulation`."""
    batch, m, n, k = op.shape
    return replace(op, moved_bytes=batch * (m * k + k * n) * FP8_BYTES + batch * m * n * element_bytes, float8=True,
                   split_accumulation=split_accumulation)


def cast_ops(products: tuple[OpCount, ...], roles: tuple[str, ...], recipe: Fp8Recipe,
             element_bytes: int, expert_ranks: int = 1, norm_inputs: Counter | None = None) -> tuple[OpCount, ...]:
    """The memory-bound kernels casting each of `roles`' tensors of every forward product (each of its `batch`
    products' m × k input, n × k weight, m × n output gradient) to float8; a routed product's weights only the
    1/`expert_ranks` of its experts one rank holds; of the products of each shape, as many inputs as `norm_inputs`
    counts (a norm's outputs: planning/te.py `norm_read_products`) by the recipe's `norm_cast_kernels`, taken once
    over the products of a shape (Qwen2's biased q and unbiased o are two products of one shape; only q reads the
    norm)."""
    ops = []
    norm_left = Counter(norm_inputs or ())
    for product in products:
        batch, m, n, k = product.shape
        shapes = {"input": (m, k), "weight": (n, k), "grad": (m, n)}
        norm_fed = min(product.count, norm_left[product.shape])
        norm_left[product.shape] -= norm_fed
        fused = product.routed and recipe.fuses_split_casts  # every local expert's split in one kernel
        for role in roles:
            held = batch // expert_ranks if role == "weight" and product.routed else batch
            rows, cols = shapes[role]
            elements = held * rows * cols  # a call's: its batch of tensors
            normed = norm_fed if role == "input" else 0
            for kernels, calls in ((recipe.kernels, product.count - normed), (recipe.norm_cast_kernels or (), normed)):
                if not calls:
                    continue
                kernel_elements, calls = (elements * calls, 1) if fused else (elements, calls)
                ops += [OpCount(f"fp8_{kernel}_{role}", "memory", shapes[role], 0,
                                kernel_elements * (reads * element_bytes + writes * FP8_BYTES), calls)
                        for kernel, reads, writes in kernels]
    return tuple(ops)


def in_float8(layer: LayerCount, recipe: Fp8Recipe, element_bytes: int) -> LayerCount:
    """`layer` as the recipe runs it: in a transformer layer, every pass's linear products in float8 with the
    recipe's casts after them (those a recomputation reruns in float8 too), and what its forward saves (a tensor
    only the products saved as its float8 copy, one another op saves too beside its float8 copy, those the recipe
    caches in a format of its own as `cached_saves` says); any other layer unchanged."""
    if not layer.transformer_layer:
        return layer
    products = tuple(op for op in layer.ops.get("fwd", ()) if _converted(op, recipe))
    norms = float8_norm_outputs(layer) if recipe.norm_cast_kernels is not None else ()
    norm_inputs = norm_read_products(layer, norms) if norms else None
    ops = {name: tuple(_in_float8(op, element_bytes, name in recipe.split_accumulation) if _converted(op, recipe)
                       else op for op in passed)
           + cast_ops(products, recipe.casts[name], recipe, element_bytes, norm_inputs=norm_inputs)
           for name, passed in layer.ops.items()}
    if norms and recipe.norms_write_float8:
        ops = norms_in_float8(ops, layer, norms, element_bytes)
    saved = layer.saved_tensors
    if recipe.saves_float8_inputs and layer.linear_input_saves:
        def kept(nbytes: int, how: str) -> int:
            float8 = nbytes // element_bytes * FP8_BYTES
            return {"only": float8, "also": nbytes + float8, "": nbytes}[how]

        saved = tuple((shape, kept(nbytes, how)) for (shape, nbytes), how in zip(saved, layer.linear_input_saves))
    cached = cached_saves(layer, recipe, element_bytes)
    saved = tuple((shape, cached.get(i, nbytes)) for i, (shape, nbytes) in enumerate(saved))
    ops["fwd"] += cache_ops(layer, cached, element_bytes, forward=True)
    if recipe.clones_scale_inverses and (modules := te_modules(layer, recipe.routed)):
        ops["fwd"] += (OpCount("fp8_scale_inv_clone", "memory", (SCALE_INVERSES,), 0,
                               2 * SCALE_INVERSES * FP8_SCALE_BYTES, modules),)
    for name in ("bwd", "igrad"):
        ops[name] = ops.get(name, ()) + cache_ops(layer, cached, element_bytes, forward=False)
    delta = sum(nbytes for _, nbytes in saved) - sum(nbytes for _, nbytes in layer.saved_tensors)
    rerun = {name: tuple(_in_float8(op, element_bytes, "fwd" in recipe.split_accumulation)
                         if _converted(op, recipe) else op for op in region)
             for name, region in layer.region_ops.items()}  # a recomputed forward product reads its float8 input
    return replace(layer, ops=ops, saved_tensors=saved, saved_bytes=layer.saved_bytes + delta, region_ops=rerun,
                   weight_grad_outputs=kept_output_gradients(layer, recipe, element_bytes))


def norms_in_float8(ops: dict[str, tuple[OpCount, ...]], layer: LayerCount,
                    outputs: tuple[tuple[int, tuple[int, ...]], ...],
                    element_bytes: int) -> dict[str, tuple[OpCount, ...]]:
    """A layer's passes (`ops`) with each norm output of `outputs` (planning/te.py `float8_norm_outputs`) written
    in float8 by the norm's kernel, as TransformerEngine's LayerNormLinear runs it under delayed scaling
    (module/layernorm_linear.py at v1.7 to v1.11: `ln_out_dtype = torch.uint8`, its norm `layernorm_fwd_fp8` or
    `rmsnorm_fwd_fp8`, module/_common.py `_apply_normalization`; v2.x alike, csrc/extensions/normalization.cpp
    "Always used fused kernel for FP8 delayed scaling"): one forward call of the norm's kernel writes 1 byte an
    element, not 16 bits, and the products that read it cast no input (`cast_ops`: `norm_cast_kernels` none), and
    the weight-gradient passes transpose it, reading and writing 1 byte an element, one kernel (`ln_out_total_t =
    tex.fp8_transpose(ln_out_total, ...)` before the weight-gradient GEMM), where a cast-transpose wrote the
    transpose in the forward. Under sequence parallelism that transposes the gathered tensor: what the rank's share
    leaves is `gathered_transposes_ms`'s (planning/estimate.py)."""
    kernels = {(op.op, op.shape) for op in layer.region_ops.get("layernorm", ())}
    written = Counter(math.prod(shape) for _, shape in outputs)
    forward = []
    for op in ops.get("fwd", ()):
        elements = math.prod(op.shape)
        fused = min(op.count, written[elements]) if (op.op, op.shape) in kernels else 0
        written[elements] -= fused
        if fused:  # its output written at 1 byte an element, not `element_bytes`
            saved = elements * (element_bytes - FP8_BYTES)
            forward.append(replace(op, count=fused, moved_bytes=op.moved_bytes - saved))
        if op.count > fused:
            forward.append(replace(op, count=op.count - fused))
    shapes = Counter(shape for _, shape in outputs)
    transposes = tuple(OpCount("fp8_transpose_input", "memory", shape, 0, math.prod(shape) * 2 * FP8_BYTES, count)
                       for shape, count in shapes.items())
    return {name: tuple(forward) if name == "fwd" else passed + transposes * (name in BIAS_GRADIENT_PASSES)
            for name, passed in ops.items()}


def gathered_norm_share(layer: LayerCount, recipe: Fp8Recipe) -> float:
    """Of the product inputs sequence parallelism gathers in `layer` (`LayerCount.sequence_inputs`), the share a
    norm writes in float8 under the recipe (`norms_in_float8`), whose weight-gradient pass transposes the rank's
    share already (planning/estimate.py `gathered_transposes_ms`); 0 where none is gathered."""
    gathered = {number for _, number in layer.sequence_inputs}
    if not (recipe.norms_write_float8 and gathered):
        return 0.0
    return len(gathered.intersection(number for number, _ in float8_norm_outputs(layer))) / len(gathered)


def kept_output_gradients(layer: LayerCount, recipe: Fp8Recipe, element_bytes: int
                          ) -> tuple[tuple[tuple[int, int, int, int], int, bool], ...]:
    """`layer.weight_grad_outputs` as the recipe keeps them until a deferred weight pass: the routed experts'
    down-projection's in float8 with a float32 scale a `routed_output_gradient_tile` of each of its rows of n (a
    partial tile scaled too, as DeepGEMM's ceil(k / 128) scales), the rest as counted. The count records a grouped
    product as (experts, rows, n, k), a linear one with batch 1 (workload/count.py `_record_product`), and marks
    the grouped ones (`LayerCount.weight_grad_routed`: one routed expert's batch is 1 too); only the routed experts'
    products are grouped (shared experts run linear ones: `_SaverParts._weighted`), and they run their
    up-projection, gated or not, then their down-projection (workload/moe.py `routed_experts`): the down-projection
    is the last grouped one, whatever the experts' number, --expert-gemm or the expert ranks (which split it
    later)."""
    outputs = layer.weight_grad_outputs
    routed = [i for i, grouped in enumerate(layer.weight_grad_routed) if grouped]
    if recipe.routed_output_gradient_tile is None or not (recipe.routed and routed):
        return outputs
    shape, nbytes, shares_input = outputs[routed[-1]]
    width = shape[2]
    rows = nbytes // element_bytes // width
    kept = rows * (width * FP8_BYTES + math.ceil(width / recipe.routed_output_gradient_tile) * FP8_SCALE_BYTES)
    return (*outputs[:routed[-1]], (shape, kept, shares_input), *outputs[routed[-1] + 1:])


@dataclass
class Float8Forms:
    """The layers one estimate prices as its recipe runs them (`in_float8`; `recipe` None: as counted), with the bias
    gradients its runtime fuses into their products dropped where `bias_fused` (planning/te.py), each built
    once: a layer's passes on each device and its routed part (planning/estimate.py `estimate_layer`), its products'
    times (`persistent_product_ms`) and its kernels' issue (host.py `pass_kernels`) read the same form. `of` a
    layer with a context ring converts the layer as the ring keeps it (`ContextRing.kept`, the count's own storages
    before the float8 copies), kept once too. Each is found by its layer's identity (and the ring), the layer held
    beside it so that no identity is reused while the estimate lasts (a count's layers are frozen)."""

    recipe: Fp8Recipe | None
    element_bytes: int
    bias_fused: bool = False
    built: dict[tuple, tuple[LayerCount, LayerCount]] = field(default_factory=dict)

    def of(self, layer: LayerCount, ring: ContextRing | None = None) -> LayerCount:
        if ring is not None:
            layer = self._once(("kept", id(layer), ring), layer, ring.kept)
        return self._once(("run", id(layer)), layer, self._run)

    def _run(self, counted: LayerCount) -> LayerCount:
        layer = without_fused_bias_sums(counted) if self.bias_fused else counted
        return layer if self.recipe is None else in_float8(layer, self.recipe, self.element_bytes)

    def _once(self, key: tuple, layer: LayerCount, make: Callable[[LayerCount], LayerCount]) -> LayerCount:
        if key not in self.built:
            self.built[key] = (layer, make(layer))
        return self.built[key][1]


def cached_saves(layer: LayerCount, recipe: Fp8Recipe, element_bytes: int) -> dict[int, int]:
    """The saved tensors (by index in `layer.saved_tensors`) the recipe keeps in a format of its own, with their
    bytes: of the attention's output and the copies made of it (the "attention_out" region), the next product's
    input at `attention_output_bytes` an element and the other 16-bit copies none (the same values, kept once);
    the routed experts' saved activation inputs at `activation_input_bytes`."""
    cached: dict[int, int] = {}
    if recipe.attention_output_bytes is not None:
        for i in layer.region_saves.get("attention_out", ()):
            shape, nbytes = layer.saved_tensors[i]
            elements = math.prod(shape)
            if layer.linear_input_saves and layer.linear_input_saves[i]:
                cached[i] = math.ceil(elements * recipe.attention_output_bytes)
            elif nbytes == elements * element_bytes:
                cached[i] = 0
    if recipe.activation_input_bytes is not None:
        for _, shape, _, _, i in layer.region_inputs.get("moe_act", ()):
            if i >= 0:
                cached[i] = math.ceil(math.prod(shape) * recipe.activation_input_bytes)
    return cached


def cache_ops(layer: LayerCount, cached: dict[int, int], element_bytes: int, forward: bool) -> tuple[OpCount, ...]:
    """The memory-bound kernels of the recipe's cached copies (`cached_saves`): each written in the forward from
    its 16-bit tensor, read back into 16 bits in the backward (a copy kept as none is neither)."""
    ops = []
    for i, nbytes in cached.items():
        shape, _ = layer.saved_tensors[i]
        if nbytes:
            moved = math.prod(shape) * element_bytes + nbytes
            ops.append(OpCount("fp8_cache" if forward else "fp8_uncache", "memory", shape, 0, moved, 1))
    return tuple(ops)


def _weighed_products(layer: LayerCount, recipe: Fp8Recipe) -> tuple[OpCount, ...]:
    """A transformer layer's forward linear products whose weights the recipe casts once a step (none else)."""
    if not (recipe.weights_per_step and layer.transformer_layer):
        return ()
    return tuple(op for op in layer.ops.get("fwd", ()) if _converted(op, recipe))


def step_cast_ops(layer: LayerCount, recipe: Fp8Recipe, element_bytes: int, expert_ranks: int = 1,
                  float8_shards: int | None = None) -> tuple[OpCount, ...]:
    """The weight casts a recipe runs once per optimizer step (TransformerEngine's), for a transformer layer on
    one of `expert_ranks` expert-parallel ranks. With the weights kept as TransformerEngine's float8 tensors and
    all-gathered so over `float8_shards` ranks (`fp8_param_gather`) no pass casts a 16-bit weight: NeMo's
    distributed Adam casts each rank's float32 shard to float8 (`_check_params_shard_dtypes`, `cast_to_fp8`) and,
    once gathered, fills each weight's transpose cache from its float8 data (`_param_copy_fragments`,
    `transpose(update_cache=True)`; nemo/core/optim/distributed_adam.py)."""
    products = _weighed_products(layer, recipe)
    if float8_shards is None:
        return cast_ops(products, ("weight",), recipe, element_bytes, expert_ranks)
    ops = []
    for product in products:
        batch, _, n, k = product.shape
        elements = (batch // expert_ranks if product.routed else batch) * n * k
        ops += [OpCount("fp8_shard_cast_weight", "memory", (n, k), 0,
                        elements * SHARD_FLOAT8_CAST_BYTES // float8_shards, product.count),
                OpCount("fp8_transpose_weight", "memory", (n, k), 0, elements * 2 * FP8_BYTES, product.count)]
    return tuple(ops)


def float8_weight_bytes(layer: LayerCount, recipe: Fp8Recipe, expert_ranks: int = 1,
                        float8_params: bool = False) -> int:
    """The float8 weight casts the recipe holds between steps beside the weights for `layer` on one of
    `expert_ranks` expert-parallel ranks (each product's n × k weight, a routed product's for the rank's share of
    its experts). With the weights kept as TransformerEngine's float8 tensors (`float8_params`: NeMo's
    `fp8_params`, TE's `fp8_model_init`) the float8 data is the weight itself, held as gathered (planning/estimate.py
    `gathered_weight_bytes`), and only its transpose is held beside it, 1 byte an element: TransformerEngine 1.x's
    modules fill a Float8Tensor weight's transpose cache on the first micro-batch (`transpose_2d(fill_cache=True)`)
    and cast to their `weight_fp8`/`weight_t_fp8` workspaces only weights that are not Float8Tensors."""
    copy_bytes = FP8_BYTES if float8_params else recipe.weight_copy_bytes
    return sum(op.count * (op.shape[0] // expert_ranks if op.routed else 1) * op.shape[2] * op.shape[3]
               for op in _weighed_products(layer, recipe)) * copy_bytes
