"""Tables never cut a number: every command's table at 80 and 120 columns, and the fitting itself over random
tables at any width."""

from __future__ import annotations

import io
import re
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from rich import box
from rich.console import Console
from rich.table import Table

from pipesim.commands.tables import SHORT_CELL, print_paragraph, print_table, print_table_last_below, print_tables
from pipesim.traces.metrics import rate_text
from tests.conftest import at_columns, pipesim

REPO = Path(__file__).resolve().parents[1]
NUMBER = re.compile(r"\d[\d,.]*%?")


def rendered(table: Table, width: int | None, keys: int = 1) -> list[str]:
    """The lines `print_table` writes for `table` with $COLUMNS at `width` (None: piped, no limit)."""
    out = io.StringIO()
    with pytest.MonkeyPatch.context() as patch:
        if width is None:
            patch.delenv("COLUMNS", raising=False)
        else:
            patch.setenv("COLUMNS", str(width))
        print_table(table, Console(file=out, width=120, color_system=None), keys=keys)
    return out.getvalue().splitlines()


values = st.one_of(
    st.integers(0, 10**7).map(lambda n: f"{n:,}"),
    st.floats(0, 1e5, allow_nan=False).map(lambda x: f"{x:,.3f}"),
    st.floats(0, 1).map(lambda x: f"{x:.1%}"),
    st.sampled_from(["fits", "OOM on devices 0,1,2,3", "xpipe (s: paper)", "2% slower: busiest device 24,536 vs "
                     "24,031 ms/step; same as pipedream-2bw p=4", "-"]),
)


@settings(max_examples=60, deadline=None)
@given(columns=st.integers(1, 14), rows=st.integers(0, 5), width=st.integers(40, 200), data=st.data())
def test_no_cell_is_cut_at_any_width(columns, rows, width, data):
    table = Table(title="a title " * data.draw(st.integers(0, 30)), caption="a caption " * 12)
    headers = data.draw(st.lists(st.sampled_from(["schedule", "ms/step", "samples/s", "peak MiB", "why not", "p"]),
                                 min_size=columns, max_size=columns))
    for header in headers:
        table.add_column(header, justify="right")
    cells = [data.draw(st.lists(values, min_size=columns, max_size=columns)) for _ in range(rows)]
    for row in cells:
        table.add_row(*row)
    lines = rendered(table, width)
    text = "\n".join(lines)
    assert "…" not in text
    assert max(map(len, lines), default=0) <= width
    for row in cells:
        for cell in row:  # a short cell whole on one line; a longer one's words each whole
            for piece in [cell] if len(cell) <= SHORT_CELL else cell.split():
                assert any(piece in line for line in lines), (piece, text)


def test_a_piped_table_takes_the_width_it_needs():
    table = Table(title="t")
    for k in range(12):
        table.add_column(f"column {k}")
    table.add_row(*[f"{10 ** k:,}.25 ms" for k in range(12)])
    lines = rendered(table, None)
    assert max(map(len, lines)) > 120  # not the console's 120: one row, every cell whole
    assert any(all(f"{10 ** k:,}.25 ms" in line for k in range(12)) for line in lines)


def test_a_table_too_wide_is_split_with_its_first_column_repeated_and_says_so():
    table = Table(title="t")
    for k in range(12):
        table.add_column(f"c{k}")
    table.add_row("key", *[f"{10 ** k:,}.25" for k in range(11)])
    lines = rendered(table, 80)
    assert sum("key" in line for line in lines) >= 2
    assert any("printed in" in line and "parts" in line for line in lines)
    assert all(len(line) <= 80 for line in lines)


def test_a_number_with_its_spread_is_one_value_never_wrapped():
    table = Table()
    for header in ("arm", "acc %", "loss", "samples/s", "predicted", "staleness", "s (F)", "s (B)", "div."):
        table.add_column(header, justify="right")
    table.add_row("pipeoptim (code)", "53.9 ± 37.8", "0.904 ± 0.198", "1,659", "3,451", "1,1,1,0", "4,3,2,1",
                  "3,2,1,0", "1/3")
    lines = rendered(table, 80)
    assert any("0.904 ± 0.198" in line for line in lines), "\n".join(lines)


