"""The benchmarks' tables print as the command line's do (commands/tables.py): at 80 columns in parts with nothing
cut, piped in whole rows. They printed at a fixed 160 or 200 columns, so at 80 a terminal wrapped their rows
across lines, numbers split between two."""

from __future__ import annotations

import io
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from rich.console import Console

from benchmarks.published_runs import print_rows
from tests.conftest import at_columns, script_module

REPO = Path(__file__).resolve().parents[1]
VALUE = re.compile(r"[\d,.]+")


def _bench_simulate_rows(columns: int | None) -> list[list[str]]:
    """bench_simulate.py's one row (1F1B at p=4, m=8), piped with $COLUMNS at `columns` (None: unset), as the cells
    of each line that holds it (one per part), with every line of the output no wider than `columns`."""
    env = {key: value for key, value in os.environ.items() if key != "COLUMNS"}
    if columns is not None:
        env["COLUMNS"] = str(columns)
    done = subprocess.run([sys.executable, str(REPO / "benchmarks" / "bench_simulate.py"), "--sizes", "4x8"],
                          capture_output=True, text=True, env=env, check=True)
    lines = done.stdout.splitlines()
    assert "…" not in done.stdout
    if columns is not None:
        assert max(map(len, lines)) <= columns, done.stdout
    rows = [[cell.strip() for cell in line.strip().strip("│").split("│")] for line in lines]  # the box's edges off
    return [row for row in rows if row[0] == "4x8"]


def test_a_benchmarks_table_at_80_columns_keeps_every_number_whole_and_piped_its_rows_whole():
    """bench_simulate.py's 16 columns: piped, one line holds the row; at 80 columns the row is in parts, each led by
    its size, and every one of its 15 figures is a whole number in one cell."""
    (whole,) = _bench_simulate_rows(None)
    assert len(whole) == 16 and whole[:3] == ["4x8", "128", "328"]
    parts = _bench_simulate_rows(80)
    assert len(parts) > 1 and all(part[0] == "4x8" for part in parts)
    figures = [cell for part in parts for cell in part[1:]]
    assert len(figures) == 15 and all(VALUE.fullmatch(cell) for cell in figures), parts
    assert figures[:2] == ["128", "328"]


def test_published_runs_prints_its_rows_with_every_figure_whole_at_80_columns_and_piped_one_line_a_row(
        monkeypatch, capsys):
    """published_runs.py printed its rows 114 columns wide, which a terminal of 80 wrapped, a row's figures on the
    line under its name; through print_table at 80 columns every line fits and a row's three figures stay on one
    line, and piped each row and each command is one line, as docs/hardware.md quotes them."""
    rows = json.loads((REPO / "benchmarks" / "published_runs.json").read_text())["rows"]
    figures = [[f"{r['predicted']:.2f}", f"{r['published']:.2f}", f"{r['error']:+.1%}"] for r in rows]
    at_columns(monkeypatch, 80)
    print_rows(rows)
    out = capsys.readouterr().out
    lines = out[:out.index("Each row's command")].splitlines()  # the commands stay whole: a terminal wraps them
    assert max(map(len, lines)) <= 80, "\n".join(lines)
    assert all(any(line.split()[-3:] == row for line in lines) for row in figures), "\n".join(lines)
    at_columns(monkeypatch, None)
    print_rows(rows)
    lines = capsys.readouterr().out.splitlines()
    for r, row in zip(rows, figures):
        assert [*r["run"].split(), r["unit"], *row] in [line.split() for line in lines], r["run"]
        assert f"  {r['command']}" in lines


# Each published_*.py script's printer and its arguments from the rows it recorded (benchmarks/NAME.json).
PRINTERS = {
    "published_memory": ("print_rows", lambda recorded: (recorded,)),
    "published_moe": ("print_rows", lambda recorded: (recorded["rows"],)),
    "published_h100": ("print_rows", lambda recorded: ([{**r, "layout": r["run"]} for r in recorded["rows"]],
                                                       recorded["nemo_summary_rows"])),
    "published_deepseek": ("print_row", lambda recorded: (recorded,)),
}


def _commands(recorded: object) -> list[str]:
    """Every "command" a recorded JSON holds, however deep."""
    if isinstance(recorded, list):
        return [c for value in recorded for c in _commands(value)]
    if not isinstance(recorded, dict):
        return []
    own = [recorded["command"]] if "command" in recorded else []
    return own + [c for value in recorded.values() for c in _commands(value)]


@pytest.mark.parametrize("name", PRINTERS)
def test_a_published_scripts_lines_fit_80_columns_between_words_and_piped_each_command_is_one_line(name):
    """published_memory.py printed its first two tables as fixed-width rows (up to 220 columns), and it and
    published_moe, published_h100 and published_deepseek printed their commands and notes with print(), which a
    terminal of 80 columns broke inside a flag or a figure: on a terminal every line fits (a word wider than it, a
    --layout, alone on its line) and each command's words are all there in order; piped each command is one line."""
    recorded = json.loads((REPO / "benchmarks" / f"{name}.json").read_text())
    printer, arguments = PRINTERS[name]
    commands = _commands(recorded)
    assert commands
    with script_module(name) as script:
        for terminal in (True, False):
            console = Console(width=80, file=io.StringIO(), force_terminal=terminal, color_system=None)
            getattr(script, printer)(*arguments(recorded), console)
            out = console.file.getvalue()
            assert "…" not in out
            if terminal:
                assert all(len(line) <= 80 or " " not in line.strip() for line in out.splitlines()), out
                words = " ".join(out.split())
                assert all(" ".join(command.split()) in words for command in commands)
            else:
                assert set(f"  {command}" for command in commands) <= set(out.splitlines())
