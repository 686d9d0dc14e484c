"""Each row of `sweep --out` carries the `pipesim simulate` line that gives it: the model, costs and hardware every
row shares (which the file had nowhere else), and the row's configuration."""

import csv
import json
import shlex
from pathlib import Path

import pytest

from tests.conftest import pipesim

REPO = Path(__file__).resolve().parents[1]

FIGURES = ("time_per_minibatch_ms", "samples_per_s", "bubble_fraction", "peak_memory_mb", "max_staleness",
           "makespan_ms", "exposed_comm_ms")

SWEEPS = {
    # the built-in costs, the whole model's in sweep and a device's share in simulate, every method and every axis;
    # a row whose order runs no PRED (W) rows has no --pred (--wgrad-fraction) in its line, which simulate refuses
    "built-in costs": ["-p", "2,4", "-m", 8, "-v", 2, "-P", 2, "--activation-limit", 0.8, "--prediction", "paper",
                       "--cost-scale", "0.5,1", "--data-parallel", 2, "--fwd", 6, "--pred", 0.3, "--comm", 0.2,
                       "--wgrad-fraction", 0.4],
    # sweep's defaults, --comm's among them (0.1 ms, simulate's 0): the line gives each
    "the built-in defaults": ["-s", "1f1b,zb-v,pipedream", "-p", "2,4", "-m", 4],
    "a cluster's links": ["-s", "1f1b,zb-h1,zb-v", "-p", 2, "-m", 4, "--cluster", REPO / "examples" / "cluster.json",
                          "--output-mb", 64],
    "a profile": ["--profile", REPO / "traces" / "profiles" / "gpt-cpu.json", "-s", "1f1b,interleaved-1f1b,auto",
                  "-p", "2,4", "-m", 8, "--optimizer", "sgd"],
    "a catalogue GPU": ["--gpu", "h100-sxm", "--model", "gpt", "--layers", 8, "--width", 1024, "--heads", 16,
                        "--seq-len", 1024, "-s", "1f1b,dualpipev", "-p", 2, "-m", 8, "--data-parallel", 2, "--zero",
                        1, "--recompute", "selective"],
    # torch's gradient accumulation: an m that 2 rounds do not split and a method that never flushes are skipped
    "rounds": ["-s", "gpipe,1f1b,pipedream", "-p", 2, "-m", "6,7", "--rounds", 2, "--data-parallel", 2],
}


@pytest.mark.parametrize("flags", SWEEPS.values(), ids=SWEEPS.keys())
def test_each_rows_simulate_line_gives_its_figures_or_its_reason(tmp_path, flags):
    out = tmp_path / "rows.csv"
    code, _, err = pipesim("sweep", *flags, "--out", out, "--workers", 1)
    assert code == 0, err
    with open(out, newline="") as handle:
        rows = list(csv.DictReader(handle))
    assert {row["status"] for row in rows} >= {"ok"}
    for row in rows:
        program, command, *args = shlex.split(row["command"])
        assert (program, command) == ("pipesim", "simulate")
        code, printed, err = pipesim("simulate", *args, "--json")
        if row["status"] == "skipped":
            assert code == 2 and err.strip() == f"error: {row['reason']}", row["command"]
            continue
        assert code == 0, (row["command"], err)
        [result] = json.loads(printed)["results"]
        assert {key: float(row[key]) for key in FIGURES} == pytest.approx(
            {key: float(result[key]) for key in FIGURES}, rel=1e-12), row["command"]


def test_the_line_names_what_every_row_shares_and_the_rows_own_configuration(tmp_path):
    out = tmp_path / "rows.csv"
    code, _, err = pipesim("sweep", "--gpu", "h100-sxm", "--model", "gpt", "--layers", 4, "--seq-len", 256,
                           "-s", "interleaved-1f1b", "-p", 2, "-m", "4,8", "-v", 2, "--cost-scale", 2, "--out", out)
    assert code == 0, err
    with open(out, newline="") as handle:
        commands = [row["command"] for row in csv.DictReader(handle)]
    assert commands == [f"pipesim simulate --gpu h100-sxm --model gpt --layers 4 --seq-len 256 -s interleaved-1f1b "
                        f"-p 2 -m {m} -n 4 -v 2 --cost-scale 2.0" for m in (4, 8)]


def test_rounds_run_every_row_in_that_many_flushes_and_the_caption_says_so(tmp_path):
    """--rounds is every row's, as --data-parallel is: the caption says it (no column does), and GPipe's row holds
    fewer micro-batches' activations at once and takes longer, a bubble a round."""
    rows = {}
    for rounds in (1, 2):
        code, out, err = pipesim("sweep", "-s", "gpipe", "-p", 2, "-m", 8, "--rounds", rounds, "--workers", 1,
                                 "--out", tmp_path / f"{rounds}.csv")
        assert code == 0, err
        assert ("each mini-batch in 2 rounds (--rounds) in every row" in " ".join(out.split())) == (rounds == 2), out
        with open(tmp_path / f"{rounds}.csv", newline="") as handle:
            [rows[rounds]] = csv.DictReader(handle)
    assert float(rows[2]["peak_memory_mb"]) < float(rows[1]["peak_memory_mb"])
    assert float(rows[2]["time_per_minibatch_ms"]) > float(rows[1]["time_per_minibatch_ms"])


@pytest.mark.parametrize("scale", ["0", "-1", "nan", "inf"])
def test_simulate_refuses_a_cost_scale_that_is_not_a_finite_number_above_0(scale):
    code, out, err = pipesim("simulate", "-s", "1f1b", "--cost-scale", scale)
    assert (code, out) == (2, "")
    assert err.strip() == f"error: --cost-scale: give a finite number above 0 (got {scale})"


