"""`pipesim tune`: the fastest way to train a measured model on D devices under a per-device memory cap.

The problem. A calibration profile gives per-layer times measured at micro-batch size b, bytes, the
point-to-point link and all-reduce times. Given D identical devices holding G bytes each and a global batch
of B samples per optimizer step, choose
  - a schedule (of `Problem.schedules`),
  - the pipeline depth p, a divisor of D: the devices form r = D/p data-parallel replicas of one pipeline,
  - v model chunks per device (interleaved and V schedules: p·v model stages), P parallel pipelines (AvgPipe),
  - the split of the profile's layers into p·v contiguous stages,
to maximise samples/s subject to every device's peak memory <= G and staleness <= S. b stays fixed (the
times hold at b only), so each pipeline runs m = B/(r·P·b) micro-batches per step, which must be whole.
Ties: less peak memory, then less staleness, then fewer model stages, fewer pipelines, the enumeration order
(catalogue order of the schedules, then smaller p). v > 1 needs p > 1: chunks on a lone device would only
split its all-reduce. Configurations with equal speed, memory and staleness are "twins", listed as one row
(every method is the same schedule at p = 1). `auto`, whose order is searched from the costs, is partitioned
as 1F1B's order is (R = 1, 1F1B's activations), then searched for that partition at the memory each device
allows (an activation limit R no order reaches, so that G binds); the R its order then holds is reported.

Costs. One replica is simulated (p devices, the profile's link between every pair), with its r data-parallel
replicas as the schedule's REDUCE rows: per stage and step, the all-reduce of its gradients over the r
replicas, priced by the scenario (`Scenario.data_parallel_link`: an estimate's data-parallel link, or the fit
of a calibrated profile's measured all-reduce) and run on the device's network stream, overlapping the
backward work still to come; the stage's update waits for it. A calibrated profile without all-reduce times
cannot price it, so it allows p = D only.

Partition. The DP partitioner (profiles/partition.py) minimises the slowest stage with every stage within
G/v, by models read off the candidate's own schedule (`_splitter`): a stage's compute per step as that
schedule runs it, and its memory. If no split fits, the split whose fullest stage is leanest is simulated.

Score. The steady-state step time: how much the makespan grows per extra mini-batch (schedules that flush
repeat exactly from the second step on; the others are averaged over STEADY_STEPS steps past their warm-up, or
where the rows show that window is not yet their periodic regime, that regime's step, in longer runs if need be:
`_periodic_step_ms`), never below the busiest device's compute per step, which no steady state can beat.

Search. Best bound first, in two tiers, so that only what can still win is built and only what can still
win once built is simulated. A shape (schedule, p, v, P, m) is bounded from a sketch of its order read off a
small probe (`_Sketch`): the mean compute, the busiest stage of the best split of the layers, a flushing
chain's fill and drain and its REDUCE waits; and a memory floor, the mean of the bytes every device holds
throughout. Building a candidate (its partition, its order at m) gives its staleness and its memory floor
(static bytes plus the largest activations or weight versions one of a device's stages holds: a lower bound
of the simulated peak, which adds transfer buffers and overlaps on top); its costs give each device's compute
per step plus the REDUCE it must wait out, and a flushing chain's bound: an upper bound of samples/s that
tests hold to the simulation. Candidates over the staleness limit or
with a floor over the cap are out unsimulated; the rest are simulated best bound first, until the bound
falls below the sixth best row found, so the choice and its five runners-up are exact; the caching
allocator's reserve, the dear part of a simulation, is replayed only for a result that could be kept by its
speed and its peak less the reserve (`top_groups`). Excluded
candidates whose floor fits are simulated, best bound first, only while their bound beats the choice by more
than OVER_MARGIN and, once five rows that do are kept (the five shown), the fifth: what the limits cost (one
whose floor is over the cap holds more than the device before any schedule runs), shown where the simulation
beats the margin too, so that what is shown does not depend on what was simulated; the fastest over the cap alone
keeps a row among them where one beats the margin (`_with_heavier`). Those that could beat the
choice by no more than the margin, by their bounds, are not simulated for it: while fewer than five rows are
shown, a note counts them (`_within_margin`).
The limit that changes what a run trains is staleness (synchronous by default): so that it is not a hidden
price, a configuration over it alone (within the cap) that beats the choice by more than the margin is named in
a note (`_staler`): the fastest, exactly, where a row over a limit is one; else the first such one the stale
candidates whose floor fits give, searched best bound first, with the highest bound of those left unsimulated
that could beat it ("up to"), none where nothing could, so that the note costs no more than one such simulation.
"""

from __future__ import annotations

import bisect
import gc
import heapq
import itertools
import math
import multiprocessing
import pickle
import signal
import sys
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, InvalidStateError, ProcessPoolExecutor
from concurrent.futures import wait as wait_for_futures
from contextlib import contextmanager, nullcontext
from dataclasses import asdict, dataclass, field, replace
from functools import cache, cached_property, partial
from typing import TypeVar

import numpy as np

from ..profiles.partition import (
    MostOfRanges,
    OverCapError,
    ScaledRanges,
    activation_ranges,
    least_slowest,
    owners,
    partition,
    range_sums,
    tied_pairs,
)
from ..profiles.schema import (
    LayerProfile,
    Profile,
    fused_accumulation,
    layer_costs,
    layer_static_bytes,
    p2p_synced,
    stage_waits_ms,
    step_shares,
    step_totals,
    wgrad_held_ranges,
)
from ..profiles.workload import layers_text, most_stages
from ..schedules import (
    ALL_TO_ALL_KINDS,
    COLLECTIVE_KINDS,
    KIND_CODE,
    KINDS,
    METHODS,
    NUM_COMPUTE_KINDS,
    PASS_COLLECTIVE_KINDS,
    Kind,
    Schedule,
    ScheduleError,
    ScheduleParams,
    StageGraph,
    flushes,
    kind_mask,
    peak_per_stage,
    version_reads,
    warmup_minibatches,
)
from ..schedules.ranks import estimated_experts_refusal
from ..schedules.rivals import least_microbatch_group
from ..sim.cluster import Cluster
from ..sim.costs import WGRAD_ACTIVATION_FRACTION, Costs, owned_bytes, product_delay, wgrad_held
from ..sim.engine import device_product_ms, simulate, static_bytes, takes_time
from ..traces import Summary, Trace, summarize
from ..traces.metrics import percent_text, rate_text, steady_bubble, steady_compute_ms
from ..units import GIB, MIB, count_text, degree_text
from .auto import activation_ratio, check_shape, schedule_frame
from .scenario import (
    CollectiveLink,
    Scenario,
    device_stages,
    experts_moved,
    held_weights,
    over_expert_groups,
    profile_costs,
    stage_held_counts,
)

RUNNERS_UP = 5
OVER_MARGIN = 0.005
"""How much more than the choice's samples/s a configuration over a limit must be able to give (by its bound) to
be simulated for a row over the limits or the staleness note, and give (simulated) to be shown: what the limits
cost is worth a row where it is more than this; within it, proving that a candidate loses is most of tune's time
(the 70B's twelve stale p = 32 orders, 0.02-1.5 % over by their bounds, 38 CPU s of 60), so those are counted in
a note instead."""
COMPUTE = np.array([kind not in COLLECTIVE_KINDS | ALL_TO_ALL_KINDS  # op kinds on compute, not the network lane
                    for kind in KINDS[:NUM_COMPUTE_KINDS]])
# the replicas' collectives (REDUCE, GATHER): a candidate's all-reduce, not its passes' all-to-alls
DATA_PARALLEL = np.array([kind in COLLECTIVE_KINDS - PASS_COLLECTIVE_KINDS for kind in KINDS[:NUM_COMPUTE_KINDS]])
PASSES = tuple(KIND_CODE[kind] for kind in (Kind.F, Kind.B, Kind.I, Kind.W))  # the passes' columns of an op table
_UNBOUNDED_BYTES = 1 << 62  # a peak no cap admits
STEADY_STEPS = 12  # steps averaged for schedules that never flush (their steady state can cycle over a few)
LONGEST_STEADY_STEPS = 8 * STEADY_STEPS  # the longest run `_periodic_step_ms` looks for a periodic regime in
UNPROVEN_STEADY_STEPS = 4 * LONGEST_STEADY_STEPS  # its longest where the engine's rules are not max-plus
_PERIOD_TOLERANCE_PS = 2  # rows' ends read back from the trace's microseconds: within 2 ps of the engine's
_ORDINAL_VALUES = 1 << 62  # the most values `_ordinal` packs into one int64
CRITICAL_STEPS = 4  # steps of those a critical path follows (`_with_critical_path`), fewer than STEADY_STEPS
Found = TypeVar("Found")  # what `_per_pipeline` keeps
AHEAD_READ = 15  # the heap's first four levels, which idle workers read for work ahead (`_Built.ahead`)


class TuneError(ValueError):
    """No answer: nothing to search, or nothing fits; the message says what would."""


@dataclass(frozen=True)
class Problem:
    devices: int  # the schedules' devices, each C context-parallel GPUs (`Scenario.order_params`): D/C of the D GPUs
    memory_cap_bytes: int
    batch_size: int  # B: samples per optimizer step, over all replicas and pipelines
    schedules: tuple[str, ...]
    max_staleness: int = 0  # synchronous: the same training as one device
    max_chunks: int = 4
    max_pipelines: int = 4
    search_seconds: float | None = None  # auto's search budget (None: its default)
    zero: int = 0  # ZeRO's stage over each candidate's d·C gradient ranks (`Config.zero`)
    memory_part: str | None = None  # the catalogue part whose own memory is the cap (`nothing_fits_text`)
    context: int = 1  # C: the context-parallel GPUs each of the devices stands for, as the settings' profiles say

    @property
    def gpus(self) -> int:
        """D: the GPUs the devices stand for, as --devices gave them."""
        return self.devices * self.context

    @staticmethod
    def devices_of(gpus: int, context: int) -> int:
        """The search's devices on D GPUs, each device C context-parallel GPUs (`gpus`' inverse; C divides D)."""
        return gpus // context


@dataclass(frozen=True)
class Setting:
    """A profile the search prices candidates on, and what it was made for: a calibrated one serves every depth
    p; an estimate (--gpu) was made for one tensor-parallel degree t, recomputation, depth p (which links its
    stage boundaries cross), expert-parallel degree E and rank order (where its groups' ranks sit), at its
    micro-batch size."""

    scenario: Scenario
    tensor: int = 1  # t: devices each layer is split over
    recompute: str | None = None  # None: as calibrated
    depths: tuple[int, ...] | None = None  # the p it prices (None: any)
    expert: int = 1  # E: ranks a mixture of experts' routed experts are placed over
    sequence_parallel: bool = False  # an estimate's at t > 1: norms and dropouts split over the t GPUs
    rank_order: str = "pipesim"  # an estimate's, of schedules/ranks.py's RANK_ORDERS
    orders_alike: bool = False  # every rank order searched places it alike (the estimate is theirs too)

    @property
    def microbatch_size(self) -> int:
        return self.scenario.measured.environment.microbatch_size


@dataclass(frozen=True)
class Config:
    schedule: str
    stages: int  # p: devices per pipeline
    chunks: int  # v: model stages per device
    pipelines: int  # P: pipelines sharing the devices
    microbatches: int  # m, per pipeline and step
    replicas: int  # r = D / (p·t): data-parallel replicas d
    tensor: int = 1  # t
    microbatch_size: int = 1  # b
    recompute: str | None = None  # an estimate's; None: as calibrated
    expert: int = 1  # E
    zero: int = 0  # ZeRO's stage: the problem's, none where d·C = 1 (as the estimate's `Parallelism` shards)
    sequence_parallel: bool = False  # an estimate's
    rank_order: str = "pipesim"  # an estimate's
    orders_alike: bool = False  # the setting's
    # interleaved 1F1B's micro-batch group where m is no multiple of p (`least_microbatch_group`); None: p's
    microbatch_group: int | None = None

    def label(self) -> str:
        extra = [degree_text("v", self.chunks)] * (self.chunks > 1)
        extra += [degree_text("g", self.microbatch_group)] if self.microbatch_group is not None else []
        extra += [degree_text("P", self.pipelines)] * (self.pipelines > 1)
        extra += [degree_text("t", self.tensor)] * (self.tensor > 1) + ["sp"] * self.sequence_parallel
        extra += [degree_text("d", self.replicas)] * (self.recompute is not None)
        extra += [degree_text("E", self.expert)] * (self.expert > 1)
        extra += [degree_text("b", self.microbatch_size)] * (self.recompute is not None)
        extra += [f"recompute {self.recompute}"] * (self.recompute not in (None, "none"))
        extra += [f"ranks {self.rank_order}"] * (self.rank_order != "pipesim")
        return f"{self.schedule} {degree_text('p', self.stages)}" + "".join(f" {e}" for e in extra)


@dataclass(frozen=True)
class Candidate:
    """A configuration with its partition, costs and everything known about it before simulating."""

    config: Config
    setting: Setting  # what it is priced on
    index: int  # enumeration order, the last tie-break
    params: ScheduleParams  # for the long run
    bounds: list[int]
    schedule: Schedule  # the long run: enough mini-batches to reach the steady state
    short_minibatches: int
    costs: Costs
    links: Cluster  # between its devices (`Scenario.links`)
    staleness: int
    busy_ms: np.ndarray  # compute per step, per device
    memory_floor_bytes: int
    allreduce_ms: float  # its replicas' REDUCEs and GATHERs per step, on the device that spends most on them
    max_samples_per_s: float
    activation_limit: float | None  # a searched order's (auto): the R it holds; None for a fixed order
    short_schedule: Schedule | None = None  # the short run, built with the long where building it later would
    # search again (a searched order's search is remembered only for the next few)
    critical: bool = False  # whether its bound holds its critical path too (`_with_critical_path`)

    @cached_property
    def busiest_ms(self) -> float:
        """The busiest device's compute in a steady step with the gradient accumulations its B and W rows add, which
        `busy_ms` leaves out and the simulator prices in those rows: no step is shorter (`_measured`), and what a
        reason names (`_slower_part`, the choice's once for every row it explains)."""
        return _steady_busiest_ms(self.schedule, self.costs, self.busy_ms, self.short_minibatches)


@dataclass(frozen=True)
class Result:
    candidate: Candidate
    samples_per_s: float
    step_ms: float
    bubble_fraction: float  # steady state: 1 - mean compute per step / step time
    peak_memory_bytes: int

    @property
    def config(self) -> Config:
        return self.candidate.config

    @property
    def staleness(self) -> int:
        return self.candidate.staleness

    def to_dict(self) -> dict:
        c = self.config
        return {"schedule": c.schedule, "stages": c.stages, "chunks": c.chunks, "pipelines": c.pipelines,
                "microbatches": c.microbatches, "microbatch_group": c.microbatch_group, "replicas": c.replicas,
                "tensor_parallel": c.tensor,
                "microbatch_size": c.microbatch_size, "recompute": c.recompute, "expert_parallel": c.expert,
                "zero": c.zero, "sequence_parallel": c.sequence_parallel, "rank_order": c.rank_order,
                "rank_orders_alike": c.orders_alike,
                "partition": list(self.candidate.bounds),
                "samples_per_s": self.samples_per_s, "step_ms": self.step_ms, "bubble_fraction": self.bubble_fraction,
                "peak_memory_gib": self.peak_memory_bytes / GIB, "staleness": self.staleness,
                "allreduce_ms_per_step": self.candidate.allreduce_ms,
                "activation_limit": self.candidate.activation_limit}


@dataclass(frozen=True)
class Row:
    """A result as shown: why it lost to the choice, and its twins (other configurations with the same speed,
    memory and staleness, listed once: typically one schedule under several names, as every method at p = 1)."""

    result: Result
    why: str
    twins: list[Config]

    def to_dict(self) -> dict:
        return {**self.result.to_dict(), "why": self.why, "same_result": [twin.label() for twin in self.twins]}


@dataclass(frozen=True)
class Stats:
    shapes: int  # (schedule, p, v, P) with a whole m and at least one layer per model stage
    refused: int  # shapes the method refuses (e.g. v > 1 for 1F1B, interleaved with m not a multiple of p)
    stale: int  # configurations over the staleness limit, known from the schedule alone
    over_memory_floor: int  # memory floor over the cap
    pruned: int  # within the limits but never simulated: their throughput bound could not beat the rows kept
    simulated: int  # within the limits by staleness and memory floor, and simulated
    simulated_over_limits: int  # stale or over the memory floor, simulated only to show what the limits cost
    # leaner cuts simulated where no cut for time fits the cap: leanest (`_fastest_leanest`) or cut again for the cap
    # less an overrun (`_fastest_tightened`)
    simulated_leanest: int
    seconds: float
    refused_built: int  # of `refused`, shapes searched and refused once built (a searched order short of memory)

    @property
    def configurations(self) -> int:
        return self.shapes - self.refused


@dataclass(frozen=True)
class StalerBound:
    """The stale candidates the staleness note left unsimulated whose bounds beat the configuration it names
    (`_staler`): how many, and the highest bound, in samples/s."""

    configurations: int
    max_samples_per_s: float


@dataclass(frozen=True)
class Tuning:
    problem: Problem
    choice: Row
    runners_up: list[Row]
    excluded: list[Row]  # faster than the choice but over a limit
    stats: Stats
    notes: list[str]
    staler: Row | None = None  # a configuration over the staleness limit alone that beats the choice (`_staler`)
    staler_bound: StalerBound | None = None  # None: `staler` is the fastest such, exactly
    over_within_margin: int = 0  # configurations over a limit left unshown within OVER_MARGIN (`_within_margin`)

    def to_dict(self) -> dict:
        problem = self.problem
        return {
            # the cap in GiB to a byte's precision (9.3e-10 GiB): --memory-gb 0.1, held as whole bytes, is 0.1 again
            "problem": {"devices": problem.gpus, "memory_cap_gib": round(problem.memory_cap_bytes / GIB, 9),
                        "batch_size": problem.batch_size, "schedules": list(problem.schedules),
                        "max_staleness": problem.max_staleness, "max_chunks": problem.max_chunks,
                        "max_pipelines": problem.max_pipelines, "search_seconds": problem.search_seconds,
                        "zero": problem.zero},
            "choice": self.choice.to_dict(),
            "runners_up": [row.to_dict() for row in self.runners_up],
            "excluded": [row.to_dict() for row in self.excluded],
            "search": {**asdict(self.stats), "configurations": self.stats.configurations},
            "notes": self.notes,
            "over_within_margin": self.over_within_margin,
            "staler_winner": None if self.staler is None else {
                **self.staler.to_dict(),  # with the highest bound of what could be faster unsimulated (None: exact)
                "bound_samples_per_s": self.staler_bound.max_samples_per_s if self.staler_bound else None,
                "bound_configurations": self.staler_bound.configurations if self.staler_bound else 0},
        }


def speed_key(samples_per_s: float) -> float:
    """Scores equal to 9 significant digits tie (runs of different lengths round differently)."""
    return float(f"{samples_per_s:.9g}")


def rank_key(result: Result) -> tuple:
    c = result.config
    return (-speed_key(result.samples_per_s), result.peak_memory_bytes, result.staleness, c.stages * c.chunks,
            c.pipelines, result.candidate.index)


def allowed(result: Result, problem: Problem) -> bool:
    return result.peak_memory_bytes <= problem.memory_cap_bytes and result.staleness <= problem.max_staleness


def twins(a: Result, b: Result) -> bool:
    return (speed_key(a.samples_per_s), a.peak_memory_bytes, a.staleness) == (
        speed_key(b.samples_per_s), b.peak_memory_bytes, b.staleness)


def start_workers(workers: int, forked: bool = True, collect: bool = False) -> Workers | None:
    """The search's `workers` processes (None for 1: it runs here), started now, so that a caller with work of
    its own before the search (tune --gpu's estimates) has them ready on the cores that work leaves idle. The
    caller stops them (`Workers.stop`, or leaving a `with` over them), not `shutdown`, which waits for one still
    starting. Forked where this process runs no other thread (tune --gpu starts them before its progress line)
    and `forked` allows it (sweep's workers are fresh interpreters): a copy of it has the simulator
    imported already, where a spawned interpreter imports it again (`_started`), about a CPU second a worker on
    cores the estimates want. `collect`: the workers keep their cycle collector (sweep's live the whole grid,
    where tune's live one search: `_started`). Spawned otherwise: a fork copies the locks other threads hold (a
    progress bar's), and a worker could wait on one forever. Ctrl-C, which reaches the workers too, is this
    process's to report ("interrupted"): a worker ends without a word (`_started`), and ignores it while it starts
    (`_ignoring_ctrl_c`)."""
    if workers <= 1:
        return None
    alone = forked and threading.active_count() == 1 and "fork" in multiprocessing.get_all_start_methods()
    if alone:
        sys.stdout.flush()  # a forked worker writes out its copy of what is buffered as it ends
        sys.stderr.flush()
    with _ignoring_ctrl_c():
        pool = Workers(workers, "fork" if alone else "spawn", collect)
        for _ in range(workers):  # now: a fork starts all at the first task, a spawn one per task while none is idle
            pool.submit(_started, collect)
    return pool


class Workers(ProcessPoolExecutor):
    """`start_workers`' pool, which records each process its context (`mp_context`, what the executor launches its
    workers with) launches, so that Ctrl-C can end them at once (`stop`): before Python 3.14 the executor has no
    public way to."""

    def __init__(self, workers: int, method: str, collect: bool) -> None:
        self._launched: list[multiprocessing.process.BaseProcess] = []
        own = multiprocessing.get_context(method)
        self._process = own.Process
        context = type(own)()
        context.Process = self._launch  # the method's own context otherwise
        super().__init__(workers, mp_context=context, initializer=_started, initargs=(collect,))

    def _launch(self, *args, **kwargs) -> multiprocessing.process.BaseProcess:
        process = self._process(*args, **kwargs)
        self._launched.append(process)
        return process

    def stop(self, at_once: bool) -> None:
        """The workers shut down, what runs finished and what waits dropped; `at_once` (Ctrl-C, an error): ended
        first, where shutting down would wait for one still starting (a spawned worker's imports, seconds on a busy
        host, with Ctrl-C ignored: `_ignoring_ctrl_c`) before it gave the prompt back."""
        with self._quiet_on_cancelled_work() if at_once else nullcontext():
            if at_once:
                started = [process for process in self._launched if process.pid is not None]  # one whose start failed
                for process in started:  # has no process to end, and ending it raised over the error that stopped it
                    process.terminate()
                for process in started:
                    process.join()
                # one ended mid-send leaves half a result in the pipe, which the pool's manager thread would wait for
                # forever (this process holds the pipe's write end too, tune --gpu's estimates send hundreds of KB):
                # closed, the thread reads its end, marks the pool broken and ends, and shutting down returns
                if self._result_queue is not None:
                    self._result_queue._writer.close()
            tasks = self._call_queue  # (shutting down lets go of it)
            self.shutdown(cancel_futures=True)  # joins the pool's manager thread
            # the tasks' pipe, read by no worker now: its feeder thread, blocked writing a task's hundreds of KB, is
            # joined as this process exits, which hung where Python 3.11's manager thread, failing on a cancelled
            # task (`_quiet_on_cancelled_work`), ended before its own closing of the pipe and the queue (later
            # Pythons catch that failure). Closed once that thread has ended: closed beside it, both closed the one
            # descriptor. Then the queue closed and its feeder thread joined (no-ops where the manager did both): left
            # waiting for more tasks, the feeder lived as long as this process, whose next pool is then spawned, not
            # forked (`start_workers`: another thread runs)
            if at_once and tasks is not None:
                tasks._reader.close()
                tasks.close()
                tasks.join_thread()

    @contextmanager
    def _quiet_on_cancelled_work(self) -> Iterator[None]:
        """The pool's manager thread not reported for the error Python 3.11's raises when, finding a worker ended,
        it fails a queued task the search had cancelled (`_if_done`): concurrent.futures.process `terminate_broken`
        sets an exception on every pending future, which a cancelled one refuses (3.12 passes over it). Ending the
        workers is this pool's own doing, and the thread's traceback was printed under tune's one-line refusal."""
        hook = threading.excepthook

        def unless_cancelled_work_failed(args: threading.ExceptHookArgs) -> None:
            if not (args.exc_type is InvalidStateError and args.thread is self._executor_manager_thread):
                hook(args)

        threading.excepthook = unless_cancelled_work_failed
        try:
            yield
        finally:
            threading.excepthook = hook

    def __exit__(self, kind, value, traceback) -> bool:
        self.stop(at_once=kind is not None)
        return False


@contextmanager
def _ignoring_ctrl_c() -> Iterator[None]:
    """SIGINT ignored here while workers start: a worker inherits that, forked or spawned, until `_started` sets
    its own handler, where a spawned interpreter would raise KeyboardInterrupt, with a traceback, in the middle of
    its imports. A Ctrl-C in those milliseconds is lost. Only the main thread may set a handler (elsewhere this
    does nothing), and one not set from Python cannot be put back (then neither)."""
    handler = signal.getsignal(signal.SIGINT)
    if handler is None or threading.current_thread() is not threading.main_thread():
        yield
        return
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, handler)


def device_shares(devices: int, workers: int) -> list[range]:
    """A trace's `devices` dealt out device by device to at most `workers` tasks, one share each (each device's
    caching allocator replays apart: `Scenario.reserves`' devices), as even as they deal."""
    return [range(devices)[k::workers] for k in range(min(workers, devices))]


def dealt_back(found: Sequence[Sequence[int]]) -> list[int]:
    """Each device's value in device order, from what the tasks of `device_shares`' shares found, in their order."""
    values = [0] * sum(map(len, found))
    for share, share_values in enumerate(found):
        values[share::len(found)] = share_values
    return values


def _started(collect: bool = False) -> None:
    """Each worker's initializer, and the tasks that spawn them: unpickling it imports this module, all that a
    worker needs before its first task. The worker's cycle collector is held off, as tune's own is (commands/
    common.py `collector_paused`): on the 70B that takes its two workers' CPU from 22.1 to 19.6 s, and a
    collection as a worker ends (it lives one search) finds some 650 objects unreachable. Ctrl-C ends the worker
    quietly (`_quit_quietly`). With `collect` (sweep's workers, which live the whole grid) the collector stays on."""
    signal.signal(signal.SIGINT, _quit_quietly)
    if not collect:
        gc.disable()


