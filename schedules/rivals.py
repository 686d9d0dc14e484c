"""The synchronous rivals of 1F1B: interleaved 1F1B, zero bubble (H1, H2, V), DualPipeV and DualPipe.

All of them flush: per mini-batch every device runs its pattern, then one OPT per model stage it holds,
so no op ever reads stale weights (policy SYNCHRONOUS). With several mini-batches the pattern repeats.
Each function names the source whose order it follows; the order rules are written here, not copied.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace

import numpy as np

from ..units import degree_text
from .ir import Kind, Schedule, ScheduleError, StageGraph
from .methods import (
    Method,
    ScheduleParams,
    interleave_1f1b_rows,
    make_schedule,
    require_degree,
    require_plain,
    require_single_pipeline,
)
from .table import FIELD_DTYPE, KIND_CODE, KIND_DTYPE, ActionTable

_F, _B, _I, _W, _OPT = (KIND_CODE[k] for k in (Kind.F, Kind.B, Kind.I, Kind.W, Kind.OPT))


def _flushed(method: str, params: ScheduleParams, placement: Sequence[int], pattern: ActionTable,
             graph: StageGraph | None = None) -> Schedule:
    """Repeat `pattern`, every device's actions for mini-batch 0 (rows grouped by device, device 0's first), per
    mini-batch, each followed by the OPT of every stage the device holds (after all of that stage's backward work,
    which the pattern finishes first); the stages a chain unless `graph` says otherwise. The pattern is the same
    for every mini-batch, so it is built once and repeated as table rows (`ActionTable.per_minibatch`)."""
    stages = np.argsort(placement, kind="stable")  # every device's, in device order
    devices = np.asarray(placement)[stages]
    updates = {"device": devices, "kind": _OPT, "stage": stages, "microbatch": -1, "minibatch": 0, "pipeline": 0,
               "peer": -1}
    after = np.searchsorted(pattern.device, devices, side="right")  # past the device's pattern
    minibatch = ActionTable(**{name: np.insert(getattr(pattern, name), after, value)
                               for name, value in updates.items()})
    return make_schedule(method, params, minibatch.per_minibatch(params.minibatches), placement=placement,
                         graph=graph)


def _each_device(devices: int, device_order: Callable[[int], _VOrder]) -> ActionTable:
    """A pattern (`_flushed`) from each device's actions for mini-batch 0, `device_order(device)`."""
    orders = [device_order(device).columns() for device in range(devices)]
    kind, stage, microbatch, peer = (np.concatenate(column) for column in zip(*orders))
    rows = len(kind)
    return ActionTable(np.repeat(np.arange(devices, dtype=FIELD_DTYPE), [len(order[0]) for order in orders]),
                       kind, stage.astype(FIELD_DTYPE), microbatch.astype(FIELD_DTYPE),
                       np.zeros(rows, dtype=FIELD_DTYPE), np.zeros(rows, dtype=FIELD_DTYPE), peer.astype(FIELD_DTYPE))


