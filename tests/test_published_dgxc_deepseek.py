"""DGX Cloud's DeepSeek-V3 recipe on H100 (benchmarks/published/nvidia-dgxc-deepseek-v3-h100.csv, run by
benchmarks/published_moe.py and recorded in benchmarks/published_moe.json): the CSV holds the README's figures, each
row is recorded with its layout and NeMo's pretrain_deepseek_v3.py settings, and each command reproduces its row
(tests/test_published_moe.py)."""

from __future__ import annotations

import csv
import json
import shlex
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SOURCE = "nvidia-dgxc-deepseek-v3-h100.csv"
PUBLISHED = list(csv.DictReader((REPO / "benchmarks" / "published" / SOURCE).open()))
RECORDED = [row for row in json.loads((REPO / "benchmarks" / "published_moe.json").read_text())["rows"]
            if row["source"] == SOURCE]
DEEPSEEK_V3_LAYERS = 61


def _flag(args: list[str], flag: str) -> str:
    return args[args.index(flag) + 1]


def test_the_csv_holds_the_readmes_rows_and_their_own_arithmetic():
    """deepseek_v3/pretraining/README.md at 1f6d9f4: 48.948 and 52.04 s a step; its tokens/s are GBS x 4,096 over
    the step, and each layout's t·d·p its GPUs."""
    assert [(row["gpus"], row["step_time_s"]) for row in PUBLISHED] == [("512", "48.948"), ("1024", "52.04")]
    for row in PUBLISHED:
        t, p, d, gpus, batch, seq = (int(row[k]) for k in ("tensor_parallel", "pipeline_parallel", "data_parallel",
                                                           "gpus", "global_batch", "seq_len"))
        assert t * p * d == gpus and batch == d * int(row["microbatch_size"]) * int(row["gradient_accumulation"])
        assert float(row["tokens_per_s"]) == pytest.approx(batch * seq / float(row["step_time_s"]), abs=0.01)


def test_each_row_is_recorded_as_nemos_deepseek_v3_script_ran_it():
    """The MTP layer, 64 / p - 1 layers first and 64 / p - 2 last (the 61 in all), the recomputed MLA
    up-projections, the all-to-all dispatcher at capacity 1 padded (the token-drop callback), float32 gradients
    and RoPE unfused; the published tokens/s per GPU from the step."""
    assert len(RECORDED) == len(PUBLISHED) == 2
    for row, published in zip(RECORDED, PUBLISHED):
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
