"""Interactive, self-contained HTML views: the timeline page for traces and a page of Plotly figures.

The timeline page (`write_timeline_page`) holds plotly.js once, each trace's op columns as compressed typed
arrays (byte planes, zlib, base64: a few bytes per op) and a small script that draws ONE timeline figure with
a selector to switch between views, so a page holds one WebGL figure whatever the number of schedules. Bars are
WebGL line segments, one trace per kind, sized from the lane's pixel height; hover text is built in the page
from the columns for the op under the pointer (the file holds no per-op strings). A view shows one trace or
several aligned device by device (lanes interleaved), so a prediction and a measurement can be read side by
side. Memory per device sits under the timeline; a comparison of the views' summaries sits at the top.

Every page records its own health on `<body>`: `data-status` is "loading", then "ok" once the first plot is
drawn, or "error" (sticky) with `data-errors` naming a script error, a lost WebGL context, a network request
(a content security policy blocks them all) or a blank plot. Opened with `#test`, the timeline page draws every
view in turn and checks each one's pixels before it says "ok": tests/test_browser.py reads that.
"""

from __future__ import annotations

import base64
import html
import json
import math
import os
import re
import zlib
from collections.abc import Iterable, Sequence
from typing import Any, Protocol

import numpy as np
import plotly.graph_objects as go
from plotly.colors import qualitative, sample_colorscale

from ..files import PAGE_HEALTH
from ..memory_parts import MEMORY_PARTS, SAVERS
from ..units import MIB, degree_text, rounds_text
from .compare import Comparison
from .metrics import MIB_SHOWN, MS_DECIMALS, Summary, mib_text, ms_text, percent_text, rate_text, summarize
from .trace import STREAMS, Trace, TraceMeta, write_atomic


class MemoryCheck(Protocol):
    """What the page reads of a device's memory check (sim/cluster.py's, which traces/ may not import): the most the
    device alone may hold, the shared GPU whose memory it draws on (None: its own), and whether it is out of
    memory, as the table's fits / OOM says."""

    @property
    def room_bytes(self) -> float | None: ...

    @property
    def memory(self) -> str | None: ...

    @property
    def out_of_memory(self) -> bool: ...


# Fixed per kind, so the same kind looks the same in every figure and comparisons read at a glance.
KIND_COLORS = {
    "F": "#4c78a8",
    "B": "#54a24b",
    "I": "#8fd175",
    "W": "#2e6b30",
    "F&B": "#17becf",  # compare's overlapped pair, one unit (traces/compare.py PAIR_KIND)
    "OPT": "#e45756",
    "PRED": "#9d6bc4",
    "AVG": "#f58518",
    "REDUCE": "#e0a100",
    "GATHER": "#b07c00",
    "A2A_F": "#72b7b2",
    "A2A_B": "#3d8a85",
    "RING_F": "#d67fb5",
    "RING_B": "#a0457e",
    "SEND_F": "#b0b0b0",  # sends grey, receives tan: alike, their legend entries read as one kind
    "RECV_F": "#d4b483",
    "SEND_B": "#7a7a7a",
    "RECV_B": "#8c6d3f",
}
_OP_COLUMNS = ("device", "stream", "kind", "stage", "microbatch", "minibatch", "pipeline", "peer", "version",
               "prediction", "start_us", "dur_us")
_SUMMARY_FIELDS = ("schedule", "makespan_ms", "time_per_minibatch_ms", "samples_per_s", "bubble_fraction",
                   "exposed_comm_ms", "peak_memory_mb", "max_staleness")
# No request leaves the page: anything but inline code, inline styles and data/blob URLs is refused (and
# reported by the health script). regl, plotly's WebGL layer, compiles its draw calls, hence 'unsafe-eval'.
_CSP = ("default-src 'none'; script-src 'unsafe-inline' 'unsafe-eval'; style-src 'unsafe-inline'; "
        "img-src data: blob:; font-src data:; connect-src data: blob:; worker-src blob:")


def kind_color(kind: str, code: int = 0) -> str:
    """The colour of op kind `kind` (one from a fixed palette for kinds pipesim does not know)."""
    return KIND_COLORS.get(kind, qualitative.Dark24[code % len(qualitative.Dark24)])


# --- page data ---------------------------------------------------------------------------------------------

def _smallest(values: np.ndarray) -> np.ndarray:
    """Integers in the narrowest signed type that holds them (float64 past int32); floats as float64."""
    if values.dtype.kind not in "iu":
        return values.astype("<f8")
    if len(values) == 0:
        return values.astype("<i1")
    lo, hi = int(values.min()), int(values.max())
    for dtype in ("<i1", "<i2", "<i4"):
        info = np.iinfo(dtype)
        if info.min <= lo and hi <= info.max:
            return values.astype(dtype)
    return values.astype("<f8")


def encode_column(values: np.ndarray) -> dict[str, Any]:
    """One typed array for the page: its bytes regrouped as planes (every element's first byte, then every
    second byte, ...: neighbouring values then share most bytes and compress well), zlib, base64."""
    array = np.ascontiguousarray(_smallest(np.asarray(values)))
    planes = array.view(np.uint8).reshape(len(array), array.itemsize).T.tobytes()
    return {"type": array.dtype.name, "n": len(array),
            "z": base64.b64encode(zlib.compress(planes, 6)).decode("ascii")}


def decode_column(column: dict[str, Any]) -> np.ndarray:
    """The inverse of `encode_column` (the page does the same in JavaScript)."""
    dtype = np.dtype(column["type"]).newbyteorder("<")
    planes = np.frombuffer(zlib.decompress(base64.b64decode(column["z"])), dtype=np.uint8)
    return planes.reshape(dtype.itemsize, column["n"]).T.copy().view(dtype).ravel()


STACK_COLUMNS = 4000  # the stacked memory curve's most samples: beyond, one per column, where its total is highest
PART_WORDS = {"parameters": "weights", "gradients": "gradients", "optimizer_state": "optimizer state",
              "activations": "activations", "activations.attention": "activations: attention",
              "activations.mlp": "activations: MLP", "activations.norms": "activations: norms",
              "activations.dropout": "activations: dropout masks", "activations.other": "activations: other",
              "communication": "transfer buffers", "runtime_buffers": "runtime's buffers",
              "transient": "a pass's transient tensors", "reserve": "allocator's reserve"}
PART_COLORS = {"parameters": "#4c78a8", "gradients": "#f58518", "optimizer_state": "#54a24b",
               "activations": "#e45756", "activations.attention": "#e45756", "activations.mlp": "#ff9da6",
               "activations.norms": "#9d755d", "activations.dropout": "#bab0ac", "activations.other": "#eeca3b",
               "communication": "#b279a2", "runtime_buffers": "#d67195", "transient": "#17becf",
               "reserve": "#79706e"}


def stacked_memory(trace: Trace, end_us: float) -> dict[str, Any] | None:
    """The fullest device's memory by part (of those the `memory_bytes.PART` counters hold), stacked: per
    part, MiB of it and of the parts before it, on the times any part changes (held to `end_us`); the
    activations by what saves them where the trace says (not all other); None where the trace has no parts. A
    long run's curve keeps STACK_COLUMNS samples, each its column's moment of most memory, so the peak's parts
    stay shown."""
    if any(f"memory_bytes.{part}" not in trace.counters for part in MEMORY_PARTS[:5]):
        return None  # (a trace from before transients and the reserve were counted has the others)
    drawn = [d for d, curve in enumerate(trace.counters["memory_bytes.parameters"]) if len(curve.times_us)]
    if not drawn:
        return None
    totals = trace.counters["memory_bytes"]
    device = max(drawn, key=lambda d: totals[d].values.max())  # the device whose peak the table shows
    savers = [trace.counters.get(f"memory_bytes.{saver}") for saver in SAVERS]
    attributed = all(curve is not None for curve in savers) and any(
        curve[device].values.any() for curve in savers[:-1])
    parts = [*MEMORY_PARTS[:3], *(SAVERS if attributed else ("activations",)), "communication",
             *(part for part in MEMORY_PARTS[5:] if f"memory_bytes.{part}" in trace.counters)]
    curves = [trace.counters[f"memory_bytes.{part}"][device] for part in parts]
    times = np.unique(np.concatenate([curve.times_us for curve in curves]))
    # a part the device never holds is no layer and no legend entry: "transfer buffers", "a pass's transient
    # tensors" and "allocator's reserve" were listed under a run of typed costs without comm, drawn nowhere
    kept = [(part, curve) for part, curve in zip(parts, curves) if curve.values.any()]
    if not kept:
        return None  # (a trace that holds no memory, as one simulated without sizes)
    parts, curves = zip(*kept)
    held = np.array([curve.values[np.searchsorted(curve.times_us, times, side="right") - 1] for curve in curves])
    times, held = _with_instant_peaks(times, held, curves, totals[device])
    if len(times) > STACK_COLUMNS:
        column = np.minimum((times / max(end_us, float(times[-1]), 1e-9) * STACK_COLUMNS).astype(np.int64),
                            STACK_COLUMNS - 1)
        order = np.lexsort((-held.sum(axis=0), column))  # by column, most memory first
        first = order[np.r_[True, column[order][1:] != column[order][:-1]]]
        keep = np.sort(first)
        times, held = times[keep], held[:, keep]
    times = np.append(times, max(end_us, float(times[-1])))
    held = np.concatenate([held, held[:, -1:]], axis=1)
    stack = np.cumsum(held, axis=0) / MIB
    return {"device": device, "names": [PART_WORDS[part] for part in parts],
            "colors": [PART_COLORS[part] for part in parts], "t_us": encode_column(times.astype(np.float64)),
            "stack": [encode_column(level.astype(np.float64)) for level in stack]}


def _most_at(curve, times: np.ndarray) -> np.ndarray:
    """A counter's most at each of `times` (sorted, unique): of the values it takes at that moment, several where
    it rises and falls within it (a send's buffer made and freed at once); where it takes none, what it holds."""
    first = np.searchsorted(curve.times_us, times, side="left")
    last = np.searchsorted(curve.times_us, times, side="right")
    most = np.where(last > 0, curve.values[np.maximum(last - 1, 0)], 0).astype(np.float64)
    for at in np.flatnonzero(last - first > 1):
        most[at] = curve.values[first[at]:last[at]].max()
    return most


def _with_instant_peaks(times: np.ndarray, held: np.ndarray, curves, total) -> tuple[np.ndarray, np.ndarray]:
    """The stack's samples (`held`, per part, as each stands after `times`) with a sample before each moment at
    which the device's memory rose and fell within that moment, holding each part's most there, where those add up
    to no more than the device's most then (one part rose alone): such a peak lasts no time, and the stack, which
    kept what came after it, topped out under the peak the table gives (1,288 MiB under 1,296: two transfer
    buffers at one moment)."""
    most = np.array([_most_at(curve, times) for curve in curves])
    total_most = _most_at(total, times)
    instant = (most.sum(axis=0) > held.sum(axis=0)) & (most.sum(axis=0) <= total_most)
    if not instant.any():
        return times, held
    at = np.flatnonzero(instant)
    return np.insert(times, at, times[at]), np.insert(held, at, most[:, at], axis=1)


