"""Optimizers, their weight prediction, and elastic averaging: the parts of a training step that the
asynchronous methods change. Calibration times them; the executor runs them.

The optimizers are torch.optim's update rules (SGD, with momentum, Adam, AdamW at their defaults) written
out here, because torch.optim's `step` and `add_param_group` import torch._dynamo on their first call: 1.5 to
1.9 s in every process that steps one (each rank of a run, calibration's own), longer than a small model's
whole run. The arithmetic is torch's own on CPU, op for op, so the weights come out bit for bit as torch.optim's
(tests/test_workload.py holds them to it). All work on lists of tensors with torch's foreach kernels, one launch
per list rather than one per tensor, since a stage may hold hundreds of parameter tensors.

The tensors these ops write (a prediction, averaging's differences, Adam's denominator) come, on CPU, from `Spares`,
where the executor keeps those it is done with for the next op. SpecTrain's and PipeOptim's runtimes (PipeDream's,
extended) allocate nothing there either: they keep their stashed versions in a queue of copies made once and
refilled with `copy_` (`initialize_queue`, `get_params`), and predict into the module's own parameters in place
(`p.data.add_`; ntueclab/SpecTrain-PyTorch src/optimizer.py at b93355d, guanleics/PipeOptim optimizer.py at
8f5e4f8).
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Hashable, Iterable, Sequence
from typing import Any

import torch

# the names profiles and the simulator know; "momentum" is SGD-momentum
from ..profiles.schema import OPTIMIZERS, optimizer_refusal

__all__ = ["OPTIMIZERS", "Optimizer", "Spares", "elastic_average", "make_optimizer", "predict_weights"]

ADAM_BETAS = (0.9, 0.999)  # torch.optim.Adam's defaults
ADAM_EPS = 1e-8


class Spares:
    """Tensors an op is done with, kept by shape, stride, dtype and device for the next op that needs the same, or
    (`keep` False) let go. On CPU glibc hands a freed block of a few MB back to the OS, and the next tensor of its
    size is faulted in afresh, or not, as the process's history has moved glibc's thresholds (allocator.py): a 4.3
    MB prediction took 0.21-0.30 ms on reused heap and 1.2-1.7 ms on fresh pages, so an op that allocated its output
    timed in calibration in either mode (docs/fidelity.md). Taken from here, its tensors are made once, in the
    first rounds, and the op is its arithmetic alone, in calibration as in the executor. On a GPU torch's caching
    allocator keeps freed blocks the same way, and the executor's books count what it holds allocated: nothing is
    kept here."""

    def __init__(self, keep: bool) -> None:
        self.keep = keep
        self.free: dict[Hashable, list[torch.Tensor]] = defaultdict(list)

    @staticmethod
    def _key(t: torch.Tensor) -> Hashable:
        return tuple(t.shape), t.stride(), t.dtype, t.device

    def take(self, like: Iterable[torch.Tensor]) -> list[torch.Tensor]:
        """Tensors shaped as `like`'s, contents undefined: kept ones where there are, else new."""
        return [self.free[key].pop() if self.free.get(key := self._key(t)) else
                torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=t.device) for t in like]

    def give(self, tensors: Iterable[torch.Tensor]) -> int:
        """Keep `tensors` for a later `take`, each as a new alias of its storage, or free that storage: whatever
        else still views it (a forward's graph holding used weights as its leaves until its backward, which
        unpacks the weights its own row names) keeps its tensor and shape, all a weight gradient needs, as the
        original codes swapped `param.data`. The bytes given."""
        given = 0
        for t in tensors:
            storage = t.untyped_storage()
            given += storage.nbytes()
            if self.keep:
                self.free[self._key(t)].append(t.detach())
            else:
                storage.resize_(0)  # a second view of the same storage finds it empty
        return given


NO_SPARES = Spares(keep=False)  # keeps nothing, so stateless: the one for every caller that gives none


