"""NeMo AutoModel's H100 pre-training table (benchmarks/published/nemo-automodel-moe-h100.csv, run by
benchmarks/published_moe.py `automodel_runs` and recorded in benchmarks/published_moe.json): the CSV holds the
table as printed, its Qwen3-30B-A3B and 256-GPU DeepSeek-V3 rows are recorded with FSDP2's layout and their configs'
settings (their commands reproduce them: tests/test_published_moe.py), and the other rows are listed with why."""

from __future__ import annotations

import csv
import json
import shlex
from pathlib import Path

import pytest

from tests.helpers import flag_value as _flag

REPO = Path(__file__).resolve().parents[1]
SOURCE = "nemo-automodel-moe-h100.csv"
PUBLISHED = list(csv.DictReader((REPO / "benchmarks" / "published" / SOURCE).open()))
RECORDED = [row for row in json.loads((REPO / "benchmarks" / "published_moe.json").read_text())["rows"]
            if row["source"] == SOURCE]


def test_the_csv_holds_the_tables_rows_and_their_arithmetic():
    """docs/performance-summary.mdx at 36044ad3d: nine MoE rows; each GBS is GPUs / (t·p) x local batch x GA and
    each tokens/s per GPU GBS x sequence over the step and GPUs (to the table's rounding)."""
    assert len(PUBLISHED) == 9
    for row in PUBLISHED:
        gpus, t, p, batch, local, ga, seq = (int(row[k]) for k in ("gpus", "tensor_parallel", "pipeline_parallel",
                                                                   "global_batch", "local_batch_size",
                                                                   "gradient_accumulation", "seq_len"))
        assert batch == gpus // (t * p) * local * ga
        assert float(row["tokens_per_s_per_gpu"]) == pytest.approx(
            batch * seq / (float(row["step_time_s"]) * gpus), rel=2e-3)


def test_the_qwen3_row_runs_fsdp2_with_expert_parallelism_as_its_config_sets_it():
    """qwen3_moe_30b_te_deepep.yaml at 8d9bfb90e: 8 GPUs, EP 8, local batch 4, GA 16, every block checkpointed,
    DeepEP with FakeBalancedGate, the experts' grouped_gemm, torch's cross entropy and autograd's accumulation."""
    (row,) = [row for row in RECORDED if row["run"].startswith("AutoModel Qwen3")]
    args = shlex.split(row["command"])
    assert (_flag(args, "--data-parallel"), _flag(args, "--expert-parallel"), _flag(args, "-b"), _flag(args, "-m"),
            _flag(args, "-p")) == ("8", "8", "4", "16", "1")
    assert (_flag(args, "--zero"), _flag(args, "--precision"), _flag(args, "--recompute"),
            _flag(args, "--grad-accumulation")) == ("2", "nemo-bf16-adam", "full", "separate")
    assert (_flag(args, "--token-dispatcher"), _flag(args, "--routing"), _flag(args, "--expert-gemm"),
            _flag(args, "--cross-entropy"), _flag(args, "--rope-kernel")) == ("deepep", "balanced", "grouped",
                                                                              "torch", "eager")
    assert row["published_tokens_per_s_per_gpu"] == 12040.0
    assert "--pp-runtime" not in args


def test_the_256_gpu_deepseek_row_runs_autopipelines_cut_under_torchs_pipelining():
    """deepseek_v3_te_deepep.yaml at 89e3a9fdd: p 4, layers_per_stage 2, so ⌈61 / 2⌉ + 1 = 32 stages (v 8, the
    table's), 29 of two blocks then 3 of one, the embedding first and the head last; local batch 8 in micro-batches
    of 1; FSDP2's weights kept gathered by the pipeline stage through the step (ZeRO-3 in a pipeline)."""
    (row,) = [row for row in RECORDED if row["run"] == "AutoModel DeepSeek V3 671B 256 GPUs t1 p4 v8 E64"]
    args = shlex.split(row["command"])
    assert (_flag(args, "-p"), _flag(args, "--chunks"), _flag(args, "-m"), _flag(args, "--data-parallel"),
            _flag(args, "--expert-parallel")) == ("4", "8", "8", "64", "64")
    assert (_flag(args, "--zero"), _flag(args, "--pp-runtime"), _flag(args, "-s")) == ("3", "torch",
                                                                                     "interleaved-1f1b")
    stages = _flag(args, "--stage-cut").removeprefix("layout:E").removesuffix("L").split("|")
    assert [len(stage) for stage in stages] == [2] * 29 + [1] * 3 and "--mtp-layers" not in args
    assert row["published_tokens_per_s_per_gpu"] == 1002.0


