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


class SimulationError(RuntimeError):
    """The model could not finish (a lowered order that waits for a transfer nobody sends)."""


@dataclass
class _Program:
    """The lowered schedule as flat arrays, one row per op (its gid), and one step list per device."""

    table: ActionTable
    steps: list[tuple[list[int], list[float], list[int]]]  # per device, its rows in order: code, ms, transfer id
    code: np.ndarray
    duration_ms: np.ndarray
    transfer: np.ndarray
    version: np.ndarray
    prediction: np.ndarray
    transfer_ms: list[float]
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

    # Transfers: a SEND and its RECV share one id; size, time and route come per id.
    transfer = np.full(n, -1, dtype=np.int64)
    rows = np.flatnonzero(~compute)
    transfer_ms: list[float] = []
    routes: list[tuple[int, ...]] = []
    transfer_route: list[int] = []
    resources: dict[str, int] = {}
    if len(rows):
        sending = code[rows] == _SEND
        forward = kind_mask(kind[rows], Kind.SEND_F, Kind.RECV_F)
        sender = np.where(sending, stage[rows], t.peer[rows])
        receiver = np.where(sending, t.peer[rows], stage[rows])
        p, m = schedule.num_stages, schedule.microbatches
        key = (((forward * p + sender) * p + receiver) * m + t.microbatch[rows]) * schedule.minibatches
        key = (key + t.minibatch[rows]) * schedule.pipelines + t.pipeline[rows]
        _, first, ids = np.unique(key, return_index=True, return_inverse=True)
        transfer[rows] = ids.ravel()
        output = np.asarray([c.output_bytes for c in stages], dtype=np.int64)
        nbytes = np.where(forward, output[sender], output[receiver])[first]
        placement = np.asarray(schedule.placement)
        src, dst = placement[sender[first]], placement[receiver[first]]
        sizes, size_of = np.unique(nbytes, return_inverse=True)
        key = (src * schedule.num_devices + dst) * len(sizes) + size_of.ravel()
        _, combo_first, combo_of = np.unique(key, return_index=True, return_inverse=True)
        combo_ms, combo_route = [], []
        for a, b, size in zip(src[combo_first].tolist(), dst[combo_first].tolist(), nbytes[combo_first].tolist()):
            link = cluster.link(a, b)
            combo_ms.append(link.transfer_ms(size))
            combo_route.append(() if link.resource is None else (resources.setdefault(link.resource, len(resources)),))
        combo_of = combo_of.ravel()
        transfer_ms = np.asarray(combo_ms)[combo_of].tolist()
        transfer_route = combo_of.tolist()
        routes = combo_route
        row_bytes = nbytes[ids.ravel()]
        mem_at_start[rows] = row_bytes  # a SEND holds its buffer until the transfer ends,
        mem_at_end[rows] = np.where(sending, -row_bytes, 0)
        recv_rows = rows[~sending]  # a RECV's buffer lives until its consumer (the next compute op) ends
        consumer = np.flatnonzero(compute)[np.searchsorted(np.flatnonzero(compute), recv_rows)]
        np.add.at(mem_at_end, consumer, -row_bytes[~sending])

    steps = []
    bounds = np.searchsorted(t.device, np.arange(schedule.num_devices + 1))
    for d in range(schedule.num_devices):
        lo, hi = bounds[d], bounds[d + 1]
        steps.append((code[lo:hi].tolist(), duration[lo:hi].tolist(), transfer[lo:hi].tolist()))
    static = []
    for device in range(schedule.num_devices):
        mine = [stages[s] for s in schedule.stages_on(device)]
        per_replica = sum(2 * c.param_bytes + c.optimizer_state_bytes for c in mine)  # weights, grads, state
        extra = schedule.policy.extra_copies * sum(c.param_bytes for c in mine)
        static.append(per_replica * schedule.pipelines + extra)
    # A transfer keeps the weight-copy level of the compute op before it on its device (1 before any).
    last_compute = np.maximum.accumulate(np.where(origin >= 0, np.arange(n), 0))
    unused = 1 + schedule.policy.extra_copies
    held = _scatter(versions.held_after, origin, unused)[last_compute]
    held = np.where(t.device[last_compute] == t.device, held, unused)
    return _Program(t, steps, code, duration, transfer, _scatter(versions.read, origin, -1),
                    _scatter(versions.prediction, origin, -1), transfer_ms, routes, transfer_route, len(resources),
                    mem_at_start, mem_at_end, act_at_start, act_at_end, held, static)


