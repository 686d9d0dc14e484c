"""The Megatron MoE Model Zoo's H100 table (benchmarks/published/megatron-moe-modelzoo-h100.csv, run by
benchmarks/published_moe.py and recorded in benchmarks/published_moe.json): the CSV holds the table as printed, every
expressible row is recorded with its step time and its whole layout, the others are listed with why, and each
recorded command runs and reproduces its prediction (tests/test_published_moe.py)."""

from __future__ import annotations

import csv
import json
import shlex
from pathlib import Path

import pytest

from tests.helpers import flag_value as _flag

REPO = Path(__file__).resolve().parents[1]
SOURCE = "megatron-moe-modelzoo-h100.csv"
PUBLISHED = list(csv.DictReader((REPO / "benchmarks" / "published" / SOURCE).open()))
RECORDED = [row for row in json.loads((REPO / "benchmarks" / "published_moe.json").read_text())["rows"]
            if row["source"] == SOURCE]
EXPRESSIBLE = [row for row in PUBLISHED if row["fsdp"] != "On"]
QWEN3_235B_LAYERS = 94
# each model's config, and the layers its run cuts evenly over the p·v chunks: the 235B's counting the embedding and
# the loss as one each (its first and last chunks one block short), Qwen3-Next's blocks alone
MODELS = {"235B": ("hf:examples/qwen3-235b-a22b", QWEN3_235B_LAYERS + 2),
          "Next-80B-A3B": ("hf:examples/qwen3-next-80b-a3b", 48)}
RECOMPUTED = {"norm, act": "layernorm,moe_act", "norm, act, shared_expert": "layernorm,moe_act,shared_experts",
              "": ""}


def test_the_csv_holds_the_tables_rows_and_each_layout_covers_its_gpus():
    """best_practice/Qwen3/readme.md at b0b92ff: six rows, their step times and TFLOP/s as printed; each row's
    t·C·d·p is its GPUs and its experts' E·ETP·EDP the t·C·d of a stage (Megatron-core's folding)."""
    assert [(row["model"], row["step_time_s"], row["per_gpu_tflops"]) for row in PUBLISHED] == [
        ("235B", "19.7", "245"), ("235B", "17.6", "276"), ("235B", "17.6", "276"), ("235B", "24.2", "200"),
        ("235B", "29.0", "167"), ("Next-80B-A3B", "2.2", "89")]
    for row in PUBLISHED:
        t, c, d, p, e, etp, edp, gpus = (int(row[k]) for k in (
            "tensor_parallel", "context_parallel", "data_parallel", "pipeline_parallel", "expert_parallel",
            "expert_tensor_parallel", "expert_data_parallel", "gpus"))
        assert t * c * d * p == gpus and e * etp * edp == t * c * d
        assert int(row["global_batch"]) == d * int(row["microbatch_size"]) * int(row["gradient_accumulation"])
    # the 235B rows run the same step's FLOPs (GBS 2048 of 4,096 tokens on 256 GPUs): step x TFLOP/s a GPU agrees to
    # the rounding of the printed figures, 4,827-4,858 TFLOP a GPU
    work = [float(row["step_time_s"]) * float(row["per_gpu_tflops"]) for row in PUBLISHED if row["model"] == "235B"]
    assert max(work) / min(work) < 1.007


