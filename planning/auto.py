"""`auto`: the synchronous schedule searched from a scenario's costs, under a limit on activation memory.

As the zero-bubble paper's automatic scheduler does (Qi et al., ICLR 2024, section 4): a greedy list scheduler
runs the simulator's event model (a device runs one op at a time; an F waits for the previous stage's F and the
transfer, an I for the next stage's I and the transfer back; W only for its own I) and decides on every device,
whenever it is free, what to run next: a ready I first (it is on the critical path), else a ready F if the
device's memory allows it, else a deferred W to fill the gap. Its knobs (how many micro-batches a stage may
hold in flight, whether W's fill every gap or wait for the end of the mini-batch) are tried in turn, beside the
fixed orders (1F1B, ZB-H1, ZB-H2, GPipe) that fit the same memory, and every candidate is timed as a repeated
step: mini-batches following each other, each device starting the next one after its own update. Past what the
knobs reach, up to 4 stages every in-order pattern is timed where the budget affords them all (then none is
faster), else patterns one op move away from the best are, for the rest of the budget. The one with the
shortest steady-state time per mini-batch wins (ties: the faster cold first mini-batch, then the first tried),
so the same inputs give the same schedule. Where a device's memory could bind, it also holds what the device
has received and not yet taken in, as the simulator does: the list scheduler counts it before an F on the device
and on the next one, and every candidate is held to it, timed (`within_room`).

The result is an ordinary Schedule: per mini-batch each device runs its pattern, then its stage's OPT.
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from collections.abc import Callable, Generator, Iterator, Sequence
from dataclasses import dataclass, replace
from functools import lru_cache
from itertools import accumulate
from operator import itemgetter

import numpy as np

from ..schedules import KIND_CODE, Kind, Schedule, ScheduleError, ScheduleParams, make_schedule
from ..schedules.catalogue import METHODS
from ..schedules.table import stacked
from ..sim import Cluster, Costs
from ..sim.engine import static_bytes
from ..units import MIB

METHOD = "auto"
_F, _I, _W, _B = range(4)  # op codes of a pattern
_KIND = (Kind.F, Kind.I, Kind.W, Kind.B)
_STEADY = 2  # mini-batches timed: the second shows the steady state of a flushing order (`steady_minibatches`)
_FIXED = ("1f1b", "zb-h1", "zb-h2", "gpipe")  # fixed orders the search starts from, where they fit
# The list scheduler's variants, most often best first: (micro-batches a stage may hold between F and I, as a
# multiple of 1F1B's p - k; W's it keeps for the end of the mini-batch, as a multiple of what fills its wait there;
# whether no F may delay a stage's first I; how many fewer micro-batches the stages after the first hold).
_GRID = ((2.0, 1.0, True, 0), (2.0, 1.0, False, 0), (2.0, 1.0, False, 1), (1.0, 0.5, False, 0),
         (2.0, 1.0, True, 1), (math.inf, 1.0, True, 0), (2.0, 0.0, True, 0), (1.5, 0.5, False, 0),
         (1.5, 1.0, False, 0), (2.0, 0.5, False, 0), (1.0, 0.0, False, 0), (2.0, 0.0, False, 0),
         (math.inf, 0.0, True, 0), (1.5, 0.0, True, 0), (1.0, 1.0, False, 0), (3.0, 1.0, False, 0),
         (math.inf, math.inf, False, 0))
DEFAULT_SECONDS = 0.3  # search budget unless --search-seconds says otherwise
DEFAULT_LIMIT = 1.0  # R unless --activation-limit says otherwise: 1F1B's peak activation memory
_EXACT_STAGES = 4  # up to this many stages, every in-order pattern is timed where the budget affords it
_REPORTED_DEPTH = 2  # that walk reports its progress after each order of its first this many devices
# The budget's unit: ops scheduled or timed per budgeted second, fixed so that a budget gives the same schedule on any
# machine. It was the CPU's rate when set (1.0 to 1.4 million); the search has grown faster since, and takes about a
# fifth of its budget's seconds (4.5 to 4.8 million a CPU second measured here in session 66, p = 6 and 8)
_OPS_PER_SECOND = 1_000_000



class ActivationLimitError(ScheduleError):
    """--activation-limit leaves a device less than one micro-batch's activations: a flag's value to change."""


Pattern = tuple[tuple[tuple[int, int], ...], ...]  # per device: one mini-batch's (op code, micro-batch), in order


@dataclass(frozen=True)
class StageTimes:
    """What the search reads, for a chain of p stages, stage k on device k: `op_ms[k]` the ms of F, I, W and B
    of one micro-batch (the runtime's own cost per row included), `opt_ms[k]` its update; `send_ms[k]` the
    activation's transfer from stage k to k + 1 and `grad_ms[k]` its gradient's back; `held_bytes[k]` what a
    micro-batch holds from its F until its I (or B), `kept_bytes[k]` what it still holds from its I until its W;
    `limit_bytes[k]` the most device k may hold at once. Where its memory is known (`room_bytes[k]`, () where no
    device's is), what it holds beside its weights, state and the one boundary tensor of each kind `_buffer_bytes`
    counts: the activations and the boundary tensors beyond those (`within_room`), each of `boundary_bytes[k]` at
    the boundary of stages k and k + 1; `takes_input[k]` whether stage k's forward takes its received input in as
    an activation from its start (its held bytes are known) rather than free it at its end."""

    op_ms: tuple[tuple[float, float, float, float], ...]
    opt_ms: tuple[float, ...]
    send_ms: tuple[float, ...]
    grad_ms: tuple[float, ...]
    held_bytes: tuple[float, ...]
    kept_bytes: tuple[float, ...]
    limit_bytes: tuple[float, ...]
    microbatches: int
    boundary_bytes: tuple[float, ...] = ()
    room_bytes: tuple[float, ...] = ()
    takes_input: tuple[bool, ...] = ()

    @property
    def stages(self) -> int:
        return len(self.opt_ms)

    @property
    def boundary_sizes(self) -> tuple[float, ...]:
        """`boundary_bytes` with none past either end: [k] what stage k receives from above, [k + 1] from below."""
        return (0.0, *self.boundary_bytes, 0.0) if self.boundary_bytes else (0.0,) * (self.stages + 1)


def search_schedule(params: ScheduleParams, costs: Costs, links: Cluster, memory_bytes: Sequence[int | None] = (),
                    progress: Callable[[float], None] | None = None) -> Schedule:
    """The `auto` schedule for `params` (p stages, one per device, m micro-batches, N mini-batches; its
    activation limit R and search budget) on `costs` and `links`, each device's activations capped by
    R × 1F1B's peak (`one_f_one_b_peak`) and, where `memory_bytes` knows a device's memory, by what fits beside its
    weights, gradients, optimizer state and transfer buffers. `progress`, if given, is told the share of the
    search's budget spent as it goes (a progress bar). Raises ActivationLimitError when R leaves a device less
    than one micro-batch, ScheduleError when its memory does. The schedule records the R and budget it was
    searched with, defaults included, so that a trace says what ran."""
    check_shape(params)
    frame = schedule_frame(params)
    times = stage_times(params, costs, links, memory_bytes, static_bytes(frame, costs))
    budget = params.search_seconds if params.search_seconds is not None else DEFAULT_SECONDS
    pattern = best_pattern(times, budget, progress)
    limit = params.activation_limit if params.activation_limit is not None else DEFAULT_LIMIT
    return _schedule(replace(params, activation_limit=limit, search_seconds=budget), _merge_backward(pattern, times))


def check_shape(params: ScheduleParams) -> None:
    """ScheduleError for a shape the search cannot take, known before any cost is (`tune` skips it unsearched)."""
    if params.chunks != 1 or params.pipelines != 1:
        raise ScheduleError(f"{METHOD} places one model stage per device in one pipeline: chunks and pipelines "
                            f"must be 1 (got {params.chunks} and {params.pipelines})")


def schedule_frame(params: ScheduleParams) -> Schedule:
    """The shape of an `auto` schedule before its order is known (a chain, stage k on device k, no actions):
    what its costs, links and memory are looked up for."""
    return make_schedule(METHOD, params, [() for _ in range(params.stages)])


def stage_times(params: ScheduleParams, costs: Costs, links: Cluster, memory_bytes: Sequence[int | None],
                static: Sequence[int]) -> StageTimes:
    """The search's view of the costs; the activation limit in bytes per device (in micro-batches when no stage
    saves activations): R × 1F1B's peak, or less where the device's memory is known to hold less.
    ActivationLimitError when R leaves a device less than one micro-batch's activations (naming the least R
    that does not), ScheduleError when its memory does."""
    p, m = params.stages, params.microbatches
    ops = costs.op_ms_table(1)
    host = costs.overhead.host_ms + np.pad(np.asarray(costs.overhead.compute_ms), (0, len(KIND_CODE) - len(
        costs.overhead.compute_ms)))

    def row_ms(kind: Kind) -> np.ndarray:
        return ops[:, KIND_CODE[kind]] + host[KIND_CODE[kind]]

    first, last = np.arange(p) == 0, np.arange(p) == p - 1
    sends_f, recvs_f = np.where(last, 0.0, host[KIND_CODE[Kind.SEND_F]]), np.where(first, 0.0, host[KIND_CODE[
        Kind.RECV_F]])
    sends_b, recvs_b = np.where(first, 0.0, host[KIND_CODE[Kind.SEND_B]]), np.where(last, 0.0, host[KIND_CODE[
        Kind.RECV_B]])
    op_ms = np.stack([row_ms(Kind.F) + sends_f + recvs_f, row_ms(Kind.I) + sends_b + recvs_b, row_ms(Kind.W),
                      row_ms(Kind.B) + sends_b + recvs_b], axis=1)
    out = [c.output_bytes for c in costs.stages]
    send_ms = tuple(links.link(k, k + 1).transfer_ms(out[k]) for k in range(p - 1))
    grad_ms = tuple(links.link(k + 1, k).transfer_ms(out[k]) for k in range(p - 1))
    held = np.array([c.activation_bytes + (c.held_bytes or 0) for c in costs.stages], dtype=float)
    kept = np.add(*costs.wgrad_held_bytes(), dtype=float)  # from I until W, as the simulator holds it
    unit = "bytes"
    if not held.any():  # no sizes given: count micro-batches
        held, kept, unit = np.ones(p), np.full(p, costs.wgrad_activation_fraction), "micro-batches"
    limit_r = params.activation_limit if params.activation_limit is not None else DEFAULT_LIMIT
    reference = one_f_one_b_peak(held.tolist(), m)
    limit = np.full(p, limit_r * reference)  # a Python float: R up to 1e308 saturates to inf, silently
    room = np.full(p, math.inf)
    for d, memory in enumerate(memory_bytes[:p]):
        if memory is not None and unit == "bytes":
            room[d] = memory - static[d] - _buffer_bytes(costs, d)
            limit[d] = min(limit[d], room[d])

    def amount(value: float) -> str:
        return f"{value / MIB:,.1f} MiB" if unit == "bytes" else f"{value:g} micro-batch{'' if value == 1 else 'es'}"

    short = np.flatnonzero(limit < held - 1e-9)
    by_memory = [int(d) for d in short if limit[d] < limit_r * reference]  # the device's memory binds: no R helps
    if by_memory:
        d = by_memory[0]
        raise ScheduleError(f"{METHOD}: device {d}'s memory leaves {amount(max(limit[d], 0.0))} for activations "
                            "beside its weights, gradients, optimizer state and transfer buffers, less than one "
                            f"micro-batch's {amount(held[d])}: no --activation-limit helps; it needs more device "
                            "memory or the model cut into more stages")
    if len(short):  # R binds: the least R that admits every device is the fullest short one's
        d = int(short[np.argmax(held[short])])
        raise ActivationLimitError(f"--activation-limit: R = {limit_r:g} lets a device hold {amount(limit[d])} of "
                                   f"activations (R = 1: {amount(reference)}, 1F1B's peak), less than one micro-batch "
                                   f"of device {d}'s ({amount(held[d])}); R must be at least "
                                   f"{least_limit(held[d], reference)}")
    opt = ops[:, KIND_CODE[Kind.OPT]] + host[KIND_CODE[Kind.OPT]]
    known = np.isfinite(room).any()
    return StageTimes(tuple(map(tuple, op_ms.tolist())), tuple(opt.tolist()), send_ms, grad_ms,
                      tuple(held.tolist()), tuple(kept.tolist()), tuple(limit.tolist()), m,
                      tuple(map(float, out[:-1])) if known else (), tuple(room.tolist()) if known else (),
                      tuple(c.held_bytes is not None for c in costs.stages) if known else ())


def one_f_one_b_peak(held: Sequence[float], microbatches: int) -> float:
    """What R = 1 stands for: the most activation memory a device of 1F1B holds at once, on its fullest device
    (stage k holds min(p - k, m) micro-batches from their F until their B), so that R = 1 always admits 1F1B's
    own order, whichever stage saves the most."""
    p = len(held)
    return max(min(p - k, microbatches) * held[k] for k in range(p))


def least_limit(needed: float, reference: float) -> str:
    """The smallest R, as printed (three significant digits), that gives a device `needed` of `reference`'s:
    rounded up, so that the value suggested is one that works."""
    shown = float(f"{needed / reference:.3g}")
    while shown * reference < needed - 1e-9:  # `stage_times`'s own test, on the value as the user will give it
        shown = float(f"{shown + 10.0 ** (math.floor(math.log10(shown)) - 2):.3g}")
    return f"{shown:g}"


def _buffer_bytes(costs: Costs, k: int) -> float:
    """What stage k's device may hold besides its weights, gradients, optimizer state and saved activations, at
    most: an activation and a gradient in transfer at each of its boundaries, the receives the runtime posts ahead
    (`recv_window`, each holding a boundary tensor), the gradient copies an update leaves held and the transient
    tensors of the pass running (its largest pass's, `StageCosts.transient_bytes`)."""
    boundary = [costs.stages[j].output_bytes for j in (k - 1, k) if 0 <= j < len(costs.stages) - 1]
    return (2 * sum(boundary) + costs.recv_window * max(boundary, default=0)
            + costs.kept_gradients * costs.stages[k].gradient_bytes
            + max(costs.stages[k].transient_bytes.values(), default=0))


_SEARCHED: dict[tuple[StageTimes, float], Pattern] = {}  # the last few searches' results, by their inputs


def best_pattern(times: StageTimes, budget_seconds: float = DEFAULT_SECONDS,
                 progress: Callable[[float], None] | None = None) -> Pattern:
    """The candidate with the shortest steady-state time per mini-batch (then the shortest first mini-batch,
    then the first tried): the fixed orders that fit (always timed), then the list scheduler's variants in
    `_GRID` order, then a local search over its per-stage knobs, then every in-order pattern (up to
    `_EXACT_STAGES` stages, where the budget affords them all) or a search over one-op moves, for as long as the
    budget lasts. The budget is counted in ops scheduled and timed at a rate fixed in `_OPS_PER_SECOND`, not on
    the clock, so the same inputs give the same schedule on any machine, loaded or not; the fixed orders and the
    first variant are always tried (the constructive pass), the budget bounds the rest. The last 8 results are
    remembered: a command builds one schedule for several mini-batch counts, and searches once."""
    key = (times, budget_seconds)
    if key not in _SEARCHED:
        while len(_SEARCHED) >= 8:
            del _SEARCHED[next(iter(_SEARCHED))]
        _SEARCHED[key] = _search(times, budget_seconds, progress)
    return _SEARCHED[key]


def forget_searches() -> None:
    """Search again rather than remember, the fixed orders built anew too (benchmarks, tests of determinism)."""
    _SEARCHED.clear()
    _fixed_patterns.cache_clear()
    _step_table.cache_clear()


def _search(times: StageTimes, budget_seconds: float, progress: Callable[[float], None] | None) -> Pattern:
    search = _Search(times, round(budget_seconds * _OPS_PER_SECOND), progress)
    for pattern in _fixed_patterns(times.stages, times.microbatches):
        search.consider(pattern, None)
    for n, variant in enumerate(_GRID):
        if n and not search.affords():  # the first variant runs whatever the budget
            break
        search.knobs(Knobs.scaled(times, *variant))
    search.improve()
    if times.stages > _EXACT_STAGES or not search.time_every_in_order():
        search.explore()
    if search.best is None:  # where boundary tensors waiting fill a room: one micro-batch at a time holds one each
        search.consider(tuple(tuple((code, j) for j in range(times.microbatches) for code in (_F, _I, _W))
                              for _ in range(times.stages)), None)
    if progress is not None:
        progress(1.0)
    if search.best is None:  # one micro-batch at a time fits where what it keeps from its I to its W fits too
        raise ScheduleError(f"{METHOD}: no order fits each device's activation limit and memory")
    return search.best


class _Search:
    """The best pattern so far, the knobs tried and the budget left (in ops), reported to `progress`."""

    def __init__(self, times: StageTimes, budget_ops: int, progress: Callable[[float], None] | None) -> None:
        self.times = times
        self.budget_ops = self.total_ops = max(budget_ops, 1)
        self.progress = progress
        self.cost_ops = 3 * times.stages * times.microbatches * _STEADY  # one pass over two mini-batches' ops
        self.best: Pattern | None = None
        self.best_key: tuple[float, float] | None = None
        self.best_knobs: Knobs | None = None
        self.tried: set[Knobs] = set()
        self.roomy = _roomy(times)

    def affords(self) -> bool:
        return self.budget_ops >= 2 * self.cost_ops

    def consider(self, pattern: Pattern | None, knobs: Knobs | None, done: list[float] | None = None) -> bool:
        """Time `pattern` (if it fits; `done`: timed already) and keep it if it beats the best; whether it did."""
        if done is None and pattern is not None:
            done = self.finish_ms(pattern)
        if done is None:
            return False
        key = (round(done[1] - done[0], 9), round(done[0], 9))
        if self.best_key is not None and key >= self.best_key:
            return False
        self.best, self.best_key = pattern, key
        if knobs is not None:
            self.best_knobs = knobs
        return True

    def knobs(self, knobs: Knobs) -> bool:
        """Run the list scheduler with `knobs` (once) and consider its pattern."""
        if knobs in self.tried:
            return False
        self.tried.add(knobs)
        self.budget_ops -= 2 * self.cost_ops  # scheduled, then timed
        better = self.consider(_greedy(self.times, knobs), knobs)
        self.report()
        return better

    def improve(self) -> None:
        """Coordinate descent from the best knobs: one stage's in-flight cap or W reserve one up or down, or its
        guard switched, the first change that shortens the step kept, until none does or the budget is spent."""
        m = self.times.microbatches
        improved = self.best_knobs is not None
        while improved:
            improved = False
            for k in range(self.times.stages):
                for field, delta in (("in_flight", -1), ("reserve", 1), ("reserve", -1), ("in_flight", 1),
                                     ("guard", 1)):
                    if not self.affords():
                        return
                    values = list(getattr(self.best_knobs, field))
                    values[k] = not values[k] if field == "guard" else values[k] + delta
                    if field != "guard" and not (0 if field == "reserve" else 1) <= values[k] <= m:
                        continue
                    if self.knobs(replace(self.best_knobs, **{field: tuple(values)})):
                        improved = True

    def explore(self) -> None:
        """Local search on the best pattern itself, past what the list scheduler's knobs reach: patterns one op
        move away (`_moves`) from those whose step is no longer than the best's, breadth first, each timed once,
        until none is left or the budget is spent. Moves that keep the step as it is are followed too: the order
        that shortens it may lie several such moves away."""
        if self.best is None:
            return
        seen = {self.best}
        frontier = deque([self.best])
        while frontier:
            pattern = frontier.popleft()
            for k in range(self.times.stages):
                for moved in _moves(pattern[k]):
                    candidate = (*pattern[:k], moved, *pattern[k + 1:])
                    if candidate in seen:
                        continue
                    if not self.affords():
                        return
                    seen.add(candidate)
                    self.budget_ops -= self.cost_ops
                    done = self.finish_ms(candidate)
                    if done is not None and done[1] - done[0] <= self.best_key[0] + 1e-9:
                        frontier.append(candidate)
                        self.consider(candidate, None, done)
            self.report()

    def time_every_in_order(self) -> bool:
        """Time every in-order pattern (each device's F, I and W in micro-batch order, I after its F, W after its I,
        within its activation limit) where the budget affords them all, the pairs of neighbouring orders that
        deadlock left out: then no such pattern is better than the best found. Whether it did."""
        times, p, length = self.times, self.times.stages, 3 * self.times.microbatches
        orders = []
        for k in range(p):  # listing them costs ops too, and stops where they are more than the budget could time
            found = _in_order(times.microbatches, times.held_bytes[k], times.kept_bytes[k], times.limit_bytes[k],
                              self.budget_ops // self.cost_ops)
            self.budget_ops -= length * (len(found) if found is not None else self.budget_ops // self.cost_ops)
            if found is None:
                return False
            orders.append(found)
        pair_ops = sum(len(a) * len(b) for a, b in zip(orders, orders[1:])) * 2 * length
        if pair_ops > self.budget_ops // 8:  # most of the budget stays for `explore` where this cannot finish
            return False
        self.budget_ops -= pair_ops
        follows = [[[j for j, b in enumerate(orders[k + 1]) if _live_pair(a, b)] for a in orders[k]]
                   for k in range(p - 1)]
        count = [1] * len(orders[-1])  # per order of device k: the live patterns of devices k .. p - 1 it starts
        for k in range(p - 2, -1, -1):
            count = [sum(count[j] for j in follows[k][i]) for i in range(len(orders[k]))]
        if sum(count) * self.cost_ops > self.budget_ops:
            return False

        def walk(k: int, chosen: tuple[tuple[tuple[int, int], ...], ...], index: int) -> None:
            if k == p:
                self.budget_ops -= self.cost_ops
                self.consider(chosen, None)
                return
            for j in range(len(orders[0])) if k == 0 else follows[k - 1][index]:
                walk(k + 1, (*chosen, orders[k][j]), j)
                if k < _REPORTED_DEPTH:  # the bar moves as the walk goes: p = 4, m = 3 walked 10 s at 0 %
                    self.report()

        walk(0, (), 0)
        self.report()
        return True

    def finish_ms(self, pattern: Pattern) -> list[float] | None:
        """`pattern`'s mini-batches' ends (`finish_ms`), None where it deadlocks, breaks a device's activation limit
        or, timed, holds more than a device's room, boundary tensors waiting included (`within_room`, where a
        device's room could bind)."""
        if not fits(pattern, self.times):
            return None
        if not all(self.roomy):  # a second pass over its ops, sorted
            self.budget_ops -= self.cost_ops
        return _timed_within_room(pattern, self.times, self.roomy)

    def report(self) -> None:
        if self.progress is not None:
            self.progress(min(1.0, 1.0 - self.budget_ops / self.total_ops))


def _in_order(m: int, held: float, kept: float, limit: float, most: int) -> list[tuple[tuple[int, int], ...]] | None:
    """Every order of one device's F, I and W of m micro-batches, each kind in micro-batch order, I after its F and
    W after its I, whose activations stay within `limit` (F, then I, then W first where there is a choice); None
    where there are more than `most`. Depth first on a stack of its own: an order is 3m ops deep, past Python's
    recursion limit from m = 333 (`simulate -s auto -p 2 -m 340` raised RecursionError)."""
    found: list[tuple[tuple[int, int], ...]] = []
    ops: list[tuple[int, int]] = []
    stack = [(0, 0, 0, 0.0)]  # per op placed, and the start: F's, I's and W's placed and the activations held
    tried = [0]  # per entry of `stack`: how many of its three next ops have been tried
    while stack:
        f, i, w, level = stack[-1]
        if w == m:
            found.append(tuple(ops))
            if len(found) > most:
                return None
        if w == m or tried[-1] == 3:  # done with this op: back to the one before it
            stack.pop()
            tried.pop()
            if ops:
                ops.pop()
            continue
        code, j, after, go = ((_F, f, level + held, f < m), (_I, i, level - held + kept, i < f),
                              (_W, w, level - kept, w < i))[tried[-1]]
        tried[-1] += 1
        if go and (code != _F or after <= limit + 1e-9):
            ops.append((code, j))
            stack.append((f + (code == _F), i + (code == _I), w + (code == _W), after))
            tried.append(0)
    return found


def _live_pair(upstream: Sequence[tuple[int, int]], downstream: Sequence[tuple[int, int]]) -> bool:
    """Whether two neighbouring devices' orders can both finish: each F downstream waits for its F upstream,
    each I upstream for its I downstream (the rest of the chain only adds waits, so a pair that deadlocks alone
    deadlocks in it)."""
    forwards = backwards = a = b = 0  # F's done upstream, I's done downstream, the next op of each
    while a < len(upstream) or b < len(downstream):
        moved = False
        while a < len(upstream) and (upstream[a][0] != _I or upstream[a][1] < backwards):
            forwards += upstream[a][0] == _F
            a, moved = a + 1, True
        while b < len(downstream) and (downstream[b][0] != _F or downstream[b][1] < forwards):
            backwards += downstream[b][0] == _I
            b, moved = b + 1, True
        if not moved:
            return False
    return True


def _moves(ops: tuple[tuple[int, int], ...]) -> Iterator[tuple[tuple[int, int], ...]]:
    """Device orders one op away from `ops`: each op put at each other place between the ops that must stay before
    it (the previous op of its kind (I and B count as one), its own F or I) and those that must stay after it,
    nearest places first."""
    group = (0, 1, 2, 1)  # by op code: F, backward (I or B), W

    def bound(code: int, j: int, other: tuple[int, int], before: bool) -> bool:
        """Whether `other` must stay on its side of (code, j)."""
        if group[other[0]] == group[code]:
            return True
        if before:
            return (code != _F and other == (_F, j)) or (code == _W and other == (_I, j))
        return (code == _F and other[1] == j) or (code == _I and other == (_W, j))

    for a, (code, j) in enumerate(ops):
        rest = ops[:a] + ops[a + 1:]
        left = a
        while left > 0 and not bound(code, j, ops[left - 1], True):
            left -= 1
        right = a
        while right < len(ops) - 1 and not bound(code, j, ops[right + 1], False):
            right += 1
        for distance in range(1, max(a - left, right - a) + 1):
            for b in (a - distance, a + distance):
                if left <= b <= right:
                    yield rest[:b] + ((code, j),) + rest[b:]


@lru_cache(maxsize=8)
def _fixed_patterns(p: int, m: int) -> tuple[Pattern | None, ...]:
    """The fixed methods' orders for one mini-batch, as patterns (None where a method cannot be built)."""
    code = np.full(len(KIND_CODE), -1)
    code[[KIND_CODE[kind] for kind in _KIND]] = np.arange(len(_KIND))
    patterns = []
    for name in _FIXED:
        try:
            table = METHODS[name].build(ScheduleParams(p, m)).table
        except ScheduleError:
            patterns.append(None)
            continue
        keep = code[table.kind] >= 0
        ops = list(zip(code[table.kind[keep]].tolist(), table.microbatch[keep].tolist()))
        bounds = np.searchsorted(table.device[keep], np.arange(p + 1)).tolist()
        patterns.append(tuple(tuple(ops[bounds[k]:bounds[k + 1]]) for k in range(p)))
    return tuple(patterns)


def fits(pattern: Pattern, times: StageTimes) -> bool:
    """Whether every device's activations stay within its limit (an order's memory follows from the order)."""
    return all(peak <= limit + 1e-9 for peak, limit in zip(peak_bytes(pattern, times), times.limit_bytes))


def peak_bytes(pattern: Pattern, times: StageTimes) -> list[float]:
    """Per device, the most activation memory its pattern holds at once (at the start of an F)."""
    peaks = []
    for k, ops in enumerate(pattern):
        held, kept = times.held_bytes[k], times.kept_bytes[k]
        delta = (held, kept - held, -kept, -held)  # by op code: F, I, W, B
        peaks.append(max(accumulate(map(delta.__getitem__, map(itemgetter(0), ops)), initial=0.0)))
    return peaks


def _roomy(times: StageTimes) -> list[bool]:
    """Per device, whether its room cannot bind: unknown, or at least all m micro-batches' activations (each the
    more of what it holds until its I and what it keeps from there until its W, which may be more) and m - 1
    boundary tensors of each kind beyond the one `_buffer_bytes` counts (a flushing order holds no more: each is a
    micro-batch of the mini-batch in flight on the device)."""
    if not times.room_bytes:
        return [True] * times.stages
    m, sizes = times.microbatches, times.boundary_sizes
    return [room >= m * max(held, kept) + 2 * (m - 1) * (sizes[k] + sizes[k + 1])
            for k, (room, held, kept) in enumerate(zip(times.room_bytes, times.held_bytes, times.kept_bytes))]


def _timed_within_room(pattern: Pattern, times: StageTimes, roomy: Sequence[bool]) -> list[float] | None:
    """`finish_ms` of `pattern` over `_STEADY` mini-batches, None where it deadlocks or, timed, breaks a device's
    room (`within_room`; not timed again where no room binds, `roomy`)."""
    starts = None if all(roomy) else [[] for _ in pattern]
    done = finish_ms(pattern, times, _STEADY, starts)
    if done is None or (starts is not None and not within_room(pattern, times, starts, roomy)):
        return None
    return done


def within_room(pattern: Pattern, times: StageTimes, starts: Sequence[Sequence[float]], roomy: Sequence[bool]) -> bool:
    """Whether each device whose room could bind (`roomy` False) holds within it, timed as `starts` says
    (`finish_ms`'s), its activations and the boundary tensors beyond the one of each kind `_buffer_bytes` counts,
    as the simulator holds them (sim/engine.py, `_memory_tables`): one it sends from the end of the op that makes it
    for the transfer's time (an F's output not where its stage takes its input in, `takes_input`: its own then, an
    activation); one it receives from its arrival until the op that takes it in ends, or begins where that is such
    an F. What an op adds counts from its start, what it frees from its end; at equal times arrivals come first,
    then the device's own changes in its order, then the transfers' ends. Transfers are timed as `finish_ms` times
    them, each link free: where they queue on a busy one, or wait for the receiver (--blocking-comm), the simulator
    may hold a sent tensor longer than counted here (simulate then marks the device out of memory, and tune counts
    the order over its cap).

    Each device's changes are arrays, sorted and summed in numpy (`_Events`): the search times hundreds of
    candidates, each of thousands of changes, and this check was most of a tune's time op by op in Python."""
    p = times.stages
    table = _OpTable(pattern, starts, times)
    sizes = times.boundary_sizes
    for k in range(p):
        if roomy[k]:
            continue
        code, unit, start, end, own = table.ops(k)
        held, kept = times.held_bytes[k], times.kept_bytes[k]
        freed = np.array([0.0, held - kept, kept, held])  # by op code, at its end (an F holds `held` from its start)
        forward, backward = code == _F, (code == _I) | (code == _B)
        events = _Events()  # (ms, group: arrivals, own changes, transfers' ends; order in it, activations, kind, count)
        events.add(start[forward], 1, own[forward], held, 0, 0)
        if k:
            events.add(table.ends(k - 1, _F)[unit[forward]] + times.send_ms[k - 1], 0, 0, 0.0, 0, 1)
            if times.takes_input[k]:
                events.add(start[forward], 1, own[forward], 0.0, 0, -1)
            else:
                events.add(end[forward], 1, own[forward] + 1, 0.0, 0, -1)
        if k < p - 1:
            if not times.takes_input[k]:  # it sends its output
                events.add(end[forward], 1, own[forward] + 1, 0.0, 2, 1)
                events.add(end[forward] + times.send_ms[k], 2, 0, 0.0, 2, -1)
            events.add(table.ends(k + 1, _I)[unit[backward]] + times.grad_ms[k], 0, 0, 0.0, 3, 1)
            events.add(end[backward], 1, own[backward] + 1, 0.0, 3, -1)
        if k:
            events.add(end[backward], 1, own[backward] + 1, 0.0, 1, 1)
            events.add(end[backward] + times.grad_ms[k - 1], 2, 0, 0.0, 1, -1)
        later = ~forward
        events.add(end[later], 1, own[later] + 1, -freed[code[later]], 0, 0)
        if events.peak(sizes[k], sizes[k + 1]) > times.room_bytes[k] + 1e-9:
            return False
    return True


class _OpTable:
    """A timed pattern's ops as arrays, device by device: each op's code, unit (b·m + j), start and end ms, and
    its place in its device's order (twice its index: an op's changes at its start, then those at its end)."""

    def __init__(self, pattern: Pattern, starts: Sequence[Sequence[float]], times: StageTimes) -> None:
        self.pattern, self.starts, self.times = pattern, starts, times
        self._ops: dict[int, tuple[np.ndarray, ...]] = {}
        self._ends: dict[tuple[int, int], np.ndarray] = {}

    def ops(self, d: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        if d not in self._ops:
            ops, m = self.pattern[d], self.times.microbatches
            start = np.asarray(self.starts[d], dtype=float)
            minibatches = len(start) // len(ops)
            code = np.tile(np.array([c for c, _ in ops]), minibatches)
            unit = np.repeat(np.arange(minibatches) * m, len(ops)) + np.tile(np.array([j for _, j in ops]), minibatches)
            end = start + np.asarray(self.times.op_ms[d], dtype=float)[code]
            self._ops[d] = code, unit, start, end, 2 * np.arange(len(start))
        return self._ops[d]

    def ends(self, d: int, code: int) -> np.ndarray:
        """By unit, when device d's F (code _F) or backward (_I: its I or B) of it ends."""
        if (d, code) not in self._ends:
            codes, unit, _, end, _ = self.ops(d)
            chosen = codes == _F if code == _F else (codes == _I) | (codes == _B)
            by_unit = np.full(len(codes), np.nan)  # as many units as ops, and more than enough
            by_unit[unit[chosen]] = end[chosen]
            self._ends[d, code] = by_unit
        return self._ends[d, code]


class _Events:
    """One device's memory changes (`within_room`), a piece at a time (the changes at `ms`, each field of theirs an
    array or one value for all), sorted and summed as Python would sort their tuples and sum them in that order."""

    def __init__(self) -> None:
        self.pieces: list[list[np.ndarray]] = []

    def add(self, ms: np.ndarray, group: int, order: np.ndarray | int, activation_bytes: np.ndarray | float,
            kind: int, count: int) -> None:
        self.pieces.append([field if isinstance(field, np.ndarray) else np.full(len(ms), field)
                            for field in (ms, group, order, activation_bytes, kind, count)])

    def peak(self, received_bytes: float, sent_bytes: float) -> float:
        """The most the device holds at once: its activations and, of each kind of boundary tensor (received
        input, sent gradient, sent output, received gradient), those beyond the first, each of its size."""
        ms, group, order, activation_bytes, kind, count = (np.concatenate(field) for field in zip(*self.pieces))
        at = np.lexsort((count, kind, activation_bytes, order, group, ms))  # the last key first, as tuples sort
        activation_bytes, kind, count = activation_bytes[at], kind[at], count[at]
        beyond = [np.maximum(np.cumsum(np.where(kind == c, count, 0)) - 1, 0) * size
                  for c, size in enumerate((received_bytes, received_bytes, sent_bytes, sent_bytes))]
        return float((np.cumsum(activation_bytes) + (beyond[0] + beyond[1] + beyond[2] + beyond[3])).max())


def finish_ms(pattern: Pattern, times: StageTimes, minibatches: int, starts: list[list[float]] | None = None
              ) -> list[float] | None:
    """When each of `minibatches` mini-batches ends (its last op, updates included), every device running the
    pattern and then its update per mini-batch; None if the pattern deadlocks. The simulator's model without
    contention: a device's ops run in order, each as soon as the device is free and its inputs have arrived.
    `starts`, if given (a list per device), gets when each op begins, device by device in its order."""
    p, m = times.stages, times.microbatches
    ends = [-1.0] * (2 * p * m * minibatches)  # at k·units + u: F of stage k; at (p + k)·units + u: I or B of stage k
    waiting = [-1] * p  # the index in `ends` each device waits for (-1: none)
    steps = [list(map(table.__getitem__, ops)) for table, ops in zip(_step_table(times, minibatches), pattern)]
    position, clock = [0] * p, [0.0] * p
    done = [0.0] * minibatches
    ready = deque(range(p))
    while ready:
        k = ready.popleft()
        ops, opt_ms = steps[k], times.opt_ms[k]
        length = len(ops)
        b, r = divmod(position[k], length + 1)
        now, offset = clock[k], b * m  # offset: the mini-batch's first unit
        while b < minibatches:
            if r == length:
                now += opt_ms
                done[b] = max(done[b], now)
                b, r, offset = b + 1, 0, offset + m
                continue
            duration, source, delay, output, reader = ops[r]
            if source >= 0:
                arrived = ends[source + offset]
                if arrived < 0:
                    waiting[k] = source + offset
                    break
                if arrived + delay > now:
                    now = arrived + delay
            if starts is not None:
                starts[k].append(now)
            now += duration
            if output >= 0:
                ends[output + offset] = now
                if waiting[reader] == output + offset:
                    waiting[reader] = -1
                    ready.append(reader)
            r += 1
        position[k], clock[k] = b * (length + 1) + r, now
    if any(i < (len(ops) + 1) * minibatches for i, ops in zip(position, pattern)):
        return None
    return done


@lru_cache(maxsize=8)
def _step_table(times: StageTimes, minibatches: int) -> tuple[dict[tuple[int, int], tuple], ...]:
    """Per stage k, each op (code, micro-batch j) as `finish_ms` walks it: its ms, where in `ends` the output it
    waits for is in the first mini-batch (-1: its own device's order suffices) and the transfer after it, where
    the end time it writes is (-1: nothing waits for it) and which device reads it. Built once per search (a
    search times hundreds of patterns on the same stages), so that a pattern's steps are a lookup per op."""
    p, m = times.stages, times.microbatches
    units = m * minibatches
    tables = []
    for k in range(p):
        table = {}
        for code, duration in enumerate(times.op_ms[k]):
            source, delay, output, reader = -1, 0.0, -1, -1
            if code == _F:
                if k < p - 1:
                    output, reader = k * units, k + 1
                if k:
                    source, delay = (k - 1) * units, times.send_ms[k - 1]
            elif code != _W:
                if k:
                    output, reader = (p + k) * units, k - 1
                if k < p - 1:
                    source, delay = (p + k + 1) * units, times.grad_ms[k]
            for j in range(m):
                table[code, j] = (duration, source + j if source >= 0 else -1, delay,
                                  output + j if output >= 0 else -1, reader)
        tables.append(table)
    return tuple(tables)


@dataclass(frozen=True)
class Knobs:
    """The list scheduler's choices per stage k: `in_flight[k]`, the most micro-batches it holds between F and I
    (besides what its memory allows); `reserve[k]`, the W's it keeps for the end of the mini-batch, where the
    next mini-batch's forwards have yet to arrive (a W fills an earlier gap only beyond these, or when memory
    needs it)."""

    in_flight: tuple[int, ...]
    reserve: tuple[int, ...]
    guard: tuple[bool, ...]  # whether stage k leaves an F unstarted that would delay its first I (due sooner)

    @classmethod
    def scaled(cls, times: StageTimes, in_flight: float, reserve: float, guard: bool = False, less: int = 0
               ) -> Knobs:
        """`in_flight` × 1F1B's p − k micro-batches, `less` fewer below the first stage (ZB-H2 holds 2(p − k) − 1);
        `reserve` × the W's that fill the time stage k waits for the next mini-batch's first forward after its own
        last I (k hops of F, I and two transfers after the first stage's)."""
        p, m = times.stages, times.microbatches
        ops = times.op_ms
        hops = np.concatenate([[0.0], np.cumsum([ops[k][_F] + ops[k][_I] + times.send_ms[k - 1] + times.grad_ms[
            k - 1] for k in range(1, p)])])
        wait = [hops[k] / max(ops[k][_W], 1e-9) for k in range(p)]
        return cls(tuple(max(1, min(m, math.ceil(in_flight * (p - k)) - (less if k else 0)))
                         if math.isfinite(in_flight) else m for k in range(p)),
                   tuple(min(m, round(reserve * wait[k])) if math.isfinite(reserve) else m for k in range(p)),
                   (guard,) * p)


def _greedy(times: StageTimes, knobs: Knobs) -> Pattern | None:
    """The list scheduler's pattern: `_STEADY` mini-batches scheduled one after another, each device deciding
    whenever it is free (devices in time order, through a heap); the last mini-batch's order (the steady one)
    is the pattern. None where the knobs leave a device nothing it can ever run.

    Each device runs as a generator that keeps its own counters, memory and costs in local variables and yields
    whenever another device is due before it: the search's dearest loop reads locals, not per-device lists (but
    its neighbours' counts and activations where a room binds, `within_room`'s boundary tensors). A
    device waits for at most one F and one I at a time, so who waits for an end time is a slot per device; one
    that waits for an arrival due before every other device decides again at once, as the heap would have it."""
    p, m, n = times.stages, times.microbatches, _STEADY
    units = m * n
    forward_end = [0.0] * units + [-1.0] * (p * units)  # at (k + 1)·units + u: F of stage k; at u: the input, at once
    backward_end = [-1.0] * (p * units) + [0.0] * units  # at k·units + u: I of stage k; at p·units + u: the loss
    waits_f, waits_i = [-1] * p, [-1] * p  # [k]: the unit whose F (I) device k waits for from its neighbour
    # Where a device's room could bind (`_roomy`): [k] the F's and I's device k has begun (one more slot, never
    # begun: the boundaries past the ends) and the activations it holds, from which its neighbours count what they
    # send it and it has yet to take in. A device short of room, its own or the next one's, waits for its own next
    # I, as for its activation limit, not for the other device: its order then says the wait (an F after that I),
    # which a pattern run as soon as each op can (`finish_ms`, the simulator) would not
    begun_f, begun_i, load = [0] * (p + 1), [0] * (p + 1), [0.0] * p
    roomy, rooms, sizes = _roomy(times), times.room_bytes or (math.inf,) * p, times.boundary_sizes
    tracked = not all(roomy)  # kept only where read
    # per device: when it last stopped (read only while it is stopped), its live heap entry, when it is due
    clock, token, due, asleep = [0.0] * p, [0] * p, [0.0] * p, [False] * p
    recorded: list[list[tuple[int, int]]] = [[] for _ in range(p)]
    heap = [(0.0, k, 0) for k in range(p)]
    push = heapq.heappush

    def wake(d: int, ready_at: float) -> None:
        """Device d, stopped waiting for an input that arrives at `ready_at`, decides then (or when it stopped)."""
        if clock[d] > ready_at:
            ready_at = clock[d]
        if asleep[d] or ready_at < due[d]:
            asleep[d] = False
            token[d] += 1
            due[d] = ready_at
            push(heap, (ready_at, d, token[d]))

    def device(k: int) -> Generator[tuple[float, int, int] | None, float, bool]:
        """Device k's decisions, resumed with the time it is due at. It yields its heap entry where it is due
        again at once but another device is due first (the loop pushes it as it pops the next), else nothing;
        returns whether it finished (False: the knobs leave it nothing it can ever run)."""
        cap, reserve, guard = knobs.in_flight[k], knobs.reserve[k], knobs.guard[k]
        held, kept, limit = times.held_bytes[k], times.kept_bytes[k], times.limit_bytes[k] + 1e-9
        freed = held - kept
        f_ms, i_ms, w_ms = times.op_ms[k][_F], times.op_ms[k][_I], times.op_ms[k][_W]
        forward_in, backward_in = k * units, (k + 1) * units  # where the inputs it waits for are
        forward_out, backward_out = (k + 1) * units, k * units  # where the end times it writes are
        above = k - 1
        send_in = times.send_ms[k - 1] if k else 0.0  # its F's input's transfer
        grad_in = times.grad_ms[k] if k < p - 1 else 0.0  # its I's
        below = k + 1 if k < p - 1 else -1
        send_out = times.send_ms[k] if below >= 0 else 0.0
        grad_out = times.grad_ms[k - 1] if k else 0.0
        record = recorded[k].append
        pending: deque[int] = deque()
        memory, inf = 0.0, math.inf
        room, unbound, after = rooms[k] + 1e-9, roomy[k], below >= 0 and not roomy[below]
        up, down = sizes[k], sizes[k + 1]  # the boundary tensors it receives from above and from below
        # Of the inputs sent to a device and not yet begun, those beyond one that its next F leaves held: all but
        # two where its stage takes its input in as the F begins (that one, and the one `_buffer_bytes` counts),
        # else all but one (the F holds its own until it ends). Here, and on the device below (`fits_below`).
        taken = 2 if not unbound and times.takes_input[k] else 1
        if after:
            taken_below, held_below, room_below = (2 if times.takes_input[below] else 1, times.held_bytes[below],
                                                   rooms[below] + 1e-9)

        def fits_below(sent: int) -> bool:
            """Whether the next device, `sent` inputs of this device's sent so far, holds those beyond one within its
            room, as it is (an F under way holding its own input too, where it frees it as it ends) and as its next
            F would leave it: it holds them however full it is, and one that could not begin its next F would wait
            for what only it can free."""
            waiting = sent - begun_f[below]
            gradients = max(begun_i[below + 1] - begun_i[below] - 1, 0) * sizes[k + 2]
            now_beyond, next_beyond = waiting - taken_below + 1, waiting - taken_below
            return ((now_beyond <= 0 or load[below] + now_beyond * down + gradients <= room_below)
                    and (next_beyond <= 0 or load[below] + held_below + next_beyond * down + gradients <= room_below))

        now = yield
        for b in range(n):
            base, keep = b * m, b == n - 1
            f = i = 0
            while i < m or pending:
                i_at = f_at = None
                if i < f:
                    arrived = backward_end[backward_in + base + i]
                    if arrived >= 0:
                        i_at = arrived + grad_in
                if f < m and f - i < cap:
                    arrived = forward_end[forward_in + base + f]
                    if arrived >= 0:
                        f_at = arrived + send_in
                # an F that would end after the mini-batch's first I arrives delays the whole backward chain, which
                # a guarded stage avoids
                free_until = i_at if guard and i == 0 and i_at is not None else inf
                if i_at is not None and i_at <= now:
                    now += i_ms
                    if keep:
                        record((_I, i))
                    memory -= freed
                    if tracked:
                        begun_i[k], load[k] = base + i + 1, memory
                    pending.append(i)
                    u = base + i
                    backward_end[backward_out + u] = now
                    if above >= 0 and waits_i[above] == u:
                        waits_i[above] = -1
                        wake(above, now + grad_out)
                    i += 1
                elif f_at is not None and f_at <= now and memory + held <= limit and now + f_ms <= free_until and (
                        unbound or memory + held + max(begun_f[above] - base - f - taken, 0) * up  # beyond one each
                        + max(begun_i[below] - base - i - 1, 0) * down <= room) and (
                        not after or fits_below(base + f + 1)):
                    now += f_ms
                    if keep:
                        record((_F, f))
                    memory += held
                    if tracked:
                        begun_f[k], load[k] = base + f + 1, memory
                    u = base + f
                    forward_end[forward_out + u] = now
                    if below >= 0 and waits_f[below] == u:
                        waits_f[below] = -1
                        wake(below, now + send_out)
                    f += 1
                elif pending and now + w_ms <= free_until and (
                        len(pending) > reserve or i == f == m or (f_at is not None and f_at <= now)):
                    now += w_ms
                    j = pending.popleft()
                    if keep:
                        record((_W, j))
                    memory -= kept
                    if tracked:
                        load[k] = memory
                else:  # wait: for an input whose arrival is known, or for one not yet sent
                    sleeps = i < f and i_at is None
                    if sleeps:
                        waits_i[k] = base + i
                    wake_at = i_at  # None or later than now (else it would run): the earliest known arrival
                    if f_at is not None and f_at > now and (wake_at is None or f_at < wake_at):
                        wake_at = f_at  # an F that arrived but has no room does not wake it: a W frees the room
                    if f < m and f - i < cap and f_at is None:
                        waits_f[k] = base + f
                    elif wake_at is None and not sleeps:
                        return False
                    if wake_at is not None and (not heap or wake_at < heap[0][0]):  # it would be popped next
                        now = wake_at
                        continue
                    clock[k] = now
                    token[k] += 1
                    if wake_at is not None:
                        due[k] = wake_at
                        push(heap, (wake_at, k, token[k]))
                    else:
                        asleep[k] = True
                    now = yield
                    continue
                if heap and heap[0][0] <= now:  # another device decides first
                    clock[k] = now
                    token[k] += 1
                    due[k] = now
                    now = yield now, k, token[k]
            now += times.opt_ms[k]
            if not keep and heap and heap[0][0] <= now:
                clock[k] = now
                token[k] += 1
                due[k] = now
                now = yield now, k, token[k]
        return True

    resume = [runner.send for runner in map(device, range(p))]
    for start in resume:
        start(None)
    finished, pop, push_pop = 0, heapq.heappop, heapq.heappushpop
    entry = pop(heap) if heap else None
    while entry is not None:
        now, k, live = entry
        if live != token[k]:
            entry = pop(heap) if heap else None
            continue
        try:
            again = resume[k](now)
        except StopIteration as stop:
            if not stop.value:
                return None
            finished += 1
            again = None
        entry = push_pop(heap, again) if again is not None else pop(heap) if heap else None
    if finished < p:
        return None
    return tuple(tuple(ops) for ops in recorded)


def _merge_backward(pattern: Pattern, times: StageTimes) -> Pattern:
    """On the first stage, an I followed at once by its own W becomes one B where B costs no more than the two (a
    split backward walks the graph twice): fewer rows, the same activations (W frees what I kept when B ends), and
    no one waits for that stage's input gradient. Elsewhere B would send its gradient only after the W part. Where a
    room could bind, not if one then breaks: a B holds the gradient it received until it ends, past where the I
    would have, beside those arriving meanwhile, and where B is cheaper the next forwards reach the next device
    sooner."""
    if times.op_ms[0][_B] > times.op_ms[0][_I] + times.op_ms[0][_W]:
        return pattern
    out: list[tuple[int, int]] = []
    for code, j in pattern[0]:
        if code == _W and out and out[-1] == (_I, j):
            out[-1] = (_B, j)
        else:
            out.append((code, j))
    merged = (tuple(out), *pattern[1:])
    roomy = _roomy(times)
    return merged if all(roomy) or _timed_within_room(merged, times, roomy) is not None else pattern


def _schedule(params: ScheduleParams, pattern: Pattern) -> Schedule:
    """Each device's pattern, then its stage's update, once per mini-batch (built as columns)."""
    n = params.minibatches
    kind_code = np.array([KIND_CODE[kind] for kind in _KIND] + [KIND_CODE[Kind.OPT]])
    parts = []
    for k, ops in enumerate(pattern):
        codes, microbatches = (np.array([*column, fill]) for column, fill in zip(zip(*ops), (len(_KIND), -1)))
        rows = len(codes) * n
        parts.append((k, np.tile(kind_code[codes], n), np.full(rows, k), np.tile(microbatches, n),
                      np.repeat(np.arange(n), len(codes)), np.zeros(rows)))
    return make_schedule(METHOD, params, stacked(parts))


def activation_ratio(schedule: Schedule, costs: Costs) -> float:
    """The R a searched schedule holds: the most activation memory one of its devices holds at once (the search's
    rule, `peak_bytes`, on its first mini-batch) over 1F1B's peak for the same costs (`one_f_one_b_peak`).
    `tune`, which hands the search a device's whole memory, reports it."""
    params = ScheduleParams(**schedule.params)
    times = stage_times(params, costs, Cluster.uniform(params.stages, 0.0), (), [0] * params.stages)
    t = schedule.table
    code = {KIND_CODE[kind]: c for c, kind in enumerate(_KIND)}
    first = (t.minibatch == 0) & np.isin(t.kind, list(code))
    pattern = tuple(tuple((code[kind], int(j)) for kind, j in zip(t.kind[first & (t.stage == k)],
                                                                     t.microbatch[first & (t.stage == k)]))
                    for k in range(params.stages))
    return max(peak_bytes(pattern, times)) / one_f_one_b_peak(times.held_bytes, params.microbatches)
