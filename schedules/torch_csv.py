"""Interop with torch.distributed.pipelining's schedule CSV, so torch's schedules can be simulated and ours
can run under torch's `_PipelineScheduleRuntime` (`_load_csv`).

The format (torch's `_dump_csv` / `_load_csv`): one CSV row per rank, one cell per action in the rank's
order, an empty cell for an idle step. A compute cell is `[stage][F|B|I|W][micro-batch]`, e.g. `0F0,0F1,1B0`.
Lowered dumps also hold `SEND_F`, `RECV_F`, `SEND_B`, `RECV_B` (always naming a stage on the cell's own
rank), FSDP's `UNSHARD`/`RESHARD`, `REDUCE_GRAD`, and `(0F7;7B3)OVERLAP_F_B`, one cell that runs its
sub-actions overlapped (pipesim's overlapped pair).

A CSV is one training step of one synchronous pipeline (torch repeats it every `step()`), so only such
schedules export, built for one mini-batch. Text only: torch is never imported here.
"""

from __future__ import annotations

import csv
import io
import re

from .analysis import validate
from .ir import (
    COLLECTIVE_KINDS,
    OVERLAP_F_B,
    RECV_KINDS,
    SEND_KINDS,
    SYNCHRONOUS,
    Action,
    Kind,
    Read,
    Schedule,
    ScheduleError,
    StageGraph,
    is_pair,
    overlapped,
)

_COMPUTE = {"F": Kind.F, "B": Kind.B, "I": Kind.I, "W": Kind.W}
# Derived again by our SEND/RECV pass, or no-ops for one pipeline without data or FSDP sharding.
_IGNORED = ("SEND_F", "RECV_F", "SEND_B", "RECV_B", "UNSHARD", "RESHARD", "REDUCE_GRAD")
_CELL = re.compile(r"(\d+)(SEND_F|RECV_F|SEND_B|RECV_B|UNSHARD|RESHARD|REDUCE_GRAD|F|B|I|W)(\d*)")
_OVERLAP = re.compile(r"\((.*)\)" + OVERLAP_F_B)
_EXPECTED = ("expected [stage][F|B|I|W][micro-batch] such as 2F0, a transfer such as 0SEND_F3, "
             "UNSHARD, RESHARD, REDUCE_GRAD, (..;..)OVERLAP_F_B, or an empty cell")


def to_torch_csv(schedule: Schedule) -> str:
    """The F/B/I/W order of each device as torch's compute-only CSV, one row per device (= rank); an overlapped
    pair is one `(F;B)OVERLAP_F_B` cell, as torch writes it.

    OPT and explicit transfers are left out: torch's runtime steps the optimizer outside the schedule and
    derives its own SEND/RECV. So are REDUCE and GATHER (d > 1 data-parallel replicas): a torch stage wrapped in
    DDP synchronises its gradients outside the schedule too (its REDUCE_GRAD cell is FSDP's, which pipesim does
    not model, so none is written); the experts' all-to-alls (A2A_F, A2A_B), which a torch stage runs inside
    its forward and backward; and the context-parallel rings (RING_F, RING_B): torch's pipelining has no such
    action, its context parallel runs the ring inside the attention call (`_templated_ring_attention`). Raises
    ScheduleError for what torch's format cannot say.
    """
    name = schedule.method
    policy = schedule.policy
    if schedule.pipelines != 1:
        raise ScheduleError(f"{name}: a torch schedule CSV is one pipeline; this schedule has {schedule.pipelines}")
    if (policy.forward is not Read.LATEST or policy.backward is not Read.LATEST
            or policy.predict_forward or policy.predict_backward):
        raise ScheduleError(f"{name}: torch.distributed.pipelining runs synchronous schedules only (every op on "
                            f"the latest weights); {name}'s forwards read {policy.forward.value} weights, its "
                            f"backwards {policy.backward.value} ones" + (", with prediction" if policy.predict_forward
                                                                        or policy.predict_backward else ""))
    if schedule.minibatches != 1:
        raise ScheduleError(f"{name}: a torch schedule CSV is one training step (torch repeats it every step); "
                            f"build the schedule with one mini-batch (got {schedule.minibatches})")
    if schedule.graph != StageGraph.chain(schedule.num_stages):
        raise ScheduleError(f"{name}: torch's pipelining runs a chain of stages 0 -> 1 -> ... -> "
                            f"{schedule.num_stages - 1}; this stage graph has edges "
                            f"{', '.join(f'{a} -> {b}' for a, b in schedule.graph.edges)}")
    buffer = io.StringIO()
    writer = csv.writer(buffer, lineterminator="\n")
    for device, order in enumerate(schedule.orders):
        row: list[str] = []
        for i, a in enumerate(order):
            if a.kind.value in _COMPUTE and i and is_pair(order[i - 1], a):  # an overlapped pair: one cell
                row[-1] = f"({row[-1]};{a.stage}{a.kind.value}{a.microbatch}){OVERLAP_F_B}"
            elif a.kind.value in _COMPUTE:
                row.append(f"{a.stage}{a.kind.value}{a.microbatch}")
            elif a.kind not in COLLECTIVE_KINDS | {Kind.OPT} and a.kind not in SEND_KINDS | RECV_KINDS:
                raise ScheduleError(f"{name}: device {device} runs {a}; torch.distributed.pipelining runs synchronous "
                                    f"schedules only, of F, B, I and W (the optimizer steps outside), and has no "
                                    f"{a.kind.value}")
        writer.writerow(row)
    return buffer.getvalue()