def interleaved_1f1b(params: ScheduleParams) -> Schedule:
    """Megatron-LM's interleaved 1F1B (Narayanan et al. 2021): v chunks per device, model stage s on device
    s mod p, so a micro-batch crosses every device v times and the fill/drain bubble shrinks by v.

    The micro-batches pass through the chunks in groups of g (`microbatch_group`, Megatron-core's
    microbatch_group_size_per_vp_stage, p by default): every device's forward i is entry i of the table that runs
    each group through chunk 0, then chunk 1, ... (`megatron_chunk_order`), its backward i the same micro-batch on
    the mirrored chunk v - 1 - c. Warm-up (p - k - 1)·2 + (v - 1)·g forwards (capped at m·v), then 1F1B, then
    cool-down (schedules.py `get_pp_rank_microbatches`). Megatron runs its non-interleaved 1F1B when v = 1, so
    that case is plain 1F1B (warm-up p - k - 1), which takes no group.
    """
    method = "interleaved-1f1b"
    require_single_pipeline(method, params)
    p, m, v = params.stages, params.microbatches, params.chunks
    given = params.microbatch_group
    if v == 1 and given is not None:
        raise ScheduleError(f"--microbatch-group: {method} at v = 1 runs Megatron's plain 1F1B, which takes no "
                            f"group: give --chunks 2 or more, or leave --microbatch-group out")
    g = p if given is None else given
    if v > 1:
        _check_microbatch_group(method, p, m, v, g, given is not None)
    if given == p:  # Megatron-core's default, recorded as not given: the same order reads the same everywhere
        params = replace(params, microbatch_group=None)
    k = np.arange(p)  # the device
    warmup = (p - k - 1) * 2 + (v - 1) * g if v > 1 else p - k - 1
    backward, i = interleave_1f1b_rows(m * v, warmup)  # per device, the virtual micro-batch i of each step
    table_microbatch, table_chunk = megatron_chunk_order(m, v, g)
    chunk = np.where(backward, v - 1 - table_chunk[i], table_chunk[i])
    pattern = ActionTable.from_device_rows(np.where(backward, _B, _F), chunk * p + k[:, None], table_microbatch[i])
    return _flushed(method, params, [s % p for s in range(p * v)], pattern)


def megatron_chunk_order(m: int, v: int, g: int) -> tuple[np.ndarray, np.ndarray]:
    """(micro-batch, chunk) of each of a device's m·v forwards in turn, as Megatron-core's `get_schedule_table`
    orders them: the micro-batches in groups of g (the last one the rest), each group through chunk 0, then
    chunk 1, and so on."""
    starts = np.arange(0, m, g)
    sizes = np.minimum(starts + g, m) - starts
    microbatch = np.concatenate([np.tile(np.arange(a, a + n), v) for a, n in zip(starts, sizes)])
    chunk = np.concatenate([np.repeat(np.arange(v), n) for n in sizes])
    return microbatch, chunk


def least_microbatch_group(p: int, m: int) -> int | None:
    """The smallest micro-batch group Megatron-core takes for m micro-batches on p stages where its default, p, is
    refused (m not a multiple of p): the group that holds the fewest micro-batches in flight (`interleaved_1f1b`'s
    warm-up grows with it); None where the default runs, or where no group does (m < p)."""
    if m % p == 0 or m < p:
        return None
    return next(g for g in range(p + 1, m + 1) if m % g == 0 or m % g >= p)


def _check_microbatch_group(method: str, p: int, m: int, v: int, g: int, given: bool) -> None:
    """Refuse a group Megatron-core refuses (forward_backward_pipelining_with_interleaving): g from p to m, and a
    last group of m mod g micro-batches either none or at least p, since fewer than p leave the pipeline waiting
    on its own dependencies. With g = p, its default, that is m a multiple of p."""
    if not given:
        if m % p:
            raise ScheduleError(
                f"{method} with {v} chunks per device needs micro-batches to be a multiple of stages "
                f"(Megatron sends p micro-batches through each chunk in turn): got {degree_text('m', m)}, "
                f"{degree_text('p', p)}" + ("; simulate, run and export take --microbatch-group G from p to m whose "
                                            "remainder m mod G is 0 or at least p (Megatron's "
                                            "microbatch_group_size_per_vp_stage), here "
                                            f"{least_microbatch_group(p, m):,} at the least" if m > p else ""))
        return
    if m < p:
        raise ScheduleError(f"--microbatch-group: a group holds p to m micro-batches, and m = {m:,} is fewer than "
                            f"p = {p:,}: give --microbatches {p:,} or more")
    if not p <= g <= m:
        raise ScheduleError(f"--microbatch-group: give {p:,} (p) to {m:,} (m), the micro-batches each chunk takes "
                            f"in turn, as Megatron-core does (got {g:,})")
    if 0 < m % g < p:
        raise ScheduleError(f"--microbatch-group: its last group would hold m mod G = {m % g:,} micro-batches, fewer "
                            f"than p = {p:,}, which Megatron-core refuses (it leaves the pipeline waiting on its "
                            f"own dependencies): give a G whose remainder is 0 or at least p (got {g:,})")


