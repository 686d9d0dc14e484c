"""Every Hugging Face model's attention is counted one way (workload/hf.py `counted_attention`): a causal kernel,
with the layer's sliding window, whether transformers' class offers sdpa (Mistral, Qwen2, Gemma 3) or not (Gemma 2,
whose soft-capped scores FlashAttention-2 computes in the kernel)."""

from __future__ import annotations

import pytest
import torch

from pipesim.planning.estimate import kernel_flops, window_tile_pairs
from pipesim.workload.count import count_built
from pipesim.workload.hf import hf_model
from tests.conftest import needs_transformers, pipesim
from tests.helpers import write_config

pytestmark = needs_transformers

HEADS, HEAD, WINDOW = 4, 16, 16
SMALL = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": HEADS,
         "num_key_value_heads": 2, "head_dim": HEAD, "vocab_size": 256, "max_position_embeddings": 256,
         "sliding_window": WINDOW}
# each model's layers, windowed first: Gemma 2 alternates local and global from its first layer, Qwen2 windows the
# layers from max_window_layers on, Mistral every layer
MODELS = {"gemma2": ({"attn_logit_softcapping": 50.0}, (WINDOW, 0)),
          "gemma3_text": ({"layer_types": ["sliding_attention", "full_attention"]}, (WINDOW, 0)),
          "qwen2": ({"use_sliding_window": True, "max_window_layers": 1}, (0, WINDOW)),
          "mistral": ({}, (WINDOW, WINDOW))}


def _forward_kernels(tmp_path, model_type: str, seq_len: int, attention: str = "flash") -> list[list]:
    fields, _ = MODELS[model_type]
    folder = write_config(tmp_path / model_type, {**SMALL, "model_type": model_type, **fields})
    counted = count_built(f"hf:{folder}", {"seq_len": seq_len}, 1, torch.bfloat16, attention)
    return [[op for op in layer.ops["fwd"] if op.kind == "attention" or op.op == "bmm"]
            for layer in counted.layers[1:3]]


@pytest.mark.parametrize("model_type", sorted(MODELS))
def test_a_layer_past_its_window_records_it_and_within_it_the_causal_kernel(tmp_path, model_type):
    """At s > w a windowed layer's forward kernel records its window (torch's count: the whole s x s, 4·head FLOPs a
    pair), priced at the causal kernel's share of the tiles its band touches (`window_tile_pairs`: at s = 64 in
    FlashAttention-2's 128 x 128 tiles, the one tile, half the square, where the band holds s·w - w(w-1)/2 pairs),
    a global layer half the s x s square; at s <= w both compute half of it."""
    s = 64
    for kernels, window in zip(_forward_kernels(tmp_path, model_type, s), MODELS[model_type][1]):
        (kernel,) = kernels
        assert kernel.causal and kernel.window == window and kernel.flops == 4 * HEADS * HEAD * s * s
        share = window_tile_pairs(s, s, window, (128, 128)) / window_tile_pairs(s, s, s, (128, 128)) if window else 1
        assert share == 1 and kernel_flops(kernel) == pytest.approx(4 * HEADS * HEAD * s * s / 2 * share)
    for (kernel,) in _forward_kernels(tmp_path / "short", model_type, WINDOW):
        assert kernel.causal and kernel_flops(kernel) == pytest.approx(4 * HEADS * HEAD * WINDOW * WINDOW / 2)


def test_mfus_numerator_counts_a_windowed_attention_at_its_window(tmp_path):
    """MFU's numerator (`LayerCount.model_flops`) counts a full attention's every key, as torch's count does; under a
    sliding window of w keys it counts w a query: a Mistral-like model of a 128-key window at 131,072 tokens was
    counted at the whole square and its MFU read 121 %. Mistral's two windowed layers at s = 4w take a quarter of
    their attention kernels' FLOPs, forward and backward; the rest is as counted."""
    s = 4 * WINDOW
    folder = write_config(tmp_path / "mistral", {**SMALL, "model_type": "mistral"})
    counted = count_built(f"hf:{folder}", {"seq_len": s}, 1, torch.bfloat16, "flash")
    for layer in counted.layers[1:3]:
        kernels = [op for name in ("fwd", "bwd") for op in layer.ops[name] if op.kind == "attention"]
        assert len(kernels) == 2 and all(op.window == WINDOW for op in kernels)
        whole = sum(op.flops * op.count for op in kernels)
        forward, backward = (op.flops * op.count for op in kernels)
        recomputed = (backward - 2 * forward) * WINDOW / s  # the backward's recomputed scores, at the window too
        counted_flops = layer.fwd_flops + layer.igrad_flops + layer.wgrad_flops
        assert layer.model_flops == round(counted_flops - whole * (1 - WINDOW / s) - recomputed) < counted_flops


def test_mfus_numerator_is_the_same_whatever_the_attention_kernel(tmp_path):
    """A fused kernel's backward recomputes the scores, which torch counts as a fifth product: Llama 3.1 8B's MFU at
    131,072 tokens read 47.9 % with FlashAttention where the model's FLOPs give 42.1 %. MFU's numerator counts the
    model's products, not a kernel's: a layer of a full attention counted fused and unfused has the same."""
    folder = write_config(tmp_path / "llama", {**SMALL, "model_type": "llama"})
    fused, unfused = (count_built(f"hf:{folder}", {"seq_len": 64}, 1, torch.bfloat16, kernel)
                      for kernel in ("flash", "math"))
    for layer, same in zip(fused.layers, unfused.layers):
        assert layer.model_flops == same.model_flops, layer.name
    assert sum(layer.fwd_flops + layer.igrad_flops + layer.wgrad_flops for layer in fused.layers) > sum(
        layer.model_flops for layer in fused.layers)  # as torch counts the fused kernel: more


