"""`pipesim view`: traces as one interactive timeline page."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated

import typer

from .common import (
    READING_STATUS,
    InputError,
    check_outputs,
    fail,
    out_of_memory_line,
    output_path,
    stderr,
    stdout,
    transient_status,
    writing,
    wrote_text,
)
from .tables import print_message


def _names(paths: list[Path], traces: list) -> list[tuple[str, str]]:
    """Each trace's label, its method and source ("1f1b, measured"), and the same as a sentence's subject ("the
    measured 1f1b": the out-of-memory warning read "1f1b, predicted runs out of memory"), each with its file's name
    where that alone tells two apart (a file's name says nothing of the run: measured.json of 1F1B was titled
    "measured (measured)")."""
    named = [(trace.meta.schedule, trace.meta.source) for trace in traces]
    out = []
    for path, (schedule, source) in zip(paths, named):
        alike = [other for other, key in zip(paths, named) if key == (schedule, source)]
        file = "" if len(alike) == 1 else f" ({_tail(path, alike)})"
        out.append((f"{schedule}, {source}{file}", f"the {source} {schedule}{file}"))
    return out


def _tail(path: Path, alike: list[Path]) -> str:
    """The fewest last parts of `path` that no other of `alike` ends in: two folders' a.json are told apart by their
    folders (by name alone their summary bars were drawn as one), and no more of their paths (the whole of
    traces/measured/gpu-check-h200-day41/run-1f1b.json took 40 % of a 1,400 px page's lanes)."""
    whole = Path(os.path.abspath(path)).parts  # as given, not through a link (runs/latest, not its target's name)
    count = next(count for count in range(1, len(whole) + 1)  # view refused two paths of one file: one is found
                 if sum(Path(os.path.abspath(other)).parts[-count:] == whole[-count:] for other in alike) == 1)
    return str(Path(*whole[-count:]))


def view(
    traces: Annotated[list[Path], typer.Argument(help="Trace files (from simulate --trace or run --trace).",
                                                 metavar="TRACE...")],
    html: Annotated[Path | None, typer.Option(
        "--html", metavar="PATH", parser=output_path,
        help="Page to write (a pipesim page there is replaced). Default: the first trace's name with .html.")] = None,
) -> None:
    """Draw traces on one self-contained page (works offline). One view per trace and, for several traces, one
    with their lanes interleaved device by device, predicted beside measured; memory under the timelines, with each
    device's memory and the warning simulate's page gave (on stderr too, as simulate gives it) where the trace
    records its memory checks."""
    from ..sim.cluster import MemoryCheck
    from ..traces.trace import TraceError, read_trace
    from ..traces.view import write_timeline_page

    out = html if html is not None else traces[0].with_suffix(".html")
    try:
        with transient_status(READING_STATUS, quiet=False):  # a large run's traces: tens of seconds
            # the page is named after it: say why it cannot be read, or what it is where it is the page's own name (a
            # page given as the trace was refused as --html, a flag not given)
            if html is None and (not os.path.isfile(traces[0]) or out.resolve() == traces[0].resolve()):
                read_trace(traces[0])
            check_outputs([("--html", out)], [("trace", path) for path in traces])  # a file there: a pipesim page
            if len({path.resolve() for path in traces}) < len(traces):  # drawn twice under one name, its bars as one
                again = next(path for i, path in enumerate(traces)
                             if path.resolve() in {p.resolve() for p in traces[:i]})
                raise InputError(f"TRACE: {again} is given twice; give each trace once")
            replaced = out.is_file()
            loaded = [read_trace(path) for path in traces]
            if (empty := next((path for path, trace in zip(traces, loaded)
                               if not len(trace.ops) and trace.meta.complete), None)) is not None:
                raise InputError(f"trace {empty} holds no ops: nothing to draw (a run that stopped before its first "
                                 "op is marked incomplete)")
            labels, subjects = zip(*_names(traces, loaded))
            views = [(label, [i]) for i, label in enumerate(labels)]
            if len(loaded) > 1:
                views.insert(0, ("all, device by device", list(range(len(loaded)))))
            title = "pipesim: " + "; ".join(labels)  # a run's shape is its view line's (p=2, m=4, N=8, 272 ops)
            checks = [None if t.meta.memory_checks is None else [MemoryCheck.of_record(c) for c in t.meta.memory_checks]
                      for t in loaded]
            # a run that stopped part-way: its ms/step, bubble and peaks are those of what ran, not of the run
            notes = [f"{subject} is {trace.meta.incomplete_text}: its figures cover only the ops that ran"
                     for subject, trace in zip(subjects, loaded) if not trace.meta.complete]
            notes += [line for subject, device_checks in zip(subjects, checks) if device_checks is not None
                      and (line := out_of_memory_line(subject, device_checks)) is not None]
            with writing("--html"):
                write_timeline_page(loaded, out, labels=labels, views=views, title=title, notes=notes,
                                    memory_checks=checks)
    except (InputError, TraceError) as exc:
        fail(str(exc))
    for note in notes:  # as simulate warns: the page's note alone went unseen by a user who did not open it
        print_message(f"warning: {note}", stderr)
    stdout.print(wrote_text(out, replaced), highlight=False)
