"""The SimPy model: one process per device walks its action list in order, as a real runtime does.

A device has a compute stream and separate send and receive streams. The schedule is first lowered by
`add_communication`, so the runtime only interprets three things: compute (busy for the op's cost),
SEND (the transfer is queued on the link's resources and the compute stream goes on, unless the
cluster says sends block), RECV (the compute stream waits until the data has arrived). Transfers are
reserved on their link when issued, which, since SimPy advances in time order, is first come first
served on shared links. Nothing here knows a method by name.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import simpy

from .. import __version__
from ..schedules import (
    KIND_CODE,
    KINDS,
    NUM_COMPUTE_KINDS,
    ActionTable,
    Kind,
    Schedule,
    ScheduleError,
    communication_table,
    kind_mask,
    check_complete,
    local_order_ok,
    validate,
    weight_versions,
)
from ..traces.trace import Counter, Ops, Trace
from .cluster import Cluster
from .costs import Costs

_COMPUTE, _SEND, _RECV = 0, 1, 2
_PS_PER_MS = 1e9


def _picoseconds(ms: np.ndarray) -> np.ndarray:
    """Times run on an integer picosecond clock: sums are exact and associative, so an op computed to
    start where the one before it ends starts exactly there, however its time was added up."""
    return np.round(np.asarray(ms, dtype=np.float64) * _PS_PER_MS).astype(np.int64)


class SimulationError(RuntimeError):
    """The model could not finish (a lowered order that waits for a transfer nobody sends)."""


@dataclass
class _Program:
    """The lowered schedule as flat arrays, one row per op (its gid), and one step list per device."""

    table: ActionTable
    # Per device, its transfers in order: compute ps since the previous one, code, transfer id. Compute
    # ops need no step of their own: between transfers a device's clock just adds their durations.
    steps: list[tuple[list[int], list[int], list[int]]]
    bounds: np.ndarray  # rows of device d: bounds[d]..bounds[d+1]
    busy_before_ps: np.ndarray  # per row: compute time of its device's earlier rows
    code: np.ndarray
    duration_ps: np.ndarray
    transfer: np.ndarray
    version: np.ndarray
    prediction: np.ndarray
    transfer_ps: list[int]
    routes: list[tuple[int, ...]]  # distinct routes (resource ids a transfer occupies)
    transfer_route: list[int]  # per transfer id: its index in `routes`
    num_resources: int
    mem_at_start: np.ndarray
    mem_at_end: np.ndarray
    act_at_start: np.ndarray
    act_at_end: np.ndarray
    held_after: np.ndarray
    static_bytes: list[int]


def _scatter(values: np.ndarray, origin: np.ndarray, fill: int) -> np.ndarray:
    """Spread per-action values of the schedule onto the lowered rows (inserted transfers get `fill`)."""
    return np.where(origin >= 0, values[np.maximum(origin, 0)], fill)


def _lower(schedule: Schedule, costs: Costs, cluster: Cluster, jitter: float, seed: int) -> _Program:
    """Turn the schedule into arrays: durations, transfers and their routes, memory and counter deltas."""
    t, origin = communication_table(schedule)
    versions = weight_versions(schedule)
    n = len(t.kind)
    stages = costs.stages
    kind, stage = t.kind, t.stage
    code = np.where(kind < NUM_COMPUTE_KINDS, _COMPUTE,
                    np.where(kind_mask(kind, Kind.SEND_F, Kind.SEND_B), _SEND, _RECV))
    compute = code == _COMPUTE

    op_ms = np.array([[costs.op_ms(k.value, s) for s in range(schedule.num_stages)]
                      for k in KINDS[:NUM_COMPUTE_KINDS]])
    duration = np.where(compute, op_ms[np.where(compute, kind, 0), stage], 0.0)
    if jitter > 0:
        duration = duration * np.random.default_rng(seed).lognormal(0.0, jitter, n)
    duration = _picoseconds(duration)

    def per_stage(values: list[float]) -> np.ndarray:
        return np.asarray(values, dtype=np.int64)[stage]

    activation = per_stage([c.activation_bytes for c in stages])
    param = per_stage([c.param_bytes for c in stages])
    kept = np.round(activation * costs.wgrad_activation_fraction).astype(np.int64)  # held from I until W
    is_kind = {k: kind == KIND_CODE[k] for k in (Kind.F, Kind.B, Kind.I, Kind.W)}
    mem_at_start = np.where(is_kind[Kind.F], activation, 0)
    mem_at_end = (-np.where(is_kind[Kind.B], activation, 0) - np.where(is_kind[Kind.I], activation - kept, 0)
                  - np.where(is_kind[Kind.W], kept, 0) + _scatter(versions.copies_delta, origin, 0) * param)
    act_at_start = is_kind[Kind.F].astype(np.int64)
    act_at_end = -(is_kind[Kind.B] | is_kind[Kind.W]).astype(np.int64)

    # Transfers: a SEND and its RECV share one id, (cross-device edge, direction, unit), so ids are
    # dense and found without matching; size, time and route depend only on the edge and direction.
    transfer = np.full(n, -1, dtype=np.int64)
    rows = np.flatnonzero(~compute)
    transfer_ps: list[int] = []
    routes: list[tuple[int, ...]] = []
    transfer_route: list[int] = []
    resources: dict[str, int] = {}
    if len(rows):
        sending = code[rows] == _SEND
        forward = kind_mask(kind[rows], Kind.SEND_F, Kind.RECV_F)
        sender = np.where(sending, stage[rows], t.peer[rows])
        receiver = np.where(sending, t.peer[rows], stage[rows])
        num_stages = schedule.num_stages
        edges = np.array([e for e in schedule.graph.edges
                          if schedule.placement[e[0]] != schedule.placement[e[1]]], dtype=np.int64)
        edge_keys = edges[:, 0] * num_stages + edges[:, 1]
        by_key = np.argsort(edge_keys)
        edge = by_key[np.searchsorted(edge_keys[by_key], np.where(forward, sender * num_stages + receiver,
                                                                   receiver * num_stages + sender))]
        units = schedule.microbatches * schedule.minibatches * schedule.pipelines
        unit = ((t.microbatch[rows] * schedule.minibatches + t.minibatch[rows]) * schedule.pipelines
                + t.pipeline[rows])
        combo = edge * 2 + ~forward  # (edge, direction)
        transfer[rows] = combo * units + unit
        output = np.asarray([c.output_bytes for c in stages], dtype=np.int64)
        combo_bytes = np.repeat(output[edges[:, 0]], 2)  # a gradient has its activation's size
        placement = np.asarray(schedule.placement)
        combo_src = np.stack([placement[edges[:, 0]], placement[edges[:, 1]]], axis=1).ravel()
        combo_dst = np.stack([placement[edges[:, 1]], placement[edges[:, 0]]], axis=1).ravel()
        combo_ms = []
        for a, b, size in zip(combo_src.tolist(), combo_dst.tolist(), combo_bytes.tolist()):
            link = cluster.link(a, b)
            combo_ms.append(link.transfer_ms(size))
            routes.append(() if link.resource is None else (resources.setdefault(link.resource, len(resources)),))
        transfer_ps = np.repeat(_picoseconds(np.asarray(combo_ms)), units).tolist()
        transfer_route = np.repeat(np.arange(len(routes)), units).tolist()
        row_bytes = combo_bytes[combo]
        mem_at_start[rows] = row_bytes  # a SEND holds its buffer until the transfer ends,
        mem_at_end[rows] = np.where(sending, -row_bytes, 0)
        recv_rows = rows[~sending]  # a RECV's buffer lives until its consumer (the next compute op) ends
        consumer = np.flatnonzero(compute)[np.searchsorted(np.flatnonzero(compute), recv_rows)]
        np.add.at(mem_at_end, consumer, -row_bytes[~sending])

    steps = []
    busy_before = np.empty(n, dtype=np.int64)
    bounds = np.searchsorted(t.device, np.arange(schedule.num_devices + 1))
    for d in range(schedule.num_devices):
        lo, hi = bounds[d], bounds[d + 1]
        busy_before[lo:hi] = np.cumsum(duration[lo:hi]) - duration[lo:hi]
        comm = lo + np.flatnonzero(code[lo:hi] != _COMPUTE)
        pre = np.diff(busy_before[comm], prepend=0)
        steps.append((pre.tolist(), code[comm].tolist(), transfer[comm].tolist()))
    # A transfer keeps the weight-copy level of the compute op before it on its device (1 before any).
    last_compute = np.maximum.accumulate(np.where(origin >= 0, np.arange(n), 0))
    unused = 1 + schedule.policy.extra_copies
    held = _scatter(versions.held_after, origin, unused)[last_compute]
    held = np.where(t.device[last_compute] == t.device, held, unused)
    return _Program(t, steps, bounds, busy_before, code, duration, transfer, _scatter(versions.read, origin, -1),
                    _scatter(versions.prediction, origin, -1), transfer_ps, routes, transfer_route, len(resources),
                    mem_at_start, mem_at_end, act_at_start, act_at_end, held, static_bytes(schedule, costs))


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


class _Model:
    """The SimPy processes; times in integer picoseconds.

    Each device keeps its own clock and yields to SimPy only where another device's progress matters:
    to wait for a transfer not yet sent, and, before reserving a shared link, to let the simulated time
    reach its own clock, so shared links serve transfers in the order they were issued. Everything else
    (compute, sends on private links) advances the device's clock without an event, which is exact
    because nothing else can observe it in between.
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
        self.finished = 0

    def device(self, steps: tuple[list[float], list[int], list[int]], clock_after: list[float]):
        env = self.env
        arrival, waiting, free_at = self.arrival, self.waiting, self.free_at
        done = clock_after.append
        routes, transfer_ps, overlap = self.program.routes, self.program.transfer_ps, self.overlap_comm
        transfer_route = self.program.transfer_route
        clock = 0
        for busy_ps, code, xid in zip(*steps):
            clock += busy_ps
            if code == _SEND:
                route = routes[transfer_route[xid]]
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
            else:
                ready = arrival[xid]
                if ready is None:
                    event = waiting[xid] = env.event()
                    yield event
                    ready = arrival[xid]
                if ready > clock:
                    clock = ready
            done(clock)
        self.finished += 1

    def run(self) -> None:
        for steps, clock_after in zip(self.program.steps, self.clock_after):
            self.env.process(self.device(steps, clock_after))
        self.env.run()


