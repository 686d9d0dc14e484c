"""The study's table and page as a reader sees them: a diverged run (stopped on a non-finite loss, or a finite
loss that blew up) is named as such, never printed as a loss or allowed to stretch an axis; every panel has its
own labelled axis; accuracy is drawn against a numeric axis."""

from __future__ import annotations

import math

import pytest

from pipesim.study.results import StudyFile, load_results
from tests.conftest import pipesim
from tests.helpers import TINY_SETTING as TINY


def _record(method, optimizer, seed, losses, status="ok", source=None):
    from pipesim.study.results import RunRecord, StageRecord

    stages = [] if status != "ok" else [StageRecord(stage=k, forward_staleness=0, backward_staleness=0,
                                                    prediction_distance=None, backward_prediction_distance=None)
                                        for k in range(2)]
    return RunRecord(method=method, source=source, primary=True, optimizer=optimizer,
                     lr={"momentum": 0.05, "adam": 0.002}[optimizer], seed=seed, status=status,
                     samples_per_minibatch=8, losses=losses if status == "ok" else [None] * len(losses),
                     heldout_loss=None if status != "ok" else losses[-1],
                     heldout_accuracy=None if status != "ok" else 0.5, stages=stages, wall_s=1.0)


@pytest.fixture
def blown_up(tmp_path):
    """A study where, under momentum, one gpipe seed's loss blew up to 1e16 while staying finite, and the
    executor stopped pipedream's only seed on a non-finite loss; under adam both trained."""
    falling = [2.3 * 0.9 ** b for b in range(20)]
    blowing_up = [2.3 * 10 ** b for b in range(17)] + [3.4e16] * 3
    runs = [_record("gpipe", "momentum", 0, falling), _record("gpipe", "momentum", 1, blowing_up),
            _record("pipedream", "momentum", 0, falling, status="diverged"),
            _record("gpipe", "adam", 0, falling), _record("pipedream", "adam", 0, [v * 1.1 for v in falling])]
    path = tmp_path / "blown.json"
    StudyFile(format_version=1, setting=TINY.as_dict(), runs=runs).save(path)
    return path


def test_a_loss_that_blew_up_counts_as_diverged_and_prints_as_such(blown_up):
    from pipesim.study.results import recorded_arms, summarize

    saved = load_results(blown_up)
    assert [r.diverged for r in saved.runs] == [False, True, True, False, False]
    by_arm = {(s.arm.label, s.optimizer): s for s in summarize(saved, *recorded_arms(saved))}
    gpipe, pipedream = by_arm["gpipe", "momentum"], by_arm["pipedream", "momentum"]
    assert gpipe.diverged == 1 and gpipe.final_loss.n == 1 and gpipe.final_loss.mean < 1  # the blown-up seed left out
    assert pipedream.final_loss.text() == "diverged"
    code, out, err = pipesim("study", "--plot-only", "--results", blown_up, "--html", blown_up.with_suffix(".html"))
    assert code == 0, err
    assert "e+16" not in out and "3400" not in out and "diverged" in out and "1/2" in out and "1/1" in out


def test_a_diverged_seed_is_left_out_of_every_figure_and_the_caption_says_so(blown_up):
    """gpipe's blown-up momentum seed (status "ok", its loss 10x its first) kept its held-out scores: they were
    averaged into its accuracy (the committed study's pipeoptim (code) read 53.9 ± 37.8, of 76.9, 10.3 and 74.4)
    while its loss covered the other seeds, and the caption said "over 2 seeds" for both."""
    from pipesim.study.results import recorded_arms, summarize

    saved = load_results(blown_up)
    saved.runs[1] = saved.runs[1].model_copy(update={"heldout_accuracy": 0.1, "heldout_loss": 9.0})
    saved.save(blown_up)
    gpipe = {(s.arm.label, s.optimizer): s for s in summarize(saved, *recorded_arms(saved))}["gpipe", "momentum"]
    assert [(f.n, f.mean) for f in (gpipe.heldout_accuracy, gpipe.heldout_loss)] == [(1, 0.5), (1, 2.3 * 0.9 ** 19)]
    code, out, err = pipesim("study", "--plot-only", "--results", blown_up, "--html", blown_up.with_suffix(".html"))
    assert code == 0, err
    (row,) = [line.split() for line in out.splitlines() if line.split()[:1] == ["gpipe"] and "1/2" in line]
    assert row[1:4] == ["50.0", gpipe.final_loss.text(), "1/2"]  # one seed: the mean alone, in every column
    assert "mean ± std over 2 seeds less those that diverged; div.: seeds that diverged (the loss went non-finite, " \
           "or ended 10x its first), left out of every figure" in " ".join(out.split())


