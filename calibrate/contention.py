"""How much ranks computing at once on one CPU host slow each other, measured into a `ContentionProfile`.

Layers are calibrated one process alone, but the ranks of a run share the host's cores, caches and memory
bandwidth (and oversubscribe the cores when ranks x threads exceed them): ranks computing side by side can
each take longer than alone, while a rank waiting in a receive costs its peers nothing. So
`pipesim calibrate` measures in as many processes as the run has ranks (at least two), started once: the ranks
of its run of the calibrated model where that has as many (`ContentionProbe.prelude`: the measurement runs in
them before the run, sharing their start-up), else processes of its own. Process r builds the calibrated model
at the calibrated thread count, dtype and micro-batch size, and repeats a rank's F and B of stage r mod p, as the
executor runs them (passes.py). In each of up to ROUNDS rounds the parent first lets
each run alone for a window while the others block, then the first k run together for k = 2 .. K; a ratio is
taken within its round, and the factor is the median over rounds, so one slow spell of a shared host (it once
made two at once measure 1.84x, against 1.09-1.14x in the minutes before and after) sets none. The rounds stop
after MIN_ROUNDS when those agree (`rounds_agree`): a slow spell in one of them shows as disagreement, and the
next round outvotes it. Windows start and end on
the host's monotonic clock, so every kept iteration overlaps the other k - 1 computing; each window drops its
warm-up (`Windows`: waking up, cold caches, until every rank's first iteration has ended) and any iteration
running past its end, and is long enough for MIN_ITERATIONS of the slowest stage's iterations with k at once
slowed as much as they oversubscribe the host's usable cores (k x threads over cores, at least 1; WINDOW_S at
least).

A rank's time is its mean iteration, not the median: with more processes than cores, an iteration shorter than
the scheduler's time slice mostly runs undisturbed and a few absorb the whole wait (3 one-thread processes on 2
cores: median 1.07x alone, mean 1.7x), and the mean is the rate a rank advances at, which the simulator's
processor sharing prices. `tail` is a rank's mean iteration alone over its median in the process's CPU time (the
median over its solo windows, each taken within its round): the stage passes calibration times are medians, and
the simulator prices them at their mean, so the tail is what the pass itself costs now and then beyond its median
(a cold cache, a first allocation, a page fault). Not its wall time: a rank alone on a host whose other work keeps
the cores busy spends most of its wall time waiting for a core, and a busy loop's few long waits set that mean
(docs/auto.md's --width 16 mlp at others' load 0.81-0.92 per core: 3.2-7.5x the median over four calibrations; CPU
time 1.06-1.07 over three): a share of the cores that moves with the others' load from minute to minute, which the
others' CPU time cannot tell apart once they fill the cores, that a run's rank, which sleeps in its receives, waits
for less than a busy loop does, and that no other calibrated term holds (compare says when the host was busy).
`slowdown[k - 1]` is the median over rounds of the median over the k processes of their mean with k over their
mean alone in the same round; `spread[k - 1]` the interquartile range of the same ratio taken over each fifth of
every window (BLOCKS runs of consecutive iterations), pooled over the k and the rounds.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Mapping
from contextlib import nullcontext, suppress
from dataclasses import asdict, dataclass, field
from functools import partial
from typing import Any

import numpy as np
import torch

from ..executor import Prelude
from ..profiles.schema import ContentionProfile, Profile
from ..traces.hostload import HostLoad, mark
from ..workload.processes import rank_context, rank_process, start_processes
from .measure import DTYPES, Advance, PhaseLine, place
from .passes import stage_runs

WINDOW_S = 0.25  # the shortest window: about 35 iterations after the warm-up of the default mlp's stage (b 16);
# as reproducible as 0.5 s within the noise of the host (benchmarks/contention_settings.py), in half the time
WARMUP_S = 0.1  # dropped at the start of every window at least ...
WARMUP_ITERATIONS = 1.25  # ... and this many of the slowest stage's iterations: every rank's first one has ended
# by then (2 ranks of the default gpt: a kept iteration overlapping the other's first, cold, one took 2-6 % longer)
BLOCKS = 5  # runs of consecutive iterations per window whose ratios give the spread
ROUNDS = 3  # of alone and together windows at most, each ratio taken within its round
MIN_ROUNDS = 2
AGREEMENT = 0.03  # rounds whose ratios differ by at most this (relative) need no round to outvote one
MIN_ITERATIONS = 2  # a window keeps this many of the slowest stage's iterations, and room for one running past
PRIMING_ITERATIONS = 1  # untimed, once per process, before any window (first allocations, lazy set-up; each
# window drops its own cold start)
LEAD_S = 0.05  # from posting a window to its start: every process has its command by then
START_TIMEOUT_S = 120.0  # spawning, importing torch and building the model, on a loaded machine
ANSWER_SLACK_S = 30.0  # beyond a window's end (and one more window for an iteration running past it)
STOP_GRACE_S = 3.0
WINDOW_TRIES = 4  # a window no iteration of some rank fitted in is taken again, twice as long each time
TAIL_FROM = "process CPU time"  # what `pass_tail` reads (the cache key holds it: a tail kept from wall time differs)


class ContentionError(RuntimeError):
    """A measurement process that failed, died or stopped answering; one line naming it."""


@dataclass(frozen=True)
class _Job:
    """What every process rebuilds: the model as the calibration built it, and how it was timed."""

    model: str
    options: dict[str, int]
    dtype: str
    microbatch_size: int
    threads: int
    bounds: list[int]


def processes_for(ranks: int) -> int:
    """One process per rank of the run; two at least, to have something to share with."""
    return max(2, ranks)


def rounds_agree(rounds: list[Round]) -> bool:
    """The stopping rule: at least MIN_ROUNDS rounds, and for every k the ratios of the rounds so far within
    AGREEMENT of each other (relative to the smallest)."""
    if len(rounds) < MIN_ROUNDS:
        return False
    _, by_round = measured_slowdowns(rounds)
    ratios = np.asarray(by_round)  # rounds x (k = 2 .. K)
    return bool(np.all(ratios.max(axis=0) <= ratios.min(axis=0) * (1 + AGREEMENT)))


def slowdowns(measured: list[float]) -> list[float]:
    """The slowdowns to price from the measured ratios (k = 1, 2, ...): more ranks computing at once never
    advance faster than fewer, so a ratio below the one before is the host's noise (a neighbour's load during
    the solo windows: 0.81 with two at once was measured so) and takes the one before."""
    return np.maximum.accumulate(np.asarray(measured, dtype=float)).tolist()


# One round's iteration times (ms): per rank, alone; per k = 2 .. K, per rank of the first k, with k at once.
Round = tuple[list[list[float]], list[list[list[float]]]]


def measured_slowdowns(rounds: list[Round]) -> tuple[list[float], list[list[float]]]:
    """Per k = 1, 2, ...: the median over rounds of the median over the k processes of their mean iteration
    with k at once over their mean alone in the same round (1 for k = 1); and each round's ratios (k >= 2)."""
    by_round = [[float(np.median([np.mean(ms) / np.mean(solo) for ms, solo in zip(times, alone)]))
                 for times in together] for alone, together in rounds]
    return [1.0] + np.median(by_round, axis=0).tolist(), by_round


