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
from tests.conftest import needs_transformers, pipesim, simulate_json
from tests.helpers import H100, H100_BF16, HEAD, KV, LLAMA, TINY_DEEPSEEK, A, B, S, write_config
from tests.helpers import LLAMA_GPT as GPT

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


def test_deepseek_v2s_complex_rope_on_its_own_layout_is_left_eager_and_fused_is_refused(tmp_path):
    """DeepSeek-V2's `apply_rotary_emb(xq, xk, freqs_cis)` takes Llama 4's parameters on another layout (heads
    before tokens): Llama 4's stand-in (workload/rope.py `_apply_fused_complex`) is not put in its place, which
    broadcast its angles over the wrong axes, so --rope-kernel fused is refused as for a model without RoPE."""
    deepseek_v2 = write_config(tmp_path / "deepseek_v2", {**TINY_DEEPSEEK, "model_type": "deepseek_v2"})
    with pytest.raises(ModelError, match="Llama 4's apply_rotary_emb"):
        count_built(f"hf:{deepseek_v2}", {"seq_len": S}, B, torch.bfloat16, "flash", rope_kernel="fused")


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


# The gpt with RoPE: 8 heads of 24 features, 2 key/value heads, 256 tokens, one block, in bf16.
ROTARY_GPT = dict(layers=1, width=192, heads=8, kv_heads=2, seq_len=256, vocab=512)


def _rotary_gpt(share: float | None, kernel: str = "eager"):
    return count_built("gpt", {**ROTARY_GPT, "rotary_percent": share}, 1, torch.bfloat16, "flash",
                       rope_kernel=kernel)


def test_the_gpts_rope_replaces_its_learned_positions_and_rotates_q_and_k_in_eager_ops():
    """--rotary-percent: no position table (256 x 192 bf16 weights fewer), and each block's q and k rotated by
    transformers' eager ops (products, a negation, a concatenation, a sum) before the attention, none of them
    without it."""
    learned, rotary = _rotary_gpt(None), _rotary_gpt(1.0)
    assert learned.layers[0].param_bytes - rotary.layers[0].param_bytes == 256 * 192 * E
    eager_ops = {op.op for op in rotary.layers[1].ops["fwd"]} - {op.op for op in learned.layers[1].ops["fwd"]}
    assert {"mul", "neg", "cat"} <= eager_ops and not any(op.op.startswith("fused_rope")
                                                           for op in rotary.layers[1].ops["fwd"])


@pytest.mark.parametrize("share, angles", [(1.0, 2 * 256 * 24 * E), (0.5, 2 * 256 * 12 * E)])
def test_the_gpts_fused_rope_is_one_kernel_a_tensor_each_way(share, angles):
    """--rope-kernel fused: TransformerEngine's kernel once for q (256 x 8 x 24 bf16, 98,304 B) and once for k
    (24,576 B), each reading its tensor and the cosines and sines (of the rotated features: 24, or 12 at 0.5) and
    writing the whole tensor (the rest of a head passes through), forward and backward."""
    layer = _rotary_gpt(share, "fused").layers[1]
    for name, kernel in (("fwd", "fused_rope"), ("bwd", "fused_rope_backward")):
        assert sorted(op.moved_bytes for op in layer.ops[name] if op.op == kernel) == [
            2 * 24_576 + angles, 2 * 98_304 + angles]


def test_an_estimated_gpt_layer_pays_its_two_fused_rope_kernels_each_way():
    """The block's priced forward and backward are each two memory-bound kernels longer than without RoPE: a
    kernel's overhead each and 221,184 + 73,728 bytes at the memory's rate (q's and k's read and written, the
    angles read)."""
    from pipesim.planning.estimate import Parallelism, estimate_layer, placement_links

    links = placement_links(H100, Parallelism())
    learned, fused = (estimate_layer(count.layers[1], H100_BF16, Parallelism(), links.tensor, E)
                      for count in (_rotary_gpt(None), _rotary_gpt(1.0, "fused")))
    kernels_ms = 2 * H100.curve.kernel_overhead_ms + (221_184 + 73_728) / H100_BF16.memory_bytes_per_ms
    assert fused.fwd_ms - learned.fwd_ms == pytest.approx(kernels_ms)
    assert fused.bwd_ms - learned.bwd_ms == pytest.approx(kernels_ms)


def test_the_gpts_angles_leave_the_first_position_and_every_norm_as_they_are():
    """Real numbers: position 0's angles are 0 (q and k unchanged there); a rotation keeps each pair's length."""
    from pipesim.workload.models import apply_rotary_pos_emb, rotary_angles

    cos, sin = rotary_angles(16, 8)
    q, k = torch.randn(1, 16, 2, 8), torch.randn(1, 16, 1, 8)
    q_turned, k_turned = apply_rotary_pos_emb(q, k, cos[None], sin[None], unsqueeze_dim=2)
    assert torch.equal(q_turned[:, 0], q[:, 0]) and torch.equal(k_turned[:, 0], k[:, 0])
    assert torch.allclose(q_turned.norm(dim=-1), q.norm(dim=-1), atol=1e-5)


SHARE_ALLOWED = "--rotary-percent: give a finite number above 0 and at most 1"


@pytest.mark.parametrize("share, words", [("0", f"{SHARE_ALLOWED} (got 0)"), ("1.5", f"{SHARE_ALLOWED} (got 1.5)"),
                                          ("nan", f"{SHARE_ALLOWED} (got nan)"),
                                          ("0.3", "rotates 19 of a head's 64 features")])
