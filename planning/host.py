"""Host-bound execution: the host's issue of a pass's kernels, a floor on every pass, and after the device-to-host
synchronisation a dropless mixture of experts' dispatcher makes once per MoE layer's forward, priced in their order.

The GPU runs kernels in the order the host issues them, and the host issues them asynchronously (CUDA C++
Programming Guide, "Asynchronous Concurrent Execution": a launch returns to the host before the kernel completes; a
stream runs its kernels in issue order), so it runs ahead of the GPU and its time stays hidden (a queue of issued
kernels waits on the GPU) as long as it issues faster than the GPU runs. Where it does not, the queue drains and
the GPU runs at the host's pace, synchronisation or none: so every pass of a stage takes at least its kernels'
issue (`issued_ms`: their module calls' Python and each kernel's issue, as priced below). Where nothing makes its
host wait for the GPU, a stage's pass takes the longer of its GPU time and its issue (profiles/schema.py
`stage_host_waits_ms`), not the recursion below from an empty queue: nothing empties the queue at the pass's start
then, and the host's lead there is not counted either way (it runs ahead through the step's bubbles and the passes
the GPU outlasts it in), so only the two totals bind; ordering penalties (host-heavy kernels before GPU-heavy ones)
need the empty queue a synchronisation leaves, which `--p2p-sync` makes at each received pass. Megatron-core's
dropless token dispatchers make the host wait for the GPU once per MoE layer's forward: they need the tokens each
expert receives on the host to size the all-to-all and the grouped products (megatron/core/transformer/moe/
token_dispatcher.py at Megatron-LM d98e8a64dd: the all-to-all dispatcher's `_maybe_dtoh_and_synchronize` copies
the split sizes to the host and waits on its event, at "before_ep_alltoall" with expert parallelism; the flex
dispatcher's DeepEP path `tokens_per_expert.sum().item()`; HybridEP "sizes buffers dynamically (CPU sync in
dispatch)" unless `moe_expert_rank_capacity_factor` gives it a budget). None waits when the experts' input is
padded to its capacity (`moe_pad_expert_input_to_capacity`: the sizes are known on the host), pipesim's
`--capacity-factor`; nor does a dense model, whose passes only the floor above binds (a dense layer's kernels
after a MoE layer's synchronisation are issued in its segment).

After a synchronisation the GPU's queue is empty, so until the host is ahead again the GPU runs a kernel only once
the host has issued it (the same guide's asynchronous launch). So a pass is priced in its kernels' order
(`waited_ms`, a max-plus recursion): the host issues kernel k at H_k, the cumulative host cost of kernels 1..k
(module calls' Python where they are issued), the GPU starts it at the later of H_k and its end of kernel k-1 and
ends it its GPU time later; the all-to-alls are GPU time the host issues under. Host-heavy kernels (a GroupedLinear's
per-expert casts and GEMMs) before GPU-heavy ones (the next layer's attention) add their times where interleaved
ones overlap: the longer of the two totals is only the recursion's floor. The count
lists a pass's ops in their first call's order, an op's later calls on the same shapes with it (`pass_kernels`).
Segments run from one synchronisation to the next: a pass starts with the host not ahead, each layer issued from the
queue the one before left, the dispatch of layer L to that of L+1 one segment of the forward; a backward pass waits
for nothing itself (the split sizes are on the host already) and runs whole from the queue the forward's last
synchronisation emptied, the last layer first. Each pipeline stage is a process whose host waits only where one of
its own layers synchronises, and the simulator cuts the layers into stages after they are priced: a layer's times
hold the model's layers' waits carried from the first (`carried_waits_ms`), and its passes' issue as a max-plus map
of the lead each starts with (`pass_issue`), from which a stage composes its own from its start (profiles/schema.py
`stage_host_waits_ms`; the lead a stage's wait for its input gives the host is not counted). The host's cost per
kernel (`HOST_KERNEL_US`) is eager PyTorch's, measured: the GPU probe's MoE layer (benchmarks/gpu_probe.py part (a),
traces/measured/gpu-probe-h200.json: torch 2.11.0+cu130 on an H200 behind a 16-core VM host) issued 438 kernels in
13.96 ms of host time over the spans that issue from an empty queue (each forward from the dispatcher's wait, each
backward; 4, 8 and 16 local experts pooled): 31.9 us a kernel (19.8 to 39.0 a span). The count lists the ops that
run a kernel, not the views and kernel-less ops between them (t, chunk, split, autograd's view nodes), which the
host pays too: the probe dispatched 1.9 ops a kernel at 16.6 us an op (15.3 to 17.8 a span), in line with the
published per op, 6.8 us of Python, dispatcher and autograd (github.com/pytorch/pytorch issue 41383) plus the CUDA
launch's "usually between 5-20 microseconds" (facebookresearch/HolisticTraceAnalysis
docs/source/features/cuda_kernel_launch_stats.rst); so a counted kernel costs the host its ops' time, views included
(benchmarks/probe_moe.py prints the probe against pipesim's prediction of its layer).

Under TransformerEngine (the float8 recipes `te` and `te-current`: Megatron-core's TransformerEngine layer spec)
a layer's products and attention are module calls whose Python costs the host more than their kernels' issue:
argument checks, the float8 quantizers' and scaling metadata's setup, autograd's bookkeeping (transformer_engine/
pytorch/module/base.py `prepare_forward`, linear.py `_Linear`). Megatron-core's TEColumnParallelLinear took 115 us
of CPU a BF16 forward at t = 1 after TransformerEngine PR 1191's optimisations (140 before; its ColumnParallelLinear,
the same GEMM without TransformerEngine, 74: that PR's description), and TransformerEngine issue 761 measured an FP8
te.Linear's forward scheduling at more than twice its BF16 one on an H100 (TE cf6fc89). So each module call adds its
Python beyond its kernels' issue (`TE_MODULE_US`: the 115 us less its GEMM's issue at `HOST_KERNEL_US`; twice that
for a module whose products run in float8), forward and backward (the backward's Python is not published: assumed
as the forward's, spread over the backward's kernels, which the count does not tie to modules), its kernels still
issued at the per-kernel cost (`_module_calls` says which calls a layer makes and where). Not modelled: the kernels a
CUDA graph issues as one (each would issue fewer), a recomputed forward's dispatcher synchronisation (a rerun
op's own wait, `OpCount.host_waits`, is priced where the backward reruns it), TransformerEngine's
norms, RoPE, router and permutation functions beyond their kernels' issue, and the synchronisation's own round
trip. Megatron-core's overlapped pair (`--overlap-expert-comm`, planning/experts.py `paired_exposed_ms`) keeps its
own node-by-node max-plus of the two passes where its layer synchronises, each node's issue as one lump
(`issued_ms`) of the kernels its layer's passes are priced by, the recomputation's rerun included; elsewhere it
runs the stage's passes, floored by their issue as any."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..profiles.workload import LayerCount, OpCount

if TYPE_CHECKING:  # the schema only where a pass's issue is made: a run from cost flags never imports it
    from ..profiles.schema import PassIssue

HOST_KERNEL_US = 31.9  # the host's issue of one kernel in eager PyTorch: the GPU probe's, pooled (above)
# a TransformerEngine module call's Python beyond its kernels' issue, in BF16 (sources above): PR 1191's 115 us a
# TEColumnParallelLinear forward less its one GEMM's issue
TE_MODULE_US = 115.0 - HOST_KERNEL_US
TE_FLOAT8_MODULE_FACTOR = 2.0  # a module whose products run in float8: issue 761's "more than 2x" its BF16 call
TE_RECIPES = ("te", "te-current")  # the float8 recipes that are TransformerEngine's modules (planning/fp8.py)
MODULE_PASSES = ("fwd", "bwd", "igrad")  # the passes a module call's Python runs in (wgrad: its GEMMs alone)


def waits_for_tokens(layer: LayerCount, options: dict[str, Any]) -> bool:
    """Whether the layer's forward waits for the GPU on the host before its dispatch: a routed layer whose experts
    are dropless (the tokens each expert receives copied to the host)."""
    return options.get("capacity_factor") is None and any(op.routed for op in layer.ops.get("fwd", ()))


def synchronises(layer: LayerCount, options: dict[str, Any]) -> bool:
    """Whether the layer's forward waits for the GPU on the host anywhere: before its dispatch (`waits_for_tokens`)
    or before an op the count marks so (`OpCount.host_waits`)."""
    return waits_for_tokens(layer, options) or any(op.host_waits for op in layer.ops.get("fwd", ()))


def module_us(fp8: str | None, given: float | None) -> float:
    """The host's microseconds a BF16 TransformerEngine module call adds: `given` (--host-module-us), else
    `TE_MODULE_US` under TransformerEngine's float8 recipes and none under any other runtime (eager PyTorch)."""
    if given is not None:
        return given
    return TE_MODULE_US if fp8 in TE_RECIPES else 0.0


