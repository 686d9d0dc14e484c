"""Megatron-core's expert-parallel overlap as an IR pass (schedules/passes.py `overlap_expert_communication`,
`--overlap-expert-comm`): one more warm-up forward than 1F1B's, then each steady-state forward paired with the
backward after it into an overlapped F&B pair, whose all-to-alls the simulator hides under the other part's compute
and the executor runs part after part on CPU."""

from __future__ import annotations

import csv
import itertools
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch

from pipesim.executor import run_multiprocess
from pipesim.schedules import ScheduleError, ScheduleParams, build_schedule
from pipesim.schedules.analysis import overlapped_pairs
from pipesim.sim.cluster import Cluster, Link
from pipesim.sim.costs import Costs, StageCosts
from pipesim.sim.engine import simulate
from pipesim.traces.metrics import summarize
from tests.conftest import build, pipesim, simulate_json
from tests.helpers import TIGHT, ep_spec, pair_parts
from tests.reference import single_process

REPO = Path(__file__).resolve().parents[1]


def overlapped(method: str, stages: int, microbatches: int, chunks: int = 1, minibatches: int = 1,
               overlap: bool = True):
    return build_schedule(method, ScheduleParams(stages=stages, microbatches=microbatches, chunks=chunks,
                                                 minibatches=minibatches, expert_parallel=2,
                                                 overlap_expert_comm=overlap))


def passes(schedule) -> list[str]:
    """Each device's F, B and OPT tokens, the all-to-all rows left out."""
    return [" ".join(token for token in line.split()[1:] if "A2A" not in token)
            for line in schedule.to_text().splitlines()]


def test_interleaved_pairs_are_megatrons_written_out_by_hand():
    """p = 2, v = 2, m = 4. Megatron-core's interleaved order (schedules.py `get_schedule_table`): forwards 0F0 0F1
    2F0 2F1 0F2 0F3 2F2 2F3 on device 0, backwards mirrored (2B0 2B1 0B0 0B1 ...); warm-up (p-k-1)·2 + (v-1)·p, plus
    one with the overlap (`get_pp_rank_microbatches`): 5 on device 0, 3 on device 1; then forward k + warm-up with
    backward k, then the cool-down."""
    assert passes(overlapped("interleaved-1f1b", 2, 4, chunks=2)) == [
        "0F0 0F1 2F0 2F1 0F2 (0F3;2B0)OVERLAP_F_B (2F2;2B1)OVERLAP_F_B (2F3;0B0)OVERLAP_F_B 0B1 2B2 2B3 0B2 0B3 0OPT "
        "2OPT",
        "1F0 1F1 3F0 (3F1;3B0)OVERLAP_F_B (1F2;3B1)OVERLAP_F_B (1F3;1B0)OVERLAP_F_B (3F2;1B1)OVERLAP_F_B "
        "(3F3;3B2)OVERLAP_F_B 3B3 1B2 1B3 1OPT 3OPT"]


def test_with_no_pipeline_each_forward_runs_with_the_previous_backward():
    """combined_1f1b_schedule_for_no_pipelining: the first forward alone, each next one with the backward before
    it, the last backward alone; every mini-batch alike."""
    assert passes(overlapped("1f1b", 1, 4, minibatches=2)) == [
        "0F0 (0F1;0B0)OVERLAP_F_B (0F2;0B1)OVERLAP_F_B (0F3;0B2)OVERLAP_F_B 0B3 0OPT "
        "0F0.1 (0F1.1;0B0.1)OVERLAP_F_B (0F2.1;0B1.1)OVERLAP_F_B (0F3.1;0B2.1)OVERLAP_F_B 0B3.1 0OPT.1"]


@pytest.mark.parametrize("stages, chunks, microbatches", [(2, 2, 4), (4, 2, 8), (4, 3, 4), (2, 4, 2), (4, 2, 16)])
def test_the_warm_up_is_megatrons_plus_one_and_every_later_forward_is_paired(stages, chunks, microbatches):
    schedule = overlapped("interleaved-1f1b", stages, microbatches, chunks)
    total = microbatches * chunks
    for k, order in enumerate(passes(schedule)):
        tokens = order.split()
        warmup = min((stages - k - 1) * 2 + (chunks - 1) * stages + 1, total)
        assert all("F" in token and "(" not in token for token in tokens[:warmup])
        assert sum(token.startswith("(") for token in tokens) == total - warmup
    assert overlapped_pairs(schedule) == sum(max(total - (stages - k - 1) * 2 - (chunks - 1) * stages - 1, 0)
                                             for k in range(stages))


