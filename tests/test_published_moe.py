"""NVIDIA's published MoE throughput on H100 (benchmarks/published_moe.py and the rows it recorded in
benchmarks/published_moe.json): every expressible row is recorded with the CSV's figure, its layout, Megatron-core's
rank order with its recipe's expert-tensor-parallel size and its recipe's token dispatcher, and a row's printed
command reproduces its recorded prediction and the parts of its step."""

from __future__ import annotations

import csv
import json
import shlex
from pathlib import Path

import pytest

from tests.conftest import simulate_json
from tests.helpers import flag_value as _flag

REPO = Path(__file__).resolve().parents[1]
SOURCE = "nemo-megatron-bridge-moe-h100.csv"
EVERY_RECORDED = json.loads((REPO / "benchmarks" / "published_moe.json").read_text())["rows"]
# Megatron-Bridge's rows; the other sources': tests/test_published_modelzoo.py, tests/test_published_dgxc_deepseek.py
RECORDED = [row for row in EVERY_RECORDED if row["source"] == SOURCE]
PUBLISHED = list(csv.DictReader((REPO / "benchmarks" / "published" / SOURCE).open()))
DEEPSEEK = "25.09 DeepSeekV3 (dropless) t2 p8 v4 E64"  # run as v0.1.0rc4's run_script.py ran its H100 recipe
NANO = "Nemotron_3_Nano"  # a Mamba-2 hybrid, run as its H100 FP8-CS recipe runs it (published_moe.py `NANO_RECIPE`)


# (container, model) -> (t, p, v, E, micro-batch): the rows run as their release's recipe ran them (published_moe.py
# `RELEASE_LAYOUTS`): 26.02.01 is Megatron-Bridge r0.3.1, whose H100 FP8-CS recipe for the 30B is t1 p1 E16; 25.11's
# (v0.2.x) is p2 v12 at MBS 1, 25.09's (v0.1.0rc4) p2 v12 at MBS 2, where both rows print MBS 2 and VP 24; 25.11's
# gpt-oss-120b recipe runs MBS 1 where its row prints 4
RELEASE_LAYOUTS = {("26.02.01", "Qwen3_30B_a3B"): (1, 1, 1, 16, 1), ("25.11", "Qwen3_30B_a3B"): (1, 2, 12, 8, 1),
                   ("25.09", "Qwen3_30B_a3B (tokendrop)"): (1, 2, 12, 8, 2), ("25.11", "GPT OSS 120B"): (1, 4, 1, 8, 1)}


