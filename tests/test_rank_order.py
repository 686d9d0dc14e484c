"""--rank-order and --expert-tensor-parallel: each group's ranks as Megatron-core's RankGenerator numbers them
(megatron/core/parallel_state.py: rank = i_0 + n_0·(i_1 + n_1·(...)) along the order, a group the ranks that
differ in its dimensions only; the expected ranks below are written out by hand from that rule), the links they
give, and the experts folded over t·C·d."""

from __future__ import annotations

import json
import math

import pytest

from pipesim.planning.estimate import gradient_ranks_per_node, links_of
from pipesim.planning.experts import ExpertParallelError, expert_group
from pipesim.schedules.ranks import RankOrderError, dense_grid, expert_grid
from tests.conftest import pipesim, simulate_json, tune_rows
from tests.helpers import H100
from tests.helpers import H100_PLACEMENT as PLACEMENT


def groups(grid, dims: tuple[str, ...]) -> list[list[int]]:
    """Every group of `dims` over the grid's ranks, each once, in order of their first rank."""
    return sorted(map(list, {tuple(grid.group(dims, rank)) for rank in range(math.prod(grid.sizes))}))


def test_megatron_order_numbers_the_dense_groups_as_its_rank_generator():
    # tp-cp-ep-dp-pp with t = 2, C = 1, d = 4, p = 2 on 16 ranks: strides tp 1, dp 2, pp 8
    grid = dense_grid("megatron", t=2, c=1, p=2, d=4)
    assert groups(grid, ("tp",)) == [[0, 1], [2, 3], [4, 5], [6, 7], [8, 9], [10, 11], [12, 13], [14, 15]]
    assert groups(grid, ("dp",)) == [[0, 2, 4, 6], [1, 3, 5, 7], [8, 10, 12, 14], [9, 11, 13, 15]]
    assert groups(grid, ("pp",)) == [[0, 8], [1, 9], [2, 10], [3, 11], [4, 12], [5, 13], [6, 14], [7, 15]]
    # with C = 2 (t = 2, d = 2, p = 2): strides tp 1, cp 2, dp 4, pp 8
    grid = dense_grid("megatron", t=2, c=2, p=2, d=2)
    assert groups(grid, ("cp",)) == [[0, 2], [1, 3], [4, 6], [5, 7], [8, 10], [9, 11], [12, 14], [13, 15]]
    assert groups(grid, ("cp", "dp")) == [[0, 2, 4, 6], [1, 3, 5, 7], [8, 10, 12, 14], [9, 11, 13, 15]]
    assert groups(grid, ("pp",))[0] == [0, 8]


def test_megatron_order_folds_the_experts_over_tensor_and_data_parallel_ranks():
    # the expert grid tp-ep-dp-pp with ETP = 1, E = 4 over t·C·d = 8 (t = 2, d = 4), p = 2: strides ep 1, edp 4, pp 8
    grid = expert_grid("megatron", t=2, c=1, p=2, d=4, e=4, etp=1)
    assert groups(grid, ("ep",)) == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11], [12, 13, 14, 15]]
    assert groups(grid, ("dp",)) == [[0, 4], [1, 5], [2, 6], [3, 7], [8, 12], [9, 13], [10, 14], [11, 15]]
    # the stages are the dense grid's, as Megatron-core asserts
    assert groups(grid, ("pp",)) == groups(dense_grid("megatron", t=2, c=1, p=2, d=4), ("pp",))
    # ETP = t (the default): E = 2 over C·d, every expert split over the dense tensor-parallel pair
    grid = expert_grid("megatron", t=2, c=1, p=2, d=4, e=2)
    assert groups(grid, ("tp",))[:2] == [[0, 1], [2, 3]]
    assert groups(grid, ("ep",))[:2] == [[0, 2], [1, 3]]


def test_pipesim_order_keeps_the_stages_inside_the_replicas():
    grid = dense_grid("pipesim", t=2, c=1, p=2, d=4)  # strides tp 1, pp 2, dp 4
    assert groups(grid, ("pp",))[:2] == [[0, 2], [1, 3]]
    assert groups(grid, ("dp",))[:2] == [[0, 4, 8, 12], [1, 5, 9, 13]]
    assert groups(expert_grid("pipesim", t=2, c=1, p=2, d=4, e=2), ("ep",))[:2] == [[0, 4], [1, 5]]