def test_the_tables_of_one_output_share_one_style_where_one_must_be_compact():
    """compare's three tables at 80 columns: the widest compact, the two that fit whole printed compact too, not
    padded with blank rows and edges beside it."""
    tables = []
    for columns in (9, 2):
        table = Table(box=box.SIMPLE_HEAD)
        for k in range(columns):
            table.add_column(f"column {k}", justify="right")
        table.add_row(*(f"{k:,}.25 ms" for k in range(columns)))
        tables.append(table)
    out = io.StringIO()
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("COLUMNS", "80")
        print_tables(tables, Console(file=out, width=120, color_system=None))
    lines = out.getvalue().splitlines()
    assert len(lines) == 6 and all(line.startswith("column 0") or line.lstrip()[:1] in "─0" for line in lines), \
        "\n".join(lines)


def test_a_table_that_fits_opens_as_one_compacted_does_with_no_blank_line():
    """study's table fit at 80 columns and opened with a blank line over its header (its box's edge), which
    simulate's, compacted, did not: no table has one now, only the padding differs."""
    table = Table(title="the setting", title_justify="left", box=box.SIMPLE_HEAD, pad_edge=False)
    table.add_column("arm")
    table.add_column("acc %", justify="right")
    table.add_row("1f1b", "90.3 ± 4.8")
    lines = rendered(table, 80)
    assert [line.rstrip() for line in lines] == ["the setting", " arm         acc %", "─" * 19,
                                                 " 1f1b   90.3 ± 4.8"], "\n".join(lines)


def test_a_table_that_wraps_gives_its_padding_to_the_wrapped_cell():
    """tune's table at 100 columns: with a space between columns instead of padding, its "why not" reason takes
    twice the width, and half the lines."""
    table = Table(box=box.SIMPLE_HEAD)
    for header in ("", "schedule", "p", "v", "m", "R", "samples/s", "bubble", "peak", "stale", "why not"):
        table.add_column(header, justify="left" if header in ("", "schedule", "why not") else "right")
    reason = "9% slower: bubble 26% vs 19%; same as interleaved-1f1b p=8, auto p=8, graphpipe p=8"
    table.add_row("5", "1f1b", "8", "1", "32", "-", "8.8", "26%", "0.246 GiB", "0", reason)
    lines = rendered(table, 100)
    row = [line for line in lines if line.strip() and "─" not in line][1:]  # less the header
    assert len(row) == 2 and all(len(line) <= 100 for line in lines), "\n".join(lines)


def test_a_reason_squeezed_to_its_longest_word_is_printed_in_a_part_of_its_own_instead():
    """tune --gpu's table at 80 columns: beside t, d, b, recomp and MFU its "why not" fits only at its longest
    word, 7 characters, each reason on 7 lines, so it is printed at least READABLE_TEXT wide in a second part."""
    table = Table(box=box.SIMPLE_HEAD)
    for header in ("", "schedule", "p", "v", "t", "d", "b", "recomp", "m", "samples/s", "MFU", "bubble", "peak",
                   "stale", "why not"):
        table.add_column(header, justify="left" if header in ("", "schedule", "recomp", "why not") else "right")
    reason = "0.42% slower: busiest device 4,021 vs 3,634 ms/step"
    table.add_row("2", "dualpipev", "8", "2", "1", "2", "1", "none", "32", "14.5", "45.0%", "22%", "74.1 GiB", "0",
                  reason)
    lines = rendered(table, 80)
    assert any("printed in 2 parts" in line for line in lines), "\n".join(lines)
    assert sum(any(word in line for word in reason.split()) for line in lines) <= 2, "\n".join(lines)
    assert all(len(line) <= 80 for line in lines)


