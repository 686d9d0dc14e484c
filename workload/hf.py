"""A Hugging Face decoder model as a pipesim Model: transformers builds it from its config (on the meta device
when counted), and pipesim cuts it where a pipeline can: the token embedding, each decoder layer, the final norm
and the vocabulary head, which workload/count.py counts as it counts the built-in gpt's layers.

Each decoder layer is handed what the model's own forward hands it: the rotary position embeddings, computed in
the layer from the model's rotary module (as each pipeline stage computes them for its own layers), and no mask,
so that every model's attention, run as `counted_attention` (transformers' sdpa attention, whether or not the
model's class offers it), asks for a causal kernel (`is_causal`): on the meta device with the layer's sliding window
(Mistral's `sliding_window`, the "sliding_attention" layers of gpt-oss, Gemma 2 and 3 and Qwen2), which the fused
kernel's count carries (workload/count.py `attention_window`). Gemma 2's and 3's capping of their logits is counted
in the head's layer (`CappedHead`); anything else a model's forward does between its parts is not (Llama's,
Mistral's and Qwen's do nothing else; Gemma scales its embedding in its embedding module). A tied head is counted as
its own copy of the embedding's weights, as Megatron-LM keeps one on the last stage.

With `mtp_layers` D (`--mtp-layers`), DeepSeek-V3's multi-token prediction (its report, arXiv 2412.19437, 2.2: D
sequential modules, each a projection of [RMSNorm(h); RMSNorm(Emb(t_{i+k}))] from 2h to h, one more transformer
block, and the shared output head predicting token i+k+1; section 4.2: D = 1; Megatron-core's --mtp-num-layers)
is one more layer after the final norm, `MultiTokenPrediction`, which the head then reads.

With `capacity_factor` C (`--capacity-factor`) a mixture of experts drops each expert's tokens past its capacity
and pads it to it, as Megatron-core's `moe_expert_capacity_factor` with `moe_pad_expert_input_to_capacity` runs it
(Megatron-Bridge's `apply_moe_token_drop`: C = 1, padded; NVIDIA's 25.09 "(tokendrop)" runs). At Megatron-core
0.14.0 (megatron/core/transformer/moe/moe_utils.py `get_capacity`, `apply_router_token_dropping`) each expert takes
⌈C·k·T/E⌉ of a rank's T tokens, the top ones by router probability, padded with zero-weighted tokens where fewer
were routed to it; the all-to-all dispatcher (token_dispatcher.py, `preprocess` under `drop_and_pad`) then sends
each rank's E·capacity tokens in equal splits, each local expert computes capacity × its tp·ep sources, and the
combine returns as many, with the sizes known on the host (no device-to-host synchronisation: planning/host.py).
So every expert of the count computes its capacity (`workload.moe.expected_tokens`) and the dispatch records the
padded buffers, as the built-in gpt's `capacity_factor` does.

transformers is an optional extra (`pipesim[hf]`), imported only here."""

from __future__ import annotations

import copy
import functools
import inspect
import json
import math
import sys
import textwrap
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ..units import count_text
from . import data
from .count import attention_window, fused_attention, is_norm
from .dsa import INDEXERS, counted_sparse_attentions, is_sparse_attention, kept_keys, shares_top_k
from .gdn import counted_delta_nets, is_gated_delta_net
from .hfconfig import (
    EXPERT_FIELDS,
    FIGURES,
    LONGEST_FIELD,
    MOE_PLACEMENT_FIELDS,
    SIZES,
    TOP_K_FIELD,
    HfConfig,
    HfConfigError,
    read_hf_config,
    seq_len_refusal,
    size_field_refusal,
)
from .mamba import counted_mixers, is_mamba2_mixer
from .models import (
    BATCH,
    FOLLOWS_PREVIOUS,
    MIXERS_ATTRIBUTE,
    Model,
    ModelError,
    check_capacity_factor,
    check_positive,
    check_size,
    classification_loss,
)
from .moe import BLOCK_NORM, CHECKPOINT_REGION, gated_mlp, gating_linear, gating_router, routed_experts

WELL_KNOWN = ("llama", "mistral", "qwen2", "qwen3", "gemma2", "phi3", "olmo2")  # named where a model_type is unknown
ACTIVATION_FIELDS = ("hidden_act", "hidden_activation")  # the MLP's activation, by its name in ACT2FN (Gemma's 2nd)
# transformers runs a mixture's experts (`_routed_experts`) as grouped products, which torch's FLOP counter counts
# as nothing, so pipesim runs them as its own (`balanced_experts`).
EXPERT_FFN_FIELD = "moe_intermediate_size"  # an expert's MLP width where it is not intermediate_size's (Mixtral's)
DENSE_FFN_FIELD = "intermediate_size_mlp"  # Llama 4's dense layers' MLP width, its intermediate_size its experts'
# DeepSeek-V3's group-limited routing: the router picks topk_group of n_group expert groups a token, then its k
# experts among them (transformers' DeepseekV3 router; the report's node-limited routing, a group a node)
GROUP_FIELDS = ("n_group", "topk_group")
# transformers' names of an MLP's output product and of those that read its input beside it (`_as_megatron_runs`):
# Llama's, Phi-3's and Nemotron-H's; GraniteMoeHybrid's shared_mlp
MLP_PRODUCTS = (("down_proj", ("up_proj", "gate_proj", "gate_up_proj")), ("output_linear", ("input_linear",)))
# A mixture of experts' shared expert, its MLP beside the routed experts (Qwen-MoE's and Qwen3-Next's shared_expert,
# Llama 4's; DeepSeek's, Nemotron-H's shared_experts): Megatron-core's "shared_experts" recompute module
SHARED_EXPERTS = ("shared_expert", "shared_experts")
EXPERTS_IMPLEMENTATION = "pipesim_balanced"  # the name `balanced_experts` is registered by with transformers
ATTENTION_IMPLEMENTATION = "pipesim_attention"  # and `counted_attention`
# what a layer may hand its attention that `counted_attention` refuses: a bias added to every score (Inkling 2's
# position_bias) and, on the meta device, the keys a sparse attention picks for each query (HY-V4's indices, as
# flash_mla takes them; DeepSeek-V3.2's and GLM-5's layers are counted by workload/dsa.py, and hand them off it)
UNCOUNTED_ATTENTION = {"position_bias": "a position bias added to its scores"}
SPARSE_KEYS = "indices"
# the capacity factor `balanced_experts` pads an experts module to, set on it by `_drop_past_capacity` (absent: it
# drops nothing)
CAPACITY_ATTRIBUTE = "pipesim_capacity_factor"
# transformers' mixtures that run every token through every expert, by class, with their experts module's class:
# Llama 4's Llama4TextMoe repeats the tokens for each expert and scales those not routed to it by 0 (each expert's
# bmm over all of them), where Megatron-core computes each token's top-k only; pipesim runs them so
# (`_input_scaled_mixture`)
EVERY_TOKEN_MIXTURES = {"Llama4TextMoe": "Llama4TextExperts"}


