"""A weight-gradient product that accumulates into the held gradients (`--grad-accumulation fused`,
planning/estimate.py `accumulated_in_products`) reads and writes them in its epilogue, 2 x their element's bytes on
top of its main loop, where the count writes its 16-bit output once: a routed expert seeing a few tokens beside its
weight is bound by those bytes, and a dense product's FLOPs do not hide them."""

from __future__ import annotations

from functools import cache

import pytest
import torch

from pipesim.planning.estimate import (
    Parallelism,
    _Split,
    accumulated_in_products,
    accumulating,
    estimate_layer,
    estimate_profile,
    matmul_ms,
    placement_links,
)
from pipesim.profiles.workload import LayerCount, OpCount
from pipesim.workload.count import WorkloadCount, count_built
from tests.helpers import H100
from tests.helpers import H100_BF16 as DEVICE


@cache
def moe(width: int = 512, seq_len: int = 64, experts: int = 32) -> WorkloadCount:
    """A MoE gpt whose 32 experts each see 2 of a micro-batch's 64 tokens (top-1)."""
    return count_built("gpt", dict(layers=2, width=width, heads=4, seq_len=seq_len, vocab=128, experts=experts,
                                   top_k=1), 1, torch.bfloat16, "flash")


def _matmuls(layer: LayerCount, name: str) -> list:
    return [op for op in layer.ops[name] if op.kind == "matmul"]


def test_each_weight_gradient_product_moves_the_gradient_read_and_written_and_nothing_else_does():
    """float32 gradients beside a 16-bit count: each weight's gradient (m x n of its batch) read and written in the
    product's epilogue, 8 bytes an element, where the count wrote 2 in its main loop's bytes, in the wgrad pass and in
    the full backward; the input-gradient products and the forward as counted."""
    block = moe().layers[1]
    fused = accumulated_in_products(block, 4, 2)
    for before, after in zip(_matmuls(block, "wgrad"), _matmuls(fused, "wgrad"), strict=True):
        batch, m, n, _ = before.shape
        assert (after.epilogue_bytes, before.moved_bytes - after.moved_bytes) == (8 * batch * m * n, 2 * batch * m * n)
        assert before.epilogue_bytes == 0
    wgrad = set(_matmuls(fused, "wgrad"))
    backward = _matmuls(fused, "bwd")
    assert wgrad <= set(backward)
    assert [op for op in backward if op not in wgrad] == _matmuls(block, "igrad")
    assert fused.ops["fwd"] == block.ops["fwd"] and fused.ops["igrad"] == block.ops["igrad"]


def test_a_compute_bound_product_adding_into_float32_takes_its_epilogue_bytes_on_top_of_its_flops():
    """The H200 probe's BF16 weight gradients added into float32 ran 18-20 % slower than writing BF16, the
    gradient's 8 bytes an element on top of the FLOPs (docs/hardware.md): a dense product over 8,192 tokens, FLOPs
    bound either way, takes them at the memory's rate after its main loop, not hidden under its FLOPs."""
    product = OpCount("mm", "matmul", (1, 4096, 4096, 8192), 2 * 4096 * 4096 * 8192,
                      2 * (2 * 4096 * 8192 + 4096 * 4096), 1)
    fused = accumulating(product, 4, 2)
    assert matmul_ms(fused, DEVICE) - matmul_ms(product, DEVICE) == pytest.approx(
        8 * 4096 * 4096 / DEVICE.memory_bytes_per_ms)