def measure_contention(profile: Profile, model: str, options: Mapping[str, int | None],
                       advance: Advance = lambda what: None, ranks: int | None = None) -> ContentionProfile:
    """Measure `profile`'s stages slowing each other on this CPU host, in processes of its own
    (`ContentionProbe` says what is measured)."""
    probe = ContentionProbe(profile, model, options, advance, ranks)
    probe.run()
    return probe.result()


class ContentionProbe:
    """One contention measurement of `profile`'s stages on this CPU host; `model` and `options` are what the
    calibration built it from (`build_model`'s arguments: a user's `package.module:attr` too). `ranks`: the most
    ranks a run of the profile will have (default: one per stage; AvgPipe's pipelines have more), since beyond the
    measured count the simulator can only hold the last factor. It runs in `count` processes of its own (`run`),
    or first thing in the ranks of an executor run with one rank per process it needs (`prelude`), which then
    share their start-up with the run's; `result()` gives the profile's factors."""

    def __init__(self, profile: Profile, model: str, options: Mapping[str, int | None],
                 advance: Advance = lambda what: None, ranks: int | None = None) -> None:
        env = profile.environment
        if env.device != "cpu":
            raise ContentionError(f"contention is measured on CPU hosts only (the profile is for {env.device})")
        self.count = processes_for(ranks or profile.partition.stages)
        self.job = _Job(model, {key: value for key, value in options.items() if value is not None}, env.dtype,
                        env.microbatch_size, env.threads, list(profile.partition.bounds))
        self.layers = [[layer.name, layer.param_bytes] for layer in profile.layers]
        self.windows = Windows(max(stage.fwd_ms + stage.bwd_ms for stage in profile.stages) / 1e3, env.threads)
        self.window_s = [self.windows.length_s(k) for k in range(1, self.count + 1)]
        self.advance = advance
        self.rounds: list[Round] = []
        self.solo_cpu_ms: list[list[list[float]]] = []  # per round, per rank alone: its kept iterations' CPU time
        self.retaken: list[float] = []  # the lengths of the windows taken again
        self.processes = "its own"  # or "the ranks of the run it preceded" (`prelude`)
        self.load: HostLoad | None = None  # the host's load over `measure`

    def run(self) -> None:
        """Measure in `count` processes of its own, started here and ended before it returns."""
        context = rank_context()
        pipes = [context.Pipe() for _ in range(self.count)]
        procs = [rank_process(context, _worker, (self.job, theirs, rank), f"pipesim-contention-{rank}",
                              self.job.threads)
                 for rank, (_, theirs) in enumerate(pipes)]
        conns = [ours for ours, _ in pipes]
        try:
            self.advance(f"contention: starting {self.count} processes")
            start_processes(procs, self.job.threads)
            for _, theirs in pipes:
                theirs.close()  # the parent keeps only its own ends, so a process that dies reads as EOF
            self.measure(conns, procs)
        finally:
            _stop(procs, conns)

    @property
    def done(self) -> bool:
        return bool(self.rounds)

    def cache_key(self) -> dict[str, Any]:
        """What the factors depend on beyond the host (calibrate/cache.py adds it): the workload each process
        runs, down to its layers' names and weights, the processes, and how the windows are taken."""
        return {"workload": asdict(self.job), "layers": self.layers, "processes": self.count,
                "windows": {"min_s": WINDOW_S, "warmup_s": WARMUP_S, "warmup_iterations": WARMUP_ITERATIONS,
                            "min_iterations": MIN_ITERATIONS, "slowed_by": "oversubscription", "tail_from": TAIL_FROM,
                            "rounds": [MIN_ROUNDS, ROUNDS], "agreement": AGREEMENT, "blocks": BLOCKS}}

    def prelude(self, phase: PhaseLine = lambda title: nullcontext([])) -> Prelude:
        """The measurement as the prelude of an executor run with `count` ranks (`run_multiprocess(...,
        prelude=)`), inside `phase(title)`."""
        def measure(conns: list[Any], procs: list[Any]) -> None:
            with phase(f"measuring contention in the run's {self.count} ranks, before it"):
                self.measure(conns, procs)
            self.processes = "the ranks of the run it preceded"
        return Prelude(rank=partial(_worker, self.job), parent=measure)

    def measure(self, conns: list[Any], procs: list[Any]) -> None:
        """The windows, round by round, with the started processes `procs` (each running `_worker`) over their
        pipes `conns`: once each has answered ready, each alone, then 2, 3, ... at once, until the rounds agree
        or ROUNDS are taken; then each process is told to stop measuring."""
        def window(ranks: range) -> list[Kept]:
            """Per rank, its kept iterations in one window where `ranks` compute at once; a window in which a
            rank finished no iteration (a host so loaded that it hardly ran) is taken again, twice as long, up to
            WINDOW_TRIES times."""
            for attempt in range(WINDOW_TRIES):
                length_s = self.window_s[len(ranks) - 1] * 2 ** attempt
                start_s = time.monotonic() + LEAD_S
                for rank in ranks:
                    conns[rank].send((start_s, start_s + self.windows.warmup_s(len(ranks)), start_s + length_s))
                kept = [Kept(*_answer(conns[rank], procs[rank], rank,
                                      start_s + 2 * length_s + ANSWER_SLACK_S - time.monotonic())) for rank in ranks]
                idle = [rank for rank, iterations in zip(ranks, kept) if not iterations.wall_ms]
                if not idle:
                    return kept
                self.retaken.append(length_s)
            raise ContentionError(f"contention measurement: process {idle[0]} finished no iteration in a "
                                  f"{length_s:g} s window (is the host overloaded?)")

        start = mark()
        self.advance(f"contention: {self.count} processes getting ready")
        for rank in range(self.count):
            _answer(conns[rank], procs[rank], rank, START_TIMEOUT_S)
        for number in range(1, ROUNDS + 1):
            alone = []
            for rank in range(self.count):
                self.advance(f"contention: round {number}/{ROUNDS}, process {rank} alone")
                alone += window(range(rank, rank + 1))
            together = []
            for k in range(2, self.count + 1):
                self.advance(f"contention: round {number}/{ROUNDS}, {k} processes at once")
                together.append([kept.wall_ms for kept in window(range(k))])
            self.rounds.append(([kept.wall_ms for kept in alone], together))
            self.solo_cpu_ms.append([kept.cpu_ms for kept in alone])
            if rounds_agree(self.rounds):
                break
        for conn in conns:
            conn.send(None)
        self.load = HostLoad.since(start, self.count * self.job.threads)

    def result(self) -> ContentionProfile:
        """The factors from the rounds `measure` took."""
        rounds, count, job = self.rounds, self.count, self.job
        stages = len(job.bounds) - 1
        pooled = [np.concatenate([alone[rank] for alone, _ in rounds]) for rank in range(count)]
        solo_ms = [float(np.mean(ms)) for ms in pooled]
        solo_median_ms = [float(np.median(ms)) for ms in pooled]
        # window by window (pooled over rounds, the host's drift between them would pass for a tail)
        solo_tails = [[pass_tail(ms) for ms in alone] for alone in self.solo_cpu_ms]
        tail = float(np.median(solo_tails))
        measured, by_round = measured_slowdowns(rounds)
        slowdown = slowdowns(measured)
        # per number of processes at once, from 1 (each rank alone): each block's mean over its rank's mean alone
        # in the same round
        windows = [[alone, *together] for alone, together in rounds]
        blocks = [np.concatenate([_block_means(ms) / np.mean(solo) for by_count in windows
                                  for ms, solo in zip(by_count[index], by_count[0])])
                  for index in range(count)]
        spread = [float(np.subtract(*np.percentile(ratios, [75, 25]))) for ratios in blocks]
        meta = {"processes": count, "processes_started": self.processes, "threads_per_process": job.threads,
                "window_s": self.window_s[-1], "window_s_by_count": self.window_s,
                "warmup_s": self.windows.warmup_s(count),
                "warmup_s_by_count": [self.windows.warmup_s(k) for k in range(1, count + 1)],
                "cpu_count": os.cpu_count(),
                "cpus_usable": _usable_cpus(),
                "workload": {"model": job.model, "options": job.options, "bounds": job.bounds, "dtype": job.dtype,
                             "microbatch_size": job.microbatch_size,
                             "stages": [rank % stages for rank in range(count)],
                             "pass": "forward and full backward, as the executor runs them"},
                "solo_ms": [round(ms, 4) for ms in solo_ms],
                "solo_median_ms": [round(ms, 4) for ms in solo_median_ms],
                "solo_tail_by_round": [[round(t, 4) for t in tails] for tails in solo_tails],
                "tail_from": TAIL_FROM,
                "measured_slowdown": [round(r, 4) for r in measured], "rounds": len(rounds),
                "windows_retaken": self.retaken,
                "measured_slowdown_by_round": [[round(r, 4) for r in ratios] for ratios in by_round],
                "iterations": [[[len(ms) for ms in times] for times in by_count] for by_count in windows]}
        return ContentionProfile(slowdown=[round(s, 4) for s in slowdown], spread=[round(s, 4) for s in spread],
                                 tail=round(tail, 4), meta=meta)


