"""A Hugging Face model's rotary position embedding (RoPE) run as one fused kernel a tensor (`--rope-kernel fused`),
keeping for the backward what TransformerEngine's keeps, where transformers' eager code keeps what its ops save.

transformers' eager `apply_rotary_pos_emb` (Llama, Mixtral, Qwen3-MoE: `q * cos + rotate_half(q) * sin`, the same
for k, `rotate_half` two slices, a negation and a concatenation) runs several memory-bound kernels each way, each
reading and writing its own copy of q or k; its products keep cos and sin (neither needs a gradient).
Megatron-core with `apply_rope_fusion` (which Megatron-Bridge's performance scripts set: perf_recipes/_common.py
`_benchmark_common` and scripts/performance/utils/overrides.py at 067f987df0) calls TransformerEngine's fused RoPE
once for q and once for k (transformer_engine/pytorch/attention/rope.py `FusedRoPEFunc`: `tex.fused_rope_forward`
and, backward, `tex.fused_rope_backward`, which rotates the gradient back by the same angles): one kernel a tensor
each way, reading the tensor and the angles and writing the result, and it saves only the angles
(`ctx.save_for_backward(freqs, ...)`), nothing of q or k. Here the angles are transformers' cos and sin, which the
eager products keep too: the kept bytes do not change, the kernels and their bytes do. The rotation covers cos's
last dimension, the rest passes through (TransformerEngine's partial rotary, freqs narrower than the head)."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

from .moe import _kernel_writes, _one_kernel


def _rotated(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """`x`'s first cos.shape[-1] features rotated as transformers' rotate_half pairs them, the rest as they are."""
    rotary = cos.shape[-1]
    half = rotary // 2
    turned = x[..., :rotary]
    out = turned * cos + torch.cat((-turned[..., half:], turned[..., :half]), dim=-1) * sin
    return torch.cat((out, x[..., rotary:]), dim=-1) if rotary < x.shape[-1] else out


class _FusedRope(torch.autograd.Function):
    """`x` rotated by the angles whose cosines and sines are `cos` and `sin`, keeping only those, each way one kernel
    (module docstring): the backward rotates the gradient back, by the angles negated."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        with _one_kernel("fused_rope", (x, cos, sin)):
            out = _rotated(x, cos, sin)
            _kernel_writes(out)
        ctx.save_for_backward(cos, sin)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        cos, sin = ctx.saved_tensors
        with _one_kernel("fused_rope_backward", (grad, cos, sin)):
            grad_x = _rotated(grad, cos, -sin)
            _kernel_writes(grad_x)
        return grad_x, None, None


def _apply_fused(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                 unsqueeze_dim: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' `apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim)` as Megatron-core's fused path runs it:
    one `_FusedRope` for q and one for k."""
    cos, sin = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)
    return _FusedRope.apply(q, cos, sin), _FusedRope.apply(k, cos, sin)


@contextmanager
def fused_rope(layer: torch.nn.Module, on: bool) -> Iterator[None]:
    """Run `layer`'s RoPE as `_apply_fused` inside (`on`), else as it is: the modeling modules of its submodules
    that define transformers' `apply_rotary_pos_emb` and `rotate_half` (the form their attention calls by name)."""
    modelings = {sys.modules[type(module).__module__] for module in layer.modules()} if on else set()
    eager = {modeling: modeling.apply_rotary_pos_emb for modeling in modelings
             if callable(getattr(modeling, "apply_rotary_pos_emb", None)) and hasattr(modeling, "rotate_half")}
    for modeling in eager:
        modeling.apply_rotary_pos_emb = _apply_fused
    try:
        yield
    finally:
        for modeling, function in eager.items():
            modeling.apply_rotary_pos_emb = function
