"""Tables that never cut a number. rich shrinks a table wider than the terminal by cutting its cells to "…";
here a table is fitted instead: text wraps between words, a short cell (a number with its unit) or a number with
its spread ("0.357 ± 0.244") never wraps, a table that would wrap gives its padding to the wrapped cells first, and
a table that cannot fit even so is printed in parts of whole columns, the first column (or the first few, which
name a row, on one line where a part can keep them so) repeated in each, with a line that says so. Piped output
without $COLUMNS takes the width the table needs."""

from __future__ import annotations

import copy
import io
import os
import re
import textwrap
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import fields

from rich.cells import cell_len
from rich.console import Console
from rich.measure import Measurement
from rich.table import Column, Table
from rich.text import Text

from .common import stdout

SHORT_CELL = 12  # characters: a cell this short is a value ("2,875.9 ms", "8.6%"), never wrapped
READABLE_TEXT = 20  # characters: a text cell wraps no narrower where splitting the table into parts can keep it so
# characters: a row's name (a column of the first `keys`) this long stays on one line where splitting the table
# into parts can keep it so: "interleaved-1f1b (v=2)" broke after its method at 80 columns, "xpipe (s:" over "paper)"
ROW_NAME = 32
# characters: a table's last column of text (tune's "why not") narrower than this beside the others is printed under
# the table instead (`print_table_last_below`): at 80 columns tune's was 22 wide, a reason on 5 lines
TEXT_BESIDE = 40
UNLIMITED = 10_000  # characters: what a cell is measured against when nothing limits it
WITH_SPREAD = re.compile(r"\S+ ± \S+")  # a mean and its spread (study's "0.357 ± 0.244"): one value, never wrapped
# Spaces where a line never wraps: between a figure and its unit ("23.62 s", "0.3 GiB", "10.6 samples/s"), between
# a label and the figure it names (run's peaks "2: 10.4", which 80 columns broke after "2:"), and inside a numbered
# label ("replica 1: 6.73", broken after "replica").
GLUED_SPACE = re.compile(r"(?<=\d) (?=(?:s|ms|ms/step|us|B|KiB|MiB|GiB|GB/s|Gb/s|samples/s|TFLOP/s)(?![\w/]))"
                         r"|(?<=\w:) (?=[-+\u2212]?\d)|(?<=[a-z]) (?=\d[\d,]*:(?:\s|$))")
NO_BREAK = "\u00a0"
# A console that only measures (`_whole_width`): a table's columns at fixed widths measure the same on any console.
_MEASURING = Console(file=io.StringIO(), width=UNLIMITED)


def available_width(console: Console) -> int | None:
    """The columns a table must fit: the terminal's, else $COLUMNS where set, else none (pipes and logs get
    whole rows)."""
    if console.is_terminal:
        return console.width
    try:
        columns = int(os.environ.get("COLUMNS", ""))
    except ValueError:
        return None
    return columns if columns > 0 else None


def _is_value(cell: object, measured: Measurement) -> bool:
    """Whether `cell` is one value, kept on one line: short, or a number with its spread."""
    text = cell.plain if isinstance(cell, Text) else cell
    return measured.maximum <= SHORT_CELL or (isinstance(text, str) and WITH_SPREAD.fullmatch(text) is not None)


def _longest_word(cell: object, measured: Measurement) -> int:
    """The width of `cell`'s longest part that `_wrapped` keeps on one line (words joined at a `GLUED_SPACE`): rich
    measures its words alone, and a column that narrow folded "2: 10.4" (a markup cell is left to rich)."""
    if not isinstance(cell, str) or "[" in cell:
        return measured.minimum
    return max([measured.minimum, *map(cell_len, re.split(r"[ \n]+", GLUED_SPACE.sub(NO_BREAK, cell)))])