def test_a_rows_name_stays_whole_where_headers_can_wrap_instead():
    """simulate's table at 80 columns: "peak MiB" and "peak act" wrap between their words, so that the column
    naming the rows keeps "xpipe (s: paper)" on one line."""
    table = Table(box=box.SIMPLE_HEAD)
    for header in ("schedule", "ms/step", "samples/s", "bubble", "peak MiB", "peak act", "weights", "staleness",
                   "makespan"):
        table.add_column(header, justify="left" if header == "schedule" else "right")
    table.add_row("1f1b", "33.000", "242.4", "27.3%", "1,288", "4", "1", "0", "132.000")
    table.add_row("xpipe (s: paper)", "24.000", "333.3", "8.6%", "1,800", "4", "3", "1", "105.000")
    lines = rendered(table, 80)
    assert any(line.startswith("xpipe (s: paper) ") for line in lines) and all(len(line) <= 80 for line in lines), (
        "\n".join(lines))


def test_a_rows_name_stays_whole_where_the_numbers_leave_it_too_little_and_the_table_is_split_instead():
    """simulate --profile's table, with its memory column, at 80 columns: with every header wrapped its numbers
    leave the column naming the rows 10 characters, and "xpipe (s: paper)" broke over "xpipe (s:" and "paper)";
    the 175B what-if's, already in two parts, broke "interleaved-1f1b" over "(v=3)". Each part now leads with the
    name whole."""
    headers = ("schedule", "ms/step", "samples/s", "bubble", "peak MiB", "peak act", "weights", "staleness",
               "makespan", "memory")
    rows = [("1f1b", "460.256", "139.1", "12.4%", "21.1", "2", "1", "0", "1,909.839", "fits"),
            ("xpipe (s: paper)", "538.493", "118.9", "8.3%", "29.4", "2", "3", "1", "2,347.775", "fits"),
            ("interleaved-1f1b (v=3)", "13,147.553", "4.9", "6.0%", "56,621", "31", "1", "0", "1,209.110", "fits")]
    for shown in (rows[:2], rows):
        table = Table(box=box.SIMPLE_HEAD)
        for header in headers:
            table.add_column(header, justify="left" if header in ("schedule", "memory") else "right")
        for row in shown:
            table.add_row(*row)
        lines = rendered(table, 80)
        assert all(len(line) <= 80 for line in lines), "\n".join(lines)
        for name, *numbers in shown:
            assert sum(line.startswith(name + " ") for line in lines) == 2, "\n".join(lines)  # one in each part
            assert all(any(number in line.split() for line in lines) for number in numbers), "\n".join(lines)


def test_a_split_table_repeats_the_columns_that_name_a_row():
    """simulate --memory's rows are a schedule's devices: split at 80 columns, each part leads with both, so a row
    of the second part still says which device it is."""
    table = Table(box=box.SIMPLE_HEAD)
    for header in ("schedule", "device", *(f"part {k}" for k in range(9))):
        table.add_column(header, justify="right")
    for device in range(3):
        table.add_row("1f1b" if device == 0 else "", str(device),
                      *(f"{(device + 1) * 10 ** 5 + k:,}" for k in range(9)))
    lines = rendered(table, 80, keys=2)
    assert any("the first 2 columns repeated" in line for line in lines)
    for device in range(3):
        for k in range(9):
            (line,) = [line for line in lines if f"{(device + 1) * 10 ** 5 + k:,}" in line]
            assert str(device) in line.split()[:2], "\n".join(lines)


