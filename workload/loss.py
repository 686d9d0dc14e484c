"""torch's `loss_parallel` cross entropy (torch/distributed/tensor/parallel/loss.py, torch 2.13), which torchtitan
computes its loss with under tensor parallelism: the logits stay split by vocabulary over the t ranks, and each
rank runs the ops below on its t-th, the maximum, the sum of exponentials and the picked logit all-reduced over
the ranks (over one here: the count's tensors are the whole vocabulary's, which the estimate splits by t).

Its memory differs from aten's pair (log_softmax, nll_loss) in the backward: torch fuses the two backwards into
one (`_nll_loss_and_log_softmax_backward`, `(grad_input + exp(x)) * grad_output`, to spare an all-gather), which
holds the saved log-softmax, grad_input, the exponential and their sum at once, four float32 tokens x vocabulary
tensors where aten's holds three; its forward (`_log_softmax`, torch._decomp's decomposition) holds the shifted
logits beside their exponential where aten's kernel writes its output alone.
"""

from __future__ import annotations

from typing import Any

import torch

IGNORE_INDEX = -100  # torch's cross entropy's default, which torchtitan keeps


class _VocabularyParallelCrossEntropy(torch.autograd.Function):
    """Mean cross entropy of float32 `logits` (tokens x vocabulary) against `target`, op for op as torch's
    loss_parallel handlers compute it on a rank (`_log_softmax`, `_nll_loss_forward`,
    `_nll_loss_and_log_softmax_backward`), the log-softmax saved for the backward as aten's nodes save it."""

    @staticmethod
    def forward(ctx: Any, logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        shifted = logits - torch.amax(logits, 1, keepdim=True)
        log_probs = shifted - torch.log(torch.sum(torch.exp(shifted), 1, keepdim=True))
        kept = target != IGNORE_INDEX
        safe_target = torch.where(kept, target, 0)
        total_weight = kept.sum().to(log_probs.dtype)
        picked = torch.where(kept, log_probs.gather(1, safe_target.unsqueeze(1)).squeeze(1), 0.0)
        ctx.save_for_backward(log_probs, target, total_weight)
        return -picked.sum() / total_weight

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> tuple[torch.Tensor, None]:
        log_probs, target, total_weight = ctx.saved_tensors
        kept = target != IGNORE_INDEX
        grad_input = torch.zeros_like(log_probs)
        grad_input[torch.arange(target.shape[0], device=target.device), torch.where(kept, target, 0)] = -1.0
        grad_output = torch.where(kept, grad_output / total_weight, 0.0).unsqueeze(1)
        return (grad_input + torch.exp(log_probs)) * grad_output, None


def vocabulary_parallel_cross_entropy(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Cross entropy in float32 over every leading position, as the models' own loss (`models.classification_loss`) and
    torchtitan's (`pred.flatten(0, 1).float()`) take it, computed as torch's loss_parallel computes it."""
    return _VocabularyParallelCrossEntropy.apply(out.float().reshape(-1, out.shape[-1]), target.reshape(-1))


class _MegatronCrossEntropy(torch.autograd.Function):
    """Mean cross entropy of `logits` (tokens x vocabulary, in the model's dtype) against `target`, op for op as
    Megatron-core's vocabulary-parallel cross entropy computes it on a rank (megatron/core/tensor_parallel/
    cross_entropy.py, `VocabParallelCrossEntropy`, which its fused variant under cross_entropy_loss_fusion,
    fusions/fused_cross_entropy.py, runs too): one float32 copy of the logits, shifted, exponentiated and
    normalised in place into the softmax it saves; its backward writes the gradient into that softmax in place
    (`grad_input = softmax`, then `grad_2d[arange, target] -= 1` and `mul_`), so it creates no tokens x vocabulary
    tensor of its own; autograd casts the float32 gradient to the logits' dtype."""

    @staticmethod
    def forward(ctx: Any, logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        probs = logits.float()
        probs -= torch.max(probs, dim=-1)[0].unsqueeze(-1)
        kept = target != IGNORE_INDEX
        safe_target = torch.where(kept, target, 0)
        picked = probs[torch.arange(probs.shape[0], device=probs.device), safe_target].clone()
        torch.exp(probs, out=probs)
        sum_exp = probs.sum(dim=-1)
        losses = torch.where(kept, torch.log(sum_exp) - picked, 0.0)
        probs.div_(sum_exp.unsqueeze(-1))
        total_weight = kept.sum().to(probs.dtype)
        ctx.save_for_backward(probs, safe_target, kept, total_weight)
        return losses.sum() / total_weight

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> tuple[torch.Tensor, None]:
        grad_input, safe_target, kept, total_weight = ctx.saved_tensors
        grad_input[torch.arange(grad_input.shape[0], device=grad_input.device), safe_target] -= kept.float()
        grad_input.mul_(torch.where(kept, grad_output / total_weight, 0.0).unsqueeze(-1))
        return grad_input, None


def megatron_cross_entropy(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Cross entropy over every leading position, computed as Megatron-core's computes it (`--cross-entropy
    megatron`): the logits handed over in the model's dtype, the float32 softmax kept and reused as the gradient."""
    return _MegatronCrossEntropy.apply(out.reshape(-1, out.shape[-1]), target.reshape(-1))
