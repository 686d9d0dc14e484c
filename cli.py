"""The `pipesim` command line: the typer app and its entry point. Each command lives in its own module under
commands/ and imports what it needs only when it runs, so `pipesim simulate` starts fast and never imports
torch."""

from __future__ import annotations

import typer

from .commands.calibrate import calibrate
from .commands.common import fail
from .commands.simulate import export, list_schedules, simulate
from .commands.sweep import sweep
from .commands.tune import tune

app = typer.Typer(
    name="pipesim",
    help="Simulate, run and compare pipeline-parallel training schedules.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
app.command()(simulate)
app.command()(calibrate)
app.command()(export)
app.command()(sweep)
app.command("schedules")(list_schedules)
app.command()(tune)


def main(argv: list[str] | None = None) -> None:
    """Console entry point: usage errors become one line and exit code 2, never a traceback."""
    command = typer.main.get_command(app)
    try:
        code = command.main(args=argv, prog_name="pipesim", standalone_mode=False)
    except typer.Abort:
        raise SystemExit(1) from None
    except Exception as exc:
        if not callable(getattr(exc, "format_message", None)):
            raise
        fail(exc.format_message())  # click's usage and parameter errors
    raise SystemExit(code if isinstance(code, int) else 0)


if __name__ == "__main__":
    main()
