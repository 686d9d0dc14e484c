"""What a new user sees on an interactive terminal: nothing that takes seconds leaves the screen blank."""

import json
import re
from io import StringIO

import pytest
from rich.console import Console

# imported before any test stands a terminal in for common.stderr: a module first imported under the stand-in
# would keep it as its `stderr` for every later test
from pipesim import cli  # noqa: F401
from pipesim.commands import (  # noqa: F401
    calibrate,
    common,
    compare,
    count,
    estimate,
    run,
    simulate,
    study,
    sweep,
    tune,
    view,
)

from .conftest import pipesim
from .helpers import GPT_CPU


def _terminal(monkeypatch) -> StringIO:
    """stderr as an 80-column interactive terminal, its output kept."""
    screen = StringIO()
    monkeypatch.setattr(common, "stderr", Console(file=screen, force_terminal=True, width=80))
    return screen


def test_one_simulation_alone_shows_a_progress_bar_on_a_terminal(monkeypatch):
    """`simulate -s 1f1b -p 128 -m 16384` took half a minute with nothing on the screen: a bar was drawn for two
    schedules or more only."""
    screen = _terminal(monkeypatch)
    assert list(common.progress(["1f1b"], quiet=False)) == ["1f1b"]
    assert "simulating" in screen.getvalue()


def test_a_long_phase_wraps_its_words_and_keeps_the_bars_figures_whole_at_80_columns(monkeypatch):
    """calibrate's transient bar at 80 columns beside a long phase cut its elapsed time to "0:0…"; its
    description wraps between words instead (common.description_column, run's and study's bars' too)."""
    screen = _terminal(monkeypatch)
    monkeypatch.setattr(calibrate, "stderr", common.stderr)
    with calibrate._phases("calibrating mlp") as (advance, _):
        advance("timing the all-reduce beside computing ranks (4.135 MiB)")
    drawn = screen.getvalue()
    assert "0:00:0" in drawn and "(4.135" in drawn and "…" not in drawn, drawn


def _rows(screen: StringIO) -> list[str]:
    """The rows an 80-column terminal shows of what was written: the escape codes and a redrawn bar's returns out."""
    plain = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", screen.getvalue())
    return [row for line in plain.split("\n") for row in line.split("\r")]


def test_a_refusal_and_a_calibration_phase_wrap_between_words_on_an_80_column_terminal(monkeypatch):
    """At 80 columns the terminal broke calibrate's refusal "use --de" / "vice cpu" and its phase line "... 1.3" /
    "s", and the transient bar redrawn under a phase line wider than the terminal overwrote the rows it did not
    count (one of "timing the all-reduce beside computing ranks"' lost its "U time); --fresh measures again)").
    Each is wrapped between words at the terminal's width; piped, it stays one line (the refusal tests)."""
    screen = _terminal(monkeypatch)
    monkeypatch.setattr(calibrate, "stderr", common.stderr)
    refusal = "no CUDA device: torch 2.13.0+cpu (a CPU-only build) sees no GPU; use --device cpu"
    with pytest.raises(SystemExit):
        common.fail(refusal)
    with calibrate._phases("calibrating mlp") as (_, phase), phase(
            "running the calibrated model (2 ranks, 8 micro-batches, 5 mini-batches)"):
        pass
    rows = [row.rstrip() for row in _rows(screen) if row.strip()]
    assert max(map(len, rows)) <= 80, rows
    assert " ".join(rows[:2]) == f"error: {refusal}", rows
    ran = next(k for k, row in enumerate(rows) if row.startswith("running the calibrated model"))
    assert re.fullmatch(r"\d+\.\d s", rows[ran + 1]), rows


