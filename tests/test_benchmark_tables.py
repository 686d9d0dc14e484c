"""The benchmarks' tables print as the command line's do (commands/tables.py): at 80 columns in parts with nothing
cut, piped in whole rows. They printed at a fixed 160 or 200 columns, so at 80 a terminal wrapped their rows
across lines, numbers split between two."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

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
