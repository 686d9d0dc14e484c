"""NVIDIA's published dense H100 step times (benchmarks/published_h100.py and the rows it recorded in
benchmarks/published_h100.json): every published figure is the CSV's, each row's command carries its layout, and
a row's printed command reproduces its recorded prediction."""

from __future__ import annotations

import csv
import json
import shlex
from pathlib import Path

import pytest

from tests.conftest import simulate_json
from tests.helpers import flag_value as _flag

REPO = Path(__file__).resolve().parents[1]
RECORDED = json.loads((REPO / "benchmarks" / "published_h100.json").read_text())["rows"]
PUBLISHED = list(csv.DictReader((REPO / "benchmarks" / "published" / "nvidia-dgxc-h100.csv").open()))


def test_every_published_row_is_recorded_with_its_figure_and_layout():
    assert len(RECORDED) == len(PUBLISHED) == 70
    for row, published in zip(RECORDED, PUBLISHED):
        args = shlex.split(row["command"])
        t, p, c, gpus = (int(published[k]) for k in ("tensor_parallel", "pipeline_parallel", "context_parallel",
                                                     "gpus"))
        d = gpus // (t * p * c)
        assert row["published_s"] == float(published["step_s"]) and row["gpus"] == gpus
        assert (_flag(args, "-p"), _flag(args, "--data-parallel")) == (str(p), str(d))
        assert _flag(args, "--tensor-parallel") == str(t) if t > 1 else "--tensor-parallel" not in args
        assert _flag(args, "--context-parallel") == str(c) if c > 1 else "--context-parallel" not in args
        assert int(_flag(args, "-m")) * d * int(_flag(args, "-b")) == int(published["global_batch"])
        assert _flag(args, "--dtype") == published["precision"]
        assert ("--fp8-param-gather" in args) == (published["precision"] == "fp8")  # every FP8 run's fp8_params
        assert ("nemo-bf16-adam" in args) == (published["optimizer_state"] == "bf16")
        # NeMo's distributed Adam syncs bf16 gradients (grad_sync_dtype), Megatron-core's optimizer float32 ones
        held = _flag(args, "--precision") if "--precision" in args else "megatron"
        assert (held in ("megatron-16bit-grads", "nemo-bf16-adam")) == (published["optimizer_buckets"] == "nemo")
        assert _flag(args, "--optimizer-buckets") == published["optimizer_buckets"]
        assert (_flag(args, "--recompute") if "--recompute" in args else "none") == published["recompute"]
        assert ("--tp-overlap-no-margin" in args) == (published["tp_overlap_sm_margin"] == "false")
        assert (published["tp_overlap_sm_margin"] == "") == (t == 1) == (published["tp_overlap_fp8_buf"] == "")
        assert ("--tp-overlap-fp8-buf" in args) == (published["tp_overlap_fp8_buf"] == "true")
        assert published["tp_overlap_fp8_buf"] != "true" or published["precision"] == "fp8"
        # every pipelined run overlaps its exchanges: 340B's configure.sh overrides its yaml's overlap_p2p_comm False
        assert published["p2p_overlap"] == ("true" if p > 1 else "") and "--blocking-comm" not in args
        assert _flag(args, "--attention-kernel") == published["attention_kernel"]
        assert _flag(args, "--linear-kernel") == "te"  # Megatron-core's TransformerEngine layers, every run's
        rotary = _flag(args, "--rotary-percent") if "--rotary-percent" in args else ""
        assert rotary == published["rotary_percent"] and ("--rope-kernel" in args) == bool(rotary)
        assert rotary == ("" if published["model"] == "GPT-3 175B" else "0.5" if "Nemotron" in published["model"]
                          else "1.0")
        # NVTE_FUSED_ATTN=0 in 340B's configure.sh (nemotron/ at 143b90dd91); 1 in every other (GPT-3 175B's:
        # nemo_megatron/configure.sh at 0b71cfda51, whose README holds its rows), where TransformerEngine prefers cuDNN
        assert published["attention_kernel"] == ("flash2" if published["model"] == "Nemotron-4 340B" else "cudnn")
        assert int(_flag(args, "--vocab")) % (128 * t) == 0 <= int(_flag(args, "--vocab")) - int(published["vocab"])


@pytest.mark.parametrize("run", ["Nemotron-4 15B FP8 2048 GPUs", "Llama 3.1 8B BF16 8 GPUs"])
def test_a_row_is_reproduced_by_its_printed_command(run):
    (row,) = [r for r in RECORDED if r["run"] == run]
    args = shlex.split(row["command"])
    assert args[:2] == ["pipesim", "simulate"]
    (result,) = simulate_json(*args[2:])
    assert result["time_per_minibatch_ms"] / 1e3 == pytest.approx(row["predicted_s"], rel=1e-9)
    assert row["error"] == pytest.approx(row["predicted_s"] / row["published_s"] - 1, rel=1e-12)


def test_the_rise_is_read_per_layout_from_its_fewest_gpus_to_its_most(monkeypatch):
    monkeypatch.syspath_prepend(str(REPO / "benchmarks"))
    from published_h100 import scaling

    def run(gpus: int, layout: str, predicted: float, published: float) -> dict:
        return {"model": "M", "precision": "bf16", "gpus": gpus, "layout": layout, "predicted_s": predicted,
                "published_s": published}

    rows = [run(256, "a", 1.0, 2.2), run(16, "a", 1.0, 2.0), run(64, "a", 1.1, 2.1), run(8, "b", 1.0, 1.0)]
    assert scaling(rows) == ["M BF16 16->256 GPUs: measured +10.0%, predicted +0.0%"]
