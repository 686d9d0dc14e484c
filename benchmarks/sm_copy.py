"""A copy on a fixed number of CTAs, the shape of a collective's kernel (NCCL's channels, DeepEP's and HybridEP's
SMs): each CTA strides over the buffer in blocks, so the copy runs as `ctas` CTAs from its start to its end
(several may share a multiprocessor where nothing else holds it). Triton; imported by benchmarks/gpu_probe.py's
part (g) on a GPU only."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_ELEMENTS = 8192  # a block's elements a loop step: 16 KiB of bf16, each CTA's 16 warps a few loads in flight


@triton.jit
def _strided_copy(source, target, elements, BLOCK: tl.constexpr):
    step = tl.num_programs(0) * BLOCK
    for start in range(tl.program_id(0) * BLOCK, elements, step):
        offsets = start + tl.arange(0, BLOCK)
        inside = offsets < elements
        tl.store(target + offsets, tl.load(source + offsets, mask=inside), mask=inside)


def copy_on_ctas(source: torch.Tensor, target: torch.Tensor, ctas: int) -> None:
    """`target[:] = source` (both contiguous, alike) by a kernel of `ctas` CTAs on the current stream."""
    _strided_copy[(ctas,)](source, target, source.numel(), BLOCK=BLOCK_ELEMENTS, num_warps=16)
