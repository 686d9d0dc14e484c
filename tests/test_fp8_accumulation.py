"""Float8 products that add their partial sums into float32 every few steps (cuBLASLt's FAST_ACCUM off: the
backward's under TransformerEngine and torchao) run at the curve's `fp8_split_accumulation_efficiency`, the
part's float8 MAMF; the forward's, with fast accumulation, at `matmul_efficiency` (planning/fp8.py)."""

from __future__ import annotations

import pytest

from pipesim.hardware.catalogue import load_catalogue
from pipesim.planning.estimate import Device, Parallelism, estimate_layer, op_ms
from pipesim.planning.fp8 import FP8_RECIPES, in_float8
from tests.conftest import pipesim
from tests.helpers import H100
from tests.helpers import H100_FP8 as DEVICE
from tests.helpers import H100_TENSOR_LINK as LINK
from tests.helpers import product_attention_layer as _layer

MAMF_TFLOPS = 1402.6  # stas00/ml-engineering's float8_e4m3fn MAMF of the H100 SXM, torch._scaled_mm's default


def _products(layer, name: str):
    return [op for op in layer.ops[name] if op.kind == "matmul"]


@pytest.mark.parametrize("recipe, split", [("te", True), ("te-current", True), ("torchao", True), ("deepseek", False)])
def test_the_backward_products_accumulate_split_under_cublas_recipes_and_the_forward_ones_fast(recipe, split):
    layer = in_float8(_layer(4096, 1024), FP8_RECIPES[recipe], 2)
    assert not any(op.split_accumulation for op in _products(layer, "fwd"))
    for name in ("bwd", "igrad", "wgrad"):
        assert [op.split_accumulation for op in _products(layer, name)] == [split] * len(_products(layer, name))


def test_the_h100_prices_a_split_accumulating_product_at_its_float8_mamf_and_a_fast_one_as_before():
    assert H100.curve.fp8_split_accumulation_efficiency == pytest.approx(MAMF_TFLOPS / H100.dense_tflops.fp8,
                                                                         abs=5e-4)
    layer = in_float8(_layer(16384, 16384), FP8_RECIPES["te"], 2)
    (forward,), (backward, _) = _products(layer, "fwd"), _products(layer, "bwd")
    overhead = H100.curve.kernel_overhead_ms
    assert (op_ms(backward, DEVICE) - overhead) / (op_ms(forward, DEVICE) - overhead) == pytest.approx(
        H100.curve.matmul_efficiency / H100.curve.fp8_split_accumulation_efficiency)  # same shape, 16384^3
    te, deepseek = (estimate_layer(_layer(16384, 16384), DEVICE, Parallelism(fp8=name), LINK, 2)
                    for name in ("te", "deepseek"))
    assert te.fwd_ms == pytest.approx(deepseek.fwd_ms) and te.wgrad_ms > 1.1 * deepseek.wgrad_ms


def test_a_part_without_a_published_split_figure_prices_both_at_its_matmul_efficiency():
    l40s = load_catalogue().find("l40s")
    assert l40s.curve.fp8_split_accumulation_efficiency is None
    device = Device(l40s.dense_tflops.bf16 * 1e9, l40s.memory_bandwidth_gb_s * 1e6, l40s.curve,
                    l40s.dense_tflops.fp8 * 1e9)
    layer = in_float8(_layer(8192, 8192), FP8_RECIPES["te"], 2)
    (forward,), (backward, _) = _products(layer, "fwd"), _products(layer, "bwd")
    assert op_ms(forward, device) == op_ms(backward, device)


def test_a_split_accumulation_efficiency_above_one_is_refused_in_one_line(tmp_path):
    part = tmp_path / "mine.toml"
    part.write_text('[gpu.mine]\nname = "mine"\nmemory_gib = 80\nmemory_bandwidth_gb_s = 3350\nsource = "s"\n'
                    'dense_tflops = { fp32 = 67, bf16 = 989, fp16 = 989, fp8 = 1979 }\n'
                    'intra_node = { link = "nvlink", gb_s_per_direction = 450, gpus_per_node = 8, source = "s" }\n'
                    'network = { kind = "infiniband", gbit_s = 400, source = "s" }\n'
                    'curve = { matmul_efficiency = 0.8, attention_efficiency = 0.35, memory_efficiency = 0.88, '
                    'kernel_overhead_ms = 0.004, multiprocessors = 132, tiles = [[128, 128]], '
                    'fp8_split_accumulation_efficiency = 1.2, source = "s" }\n')
    code, out, err = pipesim("gpus", "--gpus", part)
    assert code == 2 and not out and len(err.strip().splitlines()) == 1, err
    assert "fp8_split_accumulation_efficiency" in err and "less than or equal to 1" in err
