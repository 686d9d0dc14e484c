"""The tables the README shows are the ones their commands print now, figure for figure.

test_readme.py runs every command the README shows; test_published_runs.py holds its published run's figure.
Here the deterministic tables beside a command (what-if costs, auto's order, tune's pick from a committed
profile) are printed again and compared row by row, word by word: a README row that ends in "..." is the
printed row cut short, compared up to there. Timings (ms/step of a run, seconds taken) are not compared."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from tests.conftest import pipesim, simulate_json

REPO = Path(__file__).resolve().parents[1]
README = (REPO / "README.md").read_text()


def section(title: str) -> str:
    """The README's `## title` section."""
    return README.split(f"\n## {title}\n")[1].split("\n## ")[0]


def shown_after(text: str, command_start: str) -> tuple[str, list[str]]:
    """The command in `text` that starts with `command_start` and the lines of the first output block after it."""
    command = next(line.split("  #")[0].strip() for line in text.splitlines()
                   if line.startswith(command_start))
    after = text.split(command, 1)[1].split("```", 1)[1]  # past the end of the command's block
    return command, re.search(r"```\n(.*?)```", after, flags=re.S).group(1).splitlines()


def words_agree(shown: list[str], printed: str, first_words: tuple[str, ...]) -> None:
    """Every shown line starting with one of `first_words` starts a printed line, word for word."""
    printed_rows = [line.split() for line in printed.splitlines()]
    rows = [line.split() for line in shown if line.split()[:1] and line.split()[0] in first_words]
    assert rows, f"no row of {first_words} in the README's block"
    for row in rows:
        words = row[:row.index("...")] if "..." in row else row
        assert any(p[:len(words)] == words for p in printed_rows), \
            f"README row {' '.join(row)!r} is not printed:\n{printed}"


@pytest.mark.parametrize("title, command_start, first_words", [
    ("Simulate: what-if, side by side", "pipesim simulate -s 1f1b", ("1f1b", "zb-h1", "pipedream", "xpipe")),
    ("auto: the schedule searched for your costs", "pipesim simulate -s auto", ("auto", "zb-h1", "zb-h2", "1f1b")),
    ("Sweep and tune: many configurations at once", "pipesim tune", ("best", "over", "note:")),
])
def test_a_readme_table_is_what_its_command_prints(title, command_start, first_words, tmp_path, monkeypatch):
    monkeypatch.chdir(REPO)
    command, shown = shown_after(section(title), command_start)
    args = [str(tmp_path / a) if a.endswith(".html") else a for a in shlex.split(command)[1:]]
    code, out, err = pipesim(*args)
    assert code == 0, err
    words_agree(shown, out, first_words)


@pytest.mark.slow
def test_the_deepseek_what_if_prose_is_what_its_command_prints(monkeypatch):
    """The figures the README quotes after its DeepSeek-V3 what-if, in order: DualPipeV's step (s) and peak (GiB),
    1F1B's step, ZB-V's step and peak, as the command prints them; then DualPipeV's peak in BF16 (the command
    without its FP8 flags), beyond the H100's 80 GiB as the sentence says."""
    monkeypatch.chdir(REPO)
    text = section("Models and parallelism of now")
    command = next(line for line in text.splitlines() if line.startswith("pipesim") and "deepseek-v3" in line)
    sentence = text.split("above, in FP8 as DeepSeek-V3 trained,", 1)[1].split("does not fit either")[0]
    quoted = [float(number) for number in re.findall(r"\d+\.\d+", sentence)]
    args = shlex.split(command)[2:]
    fp8 = {result["schedule"].split()[0]: result for result in simulate_json(*args)}
    schedules = {i for i, arg in enumerate(args) if arg == "-s"}
    bf16_args = [arg for i, arg in enumerate(args) if i not in schedules and i - 1 not in schedules
                 and arg not in ("--dtype", "fp8", "--fp8-recipe", "deepseek")]
    (bf16,) = simulate_json(*bf16_args, "-s", "dualpipev")
    seconds = {name: round(result["time_per_minibatch_ms"] / 1e3, 1) for name, result in fp8.items()}
    gib = {name: round(result["peak_memory_mb"] / 1024, 1) for name, result in fp8.items()}
    assert quoted == [seconds["dualpipev"], gib["dualpipev"], seconds["1f1b"], seconds["zb-v"], gib["zb-v"],
                      round(bf16["peak_memory_mb"] / 1024, 1)]
    assert gib["dualpipev"] < 80 < gib["zb-v"] and bf16["peak_memory_mb"] / 1024 > 80


@pytest.mark.slow
def test_the_405b_what_if_step_is_what_its_command_prints(monkeypatch):
    """The step the README quotes after its Llama 3.1 405B what-if (torchtitan's layout) is its command's, in s."""
    monkeypatch.chdir(REPO)
    text = section("Models and parallelism of now")
    command = next(line for line in text.splitlines() if line.startswith("pipesim") and "llama3.1-405b" in line)
    quoted = float(re.search(r"as torchtitan runs it:\s+(\d+\.\d) s a step", text).group(1))
    (result,) = simulate_json(*shlex.split(command)[2:])
    assert quoted == round(result["time_per_minibatch_ms"] / 1e3, 1)


def test_the_simulate_tour_gpipe_figures_are_what_its_command_prints():
    """docs/simulate.md's tour: its gpipe command prints makespan_ms 33 = (m+p-1)(F+B) and bubble 3/11 (without
    --minibatches 1 it simulated N = 2 and printed 66)."""
    tour = (REPO / "docs" / "simulate.md").read_text().split("\n## Tour\n")[1]
    command = next(line for line in tour.splitlines() if line.startswith("pipesim simulate --schedule gpipe"))
    args = shlex.split(command)[2:]
    assert args[-1] == "--json"
    (result,) = simulate_json(*args[:-1])
    assert result["makespan_ms"] == pytest.approx(33) and result["bubble_fraction"] == pytest.approx(3 / 11)
