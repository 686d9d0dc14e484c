"""`pipesim compare`: a measured run against its prediction, op by op."""

from __future__ import annotations

import json
import os
import shlex
from pathlib import Path
from typing import Annotated

import typer
from rich import box
from rich.table import Table
from rich.text import Text

from ..traces.metrics import mib_text, ms_text, percent_text, signed_text
from .common import (
    READING_STATUS,
    InputError,
    check_outputs,
    fail,
    output_path,
    refuse,
    stderr,
    stdout,
    transient_status,
    warn_of_wall_time_tail,
    writing,
)
from .tables import print_message, print_tables


def _percent(value: float | None) -> str:
    return "-" if value is None else percent_text(value, signed=True)


def _mib(value: float | None) -> str:
    """As the page writes MiB (`mib_text`): a run of a few KiB read "0.0 / 0.0", as if it held nothing."""
    return "n/a" if value is None else mib_text(value)


def _versions(c) -> str:
    """One true sentence about the weight versions: compared (and how many differ), or not recorded."""
    if not c.versions_compared:
        return "not compared (the measurement records none)"
    if not c.version_mismatches:
        return f"all {c.versions_compared:,} compared agree"
    return f"[bold red]{c.version_mismatches:,} of {c.versions_compared:,} differ[/], e.g. " + "; ".join(
        c.version_examples)


def _conditions(found) -> list[str]:
    """The conditions section: how long before the run the profile was calibrated, the others' load on the host
    while calibrating and running, the ranks, its host terms; "differs" beside what differs enough to explain an
    error."""
    from ..traces.hostload import format_age

    def load(value) -> str:
        return "not recorded" if value is None else value.figure()

    def ago(seconds: float | None) -> str:
        return f"{format_age(abs(seconds))} {'before' if seconds >= 0 else 'after'} the run"

    differs = " [bold yellow](differs)[/]"
    calibrated_for = (f"calibrated for {found.calibrated_ranks} computing at once" if found.calibrated_ranks
                      else "not recorded for the calibration")
    lines = ["calibrated: " + (ago(found.calibrated_before_run_s) if found.calibrated_before_run_s is not None
                               else "not recorded how long before the run"),
             f"others' load on the host: {load(found.calibrated_load)} while calibrating; {load(found.run_load)} "
             "while running" + (differs if found.load_differs else ""),
             f"ranks: {calibrated_for}; "
             + (f"ran {found.run_ranks} on one host" if found.run_ranks else "not recorded for the run")
             + (differs if found.ranks_differ else "")]
    for term in found.host_terms:
        how = "from the host cache, measured" if term.reused else "measured by the calibration"
        when = f" {ago(term.before_run_s)}" if term.before_run_s is not None else ""
        lines.append(f"{term.name}: {how}{when} at {term.load.describe() if term.load else 'a load not recorded'}"
                     + (differs if term.load_differs else ""))
    return lines


def _print_item(markup: str, indent: int = 2) -> None:
    """One item of a list: its first line `indent` spaces in, the lines it wraps onto twice that, so that each
    reads as one item (at 80 columns the host's load ran on from column 0, under the heading)."""
    for k, line in enumerate(Text.from_markup(markup).wrap(stdout, max(stdout.width - 2 * indent, 20))):
        stdout.print(Text(" " * (indent if k == 0 else 2 * indent)) + line, highlight=False)


