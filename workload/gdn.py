"""A Gated DeltaNet mixer (transformers' Qwen3NextGatedDeltaNet, Qwen3_5GatedDeltaNet, OlmoHybridGatedDeltaNet: the
linear attention of Qwen3-Next, Qwen3.5 and OLMo Hybrid) counted on the meta device as Megatron-core's GatedDeltaNet
trains one, with flash-linear-attention's kernels.

Off the meta device a mixer computes what transformers computes (`run` trains it, `calibrate` times it: on a CPU its
PyTorch reference). On the meta device that reference is not what a GPU runs: a Python loop over the sequence's
chunks of 64 tokens, hundreds of small kernels a layer. Megatron-core (Megatron-LM d98e8a64
megatron/core/ssm/gated_delta_net/common.py and gdn.py) runs flash-linear-attention's causal conv (its activation
fused), its l2norm of a copy of the query and key joined, repeats them to the value heads, runs its
`chunk_gated_delta_rule`, then TransformerEngine's RMSNorm and the silu gate (compiled into one kernel). So during
the count the mixer's modeling
module's chunk rule and conv are those kernels' counts (`_fla_kernels`), its gated norm the two kernels; the mixer's
own projections, splits, decay and beta are transformers' torch code, counted as every model's is.

The chunk rule (fla-org/flash-linear-attention bc3b101d fla/ops/gated_delta_rule/chunk.py
`ChunkGatedDeltaRuleFunction`) is recorded kernel by kernel (`_ChunkRule`), each with the tensors it reads and writes
and the FLOPs of its products. With H heads (the value heads), each a query and key of K channels and a value of V,
chunks of BT = 64 tokens and NT of them a sequence, the products are per token and head 6·K·V + BT·(5.25·K + 4·V) +
BT²/2 forward and 16·K·V + 18·BT·K + 10·BT·V + 4·BT² backward, the backward's recomputation of the chunk states
included: 176k and 508k FLOPs at K = V = 128, where Megatron-LM's own `transformer_flops` counts 4·V² forward (66k).
The intra-chunk products are counted whole, the causal mask's upper tiles included, as the kernels compute them. The
forward saves the query and key (repeated), the value, the float32 cumulative decay, beta and each chunk's solved
(I + A)⁻¹ (BT values a token and head); the chunk states h (K·V a chunk and head) are recomputed in the backward.
Under context parallelism the count records what the mixer's two all-to-alls exchange (`context_exchanges`)."""

from __future__ import annotations

import contextlib
import functools
import math
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from .mamba import F32, _kernel
from .moe import OPEN_REGIONS, _kernel_writes, _one_kernel
from .norms import _FusedRmsNorm

MIXER_FIELDS = ("conv1d", "A_log", "dt_bias", "num_k_heads", "num_v_heads", "head_k_dim", "head_v_dim")
# What a mixer's modeling module calls the two functions whose kernels a run calls (flash-linear-attention's)
CHUNK_RULE, CONV = "torch_chunk_gated_delta_rule", "causal_conv1d_fn"
CHUNK_TOKENS = 64  # BT: flash-linear-attention's chunk (its `chunk_size` default, which transformers does not change)
# The widest tile of a value head's channels the output kernel's autotuning tries (chunk_o.py `chunk_fwd_kernel_o`,
# BV in 32, 64, 128), and of a key head's channels the dq/dk kernel's on an H100 (`CONST_TILING`): each tile beyond
# one recomputes the chunk's q·kᵀ (the output's) or its scores (the gradients')
WIDEST_TILE = 128


def is_gated_delta_net(module: nn.Module) -> bool:
    """Whether `module` is a Gated DeltaNet mixer laid out as transformers' (Qwen3-Next's, Qwen3.5's, OLMo
    Hybrid's), whose modeling module holds the two functions its kernels replace."""
    module_globals = vars(sys.modules[type(module).__module__])
    return (type(module).__name__.endswith("GatedDeltaNet") and all(hasattr(module, name) for name in MIXER_FIELDS)
            and CHUNK_RULE in module_globals and CONV in module_globals)


