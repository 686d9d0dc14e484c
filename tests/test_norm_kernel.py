"""--norm-kernel fused: a Hugging Face model's RMSNorms run as TransformerEngine's kernel (workload/norms.py), the
same output and gradients as transformers' eager module, keeping the 16-bit input and one float32 a token where
the eager module keeps a float32 copy of its input and the normalised 16-bit tensor."""

from __future__ import annotations

import pytest
import torch

from pipesim.workload.count import count_built
from pipesim.workload.models import ModelError
from pipesim.workload.norms import NO_RMSNORM_TO_FUSE
from tests.conftest import needs_transformers, pipesim, refused
from tests.helpers import LLAMA, B, H, S, write_config
from tests.helpers import LLAMA_GPT as GPT

E = 2  # bytes per bf16 element


@pytest.mark.parametrize("kind", [pytest.param("transformers", marks=needs_transformers), "torch"])
def test_it_computes_the_rmsnorm_and_its_gradients(kind):
    """Real numbers on the CPU, in float32 (both compute in it): transformers' module where `--norm-kernel fused`
    asks, torch's (the gpt's `--norm rmsnorm`) whatever it asks, as torch runs it on a GPU."""
    from pipesim.workload.norms import fused_norms

    if kind == "transformers":
        from transformers.models.llama.modeling_llama import LlamaRMSNorm

        eager = LlamaRMSNorm(8, eps=1e-5)
    else:
        eager = torch.nn.RMSNorm(8, eps=1e-5)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        eager.weight.copy_(torch.randn(8, generator=gen))
    x = torch.randn(3, 5, 8, generator=gen, requires_grad=True)
    grad = torch.randn(3, 5, 8, generator=gen)
    expected = eager(x)
    expected_grads = torch.autograd.grad(expected, (x, eager.weight), grad)
    with fused_norms(eager, kind == "transformers"):
        assert "forward" in vars(eager)  # run as the fused kernel inside
        out = eager(x)
    torch.testing.assert_close(out, expected)
    for mine, theirs in zip(torch.autograd.grad(out, (x, eager.weight), grad), expected_grads):
        torch.testing.assert_close(mine, theirs)
    assert "forward" not in vars(eager)  # the module runs as its own again


@needs_transformers
def test_each_norm_keeps_its_16_bit_input_and_a_float32_a_token(tmp_path):
    """A decoder layer's two norms: eager, 6 bytes an element and 4 a token each (the float32 input, 1/rms and the
    normalised 16-bit tensor); fused, 2 and 4, 4 bytes a token fewer than the gpt's LayerNorm (a mean and 1/std)."""
    llama = write_config(tmp_path / "llama", LLAMA)
    eager, fused = (count_built(f"hf:{llama}", {"seq_len": S}, B, torch.bfloat16, "flash", swiglu_fusion=False,
                                norm_kernel=kernel).layers[1] for kernel in ("eager", "fused"))
    gpt = count_built("gpt", GPT, B, torch.bfloat16, "flash").layers[1]

    def norms(layer) -> int:
        return sum(n for (_, n), part in zip(layer.saved_tensors, layer.saved_parts) if part == "norms")

    assert norms(eager) == 2 * (6 * B * S * H + 4 * B * S)
    assert norms(fused) == 2 * (E * B * S * H + 4 * B * S)
    assert norms(fused) == norms(gpt) - 2 * 4 * B * S
    assert eager.saved_bytes - fused.saved_bytes == 2 * 4 * B * S * H


