"""Tensor parallelism beyond a node and overlapped, data-parallel collectives at scale (issue 42, item 4)."""

import json
from dataclasses import replace

import pytest

from pipesim.hardware import collectives
from pipesim.planning.estimate import Device, EstimateError, Parallelism, estimate_layer, op_ms, placement_links
from pipesim.profiles.workload import WorkloadCount
from pipesim.units import GIB
from tests.conftest import needs_transformers, pipesim
from tests.helpers import A100
from tests.helpers import A100_FP16 as DEVICE
from tests.helpers import TP_LLAMA_JSON as LLAMA

NIC_BYTES_PER_MS = A100.network.gbit_s / 8 * A100.curve.network_efficiency * 1e6  # NCCL's 24 of HDR's 25 GB/s
NVLINK_BYTES_PER_MS = A100.intra_node.gb_s_per_direction * A100.curve.link_efficiency * 1e6
S, B, H, HEADS = 128, 2, 256, 16  # 16 heads: t = 16 divides them


@pytest.fixture(scope="module")
def gpt16() -> WorkloadCount:
    torch = pytest.importorskip("torch")
    from pipesim.workload.count import count_built

    return count_built("gpt", dict(layers=2, width=H, heads=HEADS, seq_len=S, vocab=512), B, torch.float16)


def test_a_tensor_parallel_group_of_two_nodes_crosses_on_every_nic_at_nccls_mixed_step_latency():
    link = placement_links(A100, Parallelism(tensor=16)).tensor
    assert link.kind == "infiniband"
    assert link.bytes_per_ms == min(8 * NIC_BYTES_PER_MS, NVLINK_BYTES_PER_MS)  # 8 NICs of 24 GB/s: 192 GB/s
    # NCCL's ring all-reduce over 16 ranks on 2 nodes: 2·2 of its 30 steps on the network, 26 on NVLink
    assert link.latency_ms == pytest.approx((4 * 0.014 + 26 * 0.0034) / 30)
    assert placement_links(A100, Parallelism(tensor=8)).tensor.kind == "nvlink"  # one node: as before


def test_a_layer_split_over_two_nodes_pays_its_all_reduces_on_the_network(gpt16):
    """The forward's two all-reduces of b·s·h 16-bit elements, priced on the group's link and nothing else: the
    layer's time on a link twice as fast differs by exactly their difference."""
    block = gpt16.layers[1]
    link = placement_links(A100, Parallelism(tensor=16)).tensor
    faster = link.model_copy(update={"bytes_per_ms": 2 * link.bytes_per_ms})
    parallel = Parallelism(tensor=16)
    nbytes = B * S * H * 2
    saved = estimate_layer(block, DEVICE, parallel, link, 2).fwd_ms - estimate_layer(
        block, DEVICE, parallel, faster, 2).fwd_ms
    expected = 2 * (collectives.all_reduce_ms(nbytes, 16, link.latency_ms, link.bytes_per_ms)
                    - collectives.all_reduce_ms(nbytes, 16, link.latency_ms, faster.bytes_per_ms))
    assert saved == pytest.approx(expected)


def test_a_tensor_parallel_group_that_leaves_a_node_must_fill_whole_nodes():
    with pytest.raises(EstimateError, match="tensor: 12 spans nodes of 8 GPUs"):
        placement_links(A100, Parallelism(tensor=12))


GPT16 = ["--model", "gpt", "--layers", 2, "--width", 192, "--heads", 48, "--seq-len", S, "--vocab", 512, "-b", 1,
         "--gpu", "a100-sxm-80gb"]


def test_estimate_says_the_tensor_parallel_group_crosses_nodes(tmp_path):
    code, out, err = pipesim("estimate", *GPT16, "--tensor-parallel", 16, "--out", tmp_path / "p.json")
    assert code == 0, err
    assert "tensor-parallel group across 2 nodes infiniband 192 GB/s" in " ".join(out.split())
    code, out, err = pipesim("simulate", *GPT16, "--tensor-parallel", 16, "-p", 1, "-m", 1, "-s", "gpipe")
    assert code == 0, err
    assert "the tensor-parallel group across 2 nodes" in " ".join(out.split())


