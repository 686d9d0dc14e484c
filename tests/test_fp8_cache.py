"""--fp8-recipe deepseek (planning/fp8.py): DeepSeek-V3's low-precision storage (its report, 3.3.3) on the tensors
the count traced (workload/count.py `_Regions`): the attention's output kept once at 1.5 bytes an element (E5M6)
for its backward and the output projection's, the routed experts' SwiGLU inputs in float8, and until a deferred
weight pass the routed down-projection's output gradient in float8 with a float32 scale a 1x128 tile; nothing else
moved."""

from __future__ import annotations

from pipesim.hardware.catalogue import load_catalogue
from pipesim.planning.estimate import Device, Parallelism, estimate_layer, placement_links
from pipesim.planning.fp8 import FP8_RECIPES, in_float8
from tests.conftest import needs_transformers
from tests.helpers import B, S
from tests.helpers import tiny_deepseek_count as deepseek


@needs_transformers
def test_deepseeks_storage_changes_exactly_the_attention_output_and_the_swiglu_inputs():
    """The tiny DeepSeek's MoE layer against te's recipe: the output projection's input (B·S tokens x 2 heads of
    16, float8 under te) at 1.5 bytes; the flash kernel's own 16-bit output (padded to 24) kept as none; each of 8
    experts' 16 tokens' SwiGLU input (gate and up, 64) and the router's weights halved; every other save alike."""
    layer = deepseek().layers[2]
    te, ours = (in_float8(layer, FP8_RECIPES[name], 2) for name in ("te", "deepseek"))
    changed = {i: (layer.saved_tensors[i], after) for i, (before, after) in
               enumerate(zip(te.saved_tensors, ours.saved_tensors)) if before != after}
    assert sorted(changed.values()) == sorted([
        (((B * S, 32), B * S * 32 * 2), ((B * S, 32), B * S * 32 * 3 // 2)),
        (((B, 2, S, 24), B * 2 * S * 24 * 2), ((B, 2, S, 24), 0)),
        (((8, 16, 64), 8 * 16 * 64 * 2), ((8, 16, 64), 8 * 16 * 64)),
        (((8, 16, 1), 8 * 16 * 2), ((8, 16, 1), 8 * 16))])
    assert ours.saved_bytes - te.saved_bytes == sum(after[1] for _, after in changed.values()) - sum(
        nbytes for (_, nbytes), (shape, _) in ((te.saved_tensors[i], after) for i, (_, after) in changed.items()))
    cached = [op for op in ours.ops["fwd"] if op.op == "fp8_cache"]
    assert len(cached) == 3 and all(op.op == "fp8_uncache" for op in ours.ops["igrad"][-3:])


@needs_transformers
def test_the_dense_layer_caches_its_attention_output_only():
    layer = deepseek().layers[1]
    te, ours = (in_float8(layer, FP8_RECIPES[name], 2) for name in ("te", "deepseek"))
    assert ours.saved_bytes - te.saved_bytes == B * S * 32 * 3 // 2 - B * S * 32 - B * 2 * S * 24 * 2


@needs_transformers
def test_a_recomputed_up_projection_reruns_in_float8_as_its_forward_ran():
    layer = deepseek().layers[1]
    rerun = in_float8(layer, FP8_RECIPES["te"], 2).region_ops["mla_up_proj"]
    products = [op for op in rerun if op.kind == "matmul"]
    assert len(products) == 2 and all(op.float8 for op in products)
    assert not any(op.float8 for op in layer.region_ops["mla_up_proj"])


@needs_transformers
def test_a_deferred_weight_pass_keeps_the_routed_down_projections_output_gradient_in_float8():
    """3.3.3: "A similar strategy is applied to the activation gradient before MoE down-projections". The tiny
    DeepSeek's MoE layer: of its products' output gradients only the 8 experts' down-projection's (16 tokens x 64
    each, 16-bit as counted) is kept at 1 byte an element and 4 a row's 1x128 tile (a row of 64 is one tile: 4 bytes
    a row, not 64 elements' share of a whole tile), under te all stay 16-bit; the
    dense layer keeps its own as counted; the estimate's W holds that much less from I until W."""
    moe, dense = deepseek().layers[2], deepseek().layers[1]
    te, ours = (in_float8(moe, FP8_RECIPES[name], 2) for name in ("te", "deepseek"))
    assert te.weight_grad_outputs == moe.weight_grad_outputs
    changed = [(before, after) for before, after in zip(te.weight_grad_outputs, ours.weight_grad_outputs)
               if before != after]
    elements, rows = 8 * 16 * 64, 8 * 16
    assert changed == [(((8, 16, 64, 32), elements * 2, False), ((8, 16, 64, 32), elements + rows * 4, False))]
    assert in_float8(dense, FP8_RECIPES["deepseek"], 2).weight_grad_outputs == dense.weight_grad_outputs
    h800 = load_catalogue().find("h800")
    device = Device(h800.dense_tflops.fp16 * 1e9, h800.memory_bandwidth_gb_s * 1e6, h800.curve,
                    h800.dense_tflops.fp8 * 1e9)
    kept = {name: estimate_layer(moe, device, Parallelism(fp8=name), placement_links(h800, Parallelism()).tensor, 2)
            for name in ("te", "deepseek")}
    assert kept["te"].wgrad_gradient_bytes - kept["deepseek"].wgrad_gradient_bytes == elements - rows * 4


def test_one_routed_expert_keeps_its_down_projections_output_gradient_in_float8_as_two_do():
    """One routed expert's grouped products have a batch of 1, as a linear product's: the count marks them routed
    (`LayerCount.weight_grad_routed`), so its down-projection's output gradient (64 tokens x 64, top-1) is kept at 1
    byte an element and 4 a row's tile, as two experts' (2 x 32 tokens) are; the gate and the rest as counted."""
    import torch

    from pipesim.workload.count import count_built

    for experts in (1, 2):
        block = count_built("gpt", {"layers": 2, "width": 64, "heads": 2, "seq_len": 32, "vocab": 256,
                                    "experts": experts, "top_k": 1}, 2, torch.bfloat16, "flash").layers[1]
        ours = in_float8(block, FP8_RECIPES["deepseek"], 2)
        changed = [(before, after) for before, after in zip(block.weight_grad_outputs, ours.weight_grad_outputs)
                   if before != after]
        down = (experts, 64 // experts, 64, 256)
        assert changed == [((down, 64 * 64 * 2, False), (down, 64 * 64 + 64 * 4, False))], experts
