"""The torch side of a study: train one run with the executor (every device a thread of this process: the
same DeviceLoop and weight semantics as `pipesim run`, without spawning processes for each of hundreds of
runs), calibrate the setting once, and time an arm on spawned ranks against the simulator's prediction."""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable

import torch

from ..calibrate.cache import HostCache
from ..calibrate.measure import threads
from ..executor import DivergedError, RunSpec, even_bounds, run_in_process, run_multiprocess
from ..planning.replay import predict_measured
from ..profiles.linkfit import default_sizes
from ..profiles.schema import Profile
from ..traces.metrics import summarize
from ..traces.trace import Trace
from ..units import MIB
from ..workload.models import build_model
from .plan import Arm, Setting, build
from .results import RunRecord, StageRecord, TimingRecord

LINK_MAX_BYTES = MIB  # a study's stage edges carry a micro-batch's activations: kilobytes, not megabytes
TIMEOUT_S = 120.0


def _spec(setting: Setting, arm: Arm, optimizer: str, lr: float, seed: int) -> RunSpec:
    """The arm's run: its model cut evenly into the schedule's stages (p·v for a V schedule)."""
    layers = len(build_model(setting.model, **setting.model_options).layers)
    schedule = build(setting, arm.method, arm.source)
    return RunSpec(schedule, setting.model, dict(setting.model_options),
                   microbatch_size=setting.microbatch_size, optimizer=optimizer, lr=lr, seed=seed,
                   bounds=tuple(even_bounds(layers, schedule.num_stages)), threads_per_rank=1, timeout_s=TIMEOUT_S)


def _stages(trace: Trace) -> list[StageRecord]:
    return [StageRecord(stage=s.stage, forward_staleness=s.forward_staleness, backward_staleness=s.backward_staleness,
                        prediction_distance=s.prediction_distance,
                        backward_prediction_distance=s.backward_prediction_distance)
            for s in summarize(trace).stages]


def train(setting: Setting, arm: Arm, optimizer: str, lr: float, seed: int) -> RunRecord:
    """Train one run to the end, or until its loss goes non-finite (recorded as diverged, not raised, with the
    losses of the mini-batches finished before it); a run whose trained model scores a non-finite held-out loss is
    recorded as diverged too, with all its losses."""
    spec = _spec(setting, arm, optimizer, lr, seed)
    schedule = spec.schedule
    per_minibatch = schedule.pipelines * schedule.microbatches * setting.microbatch_size
    base = dict(method=arm.method, source=arm.source, primary=arm.primary, optimizer=optimizer, lr=lr, seed=seed,
                samples_per_minibatch=per_minibatch)
    began = time.perf_counter()
    try:
        with threads(1):  # the devices are threads: one intra-op thread each, as each rank of a real run
            result = run_in_process(spec)
    except DivergedError as exc:
        finished = [statistics.fmean(pipeline[b] for pipeline in exc.losses)
                    for b in range(min(map(len, exc.losses), default=0))]
        return RunRecord(**base, status="diverged", losses=finished + [None] * (schedule.minibatches - len(finished)),
                         heldout_loss=None, heldout_accuracy=None, stages=[], wall_s=time.perf_counter() - began)
    losses = [statistics.fmean(pipeline[b] for pipeline in result.losses) for b in range(schedule.minibatches)]
    scores = result.trace.meta.extra.get("heldout") or {}
    # a model whose last updates blew its weights up scores a non-finite held-out loss (pipeoptim (code)'s training
    # loss rose to 2e17 by the study's 60th mini-batch, its held-out loss NaN): it diverged, and scored nothing
    blown_up = not math.isfinite(scores.get("loss", 0.0))
    return RunRecord(**base, status="diverged" if blown_up else "ok", losses=losses,
                     heldout_loss=None if blown_up else scores.get("loss"),
                     heldout_accuracy=None if blown_up else scores.get("accuracy"), stages=_stages(result.trace),
                     wall_s=time.perf_counter() - began)


def measurement(setting: Setting):
    """How a study calibrates: on CPU, at its micro-batch size, one thread, as each rank runs."""
    from ..calibrate.measure import Settings

    return Settings(torch.device("cpu"), torch.float32, setting.microbatch_size, warmup=2, repeats=10, threads=1)


def calibrate_setting(setting: Setting, optimizer: str, advance: Callable[[str], None],
                      cache: HostCache | None = None) -> Profile:
    """The setting's model measured as each rank runs it and the local link (from the host `cache` where
    `pipesim calibrate` left it): what the throughput predictions come from, measured once per study (the
    executor's own costs are the runtime probe's, `pipesim calibrate`'s)."""
    from ..calibrate.measure import calibrate

    return calibrate(build_model(setting.model, **setting.model_options), measurement(setting),
                     stages=setting.stages, optimizer=optimizer, memory_cap_bytes=None,
                     link_sizes=default_sizes(LINK_MAX_BYTES), dtype_name="float32", advance=advance, cache=cache)


def time_arm(setting: Setting, arm: Arm, optimizer: str, lr: float, seed: int, profile: Profile,
             repeats: int) -> TimingRecord:
    """Samples/s of the arm on one spawned process per device (gloo), median of `repeats` fresh runs, and the
    simulator's prediction of the same run from `profile`. Give a run that trained to the end in process: a
    diverging one stops (RunFailed) before it can be timed."""
    spec = _spec(setting, arm, optimizer, lr, seed)
    measured, predicted = [], []
    for _ in range(repeats):
        trace = run_multiprocess(spec, device="cpu").trace
        trace.meta.extra["profile"] = profile.model_dump(mode="json")
        measured.append(summarize(trace).samples_per_s)
        predicted.append(summarize(predict_measured(trace.meta)).samples_per_s)
    return TimingRecord(method=arm.method, source=arm.source, optimizer=optimizer, lr=lr, seed=seed, repeats=repeats,
                        measured_samples_per_s=statistics.median(measured),
                        measured_spread=max(measured) - min(measured),
                        predicted_samples_per_s=statistics.median(predicted), ranks=spec.schedule.num_devices)