@pytest.mark.parametrize("method, stages, chunks, experts, fragment", [
    ("gpipe", 2, 1, 2, "only in 1f1b and interleaved-1f1b's order; leave out --overlap-expert-comm"),
    ("zb-h1", 2, 1, 2, "only in 1f1b and interleaved-1f1b's order"),
    # DualPipe's pairs hide them already: the line said it could not overlap them
    ("dualpipe", 2, 2, 2, "^dualpipe: its F&B pairs already hide each part's expert-parallel all-to-alls under the "
                          "other's compute, as --overlap-expert-comm pairs interleaved-1f1b's F and B, and 1f1b's "
                          "on one stage"),
    ("dualpipev", 2, 2, 2, "^dualpipev: its F&B pairs already hide"),
    ("1f1b", 2, 1, 2, "only with virtual stages: use interleaved-1f1b with --chunks 2 or more, or --stages 1"),
    ("interleaved-1f1b", 2, 1, 2, "only with virtual stages"),
    ("1f1b", 1, 1, 1, "with E = 1 there are none: give --expert-parallel 2 or more"),
])
def test_orders_megatron_does_not_pair_are_refused(method, stages, chunks, experts, fragment):
    with pytest.raises(ScheduleError, match=fragment):
        build_schedule(method, ScheduleParams(stages=stages, microbatches=4, chunks=chunks, expert_parallel=experts,
                                              overlap_expert_comm=True))


def test_an_overlap_that_pairs_nothing_is_refused():
    """1F1B on one stage at m = 1 runs its forward in the warm-up and its backward alone: no pair, so the overlap
    changed nothing and was taken silently. At m = 2 one pair forms."""
    with pytest.raises(ScheduleError, match="^1f1b: --overlap-expert-comm pairs a steady-state forward with the "
                                            "backward run next, and at m = 1 every forward runs in the warm-up"):
        build_schedule("1f1b", ScheduleParams(stages=1, microbatches=1, expert_parallel=2, overlap_expert_comm=True))
    paired = build_schedule("1f1b", ScheduleParams(stages=1, microbatches=2, expert_parallel=2,
                                                   overlap_expert_comm=True))
    assert (paired.table.peer >= 0).sum() == 2 * paired.minibatches  # a forward and a backward each mini-batch


def step_ms(method: str, stages: int, chunks: int, microbatches: int, overlap: bool, costs: StageCosts,
            latency_ms: float = 0.0) -> float:
    schedule = overlapped(method, stages, microbatches, chunks, minibatches=2, overlap=overlap)
    trace = simulate(schedule, Costs((costs,) * (stages * chunks)),
                     Cluster(stages, default_link=Link(latency_ms=latency_ms)))
    return summarize(trace).time_per_minibatch_ms


SHAPES = [("1f1b", 1, 1, 4), ("interleaved-1f1b", 2, 2, 4), ("interleaved-1f1b", 4, 2, 8),
          ("interleaved-1f1b", 2, 3, 6)]


@pytest.mark.parametrize("method, stages, chunks, microbatches", SHAPES)
def test_a_step_is_never_slower_with_the_overlap_and_the_same_with_free_all_to_alls(method, stages, chunks,
                                                                                    microbatches):
    """Transfers between stages free: each pair takes its parts' compute, less of its all-to-alls than they took
    alone; with no all-to-all time there is nothing to hide and the step is the same."""
    for fwd, bwd, a2a_fwd, a2a_bwd in itertools.product((1.0, 0.4), (2.0, 0.9), (0.0, 0.3, 1.5), (0.0, 0.5, 3.0)):
        costs = StageCosts(fwd_ms=fwd, bwd_ms=bwd, all_to_all_fwd_ms=a2a_fwd, all_to_all_bwd_ms=a2a_bwd)
        alone, paired = (step_ms(method, stages, chunks, microbatches, overlap, costs) for overlap in (False, True))
        if a2a_fwd == a2a_bwd == 0:
            assert paired == pytest.approx(alone, abs=1e-9)
        else:
            assert paired <= alone + 1e-9