@pytest.mark.parametrize("seq_len", [128, 256])
def test_a_context_parallel_rank_adds_into_its_whole_weight_gradient_whatever_the_weights_sides_measure(seq_len):
    """Under C = 2 each rank contracts over half the tokens and adds into the whole weight's gradient: its epilogue's
    bytes as on one rank, its tokens halved, also where a weight's side measures the micro-batch's tokens (128 wide
    at 128 tokens, as a 70B's 8,192 at seq 8,192), which the split once took for the tokens and halved instead."""
    count = count_built("gpt", dict(layers=2, width=128, heads=4, seq_len=seq_len, vocab=128), 1, torch.bfloat16,
                        "flash")
    block = accumulated_in_products(count.layers[1], 4, 2)
    split = _Split.of(block, Parallelism(context=2))
    products = [op for op in block.ops["wgrad"] if op.kind == "matmul"]
    for op in products:
        ((mine, _, share),) = split.products(op, "wgrad")
        assert (mine.epilogue_bytes, mine.shape[:3], mine.shape[3], share) == (
            op.epilogue_bytes, op.shape[:3], op.shape[3] // 2, 1.0)
    assert any(seq_len in op.shape[1:3] for op in products) == (seq_len == 128)


def test_an_input_gradient_product_of_a_weight_gradients_shape_keeps_its_calls():
    """A 64 x 64 weight over 64 tokens: its input's gradient and its weight's are one (1, 64, 64, 64) entry of
    the full backward, 2 calls, of which only the weight's accumulates."""
    block = moe(width=64, seq_len=64, experts=8).layers[1]
    both = next(op for op in block.ops["bwd"] if op.kind == "matmul" and op.shape == (1, 64, 64, 64))
    assert both.count == 2
    fused = [op for op in accumulated_in_products(block, 4, 2).ops["bwd"] if op.shape == both.shape]
    assert sorted((op.count, op.epilogue_bytes) for op in fused) == [(1, 0), (1, 8 * 64 * 64)]


def test_the_experts_few_tokens_make_their_weight_gradients_as_slow_as_the_gradients_bytes():
    """Each expert's weight-gradient product contracts over its 2 tokens: its bytes bind, so float32 gradients
    cost it 4 bytes an element more than 16-bit ones, at the memory's rate (a dense product over the micro-batch's
    64 tokens at most as much), in the wgrad pass and the whole backward alike; None (no accumulation in the
    products) writes the count's 16 bits."""
    block = moe().layers[1]
    links = placement_links(H100, Parallelism()).tensor
    priced = {grad: estimate_layer(block, DEVICE, Parallelism(), links, 2, grad_bytes=grad) for grad in (None, 2, 4)}
    routed, dense = (sum(op.shape[0] * op.shape[1] * op.shape[2] for op in _matmuls(block, "wgrad")
                         if op.routed == experts) for experts in (True, False))
    assert priced[None].wgrad_ms < priced[2].wgrad_ms < priced[4].wgrad_ms
    # the experts' products bound by their bytes both ways; the dense ones (64 tokens) at most
    assert 4 * routed / DEVICE.memory_bytes_per_ms < priced[4].wgrad_ms - priced[2].wgrad_ms \
        <= 4 * (routed + dense) / DEVICE.memory_bytes_per_ms * (1 + 1e-9)
    assert priced[4].bwd_ms - priced[2].bwd_ms == pytest.approx(priced[4].wgrad_ms - priced[2].wgrad_ms, rel=1e-9)
    assert priced[4].igrad_ms == priced[None].igrad_ms and priced[4].fwd_ms == priced[None].fwd_ms


def test_an_estimate_accumulates_in_the_gradients_its_precision_holds_only_where_fused():
    """Megatron's float32 gradients make the MoE stage's backward slower than its 16-bit ones; under separate
    accumulation the products write the count's output and the two precisions' backwards agree. (The host's
    issue left out: this small layer's kernels are issued slower than the GPU runs them, planning/host.py.)"""
    def bwd_ms(**given) -> float:
        return estimate_profile(moe(), H100, Parallelism(host_kernel_us=0.0, **given)).stages[0].bwd_ms

    assert bwd_ms(precision="megatron") > bwd_ms(precision="megatron-16bit-grads")
    assert bwd_ms(precision="megatron", grad_accumulation="separate") == \
        bwd_ms(precision="megatron-16bit-grads", grad_accumulation="separate")
