"""Interactive timeline views of traces: a Plotly figure per trace and one offline HTML page for several.

Built for traces of 100k+ ops: ops are drawn with WebGL (`Scattergl`) as a handful of traces, one per op
kind, whose geometry is computed with numpy; one trace per op would make the browser crawl.
"""

from __future__ import annotations

import html
import os
from collections.abc import Iterable

import numpy as np
import plotly.graph_objects as go
from plotly.colors import qualitative, sample_colorscale
from plotly.subplots import make_subplots

from ..units import MIB
from .metrics import summarize
from .trace import STREAMS, Stream, Trace, write_atomic

# Fixed per kind, so the same kind looks the same in every figure and comparisons read at a glance.
KIND_COLORS = {
    "F": "#4c78a8",
    "B": "#54a24b",
    "I": "#8fd175",
    "W": "#2e6b30",
    "OPT": "#e45756",
    "PRED": "#9d6bc4",
    "AVG": "#f58518",
    "SEND_F": "#b0b0b0",
    "RECV_F": "#b0b0b0",
    "SEND_B": "#7a7a7a",
    "RECV_B": "#7a7a7a",
}
_LANE_PX = 24  # height of one lane; ops are drawn as lines _BAR_PX thick
_BAR_PX = 16
_DEVICE_GAP = 0.5  # extra space between devices, in lanes, so each device's lanes read as a group
_INSET = 0.025  # each bar is shortened by this fraction of its op at both ends, so back-to-back ops stay apart
_MEMORY_PX = 220
_MARGIN = {"t": 80, "b": 60, "l": 110, "r": 20}


def _lanes(trace: Trace) -> tuple[np.ndarray, list[float], list[str]]:
    """Lane position of every (device, stream) that has a lane (NaN otherwise), and the y ticks.

    Every device gets a compute lane, even when idle, so a missing device never goes unnoticed;
    send and recv lanes appear only where the device transfers something.
    """
    ops = trace.ops
    present = np.zeros((trace.num_devices, len(STREAMS)), dtype=bool)
    present[:, Stream.COMPUTE] = True
    present[ops.device, ops.stream] = True
    devices, streams = np.nonzero(present)  # device-major, compute lane first
    positions = np.arange(len(devices)) + _DEVICE_GAP * devices
    lane_y = np.full(present.shape, np.nan)
    lane_y[devices, streams] = positions
    labels = [f"device {d}" if s == Stream.COMPUTE else f"device {d} {STREAMS[s]}"
              for d, s in zip(devices.tolist(), streams.tolist())]
    return lane_y, positions.tolist(), labels


def _hover_texts(trace: Trace, rows: np.ndarray) -> list[str]:
    """One hover text per op in `rows`, naming everything that identifies it."""
    ops = trace.ops
    cols = [getattr(ops, name)[rows].tolist() for name in
            ("device", "stage", "microbatch", "minibatch", "pipeline", "peer", "version", "prediction")]
    start_ms = (ops.start_us[rows] / 1e3).tolist()
    dur_ms = (ops.dur_us[rows] / 1e3).tolist()
    labels = [trace.op_label(i) for i in rows.tolist()]
    return [
        f"<b>{label}</b>  device {d}, stage {s}"
        + (f", peer {peer}" if peer >= 0 else "")
        + "<br>"
        + (f"micro-batch {mb}, " if mb >= 0 else "")
        + f"mini-batch {mn}"
        + (f", pipeline {pl}" if pl > 0 else "")
        + f"<br>start {t:.3f} ms, dur {dt:.3f} ms"
        + (f"<br>weight version {v}" if v >= 0 else "")
        + (f"<br>prediction distance {p}" if p >= 0 else "")
        for label, d, s, mb, mn, pl, peer, v, p, t, dt in zip(labels, *cols, start_ms, dur_ms)
    ]