class _Model:
    """The SimPy processes; times in milliseconds.

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
        n_transfers = len(program.transfer_ms)
        # Per device, per row: compute: op start; SEND: when issued; RECV: when the wait began.
        self.starts: list[list[float]] = [[] for _ in program.steps]
        self.transfer_start = [0.0] * n_transfers
        self.arrival: list[float | None] = [None] * n_transfers
        self.waiting: dict[int, simpy.Event] = {}
        self.free_at = [0.0] * program.num_resources
        self.finished = 0

    def device(self, steps: tuple[list[int], list[float], list[int]], starts: list[float]):
        env = self.env
        arrival, waiting, free_at = self.arrival, self.waiting, self.free_at
        issue = starts.append
        routes, transfer_ms, overlap = self.program.routes, self.program.transfer_ms, self.overlap_comm
        transfer_route = self.program.transfer_route
        clock = 0.0
        for code, duration, xid in zip(*steps):
            issue(clock)
            if code == _COMPUTE:
                clock += duration
            elif code == _SEND:
                route = routes[transfer_route[xid]]
                begin = clock
                if route:
                    if clock > env.now:
                        yield env.timeout(clock - env.now)
                    for r in route:
                        if free_at[r] > begin:
                            begin = free_at[r]
                end = begin + transfer_ms[xid]
                for r in route:
                    free_at[r] = end
                self.transfer_start[xid] = begin
                arrival[xid] = end
                event = waiting.pop(xid, None)
                if event is not None:
                    event.succeed()
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
        self.finished += 1

    def run(self) -> None:
        for steps, starts in zip(self.program.steps, self.starts):
            self.env.process(self.device(steps, starts))
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
    issued_ms = np.concatenate([np.asarray(s, dtype=np.float64) for s in model.starts])
    start_ms = issued_ms.copy()
    end_ms = issued_ms + program.duration_ms
    if len(model.arrival):
        start_ms[is_transfer] = np.asarray(model.transfer_start)[xid[is_transfer]]
        end_ms[is_transfer] = np.asarray(model.arrival, dtype=np.float64)[xid[is_transfer]]
    ops = Ops(device=t.device, stream=code, kind=t.kind, stage=t.stage, microbatch=t.microbatch,
              minibatch=t.minibatch, pipeline=t.pipeline, peer=t.peer, version=program.version,
              prediction=program.prediction, start_us=start_ms * 1e3, dur_us=(end_ms - start_ms) * 1e3)

    # Event times: a SEND allocates when issued and frees when its transfer ends; a RECV allocates on arrival.
    first_ms = np.where(code == _RECV, end_ms, issued_ms)
    devices = schedule.num_devices
    counters = {
        "memory_bytes": _step_counters(t.device, first_ms, end_ms, program.mem_at_start, program.mem_at_end,
                                       program.static_bytes, devices),
        "activations": _step_counters(t.device, first_ms, end_ms, program.act_at_start, program.act_at_end,
                                      [0] * devices, devices),
        "weight_versions": _level_counters(t.device, end_ms, program.held_after, devices),
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


def _step_counters(device, first_ms, second_ms, first_delta, second_delta, initial, num_devices) -> list[Counter]:
    """Per device, the running total of deltas applied at two event times per op, in time order
    (ties keep program order, so an op's end counts before the next op's start). Rows come grouped
    by device, in program order."""
    times = np.stack([first_ms, second_ms], axis=1).ravel()  # program order: op i's two events at 2i, 2i+1
    deltas = np.stack([first_delta, second_delta], axis=1).ravel()
    devices = np.repeat(device, 2)
    keep = deltas != 0
    times, deltas, devices = times[keep], deltas[keep], devices[keep]
    out = []
    for d in range(num_devices):
        lo, hi = np.searchsorted(devices, [d, d + 1])
        order = np.argsort(times[lo:hi], kind="stable")
        values = initial[d] + np.cumsum(deltas[lo:hi][order])
        out.append(Counter(np.concatenate([[0.0], times[lo:hi][order] * 1e3]),
                           np.concatenate([[initial[d]], values]).astype(np.int64)))
    return out


def _level_counters(device, end_ms, level, num_devices) -> list[Counter]:
    """Per device, samples of `level` (valid after each op ends) wherever it changes."""
    out = []
    for d in range(num_devices):
        mine = device == d
        times, values = end_ms[mine] * 1e3, level[mine]
        change = np.ones(len(values), dtype=bool)
        change[1:] = values[1:] != values[:-1]
        out.append(Counter(np.concatenate([[0.0], times[change]]), np.concatenate([[1], values[change]])))
    return out
