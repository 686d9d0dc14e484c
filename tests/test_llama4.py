"""Llama 4 (transformers' llama4_text): its mixture of experts counted and run as Megatron-core runs it, each token
through its top-k experts with the router's weight on its input (workload/hf.py `_input_scaled_mixture`), where
transformers' Llama4TextMoe runs every token through every expert; its complex RoPE as TransformerEngine's fused
interleaved kernel (workload/rope.py `_apply_fused_complex`); its chunked attention refused past one chunk under
--attention math and context parallelism; and
Llama 4 Maverick's config (examples/) counted at its card's sizes."""

from __future__ import annotations

import pytest
import torch

from tests.conftest import needs_transformers, pipesim
from tests.helpers import count_config

pytestmark = needs_transformers

H, EXPERTS, EXPERT_FFN, DENSE_FFN, SEQ, BATCH = 64, 8, 32, 96, 32, 2
# two layers, the second a mixture (interleave 2) of 8 experts, top 1, beside a shared expert; the first with RoPE
# and the query and key norms, the second without RoPE (Llama 4 Scout's layout, Maverick's is without qk norm)
TINY_LLAMA4 = {"model_type": "llama4_text", "hidden_size": H, "intermediate_size": EXPERT_FFN,
               "intermediate_size_mlp": DENSE_FFN, "num_hidden_layers": 2, "num_attention_heads": 4,
               "num_key_value_heads": 2, "head_dim": 16, "num_local_experts": EXPERTS, "num_experts_per_tok": 1,
               "interleave_moe_layer_step": 2, "no_rope_layer_interval": 2, "use_qk_norm": True,
               "attention_chunk_size": 64, "vocab_size": 100, "max_position_embeddings": 256,
               "tie_word_embeddings": False, "initializer_range": 0.2}


def _llama4_moe():
    from transformers import Llama4TextConfig
    from transformers.models.llama4.modeling_llama4 import Llama4TextMoe

    config = Llama4TextConfig(**{k: v for k, v in TINY_LLAMA4.items() if k != "model_type"})
    torch.manual_seed(0)
    moe = Llama4TextMoe(config)
    with torch.no_grad():  # transformers leaves them uninitialised: any values the two forwards then share
        for weight in (moe.experts.gate_up_proj, moe.experts.down_proj):
            weight.normal_(std=0.2)
    return moe