def test_every_row_is_recorded_with_its_figure_and_layout():
    """Each row's command runs the row's columns, or its release's recipe's layout where that differs."""
    assert len(PUBLISHED) == len(RECORDED) == 23
    for row, published in zip(RECORDED, PUBLISHED, strict=True):
        args = shlex.split(row["command"])
        t, p, e, gpus = (int(published[k]) for k in ("tensor_parallel", "pipeline_parallel", "expert_parallel",
                                                     "gpus"))
        chunks = "1" if published["virtual_pipeline"] == "n/a" else published["virtual_pipeline"]
        b = int(published["microbatch_size"])
        if (published["container"], published["model"]) in RELEASE_LAYOUTS:
            t, p, v, e, b = RELEASE_LAYOUTS[published["container"], published["model"]]
            chunks = str(v)
        d = gpus // (t * p)
        assert row["published_tokens_per_s_per_gpu"] == float(published["tokens_per_s_per_gpu"])
        assert (_flag(args, "--tensor-parallel"), _flag(args, "-p"), _flag(args, "--data-parallel"),
                _flag(args, "--expert-parallel")) == (str(t), str(p), str(d), str(e))
        assert _flag(args, "-b") == str(b) and int(_flag(args, "-m")) * d * b == int(published["global_batch"])
        gpt_oss = published["model"] == "GPT OSS 120B"  # BF16, recomputing its norms and experts' activation
        assert _flag(args, "--seq-len") == published["sequence_length"] and _flag(args, "--dtype") == (
            "bf16" if gpt_oss else "fp8")
        nano = published["model"] == NANO
        assert (_flag(args, "--recompute-modules") if "--recompute-modules" in args else None) == (
            "layernorm,moe_act" if gpt_oss else "mla_up_proj,mlp" if row["run"] == DEEPSEEK
            else "moe,layernorm,moe_act" if nano else None)
        assert (_flag(args, "--rank-order"), _flag(args, "--expert-tensor-parallel")) == ("megatron", "1")
        assert _flag(args, "--expert-gemm") == "per-expert"  # TEGroupedMLP: a GEMM per local expert
        # forced balance draws each token's experts (random), but the token-drop runs pad each expert to its share
        assert _flag(args, "--routing") == ("balanced" if "(tokendrop)" in published["model"] else "random")
        # and drop past capacity 1, padded to it (apply_moe_token_drop's defaults); the others drop nothing
        assert (_flag(args, "--capacity-factor") if "--capacity-factor" in args else None) == (
            "1" if "(tokendrop)" in published["model"] else None)
        assert (_flag(args, "--chunks") if "--chunks" in args else "1") == chunks
        # the recipes that ran HybridEP (t1 p1 E16) or DeepEP (26.02's p2 v12; 25.11's ran NCCL's all-to-all)
        hybridep = (p, chunks, e) == (1, "1", 16) or nano
        deepep = (published["container"], p, chunks, e) == ("26.02", 2, "12", 8) or row["run"] == DEEPSEEK
        assert (_flag(args, "--token-dispatcher") if "--token-dispatcher" in args else None) == (
            "hybridep" if hybridep else "deepep" if deepep else None)
        predicted = int(published["global_batch"]) * int(published["sequence_length"]) / (
            row["command_ms"] / 1e3 * gpus)
        assert row["predicted_tokens_per_s_per_gpu"] == pytest.approx(predicted, rel=1e-12)


@pytest.mark.parametrize("run", ["26.04.01 Qwen3_30B_a3B t1 p1 v1 E16", "26.02 Qwen3_30B_a3B t1 p2 v12 E8",
                                 "26.04.01 GPT OSS 120B t1 p4 v1 E8", DEEPSEEK,
                                 "25.11 Qwen3_235B_a22B t2 p8 v4 E32", "25.11 Qwen3_30B_a3B t1 p2 v12 E8",
                                 "25.09 Qwen3_30B_a3B (tokendrop) t1 p2 v12 E8", f"26.06 {NANO} t1 p1 v1 E8",
                                 *(row["run"] for row in EVERY_RECORDED if row["source"] != SOURCE)])
def test_a_moe_row_is_reproduced_by_its_printed_command(run, monkeypatch):
    """Seven of Megatron-Bridge's rows and every row of the other sources. The 235B row runs Megatron-core's
    overlapped pairs, each leaving its layers' all-to-alls exposed as their nodes' order does (planning/experts.py
    `paired_exposed_ms`)."""
    monkeypatch.chdir(REPO)  # the command names its config as examples/, from the repository root
    (row,) = [r for r in EVERY_RECORDED if r["run"] == run]
    args = shlex.split(row["command"])
    assert args[:2] == ["pipesim", "simulate"]
    (result,) = simulate_json(*args[2:])
    assert result["time_per_minibatch_ms"] == pytest.approx(row["command_ms"], rel=1e-9)
    fullest = max(result["devices"], key=lambda device: device["peak_memory_mb"])
    assert fullest["peak_memory_mb"] == pytest.approx(row["memory"]["peak_mib"], rel=1e-9)
    assert fullest["out_of_memory"] == row["memory"]["out_of_memory"]
    assert row["error"] == pytest.approx(row["predicted_tokens_per_s_per_gpu"]
                                         / row["published_tokens_per_s_per_gpu"] - 1, rel=1e-12)
    parts = row["parts"]
    slowest = next(device for device in result["devices"] if device["device"] == parts["device"])
    assert parts["compute_ms"] == pytest.approx(slowest["busy_ms"] / result["minibatches"], rel=1e-9)
    assert parts["compute_ms"] + parts["exposed_comm_ms"] + parts["idle_ms"] == pytest.approx(row["command_ms"])


