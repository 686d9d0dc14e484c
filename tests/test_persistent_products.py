"""A collective kernel beside a product that runs on every multiprocessor (TransformerEngine's bulk overlaps,
Megatron-core's asynchronous input all-gather): on a part whose products run persistent CTAs (Hopper) the product
ends the collective's time late; elsewhere only what outlasts the product is exposed (planning/estimate.py
`bulk_exposed_ms`)."""

from dataclasses import replace

import pytest

from pipesim.hardware import collectives
from pipesim.planning.estimate import (
    TE_PIPELINE_MULTIPROCESSORS,
    TE_PIPELINE_SPLITS,
    Device,
    EstimateError,
    Parallelism,
    bulk_exposed_ms,
    estimate_layer,
    input_gather_ms,
    on_multiprocessors,
    op_ms,
    placement_links,
    ring_exchange_ms,
    userbuffers_backward_ms,
    userbuffers_forward_ms,
)
from pipesim.profiles.workload import OpCount
from tests.conftest import pipesim
from tests.helpers import CATALOGUE, H100

PERSISTENT = Device(H100.dense_tflops.bf16 * 1e9, H100.memory_bandwidth_gb_s * 1e6 * H100.curve.memory_efficiency,
                    H100.curve)
WAVES = replace(PERSISTENT, curve=H100.curve.model_copy(update={"persistent_products": False}))
T = 4
LINK = placement_links(H100, Parallelism(tensor=T)).tensor
M, N, K = 2048, 12288, 12288
PRODUCT = OpCount("mm", "matmul", (1, M, N, K), 2 * M * N * K, 2 * (M * K + K * N + M * N), 1)
NBYTES = M * N * 2


def test_hoppers_products_run_persistent_ctas_and_amperes_do_not():
    assert {name for name, gpu in CATALOGUE.gpu.items() if gpu.curve and gpu.curve.persistent_products} == {
        "h100-sxm", "h100-pcie", "h200", "h800"}


@pytest.mark.parametrize("device, exposed_share", [(PERSISTENT, 1.0), (WAVES, 0.0)])
def test_a_collective_shorter_than_its_product_is_exposed_whole_only_beside_persistent_ctas(device, exposed_share):
    product_ms = op_ms(PRODUCT, device)
    gather_ms = collectives.all_gather_ms(NBYTES, T, LINK.latency_ms, LINK.bytes_per_ms)
    assert gather_ms < product_ms
    assert bulk_exposed_ms(gather_ms, product_ms, device) == exposed_share * gather_ms
    assert input_gather_ms(NBYTES, product_ms, T, LINK, device) == pytest.approx(exposed_share * gather_ms)
    # one longer than the product: beside waves, its excess; beside persistent CTAs, still all of it
    exposed_ms = (3 if exposed_share else 2) * product_ms
    assert bulk_exposed_ms(3 * product_ms, product_ms, device) == pytest.approx(exposed_ms)


def test_the_backward_reduce_scatter_in_bulk_costs_its_whole_time_on_a_persistent_part():
    scatter_ms = collectives.reduce_scatter_ms(NBYTES, T, LINK.latency_ms, LINK.bytes_per_ms)
    assert userbuffers_backward_ms(PRODUCT, PERSISTENT, T, NBYTES, LINK) - userbuffers_backward_ms(
        PRODUCT, WAVES, T, NBYTES, LINK) == pytest.approx(scatter_ms)


