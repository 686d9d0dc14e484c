"""DeepSeek Sparse Attention (DSA: the attention of DeepSeek-V3.2 and GLM-5, transformers' DeepseekV32Attention and
GlmMoeDsaAttention) counted on the meta device as Megatron-core trains it.

A DSA layer is MLA whose queries each attend to `index_topk` keys (2,048) that a lightning indexer picks: a few heads
(64 of 128 channels at DeepSeek-V3.2) score every earlier key, sum_h w_h·relu(q_h·k), and the top k are kept.
Transformers computes it as dense attention under a mask, and its indexer's [s, s] scores in float32. Megatron-core
(Megatron-LM d98e8a64 megatron/core/transformer/experimental_attention_variant/dsa.py, dsa_cudnn_kernels.py) trains it
absorbed (`AbsorbedMLASelfAttention`: MQA over the 576-channel latent, the value the first 512, the key up-projection
folded into the query and the value's applied after attention), with the cuDNN backend Megatron-Bridge's GLM-5
recipes select (`dsa_kernel_backend = "cudnn"`) and their bridge's indexer loss (glm5_bridge.py: a KL divergence of
the indexer's distribution from the attention's over the kept keys, coefficient 0.001, the indexer's inputs
detached, so no gradient reaches the model through it). So on the meta device a DSA layer runs, per micro-batch of
b sequences of s tokens, H heads, an indexer of H_I heads of D_I channels, k kept keys, and P = b·sum_i min(k, i+1)
query-key pairs kept:

- the MLA projections and norms as transformers', the two absorptions as einsums of the key/value up-projection's
  weight (their FLOPs those of the up-projection they replace);
- the indexer's projections, norm and RoPE as transformers', on the detached hidden state and query latent (their
  backward computes weight gradients only), the Hadamard rotation of its query and key where Megatron-core applies it
  (`dsa_indexer_rotate_activation`, on by default, off in Megatron-Bridge's GLM-5 bridge);
- `_SparseAttention`, the fused path (`FusedIndexerSparseAttnFunc`), kernel by kernel: the indexer's scores over the
  causal pairs into an [s, s] float32 buffer (2·H_I·D_I FLOPs a pair), the top k of each row, the kept indices
  compacted and sorted, FlashMLA's sparse forward (2·H·(576 + 512) FLOPs a kept pair), then the loss: the indexer's
  log-softmax, the attention's distribution over the kept keys recomputed from the saved log-sum-exp (2·H·576 a pair),
  its normalisation and the KL, and the indexer's backward, which cuDNN runs inside the forward (6·H_I·D_I a pair),
  its gradients saved. Its backward: the rows' compaction copies, the sparse attention's backward (2·H·(3·576 +
  2·512) a pair, out and the log-sum-exp saved), and the indexer's saved gradients scaled.

The loss's kernels run only with gradients on: under full recomputation in the rerun, not in the first,
checkpointed forward (profiles/workload.py `GRAD_ONLY_KERNELS`, which the estimate prices so). Off the meta device
a layer computes transformers' model (its indexer untrained, as transformers runs it under no_grad; the attention
masked to the kept keys: workload/hf.py `counted_attention`)."""

from __future__ import annotations

import functools
import inspect
import math
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
from torch import nn

from .count import unfused_count
from .mamba import F32, _kernel
from .models import ModelError
from .moe import NORM_APART, OPEN_REGIONS

I32 = torch.int32
INDEXER_FIELDS = ("wq_b", "wk", "k_norm", "weights_proj", "n_heads", "head_dim", "index_topk", "softmax_scale")
MLA_FIELDS = ("q_a_proj", "q_a_layernorm", "q_b_proj", "kv_a_proj_with_mqa", "kv_a_layernorm", "kv_b_proj", "o_proj")


class IndexerLayout(NamedTuple):
    """How a model's indexer runs: whether Megatron-core rotates its query and key by a Hadamard transform
    (`dsa_indexer_rotate_activation`, True by default, transformer_config.py; Megatron-Bridge's GLM-5 bridge sets it
    False, glm5_bridge.py; DeepSeek-V3.2 has no bridge: the default), and whether its RoPE pairs channels interleaved
    (GLM-5's, as transformers' GlmMoeDsaIndexer and the bridge's `dsa_indexer_rope_interleaved`) or as halves
    (DeepSeek-V3.2's)."""

    rotated: bool
    interleaved_rope: bool