def test_the_kimi_k2_row_runs_the_deepseek_rows_config_at_its_own_p_and_e():
    """kimi_k2_te_deepep.yaml at 89e3a9fdd is deepseek_v3_te_deepep.yaml there but for pp_size 8, ep_size 32 and the
    model (moonshotai/Kimi-K2-Base, AutoModel's DeepseekV3ForCausalLM): 61 blocks at layers_per_stage 2 make the
    same 32 stages, v 4 at p 8 (the table's); local batch 8, GA 2, so 16 micro-batches of 1 over d = 32, in two
    `schedule.step` calls of 8 each (`--rounds 2`), where the DeepSeek-V3 row's GA 1 runs one."""
    (row,) = [row for row in RECORDED if row["run"] == "AutoModel Kimi K2 256 GPUs t1 p8 v4 E32"]
    (deepseek,) = [row for row in RECORDED if row["run"] == "AutoModel DeepSeek V3 671B 256 GPUs t1 p4 v8 E64"]
    args, theirs = shlex.split(row["command"]), shlex.split(deepseek["command"])
    assert (_flag(args, "--model"), _flag(args, "-p"), _flag(args, "--chunks"), _flag(args, "-m"),
            _flag(args, "--data-parallel"), _flag(args, "--expert-parallel"),
            _flag(args, "--rounds")) == ("hf:examples/kimi-k2", "8", "4", "16", "32", "32", "2")
    assert "--rounds" not in theirs
    differing = {"--model", "-p", "--chunks", "-m", "--data-parallel", "--expert-parallel", "--rounds"}

    def rest(words: list[str]) -> list[str]:
        return [word for i, word in enumerate(words) if not {word, words[i - 1]} & differing]

    assert rest(args) == rest(theirs) and "--stage-cut" in rest(args)
    assert row["published_tokens_per_s_per_gpu"] == 924.0


def test_autopipelines_stage_count_is_its_rule(monkeypatch):
    """functional.py calculate_virtual_stages: ⌈L / n⌉ + 1 rounded down to a multiple of p: 32 at n = 2 and 16 at
    n = 4 (the 1,024-GPU config, whose v 4 the table prints as 8)."""
    monkeypatch.syspath_prepend(str(REPO / "benchmarks"))
    from published_moe import autopipeline_stages

    assert (autopipeline_stages(61, 2, 4), autopipeline_stages(61, 4, 4), autopipeline_stages(61, 3, 4)) == (32, 16, 20)


def test_the_other_rows_are_listed_with_why(monkeypatch, tmp_path):
    """Wherever it runs: the DeepSeek configs' blocks are read from the repository's examples/, not the cwd's."""
    monkeypatch.syspath_prepend(str(REPO / "benchmarks"))
    monkeypatch.chdir(tmp_path)
    from published_moe import automodel_runs

    expressible, left_out = automodel_runs()
    assert [run.name for run, _ in expressible] == [row["run"] for row in RECORDED]
    reasons = dict(left_out)
    assert len(left_out) == 5 and len(reasons) == 5
    assert all("not among examples/" in reasons[name] for name in (
        "AutoModel Nemotron V3 Super 120B (26.02) 64 GPUs t1 p1 v1 E64",
        "AutoModel Nemotron V3 Ultra 550B (26.04) 128 GPUs t1 p1 v1 E64"))
    assert "gptoss_120b_te_deepep.yaml" in reasons["AutoModel GPT-OSS 120B 64 GPUs t1 p1 v1 E-"]
    assert "gptoss_20b_te_deepep.yaml" in reasons["AutoModel GPT-OSS 20B 8 GPUs t1 p1 v1 E-"]
    assert all("FlexAttention" in reasons[f"AutoModel GPT-OSS {size}"] for size in ("120B 64 GPUs t1 p1 v1 E-",
                                                                                 "20B 8 GPUs t1 p1 v1 E-"))
    assert "cuts 16 stages, v 4" in reasons["AutoModel DeepSeek V3 671B 1024 GPUs t1 p4 v8 E64"]
