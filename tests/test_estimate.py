"""The time model of issue 29 held against closed forms: NCCL's collectives, a big GEMM at its efficiency,
tensor parallelism's split and collectives, Korthikanti et al.'s activation memory."""

import json
import math
import re
from dataclasses import replace
from pathlib import Path

import pytest

from pipesim.hardware import collectives

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("ranks", [2, 3, 8, 64])
def test_ring_all_reduce_is_nccl_tests_bus_bandwidth_factor(ranks):
    nbytes, latency_ms, bytes_per_ms = 1e9, 0.005, 1e8
    bus_factor = 2 * (ranks - 1) / ranks  # nccl-tests PERFORMANCE.md: busbw = algbw * 2(n-1)/n
    expected = 2 * (ranks - 1) * latency_ms + nbytes * bus_factor / bytes_per_ms
    assert collectives.ring_all_reduce_ms(nbytes, ranks, latency_ms, bytes_per_ms) == pytest.approx(expected)
    half = (ranks - 1) * latency_ms + nbytes * (ranks - 1) / ranks / bytes_per_ms
    assert collectives.reduce_scatter_ms(nbytes, ranks, latency_ms, bytes_per_ms) == pytest.approx(half)
    assert collectives.all_gather_ms(nbytes, ranks, latency_ms, bytes_per_ms) == pytest.approx(half)


def test_all_reduce_takes_the_tree_for_small_buffers_over_many_ranks_and_the_ring_for_large():
    latency_ms, bytes_per_ms, ranks = 0.01, 1e8, 256
    small, large = 1e3, 1e10
    tree_small = collectives.tree_all_reduce_ms(small, ranks, latency_ms, bytes_per_ms)
    assert tree_small == pytest.approx(2 * math.log2(ranks) * latency_ms
                                        + 2 * small / (collectives.TREE_BANDWIDTH_FACTOR * bytes_per_ms))
    assert collectives.all_reduce_ms(small, ranks, latency_ms, bytes_per_ms) == tree_small
    assert collectives.all_reduce_ms(large, ranks, latency_ms, bytes_per_ms) == \
        collectives.ring_all_reduce_ms(large, ranks, latency_ms, bytes_per_ms)


def test_one_rank_costs_nothing_and_bad_sizes_name_the_field():
    assert collectives.all_reduce_ms(1e9, 1, 0.01, 1e6) == 0.0
    with pytest.raises(ValueError, match="ranks"):
        collectives.all_reduce_ms(1e9, 0, 0.01, 1e6)
    with pytest.raises(ValueError, match="nbytes"):
        collectives.reduce_scatter_ms(-1, 2, 0.01, 1e6)


# --- the time model (planning/estimate.py) ---

from pipesim.planning.estimate import (  # noqa: E402
    EstimateError,
    Parallelism,
    estimate_layer,
    estimate_profile,
    op_ms,
    placement_links,
)
from pipesim.profiles.workload import LayerCount, OpCount, WorkloadCount  # noqa: E402
from tests.helpers import A100, GPT_CPU  # noqa: E402
from tests.helpers import A100_FP16 as DEVICE  # noqa: E402


def test_a_big_gemm_that_fills_every_multiprocessor_runs_at_the_large_product_efficiency():
    curve = A100.curve
    m, n, k = 256 * curve.multiprocessors, 128 * 8, 8192  # 8 waves of whole 256 x 128 tiles
    op = OpCount("mm", "matmul", (1, m, n, k), 2 * m * n * k, 2 * (m * k + k * n + m * n), 1)
    expected = curve.kernel_overhead_ms + op.flops / (DEVICE.peak_flops_per_ms * curve.matmul_efficiency)
    assert op_ms(op, DEVICE) == pytest.approx(expected)
    ragged = OpCount("mm", "matmul", (1, m + 1, n, k), 2 * (m + 1) * n * k, op.moved_bytes, 1)  # one more wave
    assert op_ms(ragged, DEVICE) > op_ms(op, DEVICE) * 1.05
    small = OpCount("mm", "matmul", (1, 64, 64, 64), 2 * 64 ** 3, 3 * 2 * 64 * 64, 1)
    assert small.flops / op_ms(small, DEVICE) < 0.01 * DEVICE.peak_flops_per_ms  # far from peak


S, B, H, HEADS = 128, 2, 192, 8  # tokens (b·s) differ from the width, as the split tells them apart


