"""Mixtures of experts (workload/moe.py): the gpt's `--experts` and Hugging Face MoE configs counted at balanced
routing, held against the dense models that must do the same products (a router aside), DeepSeek-V3's published
parameter counts, the real routing the executor would run, and bad input refused in one line."""

from __future__ import annotations

import json
from functools import cache
from pathlib import Path

import pytest
import torch

from pipesim.planning.estimate import unfused_weight_share
from pipesim.workload.count import WorkloadCount, count_built
from pipesim.workload.moe import expected_tokens, routed_experts
from tests.conftest import needs_transformers, pipesim, reductions, simulate_json
from tests.helpers import EXPERT_FFN as FFN
from tests.helpers import (
    EXPERTS,
    GPT_OSS,
    MIXTRAL,
    QWEN3,
    QWEN3_MOE,
    TINY_DEEPSEEK,
    TOP_K,
    B,
    H,
    S,
    count_config,
    tiny_deepseek_count,
    write_config,
)
from tests.helpers import MOE_LLAMA as LLAMA

ROOT = Path(__file__).resolve().parents[1]
TOKENS = B * S
GPT = dict(layers=1, width=H, heads=4, seq_len=S, vocab=100, gated=True)
MLP_FLOPS = 3 * 2 * H * FFN  # a SwiGLU expert's three products, per token
ROUTER_FLOPS = 2 * TOKENS * H * EXPERTS  # per micro-batch, forward (and again for each backward part)


@cache
def gpt_count(swiglu_fusion: bool = True, **options) -> WorkloadCount:
    return count_built("gpt", {**GPT, **options}, B, torch.bfloat16, swiglu_fusion=swiglu_fusion)


def block(counted: WorkloadCount):
    return counted.layers[1]


def test_expected_tokens_are_k_over_e_of_them_or_the_capacity():
    assert expected_tokens(64, 2, 8) == 16
    assert expected_tokens(64, 2, 8, capacity_factor=1.25) == 20
    assert expected_tokens(10, 2, 8) == 3  # ⌈2.5⌉
    assert expected_tokens(64, 2, 8, capacity_factor=4.0) == 64  # C = E/k: every token, the most a C may give


def test_top_k_of_e_experts_do_the_products_of_a_dense_mlp_k_times_as_wide_plus_the_router():
    """Balanced routing: each expert computes k·T/E tokens, so E experts of f do what one MLP of k·f does for all
    T tokens; the router adds one product of E scores per token, forward, input- and weight-gradient alike."""
    moe, dense = block(gpt_count(experts=EXPERTS, top_k=TOP_K, expert_ffn=FFN)), block(gpt_count(ffn=TOP_K * FFN))
    assert moe.fwd_flops - dense.fwd_flops == ROUTER_FLOPS
    assert moe.igrad_flops - dense.igrad_flops == ROUTER_FLOPS
    assert moe.wgrad_flops - dense.wgrad_flops == ROUTER_FLOPS


def test_its_weights_are_every_experts_and_the_routers():
    """All E experts' weights are held (bias-free, as Mixtral's), whatever share of the tokens each computes."""
    moe, dense = block(gpt_count(experts=EXPERTS, top_k=TOP_K, expert_ffn=FFN)), block(gpt_count(ffn=TOP_K * FFN))
    dense_mlp = 3 * H * TOP_K * FFN + 2 * TOP_K * FFN + H  # gate_up and down with their biases
    assert (moe.param_bytes - dense.param_bytes) // 2 == EXPERTS * 3 * H * FFN + H * EXPERTS - dense_mlp


def test_shared_experts_are_one_mlp_every_token_passes():
    plain = block(gpt_count(experts=EXPERTS, top_k=TOP_K, expert_ffn=FFN))
    shared = block(gpt_count(experts=EXPERTS, top_k=TOP_K, expert_ffn=FFN, shared_experts=2))
    assert shared.fwd_flops - plain.fwd_flops == TOKENS * 2 * MLP_FLOPS


def test_a_layer_records_its_experts_weights_and_the_token_copies_its_dispatch_sends():
    """What expert parallelism needs of the count: the routed experts' weights (which it shards) and the bytes of
    the k copies of each token the dispatch sends (padded to capacity where the model pads): bf16, 2 bytes."""
    counted = gpt_count(experts=EXPERTS, top_k=TOP_K, expert_ffn=FFN)
    assert [layer.expert_param_bytes for layer in counted.layers] == [0, EXPERTS * 3 * H * FFN * 2, 0]
    assert [layer.dispatched_bytes for layer in counted.layers] == [0, TOKENS * TOP_K * H * 2, 0]
    padded = block(gpt_count(experts=EXPERTS, top_k=TOP_K, expert_ffn=FFN, capacity_factor=2.0))
    assert padded.dispatched_bytes == 2 * TOKENS * TOP_K * H * 2
    assert block(gpt_count(ffn=FFN)).expert_param_bytes == 0


def test_the_routed_experts_own_ops_are_marked_forward_and_backward():
    """The experts' products, found by the weights and products they read: E batched products at k·T/E tokens,
    three a SwiGLU expert, in each pass; the router's product and the dispatch's gather are not the experts'."""
    layer = block(gpt_count(experts=EXPERTS, top_k=TOP_K, expert_ffn=FFN))
    for name in ("fwd", "igrad", "wgrad"):
        products = [op for op in layer.ops[name] if op.routed and op.kind == "matmul"]
        assert sum(op.flops * op.count for op in products) == TOKENS * TOP_K * MLP_FLOPS, name
        assert {op.shape[0] for op in products} == {EXPERTS}
    assert not any(op.routed for op in layer.ops["fwd"] if op.op in ("mm", "index_select", "index_put"))
    assert not any(op.routed for layer in gpt_count(ffn=FFN).layers for ops in layer.ops.values() for op in ops)


def _experts_kept(layer) -> list[tuple[int, str]]:
    """The routed experts' saved tensors (bytes, whether a product's input) of a counted block."""
    return [(nbytes, how) for (shape, nbytes), how, part in zip(layer.saved_tensors, layer.linear_input_saves,
                                                                layer.saved_parts)
            if part == "mlp" and shape[0] == EXPERTS]


