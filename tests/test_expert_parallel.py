"""Expert parallelism in an estimate (planning/experts.py, `--expert-parallel E`): the routed experts' weights,
gradients and optimizer state sharded over E of the d replicas, the dispatch and combine all-to-alls priced on the
placement's links (the node's inside it, each GPU's NIC across), and bad degrees refused in one line."""

from __future__ import annotations

import json
import math
from dataclasses import replace

import numpy as np
import pytest
import torch

from pipesim.hardware.catalogue import load_catalogue
from pipesim.planning.estimate import (
    Parallelism,
    estimate_layer,
    estimate_profile,
    node_placement,
    placement_links,
)
from pipesim.planning.experts import (
    ExpertParallelError,
    expected_normal_maximum,
    expert_group,
    random_routing_load,
)
from pipesim.workload.count import count_built
from tests.conftest import pipesim, tune_rows
from tests.helpers import EP_GPT as GPT
from tests.helpers import EP_H as H
from tests.helpers import EP_S as S
from tests.helpers import EXPERTS, H100, TOP_K
from tests.helpers import H100_BF16 as DEVICE
from tests.helpers import H100_PLACEMENT as PLACEMENT
from tests.helpers import ep_gpt_count as counted


def profile(**parallel):
    """The GPU's pricing alone: a layer this small would wait on the host's issue of its kernels (planning/host.py)."""
    return estimate_profile(counted(), H100, Parallelism(pipeline=2, data=8, host_kernel_us=0, **parallel))


def test_an_all_to_all_sends_all_but_its_own_share_over_the_node_and_the_nic_at_once():
    """E = 8 ranks, 2 on each node: of a rank's bytes 1/8 stays, 1/8 goes to the other rank of its node over the
    node's link, 6/8 leave the node over its NIC; the slower of the two sets the time."""
    group = expert_group(PLACEMENT, 8, EXPERTS, tensor=1, context=1, pipeline=4, data=8)
    assert group.per_node == 2
    node, network, nbytes = PLACEMENT.node_link, PLACEMENT.network_link, 8e6
    inside = node.latency_ms + nbytes / 8 / node.bytes_per_ms
    outside = network.latency_ms + nbytes * 6 / 8 / network.bytes_per_ms
    assert group.all_to_all_ms(nbytes) == pytest.approx(max(inside, outside))
    within = expert_group(PLACEMENT, 8, EXPERTS, tensor=1, context=1, pipeline=1, data=8)  # all 8 on one node
    assert within.per_node == 8
    assert within.all_to_all_ms(nbytes) == pytest.approx(node.latency_ms + nbytes * 7 / 8 / node.bytes_per_ms)
    assert expert_group(PLACEMENT, 1, EXPERTS, 1, 1, 4, 8).all_to_all_ms(nbytes) == 0.0


def test_the_nic_carries_an_all_to_alls_share_at_what_nccl_moves_through_it():
    """NCCL moves 46-48 GB/s through an H100's ConnectX-7 NDR NIC of its 50 (its maintainers, nccl-tests issues 290
    and 267): E = 32 over 4 nodes sends 3/4 of a rank's 134.4 MB of copies, 100.8 MB, at 47 GB/s. A part whose NIC
    no such figure is given for (MI300X) stays at its line rate."""
    assert PLACEMENT.network_link.bytes_per_ms == pytest.approx(47e6)
    group = expert_group(PLACEMENT, 32, 128, tensor=1, context=1, pipeline=1, data=32)
    assert group.per_node == 8
    network = PLACEMENT.network_link
    assert group.all_to_all_ms(134.4e6) == pytest.approx(network.latency_ms + 100.8e6 / 47e6)
    assert node_placement(load_catalogue().find("mi300x")).network_link.bytes_per_ms == pytest.approx(50e6)


def test_each_rank_holds_its_share_of_the_experts_weights_gradients_and_optimizer_state():
    whole, sharded = profile(), profile(expert=4)
    for one, four, layer in zip(whole.layers, sharded.layers, counted().layers):
        moved = layer.expert_param_bytes * 3 // 4  # the 3/4 of the experts the other ranks hold
        assert one.param_bytes - four.param_bytes == moved
        assert one.grad_bytes - four.grad_bytes == moved * 2  # float32 main gradients of bf16 weights (Megatron's)
        held = four.param_bytes / one.param_bytes
        assert four.optimizer_state_bytes["adam"] == pytest.approx(one.optimizer_state_bytes["adam"] * held, abs=1)
    assert sum(layer.expert_param_bytes for layer in counted().layers) > 0


