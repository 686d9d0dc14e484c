"""--expert-gemm per-expert (planning/experts.py `per_expert_products`): a rank's routed experts' products run as
TransformerEngine's GroupedLinear runs them, one GEMM per local expert, each expert's float8 casts on their own
under current scaling and in one kernel under delayed scaling (planning/fp8.py `Fp8Recipe.fuses_split_casts`);
grouped (one kernel over them all) stays the default; a bad value is one line."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from pipesim.planning.experts import per_expert_products
from pipesim.planning.fp8 import FP8_RECIPES, in_float8
from pipesim.profiles.workload import LayerCount, OpCount
from tests.conftest import needs_transformers, pipesim
from tests.helpers import H100

EXPERTS, TOKENS, WIDTH, FFN = 8, 64, 128, 256  # a rank's 8 local experts, 64 token copies each


def _layer(attention: bool = True) -> LayerCount:
    """A layer with the experts' grouped product (and a fused attention kernel and a linear product unless not
    `attention`: the routed part alone, as an overlapped pair's experts node is priced)."""
    flash = OpCount("flash", "attention", (4, 64, 64, 32), 4 * 4 * 64 * 64 * 32, 0, 1)
    linear = OpCount("mm", "matmul", (1, 512, WIDTH, WIDTH), 2 * 512 * WIDTH * WIDTH, 2 * 3 * 512 * WIDTH, 1)
    routed = OpCount("bmm", "matmul", (EXPERTS, TOKENS, FFN, WIDTH), 2 * EXPERTS * TOKENS * FFN * WIDTH,
                     2 * EXPERTS * (TOKENS * WIDTH + WIDTH * FFN + TOKENS * FFN), 1, routed=True)
    ops = {"fwd": (flash, linear, routed) if attention else (routed,), "igrad": (), "wgrad": (), "bwd": ()}
    return LayerCount("1:block", 0, 0, 0, 0, 0, 0, 0, 0, 0, {}, {}, (1, 512, WIDTH), 2 * 512 * WIDTH, (0,),
                      ops=ops)


def test_each_local_expert_runs_its_own_product_with_the_same_work():
    grouped = _layer()
    split = per_expert_products(grouped)
    *dense, routed = split.ops["fwd"]
    assert tuple(dense) == grouped.ops["fwd"][:2]
    (whole,) = [op for op in grouped.ops["fwd"] if op.routed]
    assert (routed.shape, routed.count, routed.routed) == ((1, TOKENS, FFN, WIDTH), EXPERTS, True)
    assert (routed.count * routed.flops, routed.count * routed.moved_bytes) == (whole.flops, whole.moved_bytes)


@pytest.mark.parametrize("recipe, kernels", [("te-current", EXPERTS), ("te", 1)])
def test_current_scaling_casts_each_experts_split_and_delayed_scaling_all_in_one_kernel(recipe, kernels):
    """TransformerEngine's split_quantize: nvte_multi_cast_transpose over every split for delayed scaling's
    quantizers, each split quantized on its own for current scaling's; the bytes are the same either way."""
    forward = in_float8(per_expert_products(_layer()), FP8_RECIPES[recipe], 2).ops["fwd"]
    casts = [op for op in forward if op.op == "fp8_cast_transpose_input" and op.shape == (TOKENS, WIDTH)]
    assert [op.count for op in casts] == [kernels]
    # current scaling's quantize of a split: zero its amax (a one-thread kernel), the amax, the scale, the cast
    # (TransformerEngine v2.9 to v2.14: quantizer.cpp `quantize_impl`, current_scaling.cu `launch_amax_kernel`)
    before = [(op.op, op.count) for op in forward if op.op.startswith("fp8_") and op.op.endswith("_input")
              and op.shape == (TOKENS, WIDTH)]
    assert before == ([(f"fp8_{kernel}_input", EXPERTS) for kernel in ("zero_amax", "amax", "scale", "cast_transpose")]
                      if recipe == "te-current" else [("fp8_cast_transpose_input", 1)])
    assert casts[0].count * casts[0].moved_bytes == EXPERTS * TOKENS * WIDTH * (2 + 2)
    grouped = [op for op in in_float8(_layer(), FP8_RECIPES[recipe], 2).ops["fwd"]
               if op.op == "fp8_cast_transpose_input" and op.shape == (TOKENS, WIDTH)]
    assert [op.count for op in grouped] == [1]  # the default's one kernel, whatever the recipe