def balanced_experts(experts: nn.Module, hidden: torch.Tensor, top_k_index: torch.Tensor,
                     top_k_weights: torch.Tensor) -> torch.Tensor:
    """A transformers experts module (`@use_experts_implementation`: every expert's gate/up and down products as
    3-D weights, with their biases where it has them) run by `workload.moe.routed_experts`: on the meta device
    each expert at its expected share of the tokens (its capacity where the model drops, `CAPACITY_ATTRIBUTE`),
    counted as one matrix product per expert; a clamped quick-GEGLU (gpt-oss's, `_quick_geglu_limit`) as
    Megatron-core runs it (`routed_experts`' `clamp`)."""
    up = experts.gate_up_proj if experts.has_gate else experts.up_proj
    down = experts.down_proj
    if not experts.is_transposed:  # stored (E, out, in), as nn.Linear's weights
        up, down = up.transpose(1, 2), down.transpose(1, 2)
    activation = experts._apply_gate if experts.has_gate else experts.act_fn
    biases = None
    if experts.has_bias:  # transformers' names for them (integrations/moe.py `grouped_mm_experts_forward`)
        biases = (experts.gate_up_proj_bias if experts.has_gate else experts.up_proj_bias, experts.down_proj_bias)
    return routed_experts(hidden, top_k_index, top_k_weights, up, down, activation,
                          getattr(experts, CAPACITY_ATTRIBUTE, None), gated=experts.has_gate, biases=biases,
                          clamp=_quick_geglu_limit(experts))


def _sigmoid_top_k(router: nn.Linear, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Llama 4's router (transformers' Llama4Router: its product's top-k logits through a sigmoid, the scores of
    the others none) as transformers 5's routers answer: the logits, the top-k's weights and their experts."""
    logits = F.linear(hidden, router.weight)
    top, experts = torch.topk(logits, router.top_k, dim=-1)
    return logits, torch.sigmoid(top.float()).to(logits.dtype), experts


def _input_scaled_mixture(moe: nn.Module, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Llama 4's mixture of experts (an `EVERY_TOKEN_MIXTURES` module) as Megatron-core runs it: each token through
    its top-k experts, their router's weight scaling its input (`moe_apply_probs_on_input`), beside the shared
    expert, whose output the routed experts' is added to; (the output, the router's logits), as transformers'
    forward returns them."""
    tokens = hidden.reshape(-1, moe.hidden_dim)
    logits, weights, chosen = moe.router(tokens)
    experts = moe.experts

    def swiglu(inner: torch.Tensor) -> torch.Tensor:  # Llama4TextExperts': gate and up halves, gate first
        gate, up = inner.chunk(2, dim=-1)
        return experts.act_fn(gate) * up

    routed = routed_experts(tokens, chosen, weights, experts.gate_up_proj, experts.down_proj, swiglu,
                            getattr(experts, CAPACITY_ATTRIBUTE, None), gated=True, probs_on_input=True)
    return moe.shared_expert(tokens) + routed, logits


def _is_experts(module: nn.Module) -> bool:
    """Whether `module` holds a mixture's routed experts as pipesim runs them: transformers' experts interface
    (what @use_experts_implementation sets) or an `EVERY_TOKEN_MIXTURES` experts module."""
    return hasattr(module, "is_concatenated") or type(module).__name__ in EVERY_TOKEN_MIXTURES.values()


def _quick_geglu_limit(experts: nn.Module) -> float | None:
    """The limit a gated experts module's quick-GEGLU clamps its halves at (gpt-oss's: its gate's sigmoid scaled by
    `alpha`, `swiglu_alpha` 1.702, the sigmoid approximation of GELU, clamped at `limit`, `swiglu_limit`), which
    Megatron-Bridge runs as Megatron-core's quick-GEGLU with `activation_func_clamp_value`; None for any other
    activation (a SwiGLU's silu, clamped or not) or an unbounded limit."""
    limit = getattr(experts, "limit", None)
    if not (experts.has_gate and hasattr(experts, "alpha")) or limit is None or not math.isfinite(limit):
        return None
    return float(limit)


def counted_attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      attention_mask: torch.Tensor | None, s_aux: torch.Tensor | None = None,
                      softcap: float | None = None, **kwargs: Any) -> tuple[torch.Tensor, Any]:
    """Every model's attention (an attention interface: the layer's own code calls it), handed no mask: transformers'
    sdpa attention, so a causal kernel, its kernel recorded on the meta device with the layer's sliding window
    (`sliding_window`, as Mistral, Qwen2, Gemma 2 and 3, Cohere 2 and OLMo 3 pass it, else the attention's own
    `sliding_window`, as Qwen2-MoE's holds it; None: every earlier key). gpt-oss's attention sinks (`s_aux`, one
    learned logit per head in every query's softmax) are computed inside the fused kernel, as TransformerEngine runs
    them (softmax_type "learnable": Megatron-Bridge's gpt_oss_bridge.py maps the sinks to
    core_attention.softmax_offset, at NVIDIA-NeMo/Megatron-Bridge 067f987df), their work the kernel's. Gemma 2's
    soft-capped scores (`softcap`: cap·tanh(score/cap)) are too in a fused count: FlashAttention-2 (from 2.6,
    `softcap`) and -3 cap them in the kernel; in an unfused one ("math") they are the model's own eager attention,
    the scores' products, the capping's ops and the softmax, as Megatron-Bridge's Gemma2DotProductAttention runs
    them, handed the causal mask (its add over the scores, as torch's unfused sdpa adds it). The fused kernel is
    marked as capping (`OpCount.softcap`): cuDNN's does not cap a causal kernel (planning/estimate.py refuses it).

    Off the meta device (run trains it, calibrate times it, torch.compile traces it, which traces no recording
    context) the layer's attention computes what transformers' model computes: sdpa's causal kernel, handed the
    window's mask where the window is shorter than the keys (as transformers' sdpa attention is handed
    masking_utils.py's sliding-window mask: torch's sdpa takes no window); with sinks or capped scores, which sdpa
    does not compute, the model's own eager attention (gpt-oss's `eager_attention_forward` adds the sinks) handed
    the causal mask, windowed. Either times a kernel other than the count's: a masked kernel that visits every
    query-key pair, or the eager products and softmax over the whole materialised square, where the count prices
    the fused causal kernel over the window's band (with the sinks and the capping inside it)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    chunk = _attention_chunk(module)
    if chunk is not None and chunk < query.shape[-2]:
        tokens = query.shape[-2]
        out, weights = counted_attention(module, *(_chunked(t, chunk) for t in (query, key, value)), attention_mask,
                                         s_aux, softcap, **kwargs)
        return out.reshape(query.shape[0], -1, *out.shape[2:])[:, :tokens], weights
    unknown = next((what for name, what in UNCOUNTED_ATTENTION.items() if kwargs.get(name) is not None), None)
    if unknown:
        raise ModelError(f"--model: {type(module).__name__} hands its attention {unknown}, which the fused attention "
                         "kernels pipesim counts do not compute")
    window = kwargs.pop("sliding_window", getattr(module, "sliding_window", None))
    if window is not None and window < 1:  # a config whose window is switched off yet read (hfconfig's SWITCHED_BY)
        raise ModelError(f"--model: {type(module).__name__} attends within a sliding window of {window} keys: give the "
                         "config's sliding_window a whole number from 1, or switch it off for every layer")
    kept = kwargs.pop(SPARSE_KEYS, None)
    computed = query.device.type != "meta"
    if kept is not None:
        if not computed:
            raise ModelError(f"--model: {type(module).__name__} hands its attention the keys its sparse attention "
                             "picks for each query, which the fused attention kernels pipesim counts do not compute")
        return sdpa_attention_forward(module, query, key, value, _causal_mask(query, key, window) + _kept(kept, key),
                                      **kwargs)
    if (computed and (s_aux is not None or softcap is not None)) or (softcap is not None and not fused_attention()):
        eager = sys.modules[type(module).__module__].eager_attention_forward  # counted: the whole square, no window
        return eager(module, query, key, value, _causal_mask(query, key, window if computed else None),
                     softcap=softcap, **kwargs)
    if computed:
        windowed = window is not None and window < key.shape[-2]
        return sdpa_attention_forward(module, query, key, value, _causal_mask(query, key, window) if windowed else None,
                                      **kwargs)
    with attention_window(window, softcap is not None):
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)


def _attention_chunk(module: nn.Module) -> int | None:
    """The chunks an attention module's queries attend within, each to the keys of its own up to itself (Llama 4's
    layers of type "chunked_attention": transformers' chunked mask, `attention_chunk_size`), None for the others."""
    config, index = getattr(module, "config", None), getattr(module, "layer_idx", None)
    types = getattr(config, "layer_types", None)
    if index is None or not types or types[index] != "chunked_attention":
        return None
    return config.attention_chunk_size


