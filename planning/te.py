"""What TransformerEngine's modules run beside their products as Megatron-core's layers call them
(`--linear-kernel te`, the default under --fp8-recipe te and te-current), read at TransformerEngine v1.10 and v2.9
and Megatron-core core_v0.9.0:

- Bias gradients. A bias TransformerEngine's Linear adds in its own product (`use_bias`) takes its gradient with the
  product's backward (module/base.py `grad_output_preprocess`): in 16 bits from the weight-gradient GEMM's epilogue
  ("No-FP8 case: bgrad is fused with wgrad": `gemm(..., use_bias=ctx.use_bias)` returns `grad_bias`), in float8
  under delayed scaling from the output gradient's cast-transpose ("FP8 case without gather: cast, transpose, bgrad
  fused", `fp8_cast_transpose_bgrad_fused`) unless the product gathers that gradient (a row-parallel one under
  sequence parallelism: "unfused bgrad", a `sum` of its own); under current scaling a `sum` of its own (v2.9
  csrc/extensions/bias.cpp `bgrad_quantize`: on Hopper the fused kernel takes delayed scaling's quantizer only,
  `IsFloat8Quantizers`). Megatron-core hands every other product's bias on to the fused kernel after it
  (skip_bias_add=True: linear_proj's and linear_fc2's to bias-dropout-add, linear_fc1's to bias_gelu or bias_swiglu,
  transformer/attention.py and mlp.py), whose autograd sums it apart, and TransformerEngine adds a row-parallel
  product's own bias after its reduction (linear.py `gemm_bias_unfused_add`), autograd's sum too: only the
  attention's input projection, linear_qkv (skip_bias_add=False), column-parallel, adds its own. So a product whose
  output the fused attention kernel reads through no other product (q, k and v: `fused_bias_products`) has its
  bias's `sum` dropped from the backward (`without_fused_bias_sums`). Under --attention math no fused kernel reads
  them: their sums stay.
- Scale-inverse clones (planning/fp8.py `Fp8Recipe.clones_scale_inverses`): one small kernel a module
  (`te_modules`) and forward.
- The amax update around each amax all-reduce of delayed scaling: `AMAX_UPDATE_KERNELS` a chunk's forward and
  backward (planning/scenario.py `amax_update_ms`).
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import replace

from ..profiles.workload import LayerCount, OpCount, weighted_products

LINEAR_KERNELS = ("eager", "te")  # whose linear layers run: torch's nn.Linear, Megatron-core's TransformerEngine ones
BIAS_GRADIENT_PASSES = ("bwd", "wgrad")  # the passes that compute the weights' (and biases') gradients
# delayed scaling's kernels beside a chunk's amax all-reduce at its forward's end and at its backward's: the amaxes
# concatenated and the fused amax-and-scale update (planning/scenario.py `amax_update_ms`)
AMAX_UPDATE_KERNELS = 2


def _forward_products(layer: LayerCount) -> dict[int, int]:
    """The forward's products with weights: their storage's number in `allocations["fwd"]` -> their index in
    `LayerCount.weight_grad_outputs`."""
    return {number: j for number, (j, _, _) in weighted_products(layer, {}, "fwd").items()}


def fused_bias_products(layer: LayerCount) -> tuple[int, ...]:
    """The products with a bias (their indices in `LayerCount.weight_grad_outputs`) whose output a fused attention
    kernel reads through ops that are no product: the attention's input projections, Megatron-core's linear_qkv
    (q, k and v, their rotary embedding between), in the forward's order."""
    if not any(layer.weight_grad_bias_bytes):
        return ()
    products = _forward_products(layer)
    kernels = {op.op for op in layer.ops.get("fwd", ()) if op.kind == "attention"}
    any_product = {number for number, _ in layer.product_allocations.get("fwd", ())}
    reads = dict(layer.forward_reads)
    todo = [number for number, _, nbytes, op in layer.allocations.get("fwd", ()) if op in kernels and nbytes >= 0]
    seen, reached = set(todo), set()
    while todo:
        for source in reads.get(todo.pop(), ()):
            if source in seen:
                continue
            seen.add(source)
            if source in products:
                reached.add(products[source])
            elif source not in any_product:
                todo.append(source)
    return tuple(sorted(j for j in reached if layer.weight_grad_bias_bytes[j]))