def test_a_stages_gradient_accumulation_and_weight_passes_go_over_the_weights_its_rank_holds():
    """Accumulating a micro-batch's gradients (and averaging, predicting or copying the weights) reads and writes
    what the rank holds: 1/E of the routed experts, not all of them (DeepSeek-V3 at E = 64 was priced 4 TB a
    backward on 27 GB held)."""
    whole, sharded = profile(), profile(expert=4)
    curve = whole.estimate.curve
    bytes_per_ms = H100.memory_bandwidth_gb_s * 1e6 * curve["memory_efficiency"]
    for one, four in zip(whole.stages, sharded.stages):
        assert four.param_bytes < one.param_bytes
        for stage in (one, four):
            assert stage.accumulate.median_ms == pytest.approx(
                curve["kernel_overhead_ms"] + 3 * stage.param_bytes / bytes_per_ms, rel=1e-12)
            assert stage.weight_copy.median_ms == pytest.approx(
                curve["kernel_overhead_ms"] + 2 * stage.param_bytes / bytes_per_ms, rel=1e-12)


def test_with_a_sharded_optimizer_the_experts_state_is_spread_over_the_d_replicas_as_the_rest_is():
    """ZeRO-1 with EP: the experts' state over E ranks times the d/E replicas of each expert, d in all."""
    whole, sharded = profile(sharded_optimizer=True), profile(sharded_optimizer=True, expert=4)
    assert [layer.optimizer_state_bytes for layer in sharded.layers] == \
        [layer.optimizer_state_bytes for layer in whole.layers]


def test_zero_3_and_2_shard_the_experts_weights_and_gradients_over_their_own_replicas():
    """d = 8, E = 4: a rank's 1 MB of dense weights shard over the 8 replicas, its 3 MB of experts (a quarter of
    the 12 MB) over the 2 that hold the same ones, as its optimizer state does (Megatron-core's expert data-parallel
    group; FSDP2's `dp_mod_ep`): ZeRO-3 keeps 1/8 + 3/2 MB between passes and ZeRO-2 the same gradients after their
    reduce-scatter. Over d alone, the experts' shard read 3/8 MB, E times too little."""
    from pipesim.schedules import ScheduleParams, build_schedule
    from pipesim.sim.cluster import Cluster
    from pipesim.sim.costs import Costs, StageCosts
    from pipesim.sim.engine import held_static_parts, simulate

    stage = StageCosts(fwd_ms=1.0, bwd_ms=2.0, param_bytes=4_000_000, expert_param_bytes=3_000_000,
                       optimizer_state_bytes=8_000_000, expert_shards=4)
    shard = 1_000_000 / 8 + 3_000_000 / 2
    for zero in (2, 3):
        schedule = build_schedule("1f1b", ScheduleParams(stages=2, microbatches=2, data_parallel=8, expert_parallel=4,
                                                         zero=zero))
        held = held_static_parts(schedule, [stage])
        assert held["optimizer_state"] == 2 * shard
        assert held["parameters"] == (shard if zero == 3 else 4_000_000)
        costs = Costs((stage, stage))
        gradients = simulate(schedule, costs, Cluster.uniform(2, 0.1)).counters["memory_bytes.gradients"][0]
        assert sorted(set(gradients.values)) == [0, shard, 4_000_000]  # whole from the backward, then the shard
    assert StageCosts(fwd_ms=1.0, bwd_ms=1.0, param_bytes=4_000_000, expert_param_bytes=3_000_000).shard_scale == 1


