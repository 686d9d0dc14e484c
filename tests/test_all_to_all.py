"""Expert parallelism's all-to-alls as rows of the schedule (schedules/passes.py `add_expert_parallel`): an A2A_F
after every forward, an A2A_B after every backward that sends gradients back (B or I), an overlapped pair's after
both its parts; lowered so that the pass's outputs are sent after them and its device's next row waits for them;
run by the simulator on the device's network stream, priced from the costs (an estimate's, planning/experts.py)."""

from __future__ import annotations

from collections import Counter

import pytest

from pipesim.schedules import (
    Schedule,
    ScheduleError,
    ScheduleParams,
    build_schedule,
    lower,
    validate,
)
from pipesim.schedules.analysis import overlapped_pairs
from pipesim.schedules.torch_csv import to_torch_csv
from pipesim.sim.cluster import Cluster
from pipesim.sim.costs import Costs, StageCosts
from pipesim.sim.engine import simulate
from pipesim.traces.trace import Stream
from tests.conftest import pipesim, simulate_json
from tests.helpers import around_first, kind_stage_microbatch, stream_rows, without


def ep(method: str, stages: int = 2, microbatches: int = 2, chunks: int = 1) -> Schedule:
    return build_schedule(method, ScheduleParams(stages=stages, microbatches=microbatches, chunks=chunks,
                                                 expert_parallel=4))


def test_every_forward_and_backward_is_followed_by_its_all_to_alls():
    assert ep("1f1b").to_text() == ("0: 0F0 0A2A_F0 0F1 0A2A_F1 0B0 0A2A_B0 0B1 0A2A_B1 0OPT\n"
                                    "1: 1F0 1A2A_F0 1B0 1A2A_B0 1F1 1A2A_F1 1B1 1A2A_B1 1OPT")
    assert build_schedule("1f1b", ScheduleParams(stages=2, microbatches=2)).to_text() == \
        "0: 0F0 0F1 0B0 0B1 0OPT\n1: 1F0 1B0 1F1 1B1 1OPT"


def test_a_split_backward_routes_its_gradients_back_in_its_input_pass_not_its_weight_pass():
    order = ep("zb-h1").to_text().splitlines()[1].split()[1:]
    assert order[:4] == ["1F0", "1A2A_F0", "1I0", "1A2A_B0"] and "1A2A_B0" not in order[order.index("1W0"):]


def test_an_overlapped_pair_keeps_its_parts_together_and_runs_both_all_to_alls_after_them():
    tokens = ep("dualpipev", chunks=2, microbatches=4).to_text().split()
    pair = tokens.index("(0F3;3B1)OVERLAP_F_B")
    assert tokens[pair + 1:pair + 3] == ["0A2A_F3", "3A2A_B1"]


def test_a_missing_all_to_all_is_an_incomplete_schedule():
    with pytest.raises(ScheduleError, match=r"0A2A_F1 appears 0 times \(E = 4: 1 per forward\)"):
        validate(without(ep("1f1b"), "0A2A_F1"))


def test_a_forward_sends_its_output_after_its_all_to_alls_and_the_next_row_waits_for_them():
    lowered = lower(ep("1f1b"))
    # the send waits for the combine
    assert around_first(lowered, "A2A_F") == ([("F", 0, 0), ("A2A_F", 0, 0), ("SEND_F", 0, 0)], True)
    rows = kind_stage_microbatch(lowered)
    after_backward = rows.index(("A2A_B", 0, 0)) + 1
    assert rows[after_backward][0] == "RECV_B" and lowered.awaits[after_backward] == -1  # a receive waits for data
    assert lowered.awaits[after_backward + 1] == after_backward - 1  # the next compute row waits for the all-to-all