def _chunked(states: torch.Tensor, chunk: int) -> torch.Tensor:
    """Queries, keys or values (batch, heads, tokens, features) as chunks of `chunk` tokens, each chunk a batch
    entry of its own: a view of transformers' (batch, tokens, heads, features) layout, its last chunk padded with
    zeros to `chunk` tokens (the padded keys lie after every query, so the causal mask hides them; the padded queries'
    outputs are dropped). Megatron-core's Llama 4 (NeMo's Llama4SelfAttention `chunkify`) copies them so, its
    layout sequence-first; those copies are not counted."""
    _, heads, tokens, features = states.shape
    laid = states.transpose(1, 2)
    if tokens % chunk:
        laid = F.pad(laid, (0, 0, 0, 0, 0, chunk - tokens % chunk))
    return laid.reshape(-1, chunk, heads, features).transpose(1, 2)


def _causal_mask(query: torch.Tensor, key: torch.Tensor, window: int | None) -> torch.Tensor:
    """The additive mask (-inf where a query may not look) that attends each query to the keys up to its own, and
    of those to its last `window` (None: to all), as transformers' masking_utils.py masks a sliding window
    (`kv_idx > q_idx - sliding_window`); eager attention adds only the mask it is given."""
    blocked = torch.full((1, 1, query.shape[-2], key.shape[-2]), float("-inf"), dtype=query.dtype,
                         device=query.device)
    return blocked.triu(1) if window is None else blocked.triu(1) + blocked.tril(-window)


def _kept(indices: torch.Tensor, key: torch.Tensor) -> torch.Tensor:
    """The additive mask (-inf at the keys a query's sparse attention does not keep) of each query's `indices`, as
    transformers masks DeepSeek-V3.2's eager and sdpa attention to its indexer's top k."""
    batch, tokens = indices.shape[:2]
    blocked = torch.full((batch, tokens, key.shape[-2]), float("-inf"), dtype=key.dtype, device=key.device)
    return blocked.scatter(-1, indices.long(), 0.0).unsqueeze(1)


@dataclass
class TopKHandoff:
    """The top k the last sparse attention layer run returned, which transformers hands the next layer
    (`prev_topk_indices`: GLM-5.2's layers of `indexer_types` "shared" attend to the keys the last layer that ran
    its indexer kept), held between the decoder layers of one model as its forward passes from layer to layer; a
    stage starts only at a layer that runs its indexer (`FOLLOWS_PREVIOUS`), which sets them before the layers
    after it read them, so one stage's forward never reads another micro-batch's."""

    indices: torch.Tensor | None = None


class DecoderLayer(nn.Module):
    """One decoder layer of a transformers model, given its position embeddings by `rotary` (None: the layer
    has none, or makes its own), for its `layer_type` where the rotary module computes one per type (Gemma 3's
    local and global layers rotate at their own bases), and causal attention; with a `handoff`, handed the top k
    the layer before it kept and handing on its own (`TopKHandoff`)."""

    decoder_block = True  # what the count records (`LayerCount.decoder_block`)

    def __init__(self, layer: nn.Module, rotary: nn.Module | None, layer_type: str | None = None,
                 handoff: TopKHandoff | None = None) -> None:
        super().__init__()
        self.layer, self.rotary, self.handoff = layer, rotary, handoff
        typed = rotary is not None and "layer_type" in inspect.signature(type(rotary).forward).parameters
        self.rotary_options = {"layer_type": layer_type} if typed else {}
        if handoff is not None and any(shares_top_k(module) for module in layer.modules()):
            setattr(self, FOLLOWS_PREVIOUS, True)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(hidden.shape[1], device=hidden.device).unsqueeze(0)
        given: dict[str, Any] = {"position_ids": positions}
        if self.rotary is not None:
            given["position_embeddings"] = self.rotary(hidden, positions, **self.rotary_options)
        if self.handoff is not None:
            given["prev_topk_indices"] = self.handoff.indices
        out = self.layer(hidden, attention_mask=None, **given)
        if self.handoff is not None:
            self.handoff.indices = out[1]
        return out[0] if isinstance(out, tuple) else out


