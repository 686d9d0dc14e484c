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
