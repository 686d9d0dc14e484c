"""Optimizers, their weight prediction, and elastic averaging: the parts of a training step that the
asynchronous methods change. Calibration times them; the executor runs them.

All work on lists of tensors with torch's foreach kernels, one launch per list rather than one per tensor,
since a stage may hold hundreds of parameter tensors.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

import torch

from ..profiles.schema import OPTIMIZERS  # the names profiles and the simulator know; "momentum" is SGD-momentum

__all__ = ["OPTIMIZERS", "elastic_average", "make_optimizer", "predict_weights"]


def make_optimizer(name: str, params: Iterable[torch.Tensor], lr: float, *, momentum: float = 0.9,
                   weight_decay: float = 0.01) -> torch.optim.Optimizer:
    """The optimizer `name` (one of OPTIMIZERS) over `params`: `momentum` applies to "momentum" (SGD with
    momentum) and `weight_decay` to "adamw" (decoupled decay) only; "sgd" and "adam" have no decay."""
    if name == "sgd":
        return torch.optim.SGD(params, lr=lr)
    if name == "momentum":
        return torch.optim.SGD(params, lr=lr, momentum=momentum)
    if name == "adam":
        return torch.optim.Adam(params, lr=lr)
    if name == "adamw":
        return torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay)
    raise ValueError(f"optimizer: choose from {', '.join(OPTIMIZERS)} (got {name!r})")


@torch.no_grad()
def predict_weights(optimizer: torch.optim.Optimizer, weights: Sequence[torch.Tensor],
                    distance: int) -> list[torch.Tensor]:
    """The weights `distance` updates ahead, as new tensors: W - distance * lr * d, d the direction of the
    optimizer's update, as if the next updates repeated the last one.

    `weights` are tensors the optimizer steps (its state is looked up by them); the optimizer has one
    parameter group, as make_optimizer's do. The direction d is
    - SGD: the gradient the parameter holds (so predict before zeroing it);
    - SGD with momentum: the momentum buffer (SpecTrain's and PipeOptim's rule);
    - Adam: m_hat / (sqrt(v_hat) + eps) with both bias corrections (PipeOptim's Adam rule, XPipe's prediction);
    - AdamW: the same plus weight_decay * W, its decoupled decay, applied at every predicted step.
    A weight the optimizer has no direction for yet (no gradient, no momentum buffer, no Adam step) has
    nothing to extrapolate: its prediction is a copy of itself. Distance 0 returns copies.
    """
    if distance < 0:
        raise ValueError(f"prediction distance must be >= 0 (got {distance})")
    if len(optimizer.param_groups) != 1:
        raise ValueError(f"predict_weights needs one parameter group (got {len(optimizer.param_groups)})")
    group = optimizer.param_groups[0]
    unsupported = [flag for flag in ("maximize", "nesterov", "amsgrad") if group.get(flag)]
    if unsupported:
        raise ValueError(f"predict_weights: {unsupported[0]} is not supported")
    if not isinstance(optimizer, (torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW)):
        raise TypeError(f"predict_weights: no prediction rule for {type(optimizer).__name__}")
    states = [optimizer.state.get(w, {}) for w in weights]
    if isinstance(optimizer, torch.optim.SGD):
        if group["momentum"]:
            directions = [state.get("momentum_buffer") for state in states]
        else:
            directions = [w.grad for w in weights]
        live = [i for i, d in enumerate(directions) if d is not None]
    else:
        live = [i for i, state in enumerate(states) if "exp_avg" in state]
    if distance == 0 or not live:
        return [w.detach().clone() for w in weights]

    moving = [weights[i] for i in live]
    lr = group["lr"]
    if isinstance(optimizer, torch.optim.SGD):
        predicted = torch._foreach_add(moving, [directions[i] for i in live], alpha=-distance * lr)
    else:
        beta1, beta2 = group["betas"]
        steps = [float(states[i]["step"]) for i in live]
        denom = torch._foreach_sqrt([states[i]["exp_avg_sq"] for i in live])
        torch._foreach_div_(denom, [math.sqrt(1 - beta2 ** t) for t in steps])
        torch._foreach_add_(denom, group["eps"])
        predicted = torch._foreach_addcdiv(moving, [states[i]["exp_avg"] for i in live], denom,
                                           [-distance * lr / (1 - beta1 ** t) for t in steps])
        decoupled = isinstance(optimizer, torch.optim.AdamW) or group.get("decoupled_weight_decay", False)
        if decoupled and group["weight_decay"]:
            torch._foreach_add_(predicted, moving, alpha=-distance * lr * group["weight_decay"])
    out = dict(zip(live, predicted))
    return [out[i] if i in out else w.detach().clone() for i, w in enumerate(weights)]


@torch.no_grad()
def elastic_average(replicas: Sequence[Sequence[torch.Tensor]], reference: Sequence[torch.Tensor],
                    alpha: float) -> None:
    """Synchronous elastic averaging (EASGD, as AvgPipe averages its pipelines), in place: with
    D_i = X_i - R for every replica X_i, each X_i -= alpha * D_i and R += alpha * sum_i D_i, all differences
    taken before anything moves. One replica is one pipeline's copy of a stage's weights."""
    if not 0 <= alpha <= 1:
        raise ValueError(f"elastic averaging needs 0 <= alpha <= 1 (got {alpha})")
    if not replicas:
        raise ValueError("elastic averaging needs at least one replica")
    if any(len(replica) != len(reference) for replica in replicas):
        raise ValueError(f"every replica must hold {len(reference)} tensors, as the reference does")
    if not reference:
        return
    total = None  # sum of the differences, one replica's at a time so memory stays at two copies
    for replica in replicas:
        diff = torch._foreach_sub(replica, reference)
        torch._foreach_add_(replica, diff, alpha=-alpha)
        if total is None:
            total = diff
        else:
            torch._foreach_add_(total, diff)
    torch._foreach_add_(reference, total, alpha=alpha)