@dataclass(frozen=True)
class Windows:
    """How long a window with k ranks computing lasts, and its warm-up, from the slowest stage's iteration alone
    (`iteration_s`) and the threads each rank runs: with k at once an iteration is taken to last as much longer
    as the k oversubscribe the usable cores (on 2 cores, two one-thread ranks of the default gpt measured 1.00-1.03x,
    and windows sized for 2x were twice what they needed)."""

    iteration_s: float
    threads: int
    cpus: int = field(default_factory=lambda: _usable_cpus() or 1)  # the host's usable cores, asked once

    def slowed_s(self, k: int) -> float:
        """The slowest stage's iteration with k ranks computing."""
        return self.iteration_s * max(1.0, k * self.threads / self.cpus)

    def warmup_s(self, k: int) -> float:
        """Dropped at a window's start: WARMUP_S, or WARMUP_ITERATIONS slowest iterations where longer."""
        return max(WARMUP_S, WARMUP_ITERATIONS * self.slowed_s(k))

    def length_s(self, k: int) -> float:
        """The warm-up, MIN_ITERATIONS kept iterations and one running past the end; WINDOW_S at least."""
        return max(WINDOW_S, self.warmup_s(k) + (MIN_ITERATIONS + 1) * self.slowed_s(k))


@dataclass(frozen=True)
class Kept:
    """One rank's kept iterations in one window: each one's wall time (ms, the monotonic clock), which the
    slowdowns read, and its process's CPU time over it (ms), which `pass_tail` reads."""

    wall_ms: list[float]
    cpu_ms: list[float]


