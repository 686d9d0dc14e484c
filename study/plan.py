"""What a study trains: the setting every run shares, the arms (a method, with the source of its prediction
distance where it predicts), the optimizers with their learning rates, and the seeds. Pure data, no torch.

Every arm sees the same sample budget: N mini-batches of m micro-batches of b samples. A method that runs P
pipelines side by side (AvgPipe) feeds each pipeline its own samples, so it runs N/P mini-batches per pipeline.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, field

import numpy as np

from ..schedules import Schedule, ScheduleError, lower
from ..schedules.catalogue import method_named

# The seeds' methods, in the order the paper trail runs: synchronous baselines, PipeDream and its fixes.
DEFAULT_METHODS = ("gpipe", "1f1b", "pipedream", "pipedream-2bw", "spectrain", "pipeoptim", "xpipe", "avgpipe")
# A learning rate per optimizer at which the default setting trains well synchronously and PipeDream's
# staleness visibly costs accuracy (README: "The accuracy study").
DEFAULT_LR = {"sgd": 0.1, "momentum": 0.05, "adam": 0.002, "adamw": 0.002}
DEFAULT_OPTIMIZERS = ("momentum", "adam")


@dataclass(frozen=True)
class Setting:
    """What every run of a study shares; a results file holds runs of one setting only."""

    model: str = "mlp"
    model_options: dict[str, int] = field(default_factory=lambda: {"layers": 8, "width": 128})
    stages: int = 4
    microbatches: int = 4
    microbatch_size: int = 16
    minibatches: int = 60
    pipelines: int = 2  # AvgPipe's P

    @property
    def samples(self) -> int:
        """The sample budget of every run."""
        return self.minibatches * self.microbatches * self.microbatch_size

    def as_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class Arm:
    """One method as trained: its name and, for a predicting method, the source of s (None: it predicts
    nothing). `primary`: whether that source is the one the method publishes."""

    method: str
    source: str | None = None
    primary: bool = True

    @property
    def label(self) -> str:
        return self.method if self.primary else f"{self.method} ({self.source})"


@dataclass(frozen=True)
class RunKey:
    """One training run of a study: an arm, an optimizer at a learning rate, a seed."""

    method: str
    source: str | None
    optimizer: str
    lr: float
    seed: int


def build(setting: Setting, method: str, source: str | None = None) -> Schedule:
    """The arm's schedule: `setting`'s shape, with the sample budget split over the method's pipelines."""
    spec = method_named(method)
    _, pipelines = spec.shape(pipelines=setting.pipelines if spec.reads("pipelines") else None)
    if setting.minibatches % pipelines:
        raise ScheduleError(f"{method} runs {pipelines} pipelines, each on its own samples: the mini-batches "
                            f"({setting.minibatches}) must be a multiple of {pipelines} for the same sample budget")
    params = spec.params(setting.stages, setting.microbatches, setting.minibatches // pipelines,
                         pipelines=pipelines if spec.reads("pipelines") else None,
                         prediction=source if spec.reads("prediction") else None)
    return spec.build(params)


def arms(setting: Setting, methods: Sequence[str], prediction: str | None = None) -> list[Arm]:
    """The arms to train. A predicting method runs with `prediction` as its source of s when given; else with
    its primary source, plus one arm per other source whose distances differ in this setting (the seeds'
    published s against their code's and the count: the choice changes training)."""
    out = []
    for method in methods:
        schedule = build(setting, method, prediction)
        sources = schedule.policy.sources
        if not sources:
            out.append(Arm(method))
            continue
        chosen = schedule.policy.source
        out.append(Arm(method, chosen, primary=chosen == schedule.policy.primary_source))
        if prediction is None:
            distances = lower(schedule).prediction
            for other in sources:
                if other != chosen and not np.array_equal(lower(build(setting, method, other)).prediction,
                                                          distances):
                    out.append(Arm(method, other, primary=False))
    return out
