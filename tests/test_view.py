"""The timeline page holds plotly.js once and each trace's columns compactly and losslessly; what the page draws
is checked in a real browser by tests/test_browser.py."""

import dataclasses
import itertools
import json
import math
import re
from pathlib import Path

import numpy as np
import plotly.graph_objects as go
import pytest
from plotly.offline import get_plotlyjs

from pipesim.commands.common import PAGE
from pipesim.traces import summarize
from pipesim.traces.compare import compare
from pipesim.traces.view import (
    KIND_COLORS,
    decode_column,
    encode_column,
    error_figure,
    timeline_page,
    trace_data,
    write_html,
    write_timeline_page,
)
from pipesim.units import MIB
from tests.conftest import build, run, simulated
from tests.helpers import page_data as _page_data


def _trace(name, p, m, n=1, comm=0.1, **options):
    return run(name, p, m, n, comm=comm, param_mb=100, activation_mb=10, output_mb=1, **options).trace


@pytest.fixture(scope="module")
def trace():
    return _trace("1f1b", 4, 8, 2)


@pytest.mark.parametrize("values,dtype", [
    (np.array([0, 1, -1, 127], dtype=np.int64), "int8"),
    (np.array([-300, 5, 32767]), "int16"),
    (np.array([0, 70_000, -1]), "int32"),
    (np.array([0, 2**40]), "float64"),
    (np.array([0.1, 1e9 + 0.25, -3.5]), "float64"),
    (np.array([], dtype=np.int64), "int8"),
])
def test_columns_take_the_narrowest_type_and_round_trip_exactly(values, dtype):
    column = encode_column(values)
    assert column["type"] == dtype and column["n"] == len(values)
    back = decode_column(column)
    assert back.dtype == np.dtype(dtype) and np.array_equal(back.astype(values.dtype), values)


def test_trace_data_holds_every_op_column_and_memory_to_the_end(trace):
    data = trace_data(trace)
    ops = trace.ops
    for name, column in data["columns"].items():
        assert np.array_equal(decode_column(column), getattr(ops, name)), name
    assert data["n"] == len(ops) and data["kinds"] == list(trace.kinds)
    assert data["colors"] == [KIND_COLORS[k] for k in trace.kinds]
    memory = data["memory"]
    counters = trace.counters["memory_bytes"]
    assert memory["counts"] == [len(c.times_us) + 1 for c in counters]
    times, mib = decode_column(memory["t_us"]), decode_column(memory["mib"])
    first = counters[0]
    k = len(first.times_us)
    assert np.array_equal(times[:k], first.times_us) and times[k] == ops.end_us.max()  # held to the end
    assert np.allclose(mib[:k + 1], np.append(first.values, first.values[-1]) / MIB)
    assert data["summary"]["schedule"] == "1f1b" and data["meta"]["minibatches"] == 2


def test_every_kind_pipesim_emits_has_its_colour():
    kinds = set()
    for name, options in [("1f1b", {}), ("zb-h1", {}), ("pipedream", {}), ("spectrain", {}), ("avgpipe", {})]:
        kinds |= set(_trace(name, 2, 4, 2, **options).kinds)
    assert kinds <= set(KIND_COLORS)


def test_every_two_kinds_look_apart():
    """SEND_F and RECV_F were one grey (SEND_B and RECV_B another): the legend showed two entries alike. Every two
    kinds' colours are at least 40 apart in RGB (of 441)."""
    rgb = {kind: np.array([int(colour[k:k + 2], 16) for k in (1, 3, 5)]) for kind, colour in KIND_COLORS.items()}
    close = [(a, b) for a, b in itertools.combinations(rgb, 2) if np.linalg.norm(rgb[a] - rgb[b]) < 40]
    assert close == []


def test_page_embeds_plotly_once_and_asks_for_nothing_over_the_network(trace, tmp_path):
    path = tmp_path / "view.html"
    write_timeline_page([trace, _trace("gpipe", 4, 8)], path, title="compare <two>")
    text = path.read_text(encoding="utf-8")
    bundle = get_plotlyjs()
    assert text.count(bundle) == 1
    page = text.replace(bundle, "")
    assert "Content-Security-Policy" in page and "default-src 'none'" in page
    assert not re.search(r"(src|href)=\"?https?:", page) and "https://cdn" not in page
    assert "<title>compare &lt;two&gt;</title>" in page
    assert 'data-status="loading"' in page  # the page reports "ok" once it has drawn
    data = _page_data(text)
    assert [v["name"] for v in data["views"]] == ["1f1b", "gpipe"]
    assert [v["traces"] for v in data["views"]] == [[0], [1]]


def test_page_holds_no_per_op_text(trace):
    text = timeline_page([trace])
    assert "micro-batch 3" not in text and "F3.1" not in text  # hover text is built in the page, on demand


