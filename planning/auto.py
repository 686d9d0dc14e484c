"""`auto`: the synchronous schedule searched from a scenario's costs, under a limit on activation memory.

As the zero-bubble paper's automatic scheduler does (Qi et al., ICLR 2024, section 4): a greedy list scheduler
runs the simulator's event model (a device runs one op at a time; an F waits for the previous stage's F and the
transfer, an I for the next stage's I and the transfer back; W only for its own I) and decides on every device,
whenever it is free, what to run next: a ready I first (it is on the critical path), else a ready F if the
device's memory allows it, else a deferred W to fill the gap. Its knobs (how many micro-batches a stage may
hold in flight, whether W's fill every gap or wait for the end of the mini-batch) are tried in turn, beside the
fixed orders (1F1B, ZB-H1, ZB-H2, GPipe) that fit the same memory, and every candidate is timed as a repeated
step: mini-batches following each other, each device starting the next one after its own update. The one with
the shortest steady-state time per mini-batch wins (ties: the faster cold first mini-batch, then the first
tried), so the same inputs give the same schedule.

The result is an ordinary Schedule: per mini-batch each device runs its pattern, then its stage's OPT.
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from ..schedules import KIND_CODE, Action, Kind, Schedule, ScheduleError, ScheduleParams, make_schedule
from ..schedules.catalogue import METHODS
from ..sim import Cluster, Costs
from ..sim.engine import static_bytes
from ..units import MIB

METHOD = "auto"
_F, _I, _W, _B = range(4)  # op codes of a pattern
_KIND = (Kind.F, Kind.I, Kind.W, Kind.B)
_STEADY = 2  # mini-batches timed: the second shows the steady state of a flushing order (`steady_minibatches`)
_FIXED = ("1f1b", "zb-h1", "zb-h2", "gpipe")  # fixed orders the search starts from, where they fit
_IN_FLIGHT = (1.0, 1.5, 2.0, 3.0, math.inf)  # micro-batches a stage may hold, as multiples of 1F1B's p - k



class ActivationLimitError(ScheduleError):
    """--activation-limit leaves a device less than one micro-batch's activations: a flag's value to change."""


Pattern = tuple[tuple[tuple[int, int], ...], ...]  # per device: one mini-batch's (op code, micro-batch), in order


@dataclass(frozen=True)
class StageTimes:
    """What the search reads, for a chain of p stages, stage k on device k: `op_ms[k]` the ms of F, I, W and B
    of one micro-batch (the runtime's own cost per row included), `opt_ms[k]` its update; `send_ms[k]` the
    activation's transfer from stage k to k + 1 and `grad_ms[k]` its gradient's back; `held_bytes[k]` what a
    micro-batch holds from its F until its I (or B), `kept_bytes[k]` what it still holds from its I until its W;
    `limit_bytes[k]` the most device k may hold at once."""

    op_ms: np.ndarray
    opt_ms: tuple[float, ...]
    send_ms: tuple[float, ...]
    grad_ms: tuple[float, ...]
    held_bytes: tuple[float, ...]
    kept_bytes: tuple[float, ...]
    limit_bytes: tuple[float, ...]
    microbatches: int

    @property
    def stages(self) -> int:
        return len(self.opt_ms)


def search_schedule(params: ScheduleParams, costs: Costs, links: Cluster,
                    memory_bytes: Sequence[int | None] = ()) -> Schedule:
    """The `auto` schedule for `params` (p stages, one per device, m micro-batches, N mini-batches; its
    activation limit R and search budget) on `costs` and `links`, each device's activations capped by
    R × what 1F1B holds on device 0 and, where `memory_bytes` knows a device's memory, by what fits beside its
    weights, gradients and optimizer state. Raises ScheduleError naming --activation-limit when a device could
    not hold even one micro-batch."""
    if params.chunks != 1 or params.pipelines != 1:
        raise ScheduleError(f"{METHOD} places one model stage per device in one pipeline: chunks and pipelines "
                            f"must be 1 (got {params.chunks} and {params.pipelines})")
    frame = schedule_frame(params)
    times = stage_times(params, costs, links, memory_bytes, static_bytes(frame, costs))
    pattern = best_pattern(times)
    return _schedule(params, _merge_backward(pattern, times))


def schedule_frame(params: ScheduleParams) -> Schedule:
    """The shape of an `auto` schedule before its order is known (a chain, stage k on device k, no actions):
    what its costs, links and memory are looked up for."""
    return make_schedule(METHOD, params, [() for _ in range(params.stages)])


def stage_times(params: ScheduleParams, costs: Costs, links: Cluster, memory_bytes: Sequence[int | None],
                static: Sequence[int]) -> StageTimes:
    """The search's view of the costs; the activation limit in bytes per device (in micro-batches when no stage
    saves activations). ScheduleError when a device's limit is below one micro-batch's activations."""
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
    kept = costs.wgrad_activation_fraction * np.array([c.activation_bytes for c in costs.stages], dtype=float)
    unit = "bytes"
    if not held.any():  # no sizes given: count micro-batches
        held, kept, unit = np.ones(p), np.full(p, costs.wgrad_activation_fraction), "micro-batches"
    limit_r = params.activation_limit if params.activation_limit is not None else 1.0
    reference = min(p, m) * held[0]  # what 1F1B holds on its first device
    limit = np.full(p, limit_r * reference)
    for d, memory in enumerate(memory_bytes[:p]):
        if memory is not None and unit == "bytes":
            limit[d] = min(limit[d], memory - static[d])
    short = np.flatnonzero(limit < held - 1e-9)
    if len(short):
        d = int(short[0])

        def amount(value: float) -> str:
            return f"{value / MIB:,.1f} MiB" if unit == "bytes" else f"{value:g} micro-batches"

        why = (f"its memory holds {amount(max(limit[d], 0.0))} of activations beside its weights, gradients and "
               "optimizer state" if limit[d] < limit_r * reference else
               f"R = {limit_r:g} leaves it {amount(limit[d])} of activations")
        raise ActivationLimitError(f"--activation-limit: device {d}: {why}, less than one micro-batch's "
                                   f"{amount(held[d])}; R must be at least {max(held / reference):.3g}")
    opt = ops[:, KIND_CODE[Kind.OPT]] + host[KIND_CODE[Kind.OPT]]
    return StageTimes(op_ms, tuple(opt.tolist()), send_ms, grad_ms, tuple(held.tolist()), tuple(kept.tolist()),
                      tuple(limit.tolist()), m)


def best_pattern(times: StageTimes) -> Pattern:
    """The candidate with the shortest steady-state time per mini-batch (then the shortest first mini-batch,
    then the first tried) among the fixed orders that fit and the greedy scheduler's variants."""
    candidates = [*_fixed_patterns(times), *(_greedy(times, multiple, lazy) for multiple in _IN_FLIGHT
                                             for lazy in (False, True))]
    best, best_key = None, None
    for pattern in candidates:
        if pattern is None or not fits(pattern, times):
            continue
        done = finish_ms(pattern, times, _STEADY)
        if done is None:
            continue
        key = (round(done[1] - done[0], 9), round(done[0], 9))
        if best_key is None or key < best_key:
            best, best_key = pattern, key
    if best is None:  # cannot happen: one micro-batch at a time always fits (checked by `stage_times`)
        raise ScheduleError(f"{METHOD}: no order fits the activation limit")
    return best


