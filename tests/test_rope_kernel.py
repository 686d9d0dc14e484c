"""--rope-kernel fused: a Hugging Face model's rotary position embedding run as TransformerEngine's fused kernel
(workload/rope.py), the same output and gradients as transformers' eager `apply_rotary_pos_emb`, one kernel for q
and one for k each way where the eager code runs slices, a negation, a concatenation, products and a sum."""

from __future__ import annotations

import torch

from pipesim.workload.count import count_built
from tests.test_hf import GPT, HEAD, KV, LLAMA, A, B, S, needs_transformers, write_config

E = 2  # bytes per bf16 element


@needs_transformers
def test_it_computes_transformers_rope_and_its_gradients():
    """Real numbers on the CPU, in float32: q and k rotated by Llama's angles, and the gradients back."""
    from transformers.models.llama import modeling_llama

    from pipesim.workload.rope import fused_rope

    gen = torch.Generator().manual_seed(0)
    q, k = (torch.randn(2, heads, 5, 8, generator=gen, requires_grad=True) for heads in (4, 2))
    angles = torch.randn(1, 5, 4, generator=gen).repeat(1, 1, 2)
    cos, sin = angles.cos(), angles.sin()
    grads = (torch.randn(2, 4, 5, 8, generator=gen), torch.randn(2, 2, 5, 8, generator=gen))
    eager = modeling_llama.apply_rotary_pos_emb
    expected = eager(q, k, cos, sin)
    expected_grads = torch.autograd.grad(expected, (q, k), grads)
    attention = modeling_llama.LlamaAttention(modeling_llama.LlamaConfig(hidden_size=32, num_attention_heads=4), 0)
    with fused_rope(attention, True):
        out = modeling_llama.apply_rotary_pos_emb(q, k, cos, sin)
    assert modeling_llama.apply_rotary_pos_emb is eager  # transformers' function is back
    for mine, theirs in zip((*out, *torch.autograd.grad(out, (q, k), grads)), (*expected, *expected_grads)):
        torch.testing.assert_close(mine, theirs)


@needs_transformers
def test_q_and_k_are_one_kernel_each_way_reading_and_writing_each_once(tmp_path):
    """Fused, a decoder layer's RoPE is two kernels forward (q's, k's), each reading its tensor and the 16-bit cos
    and sin (1 x s x head) and writing the result, and two backward reading the gradient and the angles and writing
    the input's gradient; none of the eager ops' slices, negation or concatenation is left, fewer bytes move each
    way, and the same bytes are kept (eager, the products keep cos and sin; fused, TransformerEngine keeps the
    angles)."""
    llama = write_config(tmp_path / "llama", LLAMA)
    eager, fused = (count_built(f"hf:{llama}", {"seq_len": S}, B, torch.bfloat16, "flash", swiglu_fusion=False,
                                rope_kernel=kernel).layers[1] for kernel in ("eager", "fused"))
    angles = 2 * S * HEAD * E
    q, k = B * A * S * HEAD * E, B * KV * S * HEAD * E
    for name, kernel in (("fwd", "fused_rope"), ("igrad", "fused_rope_backward"), ("bwd", "fused_rope_backward")):
        ops = [op for op in fused.ops[name] if op.op == kernel]
        assert sum(op.count for op in ops) == 2
        assert sum(op.moved_bytes for op in ops) == 2 * q + 2 * k + 2 * angles
    def rotations(layer, name: str) -> set[str]:  # the ops on q and k (b x heads x s x head), not on the angles
        return {op.op for op in layer.ops[name] if op.op in ("cat", "neg") and len(op.shape) == 4}

    assert rotations(eager, "fwd") == {"cat", "neg"} and rotations(eager, "igrad") == {"neg"}
    assert not rotations(fused, "fwd") | rotations(fused, "igrad")
    for name in ("fwd", "igrad"):
        assert getattr(fused, f"{name}_moved_bytes") < getattr(eager, f"{name}_moved_bytes")
    assert fused.saved_bytes == eager.saved_bytes


def test_the_gpt_has_no_rope_to_fuse():
    """pipesim's gpt learns its positions (an embedding), so its count is the same either way."""
    eager, fused = (count_built("gpt", GPT, B, torch.bfloat16, "flash", rope_kernel=kernel).layers[1]
                    for kernel in ("eager", "fused"))
    assert fused == eager
