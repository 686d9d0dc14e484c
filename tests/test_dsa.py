"""DeepSeek Sparse Attention layers (DeepSeek-V3.2's, GLM-5's, GLM-5.2's top-k sharing) from their Hugging Face
configs: on the meta device each is counted as Megatron-core trains it absorbed, with the cuDNN path's kernels and the
indexer's loss (workload/dsa.py), their FLOPs as the formulas say and what they save; off it, the layers compute
transformers' model (the attention masked to the indexer's top k, handed on to the layers that share it) and train on
two gloo ranks as one process; a stage starts only at a layer that runs its indexer; what pipesim does not price yet
(tensor or context parallelism, a score buffer past the fused path's) is one line."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from pipesim.workload.count import count_built
from tests.conftest import needs_transformers, pipesim, simulate_json
from tests.helpers import (
    S,
    assert_computes_transformers_model,
    assert_trains_as_one_process,
    what_if_refused,
    write_config,
)

pytestmark = needs_transformers

# width D; H heads, query latent Q, key latent L, no-RoPE N and RoPE R channels a head, values V; an indexer of HI
# heads of DI channels keeping TOP keys (fewer than the tests' 24 and S tokens: the top k is sparse)
D, H, Q, L, N, R, V, HI, DI, TOP = 64, 4, 32, 16, 8, 8, 8, 2, 16, 8
V32 = {"model_type": "deepseek_v32", "hidden_size": D, "intermediate_size": 96, "moe_intermediate_size": 32,
       "num_hidden_layers": 2, "first_k_dense_replace": 1, "n_routed_experts": 4, "n_shared_experts": 1,
       "num_experts_per_tok": 2, "n_group": 1, "topk_group": 1, "num_attention_heads": H, "num_key_value_heads": H,
       "q_lora_rank": Q, "kv_lora_rank": L, "qk_nope_head_dim": N, "qk_rope_head_dim": R, "v_head_dim": V,
       "index_topk": TOP, "index_n_heads": HI, "index_head_dim": DI, "vocab_size": 128,
       "max_position_embeddings": 256, "tie_word_embeddings": False}
GLM5 = {**V32, "model_type": "glm_moe_dsa", "mlp_layer_types": ["dense", "sparse"]}
# GLM-5.2's top-k sharing: the second and fourth layers attend to the keys the layer before them kept (pipesim's layers
# 2 and 4, the embedding first)
GLM52 = {**GLM5, "num_hidden_layers": 4, "mlp_layer_types": ["dense", "sparse", "sparse", "sparse"],
         "indexer_types": ["full", "shared", "full", "shared"]}


@pytest.fixture(autouse=True)
def _transformers_knows_dsa():
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    if not {"deepseek_v32", "glm_moe_dsa"} <= set(CONFIG_MAPPING):
        pytest.skip("this transformers has no DeepSeek-V3.2 or GLM-5")


def _layer(tmp_path, fields=V32, seq_len=S, index=1):
    spec = f"hf:{write_config(tmp_path / fields['model_type'], fields)}"
    return count_built(spec, {"seq_len": seq_len}, 1, torch.bfloat16, "flash").layers[index]


def _kernels(layer, kind):
    return {op.op: op for op in layer.ops[kind] if op.kind == "compute"}


@pytest.mark.parametrize("seq_len", [S, TOP // 2])
def test_a_sparse_attention_is_counted_as_megatron_cores_fused_kernels(tmp_path, seq_len):
    """The indexer scores every causal pair (2·HI·DI a pair); FlashMLA's forward and the loss's target each compute
    the kept pairs, min(k, i + 1) a query, over the 576-channel absorbed query (here L + R) and the L-channel value;
    the indexer's backward (run inside the forward, as cuDNN's path does) every one of the k slots of a query (it
    takes no top-k length) over at least 64 heads (cuDNN's, padded); the sparse backward 2·H·(3(L + R) + 2L) a kept
    pair. At fewer tokens than k every earlier key is kept."""
    layer = _layer(tmp_path, seq_len=seq_len)
    forward, backward = _kernels(layer, "fwd"), _kernels(layer, "igrad")
    s, k = seq_len, min(TOP, seq_len)
    causal, kept = s * (s + 1) // 2, k * (k + 1) // 2 + (s - k) * k
    assert {name: op.flops for name, op in forward.items()} == {
        "dsa_indexer_forward": 2 * HI * DI * causal, "flash_mla_sparse_fwd": 2 * H * (L + R + L) * kept,
        "sparse_attn_score_recompute": 2 * H * (L + R) * kept, "dsa_indexer_backward": 6 * 64 * DI * s * k}
    assert {name: op.flops for name, op in backward.items()} == {
        "sparse_attention_backward": 2 * H * (3 * (L + R) + 2 * L) * kept}
    assert not _kernels(layer, "wgrad")
    names = [op.op for op in layer.ops["fwd"]]
    assert names.count("hadamard_transform") == 2  # DeepSeek-V3.2's indexer query and key, rotated
    assert names.index("dsa_indexer_forward") < names.index("dsa_indexer_top_k") < names.index("flash_mla_sparse_fwd")


def test_the_fused_kernels_run_at_flashmlas_published_rate(tmp_path):
    """Every kernel with products the fused path and the sharing path record is one of SPARSE_ATTENTION_KERNELS but
    the sharing path's per-head scores (TF32's: `test_a_float32_product_runs_at_the_parts_tf32_peak`), priced at 640
    of the H800's 989.4 TFLOP/s (FlashMLA's sparse prefill), where another kernel with products runs at the
    products'."""
    from pipesim.planning.estimate import SPARSE_ATTENTION_FRACTION, op_ms
    from pipesim.profiles.workload import SPARSE_ATTENTION_KERNELS
    from tests.helpers import H100_BF16

    layer, sharing = _layer(tmp_path), _layer(tmp_path / "glm52", GLM52)
    recorded = {**_kernels(layer, "fwd"), **_kernels(layer, "igrad")}
    shared = {**_kernels(sharing, "fwd"), **_kernels(sharing, "igrad")}
    assert sorted({*recorded, *shared} - {"bmm_fp32"}) == sorted(SPARSE_ATTENTION_KERNELS)
    op = dataclasses.replace(recorded["flash_mla_sparse_fwd"], flops=10**15)  # bound by its products, not bytes
    assert op.flops / (op_ms(op, H100_BF16) - H100_BF16.curve.kernel_overhead_ms) == pytest.approx(
        H100_BF16.peak_flops_per_ms * SPARSE_ATTENTION_FRACTION)
    assert SPARSE_ATTENTION_FRACTION < H100_BF16.curve.matmul_efficiency