def test_the_loss_panels_each_have_a_labelled_log_axis_clipped_to_the_runs_that_did_not_diverge(blown_up):
    from pipesim.study.page import loss_figure
    from pipesim.study.results import recorded_arms, summarize

    saved = load_results(blown_up)
    arms, optimizers, seeds = recorded_arms(saved)
    fig = loss_figure(summarize(saved, arms, optimizers, seeds), list(optimizers))
    layout = fig.layout
    for axis in (layout.yaxis, layout.yaxis2):
        assert axis.type == "log" and axis.showticklabels is not False and axis.matches is None
        low, high = axis.range
        assert math.log10(0.2) < low < high < math.log10(3)  # the falling curves' span, not 1e16
        # each label a whole number, 1, 2 and 5 of a decade: plotly's own read "1, 9, 8, ..., 2" down the axis
        assert [float(text) for text in axis.ticktext] == list(axis.tickvals) == [0.5, 1, 2]
    # every arm is in the legend, also one that drew no curve under the first optimizer; a diverged one says so
    legend = {t.legendgroup: t.name for t in fig.data if t.showlegend is not False}
    assert legend == {"gpipe": "gpipe (diverged: momentum 1 of 2)",
                      "pipedream": "pipedream (diverged: momentum 1 of 1)"}
    # the blown-up seed is an × at the top of its panel, where it left the range
    (cross,) = [t for t in fig.data if t.mode == "markers"]
    assert cross.marker.symbol == "x" and cross.xaxis == "x" and cross.customdata[0] == "3.4e+16"
    assert math.log10(cross.y[0]) <= layout.yaxis.range[1]
    assert any("pipedream 1/1" in a.text for a in layout.annotations)
    # the legend in rows under the panels (beside them at 800 px, 12 arms' names left each panel 110 px), the
    # figure taller by its rows, so the panels keep their height
    assert layout.legend.orientation == "h" and layout.legend.y < 0 and layout.legend.yanchor == "top"
    assert layout.height - layout.margin.t - layout.margin.b == 390


def test_an_arm_whose_every_seed_diverged_under_one_optimizer_is_in_the_legend_by_its_line(tmp_path):
    """XPipe's one momentum seed blew up (an × in that panel, no line) and its Adam seed trained: the legend names
    it by its Adam line, where its × stood for it and the line was no arm's to the reader."""
    from pipesim.study.page import loss_figure
    from pipesim.study.results import recorded_arms, summarize

    falling = [2.3 * 0.9 ** b for b in range(20)]
    path = tmp_path / "one-blew-up.json"
    StudyFile(format_version=1, setting=TINY.as_dict(),
              runs=[_record("xpipe", "momentum", 0, [2.3 * 10 ** b for b in range(20)]),
                    _record("xpipe", "adam", 0, falling)]).save(path)
    saved = load_results(path)
    arms, optimizers, seeds = recorded_arms(saved)
    fig = loss_figure(summarize(saved, arms, optimizers, seeds), list(optimizers))
    (entry,) = [t for t in fig.data if t.showlegend]
    assert entry.mode == "lines" and entry.xaxis == "x2" and entry.name == "xpipe (diverged: momentum 1 of 1)"
    assert [t.mode for t in fig.data if t.xaxis == "x"] == ["markers"]  # the × is still drawn
    assert entry.legendrank == 0  # ranked as the arms run (by drawing order, one named by its Adam line came last)


def test_accuracy_is_drawn_against_a_numeric_axis(blown_up):
    """Untimed, there is no throughput to place arms by: accuracy is the numeric axis and the arms are named
    down the side, rather than method names on a throughput axis."""
    from pipesim.study.page import accuracy_figure
    from pipesim.study.results import TimingRecord, recorded_arms, summarize

    saved = load_results(blown_up)
    arms, optimizers, seeds = recorded_arms(saved)
    untimed = accuracy_figure(summarize(saved, arms, optimizers, seeds), list(optimizers))
    assert all(isinstance(x, float) and 0 <= x <= 1 for t in untimed.data for x in t.x)
    assert untimed.layout.xaxis.tickformat == ".0%" and untimed.layout.yaxis.type == "category"
    # the marker key under the accuracy axis: along a few arms' height it was cut off
    assert untimed.layout.yaxis.title.text == "arm" and "circle: momentum" in untimed.layout.xaxis.title.text
    # pipedream's one momentum seed diverged: its missing marker is named over the chart
    assert [a.text for a in untimed.layout.annotations] == ["no accuracy, every seed diverged: pipedream (momentum)"]
    saved.timings = [TimingRecord(method=m, source=None, optimizer="adam", lr=0.002, seed=0, repeats=1,
                                  measured_samples_per_s=s, measured_spread=0, predicted_samples_per_s=2 * s, ranks=2)
                     for m, s in (("gpipe", 1500.0), ("pipedream", 1800.0))]
    timed = accuracy_figure(summarize(saved, arms, optimizers, seeds), list(optimizers))
    assert sorted({x for t in timed.data for x in t.x}) == [1500.0, 1800.0]
    assert "samples/s" in timed.layout.xaxis.title.text and timed.layout.yaxis.tickformat == ".0%"
    assert timed.layout.legend.orientation == "h" and timed.layout.legend.y < 0  # under the chart, as the loss's