def context_exchanges(mixer: nn.Module) -> tuple[int, int]:
    """The elements a token `mixer`'s two all-to-alls exchange under context parallelism, where Megatron-core turns
    the rank's share of the sequence into its share of the heads before the conv and back after the gated norm
    (gated_delta_net/common.py `a2a_cp_to_hp`, `a2a_hp_to_cp`): its in_proj's output, the query, key, value, gate z,
    beta and decay (2·key + 2·value channels and 2 a value head), then the normed value."""
    keys, values = mixer.num_k_heads * mixer.head_k_dim, mixer.num_v_heads * mixer.head_v_dim
    return 2 * keys + 2 * values + 2 * mixer.num_v_heads, values


def counted_delta_nets(block: nn.Module) -> None:
    """Run every Gated DeltaNet mixer of `block` as `counted_delta_net`."""
    for module in block.modules():
        if is_gated_delta_net(module):
            module.forward = functools.partial(counted_delta_net, module, module.forward)


def counted_delta_net(mixer: nn.Module, computed: Callable[..., torch.Tensor], *args: Any, **kwargs: Any
                      ) -> torch.Tensor:
    """`mixer`'s forward (`computed`, transformers'), on the meta device with its kernels counted as a run's."""
    hidden = args[0] if args else kwargs["hidden_states"]
    if hidden.device.type != "meta":
        return computed(*args, **kwargs)
    with _fla_kernels(mixer):
        return computed(*args, **kwargs)


@contextlib.contextmanager
def _fla_kernels(mixer: nn.Module) -> Iterator[None]:
    """While inside: `mixer`'s modeling module's chunk rule and conv are their kernels' counts, and its gated norms
    (each child whose class ends in RMSNormGated) one fused kernel each way."""
    module_globals = vars(sys.modules[type(mixer).__module__])
    saved = {name: module_globals[name] for name in (CHUNK_RULE, CONV)}
    norms = [module for module in mixer.children() if type(module).__name__.endswith("RMSNormGated")]
    module_globals.update({CHUNK_RULE: _chunk_rule, CONV: _conv})
    for norm in norms:
        norm.forward = functools.partial(_gated_norm, norm)
    try:
        yield
    finally:
        module_globals.update(saved)
        for norm in norms:
            del norm.forward


@dataclass(frozen=True)
class _Shape:
    """The chunk rule's sizes: b sequences of s tokens, H heads, each a query and key of K channels and a value of V,
    chunks of BT tokens (NT a sequence)."""

    b: int
    s: int
    H: int
    K: int
    V: int
    BT: int = CHUNK_TOKENS

    @property
    def NT(self) -> int:
        return math.ceil(self.s / self.BT)

    @property
    def tokens(self) -> int:
        """A kernel's count of (token, head) pairs, each doing its FLOPs a token and head."""
        return self.b * self.s * self.H

    def per_head(self, width: int) -> tuple[int, ...]:
        """A head's per-token tensor of `width` channels (w, u, the output, their gradients)."""
        return (self.b, self.s, self.H, width)

    def states(self) -> tuple[int, ...]:
        """The chunk states h (and their gradients dh): K·V a chunk and value head."""
        return (self.b, self.NT, self.H, self.K, self.V)

    def scalars(self) -> tuple[int, ...]:
        """A head's scalar a token (the decay, beta)."""
        return (self.b, self.s, self.H)


def _chunk_rule(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                chunk_size: int = CHUNK_TOKENS, initial_state: torch.Tensor | None = None,
                output_final_state: bool = False, use_qk_l2norm_in_kernel: bool = False, **kwargs: Any
                ) -> tuple[torch.Tensor, None]:
    """transformers' `torch_chunk_gated_delta_rule` as Megatron-core's GatedDeltaNet runs it in training (no initial
    or final state: a training step starts each sequence afresh): the query and key l2-normed by their own kernel
    (flash-linear-attention's `l2norm`, once over the two joined), repeated to the value heads, then the chunk rule's
    kernels (`_ChunkRule`)."""
    if use_qk_l2norm_in_kernel:  # the two joined, one kernel, as Megatron-core norms its query_key copy
        query, key = _L2Norm.apply(torch.cat((query, key), dim=2)).split(query.shape[2], dim=2)
    b, s, heads, width = value.shape
    repeats = heads // query.shape[2]
    if repeats > 1:
        query, key = (x.repeat_interleave(repeats, dim=2) for x in (query, key))
    shape = _Shape(b, s, heads, query.shape[3], width, chunk_size)
    return _ChunkRule.apply(shape, query, key, value, g, beta), None


