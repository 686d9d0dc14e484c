"""DeepSeek Sparse Attention (DSA: the attention of DeepSeek-V3.2, GLM-5 and GLM-5.2, transformers' DeepseekV32Attention
and GlmMoeDsaAttention) counted on the meta device as Megatron-core trains it.

A DSA layer is MLA whose queries each attend to `index_topk` keys (2,048) that a lightning indexer picks: a few heads
(64 of 128 channels at DeepSeek-V3.2) score every earlier key, sum_h w_h·relu(q_h·k), and the top k are kept.
Transformers computes it as dense attention under a mask, and its indexer's [s, s] scores in float32. Megatron-core
(Megatron-LM d98e8a64 megatron/core/transformer/experimental_attention_variant/dsa.py, dsa_cudnn_kernels.py) trains it
absorbed (`AbsorbedMLASelfAttention`: MQA over the 576-channel latent, the value the first 512, the key up-projection
folded into the query and the value's applied after attention), with the cuDNN backend Megatron-Bridge's GLM-5 recipes
select (`dsa_kernel_backend = "cudnn"`) and their bridge's indexer loss (glm5_bridge.py: a KL divergence of the
indexer's distribution from the attention's over the kept keys, coefficient 0.001, the indexer's inputs detached, so no
gradient reaches the model through it). So on the meta device a DSA layer runs, per micro-batch of b sequences of s
tokens, H heads, an indexer of H_I heads of D_I channels, k kept keys, and P = b·sum_i min(k, i+1) query-key pairs kept:

- the MLA projections and norms as transformers', the two absorptions as einsums of the key/value up-projection's weight
  (their FLOPs those of the up-projection they replace);
- the indexer's projections, norm and RoPE as transformers', on the detached hidden state and query latent (their
  backward computes weight gradients only), the Hadamard rotation of its query and key where Megatron-core applies it
  (`dsa_indexer_rotate_activation`, on by default, off in Megatron-Bridge's GLM-5 bridge);
- `_SparseAttention`, the fused path (`FusedIndexerSparseAttnFunc`), kernel by kernel: the indexer's scores over the
  causal pairs into an [s, s] float32 buffer (2·H_I·D_I FLOPs a pair), the top k of each row, the kept indices compacted
  (again where the loss is on: FlashMLA is handed no top-k length) and sorted, FlashMLA's sparse forward (2·H·(576 +
  512) FLOPs a kept pair), then the loss: the indexer's log-softmax, the attention's distribution over the kept keys
  recomputed from the saved log-sum-exp (2·H·576 a pair), its normalisation and the KL, and the indexer's backward,
  which cuDNN runs inside the forward (below), its gradients saved. Its backward: the rows' compaction copies, the
  sparse attention's backward (2·H·(3·576 + 2·512) a pair, out and the log-sum-exp saved), and the indexer's saved
  gradients scaled.

The indexer's backward takes no top-k length and at least 64 heads (dsa_cudnn_kernels.py
`_pad_indexer_heads_for_backward`: GLM-5's 32 padded, the query and weights copied), so it computes 6·max(H_I, 64)·D_I
FLOPs for each of a query's k slots, b·s·k of them, where P are kept. The sparse backward copies its rows twice (a zero
row appended, then the rows with keys selected) before cuDNN's kernel.

Under top-k sharing (GLM-5.2: `indexer_types`, Megatron-core's `dsa_indexer_topk_freq` 4 from offset 3) Megatron-core
leaves the fused path for every layer (dsa.py: `use_fused_kernels and not self.index_share`). A layer that runs its
indexer keeps its rows' causal bounds, so cuDNN's indexer is not called: PyTorch scores the whole [s, s] square a head
at a time in float32 (a product of 2·D_I a pair, which NVIDIA's containers run as TF32, then relu, the head's weight and
the sum, each a pass over the square) and masks it twice; cuDNN's top k follows, padded back to k slots where s is
shorter, compacted (twice with the loss on, as on the fused path) and sorted; FlashMLA's sparse forward runs once for
the loss's log-sum-exp alone, its output dropped, the loss as above, then FlashMLA's forward again for the attention
(`FusedQKTopKWithSparseLossFunc`, `FusedSparseAttentionFunc`). A layer that shares an earlier one's top k runs
FlashMLA's forward and the sparse backward alone, keeping its own copy of the indices; no pipeline stage may start at it
(workload/models.py `FOLLOWS_PREVIOUS`), since the top k is handed from layer to layer within a stage (dsa.py's holder;
workload/hf.py `TopKHandoff`).

The loss's kernels run only with gradients on: under full recomputation in the rerun, not in the first, checkpointed
forward (profiles/workload.py `GRAD_ONLY_KERNELS`, which the estimate prices so). Off the meta device a layer computes
transformers' model (its indexer untrained, as transformers runs it under no_grad; the attention masked to the kept
keys: workload/hf.py `counted_attention`)."""

