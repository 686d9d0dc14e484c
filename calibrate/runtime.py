"""The executor's own costs per row, read off real runs of it on a model of tiny layers.

A measured row costs more than its stage's work: the runtime reads the loss, posts and takes messages, and
between rows draws the next forward's micro-batch and keeps its memory and version books. Those costs are per
row, so `pipesim calibrate` runs the executor itself (its own processes, transport and threads per rank) on a
two-layer MLP whose layers take microseconds, with the stage boundary as large as the calibrated model's, and
`runtime_terms` turns its traces into the profile's `RuntimeProfile`: per compute kind, a row's time minus its
stage's own pass as the probe's calibration timed it (`StagePasses`, which hold what grows with a stage's
layers: functional_call and the saved-tensor hooks); the CPU time a SEND row takes its rank's thread (its own
cost: its wall time holds the waits of a descheduled thread) and the host time of a RECV whose message had
already arrived; how long a message takes from its send's post to a receiver waiting for it; the gap after
each kind of row (less a compute row's wait for its turn on a GPU it shares); and the gradient copies an update
leaves held (what a device holds before an update at a flush over what it held before the run's first, less the
buffers of the receives posted ahead for the next mini-batch, where that memory holds them). The
probe runs its schedules in turn in one run (`probe_schedule`: 1F1B for B, then ZB-H1 for I and W; both for F,
OPT and the transfers), so its ranks start once. The gaps and a SEND's host time come from the same run on
the calibrated model itself (`host_times`): that host work runs on the caches a stage's compute leaves, and
after a stage of large layers it takes longer than after the probe's (the default gpt's gap after a forward
3.5x, a micro-batch's host time in all 1.25-1.8x); where what that could add to the probe's is a negligible share
of the stages' passes (`host_plan`), that run is not made. The probe's terms depend on
the host, the torch build, the threads, the dtype and the boundary's size but not on the model, so `pipesim
calibrate` keeps them in the host cache (calibrate/cache.py); the calibrated model's run, where made, is made
every time.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

import numpy as np

from ..profiles.schema import COMPUTE_KINDS, RECV_WINDOW, Profile, RuntimeProfile, Timing
from ..schedules import Schedule, ScheduleParams, build_schedule
from ..traces.trace import Counter, Ops, Stream, Trace

PROBE_SCHEDULES = ("1f1b", "zb-h1")  # run in turn, each for one warm-up mini-batch and `steady` more
PROBE_OPTIMIZER = "sgd"  # the probe's OPT rows minus its calibrated SGD step leave the runtime's own part
PROBE_MICROBATCHES = 8
PROBE_STEADY = 5  # mini-batches per schedule the probe keeps
HOST_STEADY = 2  # ... and the calibrated model's run: 32 gaps after each kind of compute row, 8 after updates
HOST_WARMED = 1  # schedules of that run, from the first, that start with a warm-up mini-batch: the later one runs
# warm (the default gpt's gaps after I and W in a ZB-H1 warm-up mini-batch were 0.01-0.05 ms over its steady ones)
HOST_RUN_S = 1.5  # compute per rank the calibrated model's run aims at: its gaps are short beside large rows
HOST_SHARE = 0.01  # the run is made where it can move a micro-batch's host time by this share of a stage's F + B:
HOST_MARGIN = 2  # its host time per micro-batch over the probe's is taken to be at most this (the default gpt's run:
# 1.25-1.8x, median 1.34x, over 27 calibrations on the 2-core host, its gaps after compute rows 2-3.5x, its
# receives' less); that run moved the gpt's by 0.18-0.52 % of its F + B, a simulated run by 0.1 %
HOST_KINDS = ("F", "B", "SEND_F", "SEND_B", "RECV_F", "RECV_B")  # the rows a micro-batch's gaps follow (1F1B)
MAX_PROBE_WIDTH = 1 << 16  # boundaries wider than this are probed at this width (meta says so)
WARMUP_ROWS = 8  # a fresh rank's first compute rows are priced at their own pace this many at a time ...
WARMUP_STEPS = 6  # ... for at most this many steps (`warmup_ms`)


class RuntimeProbeError(ValueError):
    """Probe traces that do not give every term; the message names the one missing."""


def probe_width(profile: Profile, element_bytes: int) -> int:
    """The width of the probe MLP (one block, then the classifier) whose boundary, at the profile's micro-batch
    size, carries as many bytes as the profile's largest stage boundary: a send's host cost depends on it."""
    boundary = max((stage.output_bytes for stage in profile.stages), default=0)
    width = round(boundary / (profile.environment.microbatch_size * element_bytes))
    return int(min(max(width, 1), MAX_PROBE_WIDTH))


def probe_schedule(stages: int, microbatches: int, steady: int, warmed: int = len(PROBE_SCHEDULES)) -> Schedule:
    """PROBE_SCHEDULES in one schedule on `stages` devices, each in turn for `steady` mini-batches, numbered on
    from the schedule before; the first `warmed` of them start with one more, a warm-up mini-batch (its first
    rows of a kind run cold code paths: `params["warmup_minibatches"]` names them, and every term drops them)."""
    parts = [build_schedule(name, ScheduleParams(stages=stages, microbatches=microbatches,
                                                 minibatches=(index < warmed) + steady))
             for index, name in enumerate(PROBE_SCHEDULES)]
    first, orders, offset, warmups = parts[0], [[] for _ in range(stages)], 0, []
    for index, part in enumerate(parts):
        for device, order in enumerate(part.orders):
            orders[device] += [action._replace(minibatch=action.minibatch + offset) for action in order]
        if index < warmed:
            warmups.append(offset)
        offset += part.minibatches
    return Schedule(method=" then ".join(PROBE_SCHEDULES), graph=first.graph, placement=first.placement,
                    orders=[tuple(order) for order in orders], policy=first.policy, microbatches=microbatches,
                    minibatches=offset, params={**first.params, "minibatches": offset, "warmup_minibatches": warmups})


@dataclass(frozen=True)
class RunPlan:
    """A run of `probe_schedule`: its micro-batches, steady mini-batches per schedule, and how many schedules,
    from the first, start with a warm-up mini-batch."""

    microbatches: int
    steady: int
    warmed: int = len(PROBE_SCHEDULES)

    @property
    def minibatches(self) -> int:
        return self.warmed + self.steady * len(PROBE_SCHEDULES)

    def schedule(self, stages: int) -> Schedule:
        return probe_schedule(stages, self.microbatches, self.steady, self.warmed)


PROBE_PLAN = RunPlan(PROBE_MICROBATCHES, PROBE_STEADY)


def host_share(profile: Profile, runtime: RuntimeProfile) -> float:
    """The probe's host time per micro-batch (a SEND row's, and the gaps after a micro-batch's rows of
    HOST_KINDS) over the shortest stage's F + B: the share of a stage's time the run of the calibrated model
    prices afresh."""
    host_ms = runtime.send_ms.median_ms + sum(runtime.gap_ms[kind].median_ms for kind in HOST_KINDS
                                              if kind in runtime.gap_ms)
    pass_ms = min(stage.fwd_ms + stage.bwd_ms for stage in profile.stages)
    return host_ms / pass_ms if pass_ms > 0 else float("inf")


def host_plan(profile: Profile, runtime: RuntimeProfile) -> RunPlan | None:
    """The run of the calibrated model (HOST_WARMED schedules warmed up: its ranks are warm by the next), or None
    where it cannot change a prediction: that host work, after a stage of large layers, took up to HOST_MARGIN times the
    probe's, so where the difference is under HOST_SHARE of every stage's F + B (the default gpt's probe share is
    0.6-0.7 %, its run's 0.8-1.2 %: not made) the probe's terms price it as closely. Else the probe's micro-batches
    and HOST_STEADY, fewer where its passes are so long that the run would take more than HOST_RUN_S of compute
    per rank (at least one steady mini-batch, and the 2p micro-batches ZB-H1 needs)."""
    if (HOST_MARGIN - 1) * host_share(profile, runtime) < HOST_SHARE:
        return None
    pass_s = max(stage.fwd_ms + stage.bwd_ms for stage in profile.stages) / 1e3
    stages = profile.partition.stages
    microbatches = max(2 * stages, min(PROBE_MICROBATCHES, int(HOST_RUN_S / (4 * pass_s)) if pass_s else 1 << 30))
    per_minibatch_s = microbatches * pass_s
    steady = HOST_STEADY if not per_minibatch_s else int((HOST_RUN_S / per_minibatch_s - HOST_WARMED)
                                                         / len(PROBE_SCHEDULES))
    return RunPlan(microbatches, min(HOST_STEADY, max(1, steady)), HOST_WARMED)


def _steady(trace: Trace) -> np.ndarray:
    """Which of the trace's ops are past warm-up: not in a warm-up mini-batch of its schedule (the first one, or
    those `probe_schedule` names)."""
    return ~np.isin(trace.ops.minibatch, trace.meta.params.get("warmup_minibatches", [0]))


def _timing(samples_ms: list[float] | np.ndarray, what: str) -> Timing:
    if len(samples_ms) == 0:
        raise RuntimeProbeError(f"the runtime probe recorded no {what}")
    q1, median, q3 = np.percentile(samples_ms, [25, 50, 75])
    return Timing(median_ms=max(float(median), 0.0), spread_ms=float(q3 - q1), repeats=len(samples_ms))


def _own_ms(probe: Profile, kind: str, stage: int, shared_gpu: bool) -> float:
    """What the probe's calibration says row `kind` of `stage` costs by its work alone: its pass as the
    executor computes it, as the probe's run issued it (`shared_gpu`: `StagePasses.issued`), or its layers' sum,
    in a probe calibrated before passes were measured."""
    s = probe.stages[stage]
    if kind == "OPT":
        return s.steps[PROBE_OPTIMIZER].step.median_ms
    name = {"F": "fwd", "B": "bwd", "I": "igrad", "W": "wgrad"}[kind]
    return getattr(s.passes.issued(shared_gpu), name).median_ms if s.passes is not None else getattr(s, f"{name}_ms")


def _message_bytes(probe: Profile, kind: str, stage: int, peer: int) -> int:
    """The bytes a receive of `stage` from `peer` takes: the boundary's activation, or its gradient."""
    return probe.stages[peer if kind == "RECV_F" else stage].output_bytes