def pass_tail(cpu_ms: list[float]) -> float:
    """A rank's mean iteration over its median in one solo window, in its process's CPU time: what its pass costs
    now and then beyond the median calibration prices (a cold cache, a first allocation). A wait for a core costs
    no CPU time, so the others' load, which sets a busy loop's wall-time mean (module docstring), sets none of it."""
    return float(np.mean(cpu_ms) / np.median(cpu_ms))


def _block_means(ms: list[float]) -> np.ndarray:
    """The mean iteration of each of BLOCKS runs of consecutive iterations (fewer when there are fewer)."""
    return np.array([block.mean() for block in np.array_split(np.asarray(ms), min(BLOCKS, len(ms)))])


def _usable_cpus() -> int | None:
    """The cores this process may run on (a container's or taskset's share), where the OS says."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()


def _answer(conn: Any, proc: Any, rank: int, timeout_s: float) -> Any:
    """Process `rank`'s next answer, or ContentionError when it fails, dies or says nothing for `timeout_s`."""
    if not conn.poll(max(timeout_s, 0.0)):
        raise ContentionError(f"contention measurement: process {rank} gave no answer within {timeout_s:.0f} s")
    try:
        what, value = conn.recv()
    except EOFError:
        proc.join(STOP_GRACE_S)
        raise ContentionError(f"contention measurement: process {rank} exited with code {proc.exitcode}") from None
    if what == "error":
        raise ContentionError(f"contention measurement: process {rank} failed: {value}")
    return value


