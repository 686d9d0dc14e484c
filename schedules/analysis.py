"""What a schedule implies without timing: completeness, deadlock freedom and weight versions.

Everything here follows from the per-device order alone, so the simulator and the executor share it.
"""

from __future__ import annotations

from collections import Counter, defaultdict, deque
from dataclasses import dataclass

import numpy as np

from .ir import (
    BACKWARD_KINDS,
    COLLECTIVE_KINDS,
    COMPUTE_KINDS,
    Action,
    Kind,
    Read,
    Schedule,
    ScheduleError,
    evaluate_formula,
    is_pair,
)
from .passes import gathered_passes, reduced_passes
from .table import KIND_CODE, KINDS, NUM_COMPUTE_KINDS, ActionTable, kind_mask

# Dependency keys: (role, stage, microbatch, minibatch, pipeline). "D" is an input gradient, produced by
# B or I; "WALL" is every weight gradient of a (stage, mini-batch, pipeline).
_Key = tuple[str, int, int, int, int]


def validate(schedule: Schedule) -> None:
    """Raise ScheduleError unless every unit of work appears once and the order cannot deadlock."""
    check_complete(schedule)
    stuck = find_deadlock(schedule)
    if stuck:
        detail = "; ".join(
            f"device {d}: {a} can never start (waits for {_describe(k)})" for d, (a, k) in sorted(stuck.items())
        )
        raise ScheduleError(f"{schedule.method}: the order deadlocks: {detail}")