def test_a_counted_bar_at_80_columns_keeps_a_studys_description_on_one_line():
    """run's and study's bars: rich's bar of 40 characters left study's "training pipedream, momentum, seed 0" 23
    at 80 columns, and it wrapped after "seed"; a description too long for the line still wraps, its figures whole."""
    from rich.progress import Progress

    screen = StringIO()
    bar = Progress(*common.counted_bar_columns(), console=Console(file=screen, width=80))
    for description in ("training pipedream, momentum, seed 0",
                        "calibrating the setting: timing the all-reduce beside computing ranks (4.135 MiB)"):
        bar.add_task(description, total=8, completed=3)
    bar.console.print(bar.make_tasks_table(bar.tasks))
    lines = [line.rstrip() for line in screen.getvalue().splitlines()]
    counted = re.compile(r".* 3/8 \d+:\d\d:\d\d")  # the count and the elapsed time, whole
    assert lines[0].startswith("training pipedream, momentum, seed 0 ") and counted.fullmatch(lines[0])
    assert lines[1].startswith("calibrating the setting:") and counted.fullmatch(lines[1])
    assert "(4.135 MiB)" in lines[2] and "…" not in screen.getvalue()


def test_progress_stays_off_when_quiet(monkeypatch):
    screen = _terminal(monkeypatch)
    assert list(common.progress(["1f1b", "zb-h1"], quiet=True)) == ["1f1b", "zb-h1"]
    assert screen.getvalue() == ""


def test_a_status_says_what_runs_on_a_terminal_and_nothing_when_quiet(monkeypatch):
    screen = _terminal(monkeypatch)
    with common.transient_status("counting", quiet=True):
        pass
    assert screen.getvalue() == ""
    with common.transient_status("counting", quiet=False):
        pass
    assert "counting" in screen.getvalue()


@pytest.mark.parametrize("command", [["simulate", "-s", "1f1b"], ["estimate", "--out", "gpt.json"],
                                     ["tune", "-D", "8"], ["sweep", "-s", "1f1b", "-p", "2", "--out", "x.csv"]])
def test_counting_a_model_for_a_gpu_says_so_on_a_terminal(monkeypatch, tmp_path, command):
    """A first --gpu count imports torch and counts on the meta device, 10 s and more on a busy host, where the
    terminal stayed blank (tune's and sweep's 4-5 s, a new user's pass found): a status names it while it runs."""
    screen = _terminal(monkeypatch)

    def stopped(*_):  # the command's last step: what the screen shows by its end was shown while it counted
        raise common.InputError("stopped at the count")

    for module in (simulate, estimate, tune, sweep):
        monkeypatch.setattr(module, "count_what_if", stopped)
    monkeypatch.chdir(tmp_path)
    code, _, _ = pipesim(*command, "--gpu", "h100-sxm", "--model", "gpt")
    assert code == 2 and "stopped at the count" in screen.getvalue()
    assert common.COUNTING_MODEL in screen.getvalue()


@pytest.mark.parametrize("command", [["calibrate", "--stages", "2", "--out", "p.json", "--no-runtime",
                                      "--no-contention", "--no-links"],
                                     ["run", "-s", "1f1b", "--stages", "2"],
                                     ["study", "--seeds", "1", "-s", "1f1b", "--no-timing", "--results", "s.json"]])
def test_a_command_that_trains_says_it_imports_torch_on_a_terminal(monkeypatch, tmp_path, command):
    """calibrate, run and study import torch and build the model before their bars: 3-6 s of a blank terminal (a
    new user's pass); a status says so from the start, torch's import itself included (`require_model`)."""
    screen = _terminal(monkeypatch)

    def stopped(*_):
        raise common.InputError("stopped at torch's import")

    for module in (calibrate, run, study):
        monkeypatch.setattr(module, "require_model", stopped)
    monkeypatch.chdir(tmp_path)
    code, _, _ = pipesim(*command, "--model", "mlp")
    assert code == 2 and "stopped at torch's import" in screen.getvalue()
    assert common.STARTING_STATUS in screen.getvalue()


def test_count_says_what_it_counts_on_a_terminal(monkeypatch):
    """`pipesim count` imports torch and counts, 6 s for the small gpt on a busy host, with a blank terminal."""
    from pipesim.workload import count as workload_count

    screen = _terminal(monkeypatch)

    def counted(*_):
        raise common.InputError("stopped at the count")

    monkeypatch.setattr(workload_count, "count_built", counted)
    code, _, _ = pipesim("count", "--model", "gpt")
    assert code == 2 and "stopped at the count" in screen.getvalue()
    assert "counting the model on torch's meta device" in screen.getvalue()