def test_views_align_several_traces_and_labels_tell_them_apart(trace):
    measured = dataclasses.replace(trace, meta=dataclasses.replace(trace.meta, source="measured"))
    data = _page_data(timeline_page([trace, measured], views=[("side by side", [0, 1]), ("measured", [1])]))
    assert [t["label"] for t in data["traces"]] == ["1f1b (predicted)", "1f1b (measured)"]
    assert data["views"] == [{"name": "side by side", "traces": [0, 1]}, {"name": "measured", "traces": [1]}]
    with pytest.raises(ValueError, match="names no trace or a missing one"):
        timeline_page([trace], views=[("x", [1])])
    with pytest.raises(ValueError, match="one label and one summary per trace"):
        timeline_page([trace], labels=["a", "b"])
    with pytest.raises(ValueError, match="no traces"):
        timeline_page([])


def test_without_a_memory_counter_the_page_has_no_memory(trace):
    from pipesim.traces.view import summary_figure

    bare = dataclasses.replace(trace, counters={})
    data = _page_data(timeline_page([bare]))
    assert data["traces"][0]["memory"] is None
    assert data["traces"][0]["summary"]["peak_memory_mb"] is None  # unknown, not 0: the page shows "n/a"
    bars = summary_figure([trace, trace], ["a", "b"], [summarize(trace), summarize(bare)], [0])["data"][3]
    assert bars["text"][1] == "n/a" and bars["customdata"] == [f"{bars['text'][0]} MiB", "n/a"]  # not "n/a MiB"
    # a bar of 0 with its text outside: as None, plotly drew no bar and no "n/a" (a torch run's empty panel)
    assert bars["x"][1] == 0 and bars["textposition"] == ["auto", "outside"]


def test_large_trace_page_grows_by_bytes_per_op():
    big = _trace("1f1b", 64, 1024, comm=0.0)
    assert len(big.ops) > 300_000
    data_bytes = len(timeline_page([big])) - len(get_plotlyjs())
    assert data_bytes < 3 * len(big.ops), f"{data_bytes:,} bytes of page for {len(big.ops):,} ops"


def test_pages_leave_nothing_behind_on_failure(trace, tmp_path):
    with pytest.raises(OSError):
        write_timeline_page([trace], tmp_path / "missing" / "view.html")
    with pytest.raises(OSError):
        write_html([("x", go.Figure())], tmp_path / "missing" / "view.html")
    assert list(tmp_path.iterdir()) == []

    existing = tmp_path / "view.html"
    existing.write_text("old")
    with pytest.raises(ValueError):
        write_timeline_page([trace], existing, views=[("x", [3])])
    with pytest.raises(AttributeError):
        write_html([("x", go.Figure()), ("broken", None)], existing)
    assert existing.read_text() == "old"
    assert list(tmp_path.iterdir()) == [existing]


def test_figure_page_embeds_plotly_once_with_its_headings(tmp_path):
    path = tmp_path / "figures.html"
    write_html([("one", go.Figure(go.Scatter(x=[0], y=[0]))), ("two", go.Figure(go.Bar(x=[1], y=[1])))], path,
               title="figures")
    text = path.read_text(encoding="utf-8")
    assert text.count(get_plotlyjs()) == 1 and text.count("Plotly.newPlot(") == 2
    assert "<h2>two</h2>" in text and "<title>figures</title>" in text and "pipesimHealth" in text


def test_both_writers_pages_are_what_an_html_flag_may_replace(trace, tmp_path):
    """commands/common.py `PAGE` knows a page by the global its health script sets (files.py `PAGE_HEALTH`), which
    both writers spell from that one constant; a page of someone else's is not one."""
    figures, timeline = tmp_path / "figures.html", tmp_path / "timeline.html"
    write_html([("one", go.Figure(go.Bar(x=[1], y=[1])))], figures)
    write_timeline_page([trace], timeline)
    assert PAGE.is_one(figures.read_bytes()) and PAGE.is_one(timeline.read_bytes())
    assert not PAGE.is_one(b"<html><script>window.pipesim = {}</script>notes of my own</html>")


def _replicas(trace, d):
    """`trace`'s run on d data-parallel replicas as `pipesim run` records it: p·d ranks, rank = replica·p + device,
    each replica's ops those of `trace` (a prediction draws one replica for all)."""
    p, ops = trace.num_devices, trace.ops

    def column(name, r):
        values = getattr(ops, name)
        if name == "device":
            return values + r * p
        return np.where(values >= 0, values + r * p, values) if name == "peer" else values

    replicated = type(ops)(**{f.name: np.concatenate([column(f.name, r) for r in range(d)])
                              for f in dataclasses.fields(ops)})
    return dataclasses.replace(trace, num_devices=p * d, ops=replicated,
                               counters={name: values * d for name, values in trace.counters.items()},
                               meta=dataclasses.replace(trace.meta, source="measured", peak_memory_parts=None))


def test_ranks_of_data_parallel_replicas_are_named_by_replica_and_device():
    """`run --stages 2 --data-parallel 2` records 4 ranks: the page names ranks 2 and 3 replica 1's devices 0 and 1
    (not "device 2/3") and gives the shape as p=2, d=2 (not p=4); a prediction says it draws one replica."""
    predicted = simulated(build("1f1b", 2, 4, 2, data_parallel=2), comm=0.1).trace
    measured = _replicas(predicted, 2)
    assert measured.num_devices == 4
    data = _page_data(timeline_page([predicted, measured]))
    assert data["traces"][1]["device_names"] == ["replica 0 · device 0", "replica 0 · device 1",
                                                 "replica 1 · device 0", "replica 1 · device 1"]
    assert data["traces"][1]["meta"]["shape"] == "p=2, d=2, m=4, N=2"
    assert data["traces"][0]["device_names"] == ["device 0", "device 1"]
    assert data["traces"][0]["meta"]["shape"] == "p=2, d=2 (one replica drawn), m=4, N=2"
    plain = trace_data(_trace("interleaved-1f1b", 2, 4, 2, chunks=2))
    assert plain["device_names"] == ["device 0", "device 1"] and plain["meta"]["shape"] == "p=2, v=2, m=4, N=2"