# The DSA models pipesim counts, by transformers' model_type
INDEXERS = {"deepseek_v32": IndexerLayout(rotated=True, interleaved_rope=False),
            "glm_moe_dsa": IndexerLayout(rotated=False, interleaved_rope=True)}
# The float32 scores Megatron-core's fused cuDNN path computes a micro-batch's [b, s, s] pairs in at once: the rows
# that fit 1 GiB, rounded down to 512 (dsa_cudnn_kernels.py `_indexer_score_chunk_rows`, `_bytes_to_chunk_rows`);
# where that is fewer than s, the rows are scored in chunks by a PyTorch fallback over the whole rectangle, which
# pipesim does not count
FUSED_SCORE_BYTES = 1 << 30
SCORE_ROW_ALIGNMENT = 512


def scored_at_once(b: int, s: int) -> bool:
    """Whether the fused path scores a micro-batch of b sequences of s tokens in one call (`FUSED_SCORE_BYTES`)."""
    rows = max(1, FUSED_SCORE_BYTES // (4 * b * s))
    return (rows // SCORE_ROW_ALIGNMENT * SCORE_ROW_ALIGNMENT if rows >= SCORE_ROW_ALIGNMENT else rows) >= s


def longest_scored_at_once(b: int) -> int:
    """The most tokens a sequence `scored_at_once` at micro-batch size b (16,384 at b = 1, 11,397 at 2)."""
    s = math.isqrt(FUSED_SCORE_BYTES // (4 * b))
    while not scored_at_once(b, s):
        s -= 1
    return s


def is_sparse_attention(module: nn.Module) -> bool:
    """Whether `module` is an MLA attention with a DSA indexer laid out as transformers' (DeepSeek-V3.2's,
    GLM-5's)."""
    indexer = getattr(module, "indexer", None)
    return (indexer is not None and all(hasattr(indexer, name) for name in INDEXER_FIELDS)
            and all(hasattr(module, name) for name in MLA_FIELDS))


def counted_sparse_attentions(block: nn.Module) -> None:
    """Run every DSA attention of `block` as `counted_sparse_attention`, its query and key norms apart from the
    up-projection (Megatron-core's sparse attention spec keeps them unfused: its indexer reads the normed query
    latent, experimental_attention_variant_module_specs.py), so outside the "mla_up_proj" checkpoint."""
    for module in block.modules():
        if is_sparse_attention(module):
            # GLM-5's returns the layer's top k too, for a later layer to share
            passes_on = "prev_topk_indices" in inspect.signature(type(module).forward).parameters
            module.forward = functools.partial(counted_sparse_attention, module, module.forward, passes_on)
            for norm in (module.q_a_layernorm, module.kv_a_layernorm):
                setattr(norm, NORM_APART, True)


def counted_sparse_attention(attention: nn.Module, computed: Callable[..., Any], passes_on: bool,
                             hidden_states: torch.Tensor, position_embeddings: tuple[torch.Tensor, torch.Tensor],
                             attention_mask: torch.Tensor | None = None, **kwargs: Any) -> tuple[Any, ...]:
    """`attention`'s forward: transformers' (`computed`) off the meta device, handed the causal mask its indexer
    reads; on it, Megatron-core's absorbed DSA with its kernels counted, returned as transformers' (`passes_on`: with
    a third value, the top k, which no layer pipesim counts reads)."""
    if hidden_states.device.type != "meta":
        if attention_mask is None:
            s = hidden_states.shape[1]
            attention_mask = hidden_states.new_full((1, 1, s, s), float("-inf")).triu(1)
        return computed(hidden_states, position_embeddings, attention_mask, **kwargs)
    out = _absorbed(attention, hidden_states, position_embeddings)
    return (out, None, None) if passes_on else (out, None)


def _absorbed(attention: nn.Module, hidden: torch.Tensor, position_embeddings: tuple[torch.Tensor, torch.Tensor]
              ) -> torch.Tensor:
    """Megatron-core's AbsorbedMLASelfAttention around DSAttention (absorbed_mla.py): the query's no-RoPE part
    times the key up-projection, with its RoPE part the 576-channel query; the normed key latent with its RoPE part
    the one key (the query's up-projection, that product, the RoPE and both joins are its "mla_up_proj"
    recomputation region, `qkv_up_proj_and_rope_apply`); the sparse attention's 512-channel output times the value
    up-projection; then o_proj."""
    b, s, _ = hidden.shape
    if unfused_count():
        raise ModelError("--attention math: Megatron-core runs an unfused sparse attention as its dense float32 "
                         "reference (dsa.py `_unfused_absorbed_dsa_fn`, every query-key pair), which pipesim does not "
                         "count; give --attention flash")
    if not scored_at_once(b, s):
        smaller = " or a smaller --microbatch-size" if b > 1 else ""
        raise ModelError(f"--seq-len: a sparse attention's indexer scores a micro-batch's {b:,} x {s:,} x {s:,} "
                         "pairs in float32 at once only within 1 GiB (Megatron-core's fused cuDNN path; past it, in "
                         "row chunks by a PyTorch fallback pipesim does not count): give "
                         f"{longest_scored_at_once(b):,} or less{smaller}")
    heads, nope, rope = attention.num_heads, attention.qk_nope_head_dim, attention.qk_rope_head_dim
    latent, value = attention.kv_lora_rank, attention.v_head_dim
    rotate = vars(sys.modules[type(attention).__module__])["apply_rotary_pos_emb_interleave"]
    q_resid = attention.q_a_layernorm(attention.q_a_proj(hidden))
    kv_pass, k_rot = attention.kv_a_proj_with_mqa(hidden).split([latent, rope], dim=-1)
    kv_pass = attention.kv_a_layernorm(kv_pass)
    k_up, v_up = attention.kv_b_proj.weight.view(heads, nope + value, latent).split([nope, value], dim=1)
    # the indexer's inputs first: the region below marks the RoPE tables its slices view as its own
    index_q, index_k, weights = _indexer_inputs(attention, hidden.detach(), q_resid.detach(), position_embeddings)
    OPEN_REGIONS.append("mla_up_proj")  # Megatron-core's checkpoint of `qkv_up_proj_and_rope_apply`, products and all
    try:
        q_nope, q_rot = attention.q_b_proj(q_resid).view(b, s, heads, nope + rope).split([nope, rope], dim=-1)
        q_rot, k_rot = rotate(q_rot, k_rot.view(b, s, 1, rope), *position_embeddings, unsqueeze_dim=2)
        query = torch.cat([torch.einsum("bshd,hdc->bshc", q_nope, k_up), q_rot], dim=-1)
        key = torch.cat([kv_pass, k_rot.view(b, s, rope)], dim=-1)
    finally:
        OPEN_REGIONS.pop()
    shape = _Shape(b, s, heads, latent, rope, attention.indexer.n_heads, attention.indexer.head_dim,
                   min(attention.indexer.index_topk, s))
    out = _SparseAttention.apply(shape, query, key, index_q, index_k, weights)
    out = torch.einsum("bshc,hdc->bshd", out, v_up).reshape(b, s, heads * value)
    return attention.o_proj(out)


def _indexer_inputs(attention: nn.Module, hidden: torch.Tensor, q_resid: torch.Tensor,
                    position_embeddings: tuple[torch.Tensor, torch.Tensor]
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The indexer's query (from the query latent), key (normed) and head weights (DSAIndexer.forward_before_topk),
    RoPE on the first `qk_rope_head_dim` channels and the Hadamard rotation of the query and key as the model's
    `IndexerLayout` says."""
    indexer, layout = attention.indexer, INDEXERS[attention.config.model_type]
    b, s, _ = hidden.shape
    heads, width, rope = indexer.n_heads, indexer.head_dim, attention.qk_rope_head_dim
    module_globals = vars(sys.modules[type(attention).__module__])
    rotate = module_globals["apply_rotary_pos_emb_interleave" if layout.interleaved_rope else "apply_rotary_pos_emb"]
    q_rot, q_pass = indexer.wq_b(q_resid).view(b, s, heads, width).split([rope, width - rope], dim=-1)
    k_rot, k_pass = indexer.k_norm(indexer.wk(hidden)).view(b, s, 1, width).split([rope, width - rope], dim=-1)
    q_rot, k_rot = rotate(q_rot, k_rot, *position_embeddings, unsqueeze_dim=2)
    query, key = torch.cat([q_rot, q_pass], dim=-1), torch.cat([k_rot, k_pass], dim=-1).view(b, s, width)
    if layout.rotated:
        query, key = _Hadamard.apply(query), _Hadamard.apply(key)
    return query, key, indexer.weights_proj(hidden) * (heads**-0.5 * indexer.softmax_scale)


class _Hadamard(torch.autograd.Function):
    """fast_hadamard_transform's kernel over the last dimension (Megatron-core's `rotate_activation`), its
    backward the same transform of the gradient."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return _kernel("hadamard_transform", (x,), [(x.shape, x.dtype)])[0]

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return _kernel("hadamard_transform", (grad,), [(grad.shape, grad.dtype)])[0]


@dataclass(frozen=True)
class _Shape:
    """A DSA layer's sizes: b sequences of s tokens, H heads over a key latent of `latent` channels and a RoPE part of
    `rope`, an indexer of `index_heads` heads of `index_width`, `kept` keys a query (k, at most s)."""

    b: int
    s: int
    H: int
    latent: int
    rope: int
    index_heads: int
    index_width: int
    kept: int

    @property
    def key_width(self) -> int:
        """The absorbed query's and the key's channels (576 at DeepSeek-V3.2)."""
        return self.latent + self.rope

    @property
    def causal_pairs(self) -> int:
        """The query-key pairs the indexer scores: each query with every key up to its own."""
        return self.b * self.s * (self.s + 1) // 2

    @property
    def kept_pairs(self) -> int:
        """P: the pairs the sparse attention computes, each query with min(k, i + 1) keys (FlashMLA's
        `topk_length`)."""
        k, s = self.kept, self.s
        return self.b * (k * (k + 1) // 2 + (s - k) * k)

    def rows(self, *width: int) -> tuple[int, ...]:
        """A tensor of `width` a token (the indices, the kept scores: (b, s, k))."""
        return (self.b, self.s, *width)


class _SparseAttention(torch.autograd.Function):
    """Megatron-core's fused DSA path on the cuDNN backend with the sparse indexer loss (dsa_cudnn_kernels.py
    `FusedIndexerSparseAttnFunc`), kernel by kernel: see the module's docstring."""

    @staticmethod
    def forward(ctx: Any, shape: _Shape, query: torch.Tensor, key: torch.Tensor, index_q: torch.Tensor,
                index_k: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        s, pairs = shape, shape.kept_pairs
        (scores,) = _kernel("dsa_indexer_forward", (index_q, index_k, weights), [((s.b, s.s, s.s), F32)],
                            flops=2 * s.index_heads * s.index_width * s.causal_pairs)
        causal = scores.view(-1)[:s.causal_pairs]  # the top-k reads each row's causal prefix
        indices, kept = _kernel("dsa_indexer_top_k", (causal,), [(s.rows(s.kept), I32), (s.rows(s.kept), F32)])
        indices, kept = _kernel("dsa_topk_compact", (indices, kept), [(s.rows(s.kept), I32), (s.rows(s.kept), F32)])
        (indices,) = _kernel("dsa_topk_sort", (indices,), [(s.rows(s.kept), I32)])
        out, lse = _kernel("flash_mla_sparse_fwd", (query, key, indices),
                           [(s.rows(s.H, s.latent), query.dtype), (s.rows(s.H), F32)],
                           flops=2 * s.H * (s.key_width + s.latent) * pairs)
        (predicted,) = _kernel("dsa_indexer_log_softmax", (kept,), [(s.rows(s.kept), F32)])
        (target,) = _kernel("sparse_attn_score_recompute", (query, key, lse, indices), [(s.rows(s.kept), F32)],
                            flops=2 * s.H * s.key_width * pairs)
        (target,) = _kernel("dsa_indexer_target_normalize", (target,), [(s.rows(s.kept), F32)])
        _kernel("dsa_indexer_kl", (target, predicted), [(s.rows(), F32)])
        gradients = _kernel("dsa_indexer_backward", (index_q, weights, index_k, target, predicted, indices),
                            [(t.shape, t.dtype) for t in (index_q, index_k, weights)],
                            flops=6 * s.index_heads * s.index_width * pairs)
        (saved_indices,) = _kernel("clamp_min", (indices,), [(indices.shape, I32)])  # a copy, the loss being on
        ctx.shape = shape
        ctx.save_for_backward(query, key, saved_indices, out, lse, *gradients)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        s = ctx.shape
        query, key, indices, out, lse, *gradients = ctx.saved_tensors
        rows = _kernel("index_select", (query, out, grad, lse, indices),
                       [(t.shape, t.dtype) for t in (query, out, grad, lse, indices)])  # the rows' compaction
        dq, dkv = _kernel("sparse_attention_backward", (*rows[:2], key, *rows[2:]),
                          [(query.shape, query.dtype), (key.shape, key.dtype)],
                          flops=2 * s.H * (3 * s.key_width + 2 * s.latent) * s.kept_pairs)
        (dq,) = _kernel("index_copy", (dq,), [(query.shape, query.dtype)])
        scaled = [_kernel("mul", (g,), [(g.shape, g.dtype)])[0] for g in gradients]
        return None, dq, dkv, *scaled