def parse_torch_actions(text: str) -> tuple[tuple[Kind, int, int], ...]:
    """The (kind, stage, micro-batch) of each action one torch action name holds, as torch's runtime names its
    profiler ranges: one for `1F0`, `0SEND_F3` or `2B1`, an overlapped pair's forward and full backward for
    `(0F3;3B1)OVERLAP_F_B` (torch runs them one after the other inside the one range), none for one pipesim has no
    row for (UNSHARD, RESHARD, REDUCE_GRAD, an OVERLAP_F_B of other parts) or for text that is no action."""
    overlap = _OVERLAP.fullmatch(text.strip())
    if overlap is not None:
        parts = [parse_torch_actions(part) for part in overlap[1].split(";")]
        pair = tuple(action for found in parts for action in found)
        return pair if len(parts) == 2 and [kind for kind, *_ in pair] == [Kind.F, Kind.B] else ()
    match = _CELL.fullmatch(text.strip())
    if match is None or match[2] in ("UNSHARD", "RESHARD", "REDUCE_GRAD") or not match[3]:
        return ()
    return ((Kind(match[2]), int(match[1]), int(match[3])),)


def from_torch_csv(text: str, name: str, minibatches: int = 1) -> Schedule:
    """Read torch's schedule CSV (compute-only or lowered) into a validated synchronous Schedule of one step,
    repeated `minibatches` times as torch's runtime runs it every `step()` (each repeat after the last's OPT).

    Rows are ranks. The stages, micro-batches and placement are inferred from the cells (a stage runs on
    the one rank whose row names it); the stage graph is a chain, as in torch; each rank's list gets one OPT
    per stage it holds, at its end. Transfers, UNSHARD, RESHARD and REDUCE_GRAD are ignored; an OVERLAP_F_B
    cell of a forward and a full backward becomes one overlapped pair (`ir.overlapped`), of other sub-actions
    those in order, as torch's runtime runs them. Raises ScheduleError naming the row
    and cell of a bad or repeated action, the stages and micro-batches an incomplete schedule lacks, and,
    via `validate`, per device the first action that can never start.
    """
    if not text.strip():
        raise ScheduleError(f"{name}: empty schedule file: expected one CSV row of actions per rank, e.g. 0F0,0B0")
    reader = csv.reader(io.StringIO(text), strict=True)
    try:
        rows = list(reader)
    except csv.Error as exc:
        raise ScheduleError(f"{name}: line {reader.line_num}: not CSV: {exc}") from None
    while rows and not any(cell.strip() for cell in rows[-1]):  # blank lines at the end are not ranks
        rows.pop()

    compute: list[list[Action]] = [[] for _ in rows]
    rank_of: dict[int, tuple[int, str]] = {}  # stage -> (rank, where it was first seen)
    seen: dict[tuple[Kind, int, int], str] = {}
    named: list[tuple[int, str]] = []  # (stage, where) of every action, checked against the stage count
    top: tuple[int, str] = (-1, "")  # largest micro-batch index and where it is
    for rank, row in enumerate(rows):
        for column, raw in enumerate(row):
            cell = raw.strip()
            if not cell:
                continue
            shown = cell if len(cell) <= 40 else cell[:37] + "..."
            where = f"rank {rank} (row {rank + 1}), cell {column + 1} {shown!r}"
            overlap = _OVERLAP.fullmatch(cell)
            parts = overlap[1].split(";") if overlap else [cell]
            for part in map(str.strip, parts):
                match = _CELL.fullmatch(part)
                if match is None or (overlap and match[2] not in _COMPUTE):
                    raise ScheduleError(f"{name}: {where}: not a torch pipelining action; {_EXPECTED}")
                stage, kind, microbatch = int(match[1]), match[2], match[3]
                known = rank_of.setdefault(stage, (rank, where))
                if known[0] != rank:
                    raise ScheduleError(f"{name}: {where}: stage {stage} already runs on {known[1]}; "
                                        "a stage lives on one rank")
                named.append((stage, where))
                if kind in _IGNORED:
                    continue
                if not microbatch:
                    raise ScheduleError(f"{name}: {where}: {kind} names no micro-batch; {_EXPECTED}")
                key = (_COMPUTE[kind], stage, int(microbatch))
                if key in seen:
                    raise ScheduleError(f"{name}: {where}: repeats {seen[key]}")
                seen[key] = where
                if key[2] > top[0]:
                    top = (key[2], where)
                compute[rank].append(Action(*key))
            if overlap and len(parts) == 2 and [a.kind for a in compute[rank][-2:]] == [Kind.F, Kind.B]:
                try:
                    compute[rank][-2:] = overlapped(*compute[rank][-2:])
                except ScheduleError as exc:
                    raise ScheduleError(f"{name}: {where}: {exc}") from None

    if not seen:
        raise ScheduleError(f"{name}: no compute actions (F, B, I, W) in {len(rows)} rows")
    num_stages = max(stage for _, stage, _ in seen) + 1
    for stage, where in named:
        if stage >= num_stages:
            raise ScheduleError(f"{name}: {where}: stage {stage} has no compute action; "
                                f"compute actions name stages 0..{num_stages - 1}")
    microbatches = top[0] + 1
    # What each stage lacks, from the actions written: never a walk over every stage and micro-batch the indices
    # imply (a cell 0F99999999999999999999 made that endless); `_absent` finds the first few and counts the rest.
    written: dict[tuple[Kind, int], set[int]] = {}
    for kind, stage, j in seen:
        written.setdefault((kind, stage), set()).add(j)
    problems = {stage: f"stage {stage} appears on no rank" for stage in _absent(set(rank_of), num_stages, 6)[0]}
    for stage in rank_of:
        forwards, whole, inputs, weights = (written.get((kind, stage), set())
                                            for kind in (Kind.F, Kind.B, Kind.I, Kind.W))
        backward = (whole - inputs - weights) | (inputs & weights - whole)  # one B, or one I and one W
        no_forward, bad_backward = _absent(forwards, microbatches), _absent(backward, microbatches)
        lacks = ([f"F for micro-batches {_some(*no_forward)}"] if no_forward[1] else []) + (
            [f"one B, or one I and one W, for micro-batches {_some(*bad_backward)}"] if bad_backward[1] else [])
        if lacks:
            problems[stage] = f"stage {stage} (rank {rank_of[stage][0]}) lacks " + " and ".join(lacks)
    if problems:
        count = num_stages - len(rank_of) + len(problems) - len(set(problems) - set(rank_of))
        shown = "; ".join(problems[stage] for stage in sorted(problems)[:6]) + (
            f"; and {count - 6:,} more stages" if count > 6 else "")
        raise ScheduleError(f"{name}: incomplete schedule of {num_stages:,} stage{'s' * (num_stages != 1)} x "
                            f"{microbatches:,} micro-batch{'es' * (microbatches != 1)} (the largest micro-batch "
                            f"index, {top[0]:,}, is at {top[1]}): {shown}")

    placement = tuple(rank_of[stage][0] for stage in range(num_stages))
    idle = sorted(set(range(len(rows))) - set(placement))
    if idle:
        raise ScheduleError(f"{name}: rank {idle[0]} (row {idle[0] + 1}) runs no stage; every row is a rank, "
                            "and each must hold at least one stage's actions")
    steps = tuple(
        (*actions, *(Action(Kind.OPT, stage) for stage in range(num_stages) if placement[stage] == rank))
        for rank, actions in enumerate(compute)
    )
    orders = tuple(tuple(action._replace(minibatch=n) for n in range(minibatches) for action in step)
                   for step in steps)
    schedule = Schedule(
        method=name, graph=StageGraph.chain(num_stages), placement=placement, orders=orders,
        policy=SYNCHRONOUS, microbatches=microbatches, minibatches=minibatches,
        params={"format": "torch-csv", "ranks": len(rows), "stages": num_stages, "microbatches": microbatches},
    )
    validate(schedule)
    return schedule


def _absent(present: set[int], count: int, first: int = 4) -> tuple[list[int], int]:
    """Of 0..count-1, the `first` lowest not in `present`, and how many are not: the lowest lie within
    len(present) + first of 0, so the range is never walked whole."""
    return ([j for j in range(min(count, len(present) + first)) if j not in present][:first],
            count - sum(j < count for j in present))


def _some(head: list[int], count: int) -> str:
    """The numbers `head` of `count` (`_absent`'s), the rest as how many more."""
    return ", ".join(map(str, head)) + (f" and {count - len(head):,} more" if count > len(head) else "")
