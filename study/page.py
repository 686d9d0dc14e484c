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

from ..traces.view import write_html
from .results import ArmSummary

_PALETTE = qualitative.D3 + qualitative.Set2


def _colours(summaries: Sequence[ArmSummary]) -> dict[str, str]:
    """One colour per arm, in the order the arms run."""
    labels = list(dict.fromkeys(s.arm.label for s in summaries))
    return {label: _PALETTE[i % len(_PALETTE)] for i, label in enumerate(labels)}


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


def loss_figure(summaries: Sequence[ArmSummary], optimizers: Sequence[str]) -> go.Figure:
    colours = _colours(summaries)
    fig = make_subplots(rows=1, cols=len(optimizers), shared_yaxes=True, horizontal_spacing=0.04,
                        subplot_titles=[f"{o} (lr {next(s.lr for s in summaries if s.optimizer == o):g})"
                                        for o in optimizers])
    for col, optimizer in enumerate(optimizers, start=1):
        for s in (s for s in summaries if s.optimizer == optimizer and s.runs):
            curves = np.array([[np.nan if v is None else v for v in r.losses] for r in s.runs], dtype=float)
            window = max(1, curves.shape[1] // 15)
            smooth = np.array([_smoothed(c, window) for c in curves])
            samples = (np.arange(curves.shape[1]) + 1) * s.runs[0].samples_per_minibatch
            colour, dash = colours[s.arm.label], None if s.arm.primary else "dash"
            with np.errstate(all="ignore"):
                low, high, mean = np.nanmin(smooth, 0), np.nanmax(smooth, 0), np.nanmean(smooth, 0)
            shown = np.isfinite(mean)
            if len(s.runs) > 1 and shown.any():
                fig.add_trace(go.Scatter(
                    x=np.concatenate([samples[shown], samples[shown][::-1]]),
                    y=np.concatenate([high[shown], low[shown][::-1]]), fill="toself", fillcolor=colour,
                    opacity=0.15, line={"width": 0}, hoverinfo="skip", legendgroup=s.arm.label, showlegend=False),
                    row=1, col=col)
            note = f", {s.diverged} of {len(s.runs)} diverged" if s.diverged else ""
            fig.add_trace(go.Scatter(
                x=samples[shown], y=mean[shown], mode="lines", name=s.arm.label, legendgroup=s.arm.label,
                showlegend=col == 1, line={"color": colour, "dash": dash, "width": 2},
                hovertemplate=f"{s.arm.label} ({optimizer}{note})<br>%{{x:,}} samples<br>loss %{{y:.4f}}"
                              "<extra></extra>"), row=1, col=col)
        fig.update_xaxes(title_text="samples trained on", row=1, col=col)
    fig.update_yaxes(title_text="training loss (running mean; band: min–max over seeds)", type="log", row=1, col=1)
    fig.update_layout(height=480, margin={"t": 40, "b": 50, "l": 70, "r": 20}, legend={"title": "method"})
    return fig


def accuracy_figure(summaries: Sequence[ArmSummary], optimizers: Sequence[str]) -> go.Figure:
    """Held-out accuracy (mean ± std over seeds) against measured samples/s (the prediction in the hover), one
    marker symbol per optimizer; against the arm where nothing was timed."""
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
            throughput = "" if not timed else (f"<br>{s.timing.measured_samples_per_s:,.0f} samples/s measured, "
                                               f"{s.timing.predicted_samples_per_s:,.0f} predicted")
            fig.add_trace(go.Scatter(
                x=[s.timing.measured_samples_per_s if timed else s.arm.label], y=[acc.mean],
                error_y={"type": "data", "array": [acc.std], "color": colours[s.arm.label]},
                mode="markers", name=s.arm.label, legendgroup=s.arm.label, showlegend=s.arm.label not in shown,
                marker={"color": colours[s.arm.label], "size": 11, "symbol": symbols[i % len(symbols)],
                        "line": {"width": 1, "color": "white"}},
                hovertemplate=f"{s.arm.label} ({optimizer})<br>accuracy {acc.mean:.1%} ± {acc.std:.1%} over "
                              f"{acc.n} seeds{throughput}<extra></extra>"))
            shown.add(s.arm.label)
    marks = ", ".join(f"{symbols[i % len(symbols)]}: {o}" for i, o in enumerate(optimizers))
    fig.update_layout(height=460, margin={"t": 20, "b": 50, "l": 70, "r": 20}, legend={"title": "method"},
                      xaxis_title=f"samples/s measured on spawned ranks ({marks})" if timed else f"method ({marks})",
                      yaxis_title="held-out accuracy (mean ± std over seeds)", yaxis_tickformat=".0%")
    return fig


def stages_figure(summaries: Sequence[ArmSummary]) -> go.Figure:
    """What every stage ran on, as the executor measured it, per arm: a table."""
    rows: dict[str, tuple[str, ...]] = {}
    for label in dict.fromkeys(s.arm.label for s in summaries):
        # the first optimizer whose runs measured it (a run that diverged measured nothing)
        measured = next((s for s in summaries if s.arm.label == label and s.stages), None)
        rows[label] = tuple("-" if measured is None else measured.per_stage(name, ", ") for name in (
            "forward_staleness", "backward_staleness", "prediction_distance", "backward_prediction_distance"))
    header = ["arm", "F staleness per stage", "B staleness per stage", "F prediction s", "B prediction s"]
    columns = [list(rows), *zip(*rows.values())] if rows else [[] for _ in header]
    fig = go.Figure(go.Table(header={"values": header, "align": "left", "fill_color": "#eef1f5"},
                             cells={"values": columns, "align": "left", "height": 24}))
    fig.update_layout(height=80 + 26 * max(len(rows), 1), margin={"t": 10, "b": 10, "l": 10, "r": 10})
    return fig


def write_study_page(summaries: Sequence[ArmSummary], optimizers: Sequence[str], path: str | os.PathLike[str],
                     title: str) -> None:
    write_html([("Training loss, per optimizer", loss_figure(summaries, optimizers)),
                ("Held-out accuracy against throughput", accuracy_figure(summaries, optimizers)),
                ("Staleness and prediction distance each stage ran with (measured)", stages_figure(summaries))],
               path, title=title)
