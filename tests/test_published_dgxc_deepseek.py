"""DGX Cloud's MoE recipes on H100 (benchmarks/published/nvidia-dgxc-moe-h100.csv, run by benchmarks/published_moe.py
and recorded in benchmarks/published_moe.json): the CSV holds the READMEs' figures, each DeepSeek-V3 row is recorded
with its layout and NeMo's pretrain_deepseek_v3.py settings at its release and its command reproduces it
(tests/test_published_moe.py), and Llama 4 Maverick's rows as NeMo's pretrain_llama4_e128.py ran them."""

from __future__ import annotations

import csv
import json
import shlex
from pathlib import Path

import pytest

from tests.helpers import flag_value as _flag

REPO = Path(__file__).resolve().parents[1]
SOURCE = "nvidia-dgxc-moe-h100.csv"
EVERY_PUBLISHED = list(csv.DictReader((REPO / "benchmarks" / "published" / SOURCE).open()))
# the rows of DGX Cloud's v25.05.04 (1f6d9f4) that pretrain_deepseek_v3.py at NeMo 7a8f1cc7bc ran, and v25.08.01's
# (2fc17d4), which it ran at NeMo 9244b1ec89
PUBLISHED = [row for row in EVERY_PUBLISHED if row["workload"] == "deepseek_v3" and row["release"] == "1f6d9f4"]
[V25_08] = [row for row in EVERY_PUBLISHED if row["workload"] == "deepseek_v3" and row["release"] == "2fc17d4"]
RECORDED = [row for row in json.loads((REPO / "benchmarks" / "published_moe.json").read_text())["rows"]
            if row["source"] == SOURCE]
DEEPSEEK_V3_LAYERS = 61


def test_the_csv_holds_the_readmes_rows_and_their_own_arithmetic():
    """deepseek_v3/pretraining/README.md and llama4/README.md at 1f6d9f4: DeepSeek-V3 48.948 and 52.04 s a step,
    Llama 4 Maverick 4.426 (BF16) and 3.855 (FP8); deepseek_v3/pretrain/README.md at 2fc17d4 (v25.08.01): 36.189 s on
    1,024 GPUs at t1 p8 v2; each README's tokens/s is GBS x sequence over the step (to the figure it prints for
    DeepSeek-V3, within 0.03 % for Llama 4), and each layout's t·d·p its GPUs."""
    assert [(row["workload"], row["gpus"], row["step_time_s"], row["release"]) for row in EVERY_PUBLISHED] == [
        ("deepseek_v3", "512", "48.948", "1f6d9f4"), ("deepseek_v3", "1024", "52.04", "1f6d9f4"),
        ("deepseek_v3", "1024", "36.189", "2fc17d4"), ("llama4", "512", "4.426", "1f6d9f4"),
        ("llama4", "512", "3.855", "1f6d9f4")]
    for row in EVERY_PUBLISHED:
        t, p, d, gpus, batch, seq = (int(row[k]) for k in ("tensor_parallel", "pipeline_parallel", "data_parallel",
                                                           "gpus", "global_batch", "seq_len"))
        assert t * p * d == gpus and batch == d * int(row["microbatch_size"]) * int(row["gradient_accumulation"])
        assert float(row["tokens_per_s"]) == pytest.approx(batch * seq / float(row["step_time_s"]), rel=3e-4)
    # DeepSeek-V3's two rows do the same work a GPU (GBS 8 a GPU): step x TFLOPS_per_GPU 8,518 and 8,519 TFLOP
    first, second = (float(row["step_time_s"]) * float(row["tflops_per_gpu"]) for row in PUBLISHED)
    assert first == pytest.approx(second, rel=2e-4)