def test_the_order_moves_the_stage_and_data_parallel_links():
    pipesim = links_of(PLACEMENT, t=1, p=2, d=8)
    megatron = links_of(PLACEMENT, t=1, p=2, d=8, order="megatron")
    assert (pipesim.stage.kind, pipesim.data.kind) == ("nvlink", "infiniband")  # both stages on a node
    assert (megatron.stage.kind, megatron.data.kind) == ("infiniband", "nvlink")  # the 8 replicas on a node
    assert links_of(PLACEMENT, t=1, p=2, d=8, order="pipesim") == pipesim  # the default is pipesim's
    # d = 32: 8 of a stage's replicas share each node under megatron's order, 4 under pipesim's
    assert gradient_ranks_per_node(8, t=1, p=2, c=1, d=32, order="megatron") == 8
    assert gradient_ranks_per_node(8, t=1, p=2, c=1, d=32) == 4
    nic, node = PLACEMENT.network_link.bytes_per_ms, PLACEMENT.node_link.bytes_per_ms  # up to the node's link
    assert links_of(PLACEMENT, t=1, p=2, d=32, order="megatron").data.bytes_per_ms == min(8 * nic, node)
    assert links_of(PLACEMENT, t=1, p=2, d=32).data.bytes_per_ms == min(4 * nic, node)


def test_the_order_places_the_expert_group_and_folding_shards_the_experts():
    # E = 8 with p = 2: pipesim's 8 replicas sit 2 ranks apart (4 a node), megatron's on one node
    assert expert_group(PLACEMENT, 8, 128, 1, 1, 2, 8).per_node == 4
    assert expert_group(PLACEMENT, 8, 128, 1, 1, 2, 8, order="megatron").per_node == 8
    # Qwen3-235B's H100 layout: t = 2, p = 8, d = 16, E = 32 with ETP = 1, each rank 1/32 of the experts
    folded = expert_group(PLACEMENT, 32, 128, 2, 1, 8, 16, order="megatron", expert_tensor=1)
    assert (folded.per_node, folded.weight_shards) == (8, 16)  # 1/16 beside the dense layers' 1/t = 1/2
    assert expert_group(PLACEMENT, 8, 128, 2, 1, 2, 8).weight_shards == 8  # unfolded: E, as before
    with pytest.raises(ExpertParallelError, match="must divide the data-parallel degree, 16"):
        expert_group(PLACEMENT, 32, 128, 2, 1, 8, 16)
    with pytest.raises(ExpertParallelError, match="expert: 8 x expert_tensor 3 = 24 must divide the t·C·d = 32"):
        expert_group(PLACEMENT, 8, 128, 2, 1, 8, 16, order="megatron", expert_tensor=3)
    with pytest.raises(RankOrderError, match="rank_order: choose from pipesim, megatron"):
        dense_grid("torchtitan", 1, 1, 1, 1)
    # Megatron folds E over the context-parallel ranks too (its expert grid has no cp): E = 4 over C·d = 2 x 2
    assert expert_grid("megatron", t=1, c=2, p=1, d=2, e=4).group(("ep",)) == [0, 1, 2, 3]


def test_a_folded_expert_is_held_by_etp_ranks_whatever_t_is():
    """t = 2 with E = 2: at ETP = 2 (the default) a rank holds 1/4 of the routed experts' weights, at ETP = 1 half,
    more than its 1/t share of the dense ones."""
    import torch

    from pipesim.planning.estimate import Parallelism, estimate_profile
    from pipesim.workload.count import count_built

    counted = count_built("gpt", dict(layers=2, width=256, heads=4, seq_len=128, vocab=1000, gated=True, experts=8,
                                      expert_ffn=512), 1, torch.bfloat16, "flash")
    routed = sum(layer.expert_param_bytes for layer in counted.layers)

    def held(etp: int | None) -> int:
        profile = estimate_profile(counted, H100, Parallelism(
            tensor=2, data=4, expert=2, expert_tensor=etp, rank_order="megatron"))
        return sum(layer.expert_param_bytes for layer in profile.layers)

    assert held(None) == held(2) == pytest.approx(routed / 4, rel=1e-3)
    assert held(1) == pytest.approx(routed / 2, rel=1e-3)


MOE = ["--model", "gpt", "--layers", "4", "--width", "256", "--heads", "4", "--seq-len", "128", "--experts", "16",
       "--gpu", "h100-sxm", "-p", "2", "-m", "4", "--data-parallel", "8", "--expert-parallel", "8", "-s", "1f1b"]