def trace_data(trace: Trace, label: str | None = None, summary: Summary | None = None,
               memory_checks: Sequence[MemoryCheck] | None = None) -> dict[str, Any]:
    """What the page needs of one trace: its op columns, memory per device (MiB, the last value held to the
    end of the run) with the most each device may hold where known (`memory_checks`, one per device: its
    `room_bytes`, its memory less the peaks of ranks sharing its GPU; the page draws it as a dashed line over
    the device's curve), summary and shape."""
    ops = trace.ops
    summary = summary or summarize(trace)
    meta = trace.meta
    memory = None
    counters = trace.counters.get("memory_bytes")
    if counters and any(len(c.times_us) for c in counters):
        end_us = float(ops.end_us.max()) if len(ops) else 0.0
        times, values, counts = [], [], []
        for counter in counters:
            k = len(counter.times_us)
            if k:
                times.append(np.append(counter.times_us, max(end_us, float(counter.times_us[-1]))))
                values.append(np.append(counter.values, counter.values[-1]) / MIB)
            counts.append(k + 1 if k else 0)
        checks = memory_checks or [None] * len(counters)
        memory = {"counts": counts, "t_us": encode_column(np.concatenate(times)),
                  "mib": encode_column(np.concatenate(values).astype(np.float64)),
                  "colors": sample_colorscale("Viridis", np.linspace(0, 0.85, max(len(counters), 2)).tolist()),
                  "parts": stacked_memory(trace, end_us),
                  "limits_mib": [None if check is None or check.room_bytes is None else check.room_bytes / MIB
                                 for check in checks],
                  "limits_shared": [check is not None and check.memory is not None for check in checks]}
    return {
        "label": label or meta.schedule,
        "kinds": list(trace.kinds),
        "colors": [kind_color(k, i) for i, k in enumerate(trace.kinds)],
        "streams": list(STREAMS),
        "num_devices": trace.num_devices,
        "n": len(ops),
        "columns": {name: encode_column(getattr(ops, name)) for name in _OP_COLUMNS},
        "memory": memory,
        "summary": {**{k: getattr(summary, k) for k in _SUMMARY_FIELDS},
                    "peak_memory_text": None if summary.peak_memory_mb is None else mib_text(summary.peak_memory_mb)},
        "meta": {"source": meta.source, "schedule": meta.schedule, "microbatches": meta.microbatches,
                 "minibatches": meta.minibatches, "pipelines": meta.pipelines,
                 "stages": int(ops.stage.max()) + 1 if len(ops) else 0, "shape": shape_text(trace),
                 # the view line gives the source where its label does not: view's "1f1b, measured" and compare's
                 # "measured" do (a line read "1f1b, measured: ... (p=2, m=4, N=8, 272 ops, measured)")
                 "source_unnamed": re.search(rf"\b{re.escape(meta.source)}\b", label or "") is None},
        "device_names": device_names(trace),
    }


def _devices_per_pipeline(meta: TraceMeta) -> int:
    """p: the devices one pipeline replica spans (its placement's), whatever a trace of several replicas holds."""
    return max(meta.placement) + 1 if meta.placement else 1


def device_names(trace: Trace) -> list[str]:
    """Each device's name on the page. A run of d data-parallel replicas has p·d ranks, each at replica·p + device:
    they are named by replica and device in it ("replica 1 · device 0"), as `pipesim run` places them."""
    p = _devices_per_pipeline(trace.meta)
    if int(trace.meta.params.get("data_parallel", 1)) == 1 or trace.num_devices <= p:
        return [f"device {d}" for d in range(trace.num_devices)]
    return [f"replica {rank // p} · device {rank % p}" for rank in range(trace.num_devices)]


def shape_text(trace: Trace) -> str:
    """The run's shape as the command line gives it: p devices per pipeline, d replicas (and whether the trace
    holds them all or one stands for all, as a prediction's does), v chunks, P pipelines, m, N; of a run that
    stopped part-way, the mini-batches every device updated its weights for too (an interrupted run's line read
    N=2,000 where 312 ran)."""
    meta = trace.meta
    p, d = _devices_per_pipeline(meta), int(meta.params.get("data_parallel", 1))
    chunks = int(meta.params.get("chunks", 1))
    parts = [degree_text("p", p)]
    if d > 1:
        parts.append(degree_text("d", d) + ("" if trace.num_devices > p else " (one replica drawn)"))
    if chunks > 1:
        parts.append(degree_text("v", chunks))
    if meta.pipelines > 1:
        parts.append(degree_text("P", meta.pipelines))
    ran = ""
    if not meta.complete and "OPT" in trace.kinds:
        updates = np.bincount(trace.ops.device[trace.ops.kind == trace.kinds.index("OPT")],
                              minlength=trace.num_devices)
        ran = f" asked, {int(updates.min()):,} run"
    return ", ".join(parts + [degree_text("m", meta.microbatches) + rounds_text(meta.rounds),
                              degree_text("N", meta.minibatches) + ran])


def _labels(traces: Sequence[Trace]) -> list[str]:
    """Each trace's schedule, with its source where that alone tells two apart, then a number if still needed."""
    labels = [t.meta.schedule for t in traces]
    if len(set(labels)) < len(labels):
        labels = [f"{t.meta.schedule} ({t.meta.source})" for t in traces]
    seen: dict[str, int] = {}
    out = []
    for label in labels:
        seen[label] = seen.get(label, 0) + 1
        out.append(label if labels.count(label) == 1 else f"{label} #{seen[label]}")
    return out


# The pages' numbers, one rule per unit (metrics.py's ms_text, mib_text, percent_text, rate_text), written alike by
# Python (figures' text, tables' cells) and by the timeline's script (its hovers and title: msText, mibText,
# percentText), with thousands separators throughout: an axis tick read "1000" and "20k" where every figure read
# "1,288".
TICK_FORMAT = ","  # the axes' ticks of ms, MiB, samples and samples/s: "1,000", "20,000" (plotly's own: "20k")
# An axis whose ticks plotly places: every tick to the decimals its step has ("24.5, 25.0, 25.5", where "," wrote
# "24.5 25 25.5"); a step's bounds are inclusive and the first stop that holds it counts.
TICK_FORMAT_STOPS = [{"dtickrange": [1, None], "value": TICK_FORMAT}, {"dtickrange": [0.1, 1], "value": ",.1f"},
                     {"dtickrange": [0.01, 0.1], "value": ",.2f"}, {"dtickrange": [None, 0.01], "value": ",.3f"}]
# Where plotly's mode bar ends under a figure's top (23 px high, 2 px down): a small figure's title, plot or table
# starts under it (at 800 px the sweep's title ran under its icons, the study's accuracy chart's top markers too).
MODEBAR_BOTTOM_PX = 25
# A small figure's plot or table starts UNDER_MODEBAR_PX under the mode bar, or LINE_OVER_PX where a line of text
# stands over it (a title, whose text plotly writes 15 px above its top pad; a note): at 20 px from the top the mode
# bar lay over the study's accuracy chart's top markers, and at 800 px it touched the Adam panel's title and ran
# over the sweep's title and its table's "bubble" header.
UNDER_MODEBAR_PX, LINE_OVER_PX = 5, 20


# The summary chart's panels: (title, Summary field, bar text); samples/s first, the one measure that a mini-batch
# of another size (AvgPipe's P pipelines, d replicas) does not distort, written as the commands' tables write it.
_SUMMARY_PANELS = (("samples/s (more is better)", "samples_per_s", rate_text),
                   ("time per mini-batch (ms)", "time_per_minibatch_ms", ms_text),
                   ("bubble", "bubble_fraction", percent_text),
                   ("peak memory per device (MiB)", "peak_memory_mb", mib_text))
SUMMARY_SHOWN, SUMMARY_OTHER = "#4c78a8", "#bccbe0"  # the selected view's traces' bars, and the others'
# The bars' figures, level and of one size in every panel: plotly's defaults turned a figure that fits a bar
# better on end ("45" MiB on 16 bars) and wrote one outside a short bar larger than those inside.
SUMMARY_TEXT_PX = 10


def summary_figure(traces: Sequence[Trace], labels: Sequence[str], summaries: Sequence[Summary],
                   shown: Sequence[int],
                   memory_checks: Sequence[Sequence[MemoryCheck] | None] | None = None,
                   unsteady: Sequence[bool] | None = None) -> dict[str, Any]:
    """The chart that heads a page of several traces (Plotly's figure JSON, which the page draws): a horizontal bar
    per trace in each panel of `_SUMMARY_PANELS`, the traces `shown` (the first view's) highlighted. Time per
    mini-batch says how many samples each mini-batch holds, and its title warns where they differ: a larger
    mini-batch takes longer. A trace out of memory on a device of its `memory_checks` (per trace, as
    `timeline_page` takes them) has "OOM" after its peak, as the table's memory column says: ZB-V's DeepSeek-V3
    peak led the panel unmarked, the fastest bar beside it. `titles` are the panels' titles and notes as text: the
    page builds their annotations, each wrapped to its panel's width, and grows the top margin by the lines they
    take (`fitSummaryTitles`), so the figure's layout holds none. A trace `unsteady` says has its samples/s and
    time per mini-batch marked *, as simulate's table marks a step that is no steady state."""
    samples = [t.meta.samples_per_minibatch for t in traces]
    marks = ["*" if short else "" for short in unsteady or [False] * len(traces)]
    over = [any(check.out_of_memory for check in checks or ()) for checks in memory_checks or [None] * len(traces)]
    data = []
    for j, (title, field, text_of) in enumerate(_SUMMARY_PANELS):
        values = [getattr(s, field) for s in summaries]
        texts = ["n/a" if v is None else text_of(v) for v in values]
        if field in ("samples_per_s", "time_per_minibatch_ms"):
            texts = [text + mark for text, mark in zip(texts, marks)]
        hover = texts
        if field == "time_per_minibatch_ms":
            hover = [f"{text} ms per mini-batch of {n:,} samples" for text, n in zip(texts, samples)]
        elif field == "peak_memory_mb":
            hover = [text if v is None else f"{text} MiB" + (", out of memory" if oom else "")  # "n/a", no unit
                     for text, v, oom in zip(texts, values, over)]
            texts = [text + (" OOM" if oom else "") for text, oom in zip(texts, over)]
        # a value not recorded (a torch run's memory) is a bar of 0 whose "n/a" stands beside it: as None, plotly drew
        # no bar, and its text with it, so the panel read as if the trace were not there
        data.append({"type": "bar", "orientation": "h", "y": list(labels), "x": [0 if v is None else v for v in values],
                     "text": texts, "customdata": hover,
                     "textposition": ["outside" if v is None else "auto" for v in values], "textangle": 0,
                     "cliponaxis": False,
                     "xaxis": "x" + (str(j + 1) if j else ""), "yaxis": "y", "showlegend": False, "name": title,
                     "marker": {"color": [SUMMARY_SHOWN if k in shown else SUMMARY_OTHER for k in range(len(labels))]},
                     "hovertemplate": "%{y}: %{customdata}<extra>" + title + "</extra>"})
    notes = ["" for _ in _SUMMARY_PANELS]
    if len(set(samples)) > 1:  # on a line of its own: beside the title it ran over the next panel's at 1000 px
        notes[1] = "mini-batches differ in size"
    width = 1 / len(_SUMMARY_PANELS)
    layout: dict[str, Any] = {
        "height": 80 + 20 * len(labels),  # and the titles' lines past the first (`fitSummaryTitles`)
        "margin": {"t": 30, "b": 20, "l": 20 + 7 * max(len(label) for label in labels), "r": 20},
        "paper_bgcolor": "#fff", "plot_bgcolor": "#fff", "font": {"size": 12}, "bargap": 0.25,
        "uniformtext": {"mode": "show", "minsize": SUMMARY_TEXT_PX},
        "yaxis": {"autorange": "reversed", "type": "category", "ticks": "", "fixedrange": True},
    }
    for j, (_, field, _) in enumerate(_SUMMARY_PANELS):
        layout["xaxis" + (str(j + 1) if j else "")] = {
            "domain": [j * width, (j + 1) * width - 0.04], "anchor": "y", "gridcolor": "#ececec", "zeroline": False,
            "rangemode": "tozero", "fixedrange": True,
            "tickformat": ".0%" if field == "bubble_fraction" else TICK_FORMAT}
    return {"data": data, "layout": layout, "colors": [SUMMARY_SHOWN, SUMMARY_OTHER],
            "titles": [{"title": title, "note": note} for (title, _, _), note in zip(_SUMMARY_PANELS, notes)]}


