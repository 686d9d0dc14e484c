"""NeMo's performance summary on DGX-H100 (benchmarks/published/nemo-perf-summary-h100.csv), the second source of
benchmarks/published_h100.py: every row is recorded in benchmarks/published_h100.json with its command, built from
its columns, and printed in a table of its own with its median line."""

from __future__ import annotations

import csv
import json
import shlex
import sys
from pathlib import Path

import pytest

from tests.conftest import simulate_json
from tests.helpers import flag_value as _flag

REPO = Path(__file__).resolve().parents[1]
RECORDED = json.loads((REPO / "benchmarks" / "published_h100.json").read_text())
PUBLISHED = list(csv.DictReader((REPO / "benchmarks" / "published" / "nemo-perf-summary-h100.csv").open()))
# the summary's three tables on NeMo's main (docs/source/performance/performance_summary.md), rows at lines 14-25
RELEASES = {"4c73f77670", "3a8081fef6", "8e3d65dcfe"}


def test_every_summary_row_is_recorded_with_its_figure_and_layout():
    rows = RECORDED["nemo_summary_rows"]
    assert len(rows) == len(PUBLISHED) == 36
    for row, published in zip(rows, PUBLISHED):
        args = shlex.split(row["command"])
        t, p, v, c, gpus, batch, seq = (int(published[k]) for k in (
            "tensor_parallel", "pipeline_parallel", "virtual_pipeline", "context_parallel", "gpus", "global_batch",
            "seq_len"))
        d = gpus // (t * p * c)
        assert published["commit"] in RELEASES and 14 <= int(published["line"]) <= 25
        assert row["run"].endswith(f"({published['commit'][:7]})")
        assert row["published_s"] == pytest.approx(batch * seq / (gpus * float(published["tokens_per_s_gpu"])))
        assert (_flag(args, "-p"), _flag(args, "--data-parallel")) == (str(p), str(d))
        assert int(_flag(args, "-m")) * d * int(_flag(args, "-b")) == batch
        assert (_flag(args, "--chunks") if "--chunks" in args else "1") == str(v)
        assert _flag(args, "--context-parallel") == str(c) if c > 1 else "--context-parallel" not in args
        assert _flag(args, "--tensor-parallel") == str(t) if t > 1 else "--tensor-parallel" not in args
        # the source's ub_tp_comm_overlap, fp8_params, apply_rope_fusion, grad_sync_dtype (settings_source)
        assert ("--tp-overlap" in args) == (published["tp_overlap"] == "true")
        assert ("--tp-overlap-fp8-buf" in args) == (published["tp_overlap_fp8_buf"] == "true")
        assert (published["tp_overlap"] == "") == (t == 1)
        # the configs' overlap_p2p_comm: where false (340B's batch_p2p_comm), Megatron-core waits each exchange
        assert ("--blocking-comm" in args) == (published["p2p_overlap"] == "false")
        assert (published["p2p_overlap"] == "") == (p == 1)
        assert ("--fp8-param-gather" in args) == (published["fp8_params"] == "true")
        rope = _flag(args, "--rope-kernel") if "--rope-kernel" in args else ""
        assert rope == {"true": "fused", "false": "eager", "": ""}[published["rope_fusion"]]
        held = _flag(args, "--precision") if "--precision" in args else "megatron"
        assert held == {("bf16", "bf16"): "nemo-bf16-adam", ("fp32", "bf16"): "megatron-16bit-grads",
                        ("fp32", "fp32"): "megatron"}[published["optimizer_state"], published["grad_sync_dtype"]]
        assert _flag(args, "--dtype") == "fp8" and _flag(args, "--attention-kernel") == published["attention_kernel"]
        # NVTE_FUSED_ATTN 0 in the launcher's conf/config.yaml at 24.07 (and in DGX Cloud's 340B recipe), unset at 24.09
        assert (published["attention_kernel"] == "cudnn") == published["settings_source"].startswith("launcher 24.09 ")


def test_a_summary_row_is_reproduced_by_its_printed_command():
    (row,) = [r for r in RECORDED["nemo_summary_rows"] if r["run"] == "LLAMA2-7B FP8 8 GPUs (8e3d65d)"]
    args = shlex.split(row["command"])
    (result,) = simulate_json(*args[2:])
    assert result["time_per_minibatch_ms"] / 1e3 == pytest.approx(row["predicted_s"], rel=1e-9)