def _module_calls(ops: Sequence[OpCount]) -> list[tuple[int, int]]:
    """Per op of a layer's forward `ops`, the TransformerEngine module calls issued with it under Megatron-core's
    layer spec, as (in float8 where the recipe runs its products so, in BF16): the products before the attention
    kernel are one call, issued with the first of them (they read the attention's input: linear_qkv, a
    LayerNormLinear, fuses q, k and v), each later product a call (linear_proj, a shared expert's or a dense MLP's),
    each routed product a GroupedLinear call over the rank's local experts (one entry, whatever the GEMMs it
    issues), each attention kernel a DotProductAttention call (BF16: no fp8_dpa); in a layer that does not attend
    each product is a call. A router's gating product is Megatron-core's own (no module)."""
    calls = [(0, 0)] * len(ops)
    pending: list[int] = []  # the product ops seen before the attention kernel
    attended = False
    for i, op in enumerate(ops):
        if op.kind == "attention":
            attended = True
            if pending:
                calls[pending[0]] = (1, 0)
            pending = []
            calls[i] = (0, op.count)
        elif op.kind == "matmul" and not op.gating and (op.routed or op.shape[0] == 1):  # a linear's, an expert's
            if op.routed:
                calls[i] = (1, 0)
            elif attended:
                calls[i] = (op.count, 0)
            else:
                pending.append(i)
    for i in pending:
        calls[i] = (ops[i].count, 0)
    return calls