def test_a_tensor_parallel_degree_that_splits_a_node_is_one_line_and_writes_nothing(tmp_path):
    code, out, err = pipesim("estimate", *GPT16, "--tensor-parallel", 12, "--out", tmp_path / "p.json")
    assert code == 2 and len(err.strip().splitlines()) == 1
    assert "--tensor-parallel 12 spans nodes of 8 GPUs and must fill them" in err
    assert not (tmp_path / "p.json").exists()


# --- --tp-overlap: sequence parallelism's collectives overlapped with the products in t chunks ---

from pipesim.planning.estimate import (  # noqa: E402
    async_tp_ms,
    input_gather_ms,
    overlapped_ms,
    userbuffers_backward_ms,
    userbuffers_forward_ms,
)
from pipesim.profiles.workload import OpCount  # noqa: E402

PRODUCT = OpCount("mm", "matmul", (1, 8192, 6144, 768), 2 * 8192 * 6144 * 768, 2 * (8192 * 768 + 768 * 6144), 1)


@pytest.mark.parametrize("bytes_per_ms, hidden", [(1e12, True), (1e6, False)])
def test_tp_overlap_hides_each_transfer_under_one_chunk_and_exposes_only_what_outlasts_it(bytes_per_ms, hidden):
    t, nbytes = 8, 8192 * 6144 * 2
    link = placement_links(A100, Parallelism(tensor=t)).tensor.model_copy(update={"bytes_per_ms": bytes_per_ms})
    chunk = OpCount("mm", "matmul", (1, 8192 // t, 6144, 768), PRODUCT.flops // t, PRODUCT.moved_bytes // t, 1)
    chunk_ms = op_ms(chunk, DEVICE)
    step_ms = link.latency_ms + nbytes / t / bytes_per_ms  # one of a reduce-scatter's t - 1 steps
    assert (step_ms < chunk_ms) is hidden
    expected = t * chunk_ms + (0.0 if hidden else 2 * (t - 1) * (step_ms - chunk_ms))
    assert overlapped_ms(PRODUCT, DEVICE, t, nbytes, link) == pytest.approx(expected)
    serial = op_ms(PRODUCT, DEVICE) + 2 * collectives.reduce_scatter_ms(nbytes, t, link.latency_ms, bytes_per_ms)
    # chunking costs kernels and tile fill: it pays where the transfers are long, not where they are free
    assert (overlapped_ms(PRODUCT, DEVICE, t, nbytes, link) < serial) is not hidden


def test_torchs_async_tp_makes_a_sequence_parallel_layer_faster_but_no_faster_than_its_products_alone(gpt16):
    block = gpt16.layers[1]
    link = placement_links(A100, Parallelism(tensor=8)).tensor
    free = link.model_copy(update={"latency_ms": 0.0, "bytes_per_ms": 1e15})  # the collectives cost nothing

    def fwd(link, **kwargs) -> float:
        parallel = Parallelism(tensor=8, sequence_parallel=True, tp_runtime="torch", **kwargs)
        return estimate_layer(block, DEVICE, parallel, link, 2).fwd_ms

    assert fwd(free, tp_overlap=True) <= fwd(link, tp_overlap=True) < fwd(link)


@pytest.mark.parametrize("bytes_per_ms", [1e15, 1e6])
def test_userbuffers_pipeline_the_forward_reduce_scatter_in_four_splits_on_the_multiprocessors_left(bytes_per_ms):
    """TransformerEngine's `pipeline` overlap as written in its initialize_ub defaults: 4 splits of the rows, each
    on 108 - 16 of the A100's multiprocessors (its peak in that share, its tiles' waves over 92), each split's
    reduce-scatter of a quarter of the tensor under the next split and the last one's exposed; then the
    all-gather's ring exchange as the chunks of t that torch's async TP prices."""
    t, nbytes = 8, 8192 * 6144 * 2
    link = placement_links(A100, Parallelism(tensor=t)).tensor.model_copy(update={"bytes_per_ms": bytes_per_ms})
    split = OpCount("mm", "matmul", (1, 8192 // 4, 6144, 768), PRODUCT.flops // 4, PRODUCT.moved_bytes // 4, 1)
    narrower = Device(DEVICE.peak_flops_per_ms * 92 / 108, DEVICE.memory_bytes_per_ms,
                      A100.curve.model_copy(update={"multiprocessors": 92}))
    split_ms = op_ms(split, narrower)
    assert split_ms > op_ms(PRODUCT, DEVICE) / 4  # fewer multiprocessors, never faster
    scatter_ms = collectives.reduce_scatter_ms(nbytes / 4, t, link.latency_ms, bytes_per_ms)
    pipelined = split_ms + 3 * max(split_ms, scatter_ms) + scatter_ms
    chunk = OpCount("mm", "matmul", (1, 8192 // t, 6144, 768), PRODUCT.flops // t, PRODUCT.moved_bytes // t, 1)
    chunk_ms, step_ms = op_ms(chunk, DEVICE), link.latency_ms + nbytes / t / bytes_per_ms
    gathered = t * chunk_ms - op_ms(PRODUCT, DEVICE) + (t - 1) * max(step_ms - chunk_ms, 0.0)
    assert userbuffers_forward_ms(PRODUCT, DEVICE, t, nbytes, link) == pytest.approx(pipelined + gathered)


def test_tp_overlap_needs_sequence_parallelism_and_one_node(tmp_path):
    with pytest.raises(EstimateError, match="tp_overlap"):
        Parallelism(tensor=8, tp_overlap=True)
    code, _, err = pipesim("estimate", *GPT16, "--tensor-parallel", 8, "--tp-overlap", "--out", tmp_path / "p.json")
    assert code == 2 and len(err.strip().splitlines()) == 1 and "give --sequence-parallel too" in err
    for given, wanted in (((), " and --sequence-parallel"), (("--sequence-parallel",), "")):  # t = 1: what is missing
        code, _, err = pipesim("estimate", *GPT16, "--tp-overlap", *given, "--out", tmp_path / "p.json")
        assert code == 2 and err.endswith(f"give --tensor-parallel 2 or more{wanted}\n"), err
    code, _, err = pipesim("estimate", *GPT16, "--tensor-parallel", 16, "--sequence-parallel", "--tp-overlap",
                           "--out", tmp_path / "p.json")
    assert code == 2 and len(err.strip().splitlines()) == 1 and "--tp-overlap moves its chunks" in err
    assert err.endswith("spans nodes of 8 GPUs: give --tensor-parallel 8 or fewer, or leave --tp-overlap out\n")
    assert not (tmp_path / "p.json").exists()


# --- data-parallel collectives as NCCL's tuner prices them (hardware/collectives.py) ---

NIC_MS, NVLINK_MS = 0.014, 0.0034  # NCCL's ring step latencies on the network and on NVLink (Simple protocol)


@pytest.mark.parametrize("ranks", [16, 64, 256])
def test_a_data_parallel_ring_all_reduce_pays_nccls_latency_for_each_rank_across_nodes(ranks):
    """One rank a node (t = 8): a large buffer takes the ring, whose latency is NCCL's base and 2(n-1) steps, every
    one across nodes (its tuner counts 2k of them on k nodes, here at most all), the whole x1.4, beside its bytes."""
    nbytes, rate = 2e9, NIC_BYTES_PER_MS
    latency = (collectives.RING_BASE_LATENCY_MS + 2 * (ranks - 1) * NIC_MS) * collectives.RING_PLATEAU
    expected = latency + nbytes * 2 * (ranks - 1) / ranks / rate
    assert collectives.nccl_all_reduce_ms(nbytes, ranks, 1, NVLINK_MS, NIC_MS, rate) == pytest.approx(expected)


def test_the_data_parallel_collective_grows_with_the_ranks_and_takes_the_tree_where_its_hops_are_fewer():
    nbytes, rate = 64e6, NIC_BYTES_PER_MS
    times = [collectives.nccl_all_reduce_ms(nbytes, n, 1, NVLINK_MS, NIC_MS, rate) for n in (16, 64, 256, 1024)]
    assert times == sorted(times) and times[-1] > times[0]
    tree_rate = collectives.TREE_BANDWIDTH_FACTOR * 0.7 * rate  # NCCL's correction for 32-64 MiB (64·2^19 up)
    tree = 2 * 10 * collectives.TREE_HOP_LATENCY_MS + 2 * nbytes / tree_rate
    assert times[-1] == pytest.approx(tree)  # 1,024 nodes: 2·log2(1024) hops beat 2,046 ring steps
    within = collectives.nccl_all_reduce_ms(nbytes, 8, 8, NVLINK_MS, NIC_MS, rate)  # one node: no network step
    assert within == pytest.approx(min(collectives.RING_BASE_LATENCY_MS + 14 * NVLINK_MS + nbytes * 14 / 8 / rate,
                                       2 * 7 * collectives.TREE_HOP_LATENCY_MS + 2 * nbytes / tree_rate))
    huge = GIB  # from 512 MiB the tree runs uncorrected
    assert collectives.nccl_all_reduce_ms(huge, 1024, 1, NVLINK_MS, NIC_MS, rate) == pytest.approx(min(
        2 * 10 * collectives.TREE_HOP_LATENCY_MS + 2 * huge / (collectives.TREE_BANDWIDTH_FACTOR * rate),
        (collectives.RING_BASE_LATENCY_MS + 2046 * NIC_MS) * collectives.RING_PLATEAU + huge * 2046 / 1024 / rate))
    shard = collectives.nccl_reduce_scatter_ms(nbytes, 32, 4, NVLINK_MS, NIC_MS, rate)  # 8 nodes: 7 of 31 steps
    assert shard == pytest.approx(collectives.RING_BASE_LATENCY_MS + 24 * NVLINK_MS + 7 * NIC_MS
                                  + nbytes * 31 / 32 / rate)


def test_an_estimates_reduce_is_priced_over_its_placements_ranks_on_each_node(gpt16):
    from pipesim.planning.estimate import estimate_profile
    from pipesim.planning.scenario import profile_scenario
    from pipesim.schedules import ScheduleParams

    scenario = profile_scenario(estimate_profile(gpt16, A100, Parallelism(tensor=2, pipeline=2, data=16)), "adam")
    sched = scenario.build("1f1b", ScheduleParams(2, 4, data_parallel=16))
    link = scenario.data_parallel_link(sched)
    assert (link.per_node, link.node_latency_ms) == (2, NVLINK_MS)  # t2 p2: 2 replicas on each node of 8
    stage = scenario.costs(sched).stages[0]
    assert stage.reduce_ms == pytest.approx(collectives.nccl_all_reduce_ms(
        stage.param_bytes, 16, 2, NVLINK_MS, NIC_MS, link.bytes_per_ms))


def test_tunes_reduce_bound_stays_below_what_the_simulation_prices(gpt16):
    """tune prunes by a REDUCE that must never exceed the priced one: 16 replicas, 8 on each node, reduce 1 GB
    on NCCL's ring, whose steps inside a node cost 3.4 us, not the 14 us of a plain ring's network steps."""
    from pipesim.planning.estimate import estimate_profile
    from pipesim.planning.scenario import profile_scenario
    from pipesim.planning.tune import _data_link, _mean_reduce_ms
    from pipesim.schedules import ScheduleParams

    scenario = profile_scenario(estimate_profile(gpt16, A100, Parallelism(data=16)), "adam")
    link = scenario.data_parallel_link(scenario.build("gpipe", ScheduleParams(1, 1, data_parallel=16)))
    assert link.per_node == 8
    nbytes = 10 ** 9
    assert 0 < _mean_reduce_ms(_data_link(scenario, 1, 16), 1, 16, nbytes, None, 0, 0, nbytes) <= link.all_reduce_ms(
        nbytes, 16)


@pytest.mark.parametrize("tp_overlap", [False, True])
def test_the_backward_gathers_each_column_parallel_products_input_again_for_its_weight_gradient(tp_overlap):
    """Sequence parallelism's six backward collectives a layer: the input gradients' two reduce-scatters and the
    next two all-gathers as before, and the all-gathers of the QKV and first MLP products' saved inputs, exposed
    where they outlast the input-gradient product they run under. On links slow enough that each does, halving the
    rate adds 2 x (reduce-scatter + all-gather + all-gather) to the backward and 2 x 2 to the forward; the weight
    gradients, which wait for nothing, do not move."""
    torch = pytest.importorskip("torch")
    from pipesim.workload.count import count_built

    width, t = 384, 8  # not B·S: a weight gradient's shape tells its width from its tokens
    block = count_built("gpt", dict(layers=2, width=width, heads=HEADS, seq_len=S, vocab=512), B,
                        torch.float16).layers[1]
    slow = placement_links(A100, Parallelism(tensor=t)).tensor.model_copy(update={"bytes_per_ms": 1e4})
    slower = slow.model_copy(update={"bytes_per_ms": slow.bytes_per_ms / 2})
    parallel = Parallelism(tensor=t, sequence_parallel=True, tp_overlap=tp_overlap)
    on_slow, on_slower = (estimate_layer(block, DEVICE, parallel, link, 2) for link in (slow, slower))
    nbytes = B * S * width * 2
    if tp_overlap:  # each of a collective's t - 1 steps exposed beyond its chunk, whose time cancels
        step = lambda link, size=nbytes: (t - 1) * size / t / link.bytes_per_ms  # noqa: E731
    else:
        step = lambda link, size=nbytes: collectives.reduce_scatter_ms(size, t, link.latency_ms,  # noqa: E731
                                                                       link.bytes_per_ms)
    gather = lambda link: collectives.all_gather_ms(nbytes, t, link.latency_ms, link.bytes_per_ms)  # noqa: E731
    assert on_slower.fwd_ms - on_slow.fwd_ms == pytest.approx(2 * 2 * (step(slower) - step(slow)))
    expected = 2 * (2 * (step(slower) - step(slow)) + gather(slower) - gather(slow))
    assert on_slower.bwd_ms - on_slow.bwd_ms == pytest.approx(expected)
    assert on_slower.igrad_ms - on_slow.igrad_ms == pytest.approx(expected)
    assert on_slower.wgrad_ms == on_slow.wgrad_ms
    # torch's keeps the gathered input (DTensor's autograd): its backward gathers nothing more than its forward
    torch_runtime = replace(parallel, tp_runtime="torch")
    on_slow, on_slower = (estimate_layer(block, DEVICE, torch_runtime, link, 2) for link in (slow, slower))
    assert on_slower.bwd_ms - on_slow.bwd_ms == pytest.approx(2 * 2 * (step(slower) - step(slow)))
    # TransformerEngine's float8 casts before it gathers: the forward's gathers, the backward's of the output
    # gradients and its re-gathers of the saved inputs move 1 byte an element, the reduce-scatters 2
    float8 = replace(parallel, fp8="te")
    device = replace(DEVICE, fp8_peak_flops_per_ms=2 * DEVICE.peak_flops_per_ms)
    on_slow, on_slower = (estimate_layer(block, device, float8, link, 2) for link in (slow, slower))
    half = lambda link: collectives.all_gather_ms(nbytes // 2, t, link.latency_ms, link.bytes_per_ms)  # noqa: E731
    one_of_each = step(slower) - step(slow) + step(slower, nbytes // 2) - step(slow, nbytes // 2)
    assert on_slower.fwd_ms - on_slow.fwd_ms == pytest.approx(2 * one_of_each)
    assert on_slower.bwd_ms - on_slow.bwd_ms == pytest.approx(2 * (one_of_each + half(slower) - half(slow)))


@pytest.mark.parametrize("args, fragment", [
    (["--tp-runtime", "deepspeed"], "--tp-runtime: choose from megatron, torch (got 'deepspeed')"),
    (["--tp-runtime", "torch"], "--tp-runtime sets how sequence-parallel layers keep their inputs: give "
                                "--sequence-parallel too"),
])
def test_a_bad_tp_runtime_is_one_line_and_writes_nothing(args, fragment, tmp_path):
    code, _, err = pipesim("estimate", *GPT16, "--tensor-parallel", 8, *args, "--out", tmp_path / "p.json")
    assert code == 2 and err.strip() == f"error: {fragment}" and not (tmp_path / "p.json").exists()


def test_the_input_gather_hides_under_the_input_gradient_product_up_to_its_length():
    link = placement_links(A100, Parallelism(tensor=8)).tensor
    gather_ms = collectives.all_gather_ms(2**24, 8, link.latency_ms, link.bytes_per_ms)
    assert input_gather_ms(2**24, 2 * gather_ms, 8, link, DEVICE) == 0.0
    assert input_gather_ms(2**24, gather_ms / 4, 8, link, DEVICE) == pytest.approx(3 * gather_ms / 4)


@pytest.mark.parametrize("link_ms_per_product_ms", [0.0, 1.13, 20.0])
def test_userbuffers_backward_scatter_in_bulk_under_the_weight_gradient_and_gather_in_a_ring(link_ms_per_product_ms):
    """NeMo's backward: the input-gradient product whole, its reduce-scatter a bulk overlap under the weight
    gradient (the same m·n·k), exposed only beyond it; the next all-gather a ring exchange over t chunks. Where
    the tensor's time on the link is a little over the product's, the bulk reduce-scatter hides whole while each of
    torch's chunked steps outlasts its chunk."""
    t, (m, n, k) = 8, (8192, 6144, 6144)
    product = OpCount("mm", "matmul", (1, m, n, k), 2 * m * n * k, 2 * (m * k + k * n + m * n), 1)
    chunk = OpCount("mm", "matmul", (1, m // t, n, k), product.flops // t, product.moved_bytes // t, 1)
    nbytes, product_ms, chunk_ms = m * n * 2, op_ms(product, DEVICE), op_ms(chunk, DEVICE)
    bytes_per_ms = nbytes / (link_ms_per_product_ms * product_ms) if link_ms_per_product_ms else 1e15
    link = placement_links(A100, Parallelism(tensor=t)).tensor.model_copy(update={"latency_ms": 0.0,
                                                                                   "bytes_per_ms": bytes_per_ms})
    step_ms = nbytes / t / bytes_per_ms
    scatter_ms = collectives.reduce_scatter_ms(nbytes, t, 0.0, bytes_per_ms)
    expected = product_ms + max(scatter_ms - product_ms, 0.0) + t * chunk_ms - product_ms + (t - 1) * max(
        step_ms - chunk_ms, 0.0)
    assert userbuffers_backward_ms(product, DEVICE, t, nbytes, link) == pytest.approx(expected)
    if link_ms_per_product_ms == 1.13:
        assert scatter_ms < product_ms and step_ms > chunk_ms
        assert userbuffers_backward_ms(product, DEVICE, t, nbytes, link) < overlapped_ms(product, DEVICE, t, nbytes,
                                                                                        link)


def test_tp_overlap_runs_the_forward_as_the_named_runtime_does(gpt16):
    """With free links only the products' own time is left: Megatron's forward pays its splits on the
    multiprocessors the userbuffers kernels leave, torch's its t chunks on all of them and the sum of its stacked
    partials; in the backward both pay t chunks (Megatron's for the ring exchange's all-gather), torch's the sum
    too."""
    block = gpt16.layers[1]
    free = placement_links(A100, Parallelism(tensor=8)).tensor.model_copy(update={"latency_ms": 0.0,
                                                                                   "bytes_per_ms": 1e15})
    megatron, torch = (estimate_layer(block, DEVICE, Parallelism(tensor=8, sequence_parallel=True, tp_overlap=True,
                                                                 tp_runtime=runtime), free, 2)
                       for runtime in ("megatron", "torch"))
    assert megatron.fwd_ms > torch.fwd_ms and megatron.bwd_ms < torch.bwd_ms


def test_torchs_async_tp_sums_its_stacked_partials_after_the_last_chunk():
    """torch's `_fused_matmul_reduce_scatter_impl`: the t chunks land in the owners' stacked partials (the whole
    output), then one reduction reads them all and writes the rank's 1/t, exposed after the pipeline."""
    t, nbytes = 8, 8192 * 6144 * 2
    link = placement_links(A100, Parallelism(tensor=t)).tensor
    reduction_ms = A100.curve.kernel_overhead_ms + (nbytes + nbytes // t) / DEVICE.memory_bytes_per_ms
    assert async_tp_ms(PRODUCT, DEVICE, t, nbytes, link) == pytest.approx(
        overlapped_ms(PRODUCT, DEVICE, t, nbytes, link) + reduction_ms)


def test_the_costs_line_names_the_tp_runtime_only_where_it_is_not_megatrons(tmp_path):
    args = ("estimate", *GPT16, "--tensor-parallel", 8, "--sequence-parallel")
    code, out, err = pipesim(*args, "--tp-runtime", "torch", "--out", tmp_path / "torch.json")
    assert code == 0 and "tp runtime torch" in " ".join(out.split()), err
    code, out, err = pipesim(*args, "--out", tmp_path / "megatron.json")
    assert code == 0 and "tp runtime" not in " ".join(out.split()), err


def test_the_count_marks_the_inputs_a_column_parallel_product_reads_from_a_norm_or_the_layers_input(gpt16):
    """A block's q, k, v input and its first MLP product's (each a norm's output, saved by the products alone),
    not the attention output projection's (same shape: the attention made it) nor the second MLP product's; the
    head's product reads its final norm's output."""
    block, head = gpt16.layers[1], gpt16.layers[3]
    tokens = B * S
    assert [(block.saved_parts[i], block.saved_tensors[i]) for i, _ in block.sequence_inputs] == [
        ("attention", ((tokens, H), tokens * H * 2)), ("mlp", ((tokens, H), tokens * H * 2))]
    attention_output = [i for i, (shape, _) in enumerate(block.saved_tensors)
                        if shape == (tokens, H) and block.linear_input_saves[i]]
    assert len(attention_output) == 3  # q, k, v's; the MLP's; the output projection's: not a sequence input
    assert [(head.saved_tensors[i], number >= 0) for i, number in head.sequence_inputs] == [
        (((tokens, H), tokens * H * 2), True)]


@pytest.mark.parametrize("recompute", ["none", "full"])
def test_torchs_runtime_keeps_a_column_parallel_products_gathered_input_whole(gpt16, recompute):
    """Under DTensor's sequence parallelism (`--tp-runtime torch`) the head's input, 2 x 128 x 256 fp16 = 128 KiB,
    is saved whole on each of t = 4 ranks, 96 KiB more than Megatron's runtime's 1/t; a block's two gathered
    inputs too, or, recomputed, in its backward's rerun; Megatron's runtime keeps 1/t of each."""
    t, whole = 4, B * S * H * 2
    link = placement_links(A100, Parallelism(tensor=t)).tensor
    block, head = gpt16.layers[1], gpt16.layers[3]
    megatron = Parallelism(tensor=t, sequence_parallel=True, recompute=recompute)
    on_rank = {runtime: [estimate_layer(layer, DEVICE, replace(megatron, tp_runtime=runtime), link, 2)
                         for layer in (block, head)] for runtime in ("megatron", "torch")}
    (block_megatron, head_megatron), (block_torch, head_torch) = on_rank["megatron"], on_rank["torch"]
    assert head_torch.activation_parts["other"] - head_megatron.activation_parts["other"] == whole - whole // t
    added = {part: block_torch.activation_parts[part] - block_megatron.activation_parts[part]
             for part in ("attention", "mlp")}
    rerun = block_torch.transient_bytes["bwd"] - block_megatron.transient_bytes["bwd"]
    if recompute == "none":
        assert (added, rerun) == ({"attention": whole - whole // t, "mlp": whole - whole // t}, 0)
    else:  # only the block's input kept; the rerun holds both gathered inputs whole through the backward
        assert (added, rerun) == ({"attention": 0, "mlp": 0}, 2 * (whole - whole // t))
    megatron_head = sum(nbytes for shape, nbytes in head.saved_tensors) // t  # every saved tensor 1/t
    assert head_megatron.activation_bytes == pytest.approx(megatron_head, abs=2)


def test_a_recipe_that_saves_float8_inputs_keeps_the_gathered_float8_copy_whole(gpt16):
    """torchao at eab345c (`--fp8-recipe torchao-2024`) casts a column-parallel product's input before DTensor
    gathers it (`PrepareFloat8ModuleInput`) and saves that float8 copy: whole at 1 byte an element, 2 x 128 x 256 =
    64 KiB on each of t = 4 ranks, where Megatron's runtime keeps a quarter."""
    t, whole = 4, B * S * H
    link = placement_links(A100, Parallelism(tensor=t)).tensor
    device = replace(DEVICE, fp8_peak_flops_per_ms=2 * DEVICE.peak_flops_per_ms)
    parts = {runtime: estimate_layer(gpt16.layers[1], device, Parallelism(
        tensor=t, sequence_parallel=True, tp_runtime=runtime, fp8="torchao-2024"), link, 2).activation_parts
        for runtime in ("megatron", "torch")}
    assert {part: parts["torch"][part] - parts["megatron"][part] for part in ("attention", "mlp")} == {
        "attention": whole - whole // t, "mlp": whole - whole // t}


def test_the_allocator_replays_the_gathered_inputs_whole(gpt16):
    """The caching allocator's replay (`layer_allocations`): under torch's runtime a norm's output that the products
    save (a block's two, the head's final norm's) is allocated whole; Megatron's runtime allocates 1/t."""
    from pipesim.planning.estimate import layer_allocations

    t, whole = 4, B * S * H * 2
    made = {runtime: layer_allocations(gpt16, Parallelism(tensor=t, sequence_parallel=True, tp_runtime=runtime))
            for runtime in ("megatron", "torch")}
    for runtime, each in (("megatron", whole // t), ("torch", whole)):
        for index in (1, 3):
            forward = dict(made[runtime][index].passes["fwd"])
            gathered = [forward[number] for _, number in gpt16.layers[index].sequence_inputs]
            assert gathered == [each] * (2 if index == 1 else 1)


@needs_transformers
def test_a_torchtitan_style_last_stage_saves_its_heads_gathered_input_whole(tmp_path):
    """A Llama's head as torchtitan runs it under DTensor (t = 2, sequence parallel, loss_parallel, two stages): the
    head's product reads the final norm, a layer of its own, so its forward gathers its input, 2 samples x 32
    tokens x 64 in bf16 = 8,192 bytes, and saves it whole: 4,096 more on the last stage than Megatron's runtime's
    half, and in the allocator's replay a whole storage of its own made as the head's forward begins."""
    torch = pytest.importorskip("torch")
    from pipesim.planning.estimate import layer_allocations
    from pipesim.workload.count import count_built

    (tmp_path / "config.json").write_text(LLAMA)
    args = ("estimate", "--gpu", "h100-sxm", "--model", f"hf:{tmp_path}", "--seq-len", 32, "-b", 2, "--attention",
            "flash", "--tensor-parallel", 2, "--sequence-parallel", "--loss-parallel", "-p", 2)
    parts = {}
    for runtime in ("megatron", "torch"):
        code, _, err = pipesim(*args, "--tp-runtime", runtime, "--out", tmp_path / f"{runtime}.json")
        assert code == 0, err
        parts[runtime] = [stage["activation_parts"] for stage in
                          json.loads((tmp_path / f"{runtime}.json").read_text())["stages"]]
    whole = 2 * 32 * 64 * 2
    block_inputs = 2 * (whole - whole // 2)  # each stage's block: its attention's and its MLP's gathered inputs
    assert parts["torch"][0]["other"] == parts["megatron"][0]["other"]
    assert parts["torch"][1]["other"] - parts["megatron"][1]["other"] == whole - whole // 2
    for stage in (0, 1):
        added = sum(parts["torch"][stage].values()) - sum(parts["megatron"][stage].values())
        assert added == block_inputs + (whole - whole // 2 if stage else 0)
    counted = count_built(f"hf:{tmp_path}", {"seq_len": 32}, 2, torch.bfloat16, "flash", loss_parallel=True)
    head = counted.layers[-1]
    assert [number for _, number in head.sequence_inputs] == [-1]  # the layer's input: the final norm's output
    made = {runtime: layer_allocations(counted, Parallelism(tensor=2, sequence_parallel=True, tp_runtime=runtime))[-1]
            for runtime in ("megatron", "torch")}
    # beside it its all-gather's output, freed once it is made (funcol's concatenation: `collective_copies`)
    (copy, copied), (number, nbytes), (freed, unmade), *rest = made["torch"].passes["fwd"]
    assert (copied, nbytes, freed, unmade) == (whole, whole, copy, -whole)
    assert (tuple(rest), made["torch"].saved - made["megatron"].saved) == (made["megatron"].passes["fwd"], {number})
