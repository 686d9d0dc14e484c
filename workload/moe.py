"""Routed experts (a mixture of experts' MLPs), run as a real runtime runs them and counted at balanced routing.

Which tokens an expert receives depends on the router's values, which the meta device does not have. So on the
meta device every expert computes its expected share of the tokens, as a batched product over the experts (one
matrix product per expert, as a grouped GEMM runs them): each of the T·k routed token copies of a micro-batch
lands on one of the E experts, k·T/E per expert when routing is balanced, which the load-balancing loss (Switch
Transformer, Fedus et al. 2021) and DeepSeek-V3's bias adjustment aim for. A model that drops tokens pads every
expert to its capacity, ⌈c·k·T/E⌉ tokens for a capacity factor c (GShard, Lepikhin et al. 2020; Switch
Transformer), and computes that many. The gather of each expert's tokens and the scatter back are counted as the
index_select and the accumulating index_put a dispatch runs. On a real device the router's choices route the
tokens, expert by expert, and a capacity drops each expert's tokens past it (in token order, as Switch
Transformer).

On the meta device the count is of what Megatron-core keeps for the backward, in its order (megatron/core/
transformer/moe/experts.py, TEGroupedMLP.forward; moe_utils.py, unpermute): the router's weights scale each
expert's activation before its down product (`intermediate_parallel * permuted_probs`, then linear_fc2), so the
down product's output is not kept; the scatter back keeps its indices only (as scatter_add_ does, or
TransformerEngine's fused unpermute under `moe_permute_fusion`); each grouped product keeps its input
(workload/count.py counts it as a linear layer's, which a float8 recipe keeps in float8: planning/fp8.py).

Inside `fused_swiglu(True)` (the count's default) a gated MLP's activation is one kernel that keeps only its
input (`Fused`): a routed expert's scaled by the router's weights, as Megatron-core's `weighted_bias_swiglu_impl`,
a dense MLP's (its gate and up products' outputs, `gated_mlp`: a Hugging Face model's and the built-in gpt's) as
its `bias_swiglu_impl`, both under `bias_activation_fusion` (fusions/fused_bias_swiglu.py; Megatron-LM's default,
which its --no-bias-swiglu-fusion turns off, and every Megatron-Bridge MoE recipe's setting); its work is that one
kernel's, forward, backward and where a recomputation reruns it. Off the meta device the MLPs run as torch ops.

A router's gating product (`gating_linear`) keeps its input and weight in their own dtype and computes in the
dtype the router's code asks for (float32 where transformers' DeepseekV3 router casts both), as Megatron-core's
RouterGatingLinearFunction (transformer/moe/moe_utils.py: `save_for_backward(inp, weight)`, the casts inside);
its ops are marked (`gating_now`) so that a float8 recipe leaves it in that precision (DeepSeek-V3's report,
arXiv 2412.19437, 3.3.1: "MoE gating modules" stay in their original precision; Megatron-core's router is no
TransformerEngine module, so no fp8_autocast converts it).
"""

from __future__ import annotations

import math
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import _disable_current_modes

from ..profiles.workload import RoutedBlock

DEFAULT_TOP_K = 2  # GShard's and Mixtral's


@dataclass(frozen=True)
class ExpertShape:
    """A mixture of experts' MLP: `routed` experts of hidden size `ffn`, each token sent to `top_k` of them by a
    router, `shared` experts that every token passes (DeepSeek's, one MLP of shared·ffn), and the capacity factor
    of a model that drops tokens (None: it drops none, as Mixtral, Qwen3-MoE and DeepSeek-V3)."""

    routed: int
    top_k: int
    ffn: int
    shared: int = 0
    capacity_factor: float | None = None


@dataclass
class Dispatched:
    """What the routed experts run while `dispatches` records: the bytes of the token copies each dispatch sends
    to the experts (the combine returns as many) and of the experts' weights, each summed over the calls; the token
    copies routed and computed (their ratio: the share of the experts' products that is model work); and the
    storages of the experts' weights and of what their products read and write (by identity, held so that none is
    reused), by which workload/count.py tells the experts' own ops, forward and backward, from the rest."""

    blocks: list[RoutedBlock] = field(default_factory=list)  # each call's dispatch
    expert_weight_bytes: int = 0
    routed_copies: int = 0  # the k·T token copies routing sends, summed over the calls
    computed_copies: int = 0  # the token copies the experts compute (E·`expected_tokens`: padded to a capacity)
    bias_tensors: int = 0  # the experts' biases as parameters, one an expert and product (GroupedLinear's `bias{i}`)
    expert_storages: dict[int, torch.UntypedStorage] = field(default_factory=dict)

    def reads_experts(self, tensors: list[torch.Tensor]) -> bool:
        """Whether an op reading `tensors` is an expert's: it reads an expert's weights or products."""
        return bool(self.expert_storages) and any(id(t.untyped_storage()) in self.expert_storages for t in tensors)

    @property
    def token_bytes(self) -> int:
        """The bytes of the token copies the dispatches send, summed over the calls."""
        return sum(block.sent_bytes for block in self.blocks)