def test_gemma2s_unfused_attention_computes_the_whole_square_and_caps_it(tmp_path):
    """Counted unfused ("math"), Gemma 2's attention is its own eager code, as Megatron-Bridge runs it: both
    products over the whole s x s square, whatever the window, and the capping's tanh on the scores."""
    folder = write_config(tmp_path / "gemma2", {**SMALL, "model_type": "gemma2", **MODELS["gemma2"][0]})
    counted = count_built(f"hf:{folder}", {"seq_len": 64}, 1, torch.bfloat16, "math")
    for layer in counted.layers[1:3]:
        products = [op for op in layer.ops["fwd"] if op.op == "bmm"]
        assert sum(op.count * op.flops for op in products) == 2 * 2 * HEADS * 64 * 64 * HEAD
        assert any(op.op == "tanh" and op.shape == (1, HEADS, 64, 64) for op in layer.ops["fwd"])


def test_gemma2s_unfused_attention_is_causal(tmp_path):
    """Handed no mask, Gemma 2's eager attention attended each token to the later ones too: off the meta device (run
    and calibrate trained and timed that model) and in the count (no mask's add over the scores, which torch's
    unfused sdpa counts for every other model). It is handed the causal mask the fused kernel applies."""
    folder = write_config(tmp_path / "gemma2", {**SMALL, "model_type": "gemma2", **MODELS["gemma2"][0]})
    layer = hf_model(f"hf:{folder}", 8).layers[1]
    hidden = torch.randn(1, 8, SMALL["hidden_size"], generator=torch.Generator().manual_seed(0))
    later = hidden.clone()
    later[:, -1] += 1  # the last token changed: no earlier one's output may change
    assert torch.allclose(layer(hidden)[:, :-1], layer(later)[:, :-1])
    counted = count_built(f"hf:{folder}", {"seq_len": 64}, 1, torch.bfloat16, "math")
    assert any(op.op == "add" and op.shape == (1, HEADS, 64, 64) for op in counted.layers[1].ops["fwd"])


@pytest.mark.parametrize("given", [{"position_bias": torch.zeros(1, HEADS, 8, 8)},
                                   {"indices": torch.zeros(1, 8, 4, dtype=torch.long)}])
def test_an_attention_the_kernels_do_not_compute_is_refused_in_one_line(given):
    """A score bias (Inkling 2's) or a sparse attention's picked keys (HY-V4's) would be counted as the dense causal
    kernel: refused, naming what the layer hands its attention."""
    from pipesim.workload.hf import counted_attention
    from pipesim.workload.models import ModelError

    query = torch.zeros(1, HEADS, 8, HEAD, device="meta")
    with pytest.raises(ModelError, match=r"^--model: Linear hands its attention (a position bias|the keys its sparse)"):
        counted_attention(torch.nn.Linear(1, 1), query, query, query, None, **given)


def test_gemma2s_fused_kernels_carry_the_soft_capping_and_cudnn_refuses_them(tmp_path):
    """Counted fused, Gemma 2's kernels, forward and backward, are marked as capping their scores (Mistral's are
    not); cuDNN's fused attention caps only through TransformerEngine's experimental score_mod, which takes no
    causal mask: an estimate on it is refused in one line, writing nothing, where flash2's goes through."""
    for model_type, capped in (("gemma2", True), ("mistral", False)):
        folder = write_config(tmp_path / model_type, {**SMALL, "model_type": model_type, **MODELS[model_type][0]})
        counted = count_built(f"hf:{folder}", {"seq_len": 64}, 1, torch.bfloat16, "flash")
        kernels = [op for layer in counted.layers[1:3] for ops in layer.ops.values() for op in ops
                   if op.kind == "attention"]
        assert {op.op.endswith("_backward") for op in kernels} == {False, True}
        assert {op.softcap for op in kernels} == {capped}
    run = ["estimate", "--model", f"hf:{tmp_path / 'gemma2'}", "--seq-len", 64, "--attention", "flash",
           "--gpu", "h100-sxm"]
    out = tmp_path / "profile.json"
    code, _, err = pipesim(*run, "--attention-kernel", "cudnn", "--out", out)
    assert code == 2 and err.strip() == (
        "error: --attention-kernel cudnn: the model soft-caps its attention scores, which cuDNN's causal fused "
        "attention does not compute; use flash2 or flash3 (their softcap), or count it with --attention math")
    assert not out.exists()
    assert pipesim(*run, "--attention-kernel", "flash2", "--out", out).code == 0 and out.exists()


def test_gemma2s_final_logit_capping_is_counted_in_the_heads_layer(tmp_path):
    """Gemma 2 caps its logits after the head's product (`final_logit_softcapping`): a division, a tanh and a
    multiplication over the tokens x vocabulary logits, in the head's layer, which keeps the tanh's output for its
    backward (the division and multiplication by a number keep nothing)."""
    heads = {}
    for cap in (None, 30.0):
        folder = write_config(tmp_path / str(cap), {**SMALL, "model_type": "gemma2", "final_logit_softcapping": cap})
        heads[cap] = count_built(f"hf:{folder}", {"seq_len": 64}, 1, torch.bfloat16, "flash").layers[-1]
    logits = (1, 64, SMALL["vocab_size"])
    capping = [(op.op, op.shape) for op in heads[30.0].ops["fwd"] if op.op in ("div", "tanh", "mul")]
    assert capping == [("div", logits), ("tanh", logits), ("mul", logits)]
    assert not [op for op in heads[None].ops["fwd"] if op.op in ("div", "tanh", "mul")]
    assert heads[30.0].saved_bytes - heads[None].saved_bytes == 64 * SMALL["vocab_size"] * 2