@pytest.mark.parametrize("fields, lse_alone", [(V32, False), (GLM52, True)], ids=["fused", "sharing"])
def test_under_full_recomputation_the_indexer_loss_runs_in_the_rerun_alone(tmp_path, fields, lse_alone):
    """Megatron-core computes the indexer's loss only with gradients on: under full recomputation the first,
    checkpointed forward skips its kernels (under top-k sharing, the FlashMLA forward run for the loss's log-sum-exp
    too) and the rerun runs them; without recomputation the one forward does."""
    from pipesim.planning.estimate import Parallelism, estimate_layer, op_ms
    from pipesim.profiles.schema import EstimateLink
    from pipesim.profiles.workload import GRAD_ONLY_KERNELS
    from tests.helpers import H100_BF16

    layer = _layer(tmp_path, fields)
    link = EstimateLink(kind="nvlink", latency_ms=0.01, bytes_per_ms=1e6)
    plain, full = (estimate_layer(layer, H100_BF16, Parallelism(recompute=how), link, 2) for how in ("none", "full"))
    loss_ms = sum(op.count * op_ms(op, H100_BF16) for op in layer.ops["fwd"] if op.op in GRAD_ONLY_KERNELS)
    lse = {"flash_mla_sparse_fwd_lse"}
    assert {op.op for op in layer.ops["fwd"]} >= set(GRAD_ONLY_KERNELS) - (set() if lse_alone else lse)
    assert loss_ms > 0
    assert full.fwd_ms == pytest.approx(plain.fwd_ms - loss_ms)
    assert full.bwd_ms == pytest.approx(plain.bwd_ms + plain.fwd_ms)