def _quit_quietly(signum: int, frame: object) -> None:
    """A worker's SIGINT: it exits with the shell's code for the signal (130) and no traceback of its own, idle
    or mid-task (the task's future then holds the SystemExit); the process that started it, told too, says it."""
    raise SystemExit(128 + signum)


def tune(settings: list[Setting], problem: Problem, report: Callable[[str], None] | None = None,
         workers: int = 1, pool: Workers | None = None) -> Tuning:
    """The best configuration, its runners-up and what the limits cost (see the module docstring), over every
    profile of `settings`. A candidate is built (partitioned, costed) only when its shape's bound comes up in
    the search, and simulated only when its own does, in `workers` processes (1: here; `pool`: those
    `start_workers` started, else started now); `report`, if given, is told how far the search is. Each device's
    memory is the cap, as the simulate line tune prints gives it (--memory-gb): the caching allocator's reserve is
    replayed within it (its replay within the part's whole memory kept more cached, a peak 494 MiB over that line's
    on the 8B Llama at 40 GiB), and auto's order searched within it."""
    started = time.perf_counter()
    settings = capped_settings(settings, problem)
    orders = _Orders()
    shapes, count, refused = _shapes(settings, problem, orders)
    if not shapes:
        raise TuneError(_nothing_to_search(settings, problem, count, orders.refusals()))
    with _Built(problem, orders, report, len(shapes), workers, pool) as built:
        return _search(settings, problem, shapes, built, count, refused, started)


def capped_settings(settings: list[Setting], problem: Problem) -> list[Setting]:
    """`settings` each with its devices' memory the problem's cap (`Scenario.memory_bytes`), as `tune` searches them:
    what an exhaustive search of the same problem simulates too."""
    return [replace(setting, scenario=replace(setting.scenario, memory_bytes=problem.memory_cap_bytes))
            for setting in settings]


def _search(settings: list[Setting], problem: Problem, shapes: list[Shape], built: _Built, count: int, refused: int,
            started: float) -> Tuning:
    limit, cap = problem.max_staleness, problem.memory_cap_bytes

    def fits_floor(item: Shape | Candidate) -> bool:
        return item.memory_floor_bytes <= cap

    def fresh(item: Shape | Candidate) -> bool:  # within the staleness limit (unknown before it is built) and floor
        return (item.staleness is None or item.staleness <= limit) and fits_floor(item)

    best, _ = top_groups(shapes, built, fresh, lambda result: allowed(result, problem), float("-inf"),
                         staler_ahead=True)
    leanest, simulated_leanest = [], 0
    if not best:  # every cut for time over the cap, with the reserve the partitioner does not count: the leanest?
        fastest, simulated_leanest = _fastest_leanest(settings, problem)
        tightened, simulated_tightened = _fastest_tightened(shapes, built, problem, fastest)
        best, leanest = [[tightened or fastest]], [TIGHTENED_NOTE if tightened else LEANEST_NOTE]
        simulated_leanest += simulated_tightened
    choice = best[0][0]
    margin = speed_key(choice.samples_per_s * (1 + OVER_MARGIN))
    faster, _ = top_groups(shapes, built, fits_floor, lambda result: not allowed(result, problem), margin,
                           groups=RUNNERS_UP)  # the rows shown, and no more
    faster = _with_heavier(faster, shapes, built, problem, margin, fresh)
    staler, bounds = _staler(shapes, built, problem, margin, faster)
    within = _within_margin(shapes, built, problem, choice, margin) if len(faster) < RUNNERS_UP else 0

    def row(group: list[Result]) -> Row:
        return Row(group[0], explain(group[0], choice, problem), [twin.config for twin in group[1:]])

    refused_built, *accounts = _accounts(shapes, built, problem)
    stats = Stats(count, refused + refused_built, *accounts, simulated_leanest, time.perf_counter() - started,
                  refused_built)
    staler_row = row(staler) if staler else None
    unsimulated = StalerBound(len(bounds), max(bounds)) if staler_row and bounds else None
    return Tuning(problem, row(best[0]), [row(g) for g in best[1:]], [row(g) for g in faster], stats,
                  _notes(settings, problem) + leanest + _headroom_note(choice, problem)
                  + ([_within_margin_note(within)] if within else [])
                  + ([_staler_note(staler_row, choice, unsimulated)] if staler_row else []),
                  staler_row, unsimulated, within)


def _heavier(result: Result, problem: Problem) -> bool:
    """Over the memory cap and within the staleness limit: what more memory alone would allow."""
    return result.peak_memory_bytes > problem.memory_cap_bytes and result.staleness <= problem.max_staleness


def _with_heavier(faster: list[list[Result]], shapes: list[Shape], built: _Built, problem: Problem,
                  margin: float, fresh: Callable[[Shape | Candidate], bool]) -> list[list[Result]]:
    """The rows over the limits, with the fastest configuration over the memory cap alone among them where one
    beats the choice by more than the margin: five faster rows over the staleness limit (named in a note anyway)
    would otherwise hide what a little more memory buys (a config 10 KiB over the cap and 67 % faster), so it
    takes the last row's place, in rank order. Its search, over the candidates the choice's was (`fresh`), is
    short: a result among them that beats the choice has been simulated by the choice's search already."""
    if len(faster) < RUNNERS_UP or any(_heavier(group[0], problem) for group in faster):
        return faster  # fewer rows: every one over a limit that beats the margin is among them
    heavier, _ = top_groups(shapes, built, fresh, lambda result: _heavier(result, problem), margin, groups=1)
    if not heavier:
        return faster
    return sorted([*faster[:RUNNERS_UP - 1], *heavier], key=lambda group: rank_key(group[0]))


def _within_margin(shapes: list[Shape], built: _Built, problem: Problem, choice: Result, margin: float) -> int:
    """How many configurations over a limit (their floor within the cap, as the rows over the limits) might beat
    the choice by no more than OVER_MARGIN (`margin`, a speed key): those whose bound (`_known_bound`) beats the
    choice's and not the margin. A configuration within the limits is not among them: none beats the choice."""
    cap, fastest = problem.memory_cap_bytes, speed_key(choice.samples_per_s)
    count = 0
    for shape in shapes:
        item = built.known(shape)
        if item is None or item.memory_floor_bytes > cap:
            continue
        count += fastest < speed_key(_known_bound(built, shape.index, item)) <= margin
    return count


# The share of a catalogue part's memory under which a choice's peak is said to leave no headroom: the CUDA context,
# NCCL's buffers and whatever else allocates outside torch's caching allocator take their share of what the driver
# gives torch (`Gpu.device_memory`), and no count holds them.
HEADROOM = 0.02


def _headroom_note(choice: Result, problem: Problem) -> list[str]:
    """A note where the choice peaks within `HEADROOM` of the part's own memory (the cap where --memory-gb is not
    given): it fits what the driver gives torch, which a run does not have whole."""
    if problem.memory_part is None or choice.peak_memory_bytes <= problem.memory_cap_bytes * (1 - HEADROOM):
        return []
    left = 1 - choice.peak_memory_bytes / problem.memory_cap_bytes
    return [f"the choice peaks at {memory_text(choice.peak_memory_bytes)}, {percent_text(left)} under the "
            f"{problem.memory_part}'s {memory_text(problem.memory_cap_bytes)} (`pipesim gpus`); the CUDA context and "
            "NCCL's buffers, which pipesim does not count, take some of it: give --memory-gb to keep headroom"]


def _within_margin_note(count: int) -> str:
    return (f"{count_text(count, 'more configuration')} over the limits might beat the choice by at most "
            f"{_percent(OVER_MARGIN)} (by their bounds; not shown)")


def _staler(shapes: list[Shape], built: _Built, problem: Problem, margin: float, faster: list[list[Result]]
            ) -> tuple[list[Result], list[float]]:
    """The staleness note's configuration: over the staleness limit alone (within the cap) and faster than the
    choice by more than OVER_MARGIN (`margin`, a speed key), with its twins (none if nothing is), and the bounds
    (samples/s) of the stale candidates left unsimulated that could be faster still. The fastest, exactly, where
    a row over a limit is one (`faster` ranks them exactly); else the stale candidates are searched best bound
    first up to the first such result (`top_groups`' `first`), and the fastest of those simulated so far is
    named, with its twins simulated so far: the note says what the limit costs, and at most how much more by the
    bounds, without simulating every stale candidate whose bound beats the one found. A candidate left whose
    simulation is known without its replay is bounded by the speed that gave (exact, or a bound from above where
    it lost: `_Built.floor`)."""
    limit, cap = problem.max_staleness, problem.memory_cap_bytes
    stale = next((group for group in faster if group[0].staleness > limit and group[0].peak_memory_bytes <= cap), None)
    if stale is not None:
        return stale, []
    found, left = top_groups(shapes, built, lambda item: (item.staleness is None or item.staleness > limit)
                             and item.memory_floor_bytes <= cap, lambda result: result.peak_memory_bytes <= cap,
                             margin, groups=1, first=True)
    if not found:
        return [], []
    simulated = [result for result in built.results.values()
                 if result.staleness > limit and result.peak_memory_bytes <= cap]
    fastest = min(simulated, key=rank_key)  # the one found, or one the passes before simulated
    bounds = [_known_bound(built, index, item)
              for item, index in ((item, _index(item)) for item in left) if index not in built.results]
    # a bound is shaded a billionth over the step it bounds (`_candidate`): one within that ties, as a twin would
    return (sorted([result for result in simulated if twins(result, fastest)], key=rank_key),
            [bound for bound in bounds if speed_key(bound * (1 - 1e-9)) > speed_key(fastest.samples_per_s)])


def _known_bound(built: _Built, index: int, item: Shape | Candidate | Result) -> float:
    """The most samples/s candidate `index` (`item`) can give as far as the search knows: its simulation's speed
    where that is known without its replay (`_Built.floor`: exact, or a bound from above where it lost), else its
    bound (`_bound`)."""
    return built.floors[index].samples_per_s if index in built.floors else _bound(item)


def _index(item: Shape | Candidate | Result) -> int:
    return item.candidate.index if isinstance(item, Result) else item.index


def top_groups(shapes: list[Shape], built: _Built, eligible: Callable[[Shape | Candidate], bool],
               keep: Callable[[Result], bool], above: float, groups: int = RUNNERS_UP + 1,
               staler_ahead: bool = False, first: bool = False
               ) -> tuple[list[list[Result]], list[Shape | Candidate | Result]]:
    """The best `groups` groups of twins among the results `keep` accepts whose speed key beats `above`, in
    rank order (each group best first), of the candidates `eligible` accepts; and what is left untaken whose
    bound (a result's: its speed) is over the last group kept, nothing unless `first`. With `first`, the search
    stops at the first result kept, a group of one, exact but not always the best: what is still on the heap
    or out (searched, simulated or replayed in a worker, its result not taken) is left.

    Best bound first: a shape not yet built is built when its bound (`Shape.max_samples_per_s`, which no
    partition beats) comes up, and goes back with the candidate's own bound (never higher; a searched order's
    shape first goes back bounded on its partition, before its search, `_Built.advance`); a candidate goes back
    once more with its critical path (`_Built.tighten`), and is simulated when its bound comes up after that. So
    the bounds popped never rise, and the search stops at the first that can neither beat `above` nor match the
    last group kept: no later one could.

    With worker processes, up to `built.window` candidates are simulated, or searched orders searched (their
    candidates built: `_Built.submit_search`), at once: those popped next, while the results before them are
    still out; other shapes that come up meanwhile are built here. Results are taken in the order popped, and
    only when the next finds the window full or the heap has nothing left that could win, so what is built
    and simulated does not depend on timing. The answer is the one doing one at a time gives: the search stops
    only once no search is out (a candidate it builds goes back on the heap), and a shape or candidate popped
    only because a result before it was not in yet has a bound no better than the first that would have
    stopped the search, so its result can neither beat `above` nor enter the groups kept (which groups are
    kept does not depend on the order results come in); it was only built or simulated for nothing.

    A result is first taken with its peak less the caching allocator's reserve (`_Built.floor`), which is at
    least 0 (max reserved >= max allocated): a lower bound of its peak. Its speed alone says whether it beats
    `above` and whether its group would rank above the last group kept; `keep` compares the peak with the cap
    (at most or over it), so if it refuses both that bound and an unbounded peak it refuses the peak between.
    Only a result that passes all three is replayed (`_Built.replay`), for its peak: whether `keep` takes it,
    its twins and its rank among equally fast ones. It is taken again after what is out before it: the groups
    kept meanwhile are fewer, so a later result is cut no sooner than it would be, and the groups kept in the end
    are the ones every result replayed gives. Taken again it is pending, replayed only where a decision depends
    on it (`settle`, the fastest first; with `first`, each as it comes): the bar lies between the one the
    results replayed set and the one they would set with every pending result kept as a group of its own; where
    a bound or a result's speed falls between the two, the fastest pending are replayed until it does not, and
    all of them before an order that never flushes is simulated against the bar (`_measured` stops by it). So
    every decision is the one replaying each result as it came gives, and a result put out of the groups by
    faster ones before any decision needed it is never replayed (the 70B's first pass: three of its nine
    replays, 4 CPU s); idle workers replay none ahead (`settle` hands the next fastest out). With `staler_ahead`
    (the first pass, within the limits), idle workers also take the steps the later passes will want of the stale
    candidates built meanwhile (`_Built.ahead_of_staler`)."""
    heap = []
    for shape in shapes:
        item = built.known(shape)
        if item is not None and eligible(item):
            heap.append((-item.max_samples_per_s, shape.index, item))
    heapq.heapify(heap)
    kept: list[list[Result]] = []
    out: deque[Shape | Candidate | Result] = deque()  # handed to a worker (searched, simulated or replayed), in order
    pending: list[Result] = []  # taken again for their replay, not replayed yet (unless `first`): `settle`

    def bar(unreplayed: Sequence[Result]) -> float:
        """The speed key a result must beat to matter: `above`, and once the groups are full, all under the last
        kept (a tie with it ranks by the rest of `rank_key`), were each of `unreplayed` kept as a group of its own."""
        speeds = sorted([speed_key(g[0].samples_per_s) for g in kept]
                        + [speed_key(result.samples_per_s) for result in unreplayed], reverse=True)
        return above if len(speeds) < groups else max(above, math.nextafter(speeds[groups - 1], -math.inf))

    def beaten(exact: bool = False) -> float:
        """The bar as the results replayed set it (`bar`), the least it can be; `exact`: the pending settled until
        they set it."""
        while exact and pending and bar(()) < bar(pending):
            settle()
        return bar(())

    def could_win(speed: float) -> bool:
        """Whether a result this fast beats `above` and its group would rank no lower than the last kept: the
        pending settled only where that depends on them."""
        while pending and bar(()) < speed <= bar(pending):
            settle()
        return speed > bar(())

    def worth_replaying(result: Result) -> bool:
        """Whether a result known by its peak less the reserve could be kept at some peak: its speed could win
        and `keep` takes it at that peak or at an unbounded one (it holds the peak to a cap, at most or over)."""
        return could_win(speed_key(result.samples_per_s)) and (
            keep(result) or keep(replace(result, peak_memory_bytes=_UNBOUNDED_BYTES)))

    def keep_replayed(result: Result) -> None:
        nonlocal kept
        if not keep(result):
            return
        group = next((g for g in kept if twins(g[0], result)), None)
        if group is not None:
            group[:] = sorted([*group, result], key=rank_key)
        else:
            kept = sorted([*kept, [result]], key=lambda g: rank_key(g[0]))[:groups]

    def settle() -> None:
        """The fastest pending result replayed and kept or not, where it can still rank among the groups kept; a
        slower one is dropped unreplayed, as keeping it would cut it. The next fastest are handed to the workers
        meanwhile where they would rank among the groups even with every faster one kept (none put out of them by
        the 70B's sixth)."""
        pending[:] = sorted((result for result in pending if speed_key(result.samples_per_s) > bar(())),
                            key=lambda result: -speed_key(result.samples_per_s))
        for faster, result in enumerate(pending[:built.window]):
            if speed_key(result.samples_per_s) > bar(pending[:faster]):
                built.replay(result.candidate)
        if pending:
            keep_replayed(built.result(pending.pop(0).candidate))

    def take() -> None:
        item = out.popleft()
        if isinstance(item, Shape):  # searched: its candidate goes back
            candidate = built.candidate(item)
            if candidate is not None and eligible(candidate):
                heapq.heappush(heap, (-candidate.max_samples_per_s, item.index, candidate))
            return
        if isinstance(item, Candidate):
            # its peak without the caching allocator's reserve, a lower bound; the bar exact where it bounds the run
            result = built.floor(item, beaten(not flushes(item.schedule)))
            if not worth_replaying(result):
                return  # cut by its speed whatever its peak, or refused at its least peak and at any larger one
            if item.index not in built.results:  # replayed meanwhile (or once its bar needs it), taken again after
                if first:                        # what is out
                    built.replay(item)
                out.append(result)
                return
        elif not first:
            pending.append(item)
            return
        keep_replayed(built.result(item.candidate if isinstance(item, Result) else item))

    def hand_ahead() -> None:
        """Idle workers handed the steps the search will want next (`_Built.ahead`, `ahead_of_staler`); also while
        `take` waits for a result (`_Built._awaited`)."""
        built.ahead(heap, out, bar(pending), worth_replaying if first else lambda result: False)
        if staler_ahead and (kept or pending):
            built.ahead_of_staler(max(speed_key(result.samples_per_s) for result in [*pending, *(g[0] for g in kept)]))

    built.idle = hand_ahead
    while (heap or out) and not (first and kept):
        hand_ahead()
        if not could_win(speed_key(-heap[0][0]) if heap else above):
            if not any(isinstance(item, Shape) for item in out):
                while out:  # what is out can only raise the bar: nothing left on the heap can beat it
                    take()
                break
            take()  # a search out may put back a candidate that can
            continue
        item = heap[0][2]
        searched = (isinstance(item, Shape) and item.partitioned and METHODS[item.config.schedule].needs_costs
                    and built.parallel)
        if (isinstance(item, Shape) and not searched) or (isinstance(item, Candidate) and not item.critical):
            _, index, item = heapq.heappop(heap)
            following = built.advance(item) if isinstance(item, Shape) else built.tighten(item)
            if following is not None and eligible(following):
                heapq.heappush(heap, (-following.max_samples_per_s, index, following))
        elif len(out) >= built.window:
            take()
        else:
            item = heapq.heappop(heap)[2]
            if searched:
                built.submit_search(item)
            else:
                built.submit(item, beaten(not flushes(item.schedule)))
            out.append(item)
    while pending:
        settle()
    built.idle = None
    last = speed_key(kept[-1][0].samples_per_s) if kept else above
    return kept, [item for item in [*(item for _, _, item in heap), *out] if speed_key(_bound(item)) > last]


def _bound(item: Shape | Candidate | Result) -> float:
    """The most samples/s an item of `top_groups` can give: its bound, or a result's speed (its peak may be unknown:
    out for its replay)."""
    return item.samples_per_s if isinstance(item, Result) else item.max_samples_per_s


def _accounts(shapes: list[Shape], built: _Built, problem: Problem) -> tuple[int, int, int, int, int, int]:
    """Where each configuration ended, each counted once, by what is known of it: refused once built, too stale,
    over the cap by its memory floor (a built candidate's, else its shape's), simulated, or pruned by the
    throughput bound unbuilt; and how many of the stale and heavy ones were simulated to show what the limits
    cost. Returns (refused, stale, heavy, pruned, simulated within the limits, simulated over them)."""
    limit, cap = problem.max_staleness, problem.memory_cap_bytes
    refused = stale = heavy = pruned = within = over = 0
    for shape in shapes:
        item = built.candidates.get(shape.index, shape)
        if item is None:
            refused += 1
        elif item.staleness is not None and item.staleness > limit:
            stale += 1
            over += shape.index in built.floors
        elif item.memory_floor_bytes > cap:
            heavy += 1
            over += shape.index in built.floors
        elif shape.index in built.floors:
            within += 1
        else:
            pruned += 1
    return refused, stale, heavy, pruned, within, over


