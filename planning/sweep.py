"""Sweeps: one simulation per point of a grid (methods × p × m × v × P × cost scale × source of the prediction
distance s × auto's activation limit R), run in worker processes or as Ray tasks, and the Pareto fronts of the
results over time per mini-batch, peak memory and staleness.

A configuration a method cannot run is a result too (status "skipped", with the reason), so a grid never
fails half-way. Configurations that simulate the same run (one schedule under two names: interleaved 1F1B at
v = 1 is 1F1B) are one result, which names the others (`one_row_per_schedule`). What each simulation needs
besides its shape (costs, links, a stage DAG) comes from a `Scenario` (the very one `pipesim simulate` builds)
shipped to the workers by value. Workers import the simulator only, never torch or the command line.
"""

from __future__ import annotations

import csv
import hashlib
import io
import json
import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import as_completed
from dataclasses import asdict, dataclass, fields, replace
from datetime import date, time
from itertools import product
from pathlib import Path
from time import process_time
from typing import TYPE_CHECKING

import numpy as np

from ..choices import nearest_text, unknown_names
from ..files import read_toml
from ..schedules import METHODS, ScheduleError, ScheduleParams, steady_minibatches
from ..schedules.ir import PREDICTION_SOURCES
from ..sim.cluster import ClusterError, MemoryCheck
from ..sim.costs import CostError
from ..sim.engine import SimulationError, simulate
from ..traces import Summary, Trace, write_atomic
from ..traces.hostload import usable_cpus
from ..traces.metrics import STALENESS_HEADER, mib_text, ms_text, percent_text, rate_text
from ..units import count_text, degree_text, number_allowed, rounds_text
from .auto import ActivationLimitError
from .scenario import Scenario
from .tune import start_workers

if TYPE_CHECKING:
    from ..profiles.schema import Profile

AXES = ("schedule", "stages", "microbatches", "chunks", "pipelines", "cost-scale", "prediction",
        "activation-limit")  # flags, TOML keys
POSITIVE_AXES = ("cost-scale", "activation-limit")  # finite numbers > 0
OBJECTIVES = ("time_per_minibatch_ms", "peak_memory_mb", "max_staleness")  # all minimised
MAX_CHUNK = 32  # configurations per task: ~0.1 s of work at the example's scale, so a task's overhead is noise
# CPU s a spawned worker takes before its first task: its interpreter and imports (numpy, the simulator). Measured on
# the 2-core host, two workers started at once (load 4-6): 0.64-0.74 s each, 1.3-1.9 s of wall time for both. A
# sweep of the README's grid runs its 48 configurations here in less.
WORKER_START_S = 0.7


class GridError(ValueError):
    """A grid axis or grid file that cannot be used; the message is one line naming the key."""


@dataclass(frozen=True)
class Config:
    """One point of the grid: the inputs of one simulation. `prediction`: the source of a predicting method's
    distances s (None: the method's primary source, or no prediction); a result names the source used.
    `activation_limit` (R) and `search_seconds`: a searched method's (auto) limit and budget (None: its
    defaults, or not searched). `data_parallel`: replicas d of the pipeline, each stage's gradients all-reduced
    over them (REDUCE rows), on each device once its last backward is done where `reduce_after_flush`, and sharded
    over them as ZeRO's stage `zero` says. `rounds`: the flushes a mini-batch's m micro-batches run in before its
    update (`ScheduleParams.rounds`, torch's gradient accumulation)."""

    schedule: str
    stages: int
    microbatches: int
    minibatches: int
    chunks: int
    pipelines: int
    cost_scale: float
    prediction: str | None = None
    activation_limit: float | None = None
    search_seconds: float | None = None
    data_parallel: int = 1
    reduce_after_flush: bool = False
    zero: int = 0
    rounds: int = 1

    @property
    def label(self) -> str:
        degrees = [("p", self.stages), ("m", self.microbatches), ("v", self.chunks), ("P", self.pipelines)]
        return (" ".join([self.schedule, *(degree_text(*degree) for degree in degrees)]) + rounds_text(self.rounds)
                + f" cost×{self.cost_scale:g}" + (f" s: {self.prediction}" if self.prediction else "")
                + (f" R={self.activation_limit:g}" if self.activation_limit is not None else "")
                + (f" {degree_text('d', self.data_parallel)}" if self.data_parallel > 1 else "")
                + (f" ZeRO-{self.zero}" if self.zero else ""))

    @property
    def variant(self) -> str:
        """What tells this configuration from another of the same shape (p, m, N, P, d) and cost scale: the method
        and the axes only some methods read (v, the source of s, R)."""
        return (self.schedule + (f" {degree_text('v', self.chunks)}" if METHODS[self.schedule].reads("chunks") else "")
                + (f" s: {self.prediction}" if self.prediction else "")
                + (f" R={self.activation_limit:g}" if self.activation_limit is not None else ""))


