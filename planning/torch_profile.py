"""A torch.distributed.pipelining run as a measured trace, from torch.profiler's Chrome traces, so that a
prediction can be held against the runtime a user already has.

torch's runtime (`_PipelineScheduleRuntime`: interleaved, zero-bubble and CSV-loaded schedules) wraps every
action in a `PP:<action>` range, e.g. `PP:1F0` or `PP:0SEND_F3`; `ScheduleGPipe` records `Forward i` and
`Backward i` ranges instead (receive wait and send issue included), on the one stage its rank holds. A range
named `PP:<stage>OPT` (the user's `record_function` around `optimizer.step()`) is the stage's update. torch
repeats its schedule every `step()`, so the n-th time a rank runs an action it belongs to mini-batch n.
The profiler writes one file per rank (`tensorboard_trace_handler`), which names its rank in
`distributedInfo`.

torch's runtime waits for a received activation inside the F action that reads it (`_wait_batch_p2p` before
`forward_one_chunk`), and for a received gradient inside the B, its RECV action only posting the receive
(torch/distributed/pipelining/schedules.py `_PipelineScheduleRuntime._step_microbatches`); gloo's wait records no
event. pipesim's RECV row is that wait and its F or B the compute after it, so where the trace holds the op events
inside the range (a full trace; benchmarks/torch_pipelining.py keeps the first), an F or B with a RECV of its own is
read as the RECV from the range's start to its first op and the F or B from there.

dualpipev's overlapped pair is one `PP:(0F3;3B1)OVERLAP_F_B` range, in which torch runs the forward and then the
full backward (`_perform_action` on each sub-action), so it is split where the backward's first autograd node begins
(the forward's side ending with the last event before it), and each part is read as a range of its own.
"""

from __future__ import annotations

import bisect
import json
import math
import re
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

import numpy as np

from ..files import read_json
from ..schedules.ir import Kind
from ..schedules.torch_csv import parse_torch_actions
from ..traces.compare import TORCH_RUNTIME
from ..traces.trace import Ops, Stream, Trace, TraceError
from ..units import number_allowed

_SINGLE_STAGE = re.compile(r"(Forward|Backward) (\d+)")
_OPT = re.compile(r"PP:(\d+)OPT")
# the autograd engine's range around each node it runs: an overlapped pair's backward has begun at its first
_BACKWARD_NODE = "autograd::engine::evaluate_function"


def _named(name: str, rank: int) -> tuple[tuple[Kind, int, int], ...]:
    """The (kind, stage, micro-batch) of each action a range named `name` times on `rank` (none: no pipelining
    range, or one pipesim has no row for)."""
    if name.startswith("PP:"):
        opt = _OPT.fullmatch(name)
        return ((Kind.OPT, int(opt[1]), -1),) if opt else parse_torch_actions(name[3:])
    single = _SINGLE_STAGE.fullmatch(name)
    return ((Kind.F if single[1] == "Forward" else Kind.B, rank, int(single[2])),) if single else ()


def _end(event: dict) -> float:
    return float(event["ts"]) + float(event.get("dur", 0.0))


def _check_times(event: dict) -> None:
    """TraceError naming an event whose start (`ts`) or duration (`dur`, 0 if absent) is not a finite number of µs
    (a hand-edited or truncated file), which the reading would otherwise fail on with a traceback."""
    for field, value in (("ts", event.get("ts")), ("dur", event.get("dur", 0.0))):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise TraceError(f"event {event['name']!r}: {field}: give a finite number of µs (got {json.dumps(value)})")


def _first_inside(mine: list[dict], starts: list[float], start_us: float, end_us: float) -> dict | None:
    """The first of a thread's other events (`mine`, sorted by their `starts`) that starts inside [start, end]."""
    i = bisect.bisect_left(starts, start_us)
    return mine[i] if i < len(mine) and starts[i] <= end_us else None


