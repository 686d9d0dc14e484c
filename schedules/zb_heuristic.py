"""The zero-bubble paper's own ZB-1p and ZB-2p orders: the greedy placement its fork's scheduler runs.

Qi et al., ICLR 2024, ran their Table 4 and 5 rows with sail-sg/zero-bubble-pipeline-parallelism at 425b42e5,
whose megatron/core/pipeline_parallel/auto_schedule.py builds the order (`Graph.manual_order`, tried under eight
variants by `initial_solution`, the one whose longest stage is shortest kept, the first on a tie; the ILP after it
runs only when `graph.nnodes < 0`, never). This module places ops by the same rules, written here in our own
terms: a stage puts its ops one after another on its own clock, an op ending its cost after both the stage is
free and its input has arrived (a transfer after the op that sends it).

Memory is counted in units: an F takes 2, its B (the input gradient, pipesim's I) gives 1 back and its W the
other (`GraphConfig`: mem_f 2, mem_b and mem_w -1), under a limit of 2 × --zero-bubble-max-pending-backward
(zb_schedules.py `update_schedule`), which the fork's examples/pretrain_zero_bubble.sh sets to 2p for ZB-2p (p for
ZB-1p, its ZeroBubble.md). So a stage holds up to 2p micro-batches in flight between F and B where pipesim's
handcrafted ZB-H2 holds 2(p - k) - 1, and defers as many W's as the units leave room for, where ZB-H2 defers 2k.

Its costs are integers: the medians over ranks of the profiled F, B and W times and the transfer time, in ms ×
1000, each at least 1 (`update_schedule`); before its profiling window ends the fork runs the order for
F = B = W = 1000 and a transfer of 1 (`update_schedule(scheduler, 1, 1, 1, 0)`).
"""

from __future__ import annotations

import csv
import io
import itertools
from dataclasses import dataclass, field

from ..units import degree_text
from .ir import ScheduleError

FORWARD, INPUT_GRAD, WEIGHT_GRAD = "F", "I", "W"  # torch's schedule CSV's letters; the fork calls the input gradient B
# memory units an F takes and its I and W give back (the fork's mem_f, mem_b, mem_w)
UNITS = {FORWARD: 2, INPUT_GRAD: -1, WEIGHT_GRAD: -1}


@dataclass(frozen=True)
class ForkCosts:
    """The scheduler's integer costs of one F, B (input gradient) and W and of one transfer: ms × 1000 (µs), at
    least 1, as the fork's `update_schedule` passes them; every time below is in this unit."""

    f: int
    b: int
    w: int
    comm: int

    @classmethod
    def from_ms(cls, f_ms: float, b_ms: float, w_ms: float, comm_ms: float) -> ForkCosts:
        return cls(*(max(int(ms * 1000), 1) for ms in (f_ms, b_ms, w_ms, comm_ms)))


BOOTSTRAP_COSTS = ForkCosts(1000, 1000, 1000, 1)  # the order the fork runs until its profiling window ends


@dataclass(frozen=True)
class _Variant:
    """The three choices `initial_solution` tries every combination of (`manual_order`'s keyword arguments)."""

    early_forwards_may_wait: bool  # allow_bubble_before_first_b: warm-up F's may end after micro-batch 0's B arrives
    hold_back_forwards: bool  # prioritize_b: a stage 2 or more F's ahead of the next may skip its F this round
    fill_short_waits: bool  # no_bubble_greedy: a wait no longer than the worst stage's extra idle time gets a W too


VARIANTS = tuple(_Variant(*choice) for choice in itertools.product((True, False), repeat=3))


@dataclass
class _Stage:
    """One stage's side of the placement: the ops it has put, in order, and what they leave it with."""

    free_us: int = 0  # when its last op ends
    units: int = 0  # memory units held
    idle_us: int = 0  # time it waited for inputs since its first F
    put: dict[str, int] = field(default_factory=lambda: dict.fromkeys(UNITS, 0))
    ops: list[tuple[str, int]] = field(default_factory=list)

    @property
    def deferred(self) -> int:
        """W's whose I has run."""
        return self.put[INPUT_GRAD] - self.put[WEIGHT_GRAD]


