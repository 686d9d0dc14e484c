"""Published runs from the command line: the flags that say how Megatron-LM ran them (`--stage-cut equal-blocks`,
`--reduce-after-flush`), one row per paper of benchmarks/published_runs.json reproduced by the command printed
for it, and the README's published run printing the figure the README quotes."""

from __future__ import annotations

import csv
import json
import re
import shlex
from pathlib import Path

import pytest

from pipesim.profiles.partition import PartitionError, equal_blocks, first_last_blocks, padded_blocks
from pipesim.units import whole_number
from tests.conftest import pipesim, simulate_json
from tests.helpers import HEAVY_HEAD_GPT_FLAGS as GPT

REPO = Path(__file__).resolve().parents[1]
RUNS = json.loads((REPO / "benchmarks" / "published_runs.json").read_text())["rows"]


def test_equal_blocks_gives_every_stage_as_many_blocks_the_ends_with_the_first_and_last():
    gpt = ["_Embed", *["_Block"] * 8, "Sequential"]
    assert equal_blocks(gpt, 1) == [0, 10]
    assert equal_blocks(gpt, 2) == [0, 5, 10]
    assert equal_blocks(gpt, 4) == [0, 3, 5, 7, 10]
    assert equal_blocks(gpt, 8) == [0, 2, 3, 4, 5, 6, 7, 8, 10]
    with pytest.raises(PartitionError, match="8 blocks \\(_Block\\) do not divide into 3 model stages"):
        equal_blocks(gpt, 3)
    with pytest.raises(PartitionError, match="not one run of blocks"):
        equal_blocks(["a", "b", "b", "a", "b"], 1)


def test_padded_blocks_pads_the_blocks_to_a_multiple_of_the_stages_and_gives_the_ends_one_fewer():
    """The zero-bubble fork's --allow-padding-num-layers: 22 blocks on 8 stages as 24, the last and the first one
    fewer (its Table 3's 1.5B: 4p - 2 layers); one padded block comes off the last stage only."""
    gpt = ["_Embed", *["_Block"] * 22, "Sequential"]
    assert padded_blocks(gpt, 8) == [0, 3, 6, 9, 12, 15, 18, 21, 24]
    assert padded_blocks(["_Embed", *["_Block"] * 7, "Sequential"], 4) == [0, 3, 5, 7, 9]
    assert padded_blocks(["_Embed", *["_Block"] * 8, "Sequential"], 4) == equal_blocks(
        ["_Embed", *["_Block"] * 8, "Sequential"], 4)
    with pytest.raises(PartitionError, match="leave a model stage without a layer"):
        padded_blocks(["_Embed", *["_Block"] * 3], 4)
    code, _, err = pipesim("simulate", *GPT, "-p", 3, "-s", "1f1b", "--stage-cut", "padded-blocks", "--json")
    assert code == 0, err


def test_first_last_gives_the_ends_their_blocks_and_the_stages_between_an_equal_share():
    """Megatron-core's --decoder-first-pipeline-num-layers 3 --decoder-last-pipeline-num-layers 2: 61 blocks on 16
    stages (DeepSeek-V3's count) as 3, 14 x 4, 2; refused where the stages between do not divide the rest."""
    deepseek = ["Embedding", *["DecoderLayer"] * 61, "Norm", "Linear"]
    assert first_last_blocks(deepseek, 16, 3, 2) == [0, *range(4, 61, 4), 64]
    assert first_last_blocks(["_Embed", *["_Block"] * 5, "Sequential"], 2, 3, 2) == [0, 4, 7]
    with pytest.raises(PartitionError, match="61 blocks \\(DecoderLayer\\) less 2 first and 2 last do not divide"):
        first_last_blocks(deepseek, 16, 2, 2)
    # each read "do not divide into the 0 model stages between": what is wrong is ends of more blocks than the model's
    for stages, ends, message in ((2, (5, 5), r"5 first and 5 last blocks are more than the model's 2 \(_Block\): "
                                              r"give F \+ L = 2"),
                                  (3, (2, 2), r"2 first and 2 last blocks are more than the model's 2 \(_Block\): "
                                              r"give F \+ L at most 2"),
                                  (2, (1, 0), r"1 first and 0 last blocks leave 1 of the model's 2 \(_Block\) to no "
                                              r"stage at p·v = 2: give F \+ L = 2"),
                                  (1, (1, 1), r"it cuts a first and a last stage: give p·v 2 or more model stages "
                                              r"\(got 1\)")):
        with pytest.raises(PartitionError, match=f"^{message}$"):
            first_last_blocks(["_Embed", *["_Block"] * 2, "Sequential"], stages, *ends)
    (cut,) = simulate_json(*GPT, "-p", 3, "-m", 3, "-s", "1f1b", "--stage-cut", "first-last:1,1")
    (even,) = simulate_json(*GPT, "-p", 3, "-m", 3, "-s", "1f1b", "--stage-cut", "first-last:2,1")
    assert cut["devices"][0]["busy_ms"] < even["devices"][0]["busy_ms"]  # one block fewer on the first stage


