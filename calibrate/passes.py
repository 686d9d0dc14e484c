"""A stage's forward and backward timed as the executor computes them, on the calibrated partition's stages.

Layers are timed one at a time (measure.py), and a stage's rows cost more than their layers' sum: the executor
runs a stage as one module through functional_call under its saved-tensor hooks (a few tens of microseconds
per layer), and a backward over several layers no longer finds each layer's weights and activations in cache
as a layer timed alone does (a four-layer MLP stage's backward 1.2-1.4x its layers' sum on the 2-core CPUs
here). So `stage_runs` gives each stage's F, B, I and W with the executor's own code (`cut`'s StageModule,
`stage_forward` and its `Tape`, `full_backward`, `backward_input`, `backward_weight`) on the inputs the stages
before it compute, and the profile records their times (`StagePasses`); `calibrate --passes-as torch` times them
as torch.distributed.pipelining's stage computes them instead (`TorchStageRun`). The same runs are the pass a step is
timed after, or whose memory traffic it replays (measure.py), and a rank's work in the contention probe
(contention.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from ..executor import RunSpec, cut, microbatch_data
from ..executor.backward import backward_input, backward_weight, full_backward
from ..executor.runtime import Ledger, Tape, stage_forward
from ..executor.stages import StageModule
from ..executor.weights import Weights, main_dtype
from ..schedules import ScheduleParams
from ..schedules.catalogue import build_schedule
from ..workload.models import Model

Saved = tuple[list[torch.Tensor], list[torch.Tensor], Any]  # a forward's (inputs, outputs, what I left for W)


@dataclass
class StageRun:
    """One stage's rows as `measure._time` phases: F returns what B, or I then W, runs on. `weights` are the
    tensors the passes run on (the stage's parameters, in its module's order): a caller may put others in
    their place. Each backward adds the weights' gradients into the stage's one buffer `into`, as the
    executor's do for every micro-batch of a mini-batch but its first (in `main`, float32 for 16-bit weights, as
    the executor's main gradients; None: the weights' dtype)."""

    module: StageModule
    buffers: dict[str, torch.Tensor]
    names: list[str]
    weights: list[torch.Tensor]
    args: list[torch.Tensor]  # the batch, where the stage reads it, then its received edge tensors
    received: list[bool]  # which of `args` arrive over an edge (they need an input gradient)
    grad_outputs: list[torch.Tensor | None]  # per outgoing edge, or [None] under the loss
    loss: Any
    into: list[torch.Tensor | None] = field(default_factory=list)
    main: torch.dtype | None = None
    saved_bytes: int = 0  # what the last forward saved for backward (its Ledger's count)

    @property
    def input_gradients(self) -> bool:
        """Whether its backward computes a gradient for an input: one received over an edge, floating point."""
        return any(edge and a.is_floating_point() for a, edge in zip(self.args, self.received))

    @property
    def differentiable(self) -> bool:
        """Whether the stage has a backward: it holds weights or passes a gradient back."""
        return bool(self.weights) or self.input_gradients

    def _buffer(self) -> list[torch.Tensor | None]:
        """The gradient buffer, started (by the first backward, as a mini-batch's first starts it) and kept."""
        if len(self.into) != len(self.weights):
            self.into = [None] * len(self.weights)
        return self.into

    def leaves(self) -> list[torch.Tensor]:
        """A forward's arguments: the received ones as fresh leaves (a gradient for each floating-point one)."""
        return [a.detach().requires_grad_(a.is_floating_point()) if edge else a
                for a, edge in zip(self.args, self.received)]

    def forward(self, _: Any = None) -> Saved:
        inputs = self.leaves()
        ledger = Ledger()
        tape = Tape(Weights(self.weights, 0), ledger)
        parameters = {**dict(zip(self.names, self.weights)), **self.buffers}
        outputs = stage_forward(self.module, parameters, inputs, tape, self.loss)
        self.saved_bytes = ledger.total
        return [a for a, edge in zip(inputs, self.received) if edge], outputs, None

    def backward(self, saved: Saved) -> Saved:
        inputs, outputs, _ = saved
        full_backward(outputs, self.grad_outputs, inputs, self.weights, self._buffer(), self.main)
        return saved

    def backward_input(self, saved: Saved) -> Saved:
        inputs, outputs, _ = saved
        _, pending = backward_input(outputs, self.grad_outputs, inputs, self.weights)
        return [], [], pending

    def backward_weight(self, saved: Saved) -> Saved:
        backward_weight(saved[2], self.weights, self._buffer(), self.main)
        return saved


@dataclass
class TorchStageRun:
    """One stage's rows as torch.distributed.pipelining's `PipelineStage` computes them, for a profile that
    predicts torch's runtime (`calibrate --passes-as torch`): the stage module called as it is (`forward_one_chunk`,
    the last stage's loss in its forward, as `_maybe_compute_loss` runs it inside the F action), its backward
    torch's own `stage_backward` (or `stage_backward_input` then `stage_backward_weight`; a first stage's I does
    nothing and its W is the whole backward, as `backward_weight_one_chunk` runs stage 0), adding into the
    parameters' `.grad` (torch/distributed/pipelining/stage.py, _backward.py). The executor's functional_call
    and saved-tensor hooks cost 0.3-0.5 ms a pass more on the 2-core CPUs here: a width-16 MLP stage's F + B
    1.65-1.78x torch's CPU time, a width-1024 one's F 1.01-1.08x and B 1.00-1.16x (interleaved rounds). Same
    `_time` phases as `StageRun`'s."""

    run: StageRun

    @property
    def input_gradients(self) -> bool:
        return self.run.input_gradients

    @property
    def differentiable(self) -> bool:
        return self.run.differentiable

    def forward(self, _: Any = None) -> Saved:
        inputs = self.run.leaves()
        out = self.run.module(*inputs)
        return inputs, [self.run.loss(out)] if self.run.loss is not None else list(out), None

    def _ends(self, outputs: list[torch.Tensor]) -> tuple[Any, list[torch.Tensor | None] | None]:
        """What torch's backward starts from: the last stage's loss with no gradient, else the outputs with theirs."""
        return (outputs[0], None) if self.run.loss is not None else (outputs, self.run.grad_outputs)

    def backward(self, saved: Saved) -> Saved:
        from torch.distributed.pipelining._backward import stage_backward

        inputs, outputs, _ = saved
        stage_backward(*self._ends(outputs), inputs)
        return saved

    def backward_input(self, saved: Saved) -> Saved:
        from torch.distributed.pipelining._backward import stage_backward_input

        if not self.input_gradients:
            return saved
        inputs, outputs, _ = saved
        ends, grads = self._ends(outputs)
        _, groups = stage_backward_input([ends] if grads is None else list(ends), grads, inputs,
                                         self.run.module.parameters())
        return inputs, outputs, groups

    def backward_weight(self, saved: Saved) -> Saved:
        from torch.distributed.pipelining._backward import stage_backward_weight

        if saved[2] is None:
            return self.backward(saved)
        stage_backward_weight(self.run.module.parameters(), saved[2])
        return saved


def stage_runs(model: Model, bounds: list[int], dtype: str, microbatch_size: int) -> list[StageRun]:
    """Every stage of the chain cut at `bounds` (the model on its device and dtype, as `measure_bytes` left
    it), each on micro-batch 0 as the stages before it pass it on."""
    stages = len(bounds) - 1
    schedule = build_schedule("gpipe", ScheduleParams(stages=stages, microbatches=1, minibatches=1))
    spec = RunSpec(schedule, model.name, microbatch_size=microbatch_size, dtype=dtype, bounds=tuple(bounds))
    cutting = cut(spec, model)
    device = next((p.device for layer in model.layers for p in layer.parameters()), torch.device("cpu"))
    batch, target = microbatch_data(spec, model, 0, 0)
    batch = batch.to(device)
    target = target.to(device) if torch.is_tensor(target) else target
    carried: dict[tuple[int, int], torch.Tensor] = {}
    runs = []
    for k, module in enumerate(cutting.modules):
        args = ([batch] if cutting.reads_batch[k] else []) + [carried[e] for e in cutting.in_edges[k]]
        with torch.no_grad():
            out = module(*args)
        last = not cutting.out_edges[k]
        if not last:
            carried.update(zip(cutting.out_edges[k], out))
        named = list(module.named_parameters())
        runs.append(StageRun(
            module=module, buffers=dict(module.named_buffers()), names=[name for name, _ in named],
            weights=[p.detach().clone().requires_grad_(True) for _, p in named], args=args,
            received=([False] if cutting.reads_batch[k] else []) + [True] * len(cutting.in_edges[k]),
            grad_outputs=[None] if last else [torch.randn_like(o) for o in out],
            loss=(lambda y: model.loss(y, target)) if last else None, main=main_dtype(module.parameters())))
    return runs