@dataclass(frozen=True)
class Kernels:
    """`count` alike kernels of a pass, in its issue order: the host issues each in `host_ms`, after `call_ms` of
    module calls' Python before the first, and the GPU runs each in `gpu_ms`; `waits`: the host first waits for the
    GPU to drain its queue (a dropless dispatcher's device-to-host synchronisation, a synchronous copy to the
    device)."""

    count: int
    host_ms: float
    gpu_ms: float
    call_ms: float = 0.0
    waits: bool = False


def pass_kernels(ops_ms: Sequence[tuple[OpCount, float]], forward_ops: Sequence[OpCount], float8: bool,
                 host_kernel_us: float, name: str = "fwd", host_module_us: float = 0.0, all_to_all_ms: float = 0.0,
                 synchronised: bool = False, ring_kernels: Callable[[OpCount], int] | None = None,
                 hook_adds: int = 0) -> list[Kernels]:
    """A layer's pass `name` as the host issues it: its ops in the count's order (`ops_ms`: each op as the pass
    runs it, its `count` kernels' GPU time together; a count lists an op where it first runs, its later calls on
    the same shapes with it), with the TransformerEngine module calls of the layer's forward (`forward_ops`,
    `_module_calls`; twice for a product under a float8 recipe, `float8`): in the forward each where it is issued,
    in a backward pass spread over its kernels (which backward kernels follow which module's Python the count does
    not say). The routed experts' all-to-alls (`all_to_all_ms`: half a dispatch, half a combine) are GPU time the
    host issues under, the first before the first routed op and the second after the last; with `synchronised` (a
    dropless dispatcher's forward) the host waits for the GPU before the dispatch, and before any op the count marks
    so (`OpCount.host_waits`: the clamped GLU's synchronous copy, workload/moe.py `routed_experts`, wherever the pass
    runs it, a recomputation's rerun included). Under context parallelism an
    attention call runs `ring_kernels(op)` kernels (estimate.py `ContextRing.kernels`: the ring's blocks, merges and
    copies, which its GPU time prices), each one issued. `hook_adds`: the adds Megatron-core DDP's backward post-hook
    issues after the pass, one a parameter whose gradient no product accumulated into its `main_grad`
    (`param.main_grad.add_(param.grad.data)`, distributed_data_parallel.py `_make_backward_post_hook`, Megatron-LM
    0d8e0714cd, b0cc2706, core_v0.15.0 to core_v0.18.0): kernels the host issues, their bytes priced with the step's
    accumulation (estimate.py `unfused_weight_share`), so no GPU time here."""
    def issued(op: OpCount) -> int:
        return op.count * (ring_kernels(op) if ring_kernels is not None and op.kind == "attention" else 1)

    calls = _module_calls(forward_ops) if name in MODULE_PASSES else []
    product_us = host_module_us * (TE_FLOAT8_MODULE_FACTOR if float8 else 1.0)
    calls_us = [products * product_us + attention * host_module_us for products, attention in calls]
    spread_us = 0.0 if name == "fwd" else sum(calls_us) / max(sum(issued(op) for op, _ in ops_ms), 1)
    routed = [i for i, (op, _) in enumerate(ops_ms) if op.routed]
    kernels = []
    for i, (op, gpu_ms) in enumerate(ops_ms):
        if routed and i == routed[0] and (all_to_all_ms or synchronised):
            kernels.append(Kernels(1, 0.0, all_to_all_ms / 2, waits=synchronised))
        kernels.append(Kernels(issued(op), (host_kernel_us + spread_us) / 1e3, gpu_ms / issued(op),
                               calls_us[i] / 1e3 if name == "fwd" and calls_us else 0.0, op.host_waits))
        if routed and i == routed[-1] and all_to_all_ms:
            kernels.append(Kernels(1, 0.0, all_to_all_ms / 2))
    if hook_adds:
        kernels.append(Kernels(hook_adds, host_kernel_us / 1e3, 0.0))
    return kernels