class Optimizer:
    """One of OPTIMIZERS over `params`, shaped as torch.optim's: one parameter group (`param_groups[0]` holds the
    params and hyperparameters; the executor swaps its params for copies), and per-tensor `state` under torch's
    keys (`momentum_buffer`; `step`, `exp_avg`, `exp_avg_sq`), made at a tensor's first step with a gradient.
    `step()` updates every parameter that holds a gradient, as torch.optim does. Adam's denominators, in a step and
    a prediction, are written as `spares` has it (`_computed`) and given back."""

    def __init__(self, name: str, params: Iterable[torch.Tensor], lr: float, *, momentum: float = 0.0,
                 weight_decay: float = 0.0, spares: Spares = NO_SPARES) -> None:
        if (refused := optimizer_refusal(name)) is not None:
            raise ValueError(refused)
        self.name = name
        self.spares = spares
        group: dict[str, Any] = {"params": list(params), "lr": lr}
        if name in ("sgd", "momentum"):
            group["momentum"] = momentum
        else:
            group.update(betas=ADAM_BETAS, eps=ADAM_EPS, weight_decay=weight_decay)
        self.param_groups = [group]
        self.state: dict[torch.Tensor, dict[str, torch.Tensor]] = {}

    def zero_grad(self) -> None:
        """Every parameter's gradient dropped (torch.optim's default, set to None)."""
        for param in self.param_groups[0]["params"]:
            param.grad = None

    @torch.no_grad()
    def step(self) -> None:
        group = self.param_groups[0]
        params = [p for p in group["params"] if p.grad is not None]
        if not params:
            return
        grads = [p.grad for p in params]
        if self.name in ("sgd", "momentum"):
            self._sgd(params, grads, group)
        else:
            self._adam(params, grads, group)

    def _sgd(self, params: list[torch.Tensor], grads: list[torch.Tensor], group: dict[str, Any]) -> None:
        """torch.optim.SGD without dampening, decay or Nesterov: the momentum buffer starts as the first
        gradient, then v = momentum * v + g; the weights move by -lr times it (or the gradient, without)."""
        momentum = group["momentum"]
        if momentum:
            kept = [(self.state[p]["momentum_buffer"], g) for p, g in zip(params, grads) if p in self.state]
            for p, g in zip(params, grads):
                if p not in self.state:
                    self.state[p] = {"momentum_buffer": g.detach().clone()}
            if kept:
                buffers = [buffer for buffer, _ in kept]
                torch._foreach_mul_(buffers, momentum)
                torch._foreach_add_(buffers, [g for _, g in kept])
            grads = [self.state[p]["momentum_buffer"] for p in params]
        torch._foreach_add_(params, grads, alpha=-group["lr"])

    def _adam(self, params: list[torch.Tensor], grads: list[torch.Tensor], group: dict[str, Any]) -> None:
        """torch.optim.Adam's update on CPU, in its order (AdamW first decays the weights by lr * decay): the
        moments lerp and decay, then W += -lr / (1 - beta1^t) * m / (sqrt(v) / sqrt(1 - beta2^t) + eps)."""
        lr, (beta1, beta2), eps, decay = group["lr"], group["betas"], group["eps"], group["weight_decay"]
        step_dtype = torch.float64 if torch.get_default_dtype() == torch.float64 else torch.float32  # as torch's
        for p in params:
            if p not in self.state:
                self.state[p] = {"step": torch.tensor(0.0, dtype=step_dtype, device="cpu"),  # torch's, on the host
                                 "exp_avg": torch.zeros_like(p, memory_format=torch.preserve_format),
                                 "exp_avg_sq": torch.zeros_like(p, memory_format=torch.preserve_format)}
        states = [self.state[p] for p in params]
        steps = [state["step"] for state in states]
        torch._foreach_add_(steps, 1)
        if decay and self.name == "adamw":
            torch._foreach_mul_(params, 1 - lr * decay)
        exp_avgs = [state["exp_avg"] for state in states]
        exp_avg_sqs = [state["exp_avg_sq"] for state in states]
        torch._foreach_lerp_(exp_avgs, grads, 1 - beta1)
        torch._foreach_mul_(exp_avg_sqs, beta2)
        torch._foreach_addcmul_(exp_avg_sqs, grads, grads, value=1 - beta2)
        counts = [step.item() for step in steps]
        denom = _computed(self.spares, "sqrt", exp_avg_sqs)
        torch._foreach_div_(denom, [(1 - beta2 ** t) ** 0.5 for t in counts])
        torch._foreach_add_(denom, eps)
        torch._foreach_addcdiv_(params, exp_avgs, denom, [-(lr / (1 - beta1 ** t)) for t in counts])
        self.spares.give(denom)


def _computed(spares: Spares, op: str | None, tensors: Sequence[torch.Tensor], *args: Any,
              **kwargs: Any) -> list[torch.Tensor]:
    """torch's foreach `op` over `tensors` (then `args`), out of place (None: copies of `tensors`), the caller's to
    give back to `spares`. Where the spares keep nothing (a GPU's executor and calibration, and the count on the meta
    device, whose optimizer step planning/estimate.py prices from the bytes it moves), in new tensors: one pass, as
    torch.optim's Adam takes its roots and PipeOptim predicts. Else (CPU) in tensors taken from `spares`: a copy, then
    `op` in place, a pass more (a 62-layer GPT's Adam step on an A100 38.4 -> 46.5 ms a stage, counted so)."""
    tensors = list(tensors)
    if not spares.keep:
        if op is None:
            return [t.clone() for t in tensors]
        return list(getattr(torch, f"_foreach_{op}")(tensors, *args, **kwargs))
    out = spares.take(tensors)
    torch._foreach_copy_(out, tensors)
    if op is not None:
        getattr(torch, f"_foreach_{op}_")(out, *args, **kwargs)
    return out


