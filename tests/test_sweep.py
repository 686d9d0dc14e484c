"""`pipesim sweep`: grid expansion, agreement with `simulate`, Pareto fronts, result files and bad input."""

import csv
import importlib.util
import itertools
import os
import pickle
import re
import subprocess
import sys
from collections import Counter
from dataclasses import fields
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipesim.planning.scenario import Scenario
from pipesim.planning.sweep import COLUMNS, Config, Grid, Metrics, Result, pareto_front, pareto_mask, run, write_results
from pipesim.traces.hostload import usable_cpus
from tests.conftest import pipesim, simulate_json

REPO = Path(__file__).resolve().parents[1]

# The built-in example model, whole: at p = 4 each device runs forward 1 ms and backward 2 ms.
MODEL = Scenario({"--fwd": [4.0], "--bwd": [8.0], "--param-mb": [1024.0], "--activation-mb": [256.0],
                  "--output-mb": [8.0]}, 0.5, 0.1, None, None, "adam", 1, 0.1, True, per="model")


def read_csv(path):
    """Rows of a results CSV with their types back (empty numbers, and an empty source of s, are None; a flag is
    written True or False)."""

    def value(key, text):
        if text == "" and (COLUMNS[key] is not str or key == "prediction"):
            return None
        return text == "True" if COLUMNS[key] is bool else COLUMNS[key](text)

    with open(path, newline="") as handle:
        return [{k: value(k, v) for k, v in row.items()} for row in csv.DictReader(handle)]


def test_grid_multiplies_v_and_p_only_for_the_methods_that_read_them():
    grid = Grid(("1f1b", "zb-v", "interleaved-1f1b", "avgpipe"), (2, 4), (4, 8), 3, chunks=(1, 2), pipelines=(1, 2),
                cost_scales=(0.5, 1.0))
    configs = grid.configs()
    count = {name: sum(c.schedule == name for c in configs) for name in grid.schedules}
    # p·m·scale = 8, ×2 for v or P; a V schedule only at its one v, which the values hold (at v = 1 every sweep of
    # the example grid printed a skipped row)
    assert count == {"1f1b": 8, "zb-v": 8, "interleaved-1f1b": 16, "avgpipe": 16}
    assert {(c.chunks, c.pipelines) for c in configs if c.schedule == "1f1b"} == {(1, 1)}
    assert {(c.chunks, c.pipelines) for c in configs if c.schedule == "avgpipe"} == {(1, 1), (1, 2)}
    assert {(c.chunks, c.pipelines) for c in configs if c.schedule == "zb-v"} == {(2, 1)}
    v_only = Grid(("zb-v", "dualpipev", "dualpipe", "interleaved-1f1b"), (4,), (8,), 1, chunks=(1, 4)).configs()
    assert [(c.schedule, c.chunks) for c in v_only] == [  # none holds 2: each given v, skipped with its reason
        ("zb-v", 1), ("zb-v", 4), ("dualpipev", 1), ("dualpipev", 4), ("dualpipe", 1), ("dualpipe", 4),
        ("interleaved-1f1b", 1), ("interleaved-1f1b", 4)]
    assert {c.minibatches for c in configs} == {3}
    defaults = Grid(("zb-v", "avgpipe", "gpipe"), (4,), (8,), 1).configs()  # no v or P axis: each method's own
    assert [(c.chunks, c.pipelines) for c in defaults] == [(2, 1), (1, 2), (1, 1)]


def test_unrunnable_configurations_are_skipped_rows_with_reasons(tmp_path):
    out = tmp_path / "r.csv"
    code, text, _ = pipesim("sweep", "-s", "1f1b,zb-v,interleaved-1f1b", "-p", "4", "-m", "6,8", "-v", "1,4",
                            "-j", "1", "--out", out)
    assert code == 0 and "Pareto fronts" in text
    rows = read_csv(out)
    assert len(rows) == 2 + 4 + 4 - 2  # interleaved-1f1b at v = 1 is 1f1b's row
    skipped = {(r["schedule"], r["microbatches"], r["chunks"]): r["reason"] for r in rows if r["status"] == "skipped"}
    # zb-v's one v, 2, is not among the values: each given one is a row skipped with its reason
    assert set(skipped) == {("zb-v", 6, 1), ("zb-v", 8, 1), ("zb-v", 6, 4), ("zb-v", 8, 4), ("interleaved-1f1b", 6, 4)}
    assert skipped["zb-v", 6, 1].startswith("--chunks: give 2, as zb-v folds the model into a V")
    assert "multiple of stages" in skipped["interleaved-1f1b", 6, 4]
    for row in rows:  # skipped rows carry no metrics, the others all of them
        assert (row["time_per_minibatch_ms"] is None) == (row["status"] == "skipped")