def graph_replay(kernels: Sequence[Kernels], host_kernel_us: float) -> list[Kernels]:
    """A layer's pass `kernels` (`pass_kernels`) captured in a CUDA graph (planning/estimate.py `CUDA_GRAPH_SCOPES`):
    the host issues one replay, priced as one kernel's issue (TransformerEngine's graphed callable, an autograd
    Function, then cudaGraphLaunch, for "mamba"; Megatron-core's CudaGraphManager's runner, whose own Python is
    not priced, for "full"; the modules' Python does not run), and the GPU runs the graph's kernels back to
    back, their GPU time together. A pass that waits for the GPU cannot be captured: kept as it is."""
    if not kernels or any(run.waits for run in kernels):
        return list(kernels)
    return [Kernels(1, host_kernel_us / 1e3, math.fsum(run.count * run.gpu_ms for run in kernels))]


def issued_ms(kernels: Iterable[Kernels]) -> float:
    """The host's time to issue `kernels` (`pass_kernels`: a pass's, a backward's rerun of the forward first):
    module calls' Python and each kernel's issue, which Megatron-core's overlapped pair prices each node's issue by
    (planning/experts.py `paired_exposed_ms`), from the list its layer's passes wait by."""
    return sum(run.call_ms + run.count * run.host_ms for run in kernels)


