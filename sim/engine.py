"""The SimPy model: one process per device walks its lowered rows in order, as a real runtime does.

`schedules.lower` makes every transfer explicit, so the runtime interprets three things: compute (busy for
the op's cost), SEND (the transfer is queued on the link's resources and the compute stream goes on, unless
the cluster says sends block), RECV (the compute stream waits until the data has arrived). Transfers are
reserved on their link when issued, which, since SimPy advances in time order, is first come first served
on shared links. Devices on one compute resource (ranks sharing a GPU, which the executor runs under one
lock per compute row) reserve it the same way for each compute row: a row starts when its device is ready
and the rows asked for before it have ended. That wait is not busy time: the trace shows it as a gap in the
device's compute stream, idle like any other, so the bubble counts it. Devices on one host's cores (CPU
ranks) share them by processor sharing: a compute row runs as soon as its device is ready, at the speed the
number of the host's devices computing at that moment allows, so it lasts longer while others compute too.
This module only prices the rows and runs them: nothing here knows a method by name.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass

import numpy as np
import simpy

from .. import __version__
from ..schedules import KIND_CODE, KINDS, Kind, Schedule, ScheduleError, validate
from ..schedules.lowering import Lowered, lower, preflight
from ..traces.trace import Counter, Ops, Stream, Trace, TraceMeta
from .cluster import Cluster
from .costs import Costs, RowOverhead

_PS_PER_MS = 1e9
_STREAM_OF_KIND = Stream.of_kinds(tuple(k.value for k in KINDS))


def _picoseconds(ms: np.ndarray) -> np.ndarray:
    """Times run on an integer picosecond clock: sums are exact and associative, so an op computed to
    start where the one before it ends starts exactly there, however its time was added up."""
    return np.round(np.asarray(ms, dtype=np.float64) * _PS_PER_MS).astype(np.int64)


class SimulationError(RuntimeError):
    """The model could not finish (a lowered order that waits for a transfer nobody sends)."""


@dataclass
class _Program:
    """The lowered rows priced: durations, transfer times and routes, memory and counter deltas, and one
    step list per device."""

    lowered: Lowered
    stream: np.ndarray
    # Per device, the rows it yields to SimPy at (its steps) in order: compute ps since the previous step,
    # stream, and the transfer id of a transfer or the duration of a compute row. Those are its transfers, and
    # its compute rows too if it shares a compute resource; otherwise a device's clock just adds their durations.
    steps: list[tuple[list[int], list[int], list[int]]]
    step_rows: list[np.ndarray]  # per device: its steps' rows, counted from its first row
    compute_unit: list[int | None]  # per device: the shared resource its compute rows queue on, if any
    host_unit: list[int | None]  # per device: the host whose cores its compute rows share, if any
    contention: tuple[float, ...]  # the hosts' slowdown with 1, 2, ... devices computing at once
    busy_before_ps: np.ndarray  # per row: compute time of its device's earlier rows
    duration_ps: np.ndarray
    transfer_ps: list[int]  # per transfer id
    routes: list[tuple[int, ...]]  # per transfer id: the shared resources it occupies (its channel's)
    num_resources: int
    mem_at_start: np.ndarray
    mem_at_end: np.ndarray
    act_at_start: np.ndarray
    act_at_end: np.ndarray
    static_bytes: list[int]


def _price(lowered: Lowered, costs: Costs, cluster: Cluster, jitter: float, seed: int) -> _Program:
    """Durations, transfer times and routes, and memory and counter deltas of the lowered rows."""
    schedule, t = lowered.schedule, lowered.table
    n = len(t.kind)
    stages = costs.stages
    kind, stage = t.kind, t.stage
    stream = _STREAM_OF_KIND[kind]
    compute = stream == Stream.COMPUTE

    op_ms = costs.op_ms_table(schedule.pipelines)
    overhead = costs.overhead
    computing_kind = np.where(compute, kind, 0)
    duration = np.where(compute, op_ms[stage, computing_kind] + np.asarray(overhead.compute_ms)[computing_kind], 0.0)
    spans = _gradient_spans(lowered)
    duration += spans.accumulating * np.asarray([c.accumulate_ms for c in stages])[stage]
    copying = (kind == KIND_CODE[Kind.OPT]) & (lowered.copies_delta > 0)  # copy-on-write: the old version stays
    duration += copying * np.asarray([c.copy_ms for c in stages])[stage]
    if jitter > 0:
        duration = duration * np.random.default_rng(seed).lognormal(0.0, jitter, n)
    duration = _picoseconds(duration)
    held = duration + _picoseconds(overhead.host_ms[kind])  # what each row keeps its device from its next row

    def per_stage(values: list[float]) -> np.ndarray:
        return np.asarray(values, dtype=np.int64)[stage]

    activation = per_stage([c.activation_bytes for c in stages])
    param = per_stage([c.param_bytes for c in stages])
    # A stage whose `held_bytes` is known holds its boundary tensors from F until its backward (a received
    # input becomes the forward's, a sent output stays its own); otherwise they are buffers of their own, a
    # received one freed when its consumer ends, a sent one when its transfer does.
    own_boundary = per_stage([c.held_bytes is not None for c in stages]).astype(bool)
    # An input from a stage on the same device is the producer's output itself (no transfer, one storage),
    # which the producer holds until its own backward, later than this stage's: it is counted there only.
    local_in = [0] * len(stages)
    for src, dst in schedule.graph.edges:
        if schedule.placement[src] == schedule.placement[dst] and stages[dst].held_bytes is not None:
            local_in[dst] += stages[src].output_bytes
    roots = per_stage([(c.held_bytes or 0) - local for c, local in zip(stages, local_in)])
    kept = np.round(activation * costs.wgrad_activation_fraction).astype(np.int64)  # held from I until W
    is_kind = {k: kind == KIND_CODE[k] for k in (Kind.F, Kind.B, Kind.I, Kind.W)}
    mem_at_start = np.where(is_kind[Kind.F], activation + roots, 0)
    mem_at_end = (-np.where(is_kind[Kind.B], activation + roots, 0)
                  - np.where(is_kind[Kind.I], activation - kept + roots, 0)
                  - np.where(is_kind[Kind.W], kept, 0) + lowered.copies_delta * param)
    kept_gradient = np.round(param[spans.opening] * costs.kept_gradients).astype(np.int64)
    mem_at_start[spans.opening] += kept_gradient  # a second gradient copy while the update's last one is kept
    mem_at_end[spans.closing] -= np.round(param[spans.closing] * costs.kept_gradients).astype(np.int64)
    act_at_start = is_kind[Kind.F].astype(np.int64)
    act_at_end = -(is_kind[Kind.B] | is_kind[Kind.W]).astype(np.int64)

    # A channel's transfers share their size, time and route.
    resources: dict[tuple[str, str], int] = {}
    routes, channel_ms, channel_bytes = [], [], []
    for channel in lowered.channels:
        link = cluster.link(channel.src_device, channel.dst_device)
        size = stages[channel.producer].output_bytes
        channel_bytes.append(size)
        channel_ms.append(link.transfer_ms(size))
        routes.append(() if link.resource is None else (resources.setdefault(("link", link.resource), len(resources)),))
    compute_unit = [None if len(peers) == 1 else resources.setdefault(("compute", cluster.compute[d]), len(resources))
                    for d, peers in enumerate(cluster.compute_peers(schedule.num_devices))]
    hosts: dict[str, int] = {}
    host_unit = [None if len(peers) == 1 or compute_unit[d] is not None
                 else hosts.setdefault(cluster.hosts[d], len(hosts))
                 for d, peers in enumerate(cluster.host_peers(schedule.num_devices))]
    transfer_ps = np.repeat(_picoseconds(np.asarray(channel_ms)), lowered.units).tolist()
    routes = [route for route in routes for _ in range(lowered.units)]  # one lookup per transfer when running
    rows = np.flatnonzero(~compute)
    if len(rows):
        sending = stream[rows] == Stream.SEND
        row_bytes = np.asarray(channel_bytes, dtype=np.int64)[lowered.channel_of(lowered.transfer[rows])]
        forward = np.isin(kind[rows], [KIND_CODE[Kind.SEND_F], KIND_CODE[Kind.RECV_F]])
        merged = forward & own_boundary[rows]  # an activation that is the stage's own from its F to its backward
        computing = np.flatnonzero(compute)
        # A SEND's buffer is made by its producer (the compute row before it) and held until the transfer ends
        # (merged: the stage holds it anyway).
        buffered = sending & ~merged
        np.add.at(mem_at_end, computing[np.searchsorted(computing, rows[buffered]) - 1], row_bytes[buffered])
        mem_at_start[rows] = np.where(sending, 0, row_bytes)
        mem_at_end[rows] = np.where(buffered, -row_bytes, 0)
        # A RECV's buffer lives until its consumer (the next compute row) ends; merged, it is the consumer's
        # from its start (the F's `held_bytes` or `activation_bytes` count it from there on).
        receiving, received = rows[~sending], row_bytes[~sending]
        consumer = computing[np.searchsorted(computing, receiving)]
        merged_in = merged[~sending]
        np.add.at(mem_at_end, consumer[~merged_in], -received[~merged_in])
        np.add.at(mem_at_start, consumer[merged_in], -received[merged_in])

    steps, step_rows = [], []
    busy_before = np.empty(n, dtype=np.int64)
    for d in range(schedule.num_devices):
        lo, hi = lowered.bounds[d], lowered.bounds[d + 1]
        busy_before[lo:hi] = np.cumsum(held[lo:hi]) - held[lo:hi]
        shared = compute_unit[d] is not None or host_unit[d] is not None
        mine = np.arange(hi - lo) if shared else np.flatnonzero(~compute[lo:hi])
        rows = lo + mine
        pre = np.diff(busy_before[rows], prepend=0)
        operand = np.where(compute[rows], duration[rows], lowered.transfer[rows])
        steps.append((pre.tolist(), stream[rows].tolist(), operand.tolist()))
        step_rows.append(mine)
    return _Program(lowered, stream, steps, step_rows, compute_unit, host_unit, cluster.contention, busy_before,
                    duration, transfer_ps, routes, len(resources), mem_at_start, mem_at_end, act_at_start, act_at_end,
                    static_bytes(schedule, costs))


@dataclass
class _GradientSpans:
    """Per stage replica, the B and W rows between two updates. `accumulating`: a B or W that adds into the
    buffer (not the first of its span, whose gradients become the buffer). `opening`: the first B or W of a span
    after an update, where a runtime that keeps the last gradient through the update allocates a second copy;
    `closing`: the OPT rows ending those spans, where the older copy goes."""

    accumulating: np.ndarray
    opening: np.ndarray
    closing: np.ndarray


def _gradient_spans(lowered: Lowered) -> _GradientSpans:
    t = lowered.table
    grads = (t.kind == KIND_CODE[Kind.B]) | (t.kind == KIND_CODE[Kind.W])
    rows = np.flatnonzero(grads | (t.kind == KIND_CODE[Kind.OPT]))
    replica = t.stage[rows] * lowered.schedule.pipelines + t.pipeline[rows]
    order = np.argsort(replica, kind="stable")  # by replica, each in program order (a replica is on one device)
    rows, replica = rows[order], replica[order]
    is_grad = grads[rows]
    before = np.cumsum(~is_grad) - ~is_grad  # updates before each row, counted on across replicas
    new_replica = np.r_[True, replica[1:] != replica[:-1]]
    own = before - before[new_replica][np.cumsum(new_replica) - 1]  # ... counted in its own replica
    span = replica * (len(rows) + 1) + own  # (replica, its updates before) as one number; an OPT closes its own
    starts = np.unique(span[is_grad], return_index=True)[1]
    first = rows[is_grad][starts]
    accumulating = grads.copy()
    accumulating[first] = False
    opening = first[own[is_grad][starts] > 0]
    closing = rows[~is_grad & (own > 0) & np.isin(span, span[is_grad])]
    return _GradientSpans(accumulating, opening, closing)


def static_bytes(schedule: Schedule, costs: Costs) -> list[int]:
    """Per device, the bytes held from start to end: weights, gradients and optimizer state of every stage
    it holds, per pipeline replica, plus the policy's extra weight copies. Its memory never drops below."""
    static = []
    for device in range(schedule.num_devices):
        mine = [costs.stages[s] for s in schedule.stages_on(device)]
        per_replica = sum(2 * c.param_bytes + c.optimizer_state_bytes for c in mine)  # weights, grads, state
        extra = schedule.policy.extra_copies * sum(c.param_bytes for c in mine)
        static.append(per_replica * schedule.pipelines + extra)
    return static


