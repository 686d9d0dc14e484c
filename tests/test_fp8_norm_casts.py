"""TransformerEngine's LayerNormLinear under delayed scaling (the `te` recipe): the norm's kernel writes its
product's input in float8 (`layernorm_fwd_fp8`, `rmsnorm_fwd_fp8`), so that input takes no cast of its own, and the
weight gradient transposes the float8 copy (`tex.fp8_transpose(ln_out_total)`) instead (planning/fp8.py
`norms_in_float8`, planning/te.py `float8_norm_outputs`); under current scaling (`te-current`) the norm takes its
output's amax, so its cast runs no amax pass (`norm_cast_kernels`). Each layer's memory-bound bytes and kernels, by
hand."""

from collections import Counter
from dataclasses import replace

import pytest

from pipesim.planning.estimate import gathered_transposes_ms
from pipesim.planning.fp8 import FP8_RECIPES, cast_ops, gathered_norm_share, in_float8
from pipesim.planning.te import float8_norm_outputs, norm_read_products
from pipesim.profiles.workload import OpCount
from tests.helpers import H100_FP8 as DEVICE

WIDTH, HEADS, SEQ, FFN = 256, 4, 128, 1024
TOKENS = SEQ  # one sequence a micro-batch
TE = FP8_RECIPES["te"]


def _block(**options):
    torch = pytest.importorskip("torch")
    from pipesim.workload.count import count_built

    sizes = dict(layers=1, width=WIDTH, heads=HEADS, seq_len=SEQ, vocab=128, ffn=FFN, **options)
    return count_built("gpt", sizes, 1, torch.bfloat16).layers[1]


@pytest.fixture(scope="module", params=["layernorm", "rmsnorm"])
def block(request):
    return _block(norm=request.param, gated=request.param == "rmsnorm")


def _memory(layer, name):
    """A pass's memory-bound bytes and kernels."""
    ops = [op for op in layer.ops.get(name, ()) if op.kind == "memory"]
    return sum(op.moved_bytes * op.count for op in ops), sum(op.count for op in ops)


def test_the_two_norms_outputs_are_qkv_and_the_first_mlp_products_inputs(block):
    outputs = float8_norm_outputs(block)
    assert [shape for _, shape in outputs] == [(1, SEQ, WIDTH)] * 2
    first = 2 * FFN if any(op.shape[2] == 2 * FFN for op in block.ops["fwd"] if op.kind == "matmul") else FFN
    assert norm_read_products(block, outputs) == {(1, SEQ, 3 * WIDTH, WIDTH): 1, (1, SEQ, first, WIDTH): 1}


def test_a_norm_writes_float8_and_its_products_input_is_not_cast_again(block):
    """Against the same recipe casting the norms' 16-bit outputs: the forward moves, for each of the two norms, its
    output's second byte and the cast-transpose's 2 + 2 bytes an element less, one kernel less; the full backward
    and the weight-gradient pass each transpose both float8 copies, 1 + 1 bytes an element, a kernel each; the
    input-gradient pass is unchanged."""
    fused = in_float8(block, TE, 2)
    cast = in_float8(block, replace(TE, norm_cast_kernels=None), 2)
    elements = TOKENS * WIDTH
    (fused_bytes, fused_kernels), (cast_bytes, cast_kernels) = _memory(fused, "fwd"), _memory(cast, "fwd")
    assert cast_bytes - fused_bytes == 2 * elements * (1 + 4)
    assert cast_kernels - fused_kernels == 2
    for name in ("bwd", "wgrad"):
        (fused_bytes, fused_kernels), (cast_bytes, cast_kernels) = _memory(fused, name), _memory(cast, name)
        assert fused_bytes - cast_bytes == 2 * elements * 2
        assert fused_kernels - cast_kernels == 2
    assert _memory(fused, "igrad") == _memory(cast, "igrad")
    assert fused.saved_bytes == cast.saved_bytes  # the float8 copy is kept either way


def test_current_scaling_and_torchao_cast_the_norms_output_still():
    """TransformerEngine 2.x runs the norm in 16 bits before a current-scaling cast (normalization.cpp
    `Impl::FUSED_NORM_AMAX_FP8`); torchao's and DeepSeek-V3's casts are their linears' own."""
    assert not any(FP8_RECIPES[name].norms_write_float8 for name in ("te-current", "torchao", "torchao-2024",
                                                                      "deepseek"))
    assert TE.norms_write_float8


