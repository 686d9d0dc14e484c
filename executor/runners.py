"""Running a schedule for real: ranks as threads of this process (tests), as processes this one spawns and
supervises, or as one rank of a torchrun job; and the measured trace they give.

Every runner checks the schedule first (`preflight` with the deadlock dry run, and the per-channel transfer
order), build the same setup on every rank (the model from one seed, cut into the schedule's stages), run one
`DeviceLoop` per device and merge what each device reports into one `RunResult`.
"""

from __future__ import annotations

import contextlib
import math
import os
import queue
import signal
import socket
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, NamedTuple

import numpy as np
import torch
import torch.distributed as dist

from ..launch import TORCHRUN_ENV, under_torchrun
from ..schedules import KINDS, Lowered, check_transfer_order, lower, preflight, resting_copies
from ..schedules.ir import Action, Schedule, ScheduleError
from ..traces.hostload import oom_kills
from ..traces.trace import Counter, Ops, Stream, Trace, TraceMeta
from ..workload.processes import HEARTBEAT_S, rank_context, rank_process, start_processes
from ..workload.transport import (
    InProcessTransport,
    PeerWait,
    Rendezvous,
    TransportChoice,
    TransportError,
    choose_transport,
    connect,
    served_rendezvous,
)
from .experts import dist_experts, thread_experts
from .replicas import Layout, dist_replicas, thread_replicas
from .runtime import DeviceLoop, DeviceResult
from .stages import DivergedError, ExecutorError, RunSpec, cut, heldout_scores, training_cut

_STREAM_OF_KIND = Stream.of_kinds(tuple(k.value for k in KINDS))


@dataclass
class RunResult:
    """A finished run: the measured trace, the loss per mini-batch (per pipeline; with data parallelism the
    mean over the d replicas, the whole mini-batch's), and every stage replica's final weights keyed by
    (stage, pipeline), in the stage module's parameter order: `weights` those of data-parallel replica 0,
    `replica_weights[q]` those of replica q (all equal when the REDUCE rows kept them so)."""

    trace: Trace
    losses: list[list[float]]  # [pipeline][mini-batch]
    replica_weights: list[dict[tuple[int, int], list[torch.Tensor]]] = field(default_factory=lambda: [{}])

    @property
    def weights(self) -> dict[tuple[int, int], list[torch.Tensor]]:
        return self.replica_weights[0]


@dataclass(frozen=True)
class Prelude:
    """Work a caller runs in a run's spawned ranks before the run, so that it shares their start-up (spawning,
    importing torch): each rank calls `rank(conn, rank)` (importable: spawned processes unpickle it) with its end
    of a duplex pipe, while the parent calls `parent(conns, procs)` with its ends; the run starts when that
    returns, and whatever it raises stops every rank."""

    rank: Callable[[Any, int], None]
    parent: Callable[[list[Any], list[Any]], None]


def _lowered(spec: RunSpec):
    if spec.schedule.sharded_optimizer:  # torch's fully_shard runs on CPU over gloo, but not on explicit versions
        raise ExecutorError(f"the executor does not run a sharded optimizer (ZeRO-{spec.schedule.zero}: REDUCE as a "
                            "reduce-scatter, GATHER rows of weight shards; it computes on whole weight versions, "
                            "not FSDP's sharded modules); run data parallelism without --zero")
    experts, replicas = spec.schedule.expert_parallel, spec.schedule.data_parallel
    if replicas % experts:
        raise ExecutorError(f"expert parallelism E={experts} draws its ranks from the d={replicas} data-parallel "
                            "replicas (executor/experts.py): E must divide d")
    try:
        preflight(spec.schedule, dry_run=True)
        lowered = lower(spec.schedule)
        check_transfer_order(lowered)
    except ScheduleError as exc:
        raise ExecutorError(str(exc)) from None
    return lowered


def _layout(spec: RunSpec) -> Layout:
    """The ranks of the run: the schedule's devices in each of its d data-parallel replicas, in its rank order."""
    return Layout.of(spec.schedule, spec.rank_order)


def run_in_process(spec: RunSpec) -> RunResult:
    """Every rank a thread of this process, over the in-process transport (its REDUCE rows and its experts'
    exchanges meet in rooms).
    The setups are built one after another here (model construction draws from torch's global generator),
    then the threads run."""
    lowered = _lowered(spec)
    layout = _layout(spec)
    transports = InProcessTransport.connected(layout.ranks, timeout_s=spec.timeout_s)
    rooms, members = thread_replicas(layout, spec.timeout_s)
    exchanges, experts = thread_experts(layout, spec.schedule.expert_parallel, spec.timeout_s)
    rooms += exchanges
    outputs = training_cut(spec).outputs  # each rank's cut takes them: one forward finds them
    loops = [DeviceLoop(spec, lowered, cut(spec, outputs=outputs), device, transports[rank], replica=replica,
                        replicas=members[rank], experts=experts[rank])
             for rank, (device, replica) in enumerate(map(layout.place, range(layout.ranks)))]
    results: list[DeviceResult | None] = [None] * layout.ranks
    causes: list[tuple[int, Exception]] = []

    def abandoned(reason: str) -> bool:
        """Every rank's receives and rooms failed with `reason`: each stops at its next wait. Whether this was the
        first reason (the cause)."""
        first = transports[0].abandon(reason)  # the ranks' transports share one office
        for room in rooms:
            room.abandon(reason)
        return first

    def work(rank: int) -> None:
        try:
            results[rank] = loops[rank].run()
        except Exception as exc:  # the first failure is the cause; the other ranks stop at once
            if abandoned(f"{layout.name(rank)} failed"):
                causes.append((rank, exc))

    threads = [threading.Thread(target=work, args=(rank,), name=f"pipesim-rank-{rank}", daemon=True)
               for rank in range(layout.ranks)]
    for thread in threads:
        thread.start()
    try:
        for thread in threads:
            thread.join()
    except BaseException:  # Ctrl-C: the ranks stop before the interpreter ends, which aborted inside torch's
        abandoned("interrupted")  # kernels of a rank still running ("terminate called without an active exception")
        for thread in threads:
            thread.join(STOP_GRACE_S)
        raise
    if causes:
        rank, exc = causes[0]
        message = f"{layout.name(rank)}: {type(exc).__name__}: {exc}"
        if isinstance(exc, DivergedError):
            raise DivergedError(message, _finished_losses(spec, [loop.finished_losses() for loop in loops
                                                                  if loop.losses]))
        raise ExecutorError(message)
    return _merge(spec, lowered, results, {"backend": "in-process", "device": "cpu", "ranks": layout.ranks})