def test_the_routed_experts_keep_what_megatron_cores_grouped_mlp_keeps():
    """Per micro-batch, of its k·T token copies (bf16, 2 bytes): the gathered inputs and the scaled activation,
    each kept by a grouped product as its input, the gate-up output and the router's weights; unfused, also the
    activation's silu and its product (kept for the weights' gradient). The down product's output is not kept: the
    weights scale the activation before it (TEGroupedMLP), and the scatter back keeps only its indices."""
    copies = TOKENS * TOP_K
    fused = block(gpt_count(experts=EXPERTS, top_k=TOP_K, expert_ffn=FFN))
    assert _experts_kept(fused) == [(copies * H * 2, "only"), (copies * 2 * FFN * 2, ""), (copies * 2, ""),
                                    (copies * FFN * 2, "only")]
    unfused = block(gpt_count(False, experts=EXPERTS, top_k=TOP_K, expert_ffn=FFN))
    assert _experts_kept(unfused) == [(copies * H * 2, "only"), (copies * 2 * FFN * 2, ""), (copies * FFN * 2, ""),
                                      (copies * 2, ""), (copies * FFN * 2, ""), (copies * FFN * 2, "only")]


def test_the_fused_swiglu_is_counted_as_the_one_kernel_it_is():
    """Fused, the activation and the weights' scaling are one memory-bound kernel reading its input (k·T x 2f) and
    the weights and writing its output (k·T x f), in the forward and where moe_act recomputes it; its backward reads
    the output's gradient beside them and writes theirs (Megatron-core's fused_bias_swiglu.py), where the ops it
    replaces each read and write their own. The FLOPs are the same."""
    copies = TOKENS * TOP_K
    fused = block(gpt_count(experts=EXPERTS, top_k=TOP_K, expert_ffn=FFN))
    unfused = block(gpt_count(False, experts=EXPERTS, top_k=TOP_K, expert_ffn=FFN))
    assert [fused.fwd_flops, fused.igrad_flops, fused.wgrad_flops] == [
        unfused.fwd_flops, unfused.igrad_flops, unfused.wgrad_flops]
    one_pass = copies * 2 * FFN * 2 + copies * 2 + copies * FFN * 2  # input, weights, output
    (kernel,) = [op for op in fused.ops["fwd"] if op.op == "fused_swiglu"]
    assert (kernel.moved_bytes, kernel.routed) == (one_pass, True)
    assert [(op.op, op.moved_bytes) for op in fused.region_ops["moe_act"]] == [("fused_swiglu", one_pass)]
    (backward,) = [op for op in fused.ops["igrad"] if op.op == "fused_swiglu_backward"]
    assert backward.moved_bytes == one_pass + copies * 2 * FFN * 2 + copies * 2  # the gradients of both inputs
    for name in ("fwd", "igrad"):
        assert getattr(fused, f"{name}_moved_bytes") < getattr(unfused, f"{name}_moved_bytes")
    assert fused.saved_bytes < unfused.saved_bytes


def test_no_swiglu_fusion_holds_the_activations_intermediates_until_the_backward():
    """One micro-batch's forward holds, unfused, the silu and its product beside what the fused kernel keeps:
    2 x k·T·f bf16 values more at the peak; the flag reads only the estimate, refused in one line without --gpu."""
    shape = ("--model", "gpt", "--layers", 1, "--width", H, "--heads", 4, "--seq-len", S, "--vocab", 100, "--gated",
             "--experts", EXPERTS, "--top-k", TOP_K, "--expert-ffn", FFN, "-b", B)
    run = ("--gpu", "h100-sxm", *shape, "-p", 1, "-m", 1, "-s", "1f1b")
    (fused,), (unfused,) = simulate_json(*run), simulate_json(*run, "--no-swiglu-fusion")
    held = [result["devices"][0]["peak_memory_parts_mb"]["activations"] * 2**20 for result in (fused, unfused)]
    assert held[1] - held[0] == pytest.approx(2 * TOKENS * TOP_K * FFN * 2)
    code, _, err = pipesim("simulate", "-s", "1f1b", "-p", 2, "-m", 2, "--no-swiglu-fusion")
    assert code == 2 and len(err.strip().splitlines()) == 1 and "only --gpu's estimate reads it" in err


def test_under_te_the_grouped_products_keep_their_inputs_in_float8():
    """TransformerEngine's GroupedLinear keeps its inputs' float8 copies (1 byte) for the weight gradient."""
    from pipesim.planning.fp8 import FP8_RECIPES, in_float8

    layer = block(gpt_count(False, experts=EXPERTS, top_k=TOP_K, expert_ffn=FFN))
    copies = TOKENS * TOP_K
    float8 = in_float8(layer, FP8_RECIPES["te"], 2)
    routed = [nbytes for (shape, nbytes), how, part in zip(float8.saved_tensors, layer.linear_input_saves,
                                                            layer.saved_parts) if part == "mlp" and shape[0] == EXPERTS
              and how == "only"]
    assert routed == [copies * H, copies * FFN]


def test_a_capacity_factor_pads_every_expert_to_its_capacity():
    """c = 2: each expert computes 2·k·T/E tokens, twice the routed experts' products of the dropless count."""
    dropless = block(gpt_count(experts=EXPERTS, top_k=TOP_K, expert_ffn=FFN))
    padded = block(gpt_count(experts=EXPERTS, top_k=TOP_K, expert_ffn=FFN, capacity_factor=2.0))
    assert padded.fwd_flops - dropless.fwd_flops == TOKENS * TOP_K * MLP_FLOPS


def test_the_padding_to_capacity_is_work_not_model_flops():
    """The model's FLOPs count each token's k experts whatever the capacity (Megatron-LM's
    num_floating_point_operations): the padded count computes twice the routed products, the model the same."""
    dropless = block(gpt_count(experts=EXPERTS, top_k=TOP_K, expert_ffn=FFN))
    padded = block(gpt_count(experts=EXPERTS, top_k=TOP_K, expert_ffn=FFN, capacity_factor=2.0))
    assert padded.routed_model_share == 0.5 and dropless.routed_model_share == 1.0
    assert padded.model_flops == dropless.model_flops == dropless.fwd_flops + dropless.igrad_flops \
        + dropless.wgrad_flops < padded.fwd_flops + padded.igrad_flops + padded.wgrad_flops


def test_mfu_counts_the_same_model_flops_at_every_capacity_factor():
    """MFU × step time is the model's FLOPs per step (over the peak): the same at C = 1, 2 and 4, where the step
    (which computes the padding) grows, the host free (at eager PyTorch's 31.9 us a kernel this small model's passes
    are their issue whatever the padding: planning/host.py)."""
    results = [simulate_json("--gpu", "a100-sxm-80gb", "--model", "gpt", "--layers", 1, "--width", H, "--heads", 4,
                             "--seq-len", S, "--vocab", 100, "--experts", EXPERTS, "--capacity-factor", c, "-p", 1,
                             "-m", 2, "-s", "1f1b", "--host-kernel-us", 0)[0] for c in (1, 2, 4)]
    steps = [result["time_per_minibatch_ms"] for result in results]
    assert steps[0] < steps[1] < steps[2]
    model_flops = [result["mfu"] * step for result, step in zip(results, steps)]
    assert model_flops[1] == pytest.approx(model_flops[0]) and model_flops[2] == pytest.approx(model_flops[0])


