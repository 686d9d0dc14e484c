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
last dimension, the rest passes through (TransformerEngine's partial rotary, freqs narrower than the head).

DeepSeek-V3's `apply_rotary_pos_emb_interleave` (its `rope_interleave`) rotates pairs (x0, x1), (x2, x3), ... and
writes them de-interleaved; TransformerEngine's kernel takes `interleaved=True` (`FusedRoPEFunc.forward`'s
`interleaved`, the CUDA kernel pairing each even feature with the next) and is the same one kernel a tensor, so it
is priced alike; the stand-in computes transformers' layout (TransformerEngine keeps the pairs in place, a
permutation of the features that q and k share, so their products are the same). The built-in gpt with
`--rotary-percent` calls its own `apply_rotary_pos_emb` of transformers' form (workload/models.py), replaced alike. A
model whose count calls none (the gpt without it learns its positions) is refused `--rope-kernel fused`
(`NO_ROPE_TO_FUSE`): the flag would change nothing."""

from __future__ import annotations

import inspect
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch.utils._python_dispatch import _disable_current_modes

from .moe import _kernel_writes, _one_kernel


def rotated(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """`x`'s first cos.shape[-1] features rotated as transformers' rotate_half pairs them, the rest as they are."""
    rotary = cos.shape[-1]
    half = rotary // 2
    turned = x[..., :rotary]
    out = turned * cos + torch.cat((-turned[..., half:], turned[..., :half]), dim=-1) * sin
    return torch.cat((out, x[..., rotary:]), dim=-1) if rotary < x.shape[-1] else out


def _deinterleaved(x: torch.Tensor, rotary: int) -> torch.Tensor:
    """`x`'s first `rotary` features, pairs (x0, x1), (x2, x3), ..., laid out as rotate_half pairs them (evens, then
    odds), the rest as they are: `apply_rotary_pos_emb_interleave`'s input in `apply_rotary_pos_emb`'s layout."""
    turned = x[..., :rotary]
    return torch.cat((turned[..., 0::2], turned[..., 1::2], x[..., rotary:]), dim=-1)


def _interleaved(x: torch.Tensor, rotary: int) -> torch.Tensor:
    """`_deinterleaved`'s inverse: the first `rotary` features' halves put back in pairs."""
    half = rotary // 2
    pairs = torch.stack((x[..., :half], x[..., half:rotary]), dim=-1).flatten(-2)
    return torch.cat((pairs, x[..., rotary:]), dim=-1)


class _FusedRope(torch.autograd.Function):
    """`x` rotated by the angles whose cosines and sines are `cos` and `sin`, keeping only those, each way one kernel
    (module docstring): the backward rotates the gradient back, by the angles negated. `interleaved`: `x`'s pairs
    are adjacent features and the result is written de-interleaved, as transformers' interleaved variant does."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool) -> torch.Tensor:
        with _one_kernel("fused_rope", (x, cos, sin)):
            out = rotated(_deinterleaved(x, cos.shape[-1]) if interleaved else x, cos, sin)
            _kernel_writes(out)
        ctx.save_for_backward(cos, sin)
        ctx.interleaved = interleaved
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        cos, sin = ctx.saved_tensors
        with _one_kernel("fused_rope_backward", (grad, cos, sin)):
            grad_x = rotated(grad, cos, -sin)
            if ctx.interleaved:
                grad_x = _interleaved(grad_x, cos.shape[-1])
            _kernel_writes(grad_x)
        return grad_x, None, None, None


def _apply_fused(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                 unsqueeze_dim: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' `apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim)` as Megatron-core's fused path runs it:
    one `_FusedRope` for q and one for k."""
    cos, sin = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)
    return _FusedRope.apply(q, cos, sin, False), _FusedRope.apply(k, cos, sin, False)


def _apply_fused_interleaved(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                             position_ids: torch.Tensor | None = None,
                             unsqueeze_dim: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' `apply_rotary_pos_emb_interleave` (its `position_ids` unused there too) as TransformerEngine's
    fused kernel with `interleaved=True` runs it: one `_FusedRope` for q and one for k."""
    cos, sin = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)
    return _FusedRope.apply(q, cos, sin, True), _FusedRope.apply(k, cos, sin, True)