class _SharedCores:
    """One host's cores shared by processor sharing: while k pieces of work run on it (compute rows, and the
    runtime's host time between rows, which needs a core as much), each advances at 1 / slowdown[k - 1] of its
    speed alone (the last factor beyond the measured k). Work is in picoseconds alone; `run` gives the event
    that succeeds, with its end time, when a piece's work is done."""

    def __init__(self, env: simpy.Environment, slowdown: tuple[float, ...]) -> None:
        self.env, self.slowdown = env, slowdown
        self.left: dict[simpy.Event, float] = {}  # running rows: work still to do
        self.since = 0  # when `left` was last brought up to date
        self.next_end: simpy.Event | None = None  # the timer for the next row to finish; older ones are stale

    def run(self, work_ps: int) -> simpy.Event:
        self._advance()
        finished = self.env.event()
        self.left[finished] = float(work_ps)
        self._plan()
        return finished

    def _speed(self) -> float:
        return 1.0 / self.slowdown[min(len(self.left), len(self.slowdown)) - 1]

    def _advance(self) -> None:
        if self.left:
            done = (self.env.now - self.since) * self._speed()
            for row in self.left:
                self.left[row] -= done
        self.since = self.env.now

    def _plan(self) -> None:
        if not self.left:
            self.next_end = None
            return
        timer = self.next_end = self.env.timeout(max(0, math.ceil(min(self.left.values()) / self._speed())))
        timer.callbacks.append(lambda _: self._finish(timer))

    def _finish(self, timer: simpy.Event) -> None:
        if timer is not self.next_end:  # a row started or ended since: a later timer stands for it
            return
        self._advance()
        tolerance = self._speed()  # a picosecond's work: what rounding the timer to whole picoseconds leaves
        for row in [row for row, work in self.left.items() if work <= tolerance]:
            del self.left[row]
            row.succeed(self.env.now)
        self._plan()


