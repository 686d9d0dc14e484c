"""Memory against published memory (benchmarks/published_memory.py and the rows it recorded in
benchmarks/published_memory.json): each source's figure is its paper's, a row's printed command reproduces its
figure, and the runs published as run are not marked out of memory."""

from __future__ import annotations

import csv
import json
import shlex
import statistics
from pathlib import Path

import pytest

from tests.conftest import pipesim, simulate_json

REPO = Path(__file__).resolve().parents[1]
RECORDED = json.loads((REPO / "benchmarks" / "published_memory.json").read_text())


def _peak_gib(*args: str) -> float:
    """The fullest device's peak (GiB) of `pipesim simulate ARGS`, as the benchmark reads it (`fullest`)."""
    return max(d["peak_memory_mb"] for d in simulate_json(*args)[0]["devices"]) / 1024


def test_table2_rows_hold_korthikanti_within_the_target_and_every_row_is_listed():
    rows = RECORDED["table2"]
    assert len(rows) == 4 * 6  # Table 3's four models, Table 2's six configurations
    errors = [abs(r["error"]) for r in rows]
    assert statistics.median(errors) <= 0.05 and max(errors) <= 0.10
    # The paper's formula, written out here: 175B (s 2048, h 12288, a 96), t = 8, sequence parallel, b = 1
    row = next(r for r in rows if r["run"] == "175B t=8: tensor + sequence parallel")
    assert row["published"] == pytest.approx(2048 * 12288 / 8 * (34 + 5 * 96 * 2048 / 12288) / 2**20)


def test_a_table2_rows_command_prints_its_figure(tmp_path, monkeypatch):
    row = next(r for r in RECORDED["table2"] if r["run"] == "22B t=8: tensor parallel + selective activation "
                                                             "recomputation")
    monkeypatch.chdir(tmp_path)
    code, _, err = pipesim(*shlex.split(row["command"])[1:])
    assert code == 0, err
    layer = json.loads((tmp_path / "layer.json").read_text())["layers"][1]
    assert layer["activation_bytes"] / 2**20 == pytest.approx(row["predicted"])


@pytest.mark.parametrize("name", ["Korthikanti 22B full recompute", "Korthikanti 22B SP + selective",
                                  "Korthikanti 175B full recompute", "Nemotron-4 340B (NVIDIA, NeMo 24.09)"])
def test_the_runs_published_as_run_fit_and_a_rows_command_prints_its_peak(name):
    """Korthikanti's and Narayanan's runs and NVIDIA's Nemotron-4 340B (16-bit gradients and moments and no master
    copy as its NeMo config holds them, keys and values at their 8 query groups) all fit. The 175B row's
    interleaved blocking exchanges hold the recorded file to the engine's communication buffers."""
    runs = RECORDED["measured_running"]
    assert len(runs) == 8 + 10 + 1 and not any(r["out_of_memory"] for r in runs)
    for r in runs:
        assert sum(r["parts_mib"].values()) == pytest.approx(r["peak_mib"])
        # Megatron-LM's fp16 runs step its 16-bit optimizer unsharded; NeMo's Nemotron-4 its distributed Adam
        assert ("--optimizer-step megatron" in r["command"]) == r["run"].startswith(("Korthikanti", "Megatron"))
    row = next(r for r in runs if r["run"] == name)
    devices = simulate_json(*shlex.split(row["command"])[2:])[0]["devices"]
    assert max(d["peak_memory_mb"] for d in devices) == pytest.approx(row["peak_mib"])
    assert not any(d["out_of_memory"] for d in devices)


def flag_pairs(command: str) -> set[str]:
    """Each two neighbouring words of a command line ("--zero 3")."""
    words = shlex.split(command)
    return {" ".join(pair) for pair in zip(words, words[1:])}


