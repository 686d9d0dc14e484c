"""A Hugging Face model named as `hf:PATH` (its config.json, or a folder holding one): where the config is and what
it says, read without torch or transformers, so that a what-if finds its count in the host cache by the config's
content before importing either (workload/hf.py builds the model from it)."""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..files import read_json
from ..profiles.workload import HF_PREFIX, is_hf
from ..units import number_allowed
from .sizes import MAX_SIZES, size_refusal

CONFIG_NAME = "config.json"
EXAMPLES = Path(__file__).resolve().parents[1] / "examples"  # the configs pipesim comes with (examples/README.md)
# The figures a dense decoder's config must give (transformers would fill a missing one with its default, another
# model's size), as pipesim names them: its options, which the estimate's tensor-parallel checks read.
FIGURES = {"layers": "num_hidden_layers", "width": "hidden_size", "heads": "num_attention_heads",
           "ffn": "intermediate_size", "vocab": "vocab_size"}
# The fields by which transformers' configs give a mixture of experts its routed experts (Mixtral, Qwen-MoE,
# DeepSeek, OLMoE) and how many of them each token goes to.
EXPERT_FIELDS = ("num_local_experts", "num_experts", "n_routed_experts")
# The fields that place a mixture's experts in some of its decoder layers, the rest dense (DeepSeek's and GLM's first
# k, Qwen's step and list, Llama 4's step and list, Jamba's period, ERNIE's range, Doge's switch, transformers'
# per-layer types)
MOE_PLACEMENT_FIELDS = ("first_k_dense_replace", "decoder_sparse_step", "mlp_only_layers", "moe_layer_freq",
                        "interleave_moe_layer_step", "moe_layers", "expert_layer_period", "expert_layer_offset",
                        "moe_layer_start_index", "moe_layer_end_index", "moe_layer_interval", "is_moe",
                        "mlp_layer_types")
TOP_K_FIELD = "num_experts_per_tok"
# The sizes a config gives (the key/value heads where it is not the attention heads', the keys a sliding window
# holds, the routed experts and a token's share of them), each a whole number of at least 1 (`LEAST`) where given:
# transformers builds a model of no decoder layers at 0 or fewer, torch fails deep in the count at a width, head,
# vocabulary or token's experts of 0, and a window of 0 or fewer holds no key (transformers' mask) yet was
# priced as no window or at negative FLOPs (planning/estimate.py `kernel_flops`); each field -> the `MAX_SIZES`
# bound it is held to
SIZES = {**{field: size for size, field in FIGURES.items()}, "num_key_value_heads": "kv_heads",
         "sliding_window": "seq_len", **dict.fromkeys(EXPERT_FIELDS, "experts"), TOP_K_FIELD: "top_k"}
# The least each of `SIZES` may be, where not 1: routed experts of 0 are a dense model where transformers builds
# one (Qwen-MoE's `num_experts > 0` in modeling_qwen3_moe.py, GraniteMoeHybrid's) and a mixture of no experts
# where it does not (Mixtral's, which workload/hf.py refuses once built)
LEAST = dict.fromkeys(EXPERT_FIELDS, 0)
# Of `SIZES`, those a config may switch off -> the field that does: switched off (false), the size is not read, and
# transformers writes one that is no size there (Qwen2-MoE's config saves sliding_window 0 where use_sliding_window
# is false, configuration_qwen2_moe.py at transformers 5.25; Qwen2's and Qwen3's None)
SWITCHED_BY = {"sliding_window": "use_sliding_window"}
LONGEST_FIELD = "max_position_embeddings"  # the most tokens a sample of the model holds
# A multimodal model's config (Gemma 3's, Mistral 3's, Llama 4's as their repositories publish them) holds its language
# model's config under this key, beside its encoders' (vision_config, audio_config: each a config with a model_type):
# what a pipeline's stages of transformer layers are, and what pipesim counts of it
LANGUAGE_PART = "text_config"
# fields such a config gives at its top level that decide its language model's too, over the part's own: the
# composite model ties its head to its embedding by the top level's tie_word_embeddings (transformers'
# Mistral3ForConditionalGeneration and Llama4ForConditionalGeneration read the composite config's)
SHARED_FIELDS = ("tie_word_embeddings",)


class HfConfigError(ValueError):
    """A config that cannot be read; the message is one line naming the file and what is wrong."""


@dataclass(frozen=True)
class HfConfig:
    """`spec` as the user wrote it (`hf:PATH`), the config.json it names and that file's JSON object; of a
    multimodal model's, its language model's part (`LANGUAGE_PART`), the model it is part of named in `part_of` (its
    model_type) and its other parts, left out, in `left_out`."""

    spec: str
    path: Path
    fields: dict[str, Any]
    part_of: str | None = None
    left_out: tuple[str, ...] = ()

    @property
    def where(self) -> str:
        """Where its fields are, as a refusal names it: the file, or the part of it (`LANGUAGE_PART`)."""
        return f"{self.path}'s {LANGUAGE_PART}" if self.part_of is not None else str(self.path)

    @property
    def note(self) -> str | None:
        """What the count leaves out of a multimodal model, in one line; None for a language model's config."""
        if self.part_of is None:
            return None
        others = f"; its {' and '.join(self.left_out)} not" if self.left_out else ""
        return (f"{self.spec} is a {self.part_of} model: pipesim takes its language model, {LANGUAGE_PART} "
                f"(model_type {self.model_type}){others}")

    @property
    def model_type(self) -> str:
        return self.fields["model_type"]

    @property
    def digest(self) -> str:
        """What the model is, whatever the file is called or how it is laid out: its fields, sorted."""
        return hashlib.sha256(json.dumps(self.fields, sort_keys=True).encode()).hexdigest()


