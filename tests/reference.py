"""References the executor's tests train against, written from the papers' rules and sharing no code with the
executor or with workload/optim.py: their own stage cut, data draw, optimizers and weight prediction, and a
backward of the MLP by hand. A bug in one of the executor's parts then shows as a difference instead of
passing on both sides.

What they take from pipesim is the contract a reference must meet to train the same thing: the model as
workload/models.py builds it (its layers, batches and loss) and the seeds it is drawn with.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from pipesim.executor import RunSpec
from pipesim.workload.models import Model, build_model

# The MLP's layers each stage holds, written out: as even as can be, the earlier stages taking the extra layer
# (mlp with `layers` blocks has layers + 1 Linear layers). Keyed (Linear layers, stages).
STAGE_LAYERS = {(5, 2): [[0, 1, 2], [3, 4]], (5, 3): [[0, 1], [2, 3], [4]]}

MOMENTUM = 0.9  # SGD with momentum, as pipesim's "momentum" optimizer
ADAMW_DECAY = 0.01  # AdamW's decoupled weight decay
HALF = ("bfloat16", "float16")  # trained in mixed precision, as Megatron-LM trains them: float32 master weights
# that the optimizer steps (its state float32), 16-bit copies of them that the passes compute with, and the
# micro-batches' 16-bit gradients summed in float32


def initial_model(spec: RunSpec) -> Model:
    """The model every rank builds: drawn from the spec's seed, in its dtype."""
    torch.manual_seed(spec.seed)
    model = build_model(spec.model, **spec.model_options)
    for layer in model.layers:
        layer.to(getattr(torch, spec.dtype))
    return model


def draw(spec: RunSpec, model: Model, minibatch: int, microbatch: int, pipeline: int = 0) -> tuple[torch.Tensor, Any]:
    """The samples of (pipeline, mini-batch, micro-batch): the sets are numbered in that order, set i drawn from a
    generator seeded spec.seed * 1_000_003 + i, so each pipeline trains on its own data."""
    schedule = spec.schedule
    number = (pipeline * schedule.minibatches + minibatch) * schedule.microbatches + microbatch
    x, target = model.make_batch(spec.microbatch_size, torch.Generator().manual_seed(spec.seed * 1_000_003 + number))
    return (x.to(getattr(torch, spec.dtype)) if x.is_floating_point() else x), target  # token ids stay whole


def optimizer(name: str, weights: list[torch.Tensor], lr: float) -> torch.optim.Optimizer:
    return {"sgd": lambda: torch.optim.SGD(weights, lr=lr),
            "momentum": lambda: torch.optim.SGD(weights, lr=lr, momentum=MOMENTUM),
            "adam": lambda: torch.optim.Adam(weights, lr=lr),
            "adamw": lambda: torch.optim.AdamW(weights, lr=lr, weight_decay=ADAMW_DECAY)}[name]()


def direction(opt: torch.optim.Optimizer, weights: list[torch.Tensor]) -> list[torch.Tensor] | None:
    """What the papers extrapolate one more update by, per unit of learning rate, from the state the optimizer
    holds for `weights`: SGD with momentum its momentum buffer v (SpecTrain, PipeOptim); Adam m_hat /
    (sqrt(v_hat) + eps) with both bias corrections (PipeOptim, XPipe), plus AdamW's decoupled decay * W. None
    before the first update: there is nothing to extrapolate yet."""
    states = [opt.state.get(w, {}) for w in weights]
    if not states or not states[0]:
        return None
    group = opt.param_groups[0]
    if isinstance(opt, torch.optim.SGD):
        if not group["momentum"]:
            raise ValueError("the papers predict with SGD's momentum, Adam or AdamW, not plain SGD")
        return [s["momentum_buffer"].clone() for s in states]
    beta1, beta2 = group["betas"]
    decay = group["weight_decay"] if isinstance(opt, torch.optim.AdamW) else 0.0
    out = []
    for w, s in zip(weights, states):
        t = float(s["step"])
        m_hat, v_hat = s["exp_avg"] / (1 - beta1 ** t), s["exp_avg_sq"] / (1 - beta2 ** t)
        out.append(m_hat / (v_hat.sqrt() + group["eps"]) + decay * w.detach())
    return out


@dataclass
class Snapshot:
    """A version of a stage's weights with what the papers predict from: the optimizer's direction then
    (None: none yet) and the learning rate."""

    weights: list[torch.Tensor]
    direction: list[torch.Tensor] | None
    lr: float

    @classmethod
    def of(cls, opt: torch.optim.Optimizer, weights: list[torch.Tensor]) -> Snapshot:
        return cls([w.detach().clone() for w in weights], direction(opt, weights), opt.param_groups[0]["lr"])

    def predicted(self, s: int) -> list[torch.Tensor]:
        """W - s * lr * d: the weights s updates ahead if each repeated the last one; s < 0: not predicted."""
        if s <= 0 or self.direction is None:
            return self.weights
        return [w - s * self.lr * d for w, d in zip(self.weights, self.direction)]


def forward_version(p: int, m: int, k: int, b: int, j: int = 0) -> int:
    """Updates stage k has made when it starts the forward of micro-batch j of mini-batch b: in 1F1B with
    p-k-1 warm-up forwards, backwards 0 .. u-(p-k-1)-1 are done before forward u = b*m + j, and an update
    follows every m-th backward."""
    return max(0, b * m + j - (p - k - 1)) // m


Rule = Callable[[int, int, int], tuple[tuple[int, int], tuple[int, int]]]


