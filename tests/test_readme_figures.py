"""The figures the README's prose quotes are what their commands print now or what the committed records hold.

test_readme.py runs every command the README shows, holds the tables beside them (what-if costs, auto's order,
tune's pick from a committed profile, a run's losses) to what they printed there, and holds the Models section's
figures; test_published_runs.py holds its published run's figure. Here the prose's other deterministic figures are
what their commands print or what the committed records hold. Timings (ms/step of a run, seconds taken, a
calibration's costs) are not compared."""

from __future__ import annotations

import json
import re
import shlex
import statistics
from pathlib import Path

import pytest

from benchmarks.bench_auto import bubble
from pipesim.schedules import METHODS
from tests.conftest import simulate_json
from tests.helpers import NUMBER_WORDS, shown_after
from tests.helpers import readme_prose as prose
from tests.helpers import readme_section as section

REPO = Path(__file__).resolve().parents[1]
README = (REPO / "README.md").read_text()


def test_the_simulate_tour_gpipe_figures_are_what_its_command_prints():
    """docs/simulate.md's tour: its gpipe command prints makespan_ms 33 = (m+p-1)(F+B) and bubble 3/11 (without
    --minibatches 1 it simulated N = 2 and printed 66)."""
    tour = (REPO / "docs" / "simulate.md").read_text().split("\n## Tour\n")[1]
    command = next(line for line in tour.splitlines() if line.startswith("pipesim simulate --schedule gpipe"))
    args = shlex.split(command)[2:]
    assert args[-1] == "--json"
    (result,) = simulate_json(*args[:-1])
    assert result["makespan_ms"] == pytest.approx(33) and result["bubble_fraction"] == pytest.approx(3 / 11)


def test_the_methods_table_lists_every_method_and_the_opening_counts_them():
    """The table of families names every method once, and the opening sentence counts them in words."""
    families = re.findall(r"^\| [a-z].*\| (`.*`) \|$", README, flags=re.M)
    listed = [name for row in families for name in re.findall(r"`([a-z0-9-]+)`", row)]
    assert sorted(listed) == sorted(METHODS)
    assert f"pipesim predicts what {NUMBER_WORDS[len(METHODS)]} pipeline schedules do" in " ".join(README.split())


def test_the_simulate_sections_costs_and_makespan_are_what_its_commands_print(monkeypatch):
    """The first table's costs are the defaults the prose names; the gpipe line's makespan is (m+p-1)(F+B)."""
    monkeypatch.chdir(REPO)
    text = prose("Simulate: what-if, side by side")
    fwd_ms, bwd_ms = re.search(r"defaults: (\d+) ms forward, (\d+) ms backward per device", text).groups()
    command, _ = shown_after(section("Simulate: what-if, side by side"), "pipesim simulate -s 1f1b")
    args = [a for a in shlex.split(command)[2:] if not a.endswith(".html") and a != "--html"]
    assert simulate_json(*args) == simulate_json(*args, "--fwd", fwd_ms, "--bwd", bwd_ms)
    line = next(line for line in section("Simulate: what-if, side by side").splitlines()
                if line.startswith("pipesim simulate -s gpipe"))
    command, comment = line.split("#")
    args = shlex.split(command)[2:]
    assert args[-1] == "--json"
    (result,) = simulate_json(*args[:-1])
    shape = {flag: float(args[args.index(flag) + 1]) for flag in ("-p", "-m", "--fwd", "--bwd")}
    makespan_ms = (shape["-m"] + shape["-p"] - 1) * (shape["--fwd"] + shape["--bwd"])
    assert result["makespan_ms"] == pytest.approx(makespan_ms)
    assert comment.strip() == f"makespan (m+p-1)(F+B) = {makespan_ms:g} ms"


def test_the_auto_sections_figures_are_what_its_command_and_the_papers_costs_give(monkeypatch):
    """auto's step is the slow stages' compute alone, m(F + B); on the zero-bubble paper's costs
    (benchmarks/zero_bubble_paper.json, as `python benchmarks/bench_auto.py paper` prints them) auto at R = 1 is
    ZB-1p in every setting and at R = 2 beats or ties ZB-2p, at the paper's four places."""
    monkeypatch.chdir(REPO)
    text = prose("auto: the schedule searched for your costs")
    command, _ = shown_after(section("auto: the schedule searched for your costs"), "pipesim simulate -s auto")
    args = [a for a in shlex.split(command)[2:] if not a.endswith(".html") and a != "--html"]
    (auto, *_) = simulate_json(*args)
    per_stage = {flag: [float(ms) for ms in args[args.index(flag) + 1].split(",")] for flag in ("--fwd", "--bwd")}
    compute_ms = float(args[args.index("-m") + 1]) * max(map(sum, zip(*per_stage.values())))
    assert auto["time_per_minibatch_ms"] == pytest.approx(compute_ms)
    assert f"auto reaches their compute alone ({compute_ms:g} ms)" in text
    rows = json.loads((REPO / "benchmarks" / "zero_bubble_paper.json").read_text())["rows"]
    at_1 = [round(bubble("auto", row, 1.0, None), 4) - row["bubble"]["zb-1p"] for row in rows]
    at_2 = [round(bubble("auto", row, 2.0, None), 4) - row["bubble"]["zb-2p"] for row in rows]
    assert at_1.count(0) == len(rows) and all(d <= 0 for d in at_2)
    assert (f"auto equals ZB-1p at R = 1 in all {len(rows)} settings and beats ZB-2p at R = 2 in "
            f"{sum(d < 0 for d in at_2)}, ties it in {at_2.count(0)}") in text


