"""The timeline figure draws every op exactly once and the HTML page works offline."""

import dataclasses

import numpy as np
import pytest
from plotly.offline import get_plotlyjs

from pipesim.traces.view import timeline_figure, write_html
from pipesim.units import MIB
from tests.conftest import run


def _trace(name, p, m, n=1, comm=0.1):
    return run(name, p, m, n, comm=comm, param_mb=100, activation_mb=10, output_mb=1).trace


@pytest.fixture(scope="module")
def trace():
    return _trace("1f1b", 4, 8, 2)


def _by_mode(fig, mode):
    return {t.name: t for t in fig.data if t.mode == mode and t.yaxis == "y"}


def _segments(line_trace):
    """Segments in a line trace: each is two points followed by a NaN gap."""
    x = np.asarray(line_trace.x, dtype=float)
    gaps = np.isnan(x)
    assert np.count_nonzero(~gaps) == 2 * np.count_nonzero(gaps)
    return int(np.count_nonzero(gaps))


def test_one_line_trace_per_kind_with_one_segment_per_op(trace):
    fig = timeline_figure(trace)
    lines, markers = _by_mode(fig, "lines"), _by_mode(fig, "markers")
    present = {trace.kinds[k]: int(c) for k, c in zip(*np.unique(trace.ops.kind, return_counts=True))}
    assert set(lines) == set(markers) == set(present)
    assert len(fig.data) == 2 * len(present) + trace.num_devices
    for kind, count in present.items():
        assert _segments(lines[kind]) == count
        assert len(markers[kind].x) == len(markers[kind].hovertext) == count


def test_hover_names_the_op(trace):
    hover = _by_mode(timeline_figure(trace), "markers")["F"].hovertext
    first = np.flatnonzero(trace.ops.kind == trace.kind_code("F"))[0]
    assert trace.op_label(first) in hover[0]
    assert "device 0" in hover[0] and "mini-batch 0" in hover[0] and "weight version 0" in hover[0]
    assert "prediction" not in hover[0] and "pipeline" not in hover[0]


def test_lanes_device_zero_on_top_and_transfer_lanes_only_where_used(trace):
    axis = timeline_figure(trace).layout.yaxis
    assert axis.ticktext[:3] == ("device 0", "device 0 send", "device 0 recv")
    assert len(axis.ticktext) == 3 * trace.num_devices
    assert axis.range[0] > axis.range[1]
    alone = timeline_figure(_trace("gpipe", 1, 2)).layout.yaxis
    assert alone.ticktext == ("device 0",)


def test_memory_row_peaks_at_the_counter_peak(trace):
    fig = timeline_figure(trace)
    memory = [t for t in fig.data if t.yaxis == "y2"]
    assert len(memory) == trace.num_devices
    peak = max(c.values.max() for c in trace.counters["memory_bytes"]) / MIB
    assert max(np.max(t.y) for t in memory) == pytest.approx(peak)
    assert all(t.line.shape == "hv" for t in memory)


def test_without_a_memory_counter_the_timeline_stands_alone(trace):
    fig = timeline_figure(dataclasses.replace(trace, counters={}))
    assert all(t.yaxis == "y" for t in fig.data)
    assert fig.layout.xaxis.title.text == "time (ms)"


def test_title_defaults_to_schedule_and_makespan(trace):
    assert timeline_figure(trace).layout.title.text.startswith("1f1b: makespan ")
    assert timeline_figure(trace, title="mine").layout.title.text == "mine"


def test_html_embeds_plotly_once_and_references_no_cdn(trace, tmp_path):
    path = tmp_path / "view.html"
    write_html([("1f1b", timeline_figure(trace)), ("gpipe", timeline_figure(_trace("gpipe", 4, 8)))], path,
               title="compare")
    text = path.read_text(encoding="utf-8")
    bundle = get_plotlyjs()
    assert text.count(bundle) == 1
    assert text.count("Plotly.newPlot(") == 2
    # The bundle itself names URLs for map features it never loads here; the page must add none.
    page = text.replace(bundle, "")
    assert "https://cdn" not in page and 'src="http' not in page
    assert "<title>compare</title>" in page and "<h2>gpipe</h2>" in page


def test_write_html_leaves_nothing_behind_on_failure(trace, tmp_path):
    fig = timeline_figure(trace)
    with pytest.raises(OSError):
        write_html([("x", fig)], tmp_path / "missing" / "view.html")
    assert list(tmp_path.iterdir()) == []

    existing = tmp_path / "view.html"
    existing.write_text("old")
    with pytest.raises(AttributeError):
        write_html([("x", fig), ("broken", None)], existing)
    assert existing.read_text() == "old"
    assert list(tmp_path.iterdir()) == [existing]


def test_100k_ops_stay_a_handful_of_traces():
    big = _trace("1f1b", 16, 1200, comm=0.0)
    assert len(big.ops) > 100_000
    fig = timeline_figure(big)
    lines = _by_mode(fig, "lines")
    assert len(fig.data) == 2 * len(lines) + big.num_devices
    assert sum(_segments(t) for t in lines.values()) == len(big.ops)