def build_imports(model: str) -> tuple[str, ...]:
    """What a process building --model `model` imports beyond torch and pipesim's executor: for a Hugging Face config,
    transformers' model code (4.3 s of one quiet core; a config's own modeling module adds 0.02-0.1), which a
    rank's forkserver imports once for all of them (workload/processes.py `prepare`); none for pipesim's own models
    and a user's module (whose imports are theirs)."""
    return ("transformers.modeling_utils", f"{__package__}.hf") if is_hf(model) else ()


def hf_config_path(spec: str) -> Path:
    """The config.json `spec` (`hf:PATH`) names: PATH, or PATH/config.json where PATH is a folder."""
    path = Path(spec.removeprefix(HF_PREFIX))
    return path / CONFIG_NAME if os.path.isdir(path) else path  # False where it cannot be looked at: read it says why


def nearest_config_hint(given: Path) -> str:
    """The refusals' hint for a `given` path that is not there: the folder holding a config.json whose name is
    nearest its name, among its siblings and pipesim's examples (a typo, or an example named without examples/:
    `hf:llama3.1-8b`), as hf:PATH below the working folder where it lies there; "" where no name is near. One
    wording for both refusals that give it (a name without hf:, `model_name_refusal`; an hf:PATH, `read_config`)."""
    import difflib

    folders: dict[str, Path] = {}
    for place in (given.parent, EXAMPLES):
        try:
            folders.update({folder.name: folder for folder in place.iterdir()
                            if folder.name not in folders and (folder / CONFIG_NAME).is_file()})
        except OSError:  # no such folder, or one that cannot be listed: nothing near there
            continue
    near = difflib.get_close_matches(given.name, list(folders), n=1)
    if not near:
        return ""
    folder = folders[near[0]].resolve()
    named = HF_PREFIX + str(folder.relative_to(Path.cwd()) if folder.is_relative_to(Path.cwd()) else folder)
    return f"; {named} is the nearest name that holds a {CONFIG_NAME}"


def _folder_refusal(spec: str, folder: Path) -> str:
    """The one line refusing a `folder` with no config.json in it: the folders in it that hold one, as
    hf:`folder`/NAME takes them (hf:examples names pipesim's examples below it)."""
    try:
        inside = sorted(entry.name for entry in folder.iterdir() if (entry / CONFIG_NAME).is_file())
    except OSError:  # a folder that cannot be listed: nothing to name
        inside = []
    if not inside:
        return (f"--model {spec}: {folder} holds no {CONFIG_NAME}, nor do its folders; give hf:PATH, a {CONFIG_NAME} "
                "or a folder holding one")
    return (f"--model {spec}: {folder} holds no {CONFIG_NAME}; its folders that do: {', '.join(inside)} "
            f"(give hf:{folder / 'NAME'})")


def read_hf_config(spec: str) -> HfConfig:
    """The config `spec` names; a missing or unreadable file, one not a JSON object, one without a model_type, one
    whose `SIZES`, given by their own names, are not whole numbers from their `LEAST` to their bounds
    (`size_field_refusal`), is `HfConfigError`. What transformers reads, aliases and all, only its config class
    tells, so workload/hf.py refuses the rest once it is read: a size given under an alias (`_check_aliased_sizes`),
    key/value heads that do not divide the attention heads (`_kv_heads`), more experts a token than routed experts.
    A multimodal model's config that gives no decoder figure of its own is read as its language model's part
    (`LANGUAGE_PART`, the top level's `SHARED_FIELDS` over its own), its other parts named in `HfConfig.left_out`.
    A size the config switches off (`SWITCHED_BY`) is not read."""
    given = spec.removeprefix(HF_PREFIX)
    if not given:
        raise HfConfigError(f"--model {spec}: give hf:PATH, a {CONFIG_NAME} or a folder holding one")
    path = hf_config_path(spec)
    try:
        missing = not path.exists()
    except OSError:  # a name too long, a folder that cannot be searched: reading it says which
        missing = False
    if missing and os.path.isdir(given):  # a folder of configs (hf:examples): the ones it holds
        raise HfConfigError(_folder_refusal(spec, Path(given)))
    if missing:
        raise HfConfigError(f"--model {spec}: no {path}; give hf:PATH, a {CONFIG_NAME} or a folder holding one"
                            + nearest_config_hint(Path(given)))
    fields = read_json(path, HfConfigError, "Hugging Face config", f"--model {spec}: ")
    if not isinstance(fields, dict):  # an array, number or string: no fields to read
        raise HfConfigError(f"--model {spec}: {path} is not a JSON object; give a Hugging Face {CONFIG_NAME} "
                            "(an object of fields, model_type among them)")
    if "model_type" not in fields:
        raise HfConfigError(f"--model {spec}: {path} has no model_type; give a Hugging Face {CONFIG_NAME} "
                            "(model_type says which transformers model it configures)")
    if not isinstance(fields["model_type"], str):
        raise HfConfigError(f"--model {spec}: {path}: model_type: give the name transformers knows the model by, a "
                            f"string (got {json.dumps(fields['model_type'])})")
    language = fields.get(LANGUAGE_PART)
    part_of, left_out = None, ()
    if isinstance(language, dict) and not any(field in fields for field in FIGURES.values()):
        if not isinstance(language.get("model_type"), str):
            raise HfConfigError(f"--model {spec}: {path}'s {LANGUAGE_PART} (the language model pipesim counts of a "
                                f"{fields['model_type']} model) has no model_type; add the one transformers knows "
                                "it by")
        part_of = fields["model_type"]
        left_out = tuple(sorted(key for key, value in fields.items() if key.endswith("_config") and key != LANGUAGE_PART
                                and isinstance(value, dict) and "model_type" in value))  # not quantization_config
        fields = {**language, **{key: fields[key] for key in SHARED_FIELDS if key in fields}}
    config = HfConfig(spec, path, fields, part_of, left_out)
    for field in SIZES:
        unread = fields.get(field) is None or fields.get(SWITCHED_BY.get(field)) is False
        refusal = None if unread else size_field_refusal(spec, config.where, field, field, fields[field])
        if refusal is not None:
            raise HfConfigError(refusal)
    return config