def test_summary_chart_leads_with_samples_per_s_and_says_when_mini_batches_differ(trace):
    """AvgPipe's mini-batch holds P = 2 pipelines' micro-batches: it takes longer than GPipe's yet trains more
    samples per second. The chart's first panel is samples/s; time per mini-batch says each one's size."""
    gpipe, avgpipe = _trace("gpipe", 4, 8, 2), _trace("avgpipe", 4, 8, 2)
    summaries = [summarize(gpipe), summarize(avgpipe)]
    assert summaries[1].time_per_minibatch_ms > summaries[0].time_per_minibatch_ms
    assert summaries[1].samples_per_s > summaries[0].samples_per_s
    chart = _page_data(timeline_page([gpipe, avgpipe]))["summary"]
    first, time = chart["data"][:2]
    assert first["name"].startswith("samples/s") and first["x"] == [s.samples_per_s for s in summaries]
    assert time["x"] == [s.time_per_minibatch_ms for s in summaries]
    assert time["customdata"] == [f"{s.time_per_minibatch_ms:,.3f} ms per mini-batch of {n} samples"
                                  for s, n in zip(summaries, (8, 16))]
    assert chart["titles"][:2] == [{"title": "samples/s (more is better)", "note": ""},
                                   {"title": "time per mini-batch (ms)", "note": "mini-batches differ in size"}]
    # the page writes the titles (fitSummaryTitles, wrapped to its width), the layout none: they were built twice
    assert "annotations" not in chart["layout"] and chart["layout"]["margin"]["t"] == 30
    same = _page_data(timeline_page([trace, _trace("gpipe", 4, 8, 2)]))["summary"]
    assert same["titles"][1] == {"title": "time per mini-batch (ms)", "note": ""}
    assert _page_data(timeline_page([trace]))["summary"] is None  # one trace: nothing to compare


def test_summary_bars_write_samples_per_s_as_the_tables_do(trace):
    """A 405B model's rates below 1 samples/s keep three significant digits on the page's bars, as in the commands'
    tables (`rate_text`): 0.176, 0.178 and 0.233, not 0.2 alike."""
    from pipesim.traces.view import summary_figure

    rates = (0.176, 0.178, 0.233)
    summaries = [dataclasses.replace(summarize(trace), samples_per_s=rate) for rate in rates]
    bars = summary_figure([trace] * 3, ["zb-h1", "1f1b", "zb-v"], summaries, [0])["data"][0]
    assert bars["text"] == bars["customdata"] == ["0.176", "0.178", "0.233"]


def test_a_small_runs_peak_memory_keeps_three_significant_digits_on_the_page(trace):
    """A measured CPU run peaks at 14.11 and 10.39 MiB, which the page's bars and title read "14" and "10" beside
    compare's table's 14.1 and 10.4; from 100 MiB up, whole MiB."""
    from pipesim.traces.view import summary_figure

    summaries = [dataclasses.replace(summarize(trace), peak_memory_mb=mib) for mib in (14.11, 10.39, 0.5, 1552.4)]
    bars = summary_figure([trace] * 4, ["a", "b", "c", "d"], summaries, [0])["data"][3]
    assert bars["text"] == ["14.1", "10.4", "0.50", "1,552"]
    page = _page_data(timeline_page([trace], summaries=summaries[:1]))
    assert page["traces"][0]["summary"]["peak_memory_text"] == "14.1"


@pytest.mark.parametrize("mib, text", [(0.004, "<0.01"), (0.0099, "<0.01"), (0.01, "0.01"), (0, "0")])
def test_a_peak_under_a_hundredth_of_a_mib_is_not_written_as_nothing(mib, text):
    """A 4 KiB peak read "0.00" MiB, as a trace that holds nothing; it reads "<0.01", and none reads "0"."""
    from pipesim.traces.view import mib_text

    assert mib_text(mib) == text


def test_the_pages_write_each_unit_one_way():
    """ms to the microsecond, as simulate's table (the bars wrote two decimals, the title's makespan two and its
    mini-batch three); a share to a tenth of a percent, whole from 100 % up; MiB's ties round up as the page's
    script does (1.125 MiB read 1.12 in the title and 1.13 hovered); thousands separated throughout. A share short
    of 100 % takes the decimals that keep it so, up to four (a bubble of 99.96 % read "100%")."""
    from pipesim.traces.view import mib_text, ms_text, percent_text

    assert [ms_text(ms) for ms in (33.6, 12345.6789, 0.0004)] == ["33.600", "12,345.679", "0.000"]
    assert [percent_text(f) for f in (0.073, 0, 0.9994, 0.9996, 0.9999, 1, 13.278)] == [
        "7.3%", "0.0%", "99.9%", "99.96%", "99.99%", "100%", "1,328%"]  # short of whole, not read as whole
    assert [percent_text(f, signed=True) for f in (0.367, -0.032, 15, -0.99999, -0.9999999)] == [
        "+36.7%", "-3.2%", "+1,500%", "-99.999%", "-100%"]
    assert [mib_text(mib) for mib in (1.125, 10.25, 0.375, 1288.5, 81920)] == ["1.13", "10.3", "0.38", "1,289",
                                                                                 "81,920"]


