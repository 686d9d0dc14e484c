"""The prediction of a measured run, from what the run recorded about itself.

A measured trace names its schedule and parameters, the optimizer, the stage bounds it cut the model at, and,
when it was run with `--profile`, the profile itself. That is everything the simulator needs, so
`pipesim compare MEASURED` predicts the same run from a profile measured beforehand, never from the run's own
op durations.
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

from ..choices import unknown_names
from ..schedules import METHODS, ScheduleError, ScheduleParams
from ..sim import Cluster, CostError, Costs, simulate
from ..traces.trace import Trace, TraceError, TraceMeta
from .scenario import profile_scenario

if TYPE_CHECKING:
    from ..profiles.schema import Profile


def predict_measured(meta: TraceMeta, profile: Profile | None = None, links_from: Profile | None = None) -> Trace:
    """The simulator's trace of the run `meta` describes, from the profile it recorded; TraceError says what
    the run did not record, or why that profile's times do not hold for it (another micro-batch size or thread
    count). `profile` replaces the recorded one, unchecked: a what-if (the fidelity report predicts with
    terms of the profile turned off), to be labelled as such; `links_from`, the profile whose links the transfers
    take (an estimate's own are its catalogue placement's: benchmarks/gpu_check.py prices one over the links the
    run was calibrated on)."""
    from ..profiles.schema import threads_mismatch

    if meta.source != "measured":
        raise TraceError(f"a {meta.source} trace, not a measured one: give a trace `pipesim run --trace` wrote to "
                         "predict it, or a predicted trace beside it to compare")
    if profile is None:
        profile = recorded_profile(meta)
        if profile.environment.microbatch_size != meta.microbatch_size:
            raise TraceError(f"the run used {meta.microbatch_size} samples per micro-batch, its profile was measured "
                             f"at {profile.environment.microbatch_size}: its times do not hold for this run")
        threads = (meta.hardware or {}).get("threads_per_rank")
        if threads is not None and (why := threads_mismatch(profile, threads)) is not None:
            raise TraceError(why)
    if meta.schedule not in METHODS:  # no flag named it: method_named's refusal would name --schedule
        raise TraceError(f"cannot predict the recorded run: {unknown_names('its schedule', [meta.schedule], METHODS)}")
    scenario = profile_scenario(profile, str(meta.extra.get("optimizer", "sgd")))
    bounds = meta.extra.get("bounds")
    if bounds is not None and bounds[-1] != len(profile.layers):  # a cut rising from 0 (TraceMeta's check)
        raise TraceError(f"cannot predict the recorded run: meta.extra.bounds {bounds} cut {bounds[-1]} layers, its "
                         f"profile has {len(profile.layers)}")
    try:
        schedule = scenario.build(meta.schedule, ScheduleParams.recorded(meta.params), bounds)
        linked = scenario if links_from is None else profile_scenario(links_from, scenario.optimizer)
        placed = _placed(linked.links(schedule), meta.hardware or {}, meta.shares_gpu)
        # costs on the run's placement: ranks that shared a GPU take the passes timed from an idle one
        costs = _windowed(replace(scenario, topology=placed).costs(schedule, bounds), meta)
        trace = simulate(schedule, costs, placed)
    except (ScheduleError, CostError, TypeError) as exc:
        raise TraceError(f"cannot predict the recorded run: {exc}") from None
    return trace


def recorded_profile(meta: TraceMeta) -> Profile:
    """The profile the run `meta` describes recorded (TraceError where none, or one that fails its checks)."""
    from pydantic import ValidationError

    from ..files import first_error
    from ..profiles.schema import Profile

    document = meta.extra.get("profile")
    if document is None:
        raise TraceError("the run recorded no profile (it was run without --profile): there is nothing to predict "
                         "it from; give a predicted trace as well (`pipesim simulate ... --trace`)")
    try:
        return Profile.model_validate(document)
    except ValidationError as exc:  # its first error names the field, as a profile file's refusal does
        raise TraceError("the run's recorded profile (meta.extra.profile) is not valid: "
                         f"{first_error(exc, Profile)}") from None


def _windowed(costs: Costs, meta: TraceMeta) -> Costs:
    """The costs with the run's own receive window, where its posted buffers are in the memory it counted
    (a host-staged GPU run posts them in host memory); a what-if without runtime terms keeps none. The window as
    recorded: `Costs` refuses one that is not a whole number >= 0."""
    window = meta.extra.get("recv_window")
    if not costs.recv_window or window is None:
        return costs
    return replace(costs, recv_window=window if meta.counts_posted_receives else 0)


def _placed(cluster: Cluster, hardware: dict, shares_gpu: bool = False) -> Cluster:
    """The cluster with the devices where the run's ranks computed (the runner records `host/device` per
    rank): on CUDA, ranks that took turns under the executor's compute lock name one compute resource, so the
    simulator serialises their compute as the lock did and prices their passes as issued to an idle GPU: every
    rank where the run was host-staged (`TraceMeta.shares_gpu`: one lock over all ranks, executor/runners.py,
    though its first pipeline's ranks computed on GPUs of their own, as with --backend gloo or d > 1), else those
    on one GPU (a run recorded before `host_staged` was); on CPU, ranks on one host share its cores (their
    slowdown is the profile's)."""
    places = (hardware.get("compute") or [])[:cluster.num_devices]
    if shares_gpu:
        return replace(cluster, compute=(places[0] if places else "cuda",) * cluster.num_devices)
    if hardware.get("device") == "cuda":
        return cluster if len(set(places)) == len(places) else replace(cluster, compute=tuple(places))
    if cluster.contention and places:
        return replace(cluster, hosts=tuple(place.rsplit("/", 1)[0] for place in places))
    return cluster