def test_the_rows_whose_recipe_sets_moe_a2a_overlap_run_megatron_cores_expert_overlap():
    """Qwen3-235B-A22B from 25.11 on (25.09's recipe sets none), the 30B's p2 v12 layout as 25.11 and 26.02 ran it
    (25.09's p2 v12 recipe sets none, and 26.02.01 runs r0.3.1's E16 recipe, which sets none) and 25.09's
    DeepSeek-V3 (run_script.py's A2A_1F1B on H100): benchmarks/published_moe.py `A2A_OVERLAP`, each with its recipe
    line."""
    overlapped = {row["run"] for row in RECORDED if "--overlap-expert-comm" in shlex.split(row["command"])}
    assert overlapped == {f"{container} {model}" for container, model in (
        ("26.04.01", "Qwen3_235B_a22B t2 p8 v4 E32"), ("26.04", "Qwen3_235B_a22B t2 p8 v4 E32"),
        ("26.02.01", "Qwen3_235B_a22B t2 p8 v4 E32"), ("26.02", "Qwen3_235B_a22B t2 p8 v4 E32"),
        ("25.11", "Qwen3_235B_a22B t2 p8 v4 E32"), ("26.02", "Qwen3_30B_a3B t1 p2 v12 E8"),
        ("25.11", "Qwen3_30B_a3B t1 p2 v12 E8"))} | {DEEPSEEK}


def test_deepseek_v3_runs_its_recipes_layout_mtp_layer_and_unoverlapped_gradient_reduce():
    """25.09's DeepSeek-V3 row: run_script.py's H100 layout (Megatron-core's "Et|(tt|)*30mL": 32 stages, p·v = 8 x 4),
    deepseek_v3.py's MTP layer and overlap_grad_reduce False (published_moe.py `RECIPE_RUNS`); no other row sets
    them."""
    commands = {row["run"]: shlex.split(row["command"]) for row in RECORDED}
    set_by = {run: [flag for flag in ("--mtp-layers", "--reduce-after-flush") if flag in args]
              + ["layout"] * _flag(args, "--stage-cut").startswith("layout:") for run, args in commands.items()}
    assert {run for run, flags in set_by.items() if flags} == {DEEPSEEK}
    args = commands[DEEPSEEK]
    assert set_by[DEEPSEEK] == ["--mtp-layers", "--reduce-after-flush", "layout"]
    assert (_flag(args, "--stage-cut"), _flag(args, "--mtp-layers")) == ("layout:Et|(tt|)*30mL", "1")
    assert (_flag(args, "-p"), _flag(args, "--chunks"), _flag(args, "--fp8-recipe")) == ("8", "4", "te")


def test_every_layout_fits_as_megatron_core_holds_it():
    """Every recipe keeps 16-bit gradients (grad_reduce_in_fp32 False: Qwen3's, gpt-oss's and 25.09's DeepSeek-V3's
    run), and the routed experts keep what Megatron-core's TEGroupedMLP keeps with its fused SwiGLU
    (tests/test_moe.py): Qwen3-30B-A3B's t1 p1 E16 and t1 p2 v12 E8 layouts and Qwen3-235B-A22B's fit in 80 GB as
    they ran (before: 96,141, 89,140 and 118,730 MiB; unfused SwiGLU, 235B: 83,276 and 85,020 with the recipe's
    expert overlap), gpt-oss-120b's t1 p4 E8 too (58,076 MiB, recomputing its norms and its experts' activation),
    and 25.09's DeepSeek-V3 (62,070 MiB). The 30B at MBS 2 (25.09's) fits with TransformerEngine's norms and
    Megatron-core's cross entropy (`--norm-kernel fused`, `--cross-entropy megatron`; 97,952 MiB over 24 chunks with
    transformers' eager RMSNorm and aten's cross entropy)."""
    for row in RECORDED:
        args = shlex.split(row["command"])
        assert _flag(args, "--precision") == "megatron-16bit-grads"
        assert (_flag(args, "--norm-kernel"), _flag(args, "--cross-entropy")) == ("fused", "megatron")
        assert not row["memory"]["out_of_memory"], row["run"]