class _Model:
    """The SimPy processes; times in integer picoseconds.

    Each device keeps its own clock and yields to SimPy only where another device's progress matters:
    to wait for a transfer not yet sent, and, before reserving a shared link or a shared compute resource,
    to let the simulated time reach its own clock, so shared resources serve requests in the order they were
    made (a capacity-one SimPy Resource held for the span would grant the same, at two events per row). A
    compute row on shared cores waits for its end, which the rows running beside it decide.
    Everything else (compute of its own, sends on private links) advances the device's clock without an
    event, which is exact because nothing else can observe it in between.
    """

    def __init__(self, program: _Program, overlap_comm: bool) -> None:
        self.env = simpy.Environment()
        self.program = program
        self.overlap_comm = overlap_comm
        n_transfers = len(program.transfer_ps)
        # Per device, per transfer: the device's clock once it is done (SEND issued, RECV arrived).
        self.clock_after: list[list[float]] = [[] for _ in program.steps]
        self.arrival: list[int | None] = [None] * n_transfers
        self.waiting: dict[int, simpy.Event] = {}
        self.free_at = [0] * program.num_resources
        self.cores = [_SharedCores(self.env, program.contention)
                      for _ in range(max((u + 1 for u in program.host_unit if u is not None), default=0))]
        # A row on shared cores lasts as long as they let it (a copy only where there are some), and so does
        # the host time before it (how much longer: its stretch).
        self.duration_ps = program.duration_ps.copy() if self.cores else program.duration_ps
        self.host_stretch_ps = np.zeros(len(program.duration_ps), dtype=np.int64)
        self.finished = 0

    def device(self, steps: tuple[list[int], list[int], list[int]], rows: np.ndarray, clock_after: list[int],
               unit: int | None, host: int | None):
        """One device's steps (`rows`: their global rows); `clock_after` gets its clock after each: a transfer's
        SEND issued or RECV arrived, a compute row's start (the clock after it is that plus its duration, in the
        next step's compute ps)."""
        env = self.env
        cores = self.cores[host] if host is not None else None
        duration = self.duration_ps
        arrival, waiting, free_at = self.arrival, self.waiting, self.free_at
        done = clock_after.append
        routes, transfer_ps, overlap = self.program.routes, self.program.transfer_ps, self.overlap_comm
        send, recv = int(Stream.SEND), int(Stream.RECV)  # plain ints: this loop runs once per step
        clock = computed_ps = 0  # computed_ps: the last compute row's own time, at the head of the next busy_ps
        for busy_ps, stream, xid, row in zip(*steps, rows.tolist() if cores else itertools.repeat(-1)):
            clock += busy_ps
            if cores is not None and busy_ps > computed_ps:  # the runtime's host time between rows shares them too
                host_ps = busy_ps - computed_ps
                if clock - host_ps > env.now:
                    yield env.timeout(clock - host_ps - env.now)
                end = yield cores.run(host_ps)
                self.host_stretch_ps[row] = end - clock
                clock = end
            computed_ps = 0
            if stream == send:
                route = routes[xid]
                if route:  # a shared link: wait until simulated time reaches the send, then queue on it
                    if clock > env.now:
                        yield env.timeout(clock - env.now)
                    begin = max(clock, *(free_at[r] for r in route))
                    end = begin + transfer_ps[xid]
                    for r in route:
                        free_at[r] = end
                else:
                    end = clock + transfer_ps[xid]
                arrival[xid] = end
                if xid in waiting:
                    waiting.pop(xid).succeed()
                if not overlap:
                    clock = end
            elif stream == recv:
                ready = arrival[xid]
                if ready is None:
                    event = waiting[xid] = env.event()
                    yield event
                    ready = arrival[xid]
                if ready > clock:
                    clock = ready
            else:  # a compute row on the shared compute resource `unit` or shared `cores`; `xid` is its duration
                if clock > env.now:
                    yield env.timeout(clock - env.now)
                if cores is not None:
                    end = yield cores.run(xid)
                    duration[row] = end - clock
                    done(clock)
                    clock, computed_ps = end - xid, xid  # the next step's compute ps count the row's duration alone
                    continue
                if free_at[unit] > clock:
                    clock = free_at[unit]
                free_at[unit] = clock + xid
            done(clock)
        self.finished += 1

    def run(self) -> None:
        program = self.program
        bounds = program.lowered.bounds
        for d, (steps, clock_after) in enumerate(zip(program.steps, self.clock_after)):
            self.env.process(self.device(steps, bounds[d] + program.step_rows[d], clock_after,
                                         program.compute_unit[d], program.host_unit[d]))
        self.env.run()