def test_under_current_scaling_the_norm_takes_its_outputs_amax(block):
    """Current scaling's norm kernel takes its output's amax (`create_unquantized_tensor_with_amax`, then
    `quantize_with_amax`): of each norm-fed input's cast only the amax pass goes, 2 bytes an element and a kernel;
    the zeroing, the scale and the cast-transpose stay, and nothing else moves."""
    current = FP8_RECIPES["te-current"]
    fused = in_float8(block, current, 2)
    cast = in_float8(block, replace(current, norm_cast_kernels=None), 2)
    elements = TOKENS * WIDTH
    (fused_bytes, fused_kernels), (cast_bytes, cast_kernels) = _memory(fused, "fwd"), _memory(cast, "fwd")
    assert cast_bytes - fused_bytes == 2 * elements * 2
    assert cast_kernels - fused_kernels == 2
    assert all(_memory(fused, name) == _memory(cast, name) for name in ("bwd", "igrad", "wgrad"))


def test_a_mixture_of_experts_pre_mlp_norm_is_cast_by_its_readers():
    """Megatron-core runs a mixture of experts' pre-MLP norm as a TENorm of its own, which the router reads too:
    only the attention's norm writes float8."""
    moe = _block(experts=4, top_k=2)
    assert len(float8_norm_outputs(moe)) == 1
    assert norm_read_products(moe, float8_norm_outputs(moe)) == {(1, SEQ, 3 * WIDTH, WIDTH): 1}


def test_a_gathered_norm_output_is_transposed_whole_once():
    """Under sequence parallelism at t = 4 the weight gradient transposes the gathered float8 copy: the layer's own
    transpose covers the rank's share (1 + 1 bytes an element of it, one kernel), the gather's the rest; the
    gathered output gradient, cast-transposed on the rank's share, is read and written whole as before."""
    t, elements = 4, TOKENS * WIDTH
    share = elements // t
    bytes_per_ms = DEVICE.memory_bytes_per_ms
    overhead = DEVICE.curve.kernel_overhead_ms
    assert gathered_transposes_ms(elements, t, DEVICE, norm_share=1.0) == pytest.approx(
        overhead + ((2 * elements - share) + (2 * elements - 2 * share)) / bytes_per_ms)
    assert gathered_transposes_ms(elements, t, DEVICE) == pytest.approx(
        2 * overhead + 2 * (2 * elements - share) / bytes_per_ms)
    block = _block()
    assert gathered_norm_share(block, TE) == 1.0
    assert gathered_norm_share(block, FP8_RECIPES["te-current"]) == 0.0
    # a mixture of experts' router reads its pre-MLP norm's output on the rank's own tokens (Megatron-core's
    # TopKRouter under sequence parallelism): the attention's norm alone is gathered
    moe = _block(experts=4, top_k=2)
    assert [number for _, number in moe.sequence_inputs] == [number for number, _ in float8_norm_outputs(moe)]
    assert gathered_norm_share(moe, TE) == 1.0


def test_a_norm_fed_shape_is_taken_once_over_the_products_of_that_shape():
    """Qwen2's q (biased: `addmm`) and o (unbiased: `mm`) are two products of one shape, only q reading the norm:
    o's input is still cast in full (each product took the norm's count off, so o's cast was dropped under te
    and cut to the norm-fed kernels under te-current)."""
    q = OpCount("addmm", "matmul", (1, SEQ, WIDTH, WIDTH), 2 * SEQ * WIDTH * WIDTH, 0, 1)
    o = replace(q, op="mm")
    norm_inputs = Counter({q.shape: 1})
    te = cast_ops((q, o), ("input",), TE, 2, norm_inputs=norm_inputs)
    assert [(op.op, op.shape, op.count) for op in te] == [("fp8_cast_transpose_input", (SEQ, WIDTH), 1)]
    current = FP8_RECIPES["te-current"]
    kernels = [op.op for op in cast_ops((q, o), ("input",), current, 2, norm_inputs=norm_inputs)]
    assert kernels == [f"fp8_{kernel}_input" for kernel, _, _ in current.norm_cast_kernels + current.kernels]