class _Built:
    """The candidates one search has built (None: refused once built, as a searched order short of memory is),
    simulated and replayed (`floor`, `result`), each at most once, by shape index; with `workers` > 1,
    simulated, replayed, and searched orders searched, in that many processes (`pool`, else `start_workers`'),
    up to `window` at once. A context manager: leaving it stops the workers."""

    def __init__(self, problem: Problem, orders: _Orders, report: Callable[[str], None] | None = None,
                 shapes: int = 0, workers: int = 1, pool: Workers | None = None) -> None:
        self.problem = problem
        self._report, self._shapes = report, shapes
        self.window = workers
        self._pool = pool if pool is not None else start_workers(workers)
        self._simulating: dict[int, Future] = {}
        self._searching: dict[int, Future] = {}
        self._replaying: dict[int, list[Future]] = {}  # a share of the devices each (`replay`)
        self._tightening: dict[int, Future] = {}  # critical paths found ahead (`ahead`, `ahead_of_staler`)
        self._costing: dict[int, Future] = {}  # fixed chains' partitions costed ahead (`ahead`)
        self._running: set[Future] = set()  # handed to the workers and not finished
        # what the search hands the workers ahead (`top_groups`' `ahead`), asked again each time a worker finishes
        # while the search waits for another's result (`_awaited`); None: outside a search
        self.idle: Callable[[], None] | None = None
        self._shipped: dict[int, tuple[object, _Shipped]] = {}  # by id of what is shipped, which it keeps alive
        self.orders = orders  # the shapes' own: a fixed order is built once
        self.candidates: dict[int, Candidate | None] = {}
        self.floors: dict[int, Result] = {}  # simulated, the peak without the caching allocator's reserve
        self._beaten: dict[int, float] = {}  # the speed key each floor was found against: one no faster may be a bound
        self.results: dict[int, Result] = {}  # the reserve replayed too: the peak simulate gives
        self._long_runs: dict[int, Trace] = {}  # floors' long runs as the replay reads them (`_floor`), until replayed
        self.partitioned: dict[int, Shape] = {}  # shapes bounded again on their partitions before they are built
        self._cut: dict[int, Shape] = {}  # fixed chains' shapes bounded over their best cut
        self._plans: dict[int, tuple] = {}  # fixed orders' partitions (`_plan`), which their candidates reuse
        self._chains: dict[int, _ChainWork | None] = {}  # by id of the setting
        self._links: dict[tuple[int, int, int], Cluster] = {}  # by setting, p and d
        self._data_links: dict[tuple[int, int, int], CollectiveLink | None] = {}  # by setting, p and d
        self._staler: list[int] = []  # built, within the cap by their floor, over the staleness limit
        self._reduces: dict[tuple[int, int, int], dict[tuple[int, int], float]] = {}  # by setting, p and d: a stage's
        # REDUCE by its bytes and its routed experts' (`_layer_reduces_ms`)
        self._layers: dict[int, tuple[np.ndarray, bool, np.ndarray]] = {}  # by id of the setting (`_layer_bytes`)
        self._expert_groups: dict[tuple[int, int, int], int | None] = {}  # by setting, p and d (`_expert_ranks`)

    def known(self, shape: Shape) -> Shape | Candidate | None:
        """What the search has made of `shape` so far: its candidate (None: refused once built), else the shape
        bounded on its partition (`advance`), else the shape itself."""
        return self.candidates.get(shape.index, self.partitioned.get(shape.index, shape))

    def advance(self, shape: Shape) -> Shape | Candidate | None:
        """What a shape becomes once its bound comes up: its candidate; first, for a searched order, whose search
        is dear, the shape bounded on its partition (`_searched_bound_ms`), and for a fixed flushing chain the
        shape bounded over its best cut (`_best_cut_ms`), either of which may never come up again."""
        searched = METHODS[shape.config.schedule].needs_costs
        if shape.partitioned:
            return self.candidate(shape)
        if not searched and not shape.cut_bounded:
            cut = self._cut_bounded(shape)
            if cut is not None:
                return cut
        if shape.index not in self.partitioned:
            scenario, config = shape.setting.scenario, shape.config
            split = _split_for(shape.setting)
            try:
                plan = _plan(shape.setting, self.problem, config, split, self.orders)
            except ScheduleError:
                self.candidates[shape.index] = None
                return None
            _, short, order, bounds = plan
            if searched:
                costs = scenario.costs(order.schedule, bounds)
                links = self.frame_links(shape.setting, config)
                step_ms = max(_searched_bound_ms(costs, config.microbatches, _hops_ms(links, costs, config.stages),
                                                 _send_holds_ms(order.schedule, order.per_step,
                                                                costs.transfers_hold_products, links,
                                                                [c.output_bytes for c in costs.stages], costs)),
                              _searched_device_bound_ms(costs, config.microbatches, links, _sends_hold(
                                  order.schedule, costs.transfers_hold_products, links)))
            elif order.schedule.graph == StageGraph.chain(order.schedule.num_stages):
                self._plans[shape.index] = plan
                stage_ms = split.stage_ms(bounds, config.pipelines) * scenario.cost_scale
                step_ms = _planned_bound_ms(order, short, stage_ms,
                                            self._layer_reduces_ms(shape.setting, config, bounds),
                                            self._layer_hops_ms(shape.setting, config, bounds),
                                            self._layer_sends_ms(shape.setting, config, order, bounds),
                                            _cut_accumulates_ms(scenario.measured, bounds) * scenario.cost_scale)
            else:  # cut into the model's own DAG, which only its build knows
                return self.candidate(shape)
            self.partitioned[shape.index] = self._bounded(shape, step_ms, partitioned=True)
        return self.partitioned[shape.index]

    def _bounded(self, shape: Shape, step_ms: float, **marked: bool) -> Shape:
        """`shape` with its bound lowered to what a step of at least `step_ms` allows, and `marked` as bounded so
        (`partitioned`, `cut_bounded`): a bound only ever tightens."""
        bound = _bound_samples_per_s(self.problem.batch_size, step_ms)
        return replace(shape, max_samples_per_s=min(shape.max_samples_per_s, bound), **marked)

    def _chain_work(self, setting: Setting) -> _ChainWork | None:
        if id(setting) not in self._chains:
            self._chains[id(setting)] = _ChainWork.of(setting.scenario.measured)
        return self._chains[id(setting)]

    def _layer_reduces_ms(self, setting: Setting, config: Config, bounds: list[int]) -> np.ndarray:
        """[k]: the least REDUCE of stage k's gradients (as accumulated, their routed experts' apart, in proportion
        to their weights) over the replicas (`_least_reduce_ms`); none for one replica."""
        if config.replicas == 1:
            return np.zeros(len(bounds) - 1)
        link, (held, _, experts, grads) = self._data_link(setting, config), self._layer_bytes(setting)
        ranks = self._expert_group(setting, config)
        priced = self._reduces.setdefault((id(setting), config.stages, config.replicas), {})
        starts, stops = bounds[:-1], bounds[1:]
        stages = list(zip(held[starts, stops].tolist(), experts[starts, stops].tolist(), grads[starts, stops].tolist(),
                          [True] + [False] * (len(bounds) - 2)))
        for stage in stages:
            if stage not in priced:  # partitions of a model of like layers cut stages of like bytes
                nbytes, expert_bytes, grad_bytes, first = stage
                priced[stage] = _least_reduce_ms(link, config.replicas, ranks, nbytes, expert_bytes, config.zero,
                                                 grad_bytes, first)
        return np.array([priced[stage] for stage in stages])

    def _expert_group(self, setting: Setting, config: Config) -> int | None:
        """`_expert_ranks` for the setting's p and d, found once."""
        return _per_pipeline(self._expert_groups, setting, config, _expert_ranks)

    def _layer_bytes(self, setting: Setting) -> tuple[np.ndarray, bool, np.ndarray, np.ndarray]:
        """The setting's layers' weights' bytes over every range of them ([i, j]: layers i .. j-1, a tied layer's
        once where its tie is among them: `range_sums`), whether they form a chain (`_chain_of_layers`), and their
        routed experts' bytes and their gradients' (as accumulated) alike, read once: the layer bounds ask for them
        on every partition."""
        if id(setting) not in self._layers:
            layers = setting.scenario.measured.layers
            held, experts, grads = (range_sums((getattr(layer, name) for layer in layers), tied_pairs(layers))
                                    for name in ("param_bytes", "expert_param_bytes", "grad_bytes"))
            self._layers[id(setting)] = held, _chain_of_layers(setting.scenario.measured), experts, grads
        return self._layers[id(setting)]

    def frame_links(self, setting: Setting, config: Config) -> Cluster:
        """The links between a pipeline's devices, which depend on p and d alone (`Scenario.links`): looked up once
        per setting, p and d."""
        return _per_pipeline(self._links, setting, config, lambda scenario, p, d: scenario.links(_frame(p, d)))

    def _data_link(self, setting: Setting, config: Config) -> CollectiveLink | None:
        """The replicas' all-reduce link (`_data_link`; None for one replica), looked up once per setting, p and d:
        the bounds of shapes whose devices' links are never looked up want it too."""
        return _per_pipeline(self._data_links, setting, config, _data_link)

    def _layer_hops_ms(self, setting: Setting, config: Config, bounds: list[int]) -> np.ndarray:
        """`_hops_ms` for these stages, each sending its last layer's output (a chain of layers; 0 where the
        layers branch, whose boundaries carry what their costs say)."""
        p, profile = config.stages, setting.scenario.measured
        if not self._layer_bytes(setting)[1]:
            return np.zeros(p - 1)
        links = self.frame_links(setting, config)
        sent = [profile.layers[bounds[k + 1] - 1].output_bytes for k in range(p - 1)]
        return np.array([links.link(k, k + 1).transfer_ms(sent[k]) + links.link(k + 1, k).transfer_ms(sent[k])
                         for k in range(p - 1)])

    def _layer_sends_ms(self, setting: Setting, config: Config, order: _Order, bounds: list[int]) -> np.ndarray:
        """`_send_holds_ms` for these stages, each sending its last layer's output (a chain of layers; 0 where the
        layers branch, as `_layer_hops_ms`)."""
        scenario = setting.scenario
        if not self._layer_bytes(setting)[1] or any(layer.product_ms for layer in scenario.measured.layers):
            return np.zeros(config.stages)  # products held at most their own time: the rows' times not known here
        return _send_holds_ms(order.schedule, order.per_step, scenario.transfers_hold_products,
                              self.frame_links(setting, config),
                              [scenario.measured.layers[end - 1].output_bytes for end in bounds[1:]])

    def _cut_bounded(self, shape: Shape) -> Shape | None:
        """A fixed flushing chain's shape bounded over the best cut of its layers (cheap next to building it: no
        order at m, no partition, no costs); None for any other fixed order."""
        config, setting = shape.config, shape.setting
        sketch = self.orders.of_shape(setting.scenario, config.schedule, config.stages, config.microbatches,
                                      config.chunks, config.pipelines, config.microbatch_group)  # not refused
        chain = self._chain_work(setting)
        if sketch.chain is None or chain is None:
            return None
        if shape.index not in self._cut:
            scenario, p = setting.scenario, config.stages
            step_ms = _best_cut_ms(chain, config.microbatches * sketch.chain[0], sketch.chain[1], scenario.cost_scale,
                                   chain.hops_ms(self.frame_links(setting, config), p),
                                   _least_reduce_ms(self._data_link(setting, config), config.replicas,
                                                    self._expert_group(setting, config), chain.first_param_bytes,
                                                    chain.first_expert_bytes, config.zero, chain.first_grad_bytes,
                                                    first=True))
            self._cut[shape.index] = self._bounded(shape, step_ms, cut_bounded=True)
        return self._cut[shape.index]

    def candidate(self, shape: Shape) -> Candidate | None:
        if shape.index not in self.candidates:
            searching = self._searching.pop(shape.index, None)
            if searching is not None:
                found = self._awaited(searching)  # a copy of the setting came back with it: this one prices the rest
                self.candidates[shape.index] = found and replace(found, setting=shape.setting)
            else:
                costed = _if_done(self._costing.pop(shape.index, None))
                try:
                    self.candidates[shape.index] = _candidate(
                        shape.setting, self.problem, shape.config, shape.index, _split_for(shape.setting),
                        self.orders, self.frame_links(shape.setting, shape.config),
                        self._plans.pop(shape.index, None), costed)
                except ScheduleError:
                    self.candidates[shape.index] = None
            made = self.candidates[shape.index]
            if (made is not None and made.staleness > self.problem.max_staleness
                    and made.memory_floor_bytes <= self.problem.memory_cap_bytes):
                self._staler.append(shape.index)  # searched only once the choice is known (`ahead_of_staler`)
            # both bound it from above: a searched order's own bound can sit over its shape's on its partition
            # (`_searched_device_bound_ms`), and `top_groups` pops bounds that never rise
            if made is not None and made.max_samples_per_s > shape.max_samples_per_s:
                self.candidates[shape.index] = replace(made, max_samples_per_s=shape.max_samples_per_s)
            self._progress()
        return self.candidates[shape.index]

    @property
    def parallel(self) -> bool:
        return self._pool is not None

    def _submit(self, task: Callable, *args) -> Future:
        """`task(*args)` handed to a worker, any `_Shipped` argument as the object shipped."""
        running = self._pool.submit(_run, task, *args)
        self._running.add(running)
        running.add_done_callback(self._running.discard)
        return running

    def _awaited(self, future: Future):
        """`future`'s result, the workers handed what the search would hand them ahead (`idle`) as it begins to wait
        and each time one finishes meanwhile: the search takes results in the order it handed them out, and waited
        on the oldest while a worker that had finished sat idle (the 70B's stale p = 32 orders: at a load of 10, one
        worker idle 8 s and then 17 s while the other ran PipeDream-2BW's simulation, then XPipe's, which it was
        handed only once the search had taken the first)."""
        while self.idle is not None and not future.done():
            self.idle()
            wait_for_futures([future, *(running for running in tuple(self._running) if not running.done())],
                             return_when=FIRST_COMPLETED)
        return future.result()

    def _ship(self, value: object) -> _Shipped:
        """`value` pickled once for the workers, which unpickle it once each (`_received`): a setting's scenario
        and a pipeline's links are sent with many tasks (pickling a scenario takes about 1 ms)."""
        if id(value) not in self._shipped:
            self._shipped[id(value)] = value, _Shipped(id(value), pickle.dumps(value, pickle.HIGHEST_PROTOCOL))
        return self._shipped[id(value)][1]

    def ahead(self, heap: list[tuple[float, int, Shape | Candidate]], out: deque[Shape | Candidate | Result],
              beaten: float, worth_replaying: Callable[[Result], bool]) -> None:
        """Idle workers take, ahead of the search, the next steps it will want: the caching allocator's replay
        (`result`) of a candidate whose simulation has come back (out, or on `heap`) and is `worth_replaying`
        as things stand, and, for the best items near the top of `heap` whose bound beats `beaten`, a candidate's
        critical path (`tighten`), a tightened candidate's simulation (`floor`), a partitioned searched order's
        search and a fixed chain's costs on its partition (`candidate`). Each is a function of the item alone,
        taken by the search when (and only if) it comes to that step as it would without workers ahead, so what
        is built, simulated and kept does not depend on it: only when the work is done, on a core that would
        otherwise wait. Only the heap's first levels are read (its best items, nearly in order): reading all of
        it at every step would cost more than it saves."""
        if self._pool is None or len(self._running) >= self.window:
            return
        for item in out:
            if isinstance(item, Candidate):
                self._replay_ahead(item, worth_replaying)
        for key, index, item in sorted(heap[:AHEAD_READ]):
            if speed_key(-key) <= beaten:
                return
            if isinstance(item, Candidate) and not item.critical:
                self._path_ahead(item)
            elif isinstance(item, Candidate):
                self.submit(item, beaten)
                self._replay_ahead(item, worth_replaying)
            elif item.partitioned and METHODS[item.config.schedule].needs_costs:
                self.submit_search(item)
            elif index in self._plans and index not in self._costing:
                _, short, order, bounds = self._plans[index]
                self._costing[index] = self._submit(_costed, self._ship(item.setting.scenario), self.problem,
                                                    item.config, order, bounds, short,
                                                    self._ship(self.frame_links(item.setting, item.config)))
            if len(self._running) >= self.window:
                return

    def ahead_of_staler(self, beaten: float) -> None:
        """Idle workers take, ahead of the search's later passes (what beats the choice over a limit, the staler
        note: `_search`), what those will want of the candidates built so far that fit the cap by their memory floor
        and are over the staleness limit, which only they search: each one's critical path (`tighten`), then, where
        its bound still beats `beaten` (the fastest result within the limits so far: the choice is no slower), its
        simulation (`floor`), and where that beats it too, its replay (`result`). Taken, as `ahead`'s, only where the
        search comes to that step; on the 70B, the six simulations and replays it made after the choice, in three
        rounds of two while it waited."""
        for index in self._staler:
            if self._pool is None or len(self._running) >= self.window:
                return
            candidate = self.candidates[index]
            if speed_key(candidate.max_samples_per_s) <= beaten:
                continue
            if not candidate.critical:
                tightening = self._path_ahead(candidate)
                if not (tightening.done() and speed_key(tightening.result()) > beaten):
                    continue
            self.submit(candidate, beaten)
            self._replay_ahead(candidate, lambda result: speed_key(result.samples_per_s) > beaten)

    def _path_ahead(self, candidate: Candidate) -> Future:
        """Its critical path (`tighten`) handed out to a worker, once; that work."""
        if candidate.index not in self._tightening:
            self._tightening[candidate.index] = self._submit(_path_bound, self.problem.batch_size, candidate.schedule,
                                                             candidate.costs, self._ship(candidate.links),
                                                             candidate.config.pipelines)
        return self._tightening[candidate.index]

    def _replay_ahead(self, candidate: Candidate, worth_replaying: Callable[[Result], bool]) -> None:
        """Its replay handed out now if its simulation has come back, unread (`floor` reads it), and is worth
        replaying (`ahead`, `ahead_of_staler`)."""
        running = self._simulating.get(candidate.index)
        if (running is not None and running.done() and running.exception() is None
                and worth_replaying(Result(candidate, *running.result()[0]))):
            self.replay(candidate)

    def submit_search(self, shape: Shape) -> None:
        """Start building a searched order's candidate (its search, the dear part) in a worker."""
        if shape.index not in self.candidates and shape.index not in self._searching:
            self._searching[shape.index] = self._submit(_searched_candidate, self._ship(shape.setting), self.problem,
                                                        shape.config, shape.index)

    def tighten(self, candidate: Candidate) -> Candidate:
        """The candidate bounded by its critical path too (`_with_critical_path`), from now on: the bound a worker
        found ahead (`ahead`) or has under way, awaited while the workers are handed more (a task the pool has
        queued for a worker cannot be taken back, so the wait may include a simulation queued before it), else found
        here. Finding again here a path a worker had under way cost DeepSeek-V3's tune of 256 GPUs 14 of its 91 s
        on 2 cores; awaiting it, 78 s; awaiting only as long as finding it here takes, 85-87 s."""
        ahead = self._tightening.get(candidate.index)  # kept while awaited, so that it is not handed out again
        bound = None if ahead is None or ahead.cancel() else self._awaited(ahead)
        self._tightening.pop(candidate.index, None)
        tightened = _with_critical_path(self.problem, candidate, bound)
        self.candidates[candidate.index] = tightened
        return tightened

    def submit(self, candidate: Candidate, beaten: float = -math.inf) -> None:
        """Start simulating the candidate in a worker, exactly where it beats `beaten` (`_floor`), if there are
        workers and it is not simulated yet."""
        index = candidate.index
        if self._pool is not None and index not in self.floors and index not in self._simulating:
            self._simulating[index] = self._submit(_floor, self.problem, candidate, beaten)
            self._beaten[index] = beaten

    def floor(self, candidate: Candidate, beaten: float = -math.inf) -> Result:
        """The candidate simulated, its peak without the caching allocator's reserve (the replay, the dear part
        of a simulation: `result` adds it), a lower bound of the peak; the peak itself where nothing is
        replayed (`Scenario.allocations` None). Its speed is exact where it beats `beaten` (a speed key), else
        may be a bound from above (`_measured`): no faster than `beaten` either way. A floor found against a
        higher bar that may be such a bound and beats this one is found again, against this one."""
        index = candidate.index
        if index in self.floors and not self._settles(index, self.floors[index].samples_per_s, beaten):
            del self.floors[index]
        if index not in self.floors:
            running = self._simulating.get(index)  # left there while awaited: no worker is handed it again
            found = self._awaited(running) if running is not None else None
            self._simulating.pop(index, None)
            if found is None or not self._settles(index, found[0][0], beaten):
                found = _floor(self.problem, candidate, beaten)
                self._beaten[index] = beaten
            measured, long_run = found
            self.floors[index] = Result(candidate, *measured)
            if long_run is not None:
                self._long_runs[index] = long_run
            elif speed_key(measured[0]) > self._beaten[index]:  # exact: the result itself
                self.results[index] = self.floors[index]
            self._progress()
        return self.floors[index]

    def _settles(self, index: int, samples_per_s: float, beaten: float) -> bool:
        """Whether a floor this fast, found against the bar `_beaten[index]`, serves a search that needs it exact
        where it beats `beaten`: it beats the bar it was found against (so is exact), or it does not beat
        `beaten` (nor does the exact speed, no faster)."""
        key = speed_key(samples_per_s)
        return key > self._beaten[index] or key <= beaten

    def replay(self, candidate: Candidate) -> None:
        """Start replaying the candidate's caching allocator (`result`) in the workers, a share of its devices each
        (each device's replay is its own: a p = 32 candidate's 32 took 1.1-1.3 CPU s on the 70B, which one worker
        took alone while the search waited), if there are workers, it is simulated (its simulation read, `floor`,
        or back unread, `_replay_ahead`), has allocations to replay, and is not replayed yet."""
        index = candidate.index
        if self._pool is None or index in self.results or index in self._replaying:
            return
        simulated = self._simulating.get(index)
        long_run = self._long_runs[index] if simulated is None else simulated.result()[1]
        if long_run is not None:
            self._replaying[index] = [self._submit(_device_reserves, candidate, long_run, share)
                                      for share in device_shares(candidate.schedule.num_devices, self.window)]

    def result(self, candidate: Candidate) -> Result:
        """The candidate simulated with the caching allocator's reserve: the peak simulate and sweep give."""
        index, floor = candidate.index, self.floor(candidate)  # the result itself where nothing is replayed
        if index not in self.results:
            replaying, long_run = self._replaying.pop(index, None), self._long_runs.pop(index)
            reserves = None if replaying is None else dealt_back([self._awaited(found) for found in replaying])
            self.results[index] = replace(floor, peak_memory_bytes=_reserved_peak_bytes(candidate, long_run, reserves))
        return self.results[index]

    def __enter__(self) -> _Built:
        return self

    def __exit__(self, *exc) -> None:
        """The workers ended at once, an answer found or not: what they still run is work ahead (`ahead`,
        `ahead_of_staler`) the search never came to, whose results nothing reads. Shut down the gentle way, the
        DeepSeek-V3 tune's (docs/sweep-and-tune.md) waited 150 s after its 65 s search for simulations so begun."""
        if self._pool is not None:
            self._pool.stop(at_once=True)

    def _progress(self) -> None:
        if self._report is not None:
            self._report(f"searching {count_text(self._shapes, 'configuration')}, best bound first: "
                         f"{len(self.candidates):,} built, {len(self.floors):,} simulated")


def _per_pipeline(found: dict[tuple[int, int, int], Found], setting: Setting, config: Config,
                  find: Callable[[Scenario, int, int], Found]) -> Found:
    """`find(scenario, p, d)` of the setting's scenario and the configuration's p and d, kept in `found` (by
    setting, p and d: what depends on the pipeline's devices and replicas alone), so found once."""
    key = (id(setting), config.stages, config.replicas)
    if key not in found:
        found[key] = find(setting.scenario, config.stages, config.replicas)
    return found[key]


def _if_done(ahead: Future | None):
    """The result of work a worker took ahead (`_Built.ahead`) if it is done, else None, the work cancelled if it
    has not begun: the search does the little work it hands out ahead itself rather than wait for it (behind a
    replay of a second or more, at worst)."""
    if ahead is not None and ahead.done():
        return ahead.result()
    if ahead is not None:
        ahead.cancel()
    return None


@dataclass(frozen=True)
class _Shipped:
    """An object pickled once for the workers (`_Built._ship`), by its id in the search's process."""

    key: int
    blob: bytes


_RECEIVED: dict[int, object] = {}  # in a worker: what the search shipped, by key
_OWN_KEYS = itertools.count(-1, -1)  # `shipped`'s, apart from a search's ids, which a value freed since could share


def shipped(value: object) -> _Shipped:
    """`value` pickled once for tasks handed to the workers before a search (`submit`: tune's estimates): each
    task carries the bytes, each worker unpickles them once."""
    return _Shipped(next(_OWN_KEYS), pickle.dumps(value, pickle.HIGHEST_PROTOCOL))


def submit(pool: Workers, task: Callable, *args) -> Future:
    """`task(*args)` in one of `pool`'s workers, each `shipped` argument as the value shipped."""
    return pool.submit(_run, task, *args)


def _run(task: Callable, *args):
    """In a worker: `task(*args)`, each `_Shipped` argument unpickled the first time it comes and kept."""
    for arg in args:
        if isinstance(arg, _Shipped) and arg.key not in _RECEIVED:
            _RECEIVED[arg.key] = pickle.loads(arg.blob)
    return task(*(_RECEIVED[a.key] if isinstance(a, _Shipped) else a for a in args))


_SPLITTERS: dict[int, Callable[..., list[int]]] = {}  # `_split_for`, by the setting's identity, kept while it lives


def _split_for(setting: Setting) -> Callable[..., list[int]]:
    """The setting's partitioner (`_splitter`), made once a process while the setting lives: the search's
    candidates share its partitions, and so do a worker's searched ones (made for each search, it priced every
    layer twice and summed every range's host waits again)."""
    if id(setting) not in _SPLITTERS:
        _SPLITTERS[id(setting)] = _splitter(setting.scenario.measured, setting.scenario.optimizer)
        weakref.finalize(setting, _SPLITTERS.pop, id(setting), None)
    return _SPLITTERS[id(setting)]


def _searched_candidate(setting: Setting, problem: Problem, config: Config, index: int) -> Candidate | None:
    """`_candidate` in a worker, with orders of its own and the setting's partitioner (`_split_for`; None:
    refused)."""
    try:
        return _candidate(setting, problem, config, index, _split_for(setting), _Orders(),
                          setting.scenario.links(_frame(config.stages, config.replicas)))
    except ScheduleError:
        return None


def _frame(stages: int, replicas: int) -> Schedule:
    """A pipeline of p devices and d replicas, with no order: what its links and all-reduce link are looked up
    for."""
    return schedule_frame(ScheduleParams(stages, 1, data_parallel=replicas))


def prepare(settings: list[Setting], problem: Problem) -> tuple[list[Candidate], int, int]:
    """Every configuration the problem allows on each setting's profile, built, partitioned and bounded; and how
    many shapes there were and how many of those the methods refused: what an exhaustive search simulates."""
    orders = _Orders()
    shapes, count, refused = _shapes(settings, problem, orders)
    built = _Built(problem, orders)
    found = [built.candidate(shape) for shape in shapes]
    return [c for c in found if c is not None], count, refused + sum(c is None for c in found)


@dataclass(frozen=True)
class Shape:
    """A configuration before it is partitioned and costed: its staleness where its order tells it without
    costs (None: known once built), `max_samples_per_s`, a bound no partition beats (`_shape_bound`), and a
    memory floor no partition goes below, so that the search builds a candidate only when it could still win
    and fit."""

    config: Config
    setting: Setting
    index: int  # enumeration order over all shapes: the candidate's, the last tie-break
    staleness: int | None
    max_samples_per_s: float
    memory_floor_bytes: int  # what no partition's floor goes below: the fullest device holds at least the mean
    partitioned: bool = False  # a searched order's shape bounded again on its partition, before its search
    cut_bounded: bool = False  # a fixed flushing chain's shape bounded again over its best cut (`_best_cut_ms`)


@dataclass(frozen=True)
class _Work:
    """What bounds a setting's configurations for any partition, summed over its layers for one micro-batch:
    the forward, the backward and the least backward (B, or its halves I + W) ms; and the bytes every device
    together holds throughout, per pipeline (weights, gradients, optimizer state) and per extra weight copy."""

    fwd_ms: float
    bwd_ms: float
    least_bwd_ms: float
    static_bytes: int
    param_bytes: int
    expert_param_bytes: int  # the routed experts' share of `param_bytes`
    grad_bytes: int  # the gradients as accumulated: what the replicas reduce
    slowest_ms: np.ndarray  # [k]: the least a busiest of k stages runs per micro-batch (F + least backward)
    step_ms: tuple[float, float, float]  # an update, a weight prediction and an averaging of every stage, summed
    accumulate_ms: float  # one accumulation of every stage, summed: the least over every cut (`_least_accumulate_ms`)


def _work(profile: Profile, optimizer: str) -> _Work:
    """Per-layer sums that no cut into stages exceeds (see `_shape_bound`). A stage's F and B are its layers'
    sums (times the calibrated stage's measured pass over its layers' sum, where passes were measured), so
    their totals over the stages are the layers' whatever the cut. Its I and W are its layers' sums too, except
    on a stage that sends no input gradient (the first), whose I is 0 and W its whole B: either way a stage's
    min(B, I + W) is at least its layers' sum of min(B, I + W). Where passes were measured, the calibrated cut's
    I and W are measured, which no layer sum bounds: they count for nothing; the same goes for `slowest_ms`, the
    best split of the layers' F + min(B, I + W) into k stages (`least_slowest`), which no stage's passes undercut.
    Bytes are additive over a cut, and so are a stage's update, prediction and averaging, shared out by its
    weights' bytes (`stages_for`), and its gradient accumulation (`_least_accumulate_ms`). A layer's times are its
    least (`_own_times`): a stage's host waits beyond its layers' times are at least minus the waits carried in
    those of its layers that never synchronise, so their times without them sum to no more than any cut's stages."""
    own = owners(profile.layers, 0, len(profile.layers))  # a tied layer's weights once: no cut holds less
    held = (sum(layer_static_bytes(layer, optimizer) for layer in own), sum(layer.param_bytes for layer in own),
            sum(layer.expert_param_bytes for layer in own), sum(layer.grad_bytes for layer in own))
    steps = tuple(math.fsum(pick(stage).median_ms for stage in profile.stages) for pick in (
        lambda s: s.steps[optimizer].step, lambda s: s.steps[optimizer].predict, lambda s: s.average))
    layers = _own_times(profile, least=True).layers
    if _passes_measured(profile):
        table = profile_costs(profile, optimizer, range(len(layers) + 1)).op_ms_table(1)
        return _Work(math.fsum(table[:, KIND_CODE[Kind.F]]), math.fsum(table[:, KIND_CODE[Kind.B]]), 0.0, *held,
                     np.zeros(len(layers) + 1), steps, _least_accumulate_ms(profile))
    tail = profile.contention_tail
    least_bwd = [min(layer.bwd.median_ms, layer.igrad.median_ms + layer.wgrad.median_ms) for layer in layers]
    return _Work(tail * math.fsum(layer.fwd.median_ms for layer in layers),
                 tail * math.fsum(layer.bwd.median_ms for layer in layers), tail * math.fsum(least_bwd), *held,
                 tail * _least_slowest(tuple(layer.fwd.median_ms + b for layer, b in zip(layers, least_bwd))), steps,
                 _least_accumulate_ms(profile))


def _passes_measured(profile: Profile) -> bool:
    """Whether the calibration measured each stage's passes over its layers (`StageProfile.passes`): no sum of the
    layers' times bounds those (`_work`)."""
    return all(stage.passes is not None for stage in profile.stages)


def _least_accumulate_ms(profile: Profile) -> float:
    """The least sum of every stage's accumulation over any cut of the layers (`_cut_accumulates_ms`, before
    `cost_scale`): the calibrated cut's own stages', or off it their total shared out by weight bytes, whichever
    is less."""
    return min(math.fsum(_cut_accumulates_ms(profile, bounds)) for bounds in (
        profile.partition.bounds, [0, len(profile.layers)]))