# ------------------------------------------------------------------------------------- one process per rank

# test-only: "RANK:ROWS:SIGNAL" makes RANK send itself SIGNAL after ROWS rows; "RANK:ROWS:SPIN" makes it busy-wait
# forever inside a wait on a peer (a host spinning on a message that never comes)
FAULT_ENV = "PIPESIM_TEST_FAULT"
# a rank whose process used at least this share of one core over a heartbeat period is working (a long compute
# row, a large send), not waiting: a rank blocked in a receive or a collective uses well under 1% of a core
WORKING_CPU_SHARE = 0.05
STOP_GRACE_S = 3.0  # after SIGTERM, how long ranks get before SIGKILL
# how long the parent reads on to the result of a rank that exited cleanly (`_Supervisor.unread_results`): the
# heartbeats queued before it are read at the host's pace, seconds behind on a loaded one
RESULT_DRAIN_S = 30.0


class ReportedRow(NamedTuple):
    """A row a rank finished, as the parent hears of it before (or instead of) the rank's result: its global
    index, start and end (ns), and its DeviceResult figures after it (weight copies held, memory, its peak, what
    only sends in flight hold), so that the incomplete trace of a rank that fails, dies or stalls keeps its memory
    up to then, not its timeline alone."""

    row: int
    start_ns: int
    end_ns: int
    held: int
    memory_bytes: int
    peak_bytes: int
    sending_bytes: int

    @classmethod
    def of(cls, result: DeviceResult, first: int, row: int, start_ns: int, end_ns: int) -> ReportedRow:
        """Row `row` of `result`, whose device's rows begin at global row `first`."""
        k = row - first
        return cls(row, start_ns, end_ns, int(result.held[k]), int(result.memory_bytes[k]), int(result.peak_bytes[k]),
                   int(result.sending_bytes[k]))


@dataclass
class Heartbeat:
    """What a rank tells the parent as it runs: rows done, its last action's text (`1B3.0`), the losses so
    far, and each row finished since its previous heartbeat (`ReportedRow`). A row's start is the end of the
    one before it (the loop's own bookkeeping included): enough for an incomplete trace. `working`:
    the process used WORKING_CPU_SHARE of a core or more over the heartbeat period before it (progress within
    a row, which can outlast the stall limit on a large micro-batch) and was not inside one wait on a peer all
    that period (a host waiting on gloo or a CUDA event can spin: CPU used there is not progress).
    `waiting_on`: that wait (`rank 1: receive #3 from rank 0`), "" when none."""

    rank: int
    rows_done: int
    last_action: str
    losses: dict[tuple[int, int], float]
    rows: list[ReportedRow]
    working: bool = False
    waiting_on: str = ""


@dataclass
class Progress:
    """What the parent knows mid-run: mini-batches every device has finished, and the loss of the last one."""

    minibatches_done: int
    last_loss: float | None


class RunFailed(ExecutorError):
    """A run that stopped part-way: `result` holds what was measured until then (an incomplete trace),
    `failed_rank` the rank at fault, `diverged` whether the loss went non-finite."""

    def __init__(self, message: str, result: RunResult, failed_rank: int | None, diverged: bool = False) -> None:
        super().__init__(message)
        self.result, self.failed_rank, self.diverged = result, failed_rank, diverged


class RunInterrupted(RunFailed):
    """Ctrl-C during a run: `result` holds what was measured until then (an incomplete trace), as for a
    failure, though no rank is at fault."""


def _action_text(lowered: Lowered, row: int) -> str:
    t = lowered.table
    return str(Action(KINDS[t.kind[row]], int(t.stage[row]), int(t.microbatch[row]), int(t.minibatch[row]),
                      int(t.pipeline[row]), int(t.peer[row])))


def _test_fault(rank: int) -> tuple[int, str] | None:
    """(rows, SIGNAL or SPIN) where FAULT_ENV asks this rank for a fault after that many rows, else None."""
    fault = os.environ.get(FAULT_ENV, "")
    rank_text, _, rest = fault.partition(":")
    rows_text, _, what = rest.partition(":")
    return (int(rows_text), what) if fault and int(rank_text) == rank else None