from __future__ import annotations

import functools
import inspect
import math
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal, NamedTuple

import torch
from torch import nn

from .count import unfused_count
from .mamba import F32, _kernel
from .models import ModelError
from .moe import NORM_APART, OPEN_REGIONS, _kernel_writes, _one_kernel

I32 = torch.int32
# The indexer heads cuDNN's indexer backward takes at least (`_Shape.backward_heads`)
BACKWARD_INDEXER_HEADS = 64
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
    GLM-5's), or one that reuses an earlier layer's top k in its place (`shares_top_k`)."""
    indexer = getattr(module, "indexer", None)
    indexes = indexer is not None and all(hasattr(indexer, name) for name in INDEXER_FIELDS)
    return (indexes or shares_top_k(module)) and all(hasattr(module, name) for name in MLA_FIELDS)


def shares_top_k(module: nn.Module) -> bool:
    """Whether `module` is a sparse attention without an indexer of its own, attending to the keys the last layer
    that ran one kept (GLM-5.2's layers of `indexer_types` "shared": transformers' GlmMoeDsaAttention `skip_topk`,
    Megatron-core's skip layers, dsa.py `is_dsa_skip_topk_layer`)."""
    return getattr(module, "skip_topk", False) is True and getattr(module, "indexer", True) is None


def kept_keys(attention: nn.Module) -> int:
    """The keys a query of sparse attention `attention` attends to (`index_topk`: its indexer's, or its model's
    where it shares an earlier layer's)."""
    return attention.config.index_topk if shares_top_k(attention) else attention.indexer.index_topk


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
    a third value, the top k, None here: a layer that shares them counts its kernels without reading them)."""
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
    reuses = shares_top_k(attention)
    indexer = () if reuses else _indexer_inputs(attention, hidden.detach(), q_resid.detach(), position_embeddings)
    OPEN_REGIONS.append("mla_up_proj")  # Megatron-core's checkpoint of `qkv_up_proj_and_rope_apply`, products and all
    try:
        q_nope, q_rot = attention.q_b_proj(q_resid).view(b, s, heads, nope + rope).split([nope, rope], dim=-1)
        q_rot, k_rot = rotate(q_rot, k_rot.view(b, s, 1, rope), *position_embeddings, unsqueeze_dim=2)
        query = torch.cat([torch.einsum("bshd,hdc->bshc", q_nope, k_up), q_rot], dim=-1)
        key = torch.cat([kv_pass, k_rot.view(b, s, rope)], dim=-1)
    finally:
        OPEN_REGIONS.pop()
    path = "reusing" if reuses else "sharing" if "shared" in (getattr(attention.config, "indexer_types", None)
                                                             or ()) else "fused"
    index_heads, index_width = (0, 0) if reuses else (attention.indexer.n_heads, attention.indexer.head_dim)
    # the fused path takes min(k, s) keys a query; the sharing path pads its top k back to k (`_pad_topk_result`)
    kept = min(kept_keys(attention), s) if path == "fused" else kept_keys(attention)
    shape = _Shape(b, s, heads, latent, rope, index_heads, index_width, kept, path)
    out = _SparseAttention.apply(shape, query, key, *indexer)
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
    `rope`, an indexer of `index_heads` heads of `index_width` (none on a layer reusing another's top k), `kept` top-k
    slots a query (k; at most s on the fused path, whose top k takes min(k, s)); and which of Megatron-core's paths
    runs it (`path`): "fused", the cuDNN path of a model whose every layer indexes (`FusedIndexerSparseAttnFunc`);
    under top-k sharing "sharing", a layer that runs its indexer (`FusedQKTopKWithSparseLossFunc`, then
    `FusedSparseAttentionFunc`), or "reusing", one that reads the top k of the last that did
    (`FusedSparseAttentionFunc` alone)."""

    b: int
    s: int
    H: int
    latent: int
    rope: int
    index_heads: int
    index_width: int
    kept: int
    path: Literal["fused", "sharing", "reusing"] = "fused"

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
        k, s = min(self.kept, self.s), self.s
        return self.b * (k * (k + 1) // 2 + (s - k) * k)

    @property
    def backward_heads(self) -> int:
        """The indexer heads cuDNN's indexer backward runs: at least 64 (dsa_cudnn_kernels.py
        `_pad_indexer_heads_for_backward`, "cuDNN backward kernels that require at least 64 heads")."""
        return max(self.index_heads, BACKWARD_INDEXER_HEADS)

    def rows(self, *width: int) -> tuple[int, ...]:
        """A tensor of `width` a token (the indices, the kept scores: (b, s, k))."""
        return (self.b, self.s, *width)


# A stand-in for the top k a sharing layer reads where the layer that kept it holds them (one element, made before any
# count, so that no layer's count makes or moves it; its expanded views read as many bytes as the indices)
_HELD_INDICES = torch.empty((), dtype=I32, device="meta")


class _SparseAttention(torch.autograd.Function):
    """Megatron-core's DSA on the cuDNN backend with the sparse indexer loss (dsa_cudnn_kernels.py at d98e8a64), kernel
    by kernel on the path its `_Shape` names: see the module's docstring."""

    @staticmethod
    def forward(ctx: Any, shape: _Shape, query: torch.Tensor, key: torch.Tensor, *indexer: torch.Tensor
                ) -> torch.Tensor:
        s = shape
        if s.path == "reusing":  # the top k the last indexing layer kept, held there: no storage of this layer's
            indices, gradients = _HELD_INDICES.expand(s.rows(s.kept)), ()
        elif s.path == "fused":
            indices, kept = _fused_top_k(s, *indexer)
            out, lse = _sparse_forward(s, query, key, indices)
            gradients = _indexer_loss(s, query, key, lse, indices, kept, *indexer)
        else:  # FlashMLA's forward for the loss's log-sum-exp alone, its output dropped, then the attention's own
            indices, kept = _top_k_per_head(s, *indexer)
            _, lse = _sparse_forward(s, query, key, indices, "flash_mla_sparse_fwd_lse")
            gradients = _indexer_loss(s, query, key, lse, indices, kept, *indexer)
        if s.path != "fused":
            out, lse = _sparse_forward(s, query, key, indices)
        (saved_indices,) = _kernel("clamp_min", (indices,), [(s.rows(s.kept), I32)])  # a copy the backward keeps
        ctx.shape = shape
        ctx.save_for_backward(query, key, saved_indices, out, lse, *gradients)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        s = ctx.shape
        query, key, indices, out, lse, *gradients = ctx.saved_tensors
        rows = (query, out, grad, lse, indices)
        # a zero row appended to each, then the rows with keys taken (`_run_sparse_attention_backward`)
        for copy in ("cat", "index_select"):
            rows = _kernel(copy, rows, [(t.shape, t.dtype) for t in rows])
        dq, dkv = _kernel("sparse_attention_backward", (*rows[:2], key, *rows[2:]),
                          [(query.shape, query.dtype), (key.shape, key.dtype)],
                          flops=2 * s.H * (3 * s.key_width + 2 * s.latent) * s.kept_pairs)
        (dq,) = _kernel("index_copy", (dq,), [(query.shape, query.dtype)])
        scaled = [_kernel("mul", (g,), [(g.shape, g.dtype)])[0] for g in gradients]
        return None, dq, dkv, *scaled


def _fused_top_k(s: _Shape, index_q: torch.Tensor, index_k: torch.Tensor, weights: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """The fused path's top k (`FusedIndexerSparseAttnFunc`): cuDNN's indexer scores the causal pairs into an [s, s]
    float32 buffer, the top k of each row's causal prefix taken, the kept indices compacted and sorted; the indices
    and the kept scores."""
    (scores,) = _kernel("dsa_indexer_forward", (index_q, index_k, weights), [((s.b, s.s, s.s), F32)],
                        flops=2 * s.index_heads * s.index_width * s.causal_pairs)
    causal = scores.view(-1)[:s.causal_pairs]  # the top-k reads each row's causal prefix
    indices, kept = _kernel("dsa_indexer_top_k", (causal,), [(s.rows(s.kept), I32), (s.rows(s.kept), F32)])
    return _compacted(s, indices, kept)


def _top_k_per_head(s: _Shape, index_q: torch.Tensor, index_k: torch.Tensor, weights: torch.Tensor
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """The top k of an indexing layer under top-k sharing (`FusedQKTopKWithSparseLossFunc`), which keeps its rows'
    causal bounds, so scores every row by PyTorch rather than cuDNN's indexer (dsa_cudnn_kernels.py
    `_compute_indexer_scores_chunk_with_global_rows`): the key in float32, a float32 [s, s] buffer zeroed, then a
    head at a time its query in float32, a float32 product over the whole square (2·D_I a pair; TF32's under NGC's
    containers, `TF32_PRODUCT_KERNELS`), relu, its weight in float32 and the scores scaled and added in; the keys past
    each row masked in place and again out of place (`apply_starts_ends_mask_to_scores`); cuDNN's top k with its
    values, both concatenated, checked in bounds, compacted, compacted again and sorted (`_prepare_attention_topk_
    indices`). The indices and the kept scores."""
    square = (s.b, s.s, s.s)
    (key,) = _kernel("copy", (index_k,), [((s.b, s.index_width, s.s), F32)])
    with _one_kernel("zero_", ()):  # reads nothing, writes the buffer
        scores = key.new_empty(square)
        _kernel_writes(scores)
    for _ in range(s.index_heads):
        (query,) = _kernel("copy", (index_q[:, :, 0],), [(s.rows(s.index_width), F32)])  # a head's
        (head,) = _kernel("bmm_fp32", (query, key), [(square, F32)], flops=2 * s.index_width * s.b * s.s * s.s)
        _kernel("relu_", (head,), [], into=(head,))
        (weight,) = _kernel("copy", (weights[..., 0],), [(s.rows(), F32)])
        _kernel("mul_", (head, weight), [], into=(head,))
        _kernel("add_", (scores, head), [], into=(scores,))
        del head
    _kernel("masked_fill_", (scores,), [], into=(scores,))
    (masked,) = _kernel("masked_fill", (scores,), [(square, F32)])
    indices, kept = _kernel("dsa_indexer_top_k", (masked,), [(s.rows(s.kept), I32), (s.rows(s.kept), F32)])
    del scores, masked
    indices, kept = _kernel("cat", (indices, kept), [(s.rows(s.kept), I32), (s.rows(s.kept), F32)])
    indices, kept = _kernel("dsa_topk_in_bounds", (indices, kept), [(s.rows(s.kept), I32), (s.rows(s.kept), F32)])
    return _compacted(s, indices, kept)


def _compacted(s: _Shape, indices: torch.Tensor, kept: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The top k's kept indices and scores compacted, compacted again where the loss is on (FlashMLA's forward is
    handed no top-k length then: `_run_sparse_attention_forward`'s `_prepare_attention_topk_indices`, a grad-only
    pass), and the indices sorted."""
    indices, kept = _kernel("dsa_topk_compact", (indices, kept), [(s.rows(s.kept), I32), (s.rows(s.kept), F32)])
    (indices,) = _kernel("dsa_topk_prepare", (indices,), [(s.rows(s.kept), I32)])
    (indices,) = _kernel("dsa_topk_sort", (indices,), [(s.rows(s.kept), I32)])
    return indices, kept


def _sparse_forward(s: _Shape, query: torch.Tensor, key: torch.Tensor, indices: torch.Tensor,
                    name: str = "flash_mla_sparse_fwd") -> tuple[torch.Tensor, torch.Tensor]:
    """FlashMLA's sparse forward over the kept pairs (2·H·(576 + 512) FLOPs a pair): its output and log-sum-exp."""
    return tuple(_kernel(name, (query, key, indices), [(s.rows(s.H, s.latent), query.dtype), (s.rows(s.H), F32)],
                         flops=2 * s.H * (s.key_width + s.latent) * s.kept_pairs))


def _indexer_loss(s: _Shape, query: torch.Tensor, key: torch.Tensor, lse: torch.Tensor, indices: torch.Tensor,
                  kept: torch.Tensor, index_q: torch.Tensor, index_k: torch.Tensor, weights: torch.Tensor
                  ) -> list[torch.Tensor]:
    """The indexer's sparse loss and its gradients (`_compute_sparse_indexer_loss_and_grads`, which both paths call):
    the log-softmax of the kept scores, the attention's distribution over the kept keys recomputed from FlashMLA's
    log-sum-exp (2·H·576 a pair), normalised, the KL; the indexer's query and weights padded to 64 heads where it has
    fewer, and cuDNN's indexer backward over every one of the k slots of each query (it takes no top-k length) and
    the padded heads, 6·max(H_I, 64)·D_I·b·s·k, its gradients sliced back to the indexer's heads. The gradients of
    the indexer's query, key and weights, which the backward scales."""
    (predicted,) = _kernel("dsa_indexer_log_softmax", (kept,), [(s.rows(s.kept), F32)])
    (target,) = _kernel("sparse_attn_score_recompute", (query, key, lse, indices), [(s.rows(s.kept), F32)],
                        flops=2 * s.H * s.key_width * s.kept_pairs)
    (target,) = _kernel("dsa_indexer_target_normalize", (target,), [(s.rows(s.kept), F32)])
    _kernel("dsa_indexer_kl", (target, predicted), [(s.rows(), F32)])
    padded = s.backward_heads != s.index_heads
    read_q, read_w = index_q, weights
    if padded:
        read_q, read_w = _kernel("dsa_indexer_pad_heads", (index_q, weights),
                                 [(s.rows(s.backward_heads, s.index_width), index_q.dtype),
                                  (s.rows(s.backward_heads), weights.dtype)])
    gradients = _kernel("dsa_indexer_backward", (read_q, read_w, index_k, target, predicted, indices),
                        [(read_q.shape, read_q.dtype), (index_k.shape, index_k.dtype), (read_w.shape, read_w.dtype)],
                        flops=6 * s.backward_heads * s.index_width * s.b * s.s * s.kept)
    if padded:
        gradients[0], gradients[2] = _kernel("dsa_indexer_slice_heads", (gradients[0], gradients[2]),
                                             [(t.shape, t.dtype) for t in (index_q, weights)])
    return gradients
