"""Tensor parallelism beyond a node and overlapped, data-parallel collectives at scale (issue 42, item 4)."""

import pytest

from pipesim.hardware import collectives
from pipesim.hardware.catalogue import load_catalogue
from pipesim.planning.estimate import Device, EstimateError, Parallelism, estimate_layer, placement_links
from pipesim.profiles.workload import WorkloadCount
from tests.conftest import pipesim

A100 = load_catalogue().find("a100-sxm-80gb")
DEVICE = Device(A100.dense_tflops.fp16 * 1e9, A100.memory_bandwidth_gb_s * 1e6 * A100.curve.memory_efficiency,
                A100.curve)
NIC_BYTES_PER_MS = A100.network.gbit_s / 8 * 1e6
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
    assert link.bytes_per_ms == min(8 * NIC_BYTES_PER_MS, NVLINK_BYTES_PER_MS)  # 8 NICs of 25 GB/s: 200 GB/s
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
    assert "tensor-parallel group across 2 nodes infiniband 200 GB/s" in " ".join(out.split())
    code, out, err = pipesim("simulate", *GPT16, "--tensor-parallel", 16, "-p", 1, "-m", 1, "-s", "gpipe")
    assert code == 0, err
    assert "the tensor-parallel group across 2 nodes" in " ".join(out.split())


def test_a_tensor_parallel_degree_that_splits_a_node_is_one_line_and_writes_nothing(tmp_path):
    code, out, err = pipesim("estimate", *GPT16, "--tensor-parallel", 12, "--out", tmp_path / "p.json")
    assert code == 2 and len(err.strip().splitlines()) == 1
    assert "--tensor-parallel 12 spans nodes of 8 GPUs and must fill them" in err
    assert not (tmp_path / "p.json").exists()