def waited_ms(kernels: Iterable[Kernels], lead_ms: float = 0.0) -> tuple[float, float]:
    """The GPU's time idle waiting for the host through `kernels` issued asynchronously (CUDA C++ Programming Guide,
    "Asynchronous Concurrent Execution": a launch returns to the host before its kernel completes, and a stream runs
    its kernels in their issue order): the host issues kernel k at H_k, the cumulative host cost of kernels 1..k,
    and the GPU starts it at the later of H_k and its end of kernel k-1, so a pass's host-heavy kernels before its
    GPU-heavy ones add their times where interleaved ones overlap; a wait restarts the host at the GPU's end.
    `lead_ms`: the GPU's queue ahead of the host at the start (0: the host not ahead). Returns the idle time (the
    pass takes its kernels' GPU time plus it) and the GPU's queue ahead of the host at the end. A run of n alike
    kernels in closed form: its last ends at the later of its first's start plus n GPU times and the host's issue
    of all n plus one GPU time."""
    host, gpu, idle = 0.0, lead_ms, 0.0
    for run in kernels:
        if run.waits:
            host = max(host, gpu)
        host += run.call_ms
        if run.count:
            first = max(gpu, host + run.host_ms)  # the idle time in two parts, each exactly 0 where none
            end = max(first + run.count * run.gpu_ms, host + run.count * run.host_ms + run.gpu_ms)
            idle += (first - gpu) + (end - (first + run.count * run.gpu_ms))
            gpu, host = end, host + run.count * run.host_ms
    return idle, max(gpu - host, 0.0)


def carried_waits_ms(passes: Sequence[Sequence[Kernels]], backward: bool) -> list[float]:
    """Per layer of a model whose layers make the host wait, in its order, the GPU's wait for the host in one pass
    (`waited_ms`; `passes`, each layer's kernels of it), the pass started with the host not ahead and each layer's
    kernels issued from the queue the one before it left, each synchronisation emptying it again: a forward's
    segment runs from one layer's dispatch to the next's (the rest of the one, the next up to its dispatch); a
    backward pass (`backward`), which waits for nothing itself, runs whole from the queue the forward's last
    synchronisation emptied, the last layer first. Layers alike share their lists of kernels
    (planning/estimate.py `estimate_profile`) and mostly start from the same queue, so each list's pass is priced
    once per lead it starts with."""
    waits = [0.0] * len(passes)
    lead = 0.0
    priced: dict[tuple[int, float], tuple[float, float]] = {}  # by the list's id (`passes` holds it) and lead
    for i in reversed(range(len(passes))) if backward else range(len(passes)):
        key = (id(passes[i]), lead)
        if key not in priced:
            priced[key] = waited_ms(passes[i], lead)
        waits[i], lead = priced[key]
    return waits


def pass_issue(kernels: Sequence[Kernels], carried_ms: float) -> PassIssue:
    """A layer's pass `kernels` as a function of the lead it starts with (profiles/schema.py `PassIssue`, which a
    stage composes): before its first wait the GPU's end is max(lead + their GPU time, their end from an empty
    queue), a max-plus map, so it waits max(0, idle - lead) and ends max(lead, idle) + GPU time - host time ahead;
    from a wait on, the same whatever the lead. `carried_ms`: the wait the layer's times hold."""
    from ..profiles.schema import PassIssue

    first = next((i for i, run in enumerate(kernels) if run.waits), len(kernels))
    before, after = kernels[:first], kernels[first:]
    slack_ms = sum(run.count * (run.gpu_ms - run.host_ms) - run.call_ms for run in before)
    after_idle_ms, after_lead_ms = waited_ms(after)  # both 0 where the pass never waits
    return PassIssue(idle_ms=waited_ms(before)[0], slack_ms=slack_ms, synchronises=bool(after),
                     after_idle_ms=after_idle_ms, after_lead_ms=after_lead_ms, carried_ms=carried_ms)
