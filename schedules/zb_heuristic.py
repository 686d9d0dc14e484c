"""The zero-bubble paper's own ZB-1p and ZB-2p orders: the heuristic scheduler its fork ran.

Qi et al., ICLR 2024, ran their Table 4 and 5 rows with sail-sg/zero-bubble-pipeline-parallelism at 425b42e5,
whose megatron/core/pipeline_parallel/auto_schedule.py builds the order: `Graph.manual_order` under its eight
variants (`initial_solution`), the one whose longest stage is shortest kept, the first tried on a tie (the ILP
after it is disabled there: `auto_schedule` runs it only when `graph.nnodes < 0`). Its memory is counted in units:
an F takes 2, its B (the input gradient, pipesim's I) gives 1 back and its W the other (`GraphConfig`: mem_f 2,
mem_b and mem_w -1), under a limit of 2 × --zero-bubble-max-pending-backward (zb_schedules.py
`update_schedule`), which the fork's examples/pretrain_zero_bubble.sh sets to 2p for ZB-2p (p for ZB-1p, its
ZeroBubble.md). So a stage holds up to 2p micro-batches in flight between F and B where pipesim's handcrafted
ZB-H2 holds 2(p - k) - 1, and defers as many W's as the units leave room for, where ZB-H2 defers 2k.

Its costs are integers: the medians over ranks of the profiled F, B and W times and the transfer time, in ms ×
1000, each at least 1 (`update_schedule`); before its profiling window ends the fork runs the order for
F = B = W = 1000 and a transfer of 1 (`update_schedule(scheduler, 1, 1, 1, 0)`).
"""

from __future__ import annotations

import csv
import io
from collections import defaultdict
from dataclasses import dataclass

from .ir import ScheduleError

_F, _B, _W = range(3)  # the fork's node types; its B is pipesim's I
_CELL_KIND = "FIW"  # as torch's schedule CSV names them
_MEMORY = (2, -1, -1)  # units an F takes and its B and W give back (GraphConfig's mem_f, mem_b, mem_w)
# manual_order's variants as initial_solution tries them: (allow_bubble_before_first_b, prioritize_b,
# no_bubble_greedy)
_VARIANTS = tuple((allow, prioritize, greedy) for allow in (True, False) for prioritize in (True, False)
                  for greedy in (True, False))


@dataclass(frozen=True)
class ForkCosts:
    """The scheduler's integer costs of one F, B (input gradient) and W and of one transfer: ms × 1000, at least 1,
    as the fork's `update_schedule` passes them."""

    f: int
    b: int
    w: int
    comm: int

    @classmethod
    def from_ms(cls, f_ms: float, b_ms: float, w_ms: float, comm_ms: float) -> ForkCosts:
        return cls(*(max(int(ms * 1000), 1) for ms in (f_ms, b_ms, w_ms, comm_ms)))


BOOTSTRAP_COSTS = ForkCosts(1000, 1000, 1000, 1)  # the order the fork runs until its profiling window ends