@dataclass(frozen=True)
class Metrics:
    time_per_minibatch_ms: float
    samples_per_s: float
    bubble_fraction: float
    peak_memory_mb: float
    max_staleness: int
    makespan_ms: float
    exposed_comm_ms: float
    out_of_memory: bool = False  # a device's peak past its memory, as simulate checks it (none known: False)
    steady_state: bool = True  # false: -n is short of the order's steady state, its figures include the warm-up

    @classmethod
    def of(cls, summary: Summary, checks: Sequence[MemoryCheck], steady_state: bool = True) -> Metrics:
        """A run's figures as plain Python numbers, the results file's types (`COLUMNS`), whether a device's
        peak is past its memory (`checks`, `Scenario.memory_checks`) and whether its mini-batches reach the steady
        state (`steady_minibatches`, as simulate marks a row)."""
        figures = [f.name for f in fields(cls) if f.name not in ("out_of_memory", "steady_state")]
        return cls(**{name: COLUMNS[name](getattr(summary, name)) for name in figures},
                   out_of_memory=any(check.out_of_memory for check in checks), steady_state=steady_state)


@dataclass(frozen=True)
class Result:
    """`run_key`: the digest of the run simulated (`run_key()`; "" when skipped); `same_as`: the grid's other
    configurations that simulated the very same run (one schedule under other names), folded into this row;
    `command`: the `pipesim simulate` line that gives this row (its figures, or its reason), which names the model,
    costs and hardware every row shares."""

    config: Config
    metrics: Metrics | None = None  # None: the configuration was skipped
    reason: str = ""
    limit_refused: bool = False  # skipped: its activation limit R leaves a device less than one micro-batch
    run_key: str = ""
    same_as: tuple[Config, ...] = ()
    command: str = ""

    @property
    def status(self) -> str:
        return "skipped" if self.metrics is None else "ok"

    def record(self) -> dict[str, object]:
        """One flat row: the inputs, the metrics (None when skipped), status, reason, the configurations it
        stands for too ("; "-separated, as `Config.variant` names them) and its simulate command."""
        metrics = asdict(self.metrics) if self.metrics else dict.fromkeys(f.name for f in fields(Metrics))
        return {**asdict(self.config), **metrics, "status": self.status, "reason": self.reason,
                "same_as": "; ".join(c.variant for c in self.same_as), "command": self.command}


# The degrees every row runs that no axis of the grid moves: an estimate's tensor, context and expert parallelism
# (its profile's, or --gpu's flags: `Profile.estimated_degrees`), 1 for other costs; a results file records them
# beside d (the expert-tensor group, which --rank-order megatron alone reads, the rows' commands give)
DEGREES = ("tensor_parallel", "context_parallel", "expert_parallel")


def estimate_degrees(profile: Profile | None) -> dict[str, int]:
    """`DEGREES` as `profile` estimated them (1 each for a calibrated profile or typed costs)."""
    return dict(zip(DEGREES, (1, 1, 1) if profile is None else profile.estimated_degrees, strict=True))


def degrees_text(degrees: Mapping[str, int]) -> str:
    """The `degrees` over 1 ("t=2, E=4"; "" for none), which the terminal's caption and the page say every row runs
    (no column shows them, and the rows' commands give them)."""
    return ", ".join(degree_text(letter, degrees.get(column, 1)) for letter, column in zip("tCE", DEGREES)
                     if degrees.get(column, 1) > 1)


# The columns of the results file and their types (for Parquet's schema and for readers of the CSV): the fields'
# annotations, as text under `from __future__ import annotations`, read as types
_TYPES = {"str": str, "str | None": str, "int": int, "float": float, "float | None": float, "bool": bool}
COLUMNS: dict[str, type] = {
    **{f.name: _TYPES[f.type] for f in fields(Config)}, **dict.fromkeys(DEGREES, int),
    **{f.name: _TYPES[f.type] for f in fields(Metrics)},
    "status": str, "reason": str, "same_as": str, "pareto_front": bool, "command": str,
}


def axis_values(key: str, values: Sequence[object], label: str) -> tuple:
    """Axis `key`, checked: known method names or sources of s, whole numbers of at least 1, or cost scales and
    activation limits > 0; each value once. `label` names where the values came from in errors."""
    if not values:
        raise GridError(f"{label}: give at least one value")
    if key in ("schedule", "prediction"):
        known = METHODS if key == "schedule" else PREDICTION_SOURCES
        not_names = [v for v in values if not isinstance(v, str)]  # a grid file's `true`, 4 or [...]
        if not_names:
            raise GridError(f"{label}: give names in quotes (got {toml_text(not_names[0])}); choose from "
                            f"{', '.join(known)}")
        unknown = [v for v in values if v not in known]
        if unknown:
            raise GridError(unknown_names(label, unknown, known))
    elif key in POSITIVE_AXES:
        bad = [v for v in values if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 < v < math.inf]
        if bad:
            raise GridError(f"{label}: {number_allowed(0, None, whole=False, finite=True, above=True)} each "
                            f"(got {toml_text(bad[0])})")
        values = [float(v) for v in values]
    else:
        bad = [v for v in values if isinstance(v, bool) or not isinstance(v, int) or v < 1]
        if bad:
            raise GridError(f"{label}: {number_allowed(1, None)} each (got {toml_text(bad[0])})")
    twice = [v for i, v in enumerate(values) if v in values[:i]]
    if twice:
        raise GridError(f"{label}: {toml_text(twice[0])} is given twice")
    return tuple(values)


