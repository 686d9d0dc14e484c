"""The SimPy model: one process per device walks its lowered rows in order, as a real runtime does (where no
resource is shared, the same processes run as plain coroutines: see `_Model`).

`schedules.lower` makes every transfer explicit, so the runtime interprets three things: compute (busy for
the op's cost), SEND (the transfer is queued on the link's resources and the compute stream goes on, unless
the cluster says exchanges block: then a device posts the SENDs and RECVs between two of its other rows together,
each SEND moves once its receiver has posted the RECV, and the device waits for them all, the rows lowered in such
a runtime's order, `exchange_order`), RECV (the compute stream waits until the data has arrived). Transfers are
reserved on their link when issued, which, since SimPy advances in time order, is first come first served
on shared links. A collective (REDUCE, GATHER: data-parallel replicas synchronising; a pass's all-to-alls or
context ring) runs on the device's network stream, beside its compute and after the collectives issued before it
on its link (`Costs.collective_links`), and the row that needs its result (`Lowered.awaits`) waits for it to
end. Devices on one compute resource (ranks sharing a GPU, which the executor runs under one lock per compute
row) reserve it the same way for each compute row: a row starts when its device is ready and the rows asked for
before it have ended. That wait is not busy time: the trace shows it as a gap in the device's compute stream,
idle like any other, so the bubble counts it. Devices on one host's cores (CPU ranks) share them by processor
sharing: a compute row runs as soon as its device is ready, at the speed the number of the host's devices
computing at that moment allows, so it lasts longer while others compute too. Where transfers hold the compute
beside them (`Costs.transfers_hold_products`: NCCL's kernels beside persistent products), a device's compute is
held back while a kernel of one of its transfers runs (a send's from its issue until its data has arrived, a
receive's while its data moves), each product it meets by the kernel's time left or its own, the less
(sim/costs.py `held_compute`), and the devices run in simulated time order, so that each knows the transfers beside its
compute. Where devices share nothing but links each taken by one device's sends (a queue per link
direction, as estimates and calibrations price them), none of this needs SimPy (`_Model._run_timed`).
This module only prices the rows and runs them: nothing here knows a method by name.
"""

from __future__ import annotations

import array
import collections
import heapq
import itertools
import math
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from operator import attrgetter

import numpy as np
import simpy

from ..memory_parts import MEMORY_PARTS, SAVERS
from ..profiles.partition import product_mean_ms
from ..schedules import (
    KIND_CODE,
    KINDS,
    NUM_COMPUTE_KINDS,
    PASS_COLLECTIVE_KINDS,
    ActionTable,
    Kind,
    Schedule,
    ScheduleError,
    kind_mask,
    resting_copies,
    validate,
)
from ..schedules.lowering import Lowered, lower, preflight
from ..schedules.passes import exchange_begins
from ..traces.trace import Counter, Ops, Stream, Trace, TraceMeta
from ..units import COUNTER_LIMIT
from .cluster import Cluster
from .costs import (
    TRANSIENT_KINDS,
    CostError,
    Costs,
    RowOverhead,
    StageCosts,
    held_compute,
    kept_until_update_refusal,
)

_PS_PER_MS = 1e9
# `_Model._lockstep`: the steps per sweep, over a window of sweeps, above which sweeping pays (a sweep costs about
# as much as 25 steps one at a time).
_SWEEP_PAYS = 32
_SWEEP_WINDOW = 256
# `_Model.frontier` of a device with no steps left: it sends nothing more.
_NEVER = 2**63 - 1
# `_Model.awaited` of a device waiting for nothing.
_AWAITS_NONE = (-1, -1)
# `_Program.steps`' streams of a blocking exchange's SENDs where it has several: its first, and those after it, issued
# with it, each once its own receiver has posted (`_Model._exchange_sends`).
_FIRST, _BESIDE = 5, 4
# SimPy's priority of an event processed after every other of its time (theirs: NORMAL, 1): a device that waits so
# knows every post made up to then (`_Model._exchange_sends`).
_SETTLED = 2
# A byte per row: the stream column is compared over millions of rows, and the trace widens it once.
_STREAM_OF_KIND = Stream.of_kinds(tuple(k.value for k in KINDS)).astype(np.int8)


# What a run's times are, by the input that sets them: what `_clock_refusal` names for the user to lower.
_CLOCK_PARTS = {"compute": "the rows' compute (--fwd, --bwd, a profile's or --gpu's times)",
                "transfers": "the transfers between stages (--comm, or a --cluster file's latency_us, "
                             "bandwidth_gb_per_s or table)",
                "collectives": "the collectives (all-reduces, all-to-alls: their links' or the profile's times)"}


def _picoseconds(ms: np.ndarray, part: str = "compute") -> np.ndarray:
    """Times run on an integer picosecond clock: sums are exact and associative, so an op computed to
    start where the one before it ends starts exactly there, however its time was added up. `part`: of
    `_CLOCK_PARTS`, what sets them."""
    ps = np.asarray(ms, dtype=np.float64) * _PS_PER_MS
    if ps.size and not ps.max() < COUNTER_LIMIT:  # a time the clock cannot hold: refused, not cast to garbage
        raise _clock_refusal(float(ps.max()), part)
    return np.round(ps, out=ps).astype(np.int64)


def _clock_refusal(ps: float, part: str) -> CostError:
    most_ms = COUNTER_LIMIT / _PS_PER_MS
    return CostError(f"the run's times add up to {ps / _PS_PER_MS:.3g} ms, more than the simulator's picosecond "
                     f"clock holds ({most_ms:.3g} ms, about {most_ms / 86_400_000:.0f} days), most of them "
                     f"{_CLOCK_PARTS[part]}: lower those, m (--microbatches) or N (--minibatches)")


def _check_clock(held_ps: np.ndarray, transfer_ps: np.ndarray, collective_ps: np.ndarray,
                 contention: Sequence[float]) -> None:
    """Refuse a run whose clocks could overflow: no device's clock passes every row's time, transfer and
    collective added up, each compute row slowed by the most its host's contention slows it."""
    parts = {"compute": float(held_ps.sum(dtype=np.float64)) * max(contention, default=1.0),
             "transfers": float(transfer_ps.sum(dtype=np.float64)),
             "collectives": float(collective_ps.sum(dtype=np.float64))}
    if not (total := sum(parts.values())) < COUNTER_LIMIT:
        raise _clock_refusal(total, max(parts, key=parts.__getitem__))


def takes_time(ms: np.ndarray) -> np.ndarray:
    """Elementwise, whether a row of `ms` takes any time on the engine's clock (`_picoseconds`): one that takes
    none is not held by the transfer kernels beside it (`held_compute` holds compute left to do)."""
    return _picoseconds(ms) > 0


def _index_dtype(size: int) -> type:
    """Integers that index `size` items: 32 bits where they do, so that a column of millions of indices takes half
    the memory."""
    return np.int32 if size < 2**31 else np.int64


@dataclass(frozen=True, slots=True, eq=False)
class _PendingSend:
    """A SEND of a blocking exchange not issued yet (`_Model._exchange_sends`): each one object, compared by identity
    (found in the pending list by it)."""

    place: int  # its index in the device's steps from the exchange's first SEND: the exchange's order
    step: int  # its step's index in `_Model.clocks`, which its arrival is returned under
    xid: int  # its transfer id
    receiver_clock: int  # the clock (an index in `_Model.clocks`) its receiver's exchange posts the RECV after
    receiver_ps: int  # how long after that clock it posts
    own_ps: int  # the earliest it may be issued on its own side: the exchange's post plus its SENDs' host time


class SimulationError(RuntimeError):
    """The model could not finish (a lowered order that waits for a transfer nobody sends)."""


@dataclass
class _Program:
    """The lowered rows priced: durations, transfer times and routes, memory and counter deltas, and one
    step list per device."""

    lowered: Lowered
    stream: np.ndarray
    # Per device, the rows where its clock may do more than add durations (its steps) in order, as columns:
    # compute ps since the previous step, stream, the transfer id of a transfer or the duration of a compute row,
    # the clock (an index into `_Model.clocks`) the step waits for and how long after that clock it may go on: a
    # RECV its SEND's clock and the time from there to its arrival (-1: its SEND step finds the arrival out when
    # it runs). Steps are a device's receives and the sends whose arrival is not a fixed time after their issue,
    # and its compute rows too if it shares a compute resource; elsewhere a device's clock just adds durations.
    steps: list[tuple[np.ndarray, ...]]  # consumed: `_Model.run` empties the list
    # The same steps as five columns of every device's and then every lane's (`steps` are views of them), and
    # where each device's and lane's begin (the last: their end); consumed by the run as `steps` is.
    step_columns: tuple[np.ndarray, ...]
    step_offsets: np.ndarray
    step_rows: np.ndarray | None  # every device's steps, as global rows in program order
    step_bounds: np.ndarray  # device d's steps are step_rows[step_bounds[d]:step_bounds[d + 1]]
    start_clock: np.ndarray  # per device: the index of its start in `_Model.clocks` (its steps' clocks follow)
    # Each device with collectives has a lane per link they run on (`Costs.collective_links`) after the devices: a
    # clock list of its own (in `steps` and `start_clock` after the devices'), one step per collective: when it
    # begins, after the one before it on the lane has ended (its busy ps) and once its row has issued it (the
    # clock it waits for), or, a collective whose members are rows of several devices, once the last of them has
    # (its meeting's clock); after the lanes, a join per device whose rows wait for collectives on more than one
    # lane, then a meeting per lane whose collectives have members on other devices (`_Joins`, `_meetings`), then
    # where exchanges block the posts of those after a pass's collectives and their steps' waits (`_exchange_posts`).
    collective_rows: np.ndarray  # the collective rows, in program order
    # Per collective row: the index in `_Model.clocks` of its lane's clock at its begin, moved on by how much longer
    # than alone it took on its host's shared cores (`_Model.network_stretch_ps`), so that it ends its network time
    # after that clock.
    collective_clock: np.ndarray
    collective_ps: np.ndarray  # per collective row: its network time
    num_clocks: int
    timed: bool  # whether a resource is shared, so that devices must take it in simulated time order
    # Per transfer id: the index in `_Model.clocks` of the clock it is sent from, and how long after that clock
    # it arrives (-1: its SEND step finds that out when it runs).
    send_clock: np.ndarray | None
    send_to_arrival_ps: np.ndarray | None
    # Per transfer id, where nothing is timed and exchanges block: the index in `_Model.clocks` of the clock its
    # receiver's exchange is posted from and how long after that clock it arrives from there (None: it arrives from
    # its send).
    receiver_clock: np.ndarray | None
    receiver_to_arrival_ps: np.ndarray | None
    compute_unit: list[int | None]  # per device: the shared resource its compute rows queue on, if any
    host_unit: list[int | None]  # per device: the host whose cores its compute rows share, if any
    contention: tuple[float, ...]  # the hosts' slowdown with 1, 2, ... devices computing at once
    # A host's collectives' slowdown with 0, 1, ... of its devices computing (`Cluster.collective_contention`;
    # empty: not measured, and they share no cores)
    collective_contention: tuple[float, ...]
    # Per row (released by `_trace` once read): the index in `_Model.clocks` of its device's clock before it, the
    # compute time of its device's rows between that clock and it, and its duration.
    clock_before: np.ndarray | None
    since_ps: np.ndarray | None
    duration_ps: np.ndarray | None
    channel_ps: list[int]  # per channel: the time of each of its transfers (transfer id // units)
    routes: list[tuple[int, ...]]  # per channel: the shared resources its transfers occupy
    num_resources: int
    # What the trace prices memory from (`_memory_tables`: not before, so that the run does not hold it).
    spans: _GradientSpans
    channel_bytes: list[int]  # per channel: the size of each of its transfers
    static_parts: dict[str, list[int]]  # `static_parts`
    product_ps: list[int | None]  # per device: how long one of its products runs (`device_product_ms`; None: not known)


def device_product_ms(stages_on: Sequence[Sequence[int]], costs: Costs) -> list[float]:
    """Per device (its stages, `stages_on`), how long one of its products runs, as transfers' kernels meet them
    (`held_compute`): its stages' `product_ms` weighed as a profile's stage weighs its layers' (`product_mean_ms`);
    0: not known."""
    stages = costs.stages
    return [product_mean_ms((stages[k].product_ms, stages[k].fwd_ms + stages[k].bwd_ms) for k in mine)
            for mine in stages_on]


@dataclass(frozen=True)
class _RowTimes:
    """What each lowered row takes (`_row_times`): its duration and all it holds its device for (with the
    runtime's host time after it), ps; the stages' op times (ms, `Costs.op_ms_table`), the gradient spans, and the
    overlapped pairs' forward parts whose all-to-alls follow them (`_with_all_to_alls`)."""

    op_ms: np.ndarray
    spans: _GradientSpans
    duration: np.ndarray
    held: np.ndarray
    paired: np.ndarray