def simulate(
    schedule: Schedule, costs: Costs, cluster: Cluster, *, jitter: float = 0.0, seed: int = 0
) -> Trace:
    """Predict the timeline of `schedule` on `cluster` with `costs`; the same inputs give the same trace.

    `jitter` > 0 multiplies every compute time by a log-normal factor with that sigma, drawn from `seed`.
    """
    preflight(schedule)
    if len(costs.stages) != schedule.num_stages:
        raise ScheduleError(f"costs describe {len(costs.stages)} stages, the schedule has {schedule.num_stages}")
    if cluster.num_devices < schedule.num_devices:
        raise ScheduleError(
            f"{schedule.method} needs {schedule.num_devices} devices, the cluster has {cluster.num_devices}"
        )
    if jitter < 0:
        raise ScheduleError(f"jitter must be >= 0 (got {jitter})")
    program = _price(lower(schedule), costs, cluster, jitter, seed)
    model = _Model(program, cluster.overlap_comm)
    model.run()
    if model.finished < schedule.num_devices:
        validate(schedule)
        raise SimulationError(f"{schedule.method}: {schedule.num_devices - model.finished} devices never finished")
    return _trace(costs, cluster, program, model, jitter, seed)


def _trace(costs: Costs, cluster: Cluster, program: _Program, model: _Model, jitter: float, seed: int) -> Trace:
    lowered = program.lowered
    schedule, xid, t, bounds = lowered.schedule, lowered.transfer, lowered.table, lowered.bounds
    is_transfer = program.stream != Stream.COMPUTE
    issued_ps = _issue_times(program, model)
    start_ps = issued_ps.copy()
    end_ps = issued_ps + model.duration_ps
    if len(model.arrival):
        arrival = np.fromiter(model.arrival, np.int64, len(model.arrival))
        end_ps[is_transfer] = arrival[xid[is_transfer]]  # a transfer starts its duration before it arrives
        start_ps[is_transfer] = (arrival - np.asarray(program.transfer_ps, dtype=np.int64))[xid[is_transfer]]
    issued_ms, start_ms, end_ms = issued_ps / _PS_PER_MS, start_ps / _PS_PER_MS, end_ps / _PS_PER_MS
    ops = Ops(device=t.device, stream=program.stream, kind=t.kind, stage=t.stage, microbatch=t.microbatch,
              minibatch=t.minibatch, pipeline=t.pipeline, peer=t.peer, version=lowered.version,
              prediction=lowered.prediction, start_us=start_ms * 1e3, dur_us=(end_ps - start_ps) / (_PS_PER_MS / 1e3))

    # Event times: a SEND allocates when issued and frees when its transfer ends; a RECV allocates on arrival,
    # or where the runtime posts it ahead.
    first_ms = np.where(program.stream == Stream.RECV, end_ms, issued_ms)
    if costs.recv_window:
        receives, posted = _posting_rows(bounds, program.stream, costs.recv_window)
        first_ms[receives] = issued_ms[posted]
    devices = schedule.num_devices
    counters = {
        "memory_bytes": _step_counters(bounds, first_ms, end_ms, program.mem_at_start, program.mem_at_end,
                                       program.static_bytes),
        "activations": _step_counters(bounds, first_ms, end_ms, program.act_at_start, program.act_at_end,
                                      [0] * devices),
        "weight_versions": _level_counters(bounds, end_ms, lowered.held_after, 1 + schedule.policy.extra_copies),
    }
    meta = TraceMeta(
        source="predicted", schedule=schedule.method, params=dict(schedule.params),
        microbatches=schedule.microbatches, minibatches=schedule.minibatches, pipelines=schedule.pipelines,
        microbatch_size=costs.microbatch_size, placement=list(schedule.placement),
        stage_edges=[list(e) for e in schedule.graph.edges], policy=schedule.policy.describe(),
        tool=f"pipesim {__version__}", costs=[dict(vars(c)) for c in costs.stages], cluster=cluster.describe(),
        jitter=jitter, seed=seed, calibration=costs.calibration,
        extra=_runtime_terms(costs))
    return Trace(tuple(k.value for k in KINDS), devices, ops, meta, counters)