def _last_before(counter: Counter, at_us: float) -> float:
    """`counter`'s last sample before `at_us`."""
    return counter.values[np.searchsorted(counter.times_us, at_us, side="left") - 1]


def _gaps_us(ops: Ops, rows: np.ndarray) -> np.ndarray:
    """The host time after each of a device's `rows` (in the order it ran them) but its last, until the next row:
    less the wait of a compute row for its turn on a GPU shared with other ranks (the ranks' compute, which the
    simulator runs on that GPU: left in, it was the 2-rank H200 run's gap after RECV_F, 9.9 ms, the other stage's
    backward)."""
    return ops.start_us[rows[1:]] - ops.end_us[rows[:-1]] - np.maximum(ops.wait_us[rows[1:]], 0.0)


def _host_times(traces: list[Trace]) -> tuple[dict[str, list[float]], list[float]]:
    """Per kind of row, the gaps (ms) after its steady-state rows until the device's next row; and the SEND
    rows' own cost (ms): the CPU time posting each took its rank's thread (the trace's `cpu_us`), not
    its row's wall time, which on a loaded host is mostly the thread descheduled or waiting while its peer
    runs (the mlp's on the 2-core host here: 0.1-0.25 ms of CPU in rows of 0.7-8 ms median)."""
    gaps: dict[str, list[float]] = defaultdict(list)
    sends: list[float] = []
    for trace in traces:
        ops, names = trace.ops, np.asarray(trace.kinds)[trace.ops.kind]
        steady = _steady(trace)
        cpu_us = ops.cpu_us[steady & (ops.stream == Stream.SEND)]
        sends += (cpu_us[cpu_us >= 0] / 1e3).tolist()  # a trace that does not time them records none
        for d in range(trace.num_devices):
            rows = np.flatnonzero(ops.device == d)
            rows = rows[np.argsort(ops.start_us[rows], kind="stable")]
            for row, gap in zip(rows[:-1], _gaps_us(ops, rows) / 1e3):
                if steady[row]:
                    gaps[names[row]].append(gap)
    return gaps, sends


