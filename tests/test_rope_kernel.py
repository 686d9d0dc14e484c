"""--rope-kernel fused: a Hugging Face model's rotary position embedding run as TransformerEngine's fused kernel
(workload/rope.py), the same output and gradients as transformers' eager `apply_rotary_pos_emb`, one kernel for q
and one for k each way where the eager code runs slices, a negation, a concatenation, products and a sum; DeepSeek-V3's
interleaved variant alike; a model with neither (the gpt) refused, so that the flag never silently does nothing."""

from __future__ import annotations

import pytest
import torch

from pipesim.workload.count import count_built
from pipesim.workload.models import ModelError
from pipesim.workload.rope import NO_ROPE_TO_FUSE
from tests.conftest import pipesim
from tests.test_hf import GPT, HEAD, KV, LLAMA, A, B, S, needs_transformers, write_config
from tests.test_moe import TINY_DEEPSEEK

E = 2  # bytes per bf16 element


def _llama() -> tuple[object, str, torch.nn.Module]:
    from transformers.models.llama import modeling_llama as llama

    return llama, "apply_rotary_pos_emb", llama.LlamaAttention(llama.LlamaConfig(hidden_size=32,
                                                                                 num_attention_heads=4), 0)


def _deepseek_interleaved() -> tuple[object, str, torch.nn.Module]:
    from transformers.models.deepseek_v3 import modeling_deepseek_v3 as deepseek

    return (deepseek, "apply_rotary_pos_emb_interleave",
            deepseek.DeepseekV3Attention(deepseek.DeepseekV3Config(**TINY_DEEPSEEK), 0))


@needs_transformers
@pytest.mark.parametrize("modeling_of", [_llama, _deepseek_interleaved])
def test_it_computes_transformers_rope_and_its_gradients(modeling_of):
    """Real numbers on the CPU, in float32: q and k rotated by the angles and the gradients back, as transformers'
    `apply_rotary_pos_emb` (Llama) and DeepSeek-V3's `apply_rotary_pos_emb_interleave` (pairs of adjacent
    features, written de-interleaved) compute them; each replaced inside `fused_rope` and put back after."""
    from pipesim.workload.rope import fused_rope

    modeling, name, attention = modeling_of()
    gen = torch.Generator().manual_seed(0)
    q, k = (torch.randn(2, heads, 5, 8, generator=gen, requires_grad=True) for heads in (4, 2))
    angles = torch.randn(1, 5, 4, generator=gen).repeat(1, 1, 2)
    cos, sin = angles.cos(), angles.sin()
    grads = (torch.randn(2, 4, 5, 8, generator=gen), torch.randn(2, 2, 5, 8, generator=gen))
    eager = getattr(modeling, name)
    expected = eager(q, k, cos, sin)
    expected_grads = torch.autograd.grad(expected, (q, k), grads)
    with fused_rope(attention, True):
        assert getattr(modeling, name) is not eager
        out = getattr(modeling, name)(q, k, cos, sin)
    assert getattr(modeling, name) is eager  # transformers' function is back
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


@needs_transformers
def test_deepseek_v3s_interleaved_rope_runs_as_the_fused_kernel(tmp_path):
    """A DeepSeek-V3 layer (rope_interleave, the config's default) runs two fused RoPE kernels each way, q's and the
    shared k's, and none of the eager variant's even/odd slices' concatenation on them."""
    deepseek = write_config(tmp_path / "deepseek", TINY_DEEPSEEK)
    eager, fused = (count_built(f"hf:{deepseek}", {"seq_len": S}, B, torch.bfloat16, "flash",
                                rope_kernel=kernel).layers[1] for kernel in ("eager", "fused"))
    for name, kernel in (("fwd", "fused_rope"), ("igrad", "fused_rope_backward")):
        assert sum(op.count for op in fused.ops[name] if op.op == kernel) == 2
    assert not any(op.op.startswith("fused_rope") for op in eager.ops["fwd"])
    assert fused.fwd_moved_bytes < eager.fwd_moved_bytes


def test_the_gpt_learns_its_positions_so_fused_rope_is_refused():
    """pipesim's gpt learns its positions (an embedding): `--rope-kernel fused` would change nothing, so it is
    refused, and eager counts as before."""
    with pytest.raises(ModelError, match="the built-in gpt learns its positions"):
        count_built("gpt", GPT, B, torch.bfloat16, "flash", rope_kernel="fused")
    assert count_built("gpt", GPT, B, torch.bfloat16, "flash", rope_kernel="eager").layers[1] \
        == count_built("gpt", GPT, B, torch.bfloat16, "flash").layers[1]


def test_the_cli_refuses_fused_rope_for_the_gpt_in_one_line(tmp_path):
    """As a user meets it: one line naming the flag and why, exit 2, nothing written."""
    page = tmp_path / "timeline.html"
    code, out, err = pipesim("simulate", "--model", "gpt", "--layers", "2", "--width", "64", "--heads", "2",
                             "--seq-len", "32", "--vocab", "512", "--gpu", "a100-sxm-80gb", "-p", "1", "-m", "1",
                             "-s", "gpipe", "--rope-kernel", "fused", "--html", page)
    assert code == 2 and out == "" and not page.exists()
    assert NO_ROPE_TO_FUSE in err and len(err.strip().splitlines()) == 1