def check_complete(schedule: Schedule, table: ActionTable | None = None) -> None:
    """Each (stage, micro-batch, mini-batch, pipeline) has one F and one backward (B, or I and W), where the stage
    runs the micro-batch (a model copy's stages run its share: `StageGraph.copies`; none elsewhere), and with E > 1
    expert-parallel ranks one A2A_F and one A2A_B, none with E = 1, and likewise with C > 1 context-parallel ranks
    one RING_F and one RING_B; each (stage, mini-batch, pipeline) one OPT, and
    with d > 1 data-parallel replicas one REDUCE, or one per `reduced_passes` row, and with a sharded optimizer
    one GATHER, under ZeRO-3 one per `gathered_passes` row; none with d = 1; every action runs on the device its
    stage is placed on."""
    t = table or schedule.table
    p, m, n, r = schedule.num_stages, schedule.microbatches, schedule.minibatches, schedule.pipelines
    compute = t.kind < NUM_COMPUTE_KINDS
    _check_pairs(schedule, t, compute)
    outside = compute & ~((t.stage >= 0) & (t.stage < p) & (t.microbatch < m) & (t.minibatch >= 0)
                          & (t.minibatch < n) & (t.pipeline >= 0) & (t.pipeline < r))
    if outside.any():
        i = int(np.argmax(outside))
        raise ScheduleError(
            f"{schedule.method}: action {_action(t, i)} on device {t.device[i]} is outside stages 0..{p - 1}, "
            f"micro-batches 0..{m - 1}, mini-batches 0..{n - 1}, pipelines 0..{r - 1}"
        )
    misplaced = compute & (np.asarray(schedule.placement)[np.where(compute, t.stage, 0)] != t.device)
    if misplaced.any():
        i = int(np.argmax(misplaced))
        raise ScheduleError(
            f"{schedule.method}: action {_action(t, i)} is on device {t.device[i]} but stage {t.stage[i]} "
            f"is placed on device {schedule.placement[t.stage[i]]}"
        )
    units, steps = p * m * n * r, p * n * r
    per_unit = t.unit_index(schedule)
    count = {kind: np.bincount(per_unit[t.kind == KIND_CODE[kind]], minlength=units)
             for kind in (Kind.F, Kind.B, Kind.I, Kind.W)}
    step = t.step_index(schedule)
    opt = np.bincount(step[t.kind == KIND_CODE[Kind.OPT]], minlength=steps)
    problems = []
    synchronised = schedule.gradient_ranks > 1
    gathers = (np.bincount(step[gathered_passes(schedule, t)], minlength=steps) if schedule.zero >= 3
               else np.full(steps, int(synchronised and schedule.sharded_optimizer)))
    each = reduced_passes(schedule, t)
    reduces = np.full(steps, int(synchronised)) if each is None else np.bincount(step[each], minlength=steps)
    for kind, wanted in ((Kind.REDUCE, reduces), (Kind.GATHER, gathers)):
        rows = np.bincount(step[t.kind == KIND_CODE[kind]], minlength=steps)
        for u in np.flatnonzero(rows != wanted)[:5]:
            context = schedule.gradient_ranks // schedule.data_parallel
            problems.append(f"{_step_action(schedule, int(u), kind)} appears {rows[u]} times (d = "
                            f"{schedule.data_parallel}{f', C = {context}' if context > 1 else ''}"
                            f"{f', ZeRO-{schedule.zero}' if schedule.zero else ''}: {wanted[u]} per update)")
    for kind, counts in count.items():
        for u in np.flatnonzero(counts > 1)[:5]:
            problems.append(f"{_unit_action(schedule, kind, int(u))} appears {counts[u]} times")
    for u in np.flatnonzero(opt > 1)[:5]:
        problems.append(f"{_step_action(schedule, int(u))} appears {opt[u]} times")
    runs = _runs(schedule)
    for u in np.flatnonzero(runs & (count[Kind.F] == 0))[:5]:
        problems.append(f"{_unit_action(schedule, Kind.F, int(u))} missing")
    full, split = count[Kind.B], count[Kind.I] + count[Kind.W]
    backward_ok = np.where(runs, ((full == 1) & (split == 0)) | ((full == 0) & (count[Kind.I] == 1)
                                                                 & (count[Kind.W] == 1)), full + split == 0)
    for u in np.flatnonzero(~runs & (count[Kind.F] > 0))[:5]:
        problems.append(f"{_unit_action(schedule, Kind.F, int(u))}: its micro-batch is another model copy's")
    for u in np.flatnonzero(~backward_ok)[:5]:
        problems.append(f"{_unit_action(schedule, Kind.B, int(u))}: needs one B, or one I and one W")
    for u in np.flatnonzero(opt == 0)[:5]:
        problems.append(f"{_step_action(schedule, int(u))} missing")
    # an all-to-all (a ring) after each forward and each backward that sends back, with E > 1 (C > 1)
    for kind, passes, degree in ((Kind.A2A_F, count[Kind.F], ("E", schedule.expert_parallel)),
                                 (Kind.A2A_B, full + count[Kind.I], ("E", schedule.expert_parallel)),
                                 (Kind.RING_F, count[Kind.F], ("C", schedule.context_parallel)),
                                 (Kind.RING_B, full + count[Kind.I], ("C", schedule.context_parallel))):
        wanted = int(degree[1] > 1)
        rows = np.bincount(per_unit[t.kind == KIND_CODE[kind]], minlength=units)
        each = "forward" if kind in (Kind.A2A_F, Kind.RING_F) else "backward"
        for u in np.flatnonzero(rows != passes * wanted)[:5]:
            problems.append(f"{_unit_action(schedule, kind, int(u))} appears {rows[u]} times ({degree[0]} = "
                            f"{degree[1]}: {wanted} per {each})")
    if problems:
        shown = "; ".join(problems[:5]) + (" ..." if len(problems) > 5 else "")
        raise ScheduleError(f"{schedule.method}: incomplete schedule: {shown}")


