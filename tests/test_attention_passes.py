"""A fused attention kernel priced by pass and mask where its rates are published apart (the catalogue curve's
`attention_kernel_passes`; planning/estimate.py `attention_kernel_ms`): on an H100 cuDNN's forward runs 609
TFLOP/s unmasked and 518 causal, its backward 499 unmasked (arXiv 2407.08608, figures 5 and 6, 4k tokens, head
dim 128, batch 4 x 16 heads: 2,048 query tiles) and causal at 443.6/517.3 of that (NVIDIA/cudnn-frontend
benchmark_results.csv); a causal kernel of fewer tiles pays its tail (cuDNN's H200 sweep at Llama 3.1's heads); the
context ring's first block is the causal kernel, its others unmasked."""

from __future__ import annotations

from dataclasses import replace

import pytest

from pipesim.hardware.catalogue import AttentionPasses, CatalogueError, load_catalogue
from pipesim.planning.estimate import ContextRing, Device, Parallelism, curve_for, kernel_curve, op_ms, placement_links
from pipesim.profiles.schema import FittedCurve
from pipesim.profiles.workload import OpCount
from tests.helpers import H100
from tests.helpers import h100_bf16_on as _on

HEADS, QUERIES, HEAD_DIM = 64, 4096, 128  # the published rates' shape: batch 4 x 16 heads, 2,048 query tiles
SQUARE = 4 * HEADS * QUERIES * QUERIES * HEAD_DIM  # torch's count: the whole square, forward
FORWARD = OpCount("_scaled_dot_product_flash_attention", "attention", (HEADS, QUERIES, QUERIES, HEAD_DIM), SQUARE, 1,
                  1)