@pytest.mark.parametrize("command", [["run", "--model", "mlp"], ["export", "--format", "torch-csv"]])
def test_a_second_method_where_one_runs_is_refused(tmp_path, monkeypatch, command):
    """`run -s 1f1b -s xpipe` ran xpipe alone, exit 0: click keeps an option's last value."""
    monkeypatch.chdir(tmp_path)
    code, out, err = pipesim(*command, "-s", "1f1b", "-s", "xpipe")
    assert code == 2 and out == "" and not list(tmp_path.iterdir())
    assert err.startswith("error: --schedule: given 2 times") and len(err.strip().splitlines()) == 1, err


def test_methods_compared_and_a_flag_given_again_still_run():
    code, out, _ = pipesim("simulate", "-s", "1f1b", "-s", "zb-h1", "-p", "2", "-m", "8", "--json", "--json")
    assert code == 0 and '"zb-h1"' in out and '"1f1b"' in out


@pytest.mark.parametrize("command,flag", [
    (["simulate", "-s", "1f1b", "-p", "2", "-p", "4"], "--stages"),
    (["simulate", "-s", "1f1b", "--fwd", "1", "--fwd", "2"], "--fwd"),
    (["tune", "--devices", "8", "--devices", "16"], "--devices"),
    (["study", "--layers", "4", "--layers", "8"], "--layers"),
])
def test_a_value_given_twice_where_one_is_taken_is_refused(tmp_path, monkeypatch, command, flag):
    """`simulate -p 2 -p 4` simulated p = 4 alone, exit 0: click keeps an option's last value, where the user
    asked for both."""
    monkeypatch.chdir(tmp_path)
    code, out, err = pipesim(*command)
    assert code == 2 and out == "" and not list(tmp_path.iterdir())
    assert err.startswith(f"error: {flag}: given 2 times") and len(err.strip().splitlines()) == 1, err


def test_a_sweep_axis_given_again_adds_its_values(tmp_path):
    """`sweep -s 1f1b -s zb-h1` swept zb-h1 alone and `-p 2 -p 4` p = 4 alone, exit 0."""
    out = tmp_path / "r.csv"
    code, _, err = pipesim("sweep", "-s", "1f1b", "-s", "zb-h1", "-p", "2", "-p", "4", "-j", "1", "--out", out)
    assert code == 0, err
    rows = out.read_text().splitlines()[1:]
    assert sorted((row.split(",")[0], row.split(",")[1]) for row in rows) == [
        ("1f1b", "2"), ("1f1b", "4"), ("zb-h1", "2"), ("zb-h1", "4")], rows


def test_a_link_segment_whose_times_did_not_grow_reads_so_not_as_a_bandwidth(capsys):
    """calibrate printed "from 0 B: 562.1 us + 1e+06 GB/s" for a first segment fitted at the ceiling (its times
    flat or falling with size on a busy host), which reads as a measured bandwidth."""
    from pipesim.commands.calibrate import _print_profile
    from pipesim.profiles.linkfit import MAX_BYTES_PER_MS
    from pipesim.profiles.schema import load_profile

    profile = load_profile(GPT_CPU)
    first, *rest = profile.link.segments
    flat = first.model_copy(update={"bytes_per_ms": MAX_BYTES_PER_MS})
    _print_profile(profile.model_copy(update={"link": profile.link.model_copy(update={"segments": [flat, *rest]})}))
    printed = " ".join(capsys.readouterr().out.split())
    assert f"from 0 B: {first.latency_ms * 1e3:.1f} us at any size (its times did not grow);" in printed
    assert "1e+06 GB/s" not in printed and f"{rest[0].bytes_per_ms / 1e6:.3g} GB/s" in printed


def test_tunes_summary_counts_the_configurations_its_progress_line_counted():
    """The progress line said "searching 73 configurations", the summary "searched 72": one shape was refused once
    built, which the summary counted among the shapes refused before any search."""
    from pipesim.commands.tune import search_summary
    from pipesim.planning.tune import Stats

    stats = Stats(shapes=528, refused=456, stale=16, over_memory_floor=10, pruned=16, simulated=30,
                  simulated_over_limits=6, simulated_leanest=0, seconds=3.5, refused_built=1)
    summary = search_summary(stats)
    assert summary.startswith("searched 73 configurations (455 more shapes refused by their method): 1 refused once "
                              "built, 16 too stale"), summary
    assert summary.endswith("30 simulated; 3.50 s")
    # --gpu's estimates come first, and the line said only the search's seconds (15 of a 70B tune's 40 s)
    assert search_summary(stats, 15.254).endswith("30 simulated; 3.50 s after 15.25 s of estimates")