def simulate(
    schedule: Schedule, costs: Costs, cluster: Cluster, *, jitter: float = 0.0, seed: int = 0
) -> Trace:
    """Predict the timeline of `schedule` on `cluster` with `costs`; the same inputs give the same trace.

    `jitter` > 0 multiplies every compute time by a log-normal factor with that sigma, drawn from `seed`.
    """
    check_complete(schedule)
    if not local_order_ok(schedule):
        validate(schedule)  # names, per device, the first action that can never start
    if len(costs.stages) != schedule.num_stages:
        raise ScheduleError(f"costs describe {len(costs.stages)} stages, the schedule has {schedule.num_stages}")
    if cluster.num_devices < schedule.num_devices:
        raise ScheduleError(
            f"{schedule.method} needs {schedule.num_devices} devices, the cluster has {cluster.num_devices}"
        )
    if jitter < 0:
        raise ScheduleError(f"jitter must be >= 0 (got {jitter})")
    program = _lower(schedule, costs, cluster, jitter, seed)
    model = _Model(program, cluster.overlap_comm)
    model.run()
    if model.finished < schedule.num_devices:
        validate(schedule)
        raise SimulationError(f"{schedule.method}: {schedule.num_devices - model.finished} devices never finished")
    return _trace(schedule, costs, cluster, program, model, jitter, seed)