def test_the_routed_part_alone_still_runs_its_products_in_float8():
    """An overlapped pair's experts node is priced on the routed ops alone: one expert's products (batch 1) are a
    transformer layer's routed products, converted as they are beside the attention; torchao leaves them 16-bit."""
    routed_only = per_expert_products(_layer(attention=False))
    (te,) = [op for op in in_float8(routed_only, FP8_RECIPES["te"], 2).ops["fwd"] if op.kind == "matmul"]
    assert te.float8 and te.count == EXPERTS
    torchao = in_float8(per_expert_products(_layer()), FP8_RECIPES["torchao"], 2).ops["fwd"]
    assert [op.float8 for op in torchao if op.kind == "matmul"] == [True, False]


MOE = ("--model", "gpt", "--layers", 2, "--width", 256, "--heads", 4, "--seq-len", 512, "--vocab", 1000, "--gated",
       "--experts", 16, "--top-k", 2, "--expert-ffn", 512, "--gpu", "h100-sxm", "--data-parallel", 4,
       "--expert-parallel", 4, "--dtype", "fp8", "--fp8-recipe", "te-current")


def test_the_cli_prices_a_moe_layer_per_expert_and_leaves_the_rest(tmp_path):
    """A rank's 4 local experts: each product a kernel of its own and each cast four, so the MoE layers' passes
    take longer and the host issues more of their forward kernels; the embedding's forward (before the first
    dispatch: the host runs ahead, planning/host.py) is unchanged."""
    out = {}
    for how in ("grouped", "per-expert"):
        path = tmp_path / f"{how}.json"
        code, _, err = pipesim("estimate", *MOE, "--expert-gemm", how, "-o", path)
        assert code == 0, err
        out[how] = json.loads(path.read_text())
    assert out["per-expert"]["estimate"]["parallelism"]["expert_gemm"] == "per-expert"
    for grouped, per_expert in zip(out["grouped"]["layers"], out["per-expert"]["layers"]):
        if grouped["all_to_all_fwd_ms"] > 0:
            assert per_expert["fwd"]["median_ms"] > grouped["fwd"]["median_ms"]
            assert per_expert["bwd"]["median_ms"] > grouped["bwd"]["median_ms"]
    assert out["per-expert"]["layers"][0]["fwd"] == out["grouped"]["layers"][0]["fwd"]


def test_a_bad_value_is_one_line_and_nothing_written(tmp_path):
    path = tmp_path / "out.json"
    code, out, err = pipesim("estimate", *MOE, "--expert-gemm", "cutlass", "-o", path)
    assert code == 2 and not out and not path.exists()
    assert err.strip() == "error: --expert-gemm: choose from grouped, per-expert (got 'cutlass')"


@pytest.mark.parametrize("command", [("estimate", "-o"), ("simulate", "--html")])
def test_per_expert_on_a_dense_model_is_one_line_and_nothing_written(tmp_path, command):
    """A model without routed experts has no products to run per expert: refused as the other MoE flags are."""
    path = tmp_path / "out"
    dense = (*MOE[:MOE.index("--experts")], "--gpu", "h100-sxm")
    code, out, err = pipesim(*command, path, *dense, "--expert-gemm", "per-expert")
    assert code == 2 and not out and not path.exists()
    assert err.strip() == ("error: --expert-gemm per-expert runs a mixture of experts' routed products, and the "
                           "model has none (gpt --experts, or a Hugging Face MoE config); give grouped")