def toml_text(value: object) -> str:
    """`value`, read from a --grid file, as TOML writes it (`true`, `"4"`, `[4]`, `{ a = 1 }`), where Python's repr
    wrote True, '4' and {'a': 1} back to a reader who wrote none of them; a flag's numbers read the same either way."""
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, str):
        return json.dumps(value)  # a TOML basic string escapes as JSON does
    if isinstance(value, list):
        return f"[{', '.join(map(toml_text, value))}]"
    if isinstance(value, dict):
        return "{ " + ", ".join(f"{json.dumps(key)} = {toml_text(item)}" for key, item in value.items()) + " }"
    if isinstance(value, (date, time)):  # datetime is a date
        return value.isoformat()
    return repr(value)  # int and float: TOML's own spelling, nan and inf among them


def _axis_parts(key: str, text: str) -> list:
    """A comma list's values as axis `key` takes them: names as given, else numbers (ValueError where one is
    not)."""
    parts = [part.strip() for part in text.split(",")]
    if key in ("schedule", "prediction"):
        return parts
    return [(float if key in POSITIVE_AXES else int)(part) for part in parts]


def parse_axis(key: str, text: str) -> tuple:
    """A flag's comma-separated list, e.g. `--stages 4,8` or `--schedule 1f1b,zb-h1`."""
    try:
        parts = _axis_parts(key, text)
    except ValueError:
        what = "numbers" if key in POSITIVE_AXES else "whole numbers"
        raise GridError(f"--{key}: expected {what} separated by commas, got {text!r}") from None
    return axis_values(key, parts, f"--{key}")


def load_grid(path: Path) -> dict[str, tuple]:
    """Axes from a TOML file whose keys are the axis flags' names (`stages = [4, 8]`, `cost-scale = 0.5`)."""
    doc = read_toml(path, GridError, "--grid: ")
    unknown = [key for key in doc if key not in AXES]
    if unknown:
        raise GridError(f"--grid: {path}: unknown key {unknown[0]!r}{nearest_text(unknown[0], AXES)}; allowed: "
                        f"{', '.join(AXES)}")
    listed = next((key for key, value in doc.items() if isinstance(value, str) and "," in value), None)
    if listed is not None:  # a flag's comma list, which the file read as one unknown name
        text = ",".join(part for part in doc[listed].split(",") if part.strip())
        try:
            values = _axis_parts(listed, text)
        except ValueError:  # "2,x": the parts as written, which the list's own check then names
            values = [part.strip() for part in text.split(",")]
        raise GridError(f"--grid: {path}: {listed}: give several values as a TOML list, {listed} = "
                        f"{toml_text(values)} (got {toml_text(doc[listed])})")
    return {key: axis_values(key, value if isinstance(value, list) else [value], f"--grid: {path}: {key}")
            for key, value in doc.items()}


@dataclass(frozen=True)
class Grid:
    """The axes of a sweep. `chunks`, `pipelines`, `predictions` (sources of s) and `activation_limits` (auto's
    R) None: each method's default; `search_seconds`: auto's search budget (None: its default); `data_parallel`:
    every configuration's replicas d, whether their all-reduce waits for the pipeline's flush, and ZeRO's stage
    `zero` over them; `rounds`: every configuration's flushes a mini-batch (`Config.rounds`)."""

    schedules: tuple[str, ...]
    stages: tuple[int, ...]
    microbatches: tuple[int, ...]
    minibatches: int
    chunks: tuple[int, ...] | None = None
    pipelines: tuple[int, ...] | None = None
    cost_scales: tuple[float, ...] = (1.0,)
    predictions: tuple[str, ...] | None = None
    activation_limits: tuple[float, ...] | None = None
    search_seconds: float | None = None
    data_parallel: int = 1
    reduce_after_flush: bool = False
    zero: int = 0
    rounds: int = 1

    def configs(self) -> list[Config]:
        """Every configuration, method by method. v, P, the source of s and R multiply only the methods that
        read them (interleaved and V schedules, AvgPipe, the predicting methods, auto), a V schedule's v only where
        its one value is not among them (`Method.swept`); the others run their default once."""
        configs = []
        for name in self.schedules:
            method = METHODS[name]
            chunks, pipelines = method.swept("chunks", self.chunks), method.swept("pipelines", self.pipelines)
            sources = self.predictions if self.predictions and method.reads("prediction") else (None,)
            limits = self.activation_limits if self.activation_limits and method.reads("activation_limit") else (None,)
            budget = self.search_seconds if method.reads("search_seconds") else None
            replicas = self.data_parallel
            configs += [Config(name, p, m, self.minibatches, v, copies, scale, source, limit, budget, replicas,
                               self.reduce_after_flush, self.zero, self.rounds)
                        for p, m, v, copies, scale, source, limit in
                        product(self.stages, self.microbatches, chunks, pipelines, self.cost_scales, sources, limits)]
        return configs