def test_a_figure_that_rounds_to_zero_has_no_sign():
    """compare's peak error of -3.7e-9 read "-0.0%", a zero error "+0.0%", a worst start error of none "+0.00":
    a figure that rounds to zero is written without a sign, signed or not, in every unit (the page's script
    alike: tests/test_browser.py's NUMBERS hold -0.0 and -0.0001)."""
    from pipesim.traces.metrics import mib_text, ms_text, percent_text, signed_text

    assert [percent_text(f, signed) for f in (-3.7e-9, -0.0, 0.0, 4e-4) for signed in (False, True)] == ["0.0%"] * 8
    assert [percent_text(-5e-4), percent_text(5e-4, signed=True)] == ["-0.1%", "+0.1%"]
    assert [ms_text(-1e-4), mib_text(-0.4), signed_text(-0.004, 2), signed_text(0.0, 2), signed_text(0.005, 2)] == [
        "0.000", "0", "0.00", "0.00", "+0.01"]


def test_the_summary_charts_figures_and_axes_follow_the_units_rules(trace):
    """Its bars write ms and shares as the title and hovers do, and its axes separate thousands ("3,000" where
    plotly wrote "3000", and "20k" past 10,000); the bubble's axis in percent."""
    from pipesim.traces.view import summary_figure

    summaries = [dataclasses.replace(summarize(trace), time_per_minibatch_ms=ms, bubble_fraction=bubble)
                 for ms, bubble in ((33.6, 0.073), (12345.6789, 0.25))]
    chart = summary_figure([trace] * 2, ["a", "b"], summaries, [0])
    assert chart["data"][1]["text"] == ["33.600", "12,345.679"]
    assert chart["data"][2]["text"] == ["7.3%", "25.0%"]
    ticks = [chart["layout"][name]["tickformat"] for name in ("xaxis", "xaxis2", "xaxis3", "xaxis4")]
    assert ticks == [",", ",", ".0%", ","]


def test_a_peak_out_of_memory_says_so_on_its_bar(trace):
    """DeepSeek-V3's ZB-V peaks at 117,205 MiB on 80 GiB H100s: its bar, the longest, read as plain as DualPipeV's
    that fits; it says OOM, as the table's memory column does, and its hover says out of memory."""
    from pipesim.traces.view import summary_figure

    @dataclasses.dataclass
    class Check:
        room_bytes: float | None
        memory: str | None = None
        out_of_memory: bool = False

    checks = [[Check(80 * 2**30)] * 4, [Check(80 * 2**30), Check(80 * 2**30, out_of_memory=True)] * 2, None]
    summaries = [dataclasses.replace(summarize(trace), peak_memory_mb=mib) for mib in (68980.2, 117205.1, 12.0)]
    bars = summary_figure([trace] * 3, ["dualpipev", "zb-v", "1f1b"], summaries, [0], checks)["data"][3]
    assert bars["text"] == ["68,980", "117,205 OOM", "12.0"]
    assert bars["customdata"] == ["68,980 MiB", "117,205 MiB, out of memory", "12.0 MiB"]


def test_summary_bars_write_their_figures_level_and_of_one_size(trace):
    """Sixteen methods' peaks of 45 MiB stood on end in plotly's default (textangle "auto": a figure that fits a
    thin bar better turned), and a short bar's figure, written outside it, was larger than those inside: every
    panel's figures are level, and one size at least SUMMARY_TEXT_PX across the chart."""
    from pipesim.traces.view import SUMMARY_TEXT_PX, summary_figure

    summaries = [summarize(trace)] * 16
    chart = summary_figure([trace] * 16, [f"m{k}" for k in range(16)], summaries, [0])
    assert [bars["textangle"] for bars in chart["data"]] == [0] * 4
    assert chart["layout"]["uniformtext"] == {"mode": "show", "minsize": SUMMARY_TEXT_PX}


@pytest.mark.parametrize("low, high, ticks", [
    (0.07, 3, [0.1, 0.2, 0.5, 1, 2]),  # 1, 2 and 5 of each decade
    (0.25, 3, [0.5, 1, 2]),
    (1.9, 4.5, [2, 3, 4]),  # 1, 2 and 5 leave one: every digit
    (2.1, 2.9, []),  # none: plotly's own ticks
])
def test_log_ticks_label_whole_numbers(low, high, ticks):
    from pipesim.traces.view import log_ticks

    assert log_ticks([math.log10(low), math.log10(high)]) == ticks