def test_the_absorbed_attention_keeps_its_latent_and_the_indexer_its_gradients(tmp_path):
    """What the fused path saves a token: the absorbed query (H x (L + R)) and key (L + R) in bf16, the kept indices
    (int32, k), the latent output (H x L, bf16) and its log-sum-exp (H, float32), the indexer's gradients (HI x DI +
    DI + HI, bf16); the mixer's dense parts as transformers' torch code saves them."""
    from pipesim.workload import dsa

    saved: list[list[torch.Tensor]] = []
    forward = dsa._SparseAttention.forward

    def recorded(ctx, *args):
        save = ctx.save_for_backward
        ctx.save_for_backward = lambda *tensors: (saved.append(list(tensors)), save(*tensors))
        return forward(ctx, *args)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(dsa._SparseAttention, "forward", staticmethod(recorded))
        _layer(tmp_path)
    widths = [(tuple(t.shape[2:]), t.dtype) for t in saved[0]]
    assert widths == [((H, L + R), torch.bfloat16), ((L + R,), torch.bfloat16), ((TOP,), torch.int32),
                      ((H, L), torch.bfloat16), ((H,), torch.float32), ((HI, DI), torch.bfloat16),
                      ((DI,), torch.bfloat16), ((HI,), torch.bfloat16)]


def test_glm5s_indexer_is_not_rotated_and_its_layers_count_alike(tmp_path):
    """Megatron-Bridge's GLM-5 bridge turns the indexer's Hadamard rotation off; the kernels are DeepSeek-V3.2's."""
    glm, v32 = _layer(tmp_path / "glm", GLM5), _layer(tmp_path / "v32")
    assert "hadamard_transform" not in [op.op for op in glm.ops["fwd"]]
    assert {n: op.flops for n, op in _kernels(glm, "fwd").items()} == {
        n: op.flops for n, op in _kernels(v32, "fwd").items()}


@pytest.mark.parametrize("fields", [V32, GLM5], ids=["deepseek_v32", "glm_moe_dsa"])
def test_off_the_meta_device_the_layers_compute_transformers_model(tmp_path, fields):
    """pipesim's layers give the logits transformers' model gives with the same weights, its attention masked to
    the indexer's top k of 24 tokens."""
    assert_computes_transformers_model(
        write_config(tmp_path / fields["model_type"], fields),
        lambda model, base: [base.embed_tokens, *base.layers, base.norm, model.lm_head], fields["vocab_size"])


def test_a_sparse_attention_model_trains_on_two_gloo_ranks_as_one_process(tmp_path):
    assert_trains_as_one_process(tmp_path, f"hf:{write_config(tmp_path / 'v32', V32)}")


@pytest.mark.parametrize("flags, line", [
    (("--tensor-parallel", 2), "error: --tensor-parallel 2 ranks would each run the whole indexer of the model's "
                               "sparse attention"),
    (("--context-parallel", 2), "error: --context-parallel 2 splits the sequence, and hf:"),
    (("--dtype", "fp8", "--recompute-modules", "mla_up_proj"),  # absorbed_mla.py asserts no float8 there
     "error: --recompute-modules mla_up_proj reruns the up-projections of the model's absorbed MLA"),
    (("--recompute", "selective"), "error: --recompute selective reruns the attention core pipesim finds by its s x s "
                                   "tensors, which the model's sparse attention has none of"),
])
def test_what_pipesim_does_not_price_of_a_sparse_attention_is_one_line(tmp_path, flags, line):
    model = f"hf:{write_config(tmp_path / 'v32', V32)}"
    err = what_if_refused(tmp_path, model, *flags)
    assert err.startswith(line), err


