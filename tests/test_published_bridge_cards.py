"""Megatron-Bridge's skill and model card runs on H100 (benchmarks/published/megatron-bridge-cards-moe-h100.csv,
benchmarks/published_moe.py `card_runs`): each expressible run recorded with its step and its whole layout as
the command's flags, the rest listed with why."""

from __future__ import annotations

import csv
import json
import shlex
from pathlib import Path

from tests.helpers import flag_value as _flag

REPO = Path(__file__).resolve().parents[1]
CARDS = "megatron-bridge-cards-moe-h100.csv"
RECORDED = [row for row in json.loads((REPO / "benchmarks" / "published_moe.json").read_text())["rows"]
            if row["source"] == CARDS]
PUBLISHED = list(csv.DictReader((REPO / "benchmarks" / "published" / CARDS).open()))


def test_each_run_without_the_overlap_is_recorded_with_its_step_and_layout():
    runs = [row for row in PUBLISHED if row["expert_overlap"] == "off" and row["routing"] == "forced"]
    assert len(RECORDED) == len(runs) == 2
    for row, recorded in zip(runs, RECORDED):
        args = shlex.split(recorded["command"])
        gpus, t, p = int(row["gpus"]), int(row["tensor_parallel"]), int(row["pipeline_parallel"])
        data, micro = gpus // (t * p), int(row["microbatch_size"])
        assert (_flag(args, "--tensor-parallel"), _flag(args, "-p"), _flag(args, "--expert-parallel"),
                _flag(args, "--data-parallel"), _flag(args, "-b"), _flag(args, "--seq-len")) == (
            row["tensor_parallel"], row["pipeline_parallel"], row["expert_parallel"], str(data), str(micro),
            row["seq_len"])
        assert int(_flag(args, "-m")) * data * micro == int(row["global_batch"])
        assert (_flag(args, "--chunks") or "1") == row["virtual_pipeline"]
        assert _flag(args, "--dtype") == "bf16" and _flag(args, "--token-dispatcher") == row["dispatcher"]
        assert "--overlap-expert-comm" not in args
        assert recorded["published_tokens_per_s_per_gpu"] == int(row["global_batch"]) * int(row["seq_len"]) / (
            float(row["step_time_s"]) * gpus)


def test_the_overlap_without_delayed_weight_gradients_and_the_run_without_a_layout_are_listed_with_why(monkeypatch):
    monkeypatch.syspath_prepend(str(REPO / "benchmarks"))
    import published_moe

    left_out = dict(published_moe.card_runs()[1])
    assert "delay_wgrad_compute off" in left_out["Bridge card Qwen3-30B-A3B BF16 t1 p1 v1 E16 overlap"]
    assert "no t, p, E" in left_out["Bridge card Qwen3-30B-A3B BF16 all-to-all eager"]


def test_the_model_cards_runs_with_natural_routing_or_without_delayed_weight_gradients_are_listed_with_why(
        monkeypatch):
    """The model cards' H100 runs (examples/model_verification_cards at 067f987df0): Qwen3-30B-A3B's performance run
    keeps delay_wgrad_compute off beside the overlap; its and gpt-oss-120b's functional pretraining runs route
    naturally (moe_router_force_load_balancing false), an imbalance no source gives."""
    monkeypatch.syspath_prepend(str(REPO / "benchmarks"))
    import published_moe

    left_out = dict(published_moe.card_runs()[1])
    assert "delay_wgrad_compute off" in left_out["Bridge card Qwen3-30B-A3B BF16 t1 p1 v1 E16 overlap (model card)"]
    natural = [row for row in PUBLISHED if row["routing"] == "natural"]
    assert [(row["model"], row["step_time_s"]) for row in natural] == [("Qwen3-30B-A3B", "30.28955"),
                                                                       ("gpt-oss-120b", "16.66493"),
                                                                       ("Qwen3.6-35B-A3B", "22.27122")]
    for name in ("Bridge card Qwen3-30B-A3B BF16 t1 p1 v1 E16 (functional pretrain)",
                 "Bridge card gpt-oss-120b BF16 t1 p4 v1 E8 (functional pretrain)"):
        assert "natural routing" in left_out[name]
    # Qwen3.6-35B-A3B's card trains its vision encoder too, which pipesim does not count (its text_config alone)
    assert "vision encoder" in left_out["Bridge card Qwen3.6-35B-A3B BF16 t1 p2 v1 E8 (model card)"]