# Every command that prints a table, as a new user would type it (small sizes: seconds each); sweep in this process
# (-j 1, the same table), where its default pool of fresh interpreters cost 1.4 CPU s a run for its 6 configurations.
COMMANDS = {
    "simulate": ["simulate", "-s", "1f1b", "-s", "zb-h1", "-s", "pipedream", "-s", "xpipe", "-p", "4", "-m", "8"],
    "simulate --gpu": ["simulate", "-s", "1f1b", "-s", "zb-h1", "-p", "4", "-m", "8", "--gpu", "h100-sxm", "--model",
                       "gpt", "--data-parallel", "2", "--tensor-parallel", "2"],
    "simulate --memory": ["simulate", "-s", "1f1b", "-s", "interleaved-1f1b", "-p", "4", "-m", "8", "--gpu",
                          "h100-sxm", "--model", "gpt", "--data-parallel", "2", "--memory"],
    "schedules": ["schedules"],
    "sweep": ["sweep", "-s", "1f1b,zb-h1,pipedream", "-p", "2,4", "-m", "8", "-j", "1"],
    "tune": ["tune", "--profile", "traces/profiles/gpt-cpu.json", "--devices", "8", "--memory-gb", "0.3"],
    "gpus": ["gpus"],
    "count": ["count", "--model", "gpt", "--layers", "2", "--width", "64", "--heads", "4"],
    "estimate": ["estimate", "--gpu", "h100-sxm", "--model", "gpt", "--stages", "4", "--out", "{tmp}/e.json"],
    "compare": ["compare", "traces/measured/torch-1f1b-2cpu", "{tmp}/p.json"],
    "study": ["study", "--plot-only", "--results", "traces/study/digits-mlp-p4.json", "--html", "{tmp}/s.html"],
}


def _output(args: list[str], columns: int | None, tmp_path, monkeypatch) -> str:
    """The command's stdout with $COLUMNS at `columns` (None: unset), as a process started so would print it."""
    at_columns(monkeypatch, columns)
    code, out, err = pipesim(*[a.replace("{tmp}", str(tmp_path)) for a in args])
    assert code == 0, err
    return out


def _numbers(out: str) -> set[str]:
    """The numbers printed, less the seconds a command took (which differ run to run) and those in addresses
    (which fold at any width: the whole address is one word)."""
    out = re.sub(r"https?://\S+", "", out)
    return set(NUMBER.findall(re.sub(r"[\d.]+ s\b", "", out)))


# What a command reads that an earlier one writes.
SETUP = {"compare": ["simulate", "-s", "1f1b", "-p", "2", "-m", "8", "-n", "3", "--trace", "{tmp}/p.json"]}


@pytest.mark.parametrize("name", list(COMMANDS))
def test_every_commands_table_keeps_its_numbers_at_80_and_120_columns(name, tmp_path, monkeypatch):
    monkeypatch.chdir(REPO)
    if name in SETUP:
        _output(SETUP[name], None, tmp_path, monkeypatch)
    whole = _output(COMMANDS[name], None, tmp_path, monkeypatch)
    numbers = _numbers(whole)
    for columns in (80, 120):
        out = _output(COMMANDS[name], columns, tmp_path, monkeypatch)
        assert "…" not in out, (columns, out)
        assert max(map(len, out.splitlines())) <= columns, (columns, out)
        assert numbers <= _numbers(out), (columns, numbers - _numbers(out), out)


def test_the_built_in_examples_rows_are_each_named_on_one_line_at_80_columns(tmp_path, monkeypatch):
    """The README's first command, `pipesim simulate`, at 80 columns broke "interleaved-1f1b" over "(v=2)" and
    "spectrain (s:" over "paper)"; then, each name whole, it printed its makespans in a second part, 81 columns
    wide with the copies' column headed "weights"."""
    monkeypatch.chdir(tmp_path)  # it writes its page here
    lines = _output(["simulate"], 80, tmp_path, monkeypatch).splitlines()
    for name in ("interleaved-1f1b (v=2)", "dualpipe (v=2)", "spectrain (s: paper)", "pipeoptim (s: paper)",
                 "xpipe (s: paper)", "avgpipe (P=2)"):
        assert any(line.startswith(name + " ") for line in lines), (name, "\n".join(lines))
    assert not [line for line in lines if "printed in" in line] and max(map(len, lines)) <= 80, "\n".join(lines)


