"""A study's results file: every finished run and timing, written atomically after each one, so a long study
resumes where it stopped and is re-plotted without training again. Also the per-arm summary over seeds the
table and the page show. No torch."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, field_validator

from ..files import DOCUMENT_KINDS, STUDY_RESULTS, read_document, validated
from ..traces.metrics import loss_text
from ..traces.trace import write_atomic
from .plan import Arm, RunKey, Setting

FORMAT_VERSION = 1
TAIL_FRACTION = 0.1  # the final training loss: the mean over the last 10 % of mini-batches (one is noise)
# A run whose final loss is this many times its first has diverged, even where the loss stayed finite (the
# executor stops a run only on a non-finite loss): its loss says nothing about the method but that it blew up.
DIVERGED_RISE = 10.0


class ResultsError(ValueError):
    """A results file that cannot be used: one line naming the file and what is wrong."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


def _known_method(name: str) -> str:
    """A run's or timing's method, one of the catalogue's: an unknown one was a row of the table and the page."""
    from ..schedules import METHODS

    if name not in METHODS:
        raise ValueError(f"one of {', '.join(METHODS)} (got {name!r})")
    return name


_Share = Annotated[float, Field(ge=0, le=1)]


class StageRecord(_Strict):
    """What a stage's ops ran on, as the executor measured it: version lag and prediction distance s."""

    stage: int
    forward_staleness: int
    backward_staleness: int
    prediction_distance: int | None
    backward_prediction_distance: int | None


class RunRecord(_Strict):
    """One training run: the loss per mini-batch (mean over pipelines; NaN after a divergence) and the
    held-out scores of the trained model (None when it diverged)."""

    method: str
    source: str | None
    primary: bool  # the source is the one the method publishes (or it predicts nothing)
    optimizer: str
    lr: float
    seed: int
    status: Literal["ok", "diverged"]
    samples_per_minibatch: int = Field(ge=1)  # over all pipelines: the x axis of the loss curves
    losses: list[float | None] = Field(min_length=1)  # None: not reached (diverged before)
    heldout_loss: Annotated[float, Field(ge=0)] | None
    heldout_accuracy: _Share | None
    stages: list[StageRecord]
    wall_s: float = Field(ge=0)

    _method = field_validator("method")(_known_method)

    @property
    def key(self) -> RunKey:
        return RunKey(self.method, self.source, self.optimizer, self.lr, self.seed)

    @property
    def final_loss(self) -> float:
        """Mean training loss over the last TAIL_FRACTION of mini-batches (NaN for a diverged run)."""
        return math.nan if self.diverged else self._tail_mean()

    def _tail_mean(self) -> float:  # of a run that trained to the end
        tail = max(1, round(len(self.losses) * TAIL_FRACTION))
        return float(np.mean(self.losses[-tail:]))

    @property
    def diverged(self) -> bool:
        """The executor stopped it on a non-finite loss, its model scored a non-finite held-out loss, or its loss
        ended DIVERGED_RISE times its first."""
        return self.status != "ok" or not self._tail_mean() <= DIVERGED_RISE * self.losses[0]


class TimingRecord(_Strict):
    """Throughput of one arm on spawned ranks (one process per device), measured and predicted by the
    simulator from the study's profile; medians over `repeats` runs, with the spread (max − min)."""

    method: str
    source: str | None
    optimizer: str
    lr: float
    seed: int
    repeats: int = Field(ge=1)
    measured_samples_per_s: float = Field(gt=0)
    measured_spread: float = Field(ge=0)
    predicted_samples_per_s: float = Field(gt=0)
    ranks: int = Field(ge=1)

    _method = field_validator("method")(_known_method)

    def matches(self, arm: Arm) -> bool:
        """Timed once per method: another source of s changes the weights, not the order or the work."""
        return self.method == arm.method


class StudyFile(_Strict):
    format_version: Literal[1]
    setting: dict[str, Any]
    profile: dict[str, Any] | None = None  # the calibration the predictions come from, measured once
    runs: list[RunRecord] = []
    timings: list[TimingRecord] = []

    def done(self, key: RunKey) -> bool:
        return any(r.key == key for r in self.runs)

    def timing(self, arm: Arm) -> TimingRecord | None:
        return next((t for t in self.timings if t.matches(arm)), None)

    def trained(self, arm: Arm, optimizers: dict[str, float], seeds: Sequence[int]) -> RunRecord | None:
        """The arm's first run (in optimizer, then seed order) that trained to the end: the one to time."""
        return next((r for optimizer, lr in optimizers.items() for seed in seeds for r in self.runs
                     if r.key == RunKey(arm.method, arm.source, optimizer, lr, seed) and r.status == "ok"), None)

    def save(self, path: Path) -> None:
        write_atomic(path, self.model_dump_json(indent=1) + "\n")


def open_results(path: Path, setting: Setting) -> StudyFile:
    """The results in `path` to go on from (a new, empty study where there is no file). A file of another
    setting is refused, naming the first field that differs, rather than mixing runs that do not compare."""
    if not path.exists():
        return StudyFile(format_version=FORMAT_VERSION, setting=setting.as_dict())
    study = load_results(path)
    wanted = setting.as_dict()
    for name, value in wanted.items():
        if study.setting.get(name) != value:
            raise ResultsError(f"{path} holds a study with {name} {study.setting.get(name)!r}, not {value!r}: give "
                               "another --results file, or the same setting to resume it")
    return study