def test_every_torchtitan_row_pipesim_expresses_is_compared_from_its_command(monkeypatch):
    """All 18 rows of torchtitan's page: 16 simulated from commands built from their columns (with what pipesim does
    not model named) on the page's 96 GB H100s, none marked out of memory, the two of 262,144 tokens listed as
    beyond the configs' positions. The commands run from the repository's root."""
    compared, listed = RECORDED["torchtitan"], RECORDED["torchtitan_not_modelled"]
    assert len(compared) + len(listed) == 18 and len(compared) == 16
    assert all(", CP 8" in r["run"] and "262144" in r["why_not"] for r in listed)
    plain = [r for r in compared if not r["not_modelled"]]
    assert [(r["run"], r["published_gib"]) for r in plain] == [
        ("Table 1 Llama 3.1 8B, FSDP 8: FSDP", 82.4), ("Table 3 Llama 3.1 8B, FSDP 128: FSDP", 67.0)]
    for r in compared:
        assert r["error"] == pytest.approx(r["predicted_gib"] / r["published_gib"] - 1)
        pairs = flag_pairs(r["command"])
        assert {"--zero 3", "--precision fsdp2", "--gpus examples/h100-hbm2e-96gb.toml",
                "--gpu h100-hbm2e-96gb"} <= pairs  # the page's 96 GB HBM2e parts
        assert not r["out_of_memory"]  # every row ran
        assert ("--dtype fp8" in pairs) == ("Float8" in r["run"])
        # as torchao ran at eab345c, the page's commit (benchmarks/published/README.md)
        assert ("--fp8-recipe torchao-2024" in pairs) == ("Float8" in r["run"])
        # the 405B's config all-gathers in float8 (train_configs/llama3_405b.toml); the 8B's and 70B's do not
        assert ("--fsdp-float8-all-gather" in r["command"]) == ("405B" in r["run"])
        assert ("--loss-parallel" in r["command"]) == ("TP 8" in r["run"])  # torchtitan's loss under TP
        assert ("--tp-runtime torch" in pairs) == ("TP 8" in r["run"])  # and its layers, DTensor's
        # async TP's fused collectives where the page ran them, else DTensor's, which copy each whole tensor
        assert ("--tp-overlap" in r["command"]) == ("AsyncTP" in r["run"])
        context = "CP" in r["run"] and ", CP 1" not in r["run"]
        assert ("--cp-rotate allgather" in pairs) == context  # and its context parallel, torch's all-gather
        assert ("--pp-runtime torch" in pairs) == ("PP 8" in r["run"])  # and its pipeline, torch's pipelining
        # its Llama copies the grouped keys and values to every query head before attention (model.py `repeat_kv`)
        assert "--repeat-kv" in r["command"]
        # its blocks compiled inside their checkpoints: what AOTAutograd's partitioner saves of them
        assert ("--torch-compile" in r["command"]) == ("torch.compile" in r["run"])
        # run_llama_train.sh's PYTORCH_CUDA_ALLOC_CONF on one host (Tables 1 and 2: 8 GPUs), multinode_trainer.slurm
        # sets none
        host = r["run"].startswith(("Table 1 ", "Table 2 "))
        assert ("--allocator expandable" in pairs, "--allocator caching" in pairs) == (host, not host)
    for r in plain:
        assert {"--recompute op", "--seq-len 8192", "-b 2"} <= flag_pairs(r["command"])
    monkeypatch.syspath_prepend(str(REPO / "benchmarks"))
    from published_memory import torchtitan_command
    from published_runs import _rows, command_text

    # the recorded commands are the ones the benchmark builds from the page's columns now
    assert [r["command"] for r in compared] == [
        command_text(args) for row in _rows("torchtitan-2024-llama3.csv") if (args := torchtitan_command(row))]
    # torchtitan's default micro-batches at 9dec370 are the pipeline's degree, not its stages: interleaved too
    row = next(r for r in compared if r["run"].startswith("Table 5") and "interleaved" in r["run"])
    assert {"-s interleaved-1f1b", "--chunks 2", "-m 8", "-b 4", "-p 8", "--tensor-parallel 8"} <= flag_pairs(
        row["command"])
    monkeypatch.chdir(REPO)
    for row in (plain[1], compared[-1]):
        assert _peak_gib(*shlex.split(row["command"])[2:]) == pytest.approx(row["predicted_gib"])
    # max allocated, the tensors alone: the row's command with --allocator none in place of its launcher's
    for r in compared:
        assert r["allocated_gib"] < r["predicted_gib"]
        assert r["allocated_error"] == pytest.approx(r["allocated_gib"] / r["published_gib"] - 1)
    row = next(r for r in compared if r["run"].startswith("Table 5") and "(1F1B)" in r["run"])
    words = shlex.split(row["command"])[2:]
    at = words.index("--allocator")
    assert _peak_gib(*words[:at], *words[at + 2:], "--allocator", "none") == pytest.approx(row["allocated_gib"])


