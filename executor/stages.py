"""The model cut into the schedule's stages: contiguous layer ranges, one module per stage, the data every
rank draws alike, and the shapes that cross each stage edge.

Every rank builds the whole model from one seed, so a stage's initial weights equal those of the same layers
in a single-process run, whichever rank holds it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ..schedules import Schedule
from ..workload.models import BATCH, Model, build_model

DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16, "float16": torch.float16}


class ExecutorError(RuntimeError):
    """A run that cannot start or could not finish; one line saying which part and why."""


def even_bounds(layers: int, stages: int) -> list[int]:
    """Layer boundaries of `stages` contiguous ranges as even as can be (earlier stages take the extra layers):
    stage k holds layers bounds[k]:bounds[k+1]."""
    if not 1 <= stages <= layers:
        raise ExecutorError(f"cannot cut {layers} layers into {stages} stages: each stage needs at least one layer")
    base, extra = divmod(layers, stages)
    bounds = [0]
    for k in range(stages):
        bounds.append(bounds[-1] + base + (1 if k < extra else 0))
    return bounds


def check_bounds(bounds: Sequence[int], layers: int, stages: int) -> list[int]:
    bounds = [int(b) for b in bounds]
    if len(bounds) != stages + 1 or bounds[0] != 0 or bounds[-1] != layers or any(
            a >= b for a, b in zip(bounds, bounds[1:])):
        raise ExecutorError(f"stage bounds {bounds}: expected {stages + 1} increasing layer indices from 0 to "
                            f"{layers}, every stage holding at least one layer")
    return bounds


@dataclass(frozen=True)
class RunSpec:
    """What one run trains and how: everything a rank needs to rebuild the same setup on its own (picklable as
    long as `model` is a name or a module-level callable returning a Model).

    `model`: a built-in name or `package.module:attr` (with `model_options`), or a callable returning a
    Model. `bounds`: the stage partition (default: an even split of the layers). `microbatch_size`: samples
    per micro-batch. `recv_window`: how many receives a rank keeps posted ahead of the row it runs.
    """

    schedule: Schedule
    model: str | Callable[[], Model] = "mlp"
    model_options: dict[str, int] = field(default_factory=dict)
    microbatch_size: int = 4
    optimizer: str = "sgd"
    lr: float = 0.01
    seed: int = 0
    dtype: str = "float32"
    bounds: tuple[int, ...] | None = None
    threads_per_rank: int = 1
    timeout_s: float = 120.0
    recv_window: int = 16

    @property
    def torch_dtype(self) -> torch.dtype:
        if self.dtype not in DTYPES:
            raise ExecutorError(f"dtype must be one of {', '.join(DTYPES)} (got {self.dtype!r})")
        return DTYPES[self.dtype]

    def build_model(self) -> Model:
        """The model, initialised from `seed`, in `dtype` (the same on every rank and in any reference)."""
        torch.manual_seed(self.seed)
        model = self.model() if callable(self.model) else build_model(self.model, **self.model_options)
        for layer in model.layers:
            layer.to(self.torch_dtype)
        return model


def microbatch_data(spec: RunSpec, model: Model, minibatch: int, microbatch: int,
                    pipeline: int = 0) -> tuple[torch.Tensor, Any]:
    """Micro-batch `microbatch` of mini-batch `minibatch` for pipeline `pipeline`: (input, target), drawn
    from a generator seeded by those numbers, so every rank (and a reference) draws the same samples."""
    schedule = spec.schedule
    index = (pipeline * schedule.minibatches + minibatch) * schedule.microbatches + microbatch
    generator = torch.Generator().manual_seed(spec.seed * 1_000_003 + index)
    x, target = model.make_batch(spec.microbatch_size, generator)
    if x.is_floating_point():
        x = x.to(spec.torch_dtype)
    return x, target


@dataclass
class Stages:
    """The model cut into the schedule's stages: `modules[k]` runs layers `bounds[k]:bounds[k+1]`;
    `out_shapes[k]` / `out_dtypes[k]` what stage k hands on (and the gradient coming back has)."""

    model: Model
    bounds: list[int]
    modules: list[nn.Module]
    out_shapes: list[tuple[int, ...]]
    out_dtypes: list[torch.dtype]


def cut(spec: RunSpec, model: Model | None = None) -> Stages:
    """Cut `spec`'s model into its schedule's stages and find, from one micro-batch, the shapes on every edge.
    Chain models and chain stage graphs only: a stage DAG is refused with a clear message."""
    schedule = spec.schedule
    model = model if model is not None else spec.build_model()
    if set(schedule.graph.edges) != {(k, k + 1) for k in range(schedule.num_stages - 1)}:
        raise ExecutorError(f"{schedule.method}: the executor runs stage chains 0 -> 1 -> ... only; stage "
                            "graphs that branch or merge are not supported yet")
    if any(sources != (i - 1,) for i, sources in enumerate(model.inputs) if i > 0) or model.inputs[0] != (BATCH,):
        raise ExecutorError(f"model {model.name!r} is a DAG of layers; the executor runs chain models only yet")
    layers = len(model.layers)
    p = schedule.num_stages
    bounds = even_bounds(layers, p) if spec.bounds is None else check_bounds(spec.bounds, layers, p)
    modules = [nn.Sequential(*model.layers[bounds[k]:bounds[k + 1]]) for k in range(p)]
    x, _ = microbatch_data(spec, model, 0, 0)
    shapes, dtypes = [], []
    with torch.no_grad():
        for module in modules:
            x = module(x)
            shapes.append(tuple(x.shape))
            dtypes.append(x.dtype)
    return Stages(model, bounds, modules, shapes, dtypes)