def test_simulate_takes_the_rank_order_and_refuses_bad_values_in_one_line():
    default, megatron = simulate_json(*MOE), simulate_json(*MOE, "--rank-order", "megatron")
    assert default[0]["makespan_ms"] != megatron[0]["makespan_ms"]
    for flags, line in ((("--rank-order", "zigzag"), "--rank-order: choose from pipesim, megatron (got 'zigzag')"),
                        (("--expert-tensor-parallel", "1"), "give --rank-order megatron"),
                        (("--rank-order", "megatron", "--expert-tensor-parallel", "3"),
                         "--expert-parallel 8 x --expert-tensor-parallel 3 = 24 must divide")):  # "x expert_tensor 3"
        code, out, err = pipesim("simulate", *MOE, *flags)
        assert code == 2 and line in err and len(err.strip().splitlines()) == 1, err
    folded = ("--data-parallel", "4", "--tensor-parallel", "2", "--expert-parallel", "16", "--rank-order", "megatron")
    code, out, err = pipesim("simulate", *MOE[:MOE.index("--data-parallel")], *folded, "-s", "1f1b")
    assert (code, out, err) == (2, "", "error: --expert-parallel 16 x --expert-tensor-parallel 2 (t, its default) = 32 "
                                       "must divide the t·C·d = 8 ranks of a stage, which Megatron-core folds the "
                                       "experts over\n")
    # E = 8 over the same t·d = 8 ranks folds at ETP = 1, which the refusal of the default t = 2 names
    code, out, err = pipesim("simulate", *MOE[:MOE.index("--data-parallel")], *folded[:4], "--expert-parallel", "8",
                             "--rank-order", "megatron", "-s", "1f1b")
    assert (code, out) == (2, "") and err.endswith("; --expert-tensor-parallel 1 would fold them\n"), err


def test_experts_folded_past_the_replicas_reduce_their_gradients_over_the_ranks_holding_the_same_ones():
    """E = 16 over t·d = 2 x 8 at ETP = 1 (more expert-parallel ranks than replicas): the experts' gradients go over
    t·C·d/(E·ETP) ranks, not d·C/E (which is none here)."""
    from pipesim.planning.scenario import CollectiveLink, collective_costs
    from pipesim.schedules import ScheduleParams, build_schedule
    from pipesim.sim.costs import Costs, StageCosts

    folded = [*MOE[:-8], "--tensor-parallel", "2", "--data-parallel", "8", "--expert-parallel", "16", "-s", "1f1b",
              "--rank-order", "megatron", "--expert-tensor-parallel", "1"]
    assert simulate_json(*folded)[0]["makespan_ms"] > 0
    link = CollectiveLink(latency_ms=0.01, bytes_per_ms=1e6, source="typed")
    stage = StageCosts(fwd_ms=1.0, bwd_ms=2.0, param_bytes=4_000_000, expert_param_bytes=3_000_000)
    schedule = build_schedule("1f1b", ScheduleParams(stages=1, microbatches=1, data_parallel=8, expert_parallel=16))
    assert collective_costs(Costs((stage,)), schedule, link, expert_replicas=2).stages[0].reduce_ms == pytest.approx(
        link.all_reduce_ms(1_000_000, 8) + link.all_reduce_ms(3_000_000, 2))


def test_tune_folds_the_experts_over_tensor_and_data_parallel_ranks_in_megatrons_order():
    """E = 8 at ETP = 1 on 8 GPUs: t·d must be a multiple of 8, so t = 2 with d = 4 is searched too (pipesim's order
    would need d = 8); t is fixed at 2 so that the rows shown are those, whichever layout is fastest."""
    code, out, err = pipesim("tune", "--gpu", "h100-sxm", "--model", "gpt", "--layers", 4, "--width", 256,
                             "--heads", 4, "--seq-len", 128, "--vocab", 1000, "--gated", "--experts", 8,
                             "--expert-parallel", 8, "-D", 8, "--json", "--rank-order", "megatron",
                             "--expert-tensor-parallel", 1, "--tensor-parallel", 2, "-s", "1f1b")
    assert code == 0, err
    tuned = json.loads(out)
    rows = tune_rows(tuned)
    assert all(row["tensor_parallel"] * row["replicas"] % 8 == 0 for row in rows)
    assert any(row["replicas"] < 8 for row in rows)