def run_chunk(scenario: Scenario, configs: Sequence[Config]) -> list[Result]:
    """Simulate each configuration; one the method, costs or links cannot describe (an activation limit R
    below one micro-batch included) is skipped with the reason. A result's configuration names the source of s
    its schedule used (a method's default resolved). The task of worker processes and Ray alike: a chunk of
    them amortises a task's overhead. A searched method (auto) is searched for the scaled costs it runs on."""
    results = []
    for config in configs:
        try:
            scaled = replace(scenario, cost_scale=config.cost_scale)
            params = ScheduleParams(
                config.stages, config.microbatches, config.minibatches, config.chunks, config.pipelines,
                prediction=config.prediction, activation_limit=config.activation_limit,
                search_seconds=config.search_seconds, data_parallel=config.data_parallel,
                reduce_after_flush=config.reduce_after_flush, zero=config.zero, rounds=config.rounds)
            sched = scaled.build(config.schedule, params)
            links = scaled.links(sched)  # built once: the simulation, the reserve and the memory checks read it
            trace = simulate(sched, scaled.costs(sched), links)
            scaled.add_reserve(sched, trace, links=links)
            # a searched order within the caching allocator's reserve, as simulate's
            sched, trace, summary, checks, _ = scaled.within_reserve(
                sched, trace, links, lambda at: at.build(config.schedule, params),
                lambda again, links: simulate(again, scaled.costs(again), links))
        except (ScheduleError, CostError, ClusterError, SimulationError) as exc:
            results.append(Result(config, reason=str(exc), limit_refused=isinstance(exc, ActivationLimitError)))
            continue
        results.append(Result(replace(config, prediction=sched.params.get("prediction")),
                              Metrics.of(summary, checks, sched.minibatches >= steady_minibatches(sched)),
                              run_key=run_key(trace)))
    return results


def run_key(trace: Trace) -> str:
    """A digest of a simulated run but its names: every op (device, stream, kind, indices, weight version and
    prediction distance read, start, duration) and every counter (memory, activations, weight copies). Two
    configurations with one key ran the same schedule on the same weights: interleaved 1F1B at v = 1 is 1F1B,
    SpecTrain's s from the paper is its s from the code. The simulator is deterministic, so equal inputs give one."""
    digest = hashlib.sha256()

    def add(name: str, values: np.ndarray) -> None:
        column = np.ascontiguousarray(values)
        digest.update(f"{name}:{column.dtype.str}:{len(column)}:".encode())
        digest.update(column.tobytes())

    digest.update(repr((trace.kinds, trace.num_devices)).encode())
    for f in fields(trace.ops):
        add(f.name, getattr(trace.ops, f.name))
    for name in sorted(trace.counters):
        for device, counter in enumerate(trace.counters[name]):
            add(f"{name}[{device}].t", counter.times_us)
            add(f"{name}[{device}].v", counter.values)
    return digest.hexdigest()


def one_row_per_schedule(results: Sequence[Result]) -> list[Result]:
    """The results with each run once: a configuration that simulated the run of an earlier one (the same `run_key`
    and cost scale) is folded into that one's `same_as`. Skipped rows stay, each with its own reason."""
    first: dict[tuple[str, float], int] = {}
    kept: list[Result] = []
    for r in results:
        key = (r.run_key, r.config.cost_scale)
        if r.metrics is None or key not in first:
            if r.metrics is not None:
                first[key] = len(kept)
            kept.append(r)
            continue
        earlier = kept[first[key]]
        kept[first[key]] = replace(earlier, same_as=(*earlier.same_as, r.config))
    return kept


def _chunks(indices: Sequence[int], workers: int) -> list[list[int]]:
    """Slices of the configurations' `indices`, a task each: about four per worker so the load evens out, at most
    MAX_CHUNK."""
    size = max(1, min(MAX_CHUNK, math.ceil(len(indices) / (4 * workers))))
    return [list(indices[start:start + size]) for start in range(0, len(indices), size)]