def warmup_ms(traces: list[Trace]) -> list[float]:
    """What a fresh rank's first rows cost beyond the later ones, from runs of `probe_schedule` (its first
    schedule, which starts the ranks): per device, what each row held it (a compute or SEND row's duration and
    the host time after every row; not a receive's wait) less the median of the same kind and stage's rows in
    the schedule's second half; its median per WARMUP_ROWS compute rows of the first half (step j: the rows
    after j·WARMUP_ROWS of them and before the next), up to WARMUP_STEPS, so that a row a slow spell of a shared
    machine stretched does not stand for its step; median over devices and traces. A fixed cost per row (cold
    code, first allocations; the same at every size here), so the probe's tiny layers measure it; a step
    faster than the steady rows is noise, priced as none."""
    excess = []
    for trace in traces:
        ops = trace.ops
        starts = trace.meta.params.get("warmup_minibatches", [0])
        first = ops.minibatch < (starts[1] if len(starts) > 1 else int(ops.minibatch.max()) + 1)
        for d in range(trace.num_devices):
            rows = np.flatnonzero(ops.device == d)
            rows = rows[np.argsort(ops.start_us[rows], kind="stable")]
            held_us = np.where(ops.stream[rows] == Stream.RECV, 0.0, ops.dur_us[rows])
            held_us[:-1] += _gaps_us(ops, rows)
            timed = first[rows]
            timed[-1] = False  # no row ends the host time after the device's last
            compute = ops.stream[rows] == Stream.COMPUTE
            computed = np.cumsum(compute) - compute
            half = int(compute[first[rows]].sum()) // 2
            key = ops.kind[rows].astype(np.int64) * (int(ops.stage.max()) + 1) + ops.stage[rows]  # a prediction's
            # kind is a byte
            late = timed & (computed >= half)
            steady_us = {k: float(np.median(held_us[late & (key == k)])) for k in np.unique(key[late])}
            excess.append([])
            for j in range(min(WARMUP_STEPS, half // WARMUP_ROWS)):
                mine = timed & (computed // WARMUP_ROWS == j) & np.isin(key, list(steady_us))
                excess[-1].append(float(np.median(held_us[mine] - [steady_us[k] for k in key[mine]])) / 1e3)
    excess = [e for e in excess if e]
    steps = min((len(e) for e in excess), default=0)
    if not steps:
        return []
    return [max(round(float(ms), 4), 0.0) for ms in np.median([e[:steps] for e in excess], axis=0)]


def host_times(runtime: RuntimeProfile, traces: list[Trace]) -> RuntimeProfile:
    """`runtime` with the gaps after each row and the SEND rows' own cost in `traces`, runs of the calibrated model
    itself: that host work runs on the caches the stage's compute left (after a large stage longer than after the
    probe's)."""
    gaps, sends = _host_times(traces)
    return runtime.model_copy(update={
        "send_ms": _timing(sends, "SEND rows' CPU time"),
        "gap_ms": {kind: _timing(samples, f"gaps after {kind}") for kind, samples in sorted(gaps.items())}})


def runtime_terms(traces: list[Trace], probe: Profile, meta: dict) -> RuntimeProfile:
    """The runtime's per-row costs from measured probe `traces` of the model `probe` profiles (same stage
    bounds), warm-up mini-batch dropped, samples pooled over traces, devices and stages."""
    compute: dict[str, list[float]] = defaultdict(list)
    gaps, sends = _host_times(traces)
    arrived: list[float] = []
    waited: list[float] = []  # from the send's post to the end of a receive that waited for it
    kept: list[float] = []
    window = int(traces[0].meta.extra.get("recv_window", RECV_WINDOW)) if traces else RECV_WINDOW
    for trace in traces:
        ops, kinds = trace.ops, trace.kinds
        names = np.asarray(kinds)[ops.kind]
        steady = _steady(trace)
        dur_ms, end_us = ops.dur_us / 1e3, ops.start_us + ops.dur_us
        for i in np.flatnonzero(steady & (ops.stream == Stream.COMPUTE)):
            own = (_own_ms(probe, names[i], int(ops.stage[i]), trace.meta.shares_gpu) if names[i] in COMPUTE_KINDS
                   else 0.0)
            if own > 0:  # a pass its layers do not have (an input gradient of the stage reading the batch) is skipped
                compute[names[i]].append(dur_ms[i] - own)
        sending = steady & (ops.stream == Stream.SEND)
        # A receive's message had arrived when its send was posted before the receive began.
        backward = np.char.endswith(names, "_B").astype(np.int64)
        key = np.stack([backward, ops.microbatch, ops.minibatch, ops.pipeline], axis=1).tolist()
        sent = {(*key[i], int(ops.stage[i]), int(ops.peer[i])): i for i in np.flatnonzero(sending)}
        for i in np.flatnonzero(steady & (ops.stream == Stream.RECV)):
            send = sent.get((*key[i], int(ops.peer[i]), int(ops.stage[i])))
            if send is None:
                continue
            if end_us[send] <= ops.start_us[i]:
                arrived.append(dur_ms[i])
            else:
                waited.append((end_us[i] - ops.start_us[send]) / 1e3)
        # The first schedule's updates: a later one's first rows may allocate for good what none before did.
        later = [b for b in trace.meta.params.get("warmup_minibatches", [0]) if b > 0]
        first_schedule = ops.minibatch < min(later, default=trace.meta.minibatches)
        for d in range(trace.num_devices):
            rows = np.flatnonzero(ops.device == d)
            rows = rows[np.argsort(ops.start_us[rows], kind="stable")]
            # Before an update at a flush a device holds its stage's weights and optimizer state, the mini-batch's
            # gradient, what the last update left of its own, the buffers of its next `window` receives, posted
            # ahead (where its memory counts them), and on a GPU what its allocator holds beyond the books (cuBLAS's
            # workspace per handle and stream among it, ATen/cuda/CublasHandlePool.cpp: 82 MiB a rank in the H200
            # check's runs, which over the probe's 1-16 MiB gradients read as 16-31 of them). Before the run's first
            # update none had left any: the excess over it of a later one's, in gradients, is the copies kept. Sends
            # still in flight (the executor's `sending_bytes`) are left out: when one completes is the transport's
            # threads' timing, which under load left one at the first update and none at a later (0.61-0.94 read).
            memory = trace.counters["memory_bytes"][d]
            sending = trace.counters.get("sending_bytes", [Counter(np.zeros(1), np.zeros(1))] * (d + 1))[d]
            receives = np.flatnonzero(ops.stream[rows] == Stream.RECV)  # positions in the device's order
            held: dict[int, dict[int, int]] = defaultdict(dict)  # per stage, per mini-batch
            for at in np.flatnonzero((names[rows] == "OPT") & first_schedule[rows]):
                row = rows[at]
                # the previous row's last sample (a row that frees weights has two at its end: its peak, then after)
                before = _last_before(memory, end_us[row] - 0.5) - _last_before(sending, end_us[row] - 0.5)
                posted = rows[receives[receives > at][:window]] if trace.meta.counts_posted_receives else []
                held[int(ops.stage[row])][int(ops.minibatch[row])] = before - sum(
                    _message_bytes(probe, names[i], int(ops.stage[i]), int(ops.peer[i])) for i in posted)
            for stage, by_minibatch in held.items():
                if 0 in by_minibatch:
                    kept += [(nbytes - by_minibatch[0]) / probe.stages[stage].grad_bytes
                             for b, nbytes in by_minibatch.items() if b > 0]
    recv = _timing(arrived, "receive whose message had arrived")
    return RuntimeProfile(
        compute_ms={kind: _timing(compute[kind], f"{kind} rows") for kind in COMPUTE_KINDS},
        send_ms=_timing(sends, "SEND rows' CPU time"), recv_ms=recv,
        delivery_ms=_timing(np.asarray(waited) - recv.median_ms, "receive that waited for its message"),
        delivery_bytes=int(meta["boundary_bytes"]),
        gap_ms={kind: _timing(samples, f"gaps after {kind}") for kind, samples in sorted(gaps.items())},
        kept_gradients=max(round(float(np.median(kept)), 2), 0.0) if kept else 0.0,
        recv_window=window, warmup_ms=warmup_ms(traces), warmup_rows=WARMUP_ROWS, meta=meta)