def test_simulate_says_once_under_its_table_what_every_row_agrees_on(tmp_path, monkeypatch):
    """A row named as the README's 175B what-if's, "interleaved-1f1b (v=3)", printed its copies, staleness and
    memory (1, 0, fits) in a second part at 80 columns: each is said once under the table instead, and the table
    is whole."""
    monkeypatch.chdir(REPO)
    out = _output(["simulate", "-s", "interleaved-1f1b", "--chunks", "3", "--cluster", "examples/cluster.json"], 80,
                  tmp_path, monkeypatch)
    header = next(line for line in out.splitlines() if line.startswith("schedule"))
    caption = " ".join(out.split())
    assert header.split()[-1] == "makespan" and "printed in" not in caption, out
    assert ("copies: versions of one stage's weights held, 1 in every row; stale: 0 in every row; makespan: ms from "
            "the first op to the last; memory: every device fits") in caption, out


def test_schedules_writes_each_closed_form_of_s_on_one_line_at_80_columns(tmp_path, monkeypatch):
    """As a fourth column of the methods' table XPipe's forms broke mid-expression at 80 columns ("(3*m +",
    "2*(k//2) -", "2)//(2*m)"); in a table of their own each "F: ..." and "B: ..." is one line."""
    from pipesim.schedules import METHODS

    out = _output(["schedules"], 80, tmp_path, monkeypatch)
    forms = [f"{side}: {prediction.forms[source]}" for method in METHODS.values() if not method.needs_costs
             for policy in [method.build(method.params(4, 8)).policy] for source in policy.sources
             for side, prediction in (("F", policy.predict_forward), ("B", policy.predict_backward))
             if prediction is not None and source in prediction.forms]
    assert any("(3*m" in form for form in forms)  # XPipe's, the longest
    lines = out.splitlines()
    assert all(any(form in line for line in lines) for form in forms), out
    assert max(map(len, lines)) <= 80, out


@pytest.mark.slow
def test_run_fits_80_columns(tmp_path, monkeypatch):
    """calibrate's tables are checked at 80 columns by tests/test_calibrate.py's end-to-end calibration."""
    args = ["run", "-s", "1f1b", "--model", "mlp", "--layers", "2", "--width", "16", "--stages", "2", "-m", "2", "-n",
            "2", "--trace", "{tmp}/t.json"]
    out = _output(args, 80, tmp_path, monkeypatch)
    assert "…" not in out and max(map(len, out.splitlines())) <= 80, out


@pytest.mark.parametrize("per_s, text", [(1783.04, "1,783.0"), (26.12, "26.1"), (4.84, "4.84"), (1.307, "1.31"),
                                         (9.996, "10.0"), (0.176, "0.176"), (0.233, "0.233"), (0.0123, "0.0123"),
                                         (0.0, "0.0")])
def test_a_rate_keeps_three_significant_digits(per_s, text):
    """A 70B's tune rows at 32k tokens, 1.31 to 1.28 samples/s, all read 1.3 to one decimal."""
    assert rate_text(per_s) == text


def test_simulate_tells_slow_methods_apart_by_their_samples_per_second():
    """At one decimal zero bubble H1's 0.296 and PipeDream's 0.333 samples/s both read 0.3: three digits."""
    code, out, _ = pipesim("simulate", "-s", "zb-h1", "-s", "pipedream", "-p", "4", "-m", "8", "--fwd", "1000",
                           "--bwd", "2000")
    rows = {cells[0]: cells[2] for cells in map(str.split, out.splitlines()) if cells[:1] in (["zb-h1"], ["pipedream"])}
    assert code == 0 and rows == {"zb-h1": "0.296", "pipedream": "0.333"}, out


@pytest.mark.parametrize("unit", ["ms/step", "TFLOP/s"])
def test_a_paragraph_never_wraps_between_a_figure_and_a_unit_with_a_slash(unit):
    """tune's explanations end "... 331 ms/step" and estimate's figures read "TFLOP/s": at 80 columns a paragraph
    broke "331" from "ms/step", the unit list stopping "ms" before a slash and lacking the longer units."""
    console = Console(width=80, file=io.StringIO())
    print_paragraph("a " * 38 + f"331 {unit} more", console)
    assert console.file.getvalue().splitlines()[-1] == f"331 {unit} more"