def load_results(path: Path) -> StudyFile:
    """The study in `path`. Another pipesim kind is named as such (`read_document`); any other JSON, one without the
    format_version a study's results begin with (another command's --json: simulate's, tune's), is not a study at
    all, said so, where it was refused by its first field, "format_version: Field required"."""
    document = read_document(path, STUDY_RESULTS, ResultsError)  # another kind is named, not by its missing fields
    if not isinstance(document, dict) or "format_version" not in document:
        lacks = "it has no format_version" if isinstance(document, dict) else "it is not a JSON object"
        raise ResultsError(f"{path} is not a {STUDY_RESULTS}: {lacks} (a study's results are an object of "
                           f"format_version, setting, runs and timings); give {DOCUMENT_KINDS[STUDY_RESULTS].wanted}")
    study = validated(StudyFile, document, path, STUDY_RESULTS, ResultsError)
    try:
        Setting(**study.setting)
    except TypeError as exc:
        raise ResultsError(f"{path}: setting: {exc}") from None
    return study


@dataclass(frozen=True)
class Spread:
    """A quantity over seeds: mean, sample standard deviation (None with one seed: there is no spread to
    show), how many seeds gave it, and what to print where none did."""

    mean: float
    std: float | None
    n: int
    missing: str = "-"

    @classmethod
    def of(cls, values: Sequence[float], missing: str = "-") -> Spread:
        finite = np.array([v for v in values if v is not None and math.isfinite(v)], dtype=float)
        if not len(finite):
            return cls(math.nan, math.nan, 0, missing)
        return cls(float(finite.mean()), float(finite.std(ddof=1)) if len(finite) > 1 else None, len(finite),
                   missing)

    def text(self, write: Callable[[float], str] = loss_text) -> str:
        """"mean ± std", each written by `write`, the mean alone from one seed."""
        if not self.n:
            return self.missing
        return write(self.mean) if self.std is None else f"{write(self.mean)} ± {write(self.std)}"


@dataclass(frozen=True)
class ArmSummary:
    """One arm under one optimizer, over its seeds."""

    arm: Arm
    optimizer: str
    lr: float
    runs: list[RunRecord]
    timing: TimingRecord | None

    @property
    def diverged(self) -> int:
        return sum(r.diverged for r in self.runs)

    def _over_trained(self, value: Callable[[RunRecord], float | None]) -> Spread:
        """`value` over the seeds that did not diverge (`RunRecord.diverged`), one rule for every figure: a seed
        whose loss ended 10x its first kept its held-out scores (status "ok"), which pulled pipeoptim (code)'s
        accuracy to 53.9 ± 37.8 over 3 seeds beside a loss over 2; "diverged" where every seed did."""
        return Spread.of([value(r) for r in self.runs if not r.diverged],
                         missing="diverged" if self.runs and self.diverged == len(self.runs) else "-")

    @property
    def final_loss(self) -> Spread:
        return self._over_trained(lambda r: r.final_loss)

    @property
    def heldout_loss(self) -> Spread:
        return self._over_trained(lambda r: r.heldout_loss)

    @property
    def heldout_accuracy(self) -> Spread:
        return self._over_trained(lambda r: r.heldout_accuracy)

    @property
    def stages(self) -> list[StageRecord]:
        """The measured staleness and s per stage (the same for every seed: the schedule fixes them), from the
        first seed that measured them (a diverged one measured nothing)."""
        return next((r.stages for r in self.runs if r.stages), [])

    def per_stage(self, field: str, separator: str = ",") -> str:
        """One StageRecord field over the stages, as text ("1,1,1,0"); "-" where no stage has it."""
        values = [getattr(stage, field) for stage in self.stages]
        if all(v is None for v in values):
            return "-"
        return separator.join("-" if v is None else str(v) for v in values)

    def as_dict(self) -> dict[str, Any]:
        def spread(s: Spread) -> dict[str, Any]:
            return {"mean": None if not s.n else s.mean, "std": None if not s.n else s.std, "seeds": s.n}

        return {"arm": self.arm.label, "method": self.arm.method, "prediction": self.arm.source,
                "optimizer": self.optimizer, "lr": self.lr, "seeds": len(self.runs), "diverged": self.diverged,
                "final_loss": spread(self.final_loss), "heldout_loss": spread(self.heldout_loss),
                "heldout_accuracy": spread(self.heldout_accuracy),
                "measured_samples_per_s": None if self.timing is None else self.timing.measured_samples_per_s,
                "predicted_samples_per_s": None if self.timing is None else self.timing.predicted_samples_per_s,
                "stages": [s.model_dump() for s in self.stages]}


def summarize(study: StudyFile, arms: Sequence[Arm], optimizers: dict[str, float],
              seeds: Sequence[int]) -> list[ArmSummary]:
    """Per arm and optimizer, the runs of `seeds` that are done (a resumed or re-plotted study may have fewer),
    and the arm's timing (measured under one optimizer: the step's cost barely moves the throughput)."""
    out = []
    for optimizer, lr in optimizers.items():
        for arm in arms:
            runs = [r for seed in seeds for r in study.runs if r.key == RunKey(arm.method, arm.source, optimizer,
                                                                                lr, seed)]
            out.append(ArmSummary(arm, optimizer, lr, runs, study.timing(arm)))
    return out


def recorded_arms(study: StudyFile) -> tuple[list[Arm], dict[str, float], list[int]]:
    """The arms, optimizers and seeds a results file holds runs of, in the order they were run: what
    re-plotting a file shows."""
    arms: dict[tuple[str, str | None], Arm] = {}
    optimizers: dict[str, float] = {}
    seeds: dict[int, None] = {}
    for r in study.runs:
        arms.setdefault((r.method, r.source), Arm(r.method, r.source, r.primary))
        optimizers.setdefault(r.optimizer, r.lr)
        seeds.setdefault(r.seed, None)
    return list(arms.values()), optimizers, list(seeds)