def _fixed_patterns(times: StageTimes) -> list[Pattern | None]:
    """The fixed methods' orders for one mini-batch, as patterns (None where a method cannot be built)."""
    p, m = times.stages, times.microbatches
    patterns = []
    for name in _FIXED:
        try:
            sched = METHODS[name].build(ScheduleParams(p, m))
        except ScheduleError:
            patterns.append(None)
            continue
        code = {Kind.F: _F, Kind.I: _I, Kind.W: _W, Kind.B: _B}
        patterns.append(tuple(tuple((code[a.kind], a.microbatch) for a in order if a.kind in code)
                              for order in sched.orders))
    return patterns


def fits(pattern: Pattern, times: StageTimes) -> bool:
    """Whether every device's activations stay within its limit (an order's memory follows from the order)."""
    return all(peak <= limit + 1e-9 for peak, limit in zip(peak_bytes(pattern, times), times.limit_bytes))


def peak_bytes(pattern: Pattern, times: StageTimes) -> list[float]:
    """Per device, the most activation memory its pattern holds at once (at the start of an F)."""
    peaks = []
    for k, ops in enumerate(pattern):
        held, kept = times.held_bytes[k], times.kept_bytes[k]
        delta = (held, kept - held, -kept, -held)
        level = peak = 0.0
        for code, _ in ops:
            level += delta[code]
            peak = max(peak, level)
        peaks.append(peak)
    return peaks