def _published_row_label(row: dict) -> str:
    """The README table's row a published run counts in."""
    if row["run"].startswith("Megatron"):
        return "Narayanan et al. 2021 (Megatron-LM)"
    return "Korthikanti et al. 2022, iterations" if row["unit"] == "s" else "Korthikanti et al. 2022, one 22B layer"


def _pct(fraction: float) -> str:
    return f"{100 * fraction:.1f} %"


def test_the_published_runs_table_and_sentences_are_the_record():
    """The table of published runs (rows, median and worst |error| per paper), the sentence under it and the
    175B's measured step and error are benchmarks/published_runs.json's (test_published_runs.py holds the record to
    its script, one row per paper, and the 175B's predicted step to the README's command)."""
    records = json.loads((REPO / "benchmarks" / "published_runs.json").read_text())["rows"]
    title = "What-if GPUs: a published run, predicted from the catalogue"
    table = [line.split(" | ") for line in section(title).splitlines() if line.startswith("| ") and "---" not in line]
    shown = {cells[0][2:]: cells[1:] for cells in table[1:]}
    assert len(shown) == 3
    for label, cells in shown.items():
        errors = [abs(r["error"]) for r in records if label.startswith(_published_row_label(r))]
        assert cells == [str(len(errors)), _pct(statistics.median(errors)), _pct(max(errors)) + " |"], label
    errors = [abs(r["error"]) for r in records]
    outside = [r for r in records if abs(r["error"]) > 0.10]
    sizes = [float(re.match(r"Megatron ([\d.]+)B \(t\d+ p\d+ d\d+ v[2-9]\)", r["run"]).group(1)) for r in outside]
    fast = [r["error"] for r in outside]  # too high a TFLOP/s
    assert min(fast) > 0
    assert (f"All {len(records)}: median {_pct(statistics.median(errors))}, {sum(e <= 0.10 for e in errors)} within "
            f"10 %. Outside: Megatron-LM 2021's interleaved {min(sizes):.0f}–{max(sizes):.0f}B runs, "
            f"{100 * min(fast):.0f}–{100 * max(fast):.0f} % fast.") in prose(title)
    (gpt3,) = [r for r in records if r["run"] == "Korthikanti 175B SP + selective"]
    assert (f"they measured {gpt3['published']:.2f} s per iteration; pipesim predicts {gpt3['predicted']:.2f} s "
            f"({_pct(gpt3['error']).replace('-', '−')})") in prose(title)


FIDELITY_RUNS = ("fidelity-cpu2-day6-quiet-after", "fidelity-cpu2-day7-quiet-after-1",
                 "fidelity-cpu2-day7-quiet-after-2")


def test_the_fidelity_figures_are_the_committed_runs():
    """The three quiet runs of `benchmarks/fidelity.py` docs/fidelity.md tabulates (traces/measured/): per run the
    median over methods of |iteration error|, the range of the runs' noise floors and their largest median
    peak-memory error, as the README quotes them."""
    runs = [json.loads((REPO / "traces" / "measured" / f"{name}.json").read_text()) for name in FIDELITY_RUNS]
    (methods,) = {len(run["methods"]) for run in runs}
    errors = [f"{100 * statistics.median(abs(m['iteration_error']) for m in run['methods']):.1f}" for run in runs]
    noise = [100 * run["noise_floor"] for run in runs]
    memory = max(statistics.median(m["memory_error"] for m in run["methods"] if m["memory_error"] is not None)
                 for run in runs)
    assert (f"three quiet runs on two days: iteration time within {', '.join(errors[:-1])} and {errors[-1]} % "
            f"(median of {methods} methods; noise floor {min(noise):.0f}-{max(noise):.0f} %), peak memory "
            f"{_pct(memory)}") in prose("Compare and view: predicted against measured")