def _render(c) -> None:
    stdout.print(f"[bold]{c.schedule}[/]: predicted {ms_text(c.predicted_ms)} ms per mini-batch, measured "
                 f"{ms_text(c.measured_ms)} ms: error [bold]{_percent(c.iteration_time_error)}[/] (predicted − "
                 f"measured) / measured; bubble {percent_text(c.predicted_bubble)} predicted, "
                 f"{percent_text(c.measured_bubble)} measured")
    if c.conditions is not None:
        stdout.print("conditions:", highlight=False)
        for line in _conditions(c.conditions):
            _print_item(line)
    if c.compute_duration_median is not None:
        stdout.print(f"compute ops: median duration error {percent_text(c.compute_duration_median)} (bias "
                     f"{_percent(c.compute_duration_bias)})", highlight=False)
    durations = Table(box=box.SIMPLE_HEAD, title_justify="left",
                      title="duration by kind, ms summed over its ops; error relative (worst: op@device)")
    starts = Table(box=box.SIMPLE_HEAD, title="start error by kind, ms from its mini-batch's first op in each run",
                   title_justify="left")
    for table, headers in ((durations, ("kind", "ops", "predicted ms", "measured ms", "|median|", "|p90|", "bias",
                                        "worst")),
                           (starts, ("kind", "ops", "|median|", "|p90|", "worst"))):
        for header in headers:
            table.add_column(header, justify="left" if header in ("kind", "worst") else "right", no_wrap=True)
    for k in c.kinds:
        worst = "-" if k.duration_worst is None else \
            f"{k.duration_worst.op}@{k.duration_worst.device} {percent_text(k.duration_worst.error, signed=True)}"
        durations.add_row(k.kind, f"{k.ops:,}", f"{k.predicted_ms:,.2f}", f"{k.measured_ms:,.2f}",
                          "-" if k.duration_median is None else percent_text(k.duration_median),
                          "-" if k.duration_p90 is None else percent_text(k.duration_p90), _percent(k.duration_bias),
                          worst)
        start_worst = "-" if k.start_worst is None else \
            f"{k.start_worst.op}@{k.start_worst.device} {signed_text(k.start_worst.error, 2)}"
        starts.add_row(k.kind, f"{k.ops:,}", f"{k.start_median_ms:,.2f}", f"{k.start_p90_ms:,.2f}", start_worst)
    devices = Table(box=box.SIMPLE_HEAD, title="per device (predicted / measured)", title_justify="left")
    for header in ("device", "busy ms", "exposed comm ms", "peak MiB", "peak error"):
        devices.add_column(header, justify="right")
    for d in c.devices:
        devices.add_row(str(d.device), f"{d.predicted_busy_ms:,.2f} / {d.measured_busy_ms:,.2f}",
                        f"{d.predicted_exposed_comm_ms:,.2f} / {d.measured_exposed_comm_ms:,.2f}",
                        f"{_mib(d.predicted_peak_memory_mb)} / {_mib(d.measured_peak_memory_mb)}",
                        _percent(d.peak_memory_error))
    print_tables([durations, starts, devices])
    pairs = (f" ({c.overlapped_pairs:,} overlapped pairs among them, each one F&B op in the tables)"
             if c.overlapped_pairs else "")
    stdout.print(f"matched {c.matched_ops:,} ops{pairs}; weight versions: {_versions(c)}", highlight=False)
    if c.missing_in_measured or c.missing_in_predicted:
        stdout.print(f"missing: {c.missing_in_measured:,} predicted ops were not measured, "
                     f"{c.missing_in_predicted:,} measured ops were not predicted, e.g. "
                     + "; ".join(c.missing_examples), highlight=False)
    for note in c.notes:
        stdout.print(f"note: {note}", highlight=False)


def _page_notes(c) -> list[str]:
    """What the page says above its timelines, as the command prints it: the warnings (which say what makes the
    error itself misleading: what-if costs, another runtime's passes, a busy host), the conditions the prediction
    was calibrated in against the run's, and the notes."""
    conditions = [Text.from_markup(line).plain for line in _conditions(c.conditions)] if c.conditions else []
    return ([f"warning: {warning}" for warning in c.warnings] + [f"conditions: {line}" for line in conditions]
            + [f"note: {note}" for note in c.notes])


def _pipesim_traces_refusal(folder: Path, files: list[Path], predicted: Path | None) -> str | None:
    """Where a folder given as MEASURED holds pipesim traces, which the torch.profiler reader took for rank 0's
    ("holds torch profiler traces", "profiler traces of ranks [0]"): the file to give, as a command where it holds
    that one alone. Refused, not taken from the folder: a folder means torch.profiler traces, and the page and --json
    would report a file the user never named (the swapped traces' refusal, too, gives the command, not the answer)."""
    from ..files import is_trace_bytes

    def is_trace(path: Path) -> bool:
        try:
            return is_trace_bytes(path.read_bytes())
        except OSError:  # the profiler reader names a file it cannot read
            return False

    traces = [path for path in files if is_trace(path)]
    if not traces:
        return None
    if traces == files and len(traces) == 1:
        again = " ".join(shlex.quote(str(path)) for path in (traces[0], predicted) if path is not None)
        return (f"MEASURED: {folder} holds a pipesim trace, not torch.profiler traces: give the file itself: "
                f"pipesim compare {again}")
    held = "a pipesim trace" if len(traces) == 1 else "pipesim traces"
    return (f"MEASURED: {folder} holds {held} ({', '.join(path.name for path in traces)}), not torch.profiler traces "
            "alone: give the measured trace file itself, or a folder of torch.profiler traces, one per rank")