@pytest.mark.parametrize("zero", [["--zero", 3], ["--zero", 3, "--precision", "fsdp2"], ["--zero", 1]])
def test_a_ranks_zero_shard_is_as_large_whatever_the_experts_placement(zero):
    """Expert parallelism places the experts; ZeRO shards what a rank holds over the ranks that hold the same, so
    its shard stays 1/d of its stage's every weight at E = 1, 4 and 8 (d = 8)."""
    def sharded_mb(*flags) -> list[tuple[float, float]]:
        code, out, err = pipesim("simulate", "--gpu", "h100-sxm", "--model", "gpt", "--layers", 4, "--width", 256,
                                 "--heads", 4, "--seq-len", 256, "--vocab", 512, "--experts", 8, "--top-k", 2,
                                 "-p", 2, "-m", 2, "-s", "1f1b", "--data-parallel", 8, "--allocator", "none",
                                 "--json", *flags)
        assert code == 0, err
        devices = json.loads(out)["results"][0]["devices"]
        return [(d["peak_memory_parts_mb"]["parameters"], d["peak_memory_parts_mb"]["optimizer_state"])
                for d in devices]

    for expert in (4, 8):
        whole = sharded_mb("--expert-parallel", expert)  # the rank's own weights, whole (ZeRO-3: as it computes)
        held = sharded_mb("--expert-parallel", expert, *zero)
        unplaced = sharded_mb(*zero)
        unplaced_whole = sharded_mb()
        for (weights, state), (mine, _), (everything, every_state), (all_weights, _) in zip(
                held, whole, unplaced, unplaced_whole, strict=True):
            assert weights - mine == pytest.approx(everything - all_weights, abs=0.02), expert
            assert state == pytest.approx(every_state, abs=0.02), expert


def test_a_moe_layer_records_two_all_to_alls_after_its_forward_and_two_after_its_backward():
    """The all-to-alls are the layer's own figures, which the stage's A2A_F and A2A_B rows run
    (tests/test_all_to_all.py); the other layers' passes are unchanged (a MoE layer's grouped products run the
    rank's local experts: `test_a_ranks_grouped_products_run_its_local_experts_on_the_tokens_sent_to_them`)."""
    group = expert_group(PLACEMENT, 4, EXPERTS, tensor=1, context=1, pipeline=2, data=8)
    whole, sharded = profile(), profile(expert=4)
    blocks = [i for i, layer in enumerate(counted().layers) if layer.dispatched_bytes]
    assert len(blocks) == GPT["layers"]
    each = group.all_to_all_ms(S * TOP_K * H * 2)  # a 512-token micro-batch's copies, bf16
    for i, (one, four) in enumerate(zip(whole.layers, sharded.layers)):
        assert (four.all_to_all_fwd_ms, four.all_to_all_bwd_ms) == pytest.approx((2 * each, 2 * each) if i in blocks
                                                                                 else (0.0, 0.0))
        if i not in blocks:
            assert (four.fwd, four.bwd, four.igrad, four.wgrad) == (one.fwd, one.bwd, one.igrad, one.wgrad)
        assert (one.all_to_all_fwd_ms, one.all_to_all_bwd_ms) == (0.0, 0.0)
    stage = sharded.stages[0]
    mine = range(*stage.layers)
    assert stage.all_to_all_fwd_ms == pytest.approx(sum(sharded.layers[i].all_to_all_fwd_ms for i in mine))


def test_the_busiest_rank_holds_the_hot_expert_and_its_share_of_the_rest():
    """8 experts over 4 ranks, 2 each: the hot one takes 0.3 of the routed copies, the 7 others 0.1 each, so its
    rank computes 0.4 of them where a balanced rank computes 0.25: 1.6 times the work, its products' token rows
    too (a weight gradient's contraction)."""
    group = expert_group(PLACEMENT, 4, EXPERTS, 1, 1, 2, 8, hot_share=0.3)
    assert group.load == pytest.approx(1.6)
    balanced = expert_group(PLACEMENT, 4, EXPERTS, 1, 1, 2, 8, hot_share=1 / EXPERTS)
    assert balanced.load == pytest.approx(1.0)
    layer = counted().layers[1]
    busy, even = group.local(layer), balanced.local(layer)
    for name in ("fwd", "igrad", "wgrad"):
        for mine, other in zip(busy.ops[name], even.ops[name]):
            assert mine.flops == pytest.approx(other.flops * 1.6 if other.routed else other.flops, rel=1e-3)  # rows
            if other.routed and other.kind == "matmul":
                rows = 3 if name == "wgrad" else 1
                assert mine.shape[rows] == round(other.shape[rows] * 1.6)