def test_off_the_meta_device_the_router_routes_each_token_to_its_own_experts():
    """The executor's path: each token's output is the weighted sum of its k experts' MLPs, computed one by one."""
    gen = torch.Generator().manual_seed(0)
    hidden, up, down = (torch.randn(*shape, generator=gen) for shape in ((6, 4), (3, 4, 5), (3, 5, 4)))
    index = torch.tensor([[0, 1], [2, 0], [1, 2], [0, 2], [1, 0], [2, 1]])
    weights = torch.rand(6, 2, generator=gen)
    out = routed_experts(hidden, index, weights, up, down, torch.relu)
    expected = torch.stack([sum(weights[t, j] * torch.relu(hidden[t] @ up[e]) @ down[e]
                                for j, e in enumerate(index[t].tolist())) for t in range(6)])
    torch.testing.assert_close(out, expected)
    # a capacity of 0.5 · 2 · 6 / 3 = 2 tokens an expert, kept in token order: expert 0 (tokens 0, 1, 3, 4) and
    # expert 2 (tokens 1, 2, 3, 5) both drop token 3, which keeps nothing; token 0's experts 0 and 1 keep it
    dropped = routed_experts(hidden, index, weights, up, down, torch.relu, capacity_factor=0.5)
    torch.testing.assert_close(dropped[3], torch.zeros(4))
    torch.testing.assert_close(dropped[0], expected[0])


def test_a_moe_gpt_trains_off_the_meta_device():
    from pipesim.workload.models import build_model

    model = build_model("gpt", **GPT, experts=4, top_k=2, shared_experts=1, expert_ffn=16)
    batch, target = model.make_batch(2, torch.Generator().manual_seed(0))
    model.loss(model.forward(batch), target).backward()
    experts = model.layers[1].mlp
    assert experts.up.grad.abs().sum() > 0 and experts.router.weight.grad.abs().sum() > 0


@pytest.mark.parametrize("args, fragment", [
    (("--top-k", 2), "--top-k applies to a mixture of experts: give --experts too"),
    (("--experts", 4, "--top-k", 5), "--top-k: give at most --experts 4 (got 5)"),
    (("--experts", 0), "--experts: give a whole number from 1 to 16,384 (got 0)"),
    # not the --expert-ffn it defaults from
    (("--experts", 4, "--width", 0), "--width: give a whole number from 1 to 1,048,576 (got 0)"),
    (("--experts", 4, "--ffn", 0), "--ffn: give a whole number from 1 to 4,194,304 (got 0)"),
    (("--experts", 4, "--capacity-factor", 0), "--capacity-factor: give a finite number above 0 (got 0)"),
    (("--experts", 4, "--capacity-factor", "inf"), "--capacity-factor: give a finite number above 0 (got inf)"),
    (("--experts", 8, "--top-k", 2, "--capacity-factor", 4.5),
     "--capacity-factor 4.5 pads each expert past the micro-batch's tokens (C·k/E = 4.5·2/8 > 1), which "
     "Megatron-core cannot run: give at most E/k = 4"),
    (("--experts", 4, "--shared-experts", -1), "--shared-experts: give a whole number from 0 to 16,384 (got -1)"),
])
def test_a_bad_mixture_of_experts_is_one_line(args, fragment):
    code, out, err = pipesim("count", "--model", "gpt", *args)
    assert code == 2 and out == "" and fragment in err and len(err.strip().splitlines()) == 1, err


@needs_transformers
def test_a_mixtral_config_does_a_llamas_products_with_a_k_times_wider_mlp_plus_the_router(tmp_path):
    """transformers runs Mixtral's experts as grouped products, which torch's FLOP counter counts as nothing;
    pipesim runs them as one product per expert at its expected share, so the count is Llama's of MLP k·f."""
    mixtral, llama = (count_config(tmp_path / name, fields)
                      for name, fields in (("mixtral", MIXTRAL), ("llama", LLAMA)))
    moe, dense = mixtral.layers[1], llama.layers[1]
    assert (moe.fwd_flops - dense.fwd_flops, moe.igrad_flops - dense.igrad_flops,
            moe.wgrad_flops - dense.wgrad_flops) == (ROUTER_FLOPS,) * 3
    assert (moe.param_bytes - dense.param_bytes) // 2 == (EXPERTS - TOP_K) * 3 * H * FFN + H * EXPERTS
    assert mixtral.options["experts"] == EXPERTS and mixtral.options["top_k"] == TOP_K


@needs_transformers
def test_a_qwen3_moe_config_of_no_experts_is_counted_as_the_dense_qwen3_transformers_builds(tmp_path):
    """transformers builds Qwen3-MoE's layer with a dense MLP of intermediate_size where num_experts is 0
    (modeling_qwen3_moe.py's `config.num_experts > 0`): the same products and weights as Qwen3's."""
    moe, dense = (count_config(tmp_path / name, fields)
                  for name, fields in (("moe", {**QWEN3_MOE, "num_experts": 0}), ("dense", QWEN3)))
    assert [(layer.fwd_flops, layer.igrad_flops, layer.wgrad_flops, layer.param_bytes) for layer in moe.layers] == \
        [(layer.fwd_flops, layer.igrad_flops, layer.wgrad_flops, layer.param_bytes) for layer in dense.layers]
    assert moe.options == dense.options and "experts" not in moe.options


@needs_transformers
def test_no_experts_where_transformers_builds_a_mixture_of_none_is_one_line(tmp_path):
    """Mixtral's layer is a mixture whatever num_local_experts is: at 0 its router's top-k of none was torch's
    "k not in range" deep in the count."""
    folder = write_config(tmp_path / "mixtral", {**MIXTRAL, "num_local_experts": 0})
    code, out, err = pipesim("count", "--model", f"hf:{folder}", "--seq-len", S)
    assert code == 2 and out == "" and len(err.strip().splitlines()) == 1, err
    assert (f"--model hf:{folder}: {folder}/config.json gives num_local_experts 0, which transformers' "
            "MixtralForCausalLM builds as a mixture of no experts (model.layers.0.mlp.") in err, err