class Sweep:
    """`run`'s (index into `configs`, result) pairs as the tasks finish, and where they ran: `on_ray`, as Ray tasks;
    `workers`, the processes started (0: none); `here`, the configurations simulated in this process."""

    def __init__(self, scenario: Scenario, configs: list[Config], workers: int | None,
                 ray_address: str | None) -> None:
        self._scenario, self._configs, self._given, self._ray_address = scenario, configs, workers, ray_address
        self.on_ray = ray_address is not None
        self.workers = 0
        self.here = 0

    def __iter__(self) -> Iterator[tuple[int, Result]]:
        finished = _on_ray(self._scenario, self._configs, self._ray_address) if self.on_ray else self._local()
        for part, results in finished:
            yield from zip(part, results)

    def _local(self) -> Iterator[tuple[list[int], list[Result]]]:
        """The chunks in `workers` processes, or here where one process (or one chunk) is enough. Without a count
        given, a first chunk's worth of configurations spread over the grid (every k-th: its methods differ in
        cost, auto's search most) runs here, timed, and the rest go to one process a core only where they save
        more time than the processes take to start (`workers_pay`)."""
        workers = self._given or usable_cpus()
        indices = range(len(self._configs))
        parts = _chunks(indices, workers)
        if self._given is None and len(parts) > 1:
            sample = indices[::len(parts)]
            began_s = process_time()
            results = self._run_here(sample)
            per_config_s = (process_time() - began_s) / len(sample)
            yield list(sample), results
            rest = [i for i in indices if i % len(parts)]
            parts = _chunks(rest, workers)
            if not workers_pay(per_config_s * len(rest), min(workers, len(parts))):
                workers = 1
        if min(workers, len(parts)) > 1:
            self.workers = min(workers, len(parts))
            yield from _in_processes(self._scenario, self._configs, parts, self.workers)
            return
        for part in parts:
            yield part, self._run_here(part)

    def _run_here(self, part: Sequence[int]) -> list[Result]:
        self.here += len(part)
        return run_chunk(self._scenario, [self._configs[i] for i in part])


def run(scenario: Scenario, configs: list[Config], workers: int | None = None,
        ray_address: str | None = None) -> Sweep:
    """(index into `configs`, result) pairs as the tasks finish: on a Ray cluster, in `workers` processes (None: one
    a usable core where they pay for their start, `workers_pay`), or here when one process (or one task) is
    enough."""
    return Sweep(scenario, configs, workers, ray_address)


def workers_pay(remaining_s: float, workers: int) -> bool:
    """Whether `workers` processes would finish `remaining_s` of this process's work (CPU s) sooner than it would
    alone: each takes 1/workers of it once started, all at once, each on a core of its own (WORKER_START_S)."""
    return workers > 1 and remaining_s - remaining_s / workers > WORKER_START_S


def _in_processes(scenario: Scenario, configs: list[Config], parts: list[list[int]],
                  workers: int) -> Iterator[tuple[list[int], list[Result]]]:
    # Spawned, not forked: a fresh interpreter imports only what the tasks need (never torch), and forking a
    # parent whose progress bar runs a thread is unsafe. Started as tune's are, quiet on Ctrl-C, but collecting
    # cycles: a worker lives the whole grid.
    with start_workers(workers, forked=False, collect=True) as pool:  # ended at once on Ctrl-C
        futures = {pool.submit(run_chunk, scenario, [configs[i] for i in part]): part for part in parts}
        for future in as_completed(futures):
            yield futures[future], future.result()


def _on_ray(scenario: Scenario, configs: list[Config], address: str) -> Iterator[tuple[list[int], list[Result]]]:
    """The same chunks as Ray tasks; the scenario goes to the object store once. Connects to `address`
    ("auto", "ray://host:10001", "local" for a new local cluster) unless Ray is already initialised."""
    import ray

    started = not ray.is_initialized()
    if started:
        ray.init(address=address, log_to_driver=False)
    try:
        task = ray.remote(run_chunk)
        shared = ray.put(scenario)
        cpus = max(1, int(ray.cluster_resources().get("CPU", 1)))
        pending = {task.remote(shared, [configs[i] for i in part]): part
                   for part in _chunks(range(len(configs)), cpus)}
        while pending:
            done, _ = ray.wait(list(pending), num_returns=1)
            yield pending.pop(done[0]), ray.get(done[0])
    finally:
        if started:
            ray.shutdown()


def pareto_mask(points: np.ndarray) -> np.ndarray:
    """Which rows of an (n, objectives) array no other row dominates (<= in every column and < in one; all
    columns minimised). Equal rows are all kept. Rows are visited in lexicographic order, where a dominator
    always comes first, and each is checked against the front found so far (anything dominating it is
    dominated by a member)."""
    points = np.asarray(points, dtype=float)
    mask = np.zeros(len(points), dtype=bool)
    front = np.empty((0, points.shape[1]))
    for i in np.lexsort(points.T[::-1]):
        if not np.any(np.all(front <= points[i], axis=1) & np.any(front < points[i], axis=1)):
            mask[i] = True
            front = np.vstack([front, points[i]])
    return mask