def test_a_ranks_grouped_products_run_its_local_experts_on_the_tokens_sent_to_them():
    """Megatron-core's grouped GEMM runs a rank's n/E local experts, each on the tokens the E·ETP ranks of its
    groups send it, on its 1/ETP of the expert. 8 experts of f = 128 (gated: fc1 256 wide) at top 2 over a
    2,048-token micro-batch: the count's products run all 8 on 512 tokens each. t = 2 (sequence parallel: 1,024
    tokens a rank), d = 4, E = 2, ETP = 2 under Megatron's order: 4 local experts, each on 2·2·1,024·2/8 = 1,024
    tokens, fc1 128 and fc2's contraction 64 wide; 1/t of the FLOPs, and 4 experts' halves of the weights read
    where the count read all 8 whole."""
    moe = count_built("gpt", dict(layers=2, width=256, heads=4, seq_len=2048, vocab=1000, gated=True, experts=8,
                                  top_k=2, expert_ffn=128), 1, torch.bfloat16, "flash")
    layer = moe.layers[1]
    parallel = Parallelism(tensor=2, sequence_parallel=True, data=4, expert=2, expert_tensor=2, host_kernel_us=0,
                           rank_order="megatron")
    group = expert_group(PLACEMENT, 2, 8, 2, 1, 1, 4, order="megatron", expert_tensor=2)
    local = group.local(layer)
    grouped = {name: [(op.shape, op.flops, op.moved_bytes) for op in ops if op.routed and op.kind == "matmul"]
               for name, ops in local.ops.items()}

    def product(shape: tuple[int, int, int, int]) -> tuple[tuple[int, ...], int, int]:
        b, m, n, k = shape
        return shape, 2 * b * m * n * k, 2 * b * (m * k + k * n + m * n)  # bf16 operands and output

    fc1, fc2 = (4, 1024, 128, 256), (4, 1024, 256, 64)
    assert grouped["fwd"] == [product(fc1), product(fc2)]
    weight_grads = [product((4, 64, 256, 1024)), product((4, 256, 128, 1024))]
    input_grads = [product((4, 1024, 64, 256)), product((4, 1024, 256, 128))]
    assert grouped["wgrad"] == weight_grads and grouped["igrad"] == input_grads
    assert sorted(grouped["bwd"]) == sorted(weight_grads + input_grads)
    whole = [op for op in layer.ops["fwd"] if op.routed and op.kind == "matmul"]
    assert [op.shape for op in whole] == [(8, 512, 256, 256), (8, 512, 256, 128)]
    assert sum(flops for _, flops, _ in grouped["fwd"]) * 2 == sum(op.flops for op in whole)
    priced = estimate_profile(moe, H100, replace(parallel, pipeline=1)).layers[1]
    links = placement_links(H100, parallel)
    assert priced.fwd.median_ms == pytest.approx(estimate_layer(local, DEVICE, parallel, links.tensor, 2).fwd_ms)