QWEN2_MOE = {**LLAMA, "model_type": "qwen2_moe", "num_experts_per_tok": TOP_K, "moe_intermediate_size": FFN,
             "shared_expert_intermediate_size": FFN}


def _figures(counted: WorkloadCount) -> tuple:
    return counted.options, [(layer.fwd_flops, layer.igrad_flops, layer.wgrad_flops, layer.param_bytes)
                             for layer in counted.layers]


@needs_transformers
@pytest.mark.parametrize("fields, read", [
    # the class's field and an alias of it: transformers keeps the one the class does not declare, which it sets
    # after those it does (Mixtral declares num_local_experts; Qwen3-MoE declares num_experts, stored as
    # num_local_experts)
    ({**MIXTRAL, "num_experts": 4}, {**MIXTRAL, "num_local_experts": 4}),
    ({**QWEN3_MOE, "num_local_experts": 4, "num_experts": EXPERTS}, {**QWEN3_MOE, "num_experts": 4}),
    ({**QWEN3_MOE, "num_local_experts": 0, "num_experts": 4}, QWEN3),  # a dense MLP, as transformers builds
    # a field the class neither has nor maps is none of its model's: Qwen2-MoE's modeling file reads num_experts
    ({**QWEN2_MOE, "num_local_experts": EXPERTS, "num_experts": 4}, {**QWEN2_MOE, "num_experts": 4}),
])
def test_a_config_of_two_experts_fields_is_counted_by_the_one_transformers_reads(tmp_path, fields, read):
    """The model a config of two of the fields describes is the one of the field transformers reads: counted as
    that config alone (Qwen2-MoE's num_local_experts was read first: 8 experts priced where 4 were built)."""
    both, one = (count_config(tmp_path / name, config)
                 for name, config in (("both", fields), ("one", read)))
    assert _figures(both) == _figures(one)


@needs_transformers
def test_no_experts_by_an_alias_are_refused_naming_it(tmp_path):
    """Mixtral's num_experts, its alias of num_local_experts, is the field transformers keeps of the two."""
    folder = write_config(tmp_path / "mixtral", {**MIXTRAL, "num_experts": 0})
    code, out, err = pipesim("count", "--model", f"hf:{folder}", "--seq-len", S)
    assert code == 2 and out == "" and len(err.strip().splitlines()) == 1, err
    assert f"{folder}/config.json gives num_experts 0, which transformers' MixtralForCausalLM builds" in err, err


DEEPSEEK_MOE_LAYERS, DEEPSEEK_ROUTED, DEEPSEEK_TOP_K = 61 - 3, 256, 8
DEEPSEEK_EXPERT = 3 * 7168 * 2048  # one routed expert's weights


