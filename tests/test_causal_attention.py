"""A causal attention kernel is priced by the FLOPs it computes: torch counts the whole s x s
(`sdpa_flop_count` ignores is_causal), FlashAttention skips the blocks past the diagonal, and the catalogue's
attention efficiencies are FlashAttention's benchmarks, which count a causal kernel as half the square. A
context-parallel ring passes keys and values at the heads the kernel reads them at (grouped-query attention)."""

from dataclasses import replace

import pytest

from pipesim.planning.estimate import (
    ContextRing,
    Parallelism,
    _Split,
    curve_terms,
    estimate_layer,
    kernel_flops,
    node_placement,
    op_ms,
    window_tile,
    window_tile_pairs,
)
from pipesim.profiles.schema import EstimateLink
from pipesim.profiles.workload import OpCount
from tests.conftest import needs_transformers
from tests.helpers import H100
from tests.helpers import H100_BF16 as DEVICE

HEADS, SEQ, HEAD = 32, 8192, 128
FLOPS = 4 * HEADS * SEQ * SEQ * HEAD  # torch's count of the forward: the whole square


def _attention(causal: bool) -> OpCount:
    return OpCount("_scaled_dot_product_flash_attention", "attention", (HEADS, SEQ, SEQ, HEAD), FLOPS,
                   4 * HEADS * SEQ * HEAD * 2, 1, causal=causal)


def test_a_causal_kernel_computes_half_the_square_and_takes_half_the_time():
    whole, causal = _attention(False), _attention(True)
    assert kernel_flops(whole) == FLOPS and kernel_flops(causal) == FLOPS / 2
    overhead = H100.curve.kernel_overhead_ms
    assert op_ms(causal, DEVICE) - overhead == pytest.approx((op_ms(whole, DEVICE) - overhead) / 2)
    assert FLOPS / 2 / (op_ms(causal, DEVICE) - overhead) == pytest.approx(
        DEVICE.peak_flops_per_ms * H100.curve.attention_efficiency)  # FlashAttention's convention, its efficiency