def _row_times(lowered: Lowered, costs: Costs, jitter: float, seed: int) -> _RowTimes:
    """The lowered rows' times (`_RowTimes`)."""
    schedule, t = lowered.schedule, lowered.table
    n = len(t.kind)
    stages = costs.stages
    kind, stage = t.kind, t.stage
    compute = _STREAM_OF_KIND[kind] == Stream.COMPUTE
    op_ms = costs.op_ms_table(schedule.pipelines)
    overhead = costs.overhead
    computing = np.flatnonzero(compute)
    # A compute row's time is its stage's and kind's, plus the accumulation of its gradients into the buffer (a
    # B or W after its span's first) or the copy of the old weights an update leaves to a later reader (an OPT,
    # copy-on-write): one of a few classes per stage and kind, priced in a table and looked up.
    spans = _gradient_spans(lowered)
    copying = (kind == KIND_CODE[Kind.OPT]) & (lowered.copies_delta > 0)
    row_class = stage[computing] * (NUM_COMPUTE_KINDS * 4) + kind[computing] * 4
    row_class += spans.accumulating[computing] * 2
    row_class += copying[computing]
    class_ms = (op_ms + np.asarray(overhead.compute_ms))[:, :, None, None] + np.zeros((1, 1, 2, 2))
    class_ms[:, :, 1, :] += np.array([c.accumulate_ms for c in stages])[:, None, None]
    class_ms[:, :, :, 1] += np.array([c.copy_ms for c in stages])[:, None, None]
    host_ps_of_kind = _picoseconds(overhead.host_ms)
    host_ps = host_ps_of_kind[kind] if host_ps_of_kind.any() else None  # None: no row holds its device longer
    if overhead.warmup_ms or jitter > 0:  # a time per row: priced per row, then rounded
        duration = np.zeros(n)
        duration[computing] = class_ms.ravel()[row_class]
        if overhead.warmup_ms:  # a fresh rank's first rows cost more: a compute row in its time, another after it
            extra = overhead.warmup_extra_ms(_before_on_device(compute, lowered.bounds))
            duration, host_ps = duration + extra * compute, _picoseconds(overhead.host_ms[kind] + extra * ~compute)
        if jitter > 0:
            duration = duration * np.random.default_rng(seed).lognormal(0.0, jitter, n)
        duration = _picoseconds(duration)
    else:  # each class rounded once: the same integers as each row rounded
        duration = np.zeros(n, dtype=np.int64)
        duration[computing] = _picoseconds(class_ms).ravel()[row_class]
    del row_class
    pair = np.flatnonzero((kind == KIND_CODE[Kind.F]) & (t.peer >= 0))  # overlapped pairs: an F row, then its B
    if len(pair) and costs.overlap_hidden_fraction > 0:
        forward_ms, backward_ms = costs.overlapped_ms(duration[pair] / _PS_PER_MS, duration[pair + 1] / _PS_PER_MS)
        duration[pair], duration[pair + 1] = _picoseconds(forward_ms), _picoseconds(backward_ms)
    # An overlapped pair's all-to-alls (the A2A_F and A2A_B right after it) run beside its other part's compute,
    # which they slow but where Megatron-core's pair prices that node by node in what it leaves exposed
    # (`StageCosts.all_to_all_paired_by_node`, its exposure 0 or more: planning/experts.py `paired_exposed_ms`).
    paired = _with_all_to_alls(kind, pair)
    if len(paired) and any(c.fwd_sharing_ms or c.bwd_sharing_ms for c in stages):  # a dispatcher holds some
        a2a_f, a2a_b = KIND_CODE[Kind.A2A_F], KIND_CODE[Kind.A2A_B]
        by_node = np.array([c.all_to_all_paired_by_node for c in stages]) & costs.pairs_by_node
        forward_ms = costs.sharing_dispatcher_ms(stage[paired], True, duration[paired] / _PS_PER_MS,
                                                 op_ms[stage[paired + 3], a2a_b] * ~by_node[stage[paired]])
        backward_ms = costs.sharing_dispatcher_ms(stage[paired + 1], False, duration[paired + 1] / _PS_PER_MS,
                                                  op_ms[stage[paired + 2], a2a_f] * ~by_node[stage[paired + 1]])
        duration[paired], duration[paired + 1] = _picoseconds(forward_ms), _picoseconds(backward_ms)
    held = duration if host_ps is None else duration + host_ps  # what each row keeps its device from its next row
    return _RowTimes(op_ms, spans, duration, held, paired)


def _price(lowered: Lowered, costs: Costs, cluster: Cluster, jitter: float, seed: int) -> _Program:
    """Durations, transfer times and routes, and memory and counter deltas of the lowered rows (lowered again where
    the cluster's exchanges block and they are not in a blocking runtime's order: `Lowered.blocking`)."""
    if not (cluster.overlap_comm or lowered.blocking):  # in the order the run's own times give (`exchange_order`)
        lowered = lower(lowered.schedule, _row_times(lowered, costs, jitter, seed).held, lowered)
    schedule, t = lowered.schedule, lowered.table
    stages = costs.stages
    kind, stage = t.kind, t.stage
    stream = _STREAM_OF_KIND[kind]
    compute = stream == Stream.COMPUTE
    times = _row_times(lowered, costs, jitter, seed)
    op_ms, spans, duration, held, paired = times.op_ms, times.spans, times.duration, times.held, times.paired

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
    channel_ps = _picoseconds(np.asarray(channel_ms, dtype=np.float64), "transfers")
    transfer_ps = np.repeat(channel_ps, lowered.units)
    # Transfers that hold the compute beside them (`Costs.transfers_hold_products`) make a device's clock depend on
    # when its transfers run: every one a step, run in simulated time order.
    timed = bool(resources) or any(h is not None for h in host_unit) or costs.transfers_hold_products
    bounds = lowered.bounds
    device = t.device
    num_devices = len(bounds) - 1
    sends = stream == Stream.SEND
    # A send on a link of its own that does not block its device arrives a fixed time after the clock it is
    # issued at: no step, the receiver works its arrival out from the sender's clock (only where nothing is
    # shared: taking a shared resource, devices must meet in simulated time order, which steps keep); nor one that
    # waits for a collective (the output of a pass whose all-to-alls must end first).
    waiter = lowered.awaits >= 0
    lazy = sends & (not timed and cluster.overlap_comm) & ~waiter
    shared = np.array([u is not None or h is not None for u, h in zip(compute_unit, host_unit)], dtype=bool)
    is_step = ((shared[device] if shared.any() else False) | ~compute | waiter) & ~lazy
    step_rows = np.flatnonzero(is_step)
    step_bounds = np.searchsorted(step_rows, bounds)
    # Every device's clocks sit in one list (`_Model.clocks`): device d's start at step_bounds[d] + d, then its
    # clock after each of its steps, so the clock after global step i is at i + its device + 1. Per row, the
    # clock before it (its device's start, or the clock after its last step before it) and the compute time
    # since that clock are all the run leaves to add: the row is issued at that clock plus that time. (Computed
    # in place: these columns have millions of rows.)
    start_clock = step_bounds[:-1] + np.arange(num_devices)
    clock_before = np.cumsum(is_step, dtype=_index_dtype(len(step_rows) + num_devices))
    clock_before -= is_step
    clock_before += device
    since_ps = _before_on_device(held, bounds)  # the compute time of the device's earlier rows, then the time since
    busy_at_clock = np.zeros(len(step_rows) + num_devices, dtype=np.int64)  # 0 at a device's start
    busy_at_clock[clock_before[step_rows] + 1] = since_ps[step_rows]
    since_ps -= busy_at_clock[clock_before]
    pre = since_ps[step_rows]  # compute ps since the step before

    # Per transfer: the clock its SEND is issued from (its own step's, or the one before it), and how long
    # after that clock it arrives.
    send_rows = np.flatnonzero(sends)
    xids = lowered.transfer[send_rows]
    own_step = ~lazy[send_rows]
    # (zeros: a unit a channel does not carry, as a model copy's micro-batches on another copy's edges, has none)
    send_clock, send_to_arrival = (np.zeros(len(transfer_ps), dtype=np.int64) for _ in range(2))
    send_clock[xids] = clock_before[send_rows] + own_step
    # (a step of its own: found when it runs where timed; else its clock is its arrival where it blocks, its issue
    # where it waited for a collective, the output of a pass whose all-to-alls or ring must end first)
    send_to_arrival[xids] = np.where(own_step, -1 if timed else np.where(waiter[send_rows] & cluster.overlap_comm,
                                                                         transfer_ps[xids], 0),
                                     since_ps[send_rows] + transfer_ps[xids])

    # Per step: the clock it waits for and how long after it. A RECV waits for its SEND's clock; a row that needs
    # collectives for them; a blocking exchange's steps for its posts (below); anything else for its device's start
    # (nothing).
    step_stream = stream[step_rows]
    step_device = device[step_rows]
    operand = lowered.transfer[step_rows].astype(np.int64)  # a compute step's holds its duration in ps
    computing_steps = np.flatnonzero(compute[step_rows])  # a compute row is a step only on a shared resource
    operand[computing_steps] = duration[step_rows[computing_steps]]
    waits_for = start_clock[step_device]
    after = np.zeros(len(step_rows), dtype=np.int64)
    receiving = np.flatnonzero(step_stream == Stream.RECV)
    waits_for[receiving] = send_clock[operand[receiving]]
    after[receiving] = send_to_arrival[operand[receiving]]
    # A collective's lane: step j begins when its row has issued it and the lane's step before has ended.
    collective_rows = np.flatnonzero(stream == Stream.NETWORK)
    # Of a collective's network time, the part its pass's compute covers (a ring's exchanges, each under the
    # attention block computed beside it) does not hold the lane: the row holds it for what that compute leaves.
    collective_ms = op_ms[stage[collective_rows], kind[collective_rows]]
    hidden_ms = costs.hidden_ms_table()[stage[collective_rows], kind[collective_rows]]
    collective_ps = _picoseconds(np.maximum(collective_ms - hidden_ms, 0.0), "collectives")
    _check_clock(held, transfer_ps, collective_ps, cluster.contention)
    # An overlapped pair's all-to-alls run under its other part's compute, as DualPipe overlaps them (DeepSeek-V3's
    # report, section 3.2.1: each part's communication hidden under the other part's computation): what remains
    # of each once that compute has run is what its row holds the lane for. Megatron-core's pair
    # (`Costs.pairs_by_node`) runs its layers' nodes side by side, each all-to-all under the one node beside it: its
    # rows hold the lane at least for what that leaves exposed (`StageCosts.all_to_all_paired_ms`, half of each
    # part's stage's), the shortfall split between them.
    if len(paired):
        at = np.searchsorted(collective_rows, paired + 2)
        collective_ps[at] = np.maximum(collective_ps[at] - duration[paired + 1], 0)
        collective_ps[at + 1] = np.maximum(collective_ps[at + 1] - duration[paired], 0)
        if costs.pairs_by_node:
            exposed = np.array([c.all_to_all_paired_ms for c in stages]) / 2
            short = np.maximum(_picoseconds(exposed[stage[paired]] + exposed[stage[paired + 1]], "collectives")
                               - collective_ps[at] - collective_ps[at + 1], 0)
            collective_ps[at] += short // 2
            collective_ps[at + 1] += short - short // 2
    # A lane per device and link (`Costs.collective_links`; one per device where none is named), its steps its rows'
    # in program order.
    links = sorted(set(costs.collective_links.values()))
    link_of_kind = np.zeros(len(KINDS), dtype=np.int64)
    for name, link in costs.collective_links.items():
        link_of_kind[KIND_CODE[Kind(name)]] = links.index(link) + 1
    lane_keys, row_lane = np.unique(device[collective_rows].astype(np.int64) * (len(links) + 1)
                                    + link_of_kind[kind[collective_rows]], return_inverse=True)
    by_lane = np.argsort(row_lane, kind="stable")  # the lanes' steps, one lane after another
    lane = row_lane[by_lane]
    first_clock = len(step_rows) + num_devices  # the lanes' clocks follow the devices'
    lane_starts = np.searchsorted(lane, np.arange(len(lane_keys)))
    collective_clock = np.empty(len(collective_rows), dtype=np.int64)
    collective_clock[by_lane] = first_clock + np.arange(len(collective_rows)) + lane + 1
    lane_busy = np.r_[0, collective_ps[by_lane][:-1]]
    lane_busy[lane_starts] = 0
    lane_waits_for = clock_before[collective_rows[by_lane]] + 1  # the clock after the collective row's own step
    # A row that needs collectives' results waits for each one's lane clock at its begin plus its network time: for
    # the last where they run on one lane (which runs them in order), else for its join's clock (`_joins`).
    waiting = np.flatnonzero(waiter[step_rows] & (cluster.overlap_comm | (step_stream != Stream.SEND)))  # blocking:
    # a SEND's exchange is posted once they have ended (`_exchange_posts`)
    awaited = np.searchsorted(collective_rows, lowered.awaits[step_rows[waiting]])
    waits_for[waiting] = collective_clock[awaited]
    after[waiting] = collective_ps[awaited]
    first_join_clock = first_clock + len(lane) + len(lane_keys)  # the joins' clocks follow the lanes'
    joined, joins = _joins(np.searchsorted(collective_rows, lowered.awaits_first[step_rows[waiting]]), awaited,
                           row_lane, step_device[waiting], collective_clock, collective_ps, first_join_clock)
    joins_waiting = waiting[joined]
    waits_for[joins_waiting] = joins.clock
    after[joins_waiting] = 0
    # A collective whose members are rows of several devices begins once the last has issued it: its lane step waits
    # for its meeting's clock, whose steps wait for each member's issue (the clock after its row's own step).
    first_meeting_clock = first_join_clock + joins.num_clocks  # the meetings' clocks follow the joins'
    met, meetings = _meeting_lists(_meetings(lowered, collective_rows)[by_lane], lane, lane_waits_for,
                                   first_meeting_clock)
    lane_waits_for[met] = meetings.clock
    lists = [(joins, first_join_clock), (meetings, first_meeting_clock)]  # clock lists: each with its first clock
    receiver_clock = receiver_ps = None
    if not cluster.overlap_comm:
        # A blocking exchange (Megatron-core's batched point-to-point, waited whole): a device posts the SENDs and
        # RECVs between two of its other rows together and goes on once all have ended, each transfer moving once
        # both its ends have posted (an NCCL send waits for its receive), from the later post (`_exchange_posts`).
        # Where nothing is timed, each end works that out from its own post and the other's: a step waits for the
        # other's post plus the transfer, and the exchange's first step adds its longest transfer to its own post.
        # Where timed, a SEND is issued at the later post (`_Model`), an exchange's several (`_FIRST`, then `_BESIDE`)
        # together, each whatever the others wait for (`_Model._exchange_sends`), and a RECV waits for its arrival. A
        # step of an exchange posted once a pass's collectives have ended, which its device's clock may not have
        # reached, waits for both posts (where timed, its SENDs), a clock list of two steps.
        first_post_clock = first_meeting_clock + meetings.num_clocks
        posts = _exchange_posts(lowered, stream, clock_before, since_ps, collective_rows, collective_clock,
                                collective_ps, first_post_clock)
        receives = _receive_rows(lowered, stream, len(transfer_ps))[xids]
        receiver_clock, receiver_ps = (np.zeros(len(transfer_ps), dtype=np.int64) for _ in range(2))
        receiver_clock[xids], receiver_ps[xids] = posts.at(receives)
        if not timed:
            receiver_ps[xids] += transfer_ps[xids]
            send_clock[xids], send_to_arrival[xids] = posts.at(send_rows)
            send_to_arrival[xids] += transfer_ps[xids]
            waits_for[receiving] = send_clock[operand[receiving]]
            after[receiving] = send_to_arrival[operand[receiving]]
        exchanging = np.flatnonzero((step_stream == Stream.SEND) | (step_stream == Stream.RECV))
        exchange = posts.exchange[step_rows[exchanging]]
        sending = exchanging[step_stream[exchanging] == Stream.SEND]
        waits_for[sending] = receiver_clock[operand[sending]]
        after[sending] = receiver_ps[operand[sending]]
        begins = np.flatnonzero(np.diff(exchange, prepend=-1))  # (exchanges are numbered from 0)
        if timed:
            beside = sending[posts.first[posts.exchange[step_rows[sending]]] != step_rows[sending]]
            step_stream[beside - 1] = _FIRST  # (an exchange's SENDs are steps in a row)
            step_stream[beside] = _BESIDE
        else:
            longest_ps = np.maximum.reduceat(transfer_ps[operand[exchanging]], begins) if len(begins) else begins
            pre[exchanging[begins]] += longest_ps
        # (a list per device and place in an exchange: its clock after a step is the latest of the list's steps so
        # far, which an earlier exchange's, ended before this one was posted, leaves as it is)
        joins_at = np.flatnonzero(posts.after_collectives[exchange] & ((step_stream[exchanging] != Stream.RECV)
                                                                       | (not timed)))
        place = joins_at - np.repeat(begins, np.diff(np.r_[begins, len(exchanging)]))[joins_at]
        joining = exchanging[joins_at]
        by_list = np.lexsort((joining, place, step_device[joining]))
        joining = joining[by_list]
        own_clock, _ = posts.at(step_rows[joining])
        own_ps = np.zeros(len(joining), dtype=np.int64) if timed else transfer_ps[operand[joining]]
        waits = _clock_lists(np.repeat(np.arange(len(joining)), 2), np.c_[own_clock, waits_for[joining]].ravel(),
                             np.c_[own_ps, after[joining]].ravel(),
                             step_device[joining] * (int(place.max(initial=0)) + 1) + place[by_list],
                             first_post_clock + posts.lists.num_clocks)
        waits_for[joining], after[joining] = waits.clock, 0
        lists += [(posts.lists, first_post_clock), (waits, first_post_clock + posts.lists.num_clocks)]
    lane_columns = (lane_busy, np.full(len(lane), int(Stream.NETWORK)), np.zeros(len(lane), dtype=np.int64),
                    lane_waits_for, np.zeros(len(lane), dtype=np.int64))
    columns = (pre, step_stream, operand, waits_for, after)
    if len(lane) or any(len(joined.waits_for) for joined, _ in lists):  # the lanes' and lists' steps after the
        columns = tuple(np.concatenate(parts) for parts in zip(  # devices', in the same columns
            columns, lane_columns, *(joined.columns() for joined, _ in lists)))
    lane_bounds = np.r_[lane_starts, len(lane)]
    step_offsets, start_clocks = [step_bounds, len(step_rows) + lane_bounds[1:]], [start_clock]
    start_clocks.append(first_clock + lane_bounds[:-1] + np.arange(len(lane_keys)))
    list_from = len(step_rows) + len(lane)
    for joined, first_list_clock in lists:
        step_offsets.append(list_from + joined.bounds[1:])
        list_from += len(joined.waits_for)
        start_clocks.append(joined.start_clocks(first_list_clock))
    step_offsets, start_clock = np.concatenate(step_offsets), np.concatenate(start_clocks)
    steps = [tuple(c[lo:hi] for c in columns) for lo, hi in itertools.pairwise(step_offsets.tolist())]
    no_unit = [None] * (len(start_clock) - num_devices)
    last_list, last_list_clock = lists[-1]
    return _Program(lowered, stream, steps, columns, step_offsets, step_rows, step_bounds, start_clock,
                    collective_rows, collective_clock, collective_ps, last_list_clock + last_list.num_clocks,
                    timed, send_clock, send_to_arrival,
                    *((None, None) if timed else (receiver_clock, receiver_ps)),
                    compute_unit + no_unit, host_unit + no_unit,
                    cluster.contention, cluster.collective_contention, clock_before, since_ps, duration,
                    channel_ps.tolist(), routes,
                    len(resources), spans, channel_bytes, static_parts(schedule, costs),
                    [round(ms * _PS_PER_MS) or None for ms in device_product_ms(schedule.stages_by_device, costs)]
                    if costs.transfers_hold_products else [])