def test_the_summary_is_printed_as_its_own_table_and_median(monkeypatch, capsys):
    monkeypatch.syspath_prepend(str(REPO / "benchmarks"))
    import published_h100

    recorded = {published_h100.SOURCE: RECORDED["rows"], published_h100.NEMO_SUMMARY: RECORDED["nemo_summary_rows"]}
    monkeypatch.setattr(published_h100, "rows", lambda source=published_h100.SOURCE: [
        {**r, "layout": r["run"]} for r in recorded[source]])
    monkeypatch.setattr(sys, "argv", ["published_h100.py"])
    published_h100.main()
    out = capsys.readouterr().out
    assert "performance summary (s, from tokens/s)" in out and "LLAMA3-70B FP8 64 GPUs (8e3d65d)" in out
    assert f"all |error|: {published_h100.summary(RECORDED['rows'])}" in out  # the dgxc rows' line as before
    assert f"NeMo performance summary |error|: {published_h100.summary(RECORDED['nemo_summary_rows'])}" in out
    # the three tables re-measure the same 12 configurations: the latest table's median is printed beside
    latest = [r for r in RECORDED["nemo_summary_rows"] if r["run"].endswith("(8e3d65d)")]
    assert len(latest) == 12
    assert f"latest table (8e3d65dcfe) |error|: {published_h100.summary(latest)}" in out


def test_the_launcher_examples_gradient_sync_is_each_rows():
    # NeMo-Framework-Launcher 24.07's H100 FP8 examples add `+training.model.optim.grad_sync_dtype=bf16` for every
    # GPT3 and Llama model, Nemotron-8B's and -22B's none (Apex's default: float32); 340B's config names bf16
    for published in PUBLISHED:
        example = published["example"]
        expected = "bf16" if example.startswith(("examples/training/gpt/", "examples/training/llama/")) else "fp32"
        if published["model"] == "Nemotron-340B":
            assert example == "" and published["optimizer_state"] == "bf16"
            expected = "bf16"
        assert published["grad_sync_dtype"] == expected, published["model"]


def test_nemotron_340b_is_read_where_its_layout_is():
    # p8 v12 at GBS 2 a node (nemotron_340b.yaml at 24.07: p12 v8, GBS 2,304): DGX Cloud's recipe, which overlaps
    # its exchanges and its TP collectives, fuses RoPE and keeps FP8 weights (nemotron/configure.sh at 35a9aecc8d)
    for published in (r for r in PUBLISHED if r["model"] == "Nemotron-340B"):
        assert published["settings_source"].startswith("dgxc-benchmarking v24.11.1 ")
        assert (published["pipeline_parallel"], published["virtual_pipeline"]) == ("8", "12")
        assert int(published["global_batch"]) == 2 * int(published["gpus"]) // 8
        assert [published[k] for k in ("p2p_overlap", "tp_overlap", "rope_fusion", "fp8_params")] == ["true"] * 4
    # so its step is priced as DGX Cloud's FP8 row of the same layout (published 3.16 s)
    (dgxc,) = [r["command"] for r in RECORDED["rows"] if r["run"] == "Nemotron-4 340B FP8 128 GPUs"]
    assert {r["command"] for r in RECORDED["nemo_summary_rows"] if r["model"] == "Nemotron-340B"} == {dgxc}


# each model's (t, p, v, C) in NeMo-Framework-Launcher 24.07's config and H100 FP8 example (8325688d83): 175b.yaml
# and 175b_fp8_16node.sh v 12, llama3_70b.yaml v 10, nemotron_340b.yaml p 12 v 8 (lines 60-62)
LAUNCHER_2407 = {"GPT3-5B": (1, 1, 1, 1), "GPT3-20B": (2, 1, 1, 1), "GPT3-175B": (4, 8, 12, 1),
                 "LLAMA2-7B": (1, 1, 1, 1), "LLAMA2-13B": (1, 4, 10, 1), "LLAMA2-70B": (4, 4, 20, 1),
                 "Nemotron-8B": (2, 1, 1, 1), "Nemotron-22B": (2, 4, 10, 1), "Nemotron-340B": (8, 12, 8, 1),
                 "LLAMA3-8B": (1, 1, 1, 2), "LLAMA3-70B": (4, 4, 10, 2)}


def test_a_row_is_read_at_24_07_iff_its_layout_is_its_24_07_configs():
    for published in PUBLISHED:
        layout = tuple(int(published[k]) for k in (
            "tensor_parallel", "pipeline_parallel", "virtual_pipeline", "context_parallel"))
        read_at_2407 = published["settings_source"] == "launcher 24.07 (8325688d83)"
        assert read_at_2407 == (layout == LAUNCHER_2407[published["model"]]), published["model"]