class _Reporter:
    """A rank's `on_row` and its heartbeat thread: each row is timed as it finishes, and the thread sends what
    is new every HEARTBEAT_S, so the parent hears of rows done just before a rank blocks or stops, and, when no
    row finished, whether the rank is working (its process's CPU time). In tests, raises the fault FAULT_ENV
    asks for."""

    def __init__(self, rank: int, lowered: Lowered, messages: Any) -> None:
        self.rank, self.lowered, self.messages = rank, lowered, messages
        self.loop: DeviceLoop | None = None
        self.done = 0
        self.last_action = "setup"
        self.rows: list[ReportedRow] = []
        self.lock = threading.Lock()
        self.stopped = threading.Event()
        self.thread: threading.Thread | None = None
        self.previous_ns = time.perf_counter_ns()
        self.fault = _test_fault(rank)

    def start(self) -> None:
        self.previous_ns = time.perf_counter_ns()
        self.beat()
        self.thread = threading.Thread(target=self._beating, name="pipesim-heartbeat", daemon=True)
        self.thread.start()

    def on_row(self, row: int) -> None:
        now = time.perf_counter_ns()
        with self.lock:
            first = self.lowered.rows(self.loop.device).start  # the device's rows' global index
            self.rows.append(ReportedRow.of(self.loop.result, first, row, self.previous_ns, now))
            self.done += 1
            self.last_action = _action_text(self.lowered, row)
        self.previous_ns = now
        if self.fault is not None and self.done == self.fault[0] and self.fault[1] == "SPIN":
            with PeerWait.inside(f"rank {self.rank}: a test receive that never comes"):
                while True:
                    pass
        if self.fault is not None and self.done == self.fault[0]:
            self.stop()
            _flushed(self.messages)  # the heartbeat reaches the parent before the signal lands
            os.kill(os.getpid(), getattr(signal, f"SIG{self.fault[1]}"))

    def _beating(self) -> None:
        cpu_ns, wall_ns = time.process_time_ns(), time.monotonic_ns()
        told_waiting_on = ""
        while not self.stopped.wait(HEARTBEAT_S):
            cpu_then_ns, wall_then_ns = cpu_ns, wall_ns
            cpu_ns, wall_ns = time.process_time_ns(), time.monotonic_ns()
            waiting_on, waiting_since_ns = PeerWait.what, PeerWait.since_ns
            waited_throughout = bool(waiting_on) and waiting_since_ns <= wall_then_ns
            working = not waited_throughout and cpu_ns - cpu_then_ns >= WORKING_CPU_SHARE * (wall_ns - wall_then_ns)
            if self.rows or working or waiting_on != told_waiting_on:
                self.beat(working, waiting_on)
                told_waiting_on = waiting_on

    def beat(self, working: bool = False, waiting_on: str = "") -> None:
        losses = dict(self.loop.losses) if self.loop is not None else {}
        with self.lock:
            beat = Heartbeat(self.rank, self.done, self.last_action, losses, self.rows, working, waiting_on)
            self.rows = []
        self.messages.put(("beat", beat))

    def stop(self) -> None:
        """No more heartbeats, the thread's last one sent before this returns; the last rows go out now."""
        self.stopped.set()
        if self.thread is not None:
            self.thread.join()
        self.beat()


def _flushed(messages: Any) -> None:
    """Close this process's end of `messages` once what it put is in the pipe. Left to the process's exit, the
    queue's feeder thread sends it as the process shuts down, where it drops an item whose sending fails without a
    word (multiprocessing's `is_exiting`): a rank of calibrate's runtime probe that had put its result exited with
    code 0 and the parent never read it (CI, "rank 1 exited with code 0 (last action 1OPT.4)"). Sent here, a
    failure is printed as the rank's own, and the exit has nothing left to send."""
    messages.close()
    messages.join_thread()


def _rank_main(setup: Any, rank: int, rendezvous: Rendezvous, choice: TransportChoice, messages: Any,
               compute_lock: Any, prelude: tuple[Callable[[Any, int], None], Any] | None = None) -> None:
    """One rank of `run_multiprocess` (a spawned process): run the caller's `prelude` (its work and its pipe end)
    if any, receive the RunSpec and its layers' outputs (`cut`) from `setup`, run the device, reporting
    heartbeats, then put ("done", rank, result) or ("error", rank, message, diverged)."""
    reporter = None
    try:
        if prelude is not None:
            work, conn = prelude
            work(conn, rank)
            conn.close()
        spec, outputs = setup.recv()
        torch.set_num_threads(spec.threads_per_rank)
        lowered = _lowered(spec)
        stages = cut(spec, outputs=outputs)
        reporter = _Reporter(rank, lowered, messages)
        with _joined(spec, lowered, choice, rank, rendezvous=rendezvous) as placed:
            loop = DeviceLoop(spec, lowered, stages, **placed, on_row=reporter.on_row, compute_lock=compute_lock)
            reporter.loop = loop
            reporter.start()
            dist.barrier()  # set-up takes each rank its own time: the timeline starts when all are ready
            result = loop.run()
        reporter.stop()
        messages.put(("done", rank, result))
    except BaseException as exc:  # reported to the parent, which names the rank
        if reporter is not None:
            reporter.stop()
        text = (str(exc).splitlines() or [""])[0]
        named = text if isinstance(exc, ExecutorError) else f"{type(exc).__name__}: {text}"
        messages.put(("error", rank, named, isinstance(exc, DivergedError)))
    finally:
        _flushed(messages)


def _links(lowered: Lowered) -> list[tuple[int, int, int]]:
    return [(c.src_device, c.dst_device, i) for i, c in enumerate(lowered.channels)]


@contextlib.contextmanager
def _joined(spec: RunSpec, lowered: Lowered, choice: TransportChoice, rank: int, **options: Any
            ) -> Iterator[dict[str, Any]]:
    """This rank in the job: its transport (the pipeline links of every replica, each among its own ranks) and
    its device's data-parallel group, created in one order on every rank; yields them as DeviceLoop's `device`,
    `transport`, `replica`, `replicas` and `experts`. `options` go to `connect`."""
    layout = _layout(spec)
    device, replica = layout.place(rank)
    if spec.schedule.expert_parallel > 1 and choice.device != "cpu":
        raise ExecutorError(f"expert parallelism runs on CPU ranks (gloo), not on {choice.device}")
    with connect(choice, rank, layout.ranks, timeout_s=spec.timeout_s, edges=layout.links(_links(lowered)),
                 **options) as transport:
        replicas = dist_replicas(layout, rank, choice.backend, transport.device, choice.host_staged, spec.timeout_s)
        experts = dist_experts(layout, spec.schedule.expert_parallel, rank, choice.backend, spec.timeout_s)
        yield {"device": device, "transport": transport, "replica": replica, "replicas": replicas, "experts": experts}