_recording: list[Dispatched] = []  # the records open, innermost last
_fusing: list[bool] = []  # `fused_swiglu`'s settings open, innermost last
_gating: list[bool] = []  # a router's gating product under way (`gating_now`)
_routing: list[bool] = []  # a mixture of experts' router under way (`router_now`)
_per_expert: list[bool] = []  # ops a runtime issues once a local expert under way (`per_expert_now`)
_host_waits: list[bool] = []  # a kernel the host waits for the GPU before issuing under way (`host_waits_now`)
# The recomputation regions under way that no module marks (workload/count.py's `_Regions` reads it): the routed
# experts' activation, Megatron-core's "moe_act" (`--recompute-modules`)
OPEN_REGIONS: list[str] = []
# The attribute that marks a module as a plain checkpoint's region (profiles/workload.py `CHECKPOINTED_REGIONS`, read
# by workload/count.py's `_Regions`), set where a model is built: a decoder layer's dense MLP "mlp", its mixture of
# experts "moe" (workload/hf.py `_as_megatron_runs`, workload/models.py `_Block`)
CHECKPOINT_REGION = "pipesim_checkpoint_region"
# The attribute that marks a norm as its decoder layer's own (its input or pre-MLP norm, Megatron-core's
# TransformerLayer input_layernorm and pre_mlp_layernorm: the "layernorm" recompute module's), not one inside its
# attention or mixer (a query's or key's norm, a Mamba-2 mixer's gated norm): set where a model is built
BLOCK_NORM = "pipesim_block_norm"
# The attribute that marks an MLA's query or key norm as run apart from the up-projection after it, not fused into it
# (so not in the "mla_up_proj" recompute region): an absorbed MLA's, which DSA keeps unfused (workload/dsa.py)
NORM_APART = "pipesim_norm_apart"


@contextmanager
def dispatches() -> Iterator[Dispatched]:
    """Record the routed experts run inside (workload/count.py: a layer's, for expert parallelism's all-to-all
    and its sharded weights)."""
    record = Dispatched()
    _recording.append(record)
    try:
        yield record
    finally:
        _recording.remove(record)


@contextmanager
def _open(settings: list[bool], setting: bool) -> Iterator[None]:
    """`setting` the innermost of `settings` inside."""
    settings.append(setting)
    try:
        yield
    finally:
        settings.pop()


def fused_swiglu(on: bool) -> AbstractContextManager[None]:
    """Count a gated MLP's activation (a routed expert's scaled by the router's weights) as one fused kernel (`on`)
    or as the ops that compute it, on the meta device inside."""
    return _open(_fusing, on)


def _fusing_now(t: torch.Tensor) -> bool:
    return t.device.type == "meta" and bool(_fusing) and _fusing[-1]


def gating_now() -> bool:
    """Whether the op running is a router's gating product or its casts, forward or backward (`gating_linear`)."""
    return bool(_gating)


def _in_gating() -> AbstractContextManager[None]:
    return _open(_gating, True)


def router_now() -> bool:
    """Whether the product running is a mixture of experts' router's, its gating linear to one score per routed
    expert, or its shared expert's gate's, to one score a token (`routing`): tensor parallelism keeps its weight
    whole (planning/estimate.py `_weight_splits`)."""
    return bool(_routing)


def per_expert_now() -> bool:
    """Whether the op running is one Megatron-core issues once a local expert where the count batches it over the
    experts (`_apply_bias`'s, forward and backward: `_per_local_expert`)."""
    return bool(_per_expert)


def host_waits_now() -> bool:
    """Whether the kernel running is one whose call first makes the host wait for the GPU to drain its queue: the
    clamped GLU's fused kernel, after Megatron-core's synchronous copy of its offset to the device
    (`routed_experts`), in the forward and where a recomputation reruns it."""
    return bool(_host_waits) and _host_waits[-1]


