"""Every benchmark with a command line refuses a bad flag as pipesim's own commands refuse bad input: one line on
stderr that starts "error: ", exit 2, nothing on stdout and nothing written (benchmarks/one_line_parser.py), where
most printed argparse's usage block and "NAME.py: error: ...". Each runs in this process through its main(argv)."""

from pathlib import Path

import pytest

from tests.conftest import script_module

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
COMMAND_LINES = sorted(path.stem for path in BENCHMARKS.glob("*.py") if '__name__ == "__main__"' in path.read_text())


def test_the_benchmarks_with_a_command_line_are_found():
    assert {"bench_executor", "fidelity", "published_runs", "torch_pipelining"} <= set(COMMAND_LINES)
    assert "one_line_parser" not in COMMAND_LINES


@pytest.mark.parametrize("name", COMMAND_LINES)
def test_a_benchmarks_unknown_flag_is_one_line_exit_2_and_writes_nothing(name, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    with script_module(name) as script, pytest.raises(SystemExit) as exited:
        script.main(["--no-such-flag"])
    out, err = capsys.readouterr()
    assert (exited.value.code, out, len(err.splitlines())) == (2, "", 1), err
    assert err.startswith("error: ")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("name,argv,line", [
    ("contention_settings", ["p.json", "--setting", "a:NO_SUCH=1"],
     "error: argument --setting: calibrate/contention.py has no NO_SUCH (in 'a:NO_SUCH=1')"),
    ("contention_settings", ["p.json", "--setting", "a:WINDOW_S=x"],
     "error: argument --setting: WINDOW_S: give a number (got 'x' in 'a:WINDOW_S=x')"),
    ("contention_settings", ["p.json", "--setting", "a:WINDOW_S=1"],
     "error: cannot read profile p.json: No such file or directory"),
    ("fidelity_sizes", ["--from", "."],
     "error: --from .: no size's profile there (a folder --keep filled holds w64-b8.0.profile.json, ...)"),
    ("bench_auto", ["time", "--sizes", "8x32,4"],
     "error: argument --sizes: give sizes PxM (stages x micro-batches, each at least 1), comma-separated, such as "
     "8x32,32x256 (got '8x32,4')"),
    ("bench_auto", ["time", "--repeats", "0"], "error: argument --repeats: give a whole number of at least 1 (got 0)"),
    ("bench_auto", ["time", "--repeats", "x"],
     "error: argument --repeats: give a whole number of at least 1 (got 'x')"),
    # each said "--ranks must be >= 1 (got 0)" after parsing, in words of its own
    ("bench_executor", ["--ranks", "0"], "error: argument --ranks: give a whole number of at least 1 (got 0)"),
    ("fidelity", ["--repeats", "-1"], "error: argument --repeats: give a whole number of at least 1 (got -1)"),
    ("pass_faults", ["--passes", "9"], "error: argument --passes: give a whole number of at least 10 (got 9)"),
    ("bench_simulate", ["--sizes", "4xa"],
     "error: argument --sizes: give sizes PxM (stages x micro-batches, each at least 1), comma-separated, such as "
     "8x32,32x256 (got '4xa')"),
    ("bench_sweep", ["--workers", "1,two"],
     "error: argument --workers: give whole numbers of at least 1, comma-separated, such as 1,2 (got '1,two')"),
    ("cold_after_wait", ["--rounds", "0"], "error: argument --rounds: give a whole number of at least 1 (got 0)"),
    ("cold_after_wait", ["--stages", "0"], "error: argument --stages: give a whole number of at least 1 (got 0)"),
    ("bench_auto", ["time", "--search-seconds", "-1"],
     "error: argument --search-seconds: give a finite number above 0 (got -1)"),
    ("bench_auto", ["time", "--search-seconds", "1e400"],
     "error: argument --search-seconds: give a finite number above 0 (got 1e400)"),
    ("bench_auto", ["time", "--search-seconds", "soon"],
     "error: argument --search-seconds: give a finite number above 0 (got 'soon')"),
])
def test_a_benchmarks_bad_value_is_one_line_naming_it(name, argv, line, tmp_path, monkeypatch, capsys):
    """contention_settings exited 1 with no "error: " for a constant calibrate/contention.py lacks, and a traceback
    for a value not a number or a profile it cannot read; fidelity_sizes --from a folder with no profile printed
    its line on stdout. bench_auto's and bench_simulate's sizes not PxM, bench_sweep's workers not numbers, a count
    of 0 (repeats, rounds: an empty median; cold_after_wait's stages: a division by zero) and a search budget of no
    time ended in a traceback."""
    monkeypatch.chdir(tmp_path)
    with script_module(name) as script, pytest.raises(SystemExit) as exited:
        script.main(argv)
    assert (exited.value.code, capsys.readouterr()) == (2, ("", line + "\n"))
    assert list(tmp_path.iterdir()) == []


def test_bench_sweeps_grid_the_sweep_refuses_is_its_one_line_exit_2(capfd):
    """bench_sweep passes its grid to `pipesim sweep`, whose refusal of it was followed by a CalledProcessError's
    traceback."""
    with script_module("bench_sweep") as bench, pytest.raises(SystemExit) as exited:
        bench.main(["--workers", "1", "--stages", "a"])
    out, err = capfd.readouterr()
    assert (exited.value.code, out, len(err.splitlines())) == (2, "", 1), err
    assert err.startswith("error: --stages")