def test_a_mixture_computes_what_transformers_llama4_moe_computes_with_each_token_through_its_expert_alone():
    """transformers' forward runs all 8 experts on every token, those not routed to scaled by 0 (silu(0) = 0: they
    add nothing); pipesim's runs each token through its top-1 expert, its input scaled by the router's sigmoid,
    beside the shared expert: the same output and router logits, and the same gradients of the tokens and of every
    weight (the router's through its top-1 logits alone, as transformers' scatter of -inf leaves it). In float64: the
    two sum in different orders, and in float32 gradients near 1,000 then differ by 2e-5 on an AVX2 host, past
    assert_close's float32 tolerance; in float64 they agree to 1e-12."""
    import copy

    from pipesim.workload.hf import _as_megatron_runs

    theirs_moe = _llama4_moe().double()
    ours_moe = copy.deepcopy(theirs_moe)
    _as_megatron_runs(torch.nn.ModuleList([ours_moe]))
    assert ours_moe.forward.func.__name__ == "_input_scaled_mixture"
    tokens = torch.randn(BATCH, SEQ, H, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    results = []
    for moe in (theirs_moe, ours_moe):
        given = tokens.clone().requires_grad_()
        out, logits = moe(given)
        (out.square().sum() + logits.sum()).backward()
        results.append((out, logits, given.grad, *(weight.grad for weight in moe.parameters())))
    for ours, theirs in zip(results[1], results[0], strict=True):
        torch.testing.assert_close(ours, theirs)


def test_each_expert_is_counted_at_its_top_1_share_of_the_tokens_with_the_router_weighting_its_input(tmp_path):
    """On the meta device the mixture's experts compute T·k/E tokens each (8 of 64 at top 1), not all 64: the
    experts' products are 1/8 of every-token's, and no op scales their activation (the input is scaled: the fused
    SwiGLU reads the activation's input alone)."""
    layer = count_config(tmp_path / "llama4", TINY_LLAMA4).layers[2]
    swiglu = [op for op in layer.ops["fwd"] if op.op == "fused_swiglu" and op.routed]
    assert len(swiglu) == 1 and swiglu[0].moved_bytes == 3 * BATCH * SEQ * EXPERT_FFN * 2  # reads 2f, writes f
    routed = [op for op in layer.ops["fwd"] if op.routed and op.kind == "matmul"]
    tokens = BATCH * SEQ // EXPERTS
    assert sorted(op.shape for op in routed) == [(EXPERTS, tokens, H, EXPERT_FFN), (EXPERTS, tokens, 2 * EXPERT_FFN, H)]
    assert sum(op.flops * op.count for op in routed) == 2 * BATCH * SEQ * 3 * H * EXPERT_FFN
    dense = count_config(tmp_path / "llama4", TINY_LLAMA4).layers[1]
    assert not any(op.routed for op in dense.ops["fwd"])
    assert "moe" in layer.region_ops and "mlp" in dense.region_ops  # Megatron-core's recompute modules


def test_its_complex_rope_as_transformer_engines_interleaved_kernel_gives_the_same_scores():
    """Llama 4 rotates each pair of adjacent features as a complex number; the fused stand-in writes the pairs
    de-interleaved (TransformerEngine's `interleaved=True`), the same permutation for q and k, so every query-key
    score is transformers' own."""
    from transformers.models.llama4.modeling_llama4 import apply_rotary_emb

    from pipesim.workload.rope import _apply_fused_complex

    generator = torch.Generator().manual_seed(2)
    q, k = (torch.randn(BATCH, SEQ, heads, 16, generator=generator) for heads in (4, 2))
    angles = torch.rand(BATCH, SEQ, 8, generator=generator) * 6.0
    freqs = torch.polar(torch.ones_like(angles), angles)
    theirs, ours = apply_rotary_emb(q, k, freqs), _apply_fused_complex(q, k, freqs)

    def scores(qk: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        return torch.einsum("bshd,btgd->bhgst", *qk)

    torch.testing.assert_close(scores(ours), scores(theirs))


def test_a_chunked_layer_is_counted_as_its_chunks_causal_kernels_and_the_global_layer_whole(tmp_path):
    """Past one chunk (32 tokens at chunks of 12: 12 + 12 + 8, the last padded), the RoPE layer's attention is one
    causal kernel over the 3 chunks of each sequence, each its own batch entry; the layer without RoPE attends to
    every earlier token, one causal kernel over the 32. (transformers' own chunked mask computes the same:
    tests/test_hf_attention_values.py.)"""
    layers = count_config(tmp_path / "chunks", {**TINY_LLAMA4, "attention_chunk_size": 12}, "flash").layers

    def attention(layer) -> list[tuple[int, ...]]:
        return [op.shape for op in layer.ops["fwd"] if op.kind == "attention"]

    assert attention(layers[1]) == [(BATCH * 3 * 4, 12, 12, 16)]
    assert attention(layers[2]) == [(BATCH * 4, SEQ, SEQ, 16)]


@pytest.mark.parametrize("flags, refusal", [
    (("--attention", "math"), "error: --attention math: the model's chunked attention layers attend within chunks "
                              "of 12 tokens, whose unfused scores the estimate does not split"),
    (("--attention", "flash", "--context-parallel", 2), "error: --context-parallel 2 splits the sequence for "
                                                        "attention's ring, and "),
])
def test_unfused_chunks_and_ringed_chunks_are_one_line(tmp_path, flags, refusal):
    """The unfused scores of a chunked layer are a chunk's each, which the estimate does not split (calibrate, which
    measures them, counts them so: tests/test_hf_attention_values.py runs them)."""
    from tests.helpers import write_config

    model = f"hf:{write_config(tmp_path / 'llama4', {**TINY_LLAMA4, 'attention_chunk_size': 12})}"
    code, out, err = pipesim("simulate", "--gpu", "h100-sxm", "--model", model, "--seq-len", SEQ, "-p", 1, "-s", "1f1b",
                             *flags)
    assert (code, out) == (2, "") and err.startswith(refusal) and len(err.strip().splitlines()) == 1, err
    if "--context-parallel" in flags:
        assert "chunked attention layers attend within chunks of 12 tokens" in err, err


def test_one_chunk_under_a_context_parallel_ring_runs_as_any_causal_layer(tmp_path):
    """Within one chunk (a sequence no longer than attention_chunk_size) every layer attends causally over the
    whole sequence, which the ring runs: only chunks past one are refused under context parallelism."""
    from tests.conftest import simulate_json
    from tests.helpers import write_config

    model = f"hf:{write_config(tmp_path / 'llama4', TINY_LLAMA4)}"
    result = simulate_json("--gpu", "h100-sxm", "--model", model, "--seq-len", SEQ, "--attention", "flash",
                           "--context-parallel", 2, "-p", 1, "-m", 2)[0]
    assert result["time_per_minibatch_ms"] > 0


def test_maverick_counts_its_cards_400b_parameters_and_17b_active(monkeypatch):
    """meta-llama/Llama-4-Maverick-17B-128E's card: 17B active parameters, 400B in all; 24 of its 48 layers a
    mixture of 128 experts, top 1, beside a shared one."""
    import json
    from pathlib import Path

    monkeypatch.chdir(Path(__file__).resolve().parents[1])
    code, out, err = pipesim("count", "--model", "hf:examples/llama4-maverick-17b-128e", "--seq-len", 128, "--json")
    assert code == 0, err
    counted = json.loads(out)
    assert (counted["options"]["experts"], counted["options"]["top_k"]) == (128, 1)
    # the dense layers' MLP (intermediate_size_mlp), the experts' (intermediate_size)
    assert (counted["options"]["ffn"], counted["options"]["expert_ffn"]) == (16384, 8192)
    blocks = counted["layers"][1:-2]
    assert [bool(layer["expert_param_bytes"]) for layer in blocks] == [False, True] * 24
    total = sum(layer["param_bytes"] for layer in counted["layers"]) / 2
    experts = sum(layer["expert_param_bytes"] for layer in counted["layers"]) / 2
    assert total == pytest.approx(400.7e9, rel=1e-3)
    assert total - experts + experts / 128 == pytest.approx(17.2e9, rel=1e-2)