def test_stage_cut_equal_blocks_cuts_the_estimate_as_megatron_does():
    """The host free: at eager PyTorch's 31.9 us a kernel this small model's passes are their kernels' issue
    (planning/host.py), which equal blocks balance as well as the balanced cut (tests/test_cut_host_floor.py)."""
    args = (*GPT, "--host-kernel-us", 0, "-p", 2, "-m", 4, "-s", "1f1b")
    (balanced,) = simulate_json(*args)
    (blocks,) = simulate_json(*args, "--stage-cut", "equal-blocks")
    (interleaved,) = simulate_json(*GPT, "-p", 2, "-m", 4, "-s", "interleaved-1f1b", "--chunks", 2, "--stage-cut",
                                   "equal-blocks")
    # balanced gives the head's stage fewer blocks; equal blocks put two on each device, the head on the last
    assert blocks["time_per_minibatch_ms"] > balanced["time_per_minibatch_ms"]
    assert blocks["devices"][1]["busy_ms"] > blocks["devices"][0]["busy_ms"]
    assert interleaved["time_per_minibatch_ms"] > 0
    code, _, err = pipesim("simulate", *GPT, "-p", 3, "-s", "1f1b", "--stage-cut", "equal-blocks")
    assert code == 2 and err.count("\n") == 1
    assert "4 blocks (_Block) do not divide into 3 model stages (p·v); use --stage-cut balanced" in err


@pytest.mark.parametrize(("args", "message"), [
    (("--stage-cut", "even"), "--stage-cut: choose from balanced, fit, equal-blocks, padded-blocks, first-last:F,L"),
    (("--stage-cut", "first-last:3"), "(the first and last stages' blocks, whole numbers to 1,000,000) or "
                                      "layout:STRING (Megatron-core's pipeline layout) or layers:N,N,... (each "
                                      "stage's layers); got 'first-last:3'"),
    # int() refused both in a traceback: '²' passes isdigit, and 5,000 digits its limit
    (("--stage-cut", "first-last:²,1"), "whole numbers to 1,000,000) or layout:STRING (Megatron-core's pipeline "
                                        "layout) or layers:N,N,... (each stage's layers); got 'first-last:²,1'"),
    (("--stage-cut", f"first-last:{'9' * 5000},1"), "whole numbers to 1,000,000) or layout:STRING (Megatron-core's "
                                                    "pipeline layout) or layers:N,N,... (each stage's layers); "
                                                    "got 'first-last:999"),
    (("--stage-cut", "first-last:1,1000001"), "whole numbers to 1,000,000) or layout:STRING (Megatron-core's "
                                              "pipeline layout) or layers:N,N,... (each stage's layers); got "
                                              "'first-last:1,1000001'"),
    (("--gpu", "h100-sxm", "--model", "gpt", "--layers", 2, "-p", 2, "--stage-cut", "first-last:5,5"),
     "error: --stage-cut first-last:5,5: 5 first and 5 last blocks are more than the model's 2 (_Block): give F + L "
     "= 2; use --stage-cut balanced"),
    # the bound read past leading zeros, and refused as the model's blocks
    (("--gpu", "h100-sxm", "--model", "gpt", "--layers", 2, "-p", 2, "--stage-cut", "first-last:0001000000,1"),
     "1000000 first and 1 last blocks are more than the model's 2 (_Block)"),
    (("--stage-cut", "equal-blocks", "--fwd", "2"), "--stage-cut cuts --gpu's or --profile's layers into stages"),
    (("--reduce-after-flush",), "--reduce-after-flush times the gradient all-reduce of data-parallel replicas: give "
                                "--data-parallel 2 or more"),
])
def test_bad_published_run_flags_are_one_line(args, message):
    code, out, err = pipesim("simulate", "-s", "1f1b", *args)
    assert code == 2 and not out and err.count("\n") == 1 and message in err and "Traceback" not in err


@pytest.mark.parametrize(("text", "number"), [
    ("0", 0), ("007", 7), ("100", 100), ("101", None), ("0" * 5000 + "1", 1), ("9" * 5000, None), ("١٢", 12),
    ("²", None), ("+1", None), (" 1", None), ("1_0", None), ("", None), ("-1", None), ("1.0", None)])
def test_a_whole_number_is_decimal_digits_alone_up_to_its_most(text, number):
    """What --stage-cut first-last:F,L and a layout's repeats read (`first_last`, `_repeats`): int() reads '+1',
    ' 1' and '1_0' and '١٢' (Arabic-Indic digits, as the layout's \\d matches them); it refused '²' and 5,000
    digits in a traceback."""
    assert whole_number(text, 100) == number


