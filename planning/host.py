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
12 us. Not modelled: the kernels a CUDA graph issues as one (each would issue fewer), the first kernels' order
within the layer (a forward whose short kernels come first waits on the host sooner than the totals say: the bound
is the lower one), and the synchronisation's own round trip."""

from __future__ import annotations

from typing import Any

from ..profiles.workload import LayerCount
from .fp8 import Fp8Recipe, in_float8

HOST_KERNEL_US = 12.0  # the host's issue of one kernel in eager PyTorch (sources above)


def synchronises(layer: LayerCount, options: dict[str, Any]) -> bool:
    """Whether the layer's forward waits for the GPU on the host: a routed layer whose experts are dropless."""
    return options.get("capacity_factor") is None and any(op.routed for op in layer.ops.get("fwd", ()))


def issue_ms(layer: LayerCount, recipe: Fp8Recipe | None, element_bytes: int, host_kernel_us: float,
             name: str = "fwd") -> float:
    """The host's time to issue the layer's kernels of pass `name` as the GPU runs them: the float8 recipe's casts
    too, as the passes run them (`Parallelism.float8_recipe`: no weight cast under FSDP2's float8 all-gather)."""
    run = layer if recipe is None else in_float8(layer, recipe, element_bytes)
    return sum(op.count for op in run.ops.get(name, ())) * host_kernel_us / 1e3


def host_bound_ms(gpu_ms: float, all_to_all_ms: float, issued_ms: float) -> float:
    """A pass after a synchronisation: the GPU's time unless the host issues its kernels slower, the host issuing
    while the GPU runs the pass's `all_to_all_ms` (a forward's dispatch and combine; none in a backward pass)."""
    return max(gpu_ms, issued_ms - all_to_all_ms)