def _apply_fused_complex(xq: torch.Tensor, xk: torch.Tensor,
                         freqs_cis: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Llama 4's `apply_rotary_emb` (each pair of adjacent features a complex number, times `freqs_cis`, one angle a
    pair and token) as Megatron-core's Llama 4 runs it, TransformerEngine's fused kernel with `interleaved=True`
    (rotary_interleaved and apply_rope_fusion: NeMo's Llama4Config at 7a8f1cc7bc, its performance script): one
    `_FusedRope` for q and one for k, of the angles' cosines and sines, made out of the count's sight as
    TransformerEngine's are made once for all the layers."""
    with _disable_current_modes():
        angles = freqs_cis[:, :, None, :]
        cos, sin = (torch.cat((part, part), dim=-1).to(xq.dtype) for part in (angles.real, angles.imag))
    return _FusedRope.apply(xq, cos, sin, True), _FusedRope.apply(xk, cos, sin, True)


# The functions of transformers' modeling modules that attention calls by name, with the parameters they take first,
# the one modeling module whose function it is where the name is not transformers' common form (None: any), and
# their fused stand-ins. DeepSeek-V2's `apply_rotary_emb` takes the same parameters on another layout (heads before
# tokens): left as it is, so that --rope-kernel fused is refused there (`NO_ROPE_TO_FUSE`).
_STAND_INS = {"apply_rotary_pos_emb": (("q", "k", "cos", "sin"), None, _apply_fused),
              "apply_rotary_pos_emb_interleave": (("q", "k", "cos", "sin"), None, _apply_fused_interleaved),
              "apply_rotary_emb": (("xq", "xk", "freqs_cis"), "transformers.models.llama4.modeling_llama4",
                                   _apply_fused_complex)}


# Why `--rope-kernel fused` cannot apply to a model whose count ran no `_FusedRope` (workload/count.py `count_model`).
NO_ROPE_TO_FUSE = ("--rope-kernel fused: this model calls no RoPE pipesim can run as TransformerEngine's fused kernel "
                   "(transformers' apply_rotary_pos_emb, apply_rotary_pos_emb_interleave or Llama 4's "
                   "apply_rotary_emb; the built-in gpt learns its positions unless given --rotary-percent): leave it "
                   "out or pass eager")


def _takes(function: object, parameters: tuple[str, ...]) -> bool:
    """Whether `function` is RoPE in the form a `_STAND_INS` entry replaces, taking `parameters` first. Where the
    `kernels` package is installed (transformers 5.25 requires it) transformers decorates it with
    `use_kernel_forward_from_hub`, which makes it a module whose `forward` carries the function's signature;
    attention still calls it by name."""
    if isinstance(function, torch.nn.Module):
        function = function.forward
    return callable(function) and tuple(inspect.signature(function).parameters)[:len(parameters)] == parameters


@contextmanager
def fused_rope(layer: torch.nn.Module, on: bool) -> Iterator[None]:
    """Run `layer`'s RoPE as `_STAND_INS` inside (`on`), else as it is: the functions of `_STAND_INS` that the
    modules of its submodules define in the form an entry replaces (the parameters it takes first, in the modeling
    module it names), which their attention calls by name."""
    modelings = {sys.modules[type(module).__module__] for module in layer.modules()} if on else set()
    eager = {(modeling, name): getattr(modeling, name) for modeling in modelings
             for name, (parameters, only_in, _) in _STAND_INS.items()
             if only_in in (None, modeling.__name__) and _takes(getattr(modeling, name, None), parameters)}
    for (modeling, name) in eager:
        setattr(modeling, name, _STAND_INS[name][2])
    try:
        yield
    finally:
        for (modeling, name), function in eager.items():
            setattr(modeling, name, function)