def test_megatron_cores_all_to_all_sorts_what_a_rank_receives_by_local_expert_and_back():
    """8 experts at top 2 over E = 4 ranks (2 local experts each) under the all-to-all dispatcher: a 512-token
    micro-batch's 1,024 copies of 256 bf16 (524,288 bytes) are sorted by local expert after the dispatch and back
    before the combine, each a read and a write of every copy, and each sort's gradient in the backward's input
    pass; the busiest rank (the hot expert's, 1.6 times the copies) sorts 1.6 times as many. The flex dispatcher
    (HybridEP's; DeepEP's converts its indices instead, tests/test_deepep_multihot.py) and one local expert a rank
    (E = 8) sort nothing."""
    layer = counted().layers[1]
    dispatched = S * TOP_K * H * 2
    assert layer.dispatched_bytes == dispatched
    for share, load in ((None, 1.0), (0.3, 1.6)):
        group = expert_group(PLACEMENT, 4, EXPERTS, 1, 1, 2, 8, hot_share=share)
        sorts = {name: [op for op in ops if op.op.startswith("moe_sort_chunks")]
                 for name, ops in group.local(layer).ops.items()}
        (forward,), (backward,), (input_pass,) = sorts["fwd"], sorts["bwd"], sorts["igrad"]
        assert (forward.op, forward.kind, forward.count, forward.routed) == ("moe_sort_chunks_by_index", "memory",
                                                                             2, True)
        assert forward.moved_bytes == round(2 * dispatched * load)
        assert forward.shape == (round(S * TOP_K * load), H)
        assert backward == input_pass == replace(forward, op="moe_sort_chunks_by_index_backward")
        assert sorts["wgrad"] == []
    alltoall, flex = profile(expert=4), profile(expert=4, token_dispatcher="hybridep")
    sort_ms = 2 * (H100.curve.kernel_overhead_ms + 2 * dispatched / DEVICE.memory_bytes_per_ms)
    for one, other, counted_layer in zip(alltoall.layers, flex.layers, counted().layers):
        extra = sort_ms if counted_layer.dispatched_bytes else 0.0
        for name in ("fwd", "bwd", "igrad"):
            assert getattr(one, name).median_ms - getattr(other, name).median_ms == pytest.approx(extra)
        assert one.wgrad == other.wgrad
    one_each, flex_each = profile(expert=8), profile(expert=8, token_dispatcher="hybridep")
    assert [layer.fwd for layer in one_each.layers] == [layer.fwd for layer in flex_each.layers]