def test_a_layers_backward_on_hopper_pays_each_bulk_collective_and_its_forward_none():
    """A GPT block under Megatron's runtime with --tp-overlap: its two column-parallel input gradients (QKV, the
    MLP's first) each pay their reduce-scatter and the all-gather of their saved input whole; the forward runs no
    bulk overlap and does not move."""
    torch = pytest.importorskip("torch")
    from pipesim.workload.count import count_built

    width, seq = 4096, 2048  # each collective shorter than its product: hidden whole beside waves
    block = count_built("gpt", dict(layers=2, width=width, heads=32, seq_len=seq, vocab=512), 1,
                        torch.bfloat16).layers[1]
    parallel = Parallelism(tensor=T, sequence_parallel=True, tp_overlap=True)
    persistent, waves = (estimate_layer(block, device, parallel, LINK, 2) for device in (PERSISTENT, WAVES))
    nbytes = seq * width * 2
    scatter_ms = collectives.reduce_scatter_ms(nbytes, T, LINK.latency_ms, LINK.bytes_per_ms)
    gather_ms = collectives.all_gather_ms(nbytes, T, LINK.latency_ms, LINK.bytes_per_ms)
    assert persistent.fwd_ms == waves.fwd_ms
    assert persistent.bwd_ms - waves.bwd_ms == pytest.approx(2 * (scatter_ms + gather_ms))
    # without the margin the forward's two row-parallel products (the projection, the MLP's second) run on every SM
    no_margin = estimate_layer(block, PERSISTENT, replace(parallel, tp_overlap_no_margin=True), LINK, 2)
    assert no_margin.fwd_ms != persistent.fwd_ms and no_margin.bwd_ms == persistent.bwd_ms


@pytest.mark.parametrize("device", [PERSISTENT, WAVES])
def test_the_forwards_pipelined_reduce_scatter_without_its_sm_margin_runs_each_split_on_every_sm(device):
    """TransformerEngine 1.x's default `pipeline` overlap (no `set_sm_margin`): each split's product on every
    SM beside the previous split's reduce-scatter, which a persistent product waits out whole and waves hide up to
    the split's length; with the margin (NeMo's configs) the splits run on the SMs the kernels leave."""
    split = OpCount("mm", "matmul", (1, M // TE_PIPELINE_SPLITS, N, K), PRODUCT.flops // TE_PIPELINE_SPLITS,
                    PRODUCT.moved_bytes // TE_PIPELINE_SPLITS, 1)
    scatter_ms = collectives.reduce_scatter_ms(NBYTES / TE_PIPELINE_SPLITS, T, LINK.latency_ms, LINK.bytes_per_ms)
    gathered_ms = ring_exchange_ms(PRODUCT, device, T, NBYTES, LINK)
    split_ms = op_ms(split, device)
    beside_ms = scatter_ms if device.curve.persistent_products else max(scatter_ms - split_ms, 0.0)
    expected = TE_PIPELINE_SPLITS * split_ms + (TE_PIPELINE_SPLITS - 1) * beside_ms + scatter_ms + gathered_ms
    assert userbuffers_forward_ms(PRODUCT, device, T, NBYTES, LINK, sm_margin=False) == pytest.approx(expected)
    narrower_ms = op_ms(split, on_multiprocessors(device, device.curve.multiprocessors - TE_PIPELINE_MULTIPROCESSORS))
    margin = TE_PIPELINE_SPLITS * narrower_ms + (TE_PIPELINE_SPLITS - 1) * max(scatter_ms - narrower_ms, 0.0)
    assert userbuffers_forward_ms(PRODUCT, device, T, NBYTES, LINK) == pytest.approx(margin + scatter_ms + gathered_ms)


def test_no_margin_needs_megatrons_overlapped_tensor_parallelism(tmp_path):
    with pytest.raises(EstimateError, match="tp_overlap_no_margin"):
        Parallelism(tensor=T, sequence_parallel=True, tp_overlap=True, tp_runtime="torch", tp_overlap_no_margin=True)
    model = ["--model", "gpt", "--layers", 2, "--gpu", "h100-sxm", "--tensor-parallel", T, "--sequence-parallel"]
    for extra in ([], ["--tp-overlap", "--tp-runtime", "torch"]):
        code, _, err = pipesim("estimate", *model, *extra, "--tp-overlap-no-margin", "--out", tmp_path / "p.json")
        assert code == 2 and err.strip() == ("error: --tp-overlap-no-margin sets the SMs of TransformerEngine's "
                                             "pipelined reduce-scatters: give --tp-overlap under --tp-runtime "
                                             "megatron")
        assert not (tmp_path / "p.json").exists()