def _read(events: list, rank: int) -> tuple[list[tuple[Kind, int, int, int, float, float, float]], list[dict]]:
    """The actions `events` (one rank's profiler events) time: (kind, stage, micro-batch, peer stage (-1: the
    kind's own), start µs, duration µs, µs from its start to the first other event inside it on its thread, 0 where
    none is); and the other events that reading used, which a pruned trace keeps.

    An overlapped pair's range (`(0F3;3B1)OVERLAP_F_B`) is read as its forward's range, up to the end of the last
    event on its thread that began before the backward's first autograd node, then its backward's range, whose
    first op is that node (on any thread: CUDA's backward runs on the device's autograd thread); each part names
    the other's stage as its peer, as the prediction's do. A pair's range without an autograd node inside it (a
    trace pruned before pairs were read) cannot be split, and is left out."""
    found, threads = [], {}
    for event in events:
        if not isinstance(event, dict) or event.get("ph") != "X" or not isinstance(event.get("name"), str):
            continue
        _check_times(event)
        actions = _named(event["name"], rank)
        if actions:
            found.append((actions, event))
        else:
            threads.setdefault(event.get("tid"), []).append(event)
    for mine in threads.values():
        mine.sort(key=lambda e: float(e["ts"]))
    starts = {tid: [float(e["ts"]) for e in mine] for tid, mine in threads.items()}
    nodes = sorted((e for mine in threads.values() for e in mine if e["name"].startswith(_BACKWARD_NODE)),
                   key=lambda e: float(e["ts"]))
    node_starts = [float(e["ts"]) for e in nodes]
    read, used = [], []

    def part(action: tuple[Kind, int, int], peer: int, start_us: float, end_us: float, first: dict | None) -> None:
        read.append((*action, peer, start_us, end_us - start_us, float(first["ts"]) - start_us if first else 0.0))
        used.extend([first] if first else [])

    for actions, event in found:
        start_us, end_us = float(event["ts"]), _end(event)
        mine, at = threads.get(event.get("tid"), []), starts.get(event.get("tid"), [])
        if len(actions) == 1:
            part(actions[0], -1, start_us, end_us, _first_inside(mine, at, start_us, end_us))
            continue
        node = _first_inside(nodes, node_starts, start_us, end_us)
        if node is None:
            continue
        before = mine[bisect.bisect_left(at, start_us):bisect.bisect_left(at, float(node["ts"]))]
        last = max(before, key=_end, default=None)
        split_us = min(_end(last), float(node["ts"])) if last else float(node["ts"])
        f_stage, b_stage = actions[0][1], actions[1][1]
        part(actions[0], b_stage, start_us, split_us, _first_inside(mine, at, start_us, split_us))
        part(actions[1], f_stage, split_us, end_us, node)
        used.extend([last] if last else [])
    return read, used


def _actions(path: Path, fallback_rank: int) -> tuple[int, list[tuple[Kind, int, int, int, float, float, float]]]:
    """The rank a profiler file belongs to (`distributedInfo`) and the actions it times (`_read`)."""
    doc = read_json(path, TraceError, "torch profiler trace")
    events = doc.get("traceEvents") if isinstance(doc, dict) else None
    if not isinstance(events, list):
        raise TraceError(f"{path}: not a Chrome trace (no traceEvents list)")
    info = doc.get("distributedInfo") or {}
    rank = info.get("rank", fallback_rank) if isinstance(info, dict) else None
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 0:
        raise TraceError(f"{path}: distributedInfo.rank: {number_allowed(0, None)} (got {json.dumps(rank)})")
    try:
        return rank, _read(events, rank)[0]
    except TraceError as exc:
        raise TraceError(f"{path}: {exc}") from None


def events_read(events: list) -> list[dict]:
    """What pipesim reads of one rank's profiler events, which a pruned trace keeps (benchmarks/torch_pipelining.py;
    the full trace records every aten op): the pipelining ranges, and the events `_read` uses inside them."""
    ranges = [e for e in events if isinstance(e, dict) and isinstance(e.get("name"), str)
              and (e["name"].startswith("PP:") or e["name"].split(" ")[0] in ("Forward", "Backward"))]
    return ranges + list({id(e): e for e in _read(events, 0)[1]}.values())


def profiler_actions(paths: Sequence[Path]) -> dict[int, list]:
    """Per rank, the actions its profiler file times (`_actions`), one file a rank; TraceError naming the file that is
    no torch.profiler trace, or the two of one rank."""
    if not paths:
        raise TraceError("no torch profiler traces given")
    per_rank: dict[int, list] = {}
    of_rank: dict[int, Path] = {}
    for i, path in enumerate(sorted(paths)):
        rank, found = _actions(Path(path), i)
        if rank in per_rank:
            raise TraceError(f"two profiler traces are of rank {rank} ({of_rank[rank]} and {path}): give one per rank")
        per_rank[rank], of_rank[rank] = found, Path(path)
    return per_rank


