"""`pipesim view`: traces as one interactive timeline page."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated

import typer

from .common import InputError, check_outputs, fail, stdout, writing


def _replaces(out: Path, named: bool) -> bool:
    """Whether writing `out` replaces a file. A default path (the trace's name with .html) replaces only a page
    pipesim drew, since a user who did not name the file may not know it is there; a path named with --html
    replaces whatever is there."""
    from ..traces.view import is_timeline_page

    if not out.is_file():
        return False
    try:
        ours = named or is_timeline_page(out)
    except OSError as exc:
        raise InputError(f"--html: cannot read {out} to see what it is: {exc.strerror}") from None
    if not ours:
        raise InputError(f"--html: {out} exists and is not a pipesim page; replace it by naming it (--html {out}) "
                         "or name another page")
    return True


def _labels(paths: list[Path], traces: list) -> list[str]:
    """Each trace named by its method and source ("1f1b, measured"), with its file's name where that alone tells
    two apart (a file's name says nothing of the run: measured.json of 1F1B was titled "measured (measured)")."""
    labels = [f"{trace.meta.schedule}, {trace.meta.source}" for trace in traces]
    return [f"{label} ({path.name})" if labels.count(label) > 1 else label for path, label in zip(paths, labels)]


def view(
    traces: Annotated[list[Path], typer.Argument(help="Trace files (from simulate --trace or run --trace).",
                                                 metavar="TRACE...")],
    html: Annotated[Path | None, typer.Option(
        "--html", metavar="PATH", help="Page to write (replaced if it exists). Default: the first trace's name with "
                                       ".html, which replaces only a pipesim page.")] = None,
) -> None:
    """Draw traces on one self-contained page (works offline). One view per trace and, for several traces, one
    with their lanes interleaved device by device, predicted beside measured; memory under the timelines."""
    from ..traces.trace import TraceError, read_trace
    from ..traces.view import shape_text, write_timeline_page

    out = html if html is not None else traces[0].with_suffix(".html")
    try:
        if html is None and not os.path.isfile(traces[0]):  # the page is named after it: say why it cannot be read
            read_trace(traces[0])
        check_outputs([("--html", out)], [("TRACE", path) for path in traces])
        replaced = _replaces(out, named=html is not None)
        loaded = [read_trace(path) for path in traces]
        labels = _labels(traces, loaded)
        views = [(label, [i]) for i, label in enumerate(labels)]
        if len(loaded) > 1:
            views.insert(0, ("all, device by device", list(range(len(loaded)))))
        title = "pipesim: " + (f"{labels[0]}, {shape_text(loaded[0])}" if len(loaded) == 1 else "; ".join(labels))
        with writing("--html"):
            write_timeline_page(loaded, out, labels=labels, views=views, title=title)
    except (InputError, TraceError) as exc:
        fail(str(exc))
    stdout.print(f"wrote {out}" + (" (replaced the file that was there)" if replaced else ""), highlight=False)
