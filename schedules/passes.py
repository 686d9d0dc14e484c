"""IR passes: transform a schedule instead of special-casing the runtimes that interpret it."""

from __future__ import annotations

import numpy as np

from .ir import ALL_TO_ALL_KINDS, COLLECTIVE_KINDS, PASS_COLLECTIVE_KINDS, RING_KINDS, Kind, Schedule, ScheduleError
from .table import FIELD_DTYPE, KIND_CODE, KIND_DTYPE, ActionTable, OrderView, kind_mask, require_field_fits


def communication_table(schedule: Schedule, table: ActionTable | None = None) -> tuple[ActionTable, np.ndarray]:
    """The columnar form of `add_communication`: the lowered actions, and for each lowered row the row of
    `table` it came from (-1 for an inserted SEND or RECV). Vectorised, so it scales to millions of ops."""
    lowered, origin, _ = communication_rows(schedule, table)
    return lowered, origin


def communication_rows(schedule: Schedule, table: ActionTable | None = None
                       ) -> tuple[ActionTable, np.ndarray, np.ndarray]:
    """`communication_table`, and per lowered row its transfer id (-1 for a compute row), which a SEND shares
    with its RECV: channel c, unit u is `c * units + u`, for units = m * N * r (u = (micro-batch * N +
    mini-batch) * r + pipeline); channel 2e carries the activations of the e-th stage-graph edge between two
    devices (in `graph.edges` order), 2e + 1 its gradients. Ids come from structure, not matching: both ends
    compute the same dense id."""
    t = table or schedule.table
    n = len(t.kind)
    forward = t.kind == KIND_CODE[Kind.F]
    backward = (t.kind == KIND_CODE[Kind.B]) | (t.kind == KIND_CODE[Kind.I])
    by_stage = np.argsort(t.stage, kind="stable")
    bounds = np.searchsorted(t.stage[by_stage], np.arange(schedule.num_stages + 1))
    # Each row becomes its RECVs, itself, its SENDs; count them first, then place everything directly.
    groups = []  # (rows that own the transfer, its kind, the peer stage, whether it comes before the row, channel)
    count = {True: np.zeros(n, dtype=FIELD_DTYPE), False: np.zeros(n, dtype=FIELD_DTYPE)}
    edges = [(src, dst) for src, dst in schedule.graph.edges if schedule.placement[src] != schedule.placement[dst]]
    owners_of: dict[tuple[bool, int], np.ndarray] = {}  # a stage's forwards (or backwards): a chain's receive and send

    def owning(is_forward: bool, stage: int) -> np.ndarray:
        if (is_forward, stage) not in owners_of:
            of_stage = by_stage[bounds[stage]:bounds[stage + 1]]
            owners_of[is_forward, stage] = of_stage[(forward if is_forward else backward)[of_stage]]
        return owners_of[is_forward, stage]

    # An overlapped pair (an F row then its B row, both naming a peer) receives both parts' inputs before its F and
    # sends both parts' outputs after its B; a pass's output is sent once its own collectives (the rows of
    # `PASS_COLLECTIVE_KINDS` right after it) are done: a transfer sits by its anchor, which is its owner but there.
    pair_forward = np.flatnonzero((t.kind == KIND_CODE[Kind.F]) & (t.peer >= 0))
    all_to_all = kind_mask(t.kind, *PASS_COLLECTIVE_KINDS)
    moved_anchor = len(pair_forward) or all_to_all.any()
    anchor = {True: np.arange(n), False: np.arange(n)} if moved_anchor else None
    if anchor is not None:
        anchor[True][pair_forward + 1] = pair_forward
        anchor[False][pair_forward] = pair_forward + 1
        if all_to_all.any():  # after a row, past the collectives that follow it: the next other row's, less one
            next_other = np.minimum.accumulate(np.where(all_to_all, n, np.arange(n))[::-1])[::-1]
            anchor[False] = np.append(next_other[1:], n)[anchor[False]] - 1
    for e, (src, dst) in enumerate(edges):
        for is_forward, stage, peer, kind, before, channel in (
            (True, dst, src, Kind.RECV_F, True, 2 * e), (True, src, dst, Kind.SEND_F, False, 2 * e),
            (False, src, dst, Kind.RECV_B, True, 2 * e + 1), (False, dst, src, Kind.SEND_B, False, 2 * e + 1),
        ):
            owners = owning(is_forward, stage)
            anchors = owners if anchor is None else anchor[before][owners]
            groups.append((owners, anchors, KIND_CODE[kind], peer, before, channel))
            count[before][anchors] += 1
    extra = count[True] + count[False]
    total = n + int(extra.sum(dtype=np.int64))
    units = schedule.microbatches * schedule.minibatches * schedule.pipelines
    require_field_fits(schedule, max(total, 2 * len(edges) * units), "rows or transfers")
    first_slot = np.arange(n, dtype=FIELD_DTYPE) + np.cumsum(extra, dtype=FIELD_DTYPE) - extra
    own_slot = first_slot + count[True]
    kinds, peers = np.empty(total, dtype=KIND_DTYPE), np.empty(total, dtype=FIELD_DTYPE)
    origin, transfer = (np.full(total, -1, dtype=FIELD_DTYPE) for _ in range(2))
    origin[own_slot] = np.arange(n, dtype=FIELD_DTYPE)
    kinds[own_slot], peers[own_slot] = t.kind, t.peer
    unit = (t.microbatch * schedule.minibatches + t.minibatch) * schedule.pipelines + t.pipeline
    # Where a row's next RECV, and its next SEND, goes; moved on only where a row has several on that side.
    next_slot = {True: first_slot, False: own_slot + 1}
    several = {before: n and bool(count[before].max() > 1) for before in (True, False)}
    if several[True]:
        next_slot[True] = first_slot.copy()
    moved = []  # (slots, owners) of the transfers an overlapped pair's other part anchors
    for owners, anchors, kind_code, peer, before, channel in groups:  # in group order, as `add_communication` says
        slot = next_slot[before][anchors]
        if several[before]:
            next_slot[before][anchors] += 1
        kinds[slot], peers[slot] = kind_code, peer
        transfer[slot] = unit[owners] + channel * units
        if anchors is not owners:
            away = anchors != owners
            moved.append((slot[away], owners[away]))
    # A row's transfers sit next to it and share its device, stage and unit: repeat its columns over them.
    copies = extra + 1

    def repeated(column: np.ndarray) -> np.ndarray:
        """`column` repeated over the rows' transfers; a column with one value on every row (the pipeline of one
        pipeline, the mini-batch of one) is that value broadcast, read-only: no memory for millions of rows. A
        column of long runs (a device's, a stage's) repeats each run's value over the run's lowered rows, a fill
        per run, not a copy count per row."""
        if n == 0:
            return column[:0]
        run = np.flatnonzero(column[1:] != column[:-1]) + 1  # where a run of one value begins, past the first
        if len(run) == 0:
            return np.broadcast_to(column[0], (total,))
        if len(run) < n // 16:
            return np.repeat(column[np.r_[0, run]], np.diff(np.r_[0, first_slot[run], total]))
        return np.repeat(column, copies)

    stage, microbatch = repeated(t.stage), repeated(t.microbatch)
    if moved:  # such a transfer is its owner's, not its anchor's (a pair's parts share device, mini-batch, pipeline)
        stage, microbatch = np.array(stage), np.array(microbatch)
        for slots, owners in moved:
            stage[slots], microbatch[slots] = t.stage[owners], t.microbatch[owners]
    return ActionTable(repeated(t.device), kinds, stage, microbatch, repeated(t.minibatch),
                       repeated(t.pipeline), peers), origin, transfer