def test_a_gpu_sweeps_p_deeper_than_the_model_is_a_skipped_row_as_a_profiles_is(tmp_path):
    """--gpu estimated every p before any ran, and one deeper than the model's layers stopped the whole grid with
    the estimate's refusal, where --profile skips that p's rows with the reason; every p too deep is that line."""
    model = ("--gpu", "h100-sxm", "--model", "gpt", "--layers", 2, "--width", 256, "--heads", 4, "--seq-len", 256)
    out = tmp_path / "r.csv"
    code, text, err = pipesim("sweep", *model, "-s", "1f1b", "-p", "2,8", "-m", 8, "-j", 1, "--out", out)
    assert code == 0 and "(1 more skipped)" in text, err
    rows = {row["stages"]: row for row in read_csv(out)}
    assert rows[2]["status"] == "ok" and rows[8]["status"] == "skipped"
    assert rows[8]["reason"].startswith("--stages 8: gpt of 2 blocks (--layers) has 4 layers in all; give at most 4")
    code, _, err = pipesim("sweep", *model, "-s", "1f1b", "-p", 8, "-m", 8, "-j", 1)
    assert code == 2 and err.startswith("error: no configuration runs: --stages 8: gpt of 2 blocks"), err


def test_rows_short_of_the_steady_state_are_marked_as_simulate_marks_them(tmp_path):
    """At -n 2 PipeDream (steady from its fourth mini-batch) was a row like any other, its warm-up in its step;
    simulate marked it. 1F1B reaches its steady state at N = 2."""
    out = tmp_path / "r.csv"
    page = tmp_path / "p.html"
    code, text, err = pipesim("sweep", "-s", "1f1b,pipedream", "-p", 4, "-m", 8, "-n", 2, "-j", 1, "--out", out,
                              "--html", page)
    assert code == 0, err
    assert {row["schedule"]: row["steady_state"] for row in read_csv(out)} == {"1f1b": True, "pipedream": False}
    drawn = page.read_text()
    assert "*: no steady state, the warm-up included" in drawn and "samples\\u002fs (no steady state: " in drawn
    rows = {line.split()[0]: line.split() for line in text.splitlines() if line.split()[:1] in (["1f1b"],
                                                                                               ["pipedream"])}
    assert rows["pipedream"][3].endswith("*") and not rows["1f1b"][3].endswith("*")
    assert "* marks no steady state: -n is short of the order's" in " ".join(text.split())
    code, text, err = pipesim("sweep", "-s", "1f1b,pipedream", "-p", 4, "-m", 8, "-j", 1)
    assert code == 0 and "*" not in text, err


def test_rows_equal_single_simulate_runs(tmp_path):
    out = tmp_path / "r.csv"
    code, _, _ = pipesim("sweep", "-s", "1f1b,interleaved-1f1b,avgpipe,pipedream", "-p", "4", "-m", "8",
                         "-n", "3", "-v", "2", "-P", "2", "--cost-scale", "1,2", "--comm", "0.05", "--opt", "0.2",
                         "--workers", "2", "--out", out)
    assert code == 0
    rows = {(r["schedule"], r["cost_scale"]): r for r in read_csv(out)}
    assert len(rows) == 8
    # The whole model's 4 ms forward on 4 devices is 1 ms per device, which simulate's per-device costs split
    # over a device's chunks as the sweep splits the model over p·v stages (its 0.2 ms update likewise); a cost
    # scale multiplies every compute time.
    for (name, scale), row in rows.items():
        (expected,) = simulate_json(
            "-s", name, "-p", 4, "-m", 8, "-n", 3, "--chunks", row["chunks"], "--pipelines", row["pipelines"],
            "--fwd", 1 * scale, "--bwd", 2 * scale, "--param-mb", 256, "--activation-mb", 64, "--comm", 0.05,
            "--opt", 0.2 / 4 * scale)
        assert {k: row[k] for k in METRIC_NAMES} == simulated_metrics(expected), (name, scale)
    assert rows["interleaved-1f1b", 1.0]["chunks"] == 2 and rows["avgpipe", 1.0]["pipelines"] == 2


def test_a_small_grid_is_simulated_in_this_process():
    """Without --workers, the default pool started a fresh interpreter a core (0.7 CPU s each, importing numpy and
    the simulator) for six configurations that take 0.03 s here."""
    code, text, err = pipesim("sweep", "-s", "1f1b,zb-h1,zb-v", "-p", "2,4")
    assert code == 0, err
    assert text.splitlines()[-1] == "simulated in this process"


# auto's search, about 0.7 CPU s here, leads a grid of 14 whose other configurations take milliseconds: at 2 cores
# the first of its 7 chunks' worth, configurations 0 and 7, runs here and puts the other 12 at 6 searches' time.
LED_BY_A_SEARCH = ("-s", "auto,1f1b,zb-h1,zb-h2,gpipe,spectrain,pipeoptim,xpipe", "--prediction",
                   "paper,code,counted", "-p", "8", "-m", "8", "--search-seconds", "3")


@pytest.mark.skipif(usable_cpus() < 2, reason="one usable core: a worker cannot save time")
def test_a_grid_whose_sample_takes_long_enough_starts_workers_and_gives_the_rows_of_one_process(tmp_path):
    where, rows = {}, {}
    for workers in (None, 1, 2):
        out = tmp_path / f"{workers}.csv"
        code, text, err = pipesim("sweep", *LED_BY_A_SEARCH, *(("-j", workers) if workers else ()), "--out", out)
        assert code == 0, err
        where[workers], rows[workers] = text.splitlines()[-2], read_csv(out)
    started = re.fullmatch(r"simulated in (\d+) worker processes \((\d+) configurations? in this one\)", where[None])
    assert started and int(started[1]) >= 2 and int(started[2]) >= 1, where[None]
    assert where[1] == "simulated in this process" and where[2] == "simulated in 2 worker processes"
    assert len(rows[None]) > 8 and rows[None] == rows[1] == rows[2]