_least_slowest = cache(least_slowest)  # settings of one model at other depths share their layers' costs


@dataclass(frozen=True)
class _Sketch:
    """What a method's order tells the search before any cost, per micro-batch (`_Orders.sketch`, read off a
    probe of the same shape): every method runs each micro-batch's forward and backward once on every stage, so
    its counts scale with m; whether it is a flushing chain, splits backwards or keeps extra weight copies does
    not depend on m, nor does a flushing order's staleness (nothing is in flight across its steps). Its updates,
    predictions and averagings per step do not fall as m grows, so the probe's (at m or fewer) are a floor.

    Its gradient accumulations per step (`_accumulated_ms`: each B or W but its span's first adds into the buffer)
    are a stage's B and W rows less the spans they open, each after an update of the stage's, so at least its B
    and W less its updates per step. Updates can grow with m (an order that never flushes may update per
    micro-batch), so the count is the probe's m's only."""

    forwards: float  # the fewest forwards a model stage runs, per micro-batch
    backwards: float  # the fewest B + min(I, W)
    whole: float  # the fewest full backwards (B)
    chain: tuple[float, bool] | None  # `_flush_chain`, its count per micro-batch
    staleness: int | None  # None: known at the candidate's m only
    extra_copies: int
    steps: tuple[float, float, float]  # the fewest OPT, PRED, AVG a stage runs per step
    flushing: bool
    stages: int  # model stages
    microbatches: int  # the probe's m, at which alone `accumulations` holds
    accumulations: float  # the fewest gradient accumulations a stage runs per step at the probe's m

    @classmethod
    def of(cls, order: _Order) -> _Sketch:
        if order.schedule.graph.copies > 1:  # the search cuts one chain of p·v stages, not a copy of each
            raise _CopiesRefused(f"{order.schedule.method}: the search cuts the model into one chain of stages, and "
                                 f"this method runs {order.schedule.graph.copies} copies of it; not searched yet")
        m = order.schedule.microbatches
        f, b, i, w = (order.per_step[:, KIND_CODE[kind]] for kind in (Kind.F, Kind.B, Kind.I, Kind.W))
        chain = (order.chain[0] / m, order.chain[1]) if order.chain is not None else None
        steps = tuple(float(order.per_step[:, KIND_CODE[kind]].min()) for kind in (Kind.OPT, Kind.PRED, Kind.AVG))
        flushing = flushes(order.schedule)
        accumulations = max(float((b + w - order.per_step[:, KIND_CODE[Kind.OPT]]).min()), 0.0)
        return cls(float(f.min()) / m, float((b + np.minimum(i, w)).min()) / m, float(b.min()) / m, chain,
                   order.staleness if flushing else None, order.schedule.policy.extra_copies, steps, flushing,
                   order.schedule.num_stages, m, accumulations)


class _CopiesRefused(ScheduleError):
    """A method whose order runs several copies of the model (DualPipe's two): refused for every shape, as its
    graph's copies are the method's, whatever the shape."""


@dataclass(frozen=True)
class _ChainWork:
    """What bounds a flushing chain over every cut of a profile's layers (`_best_cut_ms`): per layer, the forward
    and the input-gradient pass (B, or the least of B and I where the chain splits backwards) as prefix sums, the
    first layer's weights and its routed experts' share of them (stage 0 holds them) and, for a chain of layers, the
    fewest bytes a stage can send."""

    forward: list[float]  # prefix sums over the layers, ms, with the profile's contention tail
    whole: list[float]  # F + B
    least: list[float]  # F + min(B, I)
    first_param_bytes: int
    first_expert_bytes: int  # the routed experts' share of `first_param_bytes`
    first_grad_bytes: int  # its gradients as accumulated (`_Work.grad_bytes`)
    sent_bytes: tuple[int, ...]  # what a stage may send: a layer's output (none where the layers branch)

    @classmethod
    def of(cls, profile: Profile) -> _ChainWork | None:
        """None where passes were measured per stage: no sum of layers bounds them (`_work`). A layer's times are its
        least (`_own_times`), as `_work`'s: its own carry the host waits from the model's start, which a stage that
        never synchronises undercuts (under --p2p-sync, a host-bound first stage's forward: 0.0096 ms below its
        layers' own on a 4-layer GPT at 400 us a kernel)."""
        if _passes_measured(profile):
            return None
        tail = profile.contention_tail
        layers = _own_times(profile, least=True).layers

        def prefix(values) -> list[float]:
            return np.concatenate([[0.0], np.cumsum([tail * v for v in values])]).tolist()

        return cls(prefix(layer.fwd.median_ms for layer in layers),
                   prefix(layer.fwd.median_ms + layer.bwd.median_ms for layer in layers),
                   prefix(layer.fwd.median_ms + min(layer.bwd.median_ms, layer.igrad.median_ms) for layer in layers),
                   layers[0].param_bytes, layers[0].expert_param_bytes, layers[0].grad_bytes,
                   tuple(sorted({layer.output_bytes for layer in layers[:-1]})) if _chain_of_layers(profile) else ())

    def hops_ms(self, links: Cluster, devices: int) -> list[float]:
        """[d]: the least time a micro-batch's activation and gradient spend crossing the links between devices
        0..d of a chain (`_hops_ms` at the cheapest size a stage may send; 0 where the layers branch)."""
        return np.concatenate([[0.0], np.cumsum([min((links.link(k, k + 1).transfer_ms(sent) + links.link(
            k + 1, k).transfer_ms(sent) for sent in self.sent_bytes), default=0.0) for k in range(devices - 1)])
                               ]).tolist()


def _best_cut_ms(work: _ChainWork, passes: float, splits: bool, cost_scale: float, hops_ms: list[float],
                 tail_ms: float) -> float:
    """A lower bound of a flushing chain's step over every cut of the layers into p stages (p = len(hops_ms)),
    without building its order: `_flush_bound_ms`'s inequalities with what the shape knows. Device d's step is
    at least S_d + H_d + c·X_d + tail, where X_k is stage k's forward and input-gradient pass (its layers' sums;
    stage 0's input pass empty where the chain splits backwards), S_d = X_0 + ... + X_{d-1}, H_d the links'
    least hops to d, c (`passes`) the fewest forwards and input passes a device runs up to its last, and tail
    the least REDUCE of stage 0, which holds the first layer. The least T that some cut keeps every device
    under is found by bisection: for a given T, taking as many layers into each stage in turn as its inequality
    allows (leaving one for each stage after) finds a cut if any exists, since moving a stage's first layer
    into the stage before it lowers the later stage's term by (c - 1)·x >= 0 and leaves the others' alone. The
    largest T found to leave no cut is returned: no cut, so no candidate of the shape, steps faster."""
    stages = len(hops_ms)
    first = work.forward if splits else work.whole  # stage 0's X per layer
    rest = work.least if splits else work.whole
    layers = len(rest) - 1
    if stages > layers or passes < 1:  # the argument needs c >= 1 (every order here runs each micro-batch once)
        return 0.0

    def fits(step_ms: float) -> bool:
        start, before_ms = 0, 0.0  # the stage's first layer, and S_d
        for d in range(stages):
            weights = first if d == 0 else rest
            room_ms = (step_ms - before_ms - hops_ms[d] - tail_ms) / (passes * cost_scale)
            end = min(bisect.bisect_right(weights, weights[start] + room_ms) - 1, layers - (stages - 1 - d))
            if end <= start:
                return False
            before_ms += cost_scale * (weights[end] - weights[start])
            start = end
        return start == layers

    low, high = 0.0, cost_scale * (passes + 1) * rest[-1] + hops_ms[-1] + tail_ms + 1.0
    while high - low > 1e-7 * high:
        middle = (low + high) / 2
        low, high = (low, middle) if fits(middle) else (middle, high)
    return low


def _searched_sketch(stages: int, microbatches: int) -> _Sketch:
    """A searched order's (auto's): it flushes every mini-batch on a chain (`check_shape`: one stage per device,
    one pipeline), running each micro-batch's F and backward once per stage and one update per stage and step,
    so m - 1 accumulations; whether it splits a backward is searched: say it may."""
    return _Sketch(1.0, 1.0, 0.0, (1.0, True), None, 0, (1.0, 0.0, 0.0), True, stages, microbatches,
                   microbatches - 1.0)


def _shape_bound(problem: Problem, config: Config, work: _Work, sketch: _Sketch, cost_scale: float,
                 reduce_ms: float = 0.0, chain: bool = True) -> float:
    """An upper bound of `config`'s samples/s under any partition. The busiest device computes at least the
    mean of the p devices, and together they compute at least every stage's forwards (the fewest any stage runs
    per step, times the layers' forward sum: F is additive over a cut) and backwards (each micro-batch's B, or
    I and W, costs at least min(B, I + W) >= the layers' least backward; B alone, its layers' B) and updates,
    predictions and averagings (`sketch` gives the counts) and gradient accumulations (at the probe's m: each stage
    at least the sketch's count, so together at least that count times every stage's accumulation, which sums to
    at least `work.accumulate_ms` whatever the cut), the rest counted as 0; and the busiest device computes at
    least its busiest stage, which runs at least the fewest passes on the best split of the layers into stages.

    A flushing chain's step is also at least, for every device d, X_0 + ... + X_{d-1} + c·X_d, where X_k is
    stage k's forward plus its input-gradient pass and c the fewest of each any device runs before its last
    input-gradient pass (`_flush_bound_ms`, `_flush_chain`). Weighting device d's inequality by w_d, with
    w_d = a(c-1)^(p-1-d)/c^(p-d), gives every X_k the same coefficient a, and the weights sum to 1 for
    a = 1/(1 - (1 - 1/c)^p): the step is at least a·(X_0 + ... + X_{p-1}), whatever the cut; the X_k sum to at
    least the layers' forwards, plus their backwards where no stage runs I (B is additive; a first stage's I
    is empty). About m/p + 1/2 micro-batches' passes for m >> p: half the fill and drain, where the mean
    compute alone gives none.

    A flushing chain's device waits out its stage's REDUCE between its last backward and its update
    (`_StepRows.exposed_ms`), so the step is at least the mean compute plus the mean REDUCE, `reduce_ms`.

    The candidate's bound (`Candidate.max_samples_per_s`, from its own stages) can only be lower: a test holds
    them to it. Shaded against rounding (the sums run in another order)."""
    m = config.microbatches
    forwards, backwards, whole = m * sketch.forwards, m * sketch.backwards, m * sketch.whole
    accumulations = sketch.accumulations if m == sketch.microbatches else 0.0
    total_ms = cost_scale * (forwards * work.fwd_ms + max(backwards * work.least_bwd_ms, whole * work.bwd_ms)
                             + float(np.dot(sketch.steps, work.step_ms)) + accumulations * work.accumulate_ms)
    mean_ms = total_ms / config.stages
    stages = config.stages * config.chunks
    step_ms = max(mean_ms, cost_scale * m * min(sketch.forwards, sketch.backwards) * float(work.slowest_ms[stages])
                  if stages < len(work.slowest_ms) else 0.0)
    if chain and sketch.chain is not None:
        c, runs_input_halves = m * sketch.chain[0], sketch.chain[1]
        passes_ms = cost_scale * (work.fwd_ms + (0.0 if runs_input_halves else work.bwd_ms))
        step_ms = max(step_ms, mean_ms + reduce_ms, passes_ms / (1 - (1 - 1 / c) ** config.stages))
    # twice a candidate's shading: its bound, the same sums in another order, stays below
    return _bound_samples_per_s(problem.batch_size, step_ms, shade=2e-9)