def _read_traces(measured: Path, predicted: Path | None):
    """The predicted and the measured trace: MEASURED a pipesim trace or a folder of torch.profiler traces (read in
    the prediction's shape, and checked to be the run it predicts), PREDICTED a file, or the prediction of MEASURED
    again from the profile it recorded."""
    from ..traces.trace import TraceError, read_trace

    if os.path.isdir(measured):  # False for a path that cannot be looked at, which read_trace names
        from ..planning.torch_profile import check_same_run, profiler_actions, read_torch_profile

        # torch.profiler's traces as it exports them (.json), or its tensorboard_trace_handler's gzipped ones
        ranks = sorted([*measured.glob("*.json"), *measured.glob("*.json.gz")])
        if not ranks:  # before PREDICTED is asked for: the folder itself is what is wrong
            raise InputError(f"MEASURED: {measured} is a folder with no .json or .json.gz files; give a trace from "
                             "`pipesim run --trace`, or a folder of torch.profiler traces, one per rank")
        refuse(_pipesim_traces_refusal(measured, ranks, predicted))
        if predicted is None:  # said of what it holds: a file that is no profiler trace is named as such
            profiler_actions(ranks)
            raise InputError(f"{measured} holds torch profiler traces, which say nothing about the run's "
                             "schedule or costs: give the predicted trace too")
        predicted_trace = read_trace(predicted)
        measured_trace = read_torch_profile(ranks, like=predicted_trace)
        check_same_run(measured_trace, predicted_trace)
        return predicted_trace, measured_trace
    measured_trace = read_trace(measured)
    if predicted is None:
        from ..planning.replay import predict_measured, recorded_profile

        try:
            predicted_trace = predict_measured(measured_trace.meta)
        except TraceError as exc:  # said "a predicted trace: ...", no file named
            raise TraceError(f"MEASURED {measured}: {exc}") from None
        warn_of_wall_time_tail(recorded_profile(measured_trace.meta), f"MEASURED {measured}'s recorded profile")
        return predicted_trace, measured_trace
    predicted_trace = read_trace(predicted)
    if (measured_trace.meta.source, predicted_trace.meta.source) == ("predicted", "measured"):
        # swapped, the run's error came out as its prediction's, inverted, and sign flipped
        raise InputError(f"MEASURED {measured} is a predicted trace and PREDICTED {predicted} a measured one: the "
                         f"run comes first: pipesim compare {predicted} {measured}")
    return predicted_trace, measured_trace


def compare(
    measured: Annotated[Path, typer.Argument(
        help="Measured trace (from `pipesim run --trace`), or a folder of torch.profiler traces of a "
             "torch.distributed.pipelining run, one per rank.", metavar="MEASURED")],
    predicted: Annotated[Path | None, typer.Argument(
        help="Predicted trace (`pipesim simulate --trace`). Default: predict MEASURED again from the profile it "
             "was run with.", metavar="PREDICTED")] = None,
    html: Annotated[Path | None, typer.Option(
        "--html", metavar="PATH", parser=output_path, help="Write both timelines to this HTML page.")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON document instead of tables.")] = False,
) -> None:
    """Compare a measured run with its prediction op by op. Iteration time, per-op duration and start errors by
    kind, bubble, exposed communication, peak memory per device, and the weight versions (which must agree).
    Errors are (predicted − measured) / measured."""
    from ..traces.compare import compared
    from ..traces.trace import TraceError

    try:
        with transient_status(READING_STATUS, quiet=as_json):  # a large run's traces: tens of seconds
            check_outputs([("--html", html)], [("measured trace", measured), ("predicted trace", predicted)], as_json)
            predicted_trace, measured_trace = _read_traces(measured, predicted)
            result, held = compared(predicted_trace, measured_trace)
            if html is not None:
                from ..traces.view import error_figure, write_timeline_page

                with writing("--html"):  # the prediction the figures hold against the run (an incomplete one's part)
                    write_timeline_page([held, measured_trace], html, labels=["predicted", "measured"],
                                        title=f"pipesim: {result.schedule}, predicted and measured",
                                        views=[("predicted and measured", [0, 1]), ("predicted", [0]),
                                               ("measured", [1])],
                                        notes=_page_notes(result),
                                        figures=[("per-op duration error by kind", error_figure(result))])
    except (InputError, TraceError) as exc:
        fail(str(exc))
    for warning in result.warnings:
        print_message(f"warning: {warning}", stderr)
    if as_json:
        print(json.dumps(result.to_dict(), indent=2))
    else:
        _render(result)
        if html is not None:
            stdout.print(f"wrote {html}", highlight=False)
