"""The built-in models' default sizes and the choices their count takes, apart from their torch code
(workload/models.py builds with them, workload/count.py counts with them), so that the command line can show and
check them without importing torch."""

import math
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from ..choices import choose_from, unknown_names
from ..profiles.workload import is_hf, too_few_layers
from ..units import float_text, number_allowed

DEFAULT_SIZES: dict[str, dict[str, int]] = {
    "mlp": {"layers": 8, "width": 512},
    "cnn": {"layers": 6, "width": 32},
    "gpt": {"layers": 4, "width": 256, "heads": 4, "seq_len": 128, "vocab": 2048},
    "two-branch": {"layers": 2, "width": 32},
}


def model_name_refusal(name: str) -> str | None:
    """Why --model `name` names no model: neither a built-in, nor `package.module:attribute` (a colon), nor
    `hf:PATH`; None where it is one of them. Here, apart from the torch code, so that a misspelt name is refused
    before torch is imported (4 s of a refusal's 4.2 before)."""
    from .hfconfig import nearest_config_hint  # here: it reads this module's sizes

    if name in DEFAULT_SIZES or ":" in name or is_hf(name):
        return None
    return (f"{unknown_names('--model', [name], DEFAULT_SIZES)}, or give package.module:attribute or hf:PATH (a "
            "Hugging Face config.json)" + nearest_config_hint(Path(name)))  # an example named without hf:


def built_in_layers(model: str, blocks: int) -> int:
    """The layers a built-in `model` of `blocks` (--layers) is cut between, as workload/models.py builds it: the
    blocks and the classifier after them, the gpt's embedding before them too, two-branch's stem, its two branches of
    `blocks` each and the head that merges them."""
    return {"mlp": blocks + 1, "cnn": blocks + 1, "gpt": blocks + 2, "two-branch": 2 * blocks + 2}[model]


def stages_refusal(stages: str, count: int, model: str, sizes: Mapping[str, Any],
                   emptied_by: str | None = None) -> str | None:
    """The one line refusing `count` stages (asked for by the flags `stages`) of a built-in `model` of `sizes` (its
    size flags; None: not given) with fewer layers (profiles/workload.py `too_few_layers`, `emptied_by` as there),
    said before torch is imported: `calibrate --model mlp --stages 20` was refused after torch's import and the
    processes' server, 8.8 s. None where each stage has a layer, or for another model, whose layers are known once it
    is built."""
    if model not in DEFAULT_SIZES:
        return None
    options = {**DEFAULT_SIZES[model], **{name: value for name, value in sizes.items() if value is not None}}
    layers = built_in_layers(model, options["layers"])
    return too_few_layers(stages, model, options, layers, emptied_by=emptied_by) if count > layers else None


def attention_of(given: str | None, model: str) -> str:
    """--attention as given, else the attention the model's own runtime runs. The built-in models: "math", the
    scores materialised, as Megatron-LM ran its GPT in 2021 (CoreAttention, before FlashAttention), whose published
    rows pipesim's gpt reproduces (benchmarks/published_runs.py). A Hugging Face model: "flash", as transformers
    builds it (attn_implementation None picks "sdpa", torch's fused kernels: modeling_utils.py
    `get_correct_attn_implementation`, transformers 5.24.0), and as Megatron-core trains it (attention_backend
    auto, TransformerEngine's fused attention: transformer_config.py at Megatron-LM d98e8a6). Your own module:
    "flash", as torch's scaled_dot_product_attention picks a fused kernel on a GPU where one applies."""
    if given is not None:
        return given
    return "math" if model in DEFAULT_SIZES else "flash"


CROSS_ENTROPY = ("torch", "megatron")  # whose cross entropy a model's loss runs (workload/count.py `count_model`)
NORM_KERNELS = ("eager", "fused")  # how a Hugging Face model's RMSNorms run (workload/norms.py)
ROPE_KERNELS = ("eager", "fused")  # how a Hugging Face model's rotary position embedding runs (workload/rope.py)
# How Megatron-core computes a routed experts' router's load-balancing loss (workload/moe.py `with_aux_loss`): none,
# its torch ops (Megatron-LM 1e057005), TransformerEngine's two fused kernels (`moe_router_fusion`)
ROUTER_AUX_LOSSES = ("none", "unfused", "fused")


# --repeat-kv beside torch's math attention, which copies grouped keys and values itself: said by the count, and for a
# model not built in (a Hugging Face config's 405B counted whole first) before it
REPEAT_KV_UNDER_MATH = ("--repeat-kv: under --attention math torch's attention copies grouped-query keys and values to "
                        "every query head itself, the copies --repeat-kv would make: leave it out, or give --attention "
                        "flash")


def kernels_refusal(cross_entropy: str, norm_kernel: str, rope_kernel: str, loss_parallel: bool,
                    router_aux_loss: str = "none") -> str | None:
    """The one line refusing kernels the count does not take (None: it takes them), which the command line says
    before torch is imported and the count says again for its other callers: each of its choices, and torch's
    loss_parallel only with torch's cross entropy."""
    for flag, kernel, choices in (("--norm-kernel", norm_kernel, NORM_KERNELS),
                                  ("--rope-kernel", rope_kernel, ROPE_KERNELS),
                                  ("--cross-entropy", cross_entropy, CROSS_ENTROPY),
                                  ("--router-aux-loss", router_aux_loss, ROUTER_AUX_LOSSES)):
        if kernel not in choices:
            return choose_from(flag, choices, kernel)
    if loss_parallel and cross_entropy != "torch":
        return "--loss-parallel is torch's cross entropy: leave out --cross-entropy megatron"
    return None

