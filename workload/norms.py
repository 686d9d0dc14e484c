"""A Hugging Face model's RMSNorm run as one fused kernel (`--norm-kernel fused`), keeping for the backward what
TransformerEngine's keeps, where transformers' eager module keeps what its ops save.

transformers' eager RMSNorm (LlamaRMSNorm, Qwen3MoeRMSNorm, DeepseekV3RMSNorm: `hidden_states.to(float32)`, its
mean square, `hidden_states * rsqrt(...)`, `weight * hidden_states.to(input_dtype)`) keeps the float32 copy of
its input (the power's and the product's) and the normalised 16-bit tensor (the weight's product's) for the
backward: 6 bytes an element beside the 16-bit output the next product keeps. TransformerEngine's RMSNorm, which
Megatron-core builds every norm of (TENorm, and LayerNormLinear's fused norm; transformer_engine/pytorch/ops/
basic/rmsnorm.py and module/_common.py: `ctx.save_for_backward(x, rstdevs)`, the 16-bit input and one float32 per
token), keeps 2 bytes an element and 4 a token. NVIDIA's NeMo and Megatron-Bridge runs train with it; torchtitan
runs torch's own modules (its default, eager). Its work is that kernel's too, one each way (TransformerEngine's
rmsnorm_fwd and rmsnorm_bwd, transformer_engine/common/normalization/rmsnorm): the forward reads the input and
the weight and writes the output and the reciprocal RMS, the backward reads the output's gradient beside them and
writes the gradients asked for, where the eager module's upcast, square, mean, rsqrt, products and downcast each
read and write their own (as workload/moe.py `Fused` counts the fused SwiGLU). A model whose count runs no such
RMSNorm is refused `--norm-kernel fused` (`NO_RMSNORM_TO_FUSE`), as workload/rope.py refuses `--rope-kernel fused`:
the flag would change nothing. pipesim's gpt builds torch's LayerNorm, whose kernel keeps its input, a mean and a
reciprocal standard deviation, what TransformerEngine's LayerNorm keeps: nothing to fuse; or, with `--norm
rmsnorm`, torch's RMSNorm, which torch runs on a GPU as this one kernel each way whatever the flag (since torch 2.9,
pytorch/pytorch#153666: aten/src/ATen/native/layer_norm.cpp `rms_norm_symint` calls `_fused_rms_norm`, whose CUDA
kernel returns the output and the float32 reciprocal RMS and whose backward, `_fused_rms_norm_backward`, reads the
input, the weight and that RMS): counted so always."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

from .moe import _kernel_writes, _one_kernel, _wanted

NO_RMSNORM_TO_FUSE = ("--norm-kernel fused: this model runs no RMSNorm pipesim can run as TransformerEngine's kernel "
                      "(a Hugging Face model's transformers *RMSNorm modules; the built-in gpt's torch LayerNorm and "
                      "RMSNorm keep what TransformerEngine's keep already): leave it out or pass eager")


class _FusedRmsNorm(torch.autograd.Function):
    """`weight * x / rms(x)` in `x`'s dtype, keeping `x`, the weight and the float32 reciprocal RMS per token, each
    way one kernel (module docstring)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        with _one_kernel("fused_rmsnorm", (x, weight)):
            rsigma = torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + eps)
            out = weight * (x * rsigma).to(x.dtype)
            _kernel_writes(out, rsigma)
        ctx.save_for_backward(x, weight, rsigma)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None, None]:
        x, weight, rsigma = ctx.saved_tensors
        wanted = [_wanted(ctx.next_functions[i][0]) for i in (0, 1)]
        if not any(wanted):
            return None, None, None
        with _one_kernel("fused_rmsnorm_backward", (grad, x, weight, rsigma)):
            normed = x.float() * rsigma
            grad_x = grad_weight = None
            if wanted[0]:
                grad_normed = grad.float() * weight.float()
                grad_x = (rsigma * (grad_normed - normed * (grad_normed * normed).mean(-1, keepdim=True))).to(
                    x.dtype)
            if wanted[1]:
                grad_weight = (grad.float() * normed).reshape(-1, normed.shape[-1]).sum(0).to(weight.dtype)
            _kernel_writes(*(g for g in (grad_x, grad_weight) if g is not None))
        return grad_x, grad_weight, None


def _transformers_epsilon(module: torch.nn.Module) -> float | None:
    """transformers' eager RMSNorm's epsilon (None: `module` is not one): its class named so, with a weight and the
    epsilon its forward reads, Llama's `variance_epsilon` or the `eps` of Qwen3-Next's, Qwen3.5's and Gemma's, whose
    weight is zero-centred (`1 + weight`), as TransformerEngine's RMSNorm runs under zero_centered_gamma (Megatron-
    core's --apply-layernorm-1p), the same kernel keeping the same (the count runs it on the meta device, where its
    arithmetic, Llama's weight·x/rms, is no matter); not torch's own RMSNorm, nor one normalising groups of a row
    apart (a `group_size`: Qwen4-Exp's hyper-connection norms), whose statistics are a group's."""
    if (not type(module).__name__.endswith("RMSNorm") or isinstance(module, getattr(torch.nn, "RMSNorm", ()))
            or not isinstance(getattr(module, "weight", None), torch.nn.Parameter)
            or getattr(module, "group_size", None)):
        return None
    eps = getattr(module, "variance_epsilon", getattr(module, "eps", None))
    return eps if isinstance(eps, float) else None


def is_transformers_rms_norm(module: torch.nn.Module) -> bool:
    """transformers' eager RMSNorm (`_transformers_epsilon`)."""
    return _transformers_epsilon(module) is not None


def _fused_epsilon(module: torch.nn.Module, on: bool) -> float | None:
    """The epsilon `module` runs `_FusedRmsNorm` with: torch's RMSNorm's always (its own None is the float32
    epsilon, as aten's kernel takes it for 16- and 32-bit inputs), transformers' when `on`; None: it runs as it is."""
    if isinstance(module, getattr(torch.nn, "RMSNorm", ())) and module.weight is not None:
        return torch.finfo(torch.float32).eps if module.eps is None else module.eps
    return _transformers_epsilon(module) if on else None


@contextmanager
def fused_norms(layer: torch.nn.Module, on: bool) -> Iterator[None]:
    """Run `layer`'s RMSNorms as `_FusedRmsNorm` inside: torch's always, transformers' if `on` (module docstring)."""
    norms = [(module, eps) for module in layer.modules() if (eps := _fused_epsilon(module, on)) is not None]
    for norm, eps in norms:
        norm.forward = lambda x, norm=norm, eps=eps: _FusedRmsNorm.apply(x, norm.weight, eps)
    try:
        yield
    finally:
        for norm, _ in norms:
            del norm.forward
