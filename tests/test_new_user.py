"""What a new user sees on an interactive terminal: nothing that takes seconds leaves the screen blank."""

from io import StringIO

from rich.console import Console

from pipesim.commands import common


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


def test_progress_stays_off_when_quiet(monkeypatch):
    screen = _terminal(monkeypatch)
    assert list(common.progress(["1f1b", "zb-h1"], quiet=True)) == ["1f1b", "zb-h1"]
    assert screen.getvalue() == ""