def _runs(schedule: Schedule) -> np.ndarray:
    """Per unit (`ActionTable.unit_index`), whether its stage runs its micro-batch: always, but where the stages
    are several model copies, each running its own share of the micro-batches (`StageGraph.copies`)."""
    m, per_stage = schedule.microbatches, schedule.microbatches * schedule.minibatches * schedule.pipelines
    unit = np.arange(schedule.num_stages * per_stage)
    return schedule.graph.copy_of(unit // per_stage) == schedule.copy_of_microbatch(unit // (per_stage // m) % m)


def overlapped_pairs(schedule: Schedule) -> int:
    """How many overlapped pairs (F&B) the schedule runs, over every device and mini-batch."""
    t = schedule.table
    return int(np.count_nonzero((t.kind == KIND_CODE[Kind.F]) & (t.peer >= 0)))


def rows_of(schedule: Schedule, kind: Kind) -> int:
    """How many rows of `kind` the schedule runs (W: a split backward's second part; PRED, AVG: a weight policy's)."""
    return int(np.count_nonzero(schedule.table.kind == KIND_CODE[kind]))


def _check_pairs(schedule: Schedule, t: ActionTable, compute: np.ndarray) -> None:
    """Each part of an overlapped pair (a compute row naming a peer) sits next to its other part on its device,
    the forward first, as `ir.overlapped` makes them."""
    tagged = compute & (t.peer >= 0)
    if not tagged.any():
        return
    forward = np.flatnonzero(tagged & (t.kind == KIND_CODE[Kind.F]))
    forward = forward[forward + 1 < len(t.kind)]
    after = forward + 1  # as `ir.is_pair` says, over every pair at once
    good = forward[(t.kind[after] == KIND_CODE[Kind.B]) & (t.device[after] == t.device[forward])
                   & (t.peer[forward] == t.stage[after]) & (t.peer[after] == t.stage[forward])
                   & (t.minibatch[after] == t.minibatch[forward]) & (t.pipeline[after] == t.pipeline[forward])]
    paired = np.zeros(len(t.kind), dtype=bool)
    paired[good] = paired[good + 1] = True
    stray = np.flatnonzero(tagged & ~paired)
    if len(stray):
        i = int(stray[0])
        raise ScheduleError(f"{schedule.method}: action {_action(t, i)} on device {t.device[i]} names a peer, so it is "
                            "part of an overlapped pair, but its other part is not next to it: a pair is an F then a "
                            "B of one mini-batch, each naming the other's stage, written (F;B)OVERLAP_F_B")


def _action(t: ActionTable, i: int) -> Action:
    return Action(KINDS[t.kind[i]], int(t.stage[i]), int(t.microbatch[i]), int(t.minibatch[i]),
                  int(t.pipeline[i]), int(t.peer[i]))


def _unit_action(schedule: Schedule, kind: Kind, u: int) -> Action:
    rest, q = divmod(u, schedule.pipelines)
    rest, b = divmod(rest, schedule.minibatches)
    s, j = divmod(rest, schedule.microbatches)
    return Action(kind, s, j, b, q)


def _step_action(schedule: Schedule, u: int, kind: Kind = Kind.OPT) -> Action:
    rest, q = divmod(u, schedule.pipelines)
    s, b = divmod(rest, schedule.minibatches)
    return Action(kind, s, -1, b, q)


def local_order_ok(schedule: Schedule, table: ActionTable | None = None) -> bool:
    """Whether every input an action takes from its own device comes earlier in that device's order.

    With this, a runtime that exchanges cross-device data through SEND/RECV either finishes or stalls on
    a RECV; so the simulator checks only this up front (vectorised) and explains a stall with
    `find_deadlock`. Assumes `check_complete` passed.
    """
    t = table or schedule.table
    units = schedule.num_stages * schedule.microbatches * schedule.minibatches * schedule.pipelines
    per_unit = t.unit_index(schedule)
    rows = np.arange(len(t.kind))

    def position(*kinds: Kind) -> np.ndarray:
        where = np.full(units, -1, dtype=np.int64)
        mask = kind_mask(t.kind, *kinds)
        where[per_unit[mask]] = rows[mask]
        return where

    forward, dgrad = position(Kind.F), position(Kind.B, Kind.I)
    if kind_mask(t.kind, Kind.I, Kind.W).any():  # a split backward
        wgrad, split = position(Kind.B, Kind.W), position(Kind.W) >= 0
    else:  # the full backward is both
        wgrad, split = dgrad, np.zeros(units, dtype=bool)
    if np.any(dgrad < forward) or np.any(split & (wgrad < dgrad)):
        return False
    stride = units // schedule.num_stages  # units per stage
    for src, dst in schedule.graph.edges:
        if schedule.placement[src] == schedule.placement[dst]:
            a, b = slice(src * stride, (src + 1) * stride), slice(dst * stride, (dst + 1) * stride)
            if np.any(forward[b] < forward[a]) or np.any(dgrad[a] < dgrad[b]):
                return False
    steps = schedule.num_stages * schedule.minibatches * schedule.pipelines
    last_wgrad = np.full(steps, -1, dtype=np.int64)
    m, n, r = schedule.microbatches, schedule.minibatches, schedule.pipelines
    rest, pipeline = np.divmod(np.arange(units), r)
    rest, minibatch = np.divmod(rest, n)
    step_of_unit = ((rest // m) * n + minibatch) * r + pipeline
    np.maximum.at(last_wgrad, step_of_unit, wgrad)
    step = t.step_index(schedule)
    opt = t.kind == KIND_CODE[Kind.OPT]
    update_row = np.zeros(steps, dtype=np.int64)
    update_row[step[opt]] = rows[opt]
    reduce, gather = t.kind == KIND_CODE[Kind.REDUCE], t.kind == KIND_CODE[Kind.GATHER]
    # A REDUCE comes after its step's gradients (a backward's own after that backward) and before its update;
    # a GATHER after its update (ZeRO-3's gather the weights their pass reads, whichever update precedes them on
    # the device: `Lowered.awaits` ties them).
    gathered = schedule.zero >= 3 or np.all(rows[gather] > update_row[step[gather]])
    own = reduce & (t.microbatch >= 0)
    reduce_after = np.where(own, wgrad[np.where(own, per_unit, 0)], last_wgrad[step])[reduce]
    return bool(np.all(rows[opt] > last_wgrad[step[opt]]) and np.all(rows[reduce] > reduce_after)
                and np.all(rows[reduce] < update_row[step[reduce]]) and gathered)


def _requires(a: Action, schedule: Schedule) -> list[_Key]:
    """What must have finished (anywhere) before `a` can start."""
    graph = schedule.graph
    s, j, b, q = a.stage, a.microbatch, a.minibatch, a.pipeline
    kind = a.kind
    if kind is Kind.F:
        return [("F", u, j, b, q) for u in graph.preds[s]]
    if kind is Kind.B or kind is Kind.I:
        return [("F", s, j, b, q)] + [("D", t, j, b, q) for t in graph.succs[s]]
    if kind is Kind.W:
        return [("D", s, j, b, q)]
    if kind is Kind.OPT:
        return [("WALL", s, -1, b, q)] + ([("REDUCE", s, -1, b, q)] if schedule.gradient_ranks > 1 else [])
    if kind is Kind.REDUCE:  # a backward's own (`passes.reduced_passes`) follows it on its device
        return [] if j >= 0 else [("WALL", s, -1, b, q)]
    if kind is Kind.GATHER:  # the updated weights (ZeRO-3's: those its pass reads, by the device's own order)
        return [] if schedule.zero >= 3 else [("OPT", s, -1, b, q)]
    if kind is Kind.AVG:
        return [("OPT", s, -1, b, other) for other in range(schedule.pipelines)]
    return []


def _describe(key: _Key) -> str:
    role, s, j, b, q = key
    kind = {"F": Kind.F, "D": Kind.B, "OPT": Kind.OPT, "REDUCE": Kind.REDUCE}.get(role)
    if kind is None:
        return f"every weight gradient of stage {s}, mini-batch {b}"
    text = str(Action(kind, s, j, b, q))
    return text.replace("B", "B/I", 1) if role == "D" else text


def find_deadlock(schedule: Schedule) -> dict[int, tuple[Action, _Key]]:
    """Dry-run every device in order; return, per device that cannot finish, its first action that can
    never start and what it waits for. Empty when the order completes."""
    m = schedule.microbatches // schedule.graph.copies  # the micro-batches each stage runs
    done: set[_Key] = set()
    wgrads: Counter[tuple[int, int, int]] = Counter()
    waiting: dict[_Key, list[int]] = defaultdict(list)
    pointer = [0] * schedule.num_devices
    blocked_on: dict[int, _Key] = {}
    ready = deque(range(schedule.num_devices))

    def finish(key: _Key) -> None:
        done.add(key)
        ready.extend(waiting.pop(key, ()))

    while ready:
        device = ready.popleft()
        order = schedule.orders[device]
        i = pointer[device]
        while i < len(order):
            a = order[i]
            group = order[i:i + 2] if i + 1 < len(order) and is_pair(a, order[i + 1]) else (a,)
            if a.kind in COMPUTE_KINDS:  # an overlapped pair starts once both its parts can
                missing = next((k for x in group for k in _requires(x, schedule) if k not in done), None)
                if missing is not None:
                    waiting[missing].append(device)
                    blocked_on[device] = missing
                    break
                for x in group:
                    s, j, b, q = x.stage, x.microbatch, x.minibatch, x.pipeline
                    kind = x.kind
                    if kind is Kind.F:
                        finish(("F", s, j, b, q))
                    if kind is Kind.B or kind is Kind.I:
                        finish(("D", s, j, b, q))
                    if kind is Kind.B or kind is Kind.W:
                        wgrads[(s, b, q)] += 1
                        if wgrads[(s, b, q)] == m:
                            finish(("WALL", s, -1, b, q))
                    if kind is Kind.OPT or kind is Kind.REDUCE:
                        finish((kind.value, s, -1, b, q))
            i += len(group)
        pointer[device] = i
    return {
        d: (schedule.orders[d][pointer[d]], blocked_on[d])
        for d in range(schedule.num_devices)
        if pointer[d] < len(schedule.orders[d])
    }


@dataclass(frozen=True)
class Versions:
    """Per action, aligned with the schedule's action table (rows in device order).

    read: weight version the action computes with (-1 for OPT, REDUCE and GATHER); prediction: the distance s its
    weights are predicted over, -1 when they are not; copies_delta: change, at the action's end, in the number of
    versions of its stage's weights held; held_after: largest number of weight copies of one stage the
    device holds after the action (versions in use plus the policy's extra copies).
    """

    read: np.ndarray
    prediction: np.ndarray
    copies_delta: np.ndarray
    held_after: np.ndarray


def flushes(schedule: Schedule) -> bool:
    """Whether every device finishes each mini-batch before it starts the next (needs N >= 2 to tell)."""
    t = schedule.table
    back = np.flatnonzero(t.minibatch[1:] < t.minibatch[:-1])  # rows whose next row is of an earlier mini-batch
    return bool(np.all(t.device[back + 1] != t.device[back]))  # each the last of its device's


def steady_minibatches(schedule: Schedule) -> int:
    """The mini-batches a run needs before its time per mini-batch and its staleness are the steady state's: a
    flushing schedule repeats its step from the second on; one that never flushes is past its warm-up once a
    pipeline of p·v stages, holding at most p·v micro-batches, has turned over twice. `schedule` is built with
    any N >= 2 (the order's shape, not N, decides)."""
    return warmup_minibatches(flushes(schedule), schedule.num_stages, schedule.microbatches)


def warmup_minibatches(flushing: bool, stages: int, microbatches: int) -> int:
    """`steady_minibatches` from what decides it: whether the order flushes, its model stages and m."""
    if flushing:
        return 2
    return 2 * -(-stages // microbatches) + 2


def resting_copies(schedule: Schedule) -> int:
    """The weight copies of one stage a device holds when no older version lingers: each pipeline's replica
    of it (AvgPipe's P) plus the policy's extra copies (a prediction buffer, AvgPipe's reference model)."""
    return schedule.pipelines + schedule.policy.extra_copies


def weight_versions(schedule: Schedule) -> Versions:
    """Compute the version every action reads, and the weight copies each device must hold, from the order.

    A stage's version counts its OPT actions (per pipeline replica). A version stays held, besides the
    current one, from the update that supersedes it until the last action that reads it. The copies of one
    stage count every pipeline's replica of it.
    """
    read, prediction, copies_delta = _version_reads(schedule)
    t, n = schedule.table, len(read)
    held_after = np.full(n, resting_copies(schedule), dtype=np.int64)
    lingering = copies_delta != 0
    for d in np.unique(t.device[lingering]) if lingering.any() else ():  # (np.unique imports numpy.ma: 10 ms)
        lo, hi = np.searchsorted(t.device, [d, d + 1])
        stage, delta = t.stage[lo:hi], copies_delta[lo:hi]
        if np.all(stage == stage[0]):  # the device's one stage (PipeDream's orders)
            held_after[lo:hi] += np.cumsum(delta)
        else:
            held_after[lo:hi] += np.max([np.cumsum(np.where(stage == s, delta, 0)) for s in np.unique(stage)], axis=0)
    return Versions(read, prediction, copies_delta, held_after)


def version_reads(schedule: Schedule) -> tuple[np.ndarray, np.ndarray]:
    """`weight_versions`' `read` and `copies_delta` alone, without the copies each device holds after each action:
    what tune reads off hundreds of orders (planning/tune.py `_held`) and a stage's memory of every range of layers
    (planning/scenario.py `Scenario.stage_memory`)."""
    read, _, copies_delta = _version_reads(schedule)
    return read, copies_delta


def _version_reads(schedule: Schedule) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """`weight_versions`' read, prediction and copies_delta."""
    t, policy = schedule.table, schedule.policy
    n = len(t.kind)
    rows = np.arange(n)
    p, m, r = schedule.num_stages, schedule.microbatches, schedule.pipelines
    replica = np.where(t.kind < NUM_COMPUTE_KINDS, t.stage * r + t.pipeline, 0)
    is_opt = t.kind == KIND_CODE[Kind.OPT]
    is_f = t.kind == KIND_CODE[Kind.F]
    backward = kind_mask(t.kind, *BACKWARD_KINDS)

    # current[i]: updates of row i's replica earlier in its device's order (a stage lives on one device): the
    # updates before it, less those before its replica's first row, counted in rows sorted by replica (a
    # stable sort; none where every device runs one replica, as most orders do).
    by_replica = np.argsort(replica, kind="stable") if np.any(replica[1:] < replica[:-1]) else None
    opt_sorted = is_opt if by_replica is None else is_opt[by_replica]
    before = np.cumsum(opt_sorted) - opt_sorted
    sorted_replica = replica if by_replica is None else replica[by_replica]
    group_start = np.flatnonzero(np.r_[True, sorted_replica[1:] != sorted_replica[:-1]]) if n else rows
    counted = before - np.repeat(before[group_start], np.diff(np.r_[group_start, n]))
    if by_replica is None:
        current = counted
    else:
        current = np.empty(n, dtype=np.int64)
        current[by_replica] = counted
    if policy.forward is Read.STASHED:
        raise ScheduleError("a forward cannot read a stashed version: it is what stashes one")
    # Per unit, what its forward and its first backward read, where a rule looks that up (none reads the latest).
    looked_up = bool({policy.forward, policy.backward} & {Read.STASHED, Read.BELLWETHER})
    unit = first_forward = forward_read = backward_read = None
    if looked_up:
        unit = t.unit_index(schedule)
        first_forward = unit - t.microbatch * schedule.minibatches * r  # micro-batch 0 of the row's mini-batch
        opens_backward = kind_mask(t.kind, Kind.B, Kind.I)
        forward_read, backward_read = (np.zeros(p * m * schedule.minibatches * r, dtype=np.int64) for _ in range(2))
        forward_read[unit[is_f]] = current[is_f]
        backward_read[unit[opens_backward]] = current[opens_backward]

    def read_rule(rule: Read, mask: np.ndarray, first_read: np.ndarray | None) -> np.ndarray:
        """Versions `mask`'s rows read; `first_read` holds, per unit, what its first op of this side read."""
        if rule is Read.LATEST:
            return current
        if rule is Read.STASHED:
            return forward_read[np.where(mask, unit, 0)]
        if rule is Read.BELLWETHER:
            return first_read[np.where(mask, first_forward, 0)]
        wanted = np.maximum(t.minibatch - 1, 0)  # Read.PREVIOUS
        early = mask & (wanted > current)
        if early.any():
            i = int(np.argmax(early))
            raise ScheduleError(f"{schedule.method}: {_action(t, i)} reads version {wanted[i]} of its stage "
                                f"before that version exists (after {current[i]} updates)")
        return wanted

    forward_version = read_rule(policy.forward, is_f, forward_read)
    if looked_up and policy.forward is not Read.LATEST:  # what each forward read, where not what was just stored
        forward_read[unit[is_f]] = forward_version[is_f]
    backward_version = read_rule(policy.backward, backward, backward_read)
    read = current  # what every op reads that reads the latest; F's and the backward's by their rules
    for side, version in ((is_f, forward_version), (backward, backward_version)):
        if version is not current:
            read = np.where(side, version, read)
    read = np.where(is_opt | kind_mask(t.kind, *COLLECTIVE_KINDS) | (t.kind >= NUM_COMPUTE_KINDS), -1, read)

    prediction = np.full(n, -1, dtype=np.int64)
    consuming = None  # per step, the ordinal of the update that consumes its gradient: what a counted one reads
    for rule, mask in ((policy.predict_forward, is_f), (policy.predict_backward, backward)):
        if rule is not None:
            formula = policy.formula(rule)  # the closed form of the source in use; None: counted
            if formula is None:
                step = t.step_index(schedule)
                if consuming is None:
                    consuming = np.full(p * schedule.minibatches * r, -1, dtype=np.int64)
                    consuming[step[is_opt]] = current[is_opt]
                prediction[mask] = consuming[step[mask]] - read[mask]
            else:
                per_stage = np.array([evaluate_formula(formula, p, k, m) for k in range(p)], dtype=np.int64)
                prediction = np.where(mask, per_stage.take(t.stage), prediction)

    # Version v of a replica is held beside the current one from the update that supersedes it (the
    # update with ordinal v) until its last read. Ops on predicted weights read the prediction buffer
    # (one of the policy's extra copies), not v itself. An op that reads the latest version reads it before
    # the update that supersedes it, so where every op does, none is held beside the current one.
    if policy.forward is Read.LATEST and policy.backward is Read.LATEST:
        return read, prediction, np.zeros(n, dtype=np.int64)
    versions = int(current.max()) + 2 if n else 1
    reads = (read >= 0) & (prediction < 0)
    last_read = np.full(p * r * versions, -1, dtype=np.int64)
    np.maximum.at(last_read, replica[reads] * versions + read[reads], rows[reads])
    superseded = np.full(p * r * versions, n, dtype=np.int64)
    superseded[replica[is_opt] * versions + current[is_opt]] = rows[is_opt]
    lingers = np.flatnonzero(last_read > superseded)
    copies_delta = np.zeros(n, dtype=np.int64)
    np.add.at(copies_delta, superseded[lingers], 1)
    np.add.at(copies_delta, last_read[lingers], -1)
    return read, prediction, copies_delta


def peak_per_stage(t: ActionTable, at_start: np.ndarray, at_end: np.ndarray, num_stages: int) -> np.ndarray:
    """Per stage, the peak of a running count changed at its actions' starts and ends, in program order (a
    stage lives on one device, so a stable sort by stage keeps that order), and 0 where it never rises. Each
    stage's highest point is after some action's start or end: one running sum, a maximum over each stage's
    run of rows (tune reads it off hundreds of orders of up to a million rows each)."""
    peak = np.zeros(num_stages, dtype=np.int64)
    if not (at_start.any() or at_end.any()):
        return peak
    stage = t.stage
    if np.any(stage[1:] < stage[:-1]):  # else already by stage: one stage a device, or its stages in turn
        order = np.argsort(stage, kind="stable")
        stage, at_start, at_end = stage[order], at_start[order], at_end[order]
    after_end = np.cumsum(at_start + at_end)
    highest = np.maximum(after_end - at_end, after_end)
    first = np.searchsorted(stage, np.arange(num_stages + 1))
    held = first[:-1] < first[1:]  # the stages with rows
    starts = first[:-1][held]
    before = np.concatenate([[0], after_end])[starts]
    peak[held] = np.maximum(np.maximum.reduceat(highest, starts) - before, 0)
    return peak