class Reference:
    """The MLP's stages trained mini-batch by mini-batch with explicit weights per op. Stage k's weights
    are a flat list (weight, bias, weight, bias, ...) of its Linear layers; every Linear but the model's last
    is followed by a ReLU. `history[k][v]` is version v (after v updates) with the optimizer's state then,
    from which a prediction s updates ahead is made by the paper's formula. In 16 bits (HALF) the weights the
    optimizer steps, its history and the elastic average's are float32 masters; an op computes with a 16-bit copy
    of what it reads."""

    def __init__(self, spec: RunSpec) -> None:
        self.spec = spec
        self.model = initial_model(spec)
        self.p, self.m = spec.schedule.num_stages, spec.schedule.microbatches
        self.compute = getattr(torch, spec.dtype)
        main = torch.float32 if spec.dtype in HALF else self.compute
        cut = STAGE_LAYERS[(len(self.model.layers), self.p)]
        self.weights = [[w.detach().to(main, copy=True) for i in layers for w in self.model.layers[i].parameters()]
                        for layers in cut]
        self.optimizers = [optimizer(spec.optimizer, ws, spec.lr) for ws in self.weights]
        self.history = [[self.snapshot(k)] for k in range(self.p)]

    def snapshot(self, k: int) -> Snapshot:
        return Snapshot.of(self.optimizers[k], self.weights[k])

    def gradients(self, forward: list[list[torch.Tensor]], backward: list[list[torch.Tensor]], x, target
                  ) -> list[list[torch.Tensor]]:
        """One micro-batch's weight gradients: forward on `forward`, the input gradients through `backward`
        (the weights the backward op runs on), by hand."""
        linears_f = [(ws[i], ws[i + 1]) for ws in forward for i in range(0, len(ws), 2)]
        linears_b = [ws[i] for ws in backward for i in range(0, len(ws), 2)]
        saved, h = [], x
        for i, (w, b) in enumerate(linears_f):
            z = nn.functional.linear(h, w, b)  # the op the model runs, so the float32 loss sees equal logits
            mask = (z > 0) if i < len(linears_f) - 1 else None
            saved.append((h, mask))
            h = z * mask if mask is not None else z
        logits = h.detach().requires_grad_(True)
        (dh,) = torch.autograd.grad(self.model.loss(logits, target) / self.m, logits)
        grads: list[torch.Tensor] = []
        for i in reversed(range(len(linears_f))):
            h, mask = saved[i]
            dz = dh * mask if mask is not None else dh
            grads[:0] = [dz.T @ h, dz.sum(0)]
            dh = dz @ linears_b[i]
        flat = iter(grads)
        return [[next(flat) for _ in ws] for ws in forward]

    def update(self, k: int, grads: list[torch.Tensor]) -> None:
        for w, g in zip(self.weights[k], grads):
            w.grad = g
        self.optimizers[k].step()
        self.history[k].append(self.snapshot(k))

    def train(self, rule: Rule, pipeline: int = 0) -> None:
        """rule(k, b, j) -> ((forward version, s), (backward version, s)); s <= 0: not predicted."""
        for b in range(self.spec.schedule.minibatches):
            self.minibatch(rule, b, pipeline)

    def minibatch(self, rule: Rule, b: int, pipeline: int = 0) -> None:
        sums = [[torch.zeros_like(w) for w in ws] for ws in self.weights]
        for j in range(self.m):
            x, target = draw(self.spec, self.model, b, j, pipeline)
            reads = [rule(k, b, j) for k in range(self.p)]
            forward = [self._read(self.history[k][v].predicted(s)) for k, ((v, s), _) in enumerate(reads)]
            backward = [self._read(self.history[k][v].predicted(s)) for k, (_, (v, s)) in enumerate(reads)]
            for acc, grads in zip(sums, self.gradients(forward, backward, x, target)):
                for a, g in zip(acc, grads):
                    a.add_(g)
        for k in range(self.p):
            self.update(k, sums[k])

    def _read(self, weights: list[torch.Tensor]) -> list[torch.Tensor]:
        """What an op computes with: `weights` in the model's dtype."""
        return [w.to(self.compute) for w in weights]

    def flat(self) -> list[torch.Tensor]:
        """Every stage's weights in order, as the executor's final weights list them."""
        return [w for ws in self.weights for w in ws]


def single_process(spec: RunSpec, losses: list[float] | None = None) -> list[torch.Tensor]:
    """The model trained in one process, its layers wired as the model says (a DAG for two-branch): what a
    synchronous schedule's run must end with. Each mini-batch's loss is appended to `losses`, if given. In 16 bits
    (HALF) in mixed precision: each micro-batch's 16-bit gradients summed in float32, the optimizer stepping float32
    masters (returned), the model's weights copied from them after each update."""
    model = initial_model(spec)
    params = list({id(p): p for layer in model.layers for p in layer.parameters()}.values())  # a tied one once
    half = spec.dtype in HALF
    masters = [p.detach().to(torch.float32, copy=True) for p in params] if half else params
    opt = optimizer(spec.optimizer, masters, spec.lr)
    m = spec.schedule.microbatches
    for b in range(spec.schedule.minibatches):
        total = 0.0
        for j in range(m):
            x, target = draw(spec, model, b, j)
            loss = model.loss(model.forward(x), target) / m
            loss.backward()
            total += float(loss.detach())
            for master, p in zip(masters, params) if half else ():
                if p.grad is not None:
                    master.grad = p.grad.float() if master.grad is None else master.grad.add_(p.grad)
                    p.grad = None
        if losses is not None:
            losses.append(total)
        opt.step()
        opt.zero_grad()
        with torch.no_grad():
            for p, master in zip(params, masters) if half else ():
                p.copy_(master)
    return [w.detach() for w in masters]
