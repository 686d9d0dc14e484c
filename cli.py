"""The `pipesim` command line: the typer app and its entry point. Each command lives in its own module under
commands/ and imports what it needs only when it runs, so `pipesim simulate` starts fast and never imports
torch."""

from __future__ import annotations

import typer

from .commands.calibrate import calibrate
from .commands.common import fail, stderr
from .commands.compare import compare
from .commands.count import count
from .commands.estimate import estimate
from .commands.gpus import gpus
from .commands.run import run
from .commands.simulate import export, list_schedules, simulate
from .commands.study import study
from .commands.sweep import sweep
from .commands.tune import tune
from .commands.view import view

app = typer.Typer(
    name="pipesim",
    help="Simulate, run and compare pipeline-parallel training schedules.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,  # plain help: wraps cleanly at 80 columns, and "[[a, b], ...]" is text, not markup
)
app.command()(simulate)
app.command()(calibrate)
app.command()(run)
app.command()(export)
app.command()(sweep)
app.command("schedules")(list_schedules)
app.command()(tune)
app.command()(compare)
app.command()(view)
app.command()(study)
app.command()(count)
app.command()(gpus)
app.command()(estimate)

INTERRUPTED = 130  # 128 + SIGINT, as shells report it


def main(argv: list[str] | None = None) -> None:
    """Console entry point: usage errors become one line and exit code 2, never a traceback; Ctrl-C is one
    line, "interrupted", and exit code 130 (outputs are written whole or not at all)."""
    try:
        command = typer.main.get_command(app)
        code = command.main(args=argv, prog_name="pipesim", standalone_mode=False)
    except KeyboardInterrupt:
        code = INTERRUPTED
    except typer.Abort as exc:  # older typer: click's Abort, from a KeyboardInterrupt among others
        code = INTERRUPTED if isinstance(exc.__cause__, KeyboardInterrupt) else 1
    except Exception as exc:
        if not callable(getattr(exc, "format_message", None)):
            raise
        fail(exc.format_message())  # click's usage and parameter errors
    if code == INTERRUPTED:  # typer turns a KeyboardInterrupt in a command into this exit code
        stderr.print("interrupted", highlight=False)
    raise SystemExit(code if isinstance(code, int) else 0)


if __name__ == "__main__":
    main()