METRIC_NAMES = [name for name in Metrics.__dataclass_fields__]


def simulated_metrics(result: dict) -> dict:
    """A `simulate --json` result's figures as a sweep row holds them: its out-of-memory is said per device."""
    return {**{k: result[k] for k in METRIC_NAMES if k != "out_of_memory"},
            "out_of_memory": any(device["out_of_memory"] for device in result["devices"])}


def test_auto_rows_are_searched_per_limit_and_cost_scale_as_simulate_searches_them(tmp_path):
    """R multiplies auto alone; each auto row is `simulate -s auto --activation-limit R` on the scaled costs (the
    search sees the costs it runs on), and R = 2 is at least as fast as R = 1."""
    assert [c.activation_limit for c in Grid(("auto", "zb-h2"), (4,), (8,), 2, activation_limits=(1.0, 2.0),
                                              search_seconds=0.5).configs()] == [1.0, 2.0, None]
    out = tmp_path / "r.csv"
    code, text, err = pipesim("sweep", "-s", "auto,zb-h2", "-p", "4", "-m", "8", "-n", "2", "--activation-limit",
                              "1,2", "--cost-scale", "1,3", "--bwd", "10", "-j", "1", "--out", out)
    assert code == 0, err
    rows = {(r["schedule"], r["activation_limit"], r["cost_scale"]): r for r in read_csv(out)}
    assert set(rows) == {(name, limit, scale) for name, limit in (("auto", 1.0), ("auto", 2.0), ("zb-h2", None))
                         for scale in (1.0, 3.0)}
    for (name, limit, scale), row in rows.items():
        (expected,) = simulate_json("-s", name, "-p", 4, "-m", 8, "-n", 2, "--fwd", 1 * scale, "--bwd", 2.5 * scale,
                                    "--param-mb", 256, "--activation-mb", 64, "--comm", 0.1, "--opt", 0.1 * scale,
                                    *(["--activation-limit", limit] if limit else []))
        assert {k: row[k] for k in METRIC_NAMES} == simulated_metrics(expected), (name, limit, scale)
    for scale in (1.0, 3.0):
        assert rows["auto", 2.0, scale]["time_per_minibatch_ms"] <= rows["auto", 1.0, scale]["time_per_minibatch_ms"]
    assert " R " in text.splitlines()[2]  # the front's table has the column


def dominates(a, b):
    return all(x <= y for x, y in zip(a, b)) and any(x < y for x, y in zip(a, b))


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(*[st.integers(0, 4)] * 3), max_size=40))
def test_pareto_mask_is_brute_force_dominance(points):
    mask = pareto_mask(np.array(points, dtype=float).reshape(len(points), 3))
    expected = [not any(dominates(q, p) for q in points) for p in points]
    assert mask.tolist() == expected


def test_one_front_per_cost_scale_and_minibatch_size():
    def result(scale, m, pipelines, time_ms, memory_mb, staleness):
        return Result(Config("1f1b", 4, m, 1, 1, pipelines, scale),
                      Metrics(time_ms, 1.0, 0.1, memory_mb, staleness, time_ms, 0.0))

    results = [result(1.0, 8, 1, 10, 100, 0), result(1.0, 8, 1, 12, 90, 0), result(1.0, 8, 1, 13, 100, 0),
               result(2.0, 8, 1, 20, 100, 0),  # slower hardware: its own front, not dominated by the first
               result(1.0, 4, 2, 30, 300, 1),  # m·P = 8: competes with the first three, and loses
               result(1.0, 16, 1, 40, 300, 1),  # a bigger mini-batch: its own front
               Result(Config("zb-v", 4, 8, 1, 1, 1, 1.0), reason="--chunks: give 2")]
    assert pareto_front(results) == [0, 1, 5, 3]  # by (cost scale, m·P), fastest first


def test_results_round_trip_through_csv(tmp_path):
    configs = Grid(("1f1b", "zb-v", "xpipe"), (2, 4), (4,), 2, chunks=(1, 4), cost_scales=(0.5, 1.0)).configs()
    results = [r for _, r in sorted(run(MODEL, configs))]
    assert {r.status for r in results} == {"ok", "skipped"}
    path = tmp_path / "r.csv"
    write_results(results, path)
    fronts = set(pareto_front(results))
    ones = {"tensor_parallel": 1, "context_parallel": 1, "expert_parallel": 1}  # typed costs: no estimate's degrees
    assert read_csv(path) == [{**r.record(), **ones, "pareto_front": i in fronts} for i, r in enumerate(results)]
    assert 0 < len(fronts) < len(results)
    assert [p.name for p in tmp_path.iterdir()] == ["r.csv"]  # no temporary file left behind