def _trace(schedule: Schedule, costs: Costs, cluster: Cluster, program: _Program, model: _Model, jitter: float,
           seed: int) -> Trace:
    code, xid, t = program.code, program.transfer, program.table
    is_transfer = code != _COMPUTE
    issued_ps = _issue_times(program, model)
    start_ps = issued_ps.copy()
    end_ps = issued_ps + program.duration_ps
    if len(model.arrival):
        arrival = np.fromiter(model.arrival, np.int64, len(model.arrival))
        end_ps[is_transfer] = arrival[xid[is_transfer]]  # a transfer starts its duration before it arrives
        start_ps[is_transfer] = (arrival - np.asarray(program.transfer_ps, dtype=np.int64))[xid[is_transfer]]
    issued_ms, start_ms, end_ms = issued_ps / _PS_PER_MS, start_ps / _PS_PER_MS, end_ps / _PS_PER_MS
    ops = Ops(device=t.device, stream=code, kind=t.kind, stage=t.stage, microbatch=t.microbatch,
              minibatch=t.minibatch, pipeline=t.pipeline, peer=t.peer, version=program.version,
              prediction=program.prediction, start_us=start_ms * 1e3, dur_us=(end_ps - start_ps) / (_PS_PER_MS / 1e3))

    # Event times: a SEND allocates when issued and frees when its transfer ends; a RECV allocates on arrival.
    first_ms = np.where(code == _RECV, end_ms, issued_ms)
    devices = schedule.num_devices
    counters = {
        "memory_bytes": _step_counters(program.bounds, first_ms, end_ms, program.mem_at_start, program.mem_at_end,
                                       program.static_bytes),
        "activations": _step_counters(program.bounds, first_ms, end_ms, program.act_at_start, program.act_at_end,
                                      [0] * devices),
        "weight_versions": _level_counters(program.bounds, end_ms, program.held_after,
                                           1 + schedule.policy.extra_copies),
    }
    meta = {
        "source": "simulated",
        "tool": f"pipesim {__version__}",
        "schedule": schedule.method,
        "params": dict(schedule.params),
        "microbatches": schedule.microbatches,
        "minibatches": schedule.minibatches,
        "pipelines": schedule.pipelines,
        "microbatch_size": costs.microbatch_size,
        "placement": list(schedule.placement),
        "stage_edges": [list(e) for e in schedule.graph.edges],
        "policy": schedule.policy.describe(),
        "costs": [dict(vars(c)) for c in costs.stages],
        "cluster": cluster.describe(),
        "jitter": jitter,
        "seed": seed,
    }
    return Trace(tuple(k.value for k in KINDS), devices, ops, counters, meta)


def _issue_times(program: _Program, model: _Model) -> np.ndarray:
    """When each row was issued (compute: start; SEND: issued; RECV: wait began): the device's clock
    after its last transfer before the row, plus the compute time since."""
    out = np.empty(len(program.code), dtype=np.int64)
    for d, clock_after in enumerate(model.clock_after):
        lo, hi = program.bounds[d], program.bounds[d + 1]
        busy = program.busy_before_ps[lo:hi]
        comm = np.flatnonzero(program.code[lo:hi] != _COMPUTE)
        segment = np.searchsorted(comm, np.arange(hi - lo))  # transfers before each row
        begin = np.zeros(len(clock_after) + 1, dtype=np.int64)
        begin[1:] = np.fromiter(clock_after, np.int64, len(clock_after))
        begin = begin[segment]
        base = np.concatenate([[0], busy[comm]])[segment]
        out[lo:hi] = begin + (busy - base)
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
