"""Host-bound execution: the host's issue of a MoE layer's kernels after the device-to-host synchronisation a
dropless mixture of experts' dispatcher makes once per MoE layer's forward.

The GPU runs kernels in the order the host issues them, and the host issues them asynchronously, so it runs ahead
of the GPU and its time stays hidden (a queue of issued kernels waits on the GPU) until something makes it wait for
the GPU. Megatron-core's dropless token dispatchers do, once per MoE layer's forward: they need the tokens each
expert receives on the host to size the all-to-all and the grouped products (megatron/core/transformer/moe/
token_dispatcher.py at Megatron-LM d98e8a64dd: the all-to-all dispatcher's `_maybe_dtoh_and_synchronize` copies
the split sizes to the host and waits on its event, at "before_ep_alltoall" with expert parallelism; the flex
dispatcher's DeepEP path `tokens_per_expert.sum().item()`; HybridEP "sizes buffers dynamically (CPU sync in
dispatch)" unless `moe_expert_rank_capacity_factor` gives it a budget). None waits when the experts' input is
padded to its capacity (`moe_pad_expert_input_to_capacity`: the sizes are known on the host), pipesim's
`--capacity-factor`. A dense layer waits for nothing.

After a synchronisation the GPU's queue is empty, so until the host is ahead again the GPU runs a kernel only once
the host has issued it: the layer's forward takes the longer of the GPU's time and the host's issue of its kernels,
less what the host issues while the GPU is busy with the layer's all-to-alls. The backward waits for nothing (the
split sizes are on the host already), but it starts as the forward's last synchronisation left the queue, empty,
so each of a synchronising layer's backward passes takes the longer of the GPU's time and the host's issue of its
kernels too: where the host is slower it never gets ahead (the lead a pipeline stage's wait for its input would
give the host is not counted). The host's cost per kernel (`HOST_KERNEL_US`) is eager PyTorch's per op: Python, the
dispatcher and autograd, 6.8 us per op measured on a one-element tensor with requires_grad (github.com/pytorch/
pytorch issue 41383: 6.8 s for 10^6 `2*x`; "approx 2 us" without autograd, its maintainer there), plus the CUDA
launch's own CPU side, "usually between 5-20 microseconds" in PyTorch's training traces (Holistic Trace Analysis,
facebookresearch/HolisticTraceAnalysis docs/source/features/cuda_kernel_launch_stats.rst), taken at its low end:
12 us.

Under TransformerEngine (the float8 recipes `te` and `te-current`: Megatron-core's TransformerEngine layer spec)
a layer's products and attention are module calls whose Python costs the host more than their kernels' issue:
argument checks, the float8 quantizers' and scaling metadata's setup, autograd's bookkeeping (transformer_engine/
pytorch/module/base.py `prepare_forward`, linear.py `_Linear`). Megatron-core's TEColumnParallelLinear took 115 us
of CPU a BF16 forward at t = 1 after TransformerEngine PR 1191's optimisations (140 before; its ColumnParallelLinear,
the same GEMM without TransformerEngine, 74: that PR's description), and TransformerEngine issue 761 measured an FP8
te.Linear's forward scheduling at more than twice its BF16 one on an H100 (TE cf6fc89). So each module call adds its
Python beyond its kernels' issue (`TE_MODULE_US`: the 115 us less its GEMM's issue at `HOST_KERNEL_US`; twice that
for a module whose products run in float8), forward and backward (the backward's Python is not published: assumed
as the forward's), its kernels still issued at the per-kernel cost (`te_module_calls` says which calls a layer
makes). Not modelled: the kernels a CUDA graph issues as one (each would issue fewer), the first kernels' order
within the layer (a forward whose short kernels come first waits on the host sooner than the totals say: the bound
is the lower one), TransformerEngine's norms, RoPE, router and permutation functions beyond their kernels' issue,
and the synchronisation's own round trip."""

from __future__ import annotations

from typing import Any