@pytest.mark.skipif(importlib.util.find_spec("pyarrow") is None, reason="pyarrow not installed (pipesim[parquet])")
def test_results_round_trip_through_parquet(tmp_path):
    import pyarrow.parquet as pq

    results = [r for _, r in sorted(run(MODEL, Grid(("1f1b", "zb-v"), (4,), (8,), 2, chunks=(1, 2)).configs()))]
    fronts = set(pareto_front(results))
    degrees = {"tensor_parallel": 2, "context_parallel": 1, "expert_parallel": 4}
    write_results(results, tmp_path / "r.parquet", degrees)
    assert pq.read_table(tmp_path / "r.parquet").to_pylist() == [{**r.record(), **degrees, "pareto_front": i in fronts}
                                                                 for i, r in enumerate(results)]


def test_grid_file(tmp_path):
    grid = tmp_path / "grid.toml"
    grid.write_text('schedule = ["1f1b", "avgpipe"]\nstages = [2, 4]\nmicrobatches = 8\npipelines = [2, 3]\n'
                    "cost-scale = [0.5, 1]\n")
    out = tmp_path / "r.csv"
    code, _, _ = pipesim("sweep", "--grid", grid, "-n", "2", "-j", "1", "--out", out)
    assert code == 0
    rows = read_csv(out)
    assert len(rows) == 2 * 2 + 2 * 2 * 2
    assert {(r["schedule"], r["pipelines"]) for r in rows} == {("1f1b", 1), ("avgpipe", 2), ("avgpipe", 3)}
    assert {r["cost_scale"] for r in rows} == {0.5, 1.0} and {r["minibatches"] for r in rows} == {2}


@pytest.mark.parametrize("line, refusal", [
    ("stages = [true]", "stages: give a whole number of at least 1 each (got true)"),
    ("cost-scale = [{ a = [false] }]", 'cost-scale: give a finite number above 0 each (got { "a" = [false] })'),
    ("schedule = [true]", "schedule: give names in quotes (got true); choose from gpipe, 1f1b, "),
])
def test_a_grid_files_wrong_value_is_shown_as_toml_writes_it(tmp_path, line, refusal):
    grid, out = tmp_path / "grid.toml", tmp_path / "r.csv"
    grid.write_text(line + "\n")
    code, stdout, err = pipesim("sweep", "--grid", grid, "--out", out)
    assert (code, stdout) == (2, "") and err.startswith(f"error: --grid: {grid}: {refusal}"), err
    assert err.count("\n") == 1 and not out.exists()


def test_html_trade_off_view(tmp_path):
    page = tmp_path / "t.html"
    code, _, _ = pipesim("sweep", "-s", "1f1b,pipedream,zb-h1", "-p", "2,4", "-j", "1", "--html", page)
    assert code == 0
    text = page.read_text()
    assert page.stat().st_size > 1_000_000  # plotly.js is embedded: works offline
    assert "Pareto front" in text and "pipedream p=4 m=8 v=1 P=1" in text


def test_trade_off_view_names_each_schedule_and_shows_one_front_at_a_time():
    """A colour per schedule in the legend, a symbol per staleness, filled on the front and hollow off it, and a
    dropdown with one entry per front (p, cost scale, mini-batch), each showing only its own configurations."""
    from pipesim.planning.sweep import front_group, tradeoff_figure

    configs = Grid(("1f1b", "pipedream", "zb-h1"), (2, 4), (4, 8), 2, cost_scales=(1.0, 2.0)).configs()
    results = [r for _, r in sorted(run(MODEL, configs), key=lambda pair: pair[0])]
    front = pareto_front(results)
    fig = tradeoff_figure(results, front)
    colours = {t.name: t.marker.color for t in fig.data}
    assert sorted(colours) == ["1f1b", "pipedream", "zb-h1"] and len(set(colours.values())) == 3
    groups = sorted({front_group(r.config) for r in results})
    (menu,) = fig.layout.updatemenus
    assert len(menu.buttons) == len(groups) + 1 and menu.buttons[-1].label.startswith("every group")
    by_label = {r.config.label: (r, i in front) for i, r in enumerate(results)}
    for key, button in zip(groups, menu.buttons):
        visible, legend = button.args[0]["visible"], button.args[0]["showlegend"]
        shown = [t for t, v in zip(fig.data, visible) if v]
        points = [by_label[text.split("</b>")[0].removeprefix("<b>")] for t in shown for text in t.text]
        assert {front_group(r.config) for r, _ in points} == {key}
        assert len(points) == sum(front_group(r.config) == key for r in results)
        assert sorted(t.name for t, s in zip(fig.data, legend) if s) == sorted({t.name for t in shown})
        for t in shown:
            for text, symbol in zip(t.text, t.marker.symbol):
                r, best = by_label[text.split("</b>")[0].removeprefix("<b>")]
                assert symbol == ("diamond" if r.metrics.max_staleness == 1 else "circle") + ("" if best else "-open")
    assert [t.visible for t in fig.data] == menu.buttons[0].args[0]["visible"]  # the page opens on the first
    assert "front 1 of 8" in fig.layout.title.text
    assert not any("same point as" in text for t in fig.data for text in t.text)