def _runtime_terms(costs: Costs) -> dict:
    """The runtime's terms the prediction used, for its metadata (none: a what-if without them)."""
    terms = {}
    if costs.overhead != RowOverhead():
        terms["row_overhead"] = asdict(costs.overhead)
    if costs.kept_gradients:
        terms["kept_gradients"] = costs.kept_gradients
    if costs.recv_window:
        terms["recv_window"] = costs.recv_window
    return terms


def _posting_rows(bounds: Sequence[int], stream: np.ndarray, window: int) -> tuple[np.ndarray, np.ndarray]:
    """Every RECV row, and the row at whose start its receive is posted: a device keeps `window` receives
    posted, in program order, so the k-th posts at its first row (k < window), else right after the RECV row
    of the (k - window)-th takes its message."""
    receives, posted = [], []
    for lo, hi in itertools.pairwise(bounds):
        mine = lo + np.flatnonzero(stream[lo:hi] == Stream.RECV)
        receives.append(mine)
        posted.append(np.concatenate([np.full(min(window, len(mine)), lo), mine[:-window] + 1]) if len(mine)
                      else mine)
    return np.concatenate(receives), np.concatenate(posted)


def _issue_times(program: _Program, model: _Model) -> np.ndarray:
    """When each row was issued (compute: start; SEND: issued; RECV: wait began): the device's clock
    after its last step before the row, plus the compute time since; a compute step starts at its clock."""
    bounds = program.lowered.bounds
    out = np.empty(len(program.stream), dtype=np.int64)
    stretch = model.duration_ps - program.duration_ps if model.duration_ps is not program.duration_ps else None
    for d, (clock_after, steps) in enumerate(zip(model.clock_after, program.step_rows)):
        lo, hi = bounds[d], bounds[d + 1]
        busy = program.busy_before_ps[lo:hi]
        segment = np.searchsorted(steps, np.arange(hi - lo))  # steps before each row
        clocks = np.zeros(len(clock_after) + 1, dtype=np.int64)
        clocks[1:] = np.fromiter(clock_after, np.int64, len(clock_after))
        base = np.concatenate([[0], busy[steps]])[segment]
        out[lo:hi] = clocks[segment] + (busy - base)
        if stretch is not None:  # a row after one stretched on shared cores (all of whose rows are steps) starts later
            out[lo + 1:hi] += stretch[lo:hi - 1]
            out[lo:hi] += model.host_stretch_ps[lo:hi]  # ... as does one after host time they stretched
        queued = program.stream[lo + steps] == Stream.COMPUTE
        out[lo + steps[queued]] = clocks[1:][queued]
    return out