def front_group(config: Config) -> tuple[int, float, int]:
    """Configurations that compete on one front: same devices p, cost scale and micro-batches per step."""
    return config.stages, config.cost_scale, config.microbatches * config.pipelines


def pareto_front(results: Sequence[Result]) -> list[int]:
    """Indices of the results on a Pareto front over OBJECTIVES. There is one front per device count p, cost
    scale and mini-batch size (m·P micro-batches): more devices, a faster accelerator or a smaller mini-batch
    is no schedule's merit, so only configurations doing the same work on the same hardware compete (v and P
    share the same p devices). By group, then fastest first."""
    groups: dict[tuple[int, float, int], list[int]] = {}
    for i, r in enumerate(results):
        if r.metrics is not None:
            groups.setdefault(front_group(r.config), []).append(i)
    front = []
    for key in sorted(groups):
        members = groups[key]
        points = np.array([[getattr(results[i].metrics, name) for name in OBJECTIVES] for i in members],
                          dtype=float)
        chosen = np.flatnonzero(pareto_mask(points))
        front += [members[j] for j in chosen[np.lexsort(points[chosen].T[::-1])]]
    return front


def write_results(results: Sequence[Result], path: Path, degrees: Mapping[str, int] | None = None) -> None:
    """One row per configuration, with the degrees every row runs (`degrees`, `estimate_degrees`; 1 each where not
    given) and whether it is on its Pareto front (`pareto_front`: the terminal shows the first fronts, up to
    `FRONT_ROWS` rows): CSV, or Parquet for a .parquet path (needs pyarrow); replaced atomically."""
    fronts = set(pareto_front(results))
    degrees = dict.fromkeys(DEGREES, 1) | dict(degrees or {})
    records = [{**r.record(), **degrees, "pareto_front": i in fronts} for i, r in enumerate(results)]
    if Path(path).suffix != ".parquet":
        text = io.StringIO()
        writer = csv.DictWriter(text, fieldnames=list(COLUMNS), lineterminator="\n")
        writer.writeheader()
        writer.writerows(records)
        write_atomic(path, text.getvalue())
        return
    import pyarrow as pa
    import pyarrow.parquet as pq

    kinds = {str: pa.string(), int: pa.int64(), float: pa.float64(), bool: pa.bool_()}
    table = pa.Table.from_pylist(records, schema=pa.schema([(name, kinds[t]) for name, t in COLUMNS.items()]))
    buffer = pa.BufferOutputStream()
    pq.write_table(table, buffer)
    write_atomic(path, buffer.getvalue().to_pybytes())


def _also(r: Result, separator: str) -> str:
    """The configurations `r` stands for too, after `separator`; nothing when it stands for itself alone."""
    return f"{separator}the same schedule as {', '.join(c.variant for c in r.same_as)}" if r.same_as else ""


STALENESS_SYMBOLS = ("circle", "diamond", "square", "triangle-up", "star")  # staleness 0, 1, 2, 3, 4 or more
# A configuration past a device's memory, ringed over its point (its schedule's colour and its symbol kept): the
# hover alone said so, and an OOM configuration led its front's time axis looking like any other.
OOM_NAME, OOM_RING = "OOM: past a device's memory", "#000000"  # black: D3's red is a schedule's


def _group_name(key: tuple[int, float, int]) -> str:
    p, scale, microbatches = key
    return f"{degree_text('p', p)}, cost×{scale:g}, mini-batch of {count_text(microbatches, 'micro-batch')}"