class _Order:
    """One run of `Graph.manual_order`: each stage's ops in the order they are put, with the fork's clocks."""

    def __init__(self, stages: int, microbatches: int, costs: ForkCosts, max_mem: int) -> None:
        self.p, self.m, self.max_mem = stages, microbatches, max_mem
        self.cost = (costs.f, costs.b, costs.w)
        self.comm = costs.comm
        self.done = [[0] * stages for _ in range(3)]  # per type, per stage: how many are put
        self.end_of = [0] * stages  # e: when each stage's last op ends
        self.memory = [0] * stages  # m: units held
        self.bubble = [0] * stages  # stage_bubble: idle time after the stage's first F
        # (type, stage, micro-batch) -> completion time; 0 for one not put yet, as the fork's list starts
        self.ends: defaultdict[tuple[int, int, int], int] = defaultdict(int)
        self.ops: list[list[tuple[int, int]]] = [[] for _ in range(stages)]

    def put(self, stage: int, kind: int) -> None:
        i = self.done[kind][stage]
        if self.memory[stage] + _MEMORY[kind] > self.max_mem:
            raise ScheduleError(f"the zero-bubble fork's scheduler overran its memory limit on stage {stage}")
        cost = self.cost[kind]
        end = no_bubble = self.end_of[stage] + cost
        if stage > 0 and kind == _F:
            end = max(end, self.ends[_F, stage - 1, i] + self.comm + cost)
        if stage < self.p - 1 and kind == _B:
            end = max(end, self.ends[_B, stage + 1, i] + self.comm + cost)
        if self.done[_F][stage] > 0:
            self.bubble[stage] += end - no_bubble
        self.end_of[stage] = self.ends[kind, stage, i] = end
        self.memory[stage] += _MEMORY[kind]
        self.done[kind][stage] += 1
        self.ops[stage].append((kind, i))

    def fill_with_w(self, stage: int, until: int, greedy: bool) -> None:
        """The W's the fork puts on `stage` while it waits for an input that arrives at `until`: those that end
        by then, and one more where the wait is no longer than the worst stage's bubble less this one's (if
        `greedy`) or longer than that."""
        while self.done[_W][stage] < self.done[_B][stage] and self.end_of[stage] + self.cost[_W] <= until:
            self.put(stage, _W)
        if self.done[_W][stage] < self.done[_B][stage] and self.end_of[stage] < until:
            if until - self.end_of[stage] > max(self.bubble) - self.bubble[stage] or greedy:
                self.put(stage, _W)

    def first_microbatch(self, allow_bubble_before_first_b: bool) -> None:
        """manual_order's i = 0: every stage's first F, then the F's each stage fits before micro-batch 0's B
        reaches it, no more than the stage before puts, then the B's from the last stage back."""
        p, m = self.p, self.m
        cost_f, cost_b = self.cost[_F], self.cost[_B]
        for stage in range(p):
            self.put(stage, _F)
        required = [0] * p
        last = 0
        for stage in range(p - 1, -1, -1):
            if stage == p - 1:
                last = self.ends[_F, stage, 0] + cost_b
                continue
            memory, clock = self.memory[stage], self.end_of[stage]
            while self.done[_F][stage] + required[stage] < m and memory + _MEMORY[_F] <= self.max_mem:
                if (clock + cost_f > last + self.comm if allow_bubble_before_first_b
                        else clock >= last + self.comm):
                    break
                memory += _MEMORY[_F]
                clock += cost_f
                required[stage] += 1
            last = max(clock, last + self.comm) + cost_b
        for stage in range(1, p):
            while (0 < required[stage] and required[stage] >= required[stage - 1]
                   and self.done[_F][stage] + required[stage] < m):
                required[stage] -= 1
        for stage in range(p - 1, -1, -1):
            for _ in range(required[stage]):
                self.put(stage, _F)
            self.put(stage, _B)

    def next_microbatch(self, i: int, prioritize_b: bool, greedy: bool) -> None:
        """manual_order's i > 0: which stages put their next F (none past a stage that does not), the W's that
        make room for it or fill the wait for its input, then micro-batch i's B from the last stage back."""
        p, m = self.p, self.m
        cost_f, cost_b, cost_w = self.cost
        f, b, w = self.done
        required = [0] * p
        for stage in range(p):
            if f[stage] >= m:
                continue
            if stage + 1 < p and f[stage] >= f[stage + 1] + 2 and prioritize_b:
                next_plus_fw = self.end_of[stage + 1] + cost_f + cost_b + self.comm
                if self.end_of[stage] >= next_plus_fw:
                    continue
                w_cost, w_count, memory = 0, 0, self.memory[stage] + _MEMORY[_F]
                while memory > self.max_mem and w[stage] + w_count < b[stage]:
                    w_cost += cost_w
                    memory += _MEMORY[_W]
                    w_count += 1
                if self.end_of[stage] + cost_f + w_cost <= next_plus_fw:
                    required[stage] = 1
                    continue
                if next_plus_fw - self.end_of[stage] <= max(self.bubble) - self.bubble[stage]:
                    continue
            required[stage] = 1
        for stage in range(p - 2, -1, -1):
            required[stage] = min(required[stage], required[stage + 1])
        for stage in range(p):
            if not required[stage]:
                continue
            while self.memory[stage] + _MEMORY[_F] > self.max_mem:
                if w[stage] >= b[stage]:
                    raise ScheduleError(f"the zero-bubble fork's scheduler cannot fit stage {stage}'s next forward "
                                        f"in its memory limit")
                self.put(stage, _W)
            if stage > 0:
                self.fill_with_w(stage, self.ends[_F, stage - 1, f[stage]] + self.comm, greedy)
            self.put(stage, _F)
        for stage in range(p - 1, -1, -1):
            if stage + 1 < p:  # a B gives memory back, so none waits for room
                self.fill_with_w(stage, self.ends[_B, stage + 1, i] + self.comm, greedy)
            if stage == 0 and f[stage] == m:
                while w[stage] < b[stage]:
                    self.put(stage, _W)
            self.put(stage, _B)

    def longest_stage(self) -> int:
        """The time from a stage's first F's start to its last W's end, at the slowest stage (best_time)."""
        return max(self.ends[_W, k, self.m - 1] - self.ends[_F, k, 0] + self.cost[_F] for k in range(self.p))


def _manual_order(stages: int, microbatches: int, costs: ForkCosts, max_mem: int,
                  variant: tuple[bool, bool, bool]) -> _Order:
    allow_bubble_before_first_b, prioritize_b, greedy = variant
    order = _Order(stages, microbatches, costs, max_mem)
    order.first_microbatch(allow_bubble_before_first_b)
    for i in range(1, microbatches):
        order.next_microbatch(i, prioritize_b, greedy)
    for stage in range(stages):
        while order.done[_W][stage] < microbatches:
            order.put(stage, _W)
    return order


def fork_orders(stages: int, microbatches: int, costs: ForkCosts, max_pending: int) -> list[list[tuple[str, int]]]:
    """Each stage's (F, I or W, micro-batch) in the order the fork's scheduler puts them, for a memory limit of
    `max_pending` micro-batches (--zero-bubble-max-pending-backward: p for ZB-1p, 2p for ZB-2p)."""
    if stages < 2 or microbatches < 1 or max_pending < 1:
        raise ScheduleError(f"the zero-bubble fork's scheduler needs at least 2 stages, 1 micro-batch and a memory "
                            f"limit of at least 1 (got p={stages}, m={microbatches}, limit {max_pending})")
    best: _Order | None = None
    for variant in _VARIANTS:
        order = _manual_order(stages, microbatches, costs, 2 * max_pending, variant)
        if best is None or order.longest_stage() < best.longest_stage():
            best = order
    return [[(_CELL_KIND[kind], i) for kind, i in ops] for ops in best.ops]


def fork_csv(stages: int, microbatches: int, costs: ForkCosts, max_pending: int) -> str:
    """`fork_orders` as torch's schedule CSV (one row per rank, stage k on rank k), which `pipesim simulate
    --schedule-file` runs."""
    buffer = io.StringIO()
    writer = csv.writer(buffer, lineterminator="\n")
    for stage, ops in enumerate(fork_orders(stages, microbatches, costs, max_pending)):
        writer.writerow(f"{stage}{kind}{i}" for kind, i in ops)
    return buffer.getvalue()