@needs_transformers
def test_deepseek_v3_has_its_published_total_and_activated_parameters():
    """DeepSeek-V3's model card: 671B parameters, 37B activated per token; its README_WEIGHTS.md: the main model
    (without the multi-token-prediction module, which transformers does not build) 671B, 36.6B activated
    including the 0.9B output head, not the input embedding, which a token reads one row of. Activated is the
    total less the routed experts a token does not go to, 248 of 256 in each of the 58 MoE layers."""
    counted = count_built(f"hf:{ROOT / 'examples' / 'deepseek-v3'}", {"seq_len": 64}, 1, torch.bfloat16)
    total = sum(layer.param_bytes for layer in counted.layers) // 2
    idle = DEEPSEEK_MOE_LAYERS * (DEEPSEEK_ROUTED - DEEPSEEK_TOP_K) * DEEPSEEK_EXPERT
    embedding = counted.layers[0].param_bytes // 2
    assert round(total / 1e9) == 671
    activated = total - idle - embedding
    assert round(activated / 1e8) == 366 and round(activated / 1e9) == 37
    experts = [layer.expert_param_bytes // 2 for layer in counted.layers[1:-2]]
    assert experts == [0] * 3 + [DEEPSEEK_ROUTED * DEEPSEEK_EXPERT] * DEEPSEEK_MOE_LAYERS  # the first 3 dense


@needs_transformers
@pytest.mark.parametrize("example, billions", [("mixtral-8x7b", 46.7), ("mixtral-8x22b", 140.6),
                                               ("qwen3-30b-a3b", 30.5)])
def test_the_moe_examples_have_their_published_parameter_counts(example, billions):
    """Mixtral of Experts (arXiv 2401.04088): 47B parameters (46.7B on its model card); Mixtral 8x22B's card: 141B
    (140.6B counted); Qwen3-30B-A3B's model card: 30.5B in total."""
    counted = count_built(f"hf:{ROOT / 'examples' / example}", {"seq_len": 64}, 1, torch.bfloat16)
    assert round(sum(layer.param_bytes for layer in counted.layers) / 2e9, 1) == billions


@needs_transformers
def test_a_gpt_oss_config_does_a_mixtrals_products_and_holds_its_biases_and_sinks(tmp_path):
    """gpt-oss's experts, with their biases and clamped SwiGLU, do Mixtral's products (a bias adds no FLOPs); its
    extra weights are the biases (q, k, v and o; the router's; each expert's gate/up and down, which expert
    parallelism shards with the experts) and one sink a head."""
    oss, mixtral = (count_config(tmp_path / name, fields)
                    for name, fields in (("oss", GPT_OSS), ("mixtral", MIXTRAL)))
    moe, plain = oss.layers[1], mixtral.layers[1]
    assert (moe.fwd_flops, moe.igrad_flops, moe.wgrad_flops) == (plain.fwd_flops, plain.igrad_flops,
                                                                 plain.wgrad_flops)
    heads, kv_heads, head = 4, 2, H // 4
    attention_biases = 2 * heads * head + 2 * kv_heads * head
    expert_biases = EXPERTS * (2 * FFN + H)
    assert (moe.param_bytes - plain.param_bytes) // 2 == attention_biases + EXPERTS + expert_biases + heads
    assert (moe.expert_param_bytes - plain.expert_param_bytes) // 2 == expert_biases
    # the router's product with its bias is a gating product; the up product adds its bias itself; the down
    # product's, times the router's weights, is added to each expert's outputs, which are then joined
    assert any(op.gating and op.kind == "matmul" for op in moe.ops["fwd"])
    each = expected_tokens(TOKENS, TOP_K, EXPERTS)
    assert [op.op for op in moe.ops["fwd"] if op.routed and op.kind == "matmul"] == ["baddbmm", "bmm"]
    assert [op.op for op in moe.ops["fwd"] if op.routed and op.shape in ((EXPERTS, each, H), (EXPERTS * each, H))
            ] == ["mul", "add", "cat"]


@needs_transformers
def test_a_gpt_oss_up_product_with_its_bias_is_recorded_as_a_mixtrals(tmp_path):
    """gpt-oss's up product adds its bias itself (baddbmm, TransformerEngine's GroupedLinear): it is the routed
    experts' grouped product with weights as Mixtral's bmm is, so the count records the same products for their
    weight gradients, the up one with its bias's bytes, and the layer's unfused weights (accumulated in a pass of their
    own) are its weights outside those products, Mixtral's plus gpt-oss's extra ones."""
    oss, mixtral = (count_config(tmp_path / name, fields).layers[1]
                    for name, fields in (("oss", GPT_OSS), ("mixtral", MIXTRAL)))
    assert (oss.weight_grad_outputs, oss.weight_grad_routed) == (mixtral.weight_grad_outputs,
                                                                mixtral.weight_grad_routed)
    assert sum(oss.weight_grad_routed) == 2
    up = oss.weight_grad_routed.index(True)
    assert oss.weight_grad_bias_bytes[up] == EXPERTS * 2 * FFN * 2
    unfused = [layer.param_bytes * unfused_weight_share(layer, 2) for layer in (oss, mixtral)]
    assert round(unfused[0] - unfused[1]) == oss.param_bytes - mixtral.param_bytes


@needs_transformers
def test_a_sliding_window_layers_flash_kernels_carry_its_window_forward_and_backward(tmp_path):
    """gpt-oss's "sliding_attention" layers (and a Mistral's sliding_window) attend each query to its last w keys:
    the fused kernels, forward and backward, are recorded with w; a "full_attention" layer's with none."""
    fields = {**GPT_OSS, "num_hidden_layers": 2, "layer_types": ["sliding_attention", "full_attention"]}
    counted = count_config(tmp_path / "oss", fields, "flash")
    windows = [[(op.op, op.window) for name in ("fwd", "bwd", "igrad") for op in layer.ops[name]
                if op.kind == "attention"] for layer in counted.layers[1:3]]
    kernels = ["_scaled_dot_product_flash_attention"] + ["_scaled_dot_product_flash_attention_backward"] * 2
    assert windows == [list(zip(kernels, (8, 8, 8))), list(zip(kernels, (0, 0, 0)))]
    mistral = {**LLAMA, "model_type": "mistral", "sliding_window": 8}
    counted = count_config(tmp_path / "mistral", mistral, "flash")
    assert {op.window for name in ("fwd", "bwd") for op in counted.layers[1].ops[name] if op.kind == "attention"} == {8}


@needs_transformers
@pytest.mark.parametrize("example, layers, experts, published", [("gpt-oss-120b", 36, 128, (11683, 513)),
                                                                  ("gpt-oss-20b", 24, 32, (2091, 361))])
def test_gpt_oss_has_its_published_total_and_active_parameters(example, layers, experts, published):
    """gpt-oss's model card (OpenAI, arXiv 2508.10925, Table 1): gpt-oss-120b 116.83B parameters, 5.13B active per
    token, gpt-oss-20b 20.91B and 3.61B: the total less the experts a token does not go to (all but 4) in each
    layer and the input embedding."""
    counted = count_built(f"hf:{ROOT / 'examples' / example}", {"seq_len": 64}, 1, torch.bfloat16)
    total = sum(layer.param_bytes for layer in counted.layers) // 2
    expert = sum(layer.expert_param_bytes for layer in counted.layers) // 2 // (layers * experts)
    active = total - layers * (experts - 4) * expert - counted.layers[0].param_bytes // 2
    assert (round(total / 1e7), round(active / 1e7)) == published


@needs_transformers
def test_kimi_k2_has_its_published_total_and_activated_parameters():
    """Kimi K2's model card (moonshotai/Kimi-K2-Base): 1T parameters, 32B activated, 61 layers of which 1 dense,
    384 experts of 2,048 and 1 shared, top 8. Counted from its config: 1,026.4B, and 31.7B activated (the total less
    the 376 routed experts a token does not go to in each of the 60 MoE layers and the input embedding)."""
    counted = count_built(f"hf:{ROOT / 'examples' / 'kimi-k2'}", {"seq_len": 64}, 1, torch.bfloat16)
    total = sum(layer.param_bytes for layer in counted.layers) // 2
    expert = 3 * 7168 * 2048
    assert [layer.expert_param_bytes // 2 for layer in counted.layers[1:-2]] == [0] + [384 * expert] * 60
    activated = total - 60 * (384 - 8) * expert - counted.layers[0].param_bytes // 2
    assert (round(total / 1e12), round(activated / 1e9)) == (1, 32)
    assert (round(total / 1e8), round(activated / 1e8)) == (10264, 317)


@needs_transformers
def test_mla_under_flash_pads_the_values_to_the_queries_head_size():
    """torch's flash kernel takes one head size: MLA's values (16) are padded to the queries' and keys' (16 + 8),
    so both of its products run at 24 (4·b·heads·s²·24 FLOPs, every score counted as torch counts them)."""
    counted = tiny_deepseek_count()
    attention = [op for op in counted.layers[2].ops["fwd"] if op.kind == "attention"]
    assert [(op.shape, op.flops) for op in attention] == [((B * 2, S, S, 24), 4 * B * 2 * S * S * 24)]
    assert counted.layers[1].expert_param_bytes == 0 and counted.layers[2].expert_param_bytes > 0


@needs_transformers
@pytest.mark.parametrize("runtime, sequence_parallel, down", [
    ("megatron", False, {(1, TOKENS, H, 12): 2.0}), ("megatron", True, {(1, TOKENS, H, 12): 2.0}),
    ("torch", True, {(1, TOKENS, H, 48): 1.0})])
def test_mlas_down_projections_reduce_their_input_gradients_as_the_runtime_splits_them(runtime, sequence_parallel,
                                                                                      down):
    """t = 2: MLA's q and kv down-projections (24 outputs each) reduce their input gradients each under Megatron-core,
    a TEColumnParallelLinear each whose output the norm and the up-projection read (planning/estimate.py
    `_input_groups`), two reductions over their 12 features a rank; under torch's (with sequence parallelism, as
    --tp-runtime takes it), NoParallel in torchtitan's plan (`_weight_splits`' "latent"), none: each rank computes
    them whole on every token, their input gradient whole, and they carry once (`_Reduction.collective`, over their
    48 features) the one all-gather the attention output's gradient takes; the shared expert's gate and up (32 each)
    once under both, as Megatron-core's fused linear_fc1 and DTensor's summed Partial gradients reduce them; the
    router, replicated, none (tests/test_router_tensor_parallel.py)."""
    from pipesim.planning.estimate import Parallelism, _Split

    layer = tiny_deepseek_count().layers[2]
    split = _Split.of(layer, Parallelism(tensor=2, tp_runtime=runtime, sequence_parallel=sequence_parallel))
    igrad = [op for op in layer.ops["igrad"] if op.kind == "matmul"]
    reduced = reductions(split, igrad, "igrad")
    # the attention's or the MLP's input, 64 wide
    assert {shape: n for shape, n in reduced.items() if shape[2] == H} == {**down, (1, TOKENS, H, 32): 1.0}
    gathered = {reduction.op.shape for op in igrad for _, reduction, _ in split.products(op, "igrad")
                if reduction is not None and reduction.collective == "gather"}
    assert gathered == ({(1, TOKENS, H, 48)} if runtime == "torch" and sequence_parallel else set())
    latent = [j for j, how in split.weights.items() if how == "latent"]
    assert latent == ([0, 2] if runtime == "torch" else [])  # q_a_proj, kv_a_proj_with_mqa (24 outputs each)
    # the up-projections' (q_b_proj: 24 to 48 features, 24 a rank; kv_b_proj: 16 to 64, 32 a rank) input gradients:
    # under torch a Partial of the whole latent, all-reduced (DTensor's Partial to Replicate), not reduce-scattered
    up = {reduction.op.shape: reduction.collective for op in igrad for _, reduction, _ in split.products(op, "igrad")
          if reduction is not None and reduction.op.shape[2] in (24, 16)}
    collective = "all-reduce" if runtime == "torch" else "reduce"
    assert up == {(1, TOKENS, 24, 24): collective, (1, TOKENS, 16, 32): collective}
    assert split.latent_readers == ({1, 3} if runtime == "torch" else set())


@needs_transformers
def test_without_a_q_down_projection_torchs_latent_kv_one_leaves_the_gather_to_the_column_parallel_q(tmp_path):
    """q_lora_rank null (DeepSeek-V2-Lite's, torchtitan's 16B flavour): wq is ColwiseParallel beside the NoParallel
    wkv_a on the attention's input, so the one reduce-scatter of that input's gradient (DTensor sums the Partial and
    the Replicate parts into a Partial) and the attention output's gather are wq's reduction (48 features, 24 a
    rank), not a second gather of wkv_a's; under Megatron-core wkv_a reduces its own (24 features, 12 a rank)."""
    from pipesim.planning.estimate import Parallelism, _Split

    layer = count_config(tmp_path / "q-less", {**TINY_DEEPSEEK, "q_lora_rank": None}).layers[2]
    igrad = [op for op in layer.ops["igrad"] if op.kind == "matmul"]
    for runtime, attention in (("megatron", {(1, TOKENS, H, 24): 1.0, (1, TOKENS, H, 12): 1.0}),
                               ("torch", {(1, TOKENS, H, 24): 1.0})):
        split = _Split.of(layer, Parallelism(tensor=2, tp_runtime=runtime, sequence_parallel=True))
        reduced = reductions(split, igrad, "igrad")
        assert {shape: n for shape, n in reduced.items() if shape[2] == H and shape[3] != 32} == attention, runtime
        assert "gather" not in {reduction.collective for op in igrad
                                for _, reduction, _ in split.products(op, "igrad") if reduction is not None}


@needs_transformers
def test_torchs_latent_down_projections_run_whole_on_every_rank_and_hold_their_weights_whole():
    """Under torch's runtime at t = 2 MLA's down-projections are NoParallel (torchtitan's plan): their forward
    products run whole (64 tokens x 24 outputs x 64 inputs), not Megatron-core's 12 outputs a rank, and the rank holds
    their weights whole: t - 1 more of their 2 x 24 x 64 elements than Megatron-core's rank, its norms and router
    alike under both (`replicated_share`)."""
    from pipesim.planning.estimate import Parallelism, _Split, replicated_share

    layer = tiny_deepseek_count().layers[2]
    (down,) = [op for op in layer.ops["fwd"] if op.kind == "matmul" and op.shape == (1, TOKENS, 24, H)]
    assert down.count == 2  # the two, counted as one op of their shape
    for runtime, outputs in (("megatron", 12), ("torch", 24)):
        split = _Split.of(layer, Parallelism(tensor=2, tp_runtime=runtime, sequence_parallel=True))
        assert [mine.shape for mine, _, _ in split.products(down, "fwd")] == [(1, TOKENS, outputs, H)]
    element = 2
    extra = (replicated_share(layer, element, "torch") - replicated_share(layer, element, "megatron"))
    assert round(extra * layer.param_bytes) == 2 * 24 * H * element


@needs_transformers
def test_torchs_backward_gathers_the_attention_outputs_gradient_and_scatters_no_latent_input_gradient(monkeypatch):
    """The MoE layer under torch's sequence parallelism at t = 2, its tokens x width collectives as priced (each
    once for the products of one shape, the attention's and the MoE block's output projections alike): the forward's
    reduce-scatter and all-gather; in each backward pricing (the backward whole and its input-gradient pass) the MoE
    block's pair (the shared expert's input-gradient reduction) and the attention output's gradient gathered
    (DTensor's Shard(1) to Replicate), priced with the latent down-projections (`_Reduction.collective`), whose
    input gradient, whole on every rank, no collective scatters: 5 all-gathers, 3 reduce-scatters, where pricing
    them column-parallel gave 5 of each."""
    import pipesim.planning.estimate as estimate
    from tests.helpers import H100_BF16

    moved: dict[str, list[int]] = {"all_gather_ms": [], "reduce_scatter_ms": []}
    for name, calls in moved.items():
        real = getattr(estimate, name)
        monkeypatch.setattr(estimate, name, lambda nbytes, *args, calls=calls, real=real:
                            calls.append(nbytes) or real(nbytes, *args))
    link = estimate.EstimateLink(kind="nvlink", latency_ms=0.0, bytes_per_ms=1e9)
    estimate.estimate_layer(tiny_deepseek_count().layers[2], H100_BF16,
                            estimate.Parallelism(tensor=2, tp_runtime="torch", sequence_parallel=True), link, 2)
    assert {name: calls.count(TOKENS * H * 2) for name, calls in moved.items()} == {"all_gather_ms": 5,
                                                                                  "reduce_scatter_ms": 3}


@needs_transformers
def test_torch_saves_the_latent_norms_tensors_whole_and_megatron_its_share():
    """Under torch's runtime the latent (the down-projections' outputs and what the q and kv norms make of them) is
    whole on every rank, so what those norms save is too (`_latent_saves`): each norm's float32 copy, its statistics
    and its 16-bit copy, and the up-projection's input; not the attention norm's statistics of the same size, saved
    before them. Megatron-core scatters the latent back to the tokens' shards: none. The layer's activation memory
    on a rank grows by (t - 1)/t of them."""
    from pipesim.planning.estimate import EstimateLink, Parallelism, _latent_saves, _Split, estimate_layer
    from tests.helpers import H100_BF16

    layer = tiny_deepseek_count().layers[2]
    saved = layer.saved_tensors
    torch_split = _Split.of(layer, Parallelism(tensor=2, tp_runtime="torch", sequence_parallel=True))
    whole = sorted(_latent_saves(layer, torch_split))
    q, kv = (B, S, 24), (B, S, 16)
    assert [saved[i] for i in whole] == [
        (q, B * S * 24 * 4), ((B, S, 1), B * S * 4), (q, B * S * 24 * 2), ((B * S, 24), B * S * 24 * 2),
        (kv, B * S * 16 * 4), ((B, S, 1), B * S * 4), (kv, B * S * 16 * 2), ((B * S, 16), B * S * 16 * 2)]
    assert _latent_saves(layer, _Split.of(layer, Parallelism(tensor=2, sequence_parallel=True))) == set()
    link = EstimateLink(kind="nvlink", latency_ms=0.0, bytes_per_ms=1e9)
    kept = {runtime: estimate_layer(layer, H100_BF16, Parallelism(tensor=2, tp_runtime=runtime,
                                                                  sequence_parallel=True), link, 2).activation_bytes
            for runtime in ("megatron", "torch")}
    up_inputs = saved[whole[3]][1] + saved[whole[7]][1]  # whole under torch's sequence parallelism already
    assert kept["torch"] - kept["megatron"] >= (sum(saved[i][1] for i in whole) - up_inputs) / 2


@needs_transformers
def test_torchs_up_projections_make_their_latent_input_gradients_whole():
    """The input gradients of q_b_proj (64 tokens x 24) and kv_b_proj (x 16), bf16, as a rank allocates them in the
    backward (`_rank_pass`): under torch's runtime Partials of the whole latent before their all-reduce, whole; under
    Megatron-core's, whose latent is the tokens' shards again, 1/t."""
    from pipesim.planning.estimate import Parallelism, _rank_pass, _Split
    from pipesim.profiles.workload import weighted_products

    layer = tiny_deepseek_count().layers[2]
    for runtime, t_share in (("megatron", 2), ("torch", 1)):
        split = _Split.of(layer, Parallelism(tensor=2, tp_runtime=runtime, sequence_parallel=True))
        roles = weighted_products(layer, split.weights, "igrad")
        inputs = {number for number, (j, _, role) in roles.items() if j in (1, 3) and role == "input"}
        made = [nbytes for number, nbytes in _rank_pass(layer, split, "igrad", 2) if number in inputs and nbytes > 0]
        assert sorted(made) == [TOKENS * 16 * 2 // t_share, TOKENS * 24 * 2 // t_share], runtime


@needs_transformers
def test_torchs_rank_holds_its_latent_down_projections_float8_weights_whole():
    """torchao's float8 linears on one of t = 2 ranks (`float8_weights_on_rank`, which the saved float8 weight copies,
    FSDP2's float8 shards and its float8 all-gather read): under Megatron-core's split 1/t of every weight; under
    torch's, MLA's q and kv down-projections (24 x 64 each) whole."""
    from pipesim.planning.estimate import Parallelism, float8_weights_on_rank
    from pipesim.planning.fp8 import FP8_RECIPES, float8_weights

    layer = tiny_deepseek_count().layers[2]
    elements, tensors = float8_weights(layer, FP8_RECIPES["torchao"])
    on_rank = {runtime: float8_weights_on_rank(layer, Parallelism(tensor=2, tp_runtime=runtime, sequence_parallel=True,
                                                                  fp8="torchao"))
               for runtime in ("megatron", "torch")}
    assert on_rank["megatron"] == (elements / 2, tensors)
    assert on_rank["torch"] == (elements / 2 + 2 * 24 * H / 2, tensors)


@needs_transformers
def test_without_a_q_down_projection_torchs_rank_holds_the_kv_one_whole_in_float8_as_in_bf16(tmp_path):
    """q_lora_rank null: wkv_a (24 x 64), NoParallel beside the column-parallel wq, is whole on the rank in its float8
    copy (`float8_weights_on_rank`) as in its 16-bit weight (`replicated_share`): t - 1 more of its elements than
    Megatron-core's rank holds, in both."""
    from pipesim.planning.estimate import Parallelism, float8_weights_on_rank, replicated_share
    from pipesim.planning.fp8 import FP8_RECIPES, float8_weights

    layer = count_config(tmp_path / "q-less", {**TINY_DEEPSEEK, "q_lora_rank": None}).layers[2]
    elements, _ = float8_weights(layer, FP8_RECIPES["torchao"])
    on_rank = {runtime: float8_weights_on_rank(layer, Parallelism(tensor=2, tp_runtime=runtime, sequence_parallel=True,
                                                                  fp8="torchao"))[0]
               for runtime in ("megatron", "torch")}
    assert on_rank == {"megatron": elements / 2, "torch": elements / 2 + 24 * H / 2}
    assert round((replicated_share(layer, 2, "torch") - replicated_share(layer, 2, "megatron"))
                 * layer.param_bytes) == 24 * H * 2


@needs_transformers
def test_torchs_whole_kv_down_projection_takes_float8_where_megatrons_split_one_is_refused(tmp_path):
    """--fp8-recipe torchao at t = 4 on an MLA whose kv down-projection writes 32 features (16 latent, 16 rotary):
    Megatron-core's column split leaves 8 a rank, which torch._scaled_mm refuses (multiples of 16); torch's runtime
    keeps it whole (NoParallel), 32, and the estimate is made."""
    config = write_config(tmp_path / "mla", {**TINY_DEEPSEEK, "kv_lora_rank": 16, "qk_rope_head_dim": 16,
                                            "q_lora_rank": 32, "num_attention_heads": 4, "num_key_value_heads": 4,
                                            "moe_intermediate_size": 64})
    for runtime in ("megatron", "torch"):
        out = tmp_path / f"{runtime}.json"
        code, _, err = pipesim("estimate", "--gpu", "h100-sxm", "--model", f"hf:{config}", "--seq-len", S, "-b", B,
                               "--dtype", "fp8", "--fp8-recipe", "torchao", "--tensor-parallel", 4,
                               "--sequence-parallel", "--tp-runtime", runtime, "--out", out)
        if runtime == "megatron":
            assert code == 2 and "has a product of 64 to 8 features on 64 rows a rank" in err and not out.exists()
        else:
            assert code == 0 and out.exists(), err


def capacity_counts(tmp_path, fields: dict, *factors: float | None, **options) -> list[WorkloadCount]:
    """The config `fields` counted dropless (None) and at each capacity factor."""
    spec = f"hf:{write_config(tmp_path / fields['model_type'], fields)}"
    given = {"seq_len": S, **options}
    return [count_built(spec, given if c is None else {**given, "capacity_factor": c}, B, torch.bfloat16)
            for c in factors]


@needs_transformers
def test_a_hugging_face_moe_at_a_capacity_factor_pads_every_expert_and_its_dispatch_to_its_capacity(tmp_path):
    """Megatron-core's moe_pad_expert_input_to_capacity (workload/hf.py): each expert computes ⌈C·k·T/E⌉ tokens
    (C = 1: its balanced share, as the dropless count; C = 2 and 3: twice and three times), the dispatch sends
    and the combine returns E of those buffers, and what the layer keeps grows with them: every figure of the MoE
    layer steps by the same amount from C = 1 to 2 as from 2 to 3, the routed products' FLOPs by k·T per step."""
    dropless, one, two, three = capacity_counts(tmp_path, MIXTRAL, None, 1.0, 2.0, 3.0)
    assert one.layers == dropless.layers
    assert one.options["capacity_factor"] == 1.0 and "capacity_factor" not in dropless.options
    moe = [counted.layers[1] for counted in (one, two, three)]
    assert [layer.dispatched_bytes for layer in moe] == [c * TOKENS * TOP_K * H * 2 for c in (1, 2, 3)]
    assert moe[1].fwd_flops - moe[0].fwd_flops == TOKENS * TOP_K * MLP_FLOPS
    for name in ("fwd_flops", "igrad_flops", "wgrad_flops", "fwd_moved_bytes", "saved_bytes"):
        step = getattr(moe[1], name) - getattr(moe[0], name)
        assert step > 0 and getattr(moe[2], name) - getattr(moe[1], name) == step, name
    assert moe[1].param_bytes == moe[0].param_bytes  # every expert's weights, however many tokens each computes


@needs_transformers
def test_a_capacity_factor_pads_the_multi_token_prediction_modules_experts_too(tmp_path):
    """DeepSeek-V3's multi-token-prediction module runs one more MoE layer: its experts drop as the model's do."""
    dropless, padded = capacity_counts(tmp_path, TINY_DEEPSEEK, None, 2.0, mtp_layers=1)
    routed = [layer.dispatched_bytes for layer in dropless.layers]
    assert routed[2] > 0 and routed[-2] > 0  # the one MoE decoder layer and the prediction module
    assert [layer.dispatched_bytes for layer in padded.layers] == [2 * n for n in routed]


HF_ESTIMATE = ("estimate", "--seq-len", S, "--gpu", "h100-sxm")


@needs_transformers
def test_a_hugging_face_moe_padded_to_its_capacity_never_waits_for_the_host(tmp_path):
    """planning/host.py: a dropless MoE layer synchronises with the host, so at 1 ms a kernel its passes are the
    host's; padded to its capacity the sizes are known on the host and the layer is the GPU's at any host cost (its
    times the dropless one's with a free host, beside how its passes are issued, `host_issue`, which floors its
    stages' passes alone)."""
    spec = f"hf:{write_config(tmp_path / 'mixtral', MIXTRAL)}"

    def layers(*args) -> list[dict]:
        out = tmp_path / f"{len(list(tmp_path.glob('*.json')))}.json"
        code, _, err = pipesim(*HF_ESTIMATE, "--model", spec, *args, "-o", out)
        assert code == 0, err
        return json.loads(out.read_text())["layers"]
    free, slow = layers("--host-kernel-us", 0), layers("--host-kernel-us", 1000)
    assert slow[1]["fwd"]["median_ms"] > 100 * free[1]["fwd"]["median_ms"]
    padded = ("--capacity-factor", 1)
    assert [{**layer, "host_issue": None} for layer in layers(*padded, "--host-kernel-us", 1000)] == [
        {**layer, "host_issue": None} for layer in layers(*padded, "--host-kernel-us", 0)] == [
        {**layer, "host_issue": None} for layer in free]


@needs_transformers
@pytest.mark.parametrize("fields, args, fragment", [
    (LLAMA, ("--capacity-factor", 1), "--capacity-factor applies to a mixture of experts: hf:"),
    (MIXTRAL, ("--capacity-factor", 0), "--capacity-factor: give a finite number above 0 (got 0)"),
    (MIXTRAL, ("--capacity-factor", "-1"), "--capacity-factor: give a finite number above 0 (got -1)"),
    (MIXTRAL, ("--capacity-factor", "inf"), "--capacity-factor: give a finite number above 0 (got inf)"),
    (MIXTRAL, ("--capacity-factor", "nan"), "--capacity-factor: give a finite number above 0 (got nan)"),
    (MIXTRAL, ("--capacity-factor", 1e300), "--capacity-factor 1e+300 pads each expert past the micro-batch's "
     "tokens (C·k/E = 1e+300·2/8 > 1), which Megatron-core cannot run: give at most E/k = 4"),
    (MIXTRAL, ("--capacity-factor", 1, "--data-parallel", 2, "--expert-parallel", 2, "--token-dispatcher", "deepep"),
     "--token-dispatcher deepep: Megatron-core's flex dispatcher does not pad experts to their capacity"),
    (MIXTRAL, ("--capacity-factor", 1, "--data-parallel", 2, "--expert-parallel", 2, "--token-dispatcher", "hybridep"),
     "--token-dispatcher hybridep: its padding to capacity (--capacity-factor), inside HybridEP's dispatch, is not "
     "modelled; give alltoall"),
    (MIXTRAL, ("--capacity-factor", 1, "--data-parallel", 2, "--expert-parallel", 2, "--hot-expert-share", 0.5),
     "--hot-expert-share: a model that drops tokens (--capacity-factor) pads every expert to its capacity"),
])
def test_a_capacity_factor_the_model_cannot_take_is_one_line_and_writes_nothing(tmp_path, fields, args, fragment):
    spec = f"hf:{write_config(tmp_path / 'config', fields)}"
    code, out, err = pipesim(*HF_ESTIMATE, "--model", spec, *args, "-o", tmp_path / "out.json")
    assert code == 2 and out == "" and fragment in err and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "out.json").exists()