def _content_ranges(console: Console, table: Table, keys: int) -> list[tuple[int, int, int]]:
    """Each column's (narrowest, readable, widest) content width: the narrowest keeps the header's longest word
    and every value whole, and wraps longer cells between words; the readable also keeps a text cell of a column
    after the first `keys` at least `READABLE_TEXT` wide (at its longest word, tune's "why not" at 80 columns was
    7 characters wide, a reason on 7 lines), and a row's name in the first `keys` whole up to `ROW_NAME`."""
    options = console.options.update_width(UNLIMITED)
    ranges = []
    for index, column in enumerate(table.columns):
        header = Measurement.get(console, options, column.header)
        cells = [(cell, Measurement.get(console, options, cell)) for cell in column.cells]
        narrowest = max([header.minimum, *(c.maximum if _is_value(cell, c) else _longest_word(cell, c) for cell, c in
                                           cells)])
        readable = max([narrowest, *(min(c.maximum, ROW_NAME) for _, c in cells)]) if index < keys else max(
            [narrowest, *(min(c.maximum, READABLE_TEXT) for cell, c in cells if not _is_value(cell, c))])
        widest = max([header.maximum, *(c.maximum for _, c in cells)])
        ranges.append((narrowest, readable, widest))
    return ranges


def _with_columns(table: Table, columns: list[Column]) -> Table:
    """`table`'s settings (box, padding, styles) with copies of `columns` and no rows, each column added through
    rich's public `Table.add_column` with its public settings (which number it, as rich's private `_index`)."""
    shaped = copy.copy(table)
    shaped.columns, shaped.rows = [], []
    for column in columns:
        shaped.add_column(**{field.name: getattr(column, field.name) for field in fields(Column)
                             if not field.name.startswith("_")})
    return shaped


def _whole_width(part: Table, content_widths: list[int]) -> int:
    """The part's whole width with its columns' contents this wide: contents, padding and borders, as rich measures
    the part with its columns fixed at those widths (`Measurement.get`, public, where this read rich's private
    `Table._get_padding_width` and `_extra_width`)."""
    sized = _with_columns(part, part.columns)
    sized.width = sized.min_width = None
    for column, width in zip(sized.columns, content_widths):
        column.width = width
    return Measurement.get(_MEASURING, _MEASURING.options, sized).maximum


def _readable_width(part: Table, ranges: list[tuple[int, int, int]]) -> int:
    """The part's whole width at its narrowest readable."""
    return _whole_width(part, [readable for _, readable, _ in ranges])


def _fitted_widths(ranges: list[tuple[int, int, int]], width: int, keys: int) -> list[int]:
    """Content widths that sum to at most `width`, each at least its readable width, else at least its narrowest:
    the widest gives way first, the first `keys` columns, which name a row ("xpipe (s: paper)"), last: a header
    wraps before a row's name does."""
    widths = [widest for *_, widest in ranges]
    for floor in (1, 0):  # the readable widths, then the narrowest
        while sum(widths) > width:
            shrinkable = [i for i, bounds in enumerate(ranges) if widths[i] > bounds[floor]]
            if not shrinkable:
                break
            widths[max([i for i in shrinkable if i >= keys] or shrinkable, key=lambda i: widths[i])] -= 1
    return widths


def _part(table: Table, indices: list[int]) -> Table:
    """The table with only the columns `indices` and no rows yet (`print_table` adds them, fitted), without its
    title and caption (printed apart)."""
    part = _with_columns(table, [table.columns[i] for i in indices])
    part.title = part.caption = None
    return part


def _rows(table: Table) -> list[list]:
    """The cells handed to `table`, row by row, read through rich's public `Column.cells`: a part is filled from
    these, where it rewrote rich's private `Column._cells`, a name rich may change in any release."""
    return [list(cells) for cells in zip(*(column.cells for column in table.columns))]


def _fitted_cell(cell: object, width: int) -> object:
    """`cell` wrapped at `width` between words (`_wrapped`): rich wraps a cell at any space (tune's why-not ended a
    line "idle 21.9 vs 0" over "ms/step"); a cell of markup ("[bold]") is left to rich, whose tags a wrap must not
    split."""
    return _wrapped(cell, width) if isinstance(cell, str) and "[" not in cell and cell_len(cell) > width else cell


def _split(table: Table, ranges: list[tuple[int, int, int]], width: int, keys: int) -> list[list[int]]:
    """Column groups, in order, each fitting `width` at its readable widths with the first `keys` columns repeated
    in front (a column too wide even beside them alone gets a part with them all the same)."""
    groups: list[list[int]] = [list(range(keys))]
    for index in range(keys, len(ranges)):
        grown = [*groups[-1], index]
        if len(grown) > keys + 1 and _readable_width(_part(table, grown), [ranges[i] for i in grown]) > width:
            groups.append([*range(keys), index])
        else:
            groups[-1] = grown
    return groups


