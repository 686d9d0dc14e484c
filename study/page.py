"""A study's Plotly page: training loss per arm (mean over seeds with the min–max band), held-out accuracy
against throughput, and the staleness and prediction distance every stage ran with. One colour per arm in every
figure; an arm on another source of s than its method publishes has a dashed curve."""

from __future__ import annotations

import os
from collections.abc import Sequence

import numpy as np
import plotly.graph_objects as go
from plotly.colors import qualitative
from plotly.subplots import make_subplots

from ..traces.metrics import loss_text, percent_text, rate_text
from ..traces.view import LINE_OVER_PX, MODEBAR_BOTTOM_PX, TICK_FORMAT, UNDER_MODEBAR_PX, log_ticks, write_html
from .results import ArmSummary

_PALETTE = qualitative.D3 + qualitative.Set2


def _colours(summaries: Sequence[ArmSummary]) -> dict[str, str]:
    """One colour per arm, in the order the arms run."""
    labels = list(dict.fromkeys(s.arm.label for s in summaries))
    return {label: _PALETTE[i % len(_PALETTE)] for i, label in enumerate(labels)}


LEGEND_ROW_PX, LEGEND_ROW_ARMS = 24, 4  # a row of the legend under a chart, and the arms it holds at 1000 px or so
AXIS_TITLE_PX = 56  # from a chart's plot down past its x axis' labels and title, where a legend under it starts