def _block(saved_tensors, saved_bytes=None) -> LayerCount:
    """A transformer block's sizes (output b x s x h) with the given saved tensors and no ops."""
    saved = sum(n for _, n in saved_tensors) if saved_bytes is None else saved_bytes
    scores = OpCount("bmm", "matmul", (B * HEADS, S, S, H // HEADS), 2 * B * S * S * H, 0, 1)  # it attends
    return LayerCount("1:_Block", 0, 0, 0, 0, 0, 0, saved, 0, 0, {}, {}, (B, S, H), 2 * B * S * H, (0,),
                      saved_tensors, {"fwd": (scores,)})


@pytest.mark.parametrize("t", [1, 2, 8])
def test_activation_memory_follows_korthikanti_with_and_without_sequence_parallelism_and_recompute(t):
    sbh, core = S * B * H, 5 * HEADS * S * S * B  # the paper's 34·sbh and 5·as²b bytes (fp16)
    layer = _block([((B, S, H), 34 * sbh), ((B, HEADS, S, S), core)])

    def kept(**kwargs) -> float:
        return estimate_layer(layer, DEVICE, Parallelism(tensor=t, **kwargs), placement_links(
            A100, Parallelism(tensor=t)).tensor, 2).activation_bytes

    paper = sbh * (10 + 24 / t + 5 * HEADS * S / (H * t))  # Korthikanti et al. 2022, Eq. 2
    assert kept() == pytest.approx(paper, abs=1)
    assert kept(sequence_parallel=True) == pytest.approx(sbh / t * (34 + 5 * HEADS * S / H), abs=1)  # Eq. 4
    assert kept(sequence_parallel=True, recompute="selective") == pytest.approx(34 * sbh / t, abs=1)  # Eq. 6
    assert kept(recompute="full") == 2 * sbh  # the layer's input only


@pytest.fixture(scope="module")
def small_gpt() -> WorkloadCount:
    torch = pytest.importorskip("torch")
    from pipesim.workload.count import count_built

    return count_built("gpt", dict(layers=2, width=H, heads=HEADS, seq_len=S, vocab=512), B, torch.float16)


def test_tensor_parallelism_divides_the_products_and_adds_two_all_reduces_each_way(small_gpt):
    from pipesim.planning.estimate import _Reduction, _Split

    block = small_gpt.layers[1]
    split = _Split.of(block, Parallelism(tensor=4))
    for name, reductions in (("fwd", 2), ("igrad", 2), ("wgrad", 0)):
        products = [op for op in block.ops[name] if op.kind == "matmul"]
        mine = [split.matmul(op, name == "fwd") for op in products]
        assert sum(op.flops * op.count for op, _ in mine) * 4 == sum(op.flops * op.count for op in products)
        reduced = [op for op, ends_in_all_reduce in mine if ends_in_all_reduce]
        assert len(reduced) == reductions, name
        assert all(op.shape[0] * op.shape[1] * op.shape[2] == B * S * H for op in reduced)  # b·s·h each
        # its fused qkv column-parallel and its proj row-parallel: the roles split each product as its shape does
        assert [split.products(op, name) for op in products] == [
            ((mine, _Reduction(mine) if reduced else None, 1.0),)
            for mine, reduced in (split.matmul(op, name == "fwd") for op in products)]


def test_an_estimated_profile_is_a_profile_with_its_links_from_the_placement(small_gpt):
    one = estimate_profile(small_gpt, A100, Parallelism(pipeline=2))
    assert one.estimate.gpu == A100.name and one.partition.stages == 2 and one.link.segments[0].bytes_per_ms == \
        A100.intra_node.gb_s_per_direction * A100.curve.link_efficiency * 1e6  # 2 GPUs: one node
    tp = estimate_profile(small_gpt, A100, Parallelism(tensor=8, pipeline=2, data=2))
    assert tp.estimate.stage_link.kind == tp.estimate.data_parallel_link.kind == "infiniband"
    # its norms and its attention output's and MLP down projection's biases whole on each of the t ranks, the rest
    # split 8 ways (e849119)
    whole = small_gpt.layers[1].norm_param_bytes + 2 * H * 2  # two biases of the width, fp16
    assert whole and (tp.layers[1].param_bytes - whole) * 8 == one.layers[1].param_bytes - whole
    full = estimate_profile(small_gpt, A100, Parallelism(pipeline=2, recompute="full"))
    assert full.layers[1].bwd.median_ms == pytest.approx(one.layers[1].bwd.median_ms + one.layers[1].fwd.median_ms)
    with pytest.raises(EstimateError, match="does not divide"):
        estimate_profile(small_gpt, A100, Parallelism(tensor=3))


def test_a_data_parallel_group_with_ranks_on_every_node_crosses_on_as_many_nics():
    nic = A100.network.gbit_s / 8 * A100.curve.network_efficiency * 1e6
    one_per_node = placement_links(A100, Parallelism(tensor=8, data=4)).data
    four_per_node = placement_links(A100, Parallelism(tensor=2, data=16)).data
    assert one_per_node.kind == four_per_node.kind == "infiniband"
    assert (one_per_node.bytes_per_ms, four_per_node.bytes_per_ms) == (nic, 4 * nic)
    assert placement_links(A100, Parallelism(tensor=2, data=4)).data.kind == "nvlink"  # 8 GPUs: one node


def test_a_curve_fitted_to_a_profile_recovers_the_curve_that_made_it_and_predicts_another_size(small_gpt):
    """A slow part (compute-bound products), a profile estimated on a known curve, the curve fitted back by
    least squares from the profile's layer times and the count alone, with the kernel overhead fitted or given."""
    from pipesim.planning.estimate import curve_for, fit_rates

    torch = pytest.importorskip("torch")
    from pipesim.workload.count import count_built

    slow = A100.model_copy(update={"dense_tflops": A100.dense_tflops.model_copy(update={"fp16": 0.01}),
                                   "memory_bandwidth_gb_s": 10.0})
    truth = A100.curve.model_copy(update={"matmul_efficiency": 0.7, "memory_efficiency": 0.6,
                                          "kernel_overhead_ms": 0.02})
    measured = estimate_profile(small_gpt, slow, Parallelism(), curve=truth)
    peak, bandwidth = slow.dense_tflops.fp16 * 1e9, slow.memory_bandwidth_gb_s * 1e6
    for overhead in (None, 0.02):
        rates = fit_rates(measured, small_gpt, A100.curve.multiprocessors, A100.curve.tiles, overhead)
        assert rates.kernel_overhead_measured == (overhead is not None)
        fitted = curve_for(rates, peak, bandwidth, A100.curve, "fitted in a test")
        assert (fitted.matmul_efficiency, fitted.memory_efficiency, fitted.kernel_overhead_ms) == pytest.approx(
            (0.7, 0.6, 0.02), rel=1e-6)
        assert all(abs(r) < 1e-6 for r in rates.residuals["fwd"] + rates.residuals["bwd"] if r is not None)
    assert fitted.attention_efficiency == A100.curve.attention_efficiency  # no fused kernel counted: kept
    larger = count_built("gpt", dict(layers=2, width=2 * H, heads=HEADS, seq_len=S, vocab=512), B, torch.float16)
    predicted = estimate_profile(larger, slow, Parallelism(), curve=fitted)
    actual = estimate_profile(larger, slow, Parallelism(), curve=truth)
    assert [layer.bwd.median_ms for layer in predicted.layers] == pytest.approx(
        [layer.bwd.median_ms for layer in actual.layers], rel=1e-6)
    with pytest.raises(EstimateError, match="layers"):
        fit_rates(measured, replace(larger, layers=larger.layers[:2]), 1, [(1, 1)])
    with pytest.raises(EstimateError, match="memory_efficiency"):  # a datasheet below what was measured
        curve_for(rates, peak, bandwidth / 2, A100.curve, "x")


# --- a profile read back at another placement (issue 40) ---


def _written(small_gpt, parallel: Parallelism, path):
    """The estimate as `pipesim estimate --out` writes it, read back."""
    from pipesim.profiles.schema import load_profile, profile_json

    path.write_text(profile_json(estimate_profile(small_gpt, A100, parallel)))
    return load_profile(path)


def _placed(profile, p: int, d: int, sharded: bool = False):
    """A 1F1B run of `profile` at p, d: its scenario, schedule, costs and links."""
    from pipesim.planning.scenario import profile_scenario
    from pipesim.schedules import ScheduleParams

    scenario = profile_scenario(profile, "adam")
    sched = scenario.build("1f1b", ScheduleParams(p, 8, data_parallel=d, zero=int(sharded)))
    return scenario, sched, scenario.costs(sched), scenario.links(sched)


def test_an_estimate_read_at_another_d_or_p_is_priced_on_that_placements_links(small_gpt, tmp_path):
    """t = 2, p = 4 fill an 8-GPU node: estimated at d = 1 its data-parallel group is NVLink, at d = 2 it spans
    two nodes (InfiniBand). The d = 1 profile read at d = 2 kept NVLink (issue 40: 1,419 ms against 1,434 ms
    estimated at d = 2); now it runs exactly as the d = 2 estimate. Likewise t = 4 estimated at p = 2 and read at
    p = 4: its stage boundaries leave the node."""
    from pipesim.sim import simulate
    from pipesim.traces import summarize
    from tests.conftest import pipesim

    one = _written(small_gpt, Parallelism(tensor=2, pipeline=4, data=1), tmp_path / "d1.json")
    two = _written(small_gpt, Parallelism(tensor=2, pipeline=4, data=2), tmp_path / "d2.json")
    assert (one.estimate.data_parallel_link.kind, two.estimate.data_parallel_link.kind) == ("nvlink", "infiniband")
    assert one.estimate.placement == two.estimate.placement and one.estimate.placement.gpus_per_node == 8
    runs = {}
    for name, profile in (("d1", one), ("d2", two)):
        scenario, sched, costs, links = _placed(profile, 4, 2)
        assert scenario.data_parallel_link(sched).source == "the estimate's infiniband"
        runs[name] = summarize(simulate(sched, costs, links)).makespan_ms
    assert runs["d1"] == runs["d2"]
    code, out, err = pipesim("simulate", "--profile", tmp_path / "d1.json", "-s", "1f1b", "--data-parallel", 2)
    assert code == 0 and "meta device at p=4 d=1, links priced for this run's p and d;" in " ".join(out.split()), err
    shallow = _written(small_gpt, Parallelism(tensor=4, pipeline=2), tmp_path / "p2.json")
    deep = _written(small_gpt, Parallelism(tensor=4, pipeline=4), tmp_path / "p4.json")
    assert shallow.estimate.stage_link != deep.estimate.stage_link
    read_deeper = _placed(shallow, 4, 1)[3].links[0, 1].segments
    assert read_deeper == _placed(deep, 4, 1)[3].links[0, 1].segments == (
        (0, deep.estimate.stage_link.latency_ms, deep.estimate.stage_link.bytes_per_ms),)


def test_stage_boundaries_gather_the_ranks_shares_only_without_sequence_parallelism(small_gpt, tmp_path):
    """t = 8 fills a node, so p = 2 sends the boundary between nodes, 1/t a rank on its own NIC. Without sequence
    parallelism Megatron-LM's scatter/gather all-gathers the shares on NVLink after (1/network + 7/node a byte);
    under it each rank's share is its own sequence shard, which Megatron-LM and Megatron-core send as it is: the
    network alone. A t = 4 estimate at p = 2 (one node) read at p = 4 keeps its sequence parallelism."""
    from pipesim.planning.estimate import links_of, node_placement

    placement = node_placement(A100)
    network, node = placement.network_link, placement.node_link
    gathered = links_of(placement, t=8, p=2, d=1).stage
    assert gathered.bytes_per_ms == pytest.approx(1 / (1 / network.bytes_per_ms + 7 / node.bytes_per_ms))
    assert links_of(placement, t=8, p=2, d=1, sequence_parallel=True).stage == network
    shards = _written(small_gpt, Parallelism(tensor=4, pipeline=2, sequence_parallel=True), tmp_path / "sp.json")
    assert _placed(shards, 4, 1)[3].links[0, 1].segments == ((0, network.latency_ms, network.bytes_per_ms),)
    whole = _written(small_gpt, Parallelism(tensor=4, pipeline=2), tmp_path / "whole.json")
    assert _placed(whole, 4, 1)[3].links[0, 1].segments[0][2] < network.bytes_per_ms


def test_an_estimate_without_its_placement_still_loads_and_is_refused_where_its_links_would_differ(
        small_gpt, tmp_path):
    """An older pipesim's estimate (no `placement`) runs at its own p and d; at another d it is refused in one
    line naming what differs and how to re-estimate, and nothing is written."""
    import json

    from pipesim.profiles.schema import load_profile
    from pipesim.sim import CostError
    from tests.conftest import pipesim

    new = _written(small_gpt, Parallelism(tensor=2, pipeline=4, data=1), tmp_path / "new.json")
    raw = json.loads((tmp_path / "new.json").read_text())
    del raw["estimate"]["placement"]
    (tmp_path / "old.json").write_text(json.dumps(raw))
    old = load_profile(tmp_path / "old.json")
    assert old.estimate.placement is None
    (_, _, old_costs, old_links), (_, _, new_costs, new_links) = _placed(old, 4, 1), _placed(new, 4, 1)
    assert old_costs.stages == new_costs.stages and old_links == new_links
    with pytest.raises(CostError, match="estimated for t=2 p=4 d=1 .* re-estimate it"):
        _placed(old, 4, 2)
    code, out, err = pipesim("simulate", "--profile", tmp_path / "old.json", "-s", "1f1b", "--data-parallel", 2,
                             "--trace", tmp_path / "t.json")
    assert code == 2 and err.count("\n") == 1 and "Traceback" not in err, err
    assert "links of p=4 d=2 cannot be priced" in err and "--stages 4 --data-parallel 2" in err
    assert not (tmp_path / "t.json").exists()


def test_a_sharded_estimate_read_at_another_d_updates_and_holds_that_ds_shard(small_gpt, tmp_path):
    """ZeRO-1 estimated over d = 2 holds and steps over half the optimizer state; read at d = 4 it is a quarter,
    as the estimate at d = 4 prices it."""
    two = _written(small_gpt, Parallelism(pipeline=2, data=2, sharded_optimizer=True), tmp_path / "d2.json")
    four = _written(small_gpt, Parallelism(pipeline=2, data=4, sharded_optimizer=True), tmp_path / "d4.json")
    read, estimated = (_placed(profile, 2, 4, sharded=True)[2].stages for profile in (two, four))
    assert [c.opt_ms for c in read] == pytest.approx([c.opt_ms for c in estimated], rel=1e-9)
    assert [c.optimizer_state_bytes for c in read] == [c.optimizer_state_bytes for c in estimated]
    assert read[0].opt_ms < _placed(two, 2, 2, sharded=True)[2].stages[0].opt_ms


def test_an_unsharded_estimate_run_sharded_steps_over_the_schedules_shard(small_gpt, tmp_path):
    """Estimated without ZeRO-1 and run with it at d = 2: each replica steps over half the state, as the estimate
    made sharded at d = 2 prices it (the step was the whole state's on every replica)."""
    plain = _written(small_gpt, Parallelism(pipeline=2, data=2), tmp_path / "plain.json")
    sharded = _written(small_gpt, Parallelism(pipeline=2, data=2, sharded_optimizer=True), tmp_path / "zero1.json")
    read, estimated = (_placed(profile, 2, 2, sharded=True)[2].stages for profile in (plain, sharded))
    assert [c.opt_ms for c in read] == pytest.approx([c.opt_ms for c in estimated], rel=1e-9)
    assert [c.optimizer_state_bytes for c in read] == [c.optimizer_state_bytes for c in estimated]


def test_tune_reads_an_estimates_t_as_gpus_per_stage(small_gpt, tmp_path):
    """An estimate for t = 2 stands for 2 GPUs per stage: on 8 GPUs tune searches p·d = 4, not 8."""
    import json

    from tests.conftest import pipesim

    _written(small_gpt, Parallelism(tensor=2, pipeline=2), tmp_path / "t2.json")
    code, out, err = pipesim("tune", "--profile", tmp_path / "t2.json", "-D", 8, "-s", "1f1b", "--json")
    assert code == 0, err
    doc = json.loads(out)
    rows = [doc["choice"], *doc["runners_up"]]
    assert {r["tensor_parallel"] for r in rows} == {2} and {r["stages"] * r["replicas"] for r in rows} == {4}
    code, _, err = pipesim("tune", "--profile", tmp_path / "t2.json", "-D", 7, "-s", "1f1b")
    assert code == 2 and ("--devices: give a multiple of 2, as the profile was estimated for t=2 "
                          "GPUs per stage (got 7)" in err)


def test_repeated_blocks_are_priced_once_and_alike(small_gpt, monkeypatch):
    """A model's blocks repeat: each kind of alike blocks is priced once (tune prices hundreds of profiles of an
    80-block model), and every block of it gets the same times and bytes."""
    from dataclasses import replace

    from pipesim.planning import estimate

    deep = replace(small_gpt, layers=[small_gpt.layers[0], *[small_gpt.layers[1]] * 6, *small_gpt.layers[3:]])
    priced = []
    pricing = estimate.estimate_layer
    monkeypatch.setattr(estimate, "estimate_layer", lambda layer, *args: priced.append(layer) or pricing(layer, *args))
    profile = estimate_profile(deep, A100, Parallelism(pipeline=2))
    assert [layer.name for layer in priced] == [deep.layers[0].name, deep.layers[1].name, *(
        layer.name for layer in small_gpt.layers[3:])]  # embedding, one block for six, head
    blocks = profile.layers[1:7]
    assert all((b.fwd, b.bwd, b.igrad, b.wgrad, b.activation_bytes) == (blocks[0].fwd, blocks[0].bwd, blocks[0].igrad,
                                                                         blocks[0].wgrad, blocks[0].activation_bytes)
               for b in blocks)


def test_torchtitans_op_policy_keeps_every_other_product_and_the_attention():
    """torchtitan's selective op policy on a Llama block's forward (q, k, v, o, then w1, w3, w2; k and v counted
    as one op of two calls): it keeps products 1, 3, 5, 7 (q, v, w1, w2), the attention's output and float32
    log-sum-exp, and the block's input, and reruns products 2, 4, 6 and the memory-bound ops."""
    tokens, width, kv, ffn, heads = B * S, H, H // 4, 4 * H, HEADS

    def mm(n: int, k: int, count: int = 1) -> OpCount:
        return OpCount("mm", "matmul", (1, tokens, n, k), 2 * tokens * n * k, 0, count)

    norm = OpCount("rms_norm", "memory", (B, S, H), 0, 4 * tokens * width, 2)
    attention = OpCount("flash", "attention", (B * heads, S, S, width // heads), 4 * B * S * S * width, 0, 1)
    ops = (norm, mm(width, width), mm(kv, width, 2), attention, mm(width, width), mm(ffn, width), mm(ffn, width),
           mm(width, ffn))
    block = replace(_block([((B, S, H), 10**9)]), ops={"fwd": ops})
    kept = estimate_layer(block, DEVICE, Parallelism(recompute="op"), placement_links(
        A100, Parallelism()).tensor, 2)
    products = 2 * tokens * (width + kv + ffn + width)  # q, one of k and v, w1, w2
    assert kept.activation_bytes == 2 * tokens * width + products + B * S * width * 2 + B * heads * S * 4
    assert kept.activation_parts["attention"] == B * S * width * 2 + B * heads * S * 4
    assert kept.bwd_ms > estimate_layer(block, DEVICE, Parallelism(), placement_links(A100, Parallelism()).tensor,
                                        2).bwd_ms  # it reruns what it did not keep
    with pytest.raises(EstimateError, match="op .* is modelled for tensor 1 only"):
        Parallelism(tensor=2, recompute="op")


def test_an_estimate_over_its_gpus_memory_warns_as_simulate_does(tmp_path):
    """estimate's table gives each stage's peak on its GPU; one over the GPU's memory is warned of on stderr in
    simulate's words (commands/common.py out_of_memory_line), not left for the reader to compare."""
    from tests.conftest import pipesim

    shape = ("--gpu", "l40s", "--model", "gpt", "--layers", 2, "--width", 1024, "--heads", 8, "--seq-len", 4096,
             "-p", 2)
    code, out, err = pipesim("estimate", *shape, "-b", 64, "--out", tmp_path / "over.json")
    assert code == 0 and "wrote" in out, err
    assert re.fullmatch(r"warning: the 1F1B estimate runs out of memory: device 0 peaks at [\d,.]+ MiB, more than its "
                        r"45,486 MiB( \(and 1 more out of memory\))?\n", err), err  # torch's 44.42 GiB of 48
    code, out, err = pipesim("estimate", *shape, "-b", 16, "--out", tmp_path / "within.json")
    assert code == 0 and "alloc MiB" in out and err == "", err


def test_an_estimate_read_back_says_its_peak_is_the_tensors_alone_below_gpus_replay(tmp_path):
    """simulate --profile of a written estimate has no allocations to replay through the caching allocator, so its
    peak is below simulate --gpu's of the same flags: the caption says which each is, not two figures for one."""
    import json

    from tests.conftest import pipesim

    shape = ("--gpu", "a100-sxm-80gb", "--model", "gpt", "--layers", 2, "--width", 512, "--heads", 8, "--seq-len", 512,
             "-b", 2, "-p", 2)
    assert pipesim("estimate", *shape, "--out", tmp_path / "e.json").code == 0
    run = ("-s", "1f1b", "-m", 4)
    code, read, err = pipesim("simulate", "--profile", tmp_path / "e.json", "-p", 2, *run)
    assert code == 0, err
    code, counted, err = pipesim("simulate", *shape, *run)
    assert code == 0, err
    note = "peak: the tensors alone (max allocated): a profile holds no allocations to replay"
    assert note in " ".join(read.split()) and note not in " ".join(counted.split())
    peaks = [json.loads(pipesim("simulate", *source, *run, "--json").out)["results"][0]["peak_memory_mb"]
             for source in (("--profile", tmp_path / "e.json", "-p", 2), shape)]
    assert peaks[0] < peaks[1]


def test_tune_and_sweep_of_an_estimate_read_back_say_their_peaks_are_the_tensors_alone(tmp_path):
    """tune --profile and sweep --profile of a written estimate show the tensors-alone peaks and tune no MFU column,
    as simulate --profile's does: their captions say so in simulate's words (they said nothing), and a calibration's
    and --gpu's do not."""

    from tests.conftest import pipesim

    shape = ("--gpu", "a100-sxm-80gb", "--model", "gpt", "--layers", 2, "--width", 512, "--heads", 8, "--seq-len", 512,
             "-b", 2, "-p", 2)
    assert pipesim("estimate", *shape, "--out", tmp_path / "e.json").code == 0
    note = ("peak: the tensors alone (max allocated): a profile holds no allocations to replay through the caching "
            "allocator, as simulate --gpu does (max reserved)")
    for command, source, said in (
            (("tune", "-D", 2, "-s", "1f1b"), ("--profile", tmp_path / "e.json"), True),
            (("sweep", "-p", 2, "-m", 4, "-s", "1f1b"), ("--profile", tmp_path / "e.json"), True),
            (("tune", "-D", 2, "-s", "1f1b"), ("--profile", GPT_CPU), False),
            (("sweep", "-p", 2, "-m", 4, "-s", "1f1b"), shape[:-2], False)):
        code, out, err = pipesim(*command, *source)
        assert code == 0, err
        assert (note in " ".join(out.split())) == said, (command, source)
        if command[0] == "tune" and said:
            assert "MFU: the simulate command below gives the choice's" in " ".join(out.split())
            assert "MFU" not in next(line for line in out.splitlines() if "samples/s" in line)  # no column


@pytest.mark.parametrize("seq_len", [32, 64])
def test_a_norms_output_as_wide_as_the_sequence_is_no_attention_core(seq_len):
    """At s tokens as wide as the model (a 70B's 8,192 at --seq-len 8192) the residual stream's tensors end in (s, s)
    as an attention core's do: its norms' outputs were split by t as core tensors, so torch's runtime, which keeps
    the products' inputs whole (`gathered_saves`), held what Megatron's does (332 MiB a 70B layer under both; at
    4,096 tokens 166 against 278). At 64 = the width, as at 32, it holds more."""
    import torch

    from pipesim.planning.estimate import Parallelism, estimate_profile
    from pipesim.workload.count import count_built
    from tests.helpers import H100

    counted = count_built("gpt", {"layers": 2, "width": 64, "heads": 4, "seq_len": seq_len, "vocab": 128}, 1,
                          torch.bfloat16)
    held = {runtime: estimate_profile(counted, H100, Parallelism(tensor=2, sequence_parallel=True,
                                                                 tp_runtime=runtime)).layers[1].activation_bytes
            for runtime in ("megatron", "torch")}
    assert held["torch"] > held["megatron"], held


@pytest.mark.parametrize("degrees", [(), ("--data-parallel", 2, "--zero", 1)])
def test_an_estimates_alloc_column_is_the_1f1b_peak_simulate_gives_its_profile(degrees, tmp_path):
    """estimate's alloc column, and the fit it warns by, is each stage's 1F1B peak of the tensors alone as
    `simulate --profile` gives it with the estimate's d and sharding: the transfer buffers and a pass's transient
    tensors included (it had left them out, and read a Llama 3.1 8B's last stage on an L40S as fitting, 48,444 MiB
    of 49,152, where 1F1B peaks at 52,484)."""
    import json

    from tests.conftest import pipesim

    shape = ("--gpu", "a100-sxm-80gb", "--model", "gpt", "--layers", 4, "--width", 512, "--heads", 8, "--seq-len", 512,
             "-b", 2, "-p", 2, *degrees)
    code, out, err = pipesim("estimate", *shape, "--out", tmp_path / "e.json")
    assert code == 0, err
    printed = [float(line.split()[-1].replace(",", "")) for line in out.splitlines() if re.match(r" \d +\d", line)]
    code, read, err = pipesim("simulate", "--profile", tmp_path / "e.json", "-s", "1f1b", "-m", 8, *degrees, "--json")
    assert code == 0, err
    simulated = json.loads(read)["results"][0]["devices"]
    assert len(printed) == 2 and printed == [round(device["peak_memory_mb"]) for device in simulated]  # > 100 MiB
    assert all(device["peak_memory_parts_mb"]["transient"] > 0 for device in simulated)


def test_simulating_an_estimate_takes_its_data_parallel_replicas_and_sharding_unless_told_otherwise(tmp_path):
    """`simulate --profile E.json` (and `sweep`'s) of an estimate at d = 2 with ZeRO-1 runs its d and ZeRO by
    default, as the estimate counted its memory and as `estimate`'s own check runs it: it ran one replica, whose
    unsharded optimizer read a Llama 3.1 8B at p = 4, d = 8 as out of memory (83,101 MiB) where the estimate fits
    (60,368). Given flags still say what runs."""
    import json

    from tests.conftest import pipesim

    degrees = ("--data-parallel", 2, "--zero", 1)
    code, _, err = pipesim("estimate", "--gpu", "a100-sxm-80gb", "--model", "gpt", "--layers", 4, "--width", 512,
                           "--heads", 8, "--seq-len", 512, "-b", 2, "-p", 2, *degrees, "--out", tmp_path / "e.json")
    assert code == 0, err
    runs = {}
    for case, flags in (("default", ()), ("given", degrees), ("unsharded", ("--zero", 0)),
                        ("one replica", ("--data-parallel", 1))):
        code, out, err = pipesim("simulate", "--profile", tmp_path / "e.json", "-s", "1f1b", "-m", 8, *flags, "--json")
        assert code == 0, (case, err)
        runs[case] = json.loads(out)["results"][0]
    assert runs["default"] == runs["given"]
    assert runs["default"]["samples_per_s"] > 1.5 * runs["one replica"]["samples_per_s"]  # two replicas' samples
    parts = [run["devices"][0]["peak_memory_parts_mb"]["optimizer_state"] for run in (runs["default"],
                                                                                        runs["unsharded"])]
    assert parts[1] == pytest.approx(2 * parts[0])  # the optimizer state over d = 2, or whole
    rows = []
    for flags in ((), degrees):  # sweep alike
        code, out, err = pipesim("sweep", "--profile", tmp_path / "e.json", "-s", "1f1b", "-p", 2, "-m", 8, *flags)
        assert code == 0, err
        rows.append(next(line.split() for line in out.splitlines() if line.split()[:1] == ["1f1b"]))
    assert rows[0] == rows[1]
    assert float(rows[0][4].replace(",", "")) == pytest.approx(runs["default"]["samples_per_s"], rel=0.01)
    assert "d=2 replicas in every row, ZeRO-1" in " ".join(out.split())  # no column shows them


@pytest.mark.parametrize("estimated,simulated,said", [
    # the optimizer sharded over C = 2 context-parallel ranks at d = 1: one replica, nothing to refuse
    (("--context-parallel", 2, "--attention", "flash", "--zero", 1), (), "t x C = 1 x 2 GPUs per device"),
    (("--data-parallel", 2, "--zero", 3, "--precision", "fsdp2"), (), "d=2 replicas, ZeRO-3"),  # as estimated
    (("--data-parallel", 2, "--zero", 1), ("--reduce-after-flush",), "d=2 replicas, ZeRO-1"),  # checked at d = 2
])
def test_an_estimates_replicas_are_taken_before_the_flags_that_need_them_are_checked(tmp_path, estimated, simulated,
                                                                                     said):
    """The review's cases: an estimate sharded over context-parallel ranks at d = 1 was refused a --zero 1 nobody
    gave; FSDP2's needs its ZeRO-3; --reduce-after-flush was refused at d = 1 before the estimate's d was taken."""
    from tests.conftest import pipesim

    code, _, err = pipesim("estimate", "--gpu", "h100-sxm", "--model", "gpt", "--layers", 4, "--width", 512,
                           "--heads", 8, "--seq-len", 512, "-b", 2, "-p", 2, *estimated, "--out", tmp_path / "e.json")
    assert code == 0, err
    code, out, err = pipesim("simulate", "--profile", tmp_path / "e.json", "-s", "1f1b", "-m", 8, *simulated)
    assert code == 0, err
    assert said in out.splitlines()[0]


def test_a_schedule_file_beside_an_expert_parallel_estimate_stays_one_replica(tmp_path):
    """A schedule file is one pipeline's ranks: an estimate's d is not taken for it, so an estimate whose E = 4
    expert ranks need four replicas is refused, as before (taken, it ran all-to-alls over 4 ranks in one)."""
    from tests.conftest import pipesim

    code, _, err = pipesim("estimate", "--gpu", "h100-sxm", "--model", "gpt", "--layers", 4, "--width", 512,
                           "--heads", 8, "--seq-len", 512, "-b", 2, "-p", 2, "--experts", 4, "--top-k", 2,
                           "--data-parallel", 4, "--expert-parallel", 4, "--out", tmp_path / "e.json")
    assert code == 0, err
    code, out, err = pipesim("simulate", "--profile", tmp_path / "e.json", "--schedule-file",
                             REPO / "examples" / "order.csv")
    assert code == 2 and err.startswith("error: --data-parallel 1: the profile was estimated with --expert-parallel 4")


def test_tune_says_it_does_not_shard_the_optimizer_an_estimate_sharded(tmp_path):
    """`tune --profile` refuses --zero (it shards --gpu's estimates alone), so an estimate made with ZeRO-1 is
    planned with each replica holding the whole optimizer state: the note says so, and how to search it sharded.
    An estimate without a sharded optimizer gets no such note."""
    import json

    from tests.conftest import pipesim

    shape = ("--gpu", "a100-sxm-80gb", "--model", "gpt", "--layers", 4, "--width", 512, "--heads", 8, "--seq-len", 512,
             "-b", 2, "-p", 2)
    notes = []
    for name, degrees in (("sharded", ("--data-parallel", 2, "--zero", 1)), ("whole", ("--data-parallel", 2))):
        code, _, err = pipesim("estimate", *shape, *degrees, "--out", tmp_path / f"{name}.json")
        assert code == 0, err
        code, out, err = pipesim("tune", "--profile", tmp_path / f"{name}.json", "-D", 4, "-B", 8, "-s", "1f1b",
                                 "--json")
        assert code == 0, err
        notes.append(json.loads(out)["notes"])
    assert ["the profile was estimated sharded over 2 ranks (--zero 1), which tune --profile does not shard: each "
            "replica here holds the whole optimizer state; --gpu with --model and --zero 1 searches it sharded"] == [
        note for note in notes[0] if "sharded" in note]
    assert not any("sharded" in note for note in notes[1])


@pytest.mark.parametrize("command", ["simulate", "sweep"])
def test_a_gpu_what_ifs_caption_says_which_peak_it_shows(command):
    """simulate's and sweep's --gpu caption says whether its peak is max reserved (the caching allocator replayed,
    with expandable segments where asked) or the tensors alone (--allocator none, or a mixture of experts, whose
    step is not replayed): the captions were the same, so --allocator none's table read as the caching one's, and
    sweep's said --allocator none whatever the allocator (it read the flags' scenario, not the estimate's)."""
    from tests.conftest import pipesim

    shape = ("--gpu", "h100-sxm", "--model", "gpt", "--layers", 2, "--width", 256, "--heads", 4, "--seq-len", 256,
             "-p", 2, "-m", 4, "-s", "1f1b")
    said = {}
    for case, flags in (("caching", ()), ("expandable", ("--allocator", "expandable")),
                        ("none", ("--allocator", "none")),
                        ("experts", ("--experts", 4, "--expert-parallel", 2, "--data-parallel", 2))):
        code, out, err = pipesim(command, *shape, *flags)
        assert code == 0, err
        said[case] = " ".join(out.split())
    replayed = ("peak: max reserved, the tensors and the segments torch's caching allocator keeps cached (its step "
                "replayed")
    assert f"{replayed})" in said["caching"] and f"{replayed}, with expandable segments)" in said["expandable"]
    assert "peak: the tensors alone (max allocated: --allocator none)" in said["none"]
    assert ("peak: the tensors alone (max allocated: a mixture of experts' step is not replayed through the caching "
            "allocator)") in said["experts"]
    assert sum("peak: " in text for text in said.values()) == 4 and "--allocator none" not in said["caching"]


def test_estimates_caption_says_simulate_gpu_replays_no_mixture_of_experts(tmp_path):
    """estimate's caption said simulate --gpu's peak adds the caching allocator's reserve for every model; of a
    mixture of experts it is the tensors alone too (its step is not replayed), as simulate's caption says."""
    from tests.conftest import pipesim

    shape = ("--gpu", "h100-sxm", "--model", "gpt", "--layers", 2, "--width", 256, "--heads", 4, "--seq-len", 256,
             "-p", 2)
    said = {}
    for case, flags in (("dense", ()), ("experts", ("--experts", 4, "--expert-parallel", 2, "--data-parallel", 2))):
        code, out, err = pipesim("estimate", *shape, *flags, "-o", tmp_path / f"{case}.json")
        assert code == 0, err
        said[case] = " ".join(out.split())
    assert "simulate --gpu's peak adds the segments torch's caching allocator keeps cached" in said["dense"]
    assert ("simulate --gpu's peak is the tensors alone too (a mixture of experts' step is not replayed through the "
            "caching allocator)") in said["experts"] and "keeps cached" not in said["experts"]


def test_a_mixture_of_experts_estimate_run_with_the_other_sharding_holds_what_the_estimate_made_so_holds(tmp_path):
    """Unsharded, a rank holds the state of its own 1/E of the routed experts; sharded, its d-th of every expert's
    (Megatron-core shards them over their own d/E ranks). Resharded by d alone, DeepSeek-V3 estimated at E = 64
    and run with --zero 1 read 110 MiB of optimizer state a rank where the estimate made sharded holds 3,087, and
    the other way 395,072 where it holds 14,048. Either estimate now runs either way as the other was made; and a
    --data-parallel or --expert-parallel that restates the estimate's own keeps its sharding and runs."""
    from tests.conftest import pipesim

    model = ["--gpu", "h100-sxm", "--model", "gpt", "--layers", 2, "--width", 64, "--heads", 4, "--seq-len", 32,
             "--vocab", 100, "--experts", 8, "--expert-parallel", 4, "--data-parallel", 8, "-p", 2]
    for name, zero in (("plain", []), ("zero1", ["--zero", 1])):
        code, _, err = pipesim("estimate", *model, *zero, "-o", tmp_path / f"{name}.json")
        assert code == 0, err

    def held(name: str, *flags) -> tuple[list[float], float]:
        code, out, err = pipesim("simulate", "--profile", tmp_path / f"{name}.json", "-s", "1f1b", "--json", *flags)
        assert code == 0, err
        [result] = json.loads(out)["results"]
        state_mb = [device["peak_memory_parts_mb"]["optimizer_state"] for device in result["devices"]]
        return state_mb, result["time_per_minibatch_ms"]

    for zero in (0, 1):
        (plain, plain_ms), (sharded, sharded_ms) = held("plain", "--zero", zero), held("zero1", "--zero", zero)
        assert plain == pytest.approx(sharded, rel=1e-4) and plain_ms == pytest.approx(sharded_ms, rel=1e-6), zero
    assert held("zero1")[0] < held("plain")[0]  # each runs as made where nothing is said
    assert held("zero1", "--data-parallel", 8, "--expert-parallel", 4) == held("zero1")


def test_the_links_line_names_a_tensor_parallel_group_only_where_there_is_one_and_the_header_writes_c_whole(tmp_path):
    """At t = 1 the links line named a tensor-parallel group's NVLink (a group of one GPU talks over nothing), and
    the header wrote C = 1,024 as 1024 where the caption wrote it 1,024."""
    from tests.conftest import pipesim

    gpt = ("--gpu", "h100-sxm", "--model", "gpt", "--layers", 2, "--width", 64, "--heads", 2, "--seq-len", 4096,
           "--attention", "flash", "-p", 1)
    for tensor, named in ((1, False), (2, True)):
        code, out, err = pipesim("estimate", *gpt, "--tensor-parallel", tensor, "--out", tmp_path / f"{tensor}.json")
        assert code == 0, err
        links = " ".join(out.split()).split("links: ")[1]
        assert links.startswith("tensor-parallel group nvlink") is named, links
    code, out, err = pipesim("simulate", *gpt, "--context-parallel", 1024, "-m", 1, "-s", "1f1b")
    assert code == 0, err
    assert out.splitlines()[0].endswith("t x C = 1 x 1,024 GPUs per device")