def _stopped(pid: int | None) -> bool:
    """Whether a process is stopped (SIGSTOP, a debugger): Linux's /proc; elsewhere, not known, so no."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] in ("T", "t")
    except (OSError, IndexError):
        return False


def _stop(procs: list[Any]) -> None:
    """Every rank ends: SIGTERM, a short grace, SIGKILL (which also ends a stopped process), reaped. (Ctrl-C
    can come before every rank has started: those not started are left out.)"""
    procs = [proc for proc in procs if proc.pid is not None]
    for proc in procs:
        if proc.is_alive():
            if _stopped(proc.pid):  # a stopped process acts on SIGKILL only
                proc.kill()
            else:
                proc.terminate()
    deadline = time.monotonic() + STOP_GRACE_S
    for proc in procs:
        proc.join(timeout=max(0.0, deadline - time.monotonic()))
    for proc in procs:
        if proc.is_alive():
            proc.kill()
            proc.join(timeout=STOP_GRACE_S)




class _Supervisor:
    """The parent's view of the ranks: their heartbeats and results, who stalled or died."""

    def __init__(self, spec: RunSpec, lowered: Lowered, procs: list[Any], stall_timeout_s: float,
                 oom_kills_before: int | None = None) -> None:
        self.spec, self.lowered, self.procs = spec, lowered, procs
        self.stall_timeout_s = stall_timeout_s
        world = len(procs)
        self.results: list[DeviceResult | None] = [None] * world
        self.beats: list[Heartbeat | None] = [None] * world
        self.errors: dict[int, tuple[str, bool]] = {}  # rank -> its error, in the order they came
        self.rows: list[list[ReportedRow]] = [[] for _ in range(world)]
        self.moved = [time.monotonic()] * world  # when each rank last made progress (or started)
        self.finished_after = [_finished_after(lowered, _layout(spec).place(rank)[0]) for rank in range(world)]
        self.oom_kills_before = oom_kills_before  # the kernel's count before the ranks started: a kill raises it

    def take(self, message: tuple) -> None:
        """Record one message: a heartbeat, a result, or a rank's error (text, whether the loss diverged)."""
        what = message[0]
        if what == "beat":
            beat: Heartbeat = message[1]
            rank = beat.rank
            if self.beats[rank] is None or beat.rows_done > self.beats[rank].rows_done or beat.working:
                self.moved[rank] = time.monotonic()
            self.beats[rank] = beat
            self.rows[rank].extend(beat.rows)
        elif what == "done":  # finishing is progress too: a peer that waited on its last sends moves next
            self.results[message[1]] = message[2]
            self.moved[message[1]] = time.monotonic()
        else:
            self.errors.setdefault(message[1], (message[2], message[3]))

    def progress(self) -> Progress:
        done = min(int(np.searchsorted(after, beat.rows_done, side="right")) if beat else 0
                   for after, beat in zip(self.finished_after, self.beats))
        done = self.lowered.schedule.minibatches if all(r is not None for r in self.results) else done
        return Progress(done, self.finished_losses(done).get((0, done - 1)) if done else None)

    def finished_losses(self, done: int) -> dict[tuple[int, int], float]:
        """The loss of each pipeline's first `done` mini-batches, which every device has finished: each rank's as
        its result or its last heartbeat holds them (a heartbeat's later mini-batches may be partial sums)."""
        losses = _mean_losses([r.losses if r is not None else beat.losses if beat else {}
                               for r, beat in zip(self.results, self.beats)])
        return {key: loss for key, loss in losses.items() if key[1] < done}

    def named(self, rank: int) -> str:
        return f"rank {rank}{_layout(self.spec).where(rank)}"

    def last_action(self, rank: int) -> str:
        beat = self.beats[rank]
        return beat.last_action if beat is not None else "setup"

    def dead(self) -> list[int]:
        """Ranks that exited without a result or an error (killed, or crashed beyond Python)."""
        return [rank for rank, proc in enumerate(self.procs)
                if proc.exitcode is not None and self.results[rank] is None and rank not in self.errors]

    def unread_results(self) -> list[int]:
        """The dead ranks that exited cleanly: each put its result before it exited (a process's queue is flushed
        as it ends), so the result is in the queue, behind the heartbeats not read yet."""
        return [rank for rank in self.dead() if self.procs[rank].exitcode == 0]

    def fault(self) -> tuple[int, str, bool] | None:
        """What stops the run, if anything: (rank, what happened, whether its loss diverged). A rank that died
        comes first: its peers' failed transfers are its consequence; then a diverged loss, then the first
        error reported; then a stalled run: a stopped rank past the stall limit, or every running rank past it (a
        rank blocked in a receive while its peer computes a long row is waiting, not stalled, as long as some rank
        moves: a 1F1B last stage waits through the first stage's last backward, its update and the next forward)."""
        dead = self.dead()
        if dead:
            code = self.procs[dead[0]].exitcode
            how = (f"was killed by signal {-code}" if code < 0 else f"exited with code {code}" if code else
                   "exited (code 0) without its result reaching the parent")
            why = ""
            before = self.oom_kills_before
            if code == -signal.SIGKILL and before is not None and (oom_kills() or 0) > before:
                # the count is the host's: another process the killer ended meanwhile raises it too
                why = (": the kernel's out-of-memory killer ended a process meanwhile, most likely it, the ranks "
                       "having outgrown this host's memory; a smaller --microbatch-size, or fewer ranks, holds less")
            return dead[0], f"{self.named(dead[0])} {how} (last action {self.last_action(dead[0])}){why}", False
        if self.errors:
            rank = next((r for r, (_, diverged) in self.errors.items() if diverged), next(iter(self.errors)))
            text, diverged = self.errors[rank]
            return rank, f"{self.named(rank)} failed (last action {self.last_action(rank)}): {text}", diverged
        now = time.monotonic()
        # before its first heartbeat a rank is starting (spawn, imports, joining the process group, which has a
        # timeout of its own): it gets that timeout
        limits = [self.stall_timeout_s if beat is not None else max(self.stall_timeout_s, self.spec.timeout_s)
                  for beat in self.beats]
        running = [rank for rank in range(len(self.procs)) if self.results[rank] is None]
        stalled = [rank for rank in running if now - self.moved[rank] > limits[rank]]
        stopped = [rank for rank in stalled if _stopped(self.procs[rank].pid)]
        # a rank that finished within the limit moved the run: its peers' rows after its last sends are to come
        finished_lately = any(now - self.moved[rank] <= self.stall_timeout_s for rank in range(len(self.procs))
                              if self.results[rank] is not None)
        if not stalled or (not stopped and (len(stalled) < len(running) or finished_lately)):
            return None
        rank = stopped[0] if stopped else min(stalled, key=lambda r: self.moved[r])
        beat = self.beats[rank]
        waiting = f"; waiting on {beat.waiting_on}" if beat is not None and beat.waiting_on else ""
        return rank, (f"{self.named(rank)} made no progress for {limits[rank]:g} s (last action "
                      f"{self.last_action(rank)}{'; the process is stopped' if stopped else waiting})"), False

    def partial(self, hardware: dict[str, Any], failed_rank: int | None) -> RunResult:
        timed = {rank: rows for rank, rows in enumerate(self.rows) if self.results[rank] is None}
        return _merge(self.spec, self.lowered, self.results, hardware, timed=timed, failed_rank=failed_rank,
                      losses=self.finished_losses(self.progress().minibatches_done))