def _legend_below(fig: go.Figure, arms: int, plot_px: int, margin: dict[str, int]) -> None:
    """The legend in rows under the chart, the figure taller by as many rows as `arms` take, so the plot keeps
    `plot_px`: beside the chart, at 800 px, a legend of 12 arms ("pipeoptim (code) (diverged: momentum 1 of 3)")
    took two fifths of the width and left each loss panel 110 px."""
    legend_px = LEGEND_ROW_PX * -(-arms // LEGEND_ROW_ARMS)
    fig.update_layout(height=plot_px + margin["t"] + AXIS_TITLE_PX + legend_px,
                      margin={**margin, "b": AXIS_TITLE_PX + legend_px},
                      legend={"title": "method", "orientation": "h", "x": 0, "xanchor": "left",
                              "y": -AXIS_TITLE_PX / plot_px, "yanchor": "top"})


def _smoothed(values: np.ndarray, window: int) -> np.ndarray:
    """Running mean over the last `window` mini-batches (fewer at the start); NaN stays NaN."""
    sums = np.nancumsum(values)
    counts = np.cumsum(np.isfinite(values))
    back = np.concatenate([np.zeros(window), sums])[:len(values)]
    back_n = np.concatenate([np.zeros(window), counts])[:len(values)]
    with np.errstate(invalid="ignore", divide="ignore"):
        out = (sums - back) / (counts - back_n)
    out[~np.isfinite(values)] = np.nan
    return out


def _diverged_label(summaries: Sequence[ArmSummary], label: str) -> str:
    """The arm's name in the legend: with the seeds that diverged, per optimizer, where any did."""
    counts = ", ".join(f"{s.optimizer} {s.diverged} of {len(s.runs)}" for s in summaries
                       if s.arm.label == label and s.diverged)
    return f"{label} (diverged: {counts})" if counts else label


def _log_range(values: np.ndarray) -> list[float]:
    """A log axis's range (log10 units) over the finite positive `values`, with a margin on either side."""
    finite = values[np.isfinite(values) & (values > 0)]
    lo, hi = (np.log10(finite.min()), np.log10(finite.max())) if len(finite) else (-1.0, 1.0)
    margin = 0.05 * max(hi - lo, 0.1)
    return [float(lo - margin), float(hi + margin)]


def loss_figure(summaries: Sequence[ArmSummary], optimizers: Sequence[str]) -> go.Figure:
    """One panel per optimizer, each on its own log axis clipped to the runs that did not diverge (one blown-up
    run would squash every other curve): a diverged run is an × where it left the axis, counted in the legend
    and in a note in its panel."""
    colours = _colours(summaries)
    names = {label: _diverged_label(summaries, label) for label in colours}
    fig = make_subplots(rows=1, cols=len(optimizers), horizontal_spacing=0.07,
                        subplot_titles=[f"{o} (lr {next(s.lr for s in summaries if s.optimizer == o):g})"
                                        for o in optimizers])
    for col, optimizer in enumerate(optimizers, start=1):
        panel = [s for s in summaries if s.optimizer == optimizer and s.runs]
        curves = {}
        for s in panel:
            raw = np.array([[np.nan if v is None else v for v in r.losses] for r in s.runs], dtype=float)
            window = max(1, raw.shape[1] // 15)
            samples = (np.arange(raw.shape[1]) + 1) * s.runs[0].samples_per_minibatch
            smooth = np.array([_smoothed(c, window) for c in raw])
            curves[s.arm.label] = samples, smooth, smooth[[not r.diverged for r in s.runs]]
        y_range = _log_range(np.concatenate([ok.ravel() for _, _, ok in curves.values()]) if curves
                             else np.array([]))
        for s in panel:
            samples, smooth, ok = curves[s.arm.label]
            colour, dash = colours[s.arm.label], None if s.arm.primary else "dash"
            with np.errstate(all="ignore"):
                low, high, mean = (f(ok, 0) if len(ok) else np.full(len(samples), np.nan)
                                   for f in (np.nanmin, np.nanmax, np.nanmean))
            shown = np.isfinite(mean)
            if len(ok) > 1 and shown.any():
                fig.add_trace(go.Scatter(
                    x=np.concatenate([samples[shown], samples[shown][::-1]]),
                    y=np.concatenate([high[shown], low[shown][::-1]]), fill="toself", fillcolor=colour,
                    opacity=0.15, line={"width": 0}, hoverinfo="skip", legendgroup=s.arm.label, showlegend=False),
                    row=1, col=col)
            note = f", {s.diverged} of {len(s.runs)} seeds diverged" if s.diverged else ""
            if shown.any():
                fig.add_trace(go.Scatter(
                    x=samples[shown], y=mean[shown], mode="lines", name=names[s.arm.label], legendgroup=s.arm.label,
                    showlegend=False, line={"color": colour, "dash": dash, "width": 2},
                    customdata=[loss_text(loss) for loss in mean[shown]],
                    hovertemplate=f"{s.arm.label} ({optimizer}{note})<br>%{{x:,}} samples<br>loss %{{customdata}}"
                                  "<extra></extra>"), row=1, col=col)
            left = [_left_range(samples, c, 10 ** y_range[1]) for r, c in zip(s.runs, smooth) if r.diverged]
            left = [point for point in left if point is not None]
            if left:
                fig.add_trace(go.Scatter(
                    x=[x for x, _ in left], y=[10 ** (y_range[1] - 0.02 * (y_range[1] - y_range[0]))] * len(left),
                    mode="markers", name=names[s.arm.label], legendgroup=s.arm.label, showlegend=False,
                    cliponaxis=False,
                    marker={"symbol": "x", "size": 13, "color": colour, "line": {"width": 1, "color": "white"}},
                    customdata=[loss_text(loss) for _, loss in left],
                    hovertemplate=f"{s.arm.label} ({optimizer}) diverged: its loss (running mean) left the plot "
                                  "at %{x:,} samples and ended at %{customdata}<extra></extra>"), row=1, col=col)
        diverged = [f"{s.arm.label} {s.diverged}/{len(s.runs)}" for s in panel if s.diverged]
        if diverged:
            fig.add_annotation(text="diverged (seeds): " + ", ".join(diverged), xref="x domain", yref="y domain",
                               row=1, col=col, x=0.01, y=0.01, xanchor="left", yanchor="bottom",
                               showarrow=False, bgcolor="rgba(255,255,255,0.85)", bordercolor="#c0392b",
                               font={"size": 11, "color": "#c0392b"})
        fig.update_xaxes(title_text="samples trained on", tickformat=TICK_FORMAT, row=1, col=col)
        ticks = log_ticks(y_range)
        fig.update_yaxes(type="log", range=y_range, tickvals=ticks or None,
                         ticktext=[f"{tick:g}" for tick in ticks] or None, row=1, col=col,
                         title_text="training loss (running mean)" if col == 1 else None)
    # Each arm in the legend once, in the arms' order, by its line where any panel draws one: XPipe, every momentum
    # seed diverged, was listed by its momentum panel's ×, and its Adam line, drawn and named nowhere, read as no
    # arm's.
    for rank, label in enumerate(colours):
        drawn = [t for t in fig.data if t.legendgroup == label and t.name is not None]
        entry = next((t for t in drawn if t.mode == "lines"), drawn[0] if drawn else None)
        if entry is not None:
            entry.update(showlegend=True, legendrank=rank)
    _legend_below(fig, len(colours), 390, {"t": MODEBAR_BOTTOM_PX + LINE_OVER_PX, "l": 70, "r": 20})
    return fig


def _left_range(samples: np.ndarray, smooth: np.ndarray, top: float) -> tuple[float, float] | None:
    """Where a diverged run's curve first passes `top` (or its last point), and its last finite loss; None for
    a run the executor stopped, which recorded no loss."""
    finite = np.flatnonzero(np.isfinite(smooth))
    if not len(finite):
        return None
    above = finite[smooth[finite] > top]
    at = above[0] if len(above) else finite[-1]
    return float(samples[at]), float(smooth[finite[-1]])


# The accuracy axis within 0 to 100 %: plotly pads one arm's accuracy (or every arm's alike) by ±1, and one seed's 50 %
# was drawn between -50 % and 150 %. A marker at 100 % is drawn whole over the axis' end.
ACCURACY_RANGE = {"minallowed": 0, "maxallowed": 1}


def accuracy_figure(summaries: Sequence[ArmSummary], optimizers: Sequence[str]) -> go.Figure:
    """Held-out accuracy (mean ± std over seeds) against measured samples/s (the prediction in the hover), one
    marker symbol per optimizer. Where nothing was timed there is no throughput to place an arm by: accuracy
    per arm, arms down the side."""
    colours = _colours(summaries)
    timed = any(s.timing for s in summaries)
    symbols = ("circle", "square", "diamond", "triangle-up")
    fig = go.Figure()
    shown: set[str] = set()
    for i, optimizer in enumerate(optimizers):
        for s in (s for s in summaries if s.optimizer == optimizer and s.heldout_accuracy.n):
            if timed and s.timing is None:
                continue
            acc = s.heldout_accuracy
            throughput = "" if not timed else (f"<br>{rate_text(s.timing.measured_samples_per_s)} samples/s measured, "
                                               f"{rate_text(s.timing.predicted_samples_per_s)} predicted")
            diverged = f" ({s.diverged} of {len(s.runs)} seeds diverged)" if s.diverged else ""
            place = ({"x": [s.timing.measured_samples_per_s], "y": [acc.mean]} if timed
                     else {"x": [acc.mean], "y": [s.arm.label]})
            if acc.std is not None:  # one seed: no spread to draw
                place["error_y" if timed else "error_x"] = {"type": "data", "array": [acc.std],
                                                            "color": colours[s.arm.label]}
            over = f"± {percent_text(acc.std)} over {acc.n} seeds" if acc.std is not None else "(one seed)"
            fig.add_trace(go.Scatter(
                **place, mode="markers", name=s.arm.label, legendgroup=s.arm.label, cliponaxis=False,
                showlegend=s.arm.label not in shown,
                marker={"color": colours[s.arm.label], "size": 11, "symbol": symbols[i % len(symbols)],
                        "line": {"width": 1, "color": "white"}},
                hovertemplate=f"{s.arm.label} ({optimizer}{diverged})<br>accuracy {percent_text(acc.mean)} {over}"
                              f"{throughput}<extra></extra>"))
            shown.add(s.arm.label)
    marks = ", ".join(f"{symbols[i % len(symbols)]}: {o}" for i, o in enumerate(optimizers))
    # (an arm whose every seed diverged has no accuracy, and no spread: its std is NaN, not None)
    spread = ("mean ± std over seeds" if any(s.heldout_accuracy.n > 1 for s in summaries) else "one seed")
    if timed:
        fig.update_xaxes(title_text=f"samples/s measured on spawned ranks ({marks})", tickformat=TICK_FORMAT)
        fig.update_yaxes(title_text=f"held-out accuracy ({spread})", tickformat=".0%", autorangeoptions=ACCURACY_RANGE)
    else:  # the marker key goes under the long axis: the height of a few arms cannot hold it
        fig.update_xaxes(title_text=f"held-out accuracy ({spread}; {marks})", tickformat=".0%",
                         autorangeoptions=ACCURACY_RANGE)
        fig.update_yaxes(title_text="arm", autorange="reversed", type="category", categoryorder="array",
                         categoryarray=list(colours))
    # An arm whose every seed diverged has no accuracy: named over the chart, where its marker went missing unsaid.
    lost = [f"{s.arm.label} ({s.optimizer})" for s in summaries if s.runs and not s.heldout_accuracy.n]
    if lost:
        fig.add_annotation(text="no accuracy, every seed diverged: " + ", ".join(lost), xref="paper", yref="paper",
                           x=0, y=1, xanchor="left", yanchor="bottom", yshift=4, showarrow=False,
                           font={"size": 11, "color": "#c0392b"})
    margin = {"t": MODEBAR_BOTTOM_PX + (LINE_OVER_PX if lost else UNDER_MODEBAR_PX), "l": 70, "r": 20}
    if timed:
        _legend_below(fig, len(shown), 390, margin)
    else:  # the arms are named down the side: no legend
        fig.update_layout(height=100 + margin["t"] + 28 * len(shown), margin={**margin, "b": 50},
                          showlegend=False)
    return fig


GROUP_FILLS = ("#ffffff", "#eef1f5")  # the stages table's methods, in turn: the rows of one method share a fill


def stages_figure(summaries: Sequence[ArmSummary]) -> go.Figure:
    """What every stage ran on, as the executor measured it, per arm: a table, a method's arms (one per source of
    s) in rows of one fill, the method named on its first: "pipeoptim", "pipeoptim (code)", "pipeoptim (counted)"
    and "xpipe" read as four rows alike, the methods' bounds to be found in the names."""
    arms = list(dict.fromkeys(s.arm for s in summaries))
    methods = list(dict.fromkeys(arm.method for arm in arms))
    fills = [GROUP_FILLS[methods.index(arm.method) % len(GROUP_FILLS)] for arm in arms]
    rows = []
    for k, arm in enumerate(arms):
        # the first optimizer whose runs measured it (a run that diverged measured nothing)
        measured = next((s for s in summaries if s.arm == arm and s.stages), None)
        first = k == 0 or arms[k - 1].method != arm.method
        rows.append((arm.method if first else "", arm.source or "-", *(
            "-" if measured is None else measured.per_stage(name, ", ") for name in (
                "forward_staleness", "backward_staleness", "prediction_distance", "backward_prediction_distance"))))
    header = ["method", "s from", "F staleness per stage", "B staleness per stage", "F prediction s per stage",
              "B prediction s per stage"]
    columns = [list(column) for column in zip(*rows)] if rows else [[] for _ in header]
    fig = go.Figure(go.Table(columnwidth=[1.6, 0.8, 2, 2, 2, 2],
                             header={"values": [f"<b>{name}</b>" for name in header], "align": "left",
                                     "fill_color": "#dde3ec"},
                             cells={"values": columns, "align": "left", "height": 24,
                                    "fill_color": [fills] * len(header)}))
    # the top margin clears the mode bar, which lay over the header's last column; the header may wrap to two lines
    # (at 800 px), which the height leaves room for
    fig.update_layout(height=100 + 24 * max(len(rows), 1),
                      margin={"t": MODEBAR_BOTTOM_PX + UNDER_MODEBAR_PX, "b": 10, "l": 10, "r": 10})
    return fig


def write_study_page(summaries: Sequence[ArmSummary], optimizers: Sequence[str], path: str | os.PathLike[str],
                     title: str) -> None:
    timed = any(s.timing for s in summaries)
    write_html([("Training loss per optimizer: the mean over seeds, its band min–max over the seeds that did not "
                 "diverge; ×: where a diverged seed left the plot", loss_figure(summaries, optimizers)),
                ("Held-out accuracy against throughput" if timed
                 else "Held-out accuracy per arm (throughput not timed: run the study with timing to place arms by "
                      "samples/s)", accuracy_figure(summaries, optimizers)),
                ("Staleness and prediction distance each stage ran with (measured)", stages_figure(summaries))],
               path, title=title)