def test_an_arm_whose_first_seed_diverged_shows_what_its_other_seeds_measured(tmp_path):
    """A diverged seed measured no staleness; the arm's table row takes its stages from a seed that did."""
    from pipesim.study.results import recorded_arms, summarize

    falling = [2.3 * 0.9 ** b for b in range(20)]
    path = tmp_path / "first-diverged.json"
    StudyFile(format_version=1, setting=TINY.as_dict(),
              runs=[_record("pipedream", "momentum", 0, falling, status="diverged"),
                    _record("pipedream", "momentum", 1, falling)]).save(path)
    saved = load_results(path)
    (arm,) = summarize(saved, *recorded_arms(saved))
    assert arm.diverged == 1 and arm.per_stage("forward_staleness") == "0,0"


def test_a_study_of_one_seed_shows_no_spread(tmp_path):
    """`study --seeds 1` printed "± 0.0" and "over 1 seeds"."""
    import json

    from pipesim.study.page import accuracy_figure
    from pipesim.study.results import recorded_arms, summarize

    falling = [2.3 * 0.9 ** b for b in range(20)]
    path = tmp_path / "one-seed.json"
    StudyFile(format_version=1, setting=TINY.as_dict(),
              runs=[_record(method, "momentum", 0, falling) for method in ("gpipe", "pipedream")]).save(path)
    code, out, err = pipesim("study", "--plot-only", "--results", path, "--html", tmp_path / "s.html")
    assert code == 0, err
    words = " ".join(out.split())
    assert "±" not in out and "1 seeds" not in words and "of one seed (no spread: give --seeds 2 or more)" in words
    code, out, err = pipesim("study", "--plot-only", "--results", path, "--html", tmp_path / "s.html", "--json")
    assert code == 0 and {arm["heldout_accuracy"]["std"] for arm in json.loads(out)["arms"]} == {None}
    saved = load_results(path)
    figure = accuracy_figure(summarize(saved, *recorded_arms(saved)), ["momentum"])
    assert all(trace.error_x.array is None for trace in figure.data)
    assert all("(one seed)" in trace.hovertemplate and "±" not in trace.hovertemplate for trace in figure.data)


def test_the_stages_table_groups_a_methods_arms(tmp_path):
    """"pipeoptim", "pipeoptim (code)" and "xpipe" read as three rows alike: the table names a method once, on its
    first arm's row, each arm's source of s in a column of its own, and a method's rows share one fill."""
    from pipesim.study.page import stages_figure
    from pipesim.study.results import recorded_arms, summarize

    falling = [2.3 * 0.9 ** b for b in range(20)]
    path = tmp_path / "sources.json"
    runs = [_record("pipeoptim", "momentum", 0, falling, source="paper"),
            _record("pipeoptim", "momentum", 0, falling, source="code"),
            _record("xpipe", "momentum", 0, falling, source="paper"), _record("gpipe", "momentum", 0, falling)]
    runs[1].primary = False
    StudyFile(format_version=1, setting=TINY.as_dict(), runs=runs).save(path)
    saved = load_results(path)
    (table,) = stages_figure(summarize(saved, *recorded_arms(saved))).data
    method, source = table.cells.values[:2]
    assert list(method) == ["pipeoptim", "", "xpipe", "gpipe"] and list(source) == ["paper", "code", "paper", "-"]
    fills = table.cells.fill.color[0]
    assert fills[0] == fills[1] != fills[2] != fills[3], fills


def test_a_study_of_one_seed_where_an_arm_diverged_says_one_seed_on_its_accuracy_axis(blown_up):
    """`study --seeds 1` where XPipe's momentum seed diverged: the accuracy axis said "mean ± std over seeds", the
    diverged arm's spread (no seed) counted as one."""
    from pipesim.study.page import accuracy_figure
    from pipesim.study.results import recorded_arms, summarize

    saved = load_results(blown_up)
    saved.runs = [run for run in saved.runs if run.seed == 0]
    arms, optimizers, seeds = recorded_arms(saved)
    figure = accuracy_figure(summarize(saved, arms, optimizers, seeds), list(optimizers))
    assert figure.layout.xaxis.title.text.startswith("held-out accuracy (one seed;"), figure.layout.xaxis.title.text