def timeline_figure(trace: Trace, title: str | None = None) -> go.Figure:
    """The ops of `trace` on one lane per (device, stream) over time, with memory per device below.

    The title defaults to the schedule's name with its makespan and bubble, so a screenshot stands alone.
    Bars are shortened by a few percent at both ends so that back-to-back ops of one kind stay apart;
    the hover text gives exact times.
    """
    ops = trace.ops
    memory = trace.counters.get("memory_bytes")
    lane_y, tick_y, tick_text = _lanes(trace)
    timeline_px = _LANE_PX * max(tick_y[-1] + 1 if tick_y else 1, 4)
    rows = 2 if memory else 1
    plot_px = timeline_px + (_MEMORY_PX if memory else 0)
    spacing_px = 30
    fig = make_subplots(
        rows=rows, cols=1, shared_xaxes=True,
        row_heights=[timeline_px, _MEMORY_PX][:rows],
        vertical_spacing=spacing_px / plot_px if memory else 0.0,
    )

    start_ms = ops.start_us / 1e3
    end_ms = ops.end_us / 1e3
    op_y = lane_y[ops.device, ops.stream]
    for code, kind in enumerate(trace.kinds):
        rows_of_kind = np.flatnonzero(ops.kind == code)
        if len(rows_of_kind) == 0:
            continue
        color = KIND_COLORS.get(kind, qualitative.Dark24[code % len(qualitative.Dark24)])
        # Each op is the segment (start, y) - (end, y) followed by a NaN gap that breaks the line.
        inset = _INSET * (end_ms[rows_of_kind] - start_ms[rows_of_kind])
        x = np.full((len(rows_of_kind), 3), np.nan)
        x[:, 0], x[:, 1] = start_ms[rows_of_kind] + inset, end_ms[rows_of_kind] - inset
        y = np.full_like(x, np.nan)
        y[:, 0] = y[:, 1] = op_y[rows_of_kind]
        fig.add_trace(go.Scattergl(
            x=x.ravel(), y=y.ravel(), mode="lines", name=kind, legendgroup=kind,
            line={"color": color, "width": _BAR_PX}, hoverinfo="skip", connectgaps=False,
        ), row=1, col=1)
        # Lines carry no hover of their own; an invisible marker at each op's middle does. Even faint
        # markers would pile up where ops are dense and paint activity on zero-length transfers.
        fig.add_trace(go.Scattergl(
            x=(start_ms[rows_of_kind] + end_ms[rows_of_kind]) / 2, y=op_y[rows_of_kind], mode="markers",
            name=kind, legendgroup=kind, showlegend=False,
            marker={"color": color, "size": 6, "opacity": 0},
            hovertext=_hover_texts(trace, rows_of_kind), hoverinfo="text",
        ), row=1, col=1)

    if memory:
        end = float(end_ms.max()) if len(ops) else 0.0
        colors = sample_colorscale("Viridis", np.linspace(0, 0.8, max(len(memory), 2)).tolist())
        for d, counter in enumerate(memory):
            if len(counter.times_us) == 0:
                continue
            # The last value holds until the run ends; draw it that far.
            times = np.append(counter.times_us / 1e3, max(end, counter.times_us[-1] / 1e3))
            values = np.append(counter.values, counter.values[-1]) / MIB
            fig.add_trace(go.Scattergl(
                x=times, y=values, mode="lines", name=f"device {d}", legend="legend2",
                line={"color": colors[d], "width": 1.5, "shape": "hv"},
                hovertemplate=f"device {d}: %{{y:.1f}} MiB at %{{x:.3f}} ms<extra></extra>",
            ), row=2, col=1)
        fig.update_yaxes(title_text="memory (MiB)", fixedrange=True, row=2, col=1)
        # A legend of its own beside the memory row: clicking a kind hides the kind's ops and their
        # hover markers together (one legend group), clicking a device hides just that device's line.
        fig.update_layout(legend2={"title_text": "memory", "y": fig.layout.yaxis2.domain[1], "yanchor": "top"})

    if title is None:
        summary = summarize(trace)
        title = (f"{summary.schedule}: makespan {summary.makespan_ms:.2f} ms, "
                 f"bubble {summary.bubble_fraction:.1%}")
    fig.update_yaxes(
        tickvals=tick_y, ticktext=tick_text, range=[(tick_y[-1] if tick_y else 0) + 0.8, -0.8],
        showgrid=False, zeroline=False, fixedrange=True, row=1, col=1,
    )
    fig.update_xaxes(title_text="time (ms)", row=rows, col=1)
    fig.update_layout(
        title=title, height=plot_px + (spacing_px if memory else 0) + _MARGIN["t"] + _MARGIN["b"],
        margin=_MARGIN, hovermode="closest", template="plotly_white",
        legend={"tracegroupgap": 4},
    )
    return fig


def write_html(figures: Iterable[tuple[str, go.Figure]], path: str | os.PathLike[str],
               title: str = "pipesim") -> None:
    """Write one self-contained HTML page showing `(heading, figure)` pairs one below the other.

    plotly.js is embedded once, so the page opens offline and stays as small as it can; the file is
    written atomically, so a failure never leaves a half-written page behind.
    """
    sections = []
    for i, (heading, fig) in enumerate(figures):
        div = fig.to_html(full_html=False, include_plotlyjs=i == 0,
                          config={"displaylogo": False, "scrollZoom": True})
        sections.append(f"<section><h2>{html.escape(heading)}</h2>\n{div}\n</section>")
    page = (
        "<!DOCTYPE html>\n<html>\n<head>\n<meta charset=\"utf-8\">\n"
        f"<title>{html.escape(title)}</title>\n"
        "<style>body{font-family:sans-serif;margin:1em 2em}h2{font-size:1.1em;margin:1.5em 0 0}</style>\n"
        "</head>\n<body>\n" + "\n".join(sections) + "\n</body>\n</html>\n"
    )
    write_atomic(path, page)