@dataclass(frozen=True)
class _Posts:
    """A blocking runtime's exchanges (`_exchange_posts`): per row, `exchange`, the index of its exchange (on its
    SENDs and RECVs); per exchange, its `first` row, the clock it is posted at (`clock`, an index in
    `_Model.clocks`) and how long after that clock (`after_ps`), and whether it is posted once a pass's collectives
    have ended (`after_collectives`); the clock lists those posts are (`lists`)."""

    exchange: np.ndarray
    first: np.ndarray
    clock: np.ndarray
    after_ps: np.ndarray
    after_collectives: np.ndarray
    lists: _Joins

    def at(self, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The post clock and the ps after it of the exchange of each of `rows`."""
        exchange = self.exchange[rows]
        return self.clock[exchange], self.after_ps[exchange]


def _exchange_posts(lowered: Lowered, stream: np.ndarray, clock_before: np.ndarray, since_ps: np.ndarray,
                    collective_rows: np.ndarray, collective_clock: np.ndarray, collective_ps: np.ndarray,
                    first_clock: int) -> _Posts:
    """A blocking runtime's exchanges (`Lowered.blocking`: each a device's run of SENDs and RECVs between two of its
    other rows, posted together) and when each is posted (`_Posts`): at its first row, or, right after a pass's
    collectives (its all-to-alls, its ring: the rows `Lowered.awaits` names), once they have all ended too, as the
    runtime posts it once the pass, its collectives with it, has returned and its SENDs' data is there
    (Megatron-core's schedules call `_communicate` once `forward_step` or `backward_step` has returned, its MoE layers'
    all-to-alls and TransformerEngine's context-parallel ring inside it): a clock list per device, each such
    exchange's steps the clock at its first row and each collective's end (their clocks from `first_clock` on)."""
    t = lowered.table
    n = len(stream)
    begins = exchange_begins((stream == Stream.SEND) | (stream == Stream.RECV), t.device)
    exchange = np.cumsum(begins) - 1
    first = np.flatnonzero(begins)
    run = kind_mask(t.kind, *PASS_COLLECTIVE_KINDS)
    run_first = np.maximum.accumulate(np.where(run & ~np.r_[False, run[:-1] & (t.device[1:] == t.device[:-1])],
                                               np.arange(n), 0))  # a device's run of a pass's collectives
    before = np.maximum(first - 1, 0)
    after_collectives = (first > 0) & run[before] & (t.device[before] == t.device[first])
    following = first[after_collectives]
    lo = np.searchsorted(collective_rows, run_first[following - 1])
    size = np.searchsorted(collective_rows, following) - lo + 1  # its first row's clock, then its collectives'
    owner = np.repeat(np.arange(len(following)), size)
    member = np.arange(int(size.sum())) - np.repeat(np.cumsum(size) - size, size)
    collective = np.maximum(lo[owner] + member - 1, 0)
    own = member == 0
    lists = _clock_lists(owner, np.where(own, clock_before[following[owner]], collective_clock[collective]),
                         np.where(own, since_ps[following[owner]], collective_ps[collective]),
                         t.device[following], first_clock)
    clock, after_ps = clock_before[first], since_ps[first]
    clock[after_collectives], after_ps[after_collectives] = lists.clock, 0
    return _Posts(exchange, first, clock, after_ps, after_collectives, lists)


def _receive_rows(lowered: Lowered, stream: np.ndarray, transfers: int) -> np.ndarray:
    """Per transfer id, its RECV row."""
    receives = np.flatnonzero(stream == Stream.RECV)
    rows = np.zeros(transfers, dtype=np.int64)
    rows[lowered.transfer[receives]] = receives
    return rows


@dataclass(frozen=True)
class _Joins:
    """Clock lists whose steps each wait for one clock (a time after it), in order, so that a list's clock after a
    step is the latest of the times its steps so far waited for; a waiter waits for its list's clock after its last
    step. A join per device whose rows wait for collectives on more than one lane (a pass's all-to-alls on its
    device's network and its ring on a link of its own: `Lowered.awaits`), each step one lane's last awaited
    collective's end (`_joins`); a meeting per lane whose collectives have members on other devices, each step a
    member's issue (`_meeting_lists`). Earlier steps' times are no later than the waiter needs: a device has waited
    for its earlier rows' collectives already, a lane's collective begins after the one before it ended.
    `clock`: per waiter, the index in `_Model.clocks` of its list's clock after its last step; `waits_for` and
    `after_ps`: per step, the clock it waits for and how long after it; `bounds`: where each list's steps begin
    (the last: their end)."""

    clock: np.ndarray
    waits_for: np.ndarray
    after_ps: np.ndarray
    bounds: np.ndarray

    @property
    def num_clocks(self) -> int:
        """Its clocks in `_Model.clocks`: each list's start, then its clock after each of its steps."""
        return len(self.waits_for) + len(self.bounds) - 1

    def start_clocks(self, first_clock: int) -> np.ndarray:
        """Each list's start in `_Model.clocks`, its clocks from `first_clock` on."""
        return first_clock + self.bounds[:-1] + np.arange(len(self.bounds) - 1)

    def columns(self) -> tuple[np.ndarray, ...]:
        """Its steps in `_Program.steps`' five columns: no compute, on the network stream, waiting."""
        none = np.zeros(len(self.waits_for), dtype=np.int64)
        return none, np.full(len(none), int(Stream.NETWORK)), none, self.waits_for, self.after_ps


def _clock_lists(owner: np.ndarray, waits_for: np.ndarray, after_ps: np.ndarray, list_of_owner: np.ndarray,
                 first_clock: int) -> _Joins:
    """The lists (`_Joins`) of steps that wait for `waits_for` plus `after_ps` each, step i a step of waiter
    `owner[i]` (0, 1, ...: nondecreasing, each waiter with a step), every waiter's steps in the list
    `list_of_owner` names (nondecreasing over the waiters), their clocks from `first_clock` on."""
    keys, of_step = np.unique(list_of_owner[owner], return_inverse=True)
    bounds = np.searchsorted(of_step, np.arange(len(keys) + 1)).astype(np.int64)
    last_step = np.searchsorted(owner, np.arange(len(list_of_owner)), side="right") - 1
    return _Joins(first_clock + last_step + of_step[last_step] + 1, waits_for, after_ps, bounds)


def _joins(first: np.ndarray, last: np.ndarray, lane: np.ndarray, device: np.ndarray, collective_clock: np.ndarray,
           collective_ps: np.ndarray, first_clock: int) -> tuple[np.ndarray, _Joins]:
    """The waiting steps that wait for collectives `first..last` each (indices into the collective rows, whose lanes
    are `lane`, which begin at `collective_clock` and take `collective_ps`) on more than one lane (indices into
    them), and their joins (`_Joins`): one per device of `device`, its steps in program order."""
    lane_changes = np.r_[0, np.cumsum(lane[1:] != lane[:-1])]
    waiters = np.flatnonzero(lane_changes[last] != lane_changes[first])
    count = last[waiters] - first[waiters] + 1
    owner = np.repeat(np.arange(len(waiters)), count)
    member = np.arange(int(count.sum())) + np.repeat(first[waiters] - (np.cumsum(count) - count), count)
    key = owner * (int(lane.max(initial=0)) + 1) + lane[member]
    by_key = np.argsort(key, kind="stable")  # an owner's collectives by lane, each lane's in program order
    last_of_lane = by_key[np.diff(key[by_key], append=-1) != 0]
    owner, waits_for_row = owner[last_of_lane], member[last_of_lane]
    return waiters, _clock_lists(owner, collective_clock[waits_for_row], collective_ps[waits_for_row],
                                 device[waiters], first_clock)


def _meetings(lowered: Lowered, collective_rows: np.ndarray) -> np.ndarray:
    """Per collective row, its meeting: the rows of one collective on several devices share one (numbered 0, 1, ...),
    -1 where its other members are not simulated (the d replicas, an expert-parallel group's or a context ring's
    ranks a device stands for: symmetric with it, they issue it as it does). A stage's REDUCE and GATHER meet where
    several model copies hold it (`StageGraph.copies`): each copy's device reduces the same model stage's
    gradients with the others', the j-th of a kind, model stage, mini-batch and pipeline on one device with the
    j-th on another, as a process group pairs its members' calls in the order each issues them (executor/replicas.py
    `Layout`)."""
    schedule, t = lowered.schedule, lowered.table
    alone = np.full(len(collective_rows), -1, dtype=np.int64)
    if schedule.graph.copies == 1:
        return alone
    replicated = np.flatnonzero(kind_mask(t.kind[collective_rows], Kind.REDUCE, Kind.GATHER))
    rows = collective_rows[replicated]
    n = schedule.graph.stages_per_copy
    key = t.kind[rows].astype(np.int64) * n + t.stage[rows] % n
    key = (key * schedule.minibatches + t.minibatch[rows]) * schedule.pipelines + t.pipeline[rows]
    order = np.lexsort((key, t.device[rows]))  # by device, then key, each in program order
    begins = np.r_[True, (np.diff(key[order]) != 0) | (np.diff(t.device[rows][order]) != 0)]
    run_start = np.maximum.accumulate(np.where(begins, np.arange(len(order)), 0))
    occurrence = np.empty(len(rows), dtype=np.int64)
    occurrence[order] = np.arange(len(order)) - run_start
    _, meeting, members = np.unique(key * len(rows) + occurrence, return_inverse=True, return_counts=True)
    met = members[meeting] > 1
    alone[replicated[met]] = np.unique(meeting[met], return_inverse=True)[1]
    return alone


def _meeting_lists(meeting: np.ndarray, lane: np.ndarray, issued_clock: np.ndarray, first_clock: int
                   ) -> tuple[np.ndarray, _Joins]:
    """The lane steps that wait for a meeting (indices into them, in lanes' order: their `meeting`s, `_meetings`',
    and `lane`s) and their meetings' lists (`_Joins`), one per lane, whose steps wait for every member's issue
    (`issued_clock`, per lane step: the clock after its row's own step)."""
    met = np.flatnonzero(meeting >= 0)
    by_meeting = met[np.argsort(meeting[met], kind="stable")]  # the members of meeting 0, then of meeting 1, ...
    member_bounds = np.searchsorted(meeting[by_meeting], np.arange(int(meeting.max(initial=-1)) + 2))
    count = np.diff(member_bounds)[meeting[met]]
    owner = np.repeat(np.arange(len(met)), count)
    member = np.arange(int(count.sum())) + np.repeat(member_bounds[meeting[met]] - (np.cumsum(count) - count), count)
    return met, _clock_lists(owner, issued_clock[by_meeting[member]], np.zeros(len(member), dtype=np.int64),
                             lane[met], first_clock)


@dataclass
class _MemoryTables:
    """What each row takes at its start and gives back at its end, per part (`MEMORY_PARTS`): a row's bytes are its
    stage's and kind's (`at_start`, `at_end`: stages × kinds, raveled), a transfer's its channel's and side's
    (`transfer_start`, `transfer_end`: channels × 2, send then receive, raveled), and the few rows beyond those
    (`sparse`: rows, bytes at their start, bytes at their end): weight copies, a kept gradient. Tables, not
    columns of millions of rows, so that the counter sums the parts in one look-up and the breakdown at a peak
    counts each device's rows before it (`parts_up_to`)."""

    at_start: dict[str, np.ndarray]
    at_end: dict[str, np.ndarray]
    transfer_start: dict[str, np.ndarray]
    transfer_end: dict[str, np.ndarray]
    sparse: dict[str, tuple[np.ndarray, np.ndarray, np.ndarray]]
    stage_kind: np.ndarray  # per row, its entry in `at_start` and `at_end`
    transfers: np.ndarray  # the transfers' rows, ascending
    side: np.ndarray  # per transfer row, its entry in `transfer_start` and `transfer_end`

    def row_deltas(self, parts: Sequence[str], lo: int, hi: int) -> tuple[np.ndarray, np.ndarray] | None:
        """Rows lo..hi's bytes of `parts`, summed, taken at their start and given back at their end; None where no
        row moves any (their tables hold zeros and they have no rows beyond them: most parts of most runs)."""
        at_start, at_end, transfer_start, transfer_end = (
            sum(table[part] for part in parts)
            for table in (self.at_start, self.at_end, self.transfer_start, self.transfer_end))
        if not (at_start.any() or at_end.any() or transfer_start.any() or transfer_end.any()
                or any(len(self.sparse[part][0]) for part in parts)):
            return None
        # Most parts' tables are zeros (only `communication` moves with the transfers): zeros need no look-up.
        start, end = (_per_row(table, self.stage_kind[lo:hi]) for table in (at_start, at_end))
        i0, i1 = np.searchsorted(self.transfers, (lo, hi))
        for bytes_per_side, out in ((transfer_start, start), (transfer_end, end)):
            if bytes_per_side.any():
                out[self.transfers[i0:i1] - lo] += bytes_per_side[self.side[i0:i1]]
        for part in parts:
            sparse_rows, sparse_start, sparse_end = self.sparse[part]
            j0, j1 = np.searchsorted(sparse_rows, (lo, hi))
            np.add.at(start, sparse_rows[j0:j1] - lo, sparse_start[j0:j1])
            np.add.at(end, sparse_rows[j0:j1] - lo, sparse_end[j0:j1])
        return start, end

    def parts_up_to(self, lo: int, hi: int, counted_start: np.ndarray, counted_end: np.ndarray) -> dict[str, int]:
        """Per part (and per `activations.SAVER`), the bytes rows lo..hi add up to where `counted_start` and
        `counted_end` (one per row) say which of their events count: per table entry, the events counted, times
        its bytes."""
        entries = self.at_start[MEMORY_PARTS[0]].size
        kinds_start = np.bincount(self.stage_kind[lo:hi][counted_start], minlength=entries)
        kinds_end = np.bincount(self.stage_kind[lo:hi][counted_end], minlength=entries)
        i0, i1 = np.searchsorted(self.transfers, (lo, hi))
        rows, side = self.transfers[i0:i1] - lo, self.side[i0:i1]
        channels = self.transfer_start[MEMORY_PARTS[0]].size
        sides_start = np.bincount(side[counted_start[rows]], minlength=channels)
        sides_end = np.bincount(side[counted_end[rows]], minlength=channels)
        out = {}
        for part in self.at_start:
            sparse_rows, sparse_start, sparse_end = self.sparse[part]
            j0, j1 = np.searchsorted(sparse_rows, (lo, hi))
            mine = sparse_rows[j0:j1] - lo
            out[part] = int(kinds_start @ self.at_start[part] + kinds_end @ self.at_end[part]
                            + sides_start @ self.transfer_start[part] + sides_end @ self.transfer_end[part]
                            + sparse_start[j0:j1][counted_start[mine]].sum()
                            + sparse_end[j0:j1][counted_end[mine]].sum())
        return out


def _per_row(table: np.ndarray, entries: np.ndarray) -> np.ndarray:
    """`table[entries]`, a new array; zeros without the look-up where the table holds nothing else."""
    return table[entries] if table.any() else np.zeros(len(entries), dtype=table.dtype)


def _memory_tables(program: _Program, costs: Costs, rows: np.ndarray, transfer_ids: np.ndarray) -> _MemoryTables:
    """The memory each row takes and gives back, by part, as tables (`_MemoryTables`); `rows` are the transfers'
    rows, `transfer_ids` their ids."""
    lowered, stream, spans, channel_bytes = program.lowered, program.stream, program.spans, program.channel_bytes
    schedule, t, stages = lowered.schedule, lowered.table, costs.stages
    stage = t.stage

    def per_stage(values: list[float]) -> np.ndarray:
        return np.asarray(values, dtype=np.int64)

    def tables(shape: tuple[int, int]) -> dict[str, np.ndarray]:  # the parts, then the activations' savers
        return {part: np.zeros(shape, dtype=np.int64) for part in (*MEMORY_PARTS, *SAVERS)}

    param = per_stage([c.param_bytes for c in stages])
    activation = per_stage([c.activation_bytes for c in stages])
    # A stage whose `held_bytes` is known holds its boundary tensors from F until its backward (a received
    # input becomes the forward's, a sent output stays its own); otherwise they are buffers of their own, a
    # received one freed when its consumer ends, a sent one when its transfer does.
    own_boundary = np.array([c.held_bytes is not None for c in stages], dtype=bool)
    # An input from a stage on the same device is the producer's output itself (no transfer, one storage),
    # which the producer holds until its own backward, later than this stage's: it is counted there only.
    local_in = [0] * len(stages)
    for src, dst in schedule.graph.edges:
        if schedule.placement[src] == schedule.placement[dst] and stages[dst].held_bytes is not None:
            local_in[dst] += stages[src].output_bytes
    roots = per_stage([(c.held_bytes or 0) - local for c, local in zip(stages, local_in)])
    kept, kept_gradients = map(per_stage, costs.wgrad_held_bytes())  # from I until W
    # Of what is kept, what the forward saved: at most the activations, the rest (under recomputation) made again by
    # the I (`wgrad_held`). What a received input or a saver's share stays of is this part alone.
    kept_saved = np.minimum(kept, activation)
    # A forward on its receive buffer (`StageCosts.buffered_input_bytes`), a buffer `static_parts` counts whole:
    # of what the stage holds from F, the inputs it receives (saved by its first layer, or held as roots) are it.
    received = np.minimum(per_stage([c.buffered_input_bytes for c in stages]), activation - kept_saved + roots)
    own = activation + roots - received
    # Per stage and kind, the bytes a row takes at its start and gives back at its end.
    at_start, at_end = tables((len(stages), len(KINDS))), tables((len(stages), len(KINDS)))
    at_start["activations"][:, KIND_CODE[Kind.F]] = own
    at_end["activations"][:, KIND_CODE[Kind.B]] = -own
    at_end["activations"][:, KIND_CODE[Kind.I]] = -(own - kept - kept_gradients)
    at_end["activations"][:, KIND_CODE[Kind.W]] = -(kept + kept_gradients)
    # The activations by what saves them, where a stage says (else all other), each kept from I until W and each
    # short of a received input in proportion; other takes the boundary tensors and what rounding leaves, so that
    # they sum to the activations.
    for k, c in enumerate(stages):
        for saver, held in (c.activation_parts or {}).items():
            if saver == "other" or not held:
                continue
            kept_here = int(kept_saved[k]) * held // int(activation[k])
            held -= int(received[k]) * held // int(activation[k])
            key = f"activations.{saver}"
            at_start[key][k, KIND_CODE[Kind.F]] = held
            at_end[key][k, KIND_CODE[Kind.B]] = -held
            at_end[key][k, KIND_CODE[Kind.I]] = -(held - kept_here)
            at_end[key][k, KIND_CODE[Kind.W]] = -kept_here
    for table in (at_start, at_end):
        table["activations.other"] = table["activations"] - sum(table[saver] for saver in SAVERS[:-1])
    # What a pass creates and frees within itself, held while its row runs.
    for name, kind in TRANSIENT_KINDS.items():
        transient = per_stage([c.transient_bytes.get(name, 0) for c in stages])
        at_start["transient"][:, KIND_CODE[kind]] = transient
        at_end["transient"][:, KIND_CODE[kind]] = -transient
        exchanged = per_stage([c.ring_buffer_bytes.get(name, 0) for c in stages])  # its ring's buffers, likewise
        at_start["communication"][:, KIND_CODE[kind]] += exchanged
        at_end["communication"][:, KIND_CODE[kind]] -= exchanged
    # Point-to-point transfers: a compute row's are fixed by its stage and kind (on every channel between two
    # devices, each forward of the sending stage has its SEND among the SENDs after it and each of the receiving
    # stage its RECV among the RECVs before it; a gradient's, each B or I), so the buffers they make and free at
    # the compute rows are entries of the same tables. Per channel, a SEND's and a RECV's own deltas.
    transfer_start, transfer_end = tables((len(lowered.channels), 2)), tables((len(lowered.channels), 2))
    buffers, sent, arrived = at_start["communication"], at_end["communication"], transfer_start["communication"]
    # What each forward and each B or I leaves until the stage's update (`StageCosts.forward_kept_bytes`,
    # `backward_kept_bytes`), from the row that makes it; what it receives is a buffer of `static_parts`'.
    forward_kept, backward_kept = (per_stage([c.forward_kept_bytes for c in stages]),
                                   per_stage([c.backward_kept_bytes for c in stages]))
    sent[:, KIND_CODE[Kind.F]] += forward_kept
    for kind in (Kind.B, Kind.I):
        sent[:, KIND_CODE[kind]] += backward_kept
    if not costs.kept_until_update:  # else the tensors sent and received are those kept buffers
        for c, (channel, size) in enumerate(zip(lowered.channels, channel_bytes)):
            owners = [KIND_CODE[k] for k in ((Kind.B, Kind.I) if channel.backward else (Kind.F,))]
            if channel.backward or not own_boundary[channel.sender]:  # the sent tensor, a buffer of its own: made
                sent[channel.sender, owners] += size  # by the row before the SEND, held until the transfer ends
                transfer_end["communication"][c, 0] = -size
            arrived[c, 1] = size  # the received one, from its arrival until its consumer (the row after the RECV)
            if channel.backward or not own_boundary[channel.receiver]:  # ends; the consumer's own from its start
                sent[channel.receiver, owners] -= size  # where the stage holds its input (`held_bytes` or
            else:  # `activation_bytes` count it, as activations, from there on)
                buffers[channel.receiver, owners] -= size
    none = (np.zeros(0, dtype=np.int64),) * 3
    sparse = {part: none for part in (*MEMORY_PARTS, *SAVERS)}
    copies = np.flatnonzero(lowered.copies_delta != 0)  # weight copies an update leaves to later readers
    sparse["parameters"] = (copies, np.zeros(len(copies), dtype=np.int64),
                            lowered.copies_delta[copies] * param[stage[copies]])
    for part, events in _paired_forwards_held(t, stages, at_start).items():
        sparse[part] = _merged(sparse[part], events)
    if costs.kept_gradients:  # a second gradient copy while the update's last one is kept
        gradient = per_stage([c.gradient_bytes for c in stages])
        opening = np.round(gradient[stage[spans.opening]] * costs.kept_gradients).astype(np.int64)
        closing = -np.round(gradient[stage[spans.closing]] * costs.kept_gradients).astype(np.int64)
        both = np.concatenate([spans.opening, spans.closing])
        order = np.argsort(both, kind="stable")
        sparse["gradients"] = (both[order], np.concatenate([opening, np.zeros_like(closing)])[order],
                               np.concatenate([np.zeros_like(opening), closing])[order])
    if costs.kept_until_update:  # freed as the update ends (torch's: the next step's `clear_runtime_states`)
        updates = _per_replica_minibatch(t, schedule, (Kind.OPT,)).last
        refusal = kept_until_update_refusal(schedule)
        if refusal is not None:
            raise ScheduleError(refusal)
        forwards = np.bincount(t.stage[t.kind == KIND_CODE[Kind.F]], minlength=len(stages)) // (
            schedule.minibatches * schedule.rounds)
        kept_to_update = forwards * (forward_kept + backward_kept)  # per stage, what a mini-batch's round leaves
        sparse["communication"] = _merged(_events(updates, end=-kept_to_update[stage[updates]]),
                                          _next_rounds_free(t, schedule, kept_to_update))
        if costs.merges_outputs:  # the kept model outputs concatenated once a device's step has run its backwards
            merged = np.bincount(schedule.placement, forwards * per_stage([c.model_output_bytes for c in stages]),
                                 minlength=schedule.num_devices).astype(np.int64)  # per device
            made = _per_device_minibatch(t, schedule, (Kind.B, Kind.W)).last
            freed = _per_device_minibatch(t, schedule, (Kind.OPT,)).first
            sparse["communication"] = _merged(sparse["communication"], _events(made, end=merged[t.device[made]]),
                                              _events(freed, start=-merged[t.device[freed]]))
    if schedule.zero >= 2:
        for part, (rows_of, start_of, end_of) in _unsharded(lowered, costs, at_start, at_end).items():
            sparse[part] = _merged(sparse[part], (rows_of, start_of, end_of))
    stage_kind = (stage * len(KINDS) + t.kind).astype(np.int32)  # each row's entry in the tables
    side = (lowered.channel_of(transfer_ids) * 2 + (stream[rows] == Stream.RECV)) if len(rows) else rows
    ravel = lambda table: {part: values.ravel() for part, values in table.items()}  # noqa: E731
    return _MemoryTables(ravel(at_start), ravel(at_end), ravel(transfer_start), ravel(transfer_end), sparse,
                         stage_kind, rows, side)


def _unsharded(lowered: Lowered, costs: Costs, at_start: dict[str, np.ndarray], at_end: dict[str, np.ndarray]
               ) -> dict[str, tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """ZeRO-2's and ZeRO-3's gradients, and ZeRO-3's whole weights beside the shards `static_parts` counts, as
    torch's runtimes hold them while a stage computes: the sparse rows they add per part, and entries of the
    tables, added here.

    In a pipeline (torch.distributed.pipelining over FSDP2): `PipelineStage.backward_maybe_with_nosync` turns
    gradient sync and resharding after backward off for every backward of a stage but its last of the step, so a
    stage replica holds its whole gradients from its first backward (B or W) of a mini-batch until its last,
    accumulated as they are kept (FSDP2 upcasts them to its reduce dtype to accumulate them:
    `FSDPParam.to_accumulated_grad_if_needed`), then reduce-scatters them into a 1/(d·C) shard
    (`Schedule.gradient_ranks`; the routed experts' over their own group, `StageCosts.shard_scale`), held until the
    update ends (torchtitan zeroes the gradients to None before each step); with torchtitan's
    `reshard_after_forward=False` under PP (`apply_fsdp`) its whole weights from the all-gather ahead of its first
    forward (the GATHER row, whose output FSDP2 allocates when it issues it) until that last backward. The whole
    weights are as all-gathered (`StageCosts.gathered_weight_bytes`: under FSDP2's float8 all-gather its float8
    linears' at 1 byte), the gradients in the 16-bit dtype.
    One stage and no pipeline (FSDP2 alone): each pass gathers the weights it computes with and frees them after,
    reduce-scattering its gradients into the shard as it goes, so every F, B, I and W holds
    `StageCosts.gathered_bytes` of whole weights (ZeRO-3) and B and W as many of whole gradients, in the weights'
    dtype; the shard from the end of the first backward until the update ends."""
    schedule, t, stages = lowered.schedule, lowered.table, costs.stages

    def per_stage(values: list[int]) -> np.ndarray:
        return np.asarray(values, dtype=np.int64)

    shard = per_stage([shard_bytes((c,), attrgetter("gradient_bytes"), schedule.gradient_ranks) for c in stages])
    backward = _per_replica_minibatch(t, schedule, (Kind.B, Kind.W))
    updates = _per_replica_minibatch(t, schedule, (Kind.OPT,))
    events: dict[str, list[tuple[np.ndarray, np.ndarray, np.ndarray]]] = {"gradients": [], "parameters": []}
    if schedule.graph.num_stages == 1 and schedule.pipelines == 1:
        pairs = [c.param_bytes if c.gathered_bytes is None else c.gathered_bytes for c in stages]
        gradients = per_stage(pairs)
        # the weights as all-gathered: a float8 all-gather's share of the stage's (its blocks alike)
        weights = per_stage([pair * c.gathered_weight_bytes // max(c.param_bytes, 1) for pair, c in zip(pairs, stages)])
        passes = {"gradients": ((Kind.B, Kind.W), gradients),
                  "parameters": ((Kind.F, Kind.B, Kind.I, Kind.W), weights)}
        for part, (kinds, gathered) in passes.items():
            if part == "parameters" and schedule.zero < 3:
                continue
            for kind in kinds:
                at_start[part][:, KIND_CODE[kind]] += gathered
                at_end[part][:, KIND_CODE[kind]] -= gathered
        first = backward.first  # its gradients reduce-scattered as it goes, the shard whole once it ends
        events["gradients"].append(_events(first, end=shard[t.stage[first]]))
    else:
        whole = per_stage([c.gradient_bytes for c in stages])
        first, last = backward.first, backward.last
        events["gradients"] += [_events(first, start=whole[t.stage[first]]),
                                _events(last, end=shard[t.stage[last]] - whole[t.stage[last]])]
        if schedule.zero >= 3:  # from the GATHER issued ahead of the first forward (`passes.gathered_passes`)
            forwards = _per_replica_minibatch(t, schedule, (Kind.GATHER, Kind.F)).first
            closing = _per_replica_minibatch(t, schedule, (Kind.B, Kind.I, Kind.W)).last
            weights = per_stage([c.gathered_weight_bytes for c in stages])
            events["parameters"] += [_events(forwards, start=weights[t.stage[forwards]]),
                                     _events(closing, end=-weights[t.stage[closing]])]
    events["gradients"].append(_events(updates.last, end=-shard[t.stage[updates.last]]))
    return {part: _merged(*found) for part, found in events.items() if found}


@dataclass
class _Ends:
    """Per stage replica (or device) and mini-batch, in the same order, the first and the last of some kinds' rows."""

    first: np.ndarray
    last: np.ndarray


def _next_rounds_free(t: ActionTable, schedule: Schedule, kept: np.ndarray) -> tuple[np.ndarray, ...]:
    """Sparse rows that free, at a device's first forward of each round but a mini-batch's first (`--rounds`,
    `methods.in_rounds`), what the round before left kept on its stages (`kept`, per stage): torch's pipelining
    clears every stage's runtime state as a `schedule.step` begins (`_PipelineStageBase.clear_runtime_states`), a
    round's. None in one round."""
    if schedule.rounds == 1:
        return _events(np.zeros(0, dtype=np.int64))
    rows = np.flatnonzero(t.kind == KIND_CODE[Kind.F])
    round_of = schedule.round_of_microbatch(t.microbatch[rows].astype(np.int64))
    key = (t.minibatch[rows].astype(np.int64) * schedule.rounds + round_of) * schedule.num_devices + t.device[rows]
    first = _ends_by(rows, key).first
    first = first[round_of[np.searchsorted(rows, first)] > 0]
    on_device = np.bincount(schedule.placement, kept, minlength=schedule.num_devices).astype(np.int64)
    return _events(first, start=-on_device[t.device[first]])


def _per_replica_minibatch(t: ActionTable, schedule: Schedule, kinds: tuple[Kind, ...]) -> _Ends:
    """`_Ends` of the `kinds` rows (a stage replica is on one device, whose rows are in program order)."""
    rows = np.flatnonzero(kind_mask(t.kind, *kinds))
    key = (t.minibatch[rows].astype(np.int64) * schedule.graph.num_stages + t.stage[rows]) * schedule.pipelines
    key += t.pipeline[rows]
    return _ends_by(rows, key)


def _per_device_minibatch(t: ActionTable, schedule: Schedule, kinds: tuple[Kind, ...]) -> _Ends:
    """`_Ends` of the `kinds` rows per device and mini-batch (a device's rows are in program order)."""
    rows = np.flatnonzero(kind_mask(t.kind, *kinds))
    return _ends_by(rows, t.minibatch[rows].astype(np.int64) * schedule.num_devices + t.device[rows])


def _ends_by(rows: np.ndarray, key: np.ndarray) -> _Ends:
    """The first and the last of `rows` of each value of `key` (one a row), in the keys' order."""
    _, first = np.unique(key, return_index=True)
    _, last = np.unique(key[::-1], return_index=True)
    return _Ends(rows[first], rows[::-1][last])


def _events(rows: np.ndarray, start: np.ndarray | None = None, end: np.ndarray | None = None
            ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Sparse rows: `rows` taking `start` bytes at their start and giving `end` bytes (negative: freeing) at
    their end (None: none)."""
    none = np.zeros(len(rows), dtype=np.int64)
    return rows, none if start is None else start, none if end is None else end


def _with_all_to_alls(kind: np.ndarray, pairs: np.ndarray) -> np.ndarray:
    """Of overlapped pairs (their F rows, each before its B), those whose all-to-alls follow them: an A2A_F and an
    A2A_B the two rows after the B."""
    pairs = pairs[pairs + 3 < len(kind)]
    return pairs[(kind[pairs + 2] == KIND_CODE[Kind.A2A_F]) & (kind[pairs + 3] == KIND_CODE[Kind.A2A_B])]


def _paired_forwards_held(t: ActionTable, stages: Sequence[StageCosts], at_start: dict[str, np.ndarray]
                          ) -> dict[str, tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """Sparse rows that move an overlapped pair's forward's activations (an F with a peer, its B the next row, its
    all-to-alls the two after) beyond one layer's (`StageCosts.pair_layer_bytes`, where known) from the F's start to
    the pair's end, as the backward's micro-batch frees its layers while the forward's grows: per activations part,
    in proportion to what the F takes of it. A pair without all-to-alls keeps both micro-batches' (the example
    `overlapped_forward_backward` of deepseek-ai/DualPipe runs the whole forward, then the backward)."""
    layer = np.array([-1 if c.pair_layer_bytes is None else c.pair_layer_bytes for c in stages], dtype=np.int64)
    pairs = _with_all_to_alls(t.kind, np.flatnonzero((t.kind == KIND_CODE[Kind.F]) & (t.peer >= 0)))
    pairs = pairs[layer[t.stage[pairs]] >= 0]
    if not len(pairs):
        return {}
    entry = (t.stage[pairs], KIND_CODE[Kind.F])
    taken = at_start["activations"][entry]
    later = np.maximum(taken - layer[t.stage[pairs]], 0)
    moved = {"activations": later}
    for saver in SAVERS[:-1]:
        moved[saver] = at_start[saver][entry] * later // np.maximum(taken, 1)
    moved[SAVERS[-1]] = later - sum(moved[saver] for saver in SAVERS[:-1])
    rows, none = np.concatenate([pairs, pairs + 1]), np.zeros(len(pairs), dtype=np.int64)
    return {part: _merged((rows, np.concatenate([-bytes_, none]), np.concatenate([none, bytes_])))
            for part, bytes_ in moved.items()}


def _merged(*sparse: tuple[np.ndarray, np.ndarray, np.ndarray]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Sparse rows (rows, bytes at their start, at their end) of several sources as one, by row."""
    rows, start, end = (np.concatenate(column) for column in zip(*sparse))
    order = np.argsort(rows, kind="stable")
    return rows[order], start[order], end[order]


def _before_on_device(values: np.ndarray, bounds: np.ndarray) -> np.ndarray:
    """Per row, the sum of `values` over its device's rows before it (device d: rows bounds[d]:bounds[d+1]);
    each device's part made relative to its first row in place, with no array of a million rows more."""
    out = np.cumsum(values)
    out -= values
    for lo, hi in itertools.pairwise(bounds.tolist()):
        if hi > lo:
            out[lo:hi] -= out[lo]
    return out


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
    # A span is a replica's B and W rows between two updates, so in this order the row before a span's first
    # is no B or W of its replica, and the update that ends a span comes right after the span's last.
    after_grad = np.zeros(len(rows), dtype=bool)
    after_grad[1:] = is_grad[:-1] & ~new_replica[1:]
    first = is_grad & ~after_grad
    accumulating = grads.copy()
    accumulating[rows[first]] = False
    opening = rows[first & (own > 0)]
    closing = rows[~is_grad & (own > 0) & after_grad]
    return _GradientSpans(accumulating, opening, closing)


def static_parts(schedule: Schedule, costs: Costs) -> dict[str, list[int]]:
    """Per part (`MEMORY_PARTS`) and device, the bytes held from start to end: weights, gradients as accumulated
    and optimizer state (master weights included) of every stage it holds, per pipeline replica, each 1/(d·C) of
    itself where ZeRO's stage shards it over the d replicas and C context ranks (ZeRO-2's and 3's gradients, held
    only from a backward until the update, and ZeRO-3's whole weights while computed with, are `_unsharded`'s), and
    the policy's extra weight copies (its master copies as the optimizer owns the weights, the rest as the passes
    read them) and a float8 recipe's weight casts, whole (parameters), the receive
    buffers its stages keep, each `StageCosts.receive_buffer_bytes` a micro-batch (communication), and the
    runtime's own buffer, the largest `StageCosts.runtime_buffer_bytes` of its stages (one a process:
    runtime_buffers). Its memory never drops below their sum."""
    parts: dict[str, list[int]] = {part: [] for part in MEMORY_PARTS}
    for device in range(schedule.num_devices):
        held = held_static_parts(schedule, [costs.stages[s] for s in schedule.stages_on(device)])
        for part, values in parts.items():
            values.append(held.get(part, 0))
    return parts


def shard_bytes(stages: Sequence[StageCosts], nbytes: Callable[[StageCosts], int], ranks: int) -> int:
    """One of `ranks` ZeRO shards of what `nbytes` reads of `stages`, each stage's routed experts sharded over their
    own smaller group (`StageCosts.shard_scale`), rounded up."""
    return -(-sum(round(nbytes(c) * c.shard_scale) for c in stages) // ranks)


def held_static_parts(schedule: Schedule, mine: Sequence[StageCosts]) -> dict[str, int]:
    """`static_parts` of a device holding the stages `mine` (by part; those it holds none of left out), also what
    the memory-fitting partitioner counts a layer to hold (planning/scenario.py `Scenario.cut`)."""
    def shard(nbytes: Callable[[StageCosts], int]) -> int:
        return shard_bytes(mine, nbytes, schedule.gradient_ranks)

    weights = sum(c.param_bytes for c in mine)
    # below ZeRO-3 the weights as all-gathered are what is held (TransformerEngine's float8 weights: their data
    # at 1 byte, `StageCosts.all_gather_bytes`), else `param_bytes`
    stored, grads = sum(c.gathered_weight_bytes for c in mine), sum(c.gradient_bytes for c in mine)
    state = sum(c.optimizer_state_bytes for c in mine)
    if schedule.zero >= 3:  # ZeRO-3 (FSDP): the weights as stored, sharded
        stored = shard(attrgetter("stored_param_bytes"))
    if schedule.zero >= 2:  # ZeRO-2: the gradients only while computed and until the update (`_unsharded`)
        grads = 0
    if schedule.zero >= 1:  # ZeRO-1: each of the d replicas keeps its shard of the state
        state = shard(attrgetter("optimizer_state_bytes"))
    float8 = sum(c.float8_weight_bytes for c in mine)  # a float8 recipe's weight casts: never sharded
    policy = schedule.policy
    copies = ((policy.extra_copies - policy.master_copies) * weights
              + policy.master_copies * sum(c.owned_weight_bytes for c in mine))
    return {"parameters": (stored + float8) * schedule.pipelines + copies,
            "gradients": grads * schedule.pipelines,
            "optimizer_state": state * schedule.pipelines,
            "communication": schedule.microbatches // schedule.rounds  # a flush's
                             * sum(c.receive_buffer_bytes for c in mine),
            "runtime_buffers": max((c.runtime_buffer_bytes for c in mine), default=0)}


def static_bytes(schedule: Schedule, costs: Costs) -> list[int]:
    """Per device, the bytes held from start to end (`static_parts` summed)."""
    return [sum(held) for held in zip(*static_parts(schedule, costs).values())]


class _SharedCores:
    """One host's cores shared by processor sharing: while k pieces of work run on it (compute rows, and the
    runtime's host time between rows, which needs a core as much), each advances at 1 / slowdown[k - 1] of its
    speed alone (the last factor beyond the measured k). A collective of one of the host's devices runs on them
    too where `beside` was measured (gloo's threads reduce and send on the host's cores): while k pieces of
    compute run, it advances at 1 / beside[k] of its speed alone (`beside[0]` is 1), and it does not count among
    the compute's k (its slowing them was not measured). Work is in picoseconds alone; `run` gives the event that
    succeeds, with its end time, when a piece's work is done."""

    def __init__(self, env: simpy.Environment, slowdown: tuple[float, ...], beside: tuple[float, ...] = ()) -> None:
        self.env, self.slowdown, self.beside = env, slowdown, beside
        self.left: dict[simpy.Event, float] = {}  # running rows: work still to do
        self.collectives: set[simpy.Event] = set()  # those of `left` that are collectives
        self.since = 0  # when `left` was last brought up to date
        self.next_end: simpy.Event | None = None  # the timer for the next row to finish; older ones are stale

    def run(self, work_ps: int, collective: bool = False) -> simpy.Event:
        self._advance()
        finished = self.env.event()
        self.left[finished] = float(work_ps)
        if collective:
            self.collectives.add(finished)
        self._plan()
        return finished

    def _speed(self, row: simpy.Event | None = None) -> float:
        """A piece's speed: a compute row's (`row` None: any compute row's), or a collective's."""
        computing = len(self.left) - len(self.collectives)
        if row in self.collectives:
            return 1.0 / self.beside[min(computing, len(self.beside) - 1)]
        return 1.0 / self.slowdown[min(max(computing, 1), len(self.slowdown)) - 1]

    def _advance(self) -> None:
        if self.left:
            elapsed = self.env.now - self.since
            done = elapsed * self._speed()
            for row in self.left:
                self.left[row] -= elapsed * self._speed(row) if row in self.collectives else done
        self.since = self.env.now

    def _plan(self) -> None:
        if not self.left:
            self.next_end = None
            return
        soonest = min(work / self._speed(row) for row, work in self.left.items()) if self.collectives \
            else min(self.left.values()) / self._speed()
        timer = self.next_end = self.env.timeout(max(0, math.ceil(soonest)))
        timer.callbacks.append(lambda _: self._finish(timer))

    def _finish(self, timer: simpy.Event) -> None:
        if timer is not self.next_end:  # a row started or ended since: a later timer stands for it
            return
        self._advance()
        # a picosecond's work (what rounding the timer to whole picoseconds leaves), each at its speed
        for row in [row for row, work in self.left.items() if work <= self._speed(row)]:
            del self.left[row]
            self.collectives.discard(row)
            row.succeed(self.env.now)
        self._plan()


def _unshared(program: _Program) -> bool:
    """Whether the devices share nothing but links each of which one device's sends alone take: no compute resource,
    no host's cores, no link two devices send on."""
    if any(u is not None for u in program.compute_unit) or any(h is not None for h in program.host_unit):
        return False
    sender: dict[int, int] = {}
    for channel, route in zip(program.lowered.channels, program.routes):
        for resource in route:
            if sender.setdefault(resource, channel.src_device) != channel.src_device:
                return False
    return True


class _Model:
    """The device processes; times in integer picoseconds.

    Each device keeps its own clock and stops only where another device's progress matters: to wait for a
    transfer not yet sent and, where resources are shared (`timed`), before reserving a shared link or a shared
    compute resource, to let SimPy's simulated time reach its own clock, so shared resources serve requests in
    the order they were made (a capacity-one SimPy Resource held for the span would grant the same, at two events
    per row). A compute row on shared cores waits for its end, which the rows running beside it decide.
    Everything else (compute of its own, sends on private links) advances the device's clock without an
    event, which is exact because nothing else can observe it in between. Where nothing is shared, a device's
    clock depends on the data it receives alone, never on when other devices reach theirs: SimPy's time order is
    then not needed, and the processes run as plain coroutines, each until it waits for data (the same integers,
    without an event per wait); where many devices run side by side, sweeps that advance all of them a step at a
    time run first (`_lockstep`). Where the devices share nothing but links each taken by one device's sends (which
    serve them in that device's order, whenever it runs), they run as coroutines too, and where transfers hold the
    compute, with a simulated time of their own, a heap of the compute ends devices wait at (`_run_timed`): exact as
    SimPy's, at a fraction of its cost a step.
    """

    def __init__(self, program: _Program, overlap_comm: bool, transfers_hold: bool = False) -> None:
        self.program = program
        self.overlap_comm = overlap_comm
        devices = len(program.step_bounds) - 1
        # Timed where devices share nothing but links each taken by one device's sends: without SimPy (`_run_timed`).
        self.env = simpy.Environment() if program.timed and not _unshared(program) else None
        # Every device's clock at its start and after each of its steps (SEND issued, RECV arrived, the start of
        # a compute row that is a step), in one list (see `_Program.start_clock`; -1: not reached yet); per
        # transfer id, its arrival once its SEND step has run (-1 before). Arrays of machine integers: they keep
        # no Python object per clock, and the trace reads them as numpy arrays without a copy.
        self.clocks = array.array("q", [-1]) * program.num_clocks
        for start in program.start_clock.tolist():
            self.clocks[start] = 0
        self.arrival = array.array("q", [-1]) * len(program.send_clock)
        # Per clock index not reached yet, who waits for it (events to succeed, or coroutines to resume).
        self.waiters: dict[int, list] = {}
        self.ready: collections.deque = collections.deque()  # coroutines to resume, where nothing is timed
        self.running = None  # the coroutine running, where nothing is timed
        self.free_at = [0] * program.num_resources
        beside = program.collective_contention
        self.cores = [_SharedCores(self.env, program.contention, beside)
                      for _ in range(max((u + 1 for u in program.host_unit if u is not None), default=0))]
        # Where a host's collectives share its cores (`beside`, `_SharedCores`): per such collective, its lane's
        # clock at its begin -> its host and network ps alone; and, once it has ended, how much longer it took
        # (by which its lane's clock moved on: `_Program.collective_clock`).
        self.on_host: dict[int, tuple[int, int]] = {}
        if self.cores and beside:
            hosts = [program.host_unit[d] for d in program.lowered.table.device[program.collective_rows].tolist()]
            self.on_host = {clock: (host, ps) for clock, host, ps in zip(
                program.collective_clock.tolist(), hosts, program.collective_ps.tolist()) if host is not None}
        self.network_stretch_ps: dict[int, int] = {}
        # A row on shared cores lasts as long as they let it (a copy only where there are some), and so does
        # the host time before it (how much longer: its stretch).
        self.duration_ps = program.duration_ps.copy() if self.cores else program.duration_ps
        self.host_stretch_ps = np.zeros(len(program.duration_ps), dtype=np.int64) if self.cores else None
        # Where transfers hold the compute beside them (`Costs.transfers_hold_products`; devices that queue their
        # compute on a shared resource aside): per device, the spans its transfers' kernels run (a send's from its
        # issue, a receive's while its data moves: begin and end, ps), and every hold of a device's compute as three
        # numbers (the clock index before it, how far into the compute since that clock it began, its length), which
        # `_held_back` lays on the rows: machine integers, as `clocks`, which numpy reads without a Python object per
        # hold.
        self.kernels: list[list[tuple[int, int]]] | None = (
            [[] for _ in range(devices)] if transfers_hold and program.timed else None)
        self.held = array.array("q")
        # Per channel: the links its transfers take, their time and their receiver.
        self.channels = list(zip(program.routes, program.channel_ps,
                                 (channel.dst_device for channel in program.lowered.channels)))
        self.units = program.lowered.units
        # Timed without SimPy (`_run_timed`): the simulated time the run has reached, the devices waiting for it to
        # reach the end of their compute (end, device, coroutine), per device a time before which it issues no more
        # sends, and the devices that send to each.
        self.now = 0
        self.due: list[tuple[int, int, object]] = []
        self.frontier = [0] * devices
        self.senders: list[set[int]] = [set() for _ in range(devices)]
        for channel in program.lowered.channels:
            self.senders[channel.dst_device].add(channel.src_device)
        # Per device waiting for a clock not reached: that clock and the device that sends it the transfer it waits
        # for (-1: a collective); per channel, its sender.
        self.awaited = [_AWAITS_NONE] * devices
        self.sender_of = [channel.src_device for channel in program.lowered.channels]
        # Per device whose blocking SENDs wait for simulated time to pass a time (`_exchange_sends`): that time.
        self.timers: list[int | None] = [None] * devices
        self.finished = 0

    def _succeed(self, events: list[simpy.Event]) -> None:
        for event in events:
            event.succeed()

    def coroutine(self, d: int, first: int, clock: int):
        """Device d's steps where nothing is timed, from its step `first` on (at `clock`; `_lockstep` may have run
        those before): each step's clock is the later of the clock before it plus the compute since and the clock
        it waits for plus the time after it (see `_Program.steps`). Only waiting for a clock not reached yet
        suspends the coroutine, so this loop is all the run costs per step: three numbers read, one written. The
        columns are read through memoryviews, whose Python ints are made one at a time and reused (`tolist` would
        keep a million of them, and fault in their memory)."""
        clocks, waiters, resume = self.clocks, self.waiters, self.ready.extend
        me = self.running
        start = int(self.program.start_clock[d]) + first
        busy, _, _, waits_for, after = (memoryview(column[first:]) for column in self.program.steps[d])
        for mine, busy_ps, other, after_ps in zip(range(start + 1, start + 1 + len(busy)), busy, waits_for, after):
            clock += busy_ps
            ready = clocks[other]
            if ready < 0:  # not sent yet: wait until the sender has that clock
                waiters.setdefault(other, []).append(me)
                yield
                ready = clocks[other]
            ready += after_ps
            if ready > clock:
                clock = ready
            clocks[mine] = clock
            woken = waiters.pop(mine, None)
            if woken:
                resume(woken)
        self.finished += 1

    def process(self, d: int):
        """Device d's steps as a SimPy process, where resources are shared; `self.clocks` gets its clock after
        each: a transfer's SEND issued or RECV arrived, a compute row's start (the clock after it is that plus
        its duration, in the next step's compute ps)."""
        env = self.env
        program = self.program
        cores = self.cores[program.host_unit[d]] if program.host_unit[d] is not None else None
        unit = program.compute_unit[d]
        rows = program.step_rows[program.step_bounds[d]:program.step_bounds[d + 1]] if cores else None
        duration = self.duration_ps
        arrival, free_at, clocks, waiters = self.arrival, self.free_at, self.clocks, self.waiters
        routes, units = program.routes, program.lowered.units
        overlap = self.overlap_comm
        on_host, stretched = self.on_host, self.network_stretch_ps
        send, recv, compute = int(Stream.SEND), int(Stream.RECV), int(Stream.COMPUTE)  # plain ints: this loop runs
        queued = cores is not None or unit is not None  # once per step
        kernels = self.kernels[d] if self.kernels is not None and d < len(self.kernels) and not queued else None
        product_ps = program.product_ps[d] if kernels is not None else None
        start = int(program.start_clock[d])
        clock = computed_ps = 0  # computed_ps: the last compute row's own time, at the head of the next busy_ps
        columns = tuple(map(memoryview, program.steps[d]))  # Python ints, one at a time
        ends: dict[int, int] = {}  # blocking: per SEND step of the exchange under way, its arrival
        for mine, busy_ps, stream, xid, other, after_ps, row in zip(
                itertools.count(start + 1), *columns, rows.tolist() if cores else itertools.repeat(-1)):
            if stream == _BESIDE:  # a SEND of the exchange the one before began, issued with it (`_exchange_sends`)
                clock = clocks[mine] = max(clock, ends.pop(mine))
                woken = waiters.pop(mine, None)
                if woken:
                    self._succeed(woken)
                continue
            if kernels is not None and busy_ps:  # the compute since the last step, held by the transfer kernels
                computing_from = clock  # beside it: once simulated time reaches its end, every kernel that began
                while True:  # under it is known (a sender announces its transfer when it issues it)
                    end, holds = held_compute(kernels, computing_from, busy_ps, product_ps, hold_tag=mine - 1)
                    if end <= env.now:
                        break
                    yield env.timeout(end - env.now)
                self._hold(kernels, end, holds)
                clock = end
            else:
                clock += busy_ps
            if cores is not None and busy_ps > computed_ps:  # the runtime's host time between rows shares them too
                host_ps = busy_ps - computed_ps
                if clock - host_ps > env.now:
                    yield env.timeout(clock - host_ps - env.now)
                end = yield cores.run(host_ps)
                self.host_stretch_ps[row] = end - clock
                clock = end
            computed_ps = 0
            if stream == _FIRST:  # a blocking exchange's SENDs: this one and the `_BESIDE` after it
                ends = yield from self._exchange_sends(d, columns, start + 1, mine, clock, kernels)
                clock = ends.pop(mine)
            elif stream == recv and after_ps < 0 and not overlap:  # blocking: its data, once its SEND is issued
                if arrival[xid] < 0:
                    waiter = env.event()
                    waiters.setdefault(~xid, []).append(waiter)
                    yield waiter
                clock = max(clock, arrival[xid])
            elif stream == recv or other != start:  # a RECV waits for its data, a row that needs a collective (or a
                if clocks[other] < 0:  # lane step its row) for that clock: wait until the sender (or lane) has it
                    waiter = env.event()
                    waiters.setdefault(other, []).append(waiter)
                    yield waiter
                # A fixed time after that clock, or the arrival its SEND step found. (The step's own clock is set
                # below, once known whole: a SEND that waited for a collective has not found its arrival yet, and a
                # receive that sees the clock reads that arrival.)
                ready = clocks[other] + after_ps if after_ps >= 0 else arrival[xid]
                if ready > clock:
                    clock = ready
            if stream == send:
                if routes[xid // units] and clock > env.now:  # a shared link: wait until simulated time reaches
                    yield env.timeout(clock - env.now)  # the send, then queue on it
                end = self._issue(xid, clock, kernels)
                if not overlap:  # its blocking exchange's one SEND, whose arrival its RECV waits for
                    clock = end
                    woken = waiters.pop(~xid, None)
                    if woken:
                        self._succeed(woken)
                clocks[mine] = clock
            elif stream == compute and queued:  # on the shared resource `unit` or shared `cores`; `xid`: its duration
                if clock > env.now:
                    yield env.timeout(clock - env.now)
                if cores is not None:
                    end = yield cores.run(xid)
                    duration[row] = end - clock
                    clocks[mine] = clock
                    clock, computed_ps = end - xid, xid  # the next step's compute ps count the row's duration alone
                else:
                    if free_at[unit] > clock:
                        clock = free_at[unit]
                    free_at[unit] = clock + xid
                    clocks[mine] = clock
            elif mine in on_host:  # a collective beginning, on its host's shared cores: as long as they let it
                host, network_ps = on_host[mine]
                if clock > env.now:
                    yield env.timeout(clock - env.now)
                end = yield self.cores[host].run(network_ps, collective=True)
                stretched[mine] = end - clock - network_ps
                clock = clocks[mine] = end - network_ps  # moved on: it ends, as the lane's next step adds, its
                # network ps after its clock
            else:  # a collective issued, or a compute row of its own that waited for one
                clocks[mine] = clock
            woken = waiters.pop(mine, None)
            if woken:
                self._succeed(woken)
        self.finished += 1

    def timed_coroutine(self, d: int):
        """Device d's steps where the program is timed and nothing is shared but links each taken by one device's
        sends (`_run_timed`), as `process` runs them: such a link serves its sends in the order its device issues
        them, whenever that runs, as SimPy's time order does. Where transfers hold the compute (`kernels`), a
        compute span's end is known once every kernel that begins before it is: its own sends', and those of the
        transfers it receives, which begin no earlier than their sender's issue. So it ends at once where each
        device sending to it will issue no more sends before that end (`frontier`), else it waits for the run's
        simulated time to reach the end (every device then has issued what it sends before then, as under SimPy)
        and works it out again with the kernels announced meanwhile."""
        program = self.program
        clocks, waiters, resume, arrival = self.clocks, self.waiters, self.ready.extend, self.arrival
        due, frontier, senders, sends_after = self.due, self.frontier, tuple(self.senders[d]), self._sends_after
        kernels = None if self.kernels is None else self.kernels[d]
        product_ps = program.product_ps[d] if kernels is not None else None
        awaited, sender_of, units = self.awaited, self.sender_of, program.lowered.units
        overlap = self.overlap_comm
        me = self.running
        start = int(program.start_clock[d])
        send, recv = int(Stream.SEND), int(Stream.RECV)
        clock = 0
        columns = tuple(map(memoryview, program.steps[d]))  # Python ints, one at a time
        ends: dict[int, int] = {}  # as `process`'s
        for mine, busy_ps, stream, xid, other, after_ps in zip(itertools.count(start + 1), *columns):
            if stream == _BESIDE:  # as `process`
                clock = clocks[mine] = max(clock, ends.pop(mine))
                woken = waiters.pop(mine, None)
                if woken:
                    resume(woken)
                continue
            if kernels is None:
                clock += busy_ps
            elif busy_ps:
                end, holds = (held_compute(kernels, clock, busy_ps, product_ps, hold_tag=mine - 1) if kernels
                              else (clock + busy_ps, ()))
                while True:
                    for s in senders:
                        if frontier[s] < end and not sends_after(s, d, end):
                            break
                    else:
                        break
                    # Wait for simulated time to reach the end, which kernels announced meanwhile may put later.
                    frontier[d], known = end, len(kernels)
                    heapq.heappush(due, (end, d, me))
                    yield
                    if len(kernels) == known:
                        break
                    end, holds = held_compute(kernels, clock, busy_ps, product_ps, hold_tag=mine - 1)
                    if end <= self.now:
                        break
                if holds or kernels:
                    self._hold(kernels, end, holds)
                clock = end
            if stream == _FIRST:  # as `process`
                ends = yield from self._exchange_sends(d, columns, start + 1, mine, clock, kernels, me)
                clock = ends.pop(mine)
            elif stream == recv and after_ps < 0 and not overlap:  # as `process`
                if arrival[xid] < 0:
                    frontier[d] = clock
                    awaited[d] = (~xid, sender_of[xid // units])
                    waiters.setdefault(~xid, []).append(me)
                    yield
                    awaited[d] = _AWAITS_NONE
                if arrival[xid] > clock:
                    clock = arrival[xid]
            elif stream == recv or other != start:  # as `process`
                if clocks[other] < 0:
                    frontier[d] = clock
                    awaited[d] = (other, sender_of[xid // units] if stream == recv else -1)
                    waiters.setdefault(other, []).append(me)
                    yield
                    awaited[d] = _AWAITS_NONE
                ready = clocks[other] + after_ps if after_ps >= 0 else arrival[xid]
                if ready > clock:
                    clock = ready
            if stream == send:
                end = self._issue(xid, clock, kernels)
                if not overlap:  # as `process`
                    clock = end
                    woken = waiters.pop(~xid, None)
                    if woken:
                        resume(woken)
            clocks[mine] = clock
            woken = waiters.pop(mine, None)
            if woken:
                resume(woken)
        frontier[d] = _NEVER
        self.finished += 1

    def _sends_after(self, s: int, d: int, end: int) -> bool:
        """Whether device s, sending to device d, which computes until at least `end`, sends nothing more before
        `end`: its `frontier` says so, or it waits for a transfer not sent yet from a device that sends nothing more
        before then (its sends come after that transfer's arrival), or from d (d sends nothing before its compute
        ends)."""
        frontier, awaited, clocks, arrival = self.frontier, self.awaited, self.clocks, self.arrival
        for _ in range(len(frontier)):  # a chain of devices, each waiting for the next (a cycle: deadlocked)
            if frontier[s] >= end:
                return True
            other, s = awaited[s]  # (a blocking RECV waits for its transfer's arrival: `~xid`)
            if s < 0 or (clocks[other] if other >= 0 else arrival[~other]) >= 0:  # for a collective, or nothing now
                return False
            if s == d:
                return True
        return False

    def _hold(self, kernels: list[tuple[int, int]], end: int, holds: list[int]) -> None:
        """Records the holds of a device's compute (`held_compute`'s), which ended at `end`, and forgets the
        kernels that ended by then."""
        if holds:
            self.held.extend(holds)
        if kernels:
            kernels[:] = [kernel for kernel in kernels if kernel[1] > end]

    def _issue(self, xid: int, clock: int, kernels: list[tuple[int, int]] | None) -> int:
        """The transfer `xid` sent at `clock`, queued on its route's links: records and returns its arrival and,
        where transfers hold the compute (`kernels`: the sender's), its kernels: NCCL's send kernel runs from its
        launch until its data has moved, the receive's while the data moves."""
        route, transfer_ps, receiver = self.channels[xid // self.units]
        begin, free_at = clock, self.free_at
        for r in route:
            if free_at[r] > begin:
                begin = free_at[r]
        end = begin + transfer_ps
        for r in route:
            free_at[r] = end
        self.arrival[xid] = end
        if kernels is not None:
            kernels.append((clock, end))
            self.kernels[receiver].append((begin, end))
        return end

    def _exchange_sends(self, d: int, columns: tuple, first: int, mine: int, post_ps: int,
                        kernels: list[tuple[int, int]] | None, me=None):
        """Device d's blocking exchange's SENDs, `mine` (its `_FIRST` step, posted at `post_ps`) and the `_BESIDE` ones
        after it (`columns`: d's steps', from clock index `first`), as NCCL runs a group's sends: independently but
        for those to one peer, in order (its user guide's point-to-point page). Each is issued once its own receiver
        has posted, at the later of that post and its own (the exchange's plus its SENDs' host time up to it),
        whatever the others wait for; those on a link reach it in the order of those times, then the exchange's (one
        peer's keep theirs: `exchange_order` has their receives posted in order, so their times never fall). So one
        waits while a SEND on its link whose receiver has not posted could come first: until simulated time has
        passed its time (SimPy's other events of that time, or the compute ends `_run_timed` pops, have run), after
        which none is as early. Returns per SEND step its arrival, which its RECV waits for (`~xid` in `waiters`), not
        for the SEND's step. (`me`: d's `timed_coroutine`, where there is no SimPy.)"""
        busy, stream, operand, waits_for, after = columns
        clocks, waiters, routes, units, env = self.clocks, self.waiters, self.program.routes, self.units, self.env
        pending: list[_PendingSend] = []
        at = mine - first
        while True:
            pending.append(_PendingSend(at, first + at, operand[at], waits_for[at], after[at], post_ps))
            at += 1
            if at == len(stream) or stream[at] != _BESIDE:
                break
            post_ps += busy[at]
        ends: dict[int, int] = {}
        settled = -1  # the time up to which simulated time has passed: every post up to it is made
        while True:
            now = self.now if env is None else env.now
            floor = max(now, settled + 1)  # no post not made yet is earlier
            known, unknown = [], []
            for send in pending:
                posted = clocks[send.receiver_clock]
                if posted < 0:
                    unknown.append(send)
                else:
                    known.append((max(send.own_ps, posted + send.receiver_ps), send.place, send))  # ties: by place
            if len(known) > 1:
                known.sort()
            timer, held = None, set()  # the time the first SEND on a link waits for; the links it and those after hold
            for issue_ps, _, send in known:
                route = routes[send.xid // units]
                if route and ((env is not None and issue_ps > now) or (held and not held.isdisjoint(route)) or any(
                        (max(other.own_ps, floor), other.place) < (issue_ps, send.place)
                        and not set(route).isdisjoint(routes[other.xid // units]) for other in unknown)):
                    held.update(route)
                    timer = issue_ps if timer is None else timer
                    continue
                ends[send.step] = self._issue(send.xid, issue_ps, kernels)
                pending.remove(send)
                woken = waiters.pop(~send.xid, None)
                if woken:
                    if env is None:
                        self.ready.extend(woken)
                    else:
                        self._succeed(woken)
            if not pending:
                return ends
            keys = list({send.receiver_clock: None for send in unknown})
            if env is not None:
                events = [env.event() for _ in keys]
                for key, event in zip(keys, events):
                    waiters.setdefault(key, []).append(event)
                settling = None
                if timer is not None:
                    if timer > now:
                        events.append(env.timeout(timer - now))
                    else:  # only a post still to come at this time could go first: after all of them (an event
                        settling = simpy.Event(env)  # succeeded as SimPy's Timeout is, at a later priority)
                        settling._ok, settling._value = True, None
                        env.schedule(settling, _SETTLED)
                        events.append(settling)
                yield events[0] if len(events) == 1 else env.any_of(events)
                for key, event in zip(keys, events):
                    if not event.triggered:
                        waiters[key].remove(event)
                if settling is not None and settling.processed:
                    settled = now
                continue
            self.frontier[d] = min([issue_ps for issue_ps, _, send in known if send in pending]
                                   + [send.own_ps for send in unknown])
            self.awaited[d] = (keys[0], -1) if keys else _AWAITS_NONE
            for key in keys:
                waiters.setdefault(key, []).append(me)
            if timer is not None:
                self.timers[d] = timer
                heapq.heappush(self.due, (timer, len(self.frontier) + d, me))
            yield
            self.awaited[d] = _AWAITS_NONE
            if timer is not None and self.timers[d] is None:
                settled = timer
            self.timers[d] = None
            for key in keys:
                if me in waiters.get(key, ()):
                    waiters[key].remove(me)
            while me in self.ready:
                self.ready.remove(me)

    def _run_timed(self) -> None:
        """The devices' `timed_coroutine`s and the lanes' `coroutine`s, each run until it waits for a clock not
        reached or for simulated time to reach the end of its compute; once none can go on, simulated time moves to
        the earliest such end."""
        devices, ready, due = len(self.frontier), self.ready, self.due
        for d in range(len(self.program.steps)):
            self.running = self.timed_coroutine(d) if d < devices else self.coroutine(d, 0, 0)
            next(self.running, None)
        while True:
            while ready:
                next(ready.pop(), None)
            if not due:
                return
            self.now, rank, waiting = heapq.heappop(due)
            if rank >= devices:  # a device's SENDs waiting for simulated time to pass theirs (`_exchange_sends`)
                if self.timers[rank - devices] != self.now:  # it went on since
                    continue
                self.timers[rank - devices] = None
            next(waiting, None)

    def run(self) -> None:
        """Run every device's steps, which the run consumes: it empties `_Program.steps` (and their columns) at the
        end, so that their memory (five numbers per step: 40 MiB for a million) is free for the trace, which does
        not read them."""
        devices = range(len(self.program.steps))
        if self.env is not None:
            for d in devices:
                self.env.process(self.process(d))
            self.env.run()
        elif self.program.timed:
            self._run_timed()
        else:
            reached = self._lockstep()
            ready = self.ready
            for d in devices:  # each coroutine takes itself from `running` when first run, to leave with what it awaits
                self.running = self.coroutine(d, *reached[d])
                next(self.running, None)
            while ready:
                next(ready.pop(), None)
        self.program.steps.clear()
        self.program.step_columns = ()

    def _lockstep(self) -> list[tuple[int, int]]:
        """A faster run of the coroutines' steps where many devices run side by side: one sweep advances every
        device (and lane) whose next step's awaited clock is reached by one step, all in a few numpy operations,
        to the clock the coroutine would give it (the same integers). A sweep costs about what 25 coroutine steps
        do, so it pays where a sweep advances more: 1F1B on p = 128 takes 8.4k sweeps of 123 steps, 0.1 s, against
        0.42 s for its million steps one at a time. Sweeps go on while each window of them advances enough steps
        (not a narrow pipeline's, nor a wide one's last drain): the coroutines go on from where each device got.
        Returns per device and lane the step it got to and its clock there."""
        offsets = self.program.step_offsets
        lanes = len(offsets) - 1
        position, end = offsets[:-1].copy(), offsets[1:]
        clock = np.zeros(lanes, dtype=np.int64)
        if lanes >= _SWEEP_PAYS:
            busy_ps, _, _, waits_for, after_ps = self.program.step_columns
            clocks = np.frombuffer(self.clocks, dtype=np.int64)
            active = np.flatnonzero(position < end)
            sweep = advanced = 0
            horizon = 0  # sweeps before a lane can run out of steps (a sweep advances each at most one)
            while len(active):
                if horizon == 0:
                    active = active[position[active] < end[active]]
                    if not len(active):
                        break
                    horizon = int((end[active] - position[active]).min())
                horizon -= 1
                step = position[active]
                ready = clocks[waits_for[step]]
                going = ready >= 0
                if going.all():
                    lane = active
                else:
                    lane, step, ready = active[going], step[going], ready[going]
                reached = clock[lane]
                reached += busy_ps[step]
                ready += after_ps[step]
                np.maximum(reached, ready, out=reached)
                clock[lane] = reached
                step += 1
                position[lane] = step
                step += lane
                clocks[step] = reached  # the clock after global step g of lane L is at g + L + 1
                advanced += len(lane)
                sweep += 1
                if sweep % _SWEEP_WINDOW == 0:
                    if advanced < _SWEEP_WINDOW * _SWEEP_PAYS:
                        break
                    advanced = 0
        return list(zip((position - offsets[:-1]).tolist(), clock.tolist()))


def simulate(
    schedule: Schedule, costs: Costs, cluster: Cluster, *, jitter: float = 0.0, seed: int = 0, memory: bool = True,
    part_curves: bool = True,
) -> Trace:
    """Predict the timeline of `schedule` on `cluster` with `costs`; the same inputs give the same trace.

    `jitter` > 0 multiplies every compute time by a log-normal factor with that sigma, drawn from `seed`.
    `memory` False: the rows alone, no counters nor memory at the peak (about 70 % of the trace's making), for a
    caller that reads only when rows run (tune's longer runs for a steady step); the rows are the same.
    `part_curves` False: no curve per memory part (`memory_bytes.PART`), which only a page draws, for a run no page
    or trace file shows (a fifth of `simulate -p 128 -m 4096`); the total's curve and its parts at the peak stay.
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
    model = _Model(program, cluster.overlap_comm, costs.transfers_hold_products)
    model.run()
    if model.finished < len(program.start_clock):  # a device or lane whose steps never ended
        validate(schedule)
        waiting = "" if cluster.overlap_comm else (": their blocking exchanges wait for each other (leave out "
                                                   "--blocking-comm)")
        raise SimulationError(f"{schedule.method}: {schedule.num_devices - model.finished} devices never "
                              f"finished{waiting}")
    return _trace(costs, cluster, program, model, jitter, seed, memory, part_curves)


def _trace(costs: Costs, cluster: Cluster, program: _Program, model: _Model, jitter: float, seed: int,
           memory: bool = True, part_curves: bool = True) -> Trace:
    lowered = program.lowered
    schedule, t, bounds = lowered.schedule, lowered.table, lowered.bounds
    # The point-to-point transfers' rows and ids, which the times and the memory counters below all read.
    transfers = np.flatnonzero((program.stream == Stream.SEND) | (program.stream == Stream.RECV))
    transfer_ids = lowered.transfer[transfers]
    issued_ps, end_ps = _issue_and_end_times(program, model, transfers, transfer_ids)
    # The trace consumes the program: its per-row timing columns are read, and released here so that the
    # counters below reuse their memory (three columns of a million rows, and the transfers' and steps').
    program.clock_before = program.since_ps = program.duration_ps = model.duration_ps = None
    program.send_clock = program.send_to_arrival_ps = program.step_rows = model.arrival = None
    program.receiver_clock = program.receiver_to_arrival_ps = None
    # Counter events: a SEND allocates when issued and frees when its transfer ends; a RECV allocates on arrival,
    # or where the runtime posts it ahead. Their times stay picoseconds here (the issue times' column becomes the
    # first events'): each device's become milliseconds as its counters are made, which spares two columns of
    # a million rows.
    first_ps = issued_ps
    if costs.recv_window:
        receives, posted = _posting_rows(bounds, program.stream, costs.recv_window)
        posted_ps = first_ps[posted]
    np.copyto(first_ps, end_ps, where=program.stream == Stream.RECV)
    if costs.recv_window:
        first_ps[receives] = posted_ps
    counters, parts_at_peak, savers_at_peak = (
        _counters(program, costs, transfers, transfer_ids, first_ps, end_ps, part_curves) if memory
        else ({}, None, None))
    start_ps = _start_times(program, model, first_ps, end_ps, transfers, transfer_ids)
    del transfers, transfer_ids
    devices = schedule.num_devices
    # Microseconds as (ps / ps per ms) * 1e3, computed in place where a buffer is free.
    start_us = start_ps / _PS_PER_MS
    start_us *= 1e3
    dur_us = np.subtract(end_ps, start_ps, out=end_ps) / (_PS_PER_MS / 1e3)
    ops = Ops(device=t.device, stream=program.stream, kind=t.kind, stage=t.stage, microbatch=t.microbatch,
              minibatch=t.minibatch, pipeline=t.pipeline, peer=t.peer, version=lowered.version,
              prediction=lowered.prediction, start_us=start_us, dur_us=dur_us)
    meta = TraceMeta.of_schedule(
        "predicted", schedule, costs.microbatch_size, costs=[dict(vars(c)) for c in costs.stages],
        cluster=cluster.describe(), jitter=jitter, seed=seed, calibration=costs.calibration,
        peak_memory_parts=parts_at_peak, peak_activation_parts=savers_at_peak, extra=_runtime_terms(costs))
    return Trace(tuple(k.value for k in KINDS), devices, ops, meta, counters)


def _counters(program: _Program, costs: Costs, transfers: np.ndarray, transfer_ids: np.ndarray, first_ps: np.ndarray,
              end_ps: np.ndarray, part_curves: bool
              ) -> tuple[dict[str, list[Counter]], list[dict[str, int]], list[dict[str, int]]]:
    """The trace's counters (each row's events at `first_ps` and `end_ps`; each part's curve where `part_curves`),
    and per device each memory part and each saver of activations at its peak."""
    lowered = program.lowered
    schedule, t, bounds = lowered.schedule, lowered.table, lowered.bounds
    devices = schedule.num_devices
    memory_tables = _memory_tables(program, costs, transfers, transfer_ids)
    static = program.static_parts
    memory, peak_events = _step_counters(bounds, first_ps, end_ps,
                                         memory_tables.row_deltas(MEMORY_PARTS, 0, len(t.kind)),
                                         [sum(held) for held in zip(*static.values())])
    # Per device, each part at its peak: what it holds throughout and its rows' events up to the peak's.
    up_to_peak = _up_to_peak(bounds, first_ps, end_ps, peak_events)
    parts_at_peak, savers_at_peak = [], []
    for d, (lo, hi) in enumerate(itertools.pairwise(bounds)):
        moved = memory_tables.parts_up_to(lo, hi, up_to_peak[0][lo:hi], up_to_peak[1][lo:hi])
        parts_at_peak.append({part: static[part][d] + moved[part] for part in MEMORY_PARTS})
        savers_at_peak.append({saver.partition(".")[2]: moved[saver] for saver in SAVERS})
    del up_to_peak
    # Each part's own curve on every device, one pass per part: the page stacks the fullest device's, which the
    # caching allocator's reserve, added after the step (sim/caching_allocator.py `add_reserve`), can change;
    # `keep_fullest_parts` then drops the others'.
    part_counters = {}
    for part in (*MEMORY_PARTS, *SAVERS) if part_curves else ():
        part_counters[f"memory_bytes.{part}"], _ = _step_counters(
            bounds, first_ps, end_ps, memory_tables.row_deltas((part,), 0, len(t.kind)),
            static[part] if part in static else [0] * devices)
    del memory_tables
    act_at_start = kind_mask(t.kind, Kind.F).astype(np.int8)  # +1 or 0: a byte per row is enough
    act_at_end = -kind_mask(t.kind, Kind.B, Kind.W).astype(np.int8)
    counters = {
        "memory_bytes": memory,
        "activations": _step_counters(bounds, first_ps, end_ps, (act_at_start, act_at_end), [0] * devices)[0],
        "weight_versions": _level_counters(bounds, end_ps, lowered.held_after, resting_copies(schedule)),
        **part_counters,
    }
    return counters, parts_at_peak, savers_at_peak


def keep_fullest_parts(trace: Trace) -> None:
    """Empties every device's `memory_bytes.PART` curves but the fullest's (its `memory_bytes` peak, the reserve
    included where added), the one the table's peak and the page's stacked curve show: the others' would nearly
    double a trace's counters in memory and on disk."""
    totals = trace.counters["memory_bytes"]
    fullest = int(np.argmax([curve.values.max() for curve in totals]))
    empty = Counter(np.zeros(0), np.zeros(0, dtype=np.int64))
    for name, curves in trace.counters.items():
        if name.startswith("memory_bytes."):
            trace.counters[name] = [curve if d == fullest else empty for d, curve in enumerate(curves)]


def _issue_and_end_times(program: _Program, model: _Model, transfers: np.ndarray, transfer_ids: np.ndarray
                         ) -> tuple[np.ndarray, np.ndarray]:
    """Per row, when it was issued and when it ended (ps): a transfer when it arrives, a collective its network
    time after its lane's clock (`_Program.collective_clock`). (A function of its own, so that its temporaries are
    freed before the trace makes its columns.)"""
    clocks = np.frombuffer(model.clocks, dtype=np.int64)
    issued_ps = _issue_times(program, model, clocks)
    duration_ps = model.duration_ps
    if model.held:
        later_ps, longer_ps = _held_back(program, model)
        issued_ps += later_ps
        duration_ps = duration_ps + longer_ps
    end_ps = issued_ps + duration_ps
    if len(transfers):
        if program.timed:  # every SEND was a step and found its arrival
            arrival = np.frombuffer(model.arrival, dtype=np.int64)
        else:  # every SEND arrives a fixed time after a clock of its device (blocking: or of its receiver's, later)
            arrival = clocks[program.send_clock] + program.send_to_arrival_ps
            if program.receiver_clock is not None:
                np.maximum(arrival, clocks[program.receiver_clock] + program.receiver_to_arrival_ps, out=arrival)
        end_ps[transfers] = arrival[transfer_ids]
    end_ps[program.collective_rows] = clocks[program.collective_clock] + program.collective_ps
    return issued_ps, end_ps


def _start_times(program: _Program, model: _Model, issued_ps: np.ndarray, end_ps: np.ndarray, transfers: np.ndarray,
                 transfer_ids: np.ndarray) -> np.ndarray:
    """Per row, when it started (ps), in `issued_ps`'s memory, which holds the issue times on every row but the
    transfers': a row starts when issued, a transfer its duration before it arrives, a collective at its lane's
    begin (its clock, before what the host's cores stretched it moved that on)."""
    channel = transfer_ids // program.lowered.units
    issued_ps[transfers] = end_ps[transfers] - np.asarray(program.channel_ps, dtype=np.int64)[channel]
    issued_ps[program.collective_rows] = np.frombuffer(model.clocks, dtype=np.int64)[program.collective_clock]
    if model.network_stretch_ps:  # collectives that shared their host's cores took longer
        stretch = model.network_stretch_ps
        issued_ps[program.collective_rows] -= [stretch.get(clock, 0) for clock in program.collective_clock.tolist()]
    return issued_ps


def _runtime_terms(costs: Costs) -> dict:
    """The runtime's terms the prediction used, for its metadata (none: a what-if without them)."""
    terms = {}
    if costs.overhead != RowOverhead():
        terms["row_overhead"] = asdict(costs.overhead)
    if costs.kept_gradients:
        terms["kept_gradients"] = costs.kept_gradients
    if costs.recv_window:
        terms["recv_window"] = costs.recv_window
    if costs.overlap_hidden_fraction:  # how the overlapped pairs were priced
        terms["overlap_hidden_fraction"] = costs.overlap_hidden_fraction
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


def _held_back(program: _Program, model: _Model) -> tuple[np.ndarray, np.ndarray]:
    """Per row, how much later it starts and how much longer it runs for the transfer kernels that held its
    device's compute (`_Model.held`): the compute row running where a hold began (ps of the device's compute since
    the clock before it) lasts the hold longer, every row after it up to the device's next step starts that much
    later."""
    clock_before, since, duration = program.clock_before, program.since_ps, program.duration_ps
    later, longer = np.zeros(len(since) + 1, dtype=np.int64), np.zeros(len(since), dtype=np.int64)
    clock, at, held = np.frombuffer(model.held, dtype=np.int64).reshape(-1, 3).T
    # Per clock index, the first row whose clock before is it or later: clock_before ascends, so one search for
    # every index in order beats a search per hold (each a cache miss) several times over.
    first_row = np.searchsorted(clock_before, np.arange(program.num_clocks + 1))
    lo, hi = first_row[clock], first_row[clock + 1]  # the rows whose clock before is the hold's
    first_after = _search_right(since, lo, hi, at)
    np.add.at(later, first_after, held)
    np.add.at(later, hi, -held)
    running = first_after - 1  # the row the hold began in, if it computes there
    inside = (running >= lo) & (program.stream[running] == Stream.COMPUTE)
    inside &= since[running] + duration[running] > at
    np.add.at(longer, running[inside], held[inside])
    return np.cumsum(later[:-1]), longer


def _search_right(values: np.ndarray, lo: np.ndarray, hi: np.ndarray, targets: np.ndarray) -> np.ndarray:
    """Per target, `np.searchsorted(values[lo:hi], target, "right") + lo`, each slice ascending: one bisection of
    all of them at once (a step per halving of the longest slice), not a numpy call per target."""
    lo, hi = lo.astype(np.int64), hi.astype(np.int64)
    while True:
        open_ = np.flatnonzero(lo < hi)
        if not len(open_):
            return lo
        mid = (lo[open_] + hi[open_]) // 2
        right = values[mid] <= targets[open_]
        lo[open_[right]] = mid[right] + 1
        hi[open_[~right]] = mid[~right]


def _issue_times(program: _Program, model: _Model, clocks: np.ndarray) -> np.ndarray:
    """When each row was issued (compute: start; SEND: issued; RECV: wait began): the device's clock
    before the row plus the compute time since; a compute step starts at its clock. `clocks`: `_Model.clocks`."""
    steps = program.step_rows
    out = clocks[program.clock_before]
    out += program.since_ps
    if model.duration_ps is not program.duration_ps:  # a row after one stretched on shared cores (all of whose
        stretch = model.duration_ps - program.duration_ps  # rows are steps) starts later, as does one after host
        device = program.lowered.table.device  # time they stretched
        out[1:] += np.where(device[1:] == device[:-1], stretch[:-1], 0)
        out += model.host_stretch_ps
    queued = steps[program.stream[steps] == Stream.COMPUTE]
    out[queued] = clocks[program.clock_before[queued] + 1]
    return out


def _event_times_ms(first_ps: np.ndarray, second_ps: np.ndarray, lo: int, hi: int) -> np.ndarray:
    """Rows lo..hi's two events in order (row i's at 2i and 2i + 1, relative to lo), in ms: the times the
    counters sort by."""
    times = np.empty(2 * (hi - lo))
    times[0::2], times[1::2] = first_ps[lo:hi], second_ps[lo:hi]
    times /= _PS_PER_MS
    return times


def _step_counters(bounds, first_ps, second_ps, deltas: tuple[np.ndarray, np.ndarray] | None, initial
                   ) -> tuple[list[Counter], list[int]]:
    """Per device (rows bounds[d]..bounds[d+1], in program order), the running total of `deltas` (per row, one
    applied at each of its two event times: picoseconds; the counter's in µs as ms * 1e3), in time order (ties
    keep program order, so an op's end counts before the next op's start); and per device the event (2i: row lo +
    i's start, 2i + 1: its end) after which the total first reaches its largest value, -1 where that is the
    initial value. Events that change nothing are left out before any time is sorted; `deltas` None: none changes
    anything (most parts' curves: a part no row moves), and no event is made."""
    out, peaks = [], []
    keep, mine_times, mine_deltas = np.zeros(0, dtype=np.int64), np.zeros(0), np.zeros(0, dtype=np.int64)
    for d, (lo, hi) in enumerate(itertools.pairwise(bounds)):
        if deltas is not None:
            mine_deltas = np.empty(2 * (hi - lo), dtype=np.int64)
            mine_deltas[0::2], mine_deltas[1::2] = deltas[0][lo:hi], deltas[1][lo:hi]
            keep = np.flatnonzero(mine_deltas != 0)
            mine_times, mine_deltas = _event_times_ms(first_ps, second_ps, lo, hi)[keep], mine_deltas[keep]
        if not abs(initial[d]) + float(np.abs(mine_deltas).sum(dtype=np.float64)) < COUNTER_LIMIT:  # int64 wraps
            raise CostError(f"device {d}'s rows add and free more bytes than the simulator's counters hold "
                            f"({COUNTER_LIMIT:.3g}): lower the sizes or m (--microbatches)")
        order = np.argsort(mine_times, kind="stable")
        values = initial[d] + np.cumsum(mine_deltas[order])
        highest = int(np.argmax(values)) if len(values) else -1
        peaks.append(int(keep[order[highest]]) if highest >= 0 and values[highest] > initial[d] else -1)
        out.append(Counter(np.concatenate([[0.0], mine_times[order] * 1e3]),
                           np.concatenate([[initial[d]], values]).astype(np.int64)))
    return out, peaks


def _up_to_peak(bounds, first_ps, second_ps, peak_events: list[int]) -> tuple[np.ndarray, np.ndarray]:
    """Per row, whether its first and its second event count at its device's peak (`_step_counters`'
    `peak_events`): those the counters' order (by time, ties by event) puts at or before the peak's event, as
    the sort put them, whether or not they change the total (one that moves bytes from part to part does not)."""
    firsts, seconds = np.zeros(len(first_ps), dtype=bool), np.zeros(len(first_ps), dtype=bool)
    for (lo, hi), peak in zip(itertools.pairwise(bounds), peak_events):
        if peak < 0:
            continue
        times = _event_times_ms(first_ps, second_ps, lo, hi)
        counted = (times < times[peak]) | ((times == times[peak]) & (np.arange(len(times)) <= peak))
        firsts[lo:hi], seconds[lo:hi] = counted[0::2], counted[1::2]
    return firsts, seconds


def _level_counters(bounds, end_ps, level, initial) -> list[Counter]:
    """Per device (rows bounds[d]..bounds[d+1]), samples of `level` (valid after each op ends, at `end_ps`)
    wherever it changes."""
    out = []
    for lo, hi in zip(bounds[:-1], bounds[1:]):
        values = level[lo:hi]
        change = np.ones(len(values), dtype=bool)
        change[1:] = values[1:] != values[:-1]
        times = end_ps[lo:hi][change] / _PS_PER_MS
        out.append(Counter(np.concatenate([[0.0], times * 1e3]), np.concatenate([[initial], values[change]])))
    return out