def test_tunes_summary_at_80_columns_keeps_its_seconds_with_their_unit():
    """At 80 columns the summary's last line read "...; 23.62" and the next "s": rich wraps at any space, the one
    between a figure and its unit too."""
    from pipesim.commands.tables import print_paragraph
    from pipesim.commands.tune import search_summary
    from pipesim.planning.tune import Stats

    stats = Stats(shapes=528, refused=456, stale=1, over_memory_floor=1, pruned=1, simulated=16_000,
                  simulated_over_limits=6, simulated_leanest=1, seconds=23.62, refused_built=1)
    console = Console(width=80, file=StringIO())
    print_paragraph(search_summary(stats), console)
    lines = console.file.getvalue().splitlines()
    assert lines[-1].endswith("fits; 23.62 s") or lines[-1] == "23.62 s", lines
    assert " ".join(lines) == search_summary(stats) and max(map(len, lines)) <= 80, lines


def test_simulates_tables_separate_thousands_of_ms_and_label_a_method_by_its_shape_in_each():
    """`ms/step 330000000.000` beside memory's "1,288", and --memory's table labelled interleaved-1f1b without
    its "(v=2)", which the main table gives."""
    args = ("simulate", "-s", "interleaved-1f1b", "--fwd", "1e8", "-m", "4", "-n", "1")
    (code, out, err), (memory_code, memory, _) = pipesim(*args), pipesim(*args, "--memory")
    assert code == 0 and memory_code == 0, err
    assert "550,000,011.000*" in out and "550000011" not in out, out
    assert "interleaved-1f1b (v=2)" in " ".join(out.split()) and "interleaved-1f1b (v=2)" in memory, memory


def test_a_what_ifs_memory_replay_shows_a_bar_on_a_terminal(monkeypatch):
    """After the simulations' bar ended, the caching allocator's replay of every device (seconds on the README's 70B,
    in workers or here) left the terminal blank: a bar names it while it runs."""
    screen = _terminal(monkeypatch)
    code, _, err = pipesim("simulate", "--gpu", "a100-sxm-80gb", "--model", "gpt", "--layers", 4, "--width", 64,
                           "--heads", 4, "--seq-len", 32, "--vocab", 128, "-p", 2, "-m", 4, "-s", "1f1b")
    assert code == 0, err
    assert "replaying memory" in screen.getvalue()


def test_a_path_longer_than_the_terminal_stays_whole_in_a_refusal(monkeypatch):
    """A refusal naming a path wider than 80 columns cut it with a newline, so the path copied off the screen was
    two; the terminal wraps such a word itself, and every other word still wraps between words."""
    screen = _terminal(monkeypatch)
    path = "/tmp/a_rather_long_folder_name_for_the_demo/another_long_folder_name_of_a_project_x/trace.json"
    with pytest.raises(SystemExit):
        common.fail(f"cannot read trace file {path}: No such file or directory")
    rows = [row.rstrip() for row in _rows(screen) if row.strip()]
    assert any(path in row for row in rows), rows


def test_the_size_and_parallel_flags_help_says_what_an_hf_config_and_a_t_past_a_node_do():
    """simulate --help said --seq-len is the gpt's alone ("gpt: sequence length (default 128)"), where an hf: config
    needs it, and that --tensor-parallel splits over "t GPUs of a node", where t = 16 on 8-GPU nodes runs across 2
    nodes on their NICs (docs/hardware.md's placement; the costs line says "the tensor-parallel group across 2
    nodes")."""
    code, out, err = pipesim("simulate", "--help")
    words = " ".join(out.split())
    assert code == 0, err
    assert "hf:PATH: the tokens a sample holds, which it needs" in words
    assert "a t above a node's GPUs fills whole nodes and crosses them on their NICs" in words