def test_every_expressible_row_is_recorded_with_its_step_and_layout():
    """Each command runs the row's columns: its model, t, p, v, E, d and micro-batches (GA), BF16 with Megatron-LM's
    float32 gradients, its dispatcher, its recomputed modules, the expert overlap on the "+1f1b overlap" row, forced
    balance, and the 235B's embedding and loss counted as a layer each in the cut ((94 + 2) / (p·v) a chunk), where
    Qwen3-Next's 48 blocks are cut evenly, with its MTP layer and no gradient-reduce overlap (its yaml's)."""
    assert len(RECORDED) == len(EXPRESSIBLE) == 5
    for row, published in zip(RECORDED, EXPRESSIBLE):
        args = shlex.split(row["command"])
        t, p, v, e, d, b, m, gpus, batch, seq = (int(published[k]) for k in (
            "tensor_parallel", "pipeline_parallel", "virtual_pipeline", "expert_parallel", "data_parallel",
            "microbatch_size", "gradient_accumulation", "gpus", "global_batch", "seq_len"))
        model, split = MODELS[published["model"]]
        assert (_flag(args, "--model"), _flag(args, "--dtype"), _flag(args, "--precision")) == (
            model, "bf16", "megatron")
        assert (_flag(args, "--tensor-parallel"), _flag(args, "-p"), _flag(args, "--chunks"),
                _flag(args, "--expert-parallel"), _flag(args, "--data-parallel")) == tuple(map(str, (t, p, v, e, d)))
        assert (_flag(args, "-b"), _flag(args, "-m"), _flag(args, "--seq-len")) == (str(b), str(m), str(seq))
        next_80b = published["model"] == "Next-80B-A3B"
        per_chunk = split // (p * v)
        assert _flag(args, "--stage-cut") == ("equal-blocks" if next_80b else
                                              f"first-last:{per_chunk - 1},{per_chunk - 1}")
        assert (_flag(args, "--mtp-layers") if "--mtp-layers" in args else "0", "--reduce-after-flush" in args) == (
            ("1", True) if next_80b else ("0", False))
        assert (_flag(args, "--token-dispatcher") if "--token-dispatcher" in args else "A2A") == (
            "deepep" if published["dispatcher"] == "DeepEP" else "A2A")
        assert ("--overlap-expert-comm" in args) == (published["notes"] == "+1f1b overlap")
        assert (_flag(args, "--recompute-modules") if "--recompute-modules" in args else "") == (
            RECOMPUTED[published["recompute"]])
        assert _flag(args, "--routing") == "random"
        assert row["published_tokens_per_s_per_gpu"] == pytest.approx(
            batch * seq / (float(published["step_time_s"]) * gpus), rel=1e-12)
        assert row["predicted_tokens_per_s_per_gpu"] == pytest.approx(
            batch * seq / (row["command_ms"] / 1e3 * gpus), rel=1e-12)
        assert not row["memory"]["out_of_memory"], row["run"]


def test_the_rows_pipesim_cannot_express_are_listed_with_why(monkeypatch):
    """The Megatron-FSDP row, whose sharding the table does not give (Qwen3-Next's, once refused for its Gated
    DeltaNet layers, runs)."""
    monkeypatch.syspath_prepend(str(REPO / "benchmarks"))
    from published_moe import modelzoo_runs

    expressible, left_out = modelzoo_runs()
    assert [run.name for run, _ in expressible] == [row["run"] for row in RECORDED]
    assert [(name, "Megatron-FSDP" in why) for name, why in left_out] == [("Model Zoo 235B DeepEP t2 p1 v1 E8", True)]


def test_each_rows_router_loss_is_its_csv_column_and_a_bad_one_is_refused_naming_where(monkeypatch):
    """The router_aux_loss column (benchmarks/published/README.md: each value's source) is what each row's command
    passes; a value outside none|unfused|fused is refused naming the file, its line and the column."""
    monkeypatch.syspath_prepend(str(REPO / "benchmarks"))
    import published_moe

    expressible, _ = published_moe.modelzoo_runs()
    assert [run.router_aux_loss for run, _ in expressible] == ["fused", "fused", "unfused", "fused", "fused"]
    bad = [dict(row, router_aux_loss="fuzed") if row["notes"] == "+1f1b overlap" else row for row in PUBLISHED]
    monkeypatch.setattr(published_moe, "_rows", lambda name: bad if name == SOURCE else [])
    with pytest.raises(ValueError, match=rf"^{SOURCE} line 3, column router_aux_loss: 'fuzed', not one of none"):
        published_moe.modelzoo_runs()