def tradeoff_figure(results: Sequence[Result], front: Sequence[int]):
    """Time per mini-batch against peak memory: a colour per schedule (the legend), a symbol per staleness,
    filled where a configuration is on its Pareto front and hollow where another dominates it, ringed in black where
    it is past a device's memory, the configuration in the hover (with those it stands for too, and any other drawn
    on the same spot, which it hides). Fronts compare only their own group (p, cost scale, mini-batch), so a
    dropdown shows one group at a time, or every group at once."""
    import plotly.graph_objects as go
    from plotly.colors import qualitative

    from ..traces.view import LINE_OVER_PX, MODEBAR_BOTTOM_PX, TICK_FORMAT_STOPS

    on_front = set(front)
    ran = [i for i, r in enumerate(results) if r.metrics is not None]
    groups = sorted({front_group(results[i].config) for i in ran})
    schedules = list(dict.fromkeys(results[i].config.schedule for i in ran))
    palette = qualitative.D3 + qualitative.Dark24
    colours = {name: palette[k % len(palette)] for k, name in enumerate(schedules)}

    def point(r: Result) -> tuple:
        m = r.metrics
        return front_group(r.config), m.time_per_minibatch_ms, m.peak_memory_mb, m.max_staleness

    # Different runs drawn on one spot (PipeDream-2BW reads other weights than PipeDream in the same time and memory)
    at_point: dict[tuple, list[str]] = {}
    for i in ran:
        at_point.setdefault(point(results[i]), []).append(results[i].config.label)

    def hover(r: Result, best: bool) -> str:
        m = r.metrics
        others = [label for label in at_point[point(r)] if label != r.config.label]
        over = " (OOM: past a device's memory)" if m.out_of_memory else ""  # as sweep's table marks it
        warm = "" if m.steady_state else " (no steady state: the warm-up included, -n short of it)"
        return (f"<b>{r.config.label}</b>{' (on its front)' if best else ''}<br>{ms_text(m.time_per_minibatch_ms)} "
                f"ms per mini-batch, {rate_text(m.samples_per_s)} samples/s{warm}<br>"
                f"peak {mib_text(m.peak_memory_mb)} MiB"
                f"{over}, staleness {m.max_staleness}, bubble {percent_text(m.bubble_fraction)}" + _also(r, "<br>")
                + (f"<br>same point as {', '.join(others)}" if others else ""))

    fig = go.Figure()
    trace_group: list[int] = []
    for g, key in enumerate(groups):
        for name in schedules:
            members = [i for i in ran if front_group(results[i].config) == key and results[i].config.schedule == name]
            members.sort(key=lambda i: i not in on_front)  # the legend draws a trace's first point: a front one
            if not members:
                continue
            best = [i in on_front for i in members]
            symbols = [STALENESS_SYMBOLS[min(results[i].metrics.max_staleness, len(STALENESS_SYMBOLS) - 1)]
                       + ("" if b else "-open") for i, b in zip(members, best)]
            fig.add_trace(go.Scattergl(
                x=[results[i].metrics.time_per_minibatch_ms for i in members],
                y=[results[i].metrics.peak_memory_mb for i in members], mode="markers", name=name,
                legendgroup=name, text=[hover(results[i], b) for i, b in zip(members, best)], hoverinfo="text",
                marker={"color": colours[name], "opacity": 1, "symbol": symbols, "size": [13 if b else 9 for b in best],
                        "line": {"width": [1.5 if b else 2 for b in best],
                                 "color": ["#222" if b else colours[name] for b in best]}}))
            trace_group.append(g)
        over = [i for i in ran if front_group(results[i].config) == key and results[i].metrics.out_of_memory]
        if over:  # last in its group: drawn over the points it rings, and last in the legend
            fig.add_trace(go.Scattergl(
                x=[results[i].metrics.time_per_minibatch_ms for i in over],
                y=[results[i].metrics.peak_memory_mb for i in over], mode="markers", name=OOM_NAME,
                legendgroup=OOM_NAME, hoverinfo="skip",
                marker={"symbol": "circle-open", "size": 24, "color": OOM_RING, "line": {"width": 2.5}}))
            trace_group.append(g)

    def shown(chosen: set[int]) -> dict:
        visible = [g in chosen for g in trace_group]
        first: set[str] = set()
        legend = []
        for trace, v in zip(fig.data, visible):  # one legend entry per schedule among the traces shown
            legend.append(v and trace.name not in first)
            if v:
                first.add(trace.name)
        return {"visible": visible, "showlegend": legend}

    marks = ", ".join(f"{symbol.replace('-up', '')} {k}" for k, symbol in enumerate(STALENESS_SYMBOLS))
    key_line = f"filled: on the group's Pareto front; hollow: dominated; staleness {marks} or more"

    def view(label: str, chosen: set[int]) -> tuple[dict, dict]:
        """What choosing `label` restyles (the traces of the groups `chosen`) and relayouts (title, ranges)."""
        heading = f"front {min(chosen) + 1} of {len(groups)}: {label}" if len(chosen) == 1 else label
        return shown(chosen), {"title.text": f"{heading}<br><span style='font-size:12px'>{key_line}</span>",
                               "xaxis.autorange": True, "yaxis.autorange": True}

    choices = [(_group_name(key), {g}) for g, key in enumerate(groups)]
    if len(groups) > 1:
        choices.append((f"every group ({len(groups)} fronts, which do not compete)", set(range(len(groups)))))
    views = [(label, *view(label, chosen)) for label, chosen in choices]
    fig.update_layout(
        updatemenus=[{"buttons": [{"label": label, "method": "update", "args": [traces, layout]}
                                  for label, traces, layout in views],
                      "direction": "down", "x": 0, "xanchor": "left", "y": 1.0, "yanchor": "bottom",
                      "pad": {"b": 8}, "active": 0}] if views else [],
        xaxis_title="time per mini-batch (ms)", yaxis_title="peak memory per device (MiB)", template="plotly_white",
        xaxis_tickformatstops=TICK_FORMAT_STOPS, yaxis_tickformatstops=TICK_FORMAT_STOPS,
        height=650, margin={"t": 130}, legend={"title": {"text": "schedule"}},
        title={"y": 1, "yanchor": "top", "pad": {"t": MODEBAR_BOTTOM_PX + LINE_OVER_PX}})
    if views:  # the first group, as its button would show it
        _, traces, layout = views[0]
        fig.update(data=[{"visible": v, "showlegend": legend} for v, legend in zip(*traces.values())])
        fig.update_layout(title_text=layout["title.text"])
    return fig