def _per_local_expert(*made: torch.Tensor) -> None:
    """Mark the backward of the ops that made `made` (their autograd nodes, whose hooks bracket each node's
    kernels, the engine's reductions of a broadcast operand's gradient included) as `per_expert_now`, as the
    forward's ran inside `_open(_per_expert, True)`."""
    def enter(grads: Any) -> None:
        _per_expert.append(True)

    def leave(grads: Any, given: Any) -> None:
        _per_expert.pop()

    for node in (t.grad_fn for t in made if t.grad_fn is not None):
        node.register_prehook(enter)
        node.register_hook(leave)


def routing() -> AbstractContextManager[None]:
    """Mark the products run inside as a router's (`router_now`): the gpt's `router`, a Hugging Face model's
    `gate` and `shared_expert_gate` (`gating_router`)."""
    return _open(_routing, True)


class Fused(torch.autograd.Function):
    """`compute(*inputs)` as one kernel on the meta device: autograd keeps its inputs only (Megatron-core's
    SwiGLUFunction and WeightedSwiGLUFunction keep the activation's input, and the weights), and its work, forward
    and backward, is one memory-bound kernel reading its inputs (and the output's gradient) and writing its output
    (the inputs' gradients), as the fused kernel runs (fusions/fused_bias_swiglu.py), not the ops that compute it:
    those run out of the count's sight, their graph kept for the backward, and the count sees the kernel make its
    output from its inputs (a storage of the output's shape, each input read into it), nothing else (the ops seen
    made silu's output, which their graph held unsaved until the backward: sim/caching_allocator.py's replay held
    it for every micro-batch in flight), and `kernels` hears the one kernel instead (workload/count.py records
    it). `gating`: a router's product, whose ops are its products and casts, counted as they run (`gating_now`)."""

    @staticmethod
    def forward(ctx: Any, compute: Callable[..., torch.Tensor], gating: bool, *inputs: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(*inputs)  # what the kernel keeps
        ctx.gating = gating
        with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t), \
                _in_gating() if gating else _one_kernel("fused_swiglu", inputs):
            ctx.leaves = tuple(t.detach().requires_grad_(t.is_floating_point()) for t in inputs)
            if gating:
                ctx.out = compute(*ctx.leaves)
                return ctx.out.detach()
            with _disable_current_modes():  # its ops and their graph, for the backward, out of the count's sight
                ctx.out = compute(*ctx.leaves)
            out = inputs[0].new_empty(ctx.out.shape, dtype=ctx.out.dtype)  # its one write, seen made from its reads
            for read in inputs[1:]:
                out.add_(read)
            _kernel_writes(out)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        wanted = [leaf for leaf, (node, _) in zip(ctx.leaves, ctx.next_functions) if _wanted(node)]
        with _in_gating() if ctx.gating else _one_kernel("fused_swiglu_backward", (grad, *ctx.leaves)):
            grads = tuple(torch.autograd.grad(ctx.out, wanted, grad, retain_graph=True) if wanted else ())
            if not ctx.gating:
                _kernel_writes(*grads)
        given = iter(grads)
        return None, None, *(next(given) if any(leaf is w for w in wanted) else None for leaf in ctx.leaves)


# The fused kernels under way, innermost last: each its name, the tensors it reads and those it writes
_kernels: list[tuple[str, tuple[torch.Tensor, ...], list[torch.Tensor], int]] = []
# Who hears each fused kernel once it has run, as (name, reads, writes, FLOPs): workload/count.py's op records
kernel_listeners: list[Callable[[str, tuple[torch.Tensor, ...], tuple[torch.Tensor, ...], int], None]] = []


def in_fused_kernel() -> bool:
    """Whether the op running is inside a fused kernel (`Fused`), whose own ops the count does not record."""
    return bool(_kernels)


def in_product_kernel() -> bool:
    """Whether the op running is inside a fused kernel whose products do FLOPs (FlashMLA's, flash-linear-attention's:
    a recomputation region ends at one, as at a product, workload/count.py `_Regions`)."""
    return bool(_kernels) and _kernels[-1][3] > 0


@contextmanager
def _one_kernel(name: str, reads: tuple[torch.Tensor, ...], flops: int = 0) -> Iterator[None]:
    """One kernel `name` reading `reads` (and writing what `_kernel_writes` is told inside), whose products do
    `flops` (0: memory-bound), told to `kernel_listeners` once its inside has run."""
    _kernels.append((name, reads, [], flops))
    try:
        yield
    finally:
        name, reads, writes, _ = _kernels.pop()
    for listener in kernel_listeners:
        listener(name, reads, tuple(writes), flops)