def test_the_cli_refuses_a_rotary_share_that_turns_no_pairs_in_one_line(tmp_path, share, words):
    page = tmp_path / "timeline.html"
    code, out, err = pipesim("simulate", "--model", "gpt", "--layers", "2", "--width", "128", "--heads", "2",
                             "--seq-len", "32", "--vocab", "512", "--gpu", "a100-sxm-80gb", "-p", "1", "-m", "1",
                             "-s", "gpipe", "--rotary-percent", share, "--html", page)
    assert code == 2 and out == "" and not page.exists()
    assert "--rotary-percent" in err and words in err and len(err.strip().splitlines()) == 1


def test_the_gpt_with_rope_runs_forward_and_backward_on_real_tensors():
    """The executor's path: real weights on the CPU, the angles a buffer of each block, gradients reaching q's and
    k's weights through the rotation."""
    from pipesim.workload.models import build_model

    model = build_model("gpt", layers=1, width=32, heads=2, seq_len=16, vocab=64, rotary_percent=0.5)
    ids, target = model.make_batch(2, torch.Generator().manual_seed(0))
    out = ids
    for layer in model.layers:
        out = layer(out)
    model.loss(out, target).backward()
    assert model.layers[0].positions is None and model.layers[1].qkv.weight.grad.abs().sum() > 0


GATED_ROTARY_GPT = {"layers": 2, "width": 64, "heads": 4, "kv_heads": 2, "seq_len": 32, "vocab": 128,
                    "gated": True, "rotary_percent": 1.0}


def test_the_gpts_angles_are_its_own_buffers_not_saved_activations():
    """The fused RoPE saves the block's cos and sin (TransformerEngine's saves its freqs), but they are the
    block's buffers, held whatever autograd saves, as its weights are: no saved storage of the angles' shape
    (1 x s x 1 x rotary, as the block rotates its token-major q and k)."""
    block = count_built("gpt", GATED_ROTARY_GPT, 2, torch.bfloat16, "flash", rope_kernel="fused").layers[1]
    assert (1, 32, 1, 16) not in [shape for shape, _ in block.saved_tensors]


def test_the_fused_qkv_product_the_kernel_views_v_of_is_kept_as_v_alone_under_transformer_engines_ring():
    """The rotated q and k are tensors of their own and v a view of the fused QKV product, which the attention
    kernel keeps whole by saving v: so it does without context parallelism (TransformerEngine's FusedAttention
    saves the strided v) and under torch's rings (their kernels' views as given); under p2p TransformerEngine makes
    v contiguous and saves its own `torch.cat` of k and v, and the product is freed: q + k bytes a layer fewer."""
    from pipesim.planning.estimate import ContextRing
    from pipesim.profiles.schema import EstimateLink

    b, s, width, kv_width = 2, 32, 64, 2 * 16
    block = count_built("gpt", GATED_ROTARY_GPT, b, torch.bfloat16, "flash", rope_kernel="fused").layers[1]
    qkv = b * s * (width + 2 * kv_width) * E
    v = b * s * kv_width * E
    assert [(nbytes, copied) for (_, nbytes), copied in zip(block.saved_tensors, block.attention_copied_bytes)
            if nbytes != copied] == [(qkv, v)]
    link = EstimateLink(kind="nvlink", latency_ms=0.01, bytes_per_ms=1e8)
    assert ContextRing(2, link, "alltoall").kept(block) == block
    assert ContextRing(2, link, "p2p").kept(block).saved_bytes == block.saved_bytes - b * s * (width + kv_width) * E


@pytest.mark.parametrize("dtype", ["bf16", "fp8"])
def test_the_last_devices_activations_fall_by_q_and_k_a_layer_under_the_p2p_ring(dtype):
    """Two blocks, C = 2 under p2p against alltoall: the same saved bytes but the QKV products, q + k a layer
    (1/C of them a rank); the rings' own buffers are communication, not activations. Under float8 too, whose
    recipe keeps float8 copies of the linears' inputs, which the ring's rule leaves as they are."""
    gpt = ["--model", "gpt", "--layers", "2", "--width", "256", "--heads", "4", "--kv-heads", "2", "--gated",
           "--rotary-percent", "1.0", "--rope-kernel", "fused", "--seq-len", "256", "--vocab", "512",
           "--dtype", dtype, "--attention", "flash", "-b", "2", "--gpu", "h100-sxm", "--context-parallel", "2",
           "-p", "1", "-m", "1", "-s", "1f1b"]
    activations = [simulate_json(*gpt, "--cp-rotate", rotate)[0]["devices"][0]["peak_memory_parts_mb"]["activations"]
                   for rotate in ("alltoall", "p2p")]
    q_and_k = 2 * 256 * (256 + 128) * E / 2  # a rank's 128 of the 256 tokens
    assert (activations[0] - activations[1]) * 2 ** 20 == pytest.approx(2 * q_and_k)



def test_calibration_leaves_the_angle_buffers_out_of_a_blocks_measured_saved_bytes():
    """A real run on the CPU (`calibrate`'s measure_bytes, eager RoPE, float32): a rotary block saves its rotated q
    and k beyond what a block with learned positions saves, and not the cos and sin its products keep, which are
    the block's buffers, as the count leaves them out."""
    from pipesim.calibrate.measure import Settings, measure_bytes
    from pipesim.workload.models import build_model

    settings = Settings(torch.device("cpu"), torch.float32, 2, warmup=0, repeats=1)
    rotary, learned = (measure_bytes(build_model("gpt", **{**GATED_ROTARY_GPT, "rotary_percent": share}),
                                     settings)[1][1] for share in (1.0, None))
    q_and_k = 2 * 32 * (64 + 32) * 4
    assert rotary.activation_bytes - learned.activation_bytes == q_and_k