def test_the_zero_bubble_papers_table4_is_compared_per_model_and_schedule(monkeypatch, tmp_path):
    """Its 48 memory figures (4 GPTs, 3 micro-batch counts, 4 schedules) are one per model and schedule, each
    simulated from a command that launches the run as the paper's fork did; a row's command prints its figure."""
    rows = RECORDED["zero_bubble"]
    assert [r["run"] for r in rows] == [f"{model} {schedule}" for model in ("1.5B", "6.2B", "14.6B", "28.3B")
                                        for schedule in ("1F1B", "1F1B-I", "ZB-1p", "ZB-2p")]
    assert [r["published_gib"] for r in rows if r["run"].startswith("1.5B")] == [30, 40, 32, 59]
    for r in rows:
        assert {"--dtype fp16", "--attention math", "--dropout 0.1", "--stage-cut padded-blocks",
                "--gpu a100-sxm-80gb"} <= flag_pairs(r["command"])
        assert r["error"] == pytest.approx(r["predicted_gib"] / r["published_gib"] - 1)
    row = next(r for r in rows if r["run"] == "1.5B 1F1B-I")
    assert {"-s interleaved-1f1b", "--chunks 3", "-p 8", "-b 6"} <= flag_pairs(row["command"])
    monkeypatch.chdir(tmp_path)
    assert _peak_gib(*shlex.split(row["command"])[2:]) == pytest.approx(row["predicted_gib"])
    monkeypatch.chdir(REPO)  # the ZB rows read the order the fork built, under benchmarks/published/
    for row in (rows[0], *rows[2:4]):  # the 1.5B's other schedules (the recorded file once kept two of them stale)
        assert _peak_gib(*shlex.split(row["command"])[2:]) == pytest.approx(row["predicted_gib"]), row["run"]


def test_zero_bubble_rows_run_the_order_the_forks_scheduler_built_from_table9(monkeypatch):
    """ZB-1p and ZB-2p run the committed order of the fork's scheduler (schedules/zb_heuristic.py) for the row's
    Table 9 costs and its limit of p or 2p micro-batches, as the benchmark builds it now (`zero_bubble_csv`), for
    two steps as the other rows' methods run; the ZB-2p row's command prints its figure."""
    monkeypatch.syspath_prepend(str(REPO / "benchmarks"))
    from published_memory import zero_bubble_csv

    table4: dict[str, dict[str, str]] = {}  # each model and schedule at its fewest micro-batches, its first row
    with (REPO / "benchmarks" / "published" / "zero-bubble-2024-table4.csv").open() as f:
        for r in csv.DictReader(f):
            table4.setdefault(f"{r['model']} {r['schedule']}", r)
    ordered = [r for r in RECORDED["zero_bubble"] if " ZB-" in r["run"]]
    assert len(ordered) == 8
    for r in ordered:
        row = table4[r["run"]]
        words = shlex.split(r["command"])
        path = words[words.index("--schedule-file") + 1]
        assert not {"-s", "-p", "-m"} & set(words) and "--minibatches 2" in flag_pairs(r["command"])  # as -s runs
        assert (REPO / path).read_text() == zero_bubble_csv(row)
    row = next(r for r in ordered if r["run"] == "1.5B ZB-2p")
    monkeypatch.chdir(REPO)
    assert _peak_gib(*shlex.split(row["command"])[2:]) == pytest.approx(row["predicted_gib"])