def _kernel_writes(*tensors: torch.Tensor) -> None:
    _kernels[-1][2].extend(tensors)


def _wanted(node: Any) -> bool:
    """Whether the backward under way wants the gradient along an input's edge `node`: the count's input-gradient
    pass wants none of the weights', so a fused kernel's weight gradient runs in the weight pass only."""
    if node is None:
        return False
    try:
        return torch._C._will_engine_execute_node(node)
    except RuntimeError:  # a leaf autograd.grad asked for: captured, not executed
        return True


def gated_mlp(down: Callable[[torch.Tensor], torch.Tensor], activation: Callable[[torch.Tensor], torch.Tensor],
              gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """A gated MLP's `down(activation(gate) * up)` from its gate and up products' outputs (transformers' gate_proj
    and up_proj, the gpt's gate_up halves), its activation one fused kernel on the meta device inside
    `fused_swiglu(True)` (keeping gate and up: Megatron-core's fc1 output, which its `bias_swiglu_impl` keeps),
    else as the eager ops run it (silu keeping gate, the product keeping silu's output and up)."""
    if _fusing_now(gate):
        return down(Fused.apply(lambda g, u: activation(g) * u, False, gate, up))
    return down(activation(gate) * up)


class _GatingCasts(TorchFunctionMode):
    """Inside a router's forward on the meta device: the casts of its input and weight (`kept`) are left to its
    product, which `gating_linear` computes in the dtype they asked for, keeping both as they are."""

    def __init__(self, kept: tuple[torch.Tensor, ...]) -> None:
        super().__init__()
        self.kept = {id(t.untyped_storage()) for t in kept}
        self.dtype: torch.dtype | None = None  # the dtype the router's code cast them to (None: their own)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _CASTS and id(args[0].untyped_storage()) in self.kept:
            dtype = torch.float32 if func is torch.Tensor.float else next(
                (a for a in (*args[1:], *kwargs.values()) if isinstance(a, torch.dtype)), None)
            if dtype is not None:
                self.dtype = dtype
                return args[0]
        if func is torch.nn.functional.linear:
            given = {**dict(zip(("input", "weight", "bias"), args)), **kwargs}
            return gating_linear(given["input"], given["weight"], self.dtype or given["input"].dtype,
                                 given.get("bias"))
        return func(*args, **kwargs)


_CASTS = (torch.Tensor.to, torch.Tensor.type, torch.Tensor.float)


def gating_router(router: torch.nn.Module, balanced: bool = False) -> None:
    """Run `router` (a mixture of experts' router: its `weight` and the product it computes from it) with its
    product as `gating_linear` on the meta device, marked as a router's (`routing`); `balanced`: the routed experts'
    router, whose logits the load-balancing loss reads where `router_aux_loss` asks for it (`with_aux_loss`)."""
    forward = router.forward

    def run(hidden: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        if hidden.device.type != "meta":
            return forward(hidden, *args, **kwargs)
        with _GatingCasts((hidden, router.weight)), routing():
            out = forward(hidden, *args, **kwargs)
        return with_aux_loss(out) if balanced else out
    router.forward = run


_aux_loss: list[str] = []  # `router_aux_loss`'s settings open, innermost last


@contextmanager
def router_aux_loss(kind: str) -> Iterator[None]:
    """Count a routed experts' router's load-balancing loss (Switch Transformer's, `aux_loss`) as `kind` of
    workload/sizes.py's `ROUTER_AUX_LOSSES` computes it in every MoE layer inside (`with_aux_loss`)."""
    _aux_loss.append(kind)
    try:
        yield
    finally:
        _aux_loss.pop()


class _AuxLossScaler(torch.autograd.Function):
    """Megatron-core's MoEAuxLossAutoScaler (transformer/moe/moe_utils.py): `activation` as it is, and in the
    backward the loss's gradient, ones times the main loss's scale, so autograd runs the loss's backward too."""

    @staticmethod
    def forward(ctx: Any, activation: torch.Tensor, loss: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(loss)
        with _disable_current_modes():  # `main_loss_backward_scale`, made once a run
            ctx.scale = loss.new_empty(())
        return activation

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        (loss,) = ctx.saved_tensors
        return grad, torch.ones_like(loss) * ctx.scale


class _FusedAuxScores(torch.autograd.Function):
    """TransformerEngine's `fused_compute_score_for_moe_aux_loss` (pytorch/router.py at v2.9): the float32 softmax
    of the logits and their top-k routing map, one kernel each way, keeping the scores."""

    @staticmethod
    def forward(ctx: Any, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        with _one_kernel("fused_aux_loss_scores", (logits,)):
            scores = torch.softmax(logits, -1, dtype=torch.float32)
            routing_map = logits.new_empty(logits.shape, dtype=torch.bool)
            _kernel_writes(scores, routing_map)
        ctx.save_for_backward(scores)
        ctx.logits_dtype = logits.dtype
        ctx.mark_non_differentiable(routing_map)
        ctx.set_materialize_grads(False)  # the routing map's gradient, none, made no zeros
        return routing_map, scores

    @staticmethod
    def backward(ctx: Any, _: Any, grad: torch.Tensor) -> torch.Tensor:
        (scores,) = ctx.saved_tensors
        with _one_kernel("fused_aux_loss_scores_backward", (grad, scores)):
            logits_grad = grad.new_empty(grad.shape, dtype=ctx.logits_dtype)
            _kernel_writes(logits_grad)
        return logits_grad


class _FusedAuxLoss(torch.autograd.Function):
    """TransformerEngine's `fused_moe_aux_loss` (pytorch/router.py at v2.9): the loss from the scores and the
    tokens an expert, one kernel each way."""

    @staticmethod
    def forward(ctx: Any, scores: torch.Tensor, tokens_per_expert: torch.Tensor) -> torch.Tensor:
        with _one_kernel("fused_aux_loss", (scores, tokens_per_expert)):
            loss = scores.new_empty(())
            _kernel_writes(loss)
        ctx.save_for_backward(tokens_per_expert)
        ctx.scores_shape = scores.shape
        return loss

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        (tokens_per_expert,) = ctx.saved_tensors
        with _one_kernel("fused_aux_loss_backward", (grad, tokens_per_expert)):
            scores_grad = grad.new_empty(ctx.scores_shape)
            _kernel_writes(scores_grad)
        return scores_grad, None


def with_aux_loss(out: Any) -> Any:
    """A routed experts' router's output `out` (its logits, or transformers 5's logits, weights and indices) with
    Megatron-core's load-balancing loss attached as `router_aux_loss` asks for it (none outside it or without
    gradients, as Megatron-core skips it under no_grad). The loss is computed from the logits and attached to
    what the experts read of the router (its weights where it gives them, else the logits), as TopKRouter's
    `apply_load_balancing_loss` attaches it to its probabilities (router.py at Megatron-LM 1e057005; `_apply_aux_loss`
    at b0cc2706). Its ops, as 1e057005 runs them unfused: the float32 softmax of the logits
    (`compute_routing_scores_for_aux_loss`), their sum over the tokens, the product with the tokens an expert (the
    routing map's column sums, which the router's top-k computes anyway) and its sum times a constant
    (`switch_load_balancing_loss_func`), the tracker's division and in-place add of its layer's entry
    (`save_to_aux_losses_tracker`); fused (`moe_router_fusion`, b0cc2706), TransformerEngine's two kernels and the
    sum of their routing map's columns (`get_tokens_per_expert_and_token_count`) in place of the first four. The
    all-reduce of the tokens an expert over the tensor x context-parallel ranks is not counted (128 integers at t4:
    a latency a layer micro-batch)."""
    if not _aux_loss or _aux_loss[-1] == "none" or not torch.is_grad_enabled():
        return out
    logits = out if torch.is_tensor(out) else out[0]
    tokens = logits.reshape(-1, logits.shape[-1])
    with _disable_current_modes():  # made elsewhere: the router's top-k sums its routing map, the tracker once a run
        per_expert = tokens.new_empty(tokens.shape[-1], dtype=torch.int64)
        tracked = tokens.new_empty(1, dtype=torch.float32)
    if _aux_loss[-1] == "fused":
        routing_map, scores = _FusedAuxScores.apply(tokens)
        loss = _FusedAuxLoss.apply(scores, routing_map.sum(0))
    else:
        scores = torch.softmax(tokens, -1, dtype=torch.float32)
        loss = torch.sum(scores.sum(0) * per_expert) * _TRACKED_COEFF  # times E·coeff/(T²·k): its value uncounted
    tracked[0] += (loss / _TRACKED_COEFF).detach()
    if torch.is_tensor(out):
        return _AuxLossScaler.apply(out, loss)
    return (out[0], _AuxLossScaler.apply(out[1], loss), *out[2:])


_TRACKED_COEFF = 1e-3  # the coefficient the tracker divides by: any nonzero one runs the same division


def gating_linear(inp: torch.Tensor, weight: torch.Tensor, dtype: torch.dtype,
                  bias: torch.Tensor | None = None) -> torch.Tensor:
    """A router's product `inp @ weight.T` (plus `bias`, gpt-oss's) computed in `dtype` from `inp`, `weight` and
    `bias` kept in their own dtype (Megatron-core's RouterGatingLinearFunction, which takes the bias too), its ops
    marked as the gating's (`gating_now`)."""
    def product(a: torch.Tensor, w: torch.Tensor, *b: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.linear(a.to(dtype), w.to(dtype), b[0].to(dtype) if b else None)

    given = (inp, weight) if bias is None else (inp, weight, bias)
    if inp.device.type != "meta":
        return product(*given)
    return Fused.apply(product, True, *given)


def _experts_own(*tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Mark `tensors` as the experts' own (`Dispatched.expert_storages`) in every record open; returns them."""
    for record in _recording:
        for t in tensors:
            record.expert_storages[id(t.untyped_storage())] = t.untyped_storage()
    return tensors


def expected_tokens(tokens: int, top_k: int, experts: int, capacity_factor: float | None = None) -> int:
    """The tokens each of `experts` experts computes for `tokens` tokens routed to `top_k` each, routing balanced:
    ⌈k·T/E⌉, or its capacity ⌈c·k·T/E⌉ with a capacity factor c, as Megatron-core's `get_capacity` (moe_utils.py),
    uncapped: workload/models.py `check_capacity_factor` refuses a c above E/k, whose capacity passes T."""
    return math.ceil(top_k * tokens / experts * (capacity_factor or 1.0))


def capacity(tokens: int, top_k: int, experts: int, capacity_factor: float | None) -> int | None:
    """The tokens past which an expert drops (None: it drops none)."""
    return None if capacity_factor is None else expected_tokens(tokens, top_k, experts, capacity_factor)


def routed_experts(hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
                   up: torch.Tensor, down: torch.Tensor, activation: Callable[[torch.Tensor], torch.Tensor],
                   capacity_factor: float | None = None, gated: bool = False,
                   biases: tuple[torch.Tensor, torch.Tensor] | None = None,
                   clamp: float | None = None, probs_on_input: bool = False) -> torch.Tensor:
    """The experts' weighted outputs summed per token, for `hidden` (T, d) routed as `top_k_index` and
    `top_k_weights` (T, k) say. `up` (E, d, u) and `down` (E, f, d) are every expert's two products, `activation`
    what runs between them (SwiGLU's silu(gate)·up halves u = 2f, `gated`), `biases` (E, u) and (E, d) their
    biases where the experts have them (gpt-oss's). On the meta device every expert takes its expected share
    (`expected_tokens`). The biases run as Megatron-core's TEGroupedMLP runs them (megatron/core/transformer/moe/
    experts.py, core_v0.15.0 to core_v0.18.0): the up product's added by the product itself (linear_fc1's
    skip_bias_add False: TransformerEngine's GroupedLinear adds it), the down product's returned apart
    (skip_bias_add True) and `_apply_bias`'s: each local expert's outputs plus its bias times the router's
    weights, `t + b * p`, the experts' results then joined by one `torch.cat`; the count batches that mul and add
    over the experts, forward and backward, marked as ops Megatron-core issues once a local expert
    (`per_expert_now`, which planning/experts.py `per_expert_products` issues so).

    `clamp`: the gated activation clamps its halves at this limit (gpt-oss's `swiglu_limit`: the gate at most it,
    the linear half within ±it), which Megatron-Bridge runs as Megatron-core's quick-GEGLU with
    `activation_func_clamp_value` (its gpt-oss bridge: `quick_gelu`, `glu_linear_offset` 1, clamp 7). Inside
    `fused_swiglu(True)` that is `weighted_bias_quick_geglu_impl` (fusions/fused_bias_geglu.py at Megatron-LM
    0d8e0714cd, b0cc2706, core_v0.17.0 and core_v0.18.0, the gpt-oss rows' pins): the two clamps and the
    `torch.cat` joining them run as eager ops before the fused kernel, counted so, and it makes its offset a
    device tensor, `torch.tensor(linear_offset, device=input.device)`, a copy from the host that torch makes
    synchronously (torch/csrc/utils/tensor_new.cpp `internal_new_from_data`: `.to(device, non_blocking=false)`;
    aten/src/ATen/native/cuda/Copy.cu `copy_kernel_cuda`: `memcpy_and_sync`, a cudaStreamSynchronize): the host
    waits for the GPU before the fused kernel, each call, the forward's and a recomputation's
    (`host_waits_now`).

    `probs_on_input`: the router's weights scale each routed token before its experts' products instead of the
    activation after (Llama 4's, Megatron-core's `moe_apply_probs_on_input`, which scales each expert's tokens after
    the dispatch: experts.py at 7094270c6f)."""
    tokens, width = hidden.shape
    experts, top_k = up.shape[0], top_k_index.shape[-1]
    out = torch.zeros_like(hidden)
    for record in _recording:  # each expert's tokens in turn: what a dispatch sends (padded to its capacity)
        sent = experts * expected_tokens(tokens, top_k, experts, capacity_factor) * width * hidden.element_size()
        record.blocks.append(RoutedBlock(tokens, top_k, sent))
        record.expert_weight_bytes += sum(w.untyped_storage().nbytes() for w in (up, down, *(biases or ())))
        record.bias_tensors += experts * len(biases or ())
        record.routed_copies += top_k * tokens
        record.computed_copies += experts * expected_tokens(tokens, top_k, experts, capacity_factor)
    if hidden.device.type == "meta":
        each = expected_tokens(tokens, top_k, experts, capacity_factor)
        token = torch.empty(experts * each, dtype=torch.long, device=hidden.device)  # each expert's tokens, in turn
        copy = torch.empty_like(token)  # and which of the T·k routed copies each one is
        routed = hidden.index_select(0, token).view(experts, each, width)
        weights = top_k_weights.reshape(-1).index_select(0, copy).view(experts, each, 1)
        if probs_on_input:  # the tokens scaled before the products
            routed = routed * weights.to(hidden.dtype)
        _experts_own(routed, up, down, *(biases or ()))  # what the experts' products read: their own ops read these
        inner = torch.bmm(routed, up) if biases is None else torch.baddbmm(biases[0].unsqueeze(1), routed, up)
        _experts_own(inner)
        # else the activation, before the down product, as Megatron-core (and the down product's bias, below)
        scale = None if probs_on_input and biases is None else weights.to(hidden.dtype)
        OPEN_REGIONS.append("moe_act")
        try:
            if gated and _fusing_now(inner):
                if clamp is not None:  # Megatron-core's eager clamps of the halves, joined again
                    glu, linear = inner.chunk(2, -1)
                    inner = _experts_own(torch.cat(_experts_own(glu.clamp(max=clamp), linear.clamp(-clamp, clamp)),
                                                   -1))[0]
                with _open(_host_waits, clamp is not None):
                    weighted = Fused.apply(lambda i, *w: _experts_own(activation(i))[0] * (w[0] if w else 1), False,
                                           inner, *(() if probs_on_input else (scale,)))
            else:
                active = activation(inner)
                _experts_own(active)
                weighted = active if probs_on_input else active * scale
        finally:
            OPEN_REGIONS.pop()
        _experts_own(weighted)
        done = torch.bmm(weighted, down)
        if biases is not None:  # `_apply_bias`: each local expert's t + b * p, joined by one torch.cat
            with _open(_per_expert, True):
                scaled = _experts_own(biases[1].unsqueeze(1) * scale)[0]
                biased = _experts_own(done + scaled)[0]
            _per_local_expert(scaled, biased)
            done = torch.cat(tuple(biased))
        return out.index_put((token,), done.view(experts * each, width), accumulate=True)  # keeps the index only
    limit = capacity(tokens, top_k, experts, capacity_factor)
    for expert in range(experts):
        token, slot = torch.where(top_k_index == expert)
        token, slot = token[:limit], slot[:limit]
        if token.numel():
            weight = top_k_weights[token, slot, None].to(hidden.dtype)
            inner = (hidden[token] * weight if probs_on_input else hidden[token]) @ up[expert] + (
                biases[0][expert] if biases is not None else 0)
            done = activation(inner) @ down[expert] + (biases[1][expert] if biases is not None else 0)
            out = out.index_add(0, token, done if probs_on_input else done * weight)
    return out


class ExpertExchange(ABC):
    """One rank's side of an expert-parallel group of `ranks` ranks: this rank, number `rank` in it, holds routed
    experts rank·n/E .. (rank+1)·n/E - 1 of n, and sends each token copy to the rank holding its expert. `spent_ns`
    adds up the time this rank spent in the exchanges, forward and backward, which the executor records as the
    schedule's all-to-all rows."""

    def __init__(self, rank: int, ranks: int) -> None:
        self.rank, self.ranks = rank, ranks
        self.spent_ns = 0

    def swap(self, tensor: torch.Tensor, send: list[int], receive: list[int]) -> torch.Tensor:
        """`tensor`'s rows, `send[r]` of them to rank r in order; what the ranks sent here, `receive[r]` from rank
        r, in rank order. Every rank of the group calls it at once."""
        began = time.perf_counter_ns()
        out = self._swap(tensor.detach().contiguous(), send, receive)
        self.spent_ns += time.perf_counter_ns() - began
        return out

    @abstractmethod
    def _swap(self, wire: torch.Tensor, send: list[int], receive: list[int]) -> torch.Tensor:
        """`swap` of a contiguous tensor that needs no gradient."""


class DistExchange(ExpertExchange):
    """An exchange over torch.distributed `group`: `all_to_all_single` with uneven splits (alltoallv), which gloo
    (torch 2.13: checked on CPU ranks), NCCL and MPI implement."""

    def __init__(self, group: Any, rank: int, ranks: int) -> None:
        super().__init__(rank, ranks)
        self.group = group

    def _swap(self, wire: torch.Tensor, send: list[int], receive: list[int]) -> torch.Tensor:
        import torch.distributed as dist

        out = wire.new_empty((sum(receive), *wire.shape[1:]))
        dist.all_to_all_single(out, wire, receive, send, group=self.group)
        return out


class _Exchanged(torch.autograd.Function):
    """An exchange autograd sees through: the gradients of the rows received go back to the ranks that sent
    them, by the same all-to-all with the splits swapped."""

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, exchange: ExpertExchange, send: list[int],
                receive: list[int]) -> torch.Tensor:
        ctx.exchange, ctx.send, ctx.receive = exchange, send, receive
        return exchange.swap(tensor, send, receive)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        return ctx.exchange.swap(grad, ctx.receive, ctx.send), None, None, None


def exchanged_experts(hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
                      up: torch.Tensor, down: torch.Tensor, activation: Callable[[torch.Tensor], torch.Tensor],
                      exchange: ExpertExchange, capacity_factor: float | None = None) -> torch.Tensor:
    """`routed_experts` with the experts spread over an expert-parallel group (`exchange`): `up` and `down` hold
    this rank's n/E experts. Dispatch: the token copies, sorted by expert (each expert's in token order, past its
    capacity dropped as `routed_experts` drops them), go to the ranks holding their experts, after an exchange of
    how many each expert gets from each rank. Each local expert computes every copy it received as one product,
    and the combine returns the outputs to the copies' ranks, which weight them and add them up per token in
    expert order, as `routed_experts` does. Every rank of the group calls this for the same layer at once."""
    tokens, local = hidden.shape[0], up.shape[0]
    experts = local * exchange.ranks
    expert = top_k_index.reshape(-1)
    order = torch.sort(expert, stable=True).indices  # by expert; each expert's copies in token order
    per_expert = torch.bincount(expert, minlength=experts)
    limit = capacity(tokens, top_k_index.shape[-1], experts, capacity_factor)
    if limit is not None:
        first = torch.cumsum(per_expert, 0) - per_expert
        order = order[torch.arange(len(order)) - first[expert[order]] < limit]
        per_expert = per_expert.clamp(max=limit)
    token, slot = order // top_k_index.shape[-1], order % top_k_index.shape[-1]
    counts = exchange.swap(per_expert, [local] * exchange.ranks, [local] * exchange.ranks).view(exchange.ranks, local)
    send = per_expert.view(exchange.ranks, local).sum(1).tolist()
    receive = counts.sum(1).tolist()
    received = _Exchanged.apply(hidden[token], exchange, send, receive)
    blocks = list(received.split([n for row in counts.tolist() for n in row]))  # by source rank, then expert
    for e in range(local):
        mine = blocks[e::local]
        sizes = [len(block) for block in mine]
        if sum(sizes):
            done = activation(torch.cat(mine) @ up[e]) @ down[e]
            blocks[e::local] = done.split(sizes)
    returned = _Exchanged.apply(torch.cat(blocks), exchange, receive, send)
    weighted = returned * top_k_weights[token, slot, None].to(hidden.dtype)
    return torch.zeros_like(hidden).index_add(0, token, weighted)