@contextmanager
def _at_least(console: Console, width: int) -> Iterator[None]:
    """The console at least `width` columns wide for a moment (a piped table wider than its 120)."""
    saved = console.width
    console.width = max(saved, width)
    try:
        yield
    finally:
        console.width = saved


def _edgeless(table: Table) -> Table:
    """The table without its box's edges, which a simple box draws as a blank line over the header and another
    under the rows: only a table that fit had them, so study's at 80 columns opened with a blank line and
    simulate's, compacted, did not. The blank column the edge left before the first column stays, as padding."""
    edgeless = copy.copy(table)
    edgeless.show_edge = False
    edgeless.pad_edge = True
    return edgeless


def _compact(table: Table) -> Table:
    """The table with one space between columns instead of two (the box's rule, or padding without one), and
    none before the first."""
    compact = copy.copy(table)
    compact.padding = (0, 0) if table.box else (0, 1, 0, 0)
    compact.pad_edge = False
    return compact


def _too_wide(table: Table, ranges: list[tuple[int, int, int]], width: int | None) -> bool:
    """Whether `table` whole (its columns at their widest) is wider than `width` (None: nothing limits it)."""
    return width is not None and _whole_width(table, [widest for *_, widest in ranges]) > width


def said_once(columns: dict[str, list[str]], headers: tuple[str, ...]) -> dict[str, str]:
    """Of `columns` (header: cells), those of `headers` whose cells are all the same, with that value: a column
    every row agrees on is said once in the caption instead, so that the table fits (simulate's copies, staleness
    and memory, sweep's s and R: the README's 175B what-if needed 82 columns with them and printed in two parts)."""
    return {header: cells[0] for header, cells in columns.items() if header in headers and len(set(cells)) == 1}


def said_as(columns: dict[str, list[str]], headers: tuple[str, ...]) -> dict[str, str]:
    """Of `columns` (header: cells), those of `headers` whose cells equal an earlier one's of `headers` in every row,
    with that one's header: a column that repeats another is said once in the caption instead, so that the table
    fits (`pipesim gpus`' fp16, as bf16 on every part, printed a user's part in two parts at 80 columns). A column
    that differs from the others in any row stays."""
    said: dict[str, str] = {}
    for index, header in enumerate(headers):
        same = [other for other in headers[:index] if other not in said and columns[other] == columns[header]]
        if same:
            said[header] = same[0]
    return said


def add_columns(table: Table, columns: dict[str, list[str]], said: Iterable[str], left: tuple[str, ...] = ()
                ) -> list[str]:
    """`columns` (header: cells) added to `table` but those `said` in its caption (`said_once`, `said_as`), figures
    right-aligned and `left` ones not, none wrapped: their headers in order, whose cells make each row
    (`columns[header][row]`)."""
    shown = [header for header in columns if header not in said]
    for header in shown:
        table.add_column(header, justify="left" if header in left else "right", no_wrap=True)
    return shown


def print_tables(tables: list[Table], console: Console = stdout, keys: int = 1) -> None:
    """Print the tables of one output (`print_table` each) in one style: all compact where one must be."""
    width = available_width(console)
    compact = any(_too_wide(_edgeless(table), _content_ranges(console, table, keys), width) for table in tables)
    for table in tables:
        print_table(table, console, keys, compact)


def print_table(table: Table, console: Console = stdout, keys: int = 1, compact: bool = False) -> None:
    """Print `table` so that no cell is cut: whole where it fits, else with one space between columns (the
    padding saved goes to the cells that wrap: tune's "why not" at 100 columns), else in parts of whole columns,
    each led by the first `keys` columns, which name a row (simulate --memory's schedule and device) and wrap only
    where no part beside them can keep them whole (`ROW_NAME`); its title and caption wrap at the width available,
    not at the table's.
    `compact`: with one space between columns even where it fits (`print_tables`: beside one that does not)."""
    width = available_width(console)
    table = _edgeless(table)
    ranges = _content_ranges(console, table, keys)
    parts = [list(range(len(ranges)))]
    if compact or _too_wide(table, ranges, width):
        table = _compact(table)
        if width is not None and _readable_width(table, ranges) > width and len(ranges) > keys + 1:
            parts = _split(table, ranges, width, keys)
    tables, rows = [_part(table, group) for group in parts], _rows(table)
    if width is None:
        width = max(console.width, _whole_width(table, [widest for *_, widest in ranges]))
    for part, group in zip(tables, parts):
        padding = _whole_width(part, [0] * len(group))
        widths = _fitted_widths([ranges[i] for i in group], width - padding, keys)
        for column, fitted in zip(part.columns, widths):
            column.width = fitted
            column.no_wrap = False
            column.overflow = "fold"  # a word wider than the column (only where nothing else fits) keeps its letters
        for row, cells in zip(table.rows, rows):
            part.add_row(*(_fitted_cell(cells[i], fitted) for i, fitted in zip(group, widths)), style=row.style,
                         end_section=row.end_section)
    with _at_least(console, width):
        if table.title:
            console.print(table.title, style=table.title_style or "table.title", width=width, highlight=False)
        for part in tables:
            console.print(part)
        if table.caption:
            console.print(table.caption, style=table.caption_style or "table.caption", width=width, highlight=False)
        if len(tables) > 1:
            first = "the first column" if keys == 1 else f"the first {keys} columns"
            console.print(f"(wider than {width} columns: printed in {len(tables)} parts, {first} repeated in each; "
                          "a wider terminal, or COLUMNS, shows it whole)", style="dim", width=width, highlight=False)