def run_multiprocess(spec: RunSpec, *, device: str = "cpu", backend: str = "auto", timeout_s: float | None = None,
                     stall_timeout_s: float = 20.0, on_progress: Callable[[Progress], None] | None = None,
                     prelude: Prelude | None = None) -> RunResult:
    """One spawned process per rank (a device of a data-parallel replica) on this machine: gloo on CPU; on CUDA,
    NCCL with one GPU per rank, or, when ranks share a GPU, host-staged gloo with a cross-process lock around
    compute. The parent supervises: a rank that dies or fails stops every rank and raises RunFailed naming it,
    with the incomplete trace; so does a stall, `stall_timeout_s` with no rank making progress (finishing a row
    or computing) or with one rank stopped (SIGSTOP), and a run longer than `timeout_s`
    (default: none). Ctrl-C (KeyboardInterrupt) ends every rank and raises RunInterrupted with the rows they
    reported, or, before any rank was sent its work, propagates. `on_progress` is called
    after each message from a rank, and every HEARTBEAT_S when none comes. A `prelude` runs in the ranks first
    (neither timeout counts its time)."""
    lowered = _lowered(spec)
    # fail here, in one line, on a model the schedule cannot be cut into; the ranks' cuts take its layers' outputs
    outputs = training_cut(spec).outputs
    world = _layout(spec).ranks
    try:
        choice = choose_transport(device, world, backend=backend)
    except (ValueError, TransportError) as exc:
        raise ExecutorError(str(exc)) from None
    context = rank_context()
    messages = context.Queue()
    compute_lock = context.Lock() if choice.host_staged else None
    hardware = {**choice.meta(), "ranks": world, "threads_per_rank": spec.threads_per_rank}
    with served_rendezvous() as rendezvous:  # held from the port's choice until the ranks are gone
        setups = [context.Pipe(duplex=False) for _ in range(world)]
        pipes = [context.Pipe() for _ in range(world)] if prelude is not None else []
        procs = [rank_process(context, _rank_main,
                              (setups[rank][0], rank, rendezvous, choice, messages, compute_lock,
                               (prelude.rank, pipes[rank][1]) if prelude is not None else None),
                              f"pipesim-rank-{rank}", spec.threads_per_rank)
                 for rank in range(world)]
        supervisor, kills_before = None, oom_kills()  # the kernel's count before any rank starts
        try:
            start_processes(procs, spec.threads_per_rank)
            if prelude is not None:
                for _, theirs in pipes:
                    theirs.close()  # the parent keeps only its own ends, so a rank that dies reads as EOF
                prelude.parent([ours for ours, _ in pipes], procs)
                for ours, _ in pipes:
                    ours.close()
            supervisor = _Supervisor(spec, lowered, procs, stall_timeout_s, kills_before)
            started = time.monotonic()
            for _, writer in setups:
                writer.send((spec, outputs))
            while any(r is None for r in supervisor.results):
                try:
                    supervisor.take(messages.get(timeout=HEARTBEAT_S))
                except queue.Empty:
                    pass
                if supervisor.errors or supervisor.dead():
                    _read_behind(messages, supervisor)
                fault = supervisor.fault()
                if fault is not None:
                    rank, text, diverged = fault
                    raise RunFailed(text, supervisor.partial(hardware, rank), rank, diverged)
                if timeout_s is not None and time.monotonic() - started > timeout_s:
                    raise RunFailed(f"the run did not finish within {timeout_s:g} s",
                                    supervisor.partial(hardware, None), None)
                if on_progress is not None:
                    on_progress(supervisor.progress())
        except KeyboardInterrupt:
            if supervisor is None:
                raise
            _drain(messages, supervisor, within_s=2 * HEARTBEAT_S)  # the rows done before Ctrl-C, reported meanwhile
            raise RunInterrupted("interrupted", supervisor.partial(hardware, None), None) from None
        finally:
            _stop(procs)
    return _merge(spec, lowered, supervisor.results, hardware)


def _read_behind(messages: Any, supervisor: _Supervisor) -> None:
    """The messages behind a rank's error or exit: the other ranks' last heartbeats, a peer's death behind a
    rank's failed transfer, and the result of a rank that exited cleanly, read on to (`RESULT_DRAIN_S`): a loaded
    host reads heartbeats slower than the ranks send them, and a runtime probe's rank that had finished was declared
    dead ("exited with code 0") with its result still unread."""
    _drain(messages, supervisor)
    _drain(messages, supervisor, RESULT_DRAIN_S, until=lambda: not supervisor.unread_results())


def _drain(messages: Any, supervisor: _Supervisor, within_s: float = 1.0,
           until: Callable[[], bool] = lambda: False) -> None:
    """Take the messages already sent (the heartbeats of the moments before a failure), for `within_s` at most
    (ranks still running keep sending), or until `until` holds."""
    deadline = time.monotonic() + within_s
    while (left := deadline - time.monotonic()) > 0 and not until():
        try:
            supervisor.take(messages.get(timeout=min(left, 2 * HEARTBEAT_S)))
        except queue.Empty:
            return