def test_a_wrapped_cell_never_breaks_between_a_figure_and_its_unit(monkeypatch):
    """tune's why-not column at 80 columns ended a line "device idle 21.9 vs 0" over "ms/step", and "computing 143
    vs 157" over "ms": rich wraps a cell at any space, the no-break space too."""
    table = Table("schedule", "samples/s", "why not", box=box.SIMPLE_HEAD)
    table.add_row("zb-h2", "715.2", "12.2% slower: busiest device idle 21.9 vs 0 ms/step")
    table.add_row("1f1b", "694.1", "14.8% slower: step 184 vs 157 ms: busiest device computing 143 vs 157 ms")
    monkeypatch.setenv("COLUMNS", "40")
    console = Console(width=40, file=io.StringIO())
    print_table(table, console)
    lines = [line.rstrip() for line in console.file.getvalue().splitlines()]
    assert not [line for line in lines if re.search(r"\d$", line)], lines
    assert max(map(len, lines)) <= 40 and "0 ms/step" in "\n".join(lines), lines


@pytest.mark.parametrize("width", [80, 40, 30])
def test_a_wrapped_cell_never_breaks_between_a_label_and_its_figure(width):
    """run's peak per device at 80 columns ended a line "3: 5.40, 2:" over "10.4"; squeezed to its narrowest, the
    column is as wide as the widest label with its figure, not as rich's longest word, which folded "2: 10.4"."""
    table = Table("ms/step", "samples/s", "loss first -> last", "held-out loss / acc", "peak MiB per device")
    table.add_row("32.03", "998.9", "2.443 -> 3.094", "1.837 / 37.2%", "0: 11.1, 1: 10.4, 2: 10.4, 3: 5.40, 4: -2.5")
    lines = [line.rstrip() for line in rendered(table, width)]
    assert not [line for line in lines if re.search(r"\d:$", line)], lines
    assert max(map(len, lines)) <= width and all(any(f"{pair}" in line for line in lines) for pair in
                                                  ("0: 11.1", "2: 10.4", "3: 5.40", "4: -2.5")), lines
    replicas = Table("ms/step", "samples/s", "loss first -> last", "held-out loss / acc", "peak MiB per device")
    replicas.add_row("71.87", "890.5", "2.493 -> 2.208", "1.928 / 46.7%",
                     "replica 0: 6.73, 6.42, 6.37, 3.25; replica 1: 6.73, 6.42, 6.37, 3.27")
    lines = [line.rstrip() for line in rendered(replicas, width)]  # 80 columns broke "replica" from "1: 6.73"
    assert not [line for line in lines if line.endswith("replica")], lines
    assert all(any(label in line for line in lines) for label in ("replica 0: 6.73", "replica 1: 6.73")), lines


def test_tunes_why_not_is_printed_under_its_table_where_beside_it_would_be_narrow(tmp_path, monkeypatch):
    """The README's tune at 80 columns squeezed its "why not" to 22 columns beside the figures, a reason on 5 lines:
    the reasons are printed under the table instead, each after its row's mark and configuration."""
    monkeypatch.chdir(REPO)
    out = _output(["tune", "--profile", "traces/profiles/gpt-cpu.json", "--devices", "8", "--memory-gb", "0.3",
                   "-s", "1f1b", "-s", "avgpipe", "-s", "dualpipev"], 80, tmp_path, monkeypatch)
    lines = out.splitlines()
    header = next(line for line in lines if line.split()[:1] == ["schedule"])
    assert "why not" not in header and "why not:" in lines and max(map(len, lines)) <= 80, out
    assert re.search(r"^2 \S+ p=\d[^:]*: [\d.]+% slower: ", out, re.MULTILINE), out


def test_a_last_text_column_stays_beside_where_it_is_wide_enough():
    """`print_table_last_below` moves the last column under the table only where beside it would be narrower than
    `TEXT_BESIDE`: at 160 columns a reason stays in its row."""
    table = Table("schedule", "samples/s", "why not", box=box.SIMPLE_HEAD)
    table.add_row("1f1b", "694.1", "14.8% slower: step 184 vs 157 ms: busiest device computing 143 vs 157 ms " * 2)
    for width, below in ((160, False), (50, True)):
        console = Console(width=width, file=io.StringIO(), force_terminal=True, color_system=None)
        print_table_last_below(table, ["2 1f1b p=4"], console)
        text = console.file.getvalue()
        assert ("why not:" in text.splitlines()) == below and ("2 1f1b p=4: 14.8% slower" in text) == below, text
        assert max(map(len, text.splitlines())) <= width, text