def print_table_last_below(table: Table, labels: list[str], console: Console = stdout) -> None:
    """Print `table` (`print_table`), but where its last column, a text, would be narrower than `TEXT_BESIDE` beside
    the others, without it, and under the table that column's cells, each after its row's label in `labels`
    (rows with an empty cell left out), wrapped at the width between words."""
    width = available_width(console)
    whole = _edgeless(table)
    ranges = _content_ranges(console, whole, 1)
    beside = None if width is None or not _too_wide(whole, ranges, width) else width - _whole_width(
        _compact(whole), [widest for *_, widest in ranges[:-1]] + [0])
    if beside is None or beside >= TEXT_BESIDE:
        print_table(table, console)
        return
    shorter = copy.copy(table)
    last, shorter.columns = table.columns[-1], table.columns[:-1]
    print_table(shorter, console)
    console.print(f"{last.header}:", highlight=False)
    for label, cell in zip(labels, last.cells):
        if cell:
            print_paragraph(f"{label}: {cell}", console)


def _wrapped(text: str, width: int) -> str:
    """`text` wrapped at `width` columns between words, but never at a `GLUED_SPACE`: rich wraps at any space (a
    cell's or a paragraph's, its no-break space too)."""
    glued = GLUED_SPACE.sub(NO_BREAK, text)  # textwrap breaks at ASCII whitespace alone
    lines = [line for paragraph in glued.split("\n")
             for line in textwrap.wrap(paragraph, width, break_on_hyphens=False, break_long_words=False) or [""]]
    return "\n".join(lines).replace(NO_BREAK, " ")


def print_paragraph(text: str, console: Console = stdout) -> None:
    """`text` wrapped at the console's width (`_wrapped`): tune's search summary ended "...; 23.62" / "s" at 80
    columns. Printed as written (no markup, no highlighting)."""
    console.print(_wrapped(text, console.width), markup=False, highlight=False, soft_wrap=True)


PIPED_EVERY_S = 10.0  # seconds: how often a command of minutes piped to a file (a log, CI) says how far it is


def piped_lines(command: str, console: Console) -> Callable[[str], None]:
    """How a command of minutes whose bar is not drawn (piped to a log, CI) says how far it is: each text given, as
    "COMMAND: TEXT" on `console`, at most every PIPED_EVERY_S (a run of 64 replicas sat 44 s with nothing there)."""
    said = time.monotonic()

    def say(text: str) -> None:
        nonlocal said
        if time.monotonic() - said >= PIPED_EVERY_S:
            said = time.monotonic()
            print_message(f"{command}: {text}", console)

    return say


def print_message(text: str, console: Console, lead: str = "", lead_style: str | None = None) -> None:
    """`lead` + `text` (a refusal, warning, note or a calibration phase's line), printed as written: one line where
    `console` is piped or logged, as refusals are grepped and tested; on a terminal wrapped between words at its
    width (`_wrapped`), where the terminal broke it mid-word at 80 columns ("--de" / "vice cpu", "1.3" / "s") and a
    transient bar redrawn under it overwrote the rows it had not counted. `lead` ("error: ") takes `lead_style`."""
    whole = lead + text
    shown = Text(_wrapped(whole, console.width) if console.is_terminal else whole)
    if lead_style:
        shown.stylize(lead_style, 0, len(lead))
    console.print(shown, highlight=False, soft_wrap=True)