def test_every_row_rotates_q_and_k_with_transformer_engines_fused_rope():
    """Every release's Megatron-Bridge performance script sets apply_rope_fusion (published_moe.py's docstring):
    each row's command prices RoPE as TransformerEngine's kernel (`--rope-kernel fused`, workload/rope.py), but
    Nemotron 3 Nano's, whose model rotates nothing (position_embedding_type "none")."""
    for row in RECORDED:
        assert _flag(shlex.split(row["command"]), "--rope-kernel") == (
            "eager" if NANO in row["run"] else "fused"), row["run"]


def test_nemotron_3_nano_runs_its_recipes_graphs_recomputation_and_dispatcher():
    """Megatron-Bridge's Nemotron 3 Nano H100 FP8-CS recipe, the same from v0.3.1 to v0.5.0: its Mamba-2 layers in
    TransformerEngine's CUDA graphs, each MoE layer recomputed whole with its norms and experts' activation beside the
    core attention (selective), flex over HybridEP with forced balance, no expert overlap, the aux loss unfused."""
    rows = [row for row in RECORDED if NANO in row["run"]]
    assert [row["run"].split()[0] for row in rows] == ["26.06", "26.04.01", "26.04", "26.02.01"]
    for row in rows:
        args = shlex.split(row["command"])
        assert (_flag(args, "--cuda-graphs"), _flag(args, "--recompute"), _flag(args, "--token-dispatcher"),
                _flag(args, "--routing"), _flag(args, "--router-aux-loss"), _flag(args, "--fp8-recipe")) == (
            "mamba", "selective", "hybridep", "random", "unfused", "te-current")
        assert "--overlap-expert-comm" not in args and not row["memory"]["out_of_memory"]


# NeMo AutoModel's own Nemotron V3 model runs torch's linears and scaled dot product attention (`AUTOMODEL_KERNELS`)
OWN_KERNELS = "AutoModel Nemotron V3 Nano 30B (26.02) 8 GPUs t1 p1 v1 E8"


def test_every_sources_row_runs_cudnns_fused_attention():
    """TransformerEngine prefers cuDNN's fused attention to FlashAttention on Hopper wherever both are enabled and
    cuDNN takes the shape (published_moe.py `ATTENTION_KERNEL`): every source's rows ran it, the Model Zoo's with no
    --attention-backend (Megatron-core's auto), DeepSeek-V3's because MLA's unequal head dims (q and k 192, v 128)
    leave FlashAttention out, gpt-oss's because its sinks do, NeMo AutoModel's through its backend's attn "te" but
    for its Nemotron V3 model's torch attention, FlashAttention-2's."""
    assert len({row["source"] for row in EVERY_RECORDED}) == 5
    for row in EVERY_RECORDED:
        kernel = "flash2" if row["run"] == OWN_KERNELS else "cudnn"
        assert _flag(shlex.split(row["command"]), "--attention-kernel") == kernel, row["run"]


def test_every_sources_row_runs_transformer_engines_linear_layers():
    """Every source's run built Megatron-core's layers from TransformerEngine's modules (published_moe.py's
    docstring): each row's command says so (`--linear-kernel te`, planning/te.py), so gpt-oss-120b's BF16 rows take
    their attention input projection's bias gradient from its weight-gradient product, no sum of its own; NeMo
    AutoModel's through its backend's linear "te", but for its Nemotron V3 model's torch nn.Linear projections."""
    assert len({row["source"] for row in EVERY_RECORDED}) == 5
    for row in EVERY_RECORDED:
        kernel = "eager" if row["run"] == OWN_KERNELS else "te"
        assert _flag(shlex.split(row["command"]), "--linear-kernel") == kernel, row["run"]