def finish_ms(pattern: Pattern, times: StageTimes, minibatches: int) -> list[float] | None:
    """When each of `minibatches` mini-batches ends (its last op, updates included), every device running the
    pattern and then its update per mini-batch; None if the pattern deadlocks. The simulator's model without
    contention: a device's ops run in order, each as soon as the device is free and its inputs have arrived."""
    p, m = times.stages, times.microbatches
    units = m * minibatches
    ends = [[-1.0] * units for _ in range(2 * p)]  # ends[k]: F of stage k; ends[p + k]: I or B of stage k
    waiting: dict[int, int] = {}  # (producer row of `ends`) * units + unit -> the device waiting for it
    position, clock = [0] * p, [0.0] * p
    done = [0.0] * minibatches
    ready = deque(range(p))
    while ready:
        k = ready.popleft()
        ops, durations, length = pattern[k], times.op_ms[k].tolist(), len(pattern[k]) + 1
        i, now = position[k], clock[k]
        while i < length * minibatches:
            b, r = divmod(i, length)
            if r == length - 1:
                now += times.opt_ms[k]
            else:
                code, j = ops[r]
                u = b * m + j
                if code == _F and k:
                    source, delay = k - 1, times.send_ms[k - 1]
                elif code in (_I, _B) and k < p - 1:
                    source, delay = p + k + 1, times.grad_ms[k]
                else:
                    source = -1
                if source >= 0:
                    arrived = ends[source][u]
                    if arrived < 0:
                        waiting[source * units + u] = k
                        break
                    now = max(now, arrived + delay)
                now += durations[code]
                if code != _W:
                    row = k if code == _F else p + k
                    ends[row][u] = now
                    woken = waiting.pop(row * units + u, None)
                    if woken is not None:
                        ready.append(woken)
            done[b] = max(done[b], now)
            i += 1
        position[k], clock[k] = i, now
    if any(i < (len(ops) + 1) * minibatches for i, ops in zip(position, pattern)):
        return None
    return done