def test_a_sliding_window_kernel_computes_every_tile_its_band_touches():
    """Each of s queries attends to its last w keys: s·w - w(w-1)/2 pairs of the s x s square, but the kernel runs
    each block of queries against every key block the band touches, whole (flash-attn's n_block_min to
    n_block_max): FlashAttention-2's forward at head size 128 tiles 128 queries x 64 keys, so at w = 128 each block
    of queries runs 4 key blocks (the first 2), where the causal kernel runs 2m + 2 (its half square); priced as
    that share of the causal kernel, about twice the band's pairs. A window as long as the keys is the causal
    kernel."""
    window = 128
    windowed = replace(_attention(True), window=window)
    blocks, causal_blocks = 2 + 4 * (SEQ // 128 - 1), sum(2 * m + 2 for m in range(SEQ // 128))
    assert window_tile("flash2", False, HEAD) == (128, 64)
    assert window_tile_pairs(SEQ, SEQ, window, (128, 64)) == blocks * 128 * 64
    assert window_tile_pairs(SEQ, SEQ, SEQ, (128, 64)) == causal_blocks * 128 * 64
    assert kernel_flops(windowed) == pytest.approx(FLOPS / 2 * blocks / causal_blocks)
    pairs = SEQ * window - window * (window - 1) / 2
    assert kernel_flops(windowed) / (FLOPS * pairs / SEQ ** 2) == pytest.approx(1.969, abs=1e-3)  # the band's
    assert kernel_flops(replace(windowed, window=SEQ)) == kernel_flops(_attention(True)) == FLOPS / 2
    overhead = H100.curve.kernel_overhead_ms
    compute = (op_ms(_attention(True), DEVICE) - overhead) * blocks / causal_blocks  # the causal kernel's rate
    memory = windowed.moved_bytes / DEVICE.memory_bytes_per_ms
    assert op_ms(windowed, DEVICE) - overhead == pytest.approx(max(compute, memory))


def test_a_windows_tiles_are_its_kernels_for_the_pass_and_head_size():
    """FlashAttention-3's forward at head size 64 runs a window in 192 x 160 tiles (hopper/tile_size.h, is_local),
    FlashAttention-2's in 128 x 128; their backwards at head size 128 in 64 x 128; cuDNN, which publishes none,
    takes FlashAttention-3's. The device's kernel picks them: the same op costs more under FlashAttention-3's
    wider tiles at w = 128."""
    assert window_tile("flash3", False, 64) == (192, 160) and window_tile("flash2", False, 64) == (128, 128)
    assert window_tile("flash2", True, 128) == window_tile("flash3", True, 128) == (64, 128)
    assert window_tile("cudnn", False, 64) == window_tile("flash3", False, 64)
    assert window_tile("flash2", False, 512) == (64, 64)  # past the largest head size, the largest's
    narrow = OpCount("_scaled_dot_product_flash_attention", "attention", (64, SEQ, SEQ, 64), FLOPS / 2, 1.0, 1,
                     causal=True, window=128)
    assert kernel_flops(narrow, "flash3") > kernel_flops(narrow, "flash2")
    flash3 = replace(DEVICE, attention_kernel="flash3")
    assert op_ms(narrow, flash3) == pytest.approx(
        H100.curve.kernel_overhead_ms + kernel_flops(narrow, "flash3") / (
            DEVICE.peak_flops_per_ms * H100.curve.attention_fraction(False, True, 64 * SEQ // 128)))


def test_the_calibration_fits_the_attention_rate_on_the_same_flops_it_prices():
    class Layer:
        ops = {"fwd": (_attention(True),)}

    _, attention, _, kernels = curve_terms(Layer(), "fwd", 132, [(128, 128)])
    assert attention == FLOPS / 2 and kernels == 1


def test_the_context_ring_prices_the_visible_blocks_once():
    c = 2  # each rank: 2 of the 4 chunks, 2 visible pairs a step; every transfer hidden on a fast link
    split = _Split(1, False, HEADS * HEAD, SEQ, SEQ, c)
    mine = split.context_share(_attention(True))
    fast = ContextRing(c, EstimateLink(kind="nvlink", latency_ms=0.0, bytes_per_ms=1e15))
    block = OpCount(mine.op, mine.kind, mine.shape, mine.flops // 4, mine.moved_bytes // c, 1)
    assert fast.attention_ms(mine, DEVICE) == pytest.approx(c * op_ms(block, DEVICE))
    assert c * (op_ms(block, DEVICE) - H100.curve.kernel_overhead_ms) == pytest.approx(
        op_ms(mine, DEVICE) - H100.curve.kernel_overhead_ms)  # the rank's causal share, as one kernel would


def test_a_gpt_layer_counts_its_flash_kernels_causal_and_its_forward_saves_half_the_attention():
    torch = pytest.importorskip("torch")
    from pipesim.workload.count import count_built

    counted = count_built("gpt", {"layers": 2, "width": 256, "heads": 4, "seq_len": 512, "vocab": 1000},
                          microbatch_size=1, dtype=torch.bfloat16, attention="flash")
    layer = counted.layers[1]
    kernels = [op for name in ("fwd", "bwd", "igrad") for op in layer.ops[name] if op.kind == "attention"]
    assert len(kernels) == 3 and all(op.causal for op in kernels)
    links = node_placement(H100)
    causal = estimate_layer(layer, DEVICE, Parallelism(), links.node_link, 2)
    unmasked = {name: tuple(replace(op, causal=False) for op in ops) for name, ops in layer.ops.items()}
    whole = estimate_layer(replace(layer, ops=unmasked), DEVICE, Parallelism(), links.node_link, 2)
    (kernel,) = [op for op in layer.ops["fwd"] if op.kind == "attention"]
    saved_ms = op_ms(replace(kernel, causal=False), DEVICE) - op_ms(kernel, DEVICE)
    assert saved_ms > 0 and whole.fwd_ms - causal.fwd_ms == pytest.approx(saved_ms)


def test_the_context_ring_passes_keys_and_values_at_their_own_heads():
    ring = ContextRing(2, EstimateLink(kind="nvlink", latency_ms=0.0, bytes_per_ms=1e9))
    grouped = replace(_attention(True), kv_group=4)  # 32 query heads, 8 key/value heads
    (sent, _), after = ring.step_bytes(_attention(True), 2)
    (grouped_sent, _), grouped_after = ring.step_bytes(grouped, 2)
    assert sent == 2 * HEADS * SEQ * HEAD * 2 and grouped_sent == sent // 4
    backward = replace(grouped, op="_scaled_dot_product_flash_attention_backward")
    assert ring.step_bytes(backward, 2)[1] == 2 * HEADS // 4 * SEQ * HEAD * 4  # float32 gradients, 8 heads
    one_head = replace(_attention(True), shape=(2, SEQ, SEQ, HEAD), kv_group=8)  # t splits 2 heads: 1 kv head
    assert ring.step_bytes(one_head, 2)[0][0] == 2 * SEQ * HEAD * 2


def test_the_count_records_the_kernels_grouped_key_value_heads():
    torch = pytest.importorskip("torch")
    from pipesim.workload.count import count_built

    def groups(kv_heads: int) -> set[int]:
        counted = count_built("gpt", {"layers": 2, "width": 256, "heads": 8, "kv_heads": kv_heads, "seq_len": 64,
                                      "vocab": 100}, microbatch_size=1, dtype=torch.bfloat16, attention="flash")
        return {op.kv_group for name in ("fwd", "bwd") for op in counted.layers[1].ops[name] if op.kind == "attention"}

    assert groups(2) == {4} and groups(8) == {1}


@needs_transformers
def test_a_sliding_window_under_a_context_parallel_ring_is_one_line(tmp_path):
    """The ring passes every rank's keys and values to every other, as a causal kernel needs them; a window needs
    only its last w: not what pipesim's ring runs, so refused in one line. A window of every key (Mistral's 4,096
    at a shorter sequence) is the causal kernel, and runs as one (it was refused)."""
    from tests.conftest import pipesim, simulate_json
    from tests.helpers import LLAMA, write_config

    folder = write_config(tmp_path / "mistral", {**LLAMA, "model_type": "mistral", "sliding_window": 8})
    code, out, err = pipesim("simulate", "--model", f"hf:{folder}", "--seq-len", 32, "--gpu", "h100-sxm",
                             "--attention", "flash", "--context-parallel", 2, "-p", 1, "-m", 2)
    assert code == 2 and out == "" and err.strip().splitlines() == [
        "error: --context-parallel 2, but the model's attention has a sliding window of 8 keys, which pipesim's "
        "context-parallel ring does not run; give --context-parallel 1"], err
    whole = write_config(tmp_path / "whole", {**LLAMA, "model_type": "mistral", "sliding_window": 32})
    causal = write_config(tmp_path / "causal", {**LLAMA, "model_type": "mistral", "sliding_window": None})
    ran = [simulate_json("--model", f"hf:{folder}", "--seq-len", 32, "--gpu", "h100-sxm", "--attention", "flash",
                         "--context-parallel", 2, "-p", 1, "-m", 2)[0]["time_per_minibatch_ms"]
           for folder in (whole, causal)]
    assert ran[0] == ran[1]