def add_communication(schedule: Schedule) -> Schedule:
    """Make every cross-device transfer explicit.

    After each action whose output another device consumes comes a SEND per consuming stage; right
    before each action that consumes another device's output come the matching RECVs. Forward
    activations flow along the stage graph's edges, input gradients against them.
    """
    lowered, _ = communication_table(schedule)
    return schedule.with_orders(lowered.to_orders(schedule.num_devices))


def add_data_parallel(schedule: Schedule) -> Schedule:
    """Insert the gradient synchronisation of d > 1 data-parallel replicas (`Schedule.data_parallel`), or of the
    C > 1 context-parallel ranks a device stands for (`Schedule.gradient_ranks`).

    Each replica of a stage trains on its own micro-batches, so before each update (OPT) its gradients are
    averaged with the other replicas': a REDUCE row of the OPT's stage, mini-batch and pipeline, right after
    that stage's last backward row (B or W) before the OPT (right before the OPT if none precedes it), on the
    stage's device; with `reduce_after_flush`, right after its device's last backward row (of any stage) before the
    OPT, so that no REDUCE overlaps backward work (Megatron-LM all-reduces every chunk's gradients once the
    pipeline has flushed). With a sharded optimizer (ZeRO-1 and 2) the REDUCE is a reduce-scatter, each replica
    updates its shard, and a GATHER row right after the OPT all-gathers the updated weights. ZeRO-3 (FSDP) keeps
    only the shards: a GATHER row before each pass that computes with the whole weights (`gathered_passes`) instead,
    issued ahead of it as the runtime prefetches (`_prefetched`). With one stage and no pipeline under ZeRO-2
    and 3, a REDUCE right after every backward row instead (`reduced_passes`). d·C = 1: the schedule as it is.
    Vectorised over the action table, so it scales as the schedule does."""
    if schedule.gradient_ranks == 1:
        return schedule
    t = schedule.table
    if kind_mask(t.kind, *COLLECTIVE_KINDS).any():
        raise ScheduleError(f"{schedule.method}: the schedule has its REDUCE rows already")
    updates = t.kind == KIND_CODE[Kind.OPT]
    gradients = kind_mask(t.kind, Kind.B, Kind.W)
    each = reduced_passes(schedule)
    if each is not None:
        return _insert_collectives(schedule, np.flatnonzero(updates), each, each + 1)
    if schedule.reduce_after_flush:  # the device's rows stand for one replica: the last backward is any stage's
        last = np.maximum.accumulate(np.where(gradients, np.arange(len(t.kind)), -1))
        opts = np.flatnonzero(updates)
        found = last[opts]
        flushed = (found >= 0) & (t.device[np.maximum(found, 0)] == t.device[opts])
        return _insert_collectives(schedule, opts, opts, np.where(flushed, found + 1, opts))
    rows = np.flatnonzero(updates | gradients)
    replica = t.stage[rows] * schedule.pipelines + t.pipeline[rows]
    order = np.argsort(replica, kind="stable")  # by replica, each in program order (a replica is on one device)
    rows, replica = rows[order], replica[order]
    opt_at = np.flatnonzero(updates[rows])
    after_gradient = (opt_at > 0) & ~updates[rows[opt_at - 1]] & (replica[opt_at - 1] == replica[opt_at])
    opts = rows[opt_at]
    return _insert_collectives(schedule, opts, opts, np.where(after_gradient, rows[opt_at - 1] + 1, opts))