def test_a_sweep_none_of_whose_configurations_runs_says_why_in_one_line(tmp_path):
    """zb-h2 and dualpipe at m = 2 printed an empty table of fronts, "0 of the 0 configurations that ran", no
    reason and exit 0: now the first reason and the count of the rest, exit 2, as simulate when none can run, and
    no --out written."""
    out = tmp_path / "r.csv"
    code, text, err = pipesim("sweep", "-s", "zb-h2,dualpipe", "-p", "2,4", "-m", "2", "-j", "1", "--out", out)
    assert code == 2 and text == "" and not out.exists()
    assert err.startswith("error: no configuration runs: zb-h2 runs 2p-1 forwards") and err.endswith(
        " (and 3 more skipped)\n") and err.count("\n") == 1, err


def test_a_sweep_that_skipped_nothing_counts_only_what_ran():
    """"2 of the 4 configurations that ran (0 more skipped)": a tally of nothing said beside the count."""
    code, text, err = pipesim("sweep", "-s", "1f1b,zb-h1", "-p", "2,4", "-j", "1")
    words = " ".join(text.split())
    assert code == 0 and "of the 4 configurations that ran" in words and "skipped" not in words, err
    code, text, err = pipesim("sweep", "-s", "1f1b", "-j", "1")  # "1 of the 1 configuration that ran"
    assert code == 0 and "mini-batch size: the 1 configuration that ran" in " ".join(text.split()), err


def test_one_run_under_several_names_is_one_row_naming_the_others(tmp_path):
    """Interleaved 1F1B at v = 1 simulates 1F1B's run, and SpecTrain's s from the paper equals its s from the code:
    each is folded into the first configuration of its run (per cost scale), in the results file, the terminal's
    fronts and the page; other configurations, and skipped ones, stay rows of their own."""
    out, page = tmp_path / "r.csv", tmp_path / "t.html"
    code, text, err = pipesim("sweep", "-s", "1f1b,interleaved-1f1b,spectrain,zb-v", "-p", "2", "-m", "4", "-n", "2",
                              "-v", "1,3", "--prediction", "paper,code", "--cost-scale", "1,2", "-j", "1",
                              "--out", out, "--html", page)
    assert code == 0, err
    rows = read_csv(out)
    shown = {(r["schedule"], r["chunks"], r["prediction"], r["cost_scale"]): r["same_as"] for r in rows}
    assert shown == {**{("1f1b", 1, None, scale): "interleaved-1f1b v=1" for scale in (1.0, 2.0)},
                     **{("interleaved-1f1b", 3, None, scale): "" for scale in (1.0, 2.0)},
                     **{("spectrain", 1, "paper", scale): "spectrain s: code" for scale in (1.0, 2.0)},
                     **{("zb-v", v, None, scale): "" for v in (1, 3) for scale in (1.0, 2.0)}}
    assert [r["status"] for r in rows if r["schedule"] == "zb-v"] == ["skipped"] * 4
    ran, skipped = sum(r["status"] == "ok" for r in rows), sum(r["status"] == "skipped" for r in rows)
    # the counts add up to the grid's 14: "8 configurations (2 skipped, ...)" read as if 2 of the 8 were skipped
    tally = f"{ran} configurations that ran ({skipped} more skipped, 4 more the same schedule as one of them)"
    assert ran + skipped + 4 == 14 and f"size: the {tally}" in " ".join(text.split()) and tally in page.read_text()
    assert "same schedule as" in text.splitlines()[2] and "interleaved-1f1b v=1" in text
    assert "the same schedule as interleaved-1f1b v=1" in page.read_text()


def test_trade_off_view_names_the_configurations_one_dot_hides():
    """PipeDream-2BW reads other weights than PipeDream (another run) in the same time and memory: both are
    drawn on one spot, and each one's hover names the other."""
    from pipesim.planning.sweep import one_row_per_schedule, tradeoff_figure

    configs = Grid(("pipedream", "pipedream-2bw"), (2,), (4,), 4).configs()
    results = one_row_per_schedule([r for _, r in sorted(run(MODEL, configs), key=lambda pair: pair[0])])
    assert len(results) == 2 and not any(r.same_as for r in results)
    fig = tradeoff_figure(results, pareto_front(results))
    texts = {text.split("</b>")[0].removeprefix("<b>"): text for t in fig.data for text in t.text}
    (plain,) = [label for label in texts if label.startswith("pipedream p")]
    (double,) = [label for label in texts if label.startswith("pipedream-2bw")]
    assert texts[plain].endswith(f"same point as {double}")
    assert texts[double].endswith(f"same point as {plain}")


def test_workers_never_import_torch():
    """A worker is a fresh interpreter that unpickles the scenario and runs chunks: check exactly that."""
    probe = (f"import pickle, sys\nfrom pipesim.planning.sweep import Config, run_chunk\n"
             f"scenario = pickle.loads({pickle.dumps(MODEL)!r})\n"
             "(result,) = run_chunk(scenario, [Config('zb-v', 4, 8, 2, 2, 1, 1.0)])\n"
             "print(result.status, 'torch' in sys.modules)\n"
             "print(result.reason, file=sys.stderr)")
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True)
    assert (done.returncode, done.stdout.split()) == (0, ["ok", "False"]), done.stderr


def without(module, monkeypatch):
    """Make `module` look uninstalled to find_spec."""
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == module else find_spec(name, *a))