# --------------------------------------------------------------------------------------------- torchrun


@dataclass(frozen=True)
class TorchrunEnv:
    """This process's place in a torchrun job, from the environment torchrun sets."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int

    @classmethod
    def detect(cls) -> TorchrunEnv | None:
        """The job this process belongs to, or None when torchrun did not start it."""
        if not under_torchrun():
            return None
        try:
            rank, world, local_rank = (int(os.environ[name]) for name in TORCHRUN_ENV[:3])
            local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world))
        except ValueError:
            raise ExecutorError(f"torchrun environment: RANK, WORLD_SIZE and LOCAL_RANK must be whole numbers "
                                f"(got {', '.join(os.environ[n] for n in TORCHRUN_ENV[:3])})") from None
        return cls(rank, world, local_rank, local_world)

    def world_refusal(self, schedule: Schedule, layout: Layout) -> str | None:
        """Why this job cannot run `schedule` on `layout`'s ranks (torchrun started another number), or None."""
        if self.world_size == layout.ranks:
            return None
        replicas = f" x {layout.replicas} data-parallel replicas" if layout.replicas > 1 else ""
        return (f"torchrun started {self.world_size} ranks, but {schedule.method} on {schedule.num_stages} stages "
                f"runs on {layout.devices} devices{replicas}: start {layout.ranks} ranks (torchrun --nproc-per-node "
                "...)")


class _FileLock:
    """Ranks of one torchrun job on one machine that share a GPU take turns for compute: an exclusive lock on
    a file named after the job's rendezvous port."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __enter__(self) -> None:
        import fcntl

        self.file = open(self.path, "a")
        fcntl.flock(self.file, fcntl.LOCK_EX)

    def __exit__(self, *exc: object) -> None:
        self.file.close()  # closing releases the lock


PINGS = 16  # ping-pong rounds per rank for its clock offset; the one with the shortest round trip counts


def _clock_offsets(group: Any, job: TorchrunEnv, host: str | None = None,
                   clock_ns: Callable[[], int] = time.perf_counter_ns) -> list[int]:
    """Each rank's monotonic clock minus rank 0's, in ns (rank 0 learns them; others get zeros). On one host the
    clock is shared: all zero. Across hosts, by min-RTT ping-pong: rank 0 sends, the rank answers with its
    clock; the offset is that reading minus the round trip's midpoint on rank 0's clock. `host` (default this
    machine's name) and `clock_ns` are this rank's."""
    hosts: list[str | None] = [None] * job.world_size
    dist.all_gather_object(hosts, host or socket.gethostname(), group=group)
    offsets = [0] * job.world_size
    if len(set(hosts)) == 1:
        return offsets
    clock = torch.zeros(1, dtype=torch.int64)
    for peer in range(1, job.world_size):
        best = None
        for _ in range(PINGS):
            if job.rank == 0:
                sent = clock_ns()
                dist.send(clock, peer, group=group)
                dist.recv(clock, peer, group=group)
                back = clock_ns()
                if best is None or back - sent < best[0]:
                    best = (back - sent, int(clock) - (sent + back) // 2)
            elif job.rank == peer:
                dist.recv(clock, 0, group=group)
                clock.fill_(clock_ns())
                dist.send(clock, 0, group=group)
        if best is not None:
            offsets[peer] = best[1]
    return offsets


def run_torchrun(spec: RunSpec, job: TorchrunEnv, *, device: str = "cpu", backend: str = "auto",
                 on_progress: Callable[[Progress], None] | None = None) -> RunResult | None:
    """This rank of a torchrun job: run its device, gather every rank's result to rank 0 (gloo), and there
    return the measured trace, each rank's clock put on rank 0's (None on the other ranks). torchrun
    supervises: a rank that fails exits, and torchrun ends the others. When rank 0's device cannot finish (a
    peer died, so its transfer failed, or torchrun stops it with SIGTERM), it raises RunFailed with an
    incomplete trace of its own rows; the other ranks' rows died with them."""
    lowered = _lowered(spec)
    layout = _layout(spec)
    world = layout.ranks
    if (refusal := job.world_refusal(spec.schedule, layout)) is not None:
        raise ExecutorError(refusal)
    stages = training_cut(spec)
    try:
        choice = choose_transport(device, job.local_world_size, backend=backend)
    except (ValueError, TransportError) as exc:
        raise ExecutorError(str(exc)) from None
    torch.set_num_threads(spec.threads_per_rank)
    compute_lock = None
    if choice.host_staged:
        compute_lock = _FileLock(os.path.join(tempfile.gettempdir(),
                                              f"pipesim-gpu-{os.environ.get('MASTER_PORT', '0')}.lock"))
    done = [0]
    finished_after = _finished_after(lowered, layout.place(job.rank)[0])
    loop: DeviceLoop | None = None
    fault = _test_fault(job.rank)

    def on_row(_: int) -> None:
        done[0] += 1
        if fault is not None and done[0] == fault[0]:
            os.kill(os.getpid(), fault[1])
        if on_progress is not None:
            finished = int(np.searchsorted(finished_after, done[0], side="right"))
            on_progress(Progress(finished, loop.losses.get((0, finished - 1)) if finished else None))

    with _joined(spec, lowered, choice, job.rank, local_rank=job.local_rank) as placed:
        group = dist.new_group(backend="gloo", timeout=timedelta(seconds=spec.timeout_s))
        offsets = _clock_offsets(group, job)
        loop = DeviceLoop(spec, lowered, stages, **placed, on_row=on_row, compute_lock=compute_lock)
        dist.barrier(group)  # set-up takes each rank its own time: the timeline starts when all are ready
        hardware = {**choice.meta(), "ranks": world, "threads_per_rank": spec.threads_per_rank,
                    "launcher": "torchrun", "clock_offsets_ns": offsets}
        try:
            with _stopped_by_sigterm():
                result = loop.run()
        except Exception as exc:
            if job.rank != 0:
                raise
            mine, first = loop.result, lowered.rows(0).start
            rows = [ReportedRow.of(mine, first, first + i, int(mine.start_ns[i]), int(mine.end_ns[i]))
                    for i in range(mine.rows_done)]
            text = mine.error or f"{type(exc).__name__}: {(str(exc).splitlines() or [''])[0]}"
            raise RunFailed(text, _merge(spec, lowered, [None] * world, hardware, timed={0: rows}), None,
                            isinstance(exc, DivergedError)) from None
        gathered: list[DeviceResult | None] | None = [None] * world if job.rank == 0 else None
        dist.gather_object(result, gathered, dst=0, group=group)
        dist.destroy_process_group(group)
    if gathered is None:
        return None
    for r, offset in zip(gathered, offsets):
        r.start_ns = r.start_ns - offset
        r.end_ns = r.end_ns - offset
    return _merge(spec, lowered, gathered, hardware)