def _stop(procs: list[Any], conns: list[Any]) -> None:
    """Every started process ends: told to, then SIGTERM after a grace, then SIGKILL; all reaped."""
    for conn in conns:
        with suppress(OSError):
            conn.send(None)
    started = [proc for proc in procs if proc.pid is not None]
    deadline = time.monotonic() + STOP_GRACE_S
    for proc in started:
        proc.join(max(0.0, deadline - time.monotonic()))
    for proc in started:
        if proc.is_alive():
            proc.terminate()
            proc.join(STOP_GRACE_S)
        if proc.is_alive():
            proc.kill()
            proc.join(STOP_GRACE_S)
    for conn in conns:
        conn.close()


def _worker(job: _Job, conn: Any, rank: int) -> None:
    """One measurement process (rank r times stage r mod p): build the stage, prime it, answer "ready", then
    per (start, warm, end) window received the kept iteration times, until None; a failure is sent as one line."""
    try:
        torch.set_num_threads(job.threads)
        iteration = _stage_iteration(job, rank % (len(job.bounds) - 1))
        for _ in range(PRIMING_ITERATIONS):
            iteration()
        conn.send(("ready", None))
        while (window := conn.recv()) is not None:
            kept = _run_window(iteration, *window)
            conn.send(("times", (kept.wall_ms, kept.cpu_ms)))
    except EOFError:  # the parent is gone
        return
    except BaseException as exc:
        with suppress(OSError):
            conn.send(("error", f"{type(exc).__name__}: {(str(exc).splitlines() or [''])[0]}"))


def _run_window(iteration: Callable[[], None], start_s: float, warm_s: float, end_s: float) -> Kept:
    """Iterate from `start_s` until `end_s` (monotonic clock); the wall and CPU ms of those that began after the
    warm-up (at `warm_s`) and ended within the window. The CPU clock is read inside the wall clock's span: reading
    it brings the kernel's accounting of this process up to date, so a rank past its share of a core is taken off
    it right there (a 2-stage mlp alone on the busy host: up to 87 % of a window's wall time fell outside the
    iterations with the CPU clock read after the wall clock, none read before), and that wait is the iteration's."""
    time.sleep(max(0.0, start_s - time.monotonic()))
    kept = Kept([], [])
    while (began := time.monotonic()) < end_s:
        cpu_began = time.process_time()
        iteration()
        cpu_ended = time.process_time()
        ended = time.monotonic()
        if began >= warm_s and ended <= end_s:
            kept.wall_ms.append((ended - began) * 1e3)
            kept.cpu_ms.append((cpu_ended - cpu_began) * 1e3)
    return kept


def _stage_iteration(job: _Job, stage: int) -> Callable[[], None]:
    """A rank's F and B of `stage` as the executor runs them (`passes.stage_runs`), on the calibrated model
    rebuilt here."""
    from ..workload.models import build_model

    torch.manual_seed(0)
    model = build_model(job.model, **job.options)
    place(model, torch.device("cpu"), DTYPES[job.dtype])  # as calibration left them (no optimizer: no dynamo import)
    run = stage_runs(model, job.bounds, job.dtype, job.microbatch_size)[stage]
    return lambda: run.backward(run.forward())