def test_each_row_is_recorded_as_nemos_deepseek_v3_script_ran_it():
    """The MTP layer, 64 / p - 1 layers first and 64 / p - 2 last (the 61 in all), the recomputed MLA
    up-projections, the all-to-all dispatcher at capacity 1 padded (the token-drop callback), float32 gradients
    and RoPE unfused; the published tokens/s per GPU from the step."""
    assert len(RECORDED) == len(PUBLISHED) + 3 == 5
    for row, published in zip([row for row in RECORDED if "DeepSeek-V3 BF16 t2 " in row["run"]], PUBLISHED,
                              strict=True):
        args = shlex.split(row["command"])
        t, p, e, d, gpus, batch, seq = (int(published[k]) for k in (
            "tensor_parallel", "pipeline_parallel", "expert_parallel", "data_parallel", "gpus", "global_batch",
            "seq_len"))
        assert (_flag(args, "--tensor-parallel"), _flag(args, "-p"), _flag(args, "--expert-parallel"),
                _flag(args, "--data-parallel"), _flag(args, "-s")) == (str(t), str(p), str(e), str(d), "1f1b")
        first, last = (int(n) for n in _flag(args, "--stage-cut").removeprefix("first-last:").split(","))
        assert (first, last) == (64 // p - 1, 64 // p - 2) and first + last + (p - 2) * (64 // p) == DEEPSEEK_V3_LAYERS
        assert (_flag(args, "--mtp-layers"), _flag(args, "--recompute-modules")) == ("1", "mla_up_proj")
        assert (_flag(args, "--routing"), _flag(args, "--capacity-factor")) == ("balanced", "1")
        assert "--token-dispatcher" not in args
        assert (_flag(args, "--dtype"), _flag(args, "--precision"), _flag(args, "--rope-kernel")) == (
            "bf16", "megatron", "eager")
        assert row["published_tokens_per_s_per_gpu"] == pytest.approx(
            batch * seq / (float(published["step_time_s"]) * gpus), rel=1e-12)


def test_every_row_runs_as_recorded(monkeypatch):
    """Each of the CSV's rows is run (none left out since Llama 4 could be counted and graphed), in its order."""
    monkeypatch.syspath_prepend(str(REPO / "benchmarks"))
    from published_moe import dgxc_runs

    expressible, left_out = dgxc_runs()
    assert [run.name for run, _ in expressible] == [row["run"] for row in RECORDED] and left_out == []
    assert len(expressible) == len(EVERY_PUBLISHED)


@pytest.mark.parametrize("precision", ["BF16", "FP8"])
def test_llama_4_maverick_runs_as_its_launch_ran_it(precision):
    """llama4/launch.sh at 1f6d9f4 runs VP 1 (the README prints 12), CUDA graphs in FP8 only; NeMo's
    pretrain_llama4_e128.py at 7a8f1cc7bc: t4 with sequence parallelism and userbuffers, E128 at expert t 4, the
    all-to-all dispatcher at the token-drop callback's capacity 1 padded, no load-balancing loss (coefficient 0),
    fused RoPE, 16-bit gradient reduction; FP8 in delayed scaling (bf16_with_fp8_mixed), every layer graphed."""
    [row] = [row for row in RECORDED if row["run"] == f"DGXC Llama 4 Maverick {precision} t4 p1 v1 E128"]
    [published] = [row for row in EVERY_PUBLISHED if row["workload"] == "llama4" and row["precision"] == precision]
    args = shlex.split(row["command"])
    assert _flag(args, "--model") == "hf:examples/llama4-maverick-17b-128e"
    assert (_flag(args, "--tensor-parallel"), _flag(args, "-p"), _flag(args, "-s"), _flag(args, "--expert-parallel"),
            _flag(args, "--expert-tensor-parallel"), _flag(args, "--data-parallel"), _flag(args, "-m")) == (
        "4", "1", "1f1b", "128", "4", "128", "8")
    assert {"--sequence-parallel", "--tp-overlap"} <= set(args) and "--chunks" not in args
    assert (_flag(args, "--routing"), _flag(args, "--capacity-factor"), "--token-dispatcher" in args,
            "--router-aux-loss" in args, "--recompute-modules" in args) == ("balanced", "1", False, False, False)
    assert (_flag(args, "--precision"), _flag(args, "--rope-kernel")) == ("megatron-16bit-grads", "fused")
    if precision == "FP8":
        assert (_flag(args, "--dtype"), _flag(args, "--fp8-recipe"), _flag(args, "--cuda-graphs")) == (
            "fp8", "te", "full")
    else:
        assert _flag(args, "--dtype") == "bf16" and "--cuda-graphs" not in args
    assert row["published_tokens_per_s_per_gpu"] == pytest.approx(
        int(published["global_batch"]) * int(published["seq_len"]) / (float(published["step_time_s"]) * 512),
        rel=1e-12)


def test_v25_08_runs_as_its_release_ran_it():
    """v25.08.01's H100 launch (deepseek_v3/pretrain/launch.sh at 2fc17d4: t1 p8 v2 E64, "mla_up_proj mlp moe")
    through pretrain_deepseek_v3.py at NeMo 9244b1ec89: the script's layout of 16 chunks (the embedding and 4
    blocks, 14 of 4, then a block, the MTP layer and the loss), DeepEP with forced balance and no token drop on H100,
    the MLA RoPE fused, 16-bit gradient reduction, the aux loss unfused; its exchanges overlapped (v > 1)."""
    [row] = [row for row in RECORDED if row["run"] == "DGXC DeepSeek-V3 BF16 t1 p8 v2 E64"]
    args = shlex.split(row["command"])
    layout = _flag(args, "--stage-cut").removeprefix("layout:")
    assert layout == "Etttt|(tttt|)*14tmL" and 4 + 14 * 4 + 1 == DEEPSEEK_V3_LAYERS
    assert (_flag(args, "--tensor-parallel"), _flag(args, "-p"), _flag(args, "--chunks"), _flag(args, "-s"),
            _flag(args, "--expert-parallel"), _flag(args, "--data-parallel"), _flag(args, "-m")) == (
        "1", "8", "2", "interleaved-1f1b", "64", "128", "64")
    assert (_flag(args, "--recompute-modules"), _flag(args, "--mtp-layers")) == ("mla_up_proj,mlp,moe", "1")
    assert (_flag(args, "--token-dispatcher"), _flag(args, "--routing"), "--capacity-factor" in args) == (
        "deepep", "random", False)
    assert (_flag(args, "--precision"), _flag(args, "--rope-kernel"), _flag(args, "--router-aux-loss")) == (
        "megatron-16bit-grads", "fused", "unfused")
    assert "--p2p-sync" not in args and "--sequence-parallel" not in args
    assert row["published_tokens_per_s_per_gpu"] == pytest.approx(
        int(V25_08["global_batch"]) * int(V25_08["seq_len"]) / (float(V25_08["step_time_s"]) * 1024), rel=1e-12)