def test_random_routing_waits_for_the_busiest_rank_of_draws_that_are_even_only_on_average():
    """Megatron-core's forced balance draws each token's router logits from a normal distribution (moe_utils.py
    RandomSTE) and takes the top k: 1,024 tokens routed to 2 of 16 experts, 4 on each of 4 ranks, drawn so 2,000
    times. The busiest rank's copies over the mean (512) are `random_routing_load`'s within 5 % of the excess;
    the expected largest of 2 and of 3 normal draws are 1/sqrt(pi) and 3/(2 sqrt(pi))."""
    assert expected_normal_maximum(2) == pytest.approx(1 / math.sqrt(math.pi), rel=1e-9)
    assert expected_normal_maximum(3) == pytest.approx(3 / (2 * math.sqrt(math.pi)), rel=1e-9)
    experts, top_k, ranks, tokens, trials = 16, 2, 4, 1024, 2000
    rng = np.random.default_rng(0)
    busiest = []
    for _ in range(trials // 500):
        logits = rng.standard_normal((500, tokens, experts))
        chosen = np.argpartition(-logits, top_k, axis=-1)[..., :top_k]  # each token's top k
        per_rank = np.stack([(chosen // (experts // ranks) == r).sum(axis=(1, 2)) for r in range(ranks)], axis=1)
        busiest.extend(per_rank.max(axis=1))
    drawn = np.mean(busiest) / (tokens * top_k / ranks)
    predicted = random_routing_load(experts, top_k, ranks, tokens)
    assert predicted > 1.02
    assert drawn - 1 == pytest.approx(predicted - 1, rel=0.05)
    assert random_routing_load(experts, top_k, 1, tokens) == 1.0


def test_under_random_routing_each_moe_layer_waits_for_its_busiest_rank():
    """E = 4 over a 512-token micro-batch at top 2 of 8 experts: each rank of the group receives the copies of
    4 x 512 tokens; the busiest's load times the balanced work and all-to-all bytes, the other layers unchanged."""
    group = expert_group(PLACEMENT, 4, EXPERTS, 1, 1, 2, 8, routing="random")
    load = random_routing_load(EXPERTS, TOP_K, 4, 4 * S)
    balanced, drawn = profile(expert=4), profile(expert=4, routing="random")
    for one, busy, layer in zip(balanced.layers, drawn.layers, counted().layers):
        if layer.dispatched_bytes:
            assert group.layer_load(layer) == pytest.approx(load)
            assert busy.fwd.median_ms > one.fwd.median_ms
            assert busy.all_to_all_fwd_ms == pytest.approx(2 * group.all_to_all_ms(load * S * TOP_K * H * 2))
        else:
            assert busy.fwd == one.fwd


def test_every_rank_waits_for_the_busiest_ones_work_and_all_to_alls():
    group = expert_group(PLACEMENT, 4, EXPERTS, 1, 1, 2, 8)
    balanced, hot = profile(expert=4), profile(expert=4, hot_expert_share=0.3)
    busiest = 2 * group.all_to_all_ms(1.6 * S * TOP_K * H * 2)  # it receives 1.6 times the copies
    for one, busy, layer in zip(balanced.layers, hot.layers, counted().layers):
        if layer.dispatched_bytes:
            assert busy.fwd.median_ms > one.fwd.median_ms  # the experts' products, 1.6 times as many rows
            assert busy.all_to_all_fwd_ms == pytest.approx(busiest)
        else:
            assert busy.fwd == one.fwd
    assert [layer.param_bytes for layer in hot.layers] == [layer.param_bytes for layer in balanced.layers]


@pytest.mark.parametrize("ranks, experts, data, fragment", [
    (3, EXPERTS, 6, "expert: 3 does not divide the model's 8 routed experts"),
    (4, EXPERTS, 2, "expert: 4 must divide the data-parallel degree, 2"),
    (2, None, 2, "expert: 2, but the model has no routed experts"),
])
def test_an_impossible_degree_names_what_it_must_divide(ranks, experts, data, fragment):
    with pytest.raises(ExpertParallelError, match=fragment):
        expert_group(PLACEMENT, ranks, experts, 1, 1, 1, data)


@pytest.mark.parametrize("ranks, share, top_k, fragment", [
    (2, 0.1, 1, r"hot_expert_share: 0.1 is not a share of 8 experts' tokens: from 1/8 \(balanced\) to 1$"),
    (2, 1.5, 1, r"hot_expert_share: 1.5 is not a share"),
    # a token's 2 copies go to 2 distinct experts: one expert receives at most half of them (it was priced at 1)
    (2, 0.6, 2, r"hot_expert_share: 0.6 is not a share of 8 experts' tokens: from 1/8 \(balanced\) to 1/2 \(each "
                r"token's 2 copies go to 2 distinct experts\)"),
    (1, 0.5, 1, r"hot_expert_share: changes nothing on one expert-parallel rank"),
])
def test_a_hot_share_must_be_a_share_and_needs_expert_parallelism(ranks, share, top_k, fragment):
    with pytest.raises(ExpertParallelError, match=fragment):
        expert_group(PLACEMENT, ranks, EXPERTS, 1, 1, 1, 2, hot_share=share, top_k=top_k)
    if ranks > 1 and top_k > 1:
        assert expert_group(PLACEMENT, ranks, EXPERTS, 1, 1, 1, 2, hot_share=1 / top_k, top_k=top_k).hot_share == 0.5


@pytest.mark.parametrize("args, fragment", [
    (("--experts", 8, "--expert-parallel", 3, "--data-parallel", 6),
     "--expert-parallel 3 does not divide the model's 8 routed experts; give one of 1, 2, 4, 8"),
    (("--experts", 8, "--expert-parallel", 4),
     "--expert-parallel 4 must divide the data-parallel degree, 1: give --data-parallel a multiple of 4"),
    (("--expert-parallel", 2, "--data-parallel", 2), "--expert-parallel 2, but the model has no routed experts"),
    (("--experts", 8, "--expert-parallel", 2, "--data-parallel", 2, "--hot-expert-share", 0.05),
     "--hot-expert-share 0.05 is not a share of 8 experts' tokens"),
    (("--experts", 8, "--expert-parallel", 2, "--data-parallel", 2, "--hot-expert-share", 1),
     "--hot-expert-share 1.0 is not a share of 8 experts' tokens: from 1/8 (balanced) to 1/2 (each token's 2 copies"),
    (("--experts", 8, "--expert-parallel", 2, "--data-parallel", 2, "--routing", "even"),
     "--routing: choose from balanced, random (got 'even')"),
    (("--experts", 8, "--routing", "random"), "--routing random changes nothing on one expert-parallel rank"),
    (("--experts", 8, "--expert-parallel", 2, "--data-parallel", 2, "--routing", "random", "--hot-expert-share",
      0.2), "--routing random draws each token's experts alike, where --hot-expert-share names one"),
    (("--experts", 8, "--expert-parallel", 2, "--data-parallel", 2, "--routing", "random", "--capacity-factor",
      1.25), "--routing random: a model that drops tokens (--capacity-factor) computes each expert's capacity"),
])
def test_a_bad_expert_parallel_degree_is_one_line_and_nothing_is_written(tmp_path, args, fragment):
    out = tmp_path / "profile.json"
    code, stdout, err = pipesim("estimate", "--gpu", "h100-sxm", "--model", "gpt", "--layers", 2, "--width", 64,
                                "--heads", 4, "--seq-len", 32, "--vocab", 100, *args, "--out", out)
    assert code == 2 and stdout == "" and fragment in err and len(err.strip().splitlines()) == 1, err
    assert not out.exists()


def test_expert_parallel_needs_the_estimate():
    code, _, err = pipesim("simulate", "--expert-parallel", 2)
    assert code == 2 and "--expert-parallel: only --gpu's estimate reads it" in err


def test_tune_searches_only_the_shapes_whose_replicas_expert_parallelism_can_draw_from():
    """With --expert-parallel 4 on 8 GPUs, d = 8/(t·p) must be a multiple of 4: t·p of 1 or 2 only."""
    code, out, err = pipesim("tune", "--gpu", "h100-sxm", "--model", "gpt", "--layers", 4, "--width", 256,
                             "--heads", 4, "--seq-len", 128, "--vocab", 1000, "--gated", "--experts", 8,
                             "--expert-parallel", 4, "-D", 8, "--json")
    assert code == 0, err
    tuned = json.loads(out)
    rows = tune_rows(tuned)
    assert rows and all(row["replicas"] % 4 == 0 for row in rows)


def test_tensor_parallelism_must_split_each_experts_mlp(tmp_path):
    code, _, err = pipesim("estimate", "--gpu", "h100-sxm", "--model", "gpt", "--layers", 2, "--width", 64,
                           "--heads", 4, "--seq-len", 32, "--vocab", 100, "--experts", 4, "--expert-ffn", 33,
                           "--tensor-parallel", 2, "--out", tmp_path / "profile.json")
    assert code == 2 and "--tensor-parallel 2 does not divide the model's 33 experts' MLP width" in err, err


def test_the_estimate_says_where_the_all_to_alls_go(tmp_path):
    """p = 4 stages of one GPU: 2 of a group's 8 replicas on each 8-GPU node, 6/8 of a rank's copies on its NIC."""
    code, out, err = pipesim("estimate", "--gpu", "h100-sxm", "--model", "gpt", "--layers", 4, "--width", 64,
                             "--heads", 4, "--seq-len", 32, "--vocab", 100, "--experts", 8, "--stages", 4,
                             "--data-parallel", 8, "--expert-parallel", 8, "--out", tmp_path / "profile.json")
    assert code == 0, err
    text = " ".join(out.split())
    assert "t=1 p=4 d=8 E=8" in text
    assert ("expert-parallel group: 8 ranks, 2 on each node; an all-to-all sends 1/8 of a rank's token copies over "
            "nvlink and 6/8 over its NIC (infiniband") in text


@pytest.mark.parametrize("stages, data, says", [
    # one rank a node: no other rank of the group over NVLink (the line named it)
    (8, 8, "8 ranks, 1 on each node; DeepEP's dispatch sends a token once to each other node over its NIC"),
    (1, 8, "8 ranks, 8 on each node; DeepEP's dispatch sends a token once to each other rank holding any of its "
           "experts over nvlink"),
    (4, 8, "8 ranks, 2 on each node; DeepEP's dispatch sends a token once to each other rank holding any of its "
           "experts over nvlink, once to each other node over its NIC"),
])
def test_the_estimate_says_which_links_deepeps_dispatch_takes(tmp_path, stages, data, says):
    code, out, err = pipesim("estimate", "--gpu", "h100-sxm", "--model", "gpt", "--layers", 8, "--width", 64,
                             "--heads", 4, "--seq-len", 32, "--vocab", 100, "--experts", 8, "--stages", stages,
                             "--data-parallel", data, "--expert-parallel", 8, "--token-dispatcher", "deepep",
                             "--out", tmp_path / "profile.json")
    assert code == 0, err
    text = " ".join(out.split())
    assert f"expert-parallel group: {says}" in text
    assert "each other node" in text if stages > 1 else "each other node" not in text


def test_each_experts_gradients_are_reduced_over_the_replicas_that_hold_it():
    """d = 8, E = 4: the dense weights' gradients over 8 replicas, the experts' over the 2 that hold the same ones;
    with E = 8 every expert is on one replica and its gradients are reduced by none."""
    from pipesim.planning.scenario import CollectiveLink, collective_costs
    from pipesim.schedules import ScheduleParams, build_schedule
    from pipesim.sim.costs import Costs, StageCosts

    link = CollectiveLink(latency_ms=0.01, bytes_per_ms=1e6, source="typed")
    stage = StageCosts(fwd_ms=1.0, bwd_ms=2.0, param_bytes=4_000_000, expert_param_bytes=3_000_000)

    def reduce_ms(expert: int) -> float:
        schedule = build_schedule("1f1b", ScheduleParams(stages=1, microbatches=1, data_parallel=8,
                                                         expert_parallel=expert))
        return collective_costs(Costs((stage,)), schedule, link).stages[0].reduce_ms

    assert reduce_ms(4) == pytest.approx(link.all_reduce_ms(1_000_000, 8) + link.all_reduce_ms(3_000_000, 2))
    assert reduce_ms(8) == pytest.approx(link.all_reduce_ms(1_000_000, 8))
    assert reduce_ms(1) == pytest.approx(link.all_reduce_ms(4_000_000, 8))


SMALL_MOE = ("--gpu", "h100-sxm", "--model", "gpt", "--layers", 8, "--width", 256, "--heads", 4, "--seq-len", 128,
             "--vocab", 512, "--experts", 16, "--top-k", 2)
SPREAD = ("simulate", *SMALL_MOE, "-m", 8, "-s", "1f1b")


@pytest.mark.parametrize("flags, said", [
    # pipesim's order puts a replica's 8 stages on a node, so E = 2 of the 2 replicas lies on two nodes
    (("-p", 8, "--data-parallel", 2, "--expert-parallel", 2),
     "the expert-parallel group across 2 nodes (1 on each; --rank-order megatron places it on one node)"),
    (("-p", 2, "--data-parallel", 8, "--expert-parallel", 8),  # 4 replicas of 2 stages a node
     "the expert-parallel group across 2 nodes (4 on each; --rank-order megatron places it on one node)"),
    (("-p", 1, "--data-parallel", 16, "--expert-parallel", 16, "--rank-order", "megatron"),  # larger than a node
     "the expert-parallel group across 2 nodes (8 on each)"),
    (("-p", 8, "--data-parallel", 2, "--expert-parallel", 2, "--rank-order", "megatron"), None),  # d inside a node
    (("-p", 8, "--data-parallel", 2), None),  # no expert parallelism
])
def test_simulates_caption_says_where_an_expert_parallel_group_crosses_nodes(flags, said):
    code, out, err = pipesim(*SPREAD, *flags)
    assert code == 0, err
    caption = " ".join(out.split())  # as one line, however the terminal wrapped it
    if said is None:
        assert "expert-parallel group across" not in caption
    else:
        assert said in caption, caption


def test_the_caption_places_the_group_where_its_all_to_alls_are_priced(tmp_path):
    """An estimate read back with --profile at another p keeps the all-to-alls priced at its own p and d, and the
    caption names that placement (the estimate's), as the costs' caption names the estimate's degrees."""
    estimated = tmp_path / "estimate.json"
    code, _, err = pipesim("estimate", *SMALL_MOE, "-p", 2, "--data-parallel", 8, "--expert-parallel", 8,
                           "--out", estimated)
    assert code == 0, err
    for p in (1, 8):
        code, out, err = pipesim("simulate", "--profile", estimated, "-s", "1f1b", "-p", p, "--data-parallel", 8)
        assert code == 0, err
        caption = " ".join(out.split())
        assert ("at p=2 d=8" in caption and "the expert-parallel group across 2 nodes (4 on each; --rank-order "
                "megatron places it on one node)" in caption), caption