def add_expert_parallel(schedule: Schedule) -> Schedule:
    """Insert the all-to-alls of E > 1 expert-parallel ranks (`Schedule.expert_parallel`): an A2A_F row right after
    every forward (its routed experts' dispatch and combine) and an A2A_B row right after every backward that
    sends the input gradients back (B, or I: the routed tokens' gradients return as they came), on the row's
    device and of its stage and unit; an overlapped pair's after both its parts, the forward's first (the pair's
    parts stay next to each other). The row that follows a run of them waits for them (`Lowered.awaits`), and
    the pass's outputs are sent after them. E = 1: the schedule as it is. Vectorised."""
    if schedule.expert_parallel == 1:
        return schedule
    return _after_passes(schedule, ALL_TO_ALL_KINDS, Kind.A2A_F, Kind.A2A_B, "all-to-all")


def add_context_parallel(schedule: Schedule) -> Schedule:
    """Insert the key/value rings of C > 1 context-parallel ranks (`Schedule.context_parallel`): a RING_F row after
    every forward (its attention's C - 1 exchanges of the keys and values) and a RING_B row after every backward
    that runs the attention's backward (B, or I: the weight-gradient pass has none; the keys and values go round
    again with their gradients), each after the pass's all-to-alls (`add_expert_parallel`, applied first), as
    those are placed. The ring runs during its pass's attention (torch's `_templated_ring_attention`, Megatron's
    TransformerEngine p2p: step i's exchange under step i's partial attention); the simulator prices what of it
    the attention does not hide (`sim.costs.StageCosts.ring_fwd_ms`). C = 1: the schedule as it is. Vectorised."""
    if schedule.context_parallel == 1:
        return schedule
    return _after_passes(schedule, RING_KINDS, Kind.RING_F, Kind.RING_B, "ring")


def _after_passes(schedule: Schedule, kinds: frozenset[Kind], after_forward: Kind, after_backward: Kind,
                  what: str) -> Schedule:
    """A row of `after_forward` after every forward and one of `after_backward` after every B and I, of the pass's
    device, stage and unit, past the pass's collectives already there; an overlapped pair's after both its parts
    and theirs, the forward's first."""
    t = schedule.table
    if kind_mask(t.kind, *kinds).any():
        raise ScheduleError(f"{schedule.method}: the schedule has its {what} rows already")
    forward = t.kind == KIND_CODE[Kind.F]
    rows = np.flatnonzero(forward | kind_mask(t.kind, Kind.B, Kind.I))
    n = len(t.kind)
    own = kind_mask(t.kind, *PASS_COLLECTIVE_KINDS)  # a row's collectives already after it: the next other row's
    next_other = np.minimum.accumulate(np.where(own, n, np.arange(n))[::-1])[::-1]
    pair_forward = forward[rows] & (t.peer[rows] >= 0)
    past = rows + 1 + pair_forward  # past the pair's backward part
    after = np.append(next_other, n)[past]
    codes = np.where(forward[rows], KIND_CODE[after_forward], KIND_CODE[after_backward]).astype(t.kind.dtype)
    placed = np.lexsort((codes, after))  # at one place, the forward's first
    table = t.with_rows(after[placed], rows[placed], kind=codes[placed], peer=-1)
    return schedule.with_orders(OrderView(table, schedule.num_devices))