@pytest.mark.parametrize("args,fragment", [
    (["-s", "1f1b,nope"], "--schedule: unknown 'nope'; choose from gpipe, 1f1b"),
    (["--stages", "4,x"], "--stages: expected whole numbers separated by commas, got '4,x'"),
    (["--microbatches", "0"], "--microbatches: give a whole number of at least 1 each (got 0)"),
    (["--cost-scale", "1,-2"], "--cost-scale: give a finite number above 0 each (got -2.0)"),
    (["--chunks", "1,1"], "--chunks: 1 is given twice"),
    (["--fwd", "1,2"], "--fwd: give one number, the whole model's"),
    (["--grid", "/no/such/grid.toml"], "--grid: cannot read /no/such/grid.toml"),
    (["--grid", "GRID:stages = [4"], "is not valid TOML"),
    (["--grid", "GRID:stages = [4]\nlayers = 2"], "unknown key 'layers'; allowed: schedule, stages"),
    (["--grid", "GRID:cost_scale = [2]"], "unknown key 'cost_scale' (did you mean 'cost-scale'?); allowed: "),
    # a flag's comma list in a grid file: "unknown '1f1b,zb-h1' (did you mean 'zb-h1'?)"
    (["--grid", 'GRID:schedule = "1f1b,zb-h1"'], 'schedule: give several values as a TOML list, schedule = ["1f1b", '
                                                 '"zb-h1"] (got "1f1b,zb-h1")'),
    (["--grid", 'GRID:stages = "2, 4,"'], 'stages = [2, 4] (got "2, 4,")'),
    (["--grid", 'GRID:stages = ["4"]'], 'stages: give a whole number of at least 1 each (got "4")'),
    (["--grid", "GRID:stages = [4]", "-p", "8"], "--stages and --grid both give stages"),
    (["--out", "/no/such/dir/r.csv"], "--out: cannot write /no/such/dir/r.csv: folder /no/such/dir does not exist"),
    (["--out", "OUT/r.txt"], "--out: give a .csv or .parquet file"),
    (["--out", "OUT/r.parquet", "WITHOUT:pyarrow"],
     "needs pyarrow, which is not installed: pip install 'pipesim[parquet]'"),
    (["--ray", "auto", "WITHOUT:ray"], "--ray auto needs ray, which is not installed: pip install 'pipesim[ray]'"),
    (["--ray", "ray://127.0.0.1:1", "WITHOUT:grpc"],  # ray.init raised its ValueError: a traceback
     "--ray ray://127.0.0.1:1: a ray:// address is Ray Client's, which needs grpcio: pip install 'ray[client]'"),
    (["--ray", "127.0.0.1:1"], "--ray 127.0.0.1:1: nothing answers at 127.0.0.1:1 (Connection refused)"),  # Ray
    # retried it for minutes, writing its own log lines
    (["--ray", "127.0.0.1:²"], "--ray: give auto, local, HOST:PORT or ray://HOST:PORT, with a port from 0 to "
                               "65,535 (got '127.0.0.1:²')"),
    (["--ray", "127.0.0.1:65536"], "(got '127.0.0.1:65536')"),  # socket dialled another port, 65536 mod 2**16
    (["--ray", "foo"], "--ray: give auto, local, HOST:PORT or ray://HOST:PORT"),  # ray.init's traceback: "Invalid
    (["--ray", " :6379"], "(got ' :6379')"),  # address format"
    (["--workers", "0"], "--workers"),
    (["--optimizer", "lion"], "--optimizer: choose from"),
    (["-s", "auto", "--activation-limit", "1,x"], "--activation-limit: give a finite number above 0 (got 'x')"),
    (["-s", "auto", "--activation-limit", "0.01"], "--activation-limit: R = 0.01 lets a device hold"),
    (["-s", "auto", "--search-seconds", "0"], "--search-seconds: give a finite number above 0 and at most 86,400 "
                                               "(got 0)"),
    (["--grid", "GRID:activation-limit = [-1]"], "activation-limit: give a finite number above 0 each (got -1)"),
    # an axis no method in the grid reads was dropped, exit 0: 1f1b swept alone
    (["-s", "1f1b", "--chunks", "2"], "--chunks applies to interleaved-1f1b, zb-v, dualpipev, dualpipe only, not 1f1b"),
    (["-s", "1f1b,zb-h1", "--prediction", "paper"],
     "--prediction applies to spectrain, pipeoptim, xpipe only, not 1f1b, zb-h1"),
    (["-s", "1f1b", "--grid", "GRID:chunks = [2]"],  # a grid's axis too: 1f1b swept alone, chunks 1
     "--chunks applies to interleaved-1f1b, zb-v, dualpipev, dualpipe only, not 1f1b"),
    # it prices W alone, and neither method splits its backward: taken, it changed nothing
    (["-s", "gpipe,1f1b", "--wgrad-fraction", "0.2"], "--wgrad-fraction prices the weight gradient a split backward "
                                                      "runs apart (W), and none of gpipe, 1f1b splits it"),
])
def test_bad_input_is_one_line_exit_2_nothing_written(tmp_path, monkeypatch, args, fragment):
    out = tmp_path / "out"
    out.mkdir()
    expanded = []
    for arg in args:
        if arg.startswith("GRID:"):
            (tmp_path / "grid.toml").write_text(arg[5:])
            arg = str(tmp_path / "grid.toml")
        elif arg.startswith("WITHOUT:"):
            without(arg[8:], monkeypatch)
            continue
        expanded.append(arg.replace("OUT", str(out)))
    methods = [] if "-s" in expanded else ["-s", "1f1b"]  # a second -s adds its methods to the first
    code, _, err = pipesim("sweep", *methods, "-j", "1", "--html", out / "t.html", *expanded)
    assert code == 2
    assert fragment in err
    assert "Traceback" not in err and err.strip().count("\n") == 0
    assert os.listdir(out) == []


