"""The models calibration measures: each one an ordered list of torch layers, the layers each one reads,
a sample batch and a loss.

A pipeline cuts a model between layers, so a model is what a pipeline sees: layers in topological order,
`inputs[i]` the layers whose outputs layer i takes (`BATCH` for the sample batch; a chain unless said
otherwise, so that the two-branch model can expose its DAG), and the loss the last layer's output feeds.
"""

from __future__ import annotations

import importlib
import inspect
import os
import sys
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._pytree import tree_leaves

from pipesim.choices import choose_from
from pipesim.profiles.workload import is_hf
from pipesim.units import float_text, number_allowed
from pipesim.workload import data
from pipesim.workload.moe import (
    BLOCK_NORM,
    CHECKPOINT_REGION,
    DEFAULT_TOP_K,
    ExpertExchange,
    ExpertShape,
    exchanged_experts,
    gated_mlp,
    gating_linear,
    routed_experts,
    routing,
    with_aux_loss,
)
from pipesim.workload.rope import rotated
from pipesim.workload.sizes import (
    DEFAULT_SIZES,
    HF_OPTIONS,
    capacity_factor_refusal,
    hf_options_refusal,
    model_name_refusal,
    size_refusal,
)

MAX_CNN_CHANNELS = 512
BATCH = -1  # in `Model.inputs`: the sample batch rather than a layer's output


class ModelError(ValueError):
    """A model that cannot be built or loaded; the message names the option or name at fault."""


@dataclass
class Model:
    """`make_batch(b, generator)` returns (the first layer's input, the loss target) for b training samples;
    `loss(output, target)` is the scalar the last layer's output feeds. `heldout()` gives (input, target) never
    trained on, which `score` rates after training, made only then: a model built to be counted never reads it, and
    the token task's at 131,072 tokens takes 3.8 CPU-s. `classifier` adds accuracy to the score."""

    name: str
    layers: list[nn.Module]
    make_batch: Callable[[int, torch.Generator], tuple[torch.Tensor, Any]]
    loss: Callable[[torch.Tensor, Any], torch.Tensor]
    inputs: list[tuple[int, ...]] = field(default_factory=list)
    options: dict[str, int] = field(default_factory=dict)
    heldout: Callable[[], tuple[torch.Tensor, Any]] | None = None
    classifier: bool = False

    def __post_init__(self) -> None:
        if not self.layers:
            raise ModelError(f"model {self.name!r} has no layers")
        bad = [type(layer).__name__ for layer in self.layers if not isinstance(layer, nn.Module)]
        if bad:
            raise ModelError(f"model {self.name!r}: layers must be torch.nn.Module, got {', '.join(bad)}")
        if not self.inputs:
            self.inputs = [(i - 1,) for i in range(len(self.layers))]  # a chain; layer 0 reads the batch
        for i, sources in enumerate(self.inputs):
            if not sources or any(not BATCH <= s < i for s in sources):
                raise ModelError(f"model {self.name!r}: layer {i} must read earlier layers or the batch, "
                                 f"got {sources}")

    def layer_names(self) -> list[str]:
        """Each layer's position and class, and where it says them its mixers (`MIXERS_ATTRIBUTE`: a hybrid's)."""
        mixers = [getattr(layer, MIXERS_ATTRIBUTE, "") for layer in self.layers]
        return [f"{i}:{type(layer).__name__}" + (f"[{said}]" if said else "")
                for i, (layer, said) in enumerate(zip(self.layers, mixers, strict=True))]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The whole model on a batch, its layers wired as `inputs` says."""
        return self.outputs(x)[len(self.layers) - 1]

    def outputs(self, x: torch.Tensor) -> dict[int, torch.Tensor]:
        """Every layer's output on batch `x`, by layer (`BATCH`: `x`), its layers wired as `inputs` says: the one
        walk of the model that its forward, the executor's output shapes (executor/stages.py `layer_outputs`) and
        the host's memory check (commands/common.py `host_memory_refusal`) take."""
        outputs = {BATCH: x}
        for i, (layer, reads) in enumerate(zip(self.layers, self.inputs)):
            outputs[i] = layer(*(outputs[s] for s in reads))
        return outputs

    def score(self, output: torch.Tensor, target: Any) -> dict[str, float]:
        """The loss and, for a classifier, the fraction of positions whose top class is the target."""
        output = output.detach()
        scores = {"loss": float(self.loss(output, target))}
        if self.classifier:
            scores["accuracy"] = float((output.argmax(-1) == target).float().mean())
        return scores


