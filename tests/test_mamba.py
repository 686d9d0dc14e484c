"""A hybrid of Mamba-2, attention, MLP and mixture-of-experts layers from its Hugging Face config (transformers'
Nemotron-H): on the meta device each Mamba-2 mixer is counted as Megatron-core's kernels run it (workload/mamba.py),
its products' FLOPs and what it saves as the formulas say; off it, the layers compute transformers' model and train
on two gloo ranks as one process; Nemotron 3 Nano's config has its published parameters; and what pipesim cannot
split (t over the Mamba-2 heads or groups, the sequence of a Mamba-2 layer) is one line."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from pipesim.workload.count import count_built
from pipesim.workload.hf import hf_model
from tests.conftest import needs_transformers, pipesim, simulate_json
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
# T = B·S tokens; H heads of P, G groups of N, chunks of Q, a conv of K taps; width D; d = H·P
D, H, P, G, N, Q, K = 64, 8, 16, 2, 8, 16, 4
d, C = H * P, H * P + 2 * G * N
W = 2 * d + 2 * G * N + H  # in_proj's width: z, x, B, C and dt
HYBRID = {"model_type": "nemotron_h", "hybrid_override_pattern": "M*-E", "num_hidden_layers": 4, "hidden_size": D,
          "mamba_num_heads": H, "mamba_head_dim": P, "n_groups": G, "ssm_state_size": N, "chunk_size": Q,
          "conv_kernel": K, "num_attention_heads": 4, "num_key_value_heads": 4, "head_dim": 16,
          "intermediate_size": 128, "n_routed_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
          "moe_shared_expert_intermediate_size": 32, "vocab_size": 256, "max_position_embeddings": 256,
          "time_step_limit": [0.0, 1e9], "initializer_range": 0.2}
RECOMPUTED = ("causal_conv1d_fwd", "chunk_cumsum_fwd", "chunk_state_fwd", "state_passing_fwd", "bmm_chunk_fwd")


def _mamba_layer(tmp_path):
    counted = count_config(tmp_path / "hybrid", HYBRID, "flash")
    assert [layer.name for layer in counted.layers][:3] == ["0:Embedding", "1:DecoderLayer[M]", "2:DecoderLayer[*]"]
    return counted.layers[1]


def test_a_mamba2_layers_products_are_the_formulas_forward_and_backward(tmp_path):
    """in_proj and out_proj as the products they are; the conv 2·T·C·K; the scan 2·T·(2dN + QGN + Qd) forward
    and, its recomputation of the chunk states and C·Bᵀ included, 2·T·(5dN + 3Qd + 3QGN) in the input-gradient
    pass with the conv's recomputation and backward (2·T·C·K and 4·T·C·K); the weight pass the projections'
    weight gradients alone."""
    layer, T = _mamba_layer(tmp_path), B * S
    projections = 2 * T * D * W + 2 * T * d * D
    assert layer.fwd_flops == projections + 2 * T * C * K + 2 * T * (2 * d * N + Q * G * N + Q * d)
    assert layer.igrad_flops == projections + 6 * T * C * K + 2 * T * (5 * d * N + 3 * Q * d + 3 * Q * G * N)
    assert layer.wgrad_flops == projections


# Granite 4's hybrid: each layer a Mamba-2 mixer (or attention) beside experts, its mixer handed its input by name
GRANITE = {"model_type": "granitemoehybrid", "layer_types": ["linear_attention", "full_attention"],
           "num_hidden_layers": 2, "hidden_size": D, "mamba_n_heads": H, "mamba_d_head": P, "mamba_n_groups": G,
           "mamba_d_state": N, "mamba_chunk_size": Q, "mamba_d_conv": K, "num_attention_heads": 4,
           "num_key_value_heads": 4, "intermediate_size": 32, "shared_intermediate_size": 32, "num_local_experts": 4,
           "num_experts_per_tok": 2, "vocab_size": 256, "max_position_embeddings": 256,
           "time_step_limit": [0.0, 1e9]}


def test_a_granite_hybrid_whose_mixer_takes_its_input_by_name_is_counted_and_computed(tmp_path):
    """GraniteMoeHybrid calls its Mamba-2 mixer with hidden_states=: counted as the Nemotron-H mixer is (the scan's
    forward products with the block's own), and off the meta device computed as transformers' layer computes."""
    counted = count_config(tmp_path / "granite", GRANITE, "flash")
    assert "chunk_scan_fwd" in {op.op for op in counted.layers[1].ops["fwd"]}
    layers = hf_model(f"hf:{write_config(tmp_path / 'granite', GRANITE)}", 24).layers
    hidden = torch.randint(GRANITE["vocab_size"], (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        for layer in layers:
            hidden = layer(hidden)
    assert hidden.shape == (2, 24, GRANITE["vocab_size"]) and torch.isfinite(hidden).all()


def test_a_mamba2_layer_runs_mamba_ssms_kernels_not_the_reference_scan(tmp_path):
    """Each of the scan's kernels once a forward, each recomputed once in the backward, none of the PyTorch
    reference's Q x Q decay masks (its cumsum, tril and segment sums) counted, and the scan's float32 chunk states and
    C·Bᵀ made and freed within the pass, never saved."""
    layer = _mamba_layer(tmp_path)
    forward = [op.op for op in layer.ops["fwd"]]
    backward = [op.op for op in layer.ops["igrad"]]
    assert all(forward.count(name) == 1 and backward.count(name) == 1 for name in RECOMPUTED)
    assert forward.count("chunk_scan_fwd") == 1 and "chunk_scan_fwd" not in backward
    assert not {"cumsum", "tril", "bmm"} & {*forward, *backward}
    assert {op.op for name in ("fwd", "igrad") for op in layer.ops[name] if op.kind == "compute"} == {
        "causal_conv1d_fwd", "causal_conv1d_bwd", "chunk_state_fwd", "bmm_chunk_fwd", "chunk_scan_fwd",
        "chunk_scan_bwd_dstates", "chunk_scan_chunk_state_bwd_dx", "chunk_state_bwd_db", "chunk_scan_bwd_dC",
        "chunk_scan_bwd_dcb", "bmm_chunk_bwd", "chunk_scan_bwd_ddAcs_stable"}  # those with products of their own
    per_chunk = {(B, S // Q, H, P, N), (B, S // Q, G, Q, Q)}
    assert not per_chunk & {shape for shape, _ in layer.saved_tensors}


def test_a_mamba2_layer_saves_what_megatron_cores_functions_save(tmp_path):
    """The in_proj output zxbcdt and the scan's output before its gate (`MambaSplitConv1dScanCombinedFn`), the
    grouped norm's input and its float32 statistics (`LayerNormFn`), out_proj's input, in bfloat16 but the
    statistics: beside what the block's own norm and in_proj keep."""
    layer = _mamba_layer(tmp_path)
    T, two = B * S, 2
    assert ((B, S, W), T * W * two) in layer.saved_tensors
    assert sum(1 for shape, nbytes in layer.saved_tensors if math.prod(shape) == T * d and nbytes == T * d * two) == 3
    # all but the block's own norm: in_proj's input, zxbcdt, the scan's output, the norm's input and statistics,
    # out_proj's input, and the float32 decay rates A (H of them), which exp and the scan both keep: nothing else
    mixer = sorted(nbytes for (_, nbytes), part in zip(layer.saved_tensors, layer.saved_parts) if part != "norms")
    assert mixer == sorted([T * D * two, T * W * two, *[T * d * two] * 3, T * G * 4, H * 4, H * 4])


def test_off_the_meta_device_the_layers_compute_transformers_model(tmp_path):
    """pipesim's layers (the embedding, each block with its Mamba-2, attention, MLP or experts mixer, norm_f, the
    head) give the logits transformers' NemotronH model gives with the same weights."""
    assert_computes_transformers_model(
        write_config(tmp_path / "hybrid", HYBRID),
        lambda model, base: [base.embeddings, *base.layers, base.norm_f, model.lm_head], HYBRID["vocab_size"])


def test_a_hybrid_trains_on_two_gloo_ranks_as_one_process(tmp_path):
    """`run` trains the hybrid from its profile, a Mamba-2 and an attention block on one stage, an MLP and the
    experts on the other, to one process's losses."""
    assert_trains_as_one_process(tmp_path, f"hf:{write_config(tmp_path / 'hybrid', HYBRID)}")


def test_nemotron_3_nano_has_its_published_total_and_active_parameters():
    """Nemotron 3 Nano's report (arXiv 2512.20848) and model card: 31.6B parameters, 3.2B active a token, 3.6B with
    the embedding table (the head, 0.35B, counted in both): 52 layers, 23 Mamba-2, 23 of 128 routed experts (top 6)
    and a shared one, 6 attention."""
    counted = count_built(f"hf:{ROOT / 'examples' / 'nemotron-3-nano-30b-a3b'}", {"seq_len": 64}, 1, torch.bfloat16)
    total = sum(layer.param_bytes for layer in counted.layers) / 2
    experts = sum(layer.expert_param_bytes for layer in counted.layers) / 2
    embeddings = counted.layers[0].param_bytes / 2
    active = total - experts + experts * 6 / 128
    assert (round(total / 1e9, 1), round((active - embeddings) / 1e9, 1), round(active / 1e9, 1)) == (31.6, 3.2, 3.6)


@pytest.mark.parametrize("flags, line", [
    (("--tensor-parallel", 4), "error: --tensor-parallel 4 does not divide the model's 2 Mamba-2 groups"),
    (("--context-parallel", 2), "error: --context-parallel 2 splits the sequence for attention's ring, and "),
])
def test_what_pipesim_cannot_split_of_a_mamba2_layer_is_one_line(tmp_path, flags, line):
    model = f"hf:{write_config(tmp_path / 'hybrid', HYBRID)}"
    err = what_if_refused(tmp_path, model, *flags)
    assert err.startswith(line), err


def test_full_recomputation_keeps_only_each_blocks_input_whatever_its_mixer(tmp_path):
    """Megatron-core's HybridStack recomputes its Mamba-2 and MLP blocks as its attention and experts blocks, and NeMo
    AutoModel checkpoints every block: under --recompute full each keeps its input alone. The Mamba-2 block kept all
    it saves (its products are neither batched nor routed), 875 MiB a micro-batch of Nemotron 3 Nano at 16,384
    tokens beside the 84 MiB of its experts' blocks."""
    model = f"hf:{write_config(tmp_path / 'hybrid', HYBRID)}"
    profile = tmp_path / "profile.json"
    assert pipesim("estimate", "--gpu", "h100-sxm", "--model", model, "--seq-len", 64, "-b", 2, "-p", 1,
                   "--recompute", "full", "--out", profile).code == 0
    layers = json.loads(profile.read_text())["layers"]
    assert [layer["activation_bytes"] for layer in layers[1:5]] == [2 * 64 * D * 2] * 4  # M, *, -, E: b·s·D bf16


def test_only_a_layer_of_a_mamba2_mixer_alone_is_a_mamba_layer(tmp_path):
    """Megatron-core's MambaLayer, what CUDA graphs of the "mamba" scope capture whole: Nemotron-H's M layer, not its
    attention, MLP or experts layer, nor Granite's layer of a Mamba-2 mixer beside experts and a shared MLP, or
    beside the MLP alone, which is then its dense MLP ("mlp")."""
    hybrid = count_config(tmp_path / "hybrid", HYBRID, "flash")
    assert [layer.mamba_layer for layer in hybrid.layers] == [False, True, False, False, False, False, False]
    for experts in (4, 0):
        granite = count_config(tmp_path / f"granite{experts}", {**GRANITE, "num_local_experts": experts}, "flash")
        assert not any(layer.mamba_layer for layer in granite.layers)
        assert ("mlp" in granite.layers[1].region_ops) == (experts == 0)


def test_a_graphed_mamba2_layer_costs_the_host_one_replay_a_pass(tmp_path):
    """--cuda-graphs mamba: each pass of a Mamba-2 layer is one graph replay, issued at one kernel's cost, its GPU
    time its kernels' together; the other layers issue their kernels as before, and where the host binds (1 ms a
    kernel) the step is faster by the kernels the graphs replay."""
    from pipesim.planning.estimate import Parallelism, estimate_profile
    from tests.helpers import H100

    counted = count_config(tmp_path / "hybrid", HYBRID, "flash")
    eager, graphed = (estimate_profile(counted, H100, Parallelism(host_kernel_us=1000.0, cuda_graphs=graphs)).layers
                      for graphs in ((), ("mamba",)))
    for before, after, layer in zip(eager, graphed, counted.layers, strict=True):
        for name in ("fwd", "bwd"):
            issue = after.host_issue[name]
            if layer.mamba_layer:
                assert issue.idle_ms == pytest.approx(1.0)  # one replay issued from an empty queue
                assert issue.idle_ms < before.host_issue[name].idle_ms
                assert issue.slack_ms > before.host_issue[name].slack_ms
            else:  # what a layer carries from the one before it may differ, not its own issue
                assert (issue.idle_ms, issue.slack_ms) == (before.host_issue[name].idle_ms,
                                                           before.host_issue[name].slack_ms)
    model = f"hf:{write_config(tmp_path / 'hybrid', HYBRID)}"
    args = ("--gpu", "h100-sxm", "--model", model, "--seq-len", 64, "-b", 1, "-p", 1, "-m", 4, "--host-kernel-us", 1000)
    steps = [simulate_json(*args, *graphs)[0]["time_per_minibatch_ms"] for graphs in ((), ("--cuda-graphs", "mamba"))]
    assert steps[1] < steps[0]
    # beside expert parallelism's dispatcher too, each pass beside it (DualPipe's pairs) is the graph's replay
    beside = estimate_profile(counted, H100, Parallelism(host_kernel_us=1000.0, expert=2, data=2,
                                                         cuda_graphs=("mamba",))).layers[1]
    assert beside.host_issue["fwd_sharing"].idle_ms == pytest.approx(1.0)


@pytest.mark.parametrize("model, graphs, line", [
    ("hybrid", "attn", "error: --cuda-graphs: a comma list of mamba, full, each once (got 'attn')"),
    ("gpt", "mamba", "error: --cuda-graphs mamba: no layer of the model is a Mamba-2 layer to capture; leave it out"),
])
def test_cuda_graphs_of_a_scope_not_modelled_or_absent_are_one_line(tmp_path, model, graphs, line):
    model = "gpt" if model == "gpt" else f"hf:{write_config(tmp_path / 'hybrid', HYBRID)}"
    code, out, err = pipesim("simulate", "--gpu", "h100-sxm", "--model", model, "--seq-len", 64, "-b", 1, "-p", 1,
                             "--cuda-graphs", graphs, "--html", tmp_path / "t.html")
    assert (code, out) == (2, "") and err.startswith(line) and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "t.html").exists()


def test_a_hybrids_layers_say_their_mixers_and_are_cut_as_one_run_of_blocks(tmp_path):
    """A hybrid's decoder layers carry their mixers in Megatron-core's hybrid pattern (hybrid_override_pattern's
    symbols, "M*-E" here), as count's table prints them; cut by blocks, they are one run of the same kind whatever
    their mixers: Megatron-core cuts a hybrid stack by its layer count."""
    counted = count_config(tmp_path / "hybrid", HYBRID, "flash")
    assert [layer.name for layer in counted.layers] == [
        "0:Embedding", "1:DecoderLayer[M]", "2:DecoderLayer[*]", "3:DecoderLayer[-]", "4:DecoderLayer[E]",
        "5:NemotronHRMSNorm", "6:Linear"]
    model = f"hf:{write_config(tmp_path / 'hybrid', HYBRID)}"
    (result,) = simulate_json("--gpu", "h100-sxm", "--model", model, "--seq-len", 64, "-b", 1, "-p", 2, "-m", 4,
                              "-s", "1f1b", "--stage-cut", "equal-blocks")
    assert result["stage_bounds"] == [0, 3, 7]  # the embedding and 2 blocks, then 2 blocks, the norm and the head
