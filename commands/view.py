"""`pipesim view`: traces as one interactive timeline page."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from .common import InputError, check_writable, fail, stdout


def view(
    traces: Annotated[list[Path], typer.Argument(help="Trace files (from simulate --trace or run --trace).",
                                                 metavar="TRACE...")],
    html: Annotated[Path | None, typer.Option(
        "--html", help="Page to write. Default: the first trace's name with .html.")] = None,
) -> None:
    """Draw traces on one self-contained page (works offline): one view per trace and, for several traces, one
    with their lanes interleaved device by device, predicted beside measured; memory under the timelines."""
    from ..traces.trace import TraceError, read_trace
    from ..traces.view import write_timeline_page

    out = html if html is not None else traces[0].with_suffix(".html")
    try:
        check_writable("--html", out)
        loaded = [read_trace(path) for path in traces]
    except (InputError, TraceError) as exc:
        fail(str(exc))
    labels = [f"{path.stem} ({trace.meta.source})" for path, trace in zip(traces, loaded)]
    views = [(label, [i]) for i, label in enumerate(labels)]
    if len(loaded) > 1:
        views.insert(0, ("all, device by device", list(range(len(loaded)))))
    write_timeline_page(loaded, out, labels=labels, views=views)
    stdout.print(f"wrote {out}", highlight=False)
