"""DeepSeek-V3's own pre-training run (benchmarks/published_deepseek.py and the row it recorded in
benchmarks/published_deepseek.json): the command is rebuilt from the CSV's row with the report's layout, and run as
printed it gives the recorded prediction."""

from __future__ import annotations

import json
import shlex
from pathlib import Path

import pytest

from tests.conftest import simulate_json
from tests.helpers import flag_value as _flag

REPO = Path(__file__).resolve().parents[1]
RECORDED = json.loads((REPO / "benchmarks" / "published_deepseek.json").read_text())


def test_the_rows_command_is_rebuilt_from_the_csv_with_the_reports_layout(monkeypatch):
    """2,048 H800s, no tensor parallelism, PP 16 under the bidirectional DualPipe, EP 64 over 8 nodes with DeepEP's
    dispatch, ZeRO-1 over d = 128, 15,360 sequences of 4,096 tokens, the multi-token-prediction module at depth 1;
    published 10^12 / (180,000 x 3,600)."""
    monkeypatch.syspath_prepend(str(REPO / "benchmarks"))
    from published_deepseek import run
    from published_runs import command_text

    assert RECORDED["command"] == command_text(run().simulate_command())
    args = shlex.split(RECORDED["command"])
    assert (_flag(args, "--gpu"), _flag(args, "--tensor-parallel"), _flag(args, "-p"), _flag(args, "-s")) == (
        "h800", "1", "16", "dualpipe")
    assert (_flag(args, "--expert-parallel"), _flag(args, "--rank-order"), _flag(args, "--token-dispatcher")) == (
        "64", "megatron", "deepep")
    assert (_flag(args, "--data-parallel"), _flag(args, "--zero"), _flag(args, "--seq-len")) == ("128", "1", "4096")
    assert _flag(args, "--mtp-layers") == "1"  # 4.2: "The multi-token prediction depth D is set to 1"
    assert int(_flag(args, "-m")) * int(_flag(args, "-b")) * 128 == 15360
    assert RECORDED["published_tokens_per_s_per_gpu"] == pytest.approx(1e12 / (180_000 * 3600), rel=1e-12)
    assert RECORDED["predicted_tokens_per_s_per_gpu"] == pytest.approx(
        15360 * 4096 / (RECORDED["command_ms"] / 1e3 * 2048), rel=1e-12)


def test_the_row_is_reproduced_by_its_printed_command(monkeypatch):
    monkeypatch.chdir(REPO)  # the command names its config as examples/, from the repository root
    args = shlex.split(RECORDED["command"])
    assert args[:2] == ["pipesim", "simulate"]
    (result,) = simulate_json(*args[2:])
    assert result["time_per_minibatch_ms"] == pytest.approx(RECORDED["command_ms"], rel=1e-9)
    fullest = max(result["devices"], key=lambda device: device["peak_memory_mb"])
    assert fullest["peak_memory_mb"] == pytest.approx(RECORDED["memory"]["peak_mib"], rel=1e-9)
    assert RECORDED["error"] == pytest.approx(RECORDED["predicted_tokens_per_s_per_gpu"]
                                              / RECORDED["published_tokens_per_s_per_gpu"] - 1, rel=1e-12)