def test_the_simulator_runs_them_on_the_network_stream_between_the_passes():
    """One stage, one micro-batch: F 1 ms, its all-to-alls 0.5, B 2, its 0.25, back to back."""
    costs = Costs((StageCosts(fwd_ms=1.0, bwd_ms=2.0, all_to_all_fwd_ms=0.5, all_to_all_bwd_ms=0.25),))
    trace = simulate(ep("1f1b", stages=1, microbatches=1), costs, Cluster(1))
    assert stream_rows(trace)[:4] == [("F", Stream.COMPUTE, 0.0, 1.0), ("A2A_F", Stream.NETWORK, 1.0, 0.5),
                                      ("B", Stream.COMPUTE, 1.5, 2.0), ("A2A_B", Stream.NETWORK, 3.5, 0.25)]


def test_torch_has_no_all_to_all_cell_its_stages_run_them_inside():
    assert to_torch_csv(ep("1f1b")) == to_torch_csv(build_schedule("1f1b", ScheduleParams(stages=2, microbatches=2)))


def test_a_what_if_with_expert_parallelism_runs_the_estimated_all_to_alls_as_rows():
    args = ("--gpu", "h100-sxm", "--model", "gpt", "--layers", 4, "--width", 256, "--heads", 4, "--seq-len", 256,
            "--vocab", 1000, "--gated", "--experts", 8, "--stages", 2, "--data-parallel", 8, "-m", 4, "-s", "1f1b")
    whole, sharded = simulate_json(*args)[0], simulate_json(*args, "--expert-parallel", 8)[0]
    # the all-to-alls leave 6/8 of each copy on the NIC, exposed; the passes read only the rank's local experts
    assert sharded["exposed_comm_ms"] > whole["exposed_comm_ms"]
    assert sum(d["busy_ms"] for d in sharded["devices"]) < sum(d["busy_ms"] for d in whole["devices"])
    assert all(mine["peak_memory_mb"] < theirs["peak_memory_mb"]
               for mine, theirs in zip(sharded["devices"], whole["devices"]))


def test_an_overlapped_pair_hides_each_parts_all_to_alls_under_the_other_parts_compute():
    """DualPipe's point (DeepSeek-V3's report, 3.2.1): F 1 ms, B 2 ms; the forward's all-to-alls (0.5) vanish under
    the backward's compute, the backward's (1.5) leave 0.5 past the forward's. Unpaired passes' stay whole."""
    schedule = build_schedule("dualpipev", ScheduleParams(stages=2, chunks=2, microbatches=4, expert_parallel=4))
    costs = Costs((StageCosts(fwd_ms=1.0, bwd_ms=2.0, all_to_all_fwd_ms=0.5, all_to_all_bwd_ms=1.5),) * 4)
    trace = simulate(schedule, costs, Cluster(2))
    held = Counter((trace.kinds[k], d / 1e3) for k, d in zip(trace.ops.kind, trace.ops.dur_us)
                   if trace.kinds[k] in ("A2A_F", "A2A_B"))
    pairs = overlapped_pairs(schedule)
    assert pairs == 6
    assert held == {("A2A_F", 0.0): pairs, ("A2A_B", 0.5): pairs, ("A2A_F", 0.5): 16 - pairs,
                    ("A2A_B", 1.5): 16 - pairs}


def test_the_table_says_the_pairs_hide_the_all_to_alls():
    code, out, err = pipesim("simulate", "--gpu", "h100-sxm", "--model", "gpt", "--layers", 4, "--width", 256,
                             "--heads", 4, "--seq-len", 256, "--vocab", 1000, "--gated", "--experts", 8, "--stages",
                             2, "--data-parallel", 8, "--expert-parallel", 8, "-m", 4, "-s", "dualpipev")
    assert code == 0, err
    assert "each part's expert all-to-alls hidden under the other part's compute" in " ".join(out.split())


def test_a_cost_scale_scales_compute_not_the_all_to_alls():
    from pipesim.planning.scenario import scaled

    stage = StageCosts(fwd_ms=1.0, bwd_ms=2.0, all_to_all_fwd_ms=0.5, all_to_all_bwd_ms=0.25)
    (faster,) = scaled(Costs((stage,)), 0.5).stages
    assert (faster.fwd_ms, faster.bwd_ms, faster.all_to_all_fwd_ms, faster.all_to_all_bwd_ms) == (0.5, 1.0, 0.5, 0.25)