class _Placement:
    """The fork's greedy placement for one variant: stages put ops, each ending at max(stage free, input arrived)
    plus its cost; an input not put yet counts as arrived at the transfer's time alone (the fork's end times start
    at 0)."""

    def __init__(self, stages: int, microbatches: int, costs: ForkCosts, unit_limit: int, variant: _Variant):
        self.microbatches, self.costs, self.unit_limit, self.variant = microbatches, costs, unit_limit, variant
        self.cost = {FORWARD: costs.f, INPUT_GRAD: costs.b, WEIGHT_GRAD: costs.w}
        self.stages = [_Stage() for _ in range(stages)]
        self.end_us: dict[tuple[str, int, int], int] = {}  # (kind, stage, micro-batch) -> end time

    def arrival_us(self, kind: str, sender: int, microbatch: int) -> int:
        """When `sender`'s op of `kind` for `microbatch` reaches its neighbour."""
        return self.end_us.get((kind, sender, microbatch), 0) + self.costs.comm

    def place(self, k: int, kind: str) -> None:
        stage = self.stages[k]
        microbatch = stage.put[kind]
        if stage.units + UNITS[kind] > self.unit_limit:
            raise ScheduleError(f"the zero-bubble fork's scheduler overran its memory limit on stage {k}")
        start_us = stage.free_us
        if kind == FORWARD and k > 0:
            start_us = max(start_us, self.arrival_us(FORWARD, k - 1, microbatch))
        elif kind == INPUT_GRAD and k < len(self.stages) - 1:
            start_us = max(start_us, self.arrival_us(INPUT_GRAD, k + 1, microbatch))
        if stage.put[FORWARD]:
            stage.idle_us += start_us - stage.free_us
        stage.free_us = self.end_us[kind, k, microbatch] = start_us + self.cost[kind]
        stage.units += UNITS[kind]
        stage.put[kind] += 1
        stage.ops.append((kind, microbatch))

    def spare_idle_us(self, k: int) -> int:
        """How much more the most idle stage has waited than stage k."""
        return max(s.idle_us for s in self.stages) - self.stages[k].idle_us

    def fill_wait(self, k: int, until_us: int) -> None:
        """Deferred W's on stage k while it waits for an input arriving at `until`: all that end by then, and one
        that overruns it unless the wait left is short (within `spare_idle_us`) and the variant fills no short waits."""
        stage = self.stages[k]
        while stage.deferred and stage.free_us + self.costs.w <= until_us:
            self.place(k, WEIGHT_GRAD)
        wait_us = until_us - stage.free_us
        if stage.deferred and wait_us > 0 and (self.variant.fill_short_waits or wait_us > self.spare_idle_us(k)):
            self.place(k, WEIGHT_GRAD)

    def warm_up(self) -> None:
        """Micro-batch 0: each stage's first F, the extra F's each stage before the last fits while micro-batch 0's
        I travels back to it (fewer than the stage before it puts, while micro-batches remain), then the I's from
        the last stage back."""
        last = len(self.stages) - 1
        for k in range(last + 1):
            self.place(k, FORWARD)
        extra = [0] * (last + 1)
        input_ready_us = self.end_us[FORWARD, last, 0] + self.costs.b  # micro-batch 0's I on the last stage ends
        for k in range(last - 1, -1, -1):
            stage = self.stages[k]
            clock_us, units = stage.free_us, stage.units
            while stage.put[FORWARD] + extra[k] < self.microbatches and units + UNITS[FORWARD] <= self.unit_limit:
                arrives_us = input_ready_us + self.costs.comm
                overruns = (clock_us + self.costs.f > arrives_us if self.variant.early_forwards_may_wait
                            else clock_us >= arrives_us)
                if overruns:
                    break
                clock_us += self.costs.f
                units += UNITS[FORWARD]
                extra[k] += 1
            input_ready_us = max(clock_us, input_ready_us + self.costs.comm) + self.costs.b
        for k in range(1, last + 1):
            room = self.microbatches - self.stages[k].put[FORWARD]
            while 0 < extra[k] >= extra[k - 1] and extra[k] < room:
                extra[k] -= 1
        for k in range(last + 1):
            for _ in range(extra[k]):
                self.place(k, FORWARD)
        for k in range(last, -1, -1):
            self.place(k, INPUT_GRAD)

    def skips_forward(self, k: int) -> bool:
        """Whether stage k, 2 or more F's ahead of stage k + 1, leaves its F out this round (`hold_back_forwards`):
        stage k + 1's next F and I (and the transfer back) end by the time stage k is free, or its F (after the W's
        that make room for it) would end after them and the wait is short (within `spare_idle_us`)."""
        stage, after = self.stages[k], self.stages[k + 1]
        costs = self.costs
        next_input_us = after.free_us + costs.f + costs.b + costs.comm
        if stage.free_us >= next_input_us:
            return True
        room_w = min(max(stage.units + UNITS[FORWARD] - self.unit_limit, 0), stage.deferred)
        if stage.free_us + costs.f + room_w * costs.w <= next_input_us:
            return False
        return next_input_us - stage.free_us <= self.spare_idle_us(k)

    def steady(self, microbatch: int) -> None:
        """Micro-batch i > 0: which stages put their next F (none past a stage that does not), each after the W's
        that make room for it and fill its wait for its input, then micro-batch i's I from the last stage back, each
        after the W's that fill its wait (stage 0 puts all its deferred W's once its F's are done)."""
        last = len(self.stages) - 1
        forwards = []
        for k, stage in enumerate(self.stages):
            wants = stage.put[FORWARD] < self.microbatches
            if wants and k < last and self.variant.hold_back_forwards and \
                    stage.put[FORWARD] >= self.stages[k + 1].put[FORWARD] + 2:
                wants = not self.skips_forward(k)
            forwards.append(wants)
        for k in range(last - 1, -1, -1):
            forwards[k] = forwards[k] and forwards[k + 1]
        for k, stage in enumerate(self.stages):
            if not forwards[k]:
                continue
            while stage.units + UNITS[FORWARD] > self.unit_limit:
                if not stage.deferred:
                    raise ScheduleError(f"the zero-bubble fork's scheduler cannot fit stage {k}'s next forward in "
                                        f"its memory limit")
                self.place(k, WEIGHT_GRAD)
            if k > 0:
                self.fill_wait(k, self.arrival_us(FORWARD, k - 1, stage.put[FORWARD]))
            self.place(k, FORWARD)
        for k in range(last, -1, -1):
            stage = self.stages[k]
            if k < last:  # an I gives units back, so none waits for room
                self.fill_wait(k, self.arrival_us(INPUT_GRAD, k + 1, microbatch))
            if k == 0 and stage.put[FORWARD] == self.microbatches:
                while stage.deferred:
                    self.place(k, WEIGHT_GRAD)
            self.place(k, INPUT_GRAD)

    def run(self) -> _Placement:
        self.warm_up()
        for microbatch in range(1, self.microbatches):
            self.steady(microbatch)
        for k, stage in enumerate(self.stages):
            while stage.put[WEIGHT_GRAD] < self.microbatches:
                self.place(k, WEIGHT_GRAD)
        return self

    def longest_stage_us(self) -> int:
        """The time from a stage's first F's start to its last W's end, at the slowest stage (the fork's
        best_time)."""
        last = self.microbatches - 1
        return max(self.end_us[WEIGHT_GRAD, k, last] - self.end_us[FORWARD, k, 0] + self.costs.f
                   for k in range(len(self.stages)))