class _L2Norm(torch.autograd.Function):
    """flash-linear-attention's `l2norm`: one kernel each way, saving its output and float32 reciprocal norms."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        out, rstd = _kernel("l2norm_fwd", (x,), [(x.shape, x.dtype), (x.shape[:-1], F32)])
        ctx.save_for_backward(out, rstd)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        out, rstd = ctx.saved_tensors
        return _kernel("l2norm_bwd", (out, rstd, grad), [(grad.shape, grad.dtype)])[0]


def _states(s: _Shape, k: torch.Tensor, v: torch.Tensor, beta: torch.Tensor, A: torch.Tensor, gc: torch.Tensor
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """w and u of the WY representation, then the chunk states h and the new values v_new, passed chunk to chunk:
    the forward's, and the backward's recomputation of them. Returns (w, h, v_new)."""
    dtype = k.dtype
    w, u = _kernel("recompute_w_u_fwd", (k, v, beta, A, gc), [(s.per_head(s.K), dtype), (s.per_head(s.V), dtype)],
                   s.tokens * 2 * s.BT * (s.K + s.V))
    h, v_new = _kernel("chunk_gated_delta_rule_fwd_h", (k, u, w, gc), [(s.states(), dtype), (s.per_head(s.V), dtype)],
                       s.tokens * 4 * s.K * s.V)
    return w, h, v_new


class _ChunkRule(torch.autograd.Function):
    """flash-linear-attention's `ChunkGatedDeltaRuleFunction` (the module docstring), kernel by kernel."""

    @staticmethod
    def forward(ctx: Any, shape: _Shape, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                beta: torch.Tensor) -> torch.Tensor:
        s, dtype = shape, k.dtype
        (gc,) = _kernel("chunk_local_cumsum", (g,), [(s.scalars(), F32)])
        with _one_kernel("zeros", ()):  # the solved blocks' buffer, zeroed before the kernel fills its lower blocks
            A = k.new_empty((*s.scalars(), s.BT))
            _kernel_writes(A)
        _kernel("chunk_gated_delta_rule_fwd_kkt_solve", (k, gc, beta), [],
                s.tokens * (5 * s.BT * s.K // 4 + s.BT * s.BT // 2), into=(A,))
        _, h, v_new = _states(s, k, v, beta, A, gc)
        tiles = math.ceil(s.V / WIDEST_TILE)
        (out,) = _kernel("chunk_fwd_o", (q, k, v_new, h, gc), [(s.per_head(s.V), dtype)],
                         s.tokens * (2 * s.K * s.V + 2 * s.BT * s.K * tiles + 2 * s.BT * s.V))
        ctx.shape = shape
        ctx.save_for_backward(q, k, v, gc, beta, A)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        s = ctx.shape
        q, k, v, gc, beta, A = ctx.saved_tensors
        dtype = k.dtype
        w, h, v_new = _states(s, k, v, beta, A, gc)
        (dv_local,) = _kernel("chunk_bwd_dv_local", (q, k, gc, grad), [(s.per_head(s.V), dtype)],
                              s.tokens * 2 * s.BT * (s.K + s.V))
        dh, dv = _kernel("chunk_gated_delta_rule_bwd_dhu", (q, k, w, gc, grad, dv_local),
                         [(s.states(), dtype), (s.per_head(s.V), dtype)], s.tokens * 6 * s.K * s.V)
        tiles = math.ceil(s.K / WIDEST_TILE)
        dq, dk, dw, dg_tiles = _kernel(
            "chunk_bwd_dqkwg", (q, k, v_new, gc, h, grad, dh, dv),
            [(s.per_head(s.K), dtype)] * 3 + [((tiles, *s.scalars()), F32)],
            s.tokens * (6 * s.K * s.V + 4 * s.BT * s.K + 2 * s.BT * s.V * tiles))
        (dg,) = _kernel("sum", (dg_tiles,), [(s.scalars(), F32)])
        dk_wy, dv_out, dbeta, dg_wy = _kernel(
            "prepare_wy_repr_bwd", (k, v, beta, gc, A, dw, dv),
            [(s.per_head(s.K), dtype), (s.per_head(s.V), dtype), (s.scalars(), beta.dtype), (s.scalars(), F32)],
            s.tokens * (10 * s.BT * s.K + 4 * s.BT * s.V + 4 * s.BT * s.BT))
        _kernel("add", (dk, dk_wy), [], into=(dk,))
        _kernel("add", (dg, dg_wy), [], into=(dg,))
        (dg,) = _kernel("chunk_local_cumsum", (dg,), [(s.scalars(), F32)])
        return None, dq, dk, dv_out, dg, dbeta


def _conv(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
          activation: str | None = None, **kwargs: Any) -> torch.Tensor:
    """transformers' `causal_conv1d_fn` as flash-linear-attention's `causal_conv1d` runs it, its activation fused
    (`_Conv`)."""
    return _Conv.apply(hidden, weight, bias)


class _Conv(torch.autograd.Function):
    """flash-linear-attention's `CausalConv1dFunction` (fla/modules/conv/triton/ops.py), Megatron-core's conv: a
    depthwise causal conv of K taps over C channels, one kernel forward, saving its input; its backward reruns the
    conv (its output before the activation), then one kernel writes the input's gradient and the weight's float32
    partial sums a chunk of BT tokens, which a sum and a cast make the weight's gradient (`causal_conv1d_bwd`)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        ctx.save_for_backward(x, weight, bias)
        return _conv_kernel(x, *_held(weight, bias))

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, weight, bias = ctx.saved_tensors
        b, c, t = x.shape
        conv = _held(weight, bias)
        before = _conv_kernel(x, *conv)
        chunks = b * math.ceil(t / CHUNK_TOKENS)
        dx, *partials = _kernel("causal_conv1d_bwd", (x, before, grad, *conv),
                                [(x.shape, x.dtype)] + [((chunks, *t_.shape), F32) for t_ in conv],
                                4 * b * t * c * weight.shape[-1])
        summed = [_kernel("sum", (partial,), [(t_.shape, F32)])[0] for partial, t_ in zip(partials, conv)]
        grads = [grad_ if t_.dtype == F32 else _kernel("_to_copy", (grad_,), [(t_.shape, t_.dtype)])[0]
                 for grad_, t_ in zip(summed, conv)]  # cast to the weight's dtype where it is not float32
        return dx, grads[0], grads[1] if bias is not None else None


def _held(*tensors: torch.Tensor | None) -> tuple[torch.Tensor, ...]:
    """The conv's weight and bias it has (a conv may have no bias)."""
    return tuple(tensor for tensor in tensors if tensor is not None)


def _conv_kernel(x: torch.Tensor, *conv: torch.Tensor) -> torch.Tensor:
    """The conv's forward kernel (`causal_conv1d_fwd`) of its weight (and bias: `conv`), its output in x's layout:
    transformers hands it channels last (a transpose's view), as Megatron-core holds them."""
    b, c, t = x.shape
    with _one_kernel("causal_conv1d_fwd", (x, *conv), 2 * b * t * c * conv[0].shape[-1]):
        out = torch.empty_like(x)
        _kernel_writes(out)
    return out


def _gated_norm(norm: nn.Module, hidden: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """A gated RMSNorm's weight·norm(hidden)·silu(gate) as Megatron-core's GatedDeltaNet runs it
    (`_apply_gated_norm`): TransformerEngine's RMSNorm, one kernel each way, then the gate, one fused kernel each way
    (its `jit_fuser`, torch.compile), keeping the norm's output and the gate."""
    epsilon = getattr(norm, "variance_epsilon", getattr(norm, "eps", 0.0))  # no matter on the meta device
    OPEN_REGIONS.append("gdn_norm_out")  # Megatron-core's recompute module of the norm and gate (`_gated_norm_and_a2a`)
    try:
        return _Gate.apply(_FusedRmsNorm.apply(hidden, norm.weight, epsilon), gate)
    finally:
        OPEN_REGIONS.pop()


class _Gate(torch.autograd.Function):
    """y·act(gate) (silu, or the model's gate activation) as one kernel each way, saving y and the gate."""

    @staticmethod
    def forward(ctx: Any, y: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(y, gate)
        return _kernel("norm_gate", (y, gate), [(y.shape, y.dtype)])[0]

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        y, gate = ctx.saved_tensors
        dy, dgate = _kernel("norm_gate_backward", (grad, y, gate), [(y.shape, y.dtype), (gate.shape, gate.dtype)])
        return dy, dgate