def read_torch_profile(paths: Sequence[Path], like: Trace) -> Trace:
    """The measured trace of the torch run whose profiler files are `paths` (one per rank), in the shape of
    the prediction `like` (its schedule, kinds and metadata), so `compare` can match the two op by op."""
    per_rank = profiler_actions(paths)
    ranks = sorted(per_rank)
    if ranks != list(range(like.num_devices)):
        raise TraceError(f"profiler traces of ranks {ranks}; the prediction has {like.num_devices} devices "
                         f"(ranks 0..{like.num_devices - 1})")
    if not any(per_rank.values()):
        raise TraceError("the profiler traces hold no pipelining actions (PP:<action>, or Forward i / Backward i "
                         "ranges): were they recorded around schedule.step()?")
    rows = []
    for rank in ranks:
        seen: dict[tuple[Kind, int, int], int] = {}
        mine: dict[tuple[Kind, int, int, int], list] = {}
        for kind, stage, microbatch, peer, start_us, dur_us, wait_us in sorted(per_rank[rank], key=lambda a: a[4]):
            minibatch = seen.get((kind, stage, microbatch), 0)
            seen[(kind, stage, microbatch)] = minibatch + 1
            peer = {Kind.SEND_F: stage + 1, Kind.RECV_F: stage - 1, Kind.SEND_B: stage - 1,
                    Kind.RECV_B: stage + 1}.get(kind, peer)  # torch runs chains
            mine[(kind, stage, microbatch, minibatch)] = [rank, like.kind_code(kind.value), stage, microbatch,
                                                          minibatch, peer, start_us, dur_us, wait_us]
        for (kind, *key), row in mine.items():
            received = mine.get(({Kind.F: Kind.RECV_F, Kind.B: Kind.RECV_B}.get(kind), *key))
            if received is not None and row[8] > 0:  # the wait before its first op is the RECV's
                received[6:8] = row[6], row[8]
                row[6:8] = row[6] + row[8], row[7] - row[8]
        rows += [row[:8] for row in mine.values()]
    if any(code < 0 for _, code, *_ in rows):
        raise TraceError("the torch run has actions the prediction does not (e.g. split backward I/W against a "
                         "full-backward schedule): predict the schedule torch ran")
    table = np.array(rows, dtype=np.float64)
    kind = table[:, 1].astype(np.int64)
    ops = Ops(device=table[:, 0], stream=Stream.of_kinds(like.kinds)[kind], kind=kind, stage=table[:, 2],
              microbatch=table[:, 3], minibatch=table[:, 4], pipeline=np.zeros(len(rows)), peer=table[:, 5],
              version=np.full(len(rows), -1), prediction=np.full(len(rows), -1),
              start_us=table[:, 6] - table[:, 6].min(), dur_us=table[:, 7])
    meta = replace(like.meta, source="measured", costs=None, cluster=None, jitter=0.0, calibration=None,
                   hardware={"runtime": TORCH_RUNTIME, "ranks": len(ranks)}, extra={})
    return Trace(like.kinds, like.num_devices, ops, meta)


_PASSES = ("F", "B", "I", "W")  # the actions whose order on a rank is the schedule's (torch records each)


def check_same_run(measured: Trace, like: Trace) -> None:
    """Raise TraceError where the torch run `measured` (`read_torch_profile`'s) is not the run `like` predicts: its
    micro-batches, its steps (the mini-batches profiled) and each rank's order of passes in its first step are read
    off the actions themselves. The measured trace takes the prediction's metadata, which the profiler records none
    of, so compare's own checks passed trivially: a GPipe prediction, or one of m = 4 over 8 steps, was held against
    a 1F1B run of m = 8 over 3 and printed an error."""
    def passes(trace: Trace) -> np.ndarray:
        codes = [trace.kinds.index(k) for k in _PASSES if k in trace.kinds]
        return np.isin(trace.ops.kind, codes)

    ran, predicted = passes(measured), passes(like)
    if not ran.any():
        raise TraceError("the profiler traces hold no forward or backward pass (PP:<action> ranges, or Forward i / "
                         "Backward i), only other actions: torch's Schedule1F1B records none; profile a schedule "
                         "that does (`benchmarks/torch_pipelining.py` without --torch-schedule, or gpipe)")
    rounds = like.meta.rounds
    if rounds > 1:  # each schedule.step reads as a mini-batch: the profile does not say which steps one update ends
        raise TraceError(f"the prediction runs each mini-batch in {rounds:,} rounds (--rounds), and a profiler trace "
                         "is read one schedule.step a mini-batch, whatever updates the run made between them: predict "
                         "its steps without --rounds, -m the micro-batches of one step")
    for name, count in (("microbatches", "micro-batches"), ("minibatches", "steps (mini-batches)")):
        column = "microbatch" if name == "microbatches" else "minibatch"
        got = int(getattr(measured.ops, column)[ran].max()) + 1
        want = getattr(like.meta, name)
        if got != want:
            flag = "-m" if name == "microbatches" else "-n"
            raise TraceError(f"the torch run is not the predicted one: it ran {got:,} {count}, the prediction "
                             f"{want:,}: predict with {flag} {got:,}")
    if np.count_nonzero(ran) != np.count_nonzero(predicted):
        return  # a pair whose parts the reader could not split is left out (its later ones each a step early): the
        # ops are counted missing, and the orders say nothing of the schedule
    for device in range(like.num_devices):
        orders = [_first_step_order(trace, mask, device) for trace, mask in ((measured, ran), (like, predicted))]
        if orders[0] != orders[1]:
            at = next((i for i, (a, b) in enumerate(zip(*orders)) if a != b), min(map(len, orders)))
            shown = [" ".join(order[max(at - 2, 0):at + 2]) or "nothing" for order in orders]
            raise TraceError(f"the torch run is not the predicted {like.meta.schedule}: rank {device}'s first step "
                             f"runs {shown[0]} at pass {at + 1}, the prediction {shown[1]}: predict the schedule "
                             "torch ran")


def _first_step_order(trace: Trace, passes: np.ndarray, device: int) -> list[str]:
    """Device `device`'s passes of mini-batch 0 in the order they started, each as `stage kind micro-batch`
    (`0F3`), as torch's actions write them."""
    ops = trace.ops
    rows = np.flatnonzero(passes & (ops.device == device) & (ops.minibatch == 0))
    rows = rows[np.argsort(ops.start_us[rows], kind="stable")]
    return [f"{ops.stage[i]}{trace.kinds[ops.kind[i]]}{ops.microbatch[i]}" for i in rows]