class _Stopped(Exception):
    """torchrun ended this rank (SIGTERM: another rank failed)."""


@contextlib.contextmanager
def _stopped_by_sigterm() -> Iterator[None]:
    """While the device runs, SIGTERM (torchrun ending the job) raises _Stopped, so rank 0 keeps what it has
    measured. A run that ends in failure (its own, or that _Stopped) ignores SIGTERM from then on: torchrun
    sends it as soon as a peer dies, and the rank must still close its transport and report its rows before
    it exits, as it does right after. A run that succeeds gets the default back. Only the main thread may set
    handlers."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def stop(*_: Any) -> None:
        raise _Stopped("torchrun stopped this rank (SIGTERM), as it does when another rank fails")

    previous = signal.signal(signal.SIGTERM, stop)
    try:
        yield
    except BaseException:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        raise
    signal.signal(signal.SIGTERM, previous)


def _finished_after(lowered: Lowered, device: int) -> np.ndarray:
    """After how many of its rows `device` has finished each mini-batch, sorted (for progress); 0 for one it
    runs no row of. In one pass over the rows: a scan per mini-batch kept a run of 10^5 of them from starting
    for minutes, and a Ctrl-C meanwhile found nothing measured."""
    rows = lowered.rows(device)
    minibatch = np.asarray(lowered.table.minibatch[rows.start:rows.stop], dtype=np.int64)
    ran = (minibatch >= 0) & (minibatch < lowered.schedule.minibatches)
    after = np.zeros(lowered.schedule.minibatches, dtype=np.int64)
    np.maximum.at(after, minibatch[ran], np.flatnonzero(ran) + 1)
    return np.sort(after)


# ---------------------------------------------------------------------------------------------- the trace


def _measured_us(ns: np.ndarray) -> np.ndarray:
    """A column the ranks measured for some rows (ns, -1 elsewhere) in the trace's microseconds (-1.0 elsewhere)."""
    return np.where(ns >= 0, ns / 1e3, -1.0)


def _memory_counter(end_us: np.ndarray, memory_bytes: np.ndarray, peak_bytes: np.ndarray) -> Counter:
    """A device's memory over time from the rows it ran (their ends, memory after and peaks): before its first
    row as after it, then at each row's end its peak (before it freed the weights it read last, where it did) and
    what it holds after. No sample where no row's memory reached us (a rank that failed before its first
    heartbeat): its memory is unknown, which a sample of 0 would call nothing held."""
    if not len(memory_bytes):
        return Counter(np.zeros(0), np.zeros(0))
    peaked = peak_bytes > memory_bytes
    times_us = np.concatenate([[0.0], np.repeat(end_us, np.where(peaked, 2, 1))])
    values = np.concatenate([[memory_bytes[0]], np.stack([peak_bytes, memory_bytes], axis=1)
                             [np.stack([peaked, np.ones_like(peaked)], axis=1)]])
    return Counter(times_us, values)


def _mean_losses(reported: list[dict[tuple[int, int], float]]) -> dict[tuple[int, int], float]:
    """Per (pipeline, mini-batch), the mean of the losses the ranks reported: the d data-parallel replicas' last
    stages each report their share's, and the whole mini-batch's is their mean, summed exactly (fsum), so that it is
    the same in whatever order the ranks are numbered."""
    by_key: dict[tuple[int, int], list[float]] = {}
    for losses in reported:
        for key, value in losses.items():
            by_key.setdefault(key, []).append(value)
    return {key: math.fsum(values) / len(values) for key, values in by_key.items()}


def _finished_losses(spec: RunSpec, reported: list[dict[tuple[int, int], float]]) -> list[list[float]]:
    """Per pipeline, the losses of its first mini-batches that every last stage's device (one per data-parallel
    replica) `reported` finished, in order: a run stopped part-way keeps the mini-batches it completed."""
    done = set.intersection(*(set(losses) for losses in reported)) if reported else set()
    means = _mean_losses([{key: losses[key] for key in done} for losses in reported])
    out = []
    for pipeline in range(spec.schedule.pipelines):
        out.append([])
        while (pipeline, len(out[-1])) in means:
            out[-1].append(means[(pipeline, len(out[-1]))])
    return out


def _whole_experts(weights: list[dict[tuple[int, int], list[torch.Tensor]]], routed: dict[int, list[int]],
                   expert_parallel: int) -> list[dict[tuple[int, int], list[torch.Tensor]]]:
    """Each replica's weights with its routed experts whole: the slices its expert-parallel group's E ranks
    hold, in group order (executor/experts.py), so that a replica's weights are the whole model's."""
    if expert_parallel == 1:
        return weights
    whole = []
    for q, held in enumerate(weights):
        first = q - q % expert_parallel
        group = weights[first:first + expert_parallel]
        whole.append({key: [torch.cat([other[key][i] for other in group]) if i in routed.get(key[0], ()) else w
                            for i, w in enumerate(ws)] for key, ws in held.items()})
    return whole