def test_a_score_buffer_past_the_fused_paths_is_one_line(tmp_path):
    """A micro-batch whose [b, s, s] float32 scores pass 1 GiB is scored by a PyTorch fallback in row chunks."""
    longer = write_config(tmp_path / "v32", {**V32, "max_position_embeddings": 32768})
    code, out, err = pipesim("count", "--model", f"hf:{longer}", "--seq-len", 16385)
    assert (code, out) == (2, "") and len(err.strip().splitlines()) == 1, err
    assert err.rstrip().endswith("give 16,384 or less"), err


def test_the_fused_path_scores_what_fits_its_buffer_in_rows_of_512():
    """Megatron-core scores a micro-batch at once where the rows of s float32 scores a sequence that fit 1 GiB,
    rounded down to 512 (`_bytes_to_chunk_rows`), are s or more."""
    from pipesim.workload.dsa import longest_scored_at_once, scored_at_once

    assert [longest_scored_at_once(b) for b in (1, 2, 3, 8)] == [16_384, 11_397, 9_216, 5_632]
    assert scored_at_once(2, 11_397) and not scored_at_once(2, 11_398) and not scored_at_once(2, 11_585)


def test_tune_tries_only_the_micro_batches_whose_scores_the_fused_path_takes(tmp_path):
    """At 8,192 tokens the fused path takes micro-batches of up to 4 sequences: tune searches those, where it
    stopped at the first larger one it counted."""
    longer = write_config(tmp_path / "v32", {**V32, "max_position_embeddings": 32768})
    code, out, err = pipesim("tune", "--gpu", "h100-sxm", "--model", f"hf:{longer}", "--seq-len", 8192,
                             "--devices", 8)
    assert code == 0, err
    chosen = int(out.split(" -b ")[1].split()[0])
    assert chosen <= 4


def test_an_unfused_sparse_attention_is_one_line(tmp_path):
    """--attention math is Megatron-core's dense float32 reference of DSA, every pair: not counted."""
    code, out, err = pipesim("count", "--model", f"hf:{write_config(tmp_path / 'v32', V32)}", "--seq-len", S,
                             "--attention", "math")
    assert (code, out) == (2, "") and err.startswith("error: --attention math: Megatron-core runs an unfused sparse "
                                                     "attention as its dense float32 reference"), err


def test_mla_up_proj_reruns_the_absorbed_query_not_the_sparse_attention(tmp_path):
    """Megatron-core's "mla_up_proj" checkpoint of an absorbed MLA (`qkv_up_proj_and_rope_apply`) holds the query's
    up-projection, its absorption (a product), the RoPE and the joins; it ends where the sparse attention begins, a
    kernel with products, as a region ends at a product."""
    from pipesim.profiles.workload import SPARSE_ATTENTION_KERNELS

    region = [op.op for op in _layer(tmp_path).region_ops["mla_up_proj"]]
    assert not set(region) & set(SPARSE_ATTENTION_KERNELS)
    assert region[0] == "mm" and region.count("bmm") == 1 and region[-2:] == ["cat", "cat"]  # no norm: run before


def test_deepseek_v3_2_is_deepseek_v3_with_an_indexer_a_layer():
    """examples/deepseek-v3.2: DeepSeek-V3's 671,026,404,352 parameters (tests/test_moe.py) and 61 indexers, each a
    query projection from the 1,536-channel query latent to 64 heads of 128, a key projection from the 7,168-wide
    hidden state to 128 with its LayerNorm, and 64 head weights: with the multi-token-prediction module (14 B, not
    built), the published 685 B."""
    from pathlib import Path

    root = Path(__file__).resolve().parents[1] / "examples"
    total = {name: sum(layer.param_bytes for layer in count_built(f"hf:{root / name}", {"seq_len": 64}, 1,
                                                                   torch.bfloat16, "flash").layers) // 2
             for name in ("deepseek-v3", "deepseek-v3.2")}
    indexer = 1536 * 64 * 128 + 7168 * 128 + 2 * 128 + 7168 * 64
    assert (indexer, total["deepseek-v3.2"] - total["deepseek-v3"]) == (13_959_424, 61 * 13_959_424)
    assert total["deepseek-v3.2"] == 671_877_929_216