def test_simulates_cost_scale_scales_the_compute_alone():
    def step_ms(comm_ms, *flags):
        code, printed, err = pipesim("simulate", "-s", "1f1b", "-p", 2, "-m", 4, "--comm", comm_ms, *flags, "--json")
        assert code == 0, err
        return json.loads(printed)["results"][0]["time_per_minibatch_ms"]

    # 1F1B's step at p = 2, m = 4: 5 forwards of 1 ms and 5 backwards of 2 on its path, and 4 transfers of --comm
    assert [step_ms(0), step_ms(0, "--cost-scale", 3)] == [15, 45]
    assert [step_ms(1), step_ms(1, "--cost-scale", 3)] == [15 + 4, 45 + 4]


def test_the_terminal_says_why_each_skipped_configuration_was_skipped_each_reason_once():
    code, out, err = pipesim("sweep", "-s", "1f1b,zb-v,graphpipe", "-p", "2,4", "-m", 8, "-v", 1, "--workers", 1)
    assert code == 0, err
    assert "(3 more skipped)" in " ".join(out.split())
    assert err.splitlines() == [
        "skipped: zb-v p=2 m=8 v=1 P=1 cost×1, zb-v p=4 m=8 v=1 P=1 cost×1: --chunks: give 2, as zb-v folds the model "
        "into a V of two chunks per device (device i holds stages i and 2p-1-i) (got 1)",
        "skipped: graphpipe p=2 m=8 v=1 P=1 cost×1: --stages: graphpipe's built-in graph (a stem, two branches and a "
        "head) needs 4 or more (got 2); pipesim simulate --graph takes a stage graph of your own"]


def test_reasons_that_differ_in_their_figures_alone_are_said_once():
    """zb-h2's "at least 2p-1 = 5 micro-batches (got m=4)" was one line for each p and m it held for, filling the
    terminal's five reasons with one method's: the first is said whole, the rest counted after it."""
    code, _, err = pipesim("sweep", "-s", "zb-h2", "-s", "1f1b", "-p", "3,4", "-m", "2,4", "--workers", 1)
    assert code == 0, err
    assert err.splitlines() == [
        "skipped: zb-h2 p=3 m=2 v=1 P=1 cost×1: zb-h2 runs 2p-1 forwards on stage 0 before its first backward, so it "
        "needs at least 2p-1 = 5 micro-batches (got m=2); with fewer, use zb-h1, which is then faster (likewise 3 more "
        "configurations, each with its own figures)"]


def test_past_five_reasons_the_terminal_points_to_the_results_file(tmp_path):
    out = tmp_path / "rows.csv"
    code, _, err = pipesim("sweep", "-p", "2,4,9", "-m", 8, "-v", 1, "--prediction", "code", "--workers", 1,
                           "--out", out)
    assert code == 0, err
    lines = err.splitlines()
    assert len(lines) == 6 and all(line.startswith("skipped: ") for line in lines)
    assert lines[-1] == f"skipped: 1 more reason: {out}'s reason column gives each row's"
    with open(out, newline="") as handle:
        reasons = {row["reason"] for row in csv.DictReader(handle) if row["status"] == "skipped"}
    assert len(reasons) == 6


def test_a_cost_scale_keeps_the_mfu_over_a_peak_scaled_alike_and_says_so():
    """A tenth of the compute time read an MFU of 380 %: the part's peak is scaled alike, and the caption and --json
    name the scale."""
    model = ("--gpu", "h100-sxm", "--model", "gpt", "--layers", 4, "--width", 1024, "--heads", 8, "--seq-len", 1024,
             "-s", "1f1b", "-p", 2, "-m", 8)
    mfu = {}
    for scale in (1, 0.5):
        code, out, err = pipesim("simulate", *model, "--cost-scale", scale, "--json")
        assert code == 0, err
        [result] = json.loads(out)["results"]
        assert result["cost_scale"] == scale
        mfu[scale] = result["mfu"]
    assert mfu[0.5] == pytest.approx(mfu[1], rel=0.1)  # the transfers are not scaled: not equal, nowhere near 2x
    code, out, err = pipesim("simulate", *model, "--cost-scale", 0.5)
    assert "every compute time x 0.5 (--cost-scale), the MFU over a peak scaled alike" in " ".join(out.split())


def test_without_out_the_terminal_says_which_flag_would_give_each_rows_reason():
    code, _, err = pipesim("sweep", "-p", "2,4,9", "-m", 8, "-v", 1, "--prediction", "code", "--workers", 1)
    assert code == 0, err  # it said "--out's reason column gives each row's" with no --out given
    assert err.splitlines()[-1] == "skipped: 1 more reason: --out FILE.csv's reason column would give each row's"


@pytest.mark.parametrize("param_mb, warned", [(200_000, True), (20, False)])
def test_a_sweep_none_of_whose_configurations_fits_says_so_once(param_mb, warned):
    """Every row OOM was said only by the table's memory column, row by row; simulate warns of each."""
    code, _, err = pipesim("sweep", "-s", "1f1b,gpipe", "-p", 2, "-m", "4,8", "--cluster",
                           REPO / "examples" / "cluster.json", "--param-mb", param_mb, "--workers", 1)
    assert code == 0, err
    warning = [line for line in err.splitlines() if line.startswith("warning: no configuration fits")]
    assert len(warning) == int(warned)
    if warned:
        assert "the leanest, 1f1b p=2 m=4 v=1 P=1 cost×1, peaks at 400,272 MiB" in warning[0]