@needs_transformers
def test_each_norm_is_counted_as_one_kernel_each_way(tmp_path):
    """Fused, a decoder layer's two norms are one memory-bound kernel each way, as TransformerEngine's rmsnorm_fwd
    and rmsnorm_bwd: the forward reads the 16-bit input and the weight and writes the output and a float32 1/rms a
    token; the backward reads the output's gradient beside them and writes the input's and the weight's gradients
    at once (the input pass the input's alone). Eager, the upcast, square, mean, rsqrt, products and downcast each
    read and write their own."""
    llama = write_config(tmp_path / "llama", LLAMA)
    eager, fused = (count_built(f"hf:{llama}", {"seq_len": S}, B, torch.bfloat16, "flash", swiglu_fusion=False,
                                norm_kernel=kernel).layers[1] for kernel in ("eager", "fused"))
    tokens = B * S
    x, weight, rms = tokens * H * E, H * E, tokens * 4
    (forward,) = [op for op in fused.ops["fwd"] if op.op == "fused_rmsnorm"]
    assert (forward.count, forward.moved_bytes, forward.shape) == (2, x + weight + x + rms, (B, S, H))
    (backward,) = [op for op in fused.ops["igrad"] if op.op == "fused_rmsnorm_backward"]
    assert (backward.count, backward.moved_bytes) == (2, x + x + weight + rms + x)
    (whole,) = [op for op in fused.ops["bwd"] if op.op == "fused_rmsnorm_backward"]
    assert (whole.count, whole.moved_bytes) == (2, x + x + weight + rms + x + weight)
    assert not {"pow", "rsqrt", "mean"} & {op.op for name in ("fwd", "igrad", "wgrad") for op in fused.ops[name]}
    assert {"pow", "rsqrt", "mean"} <= {op.op for op in eager.ops["fwd"]}
    for name in ("fwd", "igrad"):
        assert getattr(fused, f"{name}_moved_bytes") < getattr(eager, f"{name}_moved_bytes")
    assert fused.fwd_flops == eager.fwd_flops


@pytest.mark.parametrize("flag", ["--norm-kernel", "--rope-kernel"])
def test_a_bad_kernel_is_refused_in_one_line(flag):
    code, out, err = pipesim("simulate", "--model", "gpt", "--layers", "2", "--width", "64", "--heads", "2",
                             "--seq-len", "32", "--vocab", "512", "--gpu", "a100-sxm-80gb", "-p", "1", "-m", "1",
                             "-s", "gpipe", flag, "te")
    assert code == 2 and out == ""
    assert f"{flag}: choose from eager, fused (got 'te')" in err and len(err.strip().splitlines()) == 1


def test_the_gpts_layernorm_has_nothing_to_fuse_so_fused_norms_are_refused(tmp_path, monkeypatch):
    """pipesim's gpt runs torch's LayerNorm, whose kernel keeps what TransformerEngine's does: `--norm-kernel fused`
    would change nothing, so it is refused (as `--rope-kernel fused` is without RoPE), and eager counts as before;
    the user meets one line, exit 2, nothing written."""
    with pytest.raises(ModelError, match="the built-in gpt's torch LayerNorm"):
        count_built("gpt", GPT, B, torch.bfloat16, "flash", norm_kernel="fused")
    assert count_built("gpt", GPT, B, torch.bfloat16, "flash", norm_kernel="eager").layers[1] \
        == count_built("gpt", GPT, B, torch.bfloat16, "flash").layers[1]
    monkeypatch.chdir(tmp_path)
    assert NO_RMSNORM_TO_FUSE in refused("estimate", "--model", "gpt", "--layers", "2", "--width", "64", "--heads", "2",
                                         "--seq-len", "32", "--vocab", "512", "--gpu", "a100-sxm-80gb", "-p", "1",
                                         "--norm-kernel", "fused", "--out", "profile.json")


def test_a_zero_centred_rmsnorm_is_fused_and_a_grouped_one_is_not():
    """transformers' RMSNorms by their epsilon's name: Llama's `variance_epsilon`, the zero-centred `eps` of
    Qwen3-Next's and Gemma's (1 + weight: TransformerEngine's zero_centered_gamma, the same kernel); a norm of
    groups of a row (`group_size`) keeps a group's statistics, not the row's, so it runs as it is."""
    from pipesim.workload.norms import is_transformers_rms_norm

    class ZeroCentredRMSNorm(torch.nn.Module):
        def __init__(self, group_size: int | None = None) -> None:
            super().__init__()
            self.weight, self.eps, self.group_size = torch.nn.Parameter(torch.zeros(8)), 1e-6, group_size

    assert is_transformers_rms_norm(ZeroCentredRMSNorm()) and not is_transformers_rms_norm(ZeroCentredRMSNorm(4))
    assert not is_transformers_rms_norm(torch.nn.RMSNorm(8, eps=1e-6))  # torch's own: always fused, whatever asked