def without_fused_bias_sums(layer: LayerCount) -> LayerCount:
    """`layer` with the bias gradients of `fused_bias_products` computed inside their products' backward: the count
    records each bias's gradient as autograd's `sum` to its n elements (one a product; workload/count.py), so one
    `sum` to n elements a fused product leaves each pass that computes gradients (sums to as many elements read as
    many bytes: whichever of them goes, the same time goes)."""
    fused = Counter(layer.weight_grad_outputs[j][0][2] for j in fused_bias_products(layer))
    if not fused:
        return layer

    def dropped(ops: tuple[OpCount, ...]) -> tuple[OpCount, ...]:
        left, kept = Counter(fused), []
        for op in ops:
            elements = math.prod(op.shape)
            take = min(op.count, left[elements]) if op.op == "sum" and op.kind == "memory" else 0
            left[elements] -= take
            if op.count > take:
                kept.append(replace(op, count=op.count - take))
        return tuple(kept)

    return replace(layer, ops={name: dropped(ops) if name in BIAS_GRADIENT_PASSES else ops
                               for name, ops in layer.ops.items()})


def float8_norm_outputs(layer: LayerCount) -> tuple[tuple[int, tuple[int, ...]], ...]:
    """The norms' outputs TransformerEngine's LayerNormLinear writes in float8 under delayed scaling (Megatron-core's
    TELayerNormColumnParallelLinear: linear_qkv with the input norm, a dense MLP's linear_fc1 with the pre-MLP
    norm): each storage a norm makes (the count's "layernorm" region) that products with weights read and nothing
    else, none a router's (a mixture of experts' pre-MLP norm is a TENorm of its own, which its router reads:
    core_v0.9.0 gpt_layer_specs.py `pre_mlp_layernorm=TENorm if num_experts else IdentityOp`), each as (its number
    in allocations["fwd"], its shape)."""
    made = set(layer.region_allocations.get("layernorm", ()))
    products = _forward_products(layer)
    router = layer.weight_grad_router or (False,) * len(layer.weight_grad_outputs)
    readers: dict[int, set[int]] = {}
    for number, sources in layer.forward_reads:
        for source in made.intersection(sources):
            readers.setdefault(source, set()).add(number)
    shapes = {number: shape for number, shape, nbytes, _ in layer.allocations.get("fwd", ()) if nbytes > 0}
    return tuple((source, shapes[source]) for source, numbers in sorted(readers.items())
                 if all(number in products and not router[products[number]] for number in numbers))


def norm_read_products(layer: LayerCount, outputs: tuple[tuple[int, tuple[int, ...]], ...]) -> Counter:
    """The forward's products that read one of `outputs` (`float8_norm_outputs`), counted by their shape."""
    read = {number for number, _ in outputs}
    sources = dict(layer.forward_reads)
    return Counter(tuple(shape) for number, shape in layer.product_allocations.get("fwd", ())
                   if read.intersection(sources.get(number, ())))


def te_modules(layer: LayerCount, routed: bool) -> int:
    """The TransformerEngine modules a layer's forward calls: its products with weights but a router's gating ones
    (no TransformerEngine module), the routed experts' grouped ones only where `routed` (TEGroupedMLP), those reading
    one input one module (Megatron-core's linear_qkv for q, k and v; linear_fc1 for gate and up)."""
    reads = dict(layer.forward_reads)
    router = layer.weight_grad_router or (False,) * len(layer.weight_grad_outputs)
    grouped = layer.weight_grad_routed or (False,) * len(layer.weight_grad_outputs)
    return len({reads.get(number, (number,)) for number, j in _forward_products(layer).items()
                if not router[j] and (routed or not grouped[j])})