def make_optimizer(name: str, params: Iterable[torch.Tensor], lr: float, *, momentum: float = 0.9,
                   weight_decay: float = 0.01, spares: Spares = NO_SPARES) -> Optimizer:
    """The optimizer `name` (one of OPTIMIZERS) over `params`: `momentum` applies to "momentum" (SGD with
    momentum) and `weight_decay` to "adamw" (decoupled decay) only; "sgd" and "adam" have no decay."""
    return Optimizer(name, params, lr, momentum=momentum if name == "momentum" else 0.0,
                     weight_decay=weight_decay if name == "adamw" else 0.0, spares=spares)


@torch.no_grad()
def predict_weights(optimizer: Optimizer, weights: Sequence[torch.Tensor], distance: int,
                    spares: Spares = NO_SPARES) -> list[torch.Tensor]:
    """The weights `distance` updates ahead, in tensors as `spares` has them (`_computed`; the caller's to give
    back; `NO_SPARES`: new ones): W - distance * lr * d, d the direction of the optimizer's update, as if the next
    updates repeated the last one.

    `weights` are tensors the optimizer steps (its state is looked up by them). The direction d is
    - SGD: the gradient the parameter holds (so predict before zeroing it);
    - SGD with momentum: the momentum buffer (SpecTrain's and PipeOptim's rule);
    - Adam: m_hat / (sqrt(v_hat) + eps) with both bias corrections (PipeOptim's Adam rule, XPipe's prediction),
      its denominator in the optimizer's spares;
    - AdamW: the same plus weight_decay * W, its decoupled decay, applied at every predicted step.
    A weight the optimizer has no direction for yet (no gradient, no momentum buffer, no Adam step) has
    nothing to extrapolate: its prediction is a copy of itself. Distance 0 gives copies.
    """
    if distance < 0:
        raise ValueError(f"prediction distance must be >= 0 (got {distance})")
    group = optimizer.param_groups[0]
    states = [optimizer.state.get(w, {}) for w in weights]
    sgd = optimizer.name in ("sgd", "momentum")
    if sgd:
        if group["momentum"]:
            directions = [state.get("momentum_buffer") for state in states]
        else:
            directions = [w.grad for w in weights]
        live = [i for i, d in enumerate(directions) if d is not None]
    else:
        live = [i for i, state in enumerate(states) if "exp_avg" in state]
    if distance == 0 or not live:
        return _computed(spares, None, weights)

    moving = [weights[i] for i in live]
    lr = group["lr"]
    if sgd:
        predicted = _computed(spares, "add", moving, [directions[i] for i in live], alpha=-distance * lr)
    else:
        beta1, beta2 = group["betas"]
        steps = [float(states[i]["step"]) for i in live]
        denom = _computed(optimizer.spares, "sqrt", [states[i]["exp_avg_sq"] for i in live])
        torch._foreach_div_(denom, [math.sqrt(1 - beta2 ** t) for t in steps])
        torch._foreach_add_(denom, group["eps"])
        predicted = _computed(spares, "addcdiv", moving, [states[i]["exp_avg"] for i in live], denom,
                              [-distance * lr / (1 - beta1 ** t) for t in steps])
        optimizer.spares.give(denom)
        if optimizer.name == "adamw" and group["weight_decay"]:
            torch._foreach_add_(predicted, moving, alpha=-distance * lr * group["weight_decay"])
    if len(live) == len(weights):
        return predicted
    out = dict(zip(live, predicted))
    copies = iter(_computed(spares, None, [w for i, w in enumerate(weights) if i not in out]))
    return [out[i] if i in out else next(copies) for i in range(len(weights))]


@torch.no_grad()
def elastic_average(replicas: Sequence[Sequence[torch.Tensor]], reference: Sequence[torch.Tensor],
                    alpha: float, spares: Spares = NO_SPARES) -> None:
    """Synchronous elastic averaging (EASGD, as AvgPipe averages its pipelines), in place: with
    D_i = X_i - R for every replica X_i, each X_i -= alpha * D_i and R += alpha * sum_i D_i, all differences
    taken before anything moves, in tensors as `spares` has them (`_computed`) and given back (`NO_SPARES`: new ones).
    One replica is one pipeline's copy of a stage's weights."""
    if not 0 <= alpha <= 1:
        raise ValueError(f"elastic averaging needs 0 <= alpha <= 1 (got {alpha})")
    if not replicas:
        raise ValueError("elastic averaging needs at least one replica")
    if any(len(replica) != len(reference) for replica in replicas):
        raise ValueError(f"every replica must hold {len(reference)} tensors, as the reference does")
    if not reference:
        return
    total = None  # the sum of the differences, one replica's at a time: two copies' memory
    for replica in replicas:
        diff = _computed(spares, "sub", replica, list(reference))
        torch._foreach_add_(replica, diff, alpha=-alpha)
        if total is None:
            total = diff
        else:
            torch._foreach_add_(total, diff)
            spares.give(diff)
    torch._foreach_add_(reference, total, alpha=alpha)
    spares.give(total)