def _alone(schedule: Schedule) -> bool:
    """One stage and no pipeline: FSDP2 without torch's pipelining, at its defaults."""
    return schedule.graph.num_stages == 1 and schedule.pipelines == 1


def reduced_passes(schedule: Schedule, table: ActionTable | None = None) -> np.ndarray | None:
    """The backward rows (B, W; of `table`, by default the schedule's) that each reduce-scatter their gradients in
    a REDUCE of their own, where the runtime does so: FSDP2 alone under ZeRO-2 and 3 (`FSDPParamGroup.post_backward`
    reduce-scatters after every backward unless `set_requires_gradient_sync(False)`, which only torch's pipelining
    calls, for every backward of a stage but its last). None: one REDUCE a step, after the stage's last backward."""
    if schedule.zero < 2 or schedule.gradient_ranks == 1 or not _alone(schedule):
        return None
    t = table or schedule.table
    return np.flatnonzero(kind_mask(t.kind, Kind.B, Kind.W))


def gathered_passes(schedule: Schedule, table: ActionTable | None = None) -> np.ndarray:
    """The rows (of `table`, by default the schedule's) that ZeRO-3 all-gathers its stage's whole weights for, in
    program order: each stage replica's first forward of a mini-batch, whose weights then stay whole until its
    last backward (torchtitan's `apply_fsdp` sets `reshard_after_forward=False` under pipeline parallelism, and
    torch's pipelining reshards only after a stage's last backward); with one stage and no pipeline, every pass
    (F, B, I, W: FSDP2's default reshards after forward, so the backward gathers again). None with d·C = 1 or
    below ZeRO-3."""
    t = table or schedule.table
    if schedule.zero < 3 or schedule.gradient_ranks == 1:
        return np.zeros(0, dtype=np.int64)
    if _alone(schedule):
        return np.flatnonzero(kind_mask(t.kind, Kind.F, Kind.B, Kind.I, Kind.W))
    forwards = np.flatnonzero(t.kind == KIND_CODE[Kind.F])
    _, first = np.unique(t.step_index(schedule)[forwards], return_index=True)
    return np.sort(forwards[first])