def tied_layers(layers: Sequence[nn.Module]) -> list[int]:
    """Per layer, the earlier layer whose parameters are all of its own (`LayerCount.tied_layer`: a tied head's are
    the embedding's, the one Parameter transformers gives both), else -1."""
    first: dict[int, int] = {}  # each parameter's first layer, by identity
    tied = []
    for i, layer in enumerate(layers):
        holders = {first.setdefault(id(weight), i) for weight in layer.parameters()}
        tied.append(holders.pop() if len(holders) == 1 and i not in holders else -1)
    return tied


def classification_loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Cross entropy in float32 whatever the model's dtype, over every leading position."""
    return F.cross_entropy(out.float().reshape(-1, out.shape[-1]), target.reshape(-1))


def _digit_images(b: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    features, labels = data.digit_batch(b, gen)
    return data.as_images(features), labels


def _heldout_images() -> tuple[torch.Tensor, torch.Tensor]:
    split = data.digits()
    return data.as_images(split.heldout_x), split.heldout_y


def check_positive(**values: int) -> None:
    """Each size given as its flag's name = value is from 1 to its `MAX_SIZES` bound, else ModelError naming the
    flag."""
    for name, value in values.items():
        check_size(name, value)


def check_size(name: str, value: int, least: int = 1) -> None:
    """The size `name` (its flag's name, a `MAX_SIZES` key) is from `least` to its bound, else ModelError naming
    the flag."""
    refusal = size_refusal(f"--{name.replace('_', '-')}", name, value, least)
    if refusal is not None:
        raise ModelError(refusal)


def _relu_linear(inputs: int, outputs: int) -> nn.Linear:
    """A linear layer initialised for a ReLU after it (He et al.): a deep stack then keeps its signal, so plain
    SGD trains the mlp at any depth (torch's default init shrinks it layer by layer). Not on the meta device, whose
    values are never read: its normal_ is a Python reference whose first call imports torch's compiler (torch._dynamo),
    1.8 s of `host_memory_refusal`'s check of the weights where no forward on the meta device follows (calibrate on a
    GPU; with a micro-batch, the forward's addmm there imports it all the same)."""
    layer = nn.Linear(inputs, outputs)
    if not layer.weight.is_meta:
        nn.init.kaiming_normal_(layer.weight, nonlinearity="relu")
        nn.init.zeros_(layer.bias)
    return layer


def mlp(layers: int = DEFAULT_SIZES["mlp"]["layers"], width: int = DEFAULT_SIZES["mlp"]["width"]) -> Model:
    """`layers` Linear+ReLU blocks of `width` (the first reads the 64 digit pixels), then a 10-way
    classifier; trains on digits."""
    check_positive(layers=layers, width=width)
    features = data.DIGIT_SIDE ** 2
    blocks: list[nn.Module] = [nn.Sequential(_relu_linear(width if i else features, width), nn.ReLU())
                               for i in range(layers)]
    blocks.append(nn.Linear(width, data.DIGIT_CLASSES))
    split = data.digits()
    return Model("mlp", blocks, data.digit_batch, classification_loss,
                 heldout=lambda: (split.heldout_x, split.heldout_y), classifier=True)


def cnn(layers: int = DEFAULT_SIZES["cnn"]["layers"], width: int = DEFAULT_SIZES["cnn"]["width"]) -> Model:
    """VGG-style for 32x32 images: 3x3 conv+ReLU layers, channels doubling (up to 512, as VGG's) and a
    2x2 max-pool after every second one (down to 1x1), then a 10-way linear classifier; trains on digits
    upsampled to 32x32 and repeated to 3 channels."""
    check_positive(layers=layers, width=width)
    blocks: list[nn.Module] = []
    channels, side = 3, 32
    for i in range(layers):
        out = min(width * 2 ** (i // 2), max(width, MAX_CNN_CHANNELS))  # VGG stops doubling at 512
        parts: list[nn.Module] = [nn.Conv2d(channels, out, 3, padding=1), nn.ReLU()]
        if i % 2 == 1 and side > 1:
            parts.append(nn.MaxPool2d(2))
            side //= 2
        blocks.append(nn.Sequential(*parts))
        channels = out
    blocks.append(nn.Sequential(nn.Flatten(), nn.Linear(channels * side * side, data.DIGIT_CLASSES)))
    return Model("cnn", blocks, _digit_images, classification_loss, heldout=_heldout_images, classifier=True)


class _Embed(nn.Module):
    """The tokens' embedding, plus a learned one of their positions unless the blocks rotate q and k (`rotary`)."""

    def __init__(self, vocab: int, width: int, seq_len: int, rotary: bool = False) -> None:
        super().__init__()
        self.tokens = nn.Embedding(vocab, width)
        self.positions = None if rotary else nn.Embedding(seq_len, width)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        embedded = self.tokens(ids)
        if self.positions is None:
            return embedded
        return embedded + self.positions(torch.arange(ids.shape[1], device=ids.device))


ROPE_BASE = 10_000.0  # RoFormer's angle base (Su et al. 2021, arXiv 2104.09864): the angles' values cost nothing


def apply_rotary_pos_emb(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                         unsqueeze_dim: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """q and k rotated over cos's last dimension, the rest of each head passed through, in transformers' form and
    ops (Llama's `q * cos + rotate_half(q) * sin`, Megatron-core's unfused `apply_rotary_pos_emb_bshd` with its
    partial rotary); `--rope-kernel fused` runs it as TransformerEngine's kernel (workload/rope.py `fused_rope`)."""
    cos, sin = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)
    return rotated(q, cos, sin), rotated(k, cos, sin)


def rotary_angles(seq_len: int, rotary: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The cosines and sines, (seq_len, rotary), of each position's angles over `rotary` features of a head:
    frequency base^(-2i/rotary) for pair i, each repeated over both halves as transformers' and Megatron-core's
    RotaryEmbedding lay them out (`torch.cat((freqs, freqs), dim=-1)`)."""
    frequencies = ROPE_BASE ** -(torch.arange(0, rotary, 2, dtype=torch.float32) / rotary)
    angles = torch.outer(torch.arange(seq_len, dtype=torch.float32), frequencies)
    angles = torch.cat((angles, angles), dim=-1)
    return angles.cos(), angles.sin()


class _GatedMLP(nn.Module):
    """SwiGLU (Shazeer 2020, as Llama's MLP): down(silu(gate(x)) * up(x)), gate and up as one matrix product
    (Megatron-core's fc1), run as `workload.moe.gated_mlp` (one fused kernel under --swiglu-fusion)."""

    def __init__(self, width: int, ffn: int, bias: bool = True) -> None:
        super().__init__()
        self.gate_up = nn.Linear(width, 2 * ffn, bias=bias)
        self.down = nn.Linear(ffn, width, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return gated_mlp(self.down, F.silu, *self.gate_up(x).chunk(2, dim=-1))


def _mlp(width: int, ffn: int, gated: bool, bias: bool = True) -> nn.Module:
    """The gpt's dense MLP: SwiGLU if `gated`, else GELU; its linear layers with biases if `bias`."""
    if gated:
        return _GatedMLP(width, ffn, bias)
    return nn.Sequential(nn.Linear(width, ffn, bias=bias), nn.GELU(), nn.Linear(ffn, width, bias=bias))


NORMS = ("layernorm", "rmsnorm")  # the gpt's --norm: torch's LayerNorm (GPT-3's), torch's RMSNorm (Llama's)


def _norm(kind: str, width: int) -> nn.Module:
    """The gpt's norm of `kind` (of `NORMS`) over `width` features, with a learned scale (and LayerNorm's shift)."""
    return nn.RMSNorm(width) if kind == "rmsnorm" else nn.LayerNorm(width)


def _swiglu(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


class _ExpertsMLP(nn.Module):
    """A mixture of experts in place of the MLP: a router (a product to one score per routed expert, softmax in
    float32, the top k kept and their weights renormalised to sum to 1, as Mixtral's), the routed experts
    (`workload.moe.routed_experts`), each an MLP as the dense one without biases (as Mixtral's and DeepSeek's), and
    the shared experts, one MLP of shared·ffn that every token passes (DeepSeekMoE's). The router's product is a
    gating product (`gating_linear`), as Megatron-core's TopKRouter computes it: no TransformerEngine module, so
    never in float8."""

    def __init__(self, width: int, shape: ExpertShape, gated: bool, bias: bool = True) -> None:
        super().__init__()
        self.top_k, self.capacity_factor, self.gated = shape.top_k, shape.capacity_factor, gated
        self.router = nn.Linear(width, shape.routed, bias=False)
        inner = 2 * shape.ffn if gated else shape.ffn
        self.up = nn.Parameter(torch.empty(shape.routed, width, inner).uniform_(-width ** -0.5, width ** -0.5))
        self.down = nn.Parameter(torch.empty(shape.routed, shape.ffn, width).uniform_(-shape.ffn ** -0.5,
                                                                                      shape.ffn ** -0.5))
        self.shared = _mlp(width, shape.shared * shape.ffn, gated, bias) if shape.shared else None
        self.exchange: ExpertExchange | None = None

    def place(self, exchange: ExpertExchange) -> None:
        """Keep only the routed experts `exchange`'s rank holds (`up` and `down` become their slices) and route the
        tokens to the others' ranks through it (`workload.moe.exchanged_experts`)."""
        routed = self.up.shape[0]
        if routed % exchange.ranks:
            raise ModelError(f"--expert-parallel {exchange.ranks} does not divide the model's {routed} routed experts")
        held = slice(exchange.rank * routed // exchange.ranks, (exchange.rank + 1) * routed // exchange.ranks)
        self.up = nn.Parameter(self.up.detach()[held].clone())
        self.down = nn.Parameter(self.down.detach()[held].clone())
        self.exchange = exchange

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        with routing():  # the load-balancing loss where the count asks for it
            scores = with_aux_loss(gating_linear(flat, self.router.weight, flat.dtype))
        weights, index = scores.float().softmax(-1).topk(self.top_k, dim=-1)
        weights = weights / weights.sum(-1, keepdim=True)
        activation = _swiglu if self.gated else F.gelu
        if self.exchange is None:
            routed = routed_experts(flat, index, weights, self.up, self.down, activation, self.capacity_factor,
                                    self.gated)
        else:
            routed = exchanged_experts(flat, index, weights, self.up, self.down, activation, self.exchange,
                                       self.capacity_factor)
        routed = routed.view(x.shape)
        return routed if self.shared is None else routed + self.shared(x)


ROUTED_PARAMETERS = ("up", "down")  # an `_ExpertsMLP`'s parameters that hold one slice per routed expert


def routed_parameters(module: nn.Module) -> list[str]:
    """The names (as `named_parameters` gives them) of `module`'s routed experts' weights, which expert
    parallelism shards: the rest is dense, alike on every rank."""
    return [f"{name}.{part}" if name else part for name, sub in module.named_modules()
            if isinstance(sub, _ExpertsMLP) for part in ROUTED_PARAMETERS]


def routed_experts_of(module: nn.Module) -> int | None:
    """How many routed experts each of `module`'s built-in mixture-of-experts layers (`_ExpertsMLP`, which
    `place_experts` places) has (None: it has none). A model's routed experts, a Hugging Face config's too, are its
    `experts` option (`Model.options`), which the estimate and calibrate read."""
    return next((sub.up.shape[0] for sub in module.modules() if isinstance(sub, _ExpertsMLP)), None)


def place_experts(module: nn.Module, exchange: ExpertExchange) -> None:
    """Every mixture-of-experts layer of `module` keeps the experts `exchange`'s rank holds (`_ExpertsMLP.place`)."""
    for sub in module.modules():
        if isinstance(sub, _ExpertsMLP):
            sub.place(exchange)


class _Block(nn.Module):
    """Pre-norm decoder block: causal self-attention, then an MLP of `ffn` (GELU, or SwiGLU if `gated`), each after a
    norm of kind `norm` (`_norm`) and with a residual, its linear layers with biases if `bias`. With `kv_heads` <
    `heads`, groups of query heads share a key and value head (grouped-query attention, as Llama 2 70B), handed to
    the attention as they are (`enable_gqa`): a flash kernel reads each key and value head for its whole group, as
    Megatron-core's TransformerEngine attention and flash-attn do (`num_gqa_groups`), so only the fewer heads are
    saved; the math path repeats them. With `experts`, the MLP is a mixture of experts (`_ExpertsMLP`); either marked
    as its plain checkpoint's region (`CHECKPOINT_REGION`: Megatron-core's "mlp" or "moe"), its norms as its own
    (`BLOCK_NORM`). With `rotary` features of each head (of `seq_len` positions), q and k are rotated by their
    positions' angles before the attention (`apply_rotary_pos_emb`)."""

    def __init__(self, width: int, heads: int, ffn: int, kv_heads: int, gated: bool, dropout: float = 0.0,
                 experts: ExpertShape | None = None, rotary: int = 0, seq_len: int = 0, bias: bool = True,
                 norm: str = "layernorm") -> None:
        super().__init__()
        self.heads, self.kv_heads, self.dropout, self.rotary = heads, kv_heads, dropout, rotary
        if rotary:
            cos, sin = rotary_angles(seq_len, rotary)
            self.register_buffer("cos", cos, persistent=False)
            self.register_buffer("sin", sin, persistent=False)
        self.drop = nn.Dropout(dropout) if dropout else nn.Identity()
        self.norm1, self.norm2 = _norm(norm, width), _norm(norm, width)
        self.qkv = nn.Linear(width, width + 2 * kv_heads * (width // heads), bias=bias)
        self.proj = nn.Linear(width, width, bias=bias)
        self.mlp = _mlp(width, ffn, gated, bias) if experts is None else _ExpertsMLP(width, experts, gated, bias)
        setattr(self.mlp, CHECKPOINT_REGION, "mlp" if experts is None else "moe")
        for own in (self.norm1, self.norm2):
            setattr(own, BLOCK_NORM, True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        head = d // self.heads
        q, k, v = self.qkv(self.norm1(x)).split([d, self.kv_heads * head, self.kv_heads * head], dim=-1)
        q = q.view(b, t, self.heads, head)
        k, v = (part.view(b, t, self.kv_heads, head) for part in (k, v))
        if self.rotary:  # token-major, as Megatron-core rotates its [s, b, heads, head] q and k
            q, k = apply_rotary_pos_emb(q, k, self.cos[None, :t], self.sin[None, :t], unsqueeze_dim=2)
        q, k, v = (part.transpose(1, 2) for part in (q, k, v))
        attended = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=self.kv_heads < self.heads,
                                                  dropout_p=self.dropout if self.training else 0.0)
        x = x + self.drop(self.proj(attended.transpose(1, 2).reshape(b, t, d)))
        return x + self.drop(self.mlp(self.norm2(x)))


GPT_SIZES = DEFAULT_SIZES["gpt"]
# The attribute a hybrid model's layer says its mixers by, in Megatron-core's hybrid pattern (M a Mamba-2 mixer, * an
# attention, - an MLP, E a mixture of experts: hybrid_override_pattern), which its name carries in brackets
# (`Model.layer_names`: 1:DecoderLayer[M]); a pipeline cut by blocks reads the name before them (planning/scenario.py)
MIXERS_ATTRIBUTE = "mixers"
# The attribute that marks a layer no pipeline stage may start at: it reads what the layer before it left beside the
# residual stream (a sparse attention reusing the top k an earlier layer's indexer kept: workload/hf.py
# `TopKHandoff`), which no stage boundary passes on (profiles/partition.py `starts_refusal`)
FOLLOWS_PREVIOUS = "follows_previous"


def gpt(layers: int = GPT_SIZES["layers"], width: int = GPT_SIZES["width"], heads: int = GPT_SIZES["heads"],
        seq_len: int = GPT_SIZES["seq_len"], vocab: int = GPT_SIZES["vocab"],
        ffn: int | None = None, kv_heads: int | None = None, gated: bool = False,
        dropout: float | None = None, experts: int | None = None, top_k: int | None = None,
        shared_experts: int | None = None, expert_ffn: int | None = None,
        capacity_factor: float | None = None, rotary_percent: float | None = None, linear_bias: bool | None = None,
        norm: str | None = None) -> Model:
    """GPT-style decoder: token+position embedding, `layers` blocks, a norm and a vocabulary head;
    next-token cross entropy on the token task of `workload.data` (a fixed successor rule with 10 % noise;
    its loss floor is `data.token_loss_floor(vocab)`). `ffn` is the MLP's hidden size (default 4 x width, as
    GPT-3), `kv_heads` the key/value heads (default `heads`; fewer is grouped-query attention), `gated` a
    SwiGLU MLP (Llama's), so that published GPT-3- and Llama-style shapes can be described. `dropout` (None:
    none) is Megatron-LM's in each block: on the attention's probabilities and on each residual branch before
    its add, so that a count holds the work and memory of the published runs' dropouts. `experts` routed experts
    make every block's MLP a mixture of experts (`_ExpertsMLP`): each token goes to `top_k` of them (default
    `DEFAULT_TOP_K`), each an MLP of `expert_ffn` (default `ffn`), besides `shared_experts` that every token passes
    (default none); `capacity_factor` drops an expert's tokens past its capacity and pads it to it (default: drops
    none). `rotary_percent` (None: positions learned, as GPT-3's) rotates q and k over that share of each head's
    features instead (RoPE, Su et al. 2021: Llama's 1.0, Nemotron-4's 0.5; Megatron-LM's
    `--position-embedding-type rope --rotary-percent`, its rotary dimensions int(head x share), an even number).
    `linear_bias` False drops the blocks' linear layers' biases (None: kept, as GPT-3's; Llama's and Nemotron-4's
    have none: Megatron-LM's `--disable-bias-linear`, NeMo's `bias: false`); the head has none either way, as
    Megatron-LM's output layer (megatron/core/models/gpt/gpt_model.py at d98e8a64: ColumnParallelLinear(...,
    bias=False); the legacy model's `parallel_lm_logits` a product with the embedding's weight, no bias), `norm`
    is every norm's kind, of `NORMS` (None: layernorm, GPT-3's; rmsnorm, Llama's: Megatron-LM's
    `--normalization RMSNorm`, NeMo's `normalization: rmsnorm`; Nemotron-4's layernorm1p is a LayerNorm whose scale
    is stored less one, the same kernel)."""
    ffn = 4 * width if ffn is None else ffn
    kv_heads = heads if kv_heads is None else kv_heads
    check_positive(layers=layers, width=width, heads=heads, seq_len=seq_len, vocab=vocab, ffn=ffn, kv_heads=kv_heads)
    moe = _expert_shape(ffn, experts, top_k, shared_experts, expert_ffn, capacity_factor)  # its ffn checked first
    if dropout is not None and not 0 <= dropout < 1:
        allowed = number_allowed(0, 1, whole=False, finite=True, below=True)
        raise ModelError(f"--dropout: {allowed} (got {float_text(float(dropout))})")
    if width % heads:
        raise ModelError(f"--width: give a multiple of --heads {heads:,} (got {width:,})")
    if heads % kv_heads:
        raise ModelError(f"--heads: give a multiple of --kv-heads {kv_heads:,} (got {heads:,})")
    norm = "layernorm" if norm is None else norm
    if norm not in NORMS:
        raise ModelError(choose_from("--norm", NORMS, norm))
    if norm == "rmsnorm" and not hasattr(nn, "RMSNorm"):
        raise ModelError("--norm rmsnorm builds torch.nn.RMSNorm: it needs torch 2.4 or later")
    bias = linear_bias is not False
    rotary = 0 if rotary_percent is None else _rotary_features(width // heads, rotary_percent)
    blocks: list[nn.Module] = [_Embed(vocab, width, seq_len, bool(rotary))]
    blocks += [_Block(width, heads, ffn, kv_heads, gated, dropout or 0.0, moe, rotary, seq_len, bias, norm)
               for _ in range(layers)]
    # named, so that the count sees its norm as one (workload/count.py `_module_part`) whichever kind it is
    blocks.append(nn.Sequential(OrderedDict(norm=_norm(norm, width), head=nn.Linear(width, vocab, bias=False))))

    def make(b: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        return data.token_batch(b, seq_len, vocab, gen)
    return Model("gpt", blocks, make, classification_loss, heldout=partial(data.token_heldout, seq_len, vocab),
                 classifier=True)


def _rotary_features(head: int, share: float) -> int:
    """The features of a `head`-wide head that RoPE rotates at `share` (Megatron-core's int(kv_channels x
    rotary_percent)), refused unless a positive even number."""
    if not 0 < share <= 1:
        allowed = number_allowed(0, 1, whole=False, finite=True, above=True)
        raise ModelError(f"--rotary-percent: {allowed} (got {float_text(float(share))})")
    rotary = int(head * share)
    if rotary < 2 or rotary % 2:
        raise ModelError(f"--rotary-percent {share} rotates {rotary} of a head's {head} features: RoPE turns pairs, "
                         "so it must be a positive even number")
    return rotary


def _expert_shape(ffn: int, experts: int | None, top_k: int | None, shared: int | None, expert_ffn: int | None,
                  capacity_factor: float | None) -> ExpertShape | None:
    """The gpt's mixture of experts from its flags (None without --experts, which the others need)."""
    if experts is None:
        given = [name for name, value in (("top-k", top_k), ("shared-experts", shared), ("expert-ffn", expert_ffn),
                                          ("capacity-factor", capacity_factor)) if value is not None]
        if given:
            raise ModelError(f"--{given[0]} applies to a mixture of experts: give --experts too")
        return None
    shape = ExpertShape(experts, DEFAULT_TOP_K if top_k is None else top_k, ffn if expert_ffn is None else expert_ffn,
                        shared or 0, capacity_factor)
    check_positive(experts=experts, top_k=shape.top_k, expert_ffn=shape.ffn)
    if shape.top_k > experts:
        raise ModelError(f"--top-k: give at most --experts {experts:,} (got {shape.top_k:,})")
    check_size("shared_experts", shape.shared, least=0)
    check_capacity_factor(capacity_factor, experts, shape.top_k)
    return shape


def check_capacity_factor(capacity_factor: float | None, experts: int, top_k: int | None) -> None:
    """Refuse a capacity factor C that gives an expert no capacity of ⌈C·k·T/E⌉ tokens (workload/moe.py
    `expected_tokens`): C is a finite number above 0 (None: the experts drop nothing), and at most E/k, since an
    expert padded past the T tokens of a micro-batch cannot run in Megatron-core (moe_utils.py
    `apply_router_token_dropping` then routes every token to every expert, T each, while the alltoall
    dispatcher's `preprocess` sizes each expert's buffer and its grouped products at `get_capacity`'s ⌈C·k·T/E⌉,
    uncapped: the buffers do not match the tokens). `top_k` None: a config without one, checked for C only."""
    if (refusal := capacity_factor_refusal(capacity_factor)) is not None:
        raise ModelError(refusal)
    if capacity_factor is not None and top_k and capacity_factor * top_k > experts:
        raise ModelError(f"--capacity-factor {capacity_factor:g} pads each expert past the micro-batch's tokens "
                         f"(C·k/E = {capacity_factor:g}·{top_k}/{experts} > 1), which Megatron-core cannot run: give "
                         f"at most E/k = {experts / top_k:g}")


class _Merge(nn.Module):
    """Concatenates the two branches' channels, then pools and classifies."""

    def __init__(self, channels: int, classes: int) -> None:
        super().__init__()
        self.mix = nn.Sequential(nn.Conv2d(channels, channels, 1), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten())
        self.classify = nn.Linear(channels, classes)

    def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return self.classify(self.mix(torch.cat([a, b], dim=1)))


def two_branch(layers: int = DEFAULT_SIZES["two-branch"]["layers"],
               width: int = DEFAULT_SIZES["two-branch"]["width"]) -> Model:
    """A stem, two branches of `layers` conv layers each (3x3 convs of `width` channels; 5x5 convs of
    half as many), and a head that merges them: GraphPipe's case, branches that can run side by side.
    Layers are stem, branch a, branch b, head; `inputs` holds the DAG. Trains on digits as the cnn does."""
    check_positive(layers=layers, width=width)
    narrow = max(1, width // 2)
    stem = nn.Sequential(nn.Conv2d(3, width, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2))
    first = [nn.Sequential(nn.Conv2d(width, width, 3, padding=1), nn.ReLU()) for _ in range(layers)]
    second = [nn.Sequential(nn.Conv2d(width if i == 0 else narrow, narrow, 5, padding=2), nn.ReLU())
              for i in range(layers)]
    a = list(range(1, 1 + layers))
    b = list(range(1 + layers, 1 + 2 * layers))
    inputs = [(BATCH,), *[(i - 1,) for i in a], (0,), *[(i - 1,) for i in b[1:]], (a[-1], b[-1])]
    return Model("two-branch", [stem, *first, *second, _Merge(width + narrow, data.DIGIT_CLASSES)], _digit_images,
                 classification_loss, inputs, heldout=_heldout_images, classifier=True)


MODELS: dict[str, Callable[..., Model]] = {"mlp": mlp, "cnn": cnn, "gpt": gpt, "two-branch": two_branch}
DIGITS_MODELS = frozenset({"mlp", "cnn", "two-branch"})  # their data is scikit-learn's digits (an optional extra)


def model_options(name: str) -> list[str]:
    """The size options (`layers`, `width`, ...) a built-in model takes; none for bring-your-own."""
    return list(inspect.signature(MODELS[name]).parameters) if name in MODELS else []


def rebuilt_options(name: str, options: dict[str, Any]) -> dict[str, Any]:
    """The options a profile's model, recorded as `name` with `options` (its `Model.options`, which describe it), is
    built again with: a Hugging Face config's those `build_model` takes of it (`HF_OPTIONS`), the config giving its
    sizes."""
    return {key: value for key, value in options.items() if not is_hf(name) or key in HF_OPTIONS}


def build_model(name: str, **options: int) -> Model:
    """A built-in model by name, a Hugging Face config (`hf:PATH`, workload/hf.py) or bring-your-own
    `package.module:attribute`. `options` are the size options the user gave (None values are left at the
    model's defaults)."""
    given = {key: value for key, value in options.items() if value is not None}
    if is_hf(name):
        if (refusal := hf_options_refusal(name, given)) is not None:
            raise ModelError(refusal)
        from .hf import hf_model

        return hf_model(name, given.get("seq_len"), given.get("mtp_layers", 0), given.get("capacity_factor"))
    if ":" in name:
        if given:
            raise ModelError(f"--{next(iter(given)).replace('_', '-')} applies to the built-in models only; "
                             f"{name} is built by its own code")
        return load_model(name)
    if (refusal := model_name_refusal(name)) is not None:
        raise ModelError(refusal)
    takes = model_options(name)
    wrong = [key for key in given if key not in takes]
    if wrong:
        allowed = ", ".join(f"--{key.replace('_', '-')}" for key in takes)
        raise ModelError(f"--{wrong[0].replace('_', '-')} does not apply to {name} (it takes {allowed})")
    model = MODELS[name](**given)
    defaults = {key: param.default for key, param in inspect.signature(MODELS[name]).parameters.items()
                if param.default is not None}  # a None default is derived from the others (gpt's ffn, kv_heads)
    model.options = {**defaults, **given}
    return model


def load_model(spec: str) -> Model:
    """Bring-your-own: `package.module:attribute` naming a Model, a torch.nn.Sequential, a list of modules,
    any torch.nn.Module with an example input as `(module, example)`, or a zero-argument callable returning one
    of them. The current folder is importable, as for `python -m`. A Sequential or list gets a sample batch
    inferred from its first layer, and a mean-square loss, since nothing else is known about it; a module with
    its example is cut as `module_model` says."""
    module_name, _, attribute = spec.partition(":")
    if not module_name or not attribute:
        raise ModelError(f"--model {spec!r}: give package.module:attribute")
    cwd = os.getcwd()
    sys.path.insert(0, cwd)
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:  # an import runs arbitrary code: report whatever it raised, in one line
        where = (f" (looked in the current folder, {cwd}, and the installed packages)"
                 if isinstance(exc, ModuleNotFoundError) and exc.name == module_name.split(".")[0] else "")
        raise ModelError(f"--model {spec}: cannot import {module_name}: {type(exc).__name__}: "
                         f"{(str(exc).splitlines() or [''])[0]}{where}") from None
    finally:
        sys.path.remove(cwd)
    try:
        value = getattr(module, attribute)
    except AttributeError:
        raise ModelError(f"--model {spec}: module {module_name} has no attribute {attribute!r}") from None
    if callable(value) and not isinstance(value, (nn.Module, Model)):
        try:
            value = value()
        except Exception as exc:
            raise ModelError(f"--model {spec}: calling {attribute}() failed: {type(exc).__name__}: "
                             f"{(str(exc).splitlines() or [''])[0]}") from None
    if isinstance(value, Model):
        return value
    if isinstance(value, tuple) and len(value) == 2 and isinstance(value[0], nn.Module) and torch.is_tensor(value[1]):
        return module_model(spec, *value)
    if not isinstance(value, (nn.Sequential, list, tuple)):
        raise ModelError(f"--model {spec}: expected a torch.nn.Sequential, a list of modules, (a torch.nn.Module, "
                         f"an example input) or a pipesim Model, got {type(value).__name__}")
    if not len(value):
        raise ModelError(f"--model {spec}: has no layers")
    layers = list(value)
    return Model(spec, layers, _infer_batch(spec, layers[0]), _mean_square)


def _mean_square(out: torch.Tensor, target: Any) -> torch.Tensor:
    return out.float().square().mean()


class WholeModule(nn.Module):
    """A module counted as one layer, its output the first floating-point tensor it returns (a transformers
    model's logits or last hidden state), which the loss reads."""

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self.module = module

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.module(x)
        floats = [t for t in tree_leaves(out) if torch.is_tensor(t) and t.is_floating_point()]
        if not floats:
            raise ModelError(f"{type(self.module).__name__} returned no floating-point tensor for a loss to read")
        return floats[0]


def module_model(name: str, module: nn.Module, example: torch.Tensor) -> Model:
    """Any module with an example input, whose first dimension is the batch (a micro-batch of b samples repeats
    its first sample). A pipeline can cut what it knows the order of: a transformers causal language model into
    its embedding, decoder layers, final norm and head (workload/hf.py), a Sequential into its layers; any other
    module is one layer."""
    from .hf import decoder_layers

    if example.dim() == 0:
        raise ModelError(f"--model {name}: the example input needs the batch as its first dimension")
    if isinstance(module, nn.Sequential) and len(module):
        layers = list(module)
    else:
        try:
            layers = decoder_layers(module, f"--model {name}")
        except ModelError:
            layers = [WholeModule(module)]

    def make(b: int, gen: torch.Generator) -> tuple[torch.Tensor, None]:
        return example[:1].expand(b, *example.shape[1:]).clone(), None
    return Model(name, layers, make, _mean_square)


def _infer_batch(spec: str, first: Any) -> Callable[[int, torch.Generator], tuple[torch.Tensor, None]]:
    """A random input the first layer accepts: features for Linear, 32x32 images for Conv2d, 128 token ids
    for Embedding."""
    if isinstance(first, nn.Sequential) and len(first):
        return _infer_batch(spec, first[0])
    if isinstance(first, nn.Linear):
        return lambda b, gen: (torch.randn(b, first.in_features, generator=gen), None)
    if isinstance(first, nn.Conv2d):
        return lambda b, gen: (torch.randn(b, first.in_channels, 32, 32, generator=gen), None)
    if isinstance(first, nn.Embedding):
        return lambda b, gen: (torch.randint(0, first.num_embeddings, (b, 128), generator=gen), None)
    raise ModelError(f"--model {spec}: cannot tell what input its first layer ({type(first).__name__}) takes; "
                     "start with Linear, Conv2d or Embedding, give (the module, an example input), or return a "
                     "pipesim.workload.models.Model")