BACKWARD = replace(FORWARD, op="_scaled_dot_product_flash_attention_backward", flops=SQUARE * 5 // 2)


def _tflop_s(op: OpCount, device: Device, flops: float) -> float:
    return flops / (op_ms(op, device) - device.curve.kernel_overhead_ms) / 1e9


def test_cudnns_passes_run_at_their_published_rates_and_flash2_at_its_one_figure():
    cudnn, flash2 = _on("cudnn"), _on("flash2")
    assert H100.curve.attention_kernel_passes["cudnn"] == AttentionPasses(
        forward=0.62, causal_forward=0.52, backward=0.50, causal_backward=0.43, causal_tail=1.40, measured_tiles=2048)
    peak = H100.dense_tflops.bf16
    rates = {(op.op, causal): _tflop_s(replace(op, causal=causal), cudnn, op.flops / (2 if causal else 1))
             for op in (FORWARD, BACKWARD) for causal in (False, True)}
    assert rates == pytest.approx({(FORWARD.op, False): 0.62 * peak, (FORWARD.op, True): 0.52 * peak,
                                   (BACKWARD.op, False): 0.50 * peak, (BACKWARD.op, True): 0.43 * peak})
    for op in (FORWARD, BACKWARD):
        for causal in (False, True):
            assert _tflop_s(replace(op, causal=causal), flash2, op.flops / (2 if causal else 1)) == \
                pytest.approx(0.35 * peak)


def test_the_rings_first_block_runs_the_causal_kernel_and_the_others_the_unmasked_one():
    """C = 2: every rank's first step is its own two chunks under the causal mask (half its work), its second
    half the queries or half the keys unmasked (the other half): the forward's blocks at 0.52 and 0.62 of the
    peak, the backward's at 0.43 and 0.50."""
    device = _on("cudnn")
    ring = ContextRing(2, placement_links(H100, Parallelism(context=2)).context)
    overhead_ms, peak = device.curve.kernel_overhead_ms, device.peak_flops_per_ms
    for op, (causal, unmasked) in ((FORWARD, (0.52, 0.62)), (BACKWARD, (0.43, 0.50))):
        half = replace(op, causal=True).flops / 4  # a rank's causal kernel's work, over its two steps
        assert ring.blocks_ms(replace(op, causal=True), device) == pytest.approx(
            [overhead_ms + half / (peak * causal), overhead_ms + half / (peak * unmasked)])
    unmasked = ring.blocks_ms(FORWARD, device)  # a model without the mask: every block unmasked
    assert unmasked[0] == pytest.approx(unmasked[1]) == pytest.approx(overhead_ms + FORWARD.flops / 2 / (peak * 0.62))


def test_a_causal_kernel_of_fewer_query_tiles_runs_slower_as_cudnns_sweep_measured_it():
    """cuDNN's causal forward at 4,096 tokens on an H200 (cudnn-frontend's prefill sweep, Llama 3.1's heads): 599,
    545, 474 and 378 TFLOP/s at 64, 32, 16 and 8 heads; the curve's tail gives each within 2 % of its share of
    the 64 heads' rate, at 64 heads (the measured tiles) the published fraction itself. Unmasked kernels and
    FlashAttention-2 (one figure, no tail published) keep their rate whatever the heads."""
    cudnn, flash2 = _on("cudnn"), _on("flash2")
    measured = {64: 598.894, 32: 544.567, 16: 473.744, 8: 377.683}

    def rate(device: Device, heads: int, causal: bool, op: OpCount = FORWARD) -> float:
        shaped = replace(op, shape=(heads, QUERIES, QUERIES, HEAD_DIM), flops=op.flops * heads // HEADS,
                         causal=causal)
        return _tflop_s(shaped, device, shaped.flops / (2 if causal else 1))

    assert rate(cudnn, 64, True) == pytest.approx(0.52 * H100.dense_tflops.bf16)
    for heads, tflop_s in measured.items():
        assert rate(cudnn, heads, True) / rate(cudnn, 64, True) == pytest.approx(tflop_s / measured[64], rel=0.02)
    assert rate(cudnn, 8, True, BACKWARD) / rate(cudnn, 64, True, BACKWARD) == pytest.approx(
        rate(cudnn, 8, True) / rate(cudnn, 64, True))
    for heads in measured:
        assert rate(cudnn, heads, False) == pytest.approx(rate(cudnn, 64, False))
        assert rate(flash2, heads, True) == pytest.approx(rate(flash2, 64, True))


def test_the_rings_causal_block_pays_the_tail_of_the_ranks_own_tiles():
    """A rank's causal block runs over its own queries' tiles (its heads x its 4,096 queries): at 16 heads (Llama 3.1
    70B at t = 4) below the published causal rate by 1.365 / 1.090, its unmasked block at the published one."""
    device = _on("cudnn")
    ring = ContextRing(2, placement_links(H100, Parallelism(context=2)).context)
    overhead_ms, peak = device.curve.kernel_overhead_ms, device.peak_flops_per_ms
    rank = replace(FORWARD, shape=(16, QUERIES, 2 * QUERIES, HEAD_DIM), flops=FORWARD.flops // 2, causal=True)
    half = rank.flops / 4
    tail = 1.40 * 132
    assert ring.blocks_ms(rank, device) == pytest.approx(
        [overhead_ms + half / (peak * 0.52 * (1 + tail / 2048) / (1 + tail / 512)), overhead_ms + half / (peak * 0.62)])


def test_a_calibrated_attention_rate_prices_every_pass_and_a_gpus_file_checks_the_fractions(tmp_path):
    base = kernel_curve(H100.curve, "cudnn", "h100-sxm")
    fitted = FittedCurve(matmul_flops_per_ms=7e11, attention_flops_per_ms=4e11, memory_bytes_per_ms=2e9,
                         kernel_overhead_ms=0.01, multiprocessors=132, tiles=[(128, 128)], passes=["fwd"],
                         attention="flash", residuals={})
    measured = curve_for(fitted, 989.4e9, 3.35e9, base, "measured")
    assert measured.attention_passes is None
    assert measured.attention_fraction(True, True) == measured.attention_fraction(False, False) == \
        pytest.approx(4e11 / 989.4e9)
    unmeasured = curve_for(fitted.model_copy(update={"attention_flops_per_ms": None}), 989.4e9, 3.35e9, base,
                           "measured")
    assert unmeasured.attention_passes == base.attention_passes
    bad = tmp_path / "gpus.toml"
    bad.write_text(
        '[gpu.h100-custom]\nname = "x"\nmemory_gib = 80\nmemory_bandwidth_gb_s = 3350\nsource = "s"\n'
        'dense_tflops = { fp32 = 67, bf16 = 989.4, fp16 = 989.4 }\n'
        'intra_node = { link = "nvlink", gb_s_per_direction = 450, gpus_per_node = 8, source = "s" }\n'
        'network = { kind = "infiniband", gbit_s = 400, source = "s" }\n'
        'curve = { matmul_efficiency = 0.8, attention_efficiency = 0.35, attention_kernels = { cudnn = 0.52 }, '
        'attention_kernel_passes = { cudnn = { forward = 1.2, causal_forward = 0.52, backward = 0.5, '
        'causal_backward = 0.43 } }, memory_efficiency = 0.88, kernel_overhead_ms = 0.004, multiprocessors = 132, '
        'tiles = [[128, 128]], source = "s" }\n')
    with pytest.raises(CatalogueError, match="attention_kernel_passes.cudnn.forward"):
        load_catalogue(bad)
    bad.write_text(bad.read_text().replace("forward = 1.2", "forward = 0.62, causal_tail = 1.4"))
    with pytest.raises(CatalogueError, match="causal_tail: give measured_tiles"):
        load_catalogue(bad)