def test_sweep_says_once_under_its_fronts_what_every_row_agrees_on(tmp_path, monkeypatch):
    """The README's grid sweep printed its s and R columns all "-" (no prediction, no auto): a column every row
    agrees on is said once in the caption, as simulate's are (`said_once`)."""
    out = _output(["sweep", "-s", "1f1b,zb-h1", "-p", "2", "-m", "4,8", "-j", "1"], 80, tmp_path, monkeypatch)
    header = next(line for line in out.splitlines() if line.split()[:1] == ["schedule"])
    assert header.split()[1:4] == ["p", "m", "ms/step"] and not {"v", "P", "cost×", "s", "R"} & set(header.split()), out
    caption = " ".join(out.split())
    assert "P: pipelines, 1 in every row" in caption, out
    assert "s: the source of prediction distances (--prediction), - in every row" in caption, out
    assert "R: auto's activation limit, in 1F1B's peak, - in every row" in caption, out


def test_gpus_prints_the_catalogue_whole_at_80_columns(tmp_path, monkeypatch):
    """`pipesim gpus` printed its network column as a second part at 80 columns: the GPUs per node, 8 in every
    row, are said once under the table, and a network's kind is written short ("400 IB"), in words under it."""
    out = _output(["gpus"], 80, tmp_path, monkeypatch)
    lines = out.splitlines()
    h100 = next(line.split() for line in lines if line.split()[:1] == ["h100-sxm"])
    assert "printed in" not in out and max(map(len, lines)) <= 80, out
    assert h100[-4:] == ["nvlink", "450", "400", "IB"], h100
    caption = " ".join(out.split())
    assert "per node: GPUs a node holds, 8 in every row; IB: InfiniBand, RoCE: RDMA over Converged Ethernet" in caption


def test_gpus_prints_a_users_part_whole_at_80_columns_saying_once_a_dtype_as_another(tmp_path, monkeypatch):
    """`pipesim gpus --gpus examples/h100-hbm2e-96gb.toml` printed in two parts at 80 columns (the part's name is 15
    letters): fp16's peaks, bf16's on every part, are said once under the table; a part whose fp16 differs keeps
    the column."""
    example = REPO / "examples" / "h100-hbm2e-96gb.toml"
    out = _output(["gpus", "--gpus", str(example)], 80, tmp_path, monkeypatch)
    lines = out.splitlines()
    header = next(line.split() for line in lines if line.split()[:1] == ["gpu"])
    part = next(line.split() for line in lines if line.split()[:1] == ["h100-hbm2e-96gb"])
    assert "printed in" not in out and max(map(len, lines)) <= 80, out
    assert "fp16" not in header and part[1:7] == ["96*", "2,400", "67", "494.7", "989.4", "1,978.9"], out
    assert "fp16: as bf16 in every row" in " ".join(out.split()), out
    own = tmp_path / "own.toml"
    own.write_text(example.read_text().replace("fp16 = 989.4", "fp16 = 900.5"))
    out = _output(["gpus", "--gpus", str(own)], 80, tmp_path, monkeypatch)
    assert "fp16: as" not in out and "900.5" in out and "fp16" in out.split(), out