def test_error_chart_is_log_scaled_so_a_large_error_leaves_the_small_ones_readable():
    """Transfers predicted 16 times too long (+1,500 %) beside forwards within 5 % and exact backwards: a log axis
    from the decade under the smallest bar, every bar labelled, an exact kind named so (a log axis has no 0)."""
    predicted = run("1f1b", 2, 4, 2, comm=1.6).trace
    measured = run("1f1b", 2, 4, 2, fwd=1.05, comm=0.1).trace
    fig = error_figure(compare(predicted, dataclasses.replace(
        measured, meta=dataclasses.replace(measured.meta, source="measured"))))
    median = fig.data[0]
    assert fig.layout.yaxis.type == "log"
    assert list(median.x) == ["F", "B (exact)", "SEND_F", "RECV_F", "SEND_B", "RECV_B"]
    assert all("%{text}" in bar.hovertemplate for bar in fig.data)  # the bars' figures, as percent_text writes them
    assert median.y[0] == pytest.approx(100 / 21) and median.y[1] is None and median.y[3] == pytest.approx(1500)
    assert median.text[:4] == ("4.8%", "0.0%", "1,500%", "1,500%")  # whole from 100 %: at 800 px, shrunk to 7 px
    assert fig.layout.uniformtext.minsize == 10 and fig.layout.uniformtext.mode == "show"
    # the p90 bars pale, their figures not: opacity on the bars' fill, not the whole trace
    assert fig.data[1].opacity is None and fig.data[1].marker.opacity == 0.45
    assert fig.layout.yaxis.range[0] == 0 and 10 ** fig.layout.yaxis.range[1] > 1500  # 1 % up to above 1,500 %
    assert "1,000%" in fig.layout.yaxis.ticktext and "1%" in fig.layout.yaxis.ticktext


def test_error_chart_keeps_its_axis_labels_and_bars_near_a_decade():
    """Forwards 11 % too long beside transfers 1,500 % too long: from the decade under 11 %, the forwards' bar was
    0.04 of the axis' 2.4 decades, 2 px; it is at least MIN_BAR_DECADES tall, on a labelled axis. Forwards 10 %
    too long: the axis starts a decade under the bar, which starting at 10 % had no height."""
    from pipesim.traces.view import MIN_BAR_DECADES

    measured = run("1f1b", 2, 4, 2, comm=0.1).trace
    measured = dataclasses.replace(measured, meta=dataclasses.replace(measured.meta, source="measured"))
    fig = error_figure(compare(run("1f1b", 2, 4, 2, fwd=1.11, comm=1.6).trace, measured))
    assert fig.data[0].text[:3] == ("11.0%", "0.0%", "1,500%")
    low, high = fig.layout.yaxis.range
    assert math.log10(11) - low >= MIN_BAR_DECADES and 10 ** high > 1500, (low, high)
    assert fig.layout.yaxis.ticktext == ("1%", "2%", "5%", "10%", "20%", "50%", "100%", "200%", "500%", "1,000%",
                                          "2,000%")
    measured = run("1f1b", 2, 4, 2).trace
    measured = dataclasses.replace(measured, meta=dataclasses.replace(measured.meta, source="measured"))
    fig = error_figure(compare(run("1f1b", 2, 4, 2, fwd=1.1).trace, measured))
    assert fig.data[0].y[0] == pytest.approx(10) and fig.layout.yaxis.range == (0, 1.2)
    assert fig.layout.yaxis.tickvals == (1, 2, 5, 10)


def test_the_fullest_devices_memory_is_stacked_by_part_up_to_its_curve(tmp_path):
    """The page stacks the fullest device's parts (weights at the bottom): their top is that device's memory curve
    wherever a part changes, and its peak is the device's peak, a peak that lasts no time too (a moment at which the
    memory rises and falls is sampled twice: at its most, then as it stands after; zb-h1's device 0 topped out at
    1,288 MiB under its 1,296 before); a long run keeps STACK_COLUMNS samples and the peak's moment among them."""
    from pipesim.traces import read_trace
    from pipesim.traces.trace import MEMORY_PARTS
    from pipesim.traces.view import STACK_COLUMNS
    from tests.conftest import pipesim

    assert pipesim("simulate", "-s", "zb-h1", "-p", 4, "-m", 8, "--trace", tmp_path / "zb.json").code == 0
    for trace, long in ((_trace("zb-h2", 4, 8, 2), False), (_trace("1f1b", 4, 1200, 2), True),
                        (read_trace(tmp_path / "zb.json"), False)):
        parts = trace_data(trace)["memory"]["parts"]
        total = trace.counters["memory_bytes"][parts["device"]]
        assert total.values.max() == max(c.values.max() for c in trace.counters["memory_bytes"])
        times = decode_column(parts["t_us"])
        stack = [decode_column(level) for level in parts["stack"]]
        assert parts["names"][0] == "weights" and np.all(np.diff(stack, axis=0) >= 0)
        times, held_to_end = times[:-1], times[-1]  # the last sample held to the run's end
        instant = np.append(times[1:] == times[:-1], False)  # a moment's most, before what stands after it
        after = total.values[np.searchsorted(total.times_us, times, side="right") - 1]
        most = [total.values[(total.times_us == t)].max() for t in times[instant]]
        assert np.allclose(stack[-1][:-1][~instant], after[~instant] / MIB)
        assert np.allclose(stack[-1][:-1][instant], np.array(most) / MIB)
        assert stack[-1].max() == pytest.approx(total.values.max() / MIB) and held_to_end >= times[-1]
        changes = np.unique(np.concatenate([trace.counters[f"memory_bytes.{part}"][parts["device"]].times_us
                                            for part in MEMORY_PARTS]))
        if long:
            assert len(changes) > STACK_COLUMNS >= len(np.unique(times))
        else:
            assert len(np.unique(times)) == len(changes)