def fork_orders(stages: int, microbatches: int, costs: ForkCosts, max_pending: int) -> list[list[tuple[str, int]]]:
    """Each stage's (F, I or W, micro-batch) in the order the fork's scheduler puts them, for a memory limit of
    `max_pending` micro-batches (--zero-bubble-max-pending-backward: p for ZB-1p, 2p for ZB-2p)."""
    if stages < 2 or microbatches < 1 or max_pending < 1:
        raise ScheduleError(f"the zero-bubble fork's scheduler needs at least 2 stages, 1 micro-batch and a memory "
                            f"limit of at least 1 (got {degree_text('p', stages)}, {degree_text('m', microbatches)}, "
                            f"limit {max_pending:,})")
    placements = (_Placement(stages, microbatches, costs, 2 * max_pending, variant).run() for variant in VARIANTS)
    best = min(placements, key=_Placement.longest_stage_us)  # the first of the shortest, as initial_solution keeps
    return [stage.ops for stage in best.stages]


def fork_csv(stages: int, microbatches: int, costs: ForkCosts, max_pending: int) -> str:
    """`fork_orders` as torch's schedule CSV (one row per rank, stage k on rank k), which `pipesim simulate
    --schedule-file` runs."""
    buffer = io.StringIO()
    writer = csv.writer(buffer, lineterminator="\n")
    for k, ops in enumerate(fork_orders(stages, microbatches, costs, max_pending)):
        writer.writerow(f"{k}{kind}{i}" for kind, i in ops)
    return buffer.getvalue()