def _merge(spec: RunSpec, lowered: Lowered, results: list[DeviceResult | None], hardware: dict[str, Any], *,
           timed: dict[int, list[ReportedRow]] | None = None, failed_rank: int | None = None,
           losses: dict[tuple[int, int], float] | None = None) -> RunResult:
    """One measured trace from every rank's rows (ranks on one host share the monotonic clock): its device is
    the rank's place, replica * devices + device (`Layout.position`, whatever the rank order), so replica 0's ops
    are those a run without data parallelism has. A
    run that stopped part-way passes `timed`, the rows reported for the ranks with no result: its trace holds
    the rows that ran, their memory included, is marked incomplete and names `failed_rank`; and `losses`, those
    of the mini-batches every rank finished (else the results' alone: a failed last stage's were lost)."""
    schedule = lowered.schedule
    layout = _layout(spec)
    complete = timed is None
    if complete and any(r is None for r in results):
        raise ExecutorError("a device reported nothing")
    t = lowered.table
    parts = []  # per rank: its rows, and their device, start, end, version and prediction columns
    ends_and_levels = []  # per rank, of the rows that ran: end ns, weight copies held, memory, peak, sending bytes
    by_position = sorted(range(layout.ranks), key=layout.position)
    for rank in by_position:
        r = results[rank]
        rows = lowered.rows(layout.place(rank)[0])
        start_ns = np.full(len(rows), -1, dtype=np.int64)
        end_ns = np.full(len(rows), -1, dtype=np.int64)
        # What each op really ran on (the loop reads it off its weights); the lowering's where a rank reported
        # heartbeats only.
        version = np.array(lowered.version[rows.start:rows.stop])
        prediction = np.array(lowered.prediction[rows.start:rows.stop])
        send_cpu_ns = np.full(len(rows), -1, dtype=np.int64)
        wait_ns = np.full(len(rows), -1, dtype=np.int64)
        levels = np.zeros((4, len(rows)), dtype=np.int64)
        if r is not None:
            start_ns[:], end_ns[:], version[:], prediction[:] = r.start_ns, r.end_ns, r.version, r.prediction
            send_cpu_ns[:], wait_ns[:] = r.send_cpu_ns, r.wait_ns
            levels[:] = r.held, r.memory_bytes, r.peak_bytes, r.sending_bytes
        beats = (timed or {}).get(rank)
        if beats:
            index, starts, ends, *reported = np.array(beats, dtype=np.int64).T
            start_ns[index - rows.start], end_ns[index - rows.start] = starts, ends
            levels[:, index - rows.start] = reported
        ran = end_ns >= 0
        parts.append((np.arange(rows.start, rows.stop)[ran], np.full(int(ran.sum()), layout.position(rank)),
                      start_ns[ran], end_ns[ran], version[ran], prediction[ran], send_cpu_ns[ran], wait_ns[ran]))
        ends_and_levels.append((end_ns[ran], *levels[:, ran]))
    row, device, start_ns, end_ns, version, prediction, send_cpu_ns, wait_ns = (np.concatenate(column)
                                                                                for column in zip(*parts))
    t0 = int(start_ns.min()) if len(start_ns) else 0
    ops = Ops(device=device, stream=_STREAM_OF_KIND[t.kind[row]], kind=t.kind[row], stage=t.stage[row],
              microbatch=t.microbatch[row], minibatch=t.minibatch[row], pipeline=t.pipeline[row], peer=t.peer[row],
              version=version, prediction=prediction,
              start_us=(start_ns - t0) / 1e3, dur_us=(end_ns - start_ns) / 1e3,
              cpu_us=_measured_us(send_cpu_ns), wait_us=_measured_us(wait_ns))
    base = resting_copies(schedule)
    counters: dict[str, list[Counter]] = {"weight_versions": [], "memory_bytes": [], "sending_bytes": []}
    for ends_ns, held, memory_bytes, peak_bytes, sending_bytes in ends_and_levels:
        end_us = (ends_ns - t0) / 1e3
        times_us = np.concatenate([[0.0], end_us])
        counters["weight_versions"].append(Counter(times_us, np.concatenate([[base], held])))
        counters["memory_bytes"].append(_memory_counter(end_us, memory_bytes, peak_bytes))
        counters["sending_bytes"].append(Counter(times_us, np.concatenate([[0], sending_bytes])))
    losses_by = _mean_losses([r.losses for r in results if r is not None]) if losses is None else losses
    losses = [[losses_by.get((p, b), float("nan")) for b in range(schedule.minibatches)]
              for p in range(schedule.pipelines)]
    if all(r is not None for r in results):
        hardware = {**hardware, "compute": [results[rank].compute for rank in by_position]}
    meta = TraceMeta.of_schedule(
        "measured", schedule, spec.microbatch_size, hardware=hardware, seed=spec.seed, complete=complete,
        failed_rank=failed_rank,
        extra={"losses": losses, "optimizer": spec.optimizer, "lr": spec.lr, "dtype": spec.dtype,
               "bounds": next((r.bounds for r in results if r is not None), None if spec.bounds is None
                              else list(spec.bounds)),
               "model_options": dict(spec.model_options), "recv_window": spec.recv_window,
               "score_heldout": spec.heldout, "rank_order": spec.rank_order, "device_ranks": by_position,
               "model": spec.model if isinstance(spec.model, str) else getattr(spec.model, "__name__", "custom")})
    weights: list[dict[tuple[int, int], list[torch.Tensor]]] = [{} for _ in range(layout.replicas)]
    for rank, r in enumerate(results):
        if r is not None:
            weights[layout.place(rank)[1]].update({key: [torch.from_numpy(w) for w in ws]
                                                   for key, ws in r.weights.items()})
    if complete:
        weights = _whole_experts(weights, {k: i for r in results for k, i in r.routed.items()},
                                 schedule.expert_parallel)
    if complete and spec.heldout:
        meta.extra["heldout"] = heldout_scores(spec, weights[0], device=hardware.get("device", "cpu"))
    return RunResult(Trace(tuple(k.value for k in KINDS), layout.ranks, ops, meta, counters), losses, weights)
