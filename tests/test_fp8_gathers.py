"""TransformerEngine's float8 recipes cast before they gather: a float8 layer's sequence-parallel all-gathers (the
forward's of a column-parallel product's input, the backward's of an output gradient and its re-gather of the
saved input) move 1 byte an element, with and without --tp-overlap (planning/estimate.py `estimate_layer`), and
the weight gradients' transposes of the gathered tensors are kernels of their own (`gathered_transposes_ms`)."""

from dataclasses import replace

import pytest

from pipesim.planning import estimate
from pipesim.planning.estimate import Parallelism, estimate_layer, gathered_transposes_ms, placement_links
from pipesim.planning.fp8 import FP8_RECIPES, gathered_norm_share
from tests.helpers import H100
from tests.helpers import H100_FP8 as DEVICE

T, WIDTH, SEQ = 4, 4096, 2048
# a link so slow that every transfer outlasts the chunk beside it: each gathered byte is exposed
SLOW = placement_links(H100, Parallelism(tensor=T)).tensor.model_copy(update={"latency_ms": 0.0, "bytes_per_ms": 1e5})


@pytest.fixture(scope="module")
def block():
    torch = pytest.importorskip("torch")
    from pipesim.workload.count import count_built

    return count_built("gpt", dict(layers=2, width=WIDTH, heads=32, seq_len=SEQ, vocab=512), 1,
                       torch.bfloat16).layers[1]


@pytest.mark.parametrize("tp_overlap", [True, False])
def test_a_float8_layers_forward_gathers_its_products_inputs_in_float8(block, monkeypatch, tp_overlap):
    """The forward's two all-gathers (into QKV and the MLP's first product) at 1 byte an element: against the same
    recipe gathering 16-bit copies, each saves (t-1)/t of a tokens x width tensor's second byte on the link."""
    parallel = Parallelism(tensor=T, sequence_parallel=True, tp_overlap=tp_overlap, fp8="te")
    float8 = estimate_layer(block, DEVICE, parallel, SLOW, 2)
    monkeypatch.setitem(FP8_RECIPES, "te", replace(FP8_RECIPES["te"], gathers_float8=False))
    sixteen_bit = estimate_layer(block, DEVICE, parallel, SLOW, 2)
    saved_byte_ms = (T - 1) / T * SEQ * WIDTH / SLOW.bytes_per_ms
    assert sixteen_bit.fwd_ms - float8.fwd_ms == pytest.approx(2 * saved_byte_ms)
    # the backward's two output-gradient gathers and two input re-gathers, each exposed whole on a slow link; a
    # 16-bit gather makes no float8 transposes of what it gathered
    transposes_ms = gathered_transposes_ms(SEQ * WIDTH, T, DEVICE, gathered_norm_share(block, FP8_RECIPES["te"]))
    assert sixteen_bit.bwd_ms - float8.bwd_ms == pytest.approx(4 * saved_byte_ms - 2 * transposes_ms, rel=1e-6)


@pytest.mark.parametrize("tp_overlap", [True, False])
def test_each_backward_transposes_its_two_gathered_float8_tensors_whole(block, monkeypatch, tp_overlap):
    """TransformerEngine 1.x transposes the gathered input (LayerNormLinear's `ln_out_total`) and the gathered
    output gradient (`grad_output_preprocess`) after the gather, each read and written whole at 1 byte an element,
    where the fused cast-transpose had written the rank's 1/t: (2 - 1/t) x 2 bytes an element of each, for the
    QKV and first MLP products' input gradients."""
    elements = SEQ * WIDTH
    moved = 2 * (2 * elements - elements // T)
    assert gathered_transposes_ms(elements, T, DEVICE) == pytest.approx(
        2 * DEVICE.curve.kernel_overhead_ms + moved / DEVICE.memory_bytes_per_ms)
    parallel = Parallelism(tensor=T, sequence_parallel=True, tp_overlap=tp_overlap, fp8="te")
    link = placement_links(H100, parallel).tensor
    bf16 = replace(parallel, fp8=None)  # gathers 16-bit copies and transposes nothing after
    with_transposes, bf16_before = (estimate_layer(block, DEVICE, run, link, 2) for run in (parallel, bf16))
    monkeypatch.setattr(estimate, "gathered_transposes_ms", lambda *_: 0.0)
    without = estimate_layer(block, DEVICE, parallel, link, 2)
    assert with_transposes.fwd_ms == without.fwd_ms
    # both gathered inputs are norms' outputs written in float8 (tests/test_fp8_norm_casts.py)
    transposes_ms = gathered_transposes_ms(elements, T, DEVICE, norm_share=1.0)
    assert with_transposes.bwd_ms - without.bwd_ms == pytest.approx(2 * transposes_ms)
    assert estimate_layer(block, DEVICE, bf16, link, 2).bwd_ms == bf16_before.bwd_ms

