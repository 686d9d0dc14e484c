"""The zero-bubble fork's own ZB-1p/ZB-2p orders (schedules/zb_heuristic.py): the port puts every op where the
fork's auto_schedule.py at 425b42e5 puts it, and ZB-2p's order holds what the fork's memory limit allows."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pipesim.schedules import ScheduleError
from pipesim.schedules.torch_csv import from_torch_csv
from pipesim.schedules.zb_heuristic import BOOTSTRAP_COSTS, ForkCosts, fork_csv, fork_orders

PAPER = Path(__file__).resolve().parents[1] / "benchmarks" / "zero_bubble_paper.json"

# Per stage, the F, B (pipesim's I) and W order the fork's own auto_schedule.py at 425b42e5 builds (run on the CPU,
# its GPU-only `populate_ancestors_using_gpu` left out, which the heuristic does not read): its __main__'s example
# (p 4, m 12, costs 5478, 5806, 3534 and 200, max_mem 32), and its bootstrap costs at p 4, m 8 under ZB-2p's limit.
FORK_EXAMPLE = """\
F0 F1 F2 F3 F4 F5 F6 F7 F8 F9 B0 F10 B1 F11 W0 W1 B2 W2 B3 W3 B4 W4 B5 W5 B6 W6 B7 W7 B8 W8 B9 W9 B10 W10 B11 W11
F0 F1 F2 F3 F4 F5 F6 B0 F7 B1 F8 B2 F9 B3 F10 B4 F11 B5 W0 B6 W1 B7 W2 W3 B8 W4 B9 W5 B10 W6 W7 B11 W8 W9 W10 W11
F0 F1 F2 F3 B0 F4 B1 F5 B2 F6 B3 F7 B4 F8 B5 F9 B6 F10 B7 F11 B8 W0 B9 W1 B10 W2 W3 B11 W4 W5 W6 W7 W8 W9 W10 W11
F0 B0 F1 B1 F2 B2 F3 B3 F4 B4 F5 B5 F6 B6 F7 B7 F8 B8 F9 B9 F10 B10 F11 B11 W0 W1 W2 W3 W4 W5 W6 W7 W8 W9 W10 W11"""
FORK_BOOTSTRAP = """\
F0 F1 F2 F3 F4 F5 F6 B0 F7 W0 B1 W1 B2 W2 B3 W3 B4 W4 B5 W5 B6 W6 B7 W7
F0 F1 F2 F3 F4 B0 F5 B1 F6 B2 F7 B3 W0 B4 W1 B5 W2 B6 W3 B7 W4 W5 W6 W7
F0 F1 F2 B0 F3 B1 F4 B2 F5 B3 F6 B4 F7 B5 W0 B6 W1 B7 W2 W3 W4 W5 W6 W7
F0 B0 F1 B1 F2 B2 F3 B3 F4 B4 F5 B5 F6 B6 F7 B7 W0 W1 W2 W3 W4 W5 W6 W7"""
# A limit of 3 micro-batches under p = 5 (fewer than 1F1B's warm-up holds), so W's run to make room for each F:
# the fork's `manual_order` as read at its 6229e79 (the stored copy; 425b42e5 is not stored), transcribed for this
# check only and run beside the port on 1,500 drawn shapes, limits and costs: the same orders.
FORK_TIGHT = """\
F0 F1 F2 B0 W0 F3 B1 W1 F4 B2 W2 F5 B3 W3 F6 B4 W4 B5 W5 B6 W6
F0 F1 B0 F2 W0 B1 F3 W1 B2 F4 W2 B3 F5 W3 B4 F6 W4 B5 W5 B6 W6
F0 B0 F1 W0 B1 F2 W1 B2 F3 W2 B3 F4 W3 B4 F5 W4 B5 F6 W5 B6 W6
F0 B0 W0 F1 B1 W1 F2 B2 W2 F3 B3 W3 F4 B4 W4 F5 B5 W5 F6 B6 W6
F0 B0 W0 F1 B1 W1 F2 B2 W2 F3 B3 W3 F4 B4 W4 F5 B5 W5 F6 B6 W6"""


def _as_fork_writes(orders: list[list[tuple[str, int]]]) -> str:
    return "\n".join(" ".join(f"{'B' if kind == 'I' else kind}{i}" for kind, i in ops) for ops in orders)


@pytest.mark.parametrize(("stages", "microbatches", "costs", "max_pending", "expected"), [
    (4, 12, ForkCosts(5478, 5806, 3534, 200), 16, FORK_EXAMPLE),
    (4, 8, BOOTSTRAP_COSTS, 8, FORK_BOOTSTRAP),
    (5, 7, ForkCosts(3000, 4500, 1200, 700), 3, FORK_TIGHT),
])
def test_the_port_orders_as_the_forks_scheduler_does(stages, microbatches, costs, max_pending, expected):
    assert _as_fork_writes(fork_orders(stages, microbatches, costs, max_pending)) == expected


def _held(ops: list[tuple[str, int]]) -> tuple[int, int]:
    """(most forwards in flight, most of the fork's memory units) a stage's order holds at once."""
    in_flight = pending = most_in_flight = most_units = 0
    for kind, _ in ops:
        in_flight += {"F": 1, "I": -1}.get(kind, 0)
        pending += {"I": 1, "W": -1}.get(kind, 0)
        most_in_flight = max(most_in_flight, in_flight)
        most_units = max(most_units, 2 * in_flight + pending)
    return most_in_flight, most_units


def test_zb_2p_holds_what_its_limit_of_2p_micro_batches_allows():
    """The paper's 1.5B at m = 24 (Table 9's costs): stage k holds 2(p - k) - 1 forwards in flight at most, as
    ZB-H2 does, but defers W's until the limit of 4p units (an F 2, its I and W 1 each) is reached, where ZB-H2
    defers 2k; ZB-1p's limit of p micro-batches keeps 1F1B's p - k forwards in flight."""
    row = next(r for r in json.loads(PAPER.read_text())["rows"] if (r["model"], r["m"]) == ("1.5B", 24))
    costs = ForkCosts.from_ms(row["fwd_ms"], row["igrad_ms"], row["wgrad_ms"], row["comm_ms"])
    p = row["p"]
    held = [_held(ops) for ops in fork_orders(p, 24, costs, 2 * p)]
    assert [in_flight for in_flight, _ in held] == [2 * (p - k) - 1 for k in range(p)]
    assert [units for _, units in held[:4]] == [4 * p] * 4
    held = [_held(ops) for ops in fork_orders(p, 24, costs, p)]
    assert [in_flight for in_flight, _ in held] == [p - k for k in range(p)]
    assert max(units for _, units in held) == 2 * p


def test_the_order_is_a_torch_schedule_csv_pipesim_runs():
    schedule = from_torch_csv(fork_csv(4, 8, BOOTSTRAP_COSTS, 8), "zb-2p")
    assert schedule.num_stages == 4 and schedule.microbatches == 8


@pytest.mark.parametrize(("stages", "microbatches", "max_pending"), [(1, 4, 2), (4, 0, 8), (4, 8, 0)])
def test_a_shape_the_scheduler_cannot_take_is_refused(stages, microbatches, max_pending):
    with pytest.raises(ScheduleError, match="needs at least 2 stages"):
        fork_orders(stages, microbatches, BOOTSTRAP_COSTS, max_pending)