def seq_len_refusal(spec: str, seq_len: int | None, longest: int | None, whose: str) -> str | None:
    """--seq-len's one line for `spec`, whose samples hold at most `longest` tokens, the bound `whose` names (None:
    none known, `whose` then what is known of it, or ""): none given, or more than the bound; None where `seq_len`
    is within it. The command line says it from the config's own field before torch is imported
    (`config_seq_len_refusal`), workload/hf.py again from transformers' reading of the config."""
    if seq_len is None:
        hint = f"up to {whose}, {longest:,}" if longest else whose
        return f"--seq-len: give the tokens a sample of {spec} holds" + (f" ({hint})" if hint else "")
    if longest and seq_len > longest:
        return f"--seq-len {seq_len:,}: {spec} takes at most {whose}, {longest:,}"
    return None


def config_seq_len_refusal(spec: str, seq_len: int | None) -> str | None:
    """`seq_len_refusal` from the config `spec` names, read without torch: a config that cannot be read, no
    --seq-len, or one past the config's own max_position_embeddings (where it gives none, transformers' default
    for its model_type bounds it, which workload/hf.py reads once transformers is imported). `hf:` without
    --seq-len was refused once torch and transformers had built the model, 10-14 s."""
    try:
        config = read_hf_config(spec)
    except HfConfigError as exc:
        return str(exc)
    longest = config.fields.get(LONGEST_FIELD)
    if longest is None:
        return None if seq_len is not None else seq_len_refusal(
            spec, None, None, f"its config gives no {LONGEST_FIELD}: transformers' default for model_type "
                              f"{config.model_type!r} bounds it")
    # 4096.0 or "4096" was said to give none, and transformers refused it once torch was imported, 10.8 s
    if (refusal := whole_number_refusal(spec, config.where, LONGEST_FIELD, longest, 1, None)) is not None:
        return refusal
    if (refusal := size_refusal(LONGEST_FIELD, None, longest)) is not None:
        return f"--model {spec}: {config.where}: {refusal}"
    return seq_len_refusal(spec, seq_len, longest, f"its {LONGEST_FIELD}")


def size_field_refusal(spec: str, where: str, given: str, field: str, value: Any) -> str | None:
    """The one line refusing `value`, which `where` (the file, or its part: `HfConfig.where`) gives as `given` (the
    `SIZES` field `field`, or an alias of it that transformers reads: workload/hf.py `_read`), where it is not a whole
    number from its `LEAST` to its bound; None where it is one."""
    least = LEAST.get(field, 1)
    if (refusal := whole_number_refusal(spec, where, given, value, least, MAX_SIZES[SIZES[field]])) is not None:
        return refusal
    refusal = size_refusal(given, SIZES[field], value, least)
    return None if refusal is None else f"--model {spec}: {where}: {refusal}"


def whole_number_refusal(spec: str, where: str, given: str, value: Any, least: int, most: int | None) -> str | None:
    """The one line refusing `value`, which `where` gives as `given`, where it is no whole number (JSON's true, 4.0
    and "4" are none: transformers' strict configs refuse them, but only once torch is imported); None where it is
    one. It states what is allowed, from `least` to `most` (None: no bound), as `size_refusal` does for a whole
    number out of them, so that 4.0 and 0 are told the same thing."""
    if isinstance(value, bool) or not isinstance(value, int):
        return f"--model {spec}: {where}: {given}: {number_allowed(least, most)} (got {json.dumps(value)})"
    return None