def _shapes(settings: list[Setting], problem: Problem, orders: _Orders) -> tuple[list[Shape], int, int]:
    """Every shape (schedule, p, v, P with a whole m) on each setting, with what its order's sketch
    (`orders.sketch`) tells before costs; how many shapes there were, and how many the methods refused from the
    sketch. The floor: the devices together hold every pipeline's weights, gradients and optimizer state and the
    policy's extra weight copies throughout, and the fullest at least the mean of that (a pipeline runtime's
    buffers, `Scenario.pp_runtime`, only add to what they hold); not under ZeRO-2 the gradients (held only from
    a backward to the update) nor under ZeRO-3 the weights (each device holding a shard), as sim/engine.py
    `static_parts` holds them: counted whole, a 4-layer GPT's floor at ZeRO-2 over 8 replicas was 102.3 MB
    against its simulated 89.3 MB peak, and a cap between them left out the fastest layout unsimulated."""
    shapes: list[Shape] = []
    count = refused = 0
    for setting in settings:
        scenario, t, b = setting.scenario, setting.tensor, setting.microbatch_size
        profile = scenario.measured
        layers = most_stages(profile.layers)
        work = _work(profile, scenario.optimizer)
        depths = [p for p in _placed_depths(setting, problem.devices)
                  if setting.depths is None or p in setting.depths]
        zero = {p: problem.zero if problem.gpus // (p * t) > 1 else 0 for p in depths}  # d·C
        held = {p: work.static_bytes - work.grad_bytes * (zero[p] >= 2) - work.param_bytes * (zero[p] >= 3)
                for p in depths}  # what of them every device holds throughout (the floor's)
        reduce_ms = {p: _mean_reduce_ms(_data_link(scenario, p, d), p, d, work.param_bytes,
                                        _expert_ranks(scenario, p, d), work.expert_param_bytes, zero[p],
                                        work.grad_bytes)
                     for p in depths for d in [problem.devices // (p * t)]}
        for name in problem.schedules:
            grouped = METHODS[name].reads("microbatch_group")  # Megatron-core's group where its default p is refused
            for p in depths:
                replicas = problem.devices // (p * t)
                # Chunks on a lone device would only split its all-reduce: v > 1 needs a pipeline.
                for v in range(1, min(problem.max_chunks if p > 1 else 1, layers // p) + 1):
                    for pipelines in range(1, problem.max_pipelines + 1):
                        m, rest = divmod(problem.batch_size, replicas * pipelines * b)
                        if m < 1 or rest:
                            continue
                        count += 1
                        group = least_microbatch_group(p, m) if v > 1 and grouped else None
                        sketch = orders.of_shape(scenario, name, p, m, v, pipelines, group)
                        if isinstance(sketch, ScheduleError):
                            refused += 1
                            continue
                        config = Config(name, p, v, pipelines, m, replicas, t, b, setting.recompute, setting.expert,
                                        zero[p], setting.sequence_parallel, setting.rank_order,
                                        setting.orders_alike, group)
                        floor = (pipelines * held[p] + sketch.extra_copies * work.param_bytes) // p
                        bound = _shape_bound(problem, config, work, sketch, scenario.cost_scale, reduce_ms[p])
                        shapes.append(Shape(config, setting, count - 1, sketch.staleness, bound, floor))
    return shapes, count, refused


def _mean_reduce_ms(link: CollectiveLink | None, stages: int, replicas: int, param_bytes: int,
                    expert_ranks: int | None, expert_bytes: int, zero: int, grad_bytes: int) -> float:
    """What p stages' REDUCEs (`_least_reduce_ms`) over r replicas take at least on average, however the model's
    gradients are cut among them, `param_bytes` of weights, `expert_bytes` of them routed experts': NCCL's
    all-reduce time, the faster of a ring and a tree, each affine in the bytes (the tree at its full rate, at most
    what its size correction leaves), is concave in them, and so is a ring reduce-scatter's (ZeRO's), each of
    `grad_bytes`, the gradients as accumulated, so the mean over any cut is at least the chord from no bytes to
    all of them, 1/p of the way; the routed experts' part, none where a stage holds no
    experts, at least the chord from nothing to all of theirs (their gradients in proportion to their weights, as
    one precision holds them). Under ZeRO-1 stage 0's may be nothing (`_least_reduce_ms`) and each other stage's
    is at least an empty one's, a collective taking no less for more bytes: the mean is at least (p - 1)/p of
    that. `link`: the replicas' (`_data_link`; None for one replica, which reduces nothing)."""
    if replicas == 1:
        return 0.0
    empty = _least_reduce_ms(link, replicas, None, 0, 0, zero, 0)
    if zero == 1:
        return empty * (stages - 1) / stages
    whole = _least_reduce_ms(link, replicas, expert_ranks, param_bytes, expert_bytes, zero, grad_bytes)
    return empty + (whole - empty) / stages


def _least_reduce_ms(link: CollectiveLink | None, replicas: int, expert_ranks: int | None, nbytes: int,
                     expert_bytes: int, zero: int, grad_bytes: int, first: bool = False) -> float:
    """The least REDUCE of a stage's gradients, `nbytes` of weights, `expert_bytes` of them routed experts', as
    `collective_costs` prices it: NCCL's all-reduce, its tree at its full rate (`CollectiveLink.all_reduce_ms`),
    or under ZeRO (`zero` >= 1) the reduce-scatter, of the gradients as accumulated (`grad_bytes`, the experts'
    share as theirs of the weights); of the rest over the r replicas and of the experts' over the `expert_ranks`
    that hold the same ones (None: E = 1, all of them over r): priced over r, the experts' share at
    E > 1 would go over E times the ranks it reduces over, and the bound pass the REDUCE it bounds (the 4-expert
    GPT's E = 2 stages: 0.074 ms against 0.063). Either collective takes no less over the d·C ranks the run
    reduces over than over r <= d·C. Under ZeRO-1 the `first` stage's (stage 0's) REDUCE is only what of its
    bucketed reduce-scatters runs past its last backward (`Scenario._distributed_optimizer_collectives`), which
    no bound from its bytes alone keeps above nothing: 0 (an all-reduce's bound there was 0.0914 ms against a
    0.0499 ms cost on a 4-layer GPT over 8 H100s). `link`: None for one replica, which reduces nothing."""
    if replicas == 1 or (zero == 1 and first):
        return 0.0
    collective = link.reduce_scatter_ms if zero else partial(link.all_reduce_ms, tree_correction=False)
    return over_expert_groups(collective, float(grad_bytes),
                              expert_bytes / nbytes if expert_ranks is not None and nbytes else 0.0, replicas,
                              expert_ranks or replicas)


def _expert_ranks(scenario: Scenario, stages: int, replicas: int) -> int | None:
    """The ranks a p-deep pipeline's routed experts' gradients reduce over (`Scenario.expert_replicas`, at the
    scenario's E and C: `Scenario.order_params`); None at E = 1, where they reduce with the rest."""
    frame = schedule_frame(scenario.order_params(ScheduleParams(stages, 1, data_parallel=replicas)))
    return scenario.expert_replicas(frame) if frame.expert_parallel > 1 else None


def _data_link(scenario: Scenario, stages: int, replicas: int) -> CollectiveLink | None:
    """The link a p-deep pipeline's r replicas all-reduce over (`Scenario.data_parallel_link`); None for one."""
    return None if replicas == 1 else scenario.data_parallel_link(_frame(stages, replicas))


def evaluate(problem: Problem, candidate: Candidate) -> Result:
    """Simulate the candidate's long and short runs: the steady-state step, memory and bubble."""
    return Result(candidate, *_measured(problem, candidate)[0])


def _measured(problem: Problem, candidate: Candidate, reserve: bool = True, beaten: float = -math.inf
              ) -> tuple[tuple[float, float, float, int], Trace]:
    """`evaluate`'s figures without the candidate: samples/s, the step in ms, the bubble fraction and the peak
    memory in bytes, with the caching allocator's reserve if `reserve` (as simulate's and sweep's peaks), else
    without it (the tensors alone: no more than that peak); and the long run's trace. Where the candidate is
    found no faster than `beaten` (a speed key) before its step is known (`_periodic_step_ms`'s lower bound, a
    millionth over the step of that speed: its key and its exact step's stay at or below `beaten`), the samples/s
    is a bound from above, the step and the bubble (1 - busy / step) bounds from below; the peak is exact either
    way."""
    config, scenario, links = candidate.config, candidate.setting.scenario, candidate.links
    short = candidate.short_schedule or build(scenario, problem, config.schedule, replace(
        candidate.params, minibatches=candidate.short_minibatches), candidate.bounds)
    long_trace = simulate(candidate.schedule, candidate.costs, links, part_curves=False)  # tune draws no page
    if reserve:
        _add_reserve(candidate, long_trace)
    long_run = summarize(long_trace)
    short_run = summarize(simulate(short, candidate.costs, links, memory=False))  # its makespan alone
    growth_ms = (long_run.makespan_ms - short_run.makespan_ms) / (
        candidate.schedule.minibatches - candidate.short_minibatches)
    if not flushes(candidate.schedule):
        growth_ms = _periodic_step_ms(lambda n: build(scenario, problem, config.schedule, replace(
            candidate.params, minibatches=n), candidate.bounds), candidate.short_minibatches, candidate.schedule,
            long_trace, candidate.costs, links, growth_ms,
            problem.batch_size / beaten * 1e3 * (1 + 1e-6) if beaten > 0 else math.inf)
    step_ms = max(growth_ms, candidate.busiest_ms)
    # the bubble of the compute rows as simulated (accumulations, and transfers' holds on the compute, included), a
    # step's compute over the steady step, as simulate's (`steady_bubble`)
    return (problem.batch_size / step_ms * 1e3, step_ms,
            steady_bubble(steady_compute_ms(long_trace), len(long_run.devices), step_ms),
            _peak_bytes(long_run)), long_trace


def _floor(problem: Problem, candidate: Candidate, beaten: float = -math.inf
           ) -> tuple[tuple[float, float, float, int], Trace | None]:
    """`_measured`'s figures without the caching allocator's reserve (what a worker sends back), found exactly
    where they beat `beaten`, and what the replay that adds it reads of the long run (`_replayed_part`; None where
    nothing is replayed), so that the replay need not simulate the run again (0.04-0.12 CPU s a candidate on the
    70B: 1 of its 12.6 CPU s in one process)."""
    figures, long_trace = _measured(problem, candidate, False, beaten)
    return figures, None if candidate.setting.scenario.allocations is None else _replayed_part(long_trace)


def _replayed_part(trace: Trace) -> Trace:
    """The trace as far as the caching allocator's replay reads it (`Scenario.add_reserve`, and the peak it makes):
    its rows and metadata, and of its counters each device's memory and reserve curves; the parts' curves, the
    larger half of its bytes, left out (a worker sends it back)."""
    return replace(trace, counters={name: curves for name, curves in trace.counters.items()
                                    if name in ("memory_bytes", "memory_bytes.reserve")})


def _periodic_step_ms(schedule_of: Callable[[int], Schedule], short: int, schedule: Schedule, trace: Trace,
                      costs: Costs, links: Cluster, growth_ms: float, losing_ms: float = math.inf) -> float:
    """The steady step of an order that never flushes (`schedule_of`: built for N mini-batches), from its long run
    (`schedule`, simulated: `trace`) past its `short` warm-up's mini-batches: `growth_ms` (the makespan's growth
    from the short run) where that is it, else the step of the periodic regime the run reaches, run longer
    (STEADY_STEPS doubled, up to LONGEST_STEADY_STEPS, or UNPROVEN_STEADY_STEPS where the engine's rules are not
    max-plus: `_max_plus`) until one shows, else the least, over the periods tried, of the largest mean step of any
    row over the window, each of which no steady step of a max-plus run exceeds (other runs: below); but where a run
    shows no period and a lower bound of the steady step at or over `losing_ms` (a step the caller needs only to
    know is reached: what loses to the choice, `_measured`), that bound, and no longer run. The growth alone can
    read a transient: a REDUCE chain's backlog on its lane can build up for tens of steps (PipeDream, 2 stages, m =
    1: 6.96 ms where every step from the eighth on takes 7), and a sound bound then sits above the step tune
    measures.

    Why the regime seen is the steady state. Index a row by its place g in the order's pattern and its mini-batch k
    (`_row_ends_ps`: E[g, k], its end; every mini-batch runs the same rows). With h = ceil(stages / m) mini-batches
    in flight, rows of mini-batch k < N - h of an N-mini-batch run end as in any longer run (only the drain's rows
    come after the last forward), and a row's end depends only on rows of its device's order and of its data no more
    than W = 2h + 2 (`short`, the warm-up's) mini-batches back. The engine is deterministic and its rules the same
    for every mini-batch past the warm-up. So if E[:, k + c] = E[:, k] + c·s for W consecutive k (the last before N
    - h - c), the first row after them that differed from that shift (in event order) would have every input equal
    to its shifted one, which is a contradiction: the run repeats with period c and step s forever. Where no period
    shows in the longest run, the largest (E[g, k + c] - E[g, k]) / c over those W mini-batches k, for each c,
    bounds the steady step from above wherever the rows' ends are monotone and shift-invariant in their inputs (a
    max-plus order's are: if every row of a window of W ends at most c·s later c mini-batches on, so does every row
    after it, by the same induction), so tune does not measure a step below the steady state's, which the bounds
    stay at or below. Its twin bounds the steady step from below: if every row of the window ends at least c·s
    later c mini-batches on (min over the rows and k of E[g, k + c] - E[g, k] >= c·s), then so does the first row
    after it, each of whose inputs ends at least c·s after its own c mini-batches back, and by induction every
    later row: no steady step is under s, from a run of any length.

    Where the rules are not max-plus neither window bound holds: a transfer kernel that begins later can hold the
    compute beside it less, so that it ends sooner (`held_compute`), and a transfer that comes later to a lane two
    devices share first come, first served can let another go first. Random chains with holds (some on one bus)
    found a window's least upper bound 4.5-13 % under the steady step (runs that keep one regime for 20-30
    mini-batches, then settle slower), at tune's last window too (an XPipe chain: 19.27 ms against its 19.30), and
    its lower bound 2.5 % over.
    So such a run doubles on to UNPROVEN_STEADY_STEPS for its period, and where none shows there, the step is the
    greater of the window's two bounds (in a max-plus run the upper), unproven: of 3,500 random chains with holds or
    one bus, 703 not periodic in tune's first run, none came out under its step at N = 1,000 (or, 16 not periodic by
    then, that run's least upper bound) by more than 1.4e-6 (the least upper bound alone: 1.1e-5). Where the holds
    are all that is not max-plus, the same order without them bounds the steady step from below: its rows have the same
    inputs, each begins at the end of the last of them in both runs and no held row ends sooner than the same row
    without its holds, so by induction in event order no row of the held run ends before the hold-free one's, whose
    window bounds (or period) give a step no steady step of the held run is under (the XPipe chain's: its period's
    16.2 ms, where the held window read 16.49; the 70B's stale p = 32 orders, whose holds cost 2.6 %, stay under the
    641.4 that loses: 639.5 at N = 16). The hold-free order is max-plus, so its window's least upper bound holds:
    once that is under `losing_ms` (or its period shows), it is run no longer, as no lower bound a longer run of it
    gives exceeds its steady step, which is at or under that bound, and none could reach `losing_ms`."""
    steps, reach = schedule.minibatches - short, short
    in_flight = -(-schedule.num_stages // schedule.microbatches)
    max_plus = _max_plus(costs, links, schedule.num_devices)
    held_free = (not max_plus and losing_ms < math.inf and costs.transfers_hold_products
                 and _max_plus(replace(costs, transfers_hold_products=False), links, schedule.num_devices))
    # the hold-free order's lower bound of the steady step; whether it is settled: exact, or never to reach losing_ms
    floor_ms, floor_settled = 0.0, False
    while True:
        clean = schedule.minibatches - in_flight
        period_ms, least_ms, lower_ms = _window_steps(_row_ends_ps(trace), clean, reach)
        if period_ms is not None:
            return growth_ms if math.isclose(growth_ms, period_ms, rel_tol=1e-9) else period_ms
        if clean > reach:
            if steps >= (LONGEST_STEADY_STEPS if max_plus else UNPROVEN_STEADY_STEPS):
                return max(least_ms, lower_ms)
            if held_free and not floor_settled:
                hold_free = simulate(schedule, replace(costs, transfers_hold_products=False), links, memory=False)
                free_ms, free_upper_ms, free_lower_ms = _window_steps(_row_ends_ps(hold_free), clean, reach)
                floor_ms = max(floor_ms, free_lower_ms if free_ms is None else free_ms)
                floor_settled = free_ms is not None or free_upper_ms < losing_ms
            lower_ms = lower_ms if max_plus else floor_ms
            if lower_ms >= losing_ms:
                return lower_ms
        steps *= 2
        schedule = schedule_of(short + steps)
        trace = simulate(schedule, costs, links, memory=False)  # its rows' ends alone


def _window_steps(ends_ps: np.ndarray, clean: int, reach: int) -> tuple[float | None, float, float]:
    """Of rows' ends E[g, k] (`_row_ends_ps`) over the `reach` mini-batches before `clean`: the step of the first
    period c that shifts every row by one value (None where none does), else, over the periods, the least of the
    largest mean step of any row and the greatest of the least (`_periodic_step_ms`' window bounds)."""
    least_ms, lower_ms = math.inf, 0.0
    for period in range(1, clean - reach + 1):
        shift_ps = ends_ps[:, clean - reach:clean] - ends_ps[:, clean - reach - period:clean - period]
        step_ms = float(shift_ps.max()) / period / 1e9
        if shift_ps.max() - shift_ps.min() <= _PERIOD_TOLERANCE_PS:
            return step_ms, least_ms, lower_ms
        least_ms = min(least_ms, step_ms)
        lower_ms = max(lower_ms, float(shift_ps.min()) / period / 1e9)
    return None, least_ms, lower_ms


def _max_plus(costs: Costs, links: Cluster, devices: int) -> bool:
    """Whether every row of a run ends its own time after the last of its inputs (its device's row before it, its
    data, the transfer before it on its lane), so that rows' ends are monotone and shift-invariant in their inputs
    (`_periodic_step_ms`'s bounds): no transfer holds the compute beside it, no link resource is queued on by two
    devices' sends (each device issues its own in its order), no two devices share a compute resource or a host's
    cores."""
    senders: dict[str, set[int]] = {}
    for src in range(devices):
        for dst in range(devices):
            resource = links.link(src, dst).resource
            if src != dst and resource is not None:
                senders.setdefault(resource, set()).add(src)
    return (not costs.transfers_hold_products and all(len(sending) == 1 for sending in senders.values())
            and all(len(peers) == 1 for peers in links.compute_peers(devices))
            and all(len(peers) == 1 for peers in links.host_peers(devices)))


def _row_ends_ps(trace: Trace) -> np.ndarray:
    """Each row's end in integer picoseconds (the engine's clock) as E[g, k]: row g of the order's pattern (its
    device, stream, kind, stage, micro-batch, pipeline, peer, and its place among rows alike) in mini-batch k.
    Sorted on one integer a row, unique (`_ordinal`): sorting on the columns themselves (`np.lexsort`, stable) took
    twice as long (0.09 CPU s against 0.04 on the 608 k rows of a PipeDream run at p = 32, m = 32, N = 100)."""
    ops = trace.ops
    ends_ps = np.rint(ops.start_us * 1e6).astype(np.int64) + np.rint(ops.dur_us * 1e6).astype(np.int64)
    row, size = _ordinal((ops.device, ops.stream, ops.kind, ops.stage, ops.microbatch, ops.pipeline, ops.peer))
    alike, alikes = _ordinal((ops.minibatch,), row, size)  # rows alike in one mini-batch
    rows = np.arange(len(ends_ps))
    order = np.argsort(_ordinal((rows,), alike, alikes)[0])  # alike rows in the order the trace lists them
    repeats = rows > 0  # the same row as the one before it in `order`, in the same mini-batch
    repeats[1:] = alike[order][1:] == alike[order][:-1]
    place = np.empty(len(order), dtype=np.int64)
    place[order] = rows - np.maximum.accumulate(np.where(repeats, 0, rows))
    by_place = np.argsort(_ordinal((place, ops.minibatch), row, size)[0])
    return ends_ps[by_place].reshape(-1, int(ops.minibatch.max()) + 1)


def _ordinal(columns: Sequence[np.ndarray], key: np.ndarray | None = None, values: int = 1) -> tuple[np.ndarray, int]:
    """One int64 a row that orders the rows as `columns` do, the first the most significant, after `key` (of
    `values` values) where given, and how many values it can take: each column's offset from its least, in a
    mixed radix, where a key would outgrow int64 first numbered densely in its own order."""
    for column in columns:
        low = int(column.min())
        radix = int(column.max()) - low + 1
        if values * radix > _ORDINAL_VALUES:
            distinct, key = np.unique(key, return_inverse=True)
            values = len(distinct)
        offset = column.astype(np.int64) - low
        key = offset if key is None else key * radix + offset
        values *= radix
    return key, values


def _steady_busiest_ms(schedule: Schedule, costs: Costs, busy_ms: np.ndarray, short: int) -> float:
    """The busiest device's compute (`busy_ms`, a candidate's) in a steady step with its gradient accumulations
    (`_accumulated_ms` in mini-batch `short`, as the bounds count them): no step is shorter. The long run's growth
    can read less where its window starts before an order's steady state (a PipeDream-2BW chain whose
    accumulations settle late), and a bound above the step `_measured` gives could prune what the exhaustive
    search keeps."""
    accumulations = _Accumulations.of(schedule, short, _accumulates(schedule))
    return float((busy_ms + accumulations.ms(_accumulates_ms(costs))).max())


def _reserved_peak_bytes(candidate: Candidate, long_run: Trace, reserves: Sequence[int] | None = None) -> int:
    """The long run's peak with the caching allocator's reserve: `_measured`'s, for a result first simulated
    without it, from what `_floor` kept of that run's trace (which it adds the reserve to: `reserves`, each
    device's, where the workers found them, `_device_reserves`)."""
    _add_reserve(candidate, long_run, reserves)
    return _peak_bytes(summarize(long_run))


def _device_reserves(candidate: Candidate, long_run: Trace, devices: Sequence[int]) -> list[int]:
    """The caching allocator's reserve on each of `devices` in the candidate's run (`_add_reserve`'s), in a worker:
    `_Built.replay` deals a candidate's devices out to the workers."""
    return candidate.setting.scenario.reserves(candidate.schedule, long_run, candidate.bounds, candidate.links,
                                               devices)


def _add_reserve(candidate: Candidate, trace: Trace, reserves: Sequence[int] | None = None) -> None:
    """The caching allocator's reserve in the candidate's run (`reserves` where found already, else found here),
    its stages' layers cut where its costs and memory are (`candidate.bounds`, the partition searched under the
    memory cap), not at the scenario's own cut (the profile's time-balanced one, `Scenario.cut`), which can differ
    (ZB-H2 at p = 32 on the 70B); each device's memory read off the candidate's links, not built again."""
    candidate.setting.scenario.add_reserve(candidate.schedule, trace, candidate.bounds, candidate.links, reserves)


def _peak_bytes(run: Summary) -> int:
    return round(run.peak_memory_mb * MIB)


def explain(result: Result, choice: Result, problem: Problem) -> str:
    """Why `result` is not the choice, in the terms that decided it."""
    limits = []
    if result.staleness > problem.max_staleness:
        limits.append(f"staleness {result.staleness} > {problem.max_staleness}")
    if result.peak_memory_bytes > problem.memory_cap_bytes:
        # the choice's own configuration on another cut (its cut for time) reads as the choice row for row: its cut
        cut = (f" on layers {cut_text(result.candidate.bounds)}"
               if result.config == choice.config and result.candidate.bounds != choice.candidate.bounds else "")
        limits.append(f"over memory: {_apart(result.peak_memory_bytes, problem.memory_cap_bytes, memory_text, '>')}"
                      f"{cut}")
    if limits:
        return f"{'; '.join(limits)} ({_percent(result.samples_per_s / choice.samples_per_s - 1)} faster)"
    if result is choice:
        return ""
    if speed_key(result.samples_per_s) < speed_key(choice.samples_per_s):
        return f"{_percent(1 - result.samples_per_s / choice.samples_per_s)} slower: {_slower_part(result, choice)}"
    if result.peak_memory_bytes > choice.peak_memory_bytes:
        return f"as fast, more memory: {_apart(result.peak_memory_bytes, choice.peak_memory_bytes, memory_text)}"
    return f"as fast and lean, staleness {result.staleness} vs {choice.staleness}"  # else it would be a twin


def cut_text(bounds: Sequence[int]) -> str:
    """The layers each model stage holds: "0-1 | 2-3 | 4-6" (tune's partition line and its rows)."""
    return " | ".join(f"{a:,}-{b - 1:,}" if b - a > 1 else f"{a:,}" for a, b in itertools.pairwise(bounds))


def _slower_part(result: Result, choice: Result) -> str:
    """What made `result`'s step longer than `choice`'s: the step is its busiest device's compute and the rest, that
    device idle or waiting on exposed communication. Where both parts are no shorter, the one that grew more (the
    idle ms is its bubble: the bubble column, a share of all devices' time, can read less, 10.8% against the
    choice's 10.9%); where one grew past the whole loss and the other shrank (more compute, less idle: DeepSeek-V3's
    busiest device computing 17,571 vs 12,953 ms in a step 2.6% longer), the step and both, as neither alone says
    how much was lost."""
    work_ms = result.candidate.busiest_ms, choice.candidate.busiest_ms
    # none where the step is its busiest device's compute but for the subtraction's rounding ("idle 2.01e-10 ms")
    idle_ms = tuple(0.0 if abs(step - work) <= 1e-9 * step else step - work
                    for step, work in zip((result.step_ms, choice.step_ms), work_ms))
    more_work, more_idle = work_ms[0] - work_ms[1], idle_ms[0] - idle_ms[1]
    if min(more_work, more_idle) < -1e-9 * choice.step_ms:  # shrank, beyond the subtractions' rounding
        return (f"step {_apart(result.step_ms, choice.step_ms)} ms: busiest device computing {_apart(*work_ms)} "
                f"ms, idle {_apart(*idle_ms)} ms")
    if more_idle >= more_work:
        return f"busiest device idle {_apart(*idle_ms)} ms/step"
    return f"busiest device computing {_apart(*work_ms)} ms/step"


def build(scenario: Scenario, problem: Problem, name: str, params: ScheduleParams,
          bounds: list[int] | None) -> Schedule:
    """A candidate's schedule; a searched one (auto) is searched for the costs at `bounds` and the memory cap."""
    return replace(scenario, memory_bytes=problem.memory_cap_bytes).build(name, params, bounds)


@dataclass(frozen=True)
class _Order:
    """A schedule and what the search reads off its order alone (`_ops_per_step`, `_flush_chain`), and what its
    stages hold (`_held`, a pass over every row's weight version: the dear part) once asked: a probe's sketch
    (`_Sketch.of`) asks only a flushing order's staleness, and nothing of one that never flushes."""

    schedule: Schedule
    per_step: np.ndarray
    chain: tuple[int, bool] | None  # `_flush_chain`
    steps: dict[int, _StepRows] = field(default_factory=dict, compare=False, repr=False)  # by steady mini-batch,
    # shared with its copies for other replicas (`_with_replicas`: the same rows)

    @classmethod
    def of(cls, schedule: Schedule) -> _Order:
        return cls(schedule, _ops_per_step(schedule), _flush_chain(schedule))

    @cached_property
    def held(self) -> tuple[int, tuple[int, ...]]:
        """`_held`: its staleness, and per stage the weight versions lingering."""
        return _held(self.schedule)

    @property
    def staleness(self) -> int:
        return self.held[0]

    @cached_property
    def in_flight(self) -> tuple[int, ...]:
        """`_in_flight`, asked of the orders partitioned (not of a probe, whose staleness alone is asked)."""
        return _in_flight(self.schedule)

    @property
    def lingering(self) -> tuple[int, ...]:
        return self.held[1]

    @cached_property
    def held_counts(self) -> tuple[tuple[tuple[int, int], ...], ...]:
        """Per stage, every distinct (micro-batches held from their forward, from their input-gradient pass until
        their weight pass) at once (planning/scenario.py `stage_held_counts`): what its partition weighs; an order
        without a split backward's its `in_flight` alone (found far faster: the 70B's search took 1.6 times as long)."""
        if not kind_mask(self.schedule.table.kind, Kind.I).any():
            return tuple(((count, 0),) for count in self.in_flight)
        return tuple(tuple(map(tuple, counts.tolist())) for counts in stage_held_counts(self.schedule))

    def __getstate__(self) -> dict:
        """Sent to a worker without `steps`: it reads its own rows there, cheaper than pickling them here."""
        return {**self.__dict__, "steps": {}}

    def step_rows(self, minibatch: int) -> _StepRows:
        """`_StepRows` of its order in steady mini-batch `minibatch`, found once."""
        if minibatch not in self.steps:
            self.steps[minibatch] = _StepRows.of(self.schedule, minibatch)
        return self.steps[minibatch]


class _Orders:
    """The orders one search builds. A fixed order of a chain (any method but auto's and a stage DAG's) depends
    on the method and its parameters alone (an estimate's expert-parallel E among them, `Scenario.order_params`:
    the all-to-all rows), not on the profile, so every setting of one E shares it: built once, refusal
    included. Nor does it depend on how many data-parallel replicas d > 1 there are (`add_data_parallel` puts
    a stage's REDUCE where it does for any d > 1; d only prices it), so it is built once for all of them."""

    def __init__(self) -> None:
        self._fixed: dict[tuple[str, ScheduleParams], _Order | ScheduleError] = {}
        self._sketches: dict[tuple[str, ScheduleParams, int | None], _Sketch | ScheduleError] = {}
        self._shapes: dict[tuple, _Sketch | ScheduleError] = {}
        self._refused_methods: dict[str, _CopiesRefused] = {}
        self._chains: dict[int, bool] = {}  # by id of the scenario: whether its model's layers form a chain
        self._refusals: dict[bool, dict[str, str]] = {True: {}, False: {}}  # by whether v and P are the method's

    def refusals(self) -> dict[str, str]:
        """Per method that refused a shape, why: its first refusal at its own v and P (`Method.defaults`: 2
        chunks for a V schedule), else its first one; at other v or P the reason is mostly those."""
        usual, other = self._refusals[True], self._refusals[False]
        return {name: usual.get(name, other.get(name)) for name in {**other, **usual}}

    def __call__(self, scenario: Scenario, name: str, params: ScheduleParams) -> _Order:
        method = METHODS[name]
        if method.needs_costs or method.on_graph is not None:
            return _Order.of(scenario.build(name, params))
        params = scenario.order_params(params)  # an estimate's E: its all-to-all rows
        if (name, params) not in self._fixed:
            shared = params if params.data_parallel <= 2 else replace(params, data_parallel=2)
            try:
                self._fixed[name, params] = (_Order.of(method.build(params)) if shared == params else
                                             _with_replicas(self(scenario, name, shared), params.data_parallel))
            except ScheduleError as exc:
                self._fixed[name, params] = exc
        found = self._fixed[name, params]
        if isinstance(found, ScheduleError):
            raise found
        return found

    def of_shape(self, scenario: Scenario, name: str, stages: int, microbatches: int, chunks: int,
                 pipelines: int, microbatch_group: int | None = None) -> _Sketch | ScheduleError:
        """The sketch of a shape (a searched order's, `_searched_sketch`, once `check_shape` takes it), or why the
        method refuses it, returned rather than raised: most of the search's shapes (tens of thousands on a large
        problem) are refused, each looked up by its numbers, without building anything. It does not depend on
        the replicas d, so the settings share it."""
        key = (name, stages, microbatches, chunks, pipelines, microbatch_group, self._model_key(scenario, name))
        if key not in self._shapes:
            try:
                params = ScheduleParams(stages, microbatches, 2, chunks, pipelines, microbatch_group=microbatch_group)
                if METHODS[name].needs_costs:
                    check_shape(params)
                    self._shapes[key] = _searched_sketch(stages, microbatches)
                else:
                    self._shapes[key] = self.sketch(scenario, name, params)
            except ScheduleError as exc:
                self._shapes[key] = exc
                defaults = METHODS[name].defaults
                usual = (chunks, pipelines) == (defaults.get("chunks", 1), defaults.get("pipelines", 1))
                self._refusals[usual].setdefault(name, str(exc))
        return self._shapes[key]

    def sketch(self, scenario: Scenario, name: str, params: ScheduleParams) -> _Sketch:
        """`name`'s sketch for `params`, read off a probe of at most 2p micro-batches (each multiple of p from
        2p - 1 up that a method may ask for) and one replica: a deep pipeline's order at a large m is slow to
        build, and the search builds it only if the shape can win. A method that refuses the probe is asked at
        m itself; one that takes the probe and refuses m is found out when the candidate is built. A method
        found to run several model copies is refused from then on, unbuilt."""
        if name in self._refused_methods:
            raise self._refused_methods[name]
        probe = _one_replica(params, min(params.microbatches, 2 * params.stages))
        key = (name, probe, self._model_key(scenario, name))
        if key not in self._sketches:
            self._sketches[key] = self._read(scenario, name, probe)
        found = self._sketches[key]
        if isinstance(found, ScheduleError) and probe.microbatches != params.microbatches and name not in \
                self._refused_methods:
            found = self._read(scenario, name, _one_replica(params, params.microbatches))
        if isinstance(found, ScheduleError):
            raise found
        return found

    def _read(self, scenario: Scenario, name: str, params: ScheduleParams) -> _Sketch | ScheduleError:
        """The sketch of `name`'s order, or why it is refused: by the method, or by the scenario's pipeline runtime
        and FSDP2 (`Scenario.order_refusal`: one search's settings share their runtimes, so the sketches they share
        hold for all)."""
        try:
            order = self(scenario, name, params)
            sketch = _Sketch.of(order)
            refusal = scenario.order_refusal(order.schedule)
            return sketch if refusal is None else ScheduleError(refusal)
        except _CopiesRefused as exc:
            self._refused_methods[name] = exc
            return exc
        except ScheduleError as exc:
            return exc

    def _model_key(self, scenario: Scenario, name: str) -> int | None:
        """What a method's order depends on beyond its parameters: a stage DAG's, the model's stage graph, which
        is a chain however a chain of layers is cut (then None: settings of the model share it), else the
        scenario's own."""
        if METHODS[name].on_graph is None:
            return None
        if id(scenario) not in self._chains:
            self._chains[id(scenario)] = scenario.dag is None and _chain_of_layers(scenario.measured)
        return None if self._chains[id(scenario)] else id(scenario)


def _one_replica(params: ScheduleParams, microbatches: int) -> ScheduleParams:
    """`params` for one replica at `microbatches`: `params` itself where they are that already (a copy, checked
    again, costs more than the sketch's lookup it is for)."""
    if params.data_parallel == 1 and params.microbatches == microbatches:
        return params
    return replace(params, microbatches=microbatches, data_parallel=1)


def _chain_of_layers(profile: Profile | None) -> bool:
    """Whether each layer reads the one before it and nothing else (the first, the batch): every cut is a chain."""
    return profile is not None and all({s for s in layer.inputs if s >= 0} == ({i - 1} if i else set())
                                       for i, layer in enumerate(profile.layers))


def _with_replicas(order: _Order, replicas: int) -> _Order:
    """`order` for d = `replicas` > 1 replicas, from its order for another d > 1: the same rows (its action
    table, built once, is shared), priced for d (`Schedule.data_parallel`)."""
    schedule = replace(order.schedule, params={**order.schedule.params, "data_parallel": replicas})
    schedule.__dict__["table"] = order.schedule.table  # the cached property: the same rows
    copied = replace(order, schedule=schedule)
    copied.__dict__["held"], copied.__dict__["in_flight"] = order.held, order.in_flight  # so they hold the same
    return copied


def _plan(setting: Setting, problem: Problem, config: Config, split: Callable[..., list[int]],
          orders: _Orders) -> tuple[ScheduleParams, int, _Order, list[int]]:
    """The long run's parameters, its warm-up mini-batches, the order the partition reads and the partition.
    A searched order is partitioned as its method's `partitioned_as` order is (auto's: 1F1B's, R = 1), then
    searched for that partition (`_candidate`)."""
    name, p, v, pipelines, m = config.schedule, config.stages, config.chunks, config.pipelines, config.microbatches
    planned = METHODS[name].partitioned_as or name
    params = ScheduleParams(p, m, 2, v, pipelines, data_parallel=config.replicas, zero=config.zero,
                            microbatch_group=config.microbatch_group)
    sketch = orders.sketch(setting.scenario, planned, params)
    short = warmup_minibatches(sketch.flushing, sketch.stages, m)
    params = replace(params, minibatches=short + (1 if sketch.flushing else STEADY_STEPS))
    order = orders(setting.scenario, planned, params)
    policy = order.schedule.policy
    bounds = split(order.schedule.num_stages, pipelines, tuple(map(tuple, order.per_step.tolist())),
                   policy.extra_copies, policy.master_copies, order.held_counts, order.lingering,
                   problem.memory_cap_bytes, device_stages(order.schedule, order.schedule.num_stages))
    return params, short, order, bounds


def _candidate(setting: Setting, problem: Problem, config: Config, index: int, split: Callable[..., list[int]],
               orders: _Orders, links: Cluster, plan: tuple | None = None, costed: tuple | None = None) -> Candidate:
    """The configuration built: partitioned (`plan`, if `_plan` has already run), ordered, costed (`costed`, if a
    worker has run `_costed` on a fixed chain's plan) and bounded; `links`: between its devices (`_frame`'s)."""
    scenario = setting.scenario
    name, p, m = config.schedule, config.stages, config.microbatches
    method = METHODS[name]
    params, short, order, bounds = plan or _plan(setting, problem, config, split, orders)
    n = order.schedule.num_stages
    # A searched order is searched for its partition and the memory cap with an activation limit R no order
    # reaches (p·m times 1F1B's peak: more than every micro-batch on any stage), so that the cap binds.
    if order.schedule.graph != StageGraph.chain(n) or method.needs_costs:  # cut where the costs are; searched for them
        if method.needs_costs:
            params = replace(params, activation_limit=float(p * m), search_seconds=problem.search_seconds)
        order = _Order.of(build(scenario, problem, name, params, bounds))
    costs, *bounded = costed or _costed(scenario, problem, config, order, bounds, short, links)
    searched = method.needs_costs
    return Candidate(config, setting, index, params, bounds, order.schedule, short, costs, links, *bounded,
                     activation_ratio(order.schedule, costs) if searched else None,
                     build(scenario, problem, name, replace(params, minibatches=short), bounds) if searched else None)


def _costed(scenario: Scenario, problem: Problem, config: Config, order: _Order, bounds: list[int], short: int,
            links: Cluster) -> tuple[Costs, int, np.ndarray, int, float, float]:
    """A candidate's costs on its partition and what they bound: (costs, staleness, compute per step per device,
    memory floor, all-reduce per step, samples/s bound), the `Candidate` fields from its costs to its bound but
    its links. A worker finds them ahead of the search for a fixed order's partition (`_Built.ahead`): they are
    far fewer bytes to send back than the candidate."""
    p, pipelines = config.stages, config.pipelines
    schedule, staleness, in_flight, lingering, per_step = (order.schedule, order.staleness, order.in_flight,
                                                           order.lingering, order.per_step)
    costs = scenario.costs(schedule, bounds)
    per_op_ms = costs.op_ms_table(pipelines)
    op_ms = per_step * per_op_ms
    stage_ms, reduces_ms = (op_ms * COMPUTE).sum(axis=1), (op_ms * DATA_PARALLEL).sum(axis=1)
    busy_ms = np.array([stage_ms[schedule.stages_on(d)].sum() for d in range(p)])
    # A forward on a receive buffer the runtime keeps (torch's, `StageCosts.buffered_input_bytes`, which
    # `static_bytes` counts) holds that much less of its own; what else the runtime keeps only adds to the peak.
    held = [max(in_flight[s] * max(c.activation_bytes - c.buffered_input_bytes, 0), lingering[s] * c.param_bytes)
            for s, c in enumerate(costs.stages)]
    floor = max(static + max(held[s] for s in schedule.stages_on(d))
                for d, static in enumerate(static_bytes(schedule, costs)))
    allreduce_ms = max(float(reduces_ms[schedule.stages_on(d)].sum()) for d in range(p))
    least_step_ms = _planned_bound_ms(order, short, per_op_ms, per_op_ms[:, KIND_CODE[Kind.REDUCE]],
                                      _hops_ms(links, costs, p), _send_holds_ms(
                                          schedule, per_step, costs.transfers_hold_products, links,
                                          [c.output_bytes for c in costs.stages], costs),
                                      _accumulates_ms(costs))
    return costs, staleness, busy_ms, floor, allreduce_ms, _bound_samples_per_s(problem.batch_size, least_step_ms)


def _with_critical_path(problem: Problem, candidate: Candidate, bound: float | None = None) -> Candidate:
    """The candidate with its bound lowered to what its critical path allows (`_critical_bound`, or `bound` if
    a worker has found it), and marked as such."""
    bound = _critical_bound(problem, candidate) if bound is None else bound
    return replace(candidate, max_samples_per_s=min(candidate.max_samples_per_s, bound), critical=True)


def _critical_bound(problem: Problem, candidate: Candidate) -> float:
    """The samples/s the candidate's critical path allows (`_path_bound`)."""
    return _path_bound(problem.batch_size, candidate.schedule, candidate.costs, candidate.links,
                       candidate.config.pipelines)


def _path_bound(batch_size: int, schedule: Schedule, costs: Costs, links: Cluster, pipelines: int) -> float:
    """The samples/s a candidate's critical path allows (`_critical_path_ms` over the long run's last step if it
    flushes, else its last `CRITICAL_STEPS`, all steady; shaded as `_candidate`'s bound). Takes only what the
    path reads, so that a worker is sent a quarter of the bytes of the candidate (its setting is most of the
    rest)."""
    steps = 1 if flushes(schedule) else CRITICAL_STEPS
    return _bound_samples_per_s(batch_size, _critical_path_ms(schedule, costs.op_ms_table(pipelines), costs, links,
                                                              schedule.minibatches - 1 - steps, steps))


def _bound_samples_per_s(batch_size: int, step_ms: float, shade: float = 1e-9) -> float:
    """The samples/s a lower bound of the step (ms) allows, the step shaded by `shade` (a billionth: its sums run in
    another order than the simulation's, and must stay below it), as every bound of the search is (`_candidate`'s,
    its shape's, its critical path's); unbounded where the step takes no time."""
    step_ms *= 1 - shade
    return batch_size / step_ms * 1e3 if step_ms > 0 else math.inf


_CRITICAL_PATH_KINDS = kind_mask(np.arange(len(KINDS)), Kind.F, Kind.B, Kind.I, Kind.W, Kind.OPT, Kind.PRED, Kind.AVG,
                                 Kind.REDUCE, *ALL_TO_ALL_KINDS)


def _critical_path_ms(schedule: Schedule, op_ms: np.ndarray, costs: Costs, links: Cluster, minibatch: int,
                      steps: int) -> float:
    """A lower bound of the steady step of a schedule down a chain whose stage 0 is on device 0: the longest
    path from device 0's first row of mini-batch `minibatch` (steady) to its first row `steps` mini-batches
    later, over `steps` (0 for any other schedule, and for one whose rows the path does not model: transfers
    of ZeRO-3, parts of a pair that overlap, all-to-alls beside a pair's other part).

    Why: a row starts no earlier than each row it waits for ends: the row before it on its device (a REDUCE
    runs on the device's network stream, after the REDUCEs before it there, once the device's program has
    reached it; the next row does not wait for it; an all-to-all, A2A_F or A2A_B, is a row of its device that
    starts after its pass and that the next row waits for, `passes.add_expert_parallel`, which the simulator
    times at its whole cost where no pair's compute hides it), its stage's last REDUCE of the step if it is an update
    (`Lowered.awaits`), and its input: a forward its micro-batch's forward on the stage before, an
    input-gradient pass (B or I) that of the stage after (the last stage's its own forward), each plus its
    transfer over the link between their devices alone (`Channel`: a gradient has its activation's size).
    So along any chain of such waits from row a to row b, b starts at least the chain's rows' times and
    transfers after a starts. A row's time is at least its cost (`op_ms`, and a B's or W's accumulation into
    the gradient buffer where the engine adds it, `sim.engine._gradient_spans`): overheads, copies and shared
    resources only add. Where sends hold the compute (`_sends_hold`), a device's compute row after one that sends
    its output also waits for that row's end plus the transfer (`_with_send_holds`). Rows from one mini-batch
    before `minibatch` to `steps` after are counted (the chains
    that leave them count for nothing: what is left out only lowers the path), each starting as soon as its
    waits allow, device 0's first of `minibatch` at 0 and nothing that does not wait on it before it. As in
    `_flush_bound_ms`, the steps repeat from the steady one on, so `steps` of them take the difference of
    the two rows' starts, at least the path. Where nothing is shared (no link carries two transfers at once)
    a flushing schedule's path over one step is the engine's own timing, so the bound is the simulated step:
    a test holds it below the simulation on every candidate of the test problems, and equal to it on some.

    Over a flushing schedule's last step (`minibatch` + 1 its last mini-batch, as `_path_bound` takes it) on
    more than one device (on one, it is device 0's path), the step is also at least the least, over devices, of
    the longest chain of waits from the device's first row of the last mini-batch to the end of any row
    (`_longest_from_ms`). Why: the step tune measures is the growth of the makespan from the short run, its N - 1
    mini-batches, to the long run, N (`_measured`). The long run runs the short run's rows and then the last
    mini-batch's, which only hold or queue behind them, so the device e whose rows of mini-batch N - 2 end last
    ends them no earlier than the short run's makespan; e flushes, so its first row of the last mini-batch starts
    after that (its REDUCEs end before the updates that wait for them), and the long run's makespan is at least
    that start plus the chain from it. The rows do not say which device e is: the least over devices holds for
    it. This counts what device 0's path misses where another device ends its step later (its update longer than
    device 0's): on the 70B, auto p = 32 t = 4 634.6 -> 653.3 ms (simulated 670.8) and zb-v p = 32 637.9 -> 663.1
    ms (734.3); a hypothesis test holds it to the simulation of random chains."""
    t = schedule.table
    n, m, pipelines = schedule.num_stages, schedule.microbatches, schedule.pipelines
    window = (t.minibatch >= minibatch - 1) & (t.minibatch <= minibatch + steps)
    rows = np.flatnonzero(window)  # grouped by device, each in program order
    if (steps < 1 or minibatch < 1 or schedule.graph != StageGraph.chain(n) or schedule.placement[0] != 0
            or not _CRITICAL_PATH_KINDS[t.kind[rows]].all()
            or (bool(np.any(t.peer[rows] >= 0)) and (costs.overlap_hidden_fraction > 0
                                                      or kind_mask(t.kind[rows], *ALL_TO_ALL_KINDS).any()))):
        return 0.0
    code = {k: KIND_CODE[k] for k in (Kind.F, Kind.B, Kind.I, Kind.W, Kind.OPT, Kind.REDUCE)}
    kind, stage, microbatch = t.kind[rows], t.stage[rows], t.microbatch[rows]
    replica = (t.minibatch[rows] - (minibatch - 1)) * pipelines + t.pipeline[rows]  # of a pipeline in a step
    forward, passing = kind == code[Kind.F], (kind == code[Kind.B]) | (kind == code[Kind.I])
    unit = (replica * n + stage) * m + microbatch  # a micro-batch of a step's pipeline on a stage
    position = np.arange(len(rows))
    units = (steps + 2) * pipelines * n * m
    forward_at, passing_at = np.full(units, -1), np.full(units, -1)
    forward_at[unit[forward]], passing_at[unit[passing]] = position[forward], position[passing]
    reducing, updating = kind == code[Kind.REDUCE], kind == code[Kind.OPT]
    reduce_at = np.full(units // m, -1)
    np.maximum.at(reduce_at, (replica * n + stage)[reducing], position[reducing])  # a step's last
    placement = np.asarray(schedule.placement)
    sizes = [c.output_bytes for c in costs.stages]

    def hop_ms(src: int, dst: int, k: int) -> float:
        a, b = int(placement[src]), int(placement[dst])
        return 0.0 if a == b else links.link(a, b).transfer_ms(sizes[k])

    forward_hop = np.array([hop_ms(k, k + 1, k) for k in range(n - 1)] + [0.0])  # [k]: stage k to k + 1
    backward_hop = np.array([hop_ms(k + 1, k, k) for k in range(n - 1)] + [0.0])  # [k]: stage k + 1 back to k
    anchor = len(rows)  # device 0's first row of `minibatch` waits for this row, which ends at 0
    first, target = (int(np.flatnonzero((t.device[rows] == 0) & (t.minibatch[rows] == b))[0])
                     for b in (minibatch, minibatch + steps))
    waits_for, lag = np.full(len(rows), -1), np.zeros(len(rows))
    later = forward & (stage > 0)
    waits_for[later] = forward_at[unit[later] - m]
    lag[later] = forward_hop[stage[later] - 1]
    inner = passing & (stage < n - 1)
    waits_for[inner] = passing_at[unit[inner] + m]
    lag[inner] = backward_hop[stage[inner]]
    last = passing & (stage == n - 1)
    waits_for[last] = forward_at[unit[last]]
    waits_for[updating] = reduce_at[(replica * n + stage)[updating]]
    weighing = kind == code[Kind.W]  # after its I, which its device runs before it
    waits_for[weighing] = passing_at[unit[weighing]]
    waits_for[first] = anchor
    duration = op_ms[stage, kind] + _accumulated_ms(schedule, _accumulates_ms(costs))[rows]
    waits_for[reducing] = _ON_NETWORK
    device = t.device[rows]
    columns = (position, waits_for, lag, duration)
    if _sends_hold(schedule, costs.transfers_hold_products, links):
        least_ms = _least_hold(costs, schedule.stages_by_device)
        held_forward = np.array([least_ms(int(placement[k]), ms) for k, ms in enumerate(forward_hop)])
        held_backward = np.array([least_ms(int(placement[k + 1]), ms) for k, ms in enumerate(backward_hop[:-1])]
                                 + [0.0])
        device, columns, anchor = _with_send_holds(device, columns, held_forward[stage] * (forward & (stage < n - 1))
                                                   + held_backward[stage - 1] * (passing & (stage > 0)),
                                                   ~reducing & ~kind_mask(kind, *ALL_TO_ALL_KINDS))
    # each device's program, its columns cut from lists made once (each column split into arrays per device, each
    # converted, and zipped into a tuple a row, took a third of the path's time on DeepSeek-V3's 256 devices)
    bounds = [0, *np.searchsorted(device, np.arange(1, schedule.num_devices)).tolist(), len(device)]
    lists = [column.tolist() for column in columns]
    programs = [tuple(values[a:b] for values in lists) for a, b in itertools.pairwise(bounds)]
    step_ms = max(0.0, (_earliest_end_ms(programs, anchor, target) - float(duration[target])) / steps)
    if steps == 1 and minibatch + 1 == schedule.minibatches - 1 and schedule.num_devices > 1 and flushes(schedule):
        last = np.flatnonzero(t.minibatch[rows] == minibatch + 1)
        _, firsts = np.unique(t.device[rows][last], return_index=True)
        starts = last[firsts]  # each device's first row of the last mini-batch, and its rows from it on
        # where each row is in the columns (the rows added are numbered past the others: `_with_send_holds`)
        at = np.empty(len(columns[0]), dtype=np.int64)
        at[columns[0]] = np.arange(len(columns[0]))
        begins = at[starts]
        kept = np.zeros(len(device), dtype=bool)
        for begin, end in zip(begins.tolist(), bounds[1:]):
            kept[begin:end] = True
        longest_ms = _longest_from_ms(
            [tuple(values[begin - first:] for values in program) for program, begin, first in zip(
                programs, begins.tolist(), bounds)], _namers(*columns[:3], kept))
        # a start with none: its rows wait on one another
        step_ms = max(step_ms, min(longest_ms.get(start, 0.0) for start in starts.tolist()))
    return step_ms


def _with_send_holds(device: np.ndarray, columns: tuple[np.ndarray, ...], sent_ms: np.ndarray, computes: np.ndarray
                     ) -> tuple[np.ndarray, tuple[np.ndarray, ...], int]:
    """`_critical_path_ms`'s rows (per row: its device, and the columns position, wait, lag and duration) with a
    row of no time before each device's first compute row of any time that follows a row sending its output
    (`sent_ms`: its transfer's time, 0 where it sends none), waiting for that row plus the transfer: where sends
    hold the compute (`_sends_hold`), the compute after a send makes no progress until the data has moved
    (`_send_holds_ms`), so it ends no earlier than the sender's end plus the transfer plus its own time. A row of
    no time on the engine's clock is not held (`sim.engine.takes_time`): it ends as its input allows and its own
    send's kernel runs beside the one before, so both hold the next row with time, together, not one after the
    other. Returns the rows' devices and columns with those rows among them, and the row that ends at 0 (the one
    past the rows, which the path's first waits for), renumbered past the added ones."""
    count = len(device)
    computing = np.flatnonzero(computes & takes_time(columns[3]))
    producers = np.flatnonzero(sent_ms > 0)
    after = np.searchsorted(computing, producers, "right")
    producers, following = producers[after < len(computing)], computing[after[after < len(computing)]]
    mine = device[following] == device[producers]
    producers, following = producers[mine], following[mine]
    added = len(producers)
    order = np.argsort(np.r_[np.arange(count) * 2 + 1, following * 2], kind="stable")  # each just before its row
    extra = (count + np.arange(added), producers, sent_ms[producers], np.zeros(added))
    columns = tuple(np.r_[column, more][order] for column, more in zip(columns, extra))
    columns[1][columns[1] == count] = count + added
    return np.r_[device, device[following]][order], columns, count + added


_ON_NETWORK = -2  # `_earliest_end_ms`: a network row's wait (none: it runs on its device's network stream)
_Program = tuple[list[int], list[int], list[float], list[float]]  # a device's rows: numbers, waits, lags, durations
_Namers = tuple[list[int], list[int], list[float]]  # `_namers`


def _longest_from_ms(programs: list[_Program], namers: _Namers) -> dict[int, float]:
    """Per row of each device's program (`_earliest_end_ms`'s, or the ends of them), the longest chain of waits
    from its start to the end of a row among them that waits on it, directly or not, or its own: its time plus
    the most, over the rows that wait on it (`namers`: those among the programs), of the lag and that row's own
    longest. As `_earliest_end_ms` starts them, a compute row waits for the compute row before it on its device
    and the row it names, and a network row for the compute row before it and the network row before it. Each
    device's program is taken from its end back, a row once every row that names it is known."""
    first, laters, lags_ms = namers
    longest_ms: dict[int, float] = {}
    left = [len(ids) for ids, *_ in programs]  # per device: its rows not taken yet
    ahead_ms = [0.0] * len(programs)  # per device: the longest of its next compute row and the network rows before it
    lane_ms = [0.0] * len(programs)  # per device: its next network row's longest
    progressed = True
    while progressed:
        progressed = False
        for d, (ids, waits, _, durations_ms) in enumerate(programs):
            i, most_ms, next_ms = left[d], ahead_ms[d], lane_ms[d]
            while i:
                row = ids[i - 1]
                waited_ms = 0.0
                for k in range(first[row], first[row + 1]):
                    later_ms = longest_ms.get(laters[k])
                    if later_ms is None:
                        break
                    waited_ms = max(waited_ms, lags_ms[k] + later_ms)
                else:
                    if waits[i - 1] == _ON_NETWORK:
                        next_ms = longest_ms[row] = durations_ms[i - 1] + max(waited_ms, next_ms)
                        most_ms = max(most_ms, next_ms)
                    else:
                        most_ms = longest_ms[row] = durations_ms[i - 1] + max(waited_ms, most_ms)
                    i -= 1
                    continue
                break
            if i < left[d]:
                progressed = True
                left[d], ahead_ms[d], lane_ms[d] = i, most_ms, next_ms
    return longest_ms


def _namers(ids: np.ndarray, waits: np.ndarray, lags_ms: np.ndarray, kept: np.ndarray) -> _Namers:
    """`_longest_from_ms`'s rows that wait on each row, of those `kept`: by row, the range [first[row],
    first[row + 1]) of the waiting rows and their lags, found at once (a dict of lists built row by row took a
    fifth of a critical path's time)."""
    naming = kept & (waits >= 0)
    order = np.argsort(waits[naming], kind="stable")
    named = waits[naming][order]
    first = np.searchsorted(named, np.arange(len(ids) + 1))
    return first.tolist(), ids[naming][order].tolist(), lags_ms[naming][order].tolist()


def _earliest_end_ms(programs: list[_Program], rows: int, target: int) -> float:
    """When row `target` of `rows` rows ends at the earliest (-inf: nothing it waits on has a time), given each
    device's program (`_Program`: per row, its number, the row it waits for, lag and duration): a row starts as
    soon as the row before it on its device (a network row, waiting for `_ON_NETWORK`: as soon as it is reached,
    after the network rows before it) and the row it waits for (-1: none) plus the lag have ended; a wait may name
    the row past the last, which ends at 0 (`_critical_path_ms`). Rows that wait on one another end at nan. Each
    row's end depends on the rows before it alone, so the devices' programs are run only until the target's is
    known; the maxima are taken by comparison (as `max` takes them), not by calls: this loop is most of a critical
    path's time."""
    end = [math.nan] * rows + [0.0]
    clock = [-math.inf] * len(programs)
    lane = [-math.inf] * len(programs)
    next_row = [0] * len(programs)
    progressed = True
    while progressed:
        progressed = False
        for d, (ids, waits, lags_ms, durations_ms) in enumerate(programs):
            i, now, free = next_row[d], clock[d], lane[d]
            count = len(ids)
            while i < count:
                wait = waits[i]
                if wait == _ON_NETWORK:
                    free = (free if free > now else now) + durations_ms[i]
                    end[ids[i]] = free
                else:
                    if wait >= 0:
                        ready = end[wait]
                        if ready != ready:  # nan: not ended yet
                            break
                        ready += lags_ms[i]
                        if ready > now:
                            now = ready
                    now += durations_ms[i]
                    end[ids[i]] = now
                i += 1
            if i > next_row[d]:
                progressed = True
                next_row[d], clock[d], lane[d] = i, now, free
                if end[target] == end[target]:  # known (not nan)
                    return end[target]
    return end[target]


def _hops_ms(links: Cluster, costs: Costs, devices: int) -> np.ndarray:
    """[k] for the first `devices` stages, stage k on device k: the least time a micro-batch spends between
    stages k and k+1 and back: its activation's transfer forward and its gradient's (the same size) back, each
    at least its link's time alone."""
    return np.array([links.link(k, k + 1).transfer_ms(costs.stages[k].output_bytes) + links.link(k + 1, k).transfer_ms(
        costs.stages[k].output_bytes) for k in range(devices - 1)])


def _planned_bound_ms(order: _Order, short: int, stage_ms: np.ndarray, reduces_ms: np.ndarray,
                      hops_ms: np.ndarray, sends_ms: np.ndarray, accumulate_ms: np.ndarray) -> float:
    """A lower bound of a partitioned fixed order's step before it is costed: `_candidate`'s bound (each device's
    compute plus the REDUCEs it waits out, `_StepRows.exposed_ms`; a flushing chain's fill and drain,
    `_flush_bound_ms`) on costs no more than its own: `stage_ms`, its layers' costs summed, `reduces_ms`, the
    least REDUCE of its stages, `hops_ms`, its transfers, and `sends_ms`, the time its sends hold each device's
    compute (`_send_holds_ms`, the other bound of that wait), and `accumulate_ms`, its stages' gradient
    accumulations (`_accumulated_ms`: each device's in its steady step, mini-batch `short`, on top of its compute;
    the rows waited and those up to a flushing chain's last input-gradient pass each take its own as well). Both
    bounds only grow with the costs (a device's compute plus what it waits out is its compute outside the span
    waited plus the span's REDUCEs). With a candidate's own costs it is `_costed`'s bound. What it reads of the
    order's rows is read once per order (`_Order.step_rows`): the search prices each on many partitions."""
    schedule, rows = order.schedule, order.step_rows(short)
    table = stage_ms.copy()
    table[:, KIND_CODE[Kind.REDUCE]] = reduces_ms
    stage_busy_ms = ((order.per_step * table) * COMPUTE).sum(axis=1)
    busy_ms = np.array([stage_busy_ms[schedule.stages_on(d)].sum() for d in range(schedule.num_devices)])
    busy_ms += rows.accumulations.ms(accumulate_ms)
    costs_ms = _row_costs_ms(table, accumulate_ms)
    return max(float((busy_ms + np.maximum(rows.exposed_ms(table, costs_ms), sends_ms)).max()),
               _flush_bound_ms(rows.flush, table, hops_ms, costs_ms))


def _searched_bound_ms(costs: Costs, microbatches: int, hops_ms: np.ndarray, sends_ms: np.ndarray) -> float:
    """A lower bound of the step of any flushing order on a chain of these stages, one per device (a searched
    order's, before it is searched), with m micro-batches: `_flush_bound_ms`'s chains with only what every such
    order runs (each stage's m forwards and m input-gradient passes, B or I, before its last), and each device's
    compute, with the m - 1 accumulations of its m B's or W's into the gradient buffer (one update a step: all
    but the first of the step's span add, `_accumulated_ms`), plus its REDUCE, which waits for the stage's last
    backward and holds up its update, with no backward after it (every I's W follows it), or plus the time its
    sends hold its compute where they do (`sends_ms`: `_send_holds_ms` of any such order, each sending the same
    m outputs each way), another bound of that wait (as in `_candidate`)."""
    f, b, i, w, opt, reduce = _searched_columns_ms(costs)
    passes_ms = f + np.minimum(b, i)
    accumulate_ms = _accumulates_ms(costs)
    busy_ms = (microbatches * (f + np.minimum(b, i + w)) + (microbatches - 1) * accumulate_ms + opt
               + np.maximum(reduce, sends_ms))
    before_ms = np.concatenate([[0.0], np.cumsum(passes_ms[:-1] + hops_ms)])  # [d]: stages 0..d-1 and their links
    chains_ms = before_ms + microbatches * passes_ms + reduce[0] + opt[0]
    return float(max(busy_ms.max(), chains_ms.max()))


def _searched_columns_ms(costs: Costs) -> tuple[np.ndarray, ...]:
    """Each stage's F, B, I, W, OPT and REDUCE ms in one pipeline (`Costs.op_ms_table`): what a searched order's
    bounds read (`_searched_bound_ms`, `_searched_device_bound_ms`)."""
    op_ms = costs.op_ms_table(1)
    return tuple(op_ms[:, KIND_CODE[kind]] for kind in (Kind.F, Kind.B, Kind.I, Kind.W, Kind.OPT, Kind.REDUCE))


def _searched_device_bound_ms(costs: Costs, microbatches: int, links: Cluster, holds: bool) -> float:
    """A lower bound of the step of any flushing order on a chain of these stages, one per device, with m
    micro-batches each mini-batch and then its update (a searched order's, before it is searched), tighter than
    `_searched_bound_ms`'s where a device waits at both ends of its step: the most over devices d of

        max(Y_d, m·(F_d + S_d)) + m·I_d + (m - 1)·G_d + max(D_d, m·W_d + (m - 1)·A_d + R_d + O_d)

    with I_k = min(B_k, I_k) a stage's input-gradient pass, W_k = min(B_k, I_k + W_k) - I_k what its backward
    has left after it, A_k adding a micro-batch's weight gradients into the buffer (every B or W of a step but
    its first: the engine's `_gradient_spans`), R_k its REDUCE, O_k its update, H_k the link's transfers between
    stages k and k+1 there and back, and S_d, G_d the time d's forward and backward sends hold its compute where
    `holds` (`_sends_hold`; else 0; 0 from a pass of no time, as `_send_holds_ms` says).
    Y_d = F_d + ... + F_{p-1} + I_{d+1} + ... + I_{p-1} + H_d + ... + H_{p-2} is a micro-batch's way from d's
    forward to its gradient back at d; D_d = the sum of F_k + I_k + H_k over k < d, plus, for d > 0, W_0 + A_0
    (for m > 1) + R_0 + O_0 (R_0 + O_0 for d = 0) is the way from d's last input-gradient pass to its next step's
    first forward through device 0's update.

    Why, with S the start of d's first F (micro-batch 0's: each kind runs in micro-batch order) in a steady step
    and S' the next step's: (1) d runs no W before its first I or B (a step's W's follow their own I's, the
    update before S needs the last step's), so until its first input-gradient pass ends it runs some a <= m
    forwards, each sending its output (holding d's next compute row until the transfer ends, as
    `_send_holds_ms` argues), and that pass waits for micro-batch 0's gradient, at least S + Y_d: it ends at
    least S + max(Y_d, a·(F_d + S_d)) + I_d. (2) Up to its last input-gradient pass d runs the other m - 1, the
    m - a forwards left and any W's, each compute row after a send held for it: another (m - 1)·(I_d + G_d) +
    (m - a)·(F_d + S_d) at least. (3) From that pass's end to S', d runs its W's left, the accumulations, its
    REDUCE (after its stage's last B or W, on the network stream; the update waits for it) and its update; and
    S' also waits for the gradient of micro-batch m - 1 to pass back through stages d-1..0 and device 0 to
    finish that micro-batch's backward, reduce and update, then the next step's micro-batch 0 to pass forward
    through stages 0..d-1: D_d. Summed, a·(F_d + S_d) moved between (1) and (2) and the W's and accumulations
    between (2) and (3) count least where all forwards come first and all W's last, which gives the bound.
    Waits, contention, receives' holds and overheads only add; steps repeat from the second on, so S' - S is
    the step. A hypothesis test holds it to the simulated step of auto's own order on random chains."""
    p, m = len(costs.stages), microbatches
    f, b, i, w, opt, reduce = _searched_columns_ms(costs)
    accumulate_ms = _accumulates_ms(costs)
    input_ms = np.minimum(b, i)
    rest_ms = np.minimum(b, i + w) - input_ms
    out = [c.output_bytes for c in costs.stages]
    forward_ms = np.array([links.link(k, k + 1).transfer_ms(out[k]) for k in range(p - 1)])
    backward_ms = np.array([links.link(k + 1, k).transfer_ms(out[k]) for k in range(p - 1)])
    hops_ms = forward_ms + backward_ms
    least_ms = _least_hold(costs, [[k] for k in range(p)])
    held_forward = np.array([least_ms(k, ms) for k, ms in enumerate(np.append(forward_ms, 0.0))]) * takes_time(f) \
        if holds else np.zeros(p)  # [k]: stage k's F's send (none from a pass of no time, `_send_holds_ms`)
    held_backward = np.array([least_ms(k, ms) for k, ms in enumerate(np.insert(backward_ms, 0, 0.0))]) * takes_time(
        input_ms) if holds else np.zeros(p)  # [k]: stage k's I's or B's send
    round_trip_ms = (np.cumsum(f[::-1])[::-1] + np.append(np.cumsum(input_ms[::-1])[::-1][1:], 0.0)
                     + np.append(np.cumsum(hops_ms[::-1])[::-1], 0.0))
    through_first_ms = np.concatenate([[0.0], np.cumsum(f[:-1] + input_ms[:-1] + hops_ms)])
    through_first_ms[1:] += rest_ms[0] + (m > 1) * accumulate_ms[0]
    through_first_ms += reduce[0] + opt[0]
    step_ms = (np.maximum(round_trip_ms, m * (f + held_forward)) + m * input_ms + (m - 1) * held_backward
               + np.maximum(through_first_ms, m * rest_ms + (m - 1) * accumulate_ms + reduce + opt))
    return float(step_ms.max())


@dataclass(frozen=True)
class _FlushRows:
    """What `_flush_bound_ms` reads of a flushing chain's rows in mini-batch 1: their codes
    (`_row_codes`), grouped by device, each device's first row and last B or I among them, which stages run B
    and I, and whether stage 0 reduces."""

    codes: np.ndarray
    first: np.ndarray  # [d]
    last: np.ndarray  # [d]: -1 where d runs no B or I
    runs: tuple[np.ndarray, np.ndarray]  # [k]: whether stage k runs B; whether it runs I
    reduces_first: bool

    @classmethod
    def of(cls, schedule: Schedule, codes: np.ndarray) -> _FlushRows | None:
        """None where the bound does not hold: any order but a flushing chain whose first p stages are on devices
        0..p-1 in turn."""
        p = schedule.num_devices
        if not (schedule.placement[:p] == tuple(range(p)) and flushes(schedule)
                and schedule.graph == StageGraph.chain(schedule.num_stages)):
            return None
        t = schedule.table
        runs = tuple(np.bincount(t.stage[t.kind == KIND_CODE[kind]], minlength=schedule.num_stages) > 0
                     for kind in (Kind.B, Kind.I))
        steady = t.minibatch == 1
        rows = np.flatnonzero(steady)  # grouped by device, each in program order
        device = t.device[rows]
        first = np.full(p, len(rows))
        np.minimum.at(first, device, np.arange(len(rows)))
        last = np.full(p, -1)
        backward = np.flatnonzero(kind_mask(t.kind[rows], Kind.B, Kind.I))
        np.maximum.at(last, device[backward], backward)
        return cls(codes[rows], first, last, runs,
                   bool((steady & (t.kind == KIND_CODE[Kind.REDUCE]) & (t.stage == 0)).any()))


@dataclass(frozen=True)
class _Accumulations:
    """The rows of a steady mini-batch that add their weight gradients into the buffer (`_accumulates`): their
    devices and stages, read off the order once (`_StepRows`) and priced on any costs (`ms`)."""

    devices: int
    device: np.ndarray
    stage: np.ndarray

    @classmethod
    def of(cls, schedule: Schedule, minibatch: int, accumulates: np.ndarray) -> _Accumulations:
        t = schedule.table
        rows = np.flatnonzero((t.minibatch == minibatch) & accumulates)
        return cls(schedule.num_devices, t.device[rows], t.stage[rows])

    def ms(self, accumulate_ms: np.ndarray) -> np.ndarray:
        """Per device, its gradient accumulations in the mini-batch (`_accumulated_ms`; [k]: stage k's)."""
        return np.bincount(self.device, accumulate_ms[self.stage], minlength=self.devices)


@dataclass(frozen=True)
class _StepRows:
    """What the bounds read off an order's rows in a steady mini-batch, found once per order (`_Order.step_rows`):
    the search prices one order on many partitions and settings (the 70B: 970 bounds on 265 orders of up to 788k
    rows), and which rows accumulate, where each device's REDUCEs and updates are and a flushing chain's rows
    are the order's alone. A row's compute is looked up by its code (`_row_codes`) in a table of its stage's kind's
    time plus its accumulation (`_row_costs_ms`), so every sum adds the same floats in the same order as the rows
    priced one by one."""

    devices: int
    codes: np.ndarray  # per row of the table (`_row_codes`)
    accumulations: _Accumulations  # the steady rows that accumulate
    reducing: np.ndarray  # [i]: the devices that reduce in the steady mini-batch (one pipeline; else none)
    reduces: np.ndarray  # [i, j]: device reducing[i]'s j-th steady REDUCE row, in program order (where `valid`)
    stages: np.ndarray  # [i, j]: its stage
    updates: np.ndarray  # [i, j]: the steady update row of that stage (0 where none)
    valid: np.ndarray  # [i, j]
    flush: _FlushRows | None

    @classmethod
    def of(cls, schedule: Schedule, minibatch: int) -> _StepRows:
        t = schedule.table
        accumulates = _accumulates(schedule)
        codes = _row_codes(t, schedule.num_stages, accumulates)
        steady = t.minibatch == minibatch
        rows = np.flatnonzero(steady & (t.kind == KIND_CODE[Kind.REDUCE]) if schedule.pipelines == 1 else [])
        updates = np.flatnonzero(steady & (t.kind == KIND_CODE[Kind.OPT]))
        update_of = np.zeros(schedule.num_stages, dtype=np.int64)
        update_of[t.stage[updates]] = updates  # one pipeline: one OPT per stage and mini-batch, after its REDUCE
        reducing, starts, counts = np.unique(t.device[rows], return_index=True, return_counts=True)  # grouped by
        owner = np.repeat(np.arange(len(reducing)), counts)  # device, each in program order
        place = np.arange(len(rows)) - np.repeat(starts, counts)
        reduces = np.zeros((len(reducing), int(counts.max(initial=0))), dtype=np.int64)
        valid = np.zeros(reduces.shape, dtype=bool)
        reduces[owner, place], valid[owner, place] = rows, True
        stages = t.stage[reduces]
        return cls(schedule.num_devices, codes, _Accumulations.of(schedule, minibatch, accumulates), reducing,
                   reduces, stages, update_of[stages], valid, _FlushRows.of(schedule, codes))

    def exposed_ms(self, op_ms: np.ndarray, costs_ms: np.ndarray) -> np.ndarray:
        """Per device, compute-free time each steady step must have (0 for a schedule of P > 1 pipelines, which
        share a device's compute as they go), on costs `op_ms` ([k, kind]) and `costs_ms` (`_row_costs_ms`). A
        stage's REDUCE starts where the device's program reaches it, after the stage's last backward, and runs on
        the device's network stream after the REDUCEs before it; its OPT waits for it. So from REDUCE i's start
        to REDUCE l's OPT (i <= l, in program order) the network works at least REDUCEs i..l while the device
        computes only the rows between the two: each step holds at least the most any such span waits beyond its
        rows (each its kind's time plus its accumulation: no more than it takes), on top of the device's compute
        with those accumulations. Every reducing device at once, each a row of `reduces`."""
        exposed = np.zeros(self.devices)
        if not len(self.reducing):
            return exposed
        upto = int(max(self.reduces.max(), self.updates.max())) + 1
        done_ms = np.concatenate([[0.0], np.cumsum(costs_ms[self.codes[:upto]])])  # by device, in program order
        reduce_ms = np.where(self.valid, op_ms[self.stages, KIND_CODE[Kind.REDUCE]], 0.0)
        through_ms = np.cumsum(reduce_ms, axis=1)  # REDUCEs up to l
        since_ms = np.maximum.accumulate(done_ms[self.reduces + 1] - (through_ms - reduce_ms), axis=1)  # best i <= l
        waited_ms = np.where(self.valid, through_ms - done_ms[self.updates] + since_ms, -np.inf)
        exposed[self.reducing] = np.maximum(waited_ms.max(axis=1), 0.0)
        return exposed


def _flush_bound_ms(flush: _FlushRows | None, op_ms: np.ndarray, hops_ms: np.ndarray, costs_ms: np.ndarray) -> float:
    """A lower bound of the steady step of a flushing schedule down a chain of stages whose first p are on
    devices 0..p-1 in turn (1F1B's placement, the interleaved and V schedules', and AvgPipe's P pipelines, each
    so placed; `flush`, its rows, `_FlushRows`; 0 for any other, None): for every device d, the forwards of
    stages 0..d-1, then d's own work in program order (every pipeline's) up to its last B or I of the step, then
    the input-gradient passes (B or I) of stages d-1..0 (of that pass's pipeline), on costs `op_ms` [k, kind] and
    `costs_ms` (`_row_costs_ms`).

    Why: device 0 starts step s+1 only after its last op of step s (it flushes), at E0(s). Device d's first op
    of step s+1 is an F (any other op needs an F of its own step before it on d), whose micro-batch went
    through F on stages 0..d-1 after E0(s) (stage d is d's lowest: its first op is an F of stage d), crossing
    each link on the way (`hops_ms`: there and back); so d starts
    step s+1 no earlier than E0(s) + sum F_k and the hops' forward halves. Its last B or I of the step ends no
    earlier than that plus the work d runs before it, one op at a time, each its kind's time plus its
    accumulation (where `_accumulates` says it adds one) at least (it is stage d's: any later stage's input
    gradient still has stage d on d to pass). That micro-batch's input gradient then passes B or I on each of
    stages d-1..0, crossing the links back, before device 0 ends step s+1, at E0(s+1), after it has reduced stage
    0's gradients and updated.
    Waits, contention and overheads only add, and steps repeat from the second on, so E0(s+1) - E0(s) is the
    step. A test holds the bound to the simulated step over every candidate."""
    if flush is None:
        return 0.0
    p = len(flush.first)
    input_grad_ms = np.minimum(*(np.where(runs, op_ms[:, KIND_CODE[kind]], np.inf)
                                 for runs, kind in zip(flush.runs, (Kind.B, Kind.I))))
    input_grad_ms[np.isinf(input_grad_ms)] = 0.0  # a stage with no backward (none here: every stage has one)
    # device 0 then reduces stage 0's gradients (after its last backward, so after that pass) and updates it
    tail_ms = (op_ms[0, KIND_CODE[Kind.REDUCE]] if flush.reduces_first else 0.0) + op_ms[0, KIND_CODE[Kind.OPT]]
    ran = flush.last >= 0
    done_ms = np.concatenate([[0.0], np.cumsum(costs_ms[flush.codes[:int(flush.last.max(initial=-1)) + 1]])])
    before_ms = np.concatenate([[0.0], np.cumsum(op_ms[:p - 1, KIND_CODE[Kind.F]] + input_grad_ms[:p - 1] + hops_ms)])
    work_ms = done_ms[flush.last[ran] + 1] - done_ms[flush.first[ran]]
    return float((before_ms[ran] + work_ms + tail_ms).max(initial=0.0))


def _row_codes(t, stages: int, accumulates: np.ndarray) -> np.ndarray:
    """Per row of the table, where `_row_costs_ms` keeps its compute: its stage's kind's time (stage·K + kind, K
    the compute kinds), that plus the stage's accumulation where the row `accumulates` (n·K more, of n stages),
    or none, a row on the network lane (2·n·K)."""
    own = np.minimum(t.kind, NUM_COMPUTE_KINDS - 1)  # transfers come after a stage's own kinds: none computes
    computes = (t.kind < NUM_COMPUTE_KINDS) & COMPUTE[own]
    return np.where(computes, (accumulates * stages + t.stage) * NUM_COMPUTE_KINDS + own,
                    2 * stages * NUM_COMPUTE_KINDS)


def _row_costs_ms(op_ms: np.ndarray, accumulate_ms: np.ndarray | None = None) -> np.ndarray:
    """[code] (`_row_codes`): the ms a row keeps its device's compute busy: its kind's time `op_ms` [k, kind], plus
    its stage's accumulation `accumulate_ms` [k] (None: none) where it accumulates; 0 on the network lane."""
    accumulate_ms = np.zeros(len(op_ms)) if accumulate_ms is None else accumulate_ms
    return np.concatenate([(op_ms + 0.0).ravel(), (op_ms + accumulate_ms[:, None]).ravel(), [0.0]])


def _accumulates(schedule: Schedule) -> np.ndarray:
    """Per row of the table, whether it adds its weight gradients into the buffer, as the engine prices it
    (`sim.engine._gradient_spans`): a B or W that does not open its stage replica's span (its replica's row before
    it among B, W and OPT, in program order, is a B or W). An order with one update a step per stage replica so
    pays m·P - 1 of them per stage and step."""
    t, pipelines = schedule.table, schedule.pipelines
    spanned = np.flatnonzero(kind_mask(t.kind, Kind.B, Kind.W, Kind.OPT))
    spanned = spanned[np.argsort(t.stage[spanned] * pipelines + t.pipeline[spanned], kind="stable")]
    owner = t.stage[spanned] * pipelines + t.pipeline[spanned]
    is_gradient = t.kind[spanned] != KIND_CODE[Kind.OPT]
    accumulates = np.zeros(len(t.kind), dtype=bool)
    accumulates[spanned[1:]] = is_gradient[1:] & is_gradient[:-1] & (owner[1:] == owner[:-1])
    return accumulates


def _accumulated_ms(schedule: Schedule, accumulate_ms: np.ndarray) -> np.ndarray:
    """Per row of the table, the ms it spends adding its weight gradients into the buffer (`_accumulates`): its
    stage's `accumulate_ms` ([k]), or 0."""
    return _accumulates(schedule) * accumulate_ms[schedule.table.stage]


def _accumulates_ms(costs: Costs) -> np.ndarray:
    """[k]: stage k's accumulation of one micro-batch's weight gradients into the buffer."""
    return np.array([c.accumulate_ms for c in costs.stages])


def _cut_accumulates_ms(profile: Profile, bounds: list[int]) -> np.ndarray:
    """`_accumulates_ms` of the chain of stages `bounds` cuts, before they are costed, as `stages_for` and
    `_stage_costs` price them (before `cost_scale`): the accumulation was timed on the calibrated stages only, so
    on their cut each has its own, and on another each stage has their total shared out by its weights' bytes
    (an elementwise pass over the weights); none where a calibrated stage's is not timed (off their cut: any)
    or its passes were measured (off their cut: all), and none under fused accumulation (`fused_accumulation`),
    whose pass `_stage_costs` prices in every backward's own time, which the layers' summed B and W carry already
    (`_splitter`'s `stage_ms`): counted here too, a bound exceeded the stage's cost by m - 1 of them."""
    stages = profile.stages
    if fused_accumulation(profile):
        return np.zeros(len(bounds) - 1)
    if list(bounds) == profile.partition.bounds:
        return np.array([s.accumulate.median_ms if s.accumulate is not None and s.passes is None else 0.0
                         for s in stages])
    if any(s.accumulate is None for s in stages) or all(s.passes is not None for s in stages):
        return np.zeros(len(bounds) - 1)
    total_ms = math.fsum(s.accumulate.median_ms for s in stages)
    total_bytes = sum(s.param_bytes for s in stages) or 1
    return np.array([total_ms * (sum(layer.param_bytes for layer in owners(profile.layers, start, stop))
                                 / total_bytes) for start, stop in zip(bounds, bounds[1:])])


def _sends_hold(schedule: Schedule, holds: bool, links: Cluster) -> bool:
    """Whether the bounds count the sends' holds (`_send_holds_ms`): transfers hold the compute beside them, on a
    one-pipeline chain without overlapped pairs whose devices queue on nothing (the engine holds those alone)."""
    p = schedule.num_devices
    return (holds and schedule.pipelines == 1
            and schedule.graph == StageGraph.chain(schedule.num_stages) and not bool(np.any(schedule.table.peer >= 0))
            and all(len(peers) == 1 for peers in links.compute_peers(p))
            and all(len(peers) == 1 for peers in links.host_peers(p)))


def _least_hold(costs: Costs | None, stages_on: Sequence[Sequence[int]]) -> Callable[[int, float], float]:
    """Per device d and a send's transfer time T (ms), the least the send's kernel holds d's next compute row:
    where d's products' time P is known (`costs`' `product_ms`, as the engine weighs them: `device_product_ms`),
    the engine holds a row of W ms beginning x after the kernel's issue (x < T) min(W', product_delay(T - x, P)),
    W' >= W the compute before its next step, so it ends at least x + W + min(W, product_delay(T - x, P)) after
    the issue, which grows with x (the delay falls by at most what x grows): at least W + min(W, product_delay(T,
    P)), and W + T where x >= T. Rows of no time between change nothing, so min(product_delay(T, P), the shortest
    row of d's with any time) holds for the first such row after the send; with P not known (or no costs), T, the
    whole transfer, as `_send_holds_ms` argues."""
    if costs is None or not any(c.product_ms for c in costs.stages):
        return lambda d, transfer_ms: transfer_ms
    product_ms = device_product_ms(stages_on, costs)
    op_ms = costs.op_ms_table(1)[:, [KIND_CODE[kind] for kind in (Kind.F, Kind.B, Kind.I, Kind.W, Kind.OPT,
                                                                   Kind.PRED, Kind.AVG)]]
    shortest_ms = [float(mine[mine > 0].min()) if (mine := op_ms[list(stages)]).any() else 0.0 for stages in stages_on]

    def least_ms(d: int, transfer_ms: float) -> float:
        if not product_ms[d]:
            return transfer_ms
        return min(product_delay(transfer_ms, product_ms[d]), shortest_ms[d])
    return least_ms


def _send_holds_ms(schedule: Schedule, per_step: np.ndarray, holds: bool, links: Cluster,
                   output_bytes: list[int], costs: Costs | None = None) -> np.ndarray:
    """Per device, time each step its compute is held by its own sends' NCCL kernels where they hold it
    (`_sends_hold`: `holds`, `Costs.transfers_hold_products`, on a chain; else 0), from its stages' rows per step
    (`_ops_per_step`) and each stage's output's size; each send's hold the least `_least_hold` allows (`costs`:
    where known, each product held at most its own time; None: the whole transfer).

    Why it is a lower bound beside the compute: lowering puts a row's SEND right after it (`add_communication`);
    on a chain each F and each B or I sends at most one output, so the sends between two compute rows of a device
    are the one of the row before. The engine runs that send's kernel from its issue c (no earlier than the row's
    end) until its data arrives, at least c plus the link's transfer time T, and the device's next compute row,
    whenever it starts (after RECVs or an awaited REDUCE), makes no progress before c + T: it ends no earlier than
    c + T plus its own time. So from a device's first compute row of a step to the next step's, its rows' times
    and each sent output's T add up, as the steps repeat. A pass of no time (in `costs`, `takes_time`) is not held,
    so its send's kernel runs beside the one before it and the two hold the next row together: its send is not
    counted. Against `_StepRows.exposed_ms` (time the REDUCEs hold the compute off) this is another bound on the
    same wait, so a step takes the larger of the two: the sum could count a send held while the network works."""
    p, n = schedule.num_devices, schedule.num_stages
    if not _sends_hold(schedule, holds, links):
        return np.zeros(p)
    placement = schedule.placement
    least_ms = _least_hold(costs, schedule.stages_by_device)

    def send_ms(src: int, dst: int, producer: int) -> float:
        a, b = placement[src], placement[dst]
        return 0.0 if a == b else least_ms(a, links.link(a, b).transfer_ms(output_bytes[producer]))

    forward = np.array([send_ms(k, k + 1, k) for k in range(n - 1)] + [0.0])  # [k]: stage k's F to k + 1
    backward = np.array([0.0] + [send_ms(k, k - 1, k - 1) for k in range(1, n)])  # [k]: stage k's B or I to k - 1
    sending = [KIND_CODE[kind] for kind in (Kind.F, Kind.B, Kind.I)]
    f, b, i = (per_step[:, sending] * (1 if costs is None else takes_time(costs.op_ms_table(1)[:, sending]))).T
    stage_ms = f * forward + (b + i) * backward
    return np.array([stage_ms[schedule.stages_on(d)].sum() for d in range(p)])


def _is_flushing_chain(schedule: Schedule) -> bool:
    p = schedule.num_devices
    return (schedule.pipelines == 1 and schedule.placement == tuple(range(p)) and schedule.graph == StageGraph.chain(p)
            and flushes(schedule))


def _flush_chain(schedule: Schedule) -> tuple[int, bool] | None:
    """For a flushing chain (`_flush_bound_ms`; None for any other order): the fewest forwards, and the fewest
    input-gradient passes (B or I), any device runs in a step up to and including its last B or I; and whether
    any stage runs I (then the first stage's input-gradient pass is empty, as its I is)."""
    if not _is_flushing_chain(schedule):
        return None
    t, p = schedule.table, schedule.num_devices
    rows = np.flatnonzero(t.minibatch == 1)  # each device's in program order: one pass for all of them
    device, kinds = t.device[rows], t.kind[rows]
    backward = kind_mask(kinds, Kind.B, Kind.I)
    last = np.full(p, -1)
    np.maximum.at(last, device[backward], np.flatnonzero(backward))
    if (last < 0).any():
        return None
    upto = np.arange(len(rows)) <= last[device]
    forwards = np.bincount(device[(kinds == KIND_CODE[Kind.F]) & upto], minlength=p)
    return int(np.minimum(forwards, np.bincount(device[backward], minlength=p)).min()), bool(
        np.any(t.kind == KIND_CODE[Kind.I]))


def _stage_waits_ms(profile: Profile) -> np.ndarray:
    """[i, j, kind]: what a stage of layers i .. j-1 waits for its host beyond its layers' times in its F, B, I and W
    (profiles/schema.py `stage_waits_ms`; a first stage's as `_fed_by_the_batch`), 0 in the other kinds: a
    host-bound stage's passes take their kernels' issue, which `_splitter`'s cut balances."""
    n = len(profile.layers)
    waits = np.zeros((n + 1, n + 1, NUM_COMPUTE_KINDS))
    for kind, name in ((Kind.F, "fwd"), (Kind.B, "bwd"), (Kind.I, "igrad"), (Kind.W, "wgrad")):
        waits[:, :, KIND_CODE[kind]] = stage_waits_ms(profile.layers, name, p2p_synced(profile))
    _fed_by_the_batch(waits[0])
    return waits


def _fed_by_the_batch(first_ms: np.ndarray) -> None:
    """A first stage's F, B, I and W in `first_ms` (kinds last) as profiles/schema.py `_summed` has a stage fed by
    the batch alone, in place: its I empty, its W its whole B."""
    first_ms[..., KIND_CODE[Kind.I]], first_ms[..., KIND_CODE[Kind.W]] = 0.0, first_ms[..., KIND_CODE[Kind.B]]


def _splitter(profile: Profile, optimizer: str) -> Callable[..., list[int]]:
    """The memory-capped partitioner with the candidate's own models, cached (candidates share them):
    - time: a stage's compute per step as its schedule runs it, the counts of each op kind per step priced
      from the layers (updates, predictions and averaging shared out by weight bytes, as for any split; the
      all-reduce runs on the network, beside it);
    - memory: P replicas of weights, gradients and optimizer state, the weight versions and micro-batches
      of activations its order holds at most, its policy's extra copies (its master copies as the optimizer owns
      the weights), and an activation and a gradient in transfer at each boundary;
    - the cap: the stages a device runs held together within its memory (`_fits_devices`), as `simulate
      --stage-cut fit` holds them (planning/scenario.py `_within_shares`, `mirrored_partition`); where the fastest
      cut with each stage within the memory does not fit so, the fastest with each stage within its share (1/v of
      a device of v stages), as every cut was held before: a V's first stage holds the most micro-batches, its last
      the fewest (Llama 3.1 8B's DualPipeV at p = 2, t = 2: 40.2 and 24.0 GiB of 80; held to 40 a stage, its cut
      lost 4.6 % a step to simulate's own).
    """
    layers, tied = layer_costs(profile.layers, optimizer), tied_pairs(profile.layers)
    static = range_sums((c.static_bytes for c in layers), tied)
    params = range_sums((layer.param_bytes for layer in profile.layers), tied)
    # the weights as the optimizer owns them, which a policy's master copies are of, as a stage's costs hold them
    owned = range_sums((owned_bytes(layer.param_bytes, *held_weights(profile, i, i + 1, layer.param_bytes))
                        for i, layer in enumerate(profile.layers)), tied)
    activations = activation_ranges(layers)
    # what a split backward's stage holds from its I until its W ends, as the simulator and simulate's fit hold it
    until_w = np.add(*wgrad_held(activations, *wgrad_held_ranges(profile.layers, activations),
                                 WGRAD_ACTIVATION_FRACTION))
    sent = np.array([layer.output_bytes for layer in profile.layers[:-1]] + [0])
    # an activation and a gradient in transfer at each boundary: into the stage's first layer, out of its last
    boundary = 2 * np.concatenate([[0], sent])  # [i]: what layer i receives (and its gradient), as layer i-1 sends
    buffers = boundary[:, None] + boundary[None, :]
    own, least = _own_times(profile), _own_times(profile, least=True)
    each = _each_layer_op_ms(own, optimizer)
    each_least = each if least is own else _each_layer_op_ms(least, optimizer)

    def ranges_ms(op_ms: Callable[[int], np.ndarray], waits: np.ndarray | float = 0.0) -> Callable[[int], np.ndarray]:
        @cache
        def summed(pipelines: int) -> np.ndarray:
            """Each op kind's ms over every range of layers, with `waits`: [i, j, kind]."""
            prefix = np.concatenate([np.zeros((1, NUM_COMPUTE_KINDS)), np.cumsum(op_ms(pipelines), axis=0)])
            return prefix[None, :, :] - prefix[:, None, :] + waits
        return summed

    # what each stage takes, its host's waits with its layers' times; the bound's, its layers' least times alone
    summed_ms, least_ms = ranges_ms(each, _stage_waits_ms(profile)), ranges_ms(each_least)

    @cache
    def split(stages: int, pipelines: int, per_step: tuple[tuple[float, ...], ...], extra_copies: int,
              master_copies: int, held_counts: tuple[tuple[tuple[int, int], ...], ...], lingering: tuple[int, ...],
              device_bytes: int, devices: tuple[tuple[int, ...], ...]) -> list[int]:
        summed = summed_ms(pipelines)
        held = pipelines * static + buffers
        times = cache(lambda weights: summed @ np.array(weights))  # stages that run the same ops share theirs

        def stage_time(k: int) -> np.ndarray:
            return times(per_step[k])

        copies = ((tuple(extra_copies - master_copies + count for count in lingering), params),)
        if master_copies:
            copies += (((master_copies,) * stages, owned),)
        # each stage's micro-batches at once (`_Order.held_counts`): so many with their activations whole, so many more
        # with what their W reads, in a few combinations, a row of memory each
        rows = max(map(len, held_counts))
        stage_bytes = MostOfRanges(tuple(
            ScaledRanges(held, (*copies, *((tuple(counts[min(r, len(counts) - 1)][side] for counts in held_counts),
                                            table) for side, table in ((0, activations), (1, until_w)))))
            for r in range(rows)))
        most_held = max(map(len, devices))
        try:
            cut = partition(layers, stages, device_bytes, stage_bytes, stage_time, devices)
            if most_held == 1 or _fits_devices(stage_bytes, cut, devices, device_bytes):
                return cut
            return partition(layers, stages, device_bytes // most_held, stage_bytes, stage_time, devices)
        except OverCapError as exc:
            return exc.leanest

    def stage_ms(bounds: list[int], pipelines: int) -> np.ndarray:
        """[k, kind]: each layer's least F, B, I and W summed over stage k's layers, stage 0's as a first stage's
        (`_fed_by_the_batch`): no more than the stage's own costs (`profile_costs`: those are additive over a cut,
        its host's waits beyond them at least the least's: `_own_times`), which the search prices only if this bound
        comes up. On the calibrated cut a stage's costs are its own, not its layers' sums: its passes where measured
        (its I and W, which no layer sum bounds: 0.56 ms over stage 0's W on the 2-stage MLP's) and its accumulation
        (fused into B and W: the stage's own pass, which the layers' shares by weight bytes overshoot where the
        unfused weights are elsewhere: 0.017 ms a backward on the 4096-wide 4-layer GPT's stage 1), so there it is
        those costs at the layers' least times. The rest count for nothing (a stage's updates share out its measured
        ones by bytes: their total is the layers', not each stage's)."""
        table = np.zeros((len(bounds) - 1, NUM_COMPUTE_KINDS))
        if list(bounds) == profile.partition.bounds:
            table[:, PASSES] = profile_costs(least, optimizer, bounds).op_ms_table(pipelines)[:, PASSES]
            return table
        table[:, PASSES] = least_ms(pipelines)[bounds[:-1], bounds[1:]][:, PASSES]
        _fed_by_the_batch(table[0])
        return table

    split.stage_ms = stage_ms
    return split


def _fits_devices(stage_bytes: ScaledRanges | MostOfRanges, cut: list[int], devices: Sequence[Sequence[int]],
                  device_bytes: int) -> bool:
    """Whether each device holds the stages it runs (`devices`, per device, as `partition` takes them) of `cut`
    within `device_bytes`, each stage's bytes as `stage_bytes` counts them."""
    return all(sum(stage_bytes.at(k, cut[k], cut[k + 1]) for k in stages) <= device_bytes for stages in devices)


def _each_layer_op_ms(profile: Profile, optimizer: str) -> Callable[[int], np.ndarray]:
    """`Costs.op_ms_table` of `profile_costs` with every layer a stage of its own, for P pipelines, read off the
    layers at once where the layers' own times (`_own_times`: no host waits) are the stages', scaled by the
    contention tail, and the steps' the calibrated stages' totals shared out by parameter bytes (profiles/schema.py
    `_summed`, `_shared_steps`; planning/scenario.py `_stage_costs`), each to the bit: pricing 80 stages one by one
    for each of tune's 85 settings was a tenth of its main process. Where a layer stage would take measured passes,
    the calibrated steps or fused accumulation, `profile_costs` itself."""
    layers, cut = profile.layers, list(range(len(profile.layers) + 1))
    if (cut == profile.partition.bounds or fused_accumulation(profile) or any(layer.host_issue is not None
                                                                              for layer in layers)
            or _passes_measured(profile)):
        return profile_costs(profile, optimizer, cut).op_ms_table
    tail = profile.contention_tail
    steps, average, _, _ = step_totals(profile, (optimizer,))
    (step, predict), share = steps[optimizer], np.array(step_shares(profile, cut))
    table = np.zeros((len(layers), NUM_COMPUTE_KINDS))
    table[:, PASSES] = [[getattr(layer, name).median_ms * tail for name in ("fwd", "bwd", "igrad", "wgrad")]
                        for layer in layers]
    for i, layer in enumerate(layers):
        if not any(0 <= s < i for s in layer.inputs):
            _fed_by_the_batch(table[i])
    table[:, KIND_CODE[Kind.OPT]], table[:, KIND_CODE[Kind.PRED]] = step[0] * share, predict[0] * share
    for kind, name in ((Kind.A2A_F, "all_to_all_fwd_ms"), (Kind.A2A_B, "all_to_all_bwd_ms"),
                       (Kind.RING_F, "ring_fwd_ms"), (Kind.RING_B, "ring_bwd_ms")):
        table[:, KIND_CODE[kind]] = [getattr(layer, name) for layer in layers]
    averaged = average[0] * share

    def op_ms(pipelines: int) -> np.ndarray:
        priced = table.copy()
        priced[:, KIND_CODE[Kind.AVG]] = averaged * pipelines
        return priced
    return op_ms


_OWN_TIMES: dict[tuple[int, bool], Profile] = {}  # `_own_times`, by the profile's identity, kept while it lives
_OWN_LAYERS: dict[tuple[int, bool], LayerProfile] = {}  # `_own_layer`, by the layer's identity, kept while it lives


def _own_times(profile: Profile, least: bool = False) -> Profile:
    """The profile with each layer's passes at its own times, without the issue a stage composes its host's waits
    from (profiles/schema.py `stage_host_waits_ms`): a layer as a stage of its own would wait for its host from its
    own start, or run no faster than its own issue, and a stage of several waits no more than its layers so, so
    their sum would bound it from above. Its own times hold the waits carried from the model's start (none where
    nothing makes a host wait), which a stage starting from an emptier queue does not undercut (`PassIssue`'s map
    is monotone in the lead); a stage none of whose layers synchronises may, floored by its issue alone (a dense
    stage in a dropless MoE model; under `--p2p-sync`, the first stage's forward and the last's backward). `least`:
    those layers' times without their carried waits too, their GPU's, which no stage undercuts: what tune's bound
    sums. Made once per profile, which is immutable, of layers made once each (`_own_layer`)."""
    key = (id(profile), least)
    if key not in _OWN_TIMES:
        carries = any(layer.host_issue is not None and any(passed.carried_ms for passed in layer.host_issue.values())
                      for layer in profile.layers)
        _OWN_TIMES[key] = (profile.model_copy(update={"layers": [_own_layer(layer, least) for layer in profile.layers]})
                           if carries or not least else _own_times(profile))
        weakref.finalize(profile, _OWN_TIMES.pop, key, None)
    return _OWN_TIMES[key]


def _own_layer(layer: LayerProfile, least: bool) -> LayerProfile:
    """`_own_times`' layer, made once per layer, which is immutable: the estimates of one t, b and recomputation at
    every p and d share their layers (planning/estimate.py `LayerMemo`), 48 layer lists in the 324 profiles of a
    70B model's tune."""
    key = (id(layer), least)
    if key not in _OWN_LAYERS:
        issue = layer.host_issue
        _OWN_LAYERS[key] = layer.model_copy(update={"host_issue": None}) if (
            not least or issue is None or issue["fwd"].synchronises) else layer.model_copy(update={
                "host_issue": None,
                **{name: getattr(layer, name).model_copy(update={
                    "median_ms": max(0.0, getattr(layer, name).median_ms - issue[name].carried_ms)})
                   for name in ("fwd", "bwd", "igrad", "wgrad")},
                **{f"{name}_ms": max(0.0, getattr(layer, f"{name}_ms") - issue[name].carried_ms)
                   for name in ("fwd_sharing", "bwd_sharing")}})
        weakref.finalize(layer, _OWN_LAYERS.pop, key, None)
    return _OWN_LAYERS[key]


def _ops_per_step(schedule: Schedule) -> np.ndarray:
    """Per model stage and compute kind (F, B, I, W, OPT, PRED, AVG), how many run per step."""
    t = schedule.table
    counts = np.bincount(t.stage * NUM_COMPUTE_KINDS + t.kind, minlength=schedule.num_stages * NUM_COMPUTE_KINDS)
    return counts.reshape(schedule.num_stages, NUM_COMPUTE_KINDS) / schedule.minibatches


def _held(schedule: Schedule) -> tuple[int, tuple[int, ...]]:
    """From the order alone: the largest staleness, and per stage the most superseded weight versions it keeps."""
    t = schedule.table
    read, copies_delta = version_reads(schedule)
    reads = kind_mask(t.kind, Kind.F, Kind.B, Kind.I, Kind.W) & (read >= 0)
    staleness = int(np.max(t.minibatch[reads] - read[reads], initial=0))
    lingering = peak_per_stage(t, np.zeros(len(t.kind), dtype=np.int64), copies_delta, schedule.num_stages)
    return staleness, tuple(lingering.tolist())


def _in_flight(schedule: Schedule) -> tuple[int, ...]:
    """From the order alone: per stage the most micro-batches whose full activations it holds (forward until B
    or I)."""
    t = schedule.table
    return tuple(peak_per_stage(t, (t.kind == KIND_CODE[Kind.F]).astype(np.int64),
                                -kind_mask(t.kind, Kind.B, Kind.I).astype(np.int64), schedule.num_stages).tolist())


def _depths(devices: int, layers: int, data_parallel: bool) -> list[int]:
    """Pipeline depths p: divisors of D with a layer per stage; D alone when all-reduce can't be costed."""
    return [p for p in range(1, min(devices, layers) + 1) if devices % p == 0 and (data_parallel or p == devices)]


def _placed_depths(setting: Setting, devices: int) -> list[int]:
    """The setting's depths p (`_depths`, of D/t) whose d = D/(p·t) replicas hold the expert-parallel ranks its
    estimate was made with (schedules/ranks.py `estimated_experts_refusal`: a --profile estimated at E = 8 planned
    at d = 4 was a traceback), as many on a node as the estimate priced its all-to-alls at (`experts_moved`: a
    group that crosses nodes at one p and not at another was planned on the first's price)."""
    profile, t = setting.scenario.measured, setting.tensor
    if devices % t:
        return []
    return [p for p in _depths(devices // t, most_stages(profile.layers), _prices_data_parallel(profile))
            if estimated_experts_refusal(profile.estimated_parallelism, p, devices // (p * t)) is None
            and (profile.estimate is None or experts_moved(profile.estimate, p, devices // (p * t)) is None)]


def _prices_data_parallel(profile: Profile) -> bool:
    """Whether the profile prices a data-parallel all-reduce: an estimate's link, or measured all-reduce times."""
    return profile.estimate is not None or bool(profile.allreduce and profile.allreduce.points)


def _nothing_to_search(settings: list[Setting], problem: Problem, shapes: int, refusals: dict[str, str]) -> str:
    """Why there is nothing to search, in one line: no depth, no whole micro-batches, or each method's first
    refusal (`_Orders.refusals`)."""
    profile = settings[0].scenario.measured  # the model's layers are the same in every setting
    sizes = " or ".join(f"{b:,}" for b in sorted({setting.microbatch_size for setting in settings}))
    if not any(_placed_depths(s, problem.devices) for s in settings):
        experts = profile.estimated_parallelism.get("expert", 1)
        placed = (", as the profile has no all-reduce times, equal D" if experts == 1 else
                  " leave d = D/(p·t) replicas over which the profile's rank order places the "
                  f"E = {experts:,} expert-parallel ranks it was estimated with, as many on a node as its "
                  f"all-to-alls were priced at (p = {profile.estimate.degrees[1]:,}, d = "
                  f"{profile.estimate.degrees[2]:,})")
        return (f"no pipeline depth p: p must divide --devices {problem.devices:,}, be at most the model's "
                f"{layers_text(profile.layers)} and{placed}")
    if not shapes:
        return (f"no configuration: the batch of {problem.batch_size:,} samples must split into whole "
                f"micro-batches of {sizes} over r = D/p replicas and P pipelines for some pipeline depth p dividing "
                f"{problem.devices:,} (p <= {layers_text(profile.layers)}); change --batch-size or --devices")
    why = "; ".join(text if text.startswith(f"{name}:") else f"{name}: {text}" for name, text in refusals.items())
    verb = "refuses" if len(problem.schedules) == 1 else "refuse"
    return (f"no configuration: {', '.join(problem.schedules)} {verb} every shape with a batch of "
            f"{problem.batch_size:,} samples on {problem.devices:,} devices ({why}); try other schedules or "
            "--batch-size")


# The choice's note where no cut for time fits the cap (`_search`) and a leanest cut does (`_fastest_leanest`), or
# one cut again for the cap less what its cut for time overran it by (`_fastest_tightened`)
LEANEST_NOTE = ("no configuration cut for time within the cap fits it once the caching allocator's reserve is added: "
                "the choice is the fastest configuration that fits on its leanest cut (none cut again for the cap "
                "less what its cut for time overran it by fits and is faster)")
TIGHTENED_NOTE = ("no configuration cut for time within the cap fits it once the caching allocator's reserve is "
                  "added: the choice is cut again for the cap less what its cut for time overran it by, the fastest "
                  "that fits so or on its leanest cut")
TIGHTENINGS = 3  # cuts again per configuration, each for the cap less what the last overran it by


def _fastest_leanest(settings: list[Setting], problem: Problem) -> tuple[Result, int]:
    """The fastest configuration that fits the cap as simulated, each cut into its leanest split (a cap of 0
    leaves no other), and how many it simulated to find it (`Stats.simulated_leanest`). The partitioner holds a cut
    to the cap by the tensors it counts, which the caching allocator's reserve adds to, so a leanest cut may fit
    where no cut for time did (a 16,384-token GPT's DualPipeV at 13 GiB: 11.4 GiB on its leanest cut, 14.4 on its
    cut for time). Best bound first, as `top_groups`, among those whose memory floor is within the cap, until no
    bound left can beat the fastest that fits (a tie ranks by `rank_key`); TuneError naming the least memory any
    needs (`_least_memory`) where none fits, or where no configuration is within the staleness limit."""
    lean = replace(problem, memory_cap_bytes=0)
    every = prepare(settings, lean)[0]
    candidates = [c for c in every if c.staleness <= problem.max_staleness]
    searched = _searched_within_cap(problem)
    if not every and searched:  # a searched order has no leanest cut: it fills what it is given
        others = [name for name in problem.schedules if not METHODS[name].needs_costs]
        rest = (f"{', '.join(others)} {'refuses' if len(others) == 1 else 'refuse'} every shape" if others else
                "no other method was given")
        raise TuneError(f"{nothing_fits_text(problem.memory_cap_bytes, problem.gpus, problem.memory_part)}: "
                        f"{searched}, and {rest}: give more memory, or add methods (-s 1f1b, ...)")
    if not candidates:
        raise TuneError(f"no configuration has staleness <= {problem.max_staleness:,}; raise --max-staleness or add "
                        "synchronous schedules")
    fastest, simulated = None, {}  # the results by id(candidate), which `_least_memory` reads again
    for candidate in sorted(candidates, key=lambda c: -c.max_samples_per_s):
        if fastest is not None and speed_key(candidate.max_samples_per_s) < speed_key(fastest.samples_per_s):
            break
        if candidate.memory_floor_bytes > problem.memory_cap_bytes:
            continue
        result = simulated[id(candidate)] = evaluate(lean, candidate)
        if allowed(result, problem) and (fastest is None or rank_key(result) < rank_key(fastest)):
            fastest = result
    if fastest is None:
        stale = [c for c in every if c.staleness > problem.max_staleness]
        leanest_stale = _least_memory(lean, stale, {}) if stale else None
        raise TuneError(_nothing_fits(_least_memory(lean, candidates, simulated), problem, leanest_stale))
    return fastest, len(simulated)


def _fastest_tightened(shapes: list[Shape], built: _Built, problem: Problem, leanest: Result) -> tuple[Result | None,
                                                                                                   int]:
    """Where no cut for time fits the cap once simulated and `leanest` is the fastest that fits on its leanest cut
    (`_fastest_leanest`): each configuration of a fixed order whose cut for time was simulated over the cap and is
    faster, fastest first, cut again for the cap less what its cut overran it by (the caching allocator's reserve,
    which the partitioner does not count), up to `TIGHTENINGS` times, until a cut fits or can no longer win (a cut as
    before is not simulated again); the fastest that fits and beats `leanest` (None: none), and how many it
    simulated. (Those whose tensors alone pass the cap, never simulated with the reserve, are not cut again.) Without
    it a cap raised chose slower: the 8B Llama's 1F1B at 41 GiB cut for time 18 | 17 over it, then its leanest 15 |
    20 at 13.1 samples/s, where 40 GiB gave 17 | 18 at 14.4."""
    fastest, simulated = None, 0
    over = [(built.results[shape.index], shape) for shape in shapes if shape.index in built.results
            and not METHODS[shape.config.schedule].needs_costs]  # a searched order fills the cap it is cut for
    over = [(result, shape) for result, shape in over
            if result.staleness <= problem.max_staleness and not allowed(result, problem)]
    for result, shape in sorted(over, key=lambda pair: rank_key(pair[0])):
        cap, bounds = problem.memory_cap_bytes, result.candidate.bounds
        for _ in range(TIGHTENINGS):
            if rank_key(result) >= rank_key(fastest or leanest):  # a leaner cut is no faster
                break
            cap -= result.peak_memory_bytes - problem.memory_cap_bytes
            try:
                candidate = _candidate(shape.setting, replace(problem, memory_cap_bytes=max(cap, 0)), shape.config,
                                       shape.index, _split_for(shape.setting), built.orders,
                                       built.frame_links(shape.setting, shape.config))
            except ScheduleError:
                break
            if candidate.memory_floor_bytes > problem.memory_cap_bytes:
                break
            if candidate.bounds == bounds:  # the same cut: the cap lowered by its overrun again, not simulated again
                continue
            result, bounds, simulated = evaluate(problem, candidate), candidate.bounds, simulated + 1
            if allowed(result, problem):
                if rank_key(result) < rank_key(fastest or leanest):
                    fastest = result
                break
    return fastest, simulated


def _least_memory(lean: Problem, candidates: list[Candidate], simulated: dict[int, Result]) -> Result:
    """The candidate that needs the least memory on its leanest cut (`lean`'s cap of 0): simulated lowest memory
    floor first, until the floors pass the least peak found; those `simulated` already (by id) not again."""
    least = None
    for candidate in sorted(candidates, key=lambda c: c.memory_floor_bytes):
        if least is not None and candidate.memory_floor_bytes >= least.peak_memory_bytes:
            break
        result = simulated.get(id(candidate)) or evaluate(lean, candidate)
        if least is None or (result.peak_memory_bytes, rank_key(result)) < (least.peak_memory_bytes, rank_key(least)):
            least = result
    return least


def _nothing_fits(least: Result, problem: Problem, leanest_stale: Result | None = None) -> str:
    """Why nothing within the limits fits the cap: the least memory any configuration within the staleness limit
    needs, and where the leanest staler one (`leanest_stale`) fits, that it does and what allows it (`tune -s
    pipedream` said only that p = 1, the one shape of staleness 0, needs 0.41 GiB, where p = 2 fits in 0.287)."""
    more_digits = digits_apart(least.peak_memory_bytes, problem.memory_cap_bytes, memory_text)
    searched = _searched_within_cap(problem)
    said = (f"{nothing_fits_text(problem.memory_cap_bytes, problem.gpus, problem.memory_part, more_digits)}; the "
            f"least memory {'a fixed order' if searched else 'any'} needs is "
            f"{memory_text(least.peak_memory_bytes, more_digits)} per device ({least.config.label()}, "
            f"{degree_text('m', least.config.microbatches)})" + (f"; {searched}" if searched else ""))
    if leanest_stale is None or leanest_stale.peak_memory_bytes > problem.memory_cap_bytes:
        return said
    limit, staleness = problem.max_staleness, leanest_stale.staleness
    return (f"{said} at staleness {limit:,}{' or less' if limit else ''}; {leanest_stale.config.label()} fits in "
            f"{memory_text(leanest_stale.peak_memory_bytes)} at staleness {staleness:,}: --max-staleness "
            f"{staleness:,} allows it")


def _searched_within_cap(problem: Problem) -> str:
    """What a refusal says of the methods given whose order is searched within the cap (auto), which have no least
    memory of their own to name (their order fills what the cap leaves, at each cap another): "" where none was
    given."""
    searched = [name for name in problem.schedules if METHODS[name].needs_costs]
    return (f"{' and '.join(searched)}, searched within the cap, found no order that fits it as simulated"
            if searched else "")


def nothing_fits_text(memory_cap_bytes: int, gpus: int, part: str | None, more_digits: int = 0) -> str:
    """A refusal's start where no configuration fits the cap, naming the flag that set it: --memory-gb (`part` None),
    else --devices, the `gpus` of the catalogue `part` whose own memory is the cap (tune --gpu without --memory-gb),
    as the user gave no --memory-gb to change; the cap to the digits (`more_digits`) at which the memory the refusal
    goes on to give reads over it."""
    cap = memory_text(memory_cap_bytes, more_digits)
    if part is None:
        return f"--memory-gb: no configuration fits in {cap}"
    return f"--devices {gpus:,}: no configuration fits on {gpus:,} {part} of {cap}"


def _notes(settings: list[Setting], problem: Problem) -> list[str]:
    profile = settings[0].scenario.measured
    notes = []
    if not _prices_data_parallel(profile) and problem.devices > 1:
        notes.append("the profile has no all-reduce times: data parallelism can't be costed, so p = D only")
    if profile.link is None:
        notes.append("the profile has no link times: transfers between devices are free")
    estimated = profile.estimate.parallelism if profile.estimate is not None else {}
    if estimated.get("sharded_optimizer") and not problem.zero:
        ranks = estimated.get("data", 1) * estimated.get("context", 1)  # C ranks shard as d do
        zero = "--zero 3 --precision fsdp2" if estimated.get("precision") == "fsdp2" else "--zero 1"
        notes.append(f"the profile was estimated sharded over {ranks:,} ranks ({zero}), which tune --profile does "
                     f"not shard: each replica here holds the whole optimizer state; --gpu with --model and {zero} "
                     "searches it sharded")
    return notes


def _staler_note(staler: Row, choice: Result, unsimulated: StalerBound | None = None) -> str:
    """What the staleness limit costs: which configuration it rules out, how much faster (and, where stale
    candidates were left unsimulated, how much faster at most by their bounds), how to allow it."""
    result = staler.result
    gain = result.samples_per_s - choice.samples_per_s
    same = f" (same as {', '.join(twin.label() for twin in staler.twins)})" if staler.twins else ""
    most = (f", up to {_percent(unsimulated.max_samples_per_s / choice.samples_per_s - 1)} more by the bounds of the "
            f"{count_text(unsimulated.configurations, 'stale configuration')} not simulated" if unsimulated else "")
    return (f"at staleness {result.staleness}, {result.config.label()}{same} fits and gives "
            f"{rate_text(result.samples_per_s)} samples/s, {_percent(gain / choice.samples_per_s)} ({rate_text(gain)}) "
            "more than "
            f"{choice.config.label()}{most}; it trains on stale weights: --max-staleness {result.staleness} allows it")


def memory_text(nbytes: float, more_digits: int = 0, zeros: bool = False) -> str:
    """GiB, the unit of --memory-gb, to three significant digits (and `more_digits`), whole GiB never rounded away
    and thousands separated ("1,234 GiB", in the peak column and the cap alike), never in e-notation; `zeros` keeps
    the zeros after the point, as a column writes its figures one under another: tune's peak read "19 GiB" under
    "19.4 GiB", as if cut."""
    gib = nbytes / GIB
    if gib <= 0:
        return "0 GiB"
    exponent = int(f"{gib:.{2 + more_digits}e}".split("e")[1])  # of the figure rounded: 99.96 is 100
    text = f"{gib:,.{max(0, 2 + more_digits - exponent)}f}"
    return (text if zeros or "." not in text else text.rstrip("0").rstrip(".")) + " GiB"


def significant_ms_text(value: float, more_digits: int = 0) -> str:
    """ms to three significant digits under 100 ms, whole from 100 up (each with `more_digits` more): tune's
    explanations and lines set configurations' figures side by side, which `_apart` widens digit by digit until two
    read apart. Not traces/metrics.py's `ms_text`, which writes every figure of a page to the microsecond, a trace's
    resolution."""
    return f"{value:,.{more_digits}f}" if value >= 100 else f"{value:.{3 + more_digits}g}"


def digits_apart(figure: float, against: float, text: Callable[[float, int], str]) -> int:
    """The fewest more digits (up to 3) at which `text` writes the two figures apart: figures that explain why a
    result lost, or why nothing fits, must show the difference ("busiest device 6,742 vs 6,742", "over memory:
    0.3 GiB > 0.3 GiB")."""
    return next((more for more in range(3) if text(figure, more) != text(against, more)), 3)


def _apart(figure: float, against: float, text: Callable[[float, int], str] = significant_ms_text,
           between: str = "vs") -> str:
    """"figure vs against" (or `between` them) as `text` writes them, apart (`digits_apart`)."""
    more_digits = digits_apart(figure, against, text)
    return f"{text(figure, more_digits)} {between} {text(against, more_digits)}"


def _percent(fraction: float) -> str:
    """A difference as every table writes a share (`percent_text`: "1.0% slower" beside "1.7% slower", where two
    significant digits wrote "1%", and "12.2%" where they wrote "12%"); one that would read "0.0%" reads "under
    0.1%", as the pages write a small share, so that what decided a rank never reads as no difference."""
    return "under 0.1%" if 0 < fraction < 0.0005 else percent_text(fraction)
