"""A Hugging Face decoder model as a pipesim Model: transformers builds it from its config (on the meta device
when counted), and pipesim cuts it where a pipeline can: the token embedding, each decoder layer, the final norm
and the vocabulary head, which workload/count.py counts as it counts the built-in gpt's layers.

Each decoder layer is handed what the model's own forward hands it: the rotary position embeddings, computed in
the layer from the model's rotary module (as each pipeline stage computes them for its own layers), and no mask,
so that transformers' sdpa attention asks for a causal kernel (`is_causal`). Anything else a model's forward does
between its parts is not counted (Llama's, Mistral's and Qwen's do nothing else; Gemma scales its embedding in its
embedding module). A tied head is counted as its own copy of the embedding's weights, as Megatron-LM keeps one on
the last stage.

transformers is an optional extra (`pipesim[hf]`), imported only here."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from . import data
from .hfconfig import HfConfig, HfConfigError, read_hf_config
from .models import Model, ModelError, _classify

# The figures a dense decoder's config must give (transformers would fill a missing one with its default, another
# model's size), as pipesim names them: its options, which the estimate's tensor-parallel checks read.
FIGURES = {"layers": "num_hidden_layers", "width": "hidden_size", "heads": "num_attention_heads",
           "ffn": "intermediate_size", "vocab": "vocab_size"}
WELL_KNOWN = ("llama", "mistral", "qwen2", "qwen3", "gemma2", "phi3", "olmo2")  # named where a model_type is unknown
# The fields by which transformers' configs give a mixture of experts its routed experts (Mixtral, Qwen-MoE,
# DeepSeek, OLMoE): their experts run as transformers' grouped products, which torch's FLOP counter does not count,
# and how many tokens each gets depends on the router's values; refused until pipesim counts them at their share.
EXPERT_FIELDS = ("num_local_experts", "num_experts", "n_routed_experts")


class DecoderLayer(nn.Module):
    """One decoder layer of a transformers model, given its position embeddings by `rotary` (None: the layer
    has none, or makes its own) and causal attention."""

    def __init__(self, layer: nn.Module, rotary: nn.Module | None) -> None:
        super().__init__()
        self.layer, self.rotary = layer, rotary

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(hidden.shape[1], device=hidden.device).unsqueeze(0)
        given: dict[str, Any] = {"position_ids": positions}
        if self.rotary is not None:
            given["position_embeddings"] = self.rotary(hidden, positions)
        out = self.layer(hidden, attention_mask=None, **given)
        return out[0] if isinstance(out, tuple) else out


def hf_model(spec: str, seq_len: int | None) -> Model:
    """The model config `spec` (`hf:PATH`) describes, built by transformers in the current default device (meta
    to count it), cut into its embedding, decoder layers, final norm and head; trained, as the gpt is, on the token
    task of `workload.data` at `seq_len` tokens a sample."""
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
    settings = _settings(config, CONFIG_MAPPING[config.model_type])
    experts = next((name for name in EXPERT_FIELDS if getattr(settings, name, None)), None)  # aliases: one is enough
    if experts is not None:
        raise ModelError(f"{where}: a mixture of experts ({experts} = {getattr(settings, experts)}); pipesim counts "
                         "dense decoders only, so far (a model without routed experts)")
    options = {name: getattr(settings, field) for name, field in FIGURES.items()}
    options["kv_heads"] = getattr(settings, "num_key_value_heads", None) or options["heads"]
    longest = getattr(settings, "max_position_embeddings", None)
    if seq_len is None:
        raise ModelError(f"--seq-len: give the tokens a sample of {spec} holds"
                         + (f" (its config allows up to {longest})" if longest else ""))
    if longest and seq_len > longest:
        raise ModelError(f"--seq-len {seq_len}: {spec} takes at most its max_position_embeddings, {longest}")
    built = MODEL_FOR_CAUSAL_LM_MAPPING.get(type(settings), None)
    if built is None:
        raise ModelError(f"{where}: model_type {config.model_type!r} is not a causal language model transformers "
                         f"builds (as {', '.join(WELL_KNOWN)} are)")
    # sdpa where the model has it (its attention counted as the kernel --attention names), else its own (Gemma 2's
    # soft-capped scores: products and a softmax, as --attention math)
    attention = "sdpa" if getattr(built, "_supports_sdpa", False) else "eager"
    try:
        model = AutoModelForCausalLM.from_config(settings, attn_implementation=attention)
    except Exception as exc:  # transformers' own code on the config's values: whatever it raised, in one line
        raise ModelError(f"{where}: transformers cannot build it: {type(exc).__name__}: "
                         f"{(str(exc).splitlines() or [''])[0]}") from None
    layers = decoder_layers(model, where)
    options["seq_len"] = seq_len
    vocab = options["vocab"]

    def make(b: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        return data.token_batch(b, seq_len, vocab, gen)
    return Model(spec, layers, make, _classify, options=options, heldout=data.token_heldout(seq_len, vocab),
                 classifier=True)


def _settings(config: HfConfig, config_class: type) -> Any:
    """The transformers config of `config`'s fields, each of `FIGURES` given (under its name or the class's alias
    for it), with the key/value cache off (training keeps none)."""
    aliases = getattr(config_class, "attribute_map", {})
    missing = [field for field in FIGURES.values() if field not in config.fields and
               aliases.get(field) not in config.fields]
    if missing:
        raise ModelError(f"--model {config.spec}: {config.path} gives no {', '.join(missing)}; a dense decoder's "
                         f"config needs {', '.join(FIGURES.values())}")
    try:
        settings = config_class.from_dict(config.fields)
    except Exception as exc:  # its checks of the fields' values (rope settings, ...): whatever they raised, in one line
        raise ModelError(f"--model {config.spec}: transformers refuses {config.path}: {type(exc).__name__}: "
                         f"{(str(exc).splitlines() or [''])[0]}") from None
    settings.use_cache = False
    return settings


def decoder_layers(model: nn.Module, where: str) -> list[nn.Module]:
    """A transformers causal language model cut as a pipeline cuts it: its base model's token embedding, each
    decoder layer, its final norm, then the head. Models laid out otherwise are refused, naming the layout."""
    base = model.get_decoder() if hasattr(model, "get_decoder") else None
    parts = [getattr(base, name, None) for name in ("embed_tokens", "layers", "norm")]
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if any(part is None for part in parts) or not isinstance(parts[1], nn.ModuleList) or head is None:
        raise ModelError(f"{where}: {type(model).__name__} is not laid out as pipesim cuts a decoder (a base model "
                         "holding embed_tokens, layers and norm, and a head: as Llama, Mistral, Qwen, Gemma and "
                         "Phi-3 are)")
    embed, blocks, norm = parts
    rotary = getattr(base, "rotary_emb", None)
    return [embed, *(DecoderLayer(block, rotary) for block in blocks), norm, head]