def hf_model(spec: str, seq_len: int | None, mtp_layers: int = 0, capacity_factor: float | None = None) -> Model:
    """The model config `spec` (`hf:PATH`) describes, built by transformers in the current default device (meta
    to count it), cut into its embedding, decoder layers, final norm, `mtp_layers` multi-token-prediction modules
    (one `MultiTokenPrediction` layer; none by default) and head, its experts dropping past `capacity_factor`
    and padded to it (None: dropless); trained, as the gpt is, on the token task of `workload.data` at `seq_len`
    tokens a sample."""
    try:
        config = read_hf_config(spec)
    except HfConfigError as exc:
        raise ModelError(str(exc)) from None
    import transformers
    from transformers import AutoModelForCausalLM
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING, MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    transformers.logging.set_verbosity_error()  # its notes on a config's unused fields are not ours to print
    where = f"--model {spec}"
    if config.model_type not in CONFIG_MAPPING:
        known = [name for name in WELL_KNOWN if name in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES]
        raise ModelError(f"{where}: transformers {transformers.__version__} does not know model_type "
                         f"{config.model_type!r}; it builds {len(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)} types of causal "
                         f"language model, {', '.join(known)} among them")
    figures = _figures(CONFIG_MAPPING[config.model_type])
    settings = _settings(config, CONFIG_MAPPING[config.model_type], figures)
    options = {name: _figure(settings, field, where) for name, field in figures.items()}
    _check_dense_attention(settings, where)
    _check_aliased_sizes(config, settings)
    options["kv_heads"] = _kv_heads(config, settings) or options["heads"]
    _check_head_size(config, settings, options["width"], options["heads"])
    routed = _routed_experts(config, settings)
    experts = routed[1] if routed else None
    if experts:
        top_k = _read(config, settings, TOP_K_FIELD)
        options.update(experts=experts, top_k=top_k[1] if top_k else None,
                       expert_ffn=getattr(settings, EXPERT_FFN_FIELD, None) or options["ffn"])
        if top_k and top_k[1] is not None and top_k[1] > experts:  # the router's top-k: torch's "k not in range"
            raise ModelError(f"{where}: {config.where} sends a token to {top_k[0]} {top_k[1]} experts, more than its "
                             f"{experts} routed experts ({routed[0]}); give 1 to {experts}")
        groups, per_token = (getattr(settings, name, None) for name in GROUP_FIELDS)
        if groups and per_token and per_token < groups:
            options.update(expert_groups=groups, groups_per_token=per_token)
    options["ffn"] = getattr(settings, DENSE_FFN_FIELD, None) or options["ffn"]
    chunk = getattr(settings, "attention_chunk_size", None)
    if chunk and seq_len and seq_len > chunk and "chunked_attention" in (getattr(settings, "layer_types", None) or ()):
        options["attention_chunk"] = chunk  # its layers of type "chunked_attention" attend within chunks of it
    if capacity_factor is not None:
        if not experts:
            raise ModelError(f"--capacity-factor applies to a mixture of experts: {spec}'s config gives no routed "
                             f"experts (none of {', '.join(EXPERT_FIELDS)} above 0)")
        check_capacity_factor(capacity_factor, experts, options["top_k"])
        options["capacity_factor"] = capacity_factor
    longest = _read(config, settings, LONGEST_FIELD)
    bound = (longest[1], f"its {longest[0]}" if longest[0] in config.fields else
             f"transformers' {type(settings).__name__} default for a config without {LONGEST_FIELD}"
             ) if longest and longest[1] else (None, "")
    if seq_len is not None:
        check_positive(seq_len=seq_len)
    if refusal := seq_len_refusal(spec, seq_len, *bound):
        raise ModelError(refusal)
    check_size("mtp_layers", mtp_layers, least=0)
    built = MODEL_FOR_CAUSAL_LM_MAPPING.get(type(settings), None)
    if built is None:
        raise ModelError(f"{where}: model_type {config.model_type!r} is not a causal language model transformers "
                         f"builds (as {', '.join(WELL_KNOWN)} are)")
    # every model's attention run by `counted_attention`, whatever transformers' class says it supports
    from transformers import AttentionInterface

    AttentionInterface.register(ATTENTION_IMPLEMENTATION, counted_attention)
    try:
        model = AutoModelForCausalLM.from_config(settings, attn_implementation=ATTENTION_IMPLEMENTATION,
                                                 **_experts_implementation(experts))
    except Exception as exc:  # transformers' own code on the config's values: whatever it raised, in one line
        raise _activation_refusal(config, exc) or ModelError(
            f"{where}: transformers cannot build it: {_in_one_line(exc)}") from None
    if experts:
        _check_experts(model, where, config, routed)
    else:
        _check_no_experts(model, where, config, routed)
    _check_no_linear_attention(model, where)
    if (kept := _check_sparse_attention(model, where)) is not None:  # what tensor and context parallelism refuse
        options["sparse_attention_keys"] = kept
    layers = decoder_layers(model, where)
    mixer = next((module for module in model.modules() if is_mamba2_mixer(module)), None)
    if mixer is not None:  # what tensor parallelism splits (Megatron-core asserts t divides both)
        options.update(mamba_heads=mixer.num_heads, mamba_groups=mixer.n_groups)
    delta_net = next((module for module in model.modules() if is_gated_delta_net(module)), None)
    if delta_net is not None:  # what tensor parallelism splits (Megatron-core's in_proj is column-parallel by head)
        options.update(linear_key_heads=delta_net.num_k_heads, linear_value_heads=delta_net.num_v_heads)
    inputs: list[tuple[int, ...]] = []
    if mtp_layers:
        head = layers.pop()
        layers += [MultiTokenPrediction(model, mtp_layers), head]
        last = len(layers) - 1
        inputs = [(i - 1,) for i in range(last - 1)] + [(last - 2, BATCH), (last - 1,)]
        options["mtp_layers"] = mtp_layers
    if capacity_factor is not None:
        _drop_past_capacity(layers, capacity_factor)
    options["seq_len"] = seq_len
    vocab = options["vocab"]

    def make(b: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        return data.token_batch(b, seq_len, vocab, gen)
    return Model(spec, layers, make, classification_loss, inputs=inputs, options=options,
                 heldout=functools.partial(data.token_heldout, seq_len, vocab), classifier=True)


class _WithLoss(torch.autograd.Function):
    """`hidden` passed on with `loss` attached: the backward hands `hidden`'s gradient back and starts the loss's
    own backward from a gradient of one (Megatron-core's MTPLossAutoScaler, multi_token_prediction.py, by which
    the main model's path carries the multi-token-prediction loss)."""

    @staticmethod
    def forward(ctx: Any, hidden: torch.Tensor, loss: torch.Tensor) -> torch.Tensor:
        return hidden.view_as(hidden)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return grad, grad.new_ones(())


class MultiTokenPrediction(nn.Module):
    """DeepSeek-V3's multi-token prediction modules (its report, 2.2, equations 21 to 25), read after the main
    model's final norm with the batch's tokens: module k normalises the hidden state it is given (the main model's,
    then module k-1's) and the embedding of token i+k, projects the two joined (2h -> h), runs one more decoder
    layer of the kind of the model's last (as Megatron-core's get_gpt_mtp_block_spec builds it, from the decoder's
    last layer's spec: DeepSeek-V3's a mixture of experts, Qwen3-Next's a full attention beside one), its own final
    norm and the main model's head, and adds the cross entropy against token i+k+1 to the loss. The embedding and
    the head are the main model's (`shared_weights`: the report's 3.2.3 shares their parameters and gradients, with
    DualPipe's placement, on the rank that holds both), read and given gradients here but counted with their own
    layers; the head's product stays in its precision, as a router's does (the report's 3.3.1 keeps "the output
    head" in BF16). The layer passes the main hidden state on, with the loss attached (`_WithLoss`)."""

    def __init__(self, model: nn.Module, depth: int) -> None:
        super().__init__()
        base = _base_model(model)
        config, norm = model.config, base.norm
        self.modules_at = nn.ModuleList()
        last = config.num_hidden_layers - 1
        kind = (getattr(config, "layer_types", None) or [None] * config.num_hidden_layers)[last]
        for _ in range(depth):
            block = type(base.layers[-1])(_indexing(config, last), last)
            _as_megatron_block(block)
            self.modules_at.append(nn.ModuleDict({
                "hnorm": copy.deepcopy(norm), "enorm": copy.deepcopy(norm),
                "eh_proj": nn.Linear(2 * config.hidden_size, config.hidden_size, bias=False),
                "block": DecoderLayer(block, getattr(base, "rotary_emb", None), kind), "norm": copy.deepcopy(norm)}))
        self.shared_weights = (base.embed_tokens.weight, model.get_output_embeddings().weight)
        self.criterion = classification_loss  # the model's loss (workload/count.py gives it the one it counts with)

    def forward(self, hidden: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        embedding, head = self.shared_weights
        state, loss = hidden, hidden.new_zeros((), dtype=torch.float32)
        for k, at in enumerate(self.modules_at, start=1):
            ahead = F.embedding(tokens.roll(-k, dims=1), embedding)
            state = at["block"](at["eh_proj"](torch.cat([at["hnorm"](state), at["enorm"](ahead)], dim=-1)))
            logits = gating_linear(at["norm"](state), head, state.dtype)
            loss = loss + self.criterion(logits, tokens.roll(-k - 1, dims=1))
        return _WithLoss.apply(hidden, loss)


def _indexing(config: Any, index: int) -> Any:
    """`config` with its layer `index` running its own indexer: Megatron-core numbers a multi-token-prediction
    module's layer 1 (multi_token_prediction.py `MultiTokenPredictionLayer`, d98e8a64), and under top-k sharing its
    first layers up to the offset each compute their own (dsa.py `is_dsa_skip_topk_layer`), so the module's
    sparse attention runs its indexer where the main model's last layer (GLM-5.2's) reuses an earlier one's."""
    types = getattr(config, "indexer_types", None)
    if not types or types[index] != "shared":
        return config
    indexing = copy.copy(config)
    indexing.indexer_types = [*types[:index], "full", *types[index + 1:]]
    return indexing


def _experts_implementation(experts: int | None) -> dict[str, str]:
    """transformers' keyword that runs a mixture of experts' experts as `balanced_experts` (none for a dense
    model), registered with transformers on first use."""
    if not experts:
        return {}
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    ALL_EXPERTS_FUNCTIONS.register(EXPERTS_IMPLEMENTATION, balanced_experts)
    return {"experts_implementation": EXPERTS_IMPLEMENTATION}


def _drop_past_capacity(layers: list[nn.Module], capacity_factor: float) -> None:
    """Pad every experts module of `layers` (the multi-token-prediction modules' too) to its capacity at
    `capacity_factor`, dropping past it (`balanced_experts` reads `CAPACITY_ATTRIBUTE`)."""
    for layer in layers:
        for module in layer.modules():
            if _is_experts(module):
                setattr(module, CAPACITY_ATTRIBUTE, capacity_factor)


def _check_experts(model: nn.Module, where: str, config: HfConfig, routed: tuple[str, int]) -> None:
    """Refuse a mixture of experts (`routed`: the field giving its routed experts and their count, its class's default
    where the config gives none) whose experts `balanced_experts` cannot run as they are: in no layer, its config
    placing them in none (`MOE_PLACEMENT_FIELDS`, each given shown up to 40 characters: DeepSeek-V3's
    first_k_dense_replace past its layers); not held as 3-D weights (transformers' experts interface, or an
    `EVERY_TOKEN_MIXTURES` module's), or with a norm after each expert. Biases are run (gpt-oss's), and gate and up
    weights interleaved (gpt-oss's) by the module's own `_apply_gate`, which splits them."""
    (field, experts), held = routed, [m for m in model.modules() if _is_experts(m)]
    if not held and not any(hasattr(m, "experts") for m in model.modules()):
        placing = [f"{name} {textwrap.shorten(json.dumps(config.fields[name]), 40, placeholder=' ...')}"
                   for name in MOE_PLACEMENT_FIELDS if name in config.fields]
        given = field if field in config.fields else f"{field}, its class's default"
        raise ModelError(f"{where}: its {experts:,} routed experts ({given}) are placed in none of its layers"
                         f"{' (' + ', '.join(placing) + ')' if placing else ''}, so transformers builds a dense model: "
                         "place them in a layer, or give no routed experts")
    if not held:
        raise ModelError(f"{where}: its {experts} experts are not held as transformers' experts modules (3-D weights "
                         "run by an experts implementation), which pipesim counts at their expected share")
    odd = next((m for m in held if getattr(m, "has_post_expert_norm", False)), None)
    if odd is not None:
        raise ModelError(f"{where}: its experts ({type(odd).__name__}) have a norm after each expert; pipesim counts "
                         "experts of gate/up and down products (with their biases) only")


def _check_no_experts(model: nn.Module, where: str, config: HfConfig, routed: tuple[str, int] | None) -> None:
    """Refuse routed experts of 0 (`routed`, `_routed_experts`) where transformers builds a mixture of no experts
    (Mixtral's, DeepSeek's: their router's top-k of none failed deep in the count, torch's "k not in range"), seen
    as a weight of no elements, which a dense layer (Qwen-MoE's, GraniteMoeHybrid's at 0) never holds."""
    empty = next((name for name, weight in model.named_parameters() if not weight.numel()), None)
    if routed is not None and routed[1] == 0 and empty is not None:
        raise ModelError(f"{where}: {config.where} gives {routed[0]} 0, which transformers' {type(model).__name__} "
                         f"builds as a mixture of no experts ({empty} holds none); give 1 or more")


def _routed_experts(config: HfConfig, settings: Any) -> tuple[str, int] | None:
    """The field of `config` that gives the routed experts transformers builds its model with, and their count
    (`_read`): the first of `EXPERT_FIELDS` its config class declares or maps, each of which names one value in
    every class of transformers 5.24.0 (Mixtral's num_experts is its num_local_experts, Qwen3-MoE's num_experts
    stored as num_local_experts); None where it has none (a dense model's)."""
    return next(filter(None, (_read(config, settings, name) for name in EXPERT_FIELDS)), None)


def _read(config: HfConfig, settings: Any, field: str) -> tuple[str, Any] | None:
    """`field` as transformers' config `settings` reads it: the name `config` gives it by and its value. The name
    is `field` or another that the class's attribute_map stores as the same value (Step-3.5's num_attention_groups
    is its num_key_value_heads), `field` where the config gives none (the class's default). Of two a config gives
    for one value, transformers keeps the one its class does not declare: it sets those after the declared
    (configuration_utils.py `PreTrainedConfig.__post_init__`), so the name is the one whose value `settings`
    holds. None where the class neither declares nor maps `field`: transformers keeps a config's such field, but
    its model reads none (Qwen2-MoE's num_local_experts: modeling_qwen2_moe.py reads num_experts)."""
    config_class = type(settings)
    aliases = getattr(config_class, "attribute_map", {})
    stored = aliases.get(field, field)
    if stored == field and field not in aliases.values() and not hasattr(config_class, field):
        return None
    value = getattr(settings, stored)
    names = (field, stored, *(alias for alias, name in aliases.items() if name == stored))
    return next((name for name in names if name in config.fields and config.fields[name] == value), field), value


def _check_aliased_sizes(config: HfConfig, settings: Any) -> None:
    """Refuse a size `config` gives under an alias transformers reads (`_read`) past its bounds
    (`size_field_refusal`): read_hf_config reads the fields by their own names only."""
    for field in SIZES:
        read = _read(config, settings, field)
        refusal = (size_field_refusal(config.spec, config.where, read[0], field, read[1])
                   if read and read[0] != field and read[1] is not None else None)
        if refusal is not None:
            raise ModelError(refusal)


def _check_head_size(config: HfConfig, settings: Any, width: int, heads: int) -> None:
    """Refuse a width its attention heads do not divide where the head size is the width's share (no head_dim in
    the config, nor one of its class's own): transformers' attention then reshapes the width into heads of
    width // heads and torch failed deep in the count ("Attempting to broadcast a dimension ..."). Some config
    classes refuse it themselves (Llama's `validate_architecture`); Mixtral's, among others, do not."""
    if width % heads and "head_dim" not in config.fields and getattr(settings, "head_dim", None) in (None,
                                                                                                   width // heads):
        raise ModelError(f"--model {config.spec}: {config.where}'s hidden_size {width:,} is not a whole number of its "
                         f"{heads:,} attention heads (transformers takes a head as hidden_size / num_attention_heads "
                         f"where head_dim is not given): give a multiple of {heads:,}, or a head_dim")


def _kv_heads(config: HfConfig, settings: Any) -> int | None:
    """The key/value heads transformers reads from `config` (`_read`), however given; None where the class has
    none, or leaves them to the attention heads'. Refused where they do not divide the attention heads
    (transformers' attention repeats each for as many query heads; torch failed deep in the count)."""
    kv_heads, heads = (_read(config, settings, field) for field in ("num_key_value_heads", "num_attention_heads"))
    if kv_heads and kv_heads[1] and heads and heads[1] % kv_heads[1]:
        gives = (f"gives {kv_heads[0]} {kv_heads[1]}" if kv_heads[0] in config.fields else
                 f"leaves {kv_heads[0]} at {type(settings).__name__}'s {kv_heads[1]}")
        raise ModelError(f"--model {config.spec}: {config.where} {gives}, which does not divide its {heads[0]} "
                         f"{heads[1]}; give a divisor of {heads[1]}")
    return kv_heads[1] if kv_heads else None


def _activation_refusal(config: HfConfig, exc: Exception) -> ModelError | None:
    """The refusal naming `config`'s activation field where building its model failed on that field's name, which
    transformers' ACT2FN does not hold (a bare KeyError of the name otherwise); None where it failed on another."""
    from transformers.activations import ACT2FN

    if not isinstance(exc, KeyError) or not exc.args:
        return None
    field = next((name for name in ACTIVATION_FIELDS if config.fields.get(name) == exc.args[0]), None)
    if field is None:
        return None
    return ModelError(f"--model {config.spec}: {config.where} gives {field} {exc.args[0]!r}, an activation "
                      f"transformers does not know; give one of {', '.join(sorted(ACT2FN))}")


# The class names' endings of transformers' linear-attention mixers (Qwen3-Next's, Qwen3.5's and OLMo Hybrid's gated
# delta rule, Kimi Linear's and GLM-5.3-Flash's KDA, MiniMax-01's lightning attention, Ling's): those but the gated
# delta rule's (workload/gdn.py counts it) `_check_no_linear_attention` refuses
LINEAR_ATTENTION = ("GatedDeltaNet", "DeltaAttention", "LightningAttention", "TextLinearAttention")


def _check_no_linear_attention(model: nn.Module, where: str) -> None:
    """Refuse a model with linear-attention layers pipesim does not count as a run's kernels compute them (all but
    the gated delta rule's, workload/gdn.py): a run computes them with flash-linear-attention's (or its own) fused
    chunk kernels, which transformers calls where they are installed (its `use_kernel_func_from_hub_with_fallback`
    hooks), and on the meta device transformers runs its torch fallback instead, a Python loop over the sequence's
    chunks whose hundreds of small kernels a layer pipesim would price as such."""
    mixers = [module for module in model.modules()
              if type(module).__name__.endswith(LINEAR_ATTENTION) and not is_gated_delta_net(module)]
    if mixers:
        raise ModelError(f"{where}: its linear attention ({type(mixers[0]).__name__}, in "
                         f"{count_text(len(mixers), 'layer')}) runs fused chunk kernels (flash-linear-attention's, or "
                         "the model's own) that pipesim does not count yet; on the meta device transformers runs its "
                         "torch fallback, a loop over the sequence's chunks, which pipesim would price as hundreds of "
                         "small kernels a layer; give a model without it (Qwen3-Next's, Qwen3.5's and OLMo Hybrid's "
                         "gated delta rule is counted)")


# The keys a query attends to that a sparse attention's indexer keeps (DeepSeek Sparse Attention's: DeepSeek-V3.2's
# `index_topk`, and the configs of GLM-5 and others that give it)
SPARSE_ATTENTION_FIELD = "index_topk"


def _check_dense_attention(settings: Any, where: str) -> None:
    """Refuse a model whose attention an indexer makes sparse where pipesim does not count it (workload/dsa.py counts
    DeepSeek-V3.2's and GLM-5's, `INDEXERS`): counted dense, its core would be priced about 32 times over at
    DeepSeek-V3.2's 128k context (or its code fails on the meta device)."""
    try:
        keys = getattr(settings, SPARSE_ATTENTION_FIELD, None)
    except Exception:  # a heterogeneous config's per-layer attribute: some of its layers index
        keys = "its layers'"
    if keys is not None and settings.model_type not in INDEXERS:
        kept = f"{keys:,}" if isinstance(keys, int) else keys
        raise ModelError(f"{where}: its attention is sparse, an indexer keeping {kept} keys a query "
                         f"({SPARSE_ATTENTION_FIELD}), laid out as no model pipesim counts so (DeepSeek-V3.2's and "
                         f"GLM-5's: {', '.join(INDEXERS)}); give a model without one")


def _check_sparse_attention(model: nn.Module, where: str) -> int | None:
    """The keys a query keeps in `model`'s sparse attention layers (None: it has none), each laid out as
    workload/dsa.py counts them, those that reuse an earlier layer's top k (GLM-5.2's `indexer_types` "shared")
    included."""
    attentions = [module for module in model.modules() if hasattr(module, "indexer")]
    if not attentions:
        return None
    unknown = next((module for module in attentions if not is_sparse_attention(module)), None)
    if unknown is not None:
        raise ModelError(f"{where}: its sparse attention ({type(unknown).__name__}) is laid out as no DSA layer "
                         "pipesim counts (DeepSeek-V3.2's and GLM-5's MLA with their indexer)")
    return kept_keys(attentions[0])


def _figure(settings: Any, field: str, where: str) -> Any:
    """The config's one `field` for the whole model, as pipesim's options hold it: a config whose layers each give
    their own (transformers' heterogeneous configs, `per_layer_config`, whose global attribute raises) is refused in
    one line, where it was a traceback."""
    try:
        return getattr(settings, field)
    except Exception as exc:  # transformers' own check of the attribute: whatever it raised, in one line
        raise ModelError(f"{where}: pipesim reads one {field} for all its layers, and transformers gives none: "
                         f"{_in_one_line(exc)}") from None


def _in_one_line(exc: Exception) -> str:
    """`exc` named and its message's lines joined: transformers' validators put the reason on the second line
    ("Class validation error for validator 'validate_architecture':" then "ValueError: The hidden size ...")."""
    return " ".join([f"{type(exc).__name__}:", *(line.strip() for line in str(exc).splitlines() if line.strip())])


def _figures(config_class: type) -> dict[str, str]:
    """`FIGURES` as `config_class` gives them: a mixture of experts whose every MLP is an expert's gives its MLP width
    as its experts' (Qwen3.5-MoE's text config has no intermediate_size, only moe_intermediate_size). One with dense
    layers of a width of their own (Ergo's first_dense_intermediate_size, Kolibri's mlp_only_intermediate_size) is
    not laid out so: refused, as one without an MLP width."""
    aliases = getattr(config_class, "attribute_map", {})
    ffn = FIGURES["ffn"]
    widths = [name for name in dir(config_class) if name.endswith(ffn) and name != EXPERT_FFN_FIELD
              and "shared" not in name]
    if not hasattr(config_class, aliases.get(ffn, ffn)) and hasattr(config_class, EXPERT_FFN_FIELD) and not widths:
        return {**FIGURES, "ffn": EXPERT_FFN_FIELD}
    return FIGURES


def _settings(config: HfConfig, config_class: type, figures: dict[str, str]) -> Any:
    """The transformers config of `config`'s fields, each of `figures` given (under its name or the class's alias
    for it), with the key/value cache off (training keeps none)."""
    aliases = getattr(config_class, "attribute_map", {})
    missing = [field for field in figures.values() if field not in config.fields and
               aliases.get(field) not in config.fields]
    # a figure the class has no field for, by its name or an alias (GPT-2's n_inner, not intermediate_size): its layout
    unknown = [field for field in missing if not hasattr(config_class, aliases.get(field, field))]
    if unknown:
        raise _not_laid_out(f"--model {config.spec}", f"model_type {config.model_type!r} ({config_class.__name__} "
                                                      f"has no {', '.join(unknown)})")
    if missing:
        raise ModelError(f"--model {config.spec}: {config.where} gives no {', '.join(missing)}; a decoder's config "
                         f"needs {'it' if len(missing) == 1 else 'each of them'} (transformers would fill in its "
                         "class's default, another model's size)")
    try:
        settings = config_class.from_dict(config.fields)
    except Exception as exc:  # its checks of the fields' values (rope settings, ...): whatever they raised, in one line
        raise ModelError(f"--model {config.spec}: transformers refuses {config.where}: {_in_one_line(exc)}") from None
    settings.use_cache = False
    return settings


FINAL_NORMS = ("norm", "norm_f")  # a base model's final norm: Llama's and most decoders', Mamba's and Nemotron-H's


def _not_laid_out(where: str, what: str) -> ModelError:
    """The refusal of `what`, a model or a model_type, whose decoder is not cut as pipesim cuts one."""
    return ModelError(f"{where}: {what} is not laid out as pipesim cuts a decoder (a base model holding its input "
                      "embedding, layers and a final norm, norm or norm_f, and a head: as Llama, Mistral, Qwen, Gemma, "
                      "Phi-3 and Nemotron-H are)")


def _base_model(model: nn.Module) -> nn.Module | None:
    """A causal language model's decoder, its `get_decoder()`, or where that answers the model itself (its
    base_model_prefix names no attribute of it: Llama4ForCausalLM's "language_model"), its `model`."""
    base = model.get_decoder() if hasattr(model, "get_decoder") else None
    return getattr(model, "model", None) if base is model else base


def decoder_layers(model: nn.Module, where: str) -> list[nn.Module]:
    """A transformers causal language model cut as a pipeline cuts it: its base model's token embedding (its
    `get_input_embeddings`: Llama's embed_tokens, Nemotron-H's embeddings), each decoder layer, its final norm
    (`FINAL_NORMS`), then the head. Models laid out otherwise are refused, naming the layout."""
    base = _base_model(model)
    try:
        embed = base.get_input_embeddings() if hasattr(base, "get_input_embeddings") else None
    except NotImplementedError:  # transformers' answer for a model without one (a vision model's)
        embed = None
    norm = next((getattr(base, name) for name in FINAL_NORMS if isinstance(getattr(base, name, None), nn.Module)), None)
    blocks = getattr(base, "layers", None)
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if embed is None or norm is None or not isinstance(blocks, nn.ModuleList) or head is None:
        raise _not_laid_out(where, type(model).__name__)
    rotary = getattr(base, "rotary_emb", None)
    types = getattr(model.config, "layer_types", None) or [None] * len(blocks)
    for block in blocks:
        _as_megatron_block(block)
    cap = getattr(model.config, "final_logit_softcapping", None)
    handoff = TopKHandoff() if any(shares_top_k(module) for module in base.modules()) else None
    layers = [DecoderLayer(block, rotary, kind, handoff) for block, kind in zip(blocks, types)]
    if any(is_mamba2_mixer(module) or is_gated_delta_net(module)  # a hybrid's: each its mixers
           for block in blocks for module in block.modules()):
        for layer, block in zip(layers, blocks):
            setattr(layer, MIXERS_ATTRIBUTE, _hybrid_mixers(block))
    return [embed, *layers, norm, CappedHead(head, cap) if cap else head]


def _hybrid_mixers(block: nn.Module) -> str:
    """A hybrid's decoder block's mixers in Megatron-core's hybrid pattern (`MIXERS_ATTRIBUTE`; models/hybrid/
    hybrid_layer_allocation.py `Symbols`): M its Mamba-2 mixer, G its Gated DeltaNet, * its attention, E its mixture
    of experts, - its dense MLP (`_as_megatron_runs` marks the two)."""
    modules = list(block.modules())
    regions = {getattr(module, CHECKPOINT_REGION, None) for module in modules}
    return "".join(symbol for symbol, holds in (
        ("M", any(is_mamba2_mixer(module) for module in modules)),
        ("G", any(is_gated_delta_net(module) for module in modules)),
        ("*", any(type(module).__name__.endswith("Attention") for module in modules)),
        ("E", "moe" in regions), ("-", "mlp" in regions)) if holds)


class CappedHead(nn.Module):
    """A head whose logits are soft-capped, cap·tanh(logits/cap), as Gemma 2's and 3's causal language models'
    forward caps them (`final_logit_softcapping`) after the head's product: its division, tanh and multiplication
    run in the head's layer, each saving what it saves."""

    def __init__(self, head: nn.Module, cap: float) -> None:
        super().__init__()
        self.head, self.cap = head, cap

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.head(hidden) / self.cap) * self.cap


def _as_megatron_block(block: nn.Module) -> None:
    """Run decoder block `block` as Megatron-core runs one: its MLPs, router and norms (`_as_megatron_runs`), its
    Mamba-2 mixers (workload/mamba.py), Gated DeltaNet mixers (workload/gdn.py) and sparse attention
    (workload/dsa.py) as their kernels."""
    _as_megatron_runs(block)
    counted_mixers(block)
    counted_delta_nets(block)
    counted_sparse_attentions(block)


def _as_megatron_runs(block: nn.Module) -> None:
    """Run `block`'s gated MLPs (dense, shared experts) as `workload.moe.gated_mlp` (their activation fused under
    --swiglu-fusion) and its router (a mixture of experts' `gate` or `router` beside its `experts`, with a `weight`
    and, gpt-oss's, a bias) and its shared expert's gate (Qwen2-MoE's `shared_expert_gate`, a Linear to one score
    a token, as Megatron-core's SharedExpertMLP `gate_weight`, a plain Parameter it multiplies by the rank's tokens:
    megatron/core/transformer/moe/shared_experts.py at core_v0.14.0) as `workload.moe.gating_router` (its product
    in its own precision, keeping its input as it is; tensor parallelism keeps both whole on every rank), run with
    its scaling inside the shared expert, as SharedExpertMLP runs them (`_gated_shared_expert`). Marks
    its mixture of experts (that module), or in a block without one its MLP (`MLP_PRODUCTS`), as their plain
    checkpoints' regions (`CHECKPOINT_REGION`: Megatron-core's "moe" and "mlp" recompute modules; "mlp" reruns no
    MoE layer's, so a shared expert beside the experts, GraniteMoeHybrid's shared_mlp, is neither) and its shared
    expert (`SHARED_EXPERTS`) as the "shared_experts" one's, and the block's
    norms, its children, as its own (`BLOCK_NORM`: workload/count.py tells an input or pre-MLP norm by what reads
    it)."""
    experts, gated_shared = False, []
    for module in block.modules():
        if all(hasattr(module, part) for part in ("gate_proj", "up_proj", "down_proj")) and _activation(module):
            module.forward = functools.partial(_gated_mlp, module)
        if type(module).__name__ in EVERY_TOKEN_MIXTURES:  # its router first: `gating_router` wraps the one it finds
            module.router.forward = functools.partial(_sigmoid_top_k, module.router)
            module.forward = functools.partial(_input_scaled_mixture, module)
        router = next((getattr(module, part) for part in ("gate", "router")  # gpt-oss's is its router
                       if isinstance(getattr(module, part, None), nn.Module)), None)
        if hasattr(module, "experts") and isinstance(getattr(router, "weight", None), torch.Tensor):
            gating_router(router, balanced=True)
            setattr(module, CHECKPOINT_REGION, "moe")
            for shared in (getattr(module, name, None) for name in SHARED_EXPERTS):
                if isinstance(shared, nn.Module):
                    setattr(shared, CHECKPOINT_REGION, "shared_experts")
            experts = True
        if isinstance(getattr(module, "shared_expert_gate", None), nn.Linear):
            gating_router(module.shared_expert_gate)
            gated_shared.append(module)
    for mixture in gated_shared:  # its shared expert's forward as set above (`_gated_mlp`), its gate put inside
        shared = mixture.shared_expert
        shared.forward = functools.partial(_gated_shared_expert, mixture.shared_expert_gate, shared.forward)
        mixture.forward = functools.partial(_gate_inside_shared_expert, mixture)
    for module in () if experts else block.modules():
        if any(hasattr(module, down) and any(hasattr(module, up) for up in ups) for down, ups in MLP_PRODUCTS):
            setattr(module, CHECKPOINT_REGION, "mlp")
    for name, child in block.named_children():
        if is_norm(name, child):
            setattr(child, BLOCK_NORM, True)


def _gated_shared_expert(gate: nn.Module, computed: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor
                         ) -> torch.Tensor:
    """A shared expert's output scaled by its gate, sigmoid(gate(x)), inside the shared expert, as Megatron-core's
    SharedExpertMLP runs its gate (moe/shared_experts.py at core_v0.14.0): what recomputing it ("shared_experts")
    drops and reruns holds the gate's product and scaling."""
    out = computed(x)  # the MLP first, then the gate's product and scaling, as SharedExpertMLP.forward runs them
    return out * torch.sigmoid(gate(x))


def _gate_inside_shared_expert(mixture: nn.Module, hidden: torch.Tensor) -> torch.Tensor:
    """Qwen2-MoE's, Qwen3-Next's and Qwen3.5-MoE's mixture forward (its shared expert, then its router and routed
    experts, added), the shared expert's gate inside the shared expert (`_gated_shared_expert`), as Megatron-core's
    MoELayer runs them without its shared-expert overlap (moe_layer.py at d98e8a64: `shared_experts_compute`, then
    `route`)."""
    flat = hidden.view(-1, hidden.shape[-1])
    shared = mixture.shared_expert(flat)
    _, weights, selected = mixture.gate(flat)
    return (mixture.experts(flat, selected, weights) + shared).reshape(hidden.shape)


def _activation(mlp: nn.Module) -> nn.Module | None:
    """A transformers gated MLP's activation: its `act_fn` (Llama's), or `activation_fn` (Llama 4's)."""
    return getattr(mlp, "act_fn", None) or getattr(mlp, "activation_fn", None)


def _gated_mlp(mlp: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """transformers' gated MLP, `down_proj(act(gate_proj(x)) * up_proj(x))`, as `workload.moe.gated_mlp`."""
    return gated_mlp(mlp.down_proj, _activation(mlp), mlp.gate_proj(x), mlp.up_proj(x))