@pytest.mark.slow
def test_ray_tasks_give_the_same_rows():
    ray = pytest.importorskip("ray", reason="ray not installed: pip install -e '.[test]' brings it")
    configs = Grid(("1f1b", "zb-v", "avgpipe"), (2, 4), (4, 8), 2, chunks=(1, 2)).configs()
    on_ray = sorted(run(MODEL, configs, ray_address="local"))  # starts a local cluster and shuts it down
    assert not ray.is_initialized()
    assert on_ray == sorted(run(MODEL, configs))


def test_the_fronts_say_what_their_short_headers_are():
    """The fronts' s and R columns, dashes for most methods, were headers no line explained."""
    code, text, err = pipesim("sweep", "-s", "1f1b,auto,xpipe", "-p", "2", "-j", "1")
    words = " ".join(text.split())
    assert code == 0, err
    assert all(f"{header}:" in words for header in ("v", "P", "cost×", "s", "R")), text
    assert "s: the source of prediction distances (--prediction); R: auto's activation limit" in words


def test_the_trade_offs_hover_and_the_fronts_table_write_each_figure_alike():
    """A run of a few KiB: its peak read "0 MiB" in the hover and the table (plotly's ",.0f"), its rate 0.176 "0.2"
    and its time "12345.679" in the hover beside the table's ".3f"; each is written by the page's one rule per unit,
    and the axes separate thousands ("12,000" where plotly wrote "12k")."""
    from pipesim.planning.sweep import fronts_table, tradeoff_figure

    config = Config("1f1b", 2, 4, 2, 1, 1, 1.0)
    result = Result(config, Metrics(time_per_minibatch_ms=12345.6789, samples_per_s=0.176, bubble_fraction=0.073,
                                    peak_memory_mb=0.004, max_staleness=0, makespan_ms=24691.3578,
                                    exposed_comm_ms=0.0))
    fig = tradeoff_figure([result], [0])
    (hover,) = fig.data[0].text
    assert "12,345.679 ms per mini-batch, 0.176 samples/s<br>peak <0.01 MiB, staleness 0, bubble 7.3%" in hover
    for axis in (fig.layout.xaxis, fig.layout.yaxis):  # whole steps of ms or MiB
        assert next(stop.value for stop in axis.tickformatstops if stop.dtickrange[0] == 1) == ","
    cells = fronts_table([result]).data[0].cells
    assert [column[0] for column in cells.values[2:]] == ["12,345.679", "<0.01", "0", "0.176", "7.3%"]
    assert cells.format is None


def test_the_trade_offs_hover_and_the_fronts_table_mark_a_configuration_over_its_devices_memory():
    """The results carried out_of_memory and sweep's table a memory column, but the page's hover and fronts table
    showed an OOM configuration as if it ran: both now mark it, the table's column only where one is over."""
    from pipesim.planning.sweep import OOM_NAME, fronts_table, tradeoff_figure

    def result(p: int, out_of_memory: bool) -> Result:
        return Result(Config("1f1b", p, 8, 1, 1, 1, 1.0), Metrics(
            time_per_minibatch_ms=100.0 / p, samples_per_s=1.0, bubble_fraction=0.1, peak_memory_mb=1000.0 / p,
            max_staleness=0, makespan_ms=100.0 / p, exposed_comm_ms=0.0, out_of_memory=out_of_memory))

    over, fits = result(2, True), result(4, False)
    fig = tradeoff_figure([over, fits], [0, 1])
    hovers = {x: text for trace in fig.data if trace.name != OOM_NAME  # a front per p; the OOM ring has none
              for x, text in zip(trace.x, trace.text)}
    assert "peak 500 MiB (OOM: past a device's memory), staleness 0" in hovers[50.0]
    assert "OOM" not in hovers[25.0]
    table = fronts_table([over, fits]).data[0]
    assert (table.header.values[-1], list(table.cells.values[-1])) == ("memory", ["OOM", "fits"])
    assert "memory" not in fronts_table([fits]).data[0].header.values