# The most of each size a model is counted at, each where the count's time or the host's memory would stop being
# bounded (a larger one ran for hours, grew past the host's memory or overflowed torch's storage sizes): the count
# builds and traces every layer (about 20 ms each on a 2-core host), the token task draws its held-out set of 256
# sequences and its vocabulary's permutation on the host (workload/data.py), and a weight's elements, width x
# ffn and experts x width x expert-ffn, stay far inside int64. The largest published models are well inside them:
# 126 layers (Llama 3.1 405B), width 18,432 and ffn 73,728 (PaLM 540B), 128 heads, a vocabulary of 262,144 (Gemma
# 3) and 256 routed experts (DeepSeek-V3). Tokens: 2^20, past the 262,144 that long-context runs split over a
# context-parallel ring and that Phi-3.5-mini's and Phi-4-mini's configs give their sliding window, which is held to
# the same bound (a 2-layer gpt at 1,048,576 tokens, C = 8: simulated in 18 s, 2.7 GB; at 262,144, 10 s, 1.2 GB).
MAX_SIZES = {"layers": 10_000, "width": 1 << 20, "heads": 1 << 16, "kv_heads": 1 << 16, "seq_len": 1 << 20,
             "vocab": 1 << 24, "ffn": 1 << 22, "expert_ffn": 1 << 22, "experts": 1 << 14, "top_k": 1 << 14,
             "shared_experts": 1 << 14, "mtp_layers": 10_000}


# The options a Hugging Face config takes (workload/hf.py `hf_model`); its config gives the other sizes
HF_OPTIONS = ("seq_len", "mtp_layers", "capacity_factor")
# The sizes a Hugging Face config takes as flags (HF_OPTIONS) with the least each allows
FLAG_SIZES_LEAST = {"seq_len": 1, "mtp_layers": 0}


def hf_options_refusal(model: str, given: Iterable[str]) -> str | None:
    """The one line refusing a size flag `given` to an hf: `model`, whose config gives its sizes (None: every one
    given is one it takes, or the model is not hf:)."""
    wrong = [name for name in given if name not in HF_OPTIONS]
    if is_hf(model) and wrong:
        return (f"--{wrong[0].replace('_', '-')} does not apply to {model}: its config gives its sizes (--seq-len, "
                "--mtp-layers and --capacity-factor are the ones it takes)")
    return None


def flag_sizes_refusal(model: str, sizes: dict[str, Any]) -> str | None:
    """The one line refusing an hf: `model`'s size flags `sizes` (None: not given): a flag its config does not take,
    --seq-len or --mtp-layers outside their bounds, a --capacity-factor not a finite number above 0, a config that
    cannot be read, no --seq-len or one past the config's max_position_embeddings (None: all within them, or
    another model, whose build refuses a flag it does not take before the flag's value, so that `--model mlp
    --seq-len 0` is not told to give a --seq-len it cannot take). A built-in model's own sizes (`DEFAULT_SIZES`'s,
    which its builder takes) out of their bounds, likewise (`run --model mlp --layers 0` was refused after torch's
    import, 12 s). The command line says it before torch is imported (--seq-len 0 of an hf: config was refused after
    torch's and transformers' imports, 11 s; --layers given to one, 17 s; no --seq-len, 10-14 s) and the model's
    build says it again for its other callers."""
    given = {name: value for name, value in sizes.items() if value is not None}
    if model in DEFAULT_SIZES:
        return next((refusal for size in DEFAULT_SIZES[model] if size in given
                     and (refusal := size_refusal(f"--{size.replace('_', '-')}", size, given[size]))), None)
    if not is_hf(model):
        return None
    if (refusal := hf_options_refusal(model, given)) is not None:
        return refusal
    for size, least in FLAG_SIZES_LEAST.items():
        if size in given and (refusal := size_refusal(f"--{size.replace('_', '-')}", size, given[size], least)):
            return refusal
    from .hfconfig import config_seq_len_refusal  # here: it reads this module's sizes

    return capacity_factor_refusal(given.get("capacity_factor")) or config_seq_len_refusal(model, given.get("seq_len"))


def capacity_factor_refusal(capacity_factor: float | None) -> str | None:
    """A capacity factor that gives an expert no capacity, one line (None: it is a finite number above 0, or not
    given)."""
    if capacity_factor is not None and not (math.isfinite(capacity_factor) and capacity_factor > 0):
        allowed = number_allowed(0, None, whole=False, finite=True, above=True)
        return f"--capacity-factor: {allowed} (got {float_text(capacity_factor)})"
    return None


def size_refusal(flag: str, size: str | None, value: int, least: int = 1) -> str | None:
    """The one line refusing `value` of `size` (a `MAX_SIZES` key; None: a size pipesim sets no bound to, a
    config's max_position_embeddings, which bounds --seq-len) where `flag` gave it (None: it is from `least` to its
    bound), worded as the command line refuses a number option's value (units.py `number_allowed`)."""
    most = None if size is None else MAX_SIZES[size]
    if least <= value and (most is None or value <= most):
        return None
    return f"{flag}: {number_allowed(least, most)} (got {value:,})"