def _defer_weight_gradients(backward: np.ndarray, microbatch: np.ndarray,
                            lag: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Split every B into I then W, holding each W back until `lag` later I's have run (oldest first),
    the rest at the end: W has no consumer, so it can fill the bubbles the I chain leaves. Per row of (rows,
    2m) 1F1B patterns (is backward, micro-batch), row r's lag `lag[r]`: (rows, 3m) kind codes and micro-batches,
    sorted by where each action goes (an F or I at its step, the n-th I's W right after the (n + lag)-th I)."""
    rows, m = len(backward), backward.shape[1] // 2
    inputs = np.nonzero(backward)[1].reshape(rows, m)  # per row, the step of its n-th I
    n = np.arange(m)
    follows = n + lag[:, None]  # the I that the n-th I's W follows
    weight_at = np.where(follows < m, 2 * np.take_along_axis(inputs, np.minimum(follows, m - 1), 1) + 1, 4 * m + n)
    at = np.concatenate([np.broadcast_to(2 * np.arange(2 * m), (rows, 2 * m)), weight_at], axis=1)
    order = np.argsort(at, axis=1)
    kind = np.concatenate([np.where(backward, _I, _F), np.full((rows, m), _W)], axis=1)
    microbatch = np.concatenate([microbatch, np.take_along_axis(microbatch, inputs, 1)], axis=1)
    return np.take_along_axis(kind, order, 1), np.take_along_axis(microbatch, order, 1)


def _zero_bubble_handcrafted(method: str, params: ScheduleParams, c: int) -> Schedule:
    """Stage k: 1F1B with warm-up c·(p−k−1) forwards and B split into I then W, each W lagging c·k I's
    (Qi et al. 2023, figure 3; DeepSpeed's ZeroBubbleH1Pipeline for c = 1). Well defined for every m."""
    p, m = params.stages, params.microbatches
    k = np.arange(p)  # the stage, on device k
    kind, microbatch = _defer_weight_gradients(*interleave_1f1b_rows(m, c * (p - k - 1)), c * k)
    return _flushed(method, params, range(p), ActionTable.from_device_rows(kind, k[:, None], microbatch))


def zb_h1(params: ScheduleParams) -> Schedule:
    """ZB-H1: 1F1B's warm-up; the later a stage, the more W's it defers (k), which cuts the bubble to
    (p−1)(F + I − W) when W ≤ I. A deferred W keeps its micro-batch's activations, so every stage holds up
    to p micro-batches: 1F1B's peak (at its stage 0), the paper's "same peak memory as 1F1B". Any m works."""
    require_plain("zb-h1", params)
    return _zero_bubble_handcrafted("zb-h1", params, 1)


def zb_h2(params: ScheduleParams) -> Schedule:
    """ZB-H2: 2(p−k)−1 forwards before the first I and W's lagging 2k, trading up to 2p−1 micro-batches of
    activations per stage for a parallelogram with no bubble after the warm-up. With fewer than 2p−1
    micro-batches the extra forwards only delay the I chain (slower than ZB-H1), so those are refused."""
    require_plain("zb-h2", params)
    p, m = params.stages, params.microbatches
    if m < 2 * p - 1:
        raise ScheduleError(
            f"zb-h2 runs 2p-1 forwards on stage 0 before its first backward, so it needs at least 2p-1 = "
            f"{2 * p - 1:,} micro-batches (got {degree_text('m', m)}); with fewer, use zb-h1, which is then faster"
        )
    return _zero_bubble_handcrafted("zb-h2", params, 2)


def _v_placement(p: int) -> list[int]:
    """Chain of 2p stages folded into a V: device i holds stages i and 2p−1−i."""
    return [s if s < p else 2 * p - 1 - s for s in range(2 * p)]


def _require_v(method: str, params: ScheduleParams,
               holds: str = "folds the model into a V of two chunks per device") -> None:
    require_single_pipeline(method, params)
    require_degree(params, "chunks", 2, f"{method} {holds} (device i holds stages i and 2p-1-i)")


# A V order's passes (`_VOrder`), each its parts' (kind, chunk): F, B, I or W of chunk 0 or 1; W of the oldest I of
# either chunk (-1; DualPipe's one WeightGradStore queue); an overlapped pair (F&B) of one chunk's forward and the
# other's full backward, its forward first.
_PASSES = (((Kind.F, 0),), ((Kind.F, 1),), ((Kind.B, 0),), ((Kind.B, 1),), ((Kind.I, 0),), ((Kind.I, 1),),
           ((Kind.W, 0),), ((Kind.W, 1),), ((Kind.W, -1),), ((Kind.F, 0), (Kind.B, 1)), ((Kind.F, 1), (Kind.B, 0)))
F0, F1, B0, B1, I0, I1, W0, W1, W, F0B1, F1B0 = range(len(_PASSES))
# [pass, part]: the part's kind code and chunk (a pass of one part: that part twice)
_PART_KIND = np.array([[KIND_CODE[parts[k % len(parts)][0]] for k in (0, 1)] for parts in _PASSES], dtype=KIND_DTYPE)
_PART_CHUNK = np.array([[parts[k % len(parts)][1] for k in (0, 1)] for parts in _PASSES])


class _VOrder:
    """One device's actions for mini-batch 0 of a schedule of two chunks per device, written as the sources write
    it, in runs of a pattern of passes (`repeat`): each (pass, chunk) takes its next micro-batch in order (chunk
    c's count from `first[c]`; B and I share the backward count), each W the oldest I still without its W, of its
    chunk or of either (an order uses one or the other), and each chunk's micro-batches beyond its `microbatches`
    are dropped (ZB-V is built for at least 2p−1 and trimmed, as torch does); an overlapped pair whose other part is
    dropped runs alone. Numbered as columns, not pass by pass: tune builds hundreds of these orders."""

    def __init__(self, stages: tuple[int, int], microbatches: int, first: tuple[int, int] = (0, 0)) -> None:
        self.stages = stages  # V schedules: chunk 0 on the way down, chunk 1 on the way back
        self.microbatches = microbatches
        self.first = first
        self.runs: list[np.ndarray] = []
        self.written = [0] * len(_PASSES)  # per pass

    def repeat(self, times: int, *passes: int) -> None:
        """`passes` in turn, `times` over (none where `times` <= 0)."""
        if times > 0:
            self.runs.append(np.tile(np.array(passes, dtype=np.intp), times))
            for code in passes:
                self.written[code] += times

    def pending_of(self, chunk: int) -> int:
        """The I's of `chunk` still without their W (W's of that chunk's own)."""
        return self.written[(I0, I1)[chunk]] - self.written[(W0, W1)[chunk]]

    def columns(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """The actions in order: (kind codes, stages, micro-batches, peers)."""
        codes = np.concatenate(self.runs) if self.runs else np.zeros(0, dtype=np.intp)
        parts = 1 + (codes >= F0B1)
        code = np.repeat(codes, parts)
        part = np.zeros(len(code), dtype=np.intp)
        part[np.cumsum(parts)[parts == 2] - 1] = 1
        kind, chunk = _PART_KIND[code, part], _PART_CHUNK[code, part]
        inputs, weights = kind == _I, kind == _W
        j = np.zeros(len(code), dtype=np.int64)  # the micro-batch's number in its chunk
        for c in (0, 1):
            for counted in (kind == _F, (kind == _B) | inputs):
                mine = np.flatnonzero(counted & (chunk == c))
                j[mine] = np.arange(len(mine))
        # the n-th W of a queue (a chunk's I's, or all of them) is the n-th I of that queue's
        queues = [(np.flatnonzero(weights & (chunk == c)), inputs & (chunk == c) if c >= 0 else inputs)
                  for c in (-1, 0, 1)]
        for taking, queued in queues:
            its_input = np.flatnonzero(queued)[:len(taking)]
            j[taking], chunk[taking] = j[its_input], chunk[its_input]
        kept = j < self.microbatches
        forward = np.flatnonzero(part == 1) - 1  # each pair's forward part, its backward next
        paired = forward[kept[forward] & kept[forward + 1]]
        stages = np.asarray(self.stages)
        peer = np.full(len(code), -1, dtype=np.int64)
        peer[paired], peer[paired + 1] = stages[chunk[paired + 1]], stages[chunk[paired]]
        return kind[kept], stages[chunk[kept]], np.asarray(self.first)[chunk[kept]] + j[kept], peer[kept]


def zb_v(params: ScheduleParams) -> Schedule:
    """ZB-V (Qi et al. 2023, section 6), order as torch's ScheduleZBVZeroBubble writes it for device i:
    2(p−i)−1 F0; i × (F1 F0); p−i × (F1 I1 W1); then F0 I0 W0 F1 I1 W1 until all forwards ran; cool-down
    i × (I0 I1), p−i × (I0 W0), the chunk-1 W's, then the chunk-0 W's. Every W follows its I at once until
    the cool-down, so a device holds at most 2p chunk micro-batches, 1F1B's p full-stage ones. Built for
    max(m, 2p−1) micro-batches and trimmed to m, so every m ≥ 1 works."""
    method = "zb-v"
    _require_v(method, params)
    p, m = params.stages, params.microbatches
    planned = max(m, 2 * p - 1)

    def device_order(i: int) -> _VOrder:
        o = _VOrder((i, 2 * p - 1 - i), m)
        o.repeat(2 * (p - i) - 1, F0)
        o.repeat(i, F1, F0)
        o.repeat(p - i, F1, I1, W1)
        o.repeat(planned - (2 * p - i - 1), F0, I0, W0, F1, I1, W1)  # until every chunk-0 forward has run
        o.repeat(p - i - 1, I0, W0, F1, I1, W1)  # until every chunk-1 forward has
        o.repeat(i, I0, I1)
        o.repeat(p - i, I0, W0)
        o.repeat(o.pending_of(1), W1)
        o.repeat(o.pending_of(0), W0)
        return o

    return _flushed(method, params, _v_placement(p), _each_device(p, device_order))


def _dualpipe_phases(o: _VOrder, ranks: int, rank: int, microbatches: int) -> _VOrder:
    """The eight phases of DualPipe's step() (deepseek-ai/DualPipe, dualpipe.py and dualpipev.py alike) for rank
    `rank` of `ranks`, chunk 0 the one its first forwards feed, each chunk running `microbatches`:
    2(p−r−1) F0; r+1 × (F0 F1); p−r−1 × (I1 W F1); m−2p+r+1 × (F0 B1 F1 B0); p−r−1 × (B1 F1 B0); r+1 × (B1 B0)
    with the later r+1 of those split into I; p−r−1 × (W I0); r+1 × W. W's run oldest first across both chunks
    (its WeightGradStore is one queue). The F and B that its `_forward_backward_chunk` overlaps are one overlapped
    pair (F&B), all but the last rank's first, which it runs apart "to further reduce bubble size"."""
    p, r = ranks, rank
    o.repeat(2 * (p - r - 1), F0)
    o.repeat(r + 1, F0, F1)
    o.repeat(p - r - 1, I1, W, F1)
    apart = int(r == p - 1)  # m >= 2p: at least one step in the steady state
    o.repeat(apart, F0, B1, F1B0)
    o.repeat(microbatches - 2 * p + r + 1 - apart, F0B1, F1B0)
    o.repeat(p - r - 1, B1, F1B0)
    o.repeat(1, *[((I1, I0) if n >= r + 1 else (B1, B0))[n % 2] for n in range(2 * (r + 1))])
    o.repeat(p - r - 1, W, I0)
    o.repeat(r + 1, W)
    return o


def dualpipev(params: ScheduleParams) -> Schedule:
    """DeepSeek's DualPipeV (DualPipe cut in half, deepseek-ai/DualPipe dualpipev.py): DualPipe's eight phases
    (`_dualpipe_phases`) on p ranks, chunk 0 the V's way down. One copy of each stage's weights (DualPipe, with
    both directions, holds two). Needs m ≥ 2p, as DualPipeV asserts.
    """
    method = "dualpipev"
    _require_v(method, params)
    p, m = params.stages, params.microbatches
    if m < 2 * p:
        raise ScheduleError(
            f"{method} needs at least 2p micro-batches, one per model stage of the V (DualPipeV asserts "
            f"num_chunks >= 2 * num_ranks): got {degree_text('m', m)}, {degree_text('p', p)}"
        )

    def device_order(r: int) -> _VOrder:
        return _dualpipe_phases(_VOrder((r, 2 * p - 1 - r), m), p, r, m)

    return _flushed(method, params, _v_placement(p), _each_device(p, device_order))


def dualpipe(params: ScheduleParams) -> Schedule:
    """DeepSeek's bidirectional DualPipe (DeepSeek-V3's report, section 3.2.1 and figure 5; deepseek-ai/DualPipe
    dualpipe.py): two copies of the model on p devices fed from both ends, copy 0's stage s on device s and copy
    1's stage s (model stage p + s) on device p−1−s, so device r holds stages r and 2p−1−r (the V's placement,
    each a whole device's share of the model). Copy 0 runs the first m/2 micro-batches, copy 1 the rest. Rank r
    runs DualPipe's eight phases (`_dualpipe_phases`) as rank min(r, p−1−r) of p/2, on m/2 micro-batches per copy,
    its chunk 0 the copy fed from its own end (copy 0 on the first p/2 ranks). Two copies of every stage's weights,
    their gradients summed before the update. Needs p even and m even and ≥ 2p, as DualPipe asserts.
    """
    method = "dualpipe"
    _require_v(method, params, "holds a stage of each of its two model copies on every device")
    p, m = params.stages, params.microbatches
    if p % 2 or m % 2 or m < 2 * p:
        raise ScheduleError(
            f"{method} needs an even number of devices and an even number of micro-batches, at least 2p (DualPipe "
            f"asserts num_ranks % 2 == 0, num_chunks % 2 == 0 and num_chunks >= num_ranks * 2): "
            f"got {degree_text('p', p)}, {degree_text('m', m)}"
        )
    half = m // 2

    def device_order(r: int) -> _VOrder:
        own, other = (r, 0), (2 * p - 1 - r, half)  # (stage, first micro-batch) of copy 0's and copy 1's stage
        near, far = (own, other) if r < p // 2 else (other, own)
        order = _VOrder((near[0], far[0]), half, first=(near[1], far[1]))
        return _dualpipe_phases(order, p // 2, min(r, p - 1 - r), half)

    return _flushed(method, params, _v_placement(p), _each_device(p, device_order),
                    StageGraph.chain(2 * p, copies=2))


RIVALS = (
    Method("interleaved-1f1b", "Interleaved 1F1B (Megatron): v chunks per device, bubble divided by v; m a "
           "multiple of p, or as --microbatch-group allows", interleaved_1f1b, defaults={"chunks": 2},
           options=frozenset({"microbatch_group"}), exchanges_per_step=True),
    Method("zb-h1", "Zero bubble H1: backward split into I and W, W's fill the bubble; 1F1B's peak memory", zb_h1,
           splits_backward=True),
    Method("zb-h2", "Zero bubble H2: 2(p-k)-1 forwards before the first I; no bubble after warm-up, 2p-1 "
           "activations", zb_h2, splits_backward=True),
    Method("zb-v", "Zero bubble V: two chunks per device in a V, split backward; 1F1B's activation memory", zb_v,
           defaults={"chunks": 2}, fixed=frozenset({"chunks"}), splits_backward=True),
    Method("dualpipev", "DualPipeV (DeepSeek): DualPipe cut in half, two chunks per device in a V; a forward and "
           "another micro-batch's backward run as one overlapped F&B pair (--fb-hidden-fraction); m >= 2p",
           dualpipev, defaults={"chunks": 2}, fixed=frozenset({"chunks"}), splits_backward=True),
    Method("dualpipe", "DualPipe (DeepSeek-V3): two copies of the model fed from both ends of the devices, F&B pairs "
           "in the steady state; twice the weights; p even, m even and >= 2p", dualpipe, defaults={"chunks": 2},
           fixed=frozenset({"chunks"}), splits_backward=True),
)
