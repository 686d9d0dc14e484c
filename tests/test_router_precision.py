"""A mixture of experts' router as Megatron-core runs it (workload/moe.py `gating_linear`): its input kept in its own
dtype (no float32 copy saved), its product in the precision its code asks for, outside every float8 recipe."""

from __future__ import annotations

from functools import cache

import pytest

from pipesim.planning.fp8 import FP8_RECIPES, in_float8
from pipesim.profiles.workload import LayerCount
from tests.conftest import needs_transformers
from tests.helpers import EXPERTS, B, H, S  # the tiny DeepSeek-V3's shape (`tiny_deepseek_count`)


@cache
def moe_layer() -> LayerCount:
    from tests.helpers import tiny_deepseek_count as deepseek

    return deepseek().layers[2]  # the embedding, a dense layer, then routed experts


def gating(layer: LayerCount, passed: str) -> list[tuple[int, ...]]:
    return sorted(op.shape for op in layer.ops[passed] if op.gating and op.kind == "matmul")


@needs_transformers
def test_the_router_keeps_its_input_as_it_is_and_computes_in_float32():
    """transformers' DeepseekV3 router casts its input and weight to float32 before its product, so autograd would
    keep a float32 copy of the input (B·S x H, 4 bytes); Megatron-core's RouterGatingLinearFunction keeps the 16-bit
    input the experts read too and casts inside, forward and backward."""
    layer = moe_layer()
    assert (B * S, H) not in [shape for (shape, nbytes) in layer.saved_tensors if nbytes == B * S * H * 4]
    (product,) = [op for op in layer.ops["fwd"] if op.gating and op.kind == "matmul"]
    assert product.shape == (1, B * S, EXPERTS, H)
    assert product.moved_bytes == (B * S * H + H * EXPERTS + B * S * EXPERTS) * 4  # in float32
    # its input gradient in the input pass, its weight gradient in the weight pass only (as a zero-bubble W runs)
    assert gating(layer, "igrad") == [(1, B * S, H, EXPERTS)]
    assert gating(layer, "bwd") == sorted([(1, B * S, H, EXPERTS), (1, EXPERTS, H, B * S)])


@needs_transformers
@pytest.mark.parametrize("recipe", ["te", "deepseek"])
def test_float8_recipes_leave_the_gating_product_in_its_own_precision(recipe):
    """DeepSeek-V3's report (3.3.1) keeps "MoE gating modules" in their original precision, and Megatron-core's
    router is no TransformerEngine module: no float8 product, no cast for it; the layer's other products convert."""
    layer = in_float8(moe_layer(), FP8_RECIPES[recipe], 2)
    for passed in ("fwd", "igrad", "bwd"):
        assert not [op for op in layer.ops[passed] if op.gating and op.float8]
        assert [op for op in layer.ops[passed] if op.float8]
    assert not [op for op in layer.ops["bwd"] if op.op.startswith("fp8_") and op.shape == (B * S, EXPERTS)]
