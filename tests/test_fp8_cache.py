"""--fp8-recipe deepseek (planning/fp8.py): DeepSeek-V3's low-precision storage (its report, 3.3.3) on the tensors
the count traced (workload/count.py `_Regions`): the attention's output kept once at 1.5 bytes an element (E5M6)
for its backward and the output projection's, the routed experts' SwiGLU inputs in float8; nothing else moved."""

from __future__ import annotations

from pipesim.planning.fp8 import FP8_RECIPES, in_float8
from tests.test_recompute_modules import B, S, deepseek, needs_transformers


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