def test_the_memory_stack_and_its_legend_leave_out_the_parts_the_device_never_holds(trace):
    """Typed costs hold no transient tensors and replay no allocator: "a pass's transient tensors" and
    "allocator's reserve" were legend entries of layers drawn nowhere; each part named now adds to the stack."""
    parts = trace_data(trace)["memory"]["parts"]
    assert parts["names"] == ["weights", "gradients", "optimizer state", "activations", "transfer buffers"]
    stack = [decode_column(level) for level in parts["stack"]]
    assert all(np.any(above > below) for below, above in zip([np.zeros_like(stack[0]), *stack], stack))


def test_the_stacked_device_is_the_one_the_reserve_makes_fullest():
    """The caching allocator's reserve, added after the step, can make another device the fullest: the page
    stacks that device, whose parts reach its peak with the reserve, and `keep_fullest_parts` keeps its curves
    alone."""
    from pipesim.sim.caching_allocator import add_reserve

    trace = _trace("1f1b", 4, 8, 2)
    peaks = [int(curve.values.max()) for curve in trace.counters["memory_bytes"]]
    tensors_fullest, least = int(np.argmax(peaks)), int(np.argmin(peaks))
    assert tensors_fullest != least
    reserves = [0] * len(peaks)
    reserves[least] = peaks[tensors_fullest] - peaks[least] + MIB  # a reserve just over the difference
    add_reserve(trace, reserves)
    parts = trace_data(trace)["memory"]["parts"]
    assert parts["device"] == least
    assert parts["names"][-1] == "allocator's reserve"
    top = decode_column(parts["stack"][-1])
    assert top.max() == pytest.approx((peaks[least] + reserves[least]) / MIB)
    assert summarize(trace).devices[least].peak_memory_mb == pytest.approx(top.max())
    from pipesim.sim.engine import keep_fullest_parts  # (after the page's checks, which hold before it too)

    keep_fullest_parts(trace)
    assert [len(curve.times_us) > 0 for curve in trace.counters["memory_bytes.parameters"]] == [
        device == least for device in range(len(peaks))]
    assert trace_data(trace)["memory"]["parts"] == parts


def test_simulate_gpu_stacks_the_device_whose_peak_with_the_reserve_it_prints(tmp_path):
    """A GPT whose last stage's tensors peak just under the first's (its vocabulary's weights) and whose reserve
    is larger: `simulate --gpu` prints the first device's peak, the page stacks that device up to it, and the
    trace holds that device's part curves alone."""
    from pipesim.traces import read_trace
    from tests.conftest import pipesim

    code, out, err = pipesim("simulate", "--gpu", "a100-sxm-80gb", "--model", "gpt", "--layers", 8, "--width", 1024,
                             "--heads", 16, "--seq-len", 1024, "--vocab", 86000, "--dtype", "fp16", "-p", 4, "-m", 8,
                             "-s", "1f1b", "--html", tmp_path / "page.html", "--trace", tmp_path / "1f1b.json")
    assert code == 0, err
    trace = read_trace(tmp_path / "1f1b.json")
    peaks = [curve.values.max() for curve in trace.counters["memory_bytes"]]
    parts = _page_data((tmp_path / "page.html").read_text())["traces"][0]["memory"]["parts"]
    assert parts["device"] == int(np.argmax(peaks)) == 0 and f"{max(peaks) / MIB:,.0f}" in out
    assert decode_column(parts["stack"][-1]).max() == pytest.approx(max(peaks) / MIB)
    assert [len(curve.times_us) > 0 for curve in trace.counters["memory_bytes.reserve"]] == [True, False, False, False]


def test_an_estimates_activations_are_stacked_by_what_saves_them(tmp_path):
    """With a count's savers, the stack's activations are its attention's, MLP's, norms', dropout masks' and
    the rest, which still reach the device's curve; typed costs stack them whole."""
    from pipesim.traces import read_trace
    from tests.conftest import pipesim

    path = tmp_path / "gpt.json"
    code, _, err = pipesim("simulate", "--gpu", "a100-sxm-80gb", "--model", "gpt", "--layers", 4, "--width", 64,
                           "--heads", 4, "--seq-len", 32, "--vocab", 128, "--dropout", 0.1, "--dtype", "fp16",
                           "-p", 2, "-s", "1f1b", "--trace", path)
    assert code == 0, err
    trace = read_trace(path)
    parts = trace_data(trace)["memory"]["parts"]
    assert parts["names"] == ["weights", "gradients", "optimizer state", "activations: attention",
                              "activations: MLP", "activations: norms", "activations: dropout masks",
                              "activations: other", "transfer buffers", "a pass's transient tensors",
                              "allocator's reserve"]
    top = decode_column(parts["stack"][-1])
    assert top.max() == pytest.approx(trace.counters["memory_bytes"][parts["device"]].values.max() / MIB)
    assert trace_data(_trace("1f1b", 4, 8, 2))["memory"]["parts"]["names"][3] == "activations"