def timeline_page(traces: Sequence[Trace], *, title: str | None = None, labels: Sequence[str] | None = None,
                  summaries: Sequence[Summary] | None = None,
                  views: Sequence[tuple[str, Sequence[int]]] | None = None, notes: Sequence[str] = (),
                  figures: Sequence[tuple[str, go.Figure]] = (),
                  memory_checks: Sequence[Sequence[MemoryCheck] | None] | None = None,
                  unsteady: Sequence[bool] | None = None) -> str:
    """The HTML of the timeline page for `traces`.

    `labels` name the traces (default: their schedules); `summaries` are their `summarize` results (computed
    when not given). `views` are (name, trace indices) pairs, one button each: a view of several traces shows
    their lanes interleaved device by device, e.g. `[("1f1b: predicted vs measured", [0, 1])]`; the default is
    one view per trace. With two traces or more, a chart comparing them (`summary_figure`: samples/s, time per
    mini-batch, bubble, peak memory; the selected view's traces highlighted) heads the page. `notes` are lines
    shown under the title (methods that could not run, say); `figures` are small (SVG) figures with a heading
    each, under the timeline (compare's error panel). `memory_checks` holds, per trace, each device's check
    against its memory (the table's fits / OOM), drawn as a dashed line over its memory curve at the most it
    may hold, so what does not fit shows. `unsteady`: per trace, whether its step is no steady state's, marked *
    in the chart as the table marks it (a note says why).
    """
    traces = list(traces)
    if not traces:
        raise ValueError("timeline_page: no traces")
    labels = list(labels) if labels is not None else _labels(traces)
    summaries = list(summaries) if summaries is not None else [summarize(t) for t in traces]
    if not len(labels) == len(summaries) == len(traces):
        raise ValueError("timeline_page: one label and one summary per trace")
    checks = list(memory_checks) if memory_checks is not None else [None] * len(traces)
    if len(checks) != len(traces) or any(device_checks is not None and len(device_checks) != trace.num_devices
                                         for device_checks, trace in zip(checks, traces)):
        raise ValueError("timeline_page: memory checks need one list per trace, one check per device")
    if views is None:
        views = [(label, [i]) for i, label in enumerate(labels)]
    for name, members in views:
        if not members or any(not 0 <= i < len(traces) for i in members):
            raise ValueError(f"timeline_page: view {name!r} names no trace or a missing one: {list(members)}")
    title = title or "pipesim: " + ", ".join(labels)
    data = {
        "title": title,
        "notes": list(notes),
        "traces": [trace_data(t, label, s, check) for t, label, s, check in zip(traces, labels, summaries, checks)],
        "views": [{"name": name, "traces": list(members)} for name, members in views],
        "summary": (summary_figure(traces, labels, summaries, views[0][1], checks, unsteady) if len(traces) > 1
                    else None),
        "numbers": {"mib_shown": MIB_SHOWN, "ms_decimals": MS_DECIMALS, "tick_format": TICK_FORMAT},
    }
    payload = json.dumps(data, separators=(",", ":")).replace("</", "<\\/")
    from plotly.offline import get_plotlyjs

    return (
        "<!DOCTYPE html>\n<html lang=\"en\">\n<head>\n<meta charset=\"utf-8\">\n"
        f"<meta http-equiv=\"Content-Security-Policy\" content=\"{_CSP}\">\n"
        f"<title>{html.escape(title)}</title>\n<style>{_PAGE_CSS}</style>\n"
        f"<script>{_HEALTH_JS}</script>\n</head>\n"
        "<body data-status=\"loading\">\n"
        f"<h1>{html.escape(title)}</h1>\n<div id=\"notes\"></div>\n<div id=\"summary\"></div>\n"
        "<nav id=\"views\" aria-label=\"views\"></nav>\n<div id=\"timeline\"></div>\n<div id=\"tip\"></div>\n"
        f"<script>{get_plotlyjs()}</script>\n"
        f"<script type=\"application/json\" id=\"pipesim-data\">{payload}</script>\n"
        f"<script>{_TIMELINE_JS}</script>\n"
        + "".join(f"<section><h2>{html.escape(heading)}</h2>\n"
                  f"{fig.to_html(full_html=False, include_plotlyjs=False, config={'displaylogo': False})}\n</section>\n"
                  for heading, fig in figures)
        + "</body>\n</html>\n"
    )


def log_ticks(span: Sequence[float]) -> list[float]:
    """A log axis's labelled ticks over `span` (log10 units): 1, 2 and 5 of each decade, or each of 1 to 9 where
    that leaves fewer than three; none (plotly's own, then) where even those leave fewer than two, as within 2.1 to
    2.9. Plotly's own label every minor tick of a longer span with its digit alone (under "1", "9 8 7 6 5 4 3 2"
    for 0.9 down to 0.2, then "0.1")."""
    ticks: list[float] = []
    for factors in ((1, 2, 5), range(1, 10)):
        ticks = [float(f"{f}e{e}") for e in range(math.floor(span[0]), math.ceil(span[1]) + 1) for f in factors
                 if span[0] <= math.log10(f) + e <= span[1]]
        if len(ticks) >= 3:
            break
    return ticks if len(ticks) >= 2 else []


MIN_BAR_DECADES = 0.5  # the error chart's smallest bar is at least this tall, in decades of its log axis


def error_figure(comparison: Comparison) -> go.Figure:
    """Per-op duration error by kind (median and p90 of |predicted − measured| / measured), in the kinds' colours, on
    a log axis: one kind's error can be a hundred times another's (a receive that waits 1,500 % longer than
    predicted beside compute within 5 %), and each must still be read. Every bar carries its value; a kind
    predicted exactly (0 %, which a log axis cannot draw) is marked so under its bars. Its figure is whole from
    100 % up, never shrunk under SUMMARY_TEXT_PX, and as dark over a pale p90 bar as over a median one: at 800 px
    plotly shrank "1,327.8%" to 7 px to fit its bar's width, and drew it at the bar's 0.45 opacity."""
    kinds = [k for k in comparison.kinds if k.duration_median is not None]
    names = [k.kind if k.duration_median > 0 else f"{k.kind} ({'median 0%' if k.duration_p90 > 0 else 'exact'})"
             for k in kinds]
    colours = [kind_color(k.kind) for k in kinds]
    bars = []
    for name, values, opacity in (("median", [k.duration_median for k in kinds], 1.0),
                                  ("p90", [k.duration_p90 for k in kinds], 0.45)):
        bars.append(go.Bar(name=name, x=names, y=[100 * v if v > 0 else None for v in values],
                           marker={"color": colours, "opacity": opacity},
                           text=[percent_text(v) for v in values], textposition="outside",
                           cliponaxis=False, hovertemplate="%{x} " + name + ": %{text}<extra></extra>"))
    drawn = [y for bar in bars for y in bar.y if y is not None]
    # From a decade at least MIN_BAR_DECADES under the smallest bar (a log axis has no zero to start bars from: from
    # the decade just under it, 11 % beside 1,500 % was a bar of 2 px) to above the largest. The span then holds a
    # decade's 1, 2 and 5, so log_ticks always labels it.
    span = ([math.floor(math.log10(min(drawn)) - MIN_BAR_DECADES), math.log10(max(drawn)) + 0.2] if drawn
            else [0, 2])
    ticks = log_ticks(span)
    fig = go.Figure(bars)
    fig.update_layout(barmode="group", height=340, margin=dict(l=60, r=20, t=40, b=40), showlegend=False,
                      uniformtext={"mode": "show", "minsize": SUMMARY_TEXT_PX},
                      yaxis=dict(type="log", range=span, title="|duration error| (%, log scale)",
                                 tickvals=ticks, ticktext=[f"{t:,g}%" for t in ticks]),
                      template="plotly_white",
                      title=f"iteration time error {percent_text(comparison.iteration_time_error, signed=True)}; bars: "
                            "median, pale: p90")
    return fig


def write_timeline_page(traces: Sequence[Trace], path: str | os.PathLike[str], **options: Any) -> None:
    """Write `timeline_page(traces, **options)` to `path`, atomically: a failure leaves no half-written page."""
    write_atomic(path, timeline_page(traces, **options))


def write_html(figures: Iterable[tuple[str, go.Figure]], path: str | os.PathLike[str],
               title: str = "pipesim") -> None:
    """Write one self-contained HTML page showing `(heading, figure)` pairs one below the other.

    For small figures (the sweep's trade-off page): each figure is a plot of its own, so use at most one
    WebGL trace type among them (browsers keep only a few WebGL contexts alive); timelines go through
    `write_timeline_page`. plotly.js is embedded once, so the page opens offline; the page reports its health
    like the timeline page; the file is written atomically.
    """
    sections = []
    for i, (heading, fig) in enumerate(figures):
        div = fig.to_html(full_html=False, include_plotlyjs=i == 0,
                          config={"displaylogo": False, "scrollZoom": True})
        sections.append(f"<section><h2>{html.escape(heading)}</h2>\n{div}\n</section>")
    page = (
        "<!DOCTYPE html>\n<html lang=\"en\">\n<head>\n<meta charset=\"utf-8\">\n"
        f"<meta http-equiv=\"Content-Security-Policy\" content=\"{_CSP}\">\n"
        f"<title>{html.escape(title)}</title>\n<style>{_PAGE_CSS}</style>\n"
        f"<script>{_HEALTH_JS}</script>\n</head>\n<body data-status=\"loading\">\n"
        + "\n".join(sections)
        + f"\n<script>window.addEventListener('load', () => requestAnimationFrame(() => {PAGE_HEALTH}.done()));"
          "</script>\n</body>\n</html>\n"
    )
    write_atomic(path, page)


# --- the page's own code -----------------------------------------------------------------------------------

_PAGE_CSS = """
body{font-family:system-ui,sans-serif;margin:1em 2em;color:#222}
h1{font-size:1.25em;margin:0 0 .3em}h2{font-size:1.1em;margin:1.5em 0 0}
#notes p{margin:.2em 0;color:#8a4b00}
#views{display:flex;flex-wrap:wrap;gap:.3em;margin:.6em 0}
#views button{font:inherit;font-size:.9em;padding:.2em .7em;border:1px solid #aab;border-radius:4px;
  background:#f6f7fa;cursor:pointer}
#views button.on{background:#4c78a8;border-color:#4c78a8;color:#fff}
#tip{position:fixed;display:none;pointer-events:none;background:#fff;border:1px solid #888;border-radius:3px;
  padding:.35em .55em;font-size:12px;line-height:1.35;box-shadow:0 1px 4px rgba(0,0,0,.2);z-index:10;
  white-space:nowrap}
"""

# Before anything else runs: collect what goes wrong, for people (the page says so) and tests (the DOM).
_HEALTH_JS = r"""
(function () {
  "use strict";
  var errors = [];
  function mark() {
    var body = document.body;
    if (!body) return;
    if (errors.length) { body.dataset.status = "error"; body.dataset.errors = errors.join(" | "); }
  }
  function note(message) { errors.push(String(message)); mark(); }
  var health = """ + PAGE_HEALTH + r""" = {
    errors: errors, note: note,
    checkResources: function () {
      performance.getEntriesByType("resource").forEach(function (r) {
        if (!/^(data|blob|about):/.test(r.name)) note("network request: " + r.name);
      });
    },
    times: [],
    time: function (what) {
      health.times.push(what + "=" + Math.round(performance.now()));
      if (document.body) document.body.dataset.timing = health.times.join(" ");
    },
    done: function () {
      health.time("done");
      health.checkResources();
      if (!errors.length && document.body) document.body.dataset.status = "ok";
    }
  };
  window.addEventListener("error", function (e) {
    var t = e.target;
    if (t && t !== window) note("resource failed: " + (t.src || t.href || t.tagName));
    else note("script error: " + e.message + (e.filename ? " (" + e.filename.slice(-40) + ":" + e.lineno + ")" : ""));
  }, true);
  window.addEventListener("unhandledrejection", function (e) {
    note("script error: " + (e.reason && e.reason.stack ? e.reason.stack.split("\n").slice(0, 2).join(" ") : e.reason));
  });
  document.addEventListener("webglcontextlost", function () { note("WebGL context lost"); }, true);
  document.addEventListener("securitypolicyviolation", function (e) {
    note("network request blocked: " + e.blockedURI + " (" + e.effectiveDirective + ")");
  });
  document.addEventListener("DOMContentLoaded", mark);
})();
"""