def ran_text(results: Sequence[Result]) -> str:
    """How many configurations ran, and how many more did not: skipped (a method that cannot run the shape) and
    folded into another's row (the same schedule), each where there are any. "40 configurations (8 skipped, ...)"
    read as if 8 of the 40 were skipped; the grid had 56."""
    skipped = sum(r.metrics is None for r in results)
    folded = sum(len(r.same_as) for r in results)
    more = [text for count, text in ((skipped, f"{skipped:,} more skipped"),
                                     (folded, f"{folded:,} more the same schedule as one of them")) if count]
    return f"{count_text(len(results) - skipped, 'configuration')} that ran" + (f" ({', '.join(more)})" if more else "")


def where_text(sweeps: Sequence[Sweep]) -> str:
    """Where the sweeps' configurations were simulated: in this process, in how many worker processes (the most
    one sweep started) and how many here beside them, or as Ray tasks."""
    if any(sweep.on_ray for sweep in sweeps):
        return "simulated as Ray tasks"
    workers, here = max(sweep.workers for sweep in sweeps), sum(sweep.here for sweep in sweeps)
    if not workers:
        return "simulated in this process"
    return f"simulated in {workers} worker processes" + (f" ({count_text(here, 'configuration')} in this one)"
                                                         if here else "")


def fronts_table(best: Sequence[Result]):
    """The Pareto fronts' configurations as a table, its figures written as the trade-off's hover writes them
    (plotly's cell formats have no rule of three significant digits, nor "<0.01")."""
    import plotly.graph_objects as go

    from ..traces.view import MODEBAR_BOTTOM_PX, UNDER_MODEBAR_PX

    def axis(name: str, text: Callable[[float], str] = str) -> list[str]:
        return [text(getattr(r.metrics, name)) for r in best]

    marks = ["" if r.metrics.steady_state else "*" for r in best]  # no steady state, as sweep's table marks it
    columns = {"configuration": [r.config.label + _also(r, ": ") for r in best],
               "cost×, m·P": [f"{r.config.cost_scale:g}, {r.config.microbatches * r.config.pipelines}"
                              for r in best],
               "ms/step": [text + mark for text, mark in zip(axis("time_per_minibatch_ms", ms_text), marks)],
               "peak MiB": axis("peak_memory_mb", mib_text), STALENESS_HEADER: axis("max_staleness"),
               "samples/s": [text + mark for text, mark in zip(axis("samples_per_s", rate_text), marks)],
               "bubble": axis("bubble_fraction", percent_text)}
    if any(r.metrics.out_of_memory for r in best):  # as sweep's table: a column only where one is over
        columns["memory"] = ["OOM" if r.metrics.out_of_memory else "fits" for r in best]
    # The page's whole width, the configuration's column a third of it: with plotly's 80 px margins, at 800 px
    # "staleness" and "samples/s" were cut in columns 56 px wide.
    table = go.Figure(go.Table(
        columnwidth=[3, 1.2] + [1] * (len(columns) - 2), header={"values": list(columns), "align": "left"},
        cells={"values": list(columns.values()), "align": "left", "height": 26}))
    top_px = MODEBAR_BOTTOM_PX + UNDER_MODEBAR_PX  # (at the page's width, the mode bar ran over the "bubble" header)
    table.update_layout(height=top_px + 70 + 26 * (len(best) + 1), margin={"t": top_px, "b": 10, "l": 0, "r": 0})
    return table


def write_tradeoff_html(results: Sequence[Result], front: Sequence[int], path: Path,
                        degrees: Mapping[str, int] | None = None) -> None:
    """The trade-off figure and the Pareto fronts listed below it: one self-contained offline page (plotly.js
    embedded); `degrees`: the estimate's t, C and E every row runs (`estimate_degrees`)."""
    from ..traces.view import write_html

    best = [results[i] for i in front]
    every = degrees_text(degrees or {})
    write_html([(f"Trade-off: time per mini-batch vs peak memory, {ran_text(results)}, one Pareto front per p, cost "
                 "scale and mini-batch size" + (f"; {every} in every row" if every else ""),
                 tradeoff_figure(results, front)),
                (f"Pareto fronts: {count_text(len(best), 'configuration')}"
                 + ("; *: no steady state, the warm-up included (-n is short of it)"
                    if any(not r.metrics.steady_state for r in best) else ""), fronts_table(best))], path,
               title="pipesim sweep")