def _step_counters(bounds, first_ms, second_ms, first_delta, second_delta, initial) -> list[Counter]:
    """Per device (rows bounds[d]..bounds[d+1], in program order), the running total of deltas applied at
    two event times per op, in time order (ties keep program order, so an op's end counts before the next
    op's start)."""
    times = np.stack([first_ms, second_ms], axis=1).ravel()  # program order: op i's two events at 2i, 2i+1
    deltas = np.stack([first_delta, second_delta], axis=1).ravel()
    out = []
    for d, (lo, hi) in enumerate(zip(bounds[:-1], bounds[1:])):
        mine_times, mine_deltas = times[2 * lo:2 * hi], deltas[2 * lo:2 * hi]
        keep = mine_deltas != 0
        mine_times, mine_deltas = mine_times[keep], mine_deltas[keep]
        order = np.argsort(mine_times, kind="stable")
        values = initial[d] + np.cumsum(mine_deltas[order])
        out.append(Counter(np.concatenate([[0.0], mine_times[order] * 1e3]),
                           np.concatenate([[initial[d]], values]).astype(np.int64)))
    return out


def _level_counters(bounds, end_ms, level, initial) -> list[Counter]:
    """Per device (rows bounds[d]..bounds[d+1]), samples of `level` (valid after each op ends) wherever
    it changes."""
    out = []
    for lo, hi in zip(bounds[:-1], bounds[1:]):
        times, values = end_ms[lo:hi] * 1e3, level[lo:hi]
        change = np.ones(len(values), dtype=bool)
        change[1:] = values[1:] != values[:-1]
        out.append(Counter(np.concatenate([[0.0], times[change]]), np.concatenate([[initial], values[change]])))
    return out