def test_the_page_holds_each_devices_memory_capacity_for_its_dashed_line(trace):
    """Each device's check reaches the page as the most it may hold, in MiB (None where its memory is unknown,
    and for all without checks); a list that does not match the traces' devices is refused."""
    from pipesim.sim.cluster import Cluster

    peaks = [MIB * peak for peak in (100, 200, 300, 400)]
    checks = Cluster.uniform(4, 0).memory_checks(peaks, [80 * 1024 * MIB, 80 * 1024 * MIB, None, 40 * 1024 * MIB])
    data = _page_data(timeline_page([trace, trace], memory_checks=[checks, None]))
    assert [t["memory"]["limits_mib"] for t in data["traces"]] == [[81920, 81920, None, 40960], [None] * 4]
    assert [t["memory"]["limits_shared"] for t in data["traces"]] == [[False] * 4] * 2
    with pytest.raises(ValueError, match="one check per device"):
        timeline_page([trace], memory_checks=[checks[:3]])
    with pytest.raises(ValueError, match="one list per trace"):
        timeline_page([trace, trace], memory_checks=[checks])


def test_ranks_sharing_a_gpu_are_drawn_against_what_the_others_peaks_leave_them(tmp_path):
    """Two ranks on one 1.5 GiB GPU, each peaking near 1 GiB: the table says OOM (their peaks add up), so the
    page's line for each sits at 1,536 MiB less the other's peak, under its own curve; at the GPU's 1,536 MiB
    it sat over both curves, the page saying they fit where the table said they did not."""
    from tests.conftest import pipesim

    cluster = tmp_path / "shared.json"
    cluster.write_text(json.dumps({"devices": [{"name": "r0", "compute": "gpu0", "memory_gib": 1.5},
                                               {"name": "r1", "compute": "gpu0"}]}))
    page = tmp_path / "page.html"
    code, out, err = pipesim("simulate", "-p", 2, "-m", 4, "-s", "1f1b", "--cluster", cluster,
                             "--activation-mb", 3, "--html", page)
    assert code == 0, err
    assert "OOM on devices 0, 1" in out
    memory = _page_data(page.read_text())["traces"][0]["memory"]
    mib = decode_column(memory["mib"])
    peaks = [mib[:memory["counts"][0]].max(), mib[memory["counts"][0]:].max()]
    assert memory["limits_shared"] == [True, True]
    assert memory["limits_mib"] == pytest.approx([1536 - peaks[1], 1536 - peaks[0]])
    assert all(peak > limit for peak, limit in zip(peaks, memory["limits_mib"]))


def test_simulate_gpu_page_carries_the_gpus_memory_for_each_device(tmp_path):
    """`simulate --gpu h100-sxm --html` hands the page each device's memory, what torch is given of its 80 GiB
    (79.11 GiB, 81,008.64 MiB: `pipesim gpus`), the memory the table's fits / OOM column checks against."""
    from tests.conftest import pipesim

    page = tmp_path / "page.html"
    code, _, err = pipesim("simulate", "--gpu", "h100-sxm", "--model", "gpt", "--layers", 4, "--width", 256,
                           "--heads", 4, "--seq-len", 128, "-p", 2, "-m", 4, "-s", "1f1b", "--html", page)
    assert code == 0, err
    assert _page_data(page.read_text())["traces"][0]["memory"]["limits_mib"] == [pytest.approx(81008.64)] * 2


def test_view_warns_on_stderr_of_a_trace_out_of_memory_as_simulate_does(tmp_path):
    """simulate warns on stderr where a method runs out of memory; `view` of its trace said so only in a note on
    the page, nothing in the terminal: one warning line per trace out of memory, none for one that fits."""
    from tests.conftest import pipesim

    cluster, tight, fits = (tmp_path / name for name in ("c.json", "tight.json", "fits.json"))
    cluster.write_text(json.dumps({"devices": [{"name": "r0", "compute": "gpu0", "memory_gib": 1.5},
                                               {"name": "r1", "compute": "gpu0"}]}))
    code, _, warned = pipesim("simulate", "-p", 2, "-m", 4, "-s", "1f1b", "--cluster", cluster, "--activation-mb", 3,
                              "--trace", tight)
    assert code == 0 and warned.startswith("warning: 1f1b runs out of memory: "), warned
    assert pipesim("simulate", "-p", 2, "-m", 4, "-s", "1f1b", "--trace", fits).code == 0
    code, _, err = pipesim("view", fits, tight, "--html", tmp_path / "page.html")
    assert (code, err) == (0, warned.replace("1f1b", "the predicted 1f1b (tight.json)", 1))