def test_a_pair_sends_its_forwards_output_after_both_parts_so_slow_links_can_cost_more_than_it_hides():
    """The exact relation where transfers take time: a pair's outputs leave once both its parts are done (the
    combined step runs the two layer by layer), so the next stage's forward waits a backward longer."""
    costs = StageCosts(fwd_ms=1.0, bwd_ms=2.0, all_to_all_fwd_ms=0.1, all_to_all_bwd_ms=0.1)
    assert step_ms("interleaved-1f1b", 4, 2, 8, True, costs, 2.0) > step_ms("interleaved-1f1b", 4, 2, 8, False,
                                                                             costs, 2.0)


def test_the_cli_refuses_the_overlap_without_expert_parallelism_in_one_line(tmp_path):
    out = tmp_path / "t.json"
    result = pipesim("simulate", "-s", "1f1b", "-p", "1", "-m", "4", "--fwd", "1", "--bwd", "2",
                     "--overlap-expert-comm", "--trace", str(out))
    assert result.code == 2 and "E = 1" in result.err and len(result.err.strip().splitlines()) == 1
    assert not out.exists()


QWEN3_30B = ("--model", "hf:examples/qwen3-30b-a3b", "--gpu", "h100-sxm", "--seq-len", "4096", "--attention", "flash",
             "-s", "interleaved-1f1b", "--chunks", "2", "-p", "2", "-m", "8", "--data-parallel", "8",
             "--expert-parallel", "8")


def test_simulate_and_sweep_run_the_pairs_the_flag_asks_for(monkeypatch, tmp_path):
    """A what-if MoE (E = 8 over 2 nodes' replicas): the step with the overlap is shorter, and says its pairs."""
    monkeypatch.chdir(REPO)  # the config is named from the repository root
    (alone,), (paired,) = simulate_json(*QWEN3_30B), simulate_json(*QWEN3_30B, "--overlap-expert-comm")
    assert (alone["overlapped_pairs"], paired["overlapped_pairs"]) == (0, 2 * (2 * 16 - 5 - 3))  # N = 2
    assert paired["time_per_minibatch_ms"] < alone["time_per_minibatch_ms"]
    swept = []
    for name, flags in (("alone", ()), ("paired", ("--overlap-expert-comm",))):
        out = tmp_path / f"{name}.csv"
        assert pipesim("sweep", *QWEN3_30B, *flags, "-o", out).code == 0
        (row,) = csv.DictReader(out.open())
        swept.append(float(row["time_per_minibatch_ms"]))
    assert swept[1] < swept[0]


def test_a_schedule_file_runs_as_written_so_the_flag_is_refused_beside_it(tmp_path):
    csv_file = tmp_path / "order.csv"
    csv_file.write_text("0F0,0B0\n")
    code, _, err = pipesim("simulate", "--schedule-file", csv_file, "--overlap-expert-comm")
    assert code == 2 and "schedule file runs its order as written" in err and len(err.strip().splitlines()) == 1


def test_run_refuses_an_order_megatron_does_not_pair_in_one_line():
    code, out, err = pipesim("run", "--model", "gpt", "--experts", "4", "-s", "1f1b", "-p", "2", "-m", "4",
                             "--data-parallel", "2", "--expert-parallel", "2", "--overlap-expert-comm")
    assert code == 2 and "only with virtual stages" in err and len(err.strip().splitlines()) == 1


@pytest.mark.slow
def test_an_overlapped_1f1b_on_two_gloo_ranks_trains_as_one_process():
    """p = 1, E = 2 over d = 2 replicas: Megatron-core's combined 1F1B with no pipeline, each pair run part after
    part, ends with one process's weights and losses on the whole mini-batch."""
    plain = ep_spec("1f1b", 4, "sgd", stages=1)
    spec = replace(plain, schedule=build("1f1b", 1, 4, 2, data_parallel=2, expert_parallel=2,
                                         overlap_expert_comm=True))
    assert overlapped_pairs(spec.schedule) == 2 * 3
    result = run_multiprocess(spec, timeout_s=120)
    assert result.trace.meta.hardware["ranks"] == 2
    forward, backward = pair_parts(result.trace)  # each replica's pairs run, part after part
    assert len(forward) == len(backward) == 2 * overlapped_pairs(spec.schedule) and (forward + 1 == backward).all()
    losses: list[float] = []
    want = single_process(replace(spec, schedule=build("gpipe", 2, 2 * 4, 2)), losses)
    np.testing.assert_allclose(result.losses[0], losses, **TIGHT)
    for q in range(2):
        got = [w for k in range(spec.schedule.num_stages) for w in result.replica_weights[q][(k, 0)]]
        assert [w.shape for w in got] == [w.shape for w in want]
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b, **TIGHT)