def test_calibrate_refuses_a_model_whose_weights_outgrow_the_hosts_memory_before_building_it(tmp_path):
    """calibrate builds the model in float32 on the host before moving it: `calibrate --model hf:examples/
    llama3.1-8b` (32 GB of weights) on a 23 GB host ran until the kernel's OOM killer ended it. One decoder layer
    of width 65,536 and a 262,144 MLP holds 77 billion weights, 287 GiB, which no host it runs on has."""
    import json
    from pathlib import Path

    from .helpers import write_config

    llama = json.loads((Path(__file__).parents[1] / "examples" / "llama3.1-8b" / "config.json").read_text())
    wide = write_config(tmp_path / "wide", {**llama, "num_hidden_layers": 1, "hidden_size": 65536,
                                            "intermediate_size": 262144, "num_attention_heads": 512})
    out = tmp_path / "profile.json"
    code, stdout, err = pipesim("calibrate", "--model", f"hf:{wide}", "--seq-len", 64, "--out", out)
    assert code == 2 and stdout == "" and len(err.strip().splitlines()) == 1, err
    assert re.fullmatch(rf"error: hf:{re.escape(str(wide))} does not fit in memory: its 77,074,726,912 weights take "
                        r"287.1 GiB in float32 as it is built on this host, which has [\d.]+ [GMK]iB available; "
                        r"calibrate a smaller config of it \(fewer layers, a narrower width\), or price it without "
                        r"building it: `pipesim estimate --gpu NAME`\n", err), err
    assert not out.exists()


def test_run_refuses_a_model_whose_weights_outgrow_the_hosts_memory_before_building_it(tmp_path):
    """run builds the whole model on the host before its ranks start (and each rank its stages): calibrate's
    refusal held for calibrate alone, and `run --model gpt --layers 64 --width 8192` (192 GiB of weights) built on
    until the host's memory ran out (under an 8 GB cap, 30 CPU s later, "gpt does not fit in memory at micro-batch
    size 8 (--microbatch-size)", which no micro-batch size mends)."""
    trace = tmp_path / "t.json"
    code, stdout, err = pipesim("run", "-s", "1f1b", "--model", "gpt", "--layers", 64, "--width", 8192,
                                "--trace", trace)
    assert code == 2 and stdout == "" and len(err.strip().splitlines()) == 1, err
    assert re.fullmatch(r"error: gpt does not fit in memory: its 51,581,042,688 weights take 192.2 GiB in float32 as "
                        r"it is built on this host, which has [\d.]+ [GMK]iB available; make it smaller \(--layers, "
                        r"--width\), or price it without building it: `pipesim estimate --gpu NAME`\n", err), err
    assert not trace.exists()


def test_tunes_json_gives_the_estimates_seconds_beside_the_searchs():
    """The text summary gives --gpu's estimates' seconds after the search's own; --json gives them too (null for a
    profile, which is estimated before)."""
    gpu = ("--gpu", "h100-sxm", "--model", "gpt", "--layers", 4, "--width", 256, "--heads", 4, "--seq-len", 256)
    for flags, estimated in ((gpu, True), (("--profile", GPT_CPU, "--memory-gb", 0.3), False)):
        code, out, err = pipesim("tune", *flags, "-D", 4, "-s", "1f1b", "--json")
        assert code == 0, err
        search = json.loads(out)["search"]
        assert (search["estimates_seconds"] > 0) if estimated else (search["estimates_seconds"] is None), search
        assert search["seconds"] > 0


def test_compare_and_view_say_they_read_the_traces_on_a_terminal(monkeypatch, tmp_path):
    """Two traces of 16 devices x 4,096 micro-batches took compare 31 s and view 12 s with a blank terminal (a new
    user's pass): a status says what runs until the tables or the page's line."""
    monkeypatch.chdir(tmp_path)
    assert pipesim("simulate", "-s", "1f1b", "-p", "2", "-m", "4", "--trace", "a.json").code == 0
    screen = _terminal(monkeypatch)
    assert pipesim("view", "a.json").code == 0
    assert common.READING_STATUS in screen.getvalue()
    screen = _terminal(monkeypatch)
    assert pipesim("compare", "a.json", "a.json").code == 0  # a prediction against itself: no error
    assert common.READING_STATUS in screen.getvalue()