def test_the_study_page_writes_rates_and_samples_as_the_other_pages_do(blown_up):
    """A rate of 0.176 samples/s read "0 samples/s measured" (",.0f"), where the tables and the timeline's summary
    write "0.176" (`rate_text`); samples and samples/s ticks separate thousands ("1,500" where plotly wrote
    "1500", "20k" past 10,000)."""
    from pipesim.study.page import accuracy_figure, loss_figure
    from pipesim.study.results import TimingRecord, recorded_arms, summarize

    saved = load_results(blown_up)
    arms, optimizers, seeds = recorded_arms(saved)
    saved.timings = [TimingRecord(method=m, source=None, optimizer="adam", lr=0.002, seed=0, repeats=1,
                                  measured_samples_per_s=s, measured_spread=0, predicted_samples_per_s=1500.0, ranks=2)
                     for m, s in (("gpipe", 0.176), ("pipedream", 1800.0))]
    summaries = summarize(saved, arms, optimizers, seeds)
    timed = accuracy_figure(summaries, list(optimizers))
    hovers = [t.hovertemplate for t in timed.data]
    assert any("accuracy 50.0% (one seed)<br>0.176 samples/s measured, 1,500.0 predicted" in h for h in hovers), hovers
    assert timed.layout.xaxis.tickformat == ","
    loss = loss_figure(summaries, list(optimizers))
    assert [loss.layout[name].tickformat for name in ("xaxis", "xaxis2")] == [",", ","]  # a panel per optimizer
    # one seed's 50 % each: plotly padded it to an axis from -50 % to 150 %
    assert timed.layout.yaxis.autorangeoptions.minallowed == 0 and timed.layout.yaxis.autorangeoptions.maxallowed == 1


def test_every_chart_of_the_study_page_starts_under_its_mode_bar(blown_up):
    """The accuracy chart's plot began 20 px under its top, where plotly's mode bar (25 px) lay over its markers at
    100 %; at 800 px the bar touched the loss panels' titles. Each plot or table starts under the bar, and a line of
    text over a plot (a panel's title, the accuracy's note of diverged arms) under the bar too."""
    from pipesim.study.page import LINE_OVER_PX, accuracy_figure, loss_figure, stages_figure
    from pipesim.study.results import TimingRecord, recorded_arms, summarize
    from pipesim.traces.view import MODEBAR_BOTTOM_PX

    saved = load_results(blown_up)
    arms, optimizers, seeds = recorded_arms(saved)
    untimed = summarize(saved, arms, optimizers, seeds)
    saved.timings = [TimingRecord(method=m, source=None, optimizer="adam", lr=0.002, seed=0, repeats=1,
                                  measured_samples_per_s=s, measured_spread=0, predicted_samples_per_s=s, ranks=2)
                     for m, s in (("gpipe", 1500.0), ("pipedream", 1800.0))]
    timed = summarize(saved, arms, optimizers, seeds)
    figures = [loss_figure(timed, list(optimizers)), accuracy_figure(timed, list(optimizers)),
               accuracy_figure(untimed, list(optimizers)), stages_figure(timed)]
    for fig in figures:
        over = [a for a in fig.layout.annotations if a.yref == "paper" and a.y == 1 and a.yanchor == "bottom"]
        assert fig.layout.margin.t >= MODEBAR_BOTTOM_PX + (LINE_OVER_PX if over else 0), fig.layout.margin
    assert any(a.text.startswith("no accuracy") for a in figures[1].layout.annotations)  # a line over the plot


def test_the_loss_hovers_write_a_loss_as_the_studys_table_and_runs_table_do(blown_up):
    """A loss is written one way (metrics.loss_text, as `run`'s table writes it): the page hovered its curves
    with plotly's ".3f" and a diverged seed's last loss with ".3g" ("3.40e+16"), where the table wrote ".3f"
    and `run` four significant digits."""
    from pipesim.study.page import loss_figure
    from pipesim.study.results import recorded_arms, summarize
    from pipesim.traces.metrics import loss_text

    saved = load_results(blown_up)
    arms, optimizers, seeds = recorded_arms(saved)
    summaries = summarize(saved, arms, optimizers, seeds)
    assert summaries[0].final_loss.text() == loss_text(summaries[0].final_loss.mean)  # the table's figure
    traces = loss_figure(summaries, list(optimizers)).data
    lines = [t for t in traces if t.mode == "lines"]
    assert lines and all(t.hovertemplate.split("<br>")[-1].startswith("loss %{customdata}") for t in lines)
    assert all(list(t.customdata) == [loss_text(y) for y in t.y] for t in lines)
    (left,) = [t for t in traces if t.mode == "markers"]
    assert "ended at %{customdata}<" in left.hovertemplate and left.customdata[0].endswith("e+16")
    assert left.customdata[0] == loss_text(float(left.customdata[0]))