def test_reduce_after_flush_waits_for_the_devices_last_backward():
    """Interleaved 1F1B with d = 2 on a slow network: each chunk's all-reduce no longer overlaps the device's
    remaining backward work, so the step is longer by what that overlap hid."""
    args = ("-s", "interleaved-1f1b", "-p", 4, "-m", 8, "--data-parallel", 2, "--network-gb-s", 0.5)
    (overlapped,) = simulate_json(*args)
    (flushed,) = simulate_json(*args, "--reduce-after-flush")
    assert flushed["time_per_minibatch_ms"] > overlapped["time_per_minibatch_ms"]


def test_sweep_takes_the_same_flags(tmp_path):
    """sweep shares --data-parallel and --blocking-comm with simulate, and so these: its rows record the reduce's
    timing, and a p whose p·v does not divide the blocks is a skipped row saying so."""
    rows = {}
    for name, flags in (("overlapped", ()), ("flushed", ("--reduce-after-flush",))):
        out = tmp_path / f"{name}.csv"
        code, _, err = pipesim("sweep", "-s", "interleaved-1f1b", "-p", 4, "--data-parallel", 2, "--network-gb-s", 0.5,
                               "-j", 1, "-o", out, *flags)
        assert code == 0, err
        (rows[name],) = list(csv.DictReader(out.open()))
    assert (rows["overlapped"]["reduce_after_flush"], rows["flushed"]["reduce_after_flush"]) == ("False", "True")
    assert float(rows["flushed"]["time_per_minibatch_ms"]) > float(rows["overlapped"]["time_per_minibatch_ms"])
    out = tmp_path / "cut.csv"
    code, _, err = pipesim("sweep", *GPT, "-s", "1f1b", "-p", "2,3", "--stage-cut", "equal-blocks", "-j", 1, "-o", out)
    assert code == 0, err
    status = {row["stages"]: (row["status"], row["reason"]) for row in csv.DictReader(out.open())}
    assert status["2"][0] == "ok" and "4 blocks (_Block) do not divide into 3 model stages" in status["3"][1]


def _command_ms(command: str, run: str) -> float:
    """The figure `command` (a pipesim command line as printed, run as written in the current folder) gives for
    `run`: simulate's ms/step, or the first block's forward or backward ms of the profile `estimate --out` wrote."""
    args = shlex.split(command)
    assert args[0] == "pipesim"
    if args[1] == "simulate":
        (result,) = simulate_json(*args[2:])
        return result["time_per_minibatch_ms"]
    code, _, err = pipesim(*args[1:])
    assert code == 0 and args[-2] == "--out", err
    block = json.loads(Path(args[-1]).read_text())["layers"][1]
    return block["fwd" if run.endswith("forward") else "bwd"]["median_ms"]


@pytest.mark.parametrize("run", ["Korthikanti 22B full recompute",
                                 "Korthikanti layer baseline no recompute: backward",
                                 "Megatron 1.7B (t1 p1 d32 v1)"])
def test_one_row_per_paper_is_reproduced_by_its_printed_command(run, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (row,) = [r for r in RUNS if r["run"] == run]
    figure = _command_ms(row["command"], run)
    assert figure == pytest.approx(row["command_ms"], rel=1e-9)
    assert row["predicted"] == pytest.approx(figure / 1e3 if row["unit"] == "s" else figure, rel=1e-12) \
        or row["unit"] == "TFLOP/s/GPU"


def test_the_readme_published_run_prints_the_figure_it_quotes():
    section = (REPO / "README.md").read_text().split("## What-if GPUs")[1].split("\n## ")[0]
    command = re.search(r"```bash\n(pipesim [^\n]+)\n```", section).group(1)
    shown = re.search(r"```\n(p=.*?)```", section, flags=re.S).group(1)
    quoted_s = float(re.search(r"pipesim predicts ([\d.]+) s", section).group(1))
    code, out, err = pipesim(*shlex.split(command)[1:])
    assert code == 0, err
    shown_rows = [line.split() for line in shown.splitlines() if line.startswith(("p=", " interleaved"))]
    printed_rows = [line.split() for line in out.splitlines() if line.startswith(("p=", " interleaved"))]
    assert len(shown_rows) == 2 and shown_rows == printed_rows  # the shape line and the schedule's row
    shape = dict(word.split("=") for word in printed_rows[0] if "=" in word)
    assert f"GPT-3 175B on {int(shape['p']) * int(shape['t'])} A100s" in " ".join(section.split())
    ms_per_step = float(printed_rows[1][2].replace(",", ""))
    assert quoted_s == round(ms_per_step / 1e3, 2)
    (published,) = [r for r in RUNS if r["run"] == "Korthikanti 175B SP + selective"]
    assert published["command"] == command and round(published["predicted"], 2) == quoted_s
