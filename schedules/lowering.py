"""Lower a schedule for a runtime: per device, the ordered rows it walks, with nothing priced yet.

The rows are the schedule's actions with every cross-device transfer made explicit (`add_communication`),
and, per row, what a runtime needs to know besides time: the weight version a compute row reads and how
far its weights are predicted, the weight copies taken and freed, and a transfer id that pairs each SEND
with its RECV. The simulator prices these rows; the executor runs them. Pure numpy.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .analysis import _action, check_complete, local_order_ok, resting_copies, validate, weight_versions
from .catalogue import METHODS
from .ir import COLLECTIVE_KINDS, PASS_COLLECTIVE_KINDS, RECV_KINDS, Kind, Schedule, ScheduleError
from .passes import communication_rows, exchange_order, gathered_passes
from .table import FIELD_DTYPE, KIND_CODE, NUM_COMPUTE_KINDS, ActionTable, kind_mask


def preflight(schedule: Schedule, *, dry_run: bool = False) -> None:
    """Raise ScheduleError unless the schedule is complete and no device waits on itself.

    The vectorised local-order check leaves one failure a runtime can meet: devices waiting on each other's
    transfers. `dry_run` proves that cannot happen too (the executor, where a stall costs a timeout); without
    it the dry run explains a failed local check only (the simulator, which finds a stall at the end of its
    run and explains it with `validate`)."""
    check_complete(schedule)
    if dry_run or not local_order_ok(schedule):
        validate(schedule)


@dataclass(frozen=True)
class Channel:
    """One direction of a stage-graph edge between two devices: activations flow from `edge[0]` to
    `edge[1]`, input gradients back. `producer` made the tensor (a gradient has its activation's size)."""

    edge: tuple[int, int]
    backward: bool
    src_device: int
    dst_device: int

    @property
    def producer(self) -> int:
        return self.edge[0]

    @property
    def sender(self) -> int:
        """The stage whose device sends."""
        return self.edge[1] if self.backward else self.edge[0]

    @property
    def receiver(self) -> int:
        return self.edge[0] if self.backward else self.edge[1]


@dataclass(frozen=True)
class Lowered:
    """A schedule's rows, grouped by device in the order each device runs them (device d: rows
    `bounds[d]:bounds[d+1]`).

    Per row: `origin`, the schedule action it came from (its index in `schedule.table`; -1 for an inserted
    SEND or RECV); `version`, the weight version a compute row reads (-1 for OPT and transfers);
    `prediction`, the distance s its weights are predicted over (-1: not predicted); `copies_delta`, the
    change at the row's end in versions of its stage held besides the current one (+1 at an update whose
    old version a later row still reads, -1 after a version's last read); `held_after`, the largest
    number of weight copies of one stage its device holds after it (transfers keep the level before them);
    `transfer`, the id a SEND shares with its RECV (-1 for compute): channel c, unit u (micro-batch,
    mini-batch, pipeline) is `c * units + u`; `awaits_first` and `awaits`, the collective rows (REDUCE, GATHER,
    A2A_*, RING_*) a row must wait for before it starts, every one of rows `awaits_first..awaits` of its device,
    on whatever lane each runs (-1: none): an OPT waits for its REDUCE (the gradients it applies), a stage's first
    row after a GATHER for the gathered weights (under ZeRO-3 the pass it was issued ahead of), the device's next
    row after a run of a pass's collectives (its all-to-alls, then its ring), a receive aside, for the whole run
    (the pass they follow is done only when all of them are, and a ring may run on a link of its own beside the
    all-to-alls: `Costs.collective_links`). A collective itself holds its device no longer than issuing it.
    `blocking`: the rows are in the order of a runtime whose exchanges block (`exchange_order`).
    """

    schedule: Schedule
    table: ActionTable
    origin: np.ndarray
    bounds: np.ndarray
    version: np.ndarray
    prediction: np.ndarray
    copies_delta: np.ndarray
    held_after: np.ndarray
    transfer: np.ndarray
    channels: tuple[Channel, ...]
    units: int
    awaits_first: np.ndarray
    awaits: np.ndarray
    blocking: bool = False

    @property
    def is_compute(self) -> np.ndarray:
        return self.table.kind < NUM_COMPUTE_KINDS

    @property
    def is_send(self) -> np.ndarray:
        return kind_mask(self.table.kind, Kind.SEND_F, Kind.SEND_B)

    def rows(self, device: int) -> range:
        return range(int(self.bounds[device]), int(self.bounds[device + 1]))

    def channel_of(self, transfer: np.ndarray) -> np.ndarray:
        return np.asarray(transfer) // self.units


def lower(schedule: Schedule, exchange_ps: np.ndarray | None = None, natural: Lowered | None = None) -> Lowered:
    """The schedule's rows for a runtime (see `Lowered`); assumes `preflight` passed. `exchange_ps`: for a runtime
    whose exchanges block, the rows in its order (`exchange_order`), given per row of `lower(schedule)` the time it
    holds its device, which places each SEND at its receiver's exchange where Megatron-core's order waits forever;
    `natural`: `lower(schedule)` where the caller has it, whose rows are reordered rather than made again."""
    t, origin, transfer = ((natural.table, natural.origin, natural.transfer) if natural is not None
                           else communication_rows(schedule))
    if exchange_ps is not None:
        method = METHODS.get(schedule.method)  # None: a schedule of no catalogue method's (read from a file)
        order = exchange_order(schedule, t, transfer, exchange_ps, method is not None and method.exchanges_per_step)
        t, origin, transfer = t.select(order), origin[order], transfer[order]
    versions = weight_versions(schedule)
    own = np.flatnonzero(origin >= 0)  # the schedule's actions, in order

    def scatter(values: np.ndarray, fill: int) -> np.ndarray:
        """`values` on the schedule's actions, `fill` on the transfers. A column that is `fill` on every row
        is that one number broadcast, read-only (no memory: a synchronous schedule predicts no weights and holds
        no second copy, and these columns have millions of rows)."""
        if not np.any(values != fill):
            return np.broadcast_to(FIELD_DTYPE(fill), origin.shape)
        out = np.full(len(origin), fill, dtype=FIELD_DTYPE)
        out[own] = values
        return out

    # A transfer keeps the weight-copy level of the compute row before it on its device (the base level
    # before any).
    base = resting_copies(schedule)
    held = scatter(versions.held_after, base)
    if np.any(versions.held_after != base):
        last_compute = np.maximum.accumulate(np.where(origin >= 0, np.arange(len(origin)), 0))
        held = np.where(t.device[last_compute] == t.device, held[last_compute], base)

    placement = schedule.placement
    edges = [e for e in schedule.graph.edges if placement[e[0]] != placement[e[1]]]
    channels = tuple(Channel(edge, backward, placement[edge[1] if backward else edge[0]],
                             placement[edge[0] if backward else edge[1]])
                     for edge in edges for backward in (False, True))  # numbered as `communication_rows` does
    units = schedule.microbatches * schedule.minibatches * schedule.pipelines
    bounds = np.searchsorted(t.device, np.arange(schedule.num_devices + 1))
    return Lowered(schedule, t, origin, bounds, scatter(versions.read, -1), scatter(versions.prediction, -1),
                   scatter(versions.copies_delta, 0), held, transfer, channels, units, *_awaits(schedule, t),
                   exchange_ps is not None)


def _awaits(schedule: Schedule, t: ActionTable) -> tuple[np.ndarray, np.ndarray]:
    """`Lowered.awaits_first` and `Lowered.awaits`: -1 broadcast where the schedule has no collective rows (d = 1);
    one array, both, where every row waits for one collective at most."""
    collective = kind_mask(t.kind, *COLLECTIVE_KINDS)
    if not collective.any():
        none = np.broadcast_to(FIELD_DTYPE(-1), t.kind.shape)
        return none, none
    awaits = np.full(len(t.kind), -1, dtype=FIELD_DTYPE)
    step = t.step_index(schedule)
    update = np.flatnonzero(t.kind == KIND_CODE[Kind.OPT])
    update_of_step = np.zeros(schedule.num_stages * schedule.minibatches * schedule.pipelines, dtype=np.int64)
    update_of_step[step[update]] = update
    reduces = np.flatnonzero(t.kind == KIND_CODE[Kind.REDUCE])[::-1]
    _, last = np.unique(step[reduces], return_index=True)  # a step's last (one a backward: `reduced_passes`)
    awaits[update_of_step[step[reduces[last]]]] = reduces[last]
    if schedule.zero >= 3:  # ZeRO-3's GATHERs, each a step's, in program order as the passes they gather for
        gathers = np.flatnonzero(t.kind == KIND_CODE[Kind.GATHER])
        passes = gathered_passes(schedule, t)
        awaits[passes[np.argsort(step[passes], kind="stable")]] = gathers[np.argsort(step[gathers], kind="stable")]
    else:  # a GATHER's waiter: the next row of its stage replica that is not a collective (a stage is on one
        # device, so its rows, grouped by replica in program order, follow one another there)
        own = np.flatnonzero((t.kind < NUM_COMPUTE_KINDS) & ~kind_mask(t.kind, Kind.REDUCE))
        replica = t.stage[own] * schedule.pipelines + t.pipeline[own]
        own = own[np.argsort(replica, kind="stable")]
        replica = t.stage[own] * schedule.pipelines + t.pipeline[own]
        gathers = np.flatnonzero(t.kind[own] == KIND_CODE[Kind.GATHER])
        waited = gathers[(gathers + 1 < len(own))
                         & (replica[np.minimum(gathers + 1, len(own) - 1)] == replica[gathers])]
        awaits[own[waited + 1]] = own[waited]
    # After a run of a pass's collectives (all-to-alls, rings), their device's next row but a receive (which waits
    # for its data, not for them) waits for the whole run. (A run follows its pass, so it never begins a device's
    # rows: no run crosses from one device's rows to the next's.)
    run = kind_mask(t.kind, *PASS_COLLECTIVE_KINDS)
    if not run.any():
        return awaits, awaits
    first = np.flatnonzero(run & ~np.r_[False, run[:-1]])
    last = np.flatnonzero(run & ~np.append(run[1:], False))
    others = np.flatnonzero(~run & ~kind_mask(t.kind, *RECV_KINDS))
    following = np.searchsorted(others, last)
    found = following < len(others)
    first, last, waiter = first[found], last[found], others[following[found]]
    mine = t.device[waiter] == t.device[last]
    awaits_first = awaits.copy()
    awaits_first[waiter[mine]] = first[mine]
    awaits[waiter[mine]] = last[mine]
    return awaits_first, awaits


def check_transfer_order(lowered: Lowered) -> None:
    """Raise ScheduleError unless, on every channel, the sender issues its SENDs in the order the receiver
    posts the matching RECVs. Then transfers need no tags: a FIFO per channel delivers each where it is
    expected, and receives can be posted ahead in schedule order. (One FIFO per device pair would not do:
    a V schedule sends chunk 0's activations and chunk 1's gradients from device 0 to device 1 in an order
    its neighbour consumes them in another.)"""
    t, transfer = lowered.table, lowered.transfer
    rows = np.flatnonzero(transfer >= 0)
    sending = lowered.is_send[rows]
    channel = lowered.channel_of(transfer[rows])
    # Rows are in device order and a channel has one sending and one receiving device, so a stable sort by
    # channel keeps each side's order.
    sends = rows[sending][np.argsort(channel[sending], kind="stable")]
    recvs = rows[~sending][np.argsort(channel[~sending], kind="stable")]
    wrong = np.flatnonzero(transfer[sends] != transfer[recvs])
    if len(wrong):
        send, recv = int(sends[wrong[0]]), int(recvs[wrong[0]])
        c = lowered.channels[int(lowered.channel_of(transfer[send]))]
        raise ScheduleError(
            f"{lowered.schedule.method}: device {c.src_device} sends {_action(t, send)} to device {c.dst_device} "
            f"when device {c.dst_device} expects {_action(t, recv)}: their order on stage edge {c.edge[0]}->"
            f"{c.edge[1]} ({'gradients' if c.backward else 'activations'}) crosses")