from ..profiles.workload import LayerCount
from .fp8 import Float8Forms

HOST_KERNEL_US = 12.0  # the host's issue of one kernel in eager PyTorch (sources above)
# a TransformerEngine module call's Python beyond its kernels' issue, in BF16 (sources above): PR 1191's 115 us a
# TEColumnParallelLinear forward less its one GEMM's issue
TE_MODULE_US = 115.0 - HOST_KERNEL_US
TE_FLOAT8_MODULE_FACTOR = 2.0  # a module whose products run in float8: issue 761's "more than 2x" its BF16 call
TE_RECIPES = ("te", "te-current")  # the float8 recipes that are TransformerEngine's modules (planning/fp8.py)
MODULE_PASSES = ("fwd", "bwd", "igrad")  # the passes a module call's Python runs in (wgrad: its GEMMs alone)


def synchronises(layer: LayerCount, options: dict[str, Any]) -> bool:
    """Whether the layer's forward waits for the GPU on the host: a routed layer whose experts are dropless."""
    return options.get("capacity_factor") is None and any(op.routed for op in layer.ops.get("fwd", ()))


def module_us(fp8: str | None, given: float | None) -> float:
    """The host's microseconds a BF16 TransformerEngine module call adds: `given` (--host-module-us), else
    `TE_MODULE_US` under TransformerEngine's float8 recipes and none under any other runtime (eager PyTorch)."""
    if given is not None:
        return given
    return TE_MODULE_US if fp8 in TE_RECIPES else 0.0


def te_module_calls(layer: LayerCount) -> tuple[int, int]:
    """The TransformerEngine module calls a layer's forward makes under Megatron-core's layer spec, as (in float8
    where the recipe runs its products so, in BF16): the products before the attention kernel are one call (they
    read the attention's input: linear_qkv, a LayerNormLinear, fuses q, k and v), each later product a call
    (linear_proj, a shared expert's or a dense MLP's), each routed product a GroupedLinear call over the rank's
    local experts (one entry, whatever the GEMMs it issues), each attention kernel a DotProductAttention call (BF16:
    no fp8_dpa); in a layer that does not attend each product is a call. A router's gating product is
    Megatron-core's own (no module)."""
    products = attention = pending = 0  # pending: the product calls seen before the attention kernel
    for op in layer.ops.get("fwd", ()):
        if op.kind == "attention":
            attention += op.count
            products += min(pending, 1)
            pending = 0
        elif op.kind == "matmul" and not op.gating and (op.routed or op.shape[0] == 1):  # a linear's, an expert's
            if op.routed:
                products += 1
            elif attention:
                products += op.count
            else:
                pending += op.count
    return products + pending, attention


def issue_ms(layer: LayerCount, float8: Float8Forms, host_kernel_us: float, name: str = "fwd",
             host_module_us: float = 0.0) -> float:
    """The host's time to issue the layer's kernels of pass `name` as the GPU runs them: the float8 recipe's casts
    too, as the passes run them (`float8`, the estimate's forms of its recipe, `Parallelism.float8_recipe`: no
    weight cast under FSDP2's float8 all-gather), and with `host_module_us` each TransformerEngine module call's
    Python (`te_module_calls`; twice in float8)."""
    kernels_us = sum(op.count for op in float8.of(layer).ops.get(name, ())) * host_kernel_us
    products, attention = te_module_calls(layer) if name in MODULE_PASSES else (0, 0)
    modules_us = (products * (1.0 if float8.recipe is None else TE_FLOAT8_MODULE_FACTOR) + attention) * host_module_us
    return (kernels_us + modules_us) / 1e3


def host_bound_ms(gpu_ms: float, all_to_all_ms: float, issued_ms: float) -> float:
    """A pass after a synchronisation: the GPU's time unless the host issues its kernels slower, the host issuing
    while the GPU runs the pass's `all_to_all_ms` (a forward's dispatch and combine; none in a backward pass)."""
    return max(gpu_ms, issued_ms - all_to_all_ms)