def test_view_of_a_saved_trace_draws_each_devices_memory_as_simulates_page_did(tmp_path):
    """`pipesim view` of simulate's --trace drew no device's memory: no dashed line, no OOM on the bar, no warning,
    the trace not recording what simulate checked. It records it now: two ranks on one GPU, out of memory together,
    get from the saved trace the lines simulate's page drew (each at the GPU less the other's peak) and the
    warning; the same trace without its checks (written before) still draws, without them."""
    from tests.conftest import pipesim

    cluster, trace, live, viewed = (tmp_path / name for name in ("c.json", "t.json", "live.html", "viewed.html"))
    cluster.write_text(json.dumps({"devices": [{"name": "r0", "compute": "gpu0", "memory_gib": 1.5},
                                               {"name": "r1", "compute": "gpu0"}]}))
    code, _, err = pipesim("simulate", "-p", 2, "-m", 4, "-s", "1f1b", "--cluster", cluster, "--activation-mb", 3,
                           "--html", live, "--trace", trace)
    assert code == 0, err
    assert pipesim("view", trace, "--html", viewed).code == 0
    drawn, shown = (_page_data(page.read_text()) for page in (live, viewed))
    assert shown["traces"][0]["memory"]["limits_mib"] == drawn["traces"][0]["memory"]["limits_mib"]
    assert shown["traces"][0]["memory"]["limits_shared"] == [True, True]
    assert all(limit is not None for limit in shown["traces"][0]["memory"]["limits_mib"])
    assert shown["notes"] == ["the predicted " + note for note in drawn["notes"]]
    assert shown["notes"][0].startswith("the predicted 1f1b runs out of memory: devices 0 and 1 share compute gpu0")
    doc = json.loads(trace.read_text())
    del doc["pipesim"]["meta"]["memory_checks"]
    trace.write_text(json.dumps(doc))
    assert pipesim("view", trace, "--html", viewed).code == 0
    old = _page_data(viewed.read_text())
    assert old["traces"][0]["memory"]["limits_mib"] == [None, None] and old["notes"] == []


def test_view_tells_traces_of_one_name_apart_by_their_folders_and_refuses_a_file_given_twice(tmp_path):
    """Two runs' a.json from two folders were both labelled "1f1b, predicted (a.json)", and the summary chart drew
    their two bars as one of twice the length (266.7 + 266.7 samples/s): so was one file given twice. Each is
    named by its folder and name alone: its whole path took 40 % of a 1,400 px page's lanes."""
    from tests.conftest import pipesim

    for folder, fwd in (("d1", 1), ("d2", 2)):
        (tmp_path / folder).mkdir()
        assert pipesim("simulate", "-s", "1f1b", "-p", 2, "-m", 4, "--fwd", fwd,
                       "--trace", tmp_path / folder / "a.json").code == 0
    first, second, page = tmp_path / "d1" / "a.json", tmp_path / "d2" / "a.json", tmp_path / "v.html"
    assert pipesim("view", first, second, "--html", page).code == 0
    assert [t["label"] for t in _page_data(page.read_text())["traces"]] == [
        "1f1b, predicted (d1/a.json)", "1f1b, predicted (d2/a.json)"]
    page.unlink()
    code, _, err = pipesim("view", first, tmp_path / "d1" / ".." / "d1" / "a.json", "--html", page)
    assert code == 2 and err.strip().splitlines() == [f"error: TRACE: {tmp_path}/d1/../d1/a.json is given twice; "
                                                      "give each trace once"]
    assert not page.exists()


def test_a_trace_whose_fields_name_no_device_or_rank_of_its_run_is_refused_and_an_empty_one_is_not_drawn(tmp_path):
    """Hand-edited traces that read silently: memory counters on pid 77 of a 2-device run drew every device's memory
    as n/a; failed_rank 7 of a 2-rank run read "rank 7 failed"; a complete trace of no ops drew an empty "0 ops"
    page (compare refused it)."""
    from tests.conftest import pipesim

    source = tmp_path / "t.json"
    assert pipesim("simulate", "-s", "1f1b", "-p", 2, "-m", 2, "-n", 2, "--trace", source).code == 0
    document = json.loads(source.read_text())

    def edited(name: str, edit) -> Path:
        copy = json.loads(json.dumps(document))
        edit(copy)
        (path := tmp_path / name).write_text(json.dumps(copy))
        return path

    def counters_on_77(doc):
        for event in doc["traceEvents"]:
            if event.get("ph") == "C":
                event["pid"] = 77

    def rank_7(doc):
        doc["pipesim"]["meta"].update(failed_rank=7, complete=False)

    def no_ops(doc):
        doc["traceEvents"] = [event for event in doc["traceEvents"] if event.get("ph") != "X"]

    for name, edit, line in [
        ("counters.json", counters_on_77, "trace {}: counter 'memory_bytes': pid 77 is not one of the trace's 2 "
                                          "devices (0..1)"),
        ("rank.json", rank_7, "trace {}: pipesim header: meta.failed_rank: give a whole number from 0 to 1, one of "
                              "the run's 2 ranks (got 7)"),
        ("empty.json", no_ops, "trace {} holds no ops: nothing to draw (a run that stopped before its first op is "
                               "marked incomplete)"),
    ]:
        path = edited(name, edit)
        code, out, err = pipesim("view", path, "--html", tmp_path / "v.html")
        assert (code, out, err) == (2, "", f"error: {line.format(path)}\n")
        assert not (tmp_path / "v.html").exists()