def test_four_local_experts_share_the_waves_on_transformer_engines_four_streams():
    """TransformerEngine issues the GEMMs round-robin on its 4 compute streams: 4 local experts' products fill the
    multiprocessors together as the one grouped kernel does; 8 run as two such waves, each a kernel overhead."""
    from pipesim.planning.estimate import Device, matmul_ms

    device = Device(H100.dense_tflops.bf16 * 1e9, H100.memory_bandwidth_gb_s * 1e6, H100.curve)
    for experts in (4, 8):
        grouped = OpCount("bmm", "matmul", (experts, 96, 640, WIDTH), 2 * experts * 96 * 640 * WIDTH,
                          2 * experts * (96 * WIDTH + WIDTH * 640 + 96 * 640), 1, routed=True)
        layer = replace(_layer(attention=False), ops={"fwd": (grouped,), "igrad": (), "wgrad": (), "bwd": ()})
        (each,) = per_expert_products(layer).ops["fwd"]
        assert (each.count, each.streams) == (experts, 4)
        waves = replace(grouped, shape=(4, 96, 640, WIDTH), flops=grouped.flops * 4 // experts,
                        moved_bytes=grouped.moved_bytes * 4 // experts)
        assert each.count * matmul_ms(each, device) == pytest.approx(experts // 4 * matmul_ms(waves, device))
        one_at_a_time = replace(each, streams=1)
        assert matmul_ms(each, device) < matmul_ms(one_at_a_time, device)  # alone, a few tiles leave most SMs idle


def test_tune_refuses_per_expert_on_a_dense_model_as_such():
    """tune takes each of its estimates' refusals as a tensor-parallel degree that does not suit the model: this one
    is the flag's, whatever the degree, and said so."""
    dense = (*MOE[:MOE.index("--experts")], "--gpu", "h100-sxm")
    code, out, err = pipesim("tune", *dense, "-D", 8, "-B", 16, "--expert-gemm", "per-expert")
    assert code == 2 and not out
    assert err.strip().splitlines()[-1].startswith("error: --expert-gemm per-expert runs a mixture of experts'")


def test_megatron_cores_bias_ops_marked_a_local_experts_run_once_a_local_expert():
    """An op the count marks as a local expert's (`OpCount.per_expert`: `_apply_bias`'s mul and add, batched over
    the experts in the count) becomes one kernel a local expert, the batch of the layer's grouped products, with
    the same bytes; an unmarked memory op stays one kernel."""
    bias = OpCount("add", "memory", (EXPERTS, TOKENS, WIDTH), 0, 3 * EXPERTS * TOKENS * WIDTH * 2, 1, routed=True,
                   per_expert=True)
    cat = OpCount("cat", "memory", (EXPERTS * TOKENS, WIDTH), 0, 2 * EXPERTS * TOKENS * WIDTH * 2, 1, routed=True)
    layer = _layer()
    layer = replace(layer, ops={**layer.ops, "fwd": (*layer.ops["fwd"], bias, cat)})
    *_, each, joined = per_expert_products(layer).ops["fwd"]
    assert (each.count, each.count * each.moved_bytes) == (EXPERTS, bias.moved_bytes)
    assert joined == cat
    assert per_expert_products(replace(layer, ops={**layer.ops, "fwd": (bias,)})).ops["fwd"] == (bias,)  # no experts


def _issued(tmp_path, model: str, how: str) -> dict[str, int]:
    """The MoE layer's kernels a pass under `--expert-gemm how`: its time at 2 ms a kernel less at 1 ms."""
    from tests.helpers import estimated_layers as layers

    slow, slower = (layers(tmp_path, "--model", model, "--seq-len", 32, "-b", 2, "--gpu", "h100-sxm",
                           "--data-parallel", 2, "--expert-parallel", 2, "--dtype", "bf16", "--expert-gemm", how,
                           "--host-kernel-us", us)[1] for us in (1000, 2000))
    return {name: round(slower[name]["median_ms"] - slow[name]["median_ms"]) for name in ("fwd", "bwd", "igrad",
                                                                                           "wgrad")}


@needs_transformers
def test_megatron_core_adds_gpt_oss_down_bias_one_local_expert_at_a_time(tmp_path):
    """TEGroupedMLP's `_apply_bias` (megatron/core/transformer/moe/experts.py at 0d8e0714cd, b0cc2706, core_v0.17.0)
    adds the down product's bias to each local expert's split apart, `t + b * p`: a mul and an add a local expert
    forward; backward the mul's products by the router's weights and by the bias and their reductions to the bias's
    and the weights' shapes (4 a local expert; 2 in each of a split backward's passes), the add passing its gradient
    on. At 8 experts over 2 ranks, 4 local experts: 3 more each than the count's batched one, beyond what the
    per-expert GEMMs add to Mixtral's experts, which have no bias."""
    from tests.helpers import GPT_OSS, MIXTRAL, write_config

    oss, mixtral = (f"hf:{write_config(tmp_path / name, fields)}" for name, fields in (("oss", GPT_OSS),
                                                                                        ("mixtral", MIXTRAL)))
    added = {}
    for name, model in (("oss", oss), ("mixtral", mixtral)):
        per_expert, grouped = (_issued(tmp_path, model, how) for how in ("per-expert", "grouped"))
        added[name] = {key: per_expert[key] - grouped[key] for key in per_expert}
    assert {key: added["oss"][key] - added["mixtral"][key] for key in added["oss"]} == {
        "fwd": 2 * 3, "bwd": 4 * 3, "igrad": 2 * 3, "wgrad": 2 * 3}
