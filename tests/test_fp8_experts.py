"""--dtype fp8 on a mixture of experts (planning/fp8.py): TransformerEngine's recipe runs the routed experts'
grouped products in float8 as Megatron-core's TEGroupedMLP does, each expert's input cast in the forward and its
weights once a step, a rank casting and holding only its expert-parallel share; torchao's leaves them 16-bit."""

from __future__ import annotations

from pipesim.planning.fp8 import FP8_RECIPES, float8_weight_bytes, in_float8, step_cast_ops
from pipesim.profiles.workload import LayerCount, OpCount

EXPERTS, TOKENS, WIDTH, FFN = 8, 64, 128, 256  # 64 token copies for each of 8 experts


def _layer() -> LayerCount:
    """A transformer layer: a fused attention kernel, one linear product, and the experts' grouped product."""
    attention = OpCount("flash", "attention", (4, 64, 64, 32), 4 * 4 * 64 * 64 * 32, 0, 1)
    linear = OpCount("mm", "matmul", (1, 512, WIDTH, WIDTH), 2 * 512 * WIDTH * WIDTH, 2 * 3 * 512 * WIDTH, 1)
    routed = OpCount("bmm", "matmul", (EXPERTS, TOKENS, FFN, WIDTH), 2 * EXPERTS * TOKENS * FFN * WIDTH,
                     2 * EXPERTS * (TOKENS * WIDTH + WIDTH * FFN + TOKENS * FFN), 1, routed=True)
    ops = {"fwd": (attention, linear, routed), "igrad": (), "wgrad": (), "bwd": ()}
    return LayerCount("1:block", 0, 0, 0, 0, 0, 0, 0, 0, 0, {}, {}, (1, 512, WIDTH), 2 * 512 * WIDTH, (0,),
                      ops=ops)


def test_te_runs_the_routed_experts_products_in_float8_and_casts_their_inputs():
    forward = in_float8(_layer(), FP8_RECIPES["te"], 2).ops["fwd"]
    (routed,) = [op for op in forward if op.routed]
    assert routed.float8
    assert routed.moved_bytes == EXPERTS * (TOKENS * WIDTH + WIDTH * FFN) + 2 * EXPERTS * TOKENS * FFN
    casts = [op for op in forward if op.op == "fp8_cast_transpose_input" and op.shape == (TOKENS, WIDTH)]
    assert [op.moved_bytes for op in casts] == [EXPERTS * TOKENS * WIDTH * (2 + 2)]  # reads 16-bit, writes 2 copies


def test_torchao_leaves_the_routed_experts_products_16_bit():
    forward = in_float8(_layer(), FP8_RECIPES["torchao"], 2).ops["fwd"]
    assert [op.float8 for op in forward if op.kind == "matmul"] == [True, False]


def test_a_rank_casts_and_holds_its_expert_parallel_share_of_the_experts_weights_once_a_step():
    te = FP8_RECIPES["te"]
    linear_bytes = WIDTH * WIDTH * te.weight_copy_bytes
    assert float8_weight_bytes(_layer(), te) == linear_bytes + EXPERTS * FFN * WIDTH * te.weight_copy_bytes
    assert float8_weight_bytes(_layer(), te, 4) == linear_bytes + EXPERTS // 4 * FFN * WIDTH * te.weight_copy_bytes
    routed_casts = [op for op in step_cast_ops(_layer(), te, 2, 4) if op.shape == (FFN, WIDTH)]
    assert [op.moved_bytes for op in routed_casts] == [EXPERTS // 4 * FFN * WIDTH * (2 + 2)]