def _prefetched(schedule: Schedule, passes: np.ndarray) -> np.ndarray:
    """Where a GATHER for each of `passes` goes (an index to insert before). With one stage and no pipeline (FSDP2
    alone): before the row ahead of it on its device, as FSDP2 issues the next module's all-gather while the
    current one computes. In a pipeline, as torch's runtime lowers a multi-stage schedule (`_add_unshard_reshard`
    in torch/distributed/pipelining/schedules.py: an UNSHARD, an all-gather of the whole stage issued async,
    for each of the next 3 stages the rank computes, before its step's first action; a single-stage schedule's
    first forward gathers at that same place): before its device's first row of its mini-batch (a device's
    stages all, even beyond 3). Never before a row that changes its stage's weights ahead of its pass (an OPT,
    PRED or AVG: the gathered weights are the changed ones), nor between an overlapped pair's parts. Assumes the
    table holds no collective rows yet."""
    t = schedule.table
    n = len(t.kind)
    if _alone(schedule):
        ahead = np.maximum(passes - 1, 0)
        place = np.where((passes > 0) & (t.device[ahead] == t.device[passes]), ahead, passes)
    else:
        step_of_device = t.device.astype(np.int64) * schedule.minibatches + t.minibatch
        steps, first = np.unique(step_of_device, return_index=True)
        place = first[np.searchsorted(steps, step_of_device[passes])]
    changes = np.flatnonzero(kind_mask(t.kind, Kind.OPT, Kind.PRED, Kind.AVG))
    changed = np.sort(t.stage[changes].astype(np.int64) * n + changes)  # by stage, then row
    before = np.searchsorted(changed, t.stage[passes].astype(np.int64) * n + passes) - 1
    own = (before >= 0) & (changed[np.maximum(before, 0)] // n == t.stage[passes])
    place = np.maximum(place, np.where(own, changed[np.maximum(before, 0)] % n + 1, 0))
    return place - ((t.kind[place] == KIND_CODE[Kind.B]) & (t.peer[place] >= 0))


def _insert_collectives(schedule: Schedule, opts: np.ndarray, reducing: np.ndarray, reduce_before: np.ndarray
                        ) -> Schedule:
    """`add_data_parallel`'s rows: a REDUCE for each row in `reducing` (an OPT, or a backward that reduces its own
    gradients) before the row `reduce_before` names, and with a sharded optimizer a GATHER right after each OPT of
    `opts` (ZeRO-1, 2), or ahead of each of `gathered_passes` (ZeRO-3); each of its row's stage, micro-batch and
    mini-batch."""
    t = schedule.table
    before, owner = [reduce_before], [reducing]
    kinds = [np.full(len(reducing), KIND_CODE[Kind.REDUCE])]
    passes = gathered_passes(schedule)
    if schedule.zero >= 3:
        before.append(_prefetched(schedule, passes))
        owner.append(passes)
    elif schedule.sharded_optimizer:
        before.append(opts + 1)
        owner.append(opts)
    if len(before) > 1:
        kinds.append(np.full(len(owner[1]), KIND_CODE[Kind.GATHER]))
    before, kinds, owner = np.concatenate(before), np.concatenate(kinds), np.concatenate(owner)
    placed = np.lexsort((owner, kinds, before))  # rows inserted at one place keep the order given
    table = t.with_rows(before[placed], owner[placed], kind=kinds[placed], peer=-1)
    return schedule.with_orders(OrderView(table, schedule.num_devices))


# The methods whose order Megatron-core pairs under `overlap_moe_expert_parallel_comm`: its interleaved 1F1B
# (pipesim's interleaved-1f1b with v >= 2), and with no pipeline its combined 1F1B (1f1b with p = 1).
EXPERT_OVERLAP_METHODS = ("1f1b", "interleaved-1f1b")


def overlap_expert_communication(schedule: Schedule) -> Schedule:
    """Megatron-core's expert-parallel overlap (`overlap_moe_expert_parallel_comm`, the recipes' `moe_a2a_overlap`):
    each device's steady-state forward runs as an overlapped pair with the backward it runs next, so each part's
    all-to-alls hide under the other's compute, as the schedule's `overlap_expert_comm` asks. Megatron-core
    (megatron/core/pipeline_parallel/schedules.py `get_pp_rank_microbatches`) runs one more warm-up forward than
    without, so that each pair's parts are independent, then in the steady state pairs forward k + warm-up with
    backward k (`combined_1f1b_schedule_for_interleaved_pipelining`); warm-up forwards and cool-down backwards run
    alone. With no pipeline (`combined_1f1b_schedule_for_no_pipelining`) that is the first forward alone, then each
    forward with the previous micro-batch's backward, then the last backward alone. Megatron-core refuses the
    overlap without expert parallelism, and under pipeline parallelism without virtual stages (transformer_config.py
    `__post_init__`; a virtual size of 1 is none, training/arguments.py), so this pass refuses them too, and an
    order that pairs its F and B already (DualPipe's F&B, which hides the all-to-alls so) as such. Applied before
    the other passes (`methods.make_schedule`), to the flushed F and B rows only."""
    if not schedule.params.get("overlap_expert_comm", False):
        return schedule
    t = schedule.table
    forward, backward = t.kind == KIND_CODE[Kind.F], t.kind == KIND_CODE[Kind.B]
    if schedule.method not in EXPERT_OVERLAP_METHODS:
        if (forward & (t.peer >= 0)).any():  # an order paired already: DualPipe's, DualPipeV's
            raise ScheduleError(f"{schedule.method}: its F&B pairs already hide each part's expert-parallel "
                                "all-to-alls under the other's compute, as --overlap-expert-comm pairs "
                                "interleaved-1f1b's F and B, and 1f1b's on one stage (Megatron-core's overlap); "
                                "leave it out")
        raise ScheduleError(f"{schedule.method}: Megatron-core overlaps the expert-parallel all-to-alls only in "
                            f"{' and '.join(EXPERT_OVERLAP_METHODS)}'s order; leave out --overlap-expert-comm")
    if schedule.expert_parallel == 1:
        raise ScheduleError(f"{schedule.method}: --overlap-expert-comm hides the expert-parallel all-to-alls, and "
                            "with E = 1 there are none: give --expert-parallel 2 or more")
    if schedule.num_devices > 1 and schedule.num_stages == schedule.num_devices:
        raise ScheduleError(f"{schedule.method}: Megatron-core overlaps the expert-parallel all-to-alls under "
                            "pipeline parallelism only with virtual stages: use interleaved-1f1b with --chunks 2 "
                            "or more, or --stages 1")
    segment = (t.device.astype(np.int64) * schedule.minibatches + t.minibatch) * schedule.pipelines + t.pipeline
    starts = np.flatnonzero(np.r_[True, segment[1:] != segment[:-1]])  # a device's mini-batch: its pattern, its OPTs
    order, peer, pairs = [], t.peer.copy(), 0
    for lo, hi in zip(starts, np.r_[starts[1:], len(segment)]):
        rows = np.arange(lo, hi)
        forwards, backwards = rows[forward[lo:hi]], rows[backward[lo:hi]]
        warmup = int(np.searchsorted(rows[forward[lo:hi] | backward[lo:hi]], backwards[0]))  # 1F1B's, plus one
        paired = len(forwards) - warmup
        pairs += paired
        pair_forwards, pair_backwards = forwards[warmup:], backwards[:paired]
        peer[pair_forwards], peer[pair_backwards] = t.stage[pair_backwards], t.stage[pair_forwards]
        order += [forwards[:warmup], np.stack([pair_forwards, pair_backwards], axis=1).ravel(), backwards[paired:],
                  rows[~(forward[lo:hi] | backward[lo:hi])]]
    if not pairs:  # it would change nothing, taken silently
        raise ScheduleError(f"{schedule.method}: --overlap-expert-comm pairs a steady-state forward with the backward "
                            f"run next, and at m = {schedule.microbatches} every forward runs in the warm-up, before "
                            "any backward: give more micro-batches, or leave it out")
    taken = np.concatenate(order)
    table = ActionTable(t.device[taken], t.kind[taken], t.stage[taken], t.microbatch[taken], t.minibatch[taken],
                        t.pipeline[taken], peer[taken])
    return schedule.with_orders(OrderView(table, schedule.num_devices))


def exchange_order(schedule: Schedule, t: ActionTable, transfer: np.ndarray, row_ps: np.ndarray,
                   per_step: bool = False) -> np.ndarray:
    """The order (a permutation of `t`'s rows, each device's kept together) in which a runtime whose exchanges block
    walks `schedule`'s lowered rows `t` (`communication_rows`; `transfer` pairs a SEND with its RECV): its exchanges
    are the SENDs and RECVs between two other rows of a device, which it posts together and waits for whole, as
    Megatron-core posts the sends and receives between two passes in one batch and waits for them all
    (megatron/core/pipeline_parallel/p2p_communication.py at NVIDIA/Megatron-LM d98e8a64dd: `_batched_p2p_ops`'
    `batch_isend_irecv`, then `_communicate`'s `req.wait()` on each), and a SEND moves only once its receiver has
    posted the RECV (NCCL's send and receive meet). Never between an overlapped pair's parts,
    nor between a pass and its collectives, nor between a forward and the backward after it where the runtime
    exchanges once for both (`per_step`: the method's `Method.exchanges_per_step`, where it has virtual stages).

    Each SEND at its device's first exchange after the row that made its data and each RECV at the last before the
    row that needs it, as Megatron-core posts them, unless that order waits forever (two devices each sending to
    the other at an exchange the other reaches only after its own send: `_waits_forever`). Then each SEND goes to
    the exchange at which its receiver posts the RECV in the run the rows make when no transfer takes time (each
    other row holds its device `row_ps`, at least 1, a RECV waits for its SEND): its device's last exchange posted
    at or before the row that needs the data starts, never before the row that made it. There each exchange's SENDs
    meet RECVs posted before its device's next exchange and its RECVs SENDs posted before theirs, so times grow
    along all a blocking exchange waits for (a device's next exchange waits for this one, which waits for its peers'
    posts): no exchange waits for itself. Within an exchange: its SENDs, then its RECVs, each in lowered order but
    those of one peer, which go in the order that peer posts them (`_in_pair_order`)."""
    n = len(t.kind)
    sending = kind_mask(t.kind, Kind.SEND_F, Kind.SEND_B)
    receiving = kind_mask(t.kind, Kind.RECV_F, Kind.RECV_B)
    ticking = ~(sending | receiving)
    device = t.device.astype(np.int64)
    index = np.arange(n)
    starts = np.flatnonzero(np.r_[True, device[1:] != device[:-1]]) if n else np.zeros(0, dtype=np.int64)
    own_start = np.repeat(starts, np.diff(np.r_[starts, n]))  # per row, its device's first row
    made = np.maximum.accumulate(np.where(ticking, index, -1))  # per row, the ticking row at or before it
    made = np.where(made >= own_start, made, -1)  # (-1: none of its device)
    needs = np.minimum.accumulate(np.where(ticking, index, n)[::-1])[::-1]  # the ticking row at or after it (n: none)
    recvs, sends = np.flatnonzero(receiving), np.flatnonzero(sending)
    # The rows an exchange may follow: a ticking row but an overlapped pair's forward part, a pass its collectives
    # follow, or where the runtime exchanges once for a forward and the backward after it, such a forward.
    follows_collective = np.r_[kind_mask(t.kind[1:], *PASS_COLLECTIVE_KINDS), False]
    pair_forward = (t.kind == KIND_CODE[Kind.F]) & (t.peer >= 0)
    anchors = ticking & ~pair_forward & ~follows_collective
    stepped = anchors.copy()
    if per_step and schedule.num_stages > schedule.num_devices:
        following = np.append(needs[1:], n)
        forward = np.flatnonzero((t.kind == KIND_CODE[Kind.F]) & (following < n))
        stepped[forward[(t.kind[following[forward]] == KIND_CODE[Kind.B])
                        & (device[following[forward]] == device[forward])]] = False
    points = np.flatnonzero(stepped)
    key = np.where(ticking, 2 * index, 0)
    at = np.searchsorted(points, made[sends])  # a SEND's first exchange at or after the row that made its data
    key[sends] = 2 * points[np.minimum(at, len(points) - 1)] + 1
    before = np.searchsorted(points, made[recvs], side="right") - 1  # a RECV's last at or before its natural one
    found = np.where(before >= 0, points[np.maximum(before, 0)], -1)
    key[recvs] = 2 * np.where(found >= own_start[recvs], found, -1) + 1
    order = _by_device_and_key(device, key, receiving)
    if not _waits_forever(t.kind[order], device[order], transfer[order]):
        return _in_pair_order(order, t.kind, device, transfer)
    # The run without transfer times: a device's clock after row r is the latest, over its rows j <= r, of when j
    # could begin (a RECV when its SEND's clock, its first row at 0) less the time held before j, plus the time
    # held up to r (a running maximum per device, repeated until the RECVs' SENDs' clocks hold), in units small
    # enough that every device's clocks, offset apart, fit in 62 bits.
    held = np.maximum(np.asarray(row_ps, dtype=np.int64), 1) * ticking
    total = int(held.sum(dtype=np.int64)) + 1
    unit = -(-2 * total * (int(device.max(initial=0)) + 1) // 2**61)
    if unit > 1:
        held = np.maximum(held // unit, 1) * ticking
    up_to = np.cumsum(held)
    up_to -= (up_to - held)[own_start]
    row_of = np.zeros(int(transfer.max(initial=-1)) + 1, dtype=np.int64)
    row_of[transfer[sends]] = sends
    sender = row_of[transfer[recvs]]
    span = 2 * total + 2  # more than any clock's range: keeps each device's running maximum to itself
    offset = device * span
    begins = np.full(n, -span, dtype=np.int64)
    begins[starts] = 0
    begins[recvs] = _receive_begins(recvs, sender, device, up_to, span)
    clock = np.maximum.accumulate(begins + offset) - offset + up_to
    points = np.flatnonzero(anchors)
    needed_at = np.zeros(len(row_of), dtype=np.int64)
    needed_at[transfer[recvs]] = clock[needs[recvs]] - held[needs[recvs]]
    found = np.searchsorted(offset[points] + clock[points], offset[sends] + needed_at[transfer[sends]], side="right")
    key = np.where(ticking, 2 * index, 2 * made + 1)
    key[sends] = 2 * np.maximum(points[np.maximum(found - 1, 0)], made[sends]) + 1
    return _in_pair_order(_by_device_and_key(device, key, receiving), t.kind, device, transfer)


def _by_device_and_key(device: np.ndarray, key: np.ndarray, receiving: np.ndarray) -> np.ndarray:
    """The rows by device, then `key` (-1 to twice the rows), SENDs before RECVs, then row: one stable sort of one
    integer, several times faster than sorting by each column in turn."""
    width = 2 * len(key) + 2
    return np.argsort((device * width + key + 1) * 2 + receiving, kind="stable")


def _in_pair_order(order: np.ndarray, kind: np.ndarray, device: np.ndarray, transfer: np.ndarray) -> np.ndarray:
    """`order` (a permutation of the rows `kind`, `device` and `transfer` describe, none of its exchanges waiting
    forever) with each exchange's SENDs to one peer in the order that peer posts their RECVs, and its RECVs from one
    peer in the order that peer posts their SENDs (at one exchange each end, the SENDs' order); every row keeps its
    exchange, and one peer's rows the places they held in it. NCCL runs a pair's sends and receives in the order each
    end posts them ("point-to-point calls within a group targeting the same peer ... are executed in order",
    https://docs.nvidia.com/deeplearning/nccl/user-guide/docs/usage/p2p.html): out of that order a send meets another
    receive, and a send whose receive its peer posts only after the next one's waits forever. Across exchanges the
    orders agree already: a pair's send in an earlier exchange received in a later one than the next is an exchange
    waiting forever (`_waits_forever`)."""
    kind, device, transfer = kind[order], device[order], transfer[order]
    sending, receiving = kind_mask(kind, Kind.SEND_F, Kind.SEND_B), kind_mask(kind, Kind.RECV_F, Kind.RECV_B)
    exchange = np.cumsum(exchange_begins(sending | receiving, device)) - 1  # per row, its exchange (a transfer's)
    sends, recvs = np.flatnonzero(sending), np.flatnonzero(receiving)
    if not len(sends):
        return order
    send_at, recv_at = (np.zeros(int(transfer.max()) + 1, dtype=np.int64) for _ in range(2))
    send_at[transfer[sends]], recv_at[transfer[recvs]] = sends, recvs
    peers = int(device.max()) + 1
    placed = order.copy()
    # SENDs by their RECV's exchange, RECVs by their SEND's place (which grows with its exchange); a stable sort of
    # rows ascending keeps the SENDs' order where the RECVs share an exchange too
    for rows, other, key in ((sends, recv_at[transfer[sends]], exchange[recv_at[transfer[sends]]]),
                             (recvs, send_at[transfer[recvs]], send_at[transfer[recvs]])):
        group = exchange[rows].astype(np.int64) * peers + device[other]  # an exchange's rows with one peer
        slots = rows[np.argsort(group, kind="stable")]
        taken = rows[np.lexsort((key, group))]
        placed[slots] = order[taken]
    return placed


def _receive_begins(recvs: np.ndarray, sender: np.ndarray, device: np.ndarray, up_to: np.ndarray,
                    span: int) -> np.ndarray:
    """`exchange_order`'s run without transfer times: per RECV row of `recvs` (ascending, each device's together),
    when it could begin less the time its device held before it (`up_to`: per row, the time its device held up to
    it, every clock under `span`), where a RECV begins once its SEND row of `sender` is issued, at its device's clock
    there: the time held up to it plus the latest such value of its device's RECVs before it (0 at least, its
    device's start). Repeated until it holds, over the RECVs alone: each pass carries the waits one device further
    down a chain of devices each waiting for the one before, and the rows between two RECVs only add their time."""
    recv_device = device[recvs]
    bounds = np.searchsorted(recv_device, np.arange(int(device.max(initial=0)) + 2))
    before = np.searchsorted(recvs, sender) - 1  # the last RECV before the SEND on its device (-1: none)
    before = np.where(before >= bounds[device[sender]], before, -1)
    own = up_to[sender] - up_to[recvs]
    offset = recv_device * span
    value = own
    latest = np.zeros(len(recvs) + 1, dtype=np.int64)  # per RECV, its device's latest up to it; last: none's, 0
    running = latest[:-1]
    for _ in range(len(recvs) + 1):
        np.maximum(value, 0, out=running)
        running += offset
        np.maximum.accumulate(running, out=running)
        running -= offset
        later = own + latest[before]
        if np.array_equal(later, value):
            break
        value = later
    return value


def exchange_begins(exchanging: np.ndarray, device: np.ndarray) -> np.ndarray:
    """Per lowered row (`exchanging`: a SEND or RECV; `device`: each device's rows together), whether it begins an
    exchange of a runtime whose exchanges block (`exchange_order`): a device's run of SENDs and RECVs between two of
    its other rows, which it posts together; the simulator's blocking runtime reads the same (sim/engine.py)."""
    return exchanging & ~np.r_[False, exchanging[:-1] & (device[1:] == device[:-1])]


def _waits_forever(kind: np.ndarray, device: np.ndarray, transfer: np.ndarray) -> bool:
    """Whether lowered rows (`kind`, `device`, `transfer` per row, each device's together) whose exchanges block
    (`exchange_order`) wait for each other forever: a device posts an exchange once its exchange before has ended,
    which is once each of its transfers' other ends has posted, so each exchange's post waits for the device's
    exchange before it and for that one's peers' exchanges; a cycle of such waits never ends."""
    exchanging = kind_mask(kind, Kind.SEND_F, Kind.SEND_B, Kind.RECV_F, Kind.RECV_B)
    rows = np.flatnonzero(exchanging)
    if not len(rows):
        return False
    begins = exchange_begins(exchanging, device)[rows]
    exchange = np.cumsum(begins) - 1  # per transfer row, its exchange
    count = int(exchange[-1]) + 1
    first = np.flatnonzero(begins)
    owner = device[rows][first]
    following = np.append(np.where(owner[1:] == owner[:-1], np.arange(1, count), -1), -1)  # its device's next
    peer = np.zeros(int(transfer.max()) + 1, dtype=np.int64)
    sending = kind_mask(kind[rows], Kind.SEND_F, Kind.SEND_B)
    peer[transfer[rows][sending]] = exchange[sending]
    other = np.where(sending, 0, peer[transfer[rows]])  # a RECV's SEND's exchange; a SEND's RECV's below
    receiver = np.zeros(len(peer), dtype=np.int64)
    receiver[transfer[rows][~sending]] = exchange[~sending]
    other[sending] = receiver[transfer[rows][sending]]
    # Edges: an exchange to its device's next; each transfer's other end's exchange to this end's next.
    sources = np.r_[np.arange(count), other]
    targets = np.r_[following, following[exchange]]
    kept = targets >= 0
    sources, targets = sources[kept], targets[kept]
    by_source = np.argsort(sources, kind="stable")
    bounds = np.searchsorted(sources[by_source], np.arange(count + 1)).tolist()
    out = targets[by_source].tolist()
    waiting = np.bincount(targets, minlength=count).tolist()
    ready = [e for e in range(count) if waiting[e] == 0]
    done = 0
    while ready:
        e = ready.pop()
        done += 1
        for f in out[bounds[e]:bounds[e + 1]]:
            waiting[f] -= 1
            if waiting[f] == 0:
                ready.append(f)
    return done < count
