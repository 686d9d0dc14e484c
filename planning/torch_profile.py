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
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

import numpy as np

from ..files import read_json
from ..schedules.ir import Kind
from ..schedules.torch_csv import parse_torch_action
from ..traces.compare import TORCH_RUNTIME
from ..traces.trace import Ops, Stream, Trace, TraceError

_SINGLE_STAGE = re.compile(r"(Forward|Backward) (\d+)")
_OPT = re.compile(r"PP:(\d+)OPT")


def _actions(path: Path, fallback_rank: int) -> tuple[int, list[tuple[Kind, int, int, float, float, float]]]:
    """The rank a profiler file belongs to and its actions: (kind, stage, micro-batch, start µs, duration µs, µs from
    its start to the first other event inside it, 0 where none is)."""
    doc = read_json(path, TraceError, "torch profiler trace")
    events = doc.get("traceEvents") if isinstance(doc, dict) else None
    if not isinstance(events, list):
        raise TraceError(f"{path}: not a Chrome trace (no traceEvents list)")
    info = doc.get("distributedInfo") or {}
    rank = int(info.get("rank", fallback_rank))
    found, threads, others = [], [], {}
    for event in events:
        if not isinstance(event, dict) or event.get("ph") != "X" or not isinstance(event.get("name"), str):
            continue
        name = event["name"]
        if name.startswith("PP:"):
            opt = _OPT.fullmatch(name)
            action = (Kind.OPT, int(opt[1]), -1) if opt else parse_torch_action(name[3:])
        else:
            single = _SINGLE_STAGE.fullmatch(name)
            action = (Kind.F if single[1] == "Forward" else Kind.B, rank, int(single[2])) if single else None
        if action is not None:
            found.append((*action, float(event["ts"]), float(event.get("dur", 0.0))))
            threads.append(event.get("tid"))
        else:
            others.setdefault(event.get("tid"), []).append(float(event["ts"]))
    starts = {tid: np.sort(np.array(ts, dtype=np.float64)) for tid, ts in others.items()}
    return rank, [(*a, _first_after(starts.get(tid), a[3], a[4])) for a, tid in zip(found, threads)]


def _first_after(starts: np.ndarray | None, start_us: float, dur_us: float) -> float:
    """µs from `start_us` to the first of its thread's other events (sorted `starts`) inside the range; 0: none."""
    i = np.searchsorted(starts, start_us) if starts is not None else 0
    return float(starts[i] - start_us) if starts is not None and i < len(starts) and starts[i] <= start_us + dur_us \
        else 0.0


def read_torch_profile(paths: Sequence[Path], like: Trace) -> Trace:
    """The measured trace of the torch run whose profiler files are `paths` (one per rank), in the shape of
    the prediction `like` (its schedule, kinds and metadata), so `compare` can match the two op by op."""
    if not paths:
        raise TraceError("no torch profiler traces given")
    per_rank: dict[int, list] = {}
    for i, path in enumerate(sorted(paths)):
        rank, found = _actions(Path(path), i)
        if rank in per_rank:
            raise TraceError(f"two profiler traces are of rank {rank} ({path} and another): give one per rank")
        per_rank[rank] = found
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
        for kind, stage, microbatch, start_us, dur_us, wait_us in sorted(per_rank[rank], key=lambda a: a[3]):
            minibatch = seen.get((kind, stage, microbatch), 0)
            seen[(kind, stage, microbatch)] = minibatch + 1
            peer = {Kind.SEND_F: stage + 1, Kind.RECV_F: stage - 1, Kind.SEND_B: stage - 1,
                    Kind.RECV_B: stage + 1}.get(kind, -1)  # torch runs chains
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