def test_tune_says_once_under_its_table_a_staleness_every_row_agrees_on(tmp_path, monkeypatch):
    """docs/sweep-and-tune.md's context-parallel tune at 80 columns printed its "stale" column, 0 in every row,
    alone in a second part: it is said once under the table, by simulate's rule (`said_once`), as are b and recomp
    where every row agrees (here -b 1 and none), which makes room for the searched rank order's column."""
    out = _output(["tune", "--gpu", "h100-sxm", "--model", "gpt", "--layers", "16", "--width", "2048", "--heads", "16",
                   "--seq-len", "32768", "--vocab", "32000", "--attention", "flash", "-D", "16",
                   "--context-parallel", "4", "-b", "1", "-s", "1f1b", "-s", "interleaved-1f1b"], 80, tmp_path,
                  monkeypatch)
    lines = out.splitlines()
    header = next(line for line in lines if line.split()[:1] == ["schedule"])
    assert "stale" not in header and "printed in" not in out and max(map(len, lines)) <= 80, out
    assert ("bubble: 1 - mean compute / step time (exposed communication's waits included); stale: 0 in every row; "
            "b: 1 in every row; recomp: none in every row") in " ".join(out.split()), out
    assert header.split()[5:8] == ["d", "ranks", "m"], header


def test_tune_says_a_staleness_once_where_only_rows_over_its_limit_differ(tmp_path, monkeypatch):
    """The README's tune lists stale orders over the limit (pipedream's 1 > 0): each says its staleness in its why
    not, so the rows within the limit, all 0, say theirs once under the table (gpt-oss-20b's tune on 8 H100s printed
    the "stale" column alone in a second part at 80 columns). Where rows within the limit differ (--max-staleness 1:
    PipeDream's rows 1, 1F1B's 0), the column stays."""
    readme = ["tune", "--profile", "traces/profiles/gpt-cpu.json", "--devices", "8", "--memory-gb", "0.3"]
    out = _output(readme, 80, tmp_path, monkeypatch)
    header = next(line for line in out.splitlines() if line.split()[:1] == ["schedule"])
    flat = " ".join(out.split())
    assert "stale" not in header.split() and "over pipedream p=2: staleness 1 > 0" in flat, out
    assert "stale: 0 in every row within the staleness limit (one over it says its own under why not)" in flat, out
    out = _output([*readme, "--max-staleness", "1", "-s", "1f1b", "-s", "pipedream"], 80, tmp_path, monkeypatch)
    header = next(line for line in out.splitlines() if line.split()[:1] == ["schedule"])
    assert "stale" in header.split() and "stale: " not in " ".join(out.split()), out


def test_simulates_caption_says_peak_act_counts_a_chunks_activations_where_v_is_above_one():
    """ZB-V's 8 beside 1F1B's 4 read as twice 1F1B's activations; each of ZB-V's is a chunk's, half a device's
    layers."""
    def caption(*methods):
        code, out, err = pipesim("simulate", *(arg for method in methods for arg in ("-s", method)), "-p", 4, "-m", 8)
        assert code == 0, err
        return " ".join(out.split())

    assert ("peak act: micro-batches of activations held, each a chunk's where a device holds several;"
            in caption("1f1b", "zb-v"))
    assert "peak act: micro-batches of activations held;" in caption("1f1b", "zb-h1")


def test_an_mfu_above_100_percent_is_said_to_be_float8_over_the_bfloat16_peak():
    """A float8 model's MFU is over bfloat16's peak (as torchtitan reports it), so its products can pass it: 104 %
    stood in the table without a word."""
    model = ("--gpu", "h100-sxm", "--model", "gpt", "--layers", 4, "--width", 16384, "--heads", 128, "--seq-len",
             2048, "--vocab", 32000, "-b", 8, "-p", 1, "-m", 4, "-s", "1f1b")
    for dtype, said in (("fp8", True), ("bf16", False)):
        code, out, err = pipesim("simulate", *model, "--dtype", dtype)
        assert code == 0, err
        caption = " ".join(out.split())
        assert ("an MFU above 100%: float8 products outrun the bfloat16 peak it is over" in caption) is said, caption
        # tune's table says it alike, of one such layer that fits the part (its vocabulary small: the head is bf16)
        code, out, err = pipesim("tune", *model[:4], "--layers", 1, *model[6:12], "--vocab", 128, "--dtype", dtype,
                                 "-D", 1, "-b", 4, "-B", 16, "--optimizer", "sgd", "-s", "1f1b")
        assert code == 0, err
        assert ("an MFU above 100%: float8 products outrun" in " ".join(out.split())) is said, out