def _greedy(times: StageTimes, multiple: float, lazy: bool) -> Pattern | None:
    """The list scheduler's pattern: `_STEADY` mini-batches scheduled one after another, each device deciding
    whenever it is free; the last mini-batch's order (the steady one) is the pattern. A stage holds at most
    `multiple` × (p − k) micro-batches between F and I (and what its memory allows); `lazy` W's wait for the
    end of the mini-batch (where the next one's forwards have yet to arrive) unless memory needs them sooner,
    else every W fills the first gap."""
    p, m = times.stages, times.microbatches
    cap = [max(1, min(m, math.ceil(multiple * (p - k)) if math.isfinite(multiple) else m)) for k in range(p)]
    n = _STEADY
    units = m * n
    ends = [[-1.0] * units for _ in range(2 * p)]
    waiting: dict[int, list[int]] = {}
    minibatch, forwards, backwards = [0] * p, [0] * p, [0] * p
    pending: list[deque[int]] = [deque() for _ in range(p)]
    memory, clock = [0.0] * p, [0.0] * p
    token = [0] * p  # a device's live heap entry; older ones are stale
    due = [0.0] * p  # when its live entry is due
    asleep = [False] * p
    recorded: list[list[tuple[int, int]]] = [[] for _ in range(p)]
    heap = [(0.0, k, 0) for k in range(p)]
    durations = times.op_ms.tolist()

    def push(k: int, at: float) -> None:
        token[k] += 1
        due[k] = at
        heapq.heappush(heap, (at, k, token[k]))

    def wake(row: int, u: int, at: float) -> None:
        """Devices waiting for this output: due no later than its arrival."""
        for d in waiting.pop(row * units + u, ()):
            at_d = max(clock[d], at)
            if asleep[d] or at_d < due[d]:
                asleep[d] = False
                push(d, at_d)

    def run(k: int, code: int, j: int, start: float) -> None:
        b = minibatch[k]
        end = start + durations[k][code]
        clock[k] = end
        if b == n - 1:
            recorded[k].append((code, j))
        u = b * m + j
        if code == _F:
            memory[k] += times.held_bytes[k]
            forwards[k] += 1
            ends[k][u] = end
            if k < p - 1:
                wake(k, u, end + times.send_ms[k])
        elif code == _I:
            memory[k] -= times.held_bytes[k] - times.kept_bytes[k]
            backwards[k] += 1
            pending[k].append(j)
            ends[p + k][u] = end
            if k:
                wake(p + k, u, end + times.grad_ms[k - 1])
        else:
            memory[k] -= times.kept_bytes[k]

    finished = 0
    while heap:
        now, k, live = heapq.heappop(heap)
        if live != token[k] or minibatch[k] == n:
            continue
        now = max(now, clock[k])
        b, f, i = minibatch[k], forwards[k], backwards[k]
        if i == m and not pending[k]:
            clock[k] = now + times.opt_ms[k]
            minibatch[k] += 1
            forwards[k] = backwards[k] = 0
            if minibatch[k] == n:
                finished += 1
            else:
                push(k, clock[k])
            continue
        known: list[float] = []
        wait_keys: list[tuple[int, int]] = []
        i_at = None
        if i < f:
            if k == p - 1:
                i_at = now
            else:
                arrived = ends[p + k + 1][b * m + i]
                if arrived >= 0:
                    i_at = arrived + times.grad_ms[k]
                else:
                    wait_keys.append((p + k + 1, b * m + i))
        f_at = None
        room = memory[k] + times.held_bytes[k] <= times.limit_bytes[k] + 1e-9
        if f < m and f - i < cap[k]:
            if k == 0:
                f_at = now
            else:
                arrived = ends[k - 1][b * m + f]
                if arrived >= 0:
                    f_at = arrived + times.send_ms[k - 1]
                else:
                    wait_keys.append((k - 1, b * m + f))
        if i_at is not None and i_at <= now:
            run(k, _I, i, now)
        elif f_at is not None and f_at <= now and room:
            run(k, _F, f, now)
        elif pending[k] and (not lazy or i == f == m or (f_at is not None and f_at <= now and not room)):
            run(k, _W, pending[k].popleft(), now)
        else:
            if i_at is not None:
                known.append(i_at)
            if f_at is not None and room:
                known.append(f_at)
            if not known and not wait_keys:
                return None  # nothing can ever run here: the knobs deadlock it
            for row, u in wait_keys:
                waiting.setdefault(row * units + u, []).append(k)
            clock[k] = now
            if known:
                push(k, min(known))
            else:
                token[k] += 1
                asleep[k] = True
            continue
        push(k, clock[k])
    if finished < p:
        return None
    return tuple(tuple(ops) for ops in recorded)


def _merge_backward(pattern: Pattern, times: StageTimes) -> Pattern:
    """On the first stage, an I followed at once by its own W becomes one B where B costs no more than the two (a
    split backward walks the graph twice): fewer rows, the same memory (W frees what I kept when B ends), and no
    one waits for that stage's input gradient. Elsewhere B would send its gradient only after the W part."""
    if times.op_ms[0][_B] > times.op_ms[0][_I] + times.op_ms[0][_W]:
        return pattern
    out: list[tuple[int, int]] = []
    for code, j in pattern[0]:
        if code == _W and out and out[-1] == (_I, j):
            out[-1] = (_B, j)
        else:
            out.append((code, j))
    return (tuple(out), *pattern[1:])


def _schedule(params: ScheduleParams, pattern: Pattern) -> Schedule:
    """Each device's pattern, then its stage's update, once per mini-batch."""
    orders = []
    for k, ops in enumerate(pattern):
        order = []
        for b in range(params.minibatches):
            order += [Action(_KIND[code], k, j, b) for code, j in ops]
            order.append(Action(Kind.OPT, k, -1, b))
        orders.append(order)
    return make_schedule(METHOD, params, orders)
