"""Gated DeltaNet layers (Qwen3-Next's, Qwen3.5's) from their Hugging Face configs: on the meta device each mixer is
counted as Megatron-core runs it with flash-linear-attention's kernels (workload/gdn.py), its products' FLOPs and
what it saves as the formulas say, in as many kernels whatever the sequence's length; off it, the layers compute
transformers' model and train on two gloo ranks as one process; Qwen3-Next's config has its published parameters; a
mixture of experts with no dense MLP width (Qwen3.5-MoE's) is counted; what pipesim cannot split is one line; other
linear attentions (Kimi Linear's KDA) are still refused."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from pipesim.workload.count import count_built
from tests.conftest import needs_transformers, pipesim
from tests.helpers import (
    B,
    S,
    assert_computes_transformers_model,
    assert_trains_as_one_process,
    count_config,
    what_if_refused,
    write_config,
)

pytestmark = needs_transformers

ROOT = Path(__file__).resolve().parents[1]
# width D, dense MLP F; the mixer's HK key heads of K, HV value heads of V, a conv of TAPS over C channels; chunks BT
D, F, HK, K, HV, V, TAPS, BT = 64, 96, 2, 16, 4, 16, 4, 64
C = 2 * HK * K + HV * V
NEXT = {"model_type": "qwen3_next", "hidden_size": D, "intermediate_size": F, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 128,
        "max_position_embeddings": 256, "num_experts": 0, "linear_num_key_heads": HK, "linear_num_value_heads": HV,
        "linear_key_head_dim": K, "linear_value_head_dim": V, "linear_conv_kernel_dim": TAPS,
        "layer_types": ["linear_attention", "full_attention"], "tie_word_embeddings": False}
CHUNK_FORWARD = ("chunk_gated_delta_rule_fwd_kkt_solve", "recompute_w_u_fwd", "chunk_gated_delta_rule_fwd_h",
                 "chunk_fwd_o")
CHUNK_BACKWARD = ("recompute_w_u_fwd", "chunk_gated_delta_rule_fwd_h", "chunk_bwd_dv_local",
                  "chunk_gated_delta_rule_bwd_dhu", "chunk_bwd_dqkwg", "prepare_wy_repr_bwd")


@pytest.fixture(autouse=True)
def _transformers_knows_qwen3_next():
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    if "qwen3_next" not in CONFIG_MAPPING:
        pytest.skip("this transformers has no Qwen3-Next")


# Qwen3.5's (its projections apart: in_proj_qkv, in_proj_z, in_proj_b, in_proj_a) and OLMo Hybrid's (q, k, v, a, b
# and g projections apart, its gated norm o_norm, beta doubled) mixers, counted alike
QWEN3_5 = {**NEXT, "model_type": "qwen3_5_text"}
OLMO_HYBRID = {key: value for key, value in NEXT.items() if key != "head_dim"} | {
    "model_type": "olmo_hybrid", "pad_token_id": 0}


def _delta_net_layer(tmp_path, seq_len=None, fields=NEXT):
    if seq_len is None:
        counted = count_config(tmp_path / "next", fields, "flash")
    else:
        counted = count_built(f"hf:{write_config(tmp_path / 'next', fields)}", {"seq_len": seq_len}, B,
                              torch.bfloat16, "flash")
    assert [layer.name for layer in counted.layers][1:3] == ["1:DecoderLayer[G-]", "2:DecoderLayer[*-]"]
    return counted.layers[1]


def _flops(layer, passed, names):
    return sum(op.flops * op.count for op in layer.ops[passed] if op.op in names)


def test_a_gated_delta_net_layers_products_are_the_formulas_forward_and_backward(tmp_path):
    """The projections (in_proj_qkvz, in_proj_ba, out_proj) and the MLP as the products they are; the conv 2·T·C·K
    forward, 6·T·C·K backward (flash-linear-attention's reruns the conv before its backward kernel); the chunk rule
    per token and value head 6KV + BT(5.25K + 4V) + BT²/2 forward and, its recomputation of the chunk states
    included, 16KV + 18·BT·K + 10·BT·V + 4·BT² backward; the weight pass the projections' weight gradients alone."""
    layer, T = _delta_net_layer(tmp_path), B * S
    chunk_forward = T * HV * (6 * K * V + BT * (21 * K + 16 * V) // 4 + BT * BT // 2)
    chunk_backward = T * HV * (16 * K * V + 18 * BT * K + 10 * BT * V + 4 * BT * BT)
    assert _flops(layer, "fwd", CHUNK_FORWARD) == chunk_forward
    assert _flops(layer, "igrad", CHUNK_BACKWARD) == chunk_backward
    products = 2 * T * D * (2 * HK * K + 2 * HV * V + 2 * HV) + 2 * T * HV * V * D + 3 * 2 * T * D * F
    assert layer.fwd_flops == products + 2 * T * C * TAPS + chunk_forward
    assert layer.igrad_flops == products + 6 * T * C * TAPS + chunk_backward
    assert layer.wgrad_flops == products


@pytest.mark.parametrize("fields", [NEXT, QWEN3_5, OLMO_HYBRID], ids=lambda fields: fields["model_type"])
def test_a_gated_delta_net_runs_fla_kernels_in_as_many_whatever_the_length(tmp_path, fields):
    """Each chunk-rule kernel once a forward and each once in the backward (w, u and the states recomputed; the conv
    rerun before its backward kernel), none of transformers' torch fallback (its loop over the chunks: cumsum, tril,
    batched products): the same kernels at 1 chunk as at 4, Qwen3-Next's, Qwen3.5's and OLMo Hybrid's mixers."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    if fields["model_type"] not in CONFIG_MAPPING:
        pytest.skip(f"this transformers has no {fields['model_type']}")
    short, long = (_delta_net_layer(tmp_path / name, seq_len, fields) for name, seq_len in (("short", 64),
                                                                                               ("long", 256)))
    for layer in (short, long):
        forward, backward = ([op.op for op in layer.ops[name]] for name in ("fwd", "igrad"))
        kernels = (*CHUNK_FORWARD, "causal_conv1d_fwd", "l2norm_fwd", "fused_rmsnorm", "norm_gate")
        assert all(forward.count(name) == 1 for name in kernels)
        assert all(backward.count(name) == 1 for name in (*CHUNK_BACKWARD, "causal_conv1d_fwd", "causal_conv1d_bwd"))
        assert not {"cumsum", "tril", "bmm", "triu"} & {*forward, *backward}
    assert [(op.op, op.count) for op in short.ops["fwd"]] == [(op.op, op.count) for op in long.ops["fwd"]]


def test_a_gated_delta_net_saves_what_its_kernels_save_and_not_the_chunk_states(tmp_path):
    """The chunk rule keeps the query and key repeated to the value heads, the value, beta, the float32 cumulative
    decay and each chunk's solved (I + A)⁻¹, BT values a token and head; the l2 norm, of the query and key joined,
    its output and float32 norms; the chunk states h (K·V a chunk and head) are recomputed, never kept."""
    layer, T, two = _delta_net_layer(tmp_path), B * S, 2
    saved = layer.saved_tensors
    assert ((B, S, HV, BT), T * HV * BT * two) in saved  # (I + A)⁻¹
    assert sum(1 for shape, nbytes in saved if shape == (B, S, HV, K) and nbytes == T * HV * K * two) >= 2  # q, k
    assert ((B, S, HV), T * HV * 4) in saved  # the cumulative decay
    assert ((B, S, 2 * HK), T * 2 * HK * 4) in saved  # the l2 norm's reciprocal norms, the query and key joined
    assert not [shape for shape, _ in saved if len(shape) == 5]


# Qwen3-Next's mixture of experts beside each mixer: routed experts and a shared one, gated
NEXT_MOE = {**NEXT, "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
            "shared_expert_intermediate_size": 48}


@pytest.mark.parametrize("fields", [NEXT, NEXT_MOE], ids=["dense", "experts"])
def test_off_the_meta_device_the_layers_compute_transformers_model(tmp_path, fields):
    """pipesim's layers give the logits transformers' Qwen3-Next gives with the same weights (its experts' with the
    shared expert's gate run inside the shared expert), and a count leaves the modeling module's functions as they
    were."""
    from transformers import AutoConfig, AutoModelForCausalLM

    modeling = sys.modules[AutoModelForCausalLM._model_mapping[AutoConfig.for_model("qwen3_next").__class__]
                           .__module__]
    functions = modeling.torch_chunk_gated_delta_rule, modeling.causal_conv1d_fn
    _delta_net_layer(tmp_path / "counted")
    assert (modeling.torch_chunk_gated_delta_rule, modeling.causal_conv1d_fn) == functions
    assert_computes_transformers_model(
        write_config(tmp_path / "next", fields),
        lambda model, base: [base.embed_tokens, *base.layers, base.norm, model.lm_head], fields["vocab_size"])


def test_a_gated_delta_net_model_trains_on_two_gloo_ranks_as_one_process(tmp_path):
    assert_trains_as_one_process(tmp_path, f"hf:{write_config(tmp_path / 'next', NEXT)}")


def test_qwen3_next_has_its_published_total_and_active_parameters():
    """Qwen3-Next-80B-A3B's architecture (Qwen3-Coder-Next shares it): 79,674,391,296 parameters in its published
    weights, 3,874,929,408 active a token (the 10 of 512 routed experts' share, the embedding and head included)."""
    counted = count_built(f"hf:{ROOT / 'examples' / 'qwen3-next-80b-a3b'}", {"seq_len": 64}, 1, torch.bfloat16)
    total = sum(layer.param_bytes for layer in counted.layers) // 2
    experts = sum(layer.expert_param_bytes for layer in counted.layers) // 2
    assert (total, total - experts + experts * 10 // 512) == (79_674_391_296, 3_874_929_408)


def test_a_mixture_of_experts_with_no_dense_mlp_is_counted_at_its_experts_width(tmp_path):
    """Qwen3.5-MoE's text config has no intermediate_size (every MLP is an expert's): its MLP width is its
    experts', which tensor parallelism splits. One whose dense layers have a width of their own (Ergo's
    first_dense_intermediate_size) is not so: it stays refused as a config without an MLP width."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    from pipesim.workload.hf import _figures

    if "qwen3_5_moe_text" not in CONFIG_MAPPING:
        pytest.skip("this transformers has no Qwen3.5-MoE")
    if "ergo" in CONFIG_MAPPING:
        assert _figures(CONFIG_MAPPING["ergo"])["ffn"] == "intermediate_size"
    fields = {key: value for key, value in NEXT.items() if key not in ("intermediate_size", "num_experts")}
    folder = write_config(tmp_path / "moe", {**fields, "model_type": "qwen3_5_moe_text", "num_experts": 4,
                                             "num_experts_per_tok": 2, "moe_intermediate_size": 24,
                                             "shared_expert_intermediate_size": 24})
    counted = count_built(f"hf:{folder}", {"seq_len": S}, B, torch.bfloat16, "flash")
    assert (counted.options["ffn"], counted.options["expert_ffn"]) == (24, 24)
    code, out, err = pipesim("simulate", "--gpu", "h100-sxm", "--model", f"hf:{folder}", "--seq-len", S, "-p", 1,
                             "--tensor-parallel", 16)
    assert (code, out) == (2, "")
    assert err.strip() == "error: --tensor-parallel 16 does not divide the model's 4 heads: give --tensor-parallel 2"


@pytest.mark.parametrize("recompute", ["none", "full"])
def test_under_context_parallelism_a_gated_delta_net_trades_the_sequence_for_its_heads_by_two_all_to_alls(
        tmp_path, recompute):
    """Megatron-core's CP around a Gated DeltaNet mixer (`a2a_cp_to_hp`, `a2a_hp_to_cp`): its in_proj's output
    (q, k, v, z, beta, decay: 2HK·K + 2HV·V + 2HV a token) goes to the rank holding its heads, the normed value (HV·V)
    comes back, each rank sending (C - 1)/C of its T/C tokens' channels, none hidden; the backward sends their
    gradients, again after a full recomputation's rerun."""
    from pipesim.planning.estimate import Parallelism, estimate_layer
    from pipesim.profiles.schema import EstimateLink
    from tests.helpers import H100_BF16

    layer, T, c = _delta_net_layer(tmp_path), B * S, 2
    assert layer.context_exchanges == ((2 * HK * K + 2 * HV * V + 2 * HV, HV * V),)
    link = EstimateLink(kind="nvlink", latency_ms=0.01, bytes_per_ms=1e6)
    priced = estimate_layer(layer, H100_BF16, Parallelism(context=c, recompute=recompute), link, 2, link)
    sent = [link.latency_ms + T // c * width * 2 * (c - 1) / c / link.bytes_per_ms
            for width in layer.context_exchanges[0]]
    assert (priced.ring_fwd.link_ms, priced.ring_fwd.hidden_ms) == (pytest.approx(sum(sent)), 0)
    assert priced.ring_bwd.link_ms == pytest.approx(sum(sent) * (2 if recompute == "full" else 1))
    if recompute == "none":  # gdn_norm_out reruns the gated norm and the normed value's exchange with it
        normed = estimate_layer(layer, H100_BF16, Parallelism(context=c, recompute_modules=("gdn_norm_out",)), link,
                                2, link)
        assert normed.ring_bwd.link_ms == pytest.approx(sum(sent) + sent[1])
        split = estimate_layer(layer, H100_BF16, Parallelism(context=c, tensor=2), link, 2, link)
        assert split.ring_fwd.link_ms == pytest.approx(sum(link.latency_ms + (ms - link.latency_ms) / 2
                                                           for ms in sent))  # t = 2: half the channels each


@pytest.mark.parametrize("flags, line", [
    (("--tensor-parallel", 4), "error: --tensor-parallel 4 does not divide the model's 2 gated delta rule key heads"),
    (("--context-parallel", 4), "error: --context-parallel 4 does not divide the 2 gated delta rule key heads of "),
    (("--context-parallel", 2), "error: --cp-rotate alltoall is a ring of torch's context parallel"),  # the default
    (("--context-parallel", 2, "--cp-rotate", "allgather"), "error: --cp-rotate allgather is a ring of torch's "),
])
def test_what_pipesim_cannot_split_of_a_gated_delta_net_is_one_line(tmp_path, flags, line):
    fields = {**NEXT, "num_attention_heads": 4, "num_key_value_heads": 4}
    model = f"hf:{write_config(tmp_path / 'next', fields)}"
    err = what_if_refused(tmp_path, model, *flags)
    assert err.startswith(line), err
    if "--cp-rotate" in line:  # the ring it names runs them
        assert "give --cp-rotate p2p (Megatron-core's ring)" in err
        assert pipesim("simulate", "--gpu", "h100-sxm", "--model", model, "--seq-len", 64, "-b", 1, "-p", 2,
                       "--context-parallel", 2, "--cp-rotate", "p2p")[0] == 0


@pytest.mark.parametrize("last", ["full_attention", "linear_attention"])
def test_an_mtp_layer_after_typed_layers_is_of_the_last_layers_kind(tmp_path, last):
    """Megatron-core builds an MTP module's layer from the decoder's last layer's spec (get_gpt_mtp_block_spec):
    Qwen3-Next's full attention, where transformers' per-layer kinds hold none past the last; after a Gated
    DeltaNet layer, one counted as its kernels run, not transformers' fallback."""
    kinds = ["linear_attention", "full_attention"]
    fields = {**NEXT, "layer_types": sorted(kinds, key=lambda kind: kind == last)}
    counted = count_built(f"hf:{write_config(tmp_path / last, fields)}", {"seq_len": S, "mtp_layers": 1}, B,
                          torch.bfloat16, "flash")
    mtp = counted.layers[-2]
    assert mtp.name.endswith("MultiTokenPrediction")
    forward = [op.op for op in mtp.ops["fwd"]]
    attention = any(op.kind == "attention" for op in mtp.ops["fwd"])
    if last == "full_attention":
        assert attention and not set(CHUNK_FORWARD) & set(forward)
    else:
        assert not attention and all(forward.count(name) == 1 for name in CHUNK_FORWARD)
        assert not {"cumsum", "tril", "bmm"} & set(forward)


def test_a_zero_centred_rmsnorm_runs_as_transformer_engines_kernel_under_the_fused_norm_kernel(tmp_path):
    """Qwen3-Next's RMSNorm scales by 1 + weight (Megatron-core's --apply-layernorm-1p, TransformerEngine's
    zero_centered_gamma): `--norm-kernel fused` runs it as the one kernel each way, keeping the input and its float32
    reciprocal RMS, where it was refused as no RMSNorm to fuse."""
    eager, fused = (count_config(tmp_path / kernel, NEXT, "flash", norm_kernel=kernel).layers[1]
                    for kernel in ("eager", "fused"))
    def norm_kernels(layer):  # the gated norm's TransformerEngine RMSNorm is one whatever the flag
        return sum(op.count for op in layer.ops["fwd"] if op.op == "fused_rmsnorm")

    assert (norm_kernels(eager), norm_kernels(fused)) == (1, 3)  # the layer's input and pre-MLP norms
    assert fused.saved_bytes < eager.saved_bytes


def test_recomputing_a_gated_shared_expert_drops_its_gates_scaling_too(tmp_path):
    """Megatron-core's SharedExpertMLP runs its gate inside (moe/shared_experts.py), so its checkpoint
    ("shared_experts") drops what the gate's sigmoid and scaling saved, not only what the MLP saved: the scaled
    product's inputs, the MLP's output (T x D) and the gate's (T x 1), and the gate's product reruns with the MLP."""
    layer, T = count_config(tmp_path / "moe", NEXT_MOE, "flash").layers[1], B * S
    dropped = [layer.saved_tensors[i] for i in layer.region_saves["shared_experts"]]
    assert ((T, D), T * D * 2) in dropped and ((T, 1), T * 2) in dropped
    assert [op.kind for op in layer.region_ops["shared_experts"]].count("matmul") == 3  # gate; gate_proj, up; down


def test_recomputing_the_gated_norm_drops_its_output_and_statistics_and_reruns_its_two_kernels(tmp_path):
    """gdn_norm_out (Megatron-core's output-discarding checkpoint of `_gated_norm_and_a2a`, the Qwen3.6-35B-A3B
    verification card's recipe): the norm's float32 statistics, the normed value the gate keeps and the gated output
    out_proj keeps are dropped and made again by the two kernels; the core's output and the gate z, which it reads,
    stay; a model without a Gated DeltaNet is refused it in one line."""
    from tests.helpers import priced_recomputing as priced

    layer, T = _delta_net_layer(tmp_path), B * S
    dropped = [layer.saved_tensors[i] for i in layer.region_saves["gdn_norm_out"]]
    assert sorted(dropped) == sorted([((T * HV, 1), T * HV * 4), ((T * HV, V), T * HV * V * 2),
                                      ((T, HV * V), T * HV * V * 2)])
    assert [op.op for op in layer.region_ops["gdn_norm_out"]] == ["fused_rmsnorm", "norm_gate"]
    assert priced(layer).activation_bytes - priced(layer, "gdn_norm_out").activation_bytes == sum(
        nbytes for _, nbytes in dropped)
    code, out, err = pipesim("simulate", "--model", "gpt", "--layers", "2", "--gpu", "h100-sxm", "-p", "2",
                             "--recompute-modules", "gdn_norm_out")
    assert (code, out) == (2, "") and err.strip() == ("error: --recompute-modules gdn_norm_out: no layer of the model "
                                                      "has a Gated DeltaNet's gated norm to recompute; leave it out")


def test_tune_refuses_context_parallel_ranks_a_tensor_rank_s_heads_do_not_split_before_it_estimates(tmp_path):
    """tune checks C against the heads of the t it was given as soon as the model is counted, in one line, not
    after seconds of estimates that each refuse it."""
    model = f"hf:{write_config(tmp_path / 'next', NEXT)}"
    code, out, err = pipesim("tune", "--gpu", "h100-sxm", "--model", model, "--seq-len", 64, "--devices", 4,
                             "--tensor-parallel", 2, "--context-parallel", 2, "--cp-rotate", "p2p")
    assert (code, out) == (2, "") and err.strip().splitlines() == [
        f"error: --context-parallel 2 does not divide the 1 gated delta rule key heads of {model} a tensor-parallel "
        "rank holds (Megatron-core splits them over the context-parallel ranks, around its Gated DeltaNet layers); "
        "leave --context-parallel out"], err


@pytest.mark.parametrize("runtime", ["megatron", "torch"])
def test_a_gated_delta_nets_in_projections_reduce_their_input_gradient_once(tmp_path, runtime):
    """in_proj_qkvz and in_proj_ba read the layer's normed input and reach out_proj through the gated norm: one
    column-parallel reduction of their summed input gradient under both runtimes (Megatron-core's fused in_proj,
    DTensor's summed Partial gradients), neither taken for MLA's latent down-projections (planning/estimate.py
    `_latent_products`), which reduced each its own under Megatron-core and ran whole under torch's."""
    from pipesim.planning.estimate import Parallelism, _Split

    layer = _delta_net_layer(tmp_path)
    split = _Split.of(layer, Parallelism(tensor=2, tp_runtime=runtime, sequence_parallel=True))
    in_projections = [0, 1]  # (64 tokens x) 192 = q, k (2 x 2 x 16), v and z (2 x 4 x 16); 8 = b and a (2 x 4)
    assert [layer.weight_grad_outputs[j][0] for j in in_projections] == [(1, BT, 2 * HK * K + 2 * HV * V, D),
                                                                         (1, BT, 2 * HV, D)]
    assert {split.weights[j] for j in in_projections} == {"column"}
    assert {split.groups[j] for j in in_projections} == {tuple(in_projections)}