_TIMELINE_JS = r"""
(function () {
  "use strict";
  const health = """ + PAGE_HEALTH + r""";
  const DATA = JSON.parse(document.getElementById("pipesim-data").textContent);
  const TEST = location.hash === "#test";
  const TYPES = {int8: Int8Array, int16: Int16Array, int32: Int32Array, float32: Float32Array,
                 float64: Float64Array};
  const GAP = 0.5;          // extra space between devices, in lanes
  const BAR = 0.7;          // a bar's height as a fraction of its lane
  const INSET = 0.025;      // bars are shortened by this fraction at both ends: back-to-back ops stay apart
  const LOD_OPS = 20000;    // above this many ops in a view, ops under 2 px are pooled per pixel column
  const MAX_MEMORY_LINES = 16;  // a trace with more devices than this: its memory as a heatmap, a row per device
  const MAX_TIMELINE_PX = 1100, MIN_LANE_PX = 5, MAX_LANE_PX = 24, MEMORY_PX = 220, GAP_PX = 56;
  // Lanes grow to LABEL_PX, every lane then labelled (11 px text), while the timeline stays under GROWN_PX:
  // 16 devices with send, receive and network lanes (DeepSeek-V3 on 16 stages) read apart, not touching.
  const LABEL_PX = 16, GROWN_TIMELINE_PX = 2400;
  const MEMORY_LEGEND_GAP_PX = 48;  // from the memory panel's bottom to its legend, under the time axis' title
  const PANEL_PX = 170, PANEL_GAP_PX = 36;  // a view of several traces: one memory panel each, on its own axis
  const HEADING_PX = 18;  // such a panel's heading ("memory of 1f1b (its own scale)"), over its top left
  const LEGEND_GAP_PX = 8;  // at least this between the title and the kinds' legend under it
  // The title's fonts (plotly's default family), and the width of the mode bar at the figure's top right.
  const FONT_FAMILY = "'Open Sans', verdana, arial, sans-serif", TITLE_PX = 14, SHAPE_PX = 12, MODEBAR_PX = 260;
  const TITLE_TOP_PX = 10, CAP_SHIFT = 0.7;  // from the figure's top to its title's; plotly's cap height (em)
  const STREAM_NAMES = ["", " send", " recv", " network"], NS = STREAM_NAMES.length;
  const LIMIT_COLOR = "#c0392b";  // the dashed line at a device's memory capacity
  // The summary chart's titles: bold 12 px, their notes 10 px, the height each line takes, and at least this gap to
  // the next panel's title.
  const SUMMARY_TITLE_PX = 12, SUMMARY_NOTE_PX = 10, SUMMARY_LINE_PX = 14, SUMMARY_TITLE_GAP_PX = 8;
  // At least this between a summary panel's tick labels, and the most ticks a wide one has.
  const SUMMARY_TICK_GAP_PX = 12, SUMMARY_MOST_TICKS = 6;
  const BAR_TEXT_PAD_PX = 3;  // plotly's space between a bar's end and its figure
  const gd = document.getElementById("timeline");
  const tip = document.getElementById("tip");
  const CONFIG = {displaylogo: false, scrollZoom: true, responsive: true};

  // ---- decoding: base64 -> inflate -> byte planes -> typed array --------------------------------------
  function fromBase64(text) {
    if (Uint8Array.fromBase64) return Uint8Array.fromBase64(text);
    const bin = atob(text), out = new Uint8Array(bin.length);
    for (let i = 0; i < bin.length; i++) out[i] = bin.charCodeAt(i);
    return out;
  }
  async function column(c) {
    const stream = new Blob([fromBase64(c.z)]).stream().pipeThrough(new DecompressionStream("deflate"));
    const planes = new Uint8Array(await new Response(stream).arrayBuffer());
    const T = TYPES[c.type], size = T.BYTES_PER_ELEMENT, n = c.n;
    if (planes.length !== n * size) throw new Error("corrupt column: " + planes.length + " bytes for " + n);
    if (size === 1) return new T(planes.buffer);
    const bytes = new Uint8Array(n * size);
    for (let b = 0; b < size; b++) {
      const off = b * n;
      for (let i = 0; i < n; i++) bytes[i * size + b] = planes[off + i];
    }
    return new T(bytes.buffer);
  }
  const traces = new Map();
  function trace(i) {
    if (!traces.has(i)) traces.set(i, decodeTrace(DATA.traces[i]));
    return traces.get(i);
  }
  async function decodeTrace(t) {
    const names = Object.keys(t.columns);
    const cols = await Promise.all(names.map(name => column(t.columns[name])));
    const c = {};
    names.forEach((name, i) => { c[name] = cols[i]; });
    const start = Float64Array.from(c.start_us, v => v / 1e3), dur = Float64Array.from(c.dur_us, v => v / 1e3);
    const memory = [];
    if (t.memory) {
      const [times, mib] = await Promise.all([column(t.memory.t_us), column(t.memory.mib)]);
      let at = 0;
      t.memory.counts.forEach(k => {
        const v = mib.subarray(at, at + k);
        memory.push({t: Float64Array.from(times.subarray(at, at + k), v => v / 1e3), v,
                     peak: v.reduce((most, x) => Math.max(most, x), 0)});
        at += k;
      });
    }
    let memoryParts = null;  // the fullest device's memory by part, stacked
    if (t.memory && t.memory.parts) {
      const p = t.memory.parts;
      const [times, ...stack] = await Promise.all([column(p.t_us), ...p.stack.map(column)]);
      memoryParts = {device: p.device, names: p.names, colors: p.colors, t: Float64Array.from(times, v => v / 1e3),
                     stack};
    }
    let end = 0;
    for (let i = 0; i < t.n; i++) end = Math.max(end, start[i] + dur[i]);
    return Object.assign({}, t, {c, start, dur, end, memory, memoryParts,
                                 memoryColors: t.memory ? t.memory.colors : [],
                                 memoryLimits: t.memory ? t.memory.limits_mib : [],
                                 memoryShared: t.memory ? t.memory.limits_shared : []});
  }

  // ---- a view: lanes, bars per kind, hit index --------------------------------------------------------
  function buildView(view, members) {
    const many = members.length > 1;
    const devices = Math.max(...members.map(T => T.num_devices));
    const laneOf = members.map(T => {
      const lane = new Int32Array(T.num_devices * NS).fill(-1);
      for (let d = 0; d < T.num_devices; d++) lane[d * NS] = 0;  // every device gets a compute lane
      for (let i = 0; i < T.n; i++) if (T.dur[i] > 0) lane[T.c.device[i] * NS + T.c.stream[i]] = 0;
      return lane;
    });
    const lanes = [];
    for (let d = 0; d < devices; d++) for (let s = 0; s < NS; s++) members.forEach((T, m) => {
      if (d < T.num_devices && laneOf[m][d * NS + s] === 0) {
        laneOf[m][d * NS + s] = lanes.length;
        const of = many ? " \u00b7 " + T.label : "";
        lanes.push({device: d, stream: s, member: m, y: lanes.length + GAP * d,
                    label: T.device_names[d] + STREAM_NAMES[s] + of, short: STREAM_NAMES[s].trim() + of});
      }
    });
    const rows = lanes.map(() => []);
    const series = [], seriesOf = members.map(T => new Int32Array(T.kinds.length).fill(-1));
    members.forEach((T, m) => {
      for (let i = 0; i < T.n; i++) {
        if (!(T.dur[i] > 0)) continue;
        rows[laneOf[m][T.c.device[i] * NS + T.c.stream[i]]].push(i);
        if (seriesOf[m][T.c.kind[i]] < 0) seriesOf[m][T.c.kind[i]] = 0;
      }
      seriesOf[m].forEach((used, k) => {
        if (used === 0) { seriesOf[m][k] = series.length; series.push({member: m, kind: k}); }
      });
    });
    const index = rows.map((r, lane) => {
      const T = members[lanes[lane].member];
      return Int32Array.from(r).sort((a, b) => T.start[a] - T.start[b]);
    });
    const longest = index.map((r, lane) => {
      const T = members[lanes[lane].member];
      let most = 0;
      for (const i of r) most = Math.max(most, T.dur[i]);
      return most;
    });
    const drawable = rows.reduce((total, r) => total + r.length, 0);
    // Memory: one panel per trace that has any, each on its own axis (a measured run of 20 MiB next to a
    // prediction of 2 GiB would be a flat line on a shared one).
    const panels = [];
    members.forEach((T, m) => {
      const rows = [];
      for (let d = 0; d < T.num_devices; d++) {
        if (T.memory[d] && T.memory[d].t.length) rows.push({member: m, device: d, label: T.device_names[d]});
      }
      if (rows.length) panels.push({member: m, rows, heatmap: rows.length > MAX_MEMORY_LINES});
    });
    const end = Math.max(...members.map(T => T.end));
    return {view, members, lanes, index, longest, series, seriesOf, drawable, panels, end};
  }

  // ---- bars: one NaN-separated line per (trace, kind); level of detail for large traces ------------------
  // With more than LOD_OPS ops, ops narrower than 2 px in [x0, x1] are pooled per pixel column: a column
  // shows the kind that covers most of it, and neighbouring columns of one kind merge into one bar, so the
  // picture costs at most a few segments per pixel whatever the op count. Wider ops are drawn exactly.
  function segments(b, x0, x1, columns) {
    const xs = b.series.map(() => []), ys = b.series.map(() => []);
    const lod = b.drawable > LOD_OPS, w = (x1 - x0) / columns;
    b.lanes.forEach((lane, li) => {
      const T = b.members[lane.member], rows = b.index[li], of = b.seriesOf[lane.member], y = lane.y;
      const cover = new Float64Array(T.kinds.length);
      let bucket = -1, runKind = -1, runFirst = 0, runLast = 0;
      const push = (k, from, to) => { xs[of[k]].push(from, to, NaN); ys[of[k]].push(y, y, NaN); };
      const closeRun = () => {
        if (runKind >= 0) push(runKind, x0 + runFirst * w, x0 + (runLast + 1) * w);
        runKind = -1;
      };
      const closeBucket = () => {
        if (bucket < 0) return;
        let k = 0;
        for (let j = 1; j < cover.length; j++) if (cover[j] > cover[k]) k = j;
        cover.fill(0);
        if (k === runKind && bucket === runLast + 1) runLast = bucket;
        else { closeRun(); runKind = k; runFirst = runLast = bucket; }
        bucket = -1;
      };
      let lo = 0, hi = rows.length;
      const from = x0 - b.longest[li];
      while (lo < hi) { const mid = (lo + hi) >> 1; if (T.start[rows[mid]] < from) lo = mid + 1; else hi = mid; }
      for (let j = lo; j < rows.length; j++) {
        const i = rows[j], start = T.start[i], dur = T.dur[i], k = T.c.kind[i];
        if (start > x1) break;
        if (start + dur < x0) continue;
        if (!lod || dur >= 2 * w) {
          closeBucket(); closeRun();
          push(k, start + INSET * dur, start + dur - INSET * dur);
          continue;
        }
        const at = Math.max(0, Math.floor((start + dur / 2 - x0) / w));
        if (at !== bucket) { closeBucket(); bucket = at; }
        cover[k] += dur;
      }
      closeBucket(); closeRun();
    });
    return {x: xs.map(a => Float64Array.from(a)), y: ys.map(a => Float64Array.from(a))};
  }

  // ---- memory: level of detail --------------------------------------------------------------------------
  function bisect(a, x) {  // the first index whose value is above x
    let lo = 0, hi = a.length;
    while (lo < hi) { const mid = (lo + hi) >> 1; if (a[mid] <= x) lo = mid + 1; else hi = mid; }
    return lo;
  }
  // A step function reduced to at most ~4 points per pixel column of [x0, x1]: each column keeps its first,
  // lowest, highest and last sample, so peaks survive; points outside the range are dropped.
  function decimate(t, v, x0, x1, columns) {
    const i0 = Math.max(bisect(t, x0) - 1, 0), i1 = Math.min(bisect(t, x1) + 1, t.length);
    if (i1 - i0 <= 4 * columns) return {x: t.subarray(i0, i1), y: v.subarray(i0, i1)};
    const keep = [];
    const width = (x1 - x0) / columns;
    let i = i0;
    while (i < i1) {
      const col = Math.floor((t[i] - x0) / width);
      let j = i, lo = i, hi = i;
      while (j < i1 && Math.floor((t[j] - x0) / width) === col) {
        if (v[j] < v[lo]) lo = j;
        if (v[j] > v[hi]) hi = j;
        j++;
      }
      const picks = [i, lo, hi, j - 1].sort((a, b) => a - b);
      picks.forEach((p, n) => { if (n === 0 || p !== picks[n - 1]) keep.push(p); });
      i = j;
    }
    return {x: Float64Array.from(keep, p => t[p]), y: Float64Array.from(keep, p => v[p])};
  }

  // A panel's memory as a grid: per row (device) and pixel column of [x0, x1], the most memory held in the column.
  function memoryGrid(b, panel, x0, x1, columns) {
    const w = (x1 - x0) / columns;
    const x = Array.from({length: columns}, (_, c) => x0 + (c + 0.5) * w);
    const z = panel.rows.map(({member, device}) => {
      const {t, v} = b.members[member].memory[device];
      const row = new Array(columns).fill(null);
      for (let i = Math.max(bisect(t, x0) - 1, 0); i < t.length - 1 && t[i] < x1; i++) {
        if (t[i + 1] <= x0) continue;
        const c0 = Math.max(0, Math.floor((t[i] - x0) / w));
        const c1 = Math.min(columns - 1, Math.floor((Math.min(t[i + 1], x1) - x0) / w));
        for (let c = c0; c <= c1; c++) if (row[c] === null || v[i] > row[c]) row[c] = v[i];
      }
      return row;
    });
    const times = x.map(msText);  // each column's time, as every row hovers it
    return {x, y: panel.rows.map(r => r.label), z, customdata: z.map(() => times),
            text: z.map(row => row.map(mib => (mib === null ? "" : mibText(mib)))),
            zmax: panel.rows.reduce((most, {member, device}) =>
              b.members[member].memory[device].v.reduce((m, v) => Math.max(m, v), most), 1)};
  }
  // A memory curve's hovered figures per point, [MiB, ms], written by mibText and msText as the title and the tables
  // write them: plotly's ",.3f" for the time rounded a tie as toFixed does, the binary value (0.0625 ms "0.062",
  // where msText and the tables write "0.063"). Rebuilt with the points after a zoom: kept, they named the MiB and
  // time of the points the curve had before it.
  function curveHover(t, mib) { return Array.from(mib, (v, k) => [mibText(v), msText(t[k])]); }

  // ---- the figure ---------------------------------------------------------------------------------------
  const measure = document.createElement("canvas").getContext("2d");
  function textPx(text, px, weight = "") {
    measure.font = weight + " " + px + "px " + FONT_FAMILY;
    return measure.measureText(text).width;
  }
  // `text`'s lines no wider than `room` px, broken between words (a word wider than `room` has a line of its own).
  function wrapWords(text, px, room, weight = "") {
    const lines = [];
    text.split(" ").forEach(word => {
      const last = lines.length - 1;
      if (last >= 0 && textPx(lines[last] + " " + word, px, weight) <= room) lines[last] += " " + word;
      else lines.push(word);
    });
    return lines;
  }
  function fmt(v, digits) {
    return Number(v).toLocaleString("en-US", {minimumFractionDigits: digits, maximumFractionDigits: digits,
                                              signDisplay: "negative"});  // -0.0001 as "0.0", as _decimal_text
  }
  // The units as traces/metrics.py's ms_text, mib_text and percent_text write them, and plotly's formats for them.
  const {mib_shown: MIB_SHOWN, ms_decimals: MS_DECIMALS, tick_format: TICK_FORMAT} = DATA.numbers;
  function msText(ms) { return fmt(ms, MS_DECIMALS); }
  function mibText(mib) {
    if (mib > 0 && mib < MIB_SHOWN) return "<" + MIB_SHOWN;
    if (!(mib > 0 && mib < 100)) return fmt(mib, 0);
    const magnitude = Math.floor(Math.log10(mib)), decimals = Math.min(2, 2 - magnitude);
    const upped = Number(fmt(mib, decimals).replace(/,/g, "")) >= 10 ** (magnitude + 1);  // into the next decade
    return fmt(mib, upped ? Math.min(2, 1 - magnitude) : decimals);
  }
  function percentText(fraction) {
    const percent = 100 * fraction;
    const short = d => Math.abs(Number(fmt(percent, d))) < 100;  // short of 100 % at d decimals
    const decimals = Math.abs(percent) < 100 ? [1, 2, 3, 4].find(short) ?? 0 : 0;
    return fmt(percent, decimals) + "%";
  }
  if (TEST) window.pipesimNumbers = {msText, mibText, percentText};  // tests/test_browser.py holds them to Python's
  // Each trace's lines of the title: its name, its figures, then in grey its shape, wrapped between them where a
  // line would run under the mode bar, `width` px less MODEBAR_PX (a long shape at 1000 px ran under it and off the
  // page; at 800 px the figures alone did, and a view of three traces' long names with its first figure).
  function viewTitle(built, width) {
    const room = width - MODEBAR_PX;
    return built.members.map(T => {
      const s = T.summary, m = T.meta;
      const figures = ["makespan " + msText(s.makespan_ms) + " ms", "bubble " + percentText(s.bubble_fraction),
                       msText(s.time_per_minibatch_ms) + " ms/step", "peak " + mib(s.peak_memory_text)];
      const lines = [{html: "<b>" + esc(T.label) + "</b>", px: textPx(T.label, TITLE_PX, "bold")}];
      const add = (html, px, joined, joinedPx, ending = "") => {
        const line = lines[lines.length - 1];
        if (line.px + joinedPx <= room) Object.assign(line, {html: line.html + joined, px: line.px + joinedPx});
        else { line.html += ending; lines.push({html, px}); }
      };
      figures.forEach((text, k) => {
        const joiner = k ? ", " : ": ";
        add(esc(text), textPx(text, TITLE_PX), esc(joiner + text), textPx(joiner + text, TITLE_PX), joiner.trim());
      });
      const shape = "(" + m.shape + ", " + T.n.toLocaleString("en-US") + " ops" +
                    (m.source_unnamed ? ", " + m.source : "") + ")";
      const grey = "<span style='font-size:" + SHAPE_PX + "px;color:#666'>" + esc(shape) + "</span>";
      add(grey, textPx(shape, SHAPE_PX), " " + grey, textPx(" ", TITLE_PX) + textPx(shape, SHAPE_PX));
      return lines.map(line => line.html).join("<br>");
    }).join("<br>");
  }
  function mib(text) { return text === null ? "n/a (not recorded)" : text + " MiB"; }  // unknown is not 0
  function esc(s) { return String(s).replace(/[&<>"']/g, ch => "&#" + ch.charCodeAt(0) + ";"); }

  // A dashed line across the panel at the most each device may hold, labelled over the panel's right end, where
  // no curve runs (under the line, the label lay on the curve of a run that peaks at it; above, a curve over it
  // crosses it, and plotly's clip cuts it off where the line tops the axis): the axis reaches it, so a curve above
  // it is what does not fit.
  // Ranks sharing one GPU's memory may hold what the others' peaks leave (their peaks add up, as the table's
  // fits / OOM column checks). Heights within a label's height (LIMIT_BAND of the highest) are labelled once,
  // naming their devices unless all share it, and their range where it is one. A device whose peak stays under
  // LIMIT_DRAWN_SHARE of its line gets no line: it would stretch the axis over it and flatten the run (53 MiB
  // under an 81,920 MiB H100 is a line at 0); the panel's note above it names that memory and the peak's share.
  // Unless another device's line takes the axis that high anyway: then its line is drawn too, not noted as off
  // the scale (Mixtral's 1F1B on four H100s: device 0 near its 81,920 MiB, devices 1-3 under half of theirs).
  const LIMIT_BAND = 0.05, LIMIT_DRAWN_SHARE = 0.5;
  function capacityLines(T, rows, axis) {
    const known = rows.map(({device}) => ({limit: T.memoryLimits[device], shared: Boolean(T.memoryShared[device]),
                                           name: T.device_names[device], peak: T.memory[device].peak}))
      .filter(({limit}) => limit !== null && limit !== undefined).sort((a, b) => a.limit - b.limit);
    const close = ({peak, limit}) => peak >= LIMIT_DRAWN_SHARE * limit;
    const reached = Math.max(0, ...known.filter(close).map(({limit}) => limit));  // the highest line drawn
    const near = entry => close(entry) || entry.limit <= reached;
    const label = (entries, low, high, shared) => {
      const names = entries.map(({name}) => name);
      const who = names.length === rows.length ? (rows.length > 1 ? "each device's" : esc(names[0]) + "'s")
        : esc(names.slice(0, 3).join(", ") + (names.length > 3 ? " and " + (names.length - 3) + " more" : "")) + ":";
      const what = shared ? " room beside its GPU's other ranks' peaks " : " memory ";
      const span = mibText(low) === mibText(high) ? mibText(low) : mibText(low) + "\u2013" + mibText(high);
      return who + what + span + " MiB";
    };
    const lines = bands(known.filter(near)).flatMap(({low, high, shared, entries}) => {
      const heights = [...new Set(entries.map(({limit}) => limit))];
      return heights.map((mib, k) => ({axis, mib, label: k ? "" : label(entries, low, high, shared)}));
    });
    const shapes = lines.map(({mib}) => ({type: "line", xref: "x domain", x0: 0, x1: 1, yref: axis, y0: mib, y1: mib,
                                          layer: "above", line: {color: LIMIT_COLOR, width: 1.5, dash: "dash"}}));
    const labels = lines.map(line => line.label).filter(Boolean);
    const far = bands(known.filter(entry => !near(entry))).map(({low, high, shared, entries}) =>
      label(entries, low, high, shared) + peakShare(Math.max(...entries.map(({peak, limit}) => peak / limit))));
    const note = far.length ? capacityNote(far, axis) : null;
    if (note && labels.length) note.yshift += CAPACITY_LINE_PX;  // over the lines' label
    return {shapes, lines, note,
            label: labels.length ? Object.assign(capacityNote([], axis), {text: "- - - " + labels.join("; ")}) : null};
  }
  function peakShare(share) { return " (peak " + (share < 0.001 ? "under 0.1%" : percentText(share)) + " of it)"; }
  // Over a panel's right end: the memory its axis leaves out, each with its peak's share of it.
  const CAPACITY_LINE_PX = 14;  // a 10 px note's line
  function capacityNote(texts, axis) {
    return {text: texts.join("; ") + ", off this panel's scale", xref: "x domain", x: 1, xanchor: "right",
            yref: axis + " domain", y: 1, yanchor: "bottom", yshift: 4, showarrow: false,
            font: {size: 10, color: LIMIT_COLOR}};
  }
  // A panel's capacity label or note, over its heading where it has one (a view of several traces).
  function overHeading(annotation, many) {
    return many ? Object.assign(annotation, {yshift: annotation.yshift + HEADING_PX}) : annotation;
  }
  // Limits within LIMIT_BAND of the highest of them, and of one kind (a GPU's own memory, or a shared one's room).
  function bands(known) {
    const near = LIMIT_BAND * Math.max(0, ...known.map(({limit}) => limit)), out = [];
    known.forEach(entry => {
      const band = out[out.length - 1];
      if (band && band.shared === entry.shared && entry.limit - band.low <= near) band.entries.push(entry);
      else out.push({low: entry.limit, shared: entry.shared, entries: [entry]});
    });
    return out.map(band => Object.assign(band, {high: band.entries[band.entries.length - 1].limit}));
  }

  // A heatmap's colours: Viridis up to the devices' memory where they all share one, and LIMIT_COLOR above it, the
  // colour bar marking it, so a cell over capacity stands out among 17 or more devices' rows (no lines to draw).
  // Where the peak stays under LIMIT_DRAWN_SHARE of that memory, Viridis runs to the peak (up to the memory, a
  // small run is one dark colour) and a note names the memory, as the lines' panel does.
  const VIRIDIS = ["#440154", "#482878", "#3e4989", "#31688e", "#26828e", "#1f9e89", "#35b779", "#6ece58",
                   "#b5de2b", "#fde725"];
  function heatmapScale(T, rows, most) {
    const limits = new Set(rows.map(({device}) => T.memoryLimits[device]));
    const own = !rows.some(({device}) => T.memoryShared[device]);  // ranks sharing a GPU: room, not its memory
    const capacity = limits.size === 1 && own ? [...limits][0] : null;
    if (capacity === null || capacity === undefined) {
      return {colorscale: "Viridis", zmax: most, capacity: null, ticks: {}, far: null};
    }
    if (most < LIMIT_DRAWN_SHARE * capacity) {
      return {colorscale: "Viridis", zmax: most, capacity: null, ticks: {},
              far: "each device's memory " + mibText(capacity) + " MiB" + peakShare(most / capacity)};
    }
    const zmax = Math.max(most, capacity), top = capacity / zmax;
    const colorscale = VIRIDIS.map((colour, k) => [top * k / (VIRIDIS.length - 1), colour]);
    if (top < 1) colorscale.push([top, LIMIT_COLOR], [1, LIMIT_COLOR]);
    const tickvals = [0, 1, 2, 3, 4].map(k => capacity * k / 4);
    const ticktext = tickvals.map((v, k) => (k === 4 ? "memory " : "") + fmt(v, 0));
    return {colorscale, zmax, capacity, ticks: {tickvals, ticktext}, far: null};
  }

  function figure(built, columns) {
    const {lanes, members} = built;
    const hasMemory = built.panels.length > 0;
    const span = (lanes.length ? lanes[lanes.length - 1].y : 0) + 1.6;
    const lanePx = Math.min(MAX_LANE_PX, Math.max(MAX_TIMELINE_PX / span,
                                                  Math.min(LABEL_PX, Math.max(MIN_LANE_PX, GROWN_TIMELINE_PX / span))));
    const timelinePx = Math.max(lanePx * span, 110);
    const margin = {t: 0, b: 50, l: 0, r: 20};
    // Tick labels no closer than LABEL_PX: label every k-th device where lanes are thin.
    const devices = lanes.length ? lanes[lanes.length - 1].device + 1 : 1;
    const devicePx = lanePx * (lanes.length / devices + GAP);  // from one device's first lane to the next's
    const every = Math.ceil(LABEL_PX / devicePx);
    const all = lanePx >= LABEL_PX - 0.01;
    const shown = lanes.filter(l => all || (l.stream === 0 && l.member === 0 && l.device % every === 0));
    // A device's first lane names it; its send, receive and network lanes under it say only which they are.
    const named = l => l.stream === 0 || !l.short;
    const tickText = l => (named(l) ? l.label : "<span style='color:#777;font-size:10px'>" + l.short + "</span>");
    margin.l = 24 + 6.5 * Math.max(8, ...shown.map(l => (named(l) ? l.label : l.short).length));
    const memoryLegend = built.panels.some(panel => !panel.heatmap);
    if (hasMemory && built.panels.some(panel => panel.heatmap)) margin.r = 80;  // the heatmaps' colour bars
    const title = viewTitle(built, columns);
    margin.t = 46 + 20 * title.split("<br>").length;
    const panelPx = built.panels.length > 1 ? PANEL_PX : MEMORY_PX;
    // Several panels, one with a device's memory known: its capacity label and note (two lines at most) go over
    // its heading, not beside it, where at 800 px they ran over each other; the panels stand apart by as much.
    const stacked = built.panels.length > 1 && built.panels.some(({member, rows}) =>
      rows.some(({device}) => members[member].memoryLimits[device] !== null));
    const panelGapPx = PANEL_GAP_PX + (stacked ? 2 * CAPACITY_LINE_PX : 0);
    const memoryPx = built.panels.length * (panelPx + panelGapPx) - panelGapPx;
    const plotPx = timelinePx + (hasMemory ? GAP_PX + memoryPx : 0);
    const height = plotPx + margin.t + margin.b;
    const split = hasMemory ? (memoryPx + GAP_PX) / plotPx : 0;
    const barPx = BAR * timelinePx / span;
    const xEnd = built.end * 1.01 || 1;
    const plotColumns = Math.max(100, Math.round(columns - margin.l - margin.r));
    const bars = segments(built, 0, xEnd, plotColumns);
    const data = built.series.map((b, j) => {
      const T = members[b.member];
      return {type: "scattergl", mode: "lines", x: bars.x[j], y: bars.y[j], xaxis: "x", yaxis: "y",
              name: T.kinds[b.kind], legendgroup: T.kinds[b.kind], showlegend: false, hoverinfo: "skip",
              connectgaps: false, line: {color: T.colors[b.kind], width: barPx}};
    });
    // One legend entry per kind, whoever has it first.
    const seen = new Set();
    data.forEach(d => { if (!seen.has(d.name)) { seen.add(d.name); d.showlegend = true; } });
    built.barTraces = data.length;
    built.memoryTraces = [];
    built.heatmaps = [];
    // Device colours from the trace with the most devices, so "device d" looks the same in every panel.
    const palette = members.reduce((most, T) => (T.memoryColors.length > most.length ? T.memoryColors : most), []);
    const inLegend = new Set();
    // A device's legend entry toggles its line in every panel, so each panel draws it by default alike: where a
    // panel draws it alone (no stack there, or its stacked device), as a measured trace's panel draws them all.
    const drawnDevices = new Set(built.panels.filter(panel => !panel.heatmap).flatMap(panel => {
      const parts = members[panel.member].memoryParts;
      return panel.rows.filter(({device}) => !parts || device === parts.device).map(({device}) => device);
    }));
    const axes = {}, headings = [], shapes = [], notes = [], labels = [];
    built.capacity = [];
    built.panels.forEach((panel, j) => {
      const T = members[panel.member], axis = "y" + (j + 2);
      const bottom = (built.panels.length - 1 - j) * (panelPx + panelGapPx);
      const domain = [bottom / plotPx, (bottom + panelPx) / plotPx];
      // A view of several traces names each panel's (compare's one panel, a measurement recording no memory, read
      // as the measurement's); "its own scale" where there are several.
      const many = members.length > 1;
      if (panel.heatmap) {
        // Too many curves to tell apart (and to draw): one row per device, coloured by the most memory it
        // holds in each pixel column, on this trace's own colour scale.
        const grid = memoryGrid(built, panel, 0, xEnd, plotColumns);
        const scale = heatmapScale(T, panel.rows, grid.zmax);
        built.heatmaps.push({panel, index: data.length, capacity: scale.capacity});
        if (scale.far) notes.push(overHeading(capacityNote([scale.far], axis), many));
        data.push({type: "heatmap", x: grid.x, y: grid.y, z: grid.z, xaxis: "x", yaxis: axis,
                   colorscale: scale.colorscale, zmin: 0, zmax: scale.zmax, name: "memory \u00b7 " + T.label,
                   showscale: true, hoverongaps: false,
                   text: grid.text, customdata: grid.customdata,
                   // the bar says what it colours (a panel of several names it)
                   colorbar: {title: {text: many ? "MiB" : "memory<br>(MiB)"}, len: panelPx / plotPx, y: domain[0],
                              yanchor: "bottom", thickness: 12, tickformat: TICK_FORMAT, ...scale.ticks},
                   hovertemplate: "%{y}" + (many ? " \u00b7 " + esc(T.label) : "") +
                                  ": up to %{text} MiB around %{customdata} ms<extra></extra>"});
        // each row's label names it ("device 3"), the axis untitled as the timeline's: titled "device", it said so
        // twice
        axes["yaxis" + (j + 2)] = {domain, anchor: "x", type: "category",
                                   autorange: "reversed", showgrid: false, ticks: "", tickfont: {size: 10}};
      } else {
        const parts = T.memoryParts;
        if (parts) {  // its fullest device stacked by part, under that device's line
          const who = T.device_names[parts.device] + (many ? " \u00b7 " + esc(T.label) : "");
          parts.stack.forEach((top, i) => {
            const own = Array.from(top, (v, k) => (i ? v - parts.stack[i - 1][k] : v));
            data.push({type: "scatter", mode: "lines", x: parts.t, y: top, customdata: curveHover(parts.t, own),
                       xaxis: "x", yaxis: axis,
                       name: parts.names[i], legend: "legend2", legendgroup: "part " + parts.names[i],
                       showlegend: !inLegend.has("part " + i), fill: i ? "tonexty" : "tozeroy",
                       fillcolor: parts.colors[i] + "99", line: {color: parts.colors[i], width: 0.5, shape: "hv"},
                       hovertemplate: parts.names[i] + " of " + who +
                                      ": %{customdata[0]} MiB at %{customdata[1]} ms<extra></extra>"});
            inLegend.add("part " + i);
          });
        }
        // Over the stack, 8-16 devices' lines read as clutter: only the stacked device's (the parts' sum) is drawn,
        // the others are listed in the legend and drawn when clicked there (unless another panel draws them).
        panel.rows.forEach(({member, device, label}) => {
          const mem = T.memory[device];
          const pts = decimate(mem.t, mem.v, 0, xEnd, plotColumns);
          built.memoryTraces.push({member, device, index: data.length, panel: j});
          data.push({type: "scatter", mode: "lines", x: pts.x, y: pts.y, customdata: curveHover(pts.x, pts.y),
                     xaxis: "x", yaxis: axis, name: label,
                     legend: "legend2", legendgroup: "memory " + device, showlegend: !inLegend.has(device),
                     visible: drawnDevices.has(device) ? true : "legendonly",
                     line: {color: palette[device], width: 1.5, shape: "hv"},
                     hovertemplate: label + (many ? " \u00b7 " + esc(T.label) : "") +
                                    ": %{customdata[0]} MiB at %{customdata[1]} ms<extra></extra>"});
          inLegend.add(device);
        });
        axes["yaxis" + (j + 2)] = {domain, anchor: "x", title: {text: many ? "MiB" : "memory (MiB)"},
                                   gridcolor: "#ececec", zeroline: false, rangemode: "tozero", tickformat: TICK_FORMAT};
        const capacity = capacityLines(T, panel.rows, axis);
        shapes.push(...capacity.shapes);
        built.capacity.push(...capacity.lines);
        if (capacity.label) labels.push(overHeading(capacity.label, many));
        if (capacity.note) notes.push(overHeading(capacity.note, many));
      }
      if (many) {
        const own = built.panels.length > 1 ? " (its own scale)" : "";
        headings.push({text: "<b>memory of " + esc(T.label) + "</b>" + own, x: 0, xref: "paper",
                       xanchor: "left", y: domain[1], yref: "paper", yanchor: "bottom", showarrow: false,
                       font: {size: 12}});
      }
    });
    const layout = {
      height, margin, hovermode: "closest", dragmode: "zoom", uirevision: built.view.name,
      paper_bgcolor: "#fff", plot_bgcolor: "#fff", font: {size: 12},
      // From the figure's left, under the view buttons, not the plot's: right of lanes named "device 0 ·
      // interleaved-1f1b, predicted" at 800 px it had 200 px before the mode bar. Its top TITLE_TOP_PX under the
      // figure's: plotly lifts a title of several lines by its cap shift, which cut the first line at the top.
      title: {text: title, x: 0, xref: "container", xanchor: "left", y: 1, yref: "container", yanchor: "top",
              pad: {t: TITLE_TOP_PX + (title.includes("<br>") ? CAP_SHIFT * TITLE_PX : 0)}, font: {size: TITLE_PX}},
      legend: {orientation: "h", x: 1, xanchor: "right", y: 1, yanchor: "bottom", tracegroupgap: 4},
      xaxis: {anchor: hasMemory ? "y" + (built.panels.length + 1) : "y", title: {text: "time (ms)"}, range: [0, xEnd],
              gridcolor: "#ececec", zeroline: false, showline: true, linecolor: "#999", tickformat: TICK_FORMAT},
      yaxis: {domain: [split, 1], anchor: "x", range: [span - 0.8, -0.8], tickvals: shown.map(l => l.y),
              ticktext: shown.map(tickText), showgrid: false, zeroline: false, ticks: "", tickfont: {size: 11},
              ticklabelstandoff: 4},
    };
    Object.assign(layout, axes);
    layout.annotations = [...headings, ...notes, ...labels];
    built.capacityLabels = labels.length;
    built.capacityNotes = notes.map(({yref, text}) => ({axis: yref.split(" ")[0], text}));
    layout.shapes = shapes;
    if (memoryLegend) {
      // One trace's parts are its fullest device's, which the title names; several traces' hovers name theirs.
      const stacked = members.filter(T => T.memoryParts);
      const of = stacked.length === 1 ? T => esc(T.device_names[T.memoryParts.device]) + "'s" : () => "fullest";
      // Across the page under the time axis, in rows: beside the panel, 7 parts and 16 devices ran past the
      // figure's foot and scrolled, hiding the devices, and squeezed the plots (`fitPlotHeight` gives it room).
      layout.legend2 = {orientation: "h", x: 0, xanchor: "left", y: -MEMORY_LEGEND_GAP_PX / plotPx, yanchor: "top",
                        title: {side: "top",
                                text: "memory" + (stacked.length ? " <span style='font-size:10px'>(filled: " +
                                      of(stacked[0]) + " parts; click a device for its line)</span>" : "")}};
    }
    built.span = span;
    built.barPx = barPx;
    built.plotPx = plotPx;
    return {data, layout};
  }

  // Bars as tall as BAR of the lane's height on screen, whatever the figure's height or y zoom.
  function barWidth() {
    const ya = gd._fullLayout && gd._fullLayout.yaxis;
    if (!ya || !ya._length) return null;
    return Math.max(1, BAR * ya._length / Math.abs(ya.range[0] - ya.range[1]));
  }
  async function fitBars(built) {
    const width = barWidth();
    if (width === null || Math.abs(width - built.barPx) < 0.25) return;
    built.barPx = width;
    await Plotly.restyle(gd, {"line.width": width}, [...Array(built.barTraces).keys()]);
  }
  // After a zoom or resize: bars (level of detail) and memory (decimation) for the range now shown, and as
  // much again on either side, so that panning finds them drawn.
  async function refine(built) {
    const xa = gd._fullLayout && gd._fullLayout.xaxis;
    if (!xa || !xa._length || built !== shownView) return;
    const span = xa.range[1] - xa.range[0], x0 = xa.range[0] - span, x1 = xa.range[1] + span;
    const columns = 3 * Math.max(100, Math.round(xa._length)), xs = [], ys = [], hovers = [], traces = [];
    if (built.drawable > LOD_OPS) {
      const bars = segments(built, x0, x1, columns);
      built.series.forEach((_, j) => { xs.push(bars.x[j]); ys.push(bars.y[j]); hovers.push(null); traces.push(j); });
    }
    built.memoryTraces.forEach(({member, device, index}) => {
      const mem = built.members[member].memory[device];
      const pts = decimate(mem.t, mem.v, x0, x1, columns);
      xs.push(pts.x); ys.push(pts.y); hovers.push(curveHover(pts.x, pts.y)); traces.push(index);
    });
    if (traces.length) await Plotly.restyle(gd, {x: xs, y: ys, customdata: hovers}, traces);
    for (const {panel, index} of built.heatmaps) {
      const grid = memoryGrid(built, panel, x0, x1, columns);
      await Plotly.restyle(gd, {x: [grid.x], z: [grid.z], text: [grid.text], customdata: [grid.customdata]}, [index]);
    }
  }

  // ---- hover: the op under the pointer, described from its columns ----------------------------------
  function opAt(built, clientX, clientY) {
    const fl = gd._fullLayout;
    if (!fl || !fl.xaxis || !built.lanes.length) return null;
    const xa = fl.xaxis, ya = fl.yaxis, box = gd.getBoundingClientRect();
    const px = clientX - box.left - xa._offset, py = clientY - box.top - ya._offset;
    if (px < 0 || px > xa._length || py < 0 || py > ya._length) return null;
    const x = xa.range[0] + (xa.range[1] - xa.range[0]) * px / xa._length;
    const y = ya.range[1] + (ya.range[0] - ya.range[1]) * py / ya._length;
    let lane = -1, best = Infinity;
    built.lanes.forEach((l, i) => { const d = Math.abs(l.y - y); if (d < best) { best = d; lane = i; } });
    if (best > BAR / 2 + 0.05) return null;
    const T = built.members[built.lanes[lane].member], rows = built.index[lane];
    let lo = 0, hi = rows.length;
    while (lo < hi) { const mid = (lo + hi) >> 1; if (T.start[rows[mid]] <= x) lo = mid + 1; else hi = mid; }
    const hidden = new Set(gd.data.filter(d => d.visible === "legendonly").map(d => d.legendgroup));
    for (let j = lo - 1; j >= 0 && j >= lo - 64; j--) {
      const i = rows[j];
      if (T.start[i] + T.dur[i] >= x && !hidden.has(T.kinds[T.c.kind[i]])) return {T, i};
    }
    return null;
  }
  function describe(T, i, many) {
    const c = T.c, kind = T.kinds[c.kind[i]], mb = c.microbatch[i], mini = c.minibatch[i];
    const label = kind + (mb >= 0 ? mb : "") + (mini ? "." + mini : "");
    const lines = ["<b>" + esc(label) + "</b> (" + esc(kind) + ")" + (many ? " \u00b7 " + esc(T.label) : ""),
      esc(T.device_names[c.device[i]]) + ", stage " + c.stage[i] +
        (c.peer[i] < 0 ? "" : /^(SEND|RECV)/.test(kind) ? ", peer device " + c.peer[i]  // in its own replica
         : ", overlapped with stage " + c.peer[i] + "'s op beside it"),  // one part of an overlapped pair (F&B)
      (mb >= 0 ? "micro-batch " + mb + ", " : "") + "mini-batch " + mini +
        (T.meta.pipelines > 1 || c.pipeline[i] > 0 ? ", pipeline " + c.pipeline[i] : ""),
      "start " + msText(T.start[i]) + " ms, duration " + msText(T.dur[i]) + " ms"];
    if (c.version[i] >= 0) lines.push("weight version " + c.version[i]);
    if (c.prediction[i] >= 0) lines.push("prediction distance " + c.prediction[i]);
    return lines.join("<br>");
  }
  let shownView = null;
  gd.addEventListener("mousemove", e => {
    const hit = shownView && opAt(shownView, e.clientX, e.clientY);
    if (!hit) { tip.style.display = "none"; return; }
    tip.innerHTML = describe(hit.T, hit.i, shownView.members.length > 1);
    tip.style.display = "block";
    const w = tip.offsetWidth, h = tip.offsetHeight;
    tip.style.left = Math.min(e.clientX + 14, window.innerWidth - w - 4) + "px";
    tip.style.top = (e.clientY + 16 + h > window.innerHeight ? e.clientY - h - 10 : e.clientY + 16) + "px";
  });
  gd.addEventListener("mouseleave", () => { tip.style.display = "none"; });

  // ---- the summary chart and the selector ----------------------------------------------------------------
  const summaryDiv = document.getElementById("summary"), nav = document.getElementById("views");
  // One bar per trace (a view of several draws theirs side by side and has no summary of its own); the bars of
  // the traces the selected view shows are highlighted, and a click selects the view of that trace alone.
  function summaryColors(selected) {
    const shown = DATA.views[selected].traces, [on, off] = DATA.summary.colors;
    return DATA.traces.map((_, k) => (shown.includes(k) ? on : off));
  }
  function viewOf(k) {
    const alone = DATA.views.findIndex(v => v.traces.length === 1 && v.traces[0] === k);
    return alone >= 0 ? alone : DATA.views.findIndex(v => v.traces.includes(k));
  }
  // Each panel's title over its left end, its note on a line of its own, both wrapped to the panel's width, the
  // top margin grown by the lines past the first (at 800 px with the built-in example's names, "samples/s (more is
  // better)" ran into the next panel's title and the last panel's ran off the page). The page's one place that
  // writes them.
  function fitSummaryTitles(layout) {
    const {titles} = DATA.summary, margin = layout.margin;
    const room = (summaryDiv.clientWidth - margin.l - margin.r) / titles.length - SUMMARY_TITLE_GAP_PX;
    const lines = titles.map(({title, note}) => [wrapWords(title, SUMMARY_TITLE_PX, room, "bold"),
                                                  note ? wrapWords(note, SUMMARY_NOTE_PX, room) : []]);
    const grown = SUMMARY_LINE_PX * (Math.max(...lines.map(([title, note]) => title.length + note.length)) - 1);
    const annotations = lines.map(([title, note], j) => ({
      text: "<b>" + title.map(esc).join("<br>") + "</b>" + note.map(line =>
        "<br><span style='font-size:" + SUMMARY_NOTE_PX + "px'>" + esc(line) + "</span>").join(""),
      align: "left", x: j / titles.length, xref: "paper", xanchor: "left", y: 1, yref: "paper", yanchor: "bottom",
      showarrow: false}));
    return Object.assign({}, layout, {annotations, height: layout.height + grown,
                                      margin: Object.assign({}, margin, {t: margin.t + grown})});
  }
  // Each panel's axis ticked every 1, 2 or 5 × 10^k, the densest step whose labels stand level and SUMMARY_TICK_GAP_PX
  // apart over its bars' most and a tenth (the axis runs past it), each label as wide as the widest it writes: at
  // 800 px, the bubble's 0 % to 40 % every 10 % stood on end, plotly's way out of labels that touch, and a room of
  // 35 px a tick set the time's "1,000", "2,000" and "3,000" 4 px apart.
  function fitSummaryTicks(layout) {
    const margin = layout.margin, width = summaryDiv.clientWidth - margin.l - margin.r, axes = {};
    DATA.summary.data.forEach((bars, j) => {
      const name = "xaxis" + (j ? j + 1 : ""), axis = layout[name];
      const most = 1.1 * Math.max(0, ...bars.x.filter(value => value !== null));
      const percent = axis.tickformat !== TICK_FORMAT;  // (".0%": whole percents, a step of 1 % at the least)
      const label = (value, step) => {
        const scale = percent ? 100 : 1, decimals = Math.max(0, -Math.floor(Math.log10(scale * step)));
        return fmt(scale * value, decimals) + (percent ? "%" : "");
      };
      const length = width * (axis.domain[1] - axis.domain[0]);
      const step = most > 0 ? tickStep(most, length, label, layout.font.size, percent ? 0.01 : 0) : null;
      axes[name] = Object.assign({}, axis, step ? {tickmode: "linear", tick0: 0, dtick: step} : {nticks: 3},
                                 {tickangle: 0});
    });
    return Object.assign({}, layout, axes);
  }
  // The least of 1, 2 and 5 × 10^k, and `least` at the least, that ticks [0, most] SUMMARY_MOST_TICKS times at most,
  // its labels `label` in `px` px text SUMMARY_TICK_GAP_PX apart on an axis `length` px long (null: none, as on an
  // axis of no width).
  function tickStep(most, length, label, px, least) {
    const first = Math.max(least, 10 ** Math.floor(Math.log10(most / SUMMARY_MOST_TICKS)));
    for (let decade = first; length > 0 && decade <= 10 * most; decade *= 10) {
      for (const step of [decade, 2 * decade, 5 * decade]) {
        const ticks = Math.floor(most / step) + 1, widest = textPx(label((ticks - 1) * step, step), px);
        if (ticks <= SUMMARY_MOST_TICKS && length * step / most >= widest + SUMMARY_TICK_GAP_PX) return step;
      }
    }
    return null;
  }
  // Each figure inside its bar where it fits there unshrunk, at the chart's font size, else just past the bar's
  // end: plotly's "auto" keeps a figure inside a bar it fits only shrunk, which uniformtext then draws larger all
  // the same, running left over the bar's start and the axis ("7.3%" on ZB-V's bubble at 800 px).
  async function placeBarTexts() {
    const fl = summaryDiv._fullLayout, fontPx = DATA.summary.layout.font.size;
    const positions = summaryDiv.data.map(bars => {
      const axis = fl[bars.xaxis.replace("x", "xaxis")], pxPerUnit = axis._length / (axis.range[1] - axis.range[0]);
      return bars.x.map((value, k) => (value !== null &&
        value * pxPerUnit >= textPx(bars.text[k], fontPx) + 2 * BAR_TEXT_PAD_PX ? "inside" : "outside"));
    });
    await Plotly.restyle(summaryDiv, {textposition: positions}, [...positions.keys()]);
  }
  async function drawSummary() {
    if (!DATA.summary) return;
    await Plotly.newPlot(summaryDiv, DATA.summary.data, fitSummaryTicks(fitSummaryTitles(DATA.summary.layout)),
                         {displaylogo: false, responsive: true, displayModeBar: false});
    await placeBarTexts();
    summaryDiv.on("plotly_click", ev => { if (ev.points.length) select(viewOf(ev.points[0].pointIndex)); });
    recordSummary();
  }
  // Where the panels' titles and the bars' figures are (tests/test_browser.py checks them apart): each title's
  // left and right, each panel's axis start and its figures' leftmost edge, each axis' tick labels (left, right,
  // top, bottom), and the chart's right.
  function recordSummary() {
    const fl = summaryDiv._fullLayout, box = summaryDiv.getBoundingClientRect();
    const span = element => { const r = element.getBoundingClientRect(); return [r.left, r.right]; };
    summaryDiv.dataset.geometry = JSON.stringify({
      right: box.right, titles: [...summaryDiv.querySelectorAll(".annotation")].map(span),
      ticks: [...summaryDiv.querySelectorAll(".xaxislayer-above")].map(layer => [...layer.querySelectorAll("text")]
        .map(text => { const r = text.getBoundingClientRect(); return [r.left, r.right, r.top, r.bottom]; })),
      figures: [...summaryDiv.querySelectorAll(".barlayer .trace")].map((trace, j) => ({
        axis_left: box.left + fl[summaryDiv.data[j].xaxis.replace("x", "xaxis")]._offset,
        left: Math.min(...[...trace.querySelectorAll("text")].map(text => span(text)[0]))}))});
  }
  DATA.views.forEach((v, i) => {
    const b = document.createElement("button");
    b.type = "button"; b.textContent = v.name; b.onclick = () => select(i);
    nav.appendChild(b);
  });
  if (DATA.views.length < 2) nav.style.display = "none";
  const notes = document.getElementById("notes");
  DATA.notes.forEach(text => { const p = document.createElement("p"); p.textContent = text; notes.appendChild(p); });
  document.addEventListener("keydown", e => {
    if (e.target.tagName === "INPUT" || e.altKey || e.ctrlKey || e.metaKey) return;
    if (e.key === "ArrowRight" || e.key === "ArrowLeft") {
      const step = e.key === "ArrowRight" ? 1 : DATA.views.length - 1;
      select((current + step) % DATA.views.length);
    }
  });

  const built = new Map();
  let current = 0, queue = Promise.resolve();
  function select(i) { queue = queue.then(() => show(i)).catch(e => health.note("script error: " + e)); return queue; }
  async function show(i) {
    if (i === current && shownView && shownView === built.get(i)) return;
    current = i;
    [...nav.children].forEach((b, j) => b.classList.toggle("on", j === i));
    if (summaryDiv.data) {
      await Plotly.restyle(summaryDiv, {"marker.color": [summaryColors(i)]}, [...summaryDiv.data.keys()]);
    }
    const view = DATA.views[i];
    if (!built.has(i)) built.set(i, buildView(view, await Promise.all(view.traces.map(trace))));
    const b = built.get(i);
    const columns = Math.max(300, Math.round(gd.clientWidth || 1200));
    const {data, layout} = figure(b, columns);
    shownView = null;
    await Plotly.react(gd, data, layout, CONFIG);
    await legendUnderTitle(layout);
    await fitPlotHeight(b);
    shownView = b;
    await fitBars(b);
    record(b);
    document.body.dataset.view = view.name;
  }
  let refining = false;
  function onRelayout(ev) {
    const b = shownView;
    if (!b) return;
    const keys = Object.keys(ev || {});
    if (keys.some(k => k.startsWith("yaxis.") || k === "autosize" || k === "height" || k === "width")) {
      fitBars(b).then(() => record(b));
    }
    if (keys.some(k => k.startsWith("xaxis.") || k === "autosize" || k === "width") && !refining) {
      refining = true;  // one refinement per frame, however many zoom steps a scroll wheel sends
      requestAnimationFrame(() => {
        refining = false;
        refine(b).catch(e => health.note("script error: " + e));
      });
    }
  }

  // plotly wraps the kinds' legend at the plot's width, which only it knows (the memory legend widens the right
  // margin as it needs), and grows the rows upwards from the lanes: where they reach the title, the top margin
  // grows by as much (DualPipeV with expert parallelism: 13 kinds, two rows at 1400 px).
  async function legendUnderTitle(layout) {
    const title = gd.querySelector(".gtitle"), legend = gd.querySelector("g.legend");
    if (!title || !legend) return;
    const below = title.getBoundingClientRect().bottom + LEGEND_GAP_PX;
    const overlap = Math.ceil(below - legend.getBoundingClientRect().top);
    if (overlap > 0) {
      await Plotly.relayout(gd, {"margin.t": layout.margin.t + overlap, height: layout.height + overlap});
    }
  }

  // plotly makes room for a legend outside the plots by taking it from them (16 devices' lanes went from 15 px
  // to 9 px apart): the figure grows by what they lost instead.
  async function fitPlotHeight(b) {
    const fl = gd._fullLayout, lost = fl ? b.plotPx - fl._size.h : 0;
    if (lost > 0.5) await Plotly.relayout(gd, {height: fl.height + Math.ceil(lost)});
  }

  // Where the lanes are on the page (the browser test checks a screenshot's bars against them), the title, the
  // kinds' legend, the memory legend (and whether it scrolls), the capacity lines, and the range and place of
  // each memory panel's axis.
  function record(b) {
    const fl = gd._fullLayout, ya = fl.yaxis, xa = fl.xaxis, box = gd.getBoundingClientRect();
    const top = box.top + window.scrollY + ya._offset, left = box.left + window.scrollX + xa._offset;
    const onPage = element => {
      const r = element.getBoundingClientRect();
      return [r.left + window.scrollX, r.top + window.scrollY, r.width, r.height];
    };
    const toPx = y => top + (y - ya.range[1]) / (ya.range[0] - ya.range[1]) * ya._length;
    const memoryLegend = gd.querySelector("g.legend2"), scrollbar = gd.querySelector("g.legend2 .scrollbar");
    gd.dataset.geometry = JSON.stringify({
      plot: [left, top, xa._length, ya._length], bar_px: b.barPx,
      points: gd.data.reduce((total, d) => total + (d.x ? d.x.length : 0), 0),
      lanes: b.lanes.map(l => toPx(l.y)),
      title: onPage(gd.querySelector(".gtitle")), legend: onPage(gd.querySelector("g.legend")),
      modebar: onPage(gd.querySelector(".modebar")), figure: onPage(gd),
      memory_legend: memoryLegend && {box: onPage(memoryLegend),
                                      scrolls: Boolean(scrollbar && scrollbar.getBoundingClientRect().height > 0)},
      capacity: b.capacity,
      // the lines' labels (the layout's last annotations) and the plot areas of their panels
      capacity_labels: [...gd.querySelectorAll(".annotation")]
        .filter(a => Number(a.dataset.index) >= fl.annotations.length - b.capacityLabels)
        .map(a => ({text: a.textContent, box: onPage(a)})),
      capacity_notes: b.capacityNotes,
      heatmaps: b.heatmaps.map(({index, capacity}, k) => ({
        capacity, zmax: gd.data[index].zmax, colorscale: gd.data[index].colorscale,
        ticks: gd.data[index].colorbar.ticktext || null,
        // the axis' title and its rows' labels as drawn
        rows: [...gd.querySelectorAll(".g-" + gd.data[index].yaxis + "title")].map(title => title.textContent).join(""),
        row_labels: [...gd.querySelectorAll("." + gd.data[index].yaxis + "tick")].map(tick => tick.textContent),
        bar: gd.data[index].colorbar.title.text, bar_box: onPage(gd.querySelectorAll(".cbtitle")[k])})),
      memory: b.panels.map((panel, j) => {
        const axis = fl["yaxis" + (j + 2)];
        const T = b.members[panel.member], parts = T.memoryParts;
        const lines = b.memoryTraces.filter(line => line.panel === j), name = line => T.device_names[line.device];
        return {trace: T.label, range: axis.range,
                plot: [left, box.top + window.scrollY + axis._offset, xa._length, axis._length],
                stacked_peak_mib: parts ? Math.max(...parts.stack[parts.stack.length - 1]) : null,
                lines_drawn: lines.filter(line => gd.data[line.index].visible === true).map(name),
                lines_listed: lines.map(name)};
      }),
    });
  }

  // The colours the WebGL canvas really shows in the timeline area: how many pixels are drawn.
  function inkInTimeline() {
    const canvas = gd.querySelector("canvas.gl-canvas-context") || gd.querySelector("canvas");
    const fl = gd._fullLayout;
    if (!canvas || !fl) return 0;
    const xa = fl.xaxis, ya = fl.yaxis;
    const scale = canvas.width / canvas.clientWidth;
    const w = Math.max(1, Math.round(xa._length)), h = Math.max(1, Math.round(ya._length));
    const probe = document.createElement("canvas");
    probe.width = w; probe.height = h;
    const ctx = probe.getContext("2d", {willReadFrequently: true});
    ctx.drawImage(canvas, xa._offset * scale, ya._offset * scale, w * scale, h * scale, 0, 0, w, h);
    const px = ctx.getImageData(0, 0, w, h).data;
    let ink = 0;
    for (let k = 3; k < px.length; k += 4) if (px[k] > 0) ink++;
    return ink / (w * h);
  }
  const frame = () => new Promise(resolve => requestAnimationFrame(() => setTimeout(resolve, 0)));

  async function main() {
    if (typeof DecompressionStream === "undefined") {
      throw new Error("this browser cannot decompress the page's data (no DecompressionStream): use a current one");
    }
    health.time("script");
    await Promise.all(DATA.traces.map((_, i) => trace(i)));
    health.time("decoded");
    await drawSummary();
    health.time("summary");
    await select(0);
    health.time("first-plot");
    gd.on("plotly_relayout", onRelayout);
    const checked = [];
    for (let i = TEST ? 0 : DATA.views.length; i < DATA.views.length; i++) {
      await select(i);
      await frame(); await frame();
      const ink = inkInTimeline();
      checked.push(DATA.views[i].name + "=" + ink.toFixed(4));
      health.time(DATA.views[i].name);
      if (!(ink > 0.002)) health.note("blank plot: " + DATA.views[i].name);
    }
    if (TEST) { await select(0); document.body.dataset.views = checked.join(" "); }
    await frame(); await frame();
    health.done();
  }
  main().catch(e => health.note("script error: " + (e && e.stack ? e.stack.split("\n").slice(0, 2).join(" ") : e)));
})();
"""