def test_glm_5_has_the_tensor_bytes_megatron_bridges_card_verified():
    """examples/glm-5: Megatron-Bridge's GLM-5 card (examples/model_verification_cards/glm5/card.yaml at 067f987df0)
    exports 1,487,822,475,264 bytes of tensors in the 78-layer graph: the parameters in bf16, and the routers'
    expert-score biases (transformers' `e_score_correction_bias`, a buffer kept in float32: 256 in each of the 75
    mixture-of-experts layers), which are not parameters."""
    from pathlib import Path

    folder = Path(__file__).resolve().parents[1] / "examples" / "glm-5"
    counted = count_built(f"hf:{folder}", {"seq_len": 64}, 1, torch.bfloat16, "flash")
    assert sum(layer.param_bytes for layer in counted.layers) + 75 * 256 * 4 == 1_487_822_475_264


@pytest.mark.parametrize("seq_len", [S, TOP // 2])
def test_under_top_k_sharing_a_layer_scores_by_head_in_float32_and_the_next_reads_its_keys(tmp_path, seq_len):
    """Under top-k sharing Megatron-core leaves the fused path (dsa.py: `not self.index_share`). A layer that runs its
    indexer scores the whole square a head at a time in float32 (2·DI·s² a head: `bmm_fp32`, which TF32 runs) and runs
    FlashMLA's forward twice, once for the loss's log-sum-exp alone; its top k padded back to k slots at fewer tokens
    (`_pad_topk_result`), over which the indexer's backward runs; a layer that shares its keys runs FlashMLA's forward
    and the sparse backward alone, keeps its own copy of the indices, and no stage may start at it."""
    folder = write_config(tmp_path / "glm52", GLM52)
    counted = count_built(f"hf:{folder}", {"seq_len": seq_len}, 1, torch.bfloat16, "flash")
    assert [layer.follows_previous for layer in counted.layers] == [False, False, True, False, True, False, False]
    indexing, reusing = counted.layers[3], counted.layers[4]
    s, k = seq_len, min(TOP, seq_len)
    pairs = k * (k + 1) // 2 + (s - k) * k
    heads = [op for op in indexing.ops["fwd"] if op.op == "bmm_fp32"]
    assert [(op.count, op.flops) for op in heads] == [(HI, 2 * DI * s * s)]
    assert {name: op.flops for name, op in _kernels(indexing, "fwd").items() if name != "bmm_fp32"} == {
        "flash_mla_sparse_fwd_lse": 2 * H * (L + R + L) * pairs, "flash_mla_sparse_fwd": 2 * H * (L + R + L) * pairs,
        "sparse_attn_score_recompute": 2 * H * (L + R) * pairs, "dsa_indexer_backward": 6 * 64 * DI * s * TOP}
    assert {name: op.flops for name, op in _kernels(reusing, "fwd").items()} == {
        "flash_mla_sparse_fwd": 2 * H * (L + R + L) * pairs}
    assert _kernels(reusing, "igrad").keys() == _kernels(indexing, "igrad").keys() == {"sparse_attention_backward"}
    assert not [op for op in reusing.ops["fwd"] if op.op.startswith("dsa_")]
    indices = ((1, s, TOP), 4 * s * TOP)  # int32, the copy each layer's sparse attention keeps for its backward
    assert indices in reusing.saved_tensors and indices in indexing.saved_tensors


def test_a_multi_token_prediction_layer_runs_its_own_indexer_where_the_last_layer_shares(tmp_path):
    """Megatron-core numbers a multi-token-prediction module's layer 1, which computes its own top k; GLM-5.2's last
    layer (here the fourth) shares the one before it."""
    folder = write_config(tmp_path / "glm52", GLM52)
    counted = count_built(f"hf:{folder}", {"seq_len": S, "mtp_layers": 1}, 1, torch.bfloat16, "flash")
    mtp = counted.layers[-2]
    assert "bmm_fp32" in {op.op for op in mtp.ops["fwd"]} and not mtp.follows_previous


def test_off_the_meta_device_a_layer_that_shares_attends_to_the_keys_the_layer_before_it_kept(tmp_path):
    """transformers hands each layer the top k of the one before (`prev_topk_indices`), which pipesim's layers pass
    on (`TopKHandoff`): the logits are transformers' model's (without them transformers' shared layer raises)."""
    assert_computes_transformers_model(
        write_config(tmp_path / "glm52", GLM52),
        lambda model, base: [base.embed_tokens, *base.layers, base.norm, model.lm_head], GLM52["vocab_size"])


def test_a_top_k_sharing_model_trains_on_two_gloo_ranks_as_one_process(tmp_path):
    """The profile's two stages are cut where a stage may start (at a layer that runs its indexer)."""
    assert_trains_as_one_process(tmp_path, f"hf:{write_config(tmp_path / 'glm52', GLM52)}")


@pytest.mark.parametrize("layout, refused_at", [("Ett|ttL", None), ("Et|tttL", 2), ("Ettt|tL", 4)])
def test_a_stage_starts_only_at_a_layer_that_runs_its_indexer(tmp_path, layout, refused_at):
    """Megatron-core refuses a pipeline layout whose stage would start at a layer reusing the top k of one in the
    stage before (`_validate_dsa_index_share_pipeline_split`); so does pipesim, in one line, writing nothing."""
    model = f"hf:{write_config(tmp_path / 'glm52', GLM52)}"
    code, out, err = pipesim("simulate", "--gpu", "h100-sxm", "--model", model, "--seq-len", S, "-b", 1, "-p", 2,
                             "-s", "1f1b", "--stage-cut", f"layout:{layout}", "--html", tmp_path / "t.html")
    if refused_at is None:
        assert code == 0, err
        return
    assert (code, out) == (2, "") and len(err.strip().splitlines()) == 1, err
    assert (f"a stage would start at layer {refused_at}, which reuses the top k a sparse attention before it kept, "
            "which no stage boundary passes on: start each stage at one of the 5 of the 7 layers that may (0, 1, 3, 5, "
            "6)") in err, err
    assert not (tmp_path / "t.html").exists()


def test_an_empty_stage_keeps_a_sharing_group_whole(tmp_path):
    """GLM-5.2's pretraining layout leaves stages empty so that each group of layers sharing a top k stays in one
    stage (Megatron-Bridge's glm52_pretrain_416gpu_h100_bf16_config): an empty stage's bound is the next stage's
    start, held to the same rule."""
    model = f"hf:{write_config(tmp_path / 'glm52', GLM52)}"
    args = ("--gpu", "h100-sxm", "--model", model, "--seq-len", S, "-b", 1, "-p", 3, "-s", "1f1b")
    (cut,) = simulate_json(*args, "--stage-cut", "layout:Ett||ttL")
    assert cut["stage_bounds"] == [0, 3, 3, 7]
    code, out, err = pipesim("simulate", *args, "--stage-cut", "layout:Et||tttL")
    assert (code, out) == (2, "") and "a stage would start at layer 2, which reuses the top k" in err, err
    # 6 stages, more than the 5 layers a stage may start at: a layout of another count is not pointed to balanced,
    # which cannot cut them either, and balanced names the layout
    six = ("-p", 3, "-s", "interleaved-1f1b", "--chunks", 2, "-m", 6)
    code, out, err = pipesim("simulate", *args[:-4], *six, "--stage-cut", "layout:Ett||ttL")
    assert code == 2 and "its 3 stages are not the schedule's 6 model stages" in err and "balanced" not in err, err
    code, out, err = pipesim("simulate", *args[:-4], *six, "--stage-cut", "balanced")
    assert code == 2 and ("give at most 5 stages, or a cut that may leave stages between the first and the last "
                          "empty (--stage-cut layout:STRING or layers:N,N,...)") in err, err


def test_the_executor_refuses_a_cut_that_starts_a_stage_at_a_layer_that_shares(tmp_path):
    from pipesim.executor import ExecutorError, RunSpec, cut
    from tests.conftest import build

    spec = RunSpec(build("1f1b", 2, 2, 1), f"hf:{write_config(tmp_path / 'glm52', GLM52)}", {"seq_len": S},
                   microbatch_size=1, bounds=[0, 2, 7])
    with pytest.raises(ExecutorError, match=r"cut at layers \[0, 2, 7\]: a stage would start at layer 2, which reuses"):
        cut(spec)


def test_a_float32_product_runs_at_the_parts_tf32_peak():
    """The per-head scores' products (`TF32_PRODUCT_KERNELS`) at the H100's 494.7 TFLOP/s of TF32, not its 989.4 of
    BF16; a part the catalogue gives no TF32 peak at its float32 one."""
    from pipesim.planning.estimate import op_ms
    from pipesim.profiles.workload import OpCount
    from tests.helpers import H100_BF16

    op = OpCount("bmm_fp32", "compute", (), flops=10**12, moved_bytes=0, count=1)
    curve = H100_BF16.curve
    assert op_ms(op, H100_BF16) == pytest.approx(curve.kernel_overhead_ms + 1e12 / (494.7e9 * curve.matmul_efficiency))


def test_count_says_where_a_stage_may_start_and_simulate_refuses_more_stages_than_that(tmp_path):
    model = f"hf:{write_config(tmp_path / 'glm52', GLM52)}"
    code, _, err = pipesim("count", "--model", model, "--seq-len", S)
    assert code == 0 and "a stage may start at 5 of the 7 layers, not at 2, 4: each reuses the top k a sparse " \
                          "attention before it kept" in err, err
    code, out, err = pipesim("simulate", "--gpu", "h100-sxm", "--model", model, "--seq-len", S, "-b", 1, "-p", 6,
                             "-s", "1f1b")
    assert (code, out) == (2, "") and len(err.strip().splitlines()) == 1, err
    assert "has 7 layers in all, 5 of which may start a stage (each other reuses the top k a sparse attention before " \
           "it kept, which no stage boundary passes on); give at most 5 stages" in err, err


def test_tune_cuts_a_top_k_sharing_model_only_where_a_stage_may_start(tmp_path):
    """tune searches at most as many stages as layers a stage may start at, and its choice's cut starts none at a
    layer that shares the top k before it; the command it prints runs."""
    model = f"hf:{write_config(tmp_path / 'glm52', GLM52)}"
    code, out, err = pipesim("tune", "--gpu", "h100-sxm", "--model", model, "--seq-len", S, "--devices", 6, "-b", 1)
    assert code == 0, err
    command = next(line.strip() for line in out.splitlines() if line.strip().startswith("pipesim simulate"))
    counts = [int(n) for n in command.split("--stage-cut layers:")[1].split()[0].split(",")]
    starts = {sum(counts[:k]) for k in range(1, len(counts))}
    assert not starts & {2, 4}, command
    code, _, err = pipesim(*command.split()[1:])
    assert code == 0, err


def test_glm_5_2_has_the_parameters_megatron_bridges_card_reloaded():
    """examples/glm-5.2: transformers reloads Megatron-Bridge's export of zai-org/GLM-5.2 with 743,377,000,704
    parameters (examples/model_verification_cards/glm5-2/card.yaml at 067f987df0): GLM-5's less the indexers of the
    57 layers that share (each a query projection from the 2,048-channel query latent to 32 heads of 128, a key
    projection from the 6,144-wide hidden state to 128 with its LayerNorm, and 32 head weights)."""
    from pathlib import Path

    from pipesim.workload.hf import hf_model

    root = Path(__file__).resolve().parents[1] / "examples"
    with torch.device("meta"):
        total = {name: sum(p.numel() for layer in hf_model(f"hf:{root / name}", 64).layers
                           for p in layer.parameters()) for name in ("glm-5", "glm-5.2")}
    indexer = 2048 * 32 * 128 + 6144 * 128 + 2 * 128 + 6144 * 32
    assert total["glm-5.2"] == 743_377_000_704 == total["glm-5"] - 57 * indexer