def test_the_trade_off_rings_each_configuration_over_its_devices_memory_in_its_group():
    """An OOM configuration was marked in its hover alone, drawn as one that fits: each group's are ringed now, by a
    trace of their points (in the legend, no hover of its own) shown with its group's points and with no other."""
    from pipesim.planning.sweep import OOM_NAME, tradeoff_figure

    def result(p: int, m: int, out_of_memory: bool) -> Result:
        return Result(Config("1f1b", p, m, 1, 1, 1, 1.0), Metrics(
            time_per_minibatch_ms=100.0 / p + m, samples_per_s=1.0, bubble_fraction=0.1,
            peak_memory_mb=1000.0 / p + m, max_staleness=0, makespan_ms=100.0, exposed_comm_ms=0.0,
            out_of_memory=out_of_memory))

    results = [result(2, 8, True), result(2, 16, False), result(4, 8, False), result(2, 32, True)]
    fig = tradeoff_figure(results, [0, 1, 2, 3]).to_plotly_json()  # groups p=2 m=8, p=2 m=16, p=2 m=32, p=4 m=8
    rings = [t for t in fig["data"] if t["name"] == OOM_NAME]
    assert [(list(t["x"]), list(t["y"])) for t in rings] == [([58.0], [508.0]), ([82.0], [532.0])]
    assert all(t["hoverinfo"] == "skip" and t["marker"]["symbol"] == "circle-open" for t in rings)
    assert [t["visible"] for t in rings] == [True, False]  # the first group's view: its ring alone
    views = fig["layout"]["updatemenus"][0]["buttons"]
    for view in views:
        shown = [(t["name"], x) for t, visible in zip(fig["data"], view["args"][0]["visible"]) if visible
                 for x in t["x"]]
        ringed = {x for name, x in shown if name == OOM_NAME}
        assert ringed == {x for name, x in shown if name != OOM_NAME and x in (58.0, 82.0)}, view["label"]


def test_ray_finding_no_cluster_here_says_what_to_give_in_pipesims_words():
    """Ray's own line names "the `--address` flag", its CLI's: pipesim's is --ray."""
    from pipesim.commands.sweep import _unreached

    said = _unreached("auto", ConnectionError("Could not find any running Ray instance. Please specify the one to "
                                              "connect to by setting `--address` flag or `RAY_ADDRESS` environment "
                                              "variable."))
    assert said.startswith("--ray auto: no Ray cluster runs on this host") and "--address" not in said
    assert "--ray local" in said and "ray start --head" in said
    unreached = _unreached("10.0.0.1:6379", ConnectionError("GCS unreachable\ndetails"))
    assert unreached == "--ray 10.0.0.1:6379: GCS unreachable"


def test_the_terminal_shows_whole_fronts_and_the_results_file_marks_every_front_row(tmp_path, monkeypatch):
    """The terminal cut the fronts at 20 rows, one front after 2 of its 3, and said "--out lists them all" though
    nothing in the CSV told a front's rows from the rest."""
    import pipesim.commands.sweep as sweeping
    from pipesim.planning.sweep import front_group

    monkeypatch.setattr(sweeping, "FRONT_ROWS", 5)
    out = tmp_path / "r.csv"
    code, text, err = pipesim("sweep", "--grid", REPO / "examples" / "grid.toml", "--out", out)
    assert code == 0, err
    marked = [row for row in read_csv(out) if row["pareto_front"]]
    sizes = Counter(front_group(Config(**{f.name: row[f.name] for f in fields(Config)})) for row in marked)
    ends = list(itertools.accumulate(size for _, size in sorted(sizes.items())))
    shown = max(end for end in ends if end <= 5)
    assert len(sizes) > 2 and ends[-1] == len(marked) > shown  # several fronts, not all shown
    assert (f"and {len(marked) - shown} more rows on the fronts after these: {out}'s pareto_front column marks "
            "them") in " ".join(text.split()), text
    # fewer rows allowed than the first front has: that front whole
    results = [r for _, r in sorted(run(MODEL, Grid(("1f1b", "pipedream", "xpipe"), (2, 4), (8,), 2).configs()))]
    front = pareto_front(results)
    first = [i for i in front if front_group(results[i].config) == front_group(results[front[0]].config)]
    monkeypatch.setattr(sweeping, "FRONT_ROWS", len(first) - 1)  # a first front longer than the rows allowed:
    assert len(first) > 1 and sweeping._whole_fronts(results, front) == first[:-1]  # its fastest, not hundreds


def test_memory_gb_caps_each_configuration_as_simulate_caps_its_run(tmp_path):
    """New-user pass: sweep had no --memory-gb (simulate's and tune's cap), so a grid could be held only to a part's or
    a cluster file's memory. Each row is over its cap as the `pipesim simulate` line it writes, which repeats the cap,
    says; a cap past the part's memory is refused as simulate refuses it."""
    out = tmp_path / "r.csv"
    code, _, err = pipesim("sweep", "-s", "1f1b", "-p", "2,4", "--memory-gb", 2, "--out", out)
    assert code == 0, err
    rows = {int(row["stages"]): row for row in csv.DictReader(out.open())}
    assert {p: row["out_of_memory"] for p, row in rows.items()} == {2: "True", 4: "False"}
    for row in rows.values():
        assert "--memory-gb 2.0" in row["command"]
        [simulated] = simulate_json(*row["command"].split()[2:])
        assert simulated["devices"][0]["memory_limit_mb"] == 2048
        assert str(any(device["out_of_memory"] for device in simulated["devices"])) == row["out_of_memory"]
    code, out_text, err = pipesim("sweep", "-s", "1f1b", "--cluster", "examples/cluster.json", "--memory-gb", 100)
    assert code == 2 and out_text == "" and len(err.strip().splitlines()) == 1, err
    assert "--memory-gb 100: more than the 80 GiB of --cluster examples/cluster.json's gpu0" in err
